//! The fence: one [`Fence`] holds what decides a write (routes, token rules, the store or
//! the lease agent, the barriers, the authority, its metrics), and decides it
//! (`Fence::decide`, then `Fence::admit` for a write that has to wait, in `fence/decide.rs`).
//! The proxy ([`crate::proxy`]) is a `Fence` plus an upstream and forwarding; the in-process
//! [`crate::layer`] is a `Fence` in front of a tower service.
//!
//! Below it, the pure decisions, as functions over values (no sockets, no clocks):
//! [`token`], [`path`], [`routes`], [`method`], [`verdict`], [`barrier`].

pub mod barrier;
mod decide;
pub(crate) mod keyed;
pub mod method;
#[cfg(test)]
pub(crate) mod model;
pub mod path;
pub(crate) mod resource;
pub mod routes;
#[cfg(test)]
mod tests;
pub mod token;
pub mod verdict;
pub use resource::{ResourceId, ResourceIdError};
pub use token::Token;

pub(crate) use decide::{Decision, Fenced, Key, Later, Pass, Refused};

use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderName;
use http::{Method, Response};

use crate::body::ProxyBody;
use crate::config::{Config, EgressConfig, EqualTokens, IdempotencyConfig};
use crate::fault::Fault;
use crate::lease::agent::Agent;
use crate::lease::grants::GrantCache;
use crate::lease::LeaseBackend;
use crate::metrics::{Metrics, RouteMetrics, UNMATCHED};
use crate::problem::refusal::{Refusal, Subject};
use crate::store::FenceStore;
use barrier::Barriers;
use routes::{Route, RouteTable};

/// What decides a fenced write, built once per configuration (and again on reload, sharing
/// the store, the barriers, the metrics and the authority).
pub struct Fence {
    pub(crate) table: RouteTable,
    pub(crate) token_header: HeaderName,
    equal: EqualTokens,
    /// `token.max_step` (`None`: off); applied in observed mode only ([`Fence::rule`]).
    max_step: Option<u64>,
    /// What a fenced write's token is checked against, or where it comes from.
    check: Check,
    pub(crate) barriers: Arc<Barriers>,
    pub(crate) metrics: Arc<Metrics>,
    /// Per-route metric children, indexed like the route table; the last one is for requests
    /// on no route.
    route_metrics: Vec<RouteMetrics>,
    /// Authoritative mode: the latest grant per resource, from the lease backend that issues
    /// tokens, cached from its grant events (and the highest grants seen, a lower bound that
    /// answers refusals without a round trip).
    authority: Option<Arc<GrantCache>>,
    /// `timeouts.store`: how long a raise (or the authority) may take.
    store_timeout: Duration,
    /// Idempotency keys: the section, and per route (indexed like the table) whether it applies.
    pub(crate) idempotency: Option<Arc<IdempotencyConfig>>,
    idempotent: Vec<bool>,
}

/// How a fence decides writes.
#[derive(Clone)]
enum Check {
    /// Ingress: the request's token is compared with the highest seen, and raised, in the store.
    Store(Arc<dyn FenceStore>),
    /// Egress: the request carries no token; the token of the lease this sidecar holds on the
    /// resource is attached (docs/leases.md, `egress`), and without one the write is refused.
    Attach(Arc<Agent>),
}

impl Fence {
    /// The fence in front of the app: `config`'s routes and token rules over `store`, with
    /// idempotency keys handled per its `idempotency` section.
    pub fn new(config: &Config, store: Arc<dyn FenceStore>, metrics: Arc<Metrics>) -> Self {
        Self::ingress(config, Check::Store(store), Barriers::new(), metrics)
    }

    /// Checks tokens against the lease backend too (`fence.authority: leases`).
    pub fn with_authority(mut self, backend: Arc<dyn LeaseBackend>) -> Self {
        self.authority = Some(Arc::new(GrantCache::new(backend, 100_000)));
        self
    }

    /// The egress fence: the held lease's token attached to writes on egress routes, and
    /// writes without a valid lease refused (503). It handles no idempotency keys.
    pub fn egress(
        config: &Config,
        egress: &EgressConfig,
        agent: Arc<Agent>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let table = RouteTable::egress(&egress.routes, config.limits.max_resource_bytes);
        let check = Check::Attach(agent);
        let idempotent = vec![false; egress.routes.len()];
        Self::build(
            config,
            table,
            check,
            None,
            idempotent,
            Barriers::new(),
            metrics,
        )
    }

