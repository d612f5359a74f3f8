//! The lease agent: acquires with backoff, renews every TTL/3 ± 15 %, declares a lease lost
//! at its local validity deadline (monotonic clock) whatever the backend says, and releases.
//!
//! The egress side asks [`Agent::token_for`], which checks the deadline itself at the moment
//! of use: a token is never attached after the deadline, even if the renewer task is late.
//!
//! While an acquisition is under way (its first attempt, and the wait for a holder to let go),
//! it is listed as an [`Attempt`], which the lease API reports as `acquiring`.
//!
//! Draining (SIGTERM) is one-way and fails closed: from [`Agent::start_draining`] on nothing
//! is granted (waiting acquisitions end with [`AcquireError::Draining`], and a grant the
//! backend committed meanwhile is given back), and held leases turn `draining`, whose tokens
//! are no longer attached. Every change of a lease's state is one compare-and-set on its
//! snapshot, so no step (a renewal, say) writes back a state that another one replaced.

use crate::fence::token::Token;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::sync::Locked;
use tokio::sync::{broadcast, watch};
use tokio::time::Instant;

mod lease;

use lease::Snapshot;
pub use lease::{Event, Lease, State};

use super::backend::{Acquired, Grant, LeaseBackend, LeaseError};
use super::schedule::{backoff, renew_delay, unit, valid_until};
use crate::config::{AcquireConfig, LeaseTtl};
use crate::metrics::Metrics;
use crate::ttl::MAX_LEASE_DURATION;

/// An acquisition under way: tried at once, then retried until its `wait` has passed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    /// The resource id asked for.
    pub resource: String,
    /// The holder asking.
    pub holder: String,
    /// The TTL the lease will be granted with.
    pub ttl: Duration,
}

/// Lists an acquisition under [`Agent::attempts`] for as long as it lives (until it returns,
/// or its future is dropped).
struct Acquiring<'a> {
    agent: &'a Agent,
    resource: String,
    id: u64,
}

impl Drop for Acquiring<'_> {
    fn drop(&mut self) {
        let mut acquiring = self.agent.acquiring.locked();
        if let Some(attempts) = acquiring.get_mut(&self.resource) {
            attempts.retain(|(id, _)| *id != self.id);
            if attempts.is_empty() {
                acquiring.remove(&self.resource);
            }
        }
    }
}

/// Whether an acquisition may go on towards a grant, and keep one the backend made: never
/// once draining has begun, so that nothing is granted after the drain's snapshot of the
/// leases it releases. Asked when an acquisition starts, before each attempt, and when a grant
/// arrives (under the `leases` lock, which draining takes too).
pub(crate) fn may_grant(draining: bool) -> bool {
    !draining
}

/// Why an acquisition did not return a lease.
#[derive(Debug)]
pub enum AcquireError {
    /// Held by another holder after waiting; retry after the hint.
    Held {
        /// The holder, when the backend says.
        holder: Option<String>,
    },
    /// The backend failed on the last attempt.
    Unavailable(LeaseError),
    /// A TTL below the minimum of `leases.ttl` (the TTL given, or the derived minimum).
    TtlTooShort {
        /// That minimum.
        minimum: Duration,
    },
    /// A TTL above [`MAX_LEASE_DURATION`].
    TtlTooLong {
        /// The maximum, 1 h.
        maximum: Duration,
    },
    /// A `wait` above [`MAX_LEASE_DURATION`].
    WaitTooLong {
        /// The maximum, 1 h.
        maximum: Duration,
    },
    /// Shutdown has begun: nothing is granted any more.
    Draining,
}

/// The lease agent: the leases this fencegate holds for its app, acquired, renewed and
/// released through one backend (see the [module docs](self)).
pub struct Agent {
    backend: Arc<dyn LeaseBackend>,
    ttl: LeaseTtl,
    acquire: AcquireConfig,
    leases: Mutex<HashMap<String, Arc<Lease>>>,
    /// Acquisitions under way per resource, oldest first, each with its id.
    acquiring: Mutex<HashMap<String, Vec<(u64, Attempt)>>>,
    next_attempt: std::sync::atomic::AtomicU64,
    events: broadcast::Sender<Event>,
    /// True from SIGTERM on. Set under the `leases` lock, which a grant also takes to be
    /// listed: a grant is either listed before draining began (and released by the drain)
    /// or sees the flag (and is given back at once). Waiters watch it to stop waiting.
    draining: watch::Sender<bool>,
    /// Flips to true once every lease has been released at shutdown, so event streams end
    /// (after sending `released`) and do not hold the drain.
    closed: watch::Sender<bool>,
    metrics: Arc<Metrics>,
    /// Holds a renewal between the backend's answer and its write, so that tests can start
    /// draining in between.
    #[cfg(test)]
    pause: tests::Pause,
    /// Holds an acquisition between the backend's grant and its use, so that tests can stop
    /// the clock there.
    #[cfg(test)]
    grant_pause: tests::Pause,
}

