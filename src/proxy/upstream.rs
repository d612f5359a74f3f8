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
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use http::uri::Authority;
use http::{HeaderValue, Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::time::Sleep;

use super::idempotent::UpstreamBody;
use super::UpstreamClient;

pub type BoxError = Box<dyn StdError + Send + Sync>;

/// Why an upstream exchange produced no response.
pub enum Failed {
    Upstream(BoxError),
    /// No response head within `timeouts.upstream`.
    Timeout,
}

/// What an upstream exchange gives: the response head, or why there is none.
pub type Sent = Result<Response<Incoming>, Failed>;

/// One client connection's upstream connection, and the authority it goes to (a reload may
/// change the upstream; the old connection is then dropped).
type Held = (Authority, SendRequest<UpstreamBody>);

/// What a client connection keeps between its requests.
#[derive(Default)]
struct PerConnection {
    upstream: Mutex<Idle>,
    /// The client's address as an `X-Forwarded-For` entry, formatted once.
    forwarded_for: OnceLock<(IpAddr, HeaderValue)>,
}

#[derive(Default)]
struct Idle {
    held: Option<Held>,
    /// The upstream timeout's timer, kept armed between requests: moving an armed timer's
    /// deadline later is one atomic step, while a new timer per request is registered with the
    /// timer wheel and removed again.
    timer: Option<Pin<Box<Sleep>>>,
}

/// The state kept per client connection: its upstream connection and its formatted address.
///
/// `Clone` gives a **new, empty** slot: the server clones its handler once per accepted
/// connection, so a handler that captures a slot gives every connection its own. Requests of
/// that connection reach it through [`ConnUpstream::share`].
#[derive(Default)]
pub struct ConnUpstream(Arc<PerConnection>);

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
pub struct SharedSlot(Arc<PerConnection>);

impl SharedSlot {
    /// The `X-Forwarded-For` entry for `peer`, formatted on the connection's first request.
    pub fn forwarded_for(&self, peer: IpAddr) -> HeaderValue {
        match self.0.forwarded_for.get() {
            Some((ip, value)) if *ip == peer => value.clone(),
            _ => {
                let value = super::forward::peer_value(peer);
                let _ = self.0.forwarded_for.set((peer, value.clone()));
                value
            }
        }
    }

    fn take(
        &self,
        authority: &Authority,
    ) -> (Option<SendRequest<UpstreamBody>>, Option<Pin<Box<Sleep>>>) {
        let mut idle = self.0.upstream.lock().expect("upstream slot poisoned");
        let sender = match idle.held.take() {
            // Byte equality, not `Authority`'s case-insensitive one: both come from the same
            // configuration, and this runs on every request.
            Some((a, sender)) if a.as_str() == authority.as_str() && !sender.is_closed() => {
                Some(sender)
            }
            _ => None,
        };
        (sender, idle.timer.take())
    }

    fn put(&self, held: Option<Held>, timer: Pin<Box<Sleep>>) {
        let mut idle = self.0.upstream.lock().expect("upstream slot poisoned");
        idle.held = held;
        idle.timer = Some(timer);
    }
}

/// Where a request goes: the pool (absolute URI), or a client connection's own upstream
/// connection (origin-form URI, `Host` already set; the upstream's authority).
pub enum Route {
    Pool,
    Own(SharedSlot, Authority),
}

// Built once per request and moved straight into its future: boxing the request would cost an
// allocation per request to save stack space nobody holds on to.
#[allow(clippy::large_enum_variant)]
enum Via {
    Pool(tokio::time::Timeout<hyper_util::client::legacy::ResponseFuture>),
    Own(SharedSlot, Authority, Request<UpstreamBody>),
}

/// Sends `req` upstream, as `route` says, waiting at most `limit` for the response head.
pub fn send(
    pool: &UpstreamClient,
    route: Route,
    limit: Duration,
    req: Request<UpstreamBody>,
) -> impl Future<Output = Sent> + Send + 'static {
    let via = match route {
        Route::Pool => Via::Pool(tokio::time::timeout(limit, pool.request(req))),
        Route::Own(slot, authority) => Via::Own(slot, authority, req),
    };
    async move {
        let (slot, authority, req) = match via {
            Via::Pool(response) => {
                return match response.await {
                    Ok(answer) => answer.map_err(|e| Failed::Upstream(e.into())),
                    Err(_) => Err(Failed::Timeout),
                }
            }
            Via::Own(slot, authority, req) => (slot, authority, req),
        };
        let (sender, timer) = slot.take(&authority);
        let deadline = tokio::time::Instant::now() + limit;
        let mut timer = match timer {
            Some(mut timer) => {
                timer.as_mut().reset(deadline);
                timer
            }
            None => Box::pin(tokio::time::sleep_until(deadline)),
        };
        let exchange = async {
            let mut sender = match sender {
                Some(sender) => sender,
                None => connect(&authority, limit).await?,
            };
            if sender.ready().await.is_err() {
                // Closed before anything was sent on it: a new connection is safe.
                sender = connect(&authority, limit).await?;
                sender.ready().await?;
            }
            let response = sender.send_request(req).await?;
            Ok::<_, BoxError>((response, sender))
        };
        tokio::select! {
            biased;
            answer = exchange => match answer {
                // Back in the slot once the upstream has answered (the next request waits in
                // `ready()` for the body to end).
                Ok((response, sender)) => {
                    slot.put(Some((authority, sender)), timer);
                    Ok(response)
                }
                // A failed exchange takes its connection with it: the next request gets a
                // fresh one instead of queueing behind an upstream that does not answer.
                Err(e) => {
                    slot.put(None, timer);
                    Err(Failed::Upstream(e))
                }
            },
            () = timer.as_mut() => {
                slot.put(None, timer);
                Err(Failed::Timeout)
            }
        }
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
    let (sender, connection) = hyper::client::conn::http1::Builder::new()
        .writev(false)
        .handshake(TokioIo::new(stream))
        .await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "upstream connection ended");
        }
    });
    Ok(sender)
}
