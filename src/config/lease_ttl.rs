//! `leases.ttl`: the lease TTL, given or derived from latency budgets (docs/leases.md), with
//! the floor and ceiling every TTL must keep.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

use crate::duration::display;
pub use crate::ttl::DerivationError;
use crate::ttl::{derive, TtlInputs, MAX_LEASE_DURATION, MIN_TTL};

/// A `leases.ttl` that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TtlError {
    /// A TTL written below the 30ms floor.
    #[error(
        "a lease ttl of {} is below the {} floor, under which a lease cannot be renewed \
         reliably: write {} or more",
        display(*ttl),
        display(MIN_TTL),
        display(MIN_TTL)
    )]
    BelowFloor {
        /// The TTL as written.
        ttl: Duration,
    },
    /// A TTL above 1h, the longest lease.
    #[error(
        "a lease ttl above {} is not supported (got {})",
        display(MAX_LEASE_DURATION),
        display(*ttl)
    )]
    AboveMax {
        /// The TTL, as written or derived.
        ttl: Duration,
    },
    /// A `ttl` written beside latency budgets, below the TTL they derive.
    #[error(
        "ttl {} is below the derived minimum {}",
        display(*ttl),
        display(*derived)
    )]
    BelowDerived {
        /// The `ttl` as written.
        ttl: Duration,
        /// The TTL the latency budgets derive.
        derived: Duration,
    },
    /// The latency budgets do not add up to a TTL.
    #[error(transparent)]
    Derivation(#[from] DerivationError),
}

/// Refuses a TTL written below [`MIN_TTL`] (a derived one is raised to it instead).
fn below_floor(ttl: Duration) -> Result<(), TtlError> {
    if ttl < MIN_TTL {
        return Err(TtlError::BelowFloor { ttl });
    }
    Ok(())
}

/// Refuses a TTL above [`MAX_LEASE_DURATION`].
fn at_most_max(ttl: Duration) -> Result<Duration, TtlError> {
    if ttl > MAX_LEASE_DURATION {
        return Err(TtlError::AboveMax { ttl });
    }
    Ok(ttl)
}

/// The lease TTL: given, or derived from latency budgets (design: TTL = p99 work + p99 RTT +
/// safety margin + drift buffer, rounded up).
#[derive(Debug, Clone)]
pub struct LeaseTtl {
    /// The TTL leases are granted for unless a request asks otherwise: as written, else the
    /// derived one; 30ms to 1h.
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
    type Error = TtlError;
    fn try_from(raw: RawTtl) -> Result<Self, TtlError> {
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
                })
                .map_err(TtlError::Derivation)?;
                let (ttl, warning) = match d.ttl {
                    Some(ttl) => {
                        below_floor(ttl)?;
                        if ttl < derived.ttl {
                            return Err(TtlError::BelowDerived {
                                ttl,
                                derived: derived.ttl,
                            });
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
    /// How often a lease of this TTL is renewed: every third of it, before the agent's ±15%
    /// jitter.
    pub fn renew_every(&self) -> Duration {
        self.ttl / 3
    }
}
