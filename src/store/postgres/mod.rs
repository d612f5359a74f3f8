//! Maxima in PostgreSQL: one conditional upsert per compare-and-raise.
//!
//! `INSERT ... ON CONFLICT DO UPDATE ... WHERE max < token RETURNING prev` raises atomically
//! (the row lock serialises racing raises, and the WHERE is re-checked against the latest row
//! version). When it returns no row the token did not raise the maximum; the follow-up read
//! then decides between "equal, admitted" and "stale", which is correct at the time of that
//! read because maxima only grow. The tables are created on first use if missing.
//!
//! With `token.max_step`, a token above the step ([`Rule::floor`]) raises only an existing
//! row whose maximum is at least the floor: a conditional `UPDATE` whose `WHERE` holds both
//! bounds, so a too-far token never raises anything. When it returns no row, the follow-up read
//! says why (stale, equal, or too far: each true at the time of that read); if that read finds
//! a maximum that has meanwhile risen to within the step, the raise is tried again.
//!
//! Concurrent raises without a floor share a statement, and so a commit
//! ([`super::shared::batch`]): the same upsert over `unnest` of the batch's resources and
//! tokens, one row each, given in the resources' order so that batches lock rows in one order.
//! The maxima of those it did not raise are read in one more statement.
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
//! [`crate::idempotency::decide`] here, and on execute the raise and the `in_flight` row. An outcome
//! is one conditional `UPDATE` ([`records`]).
//!
//! With `fence.retention`, maxima not raised for the period are forgotten ([`retention`]).
//! `<prefix>_retention` holds at most one row, the retention mark ([`super::retention`]): a
//! run with retention writes it, a run without takes `raised_at` off every maximum when it
//! finds it.
//!
//! Connections come from `conn::postgres`, shared with the PostgreSQL lease backend;
//! with the `tls` mapping, they are TLS only.

mod admin;
mod records;
mod retention;

/// Raises in one statement at most.
const BATCH: usize = 64;

use crate::fence::token::Token;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use deadpool_postgres::Pool;
use tokio::sync::OnceCell;

use super::shared::batch::Raise;
use super::shared::{Claimed, Remote};
use super::{decide, Rule, StoreError, Verdict};
use crate::conn::postgres::{describe, failure, pool, Guard, START_CHECK};
use crate::conn::BoxFuture;
use crate::idempotency::{AttemptId, Claim, Record};
use crate::tls::ClientTls;

use records::IdempotencySql;
use retention::Forget;

pub struct PostgresRemote {
    pool: Pool,
    /// Which connections may be used ([`Guard`]).
    guard: Arc<Guard>,
    /// Table created (idempotently) before the first statement.
    schema: OnceCell<()>,
    table: String,
    raise_sql: String,
    /// The raise of a token above `token.max_step`: an existing maximum at least the floor.
    raise_from_sql: String,
    /// The raise of several tokens without a floor, one per resource ([`Remote::raise_many`]).
    raise_many_sql: String,
    /// The maxima of several resources.
    get_many_sql: String,
    get_sql: String,
    records: String,
    /// The table of the retention mark ([`crate::store::retention`]).
    marks: String,
    idem: IdempotencySql,
    /// When the last purge of expired records started.
    last_purge: Mutex<Option<Instant>>,
    /// Forgetting maxima past `fence.retention` ([`retention`]).
    forget: Forget,
    /// Whether the table of the reset generation was seen ([`admin`]).
    resets_exist: std::sync::atomic::AtomicBool,
}

