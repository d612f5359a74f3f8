//! The drain (SIGTERM) of a sidecar with leases, as a model explored exhaustively with
//! stateright: the sidecar holds leases (resource `r` with token `r + 1`) for its app, whose
//! egress writes each take the lease's token (or a `503`) when their head is read, leave the
//! egress for the remote service's fence some time later, and are answered later still; one
//! more acquisition of resource 0, by another holder of the app, may start at any time and
//! then waits for the lease held here; a rival holder on another sidecar is granted resource 0
//! once the backend no longer has it (released, or expired) and writes with its token. Any
//! lease may lapse (the agent's local deadline passes: renewals failed) and then expire on
//! the backend, in that order, which is what the lease model (`lease::model`) shows of the
//! deadline. A renewal's answer may land at any point after the backend granted it.
//!
//! SIGTERM drains the agent at once ([`Server::shutdown`](super::Server::shutdown)): held
//! leases turn `draining` ([`LeaseState::drained`]) and nothing is granted any more
//! ([`may_grant`]); then the lease side's steps run in the order of [`LEASE_SHUTDOWN`]: the
//! egress drain ends once no egress write is in flight, or at the drain timeout (which may
//! pass at any time after SIGTERM; the writes still running then go on, as `server::serve`
//! leaves them); the release takes its snapshot of the listed leases and releases them one
//! after the other; the lease API's drain ends once the acquisition has returned, or at the
//! same timeout; then the process exits, and whatever it still had under way dies with it.
//!
//! Every decision but one is the production one: the egress attaches a lease's token only in
//! a state that [`LeaseState::attaches`]; only a [`LeaseState::live`] lease lapses; an
//! acquisition goes on, and keeps a grant, only if [`may_grant`], and at its start
//! forgets a listed lease that is [`LeaseState::forgotten_on_acquire`] and gives back one that
//! is [`LeaseState::given_back_on_acquire`] (a compare-and-delete on the backend, which the
//! process may exit before); the shutdown's order
//! is [`LEASE_SHUTDOWN`]; the remote fence answers with [`decide`] and [`Verdict::raised`].
//! The one that is the model's own: a renewal's answer never writes the state (`renewal`
//! below stands for `Agent::renew_loop`'s compare-and-set, which
//! `lease::agent::tests::a_renewal_answered_before_draining_does_not_bring_the_token_back`
//! tests); its negative control checks the model, not the code.
//!
//! Properties, one per run (the checker stops at the first counterexample of any property it
//! checks), with one lease (and the second and fourth with two as well):
//! - no token is attached after SIGTERM, nor one whose lease the backend does not hold for
//!   this sidecar;
//! - no write leaves the egress with the token of a lease the drain released, unless the drain
//!   timeout passed first;
//! - the fence admits no token below one it acknowledged on the resource;
//! - once the sidecar has exited, the backend holds none of its leases, but one that an
//!   acquisition the drain timeout cut short was granted or was giving back (it expires at its
//!   TTL).
//!
//! Without its exception, the second breaks, and the checker shows how: a write still in the
//! egress at the drain timeout leaves it after the release. Negative controls, each caught
//! with a trace: the release before the egress drain; a draining lease's token attached; a
//! renewal that writes back the state it read; grants while draining; a lost lease forgotten
//! by an acquisition and not given back (it outlives the drain, as it did before
//! `Agent::acquire` gave it back); a fence decision one token off.

use stateright::{Model, Property};

use super::{Shutdown, LEASE_SHUTDOWN};
use crate::config::EqualTokens;
use crate::fence::model::{assert_holds, counterexample, off_by_one};
use crate::fence::verdict::{decide, Rule, Verdict};
use crate::fence::Token;
use crate::lease::agent::{may_grant, State as LeaseState};

