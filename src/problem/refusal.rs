//! Refusals: every reason fencegate answers instead of the upstream (or, in-process, the
//! inner service). Each kind is declared once in [`KINDS`]'s table: its status, problem type
//! and title (RFC 9457 problem+json, docs/requests.md), gRPC status, metric outcome, whose
//! fault it is and whether it says `Retry-After`. [`Refusal::kind`] is the one match that
//! picks a refusal's row; the detail sentence and the members after it are the refusal's own.
//! The body is a [`crate::problem::Problem`], as the lease API's and the admin listener's are;
//! it is rendered once, as problem+json, and in gRPC form for gRPC calls
//! ([`super::grpc::Answered`]).

use crate::fence::token::Token;
use std::time::Duration;

use http::header::{HeaderName, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};

use super::grpc::{self, Code};
use super::Problem;
use crate::body::ProxyBody;
use crate::fault::Fault;
use crate::fence::path::PathError;
use crate::fence::routes::ResourceError;
pub(crate) use crate::fence::routes::Subject;
use crate::fence::token::TokenError;
use crate::idempotency::KeyError;
use crate::lease::LeaseError;
use crate::metrics::Outcome;
use crate::store::StoreError;

/// Header carrying the recorded maximum on a stale (or too far) refusal.
pub const TOKEN_CURRENT: &str = "fencing-token-current";

/// Why a request was not forwarded, or why forwarding failed. Grouped by whose fault it is.
#[derive(Debug)]
pub enum Refusal {
    // The client's fault: fix the request.
    InvalidToken(TokenError),
    InvalidPath(PathError),
    InvalidResource(ResourceError),
    TokenRequired,
    Stale {
        current: Token,
    },
    /// Authoritative mode: a newer lease was granted (whether or not its holder wrote yet).
    Superseded {
        latest: Token,
    },
    /// Authoritative mode: a token no lease grant has issued (yet).
    Unissued {
        latest: Option<Token>,
    },
    /// Observed mode: the token exceeds the recorded maximum (`None`: there is none, counted
    /// as 0) by more than `token.max_step`; admitting it would make every later token stale.
    TooFar {
        current: Option<Token>,
        max_step: u64,
    },
    NoRoute,
    /// Idempotency: malformed or duplicate key header.
    InvalidIdempotencyKey(KeyError),
    /// Idempotency: the body is read whole to fingerprint it, up to this many bytes.
    RequestTooLarge {
        limit: usize,
    },
    InvalidRequest(String),
    /// Idempotency: the key's first attempt is still with the upstream.
    IdempotencyInFlight,
    /// Idempotency: the key was first used for a different request.
    IdempotencyKeyReused,
    /// Idempotency: the key's request completed with a response too large to keep.
    NotReplayable {
        status: Option<u16>,
    },
    // Ours (or our store's): retry later.
    StoreUnavailable(Unavailable),
    BarrierTimeout,
    /// Egress: no locally valid lease for the write's resource.
    LeaseNotHeld,
    // The upstream's.
    UpstreamError(String),
    /// No response head within `timeouts.upstream` (this long).
    UpstreamTimeout(Duration),
}

/// Why the store of record (the fence store, or with `fence.authority: leases` the lease
/// backend) did not answer a fenced write.
#[derive(Debug)]
pub enum Unavailable {
    /// The fence store failed, or did not answer within `timeouts.store`.
    Store(StoreError),
    /// The lease backend failed.
    Leases(LeaseError),
    /// The lease backend did not answer within `timeouts.store` (this long).
    LeasesSilent(Duration),
}

impl Unavailable {
    pub fn fault(&self) -> Fault {
        match self {
            Unavailable::Store(e) => e.fault(),
            Unavailable::Leases(e) => e.fault(),
            Unavailable::LeasesSilent(_) => Fault::Store,
        }
    }

