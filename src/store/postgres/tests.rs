//! Tests of the PostgreSQL store below the shared layer (no health probe using the pool
//! beside them), against the server at 127.0.0.1:5432 that the integration tests use.

use std::time::Duration;

use super::*;
use crate::config::EqualTokens;

const URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// A prefix no other test or run uses.
fn fresh_prefix() -> String {
    format!("u{}", AttemptId::next().hex())
}

async fn admin() -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(URL, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
}

/// The states of the server sessions running (or last having run) the table set-up of
/// `prefix`.
async fn set_up_sessions(admin: &tokio_postgres::Client, prefix: &str) -> Vec<String> {
    let rows = admin
        .query(
            "SELECT state FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND query LIKE $1",
            &[&format!("%fencegate schema {prefix}_fences%")],
        )
        .await
        .unwrap();
    rows.iter().map(|r| r.get(0)).collect()
}

/// A table set-up abandoned by its caller (the proxy gives up at `timeouts.store`) while it
/// waits for the set-up lock, and failing once it gets it, leaves no connection inside an
/// aborted transaction: the server session is idle, and the next call on the pool's
/// connection sets the tables up and writes (it failed with 25P02, "current transaction is
/// aborted", when the set-up ran in an explicit transaction that the abandoned call never
/// rolled back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_table_set_up_returns_no_aborted_transaction_to_the_pool() {
    let prefix = fresh_prefix();
    let admin = admin().await;
    // Another session holds the set-up's lock, and a records table without `expires_at`
    // makes the set-up fail once it gets the lock.
    let lock = format!("hashtextextended('fencegate schema {prefix}_fences', 0)");
    admin
        .batch_execute(&format!(
            "SELECT pg_advisory_lock({lock}); CREATE TABLE {prefix}_idempotency (resource TEXT)"
        ))
        .await
        .unwrap();
    let remote = PostgresRemote::new(URL, &prefix, None, None).unwrap();
    {
        let raise = remote.raise("a", 1.into(), EqualTokens::Allow.into());
        tokio::pin!(raise);
        // Given up once the set-up waits for the lock, as a caller's timeout gives up.
        let waiting = async {
            while set_up_sessions(&admin, &prefix).await != ["active"] {
                tokio::task::yield_now().await;
            }
        };
        tokio::select! {
            r = &mut raise => panic!("the set-up did not wait for the lock: {r:?}"),
            _ = tokio::time::timeout(Duration::from_secs(10), waiting) => {}
        }
    }
    admin
        .batch_execute(&format!("SELECT pg_advisory_unlock({lock})"))
        .await
        .unwrap();
    // The abandoned set-up runs on, fails on the records table, and ends its transaction.
    let ended = async {
        loop {
            let states = set_up_sessions(&admin, &prefix).await;
            if !states.iter().any(|s| s == "active") {
                return states;
            }
            tokio::task::yield_now().await;
        }
    };
    let states = tokio::time::timeout(Duration::from_secs(10), ended)
        .await
        .expect("the abandoned set-up did not end within 10s");
    assert!(
        states.iter().all(|s| s == "idle"),
        "the pooled connection's session: {states:?}"
    );
    admin
        .batch_execute(&format!("DROP TABLE {prefix}_idempotency"))
        .await
        .unwrap();
    assert_eq!(
        remote
            .raise("a", 1.into(), EqualTokens::Allow.into())
            .await
            .unwrap(),
        Verdict::Admitted { previous: None }
    );
    admin
        .batch_execute(&format!(
            "DROP TABLE {prefix}_fences, {prefix}_idempotency, {prefix}_retention"
        ))
        .await
        .unwrap();
}

/// Whether a session running a statement on `table` that starts with `statement` waits for
/// a lock.
async fn waiting_for_a_lock(admin: &tokio_postgres::Client, statement: &str, table: &str) -> bool {
    let row = admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE pid <> pg_backend_pid() AND wait_event_type = 'Lock' AND query LIKE $1",
            &[&format!("{statement}%{table}%")],
        )
        .await
        .unwrap();
    row.get::<_, i64>(0) > 0
}

