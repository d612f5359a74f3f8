//! The real binary: durability across `kill -9`, the SIGTERM drain, JSON logs, `check`.
//!
//! Readiness is read from the process's own log lines (explicit signals, no sleeps).

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use crate::common::*;

const BIN: &str = env!("CARGO_BIN_EXE_fencegate");

pub(crate) struct Process {
    pub child: Child,
    pub proxy: std::net::SocketAddr,
    pub admin: std::net::SocketAddr,
    /// The lease API and egress addresses, when configured.
    pub leases: Option<std::net::SocketAddr>,
    pub egress: Option<std::net::SocketAddr>,
    /// Every JSON log line the process writes to stderr.
    pub logs: mpsc::UnboundedReceiver<Value>,
}

impl Process {
    pub async fn start(config: &Path) -> Process {
        Self::start_with_env(config, &[]).await
    }

    /// As [`Process::start`], with extra environment variables (`FENCEGATE_LOG`, say).
    pub async fn start_with_env(config: &Path, env: &[(&str, &str)]) -> Process {
        let mut child = Command::new(BIN)
            .args(["run", "--config"])
            .arg(config)
            .envs(env.iter().copied())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, mut logs) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let value = serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("log line is not JSON ({e}): {line}"));
                let _ = tx.send(value);
            }
        });
        let started = wait_log(&mut logs, "fencegate started").await;
        Process {
            child,
            proxy: started["listen"].as_str().unwrap().parse().unwrap(),
            admin: started["admin"].as_str().unwrap().parse().unwrap(),
            leases: started["leases"].as_str().map(|a| a.parse().unwrap()),
            egress: started["egress"].as_str().map(|a| a.parse().unwrap()),
            logs,
        }
    }

    pub fn signal(&self, name: &str) {
        let pid = self.child.id().unwrap().to_string();
        let status = std::process::Command::new("kill")
            .args([name, &pid])
            .status()
            .unwrap();
        assert!(status.success());
    }
}

pub(crate) async fn wait_log(logs: &mut mpsc::UnboundedReceiver<Value>, message: &str) -> Value {
    let found = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(line) = logs.recv().await {
            if line["message"] == message {
                return line;
            }
        }
        panic!("process exited before logging `{message}`");
    });
    found
        .await
        .unwrap_or_else(|_| panic!("no `{message}` log line within 20s"))
}

fn write_config(dir: &Path, upstream: &str, extra: &str) -> std::path::PathBuf {
    let path = dir.join("fencegate.yaml");
    std::fs::write(
        &path,
        format!(
            "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: {upstream}\n\
             store: {{ kind: embedded, path: {} }}\n{extra}{ACCOUNTS}",
            dir.join("fences.db").display()
        ),
    )
    .unwrap();
    path
}

pub(crate) async fn put_to(addr: std::net::SocketAddr, id: &str, token: &str) -> Reply {
    send(
        "PUT",
        &format!("http://{addr}/accounts/{id}"),
        &[("fencing-token", token)],
        "w",
    )
    .await
}

#[tokio::test]
async fn kill_9_and_restart_keeps_the_maximum() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &up.url(), "");

    let mut first = Process::start(&config).await;
    assert_eq!(put_to(first.proxy, "1", "41").await.status, 200);
    assert_eq!(put_to(first.proxy, "1", "42").await.status, 200);
    assert_eq!(put_to(first.proxy, "2", "7").await.status, 200);
    // No graceful anything: SIGKILL right after the 200s.
    first.child.start_kill().unwrap();
    first.child.wait().await.unwrap();

    let mut second = Process::start(&config).await;
    let reply = put_to(second.proxy, "1", "41").await;
    reply.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(reply.headers["fencing-token-current"], "42");
    put_to(second.proxy, "2", "6")
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
    let fence = send(
        "GET",
        &format!("http://{}/v1/fences/account:1", second.admin),
        &[],
        "",
    )
    .await;
    assert_eq!(fence.json()["token"], 42);
    assert_eq!(fence.json()["store"], "embedded");
    assert_eq!(up.count(), 3);

    // The refusal is one JSON log line with the fields an operator needs.
    let refusal = wait_log(&mut second.logs, "write refused").await;
    assert_eq!(refusal["level"], "WARN");
    assert_eq!(refusal["route"], "accounts");
    assert_eq!(refusal["resource"], "account:1");
    assert_eq!(refusal["fencing_token"], 41);
    assert_eq!(refusal["current_token"], 42);
    assert_eq!(refusal["status"], 409);
    assert_eq!(refusal["type"], "urn:fencegate:stale-token");
    second.child.start_kill().unwrap();
}

