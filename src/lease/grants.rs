//! The latest grant per resource, for authoritative fencing, cached from the lease backend's
//! grant events so that a fenced write usually needs no backend round trip.
//!
//! [`GrantCache::latest`] answers from the cache when an entry is trusted, and otherwise reads
//! the backend ([`LeaseBackend::latest_token`]) and caches the answer. The rules:
//!
//! - **Only while the subscription is live.** The cache starts live only if the backend's
//!   subscription is; on `Lost` every entry is dropped and reads bypass the cache (each one is a
//!   backend round trip, so a backend that is down fails them: fail closed). On `Live` every
//!   entry is dropped again, so nothing read before `Live` is trusted after it. A `Lagged`
//!   receiver counts as `Lost` then `Live`. A closed channel (or a backend without grant
//!   events) is never live.
//! - **No lost update.** Before reading the backend, a reader leaves a `Pending(ticket)` marker
//!   on the resource (or reuses one already there). Events remove the resource's entry
//!   (`Lost`/`Live` remove every entry). The answer is cached only if the reader's marker is
//!   still there after the read: then no event for the resource arrived between the start of
//!   the read and the insert, and since a backend sends `Changed` after the grant's commit,
//!   every grant the read did not see is still to be announced and will remove the entry.
//! - **Events first.** Every look at the cache first applies every event already received (the
//!   receiver is drained under the same lock as the entries), so a grant announced before a
//!   write arrives is never answered from an older entry. The embedded backend announces a
//!   grant before `try_acquire` returns, so there is no window at all with it.
//! - **Bounded.** At most `capacity` entries; an arbitrary one is evicted to make room (the
//!   cache only saves round trips).
//! - **Never below a grant seen.** Every answer is raised to the highest grant seen for the
//!   resource ([`GrantCache::floor`], kept in a [`BoundedMaxima`] through `Lost` too, since
//!   grants never decrease), which also lets a caller refuse a lower token without a round trip.
//!
//! **The residual window.** Between a new grant's commit in the backend and its event reaching
//! this process (typically milliseconds over the network; longer if the event connection is
//! silently cut, until its heartbeat notices within about two seconds), a cached entry still
//! names the previous grant, so a write carrying the previous grant's token can pass this
//! check. The observed fence (the store's compare-and-raise) still applies to it.

use crate::fence::token::Token;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::broadcast::error::TryRecvError;
use tokio::sync::broadcast::Receiver;

use super::backend::{GrantEvent, LeaseBackend, LeaseError};
use crate::maxima::BoundedMaxima;
use crate::sync::Locked;

/// The latest grant per resource, from the cache when trusted, else from the backend.
pub struct GrantCache {
    backend: Arc<dyn LeaseBackend>,
    floor: BoundedMaxima,
    state: Mutex<State>,
}

struct State {
    events: Receiver<GrantEvent>,
    /// The subscription delivers, so entries may be trusted.
    live: bool,
    /// The channel closed: never live again.
    closed: bool,
    entries: HashMap<Box<str>, Entry>,
    capacity: usize,
    next_ticket: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    /// A read started after this marker was placed; its answer may replace it.
    Pending(u64),
    /// The latest grant (`None`: never granted), as read while nothing was announced since.
    Ready(Option<Token>),
}

impl State {
    /// Applies every event received so far.
    fn sync(&mut self) {
        if self.closed {
            return;
        }
        loop {
            match self.events.try_recv() {
                Ok(GrantEvent::Changed(resource)) => {
                    self.entries.remove(resource.as_str());
                }
                Ok(GrantEvent::Lost) => {
                    self.live = false;
                    self.entries.clear();
                }
                Ok(GrantEvent::Live) => {
                    self.live = true;
                    self.entries.clear();
                }
                // Events were missed, but the subscription is as live as it was.
                Err(TryRecvError::Lagged(_)) => self.entries.clear(),
                Err(TryRecvError::Empty) => return,
                Err(TryRecvError::Closed) => {
                    self.closed = true;
                    self.live = false;
                    self.entries.clear();
                    return;
                }
            }
        }
    }

