//! Unit tests of the embedded store.

use super::*;
use crate::config::EqualTokens;
use crate::fence::resource::rid;
use crate::fence::token::tk;
use crate::sync::Locked;

#[tokio::test]
async fn survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.db");
    {
        let store = EmbeddedStore::open(&path, "t", 1000).unwrap();
        let v = store
            .compare_and_raise(&rid("r"), 9.into(), EqualTokens::Allow.into())
            .await
            .unwrap();
        assert_eq!(v, Verdict::Admitted { previous: None });
        let v = store
            .compare_and_raise(&rid("r"), 4.into(), EqualTokens::Allow.into())
            .await
            .unwrap();
        assert_eq!(v, Verdict::Stale { current: 9.into() });
    }
    let store = EmbeddedStore::open(&path, "t", 1000).unwrap();
    assert_eq!(store.current(&rid("r")).await.unwrap(), Some(9.into()));
    let v = store
        .compare_and_raise(&rid("r"), 8.into(), EqualTokens::Allow.into())
        .await
        .unwrap();
    assert_eq!(v, Verdict::Stale { current: 9.into() });
}

fn claim(token: Token, window: Duration) -> Claim {
    Claim {
        token,
        fingerprint: crate::idempotency::Fingerprint([7; 32]),
        rule: EqualTokens::Allow.into(),
        window,
        may_execute: true,
        attempt: crate::idempotency::AttemptId::next(),
    }
}

#[tokio::test]
async fn records_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.db");
    let c = claim(4.into(), Duration::from_secs(60));
    let done = Record {
        phase: Phase::Completed,
        status: Some(204),
        ..Record::in_flight(4.into(), c.fingerprint)
    };
    {
        let store = EmbeddedStore::open(&path, "t", 1000).unwrap();
        assert_eq!(
            store.begin_idempotent(&rid("r"), "k", &c).await.unwrap(),
            Begin::Execute { previous: None }
        );
        assert!(store
            .finish_idempotent(&rid("r"), "k", &c, &done)
            .await
            .unwrap());
    }
    let store = EmbeddedStore::open(&path, "t", 1000).unwrap();
    assert_eq!(store.current(&rid("r")).await.unwrap(), Some(4.into()));
    assert_eq!(
        store.begin_idempotent(&rid("r"), "k", &c).await.unwrap(),
        Begin::Completed(done)
    );
}

