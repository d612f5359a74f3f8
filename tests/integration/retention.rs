//! `fence.retention`: maxima forgotten after the period, on the stores that offer it, and a
//! stale token still refused once its resource's maximum is forgotten, because the config
//! allows retention only with `fence.authority: leases`. The negative control shows what the
//! load-time refusal prevents: in observed fencing a forgotten maximum admits the stale token.
//!
//! Then the moves between configurations on one store (the embedded store's are its unit
//! tests): a run without retention, after or beside one with it, keeps every maximum that
//! run aged (Redis: no expiry left; PostgreSQL: no `raised_at` left), and `token.equal:
//! reject` is refused with retention.

use crate::common::rid;
use crate::common::tk;
use fencegate::fence::Token;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fencegate::config::{Config, EqualTokens};
use fencegate::store::retention::{CHECK_EVERY, QUIET};
use fencegate::store::shared::Clock;
use fencegate::store::{self, FenceStore, Verdict};

use crate::authority::{grant, hand_over};
use crate::common::*;
use crate::idempotency_stores::step_redis_clock;
use crate::services::*;

const HOUR: Duration = Duration::from_secs(3600);

async fn redis() -> ::redis::aio::MultiplexedConnection {
    let client = ::redis::Client::open(REDIS_URL).unwrap();
    client.get_multiplexed_async_connection().await.unwrap()
}

async fn pttl(key: &str) -> i64 {
    ::redis::cmd("PTTL")
        .arg(key)
        .query_async(&mut redis().await)
        .await
        .unwrap()
}

/// A fencegate config on Redis (store and lease backend, under `prefix`), authoritative, with
/// `retention` if given.
fn on_redis(prefix: &str, fence: &str) -> String {
    format!(
        "store: {{ kind: redis, url: '{REDIS_URL}', prefix: {prefix} }}\nfence: {fence}\n\
         leases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: redis, url: '{REDIS_URL}', prefix: {prefix}l }}\n  \
         ttl: 5s\n{ACCOUNTS}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgotten_maximum_still_refuses_a_stale_token_with_authority() {
    let up = Upstream::start().await;
    let prefix = fresh_prefix();
    let yaml = on_redis(&prefix, "{ authority: leases, retention: 1h }");
    let fg = fencegate(&up.url(), &yaml).await;
    let t1 = grant(&fg, "worker-1").await;
    assert_eq!(put(&fg, "42", &t1.to_string()).await.status, 200);
    let t2 = hand_over(&fg, "worker-2").await;
    assert_eq!(put(&fg, "42", &t2.to_string()).await.status, 200);
    // The maximum lives an hour from its raise.
    let key = format!("{prefix}:{{account:42}}:max");
    let left = pttl(&key).await;
    assert!(left > 3_500_000 && left <= 3_600_000, "PTTL {left}");

    // Two hours on, Redis has forgotten it; a fencegate that has not cached it (a replica, or
    // this one after a restart) meets worker-1 waking up with its old token.
    step_redis_clock(&prefix, 2 * HOUR).await;
    assert_eq!(pttl(&key).await, -2, "the maximum is gone");
    let replica = fencegate(&up.url(), &yaml).await;
    let reply = put(&replica, "42", &t1.to_string()).await;
    let body = reply.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(body["token"], t1);
    assert_eq!(body["current_token"], t2);
    assert_eq!(
        reply.headers["fencing-token-current"],
        t2.to_string().as_str()
    );
    assert_eq!(up.count(), 2, "{:?}", up.seen());
    // worker-2 still writes, and its write records the maximum again.
    assert_eq!(put(&replica, "42", &t2.to_string()).await.status, 200);
    assert!(pttl(&key).await > 3_500_000);
}

/// The negative control: what forgetting would do in observed fencing, which is why the config
/// refuses `retention` without `authority: leases`. The same history, the maximum gone as an
/// expiry would take it: the stale token is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_authority_a_forgotten_maximum_admits_a_stale_token() {
    let up = Upstream::start().await;
    let prefix = fresh_prefix();
    let refused = Config::parse(&format!(
        "upstream: http://127.0.0.1:1\n{}",
        on_redis(&prefix, "{ authority: none, retention: 1h }")
    ));
    assert!(
        refused.as_ref().is_err_and(|e| e
            .to_string()
            .starts_with("fence.retention: 1h is safe only with `fence.authority: leases`")),
        "{refused:?}"
    );
    let fg = fencegate(&up.url(), &on_redis(&prefix, "{ authority: none }")).await;
    let t1 = grant(&fg, "worker-1").await;
    assert_eq!(put(&fg, "42", &t1.to_string()).await.status, 200);
    let t2 = hand_over(&fg, "worker-2").await;
    assert_eq!(put(&fg, "42", &t2.to_string()).await.status, 200);
    let key = format!("{prefix}:{{account:42}}:max");
    assert_eq!(
        pttl(&key).await,
        -1,
        "no retention: the maximum never expires"
    );
    let _: i64 = ::redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut redis().await)
        .await
        .unwrap();
    let replica = fencegate(&up.url(), &on_redis(&prefix, "{ authority: none }")).await;
    assert_eq!(put(&replica, "42", &t1.to_string()).await.status, 200);
    assert_eq!(up.count(), 3, "the stale write went through");
}

