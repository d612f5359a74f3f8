//! The fence proxy: one request, start to finish.
//!
//! `normalise path → route match (resource id) → token parse → compare-and-raise → optional
//! barrier → forward (streaming) → metrics + log`. Every early exit is a [`Refusal`], turned
//! into a response in one place ([`Proxy::refuse`]), where it is also counted and logged.

pub mod body;
pub mod headers;
pub mod idempotent;
pub mod problem;
pub mod upstream;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use http::header::HeaderName;
use http::uri::PathAndQuery;
use http::{Method, Request, Response, Uri, Version};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::config::{
    Config, EgressConfig, EqualTokens, IdempotencyConfig, MissingToken, Ordering, RouteConfig,
    Timeouts, Unmatched, UpstreamUrl,
};
use crate::fence::barrier::{Barriers, Ticket};
use crate::fence::method::method_override;
use crate::fence::path;
use crate::fence::routes::{Matched, Route, RouteTable};
use crate::fence::token::{connection_nominates, token_from_headers, TokenError};
use crate::lease::agent::Agent;
use crate::lease::LeaseBackend;
use crate::metrics::{Metrics, Outcome, RouteMetrics, UNMATCHED};
use crate::store::{FenceStore, StoreError, Verdict};
use body::ProxyBody;
use idempotent::{Attempt, UpstreamBody};
use problem::{Refusal, Subject};
use upstream::Failed;

pub type UpstreamClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, UpstreamBody>;

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

/// What answering a forwarded request needs besides the upstream's answer.
struct Answer<'a> {
    route: Option<&'a Route>,
    subject: Subject<'a>,
    outcome: Outcome,
    method: &'a Method,
    normalised: &'a str,
    /// The path as received, for the access log, when it is on and normalising changed it.
    received: Option<&'a str>,
    started: Instant,
}

/// What a forwarded request's answer is counted and logged under, owned by its future.
struct Answering {
    /// Index of the route in the table; `None` for a request on no route.
    route: Option<usize>,
    resource: Option<String>,
    token: Option<u64>,
    outcome: Outcome,
    /// When the request's head was handed to fencegate.
    started: Instant,
    /// The path as received, kept only for the access log and only when normalising changed it.
    received: Option<Box<str>>,
}

impl Answering {
    fn unfenced(route: Option<usize>, outcome: Outcome, started: Instant) -> Self {
        Answering {
            route,
            resource: None,
            token: None,
            outcome,
            started,
            received: None,
        }
    }

    fn fenced(
        route: usize,
        resource: String,
        token: Option<u64>,
        outcome: Outcome,
        started: Instant,
    ) -> Self {
        Answering {
            route: Some(route),
            resource: Some(resource),
            token,
            outcome,
            started,
            received: None,
        }
    }

