//! `fencegate webhook`: a mutating admission webhook that injects the sidecar into pods at
//! creation. `POST /mutate` takes an AdmissionReview v1 and answers one, injecting pods
//! labelled `fencegate.io/inject: enabled`; `POST /mutate-namespace` does the same for pods
//! whose namespace carries that label, injecting every pod not labelled
//! `fencegate.io/inject: disabled` (an AdmissionReview does not carry the namespace's labels:
//! the chart's webhook entry for labelled namespaces calls this path). `GET /healthz` and
//! `GET /readyz` are for probes.
//!
//! The webhook never blocks a pod on its own account: anything it cannot or need not inject
//! (another kind, a malformed pod, a bad annotation) is allowed unchanged, with a warning
//! that `kubectl` shows. Only a body that is not an AdmissionReview at all gets a 400.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use http::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use super::{
    inject_label, inject_pod_as, patch, store_dies_with_pod, OptIn, Options, Outcome, DATA_VOLUME,
    INJECT_DISABLED, INJECT_ENABLED, INJECT_LABEL,
};
use crate::body::ProxyBody;
use crate::server::{serve, ServerSettings};

/// An AdmissionReview carries the pod (and on updates the old one): objects are at most
/// 1.5 MiB in etcd, so this leaves room without accepting anything unbounded.
pub const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;
/// The API server truncates longer warnings.
const MAX_WARNING_CHARS: usize = 256;
/// Pods that opted in by their own label.
pub const POD_PATH: &str = "/mutate";
/// Pods of a namespace that opted in, unless they opted out.
pub const NAMESPACE_PATH: &str = "/mutate-namespace";

/// The answer to one request body: a status and a JSON document.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub status: StatusCode,
    pub body: Value,
    /// The object under review, for the log line; empty for a body that is not a review.
    pub subject: Subject,
}

/// Which object a review was about, as far as the request says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Subject {
    pub namespace: String,
    /// The pod's name, or its `generateName` (`ledger-6d9f8b7c5-`) before it has one.
    pub pod: String,
    /// `Kind/name` of its controller (or first owner), e.g. `ReplicaSet/ledger-6d9f8b7c5`.
    pub owner: String,
}

impl Subject {
    fn of(request: &Value) -> Subject {
        let text = |v: Option<&Value>| {
            v.and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
        };
        let metadata = request.pointer("/object/metadata");
        let field = |key: &str| text(metadata.and_then(|m| m.get(key)));
        let owners = metadata
            .and_then(|m| m.get("ownerReferences"))
            .and_then(Value::as_array);
        let owner = owners
            .and_then(|o| {
                o.iter()
                    .find(|r| r.get("controller") == Some(&Value::Bool(true)))
                    .or_else(|| o.first())
            })
            .map(|r| {
                format!(
                    "{}/{}",
                    text(r.get("kind")).unwrap_or_default(),
                    text(r.get("name")).unwrap_or_default()
                )
            });
        Subject {
            namespace: text(request.get("namespace"))
                .or_else(|| field("namespace"))
                .unwrap_or_default(),
            pod: field("name")
                .or_else(|| text(request.get("name")))
                .or_else(|| field("generateName"))
                .unwrap_or_default(),
            owner: owner.unwrap_or_default(),
        }
    }
}

fn bad_request(message: impl Into<String>) -> Reply {
    Reply {
        status: StatusCode::BAD_REQUEST,
        body: json!({"error": message.into()}),
        subject: Subject::default(),
    }
}

