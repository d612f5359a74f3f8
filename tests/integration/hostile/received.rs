//! The upstream applies exactly what was fenced: for every request the upstream received, read
//! the way a permissive downstream reads it, the write it performs (method, resource, token)
//! must be one the fence decided on.
//!
//! A downstream reads more leniently than the fence parses: WSGI, CGI and Rack fold `_` into
//! `-` in header names and pick any of several values; frameworks honour method override
//! headers, decode path captures (`u%3A1` is `u:1`) and gRPC binary metadata (`AQ==` and `AQ`
//! are one value); a tenant header that did not arrive falls back to a default tenant; the host
//! is the one `X-Forwarded-Host` reports. [`readings`] lists every write such a downstream
//! could perform for one received request, and [`violations`] holds each against two rules:
//!
//! - **monotonic as applied**: its token is at least every token the upstream already applied
//!   to the same resource (as the upstream reads it);
//! - **fenced as applied**: the fence recorded a maximum at least that token for that very
//!   resource (a write the fence admitted for another resource, or not at all, fails it).
//!
//! [`hostile_variants_reach_the_upstream_only_as_fenced`] sends hostile spellings of every
//! header and path the fence reads, with a stale token, and prints what became of each; the
//! negative controls show the checker fires on a known-bad history and on a pipeline that
//! strips a fenced header after the fence decided.

use crate::common::rid;
use fencegate::fence::Token;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use base64::Engine;
use http::Method;

use super::*;

/// The routes of this suite, and how the permissive downstream names their resources.
const ROUTES: &str = "routes:
  - { name: accounts, path: '/accounts/{id}', resource: 'account:{id}' }
  - { name: tenants, path: /jobs, resource: 'tenant:{header:X-Tenant}' }
  - { name: shards, path: /shards, resource: 'shard:{header:X-Shard-Bin}' }
  - { name: sites, path: /site, resource: 'site:{header:Host}' }
  - { name: queues, path: /queue, resource: 'queue:{query:name}' }
";

/// One write a downstream could perform for a received request.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Reading {
    method: String,
    resource: String,
    token: Option<u64>,
}

/// A rule broken by one reading of one received request (by its position in the history).
#[derive(Debug, PartialEq, Eq)]
struct Violation {
    at: usize,
    reading: Reading,
    rule: &'static str,
}

/// The values a downstream that folds `_` into `-` and ignores case could read for `name`,
/// from every spelling and every line.
fn lenient(seen: &Seen, name: &str) -> Vec<String> {
    seen.headers
        .iter()
        .filter(|(k, _)| k.as_str().replace('_', "-") == name)
        .filter_map(|(_, v)| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|v| v.trim().to_owned())
        .collect()
}

/// The values a form-style query parser could read for `name`: pairs split on `&` and on `;`
/// (Rack 2, older Go and Python), keys and values percent-decoded with `+` as a space.
fn lenient_query(seen: &Seen, name: &str) -> Vec<String> {
    let query = seen.target.split_once('?').map_or("", |(_, q)| q);
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(&s.replace('+', " "))
            .decode_utf8_lossy()
            .into_owned()
    };
    query
        .split(['&', ';'])
        .filter_map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (decode(k) == name).then(|| decode(v))
        })
        .collect()
}

/// `values`, or `fallback` when there is none (the downstream's default).
fn or_default(values: Vec<String>, fallback: Option<&str>) -> Vec<String> {
    if values.is_empty() {
        fallback.map(str::to_owned).into_iter().collect()
    } else {
        values
    }
}

