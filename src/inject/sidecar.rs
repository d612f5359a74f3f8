//! The sidecar container and its volumes: the one definition that `inject` and the webhook
//! share, and what a pod's annotations may change in it.

use serde_json::{json, Value};

use super::{pod_error, PodError, SidecarConfig};

/// The opt-in label and the value that enables injection.
pub const INJECT_LABEL: &str = "fencegate.io/inject";
pub const INJECT_ENABLED: &str = "enabled";
/// The value that opts a pod out where its namespace opted in.
pub const INJECT_DISABLED: &str = "disabled";
/// Names the ConfigMap with `fencegate.yaml`.
pub const CONFIG_ANNOTATION: &str = "fencegate.io/config";
/// The port the application listens on, handed to the sidecar as `FENCEGATE_UPSTREAM_PORT`.
pub const UPSTREAM_PORT_ANNOTATION: &str = "fencegate.io/upstream-port";
pub const DEFAULT_CONFIG_MAP: &str = "fencegate";
pub const DEFAULT_UPSTREAM_PORT: u16 = 8080;

/// The container name; its presence is how an injected pod is recognised.
pub const CONTAINER_NAME: &str = "fencegate";
pub const CONFIG_VOLUME: &str = "fencegate-config";
/// Holds the embedded store. A pod volume (or StatefulSet claim) of this name, say a
/// PersistentVolumeClaim, replaces the emptyDir so the recorded maxima outlive the pod.
pub const DATA_VOLUME: &str = "fencegate-data";
pub const CONFIG_DIR: &str = "/etc/fencegate";
pub const DATA_DIR: &str = "/var/lib/fencegate";
/// The fence proxy port (`listen`), which Services target by its name.
pub const PROXY_PORT: u16 = 7440;
pub const PROXY_PORT_NAME: &str = "fenced-http";
/// Metrics and probes (`admin`).
pub const ADMIN_PORT: u16 = 7441;
pub const ADMIN_PORT_NAME: &str = "admin";
/// The distroless `nonroot` user of the image.
pub const RUN_AS_USER: u32 = 65532;
/// Classic sidecars: how long the `preStop` hook holds SIGTERM back, so the Service stops
/// sending traffic before the proxy closes its listener (docs/operations.md, Shutdown).
pub const PRE_STOP_SLEEP_SECONDS: u32 = 5;

/// How to inject, the same for every pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// The sidecar image.
    pub image: String,
    /// `true`: a native sidecar (`initContainers` with `restartPolicy: Always`, Kubernetes
    /// 1.29+), started before the other init containers and stopped after the app.
    /// `false`: a plain entry in `containers`, for older clusters.
    pub native: bool,
    /// The ConfigMap of pods without the `fencegate.io/config` annotation, and the one that
    /// `config` and `env_from_secret` are about.
    pub config_map: String,
    /// The `fencegate.yaml` of `config_map` (`--config`), for the pods that mount it.
    pub config: Option<SidecarConfig>,
    /// A Secret in the pod's namespace whose keys become the sidecar's environment
    /// (`envFrom`), for the `${VARIABLES}` of `config_map`'s file, on the pods that mount it.
    pub env_from_secret: Option<String>,
}

impl Options {
    /// The image of this very build: the injector and the sidecar versions move together.
    pub fn default_image() -> String {
        format!("ghcr.io/fencegate/fencegate:{}", env!("CARGO_PKG_VERSION"))
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            image: Self::default_image(),
            native: true,
            config_map: DEFAULT_CONFIG_MAP.to_owned(),
            config: None,
            env_from_secret: None,
        }
    }
}

/// What the annotations of one pod ask for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodSettings {
    pub config_map: String,
    pub upstream_port: u16,
}

