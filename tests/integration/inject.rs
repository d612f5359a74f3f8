//! The Kubernetes side: `fencegate inject` on real-world manifests against golden files in
//! `tests/inject/`, and the admission webhook over real TLS, whose patch must produce exactly
//! the pod that `inject` produces.
//!
//! Goldens are compared byte for byte. After an intended change, regenerate them with
//! `FENCEGATE_BLESS=1 cargo test --test integration inject` and review the diff.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;

use base64::Engine as _;
use bytes::Bytes;
use fencegate::config::TlsConfig;
use fencegate::inject::{inject_manifests, yaml, Options, SidecarConfig};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnectorBuilder;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use crate::common::Reply;
use crate::process::wait_log;

const BIN: &str = env!("CARGO_BIN_EXE_fencegate");

/// A fixed image, so the goldens do not change with every release.
const IMAGE: &str = "ghcr.io/fencegate/fencegate:0.0.0-golden";

fn native() -> Options {
    Options {
        image: IMAGE.to_owned(),
        native: true,
        ..Options::default()
    }
}

fn classic() -> Options {
    Options {
        image: IMAGE.to_owned(),
        native: false,
        ..Options::default()
    }
}

/// `options` with `tests/inject/config/<config>` as `--config` and `secret` as
/// `--env-from-secret`.
fn with_config(options: Options, config: &str, secret: Option<&str>) -> Options {
    let text = read(&format!("tests/inject/config/{config}"));
    Options {
        config: Some(SidecarConfig::parse(&text).unwrap_or_else(|e| panic!("{config}: {e}"))),
        env_from_secret: secret.map(str::to_owned),
        ..options
    }
}

fn path(relative: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(relative)
}

fn read(relative: &str) -> String {
    std::fs::read_to_string(path(relative))
        .unwrap_or_else(|e| panic!("cannot read {relative}: {e}"))
}

/// Injects `tests/inject/<case>.yaml` and compares with `<case>.golden.yaml`; the output must
/// also be a fixed point (injecting it again changes nothing).
fn golden(case: &str, options: &Options) -> String {
    let input = read(&format!("tests/inject/{case}.yaml"));
    let output = inject_manifests(&input, options).unwrap_or_else(|e| panic!("{case}: {e}"));
    let golden = format!("tests/inject/{case}.golden.yaml");
    if std::env::var_os("FENCEGATE_BLESS").is_some() {
        std::fs::write(path(&golden), &output).unwrap();
    }
    let expected = std::fs::read_to_string(path(&golden)).unwrap_or_else(|e| {
        panic!(
            "{golden}: {e}; create it with FENCEGATE_BLESS=1 cargo test --test integration inject"
        )
    });
    assert!(
        output == expected,
        "{case}: output differs from {golden} (FENCEGATE_BLESS=1 regenerates it):\n{output}"
    );
    let again = inject_manifests(&output, options).unwrap();
    assert_eq!(again, output, "{case}: injecting twice changed the output");
    output
}

/// The case needs no change: the output is the input, byte for byte.
fn unchanged(case: &str, options: &Options) {
    let input = read(&format!("tests/inject/{case}.yaml"));
    let output = inject_manifests(&input, options).unwrap_or_else(|e| panic!("{case}: {e}"));
    assert!(output == input, "{case} changed:\n{output}");
}

/// Every document of a YAML stream, parsed as Kubernetes reads it.
fn documents(text: &str) -> Vec<Value> {
    // The newline before `---` ends the document's last line.
    text.split("\n---\n")
        .map(|d| yaml::load(&format!("{d}\n")).unwrap())
        .filter(|d| !d.is_null())
        .collect()
}

