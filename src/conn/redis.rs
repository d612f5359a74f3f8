//! Connections to Redis, as the fence store and the lease backend make them: fencegate's own
//! TCP, or TLS through [`ClientTls`] for a `rediss://` url (so the ring provider, the `tls`
//! mapping's CA, client certificate and `server_name`, and certificate rotation apply as to
//! every store), with the redis crate speaking the protocol over them (`AUTH` with the url's
//! user and password, `SELECT`, `HELLO`).
//!
//! [`RedisTarget`] says where and how to connect; [`RedisConn`] is one shared connection,
//! dialled on first use and again after it broke.
//!
//! With Sentinel ([`RedisTarget::with_sentinel`]), each new connection first asks the
//! Sentinels where the primary is (`SENTINEL GET-MASTER-ADDR-BY-NAME`, the last Sentinel that
//! answered asked first), dials it with the url's user, password and database (and the same
//! TLS), and checks with `ROLE` that it is the primary: a server a Sentinel still names during
//! a failover, but that is a replica now, is never written to. No primary known: no connection
//! (the caller answers 503). The redis crate's own `sentinel` feature is not used: it dials
//! with its own TCP and TLS (not [`ClientTls`], its CA rotation and `server_name`), and asks
//! `SENTINEL MASTERS`, a wider permission than the one command needed here.
//!
//! [`RedisConn::replicated`] is `WAIT`: after a write, the caller waits until the configured
//! number of replicas acknowledged it, so that a failover keeps what was acknowledged; with
//! Sentinel, until every replica the Sentinels could promote did (when that is more), and
//! nothing is acknowledged while a Sentinel says a failover may be under way ([`watch`]); in a
//! Redis Cluster, until every replica the slot map lists for the primary did ([`cluster`]).

mod cluster;
mod watch;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ErrorKind, ProtocolVersion, RedisConnectionInfo, RedisError};

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use super::url::UrlReadError;
use super::Failure;
use crate::config::{RedisHa, WAIT_TIMEOUT};
use crate::tls::ClientTls;

/// Keys a `SCAN` step asks for (and how many keys one script is given after it).
pub(crate) const SCAN_BATCH: usize = 1000;

/// Connect timeout (TCP, TLS handshake and `AUTH` together) and per-command response
/// timeout: fail fast, so the caller's deadline, not ours, decides how long a write waits.
/// The response timeout is below the readiness probe's (1s), so a probe sees a command time
/// out rather than giving up on it first.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
const RESPONSE_TIMEOUT: Duration = Duration::from_millis(800);

/// TCP keep-alive on every connection: a peer that vanished without closing (a host gone, a
/// dropped path) is noticed by the kernel even while no command is waiting.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_RETRIES: u32 = 3;

/// Where and how to reach Redis: the url's host, port and settings (user, password,
/// database, protocol), over TCP or, for `rediss://`, TLS.
#[derive(Clone)]
pub(crate) struct RedisTarget {
    host: String,
    port: u16,
    settings: RedisConnectionInfo,
    tls: Option<Arc<ClientTls>>,
    /// With Sentinel, where the primary is found; `host` and `port` are then not dialled.
    sentinel: Option<Arc<Sentinels>>,
    /// A Redis Cluster: `host` and `port` are one node, these are more, each asked for the
    /// slot map (and dialled for lease events) in turn.
    cluster: bool,
    seeds: Vec<(String, u16)>,
}

/// The Sentinels of one master name.
struct Sentinels {
    master: String,
    nodes: Vec<RedisTarget>,
    /// The Sentinel that answered last, asked first next time.
    first: AtomicUsize,
    /// What the Sentinels' events say of the master.
    watch: watch::Watch,
    /// The tasks following each Sentinel's events, started with the first connection.
    followers: OnceLock<Vec<tokio::task::AbortHandle>>,
}

impl Drop for Sentinels {
    fn drop(&mut self) {
        for task in self.followers.get().into_iter().flatten() {
            task.abort();
        }
    }
}

/// An I/O error (unreachable, never a server's refusal): no primary to connect to.
fn no_primary(detail: String) -> RedisError {
    std::io::Error::new(std::io::ErrorKind::NotConnected, detail).into()
}

impl Sentinels {
    /// Starts following every Sentinel's events, once.
    fn follow(self: &Arc<Self>) {
        self.followers.get_or_init(|| {
            (0..self.nodes.len())
                .map(|at| tokio::spawn(watch::follow(Arc::downgrade(self), at)).abort_handle())
                .collect()
        });
    }

