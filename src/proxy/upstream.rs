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
use std::task::{Context, Poll};
use std::time::Duration;

use http::uri::Authority;
use http::{HeaderValue, Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;

use crate::sync::Locked;
use crate::timer::Kept;

/// The request body the upstream client sends: the client's, streamed, or one read whole
/// (an idempotent write's, kept for its fingerprint).
pub type UpstreamBody =
    http_body_util::Either<super::access::Received, http_body_util::Full<bytes::Bytes>>;

/// The shared pool of upstream connections (plain or TLS).
pub type UpstreamClient = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    UpstreamBody,
>;

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
    /// The upstream timeout's timer, kept armed between requests: a new timer per request
    /// would be registered with the timer wheel and removed again. It is not moved to each
    /// request's later deadline, nor polled again for the connection's next request while it
    /// has not fired (see [`crate::timer`]).
    timer: Option<Kept>,
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
                let value = crate::headers::peer_value(peer);
                let _ = self.0.forwarded_for.set((peer, value.clone()));
                value
            }
        }
    }

    fn take(&self, authority: &Authority) -> (Option<SendRequest<UpstreamBody>>, Option<Kept>) {
        let mut idle = self.0.upstream.locked();
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

    fn put(&self, held: Option<Held>, timer: Kept) {
        let mut idle = self.0.upstream.locked();
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

/// Sends `req` upstream, as `route` says, waiting until `deadline` for the response head.
///
/// On a client connection's own upstream connection that is ready (the usual case: the
/// previous exchange is over), the request is queued on it here, before the returned future
/// is first polled, and that future only waits for the answer. It then holds no request and no
/// connecting state, which keeps every request's future small (hyper moves it whole).
/// Connecting, or waiting for the connection to become ready, is the boxed slow path.
pub fn send(
    pool: &UpstreamClient,
    route: Route,
    deadline: Instant,
    req: Request<UpstreamBody>,
) -> impl Future<Output = Sent> + Send + 'static {
    let (slot, authority) = match route {
        Route::Pool => {
            // Boxed: the timeout's timer is large, and the pool's requests are the fewer.
            let response = Box::pin(tokio::time::timeout_at(deadline, pool.request(req)));
            return Exchange::Pool { response };
        }
        Route::Own(slot, authority) => (slot, authority),
    };
    let (sender, timer) = slot.take(&authority);
    let timer = match timer {
        Some(mut timer) => {
            timer.no_later_than(deadline);
            timer
        }
        None => Kept::new(deadline),
    };
    match sender {
        Some(mut sender) if sender.is_ready() => Exchange::Ready {
            response: sender.send_request(req),
            held: Some(Holding {
                slot,
                authority,
                sender,
                timer,
                deadline,
            }),
        },
        sender => Exchange::Connecting {
            exchange: Box::pin(connect_and_send(
                slot, authority, sender, timer, deadline, req,
            )),
        },
    }
}

/// What a client connection's upstream exchange keeps until the answer: the connection goes
/// back to the slot with the timer once the upstream has answered.
struct Holding {
    slot: SharedSlot,
    authority: Authority,
    sender: SendRequest<UpstreamBody>,
    /// Fires at `deadline` or earlier (see [`crate::timer`]).
    timer: Kept,
    deadline: Instant,
}

impl Holding {
    /// Back in the slot once the upstream has answered (the next request waits for the body
    /// to end); a failed exchange takes its connection with it, so the next request gets a
    /// fresh one instead of queueing behind an upstream that does not answer.
    fn settle(self, answer: Result<Response<Incoming>, BoxError>) -> Sent {
        match answer {
            Ok(response) => {
                self.slot
                    .put(Some((self.authority, self.sender)), self.timer);
                Ok(response)
            }
            Err(e) => {
                self.slot.put(None, self.timer);
                Err(Failed::Upstream(e))
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// An upstream exchange in flight (see [`send`]).
    #[project = ExchangeProj]
    enum Exchange<R> {
        Pool { response: Pin<Box<tokio::time::Timeout<hyper_util::client::legacy::ResponseFuture>>> },
        /// Queued on a ready connection: waiting for the answer, or for the timer.
        Ready { #[pin] response: R, held: Option<Holding> },
        Connecting { exchange: Pin<Box<dyn Future<Output = Sent> + Send>> },
    }
}

impl<R> Future for Exchange<R>
where
    R: Future<Output = Result<Response<Incoming>, hyper::Error>>,
{
    type Output = Sent;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Sent> {
        match self.project() {
            ExchangeProj::Pool { response } => {
                response.as_mut().poll(cx).map(|answer| match answer {
                    Ok(answer) => answer.map_err(|e| Failed::Upstream(e.into())),
                    Err(_) => Err(Failed::Timeout),
                })
            }
            ExchangeProj::Ready { response, held } => {
                if let Poll::Ready(answer) = response.poll(cx) {
                    let held = held.take().expect("polled after completion");
                    return Poll::Ready(held.settle(answer.map_err(Into::into)));
                }
                let holding = held.as_mut().expect("polled after completion");
                if holding.timer.poll_until(holding.deadline, cx).is_pending() {
                    return Poll::Pending;
                }
                let held = held.take().expect("polled after completion");
                held.slot.put(None, held.timer);
                Poll::Ready(Err(Failed::Timeout))
            }
            ExchangeProj::Connecting { exchange } => exchange.as_mut().poll(cx),
        }
    }
}

/// The slow path of [`send`]: a connection to open, or one to wait for, then the request.
async fn connect_and_send(
    slot: SharedSlot,
    authority: Authority,
    sender: Option<SendRequest<UpstreamBody>>,
    mut timer: Kept,
    deadline: Instant,
    req: Request<UpstreamBody>,
) -> Sent {
    let limit = deadline.saturating_duration_since(Instant::now());
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
            Ok((response, sender)) => {
                Holding { slot, authority, sender, timer, deadline }.settle(Ok(response))
            }
            Err(e) => {
                slot.put(None, timer);
                Err(Failed::Upstream(e))
            }
        },
        () = std::future::poll_fn(|cx| timer.poll_until(deadline, cx)) => {
            slot.put(None, timer);
            Err(Failed::Timeout)
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
        .map_err(|_| {
            format!(
                "connecting to {authority} timed out after {}",
                crate::duration::display(timeout)
            )
        })?
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
