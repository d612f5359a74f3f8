//! A small etcd v3 client: what the etcd fence store and lease backend use, over tonic.
//!
//! The gRPC code under [`pb`] is generated from etcd's API protos (`proto/`) by
//! `scripts/regen-etcd` and committed, so building fencegate needs no `protoc`.
//!
//! - [`Client::connect`]: one tonic channel to one endpoint at a time ([`Connector`]),
//!   connecting lazily and, after a failure, to the next endpoint that answers, with connect
//!   and per-request timeouts and HTTP/2 keep-alive.
//! - [`KvClient`]: `Range` and `Txn` (transactions built from [`Txn`], [`TxnOp`], [`Compare`]).
//! - [`LeaseClient`]: `LeaseGrant`, `LeaseRevoke`, one `LeaseKeepAlive` round trip,
//!   `LeaseTimeToLive`.
//! - [`WatchClient`]: a `Watch` stream per call, with progress requests.
//!
//! Names and shapes follow the `etcd-client` crate this replaces, so its users read the same;
//! answers are the generated messages, with accessors for the fields the users read.
//!
//! Every client goes through [`Transport`]:
//! - Endpoints are dialled by fencegate's own connector ([`Connector`]): TCP and, for
//!   `https://` endpoints, the handshake through [`ClientTls`] (the `tls` mapping's CA, client
//!   certificate and `server_name`, its files as they are at each new connection, ALPN `h2`).
//!   One channel connects to one endpoint at a time and, when that connection fails, to the
//!   next that answers (etcd's own clients also pin one endpoint), each endpoint given its
//!   share of the connect timeout. A channel balanced over the endpoints would keep sending a
//!   share of the calls to a member that died, each failing, for as long as it is down.
//! - Authentication: with a user and password, [`Transport`] gets a token from
//!   `Auth.Authenticate` before the first call and sends it as the `token` metadata on every
//!   call. It authenticates again when the token is older than [`TOKEN_REFRESH`] (etcd's
//!   simple tokens expire after 5 minutes unused, JWTs at their TTL), and at once after etcd
//!   refused a token ([`token_refused`]: an expired or unknown token, as after an etcd
//!   restart, or a JWT issued before a change of users or roles); the unary calls and stream
//!   openings that etcd refused so are sent once more with the new token
//!   ([`retry_unauthenticated`]).

mod kv;
mod lease;
mod watch;

// Generated code: left as generated, neither formatted nor linted.
#[rustfmt::skip]
#[allow(clippy::all, dead_code)]
pub(crate) mod pb {
    pub mod authpb;
    pub mod etcdserverpb;
    pub mod mvccpb;
}

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use http::HeaderValue;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::codegen::Service;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::sync::Locked;
use crate::tls::ClientTls;

pub use kv::{Compare, CompareOp, GetOptions, KvClient, PutOptions, Txn, TxnOp, TxnOpResponse};
pub use lease::{LeaseClient, LeaseTimeToLiveOptions};
pub use pb::mvccpb::KeyValue;
pub use watch::{EventType, WatchClient, WatchFilterType, WatchOptions};

/// How long a token is used before authenticating again.
pub const TOKEN_REFRESH: Duration = Duration::from_secs(60);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What every generated client sends its requests through: the channel, and the token of an
/// authenticated user.
#[derive(Clone)]
pub(crate) struct Transport {
    channel: Channel,
    auth: Option<Arc<Auth>>,
}

/// A user's credentials and its current token.
pub(crate) struct Auth {
    name: String,
    password: String,
    /// The token and when it was obtained; a tokio mutex, so that concurrent calls wait for
    /// one `Authenticate`.
    token: tokio::sync::Mutex<Option<(HeaderValue, Instant)>>,
    /// The last failed `Authenticate` and when it failed: for [`AUTH_RETRY`], calls fail with
    /// it instead of each authenticating again (a wrong password would otherwise cost etcd
    /// an `Authenticate`, a password hash, per call).
    failed: std::sync::Mutex<Option<(tonic::Status, Instant)>>,
}

/// How long a failed `Authenticate` is answered from memory.
pub const AUTH_RETRY: Duration = Duration::from_secs(1);

