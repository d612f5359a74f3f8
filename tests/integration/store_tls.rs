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

// ---------------------------------------------------------------------------------------------
// Redis

/// The ACL rules of the user fencegate connects as (docs/stores.md has the same line, for the
/// prefix `fencegate`): its keys and channels only, and only the commands it sends (`PING`,
/// `GET`, `EXISTS`, `EVALSHA`, `SCRIPT LOAD`, `PSUBSCRIBE`, `HELLO`) or its scripts call.
fn redis_acl(prefix: &str) -> String {
    format!(
        "resetkeys ~{prefix}:* resetchannels &{prefix}:{{*}}:released &{prefix}:{{*}}:granted \
         -@all +ping +hello +get +exists +evalsha +script|load +psubscribe \
         +set +incr +pexpire +persist +del +hset +hmget +hdel +publish"
    )
}

/// A throwaway Redis with TLS only (no plaintext port) that requires client certificates,
/// and a user `fencegate` with password `password` limited to `prefix`.
struct TlsRedis {
    port: u16,
    _child: Child,
    _dir: tempfile::TempDir,
}

impl TlsRedis {
    async fn start(pki: &Pki, prefix: &str, password: &str) -> TlsRedis {
        for _ in 0..5 {
            let dir = tempfile::tempdir().unwrap();
            let port = free_port();
            let mut user = vec!["fencegate".to_owned(), "on".into(), format!(">{password}")];
            user.extend(redis_acl(prefix).split(' ').map(str::to_owned));
            let mut child = Command::new("redis-server")
                .args(["--port", "0", "--tls-port", &port.to_string()])
                .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(dir.path())
                .arg("--tls-cert-file")
                .arg(&pki.server_cert)
                .arg("--tls-key-file")
                .arg(&pki.server_key)
                .arg("--tls-ca-cert-file")
                .arg(&pki.ca)
                .args(["--tls-auth-clients", "yes", "--user"])
                .args(&user)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .expect("redis-server");
            // Ready when it answers PING over TLS; a port taken meanwhile makes it exit.
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                if matches!(resp(port, pki, &["PING"]).await, Ok(r) if r == "+PONG") {
                    return TlsRedis {
                        port,
                        _child: child,
                        _dir: dir,
                    };
                }
                if matches!(child.try_wait(), Ok(Some(_))) {
                    break;
                }
                assert!(Instant::now() < deadline, "redis never answered over TLS");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        panic!("redis-server with TLS exited at start five times");
    }

    fn url(&self, password: &str) -> String {
        format!("rediss://fencegate:{password}@127.0.0.1:{}/", self.port)
    }

    /// A command as the unrestricted default user (over TLS, with the client certificate);
    /// the reply's first line (and a bulk string's contents).
    async fn admin(&self, pki: &Pki, args: &[&str]) -> String {
        resp(self.port, pki, args).await.unwrap()
    }
}

async fn resp(port: u16, pki: &Pki, args: &[&str]) -> Result<String, String> {
    let tcp = TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let mut stream = pki
        .client()
        .connect("127.0.0.1", tcp)
        .await
        .map_err(|e| e.to_string())?;
    let mut request = format!("*{}\r\n", args.len());
    for arg in args {
        request.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
    }
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut reply = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&reply).into_owned();
        let lines: Vec<&str> = text.split("\r\n").collect();
        let complete = match text.chars().next() {
            Some('$') if !text.starts_with("$-1") => lines.len() > 2,
            Some(_) => lines.len() > 1,
            None => false,
        };
        if complete {
            return Ok(if text.starts_with('$') && lines[0] != "$-1" {
                lines[1].to_owned()
            } else {
                lines[0].to_owned()
            });
        }
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
            .await
            .map_err(|_| "no reply".to_owned())?
            .map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("closed".into());
        }
        reply.extend_from_slice(&buf[..n]);
    }
}

fn redis_store(url: &str, prefix: &str, tls: &str) -> String {
    format!("store: {{ kind: redis, url: '{url}', prefix: {prefix}, tls: {{ {tls} }} }}\n")
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

/// Two fencegate replicas share a Redis reached over TLS with client certificates, as a user
/// limited by the documented ACL line: a token admitted by one fences the other, both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_over_tls_fences_across_two_replicas_as_a_limited_acl_user() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let redis = TlsRedis::start(&pki, &prefix, "s3cret").await;
    let up = Upstream::start().await;
    let files = tls_files(&pki.ca, &pki.client_cert, &pki.client_key);
    let a = Process::start(&fence_config(
        pki.dir.path(),
        "a.yaml",
        &up,
        &redis_store(&redis.url("s3cret"), &prefix, &files),
    ))
    .await;
    // The other replica checks the certificate's DNS name instead of the IP it connects to.
    let b = Process::start(&fence_config(
        pki.dir.path(),
        "b.yaml",
        &up,
        &redis_store(
            &redis.url("s3cret"),
            &prefix,
            &format!("{files}, server_name: localhost"),
        ),
    ))
    .await;
    wait_ready(a.admin, 200).await;
    wait_ready(b.admin, 200).await;

    assert_eq!(put_to(a.proxy, "1", "6").await.status, 200);
    let refused = put_to(b.proxy, "1", "5").await;
    refused.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(refused.headers["fencing-token-current"], "6");
    assert_eq!(put_to(b.proxy, "1", "7").await.status, 200);
    let refused = put_to(a.proxy, "1", "6").await;
    refused.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(refused.headers["fencing-token-current"], "7");
    let tokens: Vec<_> = up.seen().iter().map(|s| s.token()).collect();
    assert_eq!(tokens, [Some(6), Some(7)]);
    assert_eq!(
        redis
            .admin(&pki, &["GET", &format!("{prefix}:{{account:1}}:max")])
            .await,
        "7"
    );

    // The user really is limited: other keys and other commands are refused.
    let dry = |args: &'static [&'static str]| {
        let mut all = vec!["ACL", "DRYRUN", "fencegate"];
        all.extend_from_slice(args);
        all
    };
    for args in [
        dry(&["GET", "other:{account:1}:max"]),
        dry(&["FLUSHALL"]),
        dry(&["CONFIG", "GET", "*"]),
        dry(&["EVAL", "return 1", "0"]),
    ] {
        let reply = redis.admin(&pki, &args).await;
        assert!(reply.contains("no permissions"), "{args:?}: {reply}");
    }
    // And allowed what the lease backend's event connection and scripts do, which these
    // tests do not all reach.
    let released = format!("{prefix}:{{*}}:released");
    let granted = format!("{prefix}:{{*}}:granted");
    let channel = format!("{prefix}:{{job:1}}:released");
    let key = format!("{prefix}:{{account:1}}:max");
    for args in [
        vec!["PING"],
        vec!["GET", &key],
        vec!["HELLO", "3"],
        vec!["PSUBSCRIBE", &released, &granted],
        vec!["PUBLISH", &channel, "x"],
        vec!["HSET", &key, "p", "i"],
        vec!["PEXPIRE", &key, "1000"],
        vec!["SCRIPT", "LOAD", "return 1"],
    ] {
        let mut all = vec!["ACL", "DRYRUN", "fencegate"];
        all.extend_from_slice(&args);
        assert_eq!(redis.admin(&pki, &all).await, "+OK", "{args:?}");
    }
}

