//! Wiring: config → store → proxy and admin listeners, and the shutdown order.
//!
//! Shutdown: readiness turns false, the proxy listener closes, in-flight requests finish
//! (bounded by `timeouts.shutdown`), then the admin listener closes and the store is closed.
//! With leases, the agent drains first (nothing granted, no token attached), and the leases
//! are released once in-flight egress writes are done (bounded by `leases.drain_timeout`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use arc_swap::cache::Cache;
use arc_swap::ArcSwap;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin::{Admin, Readiness};
use crate::config::Config;
use crate::config::LeasesConfig;
use crate::fence::Fence;
use crate::lease::agent::Agent;
use crate::lease::api::LeaseApi;
use crate::metrics::Metrics;
use crate::proxy::upstream::ConnUpstream;
use crate::proxy::Proxy;
use crate::reload::Reloader;
use crate::server::{serve, ServerSettings};
use crate::store::{self, FenceStore, StoreError};
use crate::sync::Locked;
use crate::tls::TlsError;

/// Why fencegate could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    LeaseBackend(#[from] crate::lease::LeaseError),
    #[error(transparent)]
    Metrics(#[from] prometheus::Error),
    /// The proxy (its upstream clients) could not be built from the config.
    #[error(transparent)]
    Proxy(#[from] crate::proxy::BuildError),
    /// The listener's certificate or key (`tls`).
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("cannot listen on {address}{}: {source}", listener.suffix())]
    Listen {
        listener: Listener,
        address: SocketAddr,
        source: std::io::Error,
    },
    /// A bound listener that cannot say its address.
    #[error(transparent)]
    LocalAddress(std::io::Error),
    /// `fence.authority: leases` without a `leases` section to open the backend from.
    #[error("fence.authority: leases needs the leases section")]
    AuthorityWithoutLeases,
}

/// Which of fencegate's listeners.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    Proxy,
    Admin,
    Leases,
    Egress,
}

impl Listener {
    /// What follows the address in messages: nothing for the proxy listener, the main one.
    fn suffix(self) -> &'static str {
        match self {
            Listener::Proxy => "",
            Listener::Admin => " (admin)",
            Listener::Leases => " (leases)",
            Listener::Egress => " (egress)",
        }
    }

    /// Binds `address`, or says which listener could not.
    async fn bind(self, address: SocketAddr) -> Result<(TcpListener, SocketAddr), StartError> {
        let listener = TcpListener::bind(address)
            .await
            .map_err(|source| StartError::Listen {
                listener: self,
                address,
                source,
            })?;
        let bound = listener.local_addr().map_err(StartError::LocalAddress)?;
        Ok((listener, bound))
    }
}

/// The fence proxy as one client connection's requests find it: the configuration, cached
/// and checked against the current one with one atomic load per request (`ArcSwap::load_full`
/// takes a debt slot and an extra reference count on every call), and the connection's own
/// upstream slot. The server clones its handler once per accepted connection, and a clone
/// is a new connection's: its own cache and a new, empty slot.
struct ConnProxy {
    cache: Mutex<Cache<Arc<ArcSwap<Proxy>>, Arc<Proxy>>>,
    own: ConnUpstream,
}

impl ConnProxy {
    fn new(proxy: Arc<ArcSwap<Proxy>>) -> Self {
        ConnProxy {
            cache: Mutex::new(Cache::new(proxy)),
            own: ConnUpstream::default(),
        }
    }

    /// The current configuration's proxy (a reload is seen by the next request).
    fn current(&self) -> Arc<Proxy> {
        // One connection's requests come one at a time: never contended. Nothing panics
        // while it is held, so poisoning cannot happen; a poisoned cache would still be whole.
        let mut cache = self.cache.locked();
        Arc::clone(cache.load())
    }
}

impl Clone for ConnProxy {
    fn clone(&self) -> Self {
        let cache = self.cache.locked();
        ConnProxy {
            cache: Mutex::new(cache.clone()),
            own: ConnUpstream::default(),
        }
    }
}

/// A running fencegate.
pub struct Server {
    /// Bound proxy address (the real port when the config said port 0).
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    /// The local lease API and the egress proxy, when `leases` / `egress` are configured.
    pub leases: Option<SocketAddr>,
    pub egress: Option<SocketAddr>,
    pub store: Arc<dyn FenceStore>,
    pub readiness: Arc<Readiness>,
    /// The lease agent, told to drain at the very start of shutdown, before any listener
    /// stops: from then on nothing is granted and no token is attached.
    agent: Option<Arc<Agent>>,
    stop: watch::Sender<bool>,
    done: JoinHandle<()>,
}

impl Server {
    /// Opens the store, binds both listeners and starts serving.
    pub async fn start(config: &Config) -> Result<Server, StartError> {
        Self::start_with(config, None).await
    }

    /// As [`Server::start`], and reloads the config from `path` on change or SIGHUP.
    pub async fn start_watching(config: &Config, path: PathBuf) -> Result<Server, StartError> {
        Self::start_with(config, Some(path)).await
    }

