//! Idempotency records: what the fence remembers about a write that carried an
//! `Idempotency-Key`, so that a retry is answered from the record of the first attempt
//! instead of being executed again.
//!
//! A record lives per `(resource, key)` for the configured window and is in one of three
//! phases:
//!
//! - `in_flight`: the first attempt was admitted and is with the upstream. A retry gets 409
//!   `idempotency-in-flight`.
//! - `completed`: the upstream answered. A retry with the same fingerprint gets the recorded
//!   response (`Idempotent-Replayed: true`), whatever tokens were admitted since: a replay
//!   reports what happened and executes nothing. A response larger than `max_response` is
//!   recorded without its body ("completed, not replayable").
//! - `unknown`: the upstream failed, timed out, or answered with a retryable status (HTTP,
//!   or gRPC's `grpc-status`: [`grpc_outcome_unknown`]), so the write may or may not have
//!   happened. A retry may execute it again, but only with a token
//!   at least the recorded one (and past the fence as usual): an older epoch cannot redo it.
//!
//! The same key with a different fingerprint (method, normalised path, query, body) is
//! refused with 422 `idempotency-key-reused`, in every phase. The method is the one the
//! upstream acts on: a method override header's when the request has one.
//!
//! [`decide`] is the whole decision, pure; every store runs it (or, for Redis, its Lua
//! transcription) in the same atomic step as the raise of the resource's maximum.

use crate::fence::token::Token;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::config::EqualTokens;
use crate::fence::verdict::{decide as fence, Rule, Verdict};

/// Longest accepted key, in bytes (keys are visible ASCII).
pub const MAX_KEY_BYTES: usize = 255;

/// Why a request's idempotency key header was refused (`400 invalid-idempotency-key`);
/// `name` is the header's name as the refusal spells it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The header came more than once.
    #[error("more than one `{name}` header: send the key once")]
    Repeated {
        /// The header's name.
        name: String,
    },
    /// The key is empty, or longer than [`MAX_KEY_BYTES`].
    #[error("the `{name}` header must be 1 to {MAX_KEY_BYTES} characters, got {length}")]
    Length {
        /// The header's name.
        name: String,
        /// The key's length, in bytes.
        length: usize,
    },
    /// The key holds a byte that is not visible ASCII.
    #[error(
        "the `{name}` header may only contain visible ASCII characters (no spaces or control \
         bytes)"
    )]
    NotVisible {
        /// The header's name.
        name: String,
    },
}

/// SHA-256 of what identifies a request: method (the one a method override header names,
/// when there is one: the method the upstream acts on), normalised path, query and body.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// The fingerprint of a request: `method` (the override's, when the request has one), the
    /// normalised `path`, the `query` (`None`: no `?`) and the whole `body`.
    pub fn of(method: &str, path: &str, query: Option<&str>, body: &[u8]) -> Self {
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        ctx.update(method.as_bytes());
        ctx.update(b"\0");
        ctx.update(path.as_bytes());
        ctx.update(b"\0");
        if let Some(q) = query {
            ctx.update(b"?");
            ctx.update(q.as_bytes());
        }
        ctx.update(b"\0");
        ctx.update(body);
        let mut out = [0u8; 32];
        out.copy_from_slice(ctx.finish().as_ref());
        Fingerprint(out)
    }

    /// The digest as 64 lower-case hex digits, as records keep it.
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Reads the hex that [`Fingerprint::hex`] writes; `None` when `s` does not read as 64 hex
    /// digits.
    pub fn from_hex(s: &str) -> Option<Self> {
        if s.len() != 64 || !s.is_ascii() {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Fingerprint(out))
    }
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fingerprint({})", &self.hex()[..12])
    }
}

/// Names one executed attempt, so that only the attempt that wrote an `in_flight` record
/// writes its outcome: a retry with the same token and body is another attempt.
///
/// The high 64 bits are drawn at random once per process, the low 64 count attempts within
/// it: unique within a process by construction, and across the processes sharing one store
/// unless two of them draw the same 64 random bits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttemptId(pub u128);

