//! Hostile input against the running proxy. Every refused case asserts its exact status,
//! that nothing reached the upstream and that the store is unchanged; the cases fencegate
//! accepts (or forwards unfenced) assert exactly what the upstream received, and say why.

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

#[tokio::test]
async fn token_grammar_variants_are_400() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let bad = [
        "+5",
        "05",
        "00",
        "-0",
        "-1",
        "1e3",
        "0x10",
        "0b1",
        "5.0",
        "5 5",
        "5,6",
        "5;q=1",
        "1_000",
        "１",
        "\u{0665}",
        "9223372036854775808",
        "18446744073709551616",
        "99999999999999999999999",
        "\"5\"",
        "5\t6",
    ];
    let mut cases: Vec<(&str, String, u16, Option<&str>)> = bad
        .iter()
        .map(|t| {
            (
                *t,
                put_with(&format!("Fencing-Token: {t}\r\n")),
                400,
                Some("urn:fencegate:invalid-token"),
            )
        })
        .collect();
    cases.push((
        "empty value",
        put_with("Fencing-Token:\r\n"),
        400,
        Some("urn:fencegate:invalid-token"),
    ));
    refused_raw(&fg, &up, &cases).await;
    // Optional whitespace around the value is not part of it (RFC 9110 §5.5): accepted.
    let resp = raw(fg.listen, put_with("Fencing-Token: \t7\t \r\n").as_bytes()).await;
    assert_eq!(status_of(&resp), 200, "{resp}");
    assert_eq!(up.seen()[0].token(), Some(7));
}

#[tokio::test]
async fn duplicate_and_aliased_token_headers_are_400() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let invalid = Some("urn:fencegate:invalid-token");
    let cases = [
        (
            "same value twice",
            put_with("Fencing-Token: 5\r\nFencing-Token: 5\r\n"),
            400,
            invalid,
        ),
        (
            "two values",
            put_with("Fencing-Token: 5\r\nFencing-Token: 9\r\n"),
            400,
            invalid,
        ),
        (
            "case-different spellings are one name, so a duplicate",
            put_with("FENCING-TOKEN: 5\r\nfencing-token: 9\r\n"),
            400,
            invalid,
        ),
        (
            "underscore alias alone",
            put_with("Fencing_Token: 5\r\n"),
            400,
            invalid,
        ),
        (
            "underscore alias beside the real one",
            put_with("Fencing-Token: 9\r\nfencing_token: 5\r\n"),
            400,
            invalid,
        ),
        (
            "partial underscore alias",
            put_with("Fencing-Token: 9\r\nFENCING_token: 5\r\n"),
            400,
            invalid,
        ),
        // Not the token header at all: a fenced write without a token.
        (
            "dotted look-alike",
            put_with("Fencing.Token: 5\r\n"),
            428,
            Some("urn:fencegate:token-required"),
        ),
        // Whitespace before the colon is a malformed field line: hyper refuses the request.
        (
            "space before the colon",
            put_with("Fencing-Token : 5\r\n"),
            400,
            None,
        ),
    ];
    refused_raw(&fg, &up, &cases).await;
}

#[tokio::test]
async fn connection_header_tricks() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let invalid = Some("urn:fencegate:invalid-token");
    // Naming the token header would strip it at the next hop: refused, whatever the spelling.
    let request = |connection: &str| {
        format!("PUT /accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 5\r\nConnection: {connection}\r\nContent-Length: 0\r\n\r\n")
    };
    let cases = [
        ("alone", request("fencing-token"), 400, invalid),
        (
            "close, fencing-token",
            request("close, fencing-token"),
            400,
            invalid,
        ),
        (
            "upper case, no space",
            request("keep-alive,FENCING-TOKEN"),
            400,
            invalid,
        ),
        ("padded", request("close ,  Fencing-Token  "), 400, invalid),
    ];
    refused_raw(&fg, &up, &cases).await;
    // Two Connection lines, the second naming the token.
    let two = "PUT /accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 5\r\nConnection: keep-alive\r\nConnection: fencing-token\r\nContent-Length: 0\r\n\r\n";
    refused_raw(&fg, &up, &[("two lines", two.into(), 400, invalid)]).await;

    // Naming `Host` strips the client's Host (hop-by-hop), nothing else: the write is fenced
    // normally and the upstream gets its own authority as Host.
    let host = "PUT /accounts/1 HTTP/1.1\r\nHost: evil.example\r\nFencing-Token: 5\r\nConnection: close, Host\r\nContent-Length: 0\r\n\r\n";
    let resp = raw(fg.listen, host.as_bytes()).await;
    assert_eq!(status_of(&resp), 200, "{resp}");
    let seen = &up.seen()[0];
    assert_eq!(seen.headers["host"], up.addr.to_string());
    assert!(seen.headers.get("x-forwarded-host").is_none(), "{seen:?}");
    assert!(seen.headers.get("connection").is_none());
    assert_eq!(seen.token(), Some(5));
    assert_eq!(recorded(&fg, "account:1").await, Some(5));
}