    /// What happened, by the error's variant (`timeout`, `unreachable`, `refused`, …).
    pub fn label(&self) -> &'static str {
        match self {
            Unavailable::Store(e) => e.label(),
            Unavailable::Leases(e) => e.label(),
            Unavailable::LeasesSilent(_) => "timeout",
        }
    }

    /// The end of the refusal's detail: the store's own words, the lease backend's error.
    fn detail(&self) -> String {
        match self {
            Unavailable::Store(e) => e.detail().to_owned(),
            Unavailable::Leases(e) => e.to_string(),
            Unavailable::LeasesSilent(limit) => format!(
                "the lease backend did not answer within {}",
                crate::duration::display(*limit)
            ),
        }
    }
}

/// What every refusal of one kind answers with: one row of the refusal table (`KINDS` lists
/// them for the tests).
#[derive(Debug)]
pub struct Kind {
    pub status: StatusCode,
    /// The problem type URI.
    pub urn: &'static str,
    pub title: &'static str,
    /// The gRPC status of its gRPC form (docs/grpc.md).
    pub grpc: Code,
    /// The metric outcome (`fencegate_requests_total{outcome}`).
    pub outcome: Outcome,
    /// Whose fault it is; a store's failure says whose itself ([`Refusal::fault`]).
    pub fault: Fault,
    /// Whether the answer says `Retry-After: 1`: the same request may pass in a moment.
    pub retry_after: bool,
}

macro_rules! kinds {
    ($($name:ident: $status:ident, $urn:literal, $title:literal, $grpc:ident, $outcome:ident,
       $fault:ident, $retry:literal;)*) => {
        $(
            static $name: Kind = Kind {
                status: StatusCode::$status,
                urn: concat!("urn:fencegate:", $urn),
                title: $title,
                grpc: Code::$grpc,
                outcome: Outcome::$outcome,
                fault: Fault::$fault,
                retry_after: $retry,
            };
        )*
        /// Every refusal kind, in the order of the table.
        #[cfg(test)]
        pub static KINDS: &[&Kind] = &[$(&$name),*];
    };
}

kinds! {
    // The client's: fix the request.
    INVALID_TOKEN: BAD_REQUEST, "invalid-token", "Invalid fencing token",
        InvalidArgument, InvalidToken, Client, false;
    INVALID_PATH: BAD_REQUEST, "invalid-path", "Invalid request path",
        InvalidArgument, InvalidPath, Client, false;
    INVALID_RESOURCE: BAD_REQUEST, "invalid-resource",
        "Cannot tell which resource this write is for",
        InvalidArgument, InvalidResource, Client, false;
    TOKEN_REQUIRED: PRECONDITION_REQUIRED, "token-required", "Fencing token required",
        InvalidArgument, TokenRequired, Client, false;
    STALE: CONFLICT, "stale-token", "Stale fencing token",
        Aborted, Stale, Client, false;
    UNISSUED: CONFLICT, "unissued-token", "Fencing token was never issued",
        Aborted, Unissued, Client, false;
    TOO_FAR: CONFLICT, "token-too-far", "Fencing token too far above the recorded maximum",
        Aborted, TooFar, Client, false;
    NO_ROUTE: NOT_FOUND, "no-route", "No route for this request",
        Unimplemented, NoRoute, Client, false;
    INVALID_IDEMPOTENCY_KEY: BAD_REQUEST, "invalid-idempotency-key", "Invalid idempotency key",
        InvalidArgument, InvalidRequest, Client, false;
    REQUEST_TOO_LARGE: PAYLOAD_TOO_LARGE, "request-too-large",
        "Request body too large for an idempotent write",
        ResourceExhausted, InvalidRequest, Client, false;
    INVALID_REQUEST: BAD_REQUEST, "invalid-request", "Invalid request",
        InvalidArgument, InvalidRequest, Client, false;
    IDEMPOTENCY_IN_FLIGHT: CONFLICT, "idempotency-in-flight",
        "A request with this idempotency key is still being processed",
        Aborted, IdempotencyInFlight, Client, true;
    IDEMPOTENCY_KEY_REUSED: UNPROCESSABLE_ENTITY, "idempotency-key-reused",
        "Idempotency key reused for a different request",
        FailedPrecondition, IdempotencyKeyReused, Client, false;
    NOT_REPLAYABLE: CONFLICT, "idempotency-not-replayable",
        "The request with this idempotency key completed; its response was not kept",
        FailedPrecondition, NotReplayable, Client, false;
    // Ours (or our store's): retry later.
    STORE_UNAVAILABLE: SERVICE_UNAVAILABLE, "store-unavailable", "Fence store unavailable",
        Unavailable, StoreUnavailable, Store, true;
    LEASE_NOT_HELD: SERVICE_UNAVAILABLE, "lease-not-held", "Lease not held",
        FailedPrecondition, LeaseNotHeld, Ours, true;
    BARRIER_TIMEOUT: SERVICE_UNAVAILABLE, "barrier-timeout",
        "Earlier writes to this resource are still in flight",
        Unavailable, BarrierTimeout, Ours, true;
    // The upstream's.
    UPSTREAM_ERROR: BAD_GATEWAY, "upstream-error", "Upstream failed",
        Unavailable, UpstreamError, Upstream, false;
    UPSTREAM_TIMEOUT: GATEWAY_TIMEOUT, "upstream-timeout", "Upstream timed out",
        DeadlineExceeded, UpstreamTimeout, Upstream, false;
}