/// Redis: every raise (plain or by an idempotent claim) sets the maximum's expiry to the
/// period; a repeat raises nothing and leaves it; without retention there is none.
#[tokio::test]
async fn redis_maxima_expire_the_period_after_their_raise() {
    let prefix = fresh_prefix();
    let config = Config::parse(&format!(
        "upstream: http://127.0.0.1:1\nstore: {{ kind: redis, url: '{REDIS_URL}', prefix: {prefix} }}\n"
    ))
    .unwrap();
    let store = store::open(&config.store).await.unwrap();
    let v = store
        .compare_and_raise(&rid("plain"), 3.into(), EqualTokens::Allow.into())
        .await;
    assert_eq!(v.unwrap(), Verdict::Admitted { previous: None });
    assert_eq!(pttl(&format!("{prefix}:{{plain}}:max")).await, -1);

    store.forget_after(2 * HOUR).unwrap();
    let v = store
        .compare_and_raise(&rid("plain"), 4.into(), EqualTokens::Allow.into())
        .await;
    assert_eq!(
        v.unwrap(),
        Verdict::Admitted {
            previous: Some(3.into())
        }
    );
    let left = pttl(&format!("{prefix}:{{plain}}:max")).await;
    assert!(left > 7_100_000 && left <= 7_200_000, "PTTL {left}");
    let claim = fencegate::idempotency::Claim {
        token: 9.into(),
        fingerprint: fencegate::idempotency::Fingerprint([1; 32]),
        rule: EqualTokens::Allow.into(),
        window: Duration::from_secs(60),
        may_execute: true,
        attempt: fencegate::idempotency::AttemptId::next(),
    };
    let begin = store
        .begin_idempotent(&rid("keyed"), "k1", &claim)
        .await
        .unwrap();
    assert!(
        matches!(begin, fencegate::idempotency::Begin::Execute { .. }),
        "{begin:?}"
    );
    let left = pttl(&format!("{prefix}:{{keyed}}:max")).await;
    assert!(left > 7_100_000 && left <= 7_200_000, "PTTL {left}");

    step_redis_clock(&prefix, 3 * HOUR).await;
    assert_eq!(pttl(&format!("{prefix}:{{plain}}:max")).await, -2);
    assert_eq!(pttl(&format!("{prefix}:{{keyed}}:max")).await, -2);
}

/// PostgreSQL: raises record `raised_at` while retention is on, and a pass (at once when
/// retention is turned on, then with the health probe) deletes the rows raised before the
/// period; rows raised while retention was off (`raised_at` NULL) are kept.
#[tokio::test]
async fn postgres_maxima_raised_before_the_period_are_deleted() {
    let prefix = fresh_prefix();
    let config = Config::parse(&format!(
        "upstream: http://127.0.0.1:1\nstore: {{ kind: postgres, url: '{POSTGRES_URL}', prefix: {prefix} }}\n"
    ))
    .unwrap();
    let store = store::open(&config.store).await.unwrap();
    let v = store
        .compare_and_raise(&rid("kept"), 3.into(), EqualTokens::Allow.into())
        .await;
    assert_eq!(v.unwrap(), Verdict::Admitted { previous: None });
    store.forget_after(HOUR).unwrap();
    for r in ["old", "young"] {
        let v = store
            .compare_and_raise(&rid(r), 5.into(), EqualTokens::Allow.into())
            .await;
        assert_eq!(v.unwrap(), Verdict::Admitted { previous: None });
    }
    let (client, connection) = tokio_postgres::connect(POSTGRES_URL, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let table = format!("{prefix}_fences");
    // Two hours pass for `old` (its raise moved back, as a clock step would show it).
    client
        .execute(
            &format!(
                "UPDATE {table} SET raised_at = raised_at - interval '2 hours' \
                 WHERE resource = 'old'"
            ),
            &[],
        )
        .await
        .unwrap();
    store.forget_after(HOUR).unwrap();
    let sql = format!("SELECT resource FROM {table} ORDER BY resource");
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let rows = client.query(&sql, &[]).await.unwrap();
            let left: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
            if left == ["kept", "young"] {
                break;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the pass did not delete `old` within 10s");
}

/// `fencegate check` refuses `fence.retention` with `token.equal: reject` (exit 1, the field
/// and the reason on stderr) and accepts the same file with `equal: allow`: the move from
/// `allow` to `reject` on a store with retention is stopped before any run starts.
#[test]
fn check_refuses_retention_with_equal_tokens_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let file = |equal: &str| {
        let path = dir.path().join(format!("{equal}.yaml"));
        std::fs::write(
            &path,
            format!(
                "upstream: http://127.0.0.1:8080\ntoken: {{ equal: {equal} }}\n{}",
                on_redis("fg", "{ authority: leases, retention: 1h }")
            ),
        )
        .unwrap();
        path
    };
    let check = |path: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_fencegate"))
            .args(["check", "--config"])
            .arg(path)
            .output()
            .unwrap()
    };
    let allowed = check(&file("allow"));
    assert_eq!(
        allowed.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&allowed.stderr)
    );
    let refused = check(&file("reject"));
    let err = String::from_utf8(refused.stderr).unwrap();
    assert_eq!(refused.status.code(), Some(1), "{err}");
    assert!(
        err.contains(
            "fence.retention: 1h is unsafe with `token.equal: reject`: the lease backend admits \
             its latest grant's token"
        ),
        "{err}"
    );
}

