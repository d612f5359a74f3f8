//! The fence proxy: one request, start to finish.
//!
//! `normalise path → route match (resource id) → token parse → compare-and-raise → optional
//! barrier → forward (streaming) → metrics + log`. Every early exit is a [`Refusal`], turned
//! into a response in one place ([`Proxy::refuse`]), where it is also counted and logged.
//!
//! Along the request's way: [`Proxy::handle_on`] (here) checks what needs no waiting;
//! [`build`] makes a `Proxy`; [`decide`] is the fence decision (authority, compare-and-raise,
//! verdict, barrier); [`idempotent`] handles writes with an `Idempotency-Key` and
//! [`recording`] records their outcome; [`forwarding`] sends and answers, over [`upstream`]
//! with [`headers`]' header surgery; [`problem`] answers refusals, in gRPC form for gRPC
//! calls ([`grpc`]); [`access`] writes the access log.

mod access;
mod build;
mod decide;
mod forwarding;
pub mod headers;
pub mod idempotent;
pub mod problem;
pub mod recording;
pub mod upstream;

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
use crate::config::{
    EqualTokens, IdempotencyConfig, MissingToken, Ordering, Timeouts, Unmatched, UpstreamUrl,
};
use crate::fence::barrier::Barriers;
use crate::fence::method::method_override;
use crate::fence::path;
use crate::fence::routes::{Matched, Route, RouteTable};
use crate::fence::token::{connection_nominates, token_from_headers, TokenError};
use crate::lease::agent::Agent;
use crate::metrics::{Metrics, Outcome, RouteMetrics};
use crate::store::FenceStore;
use access::{Subject, Timing};
use forwarding::{set_token, Answering};
use problem::{host_problem, Refusal};
use upstream::UpstreamClient;

/// Everything a request needs, built once per configuration.
pub struct Proxy {
    table: RouteTable,
    token_header: HeaderName,
    equal: EqualTokens,
    store: Arc<dyn FenceStore>,
    barriers: Arc<Barriers>,
    metrics: Arc<Metrics>,
    /// Per-route metric children, indexed like the route table; the last one is for requests
    /// on no route.
    route_metrics: Vec<RouteMetrics>,
    client: UpstreamClient,
    /// The pool for gRPC calls: HTTP/2 (prior knowledge for `http`, ALPN `h2` for `https`).
    grpc_client: UpstreamClient,
    /// Egress mode: instead of checking the token against the store, attach the token of the
    /// lease this sidecar holds on the resource (docs/leases.md, `egress`).
    attach: Option<Arc<Agent>>,
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

