//! The fence decision, shared by the proxy and the in-process layer ([`crate::layer`]):
//! [`Fence::decide`] decides what it can from a request's head alone (route, resource, token,
//! and the store's compare-and-raise when it answers at once); [`Fence::admit`] is the rest
//! for a write that has to wait: the authority (`fence.authority: leases`), the store's
//! compare-and-raise (bounded by the store timeout), its verdict, and under
//! `ordering: serialize` the barrier's turn.

use crate::fence::{ResourceId, Token};
use std::sync::Arc;

use http::header::HeaderName;
use http::{HeaderMap, Request, Response, Version};
use tokio::time::Instant;

use super::barrier::Ticket;
use super::method::method_override;
use super::path;
use super::routes::{Matched, Route};
use super::token::{connection_nominates, token_from_headers, TokenError};
use super::verdict::{Rule, Verdict};
use super::{Check, Fence};
use crate::body::ProxyBody;
use crate::config::{MissingToken, Ordering, Unmatched};
use crate::idempotency::{KeyError, MAX_KEY_BYTES};
use crate::metrics::Outcome;
use crate::problem::refusal::{spelled, Refusal, Subject, Unavailable};
use crate::store::{FenceStore, StoreError};

/// What the fence decides about a request from its head alone.
pub(crate) enum Decision {
    /// Refused: answer with this, send nothing.
    Refuse(Refused),
    /// Send it on now: unfenced, or a fenced write admitted.
    Forward(Pass),
    /// A fenced write that has to wait before it may be sent: see [`Fence::admit`] (and, with
    /// an idempotency key, the proxy's idempotent write).
    Later(Later),
}

/// A refusal, and what it is about (for its body and log line).
pub(crate) struct Refused {
    pub(crate) refusal: Refusal,
    /// Index of the route in the table, when the request is on one.
    pub(crate) route: Option<usize>,
    pub(crate) resource: Option<ResourceId>,
    pub(crate) token: Option<Token>,
}

impl Refused {
    /// The refusal, and the route it is on with what its body and log line say it is about.
    pub(crate) fn parts<'a>(
        &'a self,
        fence: &'a Fence,
    ) -> (&'a Refusal, Option<&'a Route>, Subject<'a>) {
        let route = self.route.map(|i| fence.route(i));
        let subject = Subject {
            route: route.map(|r| r.name.as_str()),
            resource: self.resource.as_deref(),
            token: self.token,
        };
        (&self.refusal, route, subject)
    }
}

/// A request to send on now.
pub(crate) struct Pass {
    /// The request's path, normalised.
    pub(crate) normalised: String,
    /// Index of the route in the table; `None` for a request on no route.
    pub(crate) route: Option<usize>,
    /// `None` for a request the fence lets pass unfenced (no route, a `GET`, `fence: false`).
    pub(crate) fenced: Option<Fenced>,
}

/// A fenced write sent on now.
pub(crate) struct Fenced {
    pub(crate) resource: ResourceId,
    /// `None` for a write without a token on a `missing_token: allow` route.
    pub(crate) token: Option<Token>,
    /// Egress: the token is the held lease's, to be set on the request before it is sent.
    pub(crate) attach: bool,
}

/// A write's `Idempotency-Key`, on a route where keys apply, with the settings they are
/// handled by.
pub(crate) struct Key {
    pub(crate) key: String,
    pub(crate) settings: Arc<crate::config::IdempotencyConfig>,
}

/// A fenced write past its token check that has to wait before its send.
pub(crate) struct Later {
    pub(crate) route: usize,
    pub(crate) resource: ResourceId,
    pub(crate) token: Token,
    pub(crate) normalised: String,
    /// The write's `Idempotency-Key`, on a route where keys apply.
    pub(crate) key: Option<Key>,
}

