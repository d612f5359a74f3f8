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
//! All maxima are also held in memory (loaded at open, updated after each commit), so a stale
//! token or a repeat of the current token is answered without touching the disk. The cache only
//! ever holds durable values, and this process is the file's only writer (redb locks it).
//!
//! Idempotency records go through the same writer: a claim reads the record, decides, raises
//! the maximum and writes the `in_flight` record in the batch's write transaction, so it is
//! durable before the write it admits is forwarded. Records live in `{prefix}.idempotency`
//! under [`record_key`], with the wall-clock instant (ms since the Unix epoch) they expire at,
//! since the file outlives the process; an expired record counts as absent. Except an
//! `in_flight` record whose attempt this process started: the writer also keeps its deadline
//! on the monotonic clock, and until that passes the record is live whatever the wall clock
//! says, so a forward step of the clock cannot let a retry execute beside a running attempt. A second table,
//! `{prefix}.idempotency.expiry`, holds `(expires_ms, record key)` for every record, so
//! purging the expired ones (inside write transactions) visits only those.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::Thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dashmap::DashMap;
use redb::{Database, ReadableDatabase, ReadableTable, Table, TableDefinition};
use tokio::sync::oneshot;

use super::{decide, record_key, BoxFuture, FenceStore, StoreError, Verdict};
use crate::config::EqualTokens;
use crate::idempotency::{self, AttemptId, Begin, Claim, Phase, Record};

/// Upper bound on operations per transaction, so one batch cannot hold the queue for long.
const MAX_BATCH: usize = 4096;

/// Upper bound on expired records purged per transaction; the rest go with the next ones.
const MAX_PURGE: usize = 1024;

/// How long the writer, after a commit, waits for a wake before it looks at the queue again,
/// and then goes idle if it found nothing.
const POLL: Duration = Duration::from_millis(1);

thread_local! {
    /// This thread runs a runtime whose park hook wakes the writers ([`defer_wakes_to_park`]).
    static PARKS_HERE: Cell<bool> = const { Cell::new(false) };
    /// Writers to wake when this thread's runtime parks.
    static DEFERRED: RefCell<Vec<Thread>> = const { RefCell::new(Vec::new()) };
}

/// Sets up `builder`'s runtime so that raises queued from its threads wake the embedded
/// store's writer when the runtime runs out of work, not one by one (see the module comment).
pub fn defer_wakes_to_park(builder: &mut tokio::runtime::Builder) {
    builder.on_thread_park(|| {
        PARKS_HERE.set(true);
        DEFERRED.with_borrow_mut(|writers| {
            for writer in writers.drain(..) {
                writer.unpark();
            }
        });
    });
}

/// Whether this thread's runtime was set up with [`defer_wakes_to_park`] and has parked since.
#[cfg(test)]
pub(crate) fn parks_here() -> bool {
    PARKS_HERE.get()
}

