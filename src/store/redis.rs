//! Maxima in Redis: one Lua script per compare-and-raise, atomic on the server.
//!
//! Tokens are stored and compared as canonical decimal strings (shorter is smaller, then
//! lexicographic), never as Lua numbers: those are doubles and lose precision above 2^53.
//! Keys are `{prefix}:{<resource>}:max`; the braces are a hash tag, so every key of one
//! resource lands in the same Redis Cluster slot.
//!
//! Idempotency records are hashes at `{prefix}:{<resource>}:idem\x1f<key>` (same hash tag as
//! the maximum, so one script may touch both; neither part can contain `\x1f`, so no two
//! `(resource, key)` pairs share a key). Fields: `p` the phase code, `t` the token (canonical
//! decimal), `f` the fingerprint (hex), `a` the attempt id and `w` its in-flight lifetime in
//! milliseconds (both `in_flight` records only) and `r` the encoded record. One script per
//! operation decides and writes.
//!
//! Outcomes (`completed`, `unknown`) expire by Redis (`PEXPIRE` with the window), on the
//! server's wall clock. `in_flight` records have no TTL (`PERSIST`): Redis keeps expiries as
//! absolute Unix times, so a forward step of the server's clock would end a running attempt's
//! claim. A claim instead takes over the record of an attempt seen in flight for a whole
//! in-flight lifetime on fencegate's monotonic clock ([`super::shared`]), in the script, only
//! while the record still names that attempt.
//!
//! With `fence.retention`, every raise sets the maximum's expiry to the period. The key
//! `{prefix}:retention` holds the retention mark ([`super::retention`]): a run with retention
//! writes it, a run without takes the expiry off every maximum when it finds it (`SCAN`, then
//! a script that `PERSIST`s a batch of keys: one Redis server, not a Cluster, whose slots a
//! batch would span). Its raises also take the expiry off any maximum they read.
//!
//! Connections are fencegate's own (`conn::redis`), shared with the Redis lease backend.

mod admin;

use crate::fence::token::Token;
use redis::Script;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::retention::{Freshness, MARK_SLACK};
use super::shared::{Claimed, Owner, Remote};
use super::{decide, Rule, StoreError, Verdict};
use crate::config::{EqualTokens, RedisHa};
use crate::conn::redis::{failure, RedisClient, RedisTarget, ScanCursor, Unconfirmed, SCAN_BATCH};
use crate::conn::BoxFuture;
use crate::idempotency::{AttemptId, Begin, Claim, Record};
use crate::tls::ClientTls;

/// KEYS[1] = maximum key, ARGV[1] = token (canonical decimal), ARGV[2] = `fence.retention` in
/// milliseconds ('0': none): a raised maximum expires that long after its raise; without
/// retention a maximum it reads but does not raise loses any expiry an earlier run gave it.
/// ARGV[3] = '1' when writes are acknowledged by replicas (`WAIT`) and equal tokens pass: a
/// token equal to the maximum then writes the maximum again, unchanged (`KEEPTTL`), so that
/// this connection's `WAIT` covers it (`WAIT` counts only what the waiting connection wrote,
/// and the maximum may be another's, refused `503` because its replicas did not acknowledge it).
/// ARGV[4] = the lowest maximum the token may be raised from (`token.max_step`,
/// [`Rule::floor`]; '' for none): below it, or with no maximum, the token is too far.
/// Returns the previous maximum ('' if none) and 1 if the token raised it, 0 if not, 2 if it is
/// too far above it.
const RAISE: &str = r"
local current = redis.call('GET', KEYS[1])
local token = ARGV[1]
local floor = ARGV[4]
if current then
  if token == current and ARGV[3] == '1' then
    redis.call('SET', KEYS[1], current, 'KEEPTTL')
  end
  if #token < #current or (#token == #current and token <= current) then
    if ARGV[2] == '0' then
      redis.call('PERSIST', KEYS[1])
    end
    return {current, 0}
  end
