//! etcd over TLS with client certificates and user/password auth: the store and the lease backend.

use super::*;
use crate::common::rid;

/// A throwaway etcd serving clients on https only: with `client_certs`, it requires a
/// certificate signed by the test CA (`--client-cert-auth`); with `auth`, a user `fencegate`
/// with that password and a role limited to `/<prefix>/` (the documented commands), and
/// authentication enabled.
struct TlsEtcd {
    port: u16,
    client_certs: bool,
    /// Authentication is on: root's password is needed.
    auth: bool,
    child: Option<Child>,
    dir: tempfile::TempDir,
    peer: u16,
    /// More etcd arguments.
    args: Vec<String>,
}

const ETCD_ROOT_PASSWORD: &str = "root-pw";

impl TlsEtcd {
    async fn start(pki: &Pki, client_certs: bool, auth: Option<(&str, &str)>) -> TlsEtcd {
        Self::start_with(pki, client_certs, auth, Vec::new()).await
    }

    /// [`TlsEtcd::start`] with JWT tokens (ES256, a key made here) instead of simple ones.
    async fn start_jwt(pki: &Pki, auth: (&str, &str)) -> TlsEtcd {
        let key = rcgen::KeyPair::generate().unwrap();
        let private = write(pki.dir.path(), "jwt.key", &key.serialize_pem());
        let public = write(pki.dir.path(), "jwt.pub", &key.public_key_pem());
        let token = format!(
            "jwt,pub-key={},priv-key={},sign-method=ES256,ttl=10m",
            public.display(),
            private.display()
        );
        Self::start_with(pki, false, Some(auth), vec!["--auth-token".into(), token]).await
    }

    async fn start_with(
        pki: &Pki,
        client_certs: bool,
        auth: Option<(&str, &str)>,
        args: Vec<String>,
    ) -> TlsEtcd {
        let mut etcd = TlsEtcd {
            port: 0,
            client_certs,
            auth: false,
            child: None,
            dir: tempfile::tempdir().unwrap(),
            peer: 0,
            args,
        };
        for _ in 0..5 {
            etcd.port = free_port();
            etcd.peer = free_port();
            let _ = std::fs::remove_dir_all(etcd.dir.path().join("data"));
            if etcd.spawn(pki).await {
                if let Some((prefix, password)) = auth {
                    etcd.enable_auth(pki, prefix, password).await;
                    etcd.auth = true;
                }
                return etcd;
            }
        }
        panic!("etcd exited at start five times");
    }