fn containers(pod_spec: &Value, field: &str) -> Vec<String> {
    pod_spec[field]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| c["name"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn inject_multi_container_deployment_matches_golden() {
    let out = golden("deployment-multi", &native());
    let deployment = &documents(&out)[0];
    let spec = &deployment["spec"]["template"]["spec"];
    assert_eq!(containers(spec, "initContainers"), ["fencegate"]);
    assert_eq!(containers(spec, "containers"), ["api", "log-shipper"]);
    let sidecar = &spec["initContainers"][0];
    assert_eq!(sidecar["restartPolicy"], "Always");
    assert_eq!(sidecar["image"], IMAGE);
    assert_eq!(
        sidecar["env"][0],
        json!({"name": "FENCEGATE_UPSTREAM_PORT", "value": "8081"})
    );
    let volumes = spec["volumes"].as_array().unwrap();
    assert!(volumes
        .contains(&json!({"name": "fencegate-config", "configMap": {"name": "ledger-fencegate"}})));
    assert!(volumes.contains(&json!({"name": "fencegate-data", "emptyDir": {}})));
    // Kubernetes reads plain 0440 and 0644 as octal: the rewrite must keep the numbers.
    assert_eq!(volumes[0]["configMap"]["defaultMode"], 0o440);
    assert_eq!(volumes[1]["configMap"]["items"][0]["mode"], 0o644);
    assert_eq!(spec["containers"][0]["env"][1]["value"], "on");
}

#[test]
fn inject_existing_init_containers_and_claim_match_golden() {
    let out = golden("statefulset-init", &native());
    let sts = &documents(&out)[0];
    let spec = &sts["spec"]["template"]["spec"];
    // First, so it serves while the other init containers run.
    assert_eq!(
        containers(spec, "initContainers"),
        ["fencegate", "migrate", "warm-cache"]
    );
    let volumes: Vec<&str> = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    // `fencegate-data` comes from the claim template, not an emptyDir.
    assert_eq!(volumes, ["cache", "fencegate-config"]);
}

#[test]
fn inject_list_matches_golden() {
    let out = golden("list", &native());
    let list = &documents(&out)[0];
    let items = list["items"].as_array().unwrap();
    assert_eq!(items.len(), 4);
    let input = yaml::load(&read("tests/inject/list.yaml")).unwrap();
    assert_eq!(items[0], input["items"][0], "the Service is unchanged");
    assert_eq!(items[1], input["items"][1], "the ConfigMap is unchanged");
    assert_eq!(items[1]["data"]["enabled"], "yes");
    let deployment = &items[2]["spec"]["template"]["spec"];
    assert_eq!(containers(deployment, "initContainers"), ["fencegate"]);
    let cron = &items[3]["spec"]["jobTemplate"]["spec"]["template"]["spec"];
    assert_eq!(containers(cron, "initContainers"), ["fencegate"]);
    assert_eq!(cron["initContainers"][0]["env"][0]["value"], "9090");
}

#[test]
fn inject_pod_job_and_unlabelled_daemonset_match_golden() {
    let out = golden("mixed", &native());
    let docs = documents(&out);
    let pod = &docs[0]["spec"];
    assert_eq!(containers(pod, "initContainers"), ["fencegate"]);
    // The pod's own `fencegate-config` volume (a Secret) is kept, not duplicated.
    assert_eq!(pod["volumes"].as_array().unwrap().len(), 2);
    assert_eq!(
        pod["volumes"][0]["secret"]["secretName"],
        "worker-fencegate"
    );
    assert_eq!(
        containers(&docs[1]["spec"]["template"]["spec"], "initContainers"),
        ["fencegate"]
    );
    // The DaemonSet did not opt in: copied verbatim, after the injected documents.
    let input = read("tests/inject/mixed.yaml");
    let daemonset = &input[input.rfind("---\n").unwrap()..];
    assert!(out.ends_with(daemonset));
}

#[test]
fn inject_classic_matches_golden() {
    let out = golden("classic", &classic());
    let spec = &documents(&out)[0]["spec"]["template"]["spec"];
    assert_eq!(containers(spec, "containers"), ["accounts", "fencegate"]);
    assert!(spec.get("initContainers").is_none());
    assert!(spec["containers"][1].get("restartPolicy").is_none());
    // It gets SIGTERM with the app: hold it back until the endpoints stop routing here.
    assert_eq!(
        spec["containers"][1]["lifecycle"],
        json!({"preStop": {"sleep": {"seconds": 5}}})
    );
    assert!(spec["containers"][0].get("lifecycle").is_none());
}

#[test]
fn inject_native_sidecar_has_no_pre_stop() {
    // Stopped after the app by Kubernetes itself.
    let out = inject_manifests(&read("tests/inject/classic.yaml"), &native()).unwrap();
    let sidecar = &documents(&out)[0]["spec"]["template"]["spec"]["initContainers"][0];
    assert_eq!(sidecar["restartPolicy"], "Always");
    assert!(sidecar.get("lifecycle").is_none(), "{sidecar}");
}

#[test]
fn inject_config_writes_the_config_map_and_app_env_matches_golden() {
    let options = with_config(native(), "leases-egress.yaml", Some("fencegate-store"));
    let out = golden("env", &options);
    let docs = documents(&out);
    assert_eq!(docs.len(), 3, "one ConfigMap, then the two Deployments");
    assert_eq!(
        docs[0],
        json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": "fencegate",
                "namespace": "payments",
                "labels": {"app.kubernetes.io/part-of": "fencegate"},
            },
            // The file as written, comments and ${VARIABLES} included.
            "data": {"fencegate.yaml": read("tests/inject/config/leases-egress.yaml")},
        })
    );
    let spec = &docs[1]["spec"]["template"]["spec"];
    assert_eq!(
        spec["containers"][0]["env"],
        json!([
            {"name": "LOG_LEVEL", "value": "info"},
            {"name": "FENCEGATE_LEASE_API", "value": "http://127.0.0.1:7442"},
            {"name": "FENCEGATE_EGRESS_URL", "value": "http://127.0.0.1:7543"},
        ])
    );
    assert_eq!(
        spec["containers"][1]["env"],
        json!([
            {"name": "FENCEGATE_EGRESS_URL", "value": "http://127.0.0.1:9443"},
            {"name": "FENCEGATE_LEASE_API", "value": "http://127.0.0.1:7442"},
        ])
    );
    let sidecar = &spec["initContainers"][0];
    assert_eq!(
        sidecar["env"],
        json!([{"name": "FENCEGATE_UPSTREAM_PORT", "value": "8080"}])
    );
    assert_eq!(
        sidecar["envFrom"],
        json!([{"secretRef": {"name": "fencegate-store"}}])
    );
    // The pod with a ConfigMap of its own gets nothing that --config implies.
    let audit = &docs[2]["spec"]["template"]["spec"];
    assert!(audit["containers"][0].get("env").is_none(), "{audit}");
    assert!(
        audit["initContainers"][0].get("envFrom").is_none(),
        "{audit}"
    );
    assert_eq!(
        audit["volumes"][0],
        json!({"name": "fencegate-config", "configMap": {"name": "audit-fencegate"}})
    );
}

#[test]
fn inject_walkthrough_matches_golden() {
    let options = with_config(native(), "redis.yaml", Some("fencegate-store"));
    let out = golden("walkthrough-ledger", &options);
    let docs = documents(&out);
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["ConfigMap", "Deployment", "Service"]);
    assert_eq!(docs[0]["metadata"]["namespace"], "payments");
    // No leases or egress in this config: the app's environment is its own.
    let spec = &docs[1]["spec"]["template"]["spec"];
    assert!(spec["containers"][0].get("env").is_none(), "{spec}");
    assert_eq!(
        spec["initContainers"][0]["envFrom"],
        json!([{"secretRef": {"name": "fencegate-store"}}])
    );
    // The Service reaches the sidecar by port number, which works before Kubernetes 1.32.
    assert_eq!(docs[2]["spec"]["ports"][0]["targetPort"], json!(7440));
    assert_eq!(
        spec["initContainers"][0]["ports"][0],
        json!({"name": "fenced-http", "containerPort": 7440, "protocol": "TCP"})
    );
    // Unchanged documents are copied byte for byte.
    let input = read("tests/inject/walkthrough-ledger.yaml");
    assert!(out.ends_with(&input[input.find("---\napiVersion: v1\nkind: Service").unwrap()..]));
}

