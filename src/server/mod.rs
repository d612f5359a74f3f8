//! Accept loop shared by the proxy and admin listeners.
//!
//! `serve(listener, ..., shutdown)` takes a bound listener and a shutdown future (tests bind
//! port 0). On shutdown the listener is closed at once, open connections are told to finish
//! their current requests (HTTP/1 keep-alive off, HTTP/2 GOAWAY), and the call returns when
//! they are done or when `drain` has passed, whichever is first.

mod drain;
mod head_timer;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;

use crate::body::ProxyBody;
use drain::Drain;
use head_timer::HeadTimer;

/// Connection-level settings.
#[derive(Clone)]
pub struct ServerSettings {
    pub tls: Option<TlsAcceptor>,
    /// Time allowed for the TLS handshake and for each request head.
    pub header_read: Duration,
    pub max_header_bytes: usize,
    pub max_headers: usize,
    pub max_connections: usize,
    /// Bound on the graceful drain after shutdown.
    pub drain: Duration,
}

/// Serves `handler` on `listener` until `shutdown` resolves, then drains: accepts
/// connections ([`Acceptor`]), serves each in a task of its own ([`connection`]), and at the
/// end waits for them ([`drain_connections`]).
pub async fn serve<H, F>(
    listener: TcpListener,
    settings: ServerSettings,
    handler: H,
    shutdown: impl Future<Output = ()>,
) where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Result<Response<ProxyBody>, Infallible>> + Send + 'static,
{
    let builders = Arc::new(Builders::new(&settings));
    let drain = Arc::new(Drain::default());
    let mut acceptor = Acceptor::new(listener, settings.max_connections);
    tokio::pin!(shutdown);
    while let Some((stream, peer, permit)) = acceptor.accept(shutdown.as_mut()).await {
        let handler = handler.clone();
        let service = service_fn(move |req| handler(req, peer));
        let conn = Connection {
            builders: Arc::clone(&builders),
            tls: settings.tls.clone(),
            handshake_limit: settings.header_read,
            peer,
        };
        let entry = drain.enter();
        tokio::spawn(async move {
            let _permit = permit;
            conn.serve(stream, service, entry).await;
        });
    }
    let addr = acceptor.listener.local_addr().ok();
    drop(acceptor);
    drain_connections(addr, &drain, settings.drain).await;
}

/// The listener and what bounds it: at most `max_connections` open at once, and a backoff
/// when accepting fails.
struct Acceptor {
    listener: TcpListener,
    slots: Arc<Semaphore>,
    backoff: Duration,
}

impl Acceptor {
    fn new(listener: TcpListener, max_connections: usize) -> Self {
        Acceptor {
            listener,
            slots: Arc::new(Semaphore::new(max_connections)),
            backoff: Duration::from_millis(5),
        }
    }

