//! Network namespaces for the partition fault: one namespace per group, joined to the host by
//! a veth pair with addresses from a private /30, and one nftables table that, while a
//! partition lasts, drops the TCP traffic between a namespace and the lease Redis.
//!
//! Names (so a later run can tell its own leftovers from anything else on the machine):
//! namespaces `fgchaos-<pid>-<n>`, host-side veth `fgc<pid>h<n>` (the peer, `fgc<pid>n<n>`,
//! lives in the namespace), nftables table `inet fgchaos_<pid>`. Everything is removed when
//! the [`Lab`] is dropped (also while unwinding from a panic); at setup, leftovers of runs whose
//! process is gone (a run killed before its drop ran) are removed. Nothing else is touched.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

/// Bound on one `ip`/`nft` call made during the run.
const TOOL_BOUND: Duration = Duration::from_secs(10);

/// One namespace and its link to the host.
#[derive(Debug, Clone)]
pub struct Link {
    pub ns: String,
    pub host_if: String,
    /// The host end's address: what processes in the namespace dial to reach the host.
    pub host_addr: Ipv4Addr,
    /// The namespace end's address: what the host dials to reach the namespace.
    pub ns_addr: Ipv4Addr,
}

/// The namespaces, veth pairs and nftables table of one run.
pub struct Lab {
    ip: PathBuf,
    nft: PathBuf,
    table: Option<String>,
    pub links: Vec<Link>,
}

