//! Redis Cluster: three primaries, three replicas, all real, on loopback, made by
//! `redis-cli --cluster create`. A shard's primary is killed with `kill -9` and its replica takes
//! over by itself; fencegate follows the slot map without a restart, and what a failover keeps
//! or loses is measured per `replicas` setting (docs/guarantees.md). Slots moved by a resharding
//! (`ASK` while a slot migrates, `MOVED` after) are followed too.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate::config::{BackendConfig, ClusterConfig, RedisHa, Remote, SecretUrl};
use fencegate::lease::{self, Acquired, GrantEvent, LeaseBackend};

use crate::common::*;
use crate::fences_cli::{fences, listed};
use crate::sentinel::{
    acquire, first_admitted, grant, once_answered, received, refused_for_want_of_one_replica,
    seven_without,
};
use crate::services::*;

fn store_yaml(topology: &ClusterTopology, prefix: &str, replicas: Option<u32>) -> String {
    let replicas = replicas.map_or(String::new(), |n| format!(", replicas: {n}"));
    format!(
        "store: {{ kind: redis, url: '{}', prefix: {prefix}, cluster: {}{replicas} }}\n{ACCOUNTS}",
        topology.url(),
        topology.yaml()
    )
}

async fn lease_backend(
    topology: &ClusterTopology,
    prefix: &str,
    replicas: u32,
) -> Arc<dyn LeaseBackend> {
    lease::open(&BackendConfig::Redis(Remote {
        url: SecretUrl::try_from(topology.url()).unwrap(),
        tls: None,
        prefix: prefix.to_owned(),
        replicas: None,
        redis: RedisHa {
            sentinel: None,
            cluster: Some(ClusterConfig {
                seeds: topology.seeds(),
            }),
            replicas,
        },
    }))
    .await
    .unwrap()
}

/// The first `n` ids `i` (from 1) whose key `format(i)` the primary on `port` serves.
async fn ids_on(
    topology: &ClusterTopology,
    port: u16,
    n: usize,
    key: impl Fn(usize) -> String,
) -> Vec<String> {
    let mut ids = Vec::new();
    for i in 1.. {
        let (primary, _) = topology.shard_of(topology.slot_of(&key(i)).await).await;
        if primary.port == port {
            ids.push(i.to_string());
            if ids.len() == n {
                return ids;
            }
        }
    }
    unreachable!()
}

