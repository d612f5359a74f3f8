//! Leases in a redb file on local disk, for a single node.
//!
//! One row per resource, `resource -> (token, expires_at_unix_ms, lease_id, holder)`, in the
//! table `<prefix>.leases`. Rows are never deleted: a release clears the holder and the lease id
//! and sets `expires_at` to 0, keeping the token, so tokens keep growing across release, expiry
//! and restart. Every change is committed with an fsync (redb's default durability) before the
//! call returns.
//!
//! Expiry: the row carries a wall-clock deadline so that it survives a restart, but within one
//! process liveness is judged on the monotonic clock (the deadline of each grant and renewal
//! made here, or of a row first read after a restart), so a wall-clock step cannot expire a lease
//! early or keep it alive late while fencegate runs. The agent is in the same process, so the
//! backend's clock and the agent's are the same clock.
//!
//! Events: a release wakes `changed()` waiters through an in-process [`Notify`](tokio::sync::Notify); an expiry wakes
//! them with a timer at the (monotonic) deadline seen when they started waiting. Grant events
//! are in-process too, so the subscription is always live: a grant is announced after its
//! commit and before `try_acquire` returns (and so is an acquisition that failed with an error,
//! since a failed commit may still have reached the disk).

mod admin;
pub use admin::EmbeddedLeasesAdmin;

use crate::fence::token::Token;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use super::backend::{Acquired, Grant, GrantEvents, LeaseBackend, LeaseError};
use super::shared::{new_lease_id, GrantFeed, Waiters};
use crate::conn::BoxFuture;
use crate::sync::Locked;

/// `(token, expires_at_unix_ms, lease_id, holder)`; a released lease has expiry 0 and empty
/// lease id and holder.
type Row<'a> = (u64, u64, &'a str, &'a str);
type Table<'a> = TableDefinition<'a, &'static str, Row<'static>>;

pub struct EmbeddedLeases {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    table: String,
    /// Serialises every access. `None` after an I/O error: redb refuses further use of a
    /// handle whose commit failed, so the next call reopens the file.
    state: Mutex<State>,
    waiters: Waiters,
    grants: GrantFeed,
}

struct State {
    db: Option<Database>,
    /// Monotonic deadline of each resource's current lease, as far as this process knows it
    /// (absent: not read since open). Only ever describes the row currently on disk.
    deadlines: HashMap<String, Instant>,
}

