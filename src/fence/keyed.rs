//! A fenced write carrying an `Idempotency-Key`, once its body is in: what the proxy and the
//! Layer share (docs/idempotency.md).
//!
//! `authority → claim (one atomic step in the store: record lookup + fence) → refuse | replay
//! | barrier turn → authority again → execute`. Reading the body, answering a replay and
//! sending the write are the caller's; recording the executed attempt's outcome is
//! [`crate::idempotency::recording`]'s.

use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, Response, StatusCode};

use tokio::time::Instant;

use super::barrier::Ticket;
use super::decide::Key;
use super::routes::Route;
use super::{Fence, ResourceId, Token};
use crate::config::Ordering;
use crate::idempotency::recording::{Attempt, Writer};
use crate::idempotency::{AttemptId, Begin, Claim, Fingerprint, Record, StoredResponse};
use crate::problem::refusal::{Refusal, Unavailable};
use crate::store::StoreError;
use bytes::Bytes;

/// Marks a response answered from a record.
pub(crate) const REPLAYED: &str = "idempotent-replayed";

/// A recorded response, answered again, its body (and trailers) made by `body`.
pub(crate) fn replay<T>(
    response: StoredResponse,
    body: impl FnOnce(Bytes, HeaderMap) -> T,
) -> Response<T> {
    let trailers = header_map(response.trailers);
    let mut out = Response::new(body(response.body, trailers));
    *out.status_mut() = StatusCode::from_u16(response.status).unwrap_or(StatusCode::OK);
    let headers = out.headers_mut();
    *headers = header_map(response.headers);
    headers.insert(REPLAYED, HeaderValue::from_static("true"));
    out
}

/// Recorded fields, in order; one that is no longer a valid header is left out.
fn header_map(fields: Vec<(String, Vec<u8>)>) -> HeaderMap {
    let mut map = HeaderMap::with_capacity(fields.len());
    for (name, value) in fields {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) {
            map.append(n, v);
        }
    }
    map
}

/// A keyed write's body, read whole to be fingerprinted: at most `limit` bytes, within
/// `within` (the upstream timeout). Refused otherwise, with nothing recorded.
pub(crate) async fn read_body<B>(body: B, limit: usize, within: Duration) -> Result<Bytes, Refusal>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    use http_body_util::BodyExt;
    let read = tokio::time::timeout(within, http_body_util::Limited::new(body, limit).collect());
    match read.await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            Err(Refusal::RequestTooLarge { limit })
        }
        Ok(Err(e)) => Err(Refusal::InvalidRequest(format!(
            "the request body could not be read: {e}; nothing was recorded"
        ))),
        Err(_) => Err(Refusal::InvalidRequest(format!(
            "the request body did not arrive within {}; nothing was recorded",
            crate::duration::display(within)
        ))),
    }
}

/// The fingerprint of a keyed write: the method the receiver acts on (an override header's
/// when there is one; a malformed or repeated override was refused before this), the
/// normalised path, the query and the body.
pub(crate) fn fingerprint(
    parts: &http::request::Parts,
    normalised: &str,
    body: &[u8],
) -> Fingerprint {
    let effective = super::method::method_override(&parts.headers)
        .ok()
        .flatten();
    let effective = effective.as_ref().unwrap_or(&parts.method);
    Fingerprint::of(effective.as_str(), normalised, parts.uri.query(), body)
}

/// How long a claim's in-flight record lives: the idempotency `window`, and at least as long
/// as its attempt may still be sent from the claim on (the store's answer to the claim, the
/// `barrier` turn, the authority's second answer under `fence.authority: leases`, the send
/// within `send_within`, and the store's answer to the outcome, each bounded), so that a
/// retry cannot execute alongside it (checked in `fence::keyed::model`).
pub(crate) fn in_flight_window(
    window: Duration,
    barrier: Duration,
    send_within: Duration,
    store_timeout: Duration,
) -> Duration {
    window.max(
        barrier
            .saturating_add(send_within)
            .saturating_add(store_timeout.saturating_mul(3)),
    )
}

/// A keyed write whose body has been read, ready to be claimed.
pub(crate) struct KeyedWrite<'a> {
    pub(crate) route: &'a Route,
    pub(crate) resource: &'a ResourceId,
    pub(crate) token: Token,
    pub(crate) key: Key,
    /// Method (as overridden), normalised path, query and body.
    pub(crate) fingerprint: Fingerprint,
    /// How long the write may take once sent (the upstream timeout): its in-flight record
    /// outlives that, so a retry cannot execute alongside it.
    pub(crate) send_within: Duration,
}

/// What claiming a keyed write decided.
pub(crate) enum Keyed {
    /// Refused (counted already: stale, too far, in flight, reused).
    Refuse(Refusal),
    /// Completed before: answer its recorded `response`; `recorded` is the token it was
    /// executed with.
    Replay {
        response: StoredResponse,
        recorded: Token,
    },
    /// Execute it: `attempt` records its outcome, and under `ordering: serialize` `ticket`
    /// (whose turn has come) is held until the answer has been sent.
    Execute {
        attempt: Attempt,
        ticket: Option<Ticket>,
    },
}

