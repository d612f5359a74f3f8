//! Writes carrying an `Idempotency-Key` on a route where keys apply.
//!
//! `key check → read the body (bounded) → fingerprint → authority → begin (one atomic step
//! in the store: record lookup + fence) → authority again → replay | refuse | forward and
//! record`. The
//! response of an executed attempt streams to the client while a copy (up to
//! `max_response_bytes`) is kept; when the upstream's body ends, the record is written
//! before the client sees the end, so a retry sent after the response never finds the key
//! still in flight. A client that goes away early does not stop the recording: the rest of
//! the upstream's body is drained and recorded in the background, and an attempt that ends
//! without an answer to record (never sent, or the upstream failed) is recorded `unknown`.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Either, Full, Limited};
use hyper::body::Incoming;

use super::body::ProxyBody;
use super::problem::{Refusal, Subject};
use super::Proxy;
use crate::config::Ordering;
use crate::fence::barrier::Ticket;
use crate::fence::routes::Route;
use crate::idempotency::{outcome_unknown, Begin, Claim, Fingerprint, Phase, Record};
use crate::idempotency::{StoredResponse, MAX_KEY_BYTES};
use crate::metrics::{IdempotencyMetrics, Outcome};
use crate::store::{BoxFuture, FenceStore, StoreError};

/// Marks a response answered from a record.
pub const REPLAYED: &str = "idempotent-replayed";

/// The key of a request, if it has one. More than one key header, or a key that is not
/// 1-255 visible ASCII characters, is refused.
pub fn key_from_headers(headers: &HeaderMap, name: &HeaderName) -> Result<Option<String>, String> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    let name = super::problem::spelled(name);
    if values.next().is_some() {
        return Err(format!("more than one `{name}` header: send the key once"));
    }
    let bytes = value.as_bytes();
    if bytes.is_empty() || bytes.len() > MAX_KEY_BYTES {
        return Err(format!(
            "the `{name}` header must be 1 to {MAX_KEY_BYTES} characters, got {}",
            bytes.len()
        ));
    }
    if !bytes.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(format!(
            "the `{name}` header may only contain visible ASCII characters (no spaces or \
             control bytes)"
        ));
    }
    Ok(Some(String::from_utf8_lossy(bytes).into_owned()))
}

/// An executed attempt: where and how to record its outcome.
///
/// Its outcome is written exactly once: by [`Attempt::record_empty`], [`Attempt::unknown`],
/// or the [`Recording`] that carries it. An attempt dropped before any of these (its client
/// went away while it waited for its barrier turn, or the process is shutting down) records
/// `unknown` on its way out, so that its key does not stay in flight for a whole window.
pub struct Attempt {
    /// Taken when the outcome is written.
    writer: Option<Writer>,
    claim: Claim,
    max_response: usize,
    /// How long the rest of a body is read after its client left.
    drain_limit: Duration,
}

/// What writing an attempt's outcome needs.
struct Writer {
    store: Arc<dyn FenceStore>,
    resource: String,
    key: String,
    store_timeout: Duration,
    metrics: Arc<crate::metrics::Metrics>,
}

impl Writer {
    /// Writes the outcome (bounded by the store timeout). A failure is logged: the record
    /// then stays `in_flight` (until its window ends; on Redis and PostgreSQL until a retry
    /// takes it over, an in-flight lifetime after it was first seen), which refuses retries
    /// (409) rather than risking a second execution.
    async fn write(self, claim: Claim, record: Record) {
        let m: &IdempotencyMetrics = &self.metrics.idempotency;
        if record.phase == Phase::Unknown {
            m.unknown.inc();
        }
        let started = Instant::now();
        let written = tokio::time::timeout(
            self.store_timeout,
            self.store
                .finish_idempotent(&self.resource, &self.key, &claim, &record),
        )
        .await
        .unwrap_or_else(|_| {
            Err(StoreError::Unavailable(format!(
                "no answer within {}",
                crate::duration::display(self.store_timeout)
            )))
        });
        m.store_finish.observe(started.elapsed().as_secs_f64());
        match written {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                resource = %self.resource,
                fencing_token = claim.token,
                "idempotency record changed while the attempt ran (expired?); outcome not recorded"
            ),
            Err(e) => {
                self.metrics.store_errors.inc();
                tracing::error!(
                    resource = %self.resource,
                    fencing_token = claim.token,
                    error = %e,
                    "idempotency outcome not recorded; the key stays in flight until it expires or is taken over"
                )
            }
        }
    }
}

