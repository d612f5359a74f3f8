//! Maxima in etcd: one transaction per compare-and-raise, or one for a batch of them.
//!
//! Values are 20-digit zero-padded decimals, so etcd's byte-wise value comparison is numeric
//! comparison. The transaction: if the key does not exist, create it; else, in a nested
//! transaction, if the stored value is below the token, read it and overwrite it; else read
//! it. etcd applies the whole transaction atomically at one revision. A token above
//! `token.max_step` ([`Rule::floor`]) is raised by one transaction that compares the stored
//! value with both bounds (below the token, above the floor minus one; a value comparison on
//! a missing key fails, so a missing maximum is too far), reading it either way. Concurrent
//! raises without a floor share a transaction ([`super::shared::batch`]): the outer one
//! compares nothing and holds each raise's transaction nested, for its own key.
//!
//! Idempotency records live at `/{prefix}/idempotency/{resource}\x1f{key}` (the JSON of
//! [`Record::encode`]), each attached to a lease whose TTL is the record's window rounded up
//! to whole seconds, so etcd itself deletes it when the window ends. The leader times leases
//! on its monotonic clock (Go's `time.Now` carries a monotonic reading, and a lease's expiry
//! is compared through it), and a new leader restarts every lease's remaining time rather
//! than shortening it: a step of any wall clock ends no in-flight record early, so, unlike
//! Redis and PostgreSQL, in-flight records here keep their store-side expiry. A claim reads the record
//! and the maximum at one revision, runs [`idempotency::decide`] here, and writes both keys in
//! one transaction guarded by their `mod_revision`s as read (0: absent); when another writer
//! got in between, it starts over from the read, a bounded number of times.

mod admin;

use crate::fence::token::Token;
use std::sync::Arc;
use std::time::Duration;

use crate::etcd::{
    Compare, CompareOp, KvClient, LeaseClient, PutOptions, Txn, TxnOp, TxnOpResponse,
};

use super::shared::batch::Raise;
use super::shared::{Claimed, Remote};
use super::{decide, record_key, Rule, StoreError, Verdict};
use crate::conn::etcd::{client, failure};
use crate::conn::BoxFuture;
use crate::idempotency::{self, AttemptId, Begin, Claim, Record};
use crate::tls::ClientTls;

/// How many times a claim or an outcome write starts over after losing a race.
const ATTEMPTS: usize = 32;

pub struct EtcdRemote {
    /// The client keeps a balanced, lazily (re)connecting channel to the endpoints.
    kv: KvClient,
    /// Leases that expire idempotency records.
    lease: LeaseClient,
    prefix: String,
    /// Set once etcd refused a batch for its size (a `--max-txn-ops` below [`BATCH`]): raises
    /// then go one transaction each.
    unbatched: std::sync::atomic::AtomicBool,
}

