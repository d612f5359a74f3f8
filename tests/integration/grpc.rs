//! gRPC through fencegate, with a real client and server (tonic, over prost messages written by
//! hand): refusals as gRPC statuses, admitted calls, a server-streaming call proxied intact
//! (messages and trailers) over h2c and over TLS, to an h2c and to an `https` upstream, keyed
//! calls replayed with their status (a final one; a retryable one, the server's or a downstream
//! fencegate's, leaves the key free), and a content type in another case told a gRPC call.

use fencegate::layer::RequestBody;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use http::{HeaderMap, Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;

use crate::common::*;

/// `ledger.Ledger/Deposit`'s request; a negative amount is refused (`INVALID_ARGUMENT`).
#[derive(Clone, PartialEq, prost::Message)]
struct Deposit {
    #[prost(int64, tag = "1")]
    amount: i64,
}

/// `ledger.Ledger/Deposit`'s answer.
#[derive(Clone, PartialEq, prost::Message)]
struct Balance {
    #[prost(int64, tag = "1")]
    amount: i64,
}

/// `ledger.Ledger/History`'s request: `count` entries, then OK, or `OUT_OF_RANGE` when `fail`.
#[derive(Clone, PartialEq, prost::Message)]
struct History {
    #[prost(uint32, tag = "1")]
    count: u32,
    #[prost(bool, tag = "2")]
    fail: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Entry {
    #[prost(uint32, tag = "1")]
    seq: u32,
    #[prost(string, tag = "2")]
    text: String,
}

const DEPOSIT: &str = "/ledger.Ledger/Deposit";
const HISTORY: &str = "/ledger.Ledger/History";

/// Both methods fenced, on the account the `x-account-id` metadata names.
const ROUTES: &str = "routes:
  - { name: deposit, path: /ledger.Ledger/Deposit, methods: [POST], resource: 'account:{header:x-account-id}' }
  - { name: history, path: /ledger.Ledger/History, methods: [POST], resource: 'account:{header:x-account-id}' }
";

/// One call as the gRPC server saw it.
#[derive(Debug, Clone)]
struct Call {
    path: String,
    token: Option<String>,
    te: Option<String>,
}

/// How the ledger fails a `Deposit` instead of running it.
enum Failure {
    /// Trailers-only: the status in the response headers, no body (as tonic answers an error).
    TrailersOnly(Status),
    /// A message (the balance as it was), then the status in the trailers.
    InTrailers(Status),
    /// A message, then the stream breaks when the receiver is told to: no status at all.
    Broken(tokio::sync::oneshot::Receiver<()>),
}

/// A response body that sends `message`, then fails once `broken` is told to.
struct Breaking {
    message: Option<bytes::Bytes>,
    broken: tokio::sync::oneshot::Receiver<()>,
}

impl http_body::Body for Breaking {
    type Data = bytes::Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, std::io::Error>>> {
        if let Some(message) = self.message.take() {
            return std::task::Poll::Ready(Some(Ok(http_body::Frame::data(message))));
        }
        let _ = std::task::ready!(std::future::Future::poll(
            std::pin::Pin::new(&mut self.broken),
            cx
        ));
        std::task::Poll::Ready(Some(Err(std::io::Error::other("the ledger crashed"))))
    }
}

/// The ledger's gRPC server (HTTP/2 only, as gRPC servers are), recording each call.
#[derive(Clone, Default)]
struct Ledger {
    calls: Arc<Mutex<Vec<Call>>>,
    /// How the next `Deposit` calls fail, in order; then they run.
    failures: Arc<Mutex<VecDeque<Failure>>>,
    /// While set, connections are closed as soon as they are accepted.
    down: Arc<AtomicBool>,
}

impl Ledger {
    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    /// The next `Deposit` calls fail as listed.
    fn fail_next(&self, failures: impl IntoIterator<Item = Failure>) {
        self.failures.lock().unwrap().extend(failures);
    }

    fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// A failure's response: see [`Failure`].
    fn failed(failure: Failure) -> Response<tonic::body::Body> {
        use http_body_util::StreamBody;

        let message = prost::Message::encode_to_vec(&Balance { amount: 100 });
        let mut frame = vec![0u8];
        frame.extend_from_slice(&(message.len() as u32).to_be_bytes());
        frame.extend_from_slice(&message);
        let body = match failure {
            Failure::TrailersOnly(status) => return status.into_http(),
            Failure::InTrailers(status) => {
                let mut trailers = HeaderMap::new();
                status.add_header(&mut trailers).unwrap();
                let frames: [Result<_, Infallible>; 2] = [
                    Ok(http_body::Frame::data(frame.into())),
                    Ok(http_body::Frame::trailers(trailers)),
                ];
                tonic::body::Body::new(StreamBody::new(tokio_stream::iter(frames)))
            }
            Failure::Broken(broken) => tonic::body::Body::new(Breaking {
                message: Some(frame.into()),
                broken,
            }),
        };
        let mut response = Response::new(body);
        response
            .headers_mut()
            .insert("content-type", "application/grpc".parse().unwrap());
        response
    }

    async fn handle<B>(self, req: Request<B>) -> Result<Response<tonic::body::Body>, Infallible>
    where
        B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + Sync + 'static,
    {
        let header =
            |h: &HeaderMap, name: &str| h.get(name).map(|v| v.to_str().unwrap().to_owned());
        self.calls.lock().unwrap().push(Call {
            path: req.uri().path().to_owned(),
            token: header(req.headers(), "fencing-token"),
            te: header(req.headers(), "te"),
        });
        let failure = match req.uri().path() {
            DEPOSIT => self.failures.lock().unwrap().pop_front(),
            _ => None,
        };
        if let Some(failure) = failure {
            return Ok(Self::failed(failure));
        }
        let answer = match req.uri().path() {
            DEPOSIT => {
                let mut grpc = tonic::server::Grpc::new(ProstCodec::<Balance, Deposit>::default());
                let deposit = tower::service_fn(|req: tonic::Request<Deposit>| async move {
                    let amount = req.get_ref().amount;
                    if amount < 0 {
                        return Err(Status::invalid_argument(format!(
                            "no negative deposits: {amount} é%"
                        )));
                    }
                    Ok(tonic::Response::new(Balance {
                        amount: 100 + amount,
                    }))
                });
                grpc.unary(deposit, req).await
            }
            HISTORY => {
                let mut grpc = tonic::server::Grpc::new(ProstCodec::<Entry, History>::default());
                let history = tower::service_fn(|req: tonic::Request<History>| async move {
                    let History { count, fail } = *req.get_ref();
                    let mut entries: Vec<Result<Entry, Status>> = (1..=count)
                        .map(|seq| {
                            Ok(Entry {
                                seq,
                                text: "é%\n".repeat(seq as usize),
                            })
                        })
                        .collect();
                    if fail {
                        entries.push(Err(Status::out_of_range("end of history: 100% read")));
                    }
                    Ok::<_, Status>(tonic::Response::new(tokio_stream::iter(entries)))
                });
                grpc.server_streaming(history, req).await
            }
            _ => Status::unimplemented("no such method").into_http(),
        };
        Ok(answer)
    }

    /// Serves h2c on port 0, or h2 over TLS (the fixtures' server certificate) when `tls`.
    async fn start(tls: bool) -> (Ledger, SocketAddr) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let ledger = Ledger::default();
        let acceptor = tls.then(|| {
            let key = PrivateKeyDer::from_pem_file(fixture("server-key.pem")).unwrap();
            let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs("server.pem"), key)
            .unwrap();
            config.alpn_protocols = vec![b"h2".to_vec()];
            TlsAcceptor::from(Arc::new(config))
        });
        let server = ledger.clone();
        tokio::spawn(async move {
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                if server.down.load(Ordering::SeqCst) {
                    drop(tcp);
                    continue;
                }
                let (ledger, acceptor) = (server.clone(), acceptor.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| ledger.clone().handle(req));
                    let h2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
                    let _ = match acceptor {
                        Some(acceptor) => {
                            let tls = acceptor.accept(tcp).await.unwrap();
                            h2.serve_connection(TokioIo::new(tls), service).await
                        }
                        None => h2.serve_connection(TokioIo::new(tcp), service).await,
                    };
                });
            }
        });
        (ledger, addr)
    }
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn certs(name: &str) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_file_iter(fixture(name))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

