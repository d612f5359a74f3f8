//! The run's processes: fence sidecars, workers and their sidecars, and how they are configured and started.

use super::*;

/// A fence sidecar and how to restart it.
pub(super) struct Fence {
    pub(super) config: PathBuf,
    pub(super) process: Fencegate,
    /// The fence store's own Redis (group 1, and group 2 without PostgreSQL).
    pub(super) redis: Option<Redis>,
    /// The fence store's own PostgreSQL (group 2).
    pub(super) postgres: Option<Postgres>,
    /// The fence store's replicated topology (the failover groups).
    pub(super) replicated: Option<Replicated>,
    /// What the fence is started under (again after a restart): for group 0, libfaketime
    /// reading its wall clock's offset from `clock`, and the slow-disk library reading its
    /// fsyncs' delay from `slow_disk`.
    pub(super) prefix: Vec<String>,
    /// The file holding the fence's wall-clock offset (`+3600`: an hour ahead), when
    /// libfaketime is installed; the monotonic clock is left alone.
    pub(super) clock: Option<PathBuf>,
    /// The small tmpfs the embedded store's file lives on (group 0, as root), which the
    /// full-disk fault fills.
    pub(super) disk: Option<Tmpfs>,
    /// The file holding how many milliseconds the fence's fsyncs wait (group 0, where the
    /// slow-disk library could be built): the slow-disk fault writes it.
    pub(super) slow_disk: Option<PathBuf>,
    /// The latency relay between the fence and its store (group 1's Redis).
    pub(super) relay: Option<Relay>,
}

/// A tmpfs mounted for the run, unmounted when dropped.
pub(super) struct Tmpfs {
    pub(super) path: PathBuf,
}

impl Tmpfs {
    /// A tmpfs of `mib` MiB at `path`; `None` where mounting is not allowed (not root).
    fn mount(path: &Path, mib: u64) -> Option<Tmpfs> {
        std::fs::create_dir_all(path).ok()?;
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(path)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        mounted.then(|| Tmpfs {
            path: path.to_owned(),
        })
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.path)
            .status();
    }
}

/// libfaketime, which steps a process's wall clock (and, as set here, only that).
const FAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// What a fence is started under: the command prefix, the file holding its wall clock's
/// offset in seconds (`+0` at first) where libfaketime is installed, and the file holding its
/// fsyncs' delay in milliseconds (`0` at first) where the slow-disk library could be built.
struct Preload {
    prefix: Vec<String>,
    clock: Option<PathBuf>,
    slow_disk: Option<PathBuf>,
}

/// The fence of group 0 runs under libfaketime and the slow-disk library, each where it can.
fn preload(dir: &Path, group: usize) -> Preload {
    let mut libs = Vec::new();
    let mut prefix = vec!["env".to_owned()];
    let mut clock = None;
    if Path::new(FAKETIME).exists() {
        let file = dir.join(format!("clock{group}"));
        std::fs::write(&file, "+0\n").expect("write the clock file");
        libs.push(FAKETIME.to_owned());
        prefix.extend([
            format!("FAKETIME_TIMESTAMP_FILE={}", file.display()),
            "FAKETIME_NO_CACHE=1".to_owned(),
            "FAKETIME_DONT_FAKE_MONOTONIC=1".to_owned(),
        ]);
        clock = Some(file);
    }
    let mut slow_disk = None;
    match build_slow_disk(dir) {
        Ok(lib) => {
            let file = dir.join(format!("disk-delay{group}"));
            std::fs::write(&file, "0\n").expect("write the disk delay file");
            libs.push(lib.display().to_string());
            prefix.push(format!("FENCEGATE_SLOW_DISK={}", file.display()));
            slow_disk = Some(file);
        }
        Err(reason) => println!("  SKIPPED slow-disk library: {reason}"),
    }
    if libs.is_empty() {
        return Preload {
            prefix: Vec::new(),
            clock,
            slow_disk,
        };
    }
    prefix.insert(1, format!("LD_PRELOAD={}", libs.join(":")));
    Preload {
        prefix,
        clock,
        slow_disk,
    }
}

