//! One conformance suite that every fence store passes, against real servers, plus the
//! replica and failure behaviour of the shared stores.

use crate::common::rid;
use crate::common::tk;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate::config::{Config, EqualTokens};
use fencegate::store::{self, FenceStore, Verdict};

use crate::common::*;
use crate::process::{put_to, Process};
use crate::services::*;

use EqualTokens::{Allow, Reject};

/// A store of `kind` on a fresh prefix (and, for etcd, a throwaway server kept alive by the
/// returned guard).
pub(crate) async fn open(kind: &str) -> (Arc<dyn FenceStore>, Option<Service>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let (yaml, service) = store_yaml(kind, &dir).await;
    let config = Config::parse(&format!("upstream: http://127.0.0.1:1\n{yaml}")).unwrap();
    (store::open(&config.store).await.unwrap(), service, dir)
}

pub(crate) async fn store_yaml(kind: &str, dir: &tempfile::TempDir) -> (String, Option<Service>) {
    let prefix = fresh_prefix();
    match kind {
        "memory" => ("store: { kind: memory }\n".into(), None),
        "embedded" => (
            format!(
                "store: {{ kind: embedded, path: {}, prefix: {prefix} }}\n",
                dir.path().join("f.db").display()
            ),
            None,
        ),
        "redis" => (
            format!("store: {{ kind: redis, url: '{REDIS_URL}', prefix: {prefix} }}\n"),
            None,
        ),
        "postgres" => (
            format!("store: {{ kind: postgres, url: '{POSTGRES_URL}', prefix: {prefix} }}\n"),
            None,
        ),
        "etcd" => {
            let etcd = Service::start(Kind::Etcd).await;
            (
                format!(
                    "store: {{ kind: etcd, url: '{}', prefix: {prefix} }}\n",
                    etcd.url()
                ),
                Some(etcd),
            )
        }
        other => panic!("unknown store {other}"),
    }
}

async fn raise_equal_stale(store: Arc<dyn FenceStore>) {
    let r = "account:1";
    assert_eq!(store.current(&rid(r)).await.unwrap(), None);
    assert_eq!(
        store
            .compare_and_raise(&rid(r), 5.into(), Allow.into())
            .await
            .unwrap(),
        Verdict::Admitted { previous: None }
    );
    assert_eq!(
        store
            .compare_and_raise(&rid(r), 9.into(), Allow.into())
            .await
            .unwrap(),
        Verdict::Admitted {
            previous: Some(5.into())
        }
    );
    assert_eq!(
        store
            .compare_and_raise(&rid(r), 9.into(), Allow.into())
            .await
            .unwrap(),
        Verdict::Admitted {
            previous: Some(9.into())
        }
    );
    assert_eq!(
        store
            .compare_and_raise(&rid(r), 9.into(), Reject.into())
            .await
            .unwrap(),
        Verdict::Stale { current: 9.into() }
    );
    assert_eq!(
        store
            .compare_and_raise(&rid(r), 8.into(), Allow.into())
            .await
            .unwrap(),
        Verdict::Stale { current: 9.into() }
    );
    assert_eq!(
        store
            .compare_and_raise(&rid(r), 0.into(), Allow.into())
            .await
            .unwrap(),
        Verdict::Stale { current: 9.into() }
    );
    assert_eq!(
        store
            .compare_and_raise(&rid(r), 10.into(), Reject.into())
            .await
            .unwrap(),
        Verdict::Admitted {
            previous: Some(9.into())
        }
    );
    assert_eq!(store.current(&rid(r)).await.unwrap(), Some(10.into()));
    // Zero is a token like any other.
    assert_eq!(
        store
            .compare_and_raise(&rid("zero"), 0.into(), Allow.into())
            .await
            .unwrap(),
        Verdict::Admitted { previous: None }
    );
    assert_eq!(
        store
            .compare_and_raise(&rid("zero"), 0.into(), Reject.into())
            .await
            .unwrap(),
        Verdict::Stale { current: 0.into() }
    );
}

