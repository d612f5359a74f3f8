//! `fencegate fences get|list|reset` against real stores, beside fencegates running on them
//! (separate processes, like sidecars): what the replicas recorded is what the commands print,
//! a reset reaches every running replica, and a reset nobody confirmed changes nothing.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::process::Command;

use crate::common::*;
use crate::process::{put_to, Process};
use crate::services::Service;
use crate::stores::store_yaml;

const BIN: &str = env!("CARGO_BIN_EXE_fencegate");
/// The highest token there is: a maximum a misbehaving client recorded, refusing every write.
const POISON: &str = "9223372036854775807";

/// A store on a fresh prefix and a config file naming it.
struct Setup {
    config: PathBuf,
    _dir: tempfile::TempDir,
    _service: Option<Service>,
}

async fn setup(kind: &str, upstream: &str) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let (store, service) = store_yaml(kind, &dir).await;
    let config = dir.path().join("fencegate.yaml");
    std::fs::write(
        &config,
        // `max_step: off`: the poison is recorded as it was before the ceiling refused it.
        format!(
            "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: {upstream}\n\
             token: {{ max_step: off }}\n{store}{ACCOUNTS}"
        ),
    )
    .unwrap();
    Setup {
        config,
        _dir: dir,
        _service: service,
    }
}

/// What one command run did.
pub(crate) struct Ran {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Ran {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}\nstderr: {}", self.stdout, self.stderr))
    }

    /// The log lines (JSON: stderr is no terminal) with `audit: fence_reset`.
    fn audit(&self) -> Vec<Value> {
        self.stderr
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|l| l["audit"] == "fence_reset")
            .collect()
    }
}

