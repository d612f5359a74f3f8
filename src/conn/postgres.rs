//! Connections to PostgreSQL, as the fence store and the lease backend make them: a pool
//! ([`pool`]) and, with the `tls` mapping, TLS only ([`PgTls`]).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::config::SslMode;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};
use tokio_postgres::{NoTls, Socket};

use super::{BoxFuture, Failure};
use crate::tls::ClientTls;

/// A connection pool for `url` (at most 16 connections), the same for the store and the lease
/// backend; also returns the parsed config for dedicated connections.
///
/// With `tls`, every connection is TLS through [`PgTls`] (`sslmode=require`, so never
/// plaintext: a server that does not offer TLS is an error) and the certificate and name are
/// verified as `verify-full` does; an `sslmode` in the url (only `require`, `verify-ca` or
/// `verify-full` load with `tls`) is replaced by that.
pub(crate) fn pool(
    url: &str,
    tls: Option<Arc<ClientTls>>,
) -> Result<(Pool, tokio_postgres::Config), String> {
    let url = match &tls {
        Some(_) => without_sslmode(url),
        None => url.to_owned(),
    };
    let mut config: tokio_postgres::Config =
        url.parse().map_err(|e| format!("bad postgres url: {e}"))?;
    let manager_config = ManagerConfig {
        recycling_method: RecyclingMethod::Fast,
    };
    let manager = match tls {
        Some(tls) => {
            config.ssl_mode(SslMode::Require);
            Manager::from_config(config.clone(), PgTls(tls), manager_config)
        }
        None => Manager::from_config(config.clone(), NoTls, manager_config),
    };
    let pool = Pool::builder(manager)
        .max_size(16)
        .build()
        .map_err(|e| format!("postgres pool: {e}"))?;
    Ok((pool, config))
}

/// `url` without its `sslmode` parameter.
fn without_sslmode(url: &str) -> String {
    let Some((base, query)) = url.split_once('?') else {
        return url.to_owned();
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| !pair.starts_with("sslmode="))
        .collect();
    if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    }
}

/// TLS for tokio-postgres over rustls: the handshake through [`ClientTls`] (its files as
/// they are at each new connection, the host or `server_name` checked against the
/// certificate). No channel binding is offered, so SCRAM runs without `-PLUS`; the verified
/// certificate is what ties the session to the server.
#[derive(Clone)]
pub struct PgTls(pub Arc<ClientTls>);

impl MakeTlsConnect<Socket> for PgTls {
    type Stream = PgTlsStream;
    type TlsConnect = PgTlsConnect;
    type Error = std::io::Error;

    fn make_tls_connect(&mut self, host: &str) -> Result<PgTlsConnect, std::io::Error> {
        Ok(PgTlsConnect {
            tls: Arc::clone(&self.0),
            host: host.to_owned(),
        })
    }
}

/// One connection's handshake: [`PgTls`] for `host`.
pub struct PgTlsConnect {
    tls: Arc<ClientTls>,
    host: String,
}

impl TlsConnect<Socket> for PgTlsConnect {
    type Stream = PgTlsStream;
    type Error = std::io::Error;
    type Future = BoxFuture<'static, Result<PgTlsStream, std::io::Error>>;

    fn connect(self, socket: Socket) -> Self::Future {
        Box::pin(async move {
            let stream = self.tls.connect(&self.host, socket).await?;
            Ok(PgTlsStream(stream))
        })
    }
}

/// A TLS connection to PostgreSQL.
pub struct PgTlsStream(tokio_rustls::client::TlsStream<Socket>);

impl tokio_postgres::tls::TlsStream for PgTlsStream {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

impl AsyncRead for PgTlsStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for PgTlsStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
}

/// An error with its causes: tokio-postgres says "error performing TLS handshake" or "db
/// error" and keeps why (the certificate, the server's message) in its sources.
pub(crate) fn describe(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = cause.source();
    }
    text
}

/// How a PostgreSQL call failed, from the error and its causes: the server's own error
/// (authentication, permissions, a read-only transaction, a full disk, a constraint) is
/// refused; the pool's wait or a connect attempt that timed out is a timeout; anything else
/// (connecting, TLS, a connection that closed) unreachable.
pub(crate) fn failure(e: &(dyn std::error::Error + 'static)) -> Failure {
    let mut next = Some(e);
    while let Some(e) = next {
        if e.is::<tokio_postgres::error::DbError>() {
            return Failure::Refused;
        }
        if let Some(deadpool_postgres::PoolError::Timeout(_)) = e.downcast_ref() {
            return Failure::Timeout;
        }
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return Failure::Timeout;
        }
        next = e.source();
    }
    Failure::Unreachable
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_replaces_the_urls_sslmode_with_require() {
        assert_eq!(
            without_sslmode("postgres://u@h/db?sslmode=verify-full"),
            "postgres://u@h/db"
        );
        assert_eq!(
            without_sslmode(
                "postgres://u@h/db?application_name=fg&sslmode=require&connect_timeout=2"
            ),
            "postgres://u@h/db?application_name=fg&connect_timeout=2"
        );
        assert_eq!(without_sslmode("postgres://u@h/db"), "postgres://u@h/db");
        let tls = Arc::new(ClientTls::load(&Default::default(), "store.tls", &[]).unwrap());
        let (_, config) = pool("postgres://u@h/db?sslmode=verify-full", Some(tls)).unwrap();
        assert_eq!(config.get_ssl_mode(), SslMode::Require);
        let (_, config) = pool("postgres://u@h/db", None).unwrap();
        assert_eq!(config.get_ssl_mode(), SslMode::Prefer);
    }

    #[test]
    fn failures_are_told_apart() {
        let waited = deadpool_postgres::PoolError::Timeout(deadpool_postgres::TimeoutType::Wait);
        assert_eq!(failure(&waited), Failure::Timeout);
        let timed_out = std::io::Error::new(std::io::ErrorKind::TimedOut, "x");
        assert_eq!(failure(&timed_out), Failure::Timeout);
        assert_eq!(
            failure(&deadpool_postgres::PoolError::Closed),
            Failure::Unreachable
        );
    }
}
