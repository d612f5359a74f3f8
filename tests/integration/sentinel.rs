//! Redis with Sentinel: a primary, a replica and three Sentinels, all real, on loopback. The
//! primary is killed with `kill -9`; fencegate follows the promotion without a restart, and
//! what a failover keeps or loses is measured per `replicas` setting (docs/guarantees.md).

use crate::common::rid;
use crate::common::tk;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate::app::Server;
use fencegate::config::{BackendConfig, RedisHa, Remote, SecretUrl, SentinelConfig};
use fencegate::lease::{self, Acquired, LeaseBackend};

use crate::common::*;
use crate::services::*;

/// The fence store through the topology's Sentinels (`replicas` as written, or the default).
fn store_yaml(topology: &SentinelTopology, replicas: Option<u32>) -> String {
    let replicas = replicas.map_or(String::new(), |n| format!(", replicas: {n}"));
    format!(
        "store: {{ kind: redis, url: 'redis://{MASTER}/', prefix: {}, sentinel: {}{replicas} }}\n{ACCOUNTS}",
        fresh_prefix(),
        topology.yaml()
    )
}

/// Writes `resource` with rising tokens from `first` until one is admitted; every other answer
/// must be `503 store-unavailable` (never forwarded). Returns the admitted token.
pub(crate) async fn first_admitted(fg: &Server, id: &str, first: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut token = first;
    loop {
        let reply = put(fg, id, &token.to_string()).await;
        if reply.status == 200 {
            return token;
        }
        reply.assert_problem(503, "urn:fencegate:store-unavailable");
        assert!(
            Instant::now() < deadline,
            "no write admitted after the failover"
        );
        token += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The answer to `token` on `id` once the store answers at all (not 503).
pub(crate) async fn once_answered(fg: &Server, id: &str, token: &str) -> Reply {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let reply = put(fg, id, token).await;
        if reply.status != 503 {
            return reply;
        }
        assert!(Instant::now() < deadline, "the store never answered again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Stops `replica` (`SIGSTOP`) and cuts its replication link on `primary` (found by the
/// link's address on the replica's side), then writes token 7 to `account:<id>` through `fg`:
/// only the primary's other replicas can hold it. Returns the answer, once the primary says
/// another replica has it (`WAIT 1 0`).
pub(crate) async fn seven_without(primary: u16, replica: &Service, fg: &Server, id: &str) -> Reply {
    let link = redis_cli_at(replica.port, &["CLIENT", "LIST", "TYPE", "master"]).await;
    let laddr = link
        .split_whitespace()
        .find_map(|f| f.strip_prefix("laddr="))
        .unwrap_or_else(|| panic!("no replication link on the replica: {link}"))
        .to_owned();
    replica.pause();
    let cut = redis_cli_at(primary, &["CLIENT", "KILL", "ADDR", &laddr]).await;
    assert_eq!(cut.trim(), "1", "the replica's link was not cut");
    let seven = put(fg, id, "7").await;
    let acked = redis_cli_at(primary, &["WAIT", "1", "0"]).await;
    assert_eq!(
        acked.trim(),
        "1",
        "another replica acknowledges what it lacks"
    );
    seven
}

/// Token 7 of [`seven_without`] was refused `503` since one of two replicas lacked it, and
/// stale 6 after the failover was then admitted (no violation: 7 was never forwarded).
pub(crate) fn refused_for_want_of_one_replica(seven: &Reply, six: &Reply) {
    seven.assert_problem(503, "urn:fencegate:store-unavailable");
    assert!(
        seven.text().contains("1 of the 2 replicas"),
        "{}",
        seven.text()
    );
    assert_eq!(six.status, 200);
}

/// Tokens the upstream received for `account:<id>`, in order.
pub(crate) fn received(up: &Upstream, id: &str) -> Vec<u64> {
    let target = format!("/accounts/{id}");
    up.seen()
        .iter()
        .filter(|s| s.target == target)
        .filter_map(|s| s.token())
        .collect()
}

async fn lease_backend(topology: &SentinelTopology) -> Arc<dyn LeaseBackend> {
    lease_backend_with(topology, 1).await
}

async fn lease_backend_with(topology: &SentinelTopology, replicas: u32) -> Arc<dyn LeaseBackend> {
    let urls = topology
        .urls()
        .into_iter()
        .map(|u| SecretUrl::try_from(u).unwrap())
        .collect();
    lease::open(&BackendConfig::Redis(Remote {
        url: SecretUrl::try_from(format!("redis://{MASTER}/")).unwrap(),
        tls: None,
        prefix: fresh_prefix(),
        replicas: None,
        redis: RedisHa {
            cluster: None,
            sentinel: Some(SentinelConfig {
                master: MASTER.into(),
                urls,
            }),
            replicas,
        },
    }))
    .await
    .unwrap()
}

/// An acquire of `resource` by `holder`, retried while the backend is unavailable (a
/// failover).
pub(crate) async fn acquire(leases: &dyn LeaseBackend, resource: &str, holder: &str) -> Acquired {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match leases
            .try_acquire(resource, holder, Duration::from_secs(30))
            .await
        {
            Ok(acquired) => return acquired,
            Err(e) => assert!(Instant::now() < deadline, "no answer after failover: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub(crate) async fn grant(leases: &dyn LeaseBackend, resource: &str) -> fencegate::lease::Grant {
    match acquire(leases, resource, "holder").await {
        Acquired::Granted(grant) => grant,
        Acquired::Held { holder } => panic!("held by {holder:?}"),
    }
}

/// The safe setting (Sentinel's default, `replicas: 1`): token 7 admitted, the primary killed
/// right after; once the replica is promoted, stale token 6 is 409 through both fencegates
/// (each asking the store, not its cache), fresh tokens pass, no restart. Lease grants never
/// repeat a token across the failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_keeps_every_acknowledged_raise_and_grant() {
    let topology = SentinelTopology::start().await;
    let up = Upstream::start().await;
    let yaml = store_yaml(&topology, None);
    let a = fencegate(&up.url(), &yaml).await;
    let b = fencegate(&up.url(), &yaml).await;
    let leases = lease_backend(&topology).await;

    let mut granted = Vec::new();
    for _ in 0..3 {
        let grant = grant(&*leases, "job").await;
        granted.push(grant.token);
        assert!(leases.release(&grant).await.unwrap());
    }
    let held = grant(&*leases, "job").await;
    granted.push(held.token);

    assert_eq!(put(&a, "1", "7").await.status, 200);
    assert_eq!(put(&b, "2", "7").await.status, 200);
    let mut topology = topology;
    topology.primary.kill().await;
    let killed = Instant::now();

    let admitted = first_admitted(&a, "3", 1).await;
    let recovery = killed.elapsed();
    println!(
        "sentinel failover (replicas: 1): primary killed -> first admitted write {}ms",
        recovery.as_millis()
    );
    // The promotion is complete, as every Sentinel sees it.
    topology.wait_promoted().await;
    assert_eq!(recorded(&a, "account:3").await, Some(admitted));

    // Stale through both, each from the store: A never saw account 2, B never saw account 1.
    for (fg, id) in [(&a, "2"), (&b, "1")] {
        let refused = once_answered(fg, id, "6").await;
        refused.assert_problem(409, "urn:fencegate:stale-token");
        assert_eq!(refused.headers["fencing-token-current"], "7");
        assert_eq!(put(fg, id, "8").await.status, 200);
    }
    assert_eq!(received(&up, "1"), [7, 8]);
    assert_eq!(received(&up, "2"), [7, 8]);

    // The lease held through the failover is still held; released, the next grant's token is
    // above every earlier one.
    let lease_killed = Instant::now();
    assert!(matches!(
        acquire(&*leases, "job", "other").await,
        Acquired::Held { .. }
    ));
    assert!(leases.release(&held).await.unwrap());
    let next = grant(&*leases, "job").await;
    println!(
        "lease tokens before the failover {granted:?}, after {} ({}ms to grant)",
        next.token,
        lease_killed.elapsed().as_millis()
    );
    assert!(next.token > *granted.iter().max().unwrap());
}

/// The replicas miss the last raise: they are stopped (SIGSTOP) and their replication links
/// cut, token 7 is written, the primary is killed with `kill -9`, the replicas resumed and one
/// promoted.
/// Returns the answer to 7, the answer to stale token 6 through the other fencegate after the
/// failover, and what the upstream received.
async fn lagging_replica(replicas: u32) -> (Reply, Reply, Vec<u64>) {
    let mut topology = SentinelTopology::start().await;
    let up = Upstream::start().await;
    let yaml = store_yaml(&topology, Some(replicas));
    let a = fencegate(&up.url(), &yaml).await;
    let b = fencegate(&up.url(), &yaml).await;
    // Both connected and in sync before the fault.
    assert_eq!(put(&a, "9", "1").await.status, 200);
    assert_eq!(put(&b, "9", "2").await.status, 200);

    for replica in &topology.replicas {
        replica.pause();
    }
    let cut = redis_cli_at(
        topology.primary.port,
        &["CLIENT", "KILL", "TYPE", "replica"],
    )
    .await;
    assert_eq!(cut.trim(), "2", "the replication links were not cut");
    let seven = put(&a, "1", "7").await;
    topology.primary.kill().await;
    let killed = Instant::now();
    for replica in &topology.replicas {
        replica.resume();
    }

    let six = once_answered(&b, "1", "6").await;
    println!(
        "sentinel failover (replicas: {replicas}, replica lagging): 7 answered {}, then stale 6 \
         through the other fencegate {} after {}ms",
        seven.status,
        six.status,
        killed.elapsed().as_millis()
    );
    topology.wait_promoted().await;
    (seven, six, received(&up, "1"))
}

/// `replicas: 0`: the documented window, measured. The raise of 7 was acknowledged (and its
/// write forwarded), the promoted replica never had it, and stale token 6 passes after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_without_replica_acknowledgement_loses_a_raise_in_a_failover() {
    let (seven, six, received) = lagging_replica(0).await;
    assert_eq!(seven.status, 200);
    assert_eq!(six.status, 200, "the lost raise did not let 6 pass");
    assert_eq!(
        received,
        [7, 6],
        "the upstream saw a stale token after a newer one"
    );
}

/// `replicas: 1`, same fault: the raise of 7 is refused 503 (never forwarded) since no replica
/// acknowledged it; 6 after the failover is then no violation: the upstream never saw 7.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_with_replica_acknowledgement_refuses_a_raise_a_failover_could_lose() {
    let (seven, six, received) = lagging_replica(1).await;
    seven.assert_problem(503, "urn:fencegate:store-unavailable");
    assert!(seven.text().contains("replicas"), "{}", seven.text());
    assert_eq!(six.status, 200);
    assert_eq!(received, [6]);
}

/// Two replicas, the Sentinels preferring B (`replica-priority`), `replicas: 1`: B is stopped
/// and its replication link cut, so only A can acknowledge token 7; the primary is killed, B
/// resumed and promoted. `WAIT 1` would acknowledge 7 through A alone and the promotion of B
/// would lose it (stale 6 then admitted after 7 was forwarded); the write must wait for every
/// replica the Sentinels could promote, so 7 is refused 503, never forwarded, and 6 after the
/// failover is no violation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raise_waits_for_every_replica_the_sentinels_could_promote() {
    // Down after 5 s: B, stopped for under a second, is never taken for down (and so stays
    // promotable in the Sentinels' eyes and in fencegate's count).
    let mut topology = SentinelTopology::start_preferring(
        &format!("sentinel down-after-milliseconds {MASTER} 5000\n"),
        Some(1),
    )
    .await;
    let up = Upstream::start().await;
    let yaml = store_yaml(&topology, Some(1));
    let a = fencegate(&up.url(), &yaml).await;
    let b = fencegate(&up.url(), &yaml).await;
    assert_eq!(put(&a, "9", "1").await.status, 200);
    assert_eq!(put(&b, "9", "2").await.status, 200);

    let preferred = topology.replicas[1].port;
    let seven = seven_without(topology.primary.port, &topology.replicas[1], &a, "1").await;
    topology.primary.kill().await;
    topology.replicas[1].resume();

    let six = once_answered(&b, "1", "6").await;
    let promoted = topology.wait_promoted().await;
    assert_eq!(promoted, preferred, "the Sentinels promoted A, not B");
    println!(
        "preferred replica lagging (replicas: 1, two replicas): 7 answered {}, stale 6 after \
         the failover {}",
        seven.status, six.status
    );
    refused_for_want_of_one_replica(&seven, &six);
    assert_eq!(received(&up, "1"), [6], "a stale token after a newer one");
}

/// The price of waiting for every promotable replica: one that stops answering (`SIGSTOP`)
/// holds every write back (`503`, never forwarded) until the Sentinels take it for down; then
/// the replica left acknowledges, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_stops_answering_holds_writes_back_until_the_sentinels_take_it_for_down() {
    let topology = SentinelTopology::start().await;
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), &store_yaml(&topology, None)).await;
    assert_eq!(put(&fg, "1", "1").await.status, 200);
    topology.replicas[1].pause();
    let stopped = Instant::now();
    let held = put(&fg, "1", "2").await;
    held.assert_problem(503, "urn:fencegate:store-unavailable");
    assert!(
        held.text().contains("1 of the 2 replicas"),
        "{}",
        held.text()
    );
    let admitted = first_admitted(&fg, "1", 3).await;
    println!(
        "a replica stopped: writes refused 503 for {}ms (down-after-milliseconds 1000)",
        stopped.elapsed().as_millis()
    );
    topology.replicas[1].resume();
    assert_eq!(received(&up, "1"), [1, admitted]);
}

