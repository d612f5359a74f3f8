//! Forgetting maxima not raised for `fence.retention`: every raise sets `raised_at` while it
//! is on and this run's retention mark is fresh (`NULL` otherwise: such maxima are kept; a
//! run without retention also takes the `raised_at` of the others away when it finds a mark,
//! see [`crate::store::retention`]), and a pass every [`PURGE_EVERY`](super::records::PURGE_EVERY), started
//! by the health probe, deletes the rows raised before the period, [`PURGE_BATCH`] at a time.
//! A row raised meanwhile is a new row version, which the `ctid` re-check leaves alone.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use deadpool_postgres::Pool;

use super::records::{pass_due, PURGE_BATCH};
use super::{failed, PostgresRemote};
use crate::store::retention::Freshness;
use crate::store::StoreError;

/// The statements and state of forgetting.
pub(super) struct Forget {
    /// The index of `raised_at`, created (without blocking writes) before the first pass.
    index: String,
    delete: String,
    /// The period in ms; 0: keep every maximum.
    retention_ms: AtomicU64,
    /// When the last pass started.
    last: Mutex<Option<Instant>>,
    /// Whether this run's last mark is fresh enough to age raises ([`crate::store::retention`]).
    pub(super) fresh: Freshness,
    /// The retention mark: written, read, deleted if unchanged.
    pub(super) mark: String,
    pub(super) read_mark: String,
    pub(super) unmark: String,
    /// Takes the age of [`PURGE_BATCH`] maxima away.
    keep: String,
}

impl Forget {
    /// Off until [`PostgresRemote::forget_after`] turns it on. `marks` is the table of the
    /// retention mark (one row at most).
    pub(super) fn new(table: &str, marks: &str) -> Self {
        Forget {
            index: format!(
                "CREATE INDEX CONCURRENTLY IF NOT EXISTS {table}_raised ON {table} (raised_at)"
            ),
            // The rows are locked as they are picked, skipping those a raise holds (it makes
            // them young again): a batch of raises locks rows in resource order, this in the
            // table's, and waiting for each other's rows would deadlock.
            delete: format!(
                "DELETE FROM {table} \
                 WHERE ctid = ANY (ARRAY(\
                   SELECT ctid FROM {table} \
                   WHERE raised_at < now() - make_interval(secs => $1) LIMIT $2 \
                   FOR UPDATE SKIP LOCKED)) \
                   AND raised_at < now() - make_interval(secs => $1)"
            ),
            retention_ms: AtomicU64::new(0),
            last: Mutex::new(None),
            fresh: Freshness::default(),
            mark: format!(
                "INSERT INTO {marks} (only_row, mark, written_at) VALUES (true, $1, now()) \
                 ON CONFLICT (only_row) DO UPDATE SET mark = EXCLUDED.mark, written_at = now()"
            ),
            read_mark: format!("SELECT mark FROM {marks}"),
            unmark: format!("DELETE FROM {marks} WHERE mark = $1"),
            keep: format!(
                "UPDATE {table} SET raised_at = NULL \
                 WHERE ctid = ANY (ARRAY(\
                   SELECT ctid FROM {table} WHERE raised_at IS NOT NULL LIMIT $1 \
                   FOR UPDATE SKIP LOCKED)) \
                   AND raised_at IS NOT NULL"
            ),
        }
    }
}

impl PostgresRemote {
    /// Whether raises record when they happened: `fence.retention` is on and this run's mark
    /// is fresh.
    pub(super) fn aging(&self) -> bool {
        self.forget.retention_ms.load(Ordering::Relaxed) > 0 && self.forget.fresh.fresh()
    }

    /// The period `forget_after` set.
    pub(super) fn retention(&self) -> Option<Duration> {
        match self.forget.retention_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    /// Takes the age of every maximum away, [`PURGE_BATCH`] rows per statement; a row raised
    /// meanwhile is a new row version, which the `ctid` re-check leaves (the next sweep takes
    /// its age). Returns how many rows had one.
    pub(super) async fn keep_all(&self) -> Result<u64, StoreError> {
        let client = self.client().await?;
        let mut kept = 0;
        loop {
            let n = client
                .execute(&self.forget.keep, &[&PURGE_BATCH])
                .await
                .map_err(|e| self.failed(&e))?;
            kept += n;
            if n < PURGE_BATCH as u64 {
                return Ok(kept);
            }
        }
    }

    /// Turns forgetting on, and starts a pass at once (the health probe starts the next ones).
    pub(super) fn forget_after(&self, period: Duration) {
        let ms = crate::store::retention_ms(period);
        self.forget.retention_ms.store(ms, Ordering::Relaxed);
        self.maybe_forget(true);
    }

    /// Starts a pass forgetting maxima past the retention in the background, if retention is
    /// on and none started within [`PURGE_EVERY`](super::records::PURGE_EVERY) (or ever, with `now`).
    pub(super) fn maybe_forget(&self, now: bool) {
        let ms = self.forget.retention_ms.load(Ordering::Relaxed);
        if ms == 0 {
            return;
        }
        if !pass_due(&self.forget.last, now) {
            return;
        }
        let pool = self.pool.clone();
        let (index, delete) = (self.forget.index.clone(), self.forget.delete.clone());
        let secs = ms as f64 / 1000.0;
        tokio::spawn(async move {
            match forget(&pool, &index, &delete, secs).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(forgotten = n, "forgot maxima past fence.retention"),
                Err(e) => {
                    tracing::warn!(error = %e, "forgetting maxima past fence.retention failed")
                }
            }
        });
    }
}

impl PostgresRemote {
    /// One pass forgetting the maxima raised more than `secs` ago, now, in this task.
    #[cfg(test)]
    pub(super) async fn forget_now(&self, secs: f64) -> Result<u64, StoreError> {
        forget(&self.pool, &self.forget.index, &self.forget.delete, secs).await
    }
}

/// Deletes the maxima raised more than `secs` ago, creating the index of `raised_at` first if
/// it is missing. Returns how many it deleted.
async fn forget(pool: &Pool, index: &str, delete: &str, secs: f64) -> Result<u64, StoreError> {
    let client = pool.get().await.map_err(|e| failed(&e))?;
    client.batch_execute(index).await.map_err(|e| failed(&e))?;
    let mut deleted = 0;
    loop {
        let n = client
            .execute(delete, &[&secs, &PURGE_BATCH])
            .await
            .map_err(|e| failed(&e))?;
        deleted += n;
        if n < PURGE_BATCH as u64 {
            return Ok(deleted);
        }
    }
}
