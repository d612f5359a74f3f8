//! `fencegate inject`: multi-document YAML in, the same documents out with the sidecar added
//! to the pod templates that opted in. Only a pod template's own label counts: a manifest does
//! not say what its namespace is labelled, so namespace opt-in is the webhook's alone.
//!
//! The input is split on `---` lines here rather than by the YAML library, so a document that
//! needs no change is copied byte for byte, comments and all. A changed document is written
//! again from its parsed value ([`super::yaml::emit`]): its comments and formatting are lost.

use serde_json::Value;

use super::yaml;
use super::{
    inject_pod, pod_error, Options, Outcome, PodError, SidecarConfig, DATA_VOLUME, INJECT_DISABLED,
    INJECT_ENABLED, INJECT_LABEL,
};

/// Why `inject` refused its input. Every case is a problem with the input.
#[derive(Debug, thiserror::Error)]
pub enum InjectError {
    #[error("document {document} (line {line}): not valid YAML: {message}")]
    Yaml {
        document: usize,
        line: usize,
        message: String,
    },
    #[error("document {document} (line {line}), {object}: cannot inject the sidecar: {error}")]
    Pod {
        document: usize,
        line: usize,
        /// `Kind name`, and the item's index inside a `List`.
        object: String,
        error: PodError,
    },
    #[error("document {document} (line {line}), ConfigMap {name}: {message}")]
    ConfigMap {
        document: usize,
        line: usize,
        name: String,
        message: String,
    },
}

/// A pod template that looks meant to opt in but does not: the label is on the workload
/// instead of its pod template, is an annotation, or has another value than `enabled`. Its
/// document is copied unchanged; the warning says what to write.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("document {document} (line {line}), {object}: {message}")]
pub struct InjectWarning {
    pub document: usize,
    pub line: usize,
    /// `Kind namespace/name` (or `Kind name`), and the item's index inside a `List`.
    pub object: String,
    pub message: String,
}

/// The manifests with the sidecar added, and what looked meant to opt in but did not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Injected {
    pub output: String,
    pub warnings: Vec<InjectWarning>,
}

/// One document of the input: its `---` line (empty for a first document without one) and
/// everything up to the next `---` line.
struct Document<'a> {
    /// 1-based line of the document's first line, for messages.
    line: usize,
    text: &'a str,
}

/// A line that starts a new document: `---` alone, or followed by a space or tab.
fn is_separator(line: &str) -> bool {
    let line = line.trim_end_matches(['\n', '\r']);
    line == "---" || line.starts_with("--- ") || line.starts_with("---\t")
}

fn split(input: &str) -> Vec<Document<'_>> {
    let mut docs = Vec::new();
    let (mut start, mut start_line, mut offset) = (0, 1, 0);
    for (i, line) in input.split_inclusive('\n').enumerate() {
        if is_separator(line) && offset > start {
            docs.push(Document {
                line: start_line,
                text: &input[start..offset],
            });
            (start, start_line) = (offset, i + 1);
        }
        offset += line.len();
    }
    if offset > start || docs.is_empty() {
        docs.push(Document {
            line: start_line,
            text: &input[start..],
        });
    }
    docs
}

/// Only comments, blank lines, directives and markers: nothing to parse.
fn is_blank(text: &str) -> bool {
    text.lines().all(|l| {
        let t = l.trim();
        t.is_empty() || t.starts_with('#') || t.starts_with('%') || t == "---" || t == "..."
    })
}

/// Injects every opted-in pod template of `input`; other documents are copied verbatim. With
/// `options.config`, the ConfigMap it describes comes first (see [`config_maps`]).
pub fn inject_manifests(input: &str, options: &Options) -> Result<String, InjectError> {
    inject_manifests_with_warnings(input, options).map(|injected| injected.output)
}

/// [`inject_manifests`], with a warning for each pod template that looks meant to opt in but
/// does not.
pub fn inject_manifests_with_warnings(
    input: &str,
    options: &Options,
) -> Result<Injected, InjectError> {
    let mut out = String::with_capacity(input.len() * 2);
    let mut warnings = Vec::new();
    let mut objects = Vec::new();
    for (index, doc) in split(input).iter().enumerate() {
        let document = index + 1;
        if is_blank(doc.text) {
            out.push_str(doc.text);
            continue;
        }
        let mut value = yaml::load(doc.text).map_err(|e| InjectError::Yaml {
            document,
            line: doc.line + e.location().map_or(0, |l| l.line().saturating_sub(1)),
            message: e.to_string(),
        })?;
        let mut found = Vec::new();
        let changed =
            inject_object(&mut value, options, &mut found).map_err(|(object, error)| {
                InjectError::Pod {
                    document,
                    line: doc.line,
                    object,
                    error,
                }
            })?;
        warnings.extend(found.into_iter().map(|(object, message)| InjectWarning {
            document,
            line: doc.line,
            object,
            message,
        }));
        if options.config.is_some() {
            objects.push((document, doc.line, value.clone()));
        }
        if !changed {
            out.push_str(doc.text);
            continue;
        }
        if !out.is_empty() && !out.ends_with('\n') {
            out.push('\n');
        }
        let first = doc.text.split_inclusive('\n').next().unwrap_or_default();
        if is_separator(first) {
            out.push_str("---\n");
        }
        out.push_str(&yaml::emit(&value));
    }
    let Some(config) = &options.config else {
        return Ok(Injected {
            output: out,
            warnings,
        });
    };
    let mut first = String::new();
    for config_map in config_maps(&objects, config, options)? {
        if !first.is_empty() {
            first.push_str("---\n");
        }
        first.push_str(&config_map);
    }
    let separated = is_separator(out.split_inclusive('\n').next().unwrap_or_default());
    if !first.is_empty() && !out.is_empty() && !separated {
        first.push_str("---\n");
    }
    Ok(Injected {
        output: first + &out,
        warnings,
    })
}

