//! One conformance suite for the idempotency records every fence store keeps, against real
//! servers: the decision, its coupling with the maximum, the outcome write and expiry.

use crate::common::rid;
use crate::common::tk;
use fencegate::fence::Token;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use fencegate::config::{Config, EqualTokens};
use fencegate::idempotency::{AttemptId, Begin, Claim, Fingerprint, Phase, Record, StoredResponse};
use fencegate::store::shared::Clock;
use fencegate::store::{self, FenceStore, Verdict};

use crate::services::{fresh_prefix, POSTGRES_URL, REDIS_URL};
use crate::stores::open;

fn fp(n: u8) -> Fingerprint {
    Fingerprint([n; 32])
}

fn claim(token: Token, f: u8) -> Claim {
    Claim {
        token,
        fingerprint: fp(f),
        rule: EqualTokens::Allow.into(),
        window: Duration::from_secs(60),
        may_execute: true,
        attempt: AttemptId::next(),
    }
}

fn completed(token: Token, f: u8, body: &'static [u8]) -> Record {
    Record {
        phase: Phase::Completed,
        token,
        fingerprint: fp(f),
        status: Some(201),
        response: Some(StoredResponse {
            status: 201,
            headers: vec![
                ("content-type".into(), b"application/json".to_vec()),
                ("x-opaque".into(), vec![0x80, 0xff, b'a']),
            ],
            body: Bytes::from_static(body),
            trailers: Vec::new(),
        }),
        attempt: None,
    }
}

/// The life of one key: claim, conflicts, completion, replay.
async fn claim_complete_replay(store: Arc<dyn FenceStore>) {
    let (r, k) = ("account:1", "key-1");
    let c = claim(5.into(), 1);
    assert_eq!(
        store.begin_idempotent(&rid(r), k, &c).await.unwrap(),
        Begin::Execute { previous: None }
    );
    // The claim raised the maximum, in the same step.
    assert_eq!(store.current(&rid(r)).await.unwrap(), Some(5.into()));
    assert_eq!(
        store
            .begin_idempotent(&rid(r), k, &claim(5.into(), 1))
            .await
            .unwrap(),
        Begin::InFlight
    );
    assert_eq!(
        store
            .begin_idempotent(&rid(r), k, &claim(6.into(), 2))
            .await
            .unwrap(),
        Begin::Reused
    );
    // Someone else's outcome does not land.
    assert!(!store
        .finish_idempotent(
            &rid(r),
            k,
            &claim(4.into(), 1),
            &completed(4.into(), 1, b"x")
        )
        .await
        .unwrap());
    let done = completed(5.into(), 1, b"{\"ok\":true}\n");
    assert!(store
        .finish_idempotent(&rid(r), k, &c, &done)
        .await
        .unwrap());
    // Finishing twice does not land either: the record is no longer in flight.
    assert!(!store
        .finish_idempotent(&rid(r), k, &c, &done)
        .await
        .unwrap());
    assert_eq!(
        store
            .begin_idempotent(&rid(r), k, &claim(5.into(), 1))
            .await
            .unwrap(),
        Begin::Completed(done.clone())
    );
    // A newer epoch was admitted since: the record still answers, nothing executes.
    assert!(matches!(
        store
            .compare_and_raise(&rid(r), 9.into(), EqualTokens::Allow.into())
            .await
            .unwrap(),
        Verdict::Admitted { .. }
    ));
    assert_eq!(
        store
            .begin_idempotent(&rid(r), k, &claim(5.into(), 1))
            .await
            .unwrap(),
        Begin::Completed(done.clone())
    );
    let refused = Claim {
        may_execute: false,
        ..claim(5.into(), 1)
    };
    assert_eq!(
        store.begin_idempotent(&rid(r), k, &refused).await.unwrap(),
        Begin::Completed(done)
    );
    assert_eq!(
        store
            .begin_idempotent(&rid(r), k, &claim(9.into(), 3))
            .await
            .unwrap(),
        Begin::Reused
    );
    assert_eq!(store.current(&rid(r)).await.unwrap(), Some(9.into()));
    // Keys are per resource.
    assert_eq!(
        store
            .begin_idempotent(&rid("account:2"), k, &claim(1.into(), 2))
            .await
            .unwrap(),
        Begin::Execute { previous: None }
    );
}

