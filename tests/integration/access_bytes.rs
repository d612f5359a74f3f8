//! The access log's `bytes_in` and `bytes_out`: the bytes the bodies actually carried, chunked
//! or not, and what was sent before a body was cut short; none for `HEAD` and `204`.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::common::*;
use crate::process::{wait_log, Process};

/// An upstream that answers by the request's path (its id), one request per connection:
/// `chunked` with an 11-byte chunked body, `short` with 4 of the 10 bytes it declares, `head`
/// with a declared length and no body, `empty` with a 204, anything else with 2 bytes.
async fn scripted_upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            tokio::spawn(answer(conn));
        }
    });
    addr
}

async fn answer(mut conn: TcpStream) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    // The head, then the body as it says (chunked: to the last chunk).
    let head_end = loop {
        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
        match conn.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    };
    let head = String::from_utf8_lossy(&got[..head_end]).to_ascii_lowercase();
    let length = head.lines().find_map(|l| {
        l.strip_prefix("content-length:")
            .and_then(|v| v.trim().parse::<usize>().ok())
    });
    let chunked = head.contains("transfer-encoding: chunked");
    loop {
        let body = &got[head_end..];
        let done = if chunked {
            body.ends_with(b"0\r\n\r\n")
        } else {
            body.len() >= length.unwrap_or(0)
        };
        if done {
            break;
        }
        match conn.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    let path = head.split(' ').nth(1).unwrap_or("").to_owned();
    let response: &[u8] = match path.as_str() {
        "/accounts/chunked" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
        "/accounts/short" => b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\nConnection: close\r\n\r\nabcd",
        "/accounts/head" => b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\nConnection: close\r\n\r\n",
        "/accounts/empty" => b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n",
        _ => b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
    };
    let _ = conn.write_all(response).await;
    let _ = conn.shutdown().await;
}

/// Sends `request` on a fresh connection and reads until the server closes.
async fn exchange(addr: SocketAddr, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "the server did not close within 10s");
    String::from_utf8_lossy(&out).into_owned()
}

/// The next access line, as `(path, status, bytes_in, bytes_out)`.
async fn next_access(p: &mut Process) -> (String, u64, Value, Value) {
    let line = wait_log(&mut p.logs, "request").await;
    assert_eq!(line["target"], "fencegate::access", "{line}");
    (
        line["path"].as_str().unwrap().to_owned(),
        line["status"].as_u64().unwrap(),
        line["bytes_in"].clone(),
        line["bytes_out"].clone(),
    )
}

#[tokio::test]
async fn access_lines_count_the_bytes_the_bodies_actually_carried() {
    let upstream = scripted_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fencegate.yaml");
    std::fs::write(
        &config,
        format!(
            "access_log: true\nlisten: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://{upstream}\nstore: {{ kind: memory }}\n{ACCOUNTS}"
        ),
    )
    .unwrap();
    let mut p = Process::start(&config).await;
    let at = |path: &str| (path.to_owned(), 200, Value::from(0u64), Value::from(0u64));

    // A chunked upload (3 + 4 bytes) answered by a chunked body (5 + 6 bytes).
    let answer = exchange(
        p.proxy,
        b"PUT /accounts/chunked HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer.contains("hello\r\n") && answer.contains(" world\r\n"),
        "{answer}"
    );
    let mut want = at("/accounts/chunked");
    (want.2, want.3) = (7.into(), 11.into());
    assert_eq!(next_access(&mut p).await, want);

    // A declared length, as sent.
    exchange(
        p.proxy,
        b"PUT /accounts/plain HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello",
    )
    .await;
    let mut want = at("/accounts/plain");
    (want.2, want.3) = (5.into(), 2.into());
    assert_eq!(next_access(&mut p).await, want);

    // The upstream's body cut short after 4 of its 10 bytes: the 4 that were sent.
    let answer = exchange(
        p.proxy,
        b"GET /accounts/short HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.ends_with("abcd"), "{answer}");
    let mut want = at("/accounts/short");
    want.3 = 4.into();
    assert_eq!(next_access(&mut p).await, want);

    // The client's body cut short after 4 of its 10 bytes: the 4 that were read, and the
    // refusal that could not be delivered.
    let mut stream = TcpStream::connect(p.proxy).await.unwrap();
    stream
        .write_all(b"PUT /accounts/cut HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\nContent-Length: 10\r\n\r\nabcd")
        .await
        .unwrap();
    stream.shutdown().await.unwrap();
    let line = wait_log(&mut p.logs, "request").await;
    assert_eq!(
        (
            &line["path"],
            &line["status"],
            &line["refusal"],
            &line["bytes_in"]
        ),
        (
            &Value::from("/accounts/cut"),
            &Value::from(400),
            &Value::from("invalid-request"),
            &Value::from(4)
        ),
        "{line}"
    );
    drop(stream);

    // HEAD: a declared length, no body.
    let answer = exchange(
        p.proxy,
        b"HEAD /accounts/head HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.contains("content-length: 10"), "{answer}");
    assert_eq!(next_access(&mut p).await, at("/accounts/head"));

    // 204: no body.
    let answer = exchange(
        p.proxy,
        b"DELETE /accounts/empty HTTP/1.1\r\nHost: a\r\nFencing-Token: 1\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 204"), "{answer}");
    let mut want = at("/accounts/empty");
    want.1 = 204;
    assert_eq!(next_access(&mut p).await, want);
}