/// Waits (at most 10s) until `check` answers true.
async fn until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let wait = async {
        while !check().await {
            tokio::task::yield_now().await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .is_err()
    {
        panic!("not within 10s: {what}");
    }
}

async fn redis_get(key: &str) -> Option<String> {
    ::redis::cmd("GET")
        .arg(key)
        .query_async(&mut redis().await)
        .await
        .unwrap()
}

/// The lease on `resource`, granted through `fg`'s lease API to `holder`: its token.
async fn grant_on(fg: &fencegate::app::Server, resource: &str, holder: &str) -> u64 {
    let api = format!("http://{}/v1/leases/{resource}", fg.leases.unwrap());
    let reply = send("POST", &api, &[], format!(r#"{{"holder":"{holder}"}}"#)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.json()["fencing_token"].as_u64().unwrap()
}

/// A PUT of `account:<id>` with the token just granted: answered `409 unissued-token` while
/// the grant's event has not reached `fg`'s grant cache yet (a few milliseconds, more on a
/// loaded machine), so sent again until it is not; returns the status.
async fn put_granted(fg: &fencegate::app::Server, id: &str, token: Token) -> u16 {
    let wait = async {
        loop {
            let reply = put(fg, id, &token.to_string()).await;
            let status = reply.status.as_u16();
            if !(status == 409 && reply.json()["type"] == "urn:fencegate:unissued-token") {
                return status;
            }
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .expect("the grant reached the grant cache within 10s")
}

async fn stop(fg: fencegate::app::Server) {
    fg.shutdown();
    fg.wait().await;
}

/// Run A, authoritative with `retention: 1h`, writes tokens 1 and 2 to `account:42` and
/// stops. Run B on the same prefix, with `b_fence` (no retention), makes its first write, to
/// another resource: before admitting anything it found A's mark and took the expiry off
/// A's maxima. Two hours on, a fresh B replica still refuses token 1.
async fn retention_then_none_on_redis(b_fence: &str) {
    let up = Upstream::start().await;
    let prefix = fresh_prefix();
    let a = fencegate(
        &up.url(),
        &on_redis(&prefix, "{ authority: leases, retention: 1h }"),
    )
    .await;
    let t1 = grant(&a, "worker-1").await;
    assert_eq!(put(&a, "42", &t1.to_string()).await.status, 200);
    let t2 = hand_over(&a, "worker-2").await;
    assert_eq!(put_granted(&a, "42", tk(t2)).await, 200);
    let key = format!("{prefix}:{{account:42}}:max");
    assert!(pttl(&key).await > 3_500_000, "A ages its maxima");
    stop(a).await;

    let b = fencegate(&up.url(), &on_redis(&prefix, b_fence)).await;
    let t7 = grant_on(&b, "account:7", "worker-7").await;
    assert_eq!(put(&b, "7", &t7.to_string()).await.status, 200);
    assert_eq!(pttl(&key).await, -1, "B left A's maximum an expiry");
    assert_eq!(redis_get(&key).await, Some(t2.to_string()));
    assert_eq!(pttl(&format!("{prefix}:{{account:7}}:max")).await, -1);

    step_redis_clock(&prefix, 2 * HOUR).await;
    let replica = fencegate(&up.url(), &on_redis(&prefix, b_fence)).await;
    let reply = put(&replica, "42", &t1.to_string()).await;
    let body = reply.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(body["current_token"], t2);
    assert_eq!(up.count(), 3, "{:?}", up.seen());
    assert_eq!(redis_get(&key).await, Some(t2.to_string()));
}

/// Authoritative with retention, then observed: the move the observed run's promise ("never
/// forgotten") must survive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_authoritative_with_retention_then_observed_keeps_every_maximum() {
    retention_then_none_on_redis("{ authority: none }").await;
}

/// Retention on, then off (authoritative both times).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_retention_on_then_off_keeps_every_maximum() {
    retention_then_none_on_redis("{ authority: leases }").await;
}

/// `token.equal: allow` with retention, then `reject`: with retention the move is refused at
/// load; without it, run B keeps the maximum run A aged, so the repeat of the latest grant's
/// token (which the lease backend admits) is still refused two hours on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_equal_allow_with_retention_then_reject_keeps_refusing_the_repeat() {
    let up = Upstream::start().await;
    let prefix = fresh_prefix();
    let a = fencegate(
        &up.url(),
        &on_redis(&prefix, "{ authority: leases, retention: 1h }"),
    )
    .await;
    let t1 = grant(&a, "worker-1").await;
    assert_eq!(put(&a, "42", &t1.to_string()).await.status, 200);
    assert_eq!(put(&a, "42", &t1.to_string()).await.status, 200, "allow");
    stop(a).await;

    let reject = |fence: &str| format!("token: {{ equal: reject }}\n{}", on_redis(&prefix, fence));
    let refused = Config::parse(&format!(
        "upstream: http://127.0.0.1:1\n{}",
        reject("{ authority: leases, retention: 1h }")
    ))
    .unwrap_err()
    .to_string();
    assert!(
        refused.starts_with("fence.retention: 1h is unsafe with `token.equal: reject`"),
        "{refused}"
    );
    let b = fencegate(&up.url(), &reject("{ authority: leases }")).await;
    let t7 = grant_on(&b, "account:7", "worker-7").await;
    assert_eq!(put(&b, "7", &t7.to_string()).await.status, 200);
    let key = format!("{prefix}:{{account:42}}:max");
    assert_eq!(pttl(&key).await, -1);

    step_redis_clock(&prefix, 2 * HOUR).await;
    let replica = fencegate(&up.url(), &reject("{ authority: leases }")).await;
    let reply = put(&replica, "42", &t1.to_string()).await;
    let body = reply.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(body["current_token"], t1);
    assert_eq!(up.count(), 3, "{:?}", up.seen());
}

/// A monotonic clock that a test moves, for the store that checks for the mark.
fn test_clock() -> (Clock, Arc<AtomicU64>) {
    let base = tokio::time::Instant::now();
    let offset = Arc::new(AtomicU64::new(0));
    let read = Arc::clone(&offset);
    let clock: Clock = Arc::new(move || base + Duration::from_millis(read.load(Ordering::SeqCst)));
    (clock, offset)
}

fn advance(offset: &AtomicU64, by: Duration) {
    offset.fetch_add(u64::try_from(by.as_millis()).unwrap(), Ordering::SeqCst);
}

fn store_config(kind: &str, prefix: &str) -> Config {
    let url = if kind == "redis" {
        REDIS_URL
    } else {
        POSTGRES_URL
    };
    Config::parse(&format!(
        "upstream: http://127.0.0.1:1\nstore: {{ kind: {kind}, url: '{url}', prefix: {prefix} }}\n"
    ))
    .unwrap()
}

async fn raise(store: &dyn FenceStore, resource: &str, token: Token) -> Verdict {
    store
        .compare_and_raise(&rid(resource), token, EqualTokens::Allow.into())
        .await
        .unwrap()
}

/// Redis, during a rolling change: replica B (no retention) runs beside replica A (with
/// retention). A's raises get an expiry; B, at its next check, finds A's mark and takes the
/// expiry off (off maxima only: an idempotency record keeps its window); once A's mark has stayed the same for the quiet period (A stopped), B sweeps a
/// last time and deletes the mark. B's checks run on a clock the test moves, woken by its
/// admissions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_replica_without_retention_keeps_what_one_with_retention_raises_beside_it() {
    let prefix = fresh_prefix();
    let config = store_config("redis", &prefix);
    let (clock, offset) = test_clock();
    let b = store::open_with_clock(&config.store, clock).await.unwrap();
    assert_eq!(
        raise(&*b, "b", 1.into()).await,
        Verdict::Admitted { previous: None }
    );
    let a = store::open(&config.store).await.unwrap();
    a.forget_after(HOUR).unwrap();
    assert_eq!(
        raise(&*a, "r", 2.into()).await,
        Verdict::Admitted { previous: None }
    );
    let (r, s, mark) = (
        format!("{prefix}:{{r}}:max"),
        format!("{prefix}:{{s}}:max"),
        format!("{prefix}:retention"),
    );
    assert!(pttl(&r).await > 3_500_000);
    assert!(pttl(&mark).await > 3_600_000, "the mark outlives A's keys");
    // A completed idempotency record whose key makes its name look like a maximum's: the
    // sweep leaves its expiry (the window).
    let claim = fencegate::idempotency::Claim {
        token: 1.into(),
        fingerprint: fencegate::idempotency::Fingerprint([3; 32]),
        rule: EqualTokens::Allow.into(),
        window: Duration::from_secs(60),
        may_execute: true,
        attempt: fencegate::idempotency::AttemptId::next(),
    };
    let done = fencegate::idempotency::Record {
        phase: fencegate::idempotency::Phase::Completed,
        status: Some(204),
        ..fencegate::idempotency::Record::in_flight(1.into(), claim.fingerprint)
    };
    a.begin_idempotent(&rid("x"), "k}:max", &claim)
        .await
        .unwrap();
    assert!(a
        .finish_idempotent(&rid("x"), "k}:max", &claim, &done)
        .await
        .unwrap());
    let record = format!("{prefix}:{{x}}:idem\u{1f}k}}:max");
    assert!(pttl(&record).await > 0);

    advance(&offset, CHECK_EVERY);
    assert_eq!(
        raise(&*b, "b", 1.into()).await,
        Verdict::Admitted {
            previous: Some(1.into())
        }
    );
    until("B takes the expiry off r", || async {
        pttl(&r).await == -1
    })
    .await;
    assert!(pttl(&record).await > 0, "the sweep persisted a record");
    assert_eq!(
        raise(&*a, "s", 3.into()).await,
        Verdict::Admitted { previous: None }
    );
    assert!(pttl(&s).await > 3_500_000, "A still ages its raises");
    drop(a);

    advance(&offset, QUIET);
    assert_eq!(
        raise(&*b, "b", 1.into()).await,
        Verdict::Admitted {
            previous: Some(1.into())
        }
    );
    until("B deletes the quiet mark", || async {
        redis_get(&mark).await.is_none()
    })
    .await;
    for (key, value) in [(&r, "2"), (&s, "3")] {
        assert_eq!(pttl(key).await, -1, "{key}");
        assert_eq!(redis_get(key).await.as_deref(), Some(value));
    }
}

/// Redis: a run without retention that reads a maximum with an expiry (its mark lost, as an
/// eviction would lose it) without raising it (a stale plain write, an idempotent claim of the
/// equal token) takes the expiry off. (A raise writes the maximum anew, without an expiry.)
#[tokio::test]
async fn redis_a_maximum_read_without_retention_loses_its_expiry() {
    let prefix = fresh_prefix();
    let config = store_config("redis", &prefix);
    let a = store::open(&config.store).await.unwrap();
    a.forget_after(HOUR).unwrap();
    for r in ["plain", "keyed"] {
        assert_eq!(
            raise(&*a, r, 5.into()).await,
            Verdict::Admitted { previous: None }
        );
        assert!(pttl(&format!("{prefix}:{{{r}}}:max")).await > 3_500_000);
    }
    drop(a);
    let _: i64 = ::redis::cmd("DEL")
        .arg(format!("{prefix}:retention"))
        .query_async(&mut redis().await)
        .await
        .unwrap();
    let b = store::open(&config.store).await.unwrap();
    assert_eq!(
        raise(&*b, "plain", 4.into()).await,
        Verdict::Stale { current: 5.into() }
    );
    let claim = fencegate::idempotency::Claim {
        token: 5.into(),
        fingerprint: fencegate::idempotency::Fingerprint([2; 32]),
        rule: EqualTokens::Allow.into(),
        window: Duration::from_secs(60),
        may_execute: true,
        attempt: fencegate::idempotency::AttemptId::next(),
    };
    let begin = b
        .begin_idempotent(&rid("keyed"), "k", &claim)
        .await
        .unwrap();
    assert_eq!(
        begin,
        fencegate::idempotency::Begin::Execute {
            previous: Some(5.into())
        }
    );
    for r in ["plain", "keyed"] {
        let key = format!("{prefix}:{{{r}}}:max");
        assert_eq!(pttl(&key).await, -1, "{key}");
        assert_eq!(redis_get(&key).await.as_deref(), Some("5"));
    }
}

async fn postgres() -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(POSTGRES_URL, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
}

/// PostgreSQL: `(resource, max_token, raised_at is set)` of every row, by resource.
async fn pg_rows(pg: &tokio_postgres::Client, prefix: &str) -> Vec<(String, i64, bool)> {
    let sql = format!(
        "SELECT resource, max_token, raised_at IS NOT NULL FROM {prefix}_fences ORDER BY resource"
    );
    let rows = pg.query(&sql, &[]).await.unwrap();
    rows.iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

async fn pg_mark(pg: &tokio_postgres::Client, prefix: &str) -> Option<String> {
    let sql = format!("SELECT mark FROM {prefix}_retention");
    pg.query_opt(&sql, &[]).await.unwrap().map(|r| r.get(0))
}

/// Two hours pass on the PostgreSQL server for every maximum with a raise time (as a clock
/// step shows it, or as they would pass).
async fn pg_two_hours_pass(pg: &tokio_postgres::Client, prefix: &str) {
    let sql = format!(
        "UPDATE {prefix}_fences SET raised_at = raised_at - interval '2 hours' \
         WHERE raised_at IS NOT NULL"
    );
    pg.execute(&sql, &[]).await.unwrap();
}

/// `store` (with retention) runs a forgetting pass now; returns once it has deleted `gone`
/// (a maximum it raised, then aged by two hours) so the pass is known to have run.
async fn pg_pass(store: &dyn FenceStore, pg: &tokio_postgres::Client, prefix: &str, gone: &str) {
    store.forget_after(HOUR).unwrap();
    until("the forgetting pass deletes its control row", || async {
        !pg_rows(pg, prefix).await.iter().any(|(r, _, _)| r == gone)
    })
    .await;
}

/// `store` is told its period, and its first forgetting pass (started by that, in the
/// background) has run: a control row two hours old is gone. Without waiting, that pass could
/// run after the test aged a row on purpose and delete it.
async fn pg_forget_after(store: &dyn FenceStore, pg: &tokio_postgres::Client, prefix: &str) {
    let sql = format!(
        "INSERT INTO {prefix}_fences (resource, max_token, raised_at) \
         VALUES ('control', 1, now() - interval '2 hours')"
    );
    pg.execute(&sql, &[]).await.unwrap();
    store.forget_after(HOUR).unwrap();
    until(
        "the first forgetting pass deletes its control row",
        || async {
            !pg_rows(pg, prefix)
                .await
                .iter()
                .any(|(r, _, _)| r == "control")
        },
    )
    .await;
}

/// PostgreSQL, restarts: run A (retention) raises `r`; run B (none) finds A's mark at its
/// start and takes `r`'s raise time away; run C (retention again), two hours on, forgets a
/// maximum raised and aged under it, and keeps `r`: the raise time A left did not date it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_retention_on_off_on_across_restarts_keeps_what_the_run_without_kept() {
    let prefix = fresh_prefix();
    let config = store_config("postgres", &prefix);
    let pg = postgres().await;
    let a = store::open(&config.store).await.unwrap();
    a.forget_after(HOUR).unwrap();
    assert_eq!(
        raise(&*a, "r", 5.into()).await,
        Verdict::Admitted { previous: None }
    );
    assert_eq!(pg_rows(&pg, &prefix).await, [("r".into(), 5, true)]);
    drop(a);

    let b = store::open(&config.store).await.unwrap();
    assert_eq!(
        raise(&*b, "b", 1.into()).await,
        Verdict::Admitted { previous: None }
    );
    assert_eq!(
        pg_rows(&pg, &prefix).await,
        [("b".into(), 1, false), ("r".into(), 5, false)]
    );
    assert!(pg_mark(&pg, &prefix).await.is_some(), "not quiet yet");
    drop(b);

    let c = store::open(&config.store).await.unwrap();
    c.forget_after(HOUR).unwrap();
    assert_eq!(
        raise(&*c, "gone", 1.into()).await,
        Verdict::Admitted { previous: None }
    );
    pg_two_hours_pass(&pg, &prefix).await;
    pg_pass(&*c, &pg, &prefix, "gone").await;
    assert_eq!(
        pg_rows(&pg, &prefix).await,
        [("b".into(), 1, false), ("r".into(), 5, false)]
    );
}

/// PostgreSQL, during a rolling change: replica A (retention) and replica B (none) share the
/// table. B's checks take the raise time off what A raised, so A's pass, two hours on,
/// forgets only what A raised after B's sweep (the control row); once A has stopped and its
/// mark has stayed the same for the quiet period, B deletes it. B's checks run on a clock the
/// test moves, woken by its admissions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_replica_without_retention_keeps_what_one_with_retention_raises_beside_it() {
    let prefix = fresh_prefix();
    let config = store_config("postgres", &prefix);
    let pg = postgres().await;
    let (clock, offset) = test_clock();
    let b = store::open_with_clock(&config.store, clock).await.unwrap();
    assert_eq!(
        raise(&*b, "b", 1.into()).await,
        Verdict::Admitted { previous: None }
    );
    let a = store::open(&config.store).await.unwrap();
    pg_forget_after(&*a, &pg, &prefix).await;
    assert_eq!(
        raise(&*a, "r", 2.into()).await,
        Verdict::Admitted { previous: None }
    );
    pg_two_hours_pass(&pg, &prefix).await;

    advance(&offset, CHECK_EVERY);
    assert_eq!(
        raise(&*b, "b", 1.into()).await,
        Verdict::Admitted {
            previous: Some(1.into())
        }
    );
    until("B takes the raise time off r", || async {
        pg_rows(&pg, &prefix)
            .await
            .contains(&("r".into(), 2, false))
    })
    .await;
    assert_eq!(
        raise(&*a, "gone", 3.into()).await,
        Verdict::Admitted { previous: None }
    );
    pg_two_hours_pass(&pg, &prefix).await;
    pg_pass(&*a, &pg, &prefix, "gone").await;
    assert_eq!(
        pg_rows(&pg, &prefix).await,
        [("b".into(), 1, false), ("r".into(), 2, false)]
    );
    // The pass was forced by telling A its period again, which wrote a new mark: B sweeps at
    // its next check again, and takes the raise time off what A raised since.
    assert_eq!(
        raise(&*a, "late", 4.into()).await,
        Verdict::Admitted { previous: None }
    );
    drop(a);
    advance(&offset, CHECK_EVERY);
    assert_eq!(
        raise(&*b, "b", 1.into()).await,
        Verdict::Admitted {
            previous: Some(1.into())
        }
    );
    until("B takes the raise time off late", || async {
        pg_rows(&pg, &prefix)
            .await
            .contains(&("late".into(), 4, false))
    })
    .await;

    advance(&offset, QUIET);
    assert_eq!(
        raise(&*b, "b", 1.into()).await,
        Verdict::Admitted {
            previous: Some(1.into())
        }
    );
    until("B deletes the quiet mark", || async {
        pg_mark(&pg, &prefix).await.is_none()
    })
    .await;
}

