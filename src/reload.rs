//! Live configuration: the config file is re-read on SIGHUP and whenever its content changes
//! (a mounted ConfigMap is swapped under it; polling sees that where inotify on the symlinked
//! directory would not). A valid config replaces the proxy's routes, token policy, upstream
//! and timeouts atomically; requests in flight finish on the config they started with; the
//! store, its maxima and the serialize barriers carry over. An invalid config is refused with
//! a log line and a metric, and the running one stays.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::sync::watch;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::proxy::Proxy;

/// How often the file is compared with what is running.
pub const POLL: Duration = Duration::from_secs(1);

pub struct Reloader {
    pub path: PathBuf,
    /// The config running now, to report fields that only a restart can change.
    pub running: Config,
    pub proxy: Arc<ArcSwap<Proxy>>,
    pub metrics: Arc<Metrics>,
}

impl Reloader {
    /// Runs until `stop` turns true.
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut hangup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        {
            Ok(signal) => Some(signal),
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGHUP; reloading on file change only");
                None
            }
        };
        let mut last = std::fs::read(&self.path).ok();
        let mut poll = tokio::time::interval(POLL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let forced = tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                _ = async { match &mut hangup { Some(h) => h.recv().await, None => std::future::pending().await } } => true,
                _ = poll.tick() => false,
            };
            let current = std::fs::read(&self.path).ok();
            if !forced && (current.is_none() || current == last) {
                // Unchanged, or mid-swap (the file is briefly absent while a ConfigMap updates).
                continue;
            }
            last = current;
            self.reload(if forced { "SIGHUP" } else { "file changed" });
        }
    }

    fn reload(&mut self, trigger: &str) {
        let config = match Config::load(&self.path) {
            Ok(config) => config,
            Err(e) => return self.refuse(trigger, &e.to_string()),
        };
        let proxy = match self.proxy.load().reconfigure(&config) {
            Ok(proxy) => proxy,
            Err(e) => return self.refuse(trigger, &e),
        };
        let needs_restart = restart_only_changes(&self.running, &config);
        self.proxy.store(Arc::new(proxy));
        self.metrics.reloads_ok.inc();
        tracing::info!(
            trigger,
            routes = config.routes.len(),
            not_applied_until_restart = ?needs_restart,
            "configuration reloaded"
        );
        self.running = config;
    }

    fn refuse(&self, trigger: &str, error: &str) {
        self.metrics.reloads_refused.inc();
        tracing::error!(
            trigger,
            error,
            "configuration refused; the running one stays"
        );
    }
}

/// Fields a reload cannot change (sockets, TLS, the store): listed so the log says so.
fn restart_only_changes(old: &Config, new: &Config) -> Vec<&'static str> {
    let mut changed = Vec::new();
    if old.listen != new.listen {
        changed.push("listen");
    }
    if old.admin != new.admin {
        changed.push("admin");
    }
    if format!("{:?}", old.tls) != format!("{:?}", new.tls) {
        changed.push("tls");
    }
    if format!("{:?}", old.store) != format!("{:?}", new.store) {
        changed.push("store");
    }
    if old.fence.authority != new.fence.authority {
        changed.push("fence.authority");
    }
    if format!("{:?}", old.leases) != format!("{:?}", new.leases) {
        changed.push("leases");
    }
    if format!("{:?}", old.egress) != format!("{:?}", new.egress) {
        changed.push("egress");
    }
    let (a, b) = (&old.limits, &new.limits);
    if (a.max_header_bytes, a.max_headers, a.max_connections)
        != (b.max_header_bytes, b.max_headers, b.max_connections)
        || old.timeouts.header_read != new.timeouts.header_read
        || old.timeouts.shutdown != new.timeouts.shutdown
    {
        changed.push("limits/timeouts of connections");
    }
    changed
}