/// Runs `fencegate fences ARGS --config CONFIG` with no terminal on stdin.
pub(crate) async fn fences(config: &Path, args: &[&str]) -> Ran {
    let out = Command::new(BIN)
        .arg("fences")
        .args(args)
        .arg("--config")
        .arg(config)
        .env("USER", "oncall-test")
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap();
    Ran {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

async fn max_of(config: &Path, resource: &str) -> Value {
    let ran = fences(config, &["get", resource, "--output", "json"]).await;
    assert_eq!(ran.code, 0, "stderr: {}", ran.stderr);
    ran.json()["max_token"].clone()
}

/// The resources and maxima of a `list --output json`.
pub(crate) fn listed(page: &Value) -> Vec<(String, u64)> {
    page["fences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["resource"].as_str().unwrap().to_owned(),
                f["max_token"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn owned(pairs: &[(&str, u64)]) -> Vec<(String, u64)> {
    pairs.iter().map(|(r, t)| ((*r).to_owned(), *t)).collect()
}

/// Writes `token` to `/accounts/{id}` until it is admitted: a reset reaches a running
/// fencegate at its next read of the store's reset generation (every second).
async fn admitted_eventually(addr: std::net::SocketAddr, id: &str, token: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let reply = put_to(addr, id, token).await;
        if reply.status == 200 {
            return;
        }
        assert_eq!(reply.status, 409, "{}", reply.text());
        assert!(
            Instant::now() < deadline,
            "{addr} still refuses {token} 10s after the reset"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn resets_counted(admin: std::net::SocketAddr) -> String {
    let metrics = send("GET", &format!("http://{admin}/metrics"), &[], "")
        .await
        .text();
    metrics
        .lines()
        .find(|l| l.starts_with("fencegate_fence_resets_total "))
        .unwrap_or_else(|| panic!("no fencegate_fence_resets_total in\n{metrics}"))
        .to_owned()
}

async fn stop(mut p: Process) {
    p.signal("-TERM");
    let status = p.child.wait().await.unwrap();
    assert!(status.success(), "{status}");
}

/// Two replicas record maxima; `get` and `list` print exactly those, in pages.
async fn get_and_list_show_what_the_replicas_recorded(kind: &str) {
    let up = Upstream::start().await;
    let s = setup(kind, &up.url()).await;
    let one = Process::start(&s.config).await;
    let two = Process::start(&s.config).await;
    assert_eq!(put_to(one.proxy, "1", "5").await.status, 200);
    assert_eq!(put_to(two.proxy, "2", "7").await.status, 200);
    assert_eq!(put_to(two.proxy, "1", "6").await.status, 200);
    assert_eq!(put_to(one.proxy, "10", "3").await.status, 200);

    let got = fences(&s.config, &["get", "account:1", "--output", "json"]).await;
    assert_eq!(got.code, 0, "{}", got.stderr);
    let got = got.json();
    assert_eq!(got["resource"], "account:1");
    assert_eq!(got["max_token"], 6);
    assert_eq!(got["store"], kind);
    // Nothing recorded: said, exit 0.
    let none = fences(&s.config, &["get", "account:404", "--output", "json"]).await;
    assert_eq!(none.code, 0, "{}", none.stderr);
    assert_eq!(
        none.json(),
        json!({ "resource": "account:404", "max_token": null, "store": kind })
    );
    let none = fences(&s.config, &["get", "account:404"]).await;
    assert_eq!(
        none.stdout,
        format!("account:404: nothing recorded in the {kind} store\n")
    );

    let all = fences(&s.config, &["list", "--output", "json"]).await;
    assert_eq!(all.code, 0, "{}", all.stderr);
    let all = all.json();
    assert_eq!(
        listed(&all),
        owned(&[("account:1", 6), ("account:10", 3), ("account:2", 7)])
    );
    assert_eq!(all["next"], Value::Null);
    // Pages of two, by the cursor.
    let first = fences(&s.config, &["list", "--limit", "2", "--output", "json"])
        .await
        .json();
    assert_eq!(
        listed(&first),
        owned(&[("account:1", 6), ("account:10", 3)])
    );
    assert_eq!(first["next"], "account:10");
    let second = fences(
        &s.config,
        &[
            "list",
            "--limit",
            "2",
            "--after",
            "account:10",
            "--output",
            "json",
        ],
    )
    .await
    .json();
    assert_eq!(listed(&second), owned(&[("account:2", 7)]));
    assert_eq!(second["next"], Value::Null);
    // A resource prefix.
    let under = fences(
        &s.config,
        &["list", "--prefix", "account:1", "--output", "json"],
    )
    .await
    .json();
    assert_eq!(
        listed(&under),
        owned(&[("account:1", 6), ("account:10", 3)])
    );
    // The table.
    let table = fences(&s.config, &["list", "--prefix", "account:2"]).await;
    assert_eq!(table.code, 0, "{}", table.stderr);
    let lines: Vec<&str> = table.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{}", table.stdout);
    assert!(
        lines[0].starts_with("RESOURCE   MAX_TOKEN"),
        "{}",
        table.stdout
    );
    assert!(lines[1].starts_with("account:2  7"), "{}", table.stdout);
    drop((one, two));
}

#[tokio::test]
async fn get_and_list_show_what_two_redis_replicas_recorded() {
    get_and_list_show_what_the_replicas_recorded("redis").await;
}

#[tokio::test]
async fn get_and_list_show_what_two_postgres_replicas_recorded() {
    get_and_list_show_what_the_replicas_recorded("postgres").await;
}

#[tokio::test]
async fn get_and_list_show_what_two_etcd_replicas_recorded() {
    get_and_list_show_what_the_replicas_recorded("etcd").await;
}

/// A poisoned maximum, recorded through one replica, refuses every write on both; a reset
/// nobody confirmed changes nothing; `reset --yes` lowers it, logs who did it, and both
/// replicas admit the next normal write and count the reset.
async fn reset_reaches_both_running_replicas(kind: &str) {
    let up = Upstream::start().await;
    let s = setup(kind, &up.url()).await;
    let one = Process::start(&s.config).await;
    let two = Process::start(&s.config).await;
    assert_eq!(put_to(one.proxy, "1", POISON).await.status, 200);
    assert_eq!(put_to(one.proxy, "1", "5").await.status, 409);
    assert_eq!(put_to(two.proxy, "1", "5").await.status, 409);
    // Another resource, which the reset leaves alone.
    assert_eq!(put_to(two.proxy, "2", "8").await.status, 200);

    // No terminal, no --yes: refused, nothing changed.
    let refused = fences(
        &s.config,
        &["reset", "account:1", "--to", "4", "--reason", "poisoned"],
    )
    .await;
    assert_eq!(refused.code, 1, "{}", refused.stderr);
    assert!(
        refused
            .stderr
            .contains("not resetting: no terminal to confirm on and no --yes; nothing changed"),
        "{}",
        refused.stderr
    );
    assert!(refused.audit().is_empty(), "{}", refused.stderr);
    assert_eq!(
        max_of(&s.config, "account:1").await,
        json!(9223372036854775807u64)
    );
    assert_eq!(put_to(two.proxy, "1", "5").await.status, 409);

    let reset = fences(
        &s.config,
        &[
            "reset",
            "account:1",
            "--to",
            "4",
            "--reason",
            "poisoned by a bad client",
            "--yes",
            "--output",
            "json",
        ],
    )
    .await;
    assert_eq!(reset.code, 0, "{}", reset.stderr);
    assert_eq!(
        reset.json(),
        json!({ "resource": "account:1", "before": 9223372036854775807u64, "after": 4, "store": kind })
    );
    let audit = reset.audit();
    assert_eq!(audit.len(), 1, "{}", reset.stderr);
    let line = &audit[0];
    assert_eq!(line["message"], "fence maximum reset");
    assert_eq!(line["user"], "oncall-test");
    assert_eq!(line["uid"], json!(uid()));
    assert_eq!(line["store"], kind);
    assert_eq!(line["resource"], "account:1");
    assert_eq!(line["before"], json!(9223372036854775807u64));
    assert_eq!(line["after"], 4);
    assert_eq!(line["reason"], "poisoned by a bad client");
    assert_eq!(max_of(&s.config, "account:1").await, json!(4));

    admitted_eventually(one.proxy, "1", "5").await;
    admitted_eventually(two.proxy, "1", "5").await;
    assert_eq!(max_of(&s.config, "account:1").await, json!(5));
    // Still fenced: below the new maximum is stale on both.
    assert_eq!(put_to(one.proxy, "1", "4").await.status, 409);
    assert_eq!(put_to(two.proxy, "1", "4").await.status, 409);
    assert_eq!(put_to(one.proxy, "2", "7").await.status, 409);
    assert_eq!(max_of(&s.config, "account:2").await, json!(8));
    for admin in [one.admin, two.admin] {
        assert_eq!(
            resets_counted(admin).await,
            "fencegate_fence_resets_total 1"
        );
    }
}

fn uid() -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").unwrap().uid()
}

#[tokio::test]
async fn reset_reaches_both_running_redis_replicas() {
    reset_reaches_both_running_replicas("redis").await;
}

#[tokio::test]
async fn reset_reaches_both_running_postgres_replicas() {
    reset_reaches_both_running_replicas("postgres").await;
}

#[tokio::test]
async fn reset_reaches_both_running_etcd_replicas() {
    reset_reaches_both_running_replicas("etcd").await;
}

/// A token-space restart: every maximum under a resource prefix is set at once; the others
/// stay, and both replicas admit the restarted tokens.
#[tokio::test]
async fn reset_all_under_a_prefix_restarts_the_token_space() {
    let up = Upstream::start().await;
    let s = setup("redis", &up.url()).await;
    let one = Process::start(&s.config).await;
    let two = Process::start(&s.config).await;
    assert_eq!(put_to(one.proxy, "1", "900").await.status, 200);
    assert_eq!(put_to(two.proxy, "2", "901").await.status, 200);
    assert_eq!(put_to(one.proxy, "3", "902").await.status, 200);
    // Each replica caches both maxima it refuses a token below.
    for p in [&one, &two] {
        for id in ["1", "2"] {
            assert_eq!(put_to(p.proxy, id, "1").await.status, 409);
        }
    }
    let reset = fences(
        &s.config,
        &[
            "reset",
            "--all-under",
            "account:",
            "--to",
            "0",
            "--reason",
            "new etcd cluster",
            "--yes",
            "--output",
            "json",
        ],
    )
    .await;
    assert_eq!(reset.code, 0, "{}", reset.stderr);
    let doc = reset.json();
    assert_eq!(doc["prefix"], "account:");
    assert_eq!(
        doc["resets"],
        json!([
            { "resource": "account:1", "before": 900, "after": 0 },
            { "resource": "account:2", "before": 901, "after": 0 },
            { "resource": "account:3", "before": 902, "after": 0 },
        ])
    );
    assert_eq!(reset.audit().len(), 3, "{}", reset.stderr);
    let all = fences(&s.config, &["list", "--output", "json"])
        .await
        .json();
    assert_eq!(
        listed(&all),
        owned(&[("account:1", 0), ("account:2", 0), ("account:3", 0)])
    );
    for p in [&one, &two] {
        for id in ["1", "2"] {
            admitted_eventually(p.proxy, id, "1").await;
        }
    }
    for admin in [one.admin, two.admin] {
        assert_eq!(
            resets_counted(admin).await,
            "fencegate_fence_resets_total 3"
        );
    }
}

/// The embedded store's file is one process's: the commands say so while fencegate runs, and
/// read and reset it once that fencegate is stopped; the next one starts from the reset.
#[tokio::test]
async fn embedded_is_inspected_and_reset_where_no_fencegate_has_the_file() {
    let up = Upstream::start().await;
    let s = setup("embedded", &up.url()).await;
    let running = Process::start(&s.config).await;
    assert_eq!(put_to(running.proxy, "1", "5").await.status, 200);
    assert_eq!(put_to(running.proxy, "2", POISON).await.status, 200);
    let busy = fences(&s.config, &["get", "account:1"]).await;
    assert_eq!(busy.code, 1, "{}", busy.stdout);
    assert!(
        busy.stderr
            .contains("is open in another process (a running fencegate"),
        "{}",
        busy.stderr
    );
    let busy = fences(
        &s.config,
        &["reset", "account:2", "--to", "4", "--reason", "x", "--yes"],
    )
    .await;
    assert_eq!(busy.code, 1, "{}", busy.stdout);
    assert!(busy.audit().is_empty(), "{}", busy.stderr);
    stop(running).await;

    assert_eq!(max_of(&s.config, "account:1").await, json!(5));
    let all = fences(&s.config, &["list", "--output", "json"])
        .await
        .json();
    assert_eq!(
        listed(&all),
        owned(&[("account:1", 5), ("account:2", 9223372036854775807)])
    );
    let refused = fences(
        &s.config,
        &["reset", "account:2", "--to", "4", "--reason", "poisoned"],
    )
    .await;
    assert_eq!(refused.code, 1, "{}", refused.stderr);
    assert_eq!(
        max_of(&s.config, "account:2").await,
        json!(9223372036854775807u64)
    );
    let reset = fences(
        &s.config,
        &[
            "reset",
            "account:2",
            "--to",
            "4",
            "--reason",
            "poisoned",
            "--yes",
        ],
    )
    .await;
    assert_eq!(reset.code, 0, "{}", reset.stderr);
    assert_eq!(reset.stdout, "account:2: 9223372036854775807 -> 4\n");
    assert_eq!(reset.audit().len(), 1, "{}", reset.stderr);

    let next = Process::start(&s.config).await;
    assert_eq!(put_to(next.proxy, "2", "5").await.status, 200);
    assert_eq!(put_to(next.proxy, "2", "4").await.status, 409);
    assert_eq!(put_to(next.proxy, "1", "4").await.status, 409);
}

/// The admin listener's read-only `GET /fences/{resource}`.
#[tokio::test]
async fn the_admin_listener_answers_fences_without_the_version() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    assert_eq!(put(&fg, "1", "12").await.status, 200);
    let reply = send(
        "GET",
        &format!("http://{}/fences/account%3A1", fg.admin),
        &[],
        "",
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.json(),
        json!({ "resource": "account:1", "token": 12, "store": "memory" })
    );
    let reply = send(
        "GET",
        &format!("http://{}/fences/account%3A2", fg.admin),
        &[],
        "",
    )
    .await;
    assert_eq!(reply.status, 404);
    assert_eq!(reply.json()["token"], Value::Null);
}

/// The text form of the audit line quotes the reason and the user, so that a reason with
/// spaces (or `key=value` in it) reads as one field.
#[tokio::test]
async fn the_text_audit_line_quotes_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fencegate.yaml");
    std::fs::write(
        &config,
        format!(
            "upstream: http://127.0.0.1:9\nlog: {{ format: text }}\n\
             store: {{ kind: embedded, path: {} }}\n{ACCOUNTS}",
            dir.path().join("fences.db").display()
        ),
    )
    .unwrap();
    let reason = "INC-1: bogus token, owner=payments";
    let reset = fences(
        &config,
        &[
            "reset",
            "account:1",
            "--to",
            "3",
            "--reason",
            reason,
            "--yes",
        ],
    )
    .await;
    assert_eq!(reset.code, 0, "{}", reset.stderr);
    let line = reset
        .stderr
        .lines()
        .find(|l| l.contains("fence maximum reset"))
        .unwrap_or_else(|| panic!("no audit line: {}", reset.stderr));
    assert!(
        line.contains(&format!("reason=\"{reason}\"")) && line.contains("user=\"oncall-test\""),
        "{line}"
    );
}
