//! Recording an executed idempotent attempt's outcome: the [`Attempt`] that writes it exactly
//! once, and the [`Recording`] body that streams the upstream's response to the client while
//! keeping a copy (body and trailers, up to `max_response_bytes` together) for the record.
//!
//! When the upstream's body ends, the record is written before the client sees the end, so a
//! retry sent after the response never finds the key still in flight. A client that goes away
//! early does not stop the recording: the rest of the upstream's body is drained and recorded
//! in the background, and an attempt that ends without an answer to record (never sent, or the
//! upstream failed) is recorded `unknown`. So is an answer whose status says "try again": an
//! HTTP status ([`outcome_unknown`]) or a gRPC one ([`grpc_outcome_unknown`]), in the response
//! headers (trailers-only) or its trailers.
//!
//! Shared by the proxy (the upstream's body) and the Layer (the inner service's body), apart
//! from the decision whether a write executes (`Fence::begin_keyed`), so that
//! the response body types ([`crate::body::ProxyBody`], `FenceBody`) can hold a recording
//! without importing the request path that makes one.

use crate::fence::resource::ResourceId;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use bytes::{Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;

use crate::fence::barrier::Ticket;
use crate::idempotency::{
    grpc_outcome_unknown, outcome_unknown, Claim, Phase, Record, StoredResponse,
};
use crate::metrics::IdempotencyMetrics;
use crate::store::{BoxFuture, FenceStore, StoreError};

/// An executed attempt: where and how to record its outcome.
///
/// Its outcome is written exactly once: by [`Attempt::answered`] (for an answer without a
/// body), [`Attempt::unknown`], or the [`Recording`] that carries it. An attempt dropped
/// before any of these (its client went away while it waited for its barrier turn, or the
/// process is shutting down) records `unknown` on its way out, so that its key does not stay
/// in flight for a whole window.
pub struct Attempt {
    /// Taken when the outcome is written.
    pub(crate) writer: Option<Writer>,
    pub(crate) claim: Claim,
    pub(crate) max_response: usize,
    /// How long the rest of a body is read after its client left.
    pub(crate) drain_limit: Duration,
}

/// What writing an attempt's outcome needs.
pub(crate) struct Writer {
    pub(crate) store: Arc<dyn FenceStore>,
    pub(crate) resource: ResourceId,
    pub(crate) key: String,
    pub(crate) store_timeout: Duration,
    pub(crate) metrics: Arc<crate::metrics::Metrics>,
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
        .unwrap_or_else(|_| Err(StoreError::no_answer_within(self.store_timeout)));
        m.store_finish.observe(started.elapsed().as_secs_f64());
        match written {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                resource = %self.resource,
                fencing_token = claim.token.get(),
                "idempotency record changed while the attempt ran (expired?); outcome not recorded"
            ),
            Err(e) => {
                self.metrics.store_error("store", e.label());
                tracing::error!(
                    resource = %self.resource,
                    fencing_token = claim.token.get(),
                    error = %e,
                    store_error = e.label(),
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

    /// The upstream answered without a body (a gRPC trailers-only response among them).
    fn record_empty(self, status: StatusCode, head: &HeaderMap) -> Finish {
        let record = self.outcome(status, head, None, Some(Kept::default()));
        self.finish(record)
    }

    /// The upstream never answered (or we never sent): the write may or may not have happened.
    pub fn unknown(self) -> Finish {
        let record = Record::unknown(self.claim.token, self.claim.fingerprint);
        self.finish(record)
    }

    /// The record of an answer: `trailed` is the `grpc-status` its trailers carried, `copy`
    /// is `None` when the response cannot be replayed (too large, or its body broke).
    fn outcome(
        &self,
        status: StatusCode,
        head: &HeaderMap,
        trailed: Option<&HeaderValue>,
        copy: Option<Kept>,
    ) -> Record {
        let (token, fingerprint) = (self.claim.token, self.claim.fingerprint);
        if outcome_unknown(status.as_u16()) || grpc_unknown(head, trailed) {
            return Record::unknown(token, fingerprint);
        }
        let response = copy.map(|copy| StoredResponse {
            status: status.as_u16(),
            headers: fields(head),
            body: copy.body.freeze(),
            trailers: copy.trailers,
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

static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");

/// Whether a response's gRPC status leaves the outcome unknown ([`grpc_outcome_unknown`]): the
/// status in its headers (a trailers-only response) or in its trailers (`trailed`), either
/// one not final; or none at all on a gRPC response (its body broke before the trailers, or
/// they had none), which its client reads as an error. A response that is not gRPC and
/// carries no status is left to its HTTP status.
fn grpc_unknown(head: &HeaderMap, trailed: Option<&HeaderValue>) -> bool {
    let headed = head.get(&GRPC_STATUS);
    if headed.is_none() && trailed.is_none() {
        return crate::headers::is_grpc(head);
    }
    headed
        .into_iter()
        .chain(trailed)
        .any(|s| grpc_outcome_unknown(s.as_bytes()))
}

/// The `grpc-status` of a trailers frame, noted into `trailed`.
fn note_status(trailed: &mut Option<HeaderValue>, frame: &Frame<Bytes>) {
    if let Some(status) = frame.trailers_ref().and_then(|t| t.get(&GRPC_STATUS)) {
        *trailed = Some(status.clone());
    }
}

fn fields(map: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    map.iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect()
}

/// The copy of a response's body and trailers kept for its record.
#[derive(Default)]
struct Kept {
    body: BytesMut,
    trailers: Vec<(String, Vec<u8>)>,
    /// Body bytes plus the trailers' names and values, counted against `max_response`.
    size: usize,
}

impl Kept {
    /// Adds `frame` to the copy, or gives the copy up (`None`) once it outgrows `limit`.
    fn keep(copy: &mut Option<Kept>, frame: &Frame<Bytes>, limit: usize) {
        let Some(c) = copy else { return };
        let added = match (frame.data_ref(), frame.trailers_ref()) {
            (Some(chunk), _) => chunk.len(),
            (None, Some(trailers)) => trailers
                .iter()
                .map(|(n, v)| n.as_str().len() + v.len())
                .sum(),
            (None, None) => 0,
        };
        if c.size + added > limit {
            *copy = None;
            return;
        }
        c.size += added;
        if let Some(chunk) = frame.data_ref() {
            c.body.extend_from_slice(chunk);
        } else if let Some(trailers) = frame.trailers_ref() {
            c.trailers.extend(fields(trailers));
        }
    }
}

/// The upstream's (or the inner service's) body, streamed to the client and copied for the
/// record.
pub struct Recording<B> {
    inner: Option<Pin<Box<B>>>,
    /// Reads the rest of `inner` after its client left, and records the outcome: made where
    /// `B` is known to be a body that can be read in the background.
    drain: fn(Pin<Box<B>>, Left),
    /// Held until the body has ended (or been drained after the client left).
    ticket: Option<Ticket>,
    status: StatusCode,
    head: HeaderMap,
    /// The copy so far; `None` once it outgrew `max_response`.
    copy: Option<Kept>,
    /// The trailers' `grpc-status`, kept apart from the copy: it decides the outcome also
    /// when the copy was given up.
    trailed: Option<HeaderValue>,
    attempt: Option<Attempt>,
    /// Dropped unfinished (the client left), it completes in the background.
    finishing: Option<Finish>,
    /// The last frame, held back until the record is written: a server that knows the length
    /// stops polling after the last byte, so the end must not be waited for.
    held: Option<Frame<Bytes>>,
}

/// An executed attempt's answer, made ready to record its outcome ([`Attempt::answered`]).
pub enum Recorded<B> {
    /// The answer has no body: its outcome was recorded before the response goes, as a server
    /// never polls an empty body.
    Empty {
        /// The (empty) body, to go out as it is.
        body: B,
        /// To be held with the body.
        ticket: Option<Ticket>,
    },
    /// The body records the outcome once read to its end, or in the background when dropped
    /// unread.
    Streaming(Box<Recording<B>>),
}

impl Attempt {
    /// The upstream's answer to this attempt (`status`, `head`, `body`), made ready to record
    /// its outcome, whoever reads or drops the response from here on; `ticket` is held until
    /// the body has ended.
    pub async fn answered<B: Body<Data = Bytes> + Send + 'static>(
        self,
        status: StatusCode,
        head: &HeaderMap,
        body: B,
        ticket: Option<Ticket>,
    ) -> Recorded<B> {
        if body.is_end_stream() {
            self.record_empty(status, head).await;
            return Recorded::Empty { body, ticket };
        }
        let recording = Recording::new(body, ticket, status, head.clone(), self);
        Recorded::Streaming(Box::new(recording))
    }
}

/// What recording the rest of a body after its client left needs.
struct Left {
    attempt: Attempt,
    ticket: Option<Ticket>,
    status: StatusCode,
    head: HeaderMap,
    copy: Option<Kept>,
    trailed: Option<HeaderValue>,
}

impl<B: Body<Data = Bytes> + Send + 'static> Recording<B> {
    /// Streams `inner` (the answer to an executed attempt, `status` and `head` its head),
    /// keeping a copy for `attempt`'s record; `ticket` is held until the body has ended.
    pub fn new(
        inner: B,
        ticket: Option<Ticket>,
        status: StatusCode,
        head: HeaderMap,
        attempt: Attempt,
    ) -> Self {
        Recording {
            inner: Some(Box::pin(inner)),
            drain: drain::<B>,
            ticket,
            status,
            head,
            copy: Some(Kept::default()),
            trailed: None,
            attempt: Some(attempt),
            finishing: None,
            held: None,
        }
    }
}

impl<B: Body<Data = Bytes> + Send + 'static> Body for Recording<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
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
            match inner.as_mut().poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(attempt) = &this.attempt {
                        Kept::keep(&mut this.copy, &frame, attempt.max_response);
                        note_status(&mut this.trailed, &frame);
                    }
                    let last = this.inner.as_ref().is_some_and(|i| i.is_end_stream());
                    match (last, this.attempt.take()) {
                        (true, Some(attempt)) => {
                            this.inner = None;
                            let trailed = this.trailed.as_ref();
                            let record =
                                attempt.outcome(this.status, &this.head, trailed, this.copy.take());
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
                    // not, for a retryable status, or a gRPC call whose status never came)
                    // but the response cannot be replayed.
                    this.inner = None;
                    if let Some(attempt) = this.attempt.take() {
                        let trailed = this.trailed.as_ref();
                        let record = attempt.outcome(this.status, &this.head, trailed, None);
                        attempt.finish(record).detach();
                    }
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(None) => {
                    this.inner = None;
                    match this.attempt.take() {
                        Some(attempt) => {
                            let trailed = this.trailed.as_ref();
                            let record =
                                attempt.outcome(this.status, &this.head, trailed, this.copy.take());
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

impl<B> Drop for Recording<B> {
    /// The client went away before the end (or never started reading): finish recording
    /// without it. An outcome already being written (`finishing`) completes on its own.
    fn drop(&mut self) {
        let (Some(inner), Some(attempt)) = (self.inner.take(), self.attempt.take()) else {
            // No body left to read: the attempt, if still here, records `unknown` as it drops.
            return;
        };
        let left = Left {
            attempt,
            ticket: self.ticket.take(),
            status: self.status,
            head: std::mem::take(&mut self.head),
            copy: self.copy.take(),
            trailed: self.trailed.take(),
        };
        (self.drain)(inner, left);
    }
}

/// Reads the rest of a body whose client left, in the background, and records the outcome.
fn drain<B: Body<Data = Bytes> + Send + 'static>(mut inner: Pin<Box<B>>, left: Left) {
    let Left {
        attempt,
        ticket,
        status,
        head,
        mut copy,
        mut trailed,
    } = left;
    background(Box::pin(async move {
        let _ticket = ticket;
        // Bounded: an upstream that stalls mid-body must not hold the barrier ticket (or
        // this task) forever; past the limit it counts as a broken body.
        let drained = tokio::time::timeout(attempt.drain_limit, async {
            while let Some(frame) = inner.frame().await {
                let frame = frame.ok()?;
                Kept::keep(&mut copy, &frame, attempt.max_response);
                note_status(&mut trailed, &frame);
            }
            Some(())
        })
        .await;
        let copy = match drained {
            Ok(Some(())) => copy,
            Ok(None) | Err(_) => None,
        };
        let record = attempt.outcome(status, &head, trailed.as_ref(), copy);
        attempt.finish(record).await
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(limit: usize) -> Option<Kept> {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", "0".parse().unwrap());
        let mut copy = Some(Kept::default());
        for frame in [
            Frame::data(Bytes::from_static(b"abc")),
            Frame::trailers(trailers),
        ] {
            Kept::keep(&mut copy, &frame, limit);
        }
        copy
    }

    fn head(lines: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in lines {
            h.append(*n, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn a_grpc_status_in_the_headers_or_the_trailers_decides() {
        let grpc = [("content-type", "application/grpc")];
        let status = |s: &'static str| HeaderValue::from_static(s);
        // Trailers-only: the status is in the headers.
        assert!(grpc_unknown(&head(&[grpc[0], ("grpc-status", "14")]), None));
        assert!(!grpc_unknown(&head(&[grpc[0], ("grpc-status", "5")]), None));
        // After a body: in the trailers.
        assert!(grpc_unknown(&head(&grpc), Some(&status("13"))));
        assert!(!grpc_unknown(&head(&grpc), Some(&status("0"))));
        // Either one not final is enough.
        assert!(grpc_unknown(
            &head(&[grpc[0], ("grpc-status", "0")]),
            Some(&status("14"))
        ));
        // A gRPC response without a status: its client reads an error.
        assert!(grpc_unknown(&head(&grpc), None));
        assert!(grpc_unknown(
            &head(&[("content-type", "Application/GRPC+proto")]),
            None
        ));
        // Anything else without a status is left to its HTTP status.
        assert!(!grpc_unknown(
            &head(&[("content-type", "text/plain")]),
            None
        ));
        assert!(!grpc_unknown(&HeaderMap::new(), None));
    }

    #[test]
    fn trailers_are_kept_within_the_same_bound_as_the_body() {
        // 3 body bytes, then `grpc-status` (11) and `0` (1).
        let copy = kept(15).unwrap();
        assert_eq!(&copy.body[..], b"abc");
        assert_eq!(copy.trailers, [("grpc-status".to_owned(), b"0".to_vec())]);
        assert_eq!(copy.size, 15);
        assert!(kept(14).is_none());
    }
}