impl Auth {
    /// The current token, authenticating first if there is none or it is old.
    async fn token(&self, channel: &Channel) -> Result<HeaderValue, tonic::Status> {
        let mut token = self.token.lock().await;
        if let Some((value, at)) = &*token {
            if at.elapsed() < TOKEN_REFRESH {
                return Ok(value.clone());
            }
        }
        if let Some((status, at)) = &*self.failed.locked() {
            if at.elapsed() < AUTH_RETRY {
                return Err(tonic::Status::new(status.code(), status.message()));
            }
        }
        let request = pb::etcdserverpb::AuthenticateRequest {
            name: self.name.clone(),
            password: self.password.clone(),
        };
        let answer = pb::etcdserverpb::auth_client::AuthClient::new(channel.clone())
            .authenticate(request)
            .await
            .and_then(|response| {
                HeaderValue::from_str(&response.into_inner().token)
                    .map_err(|_| tonic::Status::internal("etcd returned a token that is no header"))
            });
        let failed = answer.as_ref().err().map(|status| {
            (
                tonic::Status::new(status.code(), status.message()),
                Instant::now(),
            )
        });
        *self.failed.locked() = failed;
        let value = answer?;
        *token = Some((value.clone(), Instant::now()));
        Ok(value)
    }

    /// etcd refused the token of a call made at `sent`: the next call authenticates again,
    /// unless the token was replaced since (etcd sends the status after the response
    /// headers, so it is seen only by the caller, not by the transport).
    async fn forget(&self, sent: Instant) {
        let mut token = self.token.lock().await;
        if token.as_ref().is_some_and(|(_, at)| *at <= sent) {
            *token = None;
        }
    }
}

impl Service<http::Request<tonic::body::Body>> for Transport {
    type Response = http::Response<tonic::body::Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // With a user, the call itself waits for the channel, once it has its token: a slot
        // of the channel is not held while waiting for the token (whose `Authenticate` needs
        // one too).
        if self.auth.is_some() {
            return Poll::Ready(Ok(()));
        }
        self.channel.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut request: http::Request<tonic::body::Body>) -> Self::Future {
        let Some(auth) = self.auth.clone() else {
            // The channel that was made ready makes the call; a clone takes its place.
            let fresh = self.channel.clone();
            let mut ready = std::mem::replace(&mut self.channel, fresh);
            return Box::pin(async move { ready.call(request).await.map_err(Into::into) });
        };
        let mut channel = self.channel.clone();
        Box::pin(async move {
            // Boxed as itself, so that the client reads the status back (code and message).
            let token = auth
                .token(&channel)
                .await
                .map_err(|status| -> BoxError { Box::new(status) })?;
            request.headers_mut().insert("token", token);
            std::future::poll_fn(|cx| channel.poll_ready(cx)).await?;
            let response = channel.call(request).await?;
            Ok(response)
        })
    }
}

/// Whether etcd refused a call for its token, before executing it: `Unauthenticated` (an
/// expired or unknown token), or `InvalidArgument` for a token issued before the last change
/// of users, roles or permissions (`revision of auth store is old`: every JWT, as their
/// revision is inside them) or one etcd could not read (`user name is empty`). A new token
/// gets the call through.
fn token_refused(code: tonic::Code, message: &[u8]) -> bool {
    const STALE: [&[u8]; 2] = [b"revision of auth store is old", b"user name is empty"];
    match code {
        tonic::Code::Unauthenticated => true,
        tonic::Code::InvalidArgument => STALE
            .iter()
            .any(|stale| message.windows(stale.len()).any(|w| w == *stale)),
        _ => false,
    }
}

/// Runs `call`, and once more if etcd refused its token ([`token_refused`]: the token is
/// forgotten, so the second call authenticates anew). A refused call was
/// not executed, so sending it again is safe.
///
/// `call` takes `request`, cloned for the first call only when a user is configured (without
/// one, a refused token is not retried and the request is sent as it is).
pub(crate) async fn retry_unauthenticated<R, T, F, Fut>(
    auth: Option<&Auth>,
    request: R,
    mut call: F,
) -> Result<T, Error>
where
    R: Clone,
    F: FnMut(R) -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    let Some(auth) = auth else {
        return call(request).await;
    };
    let sent = Instant::now();
    match call(request.clone()).await {
        Err(Error::GRpcStatus(status))
            if token_refused(status.code(), status.message().as_bytes()) =>
        {
            auth.forget(sent).await;
            call(request).await
        }
        other => other,
    }
}