/// A lease acquired from a Redis backend over TLS, as the limited ACL user, is renewed over
/// TLS, refused to another holder, and released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_lease_is_acquired_and_renewed_over_tls() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let redis = TlsRedis::start(&pki, &prefix, "s3cret").await;
    let files = tls_files(&pki.ca, &pki.client_cert, &pki.client_key);
    let config = write(
        pki.dir.path(),
        "leases.yaml",
        &format!(
            "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://127.0.0.1:9\nstore: {{ kind: memory }}\n\
             leases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: redis, url: '{}', prefix: {prefix}, tls: {{ {files} }} }}\n  ttl: 1s\n",
            redis.url("s3cret")
        ),
    );
    let p = Process::start(&config).await;
    assert_eq!(lease_acquired_renewed_released(&p).await, 1);
    let token_key = format!("{prefix}:{{job:1}}:token");
    assert_eq!(redis.admin(&pki, &["GET", &token_key]).await, "1");
}

/// A lease backend reached with the wrong CA: acquisitions are refused 503 with one log line
/// naming the cause, and succeed once the right CA file is renamed over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_lease_backend_with_a_wrong_ca_fails_closed_and_recovers() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let redis = TlsRedis::start(&pki, &prefix, "s3cret").await;
    let ca = pki.copy(&pki.other_ca, "fencegate-ca.pem");
    let files = tls_files(&ca, &pki.client_cert, &pki.client_key);
    let config = write(
        pki.dir.path(),
        "leases.yaml",
        &format!(
            "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://127.0.0.1:9\nstore: {{ kind: memory }}\n\
             leases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: redis, url: '{}', prefix: {prefix}, tls: {{ {files} }} }}\n  ttl: 1s\n",
            redis.url("s3cret")
        ),
    );
    let mut p = Logged::start(&config).await;
    for _ in 0..3 {
        let refused = acquire(&p.process, "job:1", "w1").await;
        assert_eq!(refused.status, 503, "{}", refused.text());
        assert_eq!(
            refused.json()["type"],
            "urn:fencegate:lease-backend-unavailable"
        );
    }
    replace(&ca, &pki.ca);
    assert_eq!(lease_acquired_renewed_released(&p.process).await, 1);
    p.wait("lease backend reachable again").await;
    let down = p.count("lease backend unavailable");
    assert_eq!(down.len(), 1, "one line per cause: {down:#?}");
    let error = down[0]["error"].as_str().unwrap();
    assert!(
        error.contains("invalid peer certificate: UnknownIssuer"),
        "{error}"
    );
}

/// A lease backend whose user lacks a command its scripts need: acquisitions are refused 503
/// with one log line naming the missing permission, and succeed once it is granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_lease_backend_missing_a_permission_logs_it_once_and_recovers() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let redis = TlsRedis::start(&pki, &prefix, "s3cret").await;
    redis
        .admin(&pki, &["ACL", "SETUSER", "fencegate", "-evalsha"])
        .await;
    let files = tls_files(&pki.ca, &pki.client_cert, &pki.client_key);
    let config = write(
        pki.dir.path(),
        "leases.yaml",
        &format!(
            "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://127.0.0.1:9\nstore: {{ kind: memory }}\n\
             leases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: redis, url: '{}', prefix: {prefix}, tls: {{ {files} }} }}\n  ttl: 1s\n",
            redis.url("s3cret")
        ),
    );
    let mut p = Logged::start(&config).await;
    for _ in 0..3 {
        let refused = acquire(&p.process, "job:1", "w1").await;
        assert_eq!(refused.status, 503, "{}", refused.text());
    }
    redis
        .admin(&pki, &["ACL", "SETUSER", "fencegate", "+evalsha"])
        .await;
    assert_eq!(lease_acquired_renewed_released(&p.process).await, 1);
    p.wait("lease backend reachable again").await;
    let down = p.count("lease backend unavailable");
    assert_eq!(down.len(), 1, "one line per cause: {down:#?}");
    let error = down[0]["error"].as_str().unwrap();
    assert!(
        error.contains("no permissions to run the 'evalsha'"),
        "{error}"
    );
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