impl Agent {
    /// An agent on `backend`, with the `leases.ttl` and `leases.acquire` settings, counting in
    /// `metrics`' lease metrics.
    pub fn new(
        backend: Arc<dyn LeaseBackend>,
        ttl: LeaseTtl,
        acquire: AcquireConfig,
        metrics: Arc<Metrics>,
    ) -> Arc<Self> {
        Arc::new(Agent {
            backend,
            ttl,
            acquire,
            leases: Mutex::default(),
            acquiring: Mutex::default(),
            next_attempt: std::sync::atomic::AtomicU64::new(0),
            events: broadcast::channel(1024).0,
            draining: watch::channel(false).0,
            closed: watch::channel(false).0,
            metrics,
            #[cfg(test)]
            pause: tests::Pause::default(),
            #[cfg(test)]
            grant_pause: tests::Pause::default(),
        })
    }

    /// The lease TTL of the config (`leases.ttl`), for requests that name none.
    pub fn default_ttl(&self) -> Duration {
        self.ttl.ttl
    }

    /// The lease backend.
    pub fn backend(&self) -> &Arc<dyn LeaseBackend> {
        &self.backend
    }

    /// Every lease's events from now on: a transition or a renewal each (the channel keeps
    /// 1024; a reader further behind skips the missed ones).
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }

    /// Resolves once shutdown has released every lease.
    pub fn closed(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.closed.subscribe();
        async move {
            let _ = rx.wait_for(|d| *d).await;
        }
    }

    /// The lease listed here for `resource`: held, draining, or lost (until it is released or
    /// asked for again).
    pub fn get(&self, resource: &str) -> Option<Arc<Lease>> {
        self.leases.locked().get(resource).cloned()
    }

    /// Every lease listed here, lost ones included, by resource.
    pub fn all(&self) -> Vec<Arc<Lease>> {
        let mut all: Vec<_> = self.leases.locked().values().cloned().collect();
        all.sort_by(|a, b| a.grant.resource.cmp(&b.grant.resource));
        all
    }

    /// The oldest acquisition under way for `resource`, if any.
    pub fn attempt(&self, resource: &str) -> Option<Attempt> {
        self.acquiring
            .locked()
            .get(resource)
            .and_then(|attempts| attempts.first())
            .map(|(_, attempt)| attempt.clone())
    }

    /// The oldest acquisition under way for each resource, by resource.
    pub fn attempts(&self) -> Vec<Attempt> {
        let mut all: Vec<Attempt> = self
            .acquiring
            .locked()
            .values()
            .filter_map(|attempts| attempts.first())
            .map(|(_, attempt)| attempt.clone())
            .collect();
        all.sort_by(|a, b| a.resource.cmp(&b.resource));
        all
    }

    fn start_acquiring(&self, resource: &str, holder: &str, ttl: Duration) -> Acquiring<'_> {
        let id = self
            .next_attempt
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let attempt = Attempt {
            resource: resource.to_owned(),
            holder: holder.to_owned(),
            ttl,
        };
        self.acquiring
            .locked()
            .entry(resource.to_owned())
            .or_default()
            .push((id, attempt));
        Acquiring {
            agent: self,
            resource: resource.to_owned(),
            id,
        }
    }

    /// The token to attach to a write for `resource`, if a lease is held and locally valid now.
    pub fn token_for(&self, resource: &str) -> Option<Token> {
        let lease = self.get(resource)?;
        lease.state().attaches().then_some(lease.grant.token)
    }

    /// Acquires `resource` for `holder`: try once, then retry with backoff (woken early by the
    /// backend's change events) until `wait` has passed.
    pub async fn acquire(
        self: &Arc<Self>,
        resource: &str,
        holder: &str,
        ttl: Option<Duration>,
        wait: Duration,
    ) -> Result<Arc<Lease>, AcquireError> {
        if !may_grant(self.is_draining()) {
            return Err(AcquireError::Draining);
        }
        let ttl = ttl.unwrap_or(self.ttl.ttl);
        if ttl < self.ttl.minimum {
            return Err(AcquireError::TtlTooShort {
                minimum: self.ttl.minimum,
            });
        }
        if ttl > MAX_LEASE_DURATION {
            return Err(AcquireError::TtlTooLong {
                maximum: MAX_LEASE_DURATION,
            });
        }
        if wait > MAX_LEASE_DURATION {
            return Err(AcquireError::WaitTooLong {
                maximum: MAX_LEASE_DURATION,
            });
        }
        if let Some(existing) = self.get(resource) {
            let state = existing.state();
            if state == State::Held && existing.grant.holder == holder {
                return Ok(existing);
            }
            // Held here by another holder, the backend says so too, and the loop below waits
            // for it like for any other holder; a lost or released lease is forgotten, and a
            // lost one given back, so that neither this acquisition nor the next holder waits
            // for its TTL, nor does it outlive a drain.
            if state.forgotten_on_acquire() {
                self.forget(resource, &existing);
                if state.given_back_on_acquire() {
                    let why = "lost lease given back before a new acquisition";
                    self.give_back(&existing.grant, why).await;
                }
            }
        }
        let _acquiring = self.start_acquiring(resource, holder, ttl);
        let mut draining = self.draining.subscribe();
        let started = Instant::now();
        // Both bounded above (MAX_LEASE_DURATION), so this cannot overflow; fail closed if not.
        let deadline = started.checked_add(wait).unwrap_or(started);
        let mut attempt = 0;
        loop {
            if !may_grant(*draining.borrow_and_update()) {
                return Err(AcquireError::Draining);
            }
            let sent = Instant::now();
            let outcome = match self.backend.try_acquire(resource, holder, ttl).await {
                Ok(Acquired::Granted(grant)) => {
                    #[cfg(test)]
                    self.grant_pause.wait_if_armed().await;
                    // A grant taken in at or after its local deadline (counted from the
                    // request: the backend answered slower than the TTL, or this process was
                    // stopped while the answer waited) is no lease: it may have expired on the
                    // backend and gone to another holder. Given back, it counts as an answer
                    // that came too late.
                    if Instant::now() >= valid_until(sent, ttl, self.ttl.drift_buffer) {
                        let why = "lease granted past its local deadline; given back";
                        self.give_back(&grant, why).await;
                        AcquireError::Unavailable(LeaseError::timeout(format!(
                            "the grant arrived {} ms after it was asked for, past the lease's \
                             local deadline (its TTL of {} ms less the drift buffer)",
                            sent.elapsed().as_millis(),
                            ttl.as_millis()
                        )))
                    } else {
                        self.metrics
                            .lease
                            .acquisition
                            .observe(started.elapsed().as_secs_f64());
                        return match self.hold(grant, ttl, sent) {
                            Ok(lease) => Ok(lease),
                            Err(grant) => {
                                let why = "lease granted while draining; given back";
                                self.give_back(&grant, why).await;
                                Err(AcquireError::Draining)
                            }
                        };
                    }
                }
                Ok(Acquired::Held { holder }) => AcquireError::Held { holder },
                Err(e) => AcquireError::Unavailable(e),
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(outcome);
            }
            if attempt == 0 {
                tracing::debug!(
                    resource,
                    holder_id = holder,
                    ttl_ms = ttl.as_millis() as u64,
                    wait_ms = wait.as_millis() as u64,
                    "lease acquisition waiting"
                );
            }
            let delay = backoff(attempt, &self.acquire, unit()).min(deadline - now);
            attempt += 1;
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = self.backend.changed(resource) => {}
                // Checked at the top of the loop.
                _ = draining.changed() => {}
            }
        }
    }

    /// Forgets `lost`, listed for `resource`, unless another lease is listed there by now:
    /// an acquisition running alongside may have been granted one since `lost` was read,
    /// and that one stays (forgotten, it would be renewed but never attached nor released).
    fn forget(&self, resource: &str, lost: &Arc<Lease>) {
        let mut leases = self.leases.locked();
        if leases.get(resource).is_some_and(|l| Arc::ptr_eq(l, lost)) {
            leases.remove(resource);
        }
    }

    /// Whether shutdown has begun.
    pub fn is_draining(&self) -> bool {
        *self.draining.borrow()
    }

    /// Releases `grant` on the backend, which releases it only if it still holds that grant
    /// (its lease id), so a newer grant is never touched: a grant that arrived after draining
    /// began, or a lost lease an acquisition forgot. `why` is the log line.
    async fn give_back(&self, grant: &Grant, why: &'static str) {
        let (released, error) = match self.backend.release(grant).await {
            Ok(released) => (released, None),
            Err(e) => (false, Some(e.to_string())),
        };
        tracing::info!(
            resource = grant.resource,
            holder_id = grant.holder,
            lease_id = grant.lease_id,
            fencing_token = grant.token.get(),
            released,
            error,
            "{why}"
        );
    }

    /// Lists a new grant as held here and starts renewing it, unless draining has begun, in
    /// which case the grant is handed back to the caller to give back.
    fn hold(
        self: &Arc<Self>,
        grant: Grant,
        ttl: Duration,
        sent: Instant,
    ) -> Result<Arc<Lease>, Grant> {
        let lease = {
            let mut leases = self.leases.locked();
            if !may_grant(self.is_draining()) {
                return Err(grant);
            }
            let lease = Arc::new(Lease {
                grant,
                ttl,
                snapshot: watch::channel(Snapshot {
                    state: State::Held,
                    valid_until: valid_until(sent, ttl, self.ttl.drift_buffer),
                })
                .0,
                renewer: Mutex::new(None),
            });
            leases.insert(lease.grant.resource.clone(), Arc::clone(&lease));
            // Under the lock: the gauge follows the lease listed for the resource.
            self.metrics.lease.held(&lease.grant.resource);
            lease
        };
        self.emit("held", &lease);
        let renewer = tokio::spawn(Arc::clone(self).renew_loop(Arc::clone(&lease)));
        *lease.renewer.locked() = Some(renewer);
        Ok(lease)
    }

    /// Renews every TTL/3 ± 15 % until the lease is released or lost.
    async fn renew_loop(self: Arc<Self>, lease: Arc<Lease>) {
        loop {
            let deadline = lease.snapshot.borrow().valid_until;
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => {
                    return self.lose(&lease, "the local validity deadline passed without a renewal");
                }
                () = tokio::time::sleep(renew_delay(lease.ttl, unit())) => {}
            }
            let sent = Instant::now();
            let renewed =
                tokio::time::timeout_at(deadline, self.backend.renew(&lease.grant, lease.ttl))
                    .await;
            match renewed {
                Err(_) => {
                    return self.lose(
                        &lease,
                        "the local validity deadline passed during a renewal",
                    );
                }
                Ok(Ok(true)) => {
                    self.metrics.lease.renewals_ok.inc();
                    #[cfg(test)]
                    self.pause.wait_if_armed().await;
                    // An answer taken in only after the deadline (the process was stopped
                    // while it waited: the timeout above polls the answer first) comes too
                    // late, as if the timeout had fired: the backend may have let the lease go
                    // and granted it again meanwhile.
                    if Instant::now() >= deadline {
                        return self.lose(
                            &lease,
                            "the local validity deadline passed during a renewal",
                        );
                    }
                    // Only the deadline moves: held stays held, draining stays draining, and
                    // a lease released or lost meanwhile stays so.
                    let until = valid_until(sent, lease.ttl, self.ttl.drift_buffer);
                    let extended = lease.transition(|s| {
                        s.state.live() && {
                            s.valid_until = s.valid_until.max(until);
                            true
                        }
                    });
                    if extended {
                        self.emit("renewed", &lease);
                    }
                }
                Ok(Ok(false)) => {
                    self.metrics.lease.renewals_lost.inc();
                    return self.lose(&lease, "the backend no longer has this lease");
                }
                Ok(Err(e)) => {
                    self.metrics.lease.renewals_failed.inc();
                    tracing::warn!(
                        resource = lease.grant.resource,
                        holder_id = lease.grant.holder,
                        lease_id = lease.grant.lease_id,
                        fencing_token = lease.grant.token.get(),
                        ttl_ms = lease.ttl.as_millis() as u64,
                        valid_for_ms = lease.valid_for().as_millis() as u64,
                        error = %e,
                        state = lease.snapshot.borrow().state.as_str(),
                        "lease renewal failed; retrying"
                    );
                    self.emit("renew_failed", &lease);
                }
            }
        }
    }

    /// The lease is gone locally: stop attaching its token, tell the app, never re-acquire.
    fn lose(&self, lease: &Arc<Lease>, why: &str) {
        let now = Instant::now();
        let lost = lease.transition(|s| {
            s.state.live() && {
                s.state = State::Expired;
                s.valid_until = now;
                true
            }
        });
        if !lost {
            // Released meanwhile: nothing to declare.
            return;
        }
        self.metrics.lease.expiry_forced.inc();
        {
            // A newer lease on the resource (granted after the backend dropped this one) has
            // the gauge: only the lease listed for the resource writes it.
            let leases = self.leases.locked();
            let current = leases
                .get(&lease.grant.resource)
                .is_none_or(|l| Arc::ptr_eq(l, lease));
            if current {
                self.metrics.lease.not_held(&lease.grant.resource);
            }
        }
        // The one line of this transition: WARN, with the reason and the new state.
        tracing::warn!(
            resource = lease.grant.resource,
            holder_id = lease.grant.holder,
            lease_id = lease.grant.lease_id,
            fencing_token = lease.grant.token.get(),
            ttl_ms = lease.ttl.as_millis() as u64,
            reason = why,
            state = State::Expired.as_str(),
            "lease lost"
        );
        self.emit("lost", lease);
    }

    /// Releases a lease held here. `None` if this agent holds nothing valid for `resource`
    /// (never acquired, already released, or lost: a lost lease is forgotten here and given
    /// back to the backend in case it still has it, but it was not held).
    pub async fn release(&self, resource: &str) -> Option<Result<Arc<Lease>, LeaseError>> {
        let lease = {
            let mut leases = self.leases.locked();
            let lease = leases.remove(resource)?;
            self.metrics.lease.not_held(&lease.grant.resource);
            lease
        };
        if let Some(renewer) = lease.renewer.locked().take() {
            renewer.abort();
        }
        let now = Instant::now();
        let mut was_held = false;
        lease.transition(|s| {
            was_held = s.state.live() && now < s.valid_until;
            s.state = State::Released;
            s.valid_until = now;
            true
        });
        // A lost lease is released too: harmless if someone else holds it (compare-and-delete).
        let released = self.backend.release(&lease.grant).await;
        if !was_held {
            return None;
        }
        match &released {
            Ok(_) => self.emit("released", &lease),
            Err(e) => tracing::warn!(
                resource,
                holder_id = lease.grant.holder,
                lease_id = lease.grant.lease_id,
                fencing_token = lease.grant.token.get(),
                was_held,
                error = %e,
                "lease release failed; it expires at its TTL"
            ),
        }
        Some(released.map(|_| lease))
    }

    /// SIGTERM: grant nothing from now on (waiting acquisitions end with
    /// [`AcquireError::Draining`]), and stop attaching the tokens of held leases.
    pub fn start_draining(&self) {
        let leases = self.leases.locked();
        self.draining.send_replace(true);
        for lease in leases.values() {
            lease.transition(|s| match s.state.drained() {
                Some(drained) => {
                    s.state = drained;
                    true
                }
                None => false,
            });
        }
    }

    /// Releases every lease (the last step of the drain). Drains first, if that has not
    /// begun yet: a lease granted after this snapshot would outlive the process.
    pub async fn release_all(&self) {
        self.start_draining();
        let resources: Vec<String> = self
            .all()
            .iter()
            .map(|l| l.grant.resource.clone())
            .collect();
        for resource in resources {
            let _ = self.release(&resource).await;
        }
        self.closed.send_replace(true);
    }

    fn emit(&self, event: &'static str, lease: &Lease) {
        let e = Event {
            event,
            resource: lease.grant.resource.clone(),
            holder: lease.grant.holder.clone(),
            lease_id: lease.grant.lease_id.clone(),
            fencing_token: lease.grant.token,
            ttl_ms: lease.ttl.as_millis(),
            // As the lease API shows it: a lease whose local deadline has passed is expired,
            // whatever transition is announced.
            state: lease.state(),
        };
        // One line per transition: `lost` and `renew_failed` have their own WARN line, with
        // the reason; a successful renewal is a DEBUG line (one per lease every TTL/3).
        match event {
            "held" | "released" => tracing::info!(
                resource = e.resource,
                holder_id = e.holder,
                lease_id = e.lease_id,
                fencing_token = e.fencing_token.get(),
                ttl_ms = e.ttl_ms as u64,
                state = e.state.as_str(),
                "lease {event}"
            ),
            "renewed" => tracing::debug!(
                resource = e.resource,
                holder_id = e.holder,
                lease_id = e.lease_id,
                fencing_token = e.fencing_token.get(),
                ttl_ms = e.ttl_ms as u64,
                valid_for_ms = lease.valid_for().as_millis() as u64,
                state = e.state.as_str(),
                "lease renewed"
            ),
            _ => {}
        }
        let _ = self.events.send(e);
    }
}

#[cfg(test)]
mod tests;
