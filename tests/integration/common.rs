//! Test harness: a recording upstream, an in-process fencegate, and small HTTP clients.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use fencegate::app::Server;
use fencegate::body::ProxyBody;
use fencegate::config::Config;
use fencegate::server::{serve, ServerSettings};
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};

/// One request as the upstream saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: Method,
    /// Path and query exactly as received.
    pub target: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Seen {
    pub fn token(&self) -> Option<u64> {
        self.headers
            .get("fencing-token")
            .map(|v| v.to_str().unwrap().parse().unwrap())
    }
}

/// A real HTTP server that records every request it receives and answers 200 `ok`.
///
/// With a gate, each request waits for a permit before answering (`release`), and announces
/// its arrival on `arrivals`: explicit signals instead of sleeps.
pub struct Upstream {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    gate: Option<Arc<Semaphore>>,
    pub arrivals: Option<tokio::sync::Mutex<mpsc::UnboundedReceiver<Seen>>>,
}

impl Upstream {
    pub async fn start() -> Upstream {
        Self::spawn(None, None).await
    }

    /// An upstream behind a hop that removes the header `strip` from every request before the
    /// upstream sees it: a stand-in for a proxy that loses a header the fence read.
    pub async fn stripping(strip: &'static str) -> Upstream {
        Self::spawn(None, Some(strip)).await
    }

    /// Requests are held until [`Upstream::release`] hands out permits.
    pub async fn gated() -> Upstream {
        Self::spawn(Some(Arc::new(Semaphore::new(0))), None).await
    }

