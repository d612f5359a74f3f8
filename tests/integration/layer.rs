//! The fence in-process ([`fencegate::layer::FenceLayer`]), driven as a tower service without a
//! socket: the same decisions and refusals as the proxy (byte for byte), admitted requests
//! reaching the inner service unchanged (a path that was not normal, normalised), the serialize barrier held by the response body, and
//! gRPC calls refused in gRPC form.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use fencegate::config::Config;
use fencegate::layer::{FenceBody, FenceLayer, RequestBody};
use http::{HeaderMap, Request, Response, StatusCode, Version};
use http_body_util::{BodyExt, Full};
use tower::{Service, ServiceExt};
use tower_layer::Layer;

use crate::common::*;

/// The example itself, so that what it shows is tested.
#[allow(dead_code)]
#[path = "../../examples/axum_ledger.rs"]
mod axum_ledger;

/// Request headers, as name and value.
type Headers<'a> = &'a [(&'a str, &'a str)];

/// What the inner service saw: method, path and token of each request.
type Log = Arc<Mutex<Vec<(String, String, Option<String>)>>>;

type Inner = tower::util::BoxCloneSyncService<
    Request<RequestBody<Full<Bytes>>>,
    Response<Full<Bytes>>,
    Infallible,
>;

/// The layer over a service that records each request and answers 200 `stored`.
async fn fenced(extra: &str) -> (fencegate::layer::FenceService<Inner>, Log) {
    let store = if extra.lines().any(|l| l.starts_with("store:")) {
        ""
    } else {
        "store: { kind: memory }\n"
    };
    let yaml = format!("{store}{extra}");
    let config = Config::parse_fence(&yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    let log: Log = Arc::default();
    let seen = Arc::clone(&log);
    let inner = tower::service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
        let token = req
            .headers()
            .get("fencing-token")
            .map(|t| t.to_str().unwrap().to_owned());
        seen.lock()
            .unwrap()
            .push((req.method().to_string(), req.uri().path().to_owned(), token));
        async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("stored")))) }
    });
    let layer = FenceLayer::open(&config).await.unwrap();
    (layer.layer(Inner::new(inner)), log)
}

fn request(method: &str, path: &str, headers: &[(&str, &str)]) -> Request<Full<Bytes>> {
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "ledger");
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    req.body(Full::new(Bytes::from("body"))).unwrap()
}

/// One request through the layer, its response read whole.
async fn call(
    service: &mut fencegate::layer::FenceService<Inner>,
    req: Request<Full<Bytes>>,
) -> Reply {
    let response = service.ready().await.unwrap().call(req).await.unwrap();
    read(response).await
}

