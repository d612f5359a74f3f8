//! Wiring: config → store → proxy and admin listeners, and the shutdown order.
//!
//! Shutdown: readiness turns false, the proxy listener closes, in-flight requests finish
//! (bounded by `timeouts.shutdown`), then the admin listener closes and the store is closed.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use arc_swap::ArcSwap;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin::{Admin, Readiness};
use crate::config::Config;
use crate::metrics::Metrics;
use crate::proxy::Proxy;
use crate::reload::Reloader;
use crate::server::{serve, ServerSettings};
use crate::store::{self, FenceStore};

/// A running fencegate.
pub struct Server {
    /// Bound proxy address (the real port when the config said port 0).
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    pub store: Arc<dyn FenceStore>,
    pub readiness: Arc<Readiness>,
    stop: watch::Sender<bool>,
    done: JoinHandle<()>,
}

impl Server {
    /// Opens the store, binds both listeners and starts serving.
    pub async fn start(config: &Config) -> Result<Server, String> {
        Self::start_with(config, None).await
    }

    /// As [`Server::start`], and reloads the config from `path` on change or SIGHUP.
    pub async fn start_watching(config: &Config, path: PathBuf) -> Result<Server, String> {
        Self::start_with(config, Some(path)).await
    }

    async fn start_with(config: &Config, watch_path: Option<PathBuf>) -> Result<Server, String> {
        crate::tls::install_default_provider();
        let store = store::open(&config.store)
            .await
            .map_err(|e| e.to_string())?;
        let metrics =
            Arc::new(Metrics::new(prometheus::Registry::new()).map_err(|e| e.to_string())?);
        let proxy = Arc::new(ArcSwap::from_pointee(Proxy::new(
            config,
            Arc::clone(&store),
            Arc::clone(&metrics),
        )?));
        let tls = match &config.tls {
            Some(tls) => Some(tokio_rustls::TlsAcceptor::from(crate::tls::server_config(
                tls,
            )?)),
            None => None,
        };
        let proxy_listener = TcpListener::bind(config.listen)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
        let admin_listener = TcpListener::bind(config.admin)
            .await
            .map_err(|e| format!("cannot listen on {} (admin): {e}", config.admin))?;
        let listen = proxy_listener.local_addr().map_err(|e| e.to_string())?;
        let admin = admin_listener.local_addr().map_err(|e| e.to_string())?;

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
        let (stop, stopped) = watch::channel(false);
        if let Some(path) = watch_path {
            let reloader = Reloader {
                path,
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
        let done = tokio::spawn(async move {
            let (admin_stop, admin_stopped) = watch::channel(false);
            let admin_task = tokio::spawn(serve(
                admin_listener,
                admin_settings,
                move |req, _peer| Arc::clone(&admin_service).handle(req),
                wait_for(admin_stopped),
            ));
            serve(
                proxy_listener,
                settings,
                // One atomic load per request: a reload never tears a request's config.
                move |req, peer| proxy.load_full().handle(req, peer),
                wait_for(stopped),
            )
            .await;
            let _ = admin_stop.send(true);
            let _ = admin_task.await;
        });
        tracing::info!(
            %listen,
            %admin,
            store = store.kind(),
            store_url = config.store.url.as_ref().map(|u| u.to_string()),
            "fencegate started"
        );
        Ok(Server {
            listen,
            admin,
            store,
            readiness,
            stop,
            done,
        })
    }

    /// Begins the shutdown sequence; returns at once.
    pub fn shutdown(&self) {
        self.readiness.start_draining();
        let _ = self.stop.send(true);
    }

    /// Waits until both listeners have stopped and in-flight requests have drained.
    pub async fn wait(self) {
        let _ = self.done.await;
    }
}

async fn wait_for(mut flag: watch::Receiver<bool>) {
    let _ = flag.wait_for(|stop| *stop).await;
}
