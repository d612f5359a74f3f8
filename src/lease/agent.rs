//! The lease agent: acquires with backoff, renews every TTL/3 ± 15 %, declares a lease lost
//! at its local validity deadline (monotonic clock) whatever the backend says, and releases.
//!
//! The egress side asks [`Agent::token_for`], which checks the deadline itself at the moment
//! of use: a token is never attached after the deadline, even if the renewer task is late.
//!
//! While an acquisition is under way (its first attempt, and the wait for a holder to let go),
//! it is listed as an [`Attempt`], which the lease API reports as `acquiring`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::backend::{Acquired, Grant, LeaseBackend, LeaseError};
use super::schedule::{backoff, renew_delay, unit, valid_until};
use crate::config::{AcquireConfig, LeaseTtl};
use crate::metrics::Metrics;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Acquiring,
    Held,
    Draining,
    Expired,
    Released,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Acquiring => "acquiring",
            State::Held => "held",
            State::Draining => "draining",
            State::Expired => "expired",
            State::Released => "released",
        }
    }
}

/// A lease transition or renewal, as sent on the events stream.
#[derive(Debug, Clone, Serialize)]
pub struct Event {
    pub event: &'static str,
    pub resource: String,
    pub holder: String,
    pub lease_id: String,
    pub fencing_token: u64,
    pub ttl_ms: u128,
    pub state: State,
}

#[derive(Debug, Clone, Copy)]
struct Snapshot {
    state: State,
    valid_until: Instant,
}

/// One lease held (or recently held) through this agent.
pub struct Lease {
    pub grant: Grant,
    pub ttl: Duration,
    snapshot: watch::Sender<Snapshot>,
    renewer: Mutex<Option<JoinHandle<()>>>,
}

impl Lease {
    pub fn state(&self) -> State {
        let snap = *self.snapshot.borrow();
        let live = matches!(snap.state, State::Held | State::Draining);
        if live && Instant::now() >= snap.valid_until {
            // The renewer declares it lost at the deadline; the view must not lag behind.
            State::Expired
        } else {
            snap.state
        }
    }

    /// Time left before the local deadline.
    pub fn valid_for(&self) -> Duration {
        self.snapshot
            .borrow()
            .valid_until
            .saturating_duration_since(Instant::now())
    }

    fn set(&self, state: State, valid_until: Instant) {
        self.snapshot.send_replace(Snapshot { state, valid_until });
    }
}

/// An acquisition under way: tried at once, then retried until its `wait` has passed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    pub resource: String,
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
        let mut acquiring = self.agent.acquiring.lock().expect("acquiring lock");
        if let Some(attempts) = acquiring.get_mut(&self.resource) {
            attempts.retain(|(id, _)| *id != self.id);
            if attempts.is_empty() {
                acquiring.remove(&self.resource);
            }
        }
    }
}

/// Why an acquisition did not return a lease.
#[derive(Debug)]
pub enum AcquireError {
    /// Held by another holder after waiting; retry after the hint.
    Held {
        holder: Option<String>,
    },
    Unavailable(LeaseError),
    TtlTooShort {
        minimum: Duration,
    },
    Draining,
}

pub struct Agent {
    backend: Arc<dyn LeaseBackend>,
    ttl: LeaseTtl,
    acquire: AcquireConfig,
    leases: Mutex<HashMap<String, Arc<Lease>>>,
    /// Acquisitions under way per resource, oldest first, each with its id.
    acquiring: Mutex<HashMap<String, Vec<(u64, Attempt)>>>,
    next_attempt: std::sync::atomic::AtomicU64,
    events: broadcast::Sender<Event>,
    draining: std::sync::atomic::AtomicBool,
    /// Flips to true once every lease has been released at shutdown, so event streams end
    /// (after sending `released`) and do not hold the drain.
    closed: watch::Sender<bool>,
    metrics: Arc<Metrics>,
}