/// The write of an outcome to the store.
///
/// Awaited by whoever needs it done (the end of a response waits for it), and finished in the
/// background if that waiter is dropped first: a client that hangs up must not cancel the
/// write half-way and leave its key in flight.
#[must_use = "dropping a Finish writes the outcome in the background; await it to wait for it"]
pub struct Finish(Option<BoxFuture<'static, ()>>);

impl Finish {
    fn new(write: impl Future<Output = ()> + Send + 'static) -> Self {
        Finish(Some(Box::pin(write)))
    }

    /// Lets the write finish in the background.
    fn detach(mut self) {
        if let Some(write) = self.0.take() {
            background(write);
        }
    }
}

impl Future for Finish {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if let Some(write) = &mut self.0 {
            std::task::ready!(write.as_mut().poll(cx));
            self.0 = None;
        }
        Poll::Ready(())
    }
}

impl Drop for Finish {
    fn drop(&mut self) {
        if let Some(write) = self.0.take() {
            background(write);
        }
    }
}

/// Runs `work` on the current runtime without waiting for it. Called from `Drop`, where
/// `tokio::spawn`'s panic outside a runtime would abort.
fn background(work: BoxFuture<'static, ()>) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn(work)),
        Err(_) => tracing::error!(
            "no runtime left to record an idempotency outcome on; the key stays in flight until it expires or is taken over"
        ),
    }
}

impl Attempt {
    /// Writes the outcome; see [`Finish`].
    fn finish(mut self, record: Record) -> Finish {
        let writer = self
            .writer
            .take()
            .expect("an attempt's outcome is written once, by the call that consumes it");
        Finish::new(writer.write(self.claim, record))
    }

    /// The upstream answered without a body.
    pub fn record_empty(self, status: StatusCode, head: &HeaderMap) -> Finish {
        let record = self.outcome(status, head, Some(Bytes::new()));
        self.finish(record)
    }

    /// The upstream never answered (or we never sent): the write may or may not have happened.
    pub fn unknown(self) -> Finish {
        let record = Record::unknown(self.claim.token, self.claim.fingerprint);
        self.finish(record)
    }

    fn outcome(&self, status: StatusCode, head: &HeaderMap, body: Option<Bytes>) -> Record {
        let (token, fingerprint) = (self.claim.token, self.claim.fingerprint);
        if outcome_unknown(status.as_u16()) {
            return Record::unknown(token, fingerprint);
        }
        let response = body.map(|body| StoredResponse {
            status: status.as_u16(),
            headers: head
                .iter()
                .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
                .collect(),
            body,
        });
        Record {
            phase: Phase::Completed,
            token,
            fingerprint,
            status: Some(status.as_u16()),
            response,
            attempt: None,
        }
    }
}

impl Drop for Attempt {
    /// Dropped without an outcome: nothing is known about the write (it may not have been
    /// sent, or its answer was lost), so a retry may execute it (with a token at least this
    /// one's), instead of being refused as in flight until the window ends.
    fn drop(&mut self) {
        if let Some(writer) = self.writer.take() {
            let record = Record::unknown(self.claim.token, self.claim.fingerprint);
            Finish::new(writer.write(self.claim, record)).detach();
        }
    }
}

/// The upstream's body, streamed to the client and copied for the record.
pub struct Recording {
    inner: Option<Incoming>,
    /// Held until the body has ended (or been drained after the client left).
    ticket: Option<Ticket>,
    status: StatusCode,
    head: HeaderMap,
    /// The copy so far; `None` once it outgrew `max_response`.
    copy: Option<BytesMut>,
    attempt: Option<Attempt>,
    /// Dropped unfinished (the client left), it completes in the background.
    finishing: Option<Finish>,
    /// The last frame, held back until the record is written: a server that knows the length
    /// stops polling after the last byte, so the end must not be waited for.
    held: Option<Frame<Bytes>>,
}

