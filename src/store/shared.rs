//! What every networked store (Redis, PostgreSQL, etcd) shares: a bounded local cache of
//! maxima that answers refusals without a round trip, and a health latch with a background
//! probe that reconnects with backoff.
//!
//! A maximum seen once is a lower bound forever (maxima never decrease), so a token below a
//! cached value is stale no matter what other replicas did since. Admissions always go to the
//! store: only the store knows whether another replica raised the maximum meanwhile.
//!
//! In-flight idempotency records in Redis and PostgreSQL carry no server-side expiry: the
//! server's wall clock may step forward while the attempt runs, and a retry would then
//! execute beside it. Their end is timed here instead, on this process's monotonic clock
//! ([`InFlightSightings`]): a record whose owning attempt is still in flight a whole in-flight
//! lifetime after this process first saw it so is taken over by the next claim, and the store
//! checks, in the same atomic step as the claim, that the record still names that attempt.
//! The first sighting is no earlier than the attempt's start, so the takeover is never early,
//! whatever any wall clock does.

pub mod batch;
pub mod resets;
pub mod retention;
use crate::fence::resource::ResourceId;
use crate::fence::token::Token;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::{decide, BoxFuture, FenceStore, Rule, StoreError, Verdict};
use crate::idempotency::{AttemptId, Begin, Claim, Record};
use crate::maxima::BoundedMaxima;

use crate::sync::Locked;
use retention::Guard;

/// The monotonic clock in-flight records are timed by: `Instant::now` but in tests.
pub type Clock = Arc<dyn Fn() -> Instant + Send + Sync>;

/// The clock of a running fencegate.
pub fn monotonic() -> Clock {
    Arc::new(Instant::now)
}

/// Whose the `in_flight` record a claim found is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    /// The attempt the record names.
    pub attempt: AttemptId,
    /// The in-flight lifetime the owner claimed with (its `claim.window`), when the record
    /// says.
    pub lifetime: Option<Duration>,
}

/// A remote's answer to a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claimed {
    /// The answer, as [`FenceStore::begin_idempotent`] gives it.
    pub begin: Begin,
    /// With [`Begin::InFlight`]: the attempt that owns the record, `None` when it names none
    /// (written before attempts had ids: it keeps the server-side expiry it was written with)
    /// or the store expires in-flight records itself (etcd).
    pub owner: Option<Owner>,
    /// Whether the claim took over (replaced or deleted) the record of the attempt named by
    /// `takeover`.
    pub took_over: bool,
}

impl From<Begin> for Claimed {
    fn from(begin: Begin) -> Self {
        Claimed {
            begin,
            owner: None,
            took_over: false,
        }
    }
}