    fn insert(&mut self, resource: &str, entry: Entry) {
        if let Some(slot) = self.entries.get_mut(resource) {
            *slot = entry;
            return;
        }
        if self.capacity == 0 {
            return;
        }
        if self.entries.len() >= self.capacity {
            let victim = self.entries.keys().next().cloned();
            if let Some(victim) = victim {
                self.entries.remove(&victim);
            }
        }
        self.entries.insert(resource.into(), entry);
    }
}

impl GrantCache {
    /// Subscribes to `backend`'s grant events (inside a Tokio runtime); at most `capacity`
    /// resources are cached, and as many grants remembered for [`GrantCache::floor`].
    pub fn new(backend: Arc<dyn LeaseBackend>, capacity: usize) -> Self {
        let subscription = backend.grant_events();
        GrantCache {
            backend,
            floor: BoundedMaxima::new(capacity),
            state: Mutex::new(State {
                events: subscription.events,
                live: subscription.live,
                closed: false,
                entries: HashMap::new(),
                capacity,
                next_ticket: 0,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        let mut state = self.state.locked();
        state.sync();
        state
    }

    /// The token of the latest grant for `resource` (`None`: never granted), from the cache
    /// when it is trusted, else from the backend. Never below [`GrantCache::floor`].
    pub async fn latest(&self, resource: &str) -> Result<Option<Token>, LeaseError> {
        let ticket = {
            let mut state = self.state();
            if !state.live {
                None
            } else {
                match state.entries.get(resource).copied() {
                    Some(Entry::Ready(latest)) => return Ok(self.raised(resource, latest)),
                    // A read is under way since that marker: this one started later, so its
                    // answer may replace the marker as well.
                    Some(Entry::Pending(ticket)) => Some(ticket),
                    None => {
                        let ticket = state.next_ticket;
                        state.next_ticket += 1;
                        state.insert(resource, Entry::Pending(ticket));
                        Some(ticket)
                    }
                }
            }
        };
        let latest = self.backend.latest_token(resource).await?;
        if let Some(latest) = latest {
            self.floor.observe(resource, latest);
        }
        if let Some(ticket) = ticket {
            let mut state = self.state();
            // Still there: no event for the resource (and no Lost, Live or lag) since the
            // marker was placed, which was before the read started.
            if state.live && state.entries.get(resource) == Some(&Entry::Pending(ticket)) {
                state.insert(resource, Entry::Ready(latest));
            }
        }
        Ok(self.raised(resource, latest))
    }

    /// The highest grant seen for `resource` (a lower bound of the latest grant), if any.
    pub fn floor(&self, resource: &str) -> Option<Token> {
        self.floor.get(resource)
    }

    /// Whether answers may currently come from the cache (the subscription is live).
    pub fn is_live(&self) -> bool {
        self.state().live
    }

    /// Resources in the cache (read or being read).
    pub fn len(&self) -> usize {
        self.state().entries.len()
    }

    /// Whether the cache holds no resource.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn raised(&self, resource: &str, latest: Option<Token>) -> Option<Token> {
        match (latest, self.floor.get(resource)) {
            (Some(latest), Some(floor)) => Some(latest.max(floor)),
            (latest, floor) => latest.or(floor),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::fence::token::tk;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use tokio::sync::{broadcast, Notify};

    use super::*;
    use crate::conn::BoxFuture;
    use crate::lease::backend::GrantEvents;
    use crate::lease::{Acquired, Grant};

    /// An in-memory backend whose events the test sends, and whose reads can be held after
    /// they took their snapshot of the token.
    struct Fake {
        tokens: Mutex<HashMap<String, Token>>,
        events: broadcast::Sender<GrantEvent>,
        live: bool,
        reads: AtomicUsize,
        fail: std::sync::atomic::AtomicBool,
        /// When set, a read waits for `resume` after taking its snapshot (and says so).
        hold: std::sync::atomic::AtomicBool,
        snapshot_taken: Notify,
        resume: Notify,
    }

    impl Fake {
        fn new(live: bool, capacity: usize) -> Arc<Fake> {
            Arc::new(Fake {
                tokens: Mutex::default(),
                events: broadcast::channel(capacity).0,
                live,
                reads: AtomicUsize::new(0),
                fail: Default::default(),
                hold: Default::default(),
                snapshot_taken: Notify::new(),
                resume: Notify::new(),
            })
        }

        /// A new grant: committed, then announced.
        fn grant(&self, resource: &str) -> Token {
            let token = {
                let mut tokens = self.tokens.lock().unwrap();
                let t = tokens.entry(resource.to_owned()).or_insert(Token::ZERO);
                *t = t.next().expect("a test grants few tokens");
                *t
            };
            self.send(GrantEvent::Changed(resource.to_owned()));
            token
        }

        fn send(&self, event: GrantEvent) {
            let _ = self.events.send(event);
        }

        fn reads(&self) -> usize {
            self.reads.load(Ordering::SeqCst)
        }
    }

    impl LeaseBackend for Fake {
        fn try_acquire<'a>(
            &'a self,
            _: &'a str,
            _: &'a str,
            _: Duration,
        ) -> BoxFuture<'a, Result<Acquired, LeaseError>> {
            unimplemented!()
        }
        fn renew<'a>(
            &'a self,
            _: &'a Grant,
            _: Duration,
        ) -> BoxFuture<'a, Result<bool, LeaseError>> {
            unimplemented!()
        }
        fn release<'a>(&'a self, _: &'a Grant) -> BoxFuture<'a, Result<bool, LeaseError>> {
            unimplemented!()
        }
        fn latest_token<'a>(
            &'a self,
            resource: &'a str,
        ) -> BoxFuture<'a, Result<Option<Token>, LeaseError>> {
            Box::pin(async move {
                self.reads.fetch_add(1, Ordering::SeqCst);
                if self.fail.load(Ordering::SeqCst) {
                    return Err(LeaseError::unreachable("down"));
                }
                let snapshot = self.tokens.lock().unwrap().get(resource).copied();
                if self.hold.load(Ordering::SeqCst) {
                    let resumed = self.resume.notified();
                    self.snapshot_taken.notify_one();
                    resumed.await;
                }
                Ok(snapshot)
            })
        }
        fn changed<'a>(&'a self, _: &'a str) -> BoxFuture<'a, ()> {
            Box::pin(std::future::pending())
        }
        fn grant_events(&self) -> GrantEvents {
            GrantEvents {
                live: self.live,
                events: self.events.subscribe(),
            }
        }
        fn kind(&self) -> &'static str {
            "fake"
        }
    }

    fn cache(fake: &Arc<Fake>, capacity: usize) -> GrantCache {
        GrantCache::new(Arc::clone(fake) as Arc<dyn LeaseBackend>, capacity)
    }

    #[tokio::test]
    async fn a_cached_grant_needs_no_round_trip_until_a_new_grant_is_announced() {
        let fake = Fake::new(true, 64);
        let cache = cache(&fake, 100);
        assert_eq!(cache.latest("r").await.unwrap(), None);
        assert_eq!(cache.latest("r").await.unwrap(), None);
        assert_eq!(fake.reads(), 1, "never granted is cached too");
        let t1 = fake.grant("r");
        assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t1.get())));
        for _ in 0..10 {
            assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t1.get())));
        }
        assert_eq!(fake.reads(), 2);
        // Another resource's grant leaves this entry alone.
        fake.grant("other");
        assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t1.get())));
        assert_eq!(fake.reads(), 2);
        let t2 = fake.grant("r");
        assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t2.get())));
        assert_eq!(fake.reads(), 3);
        assert_eq!(cache.floor("r"), Some(tk(t2.get())));
    }

    /// The negative control: a grant is committed and announced while a read that took its
    /// snapshot before it is still under way. That read's (stale) answer must not be cached.
    #[tokio::test]
    async fn an_event_during_a_read_keeps_its_stale_answer_out_of_the_cache() {
        let fake = Fake::new(true, 64);
        let cache = Arc::new(cache(&fake, 100));
        let t1 = fake.grant("r");
        fake.hold.store(true, Ordering::SeqCst);
        let snapshot_taken = fake.snapshot_taken.notified();
        let reader = tokio::spawn({
            let cache = Arc::clone(&cache);
            async move { cache.latest("r").await }
        });
        snapshot_taken.await;
        // The read saw t1; now t2 is granted and announced before the read's answer is in.
        let t2 = fake.grant("r");
        fake.hold.store(false, Ordering::SeqCst);
        fake.resume.notify_one();
        // The reader itself answers what it read (the window the observed fence covers)...
        assert_eq!(reader.await.unwrap().unwrap(), Some(tk(t1.get())));
        // ...but did not cache it: the next look reads the backend again and sees t2.
        assert_eq!(cache.state().entries.get("r"), None);
        let reads = fake.reads();
        assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t2.get())));
        assert_eq!(fake.reads(), reads + 1, "the stale answer was cached");
        assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t2.get())));
        assert_eq!(fake.reads(), reads + 1);
    }

    /// The same with the subscription lost (and even restored) during the read.
    #[tokio::test]
    async fn a_lost_subscription_during_a_read_keeps_its_answer_out_of_the_cache() {
        for restored in [false, true] {
            let fake = Fake::new(true, 64);
            let cache = Arc::new(cache(&fake, 100));
            let t1 = fake.grant("r");
            fake.hold.store(true, Ordering::SeqCst);
            let snapshot_taken = fake.snapshot_taken.notified();
            let reader = tokio::spawn({
                let cache = Arc::clone(&cache);
                async move { cache.latest("r").await }
            });
            snapshot_taken.await;
            fake.send(GrantEvent::Lost);
            // Granted while nothing is announced.
            let t2 = {
                let mut tokens = fake.tokens.lock().unwrap();
                let t = tokens.get_mut("r").unwrap();
                *t = t.next().unwrap();
                tokens["r"]
            };
            if restored {
                fake.send(GrantEvent::Live);
            }
            fake.hold.store(false, Ordering::SeqCst);
            fake.resume.notify_one();
            assert_eq!(reader.await.unwrap().unwrap(), Some(tk(t1.get())));
            assert!(cache.state().entries.is_empty());
            assert_eq!(cache.is_live(), restored);
            let reads = fake.reads();
            assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t2.get())));
            assert_eq!(fake.reads(), reads + 1);
        }
    }

    #[tokio::test]
    async fn lost_bypasses_the_cache_and_fails_closed_until_live() {
        let fake = Fake::new(true, 64);
        let cache = cache(&fake, 100);
        let t1 = fake.grant("r");
        assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t1.get())));
        assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t1.get())));
        assert_eq!(fake.reads(), 1);

        fake.send(GrantEvent::Lost);
        assert!(!cache.is_live());
        assert!(cache.is_empty());
        // Every read goes to the backend, which is down: no answer from the cache.
        fake.fail.store(true, Ordering::SeqCst);
        assert!(cache.latest("r").await.is_err());
        assert!(cache.latest("r").await.is_err());
        assert_eq!(fake.reads(), 3);
        // Up again, still not subscribed: answers, but nothing is cached.
        fake.fail.store(false, Ordering::SeqCst);
        assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t1.get())));
        assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t1.get())));
        assert_eq!(fake.reads(), 5);
        assert!(cache.is_empty());
        // The lower bound survives: a grant seen is never forgotten.
        assert_eq!(cache.floor("r"), Some(tk(t1.get())));

        fake.send(GrantEvent::Live);
        assert!(cache.is_live());
        assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t1.get())));
        assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t1.get())));
        assert_eq!(fake.reads(), 6);
    }

    #[tokio::test]
    async fn live_drops_entries_read_before_it() {
        let fake = Fake::new(true, 64);
        let cache = cache(&fake, 100);
        let t1 = fake.grant("r");
        assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t1.get())));
        // Lost and Live back to back (a reconnect): grants in between were not announced.
        fake.send(GrantEvent::Lost);
        let t2 = {
            let mut tokens = fake.tokens.lock().unwrap();
            let t = tokens.get_mut("r").unwrap();
            *t = t.next().unwrap();
            tokens["r"]
        };
        fake.send(GrantEvent::Live);
        assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t2.get())));
        assert_eq!(fake.reads(), 2);
    }

    #[tokio::test]
    async fn a_lagging_receiver_forgets_everything() {
        let fake = Fake::new(true, 4);
        let cache = cache(&fake, 100);
        let t1 = fake.grant("r");
        assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t1.get())));
        // More events than the channel holds: the one about `r` may be among the lost ones.
        for i in 0..10 {
            fake.grant(&format!("other{i}"));
        }
        assert!(cache.is_empty());
        assert!(cache.is_live());
        assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t1.get())));
        assert_eq!(fake.reads(), 2);
    }

    #[tokio::test]
    async fn a_backend_without_events_is_never_cached() {
        let fake = Fake::new(false, 64);
        let cache = cache(&fake, 100);
        let t1 = fake.grant("r");
        for _ in 0..3 {
            assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t1.get())));
        }
        assert_eq!(fake.reads(), 3);
        // The default `grant_events` of the trait: a closed channel, never live.
        let closed = GrantEvents::never();
        assert!(!closed.live);
        let mut state = State {
            events: closed.events,
            live: true,
            closed: false,
            entries: HashMap::from([("r".into(), Entry::Ready(Some(1.into())))]),
            capacity: 10,
            next_ticket: 0,
        };
        state.sync();
        assert!(!state.live && state.closed && state.entries.is_empty());
    }

    #[tokio::test]
    async fn the_cache_is_bounded() {
        let fake = Fake::new(true, 64);
        let cache = cache(&fake, 3);
        for i in 0..10 {
            let resource = format!("r{i}");
            fake.grant(&resource);
            cache.latest(&resource).await.unwrap();
            assert!(cache.len() <= 3);
        }
        assert_eq!(cache.len(), 3);
        assert_eq!(fake.reads(), 10);
        let none = GrantCache::new(Arc::clone(&fake) as Arc<dyn LeaseBackend>, 0);
        none.latest("r1").await.unwrap();
        none.latest("r1").await.unwrap();
        assert!(none.is_empty());
    }

    /// Answers never go below a grant seen before, even if an older answer is cached.
    #[tokio::test]
    async fn answers_are_raised_to_the_highest_grant_seen() {
        let fake = Fake::new(true, 64);
        let cache = cache(&fake, 100);
        let t1 = fake.grant("r");
        assert_eq!(cache.latest("r").await.unwrap(), Some(t1));
        cache.floor.observe("r", tk(t1.get() + 5));
        assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t1.get() + 5)));
        assert_eq!(fake.reads(), 1);
    }

    /// Two readers of one resource share the marker: the later one may cache its answer too.
    #[tokio::test]
    async fn concurrent_readers_share_a_marker() {
        let fake = Fake::new(true, 64);
        let cache = Arc::new(cache(&fake, 100));
        let t1 = fake.grant("r");
        fake.hold.store(true, Ordering::SeqCst);
        let first_taken = fake.snapshot_taken.notified();
        let first = tokio::spawn({
            let cache = Arc::clone(&cache);
            async move { cache.latest("r").await }
        });
        first_taken.await;
        fake.hold.store(false, Ordering::SeqCst);
        assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t1.get())));
        assert_eq!(
            cache.state().entries.get("r"),
            Some(&Entry::Ready(Some(tk(t1.get()))))
        );
        fake.resume.notify_one();
        assert_eq!(first.await.unwrap().unwrap(), Some(tk(t1.get())));
        assert_eq!(cache.latest("r").await.unwrap(), Some(tk(t1.get())));
        assert_eq!(fake.reads(), 2);
    }
}
