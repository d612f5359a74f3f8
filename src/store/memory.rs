//! In-process maxima: fast and forgetful. For tests and demos; a restart forgets everything.

use crate::fence::resource::ResourceId;
use crate::fence::token::Token;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Mutex;

use dashmap::mapref::entry::Entry;
use dashmap::DashMap;
use tokio::time::Instant;

use super::{decide, record_key, BoxFuture, FenceStore, Rule, StoreError, Verdict};
use crate::idempotency::{self, Begin, Claim, Record};
use crate::sync::Locked;

/// A test's look at the maxima from inside a claim.
#[cfg(test)]
type Between = dyn Fn(&DashMap<Box<str>, Token>) + Send + Sync;

/// The `memory` store: maxima and idempotency records in this process's memory, for tests
/// and demos; a restart forgets everything.
#[derive(Default)]
pub struct MemoryStore {
    maxima: DashMap<Box<str>, Token>,
    /// Idempotency records by [`record_key`], with their expiry instants (monotonic, so a
    /// wall-clock step expires nothing; `None`: the window does not fit in an `Instant`, the
    /// record never expires).
    records: DashMap<String, (Record, Option<Instant>)>,
    /// Expiry instants in order, so expiring touches only what expired (an entry whose record
    /// was rewritten later is skipped).
    expiries: Mutex<BinaryHeap<Reverse<(Instant, String)>>>,
    /// Runs inside a claim, between reading the maximum and raising it (tests).
    #[cfg(test)]
    between: Option<Box<Between>>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// The compare-and-raise itself, synchronous: one shard lock, no await inside.
    pub fn raise(&self, resource: &str, token: Token, rule: Rule) -> Verdict {
        // Existing resources (the common case) take the lookup path, which allocates nothing.
        if let Some(mut current) = self.maxima.get_mut(resource) {
            let verdict = decide(Some(*current), token, rule);
            if verdict.raised(token) {
                *current = token;
            }
            return verdict;
        }
        match self.maxima.entry(resource.into()) {
            Entry::Occupied(mut e) => {
                let verdict = decide(Some(*e.get()), token, rule);
                if verdict.raised(token) {
                    e.insert(token);
                }
                verdict
            }
            Entry::Vacant(e) => {
                let verdict = decide(None, token, rule);
                if verdict.raised(token) {
                    e.insert(token);
                }
                verdict
            }
        }
    }

    /// Resources with a recorded maximum.
    pub fn len(&self) -> usize {
        self.maxima.len()
    }

    /// Idempotency records currently kept (expired ones go on the next write).
    pub fn records(&self) -> usize {
        self.records.len()
    }

    fn expire(&self, now: Instant) {
        let mut heap = self.expiries.locked();
        while let Some(Reverse((at, _))) = heap.peek() {
            if *at > now {
                break;
            }
            let Reverse((at, key)) = heap.pop().expect("peeked");
            self.records
                .remove_if(&key, |_, (_, expires)| expires.is_some_and(|e| e <= at));
        }
    }

    fn schedule(&self, key: String, at: Instant) {
        let mut heap = self.expiries.locked();
        heap.push(Reverse((at, key)));
    }

    /// [`FenceStore::begin_idempotent`], synchronous and one atomic step: the record's shard
    /// lock and the maximum's entry are both held from the reads through the decision to the
    /// writes, so no raise lands between the decision and the claim it makes.
    pub fn begin(&self, resource: &str, key: &str, claim: &Claim) -> Begin {
        let now = Instant::now();
        self.expire(now);
        let k = record_key(resource, key);
        let expires = now.checked_add(claim.window);
        let entry = self.records.entry(k.clone());
        let live = match &entry {
            Entry::Occupied(e) if e.get().1.is_none_or(|at| at > now) => Some(&e.get().0),
            _ => None,
        };
        // Always records, then maxima (`raise` takes only maxima): no lock-order inversion.
        let maximum = self.maxima.entry(resource.into());
        let current = match &maximum {
            Entry::Occupied(e) => Some(*e.get()),
            Entry::Vacant(_) => None,
        };
        #[cfg(test)]
        if let Some(between) = &self.between {
            between(&self.maxima);
        }
        let begin = idempotency::decide(live, current, claim);
        if let Begin::Execute { .. } = begin {
            match maximum {
                Entry::Occupied(mut e) if claim.token > *e.get() => {
                    e.insert(claim.token);
                }
                Entry::Occupied(_) => {}
                Entry::Vacant(e) => {
                    e.insert(claim.token);
                }
            }
            entry.insert((claim.in_flight(), expires));
            if let Some(at) = expires {
                self.schedule(k, at);
            }
        }
        begin
    }