impl EtcdRemote {
    /// `url`: see [`crate::conn::etcd::parse_url`].
    pub async fn connect(
        url: &str,
        prefix: &str,
        tls: Option<Arc<ClientTls>>,
    ) -> Result<Self, StoreError> {
        let client = client(url, tls).await.map_err(StoreError::config_from)?;
        Ok(EtcdRemote {
            kv: client.kv_client(),
            lease: client.lease_client(),
            prefix: prefix.to_owned(),
            unbatched: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn key(&self, resource: &str) -> String {
        format!("/{}/fences/{resource}", self.prefix)
    }

    fn record_key(&self, resource: &str, key: &str) -> String {
        format!("/{}/idempotency/{}", self.prefix, record_key(resource, key))
    }

    /// A lease that ends `window` from now (rounded up to whole seconds; etcd may raise it
    /// to its minimum TTL).
    async fn grant(&self, window: Duration) -> Result<i64, StoreError> {
        let response = self
            .lease
            .clone()
            .grant(lease_ttl(window))
            .await
            .map_err(unavailable)?;
        Ok(response.id())
    }

    /// Gives back, in the background, a lease no key is attached to any more (each lease
    /// belongs to one record write): the one granted for a write that did not happen, or the
    /// one of a record just replaced. It would expire on its own anyway.
    fn release(&self, lease: Option<i64>) {
        if let Some(id) = lease.filter(|&id| id != 0) {
            let mut client = self.lease.clone();
            tokio::spawn(async move {
                let _ = client.revoke(id).await;
            });
        }
    }

    /// The record and the maximum of a resource, read at one revision.
    async fn read(&self, record: &str, maximum: &str) -> Result<Snapshot, StoreError> {
        let txn = Txn::new().and_then([
            TxnOp::get(record.to_owned(), None),
            TxnOp::get(maximum.to_owned(), None),
        ]);
        let response = self.kv.clone().txn(txn).await.map_err(unavailable)?;
        let mut gets = response.op_responses().into_iter().filter_map(|r| match r {
            TxnOpResponse::Get(get) => Some(get),
            _ => None,
        });
        let (Some(record), Some(maximum)) = (gets.next(), gets.next()) else {
            return Err(StoreError::corrupt("etcd: malformed transaction answer"));
        };
        let (record, record_revision, record_lease) = match record.kvs().first() {
            Some(kv) => (Some(decode(kv.value())?), kv.mod_revision(), kv.lease()),
            None => (None, 0, 0),
        };
        let (current, maximum_revision) = match maximum.kvs().first() {
            Some(kv) => (Some(parse(kv.value())?), kv.mod_revision()),
            None => (None, 0),
        };
        Ok(Snapshot {
            record,
            record_revision,
            record_lease,
            current,
            maximum_revision,
        })
    }

    async fn begin(&self, resource: &str, key: &str, claim: &Claim) -> Result<Begin, StoreError> {
        let record_key = self.record_key(resource, key);
        let maximum_key = self.key(resource);
        // Granted once, on the first decision to execute, and kept across retries.
        let mut lease = None;
        for _ in 0..ATTEMPTS {
            let read = self.read(&record_key, &maximum_key).await?;
            let begin = idempotency::decide(read.record.as_ref(), read.current, claim);
            if !matches!(begin, Begin::Execute { .. }) {
                self.release(lease);
                return Ok(begin);
            }
            let id = match lease {
                Some(id) => id,
                None => *lease.insert(self.grant(claim.window).await?),
            };
            let record = claim.in_flight().encode();
            let mut puts = vec![TxnOp::put(
                record_key.clone(),
                record,
                Some(PutOptions::new().with_lease(id)),
            )];
            if read.current.is_none_or(|c| claim.token > c) {
                puts.push(TxnOp::put(maximum_key.clone(), padded(claim.token), None));
            }
            let txn = Txn::new()
                .when([
                    Compare::mod_revision(
                        record_key.clone(),
                        CompareOp::Equal,
                        read.record_revision,
                    ),
                    Compare::mod_revision(
                        maximum_key.clone(),
                        CompareOp::Equal,
                        read.maximum_revision,
                    ),
                ])
                .and_then(puts);
            let response = self.kv.clone().txn(txn).await.map_err(unavailable)?;
            if response.succeeded() {
                self.release(Some(read.record_lease));
                return Ok(begin);
            }
        }
        self.release(lease);
        Err(StoreError::contended(format!(
            "etcd: the idempotency record of {resource} changed under {ATTEMPTS} attempts"
        )))
    }

    async fn finish(
        &self,
        resource: &str,
        key: &str,
        claim: &Claim,
        outcome: &Record,
    ) -> Result<bool, StoreError> {
        let record_key = self.record_key(resource, key);
        let mut lease = None;
        for _ in 0..ATTEMPTS {
            let response = self
                .kv
                .clone()
                .get(record_key.clone(), None)
                .await
                .map_err(unavailable)?;
            let Some(kv) = response.kvs().first() else {
                self.release(lease);
                return Ok(false);
            };
            // Only the attempt that claimed the record: the transaction below is guarded by
            // the revision this was read at.
            if !decode(kv.value())?.owned_by(claim) {
                self.release(lease);
                return Ok(false);
            }
            let id = match lease {
                Some(id) => id,
                None => *lease.insert(self.grant(claim.window).await?),
            };
            let txn = Txn::new()
                .when([Compare::mod_revision(
                    record_key.clone(),
                    CompareOp::Equal,
                    kv.mod_revision(),
                )])
                .and_then([TxnOp::put(
                    record_key.clone(),
                    outcome.encode(),
                    Some(PutOptions::new().with_lease(id)),
                )]);
            let response = self.kv.clone().txn(txn).await.map_err(unavailable)?;
            if response.succeeded() {
                self.release(Some(kv.lease()));
                return Ok(true);
            }
        }
        self.release(lease);
        Err(StoreError::contended(format!(
            "etcd: the idempotency record of {resource} changed under {ATTEMPTS} attempts"
        )))
    }
}

/// What a claim decides on: the record (present means live: etcd deletes expired ones) and
/// the maximum, with the revisions the write is guarded by (0: absent).
struct Snapshot {
    record: Option<Record>,
    record_revision: i64,
    /// The lease the record is attached to (0: none), given back once it is replaced.
    record_lease: i64,
    current: Option<Token>,
    maximum_revision: i64,
}

/// The lease TTL for a window: whole seconds, rounded up, at least one.
fn lease_ttl(window: Duration) -> i64 {
    let seconds = window.as_nanos().div_ceil(1_000_000_000).max(1);
    i64::try_from(seconds).unwrap_or(i64::MAX)
}

fn decode(value: &[u8]) -> Result<Record, StoreError> {
    Record::decode(value).map_err(|e| StoreError::corrupt(format!("etcd: {e}")))
}

fn unavailable(e: crate::etcd::Error) -> StoreError {
    StoreError::new(failure(&e), format!("etcd: {e}")).with_source(e)
}

fn padded(token: Token) -> String {
    format!("{token:020}")
}

fn parse(value: &[u8]) -> Result<Token, StoreError> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|s| s.parse().ok())
        .and_then(Token::new)
        .ok_or_else(|| StoreError::corrupt("etcd holds a non-token maximum"))
}

/// Raises in one transaction at most: etcd refuses a transaction of more than
/// `--max-txn-ops` operations in any branch (128 by default).
const BATCH: usize = 64;

/// What etcd answers to a transaction of more operations than its `--max-txn-ops`.
const TOO_MANY_OPS: &str = "too many operations in txn request";

/// The raise of `key` to `value` with no floor: if the key does not exist, create it; else,
/// in a nested transaction, if the stored value is below, read it and overwrite it; else read
/// it.
fn raise_txn(key: String, value: String) -> Txn {
    let existing = Txn::new()
        .when([Compare::value(key.clone(), CompareOp::Less, value.clone())])
        .and_then([
            TxnOp::get(key.clone(), None),
            TxnOp::put(key.clone(), value.clone(), None),
        ])
        .or_else([TxnOp::get(key.clone(), None)]);
    Txn::new()
        .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
        .and_then([TxnOp::put(key, value, None)])
        .or_else([TxnOp::txn(existing)])
}

/// The verdict of `token` from the answer to its [`raise_txn`]: whether it succeeded (the key
/// was created) and its operations' answers.
fn raise_verdict(
    created: bool,
    answers: Vec<TxnOpResponse>,
    token: Token,
    rule: Rule,
) -> Result<Verdict, StoreError> {
    if created {
        return Ok(Verdict::Admitted { previous: None });
    }
    let inner = answers
        .into_iter()
        .find_map(|r| match r {
            TxnOpResponse::Txn(inner) => Some(inner),
            _ => None,
        })
        .ok_or_else(|| StoreError::corrupt("etcd: malformed transaction answer"))?;
    let current = read_value(&inner.op_responses())?;
    if inner.succeeded() {
        Ok(Verdict::Admitted { previous: current })
    } else {
        Ok(decide(current, token, rule))
    }
}

/// The value read by the first `Get` among transaction responses.
fn read_value(responses: &[TxnOpResponse]) -> Result<Option<Token>, StoreError> {
    for response in responses {
        if let TxnOpResponse::Get(get) = response {
            return get.kvs().first().map(|kv| parse(kv.value())).transpose();
        }
    }
    Ok(None)
}

impl Remote for EtcdRemote {
    fn raise<'a>(
        &'a self,
        resource: &'a str,
        token: Token,
        rule: Rule,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>> {
        Box::pin(async move {
            let key = self.key(resource);
            let value = padded(token);
            if let Some(floor) = rule.floor(token) {
                let txn = Txn::new()
                    .when([
                        Compare::value(key.clone(), CompareOp::Less, value.clone()),
                        // floor >= 1: above floor - 1 is at least the floor.
                        Compare::value(
                            key.clone(),
                            CompareOp::Greater,
                            padded(floor.checked_sub(1).unwrap_or(Token::ZERO)),
                        ),
                    ])
                    .and_then([
                        TxnOp::get(key.clone(), None),
                        TxnOp::put(key.clone(), value, None),
                    ])
                    .or_else([TxnOp::get(key, None)]);
                let response = self.kv.clone().txn(txn).await.map_err(unavailable)?;
                let current = read_value(&response.op_responses())?;
                return Ok(if response.succeeded() {
                    Verdict::Admitted { previous: current }
                } else {
                    decide(current, token, rule)
                });
            }
            let response = self
                .kv
                .clone()
                .txn(raise_txn(key, value))
                .await
                .map_err(unavailable)?;
            raise_verdict(response.succeeded(), response.op_responses(), token, rule)
        })
    }

