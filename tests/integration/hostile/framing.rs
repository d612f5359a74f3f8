//! Request framing (smuggling forms, chunked bodies, upgrades) and header limits.

use super::*;

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