pub(super) async fn read(response: Response<FenceBody<Full<Bytes>>>) -> Reply {
    let (parts, body) = response.into_parts();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

/// The headers a refusal's client sees, but `date` and `content-length` (hyper's).
fn own_headers(headers: &HeaderMap) -> Vec<(String, String)> {
    let mut own: Vec<(String, String)> = headers
        .iter()
        .filter(|(name, _)| *name != "date" && *name != "content-length")
        .map(|(name, value)| (name.to_string(), value.to_str().unwrap().to_owned()))
        .collect();
    own.sort();
    own
}

#[tokio::test]
async fn the_layer_refuses_as_the_proxy_does_byte_for_byte() {
    let routes = "routes:
  - { name: accounts, path: '/accounts/{id}', resource: 'account:{id}' }
  - { name: tenants, path: '/tenants', resource: 'tenant:{header:x-tenant}' }
";
    let upstream = Upstream::start().await;
    let proxy = fencegate(&upstream.url(), routes).await;
    let (mut layer, log) = fenced(routes).await;

    // The same requests, in the same order, to both.
    let cases: [(&str, &str, Headers); 8] = [
        ("PUT", "/accounts/42", &[("fencing-token", "34")]),
        ("PUT", "/accounts/42", &[("fencing-token", "33")]),
        // Equal to the maximum: admitted (`token.equal: accept`, the default).
        ("PUT", "/accounts/42", &[("fencing-token", "34")]),
        ("PUT", "/accounts/42", &[]),
        ("PUT", "/accounts/42", &[("fencing-token", "007")]),
        ("POST", "/tenants", &[("fencing-token", "1")]),
        ("PUT", "/accounts/%2F", &[("fencing-token", "1")]),
        ("GET", "/accounts/42", &[]),
    ];
    let mut statuses = Vec::new();
    for (method, path, headers) in cases {
        let url = format!("http://{}{path}", proxy.listen);
        let by_proxy = send(method, &url, headers, "body").await;
        let in_process = call(&mut layer, request(method, path, headers)).await;
        assert_eq!(in_process.status, by_proxy.status, "{method} {path}");
        if by_proxy.status.is_success() {
            assert_eq!(in_process.text(), "stored");
        } else {
            assert_eq!(in_process.text(), by_proxy.text(), "{method} {path}");
            assert_eq!(
                own_headers(&in_process.headers),
                own_headers(&by_proxy.headers),
                "{method} {path}"
            );
        }
        statuses.push(in_process.status.as_u16());
    }
    assert_eq!(statuses, [200, 409, 200, 428, 400, 400, 400, 200]);

    // The stale refusal, as the proxy documents it.
    let stale = call(
        &mut layer,
        request("PUT", "/accounts/42", &[("fencing-token", "33")]),
    )
    .await;
    stale.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(stale.headers["fencing-token-current"], "34");
    assert_eq!(
        stale.text(),
        r#"{"type":"urn:fencegate:stale-token","title":"Stale fencing token","status":409,"detail":"token 33 is below 34, the highest token recorded for account:42; the write was not forwarded","resource":"account:42","token":33,"current_token":34}"#
    );

    // Only what the fence admitted (and the read) reached the service, unchanged.
    let seen = log.lock().unwrap().clone();
    assert_eq!(
        seen,
        [
            ("PUT".into(), "/accounts/42".into(), Some("34".into())),
            ("PUT".into(), "/accounts/42".into(), Some("34".into())),
            ("GET".into(), "/accounts/42".into(), None),
        ]
    );
    proxy.shutdown();
}

/// `token.max_step` in-process: a token too far above the maximum is refused before the inner
/// service, with the proxy's problem, and the maximum stays; within the step it is admitted.
#[tokio::test]
async fn the_layer_refuses_a_token_too_far_above_the_maximum() {
    let (mut layer, log) = fenced(&format!("token: {{ max_step: 100 }}\n{ACCOUNTS}")).await;
    let put = |token: &'static str| request("PUT", "/accounts/7", &[("fencing-token", token)]);
    assert_eq!(call(&mut layer, put("5")).await.status, StatusCode::OK);
    let refused = call(&mut layer, put("9223372036854775807")).await;
    refused.assert_problem(409, "urn:fencegate:token-too-far");
    assert_eq!(
        refused.text(),
        r#"{"type":"urn:fencegate:token-too-far","title":"Fencing token too far above the recorded maximum","status":409,"detail":"token 9223372036854775807 exceeds 5, the highest token recorded for account:7, by more than token.max_step (100); it was not forwarded and the recorded maximum is unchanged","resource":"account:7","token":9223372036854775807,"current_token":5,"max_step":100}"#
    );
    assert_eq!(refused.headers["fencing-token-current"], "5");
    call(&mut layer, put("106"))
        .await
        .assert_problem(409, "urn:fencegate:token-too-far");
    // The maximum stayed at 5: 105 is within the step, and 104 is then stale.
    assert_eq!(call(&mut layer, put("105")).await.status, StatusCode::OK);
    call(&mut layer, put("104"))
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
    let tokens: Vec<Option<String>> = log.lock().unwrap().iter().map(|s| s.2.clone()).collect();
    assert_eq!(tokens, [Some("5".to_owned()), Some("105".to_owned())]);
}

#[tokio::test]
async fn under_serialize_a_higher_token_waits_for_the_lower_ones_body() {
    let routes = "routes:
  - { name: accounts, path: '/accounts/{id}', resource: 'account:{id}', ordering: serialize, barrier_timeout: 5s }
";
    let (mut layer, log) = fenced(routes).await;
    let first = layer
        .ready()
        .await
        .unwrap()
        .call(request("PUT", "/accounts/7", &[("fencing-token", "5")]))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::OK);

    // Token 6 is admitted by the store, then waits for 5's write to finish: its body unread.
    let mut second_service = layer.clone();
    let second = tokio::spawn(async move {
        call(
            &mut second_service,
            request("PUT", "/accounts/7", &[("fencing-token", "6")]),
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !second.is_finished(),
        "6 went ahead of 5's unfinished write"
    );
    assert_eq!(log.lock().unwrap().len(), 1);

    let first = read(first).await;
    assert_eq!(first.text(), "stored");
    let second = tokio::time::timeout(Duration::from_secs(5), second)
        .await
        .expect("6 goes once 5 has finished")
        .unwrap();
    assert_eq!(second.status, StatusCode::OK);
    assert_eq!(log.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn a_grpc_call_is_refused_in_grpc_form() {
    let routes = "routes:
  - { name: deposit, path: /ledger.Ledger/Deposit, methods: [POST], resource: 'account:{header:x-account-id}' }
";
    let (mut layer, log) = fenced(routes).await;
    let call_with = |token: &str| {
        let mut req = request(
            "POST",
            "/ledger.Ledger/Deposit",
            &[
                ("content-type", "application/grpc"),
                ("x-account-id", "9"),
                ("fencing-token", token),
            ],
        );
        *req.version_mut() = Version::HTTP_2;
        req
    };
    let admitted = call(&mut layer, call_with("3")).await;
    assert_eq!(admitted.text(), "stored");

    let stale = call(&mut layer, call_with("2")).await;
    assert_eq!(stale.status, StatusCode::OK);
    assert_eq!(stale.headers["content-type"], "application/grpc");
    assert_eq!(stale.headers["grpc-status"], "10");
    assert_eq!(
        stale.headers["grpc-message"],
        "token 2 is below 3, the highest token recorded for account:9; the write was not forwarded"
    );
    assert_eq!(stale.headers["fencing-token-current"], "3");
    assert!(stale.body.is_empty());
    assert_eq!(log.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn the_axum_example_answers_a_stale_write_with_the_proxys_409() {
    let config = Config::parse_fence(axum_ledger::DEFAULT_CONFIG).unwrap();
    let app = axum_ledger::app(FenceLayer::open(&config).await.unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ledger = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let upstream = Upstream::start().await;
    let proxy = fencegate(&upstream.url(), ACCOUNTS).await;

    let url = format!("http://{ledger}/accounts/42");
    let stored = send("PUT", &url, &[("fencing-token", "34")], "100").await;
    assert_eq!(stored.text(), "account 42 = 100 (token 34)\n");
    let stale = send("PUT", &url, &[("fencing-token", "33")], "90").await;
    assert_eq!(put(&proxy, "42", "34").await.status, StatusCode::OK);
    let by_proxy = put(&proxy, "42", "33").await;
    by_proxy.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(stale.status, by_proxy.status);
    assert_eq!(stale.text(), by_proxy.text());
    assert_eq!(own_headers(&stale.headers), own_headers(&by_proxy.headers));
    let balance = send("GET", &url, &[], "").await;
    assert_eq!(balance.text(), "100\n");
    proxy.shutdown();
}

/// With `fence.authority: leases` the layer checks every token against the lease backend, as
/// the sidecar does: `FenceLayer::new`, which has no backend, refuses such a config instead of
/// fencing without it, and `FenceLayer::with_lease_backend` refuses a token below the latest
/// grant before the new holder has written anything.
#[tokio::test]
async fn an_authoritative_config_is_never_fenced_without_its_lease_backend() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        "store: {{ kind: memory }}\nfence: {{ authority: leases }}\n\
         leases: {{ backend: {{ kind: embedded, path: {} }}, ttl: 5s }}\n{ACCOUNTS}",
        dir.path().join("leases.db").display()
    );
    let config = Config::parse_fence(&yaml).unwrap();
    let store = || Arc::new(fencegate::store::MemoryStore::new());
    let refused = FenceLayer::new(&config, store(), prometheus::Registry::new()).err();
    assert_eq!(
        refused.map(|e| e.to_string()).as_deref(),
        Some(
            "fence.authority: leases checks every token against the lease backend, which \
             FenceLayer::new does not open: use FenceLayer::open, or \
             FenceLayer::with_lease_backend"
        )
    );

    let backend = fencegate::lease::open(&config.leases.as_ref().unwrap().backend)
        .await
        .unwrap();
    let ttl = Duration::from_secs(5);
    let grant = |acquired| match acquired {
        Ok(fencegate::lease::Acquired::Granted(grant)) => grant,
        other => panic!("not granted: {other:?}"),
    };
    let first = grant(backend.try_acquire("account:42", "worker-1", ttl).await);
    assert!(backend.release(&first).await.unwrap());
    let second = grant(backend.try_acquire("account:42", "worker-2", ttl).await);
    let layer = FenceLayer::with_lease_backend(
        &config,
        store(),
        Arc::clone(&backend),
        prometheus::Registry::new(),
    )
    .unwrap();
    let seen: Log = Arc::default();
    let log = Arc::clone(&seen);
    let inner = tower::service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
        log.lock()
            .unwrap()
            .push((req.method().to_string(), req.uri().path().to_owned(), None));
        async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("stored")))) }
    });
    let mut service = layer.layer(Inner::new(inner));
    let token = first.token.to_string();
    let stale = request("PUT", "/accounts/42", &[("fencing-token", &token)]);
    let body = call(&mut service, stale)
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(body["token"], first.token.get());
    assert_eq!(body["current_token"], second.token.get());
    assert!(seen.lock().unwrap().is_empty());
    let token = second.token.to_string();
    let fresh = request("PUT", "/accounts/42", &[("fencing-token", &token)]);
    assert_eq!(call(&mut service, fresh).await.status, 200);
    assert_eq!(seen.lock().unwrap().len(), 1);
}

