//! What the fence stores and the lease backends share to reach the systems they keep their
//! state in: the boxed future their traits answer with, and one way per system to connect
//! ([`redis`]: a target and a shared connection that redials; [`postgres`]: a pool and TLS;
//! [`etcd`]: the client's timeouts; [`embedded`]: why a file did not open), and how each reads
//! its url ([`url`], which the config checks urls with at load). Neither family imports the
//! other for these.

#[cfg(feature = "embedded")]
pub mod embedded;
pub mod error;
#[cfg(feature = "etcd")]
pub mod etcd;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis;
pub mod url;

use std::future::Future;
use std::pin::Pin;

/// What the store and lease traits answer with: a boxed future, so the traits stay
/// object-safe.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// How a call to a store or lease backend failed, told from its client's error (each
/// submodule's `failure`); [`crate::store::StoreError::new`] and
/// [`crate::lease::LeaseError::new`] make the variant of the same name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Not reached: connecting, TLS, I/O, a connection that broke.
    Unreachable,
    /// No answer in time.
    Timeout,
    /// The server answered with an error: authentication, permissions, a read-only replica,
    /// a quota.
    Refused,
    /// An answer that does not parse as what was asked for.
    Corrupt,
}