/// A retention pass (deleting old maxima, or taking their ages away) and a batch of raises
/// over the same rows never wait for each other in a cycle. The batch locks its rows in
/// resource order (`a`, then `b`); the pass picks them in the table's (`b`, then `a`). Here
/// another session holds `b` while the pass starts and the batch locks `a`, then lets go:
/// a pass that waited for `b` would then hold it and wait for `a`, held by the batch waiting
/// for `b`, and PostgreSQL would abort one of them ("deadlock detected"). A pass that skips
/// the rows others hold never waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retention_pass_and_a_batch_of_raises_never_wait_for_each_other() {
    for keep in [false, true] {
        let prefix = fresh_prefix();
        let table = format!("{prefix}_fences");
        let remote = Arc::new(PostgresRemote::new(URL, &prefix, None, None).unwrap());
        let allow: Rule = EqualTokens::Allow.into();
        // The tables and the index of `raised_at`, then two old maxima, `b` first in the
        // table and in age.
        for resource in ["b", "a"] {
            let raised = remote.raise(resource, 1.into(), allow).await.unwrap();
            assert_eq!(raised, Verdict::Admitted { previous: None });
        }
        assert_eq!(remote.forget_now(3600.0).await.unwrap(), 0);
        let admin = admin().await;
        for (resource, age) in [("b", 7200), ("a", 3600)] {
            admin
                .execute(
                    &format!(
                        "UPDATE {table} SET raised_at = now() - make_interval(secs => $1) \
                         WHERE resource = $2"
                    ),
                    &[&f64::from(age), &resource],
                )
                .await
                .unwrap();
        }
        let holder = holding_row(&table, "b").await;

        let pass = {
            let remote = Arc::clone(&remote);
            tokio::spawn(async move {
                match keep {
                    true => remote.keep_all().await,
                    false => remote.forget_now(60.0).await,
                }
            })
        };
        let statement = if keep { "UPDATE" } else { "DELETE" };
        // The pass either waits for `b` or has gone past it.
        while !pass.is_finished() && !waiting_for_a_lock(&admin, statement, &table).await {
            tokio::task::yield_now().await;
        }
        let batch = batch_waiting(&remote, [("a", 2), ("b", 2)], &admin, &table).await;
        holder
            .batch_execute("COMMIT")
            .await
            .expect("the holding session commits");

        let passed = tokio::time::timeout(Duration::from_secs(20), pass)
            .await
            .expect("the pass ended")
            .unwrap();
        let batched = tokio::time::timeout(Duration::from_secs(20), batch)
            .await
            .expect("the batch ended")
            .unwrap();
        let verdicts = batched.unwrap_or_else(|e| panic!("keep {keep}: the batch failed: {e}"));
        passed.unwrap_or_else(|e| panic!("keep {keep}: the pass failed: {e}"));
        // `a` was forgotten or raised from 1, `b` (held while the pass picked) raised from 1.
        assert!(
            matches!(
                verdicts[0],
                Ok(Verdict::Admitted {
                    previous: None | Some(_)
                })
            ),
            "a: {:?}",
            verdicts[0]
        );
        assert!(
            matches!(verdicts[1], Ok(Verdict::Admitted { previous: Some(p) }) if p == 1.into()),
            "b: {:?}",
            verdicts[1]
        );
        admin
            .batch_execute(&format!(
                "DROP TABLE {table}, {prefix}_idempotency, {prefix}_retention"
            ))
            .await
            .unwrap();
    }
}

