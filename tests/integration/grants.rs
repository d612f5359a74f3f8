//! The grant cache of authoritative fencing against real backends: a cached grant answers
//! without a round trip, a grant by another client of the backend invalidates it through the
//! backend's grant events, and once the event subscription is lost (the server is killed) the
//! cache is bypassed, so answers fail while the server is down, until it is back and
//! subscribed again.

use crate::common::tk;
use fencegate::fence::Token;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate::config::{BackendConfig, Remote, SecretUrl};
use fencegate::lease::grants::GrantCache;
use fencegate::lease::{self, Acquired, Grant, GrantEvent, GrantEvents, LeaseBackend, LeaseError};
use fencegate::store::BoxFuture;
use tokio::sync::broadcast::error::TryRecvError;

use crate::common::*;
use crate::services::*;

/// A backend that counts its `latest_token` round trips.
struct Counting {
    inner: Arc<dyn LeaseBackend>,
    reads: AtomicUsize,
}

impl Counting {
    fn reads(&self) -> usize {
        self.reads.load(Ordering::SeqCst)
    }
}

impl LeaseBackend for Counting {
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
        self.inner.renew(grant, ttl)
    }
    fn release<'a>(&'a self, grant: &'a Grant) -> BoxFuture<'a, Result<bool, LeaseError>> {
        self.inner.release(grant)
    }
    fn latest_token<'a>(&'a self, r: &'a str) -> BoxFuture<'a, Result<Option<Token>, LeaseError>> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.inner.latest_token(r)
    }
    fn changed<'a>(&'a self, r: &'a str) -> BoxFuture<'a, ()> {
        self.inner.changed(r)
    }
    fn grant_events(&self) -> GrantEvents {
        self.inner.grant_events()
    }
    fn kind(&self) -> &'static str {
        "counting"
    }
}

const LONG: Duration = Duration::from_secs(30);
/// The longest any condition below is polled for.
const BOUND: Duration = Duration::from_secs(30);