impl PostgresRemote {
    /// `prefix` is validated as an SQL identifier when the config is loaded.
    pub fn new(
        url: &str,
        prefix: &str,
        tls: Option<Arc<ClientTls>>,
        replicas: Option<u32>,
    ) -> Result<Self, StoreError> {
        let (pool, _, guard) = pool(url, tls, replicas).map_err(StoreError::config_from)?;
        let table = format!("{prefix}_fences");
        let records = format!("{prefix}_idempotency");
        let marks = format!("{prefix}_retention");
        Ok(PostgresRemote {
            pool,
            guard,
            schema: OnceCell::new(),
            raise_sql: format!(
                "INSERT INTO {table} AS f (resource, max_token, prev_token, raised_at) \
                 VALUES ($1, $2, NULL, CASE WHEN $3 THEN now() END) \
                 ON CONFLICT (resource) DO UPDATE \
                 SET max_token = EXCLUDED.max_token, prev_token = f.max_token, \
                     raised_at = EXCLUDED.raised_at \
                 WHERE f.max_token < EXCLUDED.max_token \
                 RETURNING prev_token"
            ),
            raise_from_sql: format!(
                "UPDATE {table} AS f \
                 SET max_token = $2, prev_token = f.max_token, \
                     raised_at = CASE WHEN $3 THEN now() END \
                 WHERE f.resource = $1 AND f.max_token < $2 AND f.max_token >= $4 \
                 RETURNING prev_token"
            ),
            raise_many_sql: format!(
                "INSERT INTO {table} AS f (resource, max_token, prev_token, raised_at) \
                 SELECT r, t, NULL, CASE WHEN $3 THEN now() END \
                 FROM unnest($1::text[], $2::bigint[]) AS i(r, t) \
                 ON CONFLICT (resource) DO UPDATE \
                 SET max_token = EXCLUDED.max_token, prev_token = f.max_token, \
                     raised_at = EXCLUDED.raised_at \
                 WHERE f.max_token < EXCLUDED.max_token \
                 RETURNING resource, prev_token"
            ),
            get_many_sql: format!(
                "SELECT resource, max_token FROM {table} WHERE resource = ANY($1::text[])"
            ),
            forget: Forget::new(&table, &marks),
            get_sql: format!("SELECT max_token FROM {table} WHERE resource = $1"),
            idem: IdempotencySql::new(&table, &records),
            table,
            records,
            marks,
            last_purge: Mutex::new(None),
            resets_exist: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// At start-up: refuses a server whose replication falls short of `replicas`
    /// ([`Guard::check_at_start`]).
    pub async fn check_at_start(&self) -> Result<(), StoreError> {
        self.guard
            .check_at_start(&self.pool, START_CHECK)
            .await
            .map_err(|e| StoreError::config(format!("store: {e}")).with_source(e))
    }

    /// A failed call, with the error's causes ([`describe`]); a read-only answer retires the
    /// pool's connections ([`Guard::note`]).
    fn failed(&self, e: &(dyn std::error::Error + 'static)) -> StoreError {
        self.guard.note(e);
        failed(e)
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        let client = self.pool.get().await.map_err(|e| self.failed(&e))?;
        self.schema
            .get_or_try_init(|| async {
                let (table, records, marks) = (&self.table, &self.records, &self.marks);
                // One transaction under an advisory lock: sidecars that start together on a
                // new prefix would otherwise race `CREATE … IF NOT EXISTS` into a unique
                // violation on the catalog. The transaction is the implicit one of a single
                // simple query (no `BEGIN`/`COMMIT`): the server ends it on its own, committed
                // or rolled back, even when this call is abandoned (the proxy gives up at
                // `timeouts.store`) while the set-up waits for the lock. An explicit `BEGIN`
                // left the connection inside the failed transaction, back in the pool, when
                // the abandoned set-up failed: every later statement on it failed with 25P02.
                let add = |table: &str, column: &str, kind: &str| {
                    format!(
                        "IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = '{table}'::regclass \
                           AND attname = '{column}' AND NOT attisdropped) THEN \
                           ALTER TABLE {table} ADD COLUMN {column} {kind}; \
                         END IF;"
                    )
                };
                // Columns and the index are added only where missing: `ALTER TABLE` and
                // `CREATE INDEX` lock their table even when there is nothing to do, and a lock
                // on the maxima taken while a claim holds the records' would deadlock with it.
                let result = client
                    .batch_execute(&format!(
                        "SELECT pg_advisory_xact_lock(hashtextextended('fencegate schema {table}', 0)); \
                         CREATE TABLE IF NOT EXISTS {table} (\
                           resource TEXT PRIMARY KEY, \
                           max_token BIGINT NOT NULL CHECK (max_token >= 0), \
                           prev_token BIGINT, \
                           raised_at TIMESTAMPTZ); \
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
                         CREATE TABLE IF NOT EXISTS {marks} (\
                           only_row BOOLEAN PRIMARY KEY DEFAULT true CHECK (only_row), \
                           mark TEXT NOT NULL, \
                           written_at TIMESTAMPTZ NOT NULL); \
                         DO $$ BEGIN {} {} {} \
                           IF to_regclass('{records}_expiry') IS NULL THEN \
                             CREATE INDEX {records}_expiry ON {records} (expires_at); \
                           END IF; \
                         END $$",
                        add(records, "attempt", "TEXT"),
                        add(records, "in_flight_ms", "BIGINT"),
                        add(table, "raised_at", "TIMESTAMPTZ"),
                    ))
                    .await;
                if let Err(e) = result {
                    // The server's message, not only tokio-postgres's "db error".
                    return Err(match e.as_db_error() {
                        Some(db) => StoreError::refused(format!(
                            "postgres: creating the tables: {} ({})",
                            db.message(),
                            db.code().code()
                        )),
                        None => self.failed(&e),
                    });
                }
                Ok(())
            })
            .await?;
        Ok(client)
    }
}

/// A failed call, with the error's causes ([`describe`]).
fn failed(e: &(dyn std::error::Error + 'static)) -> StoreError {
    StoreError::new(failure(e), format!("postgres: {}", describe(e)))
}

fn encoded(record: &Record) -> String {
    String::from_utf8(record.encode()).expect("a record encodes as JSON, which is UTF-8")
}

/// A `BIGINT` maximum as a token: a negative one is corrupt. (Every [`Token`] fits a
/// `BIGINT`: [`Token::to_i64`].)
fn token_of(v: i64) -> Result<Token, StoreError> {
    Token::try_from(v)
        .map_err(|_| StoreError::corrupt(format!("postgres holds a negative maximum {v}")))
}

impl PostgresRemote {
    /// The maxima of `resources` (those recorded), each parsed on its own.
    async fn maxima(
        &self,
        client: &deadpool_postgres::Object,
        resources: &[&str],
    ) -> Result<std::collections::HashMap<String, Result<Token, StoreError>>, StoreError> {
        let get = client
            .prepare_cached(&self.get_many_sql)
            .await
            .map_err(|e| self.failed(&e))?;
        let rows = client
            .query(&get, &[&resources])
            .await
            .map_err(|e| self.failed(&e))?;
        Ok(rows
            .iter()
            .map(|row| (row.get::<_, String>(0), token_of(row.get(1))))
            .collect())
    }
}

impl Remote for PostgresRemote {
    fn raise<'a>(
        &'a self,
        resource: &'a str,
        token: Token,
        rule: Rule,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            let signed = token.to_i64();
            let floor = rule.floor(token).map(Token::to_i64);
            let raise = match floor {
                None => &self.raise_sql,
                Some(_) => &self.raise_from_sql,
            };
            let raise = client
                .prepare_cached(raise)
                .await
                .map_err(|e| self.failed(&e))?;
            let get = client
                .prepare_cached(&self.get_sql)
                .await
                .map_err(|e| self.failed(&e))?;
            loop {
                let aging = self.aging();
                let raised = match &floor {
                    None => {
                        client
                            .query_opt(&raise, &[&resource, &signed, &aging])
                            .await
                    }
                    Some(floor) => {
                        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
                            [&resource, &signed, &aging, floor];
                        client.query_opt(&raise, &params).await
                    }
                }
                .map_err(|e| self.failed(&e))?;
                if let Some(row) = raised {
                    let previous: Option<i64> = row.get(0);
                    return Ok(Verdict::Admitted {
                        previous: previous.map(token_of).transpose()?,
                    });
                }
                let row = client
                    .query_opt(&get, &[&resource])
                    .await
                    .map_err(|e| self.failed(&e))?;
                let current = row.map(|r| token_of(r.get(0))).transpose()?;
                let verdict = decide(current, token, rule);
                // Raised since the statement, to within the step: try the raise again (a
                // maximum only grows, so this ends once the token is stale, equal or raised).
                if !verdict.raised(token) {
                    return Ok(verdict);
                }
            }
        })
    }

    fn batch_limit(&self) -> usize {
        BATCH
    }

    fn raise_many<'a>(
        &'a self,
        raises: &'a [Raise],
    ) -> BoxFuture<'a, Result<Vec<Result<Verdict, StoreError>>, StoreError>> {
        Box::pin(async move {
            // Rows are locked in the order they are given, so every batch gives them in one
            // order: two batches (of this sidecar or another) never wait on each other's rows
            // in a cycle.
            let mut order: Vec<usize> = (0..raises.len()).collect();
            order.sort_unstable_by(|&a, &b| raises[a].resource.cmp(&raises[b].resource));
            let resources: Vec<&str> = order.iter().map(|&i| &*raises[i].resource).collect();
            let tokens: Vec<i64> = order.iter().map(|&i| raises[i].token.to_i64()).collect();
            let client = self.client().await?;
            let raise = client
                .prepare_cached(&self.raise_many_sql)
                .await
                .map_err(|e| self.failed(&e))?;
            let aging = self.aging();
            let rows = client
                .query(&raise, &[&resources, &tokens, &aging])
                .await
                .map_err(|e| self.failed(&e))?;
            // The statement has committed: from here on, an error is the answer of the raises
            // it concerns, never the call's (the call's error would have them sent again).
            let mut raised = std::collections::HashMap::with_capacity(rows.len());
            for row in &rows {
                let previous: Option<i64> = row.get(1);
                let previous = previous.map(token_of).transpose();
                raised.insert(row.get::<_, &str>(0), previous);
            }
            // The others were not raised: their maxima decide them, read in one statement.
            let rest: Vec<&str> = resources
                .iter()
                .copied()
                .filter(|r| !raised.contains_key(r))
                .collect();
            let current = if rest.is_empty() {
                Ok(std::collections::HashMap::new())
            } else {
                self.maxima(&client, &rest).await
            };
            drop(client);
            let mut verdicts = Vec::with_capacity(raises.len());
            for r in raises {
                let current = match (raised.get(&*r.resource), &current) {
                    (Some(previous), _) => {
                        let admitted = |previous| Verdict::Admitted { previous };
                        verdicts.push(previous.clone().map(admitted));
                        continue;
                    }
                    (None, Err(e)) => Err(e.clone()),
                    (None, Ok(maxima)) => maxima.get(&r.resource).cloned().transpose(),
                };
                let verdict = current.map(|current| decide(current, r.token, r.rule));
                if verdict.as_ref().is_ok_and(|v| v.raised(r.token)) {
                    // Not raised by the statement, yet passes against the maximum read after
                    // it: forgotten since (retention, a reset). Alone, again.
                    verdicts.push(self.raise(&r.resource, r.token, r.rule).await);
                } else {
                    verdicts.push(verdict);
                }
            }
            Ok(verdicts)
        })
    }