fn yaml_path(name: &str) -> String {
    format!(
        "'{}'",
        fixture(name).display().to_string().replace('\'', "''")
    )
}

/// A gRPC client to fencegate: h2c by prior knowledge, or TLS (ALPN `h2`, trusting the test CA).
async fn client(addr: SocketAddr, tls: bool) -> tonic::client::Grpc<Channel> {
    let endpoint = Endpoint::from_shared(format!("http://localhost:{}", addr.port())).unwrap();
    let channel = if tls {
        let mut roots = RootCertStore::empty();
        for cert in certs("ca.pem") {
            roots.add(cert).unwrap();
        }
        let mut config =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
        config.alpn_protocols = vec![b"h2".to_vec()];
        let connector = TlsConnector::from(Arc::new(config));
        let connect = tower::service_fn(move |_: http::Uri| {
            let connector = connector.clone();
            async move {
                let tcp = TcpStream::connect(addr).await?;
                let name = ServerName::try_from("localhost").unwrap();
                let tls = connector.connect(name, tcp).await?;
                Ok::<_, std::io::Error>(TokioIo::new(tls))
            }
        });
        endpoint.connect_with_connector(connect).await.unwrap()
    } else {
        endpoint.connect().await.unwrap()
    };
    tonic::client::Grpc::new(channel)
}