async fn very_large_tokens(store: Arc<dyn FenceStore>) {
    // 2^53 + 1 is where doubles stop counting; 9 vs 10 is where strings stop ordering.
    let two53 = 1u64 << 53;
    assert!(matches!(
        store
            .compare_and_raise(&rid("f"), tk(two53 + 1), Allow.into())
            .await
            .unwrap(),
        Verdict::Admitted { .. }
    ));
    assert_eq!(
        store
            .compare_and_raise(&rid("f"), tk(two53), Allow.into())
            .await
            .unwrap(),
        Verdict::Stale {
            current: tk(two53 + 1)
        }
    );
    assert!(matches!(
        store
            .compare_and_raise(&rid("s"), 9.into(), Allow.into())
            .await
            .unwrap(),
        Verdict::Admitted { .. }
    ));
    assert!(matches!(
        store
            .compare_and_raise(&rid("s"), 10.into(), Allow.into())
            .await
            .unwrap(),
        Verdict::Admitted { .. }
    ));
    assert_eq!(
        store
            .compare_and_raise(&rid("s"), 9.into(), Allow.into())
            .await
            .unwrap(),
        Verdict::Stale { current: 10.into() }
    );
    let max = i64::MAX as u64;
    assert!(matches!(
        store
            .compare_and_raise(&rid("m"), tk(max - 1), Allow.into())
            .await
            .unwrap(),
        Verdict::Admitted { .. }
    ));
    assert_eq!(
        store
            .compare_and_raise(&rid("m"), tk(max), Allow.into())
            .await
            .unwrap(),
        Verdict::Admitted {
            previous: Some(tk(max - 1))
        }
    );
    assert_eq!(
        store
            .compare_and_raise(&rid("m"), tk(max - 1), Allow.into())
            .await
            .unwrap(),
        Verdict::Stale { current: tk(max) }
    );
    assert_eq!(store.current(&rid("m")).await.unwrap(), Some(tk(max)));
}

async fn concurrent_racing(store: Arc<dyn FenceStore>) {
    let mut tasks = Vec::new();
    for w in 0..8u64 {
        let store = Arc::clone(&store);
        tasks.push(tokio::spawn(async move {
            let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (w + 1);
            let mut out = Vec::new();
            for _ in 0..40 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let token = x % 500;
                out.push((
                    token,
                    store
                        .compare_and_raise(&rid("race"), tk(token), Allow.into())
                        .await
                        .unwrap(),
                ));
            }
            out
        }));
    }
    let mut admitted_max = None;
    for t in tasks {
        for (token, verdict) in t.await.unwrap() {
            match verdict {
                Verdict::Admitted { previous } => {
                    assert!(
                        previous.is_none_or(|p| p <= tk(token)),
                        "{token} admitted over {previous:?}"
                    );
                    admitted_max = admitted_max.max(Some(token));
                }
                Verdict::Stale { current } => {
                    assert!(current > tk(token), "{token} refused against {current}")
                }
                Verdict::TooFar { current } => panic!("{token} too far over {current:?}"),
            }
        }
    }
    assert_eq!(
        store.current(&rid("race")).await.unwrap(),
        admitted_max.map(tk)
    );
}

async fn many_resources(store: Arc<dyn FenceStore>) {
    let resources: Vec<String> = (0..300).map(|i| format!("account:{i}")).collect();
    for (i, r) in resources.iter().enumerate() {
        assert!(matches!(
            store
                .compare_and_raise(&rid(r), tk(i as u64), Allow.into())
                .await
                .unwrap(),
            Verdict::Admitted { previous: None }
        ));
    }
    for (i, r) in resources.iter().enumerate() {
        assert_eq!(
            store.current(&rid(r)).await.unwrap(),
            Some(tk(i as u64)),
            "{r}"
        );
    }
    if let Some(i) = (1..300u64).step_by(37).next() {
        assert_eq!(
            store
                .compare_and_raise(&rid(&resources[i as usize]), tk(i - 1), Allow.into())
                .await
                .unwrap(),
            Verdict::Stale { current: tk(i) }
        );
    }
    assert!(store.healthy());
}

