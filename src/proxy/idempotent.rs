//! Writes carrying an `Idempotency-Key` on a route where keys apply.
//!
//! `key check → read the body (bounded) → fingerprint →` the fence's claim
//! (`fence::keyed`: authority, begin in the store, barrier turn, authority again)
//! `→ replay | refuse | forward and record`. How an executed attempt's outcome is recorded is
//! [`crate::idempotency::recording`]'s part.

use http::{Request, Response};
use http_body_util::{Either, Full};
use hyper::body::Incoming;

use super::access::{log_access, sent_bytes, Access, Timing};
use super::{Proxy, Write};
use crate::body::ProxyBody;
use crate::fence::keyed::{fingerprint, read_body, replay, Keyed, KeyedWrite};
use crate::fence::{Fence, Key};
use crate::metrics::Outcome;

impl Proxy {
    /// A fenced write with an idempotency key.
    pub(super) async fn idempotent_write(
        &self,
        req: Request<Incoming>,
        write: Write,
        key: Key,
    ) -> Response<ProxyBody> {
        let route = self.fence.route(write.route);
        let subject = write.subject(route);
        let (normalised, resource, token, started) = (
            write.normalised.as_str(),
            &write.resource,
            write.token,
            write.started,
        );
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
        let limit = key.settings.max_request_bytes;
        let read = read_body(body, limit, self.timeouts.upstream).await;
        let body = match read {
            Ok(body) => body,
            Err(refusal) => return refuse(refusal),
        };
        if let Some(head) = &head {
            head.received
                .store(body.len() as u64, std::sync::atomic::Ordering::Relaxed);
        }
        let fingerprint = fingerprint(&parts, normalised, &body);
        // Authoritative mode is asked once the body is in: a slow body gives the lease all the
        // time it needs to pass on.
        let keyed = self
            .fence
            .begin_keyed(KeyedWrite {
                route,
                resource,
                token,
                key,
                fingerprint,
                send_within: self.timeouts.upstream,
            })
            .await;
        let route_metrics = self.fence.metrics_for(Some(route));
        match keyed {
            Keyed::Refuse(refusal) => refuse(refusal),
            Keyed::Replay { response, recorded } => {
                let timing = Timing::without_upstream(started).head(head.as_deref());
                route_metrics.finish(Outcome::Replayed, &method, response.status, timing.took());
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
                Fence::log_replayed(
                    route,
                    &method,
                    normalised,
                    resource,
                    token,
                    recorded,
                    response.status,
                );
                replay(response, ProxyBody::local_with_trailers)
            }
            Keyed::Execute { attempt, ticket } => {
                let req = Request::from_parts(parts, Either::Right(Full::new(body)));
                self.forward_held(req, write, ticket, Some(attempt), head)
                    .await
            }
        }
    }
}
