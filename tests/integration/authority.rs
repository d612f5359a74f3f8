//! Authoritative fencing (`fence.authority: leases`) is decided when the write is admitted,
//! not when its headers arrive: a lease that passes on while the body is still coming, while
//! the store raises, or while the write waits for its barrier turn refuses the write.

use crate::common::rid;
use crate::common::tk;
use fencegate::fence::{ResourceId, Token};
use std::sync::Arc;
use std::time::Duration;

use fencegate::config::Config;
use fencegate::fence::Fence;
use fencegate::idempotency::{Begin, Claim, Record};
use fencegate::lease::{Acquired, Grant};
use fencegate::metrics::Metrics;
use fencegate::proxy::Proxy;
use fencegate::server::serve;
use fencegate::store::{BoxFuture, FenceStore, MemoryStore, Rule, StoreError, Verdict};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};

use crate::common::*;

/// The lease API of `fg` for `account:42`: grants to `holder` and returns the token.
pub(crate) async fn grant(fg: &fencegate::app::Server, holder: &str) -> u64 {
    let api = format!("http://{}/v1/leases/account:42", fg.leases.unwrap());
    let reply = send("POST", &api, &[], format!(r#"{{"holder":"{holder}"}}"#)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.json()["fencing_token"].as_u64().unwrap()
}

/// Releases the lease on `account:42` and grants it to `holder`: a hand-over.
pub(crate) async fn hand_over(fg: &fencegate::app::Server, holder: &str) -> u64 {
    let api = format!("http://{}/v1/leases/account:42", fg.leases.unwrap());
    assert_eq!(send("DELETE", &api, &[], "").await.status, 200);
    grant(fg, holder).await
}

fn authoritative(dir: &tempfile::TempDir, routes: &str) -> String {
    format!(
        "store: {{ kind: memory }}\nfence: {{ authority: leases }}\nleases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: embedded, path: {} }}\n  ttl: 5s\ntimeouts: {{ store: 30s }}\n{routes}",
        dir.path().join("leases.db").display()
    )
}

/// Keyed write: the body is read whole (to fingerprint it) before the claim. The lease passes
/// to another worker after the headers were read and while the body is still coming (hyper
/// answers `100 Continue` when the body is first read: the signal that the headers were
/// handled); the completed write is superseded, not claimed and not forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_write_whose_lease_passes_on_during_its_body_is_superseded() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let routes = format!("idempotency: {{ window: 1m }}\n{ACCOUNTS}");
    let fg = fencegate(&up.url(), &authoritative(&dir, &routes)).await;
    let t1 = grant(&fg, "worker-1").await;

    let mut stream = TcpStream::connect(fg.listen).await.unwrap();
    let head = format!(
        "POST /accounts/42 HTTP/1.1\r\nHost: x\r\nfencing-token: {t1}\r\nidempotency-key: k1\r\ncontent-length: 5\r\nexpect: 100-continue\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut buf = [0u8; 256];
    let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
        .await
        .expect("no 100 Continue within 10s")
        .unwrap();
    assert_eq!(
        std::str::from_utf8(&buf[..n]).unwrap(),
        "HTTP/1.1 100 Continue\r\n\r\n"
    );

    let t2 = hand_over(&fg, "worker-2").await;
    assert!(t2 > t1);
    stream.write_all(b"debit").await.unwrap();
    let answer = read_response(&mut stream).await;
    assert!(answer.starts_with("HTTP/1.1 409 "), "{answer}");
    let body: serde_json::Value =
        serde_json::from_str(&answer[answer.find("\r\n\r\n").unwrap() + 4..]).unwrap();
    assert_eq!(body["type"], "urn:fencegate:stale-token", "{body}");
    assert_eq!(body["current_token"], t2, "{body}");
    assert_eq!(body["token"], t1, "{body}");
    assert!(up.seen().is_empty(), "{:?}", up.seen());
    // Nothing was claimed: the key is free, and the new holder's write with it executes.
    let reply = send(
        "POST",
        &format!("http://{}/accounts/42", fg.listen),
        &[
            ("fencing-token", &t2.to_string()),
            ("idempotency-key", "k1"),
        ],
        "debit",
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let tokens: Vec<_> = up.seen().iter().map(|s| s.token()).collect();
    assert_eq!(tokens, [Some(t2)]);
}

/// `ordering: serialize`: a write admitted with the latest grant waits for its turn behind a
/// lower token still with the upstream; the lease passes on meanwhile. When its turn comes the
/// write is superseded, and the upstream never sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serialized_write_whose_lease_passes_on_while_it_waits_its_turn_is_superseded() {
    let up = Upstream::gated().await;
    let dir = tempfile::tempdir().unwrap();
    let routes = "routes:\n  - { name: accounts, path: '/accounts/{id}', resource: 'account:{id}', ordering: serialize, barrier_timeout: 30s }\n";
    let fg = fencegate(&up.url(), &authoritative(&dir, routes)).await;
    let fg = Arc::new(fg);

    let t1 = grant(&fg, "worker-1").await;
    let mut first = tokio::spawn({
        let fg = Arc::clone(&fg);
        async move { put(&fg, "42", &t1.to_string()).await }
    });
    tokio::select! {
        seen = up.arrival() => assert_eq!(seen.token(), Some(t1)),
        reply = &mut first => panic!("answered before it reached the upstream: {:?}", reply.map(|r| r.text())),
    }

    let t2 = hand_over(&fg, "worker-2").await;
    let second = tokio::spawn({
        let fg = Arc::clone(&fg);
        async move { put(&fg, "42", &t2.to_string()).await }
    });
    // Admitted (the maximum is its token) and waiting for the first write to finish.
    wait_for_maximum(fg.store.as_ref(), "account:42", tk(t2)).await;

    let t3 = hand_over(&fg, "worker-3").await;
    up.release(2);
    assert_eq!(first.await.unwrap().status, 200);
    let reply = second.await.unwrap();
    let body = reply.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(body["current_token"], t3);
    assert_eq!(body["token"], t2);
    let tokens: Vec<_> = up.seen().iter().map(|s| s.token()).collect();
    assert_eq!(tokens, [Some(t1)]);
}

/// Plain write on a store that answers later: the lease passes on while the compare-and-raise
/// is with the store. The raise admits the token (it is above the maximum), but the write is
/// superseded by the time it could be sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_write_whose_lease_passes_on_during_its_raise_is_superseded() {
    fencegate::tls::install_default_provider();
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: {}\n{}",
        up.url(),
        authoritative(&dir, ACCOUNTS)
    );
    let config = Config::parse(&yaml).unwrap();
    let backend = fencegate::lease::open(&config.leases.as_ref().unwrap().backend)
        .await
        .unwrap();
    let (raising, mut raised) = mpsc::unbounded_channel();
    let gate = Arc::new(Semaphore::new(0));
    let store = Arc::new(GatedStore {
        inner: MemoryStore::new(),
        raising,
        gate: Arc::clone(&gate),
    });
    let metrics = Arc::new(Metrics::new(prometheus::Registry::new()).unwrap());
    let proxy = Arc::new(
        Proxy::over(
            &config,
            Fence::new(&config, store, metrics).with_authority(Arc::clone(&backend)),
        )
        .unwrap(),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(
        listener,
        settings(),
        move |req, peer| Arc::clone(&proxy).handle(req, peer),
        std::future::pending(),
    ));

    let ttl = Duration::from_secs(5);
    let first = granted(backend.try_acquire("account:42", "worker-1", ttl).await);
    let write = tokio::spawn(async move {
        send(
            "PUT",
            &format!("http://{addr}/accounts/42"),
            &[("fencing-token", &first.token.to_string())],
            "debit",
        )
        .await
    });
    // The write passed the authority and is with the store.
    assert_eq!(raised.recv().await, Some(first.token.get()));
    assert!(backend.release(&first).await.unwrap());
    let second = granted(backend.try_acquire("account:42", "worker-2", ttl).await);
    gate.add_permits(1);

    let reply = write.await.unwrap();
    let body = reply.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(body["current_token"], second.token.get());
    assert_eq!(body["token"], first.token.get());
    assert!(up.seen().is_empty(), "{:?}", up.seen());
}

