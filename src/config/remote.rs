//! A Redis, PostgreSQL or etcd server, as a networked store or lease backend reaches it: its
//! URL (checked against the kind, printed with its password masked), TLS files and prefix.

use std::fmt;

use super::checked::checked_from_str;
use super::ClientTlsConfig;

use serde::Serialize;

pub use crate::conn::url::UrlReadError;

/// A Redis, PostgreSQL or etcd server: a networked store or lease backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Remote {
    /// Printed and logged with its password masked; its scheme fits the kind and says
    /// whether the connection uses TLS ([`SecretUrl::check`]).
    pub url: SecretUrl,
    /// TLS files (docs/stores.md); without them, a TLS URL trusts the public web roots.
    pub tls: Option<ClientTlsConfig>,
    /// Key / table namespace, an identifier ([`check_prefix`]).
    pub prefix: String,
    /// PostgreSQL: how many synchronous standbys must hold a commit before it is
    /// acknowledged, checked against the server's replication settings on every new
    /// connection (`crate::conn::postgres`). `None` (the default) asks for one when the server
    /// streams to any standby, and none for a lone primary.
    pub replicas: Option<u32>,
    /// Redis only: Sentinel discovery and replica acknowledgement (the defaults elsewhere).
    pub redis: RedisHa,
}

/// How a Redis store or lease backend finds its primary, and how many replicas must hold a
/// write before it is acknowledged (docs/stores.md#redis-sentinel).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedisHa {
    /// The Sentinels that say which server is the primary; `None`: the `url` names it.
    pub sentinel: Option<SentinelConfig>,
    /// A Redis Cluster: `url` is one of its nodes; the slot map says which primary holds a key.
    pub cluster: Option<ClusterConfig>,
    /// `WAIT` for this many replicas after each raise, idempotency record and grant; fewer
    /// within [`WAIT_TIMEOUT`] refuse the write (`503`). Default: 1 with `sentinel` or
    /// `cluster`, else 0.
    pub replicas: u32,
}

/// How long a write waits for its replicas (`WAIT`'s timeout): below the Redis connection's
/// 800ms per-command timeout and the default `timeouts.store` of 2s.
pub const WAIT_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(500);

/// At most this many replicas can be asked for (a typo like `replicas: 10` for `1` would
/// refuse every write).
pub const MAX_REPLICAS: u32 = 8;

/// `sentinel:` of a Redis store or lease backend.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SentinelConfig {
    /// The master name the Sentinels monitor (`sentinel monitor <name> …`).
    pub master: String,
    /// The Sentinels, asked in order (the last that answered first): `redis://` or, with the
    /// `tls` mapping, `rediss://`, with the Sentinel's own `user:password@` if it has one.
    pub urls: Vec<SecretUrl>,
}

/// Why a store or lease backend of `kind` cannot be used: this build left it out.
pub(crate) fn not_built(kind: &str) -> String {
    format!(
        "this fencegate was built without the `{kind}` store and lease backend: build it with \
         the Cargo feature `{kind}` (the default builds them all)"
    )
}

/// `cluster:` of a Redis store or lease backend: the `url` names one node of the cluster (with
/// the user, password and TLS every node is reached with), `seeds` more nodes to ask for the
/// slot map while that one is down.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// `host:port` of more nodes, asked in order after the url's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub seeds: Vec<String>,
}

/// A `cluster` mapping that cannot be followed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClusterError {
    /// A seed that is not `host:port`: its index in `cluster.seeds`, and the seed as written.
    #[error("`cluster.seeds[{0}]` is `host:port`, like 10.0.0.2:6379 (it is `{1}`)")]
    Seed(usize, String),
    /// The `url` names a database other than 0.
    #[error(
        "with `cluster`, the `url` names database 0 or none: a Redis Cluster has only database 0"
    )]
    Database,
    /// Both `cluster` and `sentinel`.
    #[error(
        "`sentinel` and `cluster` exclude each other: a Redis Cluster fails over by itself, \
         without Sentinels"
    )]
    WithSentinel,
}

impl ClusterConfig {
    /// Checks the seeds and the url's database.
    fn check(&self, url: &SecretUrl) -> Result<(), ClusterError> {
        for (i, seed) in self.seeds.iter().enumerate() {
            if parse_seed(seed).is_none() {
                return Err(ClusterError::Seed(i, seed.clone()));
            }
        }
        let path = url.expose().split_once("://").map(|(_, r)| r);
        let db = path
            .and_then(|r| r.split_once('/'))
            .map(|(_, db)| db.split('?').next().unwrap_or(""));
        if db.is_some_and(|db| !db.is_empty() && db != "0") {
            return Err(ClusterError::Database);
        }
        Ok(())
    }
}

