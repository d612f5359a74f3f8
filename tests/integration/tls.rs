//! HTTP/2 cleartext, the TLS listener (ALPN h2 and HTTP/1.1, mutual TLS) and an `https`
//! upstream. Certificates come from `tests/fixtures` (see its README to regenerate them).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use fencegate::body::ProxyBody;
use fencegate::config::TlsConfig;
use fencegate::server::{serve, ServerSettings};
use http::{Method, Request, Response, StatusCode, Version};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnectorBuilder;
use hyper_util::client::legacy::connect::Connect;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::common::*;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A fixture path as a single-quoted YAML scalar, whatever the checkout path contains.
fn yaml_path(name: &str) -> String {
    format!(
        "'{}'",
        fixture(name).display().to_string().replace('\'', "''")
    )
}

/// `tls:` for the listener, plus the accounts route.
fn tls_listener(client_ca: bool) -> String {
    let ca = if client_ca {
        format!(", client_ca: {}", yaml_path("ca.pem"))
    } else {
        String::new()
    };
    format!(
        "tls: {{ cert: {}, key: {}{ca} }}\n{ACCOUNTS}",
        yaml_path("server.pem"),
        yaml_path("server-key.pem"),
    )
}

fn certs(name: &str) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_file_iter(fixture(name))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

/// A client that trusts only the test CA, with the test client certificate when `identity`.
fn client_tls(identity: bool) -> ClientConfig {
    let mut roots = RootCertStore::empty();
    for cert in certs("ca.pem") {
        roots.add(cert).unwrap();
    }
    let builder =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
    if identity {
        let key = PrivateKeyDer::from_pem_file(fixture("client-key.pem")).unwrap();
        builder
            .with_client_auth_cert(certs("client.pem"), key)
            .unwrap()
    } else {
        builder.with_no_client_auth()
    }
}

type Https = hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>;

/// HTTPS client speaking HTTP/2 only, offering ALPN `h2`.
fn h2_client(identity: bool) -> Client<Https, Full<Bytes>> {
    let connector = HttpsConnectorBuilder::new()
        .with_tls_config(client_tls(identity))
        .https_only()
        .enable_http2()
        .build();
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(connector)
}

/// HTTPS client speaking HTTP/1.1 only (hyper-rustls offers no ALPN then).
fn h1_client(identity: bool) -> Client<Https, Full<Bytes>> {
    let connector = HttpsConnectorBuilder::new()
        .with_tls_config(client_tls(identity))
        .https_only()
        .enable_http1()
        .build();
    Client::builder(TokioExecutor::new()).build(connector)
}

/// One request through `client`; the version the response came back on, and the response.
async fn exchange<C>(
    client: &Client<C, Full<Bytes>>,
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: &'static str,
) -> Result<(Version, Reply), hyper_util::client::legacy::Error>
where
    C: Connect + Clone + Send + Sync + 'static,
{
    let mut req = Request::builder().method(method).uri(url);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let resp = client
        .request(
            req.body(Full::new(Bytes::from_static(body.as_bytes())))
                .unwrap(),
        )
        .await?;
    let (parts, body) = resp.into_parts();
    Ok((
        parts.version,
        Reply {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.unwrap().to_bytes(),
        },
    ))
}

/// A fenced PUT to `/accounts/{id}` on `base` (scheme and authority).
async fn put_via<C>(
    client: &Client<C, Full<Bytes>>,
    base: &str,
    id: &str,
    token: &str,
) -> Result<(Version, Reply), hyper_util::client::legacy::Error>
where
    C: Connect + Clone + Send + Sync + 'static,
{
    exchange(
        client,
        Method::PUT,
        &format!("{base}/accounts/{id}"),
        &[("fencing-token", token)],
        "balance=10",
    )
    .await
}

/// `a: b: c` from an error and its sources.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn assert_admitted(reply: &Reply) {
    assert_eq!(reply.status, StatusCode::OK, "body: {}", reply.text());
    assert_eq!(reply.text(), "ok");
    assert_eq!(reply.headers["x-upstream"], "yes");
}

fn assert_stale(reply: &Reply, token: u64, current: u64) {
    let body = reply.assert_problem(409, "urn:fencegate:stale-token");
    assert_eq!(reply.headers["fencing-token-current"], current.to_string());
    assert_eq!(body["resource"], "account:a");
    assert_eq!(body["token"], token);
    assert_eq!(body["current_token"], current);
}

