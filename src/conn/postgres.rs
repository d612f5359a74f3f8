//! Connections to PostgreSQL, as the fence store and the lease backend make them: a pool
//! ([`pool`]) and, with the `tls` mapping, TLS only ([`PgTls`]).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use deadpool_postgres::{
    ClientWrapper, Hook, HookError, Manager, ManagerConfig, Metrics, Pool, RecyclingMethod,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::config::SslMode;
use tokio_postgres::error::SqlState;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};
use tokio_postgres::{NoTls, Socket};

use super::url::UrlReadError;
use super::{BoxFuture, Failure};
use crate::sync::Locked;
use crate::tls::ClientTls;

/// A connection pool for `url` (at most 16 connections), the same for the store and the lease
/// backend; also returns the parsed config for dedicated connections, and the pool's
/// [`Guard`].
///
/// With `tls`, every connection is TLS through [`PgTls`] (`sslmode=require`, so never
/// plaintext: a server that does not offer TLS is an error) and the certificate and name are
/// verified as `verify-full` does; an `sslmode` in the url (only `require`, `verify-ca` or
/// `verify-full` load with `tls`) is replaced by that.
///
/// Every new connection is checked before it is used ([`Guard::check`]): a read-only session
/// (a standby, or a primary fenced read-only) and a server whose replication falls short of
/// `replicas` are refused. A pooled connection made before one of the pool's connections
/// answered "read-only" ([`Guard::note`]) is not reused: after a failover, connections to the
/// old primary are dropped and new ones reach the new primary (with
/// `target_session_attrs=read-write` in a multi-host url).
pub(crate) fn pool(
    url: &str,
    tls: Option<Arc<ClientTls>>,
    replicas: Option<u32>,
) -> Result<(Pool, tokio_postgres::Config, Arc<Guard>), PoolSetupError> {
    let mut config = super::url::postgres(url, tls.is_some())?;
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
    let guard = Arc::new(Guard::new(replicas));
    let (checking, recycling) = (Arc::clone(&guard), Arc::clone(&guard));
    let pool = Pool::builder(manager)
        .max_size(16)
        .post_create(Hook::async_fn(move |client: &mut ClientWrapper, _| {
            let guard = Arc::clone(&checking);
            Box::pin(async move {
                guard
                    .check(client)
                    .await
                    .map_err(|e| HookError::message(e.to_string()))
            })
        }))
        .pre_recycle(Hook::sync_fn(move |_, metrics: &Metrics| {
            if recycling.outdated(metrics.created) {
                Err(HookError::message("made before a read-only answer"))
            } else {
                Ok(())
            }
        }))
        .build()
        .map_err(PoolSetupError::Build)?;
    Ok((pool, config, guard))
}

/// Why no pool was made for a url.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PoolSetupError {
    /// The url cannot be read.
    #[error(transparent)]
    Url(#[from] UrlReadError),
    /// deadpool refused the pool's settings.
    #[error("postgres pool: {0}")]
    Build(#[source] deadpool_postgres::BuildError),
}

/// Why a new connection is not used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CheckError {
    /// The query that reads the session's and the server's settings failed.
    #[error("checking the server: {}", describe(.0))]
    Query(#[source] tokio_postgres::Error),
    /// The session is read-only: a standby, or a primary being failed over.
    #[error(
        "the server is read-only (a standby, or a primary being failed over): name the primary, \
         or every host with target_session_attrs=read-write"
    )]
    ReadOnly,
    /// The server's replication falls short of `replicas`.
    #[error(transparent)]
    Replication(#[from] Shortfall),
}

