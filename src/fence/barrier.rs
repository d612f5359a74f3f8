//! The per-resource in-flight barrier of `ordering: serialize`.
//!
//! A write registers its token *before* its compare-and-raise, and is forwarded only once no
//! registered write with a lower token remains. Any lower token that registers later is refused
//! by the raise (the maximum is already ours), so the upstream sees admitted writes of one
//! resource in non-decreasing token order. Equal tokens (one lease epoch) do not wait for each
//! other. The lowest registered token never waits, so the barrier cannot deadlock.

use crate::fence::Token;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::sync::Locked;
use dashmap::DashMap;
use tokio::sync::Notify;

/// The in-flight barriers of every resource (`ordering: serialize`), shared by a fence's
/// writes and kept across reloads.
#[derive(Default)]
pub struct Barriers {
    slots: DashMap<Box<str>, Arc<Slot>>,
}

#[derive(Default)]
struct Slot {
    /// Registered tokens and how many writes carry each. Held only for map updates, never
    /// across an await.
    in_flight: Mutex<BTreeMap<Token, usize>>,
    changed: Notify,
}

impl Slot {
    fn lower_in_flight(&self, token: Token) -> bool {
        let map = self.in_flight.locked();
        map.range(..token).next().is_some()
    }
}

/// A write's place in its resource's barrier; dropping it lets higher tokens through.
pub struct Ticket {
    barriers: Arc<Barriers>,
    resource: Box<str>,
    token: Token,
    slot: Arc<Slot>,
}

impl Barriers {
    /// Barriers with no write registered, in the `Arc` that [`Barriers::enter`] takes.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Registers a write; call before the compare-and-raise.
    pub fn enter(self: &Arc<Self>, resource: &str, token: Token) -> Ticket {
        // Registration happens under the shard lock so it cannot race the removal of an
        // emptied slot (which also takes the shard lock).
        let slot = {
            let entry = self.slots.entry(resource.into()).or_default();
            *entry.in_flight.locked().entry(token).or_default() += 1;
            Arc::clone(&entry)
        };
        Ticket {
            barriers: Arc::clone(self),
            resource: resource.into(),
            token,
            slot,
        }
    }

    /// Resources with registered writes (for tests: empty once all tickets are dropped).
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether no resource has a registered write.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

/// A write's turn did not come within its limit (`barrier_timeout`): refused with `503`
/// `barrier-timeout`.
#[derive(Debug, PartialEq, Eq)]
pub struct BarrierTimeout;

impl Ticket {
    /// Waits until every registered write with a lower token has finished.
    pub async fn wait_turn(&self, limit: Duration) -> Result<(), BarrierTimeout> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let notified = self.slot.changed.notified();
            tokio::pin!(notified);
            // Subscribe before checking, so a wake-up between check and wait is not lost.
            notified.as_mut().enable();
            if !self.slot.lower_in_flight(self.token) {
                return Ok(());
            }
            tokio::time::timeout_at(deadline, notified)
                .await
                .map_err(|_| BarrierTimeout)?;
        }
    }

    /// The token this write registered.
    pub fn token(&self) -> Token {
        self.token
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        {
            let mut map = self.slot.in_flight.locked();
            if let Some(count) = map.get_mut(&self.token) {
                *count -= 1;
                if *count == 0 {
                    map.remove(&self.token);
                }
            }
        }
        self.slot.changed.notify_waiters();
        self.barriers
            .slots
            .remove_if(&self.resource, |_, slot| slot.in_flight.locked().is_empty());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn higher_waits_for_lower_and_equal_does_not() {
        let b = Barriers::new();
        let low = b.enter("r", 5.into());
        let same = b.enter("r", 5.into());
        let high = b.enter("r", 7.into());
        assert_eq!(same.wait_turn(Duration::from_secs(1)).await, Ok(()));
        assert_eq!(
            high.wait_turn(Duration::from_secs(1)).await,
            Err(BarrierTimeout)
        );
        let waiter = tokio::spawn(async move { high.wait_turn(Duration::from_secs(60)).await });
        drop(low);
        tokio::task::yield_now().await;
        drop(same);
        assert_eq!(waiter.await.unwrap(), Ok(()));
        assert!(b.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn other_resources_are_independent() {
        let b = Barriers::new();
        let _a = b.enter("a", 1.into());
        let other = b.enter("b", 9.into());
        assert_eq!(other.wait_turn(Duration::from_millis(1)).await, Ok(()));
        assert_eq!(b.len(), 2);
    }
}
