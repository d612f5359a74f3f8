//! The lease agent's timing, under `tokio::time::pause`: renewals at TTL/3 ± 15 %, and `lost`
//! exactly at the local validity deadline when renewals fail, before the backend's own expiry.
//! The backend is the real embedded one, wrapped to record renewals and to fail them on demand
//! (the way a partition from the backend would).

use fencegate::fence::Token;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencegate::config::{Config, LeasesConfig};
use fencegate::lease::agent::{AcquireError, Agent, State};
use fencegate::lease::{Acquired, Grant, LeaseBackend, LeaseError};
use fencegate::metrics::Metrics;
use fencegate::store::BoxFuture;
use tokio::time::Instant;

struct Partitionable {
    inner: Arc<dyn LeaseBackend>,
    cut: AtomicBool,
    renewals: Mutex<Vec<Instant>>,
}

impl LeaseBackend for Partitionable {
    fn try_acquire<'a>(
        &'a self,
        r: &'a str,
        h: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LeaseError>> {
        self.inner.try_acquire(r, h, ttl)
    }
    fn renew<'a>(
        &'a self,
        grant: &'a Grant,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, LeaseError>> {
        self.renewals.lock().unwrap().push(Instant::now());
        if self.cut.load(Ordering::SeqCst) {
            return Box::pin(std::future::ready(Err(LeaseError::unreachable(
                "partitioned",
            ))));
        }
        self.inner.renew(grant, ttl)
    }
    fn release<'a>(&'a self, grant: &'a Grant) -> BoxFuture<'a, Result<bool, LeaseError>> {
        self.inner.release(grant)
    }
    fn latest_token<'a>(&'a self, r: &'a str) -> BoxFuture<'a, Result<Option<Token>, LeaseError>> {
        self.inner.latest_token(r)
    }
    fn changed<'a>(&'a self, r: &'a str) -> BoxFuture<'a, ()> {
        self.inner.changed(r)
    }
    fn kind(&self) -> &'static str {
        "partitionable"
    }
}

/// The leases config every test here uses (embedded backend in `dir`, 1500 ms TTL) and its
/// real backend.
async fn embedded(dir: &tempfile::TempDir) -> (LeasesConfig, Arc<dyn LeaseBackend>) {
    let config = Config::parse(&format!(
        "upstream: http://127.0.0.1:1\nleases:\n  backend: {{ kind: embedded, path: {} }}\n  ttl: 1500ms\n",
        dir.path().join("leases.db").display()
    ))
    .unwrap();
    let leases = config.leases.unwrap();
    assert_eq!(leases.ttl.drift_buffer, Duration::from_millis(100));
    let backend = fencegate::lease::open(&leases.backend).await.unwrap();
    (leases, backend)
}

fn metrics() -> Arc<Metrics> {
    Arc::new(Metrics::new(prometheus::Registry::new()).unwrap())
}

async fn agent(dir: &tempfile::TempDir) -> (Arc<Agent>, Arc<Partitionable>, Arc<Metrics>) {
    let (leases, inner) = embedded(dir).await;
    let backend = Arc::new(Partitionable {
        inner,
        cut: AtomicBool::new(false),
        renewals: Mutex::default(),
    });
    let metrics = metrics();
    let agent = Agent::new(
        backend.clone(),
        leases.ttl,
        leases.acquire,
        Arc::clone(&metrics),
    );
    (agent, backend, metrics)
}

