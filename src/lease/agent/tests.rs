//! The agent's unit tests: draining, releasing, the held gauge and listed acquisitions.

use super::*;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::Notify;

/// A pause point in the agent (a renewal's or a grant's answer), armed by a test for once.
#[derive(Default)]
pub(super) struct Pause {
    armed: AtomicBool,
    /// Told when the armed point has the backend's answer.
    reached: Notify,
    /// Lets it go on.
    resume: Notify,
}

impl Pause {
    pub(super) async fn wait_if_armed(&self) {
        if self.armed.swap(false, Ordering::SeqCst) {
            self.reached.notify_one();
            self.resume.notified().await;
        }
    }
}

/// The `fencegate_lease_held` series of `resource` and `fencegate_held_lease_count`, as exported.
fn gauge(agent: &Agent, resource: &str) -> (Option<String>, String) {
    let text = agent.metrics.render();
    let value = |prefix: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .map(str::to_owned)
    };
    let held = value(&format!("fencegate_lease_held{{resource=\"{resource}\"}} "));
    let count =
        value("fencegate_held_lease_count ").unwrap_or_else(|| panic!("no count in\n{text}"));
    (held, count)
}

/// Lets spawned tasks run until `f` holds (no timers involved).
async fn until(what: &str, f: impl Fn() -> bool) {
    for _ in 0..10_000 {
        if f() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("never: {what}");
}

/// `r` acquired by w1 (its `held` event read), and its next renewal stopped right after the
/// backend said yes (resumed with `pause.resume`); the events from there on.
async fn held_until_a_renewal_is_answered(
    agent: &Arc<Agent>,
) -> (Arc<Lease>, tokio::sync::broadcast::Receiver<Event>) {
    let mut events = agent.subscribe();
    let lease = agent
        .acquire("r", "w1", None, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(events.recv().await.unwrap().event, "held");
    agent.pause.armed.store(true, Ordering::SeqCst);
    agent.pause.reached.notified().await;
    (lease, events)
}

#[tokio::test(start_paused = true)]
async fn a_renewal_answered_before_draining_does_not_bring_the_token_back() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent(&dir).await;
    // The next renewal stops right after the backend said yes; draining starts there.
    let (lease, mut events) = held_until_a_renewal_is_answered(&agent).await;
    agent.start_draining();
    assert_eq!(lease.state(), State::Draining);
    assert_eq!(agent.token_for("r"), None);
    agent.pause.resume.notify_one();
    let renewed = events.recv().await.unwrap();
    assert_eq!((renewed.event, renewed.state), ("renewed", State::Draining));
    assert_eq!(lease.state(), State::Draining);
    assert_eq!(agent.token_for("r"), None);
}

/// A renewal whose answer is taken in only after the local deadline has passed (the process
/// was stopped with the answer waiting, as SIGSTOP or a long pause stops it; the renewal's
/// timeout polls the answer first) loses the lease: the backend may have let it go and
/// granted it again meanwhile. It was announced `renewed`, still `held`: an app that went by
/// the event believed it held the lease after its next holder had it.
#[tokio::test(start_paused = true)]
async fn a_renewal_answer_taken_in_after_the_local_deadline_loses_the_lease() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent(&dir).await;
    let (lease, mut events) = held_until_a_renewal_is_answered(&agent).await;
    // Stopped with the backend's yes in hand, for a whole TTL.
    tokio::time::advance(lease.ttl).await;
    agent.pause.resume.notify_one();
    let next = events.recv().await.unwrap();
    assert_eq!((next.event, next.state), ("lost", State::Expired));
    assert_eq!(lease.state(), State::Expired);
    assert_eq!(agent.token_for("r"), None);
}