    fn subject<'a>(&'a self, route: Option<&'a Route>) -> Subject<'a> {
        Subject {
            route: route.map(|r| r.name.as_str()),
            resource: self.resource.as_deref(),
            token: self.token,
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
    pub fn new(
        config: &Config,
        store: Arc<dyn FenceStore>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, String> {
        let client = upstream_client(config.upstream_ca.as_deref(), config.timeouts.upstream)?;
        Ok(Self::build(config, store, Barriers::new(), metrics, client))
    }

    /// Checks tokens against the lease backend too (`fence.authority: leases`).
    pub fn with_authority(mut self, backend: Arc<dyn LeaseBackend>) -> Self {
        self.authority = Some(Arc::new(crate::lease::grants::GrantCache::new(
            backend, 100_000,
        )));
        self
    }

    /// The egress proxy: app → fencegate → `egress.upstream`, with the held lease's token
    /// attached to writes on egress routes, and writes without a valid lease refused (503).
    pub fn egress(
        config: &Config,
        egress: &EgressConfig,
        agent: Arc<Agent>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, String> {
        let routes: Vec<RouteConfig> = egress
            .routes
            .iter()
            .enumerate()
            .map(|(i, r)| RouteConfig {
                name: format!("egress[{i}]"),
                path: r.path.clone(),
                methods: r.methods.clone(),
                resource: Some(r.lease.clone()),
                missing_token: MissingToken::Reject,
                ordering: Ordering::None,
                barrier_timeout: std::time::Duration::ZERO,
                fence: true,
                idempotency: None,
            })
            .collect();
        let mut egress_config = config.clone();
        egress_config.routes = routes;
        egress_config.upstream = egress.upstream.clone();
        egress_config.unmatched = Unmatched::Forward;
        egress_config.tls = None;
        egress_config.idempotency = None;
        let client = upstream_client(config.upstream_ca.as_deref(), config.timeouts.upstream)?;
        // The store is never consulted in egress mode; a memory store keeps the type simple.
        let store: Arc<dyn FenceStore> = Arc::new(crate::store::MemoryStore::new());
        let mut proxy = Self::build(&egress_config, store, Barriers::new(), metrics, client);
        proxy.attach = Some(agent);
        Ok(proxy)
    }

    /// A proxy for a reloaded config: same store, barriers and metrics (maxima and in-flight
    /// writes carry over), same connection pool when the upstream did not change.
    pub fn reconfigure(&self, config: &Config) -> Result<Self, String> {
        let client = if config.upstream == self.upstream && config.upstream_ca == self.upstream_ca {
            self.client.clone()
        } else {
            upstream_client(config.upstream_ca.as_deref(), config.timeouts.upstream)?
        };
        let mut proxy = Self::build(
            config,
            Arc::clone(&self.store),
            Arc::clone(&self.barriers),
            Arc::clone(&self.metrics),
            client,
        );
        // Fencing against leases is part of the running process, not of the reloadable part:
        // a reload never turns it off (nor on: that needs a restart, and the log says so).
        proxy.attach = self.attach.clone();
        proxy.authority = self.authority.clone();
        Ok(proxy)
    }

    fn build(
        config: &Config,
        store: Arc<dyn FenceStore>,
        barriers: Arc<Barriers>,
        metrics: Arc<Metrics>,
        client: UpstreamClient,
    ) -> Self {
        let table = RouteTable::new(
            &config.routes,
            config.unmatched,
            config.limits.max_resource_bytes,
        );
        let mut route_metrics: Vec<RouteMetrics> = table
            .routes()
            .iter()
            .map(|r| metrics.route(&r.name))
            .collect();
        route_metrics.push(metrics.route(UNMATCHED));
        Proxy {
            table,
            token_header: config.token.header.0.clone(),
            equal: config.token.equal,
            store,
            barriers,
            metrics,
            route_metrics,
            client,
            attach: None,
            authority: None,
            upstream: config.upstream.clone(),
            upstream_host: http::HeaderValue::from_str(config.upstream.authority.as_str())
                .expect("an authority is a valid header value"),
            upstream_ca: config.upstream_ca.clone(),
            timeouts: config.timeouts.clone(),
            https: config.tls.is_some(),
            idempotency: config.idempotency.clone(),
            idempotent: config
                .routes
                .iter()
                .map(|r| r.idempotent(config.idempotency.as_ref()))
                .collect(),
            access_log: config.access_log,
        }
    }

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
    pub fn handle_on(
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
            return Handling::Later {
                future: Box::pin(self.fence_later(
                    req, normalised, index, resource, token, key, peer, own, started,
                )),
            };
        };
        if let Err(refusal) = self.on_verdict(route, token, answer) {
            return refused(refusal, Some(route), subject);
        }
        let answering = Answering::fenced(index, resource, Some(token), Outcome::Admitted, started);
        self.forwarding(req, normalised, answering, peer, own)
    }

    /// The rest of a fenced write that has to wait before its send: an idempotency key, an
    /// authority, an ordering barrier, or a store that answers later.
    #[allow(clippy::too_many_arguments)]
    async fn fence_later(
        self: Arc<Self>,
        req: Request<Incoming>,
        normalised: String,
        index: usize,
        resource: String,
        token: u64,
        key: Option<String>,
        peer: SocketAddr,
        own: Option<upstream::SharedSlot>,
        started: Instant,
    ) -> Response<ProxyBody> {
        let route = &self.table.routes()[index];
        let subject = Subject {
            route: Some(&route.name),
            resource: Some(&resource),
            token: Some(token),
        };
        if let Some(key) = key {
            return self
                .idempotent_write(
                    req,
                    &normalised,
                    route,
                    &resource,
                    key,
                    subject,
                    peer,
                    own,
                    started,
                )
                .await;
        }
        // Authority, then the barrier's turn for this token taken, the raise, the wait for
        // that turn, and the authority again: any of them may refuse the write.
        let admitted = async {
            if let Some(refusal) = self.check_authority(&resource, token).await {
                return Err(refusal);
            }
            let ticket = (route.ordering == Ordering::Serialize)
                .then(|| self.barriers.enter(&resource, token));
            self.on_verdict(route, token, self.check(&resource, token).await)?;
            if let Some(ticket) = &ticket {
                let turn = ticket.wait_turn(route.barrier_timeout).await;
                turn.map_err(|_| Refusal::BarrierTimeout)?;
            }
            // The lease may have passed on while the raise (or the turn) was awaited: the
            // authority is asked again, the last thing before the send.
            if let Some(refusal) = self.check_authority(&resource, token).await {
                return Err(refusal);
            }
            Ok(ticket)
        };
        let ticket = match admitted.await {
            Ok(ticket) => ticket,
            Err(refusal) => {
                let (method, path) = (req.method(), req.uri().path());
                let timing = Timing::without_upstream(started);
                return self.refuse(refusal, Some(route), subject, method, path, timing);
            }
        };
        match ticket {
            None => {
                let answering =
                    Answering::fenced(index, resource, Some(token), Outcome::Admitted, started);
                let forwarded = Arc::clone(&self).forwarding(req, normalised, answering, peer, own);
                forwarded.await.unwrap_or_else(|never| match never {})
            }
            ticket => {
                self.forward_held(
                    req.map(http_body_util::Either::Left),
                    &normalised,
                    route,
                    subject,
                    ticket,
                    peer,
                    None,
                    own,
                    started,
                )
                .await
            }
        }
    }

    /// Counts a store's verdict on an admitted write, and turns the others into refusals.
    fn on_verdict(
        &self,
        route: &Route,
        token: u64,
        answer: Result<Verdict, StoreError>,
    ) -> Result<(), Refusal> {
        match answer {
            Ok(verdict @ Verdict::Admitted { .. }) => {
                if verdict.raised(token) {
                    self.route_metrics[route.index].increments.inc();
                }
                Ok(())
            }
            Ok(Verdict::Stale { current }) => {
                self.route_metrics[route.index].stale.inc();
                Err(Refusal::Stale { current })
            }
            Err(StoreError::Unavailable(e)) => Err(Refusal::StoreUnavailable(e)),
        }
    }

    /// Authoritative fencing: the token must be the latest grant's. Older is stale even if the
    /// newer holder has not written yet; newer was never issued. Refusals of tokens below a
    /// grant seen before need no round trip; everything else asks the grant cache, which
    /// answers from the backend's grant events while subscribed and asks the backend
    /// otherwise; a backend that does not answer refuses the write (fail closed).
    async fn check_authority(&self, resource: &str, token: u64) -> Option<Refusal> {
        let grants = self.authority.as_ref()?;
        if let Some(floor) = grants.floor(resource) {
            if token < floor {
                return Some(Refusal::Superseded { latest: floor });
            }
        }
        let latest = tokio::time::timeout(self.timeouts.store, grants.latest(resource)).await;
        match latest {
            Ok(Ok(Some(latest))) => match token.cmp(&latest) {
                std::cmp::Ordering::Less => Some(Refusal::Superseded { latest }),
                std::cmp::Ordering::Greater => Some(Refusal::Unissued {
                    latest: Some(latest),
                }),
                std::cmp::Ordering::Equal => None,
            },
            Ok(Ok(None)) => Some(Refusal::Unissued { latest: None }),
            Ok(Err(e)) => {
                self.metrics.store_errors.inc();
                Some(Refusal::StoreUnavailable(e.to_string()))
            }
            Err(_) => {
                self.metrics.store_errors.inc();
                Some(Refusal::StoreUnavailable(format!(
                    "the lease backend did not answer within {}",
                    crate::duration::display(self.timeouts.store)
                )))
            }
        }
    }

    /// Compare-and-raise, bounded by the store timeout; a late answer counts as no answer.
    async fn check(&self, resource: &str, token: u64) -> Result<Verdict, StoreError> {
        if let Some(answer) = self.raise_at_once(resource, token) {
            return answer;
        }
        let started = Instant::now();
        let answer = bounded(
            self.timeouts.store,
            self.store.compare_and_raise(resource, token, self.equal),
        )
        .await;
        self.observe_store(started, &answer);
        answer
    }

    /// The compare-and-raise of a store that answers at once (see
    /// [`FenceStore::raise_at_once`]), timed and counted as [`Proxy::check`] does.
    fn raise_at_once(&self, resource: &str, token: u64) -> Option<Result<Verdict, StoreError>> {
        let started = Instant::now();
        let answer = self.store.raise_at_once(resource, token, self.equal)?;
        self.observe_store(started, &answer);
        Some(answer)
    }

    fn observe_store(&self, started: Instant, answer: &Result<Verdict, StoreError>) {
        self.metrics
            .store_raise
            .observe(started.elapsed().as_secs_f64());
        if answer.is_err() {
            self.metrics.store_errors.inc();
        }
    }

    /// Sends the request upstream and answers with the upstream's response (or the refusal
    /// that says why there is none).
    ///
    /// Everything up to the send happens here, when called: the returned future holds only
    /// the exchange and what the answer needs (route, resource and token for metrics and the
    /// log), not the request. A write that must outlive its client goes through
    /// [`Proxy::forward_held`].
    fn forwarding(
        self: Arc<Self>,
        req: Request<Incoming>,
        normalised: String,
        answering: Answering,
        peer: SocketAddr,
        own: Option<upstream::SharedSlot>,
    ) -> Handling<impl Future<Output = Response<ProxyBody>> + Send + 'static> {
        let method = req.method().clone();
        let mut answering = answering;
        if self.access_log && req.uri().path() != normalised {
            answering.received = Some(req.uri().path().into());
        }
        let req = req.map(http_body_util::Either::Left);
        let (exchange, sent_at) = match self.send(req, &normalised, true, peer, own) {
            Ok(sending) => sending,
            Err(e) => {
                let route = answering.route.map(|i| &self.table.routes()[i]);
                let subject = answering.subject(route);
                let refusal = Refusal::InvalidPath(e);
                let timing = Timing::without_upstream(answering.started)
                    .received(answering.received.as_deref());
                return Handling::done(self.refuse(
                    refusal,
                    route,
                    subject,
                    &method,
                    &normalised,
                    timing,
                ));
            }
        };
        // Only what is needed after the answer lives across the wait.
        Handling::Forwarding {
            forwarding: async move {
                let sent = exchange.await;
                let ended = Instant::now();
                let route = answering.route.map(|i| &self.table.routes()[i]);
                let answer = Answer {
                    route,
                    subject: answering.subject(route),
                    outcome: answering.outcome,
                    method: &method,
                    normalised: &normalised,
                    received: answering.received.as_deref(),
                    started: answering.started,
                };
                self.answer(answer, ended - sent_at, ended, pass_on(sent, None))
            },
        }
    }

    /// [`Proxy::forwarding`] for a write that holds a barrier ticket or an idempotency claim.
    /// These must outlive the client: if it hangs up while the write is with the upstream,
    /// the ticket is held (and the outcome recorded) until the upstream has answered, not
    /// dropped with the request. The answer is settled before it is handed over: the
    /// response's body then holds the ticket and records the outcome when read to the end,
    /// and drains and records in the background when dropped unread, whether by the server
    /// (the client is gone) or with the channel (the client went away before, or even after,
    /// the send).
    #[allow(clippy::too_many_arguments)]
    async fn forward_held(
        &self,
        req: Request<UpstreamBody>,
        normalised: &str,
        route: &Route,
        subject: Subject<'_>,
        ticket: Option<Ticket>,
        peer: SocketAddr,
        attempt: Option<Attempt>,
        own: Option<upstream::SharedSlot>,
        started: Instant,
    ) -> Response<ProxyBody> {
        let method = req.method().clone();
        let route = Some(route);
        // The request is still as received here (`send` rewrites its URI).
        let received = (self.access_log && req.uri().path() != normalised)
            .then(|| req.uri().path().to_owned());
        let (exchange, sent_at) = match self.send(req, normalised, false, peer, own) {
            Ok(sending) => sending,
            Err(e) => {
                if let Some(attempt) = attempt {
                    // Claimed but never sent: a retry may execute it.
                    attempt.unknown().await;
                }
                let refusal = Refusal::InvalidPath(e);
                let timing = Timing::without_upstream(started).received(received.as_deref());
                return self.refuse(refusal, route, subject, &method, normalised, timing);
            }
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let sent = exchange.await;
            let answered = Instant::now();
            let _ = tx.send((answered, settle(sent, ticket, attempt).await));
        });
        let answer = Answer {
            route,
            subject,
            outcome: Outcome::Admitted,
            method: &method,
            normalised,
            received: received.as_deref(),
            started,
        };
        match rx.await {
            // Settling may have waited (an idempotency record written): the request ends now.
            Ok((answered, settled)) => {
                self.answer(answer, answered - sent_at, Instant::now(), settled)
            }
            Err(_) => {
                let refusal = Refusal::UpstreamError("the upstream exchange failed".into());
                let timing = Timing::without_upstream(started).received(received.as_deref());
                self.refuse(refusal, route, subject, &method, normalised, timing)
            }
        }
    }

    /// The response to a forwarded request, counted: the upstream's, or the refusal that says
    /// why there is none.
    fn answer(
        &self,
        answer: Answer<'_>,
        took: Duration,
        ended: Instant,
        settled: Result<Response<ProxyBody>, Failed>,
    ) -> Response<ProxyBody> {
        let metrics = self.metrics_for(answer.route);
        metrics.upstream.observe(took.as_secs_f64());
        let timing = Timing {
            started: answer.started,
            ended,
            upstream: Some(took),
            received: answer.received,
        };
        let refusal = match settled {
            Ok(response) => {
                metrics.finish(answer.outcome, timing.took());
                if self.access_log {
                    log_access(Access {
                        subject: answer.subject,
                        method: answer.method,
                        path: answer.received.unwrap_or(answer.normalised),
                        status: response.status().as_u16(),
                        outcome: answer.outcome,
                        problem: None,
                        timing,
                    });
                }
                return response;
            }
            Err(Failed::Upstream(e)) if request_body_failed(&e) => {
                Refusal::InvalidRequest(format!(
                    "the request body was malformed or cut short ({}); the upstream got an \
                     incomplete request",
                    error_chain(e.as_ref())
                ))
            }
            Err(Failed::Upstream(e)) => Refusal::UpstreamError(error_chain(e.as_ref())),
            Err(Failed::Timeout) => Refusal::UpstreamTimeout,
        };
        self.refuse(
            refusal,
            answer.route,
            answer.subject,
            answer.method,
            answer.normalised,
            timing,
        )
    }

    /// The request, made ready for the upstream (URI, forwarding headers, HTTP/1.1) and sent;
    /// the exchange and when it started. `may_own`: whether the exchange may use the client
    /// connection's own upstream connection (see below).
    fn send(
        &self,
        req: Request<UpstreamBody>,
        normalised: &str,
        may_own: bool,
        peer: SocketAddr,
        own: Option<upstream::SharedSlot>,
    ) -> Result<
        (
            impl Future<Output = upstream::Sent> + Send + 'static,
            tokio::time::Instant,
        ),
        path::PathError,
    > {
        let (mut parts, body) = req.into_parts();
        let forwarded_for = match &own {
            Some(slot) => slot.forwarded_for(peer.ip()),
            None => headers::peer_value(peer.ip()),
        };
        // The client connection's own upstream connection serves HTTP/1 clients of a plain
        // upstream; HTTP/2 clients (concurrent streams) and https upstreams use the pool, and
        // so do exchanges that must outlive their client (a barrier ticket or an idempotency
        // claim): the pool keeps their connection until the response has been read, whoever
        // reads it.
        let via = match own {
            Some(slot)
                if may_own && parts.version <= Version::HTTP_11 && !self.upstream.is_https() =>
            {
                upstream::Route::Own(slot, self.upstream.authority.clone())
            }
            _ => upstream::Route::Pool,
        };
        let absolute = matches!(via, upstream::Route::Pool);
        // On its own connection the request carries the upstream's `Host`; the pool sets it
        // from the absolute URI.
        let upstream_host = (!absolute).then(|| self.upstream_host.clone());
        let uri = self.upstream_uri(normalised, &parts.uri, absolute)?;
        // Borrowed from the URI (a field apart from the headers): no copy of the authority.
        headers::request_headers(
            &mut parts.headers,
            forwarded_for,
            self.https,
            parts.uri.authority().map(|a| a.as_str()),
            upstream_host,
        );
        parts.uri = uri;
        // The upstream connection is HTTP/1.1 whatever the client spoke.
        parts.version = Version::HTTP_11;
        // tokio's clock: the upstream deadline is a tokio timer's.
        let started = tokio::time::Instant::now();
        let exchange = upstream::send(
            &self.client,
            via,
            started + self.timeouts.upstream,
            Request::from_parts(parts, body),
        );
        Ok((exchange, started))
    }

    /// The upstream URI: the normalised path and the original query, after the upstream's scheme
    /// and authority when `absolute` (the pool wants those; a connection of our own does not).
    /// When normalising changed nothing (the common case) the request's own path-and-query is
    /// reused instead of being formatted and parsed again.
    fn upstream_uri(
        &self,
        path: &str,
        original: &Uri,
        absolute: bool,
    ) -> Result<Uri, path::PathError> {
        let query = original.query();
        let unchanged = original
            .path_and_query()
            .filter(|pq| pq.path() == path)
            .cloned();
        let path_and_query = match (unchanged, query) {
            (Some(pq), _) => Ok(pq),
            (None, Some(q)) => PathAndQuery::try_from(format!("{path}?{q}")),
            (None, None) => PathAndQuery::try_from(path),
        }
        .map_err(|_| path::PathError::Control)?;
        if !absolute {
            return Ok(Uri::from(path_and_query));
        }
        Uri::builder()
            .scheme(self.upstream.scheme.clone())
            .authority(self.upstream.authority.clone())
            .path_and_query(path_and_query)
            .build()
            .map_err(|_| path::PathError::Control)
    }

    fn metrics_for(&self, route: Option<&Route>) -> &RouteMetrics {
        let index = route.map_or(self.route_metrics.len() - 1, |r| r.index);
        &self.route_metrics[index]
    }

    /// Counts, logs (one line per refusal, and the access line) and answers.
    fn refuse(
        &self,
        refusal: Refusal,
        route: Option<&Route>,
        subject: Subject<'_>,
        method: &Method,
        path: &str,
        timing: Timing<'_>,
    ) -> Response<ProxyBody> {
        let (status, kind, _, outcome) = refusal.kind();
        self.metrics_for(route).finish(outcome, timing.took());
        let current_token = match refusal {
            Refusal::Stale { current } | Refusal::Superseded { latest: current } => Some(current),
            Refusal::Unissued { latest } => latest,
            _ => None,
        };
        tracing::warn!(
            route = subject.route,
            %method,
            path,
            resource = subject.resource,
            fencing_token = subject.token,
            current_token,
            status = status.as_u16(),
            r#type = kind,
            detail = refusal.detail(&subject, &self.token_header),
            "{}",
            if outcome == Outcome::UpstreamError || outcome == Outcome::UpstreamTimeout {
                "upstream failed"
            } else {
                "write refused"
            }
        );
        if self.access_log {
            log_access(Access {
                subject,
                method,
                path: timing.received.unwrap_or(path),
                status: status.as_u16(),
                outcome,
                problem: Some(kind),
                timing,
            });
        }
        refusal.response(&subject, &self.token_header)
    }
}

/// When a request's handling began and ended, and how long its upstream exchange took; and,
/// for the access line, the path as received where the lines of [`Proxy::refuse`] are given
/// the normalised one (kept only when the access log is on and normalising changed the path).
#[derive(Debug, Clone, Copy)]
struct Timing<'a> {
    started: Instant,
    ended: Instant,
    /// `None` when the request was not sent upstream.
    upstream: Option<Duration>,
    received: Option<&'a str>,
}

