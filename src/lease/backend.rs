//! The lease backend trait: what a coordination system must answer, atomically.

use std::sync::Arc;
use std::time::Duration;

use crate::config::{BackendConfig, BackendKind};
use crate::store::BoxFuture;

/// A granted lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub resource: String,
    pub holder: String,
    /// Unique per grant (the owner value compared on renew and release).
    pub lease_id: String,
    /// The fencing token: strictly greater than every earlier grant's for this resource.
    pub token: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquired {
    Granted(Grant),
    /// Held by someone else (the holder id when the backend knows it).
    Held {
        holder: Option<String>,
    },
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum LeaseError {
    #[error("the lease backend is unavailable: {0}")]
    Unavailable(String),
}

/// One coordination system's leases. Every method is one atomic step on the backend; none
/// waits or retries (the agent does).
pub trait LeaseBackend: Send + Sync + 'static {
    /// Grants the lease if it is free or expired, with a token above every earlier grant.
    fn try_acquire<'a>(
        &'a self,
        resource: &'a str,
        holder: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LeaseError>>;

    /// Extends the lease by `ttl` if `grant` still owns it; `Ok(false)` if it does not.
    fn renew<'a>(
        &'a self,
        grant: &'a Grant,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, LeaseError>>;

    /// Frees the lease if `grant` still owns it; `Ok(false)` if it did not.
    fn release<'a>(&'a self, grant: &'a Grant) -> BoxFuture<'a, Result<bool, LeaseError>>;

    /// The token of the latest grant for `resource` (held or not), for authoritative fencing.
    fn latest_token<'a>(
        &'a self,
        resource: &'a str,
    ) -> BoxFuture<'a, Result<Option<u64>, LeaseError>>;

    /// Resolves when the lease on `resource` may have become free (released or expired), as
    /// far as the backend's change events tell; backends without events never resolve.
    /// Waiters use it to wake before their backoff ends.
    fn changed<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, ()>;

    fn kind(&self) -> &'static str;
}

/// Opens the backend a config names.
pub async fn open(config: &BackendConfig) -> Result<Arc<dyn LeaseBackend>, LeaseError> {
    let url = || {
        config
            .url
            .as_ref()
            .map(|u| u.expose())
            .ok_or_else(|| LeaseError::Unavailable("this lease backend needs a `url`".into()))
    };
    match config.kind {
        BackendKind::Embedded => {
            let path = config.path.as_deref().ok_or_else(|| {
                LeaseError::Unavailable("the embedded lease backend needs a `path`".into())
            })?;
            Ok(Arc::new(super::embedded::EmbeddedLeases::open(
                path,
                &config.prefix,
            )?))
        }
        BackendKind::Redis => Ok(Arc::new(super::redis::RedisLeases::new(
            url()?,
            &config.prefix,
        )?)),
        BackendKind::Postgres => Ok(Arc::new(super::postgres::PostgresLeases::new(
            url()?,
            &config.prefix,
        )?)),
        BackendKind::Etcd => Ok(Arc::new(
            super::etcd::EtcdLeases::connect(url()?, &config.prefix).await?,
        )),
    }
}
