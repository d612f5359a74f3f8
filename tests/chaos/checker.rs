//! The history checker: pure functions over a recorded history, no I/O, no clocks.
//!
//! A history has five kinds of records, all timed on one clock (microseconds since the start
//! of the run, [`Micros`]):
//! - [`Commit`]: what the ledger (the protected downstream) applied, in its commit order, with
//!   the idempotency key the write carried;
//! - [`Admission`]: a write that reached the fence, admitted (forwarded) or refused;
//! - [`Hold`]: a lease grant as its holder lived it: from the moment it learnt of the grant to
//!   its local validity deadline (and, for a holder that ignores the deadline, its last use);
//! - [`Response`]: what a writer's client got back for one write;
//! - [`Exit`]: what the lease backend still held for a sidecar's holder id once that sidecar
//!   had been asked to shut down (SIGTERM, drain) and had exited.
//!
//! Invariants, each with a hand-made history that must make it fire ([`self_tests`]):
//! - (a) [`Invariant::CommittedTokensMonotonic`]: per resource, the ledger's committed tokens
//!   never decrease in commit order;
//! - (b) [`Invariant::NoLateLowerAdmission`]: no write is admitted after a write with a higher
//!   token was admitted for that resource, where "after" is judged conservatively: the lower
//!   write was *sent* after the higher one was *known admitted* (an upper bound of its
//!   admission instant: its arrival at the ledger, or its 2xx answer);
//! - (c) [`Invariant::DisjointHolds`]: for one resource, the intervals in which two different
//!   holders believed they held the lease never overlap;
//! - (d) [`Invariant::NoSuccessAfterDeadline`]: no 2xx answer for a write that was sent after
//!   its holder's local deadline (or for a write under no lease at all); a write is sent when
//!   its last byte is (a slow body is sent when it ends);
//! - (e) [`Invariant::KeyAppliedOnce`]: the ledger applies an idempotency key's write at most
//!   once, unless one of its attempts ended with an outcome fencegate documents as unknown
//!   (`502`, `504`, or no answer at all), after which a retry may execute it again;
//! - (f) [`Invariant::NoLeaseAfterDrain`]: once a sidecar that was asked to shut down has
//!   exited, the lease backend holds no lease for its holder id.
//!
//! Cost: each check is one pass after ordering by time. Histories are recorded in time order
//! (one lock, appended as events happen) and Rust's sort detects already-sorted runs in one
//! pass, so a recorded history is checked in linear time; an unordered one costs one sort.

use std::collections::HashMap;
use std::fmt;

/// Microseconds since the start of the run, on the harness's monotonic clock.
pub type Micros = u64;

/// One write applied by the ledger.
#[derive(Debug, Clone)]
pub struct Commit {
    /// Commit order (the ledger's append position).
    pub seq: u64,
    pub resource: String,
    pub token: u64,
    pub writer: String,
    pub op: String,
    /// The `Idempotency-Key` the write carried.
    pub key: Option<String>,
}

/// One write as the fence treated it.
#[derive(Debug, Clone)]
pub struct Admission {
    pub resource: String,
    pub token: u64,
    pub op: String,
    /// The status the writer saw (for reports).
    pub status: u16,
    /// When the writer sent it: a lower bound of the admission instant.
    pub sent: Micros,
    /// `Some(t)` if the write was admitted (forwarded), `t` being an upper bound of the
    /// admission instant; `None` if refused.
    pub admitted_by: Option<Micros>,
}

/// One lease grant, as its holder lived it.
#[derive(Debug, Clone)]
pub struct Hold {
    pub holder: String,
    pub resource: String,
    pub token: u64,
    /// When the holder learnt of the grant.
    pub start: Micros,
    /// Its local validity deadline (an upper bound), or its release if earlier.
    pub end: Micros,
    /// The last instant the holder acted as holder (finished sending a write that succeeded); a holder
    /// that ignores its deadline believes it holds the lease until then.
    pub last_use: Micros,
}