    fn get<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<Token>, StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            let row = client
                .query_opt(&self.get_sql, &[&resource])
                .await
                .map_err(|e| self.failed(&e))?;
            row.map(|r| token_of(r.get(0))).transpose()
        })
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            client
                .simple_query("SELECT 1")
                .await
                .map_err(|e| self.failed(&e))?;
            self.maybe_forget(false);
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
        Box::pin(self.begin(resource, key, claim, takeover))
    }

    fn finish_idempotent<'a>(
        &'a self,
        resource: &'a str,
        key: &'a str,
        claim: &'a Claim,
        outcome: &'a Record,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.finish(resource, key, claim, outcome))
    }

    fn kind(&self) -> &'static str {
        "postgres"
    }

    fn forget_after(&self, period: std::time::Duration) -> Result<(), StoreError> {
        PostgresRemote::forget_after(self, period);
        Ok(())
    }

    fn forgets(&self) -> bool {
        true
    }

    fn retention(&self) -> Option<Duration> {
        PostgresRemote::retention(self)
    }

    fn mark<'a>(&'a self, value: &'a str) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let sent = Instant::now();
            let client = self.client().await?;
            client
                .execute(&self.forget.mark, &[&value])
                .await
                .map_err(|e| {
                    self.failed(&e)
                        .with_context(&format!("writing the mark in {}", self.marks))
                })?;
            self.forget.fresh.marked(sent);
            Ok(())
        })
    }

    fn read_mark(&self) -> BoxFuture<'_, Result<Option<String>, StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            let row = client
                .query_opt(&self.forget.read_mark, &[])
                .await
                .map_err(|e| {
                    self.failed(&e)
                        .with_context(&format!("reading the mark in {}", self.marks))
                })?;
            Ok(row.map(|r| r.get(0)))
        })
    }

    fn reset_generation(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(self.read_resets())
    }

    fn unmark<'a>(&'a self, value: &'a str) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            let n = client
                .execute(&self.forget.unmark, &[&value])
                .await
                .map_err(|e| self.failed(&e))?;
            Ok(n == 1)
        })
    }

    fn keep_all(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(PostgresRemote::keep_all(self))
    }
}

#[cfg(test)]
mod tests;
