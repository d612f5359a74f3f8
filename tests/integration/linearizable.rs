//! Store histories checked for linearizability. Concurrent clients run compare-and-raise
//! through each real store (`store::open`, cache included) while the store's server is killed
//! with `kill -9` and restarted; every call is recorded with its invocation and response
//! instants, and the history is checked against the sequential specification of a fence (a
//! maximum per resource) by a Wing–Gong search with memoisation (as Knossos and Porcupine do),
//! one resource at a time (linearizability is local). A call that failed (`503` in the proxy)
//! has an unknown outcome: it may have taken effect at any instant after it was sent, or never.
//! Negative controls: a hand-made history that is not linearizable, and a store whose
//! compare-and-raise is not atomic (read, pause, write), must both be refused.

use crate::common::rid;
use crate::common::tk;
use fencegate::fence::{ResourceId, Token};
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fencegate::config::{Config, EqualTokens};
use fencegate::idempotency::{Begin, Claim, Record};
use fencegate::lease::{Acquired, LeaseBackend};
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

/// A sequential specification, for the search: the states a call may leave behind, from a
/// state, given what it answered. An unknown outcome that would change nothing yields no state
/// (never placing it is the same, and the search covers that).
trait Spec {
    type State: Clone + Eq + std::hash::Hash;
    type Call: Recorded;
    const WHAT: &'static str;
    fn init(&self) -> Self::State;
    fn next(&self, call: &Self::Call, state: &Self::State) -> Vec<Self::State>;
}

/// A fence: the maximum of one resource.
struct Fence;

impl Spec for Fence {
    type State = Option<u64>;
    type Call = Call;
    const WHAT: &'static str = "a fence";

    fn init(&self) -> Option<u64> {
        None
    }

    /// An admission reports the maximum it raised (equal tokens pass); a stale verdict names a
    /// maximum above the token that is at most the store's (a sidecar's cache answers with a
    /// lower bound); an unknown outcome that took effect raised the maximum.
    fn next(&self, call: &Call, max: &Option<u64>) -> Vec<Option<u64>> {
        let (t, max) = (call.token, *max);
        let raised = Some(max.map_or(t, |m| m.max(t)));
        match call.outcome {
            Outcome::Admitted { previous } => {
                if previous == max && max.is_none_or(|m| t >= m) {
                    vec![raised]
                } else {
                    vec![]
                }
            }
            Outcome::Stale { current } => {
                if t < current && max.is_some_and(|m| current <= m) {
                    vec![max]
                } else {
                    vec![]
                }
            }
            Outcome::Unknown if max.is_none_or(|m| t > m) => vec![raised],
            Outcome::Unknown => vec![],
        }
    }
}

/// Whether `calls` (at most 128, of one object) are linearizable under `spec`; `Err` says how
/// far the search got.
fn linearizable<S: Spec>(spec: &S, calls: &[S::Call]) -> Result<(), String> {
    assert!(calls.len() <= 128, "too many calls on one object");
    let known: u128 = calls
        .iter()
        .enumerate()
        .filter(|(_, c)| c.answered().is_some())
        .fold(0, |m, (i, _)| m | 1 << i);
    let mut seen = HashSet::new();
    let mut deepest = 0;
    if search(spec, calls, known, 0, spec.init(), &mut seen, &mut deepest) {
        Ok(())
    } else {
        Err(format!(
            "no order of the {} calls fits {}: at most {deepest} of them could be placed \
             ({} states tried)",
            calls.len(),
            S::WHAT,
            seen.len()
        ))
    }
}