    /// The primary's host and port, as the first Sentinel that knows says.
    async fn primary(&self) -> Result<(String, u16), RedisError> {
        let n = self.nodes.len();
        let first = self.first.load(Ordering::Relaxed);
        let mut failures = Vec::new();
        for i in 0..n {
            let at = (first + i) % n;
            let node = &self.nodes[at];
            match self.ask(at, node).await {
                Ok(Some(addr)) => {
                    self.first.store(at, Ordering::Relaxed);
                    return Ok(addr);
                }
                Ok(None) => failures.push(format!(
                    "{}:{} knows no master `{}`",
                    node.host, node.port, self.master
                )),
                Err(e) => failures.push(format!("{}:{}: {e}", node.host, node.port)),
            }
        }
        Err(no_primary(format!(
            "no Sentinel named the primary of `{}` ({})",
            self.master,
            failures.join("; ")
        )))
    }

    /// Sentinel `at` (`node`) names the primary, and says which replicas it could promote
    /// (so that the first write on a new connection already waits for them; a refusal of that
    /// is left to the Sentinel's follower to report).
    async fn ask(
        &self,
        at: usize,
        node: &RedisTarget,
    ) -> Result<Option<(String, u16)>, RedisError> {
        let config = AsyncConnectionConfig::new().set_response_timeout(Some(RESPONSE_TIMEOUT));
        let mut conn = node.dial(&node.host, node.port, config).await?;
        let primary = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(&self.master)
            .query_async(&mut conn)
            .await?;
        let _ = watch::ask_replicas(&self.watch, at, &self.master, &mut conn).await;
        Ok(primary)
    }
}

