//! What the run records as it goes (one lock per kind, appended in time order), and how the
//! records become the checker's [`History`].

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;

use crate::checker::{Admission, Commit, Exit, History, Hold, Micros, Response};

/// One write, as its writer saw it.
#[derive(Debug, Clone)]
pub struct Op {
    pub writer: String,
    pub group: usize,
    pub op: String,
    pub resource: String,
    pub token: u64,
    /// Its `Idempotency-Key` (retries of one write share it, with the same token and body).
    pub key: Option<String>,
    /// HTTP status, or 0 when the client gave up (no answer within its own bound).
    pub status: u16,
    /// The problem `type` of a refusal, when there was one.
    pub problem: Option<String>,
    /// When its head was sent.
    pub sent: Micros,
    /// When its last body byte was sent (`sent`, but for a slow body).
    pub done: Micros,
    pub answered: Micros,
}

/// One grant a writer received, and when it let go (asked its sidecar for the release).
#[derive(Debug, Clone)]
pub struct Acquired {
    pub writer: String,
    pub resource: String,
    pub token: u64,
    pub at: Micros,
    pub released: Option<Micros>,
}

/// A lease event from a sidecar's event stream, timed at receipt.
#[derive(Debug, Clone)]
pub struct LeaseEvent {
    pub writer: String,
    pub resource: String,
    pub token: u64,
    pub kind: String,
    pub at: Micros,
}

#[derive(Default)]
pub struct Recorder {
    pub ops: Mutex<Vec<Op>>,
    pub acquired: Mutex<Vec<Acquired>>,
    pub events: Mutex<Vec<LeaseEvent>>,
    /// Sidecars stopped during the run, and what the backend held for them afterwards.
    pub exits: Mutex<Vec<Exit>>,
    /// Bumped on every answered write, for waiters.
    answered: watch::Sender<u64>,
    /// Per group, writes sent so far.
    sent: Mutex<HashMap<usize, watch::Sender<u64>>>,
    /// Per group, writes sent and not yet answered.
    in_flight: Mutex<HashMap<usize, watch::Sender<u64>>>,
    /// Bumped on every lease event.
    event_count: watch::Sender<u64>,
}

impl Recorder {
    pub fn sent_counter(&self, group: usize) -> watch::Receiver<u64> {
        self.sent
            .lock()
            .unwrap()
            .entry(group)
            .or_insert_with(|| watch::channel(0).0)
            .subscribe()
    }

    pub fn in_flight(&self, group: usize) -> watch::Receiver<u64> {
        self.in_flight
            .lock()
            .unwrap()
            .entry(group)
            .or_insert_with(|| watch::channel(0).0)
            .subscribe()
    }

    pub fn note_sent(&self, group: usize) {
        for counters in [&self.sent, &self.in_flight] {
            counters
                .lock()
                .unwrap()
                .entry(group)
                .or_insert_with(|| watch::channel(0).0)
                .send_modify(|n| *n += 1);
        }
    }

    pub fn push_op(&self, op: Op) {
        if let Some(n) = self.in_flight.lock().unwrap().get(&op.group) {
            n.send_modify(|n| *n = n.saturating_sub(1));
        }
        self.ops.lock().unwrap().push(op);
        self.answered.send_modify(|n| *n += 1);
    }

    pub fn push_event(&self, e: LeaseEvent) {
        self.events.lock().unwrap().push(e);
        self.event_count.send_modify(|n| *n += 1);
    }

    /// Waits for `count` successful writes sent at or after `after` that match `pred`;
    /// returns the earliest answer instant among them. Explicit signal: every answer bumps a
    /// watch channel.
    pub async fn wait_ok(
        &self,
        after: Micros,
        count: usize,
        within: Duration,
        pred: impl Fn(&Op) -> bool,
    ) -> Option<Micros> {
        let mut rx = self.answered.subscribe();
        let mut scanned = 0;
        let mut found: Vec<Micros> = Vec::new();
        let search = async {
            loop {
                {
                    let ops = self.ops.lock().unwrap();
                    for op in &ops[scanned..] {
                        if (200..300).contains(&op.status) && op.sent >= after && pred(op) {
                            found.push(op.answered);
                        }
                    }
                    scanned = ops.len();
                }
                if found.len() >= count {
                    return found.iter().copied().min();
                }
                if rx.changed().await.is_err() {
                    return None;
                }
            }
        };
        tokio::time::timeout(within, search).await.ok().flatten()
    }

    /// Waits for the first write (any outcome) sent at or after `after` that matches `pred`,
    /// bounded; explicit signal as for [`Recorder::wait_ok`].
    pub async fn wait_op(
        &self,
        after: Micros,
        within: Duration,
        pred: impl Fn(&Op) -> bool,
    ) -> Option<Op> {
        let mut rx = self.answered.subscribe();
        let mut scanned = 0;
        let search = async {
            loop {
                {
                    let ops = self.ops.lock().unwrap();
                    if let Some(op) = ops[scanned..].iter().find(|o| o.sent >= after && pred(o)) {
                        return Some(op.clone());
                    }
                    scanned = ops.len();
                }
                if rx.changed().await.is_err() {
                    return None;
                }
            }
        };
        tokio::time::timeout(within, search).await.ok().flatten()
    }

