//! The proxy half: header surgery, streaming both ways, upstream failures, limits, barrier.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::common::*;

#[tokio::test]
async fn hop_by_hop_headers_are_stripped_and_forwarding_headers_set() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let reply = send(
        "PUT",
        &format!("http://{}/accounts/1", fg.listen),
        &[
            ("fencing-token", "4"),
            ("host", "ledger.example"),
            ("connection", "x-drop-me"),
            ("x-drop-me", "secret"),
            ("keep-alive", "timeout=1"),
            ("te", "trailers"),
            ("proxy-authorization", "Basic Zm9vOmJhcg=="),
            ("x-forwarded-for", "10.1.1.1"),
            ("x-keep-me", "yes"),
        ],
        "body",
    )
    .await;
    assert_eq!(reply.status, 200);
    // The upstream's own hop-by-hop header does not reach the client either.
    assert!(reply.headers.get("keep-alive").is_none());
    assert_eq!(reply.headers["x-upstream"], "yes");
    assert_eq!(reply.text(), "ok");

    let seen = &up.seen()[0];
    for gone in [
        "x-drop-me",
        "keep-alive",
        "te",
        "proxy-authorization",
        "upgrade",
    ] {
        assert!(seen.headers.get(gone).is_none(), "{gone} was forwarded");
    }
    assert_eq!(seen.headers["x-keep-me"], "yes");
    assert_eq!(seen.headers["fencing-token"], "4");
    assert_eq!(seen.headers["x-forwarded-for"], "10.1.1.1, 127.0.0.1");
    assert_eq!(seen.headers["x-forwarded-proto"], "http");
    assert_eq!(seen.headers["x-forwarded-host"], "ledger.example");
    assert_eq!(seen.headers["host"], up.addr.to_string());
    assert_eq!(seen.body, "body");
}

#[tokio::test]
async fn upstream_down_is_502_and_the_raise_stays() {
    // A port with nothing listening: bound but never listened on, and held for the whole test,
    // so no other test can take it in between.
    let reserved = tokio::net::TcpSocket::new_v4().unwrap();
    reserved.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = reserved.local_addr().unwrap();
    let fg = fencegate(&format!("http://{addr}"), ACCOUNTS).await;
    let reply = put(&fg, "1", "8").await;
    let body = reply.assert_problem(502, "urn:fencegate:upstream-error");
    assert_eq!(body["resource"], "account:1");
    assert_eq!(body["token"], 8);
    // Never lowered: the admitted token stays recorded although the write failed.
    assert_eq!(recorded(&fg, "account:1").await, Some(8));
    put(&fg, "1", "7")
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
}

#[tokio::test]
async fn slow_upstream_is_504() {
    let up = Upstream::gated().await;
    let fg = fencegate(
        &up.url(),
        &format!("timeouts: {{ upstream: 200ms }}\n{ACCOUNTS}"),
    )
    .await;
    let reply = put(&fg, "1", "3").await;
    let body = reply.assert_problem(504, "urn:fencegate:upstream-timeout");
    assert_eq!(
        body["detail"],
        "the upstream sent no response headers within timeouts.upstream (200ms); the request \
         may or may not have been applied"
    );
    // It did reach the upstream (which may commit it): the token stays recorded.
    assert_eq!(up.arrival().await.token(), Some(3));
    assert_eq!(recorded(&fg, "account:3").await, None);
    assert_eq!(recorded(&fg, "account:1").await, Some(3));
    up.release(1);
}

#[tokio::test]
async fn oversized_headers_are_431_and_not_forwarded() {
    let up = Upstream::start().await;
    let fg = fencegate(
        &up.url(),
        &format!("limits: {{ max_header_bytes: 8192 }}\n{ACCOUNTS}"),
    )
    .await;
    let big = "a".repeat(20_000);
    let resp = raw(
        fg.listen,
        format!("PUT /accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 1\r\nX-Big: {big}\r\nContent-Length: 0\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 431"), "{resp}");
    assert_eq!(up.count(), 0);
    assert_eq!(recorded(&fg, "account:1").await, None);
}

