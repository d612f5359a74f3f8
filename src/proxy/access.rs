//! The access log (`access_log: true`): one line per request, on the `fencegate::access`
//! target, with its timing and the bytes its bodies carried.
//!
//! A forwarded request's line is written when its response body is done with (sent to the
//! end, cut short, or never sent, as for `HEAD`): [`Received`] counts the request body's bytes
//! as the upstream exchange reads them, [`Tally`] the response body's as they are handed to
//! the client's connection. Both count into the request's [`Head`], made only when the access
//! log is on: with it off they hold `None` and count nothing.

use crate::fence::resource::ResourceId;
use crate::fence::token::Token;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

use http::{HeaderName, HeaderValue, Method, Request, Version};
use tokio::time::Instant;

use crate::config::LogQuery;
use crate::fence::routes::Subject;
use crate::metrics::{Outcome, UNMATCHED};

/// When a request's handling began and ended, and how long its upstream exchange took; and,
/// for the access line, the request as it came ([`Head`], made only when the access log is
/// on): the lines of [`crate::fence::Fence::refuse`] are given the normalised path, the access line the one
/// received.
#[derive(Debug, Clone, Copy)]
pub(super) struct Timing<'a> {
    pub(super) started: Instant,
    pub(super) ended: Instant,
    /// `None` when the request was not sent upstream.
    pub(super) upstream: Option<Duration>,
    pub(super) head: Option<&'a Head>,
}

impl<'a> Timing<'a> {
    /// A request answered by fencegate, now, without an exchange with the upstream.
    pub(super) fn without_upstream(started: Instant) -> Self {
        Timing {
            started,
            ended: Instant::now(),
            upstream: None,
            head: None,
        }
    }

    pub(super) fn head(self, head: Option<&'a Head>) -> Self {
        Timing { head, ..self }
    }

    /// End to end.
    pub(super) fn took(&self) -> Duration {
        self.ended.saturating_duration_since(self.started)
    }
}

/// The request header that carries its id, kept when the client sent one, made otherwise.
pub(super) static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// What the access line says of a request as it came: taken from its head when the access
/// log is on, before anything is changed for the upstream.
#[derive(Debug)]
pub(super) struct Head {
    /// The path as received.
    pub(super) path: Box<str>,
    /// The query as `log.query` says: whole, its names with the values masked, or none.
    pub(super) query: Option<Box<str>>,
    pub(super) protocol: &'static str,
    /// The client's address (the peer of the connection); `None` in-process.
    pub(super) client: Option<IpAddr>,
    /// The client's `X-Request-Id`, or one made for the request (then `made`).
    pub(super) request_id: HeaderValue,
    pub(super) made: bool,
    /// W3C trace context, as the client sent it (passed through unchanged).
    pub(super) traceparent: Option<Box<str>>,
    /// The bytes read from the request's body so far (by [`Received`], or an idempotent
    /// write's read of the whole body): none for a request refused before its body was read.
    pub(super) received: AtomicU64,
    /// What became of a forwarded request, set when its response's head is ready; its line is
    /// written when the response's body is done with ([`Tally`]).
    pub(super) answered: OnceLock<Answered>,
}

/// The access line of a forwarded request, but for its byte counts: known when the response's
/// head is ready, written when its body is done with.
#[derive(Debug)]
pub(super) struct Answered {
    /// Shared with the proxy that answered (made once per configuration): no copy per request.
    pub(super) route: Option<Arc<str>>,
    pub(super) resource: Option<ResourceId>,
    pub(super) token: Option<Token>,
    pub(super) method: Method,
    pub(super) status: u16,
    pub(super) outcome: Outcome,
    pub(super) started: Instant,
    pub(super) ended: Instant,
    pub(super) upstream_took: Duration,
    pub(super) upstream: Arc<str>,
}

impl Head {
    /// The head of `req`, from `client`, its query logged as `query` says.
    pub(super) fn of<B>(req: &Request<B>, client: Option<IpAddr>, query: LogQuery) -> Arc<Head> {
        let headers = req.headers();
        let given = headers
            .get(&X_REQUEST_ID)
            .filter(|id| usable_id(id.as_bytes()));
        let (request_id, made) = match given {
            Some(id) => (id.clone(), false),
            None => (made_id(), true),
        };
        let traceparent = headers
            .get(&TRACEPARENT)
            .and_then(|t| t.to_str().ok())
            .filter(|t| t.len() <= 128)
            .map(Box::from);
        Arc::new(Head {
            path: req.uri().path().into(),
            query: req.uri().query().and_then(|q| logged_query(q, query)),
            protocol: protocol(req.version()),
            client,
            request_id,
            made,
            traceparent,
            received: AtomicU64::new(0),
            answered: OnceLock::new(),
        })
    }

    /// Sets the request's id on its way upstream when fencegate made it, so that the
    /// upstream's logs can be joined with this line.
    pub(super) fn forward_id(&self, headers: &mut http::HeaderMap) {
        if self.made {
            headers.insert(X_REQUEST_ID.clone(), self.request_id.clone());
        }
    }
}

/// A request id worth keeping: 1 to 200 visible ASCII characters.
fn usable_id(id: &[u8]) -> bool {
    !id.is_empty() && id.len() <= 200 && id.iter().all(|b| b.is_ascii_graphic())
}