impl<'a> Timing<'a> {
    /// A request answered by fencegate, now, without an exchange with the upstream.
    fn without_upstream(started: Instant) -> Self {
        Timing {
            started,
            ended: Instant::now(),
            upstream: None,
            received: None,
        }
    }

    fn received(self, received: Option<&'a str>) -> Self {
        Timing { received, ..self }
    }

    /// End to end.
    fn took(&self) -> Duration {
        self.ended.saturating_duration_since(self.started)
    }
}

/// One access log line: a request as it came and what became of it.
struct Access<'a> {
    subject: Subject<'a>,
    method: &'a Method,
    /// As received, without the query.
    path: &'a str,
    status: u16,
    outcome: Outcome,
    /// The problem type fencegate answered with; `None` for the upstream's answer.
    problem: Option<&'static str>,
    timing: Timing<'a>,
}

/// Writes `access` at `INFO` on the `fencegate::access` target (`access_log: true`).
fn log_access(access: Access<'_>) {
    let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    tracing::info!(
        target: "fencegate::access",
        route = access.subject.route.unwrap_or(UNMATCHED),
        method = access.method.as_str(),
        path = access.path,
        resource = access.subject.resource,
        fencing_token = access.subject.token,
        status = access.status,
        outcome = access.outcome.label(),
        refusal = access
            .problem
            .map(|t| t.strip_prefix("urn:fencegate:").unwrap_or(t)),
        duration_us = micros(access.timing.took()),
        upstream_duration_us = access.timing.upstream.map(micros),
        "request"
    );
}

