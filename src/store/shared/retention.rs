//! Retention across runs on a shared store (Redis, PostgreSQL): what a run with
//! `fence.retention` leaves behind must not make a run without it forget.
//!
//! A run with retention ages the maxima it raises (Redis: the key's expiry; PostgreSQL:
//! `raised_at`, which its forgetting pass reads). That age outlives the run: on Redis the keys
//! expire whoever runs after, and on PostgreSQL a later run with retention would date maxima
//! by it. A run without retention (observed fencing, or authoritative without retention; a
//! replica not yet given the new config during a rolling change, or a run long after) promises
//! to keep every maximum, so it must take the age away, and it must know when to.
//!
//! **The mark.** A run with retention records a mark in the store (Redis: the key
//! `{prefix}:retention`; PostgreSQL: the one row of `{prefix}_retention`), a new value at its
//! start and every [`CHECK_EVERY`]. It ages a raise only while its last mark is fresh: sent less
//! than [`FRESH`] ago and written (a raise sent later, or after a failed write, gets no age:
//! kept, the safe side). On Redis the mark expires [`MARK_SLACK`] after the period: by then
//! every key that run aged has expired or been made permanent.
//!
//! **The sweep.** A run without retention reads the mark at its start and every
//! [`CHECK_EVERY`]. When it finds one, it makes every maximum under its prefix permanent
//! (Redis: `PERSIST` on every `{prefix}:{…}:max` key; PostgreSQL: `raised_at` set to `NULL`).
//! A run with retention may still be raising (a rolling change of the config), so the sweep is
//! repeated at every check that finds a mark. Once the value has stayed the same
//! for [`QUIET`] (longer than [`FRESH`]), no run with retention can age a raise any more
//! without writing a new value: one last sweep, and the mark is deleted if it still holds that
//! value (compare and delete; a new value written meanwhile starts over).
//!
//! **Fail closed.** A store admits no write (it answers [`StoreError`], which the proxy turns
//! into `503`) and is not ready until its first check has succeeded: a run with retention has
//! written its mark, a run without has swept what it found. A later check that fails (the
//! mark cannot be read, a sweep is refused) does the same until one succeeds: retried with
//! backoff, and at once by the next admission. The first check waits for [`crate::store::FenceStore::forget_after`], the first
//! admission or [`START_GRACE`], whichever is first, so that a run with retention does not
//! sweep as a run without before it is told its period.
//!
//! What a sweep cannot do: bring back a maximum forgotten before it (a Redis key that expired,
//! a PostgreSQL row deleted). Under `fence.authority: leases` that is safe (the lease
//! backend refuses older tokens); in observed fencing a stale token for such a resource is
//! admitted, and the sweep says so in its log line (see docs/guarantees.md).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::time::Instant;

use tokio::sync::{watch, Notify};

use super::{Clock, Remote};
use crate::store::StoreError;
use crate::sync::Locked;

/// How often a run with retention writes its mark, and a run without reads it.
pub const CHECK_EVERY: Duration = Duration::from_secs(60);
/// How long after sending its last successful mark a run with retention still ages raises.
pub const FRESH: Duration = Duration::from_secs(90);
/// How long a mark's value must stay the same before a run without retention deletes it:
/// [`FRESH`] and a minute for raises sent within it to reach the server.
pub const QUIET: Duration = Duration::from_secs(150);
/// How much longer than the period a mark lives on Redis: a key aged by a raise sent up to
/// [`FRESH`] after the mark expires no later than the mark, with margin.
pub const MARK_SLACK: Duration = Duration::from_secs(10 * 60);
/// How long the first check waits for `forget_after` or an admission.
pub const START_GRACE: Duration = Duration::from_secs(1);
/// Backoff of failed checks.
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// A new mark value for a run with `period`: the period in milliseconds (for the log of the
/// run that finds it) and a value no other mark has had.
pub fn mark_value(period: Duration) -> String {
    format!(
        "{} {}",
        crate::store::retention_ms(period),
        crate::idempotency::AttemptId::next().hex()
    )
}

/// The period a mark value names, if it reads as one.
fn period_of(value: &str) -> Option<Duration> {
    let ms = value.split(' ').next()?.parse().ok()?;
    Some(Duration::from_millis(ms))
}

