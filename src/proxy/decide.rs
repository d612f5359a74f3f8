//! The fence decision for a write past its token check: the authority (`fence.authority:
//! leases`), the store's compare-and-raise (bounded by the store timeout), its verdict, and
//! under `ordering: serialize` the barrier's turn.

use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;
use tokio::time::Instant;

use super::access::Timing;
use super::forwarding::Answering;
use super::problem::{Refusal, Unavailable};
use super::{Proxy, Write};
use crate::body::ProxyBody;
use crate::config::Ordering;
use crate::fence::routes::Route;
use crate::fence::verdict::Verdict;
use crate::metrics::Outcome;
use crate::store::StoreError;

impl Proxy {
    /// The rest of a fenced write that has to wait before its send: an idempotency key, an
    /// authority, an ordering barrier, or a store that answers later.
    pub(super) async fn fence_later(
        self: Arc<Self>,
        req: Request<Incoming>,
        write: Write,
        key: Option<String>,
    ) -> Response<ProxyBody> {
        let route = &self.table.routes()[write.route];
        if let Some(key) = key {
            return self.idempotent_write(req, write, key).await;
        }
        let (resource, token) = (write.resource.as_str(), write.token);
        // Authority, then the barrier's turn for this token taken, the raise, the wait for
        // that turn, and the authority again: any of them may refuse the write.
        let admitted = async {
            if let Some(refusal) = self.check_authority(resource, token).await {
                return Err(refusal);
            }
            let ticket = (route.ordering == Ordering::Serialize)
                .then(|| self.barriers.enter(resource, token));
            self.on_verdict(route, token, self.check(resource, token).await)?;
            if let Some(ticket) = &ticket {
                let turn = ticket.wait_turn(route.barrier_timeout).await;
                turn.map_err(|_| Refusal::BarrierTimeout)?;
            }
            // The lease may have passed on while the raise (or the turn) was awaited: the
            // authority is asked again, the last thing before the send.
            if let Some(refusal) = self.check_authority(resource, token).await {
                return Err(refusal);
            }
            Ok(ticket)
        };
        let ticket = match admitted.await {
            Ok(ticket) => ticket,
            Err(refusal) => {
                let (method, path) = (req.method(), req.uri().path());
                let timing = Timing::without_upstream(write.started);
                let subject = write.subject(route);
                return self.refuse(refusal, Some(route), subject, method, path, timing);
            }
        };
        match ticket {
            None => {
                let Write {
                    route: index,
                    resource,
                    token,
                    normalised,
                    peer,
                    own,
                    started,
                } = write;
                let answering =
                    Answering::fenced(index, resource, Some(token), Outcome::Admitted, started);
                let forwarded = Arc::clone(&self).forwarding(req, normalised, answering, peer, own);
                forwarded.await.unwrap_or_else(|never| match never {})
            }
            ticket => {
                let req = req.map(http_body_util::Either::Left);
                self.forward_held(req, write, ticket, None).await
            }
        }
    }

    /// Counts a store's verdict on an admitted write, and turns the others into refusals.
    pub(super) fn on_verdict(
        &self,
        route: &Route,
        token: u64,
        answer: Result<Verdict, StoreError>,
    ) -> Result<(), Refusal> {
        match answer {
            Ok(verdict @ Verdict::Admitted { .. }) => {
                if verdict.raised(token) {
                    self.route_metrics[route.index].increments.inc();
                }
                Ok(())
            }
            Ok(Verdict::Stale { current }) => {
                self.route_metrics[route.index].stale.inc();
                Err(Refusal::Stale { current })
            }
            Err(e) => Err(Refusal::StoreUnavailable(Unavailable::Store(e))),
        }
    }

    /// Authoritative fencing: the token must be the latest grant's. Older is stale even if the
    /// newer holder has not written yet; newer was never issued. Refusals of tokens below a
    /// grant seen before need no round trip; everything else asks the grant cache, which
    /// answers from the backend's grant events while subscribed and asks the backend
    /// otherwise; a backend that does not answer refuses the write (fail closed).
    pub(super) async fn check_authority(&self, resource: &str, token: u64) -> Option<Refusal> {
        let grants = self.authority.as_ref()?;
        if let Some(floor) = grants.floor(resource) {
            if token < floor {
                return Some(Refusal::Superseded { latest: floor });
            }
        }
        let latest = tokio::time::timeout(self.timeouts.store, grants.latest(resource)).await;
        match latest {
            Ok(Ok(Some(latest))) => match token.cmp(&latest) {
                std::cmp::Ordering::Less => Some(Refusal::Superseded { latest }),
                std::cmp::Ordering::Greater => Some(Refusal::Unissued {
                    latest: Some(latest),
                }),
                std::cmp::Ordering::Equal => None,
            },
            Ok(Ok(None)) => Some(Refusal::Unissued { latest: None }),
            Ok(Err(e)) => {
                self.metrics.store_errors.inc();
                Some(Refusal::StoreUnavailable(Unavailable::Leases(e)))
            }
            Err(_) => {
                self.metrics.store_errors.inc();
                Some(Refusal::StoreUnavailable(Unavailable::LeasesSilent(
                    self.timeouts.store,
                )))
            }
        }
    }

    /// Compare-and-raise, bounded by the store timeout; a late answer counts as no answer.
    pub(super) async fn check(&self, resource: &str, token: u64) -> Result<Verdict, StoreError> {
        if let Some(answer) = self.raise_at_once(resource, token) {
            return answer;
        }
        let started = Instant::now();
        let answer = bounded(
            self.timeouts.store,
            self.store.compare_and_raise(resource, token, self.equal),
        )
        .await;
        self.observe_store(started, &answer);
        answer
    }

    /// The compare-and-raise of a store that answers at once (see
    /// [`FenceStore::raise_at_once`]), timed and counted as [`Proxy::check`] does.
    pub(super) fn raise_at_once(
        &self,
        resource: &str,
        token: u64,
    ) -> Option<Result<Verdict, StoreError>> {
        let started = Instant::now();
        let answer = self.store.raise_at_once(resource, token, self.equal)?;
        self.observe_store(started, &answer);
        Some(answer)
    }

    pub(super) fn observe_store(&self, started: Instant, answer: &Result<Verdict, StoreError>) {
        self.metrics
            .store_raise
            .observe(started.elapsed().as_secs_f64());
        if answer.is_err() {
            self.metrics.store_errors.inc();
        }
    }
}

/// A store answer, bounded by `limit`. Answers that are ready at once (the memory store, a
/// cached refusal) skip the timer: arming and disarming it costs more than they do.
async fn bounded<T>(
    limit: std::time::Duration,
    mut answer: crate::conn::BoxFuture<'_, Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let first = {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        answer.as_mut().poll(&mut cx)
    };
    if let std::task::Poll::Ready(ready) = first {
        return ready;
    }
    tokio::time::timeout(limit, answer)
        .await
        .unwrap_or_else(|_| Err(StoreError::no_answer_within(limit)))
}
