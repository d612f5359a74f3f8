//! Replicated fence stores for the failover faults, all on loopback and owned by the run:
//! - a Redis primary with two replicas and three Sentinels (quorum 2, down after 3 s: with 1 s,
//!   on a loaded 2-core machine, a Sentinel sometimes took the primary it had just promoted for
//!   down and a second failover left two primaries with a replica each for a moment, and
//!   acknowledged writes were lost; see docs/reliability.md, finding 18). Each node has its own
//!   `replica-priority`, so the Sentinels promote by priority, not by offset: the replica a
//!   failover promotes is as often the one that lags as the one that is ahead (finding 25);
//! - a PostgreSQL primary with one synchronous standby (`pg_basebackup -R`), on two ports that
//!   the fence's multi-host url names; after a promotion a new standby is made from the new
//!   primary on the old primary's port, so every round starts replicated again;
//! - a three-member etcd cluster; a killed member is restarted on its data and ports.
//!
//! Each can lose its primary (leader) to `kill -9`. Readiness is polled from the servers' own
//! answers (PING, INFO, SENTINEL, `pg_stat_replication`, /health), every wait with a deadline.

use std::future::Future;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::net::TcpStream;
use tokio::process::{Child, Command};

use crate::procs::{free_port, pg_ready, process_tree, PgTools};

/// The master name the Sentinels monitor.
pub const MASTER: &str = "chaosmaster";
/// The user and password fencegate writes as on the Sentinels' data nodes: not the Sentinels'
/// own (the default user), whose rights the deposing fault takes away.
pub const USER: &str = "fencegate:chaos";

/// How long any one readiness wait may take.
const WAIT: Duration = Duration::from_secs(30);

/// Polls `probe` until it answers, within `within`; the error names `what`.
async fn poll<T, F, Fut>(what: &str, within: Duration, mut probe: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = probe().await {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            return Err(format!("{what}: not within {within:?}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether something accepts connections on the port.
async fn listening(port: u16) -> bool {
    TcpStream::connect(("127.0.0.1", port)).await.is_ok()
}

/// One Redis command on a fresh connection, bounded; `None` on any failure.
async fn redis_query<T: redis::FromRedisValue>(port: u16, args: &[&str]) -> Option<T> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).ok()?;
    let query = async {
        let mut conn = client.get_multiplexed_async_connection().await.ok()?;
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query_async::<T>(&mut conn).await.ok()
    };
    tokio::time::timeout(Duration::from_secs(1), query)
        .await
        .ok()
        .flatten()
}

/// A flat `[field, value, field, value, …]` reply as pairs.
fn fields(flat: &[String]) -> std::collections::HashMap<&str, &str> {
    flat.chunks(2)
        .filter_map(|p| match p {
            [k, v] => Some((k.as_str(), v.as_str())),
            _ => None,
        })
        .collect()
}

/// A Redis data node or Sentinel: its port, process and directory (AOF, Sentinel config).
struct RedisProc {
    port: u16,
    /// `replica-priority` as a data node (unused by a Sentinel).
    priority: u32,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl RedisProc {
    fn new() -> RedisProc {
        RedisProc {
            port: free_port(),
            priority: 100,
            child: None,
            dir: tempfile::tempdir().unwrap(),
        }
    }

    /// Starts a data node (durable: AOF with fsync always), a replica of `of` if given.
    async fn spawn_node(&mut self, of: Option<u16>) -> Result<(), String> {
        let mut c = Command::new("redis-server");
        c.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ])
            // A replica that needs a full copy gets it at once, not after waiting for others.
            .args(["--repl-diskless-sync-delay", "0"])
            .args(["--replica-priority", &self.priority.to_string(), "--dir"])
            .arg(self.dir.path())
            .args(["--user", "fencegate", "on", ">chaos", "~*", "&*", "+@all"]);
        if let Some(primary) = of {
            c.args(["--replicaof", "127.0.0.1", &primary.to_string()]);
        }
        self.run(c).await
    }

    /// Starts a Sentinel watching the primary on `primary`.
    async fn spawn_sentinel(&mut self, primary: u16) -> Result<(), String> {
        let conf = self.dir.path().join("sentinel.conf");
        // `FENCEGATE_CHAOS_DOWN_AFTER_MS` sets it shorter, to provoke back-to-back failovers.
        let down_after: u64 = std::env::var("FENCEGATE_CHAOS_DOWN_AFTER_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(3000);
        std::fs::write(
            &conf,
            format!(
                "sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n\
                 sentinel down-after-milliseconds {MASTER} {down_after}\n\
                 sentinel failover-timeout {MASTER} 2000\n"
            ),
        )
        .map_err(|e| e.to_string())?;
        let mut c = Command::new("redis-server");
        c.arg(&conf)
            .args(["--sentinel", "--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--dir"])
            .arg(self.dir.path());
        self.run(c).await
    }

    async fn run(&mut self, mut c: Command) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("redis.log"))
            .map_err(|e| e.to_string())?;
        let child = c
            .stdout(log)
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start redis-server: {e}"))?;
        self.child = Some(child);
        let port = self.port;
        poll(
            &format!("redis on port {port} answers PING"),
            WAIT,
            || async move {
                redis_query::<String>(port, &["PING"])
                    .await
                    .filter(|p| p == "PONG")
            },
        )
        .await
        .map(|_| ())
    }

    async fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }
}

