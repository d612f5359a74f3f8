//! The Kubernetes side (docs/kubernetes.md): the one definition of the sidecar container, and the pod
//! surgery that adds it. `fencegate inject` applies it to manifests ([`manifest`]), the
//! mutating admission webhook to pods at creation ([`webhook`]), so both produce the same pod.
//!
//! A pod opts in with the label `fencegate.io/inject: enabled`, or through its namespace's
//! label of the same name and value (webhook only: see [`OptIn`]), where the pod label
//! `fencegate.io/inject: disabled` opts it out. It may set the annotations
//! `fencegate.io/config` (the ConfigMap holding `fencegate.yaml`, default `fencegate`) and
//! `fencegate.io/upstream-port` (default `8080`). A pod that already has a container named
//! `fencegate` is left alone, so injecting twice changes nothing.

pub mod config;
pub mod manifest;
pub mod patch;
pub mod sidecar;
pub mod webhook;
pub mod yaml;

use serde_json::{json, Map, Value};

pub use config::{SidecarConfig, SidecarConfigError};
pub use manifest::{inject_manifests, inject_manifests_with_warnings, InjectWarning, Injected};
pub use sidecar::*;

/// Why a pod that opted in cannot get the sidecar. The pod's author has to fix the manifest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct PodError {
    /// Where in the pod, e.g. `spec.containers` or `metadata.annotations`.
    pub field: String,
    pub message: String,
}

fn pod_error(field: &str, message: impl Into<String>) -> PodError {
    PodError {
        field: field.to_owned(),
        message: message.into(),
    }
}

/// What [`inject_pod`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Injected,
    /// A container named `fencegate` is already there.
    AlreadyInjected,
    /// Not opted in: with [`OptIn::Pod`] no `fencegate.io/inject: enabled` label, with
    /// [`OptIn::Namespace`] a `fencegate.io/inject: disabled` label.
    NotOptedIn,
}

/// Where the opt-in comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptIn {
    /// The pod's own label `fencegate.io/inject: enabled`; no label or any other value means no.
    Pod,
    /// The pod's namespace is labelled `fencegate.io/inject: enabled` (the webhook knows it
    /// from the path the API server calls): every pod is injected but one labelled
    /// `fencegate.io/inject: disabled`. An injected pod without the label gets
    /// `fencegate.io/inject: enabled`, so it looks like any other injected pod (to a
    /// PodMonitor, to `kubectl get pods -l`); a label with another value is kept as it is.
    Namespace,
}

/// The value of the pod's `fencegate.io/inject` label, if it has one.
pub fn inject_label(metadata: Option<&Value>) -> Option<&Value> {
    metadata
        .and_then(|m| m.get("labels"))
        .and_then(|l| l.get(INJECT_LABEL))
}

/// Whether a pod's metadata carries the opt-in label.
pub fn opted_in(metadata: Option<&Value>) -> bool {
    inject_label(metadata).and_then(Value::as_str) == Some(INJECT_ENABLED)
}

/// Whether a pod's metadata carries the opt-out label (which counts where the namespace
/// opted in).
pub fn opted_out(metadata: Option<&Value>) -> bool {
    inject_label(metadata).and_then(Value::as_str) == Some(INJECT_DISABLED)
}

/// Adds the sidecar to a pod, or a pod template: an object with `metadata` and `spec`,
/// when it opted in by its own label.
///
/// `claims` names volumes that will exist without being in the pod spec (a StatefulSet's
/// `volumeClaimTemplates`). On error the pod is unchanged.
pub fn inject_pod(
    pod: &mut Value,
    options: &Options,
    claims: &[&str],
) -> Result<Outcome, PodError> {
    inject_pod_as(pod, options, claims, OptIn::Pod)
}

