//! Where recorded maxima live. Every store implements [`FenceStore`] with one atomic
//! compare-and-raise; the decision itself is the pure [`decide`] (in [`crate::fence::verdict`]),
//! shared by all of them.

mod embedded;
mod error;
mod etcd;
mod memory;
mod postgres;
mod redis;
pub mod shared;

use std::sync::Arc;

#[cfg(test)]
pub(crate) use embedded::parks_here;
pub use embedded::{defer_wakes_to_park, EmbeddedStore};
pub use error::StoreError;
pub use memory::MemoryStore;

use crate::config::{EqualTokens, StoreConfig, StoreKind};
// The backends apply the decision; they import it from here.
pub use crate::fence::verdict::{decide, Verdict};
use crate::idempotency::{Begin, Claim, Record};

pub use crate::conn::BoxFuture;

/// A place that records, per resource, the highest admitted token.
pub trait FenceStore: Send + Sync + 'static {
    /// Atomically: if `token` passes against the recorded maximum, raise the maximum to it.
    /// Returns only after the raise is as durable as the store promises.
    fn compare_and_raise<'a>(
        &'a self,
        resource: &'a str,
        token: u64,
        equal: EqualTokens,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>>;

    /// [`FenceStore::compare_and_raise`] answered at once, by a store that needs no waiting
    /// for it (the memory store): no future to box and poll. `None`: ask `compare_and_raise`.
    fn raise_at_once(
        &self,
        _resource: &str,
        _token: u64,
        _equal: EqualTokens,
    ) -> Option<Result<Verdict, StoreError>> {
        None
    }

    /// The recorded maximum, if any.
    fn current<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<u64>, StoreError>>;

    /// Cheap readiness signal: false once the store is known to be unusable.
    fn healthy(&self) -> bool;

    fn kind(&self) -> &'static str;

    /// Starts forgetting each maximum not raised for `period` (`fence.retention`, which the
    /// config allows only with `fence.authority: leases` and on the stores that implement
    /// this; the others refuse).
    fn forget_after(&self, period: std::time::Duration) -> Result<(), StoreError> {
        let _ = period;
        Err(StoreError::Config(format!(
            "the {} store cannot forget maxima (fence.retention)",
            self.kind()
        )))
    }

    /// Idempotency, one atomic step: look up the live record of `(resource, key)`, run
    /// [`crate::idempotency::decide`] against it and the resource's maximum, and on
    /// [`Begin::Execute`] raise the maximum and write [`Claim::in_flight`] (living
    /// `claim.window`; the proxy passes at least the upstream timeout plus the store's answers
    /// here, so an in-flight record outlives its attempt; the memory and embedded stores keep
    /// that deadline on the monotonic clock, so a wall-clock step cannot shorten it).
    fn begin_idempotent<'a>(
        &'a self,
        resource: &'a str,
        key: &'a str,
        claim: &'a Claim,
    ) -> BoxFuture<'a, Result<Begin, StoreError>>;

    /// Replaces the record of `(resource, key)` with `outcome` (living `claim.window` from
    /// now), in one atomic step, only if it still is the `in_flight` record this attempt
    /// wrote ([`Record::owned_by`]: same attempt id, token and fingerprint). Another attempt
    /// with the same token and body owns nothing here. Returns whether it wrote.
    fn finish_idempotent<'a>(
        &'a self,
        resource: &'a str,
        key: &'a str,
        claim: &'a Claim,
        outcome: &'a Record,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;
}

/// The store key of an idempotency record: resource and key, separated by a byte neither
/// can contain (resource ids and keys are visible ASCII or escaped).
pub fn record_key(resource: &str, key: &str) -> String {
    format!("{resource}\u{1f}{key}")
}

/// Opens the store a config names. Networked stores connect lazily: an unreachable store
/// makes fencegate not ready (and its writes 503), not fail to start.
pub async fn open(config: &StoreConfig) -> Result<Arc<dyn FenceStore>, StoreError> {
    open_with_clock(config, shared::monotonic()).await
}

/// [`open`], with the monotonic clock the networked stores time in-flight idempotency records
/// by ([`shared`]); the memory and embedded stores keep their own. For tests.
pub async fn open_with_clock(
    config: &StoreConfig,
    clock: shared::Clock,
) -> Result<Arc<dyn FenceStore>, StoreError> {
    let url = || {
        config
            .url
            .as_ref()
            .map(|u| u.expose())
            .expect("networked stores always have a url after validation")
    };
    let cache = config.cache_size;
    // TLS files are read now, so that a bad one stops `run` with the field's name.
    let tls = |alpn: &[&[u8]]| -> Result<Option<Arc<crate::tls::ClientTls>>, StoreError> {
        let url_tls = config.url.as_ref().is_some_and(|u| u.is_tls());
        match (&config.tls, url_tls) {
            (Some(files), _) => crate::tls::ClientTls::load(files, "store.tls", alpn),
            (None, true) => crate::tls::ClientTls::load(&Default::default(), "store.tls", alpn),
            (None, false) => return Ok(None),
        }
        .map(|tls| Some(Arc::new(tls)))
        .map_err(StoreError::Config)
    };
    match config.kind {
        StoreKind::Memory => Ok(Arc::new(MemoryStore::new())),
        StoreKind::Embedded => {
            let path = config
                .path
                .as_deref()
                .expect("the embedded store always has a path after validation");
            Ok(Arc::new(EmbeddedStore::open(path, &config.prefix, cache)?))
        }
        StoreKind::Redis => {
            let remote = self::redis::RedisRemote::new(url(), &config.prefix, tls(&[])?)?;
            Ok(Arc::new(shared::SharedStore::with_clock(
                remote, cache, clock,
            )))
        }
        StoreKind::Postgres => {
            let remote = self::postgres::PostgresRemote::new(url(), &config.prefix, tls(&[])?)?;
            Ok(Arc::new(shared::SharedStore::with_clock(
                remote, cache, clock,
            )))
        }
        StoreKind::Etcd => {
            let remote =
                self::etcd::EtcdRemote::connect(url(), &config.prefix, tls(&[b"h2"])?).await?;
            Ok(Arc::new(shared::SharedStore::with_clock(
                remote, cache, clock,
            )))
        }
    }
}