fn request<M>(message: M, account: &str, token: Option<&str>) -> tonic::Request<M> {
    let mut req = tonic::Request::new(message);
    req.metadata_mut()
        .insert("x-account-id", account.parse().unwrap());
    if let Some(token) = token {
        req.metadata_mut()
            .insert("fencing-token", token.parse().unwrap());
    }
    req
}

async fn deposit(
    grpc: &mut tonic::client::Grpc<Channel>,
    account: &str,
    token: Option<&str>,
) -> Result<tonic::Response<Balance>, Status> {
    grpc.ready().await.unwrap();
    let req = request(Deposit { amount: 5 }, account, token);
    let codec = ProstCodec::<Deposit, Balance>::default();
    grpc.unary(req, PathAndQuery::from_static(DEPOSIT), codec)
        .await
}

/// A `Deposit` of `amount` with token 3 and an `idempotency-key`.
async fn keyed_deposit(
    grpc: &mut tonic::client::Grpc<Channel>,
    account: &str,
    key: &str,
    amount: i64,
) -> Result<tonic::Response<Balance>, Status> {
    grpc.ready().await.unwrap();
    let mut req = request(Deposit { amount }, account, Some("3"));
    req.metadata_mut()
        .insert("idempotency-key", key.parse().unwrap());
    let codec = ProstCodec::<Deposit, Balance>::default();
    grpc.unary(req, PathAndQuery::from_static(DEPOSIT), codec)
        .await
}

/// A server-streaming `History` call; the entries received, then how the stream ended.
async fn history(
    grpc: &mut tonic::client::Grpc<Channel>,
    account: &str,
    token: &str,
    call: History,
) -> Result<(Vec<Entry>, Result<(), Status>), Status> {
    grpc.ready().await.unwrap();
    let req = request(call, account, Some(token));
    let codec = ProstCodec::<History, Entry>::default();
    let mut stream = grpc
        .server_streaming(req, PathAndQuery::from_static(HISTORY), codec)
        .await?
        .into_inner();
    let mut entries = Vec::new();
    loop {
        match stream.message().await {
            Ok(Some(entry)) => entries.push(entry),
            Ok(None) => return Ok((entries, Ok(()))),
            Err(status) => return Ok((entries, Err(status))),
        }
    }
}

fn metadata<'a>(status: &'a Status, name: &str) -> Option<&'a str> {
    status.metadata().get(name).map(|v| v.to_str().unwrap())
}

#[tokio::test]
async fn a_stale_unary_write_is_aborted_with_the_current_token() {
    let (ledger, addr) = Ledger::start(false).await;
    let server = fencegate(&format!("http://{addr}"), ROUTES).await;
    let mut grpc = client(server.listen, false).await;

    let fresh = deposit(&mut grpc, "a1", Some("7")).await.unwrap();
    assert_eq!(fresh.get_ref().amount, 105);

    let stale = deposit(&mut grpc, "a1", Some("6")).await.unwrap_err();
    assert_eq!(stale.code(), Code::Aborted);
    assert_eq!(
        stale.message(),
        "token 6 is below 7, the highest token recorded for account:a1; the write was not forwarded"
    );
    assert_eq!(metadata(&stale, "fencing-token-current"), Some("7"));
    assert_eq!(metadata(&stale, "content-type"), Some("application/grpc"));

    // Only the fresh write reached the server, token and `te: trailers` as gRPC wants them.
    let calls = ledger.calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0].path, DEPOSIT);
    assert_eq!(calls[0].token.as_deref(), Some("7"));
    assert_eq!(calls[0].te.as_deref(), Some("trailers"));
    assert_eq!(recorded(&server, "account:a1").await, Some(7));
    server.shutdown();
}

