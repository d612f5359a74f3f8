//! The admin listener: probes, metrics with the names in docs/operations.md, the fence inspection API.

use crate::common::*;

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

    // Captures keep their normalised, still-encoded form in the resource id.
    let reply = send(
        "GET",
        &format!("{admin}/v1/fences/account%3Aa%253Ab"),
        &[],
        "",
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.json(),
        serde_json::json!({"resource": "account:a%3Ab", "token": 6, "store": "memory"})
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
        r#"fencegate_requests_total{outcome="admitted",route="accounts"} 3"#,
        r#"fencegate_requests_total{outcome="stale",route="accounts"} 1"#,
        r#"fencegate_requests_total{outcome="token_required",route="accounts"} 1"#,
        r#"fencegate_requests_total{outcome="forwarded",route="accounts"} 1"#,
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