    async fn spawn(gate: Option<Arc<Semaphore>>, strip: Option<&'static str>) -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let (tx, rx) = mpsc::unbounded_channel();
        let handler_seen = Arc::clone(&seen);
        let handler_gate = gate.clone();
        tokio::spawn(serve(
            listener,
            settings(),
            move |req: Request<Incoming>, _| {
                let seen = Arc::clone(&handler_seen);
                let gate = handler_gate.clone();
                let tx = tx.clone();
                async move {
                    let (mut parts, body) = req.into_parts();
                    if let Some(strip) = strip {
                        parts.headers.remove(strip);
                    }
                    let body = body
                        .collect()
                        .await
                        .map(|b| b.to_bytes())
                        .unwrap_or_default();
                    let record = Seen {
                        method: parts.method,
                        target: parts
                            .uri
                            .path_and_query()
                            .map(|p| p.as_str().to_owned())
                            .unwrap_or_default(),
                        headers: parts.headers,
                        body,
                    };
                    seen.lock().unwrap().push(record.clone());
                    let _ = tx.send(record);
                    if let Some(gate) = gate {
                        gate.acquire().await.unwrap().forget();
                    }
                    let mut resp = Response::new(ProxyBody::local("ok"));
                    resp.headers_mut()
                        .insert("x-upstream", "yes".parse().unwrap());
                    resp.headers_mut()
                        .insert("keep-alive", "timeout=5".parse().unwrap());
                    Ok(resp)
                }
            },
            std::future::pending(),
        ));
        Upstream {
            addr,
            seen,
            arrivals: gate.is_some().then(|| tokio::sync::Mutex::new(rx)),
            gate,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    pub fn release(&self, n: usize) {
        self.gate.as_ref().expect("gated upstream").add_permits(n);
    }

    /// Waits for the next request to arrive (gated upstreams only).
    pub async fn arrival(&self) -> Seen {
        let mut rx = self.arrivals.as_ref().expect("gated upstream").lock().await;
        tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("no request reached the upstream within 10s")
            .unwrap()
    }
}

pub fn settings() -> ServerSettings {
    ServerSettings {
        tls: None,
        header_read: Duration::from_secs(5),
        max_header_bytes: 64 * 1024,
        max_headers: 200,
        max_connections: 1024,
        drain: Duration::from_secs(1),
    }
}

/// The default test routes: `/accounts/{id}` fenced as `account:{id}`.
pub const ACCOUNTS: &str =
    "routes:\n  - { name: accounts, path: '/accounts/{id}', resource: 'account:{id}' }\n";

/// An in-process fencegate in front of `upstream`, with the memory store unless `extra` says
/// otherwise. `extra` is appended YAML (routes, store, token, ...).
pub async fn fencegate(upstream: &str, extra: &str) -> Server {
    // A top-level `store:` line, not `timeouts: { store: … }`: without one, the default store
    // would be the embedded file under /var/lib, shared by every test and every run.
    let store = if extra.lines().any(|l| l.starts_with("store:")) {
        ""
    } else {
        "store: { kind: memory }\n"
    };
    let yaml =
        format!("listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: {upstream}\n{store}{extra}");
    let config = Config::parse(&yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    Server::start(&config).await.unwrap()
}

/// A response, fully read.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.body))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Asserts a problem+json refusal with the given status and type.
    pub fn assert_problem(&self, status: u16, kind: &str) -> serde_json::Value {
        assert_eq!(self.status.as_u16(), status, "body: {}", self.text());
        assert_eq!(self.headers["content-type"], "application/problem+json");
        let body = self.json();
        assert_eq!(body["type"], kind, "{body}");
        assert_eq!(body["status"], status, "{body}");
        assert!(
            body["title"].is_string() && body["detail"].is_string(),
            "{body}"
        );
        body
    }
}

/// Sends one HTTP/1.1 request with the given headers and body.
pub async fn send(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Reply {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let mut req = Request::builder()
        .method(Method::from_bytes(method.as_bytes()).unwrap())
        .uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = client
        .request(req.body(Full::new(body.into())).unwrap())
        .await
        .unwrap();
    let (parts, body) = resp.into_parts();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

/// A fenced PUT to `/accounts/{id}` with a token.
pub async fn put(server: &Server, id: &str, token: &str) -> Reply {
    put_at(server, &format!("/accounts/{id}"), token).await
}

/// A PUT with a token to `target` (path and query) on the listener.
pub async fn put_at(server: &Server, target: &str, token: &str) -> Reply {
    send(
        "PUT",
        &format!("http://{}{target}", server.listen),
        &[("fencing-token", token)],
        format!("write with {token}"),
    )
    .await
}

/// The recorded maximum for a resource, through the admin API.
pub async fn recorded(server: &Server, resource: &str) -> Option<u64> {
    let reply = send(
        "GET",
        &format!("http://{}/v1/fences/{resource}", server.admin),
        &[],
        "",
    )
    .await;
    match reply.status {
        StatusCode::OK => Some(reply.json()["token"].as_u64().unwrap()),
        StatusCode::NOT_FOUND => None,
        other => panic!("admin answered {other}"),
    }
}

/// Writes raw bytes on a fresh connection and reads until the server closes or `limit` bytes.
pub async fn raw(addr: SocketAddr, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let read = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
            .await
            .expect("server neither answered nor closed within 10s");
        match read {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                out.extend_from_slice(&buf[..n]);
                // One response is enough; stop at the end of a Content-Length body.
                if let Some(done) = complete_response(&out) {
                    out.truncate(done);
                    break;
                }
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Reads one whole response (Content-Length body) from a connection that stays open, and
/// returns it as text; fails if the server closes or says nothing within 10 s.
pub async fn read_response(stream: &mut TcpStream) -> String {
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    let end = loop {
        if let Some(end) = complete_response(&answer) {
            break end;
        }
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
            .await
            .expect("no answer within 10s")
            .unwrap();
        assert_ne!(n, 0, "the server closed the connection");
        answer.extend_from_slice(&buf[..n]);
    };
    String::from_utf8_lossy(&answer[..end]).into_owned()
}

/// The length of the first complete response in `buf` (a Content-Length body), if it is all there.
pub fn complete_response(buf: &[u8]) -> Option<usize> {
    let text = std::str::from_utf8(buf).ok()?;
    let head_end = text.find("\r\n\r\n")? + 4;
    let length = text[..head_end].lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("content-length")
            .then(|| v.trim().parse::<usize>().ok())?
    })?;
    (buf.len() >= head_end + length).then_some(head_end + length)
}

/// `value` as a token (tests use values well inside the range).
pub fn tk(value: u64) -> fencegate::fence::Token {
    fencegate::fence::Token::new(value).expect("a test token is at most 2^63-1")
}

/// `id` as a resource id (tests use valid ones).
pub fn rid(id: &str) -> fencegate::fence::ResourceId {
    fencegate::fence::ResourceId::new(id).expect("a test resource id is valid")
}