/// Every write the permissive downstream could perform for `seen`.
fn readings(seen: &Seen) -> Vec<Reading> {
    let mut methods = vec![seen.method.as_str().to_owned()];
    for name in [
        "x-http-method-override",
        "x-http-method",
        "x-method-override",
    ] {
        methods.extend(lenient(seen, name).iter().map(|m| m.to_ascii_uppercase()));
    }
    let writes: Vec<String> = methods
        .into_iter()
        .filter(|m| !matches!(m.as_str(), "GET" | "HEAD" | "OPTIONS"))
        .collect();
    let path = seen.target.split('?').next().unwrap_or_default();
    let decoded = percent_encoding::percent_decode_str(path)
        .decode_utf8_lossy()
        .into_owned();
    let resources: Vec<String> = if let Some(id) = decoded.strip_prefix("/accounts/") {
        vec![format!("account:{}", id.trim_end_matches('/'))]
    } else if decoded == "/jobs" {
        or_default(lenient(seen, "x-tenant"), Some("default"))
            .into_iter()
            .map(|t| format!("tenant:{t}"))
            .collect()
    } else if decoded == "/shards" {
        let lenient_b64 = base64::engine::GeneralPurpose::new(
            &base64::alphabet::STANDARD,
            base64::engine::GeneralPurposeConfig::new()
                .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent)
                .with_decode_allow_trailing_bits(true),
        );
        lenient(seen, "x-shard-bin")
            .iter()
            .filter_map(|v| lenient_b64.decode(v).ok())
            .map(|bytes| format!("shard:{bytes:?}"))
            .collect()
    } else if decoded == "/site" {
        // The site is the host the proxy reports; without a report, the Host it was sent.
        let reported = lenient(seen, "x-forwarded-host");
        let hosts = if reported.is_empty() {
            lenient(seen, "host")
        } else {
            reported
        };
        hosts.into_iter().map(|h| format!("site:{h}")).collect()
    } else if decoded == "/queue" {
        lenient_query(seen, "name")
            .into_iter()
            .map(|q| format!("queue:{q}"))
            .collect()
    } else {
        Vec::new()
    };
    let tokens: Vec<Option<u64>> = {
        let values = lenient(seen, "fencing-token");
        if values.is_empty() {
            vec![None]
        } else {
            values.iter().map(|v| v.parse().ok()).collect()
        }
    };
    let mut out = BTreeSet::new();
    for method in &writes {
        for resource in &resources {
            for token in &tokens {
                out.insert(Reading {
                    method: method.clone(),
                    resource: resource.clone(),
                    token: *token,
                });
            }
        }
    }
    out.into_iter().collect()
}

/// The readings of `history` that break a rule; `recorded` is the fence's maximum for a
/// resource id as the downstream names it (`shard:` resources are named by their bytes, so
/// the fence's base64 name is asked).
fn violations(history: &[Seen], recorded: &BTreeMap<String, Option<u64>>) -> Vec<Violation> {
    let mut applied: BTreeMap<String, u64> = BTreeMap::new();
    let mut out = Vec::new();
    for (at, seen) in history.iter().enumerate() {
        for reading in readings(seen) {
            let mut broke = |rule| {
                out.push(Violation {
                    at,
                    reading: reading.clone(),
                    rule,
                })
            };
            let Some(token) = reading.token else {
                broke("a fenced write reached the upstream without a token");
                continue;
            };
            if applied
                .get(&reading.resource)
                .is_some_and(|&max| token < max)
            {
                broke("monotonic as applied: a token below one already applied");
            }
            if recorded.get(&reading.resource).copied().flatten() < Some(token) {
                broke("fenced as applied: the fence recorded no such token for this resource");
            }
            let max = applied.entry(reading.resource.clone()).or_default();
            *max = (*max).max(token);
        }
    }
    out
}

/// The fence's name for a resource the downstream names (`shard:[1]` is `shard:AQ`).
fn fence_name(resource: &str) -> String {
    match resource.strip_prefix("shard:") {
        Some(bytes) => {
            let bytes: Vec<u8> = bytes
                .trim_matches(['[', ']'])
                .split(',')
                .filter(|b| !b.trim().is_empty())
                .map(|b| b.trim().parse().unwrap())
                .collect();
            format!(
                "shard:{}",
                base64::engine::general_purpose::STANDARD_NO_PAD.encode(bytes)
            )
        }
        None => resource.to_owned(),
    }
}

/// The fence under test: the proxy, or the in-process layer in front of an axum app that
/// records what it receives (and the store the layer raises, to read its maxima).
enum Front<'a> {
    Proxy(&'a fencegate::app::Server),
    Layer {
        addr: SocketAddr,
        store: Arc<dyn fencegate::store::FenceStore>,
        seen: Arc<Mutex<Vec<Seen>>>,
    },
}

impl Front<'_> {
    fn addr(&self) -> SocketAddr {
        match self {
            Front::Proxy(fg) => fg.listen,
            Front::Layer { addr, .. } => *addr,
        }
    }

    /// The fence's maximum for a resource, by its fence name.
    async fn recorded(&self, name: &str) -> Option<u64> {
        match self {
            Front::Proxy(fg) => {
                let path =
                    percent_encoding::utf8_percent_encode(name, percent_encoding::NON_ALPHANUMERIC);
                recorded(fg, &path.to_string()).await
            }
            Front::Layer { store, .. } => store.current(&rid(name)).await.unwrap().map(Token::get),
        }
    }

    /// What the service behind the fence received, in order.
    fn history(&self, up: Option<&Upstream>) -> Vec<Seen> {
        match self {
            Front::Proxy(_) => up.expect("the proxy's upstream").seen(),
            Front::Layer { seen, .. } => seen.lock().unwrap().clone(),
        }
    }
}