/// A Redis primary, two replicas and three Sentinels.
pub struct Sentinels {
    nodes: Vec<RedisProc>,
    sentinels: Vec<RedisProc>,
}

impl Sentinels {
    /// Started and settled, or why not.
    pub async fn start() -> Result<Sentinels, String> {
        let mut nodes: Vec<RedisProc> = (0..3).map(|_| RedisProc::new()).collect();
        for (node, priority) in nodes.iter_mut().zip([30, 20, 10]) {
            node.priority = priority;
        }
        let primary = nodes[0].port;
        nodes[0].spawn_node(None).await?;
        for node in &mut nodes[1..] {
            node.spawn_node(Some(primary)).await?;
        }
        let mut sentinels: Vec<RedisProc> = (0..3).map(|_| RedisProc::new()).collect();
        for s in &mut sentinels {
            s.spawn_sentinel(primary).await?;
        }
        let set = Sentinels { nodes, sentinels };
        set.settled().await?;
        Ok(set)
    }

    /// `sentinel: { … }` for a store config.
    pub fn yaml(&self) -> String {
        let urls: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("'redis://127.0.0.1:{}'", s.port))
            .collect();
        format!("{{ master: {MASTER}, urls: [{}] }}", urls.join(", "))
    }

    /// The primary's port, as every Sentinel names it.
    async fn named(&self) -> Option<u16> {
        let mut named = None;
        for s in &self.sentinels {
            let (_, port) = redis_query::<Option<(String, String)>>(
                s.port,
                &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER],
            )
            .await
            .flatten()?;
            let port: u16 = port.parse().ok()?;
            if named.is_some_and(|n| n != port) {
                return None;
            }
            named = Some(port);
        }
        named
    }

    async fn role(port: u16) -> Option<String> {
        let info = redis_query::<String>(port, &["INFO", "replication"]).await?;
        info.lines()
            .find_map(|l| l.strip_prefix("role:"))
            .map(|r| r.trim().to_owned())
    }

    /// Waits until the Sentinels agree on a primary, it is one, both replicas replicate it
    /// (link up, online at the primary), and every Sentinel sees the primary, two healthy
    /// replicas and two other Sentinels: a next failover can be agreed and finds a replica.
    /// The primary is whichever they agree on: a second failover right after the first (the
    /// promoted node taken for down in turn) settles around the node it promoted.
    async fn settled(&self) -> Result<(), String> {
        poll("the Sentinel topology settles", WAIT, || async move {
            let primary = self.named().await?;
            let info = redis_query::<String>(primary, &["INFO", "replication"]).await?;
            let online = info
                .lines()
                .filter(|l| l.starts_with("slave") && l.contains("state=online"))
                .count();
            if !info.contains("role:master") || online != 2 {
                return None;
            }
            for n in self.nodes.iter().filter(|n| n.port != primary) {
                let info = redis_query::<String>(n.port, &["INFO", "replication"]).await?;
                if !info.contains("master_link_status:up") {
                    return None;
                }
            }
            for s in &self.sentinels {
                let master =
                    redis_query::<Vec<String>>(s.port, &["SENTINEL", "MASTER", MASTER]).await?;
                let m = fields(&master);
                if m.get("flags") != Some(&"master")
                    || m.get("num-slaves") != Some(&"2")
                    || m.get("num-other-sentinels") != Some(&"2")
                {
                    return None;
                }
                let replicas =
                    redis_query::<Vec<Vec<String>>>(s.port, &["SENTINEL", "REPLICAS", MASTER])
                        .await?;
                let healthy = replicas.iter().all(|r| {
                    let r = fields(r);
                    r.get("flags") == Some(&"slave") && r.get("master-link-status") == Some(&"ok")
                });
                if !healthy {
                    return None;
                }
            }
            Some(())
        })
        .await
    }

    /// Kills the primary (`kill -9`); returns its port.
    pub async fn kill_primary(&mut self) -> Result<u16, String> {
        let primary = self
            .named()
            .await
            .ok_or("the Sentinels do not agree on a primary")?;
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.port == primary)
            .ok_or("the Sentinels name no node of the run")?;
        node.kill9().await;
        Ok(primary)
    }

    /// Deposes the primary the Sentinels name without stopping it: their `PING`s (as the
    /// default user) are refused, so they take it for down and fail it over, while it keeps
    /// serving fencegate's user as a primary with its replicas until the Sentinels move them.
    pub async fn depose_primary(&mut self) -> Result<u16, String> {
        let primary = self
            .named()
            .await
            .ok_or("the Sentinels do not agree on a primary")?;
        redis_query::<String>(primary, &["ACL", "SETUSER", "default", "-ping"])
            .await
            .ok_or("the primary did not take the ACL change")?;
        Ok(primary)
    }

    /// The deposed node answers the Sentinels again; they turn it into a replica of the
    /// promoted one, and the topology settles.
    pub async fn readmit(&mut self, old: u16) -> Result<(), String> {
        redis_query::<String>(old, &["ACL", "SETUSER", "default", "+ping"])
            .await
            .ok_or("the deposed node did not take the ACL change")?;
        self.settled().await
    }

    /// Waits until every Sentinel names another node, and it is a primary; returns its port.
    pub async fn wait_promoted(&self, old: u16) -> Result<u16, String> {
        poll("the Sentinels promote a replica", WAIT, || async move {
            let port = self.named().await.filter(|p| *p != old)?;
            (Self::role(port).await.as_deref() == Some("master")).then_some(port)
        })
        .await
    }

    /// What each node and Sentinel says now, and the end of each Sentinel's log (its events:
    /// `+sdown`, `+switch-master`, `+convert-to-slave`, …): for a report when something fails.
    pub async fn describe(&self) -> String {
        let mut out = String::new();
        for n in &self.nodes {
            let info = redis_query::<String>(n.port, &["INFO", "replication"])
                .await
                .unwrap_or_else(|| "(no answer)".into());
            let keep: Vec<&str> = info
                .lines()
                .filter(|l| {
                    [
                        "role:",
                        "master_port:",
                        "master_link_status:",
                        "slave",
                        "master_repl_offset:",
                    ]
                    .iter()
                    .any(|k| l.starts_with(k))
                })
                .map(str::trim)
                .collect();
            out.push_str(&format!("    node :{}: {}\n", n.port, keep.join(" ")));
            let log = std::fs::read_to_string(n.dir.path().join("redis.log")).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            for l in &lines[lines.len().saturating_sub(30)..] {
                out.push_str(&format!("      {l}\n"));
            }
        }
        for s in &self.sentinels {
            let master = redis_query::<Vec<String>>(s.port, &["SENTINEL", "MASTER", MASTER])
                .await
                .unwrap_or_default();
            let m = fields(&master);
            let replicas =
                redis_query::<Vec<Vec<String>>>(s.port, &["SENTINEL", "REPLICAS", MASTER])
                    .await
                    .unwrap_or_default();
            let replicas: Vec<String> = replicas
                .iter()
                .map(|r| {
                    let r = fields(r);
                    format!(
                        ":{} {} link {} offset {}",
                        r.get("port").unwrap_or(&"?"),
                        r.get("flags").unwrap_or(&"?"),
                        r.get("master-link-status").unwrap_or(&"?"),
                        r.get("slave-repl-offset").unwrap_or(&"?")
                    )
                })
                .collect();
            out.push_str(&format!(
                "    sentinel :{}: master :{} {} epoch {}; replicas {}\n",
                s.port,
                m.get("port").unwrap_or(&"?"),
                m.get("flags").unwrap_or(&"?"),
                m.get("config-epoch").unwrap_or(&"?"),
                replicas.join(", ")
            ));
            let log = std::fs::read_to_string(s.dir.path().join("redis.log")).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            for l in &lines[lines.len().saturating_sub(25)..] {
                out.push_str(&format!("      {l}\n"));
            }
        }
        out
    }

    /// Restarts the killed node as a replica of `primary` (as Sentinel would reconfigure it),
    /// then waits until the topology has settled (around `primary`, or the node a second
    /// failover promoted).
    pub async fn rejoin(&mut self, old: u16, primary: u16) -> Result<(), String> {
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.port == old)
            .ok_or("no such node")?;
        node.spawn_node(Some(primary)).await?;
        self.settled().await
    }
}