/// Two raises sent as one batch (under `token.equal: allow`), once its statement waits for a
/// row lock.
async fn batch_waiting(
    remote: &Arc<PostgresRemote>,
    raises: [(&'static str, u32); 2],
    admin: &tokio_postgres::Client,
    table: &str,
) -> tokio::task::JoinHandle<Result<Vec<Result<Verdict, StoreError>>, StoreError>> {
    let remote = Arc::clone(remote);
    let batch = tokio::spawn(async move {
        let raises = raises.map(|(resource, token)| Raise {
            resource: resource.to_owned(),
            token: token.into(),
            rule: EqualTokens::Allow.into(),
        });
        remote.raise_many(&raises).await
    });
    while !waiting_for_a_lock(admin, "INSERT", table).await {
        tokio::task::yield_now().await;
    }
    batch
}

/// A session of its own, in a transaction holding the row of `resource` in `table`.
async fn holding_row(table: &str, resource: &str) -> tokio_postgres::Client {
    let holder = admin().await;
    holder
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM {table} WHERE resource = '{resource}' FOR UPDATE"
        ))
        .await
        .unwrap();
    holder
}

/// Once a batch's statement has committed, an error after it is the answer of the raises it
/// concerns, not the call's: a call's error means nothing took effect, and would have every
/// raise sent again alone, where one already raised would find its own token (refused under
/// `token.equal: reject`). Here `x` is stale, so the statement raises only `y` and leaves `x`
/// to the read that follows; that read waits for a table lock another session took as the
/// statement committed, and its connection is ended while it waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_fails_after_its_statement_committed_answers_each_raise() {
    let prefix = fresh_prefix();
    let table = format!("{prefix}_fences");
    let remote = Arc::new(PostgresRemote::new(URL, &prefix, None, None).unwrap());
    let allow: Rule = EqualTokens::Allow.into();
    let raised = remote.raise("x", 5u32.into(), allow).await.unwrap();
    assert_eq!(raised, Verdict::Admitted { previous: None });
    let admin = admin().await;
    // The statement waits for `x`'s row...
    let row_holder = holding_row(&table, "x").await;
    let batch = batch_waiting(&remote, [("x", 3), ("y", 1)], &admin, &table).await;
    // ... and a session asking for the whole table waits behind it, then gets the table as it
    // commits, before the read.
    let locking = {
        let table = table.clone();
        tokio::spawn(async move {
            let holder = self::admin().await;
            holder
                .batch_execute(&format!(
                    "BEGIN; LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"
                ))
                .await
                .unwrap();
            holder
        })
    };
    while !waiting_for_a_lock(&admin, "BEGIN", &table).await {
        tokio::task::yield_now().await;
    }
    row_holder.batch_execute("COMMIT").await.unwrap();
    let table_holder = locking.await.unwrap();
    while !waiting_for_a_lock(&admin, "SELECT", &table).await {
        tokio::task::yield_now().await;
    }
    let ended = admin
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE wait_event_type = 'Lock' AND query LIKE $1",
            &[&format!("SELECT%{table}%")],
        )
        .await
        .unwrap();
    assert_eq!(ended.get::<_, i64>(0), 1);
    let verdicts = tokio::time::timeout(Duration::from_secs(20), batch)
        .await
        .expect("the batch ended")
        .unwrap()
        .unwrap_or_else(|e| panic!("the call failed whole, after its statement committed: {e}"));
    assert!(
        verdicts[0].is_err(),
        "x, left to the read: {:?}",
        verdicts[0]
    );
    assert!(
        matches!(verdicts[1], Ok(Verdict::Admitted { previous: None })),
        "y, raised by the statement: {:?}",
        verdicts[1]
    );
    table_holder.batch_execute("ROLLBACK").await.unwrap();
    let maxima = admin
        .query(
            &format!("SELECT resource, max_token FROM {table} ORDER BY resource"),
            &[],
        )
        .await
        .unwrap();
    let maxima: Vec<(String, i64)> = maxima.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(maxima, [("x".to_owned(), 5), ("y".to_owned(), 1)]);
    admin
        .batch_execute(&format!(
            "DROP TABLE {table}, {prefix}_idempotency, {prefix}_retention"
        ))
        .await
        .unwrap();
}