/// Why a [`RedisTarget`] cannot be made (the config refuses each of these when it loads).
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum TargetError {
    /// The url cannot be read.
    #[error(transparent)]
    Url(#[from] UrlReadError),
    /// `rediss://` without TLS settings, or `redis://` with them.
    #[error("a rediss:// url goes with TLS settings, a redis:// url without")]
    TlsMismatch,
    /// A cluster seed that is not `host:port`.
    #[error("cluster: `{0}` is not host:port")]
    Seed(String),
    /// A Sentinel's url that does not make a target.
    #[error("sentinel: {0}")]
    Sentinel(#[source] Box<TargetError>),
    /// A Sentinel's url with a database.
    #[error("a Sentinel url names no database")]
    SentinelDatabase,
    /// No Sentinel urls.
    #[error("sentinel: no Sentinel urls")]
    NoSentinels,
}

impl RedisTarget {
    /// `tls` is given exactly when the url is `rediss://` (the config checks that).
    pub(crate) fn new(url: &str, tls: Option<Arc<ClientTls>>) -> Result<Self, TargetError> {
        let url = super::url::redis(url)?;
        if url.tls != tls.is_some() {
            return Err(TargetError::TlsMismatch);
        }
        Ok(RedisTarget {
            host: url.host,
            port: url.port,
            settings: url.settings,
            tls,
            sentinel: None,
            cluster: false,
            seeds: Vec::new(),
        })
    }

    /// The node at `host:port`, reached with this target's settings and TLS.
    fn at(&self, host: &str, port: u16) -> Self {
        RedisTarget {
            host: host.to_owned(),
            port,
            settings: self.settings.clone(),
            tls: self.tls.clone(),
            sentinel: None,
            cluster: false,
            seeds: Vec::new(),
        }
    }

    /// A Redis Cluster, with `seeds` (`host:port`) besides the url's node.
    pub(crate) fn with_cluster(mut self, seeds: &[String]) -> Result<Self, TargetError> {
        self.seeds = seeds
            .iter()
            .map(|seed| {
                crate::config::parse_seed(seed).ok_or_else(|| TargetError::Seed(seed.clone()))
            })
            .collect::<Result<_, _>>()?;
        self.cluster = true;
        Ok(self)
    }

    /// The url's target with `ha`'s Sentinels, if it names any: each Sentinel url is read like
    /// the data nodes' (its own user and password; the same TLS).
    pub(crate) fn with_ha(self, ha: &RedisHa) -> Result<Self, TargetError> {
        if let Some(cluster) = &ha.cluster {
            return self.with_cluster(&cluster.seeds);
        }
        match &ha.sentinel {
            None => Ok(self),
            Some(sentinel) => {
                let urls: Vec<&str> = sentinel.urls.iter().map(|u| u.expose()).collect();
                self.with_sentinel(&sentinel.master, &urls)
            }
        }
    }

    /// The primary of `master` as the Sentinels at `urls` say, reached with this target's
    /// settings (user, password, database) and TLS.
    pub(crate) fn with_sentinel(
        mut self,
        master: &str,
        urls: &[&str],
    ) -> Result<Self, TargetError> {
        let nodes = urls
            .iter()
            .map(|url| {
                let node = RedisTarget::new(url, self.tls.clone())
                    .map_err(|e| TargetError::Sentinel(Box::new(e)))?;
                if node.settings.db() != 0 {
                    return Err(TargetError::SentinelDatabase);
                }
                Ok(node)
            })
            .collect::<Result<Vec<_>, _>>()?;
        if nodes.is_empty() {
            return Err(TargetError::NoSentinels);
        }
        self.sentinel = Some(Arc::new(Sentinels {
            master: master.to_owned(),
            watch: watch::Watch::new(nodes.len()),
            nodes,
            first: AtomicUsize::new(0),
            followers: OnceLock::new(),
        }));
        Ok(self)
    }

    /// Why a write on the primary may not be acknowledged now: a Sentinel says a failover
    /// may be under way.
    fn doubt(&self) -> Option<String> {
        let sentinels = self.sentinel.as_ref()?;
        sentinels.watch.doubt(&sentinels.master)
    }

    /// How many replicas the Sentinels could promote (0 without Sentinel).
    fn promotable(&self) -> u32 {
        self.sentinel.as_ref().map_or(0, |s| s.watch.promotable())
    }

    /// How many times the Sentinels announced a new primary.
    fn switches(&self) -> u64 {
        self.sentinel.as_ref().map_or(0, |s| s.watch.switches())
    }

    /// The same server, speaking `protocol` (push messages need RESP3).
    pub(crate) fn with_protocol(&self, protocol: ProtocolVersion) -> Self {
        let mut target = self.clone();
        target.settings = target.settings.set_protocol(protocol);
        target
    }

    /// A new connection (TLS handshake with the TLS files as they are now), set up and
    /// authenticated, with its driver task running; within [`CONNECT_TIMEOUT`].
    /// With Sentinel, to the primary the Sentinels name, checked with `ROLE`; with Cluster, to
    /// the url's node or else the first seed that answers (any node hears every `PUBLISH`).
    pub(crate) async fn connect(
        &self,
        config: AsyncConnectionConfig,
    ) -> Result<MultiplexedConnection, RedisError> {
        if self.cluster {
            let mut last = None;
            let seeds = self.seeds.iter().map(|(h, p)| (h.as_str(), *p));
            for (host, port) in std::iter::once((self.host.as_str(), self.port)).chain(seeds) {
                match self.dial(host, port, config.clone()).await {
                    Ok(conn) => return Ok(conn),
                    Err(e) => last = Some(e),
                }
            }
            return Err(last.unwrap_or_else(|| no_primary("no cluster node".into())));
        }
        let Some(sentinels) = &self.sentinel else {
            return self.dial(&self.host, self.port, config).await;
        };
        sentinels.follow();
        let (host, port) = sentinels.primary().await?;
        let mut conn = self.dial(&host, port, config).await?;
        let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(&mut conn).await?;
        let role = match role.first() {
            Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
            Some(redis::Value::SimpleString(s)) => s.clone(),
            _ => String::new(),
        };
        if role != "master" {
            // A failover under way: the Sentinels will name the new primary shortly.
            return Err(no_primary(format!(
                "the Sentinels name {host}:{port} as the primary of `{}`, but it is a {role}",
                sentinels.master
            )));
        }
        Ok(conn)
    }

    /// A new connection to `host:port` with this target's settings and TLS.
    async fn dial(
        &self,
        host: &str,
        port: u16,
        config: AsyncConnectionConfig,
    ) -> Result<MultiplexedConnection, RedisError> {
        let connect = async {
            let tcp = tokio::net::TcpStream::connect((host, port)).await?;
            let _ = tcp.set_nodelay(true);
            let keepalive = socket2::TcpKeepalive::new()
                .with_time(KEEPALIVE_IDLE)
                .with_interval(KEEPALIVE_INTERVAL)
                .with_retries(KEEPALIVE_RETRIES);
            let _ = socket2::SockRef::from(&tcp).set_tcp_keepalive(&keepalive);
            match &self.tls {
                Some(tls) => {
                    let stream = tls.connect(host, tcp).await?;
                    self.set_up(stream, config).await
                }
                None => self.set_up(tcp, config).await,
            }
        };
        tokio::time::timeout(CONNECT_TIMEOUT, connect)
            .await
            .unwrap_or_else(|_| {
                Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no connection within {}ms", CONNECT_TIMEOUT.as_millis()),
                )
                .into())
            })
    }

    async fn set_up<S>(
        &self,
        stream: S,
        config: AsyncConnectionConfig,
    ) -> Result<MultiplexedConnection, RedisError>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (conn, driver) =
            MultiplexedConnection::new_with_config(&self.settings, stream, config).await?;
        // Ends when the last handle of the connection is dropped, or the connection breaks.
        tokio::spawn(driver);
        Ok(conn)
    }
}

