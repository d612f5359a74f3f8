//! Maxima in PostgreSQL: one conditional upsert per compare-and-raise.
//!
//! `INSERT ... ON CONFLICT DO UPDATE ... WHERE max < token RETURNING prev` raises atomically
//! (the row lock serialises racing raises, and the WHERE is re-checked against the latest row
//! version). When it returns no row the token did not raise the maximum; the follow-up read
//! then decides between "equal, admitted" and "stale", which is correct at the time of that
//! read because maxima only grow. The tables are created on first use if missing.
//!
//! Idempotency records live in `<prefix>_idempotency`, one row per `(resource, key)`: the phase
//! code, token, fingerprint and (`in_flight` rows only) attempt id and in-flight lifetime as
//! columns (for the conditional outcome write and the takeover; these columns are added to
//! tables created without them, and a row without an attempt belongs to no attempt) and the
//! encoded record, with an `expires_at` in server time. Rows past it are absent to every
//! statement and are deleted in bounded batches through the index on `expires_at`, at most
//! once a minute.
//!
//! An outcome's `expires_at` is `now()` plus the window, on the server's wall clock. An
//! `in_flight` row's is `infinity`: compared with `now()`, a forward step of the server's clock
//! would end a running attempt's claim. A claim instead takes over the row of an attempt seen
//! in flight for a whole in-flight lifetime on fencegate's monotonic clock
//! ([`super::shared`]), in its transaction, only while the row still names that attempt.
//!
//! A claim is one transaction: an advisory lock on `(resource, key)`, the takeover if any (a
//! conditional `DELETE`), then the record, the maximum's row locked `FOR UPDATE`,
//! [`idempotency::decide`] here, and on execute the raise and the `in_flight` row. An outcome
//! is one conditional `UPDATE`.
//!
//! Connections come from [`crate::conn::postgres`], shared with the PostgreSQL lease backend;
//! with the `tls` mapping, they are TLS only.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use tokio::sync::OnceCell;
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use super::shared::{Claimed, Owner, Remote};
use super::{decide, record_key, StoreError, Verdict};
use crate::config::EqualTokens;
use crate::conn::postgres::{describe, failure, pool};
use crate::conn::BoxFuture;
use crate::idempotency::{self, AttemptId, Begin, Claim, Record};
use crate::tls::ClientTls;

/// How often a claim may start a purge of expired records.
const PURGE_EVERY: Duration = Duration::from_secs(60);
/// Rows one purge statement deletes at most, so no purge holds many row locks for long.
const PURGE_BATCH: i64 = 1000;
/// Claims retried when a racing first raise created the maximum between read and insert.
const CLAIM_ATTEMPTS: usize = 3;

pub struct PostgresRemote {
    pool: Pool,
    /// Table created (idempotently) before the first statement.
    schema: OnceCell<()>,
    table: String,
    raise_sql: String,
    get_sql: String,
    records: String,
    idem: IdempotencySql,
    /// When the last purge of expired records started.
    last_purge: Mutex<Option<Instant>>,
}

/// The statements of idempotency records.
struct IdempotencySql {
    lock: String,
    takeover: String,
    read: String,
    lock_max: String,
    insert_max: String,
    update_max: String,
    write: String,
    finish: String,
    purge: String,
}

