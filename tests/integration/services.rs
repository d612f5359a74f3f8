//! Throwaway Redis, PostgreSQL and etcd servers for tests that kill and restart them, and
//! fresh names (key prefixes, tables) on the machine's shared servers for the rest.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

/// The machine's shared servers (CI starts them when absent).
pub const REDIS_URL: &str = "redis://127.0.0.1:6379/";
pub const POSTGRES_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// A store prefix no other test (or earlier run) uses.
pub fn fresh_prefix() -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
        % 1_000_000_000_000;
    format!(
        "t{}_{nanos}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Redis,
    Postgres,
    Etcd,
}

/// A server process owned by one test: killed with `kill -9`, restarted on the same port and
/// data directory, removed when the test ends.
pub struct Service {
    pub kind: Kind,
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
    /// Redis and etcd: more arguments for the server (`--replicaof …`, `--max-txn-ops …`).
    extra: Vec<String>,
    /// Redis: run as a Sentinel with this configuration (it rewrites the file, kept in `dir`).
    sentinel_conf: Option<String>,
}

impl Service {
    pub async fn start(kind: Kind) -> Service {
        Self::start_with(kind, Vec::new(), None).await
    }

    /// A Redis replica of the server on `primary`.
    pub async fn start_redis_replica(primary: u16) -> Service {
        Self::start_redis_with(&["--replicaof", "127.0.0.1", &primary.to_string()]).await
    }

    /// A Redis server with more `redis-server` arguments.
    pub async fn start_redis_with(args: &[&str]) -> Service {
        let args = args.iter().map(|a| (*a).to_owned()).collect();
        Self::start_with(Kind::Redis, args, None).await
    }

    /// An etcd server with more `etcd` arguments.
    pub async fn start_etcd_with(args: &[&str]) -> Service {
        let args = args.iter().map(|a| (*a).to_owned()).collect();
        Self::start_with(Kind::Etcd, args, None).await
    }

    /// A Redis Sentinel with configuration `conf` (its `port` comes from the command line).
    pub async fn start_sentinel(conf: String) -> Service {
        Self::start_with(Kind::Redis, Vec::new(), Some(conf)).await
    }

    async fn start_with(kind: Kind, extra: Vec<String>, sentinel_conf: Option<String>) -> Service {
        let dir = tempfile::tempdir().unwrap();
        if kind == Kind::Postgres {
            init_postgres(&dir.path().to_path_buf()).await;
        }
        let mut service = Service {
            kind,
            port: free_port(),
            child: None,
            dir,
            extra,
            sentinel_conf,
        };
        // A port picked free can be taken (by another test's server, or as an outgoing
        // connection's source port) before the server binds it: then the server exits, and it
        // is started again on another port.
        for _ in 0..5 {
            if service.spawn().await {
                return service;
            }
            service.child = None;
            service.port = free_port();
            if kind == Kind::Etcd {
                // A fresh member on the new ports, not one bootstrapped on the old ones.
                let _ = std::fs::remove_dir_all(service.dir.path().join("etcd"));
            }
        }
        panic!(
            "{kind:?} exited at start five times; see {:?}",
            service.dir.path()
        );
    }

    pub fn url(&self) -> String {
        match self.kind {
            Kind::Redis => format!("redis://127.0.0.1:{}/", self.port),
            Kind::Postgres => format!("postgres://postgres@127.0.0.1:{}/postgres", self.port),
            Kind::Etcd => format!("etcd://127.0.0.1:{}", self.port),
        }
    }