/// A CA that did not sign the server's certificate: writes 503, not ready, one log line that
/// says why; the right CA file put in its place is read by the next connection, and writes
/// flow again without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_with_a_wrong_ca_fails_closed_and_recovers_when_the_ca_file_is_replaced() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let redis = TlsRedis::start(&pki, &prefix, "s3cret").await;
    let up = Upstream::start().await;
    let ca = pki.copy(&pki.other_ca, "fencegate-ca.pem");
    let mut p = Logged::start(&fence_config(
        pki.dir.path(),
        "f.yaml",
        &up,
        &redis_store(
            &redis.url("s3cret"),
            &prefix,
            &tls_files(&ca, &pki.client_cert, &pki.client_key),
        ),
    ))
    .await;
    fails_closed_then_recovers(
        &mut p,
        &up,
        "invalid peer certificate: UnknownIssuer",
        async || replace(&ca, &pki.ca),
    )
    .await;
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

/// A wrong password: the same, until the password is set on the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_with_a_wrong_password_fails_closed_and_recovers_when_the_server_accepts_it() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let redis = TlsRedis::start(&pki, &prefix, "s3cret").await;
    let up = Upstream::start().await;
    let mut p = Logged::start(&fence_config(
        pki.dir.path(),
        "f.yaml",
        &up,
        &redis_store(
            &redis.url("rotated"),
            &prefix,
            &tls_files(&pki.ca, &pki.client_cert, &pki.client_key),
        ),
    ))
    .await;
    fails_closed_then_recovers(&mut p, &up, "Password authentication failed", async || {
        let set = redis
            .admin(&pki, &["ACL", "SETUSER", "fencegate", ">rotated"])
            .await;
        assert_eq!(set, "+OK");
    })
    .await;
}

/// A client certificate the server does not trust, then the right one renamed over it on
/// disk: the next connection presents the new one, and fencegate is back without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_client_certificate_replaced_on_disk_is_used_by_the_next_connection() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let redis = TlsRedis::start(&pki, &prefix, "s3cret").await;
    let up = Upstream::start().await;
    let cert = pki.copy(&pki.other_client_cert, "fencegate.pem");
    let key = pki.copy(&pki.other_client_key, "fencegate.key");
    let mut p = Logged::start(&fence_config(
        pki.dir.path(),
        "f.yaml",
        &up,
        &redis_store(
            &redis.url("s3cret"),
            &prefix,
            &tls_files(&pki.ca, &cert, &key),
        ),
    ))
    .await;
    // The server refuses the certificate with an alert at the end of the handshake.
    fails_closed_then_recovers(&mut p, &up, "received fatal alert: UnknownCA", async || {
        replace(&key, &pki.client_key);
        replace(&cert, &pki.client_cert);
    })
    .await;
    let changed = p.count("TLS files changed; new connections use them");
    assert!(!changed.is_empty(), "{:#?}", p.lines);
}

/// `check` reads the store's and the lease backend's TLS files as `run` does: a missing one
/// is a config error naming its field; good ones print back, the password masked.
#[tokio::test]
async fn check_reads_the_store_tls_files_and_masks_the_password() {
    let pki = Pki::new();
    let check = |config: &Path| {
        let out = std::process::Command::new(BIN)
            .args(["check", "--config"])
            .arg(config)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let files = tls_files(&pki.ca, &pki.client_cert, &pki.client_key);
    let good = write(
        pki.dir.path(),
        "good.yaml",
        &format!(
            "upstream: http://127.0.0.1:9\n{}\
             leases:\n  backend: {{ kind: redis, url: 'rediss://fencegate:pw2@127.0.0.1:6380/', tls: {{ {files} }} }}\n  ttl: 1s\n",
            redis_store("rediss://fencegate:s3cret@127.0.0.1:6380/0", "fencegate", &files)
        ),
    );
    let (code, out, err) = check(&good);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("rediss://fencegate:****@127.0.0.1:6380/0"),
        "{out}"
    );
    assert!(!out.contains("s3cret") && !out.contains("pw2"), "{out}");
    assert!(out.contains(&format!("ca: {}", pki.ca.display())), "{out}");

    let missing = pki.dir.path().join("missing.pem");
    for (field, yaml) in [
        (
            "store.tls.ca",
            redis_store(
                "rediss://127.0.0.1:6380/",
                "fencegate",
                &tls_files(&missing, &pki.client_cert, &pki.client_key),
            ),
        ),
        (
            "leases.backend.tls.key",
            format!(
                "leases:\n  backend: {{ kind: redis, url: 'rediss://127.0.0.1:6380/', tls: {{ {} }} }}\n  ttl: 1s\n",
                tls_files(&pki.ca, &pki.client_cert, &missing)
            ),
        ),
    ] {
        let bad = write(
            pki.dir.path(),
            "bad.yaml",
            &format!("upstream: http://127.0.0.1:9\n{yaml}"),
        );
        let (code, _, err) = check(&bad);
        assert_eq!(code, Some(1), "{err}");
        assert!(err.contains(field) && err.contains("missing.pem"), "{err}");
    }
}

// ---------------------------------------------------------------------------------------------
// PostgreSQL

fn postgres_bin(name: &str) -> PathBuf {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL server binaries under /usr/lib/postgresql")
        .map(|e| e.unwrap().path())
        .collect();
    versions.sort();
    versions.last().unwrap().join("bin").join(name)
}

