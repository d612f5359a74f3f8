//! PostgreSQL over TLS (hostssl, SCRAM): the store and the lease backend.

use super::*;

fn postgres_bin(name: &str) -> PathBuf {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL server binaries under /usr/lib/postgresql")
        .map(|e| e.unwrap().path())
        .collect();
    versions.sort();
    versions.last().unwrap().join("bin").join(name)
}

/// The superuser's password in the throwaway servers.
const PG_ADMIN_PASSWORD: &str = "admin-pw";

/// A throwaway PostgreSQL that takes TLS connections only (`hostssl`, SCRAM passwords), with
/// a role `fencegate` owning the database `fences`; or, `tls: false`, plaintext only.
struct TlsPostgres {
    port: u16,
    dir: tempfile::TempDir,
    _child: Child,
}

impl TlsPostgres {
    async fn start(pki: &Pki, password: &str, tls: bool) -> TlsPostgres {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let pwfile = write(dir.path(), "pwfile", PG_ADMIN_PASSWORD);
        run(Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(dir.path()))
        .await;
        run(Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(postgres_bin("initdb"))
            .args(["-A", "scram-sha-256", "-U", "postgres", "--no-sync"])
            .arg(format!("--pwfile={}", pwfile.display()))
            .arg("-D")
            .arg(&data))
        .await;
        // The role and its database, in single-user mode: no connection needed yet.
        let mut single = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(postgres_bin("postgres"))
            .args(["--single", "-D"])
            .arg(&data)
            .arg("postgres")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        single
            .stdin
            .take()
            .unwrap()
            .write_all(
                format!(
                    "CREATE ROLE fencegate LOGIN PASSWORD '{password}'\n\
                     CREATE DATABASE fences OWNER fencegate\n"
                )
                .as_bytes(),
            )
            .await
            .unwrap();
        assert!(single.wait().await.unwrap().success());
        let hba = if tls {
            for (from, to) in [
                (&pki.server_cert, "server.crt"),
                (&pki.server_key, "server.key"),
                (&pki.ca, "root.crt"),
            ] {
                std::fs::copy(from, data.join(to)).unwrap();
            }
            run(Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&data))
            .await;
            run(Command::new("chmod")
                .arg("600")
                .arg(data.join("server.key")))
            .await;
            // The documented line, and no other: TLS or nothing.
            "hostssl all all 127.0.0.1/32 scram-sha-256\n"
        } else {
            "host all all 127.0.0.1/32 scram-sha-256\n"
        };
        std::fs::write(data.join("pg_hba.conf"), hba).unwrap();
        for _ in 0..5 {
            let port = free_port();
            let mut child = Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(postgres_bin("postgres"))
                .arg("-D")
                .arg(&data)
                .args(["-p", &port.to_string()])
                .args(["-c", "listen_addresses=127.0.0.1"])
                .args(["-c", "unix_socket_directories="])
                .args(["-c", &format!("ssl={}", if tls { "on" } else { "off" })])
                .args([
                    "-c",
                    "ssl_cert_file=server.crt",
                    "-c",
                    "ssl_key_file=server.key",
                ])
                .args(["-c", "ssl_ca_file=root.crt"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .unwrap();
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let ready = Command::new(postgres_bin("pg_isready"))
                    .args(["-q", "-h", "127.0.0.1", "-p", &port.to_string()])
                    .status()
                    .await
                    .unwrap();
                if ready.success() {
                    return TlsPostgres {
                        port,
                        dir,
                        _child: child,
                    };
                }
                if matches!(child.try_wait(), Ok(Some(_))) {
                    break;
                }
                assert!(Instant::now() < deadline, "postgres never became ready");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        panic!("postgres exited at start five times");
    }

    /// The url fencegate is given, with its password as written (`${PG_PASSWORD}`, say).
    fn url(&self, password: &str) -> String {
        format!(
            "postgres://fencegate:{password}@127.0.0.1:{}/fences",
            self.port
        )
    }

    /// One statement as the superuser, over TLS with the server's certificate verified;
    /// its output (tuples only).
    async fn admin(&self, pki: &Pki, sql: &str) -> String {
        let out = Command::new(postgres_bin("psql"))
            .arg(format!(
                "host=127.0.0.1 port={} user=postgres dbname=fences sslmode=verify-full sslrootcert={}",
                self.port,
                pki.ca.display()
            ))
            .args(["-tAc", sql])
            .env("PGPASSWORD", PG_ADMIN_PASSWORD)
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }
}

impl Drop for TlsPostgres {
    fn drop(&mut self) {
        // runuser forwards nothing on SIGKILL: kill the postmaster itself.
        if let Ok(pid) = std::fs::read_to_string(self.dir.path().join("data/postmaster.pid")) {
            if let Some(pid) = pid.lines().next() {
                let _ = std::process::Command::new("kill")
                    .args(["-9", pid.trim()])
                    .status();
            }
        }
    }
}

async fn run(cmd: &mut Command) {
    let status = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await
        .unwrap();
    assert!(status.success(), "{cmd:?}");
}

fn postgres_store(url: &str, prefix: &str, tls: &str) -> String {
    format!("store: {{ kind: postgres, url: '{url}', prefix: {prefix}, tls: {{ {tls} }} }}\n")
}

/// Two replicas share a PostgreSQL that takes only TLS (hostssl + SCRAM), the password from
/// the environment (`${PG_PASSWORD}` in the config file): a token admitted by one fences the
/// other, both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_over_tls_fences_across_two_replicas_with_the_password_from_the_environment() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let pg = TlsPostgres::start(&pki, "pg-s3cret", true).await;
    let up = Upstream::start().await;
    let url = pg.url("${PG_PASSWORD}");
    let env = [("PG_PASSWORD", "pg-s3cret")];
    let a = Process::start_with_env(
        &fence_config(
            pki.dir.path(),
            "a.yaml",
            &up,
            &postgres_store(&url, &prefix, &format!("ca: {}", pki.ca.display())),
        ),
        &env,
    )
    .await;
    // The other with a client certificate (the server asks; hostssl lets it be optional) and
    // the certificate's DNS name checked instead of the IP.
    let b = Process::start_with_env(
        &fence_config(
            pki.dir.path(),
            "b.yaml",
            &up,
            &postgres_store(
                &format!("{url}?sslmode=verify-full"),
                &prefix,
                &format!(
                    "{}, server_name: localhost",
                    tls_files(&pki.ca, &pki.client_cert, &pki.client_key)
                ),
            ),
        ),
        &env,
    )
    .await;
    wait_ready(a.admin, 200).await;
    wait_ready(b.admin, 200).await;

    assert_eq!(put_to(a.proxy, "1", "6").await.status, 200);
    let refused = put_to(b.proxy, "1", "5").await;
    refused.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(refused.headers["fencing-token-current"], "6");
    assert_eq!(put_to(b.proxy, "1", "7").await.status, 200);
    let refused = put_to(a.proxy, "1", "6").await;
    refused.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(refused.headers["fencing-token-current"], "7");
    let tokens: Vec<_> = up.seen().iter().map(|s| s.token()).collect();
    assert_eq!(tokens, [Some(6), Some(7)]);
    assert_eq!(
        pg.admin(
            &pki,
            &format!("SELECT max_token FROM {prefix}_fences WHERE resource = 'account:1'")
        )
        .await,
        "7"
    );
    // Every connection fencegate holds is TLS, as the fencegate role.
    assert_eq!(
        pg.admin(
            &pki,
            "SELECT count(*) FILTER (WHERE NOT ssl), count(*) > 0 FROM pg_stat_ssl \
             JOIN pg_stat_activity USING (pid) WHERE usename = 'fencegate'"
        )
        .await,
        "0|t"
    );
}

/// `tls` never falls back to plaintext: a server without TLS is unavailable, not used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tls_never_falls_back_to_plaintext() {
    let pki = Pki::new();
    let pg = TlsPostgres::start(&pki, "pg-s3cret", false).await;
    let up = Upstream::start().await;
    let mut p = Logged::start(&fence_config(
        pki.dir.path(),
        "f.yaml",
        &up,
        &postgres_store(
            &pg.url("pg-s3cret"),
            &fresh_prefix(),
            &format!("ca: {}", pki.ca.display()),
        ),
    ))
    .await;
    wait_ready(p.process.admin, 503).await;
    refused_unavailable(&p.process, "1").await;
    assert_eq!(up.count(), 0);
    let down = p.wait("fence store unavailable").await;
    let error = down["error"].as_str().unwrap();
    assert!(error.contains("TLS"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lease_is_acquired_and_renewed_over_tls() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let pg = TlsPostgres::start(&pki, "pg-s3cret", true).await;
    let config = write(
        pki.dir.path(),
        "leases.yaml",
        &format!(
            "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://127.0.0.1:9\nstore: {{ kind: memory }}\n\
             leases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: postgres, url: '{}', prefix: {prefix}, tls: {{ ca: {} }} }}\n  ttl: 1s\n",
            pg.url("pg-s3cret"),
            pki.ca.display()
        ),
    );
    let p = Process::start(&config).await;
    assert_eq!(lease_acquired_renewed_released(&p).await, 1);
    assert_eq!(
        pg.admin(
            &pki,
            &format!("SELECT fencing_token FROM {prefix}_leases WHERE resource_id = 'job:1'")
        )
        .await,
        "1"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_with_a_wrong_ca_fails_closed_and_recovers_when_the_ca_file_is_replaced() {
    let pki = Pki::new();
    let pg = TlsPostgres::start(&pki, "pg-s3cret", true).await;
    let up = Upstream::start().await;
    let ca = pki.copy(&pki.other_ca, "fencegate-ca.pem");
    let mut p = Logged::start(&fence_config(
        pki.dir.path(),
        "f.yaml",
        &up,
        &postgres_store(
            &pg.url("pg-s3cret"),
            &fresh_prefix(),
            &format!("ca: {}", ca.display()),
        ),
    ))
    .await;
    fails_closed_then_recovers(
        &mut p,
        &up,
        "invalid peer certificate: UnknownIssuer",
        async || replace(&ca, &pki.ca),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_with_a_wrong_password_fails_closed_and_recovers_when_the_server_accepts_it() {
    let pki = Pki::new();
    let pg = TlsPostgres::start(&pki, "pg-s3cret", true).await;
    let up = Upstream::start().await;
    let mut p = Logged::start(&fence_config(
        pki.dir.path(),
        "f.yaml",
        &up,
        &postgres_store(
            &pg.url("rotated"),
            &fresh_prefix(),
            &format!("ca: {}", pki.ca.display()),
        ),
    ))
    .await;
    fails_closed_then_recovers(
        &mut p,
        &up,
        "password authentication failed for user \"fencegate\"",
        async || {
            pg.admin(&pki, "ALTER ROLE fencegate PASSWORD 'rotated'")
                .await;
        },
    )
    .await;
}