fn search<S: Spec>(
    spec: &S,
    calls: &[S::Call],
    known: u128,
    done: u128,
    state: S::State,
    seen: &mut HashSet<(u128, S::State)>,
    deepest: &mut u32,
) -> bool {
    if done & known == known {
        return true;
    }
    if !seen.insert((done, state.clone())) {
        return false;
    }
    *deepest = (*deepest).max(done.count_ones());
    // A call can go next only if it was sent before every call not yet placed was answered.
    let horizon = calls
        .iter()
        .enumerate()
        .filter(|(i, _)| done & 1 << i == 0)
        .filter_map(|(_, c)| c.answered())
        .min()
        .unwrap_or(u64::MAX);
    for (i, call) in calls.iter().enumerate() {
        if done & 1 << i != 0 || call.sent() > horizon {
            continue;
        }
        for next in spec.next(call, &state) {
            if search(spec, calls, known, done | 1 << i, next, seen, deepest) {
                return true;
            }
        }
    }
    false
}

/// Checks every resource's calls under `spec`; the first that is not linearizable, if one is
/// not.
fn verdict<S: Spec>(spec: &S, calls: &[S::Call]) -> Result<(), String> {
    for r in 0..RESOURCES {
        let mine: Vec<S::Call> = calls
            .iter()
            .filter(|c| c.resource() == r)
            .cloned()
            .collect();
        linearizable(spec, &mine).map_err(|e| format!("resource {r}: {e}"))?;
    }
    Ok(())
}

/// Checks a recorded run and prints `{kind}: {n} calls ({summary}; … answered after the fault),
/// checked in …: {verdict}`; panics if it is not linearizable, or if no call was answered after
/// the fault ended (the history would say nothing of what the fault kept). Returns how many
/// calls had an unknown outcome.
fn judge<S: Spec>(spec: &S, kind: &str, calls: &[S::Call], over: u64, summary: String) -> usize {
    let after = calls
        .iter()
        .filter(|c| c.sent() > over && c.answered().is_some())
        .count();
    let started = Instant::now();
    let verdict = verdict(spec, calls);
    println!(
        "{kind}: {} calls ({summary}; {after} answered after the fault), checked in {} ms: {}",
        calls.len(),
        started.elapsed().as_millis(),
        match &verdict {
            Ok(()) => "linearizable".to_owned(),
            Err(e) => e.clone(),
        }
    );
    verdict.unwrap();
    assert!(after > 0, "no call was answered after the fault");
    calls.iter().filter(|c| c.answered().is_none()).count()
}

const RESOURCES: usize = 12;
/// Answered calls each client makes after the fault ended, at least.
const AFTER: usize = 8;
/// The pause between a client's calls: a run outlasts its fault without making more calls than
/// the search takes (128 per resource).
fn pace(random: u64) -> Duration {
    Duration::from_millis(40 + random % 20)
}

const CLIENTS: usize = 6;
/// Answered calls per client; besides, at most `UNKNOWN` unanswered ones (a failover of a few
/// seconds leaves about 20 per client at one try per 200 ms).
const CALLS: usize = 45;
const UNKNOWN: usize = 50;

/// A call as the search needs it: its resource, and when it was sent and answered (µs since
/// the start of the run; `None`: never answered, the outcome is unknown).
trait Recorded: Clone + Send + 'static {
    fn resource(&self) -> usize;
    fn sent(&self) -> u64;
    fn answered(&self) -> Option<u64>;
}

/// A client's own sequence of choices (xorshift), the same in every run.
struct Rng(u64);

