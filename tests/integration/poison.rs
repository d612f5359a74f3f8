//! `token.max_step`, the ceiling on how far a token may exceed its resource's recorded maximum:
//! every store refuses a token too far above it in the same step that reads the maximum, and
//! changes nothing; the proxy answers `409 urn:fencegate:token-too-far`; a cache in front of a
//! shared store neither admits nor refuses a step on its own; authoritative fencing does not
//! apply it; and the "Poisoned tokens" runbook in docs/operations.md runs as written.

use crate::common::rid;
use crate::common::tk;
use fencegate::fence::Token;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use fencegate::config::{Config, EqualTokens};
use fencegate::idempotency::{AttemptId, Begin, Claim, Fingerprint};
use fencegate::store::{self, FenceStore, Rule, Verdict};

use crate::authority::{grant, hand_over};
use crate::common::*;
use crate::process::{check_file, put_to, Process};
use crate::services::{POSTGRES_URL, REDIS_URL};
use crate::stores::{open, store_yaml};

use EqualTokens::{Allow, Reject};

/// The step of the store-level tests.
const STEP: u64 = 1000;

/// The top of the token grammar, the usual poison.
const TOP: u64 = i64::MAX as u64;

fn ceiling(equal: EqualTokens) -> Rule {
    Rule {
        equal,
        max_step: Some(STEP),
    }
}

async fn raise(store: &dyn FenceStore, resource: &str, token: Token, rule: Rule) -> Verdict {
    store
        .compare_and_raise(&rid(resource), token, rule)
        .await
        .unwrap_or_else(|e| panic!("raise {resource} to {token}: {e}"))
}

/// A token too far above the maximum (or above the step, with none) is refused and changes
/// nothing; exactly the step above is admitted; stale stays stale.
async fn too_far_changes_nothing(store: Arc<dyn FenceStore>) {
    let (r, rule) = ("account:7", ceiling(Allow));
    assert_eq!(
        raise(&*store, r, tk(STEP + 1), rule).await,
        Verdict::TooFar { current: None }
    );
    assert_eq!(store.current(&rid(r)).await.unwrap(), None);
    assert_eq!(
        raise(&*store, r, tk(STEP), rule).await,
        Verdict::Admitted { previous: None }
    );
    assert_eq!(store.current(&rid(r)).await.unwrap(), Some(tk(STEP)));
    for token in [2 * STEP + 1, 10_000_000_000, TOP] {
        assert_eq!(
            raise(&*store, r, tk(token), rule).await,
            Verdict::TooFar {
                current: Some(tk(STEP))
            },
            "{token}"
        );
        assert_eq!(
            store.current(&rid(r)).await.unwrap(),
            Some(tk(STEP)),
            "{token}"
        );
    }
    assert_eq!(
        raise(&*store, r, tk(2 * STEP), rule).await,
        Verdict::Admitted {
            previous: Some(tk(STEP))
        }
    );
    assert_eq!(store.current(&rid(r)).await.unwrap(), Some(tk(2 * STEP)));
    assert_eq!(
        raise(&*store, r, tk(STEP), rule).await,
        Verdict::Stale {
            current: tk(2 * STEP)
        }
    );
    assert_eq!(
        raise(&*store, r, tk(2 * STEP), ceiling(Reject)).await,
        Verdict::Stale {
            current: tk(2 * STEP)
        }
    );
    assert_eq!(
        raise(&*store, r, tk(2 * STEP), rule).await,
        Verdict::Admitted {
            previous: Some(tk(2 * STEP))
        }
    );
    assert_eq!(store.current(&rid(r)).await.unwrap(), Some(tk(2 * STEP)));
    // Without a ceiling the same store takes the poison: the rule decides, not the store.
    assert_eq!(
        raise(&*store, "unguarded", tk(TOP), Allow.into()).await,
        Verdict::Admitted { previous: None }
    );
    assert_eq!(
        store.current(&rid("unguarded")).await.unwrap(),
        Some(tk(TOP))
    );
}

fn claim(token: Token) -> Claim {
    Claim {
        token,
        fingerprint: Fingerprint([1; 32]),
        rule: ceiling(Allow),
        window: Duration::from_secs(60),
        may_execute: true,
        attempt: AttemptId::next(),
    }
}

