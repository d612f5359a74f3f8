//! The fence proxy: one request, start to finish.
//!
//! `normalise path → route match (resource id) → token parse → compare-and-raise → optional
//! barrier → forward (streaming) → metrics + log`. Every early exit is a [`Refusal`], turned
//! into a response in one place (`Fence::refuse`), where it is also counted and logged.
//!
//! A `Proxy` is a [`Fence`] (the decision, shared with the in-process [`crate::layer`]) in
//! front of an upstream. Along the request's way: [`Proxy::handle_on`] (here) asks the fence
//! for its `Decision` and acts on it; `build` makes a `Proxy`; [`idempotent`] handles
//! writes with an `Idempotency-Key` (claimed by the fence, `crate::fence::keyed`, their
//! outcome recorded by [`crate::idempotency::recording`]); `forwarding`
//! sends and answers, over [`upstream`] with [`crate::headers`]' header surgery; refusals are
//! answered by the fence, in gRPC form for gRPC calls ([`grpc`]); `access` writes the
//! access log.

pub(crate) mod access;
mod build;
mod forwarding;
pub mod idempotent;

pub mod upstream;

use crate::fence::resource::ResourceId;
use crate::fence::token::Token;
pub use build::BuildError;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::time::Instant;

use http::{Request, Response};
use hyper::body::Incoming;

use http::Method;

use crate::body::ProxyBody;
use crate::config::{Timeouts, UpstreamUrl};
use crate::fault::Fault;
use crate::fence::routes::Route;
use crate::fence::{Decision, Fence, Fenced, Pass, Refused};
use crate::metrics::Outcome;
use crate::problem::grpc;
use crate::problem::refusal::{Refusal, Subject};
use access::{log_access, sent_bytes, Access, Head, Received, Timing};
use forwarding::{set_token, Answering};
use upstream::UpstreamClient;

/// A [`Fence`] in front of an upstream: what a request needs besides the fence's decision,
/// built once per configuration.
pub struct Proxy {
    /// The decision: routes, token rules, store or lease agent, barriers, authority, metrics.
    pub(crate) fence: Arc<Fence>,
    client: UpstreamClient,
    /// The pool for gRPC calls: HTTP/2 (prior knowledge for `http`, ALPN `h2` for `https`).
    grpc_client: UpstreamClient,
    upstream: UpstreamUrl,
    /// `Host` for requests on a client connection's own upstream connection.
    upstream_host: http::HeaderValue,
    /// Kept to tell whether a reload may reuse the pooled client.
    upstream_ca: Option<std::path::PathBuf>,
    timeouts: Timeouts,
    /// The listener's scheme, for `X-Forwarded-Proto`.
    https: bool,
    /// `access_log`: one line per request (target `fencegate::access`).
    access_log: bool,
    /// `log.query`: how the access line writes a query.
    log_query: crate::config::LogQuery,
    /// The route names (indexed like the table) and the upstream's address, as access lines
    /// written after their response has gone keep them: shared, not copied per request.
    route_names: Vec<Arc<str>>,
    upstream_name: Arc<str>,
}

/// A fenced write past its token check, on its way to the upstream: what the steps that may
/// wait before the send (idempotency claim, authority, barrier) and the send itself need
/// besides the request.
struct Write {
    /// Index of the route in the table.
    route: usize,
    resource: ResourceId,
    token: Token,
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
        match self.fence.decide(&req) {
            Decision::Refuse(refused) => {
                Handling::done(self.answer_refused(refused, &req, peer, started))
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
                            set_token(req.headers_mut(), &self.fence.token_header, token);
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

impl Proxy {
    /// A request [`Fence::decide`] refused: counted, logged and answered as the fence does
    /// ([`Fence::refuse`]), and written to the access log.
    fn answer_refused(
        &self,
        refused: Refused,
        req: &Request<Incoming>,
        peer: SocketAddr,
        started: Instant,
    ) -> Response<ProxyBody> {
        let (refusal, route, subject) = refused.parts(&self.fence);
        self.refuse_request(refusal, route, subject, req, peer, started)
    }

    /// [`Proxy::refuse`] for a request refused before anything was sent: its method and path
    /// as it came, its access line made from its head.
    fn refuse_request(
        &self,
        refusal: &Refusal,
        route: Option<&Route>,
        subject: Subject<'_>,
        req: &Request<Incoming>,
        peer: SocketAddr,
        started: Instant,
    ) -> Response<ProxyBody> {
        let (method, path) = (req.method(), req.uri().path());
        let head = self
            .access_log
            .then(|| Head::of(req, Some(peer.ip()), self.log_query));
        let timing = Timing::without_upstream(started).head(head.as_deref());
        self.refuse(refusal, route, subject, method, path, timing)
    }

    /// [`Fence::refuse`] (counted, logged, answered), and the access line.
    fn refuse(
        &self,
        refusal: &Refusal,
        route: Option<&Route>,
        subject: Subject<'_>,
        method: &Method,
        path: &str,
        timing: Timing<'_>,
    ) -> Response<ProxyBody> {
        let (outcome, kind) = (refusal.outcome(), refusal.kind());
        let upstream_failed = refusal.fault() == Fault::Upstream;
        let response = self
            .fence
            .refuse(refusal, route, subject, method, path, timing.took());
        if self.access_log {
            let problem_len = http_body::Body::size_hint(response.body()).lower();
            log_access(Access {
                subject,
                method,
                path,
                status: kind.status.as_u16(),
                outcome,
                problem: Some(kind.urn),
                timing,
                bytes_out: sent_bytes(method, problem_len),
                upstream: upstream_failed.then_some(self.upstream.authority.as_str()),
            });
        }
        response
    }

    /// The rest of a fenced write that has to wait before its send: an idempotency key, an
    /// authority, an ordering barrier, or a store that answers later.
    async fn fence_later(
        self: Arc<Self>,
        req: Request<Incoming>,
        write: Write,
        key: Option<crate::fence::Key>,
    ) -> Response<ProxyBody> {
        let route = self.fence.route(write.route);
        if let Some(key) = key {
            return self.idempotent_write(req, write, key).await;
        }
        let ticket = match self.fence.admit(route, &write.resource, write.token).await {
            Ok(ticket) => ticket,
            Err(refusal) => {
                let subject = write.subject(route);
                let (peer, started) = (write.peer, write.started);
                return self.refuse_request(&refusal, Some(route), subject, &req, peer, started);
            }
        };
        match ticket {
            None => {
                let Write {
                    route: index,
                    resource,
                    token,
                    normalised,
                    peer,
                    own,
                    started,
                } = write;
                let answering =
                    Answering::fenced(index, resource, Some(token), Outcome::Admitted, started);
                let forwarded = Arc::clone(&self).forwarding(req, normalised, answering, peer, own);
                forwarded.await.unwrap_or_else(|never| match never {})
            }
            ticket => {
                let req = req.map(|body| http_body_util::Either::Left(Received::new(body, None)));
                self.forward_held(req, write, ticket, None, None).await
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