/// One shared connection, dialled on first use and again after it broke.
pub(crate) struct RedisConn {
    target: RedisTarget,
    /// The connection, its generation (so that a failure drops only the connection it
    /// happened on) and the Sentinels' switch count when it was made (a connection made
    /// before a switch is to a primary that was replaced).
    current: tokio::sync::Mutex<Current>,
    /// Whether each new connection reads the server's replication history
    /// ([`RedisConn::with_history`]).
    track_history: bool,
    /// The newest generation found broken (a command failed on it, or was abandoned before
    /// its answer): the next [`RedisConn::get`] dials anew if that is the current one.
    broken: AtomicU64,
    /// For a lease backend: log one line when connecting or commands start failing (a wrong
    /// CA or password, a missing permission) and one when a command works again (a store's
    /// health latch logs for the store).
    log_as: Option<&'static str>,
    failing: AtomicBool,
    /// How many replicas [`RedisConn::replicated`] waits for, at least.
    replicas: u32,
    /// In a Redis Cluster: how many replicas this primary has that the cluster has not marked
    /// failed (`CLUSTER NODES`, read with the slot map), every one of which could be promoted
    /// in its place.
    promotable: AtomicU32,
    /// The last `WAIT` fell short: in a Redis Cluster, the slot map is asked again (a replica
    /// the cluster has since marked failed is then no longer waited for).
    short: AtomicBool,
}

/// The connection in use, and what is known of it.
#[derive(Default)]
struct Current {
    generation: u64,
    conn: Option<MultiplexedConnection>,
    /// The Sentinels' switch count when it was made.
    switches: u64,
    history: Option<Arc<History>>,
}

/// The replication history of the server a connection reached (`INFO replication`): its
/// `master_replid` changes when a replica is promoted (and when a primary restarts), so a
/// write that records it can tell, later, that the server it wrote on was replaced since.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct History {
    pub replid: String,
    /// The server took over another's history (`master_replid2` set): it was promoted.
    pub promoted: bool,
}

impl History {
    /// From the text of `INFO replication`, if it names a replication id.
    fn parse(info: &str) -> Option<History> {
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
        };
        let replid = field("master_replid")?.to_owned();
        if replid.is_empty() {
            return None;
        }
        let promoted = field("master_replid2").is_some_and(|r| r.bytes().any(|b| b != b'0'));
        Some(History { replid, promoted })
    }
}

/// A write the primary holds but that a failover could lose, so it is not acknowledged.
#[derive(Debug)]
pub(crate) enum Unconfirmed {
    /// Fewer replicas than configured acknowledged it in time.
    Lagging { acked: u32, wanted: u32 },
    /// A Sentinel says a failover may be under way.
    Doubt(String),
}

impl Unconfirmed {
    /// How the caller counts it: no answer in time, or no primary to trust.
    pub(crate) fn failure(&self) -> Failure {
        match self {
            Unconfirmed::Lagging { .. } => Failure::Timeout,
            Unconfirmed::Doubt(_) => Failure::Unreachable,
        }
    }
}

impl std::fmt::Display for Unconfirmed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unconfirmed::Lagging { acked, wanted } => write!(
                f,
                "redis: {acked} of the {wanted} replicas asked for (`replicas`, or every \
                 replica a failover could promote) acknowledged the write within {}ms (WAIT); \
                 it is on the primary, but a failover could lose it",
                WAIT_TIMEOUT.as_millis()
            ),
            Unconfirmed::Doubt(why) => write!(f, "redis: {why}"),
        }
    }
}

impl RedisConn {
    pub(crate) fn new(target: RedisTarget, log_as: Option<&'static str>, replicas: u32) -> Self {
        RedisConn {
            target,
            current: tokio::sync::Mutex::new(Current::default()),
            track_history: false,
            broken: AtomicU64::new(0),
            log_as,
            failing: AtomicBool::new(false),
            replicas,
            promotable: AtomicU32::new(0),
            short: AtomicBool::new(false),
        }
    }

    /// `WAIT` on `conn` after a write sent on it: `Ok(Err(_))` when fewer replicas than
    /// configured acknowledged every write of the connection so far within [`WAIT_TIMEOUT`]
    /// (nothing to wait for when none are configured), or when, once they have, a Sentinel
    /// says a failover may be under way.
    pub(crate) async fn replicated(
        &self,
        conn: &mut MultiplexedConnection,
    ) -> Result<Result<(), Unconfirmed>, RedisError> {
        if self.replicas > 0 {
            // Every replica a failover could promote, and at least the configured number.
            let wanted = self
                .replicas
                .max(self.target.promotable())
                .max(self.promotable.load(Ordering::Acquire));
            let acked: u32 = redis::cmd("WAIT")
                .arg(wanted)
                .arg(u64::try_from(WAIT_TIMEOUT.as_millis()).unwrap_or(u64::MAX))
                .query_async(conn)
                .await?;
            self.short.store(acked < wanted, Ordering::Release);
            if acked < wanted {
                return Ok(Err(Unconfirmed::Lagging { acked, wanted }));
            }
        }
        Ok(match self.target.doubt() {
            Some(why) => Err(Unconfirmed::Doubt(why)),
            None => Ok(()),
        })
    }

    /// Each new connection also reads the server's replication history
    /// ([`RedisConn::get_with_history`]); one `INFO replication` per connection, which the
    /// user then needs the permission for.
    pub(crate) fn with_history(mut self) -> Self {
        self.track_history = true;
        self
    }

