//! The `leases:` and `egress:` sections (docs/leases.md): the lease agent's backend, TTL (given or
//! derived from latency budgets), acquisition backoff, drain timeout, and the egress proxy.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

use super::checked;
use super::routes::{uses_captures, Paths, Shape};
use super::store::{check_prefix, default_prefix};
use super::{
    ClientTlsConfig, MethodCfg, PathTemplate, Remote, RemoteKind, ResourceTemplate, SecretUrl,
    UpstreamUrl,
};
use crate::duration::display;
use crate::ttl::{derive, TtlInputs, MAX_LEASE_DURATION, MIN_TTL};

/// The longest `drain_timeout`: room for the default (2 × the longest TTL), so that the
/// effective config `check` prints loads again.
pub const MAX_DRAIN_TIMEOUT: Duration = MAX_LEASE_DURATION.saturating_mul(2);

/// Refuses a TTL written below [`MIN_TTL`] (a derived one is raised to it instead).
fn below_floor(ttl: Duration) -> Result<(), String> {
    if ttl < MIN_TTL {
        return Err(format!(
            "a lease ttl of {} is below the {} floor, under which a lease cannot be renewed \
             reliably: write {} or more",
            display(ttl),
            display(MIN_TTL),
            display(MIN_TTL)
        ));
    }
    Ok(())
}

/// Refuses a TTL above [`MAX_LEASE_DURATION`].
fn at_most_max(ttl: Duration) -> Result<Duration, String> {
    if ttl > MAX_LEASE_DURATION {
        return Err(format!(
            "a lease ttl above {} is not supported (got {})",
            crate::duration::display(MAX_LEASE_DURATION),
            crate::duration::display(ttl)
        ));
    }
    Ok(ttl)
}

/// Where leases are granted, with its defaults filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendConfig {
    /// Leases in a local redb file: for one process, or tests.
    Embedded {
        path: PathBuf,
        /// The redb table's name, checked like the store's.
        prefix: String,
    },
    Redis(Remote),
    Postgres(Remote),
    Etcd(Remote),
}

/// `kind:` as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum BackendKind {
    Embedded,
    Redis,
    Postgres,
    Etcd,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBackend {
    kind: BackendKind,
    url: Option<SecretUrl>,
    path: Option<PathBuf>,
    #[serde(default = "default_prefix")]
    prefix: String,
    tls: Option<ClientTlsConfig>,
}

const DEFAULT_LEASE_PATH: &str = "/var/lib/fencegate/leases.db";

impl TryFrom<RawBackend> for BackendConfig {
    type Error = String;
    fn try_from(raw: RawBackend) -> Result<Self, String> {
        check_prefix(&raw.prefix)?;
        let remote = |kind: RemoteKind, raw: RawBackend| -> Result<Remote, String> {
            let Some(url) = raw.url else {
                return Err("this backend kind needs a `url`".into());
            };
            if raw.path.is_some() {
                return Err("`path` is for the embedded backend".into());
            }
            url.check(kind, raw.tls.as_ref())?;
            Ok(Remote {
                url,
                tls: raw.tls,
                prefix: raw.prefix,
            })
        };
        match raw.kind {
            BackendKind::Embedded if raw.url.is_some() => {
                Err("`url` is for the redis, postgres and etcd backends".into())
            }
            BackendKind::Embedded if raw.tls.is_some() => {
                Err("`tls` is for the redis, postgres and etcd backends".into())
            }
            BackendKind::Embedded => Ok(BackendConfig::Embedded {
                path: raw.path.unwrap_or_else(|| DEFAULT_LEASE_PATH.into()),
                prefix: raw.prefix,
            }),
            BackendKind::Redis => remote(RemoteKind::Redis, raw).map(BackendConfig::Redis),
            BackendKind::Postgres => remote(RemoteKind::Postgres, raw).map(BackendConfig::Postgres),
            BackendKind::Etcd => remote(RemoteKind::Etcd, raw).map(BackendConfig::Etcd),
        }
    }
}

impl<'de> Deserialize<'de> for BackendConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        checked::from_map::<D, RawBackend, BackendConfig>(d)
    }
}

/// Printed as written: `kind` and the fields it uses.
#[derive(Serialize)]
struct PrintedBackend<'a> {
    kind: BackendKind,
    #[serde(skip_serializing_if = "Option::is_none")]
    url: Option<&'a SecretUrl>,
    #[serde(skip_serializing_if = "Option::is_none")]
    path: Option<&'a PathBuf>,
    prefix: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    tls: Option<&'a ClientTlsConfig>,
}