/// The layer of a config with `routes`, the memory store, in front of an axum app that records
/// every request it receives and answers 200.
async fn layer_front(routes: &str) -> Front<'static> {
    use tower_layer::Layer;
    let yaml = format!("upstream: http://unused.invalid\nstore: {{ kind: memory }}\n{routes}");
    let config = fencegate::config::Config::parse(&yaml).unwrap();
    let store: Arc<dyn fencegate::store::FenceStore> =
        Arc::new(fencegate::store::MemoryStore::new());
    let fence =
        fencegate::layer::FenceLayer::new(&config, Arc::clone(&store), prometheus::Registry::new())
            .unwrap();
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let log = Arc::clone(&seen);
    let app = tower::service_fn(
        move |req: http::Request<fencegate::layer::RequestBody<axum::body::Body>>| {
            let log = Arc::clone(&log);
            async move {
                let (parts, _) = req.into_parts();
                log.lock().unwrap().push(Seen {
                    method: parts.method,
                    target: parts
                        .uri
                        .path_and_query()
                        .map(|p| p.to_string())
                        .unwrap_or_default(),
                    headers: parts.headers,
                    body: bytes::Bytes::new(),
                });
                Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::from("ok")))
            }
        },
    );
    let router = axum::Router::new().fallback_service(fence.layer(app));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    Front::Layer { addr, store, seen }
}

/// What the fence recorded for every resource the history's readings name.
async fn maxima(front: &Front<'_>, history: &[Seen]) -> BTreeMap<String, Option<u64>> {
    let mut out = BTreeMap::new();
    for reading in history.iter().flat_map(readings) {
        if let std::collections::btree_map::Entry::Vacant(entry) = out.entry(reading.resource) {
            let max = front.recorded(&fence_name(entry.key())).await;
            entry.insert(max);
        }
    }
    out
}

/// A raw HTTP/1.1 request: `line` (method and target), `headers` (each ending in CRLF),
/// `Host: host`, no body.
fn request(line: &str, host: &str, headers: &str) -> String {
    format!("{line} HTTP/1.1\r\nHost: {host}\r\n{headers}Content-Length: 0\r\nConnection: close\r\n\r\n")
}

/// The current writes: token 10 on the resource each hostile variant aims at.
fn current() -> Vec<(&'static str, String)> {
    vec![
        (
            "account u:1",
            request("PUT /accounts/u:1", "x", "Fencing-Token: 10\r\n"),
        ),
        (
            "default tenant",
            request(
                "POST /jobs",
                "x",
                "X-Tenant: default\r\nFencing-Token: 10\r\n",
            ),
        ),
        (
            "shard [1]",
            request(
                "POST /shards",
                "x",
                "X-Shard-Bin: AQ\r\nFencing-Token: 10\r\n",
            ),
        ),
        (
            "site a.example",
            request("PUT /site", "a.example", "Fencing-Token: 10\r\n"),
        ),
        (
            "queue a b",
            request("POST /queue?name=a%20b", "x", "Fencing-Token: 10\r\n"),
        ),
    ]
}

