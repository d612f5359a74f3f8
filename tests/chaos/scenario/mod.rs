//! The chaos run: a ledger, fence sidecars in front of it, workers that acquire leases
//! through their own sidecars (Redis lease backend) and write through egress with an
//! idempotency key (retrying a write with the same key), and a fault loop. Group 2's fence is
//! authoritative (`fence.authority: leases`). Groups 3 to 5 fence through replicated stores
//! (Redis with Sentinel, PostgreSQL with a synchronous standby, a three-member etcd cluster)
//! whose primary or leader the failover faults kill. Also the negative control: the same
//! workers writing straight to the ledger.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, Empty, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;

mod faults;
mod probes;
mod rig;
mod workers;
use faults::*;
use probes::*;
use rig::*;
use workers::*;

use crate::checker::{self, Exit, History, Violation};
use crate::clock::Clock;
use crate::ledger::Ledger;
use crate::netns::Lab;
use crate::procs::{
    free_port, fresh_prefix, leases_held_by, wait_log, write_config, Fencegate, Postgres, Redis,
};
use crate::record::{Acquired, LeaseEvent, Op, Recorder};
use crate::relay::Relay;
use crate::replicated::{EtcdCluster, PgPair, Replicated, Sentinels, MASTER, USER};

/// Where everything listens unless it must be reachable from a namespace.
const LOCAL: Ipv4Addr = Ipv4Addr::LOCALHOST;
/// Lease TTL derived from { p99_work 1000ms, p99_rtt 50ms, safety_margin 200ms,
/// drift_buffer 200ms } = 1450ms, rounded up to 1500ms.
const TTL: Duration = Duration::from_millis(1500);
const DRIFT: Duration = Duration::from_millis(200);
/// The fence's `timeouts.upstream`, and how long a slow ledger commit takes.
const FENCE_UPSTREAM_TIMEOUT: Duration = Duration::from_millis(300);
const SLOW_COMMIT: Duration = Duration::from_millis(600);
/// How long a frozen fence stays frozen once writes queue on it.
const FENCE_FREEZE_DWELL: Duration = Duration::from_millis(800);
const WRITES_PER_HOLD: usize = 4;
const WORKERS_PER_GROUP: usize = 3;
/// Every client request is bounded (a frozen process must not hang a worker forever).
const CLIENT_BOUND: Duration = Duration::from_secs(10);
/// How long a worker waits for an attempt before it retries the write (same key, token and
/// body); the attempt itself runs on and its answer is recorded.
const ATTEMPT_TIMEOUT: Duration = Duration::from_millis(700);
const MAX_ATTEMPTS: usize = 6;
/// The pause before a retry after `409 idempotency-in-flight`.
const IN_FLIGHT_PAUSE: Duration = Duration::from_millis(100);
/// The group whose fence checks tokens against the lease backend (`fence.authority: leases`);
/// its store is a PostgreSQL cluster of the run (a Redis if this machine has none).
const AUTH_GROUP: usize = 2;
/// `timeouts.upstream` of the fences whose stores the stalled-store fault stops (groups 1 and
/// 2): longer than the stall's slow commit, so that a keyed write is still legitimately in
/// flight while the store stalls.
const LONG_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);
/// Every fence's `timeouts.store`.
const STORE_TIMEOUT: Duration = Duration::from_millis(500);
/// The stalled-store fault: SIGSTOP of the store's server processes, shorter and longer than
/// `timeouts.store`, while a keyed write takes this long at the ledger.
const STALL_SHORT: Duration = Duration::from_millis(250);
const STALL_LONG: Duration = Duration::from_millis(1500);
const STALL_COMMIT: Duration = Duration::from_secs(2);
/// The groups the faults other than the failovers are injected on.
const BASE_GROUPS: usize = 3;
/// The groups whose fence store is replicated, one per failover fault.
const SENTINEL_GROUP: usize = 3;
const PG_HA_GROUP: usize = 4;
const ETCD_GROUP: usize = 5;
/// The resource id the slow-body fault hands over mid-body (in the authoritative group).
const SLOW_BODY_ID: &str = "f2s";
/// The writer the harness's own keyed writes name (the clock-step and full-disk faults': they
/// hold no lease).
const HARNESS_WRITER: &str = "clockstep";

