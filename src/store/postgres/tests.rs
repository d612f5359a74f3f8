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
