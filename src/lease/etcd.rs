//! Leases in etcd: an etcd lease per grant, a lock key attached to it, and the key's create
//! revision as the fencing token.
//!
//! Keys: the lock `/<prefix>/leases/<resource>/lock` (value: holder, attached to the grant's
//! etcd lease) and `/<prefix>/leases/<resource>/last` (value: holder, no lease), both written by
//! the one grant transaction: `if create_revision(lock) == 0 then put(lock, lease) put(last)
//! else get(lock)`.
//!
//! - token: the revision of that transaction, which is the lock key's create revision and the
//!   `last` key's mod revision. etcd revisions only grow, cluster-wide and across restarts, so
//!   tokens are strictly increasing per resource (with gaps). `latest_token` reads `last`'s mod
//!   revision, which survives release and expiry (nothing else writes `last`).
//! - lease id: the etcd lease id, in decimal.
//! - TTL: etcd leases count whole seconds, so the requested TTL is rounded up (at least 1s), and
//!   servers raise short TTLs to their minimum (about 2s with default election settings). The
//!   etcd lease can therefore outlive the requested TTL; that is safe, because the agent's local
//!   deadline is based on the requested TTL. Expiry is etcd's (server-side, with its own lease
//!   checkpointing across leader changes).
//! - renew: one `LeaseKeepAlive` round trip, which resets the etcd lease to its granted TTL (so
//!   a renewal cannot lengthen it: asking for more than was granted is an error), then a check
//!   that the lock key is still attached to the lease. An expired lease cannot be kept alive.
//! - release: delete the lock key if it is attached to the grant's lease (one transaction), then
//!   revoke the lease.
//!
//! Events: `changed()` watches the lock key for delete events (release, revoke and expiry all
//! delete it), from the revision just after it saw the key held, so none is missed.
//!
//! Grant events: one watch per backend, started by the first `grant_events()`, on the prefix
//! `/<prefix>/leases/` for puts: a put of a `last` key is a grant of its resource. It is `Live`
//! once etcd confirmed the watch's creation. Every [`HEARTBEAT`] it asks for a progress
//! notification on the same stream; a stream that ends, fails, is cancelled (compaction) or
//! leaves a progress request unanswered for a heartbeat counts as lost (`Lost`), and the watch
//! is created again every half second until etcd answers.

mod admin;

use crate::fence::token::Token;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::etcd::{
    Compare, CompareOp, EventType, KvClient, LeaseClient, LeaseTimeToLiveOptions, PutOptions, Txn,
    TxnOp, TxnOpResponse, WatchClient, WatchFilterType, WatchOptions,
};

use super::backend::{Acquired, Grant, GrantEvents, LeaseBackend, LeaseError};
use super::shared::{GrantFeed, HEARTBEAT};
use crate::conn::BoxFuture;
use crate::tls::ClientTls;

pub struct EtcdLeases {
    /// The clients share one balanced, lazily (re)connecting channel.
    kv: KvClient,
    lease: LeaseClient,
    watch: WatchClient,
    prefix: String,
    grants: Arc<GrantFeed>,
    /// The grant watch, started by the first `grant_events()`.
    grant_watch: OnceLock<GrantWatch>,
}

struct GrantWatch(tokio::task::AbortHandle);

impl Drop for GrantWatch {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl EtcdLeases {
    /// `url`: `etcd://`, `http://` or (with `tls`) `https://` endpoints, comma-separated, with
    /// `user:password@` to authenticate.
    pub async fn connect(
        url: &str,
        prefix: &str,
        tls: Option<Arc<ClientTls>>,
    ) -> Result<Self, LeaseError> {
        let client = crate::conn::etcd::client(url, tls)
            .await
            .map_err(LeaseError::config_from)?;
        Ok(EtcdLeases {
            kv: client.kv_client(),
            lease: client.lease_client(),
            watch: client.watch_client(),
            prefix: prefix.to_owned(),
            grants: Arc::new(GrantFeed::new(false)),
            grant_watch: OnceLock::new(),
        })
    }

    fn lock_key(&self, resource: &str) -> String {
        format!("/{}/leases/{resource}/lock", self.prefix)
    }

    fn last_key(&self, resource: &str) -> String {
        format!("/{}/leases/{resource}/last", self.prefix)
    }

    fn leases_prefix(&self) -> String {
        format!("/{}/leases/", self.prefix)
    }

