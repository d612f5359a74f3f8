//! A write with an `Idempotency-Key`, in-process: as the sidecar does it (docs/idempotency.md),
//! with the inner service in the upstream's place.
//!
//! `read the body (bounded) → fingerprint →` the fence's claim ([`crate::fence::keyed`])
//! `→ refuse | replay | call the service and record its answer`. The service's answer is
//! recorded as the sidecar records the upstream's: a response without a body at once, any
//! other as its body is sent ([`Recording`](crate::idempotency::recording::Recording)); a
//! service that fails, or does not answer within `timeouts.upstream` (whose call is then
//! dropped), leaves the outcome unknown.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::Full;
use tokio::time::Instant;
use tower_service::Service;

use super::{refusal, FenceBody, RequestBody};
use crate::fence::keyed::{fingerprint, read_body, replay, Keyed, KeyedWrite};
use crate::fence::{Fence, Key, Later, Refused};
use crate::idempotency::recording::Recorded;
use crate::metrics::Outcome;
use crate::problem::refusal::Refusal;

/// What the keyed write needs besides the request.
pub(super) struct Call<S> {
    pub(super) fence: Arc<Fence>,
    pub(super) inner: S,
    pub(super) later: Later,
    pub(super) key: Key,
    /// How long the service may take (`timeouts.upstream`).
    pub(super) send_within: Duration,
    pub(super) grpc: bool,
    pub(super) started: Instant,
}

/// Reads the body, claims the write, and answers it: refused, replayed, or the service's
/// answer, recorded.
pub(super) async fn keyed_write<S, B, RB>(
    call: Call<S>,
    req: Request<B>,
) -> Result<Response<FenceBody<RB>>, S::Error>
where
    S: Service<Request<RequestBody<B>>, Response = Response<RB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    RB: Body<Data = Bytes> + Send + 'static,
{
    let Call {
        fence,
        mut inner,
        later,
        key,
        send_within,
        grpc,
        started,
    } = call;
    let (parts, body) = req.into_parts();
    // What a refusal's log line names of the request: its method and path (not its headers).
    let mut head = Request::new(());
    *head.method_mut() = parts.method.clone();
    *head.uri_mut() = parts.uri.clone();
    let refuse = |refusal_kind: Refusal| {
        let refused = Refused {
            refusal: refusal_kind,
            route: Some(later.route),
            resource: Some(later.resource.clone()),
            token: Some(later.token),
        };
        let response = fence.answer_refused(refused, &head, started);
        Ok(refusal(response, grpc))
    };
    let limit = key.settings.max_request_bytes;
    let body = match read_body(body, limit, send_within).await {
        Ok(body) => body,
        Err(refusal_kind) => return refuse(refusal_kind),
    };
    let fingerprint = fingerprint(&parts, &later.normalised, &body);
    let route = fence.route(later.route);
    let keyed = fence
        .begin_keyed(KeyedWrite {
            route,
            resource: &later.resource,
            token: later.token,
            key,
            fingerprint,
            send_within,
        })
        .await;
    let method = parts.method.clone();
    match keyed {
        Keyed::Refuse(refusal_kind) => refuse(refusal_kind),
        Keyed::Replay { response, recorded } => {
            let status = response.status;
            Fence::log_replayed(
                route,
                &method,
                &later.normalised,
                &later.resource,
                later.token,
                recorded,
                status,
            );
            fence.answered(
                Some(later.route),
                Outcome::Replayed,
                &method,
                status,
                started,
            );
            Ok(replay(response, |bytes, trailers| FenceBody::Replayed {
                body: Box::new(crate::body::replay(bytes, trailers)),
            }))
        }
        Keyed::Execute { attempt, ticket } => {
            let req = Request::from_parts(
                parts,
                RequestBody::Read {
                    body: Full::new(body),
                },
            );
            // The call and the recording of its answer run in a task of their own: a server
            // that drops this future (its client went away) cancels neither the write nor its
            // record, which would otherwise say `unknown` while the write may still be under
            // way, and let a retry run alongside it. Past `send_within` the call is dropped, as
            // the sidecar gives up on an upstream, and the outcome is unknown.
            let task = tokio::spawn(async move {
                let response = match tokio::time::timeout(send_within, inner.call(req)).await {
                    Err(_) => {
                        attempt.unknown().await;
                        return Sent::TimedOut;
                    }
                    Ok(Err(e)) => {
                        attempt.unknown().await;
                        return Sent::Failed(e);
                    }
                    Ok(Ok(response)) => response,
                };
                let (parts, body) = response.into_parts();
                let body = match attempt
                    .answered(parts.status, &parts.headers, body, ticket)
                    .await
                {
                    Recorded::Empty { body, ticket } => FenceBody::Inner {
                        body,
                        _ticket: ticket,
                    },
                    Recorded::Streaming(body) => FenceBody::Recorded { body },
                };
                Sent::Answered(Response::from_parts(parts, body))
            });
            match task.await {
                Err(e) => std::panic::resume_unwind(e.into_panic()),
                Ok(Sent::TimedOut) => refuse(Refusal::UpstreamTimeout(send_within)),
                Ok(Sent::Failed(e)) => Err(e),
                Ok(Sent::Answered(response)) => {
                    let code = response.status().as_u16();
                    fence.answered(Some(later.route), Outcome::Admitted, &method, code, started);
                    Ok(response)
                }
            }
        }
    }
}

/// How the service's call of an executed keyed write ended.
enum Sent<R, E> {
    Answered(R),
    Failed(E),
    TimedOut,
}
