//! The lease agent: leases acquired, renewed and released for the app, behind one backend
//! trait with one file per backend.
//!
//! A backend only answers single questions atomically (grant, renew, release, latest token).
//! Timing (backoff, renewal schedule, the local validity deadline) lives in the agent, on the
//! monotonic clock, so every backend gets it right once.
//!
//! Authoritative fencing reads the latest grant through [`grants::GrantCache`], kept current
//! by the backends' grant events.

pub mod agent;
pub mod api;
pub mod backend;
mod embedded;
mod etcd;
pub mod grants;
mod postgres;
mod redis;
pub mod schedule;

pub use backend::{open, Acquired, Grant, GrantEvent, GrantEvents, LeaseBackend, LeaseError};
