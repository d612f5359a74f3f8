//! Building a [`Proxy`]: from the configuration, for egress, with an authority, and again on
//! reload (what carries over and what is rebuilt).

use std::sync::Arc;

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::upstream::UpstreamClient;
use super::Proxy;
use crate::config::{Config, EgressConfig, MissingToken, Ordering, RouteConfig, Unmatched};
use crate::fence::barrier::Barriers;
use crate::fence::routes::RouteTable;
use crate::lease::agent::Agent;
use crate::lease::LeaseBackend;
use crate::metrics::{Metrics, RouteMetrics, UNMATCHED};
use crate::store::FenceStore;

impl Proxy {
    pub fn new(
        config: &Config,
        store: Arc<dyn FenceStore>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, String> {
        let clients = upstream_clients(config.upstream_ca.as_deref(), config.timeouts.upstream)?;
        Ok(Self::build(
            config,
            store,
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
    ) -> Result<Self, String> {
        let mut config = config.clone();
        config.idempotency = None;
        let clients = upstream_clients(None, config.timeouts.upstream)?;
        Ok(Self::build(
            &config,
            store,
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
        let clients = upstream_clients(config.upstream_ca.as_deref(), config.timeouts.upstream)?;
        // The store is never consulted in egress mode; a memory store keeps the type simple.
        let store: Arc<dyn FenceStore> = Arc::new(crate::store::MemoryStore::new());
        let mut proxy = Self::build(&egress_config, store, Barriers::new(), metrics, clients);
        proxy.attach = Some(agent);
        Ok(proxy)
    }

    /// A proxy for a reloaded config: same store, barriers and metrics (maxima and in-flight
    /// writes carry over), same connection pool when the upstream did not change.
    pub fn reconfigure(&self, config: &Config) -> Result<Self, String> {
        let clients = if config.upstream == self.upstream && config.upstream_ca == self.upstream_ca
        {
            (self.client.clone(), self.grpc_client.clone())
        } else {
            upstream_clients(config.upstream_ca.as_deref(), config.timeouts.upstream)?
        };
        let mut proxy = Self::build(
            config,
            Arc::clone(&self.store),
            Arc::clone(&self.barriers),
            Arc::clone(&self.metrics),
            clients,
        );
        // Fencing against leases is part of the running process, not of the reloadable part:
        // a reload never turns it off (nor on: that needs a restart, and the log says so).
        proxy.attach = self.attach.clone();
        proxy.authority = self.authority.clone();
        Ok(proxy)
    }

    pub(super) fn build(
        config: &Config,
        store: Arc<dyn FenceStore>,
        barriers: Arc<Barriers>,
        metrics: Arc<Metrics>,
        (client, grpc_client): (UpstreamClient, UpstreamClient),
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
            grpc_client,
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
}

/// The upstream pools: HTTP/1.1 for every request but gRPC calls, and HTTP/2 for those.
fn upstream_clients(
    upstream_ca: Option<&std::path::Path>,
    connect_timeout: std::time::Duration,
) -> Result<(UpstreamClient, UpstreamClient), String> {
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
