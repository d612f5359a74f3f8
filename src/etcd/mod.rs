//! A small etcd v3 client: what the etcd fence store and lease backend use, over tonic.
//!
//! The gRPC code under [`pb`] is generated from etcd's API protos (`proto/`) by
//! `scripts/regen-etcd` and committed, so building fencegate needs no `protoc`.
//!
//! - [`Client::connect`]: one tonic channel balanced over the endpoints, connecting lazily and
//!   again after failures, with connect and per-request timeouts and HTTP/2 keep-alive.
//! - [`KvClient`]: `Range` and `Txn` (transactions built from [`Txn`], [`TxnOp`], [`Compare`]).
//! - [`LeaseClient`]: `LeaseGrant`, `LeaseRevoke`, one `LeaseKeepAlive` round trip,
//!   `LeaseTimeToLive`.
//! - [`WatchClient`]: a `Watch` stream per call, with progress requests.
//!
//! Names and shapes follow the `etcd-client` crate this replaces, so its users read the same;
//! answers are the generated messages, with accessors for the fields the users read.
//!
//! Every client goes through [`Transport`]: TLS (an `https` endpoint with a rustls config) and
//! authentication (an interceptor adding the `token` metadata that `Auth.Authenticate` returns)
//! would change it and [`Client::connect`], not the clients.

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

use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

pub use kv::{Compare, CompareOp, GetOptions, KvClient, PutOptions, Txn, TxnOp, TxnOpResponse};
pub use lease::{LeaseClient, LeaseTimeToLiveOptions};
pub use watch::{EventType, WatchClient, WatchFilterType, WatchOptions};

/// What every generated client sends its requests through.
type Transport = Channel;

/// Why an etcd call failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid arguments: {0}")]
    InvalidArgs(String),
    #[error("transport error: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("grpc request error: {0}")]
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

/// How [`Client::connect`] reaches the endpoints.
#[derive(Debug, Clone, Copy, Default)]
pub struct ConnectOptions {
    connect_timeout: Option<Duration>,
    timeout: Option<Duration>,
    /// HTTP/2 keep-alive (interval, timeout), also while idle.
    keep_alive: Option<(Duration, Duration)>,
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
}

/// A connection to an etcd cluster, from which the per-service clients are taken (they share
/// its channel; cloning them is cheap).
#[derive(Clone)]
pub struct Client {
    channel: Transport,
}

impl Client {
    /// `endpoints`: `http://host:port` URLs. Nothing is dialled here: the channel connects on
    /// first use, to any endpoint that answers, and reconnects after failures.
    pub async fn connect<E: AsRef<str>, S: AsRef<[E]>>(
        endpoints: S,
        options: Option<ConnectOptions>,
    ) -> Result<Self, Error> {
        let options = options.unwrap_or_default();
        let endpoints = endpoints
            .as_ref()
            .iter()
            .map(|url| endpoint(url.as_ref(), &options))
            .collect::<Result<Vec<_>, _>>()?;
        if endpoints.is_empty() {
            return Err(Error::InvalidArgs("empty endpoints".into()));
        }
        // Balanced even over one endpoint, so a broken connection is replaced.
        let channel = Channel::balance_list(endpoints.into_iter());
        Ok(Client { channel })
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
    if !url.starts_with("http://") {
        return Err(Error::InvalidArgs(format!(
            "etcd endpoints are http:// URLs: {url}"
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

    #[tokio::test]
    async fn endpoints_are_checked() {
        assert!(Client::connect(["http://127.0.0.1:2379"], None)
            .await
            .is_ok());
        assert!(Client::connect(Vec::<String>::new(), None).await.is_err());
        assert!(Client::connect(["127.0.0.1:2379"], None).await.is_err());
    }
}
