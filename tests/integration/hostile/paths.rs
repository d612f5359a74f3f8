//! Paths, hosts and resource ids: one resource, or a refusal.

use super::*;

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