    /// Waits until every grant has a terminal event (released or lost) from its sidecar's
    /// stream, bounded, so the deadlines computed from renewals are complete.
    pub async fn wait_terminal_events(&self, within: Duration) -> Vec<(String, String, u64)> {
        let mut rx = self.event_count.subscribe();
        let done = async {
            loop {
                let missing = {
                    let events = self.events.lock().unwrap();
                    let ended: std::collections::HashSet<(&str, &str, u64)> = events
                        .iter()
                        .filter(|e| e.kind == "released" || e.kind == "lost")
                        .map(|e| (e.writer.as_str(), e.resource.as_str(), e.token))
                        .collect();
                    self.acquired.lock().unwrap().iter().any(|a| {
                        !ended.contains(&(a.writer.as_str(), a.resource.as_str(), a.token))
                    })
                };
                if !missing {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        };
        if tokio::time::timeout(within, done).await.is_ok() {
            return Vec::new();
        }
        let events = self.events.lock().unwrap();
        self.acquired
            .lock()
            .unwrap()
            .iter()
            .filter(|a| {
                !events.iter().any(|e| {
                    (e.kind == "released" || e.kind == "lost")
                        && e.writer == a.writer
                        && e.resource == a.resource
                        && e.token == a.token
                })
            })
            .map(|a| (a.writer.clone(), a.resource.clone(), a.token))
            .collect()
    }
}

/// Builds the checker's history.
///
/// - Admissions: a write is known admitted once it reached the ledger (the fence forwards
///   only after its compare-and-raise) or was answered 2xx; the earlier of the two instants
///   bounds its admission from above.
/// - Holds: from the grant's answer to its local deadline, bounded from above by the last
///   `held`/`renewed` event received + TTL − drift buffer (a renewal is received after it was
///   sent, and the deadline counts from the send), cut at a `released`/`lost` event or the
///   writer's release; `last_use` is the instant the last write that succeeded was fully sent.
/// - Responses: a write counts as sent when its last body byte was (a slow body's end).
pub fn history(
    rec: &Recorder,
    commits: Vec<Commit>,
    arrivals: &HashMap<String, Micros>,
    validity: Duration,
) -> History {
    let ops = rec.ops.lock().unwrap().clone();
    let acquired = rec.acquired.lock().unwrap().clone();
    let events = rec.events.lock().unwrap().clone();
    let validity = validity.as_micros() as Micros;

    type Key = (String, String, u64);
    let key = |w: &str, r: &str, t: u64| -> Key { (w.to_owned(), r.to_owned(), t) };
    let mut renewed: HashMap<Key, Micros> = HashMap::new();
    let mut ended: HashMap<Key, Micros> = HashMap::new();
    for e in &events {
        let k = key(&e.writer, &e.resource, e.token);
        match e.kind.as_str() {
            "held" | "renewed" => {
                let slot = renewed.entry(k).or_insert(e.at);
                *slot = (*slot).max(e.at);
            }
            "released" | "lost" => {
                let slot = ended.entry(k).or_insert(e.at);
                *slot = (*slot).min(e.at);
            }
            _ => {}
        }
    }
    let mut last_use: HashMap<Key, Micros> = HashMap::new();
    for op in ops.iter().filter(|o| (200..300).contains(&o.status)) {
        let slot = last_use
            .entry(key(&op.writer, &op.resource, op.token))
            .or_insert(op.done);
        *slot = (*slot).max(op.done);
    }
    let holds = acquired
        .iter()
        .map(|a| {
            let k = key(&a.writer, &a.resource, a.token);
            let base = renewed.get(&k).copied().unwrap_or(a.at).max(a.at);
            let mut end = base + validity;
            if let Some(&t) = ended.get(&k) {
                end = end.min(t.max(a.at));
            }
            if let Some(t) = a.released {
                end = end.min(t);
            }
            Hold {
                holder: a.writer.clone(),
                resource: a.resource.clone(),
                token: a.token,
                start: a.at,
                end,
                last_use: last_use.get(&k).copied().unwrap_or(a.at),
            }
        })
        .collect();
    let admissions = ops
        .iter()
        .map(|o| {
            let ok = (200..300).contains(&o.status).then_some(o.answered);
            let arrived = arrivals.get(&o.op).copied();
            let admitted_by = match (ok, arrived) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            Admission {
                resource: o.resource.clone(),
                token: o.token,
                op: o.op.clone(),
                status: o.status,
                sent: o.sent,
                admitted_by,
            }
        })
        .collect();
    let responses = ops
        .iter()
        .map(|o| Response {
            writer: o.writer.clone(),
            op: o.op.clone(),
            resource: o.resource.clone(),
            token: o.token,
            key: o.key.clone(),
            status: o.status,
            sent: o.done,
            answered: o.answered,
        })
        .collect();
    History {
        commits,
        admissions,
        holds,
        responses,
        exits: rec.exits.lock().unwrap().clone(),
    }
}