    /// The connection, dialled if there is none or it was found broken, and the command
    /// about to run on it: pass that to [`RedisConn::done`] with the command's result.
    pub(crate) async fn get(&self) -> Result<(Command<'_>, MultiplexedConnection), RedisError> {
        let (command, conn, _) = self.get_with_history().await?;
        Ok((command, conn))
    }

    /// [`RedisConn::get`], with the replication history of the server the connection reached
    /// when it was made (`None` unless [`RedisConn::with_history`], or if the server would not
    /// say).
    pub(crate) async fn get_with_history(
        &self,
    ) -> Result<(Command<'_>, MultiplexedConnection, Option<Arc<History>>), RedisError> {
        let mut current = self.current.lock().await;
        // Read before connecting: a switch announced while connecting dials again next time.
        let switches = self.target.switches();
        if let Some(conn) = &current.conn {
            if self.broken.load(Ordering::Relaxed) != current.generation
                && current.switches == switches
            {
                let history = current.history.clone();
                return Ok((self.command(current.generation), conn.clone(), history));
            }
            current.conn = None;
        }
        let config = AsyncConnectionConfig::new().set_response_timeout(Some(RESPONSE_TIMEOUT));
        let connected = match self.target.connect(config).await {
            Ok(mut conn) => match self.history_of(&mut conn).await {
                Ok(history) => Ok((conn, history)),
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        };
        match connected {
            Ok((conn, history)) => {
                current.generation += 1;
                current.conn = Some(conn.clone());
                current.switches = switches;
                current.history = history.clone();
                Ok((self.command(current.generation), conn, history))
            }
            Err(e) => {
                self.failed(&e);
                Err(e)
            }
        }
    }

    /// The replication history of a new connection's server, if tracked: `None` (and one log
    /// line) when the server refuses `INFO` (an ACL without `+info`); an error when the
    /// connection fails.
    async fn history_of(
        &self,
        conn: &mut MultiplexedConnection,
    ) -> Result<Option<Arc<History>>, RedisError> {
        if !self.track_history {
            return Ok(None);
        }
        match redis::cmd("INFO")
            .arg("replication")
            .query_async::<String>(conn)
            .await
        {
            Ok(info) => Ok(History::parse(&info).map(Arc::new)),
            Err(e) if e.kind() == ErrorKind::Server(redis::ServerErrorKind::NoPerm) => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(
                        error = %e,
                        "redis: INFO replication is refused, so a grant cannot tell that the \
                         server was replaced since the last one (grant `+info` to the user)"
                    )
                });
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// One `SCAN` step over the keys matching `pattern`, [`SCAN_BATCH`] asked for: the next
    /// cursor (0 when the scan is done) and the keys.
    pub(crate) async fn scan<K: redis::FromRedisValue>(
        &self,
        cursor: u64,
        pattern: &str,
    ) -> Result<(u64, Vec<K>), RedisError> {
        let (command, mut conn) = self.get().await?;
        let result = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(SCAN_BATCH)
            .query_async(&mut conn)
            .await;
        self.done(command, result).await
    }

    /// For a lease backend, one line when connecting or a command starts failing.
    fn failed(&self, e: &RedisError) {
        if !self.failing.swap(true, Ordering::Relaxed) {
            if let Some(what) = self.log_as {
                tracing::error!(backend = "redis", error = %e, "{what} unavailable");
            }
        }
    }

    fn command(&self, generation: u64) -> Command<'_> {
        Command {
            conn: self,
            generation,
            answered: false,
        }
    }

    /// Passes on the result of `command`; when the connection failed (anything but an error
    /// reply from the server), or the server is no primary any more (`READONLY`: a failover
    /// made it a replica and kept the connection open; `MASTERDOWN`), it is dropped, so the
    /// next call dials a new one (to whatever the url's host is now).
    pub(crate) async fn done<T>(
        &self,
        mut command: Command<'_>,
        result: Result<T, RedisError>,
    ) -> Result<T, RedisError> {
        let failed = result.as_ref().is_err_and(|e| {
            e.is_unrecoverable_error()
                || e.is_timeout()
                || e.is_io_error()
                || e.is_connection_dropped()
                || matches!(e.code(), Some("READONLY" | "MASTERDOWN"))
        });
        command.answered = !failed;
        match &result {
            Err(e) => self.failed(e),
            Ok(_) => {
                if self.failing.swap(false, Ordering::Relaxed) {
                    if let Some(what) = self.log_as {
                        tracing::info!(backend = "redis", "{what} reachable again");
                    }
                }
            }
        }
        result
    }
}

/// What the fence store and the lease backend talk to: one server (the url's, or the primary
/// the Sentinels name), or the primaries of a Redis Cluster, each key sent to the one holding
/// its slot ([`cluster`]).
pub(crate) struct RedisClient {
    target: RedisTarget,
    nodes: Nodes,
}

enum Nodes {
    One(Arc<RedisConn>),
    Cluster(Box<cluster::Cluster>),
}

