//! The YAML configuration (docs/configuration.md), parsed into validated types.
//!
//! Parsing is the validation: unknown fields, bad values and inconsistent routes fail at load
//! with line, column and field path, so an invalid config can never reach the request path.

pub(crate) mod checked;
mod egress;
mod env;
mod error;
mod idempotency;
mod lease_backend;
mod lease_ttl;
mod leases;
mod limits;
mod located;
mod max_step;
mod path;
mod remote;
mod routes;
mod store;
mod store_tls;
mod types;
mod values;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use egress::{EgressConfig, EgressRoute};
pub use env::{expand_env, EnvError};
pub use error::{ConfigError, ParseError, SectionsError};
pub use idempotency::IdempotencyConfig;
pub use lease_backend::BackendConfig;
pub use lease_ttl::{DerivationError, LeaseTtl, TtlError};
pub use leases::{AcquireConfig, LeasesConfig};
pub use limits::{BoundError, Limits, Timeouts, MAX_TIMEOUT};
pub use located::LocatedError;
pub use max_step::{MaxStep, DEFAULT_MAX_STEP};
pub use path::{PathError, PathTemplate};
pub(crate) use remote::not_built;
#[cfg(feature = "redis")]
pub(crate) use remote::parse_seed;
pub use remote::{
    ClusterConfig, ClusterError, Holder, KindError, PrefixError, RedisHa, Remote, RemoteKind,
    SecretUrl, SentinelConfig, SentinelError, UrlError, UrlReadError, MAX_REPLICAS, WAIT_TIMEOUT,
};
pub use routes::{
    MissingToken, Ordering, RouteConfig, RouteError, Unmatched, DEFAULT_BARRIER_TIMEOUT,
};
pub use store::StoreConfig;
pub use store_tls::{ClientTlsConfig, ClientTlsError};
pub use types::{
    HeaderNameCfg, HeaderNameError, MethodCfg, MethodError, ResourcePart, ResourceTemplate,
    ResourceTemplateError, UpstreamUrl, UpstreamUrlError,
};

/// The whole configuration file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a mapping of settings, such as `upstream: http://127.0.0.1:8080`"
)]
pub struct Config {
    /// The fence proxy listener (ingress).
    #[serde(default = "default_listen", deserialize_with = "values::address")]
    pub listen: SocketAddr,
    /// Metrics, probes and the fence inspection API, on their own port so probes answer under load.
    #[serde(default = "default_admin", deserialize_with = "values::address")]
    pub admin: SocketAddr,
    /// The protected service: required by the sidecar ([`Config::parse`]); an in-process fence
    /// ([`Config::parse_fence`]) has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<UpstreamUrl>,
    /// Extra CA bundle (PEM) trusted for an `https` upstream, on top of the public roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_ca: Option<PathBuf>,
    /// Serve `listen` over TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsConfig>,
    /// The token header and what a token is held to (`token`).
    #[serde(default)]
    pub token: TokenConfig,
    /// Where recorded maxima live (`store`); default the embedded store,
    /// `/var/lib/fencegate/fences.db`.
    #[serde(default)]
    pub store: StoreConfig,
    /// What a token is checked against, and how long maxima are kept (`fence`).
    #[serde(default)]
    pub fence: FenceConfig,
    /// Which requests are fenced, and on which resource (`routes`); default none.
    #[serde(default, deserialize_with = "routes::routes")]
    pub routes: Vec<RouteConfig>,
    /// What a request on no route gets (`unmatched`); default `forward`.
    #[serde(default)]
    pub unmatched: Unmatched,
    /// How long the client, the upstream and the store may take, and the drain on shutdown
    /// (`timeouts`).
    #[serde(default)]
    pub timeouts: Timeouts,
    /// Bounds on request heads, resource ids and connections (`limits`).
    #[serde(default)]
    pub limits: Limits,
    /// The lease agent: local lease API and backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leases: Option<LeasesConfig>,
    /// App → fencegate → remote service, with the held lease's token attached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<EgressConfig>,
    /// Idempotency keys on fenced routes: retries answered from the first attempt's record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency: Option<IdempotencyConfig>,
    /// One `INFO` line per request on the `fencegate::access` log target; off by default.
    #[serde(default)]
    pub access_log: bool,
    /// How log lines are written (`log.format`).
    #[serde(default, skip_serializing_if = "LogConfig::is_default")]
    pub log: LogConfig,
}

