//! A lease as the agent keeps it: its grant, its state and local validity deadline (one
//! snapshot, changed only by compare-and-set), and the events sent when it changes.

use crate::fence::Token;
use std::sync::Mutex;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::lease::backend::Grant;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Acquiring,
    Held,
    Draining,
    Expired,
    Released,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Acquiring => "acquiring",
            State::Held => "held",
            State::Draining => "draining",
            State::Expired => "expired",
            State::Released => "released",
        }
    }
}

/// A lease transition or renewal, as sent on the events stream.
#[derive(Debug, Clone, Serialize)]
pub struct Event {
    pub event: &'static str,
    pub resource: String,
    pub holder: String,
    pub lease_id: String,
    pub fencing_token: Token,
    pub ttl_ms: u128,
    pub state: State,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Snapshot {
    pub(super) state: State,
    pub(super) valid_until: Instant,
}

/// One lease held (or recently held) through this agent.
pub struct Lease {
    pub grant: Grant,
    pub ttl: Duration,
    pub(super) snapshot: watch::Sender<Snapshot>,
    pub(super) renewer: Mutex<Option<JoinHandle<()>>>,
}

impl Lease {
    pub fn state(&self) -> State {
        let snap = *self.snapshot.borrow();
        if live(snap.state) && Instant::now() >= snap.valid_until {
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

/// Held or draining: the states in which the lease is still ours, until its deadline.
pub(super) fn live(state: State) -> bool {
    matches!(state, State::Held | State::Draining)
}