/// Polls `f` every 20ms until it holds, for at most [`BOUND`].
async fn eventually<F: std::future::Future<Output = bool>>(what: &str, mut f: impl FnMut() -> F) {
    let deadline = Instant::now() + BOUND;
    while !f().await {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Grants `resource` to `holder`, retrying through errors (a server coming back).
async fn grant(backend: &dyn LeaseBackend, resource: &str, holder: &str) -> Grant {
    let deadline = Instant::now() + BOUND;
    loop {
        match backend.try_acquire(resource, holder, LONG).await {
            Ok(Acquired::Granted(g)) => return g,
            Ok(held) => panic!("{resource} should be free, got {held:?}"),
            Err(e) => {
                assert!(Instant::now() < deadline, "the backend never answered: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Releases `grant`, retrying through errors.
async fn release(backend: &dyn LeaseBackend, grant: &Grant) {
    let deadline = Instant::now() + BOUND;
    loop {
        match backend.release(grant).await {
            Ok(released) => return assert!(released, "{grant:?} was not held"),
            Err(e) => {
                assert!(Instant::now() < deadline, "the backend never answered: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Reads until `expected` comes from the cache (the grant's own event may still be on its way
/// and drop the first entry), then checks that a hundred more reads need no round trip.
async fn cached(cache: &GrantCache, counting: &Counting, resource: &str, expected: u64) {
    eventually("the grant is cached", || async {
        assert_eq!(cache.latest(resource).await.unwrap(), Some(tk(expected)));
        let before = counting.reads();
        assert_eq!(cache.latest(resource).await.unwrap(), Some(tk(expected)));
        counting.reads() == before
    })
    .await;
    let before = counting.reads();
    for _ in 0..100 {
        assert_eq!(cache.latest(resource).await.unwrap(), Some(tk(expected)));
    }
    assert_eq!(counting.reads(), before, "cached answers made round trips");
}

/// Reads until a newer grant is seen: the cache dropped its entry on the grant's event.
async fn invalidated(cache: &GrantCache, counting: &Counting, resource: &str, newer: u64) {
    let before = counting.reads();
    eventually("the new grant invalidates the cache", || async {
        cache.latest(resource).await.ok() == Some(Some(tk(newer)))
    })
    .await;
    assert!(counting.reads() > before);
}

async fn cache_follows_grants(kind: &str) {
    let mut service = match kind {
        "redis" => Some(Service::start(Kind::Redis).await),
        "postgres" => Some(Service::start(Kind::Postgres).await),
        "etcd" => Some(Service::start(Kind::Etcd).await),
        _ => None,
    };
    let dir = tempfile::tempdir().unwrap();
    let remote = |service: &Option<Service>| Remote {
        url: SecretUrl::try_from(service.as_ref().unwrap().url()).unwrap(),
        tls: None,
        prefix: fresh_prefix(),
        replicas: None,
        redis: Default::default(),
    };
    let config = match kind {
        "embedded" => BackendConfig::Embedded {
            path: dir.path().join("leases.db"),
            prefix: fresh_prefix(),
        },
        "redis" => BackendConfig::Redis(remote(&service)),
        "postgres" => BackendConfig::Postgres(remote(&service)),
        _ => BackendConfig::Etcd(remote(&service)),
    };
    let mine = lease::open(&config).await.unwrap();
    // Another client of the same backend grants the leases (with the embedded backend, whose
    // file one process opens, the same backend, as this process's lease agent would).
    let other = match kind {
        "embedded" => Arc::clone(&mine),
        _ => lease::open(&config).await.unwrap(),
    };
    let counting = Arc::new(Counting {
        inner: mine,
        reads: AtomicUsize::new(0),
    });
    let cache = GrantCache::new(Arc::clone(&counting) as Arc<dyn LeaseBackend>, 1000);
    eventually("subscribed", || async { cache.is_live() }).await;
    let mut events = counting.grant_events();

    // (a) A cached grant answers without a round trip; so does "never granted".
    let r = "account:1";
    assert_eq!(cache.latest("never").await.unwrap(), None);
    let before = counting.reads();
    assert_eq!(cache.latest("never").await.unwrap(), None);
    assert_eq!(counting.reads(), before);
    let g1 = grant(&*other, r, "a").await;
    cached(&cache, &counting, r, g1.token.get()).await;

    // (b) A new grant by the other client drops the entry through its event.
    release(&*other, &g1).await;
    let g2 = grant(&*other, r, "b").await;
    assert!(g2.token > g1.token);
    invalidated(&cache, &counting, r, g2.token.get()).await;
    assert!(cache.is_live());
    cached(&cache, &counting, r, g2.token.get()).await;
    // So does a first grant of a resource cached as never granted.
    let first = grant(&*other, "never", "c").await;
    invalidated(&cache, &counting, "never", first.token.get()).await;

    // The subscription stays up while the server is: its heartbeats are answered (an
    // observation window of a few heartbeats, not a synchronisation).
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert!(cache.is_live());
    loop {
        match events.events.try_recv() {
            Ok(GrantEvent::Changed(_)) => {}
            Ok(other) => panic!("{other:?} while the server is up"),
            Err(TryRecvError::Empty) => break,
            Err(e) => panic!("{e:?}"),
        }
    }

    let Some(service) = service.as_mut() else {
        // In process: nothing to lose.
        assert!(cache.is_live());
        return;
    };
    // (c) The server dies: the subscription is lost, the cache is bypassed, reads fail.
    service.kill().await;
    eventually("the subscription is lost", || async { !cache.is_live() }).await;
    assert!(cache.is_empty());
    for _ in 0..3 {
        let before = counting.reads();
        let answer = tokio::time::timeout(Duration::from_secs(5), cache.latest(r)).await;
        assert!(
            !matches!(answer, Ok(Ok(_))),
            "answered while the server is down: {answer:?}"
        );
        assert_eq!(counting.reads(), before + 1, "not asked of the backend");
    }

    // Back: subscribed again, caching again, and new grants invalidate again.
    service.restart().await;
    eventually("subscribed again", || async { cache.is_live() }).await;
    eventually("the backend answers", || async {
        cache.latest(r).await.ok() == Some(Some(g2.token))
    })
    .await;
    cached(&cache, &counting, r, g2.token.get()).await;
    release(&*other, &g2).await;
    let g3 = grant(&*other, r, "d").await;
    assert!(g3.token > g2.token);
    invalidated(&cache, &counting, r, g3.token.get()).await;
    cached(&cache, &counting, r, g3.token.get()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_grant_cache() {
    cache_follows_grants("embedded").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_grant_cache() {
    cache_follows_grants("redis").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_grant_cache() {
    cache_follows_grants("postgres").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_grant_cache() {
    cache_follows_grants("etcd").await
}

/// Through the fence: a newer grant by another client refuses the older token once its event
/// is in, cached admissions need no round trip, and while the backend is down every write on
/// the route is refused with 503 (fail closed), not answered from the cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authoritative_fence_with_redis_fails_closed_while_the_backend_is_down() {
    let mut redis = Service::start(Kind::Redis).await;
    let prefix = fresh_prefix();
    let up = Upstream::start().await;
    let fg = fencegate(
        &up.url(),
        &format!(
            "store: {{ kind: memory }}\nfence: {{ authority: leases }}\nleases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: redis, url: '{}', prefix: {prefix} }}\n  ttl: 5s\ntimeouts: {{ store: 1s }}\n{ACCOUNTS}",
            redis.url()
        ),
    )
    .await;
    let other = lease::open(&BackendConfig::Redis(Remote {
        url: SecretUrl::try_from(redis.url()).unwrap(),
        tls: None,
        prefix,
        replicas: None,
        redis: Default::default(),
    }))
    .await
    .unwrap();
    let g1 = grant(&*other, "account:42", "w1").await;
    let first = put(&fg, "42", &g1.token.to_string()).await;
    assert_eq!(first.status, 200, "{}", first.text());
    release(&*other, &g1).await;
    let g2 = grant(&*other, "account:42", "w2").await;
    // Once the grant's event is in, the old holder's token is stale before w2 writes.
    eventually("the old token is refused", || async {
        put(&fg, "42", &g1.token.to_string()).await.status == 409
    })
    .await;
    let reply = put(&fg, "42", &g1.token.to_string()).await;
    let body = reply.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(body["current_token"], g2.token.get());
    assert_eq!(put(&fg, "42", &g2.token.to_string()).await.status, 200);

    redis.kill().await;
    // The kill reaches the event connection within a heartbeat; from then on, no answer
    // comes from the cache.
    eventually("writes are refused while Redis is down", || async {
        put(&fg, "42", &g2.token.to_string()).await.status == 503
    })
    .await;
    for _ in 0..3 {
        put(&fg, "42", &g2.token.to_string())
            .await
            .assert_problem(503, "urn:fencegate:store-unavailable");
    }
    // A token below a grant seen is still refused as stale, without asking.
    put(&fg, "42", &g1.token.to_string())
        .await
        .assert_problem(409, "urn:fencegate:stale-token");

    redis.restart().await;
    eventually("writes are admitted again", || async {
        put(&fg, "42", &g2.token.to_string()).await.status == 200
    })
    .await;
}
