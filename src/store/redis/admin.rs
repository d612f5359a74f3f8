//! `fencegate fences` on Redis: `GET` and `PTTL` of the maximum's key; a list `SCAN`s every
//! maximum key under the resource prefix and sorts them (a page costs a scan of the prefix's
//! keys: Redis keeps no order); a reset is one script that reads and writes the maximum (with
//! no expiry: a reset maximum is kept until a raise), then `INCR {prefix}:resets`, the reset
//! generation, a key of its own (outside every resource's hash tag, like the retention mark).

use crate::fence::token::Token;
use redis::Script;

use super::{parse, unavailable, RedisRemote};
use crate::conn::redis::{glob_escape, ScanCursor};
use crate::conn::BoxFuture;
use crate::store::admin::{Fence, Inspect, Page};
use crate::store::StoreError;

/// KEYS[1] = maximum key, ARGV[1] = the new maximum (canonical decimal). Returns the one it
/// replaced ('' if none).
const RESET: &str = r"
local before = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], ARGV[1])
return before or ''
";

impl RedisRemote {
    /// The reset generation's key.
    fn resets_key(&self) -> String {
        format!("{}:resets", self.prefix)
    }

    /// The reset generation (0: no reset ever).
    pub(super) async fn read_resets(&self) -> Result<u64, StoreError> {
        let key = &self.resets_key();
        let value: Option<String> = self
            .conn
            .call(key, |mut s| async move {
                redis::cmd("GET").arg(key).query_async(&mut s.conn).await
            })
            .await
            .map_err(unavailable)?;
        value
            .as_deref()
            .map(|raw| {
                raw.parse().map_err(|_| {
                    StoreError::corrupt(format!("redis holds a non-count of resets `{raw}`"))
                })
            })
            .transpose()
            .map(Option::unwrap_or_default)
    }

    /// The resource a maximum key names, if `key` is one (an idempotency record's key has a
    /// `\x1f`, which no resource id contains).
    fn resource_of<'k>(&self, key: &'k str) -> Option<&'k str> {
        let inner = key
            .strip_prefix(self.prefix.as_str())?
            .strip_prefix(":{")?
            .strip_suffix("}:max")?;
        (!inner.contains('\u{1f}')).then_some(inner)
    }

    /// The maxima of `resources` (`None` for a key gone meanwhile) with their expiries.
    /// The maxima of `resources` (`None` for a key gone meanwhile) with their expiries.
    async fn read(&self, resources: &[String]) -> Result<Vec<Fence>, StoreError> {
        let replies: Vec<(Option<String>, i64)> = self
            .conn
            .pipelined(
                resources,
                |r| self.key(r),
                |pipe, r| {
                    let key = self.key(r);
                    pipe.cmd("GET").arg(&key).cmd("PTTL").arg(&key);
                },
            )
            .await
            .map_err(unavailable)?;
        resources
            .iter()
            .zip(replies)
            .map(|(resource, (value, ttl))| {
                let mut fence = Fence::recorded(resource, value.as_deref().map(parse).transpose()?);
                // -1: no expiry, -2: no key.
                fence.expires_in_ms = u64::try_from(ttl).ok();
                Ok(fence)
            })
            .collect()
    }
}

impl Inspect for RedisRemote {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn fence<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Fence, StoreError>> {
        Box::pin(async move {
            let mut fences = self.read(&[resource.to_owned()]).await?;
            Ok(fences.pop().unwrap_or_else(|| Fence::absent(resource)))
        })
    }

    fn list<'a>(
        &'a self,
        prefix: &'a str,
        after: Option<&'a str>,
        limit: usize,
    ) -> BoxFuture<'a, Result<Page, StoreError>> {
        Box::pin(async move {
            let pattern = format!("{}:{{{}*}}:max", self.prefix, glob_escape(prefix));
            let mut resources = Vec::new();
            let mut cursor = ScanCursor::default();
            while !cursor.done() {
                let keys: Vec<String> = self
                    .conn
                    .scan(&mut cursor, &pattern)
                    .await
                    .map_err(unavailable)?;
                resources.extend(
                    keys.iter()
                        .filter_map(|k| self.resource_of(k))
                        .filter(|r| r.starts_with(prefix) && after.is_none_or(|a| *r > a))
                        .map(str::to_owned),
                );
            }
            // SCAN may return a key more than once.
            resources.sort();
            resources.dedup();
            resources.truncate(limit.saturating_add(1));
            let fences = self
                .read(&resources)
                .await?
                .into_iter()
                .filter(|f| f.max_token.is_some())
                .collect();
            Ok(Page::of(fences, limit))
        })
    }

    fn reset<'a>(
        &'a self,
        resource: &'a str,
        to: Token,
    ) -> BoxFuture<'a, Result<Option<Token>, StoreError>> {
        Box::pin(async move {
            let (key, resets) = (&self.key(resource), &self.resets_key());
            let script = &Script::new(RESET);
            let (before, lag) = self
                .conn
                .call(key, |mut s| async move {
                    let before: String = script
                        .key(key)
                        .arg(to.to_string())
                        .invoke_async(&mut s.conn)
                        .await?;
                    Ok((before, s.replicated().await?))
                })
                .await
                .map_err(unavailable)?;
            lag.map_err(super::lagging)?;
            // After the maximum (in a cluster, maybe on another node): a fencegate that sees
            // the new generation reads the new maximum.
            let lag = self
                .conn
                .call(resets, |mut s| async move {
                    redis::cmd("INCR")
                        .arg(resets)
                        .query_async::<u64>(&mut s.conn)
                        .await?;
                    s.replicated().await
                })
                .await
                .map_err(unavailable)?;
            lag.map_err(super::lagging)?;
            if before.is_empty() {
                Ok(None)
            } else {
                parse(&before).map(Some)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_characters_are_escaped() {
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
        assert_eq!(glob_escape("account:"), "account:");
    }
}
