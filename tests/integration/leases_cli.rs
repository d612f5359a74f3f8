//! `fencegate leases get|list` against every lease backend: what was granted is what the
//! commands print (holder, token, lease id, expiry), a released lease shows its last token.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use fencegate::config::Config;
use fencegate::lease::{self, Acquired, Grant, LeaseBackend};
use serde_json::{json, Value};
use tokio::process::Command;

use crate::services::*;

const BIN: &str = env!("CARGO_BIN_EXE_fencegate");
const TTL: Duration = Duration::from_secs(60);

async fn leases(config: &Path, args: &[&str]) -> (i32, Value, String) {
    let out = Command::new(BIN)
        .arg("leases")
        .args(args)
        .arg("--config")
        .arg(config)
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let doc = serde_json::from_str(&stdout).unwrap_or(Value::Null);
    (
        out.status.code().unwrap_or(-1),
        doc,
        format!("{stdout}{stderr}"),
    )
}

async fn grant(backend: &dyn LeaseBackend, resource: &str, holder: &str) -> Grant {
    match backend.try_acquire(resource, holder, TTL).await.unwrap() {
        Acquired::Granted(g) => g,
        held => panic!("{resource} should be free, got {held:?}"),
    }
}

async fn get_and_list_show_the_granted_leases(kind: &str) {
    let dir = tempfile::tempdir().unwrap();
    let prefix = fresh_prefix();
    let mut etcd = None;
    let backend_yaml = match kind {
        "embedded" => format!(
            "{{ kind: embedded, path: {}, prefix: {prefix} }}",
            dir.path().join("leases.db").display()
        ),
        "redis" => format!("{{ kind: redis, url: '{REDIS_URL}', prefix: {prefix} }}"),
        "postgres" => format!("{{ kind: postgres, url: '{POSTGRES_URL}', prefix: {prefix} }}"),
        "etcd" => {
            let service = Service::start(Kind::Etcd).await;
            let url = service.url();
            etcd = Some(service);
            format!("{{ kind: etcd, url: '{url}', prefix: {prefix} }}")
        }
        other => panic!("unknown backend {other}"),
    };
    let yaml = format!(
        "upstream: http://127.0.0.1:1\nstore: {{ kind: memory }}\n\
         leases:\n  listen: 127.0.0.1:0\n  backend: {backend_yaml}\n  ttl: 60s\n"
    );
    let config = dir.path().join("fencegate.yaml");
    std::fs::write(&config, &yaml).unwrap();
    let parsed = Config::parse(&yaml).unwrap();
    let backend_config = &parsed.leases.as_ref().unwrap().backend;

    let (held, released) = {
        let backend = lease::open(backend_config).await.unwrap();
        let held = grant(backend.as_ref(), "job:1", "worker-a").await;
        let released = grant(backend.as_ref(), "job:2", "worker-b").await;
        assert!(backend.release(&released).await.unwrap());
        (held, released)
    };
    // The embedded backend's file is one process's: closed with the backend above.

    let (code, doc, out) = leases(&config, &["get", "job:1", "--output", "json"]).await;
    assert_eq!(code, 0, "{out}");
    assert_eq!(doc["resource"], "job:1");
    assert_eq!(doc["held"], true, "{out}");
    assert_eq!(doc["holder"], "worker-a");
    assert_eq!(doc["token"], held.token.get());
    assert_eq!(doc["lease_id"], held.lease_id.as_str());
    assert_eq!(doc["backend"], kind);
    let expires = doc["expires_in_ms"].as_u64().unwrap();
    assert!(expires > 50_000 && expires <= 60_000, "{out}");

    let (code, doc, out) = leases(&config, &["get", "job:2", "--output", "json"]).await;
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        doc,
        json!({ "resource": "job:2", "held": false, "holder": null, "lease_id": null,
                "token": released.token, "expires_in_ms": null, "backend": kind })
    );
    let (code, doc, out) = leases(&config, &["get", "job:3", "--output", "json"]).await;
    assert_eq!(code, 0, "{out}");
    assert_eq!(doc["token"], Value::Null);
    assert_eq!(doc["held"], false);

    let (code, doc, out) = leases(&config, &["list", "--limit", "1", "--output", "json"]).await;
    assert_eq!(code, 0, "{out}");
    assert_eq!(doc["leases"].as_array().unwrap().len(), 1, "{out}");
    assert_eq!(doc["leases"][0]["resource"], "job:1");
    assert_eq!(doc["next"], "job:1");
    let (code, doc, out) = leases(
        &config,
        &[
            "list", "--prefix", "job:", "--after", "job:1", "--output", "json",
        ],
    )
    .await;
    assert_eq!(code, 0, "{out}");
    let listed: Vec<(&str, u64)> = doc["leases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            (
                l["resource"].as_str().unwrap(),
                l["token"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(listed, vec![("job:2", released.token.get())], "{out}");
    assert_eq!(doc["next"], Value::Null);
    drop(etcd);
}

#[tokio::test]
async fn leases_get_and_list_show_embedded_grants() {
    get_and_list_show_the_granted_leases("embedded").await;
}

#[tokio::test]
async fn leases_get_and_list_show_redis_grants() {
    get_and_list_show_the_granted_leases("redis").await;
}

#[tokio::test]
async fn leases_get_and_list_show_postgres_grants() {
    get_and_list_show_the_granted_leases("postgres").await;
}

#[tokio::test]
async fn leases_get_and_list_show_etcd_grants() {
    get_and_list_show_the_granted_leases("etcd").await;
}

/// A config without a `leases` section has nothing to read: exit 1, said.
#[tokio::test]
async fn leases_commands_need_a_leases_section() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fencegate.yaml");
    std::fs::write(
        &config,
        "upstream: http://127.0.0.1:1\nstore: { kind: memory }\n",
    )
    .unwrap();
    let (code, _, out) = leases(&config, &["get", "job:1"]).await;
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("the config has no `leases` section"), "{out}");
}
