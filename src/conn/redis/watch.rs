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
//! What this narrows and what it does not: a promotion follows the first `+sdown` by at least
//! the quorum's agreement and an election (Sentinel round trips), and the event reaches
//! fencegate in one, so in practice no write is acknowledged on a primary being replaced. It
//! is an observation, not a proof: a Sentinel fencegate cannot reach says nothing (its word is
//! dropped when its connection is lost, so that one Sentinel gone does not stop every write),
//! and an event still in flight when a write's `WAIT` returns is not seen by it.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Weak;
use std::time::Duration;

use redis::{AsyncConnectionConfig, ProtocolVersion, PushInfo, PushKind, Value};
use tokio::sync::mpsc;

use super::Sentinels;

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

/// Each Sentinel's word on the master, and how many failovers were seen.
#[derive(Debug)]
pub(super) struct Watch {
    /// Per Sentinel (in the order of the urls): its [`SDOWN`], [`ODOWN`] and [`FAILOVER`]
    /// bits for the master.
    flags: Vec<AtomicU8>,
    /// `+switch-master` events seen: a connection made before the last one is to a primary
    /// that was replaced.
    switches: AtomicU64,
}

impl Watch {
    pub(super) fn new(sentinels: usize) -> Self {
        Watch {
            flags: (0..sentinels).map(|_| AtomicU8::new(0)).collect(),
            switches: AtomicU64::new(0),
        }
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
    }
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
                    let mut heartbeat = tokio::time::interval(HEARTBEAT);
                    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    loop {
                        tokio::select! {
                            push = rx.recv() => match push {
                                Some(push) => {
                                    let Some(s) = sentinels.upgrade() else { return };
                                    if !event(&s, at, &push) {
                                        break;
                                    }
                                }
                                None => break,
                            },
                            _ = heartbeat.tick() => {
                                if sentinels.strong_count() == 0 {
                                    return;
                                }
                                let pong = redis::cmd("PING").query_async::<Value>(&mut conn).await;
                                if pong.is_err() {
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
}