/// A store answer, bounded by `limit`. Answers that are ready at once (the memory store, a
/// cached refusal) skip the timer: arming and disarming it costs more than they do.
async fn bounded<T>(
    limit: std::time::Duration,
    mut answer: crate::store::BoxFuture<'_, Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let first = {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        answer.as_mut().poll(&mut cx)
    };
    if let std::task::Poll::Ready(ready) = first {
        return ready;
    }
    tokio::time::timeout(limit, answer)
        .await
        .unwrap_or_else(|_| {
            Err(StoreError::Unavailable(format!(
                "no answer within {}",
                crate::duration::display(limit)
            )))
        })
}

/// RFC 9112 §3.2: more than one `Host`, or an HTTP/1.1 request with neither `Host` nor an
/// absolute-form target, is a bad request (the upstream and `X-Forwarded-Host` would have to
/// pick one of two claims).
fn host_problem<B>(req: &Request<B>) -> Option<&'static str> {
    let mut hosts = req.headers().get_all(http::header::HOST).iter();
    let first = hosts.next();
    if hosts.next().is_some() {
        return Some("more than one Host header (RFC 9112 §3.2)");
    }
    if first.is_none() && req.version() == Version::HTTP_11 && req.uri().authority().is_none() {
        return Some("an HTTP/1.1 request needs a Host header (RFC 9112 §3.2)");
    }
    None
}

