//! Writes carrying an `Idempotency-Key` on a route where keys apply.
//!
//! `key check → read the body (bounded) → fingerprint → authority → begin (one atomic step
//! in the store: record lookup + fence) → authority again → replay | refuse | forward and
//! record`. How an executed attempt's outcome is recorded is [`super::recording`]'s part.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Either, Full, Limited};
use hyper::body::Incoming;

use super::access::{log_access, sent_bytes, Access, Timing};
use super::recording::{Attempt, Writer};
use super::{Proxy, Write};
use crate::body::ProxyBody;
use crate::config::Ordering;
use crate::fence::method::method_override;
use crate::idempotency::{Begin, Claim, Fingerprint, Record, StoredResponse};
use crate::metrics::Outcome;
use crate::problem::refusal::{Refusal, Unavailable};
use crate::store::StoreError;

/// Marks a response answered from a record.
pub const REPLAYED: &str = "idempotent-replayed";

/// A recorded response, answered again.
fn replay(response: StoredResponse) -> Response<ProxyBody> {
    let trailers = header_map(response.trailers);
    let mut out = Response::new(ProxyBody::local_with_trailers(response.body, trailers));
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

impl Proxy {
    /// A fenced write with an idempotency key.
    pub(super) async fn idempotent_write(
        &self,
        req: Request<Incoming>,
        write: Write,
        key: String,
    ) -> Response<ProxyBody> {
        let route = self.fence.route(write.route);
        let subject = write.subject(route);
        let (normalised, resource, token, started) = (
            write.normalised.as_str(),
            &write.resource,
            write.token,
            write.started,
        );
        let settings = self
            .fence
            .idempotency
            .as_ref()
            .expect("idempotent routes exist only with the idempotency section");
        let method = req.method().clone();
        // The request as it came, for the access line (the other lines have the normalised
        // path).
        let mut req = req;
        let head = self.access_head(&mut req, Some(write.peer));
        let refuse = |refusal| {
            let timing = Timing::without_upstream(started).head(head.as_deref());
            self.refuse(&refusal, Some(route), subject, &method, normalised, timing)
        };

        let (parts, body) = req.into_parts();
        let limit = settings.max_request_bytes;
        let read =
            tokio::time::timeout(self.timeouts.upstream, Limited::new(body, limit).collect()).await;
        let body = match read {
            Ok(Ok(collected)) => {
                let body = collected.to_bytes();
                if let Some(head) = &head {
                    head.received
                        .store(body.len() as u64, std::sync::atomic::Ordering::Relaxed);
                }
                body
            }
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
        // The method the upstream acts on: an override header's when there is one (a
        // malformed or repeated override was refused before this), or the request's own.
        let effective = method_override(&parts.headers).ok().flatten();
        let effective = effective.as_ref().unwrap_or(&parts.method);
        let fingerprint = Fingerprint::of(effective.as_str(), normalised, parts.uri.query(), &body);
        // Authoritative mode, asked once the body is in (a slow body gives the lease all the
        // time it needs to pass on): a superseded token may still have its outcome replayed.
        let mut superseded = None;
        if let Some(refusal) = self.fence.check_authority(resource, token).await {
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
            rule: self.fence.rule(),
            window: in_flight,
            may_execute: superseded.is_none(),
            attempt: crate::idempotency::AttemptId::next(),
        };
        let ticket = (route.ordering == Ordering::Serialize)
            .then(|| self.fence.barriers.enter(resource, token));
        let m = &self.fence.metrics.idempotency;
        let asked = Instant::now();
        let begin = tokio::time::timeout(
            self.timeouts.store,
            self.fence.store().begin_idempotent(resource, &key, &claim),
        )
        .await
        .unwrap_or_else(|_| Err(StoreError::no_answer_within(self.timeouts.store)));
        m.store_begin.observe(asked.elapsed().as_secs_f64());
        let route_metrics = self.fence.metrics_for(Some(route));
        match begin {
            Err(e) => {
                self.fence.metrics.store_error("store", e.label());
                // The claim may have landed before the answer was lost: mark it unknown so
                // retries are not refused as in flight for nothing. Only a record carrying
                // this attempt's id is replaced: another attempt's live record, with the same
                // token and body, stays in flight.
                let store = Arc::clone(self.fence.store());
                let (resource, key) = (resource.clone(), key);
                let outcome = Record::unknown(claim.token, claim.fingerprint);
                let limit = self.timeouts.store;
                tokio::spawn(async move {
                    let release = store.finish_idempotent(&resource, &key, &claim, &outcome);
                    let _ = tokio::time::timeout(limit, release).await;
                });
                refuse(Refusal::StoreUnavailable(Unavailable::Store(e)))
            }
            Ok(Begin::Stale { current }) => {
                route_metrics.stale.inc();
                refuse(Refusal::Stale { current })
            }
            Ok(Begin::TooFar { current }) => {
                route_metrics.too_far.inc();
                refuse(self.fence.too_far(current))
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
                    let timing = Timing::without_upstream(started).head(head.as_deref());
                    route_metrics.finish(
                        Outcome::Replayed,
                        &method,
                        response.status,
                        timing.took(),
                    );
                    if self.access_log {
                        log_access(Access {
                            subject,
                            method: &method,
                            path: normalised,
                            status: response.status,
                            outcome: Outcome::Replayed,
                            problem: None,
                            timing,
                            bytes_out: sent_bytes(&method, response.body.len()),
                            upstream: None,
                        });
                    }
                    tracing::info!(
                        route = %route.name,
                        %method,
                        path = normalised,
                        resource = resource.as_str(),
                        fencing_token = token.get(),
                        recorded_token = record.token.get(),
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
                        store: Arc::clone(self.fence.store()),
                        resource: resource.clone(),
                        key,
                        store_timeout: self.timeouts.store,
                        metrics: Arc::clone(&self.fence.metrics),
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
                if let Some(refusal) = self.fence.check_authority(resource, token).await {
                    // Claimed but never sent: a retry may execute it, with a token at least
                    // this one's, that the authority has to admit first.
                    attempt.unknown().await;
                    return refuse(refusal);
                }
                let req = Request::from_parts(parts, Either::Right(Full::new(body)));
                self.forward_held(req, write, ticket, Some(attempt), head)
                    .await
            }
        }
    }
}