impl Fence {
    /// The fence decision on a request's head: `host → normalised path → route match
    /// (resource) → token → idempotency key → compare-and-raise when the store answers at
    /// once`. Everything that needs no waiting happens here, for the proxy and the layer alike.
    pub(crate) fn decide<B>(&self, req: &Request<B>) -> Decision {
        let refuse = |refusal: Refusal, route: Option<&Route>| {
            Decision::Refuse(Refused {
                refusal,
                route: route.map(|r| r.index),
                resource: None,
                token: None,
            })
        };
        if let Some(problem) = host_problem(req) {
            return refuse(Refusal::InvalidRequest(problem.into()), None);
        }
        let normalised = match path::normalise(req.uri().path()) {
            Ok(p) => p.into_owned(),
            Err(e) => return refuse(Refusal::InvalidPath(e), None),
        };
        let authority = req.uri().authority().map(|a| a.as_str());
        let matched = self.table.lookup(
            req.method(),
            &normalised,
            req.uri().query(),
            authority,
            req.headers(),
        );
        // A method override header makes many frameworks treat the request as the method it
        // names: on a route, the request is fenced as that method when that method is fenced
        // (and as its own otherwise), and a malformed or repeated override is refused.
        let matched = match matched {
            Ok(found @ (Matched::Pass(route) | Matched::Fence { route, .. })) => {
                match method_override(req.headers()) {
                    Ok(None) => Ok(found),
                    Ok(Some(named)) => {
                        let query = req.uri().query();
                        let headers = req.headers();
                        match self
                            .table
                            .lookup(&named, &normalised, query, authority, headers)
                        {
                            fenced @ (Ok(Matched::Fence { .. }) | Err(_)) => fenced,
                            Ok(_) => Ok(found),
                        }
                    }
                    Err(e) => return refuse(Refusal::InvalidRequest(e.to_string()), Some(route)),
                }
            }
            other => other,
        };
        let pass = |route: Option<&Route>, normalised| {
            Decision::Forward(Pass {
                normalised,
                route: route.map(|r| r.index),
                fenced: None,
            })
        };
        let (route, resource) = match matched {
            Err((route, e)) => return refuse(Refusal::InvalidResource(e), route),
            Ok(Matched::None) if self.table.unmatched == Unmatched::Reject => {
                return refuse(Refusal::NoRoute, None)
            }
            Ok(Matched::None) => return pass(None, normalised),
            Ok(Matched::Pass(route)) => return pass(Some(route), normalised),
            Ok(Matched::Fence { route, resource }) => (route, resource),
        };
        let index = route.index;
        let refuse = |refusal: Refusal, resource: ResourceId, token: Option<Token>| {
            Decision::Refuse(Refused {
                refusal,
                route: Some(index),
                resource: Some(resource),
                token,
            })
        };
        let send = |normalised, resource, token, attach| {
            Decision::Forward(Pass {
                normalised,
                route: Some(index),
                fenced: Some(Fenced {
                    resource,
                    token,
                    attach,
                }),
            })
        };
        if let Check::Attach(agent) = &self.check {
            // Hop-by-hop headers go before the send: a token header the app nominated in
            // `Connection` would go with them, and the write would leave without a token.
            if connection_nominates(req.headers(), &self.token_header) {
                let refusal = Refusal::InvalidToken(TokenError::ConnectionNominated);
                return refuse(refusal, resource, None);
            }
            let Some(token) = agent.token_for(&resource) else {
                return refuse(Refusal::LeaseNotHeld, resource, None);
            };
            return send(normalised, resource, Some(token), true);
        }
        let token = match token_from_headers(req.headers(), &self.token_header) {
            Err(e) => return refuse(Refusal::InvalidToken(e), resource, None),
            Ok(None) if route.missing_token == MissingToken::Allow => {
                return send(normalised, resource, None, false)
            }
            Ok(None) => return refuse(Refusal::TokenRequired, resource, None),
            Ok(Some(token)) => token,
        };
        let key = match (&self.idempotency, self.idempotent[index]) {
            (Some(settings), true) => match key_from_headers(req.headers(), &settings.header.0) {
                Ok(key) => key.map(|key| Key {
                    key,
                    settings: Arc::clone(settings),
                }),
                Err(e) => return refuse(Refusal::InvalidIdempotencyKey(e), resource, Some(token)),
            },
            _ => None,
        };
        // The common case decides here: no key, no authority, no barrier, and a store that
        // answers at once.
        let at_once = match (&key, &self.authority, route.ordering) {
            (None, None, Ordering::None) => self.raise_at_once(&resource, token),
            _ => None,
        };
        let Some(answer) = at_once else {
            return Decision::Later(Later {
                route: index,
                resource,
                token,
                normalised,
                key,
            });
        };
        if let Err(refusal) = self.on_verdict(route, token, answer) {
            return refuse(refusal, resource, Some(token));
        }
        send(normalised, resource, Some(token), false)
    }

