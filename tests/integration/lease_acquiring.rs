//! The lease API reports an acquisition that waits for another holder as `acquiring`.

use std::time::{Duration, Instant};

use fencegate::config::{BackendConfig, Remote, SecretUrl};
use fencegate::lease::{self, Acquired};

use crate::common::*;
use crate::services::{fresh_prefix, REDIS_URL};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_acquisition_is_reported_as_acquiring() {
    let prefix = fresh_prefix();
    let up = Upstream::start().await;
    let fg = fencegate(
        &up.url(),
        &format!(
            "leases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: redis, url: '{REDIS_URL}', prefix: {prefix} }}\n  ttl: 3s\n"
        ),
    )
    .await;
    let base = format!("http://{}/v1/leases", fg.leases.unwrap());
    // Another agent of the same backend holds job:1; this one holds job:0.
    let other = lease::open(&BackendConfig::Redis(Remote {
        url: SecretUrl::try_from(REDIS_URL.to_owned()).unwrap(),
        tls: None,
        prefix,
        replicas: None,
        redis: Default::default(),
    }))
    .await
    .unwrap();
    let Acquired::Granted(theirs) = other
        .try_acquire("job:1", "elsewhere", Duration::from_secs(30))
        .await
        .unwrap()
    else {
        panic!("job:1 is free")
    };
    let held = send("POST", &format!("{base}/job:0"), &[], r#"{"holder":"w0"}"#).await;
    assert_eq!(held.status, 200, "{}", held.text());

    let waiter = tokio::spawn({
        let url = format!("{base}/job:1");
        async move {
            send(
                "POST",
                &url,
                &[],
                r#"{"holder":"w1","ttl":"4s","wait":"20s"}"#,
            )
            .await
        }
    });
    // Polled: the POST is on its way.
    let deadline = Instant::now() + Duration::from_secs(10);
    let view = loop {
        let reply = send("GET", &format!("{base}/job:1"), &[], "").await;
        if reply.status == 200 {
            break reply.json();
        }
        assert_eq!(reply.status, 404, "{}", reply.text());
        assert!(Instant::now() < deadline, "job:1 never showed up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(view["state"], "acquiring", "{view}");
    assert_eq!(view["resource"], "job:1");
    assert_eq!(view["holder"], "w1");
    assert_eq!(view["ttl_ms"], 4000);
    assert_eq!(view["renew_every_ms"], 1333);
    assert!(view["fencing_token"].is_null() && view["lease_id"].is_null());
    assert_eq!(view["valid_for_ms"], 0);
    // The list has both resources, in order, each in its state.
    let all = send("GET", &base, &[], "").await.json();
    let states: Vec<_> = all["leases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| (l["resource"].clone(), l["state"].clone()))
        .collect();
    assert_eq!(
        states,
        [
            (serde_json::json!("job:0"), serde_json::json!("held")),
            (serde_json::json!("job:1"), serde_json::json!("acquiring")),
        ],
        "{all}"
    );
    assert!(!waiter.is_finished());

    // The other holder lets go: the acquisition becomes the lease.
    assert!(other.release(&theirs).await.unwrap());
    let got = waiter.await.unwrap();
    assert_eq!(got.status, 200, "{}", got.text());
    let lease = got.json();
    assert_eq!(lease["state"], "held");
    assert!(lease["fencing_token"].as_u64().unwrap() > theirs.token.get());
    let view = send("GET", &format!("{base}/job:1"), &[], "").await.json();
    assert_eq!(view["state"], "held");
    assert_eq!(view["lease_id"], lease["lease_id"]);
}
