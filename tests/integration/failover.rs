//! Store failovers on replicated topologies started by the tests, on loopback: a PostgreSQL
//! primary with a streaming standby (`pg_basebackup -R`, promoted with `pg_ctl promote` after
//! the primary is killed with `kill -9`), and a three-member etcd cluster whose leader is
//! killed. Two fencegate replicas share the store; the second one never sees the fenced
//! resource before the failover, so its verdicts after it come from the store, not from a
//! cache. Recovery times (failover to the first admitted write) are printed.

use crate::common::rid;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate::app::Server;
use fencegate::config::{BackendConfig, Config, Remote, SecretUrl};
use fencegate::lease::{self, Acquired, LeaseBackend};

use crate::common::*;
use crate::services::*;

/// How long a failover may take before a test gives up.
const DEADLINE: Duration = Duration::from_secs(30);

/// A multi-host url naming the primary first and the standby second: a new connection goes to
/// whichever of them accepts writes.
fn multi_host(primary: &Service, standby: &Service) -> String {
    format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres\
         ?target_session_attrs=read-write&connect_timeout=2",
        primary.port, standby.port
    )
}

/// A fencegate with `store` of `kind` on `url` (and `extra` store fields), fencing
/// `/accounts/{id}`.
async fn replica(up: &Upstream, kind: &str, url: &str, prefix: &str, extra: &str) -> Server {
    fencegate(
        &up.url(),
        &format!("store: {{ kind: {kind}, url: '{url}', prefix: {prefix}{extra} }}\n{ACCOUNTS}"),
    )
    .await
}

fn remote(url: &str, prefix: &str) -> Remote {
    Remote {
        url: SecretUrl::try_from(url.to_owned()).unwrap(),
        tls: None,
        prefix: prefix.to_owned(),
        replicas: None,
        redis: Default::default(),
    }
}

