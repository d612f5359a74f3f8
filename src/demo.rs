//! `fencegate demo`: the slow-writer scenario, end to end, in one process.
//!
//! A toy ledger (which trusts every write it gets), fencegate in front of it with the memory
//! store, a toy lock service with a short TTL, and two workers. Worker 1 writes with token 33
//! and stalls past its lease; worker 2 gets the lease with token 34 and writes; worker 1 wakes
//! up and writes again with token 33, and fencegate refuses it with 409.

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
use crate::config::Config;
use crate::proxy::body::ProxyBody;
use crate::server::{serve, ServerSettings};

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
        let mut state = self.state.lock().expect("demo lock");
        let free = state.1.is_none_or(|(_, expires)| expires <= Instant::now());
        free.then(|| {
            state.0 += 1;
            state.1 = Some((who, Instant::now() + LEASE_TTL));
            state.0
        })
    }
}

/// The ledger's view of account 42: (balance, token of the last write) per applied write.
type Ledger = Arc<Mutex<Vec<(String, String)>>>;

pub async fn run() -> ExitCode {
    match scenario().await {
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

    let config = Config::parse(&format!(
        "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://{ledger_addr}\n\
         store: {{ kind: memory }}\n\
         routes:\n  - {{ name: accounts, path: '/accounts/{{id}}', resource: 'account:{{id}}' }}\n"
    ))?;
    let fencegate = Server::start(&config).await?;
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
        let req = Request::builder()
            .method(Method::PUT)
            .uri(format!("http://{}/accounts/42", fencegate.listen))
            .header("fencing-token", token)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(format!("{{\"balance\":{balance}}}"))))
            .expect("valid request");
        let client = client.clone();
        async move {
            let resp = client.request(req).await.map_err(|e| e.to_string())?;
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>((
                status,
                String::from_utf8_lossy(&body.to_bytes()).into_owned(),
            ))
        }
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

    let applied = ledger.lock().expect("demo lock").clone();
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

async fn start_ledger(ledger: Ledger) -> Result<std::net::SocketAddr, String> {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let settings = ServerSettings {
        tls: None,
        header_read: Duration::from_secs(5),
        max_header_bytes: 16 * 1024,
        max_headers: 100,
        max_connections: 64,
        drain: Duration::from_secs(1),
    };
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
                    .lock()
                    .expect("demo lock")
                    .push((String::from_utf8_lossy(&body).into_owned(), token));
                Ok(Response::new(ProxyBody::local("applied\n")))
            }
        },
        std::future::pending(),
    ));
    Ok(addr)
}