/// axum hands its handler the decoded capture: `u%3A1` and `u:1` are one account to the
/// ledger, so they are one resource to the fence, and the stale write in the other spelling
/// never reaches the balance.
#[tokio::test]
async fn the_axum_example_fences_every_spelling_of_an_account_as_one() {
    let config = Config::parse_fence(axum_ledger::DEFAULT_CONFIG).unwrap();
    let app = axum_ledger::app(FenceLayer::open(&config).await.unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ledger = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });

    let encoded = format!("http://{ledger}/accounts/u%3A1");
    let stored = send("PUT", &encoded, &[("fencing-token", "10")], "100").await;
    assert_eq!(stored.text(), "account u:1 = 100 (token 10)\n");
    let plain = format!("http://{ledger}/accounts/u:1");
    let stale = send("PUT", &plain, &[("fencing-token", "5")], "90").await;
    let body = stale.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(body["resource"], "account:u:1");
    assert_eq!(body["current_token"], 10);
    assert_eq!(send("GET", &plain, &[], "").await.text(), "100\n");
    let lower = format!("http://{ledger}/accounts/u%3a1");
    let stale = send("PUT", &lower, &[("fencing-token", "9")], "80").await;
    stale.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(send("GET", &encoded, &[], "").await.text(), "100\n");
}

