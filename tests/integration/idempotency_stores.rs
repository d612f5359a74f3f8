//! One conformance suite for the idempotency records every fence store keeps, against real
//! servers: the decision, its coupling with the maximum, the outcome write and expiry.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use fencegate::config::EqualTokens;
use fencegate::idempotency::{AttemptId, Begin, Claim, Fingerprint, Phase, Record, StoredResponse};
use fencegate::store::{FenceStore, Verdict};

use crate::stores::open;

fn fp(n: u8) -> Fingerprint {
    Fingerprint([n; 32])
}

fn claim(token: u64, f: u8) -> Claim {
    Claim {
        token,
        fingerprint: fp(f),
        equal: EqualTokens::Allow,
        window: Duration::from_secs(60),
        may_execute: true,
        attempt: AttemptId::next(),
    }
}

fn completed(token: u64, f: u8, body: &'static [u8]) -> Record {
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
        }),
        attempt: None,
    }
}

/// The life of one key: claim, conflicts, completion, replay.
async fn claim_complete_replay(store: Arc<dyn FenceStore>) {
    let (r, k) = ("account:1", "key-1");
    let c = claim(5, 1);
    assert_eq!(
        store.begin_idempotent(r, k, &c).await.unwrap(),
        Begin::Execute { previous: None }
    );
    // The claim raised the maximum, in the same step.
    assert_eq!(store.current(r).await.unwrap(), Some(5));
    assert_eq!(
        store.begin_idempotent(r, k, &claim(5, 1)).await.unwrap(),
        Begin::InFlight
    );
    assert_eq!(
        store.begin_idempotent(r, k, &claim(6, 2)).await.unwrap(),
        Begin::Reused
    );
    // Someone else's outcome does not land.
    assert!(!store
        .finish_idempotent(r, k, &claim(4, 1), &completed(4, 1, b"x"))
        .await
        .unwrap());
    let done = completed(5, 1, b"{\"ok\":true}\n");
    assert!(store.finish_idempotent(r, k, &c, &done).await.unwrap());
    // Finishing twice does not land either: the record is no longer in flight.
    assert!(!store.finish_idempotent(r, k, &c, &done).await.unwrap());
    assert_eq!(
        store.begin_idempotent(r, k, &claim(5, 1)).await.unwrap(),
        Begin::Completed(done.clone())
    );
    // A newer epoch was admitted since: the record still answers, nothing executes.
    assert!(matches!(
        store
            .compare_and_raise(r, 9, EqualTokens::Allow)
            .await
            .unwrap(),
        Verdict::Admitted { .. }
    ));
    assert_eq!(
        store.begin_idempotent(r, k, &claim(5, 1)).await.unwrap(),
        Begin::Completed(done.clone())
    );
    let refused = Claim {
        may_execute: false,
        ..claim(5, 1)
    };
    assert_eq!(
        store.begin_idempotent(r, k, &refused).await.unwrap(),
        Begin::Completed(done)
    );
    assert_eq!(
        store.begin_idempotent(r, k, &claim(9, 3)).await.unwrap(),
        Begin::Reused
    );
    assert_eq!(store.current(r).await.unwrap(), Some(9));
    // Keys are per resource.
    assert_eq!(
        store
            .begin_idempotent("account:2", k, &claim(1, 2))
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
    let a = claim(5, 1);
    assert_eq!(
        store.begin_idempotent(r, k, &a).await.unwrap(),
        Begin::Execute { previous: None }
    );
    let b = Claim {
        attempt: AttemptId::next(),
        ..a
    };
    assert!(!store
        .finish_idempotent(r, k, &b, &Record::unknown(5, fp(1)))
        .await
        .unwrap());
    // Still the first attempt's: in flight to everyone else, and its outcome lands.
    let c = Claim {
        attempt: AttemptId::next(),
        ..a
    };
    assert_eq!(
        store.begin_idempotent(r, k, &c).await.unwrap(),
        Begin::InFlight
    );
    let done = completed(5, 1, b"paid once");
    assert!(store.finish_idempotent(r, k, &a, &done).await.unwrap());
    assert_eq!(
        store.begin_idempotent(r, k, &c).await.unwrap(),
        Begin::Completed(done)
    );
}

/// A stale token claims nothing; `may_execute: false` claims nothing.
async fn stale_claims_nothing(store: Arc<dyn FenceStore>) {
    let r = "account:s";
    assert!(matches!(
        store
            .compare_and_raise(r, 10, EqualTokens::Allow)
            .await
            .unwrap(),
        Verdict::Admitted { .. }
    ));
    assert_eq!(
        store.begin_idempotent(r, "k", &claim(5, 1)).await.unwrap(),
        Begin::Stale { current: 10 }
    );
    let reject = Claim {
        equal: EqualTokens::Reject,
        ..claim(10, 1)
    };
    assert_eq!(
        store.begin_idempotent(r, "k", &reject).await.unwrap(),
        Begin::Stale { current: 10 }
    );
    let refused = Claim {
        may_execute: false,
        ..claim(11, 1)
    };
    assert_eq!(
        store.begin_idempotent(r, "k", &refused).await.unwrap(),
        Begin::Refused
    );
    assert_eq!(store.current(r).await.unwrap(), Some(10));
    assert_eq!(
        store.begin_idempotent(r, "k", &claim(11, 1)).await.unwrap(),
        Begin::Execute { previous: Some(10) }
    );
    assert_eq!(store.current(r).await.unwrap(), Some(11));
}

/// An unknown outcome is redone only with a token at least the recorded one.
async fn unknown_outcome(store: Arc<dyn FenceStore>) {
    let (r, k) = ("account:u", "k");
    let c = claim(7, 1);
    assert_eq!(
        store.begin_idempotent(r, k, &c).await.unwrap(),
        Begin::Execute { previous: None }
    );
    assert!(store
        .finish_idempotent(r, k, &c, &Record::unknown(7, fp(1)))
        .await
        .unwrap());
    assert_eq!(
        store.begin_idempotent(r, k, &claim(6, 1)).await.unwrap(),
        Begin::Stale { current: 7 }
    );
    assert_eq!(
        store.begin_idempotent(r, k, &claim(7, 2)).await.unwrap(),
        Begin::Reused
    );
    let same = Claim {
        equal: EqualTokens::Reject,
        ..claim(7, 1)
    };
    assert_eq!(
        store.begin_idempotent(r, k, &same).await.unwrap(),
        Begin::Execute { previous: Some(7) }
    );
    assert_eq!(
        store.begin_idempotent(r, k, &claim(8, 1)).await.unwrap(),
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
                .begin_idempotent("account:c", "dup", &claim(100 + i % 3, 1))
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
        ..claim(3, 1)
    };
    assert_eq!(
        store.begin_idempotent(r, k, &short).await.unwrap(),
        Begin::Execute { previous: None }
    );
    assert!(store
        .finish_idempotent(r, k, &short, &completed(3, 1, b"done"))
        .await
        .unwrap());
    assert!(matches!(
        store.begin_idempotent(r, k, &short).await.unwrap(),
        Begin::Completed(_)
    ));
    // Poll until the store has expired it (bounded): the window is the store's clock.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match store.begin_idempotent(r, k, &short).await.unwrap() {
            Begin::Completed(_) => {
                assert!(Instant::now() < deadline, "the record never expired");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Begin::Execute { previous } => {
                assert_eq!(previous, Some(3));
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
