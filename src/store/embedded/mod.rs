//! Durable maxima in a redb file on local disk.
//!
//! Every raise is committed with an fsync before the write it admits is forwarded, so a
//! `kill -9` never forgets a maximum. One writer thread owns all write transactions and commits
//! whatever raises queued up while the previous sync ran (group commit): under load many raises
//! share one sync instead of queueing for one each.
//!
//! When the writer has just committed, a raise queued from a runtime thread set up with
//! [`defer_wakes_to_park`] does not wake it at once: the runtime wakes it when it runs out of
//! work (or the writer looks again after [`POLL`]). Woken by the first raise, the writer
//! would take the core from the proxy it shares it with and commit that raise nearly alone;
//! woken when the runtime parks, it commits every raise the runtime's ready work produced. A
//! writer that has gone idle is woken at once, so a lone write never waits.
//!
//! The maxima live in the file; memory holds a bounded cache of the recently used ones
//! ([`BoundedMaxima`], `store.cache_size` resources) and redb's page cache ([`PAGE_CACHE`]),
//! so memory does not grow with the number of resources and opening reads no maximum. Every
//! cached value is a lower bound of the durable maximum, which is what makes a refusal from
//! the cache safe whatever was evicted or read meanwhile. A decision that changes nothing is
//! made without the writer, from a value that was the durable maximum during the request:
//!
//! - a token below a cached value is refused (a lower bound suffices);
//! - a repeat of an *exact* cached value is admitted. Only the writer marks values exact: after
//!   a commit, with the values it committed or read in its transaction, and it clears the mark
//!   of every resource a batch raises before committing it. As this process is the file's only
//!   writer (redb locks it), an exact value is the durable maximum;
//! - a resource not cached (or a repeat of a value that is not exact) is read from the file in
//!   one read transaction, on the calling thread, and decided against what it read.
//!
//! Every raise goes to the writer, which decides it against the maximum in its own write
//! transaction (the table, not the cache), so an eviction between a lookup and the commit
//! cannot admit a stale token.
//!
//! Idempotency records go through the same writer: a claim reads the record, decides, raises
//! the maximum and writes the `in_flight` record in the batch's write transaction, so it is
//! durable before the write it admits is forwarded. Records live in `{prefix}.idempotency`
//! under [`record_key`], with the wall-clock instant (ms since the Unix epoch) they expire at,
//! since the file outlives the process; an expired record counts as absent. A record this
//! process wrote (an attempt's `in_flight` record, or its outcome) expires by the monotonic
//! clock instead: the writer keeps its deadline, and the record is live until that passes,
//! whatever the wall clock says. So a forward step of the wall clock can neither let a retry
//! execute beside a running attempt nor run again one whose outcome is recorded, and a step
//! back keeps no record alive past its window. A second table,
//! `{prefix}.idempotency.expiry`, holds `(expires_ms, record key)` for every record, so
//! purging the expired ones (inside write transactions) visits only those.
//!
//! With `fence.retention` (allowed only with `fence.authority: leases`), the writer also keeps
//! when each maximum was last raised, and forgets maxima not raised for the period (see
//! [`retention`]).

use crate::fence::resource::ResourceId;
use crate::fence::token::Token;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::Thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwapOption;
use redb::{Database, ReadableDatabase, ReadableTable, Table, TableDefinition};
use tokio::sync::oneshot;

use super::{decide, record_key, BoxFuture, FenceStore, Rule, StoreError, Verdict};
use crate::idempotency::{self, AttemptId, Begin, Claim, Phase, Record};
use crate::maxima::BoundedMaxima;

/// Upper bound on operations per transaction, so one batch cannot hold the queue for long.
const MAX_BATCH: usize = 4096;

/// Upper bound on expired records purged per transaction; the rest go with the next ones.
const MAX_PURGE: usize = 1024;

/// redb's cache of file pages, in bytes (its default is 1 GiB). The b-tree's branch pages of
/// 10 million resources take about 4 MiB; the rest holds recently read and written leaves.
pub const PAGE_CACHE: usize = 16 << 20;

/// Opens (creating if needed) the database file with the store's page cache.
fn open_file(path: &Path) -> Result<Database, redb::DatabaseError> {
    redb::Builder::new().set_cache_size(PAGE_CACHE).create(path)
}

/// How long the writer, after a commit, waits for a wake before it looks at the queue again,
/// and then goes idle if it found nothing.
const POLL: Duration = Duration::from_millis(1);