#[test]
fn inject_embedded_store_on_a_claim_matches_golden() {
    let out = golden("shards", &with_config(native(), "embedded.yaml", None));
    let docs = documents(&out);
    assert_eq!(docs[0]["kind"], "ConfigMap");
    assert_eq!(docs[0]["metadata"]["namespace"], "inventory");
    let spec = &docs[1]["spec"]["template"]["spec"];
    // The data volume is the claim, never an emptyDir.
    assert_eq!(
        spec["volumes"],
        json!([{"name": "fencegate-config", "configMap": {"name": "fencegate"}}])
    );
}

#[test]
fn inject_refuses_the_embedded_store_on_an_empty_dir() {
    let options = with_config(classic(), "embedded.yaml", None);
    let e = inject_manifests(&read("tests/inject/classic.yaml"), &options)
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "document 1 (line 1), Deployment accounts: cannot inject the sidecar: \
         spec.template.spec.volumes: the sidecar config (--config) uses the embedded store, \
         and fencegate-data would be an emptyDir: every pod would keep maxima of its own and a \
         replaced pod would start without any; give a StatefulSet whose pods own their shards \
         a volumeClaimTemplate named fencegate-data (or the pod a persistentVolumeClaim volume \
         of that name), or share a redis, postgres or etcd store"
    );
    // A persistentVolumeClaim volume of that name is the pod's own choice.
    let with_claim = read("tests/inject/classic.yaml").replace(
        "        - containerPort: 8080\n",
        "        - containerPort: 8080\n      volumes:\n      - name: fencegate-data\n        persistentVolumeClaim: {claimName: accounts-fences}\n",
    );
    let out = inject_manifests(&with_claim, &options).unwrap();
    assert!(out.contains("claimName: accounts-fences"), "{out}");
    assert!(!out.contains("emptyDir"), "{out}");
}

#[test]
fn inject_config_map_already_in_the_input() {
    let options = with_config(native(), "embedded.yaml", None);
    let sts = read("tests/inject/shards.yaml");
    // The same file: left as it is, no second copy.
    let same = yaml::emit(&json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "fencegate", "namespace": "inventory"},
        "data": {"fencegate.yaml": read("tests/inject/config/embedded.yaml")},
    }));
    let out = inject_manifests(&format!("{same}---\n{sts}"), &options).unwrap();
    assert!(out.starts_with(&format!("{same}---\n")), "{out}");
    assert_eq!(out.matches("kind: ConfigMap").count(), 1, "{out}");
    // Another file: refused, naming the document.
    let other = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: fencegate, namespace: inventory}\ndata:\n  fencegate.yaml: |\n    upstream: http://127.0.0.1:9000\n";
    let e = inject_manifests(&format!("{sts}---\n{other}"), &options)
        .unwrap_err()
        .to_string();
    let line = sts.lines().count() + 1;
    assert_eq!(
        e,
        format!(
            "document 3 (line {line}), ConfigMap fencegate: already in the input with another \
             fencegate.yaml than --config: drop one of them"
        )
    );
    // In another namespace it is another ConfigMap.
    let elsewhere = other.replace("namespace: inventory", "namespace: staging");
    let out = inject_manifests(&format!("{sts}---\n{elsewhere}"), &options).unwrap();
    assert_eq!(out.matches("kind: ConfigMap").count(), 2, "{out}");
}

/// The walk-through in docs/kubernetes.md shows these files whole: the ones CI validates and the
/// goldens inject.
#[test]
fn inject_walkthrough_files_are_the_ones_in_the_docs() {
    let docs = read("docs/kubernetes.md");
    for file in [
        "tests/inject/walkthrough-redis.yaml",
        "tests/inject/walkthrough-ledger.yaml",
        "tests/inject/shards.yaml",
        "charts/fencegate/ci/redis-values.yaml",
    ] {
        let block = format!("```yaml\n{}```\n", read(file));
        assert!(
            docs.contains(&block),
            "docs/kubernetes.md does not show {file} as it is"
        );
    }
}

#[test]
fn inject_config_is_checked_with_stand_ins_for_the_pod_environment() {
    let e = SidecarConfig::parse(&read("tests/inject/config/invalid.yaml")).unwrap_err();
    // The URL is masked as in every message about a store URL.
    assert_eq!(
        e.to_string(),
        "store: the `url` does not fit kind redis: write one like redis://127.0.0.1:6379/ \
         at line 3 column 3 (checked with `0` for REDIS_URL, which the pod's environment sets)"
    );
}

#[test]
fn inject_leaves_objects_without_pods_byte_identical() {
    unchanged("non-pod", &native());
    unchanged("non-pod", &classic());
}

#[test]
fn inject_leaves_pods_without_the_label_byte_identical() {
    unchanged("no-label", &native());
}

#[test]
fn inject_leaves_an_already_injected_pod_byte_identical() {
    // Injected earlier (with another image, by the classic or the native form), then edited
    // by hand: comments included, nothing may change.
    unchanged("already-injected", &native());
    unchanged("already-injected", &classic());
}

#[test]
fn inject_default_image_is_this_version() {
    assert_eq!(
        Options::default().image,
        format!("ghcr.io/fencegate/fencegate:{}", env!("CARGO_PKG_VERSION"))
    );
    assert!(Options::default().native);
}

