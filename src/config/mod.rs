//! The YAML configuration (docs/configuration.md), parsed into validated types.
//!
//! Parsing is the validation: unknown fields, bad values and inconsistent routes fail at load
//! with line, column and field path, so an invalid config can never reach the request path.

pub(crate) mod checked;
mod leases;
mod routes;
mod store;
mod store_tls;
mod types;
mod values;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

pub use leases::{AcquireConfig, BackendConfig, EgressConfig, EgressRoute, LeaseTtl, LeasesConfig};
pub use store::{Remote, RemoteKind, StoreConfig};
pub use store_tls::ClientTlsConfig;
pub use types::{
    HeaderNameCfg, MethodCfg, PathTemplate, ResourcePart, ResourceTemplate, SecretUrl, UpstreamUrl,
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
    /// The protected service.
    pub upstream: UpstreamUrl,
    /// Extra CA bundle (PEM) trusted for an `https` upstream, on top of the public roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_ca: Option<PathBuf>,
    /// Serve `listen` over TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsConfig>,
    #[serde(default)]
    pub token: TokenConfig,
    #[serde(default)]
    pub store: StoreConfig,
    #[serde(default)]
    pub fence: FenceConfig,
    #[serde(default, deserialize_with = "routes::routes")]
    pub routes: Vec<RouteConfig>,
    #[serde(default)]
    pub unmatched: Unmatched,
    #[serde(default)]
    pub timeouts: Timeouts,
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
}

/// `Idempotency-Key` handling on fenced routes (every fenced route, unless a route says
/// `idempotency: false`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a mapping with `header`, `window`, `max_request_bytes` and `max_response_bytes`"
)]
pub struct IdempotencyConfig {
    #[serde(default = "default_idempotency_header")]
    pub header: HeaderNameCfg,
    /// How long a key's record lives after its last write, as written. Default: `leases.ttl`
    /// plus its `p99_work` (2 × ttl when the TTL is given as a plain duration); required
    /// without leases. A default is not printed back by `check`, so that it keeps following
    /// the TTL.
    #[serde(
        default,
        with = "crate::duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub window: Option<Duration>,
    /// The window in effect: `window`, or the default; resolved when the config is parsed.
    #[serde(skip)]
    resolved_window: Duration,
    /// Largest request body an idempotent write may have (it is read whole to fingerprint it);
    /// larger gets 413.
    #[serde(
        default = "default_max_idempotent_body",
        deserialize_with = "values::Bytes::<1048576>::de"
    )]
    pub max_request_bytes: usize,
    /// Largest response recorded for replay; a larger one is recorded as "completed, not
    /// replayable" and its retries get 409 `idempotency-not-replayable`.
    #[serde(
        default = "default_max_idempotent_body",
        deserialize_with = "values::Bytes::<1048576>::de"
    )]
    pub max_response_bytes: usize,
}

impl IdempotencyConfig {
    /// The window in effect (as written, or the default).
    pub fn window(&self) -> Duration {
        self.resolved_window
    }
}

fn default_idempotency_header() -> HeaderNameCfg {
    HeaderNameCfg(http::header::HeaderName::from_static("idempotency-key"))
}

fn default_max_idempotent_body() -> usize {
    1024 * 1024
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping with `cert` and `key`")]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// When set, clients must present a certificate signed by this CA (mutual TLS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ca: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping with `header` and `equal`")]
pub struct TokenConfig {
    #[serde(default = "default_token_header")]
    pub header: HeaderNameCfg,
    #[serde(default)]
    pub equal: EqualTokens,
}

impl Default for TokenConfig {
    fn default() -> Self {
        TokenConfig {
            header: default_token_header(),
            equal: EqualTokens::default(),
        }
    }
}

/// Whether a token equal to the recorded maximum (the same lease epoch writing again) passes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EqualTokens {
    #[default]
    Allow,
    Reject,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping with `authority`")]
pub struct FenceConfig {
    #[serde(default)]
    pub authority: Authority,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Authority {
    #[default]
    None,
    Leases,
}

checked::checked_from_str!(Authority);

impl TryFrom<String> for Authority {
    type Error = String;
    fn try_from(raw: String) -> Result<Self, Self::Error> {
        match raw.as_str() {
            "none" => Ok(Authority::None),
            "leases" => Ok(Authority::Leases),
            other => Err(format!(
                "unknown authority `{other}`, expected `none` or `leases`"
            )),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub name: String,
    pub path: PathTemplate,
    /// Fenced methods; `None` means every method except GET, HEAD and OPTIONS.
    #[serde(
        default,
        deserialize_with = "values::methods",
        skip_serializing_if = "Option::is_none"
    )]
    pub methods: Option<Vec<MethodCfg>>,
    /// Resource id template; `None` means the normalised request path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<ResourceTemplate>,
    #[serde(default)]
    pub missing_token: MissingToken,
    #[serde(default)]
    pub ordering: Ordering,
    #[serde(default = "default_barrier_timeout", with = "crate::duration")]
    pub barrier_timeout: Duration,
    #[serde(default = "default_true", deserialize_with = "values::flag")]
    pub fence: bool,
    /// `false`: no idempotency keys on this route even though the `idempotency` section is
    /// there; `true`: requires that section. Absent: follow the section.
    #[serde(
        default,
        deserialize_with = "values::optional_flag",
        skip_serializing_if = "Option::is_none"
    )]
    pub idempotency: Option<bool>,
}

