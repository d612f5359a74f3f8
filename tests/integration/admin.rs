//! The admin listener: probes, metrics with the names in docs/operations.md, the fence inspection API.

use crate::common::*;
use crate::fence::assert_exact;

#[tokio::test]
async fn probes_metrics_and_fence_lookup() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let admin = format!("http://{}", fg.admin);
    assert_eq!(
        send("GET", &format!("{admin}/healthz"), &[], "")
            .await
            .status,
        200
    );
    assert_eq!(
        send("GET", &format!("{admin}/readyz"), &[], "")
            .await
            .text(),
        "ready\n"
    );

    assert_eq!(put(&fg, "a%3Ab", "5").await.status, 200);
    assert_eq!(put(&fg, "a%3Ab", "6").await.status, 200);
    assert_eq!(put(&fg, "a%3Ab", "6").await.status, 200);
    put(&fg, "a%3Ab", "4")
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
    send("PUT", &format!("http://{}/accounts/1", fg.listen), &[], "").await;
    send("GET", &format!("http://{}/accounts/1", fg.listen), &[], "").await;

    // Captures name the resource decoded, as the service's framework reads them.
    let reply = send(
        "GET",
        &format!("{admin}/v1/fences/account%3Aa%3Ab"),
        &[],
        "",
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.json(),
        serde_json::json!({"resource": "account:a:b", "token": 6, "store": "memory"})
    );
    assert_eq!(
        send("GET", &format!("{admin}/v1/fences/nothing"), &[], "")
            .await
            .status,
        404
    );

    let metrics = send("GET", &format!("{admin}/metrics"), &[], "")
        .await
        .text();
    for line in [
        r#"fencegate_requests_total{code="200",method="PUT",outcome="admitted",route="accounts"} 3"#,
        r#"fencegate_requests_total{code="409",method="PUT",outcome="stale",route="accounts"} 1"#,
        r#"fencegate_requests_total{code="428",method="PUT",outcome="token_required",route="accounts"} 1"#,
        r#"fencegate_requests_total{code="200",method="GET",outcome="forwarded",route="accounts"} 1"#,
        r#"fencegate_stale_write_rejected_total{route="accounts"} 1"#,
        r#"fencegate_fencing_token_increments_total{route="accounts"} 2"#,
        r#"fencegate_upstream_duration_seconds_count{route="accounts"} 4"#,
        r#"fencegate_store_duration_seconds_count{op="raise"} 4"#,
    ] {
        assert!(metrics.contains(line), "missing `{line}` in\n{metrics}");
    }
}

#[tokio::test]
async fn readiness_fails_while_draining() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let admin = format!("http://{}", fg.admin);
    fg.readiness.start_draining();
    let reply = send("GET", &format!("{admin}/readyz"), &[], "").await;
    assert_eq!(reply.status, 503);
    assert_eq!(reply.text(), "draining\n");
    // Liveness is unaffected.
    assert_eq!(
        send("GET", &format!("{admin}/healthz"), &[], "")
            .await
            .status,
        200
    );
}

/// Errors on the admin listener are problem+json like the fence's; a `405` says in `Allow` and
/// in its detail that every admin path takes `GET` and `HEAD`. Probe and metrics answers keep
/// their plain bodies.
#[tokio::test]
async fn admin_errors_are_problems_and_405_names_get_and_head() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let admin = format!("http://{}", fg.admin);
    let problem = ("content-type", "application/problem+json");
    for (method, path, detail) in [
        (
            "POST",
            "/metrics",
            "/metrics accepts GET and HEAD, not POST",
        ),
        ("PUT", "/readyz", "/readyz accepts GET and HEAD, not PUT"),
        (
            "DELETE",
            "/v1/fences/account%3A1",
            "/v1/fences/{resource} accepts GET and HEAD, not DELETE",
        ),
    ] {
        assert_exact(
            &send(method, &format!("{admin}{path}"), &[], "").await,
            405,
            &[problem, ("allow", "GET, HEAD")],
            &format!(
                r#"{{"type":"urn:fencegate:method-not-allowed","title":"Method not allowed","status":405,"detail":"{detail}"}}"#
            ),
        );
    }
    // An unknown path is unknown whatever the method.
    for method in ["GET", "POST"] {
        assert_exact(
            &send(method, &format!("{admin}/nothing"), &[], "").await,
            404,
            &[problem],
            r#"{"type":"urn:fencegate:not-found","title":"No such endpoint","status":404,"detail":"/nothing is not an admin path: the admin listener serves /metrics, /healthz, /readyz, /v1/fences/{resource} and /fences/{resource}"}"#,
        );
    }
    for (path, detail) in [
        (
            "/v1/fences/",
            "the resource id is empty: put it after /v1/fences/, percent-encoded",
        ),
        (
            "/v1/fences/%FF",
            "the resource id is not UTF-8 once percent-decoded",
        ),
    ] {
        assert_exact(
            &send("GET", &format!("{admin}{path}"), &[], "").await,
            400,
            &[problem],
            &format!(
                r#"{{"type":"urn:fencegate:invalid-resource","title":"Invalid resource id","status":400,"detail":"{detail}"}}"#
            ),
        );
    }
    // Answers that are not errors keep their bodies.
    let plain = ("content-type", "text/plain; charset=utf-8");
    assert_exact(
        &send("GET", &format!("{admin}/healthz"), &[], "").await,
        200,
        &[plain],
        "ok\n",
    );
    assert_exact(
        &send("GET", &format!("{admin}/readyz"), &[], "").await,
        200,
        &[plain],
        "ready\n",
    );
    let head = send("HEAD", &format!("{admin}/healthz"), &[], "").await;
    assert_eq!(head.status, 200);
    assert!(head.body.is_empty());
    assert_exact(
        &send("GET", &format!("{admin}/v1/fences/nothing"), &[], "").await,
        404,
        &[("content-type", "application/json")],
        r#"{"resource":"nothing","token":null,"store":"memory"}"#,
    );
}

/// The store cannot answer a fence lookup: `503` store-unavailable, as on the fence.
#[tokio::test]
async fn fence_lookup_says_when_the_store_is_unavailable() {
    let up = Upstream::start().await;
    let fg = fencegate(
        &up.url(),
        &format!("store: {{ kind: redis, url: 'redis://127.0.0.1:9/' }}\n{ACCOUNTS}"),
    )
    .await;
    let reply = send(
        "GET",
        &format!("http://{}/v1/fences/account%3A1", fg.admin),
        &[],
        "",
    )
    .await;
    let body = reply.assert_problem(503, "urn:fencegate:store-unavailable");
    assert_eq!(reply.headers["retry-after"], "1");
    assert_eq!(body["title"], "Fence store unavailable");
    assert_eq!(body["resource"], "account:1");
    let detail = body["detail"].as_str().unwrap();
    assert!(
        detail.starts_with("the recorded maximum could not be read: "),
        "{detail}"
    );
}
