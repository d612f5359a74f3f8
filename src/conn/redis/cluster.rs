//! Redis Cluster: which primary holds a key's slot.
//!
//! The slot map comes from `CLUSTER SLOTS`, asked of the url's node, then the seeds, then the
//! nodes the last map named (the last that answered asked first), on a one-shot connection;
//! each primary then has its own [`RedisConn`] (the url's user, password and TLS), kept
//! across refreshes while the map still names it. The map is asked again when a command on
//! a node fails the way a failover makes it fail (the connection broke or timed out,
//! `CLUSTERDOWN`, `TRYAGAIN`, `READONLY`) and when a node answers `MOVED`, which also points the
//! slot at once to the node it names. Refreshes run one at a time and at most one per
//! [`MIN_REFRESH`]: during a failover, writes are refused (`503`) until the map names the
//! promoted replica, without every request asking the cluster for its map; while no node gives
//! a map at all, the calls within [`MIN_REFRESH`] of the last attempt get its reason at once.
//!
//! With the map, `CLUSTER NODES` says how many replicas each primary has that the cluster has
//! not marked failed, and a write on a primary waits for every one of them: the
//! cluster's election favours the replica with the highest offset but does not guarantee it,
//! so `WAIT` for fewer could acknowledge a write the promoted replica lacks. While a primary's
//! `WAIT` falls short, the map is asked again every [`SHORT_REFRESH`], so a replica the cluster
//! has since marked failed stops holding writes back.
//!
//! Every key fencegate writes in one script carries its resource in a hash tag
//! (`{prefix}:{<resource>}:…`), so one script touches one slot, and the guarantees of a single
//! primary hold per slot: `WAIT` on the slot's primary, and the lease backend's record of that
//! primary's replication id.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use redis::{AsyncConnectionConfig, RedisError, Value};

use super::{connection_failed, no_primary, RedisConn, RedisTarget, RESPONSE_TIMEOUT};
use crate::sync::Locked;

/// Slots in a Redis Cluster.
const SLOTS: u16 = 16384;

/// At most one slot-map refresh in this long (a `MOVED` reply still points its slot at once).
const MIN_REFRESH: Duration = Duration::from_millis(50);

/// How often the map is asked again while a primary's replicas do not all acknowledge.
const SHORT_REFRESH: Duration = Duration::from_secs(1);

/// One range of the slot map: its first and last slot, its primary's host and port, and how
/// many replicas that primary has that the cluster has not marked failed (`CLUSTER NODES`).
type SlotRange = (u16, u16, String, u16, u32);

/// One range of a `CLUSTER SLOTS` answer: first and last slot, the primary's host, port and
/// node id (empty if not given).
type ListedRange = (u16, u16, String, u16, String);

/// The slot of `key`: CRC16 (XMODEM) of its hash tag, the part between the first `{` and the
/// next `}` if that is not empty, else of the whole key.
pub(crate) fn slot_of(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    crc16(tagged.unwrap_or(key)) % SLOTS
}

/// CRC-16/XMODEM (polynomial 0x1021, no reflection, initial value and final XOR 0), as Redis
/// Cluster hashes keys.
fn crc16(bytes: &[u8]) -> u16 {
    bytes.iter().fold(0, |crc, &b| {
        (crc << 8) ^ CRC16_TABLE[usize::from((crc >> 8) as u8 ^ b)]
    })
}