/// The `log` section.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping with `format` and `query`")]
pub struct LogConfig {
    /// How log lines are written (`log.format`); default `auto`. `--log-format` overrides it.
    #[serde(default)]
    pub format: LogFormat,
    /// How the access log writes a request's query (`log.query`).
    #[serde(default)]
    pub query: LogQuery,
}

/// How the access log writes a request's query: whole, its names with each value masked
/// (`account=…&shard=…`, the default: queries carry ids and secrets), or not at all.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogQuery {
    /// As received (`full`).
    Full,
    /// Each name with its value masked (`names`, the default).
    #[default]
    Names,
    /// Left out (`none`).
    None,
}

impl LogConfig {
    fn is_default(&self) -> bool {
        *self == LogConfig::default()
    }
}

/// How log lines are written: one JSON object per line (for collectors), a readable line
/// (for people), or `auto`: readable when stderr is a terminal, JSON otherwise (a container's
/// stderr never is one, so deployments get JSON).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One JSON object per line (`json`).
    Json,
    /// A readable line (`text`).
    Text,
    /// Readable when stderr is a terminal, JSON otherwise (`auto`, the default).
    #[default]
    Auto,
}

impl LogFormat {
    /// Whether lines are JSON, `auto` resolved against whether stderr is a terminal.
    pub fn json(self) -> bool {
        match self {
            LogFormat::Json => true,
            LogFormat::Text => false,
            LogFormat::Auto => !std::io::IsTerminal::is_terminal(&std::io::stderr()),
        }
    }
}

/// The `tls` section: `listen` served over TLS.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping with `cert` and `key`")]
pub struct TlsConfig {
    /// PEM certificate chain (`tls.cert`).
    pub cert: PathBuf,
    /// PEM private key of `cert` (`tls.key`): PKCS#8, PKCS#1 or SEC1.
    pub key: PathBuf,
    /// When set, clients must present a certificate signed by this CA (mutual TLS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ca: Option<PathBuf>,
}

/// The `token` section: the header a token comes in, and what it is held to besides being at
/// least its resource's recorded maximum.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a mapping with `header`, `equal` and `max_step`"
)]
pub struct TokenConfig {
    /// The header carrying the token (`token.header`); default `fencing-token`.
    #[serde(default = "default_token_header")]
    pub header: HeaderNameCfg,
    /// Whether a token equal to the recorded maximum passes (`token.equal`); default `allow`.
    #[serde(default)]
    pub equal: EqualTokens,
    /// The most a token may exceed its resource's recorded maximum by, in observed fencing
    /// ([`max_step`]): one absurd token would otherwise lock the resource for good.
    #[serde(default)]
    pub max_step: MaxStep,
}

impl Default for TokenConfig {
    fn default() -> Self {
        TokenConfig {
            header: default_token_header(),
            equal: EqualTokens::default(),
            max_step: MaxStep::default(),
        }
    }
}

/// Whether a token equal to the recorded maximum (the same lease epoch writing again) passes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EqualTokens {
    /// It passes (`allow`, the default).
    #[default]
    Allow,
    /// It is refused as stale, as a lower token is (`reject`).
    Reject,
}

