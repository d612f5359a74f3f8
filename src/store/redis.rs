//! Maxima in Redis: one Lua script per compare-and-raise, atomic on the server.
//!
//! Tokens are stored and compared as canonical decimal strings (shorter is smaller, then
//! lexicographic), never as Lua numbers: those are doubles and lose precision above 2^53.
//! Keys are `{prefix}:{<resource>}:max`; the braces are a hash tag, so every key of one
//! resource lands in the same Redis Cluster slot.

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Script;
use tokio::sync::OnceCell;

use super::shared::Remote;
use super::{decide, BoxFuture, StoreError, Verdict};
use crate::config::EqualTokens;

/// KEYS[1] = maximum key, ARGV[1] = token (canonical decimal).
/// Returns the previous maximum ('' if none) and whether the token raised it.
const RAISE: &str = r"
local current = redis.call('GET', KEYS[1])
local token = ARGV[1]
if current then
  if #token < #current or (#token == #current and token <= current) then
    return {current, 0}
  end
end
redis.call('SET', KEYS[1], token)
return {current or '', 1}
";

pub struct RedisRemote {
    client: redis::Client,
    /// Connected on first use, so fencegate starts (not ready) while Redis is still down.
    conn: OnceCell<ConnectionManager>,
    script: Script,
    prefix: String,
}

impl RedisRemote {
    pub fn new(url: &str, prefix: &str) -> Result<Self, StoreError> {
        let client = redis::Client::open(url)
            .map_err(|e| StoreError::Unavailable(format!("bad redis url: {e}")))?;
        Ok(RedisRemote {
            client,
            conn: OnceCell::new(),
            script: Script::new(RAISE),
            prefix: prefix.to_owned(),
        })
    }

    fn key(&self, resource: &str) -> String {
        format!("{}:{{{resource}}}:max", self.prefix)
    }

    async fn conn(&self) -> Result<ConnectionManager, StoreError> {
        let conn = self
            .conn
            .get_or_try_init(|| async {
                // The manager reconnects by itself after a drop; fail fast so the caller's
                // deadline, not ours, decides how long a write waits.
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(std::time::Duration::from_secs(1)))
                    .set_response_timeout(Some(std::time::Duration::from_secs(2)))
                    .set_number_of_retries(1);
                ConnectionManager::new_with_config(self.client.clone(), config).await
            })
            .await
            .map_err(unavailable)?;
        Ok(conn.clone())
    }
}

fn unavailable(e: redis::RedisError) -> StoreError {
    StoreError::Unavailable(format!("redis: {e}"))
}

fn parse(raw: &str) -> Result<u64, StoreError> {
    raw.parse()
        .map_err(|_| StoreError::Unavailable(format!("redis holds a non-token maximum `{raw}`")))
}

impl Remote for RedisRemote {
    fn raise<'a>(
        &'a self,
        resource: &'a str,
        token: u64,
        equal: EqualTokens,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>> {
        Box::pin(async move {
            let mut conn = self.conn().await?;
            let (previous, raised): (String, u8) = self
                .script
                .key(self.key(resource))
                .arg(token.to_string())
                .invoke_async(&mut conn)
                .await
                .map_err(unavailable)?;
            let previous = if previous.is_empty() {
                None
            } else {
                Some(parse(&previous)?)
            };
            if raised == 1 {
                return Ok(Verdict::Admitted { previous });
            }
            // Not raised: the token is at most the maximum; equal may still pass.
            Ok(decide(previous, token, equal))
        })
    }

    fn get<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<u64>, StoreError>> {
        Box::pin(async move {
            let mut conn = self.conn().await?;
            let value: Option<String> = redis::cmd("GET")
                .arg(self.key(resource))
                .query_async(&mut conn)
                .await
                .map_err(unavailable)?;
            value.as_deref().map(parse).transpose()
        })
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let mut conn = self.conn().await?;
            redis::cmd("PING")
                .query_async::<String>(&mut conn)
                .await
                .map_err(unavailable)?;
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
        "redis"
    }
}