#[test]
fn inject_refuses_malformed_input_with_the_document_and_line() {
    let broken = "apiVersion: v1\nkind: Service\n---\nkind: Pod\nmetadata: {name: x\n";
    let e = inject_manifests(broken, &native()).unwrap_err().to_string();
    assert!(e.starts_with("document 2 (line "), "{e}");
    assert!(e.contains("not valid YAML"), "{e}");

    let no_containers =
        "kind: Pod\nmetadata:\n  name: p\n  labels: {fencegate.io/inject: enabled}\nspec: {}\n";
    let e = inject_manifests(no_containers, &native())
        .unwrap_err()
        .to_string();
    assert!(e.contains("Pod p") && e.contains("spec.containers"), "{e}");

    let bad_port = "kind: Deployment\nmetadata: {name: d}\nspec:\n  template:\n    metadata:\n      labels: {fencegate.io/inject: enabled}\n      annotations: {fencegate.io/upstream-port: http}\n    spec:\n      containers: [{name: a}]\n";
    let e = inject_manifests(bad_port, &native())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("Deployment d") && e.contains("spec.template.metadata.annotations"),
        "{e}"
    );
    assert!(e.contains("fencegate.io/upstream-port"), "{e}");

    let clash = "kind: Pod\nmetadata: {name: p, labels: {fencegate.io/inject: enabled}}\nspec:\n  containers: [{name: a, ports: [{containerPort: 7440}]}]\n";
    let e = inject_manifests(clash, &native()).unwrap_err().to_string();
    assert!(e.contains("port 7440"), "{e}");
}

/// `fencegate inject` reads `-f FILE` or stdin and writes stdout; bad input exits 1.
#[tokio::test]
async fn inject_cli_reads_file_or_stdin_and_exits_1_on_bad_input() {
    let file = path("tests/inject/classic.yaml");
    let expected = read("tests/inject/classic.golden.yaml");
    let out = tokio::process::Command::new(BIN)
        .args(["inject", "--classic", "--image", IMAGE, "-f"])
        .arg(&file)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8(out.stdout).unwrap(), expected);

    let run_stdin = |input: String, args: &'static [&'static str]| async move {
        let mut child = tokio::process::Command::new(BIN)
            .arg("inject")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(input.as_bytes()).await.unwrap();
        drop(stdin);
        child.wait_with_output().await.unwrap()
    };
    let out = run_stdin(
        read("tests/inject/statefulset-init.yaml"),
        &["--image", IMAGE],
    )
    .await;
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        read("tests/inject/statefulset-init.golden.yaml")
    );

    let out = run_stdin("kind: Pod\nspec: [\n".to_owned(), &[]).await;
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.starts_with("error: stdin: document 1"), "{stderr}");
    assert!(out.stdout.is_empty(), "nothing is written on error");
}

/// A label that looks meant to opt in but does not count (on the Deployment instead of its pod
/// template, the Istio habit `"true"` instead of `enabled`, an annotation) is a warning on
/// stderr naming the object and what to write; the manifests are written out unchanged.
#[tokio::test]
async fn inject_warns_about_an_opt_in_that_does_not_count() {
    let input = "apiVersion: apps/v1
kind: Deployment
metadata:
  name: ledger
  namespace: payments
  labels:
    fencegate.io/inject: enabled
spec:
  template:
    metadata:
      labels: {app: ledger}
    spec:
      containers: [{name: ledger, image: ledger:1}]
---
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: orders}
spec:
  template:
    metadata:
      labels:
        fencegate.io/inject: \"true\"
    spec:
      containers: [{name: orders, image: orders:1}]
---
apiVersion: v1
kind: Pod
metadata:
  name: worker
  namespace: jobs
  annotations: {fencegate.io/inject: enabled}
spec:
  containers: [{name: worker, image: worker:1}]
---
apiVersion: batch/v1
kind: CronJob
metadata: {name: nightly, labels: {fencegate.io/inject: disabled}}
spec:
  jobTemplate:
    spec:
      template:
        spec:
          containers: [{name: nightly, image: nightly:1}]
";
    let inject = |input: String| async move {
        let mut child = tokio::process::Command::new(BIN)
            .args(["inject", "--image", IMAGE])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(input.as_bytes()).await.unwrap();
        drop(stdin);
        let out = child.wait_with_output().await.unwrap();
        assert_eq!(out.status.code(), Some(0));
        (
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8(out.stderr).unwrap(),
        )
    };
    let (stdout, stderr) = inject(input.to_owned()).await;
    assert_eq!(stdout, input);
    assert_eq!(
        stderr.lines().collect::<Vec<_>>(),
        [
            "warning: stdin: document 1 (line 1), Deployment payments/ledger: not injected: the \
             label fencegate.io/inject is on the Deployment's own metadata, where it does not \
             count; write fencegate.io/inject: enabled in spec.template.metadata.labels",
            "warning: stdin: document 2 (line 14), StatefulSet orders: not injected: the label \
             fencegate.io/inject in spec.template.metadata.labels is \"true\", and only \
             \"enabled\" opts in; write fencegate.io/inject: enabled",
            "warning: stdin: document 3 (line 25), Pod jobs/worker: not injected: \
             fencegate.io/inject is an annotation in metadata.annotations, and only a label opts \
             in; write fencegate.io/inject: enabled in metadata.labels",
        ]
    );

    // Opted in as documented, or opted out on purpose (the CronJob above): not a word.
    let (stdout, stderr) = inject(read("tests/inject/deployment-multi.yaml")).await;
    assert_eq!(stdout, read("tests/inject/deployment-multi.golden.yaml"));
    assert_eq!(stderr, "");
}