/// The `fence` section: what a fenced write's token is checked against, and how long recorded
/// maxima are kept.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a mapping with `authority` and `retention`"
)]
pub struct FenceConfig {
    /// Whether tokens are also checked against the lease backend's latest grant
    /// (`fence.authority`); default `none`.
    #[serde(default)]
    pub authority: Authority,
    /// Forget a resource's maximum once it has not been raised for this long (see
    /// [`check_retention`]); `None`: keep every maximum for good.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::duration::option"
    )]
    pub retention: Option<Duration>,
}

/// The shortest `fence.retention`: far above the delay of the lease backend's grant events
/// (up to about two seconds), which is what the authority's check relies on.
pub const MIN_RETENTION: Duration = Duration::from_secs(3600);

/// Whether forgetting maxima is safe with this config: only when every fenced write's token is
/// also checked against the lease backend's latest grant, which never forgets, when nothing but
/// the recorded maximum refuses a token the lease backend admits (a repeat of the latest
/// grant's token under `token.equal: reject`), and only with a store that can forget.
fn check_retention(
    fence: &FenceConfig,
    token: &TokenConfig,
    store: &StoreConfig,
) -> Result<(), SectionsError> {
    let Some(period) = fence.retention else {
        return Ok(());
    };
    if fence.authority != Authority::Leases {
        return Err(SectionsError::RetentionWithoutAuthority { period });
    }
    if token.equal == EqualTokens::Reject {
        return Err(SectionsError::RetentionWithEqualReject { period });
    }
    if period < MIN_RETENTION {
        return Err(SectionsError::RetentionTooShort { period });
    }
    match store {
        StoreConfig::Embedded { .. } | StoreConfig::Redis { .. } | StoreConfig::Postgres { .. } => {
            Ok(())
        }
        StoreConfig::Memory => Err(SectionsError::RetentionOnMemory),
        StoreConfig::Etcd { .. } => Err(SectionsError::RetentionOnEtcd),
    }
}

/// What a fenced write's token is checked against (`fence.authority`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Authority {
    /// The store's recorded maximum only: observed fencing (`none`, the default).
    #[default]
    None,
    /// Also the latest grant in the lease backend of the `leases` section, which must be
    /// present: authoritative fencing (`leases`).
    Leases,
}

checked::checked_from_str!(Authority);

/// A `fence.authority` that is neither `none` nor `leases`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown authority `{0}`, expected `none` or `leases`")]
pub struct UnknownAuthority(String);

impl TryFrom<String> for Authority {
    type Error = UnknownAuthority;
    fn try_from(raw: String) -> Result<Self, Self::Error> {
        match raw.as_str() {
            "none" => Ok(Authority::None),
            "leases" => Ok(Authority::Leases),
            _ => Err(UnknownAuthority(raw)),
        }
    }
}