/// Only the attempt that claimed a key writes its outcome. Another attempt with the same token
/// and body (a retry whose claim timed out, cleaning up after itself) must not replace it: the
/// key would stop being in flight while the first attempt still runs.
async fn only_the_claiming_attempt_finishes(store: Arc<dyn FenceStore>) {
    let (r, k) = ("account:a", "k");
    let a = claim(5.into(), 1);
    assert_eq!(
        store.begin_idempotent(&rid(r), k, &a).await.unwrap(),
        Begin::Execute { previous: None }
    );
    let b = Claim {
        attempt: AttemptId::next(),
        ..a
    };
    assert!(!store
        .finish_idempotent(&rid(r), k, &b, &Record::unknown(5.into(), fp(1)))
        .await
        .unwrap());
    // Still the first attempt's: in flight to everyone else, and its outcome lands.
    let c = Claim {
        attempt: AttemptId::next(),
        ..a
    };
    assert_eq!(
        store.begin_idempotent(&rid(r), k, &c).await.unwrap(),
        Begin::InFlight
    );
    let done = completed(5.into(), 1, b"paid once");
    assert!(store
        .finish_idempotent(&rid(r), k, &a, &done)
        .await
        .unwrap());
    assert_eq!(
        store.begin_idempotent(&rid(r), k, &c).await.unwrap(),
        Begin::Completed(done)
    );
}

/// A stale token claims nothing; `may_execute: false` claims nothing.
async fn stale_claims_nothing(store: Arc<dyn FenceStore>) {
    let r = "account:s";
    assert!(matches!(
        store
            .compare_and_raise(&rid(r), 10.into(), EqualTokens::Allow.into())
            .await
            .unwrap(),
        Verdict::Admitted { .. }
    ));
    assert_eq!(
        store
            .begin_idempotent(&rid(r), "k", &claim(5.into(), 1))
            .await
            .unwrap(),
        Begin::Stale { current: 10.into() }
    );
    let reject = Claim {
        rule: EqualTokens::Reject.into(),
        ..claim(10.into(), 1)
    };
    assert_eq!(
        store.begin_idempotent(&rid(r), "k", &reject).await.unwrap(),
        Begin::Stale { current: 10.into() }
    );
    let refused = Claim {
        may_execute: false,
        ..claim(11.into(), 1)
    };
    assert_eq!(
        store
            .begin_idempotent(&rid(r), "k", &refused)
            .await
            .unwrap(),
        Begin::Refused
    );
    assert_eq!(store.current(&rid(r)).await.unwrap(), Some(10.into()));
    assert_eq!(
        store
            .begin_idempotent(&rid(r), "k", &claim(11.into(), 1))
            .await
            .unwrap(),
        Begin::Execute {
            previous: Some(10.into())
        }
    );
    assert_eq!(store.current(&rid(r)).await.unwrap(), Some(11.into()));
}

/// An unknown outcome is redone only with a token at least the recorded one.
async fn unknown_outcome(store: Arc<dyn FenceStore>) {
    let (r, k) = ("account:u", "k");
    let c = claim(7.into(), 1);
    assert_eq!(
        store.begin_idempotent(&rid(r), k, &c).await.unwrap(),
        Begin::Execute { previous: None }
    );
    assert!(store
        .finish_idempotent(&rid(r), k, &c, &Record::unknown(7.into(), fp(1)))
        .await
        .unwrap());
    assert_eq!(
        store
            .begin_idempotent(&rid(r), k, &claim(6.into(), 1))
            .await
            .unwrap(),
        Begin::Stale { current: 7.into() }
    );
    assert_eq!(
        store
            .begin_idempotent(&rid(r), k, &claim(7.into(), 2))
            .await
            .unwrap(),
        Begin::Reused
    );
    let same = Claim {
        rule: EqualTokens::Reject.into(),
        ..claim(7.into(), 1)
    };
    assert_eq!(
        store.begin_idempotent(&rid(r), k, &same).await.unwrap(),
        Begin::Execute {
            previous: Some(7.into())
        }
    );
    assert_eq!(
        store
            .begin_idempotent(&rid(r), k, &claim(8.into(), 1))
            .await
            .unwrap(),
        Begin::InFlight
    );
}

