//! The lease agent's renewal as a model, explored exhaustively with stateright: one agent
//! holds a lease and renews it; the backend extends the lease when a renewal reaches it in
//! time, and lets it expire otherwise, after which a rival takes it. Time advances in ticks
//! of [`TICK`]; a renewal's request and its answer take any number of ticks (a slow network,
//! a stalled agent), unless the model is `prompt`. Every timing is the production one: the
//! agent renews [`renew_delay`] after the previous renewal's answer, as `Agent::renew_loop`
//! sleeps it once the answer is in (TTL/3 with jitter, each of three jitters explored, rounded
//! down to ticks), and believes the lease valid until [`valid_until`] (the send time of the
//! renewal the backend granted, plus the TTL, minus the drift buffer).
//!
//! Properties:
//! - safety, always: while the agent believes the lease valid, the backend holds it for the
//!   agent (not expired, not taken): the agent never attaches a token whose lease has passed
//!   on. A mutated deadline, measured from the answer instead of the send, is caught with a
//!   counterexample (an answer delayed past the drift buffer).
//! - renewal, always, when round trips are prompt (request and answer within a tick each,
//!   well under TTL/3): the agent never loses the lease. A mutated schedule that renews once a
//!   TTL is caught.

use std::time::Duration;

use stateright::{Model, Property};
use tokio::time::Instant;

use super::schedule::{renew_delay, valid_until};
use crate::fence::model::{assert_holds, counterexample};

/// One step of model time.
const TICK: Duration = Duration::from_millis(100);
/// The lease TTL: 9 ticks.
const TTL: Duration = Duration::from_millis(900);
/// The drift buffer: 1 tick.
const DRIFT: Duration = Duration::from_millis(100);
/// The jitters explored for each renewal (`unit` of [`renew_delay`]).
const UNITS: [f64; 3] = [0.0, 0.5, 0.999];

/// The agent's validity deadline for a renewal sent at `sent` and answered at `answered`.
type Deadline = fn(sent: Instant, answered: Instant) -> Instant;
/// The delay until the next renewal.
type Schedule = fn(ttl: Duration, unit: f64) -> Duration;

