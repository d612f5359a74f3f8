//! Stores and lease backends as production runs them (docs/stores.md): TLS with a private CA,
//! client certificates, and a user with only the permissions fencegate needs. Each test starts
//! its own server on a free port with certificates made at run time, and real fencegate
//! processes in front of it.
//!
//! Failing closed is shown the same way for every store: a wrong CA or a wrong password makes
//! fenced writes 503 `store-unavailable` and `/readyz` 503, with one log line naming the cause
//! however many writes and probes fail, and fencegate recovers without a restart once the
//! cause is fixed (the CA file replaced on disk, the password set on the server).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use fencegate::config::ClientTlsConfig;
use fencegate::tls::ClientTls;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use crate::common::*;
use crate::process::{put_to, Process};
use crate::services::{free_port, fresh_prefix};

const BIN: &str = env!("CARGO_BIN_EXE_fencegate");

/// Certificates for one test: a CA, a server certificate for `localhost` and `127.0.0.1`
/// signed by it, a client certificate signed by it, and a second, unrelated CA with a client
/// certificate of its own (the "wrong" ones).
pub(crate) struct Pki {
    pub dir: tempfile::TempDir,
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    pub other_ca: PathBuf,
    pub other_client_cert: PathBuf,
    pub other_client_key: PathBuf,
}

struct Issued {
    cert: String,
    key: String,
}

fn ca(name: &str) -> (rcgen::CertificateParams, rcgen::KeyPair, String) {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let pem = params.self_signed(&key).unwrap().pem();
    (params, key, pem)
}

fn issue(
    ca: &(rcgen::CertificateParams, rcgen::KeyPair, String),
    names: &[&str],
    common_name: &str,
    usage: rcgen::ExtendedKeyUsagePurpose,
) -> Issued {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params =
        rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, common_name);
    params.extended_key_usages = vec![usage];
    let issuer = rcgen::Issuer::from_params(&ca.0, &ca.1);
    Issued {
        cert: params.signed_by(&key, &issuer).unwrap().pem(),
        key: key.serialize_pem(),
    }
}

impl Pki {
    pub fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let good = ca("fencegate test CA");
        let other = ca("another CA");
        let server = issue(
            &good,
            &["localhost", "127.0.0.1"],
            "localhost",
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        );
        // The client's name is the store user's (PostgreSQL's `cert` method compares them).
        let client = issue(
            &good,
            &[],
            "fencegate",
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        );
        let other_client = issue(
            &other,
            &[],
            "fencegate",
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        );
        Pki {
            ca: write("ca.pem", &good.2),
            server_cert: write("server.pem", &server.cert),
            server_key: write("server.key", &server.key),
            client_cert: write("client.pem", &client.cert),
            client_key: write("client.key", &client.key),
            other_ca: write("other-ca.pem", &other.2),
            other_client_cert: write("other-client.pem", &other_client.cert),
            other_client_key: write("other-client.key", &other_client.key),
            dir,
        }
    }

    /// Files for fencegate's own use, which a test may replace.
    pub fn copy(&self, from: &Path, name: &str) -> PathBuf {
        let to = self.dir.path().join(name);
        std::fs::copy(from, &to).unwrap();
        to
    }

    /// The client side with the right CA and client certificate.
    pub fn client(&self) -> ClientTls {
        ClientTls::load(
            &ClientTlsConfig {
                ca: Some(self.ca.clone()),
                cert: Some(self.client_cert.clone()),
                key: Some(self.client_key.clone()),
                server_name: None,
            },
            "test",
            &[],
        )
        .unwrap()
    }
}

/// Replaces `path` with `from`'s contents as certificate rotation does: a new file renamed
/// over the old one.
pub(crate) fn replace(path: &Path, from: &Path) {
    let next = path.with_extension("next");
    std::fs::copy(from, &next).unwrap();
    std::fs::rename(&next, path).unwrap();
}

/// A fencegate process whose every log line is kept (from the first: a store's first failed
/// probe can come before "fencegate started").
struct Logged {
    process: Process,
    lines: Vec<Value>,
}

impl Logged {
    async fn start(config: &Path) -> Logged {
        let mut child = Command::new(BIN)
            .args(["run", "--config"])
            .arg(config)
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, mut logs) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let value: Value = serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("log line is not JSON ({e}): {line}"));
                let _ = tx.send(value);
            }
        });
        let mut lines = Vec::new();
        let started = until(&mut logs, &mut lines, "fencegate started").await;
        Logged {
            process: Process {
                child,
                proxy: started["listen"].as_str().unwrap().parse().unwrap(),
                admin: started["admin"].as_str().unwrap().parse().unwrap(),
                leases: started["leases"].as_str().map(|a| a.parse().unwrap()),
                egress: started["egress"].as_str().map(|a| a.parse().unwrap()),
                logs,
            },
            lines,
        }
    }

    /// The first line with `message`, waiting for it if none came yet; keeps every line up
    /// to it.
    async fn wait(&mut self, message: &str) -> Value {
        if let Some(line) = self.lines.iter().find(|l| l["message"] == message) {
            return line.clone();
        }
        until(&mut self.process.logs, &mut self.lines, message).await
    }

    /// The kept lines with `message`.
    fn count(&self, message: &str) -> Vec<&Value> {
        self.lines
            .iter()
            .filter(|l| l["message"] == message)
            .collect()
    }
}