impl IdempotencySql {
    fn new(fences: &str, records: &str) -> Self {
        IdempotencySql {
            lock: "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))".to_owned(),
            takeover: format!(
                "DELETE FROM {records} \
                 WHERE resource = $1 AND idem_key = $2 AND phase = 'i' AND attempt = $3"
            ),
            read: format!(
                "SELECT record, attempt, in_flight_ms FROM {records} \
                 WHERE resource = $1 AND idem_key = $2 AND expires_at > now()"
            ),
            lock_max: format!("SELECT max_token FROM {fences} WHERE resource = $1 FOR UPDATE"),
            insert_max: format!(
                "INSERT INTO {fences} (resource, max_token, prev_token) VALUES ($1, $2, NULL) \
                 ON CONFLICT (resource) DO NOTHING RETURNING max_token"
            ),
            update_max: format!(
                "UPDATE {fences} SET max_token = $2, prev_token = max_token \
                 WHERE resource = $1 AND max_token < $2"
            ),
            write: format!(
                "INSERT INTO {records} \
                   (resource, idem_key, phase, token, fingerprint, record, expires_at, attempt, \
                    in_flight_ms) \
                 VALUES ($1, $2, 'i', $3, $4, $5, 'infinity', $6, $7) \
                 ON CONFLICT (resource, idem_key) DO UPDATE \
                 SET phase = EXCLUDED.phase, token = EXCLUDED.token, \
                     fingerprint = EXCLUDED.fingerprint, record = EXCLUDED.record, \
                     expires_at = EXCLUDED.expires_at, attempt = EXCLUDED.attempt, \
                     in_flight_ms = EXCLUDED.in_flight_ms"
            ),
            finish: format!(
                "UPDATE {records} \
                 SET phase = $3, token = $4, fingerprint = $5, record = $6, \
                     expires_at = now() + make_interval(secs => $7), attempt = NULL, \
                     in_flight_ms = NULL \
                 WHERE resource = $1 AND idem_key = $2 AND expires_at > now() \
                   AND phase = 'i' AND token = $8 AND fingerprint = $9 AND attempt = $10"
            ),
            purge: format!(
                "DELETE FROM {records} \
                 WHERE ctid = ANY (ARRAY(\
                   SELECT ctid FROM {records} WHERE expires_at < now() LIMIT $1)) \
                   AND expires_at < now()"
            ),
        }
    }
}

impl PostgresRemote {
    /// `prefix` is validated as an SQL identifier when the config is loaded.
    pub fn new(url: &str, prefix: &str, tls: Option<Arc<ClientTls>>) -> Result<Self, StoreError> {
        let (pool, _) = pool(url, tls).map_err(StoreError::Config)?;
        let table = format!("{prefix}_fences");
        let records = format!("{prefix}_idempotency");
        Ok(PostgresRemote {
            pool,
            schema: OnceCell::new(),
            raise_sql: format!(
                "INSERT INTO {table} AS f (resource, max_token, prev_token) VALUES ($1, $2, NULL) \
                 ON CONFLICT (resource) DO UPDATE \
                 SET max_token = EXCLUDED.max_token, prev_token = f.max_token \
                 WHERE f.max_token < EXCLUDED.max_token \
                 RETURNING prev_token"
            ),
            get_sql: format!("SELECT max_token FROM {table} WHERE resource = $1"),
            idem: IdempotencySql::new(&table, &records),
            table,
            records,
            last_purge: Mutex::new(None),
        })
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        let client = self.pool.get().await.map_err(|e| failed(&e))?;
        self.schema
            .get_or_try_init(|| async {
                let (table, records) = (&self.table, &self.records);
                // One transaction under an advisory lock: sidecars that start together on a
                // new prefix would otherwise race `CREATE … IF NOT EXISTS` into a unique
                // violation on the catalog.
                client
                    .batch_execute(&format!(
                        "BEGIN; \
                         SELECT pg_advisory_xact_lock(hashtextextended('fencegate schema {table}', 0)); \
                         CREATE TABLE IF NOT EXISTS {table} (\
                           resource TEXT PRIMARY KEY, \
                           max_token BIGINT NOT NULL CHECK (max_token >= 0), \
                           prev_token BIGINT); \
                         CREATE TABLE IF NOT EXISTS {records} (\
                           resource TEXT NOT NULL, \
                           idem_key TEXT NOT NULL, \
                           phase TEXT NOT NULL CHECK (phase IN ('i', 'u', 'c')), \
                           token BIGINT NOT NULL CHECK (token >= 0), \
                           fingerprint TEXT NOT NULL, \
                           record TEXT NOT NULL, \
                           expires_at TIMESTAMPTZ NOT NULL, \
                           attempt TEXT, \
                           in_flight_ms BIGINT, \
                           PRIMARY KEY (resource, idem_key)); \
                         ALTER TABLE {records} ADD COLUMN IF NOT EXISTS attempt TEXT; \
                         ALTER TABLE {records} ADD COLUMN IF NOT EXISTS in_flight_ms BIGINT; \
                         CREATE INDEX IF NOT EXISTS {records}_expiry ON {records} (expires_at); \
                         COMMIT"
                    ))
                    .await
                    .map_err(|e| {
                        // The server's message, not only tokio-postgres's "db error".
                        match e.as_db_error() {
                            Some(db) => StoreError::Refused(format!(
                                "postgres: creating the tables: {} ({})",
                                db.message(),
                                db.code().code()
                            )),
                            None => failed(&e),
                        }
                    })
            })
            .await?;
        Ok(client)
    }

