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
//! With the `tls` mapping, connections are TLS only ([`pool`], [`PgTls`]).

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::OnceCell;
use tokio_postgres::config::SslMode;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};
use tokio_postgres::types::ToSql;
use tokio_postgres::{NoTls, Row, Socket};

use crate::tls::ClientTls;

use super::shared::{Claimed, Owner, Remote};
use super::{decide, record_key, BoxFuture, StoreError, Verdict};
use crate::config::EqualTokens;
use crate::idempotency::{self, AttemptId, Begin, Claim, Record};

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
    forget: Forget,
}

/// Forgetting maxima not raised for `fence.retention`: every raise sets `raised_at` while it
/// is on (`NULL` while off: such maxima are kept), and a pass every [`PURGE_EVERY`], started
/// by the health probe, deletes the rows raised before the period, [`PURGE_BATCH`] at a time.
/// A row raised meanwhile is a new row version, which the `ctid` re-check leaves alone.
struct Forget {
    /// The index of `raised_at`, created (without blocking writes) before the first pass.
    index: String,
    delete: String,
    /// The period in ms; 0: keep every maximum.
    retention_ms: AtomicU64,
    /// When the last pass started.
    last: Mutex<Option<Instant>>,
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
                "INSERT INTO {fences} (resource, max_token, prev_token, raised_at) \
                 VALUES ($1, $2, NULL, CASE WHEN $3 THEN now() END) \
                 ON CONFLICT (resource) DO NOTHING RETURNING max_token"
            ),
            update_max: format!(
                "UPDATE {fences} SET max_token = $2, prev_token = max_token, \
                   raised_at = CASE WHEN $3 THEN now() END \
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
        let (pool, _) = pool(url, tls).map_err(StoreError::Unavailable)?;
        let table = format!("{prefix}_fences");
        let records = format!("{prefix}_idempotency");
        Ok(PostgresRemote {
            pool,
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
            forget: Forget {
                index: format!(
                    "CREATE INDEX CONCURRENTLY IF NOT EXISTS {table}_raised ON {table} (raised_at)"
                ),
                delete: format!(
                    "DELETE FROM {table} \
                     WHERE ctid = ANY (ARRAY(\
                       SELECT ctid FROM {table} \
                       WHERE raised_at < now() - make_interval(secs => $1) LIMIT $2)) \
                       AND raised_at < now() - make_interval(secs => $1)"
                ),
                retention_ms: AtomicU64::new(0),
                last: Mutex::new(None),
            },
            get_sql: format!("SELECT max_token FROM {table} WHERE resource = $1"),
            idem: IdempotencySql::new(&table, &records),
            table,
            records,
            last_purge: Mutex::new(None),
        })
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        let client = self
            .pool
            .get()
            .await
            .map_err(|e| unavailable(&describe(&e)))?;
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
                           prev_token BIGINT, \
                           raised_at TIMESTAMPTZ); \
                         ALTER TABLE {table} ADD COLUMN IF NOT EXISTS raised_at TIMESTAMPTZ; \
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
                            Some(db) => unavailable(&format_args!(
                                "creating the tables: {} ({})",
                                db.message(),
                                db.code().code()
                            )),
                            None => unavailable(&describe(&e)),
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
        let tx = Tx(client
            .transaction()
            .await
            .map_err(|e| unavailable(&describe(&e)))?);
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
                    .map_err(|e| StoreError::Unavailable(format!("postgres holds a {e}")))
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
                    let inserted = tx
                        .query_opt(&sql.insert_max, &[&resource, &token, &self.aging()])
                        .await?;
                    if inserted.is_none() {
                        tx.0.rollback()
                            .await
                            .map_err(|e| unavailable(&describe(&e)))?;
                        return Ok(None);
                    }
                }
                Some(c) if claim.token > c => {
                    tx.execute(&sql.update_max, &[&resource, &token, &self.aging()])
                        .await?;
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
        tx.0.commit()
            .await
            .map_err(|e| unavailable(&describe(&e)))?;
        Ok(Some(Claimed {
            begin,
            owner,
            took_over,
        }))
    }

    /// Whether raises record when they happened (`fence.retention` is on).
    fn aging(&self) -> bool {
        self.forget.retention_ms.load(Ordering::Relaxed) > 0
    }

    /// Starts a pass forgetting maxima past the retention in the background, if retention is
    /// on and none started within [`PURGE_EVERY`] (or ever, with `now`).
    fn maybe_forget(&self, now: bool) {
        let ms = self.forget.retention_ms.load(Ordering::Relaxed);
        if ms == 0 {
            return;
        }
        {
            let mut last = self.forget.last.lock().expect("forget clock poisoned");
            if !now && last.is_some_and(|at| at.elapsed() < PURGE_EVERY) {
                return;
            }
            *last = Some(Instant::now());
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
        let statement = self
            .0
            .prepare_cached(sql)
            .await
            .map_err(|e| unavailable(&describe(&e)))?;
        self.0
            .execute(&statement, params)
            .await
            .map_err(|e| unavailable(&describe(&e)))
    }

    async fn query_opt(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, StoreError> {
        let statement = self
            .0
            .prepare_cached(sql)
            .await
            .map_err(|e| unavailable(&describe(&e)))?;
        self.0
            .query_opt(&statement, params)
            .await
            .map_err(|e| unavailable(&describe(&e)))
    }
}

/// Deletes expired records batch by batch: each batch's row ids come from the `expires_at`
/// index, and a row renewed meanwhile fails the outer re-check and stays.
async fn purge(pool: &Pool, sql: &str) -> Result<u64, StoreError> {
    let client = pool.get().await.map_err(|e| unavailable(&describe(&e)))?;
    let mut deleted = 0;
    loop {
        let n = client
            .execute(sql, &[&PURGE_BATCH])
            .await
            .map_err(|e| unavailable(&describe(&e)))?;
        deleted += n;
        if n < PURGE_BATCH as u64 {
            return Ok(deleted);
        }
    }
}

/// Deletes the maxima raised more than `secs` ago, creating the index of `raised_at` first if
/// it is missing. Returns how many it deleted.
async fn forget(pool: &Pool, index: &str, delete: &str, secs: f64) -> Result<u64, StoreError> {
    let client = pool.get().await.map_err(|e| unavailable(&describe(&e)))?;
    client
        .batch_execute(index)
        .await
        .map_err(|e| unavailable(&describe(&e)))?;
    let mut deleted = 0;
    loop {
        let n = client
            .execute(delete, &[&secs, &PURGE_BATCH])
            .await
            .map_err(|e| unavailable(&describe(&e)))?;
        deleted += n;
        if n < PURGE_BATCH as u64 {
            return Ok(deleted);
        }
    }
}

/// A connection pool for `url` (at most 16 connections), shared in shape with the
/// PostgreSQL lease backend; also returns the parsed config for dedicated connections.
///
/// With `tls`, every connection is TLS through [`PgTls`] (`sslmode=require`, so never
/// plaintext: a server that does not offer TLS is an error) and the certificate and name are
/// verified as `verify-full` does; an `sslmode` in the url (only `require`, `verify-ca` or
/// `verify-full` load with `tls`) is replaced by that.
pub(crate) fn pool(
    url: &str,
    tls: Option<Arc<ClientTls>>,
) -> Result<(Pool, tokio_postgres::Config), String> {
    let url = match &tls {
        Some(_) => without_sslmode(url),
        None => url.to_owned(),
    };
    let mut config: tokio_postgres::Config =
        url.parse().map_err(|e| format!("bad postgres url: {e}"))?;
    let manager_config = ManagerConfig {
        recycling_method: RecyclingMethod::Fast,
    };
    let manager = match tls {
        Some(tls) => {
            config.ssl_mode(SslMode::Require);
            Manager::from_config(config.clone(), PgTls(tls), manager_config)
        }
        None => Manager::from_config(config.clone(), NoTls, manager_config),
    };
    let pool = Pool::builder(manager)
        .max_size(16)
        .build()
        .map_err(|e| format!("postgres pool: {e}"))?;
    Ok((pool, config))
}

/// `url` without its `sslmode` parameter.
fn without_sslmode(url: &str) -> String {
    let Some((base, query)) = url.split_once('?') else {
        return url.to_owned();
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| !pair.starts_with("sslmode="))
        .collect();
    if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    }
}