    fn batch_limit(&self) -> usize {
        if self.unbatched.load(std::sync::atomic::Ordering::Relaxed) {
            1
        } else {
            BATCH
        }
    }

    fn raise_many<'a>(
        &'a self,
        raises: &'a [Raise],
    ) -> BoxFuture<'a, Result<Vec<Result<Verdict, StoreError>>, StoreError>> {
        use std::sync::atomic::Ordering::Relaxed;
        Box::pin(async move {
            // Each raise a nested transaction of its own, so each compares and writes its own
            // key; the outer one, with no comparison, runs them all at one revision.
            let txn = Txn::new().and_then(
                raises
                    .iter()
                    .map(|r| TxnOp::txn(raise_txn(self.key(&r.resource), padded(r.token))))
                    .collect::<Vec<_>>(),
            );
            let response = match self.kv.clone().txn(txn).await {
                Ok(response) => response,
                Err(e) if e.to_string().contains(TOO_MANY_OPS) => {
                    // Nothing was applied: etcd checks the size before it proposes. The raises
                    // are sent again, each alone, and so is every raise from now on.
                    if !self.unbatched.swap(true, Relaxed) {
                        tracing::warn!(
                            error = %e,
                            "etcd refused {} raises in one transaction (its --max-txn-ops is \
                             below {BATCH}): raises go one transaction each from now on",
                            raises.len()
                        );
                    }
                    return Err(unavailable(e));
                }
                Err(e) => return Err(unavailable(e)),
            };
            // A short answer makes a short list, which the queue refuses raise by raise.
            Ok(raises
                .iter()
                .zip(response.op_responses())
                .map(|(r, answer)| match answer {
                    TxnOpResponse::Txn(one) => {
                        raise_verdict(one.succeeded(), one.op_responses(), r.token, r.rule)
                    }
                    _ => Err(StoreError::corrupt("etcd: malformed transaction answer")),
                })
                .collect())
        })
    }

    fn get<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<Token>, StoreError>> {
        Box::pin(async move {
            let response = self
                .kv
                .clone()
                .get(self.key(resource), None)
                .await
                .map_err(unavailable)?;
            response
                .kvs()
                .first()
                .map(|kv| parse(kv.value()))
                .transpose()
        })
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            // A key of the prefix: a user limited to it may read nothing else.
            self.kv
                .clone()
                .get(
                    format!("/{}/", self.prefix),
                    Some(crate::etcd::GetOptions::new().with_count_only()),
                )
                .await
                .map_err(unavailable)?;
            Ok(())
        })
    }

    fn begin_idempotent<'a>(
        &'a self,
        resource: &'a str,
        key: &'a str,
        claim: &'a Claim,
        _takeover: Option<AttemptId>,
    ) -> BoxFuture<'a, Result<Claimed, StoreError>> {
        // etcd deletes an in-flight record itself when its lease ends: it names no owner, so
        // nothing is ever taken over.
        Box::pin(async move { self.begin(resource, key, claim).await.map(Claimed::from) })
    }

    fn finish_idempotent<'a>(
        &'a self,
        resource: &'a str,
        key: &'a str,
        claim: &'a Claim,
        outcome: &'a Record,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.finish(resource, key, claim, outcome))
    }

    fn kind(&self) -> &'static str {
        "etcd"
    }

    fn reset_generation(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(self.read_resets())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_orders_like_numbers() {
        assert!(padded(9.into()) < padded(10.into()));
        assert!(padded(Token::MAX.checked_sub(1).unwrap()) < padded(Token::MAX));
        assert_eq!(padded(Token::MAX).len(), 20);
        assert_eq!(parse(padded(42.into()).as_bytes()).unwrap(), 42.into());
    }

    #[test]
    fn lease_ttl_rounds_up_to_seconds() {
        assert_eq!(lease_ttl(Duration::from_millis(1)), 1);
        assert_eq!(lease_ttl(Duration::ZERO), 1);
        assert_eq!(lease_ttl(Duration::from_secs(1)), 1);
        assert_eq!(lease_ttl(Duration::from_millis(1001)), 2);
        assert_eq!(lease_ttl(Duration::from_secs(86_400)), 86_400);
    }
}