/// A seed's host and port (`host:port`, `[v6]:port`).
pub(crate) fn parse_seed(seed: &str) -> Option<(String, u16)> {
    let (host, port) = seed.rsplit_once(':')?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let port: u16 = port.parse().ok().filter(|p| *p != 0)?;
    let bad = host.is_empty() || host.contains(['/', '@', ' ', '[', ']']);
    (!bad).then(|| (host.to_owned(), port))
}

/// The `redis://host:port` part of a url: after the scheme and any `user:password@`, up to the
/// path.
pub(crate) fn url_host_port(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let rest = rest.split(['/', '?']).next().unwrap_or(rest);
    rest.rfind('@').map_or(rest, |at| &rest[at + 1..])
}

/// The kinds of [`Remote`], for checking a URL against the kind it was written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteKind {
    /// Redis (`kind: redis`).
    Redis,
    /// PostgreSQL (`kind: postgres`).
    Postgres,
    /// etcd (`kind: etcd`).
    Etcd,
}

impl RemoteKind {
    /// As `kind:` writes it.
    fn name(self) -> &'static str {
        match self {
            RemoteKind::Redis => "redis",
            RemoteKind::Postgres => "postgres",
            RemoteKind::Etcd => "etcd",
        }
    }

    /// A URL of this kind, for messages.
    fn example(self) -> &'static str {
        match self {
            RemoteKind::Redis => "redis://127.0.0.1:6379/",
            RemoteKind::Postgres => "postgres://user:password@127.0.0.1:5432/database",
            RemoteKind::Etcd => "etcd://127.0.0.1:2379",
        }
    }

    /// The scheme that asks for TLS, where the scheme says it.
    fn tls_scheme(self) -> &'static str {
        match self {
            RemoteKind::Redis => "a rediss://",
            RemoteKind::Postgres | RemoteKind::Etcd => "an https://",
        }
    }
}

/// Which mapping holds a store's or lease backend's fields, for messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// The `store` section.
    Store,
    /// `leases.backend`.
    LeaseBackend,
}

impl Holder {
    fn noun(self) -> &'static str {
        match self {
            Holder::Store => "store",
            Holder::LeaseBackend => "backend",
        }
    }
}

/// A `store` or `leases.backend` mapping whose fields do not fit its `kind`.
#[derive(Debug, Clone, thiserror::Error)]
pub enum KindError {
    /// A `url` with the `memory` or `embedded` kind.
    #[error("`url` is for the redis, postgres and etcd {}s", holder.noun())]
    UrlWithoutServer {
        /// The mapping it is in.
        holder: Holder,
    },
    /// A `tls` mapping with the `memory` or `embedded` kind.
    #[error("`tls` is for the redis, postgres and etcd {}s", holder.noun())]
    TlsWithoutServer {
        /// The mapping it is in.
        holder: Holder,
    },
    /// A `path` with a kind other than `embedded`.
    #[error("`path` is for the embedded {}", holder.noun())]
    PathWithServer {
        /// The mapping it is in.
        holder: Holder,
    },
    /// No `url` with the `redis`, `postgres` or `etcd` kind.
    #[error("this {} kind needs a `url`", holder.noun())]
    NoUrl {
        /// The mapping it is missing from.
        holder: Holder,
    },
    /// `replicas` with a kind other than `redis` and `postgres`.
    #[error("`replicas` is for the redis and postgres {}s", holder.noun())]
    ReplicasWithoutReplication {
        /// The mapping it is in.
        holder: Holder,
    },
    /// A `url` that is malformed, or does not fit the kind or `tls`.
    #[error(transparent)]
    Url(#[from] UrlError),
    /// A `prefix` that is not an identifier.
    #[error(transparent)]
    Prefix(#[from] PrefixError),
    /// `sentinel` or `cluster` with a kind other than `redis`.
    #[error("`{field}` is for the redis {}", holder.noun())]
    RedisOnly {
        /// The mapping it is in.
        holder: Holder,
        /// `sentinel` or `cluster`.
        field: &'static str,
    },
    /// A `sentinel` mapping that cannot find a primary.
    #[error(transparent)]
    Sentinel(#[from] SentinelError),
    /// A `cluster` mapping that cannot be followed.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// `replicas`, as written, is above [`MAX_REPLICAS`].
    #[error("`replicas` is at most {MAX_REPLICAS} (it is {0})")]
    TooManyReplicas(u32),
    /// A kind this build left out (Cargo features).
    #[error("{}", not_built(.0))]
    NotBuilt(&'static str),
}

/// A `sentinel` mapping that cannot find a primary.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SentinelError {
    /// `sentinel.master` is empty or holds whitespace.
    #[error("`sentinel.master` is the master name the Sentinels monitor: non-empty, no spaces")]
    BadMaster,
    /// `sentinel.urls` is empty.
    #[error("`sentinel.urls` lists at least one Sentinel, like redis://127.0.0.1:26379")]
    NoSentinels,
    /// A Sentinel's url that is not a Redis url fitting `tls`: its index in `sentinel.urls`,
    /// and why.
    #[error("`sentinel.urls[{0}]`: {1}")]
    Url(usize, UrlError),
    /// A Sentinel's url asks for TLS and the `url` does not, or the other way round: its index
    /// in `sentinel.urls`.
    #[error(
        "`sentinel.urls[{0}]` and `url` differ in scheme: Sentinels and data nodes are reached \
         alike, all over TLS (`rediss://`) or none"
    )]
    SchemeDiffers(usize),
    /// A Sentinel's url names a database: its index in `sentinel.urls`.
    #[error(
        "`sentinel.urls[{0}]` names a database: a Sentinel has none (the data nodes' is in `url`)"
    )]
    SentinelDatabase(usize),
    /// With `sentinel`, a `url` whose host is not the master's name.
    #[error(
        "with `sentinel`, the `url` gives the data nodes' user, password and database, and \
         names the master instead of a server: write `redis://user:password@{master}/0` (its \
         host is `{shown}`, which would never be dialled)"
    )]
    UrlNamesAServer {
        /// `sentinel.master`, as written.
        master: String,
        /// The url's host and port, as written.
        shown: String,
    },
}

