//! Idempotency keys through the fence: a retried write executes once upstream and is
//! replayed byte for byte; conflicts, reuse, unknown outcomes, windows, and replicas sharing
//! a store.

use crate::common::rid;
use fencegate::fence::{ResourceId, Token};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use fencegate::body::ProxyBody;
use fencegate::config::{Config, EqualTokens};
use fencegate::idempotency::{AttemptId, Begin, Claim, Fingerprint, Record};
use fencegate::metrics::Metrics;
use fencegate::proxy::Proxy;
use fencegate::server::serve;
use fencegate::store::{BoxFuture, FenceStore, Rule, StoreError, Verdict};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Semaphore};

use crate::common::*;
use crate::process::Process;
use crate::stores::store_yaml;

/// A ledger-like upstream that numbers its executions: each answer says which execution it
/// was, so a replay is told apart from a second execution. `/big/...` answers 4 KiB,
/// `/busy/...` 503, and with a gate each request waits for a permit.
struct Ledger {
    addr: SocketAddr,
    executions: Arc<AtomicUsize>,
    gate: Arc<Semaphore>,
    arrivals: tokio::sync::Mutex<mpsc::UnboundedReceiver<()>>,
    gated: bool,
}

impl Ledger {
    async fn start(gated: bool) -> Ledger {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let executions = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(Semaphore::new(0));
        let (tx, rx) = mpsc::unbounded_channel();
        let (n, g) = (Arc::clone(&executions), Arc::clone(&gate));
        tokio::spawn(serve(
            listener,
            settings(),
            move |req: Request<Incoming>, _| {
                let (n, g, tx) = (Arc::clone(&n), Arc::clone(&g), tx.clone());
                async move {
                    let path = req.uri().path().to_owned();
                    let body = req.into_body().collect().await.unwrap().to_bytes();
                    let execution = n.fetch_add(1, Ordering::SeqCst) + 1;
                    let _ = tx.send(());
                    if gated {
                        g.acquire().await.unwrap().forget();
                    }
                    let (status, text) = if path.starts_with("/big/") {
                        (StatusCode::OK, "x".repeat(4096))
                    } else if path.starts_with("/busy/") {
                        (StatusCode::SERVICE_UNAVAILABLE, "busy".to_owned())
                    } else if path.starts_with("/empty/") {
                        (StatusCode::NO_CONTENT, String::new())
                    } else {
                        (
                            StatusCode::CREATED,
                            format!(
                                "{{\"execution\":{execution},\"applied\":{:?}}}",
                                String::from_utf8_lossy(&body)
                            ),
                        )
                    };
                    let mut resp = Response::new(ProxyBody::local(text));
                    *resp.status_mut() = status;
                    resp.headers_mut()
                        .insert("content-type", "application/json".parse().unwrap());
                    resp.headers_mut()
                        .insert("x-execution", execution.to_string().parse().unwrap());
                    resp.headers_mut()
                        .append("set-cookie", "a=1".parse().unwrap());
                    resp.headers_mut()
                        .append("set-cookie", "b=2".parse().unwrap());
                    Ok(resp)
                }
            },
            std::future::pending(),
        ));
        Ledger {
            addr,
            executions,
            gate,
            arrivals: tokio::sync::Mutex::new(rx),
            gated,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn executions(&self) -> usize {
        self.executions.load(Ordering::SeqCst)
    }

    fn release(&self, n: usize) {
        self.gate.add_permits(n);
    }

    async fn arrival(&self) {
        assert!(self.gated);
        let mut rx = self.arrivals.lock().await;
        tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("no request reached the upstream")
            .unwrap();
    }
}

const ROUTES: &str = "routes:\n  - { name: accounts, path: '/accounts/{id}', resource: 'account:{id}' }\n  - { name: big, path: '/big/{id}', resource: 'account:{id}' }\n  - { name: busy, path: '/busy/{id}', resource: 'account:{id}' }\n  - { name: plain, path: '/plain/{id}', resource: 'account:{id}', idempotency: false }\n  - { name: empty, path: '/empty/{id}', resource: 'account:{id}' }\n";

fn section(window: &str) -> String {
    format!("idempotency: {{ window: {window}, max_response_bytes: 1024 }}\n{ROUTES}")
}

async fn post(addr: SocketAddr, path: &str, token: &str, key: Option<&str>, body: &str) -> Reply {
    let mut headers = vec![("fencing-token", token)];
    if let Some(key) = key {
        headers.push(("idempotency-key", key));
    }
    send(
        "POST",
        &format!("http://{addr}{path}"),
        &headers,
        Bytes::copy_from_slice(body.as_bytes()),
    )
    .await
}

/// Everything but the replay marker, for byte-for-byte comparison.
fn head_without_marker(reply: &Reply) -> Vec<(String, Vec<u8>)> {
    reply
        .headers
        .iter()
        .filter(|(n, _)| n.as_str() != "idempotent-replayed")
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect()
}

async fn metrics(admin: SocketAddr) -> String {
    send("GET", &format!("http://{admin}/metrics"), &[], "")
        .await
        .text()
}

async fn a_retry_executes_once_and_replays_byte_for_byte(kind: &str) {
    let up = Ledger::start(false).await;
    let (fg, _store) = on_store(kind, &up, "1m").await;
    let first = post(fg.listen, "/accounts/1", "5", Some("pay-1"), "debit 10").await;
    assert_eq!(first.status, 201);
    assert!(first.headers.get("idempotent-replayed").is_none());
    assert_eq!(first.text(), "{\"execution\":1,\"applied\":\"debit 10\"}");
    for _ in 0..3 {
        let again = post(fg.listen, "/accounts/1", "5", Some("pay-1"), "debit 10").await;
        assert_eq!(again.status, 201, "{}", again.text());
        assert_eq!(again.headers["idempotent-replayed"], "true");
        assert_eq!(again.body, first.body);
        assert_eq!(head_without_marker(&again), head_without_marker(&first));
    }
    assert_eq!(up.executions(), 1);
    // A newer epoch wrote since: the old attempt's retry still gets its answer, and nothing
    // executes.
    assert_eq!(
        post(fg.listen, "/accounts/1", "6", None, "credit 1")
            .await
            .status,
        201
    );
    let late = post(fg.listen, "/accounts/1", "5", Some("pay-1"), "debit 10").await;
    assert_eq!(late.headers["idempotent-replayed"], "true");
    assert_eq!(late.body, first.body);
    // Without the key, the same stale token is refused as always.
    post(fg.listen, "/accounts/1", "5", None, "debit 10")
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(up.executions(), 2);
    let text = metrics(fg.admin).await;
    assert!(
        text.contains("fencegate_idempotent_replays_total 4"),
        "{text}"
    );
    assert!(
        text.contains(
            "fencegate_requests_total{code=\"201\",method=\"POST\",outcome=\"replayed\",route=\"accounts\"} 4"
        ),
        "{text}"
    );
}

async fn the_same_key_for_another_request_is_422(kind: &str) {
    let up = Ledger::start(false).await;
    let (fg, _store) = on_store(kind, &up, "1m").await;
    assert_eq!(
        post(fg.listen, "/accounts/1", "5", Some("k"), "debit 10")
            .await
            .status,
        201
    );
    let reused = post(fg.listen, "/accounts/1", "5", Some("k"), "debit 11").await;
    let body = reused.assert_problem(422, "urn:fencegate:idempotency-key-reused");
    assert_eq!(body["resource"], "account:1");
    // The same key on another resource is another record.
    assert_eq!(
        post(fg.listen, "/accounts/2", "5", Some("k"), "debit 11")
            .await
            .status,
        201
    );
    assert_eq!(up.executions(), 2);
    assert!(metrics(fg.admin)
        .await
        .contains("fencegate_idempotency_conflicts_total{reason=\"key_reused\"} 1"));
}

async fn concurrent_duplicates_execute_once_and_the_rest_get_409(kind: &str) {
    let up = Ledger::start(true).await;
    let (fg, _store) = on_store(kind, &up, "1m").await;
    let addr = fg.listen;
    let first =
        tokio::spawn(async move { post(addr, "/accounts/1", "5", Some("dup"), "debit").await });
    up.arrival().await;
    let mut dups = Vec::new();
    for _ in 0..5 {
        dups.push(tokio::spawn(async move {
            post(addr, "/accounts/1", "5", Some("dup"), "debit").await
        }));
    }
    for d in dups {
        let reply = d.await.unwrap();
        reply.assert_problem(409, "urn:fencegate:idempotency-in-flight");
        assert_eq!(reply.headers["retry-after"], "1");
    }
    up.release(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    // Sent after the first response ended: the record is there, no 409.
    let replay = post(addr, "/accounts/1", "5", Some("dup"), "debit").await;
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(replay.body, first.body);
    assert_eq!(up.executions(), 1);
}

async fn after_the_window_the_key_executes_again(kind: &str) {
    let up = Ledger::start(false).await;
    let (fg, _store) = on_store(kind, &up, "300ms").await;
    assert_eq!(
        post(fg.listen, "/accounts/1", "5", Some("w"), "x")
            .await
            .status,
        201
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let reply = post(fg.listen, "/accounts/1", "5", Some("w"), "x").await;
        assert_eq!(reply.status, 201);
        if reply.headers.get("idempotent-replayed").is_none() {
            assert_eq!(reply.text(), "{\"execution\":2,\"applied\":\"x\"}");
            break;
        }
        assert!(Instant::now() < deadline, "the record never expired");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(up.executions(), 2);
}

/// An in-process fencegate on a fresh store of `kind`; the guard keeps the store alive.
async fn on_store(
    kind: &str,
    up: &Ledger,
    window: &str,
) -> (
    fencegate::app::Server,
    (Option<crate::services::Service>, tempfile::TempDir),
) {
    let dir = tempfile::tempdir().unwrap();
    let (yaml, service) = store_yaml(kind, &dir).await;
    let fg = fencegate(&up.url(), &format!("{yaml}{}", section(window))).await;
    (fg, (service, dir))
}

macro_rules! on_every_store {
    ($($kind:ident),*) => {$(
        mod $kind {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_retry_executes_once_and_replays_byte_for_byte() { super::a_retry_executes_once_and_replays_byte_for_byte(stringify!($kind)).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_same_key_for_another_request_is_422() { super::the_same_key_for_another_request_is_422(stringify!($kind)).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_duplicates_execute_once_and_the_rest_get_409() { super::concurrent_duplicates_execute_once_and_the_rest_get_409(stringify!($kind)).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn after_the_window_the_key_executes_again() { super::after_the_window_the_key_executes_again(stringify!($kind)).await }
        }
    )*};
}

on_every_store!(memory, embedded, redis, postgres, etcd);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_outcome_is_redone_only_with_a_token_at_least_the_recorded_one() {
    let up = Ledger::start(false).await;
    let fg = fencegate(&up.url(), &section("1m")).await;
    // 503 from the upstream: the write may not have happened; it is not replayed.
    let busy = post(fg.listen, "/busy/1", "7", Some("u"), "x").await;
    assert_eq!(busy.status, 503);
    assert_eq!(busy.text(), "busy");
    let again = post(fg.listen, "/busy/1", "7", Some("u"), "x").await;
    assert_eq!(again.status, 503);
    assert!(again.headers.get("idempotent-replayed").is_none());
    assert_eq!(up.executions(), 2);
    let older = post(fg.listen, "/busy/1", "6", Some("u"), "x").await;
    let body = older.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(body["current_token"], 7);
    assert_eq!(up.executions(), 2);
    assert!(metrics(fg.admin)
        .await
        .contains("fencegate_idempotency_unknown_outcomes_total 2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_upstream_leaves_the_outcome_unknown() {
    let up = Ledger::start(false).await;
    // Port 1 refuses connections.
    let fg = fencegate("http://127.0.0.1:1", &section("1m")).await;
    post(fg.listen, "/accounts/1", "4", Some("u"), "x")
        .await
        .assert_problem(502, "urn:fencegate:upstream-error");
    // The retry is not refused as in flight: the attempt was recorded as unknown.
    post(fg.listen, "/accounts/1", "4", Some("u"), "x")
        .await
        .assert_problem(502, "urn:fencegate:upstream-error");
    post(fg.listen, "/accounts/1", "3", Some("u"), "x")
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
    drop(up);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_too_large_to_keep_is_not_replayed_nor_executed_again() {
    let up = Ledger::start(false).await;
    let fg = fencegate(&up.url(), &section("1m")).await;
    let first = post(fg.listen, "/big/1", "5", Some("b"), "x").await;
    assert_eq!(first.status, 200);
    assert_eq!(first.body.len(), 4096);
    let retry = post(fg.listen, "/big/1", "5", Some("b"), "x").await;
    let body = retry.assert_problem(409, "urn:fencegate:idempotency-not-replayable");
    assert_eq!(body["recorded_status"], 200);
    assert_eq!(up.executions(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_keys_and_bodies_are_refused_and_record_nothing() {
    let up = Ledger::start(false).await;
    let fg = fencegate(
        &up.url(),
        &format!("idempotency: {{ window: 1m, max_request_bytes: 16 }}\n{ROUTES}"),
    )
    .await;
    let long = "k".repeat(256);
    for key in ["has space", long.as_str()] {
        post(fg.listen, "/accounts/1", "5", Some(key), "x")
            .await
            .assert_problem(400, "urn:fencegate:invalid-idempotency-key");
    }
    let two = send(
        "POST",
        &format!("http://{}/accounts/1", fg.listen),
        &[
            ("fencing-token", "5"),
            ("idempotency-key", "a"),
            ("idempotency-key", "b"),
        ],
        "x",
    )
    .await;
    two.assert_problem(400, "urn:fencegate:invalid-idempotency-key");
    post(fg.listen, "/accounts/1", "5", Some("k"), &"y".repeat(17))
        .await
        .assert_problem(413, "urn:fencegate:request-too-large");
    assert_eq!(up.executions(), 0);
    assert_eq!(recorded(&fg, "account:1").await, None);
    // A route that opted out forwards keys untouched, every time.
    for _ in 0..2 {
        assert_eq!(
            post(fg.listen, "/plain/1", "5", Some("k"), "x")
                .await
                .status,
            201
        );
    }
    assert_eq!(up.executions(), 2);
}

/// A method override names the method the upstream acts on, so it is the method the
/// fingerprint takes: the same key for another overridden method is another request (422), and
/// the overridden method sent as itself is the same request (replayed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fingerprint_takes_the_method_an_override_names() {
    let up = Ledger::start(false).await;
    let fg = fencegate(&up.url(), &section("1m")).await;
    let url = format!("http://{}/accounts/1", fg.listen);
    let keyed = |header, method| {
        [
            ("fencing-token", "5"),
            ("idempotency-key", "m"),
            (header, method),
        ]
    };
    let put = send("POST", &url, &keyed("x-http-method-override", "PUT"), "v").await;
    assert_eq!(put.status, 201);
    assert_eq!(put.text(), "{\"execution\":1,\"applied\":\"v\"}");
    assert!(put.headers.get("idempotent-replayed").is_none());
    for (header, method) in [
        ("x-http-method-override", "DELETE"),
        ("x-http-method", "delete"),
        ("x-method-override", "PATCH"),
    ] {
        let other = send("POST", &url, &keyed(header, method), "v").await;
        let body = other.assert_problem(422, "urn:fencegate:idempotency-key-reused");
        assert_eq!(body["resource"], "account:1");
        assert!(other.headers.get("idempotent-replayed").is_none());
    }
    let same = send(
        "PUT",
        &url,
        &[("fencing-token", "5"), ("idempotency-key", "m")],
        "v",
    )
    .await;
    assert_eq!(same.status, 201);
    assert_eq!(same.headers["idempotent-replayed"], "true");
    assert_eq!(same.body, put.body);
    assert_eq!(head_without_marker(&same), head_without_marker(&put));
    assert_eq!(up.executions(), 1);
    assert_eq!(recorded(&fg, "account:1").await, Some(5));
}

/// Two fencegate processes sharing one store: a retry that lands on the other replica is
/// replayed from the shared record, not executed.
async fn retry_on_the_other_replica(kind: &str) {
    let up = Ledger::start(false).await;
    let dir = tempfile::tempdir().unwrap();
    let (yaml, _service) = store_yaml(kind, &dir).await;
    let config = |name: &str| {
        let path = dir.path().join(name);
        std::fs::write(
            &path,
            format!(
                "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: {}\n{yaml}{}",
                up.url(),
                section("1m")
            ),
        )
        .unwrap();
        path
    };
    let a = Process::start(&config("a.yaml")).await;
    let b = Process::start(&config("b.yaml")).await;
    let first = post(a.proxy, "/accounts/1", "5", Some("r-1"), "debit 10").await;
    assert_eq!(first.status, 201, "{}", first.text());
    let retry = post(b.proxy, "/accounts/1", "5", Some("r-1"), "debit 10").await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(retry.body, first.body);
    assert_eq!(head_without_marker(&retry), head_without_marker(&first));
    post(b.proxy, "/accounts/1", "5", Some("r-1"), "debit 11")
        .await
        .assert_problem(422, "urn:fencegate:idempotency-key-reused");
    assert_eq!(up.executions(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sharing_redis_replay_each_others_records() {
    retry_on_the_other_replica("redis").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sharing_postgres_replay_each_others_records() {
    retry_on_the_other_replica("postgres").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sharing_etcd_replay_each_others_records() {
    retry_on_the_other_replica("etcd").await
}

/// The first answer to a retry that is not `409 idempotency-in-flight`: the retry loop of a
/// client whose first attempt was abandoned, bounded by a deadline.
async fn retry_until_settled(addr: SocketAddr, path: &str, token: &str, key: &str) -> Reply {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let reply = tokio::time::timeout(
            Duration::from_secs(10),
            post(addr, path, token, Some(key), "x"),
        )
        .await
        .expect("a retry got no answer (sent upstream again?)");
        if reply.status != StatusCode::CONFLICT {
            return reply;
        }
        // Still in flight: the abandoned attempt is being recorded.
        reply.assert_problem(409, "urn:fencegate:idempotency-in-flight");
        assert!(
            Instant::now() < deadline,
            "the abandoned write was never recorded"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The client hangs up while its keyed write is with the upstream: the answer is still
/// recorded, and the retry gets it instead of executing again. Whether fencegate notices the
/// hang-up before the upstream's answer is handed to the request, while it is handed over, or
/// only when it writes the response, the outcome is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_still_gets_its_write_recorded() {
    use tokio::io::AsyncWriteExt;
    let up = Ledger::start(true).await;
    let fg = fencegate(&up.url(), &section("1m")).await;
    let mut client = tokio::net::TcpStream::connect(fg.listen).await.unwrap();
    client
        .write_all(
            b"POST /accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 5\r\nIdempotency-Key: gone\r\nContent-Length: 1\r\n\r\nx",
        )
        .await
        .unwrap();
    up.arrival().await;
    drop(client);
    up.release(1);
    let replay = retry_until_settled(fg.listen, "/accounts/1", "5", "gone").await;
    assert_eq!(replay.status, 201, "{}", replay.text());
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(replay.text(), "{\"execution\":1,\"applied\":\"x\"}");
    assert_eq!(up.executions(), 1);
}

/// An upstream that answers 201 with its head at once and holds the body until the test sends
/// it: each request hands the test the sender of its body.
struct Holding {
    addr: SocketAddr,
    executions: Arc<AtomicUsize>,
    bodies: tokio::sync::Mutex<mpsc::UnboundedReceiver<mpsc::Sender<Bytes>>>,
}

impl Holding {
    async fn start() -> Holding {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let executions = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = mpsc::unbounded_channel();
        let n = Arc::clone(&executions);
        tokio::spawn(serve(
            listener,
            settings(),
            move |req: Request<Incoming>, _| {
                let (n, tx) = (Arc::clone(&n), tx.clone());
                async move {
                    req.into_body().collect().await.unwrap();
                    n.fetch_add(1, Ordering::SeqCst);
                    let (body_tx, body_rx) = mpsc::channel(1);
                    let _ = tx.send(body_tx);
                    let mut resp = Response::new(ProxyBody::Channel(body_rx));
                    *resp.status_mut() = StatusCode::CREATED;
                    Ok(resp)
                }
            },
            std::future::pending(),
        ));
        Holding {
            addr,
            executions,
            bodies: tokio::sync::Mutex::new(rx),
        }
    }

    /// The body sender of the next request (its head is on its way).
    async fn next_body(&self) -> mpsc::Sender<Bytes> {
        let mut rx = self.bodies.lock().await;
        tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("no request reached the upstream")
            .unwrap()
    }
}

/// The client hangs up after the response head reached it, before the body exists: the body
/// is drained from the upstream once it comes, and recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_after_the_head_still_gets_its_write_recorded() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = Holding::start().await;
    let fg = fencegate(&format!("http://{}", up.addr), &section("1m")).await;
    let mut client = tokio::net::TcpStream::connect(fg.listen).await.unwrap();
    client
        .write_all(
            b"POST /accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 5\r\nIdempotency-Key: head\r\nContent-Length: 1\r\n\r\nx",
        )
        .await
        .unwrap();
    let body = up.next_body().await;
    let mut head = Vec::new();
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let mut buf = [0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(10), client.read(&mut buf))
            .await
            .expect("the response head never reached the client")
            .unwrap();
        assert!(n > 0, "fencegate closed the connection before the head");
        head.extend_from_slice(&buf[..n]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 201"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    drop(client);
    body.send(Bytes::from_static(b"late ")).await.unwrap();
    body.send(Bytes::from_static(b"body")).await.unwrap();
    drop(body);
    let replay = retry_until_settled(fg.listen, "/accounts/1", "5", "head").await;
    assert_eq!(replay.status, 201, "{}", replay.text());
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(replay.text(), "late body");
    assert_eq!(up.executions.load(Ordering::SeqCst), 1);
}

/// The client hangs up while its keyed write waits for its turn behind a lower token
/// (`ordering: serialize`): it was claimed but never sent, so its key is not left in flight
/// for the whole window; the outcome is unknown and the retry executes it, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_while_queued_leaves_its_key_retryable() {
    use tokio::io::AsyncWriteExt;
    let up = Ledger::start(true).await;
    let fg = fencegate(
        &up.url(),
        "idempotency: { window: 1m, max_response_bytes: 1024 }\nroutes:\n  - { name: queued, path: '/accounts/{id}', resource: 'account:{id}', ordering: serialize, barrier_timeout: 30s }\n",
    )
    .await;
    let addr = fg.listen;
    // Token 5 is with the upstream; token 6 must wait for it.
    let first = tokio::spawn(async move { post(addr, "/accounts/1", "5", None, "first").await });
    up.arrival().await;
    let mut queued = tokio::net::TcpStream::connect(addr).await.unwrap();
    queued
        .write_all(
            b"POST /accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 6\r\nIdempotency-Key: queued\r\nContent-Length: 1\r\n\r\nx",
        )
        .await
        .unwrap();
    // The claim raises the maximum in the same step as it writes the in-flight record.
    let deadline = Instant::now() + Duration::from_secs(10);
    while recorded(&fg, "account:1").await != Some(6) {
        assert!(
            Instant::now() < deadline,
            "the queued write was never claimed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(queued);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !metrics(fg.admin)
        .await
        .contains("fencegate_idempotency_unknown_outcomes_total 1")
    {
        assert!(
            Instant::now() < deadline,
            "the abandoned claim stayed in flight"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        up.executions(),
        1,
        "the abandoned write reached the upstream"
    );
    up.release(2);
    assert_eq!(first.await.unwrap().status, 201);
    let retry = retry_until_settled(addr, "/accounts/1", "6", "queued").await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(retry.headers.get("idempotent-replayed").is_none());
    assert_eq!(retry.text(), "{\"execution\":2,\"applied\":\"x\"}");
    assert_eq!(up.executions(), 2);
}

/// An attempt that takes longer than the window keeps its key in flight: a retry never runs
/// alongside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_longer_than_the_window_stays_in_flight() {
    let up = Ledger::start(true).await;
    let fg = fencegate(&up.url(), &section("100ms")).await;
    let addr = fg.listen;
    let first =
        tokio::spawn(async move { post(addr, "/accounts/1", "5", Some("slow"), "x").await });
    up.arrival().await;
    let until = Instant::now() + Duration::from_millis(600);
    let mut refused = 0;
    while Instant::now() < until {
        tokio::time::timeout(
            Duration::from_secs(2),
            post(addr, "/accounts/1", "5", Some("slow"), "x"),
        )
        .await
        .expect("a retry was sent upstream while the first attempt was still there")
        .assert_problem(409, "urn:fencegate:idempotency-in-flight");
        refused += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(refused >= 5);
    up.release(1);
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(up.executions(), 1);
}

/// Authoritative mode: once a newer lease is granted, the old holder's retry still gets its
/// completed write replayed, but a new key with the old token is refused before anything runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_superseded_holder_gets_its_replay_and_nothing_else() {
    let up = Ledger::start(false).await;
    let dir = tempfile::tempdir().unwrap();
    let fg = fencegate(
        &up.url(),
        &format!(
            "fence: {{ authority: leases }}\nleases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: embedded, path: {} }}\n  ttl: 5s\n{}",
            dir.path().join("leases.db").display(),
            section("1m")
        ),
    )
    .await;
    let api = format!("http://{}/v1/leases/account:1", fg.leases.unwrap());
    let grant = |holder: &'static str| {
        let api = api.clone();
        async move {
            let reply = send("POST", &api, &[], format!(r#"{{"holder":"{holder}"}}"#)).await;
            assert_eq!(reply.status, 200, "{}", reply.text());
            reply.json()["fencing_token"].as_u64().unwrap().to_string()
        }
    };
    let t1 = grant("worker-1").await;
    let first = post(fg.listen, "/accounts/1", &t1, Some("k1"), "debit").await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(send("DELETE", &api, &[], "").await.status, 200);
    let t2 = grant("worker-2").await;
    // Worker 2 has written nothing; worker 1's retry is answered from the record.
    let retry = post(fg.listen, "/accounts/1", &t1, Some("k1"), "debit").await;
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(retry.body, first.body);
    // A new write by worker 1 is superseded.
    let body = post(fg.listen, "/accounts/1", &t1, Some("k2"), "debit again")
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(body["current_token"].to_string(), t2);
    assert_eq!(up.executions(), 1);
}

/// A response without a body (204) is never polled by the server, so it is recorded before it
/// goes out: the retry sent right after it is a replay, not an in-flight conflict (on etcd, the
/// slowest store, where recording after the response lost that race).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_response_is_recorded_before_the_client_sees_it() {
    let up = Ledger::start(false).await;
    let (fg, _store) = on_store("etcd", &up, "1m").await;
    for token in 1..=3u64 {
        let key = format!("e-{token}");
        let token = token.to_string();
        let first = post(fg.listen, "/empty/1", &token, Some(&key), "x").await;
        assert_eq!(first.status, 204, "{}", first.text());
        let retry = post(fg.listen, "/empty/1", &token, Some(&key), "x").await;
        assert_eq!(retry.status, 204, "{}", retry.text());
        assert_eq!(retry.headers["idempotent-replayed"], "true");
        assert_eq!(head_without_marker(&retry), head_without_marker(&first));
    }
    assert_eq!(up.executions(), 3);
}

/// A real store whose next claim stalls until the test lets it go (the claim's caller gives up
/// first), and which reports every outcome write's answer: the shape of a store that stops
/// answering for a while.
struct Stalling {
    inner: Arc<dyn FenceStore>,
    /// Set: the next `begin_idempotent` waits on `release` before it reaches the store.
    stall: std::sync::atomic::AtomicBool,
    release: Arc<Semaphore>,
    /// Tells the test a claim is stalled.
    stalled: mpsc::UnboundedSender<()>,
    /// Each outcome write's attempt and answer, once the store answered.
    finished: mpsc::UnboundedSender<(AttemptId, Result<bool, StoreError>)>,
}

impl FenceStore for Stalling {
    fn compare_and_raise<'a>(
        &'a self,
        resource: &'a ResourceId,
        token: Token,
        rule: Rule,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>> {
        self.inner.compare_and_raise(resource, token, rule)
    }

    fn current<'a>(
        &'a self,
        resource: &'a ResourceId,
    ) -> BoxFuture<'a, Result<Option<Token>, StoreError>> {
        self.inner.current(resource)
    }

    fn healthy(&self) -> bool {
        self.inner.healthy()
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn begin_idempotent<'a>(
        &'a self,
        resource: &'a ResourceId,
        key: &'a str,
        claim: &'a Claim,
    ) -> BoxFuture<'a, Result<Begin, StoreError>> {
        let stall = self.stall.swap(false, Ordering::SeqCst);
        Box::pin(async move {
            if stall {
                let _ = self.stalled.send(());
                self.release.acquire().await.unwrap().forget();
            }
            self.inner.begin_idempotent(resource, key, claim).await
        })
    }

    fn finish_idempotent<'a>(
        &'a self,
        resource: &'a ResourceId,
        key: &'a str,
        claim: &'a Claim,
        outcome: &'a Record,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let wrote = self
                .inner
                .finish_idempotent(resource, key, claim, outcome)
                .await;
            let _ = self.finished.send((claim.attempt, wrote.clone()));
            wrote
        })
    }
}

/// Receives from `rx` within 10 s, or fails naming `what`.
async fn next<T>(rx: &mut mpsc::UnboundedReceiver<T>, what: &str) -> T {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
        .unwrap()
}

/// A retry whose claim times out while the first attempt is with the upstream must not free
/// the key: its clean-up only marks unknown a record its own claim wrote. A third attempt is
/// then refused as in flight, the upstream executes once, and the first attempt's answer is
/// what retries get.
async fn a_timed_out_retry_does_not_free_a_running_attempts_key(kind: &str) {
    let up = Ledger::start(true).await;
    let dir = tempfile::tempdir().unwrap();
    let (yaml, _service) = store_yaml(kind, &dir).await;
    let config = Config::parse(&format!(
        "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: {}\n{yaml}\
         timeouts: {{ store: 300ms, upstream: 30s }}\n{}",
        up.url(),
        section("1m")
    ))
    .unwrap();
    let (stalled, mut stalls) = mpsc::unbounded_channel();
    let (finished, mut outcomes) = mpsc::unbounded_channel();
    let store = Arc::new(Stalling {
        inner: fencegate::store::open(&config.store).await.unwrap(),
        stall: false.into(),
        release: Arc::new(Semaphore::new(0)),
        stalled,
        finished,
    });
    let metrics = Arc::new(Metrics::new(prometheus::Registry::new()).unwrap());
    let proxy = Arc::new(Proxy::new(&config, store.clone(), metrics).unwrap());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(
        listener,
        settings(),
        move |req, peer| Arc::clone(&proxy).handle(req, peer),
        std::future::pending(),
    ));
    let pay = || post(addr, "/accounts/1", "5", Some("pay-1"), "debit 10");

    // A is with the upstream.
    let a = tokio::spawn(pay());
    up.arrival().await;
    // B's claim stalls past the store timeout: 503, and its clean-up runs.
    store.stall.store(true, Ordering::SeqCst);
    let b = tokio::spawn(pay());
    next(&mut stalls, "B's claim to stall").await;
    let b = b.await.unwrap();
    let body = b.assert_problem(503, "urn:fencegate:store-unavailable");
    assert_eq!(
        body["detail"],
        "the write was not forwarded because it could not be checked: no answer within 300ms"
    );
    let (_, cleaned) = next(&mut outcomes, "B's clean-up").await;
    // C finds A's record still in flight and is not executed.
    let c = tokio::spawn(pay());
    tokio::select! {
        reply = c => {
            reply.unwrap().assert_problem(409, "urn:fencegate:idempotency-in-flight");
        }
        () = up.arrival() => panic!("C was executed while A was still with the upstream"),
    }
    assert!(!cleaned.unwrap(), "B's clean-up replaced A's live record");
    assert_eq!(up.executions(), 1);
    // A ends; its outcome lands, and a retry replays it.
    up.release(1);
    let a = a.await.unwrap();
    assert_eq!(a.status, 201);
    assert_eq!(a.text(), "{\"execution\":1,\"applied\":\"debit 10\"}");
    let (_, recorded) = next(&mut outcomes, "A's outcome").await;
    assert!(recorded.unwrap());
    let retry = pay().await;
    assert_eq!(retry.status, 201);
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(retry.body, a.body);
    assert_eq!(up.executions(), 1);
    assert_eq!(
        store.current(&rid("account:1")).await.unwrap(),
        Some(5.into())
    );
    let look = Claim {
        token: 5.into(),
        fingerprint: Fingerprint::of("POST", "/accounts/1", None, b"debit 10"),
        rule: EqualTokens::Allow.into(),
        window: Duration::from_secs(60),
        may_execute: false,
        attempt: AttemptId::next(),
    };
    match store
        .begin_idempotent(&rid("account:1"), "pay-1", &look)
        .await
    {
        Ok(Begin::Completed(record)) => {
            assert_eq!(
                (record.token, record.status, record.attempt),
                (tk(5), Some(201), None)
            );
            assert_eq!(record.response.unwrap().body, a.body);
        }
        other => panic!("expected A's completed record, got {other:?}"),
    }
    store.release.add_permits(1);
}

macro_rules! on_every_stalling_store {
    ($($kind:ident),*) => {$(
        mod $kind {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_timed_out_retry_does_not_free_a_running_attempts_key() { super::a_timed_out_retry_does_not_free_a_running_attempts_key(stringify!($kind)).await }
        }
    )*};
}

mod stalled_store {
    use super::*;
    on_every_stalling_store!(memory, embedded, redis, postgres, etcd);
}
