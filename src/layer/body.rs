//! The Layer's bodies: the request body the inner service gets, and the response body the
//! fence answers with.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;

use crate::body::Replay;
use crate::fence::barrier::Ticket;
use crate::idempotency::recording::Recording;

pin_project_lite::pin_project! {
    /// The request body the inner service gets: the request's own, streamed, or, for a write
    /// with an `Idempotency-Key` (whose body the fence reads first, to fingerprint it before
    /// the write is claimed), its bytes.
    // pin-project-lite takes no attribute on a field but `#[pin]`, so a field cannot have a
    // doc comment: each variant's doc says what its fields hold.
    #[allow(missing_docs)]
    #[project = RequestBodyProj]
    pub enum RequestBody<B> {
        /// The request's own body, `body`, as it came.
        Streamed { #[pin] body: B },
        /// The body the fence read, `body`.
        Read { #[pin] body: Full<Bytes> },
    }
}

impl<B> RequestBody<B> {
    /// The request's own body, streamed.
    pub fn streamed(body: B) -> Self {
        RequestBody::Streamed { body }
    }
}

impl<B: Body<Data = Bytes>> Body for RequestBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project() {
            RequestBodyProj::Streamed { body } => body.poll_frame(cx),
            RequestBodyProj::Read { body } => body.poll_frame(cx).map_err(|never| match never {}),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RequestBody::Streamed { body } => body.is_end_stream(),
            RequestBody::Read { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RequestBody::Streamed { body } => body.size_hint(),
            RequestBody::Read { body } => body.size_hint(),
        }
    }
}

pin_project_lite::pin_project! {
    /// [`FenceService`]'s response body: the inner service's, or a refusal's.
    // pin-project-lite takes no attribute on a field but `#[pin]`, so a field cannot have a
    // doc comment: each variant's doc says what its fields hold.
    #[allow(missing_docs)]
    #[project = FenceBodyProj]
    pub enum FenceBody<B> {
        /// The inner service's body, `body`. Under `ordering: serialize` it keeps the barrier's
        /// ticket (`_ticket`): a higher token waits until this write has fully finished.
        Inner { #[pin] body: B, _ticket: Option<Ticket> },
        /// A refusal fencegate wrote, `body` (problem+json, or empty for a gRPC call).
        Refusal { #[pin] body: Full<Bytes> },
        /// The inner service's answer to a write with an `Idempotency-Key`, `body`, copied for
        /// the key's record as it is sent (and holding the barrier's ticket, if any). Boxed,
        /// as the proxy's body boxes it: every other answer would be as large as a recording.
        Recorded { body: Box<Recording<B>> },
        /// A write with an `Idempotency-Key` answered from its record: the recorded body,
        /// then its trailers, `body` (boxed, as above).
        Replayed { body: Box<Replay> },
    }
}

impl<B: Body<Data = Bytes> + Send + 'static> Body for FenceBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project() {
            FenceBodyProj::Inner { body, .. } => body.poll_frame(cx),
            FenceBodyProj::Refusal { body } => body.poll_frame(cx).map_err(|never| match never {}),
            FenceBodyProj::Recorded { body } => Pin::new(body.as_mut()).poll_frame(cx),
            FenceBodyProj::Replayed { body } => Pin::new(body.as_mut())
                .poll_frame(cx)
                .map_err(|never| match never {}),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            FenceBody::Inner { body, .. } => body.is_end_stream(),
            FenceBody::Refusal { body } => body.is_end_stream(),
            FenceBody::Recorded { body } => body.is_end_stream(),
            FenceBody::Replayed { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            FenceBody::Inner { body, .. } => body.size_hint(),
            FenceBody::Refusal { body } => body.size_hint(),
            FenceBody::Recorded { body } => body.size_hint(),
            FenceBody::Replayed { body } => body.size_hint(),
        }
    }
}