/// Waits until the primary on `port` has a replica in sync (a restarted node rejoined).
async fn wait_replica_of(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let info = redis_cli_at(port, &["INFO", "replication"]).await;
        if info.contains("connected_slaves:1") && info.contains("state=online") {
            return;
        }
        assert!(Instant::now() < deadline, "no replica rejoined {port}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the replica on `replica` has everything the primary on `primary` wrote.
async fn wait_in_sync(primary: u16, replica: u16) {
    let offset = |info: String, field: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .map(|v| v.trim().to_owned())
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let written = offset(
            redis_cli_at(primary, &["INFO", "replication"]).await,
            "master_repl_offset",
        );
        let applied = offset(
            redis_cli_at(replica, &["INFO", "replication"]).await,
            "slave_repl_offset",
        );
        if written.is_some() && written == applied {
            return;
        }
        assert!(Instant::now() < deadline, "the replica never caught up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A cluster with two fencegates and a lease backend on it (`replicas` as written, else the
/// default), and the shard the test kills: the one of `account:1`'s slot, with `n` account ids
/// and one lease resource on it.
struct Shard {
    topology: ClusterTopology,
    up: Upstream,
    prefix: String,
    a: fencegate::app::Server,
    b: fencegate::app::Server,
    leases: Arc<dyn LeaseBackend>,
    slot: u16,
    primary: ClusterNode,
    replica: ClusterNode,
    ids: Vec<String>,
    job: String,
}

impl Shard {
    async fn start(replicas: Option<u32>, n: usize) -> Shard {
        let topology = ClusterTopology::start().await;
        let up = Upstream::start().await;
        let prefix = fresh_prefix();
        let yaml = store_yaml(&topology, &prefix, replicas);
        let a = fencegate(&up.url(), &yaml).await;
        let b = fencegate(&up.url(), &yaml).await;
        let lease_prefix = fresh_prefix();
        let leases = lease_backend(&topology, &lease_prefix, replicas.unwrap_or(1)).await;
        let slot = topology
            .slot_of(&format!("{prefix}:{{account:1}}:max"))
            .await;
        let (primary, replica) = topology.shard_of(slot).await;
        let ids = ids_on(&topology, primary.port, n, |i| {
            format!("{prefix}:{{account:{i}}}:max")
        })
        .await;
        let job = ids_on(&topology, primary.port, 1, |i| {
            format!("{lease_prefix}:{{job:{i}}}:lease")
        })
        .await;
        Shard {
            topology,
            up,
            prefix,
            a,
            b,
            leases,
            slot,
            primary,
            replica,
            ids,
            job: format!("job:{}", job[0]),
        }
    }
}

/// The safe setting (the default with `cluster`, `replicas: 1`): token 7 admitted on two
/// resources of one shard, that shard's primary killed right after; once its replica took over
/// (and the killed node, restarted, rejoined as its replica), stale token 6 is 409 through both
/// fencegates, each from the store. A resource of another shard is never interrupted. Lease
/// grants never repeat a token across the failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failover_keeps_every_acknowledged_raise_and_grant() {
    let Shard {
        mut topology,
        up,
        prefix,
        a,
        b,
        leases,
        slot,
        primary,
        replica,
        ids,
        job,
    } = Shard::start(None, 3).await;
    let other = topology
        .cluster_nodes_at(replica.port)
        .await
        .into_iter()
        .find(|n| n.primary && n.port != primary.port)
        .unwrap();
    let elsewhere = ids_on(&topology, other.port, 1, |i| {
        format!("{prefix}:{{account:{i}}}:max")
    })
    .await
    .remove(0);

    let mut granted = Vec::new();
    for _ in 0..3 {
        let grant = grant(&*leases, &job).await;
        granted.push(grant.token);
        assert!(leases.release(&grant).await.unwrap());
    }
    let held = grant(&*leases, &job).await;
    granted.push(held.token);

    assert_eq!(put(&a, &ids[0], "7").await.status, 200);
    assert_eq!(put(&b, &ids[1], "7").await.status, 200);
    topology.node(primary.port).kill().await;
    let killed = Instant::now();
    // Another shard's resource is not interrupted.
    assert_eq!(put(&b, &elsewhere, "1").await.status, 200);
    let promoted = topology.wait_promoted(slot, primary.port).await;
    assert_eq!(promoted, replica.port);
    let promoted_after = killed.elapsed();
    // The killed node comes back, as a restarted pod would, and replicates the new primary:
    // until then `replicas: 1` refuses the shard's writes (no replica to acknowledge them).
    topology.node(primary.port).restart().await;
    wait_replica_of(promoted).await;
    let admitted = first_admitted(&a, &ids[2], 1).await;
    println!(
        "cluster failover (replicas: 1): primary killed -> replica promoted {}ms -> killed node \
         rejoined and first admitted write {}ms",
        promoted_after.as_millis(),
        killed.elapsed().as_millis()
    );
    assert_eq!(
        recorded(&a, &format!("account:{}", ids[2])).await,
        Some(admitted)
    );

    // Stale through both, each from the store: A never saw ids[1], B never saw ids[0].
    for (fg, id) in [(&a, &ids[1]), (&b, &ids[0])] {
        let refused = once_answered(fg, id, "6").await;
        refused.assert_problem(409, "urn:fencegate:stale-token");
        assert_eq!(refused.headers["fencing-token-current"], "7");
        assert_eq!(put(fg, id, "8").await.status, 200);
    }
    assert_eq!(received(&up, &ids[0]), [7, 8]);
    assert_eq!(received(&up, &ids[1]), [7, 8]);
    assert_eq!(put(&b, &elsewhere, "2").await.status, 200);

    // The lease held through the failover is still held; released, the next grant's token is
    // above every earlier one.
    assert!(matches!(
        acquire(&*leases, &job, "other").await,
        Acquired::Held { .. }
    ));
    assert!(leases.release(&held).await.unwrap());
    let next = grant(&*leases, &job).await;
    println!(
        "lease tokens before the failover {granted:?}, after {}",
        next.token
    );
    assert!(next.token > *granted.iter().max().unwrap());
}

/// What a lagging replica's promotion does: the shard's replica is stopped (SIGSTOP) and its
/// replication link cut, token 7 is written and a lease granted, the primary is killed with
/// `kill -9`, the replica resumed and promoted, and the killed node restarted (it rejoins as
/// the replica). Returns the answer to 7, the answer to stale token 6 through the other
/// fencegate after the failover, what the upstream received, and the lease tokens granted
/// before the failover and the first after.
async fn lagging_replica(replicas: u32) -> (Reply, Reply, Vec<u64>, Vec<u64>, u64) {
    let Shard {
        mut topology,
        up,
        a,
        b,
        leases,
        slot,
        primary,
        replica,
        ids,
        job,
        ..
    } = Shard::start(Some(replicas), 2).await;
    // Both connected and in sync before the fault.
    assert_eq!(put(&a, &ids[1], "1").await.status, 200);
    assert_eq!(put(&b, &ids[1], "2").await.status, 200);
    let mut granted = Vec::new();
    let first = grant(&*leases, &job).await;
    granted.push(first.token.get());
    assert!(leases.release(&first).await.unwrap());
    wait_in_sync(primary.port, replica.port).await;

    topology.node(replica.port).pause();
    let cut = redis_cli_at(primary.port, &["CLIENT", "KILL", "TYPE", "replica"]).await;
    assert_eq!(cut.trim(), "1", "the replication link was not cut");
    let seven = put(&a, &ids[0], "7").await;
    if let Ok(Acquired::Granted(grant)) = leases
        .try_acquire(&job, "holder", Duration::from_secs(30))
        .await
    {
        granted.push(grant.token.get());
        assert!(leases.release(&grant).await.unwrap());
    }
    topology.node(primary.port).kill().await;
    let killed = Instant::now();
    topology.node(replica.port).resume();
    topology.wait_promoted(slot, primary.port).await;
    topology.node(primary.port).restart().await;
    wait_replica_of(replica.port).await;

    let six = once_answered(&b, &ids[0], "6").await;
    println!(
        "cluster failover (replicas: {replicas}, replica lagging): 7 answered {}, then stale 6 \
         through the other fencegate {} after {}ms",
        seven.status,
        six.status,
        killed.elapsed().as_millis()
    );
    let next = grant(&*leases, &job).await.token;
    println!("lease tokens before the failover {granted:?}, after {next}");
    (seven, six, received(&up, &ids[0]), granted, next.get())
}

/// `replicas: 0`: the documented window, measured. The raise of 7 was acknowledged (and its
/// write forwarded), the promoted replica never had it, and stale token 6 passes after it. The
/// lease grant the failover lost is not repeated: the promoted replica's replication id differs
/// from the one the resource's last grant recorded, so the counter moves on by 2^32 first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_without_replica_acknowledgement_loses_a_raise_in_a_failover() {
    let (seven, six, received, granted, next) = lagging_replica(0).await;
    assert_eq!(seven.status, 200);
    assert_eq!(six.status, 200, "the lost raise did not let 6 pass");
    assert_eq!(
        received,
        [7, 6],
        "the upstream saw a stale token after a newer one"
    );
    assert_eq!(granted, [1, 2], "the grant during the lag was made");
    // 1 (the promoted replica's counter), moved on by the gap, then the grant's increment.
    assert_eq!(next, (1 << 32) + 2);
}

/// `replicas: 1`, same fault: the raise of 7 is refused 503 (never forwarded) since no replica
/// acknowledged it, and so is the grant; 6 after the failover is then no violation: the
/// upstream never saw 7.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_with_replica_acknowledgement_refuses_a_raise_a_failover_could_lose() {
    let (seven, six, received, granted, next) = lagging_replica(1).await;
    seven.assert_problem(503, "urn:fencegate:store-unavailable");
    assert!(seven.text().contains("replicas"), "{}", seven.text());
    assert_eq!(six.status, 200);
    assert_eq!(received, [6]);
    assert_eq!(granted, [1], "a grant no replica acknowledged was refused");
    assert!(next > 1);
}

/// Two replicas per shard, `replicas: 1`: replica B is stopped and its replication link cut,
/// so only replica A can acknowledge token 7; the primary is killed, B resumed and made primary
/// (`CLUSTER FAILOVER TAKEOVER`: the cluster's own election favours the replica with the
/// highest offset, but does not guarantee it). `WAIT 1` would acknowledge 7 through A and the
/// promotion of B would lose it (stale 6 then admitted after 7 was forwarded); the write must
/// wait for every replica the slot map lists for its primary, so 7 is refused 503, never
/// forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raise_waits_for_every_replica_of_its_shard() {
    let mut topology = ClusterTopology::start_with_replicas(2).await;
    let up = Upstream::start().await;
    let prefix = fresh_prefix();
    let yaml = store_yaml(&topology, &prefix, Some(1));
    let a = fencegate(&up.url(), &yaml).await;
    let b = fencegate(&up.url(), &yaml).await;
    let slot = topology
        .slot_of(&format!("{prefix}:{{account:1}}:max"))
        .await;
    let (primary, _) = topology.shard_of(slot).await;
    let known = topology.cluster_nodes_at(primary.port).await;
    let replicas: Vec<&ClusterNode> = known
        .iter()
        .filter(|n| n.of.as_deref() == Some(primary.id.as_str()))
        .collect();
    assert_eq!(replicas.len(), 2, "{known:?}");
    let lagging = replicas[1].port;
    assert_eq!(put(&a, "1", "5").await.status, 200);
    assert_eq!(put(&b, "2", "5").await.status, 200);

    let seven = seven_without(primary.port, topology.node(lagging), &a, "1").await;
    topology.node(primary.port).kill().await;
    topology.node(lagging).resume();
    let taken = redis_cli_at(lagging, &["CLUSTER", "FAILOVER", "TAKEOVER"]).await;
    assert_eq!(taken.trim(), "OK");
    let promoted = topology.wait_promoted(slot, primary.port).await;
    assert_eq!(promoted, lagging, "A was promoted, not B");

    let six = once_answered(&b, "1", "6").await;
    println!(
        "cluster, two replicas, the promoted one lagging (replicas: 1): 7 answered {}, stale 6 \
         after the failover {}",
        seven.status, six.status
    );
    refused_for_want_of_one_replica(&seven, &six);
    assert_eq!(
        received(&up, "1"),
        [5, 6],
        "a stale token after a newer one"
    );
}

