//! Forwarding an admitted request: the send upstream (URI, forwarding headers, over the client
//! connection's own upstream connection or the pool), and the answer, counted and logged: the
//! upstream's response with its hop-by-hop headers stripped, or the refusal that says why
//! there is none. A write holding a barrier ticket or an idempotency claim is settled apart
//! from its client ([`Proxy::forward_held`]).

use crate::fence::resource::ResourceId;
use crate::fence::token::Token;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderName;
use http::uri::PathAndQuery;
use http::{Method, Request, Response, Uri, Version};
use hyper::body::Incoming;
use tokio::time::Instant;

use super::access::{Answered, Head, Received, Tally, Timing};
use super::upstream::{self, Failed, UpstreamBody};
use super::{Handling, Proxy, Write};
use crate::body::ProxyBody;
use crate::fence::barrier::Ticket;
use crate::fence::path;
use crate::fence::routes::Route;
use crate::headers;
use crate::idempotency::recording::{Attempt, Recorded};
use crate::metrics::Outcome;
use crate::problem::grpc;
use crate::problem::refusal::{Refusal, Subject};

/// What answering a forwarded request needs besides the upstream's answer.
pub(super) struct Answer<'a> {
    route: Option<&'a Route>,
    /// Owned: an access line written after the response has gone keeps it.
    resource: Option<ResourceId>,
    token: Option<Token>,
    outcome: Outcome,
    method: &'a Method,
    normalised: &'a str,
    /// The request as it came, for the access log when it is on.
    head: Option<Arc<Head>>,
    started: Instant,
}

impl Answer<'_> {
    fn subject(&self) -> Subject<'_> {
        Subject {
            route: self.route.map(|r| r.name.as_str()),
            resource: self.resource.as_deref(),
            token: self.token,
        }
    }
}

/// What a forwarded request's answer is counted and logged under, owned by its future.
pub(super) struct Answering {
    /// Index of the route in the table; `None` for a request on no route.
    route: Option<usize>,
    resource: Option<ResourceId>,
    token: Option<Token>,
    outcome: Outcome,
    /// When the request's head was handed to fencegate.
    started: Instant,
    /// The request as it came, kept only for the access log.
    head: Option<Arc<Head>>,
}

impl Answering {
    pub(super) fn unfenced(route: Option<usize>, outcome: Outcome, started: Instant) -> Self {
        Answering {
            route,
            resource: None,
            token: None,
            outcome,
            started,
            head: None,
        }
    }

    pub(super) fn fenced(
        route: usize,
        resource: ResourceId,
        token: Option<Token>,
        outcome: Outcome,
        started: Instant,
    ) -> Self {
        Answering {
            route: Some(route),
            resource: Some(resource),
            token,
            outcome,
            started,
            head: None,
        }
    }

    fn subject<'a>(&'a self, route: Option<&'a Route>) -> Subject<'a> {
        Subject {
            route: route.map(|r| r.name.as_str()),
            resource: self.resource.as_deref(),
            token: self.token,
        }
    }
}