/// One networked store's compare-and-raise, answered by the store itself, atomically.
pub trait Remote: Send + Sync + 'static {
    /// [`FenceStore::compare_and_raise`] of `resource` under `rule`, in one atomic step on the
    /// store.
    fn raise<'a>(
        &'a self,
        resource: &'a str,
        token: Token,
        rule: Rule,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>>;

    /// Most raises [`Remote::raise_many`] takes in one call; 1 (the default): it takes
    /// none, and every raise is a call of its own. A remote that takes batches may turn this
    /// to 1 later (an etcd that refuses them): raises then go around the queue.
    fn batch_limit(&self) -> usize {
        1
    }

    /// [`Remote::raise`] of each of `raises` (distinct resources, none with a
    /// [`Rule::floor`]) in one call to the store, each decided by its own rule and answered
    /// on its own account ([`batch`]). An `Err` is the whole call's failure, and says that
    /// none of them took effect: the raises are then sent again, each alone, if the server
    /// refused the call. Once any may have taken effect, errors are answered raise by raise.
    /// The default raises them one by one.
    fn raise_many<'a>(
        &'a self,
        raises: &'a [batch::Raise],
    ) -> BoxFuture<'a, Result<Vec<Result<Verdict, StoreError>>, StoreError>> {
        Box::pin(async move {
            let mut verdicts = Vec::with_capacity(raises.len());
            for r in raises {
                verdicts.push(self.raise(&r.resource, r.token, r.rule).await);
            }
            Ok(verdicts)
        })
    }

    /// The maximum the store records for `resource`, if any.
    fn get<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<Token>, StoreError>>;

    /// A cheap round trip that proves the store answers (and reconnects if needed).
    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>>;

    /// [`FenceStore::begin_idempotent`], answered by the store itself, atomically. With
    /// `takeover`, an `in_flight` record owned by that attempt counts as absent (its owner is
    /// presumed dead) and is replaced or deleted in the same atomic step; a record owned by
    /// any other attempt, or none, is left as it is. An `in_flight` record this writes has no
    /// server-side expiry (but in etcd, whose leases the leader times on its monotonic clock).
    fn begin_idempotent<'a>(
        &'a self,
        resource: &'a str,
        key: &'a str,
        claim: &'a Claim,
        takeover: Option<AttemptId>,
    ) -> BoxFuture<'a, Result<Claimed, StoreError>>;

    /// [`FenceStore::finish_idempotent`].
    fn finish_idempotent<'a>(
        &'a self,
        resource: &'a str,
        key: &'a str,
        claim: &'a Claim,
        outcome: &'a Record,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// The store's kind as `store.kind` names it (`redis`, `postgres`, `etcd`).
    fn kind(&self) -> &'static str;

    /// See [`FenceStore::forget_after`]; the default refuses.
    fn forget_after(&self, period: std::time::Duration) -> Result<(), StoreError> {
        let _ = period;
        Err(super::cannot_forget(self.kind()))
    }

    /// Whether this store can forget maxima, and so keeps the retention mark
    /// ([`super::retention`]); the methods below are called only if it does.
    fn forgets(&self) -> bool {
        false
    }

    /// The period [`Remote::forget_after`] set, if any.
    fn retention(&self) -> Option<Duration> {
        None
    }

    /// A run with retention: writes the mark with `value` (a new one each time), and once it
    /// is written ages the raises sent within [`retention::FRESH`] of this call.
    fn mark<'a>(&'a self, value: &'a str) -> BoxFuture<'a, Result<(), StoreError>> {
        let _ = value;
        Box::pin(std::future::ready(Err(super::cannot_forget(self.kind()))))
    }

    /// The store's reset generation ([`resets`]): how many times `fencegate fences reset`
    /// changed a maximum here (0: never).
    fn reset_generation(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(std::future::ready(Ok(0)))
    }

    /// The mark's value, if a run with retention left one.
    fn read_mark(&self) -> BoxFuture<'_, Result<Option<String>, StoreError>> {
        Box::pin(std::future::ready(Ok(None)))
    }

    /// Deletes the mark if it still holds `value`; whether it did.
    fn unmark<'a>(&'a self, value: &'a str) -> BoxFuture<'a, Result<bool, StoreError>> {
        let _ = value;
        Box::pin(std::future::ready(Ok(false)))
    }

    /// Takes every maximum's age away (they are kept for good until a run with retention
    /// raises them); how many had one.
    fn keep_all(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(std::future::ready(Ok(0)))
    }
}

/// Most in-flight records whose first sighting is remembered; more are forgotten (any one:
/// forgetting only postpones a takeover).
const SIGHTINGS: usize = 65_536;

/// Per `(resource, key)`: the attempt last seen owning its `in_flight` record and when this
/// process first saw it so, on the monotonic clock. At most `capacity` records.
pub struct InFlightSightings {
    map: Mutex<std::collections::HashMap<String, Sighting>>,
    capacity: usize,
}

#[derive(Debug, Clone, Copy)]
struct Sighting {
    attempt: AttemptId,
    /// When the record may be taken over: first sighting plus the longer of the owner's and
    /// the observer's in-flight lifetimes; `None` when that does not fit in an `Instant`.
    deadline: Option<Instant>,
    /// The lifetime the deadline adds, to tell when an entry is stale.
    lifetime: Duration,
}

impl InFlightSightings {
    /// Remembers the sightings of up to `capacity` records (0: none).
    pub fn new(capacity: usize) -> Self {
        InFlightSightings {
            map: Mutex::new(std::collections::HashMap::new()),
            capacity,
        }
    }

    /// The attempt a claim of `record` at `now` may take over: the one seen owning it since
    /// at least its deadline.
    pub fn takeover(&self, record: &str, now: Instant) -> Option<AttemptId> {
        let map = self.map.locked();
        let seen = map.get(record)?;
        seen.deadline
            .is_some_and(|deadline| now >= deadline)
            .then_some(seen.attempt)
    }