/// Record key to `(expires_ms, encoded record)`.
type Records<'a> = TableDefinition<'a, &'static str, (u64, &'static [u8])>;
/// `(expires_ms, record key)` for every record, in expiry order.
type Expiries<'a> = TableDefinition<'a, (u64, &'static str), ()>;

/// One operation for the writer thread.
enum Op {
    Raise {
        resource: Box<str>,
        token: u64,
        equal: EqualTokens,
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

/// The attempts of this process whose `in_flight` records are live, by record key: the owner
/// and its deadline on the monotonic clock (`None`: the window does not fit in an `Instant`).
type Running = HashMap<String, (AttemptId, Option<Instant>)>;

/// Whether `record`, stored under `key`, is the `in_flight` record of an attempt of this
/// process whose monotonic deadline has not passed.
fn running(live: &Running, key: &str, record: &Record, now: Instant) -> bool {
    live.get(key).is_some_and(|(attempt, deadline)| {
        record.phase == Phase::InFlight
            && record.attempt == Some(*attempt)
            && deadline.is_none_or(|d| d > now)
    })
}

/// Milliseconds since the Unix epoch, the clock record expiries are kept in.
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn expiry_ms(now: u64, window: Duration) -> u64 {
    now.saturating_add(u64::try_from(window.as_millis()).unwrap_or(u64::MAX))
}

struct Shared {
    /// Durable maxima, complete: a resource absent here is absent on disk.
    maxima: DashMap<Box<str>, u64>,
    healthy: AtomicBool,
    /// Committed write transactions, for tests and metrics of group commit.
    commits: AtomicU64,
    /// The writer waits without a deadline: a new operation wakes it at once.
    idle: AtomicBool,
    /// Added to the wall clock the writer reads (tests: a clock step).
    #[cfg(test)]
    clock_step_ms: AtomicU64,
}

impl Shared {
    /// The wall clock record expiries are compared with.
    fn now_ms(&self) -> u64 {
        #[cfg(test)]
        let step = self.clock_step_ms.load(Ordering::Relaxed);
        #[cfg(not(test))]
        let step = 0;
        now_ms().saturating_add(step)
    }
}

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
    /// Opens (creating if needed) the database and loads every maximum into memory.
    pub fn open(path: &Path, prefix: &str) -> Result<Self, StoreError> {
        Self::open_polling(path, prefix, POLL)
    }

    /// [`EmbeddedStore::open`] with the writer's [`POLL`] set (tests).
    fn open_polling(path: &Path, prefix: &str, poll: Duration) -> Result<Self, StoreError> {
        let fail = |what: &str, e: &dyn std::fmt::Display| {
            StoreError::Unavailable(format!("{what} {}: {e}", path.display()))
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| fail("cannot create the directory of", &e))?;
        }
        let db = Database::create(path).map_err(|e| fail("cannot open", &e))?;
        let names = Names::new(prefix);
        let maxima = DashMap::new();
        {
            let table = TableDefinition::<&str, u64>::new(&names.fences);
            let txn = db.begin_write().map_err(|e| fail("cannot write", &e))?;
            txn.open_table(table)
                .map_err(|e| fail("cannot open table in", &e))?;
            txn.open_table(Records::new(&names.records))
                .map_err(|e| fail("cannot open table in", &e))?;
            txn.open_table(Expiries::new(&names.expiries))
                .map_err(|e| fail("cannot open table in", &e))?;
            txn.commit().map_err(|e| fail("cannot commit to", &e))?;
            let read = db.begin_read().map_err(|e| fail("cannot read", &e))?;
            let table = read
                .open_table(table)
                .map_err(|e| fail("cannot read", &e))?;
            for row in table.iter().map_err(|e| fail("cannot read", &e))? {
                let (k, v) = row.map_err(|e| fail("cannot read", &e))?;
                maxima.insert(Box::from(k.value()), v.value());
            }
        }
        let shared = Arc::new(Shared {
            maxima,
            healthy: AtomicBool::new(true),
            commits: AtomicU64::new(0),
            idle: AtomicBool::new(false),
            #[cfg(test)]
            clock_step_ms: AtomicU64::new(0),
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
        let Some(writer) = self.writer.as_ref().map(|w| w.thread()) else {
            return;
        };
        // Pairs with the fence in `writer` between marking itself idle and a last look at the
        // queue: either it sees this operation, or this sees it idle.
        fence(Ordering::SeqCst);
        if !PARKS_HERE.get() || self.shared.idle.load(Ordering::Relaxed) {
            writer.unpark();
            return;
        }
        DEFERRED.with_borrow_mut(|writers| {
            if !writers.iter().any(|w| w.id() == writer.id()) {
                writers.push(writer.clone());
            }
        });
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
            sent.map_err(|_| StoreError::Unavailable("the store writer has stopped".into()))?;
            answer
                .await
                .map_err(|_| StoreError::Unavailable("the store writer has stopped".into()))?
        })
    }

    /// How many transactions have been committed since open.
    pub fn commits(&self) -> u64 {
        self.shared.commits.load(Ordering::Relaxed)
    }

    pub fn len(&self) -> usize {
        self.shared.maxima.len()
    }

    pub fn is_empty(&self) -> bool {
        self.shared.maxima.is_empty()
    }
}

impl FenceStore for EmbeddedStore {
    fn compare_and_raise<'a>(
        &'a self,
        resource: &'a str,
        token: u64,
        equal: EqualTokens,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>> {
        let cached = self.shared.maxima.get(resource).map(|v| *v);
        if let Some(current) = cached {
            let verdict = decide(Some(current), token, equal);
            if !verdict.raised(token) {
                // Refusal, or the durable maximum itself: nothing to write.
                return Box::pin(std::future::ready(Ok(verdict)));
            }
        }
        let (reply, answer) = oneshot::channel();
        let raise = Op::Raise {
            resource: resource.into(),
            token,
            equal,
            reply,
        };
        self.send(raise, answer)
    }

    fn current<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<u64>, StoreError>> {
        let current = self.shared.maxima.get(resource).map(|v| *v);
        Box::pin(std::future::ready(Ok(current)))
    }

    /// False after a failed commit until the disk takes writes again, and for good once the
    /// writer thread has stopped (a panic in it, say): every write would then be refused.
    fn healthy(&self) -> bool {
        self.shared.healthy.load(Ordering::Relaxed)
            && self.writer.as_ref().is_some_and(|w| !w.is_finished())
    }

    fn begin_idempotent<'a>(
        &'a self,
        resource: &'a str,
        key: &'a str,
        claim: &'a Claim,
    ) -> BoxFuture<'a, Result<Begin, StoreError>> {
        // Always through the writer, never from the cache: a stale token may still have a
        // record to replay.
        let (reply, answer) = oneshot::channel();
        let begin = Op::Begin {
            resource: resource.into(),
            key: key.into(),
            claim: *claim,
            reply,
        };
        self.send(begin, answer)
    }

    fn finish_idempotent<'a>(
        &'a self,
        resource: &'a str,
        key: &'a str,
        claim: &'a Claim,
        outcome: &'a Record,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let (reply, answer) = oneshot::channel();
        let finish = Op::Finish {
            resource: resource.into(),
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
}

