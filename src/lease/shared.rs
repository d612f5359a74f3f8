//! What the lease backends share besides the trait: lease ids, per-resource wake-ups for
//! `changed()` (and the one body of `changed()` for a backend whose event connection wakes
//! them), and the sending side of grant events. Backends import these and the trait, never
//! each other.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::{broadcast, watch, Notify};

use super::backend::{GrantEvent, GrantEvents};
use crate::sync::Locked;

/// A fresh lease id: 128 bits, hex. Unique (a process-wide counter, the time and the process id
/// go into it) and not guessable from outside (two hashers with per-process random keys).
pub(super) fn new_lease_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let half = |salt: u64| {
        let mut h = RandomState::new().build_hasher();
        h.write_u64(salt);
        h.write_u64(n);
        h.write_u128(nanos);
        h.write_u32(std::process::id());
        h.finish()
    };
    format!("{:016x}{:016x}", half(1), half(2))
}

/// Per-resource wake-ups for `changed()`: a waiter registers, then checks the backend, then
/// waits; the backend's event source wakes every registered waiter of a resource.
#[derive(Default)]
pub(super) struct Waiters {
    map: Mutex<HashMap<String, Arc<Notify>>>,
}

impl Waiters {
    pub(super) fn register(&self, resource: &str) -> Registration<'_> {
        let mut map = self.map.locked();
        let notify = Arc::clone(map.entry(resource.to_owned()).or_default());
        Registration {
            waiters: self,
            resource: resource.to_owned(),
            notify: Some(notify),
        }
    }

    /// Wakes the waiters of `resource` registered so far.
    pub(super) fn wake(&self, resource: &str) {
        let map = self.map.locked();
        if let Some(notify) = map.get(resource) {
            notify.notify_waiters();
        }
    }

    /// Wakes every waiter (events may have been lost, e.g. on a reconnect).
    pub(super) fn wake_all(&self) {
        let map = self.map.locked();
        for notify in map.values() {
            notify.notify_waiters();
        }
    }
}

/// One waiter's interest in a resource; removes the resource's entry when the last one goes.
pub(super) struct Registration<'a> {
    waiters: &'a Waiters,
    resource: String,
    notify: Option<Arc<Notify>>,
}

impl Registration<'_> {
    /// Create (and `enable`) the `Notified` future before checking the backend.
    pub(super) fn notify(&self) -> &Notify {
        self.notify.as_ref().expect("set until drop")
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        let mut map = self.waiters.map.locked();
        // Every clone and drop of these Arcs happens under the lock, so the count is exact.
        drop(self.notify.take());
        if map
            .get(&self.resource)
            .is_some_and(|n| Arc::strong_count(n) == 1)
        {
            map.remove(&self.resource);
        }
    }
}

/// `changed()` for a backend whose event connection wakes [`Waiters`]: once `connected` says
/// that connection is up (until then the waiter's backoff wakes it), register, then look with
/// `free`; a lease already gone returns at once, otherwise the next wake-up of `resource`
/// does. Registered before looking, so a release between the look and the wait still wakes.
pub(super) async fn changed(
    mut connected: watch::Receiver<bool>,
    waiters: &Waiters,
    resource: &str,
    free: impl Future<Output = bool>,
) {
    if connected.wait_for(|c| *c).await.is_err() {
        return std::future::pending().await;
    }
    let registration = waiters.register(resource);
    let notified = registration.notify().notified();
    tokio::pin!(notified);
    notified.as_mut().enable();
    if free.await {
        return;
    }
    notified.await;
}

/// How often an event connection proves it is alive (a round trip on that same connection),
/// and how long the answer may take before the subscription counts as lost.
pub(super) const HEARTBEAT: Duration = Duration::from_secs(1);

/// How many events a receiver may fall behind before it sees `Lagged`.
const GRANT_EVENTS_CAPACITY: usize = 4096;

/// The sending side of grant events, shared by a backend and its event task.
pub(super) struct GrantFeed {
    tx: broadcast::Sender<GrantEvent>,
    /// Whether the subscription delivers; also taken while `Lost`/`Live` are sent, so that a
    /// new receiver's initial state and its first event agree.
    live: Mutex<bool>,
}

impl GrantFeed {
    pub(super) fn new(live: bool) -> Self {
        GrantFeed {
            tx: broadcast::channel(GRANT_EVENTS_CAPACITY).0,
            live: Mutex::new(live),
        }
    }

    pub(super) fn subscribe(&self) -> GrantEvents {
        let live = self.live.locked();
        GrantEvents {
            live: *live,
            events: self.tx.subscribe(),
        }
    }

    /// Announces a (possible) new grant of `resource`.
    pub(super) fn changed(&self, resource: &str) {
        if self.tx.receiver_count() > 0 {
            let _ = self.tx.send(GrantEvent::Changed(resource.to_owned()));
        }
    }

    pub(super) fn lost(&self) {
        let mut live = self.live.locked();
        if *live {
            *live = false;
            let _ = self.tx.send(GrantEvent::Lost);
        }
    }

    pub(super) fn live(&self) {
        let mut live = self.live.locked();
        if !*live {
            *live = true;
            let _ = self.tx.send(GrantEvent::Live);
        }
    }

    /// Events may have been missed although the subscription is up (an event the backend
    /// could not attribute to one resource): everything cached must be read again.
    pub(super) fn resync(&self) {
        let live = self.live.locked();
        if *live {
            let _ = self.tx.send(GrantEvent::Lost);
            let _ = self.tx.send(GrantEvent::Live);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_ids_are_distinct_hex() {
        let ids: std::collections::HashSet<String> = (0..1000).map(|_| new_lease_id()).collect();
        assert_eq!(ids.len(), 1000);
        assert!(ids
            .iter()
            .all(|id| id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())));
    }

    #[test]
    fn waiters_clean_up() {
        let waiters = Waiters::default();
        {
            let _a = waiters.register("r");
            let _b = waiters.register("r");
            assert_eq!(waiters.map.lock().unwrap().len(), 1);
        }
        assert!(waiters.map.lock().unwrap().is_empty());
    }
}