#[tokio::test]
async fn expired_records_are_absent_and_purged_by_later_writes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.db");
    {
        let store = EmbeddedStore::open(&path, "t", 1000).unwrap();
        let short = claim(1.into(), Duration::from_millis(1));
        for key in ["a", "b", "c"] {
            assert!(matches!(
                store
                    .begin_idempotent(&rid("r"), key, &short)
                    .await
                    .unwrap(),
                Begin::Execute { .. }
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        // Expired: the key executes again; this write purges the other two.
        assert_eq!(
            store
                .begin_idempotent(&rid("r"), "a", &short)
                .await
                .unwrap(),
            Begin::Execute {
                previous: Some(1.into())
            }
        );
        let long = claim(2.into(), Duration::from_secs(60));
        assert!(matches!(
            store.begin_idempotent(&rid("r"), "d", &long).await.unwrap(),
            Begin::Execute { .. }
        ));
    }
    let db = Database::create(&path).unwrap();
    let read = db.begin_read().unwrap();
    let names = Names::new("t");
    let records = read.open_table(Records::new(&names.records)).unwrap();
    let keys: Vec<String> = records
        .iter()
        .unwrap()
        .map(|row| row.unwrap().0.value().to_owned())
        .collect();
    assert_eq!(keys, [record_key("r", "d")]);
    let expiries = read.open_table(Expiries::new(&names.expiries)).unwrap();
    assert_eq!(redb::ReadableTableMetadata::len(&expiries).unwrap(), 1);
}

/// The wall clock steps an hour forward while an attempt runs: its in-flight record is
/// past its stored expiry, but a retry is still refused as in flight (and no purge removes
/// it), and the attempt's outcome lands. Nor does a step expire a completed record early: a
/// retry within the window is answered from it, however far the wall clock has moved.
#[tokio::test]
async fn a_wall_clock_step_expires_no_record_early() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(&dir.path().join("f.db"), "t", 1000).unwrap();
    let a = claim(4.into(), Duration::from_secs(60));
    assert_eq!(
        store.begin_idempotent(&rid("r"), "k", &a).await.unwrap(),
        Begin::Execute { previous: None }
    );
    step_clock(&store, 3_600_000);
    let retry = claim(4.into(), Duration::from_secs(60));
    assert_eq!(
        store
            .begin_idempotent(&rid("r"), "k", &retry)
            .await
            .unwrap(),
        Begin::InFlight
    );
    // Another key's write purges what expired by the stepped clock.
    assert!(matches!(
        store
            .begin_idempotent(&rid("r"), "other", &retry)
            .await
            .unwrap(),
        Begin::Execute { .. }
    ));
    assert_eq!(
        store
            .begin_idempotent(&rid("r"), "k", &retry)
            .await
            .unwrap(),
        Begin::InFlight
    );
    let done = Record {
        phase: Phase::Completed,
        status: Some(204),
        ..Record::in_flight(4.into(), a.fingerprint)
    };
    assert!(store
        .finish_idempotent(&rid("r"), "k", &a, &done)
        .await
        .unwrap());
    assert_eq!(
        store
            .begin_idempotent(&rid("r"), "k", &retry)
            .await
            .unwrap(),
        Begin::Completed(done.clone())
    );
    // A further day on the wall clock, a few milliseconds in fact: "other" is still
    // `retry`'s running attempt, and "k"'s outcome is still the answer to a retry.
    step_clock(&store, 3_600_000 + 86_400_000);
    assert_eq!(
        store
            .begin_idempotent(&rid("r"), "other", &a)
            .await
            .unwrap(),
        Begin::InFlight
    );
    assert_eq!(
        store.begin_idempotent(&rid("r"), "k", &a).await.unwrap(),
        Begin::Completed(done)
    );
}

/// A wall clock stepped back keeps no record of this process alive past its window: records
/// written here expire by the monotonic clock (a window of 200 ms, a step of a day back).
#[tokio::test]
async fn a_wall_clock_stepped_back_keeps_no_record_alive() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(&dir.path().join("f.db"), "t", 1000).unwrap();
    let window = Duration::from_millis(200);
    let a = claim(4.into(), window);
    assert!(matches!(
        store.begin_idempotent(&rid("r"), "k", &a).await.unwrap(),
        Begin::Execute { .. }
    ));
    let done = Record {
        phase: Phase::Completed,
        status: Some(204),
        ..Record::in_flight(4.into(), a.fingerprint)
    };
    assert!(store
        .finish_idempotent(&rid("r"), "k", &a, &done)
        .await
        .unwrap());
    let written = Instant::now();
    // Back a day: by the wall clock the record now expires a day after its window.
    step_clock(&store, -86_400_000);
    // Within its window (asked with time to spare) it is the answer to a retry...
    let answer = store
        .begin_idempotent(&rid("r"), "k", &claim(4.into(), window))
        .await
        .unwrap();
    if written.elapsed() < window {
        assert!(matches!(answer, Begin::Completed(_)), "{answer:?}");
    }
    // ... and past it (what is awaited is the window itself, on the clock) it is gone.
    tokio::time::sleep((window + Duration::from_millis(50)).saturating_sub(written.elapsed()))
        .await;
    let answer = store
        .begin_idempotent(&rid("r"), "k", &claim(4.into(), window))
        .await
        .unwrap();
    assert!(matches!(answer, Begin::Execute { .. }), "{answer:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_raises_share_commits() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(EmbeddedStore::open(&dir.path().join("f.db"), "t", 1000).unwrap());
    let tasks: Vec<_> = (0..200u64)
        .map(|i| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                store
                    .compare_and_raise(
                        &rid(&format!("r{}", i % 20)),
                        tk(i),
                        EqualTokens::Allow.into(),
                    )
                    .await
                    .unwrap()
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    for r in 0..20u64 {
        let max = (0..200u64).filter(|i| i % 20 == r).max();
        assert_eq!(
            store.current(&rid(&format!("r{r}"))).await.unwrap(),
            max.map(tk)
        );
    }
    // 200 raises queued while earlier syncs ran: far fewer commits than raises.
    assert!(store.commits() < 100, "{} commits", store.commits());
}

/// A writer that, once active, only ever wakes when told to (the test outlives its poll).
fn patient(dir: &tempfile::TempDir) -> EmbeddedStore {
    EmbeddedStore::open_polling(
        &dir.path().join("f.db"),
        "t",
        1000,
        Duration::from_secs(3600),
    )
    .unwrap()
}

fn hooked_runtime() -> tokio::runtime::Runtime {
    let mut builder = tokio::runtime::Builder::new_current_thread();
    defer_wakes_to_park(&mut builder);
    builder.enable_all().build().unwrap()
}

/// Spins (no sleep) until `done`, for at most 10 s.
fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::yield_now();
    }
}

