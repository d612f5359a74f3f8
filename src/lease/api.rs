//! The local lease API (docs/leases.md), JSON over HTTP on `leases.listen` (loopback by default).
//!
//! `POST /v1/leases/{resource}` acquires (or returns the lease this holder already has),
//! `GET /v1/leases[/{resource}]` shows state (a resource without a lease here but with a `POST`
//! under way shows that acquisition, `acquiring`), `DELETE /v1/leases/{resource}` releases,
//! `GET /v1/leases/{resource}/events` streams transitions as Server-Sent Events.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::{json, Value};

use super::agent::{AcquireError, Agent, Attempt, Lease, State};
use crate::body::ProxyBody;
use crate::problem::{method_not_allowed, Problem};

/// Largest acquire request body: a holder id and two durations.
const MAX_BODY: usize = 16 * 1024;

/// The paths, as the docs and the `405` details write them, and the methods each accepts.
const LIST: &str = "/v1/leases";
const LIST_METHODS: &[Method] = &[Method::GET];
const ONE: &str = "/v1/leases/{resource}";
const ONE_METHODS: &[Method] = &[Method::GET, Method::POST, Method::DELETE];
const EVENTS: &str = "/v1/leases/{resource}/events";
const EVENTS_METHODS: &[Method] = &[Method::GET];

/// What a request body says, each field checked on its own so that a refusal can name it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AcquireBody {
    holder: Value,
    #[serde(default)]
    ttl: Option<Value>,
    #[serde(default)]
    wait: Option<Value>,
}

struct AcquireRequest {
    holder: String,
    ttl: Option<Duration>,
    wait: Option<Duration>,
}

/// The lease API in front of one agent.
pub struct LeaseApi {
    /// The agent whose leases it acquires, shows and releases.
    pub agent: Arc<Agent>,
}