#[tokio::test]
async fn path_confusion_resolves_to_one_resource_or_is_refused() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    // Refused before matching: no route, no store, no upstream.
    let bad_path = Some("urn:fencegate:invalid-path");
    let refused = [
        ("%2F", "/accounts%2F1", 400, bad_path),
        ("%2f inside the id", "/accounts/1%2f..%2f2", 400, bad_path),
        ("%5C", "/accounts/1%5C2", 400, bad_path),
        ("raw backslash", "/accounts\\1", 400, bad_path),
        ("%00", "/accounts/1%00", 400, bad_path),
        ("bad escape", "/accounts/%G1", 400, bad_path),
    ];
    let cases: Vec<_> = refused
        .iter()
        .map(|(what, path, status, kind)| {
            (
                *what,
                format!("PUT {path} HTTP/1.1\r\nHost: x\r\nFencing-Token: 9\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"),
                *status,
                *kind,
            )
        })
        .collect();
    refused_raw(&fg, &up, &cases).await;

    // Every other spelling of `/accounts/1` is that resource, and is forwarded as the
    // normalised path: the token rises through one spelling and is stale through the others.
    let spellings = [
        "/accounts/1",
        "/accounts/./1",
        "//accounts//1",
        "/accounts/x/../1",
        "/accounts/x/%2e%2e/1",
        "/accounts/x/%2E%2e/1",
        "/%61ccounts/%31",
        "/a/../../accounts/1",
    ];
    for (i, path) in spellings.iter().enumerate() {
        let token = 10 + i;
        let req = format!("PUT {path} HTTP/1.1\r\nHost: x\r\nFencing-Token: {token}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        let resp = raw(fg.listen, req.as_bytes()).await;
        assert_eq!(status_of(&resp), 200, "{path}: {resp}");
        assert_eq!(up.seen()[i].target, "/accounts/1", "{path}");
        let stale = format!("PUT {path} HTTP/1.1\r\nHost: x\r\nFencing-Token: {}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", token - 1);
        let resp = raw(fg.listen, stale.as_bytes()).await;
        assert_eq!(status_of(&resp), 409, "{path}: {resp}");
    }
    assert_eq!(up.count(), spellings.len());
    assert_eq!(
        recorded(&fg, "account:1").await,
        Some(10 + spellings.len() as u64 - 1)
    );
}

/// Paths are case-sensitive (RFC 3986 §6.2.2.1), and so is the router: `/Accounts/1` is not
/// the `accounts` route. With the default `unmatched: forward` it is forwarded unfenced; a
/// downstream that matches paths case-insensitively would apply it as `/accounts/1`, which is
/// a bypass. `unmatched: reject` closes it (404).
#[tokio::test]
async fn case_variants_are_another_path() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    assert_eq!(put(&fg, "1", "9").await.status, 200);
    let stale = "PUT /Accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    let resp = raw(fg.listen, stale.as_bytes()).await;
    assert_eq!(status_of(&resp), 200, "{resp}");
    assert_eq!(up.seen()[1].target, "/Accounts/1");
    assert_eq!(recorded(&fg, "account:1").await, Some(9));
    assert_eq!(recorded(&fg, "account:Accounts").await, None);

    let strict = fencegate(&up.url(), &format!("unmatched: reject\n{ACCOUNTS}")).await;
    let resp = raw(strict.listen, stale.as_bytes()).await;
    assert_eq!(status_of(&resp), 404, "{resp}");
    assert!(resp.contains("urn:fencegate:no-route"), "{resp}");
    assert_eq!(up.count(), 2);
}

/// A `;` path parameter makes a different resource id (`account:1;v=2`), forwarded as
/// `/accounts/1;v=2`. Servlet containers strip path parameters before routing, so such a
/// downstream applies the write to `/accounts/1` with a token that was checked against
/// another resource: a stale write gets through. docs/guarantees.md names `;` as a spelling fencegate
/// does not unify, but its remedies do not help: the `{id}` capture absorbs `1;v=2`, so the
/// route matches and `unmatched: reject` never applies. It should be refused like `%2F`.
#[tokio::test]
async fn path_parameters_do_not_open_a_second_resource() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    assert_eq!(put(&fg, "1", "9").await.status, 200);
    let stale = "PUT /accounts/1;v=2 HTTP/1.1\r\nHost: x\r\nFencing-Token: 1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    let resp = raw(fg.listen, stale.as_bytes()).await;
    assert_eq!(status_of(&resp), 400, "{resp}");
    assert!(resp.contains("urn:fencegate:invalid-path"), "{resp}");
    assert_eq!(up.count(), 1);
}

/// The absolute form (`PUT http://other.example/accounts/1`) carries another authority. The
/// resource comes from the path, the upstream gets its own authority as Host, and the
/// request is forwarded in origin form.
#[tokio::test]
async fn absolute_form_targets_take_the_resource_from_the_path() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let req = "PUT http://other.example/accounts/1 HTTP/1.1\r\nHost: other.example\r\nFencing-Token: 4\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    let resp = raw(fg.listen, req.as_bytes()).await;
    assert_eq!(status_of(&resp), 200, "{resp}");
    let seen = &up.seen()[0];
    assert_eq!(seen.target, "/accounts/1");
    assert_eq!(seen.headers["host"], up.addr.to_string());
    assert_eq!(seen.headers["x-forwarded-host"], "other.example");
    assert_eq!(recorded(&fg, "account:1").await, Some(4));
    // Stale through the absolute form too.
    let stale = req.replace("Fencing-Token: 4", "Fencing-Token: 3");
    assert_eq!(status_of(&raw(fg.listen, stale.as_bytes()).await), 409);
    assert_eq!(up.count(), 1);
}