/// How often a failed database is reopened and probed with a real write, so readiness comes
/// back once the disk does (a failed redb commit poisons the handle until it is reopened).
const RETRY: Duration = Duration::from_millis(500);

/// The names of the store's tables, all under its prefix.
struct Names {
    fences: String,
    records: String,
    expiries: String,
}

impl Names {
    fn new(prefix: &str) -> Self {
        Names {
            fences: format!("{prefix}.fences"),
            records: format!("{prefix}.idempotency"),
            expiries: format!("{prefix}.idempotency.expiry"),
        }
    }
}

/// The tables one write transaction works on.
#[derive(Clone, Copy)]
struct Tables<'n> {
    fences: TableDefinition<'n, &'static str, u64>,
    records: Records<'n>,
    expiries: Expiries<'n>,
}

/// The writer thread: wait for operations, take every queued one, commit them together.
fn writer(
    path: PathBuf,
    db: Database,
    names: Names,
    rx: mpsc::Receiver<Op>,
    shared: Arc<Shared>,
    poll: Duration,
) {
    let tables = Tables {
        fences: TableDefinition::new(&names.fences),
        records: Records::new(&names.records),
        expiries: Expiries::new(&names.expiries),
    };
    let probe_name = format!("{}.probe", names.fences);
    let probe = TableDefinition::<&str, u64>::new(&probe_name);
    let mut db = Some(db);
    let mut batch = Vec::with_capacity(64);
    let mut next_purge = 0;
    let mut live = Running::new();
    // Until when, after a commit, the next raises may wait for the runtime to park.
    let mut active_until: Option<Instant> = None;
    let mut next_recovery = Instant::now() + RETRY;
    loop {
        let closed = loop {
            match rx.try_recv() {
                Ok(op) => {
                    batch.push(op);
                    if batch.len() == MAX_BATCH {
                        break false;
                    }
                }
                Err(mpsc::TryRecvError::Empty) => break false,
                Err(mpsc::TryRecvError::Disconnected) => break true,
            }
        };
        if batch.is_empty() {
            if closed {
                return;
            }
            if !shared.healthy.load(Ordering::Relaxed) {
                let now = Instant::now();
                if now >= next_recovery {
                    recover(&path, &mut db, probe, &shared);
                    next_recovery = now + RETRY;
                }
                std::thread::park_timeout(next_recovery.saturating_duration_since(now));
            } else if let Some(until) = active_until {
                // A wake can come late, for an operation already taken: an early return with
                // nothing queued only means waiting again until the deadline.
                match until.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => std::thread::park_timeout(left),
                    _ => active_until = None,
                }
            } else {
                shared.idle.store(true, Ordering::Relaxed);
                // Pairs with the fence in `EmbeddedStore::wake`.
                fence(Ordering::SeqCst);
                match rx.try_recv() {
                    Ok(op) => batch.push(op),
                    Err(mpsc::TryRecvError::Empty) => std::thread::park(),
                    // The next look returns.
                    Err(mpsc::TryRecvError::Disconnected) => {}
                }
                shared.idle.store(false, Ordering::Relaxed);
            }
            continue;
        }
        active_until = Some(Instant::now() + poll);
        if db.is_none() {
            db = Database::create(&path).ok();
        }
        let result = match &db {
            Some(handle) => {
                commit_batch(handle, tables, &batch, &shared, &mut next_purge, &mut live)
                    .map_err(|e| e.to_string())
            }
            None => Err(format!("cannot reopen {}", path.display())),
        };
        match result {
            Ok((answers, raised, committed)) => {
                if committed {
                    shared.commits.fetch_add(1, Ordering::Relaxed);
                }
                if !shared.healthy.swap(true, Ordering::Relaxed) {
                    tracing::info!(path = %path.display(), "fence store writable again");
                }
                // Publish only now that the values are durable.
                for (resource, token) in raised {
                    let mut slot = shared.maxima.entry(resource).or_insert(token);
                    *slot = (*slot).max(token);
                }
                for (op, answer) in batch.drain(..).zip(answers) {
                    op.reply(Ok(answer));
                }
            }
            Err(e) => {
                shared.healthy.store(false, Ordering::Relaxed);
                // Drop the handle: redb refuses further use after an I/O error.
                db = None;
                tracing::error!(path = %path.display(), error = %e, "fence store commit failed");
                for op in batch.drain(..) {
                    op.reply(Err(StoreError::Unavailable(e.clone())));
                }
            }
        }
    }
}