/// PostgreSQL: a run without retention sweeps at every check that finds a mark, not only
/// when the mark's value changed. B's first sweep under A's mark finds `first`; A then raises
/// `r` under the same mark, and B's next check (the mark unchanged, not quiet yet) must take
/// the raise time off `r` too. Sweeping only on a changed value left `r` aged until the quiet
/// period ran out, and how B's checks fell against A's marks (an early check, a slow start)
/// decided which raises a sweep reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_run_without_retention_sweeps_at_every_check_that_finds_a_mark() {
    let prefix = fresh_prefix();
    let config = store_config("postgres", &prefix);
    let pg = postgres().await;
    let (clock, offset) = test_clock();
    let b = store::open_with_clock(&config.store, clock).await.unwrap();
    assert_eq!(
        raise(&*b, "b", 1.into()).await,
        Verdict::Admitted { previous: None }
    );
    let a = store::open(&config.store).await.unwrap();
    a.forget_after(HOUR).unwrap();
    assert_eq!(
        raise(&*a, "first", 2.into()).await,
        Verdict::Admitted { previous: None }
    );
    let mark = pg_mark(&pg, &prefix).await.expect("A marked the store");

    advance(&offset, CHECK_EVERY);
    assert_eq!(
        raise(&*b, "b", 1.into()).await,
        Verdict::Admitted {
            previous: Some(1.into())
        }
    );
    until("B takes the raise time off first", || async {
        pg_rows(&pg, &prefix)
            .await
            .contains(&("first".into(), 2, false))
    })
    .await;

    assert_eq!(
        raise(&*a, "r", 3.into()).await,
        Verdict::Admitted { previous: None }
    );
    assert!(pg_rows(&pg, &prefix).await.contains(&("r".into(), 3, true)));
    advance(&offset, CHECK_EVERY);
    assert!(
        CHECK_EVERY * 2 < QUIET,
        "B's checks come before the quiet period ends"
    );
    assert_eq!(
        raise(&*b, "b", 1.into()).await,
        Verdict::Admitted {
            previous: Some(1.into())
        }
    );
    until(
        "B takes the raise time off r under the same mark",
        || async {
            pg_rows(&pg, &prefix)
                .await
                .contains(&("r".into(), 3, false))
        },
    )
    .await;
    assert_eq!(
        pg_mark(&pg, &prefix).await,
        Some(mark),
        "A marked only once"
    );
    assert_eq!(
        pg_rows(&pg, &prefix).await,
        [
            ("b".into(), 1, false),
            ("first".into(), 2, false),
            ("r".into(), 3, false)
        ]
    );
}

