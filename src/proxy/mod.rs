//! The fence proxy: one request, start to finish.
//!
//! `normalise path → route match (resource id) → token parse → compare-and-raise → optional
//! barrier → forward (streaming) → metrics + log`. Every early exit is a [`Refusal`], turned
//! into a response in one place ([`Proxy::refuse`]), where it is also counted and logged.
//!
//! Along the request's way: [`Proxy::handle_on`] (here) checks what needs no waiting;
//! [`build`] makes a `Proxy`; [`decide`] is the fence decision (route, token, authority,
//! compare-and-raise, verdict, barrier), shared with the in-process [`crate::layer`]; [`idempotent`] handles writes with an `Idempotency-Key` and
//! [`recording`] records their outcome; [`forwarding`] sends and answers, over [`upstream`]
//! with [`headers`]' header surgery; [`problem`] answers refusals, in gRPC form for gRPC
//! calls ([`grpc`]); [`access`] writes the access log.

pub(crate) mod access;
mod build;
mod decide;
mod forwarding;
pub mod headers;
pub mod idempotent;
pub mod problem;
pub mod recording;
pub mod upstream;

pub use build::BuildError;
pub use problem::grpc;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::time::Instant;

use http::header::HeaderName;
use http::{Request, Response};
use hyper::body::Incoming;

use crate::body::ProxyBody;
use crate::config::{EqualTokens, IdempotencyConfig, Timeouts, UpstreamUrl};
use crate::fence::barrier::Barriers;
use crate::fence::routes::{Route, RouteTable};
use crate::lease::agent::Agent;
use crate::metrics::{Metrics, Outcome, RouteMetrics};
use crate::store::FenceStore;
use access::Subject;
pub(crate) use decide::{Decision, Fenced, Pass};
use forwarding::{set_token, Answering};
use upstream::UpstreamClient;

/// Everything a request needs, built once per configuration.
pub struct Proxy {
    table: RouteTable,
    token_header: HeaderName,
    equal: EqualTokens,
    /// `token.max_step` (`None`: off); applied in observed mode only ([`Proxy::rule`]).
    max_step: Option<u64>,
    /// What a fenced write's token is checked against, or where it comes from.
    check: Check,
    barriers: Arc<Barriers>,
    metrics: Arc<Metrics>,
    /// Per-route metric children, indexed like the route table; the last one is for requests
    /// on no route.
    route_metrics: Vec<RouteMetrics>,
    client: UpstreamClient,
    /// The pool for gRPC calls: HTTP/2 (prior knowledge for `http`, ALPN `h2` for `https`).
    grpc_client: UpstreamClient,
    /// Authoritative mode: the latest grant per resource, from the lease backend that issues
    /// tokens, cached from its grant events (and the highest grants seen, a lower bound that
    /// answers refusals without a round trip).
    authority: Option<Arc<crate::lease::grants::GrantCache>>,
    upstream: UpstreamUrl,
    /// `Host` for requests on a client connection's own upstream connection.
    upstream_host: http::HeaderValue,
    /// Kept to tell whether a reload may reuse the pooled client.
    upstream_ca: Option<std::path::PathBuf>,
    timeouts: Timeouts,
    /// The listener's scheme, for `X-Forwarded-Proto`.
    https: bool,
    /// Idempotency keys: the section, and per route (indexed like the table) whether it applies.
    idempotency: Option<IdempotencyConfig>,
    idempotent: Vec<bool>,
    /// `access_log`: one line per request (target `fencegate::access`).
    access_log: bool,
    /// `log.query`: how the access line writes a query.
    log_query: crate::config::LogQuery,
    /// The route names (indexed like the table) and the upstream's address, as access lines
    /// written after their response has gone keep them: shared, not copied per request.
    route_names: Vec<Arc<str>>,
    upstream_name: Arc<str>,
}

/// How a proxy fences writes.
#[derive(Clone)]
enum Check {
    /// Ingress: the request's token is compared with the highest seen, and raised, in the store.
    Store(Arc<dyn FenceStore>),
    /// Egress: the request carries no token; the token of the lease this sidecar holds on the
    /// resource is attached (docs/leases.md, `egress`), and without one the write is refused.
    Attach(Arc<Agent>),
}

/// A fenced write past its token check, on its way to the upstream: what the steps that may
/// wait before the send (idempotency claim, authority, barrier) and the send itself need
/// besides the request.
struct Write {
    /// Index of the route in the table.
    route: usize,
    resource: String,
    token: u64,
    /// The request's path, normalised: what the upstream is sent and the log lines name.
    normalised: String,
    peer: SocketAddr,
    /// The client connection's own upstream connection, when it keeps one.
    own: Option<upstream::SharedSlot>,
    /// When the request's head was handed to fencegate.
    started: Instant,
}

impl Write {
    /// What a refusal or a log line says the write is about.
    fn subject<'a>(&'a self, route: &'a Route) -> Subject<'a> {
        Subject {
            route: Some(&route.name),
            resource: Some(&self.resource),
            token: Some(self.token),
        }
    }
}