/// A resharding moves the slot of a resource from one primary to another while fencegate
/// writes: during the migration, the source answers `ASK` for the key already moved, and
/// fencegate asks the target (`ASKING`); once the slot is the target's, the source answers
/// `MOVED`, and fencegate follows it. The maximum is compared where it is at every step:
/// stale tokens are 409, fresh ones admitted, none is 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resharding_is_followed_through_ask_and_moved() {
    let topology = ClusterTopology::start().await;
    let up = Upstream::start().await;
    let prefix = fresh_prefix();
    let a = fencegate(&up.url(), &store_yaml(&topology, &prefix, None)).await;
    let key = format!("{prefix}:{{account:1}}:max");
    let slot = topology.slot_of(&key).await;
    let (source, _) = topology.shard_of(slot).await;
    let known = topology.cluster_nodes_at(source.port).await;
    let target = known
        .iter()
        .find(|n| n.primary && n.port != source.port)
        .unwrap()
        .clone();
    let slot_arg = slot.to_string();

    assert_eq!(put(&a, "1", "5").await.status, 200);
    redis_cli_at(
        target.port,
        &["CLUSTER", "SETSLOT", &slot_arg, "IMPORTING", &source.id],
    )
    .await;
    redis_cli_at(
        source.port,
        &["CLUSTER", "SETSLOT", &slot_arg, "MIGRATING", &target.id],
    )
    .await;
    let migrated = redis_cli_at(
        source.port,
        &[
            "MIGRATE",
            "127.0.0.1",
            &target.port.to_string(),
            "",
            "0",
            "5000",
            "KEYS",
            &key,
        ],
    )
    .await;
    assert_eq!(migrated.trim(), "OK");

    // The key is on the target now; the source answers ASK.
    let stale = put(&a, "1", "4").await;
    stale.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(stale.headers["fencing-token-current"], "5");
    assert_eq!(put(&a, "1", "6").await.status, 200);

    // The slot is the target's: the source answers MOVED.
    for node in &topology.nodes {
        redis_cli_at(
            node.port,
            &["CLUSTER", "SETSLOT", &slot_arg, "NODE", &target.id],
        )
        .await;
    }
    let stale = put(&a, "1", "5").await;
    stale.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(stale.headers["fencing-token-current"], "6");
    assert_eq!(put(&a, "1", "7").await.status, 200);
    assert_eq!(redis_cli_at(target.port, &["GET", &key]).await.trim(), "7");
    assert_eq!(received(&up, "1"), [5, 6, 7]);
}

