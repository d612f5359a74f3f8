//! The admin listener: `/metrics`, `/healthz`, `/readyz`, `GET /v1/fences/{resource}`.
//!
//! It runs on its own port so probes and scrapes answer even when the proxy port is saturated.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;

use crate::metrics::Metrics;
use crate::proxy::body::ProxyBody;
use crate::store::FenceStore;

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
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return Ok(text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n"));
        }
        let path = req.uri().path();
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
            "/readyz" => {
                if self.readiness.is_draining() {
                    text(StatusCode::SERVICE_UNAVAILABLE, "draining\n")
                } else if !self.store.healthy() {
                    text(StatusCode::SERVICE_UNAVAILABLE, "store unavailable\n")
                } else {
                    text(StatusCode::OK, "ready\n")
                }
            }
            _ => match path.strip_prefix("/v1/fences/") {
                Some(encoded) => self.fence(encoded).await,
                None => text(StatusCode::NOT_FOUND, "not found\n"),
            },
        })
    }

    async fn fence(&self, encoded: &str) -> Response<ProxyBody> {
        let resource = match percent_encoding::percent_decode_str(encoded).decode_utf8() {
            Ok(r) if !r.is_empty() => r,
            _ => {
                return json_response(StatusCode::BAD_REQUEST, json!({"error": "bad resource id"}))
            }
        };
        let started = std::time::Instant::now();
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
            Err(e) => json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                json!({ "resource": resource, "error": e.to_string() }),
            ),
        }
    }
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