/// Whether a run with retention may age a raise now: its last mark was sent less than
/// [`FRESH`] ago and written.
#[derive(Debug, Default)]
pub struct Freshness {
    /// Until when, in ms since [`base`] (0: never marked).
    until_ms: AtomicU64,
}

/// The instant freshness deadlines count from.
fn base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now)
}

fn ms_since_base(at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(base()).as_millis()).unwrap_or(u64::MAX)
}

impl Freshness {
    /// A mark sent at `sent` was written.
    pub fn marked(&self, sent: Instant) {
        let fresh = u64::try_from(FRESH.as_millis()).unwrap_or(u64::MAX);
        let until = ms_since_base(sent).saturating_add(fresh);
        self.until_ms.fetch_max(until, Ordering::Relaxed);
    }

    /// Whether a raise sent at `now` may be aged: a mark sent less than [`FRESH`] before was
    /// written.
    pub fn fresh_at(&self, now: Instant) -> bool {
        ms_since_base(now) < self.until_ms.load(Ordering::Relaxed)
    }

    /// [`Freshness::fresh_at`] now.
    pub fn fresh(&self) -> bool {
        self.fresh_at(Instant::now())
    }
}

#[derive(Debug, Clone)]
enum Status {
    /// No check has succeeded since the store opened or was told its period.
    Pending,
    Ready,
    Failed(StoreError),
}

/// The gate admissions pass (see the module documentation) and the task that keeps it.
pub struct Guard {
    /// Bumped by `forget_after`: a check started before answers for the old setting.
    generation: AtomicU64,
    status: watch::Sender<Status>,
    /// Fast path: the status is `Ready`.
    ready: AtomicBool,
    wake: Notify,
    /// When the next check is due, in ms of `clock` since `opened` (`u64::MAX`: none asked
    /// for; 0: at the first admission).
    due_ms: AtomicU64,
    clock: Clock,
    opened: Instant,
    /// The error of the failing checks, as last logged; held while a check's outcome is
    /// published or `forget_after` restarts the checks.
    logged: Mutex<Option<String>>,
}

impl Guard {
    /// A guard for a store that takes part (`forgets`), pending; one that does not is ready
    /// at once and never checks.
    pub fn new(forgets: bool, clock: Clock) -> Arc<Self> {
        let opened = clock();
        let (status, _) = watch::channel(if forgets {
            Status::Pending
        } else {
            Status::Ready
        });
        Arc::new(Guard {
            generation: AtomicU64::new(0),
            status,
            ready: AtomicBool::new(!forgets),
            wake: Notify::new(),
            due_ms: AtomicU64::new(if forgets { 0 } else { u64::MAX }),
            clock,
            opened,
            logged: Mutex::new(None),
        })
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(
            (self.clock)()
                .saturating_duration_since(self.opened)
                .as_millis(),
        )
        .unwrap_or(u64::MAX)
    }