#[test]
fn raises_queued_before_the_runtime_parks_share_one_commit() {
    let dir = tempfile::tempdir().unwrap();
    let store = patient(&dir);
    until("the writer to go idle", || {
        store.shared.idle.load(Ordering::Relaxed)
    });
    hooked_runtime().block_on(async {
        // The writer is idle, so this wakes it at once; the runtime parks while it waits.
        let v = store
            .compare_and_raise(&rid("first"), 1.into(), EqualTokens::Allow.into())
            .await;
        assert_eq!(v.unwrap(), Verdict::Admitted { previous: None });
        assert_eq!(store.commits(), 1);
        // Once the writer, done with that commit, has found the queue empty and waits (else
        // it could take the raises below as they are queued, in two batches).
        until("the writer to wait after its commit", || {
            store.shared.active_wait.load(Ordering::SeqCst)
        });
        // The writer has just committed: these wait for the runtime to park, then go
        // together.
        let ids = ["a", "b", "c", "d"].map(rid);
        let raises: Vec<_> = (0..64)
            .map(|i| {
                store.compare_and_raise(&ids[i % 4], tk(2 + i as u64), EqualTokens::Allow.into())
            })
            .collect();
        let mut verdicts = Vec::new();
        for raise in raises {
            verdicts.push(raise.await.unwrap());
        }
        assert_eq!(store.commits(), 2);
        assert_eq!(verdicts[0], Verdict::Admitted { previous: None });
        assert_eq!(
            verdicts[4],
            Verdict::Admitted {
                previous: Some(2.into())
            }
        );
        assert_eq!(
            verdicts[63],
            Verdict::Admitted {
                previous: Some(61.into())
            }
        );
    });
    assert_eq!(
        store.shared.cache.entry("d").map(|c| (c.value, c.exact)),
        Some((65.into(), true))
    );
}

#[test]
fn a_store_whose_writer_has_stopped_is_not_healthy() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = EmbeddedStore::open(&dir.path().join("f.db"), "t", 1000).unwrap();
    assert!(store.healthy());
    // The writer returns once its queue is closed: the same end as a panic in it, seen
    // from the store.
    drop(store.queue.take());
    let writer = store.writer.as_ref().unwrap();
    writer.thread().unpark();
    until("the writer to stop", || writer.is_finished());
    assert!(!store.healthy());
}

#[tokio::test]
async fn a_thread_without_the_hook_wakes_the_writer_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = patient(&dir);
    let r = rid("r");
    for token in 1..=3 {
        // After the first commit the writer waits an hour unless woken.
        let raise = store.compare_and_raise(&r, token.into(), EqualTokens::Allow.into());
        let v = tokio::time::timeout(Duration::from_secs(10), raise)
            .await
            .expect("the writer was not woken");
        assert!(matches!(v.unwrap(), Verdict::Admitted { .. }));
    }
    assert_eq!(store.commits(), 3);
}

#[test]
fn an_idle_writer_is_woken_at_once_even_from_a_hooked_runtime() {
    let dir = tempfile::tempdir().unwrap();
    let poll = Duration::from_micros(1);
    let store = EmbeddedStore::open_polling(&dir.path().join("f.db"), "t", 1000, poll).unwrap();
    hooked_runtime().block_on(async {
        let v = store
            .compare_and_raise(&rid("r"), 1.into(), EqualTokens::Allow.into())
            .await;
        assert_eq!(v.unwrap(), Verdict::Admitted { previous: None });
        until("the writer to go idle", || {
            store.shared.idle.load(Ordering::Relaxed)
        });
        // Queued without letting the runtime park: only an immediate wake commits it.
        let r = rid("r");
        let raise = store.compare_and_raise(&r, 2.into(), EqualTokens::Allow.into());
        until("the second commit", || store.commits() == 2);
        assert_eq!(
            raise.await.unwrap(),
            Verdict::Admitted {
                previous: Some(1.into())
            }
        );
    });
}