pin_project_lite::pin_project! {
    /// One request's handling, as the server awaits it (see [`Proxy::handle_on`]).
    #[project = HandlingProj]
    pub enum Handling<F> {
        /// Answered without waiting (a refusal).
        Done { response: Option<Response<ProxyBody>> },
        /// Sent upstream: waiting for the answer.
        Forwarding { #[pin] forwarding: F },
        /// Waiting before the send.
        Later { future: Pin<Box<dyn Future<Output = Response<ProxyBody>> + Send>> },
    }
}

impl<F> Handling<F> {
    fn done(response: Response<ProxyBody>) -> Self {
        Handling::Done {
            response: Some(response),
        }
    }
}

impl<F: Future<Output = Response<ProxyBody>>> Future for Handling<F> {
    type Output = Result<Response<ProxyBody>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            HandlingProj::Done { response } => {
                Poll::Ready(Ok(response.take().expect("polled after completion")))
            }
            HandlingProj::Forwarding { forwarding } => forwarding.poll(cx).map(Ok),
            HandlingProj::Later { future } => future.as_mut().poll(cx).map(Ok),
        }
    }
}

impl Proxy {
    /// The hyper service body: never fails, every problem becomes a response.
    pub fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> impl Future<Output = Result<Response<ProxyBody>, Infallible>> + Send + 'static {
        self.handle_on(req, peer, None)
    }

    /// [`Proxy::handle`], for a request of a client connection that keeps its own upstream
    /// connection in `own` (see [`upstream::ConnUpstream`]).
    ///
    /// Everything that needs no waiting happens here, when called: checks, refusals, the
    /// memory store's compare-and-raise and the send upstream. The returned future then holds
    /// only the exchange and what its answer needs. hyper moves a request's future several
    /// times, whole, and an `async fn` doing all of this would be about 2 KiB large. What has
    /// to wait before the send (an authority, an ordering barrier, a store that answers later,
    /// an idempotency key) continues in a boxed future.
    ///
    /// A refusal of a gRPC call is answered in gRPC form ([`grpc`]).
    pub fn handle_on(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: SocketAddr,
        own: Option<upstream::SharedSlot>,
    ) -> grpc::Answered<Handling<impl Future<Output = Response<ProxyBody>> + Send + 'static>> {
        let grpc = grpc::is_call(req.version(), req.headers());
        grpc::Answered::new(self.handling(req, peer, own), grpc)
    }

    /// [`Proxy::handle_on`], refusals in problem+json form: the fence's [`Decision`], then
    /// the send (or the wait before it).
    fn handling(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: SocketAddr,
        own: Option<upstream::SharedSlot>,
    ) -> Handling<impl Future<Output = Response<ProxyBody>> + Send + 'static> {
        // End to end: from here, where the request's head has been read, to the response's
        // head (`fencegate_request_duration_seconds`, the access log).
        let started = Instant::now();
        match self.decide(&req) {
            Decision::Refuse(refused) => {
                Handling::done(self.answer_refused(refused, &req, Some(peer), started))
            }
            Decision::Forward(Pass {
                normalised,
                route,
                fenced,
            }) => {
                let mut req = req;
                let answering = match fenced {
                    None => Answering::unfenced(route, Outcome::Forwarded, started),
                    Some(Fenced {
                        resource,
                        token,
                        attach,
                    }) => {
                        if attach {
                            let token = token.expect("an attached write has its lease's token");
                            set_token(req.headers_mut(), &self.token_header, token);
                        }
                        let outcome = if token.is_some() {
                            Outcome::Admitted
                        } else {
                            Outcome::Forwarded
                        };
                        let index = route.expect("a fenced request is on a route");
                        Answering::fenced(index, resource, token, outcome, started)
                    }
                };
                self.forwarding(req, normalised, answering, peer, own)
            }
            Decision::Later(later) => {
                let write = Write {
                    route: later.route,
                    resource: later.resource,
                    token: later.token,
                    normalised: later.normalised,
                    peer,
                    own,
                    started,
                };
                Handling::Later {
                    future: Box::pin(self.fence_later(req, write, later.key)),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// hyper moves each request's future whole, several times, so its size is kept in check:
    /// 920 bytes (in the test build) since the checks and the send happen before the future
    /// is made, which then holds only the exchange and what its answer needs (it was 2,048
    /// as one `async fn`, and 2,784 before the send moved out of the forwarding future).
    /// Waiting before the send, and connecting, are boxed apart for this.
    #[test]
    fn the_request_future_stays_under_one_kib() {
        fn future_size<A, B, C, D, Fut, F: FnOnce(A, B, C, D) -> Fut>(_: F) -> usize {
            std::mem::size_of::<Fut>()
        }
        let size = future_size(Proxy::handle_on);
        assert!(size <= 1024, "the request future grew to {size} bytes");
    }
}