    /// When a check `wait` from now is due, in ms of `clock` since `opened`.
    fn due_after(&self, wait: Duration) -> u64 {
        self.now_ms()
            .saturating_add(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX))
    }

    /// Wakes the task if a check is due (by this store's clock).
    fn poke(&self) {
        let due = self.due_ms.load(Ordering::Relaxed);
        if due != u64::MAX
            && self.now_ms() >= due
            && self.due_ms.swap(u64::MAX, Ordering::Relaxed) != u64::MAX
        {
            self.wake.notify_one();
        }
    }

    /// Waits until the store may admit: `Ok` once the last check succeeded. While the last
    /// check failed, asks for another at once and answers its outcome (one check at a time:
    /// admissions arriving meanwhile wait for the same one), so a store that is back admits
    /// at the next write, not after the backoff. The caller bounds the wait
    /// (`timeouts.store`).
    pub async fn admit(&self) -> Result<(), StoreError> {
        self.poke();
        if self.ready.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut status = self.status.subscribe();
        let mut asked = false;
        loop {
            // Cloned, not borrowed: `retry` writes the status.
            let now = status.borrow_and_update().clone();
            match now {
                Status::Ready => return Ok(()),
                Status::Failed(e) if asked => return Err(e),
                Status::Failed(_) => {
                    asked = true;
                    self.retry();
                    continue;
                }
                Status::Pending => asked = true,
            }
            if status.changed().await.is_err() {
                return Err(StoreError::internal(
                    "the retention check of the store stopped",
                ));
            }
        }
    }

    /// A failed check is to be tried again now.
    fn retry(&self) {
        let pending = self.status.send_if_modified(|status| {
            let failed = matches!(status, Status::Failed(_));
            if failed {
                *status = Status::Pending;
            }
            failed
        });
        if pending {
            self.wake.notify_one();
        }
    }

    /// False while the last check failed.
    pub fn failed(&self) -> bool {
        matches!(*self.status.borrow(), Status::Failed(_))
    }

    /// The store was told its period (`forget_after`): check again at once, and admit
    /// nothing until that check succeeds.
    pub fn restart(&self) {
        // Under the lock `finish` publishes under: no outcome of an older check lands after.
        let logged = self.logged.locked();
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.ready.store(false, Ordering::Release);
        self.status.send_replace(Status::Pending);
        drop(logged);
        self.wake.notify_one();
    }

    /// Publishes a check's outcome, if no `forget_after` came since it started. One log line
    /// when checks start failing (or fail differently), one when they work again.
    fn finish(&self, generation: u64, result: Result<(), StoreError>, kind: &'static str) {
        let mut logged = self.logged.locked();
        if self.generation.load(Ordering::Acquire) != generation {
            return;
        }
        let ok = result.is_ok();
        let new = match result {
            Ok(()) => Status::Ready,
            Err(e) => Status::Failed(e),
        };
        match &new {
            Status::Failed(e) if logged.as_deref() != Some(&e.to_string()) => {
                tracing::error!(
                    store = kind,
                    error = %e,
                    store_error = e.label(),
                    "fence store: its retention check failed; no write is admitted until it \
                     succeeds"
                );
                *logged = Some(e.to_string());
            }
            Status::Ready if logged.take().is_some() => {
                tracing::info!(
                    store = kind,
                    "fence store: its retention check succeeds again"
                )
            }
            _ => {}
        }
        self.status.send_replace(new);
        self.ready.store(ok, Ordering::Release);
    }

    /// Keeps the gate: checks (see the module documentation) until the store is dropped.
    pub async fn run<R: Remote>(self: Arc<Self>, remote: Arc<R>) {
        // The first check: at `forget_after`, the first admission, or after the grace.
        let _ = tokio::time::timeout(START_GRACE, self.wake.notified()).await;
        let mut seen: Option<Seen> = None;
        let mut backoff = MIN_BACKOFF;
        loop {
            let generation = self.generation.load(Ordering::Acquire);
            // The next check is due [`CHECK_EVERY`] after this one starts, and due from now
            // on: an admission that finds it due while this check runs asks for the next one
            // (it takes `due_ms`), rather than finding it unset and asking for nothing. Set
            // before the status says ready, so an admission that passes the gate can wake it.
            self.due_ms
                .store(self.due_after(CHECK_EVERY), Ordering::Relaxed);
            let result = check(&*remote, &mut seen, &self.clock).await;
            if self.generation.load(Ordering::Acquire) != generation {
                continue;
            }
            let wait = match &result {
                Ok(()) => {
                    backoff = MIN_BACKOFF;
                    CHECK_EVERY
                }
                Err(_) => {
                    // Retried after the backoff, or at once by the next admission (the
                    // status says failed).
                    let wait = backoff;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    self.due_ms.store(self.due_after(wait), Ordering::Relaxed);
                    wait
                }
            };
            self.finish(generation, result, remote.kind());
            self.wait(wait, generation).await;
        }
    }

    /// Until `wait` has passed or a check is asked for: by an admission that found it due
    /// (it took `due_ms`), by `restart` (a new generation) or `retry` (the status is no
    /// longer `Ready`). A wake-up that asks for nothing is waited through: the permit an
    /// admission left when it woke the first check while that check already ran (its grace
    /// had passed) would otherwise run one more check at once, at a time nobody chose.
    async fn wait(&self, wait: Duration, generation: u64) {
        let deadline = tokio::time::Instant::now() + wait;
        while tokio::time::timeout_at(deadline, self.wake.notified())
            .await
            .is_ok()
        {
            let asked = self.due_ms.load(Ordering::Relaxed) == u64::MAX
                || self.generation.load(Ordering::Acquire) != generation
                || !matches!(*self.status.borrow(), Status::Ready);
            if asked {
                return;
            }
        }
    }
}

