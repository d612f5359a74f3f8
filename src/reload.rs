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
    /// The config the process started with: the fields only a restart can change still run
    /// with its values.
    pub started: Config,
    /// The config last applied (at start or by a reload): what a reload's changes are
    /// told against.
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
            Err(e) => return self.refuse(trigger, &e.to_string()),
        };
        let changed = changed_fields(&self.running, &config);
        let needs_restart = restart_only_changes(&self.started, &config);
        self.proxy.store(Arc::new(proxy));
        self.metrics.reloads_ok.inc();
        tracing::info!(
            trigger,
            routes = config.routes.len(),
            changed = changed.join(", "),
            not_applied_until_restart = needs_restart.join(", "),
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

/// The fields whose values differ between two configs, by their path in the file: a top-level
/// field, or `field.subfield` under a mapping (`timeouts.upstream`). Store and lease backend
/// URLs are compared with their passwords, which the serialised form masks.
fn changed_fields(old: &Config, new: &Config) -> Vec<String> {
    let as_map = |c: &Config| match serde_json::to_value(c) {
        Ok(serde_json::Value::Object(map)) => map,
        _ => serde_json::Map::new(),
    };
    let (old_map, new_map) = (as_map(old), as_map(new));
    let mut changed = Vec::new();
    for key in union(&old_map, &new_map) {
        match (old_map.get(key), new_map.get(key)) {
            (Some(a), Some(b)) if a == b => {}
            (Some(serde_json::Value::Object(a)), Some(serde_json::Value::Object(b))) => {
                for sub in union(a, b) {
                    if a.get(sub) != b.get(sub) {
                        changed.push(format!("{key}.{sub}"));
                    }
                }
            }
            _ => changed.push(key.clone()),
        }
    }
    let secret_changes = [
        ("store.url", store_url(old) != store_url(new)),
        ("leases.backend", backend_url(old) != backend_url(new)),
    ];
    for (name, differs) in secret_changes {
        if differs && !changed.iter().any(|c| name.starts_with(c.as_str())) {
            changed.push(name.to_owned());
        }
    }
    changed
}

/// The store's URL with its password (the printed one is masked).
fn store_url(config: &Config) -> Option<&str> {
    config.store.remote().map(|r| r.url.expose())
}

/// The lease backend's URL with its password.
fn backend_url(config: &Config) -> Option<&str> {
    let leases = config.leases.as_ref()?;
    leases.backend.remote().map(|r| r.url.expose())
}

/// The keys of two mappings, those of `a` first, each once.
fn union<'a>(
    a: &'a serde_json::Map<String, serde_json::Value>,
    b: &'a serde_json::Map<String, serde_json::Value>,
) -> Vec<&'a String> {
    a.keys()
        .chain(b.keys().filter(|k| !a.contains_key(k.as_str())))
        .collect()
}

/// Fields a reload cannot change (sockets, TLS, the store, the lease side) whose value in
/// `new` differs from the one the process runs with: listed so the log says so.
fn restart_only_changes(running: &Config, new: &Config) -> Vec<&'static str> {
    let debug = |v: &dyn std::fmt::Debug| format!("{v:?}");
    let (a, b) = (running, new);
    let checks = [
        ("listen", a.listen != b.listen),
        ("admin", a.admin != b.admin),
        ("tls", debug(&a.tls) != debug(&b.tls)),
        (
            "store",
            debug(&a.store) != debug(&b.store) || store_url(a) != store_url(b),
        ),
        ("fence.authority", a.fence.authority != b.fence.authority),
        ("fence.retention", a.fence.retention != b.fence.retention),
        (
            "leases",
            debug(&a.leases) != debug(&b.leases) || backend_url(a) != backend_url(b),
        ),
        ("egress", debug(&a.egress) != debug(&b.egress)),
        (
            "limits.max_header_bytes",
            a.limits.max_header_bytes != b.limits.max_header_bytes,
        ),
        (
            "limits.max_headers",
            a.limits.max_headers != b.limits.max_headers,
        ),
        (
            "limits.max_connections",
            a.limits.max_connections != b.limits.max_connections,
        ),
        (
            "timeouts.header_read",
            a.timeouts.header_read != b.timeouts.header_read,
        ),
        (
            "timeouts.shutdown",
            a.timeouts.shutdown != b.timeouts.shutdown,
        ),
        ("log.format", a.log.format != b.log.format),
    ];
    checks
        .into_iter()
        .filter_map(|(name, differs)| differs.then_some(name))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> Config {
        Config::parse(&format!(
            "upstream: http://127.0.0.1:8080\nstore: {{ kind: memory }}\n{extra}"
        ))
        .unwrap()
    }

    #[test]
    fn a_reload_names_what_it_changed_and_what_waits_for_a_restart() {
        let start = config("");
        let routes = "routes:\n  - { name: a, path: '/a/{id}' }\n";
        let first = config(&format!("listen: 127.0.0.1:9000\n{routes}"));
        assert_eq!(changed_fields(&start, &first), ["listen", "routes"]);
        assert_eq!(restart_only_changes(&start, &first), ["listen"]);

        // A later reload that changes only a timeout says so, and `listen`, still not
        // applied, is still listed as waiting for a restart.
        let second = config(&format!(
            "listen: 127.0.0.1:9000\n{routes}timeouts: {{ upstream: 3s, shutdown: 1s }}\n"
        ));
        assert_eq!(
            changed_fields(&first, &second),
            ["timeouts.upstream", "timeouts.shutdown"]
        );
        assert_eq!(
            restart_only_changes(&start, &second),
            ["listen", "timeouts.shutdown"]
        );

        // Back to the values the process runs with: nothing waits any more.
        let third = config(routes);
        assert_eq!(
            changed_fields(&second, &third),
            ["listen", "timeouts.upstream", "timeouts.shutdown"]
        );
        assert!(restart_only_changes(&start, &third).is_empty());
        assert!(changed_fields(&third, &third).is_empty());
    }

    #[test]
    fn a_new_store_password_is_a_change_though_it_prints_masked() {
        let redis = |password: &str| {
            Config::parse(&format!(
                "upstream: http://127.0.0.1:8080\nstore: {{ kind: redis, url: 'redis://u:{password}@127.0.0.1:6379/' }}\n"
            ))
            .unwrap()
        };
        let (a, b) = (redis("one"), redis("two"));
        assert_eq!(changed_fields(&a, &b), ["store.url"]);
        assert_eq!(restart_only_changes(&a, &b), ["store"]);
    }
}