/// TLS for tokio-postgres over rustls: the handshake through [`ClientTls`] (its files as
/// they are at each new connection, the host or `server_name` checked against the
/// certificate). No channel binding is offered, so SCRAM runs without `-PLUS`; the verified
/// certificate is what ties the session to the server.
#[derive(Clone)]
pub struct PgTls(pub Arc<ClientTls>);

impl MakeTlsConnect<Socket> for PgTls {
    type Stream = PgTlsStream;
    type TlsConnect = PgTlsConnect;
    type Error = std::io::Error;

    fn make_tls_connect(&mut self, host: &str) -> Result<PgTlsConnect, std::io::Error> {
        Ok(PgTlsConnect {
            tls: Arc::clone(&self.0),
            host: host.to_owned(),
        })
    }
}

/// One connection's handshake: [`PgTls`] for `host`.
pub struct PgTlsConnect {
    tls: Arc<ClientTls>,
    host: String,
}

impl TlsConnect<Socket> for PgTlsConnect {
    type Stream = PgTlsStream;
    type Error = std::io::Error;
    type Future = BoxFuture<'static, Result<PgTlsStream, std::io::Error>>;

    fn connect(self, socket: Socket) -> Self::Future {
        Box::pin(async move {
            let stream = self.tls.connect(&self.host, socket).await?;
            Ok(PgTlsStream(stream))
        })
    }
}