/// The decisions the model runs: the production ones, or a mutation for a negative control.
#[derive(Clone, Copy)]
struct Decisions {
    order: [Shutdown; 3],
    attaches: fn(LeaseState) -> bool,
    /// A renewal's answer: the state it leaves the lease in, from the state read when the
    /// backend granted the renewal and the state now (`None`: left as it is).
    renewed: fn(read: LeaseState, now: LeaseState) -> Option<LeaseState>,
    may_grant: fn(draining: bool) -> bool,
    /// Whether an acquisition's start gives back the lost lease it forgets, by its state.
    gives_back: fn(LeaseState) -> bool,
    decide: fn(Option<Token>, Token, Rule) -> Verdict,
}

/// The production decisions.
const PRODUCTION: Decisions = Decisions {
    order: LEASE_SHUTDOWN,
    attaches: LeaseState::attaches,
    renewed: renewal,
    may_grant,
    gives_back: LeaseState::given_back_on_acquire,
    decide,
};

/// A renewal's answer in `Agent::renew_loop`: one compare-and-set on the lease's snapshot as
/// it is then, which moves the deadline of a live lease (not modelled) and never writes the
/// state.
fn renewal(_read: LeaseState, _now: LeaseState) -> Option<LeaseState> {
    None
}

#[derive(Clone)]
struct Drain {
    /// Leases held here at the start: resource `r`, token `r + 1`.
    leases: usize,
    /// Egress writes of the app: write `i` on resource `i % leases`.
    writes: usize,
    /// An acquisition of resource 0 by another holder of the app, which may start at any time.
    acquisition: bool,
    /// Leases may lapse and expire (else only the drain frees them).
    lapses: bool,
    /// The drain timeout may pass (else every drain waits for its requests).
    timeout: bool,
    decisions: Decisions,
    /// The property checked.
    check: &'static str,
}

/// A lease listed by the agent.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct Listed {
    state: LeaseState,
    token: Token,
}