/// Until `store` admits `resource` at `token` (its retention check retried with backoff).
async fn until_admitted(store: &dyn FenceStore, resource: &str, token: Token) -> Verdict {
    let wait = async {
        loop {
            if let Ok(verdict) = store
                .compare_and_raise(&rid(resource), token, EqualTokens::Allow.into())
                .await
            {
                return verdict;
            }
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .expect("the store admits again within 10s")
}

/// Redis, fail closed: a run without retention that cannot read the mark (here a value of
/// the wrong type under its key) admits nothing, and says why, until it can; then it writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_run_that_cannot_check_for_the_mark_admits_nothing() {
    let prefix = fresh_prefix();
    let mark = format!("{prefix}:retention");
    let _: i64 = ::redis::cmd("HSET")
        .arg(&mark)
        .arg("not")
        .arg("a mark")
        .query_async(&mut redis().await)
        .await
        .unwrap();
    let b = store::open(&store_config("redis", &prefix).store)
        .await
        .unwrap();
    let refused = b
        .compare_and_raise(&rid("b"), 1.into(), EqualTokens::Allow.into())
        .await
        .unwrap_err();
    assert!(
        refused.to_string().starts_with(&format!(
            "the fence store is unavailable: reading the mark {mark}: redis: \"WRONGTYPE\""
        )),
        "{refused}"
    );
    assert!(!b.healthy());
    assert_eq!(redis_get(&format!("{prefix}:{{b}}:max")).await, None);
    let _: i64 = ::redis::cmd("DEL")
        .arg(&mark)
        .query_async(&mut redis().await)
        .await
        .unwrap();
    assert_eq!(
        until_admitted(&*b, "b", 1.into()).await,
        Verdict::Admitted { previous: None }
    );
}

/// PostgreSQL, fail closed: a run without retention whose sweep is refused (a trigger
/// standing in for a missing permission) admits nothing until the sweep succeeds; then the
/// maximum the run with retention aged has no raise time left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_run_whose_sweep_fails_admits_nothing() {
    let prefix = fresh_prefix();
    let config = store_config("postgres", &prefix);
    let pg = postgres().await;
    let a = store::open(&config.store).await.unwrap();
    a.forget_after(HOUR).unwrap();
    assert_eq!(
        raise(&*a, "r", 5.into()).await,
        Verdict::Admitted { previous: None }
    );
    drop(a);
    pg.batch_execute(&format!(
        "CREATE FUNCTION {prefix}_refuse() RETURNS trigger LANGUAGE plpgsql AS \
           $$ BEGIN RAISE EXCEPTION 'sweep refused'; END $$; \
         CREATE TRIGGER {prefix}_refuse BEFORE UPDATE ON {prefix}_fences FOR EACH ROW \
           WHEN (OLD.raised_at IS NOT NULL AND NEW.raised_at IS NULL) \
           EXECUTE FUNCTION {prefix}_refuse()"
    ))
    .await
    .unwrap();
    let b = store::open(&config.store).await.unwrap();
    let refused = b
        .compare_and_raise(&rid("b"), 1.into(), EqualTokens::Allow.into())
        .await
        .unwrap_err();
    assert!(
        refused.to_string().starts_with(
            "the fence store is unavailable: keeping the maxima a run with fence.retention \
             left to be forgotten: postgres: "
        ) && refused.to_string().contains("sweep refused"),
        "{refused}"
    );
    assert!(!b.healthy());
    assert_eq!(pg_rows(&pg, &prefix).await, [("r".into(), 5, true)]);
    pg.batch_execute(&format!("DROP TRIGGER {prefix}_refuse ON {prefix}_fences"))
        .await
        .unwrap();
    assert_eq!(
        until_admitted(&*b, "b", 1.into()).await,
        Verdict::Admitted { previous: None }
    );
    assert_eq!(
        pg_rows(&pg, &prefix).await,
        [("b".into(), 1, false), ("r".into(), 5, false)]
    );
}

