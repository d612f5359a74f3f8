//! Real processes: the fencegate binary (readiness from its JSON logs) and a throwaway
//! redis-server that can be killed with `kill -9` and restarted on the same port and data.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

const BIN: &str = env!("CARGO_BIN_EXE_fencegate");

/// A running `fencegate run`.
pub struct Fencegate {
    pub child: Child,
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    pub leases: Option<SocketAddr>,
    pub egress: Option<SocketAddr>,
    /// Every JSON log line, as written.
    pub logs: mpsc::UnboundedReceiver<Value>,
}

impl Fencegate {
    pub async fn start(config: &Path) -> Fencegate {
        Fencegate::start_with(&[], config).await
    }

    /// Starts it under a command prefix (`ip netns exec <ns>`, which execs the binary: the
    /// child's pid is fencegate's own, so signals reach it).
    pub async fn start_with(prefix: &[String], config: &Path) -> Fencegate {
        let mut command = match prefix.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(BIN);
                c
            }
            None => Command::new(BIN),
        };
        let mut child = command
            .args(["run", "--config"])
            .arg(config)
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("cannot start fencegate");
        let stderr = child.stderr.take().unwrap();
        let (tx, mut logs) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                match serde_json::from_str::<Value>(&line) {
                    Ok(v) => {
                        let _ = tx.send(v);
                    }
                    Err(e) => eprintln!("fencegate wrote a non-JSON line ({e}): {line}"),
                }
            }
        });
        let started = wait_log(&mut logs, "fencegate started", Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", config.display()));
        let addr = |k: &str| started[k].as_str().map(|a| a.parse().unwrap());
        Fencegate {
            child,
            proxy: addr("listen").unwrap(),
            admin: addr("admin").unwrap(),
            leases: addr("leases"),
            egress: addr("egress"),
            logs,
        }
    }

    /// Discards the log lines read so far (they are only needed for readiness).
    pub fn drain_logs(&mut self) {
        while self.logs.try_recv().is_ok() {}
    }

    pub fn pid(&self) -> u32 {
        self.child.id().expect("running")
    }

    pub fn signal(&self, name: &str) {
        signal(self.pid(), name);
    }

    /// Waits for the process to exit (after a signal), bounded.
    pub async fn exited(&mut self, within: Duration) -> std::process::ExitStatus {
        tokio::time::timeout(within, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("fencegate did not exit within {within:?}"))
            .unwrap()
    }
}