/// RFC 9112 §3.2.2: with an absolute-form target the Host header is ignored and the target's
/// authority is the one `X-Forwarded-Host` reports.
#[tokio::test]
async fn absolute_form_authority_wins_over_the_host_header() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let req = "PUT http://other.example/accounts/1 HTTP/1.1\r\nHost: tenant-b.example\r\nFencing-Token: 4\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    assert_eq!(status_of(&raw(fg.listen, req.as_bytes()).await), 200);
    assert_eq!(up.seen()[0].headers["x-forwarded-host"], "other.example");
}

#[tokio::test]
async fn request_smuggling_forms_are_400_and_never_forwarded() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let head = "PUT /accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 5\r\n";
    let cases = [
        (
            "two different CL",
            format!("{head}Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!"),
        ),
        (
            "CL list with different values",
            format!("{head}Content-Length: 5, 6\r\n\r\nhello!"),
        ),
        ("signed CL", format!("{head}Content-Length: +5\r\n\r\nhello")),
        ("hex CL", format!("{head}Content-Length: 0x5\r\n\r\nhello")),
        (
            "TE chunked, identity",
            format!("{head}Transfer-Encoding: chunked, identity\r\n\r\n5\r\nhello\r\n0\r\n\r\n"),
        ),
        (
            "TE identity",
            format!("{head}Transfer-Encoding: identity\r\n\r\nhello"),
        ),
        (
            "TE gzip (not final chunked)",
            format!("{head}Transfer-Encoding: gzip\r\n\r\nhello"),
        ),
        (
            "obs-fold",
            format!("{head}X-Folded: a\r\n b\r\nContent-Length: 0\r\n\r\n"),
        ),
        (
            "obs-fold on the token",
            "PUT /accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 5\r\n 6\r\nContent-Length: 0\r\n\r\n".to_owned(),
        ),
        (
            "space-prefixed TE line",
            format!("{head} Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\nhello"),
        ),
        (
            "TE with a space before the colon",
            format!("{head}Transfer-Encoding : chunked\r\nContent-Length: 5\r\n\r\nhello"),
        ),
    ];
    for (what, request) in cases {
        let resp = raw(fg.listen, request.as_bytes()).await;
        assert_eq!(status_of(&resp), 400, "{what}: {resp}");
        assert_eq!(up.count(), 0, "{what} reached the upstream");
        assert_eq!(recorded(&fg, "account:1").await, None, "{what}");
    }
}

/// Content-Length together with Transfer-Encoding: hyper does not refuse it (RFC 9112 §6.1
/// lets a server either reject it or frame by Transfer-Encoding alone, then close). It drops
/// the Content-Length, reads the chunked body, and closes the connection after answering:
/// the bytes after the chunked body (a smuggled second request) are never read as a request,
/// and the upstream gets one unambiguous message without Content-Length.
#[tokio::test]
async fn content_length_with_transfer_encoding_is_framed_by_te_and_closes() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let smuggled =
        "PUT /accounts/2 HTTP/1.1\r\nHost: x\r\nFencing-Token: 99\r\nContent-Length: 0\r\n\r\n";
    for (i, (what, framing)) in [
        (
            "CL.TE",
            "Content-Length: 6\r\nTransfer-Encoding: chunked\r\n",
        ),
        (
            "TE.CL",
            "Transfer-Encoding: chunked\r\nContent-Length: 6\r\n",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let token = 5 + i;
        let request = format!(
            "PUT /accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: {token}\r\n{framing}\r\n1\r\nx\r\n0\r\n\r\n{smuggled}"
        );
        let mut stream = TcpStream::connect(fg.listen).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        let (answer, _) = read_until_closed(&mut stream, Duration::from_secs(10)).await;
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 200"), "{what}: {answer}");
        assert_eq!(answer.matches("HTTP/1.1 ").count(), 1, "{what}: {answer}");
        assert!(
            answer.to_ascii_lowercase().contains("connection: close"),
            "{answer}"
        );
        let seen = &up.seen()[i];
        assert_eq!(seen.body, "x", "{what}");
        assert!(
            seen.headers.get("content-length").is_none(),
            "{what}: {seen:?}"
        );
        assert_eq!(seen.token(), Some(token as u64));
    }
    assert_eq!(up.count(), 2);
    assert_eq!(
        recorded(&fg, "account:2").await,
        None,
        "the smuggled request ran"
    );
}

/// A malformed chunked body is the client's fault: 400 `invalid-request`, not a 502 that
/// blames the upstream (the write was admitted on its head; the raise stays, as docs/guarantees.md says).
#[tokio::test]
async fn malformed_chunked_body_is_400() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let request = "PUT /accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 7\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\nzz\r\nhello\r\n0\r\n\r\n";
    let resp = raw(fg.listen, request.as_bytes()).await;
    assert_eq!(status_of(&resp), 400, "{resp}");
    assert!(resp.contains("urn:fencegate:invalid-request"), "{resp}");
    assert!(resp.contains("malformed or cut short"), "{resp}");
}

