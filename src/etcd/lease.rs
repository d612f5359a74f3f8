//! Lease: `LeaseGrant`, `LeaseRevoke`, `LeaseKeepAlive`, `LeaseTimeToLive`.

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use std::sync::Arc;

use super::pb::etcdserverpb::{
    lease_client, LeaseGrantRequest, LeaseGrantResponse, LeaseKeepAliveRequest,
    LeaseKeepAliveResponse, LeaseRevokeRequest, LeaseRevokeResponse, LeaseTimeToLiveRequest,
    LeaseTimeToLiveResponse,
};
use super::{retry_unauthenticated, Auth, Error, Transport};

#[derive(Clone)]
pub struct LeaseClient {
    inner: lease_client::LeaseClient<Transport>,
    auth: Option<Arc<Auth>>,
}

impl LeaseClient {
    pub(super) fn new(channel: Transport) -> Self {
        LeaseClient {
            auth: channel.auth.clone(),
            inner: lease_client::LeaseClient::new(channel),
        }
    }

    /// A new lease of `ttl` seconds (etcd may raise it to its minimum), with an id etcd picks.
    pub async fn grant(&mut self, ttl: i64) -> Result<LeaseGrantResponse, Error> {
        let request = LeaseGrantRequest { ttl, id: 0 };
        retry_unauthenticated(self.auth.as_deref(), request, |request| {
            let mut inner = self.inner.clone();
            async move { Ok(inner.lease_grant(request).await?.into_inner()) }
        })
        .await
    }

    /// Ends the lease now, deleting the keys attached to it.
    pub async fn revoke(&mut self, id: i64) -> Result<LeaseRevokeResponse, Error> {
        let request = LeaseRevokeRequest { id };
        retry_unauthenticated(self.auth.as_deref(), request, |request| {
            let mut inner = self.inner.clone();
            async move { Ok(inner.lease_revoke(request).await?.into_inner()) }
        })
        .await
    }

    /// One keep-alive round trip on a stream of its own: the lease is reset to its granted
    /// TTL. [`Error::LeaseKeepAlive`] when etcd answers that it has expired or never was.
    pub async fn keep_alive(&mut self, id: i64) -> Result<LeaseKeepAliveResponse, Error> {
        retry_unauthenticated(self.auth.as_deref(), id, |id| {
            keep_alive(self.inner.clone(), id)
        })
        .await
    }

    pub async fn time_to_live(
        &mut self,
        id: i64,
        options: Option<LeaseTimeToLiveOptions>,
    ) -> Result<LeaseTimeToLiveResponse, Error> {
        let request = LeaseTimeToLiveRequest {
            id,
            keys: options.is_some_and(|o| o.keys),
        };
        retry_unauthenticated(self.auth.as_deref(), request, |request| {
            let mut inner = self.inner.clone();
            async move { Ok(inner.lease_time_to_live(request).await?.into_inner()) }
        })
        .await
    }
}

async fn keep_alive(
    mut inner: lease_client::LeaseClient<Transport>,
    id: i64,
) -> Result<LeaseKeepAliveResponse, Error> {
    let (sender, receiver) = mpsc::channel(1);
    sender
        .send(LeaseKeepAliveRequest { id })
        .await
        .map_err(|e| Error::LeaseKeepAlive(e.to_string()))?;
    let mut answers = inner
        .lease_keep_alive(ReceiverStream::new(receiver))
        .await?
        .into_inner();
    // The request stream stays open until the answer is in.
    let answer = answers.message().await?;
    drop(sender);
    match answer {
        Some(answer) if answer.ttl > 0 => Ok(answer),
        Some(_) => Err(Error::LeaseKeepAlive("lease not found".into())),
        None => Err(Error::Stream(
            "the keep-alive stream ended unanswered".into(),
        )),
    }
}

/// Options of a `LeaseTimeToLive`.
#[derive(Debug, Clone, Copy, Default)]
pub struct LeaseTimeToLiveOptions {
    keys: bool,
}

impl LeaseTimeToLiveOptions {
    pub fn new() -> Self {
        Self::default()
    }

    /// Also list the keys attached to the lease.
    pub fn with_keys(mut self) -> Self {
        self.keys = true;
        self
    }
}

impl LeaseGrantResponse {
    pub fn id(&self) -> i64 {
        self.id
    }
}

impl LeaseTimeToLiveResponse {
    /// Seconds left (-1: expired or never granted).
    pub fn ttl(&self) -> i64 {
        self.ttl
    }

    pub fn granted_ttl(&self) -> i64 {
        self.granted_ttl
    }

    /// The keys attached to the lease, when asked for.
    pub fn keys(&self) -> &[Vec<u8>] {
        &self.keys
    }
}
