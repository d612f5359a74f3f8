//! Idempotency records in PostgreSQL: the statements, a claim in one transaction (advisory
//! lock, takeover, record, locked maximum, [`idempotency::decide`], raise and `in_flight`
//! row), an outcome in one conditional `UPDATE`, and the purge of expired rows (see the
//! module documentation of [`super`]).

use std::time::Duration;

use tokio::time::Instant;

use deadpool_postgres::Pool;
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use super::{encoded, failed, token_of, PostgresRemote};
use crate::conn::postgres::Guard;
use crate::idempotency::{self, AttemptId, Begin, Claim, Record};
use crate::store::record_key;
use crate::store::shared::{Claimed, Owner};
use crate::store::StoreError;

/// How often a claim may start a purge of expired records (and the health probe a pass
/// forgetting maxima, [`super::retention`]).
pub(super) const PURGE_EVERY: Duration = Duration::from_secs(60);

/// Whether a background pass whose last start is in `last` may start now (at most once per
/// [`PURGE_EVERY`], or at once with `force`); if so, records this start.
pub(super) fn pass_due(last: &std::sync::Mutex<Option<Instant>>, force: bool) -> bool {
    let mut last = last
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if !force && last.is_some_and(|at| at.elapsed() < PURGE_EVERY) {
        return false;
    }
    *last = Some(Instant::now());
    true
}
/// Rows one purge statement deletes at most, so no purge holds many row locks for long.
pub(super) const PURGE_BATCH: i64 = 1000;
/// Claims retried when a racing first raise created the maximum between read and insert.
const CLAIM_ATTEMPTS: usize = 3;

/// The statements of idempotency records.
pub(super) struct IdempotencySql {
    lock: String,
    takeover: String,
    read: String,
    lock_max: String,
    insert_max: String,
    update_max: String,
    write: String,
    finish: String,
    purge: String,
}

impl IdempotencySql {
    pub(super) fn new(fences: &str, records: &str) -> Self {
        IdempotencySql {
            lock: "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))".to_owned(),
            takeover: format!(
                "DELETE FROM {records} \
                 WHERE resource = $1 AND idem_key = $2 AND phase = 'i' AND attempt = $3"
            ),
            read: format!(
                "SELECT record, attempt, in_flight_ms FROM {records} \
                 WHERE resource = $1 AND idem_key = $2 AND expires_at > now()"
            ),
            lock_max: format!("SELECT max_token FROM {fences} WHERE resource = $1 FOR UPDATE"),
            insert_max: format!(
                "INSERT INTO {fences} (resource, max_token, prev_token, raised_at) \
                 VALUES ($1, $2, NULL, CASE WHEN $3 THEN now() END) \
                 ON CONFLICT (resource) DO NOTHING RETURNING max_token"
            ),
            update_max: format!(
                "UPDATE {fences} SET max_token = $2, prev_token = max_token, \
                   raised_at = CASE WHEN $3 THEN now() END \
                 WHERE resource = $1 AND max_token < $2"
            ),
            write: format!(
                "INSERT INTO {records} \
                   (resource, idem_key, phase, token, fingerprint, record, expires_at, attempt, \
                    in_flight_ms) \
                 VALUES ($1, $2, 'i', $3, $4, $5, 'infinity', $6, $7) \
                 ON CONFLICT (resource, idem_key) DO UPDATE \
                 SET phase = EXCLUDED.phase, token = EXCLUDED.token, \
                     fingerprint = EXCLUDED.fingerprint, record = EXCLUDED.record, \
                     expires_at = EXCLUDED.expires_at, attempt = EXCLUDED.attempt, \
                     in_flight_ms = EXCLUDED.in_flight_ms"
            ),
            finish: format!(
                "UPDATE {records} \
                 SET phase = $3, token = $4, fingerprint = $5, record = $6, \
                     expires_at = now() + make_interval(secs => $7), attempt = NULL, \
                     in_flight_ms = NULL \
                 WHERE resource = $1 AND idem_key = $2 AND expires_at > now() \
                   AND phase = 'i' AND token = $8 AND fingerprint = $9 AND attempt = $10"
            ),
            purge: format!(
                "DELETE FROM {records} \
                 WHERE ctid = ANY (ARRAY(\
                   SELECT ctid FROM {records} WHERE expires_at < now() LIMIT $1)) \
                   AND expires_at < now()"
            ),
        }
    }
}

impl PostgresRemote {
    /// [`Remote::begin_idempotent`]: claims, trying again while a racing first raise keeps
    /// creating the maximum under it.
    pub(super) async fn begin(
        &self,
        resource: &str,
        key: &str,
        claim: &Claim,
        takeover: Option<AttemptId>,
    ) -> Result<Claimed, StoreError> {
        let mut client = self.client().await?;
        for _ in 0..CLAIM_ATTEMPTS {
            let claimed = self
                .try_begin(&mut client, resource, key, claim, takeover)
                .await?;
            if let Some(claimed) = claimed {
                self.maybe_purge();
                return Ok(claimed);
            }
        }
        Err(StoreError::contended(
            "postgres: the maximum kept appearing under an idempotent claim",
        ))
    }

    /// [`Remote::finish_idempotent`]: one conditional `UPDATE`.
    pub(super) async fn finish(
        &self,
        resource: &str,
        key: &str,
        claim: &Claim,
        outcome: &Record,
    ) -> Result<bool, StoreError> {
        let client = self.client().await?;
        let statement = client
            .prepare_cached(&self.idem.finish)
            .await
            .map_err(|e| self.failed(&e))?;
        let written = client
            .execute(
                &statement,
                &[
                    &resource,
                    &key,
                    &outcome.phase.code(),
                    &outcome.token.to_i64(),
                    &outcome.fingerprint.hex(),
                    &encoded(outcome),
                    &claim.window.as_secs_f64(),
                    &claim.token.to_i64(),
                    &claim.fingerprint.hex(),
                    &claim.attempt.hex(),
                ],
            )
            .await
            .map_err(|e| self.failed(&e))?;
        Ok(written == 1)
    }

