//! The upstream connection a client connection keeps: sequential requests of one HTTP/1
//! client connection share one upstream connection, and an upstream that closes it is
//! reconnected to before the next request, never after sending.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use fencegate::body::ProxyBody;
use fencegate::server::serve;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::common::*;

/// An upstream that records the peer (fencegate's upstream connection) of every request, and
/// optionally closes each connection after answering.
async fn peers_upstream(close: bool) -> (SocketAddr, Arc<Mutex<Vec<SocketAddr>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let peers: Arc<Mutex<Vec<SocketAddr>>> = Arc::default();
    let seen = Arc::clone(&peers);
    tokio::spawn(serve(
        listener,
        settings(),
        move |_req: Request<Incoming>, peer| {
            seen.lock().unwrap().push(peer);
            async move {
                let mut resp = Response::new(ProxyBody::local("ok"));
                if close {
                    resp.headers_mut()
                        .insert("connection", "close".parse().unwrap());
                }
                Ok(resp)
            }
        },
        std::future::pending(),
    ));
    (addr, peers)
}

/// Sends `n` PUTs with tokens from `first` on one keep-alive connection, reading each
/// response before the next.
async fn puts_on_one_connection(proxy: SocketAddr, first: usize, n: usize) -> Vec<String> {
    let mut stream = TcpStream::connect(proxy).await.unwrap();
    let mut replies = Vec::new();
    for token in first..first + n {
        let req = format!(
            "PUT /accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: {token}\r\nContent-Length: 0\r\n\r\n"
        );
        stream.write_all(req.as_bytes()).await.unwrap();
        let mut buf = Vec::new();
        let mut chunk = [0u8; 1024];
        // The reply is small: read until its body ("ok") has arrived.
        while !buf.ends_with(b"ok") {
            let read = stream.read(&mut chunk).await.unwrap();
            assert!(
                read > 0,
                "connection closed after {} replies",
                replies.len()
            );
            buf.extend_from_slice(&chunk[..read]);
        }
        replies.push(String::from_utf8_lossy(&buf).into_owned());
    }
    replies
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_connection_uses_one_upstream_connection() {
    let (up, peers) = peers_upstream(false).await;
    let fg = fencegate(&format!("http://{up}"), ACCOUNTS).await;
    let replies = puts_on_one_connection(fg.listen, 1, 5).await;
    assert!(
        replies.iter().all(|r| r.starts_with("HTTP/1.1 200")),
        "{replies:?}"
    );
    let peers = peers.lock().unwrap().clone();
    assert_eq!(peers.len(), 5);
    assert!(peers.iter().all(|p| *p == peers[0]), "{peers:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_client_connections_use_two_upstream_connections() {
    let (up, peers) = peers_upstream(false).await;
    let fg = fencegate(&format!("http://{up}"), ACCOUNTS).await;
    let _ = puts_on_one_connection(fg.listen, 1, 2).await;
    let _ = puts_on_one_connection(fg.listen, 3, 2).await;
    let peers = peers.lock().unwrap().clone();
    assert_eq!(peers.len(), 4);
    assert_eq!(peers[0], peers[1]);
    assert_eq!(peers[2], peers[3]);
    assert_ne!(peers[0], peers[2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_closes_is_reconnected_to_before_the_next_request() {
    let (up, peers) = peers_upstream(true).await;
    let fg = fencegate(&format!("http://{up}"), ACCOUNTS).await;
    let replies = puts_on_one_connection(fg.listen, 1, 4).await;
    assert!(
        replies.iter().all(|r| r.starts_with("HTTP/1.1 200")),
        "{replies:?}"
    );
    let peers = peers.lock().unwrap().clone();
    assert_eq!(
        peers.len(),
        4,
        "each request reached the upstream exactly once"
    );
    let mut distinct = peers.clone();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        4,
        "a closed connection was reused: {peers:?}"
    );
    assert_eq!(recorded(&fg, "account:1").await, Some(4));
}

/// An exchange given up by the upstream timeout takes its connection with it: the client's
/// next request reaches the upstream on a fresh connection instead of queueing behind the
/// request that never got its answer. The one upstream timer a client connection keeps is
/// re-armed for each request: the held write gets its full timeout from its own start (504),
/// and the write after it is answered, not refused at once by the expired timer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_exchange_does_not_hold_up_the_next_request() {
    let up = Upstream::gated().await;
    let limit = Duration::from_millis(300);
    let fg = fencegate(
        &up.url(),
        &format!("timeouts: {{ upstream: 300ms }}\n{ACCOUNTS}"),
    )
    .await;
    let stream = TcpStream::connect(fg.listen).await.unwrap();
    let (mut client, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(connection);
    let write = |token: &str| {
        Request::put("/accounts/1")
            .header("host", "ledger.example")
            .header("fencing-token", token)
            .body(http_body_util::Full::new(Bytes::from(format!(
                "with {token}"
            ))))
            .unwrap()
    };
    let mut statuses = Vec::new();
    up.release(1);
    client.ready().await.unwrap();
    let first = client.send_request(write("1")).await.unwrap();
    statuses.push(first.status().as_u16());
    assert_eq!(first.into_body().collect().await.unwrap().to_bytes(), "ok");
    assert_eq!(up.arrival().await.token(), Some(1));

    let started = tokio::time::Instant::now();
    client.ready().await.unwrap();
    let held = client.send_request(write("2")).await.unwrap();
    let waited = started.elapsed();
    statuses.push(held.status().as_u16());
    let body: serde_json::Value =
        serde_json::from_slice(&held.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(body["type"], "urn:fencegate:upstream-timeout", "{body}");
    assert!(
        waited >= limit,
        "answered after {waited:?}, before the limit"
    );
    assert_eq!(up.arrival().await.token(), Some(2));

    // The held exchange's permit and the next one's.
    up.release(2);
    // Waits until the connection is idle again: sending before that is the client's own
    // "connection was not ready" error, not the server's.
    client.ready().await.unwrap();
    let third = client.send_request(write("3")).await.unwrap();
    statuses.push(third.status().as_u16());
    assert_eq!(third.into_body().collect().await.unwrap().to_bytes(), "ok");
    assert_eq!(statuses, [200, 504, 200]);
    assert_eq!(up.arrival().await.token(), Some(3));
    assert_eq!(recorded(&fg, "account:1").await, Some(3));
}
