//! A large route table: it loads, and its last route fences as the first does.

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

/// A table of 40,000 routes loads and its last route fences as the first would. (How long it
/// takes to load is measured by `bench/run --growth`, not here: when each route was checked
/// against every route before it, 40,000 took 6.2 s of CPU in a release build, 0.24 s since.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_thousand_routes_load_and_the_last_one_fences() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), &routes(40_000)).await;
    let url = format!("http://{}/r39999/accounts/7", fg.listen);
    let reply = send("PUT", &url, &[("fencing-token", "5")], "x").await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(up.seen().last().unwrap().target, "/r39999/accounts/7");
    send("PUT", &url, &[("fencing-token", "4")], "x")
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
}