/// `--config`, `--env-from-secret` and `--config-map` on the command line.
#[tokio::test]
async fn inject_cli_writes_the_config_map_of_config() {
    let inject = |args: &[&str]| {
        std::process::Command::new(BIN)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .arg("inject")
            .args(args)
            .output()
            .unwrap()
    };
    let out = inject(&[
        "--config",
        "tests/inject/config/leases-egress.yaml",
        "--env-from-secret",
        "fencegate-store",
        "--image",
        IMAGE,
        "-f",
        "tests/inject/env.yaml",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        read("tests/inject/env.golden.yaml")
    );

    // --config-map names the ConfigMap of pods without the annotation, and of --config.
    let out = inject(&[
        "--config",
        "tests/inject/config/leases-egress.yaml",
        "--config-map",
        "audit-fencegate",
        "-f",
        "tests/inject/env.yaml",
    ]);
    assert!(out.status.success());
    let docs = documents(&String::from_utf8(out.stdout).unwrap());
    assert_eq!(docs[0]["metadata"]["name"], "audit-fencegate");
    assert_eq!(
        docs[1]["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"],
        "audit-fencegate"
    );
    assert!(docs[2]["spec"]["template"]["spec"]["containers"][0]["env"].is_array());

    let out = inject(&[
        "--config",
        "tests/inject/config/invalid.yaml",
        "-f",
        "tests/inject/env.yaml",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    assert_eq!(
        String::from_utf8(out.stderr).unwrap(),
        "error: tests/inject/config/invalid.yaml: store: the `url` does not fit kind redis: write \
         one like redis://127.0.0.1:6379/ at line 3 column 3 (checked with `0` for \
         REDIS_URL, which the pod's environment sets)\n"
    );

    let out = inject(&["--config", "tests/inject/config/missing.yaml"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8(out.stderr).unwrap(),
        "error: cannot read tests/inject/config/missing.yaml: No such file or directory (os error 2)\n"
    );

    let out = inject(&["--env-from-secret", "Store_Secret"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("invalid value 'Store_Secret' for '--env-from-secret <SECRET>': a Kubernetes object name"),
        "{stderr}"
    );
}

// ---- the webhook ------------------------------------------------------------------------

fn fixture(name: &str) -> PathBuf {
    path("tests/fixtures").join(name)
}

struct Webhook {
    port: u16,
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
    _stop: oneshot::Sender<()>,
}

impl Webhook {
    /// The webhook on port 0 with the test server certificate; a client that trusts only
    /// the test CA and connects by the name `localhost`.
    async fn start(options: Options) -> Webhook {
        let tls = fencegate::tls::server_config(
            &TlsConfig {
                cert: fixture("server.pem"),
                key: fixture("server-key.pem"),
                client_ca: None,
            },
            &fencegate::tls::CONFIG_TLS,
        )
        .unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(fencegate::inject::webhook::serve_webhook(
            listener,
            tls,
            options,
            async move {
                let _ = stopped.await;
            },
        ));
        Webhook {
            port,
            client: https_client(),
            _stop: stop,
        }
    }

    async fn send(&self, method: Method, path: &str, body: impl Into<Bytes>) -> Reply {
        let req = Request::builder()
            .method(method)
            .uri(format!("https://localhost:{}{path}", self.port))
            .header("content-type", "application/json")
            .body(Full::new(body.into()))
            .unwrap();
        let resp = self.client.request(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.unwrap().to_bytes(),
        }
    }

    /// Posts an AdmissionReview to `/mutate`; returns its `response`.
    async fn review(&self, review: &Value) -> Value {
        self.review_at("/mutate", review).await
    }

    /// Posts an AdmissionReview to `path`; returns its `response`.
    async fn review_at(&self, path: &str, review: &Value) -> Value {
        let reply = self.send(Method::POST, path, review.to_string()).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        assert_eq!(reply.headers["content-type"], "application/json");
        let body = reply.json();
        assert_eq!(body["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(body["kind"], "AdmissionReview");
        assert_eq!(body["response"]["uid"], review["request"]["uid"]);
        assert_eq!(body["response"]["allowed"], true);
        body["response"].clone()
    }
}

fn https_client() -> Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(fixture("ca.pem")).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let tls =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
    let connector = HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_only()
        .enable_http1()
        .enable_http2()
        .build();
    Client::builder(TokioExecutor::new()).build(connector)
}

fn admission(name: &str) -> Value {
    serde_json::from_str(&read(&format!("tests/inject/admission/{name}"))).unwrap()
}

/// Applies the response's base64 JSON Patch (RFC 6902, by the `json-patch` crate) to `pod`.
fn apply(response: &Value, pod: &Value) -> Value {
    assert_eq!(response["patchType"], "JSONPatch", "{response}");
    let raw = base64::engine::general_purpose::STANDARD
        .decode(response["patch"].as_str().unwrap())
        .unwrap();
    let ops: json_patch::Patch = serde_json::from_slice(&raw).unwrap();
    let mut patched = pod.clone();
    json_patch::patch(&mut patched, &ops).unwrap();
    patched
}

/// What `fencegate inject` makes of the same pod (fed as JSON, which is YAML).
fn injected(pod: &Value, options: &Options) -> Value {
    let text = inject_manifests(&serde_json::to_string_pretty(pod).unwrap(), options).unwrap();
    // With --config, after the ConfigMap.
    documents(&text).pop().unwrap()
}

#[tokio::test]
async fn webhook_patch_gives_exactly_the_inject_output() {
    for options in [native(), classic()] {
        let webhook = Webhook::start(options.clone()).await;
        for name in ["pod.json", "pod-init.json"] {
            let review = admission(name);
            let pod = &review["request"]["object"];
            let response = webhook.review(&review).await;
            assert!(response.get("warnings").is_none(), "{response}");
            let patched = apply(&response, pod);
            let expected = injected(pod, &options);
            assert_ne!(&patched, pod);
            assert_eq!(patched, expected, "{name}, native: {}", options.native);

            // The ops touch only what injection adds: nothing of the pod is replaced.
            let raw = base64::engine::general_purpose::STANDARD
                .decode(response["patch"].as_str().unwrap())
                .unwrap();
            let ops: Vec<Value> = serde_json::from_slice(&raw).unwrap();
            assert!(ops.iter().all(|op| op["op"] == "add"), "{ops:?}");

            // The API server may call again (reinvocation): an injected pod is left alone.
            let mut again = review.clone();
            again["request"]["object"] = patched;
            let response = webhook.review(&again).await;
            assert!(response.get("patch").is_none(), "{response}");
            assert!(response.get("warnings").is_none(), "{response}");
        }
    }
}

/// With `--config`: the app containers of pods that mount the ConfigMap get the lease API and
/// egress addresses, the sidecar the Secret, in the patch as in `inject`'s output.
#[tokio::test]
async fn webhook_with_config_sets_the_app_env_like_inject() {
    for base in [native(), classic()] {
        let options = Options {
            // pod.json mounts ledger-fencegate.
            config_map: "ledger-fencegate".to_owned(),
            ..with_config(base, "leases-egress.yaml", Some("fencegate-store"))
        };
        let webhook = Webhook::start(options.clone()).await;
        for name in ["pod.json", "pod-init.json"] {
            let review = admission(name);
            let pod = &review["request"]["object"];
            let response = webhook.review(&review).await;
            assert!(response.get("warnings").is_none(), "{response}");
            let patched = apply(&response, pod);
            assert_eq!(patched, injected(pod, &options), "{name}");
            assert!(
                ops(&response).iter().all(|op| op["op"] == "add"),
                "{response}"
            );
            let app = &patched["spec"]["containers"][0];
            let env = app["env"].as_array().unwrap();
            assert_eq!(
                env[env.len() - 2..],
                [
                    json!({"name": "FENCEGATE_LEASE_API", "value": "http://127.0.0.1:7442"}),
                    json!({"name": "FENCEGATE_EGRESS_URL", "value": "http://127.0.0.1:7543"}),
                ],
                "{name}"
            );
            let sidecar = if options.native {
                &patched["spec"]["initContainers"][0]
            } else {
                patched["spec"]["containers"]
                    .as_array()
                    .unwrap()
                    .last()
                    .unwrap()
            };
            assert_eq!(sidecar["name"], "fencegate");
            assert_eq!(
                sidecar["envFrom"],
                json!([{"secretRef": {"name": "fencegate-store"}}])
            );
            // Called again with the injected pod: nothing more, nothing twice.
            let mut again = review.clone();
            again["request"]["object"] = patched;
            let response = webhook.review(&again).await;
            assert!(response.get("patch").is_none(), "{response}");
        }
    }

    // A pod mounting another ConfigMap than --config-map gets neither.
    let webhook = Webhook::start(with_config(native(), "leases-egress.yaml", Some("s"))).await;
    let review = admission("pod.json");
    let patched = apply(&webhook.review(&review).await, &review["request"]["object"]);
    assert_eq!(
        patched["spec"]["containers"][0]["env"],
        review["request"]["object"]["spec"]["containers"][0]["env"]
    );
    assert!(patched["spec"]["initContainers"][0]
        .get("envFrom")
        .is_none());
}

/// The embedded store on an emptyDir keeps maxima per pod: injected, with a warning.
#[tokio::test]
async fn webhook_warns_about_the_embedded_store_on_an_empty_dir() {
    let options = Options {
        config_map: "ledger-fencegate".to_owned(),
        ..with_config(native(), "embedded.yaml", None)
    };
    let webhook = Webhook::start(options.clone()).await;
    let review = admission("pod.json");
    let response = webhook.review(&review).await;
    assert_eq!(
        response["warnings"],
        json!(["fencegate: embedded store on an emptyDir: this pod's maxima are its own and die with it; mount a PersistentVolumeClaim as fencegate-data (a StatefulSet's volumeClaimTemplate) or share a redis, postgres or etcd store"])
    );
    assert_eq!(
        apply(&response, &review["request"]["object"]),
        injected(
            &review["request"]["object"],
            &Options {
                config: None,
                ..options.clone()
            }
        )
    );
    // A StatefulSet's pod arrives with its claim as the volume: no warning.
    let mut claimed = review.clone();
    claimed["request"]["object"]["spec"]["volumes"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "fencegate-data", "persistentVolumeClaim": {"claimName": "fencegate-data-ledger-0"}}));
    let response = webhook.review(&claimed).await;
    assert!(response.get("warnings").is_none(), "{response}");
    assert_eq!(response["patchType"], "JSONPatch");
}

#[tokio::test]
async fn webhook_allows_foreign_and_bad_objects_unchanged_with_a_warning() {
    let webhook = Webhook::start(native()).await;
    let deployment = webhook.review(&admission("deployment.json")).await;
    assert!(deployment.get("patch").is_none(), "{deployment}");
    assert!(deployment.get("patchType").is_none(), "{deployment}");
    let warning = deployment["warnings"][0].as_str().unwrap();
    assert!(
        warning.contains("apps/Deployment is not a Pod"),
        "{warning}"
    );

    let bad = webhook.review(&admission("pod-bad-annotation.json")).await;
    assert!(bad.get("patch").is_none(), "{bad}");
    let warning = bad["warnings"][0].as_str().unwrap();
    assert!(warning.contains("fencegate.io/upstream-port"), "{warning}");

    // A pod without the label (the objectSelector normally keeps it away): silently allowed.
    let mut unlabelled = admission("pod.json");
    unlabelled["request"]["object"]["metadata"]["labels"]
        .as_object_mut()
        .unwrap()
        .remove("fencegate.io/inject");
    let response = webhook.review(&unlabelled).await;
    assert!(response.get("patch").is_none() && response.get("warnings").is_none());

    // Missing pieces of an otherwise valid review: allowed, with a warning.
    for (pointer, value) in [
        ("/request/object", Value::Null),
        (
            "/request/object",
            json!({"kind": "Pod", "metadata": {"labels": {"fencegate.io/inject": "enabled"}}}),
        ),
        ("/request/operation", json!("UPDATE")),
        ("/request/kind", Value::Null),
    ] {
        let mut review = admission("pod.json");
        *review.pointer_mut(pointer).unwrap() = value;
        let response = webhook.review(&review).await;
        assert!(response.get("patch").is_none(), "{pointer}: {response}");
        assert!(response["warnings"][0].is_string(), "{pointer}: {response}");
    }
}

#[tokio::test]
async fn webhook_answers_400_to_a_body_that_is_not_an_admission_review() {
    let webhook = Webhook::start(native()).await;
    for body in [
        "garbage".to_owned(),
        "{\"kind\": \"Pod\"}".to_owned(),
        json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}).to_string(),
        json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}})
            .to_string(),
    ] {
        let reply = webhook.send(Method::POST, "/mutate", body.clone()).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(reply.headers["content-type"], "application/json");
        assert!(reply.json()["error"].is_string(), "{body}");
    }
    let huge = webhook
        .send(Method::POST, "/mutate", vec![b' '; 9 * 1024 * 1024])
        .await;
    assert_eq!(huge.status, StatusCode::PAYLOAD_TOO_LARGE);
    let health = webhook.send(Method::GET, "/healthz", "").await;
    assert_eq!(health.status, StatusCode::OK);
    for (method, path, allow, error) in [
        (
            Method::GET,
            "/mutate",
            "POST",
            "/mutate accepts POST, not GET",
        ),
        (
            Method::PUT,
            "/mutate-namespace",
            "POST",
            "/mutate-namespace accepts POST, not PUT",
        ),
        (
            Method::POST,
            "/healthz",
            "GET, HEAD",
            "/healthz accepts GET and HEAD, not POST",
        ),
    ] {
        let wrong = webhook.send(method, path, "").await;
        assert_eq!(wrong.status, StatusCode::METHOD_NOT_ALLOWED, "{path}");
        assert_eq!(wrong.headers["allow"], allow, "{path}");
        assert_eq!(wrong.headers["content-type"], "application/json");
        assert_eq!(wrong.json(), json!({ "error": error }));
    }
    let garbage = webhook
        .send(Method::POST, "/mutate-namespace", "garbage")
        .await;
    assert_eq!(garbage.status, StatusCode::BAD_REQUEST);
    let missing = webhook.send(Method::POST, "/validate", "{}").await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
}

