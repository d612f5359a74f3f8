//! The fencing protocol as a model, explored exhaustively with stateright: a lease service
//! that grants, and lets expire, one lease with a growing token; holders that write with the
//! token they believe they hold (a stalled holder keeps writing after its lease expired); two
//! sidecars, each with its cache of maxima (a lower bound it may evict), in front of one store;
//! the store's compare-and-raise on a primary, replicated asynchronously to a replica, which a
//! failover promotes. Every decision is the production one: [`decide`] answers from a sidecar's
//! cache (only a stale verdict counts there, as in `store::shared`) and on the primary, and
//! [`Verdict::raised`] says whether the maximum moved.
//!
//! Property: once a write was acknowledged (forwarded), no lower token is admitted on its
//! resource. It holds when an admission waits for the replica
//! (`WAIT`, `replicas: 1`); two negative controls must fail with a counterexample: a mutated
//! decision (`<=` where `<` belongs, admitting the token just below the maximum) and
//! acknowledgements that do not wait for the replica while the store fails over.
//!
//! Chosen because the state space of a few holders, sidecars and resources is small enough to
//! visit completely on 2 cores in seconds, stateright explores it breadth-first and prints the
//! shortest trace that breaks a property, and the model is plain Rust that calls the crate's own
//! functions, so it cannot drift from them.

use crate::fence::Token;
use stateright::{Checker, Model, Property};

use crate::config::EqualTokens;
use crate::fence::verdict::{decide, Rule, Verdict};

/// The decision the model runs: [`decide`], or a mutation of it for a negative control.
type Decide = fn(Option<Token>, Token, Rule) -> Verdict;