/// Decides the answer to one `POST /mutate` (`opt_in` [`OptIn::Pod`]) or
/// `POST /mutate-namespace` ([`OptIn::Namespace`]) body. Pure: no I/O, no clock.
pub fn review(body: &[u8], options: &Options, opt_in: OptIn) -> Reply {
    let review: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return bad_request(format!("the body is not JSON: {e}")),
    };
    if review.get("kind").and_then(Value::as_str) != Some("AdmissionReview")
        || review.get("apiVersion").and_then(Value::as_str) != Some("admission.k8s.io/v1")
    {
        return bad_request("expected an AdmissionReview of apiVersion admission.k8s.io/v1");
    }
    let Some(request) = review.get("request").filter(|r| r.is_object()) else {
        return bad_request("the AdmissionReview has no `request`");
    };
    let Some(uid) = request.get("uid").and_then(Value::as_str) else {
        return bad_request("the AdmissionReview request has no `uid`");
    };
    let mut response = json!({"uid": uid, "allowed": true});
    let warnings = match decide(request, options, opt_in) {
        Decision::Unchanged => Vec::new(),
        Decision::Warn(warning) => vec![warning],
        Decision::Patch(ops, warnings) => {
            let encoded = serde_json::to_vec(&ops).expect("JSON values serialise");
            response["patchType"] = json!("JSONPatch");
            response["patch"] = json!(base64::engine::general_purpose::STANDARD.encode(encoded));
            warnings
        }
    };
    if !warnings.is_empty() {
        let warnings: Vec<String> = warnings
            .iter()
            .map(|w| {
                format!("fencegate: {w}")
                    .chars()
                    .take(MAX_WARNING_CHARS)
                    .collect()
            })
            .collect();
        response["warnings"] = json!(warnings);
    }
    Reply {
        status: StatusCode::OK,
        body: json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": response,
        }),
        subject: Subject::of(request),
    }
}

enum Decision {
    Unchanged,
    Warn(String),
    /// Inject, with warnings: the pod's label looks like a failed attempt to opt out; the
    /// embedded store would live in an emptyDir.
    Patch(Vec<Value>, Vec<String>),
}

fn decide(request: &Value, options: &Options, opt_in: OptIn) -> Decision {
    let kind = request.get("kind");
    let group = kind.and_then(|k| k.get("group")).and_then(Value::as_str);
    let name = kind.and_then(|k| k.get("kind")).and_then(Value::as_str);
    if group != Some("") || name != Some("Pod") {
        let what = match (group, name) {
            (Some(""), Some(n)) => n.to_owned(),
            (Some(g), Some(n)) => format!("{g}/{n}"),
            _ => "an object without request.kind".to_owned(),
        };
        return Decision::Warn(format!("{what} is not a Pod; passed unchanged"));
    }
    if let Some(sub) = request.get("subResource").and_then(Value::as_str) {
        return Decision::Warn(format!("subresource {sub} passed unchanged"));
    }
    let operation = request.get("operation").and_then(Value::as_str);
    if operation != Some("CREATE") {
        return Decision::Warn(format!(
            "injects at CREATE only; {} passed unchanged",
            operation.unwrap_or("an unnamed operation")
        ));
    }
    let Some(pod) = request.get("object").filter(|o| o.is_object()) else {
        return Decision::Warn("the request has no pod object; passed unchanged".to_owned());
    };
    let mut injected = pod.clone();
    match inject_pod_as(&mut injected, options, &[], opt_in) {
        Ok(Outcome::Injected) => {
            // Only `disabled` opts out of a namespace's opt-in; say so to whoever tried
            // another value.
            let mut warnings: Vec<String> = inject_label(pod.get("metadata"))
                .filter(|v| v.as_str() != Some(INJECT_ENABLED))
                .map(|v| {
                    format!(
                        "label {INJECT_LABEL}: {v} does not opt out (only {INJECT_DISABLED} does); injected because the namespace opted in"
                    )
                })
                .into_iter()
                .collect();
            if store_dies_with_pod(&injected, options, &[]) {
                warnings.push(format!(
                    "embedded store on an emptyDir: this pod's maxima are its own and die with it; mount a PersistentVolumeClaim as {DATA_VOLUME} (a StatefulSet's volumeClaimTemplate) or share a redis, postgres or etcd store"
                ));
            }
            Decision::Patch(patch::diff(pod, &injected), warnings)
        }
        Ok(Outcome::AlreadyInjected | Outcome::NotOptedIn) => Decision::Unchanged,
        Err(e) => Decision::Warn(format!("sidecar not injected: {e}")),
    }
}

