//! Maxima in PostgreSQL: one conditional upsert per compare-and-raise.
//!
//! `INSERT ... ON CONFLICT DO UPDATE ... WHERE max < token RETURNING prev` raises atomically
//! (the row lock serialises racing raises, and the WHERE is re-checked against the latest row
//! version). When it returns no row the token did not raise the maximum; the follow-up read
//! then decides between "equal, admitted" and "stale", which is correct at the time of that
//! read because maxima only grow. The table is created on first use if missing.

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio::sync::OnceCell;
use tokio_postgres::NoTls;

use super::shared::Remote;
use super::{decide, BoxFuture, StoreError, Verdict};
use crate::config::EqualTokens;

pub struct PostgresRemote {
    pool: Pool,
    /// Table created (idempotently) before the first statement.
    schema: OnceCell<()>,
    table: String,
    raise_sql: String,
    get_sql: String,
}

impl PostgresRemote {
    /// `prefix` is validated as an SQL identifier when the config is loaded.
    pub fn new(url: &str, prefix: &str) -> Result<Self, StoreError> {
        let (pool, _) = pool(url).map_err(StoreError::Unavailable)?;
        let table = format!("{prefix}_fences");
        Ok(PostgresRemote {
            pool,
            schema: OnceCell::new(),
            raise_sql: format!(
                "INSERT INTO {table} AS f (resource, max_token, prev_token) VALUES ($1, $2, NULL) \
                 ON CONFLICT (resource) DO UPDATE \
                 SET max_token = EXCLUDED.max_token, prev_token = f.max_token \
                 WHERE f.max_token < EXCLUDED.max_token \
                 RETURNING prev_token"
            ),
            get_sql: format!("SELECT max_token FROM {table} WHERE resource = $1"),
            table,
        })
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        let client = self.pool.get().await.map_err(|e| unavailable(&e))?;
        self.schema
            .get_or_try_init(|| async {
                client
                    .batch_execute(&format!(
                        "CREATE TABLE IF NOT EXISTS {} (\
                           resource TEXT PRIMARY KEY, \
                           max_token BIGINT NOT NULL CHECK (max_token >= 0), \
                           prev_token BIGINT)",
                        self.table
                    ))
                    .await
                    .map_err(|e| unavailable(&e))
            })
            .await?;
        Ok(client)
    }
}

/// A connection pool for `url` (at most 16 connections), shared in shape with the
/// PostgreSQL lease backend; also returns the parsed config for dedicated connections.
pub(crate) fn pool(url: &str) -> Result<(Pool, tokio_postgres::Config), String> {
    let config: tokio_postgres::Config =
        url.parse().map_err(|e| format!("bad postgres url: {e}"))?;
    let manager = Manager::from_config(
        config.clone(),
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let pool = Pool::builder(manager)
        .max_size(16)
        .build()
        .map_err(|e| format!("postgres pool: {e}"))?;
    Ok((pool, config))
}

fn unavailable(e: &dyn std::fmt::Display) -> StoreError {
    StoreError::Unavailable(format!("postgres: {e}"))
}

fn token_of(v: i64) -> Result<u64, StoreError> {
    u64::try_from(v)
        .map_err(|_| StoreError::Unavailable(format!("postgres holds a negative maximum {v}")))
}

impl Remote for PostgresRemote {
    fn raise<'a>(
        &'a self,
        resource: &'a str,
        token: u64,
        equal: EqualTokens,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            let signed = i64::try_from(token).map_err(|_| unavailable(&"token above 2^63-1"))?;
            let statement = client
                .prepare_cached(&self.raise_sql)
                .await
                .map_err(|e| unavailable(&e))?;
            let raised = client
                .query_opt(&statement, &[&resource, &signed])
                .await
                .map_err(|e| unavailable(&e))?;
            if let Some(row) = raised {
                let previous: Option<i64> = row.get(0);
                return Ok(Verdict::Admitted {
                    previous: previous.map(token_of).transpose()?,
                });
            }
            let statement = client
                .prepare_cached(&self.get_sql)
                .await
                .map_err(|e| unavailable(&e))?;
            let row = client
                .query_one(&statement, &[&resource])
                .await
                .map_err(|e| unavailable(&e))?;
            Ok(decide(Some(token_of(row.get(0))?), token, equal))
        })
    }

    fn get<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<u64>, StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            let row = client
                .query_opt(&self.get_sql, &[&resource])
                .await
                .map_err(|e| unavailable(&e))?;
            row.map(|r| token_of(r.get(0))).transpose()
        })
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            client
                .simple_query("SELECT 1")
                .await
                .map_err(|e| unavailable(&e))?;
            Ok(())
        })
    }

    fn begin_idempotent<'a>(
        &'a self,
        _resource: &'a str,
        _key: &'a str,
        _claim: &'a crate::idempotency::Claim,
    ) -> BoxFuture<'a, Result<crate::idempotency::Begin, StoreError>> {
        Box::pin(std::future::ready(Err(StoreError::Unavailable(
            "idempotency records are not implemented for this store yet".into(),
        ))))
    }

    fn finish_idempotent<'a>(
        &'a self,
        _resource: &'a str,
        _key: &'a str,
        _claim: &'a crate::idempotency::Claim,
        _outcome: &'a crate::idempotency::Record,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(std::future::ready(Err(StoreError::Unavailable(
            "idempotency records are not implemented for this store yet".into(),
        ))))
    }

    fn kind(&self) -> &'static str {
        "postgres"
    }
}