impl Rng {
    fn new(client: usize) -> Self {
        Rng(0x9e37_79b9_7f4a_7c15 ^ (client as u64 + 1))
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn resource(&mut self) -> usize {
        (self.next() % RESOURCES as u64) as usize
    }
}

/// What the clients of a run share: the clock, the count of calls sent (from 10; the fault
/// waits on it, and the fence clients draw their tokens from it) and when the fault ended (µs
/// since the start; 0 while it runs).
#[derive(Clone)]
struct Run {
    start: Instant,
    sent: Arc<AtomicU64>,
    over: Arc<AtomicU64>,
    deadline: Instant,
}

impl Run {
    fn now(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    /// Whether a client with these calls is done: enough answered, the fault over and enough
    /// answered since, or too many unknown, or out of time.
    fn done<C: Recorded>(&self, calls: &[C]) -> bool {
        let over = self.over.load(Ordering::Relaxed);
        let ok = calls.iter().filter(|c| c.answered().is_some()).count();
        let after = calls
            .iter()
            .filter(|c| c.answered().is_some() && over != 0 && c.sent() > over)
            .count();
        (ok >= CALLS && over != 0 && after >= AFTER)
            || calls.len() - ok >= UNKNOWN
            || Instant::now() > self.deadline
    }
}

/// Runs `CLIENTS` clients (`client(n, run)` makes and records its calls until `run.done`) while
/// `fault` runs (given the count of calls sent); returns every call, and when the fault ended.
async fn record<C, Client, F>(
    client: impl Fn(usize, Run) -> Client,
    fault: impl FnOnce(Arc<AtomicU64>) -> F,
) -> (Vec<C>, u64)
where
    C: Recorded,
    Client: std::future::Future<Output = Vec<C>> + Send + 'static,
    F: std::future::Future<Output = ()>,
{
    let start = Instant::now();
    let run = Run {
        start,
        sent: Arc::new(AtomicU64::new(10)),
        over: Arc::new(AtomicU64::new(0)),
        deadline: start + Duration::from_secs(60),
    };
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|n| tokio::spawn(client(n, run.clone())))
        .collect();
    fault(Arc::clone(&run.sent)).await;
    let over = run.now().max(1);
    run.over.store(over, Ordering::Relaxed);
    let mut calls = Vec::new();
    for task in tasks {
        calls.extend(task.await.unwrap());
    }
    (calls, over)
}

impl Recorded for Call {
    fn resource(&self) -> usize {
        self.resource
    }
    fn sent(&self) -> u64 {
        self.sent
    }
    fn answered(&self) -> Option<u64> {
        self.answered
    }
}

/// A client making compare-and-raises on random resources with tokens around the rising count
/// of calls (some above the maximum, some below).
async fn raise(store: Arc<dyn FenceStore>, prefix: String, n: usize, run: Run) -> Vec<Call> {
    let rule = Rule::from(EqualTokens::Allow);
    let mut rng = Rng::new(n);
    let mut calls: Vec<Call> = Vec::with_capacity(CALLS + UNKNOWN);
    while !run.done(&calls) {
        let resource = rng.resource();
        let token = run.sent.fetch_add(1, Ordering::Relaxed) - rng.next() % 8;
        let name = format!("{prefix}{resource}");
        let sent = run.now();
        let answer = tokio::time::timeout(
            Duration::from_secs(3),
            store.compare_and_raise(&rid(&name), tk(token), rule),
        )
        .await;
        let (outcome, answered) = match answer {
            Ok(Ok(Verdict::Admitted { previous })) => {
                let previous = previous.map(Token::get);
                (Outcome::Admitted { previous }, Some(run.now()))
            }
            Ok(Ok(Verdict::Stale { current })) => {
                let current = current.get();
                (Outcome::Stale { current }, Some(run.now()))
            }
            Ok(Ok(Verdict::TooFar { .. })) => panic!("no max_step here"),
            Ok(Err(_)) | Err(_) => (Outcome::Unknown, None),
        };
        if answered.is_none() {
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
        tokio::time::sleep(pace(rng.next())).await;
    }
    calls
}

/// [`record`] with [`raise`] clients on `store`.
async fn record_raises<F: std::future::Future<Output = ()>>(
    store: Arc<dyn FenceStore>,
    prefix: &str,
    fault: impl FnOnce(Arc<AtomicU64>) -> F,
) -> (Vec<Call>, u64) {
    let client = |n, run| raise(Arc::clone(&store), prefix.to_owned(), n, run);
    record(client, fault).await
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
    let (calls, over) = record_raises(store, prefix, fault).await;
    let count = |f: fn(&Outcome) -> bool| calls.iter().filter(|c| f(&c.outcome)).count();
    let summary = format!(
        "{} admitted, {} stale, {} unknown",
        count(|o| matches!(o, Outcome::Admitted { .. })),
        count(|o| matches!(o, Outcome::Stale { .. })),
        count(|o| *o == Outcome::Unknown),
    );
    judge(&Fence, kind, &calls, over, summary)
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
    assert_eq!(linearizable(&Fence, &good), Ok(()));
    let bad = [
        call(5, 0, 10, Outcome::Admitted { previous: None }),
        call(3, 11, 20, Outcome::Admitted { previous: Some(5) }),
    ];
    assert!(linearizable(&Fence, &bad).is_err());
    // A stale answer naming a maximum the store never had.
    let invented = [
        call(5, 0, 10, Outcome::Admitted { previous: None }),
        call(6, 11, 20, Outcome::Stale { current: 9 }),
    ];
    assert!(linearizable(&Fence, &invented).is_err());
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
    assert_eq!(linearizable(&Fence, &unknown), Ok(()));
}

/// A store whose compare-and-raise reads, pauses, then writes: two raises that overlap both
/// read the same maximum, and the later write may lower it. The pause is about as long as a
/// client's pace between calls, so that raises of one resource overlap many times in every
/// run (with 1 ms they overlapped a few times, and a run could hold no lowering at all).
#[derive(Default)]
struct Racy {
    maxima: Mutex<std::collections::HashMap<String, Token>>,
}

impl FenceStore for Racy {
    fn compare_and_raise<'a>(
        &'a self,
        resource: &'a ResourceId,
        token: Token,
        rule: Rule,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>> {
        Box::pin(async move {
            let read = self.maxima.lock().unwrap().get(resource.as_str()).copied();
            tokio::time::sleep(Duration::from_millis(40)).await;
            let verdict = store::decide(read, token, rule);
            if let Verdict::Admitted { .. } = verdict {
                self.maxima
                    .lock()
                    .unwrap()
                    .insert(resource.to_string(), token);
            }
            Ok(verdict)
        })
    }

    fn current<'a>(
        &'a self,
        resource: &'a ResourceId,
    ) -> BoxFuture<'a, Result<Option<Token>, StoreError>> {
        Box::pin(async move { Ok(self.maxima.lock().unwrap().get(resource.as_str()).copied()) })
    }