/// Replaces whatever token the app sent (any spelling, any count) with the lease's token.
fn set_token(headers: &mut http::HeaderMap, name: &HeaderName, token: u64) {
    let aliases: Vec<HeaderName> = headers
        .keys()
        .filter(|k| {
            k.as_str().len() == name.as_str().len() && k.as_str().replace('_', "-") == name.as_str()
        })
        .cloned()
        .collect();
    for alias in aliases {
        headers.remove(alias);
    }
    headers.insert(name.clone(), http::HeaderValue::from(token));
}

/// Makes an upstream exchange's result ready for its client, without the client: the response
/// (hop-by-hop headers stripped) with a body that holds the barrier ticket and, for an
/// idempotency claim, records the outcome (a response without a body is recorded here, as the
/// server never polls its body); or the failure, recorded as an unknown outcome. Whoever drops
/// the response from then on, read or not, the outcome is recorded.
async fn settle(
    sent: upstream::Sent,
    ticket: Option<Ticket>,
    attempt: Option<Attempt>,
) -> Result<Response<ProxyBody>, Failed> {
    let Some(attempt) = attempt else {
        return pass_on(sent, ticket);
    };
    let response = match sent {
        Ok(response) => response,
        Err(failed) => {
            attempt.unknown().await;
            return Err(failed);
        }
    };
    let (mut parts, inner) = response.into_parts();
    headers::strip_hop_by_hop(&mut parts.headers);
    let body = if http_body::Body::is_end_stream(&inner) {
        // A response without a body (204, Content-Length: 0) is never polled by the server:
        // record it before it goes out.
        attempt.record_empty(parts.status, &parts.headers).await;
        ProxyBody::Upstream {
            inner,
            _ticket: ticket,
        }
    } else {
        ProxyBody::Recording(Box::new(idempotent::Recording::new(
            inner,
            ticket,
            parts.status,
            parts.headers.clone(),
            attempt,
        )))
    };
    Ok(Response::from_parts(parts, body))
}