/// The ConfigMaps, one per namespace, that the output's injected pods mount from
/// `options.config_map`, holding `config`, as YAML documents. A ConfigMap of that name and
/// namespace already in the input is left as it is when it holds the same file (so injecting
/// the output again changes nothing), and refused when it holds another.
fn config_maps(
    objects: &[(usize, usize, Value)],
    config: &SidecarConfig,
    options: &Options,
) -> Result<Vec<String>, InjectError> {
    let mut wanted: Vec<Option<String>> = Vec::new();
    let mut present = Vec::new();
    let mut visit = Vec::new();
    for (document, line, value) in objects {
        visit.push((*document, *line, value));
        while let Some((document, line, object)) = visit.pop() {
            let kind = object
                .get("kind")
                .and_then(Value::as_str)
                .unwrap_or_default();
            let namespace = object
                .pointer("/metadata/namespace")
                .and_then(Value::as_str)
                .map(str::to_owned);
            if kind == "List" || kind.ends_with("List") {
                let items = object.get("items").and_then(Value::as_array);
                // Reversed, so that items are visited in order.
                visit.extend(
                    items
                        .into_iter()
                        .flatten()
                        .rev()
                        .map(|i| (document, line, i)),
                );
            } else if kind == "ConfigMap" {
                if object.pointer("/metadata/name").and_then(Value::as_str)
                    == Some(options.config_map.as_str())
                {
                    let data = object
                        .pointer("/data/fencegate.yaml")
                        .and_then(Value::as_str);
                    present.push((
                        namespace,
                        data == Some(config.text.as_str()),
                        document,
                        line,
                    ));
                }
            } else if let Some(pod) = template(object, kind) {
                let mounts = pod
                    .pointer("/spec/volumes")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .any(|v| {
                        v.get("name").and_then(Value::as_str) == Some(super::CONFIG_VOLUME)
                            && v.pointer("/configMap/name").and_then(Value::as_str)
                                == Some(options.config_map.as_str())
                    });
                if mounts && !wanted.contains(&namespace) {
                    wanted.push(namespace);
                }
            }
        }
    }
    let mut out = Vec::new();
    for namespace in wanted {
        match present.iter().find(|(ns, ..)| *ns == namespace) {
            Some((_, true, ..)) => continue,
            Some((_, false, document, line)) => {
                return Err(InjectError::ConfigMap {
                    document: *document,
                    line: *line,
                    name: options.config_map.clone(),
                    message: "already in the input with another fencegate.yaml than --config: \
                              drop one of them"
                        .to_owned(),
                })
            }
            None => out.push(yaml::emit(
                &config.config_map(&options.config_map, namespace.as_deref()),
            )),
        }
    }
    Ok(out)
}

/// The pod template of a workload object of `kind`, if it has one.
fn template<'a>(object: &'a Value, kind: &str) -> Option<&'a Value> {
    match kind {
        "Pod" => Some(object),
        "Deployment"
        | "StatefulSet"
        | "DaemonSet"
        | "ReplicaSet"
        | "ReplicationController"
        | "Job" => object.pointer("/spec/template"),
        "CronJob" => object.pointer("/spec/jobTemplate/spec/template"),
        _ => None,
    }
}

