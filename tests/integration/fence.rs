//! Every status of docs/requests.md, every refused token form, path normalisation, and the rule that a
//! refused request never reaches the upstream nor changes the store.

use crate::common::*;

#[tokio::test]
async fn stale_write_is_refused_with_409_and_current_token() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;

    assert_eq!(put(&fg, "42", "33").await.status, 200);
    assert_eq!(put(&fg, "42", "34").await.status, 200);
    let reply = put(&fg, "42", "33").await;
    let body = reply.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(reply.headers["fencing-token-current"], "34");
    assert_eq!(body["resource"], "account:42");
    assert_eq!(body["token"], 33);
    assert_eq!(body["current_token"], 34);
    assert_eq!(body["title"], "Stale fencing token");

    // Only the two admitted writes reached the upstream, each with its token forwarded.
    let seen = up.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        seen.iter().map(|s| s.token()).collect::<Vec<_>>(),
        [Some(33), Some(34)]
    );
    assert_eq!(seen[1].body, "write with 34");
    assert_eq!(recorded(&fg, "account:42").await, Some(34));
    // Other resources are independent.
    assert_eq!(put(&fg, "43", "1").await.status, 200);
    assert_eq!(recorded(&fg, "account:43").await, Some(1));
}

#[tokio::test]
async fn equal_token_is_the_same_epoch_unless_rejected() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    assert_eq!(put(&fg, "1", "5").await.status, 200);
    assert_eq!(put(&fg, "1", "5").await.status, 200);
    assert_eq!(up.count(), 2);

    let strict = fencegate(
        &up.url(),
        &format!("token: {{ equal: reject }}\n{ACCOUNTS}"),
    )
    .await;
    assert_eq!(put(&strict, "1", "5").await.status, 200);
    let reply = put(&strict, "1", "5").await;
    reply.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(reply.headers["fencing-token-current"], "5");
    assert_eq!(put(&strict, "1", "6").await.status, 200);
    assert_eq!(up.count(), 4);
}

#[tokio::test]
async fn missing_token_is_428_or_forwarded_when_allowed() {
    let up = Upstream::start().await;
    let fg = fencegate(
        &up.url(),
        "routes:\n  - { name: accounts, path: '/accounts/{id}', resource: 'account:{id}' }\n  \
         - { name: legacy, path: '/legacy/{id}', missing_token: allow }\n",
    )
    .await;
    let url = format!("http://{}/accounts/9", fg.listen);
    let reply = send("POST", &url, &[], "x").await;
    let body = reply.assert_problem(428, "urn:fencegate:token-required");
    assert_eq!(body["resource"], "account:9");
    assert!(body.get("token").is_none());
    assert_eq!(up.count(), 0);
    assert_eq!(recorded(&fg, "account:9").await, None);

    let reply = send("POST", &format!("http://{}/legacy/9", fg.listen), &[], "x").await;
    assert_eq!(reply.status, 200);
    assert_eq!(up.count(), 1);
    // With a token, the allow route still fences (resource defaults to the normalised path).
    assert_eq!(
        send(
            "POST",
            &format!("http://{}/legacy/9", fg.listen),
            &[("fencing-token", "3")],
            ""
        )
        .await
        .status,
        200
    );
    assert_eq!(recorded(&fg, "%2Flegacy%2F9").await, Some(3));
    let stale = send(
        "POST",
        &format!("http://{}/legacy/9", fg.listen),
        &[("fencing-token", "2")],
        "",
    )
    .await;
    stale.assert_problem(409, "urn:fencegate:stale-token");
}

