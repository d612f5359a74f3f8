//! One conformance suite that every lease backend passes, against real servers: embedded (a
//! temporary file), Redis and PostgreSQL (the shared servers, fresh prefixes) and etcd (a
//! throwaway server per test).

use fencegate::fence::Token;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate::config::{BackendConfig, Remote, SecretUrl};
use fencegate::lease::{self, Acquired, Grant, LeaseBackend};

use crate::services::*;

/// A backend of `kind` on a fresh prefix, and what keeps it alive (an etcd server, the
/// embedded backend's directory).
struct Fixture {
    config: BackendConfig,
    _service: Option<Service>,
    _dir: tempfile::TempDir,
}

impl Fixture {
    async fn new(kind: &str) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let remote = |url: String| Remote {
            url: SecretUrl::try_from(url).unwrap(),
            tls: None,
            prefix: fresh_prefix(),
            replicas: None,
            redis: Default::default(),
        };
        let (config, service) = match kind {
            "embedded" => (
                BackendConfig::Embedded {
                    path: dir.path().join("leases.db"),
                    prefix: fresh_prefix(),
                },
                None,
            ),
            "redis" => (BackendConfig::Redis(remote(REDIS_URL.into())), None),
            "postgres" => (BackendConfig::Postgres(remote(POSTGRES_URL.into())), None),
            "etcd" => {
                let etcd = Service::start(Kind::Etcd).await;
                (BackendConfig::Etcd(remote(etcd.url())), Some(etcd))
            }
            other => panic!("unknown backend {other}"),
        };
        Fixture {
            config,
            _service: service,
            _dir: dir,
        }
    }

    async fn open(&self) -> Arc<dyn LeaseBackend> {
        lease::open(&self.config).await.unwrap()
    }

    /// A TTL that expires quickly: etcd counts whole seconds.
    fn short_ttl(&self) -> Duration {
        match self.config {
            BackendConfig::Etcd(_) => Duration::from_secs(1),
            _ => Duration::from_millis(300),
        }
    }
}

const LONG: Duration = Duration::from_secs(30);

async fn grant(backend: &dyn LeaseBackend, resource: &str, holder: &str, ttl: Duration) -> Grant {
    match backend.try_acquire(resource, holder, ttl).await.unwrap() {
        Acquired::Granted(g) => {
            assert_eq!((g.resource.as_str(), g.holder.as_str()), (resource, holder));
            g
        }
        held => panic!("{resource} should be free for {holder}, got {held:?}"),
    }
}

async fn assert_held(backend: &dyn LeaseBackend, resource: &str, by: &str) {
    match backend
        .try_acquire(resource, "intruder", LONG)
        .await
        .unwrap()
    {
        Acquired::Held { holder } => {
            assert!(
                holder.as_deref().is_none_or(|h| h == by),
                "held by {holder:?}, not {by}"
            )
        }
        Acquired::Granted(g) => {
            panic!("{resource} granted to an intruder while {by} holds it: {g:?}")
        }
    }
}