/// One PostgreSQL server of a [`PgPair`]: its process and data directory.
struct PgNode {
    child: Child,
    dir: tempfile::TempDir,
}

/// A PostgreSQL primary and a synchronous standby on two fixed ports.
pub struct PgPair {
    tools: PgTools,
    pub ports: [u16; 2],
    nodes: [Option<PgNode>; 2],
    /// The slot (0 or 1) of the primary.
    primary: usize,
    /// Standbys made so far (their `application_name`s are `s1`, `s2`, …).
    made: u32,
}

impl PgPair {
    /// Started, the standby streaming and synchronous, or why not.
    pub async fn start() -> Result<PgPair, String> {
        let tools = PgTools::find()?;
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        tools.own(dir.path())?;
        let initdb = tools
            .command("initdb")
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(dir.path().join("data"))
            .stderr(Stdio::null())
            .status()
            .await
            .map_err(|e| format!("initdb: {e}"))?;
        if !initdb.success() {
            return Err(format!("initdb failed ({initdb})"));
        }
        let mut pair = PgPair {
            tools,
            ports: [free_port(), free_port()],
            nodes: [None, None],
            primary: 0,
            made: 0,
        };
        let child = pair.spawn(0, dir.path())?;
        pair.nodes[0] = Some(PgNode { child, dir });
        pg_ready(&pair.tools, pair.ports[0]).await?;
        pair.add_standby().await?;
        Ok(pair)
    }