async fn until(
    logs: &mut mpsc::UnboundedReceiver<Value>,
    kept: &mut Vec<Value>,
    message: &str,
) -> Value {
    let found = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = logs.recv().await {
            kept.push(line.clone());
            if line["message"] == message {
                return line;
            }
        }
        panic!("process exited before logging `{message}`; logged: {kept:#?}");
    });
    match found.await {
        Ok(line) => line,
        Err(_) => panic!("no `{message}` log line within 30s; logged: {kept:#?}"),
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

async fn ready(admin: std::net::SocketAddr) -> u16 {
    send("GET", &format!("http://{admin}/readyz"), &[], "")
        .await
        .status
        .as_u16()
}

/// Polls `/readyz` (the signal operators use) until it answers `want`.
async fn wait_ready(admin: std::net::SocketAddr, want: u16) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while ready(admin).await != want {
        assert!(Instant::now() < deadline, "readiness never became {want}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A fenced write while the store is unusable: 503 `store-unavailable`, never forwarded.
async fn refused_unavailable(p: &Process, token: &str) {
    let reply = put_to(p.proxy, "1", token).await;
    reply.assert_problem(503, "urn:fencegate:store-unavailable");
    assert_eq!(reply.headers["retry-after"], "1");
}

/// Polls until `f` is true.
async fn eventually<F: AsyncFnMut() -> bool>(what: &str, mut f: F) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f().await {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `fencegate_lease_renewals_total{result="ok"}` counter.
async fn renewals_ok(p: &Process) -> u64 {
    let metrics = send("GET", &format!("http://{}/metrics", p.admin), &[], "")
        .await
        .text();
    metrics
        .lines()
        .find(|l| l.starts_with("fencegate_lease_renewals_total{result=\"ok\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .map_or(0, |v| v.parse().unwrap())
}

async fn acquire(p: &Process, resource: &str, holder: &str) -> Reply {
    send(
        "POST",
        &format!("http://{}/v1/leases/{resource}", p.leases.unwrap()),
        &[("content-type", "application/json")],
        format!(r#"{{"holder":"{holder}"}}"#),
    )
    .await
}

fn tls_files(ca: &Path, cert: &Path, key: &Path) -> String {
    format!(
        "ca: {}, cert: {}, key: {}",
        ca.display(),
        cert.display(),
        key.display()
    )
}

fn fence_config(dir: &Path, name: &str, up: &Upstream, store: &str) -> PathBuf {
    write(
        dir,
        name,
        &format!(
            "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: {}\n{store}{ACCOUNTS}",
            up.url()
        ),
    )
}

/// Acquires `job:1`, sees it renewed, refused to another holder and released; returns its
/// token.
async fn lease_acquired_renewed_released(p: &Process) -> u64 {
    let lease = acquire(p, "job:1", "w1").await;
    assert_eq!(lease.status, 200, "{}", lease.text());
    let token = lease.json()["fencing_token"].as_u64().unwrap();
    assert_eq!(lease.json()["state"], "held");
    // Renewed every 333ms: three renewals outlive the 1s TTL.
    eventually("three renewals", async || renewals_ok(p).await >= 3).await;
    let held = send(
        "GET",
        &format!("http://{}/v1/leases/job:1", p.leases.unwrap()),
        &[],
        "",
    )
    .await;
    let metrics = send("GET", &format!("http://{}/metrics", p.admin), &[], "")
        .await
        .text();
    assert_eq!(held.json()["state"], "held", "{}\n{metrics}", held.text());
    let other = acquire(p, "job:1", "w2").await;
    assert_eq!(other.status, 409, "{}", other.text());
    assert_eq!(other.json()["type"], "urn:fencegate:lease-held");
    assert_eq!(other.json()["holder"], "w1");
    let released = send(
        "DELETE",
        &format!("http://{}/v1/leases/job:1", p.leases.unwrap()),
        &[],
        "",
    )
    .await;
    assert_eq!(released.status, 200, "{}", released.text());
    assert_eq!(released.json()["state"], "released");
    token
}

/// The checks shared by the wrong-CA and wrong-password tests: refused while broken, one
/// log line naming `cause`, back once `fix` ran.
async fn fails_closed_then_recovers(
    p: &mut Logged,
    up: &Upstream,
    cause: &str,
    fix: impl AsyncFnOnce(),
) {
    wait_ready(p.process.admin, 503).await;
    for token in ["10", "11", "12", "13", "14"] {
        refused_unavailable(&p.process, token).await;
    }
    assert_eq!(
        up.count(),
        0,
        "a write was forwarded while the store was unusable"
    );
    fix().await;
    wait_ready(p.process.admin, 200).await;
    assert_eq!(put_to(p.process.proxy, "1", "15").await.status, 200);
    p.wait("fence store reachable again").await;
    let down = p.count("fence store unavailable");
    assert_eq!(down.len(), 1, "one line per cause: {down:#?}");
    let error = down[0]["error"].as_str().unwrap();
    eprintln!("logged once: {error}");
    assert!(error.contains(cause), "{error}");
    assert_eq!(up.count(), 1);
}

mod etcd;
mod postgres;
mod redis;