/// Why an etcd call failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid arguments: {0}")]
    InvalidArgs(String),
    #[error("transport error: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("{}", status_text(.0))]
    GRpcStatus(#[from] tonic::Status),
    /// The lease to keep alive has expired or does not exist (etcd answered a TTL of 0).
    #[error("lease keep alive error: {0}")]
    LeaseKeepAlive(String),
    /// A request or answer stream closed early.
    #[error("stream error: {0}")]
    Stream(String),
    #[error("utf8 error: {0}")]
    Utf8(#[from] std::str::Utf8Error),
}

/// A status in words: no connection (the channel's `Unavailable`) says only why, which names
/// each endpoint and its error ([`unreachable`]); an answer from etcd keeps its code.
fn status_text(status: &tonic::Status) -> String {
    match status.code() {
        tonic::Code::Unavailable if status.message().contains("cannot connect to") => {
            status.message().to_owned()
        }
        code => format!("grpc request error: {code}: {}", status.message()),
    }
}

/// How [`Client::connect`] reaches the endpoints.
#[derive(Clone, Default)]
pub struct ConnectOptions {
    connect_timeout: Option<Duration>,
    timeout: Option<Duration>,
    /// HTTP/2 keep-alive (interval, timeout), also while idle.
    keep_alive: Option<(Duration, Duration)>,
    /// For `https://` endpoints.
    tls: Option<Arc<ClientTls>>,
    /// A user name and password to authenticate with.
    user: Option<(String, String)>,
}

impl ConnectOptions {
    pub fn new() -> Self {
        Self::default()
    }

    /// A timeout on establishing each connection.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = Some(timeout);
        self
    }

    /// A timeout on each request (for a stream: until its response headers).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// HTTP/2 pings every `interval`, the connection dropped when one is not answered within
    /// `timeout`.
    pub fn with_keep_alive(mut self, interval: Duration, timeout: Duration) -> Self {
        self.keep_alive = Some((interval, timeout));
        self
    }

    /// TLS for `https://` endpoints (which need it).
    pub fn with_tls(mut self, tls: Arc<ClientTls>) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Authenticates as `name` (etcd's `Auth.Authenticate`).
    pub fn with_user(mut self, name: impl Into<String>, password: impl Into<String>) -> Self {
        self.user = Some((name.into(), password.into()));
        self
    }
}

/// A connection to an etcd cluster, from which the per-service clients are taken (they share
/// its channel; cloning them is cheap).
#[derive(Clone)]
pub struct Client {
    channel: Transport,
}

impl Client {
    /// `endpoints`: `http://host:port` URLs, or `https://host:port` with TLS options. Nothing
    /// is dialled here: the channel connects on first use, to any endpoint that answers, and
    /// reconnects after failures.
    pub async fn connect<E: AsRef<str>, S: AsRef<[E]>>(
        endpoints: S,
        options: Option<ConnectOptions>,
    ) -> Result<Self, Error> {
        let options = options.unwrap_or_default();
        let urls: Vec<&str> = endpoints.as_ref().iter().map(AsRef::as_ref).collect();
        let endpoints = urls
            .iter()
            .map(|url| endpoint(url, &options))
            .collect::<Result<Vec<_>, _>>()?;
        let Some(first) = endpoints.first() else {
            return Err(Error::InvalidArgs("empty endpoints".into()));
        };
        let hosts = endpoints.iter().map(|e| host_port(e.uri())).collect();
        let count = u32::try_from(endpoints.len()).unwrap_or(u32::MAX);
        let connector = Connector {
            hosts: Arc::new(hosts),
            next: Arc::new(AtomicUsize::new(0)),
            tls: options.tls.clone(),
            // Each endpoint gets its share of the channel's connect timeout, so that one that
            // hangs leaves time for the next within the same connection.
            attempt_timeout: options.connect_timeout.map(|t| t / count),
        };
        let channel = first.connect_with_connector_lazy(connector);
        let auth = options.user.map(|(name, password)| {
            Arc::new(Auth {
                name,
                password,
                token: tokio::sync::Mutex::new(None),
                failed: std::sync::Mutex::new(None),
            })
        });
        Ok(Client {
            channel: Transport { channel, auth },
        })
    }

    pub fn kv_client(&self) -> KvClient {
        KvClient::new(self.channel.clone())
    }

    pub fn lease_client(&self) -> LeaseClient {
        LeaseClient::new(self.channel.clone())
    }

    pub fn watch_client(&self) -> WatchClient {
        WatchClient::new(self.channel.clone())
    }
}

fn endpoint(url: &str, options: &ConnectOptions) -> Result<Endpoint, Error> {
    let scheme_fits = match &options.tls {
        Some(_) => url.starts_with("https://"),
        None => url.starts_with("http://"),
    };
    if !scheme_fits {
        return Err(Error::InvalidArgs(format!(
            "etcd endpoints are http:// URLs, or https:// with TLS: {url}"
        )));
    }
    let mut endpoint = Endpoint::from_shared(url.to_owned())
        .map_err(|e| Error::InvalidArgs(format!("{url}: {e}")))?;
    if let Some((interval, timeout)) = options.keep_alive {
        endpoint = endpoint
            .keep_alive_while_idle(true)
            .http2_keep_alive_interval(interval)
            .keep_alive_timeout(timeout);
    }
    if let Some(timeout) = options.timeout {
        endpoint = endpoint.timeout(timeout);
    }
    if let Some(timeout) = options.connect_timeout {
        endpoint = endpoint.connect_timeout(timeout);
    }
    Ok(endpoint)
}

/// The host to dial and its port: an IPv6 literal without its brackets (`[::1]` in a url is
/// the address `::1`), the port 2379 if the url names none.
fn host_port(uri: &Uri) -> (String, u16) {
    let host = uri.host().unwrap_or_default();
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    (host.to_owned(), uri.port_u16().unwrap_or(2379))
}

/// Dials the endpoints: TCP, then (for `https://`) TLS through [`ClientTls`], to the endpoint
/// that answered last, else the next ones in turn.
#[derive(Clone)]
struct Connector {
    hosts: Arc<Vec<(String, u16)>>,
    /// The endpoint to try first.
    next: Arc<AtomicUsize>,
    tls: Option<Arc<ClientTls>>,
    /// How long one endpoint may take (TCP and TLS) before the next is tried.
    attempt_timeout: Option<Duration>,
}

/// A connection to one endpoint, plaintext or TLS.
enum Stream {
    Plain(tokio::net::TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>),
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }
}