impl EmbeddedLeases {
    /// Opens (creating if needed) the database and its table.
    pub fn open(path: &Path, prefix: &str) -> Result<Self, LeaseError> {
        let fail = |what: &str, e: &dyn std::fmt::Display| {
            LeaseError::unreachable(format!("{what} {}: {e}", path.display()))
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| fail("cannot create the directory of", &e))?;
        }
        let db = Database::create(path)
            .map_err(|e| LeaseError::unreachable(crate::conn::embedded::open_error(path, &e)))?;
        let table = format!("{prefix}.leases");
        {
            let txn = db.begin_write().map_err(|e| fail("cannot write", &e))?;
            txn.open_table(Table::new(&table))
                .map_err(|e| fail("cannot open table in", &e))?;
            txn.commit().map_err(|e| fail("cannot commit to", &e))?;
        }
        Ok(EmbeddedLeases {
            inner: Arc::new(Inner {
                path: path.to_owned(),
                table,
                state: Mutex::new(State {
                    db: Some(db),
                    deadlines: HashMap::new(),
                }),
                waiters: Waiters::default(),
                grants: GrantFeed::new(true),
            }),
        })
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// What a row says about the current lease.
struct Current {
    token: Token,
    lease_id: String,
    holder: String,
    /// Monotonic deadline; `None` when released.
    deadline: Option<Instant>,
}

impl Current {
    fn live(&self, now: Instant) -> bool {
        self.deadline.is_some_and(|d| d > now)
    }
}

impl Inner {
    /// Runs `f` with the database (reopened if a previous failure dropped it) under the lock.
    fn with<T>(
        &self,
        f: impl FnOnce(&Database, &mut HashMap<String, Instant>, &str) -> Result<T, redb::Error>,
    ) -> Result<T, LeaseError> {
        let mut state = self.state.locked();
        let state = &mut *state;
        if state.db.is_none() {
            state.db = Some(Database::create(&self.path).map_err(|e| {
                LeaseError::unreachable(format!("cannot reopen {}: {e}", self.path.display()))
            })?);
            // A failed commit may or may not have reached the disk: read deadlines afresh.
            state.deadlines.clear();
        }
        let db = state.db.as_ref().expect("opened above");
        match f(db, &mut state.deadlines, &self.table) {
            Ok(v) => Ok(v),
            Err(e) => {
                // Drop the handle: after an I/O error redb wants a fresh one.
                state.db = None;
                tracing::error!(path = %self.path.display(), error = %e, "lease database failed");
                Err(LeaseError::unreachable(format!(
                    "lease database {}: {e}",
                    self.path.display()
                )))
            }
        }
    }
}

/// `now + d`, or as late as the clock goes: a lease deadline past the clock's range is held
/// "forever" (until released), never treated as already expired.
fn later(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .or_else(|| now.checked_add(FOREVER))
        .unwrap_or(now)
}

/// About a century: beyond any lease, within any monotonic clock's range.
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Reads a resource's row (inside a transaction) and judges it on the monotonic clock.
fn current(
    table: &impl ReadableTable<&'static str, Row<'static>>,
    deadlines: &mut HashMap<String, Instant>,
    resource: &str,
) -> Result<Option<Current>, redb::Error> {
    let Some(row) = table.get(resource)? else {
        return Ok(None);
    };
    let (token, expires_ms, lease_id, holder) = row.value();
    let token = Token::try_from(token).map_err(|e| redb::Error::Corrupted(e.to_string()))?;
    let deadline = if expires_ms == 0 {
        None
    } else {
        // First sight since open: convert the stored wall-clock deadline once.
        Some(*deadlines.entry(resource.to_owned()).or_insert_with(|| {
            later(
                Instant::now(),
                Duration::from_millis(expires_ms.saturating_sub(unix_ms())),
            )
        }))
    };
    Ok(Some(Current {
        token,
        lease_id: lease_id.to_owned(),
        holder: holder.to_owned(),
        deadline,
    }))
}

impl Inner {
    fn try_acquire(
        &self,
        resource: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Acquired, LeaseError> {
        let acquired = self.grant(resource, holder, ttl);
        if !matches!(acquired, Ok(Acquired::Held { .. })) {
            self.grants.changed(resource);
        }
        acquired
    }

    fn grant(&self, resource: &str, holder: &str, ttl: Duration) -> Result<Acquired, LeaseError> {
        self.with(|db, deadlines, table| {
            let txn = db.begin_write()?;
            let granted = {
                let mut t = txn.open_table(Table::new(table))?;
                let now = Instant::now();
                let current = current(&t, deadlines, resource)?;
                match current {
                    Some(c) if c.live(now) => Err(c.holder),
                    current => {
                        let next = current.map_or(Some(Token::from(1u32)), |c| c.token.next());
                        let Some(token) = next else {
                            return Err(redb::Error::Corrupted(format!(
                                "{resource}: the token is 2^63-1, no higher one can be granted"
                            )));
                        };
                        let lease_id = new_lease_id();
                        let expires = unix_ms().saturating_add(ms(ttl)).max(1);
                        t.insert(resource, (token.get(), expires, lease_id.as_str(), holder))?;
                        Ok((token, lease_id, later(now, ttl)))
                    }
                }
            };
            match granted {
                Err(holder) => Ok(Acquired::Held {
                    holder: Some(holder),
                }),
                Ok((token, lease_id, deadline)) => {
                    txn.commit()?;
                    deadlines.insert(resource.to_owned(), deadline);
                    Ok(Acquired::Granted(Grant {
                        resource: resource.to_owned(),
                        holder: holder.to_owned(),
                        lease_id,
                        token,
                    }))
                }
            }
        })
    }

    fn renew(&self, grant: &Grant, ttl: Duration) -> Result<bool, LeaseError> {
        self.with(|db, deadlines, table| {
            let txn = db.begin_write()?;
            let renewed = {
                let mut t = txn.open_table(Table::new(table))?;
                let now = Instant::now();
                match current(&t, deadlines, &grant.resource)? {
                    Some(c) if c.live(now) && c.lease_id == grant.lease_id => {
                        let expires = unix_ms().saturating_add(ms(ttl)).max(1);
                        t.insert(
                            &*grant.resource,
                            (
                                c.token.get(),
                                expires,
                                c.lease_id.as_str(),
                                c.holder.as_str(),
                            ),
                        )?;
                        Some(later(now, ttl))
                    }
                    _ => None,
                }
            };
            match renewed {
                Some(deadline) => {
                    txn.commit()?;
                    deadlines.insert(grant.resource.clone(), deadline);
                    Ok(true)
                }
                None => Ok(false),
            }
        })
    }

    fn release(&self, grant: &Grant) -> Result<bool, LeaseError> {
        let released = self.with(|db, deadlines, table| {
            let txn = db.begin_write()?;
            let released = {
                let mut t = txn.open_table(Table::new(table))?;
                match current(&t, deadlines, &grant.resource)? {
                    Some(c) if c.live(Instant::now()) && c.lease_id == grant.lease_id => {
                        t.insert(&*grant.resource, (c.token.get(), 0, "", ""))?;
                        true
                    }
                    _ => false,
                }
            };
            if released {
                txn.commit()?;
                deadlines.remove(&grant.resource);
            }
            Ok(released)
        })?;
        if released {
            self.waiters.wake(&grant.resource);
        }
        Ok(released)
    }

    fn latest_token(&self, resource: &str) -> Result<Option<Token>, LeaseError> {
        self.with(|db, _, table| {
            let txn = db.begin_read()?;
            let t = txn.open_table(Table::new(table))?;
            let latest = t.get(resource)?.map(|row| Token::try_from(row.value().0));
            latest
                .transpose()
                .map_err(|e| redb::Error::Corrupted(e.to_string()))
        })
    }

    /// The monotonic deadline of the live lease on `resource`, `None` if it is free.
    fn live_until(&self, resource: &str) -> Result<Option<Instant>, LeaseError> {
        self.with(|db, deadlines, table| {
            let txn = db.begin_read()?;
            let t = txn.open_table(Table::new(table))?;
            let now = Instant::now();
            Ok(current(&t, deadlines, resource)?
                .filter(|c| c.live(now))
                .and_then(|c| c.deadline))
        })
    }
}

/// Runs a blocking database call off the async workers.
async fn blocking<T: Send + 'static>(
    inner: &Arc<Inner>,
    f: impl FnOnce(&Inner) -> Result<T, LeaseError> + Send + 'static,
) -> Result<T, LeaseError> {
    let inner = Arc::clone(inner);
    tokio::task::spawn_blocking(move || f(&inner))
        .await
        .map_err(|e| LeaseError::internal(format!("lease database task failed: {e}")))?
}

impl LeaseBackend for EmbeddedLeases {
    fn try_acquire<'a>(
        &'a self,
        resource: &'a str,
        holder: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LeaseError>> {
        let (resource, holder) = (resource.to_owned(), holder.to_owned());
        Box::pin(blocking(&self.inner, move |i| {
            i.try_acquire(&resource, &holder, ttl)
        }))
    }