impl Hold {
    /// The interval in which the holder believed it held the lease.
    pub fn belief_end(&self) -> Micros {
        self.end.max(self.last_use)
    }
}

/// One answer a writer got.
#[derive(Debug, Clone)]
pub struct Response {
    pub writer: String,
    pub op: String,
    pub resource: String,
    /// The lease token the writer wrote under.
    pub token: u64,
    /// The write's idempotency key, if it had one.
    pub key: Option<String>,
    /// The HTTP status, or 0 when no answer came.
    pub status: u16,
    /// When the writer finished sending it (its last body byte).
    pub sent: Micros,
    pub answered: Micros,
}

/// A sidecar that was asked to shut down, after it exited: what the lease backend still held
/// for its holder id, read from the backend directly.
#[derive(Debug, Clone)]
pub struct Exit {
    pub holder: String,
    /// How it was stopped (for reports): `SIGTERM` (drain), or the naive control's `kill -9`.
    pub how: String,
    pub exited: Micros,
    /// (resource, token) of each lease the backend held for `holder` after the exit.
    pub held: Vec<(String, u64)>,
}

#[derive(Debug, Clone, Default)]
pub struct History {
    pub commits: Vec<Commit>,
    pub admissions: Vec<Admission>,
    pub holds: Vec<Hold>,
    pub responses: Vec<Response>,
    pub exits: Vec<Exit>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Invariant {
    /// (a)
    CommittedTokensMonotonic,
    /// (b)
    NoLateLowerAdmission,
    /// (c)
    DisjointHolds,
    /// (d)
    NoSuccessAfterDeadline,
    /// (e)
    KeyAppliedOnce,
    /// (f)
    NoLeaseAfterDrain,
}

impl Invariant {
    pub const ALL: [Invariant; 6] = [
        Invariant::CommittedTokensMonotonic,
        Invariant::NoLateLowerAdmission,
        Invariant::DisjointHolds,
        Invariant::NoSuccessAfterDeadline,
        Invariant::KeyAppliedOnce,
        Invariant::NoLeaseAfterDrain,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Invariant::CommittedTokensMonotonic => "(a) ledger tokens never decrease",
            Invariant::NoLateLowerAdmission => "(b) no lower token admitted after a higher one",
            Invariant::DisjointHolds => "(c) holders' belief intervals never overlap",
            Invariant::NoSuccessAfterDeadline => "(d) no 2xx for a write sent past the deadline",
            Invariant::KeyAppliedOnce => "(e) an idempotency key's write applied at most once",
            Invariant::NoLeaseAfterDrain => "(f) no lease left held by a drained sidecar",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Violation {
    pub invariant: Invariant,
    pub resource: String,
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} on {}: {}",
            self.invariant.label(),
            self.resource,
            self.detail
        )
    }
}

/// Runs every check; an empty result means the history satisfies all six invariants.
pub fn check(history: &History) -> Vec<Violation> {
    let mut out = Vec::new();
    out.extend(committed_tokens_monotonic(&history.commits));
    out.extend(no_late_lower_admission(&history.admissions));
    out.extend(disjoint_holds(&history.holds));
    out.extend(no_success_after_deadline(
        &history.holds,
        &history.responses,
    ));
    out.extend(key_applied_once(&history.commits, &history.responses));
    out.extend(no_lease_after_drain(&history.exits));
    out
}

/// How many violations of each invariant.
pub fn tally(violations: &[Violation]) -> [(Invariant, usize); 6] {
    Invariant::ALL.map(|i| (i, violations.iter().filter(|v| v.invariant == i).count()))
}