fn json_response(reply: &Reply) -> Response<ProxyBody> {
    let mut resp = Response::new(ProxyBody::local(reply.body.to_string()));
    *resp.status_mut() = reply.status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

fn error(status: StatusCode, message: &str) -> Response<ProxyBody> {
    json_response(&Reply {
        status,
        body: json!({"error": message}),
        subject: Subject::default(),
    })
}

/// One HTTP request to the webhook.
pub async fn handle(req: Request<Incoming>, options: Arc<Options>) -> Response<ProxyBody> {
    match (req.method(), req.uri().path()) {
        (&Method::GET | &Method::HEAD, "/healthz" | "/readyz") => {
            Response::new(ProxyBody::local("ok"))
        }
        (&Method::POST, path @ (POD_PATH | NAMESPACE_PATH)) => {
            let opt_in = if path == NAMESPACE_PATH {
                OptIn::Namespace
            } else {
                OptIn::Pod
            };
            let body = match Limited::new(req.into_body(), MAX_BODY_BYTES)
                .collect()
                .await
            {
                Ok(collected) => collected.to_bytes(),
                Err(e)
                    if e.downcast_ref::<http_body_util::LengthLimitError>()
                        .is_some() =>
                {
                    return error(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        "the body is larger than 8 MiB",
                    )
                }
                Err(e) => {
                    tracing::debug!(error = %e, "reading an AdmissionReview failed");
                    return error(StatusCode::BAD_REQUEST, "the body could not be read");
                }
            };
            let reply = review(&body, &options, opt_in);
            log(&reply);
            json_response(&reply)
        }
        (method, path @ (POD_PATH | NAMESPACE_PATH | "/healthz" | "/readyz")) => {
            let (allow, listed) = if path.starts_with("/mutate") {
                ("POST", "POST")
            } else {
                ("GET, HEAD", "GET and HEAD")
            };
            let message = format!("{path} accepts {listed}, not {method}");
            let mut resp = error(StatusCode::METHOD_NOT_ALLOWED, &message);
            resp.headers_mut()
                .insert(ALLOW, HeaderValue::from_static(allow));
            resp
        }
        _ => error(StatusCode::NOT_FOUND, "not found"),
    }
}

/// One line per review: its `uid`, the pod's `namespace`, `pod` (name or generateName) and
/// `owner` (`Kind/name`), whether it was `injected`, and the warnings.
fn log(reply: &Reply) {
    let response = &reply.body["response"];
    let uid = response["uid"].as_str().unwrap_or_default();
    if reply.status != StatusCode::OK {
        let error = reply.body["error"].as_str().unwrap_or_default();
        tracing::warn!(
            status = reply.status.as_u16(),
            error,
            "AdmissionReview refused"
        );
        return;
    }
    let Subject {
        namespace,
        pod,
        owner,
    } = &reply.subject;
    let injected = response.get("patch").is_some();
    let warnings: Vec<&str> = response["warnings"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let warning = warnings.join("; ");
    match (warnings.is_empty(), injected) {
        (true, _) => tracing::info!(uid, namespace, pod, owner, injected, "admitted"),
        (false, true) => tracing::warn!(
            uid,
            namespace,
            pod,
            owner,
            injected,
            warning,
            "admitted, with a warning"
        ),
        (false, false) => tracing::warn!(
            uid,
            namespace,
            pod,
            owner,
            injected,
            warning,
            "admitted unchanged, with a warning"
        ),
    }
}

/// Connection settings for the webhook: the API server is the only client.
pub fn settings(tls: Arc<rustls::ServerConfig>) -> ServerSettings {
    ServerSettings {
        tls: Some(TlsAcceptor::from(tls)),
        header_read: Duration::from_secs(10),
        max_header_bytes: 16 * 1024,
        max_headers: 100,
        max_connections: 1024,
        // The API server's own timeout for a webhook call is at most 30 s.
        drain: Duration::from_secs(10),
    }
}

/// Serves the webhook over TLS on `listener` until `shutdown`, then drains.
pub async fn serve_webhook(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    options: Options,
    shutdown: impl Future<Output = ()>,
) {
    let options = Arc::new(options);
    serve(
        listener,
        settings(tls),
        move |req, _peer| {
            let options = Arc::clone(&options);
            async move { Ok::<_, Infallible>(handle(req, options).await) }
        },
        shutdown,
    )
    .await;
}
