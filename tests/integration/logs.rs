//! What the real binary logs and exports, line by line: the access log, the reload line, the
//! lease lines, and the request-duration, build and process series.
//!
//! Every log line is read from the process's stderr; the lines of a whole run are read up to
//! the process's exit (no sleeps, no guessing when a line would have come).

use std::path::Path;

use serde_json::Value;

use crate::common::*;
use crate::process::{put_to, wait_log, Process};
use crate::services::{fresh_prefix, REDIS_URL};

/// The line as compact JSON, in the order the process wrote its fields, with `timestamp` and
/// the `varying` fields (checked to be numbers, or for `request_id` an id fencegate made: 32
/// hex digits) replaced by `"…"`.
fn exact(mut line: Value, varying: &[&str]) -> String {
    let text = line.to_string();
    let fields = line
        .as_object_mut()
        .unwrap_or_else(|| panic!("not an object: {text}"));
    for key in ["timestamp"].iter().chain(varying) {
        let value = fields
            .get_mut(*key)
            .unwrap_or_else(|| panic!("no {key} in {text}"));
        let made_id = |v: &Value| {
            v.as_str()
                .is_some_and(|id| id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()))
        };
        assert!(
            *key == "timestamp" || value.is_u64() || (*key == "request_id" && made_id(value)),
            "{key} is not a number (or a request id fencegate made) in {text}"
        );
        *value = Value::String("…".into());
    }
    line.to_string()
}

/// Every remaining line, once the process has exited on SIGTERM.
async fn lines_to_exit(p: &mut Process) -> Vec<Value> {
    p.signal("-TERM");
    let mut lines = Vec::new();
    let all = async {
        while let Some(line) = p.logs.recv().await {
            lines.push(line);
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(20), all)
        .await
        .expect("the process did not exit within 20s of SIGTERM");
    lines
}

fn write(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

async fn metrics(p: &Process) -> String {
    send("GET", &format!("http://{}/metrics", p.admin), &[], "")
        .await
        .text()
}

/// `fencegate_lease_held` and `fencegate_held_lease_count`, as exported.
fn held_series(text: &str) -> (Vec<&str>, Vec<&str>) {
    (
        series(text, "fencegate_lease_held"),
        series(text, "fencegate_held_lease_count"),
    )
}

/// The exposition lines of one metric (its samples, not its `# HELP` and `# TYPE`).
fn series<'a>(text: &'a str, name: &str) -> Vec<&'a str> {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(['{', ' ']))
        })
        .collect()
}