#[tokio::test]
async fn every_malformed_token_is_400_and_leaves_no_trace() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let url = format!("http://{}/accounts/1", fg.listen);
    let cases: &[&[(&str, &str)]] = &[
        &[("fencing-token", "+5")],
        &[("fencing-token", "05")],
        &[("fencing-token", "-1")],
        &[("fencing-token", "1e3")],
        &[("fencing-token", "0x10")],
        &[("fencing-token", "5.0")],
        &[("fencing-token", "9223372036854775808")],
        &[("fencing-token", "18446744073709551616")],
        &[("fencing-token", "")],
        &[("fencing-token", "5"), ("fencing-token", "5")],
        &[("fencing-token", "5"), ("fencing-token", "6")],
        &[("fencing_token", "5")],
        &[("fencing-token", "5"), ("fencing_token", "9")],
        &[("fencing-token", "5"), ("connection", "fencing-token")],
    ];
    for headers in cases {
        let reply = send("PUT", &url, headers, "x").await;
        let body = reply.assert_problem(400, "urn:fencegate:invalid-token");
        assert_eq!(body["resource"], "account:1", "{headers:?}");
    }
    assert_eq!(up.count(), 0);
    assert_eq!(recorded(&fg, "account:1").await, None);
    // The largest legal token passes the grammar. As a first token it is above the default
    // token.max_step, so it is refused as too far (409), not as malformed; without the
    // ceiling it is admitted.
    put(&fg, "1", "9223372036854775807")
        .await
        .assert_problem(409, "urn:fencegate:token-too-far");
    assert_eq!(recorded(&fg, "account:1").await, None);
    let off = fencegate(
        &up.url(),
        &format!("token: {{ max_step: off }}\n{ACCOUNTS}"),
    )
    .await;
    assert_eq!(put(&off, "1", "9223372036854775807").await.status, 200);
    assert_eq!(recorded(&off, "account:1").await, Some(i64::MAX as u64));
}

#[tokio::test]
async fn raw_wire_forms_of_the_token() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let req = |token_line: &str| {
        format!(
            "PUT /accounts/7 HTTP/1.1\r\nHost: x\r\n{token_line}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
    };
    // An empty value and a value with inner space are malformed.
    for line in ["Fencing-Token:", "Fencing-Token: 5 5", "Fencing-Token: 5,6"] {
        let resp = raw(fg.listen, req(line).as_bytes()).await;
        assert!(resp.starts_with("HTTP/1.1 400"), "{line}: {resp}");
        assert!(
            resp.contains("urn:fencegate:invalid-token"),
            "{line}: {resp}"
        );
    }
    assert_eq!(up.count(), 0);
    // Optional whitespace around an HTTP/1 field value is not part of it (RFC 9110 §5.5).
    let resp = raw(fg.listen, req("Fencing-Token:   5  ").as_bytes()).await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert_eq!(up.seen()[0].token(), Some(5));
}

#[tokio::test]
async fn paths_are_normalised_before_matching_and_forwarding() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let cases = [
        ("/accounts/./7", "/accounts/7"),
        ("//accounts/7", "/accounts/7"),
        ("/accounts//7", "/accounts/7"),
        ("/x/../accounts/7", "/accounts/7"),
        ("/%61ccounts/%37", "/accounts/7"),
        ("/accounts/%2e/7?q=1", "/accounts/7?q=1"),
    ];
    for (i, (sent, forwarded)) in cases.iter().enumerate() {
        let token = (10 + i).to_string();
        let resp = raw(
            fg.listen,
            format!("PUT {sent} HTTP/1.1\r\nHost: x\r\nFencing-Token: {token}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await;
        assert!(resp.starts_with("HTTP/1.1 200"), "{sent}: {resp}");
        assert_eq!(up.seen()[i].target, *forwarded, "{sent}");
    }
    // All six spellings were one resource: an older token through any of them is stale.
    assert_eq!(recorded(&fg, "account:7").await, Some(15));
    let resp = raw(
        fg.listen,
        b"PUT /accounts/./7 HTTP/1.1\r\nHost: x\r\nFencing-Token: 14\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 409"), "{resp}");
}

