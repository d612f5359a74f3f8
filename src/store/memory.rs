//! In-process maxima: fast and forgetful. For tests and demos; a restart forgets everything.

use dashmap::mapref::entry::Entry;
use dashmap::DashMap;

use super::{decide, BoxFuture, FenceStore, StoreError, Verdict};
use crate::config::EqualTokens;

#[derive(Default)]
pub struct MemoryStore {
    maxima: DashMap<Box<str>, u64>,
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

    fn current<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<u64>, StoreError>> {
        let current = self.maxima.get(resource).map(|v| *v);
        Box::pin(std::future::ready(Ok(current)))
    }

    fn healthy(&self) -> bool {
        true
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}