    /// [`FenceStore::finish_idempotent`], synchronous: writes only over the `in_flight`
    /// record this attempt claimed.
    pub fn finish(&self, resource: &str, key: &str, claim: &Claim, outcome: &Record) -> bool {
        let now = Instant::now();
        let k = record_key(resource, key);
        let expires = now.checked_add(claim.window);
        let Some(mut slot) = self.records.get_mut(&k) else {
            return false;
        };
        let (record, at) = &mut *slot;
        let ours = at.is_none_or(|at| at > now) && record.owned_by(claim);
        if ours {
            *record = outcome.clone();
            *at = expires;
            drop(slot);
            if let Some(at) = expires {
                self.schedule(k, at);
            }
        }
        ours
    }

    /// Whether no maximum is recorded.
    pub fn is_empty(&self) -> bool {
        self.maxima.is_empty()
    }
}

impl FenceStore for MemoryStore {
    fn compare_and_raise<'a>(
        &'a self,
        resource: &'a ResourceId,
        token: Token,
        rule: Rule,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>> {
        let verdict = self.raise(resource, token, rule);
        Box::pin(std::future::ready(Ok(verdict)))
    }

    fn raise_at_once(
        &self,
        resource: &ResourceId,
        token: Token,
        rule: Rule,
    ) -> Option<Result<Verdict, StoreError>> {
        Some(Ok(self.raise(resource, token, rule)))
    }

    fn current<'a>(
        &'a self,
        resource: &'a ResourceId,
    ) -> BoxFuture<'a, Result<Option<Token>, StoreError>> {
        let current = self.maxima.get(resource.as_str()).map(|v| *v);
        Box::pin(std::future::ready(Ok(current)))
    }

    fn healthy(&self) -> bool {
        true
    }

    fn begin_idempotent<'a>(
        &'a self,
        resource: &'a ResourceId,
        key: &'a str,
        claim: &'a Claim,
    ) -> BoxFuture<'a, Result<Begin, StoreError>> {
        Box::pin(std::future::ready(Ok(self.begin(resource, key, claim))))
    }

    fn finish_idempotent<'a>(
        &'a self,
        resource: &'a ResourceId,
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use dashmap::try_result::TryResult;

    use super::*;
    use crate::config::EqualTokens;
    use crate::idempotency::{AttemptId, Fingerprint};

    fn claim(token: Token) -> Claim {
        Claim {
            token,
            fingerprint: Fingerprint([1; 32]),
            rule: EqualTokens::Allow.into(),
            window: Duration::from_secs(60),
            may_execute: true,
            attempt: AttemptId::next(),
        }
    }

    /// A raise that tries to land while a claim decides: it must either wait for the claim
    /// (the maximum is locked) or be seen by it, never slip in between decision and write.
    #[tokio::test]
    async fn a_raise_cannot_slip_between_a_claims_decision_and_its_write() {
        let seen = Arc::new(Mutex::new(None));
        let saw = Arc::clone(&seen);
        let store = MemoryStore {
            between: Some(Box::new(move |maxima| {
                let raced = match maxima.try_get_mut("r") {
                    TryResult::Present(mut current) => {
                        *current = 9.into();
                        "raised to 9"
                    }
                    TryResult::Locked => "locked",
                    TryResult::Absent => "absent",
                };
                *saw.lock().unwrap() = Some(raced);
            })),
            ..MemoryStore::default()
        };
        assert_eq!(
            store.raise("r", 3.into(), EqualTokens::Allow.into()),
            Verdict::Admitted { previous: None }
        );
        let begin = store.begin("r", "k", &claim(5.into()));
        let current = *store.maxima.get("r").unwrap();
        // Executed means token 5 is now the maximum: nothing higher was admitted before it.
        assert_eq!(
            (begin, current, *seen.lock().unwrap()),
            (
                Begin::Execute {
                    previous: Some(3.into())
                },
                5.into(),
                Some("locked")
            )
        );
        assert_eq!(
            store.raise("r", 9.into(), EqualTokens::Allow.into()),
            Verdict::Admitted {
                previous: Some(5.into())
            }
        );
    }
}