pub fn signal(pid: u32, name: &str) {
    let status = std::process::Command::new("kill")
        .args([name, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {name} {pid} failed");
}

/// The next log line with this message (lines before it are consumed).
pub async fn wait_log(
    logs: &mut mpsc::UnboundedReceiver<Value>,
    message: &str,
    within: Duration,
) -> Result<Value, String> {
    let found = tokio::time::timeout(within, async {
        // The last lines before it, to say why a process that exits early did.
        let mut before = std::collections::VecDeque::with_capacity(5);
        while let Some(line) = logs.recv().await {
            if line["message"] == message {
                return Ok(line);
            }
            if before.len() == 5 {
                before.pop_front();
            }
            before.push_back(line.to_string());
        }
        let before = Vec::from(before).join("\n  ");
        Err(format!(
            "process exited before logging `{message}`; its last lines:\n  {before}"
        ))
    });
    found
        .await
        .unwrap_or_else(|_| Err(format!("no `{message}` log line within {within:?}")))
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A key prefix no other run uses, on the machine's shared Redis.
pub fn fresh_prefix() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
        % 1_000_000_000_000;
    format!("chaos{}_{nanos}", std::process::id())
}

/// A redis-server owned by the run. A fence store's is durable like production should be (AOF,
/// fsync always), so recorded maxima survive `kill -9`; the lease backend's keeps nothing on
/// disk (leases are short-lived) and also listens on the host ends of the run's veth pairs.
pub struct Redis {
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
    durable: bool,
    /// Addresses besides 127.0.0.1 (private veth addresses of the run).
    also: Vec<Ipv4Addr>,
}

impl Redis {
    pub async fn start() -> Redis {
        Redis::start_on(true, Vec::new()).await
    }

    pub async fn start_on(durable: bool, also: Vec<Ipv4Addr>) -> Redis {
        let mut r = Redis {
            port: free_port(),
            child: None,
            dir: tempfile::tempdir().unwrap(),
            durable,
            also,
        };
        r.spawn().await;
        r
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The URL through one of the other addresses it listens on.
    pub fn url_at(&self, addr: Ipv4Addr) -> String {
        format!("redis://{addr}:{}/", self.port)
    }

    async fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("redis.log"))
            .unwrap();
        let mut bind = vec!["127.0.0.1".to_owned()];
        bind.extend(self.also.iter().map(Ipv4Addr::to_string));
        let aof = if self.durable { "yes" } else { "no" };
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind"])
            .args(&bind)
            // Other addresses than loopback are the run's private /30s, reached only from its
            // own namespaces.
            .args(["--protected-mode", "no", "--save", "", "--appendonly", aof])
            .args(["--appendfsync", "always", "--dir"])
            .arg(self.dir.path())
            .stdout(log)
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("cannot start redis-server");
        self.child = Some(child);
        self.wait_ready().await;
    }

    /// Bounded polling of the server's own readiness answer (PING).
    async fn wait_ready(&self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)).await {
                let mut buf = [0u8; 16];
                if s.write_all(b"PING\r\n").await.is_ok()
                    && matches!(s.read(&mut buf).await, Ok(n) if buf[..n].starts_with(b"+PONG"))
                {
                    return;
                }
            }
            assert!(
                std::time::Instant::now() < deadline,
                "redis on port {} never became ready",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sends a signal to the server (`-STOP`/`-CONT`: the stalled-store fault).
    pub fn signal(&self, name: &str) {
        let pid = self.child.as_ref().and_then(Child::id).expect("running");
        signal(pid, name);
    }

    pub async fn kill9(&mut self) {
        let mut child = self.child.take().expect("running");
        child.start_kill().unwrap();
        child.wait().await.unwrap();
    }

    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "kill first");
        self.spawn().await;
    }
}

/// A throwaway PostgreSQL cluster owned by the run (a fence store the stalled-store fault
/// stops): `initdb` into a temporary directory, the server on a free port, TCP only, trust
/// authentication. As root it runs as the `postgres` user (`setpriv`, which execs, so the
/// child is the postmaster itself).
pub struct Postgres {
    pub port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Postgres {
    /// Starts one, or says why it cannot.
    pub async fn start() -> Result<Postgres, String> {
        let tools = PgTools::find()?;
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let data = dir.path().join("data");
        tools.own(dir.path())?;
        let initdb = tools
            .command("initdb")
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(&data)
            .stderr(Stdio::null())
            .status()
            .await
            .map_err(|e| format!("initdb: {e}"))?;
        if !initdb.success() {
            return Err(format!("initdb failed ({initdb})"));
        }
        let port = free_port();
        let log =
            std::fs::File::create(dir.path().join("server.log")).map_err(|e| e.to_string())?;
        let child = tools
            .command("postgres")
            .arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string(), "-c", "listen_addresses=127.0.0.1"])
            .args(["-c", "unix_socket_directories="])
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start postgres: {e}"))?;
        let pg = Postgres {
            port,
            child,
            _dir: dir,
        };
        pg_ready(&tools, port).await?;
        Ok(pg)
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The postmaster and its children (one backend per client connection, the background
    /// processes), from /proc.
    fn pids(&self) -> Vec<u32> {
        self.child.id().map(process_tree).unwrap_or_default()
    }

    /// Sends a signal to every server process (`-STOP`/`-CONT`: the stalled-store fault).
    pub fn signal(&self, name: &str) {
        for pid in self.pids() {
            // A backend may have exited meanwhile.
            let _ = std::process::Command::new("kill")
                .args([name, &pid.to_string()])
                .status();
        }
    }
}

/// Where PostgreSQL's server binaries are and whom they run as: as root, the `postgres` user
/// (`setpriv`, which execs, so a started server's pid is the postmaster's own).
pub struct PgTools {
    bin: PathBuf,
    run_as: Vec<String>,
}

impl PgTools {
    /// The newest installed version, or why there is none.
    pub fn find() -> Result<PgTools, String> {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .map_err(|e| format!("no PostgreSQL under /usr/lib/postgresql: {e}"))?
            .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
            .filter(|b| b.join("initdb").is_file())
            .max()
            .ok_or("no /usr/lib/postgresql/*/bin/initdb")?;
        let root = std::fs::read_to_string("/proc/self/status")
            .is_ok_and(|s| s.lines().any(|l| l.starts_with("Uid:\t0\t")));
        // As root: the server refuses to run as root; as the `postgres` user instead.
        let run_as = if root {
            [
                "setpriv",
                "--reuid=postgres",
                "--regid=postgres",
                "--init-groups",
                "--",
            ]
            .map(str::to_owned)
            .to_vec()
        } else {
            Vec::new()
        };
        Ok(PgTools { bin, run_as })
    }