    fn renew<'a>(
        &'a self,
        grant: &'a Grant,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, LeaseError>> {
        let grant = grant.clone();
        Box::pin(blocking(&self.inner, move |i| i.renew(&grant, ttl)))
    }

    fn release<'a>(&'a self, grant: &'a Grant) -> BoxFuture<'a, Result<bool, LeaseError>> {
        let grant = grant.clone();
        Box::pin(blocking(&self.inner, move |i| i.release(&grant)))
    }

    fn latest_token<'a>(
        &'a self,
        resource: &'a str,
    ) -> BoxFuture<'a, Result<Option<Token>, LeaseError>> {
        let resource = resource.to_owned();
        Box::pin(blocking(&self.inner, move |i| i.latest_token(&resource)))
    }

    fn changed<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            // Register before looking, so a release between the look and the wait still wakes.
            let registration = self.inner.waiters.register(resource);
            let notified = registration.notify().notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let owned = resource.to_owned();
            let deadline = match blocking(&self.inner, move |i| i.live_until(&owned)).await {
                Ok(Some(deadline)) => deadline,
                // Free already.
                Ok(None) => return,
                // The agent's backoff retries; the database error surfaces there.
                Err(_) => return std::future::pending().await,
            };
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep_until(deadline.into()) => {}
            }
        })
    }

    fn grant_events(&self) -> GrantEvents {
        self.inner.grants.subscribe()
    }

    fn kind(&self) -> &'static str {
        "embedded"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.db");
        let ttl = Duration::from_secs(30);
        let first = {
            let leases = EmbeddedLeases::open(&path, "t").unwrap();
            let Acquired::Granted(g) = leases.try_acquire("r", "a", ttl).await.unwrap() else {
                panic!("free")
            };
            g
        };
        let leases = EmbeddedLeases::open(&path, "t").unwrap();
        // Still held after the restart, by the same grant.
        assert_eq!(
            leases.try_acquire("r", "b", ttl).await.unwrap(),
            Acquired::Held {
                holder: Some("a".into())
            }
        );
        assert!(leases.renew(&first, ttl).await.unwrap());
        assert!(leases.release(&first).await.unwrap());
        let Acquired::Granted(second) = leases.try_acquire("r", "b", ttl).await.unwrap() else {
            panic!("released")
        };
        assert_eq!(Some(second.token), first.token.next());
    }

    /// A resource whose last token is 2^63-1 gets no higher one: the next grant is refused,
    /// not written as 2^63, which no store could hold and every fence would refuse.
    #[tokio::test]
    async fn no_token_is_granted_past_the_last_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.db");
        {
            let db = Database::create(&path).unwrap();
            let txn = db.begin_write().unwrap();
            txn.open_table(Table::new("t.leases"))
                .unwrap()
                .insert("r", (Token::MAX.get(), 0, "", ""))
                .unwrap();
            txn.commit().unwrap();
        }
        let leases = EmbeddedLeases::open(&path, "t").unwrap();
        let refused = leases
            .try_acquire("r", "a", Duration::from_secs(30))
            .await
            .unwrap_err();
        assert!(
            refused.to_string().contains("no higher one can be granted"),
            "{refused}"
        );
        assert_eq!(leases.latest_token("r").await.unwrap(), Some(Token::MAX));
    }
}