/// Hostile spellings with the stale token 5, aimed at the resources [`current`] raised, each
/// with the status it must get: 409 when the fence reads the spelling as the resource it
/// aims at, 400 when the fence cannot tell which resource the downstream would write, 200
/// for the one that names another resource all along (the spoofed `X-Forwarded-Host` is
/// replaced, so the write lands on the host it was sent to, as fenced).
fn hostile() -> Vec<(&'static str, String, u16)> {
    let stale = "Fencing-Token: 5\r\n";
    let with = |h: &str| format!("{h}{stale}");
    vec![
        (
            "override with `_`: GET + X_HTTP_Method_Override: PUT",
            request(
                "GET /accounts/u:1",
                "x",
                &with("X_HTTP_Method_Override: PUT\r\n"),
            ),
            400,
        ),
        (
            "override with one `_`: GET + X-HTTP_Method-Override: DELETE",
            request(
                "GET /accounts/u:1",
                "x",
                &with("X-HTTP_Method-Override: DELETE\r\n"),
            ),
            400,
        ),
        (
            "override with `_`: GET + x_method_override: PATCH",
            request(
                "GET /accounts/u:1",
                "x",
                &with("x_method_override: PATCH\r\n"),
            ),
            400,
        ),
        (
            "override with `_`: POST + X_HTTP_Method: DELETE",
            request(
                "POST /accounts/u:1",
                "x",
                &with("X_HTTP_Method: DELETE\r\n"),
            ),
            400,
        ),
        (
            "encoded capture: /accounts/u%3A1",
            request("PUT /accounts/u%3A1", "x", stale),
            409,
        ),
        (
            "encoded capture, lower-case hex: /accounts/u%3a1",
            request("PUT /accounts/u%3a1", "x", stale),
            409,
        ),
        (
            "encoded unreserved: /accounts/%75:1",
            request("PUT /accounts/%75:1", "x", stale),
            409,
        ),
        (
            "trailing slash: /accounts/u:1/",
            request("PUT /accounts/u:1/", "x", stale),
            409,
        ),
        (
            "resource header nominated: X-Tenant: fresh, Connection: X-Tenant",
            request(
                "POST /jobs",
                "x",
                &with("X-Tenant: fresh\r\nConnection: X-Tenant\r\n"),
            ),
            400,
        ),
        (
            "resource header nominated in a second Connection line",
            request(
                "POST /jobs",
                "x",
                &with("X-Tenant: fresh\r\nConnection: keep-alive\r\nConnection: x-tenant\r\n"),
            ),
            400,
        ),
        (
            "resource header with `_`: X_Tenant: default",
            request("POST /jobs", "x", &with("X_Tenant: default\r\n")),
            400,
        ),
        (
            "resource header with `_` beside it: X-Tenant: fresh, X_Tenant: default",
            request(
                "POST /jobs",
                "x",
                &with("X-Tenant: fresh\r\nX_Tenant: default\r\n"),
            ),
            400,
        ),
        (
            "resource header twice",
            request(
                "POST /jobs",
                "x",
                &with("X-Tenant: fresh\r\nX-Tenant: default\r\n"),
            ),
            400,
        ),
        (
            "resource header missing",
            request("POST /jobs", "x", stale),
            400,
        ),
        (
            "binary metadata padded: X-Shard-Bin: AQ==",
            request("POST /shards", "x", &with("X-Shard-Bin: AQ==\r\n")),
            409,
        ),
        (
            "binary metadata with unused bits set: X-Shard-Bin: AR==",
            request("POST /shards", "x", &with("X-Shard-Bin: AR==\r\n")),
            409,
        ),
        (
            "binary metadata as two values: X-Shard-Bin: Ag,AQ",
            request("POST /shards", "x", &with("X-Shard-Bin: Ag,AQ\r\n")),
            400,
        ),
        (
            "forwarded host spoofed: Host: b.example, X-Forwarded-Host: a.example",
            request(
                "PUT /site",
                "b.example",
                &with("X-Forwarded-Host: a.example\r\n"),
            ),
            200,
        ),
        (
            "absolute form: PUT http://a.example/site, Host: b.example",
            request("PUT http://a.example/site", "b.example", stale),
            409,
        ),
        (
            "host nominated: Host: b.example, Connection: Host",
            request("PUT /site", "b.example", &with("Connection: Host\r\n")),
            400,
        ),
        (
            "query value with `+` for the space: ?name=a+b",
            request("POST /queue?name=a+b", "x", stale),
            409,
        ),
        (
            "query key encoded: ?n%61me=a%20b",
            request("POST /queue?n%61me=a%20b", "x", stale),
            409,
        ),
        (
            "query key with `+`: ?name+=x&name=a%20b",
            request("POST /queue?name+=x&name=a%20b", "x", stale),
            409,
        ),
        (
            "query given twice: ?name=c&name=a%20b",
            request("POST /queue?name=c&name=a%20b", "x", stale),
            400,
        ),
        (
            "query split on `;`: ?name=c;name=a%20b",
            request("POST /queue?name=c;name=a%20b", "x", stale),
            400,
        ),
        (
            "token with `_`: Fencing_Token",
            request("PUT /accounts/u:1", "x", "Fencing_Token: 5\r\n"),
            400,
        ),
    ]
}

