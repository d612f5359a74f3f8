//! Store histories checked for linearizability. Concurrent clients run compare-and-raise
//! through each real store (`store::open`, cache included) while the store's server is killed
//! with `kill -9` and restarted; every call is recorded with its invocation and response
//! instants, and the history is checked against the sequential specification of a fence (a
//! maximum per resource) by a Wing–Gong search with memoisation (as Knossos and Porcupine do),
//! one resource at a time (linearizability is local). A call that failed (`503` in the proxy)
//! has an unknown outcome: it may have taken effect at any instant after it was sent, or never.
//! Negative controls: a hand-made history that is not linearizable, and a store whose
//! compare-and-raise is not atomic (read, pause, write), must both be refused.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fencegate::config::{Config, EqualTokens};
use fencegate::idempotency::{Begin, Claim, Record};
use fencegate::store::{self, BoxFuture, FenceStore, Rule, StoreError, Verdict};

use crate::services::*;

/// What a call answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Admitted {
        previous: Option<u64>,
    },
    Stale {
        current: u64,
    },
    /// The store failed to answer: the raise may or may not have happened.
    Unknown,
}

/// One compare-and-raise: on which resource, which token, sent and answered when (µs since
/// the start; `None`: never answered, the outcome is unknown), and what it answered.
#[derive(Debug, Clone)]
struct Call {
    resource: usize,
    token: u64,
    sent: u64,
    answered: Option<u64>,
    outcome: Outcome,
}

/// The maximum after `call` takes effect on `max`, if the specification allows its answer
/// there: an admission reports the maximum it raised (equal tokens pass); a stale verdict
/// names a maximum above the token that is at most the store's (a sidecar's cache answers
/// with a lower bound); an unknown outcome that took effect raised the maximum if it could.
fn step(call: &Call, max: Option<u64>) -> Option<Option<u64>> {
    let t = call.token;
    match call.outcome {
        Outcome::Admitted { previous } => (previous == max && max.is_none_or(|m| t >= m))
            .then(|| Some(max.map_or(t, |m| m.max(t)))),
        Outcome::Stale { current } => {
            (t < current && max.is_some_and(|m| current <= m)).then_some(max)
        }
        Outcome::Unknown => Some(Some(max.map_or(t, |m| m.max(t)))),
    }
}

/// Whether the calls on one resource (at most 128) are linearizable; `Err` says how far the
/// search got.
fn linearizable(calls: &[Call]) -> Result<(), String> {
    assert!(calls.len() <= 128, "too many calls on one resource");
    let known: u128 = calls
        .iter()
        .enumerate()
        .filter(|(_, c)| c.answered.is_some())
        .fold(0, |m, (i, _)| m | 1 << i);
    let mut seen = HashSet::new();
    let mut deepest = 0;
    if search(calls, known, 0, None, &mut seen, &mut deepest) {
        Ok(())
    } else {
        Err(format!(
            "no order of the {} calls fits a fence: at most {deepest} of them could be placed \
             ({} states tried)",
            calls.len(),
            seen.len()
        ))
    }
}

fn search(
    calls: &[Call],
    known: u128,
    done: u128,
    max: Option<u64>,
    seen: &mut HashSet<(u128, Option<u64>)>,
    deepest: &mut u32,
) -> bool {
    if done & known == known {
        return true;
    }
    if !seen.insert((done, max)) {
        return false;
    }
    *deepest = (*deepest).max(done.count_ones());
    // A call can go next only if it was sent before every call not yet placed was answered.
    let horizon = calls
        .iter()
        .enumerate()
        .filter(|(i, _)| done & 1 << i == 0)
        .filter_map(|(_, c)| c.answered)
        .min()
        .unwrap_or(u64::MAX);
    for (i, call) in calls.iter().enumerate() {
        if done & 1 << i != 0 || call.sent > horizon {
            continue;
        }
        // An unknown outcome placed where it cannot raise the maximum changes nothing: the
        // same as never placing it, which the search covers.
        if call.outcome == Outcome::Unknown && max.is_some_and(|m| call.token <= m) {
            continue;
        }
        if let Some(next) = step(call, max) {
            if search(calls, known, done | 1 << i, next, seen, deepest) {
                return true;
            }
        }
    }
    false
}