/// [`crc16`] of each byte value.
const CRC16_TABLE: [u16; 256] = {
    let mut table = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// One range of slots and the primary that serves it.
struct Range {
    first: u16,
    last: u16,
    node: Arc<RedisConn>,
}

#[derive(Default)]
struct Map {
    /// Sorted by `first`, not overlapping; slots no primary serves are in none.
    ranges: Vec<Range>,
    /// A failure said the map may be out of date.
    stale: bool,
    /// Refreshes so far, so that a caller who waited for another's refresh does not repeat it.
    generation: u64,
    refreshed: Option<Instant>,
    /// Why the last refresh found no map, if it did not: told again, without asking, to the
    /// calls within [`MIN_REFRESH`] of it.
    failed: Option<String>,
}

impl Map {
    /// Whether `node`'s last `WAIT` fell short and the map is older than [`SHORT_REFRESH`]: a
    /// replica it lists may have failed since, and then it is no longer waited for.
    fn asks_again(&self, node: &RedisConn) -> bool {
        node.short.load(Ordering::Acquire)
            && self
                .refreshed
                .is_none_or(|at| at.elapsed() >= SHORT_REFRESH)
    }

    fn find(&self, slot: u16) -> Option<&Arc<RedisConn>> {
        let at = self.ranges.partition_point(|r| r.last < slot);
        self.ranges
            .get(at)
            .filter(|r| r.first <= slot)
            .map(|r| &r.node)
    }

    fn node_at(&self, host: &str, port: u16) -> Option<&Arc<RedisConn>> {
        self.ranges
            .iter()
            .map(|r| &r.node)
            .find(|n| n.target.host == host && n.target.port == port)
    }

    /// Points `slot` at `node` (a `MOVED` reply), splitting the range that held it.
    fn point(&mut self, slot: u16, node: Arc<RedisConn>) {
        let mut ranges = Vec::with_capacity(self.ranges.len() + 2);
        for r in self.ranges.drain(..) {
            if r.first <= slot && slot <= r.last {
                if r.first < slot {
                    ranges.push(Range {
                        first: r.first,
                        last: slot - 1,
                        node: Arc::clone(&r.node),
                    });
                }
                if slot < r.last {
                    ranges.push(Range {
                        first: slot + 1,
                        last: r.last,
                        node: r.node,
                    });
                }
            } else {
                ranges.push(r);
            }
        }
        ranges.push(Range {
            first: slot,
            last: slot,
            node,
        });
        ranges.sort_by_key(|r| r.first);
        self.ranges = ranges;
    }
}

/// The primaries of one Redis Cluster.
pub(super) struct Cluster {
    /// The url's node, its settings and TLS for every node, and the seeds.
    target: RedisTarget,
    log_as: Option<&'static str>,
    replicas: u32,
    history: bool,
    map: Mutex<Map>,
    refreshing: tokio::sync::Mutex<()>,
    /// The node that answered `CLUSTER SLOTS` last, in [`Cluster::askable`]'s order.
    first: AtomicUsize,
    /// A node refused `CLUSTER NODES` (logged once).
    nodes_refused: AtomicBool,
}

impl Cluster {
    pub(super) fn new(
        target: RedisTarget,
        log_as: Option<&'static str>,
        replicas: u32,
        history: bool,
    ) -> Self {
        Cluster {
            target,
            log_as,
            replicas,
            history,
            map: Mutex::default(),
            refreshing: tokio::sync::Mutex::new(()),
            first: AtomicUsize::new(0),
            nodes_refused: AtomicBool::new(false),
        }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, Map> {
        self.map.locked()
    }

    /// A connection for the primary at `host:port`: the one in the map, else a new one.
    fn node(&self, host: &str, port: u16) -> Arc<RedisConn> {
        if let Some(node) = self.map().node_at(host, port) {
            return Arc::clone(node);
        }
        let conn = RedisConn::new(self.target.at(host, port), self.log_as, self.replicas);
        Arc::new(if self.history {
            conn.with_history()
        } else {
            conn
        })
    }

    /// The primary serving `key`'s slot, the map refreshed first if it is stale or has none.
    pub(super) async fn route(&self, key: &[u8]) -> Result<Arc<RedisConn>, RedisError> {
        let slot = slot_of(key);
        let seen = {
            let map = self.map();
            match map.find(slot) {
                Some(node) if !map.stale && !map.asks_again(node) => return Ok(Arc::clone(node)),
                _ => map.generation,
            }
        };
        self.refresh(seen).await?;
        self.map().find(slot).cloned().ok_or_else(|| {
            no_primary(format!(
                "no primary of the Redis Cluster serves slot {slot} (CLUSTER SLOTS)"
            ))
        })
    }

    /// Every primary the map names, each once, in address order.
    pub(super) async fn primaries(&self) -> Result<Vec<Arc<RedisConn>>, RedisError> {
        let seen = {
            let map = self.map();
            (map.stale || map.ranges.is_empty()).then_some(map.generation)
        };
        if let Some(seen) = seen {
            self.refresh(seen).await?;
        }
        let mut nodes: Vec<Arc<RedisConn>> = Vec::new();
        for range in &self.map().ranges {
            if !nodes.iter().any(|n| Arc::ptr_eq(n, &range.node)) {
                nodes.push(Arc::clone(&range.node));
            }
        }
        nodes.sort_by(|a, b| (&a.target.host, a.target.port).cmp(&(&b.target.host, b.target.port)));
        Ok(nodes)
    }

    /// A failure says the map may be out of date: the next command asks again.
    pub(super) fn stale(&self) {
        self.map().stale = true;
    }

    /// A `MOVED slot host:port` reply: the slot is served there now; the rest of the map is
    /// asked again too (a failover or a resharding moves more than one slot).
    pub(super) fn moved(&self, slot: u16, host: &str, port: u16) {
        let node = self.node(host, port);
        let mut map = self.map();
        map.point(slot, node);
        map.stale = true;
    }

    /// The connection a redirection to `host:port` goes over (`ASK`).
    pub(super) fn redirected(&self, host: &str, port: u16) -> Arc<RedisConn> {
        self.node(host, port)
    }

    /// Asks for the slot map, unless another caller refreshed it since generation `seen` or
    /// it was refreshed within [`MIN_REFRESH`] (and then still has some slots).
    async fn refresh(&self, seen: u64) -> Result<(), RedisError> {
        let _one = self.refreshing.lock().await;
        {
            let mut map = self.map();
            let recent = map.refreshed.is_some_and(|at| at.elapsed() < MIN_REFRESH);
            if recent && map.ranges.is_empty() {
                if let Some(why) = &map.failed {
                    return Err(no_primary(why.clone()));
                }
            }
            if map.generation != seen || (recent && !map.ranges.is_empty()) {
                map.stale = false;
                return Ok(());
            }
        }
        let askable = self.askable();
        let first = self.first.load(Ordering::Relaxed) % askable.len();
        let mut failures = Vec::new();
        for i in 0..askable.len() {
            let at = (first + i) % askable.len();
            let (host, port) = &askable[at];
            match self.ask(host, *port).await {
                Ok(slots) if !slots.is_empty() => {
                    self.first.store(at, Ordering::Relaxed);
                    self.install(slots);
                    return Ok(());
                }
                Ok(_) => failures.push(format!("{host}:{port} serves no slots")),
                Err(e) => failures.push(format!("{host}:{port}: {e}")),
            }
        }
        let why = format!(
            "no node of the Redis Cluster gave its slot map ({})",
            failures.join("; ")
        );
        let mut map = self.map();
        map.generation += 1;
        map.refreshed = Some(Instant::now());
        map.failed = Some(why.clone());
        Err(no_primary(why))
    }

    /// The url's node, the seeds, then the nodes of the current map, each once.
    fn askable(&self) -> Vec<(String, u16)> {
        let mut nodes = vec![(self.target.host.clone(), self.target.port)];
        nodes.extend(self.target.seeds.iter().cloned());
        for range in &self.map().ranges {
            nodes.push((range.node.target.host.clone(), range.node.target.port));
        }
        let mut seen = Vec::with_capacity(nodes.len());
        nodes.retain(|n| {
            let new = !seen.contains(n);
            if new {
                seen.push(n.clone());
            }
            new
        });
        nodes
    }

    /// `CLUSTER SLOTS` of the node at `host:port`.
    async fn ask(&self, host: &str, port: u16) -> Result<Vec<SlotRange>, RedisError> {
        let config = AsyncConnectionConfig::new().set_response_timeout(Some(RESPONSE_TIMEOUT));
        let mut conn = self.target.dial(host, port, config).await?;
        let reply: Value = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut conn)
            .await?;
        let listed = parse_slots(&reply, host).ok_or_else(|| {
            RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "CLUSTER SLOTS",
                format!("an answer fencegate cannot read: {reply:?}"),
            ))
        })?;
        // `CLUSTER SLOTS` lists replicas too, but Redis caches that answer and leaves out
        // replicas it last saw at offset 0, so the count comes from `CLUSTER NODES`.
        let nodes = match redis::cmd("CLUSTER")
            .arg("NODES")
            .query_async::<String>(&mut conn)
            .await
        {
            Ok(nodes) => nodes,
            Err(e) if connection_failed(&e) => return Err(e),
            Err(e) => {
                if !self.nodes_refused.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        error = %e,
                        "the Redis Cluster will not list its nodes (`CLUSTER NODES`; the user \
                         needs `+cluster|nodes`): writes wait only for the configured \
                         `replicas`, and a failover that promotes another replica loses them"
                    );
                }
                String::new()
            }
        };
        Ok(listed
            .into_iter()
            .map(|(first, last, host, port, id)| {
                let replicas = replicas_of(&nodes, &id);
                (first, last, host, port, replicas)
            })
            .collect())
    }

    /// A new map, keeping the connections of primaries it still names; each primary is told
    /// how many replicas it has now.
    fn install(&self, slots: Vec<SlotRange>) {
        let mut ranges: Vec<Range> = Vec::with_capacity(slots.len());
        for (first, last, host, port, replicas) in slots {
            let known = ranges
                .iter()
                .map(|r| &r.node)
                .find(|n| n.target.host == host && n.target.port == port)
                .cloned();
            let node = known.unwrap_or_else(|| self.node(&host, port));
            node.promotable.store(replicas, Ordering::Release);
            node.short.store(false, Ordering::Release);
            ranges.push(Range { first, last, node });
        }
        ranges.sort_by_key(|r| r.first);
        let mut map = self.map();
        map.ranges = ranges;
        map.stale = false;
        map.generation += 1;
        map.refreshed = Some(Instant::now());
        map.failed = None;
    }
}