/// `name` found on PATH or in the sbin directories (root's tools; PATH may lack them).
fn tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Runs a tool to completion; its stdout, or a one-line reason.
fn run(program: &PathBuf, args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", program.display()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`{} {}` failed ({}): {}",
            program.display(),
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The same, without blocking the runtime, bounded.
async fn run_async(program: &PathBuf, args: &[&str]) -> Result<(), String> {
    let out = tokio::process::Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(TOOL_BOUND, out)
        .await
        .map_err(|_| {
            format!(
                "`{} {}` took over {TOOL_BOUND:?}",
                program.display(),
                args.join(" ")
            )
        })?
        .map_err(|e| format!("cannot run {}: {e}", program.display()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{} {}` failed ({}): {}",
            program.display(),
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Is `pid` a live run of this harness (the test binary is `chaos-<hash>`)? A pid that is gone,
/// or reused by another program, owns nothing any more.
fn live_run(pid: u32) -> bool {
    pid != std::process::id()
        && std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .is_ok_and(|comm| comm.starts_with("chaos"))
}

/// The pid in a name of ours, `<prefix><pid>` or `<prefix><pid><sep><n>` (digits only), so
/// that a name merely starting like ours is never taken for one.
fn owner(name: &str, prefix: &str, sep: Option<char>) -> Option<u32> {
    let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    let rest = name.strip_prefix(prefix)?;
    let pid = match sep {
        Some(c) => {
            let (pid, n) = rest.split_once(c)?;
            digits(n).then_some(pid)?
        }
        None => rest,
    };
    if digits(pid) {
        pid.parse().ok()
    } else {
        None
    }
}

impl Lab {
    /// Creates `count` namespaces with their veth pairs and the (empty) nftables table, after
    /// removing the leftovers of dead runs. `Err` says why partitions cannot be made here.
    pub fn setup(count: usize) -> Result<Lab, String> {
        let ip = tool("ip").ok_or("`ip` (iproute2) not found")?;
        let nft = tool("nft").ok_or("`nft` (nftables) not found")?;
        let mut lab = Lab {
            ip,
            nft,
            table: None,
            links: Vec::new(),
        };
        lab.remove_stale();
        let pid = std::process::id();
        // A /24 of 10.201.0.0/16 that no interface of the host uses yet; its /30s are ours.
        let used = run(&lab.ip, &["-o", "-4", "addr", "show"])?;
        let third = (0..250u32)
            .map(|k| ((pid + k) % 250) as u8)
            .find(|t| !used.contains(&format!("10.201.{t}.")))
            .ok_or("no free /24 in 10.201.0.0/16")?;
        for n in 0..count {
            let link = Link {
                ns: format!("fgchaos-{pid}-{n}"),
                host_if: format!("fgc{pid}h{n}"),
                host_addr: Ipv4Addr::new(10, 201, third, 4 * n as u8 + 1),
                ns_addr: Ipv4Addr::new(10, 201, third, 4 * n as u8 + 2),
            };
            let peer = format!("fgc{pid}n{n}");
            run(&lab.ip, &["netns", "add", &link.ns])?;
            // Recorded as soon as it exists, so a failure below still removes it.
            lab.links.push(link.clone());
            let host_cidr = format!("{}/30", link.host_addr);
            let ns_cidr = format!("{}/30", link.ns_addr);
            for args in [
                vec![
                    "link",
                    "add",
                    &link.host_if,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &peer,
                    "netns",
                    &link.ns,
                ],
                vec!["addr", "add", &host_cidr, "dev", &link.host_if],
                vec!["link", "set", &link.host_if, "up"],
                vec!["-n", &link.ns, "addr", "add", &ns_cidr, "dev", &peer],
                vec!["-n", &link.ns, "link", "set", &peer, "up"],
                vec!["-n", &link.ns, "link", "set", "lo", "up"],
            ] {
                run(&lab.ip, &args)?;
            }
        }
        let table = format!("fgchaos_{pid}");
        run(&lab.nft, &["add", "table", "inet", &table])?;
        lab.table = Some(table.clone());
        for (chain, hook) in [("input", "input"), ("output", "output")] {
            let spec = format!("{{ type filter hook {hook} priority -10; policy accept; }}");
            run(&lab.nft, &["add", "chain", "inet", &table, chain, &spec])?;
        }
        Ok(lab)
    }

    /// The command prefix that runs a program inside link `n`'s namespace.
    pub fn exec_prefix(&self, n: usize) -> Vec<String> {
        vec![
            self.ip.display().to_string(),
            "netns".into(),
            "exec".into(),
            self.links[n].ns.clone(),
        ]
    }

    /// Readiness of the path namespace -> host: a Redis PING from inside each namespace to
    /// `port` on the host end's address, bounded.
    pub async fn probe(&self, port: u16) -> Result<(), String> {
        let cli = tool("redis-cli").ok_or("`redis-cli` not found (needed to probe the veth)")?;
        for (n, link) in self.links.iter().enumerate() {
            let mut cmd = self.exec_prefix(n);
            cmd.extend([
                cli.display().to_string(),
                "-h".into(),
                link.host_addr.to_string(),
                "-p".into(),
                port.to_string(),
                "ping".into(),
            ]);
            let out = tokio::process::Command::new(&cmd[0])
                .args(&cmd[1..])
                .stdin(Stdio::null())
                .kill_on_drop(true)
                .output();
            let answer = tokio::time::timeout(Duration::from_secs(5), out)
                .await
                .map_err(|_| format!("no answer from Redis through {}", link.host_if))?
                .map_err(|e| format!("cannot run ip netns exec: {e}"))?;
            if !String::from_utf8_lossy(&answer.stdout).contains("PONG") {
                return Err(format!(
                    "Redis at {}:{port} unreachable from {}: {}{}",
                    link.host_addr,
                    link.ns,
                    String::from_utf8_lossy(&answer.stdout).trim(),
                    String::from_utf8_lossy(&answer.stderr).trim()
                ));
            }
        }
        Ok(())
    }

    /// Cuts link `n` off the TCP port `port` of the host, both ways: what the namespace sends
    /// to it and what it answers are dropped (silently: no reset, as a real partition).
    pub async fn partition(&self, n: usize, port: u16) -> Result<(), String> {
        self.drop_packets(n, port, None).await
    }

    /// Makes link `n` to the TCP port `port` of the host lossy, both ways: each packet is
    /// dropped with probability `percent` in 100 (nftables' `numgen random`; this kernel has
    /// no netem).
    pub async fn lossy(&self, n: usize, port: u16, percent: u8) -> Result<(), String> {
        self.drop_packets(n, port, Some(percent)).await
    }

    /// Drop rules for link `n` and `port`, both ways: every packet, or `percent` in 100.
    async fn drop_packets(&self, n: usize, port: u16, percent: Option<u8>) -> Result<(), String> {
        let table = self.table.as_deref().ok_or("no table")?;
        let link = &self.links[n];
        let port = port.to_string();
        let percent = percent.map(|p| p.to_string());
        let sample: Vec<&str> = match &percent {
            Some(p) => vec!["numgen", "random", "mod", "100", "<", p],
            None => Vec::new(),
        };
        let inbound = [
            "add",
            "rule",
            "inet",
            table,
            "input",
            "iifname",
            &link.host_if,
            "tcp",
            "dport",
            &port,
        ];
        let outbound = [
            "add",
            "rule",
            "inet",
            table,
            "output",
            "oifname",
            &link.host_if,
            "tcp",
            "sport",
            &port,
        ];
        for rule in [&inbound[..], &outbound[..]] {
            let rule: Vec<&str> = rule
                .iter()
                .copied()
                .chain(sample.iter().copied())
                .chain(["drop"])
                .collect();
            run_async(&self.nft, &rule).await?;
        }
        Ok(())
    }

    /// Ends every partition (one fault at a time: the table's rules are all the partition's).
    pub async fn heal(&self) -> Result<(), String> {
        let table = self.table.as_deref().ok_or("no table")?;
        for chain in ["input", "output"] {
            run_async(&self.nft, &["flush", "chain", "inet", table, chain]).await?;
        }
        Ok(())
    }

    /// Removes the namespaces, veth pairs and table of runs that are no longer running.
    fn remove_stale(&self) {
        if let Ok(tables) = run(&self.nft, &["list", "tables"]) {
            for line in tables.lines() {
                let Some(name) = line.trim().strip_prefix("table inet ") else {
                    continue;
                };
                if owner(name, "fgchaos_", None).is_some_and(|p| !live_run(p)) {
                    println!("  removing nftables table inet {name} left by an earlier run");
                    let _ = run(&self.nft, &["delete", "table", "inet", name]);
                }
            }
        }
        if let Ok(links) = run(&self.ip, &["-o", "link", "show"]) {
            for line in links.lines() {
                // `7: fgc123h0@if2: <...`
                let Some(name) = line.split(": ").nth(1).and_then(|n| n.split('@').next()) else {
                    continue;
                };
                if owner(name, "fgc", Some('h')).is_some_and(|p| !live_run(p)) {
                    println!("  removing veth {name} left by an earlier run");
                    let _ = run(&self.ip, &["link", "del", name]);
                }
            }
        }
        if let Ok(spaces) = run(&self.ip, &["netns", "list"]) {
            for line in spaces.lines() {
                // `fgchaos-123-0 (id: 4)`
                let name = line.split_whitespace().next().unwrap_or_default();
                if owner(name, "fgchaos-", Some('-')).is_some_and(|p| !live_run(p)) {
                    println!("  removing network namespace {name} left by an earlier run");
                    let _ = run(&self.ip, &["netns", "del", name]);
                }
            }
        }
    }

    fn cleanup(&mut self) {
        if let Some(table) = self.table.take() {
            if let Err(e) = run(&self.nft, &["delete", "table", "inet", &table]) {
                eprintln!("cleanup: {e}");
            }
        }
        for link in self.links.drain(..) {
            // Deleting the host end deletes the pair, even if a process still keeps the
            // namespace alive; then the namespace's name goes.
            let _ = run(&self.ip, &["link", "del", &link.host_if]);
            if let Err(e) = run(&self.ip, &["netns", "del", &link.ns]) {
                eprintln!("cleanup: {e}");
            }
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.cleanup();
    }
}