    fn healthy(&self) -> bool {
        true
    }

    fn kind(&self) -> &'static str {
        "racy"
    }

    fn begin_idempotent<'a>(
        &'a self,
        _: &'a ResourceId,
        _: &'a str,
        _: &'a Claim,
    ) -> BoxFuture<'a, Result<Begin, StoreError>> {
        unreachable!("no idempotency keys here")
    }

    fn finish_idempotent<'a>(
        &'a self,
        _: &'a ResourceId,
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
    let (calls, _) = record_raises(Arc::new(Racy::default()), "racy:", |_| async {}).await;
    let verdict = verdict(&Fence, &calls);
    println!("racy store: {verdict:?}");
    assert!(verdict.is_err(), "the racy store's history passed");
}

/// A lease call: what was asked, and what it answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LeaseOp {
    Acquire,
    /// Renew or release the grant with this lease (an index: ids are long strings).
    Renew(u32),
    Release(u32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LeaseAnswer {
    Granted {
        token: u64,
        lease: u32,
    },
    Held,
    /// What a renewal or a release answered: whether the lease was still this grant.
    Done(bool),
    Unknown,
}

#[derive(Debug, Clone)]
struct LeaseCall {
    resource: usize,
    op: LeaseOp,
    answer: LeaseAnswer,
    sent: u64,
    answered: Option<u64>,
}

/// Who holds a lease, as far as the history tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Holder {
    Known(u32),
    /// A grant whose answer was lost: nobody can renew or release it, and it expires.
    Unknown,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct LeaseState {
    /// The last token granted, or (after a grant whose answer was lost) the least it can be.
    counter: u64,
    holder: Option<Holder>,
}

/// A lease: one holder at a time, every grant's token above every earlier one (a failover may
/// make it jump); a renewal or release succeeds exactly while the lease is that grant. Grants
/// are made with a TTL longer than the run, so only a lease whose grant was never answered can
/// expire (at any moment).
struct Lease;

impl Spec for Lease {
    type State = LeaseState;
    type Call = LeaseCall;
    const WHAT: &'static str = "a lease";

    fn init(&self) -> LeaseState {
        LeaseState {
            counter: 0,
            holder: None,
        }
    }

    fn next(&self, call: &LeaseCall, state: &LeaseState) -> Vec<LeaseState> {
        // A lease whose grant was never answered may have expired before this call.
        let mut from = vec![state.clone()];
        if state.holder == Some(Holder::Unknown) {
            from.push(LeaseState {
                holder: None,
                ..state.clone()
            });
        }
        let mut out = Vec::new();
        for s in from {
            let ours = |lease| s.holder == Some(Holder::Known(lease));
            match (call.op, call.answer) {
                (LeaseOp::Acquire, LeaseAnswer::Granted { token, lease })
                    if s.holder.is_none() && token > s.counter =>
                {
                    out.push(LeaseState {
                        counter: token,
                        holder: Some(Holder::Known(lease)),
                    });
                }
                (LeaseOp::Acquire, LeaseAnswer::Held) if s.holder.is_some() => out.push(s),
                (LeaseOp::Acquire, LeaseAnswer::Unknown) if s.holder.is_none() => {
                    out.push(LeaseState {
                        counter: s.counter + 1,
                        holder: Some(Holder::Unknown),
                    });
                }
                (LeaseOp::Renew(lease), LeaseAnswer::Done(answer)) if ours(lease) == answer => {
                    out.push(s)
                }
                (LeaseOp::Release(lease), LeaseAnswer::Done(answer)) if ours(lease) == answer => {
                    out.push(LeaseState {
                        holder: if answer { None } else { s.holder },
                        ..s
                    });
                }
                (LeaseOp::Release(lease), LeaseAnswer::Unknown) if ours(lease) => {
                    out.push(LeaseState { holder: None, ..s });
                }
                // Answers the state does not allow; and a renewal whose answer was lost, which
                // changes nothing the history can see.
                _ => {}
            }
        }
        out
    }
}

impl Recorded for LeaseCall {
    fn resource(&self) -> usize {
        self.resource
    }
    fn sent(&self) -> u64 {
        self.sent
    }
    fn answered(&self) -> Option<u64> {
        self.answered
    }
}

/// A client acquiring random resources (as holder `c<n>`, TTL 60 s) and, when granted, holding
/// the lease a while, renewing it, holding it again and releasing it. `ids` numbers the lease
/// ids of every client of the run.
async fn lease(
    backend: Arc<dyn LeaseBackend>,
    prefix: String,
    ids: Arc<Mutex<Vec<String>>>,
    n: usize,
    run: Run,
) -> Vec<LeaseCall> {
    let ttl = Duration::from_secs(60);
    let holder = format!("c{n}");
    let mut rng = Rng::new(n);
    let mut calls: Vec<LeaseCall> = Vec::new();
    let call = |resource, op, answer, sent, answered| LeaseCall {
        resource,
        op,
        answer,
        sent,
        answered,
    };
    while !run.done(&calls) {
        let resource = rng.resource();
        let name = format!("{prefix}{resource}");
        run.sent.fetch_add(1, Ordering::Relaxed);
        let sent = run.now();
        let got = tokio::time::timeout(
            Duration::from_secs(3),
            backend.try_acquire(&name, &holder, ttl),
        )
        .await;
        let grant = match got {
            Ok(Ok(Acquired::Granted(grant))) => {
                let lease = {
                    let mut ids = ids.lock().unwrap();
                    ids.push(grant.lease_id.clone());
                    (ids.len() - 1) as u32
                };
                let answer = LeaseAnswer::Granted {
                    token: grant.token.get(),
                    lease,
                };
                calls.push(call(
                    resource,
                    LeaseOp::Acquire,
                    answer,
                    sent,
                    Some(run.now()),
                ));
                Some((grant, lease))
            }
            Ok(Ok(Acquired::Held { .. })) => {
                let answer = LeaseAnswer::Held;
                calls.push(call(
                    resource,
                    LeaseOp::Acquire,
                    answer,
                    sent,
                    Some(run.now()),
                ));
                None
            }
            _ => {
                let answer = LeaseAnswer::Unknown;
                calls.push(call(resource, LeaseOp::Acquire, answer, sent, None));
                // The server is down: try again a little later.
                tokio::time::sleep(Duration::from_millis(200)).await;
                None
            }
        };
        if let Some((grant, lease)) = grant {
            for op in [LeaseOp::Renew(lease), LeaseOp::Release(lease)] {
                // Held a while, so that other clients find it held.
                tokio::time::sleep(pace(rng.next())).await;
                let sent = run.now();
                let done = tokio::time::timeout(Duration::from_secs(3), async {
                    match op {
                        LeaseOp::Renew(_) => backend.renew(&grant, ttl).await,
                        _ => backend.release(&grant).await,
                    }
                })
                .await;
                let (answer, answered) = match done {
                    Ok(Ok(ours)) => (LeaseAnswer::Done(ours), Some(run.now())),
                    _ => (LeaseAnswer::Unknown, None),
                };
                calls.push(call(resource, op, answer, sent, answered));
            }
        }
        tokio::time::sleep(pace(rng.next())).await;
    }
    calls
}

/// Records the lease backend `backend_yaml` names with [`lease`] clients while `fault` runs,
/// and judges the history against [`Lease`] as [`checked`] does.
async fn checked_leases<F: std::future::Future<Output = ()>>(
    kind: &str,
    backend_yaml: &str,
    names: &str,
    fault: impl FnOnce(Arc<AtomicU64>) -> F,
) -> usize {
    let config = Config::parse(&format!(
        "upstream: http://127.0.0.1:9\nstore: {{ kind: memory }}\n\
         leases: {{ backend: {backend_yaml}, ttl: 1s }}\n"
    ))
    .unwrap();
    let backend = fencegate::lease::open(&config.leases.unwrap().backend)
        .await
        .unwrap();
    let ids = Arc::new(Mutex::new(Vec::new()));
    let client = |n, run| {
        let ids = Arc::clone(&ids);
        lease(Arc::clone(&backend), names.to_owned(), ids, n, run)
    };
    let (calls, over) = record(client, fault).await;
    let count = |f: fn(&LeaseAnswer) -> bool| calls.iter().filter(|c| f(&c.answer)).count();
    let summary = format!(
        "{} granted, {} held, {} unknown",
        count(|a| matches!(a, LeaseAnswer::Granted { .. })),
        count(|a| *a == LeaseAnswer::Held),
        count(|a| *a == LeaseAnswer::Unknown),
    );
    judge(&Lease, &format!("{kind} leases"), &calls, over, summary)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_histories_are_linearizable_through_a_kill() {
    let dir = tempfile::tempdir().unwrap();
    let embedded = format!(
        "{{ kind: embedded, path: {} }}",
        dir.path().join("leases.db").display()
    );
    checked_leases("embedded", &embedded, &resources(), |_| async {}).await;
    for kind in [Kind::Redis, Kind::Postgres, Kind::Etcd] {
        let mut server = Service::start(kind).await;
        let yaml = format!("{{ kind: {kind:?}, url: '{}' }}", server.url()).to_lowercase();
        let server = &mut server;
        let unknown = checked_leases(&format!("{kind:?}"), &yaml, &resources(), |sent| {
            kill_and_restart(server, sent)
        })
        .await;
        assert!(unknown > 0, "the kill overlapped no {kind:?} call");
    }
}

/// Negative controls: two grants with no release between them, and a token granted twice.
#[test]
fn a_lease_history_that_fits_no_order_is_refused() {
    let call = |op, answer, sent, answered| LeaseCall {
        resource: 0,
        op,
        answer,
        sent,
        answered: Some(answered),
    };
    let granted = |token, lease| LeaseAnswer::Granted { token, lease };
    let good = [
        call(LeaseOp::Acquire, granted(1, 0), 0, 10),
        call(LeaseOp::Acquire, LeaseAnswer::Held, 11, 20),
        call(LeaseOp::Renew(0), LeaseAnswer::Done(true), 21, 30),
        call(LeaseOp::Release(0), LeaseAnswer::Done(true), 31, 40),
        call(LeaseOp::Acquire, granted(5, 1), 41, 50),
        call(LeaseOp::Release(0), LeaseAnswer::Done(false), 51, 60),
    ];
    assert_eq!(linearizable(&Lease, &good), Ok(()));
    let two_holders = [
        call(LeaseOp::Acquire, granted(1, 0), 0, 10),
        call(LeaseOp::Acquire, granted(2, 1), 11, 20),
    ];
    assert!(linearizable(&Lease, &two_holders).is_err());
    let repeated = [
        call(LeaseOp::Acquire, granted(1, 0), 0, 10),
        call(LeaseOp::Release(0), LeaseAnswer::Done(true), 11, 20),
        call(LeaseOp::Acquire, granted(1, 1), 21, 30),
    ];
    assert!(linearizable(&Lease, &repeated).is_err());
    // A grant whose answer was lost holds the lease until it expires, at any moment.
    let lost = [
        LeaseCall {
            resource: 0,
            op: LeaseOp::Acquire,
            answer: LeaseAnswer::Unknown,
            sent: 0,
            answered: None,
        },
        call(LeaseOp::Acquire, LeaseAnswer::Held, 11, 20),
        call(LeaseOp::Acquire, granted(3, 0), 21, 30),
    ];
    assert_eq!(linearizable(&Lease, &lost), Ok(()));
}

/// Lease histories through the Redis failovers (`replicas: 1`): Sentinel promoting a replica,
/// and a Cluster shard's replica taking over (the killed node restarted as its replica). A
/// grant refused `503` because no replica acknowledged it is an unknown outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_histories_are_linearizable_through_redis_failovers() {
    let mut sentinel = SentinelTopology::start().await;
    let yaml = format!(
        "{{ kind: redis, url: 'redis://{MASTER}/', sentinel: {} }}",
        sentinel.yaml()
    );
    let topology = &mut sentinel;
    let unknown = checked_leases("redis + sentinel", &yaml, &resources(), |sent| async move {
        third_sent(&sent).await;
        topology.primary.kill().await;
        topology.wait_promoted().await;
    })
    .await;
    assert!(unknown > 0, "the Sentinel failover overlapped no call");
    drop(sentinel);

    let mut cluster = ClusterTopology::start().await;
    let yaml = format!(
        "{{ kind: redis, url: '{}', cluster: {} }}",
        cluster.url(),
        cluster.yaml()
    );
    // The shard of resource 0's lease (the backend's default prefix).
    let names = resources();
    let slot = cluster
        .slot_of(&format!("fencegate:{{{names}0}}:lease"))
        .await;
    let (primary, _) = cluster.shard_of(slot).await;
    let topology = &mut cluster;
    let unknown = checked_leases("redis cluster", &yaml, &names, |sent| async move {
        third_sent(&sent).await;
        topology.node(primary.port).kill().await;
        topology.wait_promoted(slot, primary.port).await;
        topology.node(primary.port).restart().await;
    })
    .await;
    assert!(unknown > 0, "the Cluster failover overlapped no call");
}