impl Refusal {
    /// This refusal's row of the table: the one exhaustive match, no `_`, so a new refusal
    /// must pick its kind.
    pub fn kind(&self) -> &'static Kind {
        match self {
            Refusal::InvalidToken(_) => &INVALID_TOKEN,
            Refusal::InvalidPath(_) => &INVALID_PATH,
            Refusal::InvalidResource(_) => &INVALID_RESOURCE,
            Refusal::TokenRequired => &TOKEN_REQUIRED,
            Refusal::Stale { .. } | Refusal::Superseded { .. } => &STALE,
            Refusal::Unissued { .. } => &UNISSUED,
            Refusal::TooFar { .. } => &TOO_FAR,
            Refusal::NoRoute => &NO_ROUTE,
            Refusal::InvalidIdempotencyKey(_) => &INVALID_IDEMPOTENCY_KEY,
            Refusal::RequestTooLarge { .. } => &REQUEST_TOO_LARGE,
            Refusal::InvalidRequest(_) => &INVALID_REQUEST,
            Refusal::IdempotencyInFlight => &IDEMPOTENCY_IN_FLIGHT,
            Refusal::IdempotencyKeyReused => &IDEMPOTENCY_KEY_REUSED,
            Refusal::NotReplayable { .. } => &NOT_REPLAYABLE,
            Refusal::StoreUnavailable(_) => &STORE_UNAVAILABLE,
            Refusal::LeaseNotHeld => &LEASE_NOT_HELD,
            Refusal::BarrierTimeout => &BARRIER_TIMEOUT,
            Refusal::UpstreamError(_) => &UPSTREAM_ERROR,
            Refusal::UpstreamTimeout(_) => &UPSTREAM_TIMEOUT,
        }
    }

    /// Whose fault the refusal is; a store's failure says whose itself.
    pub fn fault(&self) -> Fault {
        match self {
            Refusal::StoreUnavailable(e) => e.fault(),
            _ => self.kind().fault,
        }
    }

    /// The metric outcome.
    pub fn outcome(&self) -> Outcome {
        self.kind().outcome
    }

    /// The recorded maximum (or latest grant) a stale, unissued or too-far refusal names.
    pub fn current_token(&self) -> Option<Token> {
        match *self {
            Refusal::Stale { current } | Refusal::Superseded { latest: current } => Some(current),
            Refusal::Unissued { latest } => latest,
            Refusal::TooFar { current, .. } => current,
            _ => None,
        }
    }

    /// The problem: status, type and title from its [`Kind`], `detail` from
    /// [`Refusal::detail`], then what it is about (resource, token, the current token or the
    /// recorded status).
    pub fn problem(&self, subject: &Subject<'_>, token_header: &HeaderName) -> Problem {
        let kind = self.kind();
        let detail = self.detail(subject, token_header);
        let mut problem = Problem::new(kind.status, kind.urn, kind.title, detail);
        if let Some(resource) = subject.resource {
            problem = problem.with("resource", resource);
        }
        if let Some(token) = subject.token {
            problem = problem.with("token", token);
        }
        match self {
            Refusal::Stale { current } | Refusal::Superseded { latest: current } => {
                problem = problem.with("current_token", *current)
            }
            Refusal::Unissued {
                latest: Some(latest),
            } => problem = problem.with("current_token", *latest),
            Refusal::TooFar { current, max_step } => {
                if let Some(current) = current {
                    problem = problem.with("current_token", *current);
                }
                problem = problem.with("max_step", *max_step);
            }
            Refusal::NotReplayable {
                status: Some(status),
            } => problem = problem.with("recorded_status", *status),
            _ => {}
        }
        problem
    }

    /// The `detail` sentence. `token_header` is the configured token header, named wherever
    /// the detail is about it.
    pub fn detail(&self, subject: &Subject<'_>, token_header: &HeaderName) -> String {
        match self {
            Refusal::InvalidToken(e) => {
                let header = spelled(token_header);
                match e {
                    TokenError::Grammar | TokenError::TooLarge => e.to_string(),
                    TokenError::Duplicate => {
                        format!("more than one `{header}` header: send the token once")
                    }
                    TokenError::Alias(alias) => format!(
                        "a header spelled `{alias}` aliases the token header `{header}`; use \
                         `-`, not `_`"
                    ),
                    TokenError::ConnectionNominated => format!(
                        "the Connection header names the token header `{header}`, which would \
                         strip it in transit"
                    ),
                }
            }
            Refusal::InvalidPath(e) => e.to_string(),
            Refusal::InvalidResource(e) => e.to_string(),
            Refusal::TokenRequired => format!(
                "this route requires a fencing token: send it in the `{}` header",
                spelled(token_header)
            ),
            Refusal::Stale { current } => {
                let token = subject.token.unwrap_or_default();
                let resource = subject.resource.unwrap_or("this resource");
                if token == *current {
                    format!(
                        "token {token} equals the highest token recorded for {resource} and \
                         `token.equal` is `reject`: each write needs a new token"
                    )
                } else {
                    format!(
                        "token {token} is below {current}, the highest token recorded for \
                         {resource}; the write was not forwarded"
                    )
                }
            }
            Refusal::Superseded { latest } => format!(
                "token {} is below {latest}, the latest lease granted for {}: a newer holder \
                 has the lease, even if it has not written yet",
                subject.token.unwrap_or_default(),
                subject.resource.unwrap_or("this resource")
            ),
            Refusal::Unissued { latest } => match latest {
                Some(latest) => format!(
                    "token {} is above {latest}, the latest lease granted for {}: no lease \
                     issued it",
                    subject.token.unwrap_or_default(),
                    subject.resource.unwrap_or("this resource")
                ),
                None => format!(
                    "no lease was ever granted for {}, so no token is valid for it",
                    subject.resource.unwrap_or("this resource")
                ),
            },
            Refusal::TooFar { current, max_step } => {
                let token = subject.token.unwrap_or_default();
                let resource = subject.resource.unwrap_or("this resource");
                match current {
                    Some(current) => format!(
                        "token {token} exceeds {current}, the highest token recorded for \
                         {resource}, by more than token.max_step ({max_step}); it was not \
                         forwarded and the recorded maximum is unchanged"
                    ),
                    None => format!(
                        "no token is recorded for {resource}, and a first token may be at most \
                         token.max_step ({max_step}); token {token} was not forwarded and \
                         nothing was recorded"
                    ),
                }
            }
            Refusal::NoRoute => "no configured route matches and `unmatched` is `reject`".into(),
            Refusal::InvalidIdempotencyKey(e) => e.to_string(),
            Refusal::RequestTooLarge { limit } => format!(
                "an idempotent write's body is read whole to fingerprint it; this one is larger \
                 than idempotency.max_request_bytes ({limit} bytes); nothing was recorded"
            ),
            Refusal::InvalidRequest(e) => e.clone(),
            Refusal::IdempotencyInFlight => format!(
                "a request with this idempotency key for {} is still with the upstream; retry \
                 after it completes to get its response",
                subject.resource.unwrap_or("this resource")
            ),
            Refusal::IdempotencyKeyReused => format!(
                "this idempotency key was first used on {} with a different method, path, query \
                 or body; use a new key for a new request",
                subject.resource.unwrap_or("this resource")
            ),
            Refusal::NotReplayable { status } => {
                format!(
                "the request with this idempotency key completed{} but its response was larger \
                 than idempotency.max_response_bytes, so it cannot be replayed; it was not \
                 executed again",
                status.map(|s| format!(" with status {s}")).unwrap_or_default()
            )
            }
            Refusal::StoreUnavailable(e) => format!(
                "the write was not forwarded because it could not be checked: {}",
                e.detail()
            ),
            Refusal::LeaseNotHeld => format!(
                "this sidecar holds no valid lease on {}: it was never acquired, was released, \
                 or passed its local validity deadline; the write was not sent",
                subject.resource.unwrap_or("this resource")
            ),
            Refusal::BarrierTimeout => {
                "writes with lower tokens did not finish within barrier_timeout; the write was \
                 not forwarded, its token remains recorded"
                    .into()
            }
            Refusal::UpstreamError(e) => {
                format!("the upstream could not be reached or failed: {e}")
            }
            Refusal::UpstreamTimeout(limit) => format!(
                "the upstream sent no response headers within timeouts.upstream ({}); the \
                 request may or may not have been applied",
                crate::duration::display(*limit)
            ),
        }
    }

    /// The problem+json response, with `Fencing-Token-Current` or `Retry-After` where they
    /// apply.
    #[cfg(test)]
    pub fn response(
        &self,
        subject: &Subject<'_>,
        token_header: &HeaderName,
    ) -> Response<ProxyBody> {
        self.respond(self.problem(subject, token_header))
    }

    /// `problem` (this refusal's) as the response, its gRPC status noted ([`grpc::mark`]).
    pub fn respond(&self, problem: Problem) -> Response<ProxyBody> {
        let kind = self.kind();
        let detail = problem.detail().to_owned();
        let mut response = problem.response();
        let headers = response.headers_mut();
        if let Refusal::Stale { current }
        | Refusal::Superseded { latest: current }
        | Refusal::TooFar {
            current: Some(current),
            ..
        } = self
        {
            headers.insert(TOKEN_CURRENT, HeaderValue::from(*current));
        }
        if kind.retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from_static("1"));
        }
        grpc::mark(&mut response, kind.grpc, detail);
        response
    }
}

/// A header name as people write it (`Fencing-Token`, `Idempotency-Key`, `X-Fence`): the
/// configuration keeps names lowercase, as HTTP/2 sends them, and they are case-insensitive.
pub fn spelled(name: &HeaderName) -> String {
    let mut out = String::with_capacity(name.as_str().len());
    let mut word_start = true;
    for c in name.as_str().chars() {
        out.push(if word_start {
            c.to_ascii_uppercase()
        } else {
            c
        });
        word_start = c == '-';
    }
    out
}

#[cfg(test)]
mod tests;
