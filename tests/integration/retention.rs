//! `fence.retention`: maxima forgotten after the period, on the stores that offer it, and a
//! stale token still refused once its resource's maximum is forgotten, because the config
//! allows retention only with `fence.authority: leases`. The negative control shows what the
//! load-time refusal prevents: in observed fencing a forgotten maximum admits the stale token.

use std::time::Duration;

use fencegate::config::{Config, EqualTokens};
use fencegate::store::{self, Verdict};

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
        .compare_and_raise("plain", 3, EqualTokens::Allow)
        .await;
    assert_eq!(v.unwrap(), Verdict::Admitted { previous: None });
    assert_eq!(pttl(&format!("{prefix}:{{plain}}:max")).await, -1);

    store.forget_after(2 * HOUR).unwrap();
    let v = store
        .compare_and_raise("plain", 4, EqualTokens::Allow)
        .await;
    assert_eq!(v.unwrap(), Verdict::Admitted { previous: Some(3) });
    let left = pttl(&format!("{prefix}:{{plain}}:max")).await;
    assert!(left > 7_100_000 && left <= 7_200_000, "PTTL {left}");
    let claim = fencegate::idempotency::Claim {
        token: 9,
        fingerprint: fencegate::idempotency::Fingerprint([1; 32]),
        equal: EqualTokens::Allow,
        window: Duration::from_secs(60),
        may_execute: true,
        attempt: fencegate::idempotency::AttemptId::next(),
    };
    let begin = store.begin_idempotent("keyed", "k1", &claim).await.unwrap();
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
    let v = store.compare_and_raise("kept", 3, EqualTokens::Allow).await;
    assert_eq!(v.unwrap(), Verdict::Admitted { previous: None });
    store.forget_after(HOUR).unwrap();
    for r in ["old", "young"] {
        let v = store.compare_and_raise(r, 5, EqualTokens::Allow).await;
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