fn granted(acquired: Result<Acquired, fencegate::lease::LeaseError>) -> Grant {
    match acquired.unwrap() {
        Acquired::Granted(grant) => grant,
        other => panic!("not granted: {other:?}"),
    }
}

/// Waits (bounded) until the store's maximum for `resource` is `token`.
async fn wait_for_maximum(store: &dyn FenceStore, resource: &str, token: Token) {
    tokio::time::timeout(Duration::from_secs(10), async {
        while store.current(&rid(resource)).await.unwrap() != Some(token) {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the write was not admitted within 10s");
}

/// The memory store, whose compare-and-raise announces itself and then waits for a permit.
struct GatedStore {
    inner: MemoryStore,
    raising: mpsc::UnboundedSender<u64>,
    gate: Arc<Semaphore>,
}

impl FenceStore for GatedStore {
    fn compare_and_raise<'a>(
        &'a self,
        resource: &'a ResourceId,
        token: Token,
        rule: Rule,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>> {
        Box::pin(async move {
            let _ = self.raising.send(token.get());
            self.gate.acquire().await.unwrap().forget();
            self.inner.compare_and_raise(resource, token, rule).await
        })
    }

    fn current<'a>(
        &'a self,
        resource: &'a ResourceId,
    ) -> BoxFuture<'a, Result<Option<Token>, StoreError>> {
        self.inner.current(resource)
    }

    fn healthy(&self) -> bool {
        true
    }

    fn kind(&self) -> &'static str {
        "gated"
    }

    fn begin_idempotent<'a>(
        &'a self,
        resource: &'a ResourceId,
        key: &'a str,
        claim: &'a Claim,
    ) -> BoxFuture<'a, Result<Begin, StoreError>> {
        self.inner.begin_idempotent(resource, key, claim)
    }

    fn finish_idempotent<'a>(
        &'a self,
        resource: &'a ResourceId,
        key: &'a str,
        claim: &'a Claim,
        outcome: &'a Record,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.finish_idempotent(resource, key, claim, outcome)
    }
}
