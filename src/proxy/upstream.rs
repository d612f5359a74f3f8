//! Sending a request upstream: over this client connection's own upstream connection when it
//! can, through the shared pool otherwise.
//!
//! Requests on one HTTP/1 client connection come one after another, so one upstream
//! connection serves them all: no pool checkout and return per request (the largest share of
//! the legacy client's cost). HTTP/2 clients (concurrent streams) and `https` upstreams use
//! the pool. Either way a request is sent once: a connection found dead *before* sending is
//! replaced, a failure after sending is the caller's 502.

use std::error::Error as StdError;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::uri::Authority;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

use super::idempotent::UpstreamBody;
use super::UpstreamClient;

pub type BoxError = Box<dyn StdError + Send + Sync>;

/// One client connection's upstream connection, and the authority it goes to (a reload may
/// change the upstream; the old connection is then dropped).
type Held = (Authority, SendRequest<UpstreamBody>);

/// The slot for a client connection's upstream connection.
///
/// `Clone` gives a **new, empty** slot: the server clones its handler once per accepted
/// connection, so a handler that captures a slot gives every connection its own. Requests of
/// that connection reach it through [`ConnUpstream::share`].
#[derive(Default)]
pub struct ConnUpstream(Arc<Mutex<Option<Held>>>);

impl Clone for ConnUpstream {
    fn clone(&self) -> Self {
        ConnUpstream::default()
    }
}

impl ConnUpstream {
    /// This slot, for one request of its connection.
    pub fn share(&self) -> SharedSlot {
        SharedSlot(Arc::clone(&self.0))
    }
}

/// A handle on a connection's slot (same slot, unlike `ConnUpstream::clone`).
#[derive(Clone)]
pub struct SharedSlot(Arc<Mutex<Option<Held>>>);

impl SharedSlot {
    fn take(&self, authority: &Authority) -> Option<SendRequest<UpstreamBody>> {
        let mut slot = self.0.lock().expect("upstream slot poisoned");
        match slot.take() {
            Some((a, sender)) if a == *authority && !sender.is_closed() => Some(sender),
            _ => None,
        }
    }

    fn put(&self, authority: Authority, sender: SendRequest<UpstreamBody>) {
        *self.0.lock().expect("upstream slot poisoned") = Some((authority, sender));
    }
}

// Built once per request and moved straight into its future: boxing the request would cost an
// allocation per request to save stack space nobody holds on to.
#[allow(clippy::large_enum_variant)]
enum Via {
    Pool(hyper_util::client::legacy::ResponseFuture),
    Own(SharedSlot, Authority, Request<UpstreamBody>),
}

/// Sends `req` (absolute URI) upstream: on `own` when given, through `pool` otherwise.
pub fn send(
    pool: &UpstreamClient,
    own: Option<(SharedSlot, Authority)>,
    connect_timeout: Duration,
    req: Request<UpstreamBody>,
) -> impl Future<Output = Result<Response<Incoming>, BoxError>> + Send + 'static {
    let via = match own {
        None => Via::Pool(pool.request(req)),
        Some((slot, authority)) => Via::Own(slot, authority, req),
    };
    async move {
        let (slot, authority, mut req) = match via {
            Via::Pool(response) => return response.await.map_err(Into::into),
            Via::Own(slot, authority, req) => (slot, authority, req),
        };
        let mut sender = match slot.take(&authority) {
            Some(sender) => sender,
            None => connect(&authority, connect_timeout).await?,
        };
        if sender.ready().await.is_err() {
            // Closed before anything was sent on it: a new connection is safe.
            sender = connect(&authority, connect_timeout).await?;
            sender.ready().await?;
        }
        // Origin form and the upstream's Host, as the pooled client would send them.
        let path = req
            .uri()
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
        *req.uri_mut() = http::Uri::from(path);
        req.headers_mut().insert(
            http::header::HOST,
            http::HeaderValue::from_str(authority.as_str())?,
        );
        let response = sender.send_request(req).await;
        // Back in the slot once the upstream has answered (the next request waits in
        // `ready()` for the body to end). An exchange that failed, or was given up by a timeout
        // (this future dropped), takes its connection with it: the next request gets a fresh
        // one instead of queueing behind an upstream that does not answer.
        if response.is_ok() {
            slot.put(authority, sender);
        }
        response.map_err(Into::into)
    }
}

async fn connect(
    authority: &Authority,
    timeout: Duration,
) -> Result<SendRequest<UpstreamBody>, BoxError> {
    // `host()` keeps an IPv6 literal's brackets; the resolver wants the bare address.
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let target = (host, authority.port_u16().unwrap_or(80));
    let stream = tokio::time::timeout(timeout, tokio::net::TcpStream::connect(target))
        .await
        .map_err(|_| format!("connecting to {authority} timed out after {timeout:?}"))?
        .map_err(|e| format!("connecting to {authority}: {e}"))?;
    stream.set_nodelay(true)?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "upstream connection ended");
        }
    });
    Ok(sender)
}