/// 200 raises at once, of one held resource (stale and equal tokens), one climbing resource
/// (racing tokens) and fresh ones: each answered as it would be alone, however the store
/// groups them.
async fn concurrent_mixed(store: Arc<dyn FenceStore>) {
    assert_eq!(
        store
            .compare_and_raise(&rid("held"), tk(10), Allow.into())
            .await
            .unwrap(),
        Verdict::Admitted { previous: None }
    );
    let mut tasks = Vec::new();
    for i in 0..200u64 {
        let store = Arc::clone(&store);
        tasks.push(tokio::spawn(async move {
            let (resource, token) = match i % 5 {
                0 => ("held".to_owned(), 5),
                1 => ("held".to_owned(), 10),
                2 => ("climb".to_owned(), i),
                _ => (format!("fresh{i}"), i + 1),
            };
            let verdict = store
                .compare_and_raise(&rid(&resource), tk(token), Allow.into())
                .await
                .unwrap();
            (i, token, verdict)
        }));
    }
    let mut climbed = None;
    for t in tasks {
        let (i, token, verdict) = t.await.unwrap();
        match (i % 5, verdict) {
            (0, v) => assert_eq!(v, Verdict::Stale { current: tk(10) }, "raise {i}"),
            (1, v) => assert_eq!(
                v,
                Verdict::Admitted {
                    previous: Some(tk(10))
                },
                "raise {i}"
            ),
            (2, Verdict::Admitted { previous }) => {
                assert!(previous.is_none_or(|p| p < tk(token)), "raise {i}");
                climbed = climbed.max(Some(token));
            }
            (2, Verdict::Stale { current }) => assert!(current > tk(token), "raise {i}"),
            (_, v) => assert_eq!(v, Verdict::Admitted { previous: None }, "raise {i}"),
        }
    }
    assert_eq!(climbed, Some(197), "the highest climbing token is admitted");
    assert_eq!(store.current(&rid("held")).await.unwrap(), Some(tk(10)));
    assert_eq!(store.current(&rid("climb")).await.unwrap(), Some(tk(197)));
    assert_eq!(
        store.current(&rid("fresh199")).await.unwrap(),
        Some(tk(200))
    );
}

/// 150 raises of fresh resources (`{name}0` to `{name}149`) at once on `store`.
async fn raise_fresh_at_once(store: &Arc<dyn FenceStore>, name: &'static str) {
    let mut tasks = Vec::new();
    for i in 0..150u64 {
        let store = Arc::clone(store);
        tasks.push(tokio::spawn(async move {
            store
                .compare_and_raise(&rid(&format!("{name}{i}")), tk(i + 1), Allow.into())
                .await
                .unwrap()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), Verdict::Admitted { previous: None });
    }
    assert_eq!(
        store.current(&rid(&format!("{name}149"))).await.unwrap(),
        Some(tk(150))
    );
}

/// Concurrent raises share PostgreSQL statements, and so commits: the 150 rows of 150 raises
/// at once were written by far fewer than 150 transactions (each row's `xmin`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_concurrent_raises_share_commits() {
    let prefix = fresh_prefix();
    let store = store::open(&postgres_config(&prefix).store).await.unwrap();
    raise_fresh_at_once(&store, "fresh").await;
    let admin = postgres_admin().await;
    let row = admin
        .query_one(
            &format!("SELECT count(*), count(DISTINCT xmin::text) FROM {prefix}_fences"),
            &[],
        )
        .await
        .unwrap();
    let (rows, transactions): (i64, i64) = (row.get(0), row.get(1));
    assert_eq!(rows, 150);
    assert!(
        transactions < 100,
        "150 concurrent raises took {transactions} transactions"
    );
    admin
        .batch_execute(&format!(
            "DROP TABLE IF EXISTS {prefix}_fences, {prefix}_idempotency, {prefix}_retention"
        ))
        .await
        .unwrap();
}

