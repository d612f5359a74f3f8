//! `fencegate leases` on PostgreSQL: the rows of `<prefix>_leases`, read straight from the
//! pool (no table set-up: a table that does not exist holds no lease), judged on the server's
//! clock like every lease statement.

use crate::fence::token::Token;
use tokio_postgres::error::SqlState;
use tokio_postgres::Row;

use super::{failed, PostgresLeases};
use crate::conn::postgres::like_escape;
use crate::conn::BoxFuture;
use crate::lease::admin::{InspectLeases, Lease, LeasePage};
use crate::lease::LeaseError;

impl PostgresLeases {
    fn columns(&self) -> String {
        format!(
            "SELECT resource_id, holder_id, lease_id, fencing_token, \
               CASE WHEN expires_at > now() \
                 THEN (extract(epoch FROM (expires_at - now())) * 1000)::BIGINT END \
             FROM {}",
            self.table
        )
    }

    async fn rows(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<Row>, LeaseError> {
        let client = self.pool.get().await.map_err(|e| self.failed(&e))?;
        match client.query(sql, params).await {
            Ok(rows) => Ok(rows),
            Err(e) if e.code() == Some(&SqlState::UNDEFINED_TABLE) => Ok(Vec::new()),
            Err(e) => Err(failed(&e)),
        }
    }
}

fn lease(row: &Row) -> Result<Lease, LeaseError> {
    let resource: String = row.get(0);
    let token: i64 = row.get(3);
    let token = Token::try_from(token)
        .map_err(|_| LeaseError::corrupt(format!("postgres holds a negative token {token}")))?;
    let remaining: Option<i64> = row.get(4);
    match remaining {
        Some(ms) => Ok(Lease {
            resource,
            held: true,
            holder: row.get(1),
            lease_id: row.get(2),
            token: Some(token),
            expires_in_ms: u64::try_from(ms).ok(),
        }),
        None => Ok(Lease::free(&resource, Some(token))),
    }
}

impl InspectLeases for PostgresLeases {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    fn lease<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Lease, LeaseError>> {
        Box::pin(async move {
            let sql = format!("{} WHERE resource_id = $1", self.columns());
            match self.rows(&sql, &[&resource]).await?.first() {
                Some(row) => lease(row),
                None => Ok(Lease::free(resource, None)),
            }
        })
    }

    fn list<'a>(
        &'a self,
        prefix: &'a str,
        after: Option<&'a str>,
        limit: usize,
    ) -> BoxFuture<'a, Result<LeasePage, LeaseError>> {
        Box::pin(async move {
            let sql = format!(
                "{} WHERE resource_id LIKE $1 \
                   AND ($2::TEXT IS NULL OR resource_id COLLATE \"C\" > $2) \
                 ORDER BY resource_id COLLATE \"C\" LIMIT $3",
                self.columns()
            );
            let pattern = format!("{}%", like_escape(prefix));
            let fetch = i64::try_from(limit.saturating_add(1)).unwrap_or(i64::MAX);
            let rows = self.rows(&sql, &[&pattern, &after, &fetch]).await?;
            let leases = rows.iter().map(lease).collect::<Result<Vec<_>, _>>()?;
            Ok(LeasePage::of(leases, limit))
        })
    }
}