/// A fencegate that takes a cluster node for a single server (no `cluster`) refuses a write
/// whose key another node serves, and says how to configure it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_node_configured_as_a_single_server_is_named_as_such() {
    let topology = ClusterTopology::start().await;
    let up = Upstream::start().await;
    let prefix = fresh_prefix();
    let url_port = topology.nodes[0].port;
    let a = fencegate(
        &up.url(),
        &format!(
            "store: {{ kind: redis, url: '{}', prefix: {prefix} }}\n{ACCOUNTS}",
            topology.url()
        ),
    )
    .await;
    let elsewhere = ids_on(
        &topology,
        topology
            .cluster_nodes_at(url_port)
            .await
            .iter()
            .find(|n| n.primary && n.port != url_port)
            .unwrap()
            .port,
        1,
        |i| format!("{prefix}:{{account:{i}}}:max"),
    )
    .await;
    let refused = put(&a, &elsewhere[0], "1").await;
    refused.assert_problem(503, "urn:fencegate:store-unavailable");
    assert!(
        refused.text().contains("Redis Cluster node") && refused.text().contains("`cluster`"),
        "{}",
        refused.text()
    );
    assert!(up.seen().is_empty());
}

/// `fencegate fences list` over a cluster lists the maxima of every shard (a `SCAN` per
/// primary), and `get` reads each from the primary of its slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_list_reads_every_shard() {
    let topology = ClusterTopology::start().await;
    let up = Upstream::start().await;
    let prefix = fresh_prefix();
    let store = store_yaml(&topology, &prefix, None);
    let a = fencegate(&up.url(), &store).await;
    let mut shards = std::collections::BTreeSet::new();
    let mut expected = Vec::new();
    for i in 1..=12u64 {
        assert_eq!(
            put(&a, &i.to_string(), &(i + 100).to_string()).await.status,
            200
        );
        let slot = topology
            .slot_of(&format!("{prefix}:{{account:{i}}}:max"))
            .await;
        shards.insert(topology.shard_of(slot).await.0.port);
        expected.push((format!("account:{i}"), i + 100));
    }
    assert_eq!(shards.len(), 3, "the resources span every shard");
    expected.sort();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fencegate.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: {}\n{store}",
            up.url()
        ),
    )
    .unwrap();
    let all = fences(&config, &["list", "--output", "json"]).await;
    assert_eq!(all.code, 0, "{}", all.stderr);
    assert_eq!(listed(&all.json()), expected);
}