/// An idempotent claim raises the maximum too: too far, it claims nothing (no record, no
/// raise), and the same key claims later within the step.
async fn a_claim_too_far_claims_nothing(store: Arc<dyn FenceStore>) {
    let r = "account:8";
    let begin = |key: &'static str, token: Token| {
        let store = Arc::clone(&store);
        async move {
            store
                .begin_idempotent(&rid(r), key, &claim(token))
                .await
                .unwrap()
        }
    };
    assert_eq!(
        begin("k1", tk(STEP + 1)).await,
        Begin::TooFar { current: None }
    );
    assert_eq!(store.current(&rid(r)).await.unwrap(), None);
    assert_eq!(
        begin("k1", 5.into()).await,
        Begin::Execute { previous: None }
    );
    assert_eq!(store.current(&rid(r)).await.unwrap(), Some(5.into()));
    assert_eq!(
        begin("k2", tk(5 + STEP + 1)).await,
        Begin::TooFar {
            current: Some(5.into())
        }
    );
    assert_eq!(
        begin("k2", tk(TOP)).await,
        Begin::TooFar {
            current: Some(5.into())
        }
    );
    assert_eq!(store.current(&rid(r)).await.unwrap(), Some(5.into()));
    assert_eq!(
        begin("k2", tk(5 + STEP)).await,
        Begin::Execute {
            previous: Some(5.into())
        }
    );
    assert_eq!(store.current(&rid(r)).await.unwrap(), Some(tk(5 + STEP)));
}

