//! Hostile input against the running proxy. Every refused case asserts its exact status,
//! that nothing reached the upstream and that the store is unchanged; the cases fencegate
//! accepts (or forwards unfenced) assert exactly what the upstream received, and say why.
//!
//! By what the input attacks: [`tokens`] (token and other header grammar, method overrides),
//! [`paths`] (paths, hosts and resource ids), [`framing`] (request framing and header limits),
//! [`slow`] (slow or abandoned clients), [`h2`] (HTTP/2 frames written by hand).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::*;

/// A request line + headers for `PUT /accounts/1` (plus `extra` header lines), no body.
fn put_with(extra: &str) -> String {
    format!("PUT /accounts/1 HTTP/1.1\r\nHost: x\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n")
}

fn status_of(resp: &str) -> u16 {
    resp.get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {resp:?}"))
}

/// Sends each raw request, asserts its status (and problem type when fencegate answered),
/// then that the upstream saw nothing and `account:1` has no recorded token.
async fn refused_raw(
    fg: &fencegate::app::Server,
    up: &Upstream,
    cases: &[(&str, String, u16, Option<&str>)],
) {
    for (what, request, status, kind) in cases {
        let resp = raw(fg.listen, request.as_bytes()).await;
        assert_eq!(status_of(&resp), *status, "{what}: {resp}");
        if let Some(kind) = kind {
            assert!(resp.contains(kind), "{what}: expected {kind}: {resp}");
        }
        assert_eq!(up.count(), 0, "{what} reached the upstream");
        assert_eq!(
            recorded(fg, "account:1").await,
            None,
            "{what} changed the store"
        );
    }
}

/// Reads until the server closes the connection, bounded; returns what it sent and when.
async fn read_until_closed(stream: &mut TcpStream, within: Duration) -> (Vec<u8>, Duration) {
    let started = Instant::now();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let read = tokio::time::timeout_at(
            tokio::time::Instant::from_std(started + within),
            stream.read(&mut buf),
        )
        .await
        .unwrap_or_else(|_| panic!("connection still open after {within:?}"));
        match read {
            Ok(0) | Err(_) => return (out, started.elapsed()),
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
}

mod framing;
mod h2;
mod paths;
mod received;
mod slow;
mod tokens;