    /// Starts the server and waits until it answers; false if it exited first.
    async fn spawn(&mut self) -> bool {
        let dir = self.dir.path();
        let port = self.port.to_string();
        let mut cmd = match self.kind {
            Kind::Redis if self.sentinel_conf.is_some() => {
                let conf = dir.join("sentinel.conf");
                std::fs::write(&conf, self.sentinel_conf.as_deref().unwrap()).unwrap();
                let mut c = Command::new("redis-server");
                c.arg(&conf)
                    .args([
                        "--sentinel",
                        "--port",
                        &port,
                        "--bind",
                        "127.0.0.1",
                        "--dir",
                    ])
                    .arg(dir);
                c
            }
            Kind::Redis => {
                let mut c = Command::new("redis-server");
                c.args(&self.extra);
                // Durable like production should be: a maximum survives kill -9.
                c.args([
                    "--port",
                    &port,
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "yes",
                    "--appendfsync",
                    "always",
                    "--dir",
                ])
                .arg(dir);
                c
            }
            Kind::Etcd => {
                let peer = free_port();
                let mut c = Command::new("etcd");
                c.arg("--data-dir").arg(dir.join("etcd")).args([
                    "--listen-client-urls",
                    &format!("http://127.0.0.1:{port}"),
                    "--advertise-client-urls",
                    &format!("http://127.0.0.1:{port}"),
                    "--listen-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                    "--initial-advertise-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                    "--initial-cluster",
                    &format!("default=http://127.0.0.1:{peer}"),
                    "--log-level",
                    "error",
                ]);
                c.args(&self.extra);
                c
            }
            Kind::Postgres => {
                let mut c = Command::new("runuser");
                c.args(["-u", "postgres", "--"])
                    .arg(postgres_bin("postgres"))
                    .arg("-D")
                    .arg(dir.join("data"))
                    // TCP only: a socket lock file would outlive kill -9 and block the restart.
                    .args([
                        "-p",
                        &port,
                        "-c",
                        "listen_addresses=127.0.0.1",
                        "-c",
                        "unix_socket_directories=",
                    ]);
                c
            }
        };
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("server.log"))
            .unwrap();
        let child = cmd
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {:?}: {e}", self.kind));
        self.child = Some(child);
        self.wait_ready().await
    }

    /// Polls the server's own readiness answer (PING, /health, a connection).
    async fn wait_ready(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if self.answers().await {
                return true;
            }
            if let Some(child) = &mut self.child {
                if matches!(child.try_wait(), Ok(Some(_))) {
                    return false;
                }
            }
            assert!(
                Instant::now() < deadline,
                "{:?} on port {} never became ready",
                self.kind,
                self.port
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn answers(&self) -> bool {
        let addr = ("127.0.0.1", self.port);
        match self.kind {
            Kind::Redis => {
                let Ok(mut s) = TcpStream::connect(addr).await else {
                    return false;
                };
                let mut buf = [0u8; 16];
                s.write_all(b"PING\r\n").await.is_ok()
                    && matches!(s.read(&mut buf).await, Ok(n) if buf[..n].starts_with(b"+PONG"))
            }
            Kind::Etcd => {
                let Ok(mut s) = TcpStream::connect(addr).await else {
                    return false;
                };
                let mut buf = vec![0u8; 1024];
                s.write_all(b"GET /health HTTP/1.0\r\n\r\n").await.is_ok()
                    && matches!(s.read(&mut buf).await, Ok(n) if String::from_utf8_lossy(&buf[..n]).contains("\"health\":\"true\""))
            }
            Kind::Postgres => {
                let url = self.url();
                match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
                    Ok((client, conn)) => {
                        tokio::spawn(conn);
                        client.simple_query("SELECT 1").await.is_ok()
                    }
                    Err(_) => false,
                }
            }
        }
    }

    pub async fn kill(&mut self) {
        let mut child = self.child.take().expect("running");
        if self.kind == Kind::Postgres {
            // runuser forwards nothing on SIGKILL: kill the postmaster itself, and its backends
            // with it. A backend outlives a killed postmaster until it notices, and may answer
            // (and commit) one more query on its connection meanwhile: a store that is "down"
            // yet still admits a write. The whole server dies at once, as a crashed host's would.
            let pid = std::fs::read_to_string(self.dir.path().join("data/postmaster.pid")).unwrap();
            let pid = pid.lines().next().unwrap().trim().to_owned();
            let mut pids = children_of(&pid);
            pids.push(pid);
            // A backend may exit between the listing and the kill: not worth a message.
            std::process::Command::new("kill")
                .arg("-9")
                .args(&pids)
                .stderr(Stdio::null())
                .status()
                .unwrap();
        }
        child.start_kill().unwrap();
        child.wait().await.unwrap();
        if self.kind == Kind::Postgres {
            // Backends outlive a killed postmaster for a moment; wait until the port is free.
            let deadline = Instant::now() + Duration::from_secs(30);
            while TcpStream::connect(("127.0.0.1", self.port)).await.is_ok() {
                assert!(
                    Instant::now() < deadline,
                    "postgres still listening after kill -9"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let _ = std::fs::remove_file(self.dir.path().join("data/postmaster.pid"));
        }
    }

    /// Stops the process (SIGSTOP): it keeps its sockets but reads, writes and reconnects
    /// nothing until [`Service::resume`].
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().and_then(Child::id).expect("running");
        let status = std::process::Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "kill first");
        // A PostgreSQL killed with -9 leaves its shared memory until the last of its processes
        // is gone; a restart that finds it still attached exits at once. Such a start is tried
        // again, a bounded number of times.
        for _ in 0..20 {
            if self.spawn().await {
                return;
            }
            self.child = None;
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        panic!(
            "{:?} exited at every restart on port {}: see {}",
            self.kind,
            self.port,
            self.dir.path().join("server.log").display()
        );
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if self.kind == Kind::Postgres {
            if let Ok(pid) = std::fs::read_to_string(self.dir.path().join("data/postmaster.pid")) {
                if let Some(pid) = pid.lines().next() {
                    let _ = std::process::Command::new("kill")
                        .args(["-9", pid.trim()])
                        .status();
                }
            }
        }
    }
}

fn postgres_bin(name: &str) -> PathBuf {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL server binaries under /usr/lib/postgresql")
        .map(|e| e.unwrap().path())
        .collect();
    versions.sort();
    versions.last().unwrap().join("bin").join(name)
}

async fn init_postgres(dir: &PathBuf) {
    let status = Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(dir)
        .status()
        .await
        .unwrap();
    assert!(status.success());
    let status = Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .arg(postgres_bin("initdb"))
        .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
        .arg(dir.join("data"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await
        .unwrap();
    assert!(status.success(), "initdb failed");
}

/// The processes whose parent is `pid` (from /proc).
fn children_of(pid: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{name}/stat")).ok()?;
            // `pid (comm) state ppid …`: the command may hold spaces, so read after its `)`.
            let ppid = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?;
            (ppid == pid).then_some(name)
        })
        .collect()
}

/// `redis-cli` against `port`: its output, one line per value.
pub async fn redis_cli_at(port: u16, args: &[&str]) -> String {
    let out = tokio::process::Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// The master name the Sentinels of a [`SentinelTopology`] monitor.
pub const MASTER: &str = "mymaster";

/// A Redis primary with two replicas, watched by three Sentinels (quorum 2, down after 1s): a
/// failover a test can cause with `kill -9`. Two replicas, as production runs them: after a
/// failover the one not promoted replicates the new primary, so writes that wait for one
/// replica (`replicas: 1`) go on.
pub struct SentinelTopology {
    pub primary: Service,
    pub replicas: Vec<Service>,
    pub sentinels: Vec<Service>,
}

impl SentinelTopology {
    /// Started, and settled: the replica is in sync and every Sentinel knows it and the two
    /// other Sentinels (else a failover could not be agreed or could find no replica).
    pub async fn start() -> SentinelTopology {
        Self::start_with("").await
    }

    /// [`SentinelTopology::start`], with `extra` lines in each Sentinel's configuration.
    pub async fn start_with(extra: &str) -> SentinelTopology {
        Self::start_preferring(extra, None).await
    }

    /// [`SentinelTopology::start_with`]; `preferred`: the replica (0 or 1) given
    /// `replica-priority 1` (the other keeps 100) before the Sentinels start, so that they
    /// promote it whatever its offset.
    pub async fn start_preferring(extra: &str, preferred: Option<usize>) -> SentinelTopology {
        let primary = Service::start(Kind::Redis).await;
        let mut replicas = Vec::new();
        for _ in 0..2 {
            replicas.push(Service::start_redis_replica(primary.port).await);
        }
        if let Some(at) = preferred {
            let set = redis_cli_at(
                replicas[at].port,
                &["CONFIG", "SET", "replica-priority", "1"],
            )
            .await;
            assert_eq!(set.trim(), "OK");
        }
        let conf = format!(
            "sentinel monitor {MASTER} 127.0.0.1 {} 2\n\
             sentinel down-after-milliseconds {MASTER} 1000\n\
             sentinel failover-timeout {MASTER} 2000\n{extra}",
            primary.port
        );
        let mut sentinels = Vec::new();
        for _ in 0..3 {
            sentinels.push(Service::start_sentinel(conf.clone()).await);
        }
        let topology = SentinelTopology {
            primary,
            replicas,
            sentinels,
        };
        topology.wait_settled().await;
        topology
    }

    async fn wait_settled(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let mut settled = true;
            for replica in &self.replicas {
                let info = redis_cli_at(replica.port, &["INFO", "replication"]).await;
                settled &= info.contains("master_link_status:up");
            }
            for sentinel in &self.sentinels {
                let master = sentinel_master(sentinel.port).await;
                settled &= master.get("num-slaves").map(String::as_str) == Some("2")
                    && master.get("num-other-sentinels").map(String::as_str) == Some("2");
            }
            if settled {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the Sentinel topology never settled"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `sentinel: { … }` for a store or lease backend config.
    pub fn yaml(&self) -> String {
        let urls: Vec<String> = self.urls();
        format!("{{ master: {MASTER}, urls: [{}] }}", urls.join(", "))
    }

    pub fn urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| format!("redis://127.0.0.1:{}", s.port))
            .collect()
    }

    /// The primary's port as the first Sentinel names it.
    pub async fn primary_port(&self) -> u16 {
        let out = redis_cli_at(
            self.sentinels[0].port,
            &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER],
        )
        .await;
        out.lines().nth(1).unwrap().trim().parse().unwrap()
    }

    /// Waits until every Sentinel names the same replica as the primary, and it is one;
    /// returns its port.
    pub async fn wait_promoted(&self) -> u16 {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut named = Vec::new();
            for sentinel in &self.sentinels {
                let out = redis_cli_at(
                    sentinel.port,
                    &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER],
                )
                .await;
                named.push(out.lines().nth(1).map(|p| p.trim().parse::<u16>().unwrap()));
            }
            let promoted = named[0].filter(|port| {
                named.iter().all(|n| *n == Some(*port))
                    && self.replicas.iter().any(|r| r.port == *port)
            });
            if let Some(port) = promoted {
                if redis_cli_at(port, &["ROLE"]).await.starts_with("master") {
                    return port;
                }
            }
            assert!(
                Instant::now() < deadline,
                "the Sentinels never promoted the replica"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// `SENTINEL MASTER mymaster` as field → value.
async fn sentinel_master(port: u16) -> std::collections::HashMap<String, String> {
    let out = redis_cli_at(port, &["SENTINEL", "MASTER", MASTER]).await;
    let lines: Vec<&str> = out.lines().collect();
    lines
        .chunks(2)
        .filter_map(|pair| match pair {
            [k, v] => Some((k.trim().to_owned(), v.trim().to_owned())),
            _ => None,
        })
        .collect()
}

impl Service {
    /// Runs `sql` on this PostgreSQL server (a fresh connection) and returns the first
    /// column of each row, NULL as an empty string.
    pub async fn sql(&self, sql: &str) -> Result<Vec<String>, tokio_postgres::Error> {
        assert_eq!(self.kind, Kind::Postgres);
        let (client, conn) = tokio_postgres::connect(&self.url(), tokio_postgres::NoTls).await?;
        tokio::spawn(conn);
        let rows = client.simple_query(sql).await?;
        Ok(rows
            .into_iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(row) => {
                    Some(row.get(0).unwrap_or_default().to_owned())
                }
                _ => None,
            })
            .collect())
    }

    /// Polls `sql` on this server until its first row is `want` (60 s at most).
    pub async fn wait_sql(&self, sql: &str, want: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let got = self.sql(sql).await.ok().and_then(|r| r.into_iter().next());
            if got.as_deref() == Some(want) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "`{sql}` on port {} never answered {want} (last: {got:?})",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A streaming standby of this PostgreSQL primary (`pg_basebackup -R`), started and
    /// replaying; it connects as `application_name` `name`.
    pub async fn standby(&self, name: &str) -> Service {
        assert_eq!(self.kind, Kind::Postgres);
        let dir = tempfile::tempdir().unwrap();
        let status = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(dir.path())
            .status()
            .await
            .unwrap();
        assert!(status.success());
        let conninfo = format!(
            "host=127.0.0.1 port={} user=postgres application_name={name}",
            self.port
        );
        let status = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(postgres_bin("pg_basebackup"))
            .args(["-d", &conninfo, "-R", "-X", "stream", "--no-sync", "-D"])
            .arg(dir.path().join("data"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await
            .unwrap();
        assert!(status.success(), "pg_basebackup failed");
        let mut standby = Service {
            kind: Kind::Postgres,
            port: free_port(),
            child: None,
            dir,
            extra: Vec::new(),
            sentinel_conf: None,
        };
        for _ in 0..5 {
            if standby.spawn().await {
                self.wait_sql(
                    &format!(
                        "SELECT count(*) FROM pg_stat_replication \
                         WHERE application_name = '{name}' AND state = 'streaming'"
                    ),
                    "1",
                )
                .await;
                return standby;
            }
            standby.child = None;
            standby.port = free_port();
        }
        panic!("the standby exited at start five times");
    }

    /// Promotes this standby (`pg_ctl promote`) and waits until it accepts writes.
    pub async fn promote(&self) {
        let status = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(postgres_bin("pg_ctl"))
            .args(["promote", "-D"])
            .arg(self.dir.path().join("data"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await
            .unwrap();
        assert!(status.success(), "pg_ctl promote failed");
        self.wait_sql("SELECT pg_is_in_recovery()", "f").await;
    }
}

/// A three-member etcd cluster on loopback, each member its own process and data directory.
pub struct EtcdCluster {
    /// Client ports, in member order (member `m{i}`).
    pub ports: Vec<u16>,
    children: Vec<Option<Child>>,
    _dir: tempfile::TempDir,
}

impl EtcdCluster {
    pub async fn start() -> EtcdCluster {
        // Ports picked free may be taken before a member binds them: then start afresh.
        for _ in 0..5 {
            if let Some(cluster) = Self::try_start().await {
                return cluster;
            }
        }
        panic!("the etcd cluster did not start five times");
    }

    async fn try_start() -> Option<EtcdCluster> {
        let dir = tempfile::tempdir().unwrap();
        let ports: Vec<(u16, u16)> = (0..3).map(|_| (free_port(), free_port())).collect();
        let initial: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect();
        let mut children = Vec::new();
        for (i, (client, peer)) in ports.iter().enumerate() {
            let log = std::fs::File::create(dir.path().join(format!("m{i}.log"))).unwrap();
            let child = Command::new("etcd")
                .args(["--name", &format!("m{i}"), "--data-dir"])
                .arg(dir.path().join(format!("m{i}")))
                .args([
                    "--listen-client-urls",
                    &format!("http://127.0.0.1:{client}"),
                    "--advertise-client-urls",
                    &format!("http://127.0.0.1:{client}"),
                    "--listen-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                    "--initial-advertise-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                    "--initial-cluster",
                    &initial.join(","),
                    "--initial-cluster-state",
                    "new",
                    "--initial-cluster-token",
                    "fencegate-test",
                    "--log-level",
                    "error",
                ])
                .stdout(Stdio::null())
                .stderr(log)
                .kill_on_drop(true)
                .spawn()
                .expect("cannot start etcd");
            children.push(Some(child));
        }
        let mut cluster = EtcdCluster {
            ports: ports.iter().map(|(c, _)| *c).collect(),
            children,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut healthy = 0;
            for port in &cluster.ports {
                if etcd_healthy(*port).await {
                    healthy += 1;
                }
            }
            if healthy == 3 {
                return Some(cluster);
            }
            for child in cluster.children.iter_mut().flatten() {
                if matches!(child.try_wait(), Ok(Some(_))) {
                    return None;
                }
            }
            assert!(
                Instant::now() < deadline,
                "etcd cluster never became healthy"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `etcd://` with every member's endpoint.
    pub fn url(&self) -> String {
        let endpoints: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("etcd://{}", endpoints.join(","))
    }

    /// The index of the current leader among the running members, as their status says
    /// (`etcdctl endpoint status`: each member's id and the leader's id).
    pub async fn leader(&self) -> usize {
        let alive: Vec<usize> = (0..self.ports.len())
            .filter(|i| self.children[*i].is_some())
            .collect();
        let endpoints: Vec<String> = alive
            .iter()
            .map(|i| format!("http://127.0.0.1:{}", self.ports[*i]))
            .collect();
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &endpoints.join(","), "endpoint", "status"])
            .args(["-w", "json"])
            .output()
            .await
            .unwrap();
        assert!(out.status.success(), "etcdctl endpoint status failed");
        let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let members = status.as_array().unwrap();
        let leader = &members[0]["Status"]["leader"];
        let at = members
            .iter()
            .position(|m| &m["Status"]["header"]["member_id"] == leader)
            .expect("no running member is the leader");
        alive[at]
    }

    /// `kill -9` of member `i`.
    pub async fn kill(&mut self, i: usize) {
        let mut child = self.children[i].take().expect("running");
        child.start_kill().unwrap();
        child.wait().await.unwrap();
    }

    /// Whether member `i` is up, healthy and in a cluster with a leader.
    pub async fn healthy(&self, i: usize) -> bool {
        etcd_healthy(self.ports[i]).await
    }
}

async fn etcd_healthy(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)).await else {
        return false;
    };
    let mut buf = vec![0u8; 1024];
    s.write_all(b"GET /health HTTP/1.0\r\n\r\n").await.is_ok()
        && matches!(s.read(&mut buf).await, Ok(n) if String::from_utf8_lossy(&buf[..n]).contains("\"health\":\"true\""))
}

/// A Redis Cluster of three primaries and three replicas (`redis-cli --cluster create`), each
/// node durable like [`Service`]'s Redis, with a 1 s node timeout and replicas that take over
/// however far behind they are (`cluster-replica-validity-factor 0`, so that a test can make
/// one lag and still see it promoted).
pub struct ClusterTopology {
    pub nodes: Vec<Service>,
    /// Replicas per primary.
    pub per_shard: usize,
}

/// One line of `CLUSTER NODES`.
#[derive(Debug, Clone)]
pub struct ClusterNode {
    pub id: String,
    pub port: u16,
    pub primary: bool,
    pub failed: bool,
    /// A replica's primary.
    pub of: Option<String>,
    /// A primary's slot ranges.
    pub slots: Vec<(u16, u16)>,
}

impl ClusterTopology {
    pub async fn start() -> ClusterTopology {
        Self::start_with_replicas(1).await
    }

    /// Three primaries with `per_shard` replicas each.
    pub async fn start_with_replicas(per_shard: usize) -> ClusterTopology {
        let mut nodes = Vec::new();
        for _ in 0..3 * (1 + per_shard) {
            nodes.push(
                Service::start_redis_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-node-timeout",
                    "1000",
                    "--cluster-replica-validity-factor",
                    "0",
                ])
                .await,
            );
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = tokio::process::Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args([
                "--cluster-replicas",
                &per_shard.to_string(),
                "--cluster-yes",
            ])
            .output()
            .await
            .unwrap();
        assert!(out.status.success(), "redis-cli --cluster create: {out:?}");
        let topology = ClusterTopology { nodes, per_shard };
        topology.wait_settled().await;
        topology
    }

    /// Every live node says the cluster is ok and knows three primaries with all slots and
    /// their replicas, whose links are up.
    pub async fn wait_settled(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut settled = true;
            for node in self.nodes.iter().filter(|n| n.child.is_some()) {
                let info = redis_cli_at(node.port, &["CLUSTER", "INFO"]).await;
                settled &= info.contains("cluster_state:ok");
                let known = self.cluster_nodes_at(node.port).await;
                settled &= known.iter().filter(|n| n.primary && !n.failed).count() == 3
                    && known.iter().filter(|n| !n.primary && !n.failed).count()
                        == 3 * self.per_shard;
                let replication = redis_cli_at(node.port, &["INFO", "replication"]).await;
                if replication.contains("role:slave") {
                    settled &= replication.contains("master_link_status:up");
                }
            }
            if settled {
                return;
            }
            assert!(Instant::now() < deadline, "the Redis Cluster never settled");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `cluster: { seeds: […] }` for a store or lease backend config (the url names node 0).
    pub fn yaml(&self) -> String {
        format!("{{ seeds: [{}] }}", self.seeds().join(", "))
    }

    pub fn url(&self) -> String {
        self.nodes[0].url()
    }

    pub fn seeds(&self) -> Vec<String> {
        self.nodes[1..]
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect()
    }

    /// The cluster as the node on `port` sees it.
    pub async fn cluster_nodes_at(&self, port: u16) -> Vec<ClusterNode> {
        let out = redis_cli_at(port, &["CLUSTER", "NODES"]).await;
        out.lines()
            .filter_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                let port = f
                    .get(1)?
                    .split('@')
                    .next()?
                    .rsplit(':')
                    .next()?
                    .parse()
                    .ok()?;
                let flags = f.get(2)?;
                let slots = f[8..]
                    .iter()
                    .filter(|s| !s.starts_with('['))
                    .filter_map(|s| {
                        let (a, b) = s.split_once('-').unwrap_or((s, s));
                        Some((a.parse().ok()?, b.parse().ok()?))
                    })
                    .collect();
                Some(ClusterNode {
                    id: f[0].to_owned(),
                    port,
                    primary: flags.contains("master"),
                    failed: flags.contains("fail") && !flags.contains("pfail")
                        || flags.contains("noaddr"),
                    of: (f[3] != "-").then(|| f[3].to_owned()),
                    slots,
                })
            })
            .collect()
    }

    /// The slot of `key`, as the cluster computes it.
    pub async fn slot_of(&self, key: &str) -> u16 {
        let port = self.live().port;
        redis_cli_at(port, &["CLUSTER", "KEYSLOT", key])
            .await
            .trim()
            .parse()
            .unwrap()
    }

    fn live(&self) -> &Service {
        self.nodes.iter().find(|n| n.child.is_some()).unwrap()
    }

    /// The primary serving `slot` and its replica, as a live node sees them.
    pub async fn shard_of(&self, slot: u16) -> (ClusterNode, ClusterNode) {
        let known = self.cluster_nodes_at(self.live().port).await;
        let primary = known
            .iter()
            .find(|n| n.primary && n.slots.iter().any(|(a, b)| *a <= slot && slot <= *b))
            .cloned()
            .expect("a primary serves the slot");
        let replica = known
            .iter()
            .find(|n| n.of.as_deref() == Some(primary.id.as_str()))
            .cloned()
            .expect("the primary has a replica");
        (primary, replica)
    }

    pub fn node(&mut self, port: u16) -> &mut Service {
        self.nodes.iter_mut().find(|n| n.port == port).unwrap()
    }

    /// Waits until every live node names a primary for `slot` other than `old`, and that node
    /// says it is one; returns its port.
    pub async fn wait_promoted(&self, slot: u16, old: u16) -> u16 {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut named = Vec::new();
            for node in self.nodes.iter().filter(|n| n.child.is_some()) {
                let known = self.cluster_nodes_at(node.port).await;
                named.push(
                    known
                        .iter()
                        .find(|n| {
                            n.primary
                                && !n.failed
                                && n.slots.iter().any(|(a, b)| *a <= slot && slot <= *b)
                        })
                        .map(|n| n.port),
                );
            }
            if let Some(Some(port)) = named.first().copied() {
                if port != old
                    && named.iter().all(|n| *n == Some(port))
                    && redis_cli_at(port, &["ROLE"]).await.starts_with("master")
                {
                    return port;
                }
            }
            assert!(
                Instant::now() < deadline,
                "no replica took over slot {slot}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
