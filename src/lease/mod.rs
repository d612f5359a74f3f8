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
mod error;
mod etcd;
pub mod grants;
mod postgres;
mod redis;
pub mod schedule;
mod shared;

pub use backend::{Acquired, Grant, GrantEvent, GrantEvents, LeaseBackend, LeaseError};

use std::sync::Arc;

use crate::config::{BackendConfig, BackendKind};

/// Opens the backend a config names.
pub async fn open(config: &BackendConfig) -> Result<Arc<dyn LeaseBackend>, LeaseError> {
    let url = || {
        config
            .url
            .as_ref()
            .map(|u| u.expose())
            .ok_or_else(|| LeaseError::Config("this lease backend needs a `url`".into()))
    };
    let tls = |alpn: &[&[u8]]| -> Result<Option<Arc<crate::tls::ClientTls>>, LeaseError> {
        let url_tls = config.url.as_ref().is_some_and(|u| u.is_tls());
        match (&config.tls, url_tls) {
            (Some(files), _) => crate::tls::ClientTls::load(files, "leases.backend.tls", alpn),
            (None, true) => {
                crate::tls::ClientTls::load(&Default::default(), "leases.backend.tls", alpn)
            }
            (None, false) => return Ok(None),
        }
        .map(|tls| Some(Arc::new(tls)))
        .map_err(LeaseError::Config)
    };
    match config.kind {
        BackendKind::Embedded => {
            let path = config.path.as_deref().ok_or_else(|| {
                LeaseError::Config("the embedded lease backend needs a `path`".into())
            })?;
            Ok(Arc::new(embedded::EmbeddedLeases::open(
                path,
                &config.prefix,
            )?))
        }
        BackendKind::Redis => Ok(Arc::new(redis::RedisLeases::new(
            url()?,
            &config.prefix,
            tls(&[])?,
        )?)),
        BackendKind::Postgres => Ok(Arc::new(postgres::PostgresLeases::new(
            url()?,
            &config.prefix,
            tls(&[])?,
        )?)),
        BackendKind::Etcd => Ok(Arc::new(
            etcd::EtcdLeases::connect(url()?, &config.prefix, tls(&[b"h2"])?).await?,
        )),
    }
}
