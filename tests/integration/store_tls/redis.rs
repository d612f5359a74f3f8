//! Redis over TLS with client certificates and a limited ACL user: the store and the lease backend.

use super::*;

/// The ACL rules of the user fencegate connects as (docs/stores.md has the same line, for the
/// prefix `fencegate`): its keys and channels only, and only the commands it sends (`PING`,
/// `GET`, `EXISTS`, `EVALSHA`, `SCRIPT LOAD`, `PSUBSCRIBE`, `HELLO`, `INFO`) or its scripts
/// call.
fn redis_acl(prefix: &str) -> String {
    format!(
        "resetkeys ~{prefix}:* resetchannels &{prefix}:{{*}}:released &{prefix}:{{*}}:granted \
         -@all +ping +hello +get +exists +evalsha +script|load +psubscribe +info \
         +set +incr +incrby +pexpire +persist +del +hset +hmget +hdel +publish"
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