/// The sidecar container: the only place it is defined. `own_config`: the pod mounts
/// `options.config_map`, so `options.env_from_secret` is for it.
pub fn sidecar(options: &Options, pod: &PodSettings, own_config: bool) -> Value {
    let mut container = json!({
        "name": CONTAINER_NAME,
        "image": options.image,
        "imagePullPolicy": "IfNotPresent",
        "args": ["run", "--config", format!("{CONFIG_DIR}/fencegate.yaml")],
        "ports": [
            {"name": PROXY_PORT_NAME, "containerPort": PROXY_PORT, "protocol": "TCP"},
            {"name": ADMIN_PORT_NAME, "containerPort": ADMIN_PORT, "protocol": "TCP"},
        ],
        "env": [
            {"name": "FENCEGATE_UPSTREAM_PORT", "value": pod.upstream_port.to_string()},
        ],
        // Readiness fails as soon as a drain starts; liveness only while the process serves.
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": ADMIN_PORT_NAME},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": ADMIN_PORT_NAME},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        // A proxy doing one store round trip per write: small and bursty, no CPU limit so
        // it is never throttled in front of the app.
        "resources": {
            "requests": {"cpu": "50m", "memory": "32Mi"},
            "limits": {"memory": "128Mi"},
        },
        "securityContext": {
            "runAsNonRoot": true,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "readOnlyRootFilesystem": true,
            "allowPrivilegeEscalation": false,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [
            {"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": true},
            {"name": DATA_VOLUME, "mountPath": DATA_DIR},
        ],
    });
    if let (Some(secret), Value::Object(fields)) = (
        options.env_from_secret.as_ref().filter(|_| own_config),
        &mut container,
    ) {
        // Store passwords for the config's `${VARIABLES}`, next to `env`.
        let at = fields.keys().position(|k| k == "env").map_or(0, |i| i + 1);
        fields.shift_insert(
            at,
            "envFrom".to_owned(),
            json!([{"secretRef": {"name": secret}}]),
        );
    }
    if options.native {
        // The field that makes an init container a sidecar (KEP-753).
        container["restartPolicy"] = json!("Always");
    } else {
        // A classic sidecar gets SIGTERM with the app, and closes its listener at once: hold
        // the signal back until the endpoints no longer route to the pod. (A native sidecar
        // is stopped after the app.) The `sleep` action needs Kubernetes 1.30; the image
        // has no `sleep` binary to exec.
        container["lifecycle"] = json!({"preStop": {"sleep": {"seconds": PRE_STOP_SLEEP_SECONDS}}});
    }
    container
}

/// The pod volumes the sidecar mounts.
pub fn volumes(pod: &PodSettings) -> [Value; 2] {
    [
        json!({"name": CONFIG_VOLUME, "configMap": {"name": pod.config_map}}),
        json!({"name": DATA_VOLUME, "emptyDir": {}}),
    ]
}

impl PodSettings {
    /// Reads the annotations of a pod (or pod template); `config_map` is the ConfigMap of a
    /// pod without the `fencegate.io/config` annotation.
    pub fn from_metadata(
        metadata: Option<&Value>,
        config_map: &str,
    ) -> Result<PodSettings, PodError> {
        let annotations = metadata.and_then(|m| m.get("annotations"));
        let get = |key: &str| annotations.and_then(|a| a.get(key));
        let field = "metadata.annotations";
        let config_map = match get(CONFIG_ANNOTATION) {
            None => config_map.to_owned(),
            Some(Value::String(name)) if is_dns_subdomain(name) => name.clone(),
            Some(other) => {
                return Err(pod_error(
                    field,
                    format!("{CONFIG_ANNOTATION} must name a ConfigMap (lowercase letters, digits, `-` and `.`), not {other}"),
                ))
            }
        };
        let port = match get(UPSTREAM_PORT_ANNOTATION) {
            None => Some(DEFAULT_UPSTREAM_PORT),
            Some(Value::String(s)) => s.trim().parse::<u16>().ok(),
            Some(Value::Number(n)) => n.as_u64().and_then(|n| u16::try_from(n).ok()),
            Some(_) => None,
        };
        let upstream_port = match port {
            Some(p) if p != 0 && p != PROXY_PORT && p != ADMIN_PORT => p,
            _ => {
                return Err(pod_error(
                    field,
                    format!(
                        "{UPSTREAM_PORT_ANNOTATION} must be a port number from 1 to 65535 other than {PROXY_PORT} and {ADMIN_PORT}, not {}",
                        get(UPSTREAM_PORT_ANNOTATION).map(Value::to_string).unwrap_or_default()
                    ),
                ))
            }
        };
        Ok(PodSettings {
            config_map,
            upstream_port,
        })
    }
}

/// RFC 1123 subdomain, as Kubernetes requires of ConfigMap and Secret names.
pub fn is_dns_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}