#[tokio::test]
async fn refusals_before_the_store_are_grpc_statuses() {
    let (ledger, addr) = Ledger::start(false).await;
    let server = fencegate(&format!("http://{addr}"), ROUTES).await;
    let mut grpc = client(server.listen, false).await;

    let missing = deposit(&mut grpc, "a2", None).await.unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument);
    assert_eq!(
        missing.message(),
        "this route requires a fencing token: send it in the `Fencing-Token` header"
    );

    let invalid = deposit(&mut grpc, "a2", Some("07")).await.unwrap_err();
    assert_eq!(invalid.code(), Code::InvalidArgument);

    // No `x-account-id` metadata: the resource cannot be told.
    grpc.ready().await.unwrap();
    let mut req = tonic::Request::new(Deposit { amount: 1 });
    req.metadata_mut()
        .insert("fencing-token", "1".parse().unwrap());
    let codec = ProstCodec::<Deposit, Balance>::default();
    let unknown = grpc
        .unary(req, PathAndQuery::from_static(DEPOSIT), codec)
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::InvalidArgument);
    assert!(
        unknown.message().contains("x-account-id"),
        "{}",
        unknown.message()
    );
    assert!(ledger.calls().is_empty());
    server.shutdown();
}

#[tokio::test]
async fn an_unreachable_upstream_is_unavailable() {
    // A port nothing listens on.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let server = fencegate(&format!("http://{addr}"), ROUTES).await;
    let mut grpc = client(server.listen, false).await;
    let failed = deposit(&mut grpc, "a3", Some("1")).await.unwrap_err();
    assert_eq!(failed.code(), Code::Unavailable);
    assert!(
        failed
            .message()
            .starts_with("the upstream could not be reached or failed: "),
        "{}",
        failed.message()
    );
    server.shutdown();
}

/// The streaming call, admitted, reaches the client intact: every message, and the trailers'
/// status (OK, or the server's own error with its percent-encoded message).
async fn stream_intact(server: &fencegate::app::Server, tls: bool) {
    let mut grpc = client(server.listen, tls).await;
    let ok = History {
        count: 3,
        fail: false,
    };
    let (entries, end) = history(&mut grpc, "s1", "4", ok).await.unwrap();
    assert_eq!(entries.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(entries[2].text, "é%\né%\né%\n");
    end.unwrap();

    let failing = History {
        count: 2,
        fail: true,
    };
    let (entries, end) = history(&mut grpc, "s1", "5", failing).await.unwrap();
    assert_eq!(entries.len(), 2);
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange);
    assert_eq!(status.message(), "end of history: 100% read");

    // A stale streaming call never starts.
    let stale = History {
        count: 1,
        fail: false,
    };
    let refused = history(&mut grpc, "s1", "4", stale).await.unwrap_err();
    assert_eq!(refused.code(), Code::Aborted);
    assert_eq!(metadata(&refused, "fencing-token-current"), Some("5"));
}

#[tokio::test]
async fn a_server_stream_is_proxied_intact_over_h2c() {
    let (ledger, addr) = Ledger::start(false).await;
    let server = fencegate(&format!("http://{addr}"), ROUTES).await;
    stream_intact(&server, false).await;
    assert_eq!(ledger.calls().len(), 2);
    server.shutdown();
}

#[tokio::test]
async fn a_server_stream_is_proxied_intact_over_tls_both_ways() {
    let (ledger, addr) = Ledger::start(true).await;
    let extra = format!(
        "tls: {{ cert: {}, key: {} }}\nupstream_ca: {}\n{ROUTES}",
        yaml_path("server.pem"),
        yaml_path("server-key.pem"),
        yaml_path("ca.pem"),
    );
    let server = fencegate(&format!("https://localhost:{}", addr.port()), &extra).await;
    stream_intact(&server, true).await;
    let calls = ledger.calls();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[1].token.as_deref(), Some("5"));
    server.shutdown();
}