end
if floor ~= '' and (not current or #current < #floor or (#current == #floor and current < floor)) then
  if current and ARGV[2] == '0' then
    redis.call('PERSIST', KEYS[1])
  end
  return {current or '', 2}
end
if ARGV[2] ~= '0' then
  redis.call('SET', KEYS[1], token, 'PX', ARGV[2])
else
  redis.call('SET', KEYS[1], token)
end
return {current or '', 1}
";

/// `idempotency::decide`, transcribed. KEYS[1] = maximum key, KEYS[2] = record key;
/// ARGV[1] = token (canonical decimal), ARGV[2] = fingerprint (hex), ARGV[3] = '1' when equal
/// tokens are allowed, ARGV[4] = '1' when the attempt may execute, ARGV[5] = the in-flight
/// lifetime in milliseconds, ARGV[6] = the encoded in_flight record to write on execute,
/// ARGV[7] = the attempt id (hex), ARGV[8] = the attempt whose in_flight record to take over
/// ('' for none): such a record counts as absent, and is deleted unless replaced; ARGV[9] =
/// `fence.retention` in milliseconds ('0': none), as in [`RAISE`] (without it, the maximum
/// loses any expiry, raised or not); ARGV[10] = the lowest maximum the token may be raised from,
/// as in [`RAISE`] ('' for none).
/// Returns {kind, '1' if it took over else '0', ...}: {'execute', _, previous or ''},
/// {'stale', _, current}, {'toofar', _, current or ''}, {'inflight', _, attempt or '', lifetime or ''}, {'reused', _},
/// {'completed', _, encoded record} or {'refused', _}.
const BEGIN: &str = r"
local function below(a, b)
  return #a < #b or (#a == #b and a < b)
end
local function raise(token)
  if ARGV[9] ~= '0' then
    redis.call('SET', KEYS[1], token, 'PX', ARGV[9])
  else
    redis.call('SET', KEYS[1], token)
  end
end
local token = ARGV[1]
local current = redis.call('GET', KEYS[1])
if current and ARGV[9] == '0' then
  redis.call('PERSIST', KEYS[1])
end
local record = redis.call('HMGET', KEYS[2], 'p', 't', 'f', 'r', 'a', 'w')
local took = '0'
if ARGV[8] ~= '' and record[1] == 'i' and record[5] == ARGV[8] then
  redis.call('DEL', KEYS[2])
  record = {false}
  took = '1'
end
local allow_equal = ARGV[3] == '1'
if record[1] then
  if record[3] ~= ARGV[2] then
    return {'reused', took}
  end
  if record[1] == 'i' then
    return {'inflight', took, record[5] or '', record[6] or ''}
  end
  if record[1] == 'c' then
    return {'completed', took, record[4]}
  end
  if below(token, record[2]) then
    if current and below(record[2], current) then
      return {'stale', took, current}
    end
    return {'stale', took, record[2]}
  end
  if token == record[2] then
    allow_equal = true
  end
end
if ARGV[4] ~= '1' then
  return {'refused', took}
end
if current and (below(token, current) or (token == current and not allow_equal)) then
  return {'stale', took, current}
end
if ARGV[10] ~= '' and (not current or below(current, ARGV[10])) then
  return {'toofar', took, current or ''}
end
if not current or below(current, token) then
  raise(token)
end
redis.call('HSET', KEYS[2], 'p', 'i', 't', token, 'f', ARGV[2], 'a', ARGV[7], 'w', ARGV[5], 'r', ARGV[6])
redis.call('PERSIST', KEYS[2])
return {'execute', took, current or ''}
";

/// KEYS[1] = record key; ARGV[1] = the attempt's token, ARGV[2] = its fingerprint; ARGV[3..6]
/// = the outcome's phase code, token, fingerprint and encoding; ARGV[7] = window in
/// milliseconds; ARGV[8] = the attempt id (hex). Writes only over the in_flight record this
/// attempt claimed (a record without `a`, written before attempts had ids, is nobody's);
/// returns 1 if it wrote. The outcome expires after the window.
const FINISH: &str = r"
local record = redis.call('HMGET', KEYS[1], 'p', 't', 'f', 'a')
if record[1] ~= 'i' or record[2] ~= ARGV[1] or record[3] ~= ARGV[2] or record[4] ~= ARGV[8] then
  return 0
end
redis.call('HDEL', KEYS[1], 'a', 'w')
redis.call('HSET', KEYS[1], 'p', ARGV[3], 't', ARGV[4], 'f', ARGV[5], 'r', ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[7])
return 1
";

/// KEYS = keys matching `{prefix}:{*}:max`: every string among them (a maximum; an
/// idempotency record is a hash, which `GET` refuses) loses its expiry. Returns how many had
/// one. (`GET`, not `TYPE`: one command fewer for the ACL.)
const KEEP: &str = r"
local n = 0
for _, key in ipairs(KEYS) do
  if type(redis.pcall('GET', key)) == 'string' then
    n = n + redis.call('PERSIST', key)
  end
end
return n
";

/// KEYS[1] = the retention mark, ARGV[1] = the value it was read with: deleted only if it
/// still holds it. Returns 1 if deleted.
const UNMARK: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

pub struct RedisRemote {
    /// Connected on first use, so fencegate starts (not ready) while Redis is still down.
    conn: RedisClient,
    script: Script,
    begin: Script,
    finish: Script,
    keep: Script,
    unmark: Script,
    prefix: String,
    /// `fence.retention` in ms (0: none), the expiry of every maximum raised while the mark is
    /// fresh.
    retention_ms: AtomicU64,
    /// How many replicas acknowledge each write (`WAIT`); 0: none.
    replicas: u32,
    fresh: Freshness,
}

impl RedisRemote {
    /// `ha`: the Sentinels that name the primary, and the replicas every write waits for.
    pub fn new(
        url: &str,
        prefix: &str,
        tls: Option<Arc<ClientTls>>,
        ha: &RedisHa,
    ) -> Result<Self, StoreError> {
        let target = RedisTarget::new(url, tls)
            .and_then(|t| t.with_ha(ha))
            .map_err(StoreError::config_from)?;
        Ok(RedisRemote {
            conn: RedisClient::new(target, None, ha.replicas, false),
            replicas: ha.replicas,
            script: Script::new(RAISE),
            begin: Script::new(BEGIN),
            finish: Script::new(FINISH),
            keep: Script::new(KEEP),
            unmark: Script::new(UNMARK),
            prefix: prefix.to_owned(),
            retention_ms: AtomicU64::new(0),
            fresh: Freshness::default(),
        })
    }

    fn key(&self, resource: &str) -> String {
        format!("{}:{{{resource}}}:max", self.prefix)
    }

    /// The retention mark ([`crate::store::retention`]); outside every resource's hash tag,
    /// so no resource id can name it.
    fn mark_key(&self) -> String {
        format!("{}:retention", self.prefix)
    }

    /// The expiry to give a maximum raised now, in ms: the period while the mark is fresh, 0
    /// (none) otherwise.
    fn aging_ms(&self) -> u64 {
        match self.retention_ms.load(Ordering::Relaxed) {
            0 => 0,
            ms if self.fresh.fresh() => ms,
            _ => 0,
        }
    }

    /// The record key: the maximum's hash tag, then the idempotency key after a `\x1f`.
    fn record_key(&self, resource: &str, key: &str) -> String {
        format!("{}:{{{resource}}}:idem\u{1f}{key}", self.prefix)
    }
}

fn unavailable(e: redis::RedisError) -> StoreError {
    StoreError::new(failure(&e), format!("redis: {e}")).with_source(e)
}

/// Too few replicas acknowledged a write in time: not acknowledged (`503`), though the
/// primary holds it (a raise that stays only makes later stale tokens fail).
fn lagging(lag: Unconfirmed) -> StoreError {
    match lag.failure() {
        crate::conn::Failure::Timeout => StoreError::timeout(lag.to_string()),
        _ => StoreError::unreachable(lag.to_string()),
    }
}

fn parse(raw: &str) -> Result<Token, StoreError> {
    raw.parse()
        .map_err(|_| StoreError::corrupt(format!("redis holds a non-token maximum `{raw}`")))
}

fn flag(on: bool) -> &'static str {
    if on {
        "1"
    } else {
        "0"
    }
}