#[tokio::test]
async fn trailing_slash_and_raw_utf8_name_the_same_resource() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    assert_eq!(put(&fg, "42", "36").await.status, 200);
    let resp = raw(
        fg.listen,
        b"PUT /accounts/42/ HTTP/1.1\r\nHost: x\r\nFencing-Token: 1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 409"), "{resp}");
    assert!(resp.contains("fencing-token-current: 36"), "{resp}");

    let resp = raw(
        fg.listen,
        "PUT /accounts/\u{e9} HTTP/1.1\r\nHost: x\r\nFencing-Token: 3\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".as_bytes(),
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert_eq!(up.seen()[1].target, "/accounts/%C3%A9");
    assert_eq!(recorded(&fg, "account:%C3%A9").await, Some(3));
    let resp = raw(
        fg.listen,
        b"PUT /accounts/%c3%a9 HTTP/1.1\r\nHost: x\r\nFencing-Token: 2\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 409"), "{resp}");
    assert_eq!(up.count(), 2);
}

#[tokio::test]
async fn ambiguous_paths_are_400_and_never_forwarded() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    for path in [
        "/accounts/7%2F8",
        "/accounts/7%2f8",
        "/accounts/7%5C8",
        "/accounts/7\\8",
        "/accounts/7%00",
        "/accounts/7%0D%0A",
        "/accounts/7%zz",
        "/accounts/7%",
    ] {
        for method in ["PUT", "GET"] {
            let resp = raw(
                fg.listen,
                format!("{method} {path} HTTP/1.1\r\nHost: x\r\nFencing-Token: 1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await;
            // Either hyper refuses the request line itself, or fencegate answers problem+json.
            assert!(resp.starts_with("HTTP/1.1 400"), "{method} {path}: {resp}");
            if !resp.contains("content-length: 0") {
                assert!(
                    resp.contains("urn:fencegate:invalid-path"),
                    "{method} {path}: {resp}"
                );
            }
        }
    }
    assert_eq!(up.count(), 0);
    assert_eq!(recorded(&fg, "account:7").await, None);
}

#[tokio::test]
async fn methods_fenced_by_default_include_unknown_ones() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let url = format!("http://{}/accounts/3", fg.listen);
    for method in ["POST", "PUT", "PATCH", "DELETE", "PURGE", "LOCK"] {
        send(method, &url, &[], "")
            .await
            .assert_problem(428, "urn:fencegate:token-required");
    }
    assert_eq!(up.count(), 0);
    for method in ["GET", "HEAD", "OPTIONS"] {
        assert_eq!(send(method, &url, &[], "").await.status, 200, "{method}");
    }
    assert_eq!(up.count(), 3);
}

#[tokio::test]
async fn listed_methods_and_unfenced_routes() {
    let up = Upstream::start().await;
    let fg = fencegate(
        &up.url(),
        "routes:\n  - { name: jobs, path: '/jobs/{id}', methods: [PUT], resource: 'job:{id}' }\n  \
         - { name: health, path: /healthz, fence: false }\n",
    )
    .await;
    let base = format!("http://{}", fg.listen);
    send("PUT", &format!("{base}/jobs/1"), &[], "")
        .await
        .assert_problem(428, "urn:fencegate:token-required");
    // POST is not listed on this route: forwarded without a check.
    assert_eq!(
        send("POST", &format!("{base}/jobs/1"), &[], "")
            .await
            .status,
        200
    );
    assert_eq!(
        send("POST", &format!("{base}/healthz"), &[], "")
            .await
            .status,
        200
    );
    assert_eq!(up.count(), 2);
}

#[tokio::test]
async fn unmatched_forward_or_reject() {
    let up = Upstream::start().await;
    let forwarding = fencegate(&up.url(), ACCOUNTS).await;
    assert_eq!(
        send(
            "POST",
            &format!("http://{}/elsewhere", forwarding.listen),
            &[],
            ""
        )
        .await
        .status,
        200
    );
    assert_eq!(up.count(), 1);

    let rejecting = fencegate(&up.url(), &format!("unmatched: reject\n{ACCOUNTS}")).await;
    let reply = send(
        "POST",
        &format!("http://{}/elsewhere", rejecting.listen),
        &[],
        "",
    )
    .await;
    reply.assert_problem(404, "urn:fencegate:no-route");
    assert_eq!(up.count(), 1);
}