/// A raise PostgreSQL refuses (a resource id too long for its index) fails alone: the raises
/// that shared its statement are sent again each alone and answered as if it had not been
/// there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_raise_the_server_refuses_fails_alone() {
    let prefix = fresh_prefix();
    let store = store::open(&postgres_config(&prefix).store).await.unwrap();
    // 9,000 letters that do not compress below the index's limit of about 2,700 bytes.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let long: String = (0..9000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(b'a' + (x % 26) as u8)
        })
        .collect();
    let mut tasks = Vec::new();
    for i in 0..150u64 {
        let store = Arc::clone(&store);
        let resource = if i == 100 {
            long.clone()
        } else {
            format!("fresh{i}")
        };
        tasks.push(tokio::spawn(async move {
            let answer = store
                .compare_and_raise(&rid(&resource), tk(i + 1), Allow.into())
                .await;
            (i, answer)
        }));
    }
    for t in tasks {
        match t.await.unwrap() {
            (100, answer) => assert!(answer.is_err(), "{answer:?}"),
            (i, answer) => assert_eq!(
                answer.unwrap(),
                Verdict::Admitted { previous: None },
                "raise {i}"
            ),
        }
    }
    postgres_admin()
        .await
        .batch_execute(&format!(
            "DROP TABLE IF EXISTS {prefix}_fences, {prefix}_idempotency, {prefix}_retention"
        ))
        .await
        .unwrap();
}

/// Concurrent raises share etcd transactions: the 150 keys of 150 raises at once were written
/// at far fewer than 150 revisions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_concurrent_raises_share_transactions() {
    let dir = tempfile::tempdir().unwrap();
    let (yaml, etcd) = store_yaml("etcd", &dir).await;
    let etcd = etcd.unwrap();
    let config = Config::parse(&format!("upstream: http://127.0.0.1:1\n{yaml}")).unwrap();
    let store = store::open(&config.store).await.unwrap();
    raise_fresh_at_once(&store, "fresh").await;
    let out = tokio::process::Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints=http://127.0.0.1:{}", etcd.port))
        .args(["get", "/", "--prefix", "-w", "json"])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let kvs = json["kvs"].as_array().unwrap();
    let fences: Vec<_> = kvs
        .iter()
        .filter(|kv| {
            use base64::Engine;
            let key = base64::engine::general_purpose::STANDARD
                .decode(kv["key"].as_str().unwrap())
                .unwrap();
            String::from_utf8(key).unwrap().contains("/fences/fresh")
        })
        .collect();
    assert_eq!(fences.len(), 150);
    let revisions: std::collections::HashSet<i64> = fences
        .iter()
        .map(|kv| kv["mod_revision"].as_i64().unwrap())
        .collect();
    assert!(
        revisions.len() < 100,
        "150 concurrent raises took {} transactions",
        revisions.len()
    );
}