/// A connection a command runs on, given to the operation of [`RedisClient::call`].
pub(crate) struct Session {
    pub conn: MultiplexedConnection,
    /// The replication history of the server it reached ([`RedisClient::new`]'s `history`).
    pub history: Option<Arc<History>>,
    node: Arc<RedisConn>,
}

impl Session {
    /// [`RedisConn::replicated`] on this connection.
    pub(crate) async fn replicated(&mut self) -> Result<Result<(), Unconfirmed>, RedisError> {
        self.node.replicated(&mut self.conn).await
    }
}

/// Where a `SCAN` over every primary is: which primary, and its cursor.
#[derive(Debug, Default)]
pub(crate) struct ScanCursor {
    node: usize,
    at: u64,
    done: bool,
}

impl ScanCursor {
    pub(crate) fn done(&self) -> bool {
        self.done
    }
}

/// How many redirections (`MOVED`, `ASK`) one command follows.
const MAX_REDIRECTS: usize = 3;

impl RedisClient {
    /// `log_as`: see [`RedisConn`]; `replicas`: what [`Session::replicated`] waits for;
    /// `history`: whether each new connection reads its server's replication history.
    pub(crate) fn new(
        target: RedisTarget,
        log_as: Option<&'static str>,
        replicas: u32,
        history: bool,
    ) -> Self {
        let nodes = if target.cluster {
            Nodes::Cluster(Box::new(cluster::Cluster::new(
                target.clone(),
                log_as,
                replicas,
                history,
            )))
        } else {
            let conn = RedisConn::new(target.clone(), log_as, replicas);
            Nodes::One(Arc::new(if history { conn.with_history() } else { conn }))
        };
        RedisClient { target, nodes }
    }

    pub(crate) fn target(&self) -> &RedisTarget {
        &self.target
    }

    /// Runs `op` on a connection to the primary that holds `key` (the one server, or the
    /// cluster node of its slot), following `MOVED` and `ASK` (a redirected command did not
    /// run, so running it again is safe). A failure that breaks the connection drops it, as
    /// [`RedisConn::done`] says; in a cluster, it also has the slot map asked again.
    pub(crate) async fn call<T, F, Fut>(&self, key: &str, mut op: F) -> Result<T, RedisError>
    where
        F: FnMut(Session) -> Fut,
        Fut: std::future::Future<Output = Result<T, RedisError>>,
    {
        let cluster = match &self.nodes {
            Nodes::One(node) => {
                let result = Self::run(node, &mut op).await;
                return result.map_err(|e| match e.redirect_node() {
                    Some(_) => not_a_cluster(&e),
                    None => e,
                });
            }
            Nodes::Cluster(cluster) => cluster,
        };
        let mut redirects = 0;
        loop {
            let node = cluster.route(key.as_bytes()).await?;
            let (command, conn, history) = node.get_with_history().await.inspect_err(|_| {
                cluster.stale();
            })?;
            let session = Session {
                conn,
                history,
                node: Arc::clone(&node),
            };
            let result = op(session).await;
            let redirect = match &result {
                Err(e) if redirects < MAX_REDIRECTS => e
                    .redirect_node()
                    .map(|(addr, slot)| (e.kind(), addr.to_owned(), slot)),
                _ => None,
            };
            let Some((kind, addr, slot)) = redirect else {
                if result.as_ref().is_err_and(moves_the_map) {
                    cluster.stale();
                }
                return node.done(command, result).await;
            };
            // The node answered: its connection is sound.
            node.done(command, Ok(())).await?;
            redirects += 1;
            let Some((host, port)) = crate::config::parse_seed(&addr) else {
                cluster.stale();
                continue;
            };
            if kind == ErrorKind::Server(redis::ServerErrorKind::Ask) {
                return Self::asking(&cluster.redirected(&host, port), &mut op).await;
            }
            cluster.moved(slot, &host, port);
        }
    }

    /// `op` on `node`'s shared connection.
    async fn run<T, F, Fut>(node: &Arc<RedisConn>, op: &mut F) -> Result<T, RedisError>
    where
        F: FnMut(Session) -> Fut,
        Fut: std::future::Future<Output = Result<T, RedisError>>,
    {
        let (command, conn, history) = node.get_with_history().await?;
        let session = Session {
            conn,
            history,
            node: Arc::clone(node),
        };
        let result = op(session).await;
        node.done(command, result).await
    }

    /// `op` after `ASKING`, on a connection of its own to `node` (so no other command takes
    /// the `ASKING`): a slot being migrated there. Twice at most: a script not yet loaded on
    /// `node` takes the `ASKING` with its first `EVALSHA`.
    async fn asking<T, F, Fut>(node: &Arc<RedisConn>, op: &mut F) -> Result<T, RedisError>
    where
        F: FnMut(Session) -> Fut,
        Fut: std::future::Future<Output = Result<T, RedisError>>,
    {
        let config = AsyncConnectionConfig::new().set_response_timeout(Some(RESPONSE_TIMEOUT));
        let mut conn = node.target.connect(config).await?;
        let history = node.history_of(&mut conn).await?;
        let mut tries = 0;
        loop {
            redis::cmd("ASKING").query_async::<()>(&mut conn).await?;
            let session = Session {
                conn: conn.clone(),
                history: history.clone(),
                node: Arc::clone(node),
            };
            tries += 1;
            match op(session).await {
                Err(e) if tries < 2 && e.redirect_node().is_some() => continue,
                result => return result,
            }
        }
    }