/// Sets, on every node, the data nodes' ACL line docs/stores.md gives (for `prefix`) plus
/// `extra`, as user `fencegate`; returns the url of node 0 as that user.
async fn cluster_user(topology: &ClusterTopology, prefix: &str, extra: &[&str]) -> String {
    let docs =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/stores.md")).unwrap();
    let line = docs
        .lines()
        .find(|l| l.starts_with("ACL SETUSER fencegate on >PASSWORD "))
        .unwrap()
        .replace("fencegate:", &format!("{prefix}:"))
        .replace(">PASSWORD", ">pw");
    let mut args: Vec<&str> = line.split(' ').collect();
    args.extend(extra);
    for node in &topology.nodes {
        assert_eq!(redis_cli_at(node.port, &args).await.trim(), "OK");
    }
    format!("redis://fencegate:pw@127.0.0.1:{}/", topology.nodes[0].port)
}

/// A user without `+cluster|nodes` (the rule an earlier fencegate documented): the slot map is
/// still read and writes pass on every shard, waiting for the configured `replicas` only; the
/// refusal is in the nodes' `ACL LOG` (and fencegate's log, as a warning).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_user_that_may_not_list_nodes_still_writes() {
    let topology = ClusterTopology::start().await;
    let up = Upstream::start().await;
    let prefix = fresh_prefix();
    let url = cluster_user(&topology, &prefix, &["+cluster|slots", "+asking", "+wait"]).await;
    let fg = fencegate(
        &up.url(),
        &format!(
            "store: {{ kind: redis, url: '{url}', prefix: {prefix}, cluster: {} }}\n{ACCOUNTS}",
            topology.yaml()
        ),
    )
    .await;
    for i in 1..=6 {
        assert_eq!(put(&fg, &i.to_string(), "5").await.status, 200);
    }
    let mut logs = String::new();
    for node in &topology.nodes {
        logs.push_str(&redis_cli_at(node.port, &["ACL", "LOG"]).await);
    }
    assert!(logs.contains("cluster|nodes"), "{logs}");
}