    /// Makes `dir` the server user's (as root; otherwise it is already ours).
    pub fn own(&self, dir: &Path) -> Result<(), String> {
        if self.run_as.is_empty() {
            return Ok(());
        }
        let chown = std::process::Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(dir)
            .status()
            .map_err(|e| format!("chown: {e}"))?;
        if !chown.success() {
            return Err("chown to the postgres user failed (no such user?)".into());
        }
        Ok(())
    }

    /// One of the server's programs, run as its user, stdin and stdout closed.
    pub fn command(&self, program: &str) -> Command {
        let program = self.bin.join(program);
        let mut c = match self.run_as.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(&program);
                c
            }
            None => Command::new(&program),
        };
        c.stdin(Stdio::null()).stdout(Stdio::null());
        c
    }
}

/// Bounded polling of a server's own readiness answer (`pg_isready`).
pub async fn pg_ready(tools: &PgTools, port: u16) -> Result<(), String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let ready = Command::new(tools.bin.join("pg_isready"))
            .args(["-q", "-h", "127.0.0.1", "-p", &port.to_string()])
            .status()
            .await
            .is_ok_and(|s| s.success());
        if ready {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            return Err(format!("postgres on port {port} never became ready"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A process and its children, from /proc (a postmaster and its backends).
pub fn process_tree(master: u32) -> Vec<u32> {
    let mut pids = vec![master];
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        // `pid (comm) state ppid ...`; comm may hold spaces, so after the last `)`.
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(master) {
            pids.push(pid);
        }
    }
    pids
}

impl Drop for Postgres {
    /// Every server process goes, also a stopped one (the postmaster's own kill on drop would
    /// leave stopped children behind).
    fn drop(&mut self) {
        self.signal("-KILL");
    }
}

/// The leases a Redis lease backend holds for `holder` under `prefix`, read from Redis
/// directly: every `<prefix>:{<resource>}:lease` key whose value
/// (`<lease_id>|<token>|<holder>`) names the holder, as (resource, token).
pub async fn leases_held_by(url: &str, prefix: &str, holder: &str) -> Vec<(String, u64)> {
    let client = redis::Client::open(url).expect("a valid Redis URL");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("the lease Redis answers");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*:lease"))
        .query_async(&mut conn)
        .await
        .expect("KEYS");
    let mut held = Vec::new();
    for key in keys {
        let value: Option<String> = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("GET");
        let Some(value) = value else { continue };
        let mut parts = value.splitn(3, '|');
        let (_, token, who) = (parts.next(), parts.next(), parts.next());
        if who == Some(holder) {
            let resource = key
                .strip_prefix(&format!("{prefix}:{{"))
                .and_then(|k| k.strip_suffix("}:lease"))
                .unwrap_or(&key)
                .to_owned();
            held.push((resource, token.and_then(|t| t.parse().ok()).unwrap_or(0)));
        }
    }
    held
}

/// Writes a config file into `dir`.
pub fn write_config(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}
