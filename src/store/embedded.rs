//! Durable maxima in a redb file on local disk.
//!
//! Every raise is committed with an fsync before the write it admits is forwarded, so a
//! `kill -9` never forgets a maximum. One writer thread owns all write transactions and commits
//! whatever raises queued up while the previous sync ran (group commit): under load many raises
//! share one sync instead of queueing for one each.
//!
//! All maxima are also held in memory (loaded at open, updated after each commit), so a stale
//! token or a repeat of the current token is answered without touching the disk. The cache only
//! ever holds durable values, and this process is the file's only writer (redb locks it).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use dashmap::DashMap;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use tokio::sync::oneshot;

use super::{decide, BoxFuture, FenceStore, StoreError, Verdict};
use crate::config::EqualTokens;

/// Upper bound on raises per transaction, so one batch cannot hold the queue for long.
const MAX_BATCH: usize = 4096;

struct Raise {
    resource: Box<str>,
    token: u64,
    equal: EqualTokens,
    reply: oneshot::Sender<Result<Verdict, StoreError>>,
}

struct Shared {
    /// Durable maxima, complete: a resource absent here is absent on disk.
    maxima: DashMap<Box<str>, u64>,
    healthy: AtomicBool,
    /// Committed write transactions, for tests and metrics of group commit.
    commits: AtomicU64,
}

pub struct EmbeddedStore {
    shared: Arc<Shared>,
    /// Queue to the writer thread; closing it stops the thread.
    queue: Option<mpsc::Sender<Raise>>,
    /// Joined on drop, so the database file is unlocked when the store is gone.
    writer: Option<std::thread::JoinHandle<()>>,
}

impl Drop for EmbeddedStore {
    fn drop(&mut self) {
        drop(self.queue.take());
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

impl EmbeddedStore {
    /// Opens (creating if needed) the database and loads every maximum into memory.
    pub fn open(path: &Path, prefix: &str) -> Result<Self, StoreError> {
        let fail = |what: &str, e: &dyn std::fmt::Display| {
            StoreError::Unavailable(format!("{what} {}: {e}", path.display()))
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| fail("cannot create the directory of", &e))?;
        }
        let db = Database::create(path).map_err(|e| fail("cannot open", &e))?;
        let table_name = format!("{prefix}.fences");
        let maxima = DashMap::new();
        {
            let table = TableDefinition::<&str, u64>::new(&table_name);
            let txn = db.begin_write().map_err(|e| fail("cannot write", &e))?;
            txn.open_table(table)
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
        });
        let (queue, rx) = mpsc::channel();
        let writer_shared = Arc::clone(&shared);
        let writer_path = path.to_owned();
        let writer = std::thread::Builder::new()
            .name("fencegate-store".into())
            .spawn(move || writer(writer_path, db, table_name, rx, writer_shared))
            .map_err(|e| fail("cannot start the writer for", &e))?;
        Ok(EmbeddedStore {
            shared,
            queue: Some(queue),
            writer: Some(writer),
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
        let raise = Raise {
            resource: resource.into(),
            token,
            equal,
            reply,
        };
        let sent = match &self.queue {
            Some(queue) => queue.send(raise).map_err(|_| ()),
            None => Err(()),
        };
        Box::pin(async move {
            sent.map_err(|_| StoreError::Unavailable("the store writer has stopped".into()))?;
            answer
                .await
                .map_err(|_| StoreError::Unavailable("the store writer has stopped".into()))?
        })
    }

    fn current<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<u64>, StoreError>> {
        let current = self.shared.maxima.get(resource).map(|v| *v);
        Box::pin(std::future::ready(Ok(current)))
    }

    fn healthy(&self) -> bool {
        self.shared.healthy.load(Ordering::Relaxed)
    }

    fn begin_idempotent<'a>(
        &'a self,
        _resource: &'a str,
        _key: &'a str,
        _claim: &'a crate::idempotency::Claim,
    ) -> BoxFuture<'a, Result<crate::idempotency::Begin, StoreError>> {
        Box::pin(std::future::ready(Err(StoreError::Unavailable(
            "idempotency records are not implemented for this store yet".into(),
        ))))
    }