    /// One claim attempt in one transaction. `None`: a racing first raise created the
    /// resource's maximum after it was read as absent; nothing was written, try again.
    async fn try_begin(
        &self,
        client: &mut deadpool_postgres::Object,
        resource: &str,
        key: &str,
        claim: &Claim,
        takeover: Option<AttemptId>,
    ) -> Result<Option<Claimed>, StoreError> {
        let sql = &self.idem;
        let token = signed(claim.token)?;
        let tx = Tx(client.transaction().await.map_err(|e| failed(&e))?);
        // Serialises claims of one key, also while no row exists for it yet.
        let lock = format!("{}\u{1f}{}", self.records, record_key(resource, key));
        tx.execute(&sql.lock, &[&lock]).await?;
        // Only the row of the attempt named, still in flight; rolled back with the claim.
        let took_over = match takeover {
            Some(attempt) => {
                let attempt = attempt.hex();
                tx.execute(&sql.takeover, &[&resource, &key, &attempt])
                    .await?
                    == 1
            }
            None => false,
        };
        let found = tx.query_opt(&sql.read, &[&resource, &key]).await?;
        let existing = found
            .as_ref()
            .map(|row| {
                Record::decode(row.get::<_, &str>(0).as_bytes())
                    .map_err(|e| StoreError::Corrupt(format!("postgres holds a {e}")))
            })
            .transpose()?;
        // Locked, so no other raise moves the maximum between this read and the raise below.
        let current = tx
            .query_opt(&sql.lock_max, &[&resource])
            .await?
            .map(|row| token_of(row.get(0)))
            .transpose()?;
        let begin = idempotency::decide(existing.as_ref(), current, claim);
        // A row without a readable attempt is nobody's: no takeover, it keeps its expiry.
        let owner = match (&begin, &found) {
            (Begin::InFlight, Some(row)) => row
                .get::<_, Option<&str>>(1)
                .and_then(AttemptId::from_hex)
                .map(|attempt| Owner {
                    attempt,
                    lifetime: row
                        .get::<_, Option<i64>>(2)
                        .and_then(|ms| u64::try_from(ms).ok())
                        .map(Duration::from_millis),
                }),
            _ => None,
        };
        if let Begin::Execute { .. } = begin {
            match current {
                None => {
                    let inserted = tx.query_opt(&sql.insert_max, &[&resource, &token]).await?;
                    if inserted.is_none() {
                        tx.0.rollback().await.map_err(|e| failed(&e))?;
                        return Ok(None);
                    }
                }
                Some(c) if claim.token > c => {
                    tx.execute(&sql.update_max, &[&resource, &token]).await?;
                }
                Some(_) => {}
            }
            let record = claim.in_flight();
            let attempt = claim.attempt.hex();
            let lifetime = i64::try_from(claim.window.as_millis()).unwrap_or(i64::MAX);
            let params: [&(dyn ToSql + Sync); 7] = [
                &resource,
                &key,
                &token,
                &record.fingerprint.hex(),
                &encoded(&record),
                &attempt,
                &lifetime,
            ];
            tx.execute(&sql.write, &params).await?;
        }
        tx.0.commit().await.map_err(|e| failed(&e))?;
        Ok(Some(Claimed {
            begin,
            owner,
            took_over,
        }))
    }

