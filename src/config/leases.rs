//! The `leases:` section (docs/leases.md): the lease agent's listener, backend
//! ([`super::lease_backend`]), TTL ([`super::lease_ttl`]), acquisition backoff and drain
//! timeout.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

use super::checked;
use super::{BackendConfig, LeaseTtl};
use crate::ttl::MAX_LEASE_DURATION;

/// The longest `drain_timeout`: room for the default (2 × the longest TTL), so that the
/// effective config `check` prints loads again.
pub const MAX_DRAIN_TIMEOUT: Duration = MAX_LEASE_DURATION.saturating_mul(2);

/// `leases.acquire`: how an acquisition asked to `wait` retries while the lease is held
/// elsewhere or the backend fails: after `min(max_delay, base_delay × 2^attempt + a random
/// 0 to jitter)`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a mapping with `base_delay`, `max_delay` and `jitter`"
)]
pub struct AcquireConfig {
    /// The first retry's delay, doubled at each retry after it (`leases.acquire.base_delay`);
    /// default 50ms.
    #[serde(default = "default_base", with = "crate::duration")]
    pub base_delay: Duration,
    /// The longest delay between two attempts (`leases.acquire.max_delay`); default 2s.
    #[serde(default = "default_max", with = "crate::duration")]
    pub max_delay: Duration,
    /// The most random delay added before the cap (`leases.acquire.jitter`); default 100ms.
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

/// The `leases` section: the lease agent's local API, its backend, the lease TTL, how
/// acquisitions retry, and how long in-flight work gets on shutdown.
#[derive(Debug, Clone, Serialize)]
pub struct LeasesConfig {
    /// The local lease API; loopback by default so only the pod's app can use it.
    pub listen: SocketAddr,
    /// Where leases are granted (`leases.backend`); required.
    pub backend: BackendConfig,
    /// The lease TTL, written or derived from latency budgets (`leases.ttl`); required.
    pub ttl: LeaseTtl,
    /// How an acquisition retries (`leases.acquire`).
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

impl From<RawLeases> for LeasesConfig {
    fn from(raw: RawLeases) -> Self {
        LeasesConfig {
            drain_timeout: raw.drain_timeout.unwrap_or(raw.ttl.ttl.saturating_mul(2)),
            written_drain_timeout: raw.drain_timeout,
            listen: raw.listen,
            backend: raw.backend,
            ttl: raw.ttl,
            acquire: raw.acquire,
        }
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
