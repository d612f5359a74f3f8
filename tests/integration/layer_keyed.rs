//! The layer with an `idempotency` section: writes carrying an `Idempotency-Key` are claimed,
//! replayed and recorded in-process as the sidecar does it (docs/idempotency.md), the service
//! in the upstream's place.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use fencegate::config::Config;
use fencegate::layer::{FenceLayer, FenceService, RequestBody};
use fencegate::store::{FenceStore, MemoryStore};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::sync::Notify;
use tower::{Layer, Service, ServiceExt};

use crate::common::Reply;
use crate::layer::read;

const KEYED: &str = "store: { kind: memory }
idempotency: { window: 1m }
timeouts: { upstream: 2s }
routes:
  - { name: accounts, path: '/accounts/{id}', methods: [PUT], resource: 'account:{id}' }
";

type Inner = tower::util::BoxCloneSyncService<
    Request<RequestBody<Full<Bytes>>>,
    Response<Full<Bytes>>,
    Infallible,
>;

/// What the service saw: the body of each call it ran.
type Ran = Arc<Mutex<Vec<Bytes>>>;

/// How the service answers.
#[derive(Clone)]
enum Answers {
    /// At once.
    AtOnce,
    /// Once it has said it started (`entered`) and `gate` lets it go on.
    Gated {
        entered: Arc<Notify>,
        gate: Arc<Notify>,
    },
    /// Never.
    Never,
}

/// The layer over `store` and a service that reads the body and answers `201` with
/// `ran <body>`.
fn keyed(store: &Arc<MemoryStore>, answers: Answers) -> (FenceService<Inner>, Ran) {
    let config = Config::parse_fence(KEYED).unwrap();
    let ran: Ran = Arc::default();
    let seen = Arc::clone(&ran);
    let inner = tower::service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
        let (seen, answers) = (Arc::clone(&seen), answers.clone());
        async move {
            match answers {
                Answers::AtOnce => {}
                Answers::Gated { entered, gate } => {
                    entered.notify_one();
                    gate.notified().await;
                }
                Answers::Never => std::future::pending().await,
            }
            let body = req.into_body().collect().await.unwrap().to_bytes();
            seen.lock().unwrap().push(body.clone());
            // An empty write is answered without a body.
            let (status, out) = if body.is_empty() {
                (StatusCode::NO_CONTENT, Bytes::new())
            } else {
                let ran = format!("ran {}", String::from_utf8_lossy(&body));
                (StatusCode::CREATED, Bytes::from(ran))
            };
            let mut response = Response::new(Full::new(out));
            *response.status_mut() = status;
            response
                .headers_mut()
                .insert("x-ledger", "1".parse().unwrap());
            Ok::<_, Infallible>(response)
        }
    });
    let store: Arc<dyn FenceStore> = Arc::clone(store) as _;
    let layer = FenceLayer::new(&config, store, prometheus::Registry::new()).unwrap();
    (layer.layer(Inner::new(inner)), ran)
}

