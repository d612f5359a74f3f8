//! A bounded cache of maxima: at most `capacity` resources, the recently used ones kept.
//!
//! Every value is a lower bound of the resource's recorded maximum (maxima never decrease), so
//! a token below a cached value is stale whatever happened since; the cache only saves a round
//! trip (or a file read), it never admits on its own. The embedded store also marks values as
//! *exact* ([`BoundedMaxima::confirm`]): its writer, the file's only writer, sets them to the
//! durable maximum after a commit and clears the mark ([`BoundedMaxima::unconfirm`]) before it
//! commits a raise, so an exact value is the durable maximum, not just a bound.
//!
//! The entries are split over shards by a hash of the resource, each with an equal share of the
//! capacity and two generations: a new or used entry goes to the young generation; when that
//! holds half the shard's share, the old generation is dropped and the young one becomes the old
//! one. A lookup that finds an entry in the old generation moves it back to the young one. So a
//! shard never holds more than its share, and an entry stays cached at least until its shard has
//! taken in half its share of other resources since the entry was last used. Dropping a
//! generation frees its keys in one go (about 3,000 with the default capacity of 100,000) and
//! keeps its table for the next young generation, so the cache allocates no table after warm-up.
//!
//! `fencegate fences reset` lowers a maximum in a shared store, which breaks "maxima never
//! decrease" for every value cached before it: the store's follower of resets
//! ([`crate::store::shared`]) then [`BoundedMaxima::clear`]s the cache. A value read before the
//! clear but cached after it would bring the old maximum back, so [`BoundedMaxima::observe_in`]
//! caches only values read since the last clear ([`BoundedMaxima::era`]).

use crate::fence::token::Token;
use crate::sync::Locked;
use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// A cached maximum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cached {
    /// At most the recorded maximum.
    pub value: Token,
    /// The recorded maximum itself (set by the embedded store's writer only).
    pub exact: bool,
}

/// Lower bounds of maxima, at most `capacity` resources.
pub struct BoundedMaxima {
    shards: Box<[Mutex<Shard>]>,
    /// Picks a resource's shard.
    pick: RandomState,
    capacity: usize,
    /// How many times the cache was cleared ([`BoundedMaxima::clear`]).
    era: AtomicU64,
}

/// Fewest entries per shard before the cache uses more than one shard.
const MIN_SHARE: usize = 4096;
/// Most shards: enough that two cores rarely wait for the same lock.
const MAX_SHARDS: usize = 16;

struct Shard {
    young: HashMap<Box<str>, Cached>,
    old: HashMap<Box<str>, Cached>,
    /// Most entries this shard holds.
    share: usize,
}

impl Shard {
    /// Entries the young generation takes before it becomes the old one. With a share of one
    /// there is no old generation.
    fn half(&self) -> usize {
        (self.share / 2).max(1)
    }

    /// Makes room in the young generation for one more entry.
    fn make_room(&mut self) {
        if self.young.len() < self.half() {
            return;
        }
        if self.share > 1 {
            std::mem::swap(&mut self.young, &mut self.old);
        }
        // The generation dropped here keeps its table for the young entries to come.
        self.young.clear();
    }

    /// The entry of `resource`, moved to the young generation if it was in the old one.
    fn find(&mut self, resource: &str) -> Option<&mut Cached> {
        if !self.young.contains_key(resource) {
            let (key, cached) = self.old.remove_entry(resource)?;
            self.make_room();
            self.young.insert(key, cached);
        }
        self.young.get_mut(resource)
    }

    /// The entry of `resource` where it is, without counting as a use.
    fn peek(&mut self, resource: &str) -> Option<&mut Cached> {
        match self.young.get_mut(resource) {
            Some(cached) => Some(cached),
            None => self.old.get_mut(resource),
        }
    }

    fn insert(&mut self, resource: &str, cached: Cached) {
        if self.share == 0 {
            return;
        }
        self.make_room();
        self.young.insert(resource.into(), cached);
    }

