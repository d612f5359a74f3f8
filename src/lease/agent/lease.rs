//! A lease as the agent keeps it: its grant, its state and local validity deadline (one
//! snapshot, changed only by compare-and-set), and the events sent when it changes.

use crate::fence::token::Token;
use std::sync::Mutex;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::lease::backend::Grant;

/// A lease's `state`, as the lease API and the events stream show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// An acquisition under way: tried once, or waiting for the holder to let go; no grant
    /// yet.
    Acquiring,
    /// Granted and locally valid: its token is attached to egress writes.
    Held,
    /// Held after SIGTERM: ours until its deadline, but its token is no longer attached.
    Draining,
    /// Lost: its local validity deadline passed, or a renewal found it gone. It stays so until
    /// the app asks again.
    Expired,
    /// Released by the app (`DELETE`) or at shutdown.
    Released,
}

impl State {
    /// Its name: `acquiring`, `held`, `draining`, `expired` or `released`.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Acquiring => "acquiring",
            State::Held => "held",
            State::Draining => "draining",
            State::Expired => "expired",
            State::Released => "released",
        }
    }

    /// Held or draining: the states in which the lease is still ours, until its deadline. Only
    /// such a lease is renewed, or lost.
    pub(crate) fn live(self) -> bool {
        matches!(self, State::Held | State::Draining)
    }

    /// Whether the token of a lease in this state is attached to egress writes: only while it
    /// is held, so never once draining has begun, nor after a loss or a release.
    pub(crate) fn attaches(self) -> bool {
        self == State::Held
    }

    /// What draining (SIGTERM) turns this state into, if it changes it: a held lease turns
    /// `draining`; any other state stays as it is.
    pub(crate) fn drained(self) -> Option<State> {
        (self == State::Held).then_some(State::Draining)
    }

    /// Whether a new acquisition of the resource forgets a lease listed in this state: a lost
    /// or released lease is only replaced by an explicit new request, and forgotten when one
    /// starts; one still ours (held, for another holder, or draining) stays listed, and the
    /// acquisition waits for it like for any other holder.
    pub(crate) fn forgotten_on_acquire(self) -> bool {
        match self {
            State::Expired | State::Released => true,
            State::Acquiring | State::Held | State::Draining => false,
        }
    }

    /// Whether a new acquisition gives back to the backend a lease listed in this state as it
    /// forgets it: a lost lease may still be held there (its renewals failed, the backend's
    /// TTL not yet over), and nobody would release it any more; a released one is gone.
    pub(crate) fn given_back_on_acquire(self) -> bool {
        self == State::Expired
    }
}

/// A lease transition or renewal, as sent on the events stream.
#[derive(Debug, Clone, Serialize)]
pub struct Event {
    /// What happened: `held`, `renewed`, `renew_failed`, `lost` or `released`.
    pub event: &'static str,
    /// The resource id.
    pub resource: String,
    /// The holder the lease was granted to.
    pub holder: String,
    /// The grant's id (unique per grant).
    pub lease_id: String,
    /// The grant's fencing token.
    pub fencing_token: Token,
    /// The lease TTL, in milliseconds.
    pub ttl_ms: u128,
    /// The lease's state after the event.
    pub state: State,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Snapshot {
    pub(super) state: State,
    pub(super) valid_until: Instant,
}

/// One lease held (or recently held) through this agent.
pub struct Lease {
    /// The backend's grant: resource, holder, lease id and fencing token.
    pub grant: Grant,
    /// The TTL it was granted, and is renewed, with.
    pub ttl: Duration,
    pub(super) snapshot: watch::Sender<Snapshot>,
    pub(super) renewer: Mutex<Option<JoinHandle<()>>>,
}

impl Lease {
    /// Its state now: a held or draining lease whose local deadline has passed is
    /// [`State::Expired`], even before the renewer declares it lost.
    pub fn state(&self) -> State {
        let snap = *self.snapshot.borrow();
        if snap.state.live() && Instant::now() >= snap.valid_until {
            // The renewer declares it lost at the deadline; the view must not lag behind.
            State::Expired
        } else {
            snap.state
        }
    }

    /// Time left before the local deadline.
    pub fn valid_for(&self) -> Duration {
        self.snapshot
            .borrow()
            .valid_until
            .saturating_duration_since(Instant::now())
    }

    /// One transition, atomic with respect to every other: `step` sees the current snapshot
    /// and changes it (returning true) or leaves it (false). The watch channel's write lock
    /// is held across the read and the write, so a renewal cannot write back a state that
    /// draining, a release or a loss replaced meanwhile.
    pub(super) fn transition(&self, step: impl FnOnce(&mut Snapshot) -> bool) -> bool {
        self.snapshot.send_if_modified(step)
    }
}
