//! The response body fencegate sends: the upstream's, streamed, or one it wrote itself.
//!
//! At crate level because every listener answers with it: the proxy, the lease API, the admin
//! listener and the injection webhook.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;

use crate::fence::barrier::Ticket;

pub enum ProxyBody {
    /// Streamed from the upstream. The barrier ticket (under `ordering: serialize`) lives as
    /// long as the body, so a higher token waits until this write has fully finished.
    Upstream {
        inner: Incoming,
        _ticket: Option<Ticket>,
    },
    /// Streamed from the upstream and recorded for idempotent replays.
    Recording(Box<crate::proxy::recording::Recording>),
    /// A response fencegate made (refusals, admin pages, replays).
    Local(Full<Bytes>),
    /// A stream fencegate writes as it goes (Server-Sent Events); ends when the sender drops.
    Channel(tokio::sync::mpsc::Receiver<Bytes>),
}

impl ProxyBody {
    pub fn local(bytes: impl Into<Bytes>) -> Self {
        ProxyBody::Local(Full::new(bytes.into()))
    }

    pub fn empty() -> Self {
        ProxyBody::Local(Full::new(Bytes::new()))
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            ProxyBody::Upstream { inner, .. } => Pin::new(inner).poll_frame(cx),
            ProxyBody::Recording(r) => Pin::new(r.as_mut()).poll_frame(cx),
            ProxyBody::Local(full) => Pin::new(full)
                .poll_frame(cx)
                .map_err(|never| match never {}),
            ProxyBody::Channel(rx) => rx
                .poll_recv(cx)
                .map(|chunk| chunk.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Upstream { inner, .. } => inner.is_end_stream(),
            ProxyBody::Recording(r) => r.is_end_stream(),
            ProxyBody::Local(full) => full.is_end_stream(),
            ProxyBody::Channel(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Upstream { inner, .. } => inner.size_hint(),
            ProxyBody::Recording(r) => r.size_hint(),
            ProxyBody::Local(full) => full.size_hint(),
            ProxyBody::Channel(_) => SizeHint::default(),
        }
    }
}