    /// Starts a purge of expired records in the background, at most once per [`PURGE_EVERY`].
    fn maybe_purge(&self) {
        {
            let mut last = self.last_purge.lock().expect("purge clock poisoned");
            if last.is_some_and(|at| at.elapsed() < PURGE_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        let pool = self.pool.clone();
        let sql = self.idem.purge.clone();
        tokio::spawn(async move {
            if let Err(e) = purge(&pool, &sql).await {
                tracing::warn!(error = %e, "purging expired idempotency records failed");
            }
        });
    }
}

/// A transaction whose statements are prepared once per connection.
struct Tx<'a>(deadpool_postgres::Transaction<'a>);

impl Tx<'_> {
    async fn execute(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<u64, StoreError> {
        let statement = self.0.prepare_cached(sql).await.map_err(|e| failed(&e))?;
        self.0
            .execute(&statement, params)
            .await
            .map_err(|e| failed(&e))
    }

    async fn query_opt(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, StoreError> {
        let statement = self.0.prepare_cached(sql).await.map_err(|e| failed(&e))?;
        self.0
            .query_opt(&statement, params)
            .await
            .map_err(|e| failed(&e))
    }
}

/// Deletes expired records batch by batch: each batch's row ids come from the `expires_at`
/// index, and a row renewed meanwhile fails the outer re-check and stays.
async fn purge(pool: &Pool, sql: &str) -> Result<u64, StoreError> {
    let client = pool.get().await.map_err(|e| failed(&e))?;
    let mut deleted = 0;
    loop {
        let n = client
            .execute(sql, &[&PURGE_BATCH])
            .await
            .map_err(|e| failed(&e))?;
        deleted += n;
        if n < PURGE_BATCH as u64 {
            return Ok(deleted);
        }
    }
}

/// A failed call, with the error's causes ([`describe`]).
fn failed(e: &(dyn std::error::Error + 'static)) -> StoreError {
    StoreError::new(failure(e), format!("postgres: {}", describe(e)))
}

/// Tokens are `BIGINT`; the token grammar keeps them below 2^63, so this is a guard.
fn too_large() -> StoreError {
    StoreError::Refused("postgres: token above 2^63-1".into())
}

fn signed(token: u64) -> Result<i64, StoreError> {
    i64::try_from(token).map_err(|_| too_large())
}

fn encoded(record: &Record) -> String {
    String::from_utf8(record.encode()).expect("a record encodes as JSON, which is UTF-8")
}

fn token_of(v: i64) -> Result<u64, StoreError> {
    u64::try_from(v)
        .map_err(|_| StoreError::Corrupt(format!("postgres holds a negative maximum {v}")))
}

impl Remote for PostgresRemote {
    fn raise<'a>(
        &'a self,
        resource: &'a str,
        token: u64,
        equal: EqualTokens,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            let signed = i64::try_from(token).map_err(|_| too_large())?;
            let statement = client
                .prepare_cached(&self.raise_sql)
                .await
                .map_err(|e| failed(&e))?;
            let raised = client
                .query_opt(&statement, &[&resource, &signed])
                .await
                .map_err(|e| failed(&e))?;
            if let Some(row) = raised {
                let previous: Option<i64> = row.get(0);
                return Ok(Verdict::Admitted {
                    previous: previous.map(token_of).transpose()?,
                });
            }
            let statement = client
                .prepare_cached(&self.get_sql)
                .await
                .map_err(|e| failed(&e))?;
            let row = client
                .query_one(&statement, &[&resource])
                .await
                .map_err(|e| failed(&e))?;
            Ok(decide(Some(token_of(row.get(0))?), token, equal))
        })
    }

    fn get<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<u64>, StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            let row = client
                .query_opt(&self.get_sql, &[&resource])
                .await
                .map_err(|e| failed(&e))?;
            row.map(|r| token_of(r.get(0))).transpose()
        })
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            client
                .simple_query("SELECT 1")
                .await
                .map_err(|e| failed(&e))?;
            Ok(())
        })
    }

    fn begin_idempotent<'a>(
        &'a self,
        resource: &'a str,
        key: &'a str,
        claim: &'a Claim,
        takeover: Option<AttemptId>,
    ) -> BoxFuture<'a, Result<Claimed, StoreError>> {
        Box::pin(async move {
            let mut client = self.client().await?;
            for _ in 0..CLAIM_ATTEMPTS {
                let claimed = self
                    .try_begin(&mut client, resource, key, claim, takeover)
                    .await?;
                if let Some(claimed) = claimed {
                    self.maybe_purge();
                    return Ok(claimed);
                }
            }
            Err(StoreError::Contended(
                "postgres: the maximum kept appearing under an idempotent claim".into(),
            ))
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
            let client = self.client().await?;
            let statement = client
                .prepare_cached(&self.idem.finish)
                .await
                .map_err(|e| failed(&e))?;
            let written = client
                .execute(
                    &statement,
                    &[
                        &resource,
                        &key,
                        &outcome.phase.code(),
                        &signed(outcome.token)?,
                        &outcome.fingerprint.hex(),
                        &encoded(outcome),
                        &claim.window.as_secs_f64(),
                        &signed(claim.token)?,
                        &claim.fingerprint.hex(),
                        &claim.attempt.hex(),
                    ],
                )
                .await
                .map_err(|e| failed(&e))?;
            Ok(written == 1)
        })
    }

    fn kind(&self) -> &'static str {
        "postgres"
    }
}
