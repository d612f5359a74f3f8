//! etcd clients, as the fence store and the lease backend make them: one url form, and the
//! same timeouts and keep-alive.

use std::sync::Arc;
use std::time::Duration;

use super::Failure;
use crate::etcd::{Client, ConnectOptions, Error};
use crate::tls::ClientTls;

use super::url::{etcd as parse_url, UrlReadError};

/// Why no etcd client was made.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ClientError {
    /// The url cannot be read.
    #[error(transparent)]
    Url(#[from] UrlReadError),
    /// The client refused its endpoints or options.
    #[error("etcd: {0}")]
    Client(#[source] Error),
}

/// A client for `url` (TLS with `tls`, which an `https://` url has), as the store and the
/// lease backend use it: fail fast (1s to connect, 2s per request) and keep-alive pings, so
/// the caller's deadline decides how long to wait.
pub(crate) async fn client(url: &str, tls: Option<Arc<ClientTls>>) -> Result<Client, ClientError> {
    let url = parse_url(url)?;
    let mut options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(1))
        .with_timeout(Duration::from_secs(2))
        .with_keep_alive(Duration::from_secs(5), Duration::from_secs(2));
    if let Some(tls) = tls {
        options = options.with_tls(tls);
    }
    if let Some((name, password)) = url.user {
        options = options.with_user(name, password);
    }
    Client::connect(url.endpoints, Some(options))
        .await
        .map_err(ClientError::Client)
}

/// How an etcd call failed. By the gRPC status: a deadline (etcd's `request timed out`, or
/// the client's request timeout, which tonic reports as cancelled) is a timeout; what etcd
/// refuses to do (authentication, permissions, a full database, a lease it does not have) is
/// refused; a connection that failed or broke is unreachable. A value that is no UTF-8 is
/// corrupt.
pub(crate) fn failure(e: &Error) -> Failure {
    use tonic::Code;
    match e {
        Error::GRpcStatus(status) => match status.code() {
            Code::DeadlineExceeded => Failure::Timeout,
            Code::Cancelled if status.message().contains("Timeout expired") => Failure::Timeout,
            Code::Unauthenticated
            | Code::PermissionDenied
            | Code::InvalidArgument
            | Code::FailedPrecondition
            | Code::ResourceExhausted
            | Code::NotFound
            | Code::AlreadyExists
            | Code::OutOfRange
            | Code::Unimplemented => Failure::Refused,
            Code::Ok
            | Code::Cancelled
            | Code::Unknown
            | Code::Aborted
            | Code::Internal
            | Code::Unavailable
            | Code::DataLoss => Failure::Unreachable,
        },
        Error::LeaseKeepAlive(_) => Failure::Refused,
        Error::Utf8(_) => Failure::Corrupt,
        Error::InvalidArgs(_) | Error::Transport(_) | Error::Stream(_) => Failure::Unreachable,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::url::EtcdUrl;

    #[test]
    fn url_forms() {
        let endpoints = |url| parse_url(url).unwrap().endpoints;
        assert_eq!(
            endpoints("etcd://a:2379,b:2379"),
            ["http://a:2379", "http://b:2379"]
        );
        assert_eq!(
            endpoints("http://127.0.0.1:2379/"),
            ["http://127.0.0.1:2379"]
        );
        assert_eq!(
            parse_url("https://fence%40gate:p%3Ass@a:2379,b:2379").unwrap(),
            EtcdUrl {
                endpoints: vec!["https://a:2379".into(), "https://b:2379".into()],
                user: Some(("fence@gate".into(), "p:ss".into())),
            }
        );
        assert!(parse_url("redis://x").is_err());
        assert!(parse_url("https://user@a:2379").is_err());
        assert!(parse_url("https://:pw@a:2379").is_err());
    }

    #[test]
    fn failures_are_told_apart() {
        let status = |code, message| failure(&Error::GRpcStatus(tonic::Status::new(code, message)));
        use tonic::Code;
        assert_eq!(
            status(Code::DeadlineExceeded, "etcdserver: request timed out"),
            Failure::Timeout
        );
        assert_eq!(status(Code::Cancelled, "Timeout expired"), Failure::Timeout);
        assert_eq!(
            status(Code::Unavailable, "tcp connect error"),
            Failure::Unreachable
        );
        assert_eq!(
            status(
                Code::ResourceExhausted,
                "etcdserver: mvcc: database space exceeded"
            ),
            Failure::Refused
        );
        assert_eq!(
            status(Code::PermissionDenied, "etcdserver: permission denied"),
            Failure::Refused
        );
    }
}