/// (a) Per resource, tokens in commit order never decrease.
pub fn committed_tokens_monotonic(commits: &[Commit]) -> Vec<Violation> {
    let mut ordered: Vec<&Commit> = commits.iter().collect();
    ordered.sort_by_key(|c| c.seq);
    let mut highest: HashMap<&str, &Commit> = HashMap::new();
    let mut out = Vec::new();
    for c in ordered {
        match highest.get(c.resource.as_str()) {
            Some(h) if c.token < h.token => out.push(Violation {
                invariant: Invariant::CommittedTokensMonotonic,
                resource: c.resource.clone(),
                detail: format!(
                    "commit #{} (op {} by {}) has token {} after commit #{} (op {} by {}) with token {}",
                    c.seq, c.op, c.writer, c.token, h.seq, h.op, h.writer, h.token
                ),
            }),
            Some(h) if c.token == h.token => {}
            _ => {
                highest.insert(&c.resource, c);
            }
        }
    }
    out
}

/// (b) An admitted write must not carry a token below one already known admitted when it
/// was sent.
pub fn no_late_lower_admission(admissions: &[Admission]) -> Vec<Violation> {
    // (admitted_by, index) and (sent, index) of admitted writes, each in time order.
    let admitted: Vec<(Micros, usize)> = admissions
        .iter()
        .enumerate()
        .filter_map(|(i, a)| a.admitted_by.map(|t| (t, i)))
        .collect();
    let mut by_admitted = admitted.clone();
    by_admitted.sort_by_key(|&(t, _)| t);
    let mut by_sent: Vec<(Micros, usize)> = admitted
        .iter()
        .map(|&(_, i)| (admissions[i].sent, i))
        .collect();
    by_sent.sort_by_key(|&(t, _)| t);
    // Sweep: per resource, the highest token among writes known admitted before each send.
    let mut highest: HashMap<&str, usize> = HashMap::new();
    let mut next = 0;
    let mut out = Vec::new();
    for &(sent, i) in &by_sent {
        while next < by_admitted.len() && by_admitted[next].0 < sent {
            let j = by_admitted[next].1;
            let slot = highest.entry(admissions[j].resource.as_str()).or_insert(j);
            if admissions[j].token > admissions[*slot].token {
                *slot = j;
            }
            next += 1;
        }
        let a = &admissions[i];
        if let Some(&h) = highest.get(a.resource.as_str()) {
            let h = &admissions[h];
            if a.token < h.token {
                out.push(Violation {
                    invariant: Invariant::NoLateLowerAdmission,
                    resource: a.resource.clone(),
                    detail: format!(
                        "op {} with token {} (status {}) was sent at {}us, after op {} with token {} was admitted (by {}us)",
                        a.op,
                        a.token,
                        a.status,
                        a.sent,
                        h.op,
                        h.token,
                        h.admitted_by.unwrap_or_default()
                    ),
                });
            }
        }
    }
    out
}

