//! The access log (`access_log: true`): one line per request, on the `fencegate::access`
//! target, with its timing.

use std::time::Duration;

use http::Method;
use tokio::time::Instant;

use crate::metrics::{Outcome, UNMATCHED};

/// What a request is about (route, resource, token), as its log lines and a refusal's body
/// name it.
#[derive(Debug, Default, Clone, Copy)]
pub struct Subject<'a> {
    pub route: Option<&'a str>,
    pub resource: Option<&'a str>,
    pub token: Option<u64>,
}

/// When a request's handling began and ended, and how long its upstream exchange took; and,
/// for the access line, the path as received where the lines of [`Proxy::refuse`] are given
/// the normalised one (kept only when the access log is on and normalising changed the path).
#[derive(Debug, Clone, Copy)]
pub(super) struct Timing<'a> {
    pub(super) started: Instant,
    pub(super) ended: Instant,
    /// `None` when the request was not sent upstream.
    pub(super) upstream: Option<Duration>,
    pub(super) received: Option<&'a str>,
}

impl<'a> Timing<'a> {
    /// A request answered by fencegate, now, without an exchange with the upstream.
    pub(super) fn without_upstream(started: Instant) -> Self {
        Timing {
            started,
            ended: Instant::now(),
            upstream: None,
            received: None,
        }
    }

    pub(super) fn received(self, received: Option<&'a str>) -> Self {
        Timing { received, ..self }
    }

    /// End to end.
    pub(super) fn took(&self) -> Duration {
        self.ended.saturating_duration_since(self.started)
    }
}

/// One access log line: a request as it came and what became of it.
pub(super) struct Access<'a> {
    pub(super) subject: Subject<'a>,
    pub(super) method: &'a Method,
    /// As received, without the query.
    pub(super) path: &'a str,
    pub(super) status: u16,
    pub(super) outcome: Outcome,
    /// The problem type fencegate answered with; `None` for the upstream's answer.
    pub(super) problem: Option<&'a str>,
    pub(super) timing: Timing<'a>,
}

/// Writes `access` at `INFO` on the `fencegate::access` target (`access_log: true`).
pub(super) fn log_access(access: Access<'_>) {
    let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    tracing::info!(
        target: "fencegate::access",
        route = access.subject.route.unwrap_or(UNMATCHED),
        method = access.method.as_str(),
        path = access.path,
        resource = access.subject.resource,
        fencing_token = access.subject.token,
        status = access.status,
        outcome = access.outcome.label(),
        refusal = access
            .problem
            .map(|t| t.strip_prefix("urn:fencegate:").unwrap_or(t)),
        duration_us = micros(access.timing.took()),
        upstream_duration_us = access.timing.upstream.map(micros),
        "request"
    );
}