    async fn start_with(
        config: &Config,
        watch_path: Option<PathBuf>,
    ) -> Result<Server, StartError> {
        crate::tls::install_default_provider();
        let store = store::open(&config.store).await?;
        if let Some(period) = config.fence.retention {
            store.forget_after(period)?;
        }
        let metrics = Arc::new(Metrics::new(prometheus::Registry::new())?);
        let observing = Arc::clone(&store);
        metrics.count_resets(move || observing.resets_observed())?;
        // One lease backend for the agent and, in authoritative mode, for the fence.
        let backend = match &config.leases {
            Some(leases) => Some(crate::lease::open(&leases.backend).await?),
            None => None,
        };
        let mut fence = Fence::new(config, Arc::clone(&store), Arc::clone(&metrics));
        if config.fence.authority == crate::config::Authority::Leases {
            // `Config::parse` refuses the one without the other; a config built in code may not.
            let backend = backend.clone().ok_or(StartError::AuthorityWithoutLeases)?;
            fence = fence.with_authority(backend);
        }
        let proxy = Arc::new(ArcSwap::from_pointee(Proxy::over(config, fence)?));
        let tls = match &config.tls {
            Some(tls) => Some(tokio_rustls::TlsAcceptor::from(crate::tls::server_config(
                tls,
                &crate::tls::CONFIG_TLS,
            )?)),
            None => None,
        };
        let (proxy_listener, listen) = Listener::Proxy.bind(config.listen).await?;
        let (admin_listener, admin) = Listener::Admin.bind(config.admin).await?;
        let agent = match (&config.leases, backend) {
            (Some(leases), Some(backend)) => {
                Some(LeaseSide::start(config, leases, backend, &metrics).await?)
            }
            _ => None,
        };

        let readiness = Arc::new(Readiness::default());
        let settings = ServerSettings {
            tls,
            header_read: config.timeouts.header_read,
            max_header_bytes: config.limits.max_header_bytes,
            max_headers: config.limits.max_headers,
            max_connections: config.limits.max_connections,
            drain: config.timeouts.shutdown,
        };
        let admin_settings = ServerSettings {
            tls: None,
            max_connections: 64,
            ..settings.clone()
        };
        let lease_settings = ServerSettings {
            tls: None,
            // In-flight egress writes get the lease drain timeout before leases are released.
            drain: config
                .leases
                .as_ref()
                .map_or(settings.drain, |l| l.drain_timeout),
            ..settings.clone()
        };
        let (stop, stopped) = watch::channel(false);
        if let Some(path) = watch_path {
            let reloader = Reloader {
                path,
                started: config.clone(),
                running: config.clone(),
                proxy: Arc::clone(&proxy),
                metrics: Arc::clone(&metrics),
            };
            tokio::spawn(reloader.run(stopped.clone()));
        }
        let admin_service = Arc::new(Admin {
            metrics,
            store: Arc::clone(&store),
            readiness: Arc::clone(&readiness),
        });
        let lease_addrs = agent.as_ref().map(|a| (a.api, a.egress));
        let lease_agent = agent.as_ref().map(|a| Arc::clone(&a.agent));
        let done = tokio::spawn(async move {
            let (admin_stop, admin_stopped) = watch::channel(false);
            let admin_task = tokio::spawn(serve(
                admin_listener,
                admin_settings,
                move |req, _peer| Arc::clone(&admin_service).handle(req),
                wait_for(admin_stopped),
            ));
            let lease_task = agent.map(|side| {
                let stopped = stopped.clone();
                tokio::spawn(side.serve(lease_settings, stopped))
            });
            serve(
                proxy_listener,
                settings,
                // Each request takes the configuration current when it starts: a reload never
                // tears a request's config. Per client connection (see `ConnProxy`).
                {
                    let conn = ConnProxy::new(proxy);
                    move |req, peer| conn.current().handle_on(req, peer, Some(conn.own.share()))
                },
                wait_for(stopped),
            )
            .await;
            if let Some(task) = lease_task {
                let _ = task.await;
            }
            let _ = admin_stop.send(true);
            let _ = admin_task.await;
        });
        tracing::info!(
            %listen,
            %admin,
            leases = lease_addrs.map(|(api, _)| api.to_string()),
            egress = lease_addrs.and_then(|(_, e)| e).map(|e| e.to_string()),
            store = store.kind(),
            store_url = config.store.remote().map(|r| r.url.to_string()),
            "fencegate started"
        );
        Ok(Server {
            listen,
            admin,
            leases: lease_addrs.map(|(api, _)| api),
            egress: lease_addrs.and_then(|(_, e)| e),
            store,
            readiness,
            agent: lease_agent,
            stop,
            done,
        })
    }

    /// Begins the shutdown sequence; returns at once.
    pub fn shutdown(&self) {
        self.readiness.start_draining();
        if let Some(agent) = &self.agent {
            agent.start_draining();
        }
        let _ = self.stop.send(true);
    }

    /// Waits until both listeners have stopped and in-flight requests have drained.
    pub async fn wait(self) {
        let _ = self.done.await;
    }
}