/// Builds `slowdisk.c` (fsync and fdatasync that wait first) into a shared library in `dir`.
fn build_slow_disk(dir: &Path) -> Result<PathBuf, String> {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/chaos/slowdisk.c");
    let lib = dir.join("slowdisk.so");
    let out = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&lib)
        .arg(&source)
        .arg("-ldl")
        .output()
        .map_err(|e| format!("cc: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cc failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(lib)
}

pub(super) struct Worker {
    pub(super) name: String,
    pub(super) group: usize,
    pub(super) sidecar: Fencegate,
    /// The namespace (link index) its sidecar runs in, if any.
    pub(super) link: Option<usize>,
    pub(super) gate: watch::Sender<bool>,
    pub(super) holding: watch::Receiver<Option<(String, u64, usize)>>,
}

/// The run's processes and network namespaces. Fields drop in order: the processes (killed on
/// drop) before the namespaces, the nftables table and the lease Redis, also when unwinding.
pub(super) struct Rig {
    pub(super) fences: Vec<Fence>,
    pub(super) workers: Vec<Worker>,
    pub(super) lab: Option<Lab>,
    pub(super) lease_redis: Redis,
}

pub(super) struct Ctx {
    pub(super) clock: Clock,
    pub(super) rec: Arc<Recorder>,
    pub(super) ledger: Ledger,
    pub(super) dir: tempfile::TempDir,
    pub(super) lease_prefix: String,
}

/// Resource ids of a group (the route is `/accounts/{id}`, the resource `account:{id}`).
pub(super) fn resources(mode: Mode, group: usize) -> Vec<String> {
    let tag = match mode {
        Mode::Fenced => "f",
        Mode::Naive => "n",
    };
    (0..2).map(|i| format!("{tag}{group}x{i}")).collect()
}

/// A fence: `store`, `timeouts.upstream`, and `authority` (a lease backend's URL and prefix)
/// for `fence.authority: leases`. Idempotency keys apply on its route.
pub(super) fn fence_yaml(
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

/// A worker's sidecar: leases from `backend` (the fields after `kind: redis`, see
/// [`lease_backend`]), its lease API and egress listening on `ip`.
pub(super) fn sidecar_yaml(
    prefix: &str,
    backend: &str,
    ip: Ipv4Addr,
    egress_to: Option<SocketAddr>,
) -> String {
    let egress = match egress_to {
        Some(fence) => format!(
            "egress:\n  listen: {ip}:0\n  upstream: http://{fence}\n  routes:\n    - {{ path: '/accounts/{{id}}', lease: 'account:{{id}}' }}\n"
        ),
        None => String::new(),
    };
    format!(
        "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://127.0.0.1:9\nstore: {{ kind: memory }}\n\
         timeouts: {{ upstream: 5s, shutdown: 1s }}\n\
         leases:\n  listen: {ip}:0\n  backend: {{ kind: redis, {backend}, prefix: {prefix} }}\n  \
         ttl: {{ p99_work: 1000ms, p99_rtt: 50ms, safety_margin: 200ms, drift_buffer: {}ms }}\n  \
         acquire: {{ base_delay: 20ms, max_delay: 200ms, jitter: 20ms }}\n{egress}",
        DRIFT.as_millis()
    )
}

/// A Redis lease backend: one server's url, or (`sentinel` given) the Sentinels of a
/// replicated Redis, where a grant is acknowledged once a replica holds it (`replicas: 1`).
pub(super) fn lease_backend(url: &str, sentinel: Option<&str>) -> String {
    match sentinel {
        Some(sentinel) => {
            format!("url: 'redis://{USER}@{MASTER}/', sentinel: {sentinel}, replicas: 1")
        }
        None => format!("url: '{url}'"),
    }
}

pub(super) async fn start_fence(
    dir: &Path,
    group: usize,
    ledger: &str,
    ip: Ipv4Addr,
    authority: Option<(&str, &str)>,
) -> (Fence, Option<String>) {
    let port = free_port();
    let (mut redis, mut postgres, mut replicated) = (None, None, None);
    let mut disk = None;
    let mut relay = None;
    let mut unavailable = None;
    let store = if let Some(fault) = failover_fault(group) {
        // A replicated store with the safe settings: Redis acknowledges a write once a replica
        // holds it (`replicas: 1`), PostgreSQL once its synchronous standby does, etcd on a
        // quorum. Without the servers, a memory store, and the fault is skipped.
        let started = match fault {
            Fault::RedisFailover => Sentinels::start().await.map(Replicated::Sentinel),
            Fault::PostgresFailover => PgPair::start()
                .await
                .map(|pg| Replicated::Postgres(Box::new(pg))),
            _ => EtcdCluster::start().await.map(Replicated::Etcd),
        };
        let prefix = fresh_prefix();
        let store = match &started {
            Ok(Replicated::Sentinel(s)) => format!(
                "store: {{ kind: redis, url: 'redis://{USER}@{MASTER}/', prefix: {prefix}, sentinel: {}, replicas: 1 }}\n",
                s.yaml()
            ),
            Ok(Replicated::Postgres(pg)) => format!(
                "store: {{ kind: postgres, url: '{}', prefix: {prefix}, replicas: 1 }}\n",
                pg.url()
            ),
            Ok(Replicated::Etcd(etcd)) => format!(
                "store: {{ kind: etcd, url: '{}', prefix: {prefix} }}\n",
                etcd.url()
            ),
            Err(_) => "store: { kind: memory }\n".to_owned(),
        };
        match started {
            Ok(r) => replicated = Some(r),
            Err(reason) => unavailable = Some(reason),
        }
        store
    } else if group == 0 {
        // On a tmpfs of its own where it can be mounted: the full-disk fault fills it.
        disk = Tmpfs::mount(&dir.join("disk0"), 64);
        let db_dir = disk.as_ref().map_or(dir.to_owned(), |d| d.path.clone());
        format!(
            "store: {{ kind: embedded, path: {} }}\n",
            db_dir.join("fences.db").display()
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
                // Through a relay that adds latency when the added-latency fault says so.
                let through = Relay::start(r.port).await;
                let url = format!("redis://127.0.0.1:{}/", through.port);
                redis = Some(r);
                relay = Some(through);
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
    // The embedded store keeps idempotency records by the wall clock across restarts: its
    // fence is the one whose wall clock the clock-step fault moves.
    let Preload {
        prefix,
        clock,
        slow_disk,
    } = match group {
        0 => preload(dir, group),
        _ => Preload {
            prefix: Vec::new(),
            clock: None,
            slow_disk: None,
        },
    };
    let process = Fencegate::start_with(&prefix, &config).await;
    let fence = Fence {
        config,
        process,
        redis,
        postgres,
        replicated,
        prefix,
        clock,
        disk,
        slow_disk,
        relay,
    };
    (fence, unavailable)
}

/// The failover fault of a group whose store is replicated, if it is one.
pub(super) fn failover_fault(group: usize) -> Option<Fault> {
    match group {
        SENTINEL_GROUP => Some(Fault::RedisFailover),
        PG_HA_GROUP => Some(Fault::PostgresFailover),
        ETCD_GROUP => Some(Fault::EtcdLeaderKill),
        _ => None,
    }
}
