//! The lease agent: leases acquired, renewed and released for the app, behind one backend
//! trait with one file per backend.
//!
//! A backend only answers single questions atomically (grant, renew, release, latest token).
//! Timing (backoff, renewal schedule, the local validity deadline) lives in the agent, on the
//! monotonic clock, so every backend gets it right once.
//!
//! Authoritative fencing reads the latest grant through [`grants::GrantCache`], kept current
//! by the backends' grant events.

pub mod admin;
pub mod agent;
#[cfg(feature = "proxy")]
pub mod api;
pub mod backend;
#[cfg(feature = "embedded")]
mod embedded;
mod error;
#[cfg(feature = "etcd")]
mod etcd;
pub mod grants;
#[cfg(test)]
mod model;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
pub mod schedule;
mod shared;

pub use backend::{Acquired, Grant, GrantEvent, GrantEvents, LeaseBackend, LeaseError};

use std::sync::Arc;

use crate::config::BackendConfig;

/// Opens the backend a config names.
pub async fn open(config: &BackendConfig) -> Result<Arc<dyn LeaseBackend>, LeaseError> {
    // TLS files are read now, so that a bad one stops `run` with the field's name.
    let tls = |remote, alpn| {
        crate::tls::ClientTls::for_remote(remote, "leases.backend.tls", alpn)
            .map_err(|e| LeaseError::config(e.to_string()))
    };
    match config {
        #[cfg(feature = "embedded")]
        BackendConfig::Embedded { path, prefix } => {
            Ok(Arc::new(embedded::EmbeddedLeases::open(path, prefix)?))
        }
        #[cfg(feature = "redis")]
        BackendConfig::Redis(remote) => Ok(Arc::new(redis::RedisLeases::new(
            remote.url.expose(),
            &remote.prefix,
            tls(remote, &[])?,
            &remote.redis,
        )?)),
        #[cfg(feature = "postgres")]
        BackendConfig::Postgres(remote) => {
            let leases = postgres::PostgresLeases::new(
                remote.url.expose(),
                &remote.prefix,
                tls(remote, &[])?,
                remote.replicas,
            )?;
            leases.check_at_start().await?;
            Ok(Arc::new(leases))
        }
        #[cfg(feature = "etcd")]
        BackendConfig::Etcd(remote) => Ok(Arc::new(
            etcd::EtcdLeases::connect(remote.url.expose(), &remote.prefix, tls(remote, &[b"h2"])?)
                .await?,
        )),
        #[allow(unreachable_patterns)]
        other => Err(LeaseError::config(crate::config::not_built(other.kind()))),
    }
}

/// Opens the backend a config names for `fencegate leases` ([`admin`]): it only reads, and
/// starts nothing (no event subscription, no table set-up, no start-up check).
pub async fn open_for_admin(
    config: &BackendConfig,
) -> Result<Box<dyn admin::InspectLeases>, LeaseError> {
    let tls = |remote, alpn| {
        crate::tls::ClientTls::for_remote(remote, "leases.backend.tls", alpn)
            .map_err(|e| LeaseError::config(e.to_string()))
    };
    match config {
        #[cfg(feature = "embedded")]
        BackendConfig::Embedded { path, prefix } => {
            Ok(Box::new(embedded::EmbeddedLeasesAdmin::new(path, prefix)))
        }
        #[cfg(feature = "redis")]
        BackendConfig::Redis(remote) => Ok(Box::new(redis::RedisLeases::new(
            remote.url.expose(),
            &remote.prefix,
            tls(remote, &[])?,
            &remote.redis,
        )?)),
        #[cfg(feature = "postgres")]
        BackendConfig::Postgres(remote) => Ok(Box::new(postgres::PostgresLeases::new(
            remote.url.expose(),
            &remote.prefix,
            tls(remote, &[])?,
            remote.replicas,
        )?)),
        #[cfg(feature = "etcd")]
        BackendConfig::Etcd(remote) => Ok(Box::new(
            etcd::EtcdLeases::connect(remote.url.expose(), &remote.prefix, tls(remote, &[b"h2"])?)
                .await?,
        )),
        #[allow(unreachable_patterns)]
        other => Err(LeaseError::config(crate::config::not_built(other.kind()))),
    }
}