    /// The fence of a reloaded config: same store, barriers and metrics (maxima and in-flight
    /// writes carry over). Fencing against leases is part of the running process, not of the
    /// reloadable part: a reload never turns it off (nor on: that needs a restart, and the
    /// log says so).
    pub fn reconfigure(&self, config: &Config) -> Self {
        let barriers = Arc::clone(&self.barriers);
        let mut fence = Self::ingress(
            config,
            self.check.clone(),
            barriers,
            Arc::clone(&self.metrics),
        );
        fence.authority = self.authority.clone();
        fence
    }

    fn ingress(
        config: &Config,
        check: Check,
        barriers: Arc<Barriers>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let table = RouteTable::new(
            &config.routes,
            config.unmatched,
            config.limits.max_resource_bytes,
        );
        let idempotency = config.idempotency.as_ref();
        let idempotent = config
            .routes
            .iter()
            .map(|r| r.idempotent(idempotency))
            .collect();
        let idempotency = idempotency.cloned().map(Arc::new);
        Self::build(
            config,
            table,
            check,
            idempotency,
            idempotent,
            barriers,
            metrics,
        )
    }

    /// A fence from its route table and check, and from `config` what ingress and egress
    /// share: the token header, `token.equal` and `token.max_step`, and the store timeout.
    fn build(
        config: &Config,
        table: RouteTable,
        check: Check,
        idempotency: Option<Arc<IdempotencyConfig>>,
        idempotent: Vec<bool>,
        barriers: Arc<Barriers>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let mut route_metrics: Vec<RouteMetrics> = table
            .routes()
            .iter()
            .map(|r| metrics.route(&r.name))
            .collect();
        route_metrics.push(metrics.route(UNMATCHED));
        Fence {
            table,
            token_header: config.token.header.0.clone(),
            equal: config.token.equal,
            max_step: config.token.max_step.get(),
            check,
            barriers,
            metrics,
            route_metrics,
            authority: None,
            store_timeout: config.timeouts.store,
            idempotency,
            idempotent,
        }
    }

    /// The route at `index` of the table.
    pub(crate) fn route(&self, index: usize) -> &Route {
        &self.table.routes()[index]
    }

    /// The metrics of `route`'s requests (`None`: of requests on no route).
    pub(crate) fn metrics_for(&self, route: Option<&Route>) -> &RouteMetrics {
        let index = route.map_or(self.route_metrics.len() - 1, |r| r.index);
        &self.route_metrics[index]
    }

    /// The registry the fence's metrics are in.
    pub(crate) fn metrics_registry(&self) -> &prometheus::Registry {
        &self.metrics.registry
    }

    /// Counts and logs a refusal (one `WARN` line), and answers it (problem+json; the gRPC
    /// form is made from it at the edge). `took` is the request's time so far.
    pub(crate) fn refuse(
        &self,
        refusal: &Refusal,
        route: Option<&Route>,
        subject: Subject<'_>,
        method: &Method,
        path: &str,
        took: Duration,
    ) -> Response<ProxyBody> {
        let kind = refusal.kind();
        let problem = refusal.problem(&subject, &self.token_header);
        self.metrics_for(route)
            .finish(kind.outcome, method, kind.status.as_u16(), took);
        let fault = refusal.fault();
        let store_error = match &refusal {
            Refusal::StoreUnavailable(e) => Some(e.label()),
            _ => None,
        };
        // The target is the one refusals have always been logged under, which log pipelines
        // and filters (`FENCEGATE_LOG`) select on.
        tracing::warn!(
            target: "fencegate::proxy::problem",
            route = subject.route,
            %method,
            path,
            resource = subject.resource,
            fencing_token = subject.token.map(Token::get),
            current_token = refusal.current_token().map(Token::get),
            status = kind.status.as_u16(),
            r#type = kind.urn,
            detail = problem.detail(),
            fault = fault.label(),
            store_error,
            "{}",
            if fault == Fault::Upstream {
                "upstream failed"
            } else {
                "write refused"
            }
        );
        refusal.respond(problem)
    }
}