/// Raises `resources` to `token` each (in one batch), so that a small cache evicts.
async fn fill(store: &EmbeddedStore, resources: std::ops::Range<u64>, token: Token) {
    let raises: Vec<_> = resources
        .map(|i| format!("r{i}"))
        .map(|r| async move {
            store
                .compare_and_raise(&rid(&r), token, EqualTokens::Allow.into())
                .await
        })
        .collect();
    for raise in raises {
        assert!(matches!(raise.await.unwrap(), Verdict::Admitted { .. }));
    }
}

#[tokio::test]
async fn opening_reads_no_maximum() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.db");
    {
        let store = EmbeddedStore::open(&path, "t", 100_000).unwrap();
        fill(&store, 0..2_000, 3.into()).await;
        assert_eq!(store.cached(), 2_000);
    }
    let store = EmbeddedStore::open(&path, "t", 100_000).unwrap();
    assert_eq!(store.cached(), 0);
    // Each is read from the file on first use.
    assert_eq!(store.current(&rid("r1999")).await.unwrap(), Some(3.into()));
    assert_eq!(
        store
            .compare_and_raise(&rid("r7"), 2.into(), EqualTokens::Allow.into())
            .await
            .unwrap(),
        Verdict::Stale { current: 3.into() }
    );
    assert_eq!(store.cached(), 2);
}

#[tokio::test]
async fn the_cache_is_bounded_and_an_evicted_maximum_is_read_from_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(&dir.path().join("f.db"), "t", 8).unwrap();
    fill(&store, 0..100, 5.into()).await;
    assert!(store.cached() <= 8, "{} cached", store.cached());
    assert!(!store.shared.cache.contains("r0"));
    let commits = store.commits();
    // Refused from the file, without the writer.
    assert_eq!(
        store
            .compare_and_raise(&rid("r0"), 4.into(), EqualTokens::Allow.into())
            .await
            .unwrap(),
        Verdict::Stale { current: 5.into() }
    );
    assert_eq!(
        store
            .compare_and_raise(&rid("r1"), 5.into(), EqualTokens::Reject.into())
            .await
            .unwrap(),
        Verdict::Stale { current: 5.into() }
    );
    // A repeat of the maximum: admitted, nothing written.
    assert_eq!(
        store
            .compare_and_raise(&rid("r2"), 5.into(), EqualTokens::Allow.into())
            .await
            .unwrap(),
        Verdict::Admitted {
            previous: Some(5.into())
        }
    );
    assert_eq!(store.commits(), commits);
    assert_eq!(
        store
            .compare_and_raise(&rid("r3"), 6.into(), EqualTokens::Allow.into())
            .await
            .unwrap(),
        Verdict::Admitted {
            previous: Some(5.into())
        }
    );
    assert_eq!(store.commits(), commits + 1);
}

/// The cache holds a value below the durable maximum (a read that started before a raise
/// committed and cached what it read after the raise's own entry was evicted). A token
/// between the two, or equal to the stale value, must still be refused: the writer compares
/// with the table, and a repeat of a value not marked exact is checked against the file.
#[tokio::test]
async fn a_lower_bound_in_the_cache_admits_nothing_below_the_durable_maximum() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(&dir.path().join("f.db"), "t", 1).unwrap();
    assert!(matches!(
        store
            .compare_and_raise(&rid("r"), 9.into(), EqualTokens::Allow.into())
            .await
            .unwrap(),
        Verdict::Admitted { previous: None }
    ));
    let plant = || {
        // Another resource takes the only place, then the late read lands.
        store.shared.cache.observe("other", 1.into());
        assert!(!store.shared.cache.contains("r"));
        store.shared.cache.observe("r", 3.into());
        assert_eq!(
            store.shared.cache.entry("r"),
            Some(crate::maxima::Cached {
                value: 3.into(),
                exact: false
            })
        );
    };
    // Above the lower bound: the writer's table says 9. A repeat of it: the file says 9.
    for token in [5, 8, 3] {
        plant();
        assert_eq!(
            store
                .compare_and_raise(&rid("r"), token.into(), EqualTokens::Allow.into())
                .await
                .unwrap(),
            Verdict::Stale { current: 9.into() },
            "token {token}"
        );
    }
    plant();
    assert_eq!(store.current(&rid("r")).await.unwrap(), Some(9.into()));
    // Through the idempotent path as well.
    plant();
    let c = claim(5.into(), Duration::from_secs(60));
    assert!(matches!(
        store.begin_idempotent(&rid("r"), "k", &c).await.unwrap(),
        Begin::Stale { current } if current == 9.into()
    ));
}