/// A lease listed with a deadline already past is announced as what it is: `held`, state
/// `expired`, then `lost` (its `held` event said `held` before, as a late renewal's `renewed`
/// did). `acquire` no longer lists such a grant (it gives it back: the test below); this
/// holds it directly, for the events' deadline-aware state.
#[tokio::test(start_paused = true)]
async fn a_grant_taken_in_after_its_local_deadline_is_announced_expired() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent(&dir).await;
    let mut events = agent.subscribe();
    let ttl = Duration::from_millis(1500);
    let sent = Instant::now();
    let Acquired::Granted(grant) = agent.backend().try_acquire("r", "w1", ttl).await.unwrap()
    else {
        panic!("not granted");
    };
    // Stopped with the grant in hand, for a whole TTL.
    tokio::time::advance(ttl).await;
    let lease = agent.hold(grant, ttl, sent).expect("not draining");
    let held = events.recv().await.unwrap();
    assert_eq!((held.event, held.state), ("held", State::Expired));
    let lost = events.recv().await.unwrap();
    assert_eq!((lost.event, lost.state), ("lost", State::Expired));
    assert_eq!(lease.state(), State::Expired);
    assert_eq!(agent.token_for("r"), None);
}

/// A grant taken in only after the local deadline counted from its request (the backend's
/// answer waited while the process was stopped) is no lease: it is given back, never
/// announced nor listed, and the acquisition (with no `wait` left) answers that the backend's
/// answer came too late. It was answered as a lease before, in state `expired`: an app that
/// looked only at the status took it for held.
#[tokio::test(start_paused = true)]
async fn a_grant_taken_in_after_its_local_deadline_is_given_back_not_answered() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent(&dir).await;
    let mut events = agent.subscribe();
    agent.grant_pause.armed.store(true, Ordering::SeqCst);
    let acquiring = tokio::spawn({
        let agent = Arc::clone(&agent);
        async move { agent.acquire("r", "w1", None, Duration::ZERO).await }
    });
    agent.grant_pause.reached.notified().await;
    // Stopped with the grant in hand, for a whole TTL.
    tokio::time::advance(agent.default_ttl()).await;
    agent.grant_pause.resume.notify_one();
    match acquiring.await.unwrap() {
        Err(AcquireError::Unavailable(e)) => {
            assert_eq!(e.kind(), crate::conn::error::Kind::Timeout);
            assert!(
                e.to_string().contains("past the lease's local deadline"),
                "{e}"
            );
        }
        other => panic!("{:?}", other.map(|l| l.grant.clone())),
    }
    assert!(agent.get("r").is_none());
    assert_eq!(agent.token_for("r"), None);
    assert!(events.try_recv().is_err(), "a lease was announced");
    // Given back: the next holder gets it at once.
    let next = agent
        .backend()
        .try_acquire("r", "w2", agent.default_ttl())
        .await
        .unwrap();
    assert!(matches!(next, Acquired::Granted(_)));
}

/// `resource` held by w9, and w8 waiting for it (up to 10 s) in a task of its own.
async fn held_and_waited_for(
    agent: &Arc<Agent>,
    resource: &'static str,
) -> tokio::task::JoinHandle<Result<Arc<Lease>, AcquireError>> {
    agent
        .acquire(resource, "w9", None, Duration::ZERO)
        .await
        .unwrap();
    let waiter = tokio::spawn({
        let agent = Arc::clone(agent);
        async move {
            agent
                .acquire(resource, "w8", None, Duration::from_secs(10))
                .await
        }
    });
    until("w8 waits", || agent.attempt(resource).is_some()).await;
    waiter
}

#[tokio::test(start_paused = true)]
async fn a_waiter_at_drain_is_refused_and_nothing_is_left_held() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent(&dir).await;
    let waiter = held_and_waited_for(&agent, "account:42").await;
    // SIGTERM, then the end of the drain: w9's release frees the lease w8 waits for.
    agent.start_draining();
    agent.release_all().await;
    let refused = waiter.await.unwrap();
    assert!(
        matches!(refused, Err(AcquireError::Draining)),
        "{:?}",
        refused.map(|l| l.grant.clone())
    );
    assert!(agent.get("account:42").is_none());
    assert_eq!(agent.token_for("account:42"), None);
    // Nothing is left held on the backend: the next holder gets it at once.
    let next = agent
        .backend()
        .try_acquire("account:42", "next", Duration::from_secs(30))
        .await
        .unwrap();
    assert!(matches!(next, Acquired::Granted(_)), "{next:?}");
}

