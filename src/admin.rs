//! The admin listener: `/metrics`, `/healthz`, `/readyz`, `GET /v1/fences/{resource}` (also
//! at `/fences/{resource}`: read-only, like the rest).
//!
//! It runs on its own port so probes and scrapes answer even when the proxy port is saturated.
//! Every path takes `GET` and `HEAD`; errors are problem+json, like the proxy's refusals.

use crate::fence::resource::ResourceId;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;

use crate::body::ProxyBody;
use crate::metrics::Metrics;
use crate::problem::{method_not_allowed, Problem};
use crate::store::FenceStore;

/// The fence inspection API's path; the rest is a percent-encoded resource id.
const FENCES: &str = "/v1/fences/";
/// The same, without the version.
const FENCES_UNVERSIONED: &str = "/fences/";
/// What every admin path accepts.
const METHODS: &[Method] = &[Method::GET, Method::HEAD];

/// Readiness is a one-way latch: once draining starts it never comes back.
#[derive(Default)]
pub struct Readiness {
    draining: AtomicBool,
}

impl Readiness {
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
}

pub struct Admin {
    pub metrics: Arc<Metrics>,
    pub store: Arc<dyn FenceStore>,
    pub readiness: Arc<Readiness>,
}

impl Admin {
    pub async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
    ) -> Result<Response<ProxyBody>, Infallible> {
        let path = req.uri().path();
        let (known, encoded) = match path {
            "/metrics" | "/healthz" | "/readyz" => (path, None),
            _ => match (
                path.strip_prefix(FENCES),
                path.strip_prefix(FENCES_UNVERSIONED),
            ) {
                (Some(encoded), _) => ("/v1/fences/{resource}", Some(encoded)),
                (None, Some(encoded)) => ("/fences/{resource}", Some(encoded)),
                (None, None) => return Ok(not_found(path)),
            },
        };
        if !METHODS.contains(req.method()) {
            return Ok(method_not_allowed(req.method(), known, METHODS));
        }
        if let Some(encoded) = encoded {
            return Ok(self.fence(encoded).await);
        }
        Ok(match path {
            "/metrics" => {
                let mut r = text(StatusCode::OK, self.metrics.render());
                r.headers_mut().insert(
                    CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                r
            }
            "/healthz" => text(StatusCode::OK, "ok\n"),
            // `/readyz`, the one path left.
            _ => {
                if self.readiness.is_draining() {
                    text(StatusCode::SERVICE_UNAVAILABLE, "draining\n")
                } else if !self.store.healthy() {
                    text(StatusCode::SERVICE_UNAVAILABLE, "store unavailable\n")
                } else {
                    text(StatusCode::OK, "ready\n")
                }
            }
        })
    }

    async fn fence(&self, encoded: &str) -> Response<ProxyBody> {
        let resource = match percent_encoding::percent_decode_str(encoded).decode_utf8() {
            Ok(r) if !r.is_empty() => r,
            Ok(_) => {
                return invalid_resource(
                    "the resource id is empty: put it after /v1/fences/, percent-encoded",
                )
            }
            Err(_) => return invalid_resource("the resource id is not UTF-8 once percent-decoded"),
        };
        let Ok(resource) = ResourceId::new(resource) else {
            return invalid_resource("the resource id holds a control character");
        };
        let started = tokio::time::Instant::now();
        let current = self.store.current(&resource).await;
        self.metrics
            .store_get
            .observe(started.elapsed().as_secs_f64());
        match current {
            Ok(Some(token)) => json_response(
                StatusCode::OK,
                json!({ "resource": resource, "token": token, "store": self.store.kind() }),
            ),
            Ok(None) => json_response(
                StatusCode::NOT_FOUND,
                json!({ "resource": resource, "token": null, "store": self.store.kind() }),
            ),
            Err(e) => {
                let mut r = Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "urn:fencegate:store-unavailable",
                    "Fence store unavailable",
                    format!("the recorded maximum could not be read: {e}"),
                )
                .with("resource", resource.as_str())
                .response();
                r.headers_mut()
                    .insert(RETRY_AFTER, HeaderValue::from_static("1"));
                r
            }
        }
    }
}

fn invalid_resource(detail: &str) -> Response<ProxyBody> {
    Problem::new(
        StatusCode::BAD_REQUEST,
        "urn:fencegate:invalid-resource",
        "Invalid resource id",
        detail,
    )
    .response()
}

fn not_found(path: &str) -> Response<ProxyBody> {
    Problem::new(
        StatusCode::NOT_FOUND,
        "urn:fencegate:not-found",
        "No such endpoint",
        format!(
            "{path} is not an admin path: the admin listener serves /metrics, /healthz, /readyz, \
             /v1/fences/{{resource}} and /fences/{{resource}}"
        ),
    )
    .response()
}

fn text(status: StatusCode, body: impl Into<bytes::Bytes>) -> Response<ProxyBody> {
    let mut r = Response::new(ProxyBody::local(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

fn json_response(status: StatusCode, body: serde_json::Value) -> Response<ProxyBody> {
    let mut r = Response::new(ProxyBody::local(body.to_string()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}
