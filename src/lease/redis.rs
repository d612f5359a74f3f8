//! Leases in Redis: `SET NX PX` semantics and a per-resource `INCR` counter, each step one Lua
//! script so that it is atomic on the server.
//!
//! Keys, hash-tagged so that both keys of one resource land in one Redis Cluster slot:
//! - `<prefix>:{<resource>}:lease`: `<lease_id>|<token>|<holder>`, with a millisecond TTL
//!   (Redis expires it on the server clock);
//! - `<prefix>:{<resource>}:token`: the grant counter, raised only by a grant (the acquire script
//!   checks the lease is free before `INCR`), never expiring, so tokens grow across release and
//!   expiry and across restarts as far as the server's persistence (AOF) keeps writes.
//!
//! Tokens never pass through Lua numbers (doubles, exact only to 2^53): the script reads the
//! counter back as a string after `INCR`.
//!
//! Events: the release script publishes on `<prefix>:{<resource>}:released`, the acquire
//! script on `<prefix>:{<resource>}:granted` (with the new token) when it grants. One RESP3
//! connection per backend, started by the first `changed()` or `grant_events()`, holds pattern
//! subscriptions to `<prefix>:{*}:released` (waking the resource's waiters) and
//! `<prefix>:{*}:granted` (grant events). Expiry publishes nothing (keyspace notifications need
//! server configuration), so waiters for an expiring lease wake at the end of their backoff.
//!
//! A task keeps that connection: it pings it every [`HEARTBEAT`] and counts it lost when it
//! closes or a ping is not answered within [`HEARTBEAT`]; then it wakes every waiter once (since
//! releases may have been missed), sends `Lost`, and reconnects every half second until the
//! subscriptions are confirmed again, which sends `Live`. `changed()` waits while the
//! connection is not subscribed; the waiter's backoff wakes it meanwhile. A release in the
//! moment before the subscription is restored is left to backoff.
//!
//! Both connections are made by [`RedisTarget`] (TCP, or TLS for a `rediss://` url, with the
//! `tls` mapping's files as they are at each new connection); when connecting starts failing,
//! one line says why, and one more when it works again.

mod admin;

use crate::fence::token::Token;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use redis::{AsyncConnectionConfig, ProtocolVersion, PushInfo, PushKind, Script, Value};
use tokio::sync::{mpsc, watch};

use super::backend::{Acquired, Grant, GrantEvents, LeaseBackend, LeaseError};
use super::shared::{self, new_lease_id, GrantFeed, Waiters, HEARTBEAT};
use crate::config::RedisHa;
use crate::conn::redis::{failure, RedisClient, RedisTarget, Unconfirmed};
use crate::conn::BoxFuture;
use crate::tls::ClientTls;

/// KEYS[1] = lease, KEYS[2] = counter, KEYS[3] = the replication id of the server the
/// resource's last grant was made on; ARGV[1] = lease id, ARGV[2] = holder, ARGV[3] = ttl ms,
/// ARGV[4] = grant channel, ARGV[5] = this server's replication id ('' if unknown), ARGV[6] =
/// '1' if this server was promoted, ARGV[7] = [`EPOCH_GAP`]. Returns {1, token} when granted,
/// {0, current lease value} when held.
///
/// A grant on a server other than the last grant's (a promoted replica, which may lack the
/// grants its old primary made last), or the first grant of a resource on a promoted server,
/// first moves the counter on by the gap, so that no token granted now can equal one granted
/// before the failover.
const ACQUIRE: &str = r"
local current = redis.call('GET', KEYS[1])
if current then
  return {0, current}
end
if ARGV[5] ~= '' then
  local last = redis.call('GET', KEYS[3])
  if (last and last ~= ARGV[5]) or (not last and ARGV[6] == '1') then
    redis.call('INCRBY', KEYS[2], ARGV[7])
  end
  if last ~= ARGV[5] then
    redis.call('SET', KEYS[3], ARGV[5])
  end
end
redis.call('INCR', KEYS[2])
local token = redis.call('GET', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. token .. '|' .. ARGV[2], 'PX', ARGV[3])
redis.call('PUBLISH', ARGV[4], token)
return {1, token}
";