    /// A claim at `now` found `record` in flight, owned by `owner`; `lifetime` is the
    /// claimant's in-flight lifetime. A new owner starts a new sighting; the same owner keeps
    /// the first one, its deadline only ever moving later.
    pub fn in_flight(&self, record: &str, owner: Owner, lifetime: Duration, now: Instant) {
        let lifetime = owner.lifetime.map_or(lifetime, |l| l.max(lifetime));
        let mut map = self.map.locked();
        if let Some(seen) = map.get_mut(record) {
            if seen.attempt == owner.attempt {
                if lifetime > seen.lifetime {
                    // First sighting = deadline - lifetime; move the deadline with the
                    // longer lifetime (a missing deadline stays missing: never).
                    seen.deadline = seen
                        .deadline
                        .and_then(|d| d.checked_add(lifetime - seen.lifetime));
                    seen.lifetime = lifetime;
                }
                return;
            }
        }
        if self.capacity == 0 {
            return;
        }
        if map.len() >= self.capacity && !map.contains_key(record) {
            map.retain(|_, seen| !seen.stale(now));
            if map.len() >= self.capacity {
                let victim = map.keys().next().cloned();
                if let Some(victim) = victim {
                    map.remove(&victim);
                }
            }
        }
        map.insert(
            record.to_owned(),
            Sighting {
                attempt: owner.attempt,
                deadline: now.checked_add(lifetime),
                lifetime,
            },
        );
    }

    /// A claim found `record` not in flight (or in flight for nobody): forget it.
    pub fn settled(&self, record: &str) {
        self.map.locked().remove(record);
    }

    /// Records whose sighting is remembered.
    pub fn len(&self) -> usize {
        self.map.locked().len()
    }

    /// Whether no sighting is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Sighting {
    /// Past its deadline by another lifetime without a claim taking it over: nobody asks for
    /// the key, so the entry is only memory (forgetting it postpones a takeover, no more).
    fn stale(&self, now: Instant) -> bool {
        self.deadline
            .and_then(|d| d.checked_add(self.lifetime))
            .is_some_and(|stale| now >= stale)
    }
}

/// The [`FenceStore`] of a networked store: its [`Remote`] behind the local cache of maxima,
/// the health latch and its probe, the retention guard and the follower of resets.
pub struct SharedStore<R: Remote> {
    remote: Arc<R>,
    /// Shared with the follower of resets, which clears it.
    cache: Arc<BoundedMaxima>,
    sightings: InFlightSightings,
    clock: Clock,
    health: Arc<Health>,
    /// The health probe; stopped when the store is dropped.
    probe: tokio::task::JoinHandle<()>,
    /// What admissions wait for on a store that can forget ([`super::retention`]).
    guard: Arc<Guard>,
    /// The guard's checks; stopped when the store is dropped.
    checks: Option<tokio::task::JoinHandle<()>>,
    /// Resets seen by `follow`.
    resets: Arc<resets::Resets>,
    /// Follows the store's reset generation ([`resets`]); stopped when the store is dropped.
    follow: tokio::task::JoinHandle<()>,
    /// The queue that sends concurrent raises together, when the remote takes batches.
    batcher: Option<batch::Batcher>,
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
        Self::with_clock(remote, cache_capacity, monotonic())
    }

    /// [`SharedStore::new`], timing in-flight records by `clock`.
    pub fn with_clock(remote: R, cache_capacity: usize, clock: Clock) -> Self {
        let remote = Arc::new(remote);
        // Unknown until the first answer; the first probe runs at once.
        let health = Arc::new(Health::new(remote.kind()));
        let probe = tokio::spawn(probe(Arc::clone(&remote), Arc::clone(&health)));
        let guard = Guard::new(remote.forgets(), Arc::clone(&clock));
        let checks = remote
            .forgets()
            .then(|| tokio::spawn(Arc::clone(&guard).run(Arc::clone(&remote))));
        let cache = Arc::new(BoundedMaxima::new(cache_capacity));
        let seen = Arc::new(resets::Resets::default());
        let follow = tokio::spawn(resets::follow(
            Arc::clone(&remote),
            Arc::clone(&cache),
            Arc::clone(&seen),
        ));
        let batcher =
            (remote.batch_limit() > 1).then(|| batch::Batcher::start(Arc::clone(&remote)));
        SharedStore {
            remote,
            cache,
            sightings: InFlightSightings::new(SIGHTINGS),
            clock,
            health,
            probe,
            guard,
            checks,
            resets: seen,
            follow,
            batcher,
        }
    }

    /// The remote's compare-and-raise, sent with others when the remote takes batches. A
    /// raise with a floor (`token.max_step`) is always sent alone, and so is every raise once
    /// the remote stopped taking batches.
    async fn raise(
        &self,
        resource: &ResourceId,
        token: Token,
        rule: Rule,
    ) -> Result<Verdict, StoreError> {
        match &self.batcher {
            Some(batcher) if rule.floor(token).is_none() && self.remote.batch_limit() > 1 => {
                let resource = resource.as_ref().to_owned();
                batcher
                    .raise(batch::Raise {
                        resource,
                        token,
                        rule,
                    })
                    .await
            }
            _ => self.remote.raise(resource, token, rule).await,
        }
    }

    fn record<T>(&self, result: &Result<T, StoreError>) {
        self.health.set(result.as_ref().err());
    }
}