/// A raise clears the exact mark of its resource before its commit and sets it again after:
/// while the commit runs, a repeat of the old maximum is not taken for the maximum.
#[tokio::test]
async fn the_writer_keeps_exact_values_exact() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(&dir.path().join("f.db"), "t", 100).unwrap();
    store
        .compare_and_raise(&rid("r"), 4.into(), EqualTokens::Allow.into())
        .await
        .unwrap();
    let exact = |value| Some(crate::maxima::Cached { value, exact: true });
    assert_eq!(store.shared.cache.entry("r"), exact(4.into()));
    let seen = Arc::new(std::sync::Mutex::new(None));
    let saw = Arc::clone(&seen);
    *store.shared.before_commit.locked() = Some(Box::new(move |cache| {
        *saw.locked() = cache.entry("r");
    }));
    store
        .compare_and_raise(&rid("r"), 6.into(), EqualTokens::Allow.into())
        .await
        .unwrap();
    // While the raise to 6 committed, 4 was a lower bound only.
    assert_eq!(
        *seen.locked(),
        Some(crate::maxima::Cached {
            value: 4.into(),
            exact: false
        })
    );
    assert_eq!(store.shared.cache.entry("r"), exact(6.into()));
    // Read by the writer (a stale claim): exact too.
    store.shared.cache.unconfirm("r");
    let c = claim(2.into(), Duration::from_secs(60));
    assert!(matches!(
        store.begin_idempotent(&rid("r"), "k", &c).await.unwrap(),
        Begin::Stale { current } if current == 6.into()
    ));
    assert_eq!(store.shared.cache.entry("r"), exact(6.into()));
}

/// Moves the store's wall clock to `ms` after (or, negative, before) the real one.
fn step_clock(store: &EmbeddedStore, ms: i64) {
    store.shared.clock_step_ms.store(ms, Ordering::Relaxed);
}

const MINUTE: i64 = 60_000;