/// The ledger's gRPC server with the fence in-process ([`fencegate::layer::FenceLayer`]) in
/// front of it, on h2c: no sidecar.
async fn fenced_ledger() -> (Ledger, SocketAddr) {
    use tower::ServiceExt;
    use tower_layer::Layer;

    let yaml = format!("store: {{ kind: memory }}\n{ROUTES}");
    let config = fencegate::config::Config::parse_fence(&yaml).unwrap();
    let fence = fencegate::layer::FenceLayer::open(&config).await.unwrap();
    let ledger = Ledger::default();
    let handler = ledger.clone();
    let service = fence.layer(tower::service_fn(
        move |req: Request<RequestBody<Incoming>>| handler.clone().handle(req),
    ));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let service = service.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| service.clone().oneshot(req));
                let h2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
                let _ = h2.serve_connection(TokioIo::new(tcp), service).await;
            });
        }
    });
    (ledger, addr)
}

#[tokio::test]
async fn the_layer_fences_a_tonic_service_in_process() {
    let (ledger, addr) = fenced_ledger().await;
    let mut grpc = client(addr, false).await;

    let fresh = deposit(&mut grpc, "l1", Some("7")).await.unwrap();
    assert_eq!(fresh.get_ref().amount, 105);
    let stale = deposit(&mut grpc, "l1", Some("6")).await.unwrap_err();
    assert_eq!(stale.code(), Code::Aborted);
    assert_eq!(
        stale.message(),
        "token 6 is below 7, the highest token recorded for account:l1; the write was not forwarded"
    );
    assert_eq!(metadata(&stale, "fencing-token-current"), Some("7"));
    let missing = deposit(&mut grpc, "l1", None).await.unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument);

    // Streams pass the layer intact too, trailers included.
    let failing = History {
        count: 2,
        fail: true,
    };
    let (entries, end) = history(&mut grpc, "l2", "1", failing).await.unwrap();
    assert_eq!(entries.len(), 2);
    assert_eq!(end.unwrap_err().message(), "end of history: 100% read");
    assert_eq!(ledger.calls().len(), 2);
}

#[tokio::test]
async fn a_keyed_unary_write_is_replayed_with_its_status() {
    let (ledger, addr) = Ledger::start(false).await;
    let extra = format!("idempotency: {{ window: 1m }}\n{ROUTES}");
    let server = fencegate(&format!("http://{addr}"), &extra).await;
    let mut grpc = client(server.listen, false).await;

    // OK: the status travels in the trailers, after the message.
    let first = keyed_deposit(&mut grpc, "k1", "dep-1", 5).await.unwrap();
    assert_eq!(first.get_ref().amount, 105);
    assert_eq!(first.metadata().get("idempotent-replayed"), None);
    let again = keyed_deposit(&mut grpc, "k1", "dep-1", 5).await.unwrap();
    assert_eq!(again.get_ref().amount, 105);
    assert_eq!(again.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(ledger.calls().len(), 1, "{:?}", ledger.calls());

    // The server's own error status, replayed as it was.
    let refused = keyed_deposit(&mut grpc, "k1", "dep-2", -1)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert_eq!(refused.message(), "no negative deposits: -1 é%");
    let replayed = keyed_deposit(&mut grpc, "k1", "dep-2", -1)
        .await
        .unwrap_err();
    assert_eq!(replayed.code(), Code::InvalidArgument);
    assert_eq!(replayed.message(), "no negative deposits: -1 é%");
    assert_eq!(metadata(&replayed, "idempotent-replayed"), Some("true"));
    assert_eq!(ledger.calls().len(), 2, "{:?}", ledger.calls());
    server.shutdown();
}

/// A response read whole: head, body and trailers.
struct Whole {
    status: http::StatusCode,
    headers: HeaderMap,
    body: bytes::Bytes,
    trailers: Option<HeaderMap>,
}

/// A `Deposit` of 5 sent by hand over h2c, with the `content-type` given (tonic always sends
/// its own spelling) and `extra` metadata.
async fn deposit_by_hand(
    addr: SocketAddr,
    content_type: &str,
    account: &str,
    token: &str,
    extra: &[(&str, &str)],
) -> Whole {
    use http_body_util::BodyExt;

    let response = start_by_hand(addr, content_type, account, token, extra).await;
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned();
    Whole {
        status: parts.status,
        headers: parts.headers,
        body: collected.to_bytes(),
        trailers,
    }
}

/// [`deposit_by_hand`]'s call, its response as it starts (the head, and the body to read).
async fn start_by_hand(
    addr: SocketAddr,
    content_type: &str,
    account: &str,
    token: &str,
    extra: &[(&str, &str)],
) -> Response<Incoming> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    // One message: uncompressed, its length (big-endian), then the message.
    let message = prost::Message::encode_to_vec(&Deposit { amount: 5 });
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(message.len() as u32).to_be_bytes());
    frame.extend_from_slice(&message);
    let mut req = Request::builder()
        .method("POST")
        .uri(format!("http://{addr}{DEPOSIT}"))
        .header("content-type", content_type)
        .header("te", "trailers")
        .header("x-account-id", account)
        .header("fencing-token", token);
    for (name, value) in extra {
        req = req.header(*name, *value);
    }
    let req = req
        .body(http_body_util::Full::new(bytes::Bytes::from(frame)))
        .unwrap();
    sender.send_request(req).await.unwrap()
}