/// How many transactions an etcd refused as too large: `grpc_server_handled_total` of `Txn`
/// with code `InvalidArgument`, from its `/metrics`.
async fn etcd_txns_refused(port: u16) -> u64 {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let text = raw(
        addr,
        b"GET /metrics HTTP/1.1\r\nHost: etcd\r\nConnection: close\r\n\r\n",
    )
    .await;
    text.lines()
        .filter(|l| l.starts_with("grpc_server_handled_total{"))
        .filter(|l| {
            l.contains("grpc_code=\"InvalidArgument\"") && l.contains("grpc_method=\"Txn\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// An etcd that takes fewer operations in a transaction than a batch holds (`--max-txn-ops
/// 8`): the batches it refuses are raised one transaction each, and so is every raise after
/// the first refusal; every raise is answered as alone, none refused. etcd refused only the
/// batches under way when the first refusal came back (at most the queue's four calls),
/// however many raises followed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_refusing_large_transactions_gets_raises_one_by_one() {
    let etcd = Service::start_etcd_with(&["--max-txn-ops", "8"]).await;
    let config = Config::parse(&format!(
        "upstream: http://127.0.0.1:1\nstore: {{ kind: etcd, url: '{}', prefix: {} }}\n",
        etcd.url(),
        fresh_prefix()
    ))
    .unwrap();
    let store = store::open(&config.store).await.unwrap();
    raise_fresh_at_once(&store, "fresh").await;
    raise_fresh_at_once(&store, "again").await;
    let refused = etcd_txns_refused(etcd.port).await;
    assert!(
        (1..=4).contains(&refused),
        "etcd refused {refused} transactions"
    );
}

macro_rules! conformance {
    ($($kind:ident),*) => {$(
        mod $kind {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn raise_equal_stale() { let (s, _g, _d) = open(stringify!($kind)).await; super::raise_equal_stale(s).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn very_large_tokens() { let (s, _g, _d) = open(stringify!($kind)).await; super::very_large_tokens(s).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_racing() { let (s, _g, _d) = open(stringify!($kind)).await; super::concurrent_racing(s).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn many_resources() { let (s, _g, _d) = open(stringify!($kind)).await; super::many_resources(s).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_mixed() { let (s, _g, _d) = open(stringify!($kind)).await; super::concurrent_mixed(s).await }
        }
    )*};
}

conformance!(memory, embedded, redis, postgres, etcd);

/// Two real fencegate processes sharing one store: a token seen by one fences the other.
async fn two_replicas(kind: &str) {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (yaml, _service) = store_yaml(kind, &dir).await;
    let config = |name: &str| {
        let path = dir.path().join(name);
        std::fs::write(
            &path,
            format!(
                "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: {}\n{yaml}{ACCOUNTS}",
                up.url()
            ),
        )
        .unwrap();
        path
    };
    let a = Process::start(&config("a.yaml")).await;
    let b = Process::start(&config("b.yaml")).await;

    assert_eq!(put_to(a.proxy, "1", "6").await.status, 200);
    let refused = put_to(b.proxy, "1", "5").await;
    refused.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(refused.headers["fencing-token-current"], "6");
    // The other direction, past a cached maximum: A has 6 cached, but B raised to 7.
    assert_eq!(put_to(b.proxy, "1", "7").await.status, 200);
    let refused = put_to(a.proxy, "1", "6").await;
    refused.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(refused.headers["fencing-token-current"], "7");
    let tokens: Vec<_> = up.seen().iter().map(|s| s.token()).collect();
    assert_eq!(tokens, [Some(6), Some(7)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_redis() {
    two_replicas("redis").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_postgres() {
    two_replicas("postgres").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_etcd() {
    two_replicas("etcd").await
}

async fn ready(admin: std::net::SocketAddr) -> u16 {
    send("GET", &format!("http://{admin}/readyz"), &[], "")
        .await
        .status
        .as_u16()
}

/// Waits (polling the readiness endpoint, the signal operators use) for `want`.
async fn wait_ready(admin: std::net::SocketAddr, want: u16) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while ready(admin).await != want {
        assert!(Instant::now() < deadline, "readiness never became {want}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The store dies mid-test: writes are refused with 503 (never forwarded); it comes back:
/// writes flow again, same fencegate, no restart.
async fn store_killed_and_back(kind: Kind) {
    let up = Upstream::start().await;
    let mut service = Service::start(kind).await;
    let kind_name = match kind {
        Kind::Redis => "redis",
        Kind::Postgres => "postgres",
        Kind::Etcd => "etcd",
    };
    let fg = fencegate(
        &up.url(),
        &format!(
            "store: {{ kind: {kind_name}, url: '{}', prefix: {} }}\n{ACCOUNTS}",
            service.url(),
            fresh_prefix()
        ),
    )
    .await;
    wait_ready(fg.admin, 200).await;
    assert_eq!(put(&fg, "1", "10").await.status, 200);

    service.kill().await;
    for token in ["11", "12", "13"] {
        let reply = put(&fg, "1", token).await;
        reply.assert_problem(503, "urn:fencegate:store-unavailable");
        assert_eq!(reply.headers["retry-after"], "1");
    }
    // A token below a maximum seen before is still refused from the local cache.
    put(&fg, "1", "9")
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
    wait_ready(fg.admin, 503).await;
    assert_eq!(
        up.count(),
        1,
        "a write was forwarded while the store was down"
    );

    service.restart().await;
    wait_ready(fg.admin, 200).await;
    assert_eq!(put(&fg, "1", "14").await.status, 200);
    assert_eq!(recorded(&fg, "account:1").await, Some(14));
    assert_eq!(up.count(), 2);
    let metrics = send("GET", &format!("http://{}/metrics", fg.admin), &[], "")
        .await
        .text();
    // The three refused writes, by what the store did (a refused connection, a timeout).
    let errors: Vec<(&str, u64)> = metrics
        .lines()
        .filter_map(|l| l.strip_prefix("fencegate_store_errors_total{cause=\""))
        .filter_map(|l| l.split_once("\",source=\"store\"} "))
        .map(|(cause, n)| (cause, n.parse().unwrap()))
        .collect();
    assert_eq!(errors.iter().map(|(_, n)| n).sum::<u64>(), 3, "{metrics}");
    for (cause, _) in &errors {
        assert!(["unreachable", "timeout"].contains(cause), "{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_back() {
    store_killed_and_back(Kind::Redis).await
}

/// A TCP proxy to `127.0.0.1:to` that can drop its path silently, as a vanished host or a
/// dead network path does: [`Silent::cut`] stops forwarding on every open connection (they
/// stay open, nothing is answered) and on those accepted until [`Silent::restore`].
struct Silent {
    port: u16,
    /// (cuts so far, cut now): a connection forwards while neither changed since its accept.
    state: tokio::sync::watch::Sender<(u64, bool)>,
}

impl Silent {
    async fn start(to: u16) -> Silent {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (state, _) = tokio::sync::watch::channel((0, false));
        let states = state.clone();
        tokio::spawn(async move {
            loop {
                let (mut client, _) = listener.accept().await.unwrap();
                let mut state = states.subscribe();
                let (cuts, cut) = *state.borrow_and_update();
                tokio::spawn(async move {
                    let mut server = tokio::net::TcpStream::connect(("127.0.0.1", to))
                        .await
                        .unwrap();
                    if !cut {
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut client, &mut server) => return,
                            _ = state.wait_for(|&(n, _)| n != cuts) => {}
                        }
                    }
                    // Silent: both sockets held open, nothing read or written.
                    std::future::pending::<()>().await;
                    drop((client, server));
                });
            }
        });
        Silent { port, state }
    }

    fn cut(&self) {
        self.state
            .send_modify(|(n, cut)| (*n, *cut) = (*n + 1, true));
    }

    fn restore(&self) {
        self.state.send_modify(|(_, cut)| *cut = false);
    }
}

/// The path to Redis goes silent (its connection stays open, nothing answers): readiness
/// goes 503; once a path to Redis works again, fencegate drops the silent connection for a
/// new one and is ready again, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_connection_gone_silent_is_replaced() {
    let up = Upstream::start().await;
    let path = Silent::start(6379).await;
    let fg = fencegate(
        &up.url(),
        &format!(
            "store: {{ kind: redis, url: 'redis://127.0.0.1:{}/', prefix: {} }}\n{ACCOUNTS}",
            path.port,
            fresh_prefix()
        ),
    )
    .await;
    wait_ready(fg.admin, 200).await;
    assert_eq!(put(&fg, "1", "10").await.status, 200);

    path.cut();
    wait_ready(fg.admin, 503).await;
    path.restore();
    wait_ready(fg.admin, 200).await;
    assert_eq!(put(&fg, "1", "11").await.status, 200);
    assert_eq!(up.count(), 2);
}

/// `redis-cli` against `port`: its output.
async fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = tokio::process::Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// Connections the server accepted so far (this look included).
async fn redis_connections(port: u16) -> u64 {
    let info = redis_cli(port, &["INFO", "stats"]).await;
    info.lines()
        .find_map(|l| l.strip_prefix("total_connections_received:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// The server fencegate is connected to becomes a replica (a failover that keeps the old
/// primary's connections open): the write it refuses `READONLY` makes fencegate dial anew,
/// so that its next command reaches whatever the url names now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_readonly_reply_makes_a_new_connection() {
    let service = Service::start(Kind::Redis).await;
    let config = Config::parse(&format!(
        "upstream: http://127.0.0.1:1\nstore: {{ kind: redis, url: '{}', prefix: {} }}\n",
        service.url(),
        fresh_prefix()
    ))
    .unwrap();
    let store = store::open(&config.store).await.unwrap();
    assert!(store
        .compare_and_raise(&rid("r"), 1.into(), Allow.into())
        .await
        .is_ok());
    let before = redis_connections(service.port).await;

    // A replica of nothing that answers: read-only at once.
    redis_cli(service.port, &["REPLICAOF", "127.0.0.1", "1"]).await;
    let refused = store
        .compare_and_raise(&rid("r"), 2.into(), Allow.into())
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("read only replica"),
        "{refused}"
    );
    redis_cli(service.port, &["REPLICAOF", "NO", "ONE"]).await;
    assert_eq!(
        store
            .compare_and_raise(&rid("r"), 2.into(), Allow.into())
            .await
            .unwrap(),
        Verdict::Admitted {
            previous: Some(1.into())
        }
    );
    // Three looks by redis-cli, and fencegate's new connection.
    assert_eq!(redis_connections(service.port).await - before, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_killed_and_back() {
    store_killed_and_back(Kind::Postgres).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_killed_and_back() {
    store_killed_and_back(Kind::Etcd).await
}

/// Sidecars that start together on a new prefix all create the tables at their first write:
/// none of them fails on the others' `CREATE … IF NOT EXISTS` (a unique violation on the
/// catalog when they race), which would answer its first writes 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_stores_starting_together_all_create_their_tables() {
    let yaml = format!(
        "upstream: http://127.0.0.1:1\nstore: {{ kind: postgres, url: '{POSTGRES_URL}', prefix: {} }}\n",
        fresh_prefix()
    );
    let config = Config::parse(&yaml).unwrap();
    let mut stores = Vec::new();
    for _ in 0..8 {
        stores.push(store::open(&config.store).await.unwrap());
    }
    let barrier = Arc::new(tokio::sync::Barrier::new(stores.len()));
    let firsts: Vec<_> = stores
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let (s, barrier) = (Arc::clone(s), Arc::clone(&barrier));
            tokio::spawn(async move {
                barrier.wait().await;
                s.compare_and_raise(&rid(&format!("r{i}")), 1.into(), Allow.into())
                    .await
            })
        })
        .collect();
    for (i, first) in firsts.into_iter().enumerate() {
        assert_eq!(
            first.await.unwrap().unwrap(),
            Verdict::Admitted { previous: None },
            "store {i}"
        );
    }
}

async fn postgres_admin() -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(POSTGRES_URL, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
}

fn postgres_config(prefix: &str) -> Config {
    Config::parse(&format!(
        "upstream: http://127.0.0.1:1\nstore: {{ kind: postgres, url: '{POSTGRES_URL}', prefix: {prefix} }}\n"
    ))
    .unwrap()
}

/// A store starting on tables that exist checks its columns and index without locking the
/// tables: a claim elsewhere holds the records' lock and then asks for the maxima's, so a
/// start-up that altered the maxima table in between deadlocked with it (PostgreSQL aborted
/// one of them). Here another session holds both tables' row-exclusive locks (what every
/// write takes) while a second store starts and writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_starts_without_locking_existing_tables() {
    let prefix = fresh_prefix();
    let config = postgres_config(&prefix);
    let first = store::open(&config.store).await.unwrap();
    assert_eq!(
        first
            .compare_and_raise(&rid("a"), 1.into(), Allow.into())
            .await
            .unwrap(),
        Verdict::Admitted { previous: None }
    );
    let admin = postgres_admin().await;
    admin
        .batch_execute(&format!(
            "BEGIN; LOCK TABLE {prefix}_fences IN ROW EXCLUSIVE MODE; \
             LOCK TABLE {prefix}_idempotency IN ROW EXCLUSIVE MODE"
        ))
        .await
        .unwrap();
    let second = store::open(&config.store).await.unwrap();
    let raised = tokio::time::timeout(
        Duration::from_secs(10),
        second.compare_and_raise(&rid("b"), 1.into(), Allow.into()),
    )
    .await
    .expect("the second store's start-up waited for the held locks");
    assert_eq!(raised.unwrap(), Verdict::Admitted { previous: None });
    admin.batch_execute("ROLLBACK").await.unwrap();
}

/// A failed table set-up does not leave its connection inside the failed transaction: once
/// the cause is gone, the next write succeeds (it used to fail with 25P02, "current transaction
/// is aborted", on every connection the failed set-up had used).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_table_setup_recovers_after_a_failure() {
    let prefix = fresh_prefix();
    let admin = postgres_admin().await;
    // A records table without `expires_at`: creating its index fails.
    admin
        .batch_execute(&format!(
            "CREATE TABLE {prefix}_idempotency (resource TEXT)"
        ))
        .await
        .unwrap();
    let store = store::open(&postgres_config(&prefix).store).await.unwrap();
    for _ in 0..3 {
        let failed = store
            .compare_and_raise(&rid("a"), 1.into(), Allow.into())
            .await
            .unwrap_err();
        assert_eq!(
            failed.to_string(),
            "the fence store is unavailable: postgres: creating the tables: column \"expires_at\" \
             does not exist (42703)"
        );
    }
    admin
        .batch_execute(&format!("DROP TABLE {prefix}_idempotency"))
        .await
        .unwrap();
    for r in ["a", "b", "c", "d"] {
        assert_eq!(
            store
                .compare_and_raise(&rid(r), 1.into(), Allow.into())
                .await
                .unwrap(),
            Verdict::Admitted { previous: None },
            "{r}"
        );
    }
}

/// The embedded store keeps only `cache_size` maxima in memory: a resource written before a
/// restart (a `kill -9` and a graceful one), and pushed out of the cache by others since, is
/// read from the file and its stale token still refused.
#[tokio::test]
async fn embedded_refuses_a_stale_token_for_a_resource_out_of_the_cache_after_restarts() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fencegate.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: {}\n\
             store: {{ kind: embedded, path: {}, cache_size: 2 }}\n{ACCOUNTS}",
            up.url(),
            dir.path().join("fences.db").display()
        ),
    )
    .unwrap();
    let others = |p: &Process, token: &'static str| {
        let proxy = p.proxy;
        async move {
            for id in 100..110 {
                assert_eq!(put_to(proxy, &id.to_string(), token).await.status, 200);
            }
        }
    };
    let stale = |p: &Process| {
        let proxy = p.proxy;
        async move {
            let reply = put_to(proxy, "1", "41").await;
            reply.assert_problem(409, "urn:fencegate:stale-token");
            assert_eq!(reply.headers["fencing-token-current"], "42");
        }
    };

    let mut first = Process::start(&config).await;
    assert_eq!(put_to(first.proxy, "1", "42").await.status, 200);
    others(&first, "1").await;
    stale(&first).await;
    first.child.start_kill().unwrap();
    first.child.wait().await.unwrap();

    let second = Process::start(&config).await;
    others(&second, "2").await;
    stale(&second).await;
    second.signal("-TERM");
    let mut second = second;
    assert!(second.child.wait().await.unwrap().success());

    let third = Process::start(&config).await;
    others(&third, "3").await;
    stale(&third).await;
    // A repeat of the maximum, read from the file, is admitted.
    assert_eq!(put_to(third.proxy, "1", "42").await.status, 200);
    // 1 + 10 others in each of three processes, the repeat; no stale write.
    let tokens: Vec<_> = up.seen().iter().map(|s| s.token()).collect();
    assert_eq!(tokens.len(), 32);
    assert_eq!(tokens.iter().filter(|t| **t == Some(41)).count(), 0);
}