/// A grant, as the backend keeps it.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct Grant {
    /// To this sidecar (else to the rival).
    here: bool,
    token: Token,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Write {
    /// Its head not read yet.
    Coming,
    /// Refused at the egress (`503 lease-not-held`): never forwarded.
    Refused,
    /// Its token attached; still in the egress.
    Attached(Token),
    /// Out of the egress, decided by the fence; its answer on its way.
    Sent,
    /// Answered: its request is over.
    Done,
    /// Still in the egress when the process exited: never sent.
    Dropped,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Acquisition {
    /// Not asked for yet.
    Idle,
    /// Between two attempts (it woke up at SIGTERM, or on a change of the lease).
    Waiting,
    /// An attempt sent to the backend.
    Asking,
    /// The backend granted it; its answer on its way.
    Granted(Token),
    /// Granted while draining: being given back.
    GivingBack(Token),
    /// At its start, giving back the lost lease (this token) it forgot.
    GivingBackLost(Token),
    /// Returned the lease, listed here.
    Holding,
    /// Returned `503 draining`.
    Refused,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Rival {
    Waiting,
    Holding(Token),
    Wrote,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    sigterm: bool,
    /// The drain timeout has passed.
    timed_out: bool,
    /// Steps of the shutdown's order done; all three: the process has exited.
    steps: usize,
    /// The release's snapshot: resources still to release (a bit each), once taken.
    releasing: Option<u8>,
    /// Tokens of the leases the drain released (a bit each).
    released: u16,
    /// Per resource: the lease listed by the agent, the backend's grant, a renewal's answer
    /// on its way (the lease's token and the state read), the fence's maximum.
    listed: Vec<Option<Listed>>,
    backend: Vec<Option<Grant>>,
    renewing: Vec<Option<(Token, LeaseState)>>,
    maximum: Vec<Option<Token>>,
    /// The last token granted.
    granted: Token,
    writes: Vec<Write>,
    acquisition: Option<Acquisition>,
    rival: Rival,
    /// What the properties look at, set when it happens.
    attached_unheld: bool,
    sent_after_release: bool,
    sent_after_release_in_time: bool,
    admitted_below: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Action {
    Sigterm,
    /// The drain timeout passes.
    Timeout,
    /// Write `i`'s head is read: the egress asks for the token.
    Attach(usize),
    /// Write `i` leaves the egress and reaches the fence, which decides.
    Send(usize),
    Answer(usize),
    /// The lease on resource `r` passes its local deadline (renewals failed).
    Lapse(usize),
    /// The backend lets the grant on resource `r` expire.
    Expire(usize),
    /// The backend grants a renewal of the lease on resource `r`.
    Renew(usize),
    /// Its answer reaches the agent.
    Renewed(usize),
    /// The acquisition is asked for (`POST`): it ends at once if draining, forgets a lost
    /// lease listed for the resource (and gives it back), and waits for the one held.
    Start,
    /// The backend handles the giving back of the lost lease the acquisition forgot.
    GiveBackLost,
    /// The waiting acquisition's next turn: it asks the backend, or ends.
    Retry,
    /// The backend handles its attempt.
    Commit,
    /// Its grant's answer arrives.
    Hold,
    GiveBack,
    RivalGrant,
    RivalWrite,
    /// The egress drain ends.
    EgressDrained,
    /// The release begins: the agent drains (again) and takes its snapshot.
    ReleaseAll,
    Release(usize),
    /// The lease API's drain ends.
    ApiDrained,
}

impl State {
    fn exited(&self) -> bool {
        self.steps == LEASE_SHUTDOWN.len()
    }

    fn draining(&self) -> bool {
        self.sigterm
    }

    fn in_flight(&self) -> usize {
        let going = |w: &&Write| matches!(w, Write::Attached(_) | Write::Sent);
        self.writes.iter().filter(going).count()
    }

    fn acquiring(&self) -> bool {
        use Acquisition::*;
        matches!(
            self.acquisition,
            Some(Waiting | Asking | Granted(_) | GivingBack(_) | GivingBackLost(_))
        )
    }

    /// Grants the next token on resource `r`.
    fn grant(&mut self, r: usize, here: bool) -> Option<Token> {
        self.granted = self.granted.next()?;
        self.backend[r] = Some(Grant {
            here,
            token: self.granted,
        });
        Some(self.granted)
    }

    /// The fence decides on a write of `token` to resource `r`.
    fn fence(&mut self, decide: fn(Option<Token>, Token, Rule) -> Verdict, r: usize, token: Token) {
        let verdict = decide(self.maximum[r], token, Rule::from(EqualTokens::Allow));
        if let Verdict::Admitted { .. } = verdict {
            if self.maximum[r].is_some_and(|m| token < m) {
                self.admitted_below = true;
            }
            if verdict.raised(token) {
                self.maximum[r] = Some(token);
            }
        }
    }

    /// The backend holds this sidecar's grant of `token` on `r`.
    fn holds(&self, r: usize, token: Token) -> bool {
        self.backend[r] == Some(Grant { here: true, token })
    }
}

fn bit(token: Token) -> u16 {
    1 << token.get()
}

impl Model for Drain {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let token = |r: usize| Token::new(r as u64 + 1).expect("not zero");
        let listed = (0..self.leases).map(|r| {
            Some(Listed {
                state: LeaseState::Held,
                token: token(r),
            })
        });
        let backend = (0..self.leases).map(|r| {
            Some(Grant {
                here: true,
                token: token(r),
            })
        });
        vec![State {
            sigterm: false,
            timed_out: false,
            steps: 0,
            releasing: None,
            released: 0,
            listed: listed.collect(),
            backend: backend.collect(),
            renewing: vec![None; self.leases],
            maximum: vec![None; self.leases],
            granted: token(self.leases - 1),
            writes: vec![Write::Coming; self.writes],
            acquisition: self.acquisition.then_some(Acquisition::Idle),
            rival: Rival::Waiting,
            attached_unheld: false,
            sent_after_release: false,
            sent_after_release_in_time: false,
            admitted_below: false,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        let order = self.decisions.order;
        let alive = !s.exited();
        let step = order.get(s.steps).copied();
        let egress_open = !order[..s.steps].contains(&Shutdown::Egress);
        if !s.sigterm {
            actions.push(Action::Sigterm);
        } else if self.timeout && !s.timed_out && alive {
            actions.push(Action::Timeout);
        }
        for (i, write) in s.writes.iter().enumerate() {
            match write {
                Write::Coming if alive && egress_open => actions.push(Action::Attach(i)),
                Write::Attached(_) if alive => actions.push(Action::Send(i)),
                Write::Sent if alive => actions.push(Action::Answer(i)),
                _ => {}
            }
        }
        for r in 0..self.leases {
            let live = s.listed[r].filter(|l| l.state.live());
            if self.lapses && alive && live.is_some() {
                actions.push(Action::Lapse(r));
            }
            if let Some(grant) = s.backend[r].filter(|g| g.here) {
                // The agent's deadline comes before the backend's expiry (`lease::model`).
                let believed = alive && live.is_some_and(|l| l.token == grant.token);
                if self.lapses && !believed {
                    actions.push(Action::Expire(r));
                }
            }
            if alive && s.renewing[r].is_none() && live.is_some_and(|l| s.holds(r, l.token)) {
                actions.push(Action::Renew(r));
            }
            if alive && s.renewing[r].is_some() {
                actions.push(Action::Renewed(r));
            }
        }
        match s.acquisition {
            Some(Acquisition::Idle) if alive => actions.push(Action::Start),
            Some(Acquisition::Waiting) if alive => actions.push(Action::Retry),
            // The attempt is on the network: the backend may handle it after the exit.
            Some(Acquisition::Asking) => actions.push(Action::Commit),
            Some(Acquisition::Granted(_)) if alive => actions.push(Action::Hold),
            Some(Acquisition::GivingBack(_)) if alive => actions.push(Action::GiveBack),
            Some(Acquisition::GivingBackLost(_)) if alive => actions.push(Action::GiveBackLost),
            _ => {}
        }
        match s.rival {
            Rival::Waiting if s.backend[0].is_none() => actions.push(Action::RivalGrant),
            Rival::Holding(_) => actions.push(Action::RivalWrite),
            _ => {}
        }
        if !s.sigterm {
            return;
        }
        match step {
            Some(Shutdown::Egress) if s.in_flight() == 0 || s.timed_out => {
                actions.push(Action::EgressDrained)
            }
            Some(Shutdown::Release) => match s.releasing {
                None => actions.push(Action::ReleaseAll),
                Some(left) => actions.push(Action::Release(left.trailing_zeros() as usize)),
            },
            Some(Shutdown::Api) if !s.acquiring() || s.timed_out => {
                actions.push(Action::ApiDrained)
            }
            _ => {}
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let d = self.decisions;
        let mut s = last.clone();
        match action {
            Action::Sigterm => {
                // `Server::shutdown`: the agent drains before any listener stops.
                s.sigterm = true;
                drain(&mut s);
            }
            Action::Timeout => s.timed_out = true,
            Action::Attach(i) => {
                let r = i % self.leases;
                s.writes[i] = match s.listed[r] {
                    Some(l) if (d.attaches)(l.state) => {
                        if s.sigterm || !s.holds(r, l.token) {
                            s.attached_unheld = true;
                        }
                        Write::Attached(l.token)
                    }
                    _ => Write::Refused,
                };
            }
            Action::Send(i) => {
                let Write::Attached(token) = s.writes[i] else {
                    return None;
                };
                if s.released & bit(token) != 0 {
                    s.sent_after_release = true;
                    s.sent_after_release_in_time |= !s.timed_out;
                }
                s.fence(d.decide, i % self.leases, token);
                s.writes[i] = Write::Sent;
            }
            Action::Answer(i) => s.writes[i] = Write::Done,
            Action::Lapse(r) => {
                // `Agent::lose`: a live lease turns expired.
                let listed = s.listed[r].as_mut()?;
                if listed.state.live() {
                    listed.state = LeaseState::Expired;
                }
            }
            Action::Expire(r) => s.backend[r] = None,
            Action::Renew(r) => {
                let listed = s.listed[r]?;
                s.renewing[r] = Some((listed.token, listed.state));
            }
            Action::Renewed(r) => {
                let (token, read) = s.renewing[r].take()?;
                if let Some(listed) = s.listed[r].as_mut().filter(|l| l.token == token) {
                    if let Some(state) = (d.renewed)(read, listed.state) {
                        listed.state = state;
                    }
                }
            }
            Action::Start => {
                // `Agent::acquire`, before its loop.
                if !(d.may_grant)(s.draining()) {
                    s.acquisition = Some(Acquisition::Refused);
                    return Some(s);
                }
                s.acquisition = Some(Acquisition::Waiting);
                if let Some(listed) = s.listed[0].filter(|l| l.state.forgotten_on_acquire()) {
                    s.listed[0] = None;
                    if (d.gives_back)(listed.state) {
                        s.acquisition = Some(Acquisition::GivingBackLost(listed.token));
                    }
                }
            }
            Action::GiveBackLost => {
                // `Agent::give_back_lost`: the backend deletes the grant if it still holds it.
                let Some(Acquisition::GivingBackLost(token)) = s.acquisition else {
                    return None;
                };
                if s.holds(0, token) {
                    s.backend[0] = None;
                }
                s.acquisition = Some(Acquisition::Waiting);
            }
            Action::Retry => {
                s.acquisition = Some(if (d.may_grant)(s.draining()) {
                    Acquisition::Asking
                } else {
                    Acquisition::Refused
                });
            }
            Action::Commit => {
                s.acquisition = Some(match s.backend[0] {
                    None => Acquisition::Granted(s.grant(0, true)?),
                    Some(_) => Acquisition::Waiting,
                });
            }
            Action::Hold => {
                let Some(Acquisition::Granted(token)) = s.acquisition else {
                    return None;
                };
                if (d.may_grant)(s.draining()) {
                    // Its local deadline, counted from the attempt's send, passed before
                    // the backend let it expire (`lease::model`).
                    let state = if s.holds(0, token) {
                        LeaseState::Held
                    } else {
                        LeaseState::Expired
                    };
                    s.listed[0] = Some(Listed { state, token });
                    s.acquisition = Some(Acquisition::Holding);
                } else {
                    s.acquisition = Some(Acquisition::GivingBack(token));
                }
            }
            Action::GiveBack => {
                let Some(Acquisition::GivingBack(token)) = s.acquisition else {
                    return None;
                };
                if s.holds(0, token) {
                    s.backend[0] = None;
                }
                s.acquisition = Some(Acquisition::Refused);
            }
            Action::RivalGrant => s.rival = Rival::Holding(s.grant(0, false)?),
            Action::RivalWrite => {
                let Rival::Holding(token) = s.rival else {
                    return None;
                };
                s.fence(d.decide, 0, token);
                s.rival = Rival::Wrote;
            }
            Action::EgressDrained | Action::ApiDrained => s.steps += 1,
            Action::ReleaseAll => {
                // `Agent::release_all`: it drains first, then snapshots the listed leases.
                drain(&mut s);
                let listed = s.listed.iter().enumerate().filter(|(_, l)| l.is_some());
                let left = listed.fold(0u8, |left, (r, _)| left | 1 << r);
                s.releasing = Some(left);
                if left == 0 {
                    s.steps += 1;
                }
            }
            Action::Release(r) => {
                // `Agent::release`: forgotten here, then compare-and-delete on the backend.
                let listed = s.listed[r].take()?;
                if s.holds(r, listed.token) {
                    s.backend[r] = None;
                }
                s.released |= bit(listed.token);
                let left = s.releasing? & !(1 << r);
                s.releasing = Some(left);
                if left == 0 {
                    s.steps += 1;
                }
            }
        }
        if s.exited() && !last.exited() {
            // What the process still had under way dies with it.
            for write in &mut s.writes {
                if let Write::Attached(_) = write {
                    *write = Write::Dropped;
                }
            }
            s.renewing.iter_mut().for_each(|r| *r = None);
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let property = match self.check {
            ATTACHED => Property::always(ATTACHED, |_, s: &State| !s.attached_unheld),
            IN_ORDER => Property::always(IN_ORDER, |_, s: &State| !s.sent_after_release_in_time),
            AFTER_RELEASE => Property::always(AFTER_RELEASE, |_, s: &State| !s.sent_after_release),
            FENCED => Property::always(FENCED, |_, s: &State| !s.admitted_below),
            _ => Property::always(RELEASED, |_, s: &State| nothing_left(s)),
        };
        vec![property]
    }
}

/// Once exited, the backend holds no grant of this sidecar but one that an acquisition the
/// drain timeout cut short was granted or was giving back.
fn nothing_left(s: &State) -> bool {
    use Acquisition::{GivingBack, GivingBackLost, Granted};
    let excused = |token: Token| {
        let cut = matches!(
            s.acquisition,
            Some(Granted(t) | GivingBack(t) | GivingBackLost(t)) if t == token
        );
        s.timed_out && cut
    };
    let ours = s.backend.iter().flatten().filter(|g| g.here);
    !s.exited() || ours.map(|g| g.token).all(excused)
}

/// `Agent::start_draining`: every listed lease as [`LeaseState::drained`] turns it.
fn drain(s: &mut State) {
    for listed in s.listed.iter_mut().flatten() {
        if let Some(state) = listed.state.drained() {
            listed.state = state;
        }
    }
}

const ATTACHED: &str =
    "no token is attached after SIGTERM, nor one whose lease the backend does not hold for us";
const IN_ORDER: &str =
    "no write leaves the egress with a released lease's token, unless the drain timed out first";
const AFTER_RELEASE: &str = "no write leaves the egress with a released lease's token";
const FENCED: &str = "the fence admits no token below one it acknowledged";
const RELEASED: &str = "once exited, the backend holds none of our leases, \
    but an acquisition's the drain timeout cut short";

fn model(leases: usize, check: &'static str, decisions: Decisions) -> Drain {
    Drain {
        leases,
        writes: 2,
        acquisition: true,
        lapses: true,
        timeout: true,
        decisions,
        check,
    }
}

/// The production model holds `check` with each number of leases.
fn holds(check: &'static str, leases: &[usize]) {
    for &leases in leases {
        assert_holds(model(leases, check, PRODUCTION), check, 10_000);
    }
}

/// Mutation: the leases released before the egress drain.
const RELEASE_FIRST: [Shutdown; 3] = [Shutdown::Release, Shutdown::Egress, Shutdown::Api];

/// Mutation: a draining lease's token attached too.
fn attaches_draining(state: LeaseState) -> bool {
    state.live()
}

/// Mutation: a renewal writes back the state it read (before the compare-and-set).
fn writes_back(read: LeaseState, _now: LeaseState) -> Option<LeaseState> {
    Some(read)
}

/// Mutation: grants go on while draining.
fn grants_while_draining(_draining: bool) -> bool {
    true
}

#[test]
fn no_token_is_attached_after_sigterm() {
    holds(ATTACHED, &[1]);
}

/// With two leases too: the release of one may come before or after the other's writes.
#[test]
fn the_leases_are_released_after_the_egress_drain() {
    holds(IN_ORDER, &[1, 2]);
}

#[test]
fn the_fence_admits_no_lower_token_through_the_hand_over() {
    holds(FENCED, &[1]);
}

/// With two leases too: the release goes through every lease listed.
#[test]
fn an_exited_sidecar_leaves_no_lease_held() {
    holds(RELEASED, &[1, 2]);
}

/// What the drain timeout does: a write attached before SIGTERM and still in the egress when
/// the timeout passes leaves it after the release (the fence then decides on it).
#[test]
fn after_the_drain_timeout_a_write_leaves_after_the_release() {
    let what = "production, drain timeout";
    let trace = counterexample(model(1, AFTER_RELEASE, PRODUCTION), AFTER_RELEASE, what);
    assert!(trace.iter().any(|a| a.contains("Timeout")), "{trace:?}");
}

/// Mutation: an acquisition forgets a lost lease without giving it back.
fn never(_state: LeaseState) -> bool {
    false
}

/// Negative control: a lost lease an acquisition forgets without giving it back stays on the
/// backend until its TTL, through a drain that does not even time out (as it did before
/// `Agent::acquire` gave it back).
#[test]
fn forgetting_a_lost_lease_without_giving_it_back_is_caught() {
    let decisions = Decisions {
        gives_back: never,
        ..PRODUCTION
    };
    let what = "a lost lease forgotten, not given back";
    let model = Drain {
        timeout: false,
        ..model(1, RELEASED, decisions)
    };
    let trace = counterexample(model, RELEASED, what);
    assert!(trace.iter().any(|a| a.contains("Start")), "{trace:?}");
}

/// Negative control: releasing before the egress drain lets an attached write out after it.
#[test]
fn releasing_before_the_egress_drain_is_caught() {
    let decisions = Decisions {
        order: RELEASE_FIRST,
        ..PRODUCTION
    };
    let what = "release before the egress drain";
    let trace = counterexample(model(1, IN_ORDER, decisions), IN_ORDER, what);
    assert!(!trace.iter().any(|a| a.contains("Timeout")), "{trace:?}");
}

/// Negative control: a draining lease's token attached.
#[test]
fn attaching_a_draining_leases_token_is_caught() {
    let decisions = Decisions {
        attaches: attaches_draining,
        ..PRODUCTION
    };
    let what = "draining token attached";
    let trace = counterexample(model(1, ATTACHED, decisions), ATTACHED, what);
    assert!(trace.iter().any(|a| a.contains("Sigterm")), "{trace:?}");
}

/// Negative control: a renewal granted before SIGTERM and answered after it writes `held`
/// back.
#[test]
fn a_renewal_writing_back_its_state_is_caught() {
    let decisions = Decisions {
        renewed: writes_back,
        ..PRODUCTION
    };
    let what = "renewal writes back";
    let trace = counterexample(model(1, ATTACHED, decisions), ATTACHED, what);
    assert!(trace.iter().any(|a| a.contains("Renewed")), "{trace:?}");
}

/// Negative control: an acquisition granted while draining outlives the process.
#[test]
fn granting_while_draining_is_caught() {
    let decisions = Decisions {
        may_grant: grants_while_draining,
        ..PRODUCTION
    };
    let what = "grants while draining";
    let trace = counterexample(model(1, RELEASED, decisions), RELEASED, what);
    assert!(trace.iter().any(|a| a.contains("Hold")), "{trace:?}");
}

/// Negative control: the fence's decision one token off admits the drained holder's late
/// write after the rival's. Without lapses, so that the hand-over is the drain's release.
#[test]
fn a_mutated_fence_decision_is_caught_through_the_hand_over() {
    let decisions = Decisions {
        decide: off_by_one,
        ..PRODUCTION
    };
    let what = "decide one token off";
    let model = Drain {
        lapses: false,
        ..model(1, FENCED, decisions)
    };
    let trace = counterexample(model, FENCED, what);
    assert!(trace.iter().any(|a| a.contains("Release(0)")), "{trace:?}");
}