/// How a server's replication falls short of `replicas`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Shortfall {
    /// Standbys are connected and no commit waits for one (`replicas` not written, or 1 or
    /// more with no synchronous standby).
    #[error(
        "the PostgreSQL server replicates to its standbys asynchronously ({settings}): a \
         failover to one can lose raises and grants already acknowledged. Make a standby \
         synchronous (synchronous_standby_names) and set `replicas: 1`, or set `replicas: 0` to \
         accept that window"
    )]
    Asynchronous {
        /// The replication settings, in words.
        settings: String,
    },
    /// Commits wait for fewer synchronous standbys than `replicas`.
    #[error(
        "`replicas: {replicas}` needs commits to wait for {replicas} synchronous standby(s), and \
         the PostgreSQL server waits for {waits} ({settings}): set synchronous_standby_names \
         (and synchronous_commit = on) on the server, or lower `replicas`"
    )]
    TooFewWaits {
        /// `replicas`, as configured.
        replicas: u32,
        /// The synchronous standbys a commit waits for.
        waits: u32,
        /// The replication settings, in words.
        settings: String,
    },
}

/// How long the start-up check waits for a connection ([`Guard::check_at_start`]).
pub(crate) const START_CHECK: std::time::Duration = std::time::Duration::from_secs(3);

/// What a pool's connections must be: read-write, on a server whose replication fits
/// `replicas`, and made after the last read-only answer any of them gave.
pub(crate) struct Guard {
    replicas: Option<u32>,
    /// Connections made before `base + stale_before` nanoseconds are not reused (0: none).
    base: Instant,
    stale_before: AtomicU64,
    /// The last replication refusal, for [`Guard::refusal`] at start-up.
    refused: Mutex<Option<Shortfall>>,
    /// The last warning logged, so that each new connection does not log it again.
    warned: Mutex<Option<String>>,
}

/// How the server replicates, as a new connection sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Replication {
    pub synchronous_standby_names: String,
    /// As this session commits (a role or database setting applies to it).
    pub synchronous_commit: String,
    /// Standbys connected to this server (rows of `pg_stat_replication`).
    pub standbys: i64,
    /// Of them, those in the synchronous set now (`sync_state` `sync` or `quorum`).
    pub synchronous_now: i64,
}

/// The verdict on a server's replication: refuse it, or use it with a warning or without.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    Fits,
    Warn(String),
    Refuse(Shortfall),
}

impl Replication {
    /// How many standbys a commit waits for: the number in `synchronous_standby_names`
    /// (`FIRST n (…)`, `ANY n (…)`, `n (…)`; 1 for a plain list or `*`), none when it is empty
    /// or `synchronous_commit` does not wait for standbys (`off`, `local`).
    pub fn waits_for(&self) -> u32 {
        if !matches!(
            self.synchronous_commit.as_str(),
            "on" | "remote_write" | "remote_apply"
        ) {
            return 0;
        }
        let names = self.synchronous_standby_names.trim();
        if names.is_empty() {
            return 0;
        }
        let mut rest = names;
        for method in ["first", "any"] {
            if rest.len() > method.len()
                && rest[..method.len()].eq_ignore_ascii_case(method)
                && rest[method.len()..].starts_with(char::is_whitespace)
            {
                rest = rest[method.len()..].trim_start();
            }
        }
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        if !digits.is_empty() && rest[digits.len()..].trim_start().starts_with('(') {
            digits.parse().unwrap_or(u32::MAX)
        } else {
            1
        }
    }

    /// Judges the server against `replicas` (`None`: one when any standby is connected).
    pub fn judge(&self, replicas: Option<u32>) -> Verdict {
        let waits = self.waits_for();
        let settings = format!(
            "synchronous_standby_names = '{}', synchronous_commit = {}, {} standby(s) connected",
            self.synchronous_standby_names, self.synchronous_commit, self.standbys
        );
        match replicas {
            None if self.standbys > 0 && waits == 0 => {
                Verdict::Refuse(Shortfall::Asynchronous { settings })
            }
            None => Verdict::Fits,
            Some(0) if self.standbys > 0 && waits == 0 => Verdict::Warn(format!(
                "the PostgreSQL server replicates asynchronously ({settings}) and `replicas: 0` \
                 accepts it: a failover can lose raises and grants already acknowledged"
            )),
            Some(0) => Verdict::Fits,
            Some(n) if waits < n => Verdict::Refuse(Shortfall::TooFewWaits {
                replicas: n,
                waits,
                settings,
            }),
            Some(n) if self.synchronous_now < i64::from(n) => Verdict::Warn(format!(
                "`replicas: {n}`: {} synchronous standby(s) connected now ({settings}); \
                 commits wait for the others, so raises and grants time out until they connect",
                self.synchronous_now
            )),
            Some(_) => Verdict::Fits,
        }
    }
}