impl<'a> PrintedBackend<'a> {
    fn remote(kind: BackendKind, remote: &'a Remote) -> Self {
        PrintedBackend {
            kind,
            url: Some(&remote.url),
            path: None,
            prefix: &remote.prefix,
            tls: remote.tls.as_ref(),
        }
    }
}

impl Serialize for BackendConfig {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let printed = match self {
            BackendConfig::Embedded { path, prefix } => PrintedBackend {
                kind: BackendKind::Embedded,
                url: None,
                path: Some(path),
                prefix,
                tls: None,
            },
            BackendConfig::Redis(r) => PrintedBackend::remote(BackendKind::Redis, r),
            BackendConfig::Postgres(r) => PrintedBackend::remote(BackendKind::Postgres, r),
            BackendConfig::Etcd(r) => PrintedBackend::remote(BackendKind::Etcd, r),
        };
        printed.serialize(s)
    }
}

impl BackendConfig {
    /// The networked backend's server, if it is one.
    pub fn remote(&self) -> Option<&Remote> {
        match self {
            BackendConfig::Embedded { .. } => None,
            BackendConfig::Redis(remote)
            | BackendConfig::Postgres(remote)
            | BackendConfig::Etcd(remote) => Some(remote),
        }
    }
}

/// The lease TTL: given, or derived from latency budgets (design: TTL = p99 work + p99 RTT +
/// safety margin + drift buffer, rounded up).
#[derive(Debug, Clone)]
pub struct LeaseTtl {
    pub ttl: Duration,
    /// Subtracted from the local validity deadline to absorb clock-rate drift.
    pub drift_buffer: Duration,
    /// The p99 work latency when derived, for the dedup window (TTL + p99 work).
    pub p99_work: Option<Duration>,
    /// The derived minimum; API requests asking for less are refused.
    pub minimum: Duration,
    /// Set when the derived TTL was below [`MIN_TTL`] and raised to it.
    pub warning: Option<String>,
    /// As written, so the effective config printed by `check` loads again.
    source: TtlSource,
}

#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
enum TtlSource {
    Plain(#[serde(with = "crate::duration")] Duration),
    Derived {
        #[serde(with = "crate::duration")]
        p99_work: Duration,
        #[serde(with = "crate::duration")]
        p99_rtt: Duration,
        #[serde(with = "crate::duration")]
        safety_margin: Duration,
        #[serde(with = "crate::duration")]
        drift_buffer: Duration,
        #[serde(with = "crate::duration")]
        round_to: Duration,
        /// As written: a TTL left to the derivation is not printed back, so it keeps
        /// following the inputs.
        #[serde(
            with = "crate::duration::option",
            skip_serializing_if = "Option::is_none"
        )]
        ttl: Option<Duration>,
    },
}

impl Serialize for LeaseTtl {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.source.serialize(s)
    }
}

enum RawTtl {
    Plain(Duration),
    Derived(RawDerivation),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDerivation {
    #[serde(with = "crate::duration")]
    p99_work: Duration,
    #[serde(with = "crate::duration")]
    p99_rtt: Duration,
    #[serde(with = "crate::duration")]
    safety_margin: Duration,
    #[serde(default, with = "crate::duration")]
    drift_buffer: Duration,
    #[serde(default = "default_round_to", with = "crate::duration")]
    round_to: Duration,
    /// An explicit TTL, which must not be below the derived one.
    #[serde(default, with = "crate::duration::option")]
    ttl: Option<Duration>,
}

fn default_round_to() -> Duration {
    Duration::from_millis(500)
}

impl TryFrom<RawTtl> for LeaseTtl {
    type Error = String;
    fn try_from(raw: RawTtl) -> Result<Self, String> {
        match raw {
            RawTtl::Plain(ttl) => {
                below_floor(ttl)?;
                let ttl = at_most_max(ttl)?;
                // Without a derivation, keep a tenth of the TTL (at most 100 ms) for drift.
                let drift_buffer = (ttl / 10).min(Duration::from_millis(100));
                Ok(LeaseTtl {
                    ttl,
                    drift_buffer,
                    p99_work: None,
                    minimum: ttl,
                    warning: None,
                    source: TtlSource::Plain(ttl),
                })
            }
            RawTtl::Derived(d) => {
                let derived = derive(&TtlInputs {
                    p99_work: d.p99_work,
                    p99_rtt: d.p99_rtt,
                    safety_margin: d.safety_margin,
                    drift_buffer: d.drift_buffer,
                    round_to: d.round_to,
                })?;
                let (ttl, warning) = match d.ttl {
                    Some(ttl) => {
                        below_floor(ttl)?;
                        if ttl < derived.ttl {
                            return Err(format!(
                                "ttl {} is below the derived minimum {}",
                                crate::duration::display(ttl),
                                crate::duration::display(derived.ttl)
                            ));
                        }
                        (ttl, None)
                    }
                    None => (derived.ttl, derived.floor_warning()),
                };
                let ttl = at_most_max(ttl)?;
                Ok(LeaseTtl {
                    ttl,
                    drift_buffer: d.drift_buffer,
                    p99_work: Some(d.p99_work),
                    minimum: derived.ttl,
                    warning,
                    source: TtlSource::Derived {
                        p99_work: d.p99_work,
                        p99_rtt: d.p99_rtt,
                        safety_margin: d.safety_margin,
                        drift_buffer: d.drift_buffer,
                        round_to: d.round_to,
                        ttl: d.ttl,
                    },
                })
            }
        }
    }
}

impl<'de> Deserialize<'de> for LeaseTtl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // A visitor, so that errors are raised inside the deserializer and keep their location.
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = LeaseTtl;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(
                    "a duration such as 1500ms, or { p99_work, p99_rtt, safety_margin, \
                     drift_buffer, round_to }",
                )
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<LeaseTtl, E> {
                let ttl = crate::duration::parse(v).map_err(E::custom)?;
                LeaseTtl::try_from(RawTtl::Plain(ttl)).map_err(E::custom)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Err(E::custom(crate::duration::refusal(v)))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Err(E::custom(crate::duration::refusal(v)))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
                Err(E::custom(crate::duration::refusal(v)))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<LeaseTtl, A::Error> {
                let raw =
                    RawDerivation::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                LeaseTtl::try_from(RawTtl::Derived(raw)).map_err(serde::de::Error::custom)
            }
        }
        d.deserialize_any(V)
    }
}