    /// A refused request's response: counted, logged and answered (problem+json) with the
    /// request's method and path as it came.
    pub(crate) fn answer_refused<B>(
        &self,
        refused: Refused,
        req: &Request<B>,
        started: Instant,
    ) -> Response<ProxyBody> {
        let (refusal, route, subject) = refused.parts(self);
        let (method, path) = (req.method(), req.uri().path());
        let took = started.elapsed();
        self.refuse(refusal, route, subject, method, path, took)
    }

    /// [`Fence::admit`] for a write [`Fence::decide`] left to wait; a refusal comes back with
    /// what it is about.
    pub(crate) async fn admit_later(&self, later: Later) -> Result<Option<Ticket>, Refused> {
        let route = &self.table.routes()[later.route];
        self.admit(route, &later.resource, later.token)
            .await
            .map_err(|refusal| Refused {
                refusal,
                route: Some(later.route),
                resource: Some(later.resource),
                token: Some(later.token),
            })
    }

    /// Counts a request answered by whatever the fence let it through to (the in-process
    /// layer's inner service), as the proxy counts the upstream's answers.
    pub(crate) fn answered(
        &self,
        route: Option<usize>,
        outcome: Outcome,
        method: &http::Method,
        code: u16,
        started: Instant,
    ) {
        let route = route.map(|i| self.route(i));
        self.metrics_for(route)
            .finish(outcome, method, code, started.elapsed());
    }

    /// The rest of a fenced write that has to wait before its send (without an idempotency
    /// key): authority, then the barrier's turn for this token taken, the raise, the wait for
    /// that turn, and the authority again; any of them may refuse the write. Admitted, the
    /// write holds its barrier ticket (under `ordering: serialize`) until it has finished.
    pub(crate) async fn admit(
        &self,
        route: &Route,
        resource: &ResourceId,
        token: Token,
    ) -> Result<Option<Ticket>, Refusal> {
        if let Some(refusal) = self.check_authority(resource, token).await {
            return Err(refusal);
        }
        let ticket =
            (route.ordering == Ordering::Serialize).then(|| self.barriers.enter(resource, token));
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
    }

