//! What the Sentinels say about the primary while fencegate writes to it.
//!
//! `WAIT` counts the replicas that hold a write, not whether a failover will keep them: while
//! the Sentinels fail over, the old primary still accepts writes, and a replica that has not
//! been told to follow the new primary yet still acknowledges them (and, were the new primary
//! itself to be taken for down right after its promotion, a second failover leaves two
//! primaries with a replica each). A write acknowledged then is lost when the replicas resync.
//!
//! So each Sentinel is followed on its event channels (one RESP3 connection per Sentinel,
//! re-dialled every half second while it is unreachable, `PING`ed every second). From the
//! first sign that a failover of the master may begin (a Sentinel's `+sdown` on it: the
//! subjective down that precedes the quorum's `+odown`, the election and the promotion) until
//! it is over, the primary is *in doubt*: writes still run, but none is acknowledged (the
//! caller answers 503), and readiness fails. The doubt ends with `-sdown`, `-odown`,
//! `+failover-end` or a failover abort from the Sentinel that raised it, or with
//! `+switch-master` from any Sentinel, which also makes the connection re-discover the
//! primary before its next command instead of at its first `READONLY`.
//!
//! `WAIT` for a fixed number of replicas is not enough either: the Sentinels promote the
//! replica with the best `replica-priority`, then the highest replication offset they last
//! read (`INFO`, refreshed every 1 to 10 s), so with two replicas a write one of them
//! acknowledged is lost when the other is promoted. So each Sentinel is also asked, on every
//! heartbeat, after each of its events and whenever the primary is looked up, which replicas
//! it could promote (`SENTINEL REPLICAS`: neither subjectively nor objectively down, nor
//! disconnected, `replica-priority` not 0), and a write is acknowledged only once every one of
//! them holds it ([`Watch::promotable`]).
//!
//! What this narrows and what it does not: a promotion follows the first `+sdown` by at least
//! the quorum's agreement and an election (Sentinel round trips), and the event reaches
//! fencegate in one, so in practice no write is acknowledged on a primary being replaced. It
//! is an observation, not a proof: a Sentinel fencegate cannot reach says nothing (its word is
//! dropped when its connection is lost, so that one Sentinel gone does not stop every write),
//! and an event still in flight when a write's `WAIT` returns is not seen by it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Weak;
use std::time::Duration;

use redis::{AsyncConnectionConfig, ProtocolVersion, PushInfo, PushKind, Value};
use tokio::sync::mpsc;

use super::{connection_failed, Sentinels};

/// The channels followed: the master's down states, a failover's steps, its end.
const CHANNELS: [&str; 11] = [
    "+sdown",
    "-sdown",
    "+odown",
    "-odown",
    "+try-failover",
    "+elected-leader",
    "+failover-end",
    "+failover-end-for-timeout",
    "-failover-abort-not-elected",
    "-failover-abort-no-good-slave",
    "+switch-master",
];

const HEARTBEAT: Duration = Duration::from_secs(1);
const REDIAL: Duration = Duration::from_millis(500);

/// One Sentinel takes the master for down.
const SDOWN: u8 = 1;
/// One Sentinel knows the quorum takes the master for down.
const ODOWN: u8 = 2;
/// One Sentinel is failing the master over.
const FAILOVER: u8 = 4;

/// A Sentinel's count of promotable replicas that is not known (not asked yet, refused, or
/// the Sentinel cannot be heard).
const UNKNOWN: u32 = u32::MAX;

/// Each Sentinel's word on the master, and how many failovers were seen.
#[derive(Debug)]
pub(super) struct Watch {
    /// Per Sentinel (in the order of the urls): its [`SDOWN`], [`ODOWN`] and [`FAILOVER`]
    /// bits for the master.
    flags: Vec<AtomicU8>,
    /// `+switch-master` events seen: a connection made before the last one is to a primary
    /// that was replaced.
    switches: AtomicU64,
    /// Per Sentinel: how many replicas it could promote, as it last said ([`UNKNOWN`]).
    promotable: Vec<AtomicU32>,
    /// The largest count any Sentinel gave last, kept while no Sentinel can be heard.
    last_promotable: AtomicU32,
}