impl LeaseTtl {
    pub fn renew_every(&self) -> Duration {
        self.ttl / 3
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a mapping with `base_delay`, `max_delay` and `jitter`"
)]
pub struct AcquireConfig {
    #[serde(default = "default_base", with = "crate::duration")]
    pub base_delay: Duration,
    #[serde(default = "default_max", with = "crate::duration")]
    pub max_delay: Duration,
    #[serde(default = "default_jitter", with = "crate::duration")]
    pub jitter: Duration,
}

impl Default for AcquireConfig {
    fn default() -> Self {
        AcquireConfig {
            base_delay: default_base(),
            max_delay: default_max(),
            jitter: default_jitter(),
        }
    }
}

fn default_base() -> Duration {
    Duration::from_millis(50)
}
fn default_max() -> Duration {
    Duration::from_secs(2)
}
fn default_jitter() -> Duration {
    Duration::from_millis(100)
}

#[derive(Debug, Clone, Serialize)]
pub struct LeasesConfig {
    /// The local lease API; loopback by default so only the pod's app can use it.
    pub listen: SocketAddr,
    pub backend: BackendConfig,
    pub ttl: LeaseTtl,
    pub acquire: AcquireConfig,
    /// SIGTERM: in-flight work gets this long before leases are released; as written, or
    /// 2 × ttl.
    #[serde(skip)]
    pub drain_timeout: Duration,
    /// `drain_timeout` as written. A default is shown on `check`'s `# leases:` line only, so
    /// that the printed config keeps following the TTL.
    #[serde(
        rename = "drain_timeout",
        serialize_with = "crate::duration::option::serialize",
        skip_serializing_if = "Option::is_none"
    )]
    written_drain_timeout: Option<Duration>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLeases {
    #[serde(
        default = "default_lease_listen",
        deserialize_with = "super::values::address"
    )]
    listen: SocketAddr,
    backend: BackendConfig,
    ttl: LeaseTtl,
    #[serde(default)]
    acquire: AcquireConfig,
    #[serde(default, deserialize_with = "drain_timeout")]
    drain_timeout: Option<Duration>,
}

impl TryFrom<RawLeases> for LeasesConfig {
    type Error = String;
    fn try_from(raw: RawLeases) -> Result<Self, String> {
        Ok(LeasesConfig {
            drain_timeout: raw.drain_timeout.unwrap_or(raw.ttl.ttl.saturating_mul(2)),
            written_drain_timeout: raw.drain_timeout,
            listen: raw.listen,
            backend: raw.backend,
            ttl: raw.ttl,
            acquire: raw.acquire,
        })
    }
}

impl<'de> Deserialize<'de> for LeasesConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        checked::from_map_expecting::<D, RawLeases, LeasesConfig>(
            d,
            "a mapping with `backend` and `ttl`",
        )
    }
}

