//! The fence in-process: a tower [`Layer`] for Rust services (axum, tonic, hyper), so a
//! service can refuse stale writes itself instead of behind the sidecar (docs/library.md).
//!
//! [`FenceLayer`] wraps any `Service<http::Request<B>>` in a [`FenceService`] that applies the
//! fence of a fencegate configuration: its routes and resources, the token header,
//! `missing_token`, `token.equal`, `token.max_step`, the store's compare-and-raise,
//! `fence.authority: leases`, the `ordering: serialize` barrier, and `Idempotency-Key`s. It is
//! the proxy's own
//! [`Fence`] (its decision shared, not copied), without an upstream, and so are the refusals:
//! the same problem+json bodies, statuses and headers (`Fencing-Token-Current`,
//! `Retry-After`), in gRPC form for gRPC calls ([`crate::problem::grpc`]), counted in the
//! same metrics and logged in the same `WARN` line (the access log is the sidecar's). A
//! refused request never reaches the inner service; an admitted one reaches it unchanged but
//! for a path that was not normal, which it gets as the fence read it (as the sidecar forwards
//! it), and, for a write with an `Idempotency-Key`, a body the fence read whole (request
//! trailers left out, as the sidecar leaves them out). Under `ordering: serialize` the response body holds the barrier's ticket until it has
//! been read to its end or dropped, as the proxy's does.
//!
//! Of the configuration, what is about the sidecar (`listen`, `admin`, `upstream`, `tls`,
//! `timeouts` other than `store` and, with `idempotency`, `upstream`, `limits` other than
//! `max_resource_bytes`, `access_log`) is
//! not used; [`Config::parse_fence`] reads a configuration without `upstream`.
//!
//! With an `idempotency` section, a write carrying a key is handled as the sidecar handles it
//! (docs/idempotency.md): its body is read first (up to `max_request_bytes`, within
//! `timeouts.upstream`) and fingerprinted, the key is claimed in the store with the fence, a
//! retry of a completed write is answered from its record (`Idempotent-Replayed: true`) without
//! reaching the service, and the service's answer to the write that executes is recorded as it
//! is sent. The service must answer within `timeouts.upstream`, or its call is dropped and the
//! outcome is unknown, as with an upstream the sidecar gives up on. So that a body the fence
//! has read can still reach the service, the service receives a [`RequestBody`]: the
//! request's own body, streamed, or the bytes the fence read.
//!
//! The layer sees the path its server hands it: behind axum's `Router::nest` that is the path
//! without the nest's prefix. Put the layer on the outermost router, where paths are whole.
//!
//! ```
//! use std::convert::Infallible;
//!
//! use bytes::Bytes;
//! use fencegate::config::Config;
//! use fencegate::layer::{FenceLayer, RequestBody};
//! use http::{Request, Response, StatusCode};
//! use http_body_util::{BodyExt, Full};
//! use tower_layer::Layer;
//! use tower_service::Service;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let config = Config::parse_fence(
//!     "store: { kind: memory }\n\
//!      routes:\n  - { name: accounts, path: '/accounts/{id}', methods: [PUT], resource: 'account:{id}' }\n",
//! )
//! .unwrap();
//! let fence = FenceLayer::open(&config).await.unwrap();
//! let ledger = tower::service_fn(|_req: Request<RequestBody<Full<Bytes>>>| async {
//!     Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("stored"))))
//! });
//! let mut service = fence.layer(ledger);
//!
//! let put = |token: &str| {
//!     Request::put("/accounts/42")
//!         .header("host", "ledger")
//!         .header("fencing-token", token)
//!         .body(Full::new(Bytes::new()))
//!         .unwrap()
//! };
//! let admitted = service.call(put("34")).await.unwrap();
//! assert_eq!(admitted.status(), StatusCode::OK);
//!
//! let stale = service.call(put("33")).await.unwrap();
//! assert_eq!(stale.status(), StatusCode::CONFLICT);
//! assert_eq!(stale.headers()["fencing-token-current"], "34");
//! let body = stale.into_body().collect().await.unwrap().to_bytes();
//! assert!(body.starts_with(br#"{"type":"urn:fencegate:stale-token""#));
//! # }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::Full;
use tokio::time::Instant;
use tower_layer::Layer;
use tower_service::Service;