    /// Runs `op` on every primary (the one server, or each primary of the cluster).
    pub(crate) async fn call_each<T, F, Fut>(&self, mut op: F) -> Result<Vec<T>, RedisError>
    where
        F: FnMut(Session) -> Fut,
        Fut: std::future::Future<Output = Result<T, RedisError>>,
    {
        let mut out = Vec::new();
        for node in self.primaries().await? {
            let result = Self::run(&node, &mut op).await;
            if let (Nodes::Cluster(cluster), Err(e)) = (&self.nodes, &result) {
                if moves_the_map(e) {
                    cluster.stale();
                }
            }
            out.push(result?);
        }
        Ok(out)
    }

    async fn primaries(&self) -> Result<Vec<Arc<RedisConn>>, RedisError> {
        match &self.nodes {
            Nodes::One(node) => Ok(vec![Arc::clone(node)]),
            Nodes::Cluster(cluster) => cluster.primaries().await,
        }
    }

    /// One `SCAN` step over the keys matching `pattern` ([`SCAN_BATCH`] asked for), on every
    /// primary in turn; `cursor` starts as `ScanCursor::default()` and is done after the last.
    /// A failover during a scan may make it skip or repeat keys.
    pub(crate) async fn scan<K: redis::FromRedisValue>(
        &self,
        cursor: &mut ScanCursor,
        pattern: &str,
    ) -> Result<Vec<K>, RedisError> {
        let nodes = self.primaries().await?;
        let Some(node) = nodes.get(cursor.node) else {
            cursor.done = true;
            return Ok(Vec::new());
        };
        let (next, keys) = node.scan(cursor.at, pattern).await?;
        if next == 0 {
            cursor.node += 1;
            cursor.at = 0;
            cursor.done = cursor.node >= nodes.len();
        } else {
            cursor.at = next;
        }
        Ok(keys)
    }

    /// For each of `items`, the commands `add` puts in a pipeline, one pipeline per slot of
    /// the item's `key` (a cluster answers a pipeline on one node; every key `add` names for an
    /// item shares that key's hash tag); one reply per item (a tuple of its commands' replies),
    /// in the order of `items`.
    pub(crate) async fn pipelined<I, T: redis::FromRedisValue>(
        &self,
        items: &[I],
        key: impl Fn(&I) -> String,
        add: impl Fn(&mut redis::Pipeline, &I),
    ) -> Result<Vec<T>, RedisError> {
        let keyed: Vec<(usize, String)> = items.iter().map(&key).enumerate().collect();
        let mut replies = Vec::with_capacity(items.len());
        for group in self.by_slot(keyed, |(_, k)| k.as_bytes()) {
            let mut pipe = redis::pipe();
            for (at, _) in &group {
                add(&mut pipe, &items[*at]);
            }
            let pipe = &pipe;
            let answered: Vec<T> = self
                .call(&group[0].1, |mut s| async move {
                    pipe.query_async(&mut s.conn).await
                })
                .await?;
            replies.extend(group.iter().map(|(at, _)| *at).zip(answered));
        }
        replies.sort_by_key(|(at, _)| *at);
        Ok(replies.into_iter().map(|(_, reply)| reply).collect())
    }

    /// `items` in groups that one command may touch together: one group on a single server,
    /// one per slot in a cluster (a script or a pipeline there reaches one node).
    pub(crate) fn by_slot<T>(&self, items: Vec<T>, key: impl Fn(&T) -> &[u8]) -> Vec<Vec<T>> {
        if items.is_empty() {
            return Vec::new();
        }
        if matches!(self.nodes, Nodes::One(_)) {
            return vec![items];
        }
        let mut groups: std::collections::BTreeMap<u16, Vec<T>> = Default::default();
        for item in items {
            groups
                .entry(cluster::slot_of(key(&item)))
                .or_default()
                .push(item);
        }
        groups.into_values().collect()
    }
}

/// A failure after which a cluster's slot map may be out of date.
fn moves_the_map(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_unrecoverable_error()
        || matches!(
            e.code(),
            Some("READONLY" | "MASTERDOWN" | "CLUSTERDOWN" | "TRYAGAIN")
        )
}

/// A `MOVED` or `ASK` from a server fencegate took for a single one.
fn not_a_cluster(e: &RedisError) -> RedisError {
    RedisError::from((
        ErrorKind::Server(redis::ServerErrorKind::Moved),
        "a Redis Cluster node",
        format!(
            "the server redirects to another node ({e}): it is a Redis Cluster node; set \
             `cluster` in the store or lease backend (docs/stores.md#redis-cluster)"
        ),
    ))
}