/// Under `ordering: serialize`, a write whose request future the server drops (its client went
/// away) while the service is writing keeps the barrier closed until the service has
/// finished: the next token does not reach the service alongside it.
#[tokio::test(start_paused = true)]
async fn a_dropped_serialized_call_keeps_the_barrier_until_the_service_finishes() {
    let yaml = "store: { kind: memory }\nroutes:
  - { name: accounts, path: '/accounts/{id}', resource: 'account:{id}', ordering: serialize, barrier_timeout: 5s }
";
    let config = Config::parse_fence(yaml).unwrap();
    let layer = FenceLayer::open(&config).await.unwrap();
    // The service writes token 5 until `finish` lets it; every call logs its start and end.
    let events: Arc<Mutex<Vec<String>>> = Arc::default();
    let finish = Arc::new(tokio::sync::Semaphore::new(0));
    let started = Arc::new(tokio::sync::Notify::new());
    let inner = {
        let (events, finish, started) = (events.clone(), finish.clone(), started.clone());
        tower::service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
            let token = req.headers()["fencing-token"].to_str().unwrap().to_owned();
            let (events, finish, started) = (events.clone(), finish.clone(), started.clone());
            async move {
                events.lock().unwrap().push(format!("start {token}"));
                started.notify_one();
                if token == "5" {
                    finish.acquire().await.unwrap().forget();
                }
                events.lock().unwrap().push(format!("end {token}"));
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("stored"))))
            }
        })
    };
    let service = layer.layer(Inner::new(inner));
    let put = |token: &'static str| {
        let mut service = service.clone();
        async move {
            let req = request("PUT", "/accounts/7", &[("fencing-token", token)]);
            service.ready().await.unwrap().call(req).await.unwrap()
        }
    };
    let first = tokio::spawn(put("5"));
    started.notified().await;
    first.abort();
    assert!(first.await.is_err_and(|e| e.is_cancelled()));

    // Token 6 waits for 5's write, which is still under way: at the barrier's timeout it is
    // refused, and never reaches the service.
    let refused = read(put("6").await).await;
    refused.assert_problem(503, "urn:fencegate:barrier-timeout");
    assert_eq!(*events.lock().unwrap(), ["start 5"]);

    // Once 5's write has finished, 6 goes.
    finish.add_permits(1);
    let admitted = read(put("6").await).await;
    assert_eq!(admitted.status, StatusCode::OK);
    assert_eq!(
        *events.lock().unwrap(),
        ["start 5", "end 5", "start 6", "end 6"]
    );
}

