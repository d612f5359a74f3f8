//! Microbenchmarks of the pure per-request work on fencegate's hot path.
//!
//! `cargo bench --bench hot_path` (about a minute: 1 s warm-up + 1 s measurement per bench).
//! The end-to-end comparison with nginx and haproxy is `bench/run`; this isolates the parts
//! fencegate adds on top of plain proxying: token parse, path normalise, route match and the
//! compare-and-raise on the memory store.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use fencegate::config::{Config, EqualTokens};
use fencegate::fence::path::normalise;
use fencegate::fence::routes::RouteTable;
use fencegate::fence::token::{parse_token, token_from_headers};
use fencegate::fence::Token;
use fencegate::store::MemoryStore;
use http::{HeaderMap, HeaderName, HeaderValue, Method};

/// The same routes `bench/run` gives the proxy, plus a few more so matching is not trivial.
const CONFIG: &str = r#"
upstream: http://127.0.0.1:1
routes:
  - name: accounts
    path: /accounts/{id}
    resource: "account:{id}"
  - name: ledgers
    path: /ledgers/{*rest}
    resource: "ledger:{rest}"
  - name: orders
    path: /tenants/{tenant}/orders/{id}
    methods: [POST, PUT]
    resource: "order:{tenant}:{id}"
  - name: health
    path: /healthz
    fence: false
unmatched: forward
token:
  equal: allow
"#;

fn token(c: &mut Criterion) {
    let mut g = c.benchmark_group("token");
    g.bench_function("parse_token/7_digits", |b| {
        b.iter(|| parse_token(black_box(b"1234567")))
    });
    g.bench_function("parse_token/19_digits", |b| {
        b.iter(|| parse_token(black_box(b"9223372036854775807")))
    });
    // What the proxy actually calls: hygiene checks over a realistic header map, then parse.
    let name = HeaderName::from_static("fencing-token");
    let mut headers = HeaderMap::new();
    for (k, v) in [
        ("host", "127.0.0.1:7440"),
        ("user-agent", "wrk"),
        ("content-type", "application/json"),
        ("content-length", "16"),
        ("fencing-token", "1234567"),
    ] {
        headers.insert(k, HeaderValue::from_static(v));
    }
    g.bench_function("token_from_headers/5_headers", |b| {
        b.iter(|| token_from_headers(black_box(&headers), &name))
    });
    g.finish();
}

fn path(c: &mut Criterion) {
    let mut g = c.benchmark_group("normalise");
    g.bench_function("already_normal", |b| {
        b.iter(|| normalise(black_box("/accounts/12345")).map(|p| p.len()))
    });
    g.bench_function("needs_work", |b| {
        b.iter(|| {
            normalise(black_box("/a/./b//../%61ccounts/%7euser/%c3%a9/12345/")).map(|p| p.len())
        })
    });
    g.finish();
}

fn routes(c: &mut Criterion) {
    let config = Config::parse(CONFIG).expect("bench config parses");
    let table = RouteTable::new(
        &config.routes,
        config.unmatched,
        config.limits.max_resource_bytes,
    );
    let headers = HeaderMap::new();
    let mut g = c.benchmark_group("route_lookup");
    g.bench_function("fenced_put", |b| {
        b.iter(|| {
            let m = table.lookup(
                &Method::PUT,
                black_box("/accounts/12345"),
                None,
                None,
                &headers,
            );
            black_box(m.is_ok())
        })
    });
    g.bench_function("get_pass", |b| {
        b.iter(|| {
            let m = table.lookup(
                &Method::GET,
                black_box("/accounts/12345"),
                None,
                None,
                &headers,
            );
            black_box(m.is_ok())
        })
    });
    g.bench_function("unmatched", |b| {
        b.iter(|| {
            let m = table.lookup(
                &Method::GET,
                black_box("/static/app.js"),
                None,
                None,
                &headers,
            );
            black_box(m.is_ok())
        })
    });
    g.finish();
}

fn store(c: &mut Criterion) {
    let mut g = c.benchmark_group("memory_store_raise");
    // 10,000 resources, cycled with an increasing token: every call raises an existing entry,
    // as in bench/run's fenced PUT workload.
    let store = MemoryStore::new();
    let names: Vec<String> = (0..10_000).map(|i| format!("account:{i}")).collect();
    for n in &names {
        store.raise(n, 0.into(), EqualTokens::Allow.into());
    }
    let mut next = 1u64;
    g.bench_function("raise_existing_10k", |b| {
        b.iter(|| {
            let i = (next % 10_000) as usize;
            next += 1;
            let token = Token::new(next).expect("far below 2^63");
            store.raise(black_box(&names[i]), token, EqualTokens::Allow.into())
        })
    });
    g.bench_function("stale_existing_10k", |b| {
        b.iter(|| store.raise(black_box(&names[42]), 0.into(), EqualTokens::Allow.into()))
    });
    // First sight of a resource: the insert path (allocates the key).
    g.bench_function("insert_new_x1000", |b| {
        b.iter_batched(
            || (MemoryStore::new(), names[..1000].to_vec()),
            |(s, keys)| {
                for k in &keys {
                    s.raise(k, 1.into(), EqualTokens::Allow.into());
                }
                s
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(1))
        .sample_size(50)
}

criterion_group! {
    name = hot_path;
    config = config();
    targets = token, path, routes, store
}
criterion_main!(hot_path);