/// The one request an upstream saw: a PUT to `/accounts/a` carrying `token`.
fn assert_one_put(seen: &[Seen], token: &str, proto: &str) {
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].method, Method::PUT);
    assert_eq!(seen[0].target, "/accounts/a");
    assert_eq!(seen[0].headers["fencing-token"], token);
    assert_eq!(seen[0].headers["x-forwarded-proto"], proto);
    assert_eq!(seen[0].body, "balance=10");
}

// ---------------------------------------------------------------- HTTP/2 cleartext (h2c)

#[tokio::test]
async fn h2c_prior_knowledge_fences_writes() {
    let upstream = Upstream::start().await;
    let server = fencegate(&upstream.url(), ACCOUNTS).await;
    let base = format!("http://{}", server.listen);
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();

    let (version, reply) = put_via(&client, &base, "a", "7").await.unwrap();
    assert_eq!(version, Version::HTTP_2);
    assert_admitted(&reply);
    assert_one_put(&upstream.seen(), "7", "http");
    // The hop to the upstream is HTTP/1.1 whatever the client spoke; the upstream's hop-by-hop
    // `keep-alive` must not leak into an HTTP/2 response (it would be malformed there).
    assert!(reply.headers.get("keep-alive").is_none());

    let (version, reply) = put_via(&client, &base, "a", "6").await.unwrap();
    assert_eq!(version, Version::HTTP_2);
    assert_stale(&reply, 6, 7);
    assert_eq!(upstream.count(), 1);
    assert_eq!(recorded(&server, "account:a").await, Some(7));
}

#[tokio::test]
async fn h2c_token_with_leading_space_is_invalid() {
    let upstream = Upstream::start().await;
    let server = fencegate(&upstream.url(), ACCOUNTS).await;
    let base = format!("http://{}", server.listen);
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();

    // HPACK carries the value byte for byte, and neither hyper's h2 client nor its server
    // trims or refuses it, so fencegate sees " 5" and the grammar refuses it.
    let (version, reply) = put_via(&client, &base, "a", " 5").await.unwrap();
    assert_eq!(version, Version::HTTP_2);
    let body = reply.assert_problem(400, "urn:fencegate:invalid-token");
    assert_eq!(body["resource"], "account:a");
    assert!(body.get("token").is_none(), "{body}");
    assert_eq!(upstream.count(), 0);
    assert_eq!(recorded(&server, "account:a").await, None);

    // Contrast: over HTTP/1.1 the leading space is optional whitespace (RFC 9110 §5.5), the
    // parser strips it, and the token is a plain 5, which is admitted on a fresh resource.
    let reply = put(&server, "b", " 5").await;
    assert_eq!(reply.status, StatusCode::OK, "body: {}", reply.text());
    assert_eq!(upstream.count(), 1);
    assert_eq!(upstream.seen()[0].headers["fencing-token"], "5");
}

// ---------------------------------------------------------------- TLS listener

#[tokio::test]
async fn tls_alpn_h2_fences_writes() {
    let upstream = Upstream::start().await;
    let server = fencegate(&upstream.url(), &tls_listener(false)).await;
    let base = format!("https://127.0.0.1:{}", server.listen.port());
    let client = h2_client(false);

    let (version, reply) = put_via(&client, &base, "a", "7").await.unwrap();
    assert_eq!(version, Version::HTTP_2);
    assert_admitted(&reply);
    assert_one_put(&upstream.seen(), "7", "https");

    let (version, reply) = put_via(&client, &base, "a", "6").await.unwrap();
    assert_eq!(version, Version::HTTP_2);
    assert_stale(&reply, 6, 7);
    assert_eq!(upstream.count(), 1);
}

#[tokio::test]
async fn tls_http11_fences_writes() {
    let upstream = Upstream::start().await;
    let server = fencegate(&upstream.url(), &tls_listener(false)).await;
    // `localhost` exercises the DNS name in the certificate, 127.0.0.1 above the IP address.
    let base = format!("https://localhost:{}", server.listen.port());
    let client = h1_client(false);

    let (version, reply) = put_via(&client, &base, "a", "7").await.unwrap();
    assert_eq!(version, Version::HTTP_11);
    assert_admitted(&reply);
    assert_one_put(&upstream.seen(), "7", "https");
    assert_eq!(
        upstream.seen()[0].headers["x-forwarded-host"],
        format!("localhost:{}", server.listen.port())
    );

    let (version, reply) = put_via(&client, &base, "a", "6").await.unwrap();
    assert_eq!(version, Version::HTTP_11);
    assert_stale(&reply, 6, 7);
    assert_eq!(upstream.count(), 1);
}