impl RedisHa {
    /// `sentinel`, `cluster` and `replicas` as written for a store or backend of `kind`:
    /// refused unless it is Redis; `replicas` defaults to 1 with Sentinel or Cluster (a
    /// failover promotes a replica, and an acknowledged raise must be on it), 0 without (a
    /// lone server has no replica to wait for).
    pub(super) fn from_raw(
        holder: Holder,
        kind: RemoteKind,
        sentinel: Option<SentinelConfig>,
        cluster: Option<ClusterConfig>,
        replicas: Option<u32>,
        url: &SecretUrl,
        tls: Option<&ClientTlsConfig>,
    ) -> Result<Self, KindError> {
        // A typo like `replicas: 10` for `1` would refuse every write, whatever the kind.
        if let Some(n) = replicas.filter(|&n| n > MAX_REPLICAS) {
            return Err(KindError::TooManyReplicas(n));
        }
        if kind != RemoteKind::Redis {
            for (field, set) in [
                ("sentinel", sentinel.is_some()),
                ("cluster", cluster.is_some()),
            ] {
                if set {
                    return Err(KindError::RedisOnly { holder, field });
                }
            }
            // PostgreSQL's `replicas` is `Remote::replicas`, checked against the server.
            if replicas.is_some() && kind != RemoteKind::Postgres {
                return Err(KindError::ReplicasWithoutReplication { holder });
            }
            return Ok(RedisHa::default());
        }
        if let Some(sentinel) = &sentinel {
            sentinel.check(url, tls)?;
        }
        if let Some(cluster) = &cluster {
            if sentinel.is_some() {
                return Err(ClusterError::WithSentinel.into());
            }
            cluster.check(url)?;
        }
        // A failover promotes a replica: by default an acknowledged write is on one.
        let replicas = replicas.unwrap_or(u32::from(sentinel.is_some() || cluster.is_some()));
        Ok(RedisHa {
            sentinel,
            cluster,
            replicas,
        })
    }
}