/// Checks every resource's calls; the first that is not linearizable, if one is not.
fn check(calls: &[Call], resources: usize) -> Result<(), String> {
    for r in 0..resources {
        let mine: Vec<Call> = calls.iter().filter(|c| c.resource == r).cloned().collect();
        linearizable(&mine).map_err(|e| format!("resource {r}: {e}"))?;
    }
    Ok(())
}

const RESOURCES: usize = 6;
const CLIENTS: usize = 6;
/// Answered calls per client; besides, at most `UNKNOWN` unanswered ones (a failover of a few
/// seconds leaves about 20 per client at one try per 200 ms).
const CALLS: usize = 45;
const UNKNOWN: usize = 50;

/// `CLIENTS` tasks, each making compare-and-raises on random resources with tokens around a
/// rising counter (some above the maximum, some below) until `CALLS` were answered, while
/// `fault` runs; `fault` is given the counter, which starts at 10 and counts calls.
async fn record<F: std::future::Future<Output = ()>>(
    store: Arc<dyn FenceStore>,
    prefix: &str,
    fault: impl FnOnce(Arc<AtomicU64>) -> F,
) -> (Vec<Call>, u64) {
    let start = Instant::now();
    let counter = Arc::new(AtomicU64::new(10));
    let deadline = start + Duration::from_secs(60);
    let rule = Rule::from(EqualTokens::Allow);
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let store = Arc::clone(&store);
            let counter = Arc::clone(&counter);
            let prefix = prefix.to_owned();
            tokio::spawn(async move {
                let mut seed = 0x9e37_79b9_7f4a_7c15_u64 ^ (client as u64 + 1);
                let mut next = move || {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed
                };
                let mut calls: Vec<Call> = Vec::with_capacity(CALLS + UNKNOWN);
                let (mut answered_calls, mut unknown) = (0, 0);
                while answered_calls < CALLS && unknown < UNKNOWN && Instant::now() < deadline {
                    let resource = (next() % RESOURCES as u64) as usize;
                    let base = counter.fetch_add(1, Ordering::Relaxed);
                    let token = base - next() % 8;
                    let name = format!("{prefix}{resource}");
                    let sent = start.elapsed().as_micros() as u64;
                    let answer = tokio::time::timeout(
                        Duration::from_secs(3),
                        store.compare_and_raise(&name, token, rule),
                    )
                    .await;
                    let answered = start.elapsed().as_micros() as u64;
                    let (outcome, answered) = match answer {
                        Ok(Ok(Verdict::Admitted { previous })) => {
                            (Outcome::Admitted { previous }, Some(answered))
                        }
                        Ok(Ok(Verdict::Stale { current })) => {
                            (Outcome::Stale { current }, Some(answered))
                        }
                        Ok(Ok(Verdict::TooFar { .. })) => panic!("no max_step here"),
                        Ok(Err(_)) | Err(_) => (Outcome::Unknown, None),
                    };
                    if answered.is_some() {
                        answered_calls += 1;
                    } else {
                        unknown += 1;
                        // The server is down: try again a little later.
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    calls.push(Call {
                        resource,
                        token,
                        sent,
                        answered,
                        outcome,
                    });
                    tokio::time::sleep(Duration::from_millis(next() % 5)).await;
                }
                calls
            })
        })
        .collect();
    fault(Arc::clone(&counter)).await;
    let fault_over = start.elapsed().as_micros() as u64;
    let mut calls = Vec::new();
    for task in tasks {
        calls.extend(task.await.unwrap());
    }
    (calls, fault_over)
}

/// Records a history on the store `yaml` names while `fault` runs, checks it, and prints the
/// verdict; panics if it is not linearizable, or if no call was answered after the fault
/// ended (the history would say nothing of what the fault kept). Returns how many calls had
/// an unknown outcome.
async fn checked<F: std::future::Future<Output = ()>>(
    kind: &str,
    yaml: &str,
    prefix: &str,
    fault: impl FnOnce(Arc<AtomicU64>) -> F,
) -> usize {
    let config = Config::parse(&format!("upstream: http://127.0.0.1:9\n{yaml}")).unwrap();
    let store = store::open(&config.store).await.unwrap();
    let (calls, fault_over) = record(store, prefix, fault).await;
    let after = calls
        .iter()
        .filter(|c| c.sent > fault_over && c.answered.is_some())
        .count();
    let count = |f: fn(&Outcome) -> bool| calls.iter().filter(|c| f(&c.outcome)).count();
    let started = Instant::now();
    let verdict = check(&calls, RESOURCES);
    println!(
        "{kind}: {} calls ({} admitted, {} stale, {} unknown; {after} answered after the fault), \
         checked in {} ms: {}",
        calls.len(),
        count(|o| matches!(o, Outcome::Admitted { .. })),
        count(|o| matches!(o, Outcome::Stale { .. })),
        count(|o| *o == Outcome::Unknown),
        started.elapsed().as_millis(),
        match &verdict {
            Ok(()) => "linearizable".to_owned(),
            Err(e) => e.clone(),
        }
    );
    verdict.unwrap();
    assert!(after > 0, "no call was answered after the fault");
    count(|o| *o == Outcome::Unknown)
}

