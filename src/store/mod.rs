//! Where recorded maxima live. Every store implements [`FenceStore`] with one atomic
//! compare-and-raise; the decision itself is the pure [`decide`] (in [`crate::fence::verdict`]),
//! shared by all of them.

pub mod admin;
#[cfg(feature = "embedded")]
mod embedded;
mod error;
#[cfg(feature = "etcd")]
mod etcd;
mod memory;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
pub mod shared;
/// The retention mark and its sweep ([`shared::retention`]), under its usual name.
pub use shared::retention;

use std::sync::Arc;

/// What a [`StoreError`] (and a [`crate::lease::LeaseError`]) is: one error with a kind, a
/// detail and a source.
pub use crate::conn::error::{BackendError, Kind as ErrorKind};
#[cfg(all(test, feature = "embedded"))]
pub(crate) use embedded::parks_here;
#[cfg(feature = "embedded")]
pub use embedded::{defer_wakes_to_park, EmbeddedStore};
pub use error::StoreError;
pub use memory::MemoryStore;

use crate::config::StoreConfig;
// The backends apply the decision; they import it from here.
pub use crate::fence::resource::ResourceId;
pub use crate::fence::token::Token;
pub use crate::fence::verdict::{decide, Rule, Verdict};
use crate::idempotency::{Begin, Claim, Record};

pub use crate::conn::BoxFuture;

/// A place that records, per resource, the highest admitted token.
pub trait FenceStore: Send + Sync + 'static {
    /// Atomically: if `token` passes against the recorded maximum under `rule` (`token.equal`
    /// and `token.max_step`, both decided in the same step that reads the maximum), raise the
    /// maximum to it. Returns only after the raise is as durable as the store promises.
    fn compare_and_raise<'a>(
        &'a self,
        resource: &'a ResourceId,
        token: Token,
        rule: Rule,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>>;

    /// [`FenceStore::compare_and_raise`] answered at once, by a store that needs no waiting
    /// for it (the memory store): no future to box and poll. `None`: ask `compare_and_raise`.
    fn raise_at_once(
        &self,
        _resource: &ResourceId,
        _token: Token,
        _rule: Rule,
    ) -> Option<Result<Verdict, StoreError>> {
        None
    }

    /// The recorded maximum, if any.
    fn current<'a>(
        &'a self,
        resource: &'a ResourceId,
    ) -> BoxFuture<'a, Result<Option<Token>, StoreError>>;

    /// Cheap readiness signal: false once the store is known to be unusable.
    fn healthy(&self) -> bool;

    /// The store's kind as `store.kind` names it (`memory`, `embedded`, `redis`, `postgres`,
    /// `etcd`), for logs and messages.
    fn kind(&self) -> &'static str;

    /// How many resets of maxima (`fencegate fences reset`) this process has seen in the
    /// store since it opened it ([`shared::resets`]); 0 for stores only this process writes.
    fn resets_observed(&self) -> u64 {
        0
    }

    /// Starts forgetting each maximum not raised for `period` (`fence.retention`, which the
    /// config allows only with `fence.authority: leases` and on the stores that implement
    /// this; the others refuse).
    fn forget_after(&self, period: std::time::Duration) -> Result<(), StoreError> {
        let _ = period;
        Err(cannot_forget(self.kind()))
    }

    /// Idempotency, one atomic step: look up the live record of `(resource, key)`, run
    /// [`crate::idempotency::decide`] against it and the resource's maximum, and on
    /// [`Begin::Execute`] raise the maximum and write [`Claim::in_flight`] (living
    /// `claim.window`; the proxy passes at least the upstream timeout plus the store's answers
    /// here, so an in-flight record outlives its attempt; the memory and embedded stores keep
    /// that deadline on the monotonic clock, so a wall-clock step cannot shorten it).
    fn begin_idempotent<'a>(
        &'a self,
        resource: &'a ResourceId,
        key: &'a str,
        claim: &'a Claim,
    ) -> BoxFuture<'a, Result<Begin, StoreError>>;

    /// Replaces the record of `(resource, key)` with `outcome` (living `claim.window` from
    /// now), in one atomic step, only if it still is the `in_flight` record this attempt
    /// wrote ([`Record::owned_by`]: same attempt id, token and fingerprint). Another attempt
    /// with the same token and body owns nothing here. Returns whether it wrote.
    fn finish_idempotent<'a>(
        &'a self,
        resource: &'a ResourceId,
        key: &'a str,
        claim: &'a Claim,
        outcome: &'a Record,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;
}