impl AttemptId {
    /// A new id, never returned before by this process.
    pub fn next() -> Self {
        static PREFIX: OnceLock<u64> = OnceLock::new();
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let prefix = *PREFIX.get_or_init(|| {
            let mut bytes = [0u8; 8];
            ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
                .expect("the system's random source is readable");
            u64::from_le_bytes(bytes)
        });
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        AttemptId((u128::from(prefix) << 64) | u128::from(n))
    }

    /// The id as 32 lower-case hex digits, as records keep it.
    pub fn hex(&self) -> String {
        format!("{:032x}", self.0)
    }

    /// Reads the hex that [`AttemptId::hex`] writes; `None` unless `s` is 32 hex digits.
    pub fn from_hex(s: &str) -> Option<Self> {
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u128::from_str_radix(s, 16).ok().map(AttemptId)
    }
}

impl std::fmt::Debug for AttemptId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AttemptId({})", self.hex())
    }
}

/// Where a record's write is (`in_flight`, `unknown`, `completed` in the stored record).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The first attempt was admitted and is with the upstream: a retry gets 409
    /// `idempotency-in-flight`.
    InFlight,
    /// The upstream failed, timed out or answered with a retryable status: the write may or
    /// may not have happened, and a retry may execute it again, with a token at least the
    /// recorded one.
    Unknown,
    /// The upstream answered: a retry gets the recorded response.
    Completed,
}

impl Phase {
    /// The one-letter code the Redis script and the PostgreSQL column use.
    pub fn code(self) -> &'static str {
        match self {
            Phase::InFlight => "i",
            Phase::Unknown => "u",
            Phase::Completed => "c",
        }
    }

    /// The phase a [`Phase::code`] names; `None` for any other string.
    pub fn from_code(code: &str) -> Option<Self> {
        match code {
            "i" => Some(Phase::InFlight),
            "u" => Some(Phase::Unknown),
            "c" => Some(Phase::Completed),
            _ => None,
        }
    }
}

/// The upstream's answer as recorded: end-to-end headers in order, the whole body, and the
/// trailers that followed it (gRPC's `grpc-status` travels there), in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The HTTP status code.
    pub status: u16,
    /// The end-to-end header fields, name and value bytes, in order.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The whole body.
    pub body: Bytes,
    /// Empty when the upstream sent none.
    pub trailers: Vec<(String, Vec<u8>)>,
}

/// One `(resource, key)` record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Where the write is: with the upstream, its outcome unknown, or completed.
    pub phase: Phase,
    /// The token of the attempt that wrote this record.
    pub token: Token,
    /// The request that wrote the record; a request with another gets [`Begin::Reused`].
    pub fingerprint: Fingerprint,
    /// `completed` only: the upstream's status, also when the response was too large to keep.
    pub status: Option<u16>,
    /// `completed` only: the response, `None` when it was larger than `max_response`.
    pub response: Option<StoredResponse>,
    /// `in_flight` only: the attempt that claimed the key, the only one whose outcome may
    /// replace the record. `None` in records written before attempts had ids: nobody owns
    /// those, so they stay in flight until their window ends.
    pub attempt: Option<AttemptId>,
}

impl Record {
    /// An `in_flight` record of `token` and `fingerprint` that names no attempt
    /// ([`Claim::in_flight`] is the one an attempt writes).
    pub fn in_flight(token: Token, fingerprint: Fingerprint) -> Self {
        Record {
            phase: Phase::InFlight,
            token,
            fingerprint,
            status: None,
            response: None,
            attempt: None,
        }
    }

    /// An `unknown` record of `token`: its write may or may not have happened.
    pub fn unknown(token: Token, fingerprint: Fingerprint) -> Self {
        Record {
            phase: Phase::Unknown,
            ..Record::in_flight(token, fingerprint)
        }
    }

    /// Whether this is the `in_flight` record `claim`'s attempt wrote: the only record its
    /// outcome may replace.
    pub fn owned_by(&self, claim: &Claim) -> bool {
        self.phase == Phase::InFlight
            && self.attempt == Some(claim.attempt)
            && self.token == claim.token
            && self.fingerprint == claim.fingerprint
    }