    /// The next connection (with its slot), once a slot is free; `None` once `shutdown` has
    /// resolved.
    async fn accept(
        &mut self,
        mut shutdown: std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> Option<(TcpStream, SocketAddr, OwnedSemaphorePermit)> {
        loop {
            let permit = tokio::select! {
                () = &mut shutdown => return None,
                permit = Arc::clone(&self.slots).acquire_owned() => permit.expect("never closed"),
            };
            let accepted = tokio::select! {
                () = &mut shutdown => return None,
                accepted = self.listener.accept() => accepted,
            };
            match accepted {
                Ok((stream, peer)) => {
                    self.backoff = Duration::from_millis(5);
                    let _ = stream.set_nodelay(true);
                    return Some((stream, peer, permit));
                }
                Err(e) => {
                    // Usually EMFILE: back off instead of spinning or dying.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(self.backoff).await;
                    self.backoff = (self.backoff * 2).min(Duration::from_secs(1));
                }
            }
        }
    }
}

/// One connection: TLS or not, HTTP/1 or HTTP/2, served until it ends or the drain tells it
/// to finish.
///
/// Connections are served by hyper's HTTP/1 or HTTP/2 connection, as ALPN or, in cleartext,
/// their first bytes say ([`sniff`]); plain ones whose first bytes do not tell yet by
/// hyper-util's builder, which reads them itself and replays them to the connection. Serving
/// directly spares every read that replay wrapper, and a connection that sends nothing is
/// closed after `header_read` (the builder would wait for its first bytes for ever). The
/// header-read timer is per connection ([`HeadTimer`]), set on each connection's copy of the
/// builder.
struct Connection {
    builders: Arc<Builders>,
    tls: Option<TlsAcceptor>,
    /// `header_read`: how long the TLS handshake, or the first bytes, may take.
    handshake_limit: Duration,
    peer: SocketAddr,
}

impl Connection {
    async fn serve<S>(self, stream: TcpStream, service: S, entry: drain::Entry)
    where
        S: hyper::service::Service<
                Request<Incoming>,
                Response = Response<ProxyBody>,
                Error = Infallible,
            > + Clone
            + Send
            + 'static,
        S::Future: Send + 'static,
    {
        let builders = &self.builders;
        let Some(acceptor) = self.tls else {
            match tokio::time::timeout(self.handshake_limit, sniff(&stream)).await {
                Ok(Ok(Sniffed::Http1)) => {
                    let conn = builders
                        .http1()
                        .serve_connection(TokioIo::new(stream), service);
                    let _ = entry.watch(conn, |conn| conn.graceful_shutdown()).await;
                }
                Ok(Ok(Sniffed::Http2)) => {
                    let conn = builders
                        .http2
                        .serve_connection(TokioIo::new(stream), service);
                    let _ = entry.watch(conn, |conn| conn.graceful_shutdown()).await;
                }
                Ok(Ok(Sniffed::NotYet)) => {
                    let mut auto = builders.auto.clone();
                    auto.http1().timer(HeadTimer::default());
                    let conn = auto.serve_connection(TokioIo::new(stream), service);
                    let _ = entry.watch(conn, |conn| conn.graceful_shutdown()).await;
                }
                // Closed, failed, or silent for as long as a head may take.
                Ok(Err(_)) | Err(_) => {}
            }
            return;
        };
        let peer = self.peer;
        let tls = match tokio::time::timeout(self.handshake_limit, acceptor.accept(stream)).await {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                let error = crate::tls::handshake_error(&e, "client");
                // A client certificate refused (`tls.client_ca`) is a setup to fix; other
                // failures are the client's business.
                if crate::tls::certificate_refused(&e) {
                    tracing::warn!(%peer, %error, "TLS handshake failed");
                } else {
                    tracing::debug!(%peer, %error, "TLS handshake failed");
                }
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, "TLS handshake timed out");
                return;
            }
        };
        // Over TLS the version is negotiated (ALPN), never sniffed (RFC 9113 §3.3).
        if tls.get_ref().1.alpn_protocol() == Some(b"h2") {
            let conn = builders.http2.serve_connection(TokioIo::new(tls), service);
            let _ = entry.watch(conn, |conn| conn.graceful_shutdown()).await;
        } else {
            let conn = builders
                .http1()
                .serve_connection(TokioIo::new(tls), service);
            let _ = entry.watch(conn, |conn| conn.graceful_shutdown()).await;
        }
    }
}

/// After the listener has closed: waits for the open connections to finish, at most `limit`.
async fn drain_connections(addr: Option<SocketAddr>, drain: &Drain, limit: Duration) {
    tracing::info!(
        addr = addr.map(tracing::field::display),
        open = drain.count(),
        "listener closed; draining connections"
    );
    tokio::select! {
        () = drain.shutdown() => {}
        () = tokio::time::sleep(limit) => {
            tracing::warn!(
                addr = addr.map(tracing::field::display),
                open = drain.count(),
                drain = %crate::duration::display(limit),
                "connections still open after the drain timeout; no longer waiting for them (they close when the process exits)"
            );
        }
    }
}