/// What a store without retention answers [`FenceStore::forget_after`] (the config refuses
/// `fence.retention` for it first).
pub(crate) fn cannot_forget(kind: &str) -> StoreError {
    StoreError::config(format!(
        "the {kind} store cannot forget maxima (fence.retention)"
    ))
}

/// `fence.retention` as the whole milliseconds the stores keep it in (at least 1: 0 means off).
pub(crate) fn retention_ms(period: std::time::Duration) -> u64 {
    u64::try_from(period.as_millis()).unwrap_or(u64::MAX).max(1)
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
    // TLS files are read now, so that a bad one stops `run` with the field's name.
    let tls = |remote, alpn| {
        crate::tls::ClientTls::for_remote(remote, "store.tls", alpn)
            .map_err(|e| StoreError::config(e.to_string()))
    };
    match config {
        StoreConfig::Memory => Ok(Arc::new(MemoryStore::new())),
        #[cfg(feature = "embedded")]
        StoreConfig::Embedded {
            path,
            prefix,
            cache_size,
        } => Ok(Arc::new(EmbeddedStore::open(path, prefix, *cache_size)?)),
        #[cfg(feature = "redis")]
        StoreConfig::Redis { remote, cache_size } => {
            let tls = tls(remote, &[])?;
            let store = self::redis::RedisRemote::new(
                remote.url.expose(),
                &remote.prefix,
                tls,
                &remote.redis,
            )?;
            Ok(Arc::new(shared::SharedStore::with_clock(
                store,
                *cache_size,
                clock,
            )))
        }
        #[cfg(feature = "postgres")]
        StoreConfig::Postgres { remote, cache_size } => {
            let tls = tls(remote, &[])?;
            let store = self::postgres::PostgresRemote::new(
                remote.url.expose(),
                &remote.prefix,
                tls,
                remote.replicas,
            )?;
            store.check_at_start().await?;
            Ok(Arc::new(shared::SharedStore::with_clock(
                store,
                *cache_size,
                clock,
            )))
        }
        #[cfg(feature = "etcd")]
        StoreConfig::Etcd { remote, cache_size } => {
            let tls = tls(remote, &[b"h2"])?;
            let store =
                self::etcd::EtcdRemote::connect(remote.url.expose(), &remote.prefix, tls).await?;
            Ok(Arc::new(shared::SharedStore::with_clock(
                store,
                *cache_size,
                clock,
            )))
        }
        #[allow(unreachable_patterns)]
        other => Err(StoreError::config(crate::config::not_built(other.kind()))),
    }
}

/// Opens the store a config names for `fencegate fences` ([`admin`]): connects (lazily, like
/// [`open`]) and starts no background task: no probe, no retention check, no follower of
/// resets, so it writes nothing but what [`admin::Inspect::reset`] writes. The memory store
/// lives in the process that runs it: there is nothing to open.
pub async fn open_for_admin(config: &StoreConfig) -> Result<Box<dyn admin::Inspect>, StoreError> {
    let tls = |remote, alpn| {
        crate::tls::ClientTls::for_remote(remote, "store.tls", alpn)
            .map_err(|e| StoreError::config(e.to_string()))
    };
    match config {
        StoreConfig::Memory => Err(StoreError::config(
            "the memory store lives inside the fencegate that uses it: nothing to inspect from \
             outside",
        )),
        #[cfg(feature = "embedded")]
        StoreConfig::Embedded { path, prefix, .. } => {
            Ok(Box::new(embedded::EmbeddedAdmin::new(path, prefix)))
        }
        #[cfg(feature = "redis")]
        StoreConfig::Redis { remote, .. } => {
            let tls = tls(remote, &[])?;
            Ok(Box::new(self::redis::RedisRemote::new(
                remote.url.expose(),
                &remote.prefix,
                tls,
                &remote.redis,
            )?))
        }
        #[cfg(feature = "postgres")]
        StoreConfig::Postgres { remote, .. } => {
            let tls = tls(remote, &[])?;
            Ok(Box::new(self::postgres::PostgresRemote::new(
                remote.url.expose(),
                &remote.prefix,
                tls,
                remote.replicas,
            )?))
        }
        #[cfg(feature = "etcd")]
        StoreConfig::Etcd { remote, .. } => {
            let tls = tls(remote, &[b"h2"])?;
            Ok(Box::new(
                self::etcd::EtcdRemote::connect(remote.url.expose(), &remote.prefix, tls).await?,
            ))
        }
        #[allow(unreachable_patterns)]
        other => Err(StoreError::config(crate::config::not_built(other.kind()))),
    }
}
