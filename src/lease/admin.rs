//! Inspecting leases from outside the fencegate that holds them (`fencegate leases`,
//! docs/operations.md "Inspect"). A backend opened for this
//! ([`crate::lease::open_for_admin`]) reads only: no event subscription, no table set-up.

use crate::fence::token::Token;
use serde::Serialize;

use super::LeaseError;
use crate::conn::BoxFuture;

/// What a backend knows of one resource's lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Lease {
    /// The resource id.
    pub resource: String,
    /// Whether a lease is held now (not released, not expired, as the backend judges it).
    pub held: bool,
    /// The holder of the lease held now.
    pub holder: Option<String>,
    /// The id of the lease held now (unique per grant).
    pub lease_id: Option<String>,
    /// The fencing token of the lease held now, or of the last one granted; `None`: never
    /// granted.
    pub token: Option<Token>,
    /// Milliseconds until the lease held now expires, by the backend's clock (etcd: whole
    /// seconds).
    pub expires_in_ms: Option<u64>,
}

impl Lease {
    /// A resource never leased, or one whose lease is not held (`token`: the last grant's).
    pub fn free(resource: &str, token: Option<Token>) -> Self {
        Lease {
            resource: resource.to_owned(),
            held: false,
            holder: None,
            lease_id: None,
            token,
            expires_in_ms: None,
        }
    }
}

/// One page of [`InspectLeases::list`], in resource order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LeasePage {
    /// The leases of this page, at most the `limit` asked for.
    pub leases: Vec<Lease>,
    /// The `--after` of the next page; `None` at the end.
    pub next: Option<String>,
}

impl LeasePage {
    /// A page of at most `limit` from `leases`, in order, which may hold one more.
    pub fn of(mut leases: Vec<Lease>, limit: usize) -> Self {
        let more = leases.len() > limit;
        leases.truncate(limit);
        let next = more
            .then(|| leases.last().map(|l| l.resource.clone()))
            .flatten();
        LeasePage { leases, next }
    }
}

/// Reads of one backend's leases.
pub trait InspectLeases: Send + Sync {
    /// The backend's kind, as the config names it: `embedded`, `redis`, `postgres` or `etcd`.
    fn kind(&self) -> &'static str;

    /// What the backend knows of `resource`'s lease ([`Lease::free`] if it was never leased).
    fn lease<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Lease, LeaseError>>;

    /// Up to `limit` resources ever leased whose id starts with `prefix` and sorts after
    /// `after`, in byte order of their ids.
    fn list<'a>(
        &'a self,
        prefix: &'a str,
        after: Option<&'a str>,
        limit: usize,
    ) -> BoxFuture<'a, Result<LeasePage, LeaseError>>;
}

/// Sorted, deduplicated `resources` after `after`, at most `limit + 1` of them.
pub fn page_of(mut resources: Vec<String>, after: Option<&str>, limit: usize) -> Vec<String> {
    resources.retain(|r| after.is_none_or(|a| r.as_str() > a));
    resources.sort();
    resources.dedup();
    resources.truncate(limit.saturating_add(1));
    resources
}