    /// Starts etcd on its ports and data directory; false if it exited before it was ready.
    async fn spawn(&mut self, pki: &Pki) -> bool {
        let client = format!("https://127.0.0.1:{}", self.port);
        let peer = format!("http://127.0.0.1:{}", self.peer);
        let mut cmd = Command::new("etcd");
        cmd.arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("default={peer}")])
            .args(["--log-level", "error"])
            .arg("--cert-file")
            .arg(&pki.server_cert)
            .arg("--key-file")
            .arg(&pki.server_key)
            .args(&self.args);
        if self.client_certs {
            cmd.arg("--client-cert-auth")
                .arg("--trusted-ca-file")
                .arg(&pki.ca);
        }
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("etcd");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let root = self.auth.then_some(("root", ETCD_ROOT_PASSWORD));
            if self
                .etcdctl(pki, root, &["endpoint", "health"])
                .await
                .is_ok()
            {
                self.child = Some(child);
                return true;
            }
            if matches!(child.try_wait(), Ok(Some(_))) {
                return false;
            }
            assert!(Instant::now() < deadline, "etcd never became healthy");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The documented commands: a role with read and write on the prefix, the user, root,
    /// and authentication on.
    async fn enable_auth(&self, pki: &Pki, prefix: &str, password: &str) {
        let root = Some(("root", ETCD_ROOT_PASSWORD));
        for args in [
            vec![
                "user",
                "add",
                "root",
                "--interactive=false",
                &format!("--new-user-password={ETCD_ROOT_PASSWORD}"),
            ],
            vec!["user", "grant-role", "root", "root"],
            vec!["role", "add", "fencegate"],
            vec![
                "role",
                "grant-permission",
                "fencegate",
                "--prefix=true",
                "readwrite",
                &format!("/{prefix}/"),
            ],
            vec![
                "user",
                "add",
                "fencegate",
                "--interactive=false",
                &format!("--new-user-password={password}"),
            ],
            vec!["user", "grant-role", "fencegate", "fencegate"],
            vec!["auth", "enable"],
        ] {
            self.etcdctl(pki, None, &args).await.unwrap();
        }
        // Root now needs its password.
        self.etcdctl(pki, root, &["user", "list"]).await.unwrap();
    }

    /// etcdctl over TLS (with the client certificate), as `user` if given; its output.
    async fn etcdctl(
        &self,
        pki: &Pki,
        user: Option<(&str, &str)>,
        args: &[&str],
    ) -> Result<String, String> {
        self.etcdctl_input(pki, user, args, "").await
    }

    /// [`TlsEtcd::etcdctl`] with `input` on its standard input.
    async fn etcdctl_input(
        &self,
        pki: &Pki,
        user: Option<(&str, &str)>,
        args: &[&str],
        input: &str,
    ) -> Result<String, String> {
        let mut cmd = Command::new("etcdctl");
        cmd.env("ETCDCTL_API", "3")
            .arg(format!("--endpoints=https://127.0.0.1:{}", self.port))
            .arg(format!("--cacert={}", pki.ca.display()))
            .arg(format!("--cert={}", pki.client_cert.display()))
            .arg(format!("--key={}", pki.client_key.display()))
            .arg("--command-timeout=5s");
        if let Some((name, password)) = user {
            cmd.arg(format!("--user={name}:{password}"));
        }
        let mut child = cmd
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("etcdctl");
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(input.as_bytes()).await.unwrap();
        drop(stdin);
        let out = child.wait_with_output().await.unwrap();
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    fn url(&self, user: Option<&str>) -> String {
        match user {
            Some(password) => format!("https://fencegate:{password}@127.0.0.1:{}", self.port),
            None => format!("https://127.0.0.1:{}", self.port),
        }
    }

    async fn restart(&mut self, pki: &Pki) {
        let mut child = self.child.take().unwrap();
        child.start_kill().unwrap();
        child.wait().await.unwrap();
        assert!(self.spawn(pki).await, "etcd exited at restart");
    }
}

fn etcd_store(url: &str, prefix: &str, tls: &str) -> String {
    format!("store: {{ kind: etcd, url: '{url}', prefix: {prefix}, tls: {{ {tls} }} }}\n")
}

/// Two replicas share an etcd that takes only TLS clients with certificates from its CA: a
/// token admitted by one fences the other, both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_over_tls_with_client_certificates_fences_across_two_replicas() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let etcd = TlsEtcd::start(&pki, true, None).await;
    let up = Upstream::start().await;
    let files = tls_files(&pki.ca, &pki.client_cert, &pki.client_key);
    etcd_two_replicas(
        &pki,
        &up,
        &etcd_store(&etcd.url(None), &prefix, &files),
        &etcd_store(
            &etcd.url(None),
            &prefix,
            &format!("{files}, server_name: localhost"),
        ),
    )
    .await;
    let value = etcd
        .etcdctl(
            &pki,
            None,
            &[
                "get",
                "--print-value-only",
                &format!("/{prefix}/fences/account:1"),
            ],
        )
        .await
        .unwrap();
    assert_eq!(value.trim_start_matches('0'), "7");
}

/// The first https endpoint takes TCP connections but never answers the TLS handshake (a
/// listening socket nobody accepts on): each connection moves on to the second, real one
/// within the connect timeout, so fenced writes go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_over_tls_moves_past_an_endpoint_that_never_answers() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let etcd = TlsEtcd::start(&pki, true, None).await;
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!(
        "https://{},127.0.0.1:{}",
        silent.local_addr().unwrap(),
        etcd.port
    );
    let up = Upstream::start().await;
    let files = tls_files(&pki.ca, &pki.client_cert, &pki.client_key);
    let store = etcd_store(&url, &prefix, &files);
    etcd_two_replicas(&pki, &up, &store, &store).await;
}

async fn etcd_two_replicas(pki: &Pki, up: &Upstream, a: &str, b: &str) {
    let a = Process::start(&fence_config(pki.dir.path(), "a.yaml", up, a)).await;
    let b = Process::start(&fence_config(pki.dir.path(), "b.yaml", up, b)).await;
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
}