#[tokio::test]
async fn upgrade_on_a_fenced_route_is_stripped_and_fenced() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let ws = "Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n";
    let req = |token: &str| {
        format!("PUT /accounts/1 HTTP/1.1\r\nHost: x\r\n{ws}{token}Content-Length: 0\r\n\r\n")
    };
    refused_raw(
        &fg,
        &up,
        &[(
            "no token",
            req(""),
            428,
            Some("urn:fencegate:token-required"),
        )],
    )
    .await;
    let resp = raw(fg.listen, req("Fencing-Token: 3\r\n").as_bytes()).await;
    assert_eq!(status_of(&resp), 200, "{resp}");
    let seen = &up.seen()[0];
    assert!(seen.headers.get("upgrade").is_none(), "{seen:?}");
    assert!(seen.headers.get("connection").is_none(), "{seen:?}");
    assert_eq!(seen.token(), Some(3));
    assert_eq!(recorded(&fg, "account:1").await, Some(3));
    // A GET upgrade (unfenced method) is not tunnelled either: no 101, a plain forward.
    let get = format!("GET /accounts/1 HTTP/1.1\r\nHost: x\r\n{ws}Content-Length: 0\r\n\r\n");
    let resp = raw(fg.listen, get.as_bytes()).await;
    assert_eq!(status_of(&resp), 200, "{resp}");
    assert!(up.seen()[1].headers.get("upgrade").is_none());
}

#[tokio::test]
async fn oversized_or_too_many_headers_are_431() {
    let up = Upstream::start().await;
    let fg = fencegate(
        &up.url(),
        &format!("limits: {{ max_header_bytes: 8192, max_headers: 20 }}\n{ACCOUNTS}"),
    )
    .await;
    let big = "a".repeat(9000);
    let many: String = (0..40).map(|i| format!("X-H{i}: v\r\n")).collect();
    let long_target = format!(
        "PUT /accounts/1?{} HTTP/1.1\r\nHost: x\r\nFencing-Token: 5\r\nContent-Length: 0\r\n\r\n",
        "q".repeat(9000)
    );
    let cases = [
        (
            "one big header",
            put_with(&format!("Fencing-Token: 5\r\nX-Big: {big}\r\n")),
            431,
            None,
        ),
        (
            "a big token value",
            put_with(&format!("Fencing-Token: {big}\r\n")),
            431,
            None,
        ),
        (
            "too many headers",
            put_with(&format!("Fencing-Token: 5\r\n{many}")),
            431,
            None,
        ),
        (
            "a huge request target (hyper counts it in the head: 431, not 414)",
            long_target,
            431,
            None,
        ),
    ];
    refused_raw(&fg, &up, &cases).await;
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

/// An upstream and a fencegate in front of it that gives a request head 300 ms.
async fn with_header_read_300ms() -> (Upstream, fencegate::app::Server) {
    let up = Upstream::start().await;
    let fg = fencegate(
        &up.url(),
        &format!("timeouts: {{ header_read: 300ms }}\n{ACCOUNTS}"),
    )
    .await;
    (up, fg)
}

#[tokio::test]
async fn slow_headers_are_cut_off_after_header_read() {
    let (up, fg) = with_header_read_300ms().await;
    // Slowloris: a request head that never ends.
    let mut stream = TcpStream::connect(fg.listen).await.unwrap();
    stream
        .write_all(b"PUT /accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 5\r\n")
        .await
        .unwrap();
    let (answer, after) = read_until_closed(&mut stream, Duration::from_secs(5)).await;
    assert!(
        after >= Duration::from_millis(250),
        "closed after {after:?}"
    );
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 408"),
        "{answer}"
    );

    // Dribbling one header byte at a time does not reset the clock.
    let mut stream = TcpStream::connect(fg.listen).await.unwrap();
    let started = Instant::now();
    let head = b"PUT /accounts/1 HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let mut closed_after = None;
    for byte in head {
        if stream.write_all(&[*byte]).await.is_err() {
            closed_after = Some(started.elapsed());
            break;
        }
        // The attacker's pacing (not a synchronisation): one byte every 50ms.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let after = match closed_after {
        Some(after) => after,
        None => {
            read_until_closed(&mut stream, Duration::from_secs(5))
                .await
                .1
                + started.elapsed()
        }
    };
    assert!(
        after < Duration::from_secs(3),
        "dribbled head kept for {after:?}"
    );
    assert_eq!(up.count(), 0);
    assert_eq!(recorded(&fg, "account:1").await, None);
    // The server still serves.
    assert_eq!(put(&fg, "1", "5").await.status, 200);
}

