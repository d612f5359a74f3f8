//! The `idempotency:` section (docs/idempotency.md): how retries of a fenced write are
//! recognised and answered from the first attempt's record.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{values, HeaderNameCfg};

/// `Idempotency-Key` handling on fenced routes (every fenced route, unless a route says
/// `idempotency: false`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a mapping with `header`, `window`, `max_request_bytes` and `max_response_bytes`"
)]
pub struct IdempotencyConfig {
    /// The header carrying the key (`idempotency.header`); default `idempotency-key`. It must
    /// differ from `token.header`.
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
    pub(super) resolved_window: Duration,
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
