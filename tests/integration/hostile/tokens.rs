//! Token headers, header hygiene and method overrides.

use super::*;

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