/// Record key to `(expires_ms, encoded record)`.
type Records<'a> = TableDefinition<'a, &'static str, (u64, &'static [u8])>;
/// `(expires_ms, record key)` for every record, in expiry order.
type Expiries<'a> = TableDefinition<'a, (u64, &'static str), ()>;

/// Resource to when its maximum was last raised (ms since the Unix epoch), kept only with
/// `fence.retention`.
type Raised<'a> = TableDefinition<'a, &'static str, u64>;
/// `(raised_ms, resource)` for every entry of [`Raised`], oldest first.
type RaisedOrder<'a> = TableDefinition<'a, (u64, &'static str), ()>;

/// One operation for the writer thread.
enum Op {
    Raise {
        resource: Box<str>,
        token: Token,
        rule: Rule,
        reply: oneshot::Sender<Result<Verdict, StoreError>>,
    },
    Begin {
        resource: Box<str>,
        key: Box<str>,
        claim: Claim,
        reply: oneshot::Sender<Result<Begin, StoreError>>,
    },
    Finish {
        resource: Box<str>,
        key: Box<str>,
        claim: Claim,
        outcome: Record,
        reply: oneshot::Sender<Result<bool, StoreError>>,
    },
}

/// What an operation answers once its transaction committed.
enum Answer {
    Verdict(Verdict),
    Begin(Begin),
    Finished(bool),
    /// This operation alone failed (its record is unreadable); it wrote nothing.
    Failed(StoreError),
}

impl Op {
    fn reply(self, answer: Result<Answer, StoreError>) {
        let answer = answer.and_then(|a| match a {
            Answer::Failed(e) => Err(e),
            a => Ok(a),
        });
        match self {
            Op::Raise { reply, .. } => {
                let _ = reply.send(answer.map(|a| match a {
                    Answer::Verdict(v) => v,
                    _ => unreachable!("a raise answers a verdict"),
                }));
            }
            Op::Begin { reply, .. } => {
                let _ = reply.send(answer.map(|a| match a {
                    Answer::Begin(b) => b,
                    _ => unreachable!("a claim answers a begin"),
                }));
            }
            Op::Finish { reply, .. } => {
                let _ = reply.send(answer.map(|a| match a {
                    Answer::Finished(f) => f,
                    _ => unreachable!("an outcome answers whether it landed"),
                }));
            }
        }
    }
}

/// The records this process wrote and that have not expired yet, by record key: each one's
/// stored wall-clock expiry (the mark that the stored record is still the one written here),
/// the attempt of an `in_flight` one, and its deadline on the monotonic clock (`None`: the
/// window does not fit in an `Instant`).
type Running = HashMap<String, Written>;

/// A record this process wrote: see [`Running`].
#[derive(Debug, Clone, Copy)]
struct Written {
    at: u64,
    attempt: Option<AttemptId>,
    deadline: Option<Instant>,
}

/// Whether `record`, stored under `key` to expire at `at` (wall clock), is live at `now`
/// (monotonic) by this process's own clock: `Some` for a record this process wrote, `None`
/// for one it did not (written before a restart), which the wall clock decides.
fn live_here(written: &Running, key: &str, at: u64, record: &Record, now: Instant) -> Option<bool> {
    let mine = written.get(key).filter(|w| {
        w.at == at && (record.phase != Phase::InFlight || record.attempt == w.attempt)
    })?;
    Some(mine.deadline.is_none_or(|d| d > now))
}

/// Milliseconds since the Unix epoch, the clock record expiries are kept in.
/// A maximum as the fences table holds it (a `u64`): one outside the token range is corrupt.
fn stored(value: u64) -> Result<Token, redb::Error> {
    Token::try_from(value).map_err(|e| redb::Error::Corrupted(e.to_string()))
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn expiry_ms(now: u64, window: Duration) -> u64 {
    now.saturating_add(u64::try_from(window.as_millis()).unwrap_or(u64::MAX))
}

struct Shared {
    /// Lower bounds of durable maxima, some exact (see the module comment).
    cache: BoundedMaxima,
    /// The database, for reads; `None` while the writer reopens it after a failure.
    db: ArcSwapOption<Database>,
    /// The file, for messages.
    path: PathBuf,
    /// The table of maxima.
    fences: String,
    healthy: AtomicBool,
    /// Committed write transactions, for tests and metrics of group commit.
    commits: AtomicU64,
    /// The writer waits without a deadline: a new operation wakes it at once.
    idle: AtomicBool,
    /// `fence.retention` in ms: forget a maximum not raised for this long; 0: never.
    retention_ms: AtomicU64,
    /// Added to the wall clock the writer reads (tests: a clock step).
    #[cfg(test)]
    clock_step_ms: std::sync::atomic::AtomicI64,
    /// Runs in the writer just before it commits a batch that wrote (tests).
    #[cfg(test)]
    before_commit: std::sync::Mutex<Option<Box<BeforeCommit>>>,
    /// The writer found the queue empty after a commit and waits for a wake (tests).
    #[cfg(test)]
    active_wait: AtomicBool,
}

/// A test's look at the cache while a batch is about to commit.
#[cfg(test)]
type BeforeCommit = dyn FnMut(&BoundedMaxima) + Send;

impl Shared {
    /// The wall clock record expiries are compared with.
    fn now_ms(&self) -> u64 {
        #[cfg(test)]
        let step = self.clock_step_ms.load(Ordering::Relaxed);
        #[cfg(not(test))]
        let step = 0;
        now_ms().saturating_add_signed(step)
    }
}

/// The `embedded` store: maxima and idempotency records in a redb file on local disk, every
/// raise committed with an fsync before the write it admits is forwarded. The file has one
/// writer, this store (redb locks it).
pub struct EmbeddedStore {
    shared: Arc<Shared>,
    /// Queue to the writer thread; closing it (and waking the thread) stops the thread.
    queue: Option<mpsc::Sender<Op>>,
    /// Joined on drop, so the database file is unlocked when the store is gone.
    writer: Option<std::thread::JoinHandle<()>>,
}

impl Drop for EmbeddedStore {
    fn drop(&mut self) {
        drop(self.queue.take());
        if let Some(writer) = self.writer.take() {
            writer.thread().unpark();
            let _ = writer.join();
        }
    }
}

impl EmbeddedStore {
    /// Opens (creating if needed) the database, caching up to `cache_size` maxima. Reads no
    /// maximum: the time it takes does not grow with the number of resources.
    pub fn open(path: &Path, prefix: &str, cache_size: usize) -> Result<Self, StoreError> {
        Self::open_polling(path, prefix, cache_size, POLL)
    }

    /// [`EmbeddedStore::open`] with the writer's [`POLL`] set (tests).
    fn open_polling(
        path: &Path,
        prefix: &str,
        cache_size: usize,
        poll: Duration,
    ) -> Result<Self, StoreError> {
        let fail = |what: &str, e: &dyn std::fmt::Display| {
            StoreError::unreachable(format!("{what} {}: {e}", path.display()))
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| fail("cannot create the directory of", &e))?;
        }
        let db =
            Arc::new(open_file(path).map_err(|e| {
                StoreError::unreachable(crate::conn::embedded::open_error(path, &e))
            })?);
        let names = Names::new(prefix);
        let fences = TableDefinition::<&str, u64>::new(&names.fences);
        let records = Records::new(&names.records);
        let expiries = Expiries::new(&names.expiries);
        let missing = {
            let read = db.begin_read().map_err(|e| fail("cannot read", &e))?;
            read.open_table(fences).is_err()
                || read.open_table(records).is_err()
                || read.open_table(expiries).is_err()
        };
        if missing {
            let txn = db.begin_write().map_err(|e| fail("cannot write", &e))?;
            txn.open_table(fences)
                .map_err(|e| fail("cannot open table in", &e))?;
            txn.open_table(records)
                .map_err(|e| fail("cannot open table in", &e))?;
            txn.open_table(expiries)
                .map_err(|e| fail("cannot open table in", &e))?;
            txn.commit().map_err(|e| fail("cannot commit to", &e))?;
        }
        let shared = Arc::new(Shared {
            cache: BoundedMaxima::new(cache_size),
            db: ArcSwapOption::new(Some(Arc::clone(&db))),
            path: path.to_owned(),
            fences: names.fences.clone(),
            healthy: AtomicBool::new(true),
            commits: AtomicU64::new(0),
            idle: AtomicBool::new(false),
            retention_ms: AtomicU64::new(0),
            #[cfg(test)]
            clock_step_ms: std::sync::atomic::AtomicI64::new(0),
            #[cfg(test)]
            before_commit: std::sync::Mutex::new(None),
            #[cfg(test)]
            active_wait: AtomicBool::new(false),
        });
        let (queue, rx) = mpsc::channel();
        let writer_shared = Arc::clone(&shared);
        let writer_path = path.to_owned();
        let writer = std::thread::Builder::new()
            .name("fencegate-store".into())
            .spawn(move || writer(writer_path, db, names, rx, writer_shared, poll))
            .map_err(|e| fail("cannot start the writer for", &e))?;
        Ok(EmbeddedStore {
            shared,
            queue: Some(queue),
            writer: Some(writer),
        })
    }

    /// Wakes the writer for an operation just queued: at once, or when this thread's runtime
    /// parks (see the module comment).
    fn wake(&self) {
        // Present until the store is dropped, and nothing is sent after that.
        if let Some(writer) = &self.writer {
            park::wake(writer.thread(), &self.shared.idle);
        }
    }

    fn send<T>(
        &self,
        op: Op,
        answer: oneshot::Receiver<Result<T, StoreError>>,
    ) -> BoxFuture<'static, Result<T, StoreError>>
    where
        T: Send + 'static,
    {
        let sent = match &self.queue {
            Some(queue) => queue.send(op).map(|()| self.wake()).map_err(|_| ()),
            None => Err(()),
        };
        Box::pin(async move {
            sent.map_err(|_| StoreError::internal("the store writer has stopped"))?;
            answer
                .await
                .map_err(|_| StoreError::internal("the store writer has stopped"))?
        })
    }

    /// How many transactions have been committed since open.
    pub fn commits(&self) -> u64 {
        self.shared.commits.load(Ordering::Relaxed)
    }

    /// Records maxima straight into the file at `path`, `batch` resources per transaction:
    /// each resource's maximum is raised to its token, never lowered. For benchmarks that need
    /// millions of resources without a request for each. The file must not be open elsewhere
    /// (redb locks it, and this fails). Returns how many maxima it raised.
    #[doc(hidden)]
    pub fn prefill(
        path: &Path,
        prefix: &str,
        maxima: impl IntoIterator<Item = (String, u64)>,
        batch: usize,
    ) -> Result<u64, StoreError> {
        let fail = |e: &dyn std::fmt::Display| {
            StoreError::unreachable(format!("cannot fill {}: {e}", path.display()))
        };
        let db = open_file(path).map_err(|e| fail(&e))?;
        let names = Names::new(prefix);
        let fences = TableDefinition::<&str, u64>::new(&names.fences);
        let mut maxima = maxima.into_iter().peekable();
        let mut raised = 0;
        while maxima.peek().is_some() {
            let mut write = || -> Result<u64, redb::Error> {
                let mut raised = 0;
                let txn = db.begin_write()?;
                {
                    let mut table = txn.open_table(fences)?;
                    for (resource, token) in maxima.by_ref().take(batch.max(1)) {
                        let current = table.get(resource.as_str())?.map(|v| v.value());
                        if current.is_none_or(|c| token > c) {
                            table.insert(resource.as_str(), token)?;
                            raised += 1;
                        }
                    }
                }
                txn.commit()?;
                Ok(raised)
            };
            raised += write().map_err(|e| fail(&e))?;
        }
        Ok(raised)
    }

    /// How many maxima are cached.
    pub fn cached(&self) -> usize {
        self.shared.cache.len()
    }

    /// The durable maximum of `resource`, read from the file in one read transaction (and
    /// cached as a lower bound).
    fn read_maximum(&self, resource: &str) -> Result<Option<Token>, StoreError> {
        let Some(db) = self.shared.db.load_full() else {
            return Err(StoreError::unreachable(format!(
                "{} is being reopened after a failed write",
                self.shared.path.display()
            )));
        };
        let read = || -> Result<Option<Token>, redb::Error> {
            let txn = db.begin_read()?;
            let table = txn.open_table(TableDefinition::<&str, u64>::new(&self.shared.fences))?;
            let value = table.get(resource)?.map(|v| stored(v.value()));
            value.transpose()
        };
        let durable = read().map_err(|e| {
            StoreError::unreachable(format!("cannot read {}: {e}", self.shared.path.display()))
        })?;
        if let Some(value) = durable {
            self.shared.cache.observe(resource, value);
        }
        Ok(durable)
    }

    /// The verdict on `token` when it changes nothing (a refusal, or a repeat of the maximum),
    /// decided here without the writer against one committed state of the file (a refusal
    /// decided there changes nothing, so it needs no write transaction); `None` when it would raise the maximum, which only the
    /// writer decides (see the module comment).
    fn decide_here(
        &self,
        resource: &str,
        token: Token,
        rule: Rule,
    ) -> Result<Option<Verdict>, StoreError> {
        if let Some(cached) = self.shared.cache.entry(resource) {
            let verdict = decide(Some(cached.value), token, rule);
            match verdict {
                // Below a lower bound: stale whatever the durable maximum is now.
                Verdict::Stale { .. } => return Ok(Some(verdict)),
                // Above a lower bound: the writer compares with the durable maximum.
                _ if verdict.raised(token) => return Ok(None),
                // A repeat of the durable maximum itself, or too far above it.
                _ if cached.exact => return Ok(Some(verdict)),
                // A repeat of a lower bound, or too far above one: the file says what the
                // maximum is (a lower bound cannot refuse a token as too far).
                _ => {}
            }
        }
        let verdict = decide(self.read_maximum(resource)?, token, rule);
        Ok((!verdict.raised(token)).then_some(verdict))
    }
}

impl FenceStore for EmbeddedStore {
    fn compare_and_raise<'a>(
        &'a self,
        resource: &'a ResourceId,
        token: Token,
        rule: Rule,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>> {
        match self.decide_here(resource, token, rule) {
            // Refusal, or the durable maximum itself: nothing to write.
            Ok(Some(verdict)) => return Box::pin(std::future::ready(Ok(verdict))),
            Err(e) => return Box::pin(std::future::ready(Err(e))),
            Ok(None) => {}
        }
        let (reply, answer) = oneshot::channel();
        let raise = Op::Raise {
            resource: resource.as_str().into(),
            token,
            rule,
            reply,
        };
        self.send(raise, answer)
    }

    fn current<'a>(
        &'a self,
        resource: &'a ResourceId,
    ) -> BoxFuture<'a, Result<Option<Token>, StoreError>> {
        let current = match self.shared.cache.entry(resource) {
            Some(cached) if cached.exact => Ok(Some(cached.value)),
            _ => self.read_maximum(resource),
        };
        Box::pin(std::future::ready(current))
    }

    /// False after a failed commit until the disk takes writes again, and for good once the
    /// writer thread has stopped (a panic in it, say): every write would then be refused.
    fn healthy(&self) -> bool {
        self.shared.healthy.load(Ordering::Relaxed)
            && self.writer.as_ref().is_some_and(|w| !w.is_finished())
    }

    fn begin_idempotent<'a>(
        &'a self,
        resource: &'a ResourceId,
        key: &'a str,
        claim: &'a Claim,
    ) -> BoxFuture<'a, Result<Begin, StoreError>> {
        // Always through the writer, never from the cache: a stale token may still have a
        // record to replay.
        let (reply, answer) = oneshot::channel();
        let begin = Op::Begin {
            resource: resource.as_str().into(),
            key: key.into(),
            claim: *claim,
            reply,
        };
        self.send(begin, answer)
    }

    fn finish_idempotent<'a>(
        &'a self,
        resource: &'a ResourceId,
        key: &'a str,
        claim: &'a Claim,
        outcome: &'a Record,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let (reply, answer) = oneshot::channel();
        let finish = Op::Finish {
            resource: resource.as_str().into(),
            key: key.into(),
            claim: *claim,
            outcome: outcome.clone(),
            reply,
        };
        self.send(finish, answer)
    }

    fn kind(&self) -> &'static str {
        "embedded"
    }

    fn forget_after(&self, period: Duration) -> Result<(), StoreError> {
        let ms = crate::store::retention_ms(period);
        self.shared.retention_ms.store(ms, Ordering::Relaxed);
        // The writer waits without a deadline while idle: it learns its new one now.
        if let Some(writer) = &self.writer {
            writer.thread().unpark();
        }
        Ok(())
    }
}

/// The names of the store's tables, all under its prefix.
struct Names {
    fences: String,
    records: String,
    expiries: String,
    raised: String,
    raised_order: String,
}

impl Names {
    fn new(prefix: &str) -> Self {
        Names {
            fences: format!("{prefix}.fences"),
            records: format!("{prefix}.idempotency"),
            expiries: format!("{prefix}.idempotency.expiry"),
            raised: format!("{prefix}.fences.raised"),
            raised_order: format!("{prefix}.fences.raised.order"),
        }
    }
}

mod admin;
pub use admin::EmbeddedAdmin;
mod park;
#[cfg(test)]
mod properties;
pub use park::defer_wakes_to_park;
#[cfg(test)]
pub(crate) use park::parks_here;
mod records;
use records::{purge, write_record, Found};
mod retention;
#[cfg(test)]
mod tests;
mod writer;
use writer::writer;