/// A connection that never sends a byte holds a connection slot only for `header_read`.
#[tokio::test]
async fn a_connection_that_sends_nothing_is_closed_after_header_read() {
    let (_up, fg) = with_header_read_300ms().await;
    let mut stream = TcpStream::connect(fg.listen).await.unwrap();
    let (answer, after) = read_until_closed(&mut stream, Duration::from_secs(5)).await;
    assert!(answer.is_empty(), "{}", String::from_utf8_lossy(&answer));
    assert!(
        after >= Duration::from_millis(250) && after < Duration::from_secs(3),
        "closed after {after:?}"
    );
    assert_eq!(put(&fg, "1", "5").await.status, 200);
}

/// On a kept-alive connection the header-read clock starts again for every head (the
/// connection's timer is reused from head to head): a second head that never ends is cut off
/// after `header_read` counted from the end of the first exchange, not from the first head's
/// start.
#[tokio::test]
async fn a_slow_second_head_on_a_kept_alive_connection_is_cut_off() {
    let (up, fg) = with_header_read_300ms().await;
    let mut stream = TcpStream::connect(fg.listen).await.unwrap();
    // The first head takes 200 ms (within its 300 ms), so its deadline falls 100 ms after it
    // is answered: a timer left at that deadline would cut the second head short.
    stream
        .write_all(b"PUT /accounts/1 HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    // The client's pacing (not a synchronisation).
    tokio::time::sleep(Duration::from_millis(200)).await;
    stream
        .write_all(b"Fencing-Token: 5\r\nContent-Length: 0\r\n\r\n")
        .await
        .unwrap();
    let first = read_response(&mut stream).await;
    let answered = Instant::now();
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    stream
        .write_all(b"PUT /accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 6\r\n")
        .await
        .unwrap();
    let (answer, _) = read_until_closed(&mut stream, Duration::from_secs(5)).await;
    let after = answered.elapsed();
    assert!(
        after >= Duration::from_millis(250) && after < Duration::from_secs(3),
        "second head cut off {after:?} after the first answer"
    );
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 408"),
        "{answer}"
    );
    assert_eq!(up.count(), 1);
    assert_eq!(recorded(&fg, "account:1").await, Some(5));
}

