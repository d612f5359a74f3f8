//! How a running fencegate learns of `fencegate fences reset` in its shared store.
//!
//! A reset lowers (or sets) a recorded maximum, the one change that breaks "maxima never
//! decrease", which the local cache relies on to refuse a token below a cached value without a
//! round trip ([`super`]). So every reset also moves the store's *reset generation* (Redis:
//! `INCR {prefix}:resets`; PostgreSQL: the one row of `{prefix}_resets`; etcd: a put of
//! `/{prefix}/resets`, whose `mod_revision` is the generation), after the maximum is written.
//! Each fencegate reads the generation every [`FOLLOW_EVERY`]; when it changed, it clears its
//! whole cache of maxima (the next write of every resource asks the store) and counts the
//! resets in `fencegate_fence_resets_total`.
//!
//! So a reset reaches every fencegate on the store within [`FOLLOW_EVERY`] plus a round trip.
//! Until then a fencegate may still refuse, from its cache, a token the reset made valid (409,
//! never an admission the reset did not allow: a stale cache only refuses more). A value read
//! from the store before a clear and answered after it is not cached
//! ([`crate::maxima::BoundedMaxima::observe_in`]). The first generation read after start clears
//! the cache too, without counting: a reset between the start and that read is not missed.
//! A failed read is retried at the next tick; the cache keeps refusing meanwhile.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::Remote;
use crate::maxima::BoundedMaxima;

/// How often a fencegate reads its store's reset generation.
pub const FOLLOW_EVERY: Duration = Duration::from_secs(1);

/// What a fencegate has seen of its store's resets.
#[derive(Debug, Default)]
pub struct Resets {
    /// Resets observed since start (generation steps after the first read).
    observed: AtomicU64,
}

impl Resets {
    /// Resets observed since start (steps of the generation after the first read).
    pub fn observed(&self) -> u64 {
        self.observed.load(Ordering::Relaxed)
    }
}

/// What one generation read means: `last` the generation read before (`None`: none yet).
/// Returns whether to clear the cache and how many resets to count.
pub fn step(last: Option<u64>, now: u64) -> (bool, u64) {
    match last {
        None => (true, 0),
        Some(last) if now == last => (false, 0),
        // A generation below the last one: the store's was recreated (a new prefix, a
        // restored backup); the cache is cleared, one reset counted.
        Some(last) => (true, now.checked_sub(last).unwrap_or(1)),
    }
}

/// Follows the generation of `remote` until aborted.
pub async fn follow<R: Remote>(remote: Arc<R>, cache: Arc<BoundedMaxima>, resets: Arc<Resets>) {
    let mut last = None;
    let mut tick = tokio::time::interval(FOLLOW_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = match tokio::time::timeout(FOLLOW_EVERY, remote.reset_generation()).await {
            Ok(Ok(now)) => now,
            // The health probe reports an unreachable store; the next tick tries again.
            Ok(Err(_)) | Err(_) => continue,
        };
        let (clear, counted) = step(last, now);
        if clear {
            resets.observed.fetch_add(counted, Ordering::Relaxed);
            cache.clear();
        }
        if counted > 0 {
            tracing::warn!(
                store = remote.kind(),
                generation = now,
                resets = counted,
                "fence maxima were reset in the store (fencegate fences reset): cache cleared"
            );
        }
        last = Some(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_read_clears_without_counting_and_a_change_counts_its_steps() {
        assert_eq!(step(None, 7), (true, 0));
        assert_eq!(step(Some(7), 7), (false, 0));
        assert_eq!(step(Some(7), 9), (true, 2));
        assert_eq!(step(Some(9), 0), (true, 1));
    }
}