#[tokio::test]
async fn resource_from_header_and_query() {
    let up = Upstream::start().await;
    let fg = fencegate(
        &up.url(),
        "routes:\n  - { name: t, path: '/t/{id}', resource: '{header:x-tenant}:{query:shard}:{id}' }\n",
    )
    .await;
    let url = format!("http://{}/t/5?shard=eu%2D1", fg.listen);
    let ok = send(
        "PUT",
        &url,
        &[("x-tenant", "acme"), ("fencing-token", "2")],
        "",
    )
    .await;
    assert_eq!(ok.status, 200);
    assert_eq!(recorded(&fg, "acme:eu-1:5").await, Some(2));
    // An already-normal target is forwarded as sent, query untouched.
    assert_eq!(up.seen()[0].target, "/t/5?shard=eu%2D1");
    let reply = send("PUT", &url, &[("fencing-token", "2")], "").await;
    reply.assert_problem(400, "urn:fencegate:invalid-resource");
    assert_eq!(up.count(), 1);
    // `X_Tenant` is `X-Tenant` to a CGI-style upstream, which may take it over `x-tenant`.
    let reply = send(
        "PUT",
        &url,
        &[
            ("x-tenant", "acme"),
            ("x_tenant", "globex"),
            ("fencing-token", "1"),
        ],
        "",
    )
    .await;
    reply.assert_problem(400, "urn:fencegate:invalid-resource");
    assert_eq!(up.count(), 1);
}

/// `/files/a/b/` is `/files/a/b` to the upstream, so it must be the same resource on a
/// catch-all capture too, and it must be on the route `/files/a/b` is on.
#[tokio::test]
async fn trailing_slash_on_a_catch_all_is_the_same_resource_and_route() {
    let up = Upstream::start().await;
    let fg = fencegate(
        &up.url(),
        "routes:\n  - { name: files, path: '/files/{*path}', resource: 'file:{path}' }\n  \
         - { name: item, path: '/a/{id}', resource: 'a:{id}' }\n  \
         - { name: other, path: '/{*rest}', fence: false }\n",
    )
    .await;
    let base = format!("http://{}", fg.listen);
    let ok = put_at(&fg, "/files/x/y", "5").await;
    assert_eq!(ok.status, 200);
    put_at(&fg, "/files/x/y/", "4")
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(recorded(&fg, "file:x%2Fy%2F").await, None);
    assert_eq!(up.count(), 1);

    let ok = put_at(&fg, "/a/42", "5").await;
    assert_eq!(ok.status, 200);
    put_at(&fg, "/a/42/", "4")
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
    send("PUT", &format!("{base}/a/42/"), &[], "")
        .await
        .assert_problem(428, "urn:fencegate:token-required");
    assert_eq!(up.count(), 2);
    // Unfenced with or without the slash.
    let ok = send("PUT", &format!("{base}/b/42/"), &[], "").await;
    assert_eq!(ok.status, 200);
}

/// Many servers (Rack 2, Go before 1.17, Python before 3.9.2) also split a query on `;`, and
/// take the last of two values: `account=1&x=;account=2` is account 2 to them. A resource taken
/// from such a query is ambiguous and refused, like a `;` in the path.
#[tokio::test]
async fn query_resource_with_a_semicolon_separator_is_refused() {
    let up = Upstream::start().await;
    let fg = fencegate(
        &up.url(),
        "routes:\n  - { name: jobs, path: /jobs, resource: 'account:{query:account}' }\n",
    )
    .await;
    let ok = put_at(&fg, "/jobs?account=2", "5").await;
    assert_eq!(ok.status, 200);
    for query in [
        "account=1&x=;account=2",
        "account=1;account=2",
        "x=1;account=2&account=1",
    ] {
        put_at(&fg, &format!("/jobs?{query}"), "4")
            .await
            .assert_problem(400, "urn:fencegate:invalid-resource");
    }
    assert_eq!(recorded(&fg, "account:1").await, None);
    assert_eq!(up.count(), 1);
    // A `;` inside another parameter's value changes nothing for `account`.
    let ok = put_at(&fg, "/jobs?filter=a;b&account=2", "5").await;
    assert_eq!(ok.status, 200);
}

