//! A large route table: it loads in time linear in its number of routes, and its last route
//! fences as the first does.

use std::time::{Duration, Instant};

use crate::common::*;

/// `n` routes `/r{i}/accounts/{id}` fenced as `r{i}:{id}`, each with a name and path of its
/// own, as a service with many fenced paths would write them.
fn routes(n: usize) -> String {
    let mut yaml = String::from("routes:\n");
    for i in 0..n {
        yaml.push_str(&format!(
            "  - {{ name: r{i}, path: '/r{i}/accounts/{{id}}', resource: 'r{i}:{{id}}' }}\n"
        ));
    }
    yaml
}

/// From the config text to a started fencegate with `n` routes, the fastest of two starts
/// (other tests share the machine).
async fn start_time(upstream: &str, n: usize) -> Duration {
    let yaml = routes(n);
    let mut best = Duration::MAX;
    for _ in 0..2 {
        let started = Instant::now();
        let fg = fencegate(upstream, &yaml).await;
        best = best.min(started.elapsed());
        fg.shutdown();
    }
    best
}

/// Eight times the routes take about eight times as long to load: 0.23 s and 2.0 s for 5,000
/// and 40,000 in a debug build. When each route was checked against every route before it
/// (names, paths) and grouped by a scan of the groups so far, it was 71 times (0.61 s and
/// 43 s). 20 is the bar.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_thousand_routes_load_in_linear_time_and_the_last_one_fences() {
    let up = Upstream::start().await;
    let small = start_time(&up.url(), 5_000).await;
    let large = start_time(&up.url(), 40_000).await;
    assert!(
        large < small * 20,
        "5,000 routes loaded in {small:?}, 40,000 in {large:?}: {:.1} times as long",
        large.as_secs_f64() / small.as_secs_f64()
    );

    let fg = fencegate(&up.url(), &routes(40_000)).await;
    let url = format!("http://{}/r39999/accounts/7", fg.listen);
    let reply = send("PUT", &url, &[("fencing-token", "5")], "x").await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(up.seen().last().unwrap().target, "/r39999/accounts/7");
    send("PUT", &url, &[("fencing-token", "4")], "x")
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
}