    /// Serialised as JSON (bytes in base64), readable by an operator who looks in the store.
    pub fn encode(&self) -> Vec<u8> {
        let wire = Wire {
            phase: self.phase,
            token: self.token,
            fingerprint: self.fingerprint.hex(),
            status: self.status,
            response: self.response.as_ref().map(|r| WireResponse {
                status: r.status,
                headers: encode_fields(&r.headers),
                body: B64.encode(&r.body),
                trailers: encode_fields(&r.trailers),
            }),
            attempt: self.attempt.map(|a| a.hex()),
        };
        serde_json::to_vec(&wire).expect("a record always serialises")
    }

    /// Reads what [`Record::encode`] writes; the error says what is malformed.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        let wire: Wire = serde_json::from_slice(bytes).map_err(|e| format!("bad record: {e}"))?;
        let fingerprint = Fingerprint::from_hex(&wire.fingerprint)
            .ok_or_else(|| "bad record: fingerprint is not 64 hex digits".to_string())?;
        let response = match wire.response {
            None => None,
            Some(r) => {
                let headers = decode_fields(r.headers, "header")?;
                let body = B64
                    .decode(r.body)
                    .map_err(|e| format!("bad record body: {e}"))?;
                let trailers = decode_fields(r.trailers, "trailer")?;
                Some(StoredResponse {
                    status: r.status,
                    headers,
                    body: body.into(),
                    trailers,
                })
            }
        };
        let attempt = match wire.attempt {
            None => None,
            Some(a) => Some(
                AttemptId::from_hex(&a)
                    .ok_or_else(|| "bad record: attempt is not 32 hex digits".to_string())?,
            ),
        };
        Ok(Record {
            phase: wire.phase,
            token: wire.token,
            fingerprint,
            status: wire.status,
            response,
            attempt,
        })
    }
}

/// Header (or trailer) fields as stored: names as they are, values in base64.
fn encode_fields(fields: &[(String, Vec<u8>)]) -> Vec<(String, String)> {
    fields
        .iter()
        .map(|(n, v)| (n.clone(), B64.encode(v)))
        .collect()
}

fn decode_fields(
    fields: Vec<(String, String)>,
    what: &str,
) -> Result<Vec<(String, Vec<u8>)>, String> {
    fields
        .into_iter()
        .map(|(name, value)| {
            let value = B64
                .decode(value)
                .map_err(|e| format!("bad record {what}: {e}"))?;
            Ok((name, value))
        })
        .collect()
}

#[derive(Serialize, Deserialize)]
struct Wire {
    phase: Phase,
    token: Token,
    fingerprint: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    status: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    response: Option<WireResponse>,
    /// Absent in records written before attempts had ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    attempt: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct WireResponse {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
    /// Absent in records written before trailers were kept, and when there were none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    trailers: Vec<(String, String)>,
}

/// What an attempt brings to [`decide`].
#[derive(Debug, Clone, Copy)]
pub struct Claim {
    /// The attempt's fencing token.
    pub token: Token,
    /// The attempt's request.
    pub fingerprint: Fingerprint,
    /// `token.equal` and `token.max_step`, as the fence applies them.
    pub rule: Rule,
    /// How long the record lives (from its last write).
    pub window: Duration,
    /// False when the caller already knows the write may not execute (authoritative mode
    /// found the token superseded): a completed record is still replayed, nothing is claimed.
    pub may_execute: bool,
    /// This attempt, written into the `in_flight` record it claims.
    pub attempt: AttemptId,
}

impl Claim {
    /// The `in_flight` record this attempt writes when it executes.
    pub fn in_flight(&self) -> Record {
        Record {
            attempt: Some(self.attempt),
            ..Record::in_flight(self.token, self.fingerprint)
        }
    }
}

