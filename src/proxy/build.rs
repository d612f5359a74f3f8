//! Building a [`Proxy`]: a [`Fence`] and the upstream clients, from the configuration, for
//! egress, and again on reload (what carries over and what is rebuilt).

use std::sync::Arc;

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::upstream::UpstreamClient;
use super::Proxy;
use crate::config::{Config, EgressConfig, UpstreamUrl};
use crate::fence::Fence;
use crate::lease::agent::Agent;
use crate::metrics::Metrics;
use crate::store::FenceStore;
use crate::tls::TlsError;

/// Why a proxy could not be built from its configuration.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The upstream clients' TLS: the CA bundle of `upstream_ca` cannot be used (or the
    /// crypto provider offers no usable protocol version).
    #[error(transparent)]
    UpstreamTls(#[from] TlsError),
    /// A configuration without `upstream` (read by `Config::parse_fence`, for an in-process
    /// fence): the proxy has nowhere to forward to.
    #[error("the proxy needs `upstream`: the service it forwards to")]
    NoUpstream,
}

impl Proxy {
    /// The proxy in front of the app: the fence of `config` over `store`, and its upstream.
    pub fn new(
        config: &Config,
        store: Arc<dyn FenceStore>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, BuildError> {
        Self::over(config, Fence::new(config, store, metrics))
    }

    /// `fence` (made from `config`: with an authority, say) in front of `config`'s upstream.
    pub fn over(config: &Config, fence: Fence) -> Result<Self, BuildError> {
        let upstream = config.upstream.as_ref().ok_or(BuildError::NoUpstream)?;
        let clients = upstream_clients(config.upstream_ca.as_deref(), config.timeouts.upstream)?;
        let https = config.tls.is_some();
        Ok(Self::build(config, fence, upstream, https, clients))
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
        let fence = Fence::egress(config, egress, agent, metrics);
        Ok(Self::build(config, fence, &egress.upstream, false, clients))
    }

    /// A proxy for a reloaded config: the fence reconfigured (same store, barriers, metrics
    /// and authority: maxima and in-flight writes carry over), same connection pool when the
    /// upstream did not change.
    pub fn reconfigure(&self, config: &Config) -> Result<Self, BuildError> {
        let upstream = config.upstream.as_ref().ok_or(BuildError::NoUpstream)?;
        let clients = if *upstream == self.upstream && config.upstream_ca == self.upstream_ca {
            (self.client.clone(), self.grpc_client.clone())
        } else {
            upstream_clients(config.upstream_ca.as_deref(), config.timeouts.upstream)?
        };
        let fence = self.fence.reconfigure(config);
        let https = config.tls.is_some();
        Ok(Self::build(config, fence, upstream, https, clients))
    }

    /// A proxy from its fence and upstream, and from `config` the upstream CA, the timeouts
    /// and the access log.
    fn build(
        config: &Config,
        fence: Fence,
        upstream: &UpstreamUrl,
        https: bool,
        (client, grpc_client): (UpstreamClient, UpstreamClient),
    ) -> Self {
        let route_names = fence
            .table
            .routes()
            .iter()
            .map(|r| Arc::from(&*r.name))
            .collect();
        Proxy {
            fence: Arc::new(fence),
            route_names,
            upstream_name: Arc::from(upstream.authority.as_str()),
            client,
            grpc_client,
            upstream: upstream.clone(),
            upstream_host: http::HeaderValue::from_str(upstream.authority.as_str())
                .expect("an authority is a valid header value"),
            upstream_ca: config.upstream_ca.clone(),
            timeouts: config.timeouts.clone(),
            https,
            access_log: config.access_log,
            log_query: config.log.query,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    /// A config read for an in-process fence has no upstream: a proxy over it is refused with
    /// an error, not built with a missing piece.
    #[test]
    fn a_proxy_without_an_upstream_is_refused() {
        let config = Config::parse_fence("store: { kind: memory }\n").unwrap();
        let metrics = Arc::new(Metrics::new(prometheus::Registry::new()).unwrap());
        let refused = Proxy::new(&config, Arc::new(MemoryStore::new()), metrics).err();
        assert!(matches!(refused, Some(BuildError::NoUpstream)));
    }
}