impl LeaseApi {
    /// Answers one request (docs/leases.md); it never fails: a refusal is a problem+json answer.
    pub async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
    ) -> Result<Response<ProxyBody>, Infallible> {
        let path = req.uri().path().to_owned();
        let method = req.method().clone();
        let Some(rest) = path.strip_prefix(LIST) else {
            return Ok(not_found(&path));
        };
        if rest.is_empty() {
            return Ok(if method == Method::GET {
                json_response(StatusCode::OK, json!({ "leases": self.list() }))
            } else {
                method_not_allowed(&method, LIST, LIST_METHODS)
            });
        }
        let Some(encoded) = rest.strip_prefix('/') else {
            return Ok(not_found(&path));
        };
        let (encoded, events) = match encoded.strip_suffix("/events") {
            Some(resource) => (resource, true),
            None => (encoded, false),
        };
        let (template, allowed) = if events {
            (EVENTS, EVENTS_METHODS)
        } else {
            (ONE, ONE_METHODS)
        };
        if !allowed.contains(&method) {
            return Ok(method_not_allowed(&method, template, allowed));
        }
        // `GET /v1/leases/` lists, as `/v1/leases` does; a POST or DELETE there names no lease.
        if encoded.is_empty() && !events && method == Method::GET {
            return Ok(json_response(
                StatusCode::OK,
                json!({ "leases": self.list() }),
            ));
        }
        let resource = match resource_id(encoded) {
            Ok(resource) => resource,
            Err(e) => {
                return Ok(Problem::new(
                    StatusCode::BAD_REQUEST,
                    "urn:fencegate:invalid-resource",
                    "Invalid resource id",
                    e.to_string(),
                )
                .response())
            }
        };
        Ok(match (method, events) {
            (Method::GET, true) => self.events(resource),
            (Method::POST, _) => self.acquire(resource, req).await,
            (Method::GET, _) => {
                // The attempt first: a grant is listed as a lease before its attempt goes, so
                // one of the two is seen.
                let attempt = self.agent.attempt(&resource);
                match (self.agent.get(&resource), attempt) {
                    (Some(lease), _) => json_response(StatusCode::OK, view(&lease)),
                    (None, Some(attempt)) => json_response(StatusCode::OK, view_attempt(&attempt)),
                    (None, None) => not_held(&resource),
                }
            }
            // DELETE, the one method left.
            _ => match self.agent.release(&resource).await {
                None => not_held(&resource),
                Some(Ok(lease)) => json_response(StatusCode::OK, view(&lease)),
                // Released locally (the token is no longer attached); the backend expires it.
                Some(Err(e)) => Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "urn:fencegate:lease-backend-unavailable",
                    "Lease backend unavailable",
                    format!(
                        "the lease was dropped here and its token is no longer attached, but \
                         {e}; the backend lets the lease expire at its TTL"
                    ),
                )
                .with("resource", resource)
                .response(),
            },
        })
    }

    /// Every lease here, and every acquisition under way for a resource without one, by
    /// resource.
    fn list(&self) -> Vec<Value> {
        // Attempts first, as for one resource.
        let attempts = self.agent.attempts();
        let leases = self.agent.all();
        let mut all: Vec<(String, Value)> = leases
            .iter()
            .map(|l| (l.grant.resource.clone(), view(l)))
            .collect();
        for attempt in attempts {
            if !leases.iter().any(|l| l.grant.resource == attempt.resource) {
                all.push((attempt.resource.clone(), view_attempt(&attempt)));
            }
        }
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all.into_iter().map(|(_, v)| v).collect()
    }

    async fn acquire(&self, resource: String, req: Request<Incoming>) -> Response<ProxyBody> {
        let invalid = |detail: String| {
            Problem::new(
                StatusCode::BAD_REQUEST,
                "urn:fencegate:invalid-request",
                "Invalid lease request",
                detail,
            )
            .with("resource", resource.as_str())
            .response()
        };
        let body = match http_body_util::Limited::new(req.into_body(), MAX_BODY)
            .collect()
            .await
        {
            Ok(body) => body.to_bytes(),
            Err(e) if e.is::<http_body_util::LengthLimitError>() => {
                return invalid(format!("the body is larger than {} KiB", MAX_BODY / 1024))
            }
            Err(e) => return invalid(format!("the body could not be read: {e}")),
        };
        let request = match parse_request(&body) {
            Ok(request) => request,
            Err(e) => return invalid(e.to_string()),
        };
        let wait = request.wait.unwrap_or_default();
        match self
            .agent
            .acquire(&resource, &request.holder, request.ttl, wait)
            .await
        {
            Ok(lease) => json_response(StatusCode::OK, view(&lease)),
            Err(AcquireError::Held { holder }) => {
                let mut r = Problem::new(
                    StatusCode::CONFLICT,
                    "urn:fencegate:lease-held",
                    "Lease held by another holder",
                    format!("{resource} is held by another holder"),
                )
                .with("resource", resource.as_str())
                .with("holder", holder)
                .response();
                let retry = self.agent.default_ttl().as_secs().max(1);
                r.headers_mut()
                    .insert(RETRY_AFTER, HeaderValue::from(retry));
                r
            }
            Err(AcquireError::TtlTooShort { minimum }) => Problem::new(
                StatusCode::BAD_REQUEST,
                "urn:fencegate:ttl-too-short",
                "Lease TTL too short",
                format!(
                    "ttl {} is below the configured minimum of {}",
                    crate::duration::display(request.ttl.unwrap_or_default()),
                    crate::duration::display(minimum)
                ),
            )
            .with("resource", resource)
            .response(),
            Err(AcquireError::TtlTooLong { maximum }) => invalid(format!(
                "ttl is above the maximum of {}",
                crate::duration::display(maximum)
            )),
            Err(AcquireError::WaitTooLong { maximum }) => invalid(format!(
                "wait is above the maximum of {}",
                crate::duration::display(maximum)
            )),
            Err(AcquireError::Draining) => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "urn:fencegate:draining",
                "Lease agent shutting down",
                "this sidecar is shutting down and grants no new leases",
            )
            .with("resource", resource)
            .response(),
            Err(AcquireError::Unavailable(e)) => {
                let mut r = Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "urn:fencegate:lease-backend-unavailable",
                    "Lease backend unavailable",
                    format!("no lease was granted: {e}"),
                )
                .with("resource", resource)
                .response();
                r.headers_mut()
                    .insert(RETRY_AFTER, HeaderValue::from_static("1"));
                r
            }
        }
    }

    /// Server-Sent Events for one resource: the current state first, then every transition.
    fn events(&self, resource: String) -> Response<ProxyBody> {
        let mut updates = self.agent.subscribe();
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
        let current = self.agent.get(&resource).map(|l| view(&l));
        let closed = self.agent.closed();
        tokio::spawn(async move {
            tokio::pin!(closed);
            if let Some(current) = current {
                if tx.send(sse("state", &current)).await.is_err() {
                    return;
                }
            }
            loop {
                let update = tokio::select! {
                    // Pending events first, so `released` is sent before the stream ends.
                    biased;
                    update = updates.recv() => update,
                    // Shut down (every lease released and announced): end the stream.
                    () = &mut closed => return,
                };
                match update {
                    Ok(event) if event.resource == resource => {
                        let data = serde_json::to_value(&event).unwrap_or_default();
                        if tx.send(sse(event.event, &data)).await.is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        let mut r = Response::new(ProxyBody::Channel(rx));
        r.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        r.headers_mut()
            .insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        r
    }
}

fn sse(event: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {event}\ndata: {data}\n\n"))
}

/// A lease as the API shows it: `resource`, `holder`, `lease_id`, `fencing_token`, `ttl_ms`,
/// `renew_every_ms`, `state` and `valid_for_ms`.
pub fn view(lease: &Lease) -> Value {
    json!({
        "resource": lease.grant.resource,
        "holder": lease.grant.holder,
        "lease_id": lease.grant.lease_id,
        "fencing_token": lease.grant.token,
        "ttl_ms": lease.ttl.as_millis() as u64,
        "renew_every_ms": (lease.ttl / 3).as_millis() as u64,
        "state": lease.state(),
        "valid_for_ms": lease.valid_for().as_millis() as u64,
    })
}

/// An acquisition under way: no grant yet, so no lease id, token or validity.
pub fn view_attempt(attempt: &Attempt) -> Value {
    json!({
        "resource": attempt.resource,
        "holder": attempt.holder,
        "lease_id": null,
        "fencing_token": null,
        "ttl_ms": attempt.ttl.as_millis() as u64,
        "renew_every_ms": (attempt.ttl / 3).as_millis() as u64,
        "state": State::Acquiring,
        "valid_for_ms": 0,
    })
}

fn json_response(status: StatusCode, body: Value) -> Response<ProxyBody> {
    let mut r = Response::new(ProxyBody::local(body.to_string()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// What an acquire request must be, for the refusals that say so.
const SEND: &str = "a JSON object with `holder` (and optionally `ttl` and `wait`)";

/// Why an acquire request's body cannot be used: a `400`'s `detail`.
#[derive(Debug, thiserror::Error)]
enum BodyError {
    #[error("the body is empty: send {SEND}")]
    Empty,
    /// JSON, but not an object.
    #[error("the body must be {SEND}")]
    NotObject,
    #[error("the body is not JSON: {0}")]
    NotJson(serde_json::Error),
    /// An object whose fields are not those of a request (unknown, missing, mistyped): serde's
    /// message, without the position (the body is small, it tells nothing).
    #[error("{0}")]
    Fields(String),
    #[error("holder must be a string of 1 to 256 bytes")]
    Holder,
    /// `ttl` or `wait` is not a duration.
    #[error("{field}: {source}")]
    Duration {
        field: &'static str,
        source: serde_json::Error,
    },
}

/// Why a lease API path names no resource: a `400`'s `detail`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
enum ResourceIdError {
    #[error("the resource id is empty: put it after /v1/leases/, percent-encoded")]
    Empty,
    #[error("the resource id is not UTF-8 once percent-decoded")]
    NotUtf8,
    #[error("the resource id contains a control character")]
    Control,
}

/// The body of `POST /v1/leases/{resource}`.
fn parse_request(body: &[u8]) -> Result<AcquireRequest, BodyError> {
    match body.trim_ascii_start().first() {
        None => return Err(BodyError::Empty),
        // serde would also read an array as the fields in order.
        Some(b'{') => {}
        Some(_) => {
            return Err(
                match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
                    Ok(_) => BodyError::NotObject,
                    Err(e) => BodyError::NotJson(e),
                },
            )
        }
    }
    let raw: AcquireBody = serde_json::from_slice(body).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => {
            let position = format!(" at line {} column {}", e.line(), e.column());
            let text = e.to_string();
            BodyError::Fields(text.strip_suffix(&position).unwrap_or(&text).to_owned())
        }
        _ => BodyError::NotJson(e),
    })?;
    let holder = match raw.holder {
        Value::String(h) if (1..=256).contains(&h.len()) => h,
        _ => return Err(BodyError::Holder),
    };
    // A duration field's refusal says which field (serde's does not).
    let duration = |field: &'static str, value: Option<Value>| {
        value
            .map(|v| {
                crate::duration::deserialize(v)
                    .map_err(|source| BodyError::Duration { field, source })
            })
            .transpose()
    };
    Ok(AcquireRequest {
        holder,
        ttl: duration("ttl", raw.ttl)?,
        wait: duration("wait", raw.wait)?,
    })
}

/// The resource id of a lease API path: its segment percent-decoded once, held to the rule
/// of every resource id ([`crate::fence::resource::ResourceId`]: not empty, no control
/// character).
fn resource_id(encoded: &str) -> Result<String, ResourceIdError> {
    use crate::fence::resource::{ResourceId, ResourceIdError as Rule};
    let decoded = percent_encoding::percent_decode_str(encoded)
        .decode_utf8()
        .map_err(|_| ResourceIdError::NotUtf8)?;
    match ResourceId::new(decoded) {
        Ok(id) => Ok(id.into()),
        Err(Rule::Empty) => Err(ResourceIdError::Empty),
        Err(Rule::Control) => Err(ResourceIdError::Control),
    }
}

fn not_held(resource: &str) -> Response<ProxyBody> {
    Problem::new(
        StatusCode::NOT_FOUND,
        "urn:fencegate:lease-not-held",
        "Lease not held",
        format!("this sidecar holds no lease on {resource}"),
    )
    .with("resource", resource)
    .response()
}

fn not_found(path: &str) -> Response<ProxyBody> {
    Problem::new(
        StatusCode::NOT_FOUND,
        "urn:fencegate:not-found",
        "No such endpoint",
        format!("{path} is not a lease API path: the lease API serves {LIST}, {ONE} and {EVENTS}"),
    )
    .response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(body: &str) -> String {
        match parse_request(body.as_bytes()) {
            Ok(_) => panic!("{body} was taken"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn refusals_say_what_is_wrong_with_the_body() {
        let send = "a JSON object with `holder` (and optionally `ttl` and `wait`)";
        assert_eq!(refusal("  "), format!("the body is empty: send {send}"));
        assert_eq!(refusal("[\"a\"]"), format!("the body must be {send}"));
        assert!(refusal("x").starts_with("the body is not JSON: "));
        assert!(refusal("{\"holder\": \"a\"").starts_with("the body is not JSON: "));
        assert_eq!(
            refusal("{\"holder\": \"a\", \"lease\": 1}"),
            "unknown field `lease`, expected one of `holder`, `ttl`, `wait`"
        );
        assert_eq!(
            refusal("{\"holder\": \"\"}"),
            "holder must be a string of 1 to 256 bytes"
        );
        assert!(refusal("{\"holder\": \"a\", \"wait\": \"soon\"}").starts_with("wait: "));
        let ok = parse_request(br#"{"holder": "a", "ttl": "2s"}"#).unwrap();
        assert_eq!(
            (ok.holder.as_str(), ok.ttl),
            ("a", Some(Duration::from_secs(2)))
        );
    }

    #[test]
    fn resource_ids_are_decoded_once() {
        assert_eq!(resource_id("account%3A42").unwrap(), "account:42");
        assert_eq!(resource_id("a%2541").unwrap(), "a%41");
        let refused = |encoded| resource_id(encoded).unwrap_err().to_string();
        assert_eq!(
            refused(""),
            "the resource id is empty: put it after /v1/leases/, percent-encoded"
        );
        assert_eq!(
            refused("%ff"),
            "the resource id is not UTF-8 once percent-decoded"
        );
        assert_eq!(
            refused("a%0A"),
            "the resource id contains a control character"
        );
    }
}
