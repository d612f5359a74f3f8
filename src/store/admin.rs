//! Inspecting and resetting recorded maxima from outside the fencegate that records them
//! (`fencegate fences`, docs/operations.md "Inspect" and "Repair (break-glass)").
//!
//! A store opened for this ([`crate::store::open_for_admin`]) connects and starts nothing: no
//! health probe, no retention check (which could sweep or write its mark), no follower of
//! resets. It reads, and writes only what [`Inspect::reset`] writes: the maximum and the
//! store's reset generation ([`crate::store::shared::resets`]), which tells the running
//! fencegates to drop their cached maxima.

use crate::fence::token::Token;
use serde::Serialize;

use super::{BoxFuture, StoreError};

/// What a store knows of one resource's maximum, cheaply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Fence {
    /// The resource id.
    pub resource: String,
    /// The recorded maximum; `None`: nothing recorded.
    pub max_token: Option<Token>,
    /// PostgreSQL: the maximum before the last raise (or reset).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub previous_token: Option<Token>,
    /// When the maximum was last raised, in milliseconds since the Unix epoch: kept by
    /// PostgreSQL and the embedded store only while a run with `fence.retention` raises it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub raised_at_ms: Option<u64>,
    /// Redis with `fence.retention`: milliseconds until the key expires.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_in_ms: Option<u64>,
    /// etcd: the revision of the last raise (or reset).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mod_revision: Option<i64>,
}

impl Fence {
    /// A resource with nothing recorded.
    pub fn absent(resource: &str) -> Self {
        Fence::recorded(resource, None)
    }

    /// A maximum with nothing else known.
    pub fn recorded(resource: &str, max_token: Option<Token>) -> Self {
        Fence {
            resource: resource.to_owned(),
            max_token,
            previous_token: None,
            raised_at_ms: None,
            expires_in_ms: None,
            mod_revision: None,
        }
    }
}

/// One page of [`Inspect::list`], in resource order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Page {
    /// The resources of the page, in resource order.
    pub fences: Vec<Fence>,
    /// The cursor of the next page (`--after`): the last resource of this one; `None` at the
    /// end.
    pub next: Option<String>,
}

impl Page {
    /// A page of at most `limit` from `fences`, which holds up to `limit + 1` in order (one
    /// more than `limit`: there is a next page).
    pub fn of(mut fences: Vec<Fence>, limit: usize) -> Self {
        let more = fences.len() > limit;
        fences.truncate(limit);
        let next = more
            .then(|| fences.last().map(|f| f.resource.clone()))
            .flatten();
        Page { fences, next }
    }
}

/// Inspection and repair of one store's maxima.
pub trait Inspect: Send + Sync {
    /// The store's kind as `store.kind` names it, which `fencegate fences` reports.
    fn kind(&self) -> &'static str;

    /// The maximum of `resource` and what the store knows of it.
    fn fence<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Fence, StoreError>>;

    /// Up to `limit` resources whose id starts with `prefix` and sorts after `after`, in
    /// byte order of their ids.
    fn list<'a>(
        &'a self,
        prefix: &'a str,
        after: Option<&'a str>,
        limit: usize,
    ) -> BoxFuture<'a, Result<Page, StoreError>>;

    /// Sets the maximum of `resource` to `to` (lower or higher: a break-glass repair), then
    /// moves the reset generation; returns the maximum it replaced.
    fn reset<'a>(
        &'a self,
        resource: &'a str,
        to: Token,
    ) -> BoxFuture<'a, Result<Option<Token>, StoreError>>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fence::token::tk;

    #[test]
    fn a_page_names_its_last_resource_as_next_only_when_there_is_more() {
        let fences = |n: usize| {
            (0..n)
                .map(|i| Fence::recorded(&format!("r{i}"), Some(tk(i as u64))))
                .collect::<Vec<_>>()
        };
        let page = Page::of(fences(3), 2);
        assert_eq!(page.fences.len(), 2);
        assert_eq!(page.next.as_deref(), Some("r1"));
        let page = Page::of(fences(2), 2);
        assert_eq!(page.next, None);
        assert_eq!(Page::of(fences(0), 2).next, None);
    }
}