impl Fence {
    /// The log line of a write answered from its record.
    pub(crate) fn log_replayed(
        route: &Route,
        method: &http::Method,
        path: &str,
        resource: &ResourceId,
        token: Token,
        recorded: Token,
        status: u16,
    ) {
        tracing::info!(
            target: "fencegate::proxy::idempotent",
            route = %route.name,
            %method,
            path,
            resource = resource.as_str(),
            fencing_token = token.get(),
            recorded_token = recorded.get(),
            status,
            "idempotent write replayed"
        );
    }

    /// Claims a keyed write: authority (a superseded token may still have its outcome
    /// replayed), the claim in the store, and for a write that executes, its barrier turn and
    /// the authority again. A claim whose answer was lost is marked `unknown` in the
    /// background, so retries are not refused as in flight for nothing.
    pub(crate) async fn begin_keyed(&self, write: KeyedWrite<'_>) -> Keyed {
        let KeyedWrite {
            route,
            resource,
            token,
            key,
            fingerprint,
            send_within,
        } = write;
        let Key { key, settings } = key;
        let mut superseded = None;
        if let Some(refusal) = self.check_authority(resource, token).await {
            match refusal {
                Refusal::Superseded { .. } => superseded = Some(refusal),
                other => return Keyed::Refuse(other),
            }
        }
        // The in-flight record must outlive the attempt, or a retry could execute alongside it:
        // it lives at least as long as the send may take, plus the store's answers and the
        // authority's second one. The outcome then lives `window`.
        let barrier = match route.ordering {
            Ordering::Serialize => route.barrier_timeout,
            Ordering::None => Duration::ZERO,
        };
        let in_flight =
            in_flight_window(settings.window(), barrier, send_within, self.store_timeout);
        let claim = Claim {
            token,
            fingerprint,
            rule: self.rule(),
            window: in_flight,
            may_execute: superseded.is_none(),
            attempt: AttemptId::next(),
        };
        let ticket =
            (route.ordering == Ordering::Serialize).then(|| self.barriers.enter(resource, token));
        let m = &self.metrics.idempotency;
        let asked = Instant::now();
        let begin = tokio::time::timeout(
            self.store_timeout,
            self.store().begin_idempotent(resource, &key, &claim),
        )
        .await
        .unwrap_or_else(|_| Err(StoreError::no_answer_within(self.store_timeout)));
        m.store_begin.observe(asked.elapsed().as_secs_f64());
        let route_metrics = self.metrics_for(Some(route));
        match begin {
            Err(e) => {
                self.metrics.store_error("store", e.label());
                // The claim may have landed before the answer was lost: mark it unknown so
                // retries are not refused as in flight for nothing. Only a record carrying
                // this attempt's id is replaced: another attempt's live record, with the same
                // token and body, stays in flight.
                let store = Arc::clone(self.store());
                let resource = resource.clone();
                let outcome = Record::unknown(claim.token, claim.fingerprint);
                let limit = self.store_timeout;
                tokio::spawn(async move {
                    let release = store.finish_idempotent(&resource, &key, &claim, &outcome);
                    let _ = tokio::time::timeout(limit, release).await;
                });
                Keyed::Refuse(Refusal::StoreUnavailable(Unavailable::Store(e)))
            }
            Ok(Begin::Stale { current }) => {
                route_metrics.stale.inc();
                Keyed::Refuse(Refusal::Stale { current })
            }
            Ok(Begin::TooFar { current }) => {
                route_metrics.too_far.inc();
                Keyed::Refuse(self.too_far(current))
            }
            Ok(Begin::InFlight) => {
                m.in_flight.inc();
                Keyed::Refuse(Refusal::IdempotencyInFlight)
            }
            Ok(Begin::Reused) => {
                m.reused.inc();
                Keyed::Refuse(Refusal::IdempotencyKeyReused)
            }
            Ok(Begin::Refused) => {
                Keyed::Refuse(superseded.expect("only superseded writes may not execute"))
            }
            Ok(Begin::Completed(record)) => match record.response {
                Some(response) => {
                    m.replays.inc();
                    Keyed::Replay {
                        response,
                        recorded: record.token,
                    }
                }
                None => Keyed::Refuse(Refusal::NotReplayable {
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
                // From here on, however this write ends (the client may hang up while it
                // waits for its turn or for the answer), the attempt records an outcome.
                let attempt = Attempt {
                    writer: Some(Writer {
                        store: Arc::clone(self.store()),
                        resource: resource.clone(),
                        key,
                        store_timeout: self.store_timeout,
                        metrics: Arc::clone(&self.metrics),
                    }),
                    claim,
                    max_response: settings.max_response_bytes,
                    drain_limit: send_within,
                };
                if let Some(ticket) = &ticket {
                    if ticket.wait_turn(route.barrier_timeout).await.is_err() {
                        // Claimed but never sent: a retry may execute it.
                        attempt.unknown().await;
                        return Keyed::Refuse(Refusal::BarrierTimeout);
                    }
                }
                // The lease may have passed on while the claim (or the turn) was awaited.
                if let Some(refusal) = self.check_authority(resource, token).await {
                    // Claimed but never sent: a retry may execute it, with a token at least
                    // this one's, that the authority has to admit first.
                    attempt.unknown().await;
                    return Keyed::Refuse(refusal);
                }
                Keyed::Execute { attempt, ticket }
            }
        }
    }
}

#[cfg(test)]
mod model;