#[tokio::test(start_paused = true)]
async fn renews_every_third_of_the_ttl_with_jitter() {
    let dir = tempfile::tempdir().unwrap();
    let (agent, backend, metrics) = agent(&dir).await;
    let start = Instant::now();
    let lease = agent
        .acquire("job:1", "w1", None, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(lease.state(), State::Held);
    tokio::time::sleep(Duration::from_secs(30)).await;
    let renewals = backend.renewals.lock().unwrap().clone();
    assert!(
        renewals.len() >= 52 && renewals.len() <= 71,
        "{} renewals in 30s",
        renewals.len()
    );
    let mut previous = start;
    for at in renewals {
        let gap = at - previous;
        assert!(
            gap >= Duration::from_millis(425) && gap <= Duration::from_millis(575),
            "renewal after {gap:?}, outside 500ms ± 15%"
        );
        previous = at;
    }
    assert_eq!(agent.token_for("job:1"), Some(lease.grant.token));
    assert_eq!(metrics.lease.renewals_failed.get(), 0);
}

#[tokio::test(start_paused = true)]
async fn lost_exactly_at_the_local_deadline_before_the_backend_expires() {
    let dir = tempfile::tempdir().unwrap();
    let (agent, backend, metrics) = agent(&dir).await;
    let mut events = agent.subscribe();
    let lease = agent
        .acquire("job:2", "w1", None, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(events.recv().await.unwrap().event, "held");
    // One good renewal, then the backend becomes unreachable.
    assert_eq!(events.recv().await.unwrap().event, "renewed");
    let last_ok = *backend.renewals.lock().unwrap().last().unwrap();
    backend.cut.store(true, Ordering::SeqCst);

    let mut failures = 0;
    let lost_at = loop {
        let event = events.recv().await.unwrap();
        match event.event {
            "renew_failed" => failures += 1,
            "lost" => break Instant::now(),
            other => panic!("unexpected {other}"),
        }
    };
    // Deadline = send time of the last successful renewal + ttl - drift buffer.
    assert_eq!(lost_at, last_ok + Duration::from_millis(1400));
    assert!(failures >= 1, "renewals were retried before the deadline");
    assert_eq!(lease.state(), State::Expired);
    assert_eq!(agent.token_for("job:2"), None);
    assert_eq!(metrics.lease.expiry_forced.get(), 1);
    // The backend itself still holds the lease (its clock has not reached the TTL): the local
    // deadline came first, which is the point.
    let other = backend
        .inner
        .try_acquire("job:2", "w2", Duration::from_millis(1500))
        .await
        .unwrap();
    assert!(matches!(other, Acquired::Held { .. }), "{other:?}");
    // A lost lease is never re-acquired behind the app's back.
    backend.cut.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(lease.state(), State::Expired);
    assert_eq!(agent.token_for("job:2"), None);
}

/// The real embedded backend, with its grants held back (after they are committed) until the
/// test lets them through: a grant that lands while draining begins.
struct Slow {
    inner: Arc<dyn LeaseBackend>,
    granted: tokio::sync::Notify,
    deliver: tokio::sync::Notify,
}

impl LeaseBackend for Slow {
    fn try_acquire<'a>(
        &'a self,
        r: &'a str,
        h: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LeaseError>> {
        Box::pin(async move {
            let acquired = self.inner.try_acquire(r, h, ttl).await;
            self.granted.notify_one();
            self.deliver.notified().await;
            acquired
        })
    }
    fn renew<'a>(
        &'a self,
        grant: &'a Grant,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, LeaseError>> {
        self.inner.renew(grant, ttl)
    }
    fn release<'a>(&'a self, grant: &'a Grant) -> BoxFuture<'a, Result<bool, LeaseError>> {
        self.inner.release(grant)
    }
    fn latest_token<'a>(&'a self, r: &'a str) -> BoxFuture<'a, Result<Option<Token>, LeaseError>> {
        self.inner.latest_token(r)
    }
    fn changed<'a>(&'a self, r: &'a str) -> BoxFuture<'a, ()> {
        self.inner.changed(r)
    }
    fn kind(&self) -> &'static str {
        "slow"
    }
}

#[tokio::test(start_paused = true)]
async fn a_grant_landing_as_draining_begins_is_given_back() {
    let dir = tempfile::tempdir().unwrap();
    let (leases, inner) = embedded(&dir).await;
    let backend = Arc::new(Slow {
        inner,
        granted: tokio::sync::Notify::new(),
        deliver: tokio::sync::Notify::new(),
    });
    let agent = Agent::new(backend.clone(), leases.ttl, leases.acquire, metrics());
    let acquiring = tokio::spawn({
        let agent = Arc::clone(&agent);
        async move { agent.acquire("job:3", "w1", None, Duration::ZERO).await }
    });
    // The backend has committed the grant; its answer is on the way when SIGTERM comes.
    backend.granted.notified().await;
    agent.start_draining();
    agent.release_all().await;
    backend.deliver.notify_one();
    let refused = acquiring.await.unwrap();
    assert!(
        matches!(refused, Err(AcquireError::Draining)),
        "{:?}",
        refused.map(|l| (l.grant.clone(), l.state()))
    );
    assert!(agent.get("job:3").is_none());
    assert_eq!(agent.token_for("job:3"), None);
    // Given back: the next holder gets it at once.
    let next = backend
        .inner
        .try_acquire("job:3", "w2", Duration::from_millis(1500))
        .await
        .unwrap();
    assert!(matches!(next, Acquired::Granted(_)), "{next:?}");
}
