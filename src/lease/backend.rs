//! The lease backend trait: what a coordination system must answer, atomically.
//!
//! Besides single atomic steps, a backend publishes **grant events**
//! ([`LeaseBackend::grant_events`]) so that the latest grant per resource can be cached
//! ([`super::grants::GrantCache`]) without missing a newer grant:
//!
//! - [`GrantEvent::Changed`]`(resource)` after every new grant of `resource` is committed (a
//!   backend may send it for other changes too: an extra one only costs a round trip);
//! - [`GrantEvent::Lost`] when the subscription stops delivering (connection closed, heartbeat
//!   unanswered): grants from then on may go unannounced;
//! - [`GrantEvent::Live`] when it delivers again: every grant committed after `Live` was sent
//!   is announced, grants in between are not (readers must ask the backend again).
//!
//! Events go through a [`tokio::sync::broadcast`] channel; a receiver that falls more than
//! its capacity behind gets `Lagged` and must treat it as `Lost` immediately followed by `Live`.
//! One subscription (one connection) per backend serves every receiver.

use crate::fence::token::Token;
use std::time::Duration;

use tokio::sync::broadcast;

pub use super::error::LeaseError;
use crate::conn::BoxFuture;

/// A granted lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The resource id the lease is on.
    pub resource: String,
    /// Who holds it: the `holder` named when it was acquired.
    pub holder: String,
    /// Unique per grant (the owner value compared on renew and release).
    pub lease_id: String,
    /// The fencing token: strictly greater than every earlier grant's for this resource.
    pub token: Token,
}

/// What [`LeaseBackend::try_acquire`] got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquired {
    /// The lease is granted to the caller: a new grant, with a new token.
    Granted(Grant),
    /// Held by someone else (the holder id when the backend knows it).
    Held {
        /// The holder; `None` when the backend does not know it.
        holder: Option<String>,
    },
}

/// One coordination system's leases. Every method is one atomic step on the backend; none
/// waits or retries (the agent does).
pub trait LeaseBackend: Send + Sync + 'static {
    /// Grants the lease if it is free or expired, with a token above every earlier grant.
    fn try_acquire<'a>(
        &'a self,
        resource: &'a str,
        holder: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LeaseError>>;

    /// Extends the lease by `ttl` if `grant` still owns it; `Ok(false)` if it does not.
    fn renew<'a>(
        &'a self,
        grant: &'a Grant,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, LeaseError>>;

    /// Frees the lease if `grant` still owns it; `Ok(false)` if it did not.
    fn release<'a>(&'a self, grant: &'a Grant) -> BoxFuture<'a, Result<bool, LeaseError>>;

    /// The token of the latest grant for `resource` (held or not), for authoritative fencing.
    fn latest_token<'a>(
        &'a self,
        resource: &'a str,
    ) -> BoxFuture<'a, Result<Option<Token>, LeaseError>>;

    /// Resolves when the lease on `resource` may have become free (released or expired), as
    /// far as the backend's change events tell; backends without events never resolve.
    /// Waiters use it to wake before their backoff ends.
    fn changed<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, ()>;

    /// Subscribes to grant events for every resource (see the module documentation). Starts
    /// the backend's event subscription if it is not running yet, so it must be called inside
    /// a Tokio runtime. The default is a subscription that is never live: a backend without
    /// grant events gets no caching.
    fn grant_events(&self) -> GrantEvents {
        GrantEvents::never()
    }

    /// The backend's kind as `leases.backend.kind` names it (`embedded`, `redis`, `postgres`,
    /// `etcd`).
    fn kind(&self) -> &'static str;
}

/// A grant event (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrantEvent {
    /// `resource` was granted anew (or may have changed otherwise).
    Changed(String),
    /// The subscription stopped delivering: later grants may go unannounced until `Live`.
    Lost,
    /// The subscription delivers again; grants committed while it was lost were not announced.
    Live,
}

/// A receiver of grant events, and whether the subscription was live when it was created
/// (later transitions arrive as `Lost` and `Live`).
pub struct GrantEvents {
    /// Whether the subscription was live when the receiver was created.
    pub live: bool,
    /// The events from then on.
    pub events: broadcast::Receiver<GrantEvent>,
}

impl GrantEvents {
    /// A subscription that never delivers anything (its channel is closed).
    pub fn never() -> Self {
        GrantEvents {
            live: false,
            events: broadcast::channel(1).1,
        }
    }
}