    fn len(&self) -> usize {
        self.young.len() + self.old.len()
    }
}

/// A higher `value` replaces the cached one and is not exact; one at or below it changes nothing.
fn lift(shard: &mut Shard, resource: &str, value: Token) {
    match shard.find(resource) {
        Some(cached) if cached.value >= value => {}
        Some(cached) => {
            *cached = Cached {
                value,
                exact: false,
            }
        }
        None => shard.insert(
            resource,
            Cached {
                value,
                exact: false,
            },
        ),
    }
}

impl BoundedMaxima {
    pub fn new(capacity: usize) -> Self {
        let shards = (capacity / MIN_SHARE).clamp(1, MAX_SHARDS);
        let share = capacity / shards;
        BoundedMaxima {
            shards: (0..shards)
                .map(|_| {
                    Mutex::new(Shard {
                        young: HashMap::new(),
                        old: HashMap::new(),
                        share,
                    })
                })
                .collect(),
            pick: RandomState::new(),
            capacity,
            era: AtomicU64::new(0),
        }
    }

    fn shard(&self, resource: &str) -> MutexGuard<'_, Shard> {
        let i = if self.shards.len() == 1 {
            0
        } else {
            (self.pick.hash_one(resource) % self.shards.len() as u64) as usize
        };
        // A panic while a shard was locked left it consistent (every step is one map
        // operation), and every value in it is still a lower bound.
        self.shards[i].locked()
    }

    /// A lower bound of the maximum of `resource`, if cached; counts as a use.
    pub fn get(&self, resource: &str) -> Option<Token> {
        self.entry(resource).map(|c| c.value)
    }

    /// The cached maximum of `resource` and whether it is exact; counts as a use.
    pub fn entry(&self, resource: &str) -> Option<Cached> {
        self.shard(resource).find(resource).copied()
    }

    /// Records that the maximum is at least `value`. A higher value replaces the cached one
    /// and is not exact; a value at or below it changes nothing.
    pub fn observe(&self, resource: &str, value: Token) {
        let mut shard = self.shard(resource);
        lift(&mut shard, resource, value);
    }

    /// Records that `value` is the maximum of `resource` now, exactly. Only the embedded
    /// store's writer may call this, with a value read or committed in its own transaction.
    pub fn confirm(&self, resource: &str, value: Token) {
        let mut shard = self.shard(resource);
        let exact = Cached { value, exact: true };
        match shard.find(resource) {
            Some(cached) => *cached = exact,
            None => shard.insert(resource, exact),
        }
    }

    /// The maximum of `resource` may be about to rise: its cached value is a lower bound only.
    pub fn unconfirm(&self, resource: &str) {
        if let Some(cached) = self.shard(resource).peek(resource) {
            cached.exact = false;
        }
    }

    /// The cache's era: take it before asking the store, and give it to
    /// [`BoundedMaxima::observe_in`] with the answer.
    pub fn era(&self) -> u64 {
        self.era.load(Ordering::SeqCst)
    }

    /// [`BoundedMaxima::observe`] for a value read in `era`: nothing if the cache was cleared
    /// since (the value may predate a reset).
    pub fn observe_in(&self, era: u64, resource: &str, value: Token) {
        let mut shard = self.shard(resource);
        // Checked under the shard's lock: a clear moves the era before it takes each shard's
        // lock, so a value cached here is either still of the current era or cleared after.
        if self.era.load(Ordering::SeqCst) != era {
            return;
        }
        lift(&mut shard, resource, value);
    }

    /// Forgets every cached value (a maximum was reset in the store) and starts a new era.
    pub fn clear(&self) {
        self.era.fetch_add(1, Ordering::SeqCst);
        for shard in self.shards.iter() {
            let mut shard = shard.locked();
            shard.young.clear();
            shard.old.clear();
        }
    }

    /// Drops `resource` from the cache (its store forgot its maximum).
    pub fn forget(&self, resource: &str) {
        let mut shard = self.shard(resource);
        shard.young.remove(resource);
        shard.old.remove(resource);
    }

    /// How many resources are cached.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.locked().len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most resources the cache holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether `resource` is cached, without counting as a use.
    #[cfg(test)]
    pub fn contains(&self, resource: &str) -> bool {
        self.shard(resource).peek(resource).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fence::token::tk;

    #[test]
    fn a_value_read_before_a_clear_is_not_cached_after_it() {
        let c = BoundedMaxima::new(16);
        let before = c.era();
        c.observe_in(before, "a", 9.into());
        assert_eq!(c.get("a"), Some(9.into()));
        c.clear();
        assert_eq!(c.get("a"), None);
        c.observe_in(before, "a", 9.into());
        assert_eq!(c.get("a"), None);
        c.observe_in(c.era(), "a", 4.into());
        assert_eq!(c.get("a"), Some(4.into()));
    }

    #[test]
    fn cache_is_bounded_and_only_rises() {
        let c = BoundedMaxima::new(2);
        c.observe("a", 5.into());
        c.observe("a", 3.into());
        assert_eq!(c.get("a"), Some(5.into()));
        c.observe("b", 1.into());
        c.observe("c", 1.into());
        assert_eq!(c.len(), 2);
        assert_eq!(c.get("c"), Some(1.into()));
        let none = BoundedMaxima::new(0);
        none.observe("a", 1.into());
        none.confirm("a", 1.into());
        assert!(none.is_empty());
        let one = BoundedMaxima::new(1);
        one.observe("a", 1.into());
        one.observe("b", 2.into());
        assert_eq!(
            (one.len(), one.get("a"), one.get("b")),
            (1, None, Some(2.into()))
        );
    }

    #[test]
    fn the_recently_used_stay() {
        let c = BoundedMaxima::new(100);
        c.observe("hot", 7.into());
        for i in 0..10_000 {
            c.observe(&format!("cold{i}"), i.into());
            // Used more often than every half share of new resources: never evicted.
            if i % 40 == 0 {
                assert_eq!(c.get("hot"), Some(7.into()), "after {i} others");
            }
            assert!(c.len() <= 100);
        }
        // The last half share of new resources are all there (but the uses of "hot" among
        // them).
        assert!((9_952..10_000).all(|i| c.contains(&format!("cold{i}"))));
        assert!(!c.contains("cold0"));
    }

    #[test]
    fn a_large_cache_is_sharded_and_bounded() {
        let c = BoundedMaxima::new(100_000);
        assert_eq!(c.shards.len(), MAX_SHARDS);
        for i in 0..300_000u64 {
            c.observe(&format!("r{i}"), tk(i));
        }
        assert!(c.len() <= 100_000, "{}", c.len());
        // Every shard holds at least its young generation's worth.
        assert!(c.len() >= 100_000 / 2, "{}", c.len());
    }

    #[test]
    fn exact_values_come_from_confirm_only() {
        let c = BoundedMaxima::new(10);
        c.observe("r", 5.into());
        assert_eq!(
            c.entry("r"),
            Some(Cached {
                value: 5.into(),
                exact: false
            })
        );
        c.confirm("r", 6.into());
        assert_eq!(
            c.entry("r"),
            Some(Cached {
                value: 6.into(),
                exact: true
            })
        );
        // A bound at or below an exact value leaves it exact; above it, it is a bound again.
        c.observe("r", 6.into());
        assert!(c.entry("r").unwrap().exact);
        c.unconfirm("r");
        assert_eq!(
            c.entry("r"),
            Some(Cached {
                value: 6.into(),
                exact: false
            })
        );
        c.confirm("r", 8.into());
        c.observe("r", 9.into());
        assert_eq!(
            c.entry("r"),
            Some(Cached {
                value: 9.into(),
                exact: false
            })
        );
        // Unconfirming what is not cached caches nothing.
        c.unconfirm("s");
        assert_eq!(c.entry("s"), None);
    }
}
