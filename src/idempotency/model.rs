//! The idempotency protocol as a model, explored exhaustively with stateright: holders of
//! successive leases (tokens 1, 2, …) send the same keyed write, and retry it; each attempt
//! asks the store's [`decide`] (the production function) with the key's record and the
//! resource's maximum; an executed attempt reaches the upstream, which may apply it, and ends
//! with a final answer (2xx, recorded `completed`) or one that leaves the outcome unknown (a
//! 5xx: recorded `unknown`, after which a retry may run it again). Only the attempt that
//! claimed the record may write its outcome ([`Record::owned_by`]), as every store does.
//!
//! Property: a key's write is applied at most once, except that each unknown outcome excuses
//! one more application after it (the chaos run's invariant (e)). Within one window: records
//! do not expire in the model (the config keeps the window longer than an attempt may run).
//! Negative control: a decision that runs a completed key again is caught with a trace.

use crate::fence::token::Token;
use stateright::{Model, Property};

use crate::fence::model::{assert_holds, counterexample};

use super::{decide, AttemptId, Begin, Claim, Fingerprint, Phase, Record};
use crate::config::EqualTokens;
use crate::fence::verdict::Rule;

type Decide = fn(Option<&Record>, Option<Token>, &Claim) -> Begin;

/// Every attempt sends the same request: one fingerprint.
const REQUEST: Fingerprint = Fingerprint([7; 32]);

#[derive(Clone)]
struct Keyed {
    /// Lease holders, one after the other: holder `h` writes with token `h + 1`.
    holders: u64,
    /// Attempts each holder makes at most (the first and its retries).
    attempts: u8,
    decide: Decide,
}

/// The key's record, as the model keeps it (hashable).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Kept {
    phase: Phase,
    token: Token,
    attempt: Option<u8>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Attempt {
    id: u8,
    token: Token,
    applied: bool,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
enum Event {
    Applied(u8),
    Unknown(u8),
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    record: Option<Kept>,
    maximum: Option<Token>,
    sent: Vec<u8>,
    next_id: u8,
    running: Vec<Attempt>,
    history: Vec<Event>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
enum Action {
    /// Holder `h` sends (or retries) the keyed write: the store decides.
    Send(u64),
    /// The upstream applies running attempt `i`.
    Apply(usize),
    /// Attempt `i` ends with a final answer (it was applied): recorded `completed`.
    Complete(usize),
    /// Attempt `i` ends with an unknown outcome (applied or not): recorded `unknown`.
    Fail(usize),
}

fn claim(token: Token, id: u8) -> Claim {
    Claim {
        token,
        fingerprint: REQUEST,
        rule: Rule::from(EqualTokens::Allow),
        window: std::time::Duration::from_secs(60),
        may_execute: true,
        attempt: AttemptId(u128::from(id)),
    }
}

fn record(kept: &Kept) -> Record {
    Record {
        phase: kept.phase,
        token: kept.token,
        fingerprint: REQUEST,
        status: None,
        response: None,
        attempt: kept.attempt.map(|a| AttemptId(u128::from(a))),
    }
}

impl Model for Keyed {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            record: None,
            maximum: None,
            sent: vec![0; self.holders as usize],
            next_id: 0,
            running: Vec::new(),
            history: Vec::new(),
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        for h in 0..self.holders {
            if state.sent[h as usize] < self.attempts {
                actions.push(Action::Send(h));
            }
        }
        for (i, attempt) in state.running.iter().enumerate() {
            if attempt.applied {
                actions.push(Action::Complete(i));
            } else {
                actions.push(Action::Apply(i));
            }
            actions.push(Action::Fail(i));
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        match action {
            Action::Send(h) => {
                state.sent[h as usize] += 1;
                let (token, id) = (Token::new(h + 1)?, state.next_id);
                state.next_id += 1;
                let claim = claim(token, id);
                let existing = state.record.as_ref().map(record);
                if let Begin::Execute { .. } =
                    (self.decide)(existing.as_ref(), state.maximum, &claim)
                {
                    state.maximum = Some(state.maximum.map_or(token, |m| m.max(token)));
                    state.record = Some(Kept {
                        phase: Phase::InFlight,
                        token,
                        attempt: Some(id),
                    });
                    state.running.push(Attempt {
                        id,
                        token,
                        applied: false,
                    });
                }
            }
            Action::Apply(i) => {
                state.running[i].applied = true;
                state.history.push(Event::Applied(state.running[i].id));
            }
            Action::Complete(i) | Action::Fail(i) => {
                let attempt = state.running.remove(i);
                let phase = match action {
                    Action::Complete(_) => Phase::Completed,
                    _ => Phase::Unknown,
                };
                if phase == Phase::Unknown {
                    state.history.push(Event::Unknown(attempt.id));
                }
                let ours = state
                    .record
                    .as_ref()
                    .is_some_and(|kept| record(kept).owned_by(&claim(attempt.token, attempt.id)));
                if ours {
                    state.record = Some(Kept {
                        phase,
                        token: attempt.token,
                        attempt: None,
                    });
                }
            }
        }
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![Property::always(PROPERTY, |_, state: &State| {
            let (mut applied, mut unknown) = (0u32, 0u32);
            state.history.iter().all(|event| {
                match event {
                    Event::Applied(_) => applied += 1,
                    Event::Unknown(_) => unknown += 1,
                }
                applied <= 1 + unknown
            })
        })]
    }
}

const PROPERTY: &str =
    "a key's write is applied at most once, but for one more per unknown outcome";

/// [`decide`] that runs a completed key again instead of replaying it.
fn runs_completed_again(existing: Option<&Record>, current: Option<Token>, claim: &Claim) -> Begin {
    match existing {
        Some(r) if r.phase == Phase::Completed => decide(None, current, claim),
        _ => decide(existing, current, claim),
    }
}

fn model(decide: Decide) -> Keyed {
    Keyed {
        holders: 3,
        attempts: 3,
        decide,
    }
}

#[test]
fn a_key_is_applied_at_most_once_but_after_an_unknown_outcome() {
    assert_holds(model(decide), PROPERTY, 1_000);
}

/// Negative control: a decision that runs a completed key again is caught, with a trace.
#[test]
fn running_a_completed_key_again_is_caught_with_a_counterexample() {
    let trace = counterexample(
        model(runs_completed_again),
        PROPERTY,
        "completed key run again",
    );
    assert!(trace.iter().any(|a| a.contains("Complete")));
}
