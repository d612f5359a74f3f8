//! The life of a key's in-flight record as a model, explored exhaustively with stateright:
//! attempts of one keyed write (the first and its retries) reach the store one after another;
//! an attempt that finds no live record claims the key, and its in-flight record expires
//! [`in_flight_window`] after the claim (the production function); the claim's answer, the
//! barrier turn, the authority's second answer (`fence.authority: leases`), the send and the
//! outcome's write then take any time within their bounds (`timeouts.store`,
//! `barrier_timeout`, `timeouts.store`, `timeouts.upstream`, `timeouts.store`); an attempt
//! that finds a live record is refused (in flight) or replayed (completed). Time advances in
//! ticks of [`TICK`].
//!
//! Property: no two attempts of a key are under way at once (claimed, and not yet past their
//! send): a retry never executes alongside the attempt it retries, however slowly that one
//! goes within its bounds, and however short the idempotency window. Negative control: an
//! in-flight record that lives the window alone (shorter than an attempt may run) is caught
//! with a counterexample.

use std::time::Duration;

use stateright::{Model, Property};

use super::in_flight_window;
use crate::fence::model::{assert_holds, counterexample};

/// One step of model time.
const TICK: Duration = Duration::from_millis(100);
/// `timeouts.store`: 1 tick for each of the store's answers and the authority's.
const STORE: Duration = Duration::from_millis(100);
/// `barrier_timeout`: 1 tick.
const BARRIER: Duration = Duration::from_millis(100);
/// `timeouts.upstream`: 2 ticks.
const SEND: Duration = Duration::from_millis(200);
/// The idempotency window: 1 tick, shorter than an attempt may run.
const WINDOW: Duration = Duration::from_millis(100);

type Lifetime =
    fn(window: Duration, barrier: Duration, send: Duration, store: Duration) -> Duration;

#[derive(Clone)]
struct Records {
    /// Attempts at most (the first and its retries).
    attempts: u8,
    horizon: u8,
    lifetime: Lifetime,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Step {
    /// Claimed in the store; the store's answer on its way.
    Claimed,
    /// Waiting for its barrier turn.
    Turn,
    /// Asking the authority again (`fence.authority: leases`), within `timeouts.store`.
    Authority,
    /// Sent upstream.
    Sending,
    /// Its outcome being written.
    Finishing,
    /// Its outcome written.
    Done,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Attempt {
    step: Step,
    /// The tick by which the step ends (each is bounded).
    by: u8,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
enum Kept {
    /// In flight, claimed by this attempt.
    InFlight(usize),
    Completed,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    now: u8,
    /// The key's record and the tick it expires at.
    record: Option<(Kept, u8)>,
    /// The attempts that claimed the key (an attempt refused or replayed leaves nothing).
    claimed: Vec<Attempt>,
    sent: u8,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Action {
    Tick,
    /// An attempt reaches the store.
    Arrive,
    /// Attempt `i` ends its step.
    Step(usize),
}

fn ticks(d: Duration) -> u8 {
    u8::try_from(d.as_millis() / TICK.as_millis()).unwrap_or(u8::MAX)
}

impl State {
    fn live(&self) -> Option<&Kept> {
        self.record
            .as_ref()
            .filter(|(_, expires)| self.now < *expires)
            .map(|(kept, _)| kept)
    }

    /// Attempts claimed and not yet past their send.
    fn under_way(&self) -> usize {
        let going = |a: &&Attempt| {
            matches!(
                a.step,
                Step::Claimed | Step::Turn | Step::Authority | Step::Sending
            )
        };
        self.claimed.iter().filter(going).count()
    }
}

impl Model for Records {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            now: 0,
            record: None,
            claimed: Vec::new(),
            sent: 0,
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        // Time waits for a step that must end now.
        let going = |a: &Attempt| a.step != Step::Done;
        let due = state.claimed.iter().any(|a| going(a) && a.by <= state.now);
        if state.now < self.horizon && !due {
            actions.push(Action::Tick);
        }
        if state.sent < self.attempts {
            actions.push(Action::Arrive);
        }
        let steps = state.claimed.iter().enumerate().filter(|(_, a)| going(a));
        actions.extend(steps.map(|(i, _)| Action::Step(i)));
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Tick => s.now += 1,
            Action::Arrive => {
                s.sent += 1;
                // A live record answers the attempt (in flight: refused; completed: replayed).
                if s.live().is_none() {
                    let lifetime = (self.lifetime)(WINDOW, BARRIER, SEND, STORE);
                    let id = s.claimed.len();
                    s.record = Some((Kept::InFlight(id), s.now + ticks(lifetime)));
                    s.claimed.push(Attempt {
                        step: Step::Claimed,
                        by: s.now + ticks(STORE),
                    });
                }
            }
            Action::Step(i) => {
                let now = s.now;
                let owns = matches!(s.live(), Some(Kept::InFlight(o)) if *o == i);
                let (step, by) = match s.claimed[i].step {
                    Step::Claimed => (Step::Turn, now + ticks(BARRIER)),
                    Step::Turn => (Step::Authority, now + ticks(STORE)),
                    Step::Authority => (Step::Sending, now + ticks(SEND)),
                    Step::Sending => (Step::Finishing, now + ticks(STORE)),
                    // The outcome replaces the record only if it is still this attempt's.
                    Step::Finishing => {
                        if owns {
                            s.record = Some((Kept::Completed, now + ticks(WINDOW)));
                        }
                        (Step::Done, u8::MAX)
                    }
                    Step::Done => return None,
                };
                s.claimed[i] = Attempt { step, by };
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![Property::always(PROPERTY, |_, s: &State| {
            s.under_way() <= 1
        })]
    }
}

const PROPERTY: &str = "no two attempts of a key are under way at once";

fn model(lifetime: Lifetime) -> Records {
    Records {
        attempts: 3,
        horizon: 16,
        lifetime,
    }
}

/// Mutation: the in-flight record lives the window alone.
fn window_alone(window: Duration, _: Duration, _: Duration, _: Duration) -> Duration {
    window
}

#[test]
fn a_retry_never_executes_alongside_the_attempt_it_retries() {
    assert_holds(model(in_flight_window), PROPERTY, 1_000);
}

/// Negative control: a record that lives the window alone lets a retry run alongside.
#[test]
fn an_in_flight_record_that_lives_the_window_alone_is_caught() {
    let what = "in-flight record lives the window alone";
    let trace = counterexample(model(window_alone), PROPERTY, what);
    assert!(trace.iter().filter(|a| a.contains("Arrive")).count() >= 2);
}

/// Mutation: a record one store answer short (the lifetime before the authority's second
/// answer was counted: the barrier, the send and two store answers).
fn one_store_answer_short(
    window: Duration,
    barrier: Duration,
    send: Duration,
    store: Duration,
) -> Duration {
    window.max(
        barrier
            .saturating_add(send)
            .saturating_add(store.saturating_mul(2)),
    )
}

/// Negative control: the bound is tight: a record one store answer short lets a retry in
/// while the first attempt's send may still be under way.
#[test]
fn a_record_one_store_answer_short_is_caught() {
    let what = "record one store answer short";
    let trace = counterexample(model(one_store_answer_short), PROPERTY, what);
    // The retry arrives after the first attempt's claim answer, turn and authority, during
    // its send.
    assert!(trace.iter().filter(|a| a.contains("Arrive")).count() >= 2);
}