/// Many attempts with one key at once: exactly one executes.
async fn concurrent_duplicates(store: Arc<dyn FenceStore>) {
    let mut tasks = Vec::new();
    for i in 0..16u64 {
        let store = Arc::clone(&store);
        tasks.push(tokio::spawn(async move {
            store
                .begin_idempotent(&rid("account:c"), "dup", &claim(tk(100 + i % 3), 1))
                .await
                .unwrap()
        }));
    }
    let mut executed = 0;
    for t in tasks {
        match t.await.unwrap() {
            Begin::Execute { .. } => executed += 1,
            Begin::InFlight => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(executed, 1);
}

/// Records expire after their window, by the store; the key executes again.
async fn window_expiry(store: Arc<dyn FenceStore>) {
    let (r, k) = ("account:w", "k");
    let short = Claim {
        window: Duration::from_secs(1),
        ..claim(3.into(), 1)
    };
    assert_eq!(
        store.begin_idempotent(&rid(r), k, &short).await.unwrap(),
        Begin::Execute { previous: None }
    );
    assert!(store
        .finish_idempotent(&rid(r), k, &short, &completed(3.into(), 1, b"done"))
        .await
        .unwrap());
    assert!(matches!(
        store.begin_idempotent(&rid(r), k, &short).await.unwrap(),
        Begin::Completed(_)
    ));
    // Poll until the store has expired it (bounded): the window is the store's clock.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match store.begin_idempotent(&rid(r), k, &short).await.unwrap() {
            Begin::Completed(_) => {
                assert!(Instant::now() < deadline, "the record never expired");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Begin::Execute { previous } => {
                assert_eq!(previous, Some(3.into()));
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

macro_rules! conformance {
    ($($kind:ident),*) => {$(
        mod $kind {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn claim_complete_replay() { let (s, _g, _d) = open(stringify!($kind)).await; super::claim_complete_replay(s).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn only_the_claiming_attempt_finishes() { let (s, _g, _d) = open(stringify!($kind)).await; super::only_the_claiming_attempt_finishes(s).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn stale_claims_nothing() { let (s, _g, _d) = open(stringify!($kind)).await; super::stale_claims_nothing(s).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn unknown_outcome() { let (s, _g, _d) = open(stringify!($kind)).await; super::unknown_outcome(s).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_duplicates() { let (s, _g, _d) = open(stringify!($kind)).await; super::concurrent_duplicates(s).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn window_expiry() { let (s, _g, _d) = open(stringify!($kind)).await; super::window_expiry(s).await }
        }
    )*};
}

conformance!(memory);
conformance!(embedded);
conformance!(redis);
conformance!(postgres);
conformance!(etcd);

/// A Redis or PostgreSQL store on a fresh prefix, and that prefix (to look at the server).
async fn open_shared(kind: &str) -> (Arc<dyn FenceStore>, String) {
    let prefix = fresh_prefix();
    let url = match kind {
        "redis" => REDIS_URL,
        "postgres" => POSTGRES_URL,
        other => panic!("not a shared store with a wall clock: {other}"),
    };
    let config = Config::parse(&format!(
        "upstream: http://127.0.0.1:1\nstore: {{ kind: {kind}, url: '{url}', prefix: {prefix} }}\n"
    ))
    .unwrap();
    (store::open(&config.store).await.unwrap(), prefix)
}

/// An hour: a forward step of the store server's wall clock, as NTP or an operator makes it.
const STEP: Duration = Duration::from_secs(3600);

/// What a forward step of `by` on the Redis server's clock does to the keys under `prefix`:
/// Redis keeps each expiry as an absolute Unix time, so every key with a TTL loses `by` of it,
/// and the keys with less left are gone. Keys without a TTL are untouched.
pub(crate) async fn step_redis_clock(prefix: &str, by: Duration) {
    let client = ::redis::Client::open(REDIS_URL).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let keys: Vec<String> = ::redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    let by = i64::try_from(by.as_millis()).unwrap();
    for key in keys {
        let left: i64 = ::redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        if left < 0 {
            continue;
        }
        if left <= by {
            let _: i64 = ::redis::cmd("DEL")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .unwrap();
        } else {
            let _: i64 = ::redis::cmd("PEXPIRE")
                .arg(&key)
                .arg(left - by)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    }
}

/// What a forward step of an hour on the PostgreSQL server's clock does to the records under
/// `prefix`: `now()` moves an hour closer to every `expires_at`, which is the same as every
/// `expires_at` moving an hour closer to `now()` (`infinity` stays where it is).
async fn step_postgres_clock(prefix: &str) {
    let (client, connection) = tokio_postgres::connect(POSTGRES_URL, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
        .execute(
            &format!(
                "UPDATE {prefix}_idempotency SET expires_at = expires_at - interval '3600 seconds'"
            ),
            &[],
        )
        .await
        .unwrap();
}

/// A forward step of the store server's wall clock while an attempt runs does not end its
/// in-flight record: a retry is refused as in flight instead of executing beside it, and the
/// attempt's outcome still lands and is replayed.
async fn clock_step_keeps_a_running_attempt(kind: &str) {
    let (store, prefix) = open_shared(kind).await;
    let (r, k) = ("account:step", "pay");
    let a = claim(5.into(), 1);
    assert_eq!(
        store.begin_idempotent(&rid(r), k, &a).await.unwrap(),
        Begin::Execute { previous: None }
    );
    match kind {
        "redis" => step_redis_clock(&prefix, STEP).await,
        _ => step_postgres_clock(&prefix).await,
    }
    let retry = claim(5.into(), 1);
    assert_eq!(
        store.begin_idempotent(&rid(r), k, &retry).await.unwrap(),
        Begin::InFlight,
        "a clock step on the {kind} server ended a running attempt's claim"
    );
    let done = completed(5.into(), 1, b"paid once");
    assert!(store
        .finish_idempotent(&rid(r), k, &a, &done)
        .await
        .unwrap());
    assert_eq!(
        store.begin_idempotent(&rid(r), k, &retry).await.unwrap(),
        Begin::Completed(done)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_clock_step_keeps_a_running_attempt() {
    clock_step_keeps_a_running_attempt("redis").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_clock_step_keeps_a_running_attempt() {
    clock_step_keeps_a_running_attempt("postgres").await
}

/// Two fencegates on one Redis or PostgreSQL prefix: one whose attempts die without an
/// outcome, one that retries, on a monotonic clock the test moves (milliseconds added).
async fn owner_and_observer(kind: &str) -> (Arc<dyn FenceStore>, Arc<dyn FenceStore>, Advance) {
    let (owner, prefix) = open_shared(kind).await;
    let url = if kind == "redis" {
        REDIS_URL
    } else {
        POSTGRES_URL
    };
    let config = Config::parse(&format!(
        "upstream: http://127.0.0.1:1\nstore: {{ kind: {kind}, url: '{url}', prefix: {prefix} }}\n"
    ))
    .unwrap();
    let base = tokio::time::Instant::now();
    let offset = Arc::new(AtomicU64::new(0));
    let read = Arc::clone(&offset);
    let clock: Clock =
        Arc::new(move || base + Duration::from_millis(read.load(AtomicOrdering::SeqCst)));
    let observer = store::open_with_clock(&config.store, clock).await.unwrap();
    (owner, observer, Advance(offset))
}

struct Advance(Arc<AtomicU64>);

impl Advance {
    fn by(&self, d: Duration) {
        self.0.fetch_add(
            u64::try_from(d.as_millis()).unwrap(),
            AtomicOrdering::SeqCst,
        );
    }
}

fn lasting(window: Duration, token: Token) -> Claim {
    Claim {
        window,
        ..claim(token, 1)
    }
}

/// An attempt that never records an outcome (its fencegate died) keeps its key in flight for
/// a whole in-flight lifetime on the retrying fencegate's monotonic clock from when it first
/// saw it in flight, not a millisecond less; then a retry takes the key over and executes, and
/// the dead attempt's outcome, should it arrive, no longer lands.
async fn dead_owner_is_taken_over_after_its_lifetime(kind: &str) {
    let (owner, observer, advance) = owner_and_observer(kind).await;
    let (r, k) = ("account:dead", "pay");
    let minute = Duration::from_secs(60);
    let a = lasting(minute, 5.into());
    assert_eq!(
        owner.begin_idempotent(&rid(r), k, &a).await.unwrap(),
        Begin::Execute { previous: None }
    );
    assert_eq!(
        observer
            .begin_idempotent(&rid(r), k, &lasting(minute, 5.into()))
            .await
            .unwrap(),
        Begin::InFlight
    );
    advance.by(minute - Duration::from_millis(1));
    assert_eq!(
        observer
            .begin_idempotent(&rid(r), k, &lasting(minute, 5.into()))
            .await
            .unwrap(),
        Begin::InFlight,
        "taken over before the in-flight lifetime passed"
    );
    advance.by(Duration::from_millis(1));
    let retry = lasting(minute, 5.into());
    assert_eq!(
        observer.begin_idempotent(&rid(r), k, &retry).await.unwrap(),
        Begin::Execute {
            previous: Some(5.into())
        },
        "never taken over"
    );
    // The key is the retry's now.
    assert!(!owner
        .finish_idempotent(&rid(r), k, &a, &completed(5.into(), 1, b"late"))
        .await
        .unwrap());
    assert_eq!(
        owner
            .begin_idempotent(&rid(r), k, &lasting(minute, 5.into()))
            .await
            .unwrap(),
        Begin::InFlight
    );
    let done = completed(5.into(), 1, b"paid once");
    assert!(observer
        .finish_idempotent(&rid(r), k, &retry, &done)
        .await
        .unwrap());
    assert_eq!(
        owner
            .begin_idempotent(&rid(r), k, &claim(5.into(), 1))
            .await
            .unwrap(),
        Begin::Completed(done)
    );
}

/// A retry that claims with a shorter in-flight lifetime than the running attempt's (another
/// configuration) waits for the attempt's.
async fn takeover_waits_for_the_owners_lifetime(kind: &str) {
    let (owner, observer, advance) = owner_and_observer(kind).await;
    let (r, k) = ("account:long", "pay");
    let (minute, two) = (Duration::from_secs(60), Duration::from_secs(120));
    assert_eq!(
        owner
            .begin_idempotent(&rid(r), k, &lasting(two, 5.into()))
            .await
            .unwrap(),
        Begin::Execute { previous: None }
    );
    for step in [Duration::ZERO, minute, minute - Duration::from_millis(1)] {
        advance.by(step);
        assert_eq!(
            observer
                .begin_idempotent(&rid(r), k, &lasting(minute, 5.into()))
                .await
                .unwrap(),
            Begin::InFlight
        );
    }
    advance.by(Duration::from_millis(1));
    assert_eq!(
        observer
            .begin_idempotent(&rid(r), k, &lasting(minute, 5.into()))
            .await
            .unwrap(),
        Begin::Execute {
            previous: Some(5.into())
        }
    );
}

/// A takeover names the attempt seen in flight; when another attempt has claimed the key
/// since, the takeover does nothing: that attempt keeps its key and records its outcome, and
/// its own lifetime starts when it is first seen.
async fn takeover_of_a_finished_attempt_does_nothing(kind: &str) {
    let (owner, observer, advance) = owner_and_observer(kind).await;
    let (r, k) = ("account:moved", "pay");
    let minute = Duration::from_secs(60);
    let a = lasting(minute, 5.into());
    assert_eq!(
        owner.begin_idempotent(&rid(r), k, &a).await.unwrap(),
        Begin::Execute { previous: None }
    );
    assert_eq!(
        observer
            .begin_idempotent(&rid(r), k, &lasting(minute, 5.into()))
            .await
            .unwrap(),
        Begin::InFlight
    );
    // The first attempt ends unknown, a second one claims the key (the observer sees neither).
    assert!(owner
        .finish_idempotent(&rid(r), k, &a, &Record::unknown(5.into(), fp(1)))
        .await
        .unwrap());
    let b = lasting(minute, 5.into());
    assert_eq!(
        owner.begin_idempotent(&rid(r), k, &b).await.unwrap(),
        Begin::Execute {
            previous: Some(5.into())
        }
    );
    // The observer's takeover names the first attempt: the second one's record stays.
    advance.by(minute);
    assert_eq!(
        observer
            .begin_idempotent(&rid(r), k, &lasting(minute, 5.into()))
            .await
            .unwrap(),
        Begin::InFlight
    );
    advance.by(minute - Duration::from_millis(1));
    assert_eq!(
        observer
            .begin_idempotent(&rid(r), k, &lasting(minute, 5.into()))
            .await
            .unwrap(),
        Begin::InFlight
    );
    let done = completed(5.into(), 1, b"second");
    assert!(owner
        .finish_idempotent(&rid(r), k, &b, &done)
        .await
        .unwrap());
    assert_eq!(
        observer
            .begin_idempotent(&rid(r), k, &claim(5.into(), 1))
            .await
            .unwrap(),
        Begin::Completed(done)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_dead_owner_is_taken_over_after_its_lifetime() {
    dead_owner_is_taken_over_after_its_lifetime("redis").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_dead_owner_is_taken_over_after_its_lifetime() {
    dead_owner_is_taken_over_after_its_lifetime("postgres").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_takeover_waits_for_the_owners_lifetime() {
    takeover_waits_for_the_owners_lifetime("redis").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_takeover_waits_for_the_owners_lifetime() {
    takeover_waits_for_the_owners_lifetime("postgres").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_takeover_of_a_finished_attempt_does_nothing() {
    takeover_of_a_finished_attempt_does_nothing("redis").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_takeover_of_a_finished_attempt_does_nothing() {
    takeover_of_a_finished_attempt_does_nothing("postgres").await
}