/// A token equal to a maximum another connection raised, while the replicas do not acknowledge
/// (stopped, still connected): refused like the raise itself. `WAIT` covers only what the
/// waiting connection wrote, so the script writes the maximum again before it; without that,
/// the retry of a raise refused 503 would be admitted on a maximum no replica holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_equal_token_waits_for_the_replicas_like_the_raise() {
    let primary = Service::start(Kind::Redis).await;
    let replica = Service::start_redis_replica(primary.port).await;
    let config = fencegate::config::Config::parse(&format!(
        "upstream: http://127.0.0.1:1\nstore: {{ kind: redis, url: '{}', prefix: {}, replicas: 1 }}\n",
        primary.url(),
        fresh_prefix()
    ))
    .unwrap();
    let raiser = fencegate::store::open(&config.store).await.unwrap();
    let retrier = fencegate::store::open(&config.store).await.unwrap();
    // Both connected, each with a write the replica acknowledged.
    wait_synced(&replica).await;
    use fencegate::config::EqualTokens::Allow;
    assert!(raiser
        .compare_and_raise(&rid("warm"), 1.into(), Allow.into())
        .await
        .is_ok());
    assert!(retrier
        .compare_and_raise(&rid("warm"), 2.into(), Allow.into())
        .await
        .is_ok());

    replica.pause();
    let raised = raiser
        .compare_and_raise(&rid("r"), 7.into(), Allow.into())
        .await
        .unwrap_err();
    assert!(
        raised.to_string().contains("0 of the 1 replicas"),
        "{raised}"
    );
    let retried = retrier
        .compare_and_raise(&rid("r"), 7.into(), Allow.into())
        .await;
    replica.resume();
    let retried = retried.expect_err("an equal token admitted on a maximum no replica holds");
    assert!(
        retried.to_string().contains("0 of the 1 replicas"),
        "{retried}"
    );
    // Once the replica acknowledges again, the same retry is admitted.
    assert!(retrier
        .compare_and_raise(&rid("r"), 7.into(), Allow.into())
        .await
        .is_ok());
}

