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
//! Events: the release script publishes on `<prefix>:{<resource>}:released`; one RESP3
//! connection per backend holds a pattern subscription to `<prefix>:{*}:released` and wakes the
//! resource's waiters. Expiry publishes nothing (keyspace notifications need server
//! configuration), so waiters for an expiring lease wake at the end of their backoff. After a
//! reconnect of the event connection every waiter is woken once, since releases may have been
//! missed, and each `changed()` first pings that connection, which makes it reconnect (and
//! resubscribe) if it had given up while Redis was down. A release in the moment before the
//! subscription is restored is left to backoff.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ProtocolVersion, PushInfo, PushKind, Script, Value};
use tokio::sync::{mpsc, OnceCell};

use super::backend::{Acquired, Grant, LeaseBackend, LeaseError};
use super::embedded::{new_lease_id, Waiters};
use crate::store::BoxFuture;

/// KEYS[1] = lease, KEYS[2] = counter; ARGV[1] = lease id, ARGV[2] = holder, ARGV[3] = ttl ms.
/// Returns {1, token} when granted, {0, current lease value} when held.
const ACQUIRE: &str = r"
local current = redis.call('GET', KEYS[1])
if current then
  return {0, current}
end
redis.call('INCR', KEYS[2])
local token = redis.call('GET', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. token .. '|' .. ARGV[2], 'PX', ARGV[3])
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

pub struct RedisLeases {
    client: redis::Client,
    /// Commands; connected on first use, so fencegate starts while Redis is down.
    conn: OnceCell<ConnectionManager>,
    /// The release subscription; set up on the first `changed()`.
    events: OnceCell<Events>,
    acquire: Script,
    renew: Script,
    release: Script,
    prefix: String,
    waiters: Arc<Waiters>,
}

/// The subscribed connection and the task that dispatches its messages.
struct Events {
    conn: ConnectionManager,
    task: tokio::task::AbortHandle,
}

impl Drop for Events {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RedisLeases {
    pub fn new(url: &str, prefix: &str) -> Result<Self, LeaseError> {
        let client = redis::Client::open(url)
            .map_err(|e| LeaseError::Unavailable(format!("bad redis url: {e}")))?;
        Ok(RedisLeases {
            client,
            conn: OnceCell::new(),
            events: OnceCell::new(),
            acquire: Script::new(ACQUIRE),
            renew: Script::new(RENEW),
            release: Script::new(RELEASE),
            prefix: prefix.to_owned(),
            waiters: Arc::new(Waiters::default()),
        })
    }

    fn key(&self, resource: &str, what: &str) -> String {
        format!("{}:{{{resource}}}:{what}", self.prefix)
    }

    fn manager_config() -> ConnectionManagerConfig {
        // Fail fast: the agent's backoff, not ours, decides how long to wait.
        ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(Some(Duration::from_secs(2)))
            .set_number_of_retries(1)
    }

    async fn conn(&self) -> Result<ConnectionManager, LeaseError> {
        let conn = self
            .conn
            .get_or_try_init(|| {
                ConnectionManager::new_with_config(self.client.clone(), Self::manager_config())
            })
            .await
            .map_err(unavailable)?;
        Ok(conn.clone())
    }