impl SentinelConfig {
    /// Checks the mapping against the store's `url` and `tls`: every Sentinel is reached like a
    /// data node (TLS exactly when `tls` is given), and the `url` names the master, not a
    /// server, so that no one reads it as the address in use.
    pub(super) fn check(
        &self,
        url: &SecretUrl,
        tls: Option<&ClientTlsConfig>,
    ) -> Result<(), SentinelError> {
        if self.master.is_empty() || self.master.chars().any(char::is_whitespace) {
            return Err(SentinelError::BadMaster);
        }
        if self.urls.is_empty() {
            return Err(SentinelError::NoSentinels);
        }
        for (i, sentinel) in self.urls.iter().enumerate() {
            sentinel
                .check(RemoteKind::Redis, tls)
                .map_err(|e| SentinelError::Url(i, e))?;
            if sentinel.is_tls() != url.is_tls() {
                return Err(SentinelError::SchemeDiffers(i));
            }
            let path = sentinel.expose().split_once("://").map(|(_, r)| r);
            let db = path
                .and_then(|r| r.split_once('/'))
                .map(|(_, db)| db.split('?').next().unwrap_or(""));
            if db.is_some_and(|db| !db.is_empty() && db != "0") {
                return Err(SentinelError::SentinelDatabase(i));
            }
        }
        let shown = url_host_port(url.expose());
        if shown != self.master {
            return Err(SentinelError::UrlNamesAServer {
                master: self.master.clone(),
                shown: shown.to_owned(),
            });
        }
        Ok(())
    }
}

/// A `prefix` that is not an identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`prefix` `{0}` must be 1-40 letters, digits or `_`, not starting with a digit")]
pub struct PrefixError(String);

/// A prefix names PostgreSQL and redb tables and Redis/etcd key prefixes: keep it an identifier.
pub(super) fn check_prefix(prefix: &str) -> Result<(), PrefixError> {
    let identifier = prefix.len() <= 40
        && prefix.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && prefix
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_');
    if identifier {
        Ok(())
    } else {
        Err(PrefixError(prefix.to_owned()))
    }
}

/// A store's or lease backend's `url` that is malformed, or does not fit its kind or `tls`.
#[derive(Debug, Clone, thiserror::Error)]
pub enum UrlError {
    /// An empty url, or one holding whitespace.
    #[error("a store url is non-empty and has no spaces")]
    Malformed,
    /// A url whose scheme is not one of the kind's.
    #[error(
        "the `url` does not fit kind {}: write one like {}",
        kind.name(),
        kind.example()
    )]
    DoesNotFitKind {
        /// The kind the url was written for.
        kind: RemoteKind,
    },
    /// A `tls` mapping with a Redis or etcd url whose scheme is plaintext.
    #[error(
        "`tls` needs {} url (`{url}` would connect in plaintext)",
        kind.tls_scheme()
    )]
    TlsOverPlaintext {
        /// The kind the url was written for.
        kind: RemoteKind,
        /// The url; it displays masked.
        url: SecretUrl,
    },
    /// A `tls` mapping with a PostgreSQL url whose `sslmode` allows plaintext (`disable`,
    /// `allow`, `prefer`).
    #[error(
        "`tls` always requires TLS with a verified certificate; remove `sslmode={mode}` from \
         the url"
    )]
    SslmodeWeakerThanTls {
        /// The `sslmode` as written.
        mode: String,
    },
    /// A PostgreSQL url whose `sslmode` asks for TLS (`require`, `verify-ca`, `verify-full`),
    /// without the `tls` mapping.
    #[error(
        "`sslmode={mode}` needs the `tls` mapping (`tls: {{}}` for the public web roots, or \
         `tls: {{ ca: FILE }}`)"
    )]
    SslmodeWithoutTls {
        /// The `sslmode` as written.
        mode: String,
    },
    /// What the connector would refuse when it reads the url; the reason never shows the
    /// password.
    #[error(transparent)]
    Unreadable(#[from] UrlReadError),
    /// A url of a kind this build left out (Cargo features).
    #[error("{}", not_built(.0))]
    NotBuilt(&'static str),
}

/// A store URL. It may carry a password, so it displays and serialises masked.
#[derive(Clone, PartialEq, Eq, Serialize)]
#[serde(into = "String")]
pub struct SecretUrl(String);

impl SecretUrl {
    /// The URL with its password, for the store client only.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Checks the scheme against the store kind, and against `tls` (TLS is on exactly when
    /// the scheme says so: `rediss://`, `https://`, or a PostgreSQL URL with the `tls`
    /// mapping), so that no config asks for TLS and gets plaintext.
    pub fn check(&self, kind: RemoteKind, tls: Option<&ClientTlsConfig>) -> Result<(), UrlError> {
        let fits = match kind {
            RemoteKind::Redis => self.0.starts_with("redis://") || self.0.starts_with("rediss://"),
            RemoteKind::Postgres => {
                self.0.starts_with("postgres://") || self.0.starts_with("postgresql://")
            }
            RemoteKind::Etcd => {
                self.0.starts_with("etcd://")
                    || self.0.starts_with("http://")
                    || self.0.starts_with("https://")
            }
        };
        if !fits {
            // Not printed: without a scheme it cannot be told where a password would be.
            return Err(UrlError::DoesNotFitKind { kind });
        }
        let plaintext = || UrlError::TlsOverPlaintext {
            kind,
            url: self.clone(),
        };
        match kind {
            RemoteKind::Redis if tls.is_some() && !self.0.starts_with("rediss://") => {
                Err(plaintext())
            }
            RemoteKind::Etcd if tls.is_some() && !self.0.starts_with("https://") => {
                Err(plaintext())
            }
            RemoteKind::Redis | RemoteKind::Etcd => Ok(()),
            RemoteKind::Postgres => match (tls, self.query_param("sslmode")) {
                (Some(_), Some(mode @ ("disable" | "allow" | "prefer"))) => {
                    Err(UrlError::SslmodeWeakerThanTls { mode: mode.into() })
                }
                (None, Some(mode @ ("require" | "verify-ca" | "verify-full"))) => {
                    Err(UrlError::SslmodeWithoutTls { mode: mode.into() })
                }
                _ => Ok(()),
            },
        }?;
        // Read as the connector reads it when `run` starts, so that `check` refuses it too.
        match kind {
            #[cfg(feature = "redis")]
            RemoteKind::Redis => crate::conn::url::redis(&self.0)
                .map(drop)
                .map_err(UrlError::Unreadable),
            #[cfg(feature = "postgres")]
            RemoteKind::Postgres => crate::conn::url::postgres(&self.0, tls.is_some())
                .map(drop)
                .map_err(UrlError::Unreadable),
            #[cfg(feature = "etcd")]
            RemoteKind::Etcd => crate::conn::url::etcd(&self.0)
                .map(drop)
                .map_err(UrlError::Unreadable),
            #[allow(unreachable_patterns)]
            kind => Err(UrlError::NotBuilt(kind.name())),
        }
    }

    /// Whether the URL's scheme asks for TLS (`rediss://`, `https://`).
    pub fn is_tls(&self) -> bool {
        self.0.starts_with("rediss://") || self.0.starts_with("https://")
    }

    /// A query parameter's value, as written.
    fn query_param(&self, name: &str) -> Option<&str> {
        let (_, query) = self.0.split_once('?')?;
        query
            .split('&')
            .filter_map(|pair| pair.split_once('='))
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v)
    }
}