/// [`inject_pod`], with the opt-in coming from `opt_in`.
pub fn inject_pod_as(
    pod: &mut Value,
    options: &Options,
    claims: &[&str],
    opt_in: OptIn,
) -> Result<Outcome, PodError> {
    let metadata = pod.get("metadata");
    let opted = match opt_in {
        OptIn::Pod => opted_in(metadata),
        OptIn::Namespace => !opted_out(metadata),
    };
    if !opted {
        return Ok(Outcome::NotOptedIn);
    }
    let metadata = metadata.cloned();
    let spec = match pod.get_mut("spec") {
        Some(Value::Object(spec)) => spec,
        _ => return Err(pod_error("spec", "missing or not a mapping")),
    };
    let containers = list(spec, "containers")?;
    let init = list(spec, "initContainers")?;
    let all = || {
        let tagged = |field: &'static str| move |c| (field, c);
        containers
            .iter()
            .map(tagged("spec.containers"))
            .chain(init.iter().map(tagged("spec.initContainers")))
    };
    // Checked first, so an injected pod stays untouched whatever else it says.
    if all().any(|(_, c)| c.get("name").and_then(Value::as_str) == Some(CONTAINER_NAME)) {
        return Ok(Outcome::AlreadyInjected);
    }
    if containers.is_empty() {
        return Err(pod_error("spec.containers", "missing or empty"));
    }
    if opt_in == OptIn::Namespace {
        // Checked now, so that labelling the pod below cannot fail.
        match metadata.as_ref() {
            None | Some(Value::Object(_)) => {}
            Some(_) => return Err(pod_error("metadata", "not a mapping")),
        }
        match metadata.as_ref().and_then(|m| m.get("labels")) {
            None | Some(Value::Null | Value::Object(_)) => {}
            Some(_) => return Err(pod_error("metadata.labels", "not a mapping")),
        }
    }
    let settings = PodSettings::from_metadata(metadata.as_ref(), &options.config_map)?;
    for (field, c) in all() {
        let name = c
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| pod_error(field, "every container needs a name"))?;
        let ports = c
            .get("ports")
            .and_then(Value::as_array)
            .into_iter()
            .flatten();
        for port in ports.filter_map(|p| p.get("containerPort").and_then(Value::as_u64)) {
            if port == u64::from(PROXY_PORT) || port == u64::from(ADMIN_PORT) {
                return Err(pod_error(
                    field,
                    format!(
                        "container `{name}` uses port {port}, which the fencegate sidecar needs"
                    ),
                ));
            }
        }
    }
    let existing: Vec<String> = list(spec, "volumes")?
        .iter()
        .filter_map(|v| v.get("name").and_then(Value::as_str).map(str::to_owned))
        .collect();

    // The pod mounts the ConfigMap the options know about, not a volume of its own.
    let own_config =
        settings.config_map == options.config_map && !existing.iter().any(|v| v == CONFIG_VOLUME);
    if let Some(config) = options.config.as_ref().filter(|_| own_config) {
        if let Some(Value::Array(apps)) = spec.get_mut("containers") {
            for app in apps.iter_mut() {
                add_env(app, &config.app_env());
            }
        }
    }
    let container = sidecar(options, &settings, own_config);
    if options.native {
        match spec.get_mut("initContainers") {
            Some(Value::Array(list)) => list.insert(0, container),
            _ => {
                // Placed just before `containers`, where a reader expects it.
                let at = spec
                    .keys()
                    .position(|k| k == "containers")
                    .unwrap_or(spec.len());
                spec.shift_insert(at, "initContainers".to_owned(), json!([container]));
            }
        }
    } else if let Some(Value::Array(list)) = spec.get_mut("containers") {
        list.push(container);
    }
    for volume in volumes(&settings) {
        let name = volume["name"].as_str().unwrap_or_default();
        if existing.iter().any(|v| v == name) || claims.contains(&name) {
            // The pod brings its own (a Secret for the config, a claim for the data).
            continue;
        }
        match spec.get_mut("volumes") {
            Some(Value::Array(list)) => list.push(volume),
            _ => {
                spec.insert("volumes".to_owned(), json!([volume]));
            }
        }
    }
    if opt_in == OptIn::Namespace {
        label_enabled(pod);
    }
    Ok(Outcome::Injected)
}

/// Adds `fencegate.io/inject: enabled` to a pod without that label. A label already there is
/// never changed: it may be in a controller's selector.
fn label_enabled(pod: &mut Value) {
    let Value::Object(pod) = pod else {
        return;
    };
    let metadata = pod.entry("metadata").or_insert_with(|| json!({}));
    let Value::Object(metadata) = metadata else {
        return;
    };
    let labels = metadata.entry("labels").or_insert_with(|| json!({}));
    if labels.is_null() {
        *labels = json!({});
    }
    if let Value::Object(labels) = labels {
        labels
            .entry(INJECT_LABEL)
            .or_insert_with(|| json!(INJECT_ENABLED));
    }
}

/// Adds the variables an app container does not set itself, after its own.
fn add_env(container: &mut Value, vars: &[(&str, &str)]) {
    let Value::Object(container) = container else {
        return;
    };
    for (name, value) in vars {
        let env = container.entry("env").or_insert_with(|| json!([]));
        if env.is_null() {
            *env = json!([]);
        }
        let Value::Array(env) = env else {
            return;
        };
        if !env
            .iter()
            .any(|e| e.get("name").and_then(Value::as_str) == Some(name))
        {
            env.push(json!({"name": name, "value": value}));
        }
    }
}

/// Whether an injected pod would keep its recorded maxima only as long as it lives: the
/// sidecar config that `options` know (`--config`) uses the embedded store, the pod mounts it,
/// and its `fencegate-data` volume is an `emptyDir` (or a generic ephemeral volume). `claims`
/// are the volume claim templates of its StatefulSet.
pub fn store_dies_with_pod(pod: &Value, options: &Options, claims: &[&str]) -> bool {
    if !options.config.as_ref().is_some_and(|c| c.embedded_store) {
        return false;
    }
    let volumes = pod.pointer("/spec/volumes").and_then(Value::as_array);
    let volume = |name: &str| {
        volumes
            .into_iter()
            .flatten()
            .find(|v| v.get("name").and_then(Value::as_str) == Some(name))
    };
    let config_map = volume(CONFIG_VOLUME)
        .and_then(|v| v.pointer("/configMap/name"))
        .and_then(Value::as_str);
    if config_map != Some(options.config_map.as_str()) || claims.contains(&DATA_VOLUME) {
        return false;
    }
    match volume(DATA_VOLUME) {
        None => true,
        Some(v) => v.get("emptyDir").is_some() || v.get("ephemeral").is_some(),
    }
}

/// A list field of the pod spec: absent or null is empty, anything but a list is an error.
fn list(spec: &Map<String, Value>, key: &str) -> Result<Vec<Value>, PodError> {
    match spec.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) if items.iter().all(Value::is_object) => Ok(items.clone()),
        Some(_) => Err(pod_error(
            &format!("spec.{key}"),
            "must be a list of mappings",
        )),
    }
}
