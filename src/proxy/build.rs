//! Building a [`Proxy`]: from the configuration, for egress, with an authority, and again on
//! reload (what carries over and what is rebuilt).

use std::sync::Arc;

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::upstream::UpstreamClient;
use super::{Check, Proxy};
use crate::config::{Config, EgressConfig, IdempotencyConfig, UpstreamUrl};
use crate::fence::barrier::Barriers;
use crate::fence::routes::RouteTable;
use crate::lease::agent::Agent;
use crate::lease::LeaseBackend;
use crate::metrics::{Metrics, RouteMetrics, UNMATCHED};
use crate::store::FenceStore;
use crate::tls::TlsError;

/// Why a proxy could not be built from its configuration.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The upstream clients' TLS: the CA bundle of `upstream_ca` cannot be used (or the
    /// crypto provider offers no usable protocol version).
    #[error(transparent)]
    UpstreamTls(#[from] TlsError),
}

impl Proxy {
    pub fn new(
        config: &Config,
        store: Arc<dyn FenceStore>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, BuildError> {
        let clients = upstream_clients(config.upstream_ca.as_deref(), config.timeouts.upstream)?;
        let front = Front::ingress(config, Check::Store(store), config.idempotency.as_ref());
        Ok(Self::build(
            config,
            front,
            Barriers::new(),
            metrics,
            clients,
        ))
    }

    /// The fence alone, for the in-process layer ([`crate::layer`]): what is let through goes
    /// to the layer's inner service, never upstream (the clients are made but never used), and
    /// idempotency keys are not handled.
    pub(crate) fn in_process(
        config: &Config,
        store: Arc<dyn FenceStore>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, BuildError> {
        let clients = upstream_clients(None, config.timeouts.upstream)?;
        let front = Front::ingress(config, Check::Store(store), None);
        Ok(Self::build(
            config,
            front,
            Barriers::new(),
            metrics,
            clients,
        ))
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
    /// Requests on no egress route are forwarded as they are; the egress listener is plain
    /// HTTP and handles no idempotency keys.
    pub fn egress(
        config: &Config,
        egress: &EgressConfig,
        agent: Arc<Agent>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, BuildError> {
        let clients = upstream_clients(config.upstream_ca.as_deref(), config.timeouts.upstream)?;
        let front = Front {
            table: RouteTable::egress(&egress.routes, config.limits.max_resource_bytes),
            check: Check::Attach(agent),
            upstream: &egress.upstream,
            https: false,
            idempotency: None,
            idempotent: vec![false; egress.routes.len()],
        };
        Ok(Self::build(
            config,
            front,
            Barriers::new(),
            metrics,
            clients,
        ))
    }

    /// A proxy for a reloaded config: same store, barriers and metrics (maxima and in-flight
    /// writes carry over), same connection pool when the upstream did not change.
    pub fn reconfigure(&self, config: &Config) -> Result<Self, BuildError> {
        let clients = if config.upstream == self.upstream && config.upstream_ca == self.upstream_ca
        {
            (self.client.clone(), self.grpc_client.clone())
        } else {
            upstream_clients(config.upstream_ca.as_deref(), config.timeouts.upstream)?
        };
        let front = Front::ingress(config, self.check.clone(), config.idempotency.as_ref());
        let mut proxy = Self::build(
            config,
            front,
            Arc::clone(&self.barriers),
            Arc::clone(&self.metrics),
            clients,
        );
        // Fencing against leases is part of the running process, not of the reloadable part:
        // a reload never turns it off (nor on: that needs a restart, and the log says so).
        proxy.authority = self.authority.clone();
        Ok(proxy)
    }

    /// A proxy from `front`, and from `config` what ingress and egress share: the token
    /// header, `token.equal` and `token.max_step`, the upstream CA, the timeouts and the access log.
    fn build(
        config: &Config,
        front: Front<'_>,
        barriers: Arc<Barriers>,
        metrics: Arc<Metrics>,
        (client, grpc_client): (UpstreamClient, UpstreamClient),
    ) -> Self {
        let Front {
            table,
            check,
            upstream,
            https,
            idempotency,
            idempotent,
        } = front;
        let mut route_metrics: Vec<RouteMetrics> = table
            .routes()
            .iter()
            .map(|r| metrics.route(&r.name))
            .collect();
        route_metrics.push(metrics.route(UNMATCHED));
        let route_names = table.routes().iter().map(|r| Arc::from(&*r.name)).collect();
        Proxy {
            route_names,
            upstream_name: Arc::from(upstream.authority.as_str()),
            table,
            token_header: config.token.header.0.clone(),
            equal: config.token.equal,
            max_step: config.token.max_step.get(),
            check,
            barriers,
            metrics,
            route_metrics,
            client,
            grpc_client,
            authority: None,
            upstream: upstream.clone(),
            upstream_host: http::HeaderValue::from_str(upstream.authority.as_str())
                .expect("an authority is a valid header value"),
            upstream_ca: config.upstream_ca.clone(),
            timeouts: config.timeouts.clone(),
            https,
            idempotency,
            idempotent,
            access_log: config.access_log,
            log_query: config.log.query,
        }
    }
}

/// What an ingress proxy and an egress proxy are built from differently.
struct Front<'a> {
    table: RouteTable,
    check: Check,
    upstream: &'a UpstreamUrl,
    /// The listener's scheme is `https` (for `X-Forwarded-Proto`).
    https: bool,
    /// The idempotency section, and per route (indexed like the table) whether it applies.
    idempotency: Option<IdempotencyConfig>,
    idempotent: Vec<bool>,
}

impl<'a> Front<'a> {
    /// The proxy in front of the app: `config`'s routes, upstream and listener, and
    /// idempotency keys handled per `idempotency` (`None`: not at all).
    fn ingress(config: &'a Config, check: Check, idempotency: Option<&IdempotencyConfig>) -> Self {
        Front {
            table: RouteTable::new(
                &config.routes,
                config.unmatched,
                config.limits.max_resource_bytes,
            ),
            check,
            upstream: &config.upstream,
            https: config.tls.is_some(),
            idempotency: idempotency.cloned(),
            idempotent: config
                .routes
                .iter()
                .map(|r| r.idempotent(idempotency))
                .collect(),
        }
    }
}

/// The upstream pools: HTTP/1.1 for every request but gRPC calls, and HTTP/2 for those.
fn upstream_clients(
    upstream_ca: Option<&std::path::Path>,
    connect_timeout: std::time::Duration,
) -> Result<(UpstreamClient, UpstreamClient), BuildError> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    let tls = crate::tls::client_config(upstream_ca)?;
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls.clone())
        .https_or_http()
        .enable_http1()
        .wrap_connector(http.clone());
    let mut builder = Client::builder(TokioExecutor::new());
    builder
        // A write that reached the upstream must never be sent twice by us.
        .retry_canceled_requests(false)
        .pool_idle_timeout(std::time::Duration::from_secs(60));
    let grpc = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http2()
        .wrap_connector(http);
    // One connection carries every call at once (HTTP/2 streams); an `http` upstream is spoken
    // to by prior knowledge (h2c), as gRPC servers expect.
    let grpc = builder.clone().http2_only(true).build(grpc);
    let http1 = builder.pool_max_idle_per_host(1024).build(connector);
    Ok((http1, grpc))
}
