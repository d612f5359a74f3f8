//! `fencegate demo`: the slow-writer scenario, end to end, in one process.
//!
//! A toy ledger (which trusts every write it gets), fencegate in front of it with the memory
//! store, a toy lock service with a short TTL, and two workers. Worker 1 writes with token 33
//! and stalls past its lease; worker 2 gets the lease with token 34 and writes; worker 1 wakes
//! up and writes again with token 33, and fencegate refuses it with 409. Act two repeats the
//! story with real leases: lease API, renewal, local deadline and egress.
//!
//! `fencegate demo upstream` runs the toy ledger alone, on a fixed address, as the service
//! the README's quickstart and docs/leases.md put fencegate in front of.

use crate::fence::token::Token;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;

use crate::app::Server;
use crate::body::ProxyBody;
use crate::config::Config;
use crate::lease::agent::Agent;
use crate::lease::{Acquired, Grant, LeaseBackend, LeaseError};
use crate::proxy::Proxy;
use crate::server::{serve, ServerSettings};
use crate::store::BoxFuture;
use crate::sync::Locked;

const LEASE_TTL: Duration = Duration::from_millis(300);

struct Timeline(Instant);

impl Timeline {
    fn say(&self, who: &str, what: impl AsRef<str>) {
        let ms = self.0.elapsed().as_millis();
        println!("  t={ms:>5}ms  {who:<12} {}", what.as_ref());
    }
}

/// A lock service that hands out increasing tokens, as etcd or ZooKeeper would.
struct Locks {
    state: Mutex<(u64, Option<(&'static str, Instant)>)>,
}

impl Locks {
    fn try_acquire(&self, who: &'static str) -> Option<u64> {
        let mut state = self.state.locked();
        let free = state.1.is_none_or(|(_, expires)| expires <= Instant::now());
        free.then(|| {
            state.0 += 1;
            state.1 = Some((who, Instant::now() + LEASE_TTL));
            state.0
        })
    }
}

/// `fencegate demo upstream`: a toy ledger on `listen` until the process is stopped. A
/// write (`PUT`, `POST`, `PATCH`) keeps its body under its path, `DELETE` forgets it, `GET`
/// and `HEAD` read it back; each answer is one line saying what the ledger did and which
/// fencing token it received, so a reader sees what reached it.
pub async fn upstream(listen: std::net::SocketAddr) -> ExitCode {
    let listener = match TcpListener::bind(listen).await {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("error: cannot listen on {listen}: {e}");
            return ExitCode::from(1);
        }
    };
    let addr = listener.local_addr().unwrap_or(listen);
    eprintln!(
        "fencegate demo upstream: a toy ledger on {addr}; PUT, POST or PATCH stores the body, GET \
         reads it"
    );
    let kept: Arc<Mutex<std::collections::HashMap<String, Bytes>>> = Arc::default();
    serve(
        listener,
        local_settings(),
        move |req: Request<hyper::body::Incoming>, _| {
            let kept = Arc::clone(&kept);
            async move {
                let (parts, body) = req.into_parts();
                let body = body.collect().await.map(|b| b.to_bytes());
                let (status, text) = ledger_answer(&kept, &parts, body.unwrap_or_default());
                let mut response = Response::new(ProxyBody::local(text));
                *response.status_mut() = status;
                response.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static("text/plain; charset=utf-8"),
                );
                Ok(response)
            }
        },
        std::future::pending(),
    )
    .await;
    ExitCode::SUCCESS
}

/// What the toy ledger does with one request, and its one-line answer.
fn ledger_answer(
    kept: &Mutex<std::collections::HashMap<String, Bytes>>,
    req: &http::request::Parts,
    body: Bytes,
) -> (StatusCode, String) {
    let path = req.uri.path().to_owned();
    let token = match req.headers.get("fencing-token").map(|v| v.to_str()) {
        Some(Ok(token)) => format!(" fencing-token={token}"),
        Some(Err(_)) => " fencing-token=(not text)".to_owned(),
        None => String::new(),
    };
    let method = &req.method;
    let mut kept = kept.locked();
    match *method {
        Method::PUT | Method::POST | Method::PATCH => {
            kept.insert(path.clone(), body);
            (StatusCode::OK, format!("applied {method} {path}{token}\n"))
        }
        Method::DELETE => match kept.remove(&path) {
            Some(_) => (StatusCode::OK, format!("applied {method} {path}{token}\n")),
            None => (
                StatusCode::NOT_FOUND,
                format!("nothing stored at {path}{token}\n"),
            ),
        },
        Method::GET | Method::HEAD => match kept.get(&path) {
            Some(stored) => (
                StatusCode::OK,
                format!(
                    "read {method} {path}{token}: {}\n",
                    String::from_utf8_lossy(stored)
                ),
            ),
            None => (
                StatusCode::NOT_FOUND,
                format!("nothing stored at {path}{token}\n"),
            ),
        },
        _ => (
            StatusCode::METHOD_NOT_ALLOWED,
            format!("the toy ledger takes GET, HEAD, PUT, POST, PATCH and DELETE, not {method}\n"),
        ),
    }
}