/// Methods are case-sensitive, but some servers and frameworks fold them (Jetty's legacy
/// compliance modes, Django and Werkzeug upper-case `REQUEST_METHOD`): a listed method in
/// another case is fenced too, rather than forwarded unchecked.
#[tokio::test]
async fn listed_methods_are_fenced_in_any_case() {
    let up = Upstream::start().await;
    let fg = fencegate(
        &up.url(),
        "routes:\n  - { name: jobs, path: '/jobs/{id}', methods: [PUT], resource: 'job:{id}' }\n",
    )
    .await;
    let ok = put_at(&fg, "/jobs/1", "5").await;
    assert_eq!(ok.status, 200);
    for method in ["put", "Put"] {
        let resp = raw(
            fg.listen,
            format!("{method} /jobs/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 4\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await;
        assert!(resp.starts_with("HTTP/1.1 409"), "{method}: {resp}");
    }
    assert_eq!(up.count(), 1);
}

/// A small tmpfs of the test's own, unmounted when the test ends.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    fn mount(size: &str) -> SmallDisk {
        let dir = tempfile::tempdir().unwrap();
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(
            status.success(),
            "this test mounts a tmpfs, which needs root"
        );
        SmallDisk { dir }
    }

    /// Fills the disk with one file until the kernel says it is full.
    fn fill(&self) -> std::path::PathBuf {
        use std::io::Write;
        let path = self.dir.path().join("filler");
        let mut f = std::fs::File::create(&path).unwrap();
        let chunk = vec![0u8; 64 * 1024];
        loop {
            match f.write_all(&chunk) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(28) => break, // ENOSPC
                Err(e) => panic!("{e}"),
            }
        }
        let _ = f.write_all(&[0u8; 1]);
        path
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.dir.path())
            .status();
    }
}

