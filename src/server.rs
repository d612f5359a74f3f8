//! Accept loop shared by the proxy and admin listeners.
//!
//! `serve(listener, ..., shutdown)` takes a bound listener and a shutdown future (tests bind
//! port 0). On shutdown the listener is closed at once, open connections are told to finish
//! their current requests (HTTP/1 keep-alive off, HTTP/2 GOAWAY), and the call returns when
//! they are done or when `drain` has passed, whichever is first.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;

use crate::proxy::body::ProxyBody;

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

/// Serves `handler` on `listener` until `shutdown` resolves, then drains.
pub async fn serve<H, F>(
    listener: TcpListener,
    settings: ServerSettings,
    handler: H,
    shutdown: impl Future<Output = ()>,
) where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Result<Response<ProxyBody>, Infallible>> + Send + 'static,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(settings.header_read)
        .writev(false)
        .max_buf_size(settings.max_header_bytes.max(8192))
        .max_headers(settings.max_headers);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(settings.max_header_bytes).unwrap_or(u32::MAX))
        .max_concurrent_streams(256)
        // Bounds the rapid-reset pattern (CVE-2023-44487): too many resets close the connection.
        .max_pending_accept_reset_streams(50)
        .max_local_error_reset_streams(256);
    let builder = Arc::new(builder);
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(settings.max_connections));
    tokio::pin!(shutdown);
    let mut backoff = Duration::from_millis(5);
    loop {
        let permit = tokio::select! {
            () = &mut shutdown => break,
            permit = Arc::clone(&slots).acquire_owned() => permit.expect("never closed"),
        };
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // Usually EMFILE: back off instead of spinning or dying.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    continue;
                }
            },
        };
        backoff = Duration::from_millis(5);
        let _ = stream.set_nodelay(true);
        let builder = Arc::clone(&builder);
        let watcher = graceful.watcher();
        let handler = handler.clone();
        let settings_tls = settings.tls.clone();
        let handshake_limit = settings.header_read;
        tokio::spawn(async move {
            let _permit = permit;
            let service = service_fn(move |req| handler(req, peer));
            match settings_tls {
                None => {
                    let conn = builder.serve_connection(TokioIo::new(stream), service);
                    let _ = watcher.watch(conn.into_owned()).await;
                }
                Some(acceptor) => {
                    let tls = match tokio::time::timeout(handshake_limit, acceptor.accept(stream))
                        .await
                    {
                        Ok(Ok(tls)) => tls,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "TLS handshake timed out");
                            return;
                        }
                    };
                    let conn = builder.serve_connection(TokioIo::new(tls), service);
                    let _ = watcher.watch(conn.into_owned()).await;
                }
            }
        });
    }
    let addr = listener.local_addr().ok();
    drop(listener);
    tracing::info!(addr = ?addr, open = graceful.count(), "listener closed; draining connections");
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(settings.drain) => {
            tracing::warn!(drain = ?settings.drain, "connections still open after the drain timeout; closing them");
        }
    }
}