/// Sends `requests` in order to `addr`; returns each with the status it got.
async fn run(addr: SocketAddr, requests: Vec<(&'static str, String)>) -> Vec<(&'static str, u16)> {
    let mut out = Vec::new();
    for (what, request) in requests {
        let resp = raw(addr, request.as_bytes()).await;
        out.push((what, status_of(&resp)));
    }
    out
}

#[tokio::test]
async fn hostile_variants_reach_the_upstream_only_as_fenced() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ROUTES).await;
    for (what, status) in run(fg.listen, current()).await {
        assert_eq!(status, 200, "{what}");
    }
    let variants = hostile();
    let sent = variants.iter().map(|(w, r, _)| (*w, r.clone())).collect();
    let answered = run(fg.listen, sent).await;
    let history = up.seen();
    let found = violations(&history, &maxima(&Front::Proxy(&fg), &history).await);
    println!(
        "received = fenced: {} hostile variants, stale token 5 after 10",
        answered.len()
    );
    for (what, status) in &answered {
        println!("  {status}  {what}");
    }
    println!(
        "  upstream received {} requests; violations: {}",
        history.len(),
        found.len()
    );
    assert_eq!(found, [], "{history:#?}");
    let want: Vec<(&str, u16)> = variants.iter().map(|(w, _, s)| (*w, *s)).collect();
    assert_eq!(answered, want);
    // The current writes and the one write to another site; nothing else.
    assert_eq!(history.len(), current().len() + 1);
    let spoofed = &history[current().len()];
    assert_eq!(spoofed.headers["x-forwarded-host"], "b.example");
    assert_eq!(spoofed.token(), Some(5));
    assert_eq!(recorded(&fg, "account:u:1").await, Some(10));
    assert_eq!(recorded(&fg, "tenant:default").await, Some(10));
    assert_eq!(recorded(&fg, "tenant:fresh").await, None);
    assert_eq!(recorded(&fg, "shard:AQ").await, Some(10));
    assert_eq!(recorded(&fg, "site:a.example").await, Some(10));
    assert_eq!(recorded(&fg, "site:b.example").await, Some(5));
    assert_eq!(recorded(&fg, "queue:a%20b").await, Some(10));
}

/// The spellings the fence reads as one resource are one resource to it, whichever comes
/// first: the current token written in a hostile spelling makes the plain spelling's stale
/// token stale, and a new token in the plain spelling is admitted.
#[tokio::test]
async fn one_resource_whatever_its_spelling() {
    let up = Upstream::start().await;
    let fg = fencegate(&up.url(), ROUTES).await;
    let pairs = [
        (
            "PUT /accounts/u%3a1",
            "",
            "PUT /accounts/u:1",
            "",
            "account:u:1",
        ),
        (
            "POST /shards",
            "X-Shard-Bin: AQ==\r\n",
            "POST /shards",
            "X-Shard-Bin: AR\r\n",
            "shard:AQ",
        ),
    ];
    for (first, first_headers, then, then_headers, resource) in pairs {
        let write = |line: &str, headers: &str, token: u64| {
            request(line, "x", &format!("{headers}Fencing-Token: {token}\r\n"))
        };
        let resp = raw(fg.listen, write(first, first_headers, 10).as_bytes()).await;
        assert_eq!(status_of(&resp), 200, "{resp}");
        let resp = raw(fg.listen, write(then, then_headers, 5).as_bytes()).await;
        assert_eq!(status_of(&resp), 409, "{resp}");
        assert!(
            resp.contains(&format!("\"resource\":\"{resource}\"")),
            "{resp}"
        );
        let resp = raw(fg.listen, write(then, then_headers, 11).as_bytes()).await;
        assert_eq!(status_of(&resp), 200, "{resp}");
        assert_eq!(recorded(&fg, resource).await, Some(11));
    }
    // The upstream gets the path as sent (normalised), not the decoded id.
    let targets: Vec<String> = up.seen().iter().map(|s| s.target.clone()).collect();
    assert_eq!(
        targets,
        ["/accounts/u%3A1", "/accounts/u:1", "/shards", "/shards"]
    );
    let history = up.seen();
    assert_eq!(
        violations(&history, &maxima(&Front::Proxy(&fg), &history).await),
        []
    );
}