/// A body that never completes: the write was admitted when its head arrived (the token is
/// raised, docs/guarantees.md: never undone), the upstream never gets a complete request, and the client
/// gets 504 once `timeouts.upstream` passes.
#[tokio::test]
async fn slow_body_times_out_and_never_completes_upstream() {
    let up = Upstream::start().await;
    let fg = fencegate(
        &up.url(),
        &format!("timeouts: {{ upstream: 400ms }}\n{ACCOUNTS}"),
    )
    .await;
    let mut stream = TcpStream::connect(fg.listen).await.unwrap();
    stream
        .write_all(b"PUT /accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 5\r\nContent-Length: 100\r\n\r\npartial")
        .await
        .unwrap();
    let (answer, after) = read_until_closed(&mut stream, Duration::from_secs(10)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 504"), "{answer}");
    assert!(
        answer.contains("urn:fencegate:upstream-timeout"),
        "{answer}"
    );
    assert!(after >= Duration::from_millis(350), "{after:?}");
    assert_eq!(up.count(), 0, "an incomplete body completed upstream");
    assert_eq!(recorded(&fg, "account:1").await, Some(5));
    assert_eq!(put(&fg, "1", "5").await.status, 200);
}

// ---- HTTP/2 (h2c, prior knowledge), frames written by hand ----------------------------------

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// HPACK, literal without indexing, indexed name (RFC 7541 §6.2.2); values shorter than 127.
fn literal(name_index: u8, value: &str) -> Vec<u8> {
    let mut out = vec![name_index, value.len() as u8];
    out.extend_from_slice(value.as_bytes());
    out
}

/// `PUT /accounts/1` over http with authority `x`, no token.
fn put_block() -> Vec<u8> {
    let mut block = literal(2, "PUT");
    block.push(0x86); // :scheme http
    block.extend(literal(4, "/accounts/1"));
    block.extend(literal(1, "x"));
    block
}

/// Connects with the h2c preface and an empty SETTINGS frame.
async fn h2c(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(PREFACE).await.unwrap();
    s.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
    s
}

/// Reads frames until GOAWAY (returns its error code) or the connection closes (`None`).
async fn until_goaway(stream: &mut TcpStream, within: Duration) -> Option<u32> {
    let deadline = tokio::time::Instant::now() + within;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    loop {
        while buf.len() >= 9 {
            let len =
                (usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]);
            if buf.len() < 9 + len {
                break;
            }
            if buf[3] == GOAWAY && len >= 8 {
                return Some(u32::from_be_bytes(buf[13..17].try_into().unwrap()));
            }
            buf.drain(..9 + len);
        }
        let read = tokio::time::timeout_at(deadline, stream.read(&mut chunk))
            .await
            .unwrap_or_else(|_| panic!("no GOAWAY and no close within {within:?}"));
        match read {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Reads frames until a HEADERS frame on `stream` (a response) arrives; false on close.
async fn until_headers(s: &mut TcpStream, stream: u32, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    loop {
        while buf.len() >= 9 {
            let len =
                (usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]);
            if buf.len() < 9 + len {
                break;
            }
            let id = u32::from_be_bytes(buf[5..9].try_into().unwrap()) & 0x7fff_ffff;
            if buf[3] == HEADERS && id == stream {
                return true;
            }
            buf.drain(..9 + len);
        }
        let read = tokio::time::timeout_at(deadline, s.read(&mut chunk))
            .await
            .unwrap_or_else(|_| panic!("no response within {within:?}"));
        match read {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Resident memory of a process, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

async fn real_fencegate(up: &Upstream, dir: &std::path::Path) -> crate::process::Process {
    let config = dir.join("fencegate.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: {}\nstore: {{ kind: memory }}\n{ACCOUNTS}",
            up.url()
        ),
    )
    .unwrap();
    crate::process::Process::start(&config).await
}

#[tokio::test]
async fn h2_rapid_reset_gets_goaway_and_the_server_stays_healthy() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let mut p = real_fencegate(&up, dir.path()).await;
    let mut s = h2c(p.proxy).await;
    let block = put_block();
    let mut burst = Vec::new();
    for i in 0..1000u32 {
        let id = 2 * i + 1;
        burst.extend(frame(HEADERS, END_HEADERS, id, &block));
        burst.extend(frame(RST_STREAM, 0, id, &8u32.to_be_bytes())); // CANCEL
    }
    // The server may close while we are still writing: that is the expected outcome too.
    let _ = s.write_all(&burst).await;
    let code = until_goaway(&mut s, Duration::from_secs(10)).await;
    println!("rapid reset: GOAWAY {code:?}");
    assert!(
        code.is_none() || code == Some(0xb),
        "expected ENHANCE_YOUR_CALM or a close, got GOAWAY {code:?}"
    );
    assert_eq!(up.count(), 0);
    // Still healthy, over HTTP/1 and over a fresh HTTP/2 connection.
    assert_eq!(crate::process::put_to(p.proxy, "1", "5").await.status, 200);
    let mut s = h2c(p.proxy).await;
    s.write_all(&frame(HEADERS, END_HEADERS | END_STREAM, 1, &put_block()))
        .await
        .unwrap();
    assert!(
        until_headers(&mut s, 1, Duration::from_secs(5)).await,
        "a fresh HTTP/2 connection got no response"
    );
    p.child.start_kill().unwrap();
}

#[tokio::test]
async fn h2_continuation_flood_is_cut_off_with_bounded_memory() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let mut p = real_fencegate(&up, dir.path()).await;
    let pid = p.child.id().unwrap();
    let before = rss_kib(pid);
    let mut s = h2c(p.proxy).await;
    // HEADERS without END_HEADERS, then CONTINUATION frames of fresh literal headers, never
    // ending: 64 MiB offered in all.
    s.write_all(&frame(HEADERS, 0, 1, &put_block()))
        .await
        .unwrap();
    let mut piece = Vec::new();
    while piece.len() < 16_000 {
        // literal without indexing, new name (0x00), 10-byte name, 100-byte value
        piece.push(0x00);
        piece.push(10);
        piece.extend_from_slice(format!("x-f{:07}", piece.len()).as_bytes());
        piece.push(100);
        piece.extend_from_slice(&[b'v'; 100]);
    }
    let continuation = frame(CONTINUATION, 0, 1, &piece);
    let mut written = 0usize;
    let mut reset = false;
    for _ in 0..4096 {
        match tokio::time::timeout(Duration::from_secs(5), s.write_all(&continuation)).await {
            Ok(Ok(())) => written += continuation.len(),
            // Reset or broken pipe: the server closed the connection.
            Ok(Err(_)) => {
                reset = true;
                break;
            }
            // The server stopped reading: it must now say GOAWAY or close.
            Err(_) => break,
        }
    }
    if reset {
        println!("CONTINUATION flood: connection reset after {written} bytes");
    } else {
        // Panics unless the server sends GOAWAY or closes within the bound.
        let code = until_goaway(&mut s, Duration::from_secs(10)).await;
        println!("CONTINUATION flood: GOAWAY {code:?} after {written} bytes");
    }
    let after = rss_kib(pid);
    assert!(
        after < before + 32 * 1024,
        "RSS grew from {before} KiB to {after} KiB after {written} bytes of CONTINUATION"
    );
    assert_eq!(up.count(), 0);
    assert_eq!(crate::process::put_to(p.proxy, "1", "5").await.status, 200);
    p.child.start_kill().unwrap();
}

/// A client that hangs up mid-write must not open the `ordering: serialize` barrier while its
/// write is still in flight upstream: a higher token has to wait for the lower one to finish
/// (docs/guarantees.md), here until `barrier_timeout`, then 503.
#[tokio::test]
async fn hanging_up_does_not_open_the_serialize_barrier() {
    let up = Upstream::gated().await;
    let fg = fencegate(
        &up.url(),
        "routes:\n  - { name: a, path: '/accounts/{id}', resource: 'account:{id}', ordering: serialize, barrier_timeout: 1s }\n",
    )
    .await;
    let mut first = TcpStream::connect(fg.listen).await.unwrap();
    first
        .write_all(
            b"PUT /accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 1\r\nContent-Length: 0\r\n\r\n",
        )
        .await
        .unwrap();
    assert_eq!(up.arrival().await.token(), Some(1));
    drop(first);
    let mut second = tokio::spawn({
        let url = format!("http://{}/accounts/1", fg.listen);
        async move { send("PUT", &url, &[("fencing-token", "2")], "").await }
    });
    tokio::select! {
        seen = up.arrival() => panic!(
            "token {:?} reached the upstream while token 1 was still in flight there",
            seen.token()
        ),
        reply = &mut second => {
            reply.unwrap().assert_problem(503, "urn:fencegate:barrier-timeout");
        }
    }
    up.release(2);
}

/// RFC 9112 §3.2: a request with more than one Host, or an HTTP/1.1 request without one, is
/// answered 400 before anything else (a downstream that trusts `X-Forwarded-Host` would
/// otherwise see one of two claims).
#[tokio::test]
async fn duplicate_or_missing_host_is_400() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let cases = [
        (
            "two Host headers",
            "PUT /accounts/1 HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\nFencing-Token: 5\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_owned(),
            400,
            Some("more than one Host header"),
        ),
        (
            "HTTP/1.1 without Host",
            "PUT /accounts/1 HTTP/1.1\r\nFencing-Token: 5\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_owned(),
            400,
            Some("urn:fencegate:invalid-request"),
        ),
    ];
    refused_raw(&fg, &up, &cases).await;
}

/// A resource taken from a header must be unambiguous: two values are refused.
#[tokio::test]
async fn resource_headers_with_two_values_are_refused() {
    let up = Upstream::start().await;
    let fg = fencegate(
        &up.url(),
        "routes:\n  - { name: t, path: '/t/{id}', resource: '{header:x-tenant}:{id}' }\n",
    )
    .await;
    let req = "PUT /t/1 HTTP/1.1\r\nHost: x\r\nX-Tenant: a\r\nX-Tenant: b\r\nFencing-Token: 5\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    let resp = raw(fg.listen, req.as_bytes()).await;
    assert_eq!(status_of(&resp), 400, "{resp}");
    assert!(resp.contains("urn:fencegate:invalid-resource"), "{resp}");
    assert_eq!(up.count(), 0);
    assert_eq!(recorded(&fg, "a:1").await, None);
    assert_eq!(recorded(&fg, "b:1").await, None);
}

/// A resource taken from the query must be unambiguous too. Two `shard=` are refused, but a
/// percent-encoded key (`sh%61rd=us`) is not compared decoded: fencegate sees one `shard`
/// (`eu`) while any downstream that decodes keys sees two and may pick `us`, so a token
/// checked against `eu:1` writes `us:1`.
#[tokio::test]
async fn encoded_query_keys_do_not_hide_a_second_value() {
    let up = Upstream::start().await;
    let fg = fencegate(
        &up.url(),
        "routes:\n  - { name: t, path: '/t/{id}', resource: '{query:shard}:{id}' }\n",
    )
    .await;
    for query in [
        "shard=eu&shard=us",
        "sh%61rd=us&shard=eu",
        "shard=eu&%73hard=us",
    ] {
        let req = format!("PUT /t/1?{query} HTTP/1.1\r\nHost: x\r\nFencing-Token: 5\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        let resp = raw(fg.listen, req.as_bytes()).await;
        assert_eq!(status_of(&resp), 400, "{query}: {resp}");
        assert!(
            resp.contains("urn:fencegate:invalid-resource"),
            "{query}: {resp}"
        );
    }
    assert_eq!(up.count(), 0);
    assert_eq!(recorded(&fg, "eu:1").await, None);
}

/// A hostile (or just large) config: a route path with 27 captures. It must be refused with a
/// located error; today matchit panics ("Too many route parameters"), which kills `check` and
/// `run` with exit 101 and, on a live reload, the reloader task. Found by `fuzz/` (`config`).
#[test]
fn a_route_with_27_captures_is_refused_not_a_panic() {
    let path: Vec<String> = (0..27).map(|i| format!("{{p{i}}}")).collect();
    let yaml = format!(
        "upstream: http://127.0.0.1:1\nroutes:\n  - {{ name: a, path: '/a/{}' }}\n",
        path.join("/")
    );
    let parsed = std::panic::catch_unwind(|| fencegate::config::Config::parse(&yaml).map(|_| ()));
    let error = parsed
        .expect("Config::parse panicked")
        .expect_err("27 captures accepted")
        .to_string();
    assert!(error.contains("routes[0].path"), "{error}");
}

/// A method override header (`X-HTTP-Method-Override`, `X-HTTP-Method`, `X-Method-Override`)
/// makes many frameworks run a `GET` as the method it names: on a route, such a request is
/// fenced as that method. Without a token it is refused, with a stale one too, and with a
/// current one it is admitted and forwarded as sent (the override header and the token go
/// along, so the service does what was fenced).
#[tokio::test]
async fn a_method_override_is_fenced_as_the_method_it_names() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let url = format!("http://{}/accounts/1", fg.listen);
    for name in [
        "x-http-method-override",
        "X-HTTP-Method",
        "x-method-override",
    ] {
        let reply = send("GET", &url, &[(name, "DELETE")], "").await;
        reply.assert_problem(428, "urn:fencegate:token-required");
        // Frameworks compare the named method without regard to case; so does the fence.
        let reply = send("GET", &url, &[(name, "delete")], "").await;
        reply.assert_problem(428, "urn:fencegate:token-required");
    }
    assert_eq!(up.count(), 0);
    assert_eq!(recorded(&fg, "account:1").await, None);

    let reply = send(
        "GET",
        &url,
        &[("x-http-method-override", "DELETE"), ("fencing-token", "5")],
        "",
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(recorded(&fg, "account:1").await, Some(5));
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].method, "GET");
    assert_eq!(seen[0].headers["x-http-method-override"], "DELETE");
    assert_eq!(seen[0].token(), Some(5));

    let reply = send(
        "POST",
        &url,
        &[("x-method-override", "PATCH"), ("fencing-token", "4")],
        "",
    )
    .await;
    let body = reply.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(body["current_token"], 5);
    assert_eq!(up.count(), 1);

    // An override naming a method that is not fenced leaves a fenced method fenced, and so
    // does one carried in the query (which the fence does not read).
    for name in [
        "x-http-method-override",
        "x-http-method",
        "x-method-override",
    ] {
        let reply = send("PUT", &url, &[(name, "GET")], "").await;
        reply.assert_problem(428, "urn:fencegate:token-required");
    }
    send("POST", &format!("{url}?_method=GET"), &[], "")
        .await
        .assert_problem(428, "urn:fencegate:token-required");
    // A read that names a read stays a read.
    let reply = send("GET", &url, &[("x-http-method", "HEAD")], "").await;
    assert_eq!(reply.status, 200);
    assert_eq!(up.count(), 2);
    assert_eq!(recorded(&fg, "account:1").await, Some(5));
}