/// The in-process layer applies `fence.retention` as the sidecar does: a maximum it raises
/// expires the period after its raise (it was kept for good, the setting ignored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_applies_retention_like_the_sidecar() {
    use tower::{Service, ServiceExt};
    use tower_layer::Layer;
    let prefix = fresh_prefix();
    let yaml = on_redis(&prefix, "{ authority: leases, retention: 1h }");
    let config = Config::parse_fence(&yaml).unwrap();
    let layer = fencegate::layer::FenceLayer::open(&config).await.unwrap();
    let backend = fencegate::lease::open(&config.leases.as_ref().unwrap().backend)
        .await
        .unwrap();
    let grant = match backend
        .try_acquire("account:42", "worker-1", Duration::from_secs(5))
        .await
        .unwrap()
    {
        fencegate::lease::Acquired::Granted(grant) => grant,
        other => panic!("not granted: {other:?}"),
    };
    let inner = tower::service_fn(
        |_req: http::Request<fencegate::layer::RequestBody<String>>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(String::from("stored")))
        },
    );
    let mut service = layer.layer(inner);
    let req = http::Request::put("/accounts/42")
        .header("host", "ledger")
        .header("fencing-token", grant.token.to_string())
        .body(String::new())
        .unwrap();
    let response = service.ready().await.unwrap().call(req).await.unwrap();
    assert_eq!(response.status(), 200);
    let left = pttl(&format!("{prefix}:{{account:42}}:max")).await;
    assert!(left > 3_500_000 && left <= 3_600_000, "PTTL {left}");
}