    /// Best effort: a lease nobody uses expires by itself anyway.
    async fn revoke(&self, id: i64) {
        if let Err(e) = self.lease.clone().revoke(id).await {
            tracing::debug!(lease = id, error = %e, "etcd lease revoke failed");
        }
    }
}

/// Keeps one watch on the leases prefix, announcing grants, recreating it when it breaks.
async fn watch_grants(watch: WatchClient, prefix: String, grants: Arc<GrantFeed>) {
    loop {
        let options = WatchOptions::new()
            .with_prefix()
            .with_filters([WatchFilterType::NoDelete]);
        match watch.clone().watch(prefix.clone(), Some(options)).await {
            Ok(stream) => {
                let (mut requests, mut responses) = stream.split();
                // The first answer confirms the watch: grants from here on are delivered.
                let created = tokio::time::timeout(HEARTBEAT * 2, responses.message()).await;
                if matches!(created, Ok(Ok(Some(ref r))) if r.created() && !r.canceled()) {
                    grants.live();
                    let mut heartbeat = tokio::time::interval(HEARTBEAT);
                    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    // A progress request not answered yet: anything on the stream answers it.
                    let mut asked = false;
                    loop {
                        tokio::select! {
                            message = responses.message() => match message {
                                Ok(Some(response)) if !response.canceled() => {
                                    asked = false;
                                    for event in response.events() {
                                        if event.event_type() != EventType::Put {
                                            continue;
                                        }
                                        let resource = event
                                            .kv()
                                            .and_then(|kv| kv.key_str().ok())
                                            .and_then(|k| k.strip_prefix(prefix.as_str()))
                                            .and_then(|k| k.strip_suffix("/last"));
                                        if let Some(resource) = resource {
                                            grants.changed(resource);
                                        }
                                    }
                                }
                                _ => break,
                            },
                            _ = heartbeat.tick() => {
                                if asked || requests.request_progress().await.is_err() {
                                    break;
                                }
                                asked = true;
                            }
                        }
                    }
                    grants.lost();
                    tracing::debug!("etcd grant watch lost; watching again");
                }
            }
            Err(e) => tracing::debug!(error = %e, "etcd grant watch cannot start"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn unavailable(e: crate::etcd::Error) -> LeaseError {
    LeaseError::new(crate::conn::etcd::failure(&e), format!("etcd: {e}")).with_source(e)
}

/// Whole seconds, rounded up, at least one.
fn ttl_secs(ttl: Duration) -> i64 {
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    i64::try_from(secs.max(1)).unwrap_or(i64::MAX)
}

fn token_of(revision: i64) -> Result<Token, LeaseError> {
    Token::try_from(revision)
        .ok()
        .filter(|&t| t > Token::ZERO)
        .ok_or_else(|| LeaseError::corrupt(format!("etcd answered revision {revision}")))
}

impl LeaseBackend for EtcdLeases {
    fn try_acquire<'a>(
        &'a self,
        resource: &'a str,
        holder: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LeaseError>> {
        Box::pin(async move {
            let lease_id = self
                .lease
                .clone()
                .grant(ttl_secs(ttl))
                .await
                .map_err(unavailable)?
                .id();
            let lock = self.lock_key(resource);
            let txn = Txn::new()
                .when([Compare::create_revision(lock.clone(), CompareOp::Equal, 0)])
                .and_then([
                    TxnOp::put(
                        lock.clone(),
                        holder,
                        Some(PutOptions::new().with_lease(lease_id)),
                    ),
                    TxnOp::put(self.last_key(resource), holder, None),
                ])
                .or_else([TxnOp::get(lock, None)]);
            let response = match self.kv.clone().txn(txn).await {
                Ok(response) => response,
                Err(e) => {
                    self.revoke(lease_id).await;
                    return Err(unavailable(e));
                }
            };
            if response.succeeded() {
                let revision = response.header().map_or(0, |h| h.revision());
                return Ok(Acquired::Granted(Grant {
                    resource: resource.to_owned(),
                    holder: holder.to_owned(),
                    lease_id: lease_id.to_string(),
                    token: token_of(revision)?,
                }));
            }
            self.revoke(lease_id).await;
            let holder = response.op_responses().into_iter().find_map(|r| match r {
                TxnOpResponse::Get(get) => get
                    .kvs()
                    .first()
                    .and_then(|kv| kv.value_str().ok().map(str::to_owned)),
                _ => None,
            });
            Ok(Acquired::Held { holder })
        })
    }

    fn renew<'a>(
        &'a self,
        grant: &'a Grant,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, LeaseError>> {
        Box::pin(async move {
            let Ok(id) = grant.lease_id.parse::<i64>() else {
                return Ok(false);
            };
            let mut lease = self.lease.clone();
            // One request, one answer; the client reports a TTL of 0 (expired) as this error.
            match lease.keep_alive(id).await {
                Ok(_) => {}
                Err(crate::etcd::Error::LeaseKeepAlive(_)) => return Ok(false),
                Err(e) => return Err(unavailable(e)),
            }
            let status = lease
                .time_to_live(id, Some(LeaseTimeToLiveOptions::new().with_keys()))
                .await
                .map_err(unavailable)?;
            let lock = self.lock_key(&grant.resource);
            if status.ttl() <= 0 || !status.keys().iter().any(|k| *k == lock.as_bytes()) {
                return Ok(false);
            }
            if status.granted_ttl() < ttl_secs(ttl) {
                return Err(LeaseError::refused(format!(
                    "the etcd lease was granted for {}s and cannot be renewed for {ttl:?}",
                    status.granted_ttl()
                )));
            }
            Ok(true)
        })
    }

    fn release<'a>(&'a self, grant: &'a Grant) -> BoxFuture<'a, Result<bool, LeaseError>> {
        Box::pin(async move {
            let Ok(id) = grant.lease_id.parse::<i64>() else {
                return Ok(false);
            };
            let lock = self.lock_key(&grant.resource);
            let txn = Txn::new()
                .when([Compare::lease(lock.clone(), CompareOp::Equal, id)])
                .and_then([TxnOp::delete(lock)]);
            let response = self.kv.clone().txn(txn).await.map_err(unavailable)?;
            if response.succeeded() {
                self.revoke(id).await;
            }
            Ok(response.succeeded())
        })
    }

    fn latest_token<'a>(
        &'a self,
        resource: &'a str,
    ) -> BoxFuture<'a, Result<Option<Token>, LeaseError>> {
        Box::pin(async move {
            let response = self
                .kv
                .clone()
                .get(self.last_key(resource), None)
                .await
                .map_err(unavailable)?;
            response
                .kvs()
                .first()
                .map(|kv| token_of(kv.mod_revision()))
                .transpose()
        })
    }

    fn changed<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let lock = self.lock_key(resource);
            let Ok(seen) = self.kv.clone().get(lock.clone(), None).await else {
                // etcd unreachable: the waiter's backoff wakes it.
                return std::future::pending().await;
            };
            if seen.kvs().is_empty() {
                return;
            }
            // From the revision after the read: a delete between the read and the watch's
            // creation is still delivered.
            let after = seen.header().map_or(0, |h| h.revision()) + 1;
            let options = WatchOptions::new()
                .with_start_revision(after)
                .with_filters([WatchFilterType::NoPut]);
            let Ok(mut stream) = self.watch.clone().watch(lock, Some(options)).await else {
                return std::future::pending().await;
            };
            loop {
                match stream.message().await {
                    Ok(Some(response)) => {
                        if response
                            .events()
                            .iter()
                            .any(|e| e.event_type() == EventType::Delete)
                        {
                            return;
                        }
                        if response.canceled() {
                            // Compacted past `after`: the key may be gone; let the waiter look.
                            return;
                        }
                    }
                    // The stream broke: fall back to the waiter's backoff.
                    Ok(None) | Err(_) => return std::future::pending().await,
                }
            }
        })
    }

    fn grant_events(&self) -> GrantEvents {
        let events = self.grants.subscribe();
        self.grant_watch.get_or_init(|| {
            GrantWatch(
                tokio::spawn(watch_grants(
                    self.watch.clone(),
                    self.leases_prefix(),
                    Arc::clone(&self.grants),
                ))
                .abort_handle(),
            )
        });
        events
    }

    fn kind(&self) -> &'static str {
        "etcd"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_rounds_up_to_whole_seconds() {
        assert_eq!(ttl_secs(Duration::from_millis(1)), 1);
        assert_eq!(ttl_secs(Duration::from_millis(1000)), 1);
        assert_eq!(ttl_secs(Duration::from_millis(1001)), 2);
        assert_eq!(ttl_secs(Duration::from_millis(1500)), 2);
        assert_eq!(ttl_secs(Duration::ZERO), 1);
    }
}