macro_rules! every_store {
    ($($kind:ident),*) => {$(
        mod $kind {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn too_far_changes_nothing() {
                let (s, _g, _d) = open(stringify!($kind)).await;
                super::too_far_changes_nothing(s).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_claim_too_far_claims_nothing() {
                let (s, _g, _d) = open(stringify!($kind)).await;
                super::a_claim_too_far_claims_nothing(s).await
            }
        }
    )*};
}

every_store!(memory, embedded, redis, postgres, etcd);

/// Two fencegates on one shared store: `a`'s cache holds an old lower bound. A token too far
/// above that bound but within the step of the store's maximum is admitted (the cache does
/// not refuse a step), and a token too far above the store's maximum is refused with the
/// store's maximum, not the cached one (the cache does not decide a step either way).
async fn the_cache_leaves_the_step_to_the_store(kind: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (yaml, _service) = store_yaml(kind, &dir).await;
    let config = Config::parse(&format!("upstream: http://127.0.0.1:1\n{yaml}")).unwrap();
    let a = store::open(&config.store).await.unwrap();
    let b = store::open(&config.store).await.unwrap();
    let (r, rule) = ("account:9", ceiling(Allow));
    assert_eq!(
        raise(&*a, r, 10.into(), rule).await,
        Verdict::Admitted { previous: None }
    );
    assert_eq!(
        raise(&*b, r, 900.into(), rule).await,
        Verdict::Admitted {
            previous: Some(10.into())
        }
    );
    assert_eq!(
        raise(&*b, r, 1800.into(), rule).await,
        Verdict::Admitted {
            previous: Some(900.into())
        }
    );
    assert_eq!(
        raise(&*a, r, 2700.into(), rule).await,
        Verdict::Admitted {
            previous: Some(1800.into())
        }
    );
    assert_eq!(
        raise(&*b, r, 3500.into(), rule).await,
        Verdict::Admitted {
            previous: Some(2700.into())
        }
    );
    assert_eq!(
        raise(&*a, r, 4501.into(), rule).await,
        Verdict::TooFar {
            current: Some(3500.into())
        }
    );
    assert_eq!(a.current(&rid(r)).await.unwrap(), Some(3500.into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cache_leaves_the_step_to_the_store() {
    the_cache_leaves_the_step_to_the_store("redis").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_cache_leaves_the_step_to_the_store() {
    the_cache_leaves_the_step_to_the_store("postgres").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_cache_leaves_the_step_to_the_store() {
    the_cache_leaves_the_step_to_the_store("etcd").await
}

async fn metrics(server: &fencegate::app::Server) -> String {
    send("GET", &format!("http://{}/metrics", server.admin), &[], "")
        .await
        .text()
}

/// Through the proxy: the refusal's whole body and header, the upstream not called, the
/// maximum unchanged, a token within the step admitted, and the two counters.
#[tokio::test]
async fn the_proxy_refuses_a_poisoned_token_with_its_own_problem() {
    let up = Upstream::start().await;
    let server = fencegate(
        &up.url(),
        &format!("token: {{ max_step: 1000 }}\n{ACCOUNTS}"),
    )
    .await;
    assert_eq!(put(&server, "42", "17").await.status, 200);

    let poisoned = put(&server, "42", "9223372036854775807").await;
    poisoned.assert_problem(409, "urn:fencegate:token-too-far");
    assert_eq!(
        poisoned.text(),
        r#"{"type":"urn:fencegate:token-too-far","title":"Fencing token too far above the recorded maximum","status":409,"detail":"token 9223372036854775807 exceeds 17, the highest token recorded for account:42, by more than token.max_step (1000); it was not forwarded and the recorded maximum is unchanged","resource":"account:42","token":9223372036854775807,"current_token":17,"max_step":1000}"#
    );
    assert_eq!(poisoned.headers["fencing-token-current"], "17");
    assert_eq!(up.count(), 1);
    assert_eq!(recorded(&server, "account:42").await, Some(17));

    // One above the step, refused; the step itself, admitted.
    put(&server, "42", "1018")
        .await
        .assert_problem(409, "urn:fencegate:token-too-far");
    assert_eq!(put(&server, "42", "1017").await.status, 200);
    assert_eq!(recorded(&server, "account:42").await, Some(1017));
    assert_eq!(up.count(), 2);

    // A resource with no maximum: the step counts from 0.
    let first = put(&server, "43", "1001").await;
    assert_eq!(
        first.text(),
        r#"{"type":"urn:fencegate:token-too-far","title":"Fencing token too far above the recorded maximum","status":409,"detail":"no token is recorded for account:43, and a first token may be at most token.max_step (1000); token 1001 was not forwarded and nothing was recorded","resource":"account:43","token":1001,"max_step":1000}"#
    );
    assert!(first.headers.get("fencing-token-current").is_none());
    assert_eq!(recorded(&server, "account:43").await, None);
    assert_eq!(put(&server, "43", "1000").await.status, 200);

    let text = metrics(&server).await;
    for line in [
        r#"fencegate_token_too_far_rejected_total{route="accounts"} 3"#,
        r#"fencegate_requests_total{code="409",method="PUT",outcome="too_far",route="accounts"} 3"#,
        r#"fencegate_requests_total{code="200",method="PUT",outcome="admitted",route="accounts"} 3"#,
        r#"fencegate_stale_write_rejected_total{route="accounts"} 0"#,
    ] {
        assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
    }
    assert_eq!(up.count(), 3);
}

/// The default step, 2^40, and `off`, which lets one absurd token lock the resource.
#[tokio::test]
async fn the_default_step_and_off() {
    let up = Upstream::start().await;
    let server = fencegate(&up.url(), ACCOUNTS).await;
    assert_eq!(put(&server, "1", "1").await.status, 200);
    let body = put(&server, "1", "9223372036854775807")
        .await
        .assert_problem(409, "urn:fencegate:token-too-far");
    assert_eq!(body["max_step"], 1_099_511_627_776u64, "{body}");
    assert_eq!(body["current_token"], 1, "{body}");
    put(&server, "1", "1099511627778")
        .await
        .assert_problem(409, "urn:fencegate:token-too-far");
    assert_eq!(put(&server, "1", "1099511627777").await.status, 200);
    assert_eq!(
        recorded(&server, "account:1").await,
        Some(1_099_511_627_777)
    );

    let off = fencegate(
        &up.url(),
        &format!("token: {{ max_step: off }}\n{ACCOUNTS}"),
    )
    .await;
    assert_eq!(put(&off, "1", "1").await.status, 200);
    assert_eq!(put(&off, "1", "9223372036854775807").await.status, 200);
    let locked = put(&off, "1", "2")
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(locked["current_token"], TOP, "{locked}");
}

/// An idempotent write raises the maximum as well, and is held to the same step.
#[tokio::test]
async fn an_idempotent_write_too_far_is_refused() {
    let up = Upstream::start().await;
    let server = fencegate(
        &up.url(),
        &format!("token: {{ max_step: 1000 }}\nidempotency: {{ window: 1m }}\n{ACCOUNTS}"),
    )
    .await;
    let keyed = |token: &'static str, key: &'static str| {
        let url = format!("http://{}/accounts/42", server.listen);
        async move {
            send(
                "PUT",
                &url,
                &[("fencing-token", token), ("idempotency-key", key)],
                "w",
            )
            .await
        }
    };
    assert_eq!(keyed("7", "a").await.status, 200);
    let body = keyed("1008", "b")
        .await
        .assert_problem(409, "urn:fencegate:token-too-far");
    assert_eq!(body["current_token"], 7, "{body}");
    assert_eq!(recorded(&server, "account:42").await, Some(7));
    // Refused, the key recorded nothing: within the step it executes.
    assert_eq!(keyed("1007", "b").await.status, 200);
    assert_eq!(recorded(&server, "account:42").await, Some(1007));
    assert_eq!(up.count(), 2);
    let text = metrics(&server).await;
    let line = r#"fencegate_token_too_far_rejected_total{route="accounts"} 1"#;
    assert!(text.lines().any(|l| l == line), "{text}");
}

/// With `fence.authority: leases`, a token above the latest grant is refused as unissued
/// before the store is asked, so no ceiling applies: a grant far above the recorded maximum
/// (here more than `max_step: 1` above it) is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authoritative_fencing_applies_no_ceiling() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        "store: {{ kind: memory }}\nfence: {{ authority: leases }}\ntoken: {{ max_step: 1 }}\nleases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: embedded, path: {} }}\n  ttl: 5s\n{ACCOUNTS}",
        dir.path().join("leases.db").display()
    );
    let fg = fencegate(&up.url(), &yaml).await;
    let t1 = grant(&fg, "worker-1").await;
    assert_eq!(put(&fg, "42", &t1.to_string()).await.status, 200);
    hand_over(&fg, "worker-2").await;
    let t3 = hand_over(&fg, "worker-3").await;
    assert!(t3 > t1 + 1, "{t1} then {t3}");
    assert_eq!(put(&fg, "42", &t3.to_string()).await.status, 200);
    assert_eq!(recorded(&fg, "account:42").await, Some(t3));
    let body = put(&fg, "42", "9223372036854775807")
        .await
        .assert_problem(409, "urn:fencegate:unissued-token");
    assert_eq!(body["current_token"], t3, "{body}");
}

/// The code blocks of the `## Poisoned tokens` section of docs/operations.md, by language,
/// in order.
fn runbook_blocks() -> Vec<(String, String)> {
    let docs =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operations.md"))
            .unwrap();
    let start = docs
        .find("\n## Poisoned tokens\n")
        .expect("docs/operations.md has a Poisoned tokens section");
    let section = &docs[start + 1..];
    let section = &section[..section[1..].find("\n## ").map_or(section.len(), |i| i + 1)];
    let mut blocks = Vec::new();
    let mut rest = section;
    while let Some(open) = rest.find("```") {
        let after = &rest[open + 3..];
        let (lang, body) = after.split_once('\n').unwrap();
        let close = body.find("```").expect("an unclosed block");
        blocks.push((lang.to_owned(), body[..close].to_owned()));
        rest = &body[close + 3..];
    }
    blocks
}

/// Runs one shell line as written (but for the admin address, `127.0.0.1:7441` in the docs);
/// its standard output.
fn shell(line: &str, admin: std::net::SocketAddr) -> String {
    let line = line.replace("127.0.0.1:7441", &admin.to_string());
    let out = std::process::Command::new("sh")
        .args(["-c", &line])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{line}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The commands of a `sh` block: its lines but comments and blank ones.
fn commands(block: &str) -> Vec<&str> {
    block
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect()
}

/// The runbook as written: its config passes `check`; a poisoned write is refused and the
/// commands that spot it print what the docs say; a resource poisoned before the ceiling
/// (here written straight into the store, as a run with `max_step: off` would have left it)
/// is repaired by the store-level commands, for Redis and PostgreSQL alike, and after a
/// restart writes pass again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_poisoned_tokens_runbook_runs_as_written() {
    let blocks = runbook_blocks();
    let langs: Vec<&str> = blocks.iter().map(|(l, _)| l.as_str()).collect();
    assert_eq!(langs, ["yaml", "sh", "sh"], "the runbook's code blocks");
    let (config, spot, repair) = (&blocks[0].1, &blocks[1].1, &blocks[2].1);

    // The config, as written, through `fencegate check`.
    let dir = tempfile::tempdir().unwrap();
    let written = dir.path().join("fencegate.yaml");
    std::fs::write(&written, config).unwrap();
    let (code, printed, stderr) = check_file(&written);
    assert_eq!((code, stderr.as_str()), (Some(0), ""), "{printed}");
    assert!(
        printed.contains(
            "# token.max_step: a token more than 1099511627776 above the recorded maximum (or \
             above 1099511627776 for a resource with none) is refused\n"
        ),
        "{printed}"
    );
    assert!(printed.contains("  max_step: 1099511627776\n"), "{printed}");
    assert!(config.contains(&format!("url: {REDIS_URL}")), "{config}");

    // Redis holds what the runbook's commands act on: the default prefix, account:42. A
    // previous run's maximum is dropped first.
    let key = "fencegate:{account:42}:max";
    let redis = |args: &[&str]| {
        let out = std::process::Command::new("redis-cli")
            .args(["-u", REDIS_URL])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    };
    redis(&["DEL", key]);

    let up = Upstream::start().await;
    let running = dir.path().join("running.yaml");
    let ours = config
        .replace(
            "upstream: http://127.0.0.1:8080",
            &format!("upstream: {}", up.url()),
        )
        .replace("listen: 0.0.0.0:7440", "listen: 127.0.0.1:0")
        .replace("admin: 0.0.0.0:7441", "admin: 127.0.0.1:0");
    assert_ne!(
        &ours, config,
        "the runbook's config names listen, admin and upstream"
    );
    std::fs::write(&running, &ours).unwrap();
    let mut p = Process::start(&running).await;
    assert_eq!(put_to(p.proxy, "42", "17").await.status, 200);
    put_to(p.proxy, "42", "9223372036854775807")
        .await
        .assert_problem(409, "urn:fencegate:token-too-far");

    let spot = commands(spot);
    assert_eq!(spot.len(), 2, "{spot:?}");
    assert_eq!(
        shell(spot[0], p.admin),
        "fencegate_requests_total{code=\"409\",method=\"PUT\",outcome=\"too_far\",route=\"accounts\"} 1\n\
         fencegate_token_too_far_rejected_total{route=\"-\"} 0\n\
         fencegate_token_too_far_rejected_total{route=\"accounts\"} 1\n"
    );
    assert_eq!(
        shell(spot[1], p.admin),
        r#"{"resource":"account:42","token":17,"store":"redis"}"#
    );

    // Poisoned before the ceiling: every write is stale, the inspection shows the poison.
    redis(&["SET", key, "9223372036854775807"]);
    put_to(p.proxy, "42", "18")
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(
        shell(spot[1], p.admin),
        r#"{"resource":"account:42","token":9223372036854775807,"store":"redis"}"#
    );

    // PostgreSQL's table on the default prefix, poisoned the same way.
    let pg = Config::parse(&format!(
        "upstream: http://127.0.0.1:1\nstore: {{ kind: postgres, url: '{POSTGRES_URL}' }}\n"
    ))
    .unwrap();
    let pg = store::open(&pg.store).await.unwrap();
    // The table exists once a statement ran; a previous run's row is lowered to 0 first.
    raise(&*pg, "account:42", 0.into(), Allow.into()).await;
    let psql = |sql: &str| {
        let out = std::process::Command::new("psql")
            .args([POSTGRES_URL, "-qAtc", sql])
            .output()
            .unwrap();
        assert!(out.status.success(), "{sql}");
    };
    psql(
        "UPDATE fencegate_fences SET max_token = 9223372036854775807 WHERE resource = 'account:42'",
    );

    // The repair, as written.
    let repair = commands(repair);
    assert_eq!(repair.len(), 2, "{repair:?}");
    for line in &repair {
        shell(line, p.admin);
    }
    assert_eq!(redis(&["GET", key]), "1234");
    assert_eq!(
        pg.current(&rid("account:42")).await.unwrap(),
        Some(1234.into())
    );

    // The running fencegate's cache still holds the poison as a lower bound: it keeps
    // refusing until restarted, as the runbook says.
    put_to(p.proxy, "42", "1235")
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
    p.signal("-TERM");
    p.child.wait().await.unwrap();
    let p = Process::start(&running).await;
    assert_eq!(put_to(p.proxy, "42", "1235").await.status, 200);
    put_to(p.proxy, "42", "1234")
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(
        shell(spot[1], p.admin),
        r#"{"resource":"account:42","token":1235,"store":"redis"}"#
    );
}