/// A new acquisition forgets the lost or released lease it read, not one listed since by an
/// acquisition running alongside: that one stays listed, so its token is attached and the
/// drain releases it.
#[tokio::test(start_paused = true)]
async fn an_acquisition_forgets_only_the_lease_it_read() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent(&dir).await;
    let read = agent
        .acquire("r", "w1", None, Duration::ZERO)
        .await
        .unwrap();
    agent.release("r").await.unwrap().unwrap();
    assert_eq!(read.state(), State::Released);
    // Another acquisition is granted the resource after `read` was read.
    let newer = agent
        .acquire("r", "w2", None, Duration::ZERO)
        .await
        .unwrap();
    agent.forget("r", &read);
    let listed = agent.get("r").expect("the newer lease is still listed");
    assert!(Arc::ptr_eq(&listed, &newer));
    assert_eq!(agent.token_for("r"), Some(newer.grant.token));
    agent.forget("r", &newer);
    assert!(agent.get("r").is_none());
}

/// A lost lease the backend still holds (its renewals failed, its TTL not over) is given back
/// when a new acquisition of the resource forgets it: the new one is granted at once, where it
/// waited for the TTL before, and nothing of the lost one outlives a drain.
#[tokio::test(start_paused = true)]
async fn an_acquisition_gives_back_the_lost_lease_it_forgets() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent(&dir).await;
    let lost = agent
        .acquire("r", "w1", None, Duration::ZERO)
        .await
        .unwrap();
    agent.lose(&lost, "renewals failed");
    assert_eq!(lost.state(), State::Expired);
    let latest = agent.backend().latest_token("r").await.unwrap();
    assert_eq!(latest, Some(lost.grant.token));
    let new = agent
        .acquire("r", "w2", None, Duration::ZERO)
        .await
        .expect("granted at once: the lost lease was given back");
    assert!(new.grant.token > lost.grant.token);
    assert!(agent.get("r").is_some_and(|l| Arc::ptr_eq(&l, &new)));
    agent.release_all().await;
    assert!(
        !agent.backend().release(&new.grant).await.unwrap(),
        "the drain released the new lease"
    );
}

/// The drain's last step cannot run ahead of its first: releasing everything drains too.
#[tokio::test(start_paused = true)]
async fn releasing_everything_grants_nothing_more() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent(&dir).await;
    let waiter = held_and_waited_for(&agent, "r").await;
    agent.release_all().await;
    let refused = waiter.await.unwrap();
    assert!(
        matches!(refused, Err(AcquireError::Draining)),
        "{:?}",
        refused.map(|l| l.grant.clone())
    );
    assert!(agent.is_draining());
    assert!(agent.all().is_empty());
}

#[tokio::test(start_paused = true)]
async fn the_held_gauge_follows_the_newest_lease_on_a_resource() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent(&dir).await;
    let old = agent
        .acquire("r", "w1", None, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(gauge(&agent, "r"), (Some("1".into()), "1".into()));
    let mut events = agent.subscribe();
    // The backend drops w1's lease (an operator, a failover): w2 gets the resource while
    // w1's renewer still runs.
    assert!(agent.backend().release(&old.grant).await.unwrap());
    let new = agent
        .acquire("r", "w2", None, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(gauge(&agent, "r"), (Some("1".into()), "1".into()));
    // w1's next renewal finds it gone and declares it lost.
    loop {
        let e = events.recv().await.unwrap();
        if e.event == "lost" {
            assert_eq!(e.lease_id, old.grant.lease_id);
            break;
        }
    }
    assert_eq!(old.state(), State::Expired);
    assert_eq!(new.state(), State::Held);
    assert_eq!(agent.token_for("r"), Some(new.grant.token));
    assert_eq!(gauge(&agent, "r"), (Some("1".into()), "1".into()));
    // And the new lease's own release removes the series (per-job leases would otherwise
    // leave one series each behind for good).
    agent.release("r").await.unwrap().unwrap();
    assert_eq!(gauge(&agent, "r"), (None, "0".into()));
    // A lease lost on its own removes it too.
    let lost = agent
        .acquire("s", "w3", None, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(gauge(&agent, "s"), (Some("1".into()), "1".into()));
    assert!(agent.backend().release(&lost.grant).await.unwrap());
    loop {
        if events.recv().await.unwrap().event == "lost" {
            break;
        }
    }
    assert_eq!(gauge(&agent, "s"), (None, "0".into()));
}

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