    /// The fence store's url: both hosts, a read-write session on whichever is the primary.
    pub fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres\
             ?target_session_attrs=read-write&connect_timeout=2",
            self.ports[0], self.ports[1]
        )
    }

    /// Starts the server of `slot` on `dir/data`. Every server of the pair, standby or
    /// primary, requires one synchronous standby (`*`: any that connects): a promoted standby
    /// acknowledges no commit until a standby of its own holds it.
    fn spawn(&self, slot: usize, dir: &Path) -> Result<Child, String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("server.log"))
            .map_err(|e| e.to_string())?;
        self.tools
            .command("postgres")
            .arg("-D")
            .arg(dir.join("data"))
            .args(["-p", &self.ports[slot].to_string()])
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "unix_socket_directories=",
            ])
            .args(["-c", "synchronous_standby_names=*"])
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start postgres: {e}"))
    }

    /// The first column of the first row of `sql` on the server of `slot`.
    async fn sql(&self, slot: usize, sql: &str) -> Option<String> {
        let url = format!(
            "postgres://postgres@127.0.0.1:{}/postgres?connect_timeout=2",
            self.ports[slot]
        );
        let query = async {
            let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .ok()?;
            tokio::spawn(conn);
            let rows = client.simple_query(sql).await.ok()?;
            rows.into_iter().find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
                _ => None,
            })
        };
        tokio::time::timeout(Duration::from_secs(3), query)
            .await
            .ok()
            .flatten()
    }

    /// Makes a standby of the primary in the other slot (`pg_basebackup -R`, fast checkpoint),
    /// starts it, and waits until the primary counts it as its synchronous standby.
    async fn add_standby(&mut self) -> Result<(), String> {
        let slot = 1 - self.primary;
        assert!(self.nodes[slot].is_none(), "the standby slot is taken");
        self.made += 1;
        let name = format!("s{}", self.made);
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        self.tools.own(dir.path())?;
        let conninfo = format!(
            "host=127.0.0.1 port={} user=postgres application_name={name}",
            self.ports[self.primary]
        );
        let backup = self
            .tools
            .command("pg_basebackup")
            .args(["-d", &conninfo, "-R", "-X", "stream", "-c", "fast"])
            .args(["--no-sync", "-D"])
            .arg(dir.path().join("data"))
            .stderr(Stdio::null())
            .status()
            .await
            .map_err(|e| format!("pg_basebackup: {e}"))?;
        if !backup.success() {
            return Err(format!("pg_basebackup failed ({backup})"));
        }
        let child = self.spawn(slot, dir.path())?;
        self.nodes[slot] = Some(PgNode { child, dir });
        let sql = format!(
            "SELECT count(*) FROM pg_stat_replication \
             WHERE application_name = '{name}' AND state = 'streaming' AND sync_state = 'sync'"
        );
        let (this, sql, primary) = (&*self, &sql, self.primary);
        poll(
            &format!("standby {name} streams synchronously"),
            WAIT,
            || async move { (this.sql(primary, sql).await.as_deref() == Some("1")).then_some(()) },
        )
        .await
    }

    /// Kills the primary (`kill -9` of the postmaster and every backend, as a crashed host's
    /// would go) and waits until its port is free; returns the port.
    pub async fn kill_primary(&mut self) -> Result<u16, String> {
        let port = self.ports[self.primary];
        let mut node = self.nodes[self.primary].take().ok_or("no primary")?;
        if let Some(pid) = node.child.id() {
            for p in process_tree(pid) {
                let _ = std::process::Command::new("kill")
                    .args(["-9", &p.to_string()])
                    .stderr(Stdio::null())
                    .status();
            }
        }
        let _ = node.child.wait().await;
        poll(
            &format!("postgres on port {port} stops listening"),
            WAIT,
            || async move { (!listening(port).await).then_some(()) },
        )
        .await?;
        Ok(port)
    }

    /// Promotes the standby (`pg_ctl promote`), waits until it accepts writes; returns its port.
    pub async fn promote(&mut self) -> Result<u16, String> {
        let slot = 1 - self.primary;
        let node = self.nodes[slot].as_ref().ok_or("no standby")?;
        let status = self
            .tools
            .command("pg_ctl")
            .args(["promote", "-D"])
            .arg(node.dir.path().join("data"))
            .stderr(Stdio::null())
            .status()
            .await
            .map_err(|e| format!("pg_ctl: {e}"))?;
        if !status.success() {
            return Err(format!("pg_ctl promote failed ({status})"));
        }
        let this = &*self;
        poll("the standby leaves recovery", WAIT, || async move {
            (this
                .sql(slot, "SELECT pg_is_in_recovery()")
                .await
                .as_deref()
                == Some("f"))
            .then_some(())
        })
        .await?;
        self.primary = slot;
        Ok(self.ports[slot])
    }

    /// A new synchronous standby of the promoted primary on the old primary's port.
    pub async fn rebuild_standby(&mut self) -> Result<(), String> {
        self.add_standby().await
    }
}