/// (c) Per resource, holds of different holders, taken in start order, never start before
/// an earlier hold of another holder has ended.
pub fn disjoint_holds(holds: &[Hold]) -> Vec<Violation> {
    let mut ordered: Vec<&Hold> = holds.iter().collect();
    ordered.sort_by_key(|h| h.start);
    /// The latest belief end so far, and the latest among holders other than its holder.
    struct Ends<'a> {
        best: (Micros, &'a Hold),
        other: Option<(Micros, &'a Hold)>,
    }
    let mut ends: HashMap<&str, Ends> = HashMap::new();
    let mut out = Vec::new();
    for h in ordered {
        let end = h.belief_end();
        let Some(e) = ends.get_mut(h.resource.as_str()) else {
            ends.insert(
                &h.resource,
                Ends {
                    best: (end, h),
                    other: None,
                },
            );
            continue;
        };
        let rival = if e.best.1.holder == h.holder {
            e.other
        } else {
            Some(e.best)
        };
        if let Some((rival_end, rival)) = rival {
            if rival_end > h.start {
                out.push(Violation {
                    invariant: Invariant::DisjointHolds,
                    resource: h.resource.clone(),
                    detail: format!(
                        "{} (token {}) believed it held the lease from {}us while {} (token {}) believed so until {}us",
                        h.holder, h.token, h.start, rival.holder, rival.token, rival_end
                    ),
                });
            }
        }
        if e.best.1.holder == h.holder {
            if end > e.best.0 {
                e.best = (end, h);
            }
        } else if end > e.best.0 {
            e.other = Some(e.best);
            e.best = (end, h);
        } else if e.other.is_none_or(|(o, _)| end > o) {
            e.other = Some((end, h));
        }
    }
    out
}

/// (d) A 2xx answer needs a hold of the writer, on the resource and token written, whose
/// local validity covered the instant the write was sent.
pub fn no_success_after_deadline(holds: &[Hold], responses: &[Response]) -> Vec<Violation> {
    let mut by_key: HashMap<(&str, &str, u64), Vec<&Hold>> = HashMap::new();
    for h in holds {
        by_key
            .entry((h.holder.as_str(), h.resource.as_str(), h.token))
            .or_default()
            .push(h);
    }
    let mut out = Vec::new();
    for r in responses.iter().filter(|r| (200..300).contains(&r.status)) {
        let key = (r.writer.as_str(), r.resource.as_str(), r.token);
        let candidates = by_key.get(&key).map(Vec::as_slice).unwrap_or_default();
        if candidates
            .iter()
            .any(|h| h.start <= r.sent && r.sent <= h.end)
        {
            continue;
        }
        let detail = match candidates.iter().map(|h| h.end).max() {
            Some(end) => format!(
                "{} got {} (at {}us) for op {} (token {}) sent at {}us, past its local deadline {}us ({}ms late)",
                r.writer,
                r.status,
                r.answered,
                r.op,
                r.token,
                r.sent,
                end,
                r.sent.saturating_sub(end) / 1000
            ),
            None => format!(
                "{} got {} for op {} (token {}) without holding that lease",
                r.writer, r.status, r.op, r.token
            ),
        };
        out.push(Violation {
            invariant: Invariant::NoSuccessAfterDeadline,
            resource: r.resource.clone(),
            detail,
        });
    }
    out
}

/// Statuses after which fencegate records a keyed attempt's outcome as unknown, so that a
/// retry may execute it again (docs/idempotency.md, "Unknown outcomes"): the upstream failed or was not
/// reached (`502`), sent no headers in time (`504`); and no answer at all (the harness cannot
/// tell what happened).
fn outcome_unknown(status: u16) -> bool {
    matches!(status, 0 | 502 | 504)
}

/// (e) Per (resource, key), at most one commit, unless an attempt of that key ended with an
/// unknown outcome. One pass over the responses, one over the commits.
pub fn key_applied_once(commits: &[Commit], responses: &[Response]) -> Vec<Violation> {
    let mut unknown: std::collections::HashSet<(&str, &str)> = std::collections::HashSet::new();
    for r in responses.iter().filter(|r| outcome_unknown(r.status)) {
        if let Some(key) = &r.key {
            unknown.insert((r.resource.as_str(), key.as_str()));
        }
    }
    let mut ordered: Vec<&Commit> = commits.iter().collect();
    ordered.sort_by_key(|c| c.seq);
    let mut first: HashMap<(&str, &str), &Commit> = HashMap::new();
    let mut out = Vec::new();
    for c in ordered {
        let Some(key) = &c.key else { continue };
        let slot = (c.resource.as_str(), key.as_str());
        match first.get(&slot) {
            None => {
                first.insert(slot, c);
            }
            Some(_) if unknown.contains(&slot) => {}
            Some(f) => {
                let attempts: Vec<String> = responses
                    .iter()
                    .filter(|r| r.resource == c.resource && r.key.as_deref() == Some(key))
                    .map(|r| format!("{} {} at {}us", r.op, r.status, r.sent))
                    .collect();
                out.push(Violation {
                    invariant: Invariant::KeyAppliedOnce,
                    resource: c.resource.clone(),
                    detail: format!(
                        "key {key} applied again: commit #{} (op {}) after commit #{} (op {}), no attempt with an unknown outcome; attempts: {}",
                        c.seq,
                        c.op,
                        f.seq,
                        f.op,
                        attempts.join(", ")
                    ),
                });
            }
        }
    }
    out
}

/// (f) A sidecar that was asked to shut down leaves no lease held in the backend.
pub fn no_lease_after_drain(exits: &[Exit]) -> Vec<Violation> {
    exits
        .iter()
        .flat_map(|e| {
            e.held.iter().map(move |(resource, token)| Violation {
                invariant: Invariant::NoLeaseAfterDrain,
                resource: resource.clone(),
                detail: format!(
                    "{} exited after {} (at {}us) and the backend still holds its lease with token {}",
                    e.holder, e.how, e.exited, token
                ),
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Negative controls: hand-made histories that must make each invariant fire, and close
// variants that must not (so the checker is neither blind nor trigger-happy).

fn commit(seq: u64, resource: &str, token: u64) -> Commit {
    Commit {
        seq,
        resource: resource.into(),
        token,
        writer: format!("w{token}"),
        op: format!("op{seq}"),
        key: None,
    }
}

fn keyed(seq: u64, key: &str) -> Commit {
    Commit {
        key: Some(key.into()),
        ..commit(seq, "r", 1)
    }
}

fn admission(op: &str, token: u64, sent: Micros, admitted_by: Option<Micros>) -> Admission {
    Admission {
        resource: "r".into(),
        token,
        op: op.into(),
        status: if admitted_by.is_some() { 200 } else { 409 },
        sent,
        admitted_by,
    }
}

fn hold(holder: &str, token: u64, start: Micros, end: Micros, last_use: Micros) -> Hold {
    Hold {
        holder: holder.into(),
        resource: "r".into(),
        token,
        start,
        end,
        last_use,
    }
}

fn response(writer: &str, token: u64, status: u16, sent: Micros) -> Response {
    Response {
        writer: writer.into(),
        op: format!("{writer}-{sent}"),
        resource: "r".into(),
        token,
        key: None,
        status,
        sent,
        answered: sent + 5,
    }
}

fn attempt(key: &str, status: u16, sent: Micros) -> Response {
    Response {
        key: Some(key.into()),
        ..response("w1", 1, status, sent)
    }
}

fn exit(holder: &str, held: &[(&str, u64)]) -> Exit {
    Exit {
        holder: holder.into(),
        how: "SIGTERM".into(),
        exited: 1000,
        held: held.iter().map(|&(r, t)| (r.to_owned(), t)).collect(),
    }
}

fn expect(name: &str, got: &[Violation], want: usize) -> Result<(), String> {
    if got.len() == want {
        Ok(())
    } else {
        Err(format!(
            "{name}: expected {want} violation(s), got {}: {got:?}",
            got.len()
        ))
    }
}

fn a_fires_on_a_decreasing_commit() -> Result<(), String> {
    let bad = [
        commit(0, "r", 3),
        commit(1, "r", 5),
        commit(2, "s", 1),
        commit(3, "r", 4),
    ];
    let got = committed_tokens_monotonic(&bad);
    expect("decreasing", &got, 1)?;
    if !got[0].detail.contains("token 4 after commit #1") {
        return Err(format!("wrong culprit: {}", got[0]));
    }
    // Equal tokens (one lease epoch writing again) and other resources are fine; commit
    // order, not slice order, is what counts.
    let fine = [
        commit(3, "r", 5),
        commit(0, "r", 3),
        commit(1, "r", 3),
        commit(2, "s", 1),
        commit(4, "r", 5),
    ];
    expect("monotonic", &committed_tokens_monotonic(&fine), 0)
}

fn b_fires_on_a_lower_token_admitted_after_a_higher_one() -> Result<(), String> {
    let bad = [
        admission("hi", 9, 0, Some(10)),
        admission("lo", 5, 20, Some(30)),
    ];
    expect("late lower", &no_late_lower_admission(&bad), 1)?;
    let fine = [
        // Overlapping in flight: may be admitted in either order.
        admission("hi", 9, 0, Some(50)),
        admission("lo", 5, 20, Some(30)),
        // Refused after the higher one: that is the fence working.
        admission("stale", 4, 60, None),
        // Same token again: the same epoch.
        admission("same", 9, 70, Some(80)),
    ];
    expect("overlapping", &no_late_lower_admission(&fine), 0)
}

fn c_fires_on_overlapping_holders() -> Result<(), String> {
    // w1's lease ran to 100 but w1 kept writing until 180 (a paused holder that ignored its
    // deadline); w2 got the lease at 150.
    let bad = [hold("w1", 1, 0, 100, 180), hold("w2", 2, 150, 300, 250)];
    expect("belief overlap", &disjoint_holds(&bad), 1)?;
    let bad_deadline = [hold("w1", 1, 0, 200, 50), hold("w2", 2, 150, 300, 250)];
    expect("deadline overlap", &disjoint_holds(&bad_deadline), 1)?;
    // A third holder overlapping the first but not the second is still caught.
    let bad_third = [
        hold("w1", 1, 0, 500, 0),
        hold("w2", 2, 10, 20, 0),
        hold("w2", 3, 30, 40, 0),
        hold("w3", 4, 400, 600, 0),
    ];
    expect("third", &disjoint_holds(&bad_third), 3)?;
    let fine = [
        hold("w1", 1, 0, 100, 90),
        hold("w2", 2, 150, 300, 250),
        // The same holder re-acquiring inside its own interval is not two holders.
        hold("w2", 3, 200, 400, 350),
        hold("w1", 4, 400, 500, 450),
    ];
    expect("disjoint", &disjoint_holds(&fine), 0)
}

fn d_fires_on_success_after_the_deadline() -> Result<(), String> {
    let holds = [hold("w1", 1, 0, 100, 0), hold("w2", 2, 150, 300, 0)];
    let bad = [
        response("w1", 1, 200, 50),
        response("w1", 1, 200, 120),
        response("w9", 7, 201, 10),
    ];
    let got = no_success_after_deadline(&holds, &bad);
    expect("late 2xx", &got, 2)?;
    if !got.iter().any(|v| v.detail.contains("without holding")) {
        return Err(format!("no unleased write reported: {got:?}"));
    }
    // Refusals past the deadline are the sidecar doing its job; a 2xx answered late for a
    // write sent in time is fine.
    let fine = [
        response("w1", 1, 503, 120),
        response("w1", 1, 409, 130),
        Response {
            answered: 5000,
            ..response("w1", 1, 200, 90)
        },
        response("w2", 2, 200, 200),
    ];
    expect("in time", &no_success_after_deadline(&holds, &fine), 0)
}

fn e_fires_on_a_key_applied_twice() -> Result<(), String> {
    // The stalled-store case: attempt A in flight (answered 200 later), retry B refused 503
    // (store), retry C executed: the ledger applied the key twice.
    let commits = [keyed(0, "k1"), keyed(1, "k2"), keyed(2, "k1")];
    let responses = [
        attempt("k1", 200, 0),
        attempt("k1", 503, 10),
        attempt("k1", 200, 20),
        attempt("k2", 200, 5),
    ];
    let got = key_applied_once(&commits, &responses);
    expect("applied twice", &got, 1)?;
    if !got[0].detail.contains("key k1 applied again: commit #2") {
        return Err(format!("wrong culprit: {}", got[0]));
    }
    // After a 504 (or a 502, or no answer) the outcome is unknown: a retry may execute again.
    // Writes without a key, and one key on two resources, are other writes.
    let fine_commits = [
        keyed(0, "k1"),
        keyed(1, "k1"),
        commit(2, "r", 1),
        commit(3, "r", 1),
        keyed(4, "k3"),
        Commit {
            resource: "s".into(),
            ..keyed(5, "k3")
        },
    ];
    let fine_responses = [attempt("k1", 504, 0), attempt("k1", 200, 10)];
    expect(
        "unknown outcome",
        &key_applied_once(&fine_commits, &fine_responses),
        0,
    )
}

fn f_fires_on_a_lease_left_after_a_drain() -> Result<(), String> {
    let bad = [
        exit("d1", &[]),
        exit("d2", &[("account:x", 7)]),
        exit("d3", &[("account:y", 3), ("account:z", 4)]),
    ];
    let got = no_lease_after_drain(&bad);
    expect("left held", &got, 3)?;
    if !got[0].detail.contains("d2 exited after SIGTERM") {
        return Err(format!("wrong culprit: {}", got[0]));
    }
    expect("released", &no_lease_after_drain(&[exit("d1", &[])]), 0)
}

fn check_runs_all_six() -> Result<(), String> {
    let history = History {
        commits: vec![
            commit(0, "r", 5),
            commit(1, "r", 4),
            Commit {
                resource: "q".into(),
                ..keyed(2, "k")
            },
            Commit {
                resource: "q".into(),
                ..keyed(3, "k")
            },
        ],
        admissions: vec![
            admission("hi", 5, 0, Some(10)),
            admission("lo", 4, 20, Some(30)),
        ],
        holds: vec![hold("w1", 4, 0, 100, 400), hold("w2", 5, 150, 300, 250)],
        responses: vec![response("w1", 4, 200, 400)],
        exits: vec![exit("d", &[("r", 1)])],
    };
    let got = check(&history);
    let counts = tally(&got);
    if counts.iter().all(|&(_, n)| n == 1) {
        Ok(())
    } else {
        Err(format!("expected one of each: {counts:?}"))
    }
}

fn linear_on_a_large_recorded_history() -> Result<(), String> {
    // 200k records of a healthy history (every write keyed): checked in well under a second.
    let n = 50_000u64;
    let mut h = History::default();
    for i in 0..n {
        let t = i * 100;
        h.commits.push(Commit {
            key: Some(format!("k{i}")),
            ..commit(i, "r", i / 4)
        });
        h.admissions
            .push(admission(&i.to_string(), i / 4, t, Some(t + 50)));
        if i % 4 == 0 {
            h.holds
                .push(hold(&format!("w{}", i % 3), i / 4, t, t + 390, t + 300));
        }
        h.responses
            .push(response(&format!("w{}", (i / 4 * 4) % 3), i / 4, 200, t));
    }
    let started = std::time::Instant::now();
    let got = check(&h);
    let took = started.elapsed();
    if !got.is_empty() {
        return Err(format!("{} violations, first: {}", got.len(), got[0]));
    }
    if took > std::time::Duration::from_secs(2) {
        return Err(format!("took {took:?}"));
    }
    Ok(())
}

/// The checker's own tests (this binary has no libtest harness): name and outcome.
pub fn self_tests() -> Vec<(&'static str, Result<(), String>)> {
    vec![
        (
            "checker::a_fires_on_a_decreasing_commit",
            a_fires_on_a_decreasing_commit(),
        ),
        (
            "checker::b_fires_on_a_lower_token_admitted_after_a_higher_one",
            b_fires_on_a_lower_token_admitted_after_a_higher_one(),
        ),
        (
            "checker::c_fires_on_overlapping_holders",
            c_fires_on_overlapping_holders(),
        ),
        (
            "checker::d_fires_on_success_after_the_deadline",
            d_fires_on_success_after_the_deadline(),
        ),
        (
            "checker::e_fires_on_a_key_applied_twice",
            e_fires_on_a_key_applied_twice(),
        ),
        (
            "checker::f_fires_on_a_lease_left_after_a_drain",
            f_fires_on_a_lease_left_after_a_drain(),
        ),
        ("checker::check_runs_all_six", check_runs_all_six()),
        (
            "checker::linear_on_a_large_recorded_history",
            linear_on_a_large_recorded_history(),
        ),
    ]
}