/// A method override that is repeated (two of the headers, or one twice) or does not name a
/// method is refused on a route: which one the service would honour cannot be known.
#[tokio::test]
async fn a_repeated_or_malformed_method_override_is_refused_on_a_route() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let get = |extra: &str| {
        format!("GET /accounts/1 HTTP/1.1\r\nHost: x\r\n{extra}fencing-token: 9\r\nConnection: close\r\n\r\n")
    };
    let invalid = Some("urn:fencegate:invalid-request");
    let cases = [
        (
            "two override headers",
            get("X-HTTP-Method-Override: DELETE\r\nX-HTTP-Method: DELETE\r\n"),
            400,
            invalid,
        ),
        (
            "one override header twice",
            get("X-Method-Override: GET\r\nX-Method-Override: DELETE\r\n"),
            400,
            invalid,
        ),
        (
            "a list of methods",
            get("X-HTTP-Method-Override: GET, DELETE\r\n"),
            400,
            invalid,
        ),
        ("an empty override", get("X-HTTP-Method:\r\n"), 400, invalid),
        (
            "a method with a separator",
            get("X-HTTP-Method-Override: DELETE;\r\n"),
            400,
            invalid,
        ),
    ];
    refused_raw(&fg, &up, &cases).await;
    let resp = raw(
        fg.listen,
        get("X-HTTP-Method: GET\r\nX-HTTP-Method: PUT\r\n").as_bytes(),
    )
    .await;
    assert!(
        resp.contains("more than one method override header"),
        "{resp}"
    );
    // Off every route, an override is the service's business: forwarded as is.
    let reply = send(
        "GET",
        &format!("http://{}/elsewhere", fg.listen),
        &[("x-http-method-override", "DELETE, PUT")],
        "",
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(up.count(), 1);
}