impl RouteConfig {
    /// Whether idempotency keys apply to this route under `section`.
    pub fn idempotent(&self, section: Option<&IdempotencyConfig>) -> bool {
        self.fence && section.is_some() && self.idempotency != Some(false)
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MissingToken {
    #[default]
    Reject,
    Allow,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Ordering {
    #[default]
    None,
    Serialize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Unmatched {
    #[default]
    Forward,
    Reject,
}

/// Bounds on how long any one party may make fencegate wait.
#[derive(Debug, Clone, Serialize)]
pub struct Timeouts {
    /// A client must send its complete request head within this (slowloris guard).
    #[serde(with = "crate::duration")]
    pub header_read: Duration,
    /// The upstream must answer with response headers within this, else 504.
    #[serde(with = "crate::duration")]
    pub upstream: Duration,
    /// On SIGTERM, in-flight requests get this long to finish before the process exits.
    #[serde(with = "crate::duration")]
    pub shutdown: Duration,
    /// A fenced write waits at most this long for the store's answer, else 503.
    #[serde(with = "crate::duration")]
    pub store: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            header_read: Duration::from_secs(10),
            upstream: Duration::from_secs(30),
            shutdown: Duration::from_secs(10),
            store: Duration::from_secs(2),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Limits {
    /// Largest request head accepted (HTTP/1 buffer, HTTP/2 header list); larger gets 431.
    pub max_header_bytes: usize,
    /// Most header fields in one HTTP/1 request head.
    pub max_headers: usize,
    /// Concurrent client connections; further connections wait in the accept queue.
    pub max_connections: usize,
    /// Longest resource id, in bytes; longer gets 400.
    pub max_resource_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_header_bytes: 16 * 1024,
            max_headers: 100,
            max_connections: 10_000,
            max_resource_bytes: 512,
        }
    }
}

// The same fields, unchecked: parsed first, then checked inside the deserializer (so errors
// keep their location) by the `TryFrom`s below.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawTimeouts {
    #[serde(with = "crate::duration")]
    header_read: Duration,
    #[serde(with = "crate::duration")]
    upstream: Duration,
    #[serde(with = "crate::duration")]
    shutdown: Duration,
    #[serde(with = "crate::duration")]
    store: Duration,
}

impl Default for RawTimeouts {
    fn default() -> Self {
        let t = Timeouts::default();
        RawTimeouts {
            header_read: t.header_read,
            upstream: t.upstream,
            shutdown: t.shutdown,
            store: t.store,
        }
    }
}

impl<'de> Deserialize<'de> for Timeouts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        checked::from_map::<D, RawTimeouts, Timeouts>(d)
    }
}

impl<'de> Deserialize<'de> for Limits {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        checked::from_map::<D, RawLimits, Limits>(d)
    }
}

impl TryFrom<RawTimeouts> for Timeouts {
    type Error = String;
    fn try_from(raw: RawTimeouts) -> Result<Self, String> {
        for (name, value) in [
            ("header_read", raw.header_read),
            ("upstream", raw.upstream),
            ("store", raw.store),
        ] {
            if value.is_zero() {
                return Err(format!("`{name}` must be greater than zero"));
            }
        }
        for (name, value) in [
            ("header_read", raw.header_read),
            ("upstream", raw.upstream),
            ("shutdown", raw.shutdown),
            ("store", raw.store),
        ] {
            if value > MAX_TIMEOUT {
                return Err(format!("`{name}` must be at most {MAX_TIMEOUT_TEXT}"));
            }
        }
        Ok(Timeouts {
            header_read: raw.header_read,
            upstream: raw.upstream,
            shutdown: raw.shutdown,
            store: raw.store,
        })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawLimits {
    #[serde(deserialize_with = "values::Bytes::<16384>::de")]
    max_header_bytes: usize,
    #[serde(deserialize_with = "values::Count::<100>::de")]
    max_headers: usize,
    #[serde(deserialize_with = "values::Count::<10000>::de")]
    max_connections: usize,
    #[serde(deserialize_with = "values::Bytes::<512>::de")]
    max_resource_bytes: usize,
}

impl Default for RawLimits {
    fn default() -> Self {
        let l = Limits::default();
        RawLimits {
            max_header_bytes: l.max_header_bytes,
            max_headers: l.max_headers,
            max_connections: l.max_connections,
            max_resource_bytes: l.max_resource_bytes,
        }
    }
}

impl TryFrom<RawLimits> for Limits {
    type Error = String;
    fn try_from(raw: RawLimits) -> Result<Self, String> {
        if raw.max_header_bytes < 8192 {
            // hyper's HTTP/1 read buffer cannot be smaller.
            return Err("`max_header_bytes` must be at least 8192".into());
        }
        for (name, value) in [
            ("max_headers", raw.max_headers),
            ("max_connections", raw.max_connections),
            ("max_resource_bytes", raw.max_resource_bytes),
        ] {
            if value == 0 {
                return Err(format!("`{name}` must be at least 1"));
            }
        }
        Ok(Limits {
            max_header_bytes: raw.max_header_bytes,
            max_headers: raw.max_headers,
            max_connections: raw.max_connections,
            max_resource_bytes: raw.max_resource_bytes,
        })
    }
}

/// A configuration error, displayed with its location when it has one.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

impl Config {
    /// Reads and validates a configuration file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let invalid = |message| ConfigError::Invalid {
            path: path.to_owned(),
            message,
        };
        let text = expand_env(&text, |name| std::env::var(name).ok()).map_err(invalid)?;
        Config::parse(&text).map_err(invalid)
    }