    async fn events(&self) -> Result<&Events, LeaseError> {
        self.events
            .get_or_try_init(|| async {
                // Push messages need RESP3, whatever the configured URL asks for.
                let info = self.client.get_connection_info().clone();
                let settings = info
                    .redis_settings()
                    .clone()
                    .set_protocol(ProtocolVersion::RESP3);
                let client =
                    redis::Client::open(info.set_redis_settings(settings)).map_err(unavailable)?;
                let (tx, rx) = mpsc::unbounded_channel();
                let config = Self::manager_config()
                    .set_push_sender(tx)
                    .set_automatic_resubscription();
                let mut conn = ConnectionManager::new_with_config(client, config)
                    .await
                    .map_err(unavailable)?;
                let task = tokio::spawn(dispatch(
                    rx,
                    format!("{}:{{", self.prefix),
                    Arc::clone(&self.waiters),
                ))
                .abort_handle();
                let events = Events {
                    conn: conn.clone(),
                    task,
                };
                // Returns once the server confirmed the subscription.
                conn.psubscribe(format!("{}:{{*}}:released", self.prefix))
                    .await
                    .map_err(unavailable)?;
                Ok(events)
            })
            .await
    }
}

/// Wakes the waiters of each released resource; every waiter after a disconnection.
async fn dispatch(mut rx: mpsc::UnboundedReceiver<PushInfo>, head: String, waiters: Arc<Waiters>) {
    while let Some(push) = rx.recv().await {
        match push.kind {
            PushKind::PMessage => {
                // [pattern, channel, message]
                if let Some(Value::BulkString(channel)) = push.data.get(1) {
                    let resource = std::str::from_utf8(channel)
                        .ok()
                        .and_then(|c| c.strip_prefix(&head))
                        .and_then(|c| c.strip_suffix("}:released"));
                    match resource {
                        Some(resource) => waiters.wake(resource),
                        None => waiters.wake_all(),
                    }
                }
            }
            PushKind::Disconnection => waiters.wake_all(),
            _ => {}
        }
    }
}

fn unavailable(e: redis::RedisError) -> LeaseError {
    LeaseError::Unavailable(format!("redis: {e}"))
}

fn parse_token(raw: &str) -> Result<u64, LeaseError> {
    raw.parse()
        .map_err(|_| LeaseError::Unavailable(format!("redis holds a non-token counter `{raw}`")))
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
            let mut conn = self.conn().await?;
            let lease_id = new_lease_id();
            let (granted, value): (u8, String) = self
                .acquire
                .key(self.key(resource, "lease"))
                .key(self.key(resource, "token"))
                .arg(&lease_id)
                .arg(holder)
                .arg(ttl_ms(ttl))
                .invoke_async(&mut conn)
                .await
                .map_err(unavailable)?;
            if granted == 1 {
                return Ok(Acquired::Granted(Grant {
                    resource: resource.to_owned(),
                    holder: holder.to_owned(),
                    lease_id,
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
            let mut conn = self.conn().await?;
            let renewed: u8 = self
                .renew
                .key(self.key(&grant.resource, "lease"))
                .arg(&grant.lease_id)
                .arg(ttl_ms(ttl))
                .invoke_async(&mut conn)
                .await
                .map_err(unavailable)?;
            Ok(renewed == 1)
        })
    }

    fn release<'a>(&'a self, grant: &'a Grant) -> BoxFuture<'a, Result<bool, LeaseError>> {
        Box::pin(async move {
            let mut conn = self.conn().await?;
            let released: u8 = self
                .release
                .key(self.key(&grant.resource, "lease"))
                .arg(&grant.lease_id)
                .arg(self.key(&grant.resource, "released"))
                .invoke_async(&mut conn)
                .await
                .map_err(unavailable)?;
            Ok(released == 1)
        })
    }

    fn latest_token<'a>(
        &'a self,
        resource: &'a str,
    ) -> BoxFuture<'a, Result<Option<u64>, LeaseError>> {
        Box::pin(async move {
            let mut conn = self.conn().await?;
            let value: Option<String> = redis::cmd("GET")
                .arg(self.key(resource, "token"))
                .query_async(&mut conn)
                .await
                .map_err(unavailable)?;
            value.as_deref().map(parse_token).transpose()
        })
    }

    fn changed<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let Ok(events) = self.events().await else {
                // No subscription (Redis down?): the waiter's backoff wakes it.
                return std::future::pending().await;
            };
            // The subscribed connection gets no other traffic, so it may hold a failed
            // reconnection from while Redis was down. A round trip proves it is up (and
            // resubscribed); a failed one makes the manager reconnect, which the second attempt
            // waits for.
            let mut conn = events.conn.clone();
            let mut up = false;
            for _ in 0..2 {
                if redis::cmd("PING")
                    .query_async::<Value>(&mut conn)
                    .await
                    .is_ok()
                {
                    up = true;
                    break;
                }
            }
            if !up {
                return std::future::pending().await;
            }
            // Subscribed and registered before looking: a release after the look wakes us.
            let registration = self.waiters.register(resource);
            let notified = registration.notify().notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let held = match self.conn().await {
                Ok(mut conn) => redis::cmd("EXISTS")
                    .arg(self.key(resource, "lease"))
                    .query_async::<u8>(&mut conn)
                    .await
                    .map(|n| n == 1),
                Err(_) => Ok(true),
            };
            if matches!(held, Ok(false)) {
                return;
            }
            notified.await;
        })
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
        let leases = RedisLeases::new("redis://127.0.0.1:1/", "fg").unwrap();
        assert_eq!(leases.key("a:1", "lease"), "fg:{a:1}:lease");
        assert_eq!(leases.key("a:1", "token"), "fg:{a:1}:token");
        assert_eq!(ttl_ms(Duration::from_micros(10)), 1);
    }
}