/// Two replicas share an etcd with authentication on, as a user whose role reaches only the
/// prefix's keys (the password from the environment); that user cannot read another prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_with_auth_fences_across_two_replicas_as_a_user_limited_to_its_prefix() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let etcd = TlsEtcd::start(&pki, false, Some((&prefix, "etcd-s3cret"))).await;
    let up = Upstream::start().await;
    let ca = format!("ca: {}", pki.ca.display());
    let store = etcd_store(&etcd.url(Some("etcd-s3cret")), &prefix, &ca);
    etcd_two_replicas(&pki, &up, &store, &store).await;
    let user = Some(("fencegate", "etcd-s3cret"));
    let mine = etcd
        .etcdctl(
            &pki,
            user,
            &[
                "get",
                "--print-value-only",
                &format!("/{prefix}/fences/account:1"),
            ],
        )
        .await
        .unwrap();
    assert_eq!(mine.trim_start_matches('0'), "7");
    let other = etcd
        .etcdctl(&pki, user, &["get", "/other/fences/account:1"])
        .await
        .unwrap_err();
    assert!(other.contains("permission denied"), "{other}");
}

/// A lease from an etcd backend over TLS, as the limited user: acquired, renewed, refused to
/// another holder, released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_lease_is_acquired_and_renewed_over_tls_as_a_limited_user() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let etcd = TlsEtcd::start(&pki, false, Some((&prefix, "etcd-s3cret"))).await;
    let config = write(
        pki.dir.path(),
        "leases.yaml",
        &format!(
            "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://127.0.0.1:9\nstore: {{ kind: memory }}\n\
             leases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: etcd, url: '{}', prefix: {prefix}, tls: {{ ca: {} }} }}\n  ttl: 3s\n",
            etcd.url(Some("etcd-s3cret")),
            pki.ca.display()
        ),
    );
    let p = Process::start(&config).await;
    // etcd's tokens are revisions.
    let token = lease_acquired_renewed_released(&p).await;
    assert!(token > 1, "{token}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_with_a_wrong_ca_fails_closed_and_recovers_when_the_ca_file_is_replaced() {
    let pki = Pki::new();
    let etcd = TlsEtcd::start(&pki, true, None).await;
    let up = Upstream::start().await;
    let ca = pki.copy(&pki.other_ca, "fencegate-ca.pem");
    let mut p = Logged::start(&fence_config(
        pki.dir.path(),
        "f.yaml",
        &up,
        &etcd_store(
            &etcd.url(None),
            &fresh_prefix(),
            &tls_files(&ca, &pki.client_cert, &pki.client_key),
        ),
    ))
    .await;
    fails_closed_then_recovers(&mut p, &up, "UnknownIssuer", async || replace(&ca, &pki.ca)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_with_a_wrong_password_fails_closed_and_recovers_when_the_server_accepts_it() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let etcd = TlsEtcd::start(&pki, false, Some((&prefix, "etcd-s3cret"))).await;
    let up = Upstream::start().await;
    let mut p = Logged::start(&fence_config(
        pki.dir.path(),
        "f.yaml",
        &up,
        &etcd_store(
            &etcd.url(Some("rotated")),
            &prefix,
            &format!("ca: {}", pki.ca.display()),
        ),
    ))
    .await;
    fails_closed_then_recovers(&mut p, &up, "invalid user ID or password", async || {
        etcd.etcdctl_input(
            &pki,
            Some(("root", ETCD_ROOT_PASSWORD)),
            &["user", "passwd", "fencegate", "--interactive=false"],
            "rotated\n",
        )
        .await
        .unwrap();
    })
    .await;
}

/// With a wrong password, concurrent calls do not each authenticate: one failed
/// `Authenticate` answers the calls that come within a second (counted by etcd's own
/// metrics).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_wrong_password_is_not_tried_again_by_every_call() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let metrics = free_port();
    let etcd = TlsEtcd::start_with(
        &pki,
        false,
        Some((&prefix, "etcd-s3cret")),
        vec![
            "--listen-metrics-urls".into(),
            format!("http://127.0.0.1:{metrics}"),
        ],
    )
    .await;
    let config = fencegate::config::Config::parse(&format!(
        "upstream: http://127.0.0.1:1\n{}",
        etcd_store(
            &etcd.url(Some("wrong")),
            &prefix,
            &format!("ca: {}", pki.ca.display())
        )
    ))
    .unwrap();
    fencegate::tls::install_default_provider();
    let store = fencegate::store::open(&config.store).await.unwrap();
    let authenticates = async || {
        let text = send(
            "GET",
            &format!("http://127.0.0.1:{metrics}/metrics"),
            &[],
            "",
        )
        .await
        .text();
        text.lines()
            .filter(|l| {
                l.starts_with("grpc_server_started_total")
                    && l.contains("grpc_method=\"Authenticate\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let before = authenticates().await;
    let calls: Vec<_> = (0..50)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .compare_and_raise(
                        &rid(&format!("r{i}")),
                        1.into(),
                        fencegate::config::EqualTokens::Allow.into(),
                    )
                    .await
            })
        })
        .collect();
    for call in calls {
        let e = call.await.unwrap().unwrap_err().to_string();
        assert!(e.contains("invalid user ID or password"), "{e}");
    }
    // The calls, and the store's probe.
    let tried = authenticates().await - before;
    assert!(tried <= 3.0, "{tried} Authenticate calls for 50 writes");
}