/// The health latch: unknown until the first answer, then healthy or not. One log line when
/// it changes (with the cause when the store becomes unavailable), however many requests and
/// probes fail in between: a wrong password or CA says so once, not once per retry.
struct Health {
    state: AtomicU8,
    kind: &'static str,
}

const UNKNOWN: u8 = 0;
const HEALTHY: u8 = 1;
const UNHEALTHY: u8 = 2;

impl Health {
    fn new(kind: &'static str) -> Self {
        Health {
            state: AtomicU8::new(UNKNOWN),
            kind,
        }
    }

    fn healthy(&self) -> bool {
        self.state.load(Ordering::Relaxed) == HEALTHY
    }

    fn set(&self, error: Option<&StoreError>) {
        let new = if error.is_some() { UNHEALTHY } else { HEALTHY };
        let old = self.state.swap(new, Ordering::Relaxed);
        match (old, error) {
            (HEALTHY, None) | (UNHEALTHY, Some(_)) => {}
            (UNKNOWN, None) => tracing::info!(store = self.kind, "fence store reachable"),
            (_, None) => tracing::info!(store = self.kind, "fence store reachable again"),
            (_, Some(e)) => {
                tracing::error!(
                    store = self.kind,
                    error = %e,
                    store_error = e.label(),
                    "fence store unavailable"
                )
            }
        }
    }
}

impl<R: Remote> Drop for SharedStore<R> {
    fn drop(&mut self) {
        self.probe.abort();
        self.follow.abort();
        if let Some(checks) = &self.checks {
            checks.abort();
        }
    }
}

