//! The writer thread: every write transaction, committed in groups.

use super::retention::{self, Ages};
use super::*;
use crate::fence::token::Token;

/// How often a failed database is reopened and probed with a real write, so readiness comes
/// back once the disk does (a failed redb commit poisons the handle until it is reopened).
const RETRY: Duration = Duration::from_millis(500);

/// The tables one write transaction works on.
#[derive(Clone, Copy)]
struct Tables<'n> {
    fences: TableDefinition<'n, &'static str, u64>,
    records: Records<'n>,
    expiries: Expiries<'n>,
    raised: Raised<'n>,
    raised_order: RaisedOrder<'n>,
}

/// The writer thread: wait for operations, take every queued one, commit them together.
pub(super) fn writer(
    path: PathBuf,
    db: Arc<Database>,
    names: Names,
    rx: mpsc::Receiver<Op>,
    shared: Arc<Shared>,
    poll: Duration,
) {
    let tables = Tables {
        fences: TableDefinition::new(&names.fences),
        records: Records::new(&names.records),
        expiries: Expiries::new(&names.expiries),
        raised: Raised::new(&names.raised),
        raised_order: RaisedOrder::new(&names.raised_order),
    };
    let probe_name = format!("{}.probe", names.fences);
    let probe = TableDefinition::<&str, u64>::new(&probe_name);
    let mut db = Some(db);
    let mut batch = Vec::with_capacity(64);
    let mut next_purge = 0;
    // When to look for maxima to forget next (ms since the Unix epoch; with retention only).
    let mut next_forget: u64 = 0;
    // Whether the raise times of an earlier run with retention are known to be gone (see
    // `Due::ages_dropped`).
    let mut ages_dropped = false;
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
        // With retention, how long until forgetting is due (zero: now).
        let until_forget = (shared.retention_ms.load(Ordering::Relaxed) > 0)
            .then(|| Duration::from_millis(next_forget.saturating_sub(shared.now_ms())));
        let forget_due = until_forget.is_some_and(|d| d.is_zero());
        if batch.is_empty() && !(forget_due && !closed && shared.healthy.load(Ordering::Relaxed)) {
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
                    Some(left) if !left.is_zero() => {
                        #[cfg(test)]
                        shared.active_wait.store(true, Ordering::SeqCst);
                        std::thread::park_timeout(left);
                        #[cfg(test)]
                        shared.active_wait.store(false, Ordering::SeqCst);
                    }
                    _ => active_until = None,
                }
            } else {
                shared.idle.store(true, Ordering::Relaxed);
                // Pairs with the fence in `EmbeddedStore::wake`.
                fence(Ordering::SeqCst);
                match rx.try_recv() {
                    Ok(op) => batch.push(op),
                    Err(mpsc::TryRecvError::Empty) => match until_forget {
                        Some(left) => std::thread::park_timeout(left),
                        None => std::thread::park(),
                    },
                    // The next look returns.
                    Err(mpsc::TryRecvError::Disconnected) => {}
                }
                shared.idle.store(false, Ordering::Relaxed);
            }
            continue;
        }
        active_until = Some(Instant::now() + poll);
        if db.is_none() {
            db = reopen(&path, &shared);
        }
        let result = match &db {
            Some(handle) => {
                let due = Due {
                    purge: &mut next_purge,
                    forget: &mut next_forget,
                    ages_dropped: &mut ages_dropped,
                };
                commit_batch(handle, tables, &batch, &shared, due, &mut live)
                    .map_err(|e| e.to_string())
            }
            None => Err(format!("cannot reopen {}", path.display())),
        };
        match result {
            Ok((answers, maxima, committed, forgotten)) => {
                if committed {
                    shared.commits.fetch_add(1, Ordering::Relaxed);
                }
                if !shared.healthy.swap(true, Ordering::Relaxed) {
                    tracing::info!(path = %path.display(), "fence store writable again");
                }
                // Only now that the values are durable, and before anyone is answered: each
                // is the resource's durable maximum until this thread's next commit, which
                // clears the mark first.
                for resource in &forgotten {
                    shared.cache.forget(resource);
                }
                for (resource, (value, _)) in maxima {
                    if let Some(value) = value {
                        shared.cache.confirm(&resource, value);
                    }
                }
                for (op, answer) in batch.drain(..).zip(answers) {
                    op.reply(Ok(answer));
                }
            }
            Err(e) => {
                shared.healthy.store(false, Ordering::Relaxed);
                // Drop the handle: redb refuses further use after an I/O error.
                shared.db.store(None);
                db = None;
                tracing::error!(path = %path.display(), error = %e, "fence store commit failed");
                for op in batch.drain(..) {
                    op.reply(Err(StoreError::unreachable(e.clone())));
                }
            }
        }
    }
}