type HttpClient<B> = Client<HttpConnector, B>;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Mode {
    /// Workers write through their egress sidecar, which attaches the token, to the fence.
    Fenced,
    /// Negative control: workers write straight to the ledger with their token, unchecked.
    Naive,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub enum Fault {
    WorkerFreeze,
    FenceKill9,
    RedisKill9,
    FenceFreeze,
    FenceSigterm,
    SlowUpstream,
    Partition,
    LossyLink,
    StoreStall,
    SlowBody,
    SigtermWaiting,
    ConfigReload,
    ClockStep,
    FullDisk,
    SlowDisk,
    StoreLatency,
    RedisFailover,
    RedisDeposed,
    PostgresFailover,
    EtcdLeaderKill,
}

impl Fault {
    pub const ALL: [Fault; 20] = [
        Fault::WorkerFreeze,
        Fault::FenceKill9,
        Fault::RedisKill9,
        Fault::FenceFreeze,
        Fault::FenceSigterm,
        Fault::SlowUpstream,
        Fault::Partition,
        Fault::LossyLink,
        Fault::StoreStall,
        Fault::SlowBody,
        Fault::SigtermWaiting,
        Fault::ConfigReload,
        Fault::ClockStep,
        Fault::FullDisk,
        Fault::SlowDisk,
        Fault::StoreLatency,
        Fault::RedisFailover,
        Fault::RedisDeposed,
        Fault::PostgresFailover,
        Fault::EtcdLeaderKill,
    ];

    pub fn describe(self) -> &'static str {
        match self {
            Fault::WorkerFreeze => {
                "worker + its sidecar frozen past the TTL (SIGSTOP/SIGCONT, the GC pause)"
            }
            Fault::FenceKill9 => "fence sidecar (embedded store) kill -9, restart",
            Fault::RedisKill9 => "fence store's Redis kill -9, restart (AOF fsync always)",
            Fault::FenceFreeze => "fence sidecar frozen while requests queue (SIGSTOP/SIGCONT)",
            Fault::FenceSigterm => "fence sidecar SIGTERM under load, restart",
            Fault::SlowUpstream => "ledger commits slower than the fence's upstream timeout",
            Fault::Partition => {
                "sidecar cut off from the lease Redis past the TTL (netns + nftables drop), still running"
            }
            Fault::LossyLink => {
                "lossy link: 30% of the packets between a namespaced sidecar and the lease Redis dropped, both ways, for 2 s while its worker writes (nftables numgen random; no netem in this kernel)"
            }
            Fault::StoreStall => {
                "fence store stopped (SIGSTOP/SIGCONT: PostgreSQL of group 2, Redis of group 1) past / within timeouts.store while a keyed write is at a slow ledger"
            }
            Fault::SlowBody => {
                "authoritative fence: a keyed write's body stalls while its lease passes to another holder, then ends"
            }
            Fault::SigtermWaiting => {
                "sidecar SIGTERM while an acquisition waits on its lease API; backend read after the exit"
            }
            Fault::ConfigReload => {
                "fence config file changed under load: to YAML that does not parse (refused), to a valid edit, back (SIGHUP each)"
            }
            Fault::ClockStep => {
                "fence sidecar's wall clock (embedded store) an hour ahead, then a day back, then right (libfaketime; its monotonic clock untouched): a keyed write completed before each step is replayed, not run again"
            }
            Fault::FullDisk => {
                "the embedded store's disk (a 64 MiB tmpfs) filled to the last byte while the group writes, emptied, then the fence killed (-9) and restarted: what it admitted meanwhile is durable"
            }
            Fault::SlowDisk => {
                "the embedded store's fsyncs made slow (an LD_PRELOAD library), within then past timeouts.store, while the group writes; then the fence killed (-9) and restarted: every write it admitted waited for its sync"
            }
            Fault::StoreLatency => {
                "latency added between a fence and its Redis store (a delaying relay; no netem in this kernel), within then past timeouts.store, while the group writes"
            }
            Fault::RedisFailover => {
                "Redis primary (fence store and lease backend of the group) kill -9, Sentinel promotes a replica (replicas: 1); old primary back as a replica"
            }
            Fault::RedisDeposed => {
                "Redis primary the Sentinels cannot PING (an ACL on their user) while it still serves the group: a replica promoted, the old primary a primary with a replica until the Sentinels move it; it answers them again and rejoins"
            }
            Fault::PostgresFailover => {
                "fence store's PostgreSQL primary kill -9, synchronous standby promoted (replicas: 1); new standby from it"
            }
            Fault::EtcdLeaderKill => {
                "fence store's etcd leader kill -9 (3 members), the others elect a leader; member restarted"
            }
        }
    }
}

/// One injected fault and what followed.
#[derive(Debug, Clone)]
pub struct Injected {
    pub fault: Fault,
    pub group: usize,
    /// From the start of the fault to its end (resume, restart ready, ...).
    pub duration: Duration,
    /// From the end of the fault to the next successful write it concerns.
    pub recovery: Option<Duration>,
    pub note: String,
}