async fn wait_ready(admin: std::net::SocketAddr, want: u16) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let status = send("GET", &format!("http://{admin}/readyz"), &[], "")
            .await
            .status;
        if status.as_u16() == want {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "readiness never became {want}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn full_disk_is_503_never_forwarded_and_recovers() {
    let up = Upstream::start().await;
    let disk = SmallDisk::mount("4m");
    let fg = fencegate(
        &up.url(),
        &format!(
            "store: {{ kind: embedded, path: {} }}\n{ACCOUNTS}",
            disk.dir.path().join("f.db").display()
        ),
    )
    .await;
    assert_eq!(put(&fg, "0", "1").await.status, 200);
    let filler = disk.fill();

    // New maxima cannot be made durable: refused, not forwarded, not ready.
    let mut refused = 0;
    for i in 1..200 {
        let reply = put(&fg, &i.to_string(), "5").await;
        if reply.status == 503 {
            let body = reply.assert_problem(503, "urn:fencegate:store-unavailable");
            assert_eq!(reply.headers["retry-after"], "1");
            assert_eq!(body["token"], 5);
            refused += 1;
            break;
        }
        // redb may still have free pages in its file; each success is durable and forwarded.
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    assert_eq!(refused, 1, "the store never ran out of space");
    let forwarded_before = up.count();
    wait_ready(fg.admin, 503).await;
    put(&fg, "new", "5")
        .await
        .assert_problem(503, "urn:fencegate:store-unavailable");
    // Known maxima still answer from memory: stale is refused, the current token admitted.
    put(&fg, "0", "0")
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(put(&fg, "0", "1").await.status, 200);
    assert_eq!(up.count(), forwarded_before + 1);

    // Space comes back: the store reopens, proves itself writable, writes flow again.
    std::fs::remove_file(filler).unwrap();
    wait_ready(fg.admin, 200).await;
    assert_eq!(put(&fg, "new", "5").await.status, 200);
    assert_eq!(recorded(&fg, "account:new").await, Some(5));
}

/// Asserts a response exactly: its status, every header but `date` (`content-length` is the
/// body's), and its body byte for byte.
pub fn assert_exact(reply: &Reply, status: u16, headers: &[(&str, &str)], body: &str) {
    assert_eq!(reply.status.as_u16(), status, "{}", reply.text());
    assert_eq!(reply.text(), body);
    let mut got: Vec<(String, String)> = reply
        .headers
        .iter()
        .filter(|(name, _)| *name != "date")
        .map(|(name, value)| (name.to_string(), value.to_str().unwrap().to_owned()))
        .collect();
    got.sort();
    let mut want: Vec<(String, String)> = headers
        .iter()
        .map(|(name, value)| (name.to_ascii_lowercase(), (*value).to_owned()))
        .chain([("content-length".to_owned(), body.len().to_string())])
        .collect();
    want.sort();
    assert_eq!(got, want, "{body}");
}

const PROBLEM: (&str, &str) = ("content-type", "application/problem+json");

/// The refusals about the token header name it, as configured (in the usual spelling: header
/// names are case-insensitive and the configuration keeps them lowercase).
#[tokio::test]
async fn token_refusals_name_the_configured_token_header() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ACCOUNTS).await;
    let url = format!("http://{}/accounts/42", fg.listen);
    assert_exact(
        &send("POST", &url, &[], "x").await,
        428,
        &[PROBLEM],
        r#"{"type":"urn:fencegate:token-required","title":"Fencing token required","status":428,"detail":"this route requires a fencing token: send it in the `Fencing-Token` header","resource":"account:42"}"#,
    );

    let custom = fencegate(
        &up.url(),
        &format!("token: {{ header: X-Fence }}\n{ACCOUNTS}"),
    )
    .await;
    let url = format!("http://{}/accounts/42", custom.listen);
    assert_exact(
        &send("PUT", &url, &[("fencing-token", "5")], "x").await,
        428,
        &[PROBLEM],
        r#"{"type":"urn:fencegate:token-required","title":"Fencing token required","status":428,"detail":"this route requires a fencing token: send it in the `X-Fence` header","resource":"account:42"}"#,
    );
    for (headers, detail) in [
        (
            &[("x-fence", "5"), ("x-fence", "6")][..],
            "more than one `X-Fence` header: send the token once",
        ),
        (
            &[("x_fence", "5")][..],
            "a header spelled `x_fence` aliases the token header `X-Fence`; use `-`, not `_`",
        ),
        (
            &[("x-fence", "5"), ("connection", "X-Fence")][..],
            "the Connection header names the token header `X-Fence`, which would strip it in transit",
        ),
    ] {
        assert_exact(
            &send("PUT", &url, headers, "x").await,
            400,
            &[PROBLEM],
            &format!(
                r#"{{"type":"urn:fencegate:invalid-token","title":"Invalid fencing token","status":400,"detail":"{detail}","resource":"account:42"}}"#
            ),
        );
    }
    assert_eq!(up.count(), 0);
}

/// The idempotency key refusals name the configured key header.
#[tokio::test]
async fn idempotency_key_refusals_name_the_configured_header() {
    let up = Upstream::start().await;
    let fg = fencegate(
        &up.url(),
        &format!("idempotency: {{ header: request-id, window: 1m }}\n{ACCOUNTS}"),
    )
    .await;
    let url = format!("http://{}/accounts/3", fg.listen);
    let long = "k".repeat(256);
    for (key, detail) in [
        (
            &[("request-id", "a"), ("request-id", "b")][..],
            "more than one `Request-Id` header: send the key once".to_owned(),
        ),
        (
            &[("request-id", long.as_str())][..],
            "the `Request-Id` header must be 1 to 255 characters, got 256".to_owned(),
        ),
        (
            &[("request-id", "a b")][..],
            "the `Request-Id` header may only contain visible ASCII characters (no spaces or control bytes)".to_owned(),
        ),
    ] {
        let headers: Vec<_> = [("fencing-token", "5")].iter().chain(key).copied().collect();
        assert_exact(
            &send("PUT", &url, &headers, "x").await,
            400,
            &[PROBLEM],
            &format!(
                r#"{{"type":"urn:fencegate:invalid-idempotency-key","title":"Invalid idempotency key","status":400,"detail":"{detail}","resource":"account:3","token":5}}"#
            ),
        );
    }
    assert_eq!(up.count(), 0);
}
