//! The access log (`access_log: true`): one line per request, on the `fencegate::access`
//! target, with its timing.

use std::net::IpAddr;
use std::time::Duration;

use http::{HeaderName, HeaderValue, Method, Request, Version};
use tokio::time::Instant;

use crate::config::LogQuery;
use crate::metrics::{Outcome, UNMATCHED};

/// What a request is about (route, resource, token), as its log lines and a refusal's body
/// name it.
#[derive(Debug, Default, Clone, Copy)]
pub struct Subject<'a> {
    pub route: Option<&'a str>,
    pub resource: Option<&'a str>,
    pub token: Option<u64>,
}

/// When a request's handling began and ended, and how long its upstream exchange took; and,
/// for the access line, the request as it came ([`Head`], made only when the access log is
/// on): the lines of [`Proxy::refuse`] are given the normalised path, the access line the one
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
    /// The request body's length as declared (`Content-Length`); `None` when streamed.
    pub(super) bytes_in: Option<u64>,
}

impl Head {
    /// The head of `req`, from `client`, its query logged as `query` says.
    pub(super) fn of<B>(req: &Request<B>, client: Option<IpAddr>, query: LogQuery) -> Box<Head> {
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
        let bytes_in = headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|l| l.to_str().ok()?.parse().ok());
        Box::new(Head {
            path: req.uri().path().into(),
            query: req.uri().query().and_then(|q| logged_query(q, query)),
            protocol: protocol(req.version()),
            client,
            request_id,
            made,
            traceparent,
            bytes_in,
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
    /// The response body's length as declared; `None` when streamed.
    pub(super) bytes_out: Option<u64>,
    /// The upstream's address, for a request sent to it.
    pub(super) upstream: Option<&'a str>,
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
        fencing_token = access.subject.token,
        status = access.status,
        outcome = access.outcome.label(),
        refusal = access
            .problem
            .map(|t| t.strip_prefix("urn:fencegate:").unwrap_or(t)),
        bytes_in = head.and_then(|h| h.bytes_in),
        bytes_out = access.bytes_out,
        upstream = access.upstream,
        duration_us = micros(access.timing.took()),
        upstream_duration_us = access.timing.upstream.map(micros),
        "request"
    );
}