/// PUTs with `token` until the answer is not 503 (the store failing over), within
/// [`DEADLINE`]; returns the answer's status.
async fn put_through(server: &Server, id: &str, token: &str) -> u16 {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let reply = put(server, id, token).await;
        if reply.status != 503 {
            return reply.status.as_u16();
        }
        assert!(
            Instant::now() < deadline,
            "still 503 after {DEADLINE:?}: {}",
            reply.text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Grants `resource` to `holder` and releases it; returns the token.
async fn grant_and_release(backend: &dyn LeaseBackend, resource: &str, holder: &str) -> u64 {
    match backend
        .try_acquire(resource, holder, Duration::from_secs(30))
        .await
        .unwrap()
    {
        Acquired::Granted(g) => {
            assert!(backend.release(&g).await.unwrap());
            g.token.get()
        }
        held => panic!("{resource} is free, got {held:?}"),
    }
}

/// Grants `resource` once the backend answers again (within [`DEADLINE`]); returns the token.
async fn grant_through(backend: &dyn LeaseBackend, resource: &str, holder: &str) -> u64 {
    let deadline = Instant::now() + DEADLINE;
    loop {
        match backend
            .try_acquire(resource, holder, Duration::from_secs(30))
            .await
        {
            Ok(Acquired::Granted(g)) => return g.token.get(),
            Ok(held) => panic!("{resource} is free, got {held:?}"),
            Err(e) => assert!(Instant::now() < deadline, "no grant after failover: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Makes `standby` (connected as `name`) a synchronous standby of `primary`: a commit is
/// acknowledged once the standby has flushed it.
async fn synchronous(primary: &Service, name: &str) {
    primary
        .sql(&format!(
            "ALTER SYSTEM SET synchronous_standby_names = '{name}'"
        ))
        .await
        .unwrap();
    primary.sql("SELECT pg_reload_conf()").await.unwrap();
    primary
        .wait_sql(
            &format!(
                "SELECT sync_state FROM pg_stat_replication WHERE application_name = '{name}'"
            ),
            "sync",
        )
        .await;
}

/// Synchronous replication, the safe setting: token 7 is admitted, the primary is killed right
/// after, the standby promoted. The raise survives (stale 6 is 409 through the replica that
/// never saw it), a fresh token is admitted without restarting fencegate, and lease grants
/// never repeat a token. A replica with `replicas: 1` admits nothing once the promoted server
/// has no synchronous standby left, and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_promoted_synchronous_standby_keeps_fencing() {
    let mut primary = Service::start(Kind::Postgres).await;
    let mut standby = primary.standby("standby1").await;
    synchronous(&primary, "standby1").await;
    let url = multi_host(&primary, &standby);
    let prefix = fresh_prefix();
    let up = Upstream::start().await;
    // The default setting: a server with standbys must replicate synchronously, a lone one
    // (the promoted standby) may not.
    let fg1 = replica(&up, "postgres", &url, &prefix, "").await;
    let fg2 = replica(&up, "postgres", &url, &prefix, "").await;
    // `replicas: 1`: every acknowledged raise is on a synchronous standby, or none is admitted.
    let strict = replica(&up, "postgres", &url, &prefix, ", replicas: 1").await;
    let leases = lease::open(&BackendConfig::Postgres(remote(&url, &fresh_prefix())))
        .await
        .unwrap();
    let mut before = Vec::new();
    for _ in 0..3 {
        before.push(grant_and_release(&*leases, "job", "a").await);
    }
    assert_eq!(put(&strict, "2", "1").await.status, 200);

    // A standby that lags (here: stopped) holds up acknowledgements instead of losing them: the
    // raise waits for it past the store timeout (503, not forwarded), and completes once the
    // standby is back.
    standby.kill().await;
    let waited = put(&fg1, "3", "1").await;
    waited.assert_problem(503, "urn:fencegate:store-unavailable");
    standby.restart().await;
    synchronous(&primary, "standby1").await;
    let deadline = Instant::now() + DEADLINE;
    while recorded(&fg2, "account:3").await != Some(1) {
        assert!(
            Instant::now() < deadline,
            "the waiting raise never completed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    assert_eq!(put(&fg1, "1", "7").await.status, 200);
    primary.kill().await;
    let failover = Instant::now();
    standby.promote().await;
    let promoted = Instant::now();

    // The replica that never saw account:1 asks the store: 7 survived.
    assert_eq!(
        put_through(&fg2, "1", "6").await,
        409,
        "the raise to 7 was lost"
    );
    assert_eq!(put_through(&fg1, "1", "6").await, 409);
    assert_eq!(put_through(&fg1, "1", "8").await, 200);
    let recovered = promoted.elapsed();
    assert_eq!(put_through(&fg2, "1", "9").await, 200);
    assert_eq!(recorded(&fg2, "account:1").await, Some(9));
    let after = grant_through(&*leases, "job", "b").await;
    assert!(
        before.iter().all(|t| *t < after),
        "a grant after the failover repeated a token: {before:?} then {after}"
    );
    let refused = put(&strict, "2", "2").await;
    let body = refused.assert_problem(503, "urn:fencegate:store-unavailable");
    assert!(
        body["detail"].as_str().unwrap().contains("`replicas: 1`"),
        "{body}"
    );
    eprintln!(
        "postgres synchronous standby: promotion took {:?}; promotion -> first admitted write \
         {recovered:?}; raise to 7 kept; lease tokens {before:?} then {after}",
        promoted - failover
    );
    assert_eq!(up.count(), 4, "only the admitted writes reach the upstream");
}

/// Asynchronous replication, the documented window measured: with the standby behind (stopped
/// while the primary acknowledges the raise to 7), a failover to it loses the acknowledged
/// raise and a stale token 6 passes; a lost lease grant's token is not granted again (the
/// counter moves on with the new timeline). fencegate refuses to start on such a server unless
/// `replicas: 0` says the window is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_asynchronous_standby_can_lose_an_acknowledged_raise() {
    let mut primary = Service::start(Kind::Postgres).await;
    let mut standby = primary.standby("standby1").await;
    let url = multi_host(&primary, &standby);
    let prefix = fresh_prefix();
    let up = Upstream::start().await;

    // The default: an asynchronous standby is a window fencegate does not accept silently.
    let yaml = format!(
        "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: {}\n\
         store: {{ kind: postgres, url: '{url}', prefix: {prefix} }}\n{ACCOUNTS}",
        up.url()
    );
    let refused = match Server::start(&Config::parse(&yaml).unwrap()).await {
        Ok(_) => panic!("started on an asynchronous standby without `replicas: 0`"),
        Err(e) => e.to_string(),
    };
    assert!(
        refused.contains("asynchronous") && refused.contains("replicas: 0"),
        "{refused}"
    );
    let backend = lease::open(&BackendConfig::Postgres(remote(&url, &prefix))).await;
    let refused = backend
        .err()
        .expect("the lease backend refuses too")
        .to_string();
    assert!(refused.contains("asynchronous"), "{refused}");

    let fg1 = replica(&up, "postgres", &url, &prefix, ", replicas: 0").await;
    let fg2 = replica(&up, "postgres", &url, &prefix, ", replicas: 0").await;
    let leases = lease::open(&BackendConfig::Postgres(Remote {
        replicas: Some(0),
        ..remote(&url, &prefix)
    }))
    .await
    .unwrap();
    assert_eq!(put(&fg1, "1", "5").await.status, 200);
    let replicated = grant_and_release(&*leases, "job", "a").await;
    // 5 and the first grant have reached the standby; then the standby stops, and the primary
    // acknowledges 7 and a second grant alone.
    let lsn = primary
        .sql("SELECT pg_current_wal_lsn()")
        .await
        .unwrap()
        .remove(0);
    standby
        .wait_sql(
            &format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn"),
            "t",
        )
        .await;
    standby.kill().await;
    assert_eq!(put(&fg1, "1", "7").await.status, 200);
    let lost = grant_and_release(&*leases, "job", "a").await;
    assert!(replicated < lost);
    primary.kill().await;
    standby.restart().await;
    let failover = Instant::now();
    standby.promote().await;

    // The replica that never saw account:1 asks the promoted standby, which never had 7.
    let stale = put_through(&fg2, "1", "6").await;
    let recovered = failover.elapsed();
    assert_eq!(stale, 200, "the window did not show: stale 6 was {stale}");
    assert_eq!(recorded(&fg2, "account:1").await, Some(6));
    // The promoted standby lacks the lost grant, but the next grant is made on a new
    // timeline: the counter moves on by 2^32 first, so the lost grant's token is never granted
    // again (without that, it was: `again == lost`).
    let again = grant_through(&*leases, "job", "b").await;
    assert_eq!(again, replicated + (1 << 32) + 1, "lost grant {lost}");
    assert!(again > lost);
    // A resource first leased on the promoted server starts past the gap too (its row may
    // have been lost whole), and moves on by one on the same timeline.
    let first = grant_and_release(&*leases, "job2", "c").await;
    assert_eq!(first, (1 << 32) + 1);
    assert_eq!(grant_and_release(&*leases, "job2", "c").await, first + 1);
    eprintln!(
        "postgres asynchronous standby: acknowledged raise to 7 lost, stale token 6 admitted \
         {recovered:?} after promotion; lease grant {lost} lost, the next grant {again}"
    );
}

/// The old primary stays up but read-only (as a failover manager fences it), answering
/// SQLSTATE 25006 on the pooled connections: they are dropped, and the pool reaches the promoted
/// standby without a restart, for the store and the lease backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_pool_leaves_a_read_only_primary() {
    let primary = Service::start(Kind::Postgres).await;
    let standby = primary.standby("standby1").await;
    let url = multi_host(&primary, &standby);
    let prefix = fresh_prefix();
    let up = Upstream::start().await;
    let fg = replica(&up, "postgres", &url, &prefix, ", replicas: 0").await;
    let leases = lease::open(&BackendConfig::Postgres(Remote {
        replicas: Some(0),
        ..remote(&url, &prefix)
    }))
    .await
    .unwrap();
    // Several pooled connections to the primary.
    let replies = tokio::join!(
        put(&fg, "0", "5"),
        put(&fg, "1", "5"),
        put(&fg, "2", "5"),
        put(&fg, "3", "5")
    );
    for reply in [replies.0, replies.1, replies.2, replies.3] {
        assert_eq!(reply.status, 200);
    }
    let before = grant_and_release(&*leases, "job", "a").await;
    // Everything replayed on the standby before the switch.
    let lsn = primary
        .sql("SELECT pg_current_wal_lsn()")
        .await
        .unwrap()
        .remove(0);
    standby
        .wait_sql(
            &format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn"),
            "t",
        )
        .await;

    primary
        .sql("ALTER SYSTEM SET default_transaction_read_only = on")
        .await
        .unwrap();
    primary.sql("SELECT pg_reload_conf()").await.unwrap();
    let failover = Instant::now();
    standby.promote().await;

    // The store and the lease backend, each with its own pool, fail over side by side.
    let (admitted, granted) = tokio::join!(
        async {
            let status = put_through(&fg, "1", "7").await;
            (status, failover.elapsed())
        },
        async {
            let token = grant_through(&*leases, "job", "b").await;
            (token, failover.elapsed())
        }
    );
    assert_eq!(admitted.0, 200);
    assert!(
        before < granted.0,
        "lease token repeated: {before} then {}",
        granted.0
    );
    for i in 0..4 {
        assert_eq!(put_through(&fg, &i.to_string(), "4").await, 409);
    }
    eprintln!(
        "postgres read-only old primary: promotion -> first admitted write {:?}, first lease \
         grant {:?}",
        admitted.1, granted.1
    );
}

/// A three-member etcd cluster loses its leader to `kill -9`: the two remaining members elect
/// another, a stale token is still 409 through the replica that never saw it, a fresh one is
/// admitted, and lease grants do not repeat a token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_cluster_keeps_fencing_when_its_leader_is_killed() {
    let mut cluster = EtcdCluster::start().await;
    let url = cluster.url();
    let prefix = fresh_prefix();
    let up = Upstream::start().await;
    let fg1 = replica(&up, "etcd", &url, &prefix, "").await;
    let fg2 = replica(&up, "etcd", &url, &prefix, "").await;
    let leases: Arc<dyn LeaseBackend> =
        lease::open(&BackendConfig::Etcd(remote(&url, &fresh_prefix())))
            .await
            .unwrap();
    let mut before = Vec::new();
    for _ in 0..3 {
        before.push(grant_and_release(&*leases, "job", "a").await);
    }

    assert_eq!(put(&fg1, "1", "7").await.status, 200);
    let leader = cluster.leader().await;
    cluster.kill(leader).await;
    let failover = Instant::now();

    assert_eq!(
        put_through(&fg2, "1", "6").await,
        409,
        "the raise to 7 was lost"
    );
    assert_eq!(put_through(&fg1, "1", "8").await, 200);
    let recovered = failover.elapsed();
    assert_eq!(put_through(&fg2, "1", "9").await, 200);
    // From then on no call fails for the dead member: every write is admitted, every read
    // answered, through both replicas.
    for token in 10..50 {
        let fg = if token % 2 == 0 { &fg1 } else { &fg2 };
        let reply = put(fg, "1", &token.to_string()).await;
        assert_eq!(reply.status, 200, "token {token}: {}", reply.text());
        assert_eq!(recorded(fg, "account:1").await, Some(token));
    }
    let after = grant_through(&*leases, "job", "b").await;
    assert!(
        before.iter().all(|t| *t < after),
        "a grant after the failover repeated a token: {before:?} then {after}"
    );
    // Asked of the running members only: the killed one cannot answer as leader.
    let new_leader = cluster.leader().await;
    eprintln!(
        "etcd 3-member cluster: leader m{leader} killed -> first admitted write {recovered:?}; \
         new leader m{new_leader}; lease tokens {before:?} then {after}"
    );
    assert_eq!(up.count(), 43);
}

/// The retention check on a read-only old primary: a store with `fence.retention` admits
/// nothing until its check (here the mark it writes when told its period again) succeeds. The
/// check's refusal (SQLSTATE 25006) must retire the pool's connections like a write's does;
/// else every retry of the check takes another connection to the old primary, and the store
/// never admits again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_retention_check_leaves_a_read_only_primary() {
    let primary = Service::start(Kind::Postgres).await;
    let standby = primary.standby("standby1").await;
    let url = multi_host(&primary, &standby);
    let config = Config::parse(&format!(
        "upstream: http://127.0.0.1:1\n\
         store: {{ kind: postgres, url: '{url}', prefix: {}, replicas: 0 }}\n",
        fresh_prefix()
    ))
    .unwrap();
    let store = fencegate::store::open(&config.store).await.unwrap();
    let hour = Duration::from_secs(3600);
    store.forget_after(hour).unwrap();
    // Several pooled connections to the primary.
    let raise = |resource: &'static str| {
        let store = &store;
        async move {
            store
                .compare_and_raise(
                    &rid(resource),
                    5.into(),
                    fencegate::config::EqualTokens::Allow.into(),
                )
                .await
                .unwrap()
        }
    };
    let verdicts = tokio::join!(raise("a"), raise("b"), raise("c"), raise("d"));
    for verdict in [verdicts.0, verdicts.1, verdicts.2, verdicts.3] {
        assert_eq!(
            verdict,
            fencegate::store::Verdict::Admitted { previous: None }
        );
    }
    let lsn = primary
        .sql("SELECT pg_current_wal_lsn()")
        .await
        .unwrap()
        .remove(0);
    standby
        .wait_sql(
            &format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn"),
            "t",
        )
        .await;
    primary
        .sql("ALTER SYSTEM SET default_transaction_read_only = on")
        .await
        .unwrap();
    primary.sql("SELECT pg_reload_conf()").await.unwrap();
    standby.promote().await;

    // Told its period again: the check writes a new mark, on a pooled connection first.
    store.forget_after(hour).unwrap();
    let deadline = Instant::now() + DEADLINE;
    loop {
        match store
            .compare_and_raise(
                &rid("a"),
                6.into(),
                fencegate::config::EqualTokens::Allow.into(),
            )
            .await
        {
            Ok(verdict) => {
                assert_eq!(
                    verdict,
                    fencegate::store::Verdict::Admitted {
                        previous: Some(5.into())
                    }
                );
                break;
            }
            Err(e) => assert!(
                Instant::now() < deadline,
                "the store never admitted again: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