/// Egress: an app that names the token header in `Connection` would have the token stripped
/// with the hop-by-hop headers after the sidecar set it, and the write would leave without a
/// token. It is refused as the fence listener refuses it (400), and nothing is sent.
#[tokio::test]
async fn egress_refuses_a_write_whose_connection_header_names_the_token() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let fg = fencegate(
        "http://127.0.0.1:9",
        &format!(
            "leases:\n  listen: 127.0.0.1:0\n  backend: {{ kind: embedded, path: {} }}\n  ttl: 5s\negress:\n  listen: 127.0.0.1:0\n  upstream: {}\n  routes:\n    - {{ path: '/accounts/{{id}}', lease: 'account:{{id}}' }}\n",
            dir.path().join("leases.db").display(),
            up.url()
        ),
    )
    .await;
    let api = format!("http://{}/v1/leases/account:42", fg.leases.unwrap());
    let granted = send("POST", &api, &[], r#"{"holder":"w1"}"#).await;
    assert_eq!(granted.status, 200, "{}", granted.text());
    let token = granted.json()["fencing_token"].as_u64().unwrap();
    let url = format!("http://{}/accounts/42", fg.egress.unwrap());
    for connection in ["fencing-token", "keep-alive, Fencing-Token"] {
        let reply = send("PUT", &url, &[("connection", connection)], "debit").await;
        let body = reply.assert_problem(400, "urn:fencegate:invalid-token");
        assert!(
            body["detail"]
                .as_str()
                .unwrap()
                .contains("Connection header names the token"),
            "{body}"
        );
    }
    assert_eq!(up.count(), 0);
    // The same write without the trick leaves with the lease's token.
    let reply = send("PUT", &url, &[("connection", "keep-alive")], "debit").await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].token(), Some(token));
}