/// On the outermost router, after `nest`, the layer sees whole paths: a configuration written
/// for `/v1/accounts/{id}` fences the nested route.
#[tokio::test]
async fn the_layer_outside_a_nest_fences_whole_paths() {
    let yaml = "store: { kind: memory }\nroutes:
  - { name: accounts, path: '/v1/accounts/{id}', methods: [PUT], resource: 'account:{id}' }
";
    let config = Config::parse_fence(yaml).unwrap();
    let fence = FenceLayer::open(&config).await.unwrap();
    let accounts =
        axum::Router::new().route("/accounts/{id}", axum::routing::put(|| async { "stored" }));
    let app = axum::Router::new().nest("/v1", accounts).layer(fence);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let url = format!("http://{addr}/v1/accounts/42");
    let stored = send("PUT", &url, &[("fencing-token", "34")], "").await;
    assert_eq!(stored.text(), "stored");
    send("PUT", &url, &[("fencing-token", "33")], "")
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
    send("PUT", &url, &[], "")
        .await
        .assert_problem(428, "urn:fencegate:token-required");
}

/// The layer's metrics go to the app's registry when it gives one, and are exported with the
/// app's own: a refusal and an admitted write, by outcome, method and code.
#[tokio::test]
async fn the_layers_metrics_are_in_the_apps_registry() {
    let registry = prometheus::Registry::new();
    let own = prometheus::IntCounter::new("app_requests_total", "the app's own").unwrap();
    registry.register(Box::new(own.clone())).unwrap();
    let yaml = format!("store: {{ kind: memory }}\n{ACCOUNTS}");
    let config = Config::parse_fence(&yaml).unwrap();
    let layer = FenceLayer::open_in(&config, registry.clone())
        .await
        .unwrap();
    let inner = tower::service_fn(|_req: Request<RequestBody<Full<Bytes>>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("stored"))))
    });
    let mut service = layer.layer(Inner::new(inner));
    let put = |token: &str| request("PUT", "/accounts/1", &[("fencing-token", token)]);
    assert_eq!(call(&mut service, put("2")).await.status, 200);
    call(&mut service, put("1"))
        .await
        .assert_problem(409, "urn:fencegate:stale-token");
    own.inc();
    let mut text = String::new();
    prometheus::TextEncoder::new()
        .encode_utf8(&layer.registry().gather(), &mut text)
        .unwrap();
    for line in [
        "app_requests_total 1",
        r#"fencegate_requests_total{code="200",method="PUT",outcome="admitted",route="accounts"} 1"#,
        r#"fencegate_requests_total{code="409",method="PUT",outcome="stale",route="accounts"} 1"#,
    ] {
        assert!(text.contains(line), "missing {line} in\n{text}");
    }
}