/// The lease agent with its API and egress listeners.
struct LeaseSide {
    agent: Arc<Agent>,
    api_listener: TcpListener,
    api: SocketAddr,
    egress_listener: Option<(TcpListener, Arc<Proxy>)>,
    egress: Option<SocketAddr>,
}

impl LeaseSide {
    async fn start(
        config: &Config,
        leases: &LeasesConfig,
        backend: Arc<dyn crate::lease::LeaseBackend>,
        metrics: &Arc<Metrics>,
    ) -> Result<LeaseSide, StartError> {
        let agent = Agent::new(
            backend,
            leases.ttl.clone(),
            leases.acquire.clone(),
            Arc::clone(metrics),
        );
        let (api_listener, api) = Listener::Leases.bind(leases.listen).await?;
        let (egress_listener, egress) = match &config.egress {
            Some(egress) => {
                let (listener, addr) = Listener::Egress.bind(egress.listen).await?;
                let proxy = Proxy::egress(config, egress, Arc::clone(&agent), Arc::clone(metrics))?;
                (Some((listener, Arc::new(proxy))), Some(addr))
            }
            None => (None, None),
        };
        Ok(LeaseSide {
            agent,
            api_listener,
            api,
            egress_listener,
            egress,
        })
    }

    /// Serves the lease API and egress until stopped, then shuts down in the order of
    /// [`LEASE_SHUTDOWN`]: the egress drain, the release of every lease, the lease API's drain.
    async fn serve(self, settings: ServerSettings, stopped: watch::Receiver<bool>) {
        let agent = Arc::clone(&self.agent);
        let api = Arc::new(LeaseApi {
            agent: Arc::clone(&agent),
        });
        let draining = {
            let agent = Arc::clone(&agent);
            let mut stopped = stopped.clone();
            async move {
                let _ = stopped.wait_for(|s| *s).await;
                agent.start_draining();
            }
        };
        let mut api_task = Some(tokio::spawn(serve(
            self.api_listener,
            ServerSettings {
                max_connections: 256,
                ..settings.clone()
            },
            move |req, _peer| Arc::clone(&api).handle(req),
            draining,
        )));
        let mut egress_task = self.egress_listener.map(|(listener, proxy)| {
            // As on the fence listener: each client connection keeps its own upstream
            // connection and formatted address.
            let own = ConnUpstream::default();
            tokio::spawn(serve(
                listener,
                settings,
                move |req, peer| Arc::clone(&proxy).handle_on(req, peer, Some(own.share())),
                wait_for(stopped.clone()),
            ))
        });
        wait_for(stopped).await;
        for step in LEASE_SHUTDOWN {
            match step {
                Shutdown::Egress => {
                    if let Some(task) = egress_task.take() {
                        let _ = task.await;
                    }
                }
                Shutdown::Release => {
                    // Event streams see `released`, then end, which lets the lease API's
                    // drain finish.
                    agent.release_all().await;
                    tracing::info!("leases released");
                }
                Shutdown::Api => {
                    if let Some(task) = api_task.take() {
                        let _ = task.await;
                    }
                }
            }
        }
    }
}

/// A step of the lease side's shutdown, once its listeners have been told to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Shutdown {
    /// The egress listener's drain: it returns once every in-flight egress request has
    /// finished, or once `leases.drain_timeout` has passed (requests still running then go
    /// on).
    Egress,
    /// Every lease is released on the backend ([`Agent::release_all`]).
    Release,
    /// The lease API listener's drain (bounded by `leases.drain_timeout` too): waiting
    /// acquisitions have ended at SIGTERM, and events streams end once the leases are
    /// released.
    Api,
}

/// The order of the lease side's shutdown: the leases are released only once the in-flight
/// egress writes, which carry their tokens, are done (or their drain timed out), and before
/// the lease API's drain, whose events streams end with the release. The drain model
/// (`app::model`) explores this order.
pub(crate) const LEASE_SHUTDOWN: [Shutdown; 3] =
    [Shutdown::Egress, Shutdown::Release, Shutdown::Api];

async fn wait_for(mut flag: watch::Receiver<bool>) {
    let _ = flag.wait_for(|stop| *stop).await;
}

#[cfg(test)]
mod model;

#[cfg(test)]
mod tests {
    use super::*;

    /// `Config::parse` refuses `fence.authority: leases` without a `leases` section; a config
    /// built in code can still have it, and starting from it is an error, not a panic.
    #[tokio::test]
    async fn authority_without_a_leases_section_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let yaml = format!(
            "upstream: http://127.0.0.1:9\nlisten: 127.0.0.1:0\nadmin: 127.0.0.1:0\n\
             store: {{ kind: memory }}\nfence: {{ authority: leases }}\n\
             leases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: embedded, path: {} }}\n  ttl: 1s\n",
            dir.path().join("leases.db").display()
        );
        let mut config = Config::parse(&yaml).unwrap();
        config.leases = None;
        let refused = Server::start(&config).await.err().expect("refused");
        assert!(
            matches!(refused, StartError::AuthorityWithoutLeases),
            "{refused}"
        );
        assert_eq!(
            refused.to_string(),
            "fence.authority: leases needs the leases section"
        );
    }
}