/// The names of a run's resources, less their number.
fn resources() -> String {
    format!("lin:{}:", fresh_prefix())
}

/// Returns once a third of the calls were sent.
async fn third_sent(sent: &AtomicU64) {
    let third = 10 + (CLIENTS * CALLS / 3) as u64;
    while sent.load(Ordering::Relaxed) < third {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Kills `service` with `kill -9` once a third of the calls were sent, and restarts it 300 ms
/// later.
async fn kill_and_restart(service: &mut Service, sent: Arc<AtomicU64>) {
    third_sent(&sent).await;
    service.kill().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    service.restart().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_history_is_linearizable_through_a_kill() {
    let mut redis = Service::start(Kind::Redis).await;
    let yaml = format!("store: {{ kind: redis, url: '{}' }}\n", redis.url());
    let unknown = checked("redis", &yaml, &resources(), |sent| {
        kill_and_restart(&mut redis, sent)
    })
    .await;
    assert!(unknown > 0, "the kill overlapped no call");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_history_is_linearizable_through_a_kill() {
    let mut postgres = Service::start(Kind::Postgres).await;
    let yaml = format!("store: {{ kind: postgres, url: '{}' }}\n", postgres.url());
    let unknown = checked("postgres", &yaml, &resources(), |sent| {
        kill_and_restart(&mut postgres, sent)
    })
    .await;
    assert!(unknown > 0, "the kill overlapped no call");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_history_is_linearizable_through_a_kill() {
    let mut etcd = Service::start(Kind::Etcd).await;
    let yaml = format!("store: {{ kind: etcd, url: '{}' }}\n", etcd.url());
    let unknown = checked("etcd", &yaml, &resources(), |sent| {
        kill_and_restart(&mut etcd, sent)
    })
    .await;
    assert!(unknown > 0, "the kill overlapped no call");
}

/// Redis with Sentinel (`replicas: 1`): the primary killed with `kill -9` once a third of the
/// calls were sent, a replica promoted. Every raise acknowledged before the kill is on the
/// promoted replica, so the history is linearizable; a raise refused `503` (its `WAIT` failed)
/// is an unknown outcome, which the promotion may keep or lose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sentinel_history_is_linearizable_through_a_failover() {
    let mut topology = SentinelTopology::start().await;
    let yaml = format!(
        "store: {{ kind: redis, url: 'redis://{MASTER}/', sentinel: {} }}\n",
        topology.yaml()
    );
    // Borrowed, not moved, by the fault: the servers live until the test ends.
    let topology = &mut topology;
    let unknown = checked("redis + sentinel", &yaml, &resources(), |sent| async move {
        third_sent(&sent).await;
        topology.primary.kill().await;
        topology.wait_promoted().await;
    })
    .await;
    assert!(unknown > 0, "the failover overlapped no call");
}

/// Redis Cluster (`replicas: 1`): the primary of the first resource's shard killed once a
/// third of the calls were sent, its replica promoted, the killed node restarted (it rejoins as
/// the replica, so the shard's writes can be acknowledged again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_history_is_linearizable_through_a_failover() {
    let mut topology = ClusterTopology::start().await;
    let prefix = fresh_prefix();
    let yaml = format!(
        "store: {{ kind: redis, url: '{}', prefix: {prefix}, cluster: {} }}\n",
        topology.url(),
        topology.yaml()
    );
    // The key of resource 0 (see `record`).
    let names = resources();
    let slot = topology
        .slot_of(&format!("{prefix}:{{{names}0}}:max"))
        .await;
    let (primary, _) = topology.shard_of(slot).await;
    let topology = &mut topology;
    let unknown = checked("redis cluster", &yaml, &names, |sent| async move {
        third_sent(&sent).await;
        topology.node(primary.port).kill().await;
        topology.wait_promoted(slot, primary.port).await;
        topology.node(primary.port).restart().await;
    })
    .await;
    assert!(unknown > 0, "the failover overlapped no call");
}

/// The embedded store, with a cache of one maximum (evicted at nearly every call).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_history_is_linearizable() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        "store: {{ kind: embedded, path: {}, cache_size: 1 }}\n",
        dir.path().join("f.db").display()
    );
    checked("embedded", &yaml, &resources(), |_| async {}).await;
}

/// Negative control, by hand: 5 admitted, then (after its answer) 3 admitted over 5.
#[test]
fn a_history_that_fits_no_order_is_refused() {
    let call = |token, sent, answered, outcome| Call {
        resource: 0,
        token,
        sent,
        answered: Some(answered),
        outcome,
    };
    let good = [
        call(5, 0, 10, Outcome::Admitted { previous: None }),
        call(3, 11, 20, Outcome::Stale { current: 5 }),
        // Overlapping: 7 and 6 may go either way; 6 saw 5, so 6 went first.
        call(7, 21, 40, Outcome::Admitted { previous: Some(6) }),
        call(6, 22, 30, Outcome::Admitted { previous: Some(5) }),
    ];
    assert_eq!(linearizable(&good), Ok(()));
    let bad = [
        call(5, 0, 10, Outcome::Admitted { previous: None }),
        call(3, 11, 20, Outcome::Admitted { previous: Some(5) }),
    ];
    assert!(linearizable(&bad).is_err());
    // A stale answer naming a maximum the store never had.
    let invented = [
        call(5, 0, 10, Outcome::Admitted { previous: None }),
        call(6, 11, 20, Outcome::Stale { current: 9 }),
    ];
    assert!(linearizable(&invented).is_err());
    // An unknown outcome may explain a maximum nobody was told of.
    let unknown = [
        Call {
            resource: 0,
            token: 8,
            sent: 0,
            answered: None,
            outcome: Outcome::Unknown,
        },
        call(6, 11, 20, Outcome::Stale { current: 8 }),
    ];
    assert_eq!(linearizable(&unknown), Ok(()));
}

/// A store whose compare-and-raise reads, pauses, then writes: two raises that overlap both
/// read the same maximum, and the later write may lower it.
#[derive(Default)]
struct Racy {
    maxima: Mutex<std::collections::HashMap<String, u64>>,
}

impl FenceStore for Racy {
    fn compare_and_raise<'a>(
        &'a self,
        resource: &'a str,
        token: u64,
        rule: Rule,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>> {
        Box::pin(async move {
            let read = self.maxima.lock().unwrap().get(resource).copied();
            tokio::time::sleep(Duration::from_millis(1)).await;
            let verdict = store::decide(read, token, rule);
            if let Verdict::Admitted { .. } = verdict {
                self.maxima
                    .lock()
                    .unwrap()
                    .insert(resource.to_owned(), token);
            }
            Ok(verdict)
        })
    }

    fn current<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<u64>, StoreError>> {
        Box::pin(async move { Ok(self.maxima.lock().unwrap().get(resource).copied()) })
    }

    fn healthy(&self) -> bool {
        true
    }

    fn kind(&self) -> &'static str {
        "racy"
    }

    fn begin_idempotent<'a>(
        &'a self,
        _: &'a str,
        _: &'a str,
        _: &'a Claim,
    ) -> BoxFuture<'a, Result<Begin, StoreError>> {
        unreachable!("no idempotency keys here")
    }

    fn finish_idempotent<'a>(
        &'a self,
        _: &'a str,
        _: &'a str,
        _: &'a Claim,
        _: &'a Record,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        unreachable!("no idempotency keys here")
    }
}

/// Negative control, recorded: the non-atomic store's history is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_is_not_atomic_is_caught() {
    let (calls, _) = record(Arc::new(Racy::default()), "racy:", |_| async {}).await;
    let verdict = check(&calls, RESOURCES);
    println!("racy store: {verdict:?}");
    assert!(verdict.is_err(), "the racy store's history passed");
}