/// KEYS[1] = lease; ARGV[1] = lease id, ARGV[2] = ttl ms. 1 if extended, 0 if not ours (or gone).
const RENEW: &str = r"
local current = redis.call('GET', KEYS[1])
local owner = ARGV[1] .. '|'
if current and string.sub(current, 1, #owner) == owner then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
";

/// KEYS[1] = lease; ARGV[1] = lease id, ARGV[2] = release channel. 1 if deleted, 0 if not ours.
const RELEASE: &str = r"
local current = redis.call('GET', KEYS[1])
local owner = ARGV[1] .. '|'
if current and string.sub(current, 1, #owner) == owner then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], ARGV[1])
  return 1
end
return 0
";

/// How far the counter moves on after a failover ([`ACQUIRE`]): more grants than a failover
/// can lose, and far below what a token can hold (2^63 - 1) for any number of failovers;
/// within the fence's default `token.max_step` (2^40).
pub const EPOCH_GAP: u64 = 1 << 32;

pub struct RedisLeases {
    /// Commands; connected on first use, so fencegate starts while Redis is down.
    conn: RedisClient,
    /// The event subscription; started by the first `changed()` or `grant_events()`.
    events: OnceLock<Events>,
    acquire: Script,
    renew: Script,
    release: Script,
    prefix: String,
    waiters: Arc<Waiters>,
    grants: Arc<GrantFeed>,
}

/// The task that keeps the subscribed connection, and whether it is subscribed.
struct Events {
    task: tokio::task::AbortHandle,
    subscribed: watch::Receiver<bool>,
}

impl Drop for Events {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RedisLeases {
    /// `ha`: the Sentinels that name the primary, and the replicas every grant waits for.
    pub fn new(
        url: &str,
        prefix: &str,
        tls: Option<Arc<ClientTls>>,
        ha: &RedisHa,
    ) -> Result<Self, LeaseError> {
        let target = RedisTarget::new(url, tls)
            .and_then(|t| t.with_ha(ha))
            .map_err(LeaseError::config_from)?;
        Ok(RedisLeases {
            conn: RedisClient::new(target, Some("lease backend"), ha.replicas, true),
            events: OnceLock::new(),
            acquire: Script::new(ACQUIRE),
            renew: Script::new(RENEW),
            release: Script::new(RELEASE),
            prefix: prefix.to_owned(),
            waiters: Arc::new(Waiters::default()),
            grants: Arc::new(GrantFeed::new(false)),
        })
    }

    fn key(&self, resource: &str, what: &str) -> String {
        format!("{}:{{{resource}}}:{what}", self.prefix)
    }

    /// The event subscription, started on first use (inside a Tokio runtime).
    fn events(&self) -> &Events {
        self.events.get_or_init(|| {
            let (tx, subscribed) = watch::channel(false);
            let task = tokio::spawn(keep_subscribed(
                self.conn.target().with_protocol(ProtocolVersion::RESP3),
                self.prefix.clone(),
                Arc::clone(&self.waiters),
                Arc::clone(&self.grants),
                tx,
            ))
            .abort_handle();
            Events { task, subscribed }
        })
    }
}

/// Keeps one RESP3 connection (`target` speaks RESP3: push messages need it, whatever the
/// configured url asks for) subscribed to the release and grant channels, reconnecting
/// every half second while Redis is unreachable.
async fn keep_subscribed(
    target: RedisTarget,
    prefix: String,
    waiters: Arc<Waiters>,
    grants: Arc<GrantFeed>,
    subscribed: watch::Sender<bool>,
) {
    let head = format!("{prefix}:{{");
    let patterns = [
        format!("{prefix}:{{*}}:released"),
        format!("{prefix}:{{*}}:granted"),
    ];
    loop {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let config = AsyncConnectionConfig::new()
            .set_response_timeout(Some(HEARTBEAT))
            .set_push_sender(tx);
        match target.connect(config).await {
            Ok(mut conn) => {
                // Returns once the server confirmed both subscriptions.
                if conn.psubscribe(&patterns).await.is_ok() {
                    subscribed.send_replace(true);
                    grants.live();
                    let mut heartbeat = tokio::time::interval(HEARTBEAT);
                    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    loop {
                        tokio::select! {
                            push = rx.recv() => match push {
                                Some(push) if dispatch(&push, &head, &waiters, &grants) => {}
                                _ => break,
                            },
                            _ = heartbeat.tick() => {
                                let pong = tokio::time::timeout(
                                    HEARTBEAT,
                                    redis::cmd("PING").query_async::<Value>(&mut conn),
                                )
                                .await;
                                if !matches!(pong, Ok(Ok(_))) {
                                    break;
                                }
                            }
                        }
                    }
                    subscribed.send_replace(false);
                    grants.lost();
                    tracing::debug!("redis lease event connection lost; reconnecting");
                }
                // Releases may have been missed: let every waiter look again.
                waiters.wake_all();
            }
            Err(e) => tracing::debug!(error = %e, "redis lease events cannot connect"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Wakes the waiters of each released resource and announces each grant; `false` once the
/// connection is gone.
fn dispatch(push: &PushInfo, head: &str, waiters: &Waiters, grants: &GrantFeed) -> bool {
    match push.kind {
        PushKind::PMessage => {
            // [pattern, channel, message]
            if let Some(Value::BulkString(channel)) = push.data.get(1) {
                let channel = std::str::from_utf8(channel)
                    .ok()
                    .and_then(|c| c.strip_prefix(head));
                if let Some(resource) = channel.and_then(|c| c.strip_suffix("}:released")) {
                    waiters.wake(resource);
                } else if let Some(resource) = channel.and_then(|c| c.strip_suffix("}:granted")) {
                    grants.changed(resource);
                } else {
                    waiters.wake_all();
                    grants.resync();
                }
            }
            true
        }
        PushKind::Disconnection => false,
        _ => true,
    }
}

fn unavailable(e: redis::RedisError) -> LeaseError {
    LeaseError::new(failure(&e), format!("redis: {e}")).with_source(e)
}

/// Too few replicas acknowledged a grant in time: not granted as far as the caller knows
/// (`503`); the counter did move on the primary, so no later grant repeats its token.
fn lagging(lag: Unconfirmed) -> LeaseError {
    LeaseError::new(lag.failure(), lag.to_string())
}

fn parse_token(raw: &str) -> Result<Token, LeaseError> {
    raw.parse()
        .map_err(|_| LeaseError::corrupt(format!("redis holds a non-token counter `{raw}`")))
}

fn ttl_ms(ttl: Duration) -> u64 {
    // PX 0 is an error; a lease shorter than a millisecond is one millisecond.
    u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl LeaseBackend for RedisLeases {
    fn try_acquire<'a>(
        &'a self,
        resource: &'a str,
        holder: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LeaseError>> {
        Box::pin(async move {
            let lease_id = &new_lease_id();
            let (lease, counter, history) = (
                &self.key(resource, "lease"),
                &self.key(resource, "token"),
                &self.key(resource, "history"),
            );
            let (released, granted) = (
                &self.key(resource, "released"),
                &self.key(resource, "granted"),
            );
            let ((granted, value), lag) = self
                .conn
                .call(lease, |mut s| async move {
                    let (replid, promoted) = match s.history.as_deref() {
                        Some(h) => (h.replid.clone(), if h.promoted { "1" } else { "0" }),
                        None => (String::new(), "0"),
                    };
                    let reply = self
                        .acquire
                        .key(lease)
                        .key(counter)
                        .key(history)
                        .arg(lease_id)
                        .arg(holder)
                        .arg(ttl_ms(ttl))
                        .arg(granted)
                        .arg(replid)
                        .arg(promoted)
                        .arg(EPOCH_GAP)
                        .invoke_async::<(u8, String)>(&mut s.conn)
                        .await?;
                    if reply.0 != 1 {
                        return Ok((reply, Ok(())));
                    }
                    // A grant (and its counter) survives a failover only once replicated.
                    let lag = s.replicated().await?;
                    if lag.is_err() {
                        // Refused, so nobody will ever release it: the grant is given back at
                        // once rather than holding the resource for its TTL (best effort;
                        // should this fail too, the TTL frees it).
                        let _: Result<u8, _> = self
                            .release
                            .key(lease)
                            .arg(lease_id)
                            .arg(released)
                            .invoke_async(&mut s.conn)
                            .await;
                    }
                    Ok((reply, lag))
                })
                .await
                .map_err(unavailable)?;
            lag.map_err(lagging)?;
            if granted == 1 {
                return Ok(Acquired::Granted(Grant {
                    resource: resource.to_owned(),
                    holder: holder.to_owned(),
                    lease_id: lease_id.clone(),
                    token: parse_token(&value)?,
                }));
            }
            // `<lease_id>|<token>|<holder>`: the holder is last, so it may contain `|`.
            let holder = value.splitn(3, '|').nth(2).map(str::to_owned);
            Ok(Acquired::Held { holder })
        })
    }

    fn renew<'a>(
        &'a self,
        grant: &'a Grant,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, LeaseError>> {
        Box::pin(async move {
            let lease = &self.key(&grant.resource, "lease");
            let (renewed, lag) = self
                .conn
                .call(lease, |mut s| async move {
                    let renewed = self
                        .renew
                        .key(lease)
                        .arg(&grant.lease_id)
                        .arg(ttl_ms(ttl))
                        .invoke_async::<u8>(&mut s.conn)
                        .await?;
                    // A renewal extends the holder's belief in its lease: like a grant, it
                    // counts only once the replicas hold it (else a failover could hand the
                    // lease on before the holder's new deadline).
                    if renewed == 1 {
                        return Ok((renewed, s.replicated().await?));
                    }
                    Ok((renewed, Ok(())))
                })
                .await
                .map_err(unavailable)?;
            lag.map_err(lagging)?;
            Ok(renewed == 1)
        })
    }

    fn release<'a>(&'a self, grant: &'a Grant) -> BoxFuture<'a, Result<bool, LeaseError>> {
        Box::pin(async move {
            let lease = &self.key(&grant.resource, "lease");
            let released = &self.key(&grant.resource, "released");
            let released: u8 = self
                .conn
                .call(lease, |mut s| async move {
                    self.release
                        .key(lease)
                        .arg(&grant.lease_id)
                        .arg(released)
                        .invoke_async(&mut s.conn)
                        .await
                })
                .await
                .map_err(unavailable)?;
            Ok(released == 1)
        })
    }

    fn latest_token<'a>(
        &'a self,
        resource: &'a str,
    ) -> BoxFuture<'a, Result<Option<Token>, LeaseError>> {
        Box::pin(async move {
            let counter = &self.key(resource, "token");
            let value: Option<String> = self
                .conn
                .call(counter, |mut s| async move {
                    redis::cmd("GET")
                        .arg(counter)
                        .query_async(&mut s.conn)
                        .await
                })
                .await
                .map_err(unavailable)?;
            value.as_deref().map(parse_token).transpose()
        })
    }

    fn changed<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, ()> {
        // Not subscribed (Redis down?): the waiter's backoff wakes it meanwhile.
        let subscribed = self.events().subscribed.clone();
        let free = async move {
            let lease = &self.key(resource, "lease");
            let held = self
                .conn
                .call(lease, |mut s| async move {
                    redis::cmd("EXISTS")
                        .arg(lease)
                        .query_async::<u8>(&mut s.conn)
                        .await
                })
                .await
                .map(|n| n == 1);
            matches!(held, Ok(false))
        };
        Box::pin(shared::changed(subscribed, &self.waiters, resource, free))
    }

    fn grant_events(&self) -> GrantEvents {
        let events = self.grants.subscribe();
        self.events();
        events
    }

    fn kind(&self) -> &'static str {
        "redis"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_share_a_hash_tag() {
        let leases =
            RedisLeases::new("redis://127.0.0.1:1/", "fg", None, &RedisHa::default()).unwrap();
        assert_eq!(leases.key("a:1", "lease"), "fg:{a:1}:lease");
        assert_eq!(leases.key("a:1", "token"), "fg:{a:1}:token");
        assert_eq!(ttl_ms(Duration::from_micros(10)), 1);
    }
}