/// The review with its pod's `fencegate.io/inject` label set to `value`, or removed for `None`.
fn labelled(review: &Value, value: Option<&str>) -> Value {
    let mut review = review.clone();
    let labels = review["request"]["object"]["metadata"]["labels"]
        .as_object_mut()
        .unwrap();
    match value {
        Some(v) => labels.insert("fencegate.io/inject".to_owned(), json!(v)),
        None => labels.remove("fencegate.io/inject"),
    };
    review
}

/// The patch's ops, decoded.
fn ops(response: &Value) -> Vec<Value> {
    let raw = base64::engine::general_purpose::STANDARD
        .decode(response["patch"].as_str().unwrap())
        .unwrap();
    serde_json::from_slice(&raw).unwrap()
}

#[tokio::test]
async fn webhook_namespace_path_injects_a_pod_without_the_label() {
    for options in [native(), classic()] {
        let webhook = Webhook::start(options.clone()).await;
        for name in ["pod.json", "pod-init.json"] {
            let labelled_review = admission(name);
            let review = labelled(&labelled_review, None);
            let pod = &review["request"]["object"];
            let response = webhook.review_at("/mutate-namespace", &review).await;
            assert!(response.get("warnings").is_none(), "{response}");
            let patched = apply(&response, pod);
            // The same pod as one that opted in by its own label, label included.
            let expected = injected(&labelled_review["request"]["object"], &options);
            assert_eq!(patched, expected, "{name}, native: {}", options.native);
            assert_eq!(
                patched["metadata"]["labels"]["fencegate.io/inject"],
                "enabled"
            );
            let ops = ops(&response);
            assert!(ops.iter().all(|op| op["op"] == "add"), "{ops:?}");
            assert!(
                ops.iter()
                    .any(|op| op["path"] == "/metadata/labels/fencegate.io~1inject"),
                "{ops:?}"
            );

            // Called again with the injected pod, on either path: left alone.
            let mut again = review.clone();
            again["request"]["object"] = patched;
            for path in ["/mutate-namespace", "/mutate"] {
                let response = webhook.review_at(path, &again).await;
                assert!(response.get("patch").is_none(), "{path}: {response}");
                assert!(response.get("warnings").is_none(), "{path}: {response}");
            }
        }
    }

    // A pod without any labels gets the whole map; one labelled `enabled` anyway (the
    // objectSelector normally sends it to /mutate) is injected as there.
    let webhook = Webhook::start(native()).await;
    let mut bare = admission("pod.json");
    bare["request"]["object"]["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("labels");
    let response = webhook.review_at("/mutate-namespace", &bare).await;
    let patched = apply(&response, &bare["request"]["object"]);
    assert_eq!(
        patched["metadata"]["labels"],
        json!({"fencegate.io/inject": "enabled"})
    );
    assert!(ops(&response)
        .iter()
        .any(|op| op["op"] == "add" && op["path"] == "/metadata/labels"));
    let review = admission("pod.json");
    let response = webhook.review_at("/mutate-namespace", &review).await;
    assert_eq!(
        apply(&response, &review["request"]["object"]),
        injected(&review["request"]["object"], &native())
    );
}

#[tokio::test]
async fn webhook_namespace_path_leaves_a_pod_labelled_disabled_alone() {
    let webhook = Webhook::start(native()).await;
    let review = labelled(&admission("pod.json"), Some("disabled"));
    let response = webhook.review_at("/mutate-namespace", &review).await;
    assert!(response.get("patch").is_none(), "{response}");
    assert!(response.get("patchType").is_none(), "{response}");
    assert!(response.get("warnings").is_none(), "{response}");

    // Any other value is no opt-out: injected, the label kept as it is, and a warning
    // saying what opts out.
    let review = labelled(&admission("pod.json"), Some("false"));
    let response = webhook.review_at("/mutate-namespace", &review).await;
    let patched = apply(&response, &review["request"]["object"]);
    assert_eq!(
        containers(&patched["spec"], "initContainers"),
        ["fencegate"]
    );
    assert_eq!(
        patched["metadata"]["labels"]["fencegate.io/inject"],
        "false"
    );
    let warning = response["warnings"][0].as_str().unwrap();
    assert!(
        warning.contains("\"false\" does not opt out") && warning.contains("disabled"),
        "{warning}"
    );

    // Problems with the pod are warnings there too, never a refusal.
    let bad = labelled(&admission("pod-bad-annotation.json"), None);
    let response = webhook.review_at("/mutate-namespace", &bad).await;
    assert!(response.get("patch").is_none(), "{response}");
    let warning = response["warnings"][0].as_str().unwrap();
    assert!(warning.contains("fencegate.io/upstream-port"), "{warning}");
}

#[tokio::test]
async fn webhook_pod_path_still_needs_the_pod_label() {
    let webhook = Webhook::start(native()).await;
    for value in [None, Some("disabled"), Some("true")] {
        let review = labelled(&admission("pod.json"), value);
        let response = webhook.review_at("/mutate", &review).await;
        assert!(response.get("patch").is_none(), "{value:?}: {response}");
        assert!(response.get("warnings").is_none(), "{value:?}: {response}");
    }
}

/// The real binary: serves over TLS, then drains and exits 0 on SIGTERM.
#[tokio::test]
async fn webhook_process_serves_tls_and_stops_on_sigterm() {
    let mut child = tokio::process::Command::new(BIN)
        .args(["webhook", "--listen", "127.0.0.1:0", "--tls-cert"])
        .arg(fixture("server.pem"))
        .arg("--tls-key")
        .arg(fixture("server-key.pem"))
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, mut logs) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        use tokio::io::AsyncBufReadExt;
        let mut lines = tokio::io::BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let _ = tx.send(serde_json::from_str::<Value>(&line).unwrap());
        }
    });
    let started = wait_log(&mut logs, "webhook started").await;
    assert_eq!(
        started["image"],
        format!("ghcr.io/fencegate/fencegate:{}", env!("CARGO_PKG_VERSION"))
    );
    let addr: std::net::SocketAddr = started["listen"].as_str().unwrap().parse().unwrap();
    let client = https_client();
    let review = admission("pod.json");
    let req = Request::builder()
        .method(Method::POST)
        .uri(format!("https://localhost:{}/mutate", addr.port()))
        .body(Full::new(Bytes::from(review.to_string())))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let body: Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(body["response"]["patchType"], "JSONPatch");
    // One line per review, saying which pod of which workload, before it has a name.
    let admitted = wait_log(&mut logs, "admitted").await;
    assert_eq!(admitted["uid"], "705ab4f5-6393-11e8-b7cc-42010a800002");
    assert_eq!(admitted["namespace"], "payments");
    assert_eq!(admitted["pod"], "ledger-6d9f8b7c5-");
    assert_eq!(admitted["owner"], "ReplicaSet/ledger-6d9f8b7c5");
    assert_eq!(admitted["injected"], true);
    assert_eq!(admitted["level"], "INFO");

    let pid = child.id().unwrap().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    wait_log(&mut logs, "stopped").await;
    let status = tokio::time::timeout(std::time::Duration::from_secs(20), child.wait())
        .await
        .expect("the webhook did not exit after SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");
}

