//! What the injector knows of the sidecar's `fencegate.yaml` (`--config FILE`): the text that
//! `inject` writes into the ConfigMap, and what it implies for the pods that mount it, the
//! addresses of the lease API and the egress proxy for the app containers' environment, and
//! whether the recorded maxima live in a file on the pod's `fencegate-data` volume.

use std::net::SocketAddr;

use serde_json::{json, Value};

use crate::config::{Config, EnvError, ParseError, StoreConfig};

/// The variable the injector itself sets on the sidecar, from the pod's
/// `fencegate.io/upstream-port` annotation.
const UPSTREAM_PORT_VARIABLE: &str = "FENCEGATE_UPSTREAM_PORT";
/// Stands in, while the file is checked, for a variable that only the pod's environment
/// (its Secret) provides: it keeps a URL's password, a port or a number valid.
const PLACEHOLDER: &str = "0";

/// The app containers' variable with the lease API's address.
pub const LEASE_API_ENV: &str = "FENCEGATE_LEASE_API";
/// The app containers' variable with the egress proxy's address.
pub const EGRESS_URL_ENV: &str = "FENCEGATE_EGRESS_URL";

/// Why a sidecar configuration is refused.
#[derive(Debug, thiserror::Error)]
pub enum SidecarConfigError {
    #[error(transparent)]
    Env(#[from] EnvError),
    /// Refused as `fencegate run` would refuse it; `stand_ins` are the variables that were
    /// checked with [`PLACEHOLDER`] for their value.
    #[error("{source}{}", stand_ins_note(stand_ins))]
    Invalid {
        source: ParseError,
        stand_ins: Vec<String>,
    },
    /// `listen` or `admin` where the kubelet and the pod's Service cannot reach it.
    #[error(
        "`{field}: {address}`: {why}; the injected sidecar serves `listen` on port {proxy} and \
         `admin` on port {admin} of every address (`0.0.0.0:{port}`), where the Service and the \
         probes reach them",
        proxy = super::sidecar::PROXY_PORT,
        admin = super::sidecar::ADMIN_PORT,
    )]
    Unreachable {
        field: &'static str,
        address: SocketAddr,
        why: String,
        port: u16,
    },
}

/// Says which variables took the placeholder, so a refusal caused by one is understood.
fn stand_ins_note(stand_ins: &[String]) -> String {
    if stand_ins.is_empty() {
        return String::new();
    }
    format!(
        " (checked with `{PLACEHOLDER}` for {}, which the pod's environment sets)",
        stand_ins.join(", ")
    )
}

/// A checked sidecar configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidecarConfig {
    /// The file as written, `${VARIABLES}` and comments included: the sidecar expands them.
    pub text: String,
    /// `http://127.0.0.1:<port>` of `leases.listen`, when there is a `leases` section.
    pub lease_api: Option<String>,
    /// `http://127.0.0.1:<port>` of `egress.listen`, when there is an `egress` section.
    pub egress_url: Option<String>,
    /// `store.kind: embedded` (or no `store`, whose default is embedded): each pod keeps
    /// its own maxima, in a file on its `fencegate-data` volume.
    pub embedded_store: bool,
}

impl SidecarConfig {
    /// Checks `text` as `fencegate run` would, with the pod's environment unknown:
    /// `${NAME:-default}` takes its default, `${FENCEGATE_UPSTREAM_PORT}` the injector's default
    /// port, and any other `${NAME}` (a password from the pod's Secret) the placeholder `0`.
    pub fn parse(text: &str) -> Result<SidecarConfig, SidecarConfigError> {
        let required = required_variables(text);
        let expanded = crate::config::expand_env(text, |name| {
            if !required.iter().any(|r| r == name) {
                None
            } else if name == UPSTREAM_PORT_VARIABLE {
                Some(super::DEFAULT_UPSTREAM_PORT.to_string())
            } else {
                Some(PLACEHOLDER.to_owned())
            }
        })?;
        let config = Config::parse(&expanded).map_err(|source| SidecarConfigError::Invalid {
            source,
            stand_ins: required
                .iter()
                .filter(|n| *n != UPSTREAM_PORT_VARIABLE)
                .cloned()
                .collect(),
        })?;
        reachable("listen", config.listen, super::sidecar::PROXY_PORT)?;
        reachable("admin", config.admin, super::sidecar::ADMIN_PORT)?;
        Ok(SidecarConfig {
            text: text.to_owned(),
            lease_api: config.leases.as_ref().map(|l| local_url(l.listen)),
            egress_url: config.egress.as_ref().map(|e| local_url(e.listen)),
            embedded_store: matches!(config.store, StoreConfig::Embedded { .. }),
        })
    }

    /// The variables the app containers get, in order.
    pub fn app_env(&self) -> Vec<(&'static str, &str)> {
        let mut env = Vec::new();
        if let Some(url) = &self.lease_api {
            env.push((LEASE_API_ENV, url.as_str()));
        }
        if let Some(url) = &self.egress_url {
            env.push((EGRESS_URL_ENV, url.as_str()));
        }
        env
    }