impl Recording {
    pub fn new(
        inner: Incoming,
        ticket: Option<Ticket>,
        status: StatusCode,
        head: HeaderMap,
        attempt: Attempt,
    ) -> Self {
        Recording {
            inner: Some(inner),
            ticket,
            status,
            head,
            copy: Some(BytesMut::new()),
            attempt: Some(attempt),
            finishing: None,
            held: None,
        }
    }

    fn keep(copy: &mut Option<BytesMut>, chunk: &Bytes, limit: usize) {
        if let Some(c) = copy {
            if c.len() + chunk.len() > limit {
                *copy = None;
            } else {
                c.extend_from_slice(chunk);
            }
        }
    }
}

impl Body for Recording {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        loop {
            if let Some(finishing) = &mut this.finishing {
                return match Pin::new(finishing).poll(cx) {
                    Poll::Ready(()) => {
                        this.finishing = None;
                        Poll::Ready(this.held.take().map(Ok))
                    }
                    Poll::Pending => Poll::Pending,
                };
            }
            let Some(inner) = &mut this.inner else {
                return Poll::Ready(None);
            };
            match Pin::new(inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => {
                    if let (Some(chunk), Some(attempt)) = (frame.data_ref(), &this.attempt) {
                        Self::keep(&mut this.copy, chunk, attempt.max_response);
                    }
                    let last = this.inner.as_ref().is_some_and(|i| i.is_end_stream());
                    match (last, this.attempt.take()) {
                        (true, Some(attempt)) => {
                            this.inner = None;
                            let body = this.copy.take().map(BytesMut::freeze);
                            let record = attempt.outcome(this.status, &this.head, body);
                            this.finishing = Some(attempt.finish(record));
                            this.held = Some(frame);
                        }
                        (_, attempt) => {
                            this.attempt = attempt;
                            return Poll::Ready(Some(Ok(frame)));
                        }
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    // The upstream answered, then its body broke: the write happened (or
                    // not, for a retryable status) but the response cannot be replayed.
                    this.inner = None;
                    if let Some(attempt) = this.attempt.take() {
                        let record = attempt.outcome(this.status, &this.head, None);
                        attempt.finish(record).detach();
                    }
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(None) => {
                    this.inner = None;
                    match this.attempt.take() {
                        Some(attempt) => {
                            let body = this.copy.take().map(BytesMut::freeze);
                            let record = attempt.outcome(this.status, &this.head, body);
                            this.finishing = Some(attempt.finish(record));
                        }
                        None => return Poll::Ready(None),
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_none()
            && self.finishing.is_none()
            && self.attempt.is_none()
            && self.held.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.inner, &self.held) {
            (Some(inner), _) => inner.size_hint(),
            (None, Some(frame)) => {
                SizeHint::with_exact(frame.data_ref().map_or(0, |d| d.len() as u64))
            }
            (None, None) => SizeHint::with_exact(0),
        }
    }
}

impl Drop for Recording {
    /// The client went away before the end (or never started reading): finish recording
    /// without it. An outcome already being written (`finishing`) completes on its own.
    fn drop(&mut self) {
        let (Some(mut inner), Some(attempt)) = (self.inner.take(), self.attempt.take()) else {
            // No body left to read: the attempt, if still here, records `unknown` as it drops.
            return;
        };
        let (status, head, mut copy) = (
            self.status,
            std::mem::take(&mut self.head),
            self.copy.take(),
        );
        let ticket = self.ticket.take();
        background(Box::pin(async move {
            let _ticket = ticket;
            // Bounded: an upstream that stalls mid-body must not hold the barrier ticket (or
            // this task) forever; past the limit it counts as a broken body.
            let drained = tokio::time::timeout(attempt.drain_limit, async {
                while let Some(frame) = inner.frame().await {
                    let frame = frame.ok()?;
                    if let Some(chunk) = frame.data_ref() {
                        Recording::keep(&mut copy, chunk, attempt.max_response);
                    }
                }
                Some(())
            })
            .await;
            let body = match drained {
                Ok(Some(())) => copy.map(BytesMut::freeze),
                Ok(None) | Err(_) => None,
            };
            let record = attempt.outcome(status, &head, body);
            attempt.finish(record).await
        }));
    }
}

/// A recorded response, answered again.
fn replay(response: StoredResponse) -> Response<ProxyBody> {
    let mut out = Response::new(ProxyBody::local(response.body));
    *out.status_mut() = StatusCode::from_u16(response.status).unwrap_or(StatusCode::OK);
    let headers = out.headers_mut();
    for (name, value) in response.headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) {
            headers.append(n, v);
        }
    }
    headers.insert(REPLAYED, HeaderValue::from_static("true"));
    out
}

impl Proxy {
    /// A fenced write with an idempotency key (the token is already parsed into `subject`).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn idempotent_write(
        &self,
        req: Request<Incoming>,
        normalised: &str,
        route: &Route,
        resource: &str,
        key: String,
        subject: Subject<'_>,
        peer: SocketAddr,
        own: Option<super::upstream::SharedSlot>,
        started: tokio::time::Instant,
    ) -> Response<ProxyBody> {
        let settings = self
            .idempotency
            .as_ref()
            .expect("idempotent routes exist only with the idempotency section");
        let token = subject.token.expect("idempotent writes carry a token");
        let method = req.method().clone();
        // The path as received, for the access line (the other lines have the normalised one).
        let received = (self.access_log && req.uri().path() != normalised)
            .then(|| req.uri().path().to_owned());
        let refuse = |refusal| {
            let timing = super::Timing::without_upstream(started).received(received.as_deref());
            self.refuse(refusal, Some(route), subject, &method, normalised, timing)
        };

        let (parts, body) = req.into_parts();
        let limit = settings.max_request_bytes;
        let read =
            tokio::time::timeout(self.timeouts.upstream, Limited::new(body, limit).collect()).await;
        let body = match read {
            Ok(Ok(collected)) => collected.to_bytes(),
            Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
                return refuse(Refusal::RequestTooLarge { limit })
            }
            Ok(Err(e)) => {
                return refuse(Refusal::InvalidRequest(format!(
                    "the request body could not be read: {e}; nothing was recorded"
                )))
            }
            Err(_) => {
                return refuse(Refusal::InvalidRequest(format!(
                    "the request body did not arrive within {}; nothing was recorded",
                    crate::duration::display(self.timeouts.upstream)
                )))
            }
        };
        let fingerprint =
            Fingerprint::of(parts.method.as_str(), normalised, parts.uri.query(), &body);
        // Authoritative mode, asked once the body is in (a slow body gives the lease all the
        // time it needs to pass on): a superseded token may still have its outcome replayed.
        let mut superseded = None;
        if let Some(refusal) = self.check_authority(resource, token).await {
            match refusal {
                Refusal::Superseded { .. } => superseded = Some(refusal),
                other => return refuse(other),
            }
        }
        // The in-flight record must outlive the attempt, or a retry could execute alongside it:
        // it lives at least as long as the upstream may take, plus the store's two answers.
        // The outcome then lives `window`.
        let barrier = match route.ordering {
            Ordering::Serialize => route.barrier_timeout,
            Ordering::None => Duration::ZERO,
        };
        let in_flight = settings.window().max(
            barrier
                .saturating_add(self.timeouts.upstream)
                .saturating_add(self.timeouts.store.saturating_mul(2)),
        );
        let claim = Claim {
            token,
            fingerprint,
            equal: self.equal,
            window: in_flight,
            may_execute: superseded.is_none(),
            attempt: crate::idempotency::AttemptId::next(),
        };
        let ticket =
            (route.ordering == Ordering::Serialize).then(|| self.barriers.enter(resource, token));
        let m = &self.metrics.idempotency;
        let asked = Instant::now();
        let begin = tokio::time::timeout(
            self.timeouts.store,
            self.store.begin_idempotent(resource, &key, &claim),
        )
        .await
        .unwrap_or_else(|_| {
            Err(StoreError::Unavailable(format!(
                "no answer within {}",
                crate::duration::display(self.timeouts.store)
            )))
        });
        m.store_begin.observe(asked.elapsed().as_secs_f64());
        let route_metrics = &self.route_metrics[route.index];
        match begin {
            Err(StoreError::Unavailable(e)) => {
                self.metrics.store_errors.inc();
                // The claim may have landed before the answer was lost: mark it unknown so
                // retries are not refused as in flight for nothing. Only a record carrying
                // this attempt's id is replaced: another attempt's live record, with the same
                // token and body, stays in flight.
                let store = Arc::clone(&self.store);
                let (resource, key) = (resource.to_owned(), key);
                let outcome = Record::unknown(claim.token, claim.fingerprint);
                let limit = self.timeouts.store;
                tokio::spawn(async move {
                    let release = store.finish_idempotent(&resource, &key, &claim, &outcome);
                    let _ = tokio::time::timeout(limit, release).await;
                });
                refuse(Refusal::StoreUnavailable(e))
            }
            Ok(Begin::Stale { current }) => {
                route_metrics.stale.inc();
                refuse(Refusal::Stale { current })
            }
            Ok(Begin::InFlight) => {
                m.in_flight.inc();
                refuse(Refusal::IdempotencyInFlight)
            }
            Ok(Begin::Reused) => {
                m.reused.inc();
                refuse(Refusal::IdempotencyKeyReused)
            }
            Ok(Begin::Refused) => {
                refuse(superseded.expect("only superseded writes may not execute"))
            }
            Ok(Begin::Completed(record)) => match record.response {
                Some(response) => {
                    m.replays.inc();
                    let timing = super::Timing::without_upstream(started);
                    route_metrics.finish(Outcome::Replayed, timing.took());
                    if self.access_log {
                        super::log_access(super::Access {
                            subject,
                            method: &method,
                            path: received.as_deref().unwrap_or(normalised),
                            status: response.status,
                            outcome: Outcome::Replayed,
                            problem: None,
                            timing,
                        });
                    }
                    tracing::info!(
                        route = %route.name,
                        %method,
                        path = normalised,
                        resource,
                        fencing_token = token,
                        recorded_token = record.token,
                        status = response.status,
                        "idempotent write replayed"
                    );
                    replay(response)
                }
                None => refuse(Refusal::NotReplayable {
                    status: record.status,
                }),
            },
            Ok(Begin::Execute { previous }) => {
                if previous.is_none_or(|p| token > p) {
                    route_metrics.increments.inc();
                }
                let claim = Claim {
                    window: settings.window(),
                    ..claim
                };
                // From here on, however this request ends (the client may hang up while it
                // waits for its turn or for the upstream), the attempt records an outcome.
                let attempt = Attempt {
                    writer: Some(Writer {
                        store: Arc::clone(&self.store),
                        resource: resource.to_owned(),
                        key,
                        store_timeout: self.timeouts.store,
                        metrics: Arc::clone(&self.metrics),
                    }),
                    claim,
                    max_response: settings.max_response_bytes,
                    drain_limit: self.timeouts.upstream,
                };
                if let Some(ticket) = &ticket {
                    if ticket.wait_turn(route.barrier_timeout).await.is_err() {
                        // Claimed but never sent: a retry may execute it.
                        attempt.unknown().await;
                        return refuse(Refusal::BarrierTimeout);
                    }
                }
                // The lease may have passed on while the claim (or the turn) was awaited.
                if let Some(refusal) = self.check_authority(resource, token).await {
                    // Claimed but never sent: a retry may execute it, with a token at least
                    // this one's, that the authority has to admit first.
                    attempt.unknown().await;
                    return refuse(refusal);
                }
                let req = Request::from_parts(parts, Either::Right(Full::new(body)));
                self.forward_held(
                    req,
                    normalised,
                    route,
                    subject,
                    ticket,
                    peer,
                    Some(attempt),
                    own,
                    started,
                )
                .await
            }
        }
    }
}

/// The request body the upstream client sends: the client's, streamed, or one read whole.
pub type UpstreamBody = Either<Incoming, Full<Bytes>>;
