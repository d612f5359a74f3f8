//! Leases in PostgreSQL: one row per resource in `<prefix>_leases`, every step one statement
//! judged on the server's clock (`now()`).
//!
//! - acquire: `INSERT ... ON CONFLICT DO UPDATE ... WHERE expires_at <= now()`, raising
//!   `fencing_token` by one; the row lock serialises racing acquirers and the `WHERE` is
//!   re-checked against the latest row version, so exactly one of them wins. A resource's first
//!   grant gets token 1.
//! - across a failover: each grant records the server's timeline; a grant on another timeline
//!   than the resource's last (a promoted standby) moves the counter on by [`EPOCH_GAP`] first,
//!   and a resource's first grant on a server past timeline 1 starts there, so a grant that an
//!   asynchronous standby lacked is never made again with the same token.
//! - renew: `UPDATE ... WHERE lease_id = $ AND expires_at > now()`: an expired lease is never
//!   extended.
//! - release: the row is kept (it holds the counter): holder and lease id are cleared and
//!   `expires_at` set to `-infinity`, in the same statement as a `NOTIFY`.
//!
//! Rows are never deleted, so there is no purge job: deleting a row would restart its tokens
//! at 1. A row is about 100 bytes per resource ever leased. Tokens are `BIGINT`: exact to 2^63.
//!
//! Events: release notifies channel `<prefix>_leases` with the resource as payload, and a grant
//! notifies `<prefix>_leases_granted` the same way, in the granting statement (both delivered at
//! commit). One dedicated connection per backend, started by the first `changed()` or
//! `grant_events()`, `LISTEN`s on both: it wakes the resource's waiters and sends grant events.
//! Expiry notifies nothing, so waiters for an expiring lease wake at the end of their backoff.
//! The listening connection runs `SELECT 1` every [`HEARTBEAT`]; when it drops or a heartbeat
//! is not answered within [`HEARTBEAT`], every waiter is woken once, `Lost` is sent, and it
//! reconnects after a second (`Live` once it listens again); releases in that gap are left to
//! backoff.

mod admin;

use crate::fence::token::Token;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio::sync::{watch, OnceCell};
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{AsyncMessage, NoTls, Socket};

use super::backend::{Acquired, Grant, GrantEvents, LeaseBackend, LeaseError};
use super::shared::{self, new_lease_id, GrantFeed, Waiters, HEARTBEAT};
use crate::conn::postgres::{describe, failure, pool, Guard, PgTls, START_CHECK};
use crate::conn::BoxFuture;
use crate::tls::ClientTls;

/// Payloads are limited to 8000 bytes; a longer resource wakes every waiter instead.
const MAX_PAYLOAD: usize = 7900;

/// How far a resource's counter moves on when its grant is made on another timeline than its
/// last (a promoted standby, which may lack the grants its old primary made last): more grants
/// than a failover can lose, far below what a `BIGINT` holds for any number of failovers, and
/// within the fence's default `token.max_step` (2^40).
pub const EPOCH_GAP: i64 = 1 << 32;

/// The server's timeline (a promotion starts a new one), as the first eight hex digits of the
/// current WAL file's name; 0 on a standby (where the grant then fails read-only, as before).
const TIMELINE: &str = "SELECT CASE WHEN pg_is_in_recovery() THEN 0 \
     ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int \
     END AS timeline";

pub struct PostgresLeases {
    pool: Pool,
    /// Which connections may be used ([`Guard`]).
    guard: Arc<Guard>,
    config: tokio_postgres::Config,
    /// TLS for every connection, the listener's too (the pool's carry it already).
    tls: Option<Arc<ClientTls>>,
    /// Table created (idempotently) before the first statement.
    schema: OnceCell<()>,
    table: String,
    channel: String,
    grant_channel: String,
    acquire_sql: String,
    renew_sql: String,
    release_sql: String,
    latest_sql: String,
    live_sql: String,
    waiters: Arc<Waiters>,
    grants: Arc<GrantFeed>,
    /// The listening task, started by the first `changed()` or `grant_events()`, and whether
    /// it is listening.
    listener: OnceLock<Listener>,
}