/// With retention, a maximum not raised for the period is forgotten by the writer (file and
/// cache), a maximum raised since is kept with its new age, and a repeat of the maximum
/// (which raises nothing) does not make it younger.
#[tokio::test]
async fn maxima_not_raised_for_the_retention_are_forgotten() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.db");
    {
        let store = EmbeddedStore::open(&path, "t", 1000).unwrap();
        store.forget_after(Duration::from_secs(3600)).unwrap();
        for (r, token) in [("a", 5), ("b", 3), ("c", 7)] {
            let r = rid(r);
            let v = store.compare_and_raise(&r, token.into(), EqualTokens::Allow.into());
            assert_eq!(v.await.unwrap(), Verdict::Admitted { previous: None });
        }
        step_clock(&store, 30 * MINUTE);
        let v = store
            .compare_and_raise(&rid("b"), 4.into(), EqualTokens::Allow.into())
            .await;
        assert_eq!(
            v.unwrap(),
            Verdict::Admitted {
                previous: Some(3.into())
            }
        );
        let v = store
            .compare_and_raise(&rid("a"), 5.into(), EqualTokens::Allow.into())
            .await;
        assert_eq!(
            v.unwrap(),
            Verdict::Admitted {
                previous: Some(5.into())
            }
        );
        assert!(store.shared.cache.contains("a"));
        // An hour and a minute after a's and c's raise: the next batch forgets them first.
        step_clock(&store, 61 * MINUTE);
        let v = store
            .compare_and_raise(&rid("d"), 1.into(), EqualTokens::Allow.into())
            .await;
        assert_eq!(v.unwrap(), Verdict::Admitted { previous: None });
        assert!(!store.shared.cache.contains("a"));
        assert!(!store.shared.cache.contains("c"));
        assert_eq!(store.read_maximum("a").unwrap(), None);
        assert_eq!(store.read_maximum("c").unwrap(), None);
        assert_eq!(store.current(&rid("b")).await.unwrap(), Some(4.into()));
        assert_eq!(store.current(&rid("d")).await.unwrap(), Some(1.into()));
        // Forgotten: any token is admitted again (which is why the config allows retention
        // only where the lease backend refuses old tokens).
        let v = store
            .compare_and_raise(&rid("a"), 2.into(), EqualTokens::Allow.into())
            .await;
        assert_eq!(v.unwrap(), Verdict::Admitted { previous: None });
    }
    // Reopened: forgotten stays forgotten, and ages survive (b goes an hour after its raise).
    let store = EmbeddedStore::open(&path, "t", 1000).unwrap();
    store.forget_after(Duration::from_secs(3600)).unwrap();
    assert_eq!(store.current(&rid("c")).await.unwrap(), None);
    assert_eq!(store.current(&rid("b")).await.unwrap(), Some(4.into()));
    step_clock(&store, 91 * MINUTE);
    let v = store
        .compare_and_raise(&rid("e"), 1.into(), EqualTokens::Allow.into())
        .await;
    assert_eq!(v.unwrap(), Verdict::Admitted { previous: None });
    assert_eq!(store.read_maximum("b").unwrap(), None);
    assert_eq!(store.read_maximum("a").unwrap(), Some(2.into()));
}

/// An idle writer wakes for its next forgetting pass on its own; without retention nothing is
/// ever forgotten, however far the clock goes.
#[test]
fn an_idle_writer_forgets_without_a_write() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = EmbeddedStore::open(&dir.path().join("f.db"), "t", 1000).unwrap();
    runtime.block_on(async {
        let v = store
            .compare_and_raise(&rid("kept"), 5.into(), EqualTokens::Allow.into())
            .await;
        assert_eq!(v.unwrap(), Verdict::Admitted { previous: None });
    });
    step_clock(&store, 10 * 24 * 60 * MINUTE);
    runtime.block_on(async {
        let v = store
            .compare_and_raise(&rid("other"), 1.into(), EqualTokens::Allow.into())
            .await;
        assert_eq!(v.unwrap(), Verdict::Admitted { previous: None });
    });
    assert_eq!(store.read_maximum("kept").unwrap(), Some(5.into()));

    store.forget_after(Duration::from_secs(3600)).unwrap();
    runtime.block_on(async {
        let v = store
            .compare_and_raise(&rid("gone"), 5.into(), EqualTokens::Allow.into())
            .await;
        assert_eq!(v.unwrap(), Verdict::Admitted { previous: None });
    });
    let commits = store.commits();
    // Two hours on, nothing queued: the writer's own wake-up (due within a minute of real
    // time; `forget_after` wakes it at once to look) forgets `gone`. `kept` was raised while
    // retention was off: it has no age and stays.
    step_clock(&store, 10 * 24 * 60 * MINUTE + 120 * MINUTE);
    store.forget_after(Duration::from_secs(3600)).unwrap();
    // The counter moves after the commit, so once it has, the commit is readable.
    until("the idle writer commits", || store.commits() > commits);
    assert_eq!(store.commits(), commits + 1);
    assert_eq!(store.read_maximum("gone").unwrap(), None);
    assert_eq!(store.read_maximum("kept").unwrap(), Some(5.into()));
}