/// The negative control on a known-bad history: a stale token applied after a newer one, a
/// write the fence never recorded, an override that turns a read into a write, and a write
/// without a token all fire.
#[test]
fn the_checker_fires_on_a_bad_history() {
    let seen = |method: &str, target: &str, headers: &[(&'static str, &'static str)]| {
        let mut map = http::HeaderMap::new();
        for (k, v) in headers {
            map.append(*k, http::HeaderValue::from_static(v));
        }
        Seen {
            method: Method::from_bytes(method.as_bytes()).unwrap(),
            target: target.to_owned(),
            headers: map,
            body: bytes::Bytes::new(),
        }
    };
    let history = [
        seen("PUT", "/accounts/u:1", &[("fencing-token", "10")]),
        seen(
            "GET",
            "/accounts/u%3A1",
            &[("x_http_method_override", "PUT"), ("fencing-token", "5")],
        ),
        seen("POST", "/jobs", &[("fencing-token", "7")]),
        seen("PUT", "/accounts/u:2", &[]),
        seen("PUT", "/accounts/u:1", &[("fencing-token", "9")]),
        seen("GET", "/accounts/u:1", &[("fencing-token", "1")]),
    ];
    let recorded: BTreeMap<String, Option<u64>> = [
        ("account:u:1".to_owned(), Some(10)),
        ("tenant:default".to_owned(), None),
    ]
    .into();
    let found: Vec<(usize, &str)> = violations(&history, &recorded)
        .iter()
        .map(|v| (v.at, v.rule))
        .collect();
    assert_eq!(
        found,
        [
            (1, "monotonic as applied: a token below one already applied"),
            (
                2,
                "fenced as applied: the fence recorded no such token for this resource"
            ),
            (3, "a fenced write reached the upstream without a token"),
            (4, "monotonic as applied: a token below one already applied"),
        ]
    );
}

/// The negative control on a real run: a pipeline that strips the header the fence named the
/// resource by, after the fence decided, lands a stale write on the default tenant; the
/// checker says so.
#[tokio::test]
async fn the_checker_fires_when_a_fenced_header_is_stripped() {
    let up = Upstream::stripping("x-tenant").await;
    let fg = fencegate(&up.url(), ROUTES).await;
    let writes = vec![
        (
            "default tenant",
            request(
                "POST /jobs",
                "x",
                "X-Tenant: default\r\nFencing-Token: 10\r\n",
            ),
        ),
        (
            "fresh tenant, stale for the default",
            request("POST /jobs", "x", "X-Tenant: fresh\r\nFencing-Token: 5\r\n"),
        ),
    ];
    for (what, status) in run(fg.listen, writes).await {
        assert_eq!(status, 200, "{what}");
    }
    let history = up.seen();
    let found = violations(&history, &maxima(&Front::Proxy(&fg), &history).await);
    println!("received = fenced, negative control (X-Tenant stripped after the fence): {found:?}");
    let rules: Vec<(usize, &str)> = found.iter().map(|v| (v.at, v.rule)).collect();
    assert_eq!(
        rules,
        [(1, "monotonic as applied: a token below one already applied")]
    );
}

/// The same hostile variants through the in-process layer, in front of an axum app: what the
/// app received, read as a permissive app reads it, is what the fence decided on. (The site
/// variants are the proxy's: in-process, nothing rewrites `X-Forwarded-Host`, and which host
/// the app reads is its own choice.)
#[tokio::test]
async fn hostile_variants_reach_the_app_behind_the_layer_only_as_fenced() {
    let routes = ROUTES
        .lines()
        .filter(|l| !l.contains("/site"))
        .collect::<Vec<_>>()
        .join("\n");
    let front = layer_front(&format!("{routes}\n")).await;
    let current: Vec<_> = current()
        .into_iter()
        .filter(|(w, _)| !w.starts_with("site"))
        .collect();
    let writes = current.len();
    for (what, status) in run(front.addr(), current).await {
        assert_eq!(status, 200, "{what}");
    }
    let variants: Vec<_> = hostile()
        .into_iter()
        .filter(|(_, r, _)| !r.contains("/site "))
        .collect();
    let sent = variants.iter().map(|(w, r, _)| (*w, r.clone())).collect();
    let answered = run(front.addr(), sent).await;
    let history = front.history(None);
    let found = violations(&history, &maxima(&front, &history).await);
    println!(
        "received = fenced, in-process: {} hostile variants; the app received {} requests; violations: {}",
        answered.len(),
        history.len(),
        found.len()
    );
    assert_eq!(found, [], "{history:#?}");
    let want: Vec<(&str, u16)> = variants.iter().map(|(w, _, s)| (*w, *s)).collect();
    assert_eq!(answered, want);
    assert_eq!(history.len(), writes);
    assert_eq!(front.recorded("account:u:1").await, Some(10));
    assert_eq!(front.recorded("shard:AQ").await, Some(10));
    assert_eq!(front.recorded("queue:a b").await, Some(10));
}