/// Polls (a real server's clock decides) until `resource` can be granted, within `limit`.
async fn acquire_within(
    backend: &dyn LeaseBackend,
    resource: &str,
    holder: &str,
    limit: Duration,
) -> Grant {
    let deadline = Instant::now() + limit;
    loop {
        if let Acquired::Granted(g) = backend.try_acquire(resource, holder, LONG).await.unwrap() {
            return g;
        }
        assert!(Instant::now() < deadline, "{resource} never became free");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn exclusive(f: Fixture) {
    let b = f.open().await;
    let a = grant(&*b, "account:1", "a", LONG).await;
    assert_held(&*b, "account:1", "a").await;
    assert_eq!(
        b.try_acquire("account:1", "b", LONG).await.unwrap(),
        Acquired::Held {
            holder: Some("a".into())
        }
    );
    // The holder itself gets no second grant either.
    assert_held(&*b, "account:1", "a").await;
    // Other resources are independent.
    let other = grant(&*b, "account:2", "b", LONG).await;
    assert_ne!(a.lease_id, other.lease_id);
}

async fn tokens_increase(f: Fixture) {
    let b = f.open().await;
    let r = "account:7";
    assert_eq!(b.latest_token(r).await.unwrap(), None);
    let first = grant(&*b, r, "a", LONG).await;
    assert_eq!(b.latest_token(r).await.unwrap(), Some(first.token));
    assert!(b.release(&first).await.unwrap());
    assert_eq!(b.latest_token(r).await.unwrap(), Some(first.token));
    let second = grant(&*b, r, "b", LONG).await;
    assert!(second.token > first.token, "{second:?} after {first:?}");
    assert_ne!(second.lease_id, first.lease_id);
    assert_eq!(b.latest_token(r).await.unwrap(), Some(second.token));
    // Renewals do not move the token.
    assert!(b.renew(&second, LONG).await.unwrap());
    assert_eq!(b.latest_token(r).await.unwrap(), Some(second.token));
    // Nor do grants of other resources (beyond the token's own resource).
    let third = grant(&*b, "account:8", "c", LONG).await;
    assert_eq!(b.latest_token(r).await.unwrap(), Some(second.token));
    assert!(b.latest_token("account:8").await.unwrap() == Some(third.token));

    // After expiry too.
    let short = grant(&*b, "short", "a", f.short_ttl()).await;
    let after = acquire_within(&*b, "short", "b", f.short_ttl() + Duration::from_secs(5)).await;
    assert!(after.token > short.token, "{after:?} after {short:?}");
    assert_eq!(b.latest_token("short").await.unwrap(), Some(after.token));

    // And across a new client (a restart of fencegate; the embedded file is reopened).
    let (resource, last) = (r.to_owned(), second.clone());
    drop(b);
    let b = f.open().await;
    assert_eq!(b.latest_token(&resource).await.unwrap(), Some(last.token));
    assert_held(&*b, &resource, "b").await;
    assert!(b.release(&last).await.unwrap());
    let next = grant(&*b, &resource, "c", LONG).await;
    assert!(next.token > last.token);
}

async fn renewal_keeps_it(f: Fixture) {
    let b = f.open().await;
    let ttl = f.short_ttl().max(Duration::from_secs(1));
    // The lease runs at least until `extended + ttl`: `extended` is when the call that last
    // extended it was sent. A machine that stalls this task for a whole TTL lets the lease
    // lapse for a reason that is not the backend's: then the test stops there; short of
    // that, a lapse is a failure.
    let mut extended = Instant::now();
    let g = grant(&*b, "job", "a", ttl).await;
    // Renew at about ttl / 3 for more than two ttls: it never lapses.
    let until = Instant::now() + ttl * 2 + Duration::from_millis(500);
    while Instant::now() < until {
        tokio::time::sleep(ttl / 3).await;
        let asked = Instant::now();
        if !b.renew(&g, ttl).await.unwrap() {
            let gap = asked.duration_since(extended);
            assert!(
                gap >= ttl,
                "renewal failed {gap:?} after the last extension"
            );
            return;
        }
        extended = asked;
        match b.try_acquire("job", "intruder", LONG).await.unwrap() {
            Acquired::Held { holder } => {
                assert!(
                    holder.as_deref().is_none_or(|h| h == "a"),
                    "held by {holder:?}"
                )
            }
            Acquired::Granted(intruder) => {
                let gap = extended.elapsed();
                assert!(
                    gap >= ttl,
                    "granted to {intruder:?} {gap:?} after a renewal"
                );
                return;
            }
        }
    }
    assert_eq!(b.latest_token("job").await.unwrap(), Some(g.token));
}

async fn renewal_by_others_fails(f: Fixture) {
    let b = f.open().await;
    let g = grant(&*b, "job", "a", LONG).await;
    let forged = |lease_id: &str| Grant {
        lease_id: lease_id.into(),
        ..g.clone()
    };
    for fake in [
        forged("0123456789abcdef0123456789abcdef"),
        forged("12345"),
        forged(""),
    ] {
        assert!(!b.renew(&fake, LONG).await.unwrap(), "{fake:?} renewed");
        assert!(!b.release(&fake).await.unwrap(), "{fake:?} released");
    }
    // A grant of another resource does not own this one.
    let other = grant(&*b, "other", "a", LONG).await;
    let crossed = Grant {
        resource: "job".into(),
        ..other
    };
    assert!(!b.renew(&crossed, LONG).await.unwrap());
    assert!(!b.release(&crossed).await.unwrap());
    assert_held(&*b, "job", "a").await;
    assert!(b.renew(&g, LONG).await.unwrap());
}

async fn release_frees_it(f: Fixture) {
    let b = f.open().await;
    let g = grant(&*b, "job", "a", LONG).await;
    assert!(b.release(&g).await.unwrap());
    assert!(!b.release(&g).await.unwrap(), "released twice");
    assert!(!b.renew(&g, LONG).await.unwrap(), "renewed after release");
    let next = grant(&*b, "job", "b", LONG).await;
    // The old grant does not own the new lease.
    assert!(!b.release(&g).await.unwrap());
    assert!(!b.renew(&g, LONG).await.unwrap());
    assert_held(&*b, "job", "b").await;
    assert!(b.release(&next).await.unwrap());
}

async fn expiry_frees_it(f: Fixture) {
    let b = f.open().await;
    let ttl = f.short_ttl();
    let g = grant(&*b, "job", "a", ttl).await;
    tokio::time::sleep(ttl / 2).await;
    assert_held(&*b, "job", "a").await;
    // Surely past the TTL without renewal. etcd raises short TTLs to its minimum (about 2s)
    // and sweeps expired leases every 500ms.
    let expired = match f.config {
        BackendConfig::Etcd(_) => Duration::from_secs(4),
        _ => ttl + Duration::from_millis(300),
    };
    tokio::time::sleep(expired - ttl / 2).await;
    assert!(
        !b.renew(&g, ttl).await.unwrap(),
        "an expired lease was renewed"
    );
    let next = acquire_within(&*b, "job", "b", Duration::from_secs(5)).await;
    assert!(next.token > g.token);
    assert!(!b.release(&g).await.unwrap());
    assert!(!b.renew(&g, ttl).await.unwrap());
    assert_held(&*b, "job", "b").await;
    assert_eq!(b.latest_token("job").await.unwrap(), Some(next.token));
}

/// A waiter that sleeps a long backoff between attempts, unless `changed` wakes it first.
async fn waiter_wakes_on_release(f: Fixture) {
    let b = f.open().await;
    let held = grant(&*b, "job", "a", LONG).await;
    let backoff = Duration::from_secs(10);
    let waiter = {
        let b = Arc::clone(&b);
        tokio::spawn(async move {
            let mut attempts = 0;
            loop {
                attempts += 1;
                match b.try_acquire("job", "b", LONG).await.unwrap() {
                    Acquired::Granted(g) => return (g, attempts, Instant::now()),
                    Acquired::Held { .. } => {
                        tokio::select! {
                            _ = b.changed("job") => {}
                            _ = tokio::time::sleep(backoff) => {}
                        }
                    }
                }
            }
        })
    };
    // Let the waiter find it held and start waiting.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiter.is_finished());
    let released_at = Instant::now();
    assert!(b.release(&held).await.unwrap());
    let (got, attempts, at) = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter was not woken by the release")
        .unwrap();
    assert_eq!(got.holder, "b");
    assert!(got.token > held.token);
    // Woken by the release, not by spinning on a `changed` that resolves at once.
    assert!((2..=3).contains(&attempts), "{attempts} attempts");
    assert!(
        at.duration_since(released_at) < Duration::from_secs(3),
        "woken {:?} after the release",
        at.duration_since(released_at)
    );
}

/// `changed` on a free (never granted, or released) lease resolves at once.
async fn changed_when_free(f: Fixture) {
    let b = f.open().await;
    let quickly = Duration::from_secs(3);
    tokio::time::timeout(quickly, b.changed("never"))
        .await
        .expect("changed() on a never-granted lease");
    let g = grant(&*b, "job", "a", LONG).await;
    // Held: changed() waits.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), b.changed("job"))
            .await
            .is_err()
    );
    assert!(b.release(&g).await.unwrap());
    tokio::time::timeout(quickly, b.changed("job"))
        .await
        .expect("changed() on a released lease");
}

async fn racing_acquirers(f: Fixture) {
    let b = f.open().await;
    for round in 0..3 {
        let resource = format!("race:{round}");
        let tasks: Vec<_> = (0..16)
            .map(|i| {
                let (b, resource) = (Arc::clone(&b), resource.clone());
                tokio::spawn(async move { b.try_acquire(&resource, &format!("w{i}"), LONG).await })
            })
            .collect();
        let mut granted = Vec::new();
        for t in tasks {
            if let Acquired::Granted(g) = t.await.unwrap().unwrap() {
                granted.push(g);
            }
        }
        assert_eq!(granted.len(), 1, "{granted:?}");
        assert_eq!(
            b.latest_token(&resource).await.unwrap(),
            Some(granted[0].token)
        );
    }
}

/// Holders take turns: every grant's token is above all earlier ones, and no two overlap.
async fn handoffs(f: Fixture) {
    let b = f.open().await;
    let mut last = Token::ZERO;
    for i in 0..20 {
        let g = grant(&*b, "relay", &format!("h{i}"), LONG).await;
        assert!(g.token > last, "token {} after {last}", g.token);
        last = g.token;
        assert_held(&*b, "relay", &g.holder).await;
        assert!(b.release(&g).await.unwrap());
    }
}

macro_rules! conformance {
    ($($kind:ident),*) => {$(
        mod $kind {
            use super::*;
            async fn fixture() -> Fixture { Fixture::new(stringify!($kind)).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn exclusive() { super::exclusive(fixture().await).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn tokens_increase() { super::tokens_increase(fixture().await).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn renewal_keeps_it() { super::renewal_keeps_it(fixture().await).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn renewal_by_others_fails() { super::renewal_by_others_fails(fixture().await).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn release_frees_it() { super::release_frees_it(fixture().await).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn expiry_frees_it() { super::expiry_frees_it(fixture().await).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn waiter_wakes_on_release() { super::waiter_wakes_on_release(fixture().await).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn changed_when_free() { super::changed_when_free(fixture().await).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn racing_acquirers() { super::racing_acquirers(fixture().await).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn handoffs() { super::handoffs(fixture().await).await }
        }
    )*};
}

conformance!(embedded, redis, postgres, etcd);

/// The etcd server restarts (kill -9): grants made before are still fenced by larger tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_tokens_survive_a_server_restart() {
    let mut f = Fixture::new("etcd").await;
    let b = f.open().await;
    let before = grant(&*b, "job", "a", Duration::from_secs(1)).await;
    assert!(b.release(&before).await.unwrap());
    let service = f._service.as_mut().unwrap();
    service.kill().await;
    service.restart().await;
    let b = f.open().await;
    assert_eq!(b.latest_token("job").await.unwrap(), Some(before.token));
    let after = grant(&*b, "job", "b", LONG).await;
    assert!(after.token > before.token);
}

/// Retries through the errors of connections that died with the server.
async fn grant_after_restart(backend: &dyn LeaseBackend, resource: &str, holder: &str) -> Grant {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match backend.try_acquire(resource, holder, LONG).await {
            Ok(Acquired::Granted(g)) => return g,
            Ok(held) => panic!("{resource} should be free, got {held:?}"),
            Err(e) => {
                assert!(Instant::now() < deadline, "backend never came back: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// The server restarts under a backend whose event connection is up: once it is back, a
/// waiter is woken by a release again (the event connection reconnected and resubscribed).
async fn events_survive_a_server_restart(kind: Kind) {
    let mut service = Service::start(kind).await;
    let remote = Remote {
        url: SecretUrl::try_from(service.url()).unwrap(),
        tls: None,
        prefix: fresh_prefix(),
        replicas: None,
        redis: Default::default(),
    };
    let config = match kind {
        Kind::Redis => BackendConfig::Redis(remote),
        Kind::Postgres => BackendConfig::Postgres(remote),
        Kind::Etcd => BackendConfig::Etcd(remote),
    };
    let b = lease::open(&config).await.unwrap();
    // Start the event connection.
    tokio::time::timeout(Duration::from_secs(5), b.changed("warm-up"))
        .await
        .unwrap();
    let before = grant(&*b, "job", "a", LONG).await;
    assert!(b.release(&before).await.unwrap());

    service.kill().await;
    // The backend wakes every waiter once when its event connection drops; once it has seen
    // the drop, `changed` no longer resolves while the server is down (the waiter's backoff
    // does). A call made before the drop is noticed may still resolve, so look a few times.
    let mut quiet = false;
    for _ in 0..20 {
        if tokio::time::timeout(Duration::from_millis(500), b.changed("job"))
            .await
            .is_err()
        {
            quiet = true;
            break;
        }
    }
    assert!(quiet, "`changed` kept resolving while the server was down");
    service.restart().await;

    let held = grant_after_restart(&*b, "job", "a").await;
    assert!(held.token > before.token);
    let backoff = Duration::from_secs(10);
    let waiter = {
        let b = Arc::clone(&b);
        tokio::spawn(async move {
            loop {
                match b.try_acquire("job", "b", LONG).await {
                    Ok(Acquired::Granted(g)) => return g,
                    Ok(Acquired::Held { .. }) => {
                        tokio::select! {
                            _ = b.changed("job") => {}
                            _ = tokio::time::sleep(backoff) => {}
                        }
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        })
    };
    // Long enough for the waiter to be waiting on a live subscription (PostgreSQL's listener
    // reconnects after a second).
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!waiter.is_finished());
    assert!(b.release(&held).await.unwrap());
    let got = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter was not woken by the release after the restart")
        .unwrap();
    assert!(got.token > held.token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_events_survive_a_server_restart() {
    events_survive_a_server_restart(Kind::Redis).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_events_survive_a_server_restart() {
    events_survive_a_server_restart(Kind::Postgres).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_events_survive_a_server_restart() {
    events_survive_a_server_restart(Kind::Etcd).await
}