/// The answer to an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Begin {
    /// Claimed: the maximum was raised (as by the fence) and the record is now `in_flight`
    /// with this attempt's token. `previous` is the maximum before.
    Execute {
        /// The maximum before the raise; `None`: there was none.
        previous: Option<Token>,
    },
    /// The fence refused the token; nothing changed.
    Stale {
        /// What the token was refused against: the maximum, or the token of an `unknown`
        /// record when that is higher.
        current: Token,
    },
    /// The token exceeds the maximum (`None`: there is none) by more than `token.max_step`;
    /// nothing changed.
    TooFar {
        /// The maximum; `None`: there is none.
        current: Option<Token>,
    },
    /// An attempt with this key is with the upstream.
    InFlight,
    /// The key was used for a different request.
    Reused,
    /// The key's request completed: replay it (or say why it cannot be).
    Completed(Record),
    /// `may_execute` was false and there is nothing to replay.
    Refused,
}

/// The decision, given the live record (expired ones are absent) and the resource's maximum.
/// When it is [`Begin::Execute`], the store must, in the same atomic step, raise the maximum
/// to `claim.token` (if higher) and write [`Claim::in_flight`].
pub fn decide(existing: Option<&Record>, current: Option<Token>, claim: &Claim) -> Begin {
    let equal = match existing {
        Some(r) if r.fingerprint != claim.fingerprint => return Begin::Reused,
        Some(r) if r.phase == Phase::InFlight => return Begin::InFlight,
        Some(r) if r.phase == Phase::Completed => return Begin::Completed(r.clone()),
        // Unknown outcome: redo only with a token at least the recorded one. The same token
        // is the same attempt again, so it passes even under `equal: reject`.
        Some(r) if claim.token < r.token => {
            return Begin::Stale {
                current: current.unwrap_or(r.token).max(r.token),
            }
        }
        Some(r) if claim.token == r.token => EqualTokens::Allow,
        _ => claim.rule.equal,
    };
    if !claim.may_execute {
        return Begin::Refused;
    }
    let rule = Rule {
        equal,
        ..claim.rule
    };
    match fence(current, claim.token, rule) {
        Verdict::Admitted { previous } => Begin::Execute { previous },
        Verdict::Stale { current } => Begin::Stale { current },
        Verdict::TooFar { current } => Begin::TooFar { current },
    }
}

/// Whether an upstream status leaves the outcome unknown (the write may not have happened and
/// a retry is expected): 408, 425, 429 and every 5xx. Everything else is recorded as
/// completed and replayed.
pub fn outcome_unknown(status: u16) -> bool {
    matches!(status, 408 | 425 | 429) || status >= 500
}

/// Whether a gRPC status (a `grpc-status` value) leaves the outcome unknown: the rule of
/// [`outcome_unknown`], read through the canonical mapping of gRPC codes to HTTP statuses
/// (`google.rpc.Code`).
///
/// Final, recorded and replayed: OK (0, HTTP 200), INVALID_ARGUMENT (3, 400), NOT_FOUND (5,
/// 404), ALREADY_EXISTS (6, 409), PERMISSION_DENIED (7, 403), FAILED_PRECONDITION (9, 400),
/// ABORTED (10, 409), OUT_OF_RANGE (11, 400), UNAUTHENTICATED (16, 401).
///
/// Unknown, the key left free for a retry: UNKNOWN (2, 500), DEADLINE_EXCEEDED (4, 504),
/// RESOURCE_EXHAUSTED (8, 429), UNIMPLEMENTED (12, 501), INTERNAL (13, 500), UNAVAILABLE (14,
/// 503), DATA_LOSS (15, 500); CANCELLED (1), whose HTTP form (499, "client closed request")
/// the HTTP rule does not list, but which says what 408 says: the call was not seen through;
/// and a value that is no code (a client reads it as UNKNOWN).
pub fn grpc_outcome_unknown(grpc_status: &[u8]) -> bool {
    let code = std::str::from_utf8(grpc_status)
        .ok()
        .and_then(|s| s.parse::<u32>().ok());
    !matches!(code, Some(0 | 3 | 5 | 6 | 7 | 9 | 10 | 11 | 16))
}

#[cfg(test)]
mod model;
pub mod recording;
#[cfg(test)]
mod tests;