impl Drop for PgPair {
    /// Every server process goes (`kill -9` of each postmaster and its backends).
    fn drop(&mut self) {
        for node in self.nodes.iter().flatten() {
            if let Some(pid) = node.child.id() {
                for p in process_tree(pid) {
                    let _ = std::process::Command::new("kill")
                        .args(["-9", &p.to_string()])
                        .stderr(Stdio::null())
                        .status();
                }
            }
        }
    }
}

/// A three-member etcd cluster; members are killed and restarted on their data and ports.
pub struct EtcdCluster {
    /// (client port, peer port) per member `m{i}`.
    ports: Vec<(u16, u16)>,
    children: Vec<Option<Child>>,
    dir: tempfile::TempDir,
}

impl EtcdCluster {
    /// Started and healthy, or why not.
    pub async fn start() -> Result<EtcdCluster, String> {
        let mut last = String::new();
        // Ports picked free may be taken before a member binds them: then start afresh.
        for _ in 0..3 {
            let mut cluster = EtcdCluster {
                ports: (0..3).map(|_| (free_port(), free_port())).collect(),
                children: vec![None, None, None],
                dir: tempfile::tempdir().map_err(|e| e.to_string())?,
            };
            let started = async {
                for i in 0..3 {
                    cluster.spawn(i)?;
                }
                cluster.healthy().await
            };
            match started.await {
                Ok(()) => return Ok(cluster),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn spawn(&mut self, i: usize) -> Result<(), String> {
        let initial: Vec<String> = self
            .ports
            .iter()
            .enumerate()
            .map(|(m, (_, peer))| format!("m{m}=http://127.0.0.1:{peer}"))
            .collect();
        let (client, peer) = self.ports[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("m{i}.log")))
            .map_err(|e| e.to_string())?;
        let child = Command::new("etcd")
            .args(["--name", &format!("m{i}"), "--data-dir"])
            .arg(self.dir.path().join(format!("m{i}")))
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
                // Ignored once the member has data: a restarted member rejoins.
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                "fencegate-chaos",
                "--log-level",
                "error",
            ])
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start etcd: {e}"))?;
        self.children[i] = Some(child);
        Ok(())
    }