/// `s` with Redis glob characters escaped, for `SCAN MATCH`.
pub(crate) fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// A command running on the connection of `generation`. Dropped before [`RedisConn::done`]
/// saw its answer (the caller gave up at its own deadline: a probe, a write's store timeout,
/// a lease renewal), the connection is taken as broken: an answer that does not come in time
/// may never come (a peer gone without closing), and the next command dials anew.
pub(crate) struct Command<'a> {
    conn: &'a RedisConn,
    generation: u64,
    answered: bool,
}

impl Drop for Command<'_> {
    fn drop(&mut self) {
        if !self.answered {
            // Generations only grow: the newest broken one is the one that matters.
            self.conn
                .broken
                .fetch_max(self.generation, Ordering::Relaxed);
        }
    }
}

/// How a Redis call failed: timed out (ours, the connect or response timeout), an error reply
/// or a failed `AUTH` (refused), an answer of the wrong type (corrupt), else unreachable.
/// Whether `e` says the connection failed (unreachable, broken, no answer in time), not that
/// the server refused or answered something unreadable: the connection is then dropped.
fn connection_failed(e: &RedisError) -> bool {
    matches!(failure(e), Failure::Unreachable | Failure::Timeout)
}

pub(crate) fn failure(e: &RedisError) -> Failure {
    if e.is_timeout() {
        return Failure::Timeout;
    }
    match e.kind() {
        ErrorKind::Server(_)
        | ErrorKind::Extension
        | ErrorKind::AuthenticationFailed
        | ErrorKind::RESP3NotSupported => Failure::Refused,
        ErrorKind::UnexpectedReturnType => Failure::Corrupt,
        _ => Failure::Unreachable,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_become_targets() {
        let tls = Arc::new(ClientTls::load(&Default::default(), "store.tls", &[]).unwrap());
        let target = RedisTarget::new("rediss://app:pw@redis.internal:6380/2", Some(tls)).unwrap();
        assert_eq!(
            (target.host.as_str(), target.port),
            ("redis.internal", 6380)
        );
        assert_eq!(target.settings.username(), Some("app"));
        assert_eq!(target.settings.password(), Some("pw"));
        assert_eq!(target.settings.db(), 2);
        let plain = RedisTarget::new("redis://127.0.0.1/", None).unwrap();
        let sentinel = plain
            .clone()
            .with_sentinel("mymaster", &["redis://:spw@127.0.0.1:26379"])
            .unwrap();
        let nodes = &sentinel.sentinel.as_ref().unwrap().nodes;
        assert_eq!(
            (nodes[0].port, nodes[0].settings.password()),
            (26379, Some("spw"))
        );
        assert!(plain
            .clone()
            .with_sentinel("mymaster", &["redis://127.0.0.1:26379/1"])
            .is_err());
        assert_eq!(plain.port, 6379);
        assert!(plain.tls.is_none());
        // Never without verification, and never TLS settings on a plaintext url.
        let tls = Arc::new(ClientTls::load(&Default::default(), "store.tls", &[]).unwrap());
        assert!(RedisTarget::new("rediss://127.0.0.1/#insecure", Some(tls.clone())).is_err());
        assert!(RedisTarget::new("redis://127.0.0.1/", Some(tls)).is_err());
        assert!(RedisTarget::new("rediss://127.0.0.1/", None).is_err());
    }

    #[test]
    fn a_replication_history_is_read_from_info() {
        let primary = "# Replication\r\nrole:master\r\nconnected_slaves:0\r\n\
                       master_replid:8c1d5e0a\r\n\
                       master_replid2:0000000000000000000000000000000000000000\r\n";
        assert_eq!(
            History::parse(primary),
            Some(History {
                replid: "8c1d5e0a".into(),
                promoted: false
            })
        );
        let promoted = "role:master\nmaster_replid:77aa\nmaster_replid2:8c1d5e0a\n";
        assert_eq!(
            History::parse(promoted),
            Some(History {
                replid: "77aa".into(),
                promoted: true
            })
        );
        assert_eq!(History::parse("role:master\n"), None);
        assert_eq!(History::parse("master_replid:\n"), None);
    }

    #[test]
    fn failures_are_told_apart() {
        let io = |kind| RedisError::from(std::io::Error::new(kind, "x"));
        assert_eq!(failure(&io(std::io::ErrorKind::TimedOut)), Failure::Timeout);
        assert_eq!(
            failure(&io(std::io::ErrorKind::ConnectionRefused)),
            Failure::Unreachable
        );
        let auth = RedisError::from((ErrorKind::AuthenticationFailed, "WRONGPASS"));
        assert_eq!(failure(&auth), Failure::Refused);
        let wrong = RedisError::from((ErrorKind::UnexpectedReturnType, "not a string"));
        assert_eq!(failure(&wrong), Failure::Corrupt);
    }
}