#[tokio::test]
async fn access_log_lines_follow_the_switch_and_a_reload_says_what_it_changed() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fencegate.yaml");
    let base = format!(
        "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: {}\nstore: {{ kind: memory }}\n{ACCOUNTS}",
        up.url()
    );
    write(&config, &base);
    let mut p = Process::start(&config).await;
    let get = |p: &Process| {
        let url = format!("http://{}/accounts/1", p.proxy);
        async move { send("GET", &url, &[], "").await }
    };

    // Off (the default): a forwarded write, a stale one and a read, and no access line.
    assert_eq!(put_to(p.proxy, "1", "5").await.status, 200);
    put_to(p.proxy, "1", "4")
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(get(&p).await.status, 200);

    // On with one switch, applied by a reload, which names it as what changed.
    write(&config, &format!("access_log: true\n{base}"));
    let reloaded = wait_log(&mut p.logs, "configuration reloaded").await;
    assert_eq!(
        exact(reloaded, &[]),
        r#"{"timestamp":"…","level":"INFO","message":"configuration reloaded","trigger":"file changed","routes":1,"changed":"access_log","not_applied_until_restart":"","target":"fencegate::reload"}"#
    );
    // The client's request id is kept, its trace context logged, its query's values masked.
    let traced = send(
        "PUT",
        &format!("http://{}/accounts/1?account=1&mode=x", p.proxy),
        &[
            ("fencing-token", "6"),
            ("x-request-id", "req-42"),
            (
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            ),
        ],
        "w",
    )
    .await;
    assert_eq!(traced.status, 200);
    let refused = put_to(p.proxy, "1", "5").await;
    refused.assert_problem(409, "urn:fencegate:stale-token");
    let refused_bytes = refused.body.len();
    assert_eq!(get(&p).await.status, 200);
    // The path as it came, where normalising changed it (`%31` is `1`).
    let odd = format!("http://{}/accounts/%31", p.proxy);
    assert_eq!(send("GET", &odd, &[], "").await.status, 200);

    let text = metrics(&p).await;
    let access: Vec<Value> = lines_to_exit(&mut p)
        .await
        .into_iter()
        .filter(|l| l["target"] == "fencegate::access")
        .collect();
    let [admitted, stale, read, encoded] = <[Value; 4]>::try_from(access)
        .unwrap_or_else(|lines| panic!("not four access lines: {lines:#?}"));
    for line in [&admitted, &read, &encoded] {
        assert!(
            line["upstream_duration_us"].as_u64() <= line["duration_us"].as_u64(),
            "{line}"
        );
    }
    // The ids fencegate made went upstream with the requests they name.
    let seen = up.seen();
    let sent_ids: Vec<&str> = seen
        .iter()
        .rev()
        .take(3)
        .map(|s| s.headers["x-request-id"].to_str().unwrap())
        .collect();
    assert_eq!(sent_ids[2], "req-42");
    assert_eq!(sent_ids[1], read["request_id"].as_str().unwrap());
    assert_eq!(sent_ids[0], encoded["request_id"].as_str().unwrap());
    assert_ne!(stale["request_id"], read["request_id"]);
    let upstream = up.addr.to_string();
    let both = ["duration_us", "upstream_duration_us"];
    let made = ["request_id", "duration_us", "upstream_duration_us"];
    assert_eq!(
        exact(admitted, &both),
        format!(
            r#"{{"timestamp":"…","level":"INFO","message":"request","route":"accounts","method":"PUT","path":"/accounts/1","query":"account=…&mode=…","protocol":"HTTP/1.1","client":"127.0.0.1","request_id":"req-42","traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01","resource":"account:1","fencing_token":6,"status":200,"outcome":"admitted","bytes_in":1,"bytes_out":2,"upstream":"{upstream}","duration_us":"…","upstream_duration_us":"…","target":"fencegate::access"}}"#
        )
    );
    assert_eq!(
        exact(stale, &["request_id", "duration_us"]),
        format!(
            r#"{{"timestamp":"…","level":"INFO","message":"request","route":"accounts","method":"PUT","path":"/accounts/1","protocol":"HTTP/1.1","client":"127.0.0.1","request_id":"…","resource":"account:1","fencing_token":5,"status":409,"outcome":"stale","refusal":"stale-token","bytes_in":0,"bytes_out":{refused_bytes},"duration_us":"…","target":"fencegate::access"}}"#
        )
    );
    assert_eq!(
        exact(read, &made),
        format!(
            r#"{{"timestamp":"…","level":"INFO","message":"request","route":"accounts","method":"GET","path":"/accounts/1","protocol":"HTTP/1.1","client":"127.0.0.1","request_id":"…","status":200,"outcome":"forwarded","bytes_in":0,"bytes_out":2,"upstream":"{upstream}","duration_us":"…","upstream_duration_us":"…","target":"fencegate::access"}}"#
        )
    );
    assert_eq!(
        exact(encoded, &made),
        format!(
            r#"{{"timestamp":"…","level":"INFO","message":"request","route":"accounts","method":"GET","path":"/accounts/%31","protocol":"HTTP/1.1","client":"127.0.0.1","request_id":"…","status":200,"outcome":"forwarded","bytes_in":0,"bytes_out":2,"upstream":"{upstream}","duration_us":"…","upstream_duration_us":"…","target":"fencegate::access"}}"#
        )
    );

    // The end-to-end histogram: a series per route, outcome, method and code that happened,
    // none for the others; the build and the process.
    let counts = series(&text, "fencegate_request_duration_seconds_count");
    assert_eq!(
        counts,
        [
            r#"fencegate_request_duration_seconds_count{code="200",method="GET",outcome="forwarded",route="accounts"} 3"#,
            r#"fencegate_request_duration_seconds_count{code="200",method="PUT",outcome="admitted",route="accounts"} 2"#,
            r#"fencegate_request_duration_seconds_count{code="409",method="PUT",outcome="stale",route="accounts"} 2"#,
        ],
        "{text}"
    );
    let buckets = series(&text, "fencegate_request_duration_seconds_bucket");
    assert_eq!(buckets.len(), 3 * 16, "{text}");
    assert!(
        buckets.contains(
            &r#"fencegate_request_duration_seconds_bucket{code="409",method="PUT",outcome="stale",route="accounts",le="+Inf"} 2"#
        ),
        "{text}"
    );
    assert_eq!(
        series(&text, "fencegate_build_info"),
        [format!(
            r#"fencegate_build_info{{version="{}"}} 1"#,
            env!("CARGO_PKG_VERSION")
        )],
    );
    for name in [
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
    ] {
        let found = series(&text, name);
        assert_eq!(found.len(), 1, "{name} in\n{text}");
        let value: f64 = found[0][name.len() + 1..].parse().unwrap();
        // A young process may not have spent a clock tick of CPU yet.
        let least = if name == "process_cpu_seconds_total" {
            0.0
        } else {
            1.0
        };
        assert!(value >= least, "{}", found[0]);
    }
    assert_eq!(up.count(), 5);
}