/// The connection builders, configured once.
struct Builders {
    http1: http1::Builder,
    http2: http2::Builder<TokioExecutor>,
    /// For plain connections whose first bytes do not tell the version yet.
    auto: auto::Builder<TokioExecutor>,
}

impl Builders {
    /// The builders with `settings`' limits. hyper's builders and hyper-util's take the same
    /// settings through different types.
    fn new(settings: &ServerSettings) -> Self {
        macro_rules! http1_settings {
            ($builder:expr) => {
                $builder
                    .header_read_timeout(settings.header_read)
                    .writev(false)
                    .max_buf_size(settings.max_header_bytes.max(8192))
                    .max_headers(settings.max_headers)
            };
        }
        macro_rules! http2_settings {
            ($builder:expr) => {
                $builder
                    .timer(TokioTimer::new())
                    .max_header_list_size(
                        u32::try_from(settings.max_header_bytes).unwrap_or(u32::MAX),
                    )
                    .max_concurrent_streams(256)
                    // Bounds the rapid-reset pattern (CVE-2023-44487): too many resets close
                    // the connection.
                    .max_pending_accept_reset_streams(50)
                    .max_local_error_reset_streams(256)
            };
        }
        let mut http1 = http1::Builder::new();
        http1_settings!(http1);
        let mut http2 = http2::Builder::new(TokioExecutor::new());
        http2_settings!(http2);
        let mut auto = auto::Builder::new(TokioExecutor::new());
        http1_settings!(auto.http1());
        http2_settings!(auto.http2());
        Builders { http1, http2, auto }
    }

    /// The HTTP/1 builder, with a header-read timer of the connection's own.
    fn http1(&self) -> http1::Builder {
        let mut http1 = self.http1.clone();
        http1.timer(HeadTimer::default());
        http1
    }
}

/// What a plain connection's first bytes say it speaks.
#[derive(Debug, PartialEq)]
enum Sniffed {
    Http1,
    /// The HTTP/2 connection preface (prior knowledge, RFC 9113 §3.3).
    Http2,
    /// A beginning of the preface, but not all of it yet.
    NotYet,
}

/// The HTTP/2 connection preface.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Tells HTTP/1 from HTTP/2 by the first bytes that arrive, without taking them from the
/// socket: the HTTP/1 or HTTP/2 connection then reads the stream as it came. An error for a
/// connection closed before it sent anything.
async fn sniff(stream: &tokio::net::TcpStream) -> std::io::Result<Sniffed> {
    let mut first = [0u8; PREFACE.len()];
    let n = stream.peek(&mut first).await?;
    Ok(match n {
        0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
        _ if first[..n] != PREFACE[..n] => Sniffed::Http1,
        _ if n == PREFACE.len() => Sniffed::Http2,
        _ => Sniffed::NotYet,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first bytes, peeked: the preface is HTTP/2, anything that leaves it is HTTP/1, a
    /// part of it is not decided, a close before any byte is an error; nothing is taken.
    #[tokio::test]
    async fn sniff_tells_the_version_by_the_first_bytes_and_leaves_them() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        for (sent, expected) in [
            (&PREFACE[..], Some(Sniffed::Http2)),
            (&b"GET / HTTP/1.1\r\n"[..], Some(Sniffed::Http1)),
            (&b"PUT /a HTTP/1.1\r\n"[..], Some(Sniffed::Http1)),
            (&b"P"[..], Some(Sniffed::NotYet)),
            (&PREFACE[..23], Some(Sniffed::NotYet)),
            (&b""[..], None),
        ] {
            let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (mut server, _) = listener.accept().await.unwrap();
            client.write_all(sent).await.unwrap();
            if sent.is_empty() {
                client.shutdown().await.unwrap();
            }
            let got = sniff(&server).await.ok();
            assert_eq!(got, expected, "{:?}", String::from_utf8_lossy(sent));
            let mut kept = vec![0u8; sent.len()];
            server.read_exact(&mut kept).await.unwrap();
            assert_eq!(kept, sent, "the bytes stay for the connection");
        }
    }
}
