//! What the fence stores and the lease backends share to reach the systems they keep their
//! state in: the boxed future their traits answer with, and one way per system to connect
//! ([`redis`]: a target and a shared connection that redials; [`postgres`]: a pool and TLS;
//! [`etcd`]: the url form and the client's timeouts). Neither family imports the other for
//! these.

pub mod etcd;
pub mod postgres;
pub mod redis;

use std::future::Future;
use std::pin::Pin;

/// What the store and lease traits answer with: a boxed future, so the traits stay
/// object-safe.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
