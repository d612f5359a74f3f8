//! Property tests of the embedded store against a model: random operations on a few resources
//! through a cache far smaller than them (misses and evictions on most operations), with
//! reopenings and with lower bounds planted in the cache as a late read would leave them (a
//! maximum of the past). Every answer must be the model's, but that a refusal may name such a
//! past maximum instead of the current one. The cases are drawn from seeds (xorshift), so a failure names
//! the seed that replays it: `FENCEGATE_PROPERTY_SEED=<seed> cargo test --lib
//! store::embedded::properties`.

use crate::fence::resource::rid;
use crate::fence::token::tk;
use crate::fence::token::Token;
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

use super::*;
use crate::config::EqualTokens;
use crate::idempotency::{AttemptId, Fingerprint};
use crate::sync::Locked;

/// Deterministic pseudo-random numbers.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<T: Copy>(&mut self, of: &[T]) -> T {
        of[self.below(of.len() as u64) as usize]
    }
}

/// The seeds to run: one from the environment, or `cases` of them.
fn seeds(cases: u64) -> Vec<u64> {
    match std::env::var("FENCEGATE_PROPERTY_SEED") {
        Ok(seed) => vec![seed.parse().expect("FENCEGATE_PROPERTY_SEED is a number")],
        Err(_) => (1..=cases).collect(),
    }
}

/// `token.equal` either way, and `token.max_step` off or small enough to refuse some of the
/// tokens drawn (0..24).
fn rule(rng: &mut Rng) -> Rule {
    Rule {
        equal: rng.pick(&[EqualTokens::Allow, EqualTokens::Reject]),
        max_step: rng.pick(&[None, Some(3), Some(12)]),
    }
}

fn claim(rng: &mut Rng, token: Token) -> Claim {
    Claim {
        token,
        fingerprint: Fingerprint([rng.below(2) as u8; 32]),
        rule: rule(rng),
        window: Duration::from_secs(60),
        may_execute: true,
        attempt: AttemptId::next(),
    }
}

/// One sequence of operations against the store and the model; panics with the seed and the
/// step at the first difference.
async fn sequence(seed: u64) {
    let mut rng = Rng::new(seed);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.db");
    let sizes = [0, 1, 2, 3, 5];
    let mut store = EmbeddedStore::open(&path, "p", rng.pick(&sizes)).unwrap();
    let resources: Vec<String> = (0..2 + rng.below(8)).map(|i| format!("r{i}")).collect();
    let mut model: HashMap<String, Token> = HashMap::new();
    // Every maximum each resource had.
    let mut history: HashMap<String, Vec<Token>> = HashMap::new();
    let mut keys = 0;
    for step in 0..120 {
        let at = format!("seed {seed}, step {step}");
        let r = resources[rng.below(resources.len() as u64) as usize].as_str();
        let token = tk(rng.below(24));
        match rng.below(100) {
            0..=49 => {
                let rule = rule(&mut rng);
                let verdict = store.compare_and_raise(&rid(r), token, rule).await.unwrap();
                let want = decide(model.get(r).copied(), token, rule);
                let at = format!("{at}: raise {r} to {token} ({rule:?})");
                match (verdict, want) {
                    (Verdict::Stale { current }, Verdict::Stale { .. }) => {
                        assert!(history[r].contains(&current), "{at}: {verdict:?}");
                        assert_eq!(decide(Some(current), token, rule), verdict, "{at}");
                    }
                    _ => assert_eq!(verdict, want, "{at}"),
                }
                if verdict.raised(token) {
                    model.insert(r.to_owned(), token);
                    history.entry(r.to_owned()).or_default().push(token);
                }
            }
            50..=59 => {
                let current = store.current(&rid(r)).await.unwrap();
                assert_eq!(current, model.get(r).copied(), "{at}: current of {r}");
            }
            60..=71 => {
                // A read that started before a raise committed caches what it read late (a past
                // maximum, not exact), or a commit is running.
                if let Some(past) = history.get(r) {
                    let value = past[rng.below(past.len() as u64) as usize];
                    store.shared.cache.observe(r, value);
                }
                store.shared.cache.unconfirm(r);
            }
            72..=76 => {
                drop(store);
                store = EmbeddedStore::open(&path, "p", rng.pick(&sizes)).unwrap();
            }
            _ => {
                keys += 1;
                let key = format!("k{keys}");
                let c = claim(&mut rng, token);
                let begin = store.begin_idempotent(&rid(r), &key, &c).await.unwrap();
                let want = idempotency::decide(None, model.get(r).copied(), &c);
                assert_eq!(begin, want, "{at}: claim {r} with {token}");
                if let Begin::Execute { .. } = begin {
                    if model.get(r).is_none_or(|&m| token > m) {
                        model.insert(r.to_owned(), token);
                        history.entry(r.to_owned()).or_default().push(token);
                    }
                    if rng.below(2) == 0 {
                        let done = Record {
                            phase: Phase::Completed,
                            status: Some(200),
                            ..c.in_flight()
                        };
                        assert!(store
                            .finish_idempotent(&rid(r), &key, &c, &done)
                            .await
                            .unwrap());
                    }
                }
            }
        }
        assert!(store.cached() <= store.shared.cache.capacity(), "{at}");
    }
    // After a last reopening, every maximum is still there.
    drop(store);
    let store = EmbeddedStore::open(&path, "p", 1).unwrap();
    for r in &resources {
        let current = store.current(&rid(r)).await.unwrap();
        assert_eq!(
            current,
            model.get(r).copied(),
            "seed {seed}: {r} after reopening"
        );
    }
}