/// The record's lifetime for `PEXPIRE` (or, in flight, `w`), at least a millisecond (0 would
/// delete it at once).
fn window_ms(claim: &Claim) -> u64 {
    u64::try_from(claim.window.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

fn bad_reply(what: &str) -> StoreError {
    StoreError::corrupt(format!("redis: unexpected idempotency reply: {what}"))
}

/// The begin script's reply as a [`Claimed`].
fn begin_reply(reply: &[Vec<u8>]) -> Result<Claimed, StoreError> {
    let text = |i: usize| -> Result<&str, StoreError> {
        let raw = reply.get(i).ok_or_else(|| bad_reply("too short"))?;
        std::str::from_utf8(raw).map_err(|_| bad_reply("not text"))
    };
    let took_over = match text(1)? {
        "1" => true,
        "0" => false,
        other => return Err(bad_reply(other)),
    };
    let mut owner = None;
    let begin = match text(0)? {
        "execute" => {
            let previous = text(2)?;
            let previous = if previous.is_empty() {
                None
            } else {
                Some(parse(previous)?)
            };
            Begin::Execute { previous }
        }
        "stale" => Begin::Stale {
            current: parse(text(2)?)?,
        },
        "toofar" => Begin::TooFar {
            current: Some(text(2)?)
                .filter(|c| !c.is_empty())
                .map(parse)
                .transpose()?,
        },
        "inflight" => {
            // A record without an attempt (or with one this cannot read) is nobody's: no
            // takeover, it keeps the TTL it was written with.
            let lifetime = text(3)?.parse().ok().map(Duration::from_millis);
            owner = AttemptId::from_hex(text(2)?).map(|attempt| Owner { attempt, lifetime });
            Begin::InFlight
        }
        "reused" => Begin::Reused,
        "refused" => Begin::Refused,
        "completed" => {
            let raw = reply.get(2).ok_or_else(|| bad_reply("no record"))?;
            let record = Record::decode(raw)
                .map_err(|e| StoreError::corrupt(format!("redis holds a {e}")))?;
            Begin::Completed(record)
        }
        other => return Err(bad_reply(other)),
    };
    Ok(Claimed {
        begin,
        owner,
        took_over,
    })
}

impl Remote for RedisRemote {
    fn raise<'a>(
        &'a self,
        resource: &'a str,
        token: Token,
        rule: Rule,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>> {
        let floor = rule.floor(token).map(|f| f.to_string()).unwrap_or_default();
        let equal = rule.equal;
        Box::pin(async move {
            let key = self.key(resource);
            let (key, floor, text) = (&key, &floor, &token.to_string());
            let ((previous, raised), lag) = self
                .conn
                .call(key, |mut s| async move {
                    let reply: (String, u8) = self
                        .script
                        .key(key)
                        .arg(text)
                        .arg(self.aging_ms())
                        .arg(flag(self.replicas > 0 && equal == EqualTokens::Allow))
                        .arg(floor)
                        .invoke_async(&mut s.conn)
                        .await?;
                    // An equal token admitted is acknowledged like a raise: the script wrote
                    // the maximum again for this WAIT to cover.
                    let admitted =
                        reply.1 == 1 || (&reply.0 == text && equal == EqualTokens::Allow);
                    let lag = if admitted {
                        s.replicated().await?
                    } else {
                        Ok(())
                    };
                    Ok((reply, lag))
                })
                .await
                .map_err(unavailable)?;
            lag.map_err(lagging)?;
            let previous = if previous.is_empty() {
                None
            } else {
                Some(parse(&previous)?)
            };
            match raised {
                1 => Ok(Verdict::Admitted { previous }),
                2 => Ok(Verdict::TooFar { current: previous }),
                // Not raised: the token is at most the maximum; equal may still pass.
                _ => Ok(decide(previous, token, rule)),
            }
        })
    }

    fn get<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<Token>, StoreError>> {
        Box::pin(async move {
            let key = &self.key(resource);
            let value: Option<String> = self
                .conn
                .call(key, |mut s| async move {
                    redis::cmd("GET").arg(key).query_async(&mut s.conn).await
                })
                .await
                .map_err(unavailable)?;
            value.as_deref().map(parse).transpose()
        })
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            // Ready only while the replicas asked for acknowledge what each primary's
            // connection wrote.
            let lags = self
                .conn
                .call_each(|mut s| async move {
                    redis::cmd("PING")
                        .query_async::<String>(&mut s.conn)
                        .await?;
                    s.replicated().await
                })
                .await
                .map_err(unavailable)?;
            lags.into_iter().try_for_each(|lag| lag.map_err(lagging))
        })
    }

    fn begin_idempotent<'a>(
        &'a self,
        resource: &'a str,
        key: &'a str,
        claim: &'a Claim,
        takeover: Option<AttemptId>,
    ) -> BoxFuture<'a, Result<Claimed, StoreError>> {
        Box::pin(async move {
            let in_flight = &claim.in_flight().encode();
            let max_key = &self.key(resource);
            let record_key = &self.record_key(resource, key);
            let floor = &claim
                .rule
                .floor(claim.token)
                .map(|f| f.to_string())
                .unwrap_or_default();
            let (reply, lag) = self
                .conn
                .call(max_key, |mut s| async move {
                    let reply = self
                        .begin
                        .key(max_key)
                        .key(record_key)
                        .arg(claim.token.to_string())
                        .arg(claim.fingerprint.hex())
                        .arg(flag(claim.rule.equal == EqualTokens::Allow))
                        .arg(flag(claim.may_execute))
                        .arg(window_ms(claim))
                        .arg(in_flight)
                        .arg(claim.attempt.hex())
                        .arg(takeover.map(|a| a.hex()).unwrap_or_default())
                        .arg(self.aging_ms())
                        .arg(floor)
                        .invoke_async::<Vec<Vec<u8>>>(&mut s.conn)
                        .await?;
                    // Executing wrote the in-flight record (and any raise): acknowledged only
                    // once replicated.
                    if reply.first().is_some_and(|k| k == b"execute") {
                        let lag = s.replicated().await?;
                        return Ok((reply, lag));
                    }
                    Ok((reply, Ok(())))
                })
                .await
                .map_err(unavailable)?;
            lag.map_err(lagging)?;
            begin_reply(&reply)
        })
    }

    fn finish_idempotent<'a>(
        &'a self,
        resource: &'a str,
        key: &'a str,
        claim: &'a Claim,
        outcome: &'a Record,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let record_key = &self.record_key(resource, key);
            let (wrote, lag) = self
                .conn
                .call(record_key, |mut s| async move {
                    let wrote = self
                        .finish
                        .key(record_key)
                        .arg(claim.token.to_string())
                        .arg(claim.fingerprint.hex())
                        .arg(outcome.phase.code())
                        .arg(outcome.token.to_string())
                        .arg(outcome.fingerprint.hex())
                        .arg(outcome.encode())
                        .arg(window_ms(claim))
                        .arg(claim.attempt.hex())
                        .invoke_async::<u8>(&mut s.conn)
                        .await?;
                    // The outcome a retry is answered with: kept through a failover only once
                    // replicated.
                    if wrote == 1 {
                        return Ok((wrote, s.replicated().await?));
                    }
                    Ok((wrote, Ok(())))
                })
                .await
                .map_err(unavailable)?;
            lag.map_err(lagging)?;
            Ok(wrote == 1)
        })
    }

    fn kind(&self) -> &'static str {
        "redis"
    }

    fn forget_after(&self, period: std::time::Duration) -> Result<(), StoreError> {
        let ms = crate::store::retention_ms(period);
        self.retention_ms.store(ms, Ordering::Relaxed);
        Ok(())
    }

    fn forgets(&self) -> bool {
        true
    }

    fn retention(&self) -> Option<Duration> {
        match self.retention_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    fn mark<'a>(&'a self, value: &'a str) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let sent = Instant::now();
            let period = self.retention_ms.load(Ordering::Relaxed);
            let slack = u64::try_from(MARK_SLACK.as_millis()).unwrap_or(u64::MAX);
            let key = &self.mark_key();
            self.conn
                .call(key, |mut s| async move {
                    redis::cmd("SET")
                        .arg(key)
                        .arg(value)
                        .arg("PX")
                        .arg(period.saturating_add(slack))
                        .query_async::<()>(&mut s.conn)
                        .await
                })
                .await
                .map_err(|e| unavailable(e).with_context(&format!("writing the mark {key}")))?;
            self.fresh.marked(sent);
            Ok(())
        })
    }

    fn read_mark(&self) -> BoxFuture<'_, Result<Option<String>, StoreError>> {
        Box::pin(async move {
            let key = &self.mark_key();
            self.conn
                .call(key, |mut s| async move {
                    redis::cmd("GET").arg(key).query_async(&mut s.conn).await
                })
                .await
                .map_err(|e| unavailable(e).with_context(&format!("reading the mark {key}")))
        })
    }

    fn reset_generation(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(self.read_resets())
    }

    fn unmark<'a>(&'a self, value: &'a str) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let key = &self.mark_key();
            let deleted: u8 = self
                .conn
                .call(key, |mut s| async move {
                    self.unmark
                        .key(key)
                        .arg(value)
                        .invoke_async(&mut s.conn)
                        .await
                })
                .await
                .map_err(unavailable)?;
            Ok(deleted == 1)
        })
    }

    fn keep_all(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(async move {
            // The prefix is an identifier ([A-Za-z0-9_]), so it has no glob characters.
            let pattern = format!("{}:{{*}}:max", self.prefix);
            let mut cursor = ScanCursor::default();
            let mut kept = 0;
            while !cursor.done() {
                let keys: Vec<Vec<u8>> = self
                    .conn
                    .scan(&mut cursor, &pattern)
                    .await
                    .map_err(unavailable)?;
                // One script per batch of one slot (a cluster runs a script on one node).
                for group in self.conn.by_slot(keys, |k| k.as_slice()) {
                    for chunk in group.chunks(SCAN_BATCH) {
                        let first = String::from_utf8_lossy(&chunk[0]).into_owned();
                        let n: u64 = self
                            .conn
                            .call(&first, |mut s| async move {
                                let mut keep = self.keep.prepare_invoke();
                                for key in chunk {
                                    keep.key(key.as_slice());
                                }
                                keep.invoke_async(&mut s.conn).await
                            })
                            .await
                            .map_err(unavailable)?;
                        kept += n;
                    }
                }
            }
            Ok(kept)
        })
    }
}