#[tokio::test]
async fn sigterm_drains_in_flight_requests_then_exits_0() {
    let up = Upstream::gated().await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &up.url(), "timeouts: { shutdown: 30s }\n");
    let mut p = Process::start(&config).await;

    let in_flight = tokio::spawn(put_to(p.proxy, "1", "5"));
    assert_eq!(up.arrival().await.token(), Some(5));
    p.signal("-TERM");
    wait_log(
        &mut p.logs,
        "shutting down: readiness off, draining in-flight requests",
    )
    .await;
    let closed = wait_log(&mut p.logs, "listener closed; draining connections").await;
    assert_eq!(closed["open"], 1, "{closed}");

    // Draining: not ready, no new connections, the in-flight write still completes.
    let ready = send("GET", &format!("http://{}/readyz", p.admin), &[], "").await;
    assert_eq!(
        (ready.status.as_u16(), ready.text().as_str()),
        (503, "draining\n")
    );
    assert!(tokio::net::TcpStream::connect(p.proxy).await.is_err());
    up.release(1);
    let reply = in_flight.await.unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(reply.text(), "ok");

    let status = tokio::time::timeout(Duration::from_secs(20), p.child.wait())
        .await
        .expect("did not exit after draining")
        .unwrap();
    assert_eq!(status.code(), Some(0));
    wait_log(&mut p.logs, "stopped").await;
}

#[test]
fn check_prints_the_effective_config_or_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.yaml");
    std::fs::write(
        &good,
        format!("upstream: http://127.0.0.1:8080\n{ACCOUNTS}"),
    )
    .unwrap();
    let out = std::process::Command::new(BIN)
        .args(["check", "--config"])
        .arg(&good)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("listen: 0.0.0.0:7440"), "{text}");
    assert!(text.contains("header: fencing-token"), "{text}");
    // No `ordering: serialize`, so no `barrier_timeout`: nothing waits.
    assert!(!text.contains("barrier_timeout"), "{text}");

    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "upstream: http://127.0.0.1:8080\nroutes:\n  - name: a\n    path: /a\n    ordering: sometimes\n").unwrap();
    let out = std::process::Command::new(BIN)
        .args(["check", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("routes[0].ordering: unknown variant `sometimes`"),
        "{err}"
    );
    assert!(err.contains("line 5 column 15"), "{err}");

    // The upstream's CA bundle is read by `check` as `run` reads it: a missing file fails here.
    let no_ca = dir.path().join("no-ca.yaml");
    std::fs::write(
        &no_ca,
        format!(
            "upstream: https://127.0.0.1:8443
upstream_ca: /nonexistent/ca.pem
{ACCOUNTS}"
        ),
    )
    .unwrap();
    let out = std::process::Command::new(BIN)
        .args(["check", "--config"])
        .arg(&no_ca)
        .output()
        .unwrap();
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("upstream_ca: "), "{err}");
    assert!(err.contains("/nonexistent/ca.pem"), "{err}");

    let usage = std::process::Command::new(BIN)
        .args(["check"])
        .output()
        .unwrap();
    assert_eq!(usage.status.code(), Some(2));
    let ttl = std::process::Command::new(BIN)
        .args([
            "ttl",
            "--p99-work",
            "800ms",
            "--p99-rtt",
            "40ms",
            "--safety-margin",
            "200ms",
            "--json",
        ])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8(ttl.stdout).unwrap().trim(),
        r#"{"base_ms":1040,"ttl_ms":1500,"renew_every_ms":500,"dedup_window_ms":2300}"#
    );
}