type Io = TokioIo<Stream>;

impl Service<Uri> for Connector {
    type Response = Io;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Io, std::io::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), std::io::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let count = this.hosts.len();
            let first = this.next.load(Ordering::Relaxed);
            let mut failed = Vec::with_capacity(count);
            for i in 0..count {
                let at = (first + i) % count;
                let (host, port) = &this.hosts[at];
                // Moved on before the attempt: when the channel's connect timeout cancels this
                // whole call while an endpoint hangs, the next connection starts past it.
                this.next.store((at + 1) % count, Ordering::Relaxed);
                let attempt = async {
                    let tcp = tokio::net::TcpStream::connect((host.as_str(), *port)).await?;
                    let _ = tcp.set_nodelay(true);
                    match &this.tls {
                        Some(tls) => Ok(Stream::Tls(Box::new(tls.connect(host, tcp).await?))),
                        None => Ok(Stream::Plain(tcp)),
                    }
                };
                let result = match this.attempt_timeout {
                    Some(limit) => {
                        tokio::time::timeout(limit, attempt)
                            .await
                            .unwrap_or_else(|_| {
                                Err(std::io::Error::new(
                                    std::io::ErrorKind::TimedOut,
                                    format!("{host}:{port}: no connection within {limit:?}"),
                                ))
                            })
                    }
                    None => attempt.await,
                };
                match result {
                    Ok(stream) => {
                        this.next.store(at, Ordering::Relaxed);
                        return Ok(TokioIo::new(stream));
                    }
                    Err(e) => failed.push((format!("{host}:{port}"), e)),
                }
            }
            Err(unreachable(failed))
        })
    }
}

/// Why no endpoint could be connected to, each endpoint with its own error (the OS's, or the
/// TLS handshake's), of the kind of the last.
fn unreachable(failed: Vec<(String, std::io::Error)>) -> std::io::Error {
    let kind = failed
        .last()
        .map_or(std::io::ErrorKind::NotConnected, |(_, e)| e.kind());
    let each: Vec<String> = failed
        .into_iter()
        .map(|(endpoint, e)| {
            let e = e.to_string();
            // A timeout's message names the endpoint already.
            match e.strip_prefix(&format!("{endpoint}: ")) {
                Some(rest) => format!("cannot connect to {endpoint}: {rest}"),
                None => format!("cannot connect to {endpoint}: {e}"),
            }
        })
        .collect();
    if each.is_empty() {
        return std::io::Error::new(kind, "no etcd endpoint");
    }
    std::io::Error::new(kind, each.join("; "))
}