impl Watch {
    pub(super) fn new(sentinels: usize) -> Self {
        Watch {
            flags: (0..sentinels).map(|_| AtomicU8::new(0)).collect(),
            switches: AtomicU64::new(0),
            promotable: (0..sentinels).map(|_| AtomicU32::new(UNKNOWN)).collect(),
            last_promotable: AtomicU32::new(0),
        }
    }

    /// How many replicas a write must reach before it is acknowledged, so that whichever
    /// replica a failover promotes holds it: the most any Sentinel heard now could promote
    /// (Sentinels disagree for the moment one of them notices a replica down or back), or,
    /// with none heard, the last count known (0 before any).
    pub(super) fn promotable(&self) -> u32 {
        self.promotable
            .iter()
            .map(|n| n.load(Ordering::Acquire))
            .filter(|n| *n != UNKNOWN)
            .max()
            .unwrap_or_else(|| self.last_promotable.load(Ordering::Acquire))
    }

    /// Sentinel `at` says it could promote `n` replicas.
    pub(super) fn set_promotable(&self, at: usize, n: u32) {
        self.promotable[at].store(n, Ordering::Release);
        self.last_promotable
            .store(self.promotable(), Ordering::Release);
    }

    /// Why no write may be acknowledged now, if a Sentinel says a failover may be under way.
    pub(super) fn doubt(&self, master: &str) -> Option<String> {
        let (at, bits) = self
            .flags
            .iter()
            .map(|f| f.load(Ordering::Acquire))
            .enumerate()
            .find(|(_, bits)| *bits != 0)?;
        let what = if bits & FAILOVER != 0 {
            "is failing it over"
        } else if bits & ODOWN != 0 {
            "reports the quorum takes it for down"
        } else {
            "takes it for down"
        };
        Some(format!(
            "Sentinel {} {what}: no write on the primary of `{master}` is acknowledged until \
             that ends (a failover could lose it)",
            at + 1
        ))
    }

    pub(super) fn switches(&self) -> u64 {
        self.switches.load(Ordering::Acquire)
    }

    /// Applies one event of Sentinel `at` about `master`.
    fn apply(&self, at: usize, master: &str, channel: &str, payload: &str) {
        let mut words = payload.split_whitespace();
        if channel == "+switch-master" {
            if words.next() == Some(master) {
                for f in &self.flags {
                    f.store(0, Ordering::Release);
                }
                self.switches.fetch_add(1, Ordering::AcqRel);
            }
            return;
        }
        // `master <name> <ip> <port> ...`: events about replicas and Sentinels name their
        // own kind first.
        if words.next() != Some("master") || words.next() != Some(master) {
            return;
        }
        let flags = &self.flags[at];
        match channel {
            "+sdown" => flags.fetch_or(SDOWN, Ordering::AcqRel),
            "-sdown" => flags.fetch_and(!SDOWN, Ordering::AcqRel),
            "+odown" => flags.fetch_or(ODOWN, Ordering::AcqRel),
            "-odown" => flags.fetch_and(!ODOWN, Ordering::AcqRel),
            "+try-failover" | "+elected-leader" => flags.fetch_or(FAILOVER, Ordering::AcqRel),
            _ => flags.fetch_and(!FAILOVER, Ordering::AcqRel),
        };
    }

    /// Sentinel `at` cannot be heard: its word no longer counts.
    fn forget(&self, at: usize) {
        self.flags[at].store(0, Ordering::Release);
        self.promotable[at].store(UNKNOWN, Ordering::Release);
    }
}

/// How many of the replicas in a `SENTINEL REPLICAS` answer the Sentinel could promote: not
/// down (`s_down`, `o_down`), not `disconnected` from it, `replica-priority` not 0 (what the
/// Sentinel's own choice skips first; a replica it skips for lag or a stale `INFO` is still
/// counted, which can only hold acknowledgements back).
fn promotable(replicas: &[HashMap<String, String>]) -> u32 {
    let count = replicas
        .iter()
        .filter(|r| {
            let flags = r.get("flags").map_or("", String::as_str);
            let unusable = flags
                .split(',')
                .any(|f| matches!(f, "s_down" | "o_down" | "disconnected"));
            let never = ["slave-priority", "replica-priority"]
                .iter()
                .any(|k| r.get(*k).is_some_and(|p| p == "0"));
            !unusable && !never
        })
        .count();
    u32::try_from(count).unwrap_or(UNKNOWN - 1)
}