/// The `Balance` in a response body of one gRPC message.
fn balance(body: &[u8]) -> i64 {
    assert_eq!(body[0], 0, "compressed");
    let len = u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize;
    assert_eq!(body.len(), 5 + len);
    <Balance as prost::Message>::decode(&body[5..])
        .unwrap()
        .amount
}

#[tokio::test]
async fn a_grpc_content_type_is_told_in_any_case() {
    let (ledger, addr) = Ledger::start(false).await;
    let server = fencegate(&format!("http://{addr}"), ROUTES).await;

    // Admitted, and forwarded over HTTP/2 (the server speaks nothing else): the server's
    // message and its status in the trailers.
    let fresh = deposit_by_hand(server.listen, "Application/GRPC", "c1", "7", &[]).await;
    assert_eq!(fresh.status, 200);
    assert_eq!(balance(&fresh.body), 105);
    let trailers = fresh.trailers.expect("trailers");
    assert_eq!(trailers["grpc-status"], "0");
    let calls = ledger.calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0].token.as_deref(), Some("7"));
    assert_eq!(calls[0].te.as_deref(), Some("trailers"));

    // Refused the gRPC way: trailers-only ABORTED, not problem+json.
    let stale = deposit_by_hand(server.listen, "APPLICATION/Grpc+proto", "c1", "6", &[]).await;
    assert_eq!(stale.status, 200);
    assert_eq!(stale.headers["content-type"], "application/grpc");
    assert_eq!(stale.headers["grpc-status"], "10");
    assert_eq!(
        stale.headers["grpc-message"],
        "token 6 is below 7, the highest token recorded for account:c1; the write was not forwarded"
    );
    assert_eq!(stale.headers["fencing-token-current"], "7");
    assert!(stale.body.is_empty());
    assert!(stale.trailers.is_none());
    assert_eq!(ledger.calls().len(), 1);
    assert_eq!(recorded(&server, "account:c1").await, Some(7));
    server.shutdown();
}

async fn unknown_outcomes(server: &fencegate::app::Server) -> String {
    let text = send("GET", &format!("http://{}/metrics", server.admin), &[], "")
        .await
        .text();
    let line = text
        .lines()
        .find(|l| l.starts_with("fencegate_idempotency_unknown_outcomes_total "));
    line.expect("the unknown outcomes metric").to_owned()
}