/// Opens the database again and hands it to readers too. Fails while a reader still holds
/// the handle dropped after a failure (redb locks the file); the next attempt may succeed.
fn reopen(path: &Path, shared: &Shared) -> Option<Arc<Database>> {
    let db = open_file(path).ok().map(Arc::new);
    shared.db.store(db.clone());
    db
}

/// Reopens the database if needed and proves it writable with a real commit.
fn recover(
    path: &Path,
    db: &mut Option<Arc<Database>>,
    probe: TableDefinition<&str, u64>,
    shared: &Shared,
) {
    if db.is_none() {
        *db = reopen(path, shared);
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
            shared.db.store(None);
            *db = None;
            tracing::debug!(path = %path.display(), error = %e, "fence store still not writable");
        }
    }
}

/// The maxima a batch read from the table or raised: the value after the batch (`None`: no
/// maximum recorded), and whether the batch raised it.
type Maxima = HashMap<Box<str>, (Option<Token>, bool)>;

/// The answers in batch order, the maxima the batch read or raised, whether anything was
/// committed, and the resources whose maxima it forgot.
type BatchResult = (Vec<Answer>, Maxima, bool, Vec<Box<str>>);

/// When the writer's periodic work is due next (ms since the Unix epoch).
struct Due<'a> {
    /// Purging expired idempotency records.
    purge: &'a mut u64,
    /// Forgetting maxima past the retention (with retention only).
    forget: &'a mut u64,
    /// Without retention, the first commit drops the raise times an earlier run with retention
    /// left: raises while retention is off do not keep them, so turned on again later they
    /// would date maxima by a raise long past and forget them however recently raised.
    ages_dropped: &'a mut bool,
}

/// The durable maximum of `resource` as of this point of the batch: what the batch raised it
/// to, else what the table holds (read once per batch).
fn maximum(
    fences: &Table<&'static str, u64>,
    maxima: &mut Maxima,
    resource: &str,
) -> Result<Option<Token>, redb::Error> {
    if let Some((value, _)) = maxima.get(resource) {
        return Ok(*value);
    }
    let value = fences
        .get(resource)?
        .map(|v| stored(v.value()))
        .transpose()?;
    maxima.insert(resource.into(), (value, false));
    Ok(value)
}