impl TryFrom<String> for SecretUrl {
    type Error = UrlError;
    fn try_from(raw: String) -> Result<Self, Self::Error> {
        if raw.is_empty() || raw.chars().any(char::is_whitespace) {
            return Err(UrlError::Malformed);
        }
        Ok(SecretUrl(raw))
    }
}

impl From<SecretUrl> for String {
    fn from(u: SecretUrl) -> String {
        u.to_string()
    }
}

/// `scheme://user:****@host/...`: the password is never printed or logged (a url without
/// one prints as written, `scheme://user@host/...`).
impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some((scheme, rest)) = self.0.split_once("://") else {
            return f.write_str("****");
        };
        // The userinfo ends at the last `@`, wherever it is: a password may hold `/`, `?` or
        // `#` unencoded (the etcd and PostgreSQL URL readers accept it), and must be masked
        // all the same. An `@` in the query only masks more than it needs to.
        let tail = match rest.rfind('@') {
            Some(at) => {
                // `****` only where a password is: the printed url must load again as it was
                // written (`check` prints a config that loads).
                match rest[..at].split_once(':') {
                    Some((user, _)) => write!(f, "{scheme}://{user}:****@")?,
                    None => write!(f, "{scheme}://{}@", &rest[..at])?,
                }
                &rest[at + 1..]
            }
            None => {
                write!(f, "{scheme}://")?;
                rest
            }
        };
        let (host, query) = match tail.split_once('?') {
            Some((host, query)) => (host, Some(query)),
            None => (tail, None),
        };
        f.write_str(host)?;
        if let Some(query) = query {
            // Query parameters can carry secrets too (`?password=`): mask the likely ones.
            f.write_str("?")?;
            for (i, pair) in query.split('&').enumerate() {
                if i > 0 {
                    f.write_str("&")?;
                }
                let key = pair.split_once('=').map_or(pair, |(k, _)| k);
                let lower = key.to_ascii_lowercase();
                if ["pass", "secret", "token", "key"]
                    .iter()
                    .any(|s| lower.contains(s))
                {
                    write!(f, "{key}=****")?;
                } else {
                    f.write_str(pair)?;
                }
            }
        }
        Ok(())
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

checked_from_str!(SecretUrl);