/// How many replicas of the primary `id` a `CLUSTER NODES` answer lists that the cluster has
/// not marked failed (`fail`; a `fail?`, suspected by one node only, can still be promoted and
/// counts), nor lacks an address for.
fn replicas_of(nodes: &str, id: &str) -> u32 {
    if id.is_empty() {
        return 0;
    }
    let count = nodes
        .lines()
        .filter(|line| {
            // `<id> <address> <flags> <primary's id> …`
            let mut fields = line.split_whitespace().skip(2);
            let (Some(flags), Some(of)) = (fields.next(), fields.next()) else {
                return false;
            };
            of == id
                && !flags
                    .split(',')
                    .any(|f| matches!(f, "fail" | "noaddr" | "handshake"))
        })
        .count();
    u32::try_from(count).unwrap_or(u32::MAX)
}

/// The ranges of a `CLUSTER SLOTS` reply asked of `asked`, with their primaries
/// (`[first, last, [host, port, id, …], replicas…]`; an empty host is the node asked).
fn parse_slots(reply: &Value, asked: &str) -> Option<Vec<ListedRange>> {
    let int = |v: &Value| match v {
        Value::Int(n) => u16::try_from(*n).ok(),
        _ => None,
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    let Value::Array(entries) = reply else {
        return None;
    };
    let mut slots = Vec::with_capacity(entries.len());
    for entry in entries {
        let Value::Array(parts) = entry else {
            return None;
        };
        let (first, last) = (int(parts.first()?)?, int(parts.get(1)?)?);
        let Value::Array(primary) = parts.get(2)? else {
            return None;
        };
        let host = text(primary.first()?)?;
        let port = int(primary.get(1)?)?;
        if first > last || last >= SLOTS {
            return None;
        }
        let host = if host.is_empty() || host == "?" {
            asked.to_owned()
        } else {
            host
        };
        let id = primary.get(2).and_then(text).unwrap_or_default();
        slots.push((first, last, host, port, id));
    }
    Some(slots)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_the_hash_tag() {
        // The reference value of CRC16/XMODEM, and Redis's own examples.
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(crc16(b""), 0);
        assert_eq!(slot_of(b"foo"), 12182);
        assert_eq!(slot_of(b"bar"), 5061);
        assert_eq!(slot_of(b"hello"), 866);
        assert_eq!(slot_of(b"{user1000}.following"), slot_of(b"user1000"));
        assert_eq!(slot_of(b"fg:{account:1}:max"), slot_of(b"account:1"));
        assert_eq!(slot_of(b"fg:{account:1}:idem\x1fk"), slot_of(b"account:1"));
        // An empty tag is no tag: the whole key is hashed.
        assert_eq!(slot_of(b"a{}b"), crc16(b"a{}b") % SLOTS);
        assert_eq!(slot_of(b"{}{x}"), crc16(b"{}{x}") % SLOTS);
    }

    #[test]
    fn a_slot_map_is_read_from_cluster_slots() {
        let node = |host: &str, port: i64| {
            Value::Array(vec![
                Value::BulkString(host.into()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node("10.0.0.1", 7000),
                node("10.0.0.4", 7003),
            ]),
            Value::Array(vec![Value::Int(5461), Value::Int(16383), node("", 7001)]),
        ]);
        assert_eq!(
            parse_slots(&reply, "seed").unwrap(),
            [
                (0, 5460, "10.0.0.1".to_owned(), 7000, "id".to_owned()),
                (5461, 16383, "seed".to_owned(), 7001, "id".to_owned())
            ]
        );
        let bad = Value::Array(vec![Value::Array(vec![Value::Int(9), Value::Int(3)])]);
        assert!(parse_slots(&bad, "seed").is_none());
    }

    /// No node answers: the first route tries them all; one right after it is told the same
    /// reason without dialling (it returns before any connect could time out).
    #[tokio::test]
    async fn a_cluster_with_no_map_is_not_asked_again_at_once() {
        // Port 1 on loopback: refused at once.
        let target = RedisTarget::new("redis://127.0.0.1:1/", None).unwrap();
        let cluster = Cluster::new(target, None, 0, false);
        let first = cluster.route(b"k").await.err().unwrap().to_string();
        assert!(
            first.contains("no node of the Redis Cluster gave its slot map"),
            "{first}"
        );
        let seen = cluster.map().generation;
        let again = cluster.route(b"k").await.err().unwrap().to_string();
        assert_eq!(again, first);
        assert_eq!(cluster.map().generation, seen, "it asked the nodes again");
    }

    #[test]
    fn a_moved_slot_splits_its_range() {
        let target = RedisTarget::new("redis://127.0.0.1:7000/", None).unwrap();
        let cluster = Cluster::new(target, None, 0, false);
        cluster.install(vec![
            (0, 99, "a".into(), 1, 1),
            (100, 199, "b".into(), 2, 1),
        ]);
        cluster.moved(50, "b", 2);
        let map = cluster.map();
        let port = |slot| map.find(slot).map(|n| n.target.port);
        assert_eq!(
            [
                port(0),
                port(49),
                port(50),
                port(51),
                port(99),
                port(100),
                port(200)
            ],
            [Some(1), Some(1), Some(2), Some(1), Some(1), Some(2), None]
        );
        assert!(map.stale);
    }

    #[test]
    fn a_primary_counts_its_replicas_that_have_not_failed() {
        let nodes = "\
p1 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460
r1 127.0.0.1:7003@17003 slave p1 0 1 1 connected
r2 127.0.0.1:7004@17004 slave,fail? p1 0 1 1 connected
r3 127.0.0.1:7005@17005 slave,fail p1 0 1 1 disconnected
r4 127.0.0.1:7006@17006 slave p2 0 1 2 connected
";
        assert_eq!(replicas_of(nodes, "p1"), 2);
        assert_eq!(replicas_of(nodes, "p2"), 1);
        assert_eq!(replicas_of(nodes, "p3"), 0);
        assert_eq!(replicas_of(nodes, ""), 0);
    }
}