fn put(token: &str, key: &str, body: &'static str) -> Request<Full<Bytes>> {
    Request::put("/accounts/42")
        .header("host", "ledger")
        .header("fencing-token", token)
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

async fn call(service: &mut FenceService<Inner>, req: Request<Full<Bytes>>) -> Reply {
    let response = service.ready().await.unwrap().call(req).await.unwrap();
    read(response).await
}

#[tokio::test]
async fn a_keyed_write_runs_once_and_its_retry_is_answered_from_the_record() {
    let store = Arc::new(MemoryStore::new());
    let (mut service, ran) = keyed(&store, Answers::AtOnce);
    let first = call(&mut service, put("5", "pay-1", "100")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body, "ran 100");
    assert_eq!(first.headers["x-ledger"], "1");
    assert!(first.headers.get("idempotent-replayed").is_none());

    let retry = call(&mut service, put("5", "pay-1", "100")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.body, "ran 100");
    assert_eq!(retry.headers["x-ledger"], "1");
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    // Also once a newer token was admitted: a replay reports, it executes nothing.
    assert_eq!(
        call(&mut service, put("6", "pay-2", "7")).await.body,
        "ran 7"
    );
    let late = call(&mut service, put("5", "pay-1", "100")).await;
    assert_eq!(late.headers["idempotent-replayed"], "true");
    assert_eq!(late.body, "ran 100");
    // The service saw the body the fence read, once per executed write.
    assert_eq!(*ran.lock().unwrap(), ["100", "7"]);

    let reused = call(&mut service, put("6", "pay-1", "999")).await;
    let body = reused.assert_problem(422, "urn:fencegate:idempotency-key-reused");
    assert_eq!(body["resource"], "account:42");
    let stale = call(&mut service, put("5", "pay-3", "1")).await;
    stale.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(stale.headers["fencing-token-current"], "6");
    assert_eq!(ran.lock().unwrap().len(), 2, "refused writes never ran");
}

#[tokio::test]
async fn a_retry_while_the_first_attempt_runs_is_refused_as_in_flight() {
    let (entered, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let answers = Answers::Gated {
        entered: Arc::clone(&entered),
        gate: Arc::clone(&gate),
    };
    let (service, ran) = keyed(&Arc::new(MemoryStore::new()), answers);
    let first = tokio::spawn(service.clone().oneshot(put("5", "pay-1", "100")));
    // The first attempt was claimed before the service was called.
    entered.notified().await;
    let mut retry = service.clone();
    let reply = call(&mut retry, put("5", "pay-1", "100")).await;
    reply.assert_problem(409, "urn:fencegate:idempotency-in-flight");
    assert_eq!(reply.headers["retry-after"], "1");
    gate.notify_one();
    let first = read(first.await.unwrap().unwrap()).await;
    assert_eq!(
        (first.status, &first.body[..]),
        (StatusCode::CREATED, &b"ran 100"[..])
    );
    let replayed = call(&mut retry, put("5", "pay-1", "100")).await;
    assert_eq!(replayed.headers["idempotent-replayed"], "true");
    assert_eq!(ran.lock().unwrap().len(), 1);
}

/// A service that does not answer within `timeouts.upstream`: its call is dropped, the client
/// gets `504`, and the outcome is unknown, so a retry with the same token executes.
#[tokio::test(start_paused = true)]
async fn a_service_that_does_not_answer_leaves_the_outcome_unknown() {
    let store = Arc::new(MemoryStore::new());
    let (mut silent, _) = keyed(&store, Answers::Never);
    let reply = call(&mut silent, put("5", "pay-1", "100")).await;
    let body = reply.assert_problem(504, "urn:fencegate:upstream-timeout");
    assert_eq!(body["resource"], "account:42");
    // The same store, now behind a service that answers: the retry executes.
    let (mut service, ran) = keyed(&store, Answers::AtOnce);
    let retry = call(&mut service, put("5", "pay-1", "100")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(*ran.lock().unwrap(), ["100"]);
}

/// A server that drops the call (its client went away) while the service runs the write:
/// the key stays in flight until the service has answered and its answer is recorded, so a
/// retry meanwhile is refused, not run alongside; afterwards it is replayed.
#[tokio::test]
async fn a_dropped_call_keeps_its_key_in_flight_until_the_service_answers() {
    let (entered, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let answers = Answers::Gated {
        entered: Arc::clone(&entered),
        gate: Arc::clone(&gate),
    };
    let (service, ran) = keyed(&Arc::new(MemoryStore::new()), answers);
    let first = tokio::spawn(service.clone().oneshot(put("5", "pay-1", "100")));
    entered.notified().await;
    first.abort();
    assert!(matches!(first.await, Err(e) if e.is_cancelled()));
    let mut retry = service.clone();
    let reply = call(&mut retry, put("5", "pay-1", "100")).await;
    reply.assert_problem(409, "urn:fencegate:idempotency-in-flight");
    // The service finishes the dropped call; its answer becomes the key's record.
    gate.notify_one();
    let replayed = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let reply = call(&mut retry, put("5", "pay-1", "100")).await;
            if reply.status != StatusCode::CONFLICT {
                break reply;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the dropped call's answer was never recorded");
    assert_eq!(replayed.status, StatusCode::CREATED);
    assert_eq!(replayed.body, "ran 100");
    assert_eq!(replayed.headers["idempotent-replayed"], "true");
    assert_eq!(*ran.lock().unwrap(), ["100"]);
}

/// A server never polls an answer without a body: it is recorded before it goes, so a retry is
/// answered from the record while the first answer is still unread.
#[tokio::test]
async fn an_answer_without_a_body_is_recorded_before_it_goes() {
    let (mut service, ran) = keyed(&Arc::new(MemoryStore::new()), Answers::AtOnce);
    let first = service
        .ready()
        .await
        .unwrap()
        .call(put("5", "pay-1", ""))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::NO_CONTENT);
    let _unread = first;
    let retry = call(&mut service, put("5", "pay-1", "")).await;
    assert_eq!(retry.status, StatusCode::NO_CONTENT);
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(*ran.lock().unwrap(), [""]);
}
