//! The `timeouts:` and `limits:` sections: bounds on how long any one party may make
//! fencegate wait, and on how much it reads.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

use super::{checked, values};

/// The longest timeout (`timeouts.*`, `barrier_timeout`) a config may set. Every duration
/// that reaches a clock is bounded, so no deadline computed from one can overflow.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
pub(super) const MAX_TIMEOUT_TEXT: &str = "24h";

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

/// Bounds on how much fencegate reads of a request, and on how many connections it serves.
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

/// A `timeouts` or `limits` value out of its range; `name` is the field's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BoundError {
    /// `header_read`, `upstream` or `store` is zero.
    #[error("`{name}` must be greater than zero")]
    ZeroTimeout {
        /// The timeout's field.
        name: &'static str,
    },
    /// A timeout is above [`MAX_TIMEOUT`].
    #[error("`{name}` must be at most {}", MAX_TIMEOUT_TEXT)]
    TimeoutTooLong {
        /// The timeout's field.
        name: &'static str,
    },
    /// `max_header_bytes` is below 8192, hyper's smallest HTTP/1 read buffer.
    #[error("`max_header_bytes` must be at least {}", MIN_HEADER_BYTES)]
    HeaderBytesTooFew,
    /// `max_headers`, `max_connections` or `max_resource_bytes` is 0.
    #[error("`{name}` must be at least 1")]
    ZeroLimit {
        /// The limit's field.
        name: &'static str,
    },
}

/// hyper's HTTP/1 read buffer cannot be smaller.
const MIN_HEADER_BYTES: usize = 8192;

impl TryFrom<RawTimeouts> for Timeouts {
    type Error = BoundError;
    fn try_from(raw: RawTimeouts) -> Result<Self, BoundError> {
        for (name, value) in [
            ("header_read", raw.header_read),
            ("upstream", raw.upstream),
            ("store", raw.store),
        ] {
            if value.is_zero() {
                return Err(BoundError::ZeroTimeout { name });
            }
        }
        for (name, value) in [
            ("header_read", raw.header_read),
            ("upstream", raw.upstream),
            ("shutdown", raw.shutdown),
            ("store", raw.store),
        ] {
            if value > MAX_TIMEOUT {
                return Err(BoundError::TimeoutTooLong { name });
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
    type Error = BoundError;
    fn try_from(raw: RawLimits) -> Result<Self, BoundError> {
        if raw.max_header_bytes < MIN_HEADER_BYTES {
            return Err(BoundError::HeaderBytesTooFew);
        }
        for (name, value) in [
            ("max_headers", raw.max_headers),
            ("max_connections", raw.max_connections),
            ("max_resource_bytes", raw.max_resource_bytes),
        ] {
            if value == 0 {
                return Err(BoundError::ZeroLimit { name });
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