/// A duration of at most [`MAX_DRAIN_TIMEOUT`], checked inside the deserializer so that the
/// error keeps its location.
fn drain_timeout<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    struct V;
    impl serde::de::Visitor<'_> for V {
        type Value = Option<Duration>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a duration such as 30s")
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            let d = crate::duration::parse(v).map_err(E::custom)?;
            if d > MAX_DRAIN_TIMEOUT {
                return Err(E::custom(format!(
                    "a drain_timeout above {} is not supported (got {v})",
                    crate::duration::display(MAX_DRAIN_TIMEOUT)
                )));
            }
            Ok(Some(d))
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Err(E::custom(crate::duration::refusal(v)))
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
            Err(E::custom(crate::duration::refusal(v)))
        }
        fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
            Err(E::custom(crate::duration::refusal(v)))
        }
    }
    d.deserialize_any(V)
}

fn default_lease_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 7442))
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressRoute {
    pub path: PathTemplate,
    /// The lease (resource) whose token is attached; captures of `path` may be used.
    pub lease: ResourceTemplate,
    /// Methods that get the token; default every method but GET, HEAD, OPTIONS.
    #[serde(
        default,
        deserialize_with = "super::values::methods",
        skip_serializing_if = "Option::is_none"
    )]
    pub methods: Option<Vec<super::MethodCfg>>,
}

impl Shape for EgressRoute {
    fn path(&self) -> &PathTemplate {
        &self.path
    }
    fn methods(&self) -> Option<&[MethodCfg]> {
        self.methods.as_deref()
    }
    fn fences(&self) -> bool {
        true
    }
}

/// `egress.routes`.
pub(super) fn egress_routes<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<EgressRoute>, D::Error> {
    let mut paths = Paths::new("egress.routes");
    checked::from_seq_each(
        d,
        "an egress route: a mapping with `path` and `lease`",
        move |earlier: &[EgressRoute], route: &EgressRoute| {
            uses_captures("lease", &route.lease, &route.path)?;
            paths.add(earlier, route)
        },
    )
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a mapping with `upstream` and `routes`"
)]
pub struct EgressConfig {
    #[serde(
        default = "default_egress_listen",
        deserialize_with = "super::values::address"
    )]
    pub listen: SocketAddr,
    pub upstream: UpstreamUrl,
    #[serde(default, deserialize_with = "egress_routes")]
    pub routes: Vec<EgressRoute>,
}

fn default_egress_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 7443))
}

#[cfg(test)]
mod tests {
    use super::super::Config;

    fn refused(leases: &str) -> String {
        Config::parse(&format!(
            "upstream: http://a:1\nleases:\n  backend: {{ kind: embedded }}\n{leases}"
        ))
        .expect_err("config should be refused")
    }

    #[test]
    fn absurd_durations_are_refused_with_their_location() {
        let e = refused("  ttl: 300000000000years\n");
        assert!(
            e.contains("leases.ttl")
                && e.contains("line 4")
                && e.contains("a lease ttl above 1h is not supported (got 2629800000000000h)"),
            "{e}"
        );
        let e = refused(
            "  ttl: { p99_work: 300000000000years, p99_rtt: 1ms, safety_margin: 300000000000years }\n",
        );
        assert!(
            e.contains("leases.ttl")
                && e.contains("the inputs add up to more than a duration can hold"),
            "{e}"
        );
        let e = refused("  ttl: { p99_work: 2h, p99_rtt: 1ms, safety_margin: 1ms }\n");
        assert!(
            e.contains("leases.ttl") && e.contains("a lease ttl above 1h is not supported"),
            "{e}"
        );
        let e = refused("  ttl: 1s\n  drain_timeout: 300000000000years\n");
        assert!(
            e.contains("leases.drain_timeout")
                && e.contains("line 5")
                && e.contains("a drain_timeout above 2h is not supported (got 300000000000years)"),
            "{e}"
        );
    }

    #[test]
    fn the_longest_durations_load_and_print_back() {
        let c = Config::parse(
            "upstream: http://a:1\nleases:\n  backend: { kind: embedded }\n  ttl: 1h\n",
        )
        .unwrap();
        let leases = c.leases.as_ref().unwrap();
        assert_eq!(leases.drain_timeout, super::MAX_DRAIN_TIMEOUT);
        let c = Config::parse(
            "upstream: http://a:1\nleases:\n  backend: { kind: embedded }\n  ttl: 1h\n  drain_timeout: 2h\n",
        )
        .unwrap();
        let leases = c.leases.unwrap();
        assert_eq!(leases.drain_timeout, super::MAX_DRAIN_TIMEOUT);
        let printed = serde_yaml::to_string(&leases).unwrap();
        assert!(printed.contains("drain_timeout: 2h"), "{printed}");
    }
}
