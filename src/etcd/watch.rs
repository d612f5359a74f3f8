//! Watch: one bidirectional `Watch` stream per [`WatchClient::watch`].

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use std::sync::Arc;

use super::pb::etcdserverpb::{
    watch_client, watch_create_request, watch_request, WatchCreateRequest, WatchProgressRequest,
    WatchRequest, WatchResponse,
};
use super::pb::mvccpb::{Event, KeyValue};
use super::{prefix_end, retry_unauthenticated, Auth, Error, Transport};

pub use super::pb::mvccpb::event::EventType;

#[derive(Clone)]
pub struct WatchClient {
    inner: watch_client::WatchClient<Transport>,
    auth: Option<Arc<Auth>>,
}

impl WatchClient {
    pub(super) fn new(channel: Transport) -> Self {
        WatchClient {
            auth: channel.auth.clone(),
            inner: watch_client::WatchClient::new(channel),
        }
    }

    /// Opens a stream and asks for a watch on `key`; its first answer says whether the watch
    /// was created.
    pub async fn watch(
        &mut self,
        key: impl Into<Vec<u8>>,
        options: Option<WatchOptions>,
    ) -> Result<WatchStream, Error> {
        let create = options.unwrap_or_default().request(key.into());
        retry_unauthenticated(self.auth.as_deref(), create, |create| {
            let mut inner = self.inner.clone();
            async move {
                let (sender, receiver) = mpsc::channel(8);
                sender
                    .send(WatchRequest {
                        request_union: Some(watch_request::RequestUnion::CreateRequest(create)),
                    })
                    .await
                    .map_err(|e| Error::Stream(e.to_string()))?;
                let responses = inner
                    .watch(ReceiverStream::new(receiver))
                    .await?
                    .into_inner();
                Ok(WatchStream {
                    requests: WatchRequestSender(sender),
                    responses: WatchResponseStream(responses),
                })
            }
        })
        .await
    }
}

/// What a watch reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchFilterType {
    /// Leave out puts.
    NoPut,
    /// Leave out deletes.
    NoDelete,
}

/// Options of a watch.
#[derive(Debug, Clone, Default)]
pub struct WatchOptions {
    prefix: bool,
    start_revision: i64,
    filters: Vec<WatchFilterType>,
}

impl WatchOptions {
    pub fn new() -> Self {
        Self::default()
    }

    /// Every key starting with the key, not the key alone.
    pub fn with_prefix(mut self) -> Self {
        self.prefix = true;
        self
    }

    /// Events from this revision on (0: from now).
    pub fn with_start_revision(mut self, revision: i64) -> Self {
        self.start_revision = revision;
        self
    }

    pub fn with_filters(mut self, filters: impl Into<Vec<WatchFilterType>>) -> Self {
        self.filters = filters.into();
        self
    }

    fn request(self, key: Vec<u8>) -> WatchCreateRequest {
        let range_end = if self.prefix {
            prefix_end(&key)
        } else {
            Vec::new()
        };
        let filters = self
            .filters
            .iter()
            .map(|f| match f {
                WatchFilterType::NoPut => watch_create_request::FilterType::Noput,
                WatchFilterType::NoDelete => watch_create_request::FilterType::Nodelete,
            })
            .map(i32::from)
            .collect();
        WatchCreateRequest {
            key,
            range_end,
            start_revision: self.start_revision,
            filters,
            ..WatchCreateRequest::default()
        }
    }
}

/// A watch stream: the requests half stays open as long as the stream is kept.
pub struct WatchStream {
    requests: WatchRequestSender,
    responses: WatchResponseStream,
}

impl WatchStream {
    /// The next answer; `None` once etcd closed the stream.
    pub async fn message(&mut self) -> Result<Option<WatchResponse>, Error> {
        self.responses.message().await
    }

    pub fn split(self) -> (WatchRequestSender, WatchResponseStream) {
        (self.requests, self.responses)
    }
}

/// The requests half of a watch stream.
pub struct WatchRequestSender(mpsc::Sender<WatchRequest>);

impl WatchRequestSender {
    /// Asks etcd for a progress notification: an answer with no events, carrying the
    /// current revision once every watch on the stream has caught up to it.
    pub async fn request_progress(&mut self) -> Result<(), Error> {
        let request = WatchRequest {
            request_union: Some(watch_request::RequestUnion::ProgressRequest(
                WatchProgressRequest {},
            )),
        };
        self.0
            .send(request)
            .await
            .map_err(|e| Error::Stream(e.to_string()))
    }
}

/// The answers half of a watch stream.
pub struct WatchResponseStream(tonic::Streaming<WatchResponse>);

impl WatchResponseStream {
    /// The next answer; `None` once etcd closed the stream.
    pub async fn message(&mut self) -> Result<Option<WatchResponse>, Error> {
        Ok(self.0.message().await?)
    }
}

impl WatchResponse {
    /// This answer confirms a watch's creation.
    pub fn created(&self) -> bool {
        self.created
    }

    /// The watch was cancelled (for instance, its start revision was compacted).
    pub fn canceled(&self) -> bool {
        self.canceled
    }

    pub fn events(&self) -> &[Event] {
        &self.events
    }
}

impl Event {
    pub fn event_type(&self) -> EventType {
        self.r#type()
    }

    pub fn kv(&self) -> Option<&KeyValue> {
        self.kv.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_options() {
        let request = WatchOptions::new()
            .with_prefix()
            .with_start_revision(9)
            .with_filters([WatchFilterType::NoPut])
            .request(b"/p/".to_vec());
        assert_eq!(request.range_end, b"/p0");
        assert_eq!(request.start_revision, 9);
        assert_eq!(request.filters, [0]);
        assert!(WatchOptions::new()
            .request(b"k".to_vec())
            .range_end
            .is_empty());
    }
}