/// Reopens the database if needed and proves it writable with a real commit.
fn recover(
    path: &Path,
    db: &mut Option<Database>,
    probe: TableDefinition<&str, u64>,
    shared: &Shared,
) {
    if db.is_none() {
        *db = Database::create(path).ok();
    }
    let Some(handle) = db else { return };
    let attempt = || -> Result<(), redb::Error> {
        let txn = handle.begin_write()?;
        {
            let mut t = txn.open_table(probe)?;
            let n = t.get("writes")?.map_or(0, |v| v.value());
            t.insert("writes", n + 1)?;
        }
        txn.commit()?;
        Ok(())
    };
    match attempt() {
        Ok(()) => {
            shared.healthy.store(true, Ordering::Relaxed);
            tracing::info!(path = %path.display(), "fence store writable again");
        }
        Err(e) => {
            *db = None;
            tracing::debug!(path = %path.display(), error = %e, "fence store still not writable");
        }
    }
}

/// The answers in batch order, the raised maxima, and whether anything was committed.
type BatchResult = (Vec<Answer>, HashMap<Box<str>, u64>, bool);

/// How often a batch of raises alone also purges expired idempotency records (a batch with
/// keyed operations always does).
const PURGE_EVERY_MS: u64 = 1000;

/// Applies a batch in arrival order in one write transaction, committed (with its fsync)
/// only if something was written. The idempotency tables are opened only when the batch has
/// keyed operations or a purge is due (`next_purge`, ms since the Unix epoch): a table opened
/// costs a lookup and a root update in every commit, and most batches are raises alone.
fn commit_batch(
    db: &Database,
    tables: Tables<'_>,
    batch: &[Op],
    shared: &Shared,
    next_purge: &mut u64,
    live: &mut Running,
) -> Result<BatchResult, redb::Error> {
    let txn = db.begin_write()?;
    let now = shared.now_ms();
    let monotonic = Instant::now();
    let mut answers = Vec::with_capacity(batch.len());
    // Raises within this batch, applied in arrival order.
    let mut raised: HashMap<Box<str>, u64> = HashMap::new();
    let mut wrote = false;
    let keyed = batch.iter().any(|op| !matches!(op, Op::Raise { .. }));
    let purging = keyed || now >= *next_purge;
    {
        let mut fences = txn.open_table(tables.fences)?;
        let mut idempotency = if purging {
            Some((
                txn.open_table(tables.records)?,
                txn.open_table(tables.expiries)?,
            ))
        } else {
            None
        };
        let current = |raised: &HashMap<Box<str>, u64>, resource: &str| {
            raised
                .get(resource)
                .copied()
                .or_else(|| shared.maxima.get(resource).map(|v| *v))
        };
        for op in batch {
            let answer = match op {
                Op::Raise {
                    resource,
                    token,
                    equal,
                    ..
                } => {
                    let verdict = decide(current(&raised, resource), *token, *equal);
                    if verdict.raised(*token) {
                        fences.insert(&**resource, *token)?;
                        raised.insert(resource.clone(), *token);
                        wrote = true;
                    }
                    Answer::Verdict(verdict)
                }
                Op::Begin {
                    resource,
                    key,
                    claim,
                    ..
                } => {
                    let (records, expiries) = idempotency.as_mut().expect("opened for keys");
                    let k = record_key(resource, key);
                    let existing = match read_record(records, &k)? {
                        Ok(existing) => existing,
                        Err(e) => {
                            answers.push(Answer::Failed(e));
                            continue;
                        }
                    };
                    let record = existing
                        .as_ref()
                        .filter(|(at, r)| *at > now || running(live, &k, r, monotonic))
                        .map(|(_, r)| r);
                    let maximum = current(&raised, resource);
                    let begin = idempotency::decide(record, maximum, claim);
                    if let Begin::Execute { .. } = begin {
                        if maximum.is_none_or(|c| claim.token > c) {
                            fences.insert(&**resource, claim.token)?;
                            raised.insert(resource.clone(), claim.token);
                        }
                        let record = claim.in_flight();
                        let old = existing.map(|(at, _)| at);
                        let at = expiry_ms(now, claim.window);
                        write_record(records, expiries, &k, old, at, &record)?;
                        // Kept even if this batch fails to commit: it names an attempt whose
                        // record then does not exist, and it goes at its deadline.
                        live.insert(k, (claim.attempt, monotonic.checked_add(claim.window)));
                        wrote = true;
                    }
                    Answer::Begin(begin)
                }
                Op::Finish {
                    resource,
                    key,
                    claim,
                    outcome,
                    ..
                } => {
                    let (records, expiries) = idempotency.as_mut().expect("opened for keys");
                    let k = record_key(resource, key);
                    let existing = match read_record(records, &k)? {
                        Ok(existing) => existing,
                        Err(e) => {
                            answers.push(Answer::Failed(e));
                            continue;
                        }
                    };
                    let ours = match existing {
                        Some((at, record))
                            if (at > now || running(live, &k, &record, monotonic))
                                && record.owned_by(claim) =>
                        {
                            let next = expiry_ms(now, claim.window);
                            write_record(records, expiries, &k, Some(at), next, outcome)?;
                            live.remove(&k);
                            true
                        }
                        _ => false,
                    };
                    wrote |= ours;
                    Answer::Finished(ours)
                }
            };
            answers.push(answer);
        }
        if let (true, Some((records, expiries))) = (wrote, idempotency.as_mut()) {
            live.retain(|_, (_, deadline)| deadline.is_none_or(|d| d > monotonic));
            purge(records, expiries, now, live, monotonic)?;
            *next_purge = now.saturating_add(PURGE_EVERY_MS);
        }
    }
    if wrote {
        txn.commit()?;
    }
    Ok((answers, raised, wrote))
}