/// The lease lines as the binary writes them: acquire, renew (a `DEBUG` line), lose, release,
/// one line each, and `fencegate_lease_held` there only while held.
#[tokio::test]
async fn lease_lines_for_acquire_renew_lose_and_release() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fencegate.yaml");
    let prefix = fresh_prefix();
    write(
        &config,
        &format!(
            "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://127.0.0.1:9\nstore: {{ kind: memory }}\n\
             leases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: redis, url: '{REDIS_URL}', prefix: {prefix} }}\n  ttl: 1500ms\n"
        ),
    );
    let mut p =
        Process::start_with_env(&config, &[("FENCEGATE_LOG", "info,fencegate::lease=debug")]).await;
    let lease_url = format!("http://{}/v1/leases/job:1", p.leases.unwrap());
    let acquire = || async {
        let reply = send("POST", &lease_url, &[], r#"{"holder":"w1"}"#).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        let body = reply.json();
        (
            body["lease_id"].as_str().unwrap().to_owned(),
            body["fencing_token"].as_u64().unwrap(),
        )
    };
    let fields = |id: &str, token: u64| {
        format!(
            r#""resource":"job:1","holder_id":"w1","lease_id":"{id}","fencing_token":{token},"ttl_ms":1500"#
        )
    };

    let (id, token) = acquire().await;
    let f = fields(&id, token);
    assert_eq!(
        exact(wait_log(&mut p.logs, "lease held").await, &[]),
        format!(
            r#"{{"timestamp":"…","level":"INFO","message":"lease held",{f},"state":"held","target":"fencegate::lease::agent"}}"#
        )
    );
    assert_eq!(
        held_series(&metrics(&p).await),
        (
            vec![r#"fencegate_lease_held{resource="job:1"} 1"#],
            vec!["fencegate_held_lease_count 1"]
        )
    );
    assert_eq!(
        exact(
            wait_log(&mut p.logs, "lease renewed").await,
            &["valid_for_ms"]
        ),
        format!(
            r#"{{"timestamp":"…","level":"DEBUG","message":"lease renewed",{f},"valid_for_ms":"…","state":"held","target":"fencegate::lease::agent"}}"#
        )
    );

    // The lease disappears from the backend (an operator, a failover): the next renewal finds
    // it gone, and the one line says so, with the reason and the new state.
    let redis = ::redis::Client::open(REDIS_URL).unwrap();
    let mut conn = redis.get_multiplexed_async_connection().await.unwrap();
    let deleted: i64 = ::redis::cmd("DEL")
        .arg(format!("{prefix}:{{job:1}}:lease"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(deleted, 1);
    assert_eq!(
        exact(wait_log(&mut p.logs, "lease lost").await, &[]),
        format!(
            r#"{{"timestamp":"…","level":"WARN","message":"lease lost",{f},"reason":"the backend no longer has this lease","state":"expired","target":"fencegate::lease::agent"}}"#
        )
    );
    assert_eq!(
        held_series(&metrics(&p).await),
        (vec![], vec!["fencegate_held_lease_count 0"])
    );

    let (id, token) = acquire().await;
    let f = fields(&id, token);
    wait_log(&mut p.logs, "lease held").await;
    let released = send("DELETE", &lease_url, &[], "").await;
    assert_eq!(released.status, 200, "{}", released.text());
    assert_eq!(
        exact(wait_log(&mut p.logs, "lease released").await, &[]),
        format!(
            r#"{{"timestamp":"…","level":"INFO","message":"lease released",{f},"state":"released","target":"fencegate::lease::agent"}}"#
        )
    );
    assert_eq!(
        held_series(&metrics(&p).await),
        (vec![], vec!["fencegate_held_lease_count 0"])
    );
    // The drain at shutdown has nothing left to release.
    let rest = lines_to_exit(&mut p).await;
    let messages: Vec<&str> = rest
        .iter()
        .filter(|l| l["target"] == "fencegate::lease::agent")
        .filter_map(|l| l["message"].as_str())
        .filter(|m| *m != "lease renewed")
        .collect();
    assert!(messages.is_empty(), "{messages:?}");
}

/// An upstream that cannot be reached: the fenced write is answered `502 upstream-error`, and
/// its access line says so, field by field (the address it tried, the bytes that went each
/// way: none of the body was read, as no connection took it; the refusal's type), beside the
/// `WARN` line of the failure.
#[tokio::test]
async fn an_upstream_error_has_its_access_line() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fencegate.yaml");
    // A port nothing listens on: bound, then closed.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    write(
        &config,
        &format!(
            "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://{closed}\n\
             access_log: true\nstore: {{ kind: memory }}\n{ACCOUNTS}"
        ),
    );
    let mut p = Process::start(&config).await;
    let failed = send(
        "PUT",
        &format!("http://{}/accounts/7", p.proxy),
        &[("fencing-token", "3"), ("x-request-id", "req-7")],
        "write",
    )
    .await;
    let body = failed.assert_problem(502, "urn:fencegate:upstream-error");
    let failed_bytes = failed.body.len();
    assert_eq!(body["resource"], "account:7", "{body}");
    let lines = lines_to_exit(&mut p).await;
    let access: Vec<&Value> = lines
        .iter()
        .filter(|l| l["target"] == "fencegate::access")
        .collect();
    let [line] = <[&Value; 1]>::try_from(access)
        .unwrap_or_else(|lines| panic!("not one access line: {lines:#?}"));
    assert_eq!(
        exact(line.clone(), &["duration_us", "upstream_duration_us"]),
        format!(
            r#"{{"timestamp":"…","level":"INFO","message":"request","route":"accounts","method":"PUT","path":"/accounts/7","protocol":"HTTP/1.1","client":"127.0.0.1","request_id":"req-7","resource":"account:7","fencing_token":3,"status":502,"outcome":"upstream_error","refusal":"upstream-error","bytes_in":0,"bytes_out":{failed_bytes},"upstream":"{closed}","duration_us":"…","upstream_duration_us":"…","target":"fencegate::access"}}"#
        )
    );
    assert!(
        lines
            .iter()
            .any(|l| l["message"] == "upstream failed" && l["status"] == 502),
        "{lines:#?}"
    );
}