/// A run without retention drops the raise times an earlier run with retention left, so that
/// turning retention on again does not date a maximum by a raise long past: here `r`, raised
/// two hours after its recorded raise (while retention was off), is kept.
#[tokio::test]
async fn raise_times_do_not_outlive_a_run_without_retention() {
    async fn raise(store: &EmbeddedStore, r: &str, token: Token) -> Verdict {
        store
            .compare_and_raise(&rid(r), token, EqualTokens::Allow.into())
            .await
            .unwrap()
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.db");
    {
        let store = EmbeddedStore::open(&path, "t", 1000).unwrap();
        store.forget_after(Duration::from_secs(3600)).unwrap();
        assert_eq!(
            raise(&store, "r", 1.into()).await,
            Verdict::Admitted { previous: None }
        );
    }
    {
        let store = EmbeddedStore::open(&path, "t", 1000).unwrap();
        step_clock(&store, 120 * MINUTE);
        assert_eq!(
            raise(&store, "r", 2.into()).await,
            Verdict::Admitted {
                previous: Some(1.into())
            }
        );
    }
    let store = EmbeddedStore::open(&path, "t", 1000).unwrap();
    store.forget_after(Duration::from_secs(3600)).unwrap();
    step_clock(&store, 130 * MINUTE);
    assert_eq!(
        raise(&store, "other", 1.into()).await,
        Verdict::Admitted { previous: None }
    );
    assert_eq!(store.read_maximum("r").unwrap(), Some(2.into()));
}

/// The resources that have a raise time in the file at `path` (the store closed).
fn aged(path: &std::path::Path) -> Vec<String> {
    let db = Database::create(path).unwrap();
    let read = db.begin_read().unwrap();
    let names = Names::new("t");
    match read.open_table(Raised::new(&names.raised)) {
        Ok(raised) => raised
            .iter()
            .unwrap()
            .map(|row| row.unwrap().0.value().to_owned())
            .collect(),
        Err(redb::TableError::TableDoesNotExist(_)) => Vec::new(),
        Err(e) => panic!("{e}"),
    }
}

/// Moves between configurations across restarts of the embedded store (the config side,
/// `token.equal: reject` refused with retention, is the config's test): a run with retention
/// ages `r` and `s`; a run without retention (observed or authoritative: the store is told no
/// period either way) forgets nothing however far its clock goes, drops the ages at its first
/// write, and refuses a repeat of `s` with `equal: reject`; a run with retention again keeps
/// both past the period, since neither was raised since: the maxima have exactly the values
/// written.
#[tokio::test]
async fn retention_on_then_off_then_on_across_restarts() {
    async fn raise(store: &EmbeddedStore, r: &str, token: Token, equal: EqualTokens) -> Verdict {
        store
            .compare_and_raise(&rid(r), token, equal.into())
            .await
            .unwrap()
    }
    use EqualTokens::{Allow, Reject};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.db");
    {
        let store = EmbeddedStore::open(&path, "t", 1000).unwrap();
        store.forget_after(Duration::from_secs(3600)).unwrap();
        assert_eq!(
            raise(&store, "r", 3.into(), Allow).await,
            Verdict::Admitted { previous: None }
        );
        assert_eq!(
            raise(&store, "s", 4.into(), Allow).await,
            Verdict::Admitted { previous: None }
        );
    }
    assert_eq!(aged(&path), ["r", "s"]);
    {
        let store = EmbeddedStore::open(&path, "t", 1000).unwrap();
        step_clock(&store, 10 * 24 * 60 * MINUTE);
        assert_eq!(
            raise(&store, "other", 1.into(), Reject).await,
            Verdict::Admitted { previous: None }
        );
        assert_eq!(
            raise(&store, "s", 4.into(), Reject).await,
            Verdict::Stale { current: 4.into() }
        );
        assert_eq!(store.read_maximum("r").unwrap(), Some(3.into()));
    }
    assert_eq!(aged(&path), Vec::<String>::new());
    let store = EmbeddedStore::open(&path, "t", 1000).unwrap();
    store.forget_after(Duration::from_secs(3600)).unwrap();
    step_clock(&store, 20 * 24 * 60 * MINUTE);
    assert_eq!(
        raise(&store, "new", 1.into(), Allow).await,
        Verdict::Admitted { previous: None }
    );
    step_clock(&store, 20 * 24 * 60 * MINUTE + 61 * MINUTE);
    assert_eq!(
        raise(&store, "later", 1.into(), Allow).await,
        Verdict::Admitted { previous: None }
    );
    assert_eq!(store.read_maximum("new").unwrap(), None, "forgotten");
    for (r, max) in [("r", 3), ("s", 4), ("other", 1)] {
        assert_eq!(store.read_maximum(r).unwrap(), Some(max.into()), "{r}");
    }
}