/// The webhook checks its `--config` at start-up: a file fencegate would refuse stops it.
#[tokio::test]
async fn webhook_process_checks_its_config() {
    let webhook = |config: &str| {
        tokio::process::Command::new(BIN)
            .args(["webhook", "--listen", "127.0.0.1:0", "--tls-cert"])
            .arg(fixture("server.pem"))
            .arg("--tls-key")
            .arg(fixture("server-key.pem"))
            .arg("--config")
            .arg(path(&format!("tests/inject/config/{config}")))
            .args(["--env-from-secret", "fencegate-store"])
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap()
    };
    let out = webhook("invalid.yaml").wait_with_output().await.unwrap();
    assert_eq!(out.status.code(), Some(1));
    let line: Value = serde_json::from_slice(&out.stderr).unwrap();
    assert_eq!(line["message"], "invalid sidecar config");
    assert!(
        line["error"].as_str().unwrap().ends_with(
            "tests/inject/config/invalid.yaml: store: the `url` does not fit kind redis: write one \
             like redis://127.0.0.1:6379/ at line 3 column 3 (checked with `0` for REDIS_URL, \
             which the pod's environment sets)"
        ),
        "{line}"
    );

    let mut child = webhook("leases-egress.yaml");
    let stderr = child.stderr.take().unwrap();
    let (tx, mut logs) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        use tokio::io::AsyncBufReadExt;
        let mut lines = tokio::io::BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let _ = tx.send(serde_json::from_str::<Value>(&line).unwrap());
        }
    });
    let started = wait_log(&mut logs, "webhook started").await;
    assert_eq!(started["config_map"], "fencegate");
    assert_eq!(started["lease_api"], "http://127.0.0.1:7442");
    assert_eq!(started["egress_url"], "http://127.0.0.1:7543");
    assert_eq!(started["env_from_secret"], "fencegate-store");
}