impl Proxy {
    /// Sends the request upstream and answers with the upstream's response (or the refusal
    /// that says why there is none).
    ///
    /// Everything up to the send happens here, when called: the returned future holds only
    /// the exchange and what the answer needs (route, resource and token for metrics and the
    /// log), not the request. A write that must outlive its client goes through
    /// [`Proxy::forward_held`].
    pub(super) fn forwarding(
        self: Arc<Self>,
        req: Request<Incoming>,
        normalised: String,
        answering: Answering,
        peer: SocketAddr,
        own: Option<upstream::SharedSlot>,
    ) -> Handling<impl Future<Output = Response<ProxyBody>> + Send + 'static> {
        let method = req.method().clone();
        let mut answering = answering;
        let mut req = req;
        answering.head = self.access_head(&mut req, Some(peer));
        let counted = answering.head.clone();
        let req = req.map(|body| http_body_util::Either::Left(Received::new(body, counted)));
        let (exchange, sent_at) = match self.send(req, &normalised, true, peer, own) {
            Ok(sending) => sending,
            Err(e) => {
                let route = answering.route.map(|i| self.fence.route(i));
                let subject = answering.subject(route);
                let refusal = Refusal::InvalidPath(e);
                let timing =
                    Timing::without_upstream(answering.started).head(answering.head.as_deref());
                return Handling::done(self.refuse(
                    &refusal,
                    route,
                    subject,
                    &method,
                    &normalised,
                    timing,
                ));
            }
        };
        // Only what is needed after the answer lives across the wait.
        Handling::Forwarding {
            forwarding: async move {
                let sent = exchange.await;
                let ended = Instant::now();
                let route = answering.route.map(|i| self.fence.route(i));
                let answer = Answer {
                    route,
                    resource: answering.resource,
                    token: answering.token,
                    outcome: answering.outcome,
                    method: &method,
                    normalised: &normalised,
                    head: answering.head,
                    started: answering.started,
                };
                self.answer(answer, ended - sent_at, ended, pass_on(sent, None))
            },
        }
    }

    /// [`Proxy::forwarding`] for a write that holds a barrier ticket or an idempotency claim.
    /// These must outlive the client: if it hangs up while the write is with the upstream,
    /// the ticket is held (and the outcome recorded) until the upstream has answered, not
    /// dropped with the request. The answer is settled before it is handed over: the
    /// response's body then holds the ticket and records the outcome when read to the end,
    /// and drains and records in the background when dropped unread, whether by the server
    /// (the client is gone) or with the channel (the client went away before, or even after,
    /// the send).
    pub(super) async fn forward_held(
        &self,
        req: Request<UpstreamBody>,
        write: Write,
        ticket: Option<Ticket>,
        attempt: Option<Attempt>,
        head: Option<Arc<Head>>,
    ) -> Response<ProxyBody> {
        // Taken apart: `own` goes with the send, the rest is borrowed until the answer.
        let Write {
            route: index,
            resource,
            token,
            normalised,
            peer,
            own,
            started,
        } = write;
        let route = self.fence.route(index);
        let subject = Subject {
            route: Some(&route.name),
            resource: Some(&resource),
            token: Some(token),
        };
        let normalised = normalised.as_str();
        let method = req.method().clone();
        let route = Some(route);
        // The request is still as received here (`send` rewrites its URI). A caller that
        // read the head already (an idempotent write) hands it over.
        let mut req = req;
        let head = match head {
            Some(head) => Some(head),
            None => self.access_head(&mut req, Some(peer)),
        };
        if let (Some(head), http_body_util::Either::Left(body)) = (&head, req.body_mut()) {
            body.count_into(head);
        }
        let (exchange, sent_at) = match self.send(req, normalised, false, peer, own) {
            Ok(sending) => sending,
            Err(e) => {
                if let Some(attempt) = attempt {
                    // Claimed but never sent: a retry may execute it.
                    attempt.unknown().await;
                }
                let refusal = Refusal::InvalidPath(e);
                let timing = Timing::without_upstream(started).head(head.as_deref());
                return self.refuse(&refusal, route, subject, &method, normalised, timing);
            }
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let sent = exchange.await;
            let answered = Instant::now();
            let _ = tx.send((answered, settle(sent, ticket, attempt).await));
        });
        let answer = Answer {
            route,
            resource: Some(resource),
            token: Some(token),
            outcome: Outcome::Admitted,
            method: &method,
            normalised,
            head,
            started,
        };
        match rx.await {
            // Settling may have waited (an idempotency record written): the request ends now.
            Ok((answered, settled)) => {
                self.answer(answer, answered - sent_at, Instant::now(), settled)
            }
            Err(_) => {
                let refusal = Refusal::UpstreamError("the upstream exchange failed".into());
                let timing = Timing::without_upstream(started).head(answer.head.as_deref());
                self.refuse(
                    &refusal,
                    route,
                    answer.subject(),
                    &method,
                    normalised,
                    timing,
                )
            }
        }
    }

    /// The response to a forwarded request, counted: the upstream's, or the refusal that says
    /// why there is none.
    fn answer(
        &self,
        answer: Answer<'_>,
        took: Duration,
        ended: Instant,
        settled: Result<Response<ProxyBody>, Failed>,
    ) -> Response<ProxyBody> {
        let metrics = self.fence.metrics_for(answer.route);
        metrics.upstream.observe(took.as_secs_f64());
        let timing = Timing {
            started: answer.started,
            ended,
            upstream: Some(took),
            head: answer.head.as_deref(),
        };
        let refusal = match settled {
            Ok(response) => {
                let code = response.status().as_u16();
                metrics.finish(answer.outcome, answer.method, code, timing.took());
                let Some(head) = answer.head else {
                    return response;
                };
                // The line waits for the body: written by its tally when the body is done with.
                let answered = Answered {
                    route: answer.route.map(|r| Arc::clone(&self.route_names[r.index])),
                    resource: answer.resource,
                    token: answer.token,
                    method: answer.method.clone(),
                    status: code,
                    outcome: answer.outcome,
                    started: answer.started,
                    ended,
                    upstream_took: took,
                    upstream: Arc::clone(&self.upstream_name),
                };
                let _ = head.answered.set(answered);
                return response.map(|body| body.tallied(Some(Tally::new(head))));
            }
            Err(Failed::Upstream(e)) if request_body_failed(&e) => {
                Refusal::InvalidRequest(format!(
                    "the request body was malformed or cut short ({}); the upstream got an \
                     incomplete request",
                    error_chain(e.as_ref())
                ))
            }
            Err(Failed::Upstream(e)) => Refusal::UpstreamError(error_chain(e.as_ref())),
            Err(Failed::Timeout) => Refusal::UpstreamTimeout(self.timeouts.upstream),
        };
        self.refuse(
            &refusal,
            answer.route,
            answer.subject(),
            answer.method,
            answer.normalised,
            timing,
        )
    }

    /// The request, made ready for the upstream (URI, forwarding headers, HTTP/1.1) and sent;
    /// the exchange and when it started. `may_own`: whether the exchange may use the client
    /// connection's own upstream connection (see below).
    fn send(
        &self,
        req: Request<UpstreamBody>,
        normalised: &str,
        may_own: bool,
        peer: SocketAddr,
        own: Option<upstream::SharedSlot>,
    ) -> Result<
        (
            impl Future<Output = upstream::Sent> + Send + 'static,
            tokio::time::Instant,
        ),
        path::PathError,
    > {
        let (mut parts, body) = req.into_parts();
        let forwarded_for = match &own {
            Some(slot) => slot.forwarded_for(peer.ip()),
            None => headers::peer_value(peer.ip()),
        };
        // The client connection's own upstream connection serves HTTP/1 clients of a plain
        // upstream; HTTP/2 clients (concurrent streams) and https upstreams use the pool, and
        // so do exchanges that must outlive their client (a barrier ticket or an idempotency
        // claim): the pool keeps their connection until the response has been read, whoever
        // reads it.
        let via = match own {
            Some(slot)
                if may_own && parts.version <= Version::HTTP_11 && !self.upstream.is_https() =>
            {
                upstream::Route::Own(slot, self.upstream.authority.clone())
            }
            _ => upstream::Route::Pool,
        };
        let absolute = matches!(via, upstream::Route::Pool);
        // On its own connection the request carries the upstream's `Host`; the pool sets it
        // from the absolute URI.
        let upstream_host = (!absolute).then(|| self.upstream_host.clone());
        let uri = self.upstream_uri(normalised, &parts.uri, absolute)?;
        // Borrowed from the URI (a field apart from the headers): no copy of the authority.
        headers::request_headers(
            &mut parts.headers,
            forwarded_for,
            self.https,
            parts.uri.authority().map(|a| a.as_str()),
            upstream_host,
        );
        parts.uri = uri;
        // The upstream connection is HTTP/1.1 whatever the client spoke, but for gRPC calls.
        let client = if grpc::is_call(parts.version, &parts.headers) {
            grpc::upstream_headers(&mut parts.headers);
            &self.grpc_client
        } else {
            parts.version = Version::HTTP_11;
            &self.client
        };
        // tokio's clock: the upstream deadline is a tokio timer's.
        let started = tokio::time::Instant::now();
        let exchange = upstream::send(
            client,
            via,
            started + self.timeouts.upstream,
            Request::from_parts(parts, body),
        );
        Ok((exchange, started))
    }

    /// The upstream URI: the normalised path and the original query, after the upstream's scheme
    /// and authority when `absolute` (the pool wants those; a connection of our own does not).
    /// When normalising changed nothing (the common case) the request's own path-and-query is
    /// reused instead of being formatted and parsed again.
    fn upstream_uri(
        &self,
        path: &str,
        original: &Uri,
        absolute: bool,
    ) -> Result<Uri, path::PathError> {
        let query = original.query();
        let unchanged = original
            .path_and_query()
            .filter(|pq| pq.path() == path)
            .cloned();
        let path_and_query = match (unchanged, query) {
            (Some(pq), _) => Ok(pq),
            (None, Some(q)) => PathAndQuery::try_from(format!("{path}?{q}")),
            (None, None) => PathAndQuery::try_from(path),
        }
        .map_err(|_| path::PathError::Control)?;
        if !absolute {
            return Ok(Uri::from(path_and_query));
        }
        Uri::builder()
            .scheme(self.upstream.scheme.clone())
            .authority(self.upstream.authority.clone())
            .path_and_query(path_and_query)
            .build()
            .map_err(|_| path::PathError::Control)
    }
}