use crate::body::ProxyBody;
use crate::config::{Authority, Config};
use crate::fence::barrier::Ticket;
use crate::fence::{Decision, Fence, Pass};

mod body;
mod keyed;
use crate::lease::{LeaseBackend, LeaseError};
use crate::metrics::{Metrics, Outcome};
use crate::problem::grpc;
use crate::store::{FenceStore, StoreError};
pub use body::{FenceBody, RequestBody};

/// Why the in-process fence could not be made.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// Registering the `fencegate_*` metrics (in a registry that already has them, say).
    #[error(transparent)]
    Metrics(#[from] prometheus::Error),
    /// Opening the store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// `fence.authority: leases` without a `leases` section to open the backend from.
    #[error("fence.authority: leases needs the leases section")]
    NoLeases,
    /// `fence.authority: leases` given to [`FenceLayer::new`], which has no lease backend to
    /// check tokens against: fencing without it would let a token below the latest grant
    /// through.
    #[error(
        "fence.authority: leases checks every token against the lease backend, which \
         FenceLayer::new does not open: use FenceLayer::open, or FenceLayer::with_lease_backend"
    )]
    NoLeaseBackend,
    /// Opening the lease backend (`fence.authority: leases`).
    #[error(transparent)]
    LeaseBackend(#[from] LeaseError),
}

/// Applies a fencegate configuration's fence to the services it wraps (see the [module
/// docs](self)). Cheap to clone: every service it makes shares one fence (store, barriers,
/// metrics).
#[derive(Clone)]
pub struct FenceLayer {
    fence: Arc<Fence>,
    /// How long the service may take to answer a write with an `Idempotency-Key`
    /// (`timeouts.upstream`): its in-flight record outlives that.
    send_within: std::time::Duration,
}

impl FenceLayer {
    /// The fence of `config` over `store`, its metrics registered in `registry` (the same
    /// `fencegate_*` metrics the sidecar exposes). A config with `fence.authority: leases` is
    /// refused ([`LayerError::NoLeaseBackend`]): use [`FenceLayer::with_lease_backend`], or
    /// [`FenceLayer::open`], which also opens the lease backend.
    pub fn new(
        config: &Config,
        store: Arc<dyn FenceStore>,
        registry: prometheus::Registry,
    ) -> Result<Self, LayerError> {
        if config.fence.authority == Authority::Leases {
            return Err(LayerError::NoLeaseBackend);
        }
        Self::build(config, store, None, registry)
    }

    /// [`FenceLayer::new`] with the lease backend that `fence.authority: leases` checks every
    /// token against (`fencegate::lease::open`); without that setting the backend is not used.
    pub fn with_lease_backend(
        config: &Config,
        store: Arc<dyn FenceStore>,
        backend: Arc<dyn LeaseBackend>,
        registry: prometheus::Registry,
    ) -> Result<Self, LayerError> {
        Self::build(config, store, Some(backend), registry)
    }

    fn build(
        config: &Config,
        store: Arc<dyn FenceStore>,
        backend: Option<Arc<dyn LeaseBackend>>,
        registry: prometheus::Registry,
    ) -> Result<Self, LayerError> {
        let metrics = Arc::new(Metrics::new(registry)?);
        let mut fence = Fence::new(config, store, metrics);
        if config.fence.authority == Authority::Leases {
            fence = fence.with_authority(backend.ok_or(LayerError::NoLeaseBackend)?);
        }
        Ok(FenceLayer {
            fence: Arc::new(fence),
            send_within: config.timeouts.upstream,
        })
    }

    /// Opens `config`'s store (and, with `fence.authority: leases`, its lease backend) and
    /// makes the fence, its metrics in a registry of its own ([`FenceLayer::registry`]).
    pub async fn open(config: &Config) -> Result<Self, LayerError> {
        Self::open_in(config, prometheus::Registry::new()).await
    }

    /// [`FenceLayer::open`], with the `fencegate_*` metrics registered in `registry`: the
    /// app's own, exported with its other metrics.
    pub async fn open_in(
        config: &Config,
        registry: prometheus::Registry,
    ) -> Result<Self, LayerError> {
        crate::tls::install_default_provider();
        let store = crate::store::open(&config.store).await?;
        // `fence.retention` (only ever with `fence.authority: leases`, whose backend is
        // opened below): the store forgets idle maxima as the sidecar's does.
        if let Some(period) = config.fence.retention {
            store.forget_after(period)?;
        }
        let backend = match config.fence.authority {
            Authority::Leases => {
                let leases = config.leases.as_ref().ok_or(LayerError::NoLeases)?;
                Some(crate::lease::open(&leases.backend).await?)
            }
            Authority::None => None,
        };
        Self::build(config, store, backend, registry)
    }