impl Agent {
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
            draining: std::sync::atomic::AtomicBool::new(false),
            closed: watch::channel(false).0,
            metrics,
        })
    }

    pub fn default_ttl(&self) -> Duration {
        self.ttl.ttl
    }

    pub fn backend(&self) -> &Arc<dyn LeaseBackend> {
        &self.backend
    }

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

    pub fn get(&self, resource: &str) -> Option<Arc<Lease>> {
        self.leases
            .lock()
            .expect("leases lock")
            .get(resource)
            .cloned()
    }

    pub fn all(&self) -> Vec<Arc<Lease>> {
        let mut all: Vec<_> = self
            .leases
            .lock()
            .expect("leases lock")
            .values()
            .cloned()
            .collect();
        all.sort_by(|a, b| a.grant.resource.cmp(&b.grant.resource));
        all
    }

    /// The oldest acquisition under way for `resource`, if any.
    pub fn attempt(&self, resource: &str) -> Option<Attempt> {
        self.acquiring
            .lock()
            .expect("acquiring lock")
            .get(resource)
            .and_then(|attempts| attempts.first())
            .map(|(_, attempt)| attempt.clone())
    }

    /// The oldest acquisition under way for each resource, by resource.
    pub fn attempts(&self) -> Vec<Attempt> {
        let mut all: Vec<Attempt> = self
            .acquiring
            .lock()
            .expect("acquiring lock")
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
            .lock()
            .expect("acquiring lock")
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
    pub fn token_for(&self, resource: &str) -> Option<u64> {
        let lease = self.get(resource)?;
        (lease.state() == State::Held).then_some(lease.grant.token)
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
        if self.draining.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(AcquireError::Draining);
        }
        let ttl = ttl.unwrap_or(self.ttl.ttl);
        if ttl < self.ttl.minimum {
            return Err(AcquireError::TtlTooShort {
                minimum: self.ttl.minimum,
            });
        }
        if let Some(existing) = self.get(resource) {
            match existing.state() {
                State::Held if existing.grant.holder == holder => return Ok(existing),
                // Held here by another holder: the backend says so too, and the loop below
                // waits for it like for any other holder.
                State::Held | State::Acquiring | State::Draining => {}
                // A lost or released lease is only replaced by an explicit new request, as this.
                State::Expired | State::Released => {
                    self.leases.lock().expect("leases lock").remove(resource);
                }
            }
        }
        let _acquiring = self.start_acquiring(resource, holder, ttl);
        let started = Instant::now();
        let deadline = started + wait;
        let mut attempt = 0;
        loop {
            let sent = Instant::now();
            let outcome = match self.backend.try_acquire(resource, holder, ttl).await {
                Ok(Acquired::Granted(grant)) => {
                    self.metrics
                        .lease
                        .acquisition
                        .observe(started.elapsed().as_secs_f64());
                    return Ok(self.hold(grant, ttl, sent));
                }
                Ok(Acquired::Held { holder }) => AcquireError::Held { holder },
                Err(e) => AcquireError::Unavailable(e),
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(outcome);
            }
            let delay = backoff(attempt, &self.acquire, unit()).min(deadline - now);
            attempt += 1;
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = self.backend.changed(resource) => {}
            }
        }
    }

    fn hold(self: &Arc<Self>, grant: Grant, ttl: Duration, sent: Instant) -> Arc<Lease> {
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
        self.leases
            .lock()
            .expect("leases lock")
            .insert(lease.grant.resource.clone(), Arc::clone(&lease));
        self.metrics
            .lease
            .held
            .with_label_values(&[&lease.grant.resource])
            .set(1);
        self.emit("held", &lease);
        let renewer = tokio::spawn(Arc::clone(self).renew_loop(Arc::clone(&lease)));
        *lease.renewer.lock().expect("renewer lock") = Some(renewer);
        lease
    }

    /// Renews every TTL/3 ± 15 % until the lease is released or lost.
    async fn renew_loop(self: Arc<Self>, lease: Arc<Lease>) {
        loop {
            let deadline = lease.snapshot.borrow().valid_until;
            let next = Instant::now() + renew_delay(lease.ttl, unit());
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => {
                    return self.lose(&lease, "the local validity deadline passed without a renewal");
                }
                () = tokio::time::sleep_until(next) => {}
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
                    // Held stays held, draining stays draining.
                    let state = lease.snapshot.borrow().state;
                    lease.set(state, valid_until(sent, lease.ttl, self.ttl.drift_buffer));
                    self.emit("renewed", &lease);
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
                        fencing_token = lease.grant.token,
                        ttl_ms = lease.ttl.as_millis() as u64,
                        valid_for_ms = lease.valid_for().as_millis() as u64,
                        error = %e,
                        "lease renewal failed; retrying"
                    );
                    self.emit("renew_failed", &lease);
                }
            }
        }
    }

    /// The lease is gone locally: stop attaching its token, tell the app, never re-acquire.
    fn lose(&self, lease: &Lease, why: &str) {
        lease.set(State::Expired, Instant::now());
        self.metrics.lease.expiry_forced.inc();
        self.metrics
            .lease
            .held
            .with_label_values(&[&lease.grant.resource])
            .set(0);
        tracing::warn!(
            resource = lease.grant.resource,
            holder_id = lease.grant.holder,
            lease_id = lease.grant.lease_id,
            fencing_token = lease.grant.token,
            ttl_ms = lease.ttl.as_millis() as u64,
            reason = why,
            "lease lost"
        );
        self.emit("lost", lease);
    }

    /// Releases a lease held here. `None` if this agent holds nothing valid for `resource`
    /// (never acquired, already released, or lost: a lost lease is forgotten here and given
    /// back to the backend in case it still has it, but it was not held).
    pub async fn release(&self, resource: &str) -> Option<Result<Arc<Lease>, LeaseError>> {
        let lease = self.leases.lock().expect("leases lock").remove(resource)?;
        if let Some(renewer) = lease.renewer.lock().expect("renewer lock").take() {
            renewer.abort();
        }
        let was_held = matches!(lease.state(), State::Held | State::Draining);
        lease.set(State::Released, Instant::now());
        self.metrics
            .lease
            .held
            .with_label_values(&[&lease.grant.resource])
            .set(0);
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
                fencing_token = lease.grant.token,
                was_held,
                error = %e,
                "lease release failed; it expires at its TTL"
            ),
        }
        Some(released.map(|_| lease))
    }

    /// SIGTERM: refuse new acquisitions from now on.
    pub fn start_draining(&self) {
        self.draining
            .store(true, std::sync::atomic::Ordering::SeqCst);
        for lease in self.all() {
            let snap = *lease.snapshot.borrow();
            if snap.state == State::Held {
                lease.set(State::Draining, snap.valid_until);
            }
        }
    }

    /// Releases every lease (the last step of the drain).
    pub async fn release_all(&self) {
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
            state: lease.snapshot.borrow().state,
        };
        // One line per transition: `lost` and `renew_failed` have their own, with the reason.
        if matches!(event, "held" | "released") {
            tracing::info!(
                resource = e.resource,
                holder_id = e.holder,
                lease_id = e.lease_id,
                fencing_token = e.fencing_token,
                ttl_ms = e.ttl_ms as u64,
                state = e.state.as_str(),
                "lease {event}"
            );
        }
        let _ = self.events.send(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn agent(dir: &tempfile::TempDir) -> Arc<Agent> {
        let config = crate::config::Config::parse(&format!(
            "upstream: http://127.0.0.1:1\nleases:\n  backend: {{ kind: embedded, path: {} }}\n  ttl: 1500ms\n",
            dir.path().join("leases.db").display()
        ))
        .unwrap();
        let leases = config.leases.unwrap();
        let backend = crate::lease::open(&leases.backend).await.unwrap();
        let metrics = Arc::new(Metrics::new(prometheus::Registry::new()).unwrap());
        Agent::new(backend, leases.ttl, leases.acquire, metrics)
    }

    /// Polls until `f` holds, for at most five seconds.
    async fn eventually(what: &str, f: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !f() {
            assert!(Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn an_acquisition_is_listed_while_it_waits() {
        let dir = tempfile::tempdir().unwrap();
        let agent = agent(&dir).await;
        let held = agent
            .acquire("r", "w1", None, Duration::ZERO)
            .await
            .unwrap();
        assert!(agent.attempts().is_empty() && agent.attempt("r").is_none());

        let waiter = tokio::spawn({
            let agent = Arc::clone(&agent);
            async move {
                agent
                    .acquire(
                        "r",
                        "w2",
                        Some(Duration::from_secs(3)),
                        Duration::from_secs(10),
                    )
                    .await
            }
        });
        eventually("w2 is listed", || agent.attempt("r").is_some()).await;
        let expected = Attempt {
            resource: "r".into(),
            holder: "w2".into(),
            ttl: Duration::from_secs(3),
        };
        assert_eq!(agent.attempt("r"), Some(expected.clone()));
        assert_eq!(agent.attempts(), [expected]);
        // The lease held here is still what this agent holds.
        assert_eq!(agent.get("r").unwrap().grant, held.grant);

        agent.release("r").await.unwrap().unwrap();
        let got = waiter.await.unwrap().unwrap();
        assert_eq!(got.grant.holder, "w2");
        assert_eq!(agent.attempt("r"), None);
        assert!(agent.attempts().is_empty());

        // An acquisition whose request went away is no longer listed.
        let gone = tokio::spawn({
            let agent = Arc::clone(&agent);
            async move {
                agent
                    .acquire("r", "w3", None, Duration::from_secs(30))
                    .await
            }
        });
        eventually("w3 is listed", || agent.attempt("r").is_some()).await;
        gone.abort();
        eventually("w3 is gone", || agent.attempt("r").is_none()).await;
    }
}