/// A keyed call answered UNAVAILABLE (trailers-only) or INTERNAL (in the trailers, after a
/// message) may not have run: like an HTTP 503, it is passed on and not recorded, and the
/// retry runs again. A final status (NOT_FOUND, in the trailers) is recorded and replayed.
#[tokio::test]
async fn a_keyed_call_answered_unavailable_or_internal_leaves_its_key_free() {
    let (ledger, addr) = Ledger::start(false).await;
    let extra = format!("idempotency: {{ window: 1m }}\n{ROUTES}");
    let server = fencegate(&format!("http://{addr}"), &extra).await;
    let mut grpc = client(server.listen, false).await;
    ledger.fail_next([
        Failure::TrailersOnly(Status::unavailable("restarting")),
        Failure::InTrailers(Status::internal("disk full")),
    ]);

    let unavailable = keyed_deposit(&mut grpc, "k2", "dep-u", 5)
        .await
        .unwrap_err();
    assert_eq!(unavailable.code(), Code::Unavailable);
    assert_eq!(unavailable.message(), "restarting");
    assert_eq!(metadata(&unavailable, "idempotent-replayed"), None);
    let internal = keyed_deposit(&mut grpc, "k2", "dep-u", 5)
        .await
        .unwrap_err();
    assert_eq!(internal.code(), Code::Internal);
    assert_eq!(internal.message(), "disk full");
    assert_eq!(metadata(&internal, "idempotent-replayed"), None);
    let ran = keyed_deposit(&mut grpc, "k2", "dep-u", 5).await.unwrap();
    assert_eq!(ran.get_ref().amount, 105);
    assert_eq!(ran.metadata().get("idempotent-replayed"), None);
    let replayed = keyed_deposit(&mut grpc, "k2", "dep-u", 5).await.unwrap();
    assert_eq!(replayed.get_ref().amount, 105);
    assert_eq!(
        replayed.metadata().get("idempotent-replayed").unwrap(),
        "true"
    );
    assert_eq!(ledger.calls().len(), 3, "{:?}", ledger.calls());
    assert_eq!(
        unknown_outcomes(&server).await,
        "fencegate_idempotency_unknown_outcomes_total 2"
    );

    // A final status in the trailers is the call's outcome: recorded, and replayed (read by
    // hand: a client takes the status's metadata from the trailers, without the marker).
    ledger.fail_next([Failure::InTrailers(Status::not_found("no account k2"))]);
    let missing = keyed_deposit(&mut grpc, "k2", "dep-n", 5)
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    assert_eq!(missing.message(), "no account k2");
    let key = [("idempotency-key", "dep-n")];
    let replayed = deposit_by_hand(server.listen, "application/grpc", "k2", "3", &key).await;
    assert_eq!(replayed.status, 200);
    assert_eq!(replayed.headers["idempotent-replayed"], "true");
    assert_eq!(replayed.headers["content-type"], "application/grpc");
    assert_eq!(balance(&replayed.body), 100);
    let trailers = replayed.trailers.expect("trailers");
    assert_eq!(trailers["grpc-status"], "5");
    // As the server encoded it (tonic encodes spaces too).
    assert_eq!(trailers["grpc-message"], "no%20account%20k2");
    assert_eq!(ledger.calls().len(), 4, "{:?}", ledger.calls());
    assert_eq!(recorded(&server, "account:k2").await, Some(3));
    server.shutdown();
}

/// A downstream fencegate whose upstream is down answers UNAVAILABLE, trailers-only: the
/// keyed call did not run, and once the upstream is back its retry runs (and is then
/// replayed), instead of being answered the refusal for the whole window.
#[tokio::test]
async fn a_downstream_fencegates_refusal_is_not_replayed_after_it_recovers() {
    let (ledger, addr) = Ledger::start(false).await;
    ledger.set_down(true);
    let inner = fencegate(&format!("http://{addr}"), ROUTES).await;
    let extra = format!("idempotency: {{ window: 1m }}\n{ROUTES}");
    let outer = fencegate(&format!("http://{}", inner.listen), &extra).await;
    let mut grpc = client(outer.listen, false).await;

    let refused = keyed_deposit(&mut grpc, "k3", "dep-d", 5)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable);
    assert!(
        refused
            .message()
            .starts_with("the upstream could not be reached or failed: "),
        "{}",
        refused.message()
    );
    assert_eq!(metadata(&refused, "idempotent-replayed"), None);
    assert!(ledger.calls().is_empty());

    ledger.set_down(false);
    let ran = keyed_deposit(&mut grpc, "k3", "dep-d", 5).await.unwrap();
    assert_eq!(ran.get_ref().amount, 105);
    assert_eq!(ran.metadata().get("idempotent-replayed"), None);
    let replayed = keyed_deposit(&mut grpc, "k3", "dep-d", 5).await.unwrap();
    assert_eq!(replayed.get_ref().amount, 105);
    assert_eq!(
        replayed.metadata().get("idempotent-replayed").unwrap(),
        "true"
    );
    let calls = ledger.calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0].token.as_deref(), Some("3"));
    assert_eq!(recorded(&outer, "account:k3").await, Some(3));
    assert_eq!(recorded(&inner, "account:k3").await, Some(3));
    assert_eq!(
        unknown_outcomes(&outer).await,
        "fencegate_idempotency_unknown_outcomes_total 1"
    );
    outer.shutdown();
    inner.shutdown();
}