/// Whether the object was changed; on error, which object (`Kind namespace/name`) failed.
/// `warnings` gets `(object, message)` for a pod template that looks meant to opt in but does
/// not.
fn inject_object(
    object: &mut Value,
    options: &Options,
    warnings: &mut Vec<(String, String)>,
) -> Result<bool, (String, PodError)> {
    let kind = object
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let name = object
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("(unnamed)");
    let described = match object
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
    {
        Some(namespace) => format!("{kind} {namespace}/{name}"),
        None => format!("{kind} {name}"),
    };
    let describe = |e: PodError| (described.clone(), e);
    // Volumes a StatefulSet creates from claim templates are in no pod spec.
    let claims: Vec<String> = object
        .pointer("/spec/volumeClaimTemplates")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|c| c.pointer("/metadata/name").and_then(Value::as_str))
        .map(str::to_owned)
        .collect();
    let claims: Vec<&str> = claims.iter().map(String::as_str).collect();
    let prefix = match kind.as_str() {
        "Pod" => "",
        "Deployment"
        | "StatefulSet"
        | "DaemonSet"
        | "ReplicaSet"
        | "ReplicationController"
        | "Job" => "spec.template.",
        "CronJob" => "spec.jobTemplate.spec.template.",
        k if k == "List" || k.ends_with("List") => {
            let mut changed = false;
            if let Some(Value::Array(items)) = object.get_mut("items") {
                for (i, item) in items.iter_mut().enumerate() {
                    let mut found = Vec::new();
                    changed |= inject_object(item, options, &mut found)
                        .map_err(|(what, e)| (format!("{kind} item {i} ({what})"), e))?;
                    warnings.extend(
                        found
                            .into_iter()
                            .map(|(what, m)| (format!("{kind} item {i} ({what})"), m)),
                    );
                }
            }
            return Ok(changed);
        }
        _ => return Ok(false),
    };
    // What the workload's own metadata says, before its template is borrowed.
    let own = (!prefix.is_empty())
        .then(|| missed_opt_in(object.get("metadata")))
        .flatten();
    let Some(template) = object_template(object, prefix).filter(|t| t.is_object()) else {
        return Ok(false);
    };
    let outcome = match inject_pod(template, options, &claims) {
        Ok(Outcome::Injected) if super::store_dies_with_pod(template, options, &claims) => {
            let why = format!(
                "the sidecar config (--config) uses the embedded store, and {DATA_VOLUME} would be \
                 an emptyDir: every pod would keep maxima of its own and a replaced pod would \
                 start without any; give a StatefulSet whose pods own their shards a \
                 volumeClaimTemplate named {DATA_VOLUME} (or the pod a persistentVolumeClaim \
                 volume of that name), or share a redis, postgres or etcd store"
            );
            return Err(describe(pod_error(&format!("{prefix}spec.volumes"), why)));
        }
        Ok(outcome) => outcome,
        Err(mut e) => {
            e.field = format!("{prefix}{}", e.field);
            return Err(describe(e));
        }
    };
    if outcome == Outcome::NotOptedIn {
        let labels = format!("{prefix}metadata.labels");
        let enable = format!("{INJECT_LABEL}: {INJECT_ENABLED}");
        if let Some(missed) = own {
            let what = match missed {
                Missed::Annotation => "annotation",
                Missed::Value(_) | Missed::Label => "label",
            };
            warnings.push((
                described.clone(),
                format!(
                    "not injected: the {what} {INJECT_LABEL} is on the {kind}'s own metadata, \
                     where it does not count; write {enable} in {labels}"
                ),
            ));
        }
        match missed_opt_in(template.get("metadata")) {
            Some(Missed::Value(value)) => warnings.push((
                described.clone(),
                format!(
                    "not injected: the label {INJECT_LABEL} in {labels} is {value}, and only \
                     \"{INJECT_ENABLED}\" opts in; write {enable}"
                ),
            )),
            Some(Missed::Annotation) => warnings.push((
                described,
                format!(
                    "not injected: {INJECT_LABEL} is an annotation in \
                     {prefix}metadata.annotations, and only a label opts in; write {enable} in \
                     {labels}"
                ),
            )),
            Some(Missed::Label) | None => {}
        }
    }
    Ok(outcome == Outcome::Injected)
}

/// The pod template of a workload (`prefix` as [`inject_object`] sets it), or the pod itself.
fn object_template<'a>(object: &'a mut Value, prefix: &str) -> Option<&'a mut Value> {
    match prefix {
        "" => Some(object),
        "spec.template." => object.pointer_mut("/spec/template"),
        _ => object.pointer_mut("/spec/jobTemplate/spec/template"),
    }
}

/// How metadata mentions `fencegate.io/inject` without opting in by it.
enum Missed {
    /// The label with a value that is neither `enabled` nor `disabled`, as JSON writes it.
    Value(String),
    /// The label `enabled` (on a workload's own metadata, where it does not count).
    Label,
    /// An annotation of that name (and no label).
    Annotation,
}

fn missed_opt_in(metadata: Option<&Value>) -> Option<Missed> {
    let metadata = metadata?;
    match metadata.get("labels").and_then(|l| l.get(INJECT_LABEL)) {
        // An explicit opt-out.
        Some(Value::String(v)) if v == INJECT_DISABLED => None,
        Some(Value::String(v)) if v == INJECT_ENABLED => Some(Missed::Label),
        Some(value) => Some(Missed::Value(value.to_string())),
        None => metadata
            .get("annotations")
            .and_then(|a| a.get(INJECT_LABEL))
            .map(|_| Missed::Annotation),
    }
}