/// A mark value a run without retention has seen, and when it first saw it.
struct Seen {
    value: String,
    first: Instant,
}

/// One check: a run with retention writes a new mark; one without sweeps when it finds one
/// and deletes it once quiet.
async fn check<R: Remote>(
    remote: &R,
    seen: &mut Option<Seen>,
    clock: &Clock,
) -> Result<(), StoreError> {
    if let Some(period) = remote.retention() {
        *seen = None;
        return remote.mark(&mark_value(period)).await;
    }
    let sweeping = |e: StoreError| {
        e.with_context("keeping the maxima a run with fence.retention left to be forgotten")
    };
    let Some(value) = remote.read_mark().await? else {
        *seen = None;
        return Ok(());
    };
    let now = clock();
    // Swept at every check that finds a mark, not only when its value changed: whatever
    // raise a run with retention aged since the last sweep loses its age within one check,
    // however this run's checks fall against that run's marks.
    let quiet = matches!(seen, Some(s) if s.value == value
        && now.saturating_duration_since(s.first) >= QUIET);
    let kept = remote.keep_all().await.map_err(sweeping)?;
    let period = period_of(&value)
        .map(|p| crate::duration::display(p).to_string())
        .unwrap_or_else(|| "unknown".into());
    if seen.is_none() {
        tracing::warn!(
            store = remote.kind(),
            kept,
            retention = %period,
            "fence store: a run with fence.retention uses (or used) this store; this run keeps \
             every maximum, so it made the ones that run aged permanent. Maxima forgotten \
             before are not restored: without fence.authority: leases, a stale token for such \
             a resource is admitted"
        );
    } else if kept > 0 {
        tracing::info!(
            store = remote.kind(),
            kept,
            retention = %period,
            "fence store: made maxima aged by a run with fence.retention permanent"
        );
    }
    if !quiet {
        if seen.as_ref().is_none_or(|s| s.value != value) {
            *seen = Some(Seen { value, first: now });
        }
        return Ok(());
    }
    if remote.unmark(&value).await.map_err(sweeping)? {
        tracing::info!(
            store = remote.kind(),
            "fence store: no run with fence.retention has marked this store for {}s; \
             every maximum it aged is permanent, its mark is deleted",
            QUIET.as_secs()
        );
        *seen = None;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_is_fresh_for_a_while_after_it_was_sent() {
        let f = Freshness::default();
        let t0 = base() + Duration::from_secs(3600);
        assert!(!f.fresh_at(t0), "never marked");
        f.marked(t0);
        assert!(f.fresh_at(t0 + FRESH - Duration::from_millis(1)));
        assert!(!f.fresh_at(t0 + FRESH));
        // An older mark answered late does not shorten it.
        f.marked(t0 - Duration::from_secs(30));
        assert!(f.fresh_at(t0 + FRESH - Duration::from_millis(1)));
        f.marked(t0 + Duration::from_secs(60));
        assert!(f.fresh_at(t0 + FRESH + Duration::from_secs(59)));
    }

    #[test]
    fn mark_values_are_new_each_time_and_name_their_period() {
        let a = mark_value(Duration::from_secs(3600));
        let b = mark_value(Duration::from_secs(3600));
        assert_ne!(a, b);
        assert_eq!(period_of(&a), Some(Duration::from_secs(3600)));
        assert_eq!(period_of("nonsense"), None);
    }

    /// The waits are ordered so that the sweep argument holds: a run without retention deletes
    /// a mark only after every raise a run with retention aged under it was sent, with a
    /// minute to spare; and a Redis mark outlives every key aged under it.
    #[test]
    fn the_waits_fit_together() {
        assert!(CHECK_EVERY < FRESH);
        assert!(QUIET >= FRESH + Duration::from_secs(60));
        assert!(MARK_SLACK > FRESH + Duration::from_secs(60));
    }

    /// A remote of a run without retention that finds a mark: its reads of the mark wait for
    /// a permit each, and are counted.
    struct SlowMark {
        gate: tokio::sync::Semaphore,
        reads: AtomicU64,
    }

    impl Remote for SlowMark {
        fn raise<'a>(
            &'a self,
            _: &'a str,
            _: crate::fence::token::Token,
            _: crate::store::Rule,
        ) -> crate::store::BoxFuture<'a, Result<crate::store::Verdict, StoreError>> {
            unreachable!()
        }

        fn get<'a>(
            &'a self,
            _: &'a str,
        ) -> crate::store::BoxFuture<'a, Result<Option<crate::fence::token::Token>, StoreError>>
        {
            unreachable!()
        }

        fn ping(&self) -> crate::store::BoxFuture<'_, Result<(), StoreError>> {
            unreachable!()
        }

        fn begin_idempotent<'a>(
            &'a self,
            _: &'a str,
            _: &'a str,
            _: &'a crate::idempotency::Claim,
            _: Option<crate::idempotency::AttemptId>,
        ) -> crate::store::BoxFuture<'a, Result<super::super::Claimed, StoreError>> {
            unreachable!()
        }

        fn finish_idempotent<'a>(
            &'a self,
            _: &'a str,
            _: &'a str,
            _: &'a crate::idempotency::Claim,
            _: &'a crate::idempotency::Record,
        ) -> crate::store::BoxFuture<'a, Result<bool, StoreError>> {
            unreachable!()
        }

        fn kind(&self) -> &'static str {
            "slow mark"
        }

        fn forgets(&self) -> bool {
            true
        }

        fn read_mark(&self) -> crate::store::BoxFuture<'_, Result<Option<String>, StoreError>> {
            Box::pin(async move {
                self.reads.fetch_add(1, Ordering::SeqCst);
                self.gate.acquire().await.unwrap().forget();
                Ok(Some("3600000 a".into()))
            })
        }

        fn keep_all(&self) -> crate::store::BoxFuture<'_, Result<u64, StoreError>> {
            Box::pin(async { Ok(0) })
        }
    }

    /// An admission that finds the next check due while a check is still running asks for
    /// it: that check starts as soon as the running one ends, not [`CHECK_EVERY`] after (by
    /// the real clock). Before, the next check was made due only once the running one had
    /// ended, and an admission in between asked for nothing; a test that moved the store's
    /// clock while a check ran waited a minute for the next one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_admission_during_a_check_that_finds_the_next_one_due_asks_for_it() {
        let offset = Arc::new(AtomicU64::new(0));
        let base = Instant::now();
        let read = Arc::clone(&offset);
        let clock: Clock =
            Arc::new(move || base + Duration::from_secs(read.load(Ordering::SeqCst)));
        let remote = Arc::new(SlowMark {
            gate: tokio::sync::Semaphore::new(0),
            reads: AtomicU64::new(0),
        });
        let guard = Guard::new(true, clock);
        tokio::spawn(Arc::clone(&guard).run(Arc::clone(&remote)));
        let reads_reach = |n: u64| {
            let remote = Arc::clone(&remote);
            async move {
                let reached = async {
                    while remote.reads.load(Ordering::SeqCst) < n {
                        tokio::task::yield_now().await;
                    }
                };
                tokio::time::timeout(Duration::from_secs(10), reached)
                    .await
                    .is_ok()
            }
        };
        // The first admission starts the first check, which waits in its read of the mark.
        let first = tokio::spawn({
            let guard = Arc::clone(&guard);
            async move { guard.admit().await }
        });
        assert!(reads_reach(1).await, "the first check started");
        // A minute on, by the store's clock, an admission finds the next check due.
        offset.fetch_add(CHECK_EVERY.as_secs(), Ordering::SeqCst);
        let second = tokio::spawn({
            let guard = Arc::clone(&guard);
            async move { guard.admit().await }
        });
        remote.gate.add_permits(1);
        first.await.unwrap().unwrap();
        second.await.unwrap().unwrap();
        assert!(
            reads_reach(2).await,
            "the check asked for during the first did not start within 10s"
        );
        remote.gate.add_permits(1);
    }
}