impl Proxy {
    /// The request as it came, for its access line, when the access log is on; a request id
    /// made for it is set on the request, to go upstream with it.
    pub(super) fn access_head<B>(
        &self,
        req: &mut Request<B>,
        peer: Option<SocketAddr>,
    ) -> Option<Arc<Head>> {
        if !self.access_log {
            return None;
        }
        let head = Head::of(req, peer.map(|p| p.ip()), self.log_query);
        head.forward_id(req.headers_mut());
        Some(head)
    }
}

/// Replaces whatever token the app sent (any spelling, any count) with the lease's token.
pub(super) fn set_token(headers: &mut http::HeaderMap, name: &HeaderName, token: Token) {
    let aliases: Vec<HeaderName> = headers
        .keys()
        .filter(|k| {
            k.as_str().len() == name.as_str().len() && k.as_str().replace('_', "-") == name.as_str()
        })
        .cloned()
        .collect();
    for alias in aliases {
        headers.remove(alias);
    }
    headers.insert(name.clone(), http::HeaderValue::from(token));
}

/// Makes an upstream exchange's result ready for its client, without the client: the response
/// (hop-by-hop headers stripped) with a body that holds the barrier ticket and, for an
/// idempotency claim, records the outcome (a response without a body is recorded here, as the
/// server never polls its body); or the failure, recorded as an unknown outcome. Whoever drops
/// the response from then on, read or not, the outcome is recorded.
pub(super) async fn settle(
    sent: upstream::Sent,
    ticket: Option<Ticket>,
    attempt: Option<Attempt>,
) -> Result<Response<ProxyBody>, Failed> {
    let Some(attempt) = attempt else {
        return pass_on(sent, ticket);
    };
    let response = match sent {
        Ok(response) => response,
        Err(failed) => {
            attempt.unknown().await;
            return Err(failed);
        }
    };
    let (mut parts, inner) = response.into_parts();
    headers::strip_hop_by_hop(&mut parts.headers);
    let body = match attempt
        .answered(parts.status, &parts.headers, inner, ticket)
        .await
    {
        Recorded::Empty { body, ticket } => ProxyBody::Upstream {
            inner: body,
            _ticket: ticket,
            tally: None,
        },
        Recorded::Streaming(body) => ProxyBody::Recording { body, tally: None },
    };
    Ok(Response::from_parts(parts, body))
}

/// [`settle`] without an idempotency attempt: nothing to record, so nothing to wait for.
fn pass_on(sent: upstream::Sent, ticket: Option<Ticket>) -> Result<Response<ProxyBody>, Failed> {
    let (mut parts, inner) = sent?.into_parts();
    headers::strip_hop_by_hop(&mut parts.headers);
    Ok(Response::from_parts(
        parts,
        ProxyBody::Upstream {
            inner,
            _ticket: ticket,
            tally: None,
        },
    ))
}

/// Whether a failed exchange failed on the client's own request body (malformed chunked
/// encoding, a body shorter than its Content-Length): the client's fault, not the upstream's.
fn request_body_failed(e: &upstream::BoxError) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e.as_ref());
    while let Some(s) = source {
        if let Some(h) = s.downcast_ref::<hyper::Error>() {
            if h.is_user() {
                return true;
            }
        }
        source = s.source();
    }
    false
}

/// `a: b: c` from an error and its sources, so a 502 body says what actually failed.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