/// The run's outcome.
pub struct Outcome {
    pub mode: Mode,
    pub ran_for: Duration,
    pub history: History,
    pub violations: Vec<Violation>,
    pub ops: Vec<Op>,
    pub commits: usize,
    pub grants: usize,
    pub faults: Vec<Injected>,
    /// Fault kinds this machine cannot inject, and why.
    pub skipped: Vec<(Fault, String)>,
    /// Extra evidence: (check, passed, total).
    pub evidence: Vec<(String, usize, usize)>,
}

/// Runs one scenario for `secs` of fault injection (fenced) or one deterministic pause
/// (naive), then checks the history.
pub async fn run(mode: Mode, secs: u64) -> Outcome {
    let clock = Clock::new();
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::start(clock, SLOW_COMMIT, &dir.path().join("ledger.log")).await;
    let ctx = Arc::new(Ctx {
        clock,
        rec: Arc::new(Recorder::default()),
        ledger,
        dir,
        lease_prefix: fresh_prefix(),
    });
    let groups = match mode {
        Mode::Fenced => BASE_GROUPS + 3,
        Mode::Naive => 1,
    };
    // The partition fault's namespaces (one per group), when this machine allows them.
    let mut skipped = Vec::new();
    let mut lab = None;
    if mode == Mode::Fenced {
        match Lab::setup(BASE_GROUPS) {
            Ok(l) => lab = Some(l),
            Err(reason) => {
                skipped.push((Fault::Partition, reason.clone()));
                skipped.push((Fault::LossyLink, reason));
            }
        }
    }
    let also = lab
        .iter()
        .flat_map(|l| l.links.iter().map(|k| k.host_addr))
        .collect();
    // The lease backend of every worker sidecar: a Redis of the run's own, reachable from the
    // namespaces through the host ends of their veth pairs.
    let lease_redis = Redis::start_on(false, also).await;
    if let Some(l) = &lab {
        if let Err(reason) = l.probe(lease_redis.port).await {
            skipped.push((Fault::Partition, reason.clone()));
            skipped.push((Fault::LossyLink, reason));
            lab = None;
        }
    }
    for (fault, reason) in &skipped {
        let kind = format!("{fault:?}").to_lowercase();
        println!("  SKIPPED {kind} fault: {reason}");
    }
    let mut rig = Rig {
        fences: Vec::new(),
        workers: Vec::new(),
        lab,
        lease_redis,
    };
    // Reachable from the host and from the group's namespace: the host end of its veth.
    let host_ip = |rig: &Rig, g: usize| {
        rig.lab
            .as_ref()
            .and_then(|l| l.links.get(g))
            .map_or(LOCAL, |k| k.host_addr)
    };
    if mode == Mode::Fenced {
        let lease_url = rig.lease_redis.url();
        for g in 0..groups {
            let authority = (g == AUTH_GROUP).then_some((lease_url.as_str(), &*ctx.lease_prefix));
            let (fence, unavailable) = start_fence(
                ctx.dir.path(),
                g,
                &ctx.ledger.url(),
                host_ip(&rig, g),
                authority,
            )
            .await;
            if let (Some(fault), Some(reason)) = (failover_fault(g), unavailable) {
                let kind = format!("{fault:?}").to_lowercase();
                println!("  SKIPPED {kind} fault (group {g} fences with a memory store): {reason}");
                if fault == Fault::RedisFailover {
                    skipped.push((Fault::RedisDeposed, reason.clone()));
                }
                skipped.push((fault, reason));
            }
            rig.fences.push(fence);
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks: Vec<JoinHandle<()>> = Vec::new();
    let mut streams: Vec<JoinHandle<()>> = Vec::new();
    for g in 0..groups {
        for i in 0..WORKERS_PER_GROUP {
            let name = format!("w{g}{i}");
            let egress_to = rig.fences.get(g).map(|f| f.process.proxy);
            // The group's last worker runs its sidecar in the group's namespace (the groups
            // the partition fault is injected on have one).
            let link = rig
                .lab
                .as_ref()
                .filter(|l| i == WORKERS_PER_GROUP - 1 && g < l.links.len())
                .map(|l| (g, l.links[g].clone()));
            let (redis, ip) = match &link {
                Some((_, k)) => (rig.lease_redis.url_at(k.host_addr), k.ns_addr),
                None => (rig.lease_redis.url(), LOCAL),
            };
            // The Sentinel group's sidecars lease from its fence store's Sentinels too: the
            // Redis failover fault fails over its leases and its fence at once.
            let sentinel = match rig.fences.get(g).and_then(|f| f.replicated.as_ref()) {
                Some(Replicated::Sentinel(s)) => Some(s.yaml()),
                _ => None,
            };
            let backend = lease_backend(&redis, sentinel.as_deref());
            let config = write_config(
                ctx.dir.path(),
                &format!("{name}.yaml"),
                &sidecar_yaml(&ctx.lease_prefix, &backend, ip, egress_to),
            );
            let sidecar = match (&link, &rig.lab) {
                (Some((n, _)), Some(l)) => Fencegate::start_with(&l.exec_prefix(*n), &config).await,
                _ => Fencegate::start(&config).await,
            };
            let (gate, gate_rx) = watch::channel(true);
            let (holding_tx, holding) = watch::channel(None);
            let mut followed = resources(mode, g);
            if mode == Mode::Fenced && g == AUTH_GROUP && i < 2 {
                // The two holders of the slow-body fault's hand-over.
                followed.push(SLOW_BODY_ID.to_owned());
            }
            for id in followed {
                streams.push(tokio::spawn(follow_events(
                    Arc::clone(&ctx),
                    name.clone(),
                    sidecar.leases.unwrap(),
                    format!("account:{id}"),
                )));
            }
            let target = match mode {
                Mode::Fenced => sidecar.egress.unwrap(),
                Mode::Naive => ctx.ledger.addr,
            };
            tasks.push(tokio::spawn(worker_loop(WorkerSpec {
                ctx: Arc::clone(&ctx),
                name: name.clone(),
                group: g,
                mode,
                offset: i,
                leases: sidecar.leases.unwrap(),
                target,
                resources: resources(mode, g),
                gate: gate_rx,
                holding: holding_tx,
                stop: Arc::clone(&stop),
            })));
            rig.workers.push(Worker {
                name,
                group: g,
                sidecar,
                link: link.map(|(n, _)| n),
                gate,
                holding,
            });
        }
    }
    let started = std::time::Instant::now();
    let mut faults = Vec::new();
    let mut evidence: HashMap<String, (usize, usize)> = HashMap::new();
    // Steady state first: every group writes.
    for g in 0..groups {
        let ok = ctx
            .rec
            .wait_ok(0, 3, Duration::from_secs(20), |o| o.group == g)
            .await;
        assert!(ok.is_some(), "group {g} never wrote successfully");
    }
    match mode {
        Mode::Fenced => {
            let active: Vec<Fault> = Fault::ALL
                .into_iter()
                .filter(|f| !skipped.iter().any(|(s, _)| s == f))
                .collect();
            let budget = Duration::from_secs(secs);
            // Only against a runaway: three rounds with the failovers take about 85 s on a
            // loaded 2-core machine, and a slower one must still finish them.
            let hard_stop = budget * 3 + Duration::from_secs(180);
            let mut round = 0usize;
            loop {
                let elapsed = started.elapsed();
                let rounds_done = round / active.len();
                if (elapsed >= budget && rounds_done >= 3 && round % active.len() == 0)
                    || elapsed >= hard_stop
                {
                    break;
                }
                let fault = active[round % active.len()];
                let group = match fault {
                    Fault::FenceKill9 | Fault::ClockStep | Fault::FullDisk | Fault::SlowDisk => 0,
                    Fault::RedisKill9 | Fault::StoreLatency => 1,
                    Fault::SlowBody => AUTH_GROUP,
                    // Long on group 2's store, long on group 1's, short, short.
                    Fault::StoreStall => [AUTH_GROUP, 1][rounds_done % 2],
                    Fault::RedisFailover | Fault::RedisDeposed => SENTINEL_GROUP,
                    Fault::PostgresFailover => PG_HA_GROUP,
                    Fault::EtcdLeaderKill => ETCD_GROUP,
                    _ => rounds_done % BASE_GROUPS,
                };
                let injected = inject(
                    &ctx,
                    fault,
                    group,
                    round,
                    rounds_done,
                    &mut rig,
                    &mut evidence,
                )
                .await;
                println!(
                    "  [{:>6.1}s] {:?} on group {}: {:?} down, recovery {:?} {}",
                    started.elapsed().as_secs_f64(),
                    injected.fault,
                    injected.group,
                    injected.duration,
                    injected.recovery,
                    injected.note
                );
                faults.push(injected);
                // Between faults: back to steady writing in every group (explicit signal).
                let now = ctx.clock.now();
                for g in 0..groups {
                    ctx.rec
                        .wait_ok(now, 2, Duration::from_secs(10), |o| o.group == g)
                        .await;
                }
                for f in &mut rig.fences {
                    f.process.drain_logs();
                }
                for w in &mut rig.workers {
                    w.sidecar.drain_logs();
                }
                round += 1;
            }
        }
        Mode::Naive => {
            let injected =
                inject(&ctx, Fault::WorkerFreeze, 0, 0, 0, &mut rig, &mut evidence).await;
            println!(
                "  [{:>6.1}s] {:?} on group {}: {:?} down, recovery {:?} {}",
                started.elapsed().as_secs_f64(),
                injected.fault,
                injected.group,
                injected.duration,
                injected.recovery,
                injected.note
            );
            faults.push(injected);
            // Without the fence, a write slower than its writer's patience is applied once per
            // attempt of its key: one commit of the group delayed past the attempt timeout.
            let (arrived, done) = ctx.ledger.arm_slow_on(1, STALL_COMMIT, Some("account:n0x"));
            ctx.ledger
                .slow_arrivals_reach(arrived + 1, Duration::from_secs(10))
                .await;
            ctx.ledger
                .slow_commits_reach(done + 1, Duration::from_secs(10))
                .await;
            ctx.ledger.arm_slow_on(0, STALL_COMMIT, None);
            // Without the drain: a sidecar holding a lease is killed (kill -9), and its lease
            // stays in the backend.
            let killed = leave_a_lease_behind(&ctx, &rig).await;
            println!("  naive sidecar exit: {killed}");
            let now = ctx.clock.now();
            ctx.rec
                .wait_ok(now, 10, Duration::from_secs(10), |_| true)
                .await;
        }
    }
    // Stop: workers finish their current hold and release it.
    stop.store(true, Ordering::SeqCst);
    for w in &rig.workers {
        let _ = w.gate.send(true);
    }
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(30), t).await;
    }
    // Attempts a worker stopped waiting for still run (each bounded by the client's own
    // bound): their answers belong to the history.
    for g in 0..groups {
        let mut in_flight = ctx.rec.in_flight(g);
        let _ = tokio::time::timeout(CLIENT_BOUND, in_flight.wait_for(|&n| n == 0)).await;
    }
    let unended = ctx.rec.wait_terminal_events(Duration::from_secs(5)).await;
    if !unended.is_empty() {
        println!("  note: no end event (released/lost) received for grants {unended:?}");
    }
    let ran_for = started.elapsed();
    for s in streams {
        s.abort();
    }
    let commits: Vec<checker::Commit> = ctx.ledger.log().into_iter().map(|(c, _)| c).collect();
    let arrivals = ctx.ledger.arrivals();
    let history = crate::record::history(&ctx.rec, commits.clone(), &arrivals, TTL - DRIFT);
    let violations = checker::check(&history);
    let ops = ctx.rec.ops.lock().unwrap().clone();
    // The token each write carried at the ledger is the one its writer was granted (the
    // harness's own writes hold no lease: they are left out).
    let by_op: HashMap<&str, &Op> = ops.iter().map(|o| (o.op.as_str(), o)).collect();
    let granted: Vec<&checker::Commit> = commits
        .iter()
        .filter(|c| c.writer != HARNESS_WRITER)
        .collect();
    let matching = granted
        .iter()
        .filter(|c| by_op.get(c.op.as_str()).is_some_and(|o| o.token == c.token))
        .count();
    evidence.insert(
        "ledger token = writer's granted token".into(),
        (matching, granted.len()),
    );
    let grants = ctx.rec.acquired.lock().unwrap().len();
    for w in &mut rig.workers {
        w.sidecar.signal("-TERM");
    }
    for w in &mut rig.workers {
        let _ = tokio::time::timeout(Duration::from_secs(10), w.sidecar.child.wait()).await;
    }
    // Processes first, then the namespaces, the nftables table and the lease Redis.
    drop(rig);
    let mut evidence: Vec<(String, usize, usize)> =
        evidence.into_iter().map(|(k, (a, b))| (k, a, b)).collect();
    evidence.sort();
    Outcome {
        mode,
        ran_for,
        history,
        violations,
        ops,
        commits: commits.len(),
        grants,
        faults,
        skipped,
        evidence,
    }
}

fn note(evidence: &mut Evidence, what: &str, passed: bool) {
    let e = evidence.entry(what.to_owned()).or_default();
    e.0 += usize::from(passed);
    e.1 += 1;
}

/// Median of a list of durations.
pub fn percentile(mut v: Vec<Duration>, p: f64) -> Option<Duration> {
    if v.is_empty() {
        return None;
    }
    v.sort();
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    Some(v[i])
}