/// Asks Sentinel `at` on `conn` which replicas of `master` it could promote, and records the
/// count.
pub(super) async fn ask_replicas<C: redis::aio::ConnectionLike>(
    watch: &Watch,
    at: usize,
    master: &str,
    conn: &mut C,
) -> Result<(), redis::RedisError> {
    let replicas: Vec<HashMap<String, String>> = redis::cmd("SENTINEL")
        .arg("REPLICAS")
        .arg(master)
        .query_async(conn)
        .await?;
    watch.set_promotable(at, promotable(&replicas));
    Ok(())
}

/// Follows Sentinel `at` of `sentinels` until they are dropped.
pub(super) async fn follow(sentinels: Weak<Sentinels>, at: usize) {
    let Some(node) = sentinels
        .upgrade()
        .map(|s| s.nodes[at].with_protocol(ProtocolVersion::RESP3))
    else {
        return;
    };
    loop {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let config = AsyncConnectionConfig::new()
            .set_response_timeout(Some(HEARTBEAT))
            .set_push_sender(tx);
        match node.dial(&node.host, node.port, config).await {
            Ok(mut conn) => {
                if let Err(e) = conn.subscribe(&CHANNELS).await {
                    tracing::debug!(error = %e, "a Sentinel's events cannot be followed");
                } else {
                    // The first tick is at once: the count of promotable replicas is asked
                    // for as soon as the events are followed.
                    let mut heartbeat = tokio::time::interval(HEARTBEAT);
                    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    let mut refused = false;
                    loop {
                        tokio::select! {
                            push = rx.recv() => match push {
                                Some(push) => {
                                    let Some(s) = sentinels.upgrade() else { return };
                                    if !event(&s, at, &push)
                                        || !refresh(&s, at, &mut conn, &mut refused).await
                                    {
                                        break;
                                    }
                                }
                                None => break,
                            },
                            _ = heartbeat.tick() => {
                                let Some(s) = sentinels.upgrade() else { return };
                                if !refresh(&s, at, &mut conn, &mut refused).await {
                                    break;
                                }
                            }
                        }
                    }
                }
            }
            Err(e) => tracing::debug!(error = %e, "a Sentinel cannot be reached for its events"),
        }
        match sentinels.upgrade() {
            Some(s) => s.watch.forget(at),
            None => return,
        }
        tokio::time::sleep(REDIAL).await;
    }
}

/// Asks Sentinel `at` which replicas it could promote (a `PING` once it refused that);
/// `false` if the connection failed. A refusal is logged once per connection, and the
/// Sentinel's count stays unknown.
async fn refresh(
    sentinels: &Sentinels,
    at: usize,
    conn: &mut redis::aio::MultiplexedConnection,
    refused: &mut bool,
) -> bool {
    if *refused {
        return redis::cmd("PING").query_async::<Value>(conn).await.is_ok();
    }
    match ask_replicas(&sentinels.watch, at, &sentinels.master, conn).await {
        Ok(()) => true,
        Err(e) if connection_failed(&e) => false,
        Err(e) => {
            tracing::warn!(
                error = %e,
                sentinel = at + 1,
                "a Sentinel will not say which replicas it could promote (`SENTINEL REPLICAS`; \
                 the Sentinel user needs `+sentinel|replicas`): writes wait only for the \
                 configured `replicas`, and a failover that promotes another replica loses them"
            );
            *refused = true;
            true
        }
    }
}