/// The ledger's view of account 42: (balance, token of the last write) per applied write.
type Ledger = Arc<Mutex<Vec<(String, String)>>>;

pub async fn run() -> ExitCode {
    if let Err(e) = scenario().await {
        eprintln!("demo failed: {e}");
        return ExitCode::from(1);
    }
    match act_two().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo failed: {e}");
            ExitCode::from(1)
        }
    }
}

async fn scenario() -> Result<(), String> {
    let t = Timeline(Instant::now());
    println!("fencegate demo: a paused worker's late write, refused\n");

    let ledger: Ledger = Arc::default();
    let ledger_addr = start_ledger(Arc::clone(&ledger)).await?;
    t.say(
        "ledger",
        format!("toy ledger on {ledger_addr}; it applies every write it receives"),
    );

    let fencegate = start_fence(ledger_addr).await?;
    t.say(
        "fencegate",
        format!(
            "fencing writes to /accounts/{{id}} on {} -> ledger",
            fencegate.listen
        ),
    );

    let locks = Locks {
        state: Mutex::new((32, None)),
    };
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let put = |token: u64, balance: u32| {
        put_balance(client.clone(), fencegate.listen, Some(token), balance)
    };

    let t1 = locks
        .try_acquire("worker-1")
        .ok_or("lease should be free")?;
    t.say(
        "locks",
        format!("lease on account:42 granted to worker-1, fencing token {t1}"),
    );
    let (status, _) = put(t1, 100).await?;
    t.say(
        "worker-1",
        format!("PUT /accounts/42 balance=100 token={t1} -> {status}"),
    );
    t.say(
        "worker-1",
        format!("stalls (a long GC pause); its {LEASE_TTL:?} lease runs out"),
    );

    let t2 = loop {
        if let Some(token) = locks.try_acquire("worker-2") {
            break token;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    t.say(
        "locks",
        format!("lease expired; granted to worker-2, fencing token {t2}"),
    );
    let (status, _) = put(t2, 150).await?;
    t.say(
        "worker-2",
        format!("PUT /accounts/42 balance=150 token={t2} -> {status}"),
    );

    t.say("worker-1", "wakes up, still believes it holds the lease");
    let (status, body) = put(t1, 90).await?;
    t.say(
        "worker-1",
        format!("PUT /accounts/42 balance=90 token={t1} -> {status}"),
    );
    println!("{:>22}{body}", "");

    let applied = ledger.locked().clone();
    println!();
    for (i, (balance, token)) in applied.iter().enumerate() {
        println!("  ledger write {}: {balance} (token {token})", i + 1);
    }
    fencegate.shutdown();
    fencegate.wait().await;
    if status != StatusCode::CONFLICT || applied.len() != 2 {
        return Err("the late write was not refused".into());
    }
    println!(
        "\nThe late write never reached the ledger: balance stays 150. Without fencegate it \
         would have\nbeen overwritten with 90 by a worker that no longer held the lease."
    );
    Ok(())
}

/// fencegate with the memory store, fencing `/accounts/{id}` in front of the ledger.
async fn start_fence(ledger: std::net::SocketAddr) -> Result<Server, String> {
    let config = Config::parse(&format!(
        "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://{ledger}\n\
         store: {{ kind: memory }}\n\
         routes:\n  - {{ name: accounts, path: '/accounts/{{id}}', resource: 'account:{{id}}' }}\n"
    ))
    .map_err(|e| e.to_string())?;
    Server::start(&config).await.map_err(|e| e.to_string())
}

/// Listener settings for the demo's own loopback servers.
fn local_settings() -> ServerSettings {
    ServerSettings {
        tls: None,
        header_read: Duration::from_secs(5),
        max_header_bytes: 16 * 1024,
        max_headers: 100,
        max_connections: 64,
        drain: Duration::from_secs(1),
    }
}

async fn start_ledger(ledger: Ledger) -> Result<std::net::SocketAddr, String> {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let settings = local_settings();
    tokio::spawn(serve(
        listener,
        settings,
        move |req: Request<hyper::body::Incoming>, _| {
            let ledger = Arc::clone(&ledger);
            async move {
                let token = req
                    .headers()
                    .get("fencing-token")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("-")
                    .to_owned();
                let body = req.into_body().collect().await.map(|b| b.to_bytes());
                let body = body.unwrap_or_default();
                ledger
                    .locked()
                    .push((String::from_utf8_lossy(&body).into_owned(), token));
                Ok(Response::new(ProxyBody::local("applied\n")))
            }
        },
        std::future::pending(),
    ));
    Ok(addr)
}

/// `PUT /accounts/42 {"balance": N}`, with a token or (through a sidecar) without.
async fn put_balance(
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    addr: std::net::SocketAddr,
    token: Option<u64>,
    balance: u32,
) -> Result<(StatusCode, String), String> {
    let mut req = Request::builder()
        .method(Method::PUT)
        .uri(format!("http://{addr}/accounts/42"))
        .header("content-type", "application/json");
    if let Some(token) = token {
        req = req.header("fencing-token", token);
    }
    let req = req
        .body(Full::new(Bytes::from(format!("{{\"balance\":{balance}}}"))))
        .expect("valid request");
    let resp = client.request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?;
    Ok((
        status,
        String::from_utf8_lossy(&body.to_bytes()).into_owned(),
    ))
}

/// A lock service link that can be cut, as a network partition would.
struct Link {
    inner: Arc<dyn LeaseBackend>,
    cut: std::sync::atomic::AtomicBool,
}

impl LeaseBackend for Link {
    fn try_acquire<'a>(
        &'a self,
        resource: &'a str,
        holder: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LeaseError>> {
        match self.check() {
            Ok(()) => self.inner.try_acquire(resource, holder, ttl),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        }
    }
    fn renew<'a>(
        &'a self,
        grant: &'a Grant,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, LeaseError>> {
        match self.check() {
            Ok(()) => self.inner.renew(grant, ttl),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        }
    }
    fn release<'a>(&'a self, grant: &'a Grant) -> BoxFuture<'a, Result<bool, LeaseError>> {
        self.inner.release(grant)
    }
    fn latest_token<'a>(
        &'a self,
        resource: &'a str,
    ) -> BoxFuture<'a, Result<Option<Token>, LeaseError>> {
        self.inner.latest_token(resource)
    }
    fn changed<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, ()> {
        self.inner.changed(resource)
    }
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
}

