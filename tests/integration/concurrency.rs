//! Many writers racing random tokens on one resource.
//!
//! Checked on the recorded history: the recorded maximum equals the highest admitted token;
//! no token below an already-admitted one (admitted before the later request was sent) is
//! admitted; every refusal names a current token above the refused one; and with
//! `ordering: serialize` the upstream receives admitted writes in non-decreasing order.

use std::sync::Arc;
use std::time::Instant;

use crate::common::*;

#[derive(Debug, Clone, Copy)]
struct Op {
    token: u64,
    sent: Instant,
    answered: Instant,
    admitted: bool,
}

/// Deterministic pseudo-random tokens (xorshift), so a failure can be replayed.
fn tokens(seed: u64, n: usize) -> Vec<u64> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % 1000
        })
        .collect()
}

async fn race(fg: &fencegate::app::Server, seed: u64) -> Vec<Op> {
    let writers = 16;
    let per_writer = 25;
    let mut tasks = Vec::new();
    for w in 0..writers {
        let url = format!("http://{}/accounts/race", fg.listen);
        let mine = tokens(seed + w as u64 * 7919, per_writer);
        tasks.push(tokio::spawn(async move {
            let mut ops = Vec::new();
            for token in mine {
                let sent = Instant::now();
                let reply = send("PUT", &url, &[("fencing-token", &token.to_string())], "").await;
                let answered = Instant::now();
                let admitted = match reply.status.as_u16() {
                    200 => true,
                    409 => {
                        let current = reply.json()["current_token"].as_u64().unwrap();
                        assert!(current > token, "refused {token} against {current}");
                        false
                    }
                    other => panic!("unexpected status {other}: {}", reply.text()),
                };
                ops.push(Op {
                    token,
                    sent,
                    answered,
                    admitted,
                });
            }
            ops
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

/// Returns the first violation: an admitted op whose token is below an op that was admitted
/// (answered) before it was sent.
fn check_no_late_lower(ops: &[Op]) -> Option<(u64, u64)> {
    let mut admitted: Vec<&Op> = ops.iter().filter(|o| o.admitted).collect();
    admitted.sort_by_key(|o| o.answered);
    let mut by_sent: Vec<&Op> = ops.iter().filter(|o| o.admitted).collect();
    by_sent.sort_by_key(|o| o.sent);
    // Sweep: the highest token among ops answered before each op was sent.
    let mut i = 0;
    let mut highest: Option<u64> = None;
    for op in by_sent {
        while i < admitted.len() && admitted[i].answered < op.sent {
            highest = highest.max(Some(admitted[i].token));
            i += 1;
        }
        if let Some(h) = highest {
            if op.token < h {
                return Some((op.token, h));
            }
        }
    }
    None
}

#[test]
fn the_checker_fires_on_a_bad_history() {
    let t0 = Instant::now();
    let later = |ms: u64| t0 + std::time::Duration::from_millis(ms);
    let bad = [
        Op {
            token: 9,
            sent: later(0),
            answered: later(1),
            admitted: true,
        },
        Op {
            token: 5,
            sent: later(2),
            answered: later(3),
            admitted: true,
        },
    ];
    assert_eq!(check_no_late_lower(&bad), Some((5, 9)));
    // Overlapping requests may be admitted in either order.
    let fine = [
        Op {
            token: 9,
            sent: later(0),
            answered: later(5),
            admitted: true,
        },
        Op {
            token: 5,
            sent: later(2),
            answered: later(3),
            admitted: true,
        },
    ];
    assert_eq!(check_no_late_lower(&fine), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writers_never_admit_a_late_lower_token() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let ops = race(&fg, 0x9e37_79b9).await;
    let highest = ops.iter().filter(|o| o.admitted).map(|o| o.token).max();
    assert_eq!(recorded(&fg, "account:race").await, highest);
    assert_eq!(check_no_late_lower(&ops), None);
    assert_eq!(up.count(), ops.iter().filter(|o| o.admitted).count());
    assert!(
        ops.iter().any(|o| !o.admitted),
        "the race produced no refusals at all"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writers_on_the_embedded_store() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let fg = fencegate(
        &up.url(),
        &format!(
            "store: {{ kind: embedded, path: {} }}\n{ACCOUNTS}",
            dir.path().join("f.db").display()
        ),
    )
    .await;
    let ops = race(&fg, 0x1234_5678).await;
    let highest = ops.iter().filter(|o| o.admitted).map(|o| o.token).max();
    assert_eq!(recorded(&fg, "account:race").await, highest);
    assert_eq!(check_no_late_lower(&ops), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serialize_delivers_non_decreasing_tokens_upstream() {
    let up = Arc::new(Upstream::start().await);
    let fg = fencegate(
        &up.url(),
        "routes:\n  - { name: a, path: '/accounts/{id}', resource: 'account:{id}', ordering: serialize, barrier_timeout: 30s }\n",
    )
    .await;
    let ops = race(&fg, 0xdead_beef).await;
    let delivered: Vec<u64> = up.seen().iter().map(|s| s.token().unwrap()).collect();
    assert_eq!(delivered.len(), ops.iter().filter(|o| o.admitted).count());
    assert!(
        delivered.windows(2).all(|w| w[0] <= w[1]),
        "upstream saw tokens out of order: {delivered:?}"
    );
    assert_eq!(
        recorded(&fg, "account:race").await,
        delivered.last().copied()
    );
}