/// Inside a nest, the layer sees the path without the nest's prefix: a configuration written
/// for whole paths matches nothing there. With `unmatched: reject`, as docs/library.md asks
/// of a layer that must sit inside a nest, that mistake refuses every request loudly (404
/// `no-route`) instead of forwarding writes unfenced.
#[tokio::test]
async fn a_layer_misplaced_inside_a_nest_refuses_loudly_with_unmatched_reject() {
    let yaml = "store: { kind: memory }\nunmatched: reject\nroutes:
  - { name: accounts, path: '/v1/accounts/{id}', methods: [PUT], resource: 'account:{id}' }
";
    let config = Config::parse_fence(yaml).unwrap();
    let fence = FenceLayer::open(&config).await.unwrap();
    let accounts = axum::Router::new()
        .route("/accounts/{id}", axum::routing::put(|| async { "stored" }))
        .layer(fence);
    let app = axum::Router::new().nest("/v1", accounts);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let url = format!("http://{addr}/v1/accounts/42");
    send("PUT", &url, &[("fencing-token", "33")], "")
        .await
        .assert_problem(404, "urn:fencegate:no-route");
}

/// `--help` (and `-h`) print the usage and run nothing; an unknown argument is an error.
#[test]
fn the_axum_example_prints_help() {
    let asked = |args: &[&str]| axum_ledger::parse_args(args.iter().map(|a| a.to_string()));
    for help in ["--help", "-h"] {
        assert!(matches!(asked(&[help]), Ok(axum_ledger::Asked::Help)));
    }
    assert!(axum_ledger::USAGE.starts_with("usage: axum_ledger [--listen ADDR] [--config FILE]\n"));
    assert!(matches!(
        asked(&["--listen", "127.0.0.1:0"]),
        Ok(axum_ledger::Asked::Run(_))
    ));
    assert_eq!(
        asked(&["--verbose"]).err().as_deref(),
        Some("unknown argument --verbose")
    );
}

/// The service behind the layer routes on the path the fence decided on: a path that was not
/// normal reaches it normalised (as the sidecar forwards it), so the write the fence admitted
/// for `account:42` is the write the service applies to account 42, and the query is kept.
#[tokio::test]
async fn the_service_gets_the_path_the_fence_decided_on() {
    let (mut service, log) = fenced(ACCOUNTS).await;
    let admitted = call(
        &mut service,
        request("PUT", "/accounts/7/../42?mode=a", &[("fencing-token", "5")]),
    )
    .await;
    assert_eq!(admitted.status, StatusCode::OK);
    let stale = call(
        &mut service,
        request("PUT", "/accounts/42", &[("fencing-token", "4")]),
    )
    .await;
    assert_eq!(stale.status, StatusCode::CONFLICT);
    let normal = call(
        &mut service,
        request("PUT", "/accounts/42", &[("fencing-token", "5")]),
    )
    .await;
    assert_eq!(normal.status, StatusCode::OK);
    let seen: Vec<String> = log
        .lock()
        .unwrap()
        .iter()
        .map(|(_, p, _)| p.clone())
        .collect();
    assert_eq!(seen, ["/accounts/42", "/accounts/42"]);
}