/// TLS handshake with the given ALPN offer; the protocol the server picked.
async fn negotiate(addr: std::net::SocketAddr, offer: &[&[u8]]) -> Option<Vec<u8>> {
    let mut config = client_tls(false);
    config.alpn_protocols = offer.iter().map(|p| p.to_vec()).collect();
    let tcp = TcpStream::connect(addr).await.unwrap();
    let tls = TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec)
}

#[tokio::test]
async fn tls_listener_negotiates_alpn() {
    let upstream = Upstream::start().await;
    let server = fencegate(&upstream.url(), &tls_listener(false)).await;
    let addr = server.listen;

    assert_eq!(
        negotiate(addr, &[b"h2", b"http/1.1"]).await.as_deref(),
        Some(&b"h2"[..])
    );
    assert_eq!(
        negotiate(addr, &[b"http/1.1", b"h2"]).await.as_deref(),
        Some(&b"h2"[..]),
        "the server's preference wins"
    );
    assert_eq!(
        negotiate(addr, &[b"http/1.1"]).await.as_deref(),
        Some(&b"http/1.1"[..])
    );
    assert_eq!(negotiate(addr, &[]).await, None);

    // HTTP/1.1 explicitly negotiated by ALPN, on a bare hyper connection.
    let mut config = client_tls(false);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tcp = TcpStream::connect(addr).await.unwrap();
    let tls = TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    let resp = sender
        .send_request(
            Request::put("/accounts/a")
                .header("host", "localhost")
                .header("fencing-token", "3")
                .body(Full::new(Bytes::from_static(b"balance=10")))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.version(), Version::HTTP_11);
    assert_one_put(&upstream.seen(), "3", "https");
}

/// After the handshake, an HTTP/1 connection (ALPN `http/1.1`, or none) that sends nothing is
/// closed after `header_read`. (An HTTP/2 connection may stay idle: its clients keep it open
/// between requests.)
#[tokio::test]
async fn a_tls_connection_that_sends_nothing_is_closed_after_header_read() {
    use tokio::io::AsyncReadExt;
    let upstream = Upstream::start().await;
    let yaml = format!(
        "timeouts: {{ header_read: 300ms }}\n{}",
        tls_listener(false)
    );
    let server = fencegate(&upstream.url(), &yaml).await;
    for offer in [&[b"http/1.1".as_slice()][..], &[]] {
        let mut config = client_tls(false);
        config.alpn_protocols = offer.iter().map(|p| p.to_vec()).collect();
        let tcp = TcpStream::connect(server.listen).await.unwrap();
        let mut tls = TlsConnector::from(Arc::new(config))
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await
            .unwrap();
        let started = std::time::Instant::now();
        let mut buf = Vec::new();
        let read =
            tokio::time::timeout(std::time::Duration::from_secs(5), tls.read_to_end(&mut buf))
                .await;
        let after = started.elapsed();
        assert!(read.is_ok(), "{offer:?}: still open after 5 s");
        assert!(
            after >= std::time::Duration::from_millis(250),
            "{offer:?}: closed after {after:?}"
        );
    }
    assert_eq!(upstream.count(), 0);
}