/// Raises the maximum of `resource` to `token` in the table and in `maxima`, and records when
/// (with retention).
fn raise(
    fences: &mut Table<&'static str, u64>,
    ages: &mut Option<Ages<'_>>,
    maxima: &mut Maxima,
    resource: &str,
    token: Token,
) -> Result<(), redb::Error> {
    fences.insert(resource, token.get())?;
    if let Some(ages) = ages {
        ages.touch(resource)?;
    }
    maxima.insert(resource.into(), (Some(token), true));
    Ok(())
}

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
    due: Due<'_>,
    live: &mut Running,
) -> Result<BatchResult, redb::Error> {
    let next_purge = due.purge;
    let txn = db.begin_write()?;
    let now = shared.now_ms();
    let monotonic = Instant::now();
    let mut answers = Vec::with_capacity(batch.len());
    // Maxima read and raised within this batch, applied in arrival order.
    let mut maxima = Maxima::new();
    let mut wrote = false;
    let keyed = batch.iter().any(|op| !matches!(op, Op::Raise { .. }));
    let purging = keyed || now >= *next_purge;
    let retention = shared.retention_ms.load(Ordering::Relaxed);
    let mut forgotten = Vec::new();
    {
        let mut fences = txn.open_table(tables.fences)?;
        let mut ages = if retention > 0 {
            Some(Ages {
                raised: txn.open_table(tables.raised)?,
                order: txn.open_table(tables.raised_order)?,
                now,
            })
        } else {
            None
        };
        if retention == 0 && !*due.ages_dropped {
            let dropped =
                txn.delete_table(tables.raised)? | txn.delete_table(tables.raised_order)?;
            wrote |= dropped;
        }
        // Before the batch's operations, so they decide against what is left.
        if let Some(ages) = ages.as_mut().filter(|_| now >= *due.forget) {
            let cutoff = now.saturating_sub(retention);
            let n = ages.forget(&mut fences, cutoff, &mut forgotten)?;
            wrote |= n > 0;
            *due.forget = if n == retention::MAX_FORGET {
                now
            } else {
                now.saturating_add(retention::EVERY_MS)
            };
        }
        let mut idempotency = if purging {
            Some((
                txn.open_table(tables.records)?,
                txn.open_table(tables.expiries)?,
            ))
        } else {
            None
        };
        for op in batch {
            let answer = match op {
                Op::Raise {
                    resource,
                    token,
                    rule,
                    ..
                } => {
                    // Against the table, never the cache: a cached value is only a lower bound.
                    let current = maximum(&fences, &mut maxima, resource)?;
                    let verdict = decide(current, *token, *rule);
                    if verdict.raised(*token) {
                        raise(&mut fences, &mut ages, &mut maxima, resource, *token)?;
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
                    let found = match Found::read(records, live, (resource, key), now, monotonic)? {
                        Ok(found) => found,
                        Err(unreadable) => {
                            answers.push(Answer::Failed(unreadable));
                            continue;
                        }
                    };
                    let current = maximum(&fences, &mut maxima, resource)?;
                    let begin = idempotency::decide(found.live.as_ref(), current, claim);
                    if let Begin::Execute { .. } = begin {
                        if current.is_none_or(|c| claim.token > c) {
                            raise(&mut fences, &mut ages, &mut maxima, resource, claim.token)?;
                        }
                        let record = claim.in_flight();
                        let at = expiry_ms(now, claim.window);
                        write_record(records, expiries, &found.key, found.expires, at, &record)?;
                        // Kept even if this batch fails to commit: it names an attempt whose
                        // record then does not exist, and it goes at its deadline.
                        let written = Written {
                            at,
                            attempt: Some(claim.attempt),
                            deadline: monotonic.checked_add(claim.window),
                        };
                        live.insert(found.key, written);
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
                    let found = match Found::read(records, live, (resource, key), now, monotonic)? {
                        Ok(found) => found,
                        Err(unreadable) => {
                            answers.push(Answer::Failed(unreadable));
                            continue;
                        }
                    };
                    let ours = found.live.is_some_and(|record| record.owned_by(claim));
                    if ours {
                        let next = expiry_ms(now, claim.window);
                        write_record(records, expiries, &found.key, found.expires, next, outcome)?;
                        let written = Written {
                            at: next,
                            attempt: None,
                            deadline: monotonic.checked_add(claim.window),
                        };
                        live.insert(found.key, written);
                    }
                    wrote |= ours;
                    Answer::Finished(ours)
                }
            };
            answers.push(answer);
        }
        if let (true, Some((records, expiries))) = (wrote, idempotency.as_mut()) {
            live.retain(|_, w| w.deadline.is_none_or(|d| d > monotonic));
            purge(records, expiries, now, live, monotonic)?;
            *next_purge = now.saturating_add(PURGE_EVERY_MS);
        }
    }
    if wrote {
        // Before the raised values become durable, and readable by read transactions: their
        // cached values are lower bounds from here until confirmed after the commit.
        for (resource, _) in maxima.iter().filter(|(_, (_, raised))| *raised) {
            shared.cache.unconfirm(resource);
        }
        // Their maxima are about to be gone: no cached value is exact from here.
        for resource in &forgotten {
            shared.cache.unconfirm(resource);
        }
        #[cfg(test)]
        if let Some(look) = shared.before_commit.lock().unwrap().as_mut() {
            look(&shared.cache);
        }
        txn.commit()?;
    }
    // Committed, or nothing to drop.
    if retention == 0 {
        *due.ages_dropped = true;
    }
    Ok((answers, maxima, wrote, forgotten))
}