    /// The ConfigMap holding this file as `fencegate.yaml`.
    pub fn config_map(&self, name: &str, namespace: Option<&str>) -> Value {
        let mut metadata = json!({"name": name});
        if let Some(namespace) = namespace {
            metadata["namespace"] = json!(namespace);
        }
        metadata["labels"] = json!({"app.kubernetes.io/part-of": "fencegate"});
        json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": metadata,
            "data": {"fencegate.yaml": self.text},
        })
    }
}

/// Refuses a listener the pod's Service (`listen`) or the kubelet's probes (`admin`) could
/// not reach: on loopback, or on another port than the one the sidecar's container declares.
fn reachable(
    field: &'static str,
    address: SocketAddr,
    port: u16,
) -> Result<(), SidecarConfigError> {
    let outcome = match field {
        "admin" => "the kubelet's probes would fail and the pod would never become ready",
        _ => "the Service's traffic would never arrive",
    };
    let why = if address.ip().is_loopback() {
        format!("a loopback address is reached from inside the pod only: {outcome}")
    } else if address.port() != port {
        format!("the sidecar's container declares port {port}: {outcome}")
    } else {
        return Ok(());
    };
    Err(SidecarConfigError::Unreachable {
        field,
        address,
        why,
        port,
    })
}

/// Names written `${NAME}`, without a default.
fn required_variables(text: &str) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        let after = &rest[start + 2..];
        let Some(end) = after.find('}') else { break };
        let inner = &after[..end];
        if !inner.contains(":-") && !names.iter().any(|n| n == inner) {
            names.push(inner.to_owned());
        }
        rest = &after[end + 1..];
    }
    names
}

/// Where the pod's other containers reach a sidecar listener: over loopback, unless it listens
/// on one particular address.
fn local_url(listen: SocketAddr) -> String {
    let port = listen.port();
    match listen {
        SocketAddr::V4(a) if !a.ip().is_unspecified() => format!("http://{a}"),
        SocketAddr::V6(a) if !a.ip().is_unspecified() => format!("http://[{}]:{port}", a.ip()),
        _ => format!("http://127.0.0.1:{port}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_become_loopback_urls() {
        let c = SidecarConfig::parse(
            "upstream: http://127.0.0.1:${FENCEGATE_UPSTREAM_PORT}\n\
             store: {kind: postgres, url: 'postgres://app:${PG_PASSWORD}@db/x'}\n\
             leases: {listen: '0.0.0.0:${LEASE_PORT:-7542}', backend: {kind: embedded}, ttl: 1500ms}\n\
             egress: {upstream: http://ledger:80}\n",
        )
        .unwrap();
        assert_eq!(c.lease_api.as_deref(), Some("http://127.0.0.1:7542"));
        assert_eq!(c.egress_url.as_deref(), Some("http://127.0.0.1:7443"));
        assert!(!c.embedded_store);
        assert_eq!(
            c.app_env(),
            [
                (LEASE_API_ENV, "http://127.0.0.1:7542"),
                (EGRESS_URL_ENV, "http://127.0.0.1:7443")
            ]
        );
        let c = SidecarConfig::parse("upstream: http://a:1\n").unwrap();
        assert_eq!((c.lease_api, c.egress_url), (None, None));
        assert!(c.embedded_store, "the config's default store is embedded");
        assert_eq!(
            local_url("[::1]:7442".parse().unwrap()),
            "http://[::1]:7442"
        );
        assert_eq!(
            local_url("[::]:7442".parse().unwrap()),
            "http://127.0.0.1:7442"
        );
    }

    #[test]
    fn a_refusal_names_the_stand_ins() {
        let e = SidecarConfig::parse(
            "upstream: http://a:1\nstore: {kind: redis, url: '${REDIS_URL}'}\n",
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "store: the `url` does not fit kind redis: write one like redis://127.0.0.1:6379/ at line 2 column 8 (checked with `0` for REDIS_URL, which the pod's environment sets)"
        );
        let e = SidecarConfig::parse("upstream: http://a:1\nlisten: nowhere\n")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("checked with"), "{e}");
    }

    /// A sidecar whose `listen` or `admin` the Service or the probes cannot reach is refused:
    /// the pod would never become ready.
    #[test]
    fn a_listener_the_pod_cannot_reach_is_refused() {
        let refusal = |extra: &str| {
            SidecarConfig::parse(&format!(
                "upstream: http://a:1\nstore: {{ kind: memory }}\n{extra}"
            ))
            .unwrap_err()
            .to_string()
        };
        assert_eq!(
            refusal("listen: 127.0.0.1:7440\n"),
            "`listen: 127.0.0.1:7440`: a loopback address is reached from inside the pod only: \
             the Service's traffic would never arrive; the injected sidecar serves `listen` on \
             port 7440 and `admin` on port 7441 of every address (`0.0.0.0:7440`), where the \
             Service and the probes reach them"
        );
        assert_eq!(
            refusal("admin: '[::1]:7441'\n"),
            "`admin: [::1]:7441`: a loopback address is reached from inside the pod only: the \
             kubelet's probes would fail and the pod would never become ready; the injected \
             sidecar serves `listen` on port 7440 and `admin` on port 7441 of every address \
             (`0.0.0.0:7441`), where the Service and the probes reach them"
        );
        assert!(refusal("admin: 0.0.0.0:9000\n").starts_with(
            "`admin: 0.0.0.0:9000`: the sidecar's container declares port 7441: the kubelet's \
             probes would fail"
        ));
    }
}
