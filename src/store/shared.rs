//! What every networked store (Redis, PostgreSQL, etcd) shares: a bounded local cache of
//! maxima that answers refusals without a round trip, and a health latch with a background
//! probe that reconnects with backoff.
//!
//! A maximum seen once is a lower bound forever (maxima never decrease), so a token below a
//! cached value is stale no matter what other replicas did since. Admissions always go to the
//! store: only the store knows whether another replica raised the maximum meanwhile.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;

use super::{decide, BoxFuture, FenceStore, StoreError, Verdict};
use crate::config::EqualTokens;
use crate::idempotency::{Begin, Claim, Record};

/// One networked store's compare-and-raise, answered by the store itself, atomically.
pub trait Remote: Send + Sync + 'static {
    fn raise<'a>(
        &'a self,
        resource: &'a str,
        token: u64,
        equal: EqualTokens,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>>;

    fn get<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<u64>, StoreError>>;

    /// A cheap round trip that proves the store answers (and reconnects if needed).
    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>>;

    /// [`FenceStore::begin_idempotent`], answered by the store itself, atomically.
    fn begin_idempotent<'a>(
        &'a self,
        resource: &'a str,
        key: &'a str,
        claim: &'a Claim,
    ) -> BoxFuture<'a, Result<Begin, StoreError>>;

    /// [`FenceStore::finish_idempotent`].
    fn finish_idempotent<'a>(
        &'a self,
        resource: &'a str,
        key: &'a str,
        claim: &'a Claim,
        outcome: &'a Record,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    fn kind(&self) -> &'static str;
}

/// Lower bounds of maxima, at most `capacity` resources.
pub struct BoundedMaxima {
    map: DashMap<Box<str>, u64>,
    capacity: usize,
}

impl BoundedMaxima {
    pub fn new(capacity: usize) -> Self {
        BoundedMaxima {
            map: DashMap::new(),
            capacity,
        }
    }

    pub fn get(&self, resource: &str) -> Option<u64> {
        self.map.get(resource).map(|v| *v)
    }

    /// Records that the maximum is at least `value`.
    pub fn observe(&self, resource: &str, value: u64) {
        if let Some(mut current) = self.map.get_mut(resource) {
            *current = (*current).max(value);
            return;
        }
        if self.capacity == 0 {
            return;
        }
        if self.map.len() >= self.capacity {
            // Any entry will do: the cache only saves round trips, it never decides admission.
            let victim = self.map.iter().next().map(|e| e.key().clone());
            if let Some(victim) = victim {
                self.map.remove(&victim);
            }
        }
        let mut slot = self.map.entry(resource.into()).or_insert(value);
        *slot = (*slot).max(value);
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

pub struct SharedStore<R: Remote> {
    remote: Arc<R>,
    cache: BoundedMaxima,
    healthy: Arc<AtomicBool>,
    /// The health probe; stopped when the store is dropped.
    probe: tokio::task::JoinHandle<()>,
}

/// Probe cadence: every `HEALTHY_PROBE` while healthy; from `MIN_BACKOFF` doubling to
/// `MAX_BACKOFF` while not, so readiness comes back soon after the store does.
const HEALTHY_PROBE: Duration = Duration::from_secs(5);
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

impl<R: Remote> SharedStore<R> {
    /// Wraps a remote; must be called inside a Tokio runtime (it starts the probe task).
    pub fn new(remote: R, cache_capacity: usize) -> Self {
        let remote = Arc::new(remote);
        // Unknown until the first answer; the first probe runs at once.
        let healthy = Arc::new(AtomicBool::new(false));
        let probe = tokio::spawn(probe(Arc::clone(&remote), Arc::clone(&healthy)));
        SharedStore {
            remote,
            cache: BoundedMaxima::new(cache_capacity),
            healthy,
            probe,
        }
    }

    fn record<T>(&self, result: &Result<T, StoreError>) {
        let ok = result.is_ok();
        if self.healthy.swap(ok, Ordering::Relaxed) != ok {
            match result {
                Ok(_) => tracing::info!(store = self.remote.kind(), "fence store reachable again"),
                Err(e) => {
                    tracing::error!(store = self.remote.kind(), error = %e, "fence store unavailable")
                }
            }
        }
    }
}

impl<R: Remote> Drop for SharedStore<R> {
    fn drop(&mut self) {
        self.probe.abort();
    }
}

async fn probe<R: Remote>(remote: Arc<R>, healthy: Arc<AtomicBool>) {
    let mut backoff = MIN_BACKOFF;
    loop {
        let ok = matches!(
            tokio::time::timeout(PROBE_TIMEOUT, remote.ping()).await,
            Ok(Ok(()))
        );
        let was = healthy.swap(ok, Ordering::Relaxed);
        if ok && !was {
            tracing::info!(store = remote.kind(), "fence store reachable");
        }
        let wait = if ok {
            backoff = MIN_BACKOFF;
            HEALTHY_PROBE
        } else {
            let wait = backoff;
            backoff = (backoff * 2).min(MAX_BACKOFF);
            wait
        };
        tokio::time::sleep(wait).await;
    }
}

impl<R: Remote> FenceStore for SharedStore<R> {
    fn compare_and_raise<'a>(
        &'a self,
        resource: &'a str,
        token: u64,
        equal: EqualTokens,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>> {
        if let Some(floor) = self.cache.get(resource) {
            if let stale @ Verdict::Stale { .. } = decide(Some(floor), token, equal) {
                return Box::pin(std::future::ready(Ok(stale)));
            }
        }
        Box::pin(async move {
            let result = self.remote.raise(resource, token, equal).await;
            self.record(&result);
            match &result {
                Ok(Verdict::Admitted { .. }) => self.cache.observe(resource, token),
                Ok(Verdict::Stale { current }) => self.cache.observe(resource, *current),
                Err(_) => {}
            }
            result
        })
    }

    fn current<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<u64>, StoreError>> {
        Box::pin(async move {
            let result = self.remote.get(resource).await;
            self.record(&result);
            result
        })
    }

    fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    fn begin_idempotent<'a>(
        &'a self,
        resource: &'a str,
        key: &'a str,
        claim: &'a Claim,
    ) -> BoxFuture<'a, Result<Begin, StoreError>> {
        // Never answered from the cache: a stale token may still have a record to replay.
        Box::pin(async move {
            let result = self.remote.begin_idempotent(resource, key, claim).await;
            self.record(&result);
            match &result {
                Ok(Begin::Execute { .. }) => self.cache.observe(resource, claim.token),
                Ok(Begin::Stale { current }) => self.cache.observe(resource, *current),
                _ => {}
            }
            result
        })
    }

    fn finish_idempotent<'a>(
        &'a self,
        resource: &'a str,
        key: &'a str,
        claim: &'a Claim,
        outcome: &'a Record,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let result = self
                .remote
                .finish_idempotent(resource, key, claim, outcome)
                .await;
            self.record(&result);
            result
        })
    }

    fn kind(&self) -> &'static str {
        self.remote.kind()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_is_bounded_and_only_rises() {
        let c = BoundedMaxima::new(2);
        c.observe("a", 5);
        c.observe("a", 3);
        assert_eq!(c.get("a"), Some(5));
        c.observe("b", 1);
        c.observe("c", 1);
        assert_eq!(c.len(), 2);
        assert_eq!(c.get("c"), Some(1));
        let none = BoundedMaxima::new(0);
        none.observe("a", 1);
        assert!(none.is_empty());
    }
}