    /// Parses configuration text; the error names line, column and field path.
    pub fn parse(text: &str) -> Result<Config, String> {
        let mut config = serde_yaml::from_str::<Config>(text).map_err(|e| e.to_string())?;
        config.check_sections()?;
        let derived_window = config
            .leases
            .as_ref()
            .map(|l| l.ttl.ttl + l.ttl.p99_work.unwrap_or(l.ttl.ttl));
        if let Some(idempotency) = &mut config.idempotency {
            idempotency.resolved_window = match (idempotency.window, derived_window) {
                (Some(w), _) if w.is_zero() => {
                    return Err("idempotency.window must be greater than zero".into())
                }
                (Some(w), _) if w > MAX_WINDOW => {
                    return Err(format!(
                        "idempotency.window must be at most {MAX_WINDOW_TEXT}"
                    ))
                }
                (Some(w), _) | (None, Some(w)) => w,
                (None, None) => {
                    return Err(
                        "idempotency.window is required when no `leases` section gives \
                         a TTL to derive it from (ttl + p99_work)"
                            .into(),
                    )
                }
            };
        }
        Ok(config)
    }

    /// Checks across sections (no single value is wrong, so there is no line to point at).
    fn check_sections(&self) -> Result<(), String> {
        for (i, route) in self.routes.iter().enumerate() {
            if route.barrier_timeout > MAX_TIMEOUT {
                return Err(format!(
                    "routes[{i}].barrier_timeout must be at most {MAX_TIMEOUT_TEXT}"
                ));
            }
            if route.idempotency == Some(true) && (self.idempotency.is_none() || !route.fence) {
                return Err(format!(
                    "routes[{i}].idempotency: true needs the top-level `idempotency` section \
                     and a fenced route (`fence: true`)"
                ));
            }
        }
        if let Some(idempotency) = &self.idempotency {
            if idempotency.header.0 == self.token.header.0 {
                return Err("idempotency.header and token.header must differ".into());
            }
            if idempotency.max_request_bytes == 0 {
                return Err("idempotency.max_request_bytes must be greater than zero".into());
            }
        }
        if self.fence.authority == Authority::Leases && self.leases.is_none() {
            return Err(
                "fence.authority: leases checks tokens against the lease backend configured \
                 in the `leases` section, which is missing"
                    .into(),
            );
        }
        if self.egress.is_some() && self.leases.is_none() {
            return Err("egress: attaching tokens needs the `leases` section".into());
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
                return Err(format!("`{a}` and `{b}` are both {addr}"));
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

/// Replaces `${NAME}` and `${NAME:-default}` in a config file with environment values, so a
/// Kubernetes sidecar can take its upstream port from an annotation and its store password
/// from a Secret. An unset variable without a default is an error naming its line.
pub fn expand_env(text: &str, lookup: impl Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let line = text.len() - rest.len() + start;
        let line = text[..line].matches('\n').count() + 1;
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| format!("line {line}: `${{` without a closing `}}`"))?;
        let (name, default) = match after[..end].split_once(":-") {
            Some((name, default)) => (name, Some(default)),
            None => (&after[..end], None),
        };
        let valid = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
        if !valid {
            return Err(format!(
                "line {line}: `${{{name}}}`: environment variable names are A-Z, 0-9 and _"
            ));
        }
        match (lookup(name), default) {
            (Some(value), _) => out.push_str(&value),
            (None, Some(default)) => out.push_str(default),
            (None, None) => {
                return Err(format!(
                    "line {line}: environment variable {name} is not set (write ${{{name}:-default}} for a default)"
                ))
            }
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
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

/// The longest timeout (`timeouts.*`, `barrier_timeout`) a config may set. Every duration
/// that reaches a clock is bounded, so no deadline computed from one can overflow.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
const MAX_TIMEOUT_TEXT: &str = "24h";
/// The longest idempotency window.
pub const MAX_WINDOW: Duration = Duration::from_secs(30 * 24 * 3600);
const MAX_WINDOW_TEXT: &str = "30days";

fn default_barrier_timeout() -> Duration {
    Duration::from_secs(5)
}

fn default_true() -> bool {
    true
}

#[cfg(test)]
mod tests;
