//! `fencegate fences` on PostgreSQL. Reads go straight to the pool, without the set-up that
//! creates missing tables: a table that does not exist holds nothing (`42P01`). A reset is one
//! transaction: the maximum's row (`prev_token` keeps the one replaced, `raised_at` is cleared:
//! kept until a raise), then the generation in `{prefix}_resets`, created by the first reset.
//! Running fencegates read that row ([`crate::store::shared::resets`]).

use crate::fence::token::Token;
use std::sync::atomic::Ordering;

use tokio_postgres::error::SqlState;
use tokio_postgres::Row;

use super::{failed, token_of, PostgresRemote};
use crate::conn::postgres::like_escape;
use crate::conn::BoxFuture;
use crate::store::admin::{Fence, Inspect, Page};
use crate::store::StoreError;

impl PostgresRemote {
    fn resets_table(&self) -> String {
        // `{prefix}_fences` → `{prefix}_resets`.
        let prefix = self.table.strip_suffix("_fences").unwrap_or(&self.table);
        format!("{prefix}_resets")
    }

    fn columns(&self) -> String {
        format!(
            "SELECT resource, max_token, prev_token, \
               (extract(epoch FROM raised_at) * 1000)::BIGINT FROM {}",
            self.table
        )
    }

    /// Rows of `sql`, none when a table it reads does not exist yet.
    async fn rows(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError> {
        let client = self.pool.get().await.map_err(|e| self.failed(&e))?;
        match client.query(sql, params).await {
            Ok(rows) => Ok(rows),
            Err(e) if e.code() == Some(&SqlState::UNDEFINED_TABLE) => Ok(Vec::new()),
            Err(e) => Err(self.failed(&e)),
        }
    }

    /// The reset generation (0: no reset ever, or no table for it yet). Until the table
    /// exists this asks whether it does (`to_regclass`), not for its row: a statement on a
    /// missing table would put an error in the server's log every second.
    pub(super) async fn read_resets(&self) -> Result<u64, StoreError> {
        let table = self.resets_table();
        if !self.resets_exist.load(Ordering::Relaxed) {
            let client = self.pool.get().await.map_err(|e| self.failed(&e))?;
            let row = client
                .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
                .await
                .map_err(|e| self.failed(&e))?;
            if !row.get::<_, bool>(0) {
                return Ok(0);
            }
            self.resets_exist.store(true, Ordering::Relaxed);
        }
        let rows = self
            .rows(&format!("SELECT generation FROM {table}"), &[])
            .await?;
        rows.first().map_or(Ok(0), |r| {
            let generation: i64 = r.get(0);
            u64::try_from(generation).map_err(|_| {
                StoreError::corrupt(format!(
                    "postgres holds a negative reset generation {generation}"
                ))
            })
        })
    }
}

fn fence(row: &Row) -> Result<Fence, StoreError> {
    let resource: String = row.get(0);
    let mut fence = Fence::recorded(&resource, Some(token_of(row.get(1))?));
    fence.previous_token = row.get::<_, Option<i64>>(2).map(token_of).transpose()?;
    fence.raised_at_ms = row
        .get::<_, Option<i64>>(3)
        .and_then(|ms| u64::try_from(ms).ok());
    Ok(fence)
}

impl Inspect for PostgresRemote {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    fn fence<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Fence, StoreError>> {
        Box::pin(async move {
            let sql = format!("{} WHERE resource = $1", self.columns());
            let rows = self.rows(&sql, &[&resource]).await?;
            match rows.first() {
                Some(row) => fence(row),
                None => Ok(Fence::absent(resource)),
            }
        })
    }

    fn list<'a>(
        &'a self,
        prefix: &'a str,
        after: Option<&'a str>,
        limit: usize,
    ) -> BoxFuture<'a, Result<Page, StoreError>> {
        Box::pin(async move {
            // `COLLATE "C"`: byte order, the order of the other stores and of `--after`.
            let sql = format!(
                "{} WHERE resource LIKE $1 AND ($2::TEXT IS NULL OR resource COLLATE \"C\" > $2) \
                 ORDER BY resource COLLATE \"C\" LIMIT $3",
                self.columns()
            );
            let pattern = format!("{}%", like_escape(prefix));
            let fetch = i64::try_from(limit.saturating_add(1)).unwrap_or(i64::MAX);
            let rows = self.rows(&sql, &[&pattern, &after, &fetch]).await?;
            let fences = rows.iter().map(fence).collect::<Result<Vec<_>, _>>()?;
            Ok(Page::of(fences, limit))
        })
    }

    fn reset<'a>(
        &'a self,
        resource: &'a str,
        to: Token,
    ) -> BoxFuture<'a, Result<Option<Token>, StoreError>> {
        Box::pin(async move {
            let to = to.to_i64();
            let resets = self.resets_table();
            let table = &self.table;
            // Creates the maxima's tables if missing: a reset may set a first maximum.
            let mut client = self.client().await?;
            let txn = client.transaction().await.map_err(|e| failed(&e))?;
            txn.batch_execute(&format!(
                "SELECT pg_advisory_xact_lock(hashtextextended('fencegate schema {resets}', 0)); \
                 CREATE TABLE IF NOT EXISTS {resets} (\
                   only_row BOOLEAN PRIMARY KEY DEFAULT true CHECK (only_row), \
                   generation BIGINT NOT NULL, \
                   reset_at TIMESTAMPTZ NOT NULL)"
            ))
            .await
            .map_err(|e| failed(&e))?;
            let before = txn
                .query_opt(
                    &format!("SELECT max_token FROM {table} WHERE resource = $1 FOR UPDATE"),
                    &[&resource],
                )
                .await
                .map_err(|e| failed(&e))?
                .map(|row| token_of(row.get(0)))
                .transpose()?;
            txn.execute(
                &format!(
                    "INSERT INTO {table} AS f (resource, max_token, prev_token, raised_at) \
                     VALUES ($1, $2, NULL, NULL) \
                     ON CONFLICT (resource) DO UPDATE \
                     SET max_token = EXCLUDED.max_token, prev_token = f.max_token, \
                         raised_at = NULL"
                ),
                &[&resource, &to],
            )
            .await
            .map_err(|e| failed(&e))?;
            txn.execute(
                &format!(
                    "INSERT INTO {resets} AS r (only_row, generation, reset_at) \
                     VALUES (true, 1, now()) \
                     ON CONFLICT (only_row) DO UPDATE \
                     SET generation = r.generation + 1, reset_at = now()"
                ),
                &[],
            )
            .await
            .map_err(|e| failed(&e))?;
            txn.commit().await.map_err(|e| failed(&e))?;
            Ok(before)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn like_wildcards_are_escaped() {
        assert_eq!(like_escape("a%b_c\\"), "a\\%b\\_c\\\\");
    }
}