#[derive(Clone)]
struct Renewal {
    /// Ticks explored.
    horizon: u8,
    /// Requests and answers take at most one tick each.
    prompt: bool,
    deadline: Deadline,
    schedule: Schedule,
    /// The property checked: the checker stops at its first counterexample, which a second
    /// property that holds would keep it from (it would explore on and report a later one).
    check: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
enum Renew {
    /// Sent at tick `at`, not yet at the backend; `unit` is the jitter of the delay the agent
    /// sleeps once the answer is in.
    Sent { at: u8, unit: usize },
    /// The backend answered (extended or not); the answer is on its way.
    Answered {
        sent: u8,
        at: u8,
        renewed: bool,
        unit: usize,
    },
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    now: u8,
    /// The backend's expiry of the agent's lease (tick), and whether a rival took it since.
    expires: u8,
    taken: bool,
    /// The agent's validity deadline (tick, rounded down); `None` once it knows it lost.
    valid_until: Option<u8>,
    next_renew: u8,
    renewal: Option<Renew>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Action {
    Tick,
    /// The agent sends a renewal; once its answer is in, it schedules the next one with this
    /// jitter.
    Send(usize),
    /// The backend handles the renewal.
    Handle,
    /// The agent reads the answer.
    Answer,
    /// A rival acquires the expired lease.
    Take,
}

fn ticks(d: Duration) -> u8 {
    u8::try_from(d.as_millis() / TICK.as_millis()).unwrap_or(u8::MAX)
}

/// A tick as an instant, from a fixed origin, for the production functions.
fn at(origin: Instant, tick: u8) -> Instant {
    origin + TICK * u32::from(tick)
}

fn since(origin: Instant, instant: Instant) -> u8 {
    ticks(instant.saturating_duration_since(origin))
}

impl Model for Renewal {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        // Granted at tick 0: the backend's expiry, and the agent's deadline as it computes it.
        let origin = Instant::now();
        let valid = since(origin, (self.deadline)(at(origin, 0), at(origin, 0)));
        let units = UNITS.iter().map(|&u| ticks((self.schedule)(TTL, u)));
        units
            .map(|next_renew| State {
                now: 0,
                expires: ticks(TTL),
                taken: false,
                valid_until: Some(valid),
                next_renew,
                renewal: None,
            })
            .collect()
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        let holding = state.valid_until.is_some();
        let due = holding && state.renewal.is_none() && state.now >= state.next_renew;
        // When prompt, the agent sends a renewal when it is due, and the network carries it and
        // its answer within a tick: time waits for them.
        let waiting = self.prompt
            && match state.renewal {
                Some(Renew::Sent { at: sent, .. }) | Some(Renew::Answered { at: sent, .. }) => {
                    state.now > sent
                }
                None => due,
            };
        if state.now < self.horizon && !waiting {
            actions.push(Action::Tick);
        }
        if due {
            actions.extend((0..UNITS.len()).map(Action::Send));
        }
        match state.renewal {
            Some(Renew::Sent { .. }) => actions.push(Action::Handle),
            Some(Renew::Answered { .. }) => actions.push(Action::Answer),
            None => {}
        }
        if !state.taken && state.now >= state.expires {
            actions.push(Action::Take);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        let origin = Instant::now();
        match action {
            Action::Tick => state.now += 1,
            Action::Send(unit) => {
                state.renewal = Some(Renew::Sent {
                    at: state.now,
                    unit,
                });
            }
            Action::Handle => {
                let Some(Renew::Sent { at: sent, unit }) = state.renewal else {
                    return None;
                };
                // The backend extends a lease that has not expired or passed on.
                let renewed = !state.taken && state.now < state.expires;
                if renewed {
                    state.expires = state.now.saturating_add(ticks(TTL));
                }
                state.renewal = Some(Renew::Answered {
                    sent,
                    at: state.now,
                    renewed,
                    unit,
                });
            }
            Action::Answer => {
                let Some(Renew::Answered {
                    sent,
                    renewed,
                    unit,
                    ..
                }) = state.renewal
                else {
                    return None;
                };
                state.renewal = None;
                // `renew_loop` sleeps `renew_delay` once the answer is in.
                let delay = (self.schedule)(TTL, UNITS[unit]);
                state.next_renew = state.now.saturating_add(ticks(delay));
                state.valid_until = renewed.then(|| {
                    let deadline = (self.deadline)(at(origin, sent), at(origin, state.now));
                    since(origin, deadline)
                });
            }
            Action::Take => state.taken = true,
        }
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let property = match self.check {
            SAFE => Property::always(SAFE, |_, s: &State| {
                let believed = s.valid_until.is_some_and(|v| s.now < v);
                !believed || (!s.taken && s.now < s.expires)
            }),
            _ => Property::always(KEPT, |_, s: &State| {
                !s.taken && s.valid_until.is_some_and(|v| s.now < v)
            }),
        };
        vec![property]
    }
}

const SAFE: &str = "while the agent believes its lease valid, the backend holds it for the agent";
const KEPT: &str = "with prompt round trips, the agent never loses its lease";

/// The production deadline: from the renewal's send.
fn production(sent: Instant, _answered: Instant) -> Instant {
    valid_until(sent, TTL, DRIFT)
}

/// Mutation: the deadline measured from the answer.
fn from_answer(_sent: Instant, answered: Instant) -> Instant {
    valid_until(answered, TTL, DRIFT)
}

/// Mutation: a renewal once a TTL.
fn once_a_ttl(ttl: Duration, _unit: f64) -> Duration {
    ttl
}

/// The safety model (any delays), or with `KEPT` the renewal model (prompt round trips).
fn model(check: &'static str, deadline: Deadline, schedule: Schedule) -> Renewal {
    Renewal {
        horizon: 40,
        prompt: check == KEPT,
        deadline,
        schedule,
        check,
    }
}

#[test]
fn the_agent_never_believes_a_lease_the_backend_let_go() {
    assert_holds(model(SAFE, production, renew_delay), SAFE, 1_000);
}

#[test]
fn with_prompt_round_trips_the_renewal_schedule_keeps_the_lease() {
    assert_holds(model(KEPT, production, renew_delay), KEPT, 100);
}

/// Negative control: a deadline from the answer outlives the backend's lease.
#[test]
fn a_deadline_from_the_answer_is_caught_with_a_counterexample() {
    let what = "deadline from the answer";
    let trace = counterexample(model(SAFE, from_answer, renew_delay), SAFE, what);
    assert!(trace.iter().any(|a| a.contains("Answer")));
}

/// Negative control: renewing once a TTL loses the lease even on a prompt network: it lapses
/// (its deadline passes) before the first renewal is due.
#[test]
fn renewing_once_a_ttl_is_caught_with_a_counterexample() {
    let trace = counterexample(
        model(KEPT, production, once_a_ttl),
        KEPT,
        "renewal once a TTL",
    );
    assert!(trace.iter().all(|a| a.contains("Tick")), "{trace:?}");
}