/// A keyed call whose response breaks after its message, before any status: its client gets
/// an error, and the call may or may not have run, so the key is left free (for an HTTP
/// response with a final status the same break is recorded as completed, not replayable).
#[tokio::test]
async fn a_keyed_call_broken_before_its_status_leaves_its_key_free() {
    use http_body_util::BodyExt;

    let (ledger, addr) = Ledger::start(false).await;
    let extra = format!("idempotency: {{ window: 1m }}\n{ROUTES}");
    let server = fencegate(&format!("http://{addr}"), &extra).await;
    let mut grpc = client(server.listen, false).await;
    let (breaks, broken) = tokio::sync::oneshot::channel();
    ledger.fail_next([Failure::Broken(broken)]);

    // By hand, to break the stream once its head and message have come through fencegate.
    let key = [("idempotency-key", "dep-b")];
    let response = start_by_hand(server.listen, "application/grpc", "k4", "3", &key).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/grpc");
    assert_eq!(response.headers().get("grpc-status"), None);
    let mut body = response.into_body();
    let message = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(balance(&message), 100);
    breaks.send(()).unwrap();
    let end = body.frame().await;
    assert!(matches!(end, Some(Err(_))), "{end:?}");
    // The outcome is written as the stream breaks, without waiting for it: a retry that
    // comes first is told the call is still in flight, as a client's retry loop would be.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let ran = loop {
        match keyed_deposit(&mut grpc, "k4", "dep-b", 5).await {
            Err(status) if status.code() == Code::Aborted => {
                assert_eq!(
                    status.message(),
                    "a request with this idempotency key for account:k4 is still with the \
                     upstream; retry after it completes to get its response"
                );
                assert!(std::time::Instant::now() < deadline, "never recorded");
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            other => break other.unwrap(),
        }
    };
    assert_eq!(ran.get_ref().amount, 105);
    assert_eq!(ran.metadata().get("idempotent-replayed"), None);
    let replayed = keyed_deposit(&mut grpc, "k4", "dep-b", 5).await.unwrap();
    assert_eq!(replayed.get_ref().amount, 105);
    assert_eq!(
        replayed.metadata().get("idempotent-replayed").unwrap(),
        "true"
    );
    assert_eq!(ledger.calls().len(), 2, "{:?}", ledger.calls());
    assert_eq!(
        unknown_outcomes(&server).await,
        "fencegate_idempotency_unknown_outcomes_total 1"
    );
    server.shutdown();
}

/// A keyed response too large to keep is still decided by its status: UNAVAILABLE leaves the
/// key free, a final status (NOT_FOUND) is recorded, not replayable and not run again.
#[tokio::test]
async fn a_keyed_call_too_large_to_keep_is_decided_by_its_status() {
    let (ledger, addr) = Ledger::start(false).await;
    // 20 bytes: an OK answer (a 7-byte message, `grpc-status: 0`) fits; the failures, with
    // their `grpc-message`, do not.
    let extra = format!("idempotency: {{ window: 1m, max_response_bytes: 20 }}\n{ROUTES}");
    let server = fencegate(&format!("http://{addr}"), &extra).await;
    let mut grpc = client(server.listen, false).await;
    ledger.fail_next([Failure::InTrailers(Status::unavailable("restarting"))]);
    let unavailable = keyed_deposit(&mut grpc, "k5", "dep-l", 5)
        .await
        .unwrap_err();
    assert_eq!(unavailable.code(), Code::Unavailable);
    let ran = keyed_deposit(&mut grpc, "k5", "dep-l", 5).await.unwrap();
    assert_eq!(ran.get_ref().amount, 105);
    assert_eq!(ran.metadata().get("idempotent-replayed"), None);
    let replayed = keyed_deposit(&mut grpc, "k5", "dep-l", 5).await.unwrap();
    assert_eq!(
        replayed.metadata().get("idempotent-replayed").unwrap(),
        "true"
    );

    ledger.fail_next([Failure::InTrailers(Status::not_found("no account k5"))]);
    let missing = keyed_deposit(&mut grpc, "k5", "dep-m", 5)
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    let again = keyed_deposit(&mut grpc, "k5", "dep-m", 5)
        .await
        .unwrap_err();
    assert_eq!(again.code(), Code::FailedPrecondition);
    assert!(
        again.message().starts_with(
            "the request with this idempotency key completed with status 200 but its response \
             was larger than idempotency.max_response_bytes"
        ),
        "{}",
        again.message()
    );
    assert_eq!(ledger.calls().len(), 3, "{:?}", ledger.calls());
    assert_eq!(
        unknown_outcomes(&server).await,
        "fencegate_idempotency_unknown_outcomes_total 1"
    );
    server.shutdown();
}