/// Runs `fencegate ARGS...`; its exit code, stdout and stderr.
fn fencegate_cli(args: &[&std::ffi::OsStr]) -> (Option<i32>, String, String) {
    let out = std::process::Command::new(BIN).args(args).output().unwrap();
    (
        out.status.code(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

pub(crate) fn check_file(path: &Path) -> (Option<i32>, String, String) {
    fencegate_cli(&["check".as_ref(), "--config".as_ref(), path.as_os_str()])
}

/// What `check` prints after its `# FILE: valid` line is a config file: checked again, it
/// prints the same, and the values that follow the lease TTL are on the `#` lines only.
#[test]
fn check_output_loads_again_as_the_same_config() {
    let dir = tempfile::tempdir().unwrap();
    let first = dir.path().join("worker.yaml");
    std::fs::write(
        &first,
        format!(
            "upstream: http://127.0.0.1:8080
store: {{ kind: memory }}
leases:
  backend: {{ kind: embedded, path: {} }}
  ttl: {{ p99_work: 800ms, p99_rtt: 40ms, safety_margin: 200ms, drift_buffer: 100ms }}
egress:
  upstream: http://127.0.0.1:8081
  routes:
    - {{ path: '/accounts/{{id}}', lease: 'account:{{id}}' }}
idempotency: {{}}
{ACCOUNTS}",
            dir.path().join("leases.db").display()
        ),
    )
    .unwrap();
    let (code, printed, stderr) = check_file(&first);
    assert_eq!((code, stderr.as_str()), (Some(0), ""), "{printed}");
    let (head, body) = printed.split_once('\n').unwrap();
    assert_eq!(head, format!("# {}: valid", first.display()));
    assert!(
        body.starts_with(
            "# token.max_step: a token more than 1099511627776 above the recorded maximum (or \
             above 1099511627776 for a resource with none) is refused\n\
             # leases: ttl 1500ms (minimum 1500ms), renew every 500ms, local deadline ttl - 100ms, \
             drain timeout 3s, dedup window 2300ms\n\
             # idempotency: header idempotency-key, window 2300ms, on routes [accounts]\n\
             listen: 0.0.0.0:7440\n"
        ),
        "{body}"
    );
    for pinned in ["drain_timeout", "window:", "    ttl:"] {
        assert!(!body.contains(pinned), "{pinned} in:\n{body}");
    }

    let second = dir.path().join("effective.yaml");
    std::fs::write(&second, &printed).unwrap();
    let (code, again, stderr) = check_file(&second);
    assert_eq!((code, stderr.as_str()), (Some(0), ""), "{again}");
    assert_eq!(
        again,
        printed.replacen(
            &first.display().to_string(),
            &second.display().to_string(),
            1
        )
    );
}

/// A derived TTL below the 30ms floor is raised to it: `ttl` and `check` say so on stderr
/// and print the TTL in effect; written below the floor, it is refused.
#[test]
fn a_derived_ttl_below_the_floor_is_raised_with_a_warning() {
    let warning = "the derived ttl 7ms is below the 30ms floor, under which a lease cannot be \
                   renewed reliably: the lease ttl is 30ms";
    let budgets = [
        "ttl",
        "--p99-work",
        "5ms",
        "--p99-rtt",
        "1ms",
        "--safety-margin",
        "1ms",
        "--round-to",
        "1ms",
    ]
    .map(std::ffi::OsStr::new);
    let (code, out, err) = fencegate_cli(&budgets);
    assert_eq!(code, Some(0));
    assert_eq!(err, format!("warning: {warning}\n"));
    assert_eq!(
        out,
        "base          7ms  (p99 work 5ms + p99 rtt 1ms + safety margin 1ms + drift buffer 0ms)\n\
         ttl           30ms  (base rounded up to a multiple of 1ms is 7ms, raised to the 30ms floor)\n\
         renew every   10ms  (ttl / 3, with ±15% jitter)\n\
         dedup window  35ms  (ttl + p99 work)\n"
    );
    let mut json = budgets.to_vec();
    json.push("--json".as_ref());
    let (code, out, err) = fencegate_cli(&json);
    assert_eq!(code, Some(0));
    assert_eq!(err, format!("warning: {warning}\n"));
    assert_eq!(
        out,
        "{\"base_ms\":7,\"ttl_ms\":30,\"renew_every_ms\":10,\"dedup_window_ms\":35}\n"
    );

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fast.yaml");
    let leases = "upstream: http://127.0.0.1:8080\nleases:\n  backend: { kind: embedded }\n  ttl: ";
    std::fs::write(
        &config,
        format!("{leases}{{ p99_work: 5ms, p99_rtt: 1ms, safety_margin: 1ms, round_to: 1ms }}\n"),
    )
    .unwrap();
    let (code, out, err) = check_file(&config);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        err,
        format!("warning: {}: leases.ttl: {warning}\n", config.display())
    );
    assert!(
        out.contains(
            "\n# leases: ttl 30ms (minimum 30ms), renew every 10ms, local deadline ttl - 0s, \
             drain timeout 60ms, dedup window 35ms\n"
        ),
        "{out}"
    );

    std::fs::write(&config, format!("{leases}12ms\n")).unwrap();
    let (code, out, err) = check_file(&config);
    assert_eq!((code, out.as_str()), (Some(1), ""));
    assert_eq!(
        err,
        format!(
            "error: {}: leases.ttl: a lease ttl of 12ms is below the 30ms floor, under which a \
             lease cannot be renewed reliably: write 30ms or more at line 4 column 8\n",
            config.display()
        )
    );

    // A ttl that does not divide by 3: the renewal interval printed to the millisecond.
    std::fs::write(&config, format!("{leases}5s\n")).unwrap();
    let (code, out, err) = check_file(&config);
    assert_eq!((code, err.as_str()), (Some(0), ""));
    assert!(
        out.contains("\n# leases: ttl 5s (minimum 5s), renew every 1667ms, local deadline"),
        "{out}"
    );
}

/// Replaces the config file the way a ConfigMap update does: a new file renamed over it.
fn replace_config(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test]
async fn config_reloads_live_and_refuses_invalid_edits() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &up.url(), "");
    let original = std::fs::read_to_string(&config).unwrap();
    let mut p = Process::start(&config).await;
    let jobs = format!("http://{}/jobs/1", p.proxy);

    // A keep-alive connection opened before the reload must survive it.
    let mut conn = tokio::net::TcpStream::connect(p.proxy).await.unwrap();
    let job_put = b"PUT /jobs/1 HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n";
    assert!(http_on(&mut conn, job_put)
        .await
        .starts_with("HTTP/1.1 200"));
    assert_eq!(put_to(p.proxy, "1", "5").await.status, 200);

    // Add a route: it takes effect without a restart.
    let with_jobs =
        format!("{original}  - {{ name: jobs, path: '/jobs/{{id}}', resource: 'job:{{id}}' }}\n");
    replace_config(&config, &with_jobs);
    let reloaded = wait_log(&mut p.logs, "configuration reloaded").await;
    assert_eq!(reloaded["routes"], 2);
    send("PUT", &jobs, &[], "")
        .await
        .assert_problem(428, "urn:fencegate:token-required");
    assert!(http_on(&mut conn, job_put)
        .await
        .starts_with("HTTP/1.1 428"));
    // Maxima carry over.
    put_to(p.proxy, "1", "4")
        .await
        .assert_problem(409, "urn:fencegate:stale-token");

    // An invalid edit is refused, with its location; traffic keeps flowing on the old config.
    replace_config(
        &config,
        &format!("{with_jobs}  - {{ name: jobs, path: /dup }}\n"),
    );
    let refused = wait_log(&mut p.logs, "configuration refused; the running one stays").await;
    assert!(
        refused["error"].as_str().unwrap().contains("already used"),
        "{refused}"
    );
    assert!(
        refused["error"].as_str().unwrap().contains("line "),
        "{refused}"
    );
    assert_eq!(
        send("PUT", &jobs, &[("fencing-token", "1")], "")
            .await
            .status,
        200
    );
    send("PUT", &jobs, &[], "")
        .await
        .assert_problem(428, "urn:fencegate:token-required");

    // SIGHUP re-reads the file even when it did not change (here: still invalid).
    p.signal("-HUP");
    let refused = wait_log(&mut p.logs, "configuration refused; the running one stays").await;
    assert_eq!(refused["trigger"], "SIGHUP");
    replace_config(&config, &with_jobs);
    wait_log(&mut p.logs, "configuration reloaded").await;

    let metrics = send("GET", &format!("http://{}/metrics", p.admin), &[], "")
        .await
        .text();
    assert!(
        metrics.contains(r#"fencegate_config_reloads_total{result="applied"} 2"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"fencegate_config_reloads_total{result="refused"} 2"#),
        "{metrics}"
    );
    assert_eq!(up.count(), 3);
    p.child.start_kill().unwrap();
}

/// Sends one request on an open connection and reads one response (Content-Length framed).
async fn http_on(conn: &mut tokio::net::TcpStream, request: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    conn.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = conn.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "connection closed: {}",
            String::from_utf8_lossy(&out)
        );
        out.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&out).into_owned();
        if let Some(head_end) = text.find("\r\n\r\n") {
            let length: usize = text[..head_end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap())
                })
                .unwrap_or(0);
            if out.len() >= head_end + 4 + length {
                return text;
            }
        }
    }
}