impl Guard {
    fn new(replicas: Option<u32>) -> Guard {
        Guard {
            replicas,
            base: Instant::now(),
            stale_before: AtomicU64::new(0),
            refused: Mutex::new(None),
            warned: Mutex::new(None),
        }
    }

    /// Checks a new connection: refused when its session is read-only or the server's
    /// replication falls short of `replicas`; a shortfall that is allowed is logged.
    async fn check(&self, client: &tokio_postgres::Client) -> Result<(), CheckError> {
        let row = client
            .query_one(
                "SELECT current_setting('transaction_read_only') = 'on' OR pg_is_in_recovery(), \
                 current_setting('synchronous_standby_names'), \
                 current_setting('synchronous_commit'), \
                 (SELECT count(*) FROM pg_stat_replication), \
                 (SELECT count(*) FROM pg_stat_replication \
                 WHERE sync_state IN ('sync', 'quorum'))",
                &[],
            )
            .await
            .map_err(CheckError::Query)?;
        if row.get::<_, bool>(0) {
            return Err(CheckError::ReadOnly);
        }
        let replication = Replication {
            synchronous_standby_names: row.get(1),
            synchronous_commit: row.get(2),
            standbys: row.get(3),
            synchronous_now: row.get(4),
        };
        match replication.judge(self.replicas) {
            Verdict::Fits => Ok(()),
            Verdict::Warn(message) => {
                let mut warned = self.warned.locked();
                if warned.as_deref() != Some(message.as_str()) {
                    tracing::warn!("postgres: {message}");
                    *warned = Some(message);
                }
                Ok(())
            }
            Verdict::Refuse(shortfall) => {
                *self.refused.locked() = Some(shortfall.clone());
                Err(shortfall.into())
            }
        }
    }

    /// Notes a failed call: when the server answered that it is read-only (SQLSTATE 25006,
    /// `read_only_sql_transaction`), no connection made until now is reused.
    pub fn note(&self, e: &(dyn std::error::Error + 'static)) {
        if read_only(e) {
            let now = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.stale_before
                .fetch_max(now.saturating_add(1), Ordering::Relaxed);
        }
    }

    fn outdated(&self, created: Instant) -> bool {
        let before = self.stale_before.load(Ordering::Relaxed);
        let at = u64::try_from(created.saturating_duration_since(self.base).as_nanos())
            .unwrap_or(u64::MAX);
        before != 0 && at < before
    }

    /// The replication refusal of the last connection refused for it, if any.
    pub fn refusal(&self) -> Option<Shortfall> {
        self.refused.locked().clone()
    }

    /// At start-up: a connection within `wait`, so that a server whose replication falls
    /// short of `replicas` stops the start with the reason. A server not reached in time is
    /// left to later connections, which are checked the same way.
    pub async fn check_at_start(
        &self,
        pool: &Pool,
        wait: std::time::Duration,
    ) -> Result<(), Shortfall> {
        let _ = tokio::time::timeout(wait, pool.get()).await;
        match self.refusal() {
            Some(reason) => Err(reason),
            None => Ok(()),
        }
    }
}

/// `s` with `LIKE`'s wildcards and escape character escaped.
pub(crate) fn like_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '%' | '_' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Whether the server answered that it is read-only (SQLSTATE 25006).
fn read_only(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        if let Some(db) = e.downcast_ref::<tokio_postgres::error::DbError>() {
            return *db.code() == SqlState::READ_ONLY_SQL_TRANSACTION;
        }
        next = e.source();
    }
    false
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

/// How a PostgreSQL call failed, from the error and its causes: the server's own error
/// (authentication, permissions, a read-only transaction, a full disk, a constraint) is
/// refused; the pool's wait or a connect attempt that timed out is a timeout; anything else
/// (connecting, TLS, a connection that closed) unreachable.
pub(crate) fn failure(e: &(dyn std::error::Error + 'static)) -> Failure {
    let mut next = Some(e);
    while let Some(e) = next {
        if e.is::<tokio_postgres::error::DbError>() {
            return Failure::Refused;
        }
        if let Some(deadpool_postgres::PoolError::Timeout(_)) = e.downcast_ref() {
            return Failure::Timeout;
        }
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return Failure::Timeout;
        }
        next = e.source();
    }
    Failure::Unreachable
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::url::without_sslmode;

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
        let (_, config, _) =
            pool("postgres://u@h/db?sslmode=verify-full", Some(tls), None).unwrap();
        assert_eq!(config.get_ssl_mode(), SslMode::Require);
        let (_, config, _) = pool("postgres://u@h/db", None, None).unwrap();
        assert_eq!(config.get_ssl_mode(), SslMode::Prefer);
    }