    fn finish_idempotent<'a>(
        &'a self,
        _resource: &'a str,
        _key: &'a str,
        _claim: &'a crate::idempotency::Claim,
        _outcome: &'a crate::idempotency::Record,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(std::future::ready(Err(StoreError::Unavailable(
            "idempotency records are not implemented for this store yet".into(),
        ))))
    }

    fn kind(&self) -> &'static str {
        "embedded"
    }
}

/// How often a failed database is reopened and probed with a real write, so readiness comes
/// back once the disk does (a failed redb commit poisons the handle until it is reopened).
const RETRY: Duration = Duration::from_millis(500);

/// The writer thread: block for one raise, take every other queued one, commit them together.
fn writer(
    path: PathBuf,
    db: Database,
    table_name: String,
    rx: mpsc::Receiver<Raise>,
    shared: Arc<Shared>,
) {
    let table = TableDefinition::<&str, u64>::new(&table_name);
    let probe_name = format!("{table_name}.probe");
    let probe = TableDefinition::<&str, u64>::new(&probe_name);
    let mut db = Some(db);
    let mut batch = Vec::with_capacity(64);
    loop {
        let first = if shared.healthy.load(Ordering::Relaxed) {
            match rx.recv() {
                Ok(first) => first,
                Err(_) => return,
            }
        } else {
            match rx.recv_timeout(RETRY) {
                Ok(first) => first,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    recover(&path, &mut db, probe, &shared);
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
        };
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        if db.is_none() {
            db = Database::create(&path).ok();
        }
        let result = match &db {
            Some(handle) => commit_batch(handle, table, &batch, &shared).map_err(|e| e.to_string()),
            None => Err(format!("cannot reopen {}", path.display())),
        };
        match result {
            Ok((verdicts, raised)) => {
                shared.commits.fetch_add(1, Ordering::Relaxed);
                if !shared.healthy.swap(true, Ordering::Relaxed) {
                    tracing::info!(path = %path.display(), "fence store writable again");
                }
                // Publish only now that the values are durable.
                for (resource, token) in raised {
                    let mut slot = shared.maxima.entry(resource).or_insert(token);
                    *slot = (*slot).max(token);
                }
                for (raise, verdict) in batch.drain(..).zip(verdicts) {
                    let _ = raise.reply.send(Ok(verdict));
                }
            }
            Err(e) => {
                shared.healthy.store(false, Ordering::Relaxed);
                // Drop the handle: redb refuses further use after an I/O error.
                db = None;
                tracing::error!(path = %path.display(), error = %e, "fence store commit failed");
                for raise in batch.drain(..) {
                    let _ = raise.reply.send(Err(StoreError::Unavailable(e.clone())));
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

type BatchResult = (Vec<Verdict>, HashMap<Box<str>, u64>);

fn commit_batch(
    db: &Database,
    table: TableDefinition<&str, u64>,
    batch: &[Raise],
    shared: &Shared,
) -> Result<BatchResult, redb::Error> {
    let txn = db.begin_write()?;
    let mut verdicts = Vec::with_capacity(batch.len());
    // Raises within this batch, applied in arrival order.
    let mut raised: HashMap<Box<str>, u64> = HashMap::new();
    {
        let mut t = txn.open_table(table)?;
        for raise in batch {
            let current = raised
                .get(&raise.resource)
                .copied()
                .or_else(|| shared.maxima.get(&raise.resource).map(|v| *v));
            let verdict = decide(current, raise.token, raise.equal);
            if verdict.raised(raise.token) {
                t.insert(&*raise.resource, raise.token)?;
                raised.insert(raise.resource.clone(), raise.token);
            }
            verdicts.push(verdict);
        }
    }
    if !raised.is_empty() {
        txn.commit()?;
    }
    Ok((verdicts, raised))
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
}
