//! Store latency: an admitted write (a new maximum, which must reach the store and, for the
//! durable stores, its disk) and a cached refusal (answered from the local cache), for every
//! store kind, measured through the `FenceStore` API in one run.
//!
//! `cargo bench --bench stores` (needs Redis on 6379, PostgreSQL on 5432 and an `etcd`
//! binary; `.ci/run` sets those up). Override with FENCEGATE_BENCH_REDIS / _POSTGRES.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate::config::{Config, EqualTokens};
use fencegate::fence::{ResourceId, Token};
use fencegate::store::{self, FenceStore, Verdict};

const SEQUENTIAL: usize = 2000;
const CONCURRENT_TASKS: usize = 32;
const CONCURRENT_OPS: usize = 200;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn us(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e6)
}

struct Row {
    kind: &'static str,
    admit_p50: Duration,
    admit_p99: Duration,
    refuse_p50: Duration,
    refuse_p99: Duration,
    concurrent_ops: f64,
}

async fn measure(kind: &'static str, store: Arc<dyn FenceStore>) -> Row {
    // Warm up connections and prepared statements.
    for i in 0..50u32 {
        store
            .compare_and_raise(
                &rid(&format!("warm{i}")),
                Token::from(i),
                EqualTokens::Allow.into(),
            )
            .await
            .unwrap();
    }
    let mut admit = Vec::with_capacity(SEQUENTIAL);
    for i in 0..SEQUENTIAL {
        let resource = format!("account:{i}");
        let started = Instant::now();
        let verdict = store
            .compare_and_raise(&rid(&resource), 7.into(), EqualTokens::Allow.into())
            .await
            .unwrap();
        admit.push(started.elapsed());
        assert_eq!(verdict, Verdict::Admitted { previous: None });
    }
    store
        .compare_and_raise(&rid("hot"), 1000.into(), EqualTokens::Allow.into())
        .await
        .unwrap();
    let mut refuse = Vec::with_capacity(SEQUENTIAL);
    for _ in 0..SEQUENTIAL {
        let started = Instant::now();
        let verdict = store
            .compare_and_raise(&rid("hot"), 1.into(), EqualTokens::Allow.into())
            .await
            .unwrap();
        refuse.push(started.elapsed());
        assert_eq!(
            verdict,
            Verdict::Stale {
                current: 1000.into()
            }
        );
    }
    // Concurrent admitted writes: what group commit and connection pools buy.
    let started = Instant::now();
    let tasks: Vec<_> = (0..CONCURRENT_TASKS)
        .map(|t| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                for i in 0..CONCURRENT_OPS {
                    let resource = format!("c{t}:{i}");
                    store
                        .compare_and_raise(&rid(&resource), 1.into(), EqualTokens::Allow.into())
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let concurrent_ops =
        (CONCURRENT_TASKS * CONCURRENT_OPS) as f64 / started.elapsed().as_secs_f64();
    admit.sort();
    refuse.sort();
    Row {
        kind,
        admit_p50: percentile(&admit, 0.5),
        admit_p99: percentile(&admit, 0.99),
        refuse_p50: percentile(&refuse, 0.5),
        refuse_p99: percentile(&refuse, 0.99),
        concurrent_ops,
    }
}

fn prefix() -> String {
    format!("bench_{}", std::process::id())
}

async fn open(yaml: &str) -> Arc<dyn FenceStore> {
    let config = Config::parse(&format!("upstream: http://127.0.0.1:1\n{yaml}")).unwrap();
    let store = store::open(&config.store).await.unwrap();
    store
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let dir = tempfile::tempdir().unwrap();
    let redis = std::env::var("FENCEGATE_BENCH_REDIS").unwrap_or("redis://127.0.0.1:6379/".into());
    let postgres = std::env::var("FENCEGATE_BENCH_POSTGRES")
        .unwrap_or("postgres://postgres@127.0.0.1:5432/postgres".into());
    let p = prefix();

    // A throwaway single-node etcd with default durability (fsync on every commit).
    let (etcd_port, peer) = (free_port(), free_port());
    let mut etcd = std::process::Command::new("etcd")
        .arg("--data-dir")
        .arg(dir.path().join("etcd"))
        .args([
            "--listen-client-urls",
            &format!("http://127.0.0.1:{etcd_port}"),
            "--advertise-client-urls",
            &format!("http://127.0.0.1:{etcd_port}"),
            "--listen-peer-urls",
            &format!("http://127.0.0.1:{peer}"),
            "--initial-advertise-peer-urls",
            &format!("http://127.0.0.1:{peer}"),
            "--initial-cluster",
            &format!("default=http://127.0.0.1:{peer}"),
            "--log-level",
            "error",
        ])
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("etcd binary");

    let mut rows = Vec::new();
    rows.push(measure("memory", open("store: { kind: memory }").await).await);
    rows.push(
        measure(
            "embedded",
            open(&format!(
                "store: {{ kind: embedded, path: {} }}",
                dir.path().join("f.db").display()
            ))
            .await,
        )
        .await,
    );
    rows.push(
        measure(
            "redis",
            open(&format!(
                "store: {{ kind: redis, url: '{redis}', prefix: {p} }}"
            ))
            .await,
        )
        .await,
    );
    rows.push(
        measure(
            "postgres",
            open(&format!(
                "store: {{ kind: postgres, url: '{postgres}', prefix: {p} }}"
            ))
            .await,
        )
        .await,
    );
    let etcd_store = open(&format!(
        "store: {{ kind: etcd, url: 'etcd://127.0.0.1:{etcd_port}', prefix: {p} }}"
    ))
    .await;
    // The etcd client connects lazily; wait for the server to answer.
    let deadline = Instant::now() + Duration::from_secs(30);
    while etcd_store.current(&rid("ready")).await.is_err() {
        assert!(Instant::now() < deadline, "etcd did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    rows.push(measure("etcd", etcd_store).await);
    let _ = etcd.kill();
    let _ = etcd.wait();

    println!("| store | admitted write p50 | p99 | cached refusal p50 | p99 | admitted writes/s, {CONCURRENT_TASKS} concurrent |");
    println!("|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} µs | {} µs | {} µs | {} µs | {:.0} |",
            r.kind,
            us(r.admit_p50),
            us(r.admit_p99),
            us(r.refuse_p50),
            us(r.refuse_p99),
            r.concurrent_ops
        );
    }
    // Leave the shared servers as they were.
    if let Ok(client) = redis::Client::open(redis.as_str()) {
        if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(format!("{p}:*"))
                .query_async(&mut conn)
                .await
                .unwrap_or_default();
            for chunk in keys.chunks(500) {
                let _: Result<(), _> = redis::cmd("DEL").arg(chunk).query_async(&mut conn).await;
            }
        }
    }
    if let Ok((client, conn)) = tokio_postgres::connect(&postgres, tokio_postgres::NoTls).await {
        tokio::spawn(conn);
        let _ = client
            .batch_execute(&format!("DROP TABLE IF EXISTS {p}_fences"))
            .await;
    }
}

/// `id` as a resource id (the benchmark's ids are valid).
fn rid(id: &str) -> ResourceId {
    ResourceId::new(id).expect("a benchmark resource id is valid")
}