/// A Sentinel that names a replica as the primary (its view is stale, or it was misconfigured),
/// and a replica that accepts writes (`replica-read-only no`): fencegate asks `ROLE` and refuses
/// to use it, so no raise is acknowledged by a server whose writes its primary will overwrite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_the_sentinels_name_is_used_only_if_it_is_a_primary() {
    let primary = Service::start(Kind::Redis).await;
    let replica = Service::start_redis_with(&[
        "--replicaof",
        "127.0.0.1",
        &primary.port.to_string(),
        "--replica-read-only",
        "no",
    ])
    .await;
    let sentinel = Service::start_sentinel(format!(
        "sentinel monitor {MASTER} 127.0.0.1 {} 1\n",
        replica.port
    ))
    .await;
    let config = fencegate::config::Config::parse(&format!(
        "upstream: http://127.0.0.1:1\nstore: {{ kind: redis, url: 'redis://{MASTER}/', prefix: {}, \
         replicas: 0, sentinel: {{ master: {MASTER}, urls: ['redis://127.0.0.1:{}'] }} }}\n",
        fresh_prefix(),
        sentinel.port
    ))
    .unwrap();
    let store = fencegate::store::open(&config.store).await.unwrap();
    let refused = store
        .compare_and_raise(
            &rid("r"),
            7.into(),
            fencegate::config::EqualTokens::Allow.into(),
        )
        .await
        .expect_err("a raise acknowledged by a replica");
    assert!(
        refused.to_string().contains(&format!(
            "the Sentinels name 127.0.0.1:{} as the primary of `{MASTER}`, but it is a slave",
            replica.port
        )),
        "{refused}"
    );
    assert_eq!(
        redis_cli_at(replica.port, &["DBSIZE"]).await.trim(),
        "0",
        "the replica was written to"
    );
}