/// A new request id: 128 random bits in hex (as a W3C trace id is written).
fn made_id() -> HeaderValue {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 16];
    // The system's random source; should it ever fail, the id is still unique enough for a
    // log line from the clock.
    if ring::rand::SystemRandom::new().fill(&mut bytes).is_err() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        bytes = now.to_be_bytes();
    }
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut hex = String::with_capacity(32);
    for b in bytes {
        hex.push(char::from(DIGITS[usize::from(b >> 4)]));
        hex.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    HeaderValue::try_from(hex).expect("hex is a valid header value")
}

fn protocol(version: Version) -> &'static str {
    match version {
        Version::HTTP_09 => "HTTP/0.9",
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_11 => "HTTP/1.1",
        Version::HTTP_2 => "HTTP/2",
        Version::HTTP_3 => "HTTP/3",
        _ => "HTTP",
    }
}

/// The query for the access line: whole, names only (each value replaced by `…`), or none.
fn logged_query(query: &str, how: LogQuery) -> Option<Box<str>> {
    match how {
        LogQuery::Full => Some(query.into()),
        LogQuery::None => None,
        LogQuery::Names => {
            let masked: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((name, _)) => format!("{name}=…"),
                    None => pair.to_owned(),
                })
                .collect();
            Some(masked.join("&").into())
        }
    }
}

/// One access log line: a request as it came and what became of it.
pub(super) struct Access<'a> {
    pub(super) subject: Subject<'a>,
    pub(super) method: &'a Method,
    /// As received, without the query.
    pub(super) path: &'a str,
    pub(super) status: u16,
    pub(super) outcome: Outcome,
    /// The problem type fencegate answered with; `None` for the upstream's answer.
    pub(super) problem: Option<&'a str>,
    pub(super) timing: Timing<'a>,
    /// The bytes of the response body handed to the client's connection.
    pub(super) bytes_out: u64,
    /// The upstream's address, for a request sent to it.
    pub(super) upstream: Option<&'a str>,
}

/// The bytes a body fencegate wrote itself sends: none in answer to `HEAD`.
pub(super) fn sent_bytes(method: &Method, len: impl TryInto<u64>) -> u64 {
    if method == Method::HEAD {
        return 0;
    }
    len.try_into().unwrap_or(u64::MAX)
}

/// Writes `access` at `INFO` on the `fencegate::access` target (`access_log: true`).
pub(super) fn log_access(access: Access<'_>) {
    let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    let head = access.timing.head;
    tracing::info!(
        target: "fencegate::access",
        route = access.subject.route.unwrap_or(UNMATCHED),
        method = access.method.as_str(),
        path = head.map_or(access.path, |h| &*h.path),
        query = head.and_then(|h| h.query.as_deref()),
        protocol = head.map(|h| h.protocol),
        client = head.and_then(|h| h.client).map(tracing::field::display),
        request_id = head.and_then(|h| h.request_id.to_str().ok()),
        traceparent = head.and_then(|h| h.traceparent.as_deref()),
        resource = access.subject.resource,
        fencing_token = access.subject.token.map(Token::get),
        status = access.status,
        outcome = access.outcome.label(),
        refusal = access
            .problem
            .map(|t| t.strip_prefix("urn:fencegate:").unwrap_or(t)),
        bytes_in = head.map(|h| h.received.load(Ordering::Relaxed)),
        bytes_out = access.bytes_out,
        upstream = access.upstream,
        duration_us = micros(access.timing.took()),
        upstream_duration_us = access.timing.upstream.map(micros),
        "request"
    );
}

/// The client's request body on its way upstream, its bytes counted into the request's
/// [`Head`] when the access log is on.
#[derive(Debug)]
pub struct Received {
    inner: Incoming,
    head: Option<Arc<Head>>,
}

impl Received {
    pub(super) fn new(inner: Incoming, head: Option<Arc<Head>>) -> Self {
        Received { inner, head }
    }

    /// Counts into `head` from now on (a held write reads its head after the body is wrapped).
    pub(super) fn count_into(&mut self, head: &Arc<Head>) {
        self.head = Some(Arc::clone(head));
    }
}

impl Body for Received {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let (Poll::Ready(Some(Ok(frame))), Some(head)) = (&polled, &this.head) {
            if let Some(data) = frame.data_ref() {
                head.received
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Counts a forwarded response's body bytes as they are handed to the client's connection, and
/// writes the request's access line when dropped: after the body's end, when the client hung
/// up (what was sent by then), or unpolled (`HEAD`, `204`: none).
#[derive(Debug)]
pub struct Tally {
    head: Arc<Head>,
    sent: u64,
}

impl Tally {
    pub(super) fn new(head: Arc<Head>) -> Self {
        Tally { head, sent: 0 }
    }

    /// Counts `polled`, a frame on its way to the client, and hands it on.
    pub fn count<E>(
        &mut self,
        polled: Poll<Option<Result<Frame<Bytes>, E>>>,
    ) -> Poll<Option<Result<Frame<Bytes>, E>>> {
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if let Some(data) = frame.data_ref() {
                self.sent += data.len() as u64;
            }
        }
        polled
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        let head = &*self.head;
        let Some(a) = head.answered.get() else {
            return;
        };
        log_access(Access {
            subject: Subject {
                route: a.route.as_deref(),
                resource: a.resource.as_deref(),
                token: a.token,
            },
            method: &a.method,
            path: &head.path,
            status: a.status,
            outcome: a.outcome,
            problem: None,
            timing: Timing {
                started: a.started,
                ended: a.ended,
                upstream: Some(a.upstream_took),
                head: Some(head),
            },
            bytes_out: self.sent,
            upstream: Some(&a.upstream),
        });
    }
}