/// The superuser's password in the throwaway servers.
const PG_ADMIN_PASSWORD: &str = "admin-pw";

/// A throwaway PostgreSQL that takes TLS connections only (`hostssl`, SCRAM passwords), with
/// a role `fencegate` owning the database `fences`; or, `tls: false`, plaintext only.
struct TlsPostgres {
    port: u16,
    dir: tempfile::TempDir,
    _child: Child,
}

impl TlsPostgres {
    async fn start(pki: &Pki, password: &str, tls: bool) -> TlsPostgres {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let pwfile = write(dir.path(), "pwfile", PG_ADMIN_PASSWORD);
        run(Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(dir.path()))
        .await;
        run(Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(postgres_bin("initdb"))
            .args(["-A", "scram-sha-256", "-U", "postgres", "--no-sync"])
            .arg(format!("--pwfile={}", pwfile.display()))
            .arg("-D")
            .arg(&data))
        .await;
        // The role and its database, in single-user mode: no connection needed yet.
        let mut single = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(postgres_bin("postgres"))
            .args(["--single", "-D"])
            .arg(&data)
            .arg("postgres")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        single
            .stdin
            .take()
            .unwrap()
            .write_all(
                format!(
                    "CREATE ROLE fencegate LOGIN PASSWORD '{password}'\n\
                     CREATE DATABASE fences OWNER fencegate\n"
                )
                .as_bytes(),
            )
            .await
            .unwrap();
        assert!(single.wait().await.unwrap().success());
        let hba = if tls {
            for (from, to) in [
                (&pki.server_cert, "server.crt"),
                (&pki.server_key, "server.key"),
                (&pki.ca, "root.crt"),
            ] {
                std::fs::copy(from, data.join(to)).unwrap();
            }
            run(Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&data))
            .await;
            run(Command::new("chmod")
                .arg("600")
                .arg(data.join("server.key")))
            .await;
            // The documented line, and no other: TLS or nothing.
            "hostssl all all 127.0.0.1/32 scram-sha-256\n"
        } else {
            "host all all 127.0.0.1/32 scram-sha-256\n"
        };
        std::fs::write(data.join("pg_hba.conf"), hba).unwrap();
        for _ in 0..5 {
            let port = free_port();
            let mut child = Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(postgres_bin("postgres"))
                .arg("-D")
                .arg(&data)
                .args(["-p", &port.to_string()])
                .args(["-c", "listen_addresses=127.0.0.1"])
                .args(["-c", "unix_socket_directories="])
                .args(["-c", &format!("ssl={}", if tls { "on" } else { "off" })])
                .args([
                    "-c",
                    "ssl_cert_file=server.crt",
                    "-c",
                    "ssl_key_file=server.key",
                ])
                .args(["-c", "ssl_ca_file=root.crt"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .unwrap();
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let ready = Command::new(postgres_bin("pg_isready"))
                    .args(["-q", "-h", "127.0.0.1", "-p", &port.to_string()])
                    .status()
                    .await
                    .unwrap();
                if ready.success() {
                    return TlsPostgres {
                        port,
                        dir,
                        _child: child,
                    };
                }
                if matches!(child.try_wait(), Ok(Some(_))) {
                    break;
                }
                assert!(Instant::now() < deadline, "postgres never became ready");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        panic!("postgres exited at start five times");
    }

    /// The url fencegate is given, with its password as written (`${PG_PASSWORD}`, say).
    fn url(&self, password: &str) -> String {
        format!(
            "postgres://fencegate:{password}@127.0.0.1:{}/fences",
            self.port
        )
    }

    /// One statement as the superuser, over TLS with the server's certificate verified;
    /// its output (tuples only).
    async fn admin(&self, pki: &Pki, sql: &str) -> String {
        let out = Command::new(postgres_bin("psql"))
            .arg(format!(
                "host=127.0.0.1 port={} user=postgres dbname=fences sslmode=verify-full sslrootcert={}",
                self.port,
                pki.ca.display()
            ))
            .args(["-tAc", sql])
            .env("PGPASSWORD", PG_ADMIN_PASSWORD)
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }
}

impl Drop for TlsPostgres {
    fn drop(&mut self) {
        // runuser forwards nothing on SIGKILL: kill the postmaster itself.
        if let Ok(pid) = std::fs::read_to_string(self.dir.path().join("data/postmaster.pid")) {
            if let Some(pid) = pid.lines().next() {
                let _ = std::process::Command::new("kill")
                    .args(["-9", pid.trim()])
                    .status();
            }
        }
    }
}

async fn run(cmd: &mut Command) {
    let status = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await
        .unwrap();
    assert!(status.success(), "{cmd:?}");
}

fn postgres_store(url: &str, prefix: &str, tls: &str) -> String {
    format!("store: {{ kind: postgres, url: '{url}', prefix: {prefix}, tls: {{ {tls} }} }}\n")
}

/// Two replicas share a PostgreSQL that takes only TLS (hostssl + SCRAM), the password from
/// the environment (`${PG_PASSWORD}` in the config file): a token admitted by one fences the
/// other, both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_over_tls_fences_across_two_replicas_with_the_password_from_the_environment() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let pg = TlsPostgres::start(&pki, "pg-s3cret", true).await;
    let up = Upstream::start().await;
    let url = pg.url("${PG_PASSWORD}");
    let env = [("PG_PASSWORD", "pg-s3cret")];
    let a = Process::start_with_env(
        &fence_config(
            pki.dir.path(),
            "a.yaml",
            &up,
            &postgres_store(&url, &prefix, &format!("ca: {}", pki.ca.display())),
        ),
        &env,
    )
    .await;
    // The other with a client certificate (the server asks; hostssl lets it be optional) and
    // the certificate's DNS name checked instead of the IP.
    let b = Process::start_with_env(
        &fence_config(
            pki.dir.path(),
            "b.yaml",
            &up,
            &postgres_store(
                &format!("{url}?sslmode=verify-full"),
                &prefix,
                &format!(
                    "{}, server_name: localhost",
                    tls_files(&pki.ca, &pki.client_cert, &pki.client_key)
                ),
            ),
        ),
        &env,
    )
    .await;
    wait_ready(a.admin, 200).await;
    wait_ready(b.admin, 200).await;

    assert_eq!(put_to(a.proxy, "1", "6").await.status, 200);
    let refused = put_to(b.proxy, "1", "5").await;
    refused.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(refused.headers["fencing-token-current"], "6");
    assert_eq!(put_to(b.proxy, "1", "7").await.status, 200);
    let refused = put_to(a.proxy, "1", "6").await;
    refused.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(refused.headers["fencing-token-current"], "7");
    let tokens: Vec<_> = up.seen().iter().map(|s| s.token()).collect();
    assert_eq!(tokens, [Some(6), Some(7)]);
    assert_eq!(
        pg.admin(
            &pki,
            &format!("SELECT max_token FROM {prefix}_fences WHERE resource = 'account:1'")
        )
        .await,
        "7"
    );
    // Every connection fencegate holds is TLS, as the fencegate role.
    assert_eq!(
        pg.admin(
            &pki,
            "SELECT count(*) FILTER (WHERE NOT ssl), count(*) > 0 FROM pg_stat_ssl \
             JOIN pg_stat_activity USING (pid) WHERE usename = 'fencegate'"
        )
        .await,
        "0|t"
    );
}

/// `tls` never falls back to plaintext: a server without TLS is unavailable, not used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tls_never_falls_back_to_plaintext() {
    let pki = Pki::new();
    let pg = TlsPostgres::start(&pki, "pg-s3cret", false).await;
    let up = Upstream::start().await;
    let mut p = Logged::start(&fence_config(
        pki.dir.path(),
        "f.yaml",
        &up,
        &postgres_store(
            &pg.url("pg-s3cret"),
            &fresh_prefix(),
            &format!("ca: {}", pki.ca.display()),
        ),
    ))
    .await;
    wait_ready(p.process.admin, 503).await;
    refused_unavailable(&p.process, "1").await;
    assert_eq!(up.count(), 0);
    let down = p.wait("fence store unavailable").await;
    let error = down["error"].as_str().unwrap();
    assert!(error.contains("TLS"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lease_is_acquired_and_renewed_over_tls() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let pg = TlsPostgres::start(&pki, "pg-s3cret", true).await;
    let config = write(
        pki.dir.path(),
        "leases.yaml",
        &format!(
            "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://127.0.0.1:9\nstore: {{ kind: memory }}\n\
             leases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: postgres, url: '{}', prefix: {prefix}, tls: {{ ca: {} }} }}\n  ttl: 1s\n",
            pg.url("pg-s3cret"),
            pki.ca.display()
        ),
    );
    let p = Process::start(&config).await;
    assert_eq!(lease_acquired_renewed_released(&p).await, 1);
    assert_eq!(
        pg.admin(
            &pki,
            &format!("SELECT fencing_token FROM {prefix}_leases WHERE resource_id = 'job:1'")
        )
        .await,
        "1"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_with_a_wrong_ca_fails_closed_and_recovers_when_the_ca_file_is_replaced() {
    let pki = Pki::new();
    let pg = TlsPostgres::start(&pki, "pg-s3cret", true).await;
    let up = Upstream::start().await;
    let ca = pki.copy(&pki.other_ca, "fencegate-ca.pem");
    let mut p = Logged::start(&fence_config(
        pki.dir.path(),
        "f.yaml",
        &up,
        &postgres_store(
            &pg.url("pg-s3cret"),
            &fresh_prefix(),
            &format!("ca: {}", ca.display()),
        ),
    ))
    .await;
    fails_closed_then_recovers(
        &mut p,
        &up,
        "invalid peer certificate: UnknownIssuer",
        async || replace(&ca, &pki.ca),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_with_a_wrong_password_fails_closed_and_recovers_when_the_server_accepts_it() {
    let pki = Pki::new();
    let pg = TlsPostgres::start(&pki, "pg-s3cret", true).await;
    let up = Upstream::start().await;
    let mut p = Logged::start(&fence_config(
        pki.dir.path(),
        "f.yaml",
        &up,
        &postgres_store(
            &pg.url("rotated"),
            &fresh_prefix(),
            &format!("ca: {}", pki.ca.display()),
        ),
    ))
    .await;
    fails_closed_then_recovers(
        &mut p,
        &up,
        "password authentication failed for user \"fencegate\"",
        async || {
            pg.admin(&pki, "ALTER ROLE fencegate PASSWORD 'rotated'")
                .await;
        },
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// etcd

/// A throwaway etcd serving clients on https only: with `client_certs`, it requires a
/// certificate signed by the test CA (`--client-cert-auth`); with `auth`, a user `fencegate`
/// with that password and a role limited to `/<prefix>/` (the documented commands), and
/// authentication enabled.
struct TlsEtcd {
    port: u16,
    client_certs: bool,
    /// Authentication is on: root's password is needed.
    auth: bool,
    child: Option<Child>,
    dir: tempfile::TempDir,
    peer: u16,
    /// More etcd arguments.
    args: Vec<String>,
}

const ETCD_ROOT_PASSWORD: &str = "root-pw";

impl TlsEtcd {
    async fn start(pki: &Pki, client_certs: bool, auth: Option<(&str, &str)>) -> TlsEtcd {
        Self::start_with(pki, client_certs, auth, Vec::new()).await
    }

    /// [`TlsEtcd::start`] with JWT tokens (ES256, a key made here) instead of simple ones.
    async fn start_jwt(pki: &Pki, auth: (&str, &str)) -> TlsEtcd {
        let key = rcgen::KeyPair::generate().unwrap();
        let private = write(pki.dir.path(), "jwt.key", &key.serialize_pem());
        let public = write(pki.dir.path(), "jwt.pub", &key.public_key_pem());
        let token = format!(
            "jwt,pub-key={},priv-key={},sign-method=ES256,ttl=10m",
            public.display(),
            private.display()
        );
        Self::start_with(pki, false, Some(auth), vec!["--auth-token".into(), token]).await
    }

    async fn start_with(
        pki: &Pki,
        client_certs: bool,
        auth: Option<(&str, &str)>,
        args: Vec<String>,
    ) -> TlsEtcd {
        let mut etcd = TlsEtcd {
            port: 0,
            client_certs,
            auth: false,
            child: None,
            dir: tempfile::tempdir().unwrap(),
            peer: 0,
            args,
        };
        for _ in 0..5 {
            etcd.port = free_port();
            etcd.peer = free_port();
            let _ = std::fs::remove_dir_all(etcd.dir.path().join("data"));
            if etcd.spawn(pki).await {
                if let Some((prefix, password)) = auth {
                    etcd.enable_auth(pki, prefix, password).await;
                    etcd.auth = true;
                }
                return etcd;
            }
        }
        panic!("etcd exited at start five times");
    }

    /// Starts etcd on its ports and data directory; false if it exited before it was ready.
    async fn spawn(&mut self, pki: &Pki) -> bool {
        let client = format!("https://127.0.0.1:{}", self.port);
        let peer = format!("http://127.0.0.1:{}", self.peer);
        let mut cmd = Command::new("etcd");
        cmd.arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("default={peer}")])
            .args(["--log-level", "error"])
            .arg("--cert-file")
            .arg(&pki.server_cert)
            .arg("--key-file")
            .arg(&pki.server_key)
            .args(&self.args);
        if self.client_certs {
            cmd.arg("--client-cert-auth")
                .arg("--trusted-ca-file")
                .arg(&pki.ca);
        }
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("etcd");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let root = self.auth.then_some(("root", ETCD_ROOT_PASSWORD));
            if self
                .etcdctl(pki, root, &["endpoint", "health"])
                .await
                .is_ok()
            {
                self.child = Some(child);
                return true;
            }
            if matches!(child.try_wait(), Ok(Some(_))) {
                return false;
            }
            assert!(Instant::now() < deadline, "etcd never became healthy");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The documented commands: a role with read and write on the prefix, the user, root,
    /// and authentication on.
    async fn enable_auth(&self, pki: &Pki, prefix: &str, password: &str) {
        let root = Some(("root", ETCD_ROOT_PASSWORD));
        for args in [
            vec![
                "user",
                "add",
                "root",
                "--interactive=false",
                &format!("--new-user-password={ETCD_ROOT_PASSWORD}"),
            ],
            vec!["user", "grant-role", "root", "root"],
            vec!["role", "add", "fencegate"],
            vec![
                "role",
                "grant-permission",
                "fencegate",
                "--prefix=true",
                "readwrite",
                &format!("/{prefix}/"),
            ],
            vec![
                "user",
                "add",
                "fencegate",
                "--interactive=false",
                &format!("--new-user-password={password}"),
            ],
            vec!["user", "grant-role", "fencegate", "fencegate"],
            vec!["auth", "enable"],
        ] {
            self.etcdctl(pki, None, &args).await.unwrap();
        }
        // Root now needs its password.
        self.etcdctl(pki, root, &["user", "list"]).await.unwrap();
    }

    /// etcdctl over TLS (with the client certificate), as `user` if given; its output.
    async fn etcdctl(
        &self,
        pki: &Pki,
        user: Option<(&str, &str)>,
        args: &[&str],
    ) -> Result<String, String> {
        self.etcdctl_input(pki, user, args, "").await
    }

    /// [`TlsEtcd::etcdctl`] with `input` on its standard input.
    async fn etcdctl_input(
        &self,
        pki: &Pki,
        user: Option<(&str, &str)>,
        args: &[&str],
        input: &str,
    ) -> Result<String, String> {
        let mut cmd = Command::new("etcdctl");
        cmd.env("ETCDCTL_API", "3")
            .arg(format!("--endpoints=https://127.0.0.1:{}", self.port))
            .arg(format!("--cacert={}", pki.ca.display()))
            .arg(format!("--cert={}", pki.client_cert.display()))
            .arg(format!("--key={}", pki.client_key.display()))
            .arg("--command-timeout=5s");
        if let Some((name, password)) = user {
            cmd.arg(format!("--user={name}:{password}"));
        }
        let mut child = cmd
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("etcdctl");
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(input.as_bytes()).await.unwrap();
        drop(stdin);
        let out = child.wait_with_output().await.unwrap();
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    fn url(&self, user: Option<&str>) -> String {
        match user {
            Some(password) => format!("https://fencegate:{password}@127.0.0.1:{}", self.port),
            None => format!("https://127.0.0.1:{}", self.port),
        }
    }

    async fn restart(&mut self, pki: &Pki) {
        let mut child = self.child.take().unwrap();
        child.start_kill().unwrap();
        child.wait().await.unwrap();
        assert!(self.spawn(pki).await, "etcd exited at restart");
    }
}

fn etcd_store(url: &str, prefix: &str, tls: &str) -> String {
    format!("store: {{ kind: etcd, url: '{url}', prefix: {prefix}, tls: {{ {tls} }} }}\n")
}

/// Two replicas share an etcd that takes only TLS clients with certificates from its CA: a
/// token admitted by one fences the other, both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_over_tls_with_client_certificates_fences_across_two_replicas() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let etcd = TlsEtcd::start(&pki, true, None).await;
    let up = Upstream::start().await;
    let files = tls_files(&pki.ca, &pki.client_cert, &pki.client_key);
    etcd_two_replicas(
        &pki,
        &up,
        &etcd_store(&etcd.url(None), &prefix, &files),
        &etcd_store(
            &etcd.url(None),
            &prefix,
            &format!("{files}, server_name: localhost"),
        ),
    )
    .await;
    let value = etcd
        .etcdctl(
            &pki,
            None,
            &[
                "get",
                "--print-value-only",
                &format!("/{prefix}/fences/account:1"),
            ],
        )
        .await
        .unwrap();
    assert_eq!(value.trim_start_matches('0'), "7");
}

/// The first https endpoint takes TCP connections but never answers the TLS handshake (a
/// listening socket nobody accepts on): each connection moves on to the second, real one
/// within the connect timeout, so fenced writes go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_over_tls_moves_past_an_endpoint_that_never_answers() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let etcd = TlsEtcd::start(&pki, true, None).await;
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!(
        "https://{},127.0.0.1:{}",
        silent.local_addr().unwrap(),
        etcd.port
    );
    let up = Upstream::start().await;
    let files = tls_files(&pki.ca, &pki.client_cert, &pki.client_key);
    let store = etcd_store(&url, &prefix, &files);
    etcd_two_replicas(&pki, &up, &store, &store).await;
}

async fn etcd_two_replicas(pki: &Pki, up: &Upstream, a: &str, b: &str) {
    let a = Process::start(&fence_config(pki.dir.path(), "a.yaml", up, a)).await;
    let b = Process::start(&fence_config(pki.dir.path(), "b.yaml", up, b)).await;
    wait_ready(a.admin, 200).await;
    wait_ready(b.admin, 200).await;
    assert_eq!(put_to(a.proxy, "1", "6").await.status, 200);
    let refused = put_to(b.proxy, "1", "5").await;
    refused.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(refused.headers["fencing-token-current"], "6");
    assert_eq!(put_to(b.proxy, "1", "7").await.status, 200);
    let refused = put_to(a.proxy, "1", "6").await;
    refused.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(refused.headers["fencing-token-current"], "7");
    let tokens: Vec<_> = up.seen().iter().map(|s| s.token()).collect();
    assert_eq!(tokens, [Some(6), Some(7)]);
}

/// Two replicas share an etcd with authentication on, as a user whose role reaches only the
/// prefix's keys (the password from the environment); that user cannot read another prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_with_auth_fences_across_two_replicas_as_a_user_limited_to_its_prefix() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let etcd = TlsEtcd::start(&pki, false, Some((&prefix, "etcd-s3cret"))).await;
    let up = Upstream::start().await;
    let ca = format!("ca: {}", pki.ca.display());
    let store = etcd_store(&etcd.url(Some("etcd-s3cret")), &prefix, &ca);
    etcd_two_replicas(&pki, &up, &store, &store).await;
    let user = Some(("fencegate", "etcd-s3cret"));
    let mine = etcd
        .etcdctl(
            &pki,
            user,
            &[
                "get",
                "--print-value-only",
                &format!("/{prefix}/fences/account:1"),
            ],
        )
        .await
        .unwrap();
    assert_eq!(mine.trim_start_matches('0'), "7");
    let other = etcd
        .etcdctl(&pki, user, &["get", "/other/fences/account:1"])
        .await
        .unwrap_err();
    assert!(other.contains("permission denied"), "{other}");
}

/// A lease from an etcd backend over TLS, as the limited user: acquired, renewed, refused to
/// another holder, released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_lease_is_acquired_and_renewed_over_tls_as_a_limited_user() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let etcd = TlsEtcd::start(&pki, false, Some((&prefix, "etcd-s3cret"))).await;
    let config = write(
        pki.dir.path(),
        "leases.yaml",
        &format!(
            "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://127.0.0.1:9\nstore: {{ kind: memory }}\n\
             leases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: etcd, url: '{}', prefix: {prefix}, tls: {{ ca: {} }} }}\n  ttl: 3s\n",
            etcd.url(Some("etcd-s3cret")),
            pki.ca.display()
        ),
    );
    let p = Process::start(&config).await;
    // etcd's tokens are revisions.
    let token = lease_acquired_renewed_released(&p).await;
    assert!(token > 1, "{token}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_with_a_wrong_ca_fails_closed_and_recovers_when_the_ca_file_is_replaced() {
    let pki = Pki::new();
    let etcd = TlsEtcd::start(&pki, true, None).await;
    let up = Upstream::start().await;
    let ca = pki.copy(&pki.other_ca, "fencegate-ca.pem");
    let mut p = Logged::start(&fence_config(
        pki.dir.path(),
        "f.yaml",
        &up,
        &etcd_store(
            &etcd.url(None),
            &fresh_prefix(),
            &tls_files(&ca, &pki.client_cert, &pki.client_key),
        ),
    ))
    .await;
    fails_closed_then_recovers(&mut p, &up, "UnknownIssuer", async || replace(&ca, &pki.ca)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_with_a_wrong_password_fails_closed_and_recovers_when_the_server_accepts_it() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let etcd = TlsEtcd::start(&pki, false, Some((&prefix, "etcd-s3cret"))).await;
    let up = Upstream::start().await;
    let mut p = Logged::start(&fence_config(
        pki.dir.path(),
        "f.yaml",
        &up,
        &etcd_store(
            &etcd.url(Some("rotated")),
            &prefix,
            &format!("ca: {}", pki.ca.display()),
        ),
    ))
    .await;
    fails_closed_then_recovers(&mut p, &up, "invalid user ID or password", async || {
        etcd.etcdctl_input(
            &pki,
            Some(("root", ETCD_ROOT_PASSWORD)),
            &["user", "passwd", "fencegate", "--interactive=false"],
            "rotated\n",
        )
        .await
        .unwrap();
    })
    .await;
}

/// With a wrong password, concurrent calls do not each authenticate: one failed
/// `Authenticate` answers the calls that come within a second (counted by etcd's own
/// metrics).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_wrong_password_is_not_tried_again_by_every_call() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let metrics = free_port();
    let etcd = TlsEtcd::start_with(
        &pki,
        false,
        Some((&prefix, "etcd-s3cret")),
        vec![
            "--listen-metrics-urls".into(),
            format!("http://127.0.0.1:{metrics}"),
        ],
    )
    .await;
    let config = fencegate::config::Config::parse(&format!(
        "upstream: http://127.0.0.1:1\n{}",
        etcd_store(
            &etcd.url(Some("wrong")),
            &prefix,
            &format!("ca: {}", pki.ca.display())
        )
    ))
    .unwrap();
    fencegate::tls::install_default_provider();
    let store = fencegate::store::open(&config.store).await.unwrap();
    let authenticates = async || {
        let text = send(
            "GET",
            &format!("http://127.0.0.1:{metrics}/metrics"),
            &[],
            "",
        )
        .await
        .text();
        text.lines()
            .filter(|l| {
                l.starts_with("grpc_server_started_total")
                    && l.contains("grpc_method=\"Authenticate\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let before = authenticates().await;
    let calls: Vec<_> = (0..50)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .compare_and_raise(&format!("r{i}"), 1, fencegate::config::EqualTokens::Allow)
                    .await
            })
        })
        .collect();
    for call in calls {
        let e = call.await.unwrap().unwrap_err().to_string();
        assert!(e.contains("invalid user ID or password"), "{e}");
    }
    // The calls, and the store's probe.
    let tried = authenticates().await - before;
    assert!(tried <= 3.0, "{tried} Authenticate calls for 50 writes");
}

/// With JWT tokens, every token issued before a change of users or roles is refused
/// (`revision of auth store is old`): fencegate authenticates again and sends the call once
/// more, so writes keep passing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_jwt_tokens_outdated_by_a_user_change_are_replaced_without_an_error() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let etcd = TlsEtcd::start_jwt(&pki, (&prefix, "etcd-s3cret")).await;
    let up = Upstream::start().await;
    let p = Process::start(&fence_config(
        pki.dir.path(),
        "f.yaml",
        &up,
        &etcd_store(
            &etcd.url(Some("etcd-s3cret")),
            &prefix,
            &format!("ca: {}", pki.ca.display()),
        ),
    ))
    .await;
    wait_ready(p.admin, 200).await;
    assert_eq!(put_to(p.proxy, "1", "1").await.status, 200);
    let root = Some(("root", ETCD_ROOT_PASSWORD));
    for (i, user) in ["other", "another"].into_iter().enumerate() {
        etcd.etcdctl(
            &pki,
            root,
            &[
                "user",
                "add",
                user,
                "--interactive=false",
                "--new-user-password=pw",
            ],
        )
        .await
        .unwrap();
        let token = (i + 2).to_string();
        let r = put_to(p.proxy, "1", &token).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(up.count(), 3);
}

/// etcd forgets its simple tokens when it restarts: the next call is refused with `invalid
/// auth token`, and fencegate authenticates again and sends the call once more, so no caller
/// ever sees that refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_tokens_refused_after_a_restart_are_replaced_without_an_error() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let mut etcd = TlsEtcd::start(&pki, false, Some((&prefix, "etcd-s3cret"))).await;
    let config = fencegate::config::Config::parse(&format!(
        "upstream: http://127.0.0.1:1\n{}",
        etcd_store(
            &etcd.url(Some("etcd-s3cret")),
            &prefix,
            &format!("ca: {}", pki.ca.display())
        )
    ))
    .unwrap();
    fencegate::tls::install_default_provider();
    let store = fencegate::store::open(&config.store).await.unwrap();
    use fencegate::config::EqualTokens::Allow;
    assert!(store.compare_and_raise("r", 1, Allow).await.is_ok());
    etcd.restart(&pki).await;
    // The channel may still hold the connection to the old process: transport errors until it
    // notices are expected; a refused token never is.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut errors = Vec::new();
    loop {
        match store.compare_and_raise("r", 2, Allow).await {
            Ok(verdict) => {
                assert_eq!(
                    verdict,
                    fencegate::fence::verdict::Verdict::Admitted { previous: Some(1) }
                );
                break;
            }
            Err(e) => errors.push(e.to_string()),
        }
        assert!(Instant::now() < deadline, "{errors:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !errors.iter().any(|e| e.contains("auth")),
        "a refused token reached a caller: {errors:#?}"
    );
}