#[tokio::test]
async fn large_bodies_pass_through_intact() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let body: Vec<u8> = (0..4 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let reply = send(
        "PUT",
        &format!("http://{}/accounts/1", fg.listen),
        &[("fencing-token", "1")],
        body.clone(),
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(up.seen()[0].body.as_ref(), body.as_slice());
}

/// A response body fed from a channel, so the test decides when each chunk exists.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|c| c.map(|b| Ok(Frame::data(b))))
    }
}

#[tokio::test]
async fn bodies_stream_both_ways() {
    // An upstream that reports each request-body chunk as it arrives and sends its response
    // body in two chunks, the second only when the test says so.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (chunk_tx, mut chunk_rx) = mpsc::unbounded_channel::<Bytes>();
    let (resp_tx, resp_rx) = mpsc::channel::<Bytes>(4);
    let resp_rx = std::sync::Mutex::new(Some(resp_rx));
    let resp_rx = std::sync::Arc::new(resp_rx);
    tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let service = service_fn(move |req: Request<Incoming>| {
            let chunk_tx = chunk_tx.clone();
            let resp_rx = resp_rx.lock().unwrap().take().unwrap();
            async move {
                let mut body = req.into_body();
                // Read the first chunk, answer headers at once, keep reading in the background.
                let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
                chunk_tx.send(first).unwrap();
                tokio::spawn(async move {
                    while let Some(Ok(frame)) = body.frame().await {
                        if let Ok(data) = frame.into_data() {
                            chunk_tx.send(data).unwrap();
                        }
                    }
                });
                Ok::<_, Infallible>(Response::new(ChannelBody(resp_rx)))
            }
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(stream), service)
            .await;
    });
    let fg = fencegate(&format!("http://{addr}"), ACCOUNTS).await;

    let mut client = TcpStream::connect(fg.listen).await.unwrap();
    client
        .write_all(b"PUT /accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        .await
        .unwrap();
    // The upstream has the first chunk while the client has not finished its body.
    assert_eq!(chunk_rx.recv().await.unwrap(), "first");
    resp_tx.send(Bytes::from_static(b"early-")).await.unwrap();
    // The client reads the response head and the first chunk while the upstream still writes.
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("early-") {
        let n = client.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"));
    client.write_all(b"6\r\nsecond\r\n0\r\n\r\n").await.unwrap();
    assert_eq!(chunk_rx.recv().await.unwrap(), "second");
    resp_tx.send(Bytes::from_static(b"late")).await.unwrap();
    drop(resp_tx);
    loop {
        let n = client.read(&mut buf).await.unwrap();
        got.extend_from_slice(&buf[..n]);
        if n == 0 || String::from_utf8_lossy(&got).ends_with("0\r\n\r\n") {
            break;
        }
    }
    assert!(String::from_utf8_lossy(&got).contains("late"));
}

#[tokio::test]
async fn serialize_barrier_times_out_with_503() {
    let up = Upstream::gated().await;
    let fg = fencegate(
        &up.url(),
        "routes:\n  - { name: a, path: '/accounts/{id}', resource: 'account:{id}', ordering: serialize, barrier_timeout: 100ms }\n",
    )
    .await;
    let first = tokio::spawn({
        let url = format!("http://{}/accounts/1", fg.listen);
        async move { send("PUT", &url, &[("fencing-token", "1")], "").await }
    });
    assert_eq!(up.arrival().await.token(), Some(1));
    // Token 2 is admitted (recorded) but must wait for token 1's write, which is held.
    let reply = put(&fg, "1", "2").await;
    let body = reply.assert_problem(503, "urn:fencegate:barrier-timeout");
    assert_eq!(reply.headers["retry-after"], "1");
    assert_eq!(body["token"], 2);
    assert_eq!(recorded(&fg, "account:1").await, Some(2));
    assert_eq!(up.count(), 1);
    up.release(1);
    assert_eq!(first.await.unwrap().status, 200);
    // Nothing in flight now: the next write goes straight through.
    up.release(1);
    assert_eq!(put(&fg, "1", "2").await.status, 200);
}

#[tokio::test]
async fn serialize_lets_a_higher_token_through_once_the_lower_finishes() {
    let up = Upstream::gated().await;
    let fg = fencegate(
        &up.url(),
        "routes:\n  - { name: a, path: '/accounts/{id}', resource: 'account:{id}', ordering: serialize, barrier_timeout: 30s }\n",
    )
    .await;
    let url = format!("http://{}/accounts/1", fg.listen);
    let first = tokio::spawn({
        let url = url.clone();
        async move { send("PUT", &url, &[("fencing-token", "1")], "").await }
    });
    assert_eq!(up.arrival().await.token(), Some(1));
    let second = tokio::spawn({
        let url = url.clone();
        async move { send("PUT", &url, &[("fencing-token", "2")], "").await }
    });
    // Token 2 is recorded, so a late token-1 write is refused even while 1 is in flight.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while recorded(&fg, "account:1").await != Some(2) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "token 2 never recorded"
        );
        tokio::task::yield_now().await;
    }
    put(&fg, "1", "1")
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(up.count(), 1, "token 2 overtook token 1");
    up.release(1);
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(up.arrival().await.token(), Some(2));
    up.release(1);
    assert_eq!(second.await.unwrap().status, 200);
}