/// The end of the key range holding every key that starts with `prefix`: the prefix with its
/// last byte below 0xff incremented and what follows dropped; `\0` (all keys) if there is none.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    match prefix.iter().rposition(|&b| b < 0xff) {
        Some(i) => {
            let mut end = prefix[..=i].to_vec();
            end[i] += 1;
            end
        }
        None => vec![0],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"/a/leases/"), b"/a/leases0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), b"\0");
        assert_eq!(prefix_end(b""), b"\0");
    }

    /// A request that must not be cloned.
    struct Once(Arc<AtomicUsize>);

    impl Clone for Once {
        fn clone(&self) -> Self {
            self.0.fetch_add(1, Ordering::Relaxed);
            Once(Arc::clone(&self.0))
        }
    }

    #[tokio::test]
    async fn requests_are_cloned_for_a_retry_only_with_a_user() {
        let refused = |_: Once| async { Err::<(), _>(tonic::Status::unauthenticated("x").into()) };
        let clones = Arc::new(AtomicUsize::new(0));
        let _ = retry_unauthenticated(None, Once(Arc::clone(&clones)), refused).await;
        assert_eq!(clones.load(Ordering::Relaxed), 0);
        let auth = Auth {
            name: "u".into(),
            password: "p".into(),
            token: tokio::sync::Mutex::new(None),
            failed: std::sync::Mutex::new(None),
        };
        let calls = AtomicUsize::new(0);
        let _ = retry_unauthenticated(Some(&auth), Once(Arc::clone(&clones)), |r| {
            calls.fetch_add(1, Ordering::Relaxed);
            refused(r)
        })
        .await;
        assert_eq!(clones.load(Ordering::Relaxed), 1);
        assert_eq!(calls.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn hosts_are_dialled_without_brackets() {
        let at = |url: &str| host_port(&url.parse().unwrap());
        // What the url gives, which no resolver takes.
        let uri: Uri = "https://[::1]:2379".parse().unwrap();
        assert_eq!(uri.host(), Some("[::1]"));
        assert_eq!(at("https://[::1]:2379"), ("::1".into(), 2379));
        assert_eq!(at("https://[fd00::5]"), ("fd00::5".into(), 2379));
        assert_eq!(at("https://127.0.0.1:32379"), ("127.0.0.1".into(), 32379));
        assert_eq!(at("https://etcd-0.etcd:2379"), ("etcd-0.etcd".into(), 2379));
    }

    #[test]
    fn refused_tokens_are_recognised() {
        use tonic::Code;
        assert!(token_refused(
            Code::Unauthenticated,
            b"etcdserver: invalid auth token"
        ));
        assert!(token_refused(
            Code::InvalidArgument,
            b"etcdserver: revision of auth store is old"
        ));
        assert!(token_refused(
            Code::InvalidArgument,
            b"etcdserver: user name is empty"
        ));
        assert!(!token_refused(
            Code::InvalidArgument,
            b"etcdserver: key is not provided"
        ));
        assert!(!token_refused(
            Code::PermissionDenied,
            b"etcdserver: permission denied"
        ));
    }

    #[tokio::test]
    async fn endpoints_are_checked() {
        assert!(Client::connect(["http://127.0.0.1:2379"], None)
            .await
            .is_ok());
        assert!(Client::connect(Vec::<String>::new(), None).await.is_err());
        assert!(Client::connect(["127.0.0.1:2379"], None).await.is_err());
        // https:// goes with TLS, http:// without.
        let tls = Arc::new(ClientTls::load(&Default::default(), "store.tls", &[b"h2"]).unwrap());
        let with_tls = || Some(ConnectOptions::new().with_tls(Arc::clone(&tls)));
        assert!(Client::connect(["https://127.0.0.1:2379"], None)
            .await
            .is_err());
        assert!(Client::connect(["https://127.0.0.1:2379"], with_tls())
            .await
            .is_ok());
        assert!(Client::connect(["http://127.0.0.1:2379"], with_tls())
            .await
            .is_err());
    }

    #[tokio::test]
    async fn an_endpoint_that_refuses_is_named_with_the_os_error() {
        let closed = |port| ("127.0.0.1".to_owned(), port);
        let free = || {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let (a, b) = (free(), free());
        let mut connector = Connector {
            hosts: Arc::new(vec![closed(a), closed(b)]),
            next: Arc::new(AtomicUsize::new(0)),
            tls: None,
            attempt_timeout: None,
        };
        let e = connector
            .call(Uri::from_static("http://etcd"))
            .await
            .err()
            .unwrap();
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
        assert_eq!(
            e.to_string(),
            format!(
                "cannot connect to 127.0.0.1:{a}: Connection refused (os error 111); cannot \
                 connect to 127.0.0.1:{b}: Connection refused (os error 111)"
            )
        );
    }

    /// Through the client, a call that found no etcd says why in those words alone (the
    /// store and the lease backend put `etcd: ` before them).
    #[tokio::test]
    async fn a_call_to_an_unreachable_etcd_names_the_endpoint() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let options = ConnectOptions::new().with_connect_timeout(Duration::from_secs(1));
        let client = Client::connect([format!("http://127.0.0.1:{port}")], Some(options))
            .await
            .unwrap();
        let e = client.kv_client().get("k", None).await.unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("cannot connect to 127.0.0.1:{port}: Connection refused (os error 111)")
        );
    }
}