/// A record as stored: when it expires (ms since the Unix epoch), and the record.
type Stored = Option<(u64, Record)>;

/// The stored record under `key` with its expiry, expired or not. The inner error is a record
/// that does not decode: it fails the one operation, not the batch.
fn read_record(
    records: &Table<&'static str, (u64, &'static [u8])>,
    key: &str,
) -> Result<Result<Stored, StoreError>, redb::Error> {
    let Some(guard) = records.get(key)? else {
        return Ok(Ok(None));
    };
    let (at, bytes) = guard.value();
    Ok(Record::decode(bytes).map(|r| Some((at, r))).map_err(|e| {
        StoreError::Unavailable(format!("the idempotency record {key:?} is unreadable: {e}"))
    }))
}

/// Writes `record` under `key` to expire at `at`, moving its entry in the expiry index from
/// `old` (the expiry of the record it replaces, if any).
fn write_record(
    records: &mut Table<&'static str, (u64, &'static [u8])>,
    expiries: &mut Table<(u64, &'static str), ()>,
    key: &str,
    old: Option<u64>,
    at: u64,
    record: &Record,
) -> Result<(), redb::Error> {
    if let Some(old) = old {
        expiries.remove((old, key))?;
    }
    records.insert(key, (at, record.encode().as_slice()))?;
    expiries.insert((at, key), ())?;
    Ok(())
}