/// A scripted upstream on raw TCP: counts the connections it accepts, answers `200 ok` to
/// every GET except `/items/slow`, which it never answers (the connection stays open).
async fn counting_upstream() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&accepted);
    tokio::spawn(async move {
        loop {
            let (mut stream, _) = listener.accept().await.unwrap();
            counter.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    let n = match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    head.extend_from_slice(&buf[..n]);
                    while let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
                        let request: Vec<u8> = head.drain(..end + 4).collect();
                        if request.starts_with(b"GET /items/slow ") {
                            std::future::pending::<()>().await;
                        }
                        let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if stream.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, accepted)
}

/// Sends one GET on `client` and reads its whole answer: (status, body).
async fn get_on(client: &mut tokio::net::TcpStream, path: &str) -> (u16, String) {
    let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n");
    client.write_all(request.as_bytes()).await.unwrap();
    let text = read_response(client).await;
    let status = text[9..12].parse().unwrap();
    let body = text.split_once("\r\n\r\n").unwrap().1.to_owned();
    (status, body)
}

/// A client connection keeps one upstream connection for its requests, one after another;
/// an exchange that timed out takes its upstream connection with it (it may still carry the
/// late answer), and the next request gets a fresh one.
#[tokio::test]
async fn a_client_connection_reuses_its_upstream_connection_until_an_exchange_times_out() {
    let (upstream, accepted) = counting_upstream().await;
    let fg = fencegate(
        &format!("http://{upstream}"),
        &format!("unmatched: forward\ntimeouts: {{ upstream: 300ms }}\n{ACCOUNTS}"),
    )
    .await;
    let mut client = tokio::net::TcpStream::connect(fg.listen).await.unwrap();
    assert_eq!(get_on(&mut client, "/items/1").await, (200, "ok".into()));
    assert_eq!(get_on(&mut client, "/items/2").await, (200, "ok".into()));
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "the second request connected anew"
    );

    let (status, body) = get_on(&mut client, "/items/slow").await;
    assert_eq!(status, 504, "{body}");
    assert!(body.contains("urn:fencegate:upstream-timeout"), "{body}");
    assert_eq!(get_on(&mut client, "/items/3").await, (200, "ok".into()));
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        2,
        "the timed-out connection was reused"
    );
}