    /// [`Proxy::handle_on`], refusals in problem+json form.
    fn handling(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: SocketAddr,
        own: Option<upstream::SharedSlot>,
    ) -> Handling<impl Future<Output = Response<ProxyBody>> + Send + 'static> {
        // End to end: from here, where the request's head has been read, to the response's
        // head (`fencegate_request_duration_seconds`, the access log).
        let started = Instant::now();
        // Every refusal is answered, counted and logged the same way, with the request's method
        // and path as it came.
        let refused = |refusal: Refusal, route: Option<&Route>, subject: Subject<'_>| {
            let (method, path) = (req.method(), req.uri().path());
            let timing = Timing::without_upstream(started);
            Handling::done(self.refuse(refusal, route, subject, method, path, timing))
        };
        if let Some(problem) = host_problem(&req) {
            return refused(
                Refusal::InvalidRequest(problem.into()),
                None,
                Subject::default(),
            );
        }
        let normalised = match path::normalise(req.uri().path()) {
            Ok(p) => p.into_owned(),
            Err(e) => return refused(Refusal::InvalidPath(e), None, Subject::default()),
        };
        let matched =
            self.table
                .lookup(req.method(), &normalised, req.uri().query(), req.headers());
        // A method override header makes many frameworks treat the request as the method it
        // names: on a route, the request is fenced as that method when that method is fenced
        // (and as its own otherwise), and a malformed or repeated override is refused.
        let matched = match matched {
            Ok(found @ (Matched::Pass(route) | Matched::Fence { route, .. })) => {
                match method_override(req.headers()) {
                    Ok(None) => Ok(found),
                    Ok(Some(named)) => {
                        let query = req.uri().query();
                        match self.table.lookup(&named, &normalised, query, req.headers()) {
                            fenced @ (Ok(Matched::Fence { .. }) | Err(_)) => fenced,
                            Ok(_) => Ok(found),
                        }
                    }
                    Err(e) => {
                        let subject = Subject {
                            route: Some(&route.name),
                            ..Subject::default()
                        };
                        let refusal = Refusal::InvalidRequest(e.to_string());
                        return refused(refusal, Some(route), subject);
                    }
                }
            }
            other => other,
        };
        let (route, resource) = match matched {
            Err((route, e)) => {
                let subject = Subject {
                    route: route.map(|r| r.name.as_str()),
                    ..Subject::default()
                };
                return refused(Refusal::InvalidResource(e), route, subject);
            }
            Ok(Matched::None) if self.table.unmatched == Unmatched::Reject => {
                return refused(Refusal::NoRoute, None, Subject::default())
            }
            Ok(Matched::None) => {
                let answering = Answering::unfenced(None, Outcome::Forwarded, started);
                return self.forwarding(req, normalised, answering, peer, own);
            }
            Ok(Matched::Pass(route)) => {
                let answering = Answering::unfenced(Some(route.index), Outcome::Forwarded, started);
                return self.forwarding(req, normalised, answering, peer, own);
            }
            Ok(Matched::Fence { route, resource }) => (route, resource),
        };
        let index = route.index;
        let subject = Subject {
            route: Some(&route.name),
            resource: Some(&resource),
            token: None,
        };
        if let Some(agent) = &self.attach {
            // Hop-by-hop headers go before the send: a token header the app nominated in
            // `Connection` would go with them, and the write would leave without a token.
            if connection_nominates(req.headers(), &self.token_header) {
                let refusal = Refusal::InvalidToken(TokenError::ConnectionNominated);
                return refused(refusal, Some(route), subject);
            }
            let Some(token) = agent.token_for(&resource) else {
                return refused(Refusal::LeaseNotHeld, Some(route), subject);
            };
            let mut req = req;
            set_token(req.headers_mut(), &self.token_header, token);
            let answering =
                Answering::fenced(index, resource, Some(token), Outcome::Admitted, started);
            return self.forwarding(req, normalised, answering, peer, own);
        }
        let token = match token_from_headers(req.headers(), &self.token_header) {
            Err(e) => return refused(Refusal::InvalidToken(e), Some(route), subject),
            Ok(None) if route.missing_token == MissingToken::Allow => {
                let answering =
                    Answering::fenced(index, resource, None, Outcome::Forwarded, started);
                return self.forwarding(req, normalised, answering, peer, own);
            }
            Ok(None) => return refused(Refusal::TokenRequired, Some(route), subject),
            Ok(Some(token)) => token,
        };
        let subject = Subject {
            token: Some(token),
            ..subject
        };
        let key = match (&self.idempotency, self.idempotent[index]) {
            (Some(settings), true) => {
                match idempotent::key_from_headers(req.headers(), &settings.header.0) {
                    Ok(key) => key,
                    Err(e) => {
                        return refused(Refusal::InvalidIdempotencyKey(e), Some(route), subject)
                    }
                }
            }
            _ => None,
        };
        // The common case decides here: no key, no authority, no barrier, and a store that
        // answers at once.
        let at_once = match (&key, &self.authority, route.ordering) {
            (None, None, Ordering::None) => self.raise_at_once(&resource, token),
            _ => None,
        };
        let Some(answer) = at_once else {
            let write = Write {
                route: index,
                resource,
                token,
                normalised,
                peer,
                own,
                started,
            };
            return Handling::Later {
                future: Box::pin(self.fence_later(req, write, key)),
            };
        };
        if let Err(refusal) = self.on_verdict(route, token, answer) {
            return refused(refusal, Some(route), subject);
        }
        let answering = Answering::fenced(index, resource, Some(token), Outcome::Admitted, started);
        self.forwarding(req, normalised, answering, peer, own)
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