    /// Counts a store's verdict on an admitted write, and turns the others into refusals.
    pub(crate) fn on_verdict(
        &self,
        route: &Route,
        token: Token,
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
            Ok(Verdict::TooFar { current }) => {
                self.route_metrics[route.index].too_far.inc();
                Err(self.too_far(current))
            }
            Err(e) => Err(Refusal::StoreUnavailable(Unavailable::Store(e))),
        }
    }

    /// Authoritative fencing: the token must be the latest grant's. Older is stale even if the
    /// newer holder has not written yet; newer was never issued. Refusals of tokens below a
    /// grant seen before need no round trip; everything else asks the grant cache, which
    /// answers from the backend's grant events while subscribed and asks the backend
    /// otherwise; a backend that does not answer refuses the write (fail closed).
    pub(crate) async fn check_authority(&self, resource: &str, token: Token) -> Option<Refusal> {
        let grants = self.authority.as_ref()?;
        if let Some(floor) = grants.floor(resource) {
            if token < floor {
                return Some(Refusal::Superseded { latest: floor });
            }
        }
        let latest = tokio::time::timeout(self.store_timeout, grants.latest(resource)).await;
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
                self.metrics.store_error("leases", e.label());
                Some(Refusal::StoreUnavailable(Unavailable::Leases(e)))
            }
            Err(_) => {
                self.metrics.store_error("leases", "timeout");
                Some(Refusal::StoreUnavailable(Unavailable::LeasesSilent(
                    self.store_timeout,
                )))
            }
        }
    }

    /// Compare-and-raise, bounded by the store timeout; a late answer counts as no answer.
    pub(crate) async fn check(
        &self,
        resource: &ResourceId,
        token: Token,
    ) -> Result<Verdict, StoreError> {
        if let Some(answer) = self.raise_at_once(resource, token) {
            return answer;
        }
        let started = Instant::now();
        let answer = bounded(
            self.store_timeout,
            self.store().compare_and_raise(resource, token, self.rule()),
        )
        .await;
        self.observe_store(started, &answer);
        answer
    }

    /// The compare-and-raise of a store that answers at once (see
    /// [`FenceStore::raise_at_once`]), timed and counted as [`Fence::check`] does.
    pub(crate) fn raise_at_once(
        &self,
        resource: &ResourceId,
        token: Token,
    ) -> Option<Result<Verdict, StoreError>> {
        let started = Instant::now();
        let answer = self.store().raise_at_once(resource, token, self.rule())?;
        self.observe_store(started, &answer);
        Some(answer)
    }

    /// What the store holds a token to: `token.equal`, and `token.max_step` in observed mode
    /// only. With `fence.authority: leases` every token is checked against the lease
    /// backend's latest grant before (and after) the raise, and one above it is refused as
    /// unissued, so an absurd token never reaches the store, and a ceiling could only refuse
    /// a token the backend did issue.
    pub(crate) fn rule(&self) -> Rule {
        Rule {
            equal: self.equal,
            max_step: self.max_step.filter(|_| self.authority.is_none()),
        }
    }

    /// The refusal of a token too far above `current` (the store's verdict).
    pub(crate) fn too_far(&self, current: Option<Token>) -> Refusal {
        Refusal::TooFar {
            current,
            max_step: self.max_step.unwrap_or(u64::MAX),
        }
    }

    /// The store writes are checked against. Only an ingress proxy gets this far: an egress
    /// proxy decides every fenced write in [`Fence::decide`], by the lease it holds.
    pub(crate) fn store(&self) -> &Arc<dyn FenceStore> {
        match &self.check {
            Check::Store(store) => store,
            Check::Attach(_) => unreachable!("an egress proxy never consults the store"),
        }
    }

    pub(crate) fn observe_store(&self, started: Instant, answer: &Result<Verdict, StoreError>) {
        self.metrics
            .store_raise
            .observe(started.elapsed().as_secs_f64());
        if let Err(e) = answer {
            self.metrics.store_error("store", e.label());
        }
    }
}

/// The key of a request, if it has one. More than one key header, or a key that is not
/// 1-255 visible ASCII characters, is refused.
fn key_from_headers(headers: &HeaderMap, name: &HeaderName) -> Result<Option<String>, KeyError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    let name = spelled(name);
    if values.next().is_some() {
        return Err(KeyError::Repeated { name });
    }
    let bytes = value.as_bytes();
    if bytes.is_empty() || bytes.len() > MAX_KEY_BYTES {
        let length = bytes.len();
        return Err(KeyError::Length { name, length });
    }
    if !bytes.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(KeyError::NotVisible { name });
    }
    Ok(Some(String::from_utf8_lossy(bytes).into_owned()))
}

/// RFC 9112 §3.2: more than one `Host`, or an HTTP/1.1 request with neither `Host` nor an
/// absolute-form target, is a bad request (the upstream and `X-Forwarded-Host` would have to
/// pick one of two claims).
pub(crate) fn host_problem<B>(req: &Request<B>) -> Option<&'static str> {
    let mut hosts = req.headers().get_all(http::header::HOST).iter();
    let first = hosts.next();
    if hosts.next().is_some() {
        return Some("more than one Host header (RFC 9112 §3.2)");
    }
    if first.is_none() && req.version() == Version::HTTP_11 && req.uri().authority().is_none() {
        return Some("an HTTP/1.1 request needs a Host header (RFC 9112 §3.2)");
    }
    None
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