/// A TLS connection to PostgreSQL.
pub struct PgTlsStream(tokio_rustls::client::TlsStream<Socket>);

impl tokio_postgres::tls::TlsStream for PgTlsStream {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

impl AsyncRead for PgTlsStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for PgTlsStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
}

fn unavailable(e: &dyn std::fmt::Display) -> StoreError {
    StoreError::Unavailable(format!("postgres: {e}"))
}

/// An error with its causes: tokio-postgres says "error performing TLS handshake" or "db
/// error" and keeps why (the certificate, the server's message) in its sources.
pub(crate) fn describe(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = cause.source();
    }
    text
}

fn signed(token: u64) -> Result<i64, StoreError> {
    i64::try_from(token).map_err(|_| unavailable(&"token above 2^63-1"))
}

fn encoded(record: &Record) -> String {
    String::from_utf8(record.encode()).expect("a record encodes as JSON, which is UTF-8")
}

fn token_of(v: i64) -> Result<u64, StoreError> {
    u64::try_from(v)
        .map_err(|_| StoreError::Unavailable(format!("postgres holds a negative maximum {v}")))
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
            let signed = i64::try_from(token).map_err(|_| unavailable(&"token above 2^63-1"))?;
            let statement = client
                .prepare_cached(&self.raise_sql)
                .await
                .map_err(|e| unavailable(&describe(&e)))?;
            let raised = client
                .query_opt(&statement, &[&resource, &signed, &self.aging()])
                .await
                .map_err(|e| unavailable(&describe(&e)))?;
            if let Some(row) = raised {
                let previous: Option<i64> = row.get(0);
                return Ok(Verdict::Admitted {
                    previous: previous.map(token_of).transpose()?,
                });
            }
            let statement = client
                .prepare_cached(&self.get_sql)
                .await
                .map_err(|e| unavailable(&describe(&e)))?;
            let row = client
                .query_one(&statement, &[&resource])
                .await
                .map_err(|e| unavailable(&describe(&e)))?;
            Ok(decide(Some(token_of(row.get(0))?), token, equal))
        })
    }

    fn get<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<u64>, StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            let row = client
                .query_opt(&self.get_sql, &[&resource])
                .await
                .map_err(|e| unavailable(&describe(&e)))?;
            row.map(|r| token_of(r.get(0))).transpose()
        })
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            client
                .simple_query("SELECT 1")
                .await
                .map_err(|e| unavailable(&describe(&e)))?;
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
            Err(unavailable(
                &"the maximum kept appearing under an idempotent claim",
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
                .map_err(|e| unavailable(&describe(&e)))?;
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
                .map_err(|e| unavailable(&describe(&e)))?;
            Ok(written == 1)
        })
    }

    fn kind(&self) -> &'static str {
        "postgres"
    }

    /// Also starts a pass at once (the health probe starts the next ones).
    fn forget_after(&self, period: Duration) -> Result<(), StoreError> {
        let ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX).max(1);
        self.forget.retention_ms.store(ms, Ordering::Relaxed);
        self.maybe_forget(true);
        Ok(())
    }
}

#[cfg(test)]
mod tls_tests {
    use super::*;

    #[test]
    fn tls_replaces_the_urls_sslmode_with_require() {
        assert_eq!(
            without_sslmode("postgres://u@h/db?sslmode=verify-full"),
            "postgres://u@h/db"
        );
        assert_eq!(
            without_sslmode(
                "postgres://u@h/db?application_name=fg&sslmode=require&connect_timeout=2"
            ),
            "postgres://u@h/db?application_name=fg&connect_timeout=2"
        );
        assert_eq!(without_sslmode("postgres://u@h/db"), "postgres://u@h/db");
        let tls = Arc::new(ClientTls::load(&Default::default(), "store.tls", &[]).unwrap());
        let (_, config) = pool("postgres://u@h/db?sslmode=verify-full", Some(tls)).unwrap();
        assert_eq!(config.get_ssl_mode(), SslMode::Require);
        let (_, config) = pool("postgres://u@h/db", None).unwrap();
        assert_eq!(config.get_ssl_mode(), SslMode::Prefer);
    }
}