struct Listener {
    task: tokio::task::AbortHandle,
    listening: watch::Receiver<bool>,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl PostgresLeases {
    /// `prefix` is validated as an SQL identifier when the config is loaded.
    pub fn new(
        url: &str,
        prefix: &str,
        tls: Option<Arc<ClientTls>>,
        replicas: Option<u32>,
    ) -> Result<Self, LeaseError> {
        let (pool, config, guard) =
            pool(url, tls.clone(), replicas).map_err(LeaseError::config_from)?;
        let table = format!("{prefix}_leases");
        // Unquoted identifiers fold to lower case; channel names given as strings do not.
        let channel = table.to_ascii_lowercase();
        let grant_channel = format!("{channel}_granted");
        let ttl = "now() + $4::float8 * interval '1 millisecond'";
        Ok(PostgresLeases {
            pool,
            guard,
            config,
            tls,
            schema: OnceCell::new(),
            acquire_sql: format!(
                "WITH server AS ({TIMELINE}), \
                 granted AS (\
                   INSERT INTO {table} AS l \
                     (resource_id, holder_id, lease_id, fencing_token, expires_at, updated_at, \
                      timeline) \
                   SELECT $1, $2, $3, \
                     CASE WHEN server.timeline > 1 THEN {EPOCH_GAP} + 1 ELSE 1 END, \
                     {ttl}, now(), server.timeline \
                   FROM server \
                   ON CONFLICT (resource_id) DO UPDATE \
                   SET holder_id = EXCLUDED.holder_id, lease_id = EXCLUDED.lease_id, \
                       fencing_token = l.fencing_token + 1 + \
                         CASE WHEN COALESCE(l.timeline, 1) <> EXCLUDED.timeline \
                              THEN {EPOCH_GAP} ELSE 0 END, \
                       expires_at = EXCLUDED.expires_at, updated_at = now(), \
                       timeline = EXCLUDED.timeline \
                   WHERE l.expires_at <= now() \
                   RETURNING fencing_token, resource_id) \
                 SELECT fencing_token, NULL::text, \
                   pg_notify('{grant_channel}', \
                     CASE WHEN octet_length(resource_id) <= {MAX_PAYLOAD} \
                          THEN resource_id ELSE '' END)::text \
                 FROM granted \
                 UNION ALL \
                 SELECT NULL::bigint, holder_id, NULL::text FROM {table} \
                 WHERE resource_id = $1 AND NOT EXISTS (SELECT 1 FROM granted)"
            ),
            renew_sql: format!(
                "UPDATE {table} SET expires_at = {ttl}, updated_at = now() \
                 WHERE resource_id = $1 AND lease_id = $2 AND fencing_token = $3 \
                   AND expires_at > now()"
            ),
            release_sql: format!(
                "WITH released AS (\
                   UPDATE {table} SET holder_id = NULL, lease_id = NULL, \
                     expires_at = '-infinity', updated_at = now() \
                   WHERE resource_id = $1 AND lease_id = $2 AND fencing_token = $3 \
                     AND expires_at > now() \
                   RETURNING resource_id) \
                 SELECT pg_notify('{channel}', \
                   CASE WHEN octet_length(resource_id) <= {MAX_PAYLOAD} \
                        THEN resource_id ELSE '' END)::text \
                 FROM released"
            ),
            latest_sql: format!("SELECT fencing_token FROM {table} WHERE resource_id = $1"),
            live_sql: format!(
                "SELECT 1 FROM {table} WHERE resource_id = $1 AND expires_at > now()"
            ),
            table,
            channel,
            grant_channel,
            waiters: Arc::new(Waiters::default()),
            grants: Arc::new(GrantFeed::new(false)),
            listener: OnceLock::new(),
        })
    }

    /// At start-up: refuses a server whose replication falls short of `replicas`
    /// ([`Guard::check_at_start`]).
    pub async fn check_at_start(&self) -> Result<(), LeaseError> {
        self.guard
            .check_at_start(&self.pool, START_CHECK)
            .await
            .map_err(|e| LeaseError::config(format!("leases.backend: {e}")).with_source(e))
    }

    /// A failed call, with the error's causes ([`describe`]); a read-only answer retires the
    /// pool's connections ([`Guard::note`]).
    fn failed(&self, e: &(dyn std::error::Error + 'static)) -> LeaseError {
        self.guard.note(e);
        failed(e)
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, LeaseError> {
        let client = self.pool.get().await.map_err(|e| self.failed(&e))?;
        self.schema
            .get_or_try_init(|| async {
                client
                    .batch_execute(&format!(
                        "CREATE TABLE IF NOT EXISTS {} (\
                           resource_id TEXT PRIMARY KEY, \
                           holder_id TEXT, \
                           lease_id TEXT, \
                           fencing_token BIGINT NOT NULL CHECK (fencing_token > 0), \
                           expires_at TIMESTAMPTZ NOT NULL, \
                           updated_at TIMESTAMPTZ NOT NULL DEFAULT now(), \
                           timeline INTEGER); \
                         ALTER TABLE {} ADD COLUMN IF NOT EXISTS timeline INTEGER",
                        self.table, self.table
                    ))
                    .await
                    .map_err(|e| self.failed(&e))
            })
            .await?;
        Ok(client)
    }

    /// The listening task, started on first use (inside a Tokio runtime).
    fn listener(&self) -> &Listener {
        self.listener.get_or_init(|| {
            let (tx, listening) = watch::channel(false);
            let (config, channel, grant_channel) = (
                self.config.clone(),
                self.channel.clone(),
                self.grant_channel.clone(),
            );
            let (waiters, grants) = (Arc::clone(&self.waiters), Arc::clone(&self.grants));
            let task = match &self.tls {
                Some(tls) => tokio::spawn(listen(
                    config,
                    PgTls(Arc::clone(tls)),
                    channel,
                    grant_channel,
                    waiters,
                    grants,
                    tx,
                )),
                None => tokio::spawn(listen(
                    config,
                    NoTls,
                    channel,
                    grant_channel,
                    waiters,
                    grants,
                    tx,
                )),
            }
            .abort_handle();
            Listener { task, listening }
        })
    }
}

/// Keeps one connection listening on the release and grant channels, with a heartbeat,
/// reconnecting after a second when it drops.
async fn listen<T>(
    config: tokio_postgres::Config,
    tls: T,
    channel: String,
    grant_channel: String,
    waiters: Arc<Waiters>,
    grants: Arc<GrantFeed>,
    listening: watch::Sender<bool>,
) where
    T: MakeTlsConnect<Socket> + Clone + Send + 'static,
    T::Stream: Send + 'static,
    T::TlsConnect: Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    let listen_sql = format!("LISTEN \"{channel}\"; LISTEN \"{grant_channel}\"");
    loop {
        match config.connect(tls.clone()).await {
            Ok((client, mut connection)) => {
                let (wake, announce) = (Arc::clone(&waiters), Arc::clone(&grants));
                let grant_channel = grant_channel.clone();
                // The connection yields notifications only while polled; this also drives the
                // LISTEN and the heartbeats below.
                let mut driver = tokio::spawn(async move {
                    loop {
                        match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                            Some(Ok(AsyncMessage::Notification(n))) => {
                                match (n.channel() == grant_channel, n.payload()) {
                                    (true, "") => announce.resync(),
                                    (true, resource) => announce.changed(resource),
                                    (false, "") => wake.wake_all(),
                                    (false, resource) => wake.wake(resource),
                                }
                            }
                            Some(Ok(_)) => {}
                            Some(Err(_)) | None => return,
                        }
                    }
                });
                let listened = tokio::select! {
                    r = client.batch_execute(&listen_sql) => r.is_ok(),
                    _ = &mut driver => false,
                };
                if listened {
                    listening.send_replace(true);
                    grants.live();
                    let mut heartbeat = tokio::time::interval(HEARTBEAT);
                    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    loop {
                        tokio::select! {
                            _ = &mut driver => break,
                            _ = heartbeat.tick() => {
                                let answer =
                                    tokio::time::timeout(HEARTBEAT, client.simple_query("SELECT 1"))
                                        .await;
                                if !matches!(answer, Ok(Ok(_))) {
                                    break;
                                }
                            }
                        }
                    }
                }
                driver.abort();
                drop(client);
                listening.send_replace(false);
                grants.lost();
                // Notifications may have been lost: let every waiter look again.
                waiters.wake_all();
            }
            Err(e) => {
                tracing::debug!(error = %e, "postgres lease listener cannot connect");
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// A failed call, with the error's causes ([`describe`]).
fn failed(e: &(dyn std::error::Error + 'static)) -> LeaseError {
    LeaseError::new(failure(e), format!("postgres: {}", describe(e)))
}

fn token_of(v: i64) -> Result<Token, LeaseError> {
    Token::try_from(v)
        .map_err(|_| LeaseError::corrupt(format!("postgres holds a negative token {v}")))
}

fn ttl_ms(ttl: Duration) -> f64 {
    ttl.as_secs_f64() * 1000.0
}

impl LeaseBackend for PostgresLeases {
    fn try_acquire<'a>(
        &'a self,
        resource: &'a str,
        holder: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LeaseError>> {
        Box::pin(async move {
            let client = self.client().await?;
            let statement = client
                .prepare_cached(&self.acquire_sql)
                .await
                .map_err(|e| self.failed(&e))?;
            let lease_id = new_lease_id();
            let row = client
                .query_opt(&statement, &[&resource, &holder, &lease_id, &ttl_ms(ttl)])
                .await
                .map_err(|e| self.failed(&e))?;
            let Some(row) = row else {
                // Held by a row committed after this statement's snapshot.
                return Ok(Acquired::Held { holder: None });
            };
            let token: Option<i64> = row.get(0);
            match token {
                Some(token) => Ok(Acquired::Granted(Grant {
                    resource: resource.to_owned(),
                    holder: holder.to_owned(),
                    lease_id,
                    token: token_of(token)?,
                })),
                None => Ok(Acquired::Held { holder: row.get(1) }),
            }
        })
    }

    fn renew<'a>(
        &'a self,
        grant: &'a Grant,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, LeaseError>> {
        Box::pin(async move {
            let token = grant.token.to_i64();
            let client = self.client().await?;
            let statement = client
                .prepare_cached(&self.renew_sql)
                .await
                .map_err(|e| self.failed(&e))?;
            let n = client
                .execute(
                    &statement,
                    &[&grant.resource, &grant.lease_id, &token, &ttl_ms(ttl)],
                )
                .await
                .map_err(|e| self.failed(&e))?;
            Ok(n == 1)
        })
    }

    fn release<'a>(&'a self, grant: &'a Grant) -> BoxFuture<'a, Result<bool, LeaseError>> {
        Box::pin(async move {
            let token = grant.token.to_i64();
            let client = self.client().await?;
            let statement = client
                .prepare_cached(&self.release_sql)
                .await
                .map_err(|e| self.failed(&e))?;
            let rows = client
                .query(&statement, &[&grant.resource, &grant.lease_id, &token])
                .await
                .map_err(|e| self.failed(&e))?;
            Ok(rows.len() == 1)
        })
    }

    fn latest_token<'a>(
        &'a self,
        resource: &'a str,
    ) -> BoxFuture<'a, Result<Option<Token>, LeaseError>> {
        Box::pin(async move {
            let client = self.client().await?;
            let statement = client
                .prepare_cached(&self.latest_sql)
                .await
                .map_err(|e| self.failed(&e))?;
            let row = client
                .query_opt(&statement, &[&resource])
                .await
                .map_err(|e| self.failed(&e))?;
            row.map(|r| token_of(r.get(0))).transpose()
        })
    }

    fn changed<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, ()> {
        // Not listening (PostgreSQL down?): the waiter's backoff wakes it meanwhile.
        let listening = self.listener().listening.clone();
        let free = async move {
            let live = async {
                let client = self.client().await?;
                let statement = client
                    .prepare_cached(&self.live_sql)
                    .await
                    .map_err(|e| self.failed(&e))?;
                let row = client
                    .query_opt(&statement, &[&resource])
                    .await
                    .map_err(|e| self.failed(&e))?;
                Ok::<_, LeaseError>(row.is_some())
            };
            matches!(live.await, Ok(false))
        };
        Box::pin(shared::changed(listening, &self.waiters, resource, free))
    }

    fn grant_events(&self) -> GrantEvents {
        let events = self.grants.subscribe();
        self.listener();
        events
    }

    fn kind(&self) -> &'static str {
        "postgres"
    }
}
