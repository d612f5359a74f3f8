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

use super::agent::{AcquireError, Agent, Attempt, Lease};
use crate::proxy::body::ProxyBody;

/// Largest acquire request body: a holder id and two durations.
const MAX_BODY: usize = 16 * 1024;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AcquireRequest {
    holder: String,
    #[serde(default, with = "crate::duration::option")]
    ttl: Option<Duration>,
    #[serde(default, with = "crate::duration::option")]
    wait: Option<Duration>,
}

pub struct LeaseApi {
    pub agent: Arc<Agent>,
}

impl LeaseApi {
    pub async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
    ) -> Result<Response<ProxyBody>, Infallible> {
        let path = req.uri().path().to_owned();
        let Some(rest) = path.strip_prefix("/v1/leases") else {
            return Ok(problem(
                StatusCode::NOT_FOUND,
                "not-found",
                "no such endpoint",
                None,
            ));
        };
        let method = req.method().clone();
        if rest.is_empty() || rest == "/" {
            return Ok(match method {
                Method::GET => json_response(StatusCode::OK, json!({ "leases": self.list() })),
                _ => problem(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "method-not-allowed",
                    "GET only",
                    None,
                ),
            });
        }
        let encoded = &rest[1..];
        let (encoded, events) = match encoded.strip_suffix("/events") {
            Some(resource) => (resource, true),
            None => (encoded, false),
        };
        let resource = match percent_encoding::percent_decode_str(encoded).decode_utf8() {
            Ok(r) if !r.is_empty() && !r.chars().any(char::is_control) => r.into_owned(),
            _ => {
                return Ok(problem(
                    StatusCode::BAD_REQUEST,
                    "invalid-resource",
                    "bad resource id",
                    None,
                ));
            }
        };
        Ok(match (method, events) {
            (Method::GET, true) => self.events(resource),
            (Method::POST, false) => self.acquire(resource, req).await,
            (Method::GET, false) => {
                // The attempt first: a grant is listed as a lease before its attempt goes, so
                // one of the two is seen.
                let attempt = self.agent.attempt(&resource);
                match (self.agent.get(&resource), attempt) {
                    (Some(lease), _) => json_response(StatusCode::OK, view(&lease)),
                    (None, Some(attempt)) => json_response(StatusCode::OK, view_attempt(&attempt)),
                    (None, None) => problem(
                        StatusCode::NOT_FOUND,
                        "lease-not-held",
                        "no lease on this resource here",
                        Some(&resource),
                    ),
                }
            }
            (Method::DELETE, false) => match self.agent.release(&resource).await {
                None => problem(
                    StatusCode::NOT_FOUND,
                    "lease-not-held",
                    "no lease on this resource here",
                    Some(&resource),
                ),
                Some(Ok(lease)) => json_response(StatusCode::OK, view(&lease)),
                // Released locally (the token is no longer attached); the backend expires it.
                Some(Err(e)) => problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "lease-backend-unavailable",
                    &e.to_string(),
                    Some(&resource),
                ),
            },
            _ => problem(
                StatusCode::METHOD_NOT_ALLOWED,
                "method-not-allowed",
                "see the lease API",
                None,
            ),
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
        let body = match http_body_util::Limited::new(req.into_body(), MAX_BODY)
            .collect()
            .await
        {
            Ok(body) => body.to_bytes(),
            Err(_) => {
                return problem(
                    StatusCode::BAD_REQUEST,
                    "invalid-request",
                    "unreadable or oversized body",
                    None,
                )
            }
        };
        let request: AcquireRequest = match serde_json::from_slice(&body) {
            Ok(r) => r,
            Err(e) => {
                return problem(
                    StatusCode::BAD_REQUEST,
                    "invalid-request",
                    &format!(
                    "expected {{\"holder\": \"...\", \"ttl\": \"1500ms\", \"wait\": \"5s\"}}: {e}"
                ),
                    Some(&resource),
                )
            }
        };
        if request.holder.is_empty() || request.holder.len() > 256 {
            return problem(
                StatusCode::BAD_REQUEST,
                "invalid-request",
                "holder must be 1-256 bytes",
                Some(&resource),
            );
        }
        let wait = request.wait.unwrap_or_default();
        match self
            .agent
            .acquire(&resource, &request.holder, request.ttl, wait)
            .await
        {
            Ok(lease) => json_response(StatusCode::OK, view(&lease)),
            Err(AcquireError::Held { holder }) => {
                let mut r = json_response(
                    StatusCode::CONFLICT,
                    json!({
                        "type": "urn:fencegate:lease-held",
                        "title": "Lease held by another holder",
                        "status": 409,
                        "detail": format!("{resource} is held by another holder"),
                        "resource": resource,
                        "holder": holder,
                    }),
                );
                let retry = self.agent.default_ttl().as_secs().max(1);
                r.headers_mut()
                    .insert(RETRY_AFTER, HeaderValue::from(retry));
                r
            }
            Err(AcquireError::TtlTooShort { minimum }) => problem(
                StatusCode::BAD_REQUEST,
                "ttl-too-short",
                &format!(
                    "ttl is below the configured minimum of {}ms",
                    minimum.as_millis()
                ),
                Some(&resource),
            ),
            Err(AcquireError::TtlTooLong { maximum }) => problem(
                StatusCode::BAD_REQUEST,
                "invalid-request",
                &format!(
                    "ttl is above the maximum of {}",
                    crate::duration::display(maximum)
                ),
                Some(&resource),
            ),
            Err(AcquireError::WaitTooLong { maximum }) => problem(
                StatusCode::BAD_REQUEST,
                "invalid-request",
                &format!(
                    "wait is above the maximum of {}",
                    crate::duration::display(maximum)
                ),
                Some(&resource),
            ),
            Err(AcquireError::Draining) => problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "draining",
                "this sidecar is shutting down and grants no new leases",
                Some(&resource),
            ),
            Err(AcquireError::Unavailable(e)) => {
                let mut r = problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "lease-backend-unavailable",
                    &e.to_string(),
                    Some(&resource),
                );
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
        "state": "acquiring",
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

fn problem(
    status: StatusCode,
    kind: &str,
    detail: &str,
    resource: Option<&str>,
) -> Response<ProxyBody> {
    let mut body = json!({
        "type": format!("urn:fencegate:{kind}"),
        "title": status.canonical_reason().unwrap_or("error"),
        "status": status.as_u16(),
        "detail": detail,
    });
    if let Some(resource) = resource {
        body["resource"] = resource.into();
    }
    let mut r = json_response(status, body);
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    r
}