#[test]
fn demo_refuses_both_late_writes() {
    let out = std::process::Command::new(BIN)
        .arg("demo")
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("balance=90 token=33 -> 409 Conflict"),
        "{text}"
    );
    assert!(
        text.contains("-> 503 Service Unavailable from its own sidecar"),
        "{text}"
    );
    assert!(text.contains("urn:fencegate:lease-not-held"), "{text}");
    assert_eq!(text.matches("ledger write 3").count(), 0, "{text}");
}

/// `run`'s log lines are JSON when stderr is not a terminal (a container's never is), a
/// readable line on a terminal, and as `--log-format` or `log.format` say otherwise. Start-up
/// errors follow the same rule: a configuration that cannot be read is reported in the
/// format of the flag, or by the terminal test.
#[test]
fn run_logs_json_to_a_pipe_and_text_to_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "upstream: http://127.0.0.1:8080\nlisten: nowhere\n").unwrap();
    let (code, _, stderr) = fencegate_cli(&["run".as_ref(), "--config".as_ref(), bad.as_os_str()]);
    assert_eq!(code, Some(1));
    let line: Value =
        serde_json::from_str(stderr.trim()).unwrap_or_else(|e| panic!("{e}: {stderr}"));
    assert_eq!(line["level"], "ERROR", "{line}");
    assert_eq!(line["message"], "invalid configuration", "{line}");
    let error = line["error"].as_str().unwrap();
    assert!(
        error.contains("bad.yaml: listen: `nowhere` has no port"),
        "{line}"
    );

    // The same under a pseudo-terminal (util-linux `script` gives the process one).
    let on_terminal = |args: &str| {
        let out = std::process::Command::new("script")
            .args([
                "-qec",
                &format!("{BIN} run --config {} {args}", bad.display()),
                "/dev/null",
            ])
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap()
    };
    let text = on_terminal("");
    assert!(text.contains(" ERROR "), "{text}");
    assert!(text.contains("invalid configuration error="), "{text}");
    assert!(
        text.contains("bad.yaml: listen: `nowhere` has no port"),
        "{text}"
    );
    assert!(!text.trim_start().starts_with('{'), "{text}");
    // `--log-format json` on a terminal, `--log-format text` to a pipe.
    let json = on_terminal("--log-format json");
    assert!(json.trim_start().starts_with("{\""), "{json}");
    let (_, _, text) = fencegate_cli(&[
        "run".as_ref(),
        "--config".as_ref(),
        bad.as_os_str(),
        "--log-format".as_ref(),
        "text".as_ref(),
    ]);
    assert!(text.contains(" ERROR ") && !text.starts_with('{'), "{text}");

    // `log.format` in the file governs a running process's lines.
    let good = dir.path().join("good.yaml");
    std::fs::write(
        &good,
        "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://127.0.0.1:9\nstore: { kind: memory }\nlog: { format: text }\nroutes: [{ name: a, path: /a }]\n",
    )
    .unwrap();
    let mut child = std::process::Command::new(BIN)
        .args(["run", "--config"])
        .arg(&good)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stderr.take().unwrap()),
        &mut first,
    )
    .unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        first.contains(" INFO ") && !first.starts_with('{'),
        "{first}"
    );
    // A wrong value is a configuration error with its place.
    std::fs::write(
        &bad,
        "upstream: http://127.0.0.1:8080\nlog: { format: yaml }\n",
    )
    .unwrap();
    let (code, _, stderr) = check_file(&bad);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("log.format"), "{stderr}");
}
