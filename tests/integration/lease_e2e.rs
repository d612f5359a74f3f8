//! The slow-writer scenario with real leases, end to end through real processes: a ledger,
//! a fence sidecar in front of it, and two worker sidecars that acquire leases (Redis backend)
//! and attach tokens on egress.

use std::path::Path;

use crate::common::*;
use crate::fence::assert_exact;
use crate::process::{wait_log, Process};
use crate::services::{fresh_prefix, REDIS_URL};

fn config(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

async fn acquire(p: &Process, holder: &str, wait: &str) -> Reply {
    send(
        "POST",
        &format!("http://{}/v1/leases/account:42", p.leases.unwrap()),
        &[("content-type", "application/json")],
        format!(r#"{{"holder":"{holder}","wait":"{wait}"}}"#),
    )
    .await
}

async fn egress_put(p: &Process, body: &str) -> Reply {
    // The app sends no token (and a forged one is replaced): the sidecar attaches its own.
    send(
        "PUT",
        &format!("http://{}/accounts/42", p.egress.unwrap()),
        &[("fencing-token", "999999")],
        body.to_owned(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_holder_is_fenced_after_its_lease_passes_to_another() {
    let ledger = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let fence = Process::start(&config(
        dir.path(),
        "fence.yaml",
        &format!(
            "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: {}\nstore: {{ kind: embedded, path: {} }}\n{ACCOUNTS}",
            ledger.url(),
            dir.path().join("fences.db").display()
        ),
    ))
    .await;
    let prefix = fresh_prefix();
    let worker = |name: &str| {
        config(
            dir.path(),
            name,
            &format!(
                "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://127.0.0.1:9\nstore: {{ kind: memory }}\n\
                 leases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: redis, url: '{REDIS_URL}', prefix: {prefix} }}\n  ttl: 1s\n\
                 egress:\n  listen: 127.0.0.1:0\n  upstream: http://{}\n  routes:\n    - {{ path: '/accounts/{{id}}', lease: 'account:{{id}}' }}\n",
                fence.proxy
            ),
        )
    };
    let mut w1 = Process::start(&worker("w1.yaml")).await;
    let w2 = Process::start(&worker("w2.yaml")).await;

    // Worker 1 holds the lease and writes through its sidecar, which attaches the token.
    let granted = acquire(&w1, "worker-1", "0s").await;
    assert_eq!(granted.status, 200, "{}", granted.text());
    let t1 = granted.json()["fencing_token"].as_u64().unwrap();
    assert_eq!(granted.json()["state"], "held");
    assert_eq!(egress_put(&w1, "balance=100").await.status, 200);
    assert_eq!(ledger.seen()[0].token(), Some(t1));
    // Worker 2 cannot have it while worker 1's sidecar renews it.
    let held = acquire(&w2, "worker-2", "0s").await;
    assert_eq!(held.status, 409, "{}", held.text());
    assert!(held.headers.contains_key("retry-after"));
    assert_eq!(egress_put(&w2, "balance=0").await.status, 503);

    // Worker 1's pod freezes (SIGSTOP) past its TTL; worker 2 gets the lease and writes.
    w1.signal("-STOP");
    let granted = acquire(&w2, "worker-2", "10s").await;
    assert_eq!(granted.status, 200, "{}", granted.text());
    let t2 = granted.json()["fencing_token"].as_u64().unwrap();
    assert!(t2 > t1, "token {t2} not above {t1}");
    assert_eq!(egress_put(&w2, "balance=150").await.status, 200);

    // Worker 1 wakes up, still believing it holds the lease: its own sidecar refuses to send.
    w1.signal("-CONT");
    let late = egress_put(&w1, "balance=90").await;
    let body = late.assert_problem(503, "urn:fencegate:lease-not-held");
    assert_eq!(body["resource"], "account:42");
    wait_log(&mut w1.logs, "lease lost").await;
    let view = send(
        "GET",
        &format!("http://{}/v1/leases/account:42", w1.leases.unwrap()),
        &[],
        "",
    )
    .await;
    assert_eq!(view.json()["state"], "expired");

    // Even a token sent by hand is refused by the fence in front of the ledger.
    let forged = send(
        "PUT",
        &format!("http://{}/accounts/42", fence.proxy),
        &[("fencing-token", &t1.to_string())],
        "balance=90",
    )
    .await;
    forged.assert_problem(409, "urn:fencegate:stale-token");

    // The ledger applied exactly the two legitimate writes, in token order.
    let applied: Vec<_> = ledger
        .seen()
        .iter()
        .map(|s| (s.token(), s.body.clone()))
        .collect();
    assert_eq!(
        applied,
        [
            (Some(t1), "balance=100".into()),
            (Some(t2), "balance=150".into())
        ]
    );
}

#[tokio::test]
async fn authoritative_fence_refuses_an_old_holder_before_the_new_one_writes() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let fg = fencegate(
        &up.url(),
        &format!(
            "fence: {{ authority: leases }}\nleases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: embedded, path: {} }}\n  ttl: 5s\n{ACCOUNTS}",
            dir.path().join("leases.db").display()
        ),
    )
    .await;
    let api = format!("http://{}/v1/leases/account:42", fg.leases.unwrap());
    let grant = |holder: &'static str| {
        let api = api.clone();
        async move {
            let reply = send("POST", &api, &[], format!(r#"{{"holder":"{holder}"}}"#)).await;
            assert_eq!(reply.status, 200, "{}", reply.text());
            reply.json()["fencing_token"].as_u64().unwrap()
        }
    };
    // No lease was ever granted: every token is unissued.
    let reply = put(&fg, "42", "1").await;
    let body = reply.assert_problem(409, "urn:fencegate:unissued-token");
    assert!(body.get("current_token").is_none());

    let t1 = grant("worker-1").await;
    assert_eq!(put(&fg, "42", &t1.to_string()).await.status, 200);
    assert_eq!(send("DELETE", &api, &[], "").await.status, 200);
    let t2 = grant("worker-2").await;
    assert!(t2 > t1);

    // Worker 2 has written nothing yet, and worker 1's token is already stale.
    let reply = put(&fg, "42", &t1.to_string()).await;
    let body = reply.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(body["current_token"], t2);
    assert_eq!(reply.headers["fencing-token-current"], t2.to_string());
    // A token above the latest grant was never issued.
    let reply = put(&fg, "42", &(t2 + 5).to_string()).await;
    let body = reply.assert_problem(409, "urn:fencegate:unissued-token");
    assert_eq!(body["current_token"], t2);
    assert_eq!(put(&fg, "42", &t2.to_string()).await.status, 200);
    let tokens: Vec<_> = up.seen().iter().map(|s| s.token()).collect();
    assert_eq!(tokens, [Some(t1), Some(t2)]);
}

#[tokio::test]
async fn lease_api_contract() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let fg = fencegate(
        &up.url(),
        &format!(
            "leases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: embedded, path: {} }}\n  ttl: {{ p99_work: 800ms, p99_rtt: 40ms, safety_margin: 200ms }}\n",
            dir.path().join("leases.db").display()
        ),
    )
    .await;
    let base = format!("http://{}/v1/leases", fg.leases.unwrap());
    let reply = send("POST", &format!("{base}/job:7"), &[], r#"{"holder":"w1"}"#).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let lease = reply.json();
    assert_eq!(lease["resource"], "job:7");
    assert_eq!(lease["holder"], "w1");
    assert_eq!(lease["ttl_ms"], 1500);
    assert_eq!(lease["renew_every_ms"], 500);
    assert_eq!(lease["state"], "held");
    assert!(lease["lease_id"].as_str().is_some_and(|id| !id.is_empty()));
    // Asking again as the same holder returns the same lease.
    let again = send("POST", &format!("{base}/job:7"), &[], r#"{"holder":"w1"}"#)
        .await
        .json();
    assert_eq!(again["lease_id"], lease["lease_id"]);
    // Another holder, try once: 409 with the holder and Retry-After.
    let held = send("POST", &format!("{base}/job:7"), &[], r#"{"holder":"w2"}"#).await;
    assert_eq!(held.status, 409);
    assert_eq!(held.json()["holder"], "w1");
    assert!(held.headers.contains_key("retry-after"));
    // Bad requests.
    assert_eq!(
        send("POST", &format!("{base}/job:7"), &[], "{}")
            .await
            .status,
        400
    );
    let short = send(
        "POST",
        &format!("{base}/job:8"),
        &[],
        r#"{"holder":"w1","ttl":"100ms"}"#,
    )
    .await;
    assert_eq!(short.status, 400, "{}", short.text());
    assert_eq!(short.json()["type"], "urn:fencegate:ttl-too-short");
    // Listing and one lease.
    let all = send("GET", &base, &[], "").await.json();
    assert_eq!(all["leases"].as_array().unwrap().len(), 1);
    assert_eq!(
        send("GET", &format!("{base}/job:7"), &[], "").await.json()["state"],
        "held"
    );
    assert_eq!(
        send("GET", &format!("{base}/nothing"), &[], "")
            .await
            .status,
        404
    );
    // Release, then 404 for a second release.
    let released = send("DELETE", &format!("{base}/job:7"), &[], "").await;
    assert_eq!(released.json()["state"], "released");
    assert_eq!(
        send("DELETE", &format!("{base}/job:7"), &[], "")
            .await
            .status,
        404
    );
    // Waiting: w2 gets it once w1 lets go.
    assert_eq!(
        send("POST", &format!("{base}/job:9"), &[], r#"{"holder":"w1"}"#)
            .await
            .status,
        200
    );
    let waiter = tokio::spawn({
        let url = format!("{base}/job:9");
        async move { send("POST", &url, &[], r#"{"holder":"w2","wait":"10s"}"#).await }
    });
    assert_eq!(
        send("DELETE", &format!("{base}/job:9"), &[], "")
            .await
            .status,
        200
    );
    let got = waiter.await.unwrap();
    assert_eq!(got.status, 200, "{}", got.text());
    assert_eq!(got.json()["holder"], "w2");
    let metrics = send("GET", &format!("http://{}/metrics", fg.admin), &[], "")
        .await
        .text();
    assert!(
        metrics.contains("fencegate_lease_acquisition_duration_seconds_count 3"),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"fencegate_lease_held{resource="job:9"} 1"#),
        "{metrics}"
    );
}

/// Every refusal of the lease API is a problem+json with a title of its own; a `405` says
/// in `Allow` and in its detail which methods the path takes.
#[tokio::test]
async fn lease_api_refusals_say_what_is_wrong() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let fg = fencegate(
        &up.url(),
        &format!(
            "leases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: embedded, path: {} }}\n  ttl: 1500ms\n",
            dir.path().join("leases.db").display()
        ),
    )
    .await;
    let api = format!("http://{}", fg.leases.unwrap());
    let problem = [("content-type", "application/problem+json")];

    // No resource id: POST and DELETE are refused as such; GET lists, as on /v1/leases.
    for method in ["POST", "DELETE"] {
        assert_exact(
            &send(
                method,
                &format!("{api}/v1/leases/"),
                &[],
                r#"{"holder":"w1"}"#,
            )
            .await,
            400,
            &problem,
            r#"{"type":"urn:fencegate:invalid-resource","title":"Invalid resource id","status":400,"detail":"the resource id is empty: put it after /v1/leases/, percent-encoded"}"#,
        );
    }
    let listed = send("GET", &format!("{api}/v1/leases/"), &[], "").await;
    assert_exact(
        &listed,
        200,
        &[("content-type", "application/json")],
        r#"{"leases":[]}"#,
    );
    for (target, detail) in [
        (
            "/v1/leases/%FF",
            "the resource id is not UTF-8 once percent-decoded",
        ),
        (
            "/v1/leases/a%0Ab",
            "the resource id contains a control character",
        ),
        (
            "/v1/leases//events",
            "the resource id is empty: put it after /v1/leases/, percent-encoded",
        ),
    ] {
        let method = if target.ends_with("/events") {
            "GET"
        } else {
            "POST"
        };
        assert_exact(
            &send(method, &format!("{api}{target}"), &[], r#"{"holder":"w1"}"#).await,
            400,
            &problem,
            &format!(
                r#"{{"type":"urn:fencegate:invalid-resource","title":"Invalid resource id","status":400,"detail":"{detail}"}}"#
            ),
        );
    }

    // Methods a path does not take.
    for (method, target, allow, detail) in [
        (
            "POST",
            "/v1/leases",
            "GET",
            "/v1/leases accepts GET, not POST",
        ),
        (
            "DELETE",
            "/v1/leases",
            "GET",
            "/v1/leases accepts GET, not DELETE",
        ),
        (
            "PUT",
            "/v1/leases/job:1",
            "GET, POST, DELETE",
            "/v1/leases/{resource} accepts GET, POST and DELETE, not PUT",
        ),
        (
            "PATCH",
            "/v1/leases/",
            "GET, POST, DELETE",
            "/v1/leases/{resource} accepts GET, POST and DELETE, not PATCH",
        ),
        (
            "POST",
            "/v1/leases/job:1/events",
            "GET",
            "/v1/leases/{resource}/events accepts GET, not POST",
        ),
    ] {
        assert_exact(
            &send(method, &format!("{api}{target}"), &[], "").await,
            405,
            &[problem[0], ("allow", allow)],
            &format!(
                r#"{{"type":"urn:fencegate:method-not-allowed","title":"Method not allowed","status":405,"detail":"{detail}"}}"#
            ),
        );
    }

    // Other paths, including one that only starts like the API's.
    for target in ["/v1/leasesjob:1", "/v2/leases"] {
        assert_exact(
            &send("POST", &format!("{api}{target}"), &[], r#"{"holder":"w1"}"#).await,
            404,
            &problem,
            &format!(
                r#"{{"type":"urn:fencegate:not-found","title":"No such endpoint","status":404,"detail":"{target} is not a lease API path: the lease API serves /v1/leases, /v1/leases/{{resource}} and /v1/leases/{{resource}}/events"}}"#
            ),
        );
    }

    // Bodies: the detail names the field and says what to write.
    let oversized = format!(r#"{{"holder":"{}"}}"#, "w".repeat(16 * 1024));
    for (body, detail) in [
        (
            r#"{"holder":"w1","ttl":"30"}"#,
            "ttl: `30` is not a duration: write 30s, 1500ms, 1m",
        ),
        (
            r#"{"holder":"w1","ttl":30}"#,
            "ttl: `30` is not a duration: write 30s, 1500ms, 1m",
        ),
        (
            r#"{"holder":"w1","wait":1.5}"#,
            "wait: `1.5` is not a duration: write 30s, 1500ms, 1m",
        ),
        (
            r#"{"holder":"w1","wait":"soon"}"#,
            "wait: `soon` is not a duration: write 30s, 1500ms, 1m",
        ),
        (
            r#"{"holder":"w1","wait":{}}"#,
            "wait: invalid type: map, expected a duration (write 30s, 1500ms, 1m)",
        ),
        ("{}", "missing field `holder`"),
        (
            r#"{"holder":"w1","lease":"5s"}"#,
            "unknown field `lease`, expected one of `holder`, `ttl`, `wait`",
        ),
        (
            r#"["w1"]"#,
            "the body must be a JSON object with `holder` (and optionally `ttl` and `wait`)",
        ),
        (
            r#"{"holder":5}"#,
            "holder must be a string of 1 to 256 bytes",
        ),
        (
            r#"{"holder":""}"#,
            "holder must be a string of 1 to 256 bytes",
        ),
        (
            "",
            "the body is empty: send a JSON object with `holder` (and optionally `ttl` and `wait`)",
        ),
        (
            "holder=w1",
            "the body is not JSON: expected value at line 1 column 1",
        ),
        (
            r#"{"holder":"#,
            "the body is not JSON: EOF while parsing a value at line 1 column 10",
        ),
        (oversized.as_str(), "the body is larger than 16 KiB"),
    ] {
        assert_exact(
            &send(
                "POST",
                &format!("{api}/v1/leases/job:1"),
                &[],
                body.to_owned(),
            )
            .await,
            400,
            &problem,
            &format!(
                r#"{{"type":"urn:fencegate:invalid-request","title":"Invalid lease request","status":400,"detail":"{detail}","resource":"job:1"}}"#
            ),
        );
    }
    assert_exact(
        &send(
            "POST",
            &format!("{api}/v1/leases/job:7"),
            &[],
            r#"{"holder":"w1","ttl":"1s"}"#,
        )
        .await,
        400,
        &problem,
        r#"{"type":"urn:fencegate:ttl-too-short","title":"Lease TTL too short","status":400,"detail":"ttl 1s is below the configured minimum of 1500ms","resource":"job:7"}"#,
    );

    // Held elsewhere, and not held here.
    let granted = send(
        "POST",
        &format!("{api}/v1/leases/account:42"),
        &[],
        r#"{"holder":"worker-1"}"#,
    )
    .await;
    assert_eq!(granted.status, 200, "{}", granted.text());
    assert_exact(
        &send(
            "POST",
            &format!("{api}/v1/leases/account:42"),
            &[],
            r#"{"holder":"worker-2"}"#,
        )
        .await,
        409,
        &[problem[0], ("retry-after", "1")],
        r#"{"type":"urn:fencegate:lease-held","title":"Lease held by another holder","status":409,"detail":"account:42 is held by another holder","resource":"account:42","holder":"worker-1"}"#,
    );
    for method in ["GET", "DELETE"] {
        assert_exact(
            &send(method, &format!("{api}/v1/leases/job:7"), &[], "").await,
            404,
            &problem,
            r#"{"type":"urn:fencegate:lease-not-held","title":"Lease not held","status":404,"detail":"this sidecar holds no lease on job:7","resource":"job:7"}"#,
        );
    }
}

/// The lease backend cannot be reached: `503` with the cause, and `Retry-After`.
#[tokio::test]
async fn lease_api_says_when_the_backend_is_unavailable() {
    let up = Upstream::start().await;
    let fg = fencegate(
        &up.url(),
        "leases:\n  listen: 127.0.0.1:0\n  backend: { kind: redis, url: 'redis://127.0.0.1:9/' }\n  ttl: 1500ms\n",
    )
    .await;
    let reply = send(
        "POST",
        &format!("http://{}/v1/leases/job:1", fg.leases.unwrap()),
        &[],
        r#"{"holder":"w1"}"#,
    )
    .await;
    let body = reply.assert_problem(503, "urn:fencegate:lease-backend-unavailable");
    assert_eq!(reply.headers["retry-after"], "1");
    assert_eq!(body["title"], "Lease backend unavailable");
    assert_eq!(body["resource"], "job:1");
    let detail = body["detail"].as_str().unwrap();
    assert!(
        detail.starts_with("no lease was granted: the lease backend is unavailable: "),
        "{detail}"
    );
}

/// A duration from a request is bounded: one too long to add to the clock is a 400, and the
/// connection it came on goes on serving.
#[tokio::test]
async fn absurd_durations_are_refused_and_the_connection_goes_on() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let fg = fencegate(
        &up.url(),
        &format!(
            "leases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: embedded, path: {} }}\n  ttl: 1500ms\n",
            dir.path().join("leases.db").display()
        ),
    )
    .await;
    let mut conn = tokio::net::TcpStream::connect(fg.leases.unwrap())
        .await
        .unwrap();
    let post = |body: &str| {
        format!(
            "POST /v1/leases/job:1 HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let mut exchange = async |body: &str| {
        use tokio::io::AsyncWriteExt;
        conn.write_all(post(body).as_bytes()).await.unwrap();
        let answer = read_response(&mut conn).await;
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        let status = head.split(' ').nth(1).unwrap().to_owned();
        (
            status,
            head.to_ascii_lowercase(),
            serde_json::from_str::<serde_json::Value>(body).unwrap(),
        )
    };
    for (field, body) in [
        ("wait", r#"{"holder":"w1","wait":"300000000000years"}"#),
        ("ttl", r#"{"holder":"w1","ttl":"300000000000years"}"#),
        ("wait", r#"{"holder":"w1","wait":"1h 1ms"}"#),
    ] {
        let (status, head, problem) = exchange(body).await;
        assert_eq!(status, "400", "{body}: {problem}");
        assert!(
            head.contains("content-type: application/problem+json"),
            "{head}"
        );
        assert_eq!(
            problem,
            serde_json::json!({
                "type": "urn:fencegate:invalid-request",
                "title": "Invalid lease request",
                "status": 400,
                "detail": format!("{field} is above the maximum of 1h"),
                "resource": "job:1",
            })
        );
    }
    // The same connection, then the longest wait allowed: granted at once.
    let (status, _, lease) = exchange(r#"{"holder":"w1","wait":"1h"}"#).await;
    assert_eq!(status, "200", "{lease}");
    assert_eq!(lease["state"], "held");
    assert_eq!(lease["holder"], "w1");
    assert_eq!(lease["ttl_ms"], 1500);
}

#[tokio::test]
async fn lease_events_stream() {
    use http_body_util::BodyExt;
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let fg = fencegate(
        &up.url(),
        &format!(
            "leases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: embedded, path: {} }}\n  ttl: 1s\n",
            dir.path().join("leases.db").display()
        ),
    )
    .await;
    let base = format!("http://{}/v1/leases", fg.leases.unwrap());
    let client: hyper_util::client::legacy::Client<_, http_body_util::Full<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let resp = client
        .request(
            http::Request::get(format!("{base}/job:1/events"))
                .body(Default::default())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut body = resp.into_body();
    assert_eq!(
        send("POST", &format!("{base}/job:1"), &[], r#"{"holder":"w1"}"#)
            .await
            .status,
        200
    );
    let mut seen = String::new();
    async fn next_event(body: &mut hyper::body::Incoming, seen: &mut String) -> String {
        loop {
            if let Some(end) = seen.find("\n\n") {
                return seen.drain(..end + 2).collect();
            }
            let frame = body.frame().await.unwrap().unwrap();
            seen.push_str(&String::from_utf8_lossy(&frame.into_data().unwrap()));
        }
    }
    let held = next_event(&mut body, &mut seen).await;
    assert!(held.starts_with("event: held\ndata: {"), "{held}");
    assert!(held.contains(r#""resource":"job:1""#), "{held}");
    let renewed = next_event(&mut body, &mut seen).await;
    assert!(renewed.starts_with("event: renewed\n"), "{renewed}");
    assert_eq!(
        send("DELETE", &format!("{base}/job:1"), &[], "")
            .await
            .status,
        200
    );
    let released = next_event(&mut body, &mut seen).await;
    assert!(released.starts_with("event: released\n"), "{released}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_writes_then_releases_leases() {
    let up = Upstream::gated().await;
    let dir = tempfile::tempdir().unwrap();
    let prefix = fresh_prefix();
    let sidecar = |name: &str| {
        config(
            dir.path(),
            name,
            &format!(
                "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://127.0.0.1:9\nstore: {{ kind: memory }}\n\
                 leases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: redis, url: '{REDIS_URL}', prefix: {prefix} }}\n  ttl: 30s\n  drain_timeout: 20s\n\
                 egress:\n  listen: 127.0.0.1:0\n  upstream: {}\n  routes:\n    - {{ path: '/accounts/{{id}}', lease: 'account:{{id}}' }}\n",
                up.url()
            ),
        )
    };
    let mut w1 = Process::start(&sidecar("w1.yaml")).await;
    let w2 = Process::start(&sidecar("w2.yaml")).await;
    assert_eq!(acquire(&w1, "worker-1", "0s").await.status, 200);
    let in_flight = tokio::spawn({
        let url = format!("http://{}/accounts/42", w1.egress.unwrap());
        async move { send("PUT", &url, &[], "w").await }
    });
    up.arrival().await;

    w1.signal("-TERM");
    wait_log(
        &mut w1.logs,
        "shutting down: readiness off, draining in-flight requests",
    )
    .await;
    // Draining: the lease is still held (30s TTL, not released yet) while the write is in flight.
    assert_eq!(acquire(&w2, "worker-2", "0s").await.status, 409);
    up.release(1);
    assert_eq!(in_flight.await.unwrap().status, 200);
    // Then, and only then, the lease is released: worker 2 gets it at once, not after 30s.
    wait_log(&mut w1.logs, "lease released").await;
    wait_log(&mut w1.logs, "leases released").await;
    assert_eq!(acquire(&w2, "worker-2", "0s").await.status, 200);
    let status = tokio::time::timeout(std::time::Duration::from_secs(20), w1.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

/// SIGTERM while an acquisition waits for a lease held here: the drain's own release must not
/// hand the lease to the waiter. It gets 503 `draining`, and the process leaves nothing held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_refuses_a_waiting_acquisition_and_leaves_nothing_held() {
    let dir = tempfile::tempdir().unwrap();
    let leases_db = dir.path().join("leases.db");
    let path = config(
        dir.path(),
        "w.yaml",
        &format!(
            "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://127.0.0.1:9\nstore: {{ kind: memory }}\n\
             leases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: embedded, path: {} }}\n  ttl: 30s\n  drain_timeout: 20s\n",
            leases_db.display()
        ),
    );
    // `lease acquisition waiting` (debug) says when the waiter is in the agent.
    let mut p =
        Process::start_with_env(&path, &[("FENCEGATE_LOG", "info,fencegate::lease=debug")]).await;
    let held = acquire(&p, "w9", "0s").await;
    assert_eq!(held.status, 200, "{}", held.text());
    let waiter = tokio::spawn({
        let url = format!("http://{}/v1/leases/account:42", p.leases.unwrap());
        async move { send("POST", &url, &[], r#"{"holder":"w8","wait":"10s"}"#).await }
    });
    let waiting = wait_log(&mut p.logs, "lease acquisition waiting").await;
    assert_eq!(waiting["holder_id"], "w8", "{waiting}");

    p.signal("-TERM");
    let refused = waiter.await.unwrap();
    let body = refused.assert_problem(503, "urn:fencegate:draining");
    assert_eq!(
        body,
        serde_json::json!({
            "type": "urn:fencegate:draining",
            "title": "Lease agent shutting down",
            "status": 503,
            "detail": "this sidecar is shutting down and grants no new leases",
            "resource": "account:42",
        })
    );
    let status = tokio::time::timeout(std::time::Duration::from_secs(20), p.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
    // w9's lease was released by the drain, and no lease was granted after it.
    let mut released = false;
    while let Some(line) = p.logs.recv().await {
        match line["message"].as_str() {
            Some("lease released") => {
                assert_eq!(line["holder_id"], "w9", "{line}");
                released = true;
            }
            Some("lease held") => panic!("granted while draining: {line}"),
            _ => {}
        }
    }
    assert!(released, "w9's lease was not released");
    // The backend agrees: the next holder gets the lease at once.
    let backend = fencegate::lease::open(&fencegate::config::BackendConfig::Embedded {
        path: leases_db,
        prefix: "fencegate".into(),
    })
    .await
    .unwrap();
    let next = backend
        .try_acquire("account:42", "next", std::time::Duration::from_secs(30))
        .await
        .unwrap();
    assert!(
        matches!(next, fencegate::lease::Acquired::Granted(_)),
        "{next:?}"
    );
}