/// Removes records that expired at or before `now`, visiting only those (at most
/// [`MAX_PURGE`]).
fn purge(
    records: &mut Table<&'static str, (u64, &'static [u8])>,
    expiries: &mut Table<(u64, &'static str), ()>,
    now: u64,
    live: &Running,
    monotonic: Instant,
) -> Result<(), redb::Error> {
    let mut expired = Vec::new();
    for entry in expiries
        .range(..(now.saturating_add(1), ""))?
        .take(MAX_PURGE)
    {
        let (index, _) = entry?;
        let (at, key) = index.value();
        expired.push((at, key.to_owned()));
    }
    for (at, key) in expired {
        // A running attempt's record stays, index entry and all, until its outcome or its
        // monotonic deadline.
        if live.contains_key(&key) {
            let guard = records.get(key.as_str())?;
            let bytes = guard.as_ref().map(|g| g.value().1.to_vec());
            drop(guard);
            let record = bytes.and_then(|b| Record::decode(&b).ok());
            if record.is_some_and(|r| running(live, &key, &r, monotonic)) {
                continue;
            }
        }
        expiries.remove((at, key.as_str()))?;
        // The index is exact, but never remove a record that does not expire here.
        let due = records
            .get(key.as_str())?
            .is_some_and(|g| g.value().0 == at);
        if due {
            records.remove(key.as_str())?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        {
            let store = EmbeddedStore::open(&path, "t").unwrap();
            let v = store
                .compare_and_raise("r", 9, EqualTokens::Allow)
                .await
                .unwrap();
            assert_eq!(v, Verdict::Admitted { previous: None });
            let v = store
                .compare_and_raise("r", 4, EqualTokens::Allow)
                .await
                .unwrap();
            assert_eq!(v, Verdict::Stale { current: 9 });
        }
        let store = EmbeddedStore::open(&path, "t").unwrap();
        assert_eq!(store.current("r").await.unwrap(), Some(9));
        let v = store
            .compare_and_raise("r", 8, EqualTokens::Allow)
            .await
            .unwrap();
        assert_eq!(v, Verdict::Stale { current: 9 });
    }

    fn claim(token: u64, window: Duration) -> Claim {
        Claim {
            token,
            fingerprint: crate::idempotency::Fingerprint([7; 32]),
            equal: EqualTokens::Allow,
            window,
            may_execute: true,
            attempt: crate::idempotency::AttemptId::next(),
        }
    }

    #[tokio::test]
    async fn records_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        let c = claim(4, Duration::from_secs(60));
        let done = Record {
            phase: Phase::Completed,
            status: Some(204),
            ..Record::in_flight(4, c.fingerprint)
        };
        {
            let store = EmbeddedStore::open(&path, "t").unwrap();
            assert_eq!(
                store.begin_idempotent("r", "k", &c).await.unwrap(),
                Begin::Execute { previous: None }
            );
            assert!(store.finish_idempotent("r", "k", &c, &done).await.unwrap());
        }
        let store = EmbeddedStore::open(&path, "t").unwrap();
        assert_eq!(store.current("r").await.unwrap(), Some(4));
        assert_eq!(
            store.begin_idempotent("r", "k", &c).await.unwrap(),
            Begin::Completed(done)
        );
    }

    #[tokio::test]
    async fn expired_records_are_absent_and_purged_by_later_writes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.db");
        {
            let store = EmbeddedStore::open(&path, "t").unwrap();
            let short = claim(1, Duration::from_millis(1));
            for key in ["a", "b", "c"] {
                assert!(matches!(
                    store.begin_idempotent("r", key, &short).await.unwrap(),
                    Begin::Execute { .. }
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            // Expired: the key executes again; this write purges the other two.
            assert_eq!(
                store.begin_idempotent("r", "a", &short).await.unwrap(),
                Begin::Execute { previous: Some(1) }
            );
            let long = claim(2, Duration::from_secs(60));
            assert!(matches!(
                store.begin_idempotent("r", "d", &long).await.unwrap(),
                Begin::Execute { .. }
            ));
        }
        let db = Database::create(&path).unwrap();
        let read = db.begin_read().unwrap();
        let names = Names::new("t");
        let records = read.open_table(Records::new(&names.records)).unwrap();
        let keys: Vec<String> = records
            .iter()
            .unwrap()
            .map(|row| row.unwrap().0.value().to_owned())
            .collect();
        assert_eq!(keys, [record_key("r", "d")]);
        let expiries = read.open_table(Expiries::new(&names.expiries)).unwrap();
        assert_eq!(redb::ReadableTableMetadata::len(&expiries).unwrap(), 1);
    }

    /// The wall clock steps an hour forward while an attempt runs: its in-flight record is
    /// past its stored expiry, but a retry is still refused as in flight (and no purge removes
    /// it), and the attempt's outcome lands. Records of attempts that ended do expire.
    #[tokio::test]
    async fn a_wall_clock_step_does_not_expire_a_running_attempt() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(&dir.path().join("f.db"), "t").unwrap();
        let a = claim(4, Duration::from_secs(60));
        assert_eq!(
            store.begin_idempotent("r", "k", &a).await.unwrap(),
            Begin::Execute { previous: None }
        );
        store
            .shared
            .clock_step_ms
            .store(3_600_000, Ordering::Relaxed);
        let retry = claim(4, Duration::from_secs(60));
        assert_eq!(
            store.begin_idempotent("r", "k", &retry).await.unwrap(),
            Begin::InFlight
        );
        // Another key's write purges what expired by the stepped clock.
        assert!(matches!(
            store.begin_idempotent("r", "other", &retry).await.unwrap(),
            Begin::Execute { .. }
        ));
        assert_eq!(
            store.begin_idempotent("r", "k", &retry).await.unwrap(),
            Begin::InFlight
        );
        let done = Record {
            phase: Phase::Completed,
            status: Some(204),
            ..Record::in_flight(4, a.fingerprint)
        };
        assert!(store.finish_idempotent("r", "k", &a, &done).await.unwrap());
        assert_eq!(
            store.begin_idempotent("r", "k", &retry).await.unwrap(),
            Begin::Completed(done)
        );
        // A further day: "other" is still `retry`'s running attempt here, so it stays.
        store
            .shared
            .clock_step_ms
            .store(3_600_000 + 86_400_000, Ordering::Relaxed);
        assert_eq!(
            store.begin_idempotent("r", "other", &a).await.unwrap(),
            Begin::InFlight
        );
        // "k" completed: its record is no attempt's any more, and the wall clock expires it.
        assert_eq!(
            store.begin_idempotent("r", "k", &a).await.unwrap(),
            Begin::Execute { previous: Some(4) }
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_raises_share_commits() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(EmbeddedStore::open(&dir.path().join("f.db"), "t").unwrap());
        let tasks: Vec<_> = (0..200u64)
            .map(|i| {
                let store = Arc::clone(&store);
                tokio::spawn(async move {
                    store
                        .compare_and_raise(&format!("r{}", i % 20), i, EqualTokens::Allow)
                        .await
                        .unwrap()
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        for r in 0..20u64 {
            let max = (0..200u64).filter(|i| i % 20 == r).max();
            assert_eq!(store.current(&format!("r{r}")).await.unwrap(), max);
        }
        // 200 raises queued while earlier syncs ran: far fewer commits than raises.
        assert!(store.commits() < 100, "{} commits", store.commits());
    }

    /// A writer that, once active, only ever wakes when told to (the test outlives its poll).
    fn patient(dir: &tempfile::TempDir) -> EmbeddedStore {
        EmbeddedStore::open_polling(&dir.path().join("f.db"), "t", Duration::from_secs(3600))
            .unwrap()
    }

    fn hooked_runtime() -> tokio::runtime::Runtime {
        let mut builder = tokio::runtime::Builder::new_current_thread();
        defer_wakes_to_park(&mut builder);
        builder.enable_all().build().unwrap()
    }

    /// Spins (no sleep) until `done`, for at most 10 s.
    fn until(what: &str, done: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::yield_now();
        }
    }

    #[test]
    fn raises_queued_before_the_runtime_parks_share_one_commit() {
        let dir = tempfile::tempdir().unwrap();
        let store = patient(&dir);
        until("the writer to go idle", || {
            store.shared.idle.load(Ordering::Relaxed)
        });
        hooked_runtime().block_on(async {
            // The writer is idle, so this wakes it at once; the runtime parks while it waits.
            let v = store
                .compare_and_raise("first", 1, EqualTokens::Allow)
                .await;
            assert_eq!(v.unwrap(), Verdict::Admitted { previous: None });
            assert_eq!(store.commits(), 1);
            // The writer has just committed: these wait for the runtime to park, then go
            // together.
            let raises: Vec<_> = (0..64)
                .map(|i| {
                    store.compare_and_raise(
                        ["a", "b", "c", "d"][i % 4],
                        2 + i as u64,
                        EqualTokens::Allow,
                    )
                })
                .collect();
            let mut verdicts = Vec::new();
            for raise in raises {
                verdicts.push(raise.await.unwrap());
            }
            assert_eq!(store.commits(), 2);
            assert_eq!(verdicts[0], Verdict::Admitted { previous: None });
            assert_eq!(verdicts[4], Verdict::Admitted { previous: Some(2) });
            assert_eq!(verdicts[63], Verdict::Admitted { previous: Some(61) });
        });
        assert_eq!(store.shared.maxima.get("d").map(|v| *v), Some(65));
    }

    #[test]
    fn a_store_whose_writer_has_stopped_is_not_healthy() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = EmbeddedStore::open(&dir.path().join("f.db"), "t").unwrap();
        assert!(store.healthy());
        // The writer returns once its queue is closed: the same end as a panic in it, seen
        // from the store.
        drop(store.queue.take());
        let writer = store.writer.as_ref().unwrap();
        writer.thread().unpark();
        until("the writer to stop", || writer.is_finished());
        assert!(!store.healthy());
    }

    #[tokio::test]
    async fn a_thread_without_the_hook_wakes_the_writer_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = patient(&dir);
        for token in 1..=3 {
            // After the first commit the writer waits an hour unless woken.
            let raise = store.compare_and_raise("r", token, EqualTokens::Allow);
            let v = tokio::time::timeout(Duration::from_secs(10), raise)
                .await
                .expect("the writer was not woken");
            assert!(matches!(v.unwrap(), Verdict::Admitted { .. }));
        }
        assert_eq!(store.commits(), 3);
    }

    #[test]
    fn an_idle_writer_is_woken_at_once_even_from_a_hooked_runtime() {
        let dir = tempfile::tempdir().unwrap();
        let poll = Duration::from_micros(1);
        let store = EmbeddedStore::open_polling(&dir.path().join("f.db"), "t", poll).unwrap();
        hooked_runtime().block_on(async {
            let v = store.compare_and_raise("r", 1, EqualTokens::Allow).await;
            assert_eq!(v.unwrap(), Verdict::Admitted { previous: None });
            until("the writer to go idle", || {
                store.shared.idle.load(Ordering::Relaxed)
            });
            // Queued without letting the runtime park: only an immediate wake commits it.
            let raise = store.compare_and_raise("r", 2, EqualTokens::Allow);
            until("the second commit", || store.commits() == 2);
            assert_eq!(
                raise.await.unwrap(),
                Verdict::Admitted { previous: Some(1) }
            );
        });
    }
}
