//! The chaos run: a ledger, fence sidecars in front of it, workers that acquire leases
//! through their own sidecars (Redis lease backend) and write through egress with an
//! idempotency key (retrying a write with the same key), and a fault loop. Group 2's fence is
//! authoritative (`fence.authority: leases`). Also the negative control: the same workers
//! writing straight to the ledger.

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

use crate::checker::{self, Exit, History, Violation};
use crate::clock::Clock;
use crate::ledger::Ledger;
use crate::netns::Lab;
use crate::procs::{
    free_port, fresh_prefix, leases_held_by, wait_log, write_config, Fencegate, Postgres, Redis,
};
use crate::record::{Acquired, LeaseEvent, Op, Recorder};

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
/// The resource id the slow-body fault hands over mid-body (in the authoritative group).
const SLOW_BODY_ID: &str = "f2s";

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
    StoreStall,
    SlowBody,
    SigtermWaiting,
}

impl Fault {
    pub const ALL: [Fault; 10] = [
        Fault::WorkerFreeze,
        Fault::FenceKill9,
        Fault::RedisKill9,
        Fault::FenceFreeze,
        Fault::FenceSigterm,
        Fault::SlowUpstream,
        Fault::Partition,
        Fault::StoreStall,
        Fault::SlowBody,
        Fault::SigtermWaiting,
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
            Fault::StoreStall => {
                "fence store stopped (SIGSTOP/SIGCONT: PostgreSQL of group 2, Redis of group 1) past / within timeouts.store while a keyed write is at a slow ledger"
            }
            Fault::SlowBody => {
                "authoritative fence: a keyed write's body stalls while its lease passes to another holder, then ends"
            }
            Fault::SigtermWaiting => {
                "sidecar SIGTERM while an acquisition waits on its lease API; backend read after the exit"
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

/// A fence sidecar and how to restart it.
struct Fence {
    config: PathBuf,
    process: Fencegate,
    /// The fence store's own Redis (group 1, and group 2 without PostgreSQL).
    redis: Option<Redis>,
    /// The fence store's own PostgreSQL (group 2).
    postgres: Option<Postgres>,
}

struct Worker {
    name: String,
    group: usize,
    sidecar: Fencegate,
    /// The namespace (link index) its sidecar runs in, if any.
    link: Option<usize>,
    gate: watch::Sender<bool>,
    holding: watch::Receiver<Option<(String, u64, usize)>>,
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

/// The run's processes and network namespaces. Fields drop in order: the processes (killed on
/// drop) before the namespaces, the nftables table and the lease Redis, also when unwinding.
struct Rig {
    fences: Vec<Fence>,
    workers: Vec<Worker>,
    lab: Option<Lab>,
    lease_redis: Redis,
}

struct Ctx {
    clock: Clock,
    rec: Arc<Recorder>,
    ledger: Ledger,
    dir: tempfile::TempDir,
    lease_prefix: String,
}

/// Resource ids of a group (the route is `/accounts/{id}`, the resource `account:{id}`).
fn resources(mode: Mode, group: usize) -> Vec<String> {
    let tag = match mode {
        Mode::Fenced => "f",
        Mode::Naive => "n",
    };
    (0..2).map(|i| format!("{tag}{group}x{i}")).collect()
}

/// A fence: `store`, `timeouts.upstream`, and `authority` (a lease backend's URL and prefix)
/// for `fence.authority: leases`. Idempotency keys apply on its route.
fn fence_yaml(
    ip: Ipv4Addr,
    port: u16,
    ledger: &str,
    store: &str,
    upstream: Duration,
    authority: Option<(&str, &str)>,
) -> String {
    let authority = match authority {
        Some((redis, prefix)) => format!(
                "fence: {{ authority: leases }}\nleases:\n  listen: 127.0.0.1:0\n  \
                 backend: {{ kind: redis, url: '{redis}', prefix: {prefix} }}\n  \
                 ttl: {{ p99_work: 1000ms, p99_rtt: 50ms, safety_margin: 200ms, drift_buffer: {}ms }}\n",
            DRIFT.as_millis()
        ),
        None => String::new(),
    };
    format!(
        "listen: {ip}:{port}\nadmin: 127.0.0.1:0\nupstream: {ledger}\n{store}\
         timeouts: {{ upstream: {}ms, shutdown: 2s, store: {}ms }}\n{authority}\
         idempotency: {{ window: 3s }}\n\
         routes:\n  - {{ name: accounts, path: '/accounts/{{id}}', resource: 'account:{{id}}', ordering: serialize, barrier_timeout: 2s }}\n",
        upstream.as_millis(),
        STORE_TIMEOUT.as_millis()
    )
}

/// A worker's sidecar: leases from `redis`, its lease API and egress listening on `ip`.
fn sidecar_yaml(prefix: &str, redis: &str, ip: Ipv4Addr, egress_to: Option<SocketAddr>) -> String {
    let egress = match egress_to {
        Some(fence) => format!(
            "egress:\n  listen: {ip}:0\n  upstream: http://{fence}\n  routes:\n    - {{ path: '/accounts/{{id}}', lease: 'account:{{id}}' }}\n"
        ),
        None => String::new(),
    };
    format!(
        "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://127.0.0.1:9\nstore: {{ kind: memory }}\n\
         timeouts: {{ upstream: 5s, shutdown: 1s }}\n\
         leases:\n  listen: {ip}:0\n  backend: {{ kind: redis, url: '{redis}', prefix: {prefix} }}\n  \
         ttl: {{ p99_work: 1000ms, p99_rtt: 50ms, safety_margin: 200ms, drift_buffer: {}ms }}\n  \
         acquire: {{ base_delay: 20ms, max_delay: 200ms, jitter: 20ms }}\n{egress}",
        DRIFT.as_millis()
    )
}

async fn start_fence(
    dir: &Path,
    group: usize,
    ledger: &str,
    ip: Ipv4Addr,
    authority: Option<(&str, &str)>,
) -> Fence {
    let port = free_port();
    let (mut redis, mut postgres) = (None, None);
    let store = if group == 0 {
        format!(
            "store: {{ kind: embedded, path: {} }}\n",
            dir.join("fences.db").display()
        )
    } else {
        let pg = match group {
            AUTH_GROUP => Some(Postgres::start().await),
            _ => None,
        };
        let (kind, url) = match pg {
            Some(Ok(pg)) => {
                let url = pg.url();
                postgres = Some(pg);
                ("postgres", url)
            }
            other => {
                if let Some(Err(reason)) = other {
                    println!("  SKIPPED postgres store (group {group} uses a Redis): {reason}");
                }
                let r = Redis::start().await;
                let url = r.url();
                redis = Some(r);
                ("redis", url)
            }
        };
        format!(
            "store: {{ kind: {kind}, url: '{url}', prefix: {} }}\n",
            fresh_prefix()
        )
    };
    let upstream = match group {
        0 => FENCE_UPSTREAM_TIMEOUT,
        _ => LONG_UPSTREAM_TIMEOUT,
    };
    let config = write_config(
        dir,
        &format!("fence{group}.yaml"),
        &fence_yaml(ip, port, ledger, &store, upstream, authority),
    );
    let process = Fencegate::start(&config).await;
    Fence {
        config,
        process,
        redis,
        postgres,
    }
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
        Mode::Fenced => 3,
        Mode::Naive => 1,
    };
    // The partition fault's namespaces (one per group), when this machine allows them.
    let mut skipped = Vec::new();
    let mut lab = None;
    if mode == Mode::Fenced {
        match Lab::setup(groups) {
            Ok(l) => lab = Some(l),
            Err(reason) => skipped.push((Fault::Partition, reason)),
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
            skipped.push((Fault::Partition, reason));
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
    let host_ip = |rig: &Rig, g: usize| rig.lab.as_ref().map_or(LOCAL, |l| l.links[g].host_addr);
    if mode == Mode::Fenced {
        let lease_url = rig.lease_redis.url();
        for g in 0..groups {
            let authority = (g == AUTH_GROUP).then_some((lease_url.as_str(), &*ctx.lease_prefix));
            let fence = start_fence(
                ctx.dir.path(),
                g,
                &ctx.ledger.url(),
                host_ip(&rig, g),
                authority,
            )
            .await;
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
            // The group's last worker runs its sidecar in the group's namespace.
            let link = rig
                .lab
                .as_ref()
                .filter(|_| i == WORKERS_PER_GROUP - 1)
                .map(|l| (g, l.links[g].clone()));
            let (redis, ip) = match &link {
                Some((_, k)) => (rig.lease_redis.url_at(k.host_addr), k.ns_addr),
                None => (rig.lease_redis.url(), LOCAL),
            };
            let config = write_config(
                ctx.dir.path(),
                &format!("{name}.yaml"),
                &sidecar_yaml(&ctx.lease_prefix, &redis, ip, egress_to),
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
            let hard_stop = budget * 3 + Duration::from_secs(60);
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
                    Fault::FenceKill9 => 0,
                    Fault::RedisKill9 => 1,
                    Fault::SlowBody => AUTH_GROUP,
                    // Long on group 2's store, long on group 1's, short, short.
                    Fault::StoreStall => [AUTH_GROUP, 1][rounds_done % 2],
                    _ => rounds_done % groups,
                };
                let injected = inject(&ctx, fault, group, round, &mut rig, &mut evidence).await;
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
            let injected = inject(&ctx, Fault::WorkerFreeze, 0, 0, &mut rig, &mut evidence).await;
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
    // The token each write carried at the ledger is the one its writer was granted.
    let by_op: HashMap<&str, &Op> = ops.iter().map(|o| (o.op.as_str(), o)).collect();
    let matching = commits
        .iter()
        .filter(|c| by_op.get(c.op.as_str()).is_some_and(|o| o.token == c.token))
        .count();
    evidence.insert(
        "ledger token = writer's granted token".into(),
        (matching, commits.len()),
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

fn note(evidence: &mut HashMap<String, (usize, usize)>, what: &str, passed: bool) {
    let e = evidence.entry(what.to_owned()).or_default();
    e.0 += usize::from(passed);
    e.1 += 1;
}

/// The highest token committed per resource of a group, from the ledger's log.
fn committed_maxima(ctx: &Ctx, mode: Mode, group: usize) -> HashMap<String, u64> {
    let mut out = HashMap::new();
    let wanted: Vec<String> = resources(mode, group)
        .into_iter()
        .map(|id| format!("account:{id}"))
        .collect();
    for (c, _) in ctx.ledger.log() {
        if wanted.contains(&c.resource) {
            let slot = out.entry(c.resource).or_insert(c.token);
            *slot = (*slot).max(c.token);
        }
    }
    out
}

/// The fence's recorded maxima still cover everything the ledger committed.
async fn maxima_kept(ctx: &Ctx, fence: &Fence, group: usize) -> bool {
    let client: HttpClient<Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    for (resource, committed) in committed_maxima(ctx, Mode::Fenced, group) {
        let url = format!("http://{}/v1/fences/{resource}", fence.process.admin);
        let Some((status, body)) = request(&client, Method::GET, &url, &[], Bytes::new()).await
        else {
            return false;
        };
        let recorded = (status == 200)
            .then(|| serde_json::from_slice::<serde_json::Value>(&body).ok())
            .flatten()
            .and_then(|v| v["token"].as_u64());
        if recorded.is_none_or(|r| r < committed) {
            println!("  maxima lost on {resource}: recorded {recorded:?}, committed {committed}");
            return false;
        }
    }
    true
}

/// Sends one write with `token` directly to the fence (no sidecar), recorded like any other.
async fn replay(
    ctx: &Ctx,
    writer: &str,
    group: usize,
    fence: SocketAddr,
    resource: &str,
    token: u64,
) -> u16 {
    let client: HttpClient<Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let id = resource.trim_start_matches("account:");
    let op = format!("{writer}-replay-{}", OP_SEQ.fetch_add(1, Ordering::Relaxed));
    ctx.rec.note_sent(group);
    let sent = ctx.clock.now();
    let answer = request(
        &client,
        Method::PUT,
        &format!("http://{fence}/accounts/{id}"),
        &[
            ("fencing-token", token.to_string()),
            ("x-writer", writer.to_owned()),
            ("x-op", op.clone()),
        ],
        Bytes::from_static(b"replayed"),
    )
    .await;
    let status = answer.as_ref().map_or(0, |(s, _)| *s);
    ctx.rec.push_op(Op {
        writer: writer.to_owned(),
        group,
        op,
        resource: resource.to_owned(),
        token,
        key: None,
        status,
        problem: answer.and_then(|(_, body)| problem_type(&body)),
        sent,
        done: sent,
        answered: ctx.clock.now(),
    });
    status
}

/// A fresh sidecar of the run's lease backend (no egress), named for its holder id.
async fn lone_sidecar(ctx: &Ctx, lease_url: &str, holder: &str) -> Fencegate {
    let config = write_config(
        ctx.dir.path(),
        &format!("{holder}.yaml"),
        &sidecar_yaml(&ctx.lease_prefix, lease_url, LOCAL, None),
    );
    Fencegate::start(&config).await
}

/// `POST /v1/leases/{resource}` on a lease API; the token granted, if any.
async fn acquire(
    client: &HttpClient<Full<Bytes>>,
    api: SocketAddr,
    resource: &str,
    holder: &str,
    wait: &str,
) -> Option<u64> {
    let (status, body) = request(
        client,
        Method::POST,
        &format!("http://{api}/v1/leases/{resource}"),
        &[("content-type", "application/json".into())],
        Bytes::from(format!(r#"{{"holder":"{holder}","wait":"{wait}"}}"#)),
    )
    .await?;
    (status == 200)
        .then(|| serde_json::from_slice::<serde_json::Value>(&body).ok())
        .flatten()
        .and_then(|v| v["fencing_token"].as_u64())
}

/// `DELETE /v1/leases/{resource}` on a lease API; its status.
async fn release(client: &HttpClient<Full<Bytes>>, api: SocketAddr, resource: &str) -> u16 {
    let url = format!("http://{api}/v1/leases/{resource}");
    request(client, Method::DELETE, &url, &[], Bytes::new())
        .await
        .map_or(0, |(s, _)| s)
}

/// The naive control of (f): a sidecar holding a lease is killed without its drain, and the
/// backend is read after its exit.
async fn leave_a_lease_behind(ctx: &Ctx, rig: &Rig) -> String {
    let client: HttpClient<Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let holder = "dnaive";
    let mut s = lone_sidecar(ctx, &rig.lease_redis.url(), holder).await;
    let resource = format!("account:{holder}a");
    let token = acquire(&client, s.leases.unwrap(), &resource, holder, "1s").await;
    s.signal("-KILL");
    s.exited(Duration::from_secs(10)).await;
    let exited = ctx.clock.now();
    let held = leases_held_by(&rig.lease_redis.url(), &ctx.lease_prefix, holder).await;
    let text =
        format!("{holder} held {resource} with token {token:?}, killed; backend holds {held:?}");
    ctx.rec.exits.lock().unwrap().push(Exit {
        holder: holder.to_owned(),
        how: "kill -9 (no drain)".into(),
        exited,
        held,
    });
    text
}

/// An HTTP/1.1 head read from a raw connection: its status and everything read after it.
async fn read_head(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<u16> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            buf.drain(..end + 4);
            return head.split_whitespace().nth(1)?.parse().ok();
        }
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Sends a keyed write straight to the authoritative fence with its body in two halves: the
/// head (with `Expect: 100-continue`), then, once the fence asks for the body (it has checked
/// the token against the lease backend: hyper answers `100 Continue` when the body is first
/// read), the first half; then `hand_over` runs; then the second half. Recorded as an op of
/// `writer` whose `done` is the instant the last byte went out.
#[allow(clippy::too_many_arguments)]
async fn slow_body_write<F: std::future::Future<Output = ()>>(
    ctx: &Ctx,
    writer: &str,
    group: usize,
    fence: SocketAddr,
    resource: &str,
    token: u64,
    hand_over: F,
) -> Op {
    let id = resource.trim_start_matches("account:");
    let op = format!(
        "{writer}-slowbody-{}",
        OP_SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let key = format!("{writer}-kslow{}", OP_SEQ.fetch_add(1, Ordering::Relaxed));
    let body = format!(
        "{key} by {writer} under {token}, sent slowly: {:>32}",
        "end"
    );
    let (first, second) = body.as_bytes().split_at(body.len() / 2);
    let head = format!(
        "PUT /accounts/{id} HTTP/1.1\r\nhost: {fence}\r\nfencing-token: {token}\r\n\
         idempotency-key: {key}\r\nx-writer: {writer}\r\nx-op: {op}\r\n\
         content-length: {}\r\nexpect: 100-continue\r\nconnection: close\r\n\r\n",
        body.len()
    );
    ctx.rec.note_sent(group);
    let sent = ctx.clock.now();
    let mut done = sent;
    let answer = tokio::time::timeout(CLIENT_BOUND, async {
        let mut s = TcpStream::connect(fence).await.ok()?;
        s.write_all(head.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        let status = read_head(&mut s, &mut buf).await?;
        if status == 100 {
            s.write_all(first).await.ok()?;
            hand_over.await;
            s.write_all(second).await.ok()?;
            done = ctx.clock.now();
            let status = read_head(&mut s, &mut buf).await?;
            let _ = s.read_to_end(&mut buf).await;
            return Some((status, buf));
        }
        // Refused at once, before the body was asked for.
        let _ = s.read_to_end(&mut buf).await;
        Some((status, buf))
    })
    .await
    .ok()
    .flatten();
    let (status, problem) = match &answer {
        Some((status, body)) => {
            let text = String::from_utf8_lossy(body);
            let problem = text
                .find("urn:fencegate:")
                .map(|at| text[at..].split('"').next().unwrap_or_default().to_owned());
            (*status, problem)
        }
        None => (0, None),
    };
    let o = Op {
        writer: writer.to_owned(),
        group,
        op,
        resource: resource.to_owned(),
        token,
        key: Some(key),
        status,
        problem,
        sent,
        done,
        answered: ctx.clock.now(),
    };
    ctx.rec.push_op(o.clone());
    o
}

/// Waits (bounded) until the fence refuses `token` on `resource` as stale: it knows a newer
/// grant. The probe carries no op id, so if the fence still lets it through, the ledger
/// refuses it (400) and commits nothing.
async fn fence_knows_newer_grant(fence: SocketAddr, resource: &str, token: u64) -> bool {
    let client: HttpClient<Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let id = resource.trim_start_matches("account:");
    let url = format!("http://{fence}/accounts/{id}");
    let probe = async {
        loop {
            let answer = request(
                &client,
                Method::PUT,
                &url,
                &[("fencing-token", token.to_string())],
                Bytes::from_static(b"probe"),
            )
            .await;
            if let Some((409, body)) = &answer {
                if problem_type(body).as_deref() == Some("urn:fencegate:stale-token") {
                    return;
                }
            }
            pace().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(3), probe)
        .await
        .is_ok()
}

/// Waits (bounded) until the worker holds a lease with at least two writes still to come, so
/// that pausing it before its next write leaves it holding: the lease and its token.
async fn holding_with_writes_left(w: &Worker) -> Option<(String, u64)> {
    let mut holding = w.holding.clone();
    tokio::time::timeout(
        Duration::from_secs(20),
        holding.wait_for(|h| matches!(h, Some((_, _, left)) if *left >= 2)),
    )
    .await
    .ok()
    .and_then(|r| r.ok().map(|h| h.clone()))
    .flatten()
    .map(|(resource, token, _)| (resource, token))
}

/// Injects one fault, ends it, and measures the recovery.
async fn inject(
    ctx: &Ctx,
    fault: Fault,
    group: usize,
    round: usize,
    rig: &mut Rig,
    evidence: &mut HashMap<String, (usize, usize)>,
) -> Injected {
    let (fences, workers) = (&mut rig.fences, &mut rig.workers);
    let rec = &ctx.rec;
    let begin = ctx.clock.now();
    let mut note_text = String::new();
    let (end, recovery) = match fault {
        Fault::WorkerFreeze => {
            let in_group: Vec<usize> = (0..workers.len())
                .filter(|&i| workers[i].group == group)
                .collect();
            let victim = in_group[(round / Fault::ALL.len()) % in_group.len()];
            let w = &mut workers[victim];
            let Some((resource, token)) = holding_with_writes_left(w).await else {
                return Injected {
                    fault,
                    group,
                    duration: Duration::ZERO,
                    recovery: None,
                    note: format!("skipped: {} never held a lease", w.name),
                };
            };
            let _ = w.gate.send(false);
            w.sidecar.signal("-STOP");
            let frozen_at = ctx.clock.now();
            // Frozen past the TTL: until another worker has committed a higher token on the
            // victim's resource (which needs the lease to have expired in Redis).
            let name = w.name.clone();
            let overtaken = ctx
                .ledger
                .wait_commit(TTL * 6, |c| {
                    c.resource == resource && c.token > token && c.writer != name
                })
                .await;
            w.sidecar.signal("-CONT");
            let _ = w.gate.send(true);
            let end = ctx.clock.now();
            note(
                evidence,
                "frozen holder overtaken by a higher token",
                overtaken,
            );
            if let (Some(fence), true) = (fences.get(group), overtaken) {
                // The paused worker also replays its old token straight at the fence, past
                // its own sidecar (a forged or delayed write): it must be refused, not applied.
                let status = replay(ctx, &name, group, fence.process.proxy, &resource, token).await;
                note(
                    evidence,
                    "old token replayed straight at the fence refused with 409",
                    status == 409,
                );
            }
            note_text = format!(
                "{} held {resource} with token {token}, frozen {}ms, overtaken: {overtaken}",
                w.name,
                (end - frozen_at) / 1000
            );
            let victim_name = w.name.clone();
            let first = rec
                .wait_ok(end, 1, Duration::from_secs(20), |o| o.writer == victim_name)
                .await;
            (end, first)
        }
        Fault::FenceKill9 | Fault::FenceSigterm => {
            let f = &mut fences[group];
            let status = if fault == Fault::FenceKill9 {
                f.process.signal("-KILL");
                f.process.exited(Duration::from_secs(10)).await
            } else {
                f.process.signal("-TERM");
                f.process.exited(Duration::from_secs(20)).await
            };
            if fault == Fault::FenceSigterm {
                note(
                    evidence,
                    "fence exits 0 after a SIGTERM drain",
                    status.success(),
                );
            }
            f.process = Fencegate::start(&f.config).await;
            let end = ctx.clock.now();
            let kept = maxima_kept(ctx, f, group).await;
            note(
                evidence,
                &format!(
                    "recorded maxima >= committed after fence {} ({} store)",
                    if fault == Fault::FenceKill9 {
                        "kill -9"
                    } else {
                        "SIGTERM"
                    },
                    if group == 0 { "embedded" } else { "redis" }
                ),
                kept,
            );
            let first = rec
                .wait_ok(end, 1, Duration::from_secs(20), |o| o.group == group)
                .await;
            (end, first)
        }
        Fault::RedisKill9 => {
            let f = &mut fences[group];
            let redis = f.redis.as_mut().expect("group 1 has its own Redis");
            redis.kill9().await;
            // Down long enough that writes see the store gone (explicit: two writes sent).
            let mut sent = rec.sent_counter(group);
            let before = *sent.borrow();
            let _ =
                tokio::time::timeout(Duration::from_secs(2), sent.wait_for(|&n| n >= before + 2))
                    .await;
            redis.restart().await;
            let end = ctx.clock.now();
            let first = rec
                .wait_ok(end, 1, Duration::from_secs(20), |o| o.group == group)
                .await;
            let kept = maxima_kept(ctx, f, group).await;
            note(
                evidence,
                "recorded maxima >= committed after Redis kill -9 (AOF fsync always)",
                kept,
            );
            (end, first)
        }
        Fault::FenceFreeze => {
            let f = &mut fences[group];
            let mut in_flight = rec.in_flight(group);
            f.process.signal("-STOP");
            // Frozen while requests queue: until a write per resource of the group (one per
            // lease holder; the other workers wait for those leases) waits on it, bounded.
            let holders = resources(Mode::Fenced, group).len() as u64;
            // Bounded well below the egress sidecars' upstream timeout (5s): they never give
            // up on the frozen fence, so no write is abandoned half-way (see docs).
            let queued = tokio::time::timeout(
                Duration::from_secs(2),
                in_flight.wait_for(|&n| n >= holders),
            )
            .await
            .is_ok();
            // Then stays frozen past the fence's own upstream timeout: on SIGCONT its timers
            // fire late, all at once (the fault's length, not a synchronisation).
            tokio::time::sleep(FENCE_FREEZE_DWELL).await;
            f.process.signal("-CONT");
            let end = ctx.clock.now();
            note_text = format!("a write per lease queued on the frozen fence: {queued}");
            let first = rec
                .wait_ok(end, 1, Duration::from_secs(20), |o| o.group == group)
                .await;
            (end, first)
        }
        Fault::Partition => {
            let lab = rig
                .lab
                .as_ref()
                .expect("partitions are injected only with namespaces");
            let victim = workers
                .iter()
                .position(|w| w.group == group && w.link.is_some())
                .expect("a worker of each group runs in a namespace");
            let w = &workers[victim];
            let link = w.link.expect("in a namespace");
            let name = w.name.clone();
            let Some((resource, token)) = holding_with_writes_left(w).await else {
                return Injected {
                    fault,
                    group,
                    duration: Duration::ZERO,
                    recovery: None,
                    note: format!("skipped: {name} never held a lease"),
                };
            };
            // The worker stays at its next write (slow work) while its sidecar, still running,
            // renews into the partition.
            let _ = w.gate.send(false);
            let cut = lab.partition(link, rig.lease_redis.port).await;
            note(
                evidence,
                "partition applied (nftables drop rules added)",
                cut.is_ok(),
            );
            if let Err(e) = cut {
                let _ = w.gate.send(true);
                return Injected {
                    fault,
                    group,
                    duration: Duration::ZERO,
                    recovery: None,
                    note: format!("failed: {e}"),
                };
            }
            let cut_at = ctx.clock.now();
            let cut_instant = tokio::time::Instant::now();
            // Cut off past the TTL: until another worker has committed a higher token on the
            // victim's resource (which needs the lease to have expired in Redis).
            let overtaken = ctx
                .ledger
                .wait_commit(TTL * 6, |c| {
                    c.resource == resource && c.token > token && c.writer != name
                })
                .await;
            note(
                evidence,
                "partitioned holder overtaken by a higher token",
                overtaken,
            );
            // Still cut off, the worker writes again: its own sidecar, whose local deadline
            // passed without a renewal, must no longer attach the token.
            let reopened = ctx.clock.now();
            let _ = w.gate.send(true);
            let next = rec
                .wait_op(reopened, Duration::from_secs(5), |o| o.writer == name)
                .await;
            let refused = next.as_ref().is_some_and(|o| {
                o.status == 503 && o.problem.as_deref() == Some("urn:fencegate:lease-not-held")
            });
            note(
                evidence,
                "partitioned holder's next write refused by its sidecar (503 lease-not-held)",
                refused,
            );
            let lost = rec.events.lock().unwrap().iter().any(|e| {
                e.writer == name && e.resource == resource && e.token == token && e.kind == "lost"
            });
            note(
                evidence,
                "partitioned sidecar reported the lease lost (event `lost`)",
                lost,
            );
            if let (Some(fence), true) = (fences.get(group), overtaken) {
                let status = replay(ctx, &name, group, fence.process.proxy, &resource, token).await;
                note(
                    evidence,
                    "partitioned holder's old token replayed at the fence refused with 409",
                    status == 409,
                );
            }
            // Cut off for at least the TTL (the fault's length, not a synchronisation).
            tokio::time::sleep_until(cut_instant + TTL).await;
            let healed = lab.heal().await;
            let end = ctx.clock.now();
            note(
                evidence,
                "partition healed (nftables rules removed)",
                healed.is_ok(),
            );
            let first = rec
                .wait_ok(end, 1, Duration::from_secs(20), |o| o.writer == name)
                .await;
            // When it held a lease again (the first grant answered after the heal).
            let regained = rec
                .acquired
                .lock()
                .unwrap()
                .iter()
                .filter(|a| a.writer == name && a.at >= end)
                .map(|a| a.at)
                .min();
            note_text = format!(
                "{name} held {resource} with token {token}, cut off {}ms, overtaken: {overtaken}, \
                 next write {}, lease again {} after the heal",
                (end - cut_at) / 1000,
                next.map_or("unanswered".into(), |o| format!(
                    "{} {}",
                    o.status,
                    o.problem.unwrap_or_default()
                )),
                regained.map_or("-".into(), |t| format!("{}ms", (t - end) / 1000)),
            );
            (end, first)
        }
        Fault::StoreStall => {
            // Longer than `timeouts.store` twice (both stores), then shorter twice.
            let long = (round / Fault::ALL.len() / 2) % 2 == 0;
            let stall = if long { STALL_LONG } else { STALL_SHORT };
            // A keyed write of the group first reaches the ledger and stays there (a slow
            // commit, within the fence's upstream timeout but past its writer's patience, so
            // the writer retries it with its key while the store is stopped).
            let prefix = format!("account:f{group}x");
            let (arrived, done) = ctx.ledger.arm_slow_on(1, STALL_COMMIT, Some(&prefix));
            let at_ledger = ctx
                .ledger
                .slow_arrivals_reach(arrived + 1, Duration::from_secs(10))
                .await;
            let f = &fences[group];
            let stop = |signal: &str| match (&f.postgres, &f.redis) {
                (Some(pg), _) => pg.signal(signal),
                (None, Some(redis)) => redis.signal(signal),
                (None, None) => unreachable!("groups 1 and 2 have a store server"),
            };
            let store = if f.postgres.is_some() {
                "PostgreSQL (postmaster and backends)"
            } else {
                "Redis"
            };
            stop("-STOP");
            // Stopped for the fault's length (not a synchronisation).
            tokio::time::sleep(stall).await;
            stop("-CONT");
            let end = ctx.clock.now();
            let committed = ctx
                .ledger
                .slow_commits_reach(done + 1, Duration::from_secs(10))
                .await;
            ctx.ledger.arm_slow_on(0, STALL_COMMIT, None);
            note(
                evidence,
                "stalled store: a keyed write was at the slow ledger when the store stopped",
                at_ledger,
            );
            note_text = format!(
                "store {store} stopped {}ms ({} than timeouts.store {}ms) while a keyed write \
                 committed in {}ms: at the ledger {at_ledger}, committed {committed}",
                stall.as_millis(),
                if long { "longer" } else { "shorter" },
                STORE_TIMEOUT.as_millis(),
                STALL_COMMIT.as_millis()
            );
            let first = rec
                .wait_ok(end, 1, Duration::from_secs(20), |o| o.group == group)
                .await;
            (end, first)
        }
        Fault::SlowBody => {
            let client: HttpClient<Full<Bytes>> =
                Client::builder(TokioExecutor::new()).build_http();
            let fence = fences[group].process.proxy;
            let in_group: Vec<usize> = (0..workers.len())
                .filter(|&i| workers[i].group == group)
                .collect();
            let (a, b) = (&workers[in_group[0]], &workers[in_group[1]]);
            let (a_api, b_api) = (a.sidecar.leases.unwrap(), b.sidecar.leases.unwrap());
            let resource = format!("account:{SLOW_BODY_ID}");
            let Some(t1) = acquire(&client, a_api, &resource, &a.name, "2s").await else {
                return Injected {
                    fault,
                    group,
                    duration: Duration::ZERO,
                    recovery: None,
                    note: format!("skipped: {} got no lease on {resource}", a.name),
                };
            };
            let at = ctx.clock.now();
            let a_index = {
                let mut acquired = rec.acquired.lock().unwrap();
                acquired.push(Acquired {
                    writer: a.name.clone(),
                    resource: resource.clone(),
                    token: t1,
                    at,
                    released: None,
                });
                acquired.len() - 1
            };
            // Mid-body: the holder lets go, the other worker is granted the lease, and the
            // fence is seen to know the newer grant (it refuses the old token, 409).
            let mut t2 = None;
            let mut known = false;
            let hand_over = async {
                rec.acquired.lock().unwrap()[a_index].released = Some(ctx.clock.now());
                release(&client, a_api, &resource).await;
                t2 = acquire(&client, b_api, &resource, &b.name, "2s").await;
                if let Some(t2) = t2 {
                    rec.acquired.lock().unwrap().push(Acquired {
                        writer: b.name.clone(),
                        resource: resource.clone(),
                        token: t2,
                        at: ctx.clock.now(),
                        released: None,
                    });
                    known = fence_knows_newer_grant(fence, &resource, t1).await;
                }
            };
            let op = slow_body_write(ctx, &a.name, group, fence, &resource, t1, hand_over).await;
            let end = ctx.clock.now();
            let kept = rec.acquired.lock().unwrap()[a_index].released.is_none();
            if kept {
                // Refused before the body was asked for: no hand-over happened.
                rec.acquired.lock().unwrap()[a_index].released = Some(end);
                release(&client, a_api, &resource).await;
            }
            note(
                evidence,
                "slow body: the fence asked for the body (100 Continue), the lease passed on mid-body and the fence refused the old token before the body ended",
                t2.is_some() && known,
            );
            note(
                evidence,
                "slow body: the write with the superseded token, ended after the hand-over, refused (409)",
                op.status == 409,
            );
            // The new holder writes under its token through its egress, then lets go.
            let mut first = None;
            if let Some(t2) = t2 {
                let key = format!("{}-k{}", b.name, OP_SEQ.fetch_add(1, Ordering::Relaxed));
                let o = format!("{}-{}", b.name, OP_SEQ.fetch_add(1, Ordering::Relaxed));
                rec.note_sent(group);
                let sent = ctx.clock.now();
                let answer = request(
                    &client,
                    Method::PUT,
                    &format!(
                        "http://{}/accounts/{SLOW_BODY_ID}",
                        b.sidecar.egress.unwrap()
                    ),
                    &[
                        ("x-writer", b.name.clone()),
                        ("x-op", o.clone()),
                        ("idempotency-key", key.clone()),
                    ],
                    Bytes::from(format!("{key} by {} under {t2}", b.name)),
                )
                .await;
                let answered = ctx.clock.now();
                let status = answer.as_ref().map_or(0, |(s, _)| *s);
                rec.push_op(Op {
                    writer: b.name.clone(),
                    group,
                    op: o,
                    resource: resource.clone(),
                    token: t2,
                    key: Some(key),
                    status,
                    problem: answer.and_then(|(_, body)| problem_type(&body)),
                    sent,
                    done: sent,
                    answered,
                });
                if (200..300).contains(&status) {
                    first = Some(answered);
                }
                if let Some(mine) = rec
                    .acquired
                    .lock()
                    .unwrap()
                    .iter_mut()
                    .rev()
                    .find(|x| x.writer == b.name && x.resource == resource && x.token == t2)
                {
                    mine.released = Some(ctx.clock.now());
                }
                release(&client, b_api, &resource).await;
            }
            note_text = format!(
                "{} (token {t1}) sent half a body, lease passed to {} (token {}), fence knew: {known}; \
                 the body ended {}ms after its head: {} {}",
                a.name,
                b.name,
                t2.map_or("-".into(), |t| t.to_string()),
                (op.done - op.sent) / 1000,
                op.status,
                op.problem.unwrap_or_default()
            );
            (end, first)
        }
        Fault::SigtermWaiting => {
            let client: HttpClient<Full<Bytes>> =
                Client::builder(TokioExecutor::new()).build_http();
            let lease_url = rig.lease_redis.url();
            let holder = format!("d{round}");
            let mut s = lone_sidecar(ctx, &lease_url, &holder).await;
            let api = s.leases.unwrap();
            // It holds one lease (the drain must give it back) and waits for another, held by
            // a worker's sidecar.
            let (own, wanted) = (format!("account:{holder}a"), format!("account:{holder}b"));
            let mine = acquire(&client, api, &own, &holder, "1s").await;
            let rival = workers.iter().find(|w| w.group == group).expect("a worker");
            let (rival_api, rival_name) = (rival.sidecar.leases.unwrap(), rival.name.clone());
            let theirs = acquire(&client, rival_api, &wanted, &rival_name, "1s").await;
            let waiting = {
                let client = client.clone();
                let holder = holder.clone();
                let wanted = wanted.clone();
                tokio::spawn(async move { acquire(&client, api, &wanted, &holder, "3s").await })
            };
            // Readiness: the sidecar lists the acquisition as under way.
            let url = format!("http://{api}/v1/leases/{wanted}");
            let under_way = tokio::time::timeout(Duration::from_secs(3), async {
                loop {
                    if let Some((200, body)) =
                        request(&client, Method::GET, &url, &[], Bytes::new()).await
                    {
                        if serde_json::from_slice::<serde_json::Value>(&body)
                            .is_ok_and(|v| v["state"] == "acquiring")
                        {
                            return;
                        }
                    }
                    pace().await;
                }
            })
            .await
            .is_ok();
            s.signal("-TERM");
            let drained = wait_log(&mut s.logs, "leases released", Duration::from_secs(10))
                .await
                .is_ok();
            // The drain has given back what it held; now the awaited lease comes free.
            release(&client, rival_api, &wanted).await;
            let status = s.exited(Duration::from_secs(20)).await;
            let end = ctx.clock.now();
            let granted = waiting.await.ok().flatten();
            let held = leases_held_by(&lease_url, &ctx.lease_prefix, &holder).await;
            note(
                evidence,
                "SIGTERM with an acquisition waiting: it was under way, the drain logged `leases released`, the sidecar exited 0",
                mine.is_some() && theirs.is_some() && under_way && drained && status.success(),
            );
            note_text = format!(
                "{holder} held {own} ({mine:?}), waited for {wanted} held by {rival_name} ({theirs:?}); \
                 waiting acquisition answered {granted:?}; exit {status}; backend holds for {holder}: {held:?}"
            );
            rec.exits.lock().unwrap().push(Exit {
                holder,
                how: "SIGTERM (drain)".into(),
                exited: end,
                held,
            });
            let first = rec
                .wait_ok(end, 1, Duration::from_secs(20), |o| o.group == group)
                .await;
            (end, first)
        }
        Fault::SlowUpstream => {
            let n = 3;
            let before = ctx.ledger.arm_slow(n);
            let done = ctx
                .ledger
                .slow_commits_reach(before + n, Duration::from_secs(10))
                .await;
            ctx.ledger.arm_slow(0);
            let end = ctx.clock.now();
            note_text = format!("{n} commits delayed {}ms: {done}", SLOW_COMMIT.as_millis());
            let first = rec.wait_ok(end, 1, Duration::from_secs(20), |_| true).await;
            (end, first)
        }
    };
    Injected {
        fault,
        group,
        duration: Duration::from_micros(end - begin),
        recovery: recovery.map(|t| Duration::from_micros(t.saturating_sub(end))),
        note: note_text,
    }
}

struct WorkerSpec {
    ctx: Arc<Ctx>,
    name: String,
    group: usize,
    mode: Mode,
    offset: usize,
    leases: SocketAddr,
    target: SocketAddr,
    resources: Vec<String>,
    gate: watch::Receiver<bool>,
    holding: watch::Sender<Option<(String, u64, usize)>>,
    stop: Arc<AtomicBool>,
}

static OP_SEQ: AtomicU64 = AtomicU64::new(0);

/// Sends one request, bounded; `None` when no answer came.
async fn request<B>(
    client: &HttpClient<B>,
    method: Method,
    url: &str,
    headers: &[(&str, String)],
    body: Bytes,
) -> Option<(u16, Bytes)>
where
    B: From<Bytes> + http_body::Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut req = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let req = req.body(B::from(body)).unwrap();
    let answer = async {
        let resp = client.request(req).await.ok()?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.ok()?.to_bytes();
        Some((status, body))
    };
    tokio::time::timeout(CLIENT_BOUND, answer)
        .await
        .ok()
        .flatten()
}

/// The problem `type` of a refusal's body.
fn problem_type(body: &[u8]) -> Option<String> {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["type"].as_str().map(str::to_owned))
}

/// Client retry pacing after a failed call (a real client backs off too).
async fn pace() {
    tokio::time::sleep(Duration::from_millis(20)).await;
}

/// A worker: acquire a lease, write a few times under it, release; next resource.
async fn worker_loop(mut w: WorkerSpec) {
    let client: HttpClient<Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(5))
        .build_http();
    let rec = Arc::clone(&w.ctx.rec);
    let clock = w.ctx.clock;
    let mut turn = w.offset;
    while !w.stop.load(Ordering::SeqCst) {
        let id = w.resources[turn % w.resources.len()].clone();
        turn += 1;
        let resource = format!("account:{id}");
        let lease_url = format!("http://{}/v1/leases/{resource}", w.leases);
        let body = format!(r#"{{"holder":"{}","wait":"1s"}}"#, w.name);
        let granted = request(
            &client,
            Method::POST,
            &lease_url,
            &[("content-type", "application/json".into())],
            Bytes::from(body),
        )
        .await;
        let at = clock.now();
        let token = match granted {
            Some((200, body)) => serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["fencing_token"].as_u64()),
            _ => None,
        };
        let Some(token) = token else {
            pace().await;
            continue;
        };
        let index = {
            let mut acquired = rec.acquired.lock().unwrap();
            acquired.push(Acquired {
                writer: w.name.clone(),
                resource: resource.clone(),
                token,
                at,
                released: None,
            });
            acquired.len() - 1
        };
        'hold: for k in 0..WRITES_PER_HOLD {
            let _ = w
                .holding
                .send(Some((resource.clone(), token, WRITES_PER_HOLD - k)));
            // The pause point: a frozen worker stops here, wherever its lease stands.
            let _ = w.gate.wait_for(|open| *open).await;
            if w.stop.load(Ordering::SeqCst) {
                break;
            }
            // One write: a key, a body and the token, the same on every attempt. After a
            // timeout (the attempt keeps running: its answer is still recorded), a 503 or a
            // 409 in-flight, the worker retries it, as a client with an idempotency key does.
            let key = format!("{}-k{}", w.name, OP_SEQ.fetch_add(1, Ordering::Relaxed));
            let body = Bytes::from(format!("{key} by {} under {token}", w.name));
            for _attempt in 0..MAX_ATTEMPTS {
                let op = format!("{}-{}", w.name, OP_SEQ.fetch_add(1, Ordering::Relaxed));
                let url = format!("http://{}/accounts/{id}", w.target);
                let mut headers = vec![
                    ("x-writer", w.name.clone()),
                    ("x-op", op.clone()),
                    ("idempotency-key", key.clone()),
                ];
                if w.mode == Mode::Naive {
                    // No fence: the token goes along, and nobody checks it.
                    headers.push(("fencing-token", token.to_string()));
                }
                rec.note_sent(w.group);
                let sent = clock.now();
                let (tx, rx) = tokio::sync::oneshot::channel();
                let (client, rec, resource, key, body) = (
                    client.clone(),
                    Arc::clone(&rec),
                    resource.clone(),
                    key.clone(),
                    body.clone(),
                );
                let (writer, group) = (w.name.clone(), w.group);
                tokio::spawn(async move {
                    let answer = request(&client, Method::PUT, &url, &headers, body).await;
                    let answered = clock.now();
                    let (status, problem) = match &answer {
                        Some((status, body)) => (*status, problem_type(body)),
                        None => (0, None),
                    };
                    rec.push_op(Op {
                        writer,
                        group,
                        op,
                        resource,
                        token,
                        key: Some(key),
                        status,
                        problem: problem.clone(),
                        sent,
                        done: sent,
                        answered,
                    });
                    let _ = tx.send((status, problem));
                });
                let (status, problem) = match tokio::time::timeout(ATTEMPT_TIMEOUT, rx).await {
                    Ok(Ok(answer)) => answer,
                    // Out of patience: retry while the first attempt runs on.
                    _ => (0, None),
                };
                match (status, problem.as_deref()) {
                    (200..=299, _) => break,
                    (503, Some("urn:fencegate:lease-not-held")) => break 'hold,
                    (0 | 503, _) => pace().await,
                    (409, Some("urn:fencegate:idempotency-in-flight")) => {
                        tokio::time::sleep(IN_FLIGHT_PAUSE).await
                    }
                    _ => {
                        // Refused for good (stale token, ...) or failed upstream: next write.
                        pace().await;
                        break;
                    }
                }
                if w.stop.load(Ordering::SeqCst) {
                    break 'hold;
                }
            }
        }
        let _ = w.holding.send(None);
        // The worker stops acting as holder when it asks for the release.
        rec.acquired.lock().unwrap()[index].released = Some(clock.now());
        let _ = request(&client, Method::DELETE, &lease_url, &[], Bytes::new()).await;
    }
}

/// Follows one sidecar's lease event stream for one resource, recording each event at
/// receipt (renewals move the holder's deadline; the checker needs them).
async fn follow_events(ctx: Arc<Ctx>, writer: String, leases: SocketAddr, resource: String) {
    let client: HttpClient<Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let url = format!("http://{leases}/v1/leases/{resource}/events");
    let Ok(resp) = client
        .request(Request::get(url).body(Empty::new()).unwrap())
        .await
    else {
        return;
    };
    let mut body = resp.into_body();
    let mut buf = String::new();
    while let Some(Ok(frame)) = body.frame().await {
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let at = ctx.clock.now();
        buf.push_str(&String::from_utf8_lossy(&data));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let kind = event
                .lines()
                .find_map(|l| l.strip_prefix("event: "))
                .unwrap_or_default()
                .to_owned();
            let data = event
                .lines()
                .find_map(|l| l.strip_prefix("data: "))
                .and_then(|d| serde_json::from_str::<serde_json::Value>(d).ok());
            let Some(token) = data.and_then(|d| d["fencing_token"].as_u64()) else {
                continue;
            };
            ctx.rec.push_event(LeaseEvent {
                writer: writer.clone(),
                resource: resource.clone(),
                token,
                kind,
                at,
            });
        }
    }
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