#[tokio::test]
async fn tls_listener_refuses_plain_http() {
    let upstream = Upstream::start().await;
    let server = fencegate(&upstream.url(), &tls_listener(false)).await;

    // A cleartext request is not a TLS ClientHello: the answer is a TLS alert record (content
    // type 0x15, here a fatal decode_error), never an HTTP response, and the connection closes.
    let answer = raw(
        server.listen,
        b"PUT /accounts/a HTTP/1.1\r\nhost: x\r\nfencing-token: 7\r\ncontent-length: 0\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("\x15\x03"), "{answer:?}");
    assert_eq!(upstream.count(), 0);
    assert_eq!(recorded(&server, "account:a").await, None);
}

// ---------------------------------------------------------------- mutual TLS

#[tokio::test]
async fn mutual_tls_refuses_client_without_certificate() {
    let upstream = Upstream::start().await;
    let server = fencegate(&upstream.url(), &tls_listener(true)).await;
    let base = format!("https://127.0.0.1:{}", server.listen.port());

    for client in [h1_client(false), h2_client(false)] {
        // TLS 1.3: the client finishes its side of the handshake before the server has judged
        // its (empty) certificate, so the refusal arrives as an alert on the first read.
        let err = put_via(&client, &base, "a", "7").await.unwrap_err();
        let text = chain(&err);
        assert!(text.contains("CertificateRequired"), "{text}");
    }
    assert_eq!(upstream.count(), 0);
    assert_eq!(recorded(&server, "account:a").await, None);
}

#[tokio::test]
async fn mutual_tls_admits_client_with_certificate() {
    let upstream = Upstream::start().await;
    let server = fencegate(&upstream.url(), &tls_listener(true)).await;
    let base = format!("https://127.0.0.1:{}", server.listen.port());

    let (version, reply) = put_via(&h2_client(true), &base, "a", "7").await.unwrap();
    assert_eq!(version, Version::HTTP_2);
    assert_admitted(&reply);
    assert_one_put(&upstream.seen(), "7", "https");

    let (version, reply) = put_via(&h1_client(true), &base, "a", "6").await.unwrap();
    assert_eq!(version, Version::HTTP_11);
    assert_stale(&reply, 6, 7);
    assert_eq!(upstream.count(), 1);
}

// ---------------------------------------------------------------- https upstream

/// A recording upstream behind TLS (the server certificate from the fixtures), like
/// [`Upstream`] but without gating.
struct TlsUpstream {
    port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl TlsUpstream {
    async fn start() -> TlsUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let config = fencegate::tls::server_config(
            &TlsConfig {
                cert: fixture("server.pem"),
                key: fixture("server-key.pem"),
                client_ca: None,
            },
            &fencegate::tls::CONFIG_TLS,
        )
        .unwrap();
        let tls_settings = ServerSettings {
            tls: Some(TlsAcceptor::from(config)),
            ..settings()
        };
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let handler_seen = Arc::clone(&seen);
        tokio::spawn(serve(
            listener,
            tls_settings,
            move |req: Request<Incoming>, _| {
                let seen = Arc::clone(&handler_seen);
                async move {
                    let (parts, body) = req.into_parts();
                    let body = body
                        .collect()
                        .await
                        .map(|b| b.to_bytes())
                        .unwrap_or_default();
                    seen.lock().unwrap().push(Seen {
                        method: parts.method,
                        target: parts
                            .uri
                            .path_and_query()
                            .map(|p| p.as_str().to_owned())
                            .unwrap_or_default(),
                        headers: parts.headers,
                        body,
                    });
                    let mut resp = Response::new(ProxyBody::local("ok"));
                    resp.headers_mut()
                        .insert("x-upstream", "yes".parse().unwrap());
                    Ok(resp)
                }
            },
            std::future::pending(),
        ));
        TlsUpstream { port, seen }
    }

    /// By name, so the certificate's DNS name is what gets verified.
    fn url(&self) -> String {
        format!("https://localhost:{}", self.port)
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

#[tokio::test]
async fn https_upstream_trusted_through_upstream_ca() {
    let upstream = TlsUpstream::start().await;
    let extra = format!("upstream_ca: {}\n{ACCOUNTS}", yaml_path("ca.pem"));
    let server = fencegate(&upstream.url(), &extra).await;

    let reply = send(
        "PUT",
        &format!("http://{}/accounts/a", server.listen),
        &[("fencing-token", "7")],
        "balance=10",
    )
    .await;
    assert_admitted(&reply);
    assert_one_put(&upstream.seen(), "7", "http");
}

#[tokio::test]
async fn https_upstream_without_upstream_ca_is_untrusted() {
    let upstream = TlsUpstream::start().await;
    let server = fencegate(&upstream.url(), ACCOUNTS).await;

    let reply = put(&server, "a", "7").await;
    let body = reply.assert_problem(502, "urn:fencegate:upstream-error");
    let detail = body["detail"].as_str().unwrap();
    assert!(detail.contains("UnknownIssuer"), "{detail}");
    assert!(upstream.seen().is_empty(), "{:?}", upstream.seen());
    // The token was admitted before forwarding failed, and an upstream error does not undo it.
    assert_eq!(recorded(&server, "account:a").await, Some(7));
}