#[tokio::test]
async fn sequences_through_a_small_cache_answer_as_the_model() {
    for seed in seeds(40) {
        sequence(seed).await;
    }
}

/// One raise as seen from outside: when it began and ended (ticks of one counter), and what
/// it answered.
#[derive(Debug, Clone, Copy)]
struct Seen {
    resource: usize,
    token: Token,
    began: u64,
    ended: u64,
    verdict: Verdict,
}

/// Writers race on a few resources through a cache of one, while another task evicts and plants
/// late lower bounds. Every answer must fit some order of the raises that respects real time:
/// no token is admitted below a token whose admission had been answered before it began, a
/// refusal names a maximum that was admitted, and the file ends at the highest admitted token.
async fn race(seed: u64) {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(EmbeddedStore::open(&dir.path().join("f.db"), "p", 1).unwrap());
    let clock = Arc::new(AtomicU64::new(0));
    let seen = Arc::new(Mutex::new(Vec::new()));
    // Admissions answered so far, per resource: maxima of the past, what a late read may have
    // seen.
    let answered: Arc<[Mutex<Vec<Token>>; 3]> = Arc::new(Default::default());
    let writers: Vec<_> = (0..4u64)
        .map(|w| {
            let (store, clock, seen) = (store.clone(), clock.clone(), seen.clone());
            let answered = answered.clone();
            tokio::spawn(async move {
                let mut rng = Rng::new(seed * 31 + w);
                for _ in 0..40 {
                    let resource = rng.below(3) as usize;
                    let token = tk(1 + rng.below(60));
                    let began = clock.fetch_add(1, Ordering::SeqCst);
                    let verdict = store
                        .compare_and_raise(
                            &rid(&format!("r{resource}")),
                            token,
                            EqualTokens::Allow.into(),
                        )
                        .await
                        .unwrap();
                    let ended = clock.fetch_add(1, Ordering::SeqCst);
                    if let Verdict::Admitted { .. } = verdict {
                        answered[resource].locked().push(token);
                    }
                    seen.locked().push(Seen {
                        resource,
                        token,
                        began,
                        ended,
                        verdict,
                    });
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();
    let meddler = {
        let (store, answered) = (store.clone(), answered.clone());
        tokio::spawn(async move {
            let mut rng = Rng::new(seed ^ 0xDEAD_BEEF);
            for i in 0..200 {
                let resource = rng.below(3) as usize;
                let past = answered[resource].locked().clone();
                if !past.is_empty() {
                    let value = past[rng.below(past.len() as u64) as usize];
                    store.shared.cache.observe(&format!("r{resource}"), value);
                } else {
                    store.shared.cache.observe(&format!("other{i}"), 1.into());
                }
                tokio::task::yield_now().await;
            }
        })
    };
    for writer in writers {
        writer.await.unwrap();
    }
    meddler.await.unwrap();
    let seen = seen.locked().clone();
    for a in &seen {
        let at = format!("seed {seed}: {a:?}");
        let admitted = |s: &&Seen| matches!(s.verdict, Verdict::Admitted { .. });
        let same = |s: &&Seen| s.resource == a.resource;
        match a.verdict {
            Verdict::Admitted { .. } => {
                let earlier = seen
                    .iter()
                    .filter(same)
                    .filter(admitted)
                    .filter(|b| b.ended < a.began && b.token > a.token);
                assert_eq!(
                    earlier.count(),
                    0,
                    "{at}: admitted below an earlier admission"
                );
            }
            Verdict::Stale { current } => {
                assert!(current > a.token, "{at}");
                let source = seen
                    .iter()
                    .filter(same)
                    .filter(admitted)
                    .any(|b| b.token == current && b.began < a.ended);
                assert!(
                    source,
                    "{at}: refused with a maximum nobody was admitted with"
                );
            }
            Verdict::TooFar { .. } => panic!("{at}: too far with no token.max_step"),
        }
    }
    for resource in 0..3 {
        let max = seen
            .iter()
            .filter(|s| s.resource == resource && matches!(s.verdict, Verdict::Admitted { .. }))
            .map(|s| s.token)
            .max();
        let current = store.current(&rid(&format!("r{resource}"))).await.unwrap();
        assert_eq!(current, max, "seed {seed}: r{resource} at the end");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_raises_through_a_cache_of_one_stay_linearizable() {
    for seed in seeds(12) {
        race(seed).await;
    }
}