/// `/readyz` with `replicas: 1` turns 503 while the replica does not acknowledge (stopped,
/// still connected), and 200 again once it does: the probe waits for the replicas as the writes
/// do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_waits_for_the_replicas() {
    let primary = Service::start(Kind::Redis).await;
    let replica = Service::start_redis_replica(primary.port).await;
    wait_synced(&replica).await;
    let up = Upstream::start().await;
    let fg = fencegate(
        &up.url(),
        &format!(
            "store: {{ kind: redis, url: '{}', prefix: {}, replicas: 1 }}\n{ACCOUNTS}",
            primary.url(),
            fresh_prefix()
        ),
    )
    .await;
    let ready_is = |want: u16| {
        let admin = fg.admin;
        async move {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let status = send("GET", &format!("http://{admin}/readyz"), &[], "")
                    .await
                    .status
                    .as_u16();
                if status == want {
                    return;
                }
                assert!(Instant::now() < deadline, "readiness never became {want}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    ready_is(200).await;
    assert_eq!(put(&fg, "1", "1").await.status, 200);
    replica.pause();
    ready_is(503).await;
    replica.resume();
    ready_is(200).await;
    assert_eq!(put(&fg, "1", "2").await.status, 200);
}

/// Waits until `replica` is in sync with its primary.
async fn wait_synced(replica: &Service) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !redis_cli_at(replica.port, &["INFO", "replication"])
        .await
        .contains("master_link_status:up")
    {
        assert!(Instant::now() < deadline, "the replica never synced");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The lease backend with `replicas: 1` while its replica does not acknowledge (stopped, still
/// connected): a renewal is not reported done (the holder's deadline must not move on a renewal
/// a failover could lose), and a grant refused `503` is given back at once instead of holding
/// the resource for its TTL with nobody to release it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_renewal_or_grant_the_replicas_did_not_acknowledge_counts_for_nothing() {
    let primary = Service::start(Kind::Redis).await;
    let replica = Service::start_redis_replica(primary.port).await;
    let config = fencegate::config::Config::parse(&format!(
        "upstream: http://127.0.0.1:1\nleases: {{ backend: {{ kind: redis, url: '{}', prefix: {}, replicas: 1 }}, ttl: 1s }}\n",
        primary.url(),
        fresh_prefix()
    ))
    .unwrap();
    let leases = fencegate::lease::open(&config.leases.unwrap().backend)
        .await
        .unwrap();
    wait_synced(&replica).await;
    let ttl = Duration::from_secs(60);
    let held = match leases.try_acquire("held", "w1", ttl).await.unwrap() {
        Acquired::Granted(grant) => grant,
        other => panic!("not granted: {other:?}"),
    };

    replica.pause();
    let renewed = leases.renew(&held, ttl).await;
    let refused = leases.try_acquire("other", "w1", ttl).await;
    replica.resume();
    let renewed = renewed.expect_err("a renewal no replica acknowledged was reported done");
    assert!(
        renewed.to_string().contains("0 of the 1 replicas"),
        "{renewed}"
    );
    let refused = refused.expect_err("a grant no replica acknowledged was handed out");
    assert!(
        refused.to_string().contains("0 of the 1 replicas"),
        "{refused}"
    );
    // The refused grant was given back: another holder gets the resource now, not in 60 s.
    wait_synced(&replica).await;
    match leases.try_acquire("other", "w2", ttl).await.unwrap() {
        Acquired::Granted(grant) => assert_eq!(grant.holder, "w2"),
        other => panic!("the refused grant still holds the resource: {other:?}"),
    }
}

/// A primary the Sentinels take for down while it still serves fencegate: the Sentinels' own
/// `PING`s are refused (an ACL on their user; fencegate writes as another), so they fail it
/// over while it stays a primary, reachable, with a replica attached until the Sentinels move
/// it. `WAIT 1` alone acknowledges writes there that the promotion loses (the replica not yet
/// moved acknowledges them). A writer runs throughout, each write a new resource (so a lost
/// raise is not hidden by a later one): from the first Sentinel's `+sdown` on, fencegate
/// acknowledges nothing on that primary (503, the detail naming the Sentinel),
/// `+switch-master` moves it to the new primary without a broken connection (the old one
/// never answers `READONLY`), and the new primary holds every admitted raise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_the_sentinels_take_for_down_acknowledges_nothing_until_the_switch() {
    let topology = SentinelTopology::start().await;
    let ports =
        std::iter::once(topology.primary.port).chain(topology.replicas.iter().map(|r| r.port));
    for port in ports {
        let ok = redis_cli_at(
            port,
            &["ACL", "SETUSER", "fg", "on", ">pw", "~*", "&*", "+@all"],
        )
        .await;
        assert_eq!(ok.trim(), "OK");
    }
    let up = Upstream::start().await;
    let yaml = store_yaml(&topology, None).replace("redis://mymaster/", "redis://fg:pw@mymaster/");
    assert!(yaml.contains("fg:pw@"), "{yaml}");
    let a = fencegate(&up.url(), &yaml).await;
    assert_eq!(put(&a, "0", "5").await.status, 200);

    // The writer: token 5 on account 1, 2, 3, ..., one at a time, until told to stop.
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let writer = {
        let a = a.listen;
        tokio::spawn(async move {
            let mut answers = Vec::new();
            let mut id = 1u64;
            while !*stopped.borrow_and_update() {
                let target = format!("http://{a}/accounts/{id}");
                answers.push((
                    id,
                    send("PUT", &target, &[("fencing-token", "5")], "w").await,
                ));
                id += 1;
            }
            answers
        })
    };

    let refused = redis_cli_at(
        topology.primary.port,
        &["ACL", "SETUSER", "default", "-ping"],
    )
    .await;
    assert_eq!(refused.trim(), "OK");
    let cut = Instant::now();
    let promoted = topology.wait_promoted().await;
    // Until a write is admitted after the promotion (the writer keeps writing meanwhile).
    let before = up.seen().len();
    let deadline = Instant::now() + Duration::from_secs(60);
    while up.seen().len() == before {
        assert!(
            Instant::now() < deadline,
            "nothing admitted after the promotion"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.send_replace(true);
    let answers = writer.await.unwrap();

    let mut admitted = std::collections::BTreeSet::new();
    let mut doubted = 0;
    for (id, reply) in &answers {
        match reply.status.as_u16() {
            200 => {
                admitted.insert(*id);
            }
            503 => {
                let body = reply.assert_problem(503, "urn:fencegate:store-unavailable");
                let detail = body["detail"].as_str().unwrap_or_default();
                doubted += usize::from(detail.contains("Sentinel"));
            }
            other => panic!("account {id}: {other} {}", reply.text()),
        }
    }
    // What the new primary holds: the accounts with a maximum, each at 5.
    let keys = redis_cli_at(promoted, &["KEYS", "*{account:*}:max"]).await;
    let held: std::collections::BTreeSet<u64> = keys
        .lines()
        .filter_map(|k| k.split("{account:").nth(1)?.split('}').next()?.parse().ok())
        .collect();
    let lost: Vec<u64> = admitted.difference(&held).copied().collect();
    println!(
        "sentinel down-but-serving primary: {} writes in {}ms: admitted {}, refused in doubt \
         {doubted}, admitted and lost {}",
        answers.len(),
        cut.elapsed().as_millis(),
        admitted.len(),
        lost.len()
    );
    assert!(
        lost.is_empty(),
        "{} acknowledged raises the failover lost, accounts {:?} to {:?}",
        lost.len(),
        lost.first(),
        lost.last()
    );
    assert!(admitted.len() > 1, "writes were admitted before and after");
    assert!(doubted > 0, "no write was refused for the Sentinels' doubt");
    assert_eq!(
        recorded(&a, &format!("account:{}", admitted.last().unwrap())).await,
        Some(5)
    );
}

/// The defence when a failover loses grants anyway (`replicas: 0`, the replicas cut off while
/// grants 3 and 4 were made): the promoted replica's counter is at 2, but the next grant is
/// made on a server whose replication history differs from the one the resource's last grant
/// recorded, so the counter first moves on by the epoch gap. Without it, token 3 would be
/// granted a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_after_a_failover_that_lost_grants_never_repeats_a_token() {
    let mut topology = SentinelTopology::start().await;
    let leases = lease_backend_with(&topology, 0).await;
    let mut granted = Vec::new();
    for _ in 0..2 {
        let grant = grant(&*leases, "job").await;
        granted.push(grant.token);
        assert!(leases.release(&grant).await.unwrap());
    }
    // Both replicas hold grants 1 and 2 before they are cut off.
    let key = redis_cli_at(topology.primary.port, &["KEYS", "*{job}:token"]).await;
    let key = key.trim().to_owned();
    let deadline = Instant::now() + Duration::from_secs(30);
    for replica in &topology.replicas {
        while redis_cli_at(replica.port, &["GET", &key]).await.trim() != "2" {
            assert!(Instant::now() < deadline, "a replica never had grant 2");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        replica.pause();
    }
    let cut = redis_cli_at(
        topology.primary.port,
        &["CLIENT", "KILL", "TYPE", "replica"],
    )
    .await;
    assert_eq!(cut.trim(), "2", "the replication links were not cut");
    for _ in 0..2 {
        let grant = grant(&*leases, "job").await;
        granted.push(grant.token);
        assert!(leases.release(&grant).await.unwrap());
    }
    assert_eq!(granted, [1, 2, 3, 4].map(tk));
    topology.primary.kill().await;
    for replica in &topology.replicas {
        replica.resume();
    }
    let promoted = topology.wait_promoted().await;
    let counter = redis_cli_at(promoted, &["GET", &key]).await;
    assert_eq!(
        counter.trim(),
        "2",
        "the promoted replica lacks grants 3 and 4"
    );

    let next = grant(&*leases, "job").await;
    println!(
        "lease tokens before the failover {granted:?}, after {}",
        next.token
    );
    // 2, moved on by the gap (2^32), then the grant's own increment.
    assert_eq!(next.token, tk((1 << 32) + 3));
    // The next grant on the same server does not move on again.
    assert!(leases.release(&next).await.unwrap());
    assert_eq!(
        grant(&*leases, "job").await.token,
        next.token.next().unwrap()
    );
}

/// fencegate through Sentinels whose only user for it is `fg` with `rights`; once one write
/// is admitted and every Sentinel shows the watch subscribed as `fg` to its eleven channels,
/// what each Sentinel's `ACL LOG` says it refused.
async fn through_sentinel_user(rights: &str) -> Vec<String> {
    let topology =
        SentinelTopology::start_with(&format!("user fg on >pw resetchannels &* {rights}\n")).await;
    let up = Upstream::start().await;
    let urls: Vec<String> = topology
        .sentinels
        .iter()
        .map(|s| format!("redis://fg:pw@127.0.0.1:{}", s.port))
        .collect();
    let yaml = format!(
        "store: {{ kind: redis, url: 'redis://{MASTER}/', prefix: {}, sentinel: {{ master: \
         {MASTER}, urls: [{}] }} }}\n{ACCOUNTS}",
        fresh_prefix(),
        urls.join(", ")
    );
    let fg = fencegate(&up.url(), &yaml).await;
    assert_eq!(put(&fg, "1", "1").await.status, 200);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut refused = Vec::new();
    for sentinel in &topology.sentinels {
        loop {
            let clients = redis_cli_at(sentinel.port, &["CLIENT", "LIST"]).await;
            if clients
                .lines()
                .any(|c| c.contains(" user=fg ") && c.contains(" sub=11 "))
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "no watch subscribed as fg: {clients}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        refused.push(redis_cli_at(sentinel.port, &["ACL", "LOG"]).await);
    }
    refused
}

/// The Sentinel user docs/stores.md documents (`resetchannels &* -@all
/// +sentinel|get-master-addr-by-name +sentinel|replicas +subscribe +ping`), as the only rights
/// fencegate has on the Sentinels: finding the primary, following the events and counting the
/// promotable replicas all work with it, and no Sentinel logged a refused command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_sentinel_acl_rule_is_enough() {
    let rights = "-@all +sentinel|get-master-addr-by-name +sentinel|replicas +subscribe +ping";
    for refused in through_sentinel_user(rights).await {
        assert_eq!(refused.trim(), "", "a Sentinel refused fencegate a command");
    }
}

/// A Sentinel user without `+sentinel|replicas` (the rule an earlier fencegate documented):
/// writes still pass, waiting for the configured `replicas` only, and the watch stays
/// subscribed; the refusal is in the Sentinels' log (and fencegate's, as a warning).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_user_that_may_not_list_replicas_still_finds_the_primary() {
    let rights = "-@all +sentinel|get-master-addr-by-name +subscribe +ping";
    for refused in through_sentinel_user(rights).await {
        assert!(refused.contains("sentinel|replicas"), "{refused}");
    }
}