async fn probe<R: Remote>(remote: Arc<R>, health: Arc<Health>) {
    let mut backoff = MIN_BACKOFF;
    loop {
        let error = match tokio::time::timeout(PROBE_TIMEOUT, remote.ping()).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(_) => Some(StoreError::timeout(format!(
                "no answer to a probe within {}ms",
                PROBE_TIMEOUT.as_millis()
            ))),
        };
        let ok = error.is_none();
        health.set(error.as_ref());
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
        resource: &'a ResourceId,
        token: Token,
        rule: Rule,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>> {
        // Only a stale verdict may come from the cache: a cached value is a lower bound, so a
        // token too far above it may still be within the step of the store's maximum.
        if let Some(floor) = self.cache.get(resource) {
            if let stale @ Verdict::Stale { .. } = decide(Some(floor), token, rule) {
                return Box::pin(std::future::ready(Ok(stale)));
            }
        }
        Box::pin(async move {
            self.guard.admit().await?;
            let era = self.cache.era();
            let result = self.raise(resource, token, rule).await;
            self.record(&result);
            match &result {
                Ok(Verdict::Admitted { .. }) => self.cache.observe_in(era, resource, token),
                Ok(Verdict::Stale { current })
                | Ok(Verdict::TooFar {
                    current: Some(current),
                }) => self.cache.observe_in(era, resource, *current),
                Ok(Verdict::TooFar { current: None }) | Err(_) => {}
            }
            result
        })
    }

    fn current<'a>(
        &'a self,
        resource: &'a ResourceId,
    ) -> BoxFuture<'a, Result<Option<Token>, StoreError>> {
        Box::pin(async move {
            let result = self.remote.get(resource).await;
            self.record(&result);
            result
        })
    }

    fn healthy(&self) -> bool {
        self.health.healthy() && !self.guard.failed()
    }

    fn begin_idempotent<'a>(
        &'a self,
        resource: &'a ResourceId,
        key: &'a str,
        claim: &'a Claim,
    ) -> BoxFuture<'a, Result<Begin, StoreError>> {
        // Never answered from the cache: a stale token may still have a record to replay.
        Box::pin(async move {
            self.guard.admit().await?;
            let record = super::record_key(resource, key);
            let takeover = self.sightings.takeover(&record, (self.clock)());
            let era = self.cache.era();
            let result = self
                .remote
                .begin_idempotent(resource, key, claim, takeover)
                .await;
            self.record(&result);
            let Claimed {
                begin,
                owner,
                took_over,
            } = result?;
            match (&begin, owner) {
                (Begin::InFlight, Some(owner)) => {
                    // Read after the answer: a sighting is never earlier than the store saw it.
                    self.sightings
                        .in_flight(&record, owner, claim.window, (self.clock)())
                }
                // The error case leaves the sighting: the record is as it was, or taken over.
                _ => self.sightings.settled(&record),
            }
            if let Some(attempt) = takeover.filter(|_| took_over) {
                tracing::warn!(
                    resource = resource.as_str(),
                    attempt = %attempt.hex(),
                    "idempotency record taken over: its attempt was still in flight a whole \
                     in-flight lifetime after it was first seen (did its fencegate die?)"
                );
            }
            match &begin {
                Begin::Execute { .. } => self.cache.observe_in(era, resource, claim.token),
                Begin::Stale { current }
                | Begin::TooFar {
                    current: Some(current),
                } => self.cache.observe_in(era, resource, *current),
                _ => {}
            }
            Ok(begin)
        })
    }

    fn finish_idempotent<'a>(
        &'a self,
        resource: &'a ResourceId,
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

    fn forget_after(&self, period: std::time::Duration) -> Result<(), StoreError> {
        self.remote.forget_after(period)?;
        self.guard.restart();
        Ok(())
    }

    fn kind(&self) -> &'static str {
        self.remote.kind()
    }

    fn resets_observed(&self) -> u64 {
        self.resets.observed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(n: u128, lifetime: Option<u64>) -> Owner {
        Owner {
            attempt: AttemptId(n),
            lifetime: lifetime.map(Duration::from_secs),
        }
    }

    #[test]
    fn a_takeover_waits_a_lifetime_from_the_first_sighting_of_the_same_attempt() {
        let s = InFlightSightings::new(8);
        let t0 = Instant::now();
        let at = |secs| t0 + Duration::from_secs(secs);
        let minute = Duration::from_secs(60);
        assert_eq!(s.takeover("k", t0), None);
        s.in_flight("k", owner(1, None), minute, t0);
        // Seen again later: the first sighting stands.
        s.in_flight("k", owner(1, None), minute, at(30));
        assert_eq!(s.takeover("k", at(59)), None);
        assert_eq!(s.takeover("k", at(60)), Some(AttemptId(1)));
        // The owner's longer lifetime, learnt later, still counts from the first sighting.
        s.in_flight("k", owner(1, Some(90)), minute, at(60));
        assert_eq!(s.takeover("k", at(89)), None);
        assert_eq!(s.takeover("k", at(90)), Some(AttemptId(1)));
        // Another attempt starts over.
        s.in_flight("k", owner(2, None), minute, at(90));
        assert_eq!(s.takeover("k", at(149)), None);
        assert_eq!(s.takeover("k", at(150)), Some(AttemptId(2)));
        s.settled("k");
        assert_eq!(s.takeover("k", at(1000)), None);
        // A lifetime past what an Instant holds: never.
        s.in_flight("f", owner(3, None), Duration::MAX, t0);
        assert_eq!(s.takeover("f", at(1_000_000_000)), None);
    }

    #[test]
    fn sightings_are_bounded_and_stale_ones_go_first() {
        let s = InFlightSightings::new(2);
        let t0 = Instant::now();
        let minute = Duration::from_secs(60);
        s.in_flight("old", owner(1, None), minute, t0);
        s.in_flight("new", owner(2, None), minute, t0 + Duration::from_secs(100));
        // "old" is past its deadline by a lifetime at 120s: it goes, "new" stays.
        s.in_flight(
            "third",
            owner(3, None),
            minute,
            t0 + Duration::from_secs(120),
        );
        assert_eq!(s.len(), 2);
        assert_eq!(
            s.takeover("new", t0 + Duration::from_secs(160)),
            Some(AttemptId(2))
        );
        assert_eq!(s.takeover("old", t0 + Duration::from_secs(160)), None);
        let none = InFlightSightings::new(0);
        none.in_flight("k", owner(1, None), minute, t0);
        assert!(none.is_empty());
    }
}