    /// One claim attempt in one transaction. `None`: a racing first raise created the
    /// resource's maximum after it was read as absent; nothing was written, try again.
    async fn try_begin(
        &self,
        client: &mut deadpool_postgres::Object,
        resource: &str,
        key: &str,
        claim: &Claim,
        takeover: Option<AttemptId>,
    ) -> Result<Option<Claimed>, StoreError> {
        let sql = &self.idem;
        let token = claim.token.to_i64();
        let tx = Tx(
            client.transaction().await.map_err(|e| self.failed(&e))?,
            &self.guard,
        );
        // Serialises claims of one key, also while no row exists for it yet.
        let lock = format!("{}\u{1f}{}", self.records, record_key(resource, key));
        tx.execute(&sql.lock, &[&lock]).await?;
        // Only the row of the attempt named, still in flight; rolled back with the claim.
        let took_over = match takeover {
            Some(attempt) => {
                let attempt = attempt.hex();
                tx.execute(&sql.takeover, &[&resource, &key, &attempt])
                    .await?
                    == 1
            }
            None => false,
        };
        let found = tx.query_opt(&sql.read, &[&resource, &key]).await?;
        let existing = found
            .as_ref()
            .map(|row| {
                Record::decode(row.get::<_, &str>(0).as_bytes())
                    .map_err(|e| StoreError::corrupt(format!("postgres holds a {e}")))
            })
            .transpose()?;
        // Locked, so no other raise moves the maximum between this read and the raise below.
        let current = tx
            .query_opt(&sql.lock_max, &[&resource])
            .await?
            .map(|row| token_of(row.get(0)))
            .transpose()?;
        let begin = idempotency::decide(existing.as_ref(), current, claim);
        // A row without a readable attempt is nobody's: no takeover, it keeps its expiry.
        let owner = match (&begin, &found) {
            (Begin::InFlight, Some(row)) => row
                .get::<_, Option<&str>>(1)
                .and_then(AttemptId::from_hex)
                .map(|attempt| Owner {
                    attempt,
                    lifetime: row
                        .get::<_, Option<i64>>(2)
                        .and_then(|ms| u64::try_from(ms).ok())
                        .map(Duration::from_millis),
                }),
            _ => None,
        };
        if let Begin::Execute { .. } = begin {
            match current {
                None => {
                    let inserted = tx
                        .query_opt(&sql.insert_max, &[&resource, &token, &self.aging()])
                        .await?;
                    if inserted.is_none() {
                        tx.0.rollback().await.map_err(|e| self.failed(&e))?;
                        return Ok(None);
                    }
                }
                Some(c) if claim.token > c => {
                    tx.execute(&sql.update_max, &[&resource, &token, &self.aging()])
                        .await?;
                }
                Some(_) => {}
            }
            let record = claim.in_flight();
            let attempt = claim.attempt.hex();
            let lifetime = i64::try_from(claim.window.as_millis()).unwrap_or(i64::MAX);
            let params: [&(dyn ToSql + Sync); 7] = [
                &resource,
                &key,
                &token,
                &record.fingerprint.hex(),
                &encoded(&record),
                &attempt,
                &lifetime,
            ];
            tx.execute(&sql.write, &params).await?;
        }
        tx.0.commit().await.map_err(|e| self.failed(&e))?;
        Ok(Some(Claimed {
            begin,
            owner,
            took_over,
        }))
    }

    /// Starts a purge of expired records in the background, at most once per [`PURGE_EVERY`].
    fn maybe_purge(&self) {
        if !pass_due(&self.last_purge, false) {
            return;
        }
        let pool = self.pool.clone();
        let sql = self.idem.purge.clone();
        tokio::spawn(async move {
            if let Err(e) = purge(&pool, &sql).await {
                tracing::warn!(error = %e, "purging expired idempotency records failed");
            }
        });
    }
}

/// A transaction whose statements are prepared once per connection.
struct Tx<'a>(deadpool_postgres::Transaction<'a>, &'a Guard);

impl Tx<'_> {
    async fn execute(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<u64, StoreError> {
        let statement = self.0.prepare_cached(sql).await.map_err(|e| {
            self.1.note(&e);
            failed(&e)
        })?;
        self.0.execute(&statement, params).await.map_err(|e| {
            self.1.note(&e);
            failed(&e)
        })
    }

    async fn query_opt(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, StoreError> {
        let statement = self.0.prepare_cached(sql).await.map_err(|e| {
            self.1.note(&e);
            failed(&e)
        })?;
        self.0.query_opt(&statement, params).await.map_err(|e| {
            self.1.note(&e);
            failed(&e)
        })
    }
}

/// Deletes expired records batch by batch: each batch's row ids come from the `expires_at`
/// index, and a row renewed meanwhile fails the outer re-check and stays.
async fn purge(pool: &Pool, sql: &str) -> Result<u64, StoreError> {
    let client = pool.get().await.map_err(|e| failed(&e))?;
    let mut deleted = 0;
    loop {
        let n = client
            .execute(sql, &[&PURGE_BATCH])
            .await
            .map_err(|e| failed(&e))?;
        deleted += n;
        if n < PURGE_BATCH as u64 {
            return Ok(deleted);
        }
    }
}