    /// The registry the fence's metrics are in, to export them (`prometheus::TextEncoder`).
    pub fn registry(&self) -> &prometheus::Registry {
        self.fence.metrics_registry()
    }
}

impl<S> Layer<S> for FenceLayer {
    type Service = FenceService<S>;

    fn layer(&self, inner: S) -> FenceService<S> {
        FenceService {
            inner,
            fence: Arc::clone(&self.fence),
            send_within: self.send_within,
        }
    }
}

/// A service behind the fence: refused requests are answered here, the others go to `S`.
#[derive(Clone)]
pub struct FenceService<S> {
    inner: S,
    fence: Arc<Fence>,
    send_within: std::time::Duration,
}

impl<S, B, RB> Service<Request<B>> for FenceService<S>
where
    S: Service<Request<RequestBody<B>>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    RB: Body<Data = Bytes> + Send + 'static,
{
    type Response = Response<FenceBody<RB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, RB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let started = Instant::now();
        let grpc = grpc::is_call(req.version(), req.headers());
        let method = req.method().clone();
        // The service that was polled ready serves this request; its clone waits for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let fence = Arc::clone(&self.fence);
        let self_send_within = self.send_within;
        match fence.decide(&req) {
            Decision::Refuse(refused) => {
                let response = fence.answer_refused(refused, &req, started);
                ResponseFuture::Refused {
                    response: Some(refusal(response, grpc)),
                }
            }
            Decision::Forward(Pass {
                route,
                fenced,
                normalised,
            }) => {
                let req = with_path(req, &normalised).map(RequestBody::streamed);
                let outcome = match fenced.and_then(|f| f.token) {
                    Some(_) => Outcome::Admitted,
                    None => Outcome::Forwarded,
                };
                ResponseFuture::Inner {
                    future: inner.call(req),
                    answered: Some(Counted {
                        fence,
                        route,
                        method,
                        outcome,
                        started,
                        ticket: None,
                    }),
                }
            }
            Decision::Later(mut later) => ResponseFuture::Waiting {
                future: Box::pin(async move {
                    let req = with_path(req, &later.normalised);
                    if let Some(key) = later.key.take() {
                        let call = keyed::Call {
                            fence,
                            inner,
                            later,
                            key,
                            send_within: self_send_within,
                            grpc,
                            started,
                        };
                        return keyed::keyed_write(call, req).await;
                    }
                    let req = req.map(RequestBody::streamed);
                    let route = Some(later.route);
                    match fence.admit_later(later).await {
                        Err(refused) => {
                            let response = fence.answer_refused(refused, &req, started);
                            Ok(refusal(response, grpc))
                        }
                        Ok(None) => {
                            let response = inner.call(req).await?;
                            let answered = Counted {
                                fence,
                                route,
                                method,
                                outcome: Outcome::Admitted,
                                started,
                                ticket: None,
                            };
                            Ok(answered.finish(response))
                        }
                        Ok(Some(ticket)) => {
                            // The barrier's turn is held until this write has finished. A
                            // server that drops this future (its client went away) would drop
                            // the handler with it, mid-write perhaps, and open the barrier to
                            // the next token while the write may still be under way: the call
                            // runs in a task of its own, which keeps the ticket to its end.
                            let call = inner.call(req);
                            let task = tokio::spawn(async move { (call.await, ticket) });
                            let (response, ticket) = match task.await {
                                Ok(done) => done,
                                Err(e) => std::panic::resume_unwind(e.into_panic()),
                            };
                            let answered = Counted {
                                fence,
                                route,
                                method,
                                outcome: Outcome::Admitted,
                                started,
                                ticket: Some(ticket),
                            };
                            Ok(answered.finish(response?))
                        }
                    }
                }),
            },
        }
    }
}

/// What an admitted request's answer is counted under, and the barrier ticket its body keeps.
pub struct Counted {
    fence: Arc<Fence>,
    route: Option<usize>,
    method: http::Method,
    outcome: Outcome,
    started: Instant,
    ticket: Option<Ticket>,
}