    /// `etcd://` with every member's endpoint.
    pub fn url(&self) -> String {
        let endpoints: Vec<String> = self
            .ports
            .iter()
            .map(|(c, _)| format!("127.0.0.1:{c}"))
            .collect();
        format!("etcd://{}", endpoints.join(","))
    }

    /// Whether the member on `port` is healthy: up, in a cluster with a leader.
    async fn member_healthy(port: u16) -> bool {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let probe = async {
            let mut s = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
            s.write_all(b"GET /health HTTP/1.0\r\n\r\n").await.ok()?;
            let mut buf = Vec::new();
            s.read_to_end(&mut buf).await.ok()?;
            Some(String::from_utf8_lossy(&buf).contains("\"health\":\"true\""))
        };
        tokio::time::timeout(Duration::from_secs(2), probe)
            .await
            .ok()
            .flatten()
            .unwrap_or(false)
    }

    /// Waits until every running member is healthy.
    async fn healthy(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut all = true;
            for (i, (client, _)) in self.ports.iter().enumerate() {
                if self.children[i].is_some() && !Self::member_healthy(*client).await {
                    all = false;
                }
            }
            if all {
                return Ok(());
            }
            for child in self.children.iter_mut().flatten() {
                if matches!(child.try_wait(), Ok(Some(_))) {
                    return Err("an etcd member exited".into());
                }
            }
            if Instant::now() >= deadline {
                return Err("the etcd cluster is not healthy within 60s".into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The index of the leader, as the running members' status says
    /// (`etcdctl endpoint status`: each member's id and its leader's id).
    pub async fn leader(&self) -> Result<usize, String> {
        let alive: Vec<usize> = (0..3).filter(|i| self.children[*i].is_some()).collect();
        let endpoints: Vec<String> = alive
            .iter()
            .map(|i| format!("http://127.0.0.1:{}", self.ports[*i].0))
            .collect();
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &endpoints.join(","), "endpoint", "status"])
            .args(["-w", "json"])
            .output()
            .await
            .map_err(|e| format!("etcdctl: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "etcdctl endpoint status failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let status: serde_json::Value =
            serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
        let members = status.as_array().ok_or("etcdctl: not a list")?;
        let leader = &members.first().ok_or("etcdctl: no member")?["Status"]["leader"];
        members
            .iter()
            .position(|m| &m["Status"]["header"]["member_id"] == leader)
            .map(|at| alive[at])
            .ok_or_else(|| "no running member is the leader".into())
    }

    /// `kill -9` of member `i`.
    pub async fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.children[i].take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    /// Waits until the running members are healthy again (they have elected a leader).
    pub async fn wait_leader(&mut self) -> Result<(), String> {
        self.healthy().await
    }

    /// Restarts member `i` on its data and ports, and waits until all three are healthy.
    pub async fn restart(&mut self, i: usize) -> Result<(), String> {
        self.spawn(i)?;
        self.healthy().await
    }
}

/// A fence store topology that can fail over.
pub enum Replicated {
    Sentinel(Sentinels),
    Postgres(Box<PgPair>),
    Etcd(EtcdCluster),
}