/// Applies a push message of Sentinel `at`; `false` once the connection is gone.
fn event(sentinels: &Sentinels, at: usize, push: &PushInfo) -> bool {
    match push.kind {
        PushKind::Message => {
            // [channel, message]
            if let [Value::BulkString(channel), Value::BulkString(payload)] = &push.data[..] {
                if let (Ok(channel), Ok(payload)) =
                    (std::str::from_utf8(channel), std::str::from_utf8(payload))
                {
                    sentinels
                        .watch
                        .apply(at, &sentinels.master, channel, payload);
                }
            }
            true
        }
        PushKind::Disconnection => false,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sentinel_that_takes_the_master_for_down_puts_it_in_doubt_until_it_stops() {
        let w = Watch::new(3);
        assert_eq!(w.doubt("m"), None);
        // Other masters, replicas and Sentinels do not count.
        w.apply(0, "m", "+sdown", "master other 127.0.0.1 6379");
        w.apply(
            0,
            "m",
            "+sdown",
            "slave 127.0.0.1:6380 127.0.0.1 6380 @ m 127.0.0.1 6379",
        );
        w.apply(
            0,
            "m",
            "+sdown",
            "sentinel 0a 127.0.0.1 26379 @ m 127.0.0.1 6379",
        );
        assert_eq!(w.doubt("m"), None);

        w.apply(1, "m", "+sdown", "master m 127.0.0.1 6379");
        let doubt = w.doubt("m").expect("in doubt");
        assert!(doubt.starts_with("Sentinel 2 takes it for down"), "{doubt}");
        w.apply(1, "m", "+odown", "master m 127.0.0.1 6379 #quorum 2/2");
        w.apply(1, "m", "-sdown", "master m 127.0.0.1 6379");
        let doubt = w.doubt("m").expect("still in doubt");
        assert!(doubt.contains("quorum"), "{doubt}");
        w.apply(1, "m", "-odown", "master m 127.0.0.1 6379");
        assert_eq!(w.doubt("m"), None);
    }

    #[test]
    fn a_failover_is_in_doubt_until_the_switch_and_the_switch_is_counted() {
        let w = Watch::new(3);
        w.apply(2, "m", "+try-failover", "master m 127.0.0.1 6379");
        w.apply(0, "m", "+sdown", "master m 127.0.0.1 6379");
        assert!(w.doubt("m").unwrap().starts_with("Sentinel 1"));
        w.apply(0, "m", "+switch-master", "other 127.0.0.1 1 127.0.0.1 2");
        assert!(w.doubt("m").is_some());
        assert_eq!(w.switches(), 0);
        w.apply(1, "m", "+switch-master", "m 127.0.0.1 6379 127.0.0.1 6380");
        assert_eq!(w.doubt("m"), None);
        assert_eq!(w.switches(), 1);

        // An aborted failover ends that Sentinel's doubt; a Sentinel that is lost, all of it.
        w.apply(2, "m", "+elected-leader", "master m 127.0.0.1 6380");
        w.apply(
            2,
            "m",
            "-failover-abort-no-good-slave",
            "master m 127.0.0.1 6380",
        );
        assert_eq!(w.doubt("m"), None);
        w.apply(2, "m", "+sdown", "master m 127.0.0.1 6380");
        w.forget(2);
        assert_eq!(w.doubt("m"), None);
    }

    fn replica(flags: &str, priority: &str) -> HashMap<String, String> {
        [
            ("flags", flags),
            ("slave-priority", priority),
            ("ip", "127.0.0.1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }

    #[test]
    fn a_replica_counts_unless_down_disconnected_or_never_promoted() {
        assert_eq!(promotable(&[]), 0);
        let replicas = [
            replica("slave", "100"),
            replica("slave", "1"),
            replica("s_down,slave", "100"),
            replica("slave,o_down", "100"),
            replica("slave,disconnected", "100"),
            replica("slave", "0"),
        ];
        assert_eq!(promotable(&replicas), 2);
    }

    #[test]
    fn the_most_any_heard_sentinel_could_promote_is_waited_for() {
        let w = Watch::new(3);
        assert_eq!(w.promotable(), 0, "nothing known yet");
        w.set_promotable(0, 2);
        w.set_promotable(1, 1);
        assert_eq!(w.promotable(), 2, "one Sentinel still sees a replica up");
        w.set_promotable(0, 1);
        assert_eq!(w.promotable(), 1);
        w.set_promotable(2, 2);
        w.forget(2);
        assert_eq!(
            w.promotable(),
            1,
            "a Sentinel that cannot be heard does not count"
        );
        // With none heard, the last count stands: losing the Sentinels lowers nothing.
        w.set_promotable(1, 2);
        w.forget(0);
        w.forget(1);
        assert_eq!(w.promotable(), 2);
    }
}