#[derive(Clone)]
struct Fencing {
    holders: usize,
    sidecars: usize,
    resources: usize,
    /// Grants at most.
    grants: u64,
    /// Writes each holder sends at most.
    writes: u8,
    /// Whether an admission waits until the replica holds the raise (`WAIT`).
    wait: bool,
    /// Failovers at most.
    failovers: u8,
    decide: Decide,
    rule: Rule,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
enum Phase {
    /// At the sidecar, which may refuse it from its cache.
    AtSidecar,
    /// Raised on the primary; acknowledged (and forwarded) once the replica holds it if
    /// `wait`, at once otherwise.
    Raised,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Write {
    sidecar: usize,
    resource: usize,
    token: Token,
    phase: Phase,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    granted: Token,
    /// The holder of the live lease, if any.
    lease: Option<usize>,
    /// The token each holder believes it holds: kept after its lease expired (a stall).
    believes: Vec<Option<Token>>,
    sent: Vec<u8>,
    /// Per sidecar and resource: the cached maximum, a lower bound of the store's.
    cache: Vec<Vec<Option<Token>>>,
    primary: Vec<Option<Token>>,
    replica: Vec<Option<Token>>,
    failovers: u8,
    in_flight: Vec<Write>,
    /// What happened to writes, in order.
    history: Vec<Event>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
enum Event {
    /// The store admitted (resource, token).
    Admitted(usize, Token),
    /// The sidecar acknowledged it and forwarded the write.
    Acknowledged(usize, Token),
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
enum Action {
    Grant(usize),
    Expire,
    Send {
        holder: usize,
        sidecar: usize,
        resource: usize,
    },
    /// The sidecar decides on its cache, the store on its primary (the first action on a
    /// write at the sidecar covers both: a cache miss goes to the store at once).
    Decide(usize),
    Acknowledge(usize),
    Replicate(usize),
    Evict {
        sidecar: usize,
        resource: usize,
    },
    Failover,
}

impl Model for Fencing {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            granted: 0.into(),
            lease: None,
            believes: vec![None; self.holders],
            sent: vec![0; self.holders],
            cache: vec![vec![None; self.resources]; self.sidecars],
            primary: vec![None; self.resources],
            replica: vec![None; self.resources],
            failovers: 0,
            in_flight: Vec::new(),
            history: Vec::new(),
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        if state.lease.is_none() && state.granted.get() < self.grants {
            actions.extend((0..self.holders).map(Action::Grant));
        }
        if state.lease.is_some() {
            actions.push(Action::Expire);
        }
        for holder in 0..self.holders {
            if state.believes[holder].is_some() && state.sent[holder] < self.writes {
                for sidecar in 0..self.sidecars {
                    for resource in 0..self.resources {
                        actions.push(Action::Send {
                            holder,
                            sidecar,
                            resource,
                        });
                    }
                }
            }
        }
        for (i, write) in state.in_flight.iter().enumerate() {
            match write.phase {
                Phase::AtSidecar => actions.push(Action::Decide(i)),
                Phase::Raised => {
                    let held = state.replica[write.resource].is_some_and(|r| r >= write.token);
                    if !self.wait || held {
                        actions.push(Action::Acknowledge(i));
                    }
                }
            }
        }
        for resource in 0..self.resources {
            if state.replica[resource] != state.primary[resource] {
                actions.push(Action::Replicate(resource));
            }
            for sidecar in 0..self.sidecars {
                if state.cache[sidecar][resource].is_some() {
                    actions.push(Action::Evict { sidecar, resource });
                }
            }
        }
        if state.failovers < self.failovers {
            actions.push(Action::Failover);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        match action {
            Action::Grant(holder) => {
                state.granted = state.granted.next()?;
                state.lease = Some(holder);
                state.believes[holder] = Some(state.granted);
            }
            Action::Expire => state.lease = None,
            Action::Send {
                holder,
                sidecar,
                resource,
            } => {
                state.sent[holder] += 1;
                state.in_flight.push(Write {
                    sidecar,
                    resource,
                    token: state.believes[holder]?,
                    phase: Phase::AtSidecar,
                });
            }
            Action::Decide(i) => {
                let write = state.in_flight[i].clone();
                let cached = state.cache[write.sidecar][write.resource];
                // Only a stale verdict may come from the cache (a lower bound).
                if let Some(floor) = cached {
                    if let Verdict::Stale { .. } =
                        (self.decide)(Some(floor), write.token, self.rule)
                    {
                        state.in_flight.remove(i);
                        return Some(state);
                    }
                }
                let current = state.primary[write.resource];
                let verdict = (self.decide)(current, write.token, self.rule);
                let seen = match verdict {
                    Verdict::Admitted { .. } => {
                        if verdict.raised(write.token) {
                            state.primary[write.resource] = Some(write.token);
                        }
                        state.in_flight[i].phase = Phase::Raised;
                        state
                            .history
                            .push(Event::Admitted(write.resource, write.token));
                        write.token
                    }
                    Verdict::Stale { current } => {
                        state.in_flight.remove(i);
                        current
                    }
                    Verdict::TooFar { .. } => {
                        state.in_flight.remove(i);
                        return Some(state);
                    }
                };
                let cache = &mut state.cache[write.sidecar][write.resource];
                *cache = Some(cache.map_or(seen, |c| c.max(seen)));
            }
            Action::Acknowledge(i) => {
                let write = state.in_flight.remove(i);
                state
                    .history
                    .push(Event::Acknowledged(write.resource, write.token));
            }
            Action::Replicate(resource) => state.replica[resource] = state.primary[resource],
            Action::Evict { sidecar, resource } => state.cache[sidecar][resource] = None,
            Action::Failover => {
                state.failovers += 1;
                state.primary = state.replica.clone();
                // Raises not acknowledged yet: their WAIT fails with the old primary (503).
                if self.wait {
                    state.in_flight.retain(|w| w.phase != Phase::Raised);
                }
            }
        }
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![Property::always(PROPERTY, |_, state: &State| {
            state.history.iter().enumerate().all(|(i, event)| {
                let Event::Acknowledged(resource, acknowledged) = event else {
                    return true;
                };
                state.history[i + 1..].iter().all(|later| match later {
                    Event::Admitted(r, t) => r != resource || t >= acknowledged,
                    Event::Acknowledged(..) => true,
                })
            })
        })]
    }
}

/// Once a write with token T was acknowledged, no token below T is admitted on its resource.
/// (Two writes admitted one after the other may still be acknowledged in the other order:
/// forwarding is not ordered by the store; `ordering: serialize` orders it, and is not modelled.)
const PROPERTY: &str = "no token below an acknowledged one is admitted after it";

fn model(wait: bool, decide: Decide) -> Fencing {
    Fencing {
        holders: 2,
        sidecars: 2,
        resources: 1,
        grants: 3,
        writes: 2,
        wait,
        failovers: 1,
        decide,
        rule: Rule::from(EqualTokens::Allow),
    }
}

/// [`decide`] with `<=` where `<` belongs: the token just below the maximum passes.
pub(crate) fn off_by_one(current: Option<Token>, token: Token, rule: Rule) -> Verdict {
    match current {
        Some(c) if token.next().is_some_and(|next| next < c) => Verdict::Stale { current: c },
        _ => decide(current.map(|c| c.min(token)), token, rule),
    }
}

/// Runs the checker on `model` to the end; returns the number of distinct states and the
/// trace that breaks `property`, if one does, as readable lines. Shared by the crate's models,
/// through [`assert_holds`] and [`counterexample`].
pub(crate) fn explore<M>(model: M, property: &'static str) -> (usize, Option<Vec<String>>)
where
    M: Model + Send + Sync + 'static,
    M::State: Clone + Eq + std::hash::Hash + std::fmt::Debug + Send + Sync,
    M::Action: Clone + PartialEq + std::fmt::Debug + Send + Sync,
{
    let started = std::time::Instant::now();
    let checker = model.checker().threads(2).spawn_bfs().join();
    let states = checker.unique_state_count();
    let trace = checker.discovery(property).map(|path| {
        path.into_actions()
            .iter()
            .enumerate()
            .map(|(n, a)| format!("{:>2}. {a:?}", n + 1))
            .collect()
    });
    println!(
        "{states} states, depth {}, {} ms",
        checker.max_depth(),
        started.elapsed().as_millis()
    );
    (states, trace)
}

/// Explores `model` and fails with the counterexample if `property` breaks, or if it visited
/// fewer than `at_least` states (an exploration too small to mean much).
pub(crate) fn assert_holds<M>(model: M, property: &'static str, at_least: usize)
where
    M: Model + Send + Sync + 'static,
    M::State: Clone + Eq + std::hash::Hash + std::fmt::Debug + Send + Sync,
    M::Action: Clone + PartialEq + std::fmt::Debug + Send + Sync,
{
    let (states, trace) = explore(model, property);
    if let Some(trace) = trace {
        panic!("counterexample:\n{}", trace.join("\n"));
    }
    assert!(
        states >= at_least,
        "the exploration is too small: {states} states"
    );
}

/// Explores `model`, a negative control that must break `property`: prints the counterexample
/// (`what` says which mutation) and returns it.
pub(crate) fn counterexample<M>(model: M, property: &'static str, what: &str) -> Vec<String>
where
    M: Model + Send + Sync + 'static,
    M::State: Clone + Eq + std::hash::Hash + std::fmt::Debug + Send + Sync,
    M::Action: Clone + PartialEq + std::fmt::Debug + Send + Sync,
{
    let (_, trace) = explore(model, property);
    let trace = trace.unwrap_or_else(|| panic!("went unnoticed: {what}"));
    println!("counterexample ({what}):\n{}", trace.join("\n"));
    trace
}

#[test]
fn the_protocol_admits_no_lower_token_after_a_higher_one() {
    assert_holds(model(true, decide), PROPERTY, 10_000);
}

/// Negative control: the mutated decision is caught, with a trace.
#[test]
fn a_mutated_decision_is_caught_with_a_counterexample() {
    let trace = counterexample(model(true, off_by_one), PROPERTY, "mutated decision");
    assert!(trace.iter().any(|a| a.contains("Grant")));
}

/// Negative control: acknowledging before the replica holds the raise loses it in a failover,
/// and the checker shows how.
#[test]
fn acknowledging_before_the_replica_is_caught_by_a_failover() {
    let trace = counterexample(model(false, decide), PROPERTY, "no WAIT, failover");
    assert!(trace.iter().any(|a| a.contains("Failover")));
}
