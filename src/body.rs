//! The response body fencegate sends: the upstream's, streamed, or one it wrote itself.
//!
//! At crate level because every listener answers with it: the proxy, the lease API, the admin
//! listener and the injection webhook.

use std::convert::Infallible;
use std::future::Ready;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::WithTrailers;
use http_body_util::{BodyExt, Full};
#[cfg(feature = "proxy")]
use hyper::body::Incoming;

use crate::fence::barrier::Ticket;

/// A replay's trailers, known from the start.
type Trailers = Ready<Option<Result<HeaderMap, Infallible>>>;

/// A replayed response's body: its bytes, then its trailers (if it had any).
pub type Replay = WithTrailers<Full<Bytes>, Trailers>;

/// `bytes`, then `trailers` (none sent when empty).
pub(crate) fn replay(bytes: Bytes, trailers: HeaderMap) -> Replay {
    let trailers = (!trailers.is_empty()).then_some(Ok(trailers));
    Full::new(bytes).with_trailers(std::future::ready(trailers))
}

/// The body of every response fencegate sends: the upstream's, streamed, or one it made.
pub enum ProxyBody {
    /// Streamed from the upstream. The barrier ticket (under `ordering: serialize`) lives as
    /// long as the body, so a higher token waits until this write has fully finished.
    /// With the access log on, `tally` counts what is sent and writes the line at the end.
    #[cfg(feature = "proxy")]
    Upstream {
        /// The upstream's body.
        inner: Incoming,
        /// The barrier ticket, under `ordering: serialize`.
        _ticket: Option<Ticket>,
        /// What is sent, counted for the access line, with the access log on.
        tally: Option<crate::proxy::access::Tally>,
    },
    /// Streamed from the upstream and recorded for idempotent replays.
    #[cfg(feature = "proxy")]
    Recording {
        /// The upstream's body, copied for the key's record as it is sent.
        body: Box<crate::idempotency::recording::Recording<Incoming>>,
        /// What is sent, counted for the access line, with the access log on.
        tally: Option<crate::proxy::access::Tally>,
    },
    /// A response fencegate made (refusals, admin pages, replays).
    Local(Full<Bytes>),
    /// A replayed response that had trailers: its body, then its trailers.
    Replay(Box<Replay>),
    /// A stream fencegate writes as it goes (Server-Sent Events); ends when the sender drops.
    Channel(tokio::sync::mpsc::Receiver<Bytes>),
}

impl ProxyBody {
    /// A body fencegate made: `bytes`, whole.
    pub fn local(bytes: impl Into<Bytes>) -> Self {
        ProxyBody::Local(Full::new(bytes.into()))
    }

    /// A body with nothing in it.
    pub fn empty() -> Self {
        ProxyBody::Local(Full::new(Bytes::new()))
    }

    /// Counts what is sent of a streamed body into `tally` (the body's access line); a body
    /// fencegate wrote itself has its line written already and keeps none.
    #[cfg(feature = "proxy")]
    pub(crate) fn tallied(self, tally: Option<crate::proxy::access::Tally>) -> Self {
        match self {
            ProxyBody::Upstream { inner, _ticket, .. } => ProxyBody::Upstream {
                inner,
                _ticket,
                tally,
            },
            ProxyBody::Recording { body, .. } => ProxyBody::Recording { body, tally },
            local => local,
        }
    }

    /// `bytes`, then `trailers` (none sent when empty).
    pub fn local_with_trailers(bytes: impl Into<Bytes>, trailers: HeaderMap) -> Self {
        if trailers.is_empty() {
            return ProxyBody::local(bytes);
        }
        ProxyBody::Replay(Box::new(replay(bytes.into(), trailers)))
    }
}

/// What reading a [`ProxyBody`] can fail with: only a body streamed from the upstream fails.
#[cfg(feature = "proxy")]
pub type BodyError = hyper::Error;
/// What reading a [`ProxyBody`] can fail with: nothing, in a build without the proxy.
#[cfg(not(feature = "proxy"))]
pub type BodyError = Infallible;

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.get_mut() {
            #[cfg(feature = "proxy")]
            ProxyBody::Upstream {
                inner, tally: None, ..
            } => Pin::new(inner).poll_frame(cx),
            #[cfg(feature = "proxy")]
            ProxyBody::Upstream {
                inner,
                tally: Some(tally),
                ..
            } => tally.count(Pin::new(inner).poll_frame(cx)),
            #[cfg(feature = "proxy")]
            ProxyBody::Recording { body, tally: None } => Pin::new(body.as_mut()).poll_frame(cx),
            #[cfg(feature = "proxy")]
            ProxyBody::Recording {
                body,
                tally: Some(tally),
            } => tally.count(Pin::new(body.as_mut()).poll_frame(cx)),
            ProxyBody::Local(full) => Pin::new(full)
                .poll_frame(cx)
                .map_err(|never| match never {}),
            ProxyBody::Replay(body) => Pin::new(body.as_mut())
                .poll_frame(cx)
                .map_err(|never| match never {}),
            ProxyBody::Channel(rx) => rx
                .poll_recv(cx)
                .map(|chunk| chunk.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            #[cfg(feature = "proxy")]
            ProxyBody::Upstream { inner, .. } => inner.is_end_stream(),
            #[cfg(feature = "proxy")]
            ProxyBody::Recording { body, .. } => body.is_end_stream(),
            ProxyBody::Local(full) => full.is_end_stream(),
            ProxyBody::Replay(body) => body.is_end_stream(),
            ProxyBody::Channel(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            #[cfg(feature = "proxy")]
            ProxyBody::Upstream { inner, .. } => inner.size_hint(),
            #[cfg(feature = "proxy")]
            ProxyBody::Recording { body, .. } => body.size_hint(),
            ProxyBody::Local(full) => full.size_hint(),
            ProxyBody::Replay(body) => body.size_hint(),
            ProxyBody::Channel(_) => SizeHint::default(),
        }
    }
}