impl Config {
    /// Reads and validates the sidecar's configuration file ([`Config::parse`]).
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Self::load_with(path, Config::parse)
    }

    /// Reads and validates an in-process fence's configuration file
    /// ([`Config::parse_fence`]: `upstream` may be left out).
    pub fn load_fence(path: &Path) -> Result<Config, ConfigError> {
        Self::load_with(path, Config::parse_fence)
    }

    fn load_with(
        path: &Path,
        parse: fn(&str) -> Result<Config, ParseError>,
    ) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let invalid = |source| ConfigError::Invalid {
            path: path.to_owned(),
            source,
        };
        let text = expand_env(&text, |name| std::env::var(name).ok())
            .map_err(|e| invalid(ParseError::Env(e)))?;
        parse(&text).map_err(invalid)
    }

    /// Parses the sidecar's configuration text; the error names line, column and field path.
    /// `upstream` is required.
    pub fn parse(text: &str) -> Result<Config, ParseError> {
        let config = Config::parse_fence(text)?;
        if config.upstream.is_none() {
            return Err(SectionsError::NoUpstream.into());
        }
        Ok(config)
    }

    /// Parses the configuration of an in-process fence ([`crate::layer::FenceLayer`]): as
    /// [`Config::parse`], but `upstream`, the sidecar's, may be left out.
    pub fn parse_fence(text: &str) -> Result<Config, ParseError> {
        let mut config = serde_yaml::from_str::<Config>(text)
            .map_err(|e| located::LocatedError::new(e, text))?;
        config.check_sections()?;
        for route in &mut config.routes {
            if route.ordering == Ordering::Serialize {
                route.barrier_timeout = Some(route.barrier_timeout());
            }
        }
        let derived_window = config
            .leases
            .as_ref()
            .map(|l| l.ttl.ttl + l.ttl.p99_work.unwrap_or(l.ttl.ttl));
        if let Some(idempotency) = &mut config.idempotency {
            idempotency.resolved_window = match (idempotency.window, derived_window) {
                (Some(w), _) if w.is_zero() => {
                    return Err(SectionsError::ZeroIdempotencyWindow.into())
                }
                (Some(w), _) if w > MAX_WINDOW => {
                    return Err(SectionsError::IdempotencyWindowTooLong.into())
                }
                (Some(w), _) | (None, Some(w)) => w,
                (None, None) => return Err(SectionsError::NoIdempotencyWindow.into()),
            };
        }
        Ok(config)
    }

    /// Checks across sections (no single value is wrong, so there is no line to point at).
    fn check_sections(&self) -> Result<(), SectionsError> {
        for (route, config) in self.routes.iter().enumerate() {
            if config.barrier_timeout() > MAX_TIMEOUT {
                return Err(SectionsError::BarrierTimeoutTooLong { route });
            }
            if config.idempotency == Some(true) && (self.idempotency.is_none() || !config.fence) {
                return Err(SectionsError::IdempotentRouteWithoutSection { route });
            }
        }
        if let Some(idempotency) = &self.idempotency {
            if idempotency.header.0 == self.token.header.0 {
                return Err(SectionsError::IdempotencyHeaderIsTokenHeader);
            }
            if idempotency.max_request_bytes == 0 {
                return Err(SectionsError::NoIdempotentRequestBytes);
            }
        }
        if self.fence.authority == Authority::Leases && self.leases.is_none() {
            return Err(SectionsError::AuthorityWithoutLeases);
        }
        check_retention(&self.fence, &self.token, &self.store)?;
        if self.egress.is_some() && self.leases.is_none() {
            return Err(SectionsError::EgressWithoutLeases);
        }
        let ports = [
            Some(("listen", self.listen)),
            Some(("admin", self.admin)),
            self.leases.as_ref().map(|l| ("leases.listen", l.listen)),
            self.egress.as_ref().map(|e| ("egress.listen", e.listen)),
        ];
        let ports: Vec<_> = ports.into_iter().flatten().collect();
        for (i, (a, addr)) in ports.iter().enumerate() {
            if addr.port() == 0 {
                continue;
            }
            if let Some((b, _)) = ports[..i].iter().find(|(_, other)| other == addr) {
                return Err(SectionsError::SharedAddress {
                    first: a,
                    second: b,
                    address: *addr,
                });
            }
        }
        Ok(())
    }

    /// What is valid but probably not what was meant, one sentence each, with its field path.
    pub fn warnings(&self) -> Vec<String> {
        let ttl = self.leases.as_ref().and_then(|l| l.ttl.warning.as_ref());
        ttl.map(|w| format!("leases.ttl: {w}"))
            .into_iter()
            .collect()
    }

    /// The effective configuration, defaults filled in, as YAML.
    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(self).unwrap_or_else(|e| format!("# cannot render: {e}\n"))
    }
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 7440))
}

fn default_admin() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 7441))
}

fn default_token_header() -> HeaderNameCfg {
    HeaderNameCfg(http::header::HeaderName::from_static("fencing-token"))
}

/// The longest idempotency window.
pub const MAX_WINDOW: Duration = Duration::from_secs(30 * 24 * 3600);

#[cfg(test)]
mod tests;