/// The data nodes' ACL line docs/stores.md gives, plus what its Redis Cluster section adds
/// (`+cluster|slots +cluster|nodes +asking +wait`), for `prefix`, on every node: the store and the lease
/// backend work with exactly these rights across every shard, and no node logged a refused
/// command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_cluster_acl_rule_is_enough() {
    let topology = ClusterTopology::start().await;
    let up = Upstream::start().await;
    let prefix = fresh_prefix();
    let docs =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/stores.md")).unwrap();
    assert!(docs.contains(
        "plus `+cluster|slots` (the slot map),\n`+cluster|nodes` (each primary's replicas) and \
         `+asking`"
    ));
    let url = cluster_user(
        &topology,
        &prefix,
        &["+cluster|slots", "+cluster|nodes", "+asking", "+wait"],
    )
    .await;
    let a = fencegate(
        &up.url(),
        &format!(
            "store: {{ kind: redis, url: '{url}', prefix: {prefix}, cluster: {} }}\n{ACCOUNTS}",
            topology.yaml()
        ),
    )
    .await;
    let mut shards = std::collections::BTreeSet::new();
    for i in 1..=9 {
        let id = i.to_string();
        assert_eq!(put(&a, &id, "5").await.status, 200);
        put(&a, &id, "4")
            .await
            .assert_problem(409, "urn:fencegate:stale-token");
        let slot = topology
            .slot_of(&format!("{prefix}:{{account:{i}}}:max"))
            .await;
        shards.insert(topology.shard_of(slot).await.0.port);
    }
    assert_eq!(shards.len(), 3, "the resources span every shard");

    let leases = lease::open(&BackendConfig::Redis(Remote {
        url: SecretUrl::try_from(url).unwrap(),
        tls: None,
        prefix: prefix.clone(),
        replicas: None,
        redis: RedisHa {
            sentinel: None,
            cluster: Some(ClusterConfig {
                seeds: topology.seeds(),
            }),
            replicas: 1,
        },
    }))
    .await
    .unwrap();
    let mut events = leases.grant_events();
    // Subscribed before the grants, so that none goes unannounced.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut live = events.live;
    while !live {
        assert!(
            Instant::now() < deadline,
            "the grant events never went live"
        );
        if let Ok(Ok(event)) =
            tokio::time::timeout(Duration::from_millis(200), events.events.recv()).await
        {
            live = event == GrantEvent::Live;
        }
    }
    for i in 1..=6 {
        let job = format!("job:{i}");
        let grant = grant(&*leases, &job).await;
        assert_eq!(grant.token, 1.into());
        assert!(leases.renew(&grant, Duration::from_secs(30)).await.unwrap());
        assert_eq!(leases.latest_token(&job).await.unwrap(), Some(1.into()));
        assert!(leases.release(&grant).await.unwrap());
    }
    // The grants' events reach the one subscribed connection from every shard.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut heard = std::collections::BTreeSet::new();
    while heard.len() < 6 {
        assert!(Instant::now() < deadline, "grant events heard: {heard:?}");
        if let Ok(Ok(GrantEvent::Changed(resource))) =
            tokio::time::timeout(Duration::from_millis(200), events.events.recv()).await
        {
            heard.insert(resource);
        }
    }
    for node in &topology.nodes {
        let log = redis_cli_at(node.port, &["ACL", "LOG"]).await;
        assert!(log.trim().is_empty(), "node {}: {log}", node.port);
    }
}