    #[test]
    fn failures_are_told_apart() {
        let waited = deadpool_postgres::PoolError::Timeout(deadpool_postgres::TimeoutType::Wait);
        assert_eq!(failure(&waited), Failure::Timeout);
        let timed_out = std::io::Error::new(std::io::ErrorKind::TimedOut, "x");
        assert_eq!(failure(&timed_out), Failure::Timeout);
        assert_eq!(
            failure(&deadpool_postgres::PoolError::Closed),
            Failure::Unreachable
        );
    }

    fn replication(names: &str, commit: &str, standbys: i64, now: i64) -> Replication {
        Replication {
            synchronous_standby_names: names.into(),
            synchronous_commit: commit.into(),
            standbys,
            synchronous_now: now,
        }
    }

    #[test]
    fn commits_wait_for_the_standbys_the_settings_name() {
        for (names, commit, waits) in [
            ("", "on", 0),
            ("standby1", "on", 1),
            ("*", "remote_apply", 1),
            ("a, b", "remote_write", 1),
            ("FIRST 2 (a, b, c)", "on", 2),
            ("any 3 (a,b,c)", "on", 3),
            ("2 (a, b)", "on", 2),
            ("first_standby", "on", 1),
            ("standby1", "local", 0),
            ("standby1", "off", 0),
        ] {
            assert_eq!(
                replication(names, commit, 1, 0).waits_for(),
                waits,
                "{names} / {commit}"
            );
        }
    }

    #[test]
    fn replication_is_judged_against_replicas() {
        let lone = replication("", "on", 0, 0);
        assert_eq!(lone.judge(None), Verdict::Fits);
        assert_eq!(lone.judge(Some(0)), Verdict::Fits);
        assert!(
            matches!(lone.judge(Some(1)), Verdict::Refuse(m) if m.to_string().contains("waits for 0"))
        );
        let asynchronous = replication("", "on", 1, 0);
        assert!(
            matches!(asynchronous.judge(None), Verdict::Refuse(m) if m.to_string().contains("`replicas: 0`"))
        );
        assert!(matches!(asynchronous.judge(Some(0)), Verdict::Warn(_)));
        let off = replication("standby1", "local", 1, 1);
        assert!(matches!(off.judge(None), Verdict::Refuse(_)));
        let synchronous = replication("standby1", "on", 1, 1);
        assert_eq!(synchronous.judge(None), Verdict::Fits);
        assert_eq!(synchronous.judge(Some(1)), Verdict::Fits);
        assert!(matches!(synchronous.judge(Some(2)), Verdict::Refuse(_)));
        let waiting = replication("standby1", "on", 0, 0);
        assert!(matches!(waiting.judge(Some(1)), Verdict::Warn(m) if m.contains("time out")));
    }

    #[test]
    fn failures_other_than_read_only_keep_the_connections() {
        let guard = Guard::new(None);
        let before = Instant::now();
        assert!(!guard.outdated(before));
        guard.note(&std::io::Error::other("not a server answer"));
        assert!(!guard.outdated(before));
    }
}