/// [`settle`] without an idempotency attempt: nothing to record, so nothing to wait for.
fn pass_on(sent: upstream::Sent, ticket: Option<Ticket>) -> Result<Response<ProxyBody>, Failed> {
    let (mut parts, inner) = sent?.into_parts();
    headers::strip_hop_by_hop(&mut parts.headers);
    Ok(Response::from_parts(
        parts,
        ProxyBody::Upstream {
            inner,
            _ticket: ticket,
        },
    ))
}

/// Whether a failed exchange failed on the client's own request body (malformed chunked
/// encoding, a body shorter than its Content-Length): the client's fault, not the upstream's.
fn request_body_failed(e: &upstream::BoxError) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e.as_ref());
    while let Some(s) = source {
        if let Some(h) = s.downcast_ref::<hyper::Error>() {
            if h.is_user() {
                return true;
            }
        }
        source = s.source();
    }
    false
}

/// `a: b: c` from an error and its sources, so a 502 body says what actually failed.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn upstream_client(
    upstream_ca: Option<&std::path::Path>,
    connect_timeout: std::time::Duration,
) -> Result<UpstreamClient, String> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    let tls = crate::tls::client_config(upstream_ca)?;
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new())
        // A write that reached the upstream must never be sent twice by us.
        .retry_canceled_requests(false)
        .pool_idle_timeout(std::time::Duration::from_secs(60))
        .pool_max_idle_per_host(1024)
        .build(connector))
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