/// With JWT tokens, every token issued before a change of users or roles is refused
/// (`revision of auth store is old`): fencegate authenticates again and sends the call once
/// more, so writes keep passing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_jwt_tokens_outdated_by_a_user_change_are_replaced_without_an_error() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let etcd = TlsEtcd::start_jwt(&pki, (&prefix, "etcd-s3cret")).await;
    let up = Upstream::start().await;
    let p = Process::start(&fence_config(
        pki.dir.path(),
        "f.yaml",
        &up,
        &etcd_store(
            &etcd.url(Some("etcd-s3cret")),
            &prefix,
            &format!("ca: {}", pki.ca.display()),
        ),
    ))
    .await;
    wait_ready(p.admin, 200).await;
    assert_eq!(put_to(p.proxy, "1", "1").await.status, 200);
    let root = Some(("root", ETCD_ROOT_PASSWORD));
    for (i, user) in ["other", "another"].into_iter().enumerate() {
        etcd.etcdctl(
            &pki,
            root,
            &[
                "user",
                "add",
                user,
                "--interactive=false",
                "--new-user-password=pw",
            ],
        )
        .await
        .unwrap();
        let token = (i + 2).to_string();
        let r = put_to(p.proxy, "1", &token).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(up.count(), 3);
}

/// etcd forgets its simple tokens when it restarts: the next call is refused with `invalid
/// auth token`, and fencegate authenticates again and sends the call once more, so no caller
/// ever sees that refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_tokens_refused_after_a_restart_are_replaced_without_an_error() {
    let pki = Pki::new();
    let prefix = fresh_prefix();
    let mut etcd = TlsEtcd::start(&pki, false, Some((&prefix, "etcd-s3cret"))).await;
    let config = fencegate::config::Config::parse(&format!(
        "upstream: http://127.0.0.1:1\n{}",
        etcd_store(
            &etcd.url(Some("etcd-s3cret")),
            &prefix,
            &format!("ca: {}", pki.ca.display())
        )
    ))
    .unwrap();
    fencegate::tls::install_default_provider();
    let store = fencegate::store::open(&config.store).await.unwrap();
    use fencegate::config::EqualTokens::Allow;
    assert!(store
        .compare_and_raise(&rid("r"), 1.into(), Allow.into())
        .await
        .is_ok());
    etcd.restart(&pki).await;
    // The channel may still hold the connection to the old process: transport errors until it
    // notices are expected; a refused token never is.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut errors = Vec::new();
    loop {
        match store
            .compare_and_raise(&rid("r"), 2.into(), Allow.into())
            .await
        {
            Ok(verdict) => {
                assert_eq!(
                    verdict,
                    fencegate::fence::verdict::Verdict::Admitted {
                        previous: Some(1.into())
                    }
                );
                break;
            }
            Err(e) => errors.push(e.to_string()),
        }
        assert!(Instant::now() < deadline, "{errors:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !errors.iter().any(|e| e.contains("auth")),
        "a refused token reached a caller: {errors:#?}"
    );
}