impl Link {
    fn check(&self) -> Result<(), LeaseError> {
        if self.cut.load(std::sync::atomic::Ordering::SeqCst) {
            Err(LeaseError::unreachable("network partition"))
        } else {
            Ok(())
        }
    }
}

/// Act two: real leases. Each worker's sidecar acquires through the lease API, renews, and
/// attaches the token to the worker's writes (egress); the workers never see a token. Worker
/// 1's sidecar is cut off from the lock service: it declares the lease lost at its local
/// deadline and refuses worker 1's late write itself.
async fn act_two() -> Result<(), String> {
    let t = Timeline(Instant::now());
    println!(
        "\nAct two: the same story with real leases (embedded lock service, lease API, egress)\n"
    );
    let dir = std::env::temp_dir().join(format!("fencegate-demo-{}", std::process::id()));
    let ledger: Ledger = Arc::default();
    let ledger_addr = start_ledger(Arc::clone(&ledger)).await?;
    let fence = start_fence(ledger_addr).await?;
    t.say(
        "fencegate",
        format!("fence in front of the ledger on {}", fence.listen),
    );

    // One lock service, two sidecars (one per worker pod), each with its own link to it.
    let sidecar_config = Config::parse(&format!(
        "upstream: http://127.0.0.1:1\nstore: {{ kind: memory }}\n\
         leases:\n  backend: {{ kind: embedded, path: {} }}\n  ttl: 600ms\n\
         egress:\n  listen: 127.0.0.1:0\n  upstream: http://{}\n  \
         routes: [{{ path: '/accounts/{{id}}', lease: 'account:{{id}}' }}]\n",
        dir.join("leases.db").display(),
        fence.listen
    ))
    .map_err(|e| e.to_string())?;
    let leases = sidecar_config.leases.clone().ok_or("leases section")?;
    let lock_service = crate::lease::open(&leases.backend)
        .await
        .map_err(|e| e.to_string())?;
    let metrics = Arc::new(
        crate::metrics::Metrics::new(prometheus::Registry::new()).map_err(|e| e.to_string())?,
    );
    let mut sidecars = Vec::new();
    for _ in 0..2 {
        let link = Arc::new(Link {
            inner: Arc::clone(&lock_service),
            cut: std::sync::atomic::AtomicBool::new(false),
        });
        let agent = Agent::new(
            link.clone(),
            leases.ttl.clone(),
            leases.acquire.clone(),
            Arc::clone(&metrics),
        );
        let egress = sidecar_config.egress.as_ref().ok_or("egress section")?;
        let proxy = Proxy::egress(
            &sidecar_config,
            egress,
            Arc::clone(&agent),
            Arc::clone(&metrics),
        )
        .map_err(|e| e.to_string())?;
        let proxy = Arc::new(proxy);
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| e.to_string())?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        tokio::spawn(serve(
            listener,
            local_settings(),
            move |req, peer| Arc::clone(&proxy).handle(req, peer),
            std::future::pending(),
        ));
        sidecars.push((agent, link, addr));
    }
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    // The workers send no token: their sidecars attach the lease's.
    let write = |addr, balance| put_balance(client.clone(), addr, None, balance);
    let (w1, link1, addr1) = &sidecars[0];
    let (w2, _, addr2) = &sidecars[1];

    let lease1 = w1
        .acquire("account:42", "worker-1", None, Duration::ZERO)
        .await
        .map_err(|e| format!("{e:?}"))?;
    t.say(
        "sidecar-1",
        format!(
            "lease on account:42 for worker-1, fencing token {}, renewed every {}ms",
            lease1.grant.token,
            (lease1.ttl / 3).as_millis()
        ),
    );
    let (status, _) = write(*addr1, 100).await?;
    t.say(
        "worker-1",
        format!(
            "PUT /accounts/42 balance=100 (no token; sidecar attaches {}) -> {status}",
            lease1.grant.token
        ),
    );

    link1.cut.store(true, std::sync::atomic::Ordering::SeqCst);
    t.say(
        "network",
        "sidecar-1 is cut off from the lock service; worker-1 carries on",
    );
    let lease2 = w2
        .acquire("account:42", "worker-2", None, Duration::from_secs(10))
        .await
        .map_err(|e| format!("{e:?}"))?;
    t.say(
        "sidecar-2",
        format!(
            "lease expired at the lock service; granted to worker-2, fencing token {}",
            lease2.grant.token
        ),
    );
    t.say(
        "sidecar-1",
        format!(
            "lease declared lost at its local deadline (state: {})",
            lease1.state().as_str()
        ),
    );
    let (status, _) = write(*addr2, 150).await?;
    t.say(
        "worker-2",
        format!(
            "PUT /accounts/42 balance=150 (sidecar attaches {}) -> {status}",
            lease2.grant.token
        ),
    );
    let (late, body) = write(*addr1, 90).await?;
    t.say(
        "worker-1",
        format!("PUT /accounts/42 balance=90 -> {late} from its own sidecar"),
    );
    println!("{:>22}{body}", "");

    // Had it gone around its sidecar with the old token, the fence would still refuse it.
    let (bypassed, _) = put_balance(
        client.clone(),
        fence.listen,
        Some(lease1.grant.token.get()),
        90,
    )
    .await?;
    t.say(
        "worker-1",
        format!(
            "same write sent straight to the fence with token {} -> {bypassed}",
            lease1.grant.token
        ),
    );

    let applied = ledger.locked().clone();
    println!();
    for (i, (balance, token)) in applied.iter().enumerate() {
        println!("  ledger write {}: {balance} (token {token})", i + 1);
    }
    fence.shutdown();
    fence.wait().await;
    let _ = std::fs::remove_dir_all(&dir);
    if late != StatusCode::SERVICE_UNAVAILABLE
        || bypassed != StatusCode::CONFLICT
        || applied.len() != 2
    {
        return Err("the late write was not refused".into());
    }
    println!(
        "\nWorker 1 never handled a token and never learnt it lost the lease; its sidecar did, and\n\
         kept the late write off the wire."
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_toy_ledger_says_what_it_did_and_which_token_it_got() {
        let kept = Mutex::default();
        let ask = |method: Method, token: Option<&str>, body: &'static str| {
            let mut req = Request::builder().method(method).uri("/accounts/42");
            if let Some(token) = token {
                req = req.header("fencing-token", token);
            }
            let (parts, ()) = req.body(()).unwrap().into_parts();
            let (status, text) = ledger_answer(&kept, &parts, Bytes::from_static(body.as_bytes()));
            (status.as_u16(), text)
        };
        assert_eq!(
            ask(Method::GET, None, ""),
            (404, "nothing stored at /accounts/42\n".into())
        );
        assert_eq!(
            ask(Method::PUT, Some("34"), r#"{"balance":150}"#),
            (200, "applied PUT /accounts/42 fencing-token=34\n".into())
        );
        assert_eq!(
            ask(Method::GET, None, ""),
            (200, "read GET /accounts/42: {\"balance\":150}\n".into())
        );
        assert_eq!(
            ask(Method::DELETE, None, ""),
            (200, "applied DELETE /accounts/42\n".into())
        );
        assert_eq!(ask(Method::OPTIONS, None, "").0, 405);
    }
}
