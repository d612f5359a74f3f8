//! In-process maxima: fast and forgetful. For tests and demos; a restart forgets everything.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Mutex;

use dashmap::mapref::entry::Entry;
use dashmap::DashMap;
use tokio::time::Instant;

use super::{decide, record_key, BoxFuture, FenceStore, StoreError, Verdict};
use crate::config::EqualTokens;
use crate::idempotency::{self, Begin, Claim, Record};

#[derive(Default)]
pub struct MemoryStore {
    maxima: DashMap<Box<str>, u64>,
    /// Idempotency records by [`record_key`], with their expiry instants.
    records: DashMap<String, (Record, Instant)>,
    /// Expiry instants in order, so expiring touches only what expired (an entry whose record
    /// was rewritten later is skipped).
    expiries: Mutex<BinaryHeap<Reverse<(Instant, String)>>>,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// The compare-and-raise itself, synchronous: one shard lock, no await inside.
    pub fn raise(&self, resource: &str, token: u64, equal: EqualTokens) -> Verdict {
        // Existing resources (the common case) take the lookup path, which allocates nothing.
        if let Some(mut current) = self.maxima.get_mut(resource) {
            let verdict = decide(Some(*current), token, equal);
            if verdict.raised(token) {
                *current = token;
            }
            return verdict;
        }
        match self.maxima.entry(resource.into()) {
            Entry::Occupied(mut e) => {
                let verdict = decide(Some(*e.get()), token, equal);
                if verdict.raised(token) {
                    e.insert(token);
                }
                verdict
            }
            Entry::Vacant(e) => {
                e.insert(token);
                Verdict::Admitted { previous: None }
            }
        }
    }

    pub fn len(&self) -> usize {
        self.maxima.len()
    }

    /// Idempotency records currently kept (expired ones go on the next write).
    pub fn records(&self) -> usize {
        self.records.len()
    }

    fn expire(&self, now: Instant) {
        let mut heap = self.expiries.lock().expect("expiry heap poisoned");
        while let Some(Reverse((at, _))) = heap.peek() {
            if *at > now {
                break;
            }
            let Reverse((at, key)) = heap.pop().expect("peeked");
            self.records
                .remove_if(&key, |_, (_, expires)| *expires <= at);
        }
    }

    fn schedule(&self, key: String, at: Instant) {
        let mut heap = self.expiries.lock().expect("expiry heap poisoned");
        heap.push(Reverse((at, key)));
    }

    /// [`FenceStore::begin_idempotent`], synchronous: the record's shard lock is held across
    /// the maximum's compare-and-raise.
    pub fn begin(&self, resource: &str, key: &str, claim: &Claim) -> Begin {
        let now = Instant::now();
        self.expire(now);
        let k = record_key(resource, key);
        let expires = now + claim.window;
        let entry = self.records.entry(k.clone());
        let live = match &entry {
            Entry::Occupied(e) if e.get().1 > now => Some(&e.get().0),
            _ => None,
        };
        let current = self.maxima.get(resource).map(|v| *v);
        let begin = idempotency::decide(live, current, claim);
        if let Begin::Execute { .. } = begin {
            self.raise(resource, claim.token, EqualTokens::Allow);
            entry.insert((claim.in_flight(), expires));
            self.schedule(k, expires);
        }
        begin
    }

    /// [`FenceStore::finish_idempotent`], synchronous: writes only over the `in_flight`
    /// record this attempt claimed.
    pub fn finish(&self, resource: &str, key: &str, claim: &Claim, outcome: &Record) -> bool {
        let now = Instant::now();
        let k = record_key(resource, key);
        let expires = now + claim.window;
        let Some(mut slot) = self.records.get_mut(&k) else {
            return false;
        };
        let (record, at) = &mut *slot;
        let ours = *at > now && record.owned_by(claim);
        if ours {
            *record = outcome.clone();
            *at = expires;
            drop(slot);
            self.schedule(k, expires);
        }
        ours
    }

    pub fn is_empty(&self) -> bool {
        self.maxima.is_empty()
    }
}

impl FenceStore for MemoryStore {
    fn compare_and_raise<'a>(
        &'a self,
        resource: &'a str,
        token: u64,
        equal: EqualTokens,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>> {
        let verdict = self.raise(resource, token, equal);
        Box::pin(std::future::ready(Ok(verdict)))
    }

    fn raise_at_once(
        &self,
        resource: &str,
        token: u64,
        equal: EqualTokens,
    ) -> Option<Result<Verdict, StoreError>> {
        Some(Ok(self.raise(resource, token, equal)))
    }

    fn current<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<u64>, StoreError>> {
        let current = self.maxima.get(resource).map(|v| *v);
        Box::pin(std::future::ready(Ok(current)))
    }

    fn healthy(&self) -> bool {
        true
    }

    fn begin_idempotent<'a>(
        &'a self,
        resource: &'a str,
        key: &'a str,
        claim: &'a Claim,
    ) -> BoxFuture<'a, Result<Begin, StoreError>> {
        Box::pin(std::future::ready(Ok(self.begin(resource, key, claim))))
    }

    fn finish_idempotent<'a>(
        &'a self,
        resource: &'a str,
        key: &'a str,
        claim: &'a Claim,
        outcome: &'a Record,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(std::future::ready(Ok(
            self.finish(resource, key, claim, outcome)
        )))
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}