impl Counted {
    fn finish<RB>(self, response: Response<RB>) -> Response<FenceBody<RB>> {
        let code = response.status().as_u16();
        let (route, outcome) = (self.route, self.outcome);
        self.fence
            .answered(route, outcome, &self.method, code, self.started);
        let ticket = self.ticket;
        response.map(|body| FenceBody::Inner {
            body,
            _ticket: ticket,
        })
    }
}

/// `req` with its path replaced by `normalised`, the one the fence decided on (its query
/// kept), so that the service routes the write the fence admitted as the sidecar would have
/// forwarded it. A path already normal (nearly every one) is left as it is.
fn with_path<B>(req: Request<B>, normalised: &str) -> Request<B> {
    if req.uri().path() == normalised {
        return req;
    }
    let (mut parts, body) = req.into_parts();
    let path_and_query = match parts.uri.query() {
        Some(query) => format!("{normalised}?{query}"),
        None => normalised.to_owned(),
    };
    let mut uri = parts.uri.clone().into_parts();
    // A normalised path keeps only bytes a path may hold as they are, and the query is the
    // one that came: both parse. Were one not to, the request stays as it came.
    if let Ok(path_and_query) = path_and_query.parse() {
        uri.path_and_query = Some(path_and_query);
        if let Ok(uri) = http::Uri::from_parts(uri) {
            parts.uri = uri;
        }
    }
    Request::from_parts(parts, body)
}

#[cfg(test)]
mod tests {
    use super::with_path;
    use http::Request;

    #[test]
    fn the_normalised_path_replaces_the_received_one_and_the_query_stays() {
        let to = |uri: &str, normalised: &str| {
            let req = Request::get(uri).body(()).unwrap();
            with_path(req, normalised).uri().to_string()
        };
        assert_eq!(
            to("/accounts/7/../42?mode=a", "/accounts/42"),
            "/accounts/42?mode=a"
        );
        assert_eq!(to("/accounts//42", "/accounts/42"), "/accounts/42");
        assert_eq!(
            to("http://ledger/accounts/./42?x", "/accounts/42"),
            "http://ledger/accounts/42?x"
        );
        assert_eq!(to("/accounts/42?y", "/accounts/42"), "/accounts/42?y");
    }
}

/// A refusal's response, in gRPC form for a gRPC call.
fn refusal<RB>(response: Response<ProxyBody>, grpc: bool) -> Response<FenceBody<RB>> {
    let response = if grpc {
        grpc::answer(response)
    } else {
        response
    };
    response.map(|body| match body {
        ProxyBody::Local(body) => FenceBody::Refusal { body },
        // Refusals are always written by fencegate itself.
        _ => FenceBody::Refusal {
            body: Full::default(),
        },
    })
}

pin_project_lite::pin_project! {
    /// [`FenceService`]'s future.
    // pin-project-lite takes no attribute on a field but `#[pin]`, so a field cannot have a
    // doc comment: each variant's doc says what its fields hold.
    #[allow(missing_docs)]
    #[project = ResponseFutureProj]
    pub enum ResponseFuture<F, RB, E> {
        /// Refused: answered without the inner service; `response` is the refusal, until
        /// polled.
        Refused { response: Option<Response<FenceBody<RB>>> },
        /// Let through at once: the inner service's answer (`future`), counted when it comes
        /// (`answered`).
        Inner { #[pin] future: F, answered: Option<Counted> },
        /// Waiting for the store, the authority or the barrier, then the inner service: all of
        /// it in `future`.
        Waiting {
            future: Pin<Box<dyn Future<Output = Result<Response<FenceBody<RB>>, E>> + Send>>,
        },
    }
}

impl<F, RB, E> Future for ResponseFuture<F, RB, E>
where
    F: Future<Output = Result<Response<RB>, E>>,
{
    type Output = Result<Response<FenceBody<RB>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            ResponseFutureProj::Refused { response } => {
                Poll::Ready(Ok(response.take().expect("polled after completion")))
            }
            ResponseFutureProj::Inner { future, answered } => {
                let response = std::task::ready!(future.poll(cx))?;
                let answered = answered.take().expect("polled after completion");
                Poll::Ready(Ok(answered.finish(response)))
            }
            ResponseFutureProj::Waiting { future } => future.as_mut().poll(cx),
        }
    }
}
