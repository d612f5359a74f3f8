//! Prometheus metrics (docs/operations.md), created once from an injected registry.
//!
//! Per-route children are resolved when the route table is built (request durations on a
//! route's first request with each outcome), so the hot path only calls `.inc()` /
//! `.observe()` and never hashes label values.

mod process;

use std::time::Duration;

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

/// What happened to one request; the `outcome` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Fenced write admitted and answered by the upstream.
    Admitted,
    /// Not fenced (read, unfenced route, unmatched with `forward`, tokenless `allow`).
    Forwarded,
    /// Token below the recorded maximum (or equal to it under `token.equal: reject`), or
    /// below the latest grant in authoritative mode (`409` stale-token).
    Stale,
    /// Fenced write without a token under `missing_token: reject` (`428`).
    TokenRequired,
    /// Token header malformed, above 2^63−1, sent twice or aliased (`400` invalid-token).
    InvalidToken,
    /// Path that cannot be normalised (`400` invalid-path).
    InvalidPath,
    /// Resource id that cannot be made from the request, or too long (`400` invalid-resource).
    InvalidResource,
    /// The store (or, in authoritative mode, the lease backend) failed or did not answer
    /// within `timeouts.store` (`503`).
    StoreUnavailable,
    /// `ordering: serialize` waited longer than `barrier_timeout` (`503`).
    BarrierTimeout,
    /// The upstream could not be reached or failed (`502`).
    UpstreamError,
    /// No upstream response headers within `timeouts.upstream` (`504`).
    UpstreamTimeout,
    /// No route matches and `unmatched: reject` (`404`).
    NoRoute,
    /// Egress write without a valid lease.
    LeaseNotHeld,
    /// Authoritative mode: token above the latest grant.
    Unissued,
    /// Idempotency: answered from the record of the key's first attempt.
    Replayed,
    /// Idempotency: the key's first attempt is still with the upstream.
    IdempotencyInFlight,
    /// Idempotency: the key was used for a different request.
    IdempotencyKeyReused,
    /// Idempotency: the key's request completed but its response was too large to keep.
    NotReplayable,
    /// Idempotency: malformed key, unreadable or oversized body.
    InvalidRequest,
    /// Observed mode: token above the recorded maximum by more than `token.max_step`.
    TooFar,
}

impl Outcome {
    /// Every outcome, each at the index of its discriminant.
    pub const ALL: [Outcome; 20] = [
        Outcome::Admitted,
        Outcome::Forwarded,
        Outcome::Stale,
        Outcome::TokenRequired,
        Outcome::InvalidToken,
        Outcome::InvalidPath,
        Outcome::InvalidResource,
        Outcome::StoreUnavailable,
        Outcome::BarrierTimeout,
        Outcome::UpstreamError,
        Outcome::UpstreamTimeout,
        Outcome::NoRoute,
        Outcome::LeaseNotHeld,
        Outcome::Unissued,
        Outcome::Replayed,
        Outcome::IdempotencyInFlight,
        Outcome::IdempotencyKeyReused,
        Outcome::NotReplayable,
        Outcome::InvalidRequest,
        Outcome::TooFar,
    ];

    /// Its value in the `outcome` label: `admitted`, `stale`, `token_required`, ….
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Admitted => "admitted",
            Outcome::Forwarded => "forwarded",
            Outcome::Stale => "stale",
            Outcome::TokenRequired => "token_required",
            Outcome::InvalidToken => "invalid_token",
            Outcome::InvalidPath => "invalid_path",
            Outcome::InvalidResource => "invalid_resource",
            Outcome::StoreUnavailable => "store_unavailable",
            Outcome::BarrierTimeout => "barrier_timeout",
            Outcome::UpstreamError => "upstream_error",
            Outcome::UpstreamTimeout => "upstream_timeout",
            Outcome::NoRoute => "no_route",
            Outcome::LeaseNotHeld => "lease_not_held",
            Outcome::Unissued => "unissued",
            Outcome::Replayed => "replayed",
            Outcome::IdempotencyInFlight => "idempotency_in_flight",
            Outcome::IdempotencyKeyReused => "idempotency_key_reused",
            Outcome::NotReplayable => "not_replayable",
            Outcome::InvalidRequest => "invalid_request",
            Outcome::TooFar => "too_far",
        }
    }
}

/// The `method` label: the methods of RFC 9110 and PATCH by name, every other one `other`
/// (a client cannot grow the label's values without bound).
pub fn method_label(method: &http::Method) -> (u8, &'static str) {
    match *method {
        http::Method::GET => (0, "GET"),
        http::Method::HEAD => (1, "HEAD"),
        http::Method::POST => (2, "POST"),
        http::Method::PUT => (3, "PUT"),
        http::Method::PATCH => (4, "PATCH"),
        http::Method::DELETE => (5, "DELETE"),
        http::Method::OPTIONS => (6, "OPTIONS"),
        _ => (7, "other"),
    }
}

/// The children of one (outcome, method, code): the request counter and the end-to-end
/// histogram.
struct Answered {
    key: u32,
    count: IntCounter,
    duration: Histogram,
}

/// Pre-resolved children for one route label.
pub struct RouteMetrics {
    label: String,
    /// `fencegate_requests_total` and `fencegate_request_duration_seconds` by (outcome,
    /// method, code), sorted by key: resolved on a route's first request with each, so the hot
    /// path reads a snapshot and searches a few entries, and never hashes label values.
    answered: arc_swap::ArcSwap<Vec<Answered>>,
    requests: IntCounterVec,
    duration_vec: HistogramVec,
    /// `fencegate_stale_write_rejected_total{route}`: writes refused because their token was
    /// below the recorded maximum.
    pub stale: IntCounter,
    /// `fencegate_token_too_far_rejected_total{route}`: writes refused because their token was
    /// more than `token.max_step` above the recorded maximum.
    pub too_far: IntCounter,
    /// `fencegate_fencing_token_increments_total{route}`: admitted writes that raised a
    /// resource's recorded maximum.
    pub increments: IntCounter,
    /// `fencegate_upstream_duration_seconds{route}`: time from forwarding a request to the
    /// upstream's response headers.
    pub upstream: Histogram,
}

impl RouteMetrics {
    /// One request answered: counted under its outcome, method and status code, its
    /// end-to-end time observed.
    pub fn finish(&self, outcome: Outcome, method: &http::Method, code: u16, took: Duration) {
        let (m, method) = method_label(method);
        let key = (outcome as u32) << 16 | u32::from(m) << 12 | u32::from(code & 0xfff);
        let seen = self.answered.load();
        if let Ok(i) = seen.binary_search_by_key(&key, |a| a.key) {
            seen[i].count.inc();
            seen[i].duration.observe(took.as_secs_f64());
            return;
        }
        drop(seen);
        let code = code.to_string();
        let labels = [self.label.as_str(), outcome.label(), method, code.as_str()];
        let count = self.requests.with_label_values(&labels);
        let duration = self.duration_vec.with_label_values(&labels);
        count.inc();
        duration.observe(took.as_secs_f64());
        // A new snapshot with this entry (a race adds the same children twice at worst: the
        // vec hands out the same series for the same labels).
        self.answered.rcu(|old| {
            let mut next: Vec<Answered> = old
                .iter()
                .map(|a| Answered {
                    key: a.key,
                    count: a.count.clone(),
                    duration: a.duration.clone(),
                })
                .collect();
            if let Err(at) = next.binary_search_by_key(&key, |a| a.key) {
                let entry = Answered {
                    key,
                    count: count.clone(),
                    duration: duration.clone(),
                };
                next.insert(at, entry);
            }
            next
        });
    }
}

/// Every fencegate metric (docs/operations.md), registered in one registry.
pub struct Metrics {
    /// The registry they are registered in, which [`Metrics::render`] renders.
    pub registry: Registry,
    requests: IntCounterVec,
    stale: IntCounterVec,
    too_far: IntCounterVec,
    increments: IntCounterVec,
    upstream: HistogramVec,
    request_duration: HistogramVec,
    /// `fencegate_store_duration_seconds{op="raise"}`: the compare-and-raise of a fenced write
    /// without an idempotency key.
    pub store_raise: Histogram,
    /// `fencegate_store_duration_seconds{op="get"}`: a read of one recorded maximum (the admin
    /// API's `GET /v1/fences/{resource}`).
    pub store_get: Histogram,
    store_errors: IntCounterVec,
    /// `fencegate_config_reloads_total{result="applied"}`: configuration reloads applied.
    pub reloads_ok: IntCounter,
    /// `fencegate_config_reloads_total{result="refused"}`: configuration reloads refused as
    /// invalid.
    pub reloads_refused: IntCounter,
    /// The lease agent's metrics.
    pub lease: LeaseMetrics,
    /// The metrics of idempotency keys.
    pub idempotency: IdempotencyMetrics,
}

/// Idempotency keys (docs/operations.md `fencegate_idempotent_replays_total`, and the conflicts).
pub struct IdempotencyMetrics {
    /// `fencegate_idempotent_replays_total`: requests answered from the recorded response of
    /// their key's first attempt.
    pub replays: IntCounter,
    /// `fencegate_idempotency_conflicts_total{reason="in_flight"}`: requests refused (`409`)
    /// because their key's first attempt is still with the upstream.
    pub in_flight: IntCounter,
    /// `fencegate_idempotency_conflicts_total{reason="key_reused"}`: requests refused (`422`)
    /// because their key was first used for a different request.
    pub reused: IntCounter,
    /// Attempts whose outcome is unknown (upstream failed, timed out, retryable status, or
    /// the client went away before the answer was recorded).
    pub unknown: IntCounter,
    /// `fencegate_store_duration_seconds{op="begin_idempotent"}`: the claim of a key, which
    /// also raises the maximum.
    pub store_begin: Histogram,
    /// `fencegate_store_duration_seconds{op="finish_idempotent"}`: recording a keyed write's
    /// outcome.
    pub store_finish: Histogram,
}

/// The lease agent's metrics (docs/operations.md).
pub struct LeaseMetrics {
    /// `fencegate_lease_acquisition_duration_seconds`: time from a lease request to its grant,
    /// waiting included (grants only).
    pub acquisition: Histogram,
    /// `fencegate_lease_renewals_total{result="ok"}`: renewals the backend accepted.
    pub renewals_ok: IntCounter,
    /// `fencegate_lease_renewals_total{result="failed"}`: renewals that failed with a backend
    /// error (retried at the next interval).
    pub renewals_failed: IntCounter,
    /// `fencegate_lease_renewals_total{result="lost"}`: renewals that found the lease no longer
    /// this grant's on the backend.
    pub renewals_lost: IntCounter,
    /// `fencegate_lease_expiry_forced_total`: leases declared lost, at the local validity
    /// deadline or on a `lost` renewal.
    pub expiry_forced: IntCounter,
    /// `fencegate_lease_held{resource}`: a series only while the lease is held (see
    /// [`LeaseMetrics::held`]), so per-job leases do not leave one series each behind.
    held: IntGaugeVec,
    /// `fencegate_held_lease_count`: how many resources have a `fencegate_lease_held` series.
    held_count: IntGauge,
}

impl LeaseMetrics {
    /// The lease on `resource` is held (or draining) here: its series is 1.
    pub fn held(&self, resource: &str) {
        let gauge = self.held.with_label_values(&[resource]);
        if gauge.get() == 0 {
            // A new series (a newer lease on a resource still counted keeps the one it has).
            self.held_count.inc();
        }
        gauge.set(1);
    }

    /// The lease on `resource` is no longer held here (released or lost): its series goes.
    pub fn not_held(&self, resource: &str) {
        if self.held.remove_label_values(&[resource]).is_ok() {
            self.held_count.dec();
        }
    }
}

/// Label for requests that match no route (or whose path cannot be normalised).
pub const UNMATCHED: &str = "-";

impl Metrics {
    /// One failed or silent store operation: `source` is `store` (the fence store) or
    /// `leases` (the lease backend), `cause` the error's kind (`StoreError::label`).
    pub fn store_error(&self, source: &'static str, cause: &'static str) {
        self.store_errors.with_label_values(&[source, cause]).inc();
    }

    /// Creates every metric and registers it in `registry`; fails if one of them is registered
    /// there already.
    pub fn new(registry: Registry) -> prometheus::Result<Self> {
        let requests = IntCounterVec::new(
            Opts::new(
                "fencegate_requests_total",
                "Requests by route, outcome, method and response status code.",
            ),
            &["route", "outcome", "method", "code"],
        )?;
        let stale = IntCounterVec::new(
            Opts::new(
                "fencegate_stale_write_rejected_total",
                "Writes refused because their token was below the recorded maximum.",
            ),
            &["route"],
        )?;
        let too_far = IntCounterVec::new(
            Opts::new(
                "fencegate_token_too_far_rejected_total",
                "Writes refused because their token exceeded the recorded maximum by more than \
                 token.max_step (a poisoned or mistaken token).",
            ),
            &["route"],
        )?;
        let increments = IntCounterVec::new(
            Opts::new(
                "fencegate_fencing_token_increments_total",
                "Admitted writes that raised a resource's recorded maximum (new lease epochs).",
            ),
            &["route"],
        )?;
        let upstream = HistogramVec::new(
            HistogramOpts::new(
                "fencegate_upstream_duration_seconds",
                "Time from forwarding a request to the upstream's response headers.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["route"],
        )?;
        let store = HistogramVec::new(
            HistogramOpts::new(
                "fencegate_store_duration_seconds",
                "Time the fence store took to answer, by operation.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["op"],
        )?;
        let store_errors = IntCounterVec::new(
            Opts::new(
                "fencegate_store_errors_total",
                "Store and lease backend operations that failed or timed out, by source (store, \
                 leases) and cause (unreachable, timeout, refused, corrupt, contended, config, \
                 internal).",
            ),
            &["source", "cause"],
        )?;
        let reloads = IntCounterVec::new(
            Opts::new(
                "fencegate_config_reloads_total",
                "Configuration reloads (file change or SIGHUP), applied or refused as invalid.",
            ),
            &["result"],
        )?;
        registry.register(Box::new(reloads.clone()))?;
        let acquisition = Histogram::with_opts(
            HistogramOpts::new(
                "fencegate_lease_acquisition_duration_seconds",
                "Time from a lease request to its grant, waiting included.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
        )?;
        let renewals = IntCounterVec::new(
            Opts::new(
                "fencegate_lease_renewals_total",
                "Lease renewals: ok, failed (backend error, retried) or lost (no longer the owner).",
            ),
            &["result"],
        )?;
        let expiry_forced = IntCounter::new(
            "fencegate_lease_expiry_forced_total",
            "Leases declared lost locally at their validity deadline or when renewal found them gone.",
        )?;
        let held = IntGaugeVec::new(
            Opts::new(
                "fencegate_lease_held",
                "1 while this fencegate holds the lease on a resource (no series otherwise).",
            ),
            &["resource"],
        )?;
        let held_count = IntGauge::new(
            "fencegate_held_lease_count",
            "Leases this fencegate holds (held or draining), over all resources.",
        )?;
        let request_duration = HistogramVec::new(
            HistogramOpts::new(
                "fencegate_request_duration_seconds",
                "Time from a request's head to its response's head (upstream time included), \
                 by route, outcome, method and response status code.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["route", "outcome", "method", "code"],
        )?;
        let build_info = IntGaugeVec::new(
            Opts::new(
                "fencegate_build_info",
                "Always 1; the version of the running fencegate in its label.",
            ),
            &["version"],
        )?;
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        let replays = IntCounter::new(
            "fencegate_idempotent_replays_total",
            "Requests answered from the recorded response of their idempotency key's first attempt.",
        )?;
        let conflicts = IntCounterVec::new(
            Opts::new(
                "fencegate_idempotency_conflicts_total",
                "Requests refused over their idempotency key: in_flight (409) or key_reused (422).",
            ),
            &["reason"],
        )?;
        let unknown = IntCounter::new(
            "fencegate_idempotency_unknown_outcomes_total",
            "Idempotent attempts recorded with an unknown outcome (a retry may execute them again).",
        )?;
        registry.register(Box::new(replays.clone()))?;
        registry.register(Box::new(conflicts.clone()))?;
        registry.register(Box::new(unknown.clone()))?;
        registry.register(Box::new(acquisition.clone()))?;
        registry.register(Box::new(renewals.clone()))?;
        registry.register(Box::new(expiry_forced.clone()))?;
        registry.register(Box::new(held.clone()))?;
        registry.register(Box::new(held_count.clone()))?;
        registry.register(Box::new(request_duration.clone()))?;
        registry.register(Box::new(build_info))?;
        registry.register(Box::new(process::ProcessCollector::new()))?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(stale.clone()))?;
        registry.register(Box::new(too_far.clone()))?;
        registry.register(Box::new(increments.clone()))?;
        registry.register(Box::new(upstream.clone()))?;
        registry.register(Box::new(store.clone()))?;
        registry.register(Box::new(store_errors.clone()))?;
        Ok(Metrics {
            registry,
            requests,
            stale,
            too_far,
            increments,
            upstream,
            request_duration,
            store_raise: store.with_label_values(&["raise"]),
            store_get: store.with_label_values(&["get"]),
            store_errors,
            reloads_ok: reloads.with_label_values(&["applied"]),
            reloads_refused: reloads.with_label_values(&["refused"]),
            lease: LeaseMetrics {
                acquisition,
                renewals_ok: renewals.with_label_values(&["ok"]),
                renewals_failed: renewals.with_label_values(&["failed"]),
                renewals_lost: renewals.with_label_values(&["lost"]),
                expiry_forced,
                held,
                held_count,
            },
            idempotency: IdempotencyMetrics {
                replays,
                in_flight: conflicts.with_label_values(&["in_flight"]),
                reused: conflicts.with_label_values(&["key_reused"]),
                unknown,
                store_begin: store.with_label_values(&["begin_idempotent"]),
                store_finish: store.with_label_values(&["finish_idempotent"]),
            },
        })
    }

    /// Children for one route label; call once per route when the table is built.
    pub fn route(&self, route: &str) -> RouteMetrics {
        RouteMetrics {
            label: route.to_owned(),
            answered: arc_swap::ArcSwap::from_pointee(Vec::new()),
            requests: self.requests.clone(),
            duration_vec: self.request_duration.clone(),
            stale: self.stale.with_label_values(&[route]),
            too_far: self.too_far.with_label_values(&[route]),
            increments: self.increments.with_label_values(&[route]),
            upstream: self.upstream.with_label_values(&[route]),
        }
    }

    /// Registers `fencegate_fence_resets_total`, read from `observed` at each scrape: the
    /// resets of maxima (`fencegate fences reset`, run elsewhere) this fencegate saw in its
    /// store.
    pub fn count_resets(
        &self,
        observed: impl Fn() -> u64 + Send + Sync + 'static,
    ) -> prometheus::Result<()> {
        self.registry
            .register(Box::new(ResetsCollector::new(observed)?))
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let encoder = prometheus::TextEncoder::new();
        if let Err(e) = encoder.encode_utf8(&self.registry.gather(), &mut out) {
            out = format!("# encoding failed: {e}\n");
        }
        out
    }
}

/// `fencegate_fence_resets_total`, a counter the store keeps ([`Metrics::count_resets`]).
struct ResetsCollector {
    counter: IntCounter,
    observed: Box<dyn Fn() -> u64 + Send + Sync>,
}

impl ResetsCollector {
    fn new(observed: impl Fn() -> u64 + Send + Sync + 'static) -> prometheus::Result<Self> {
        Ok(ResetsCollector {
            counter: IntCounter::new(
                "fencegate_fence_resets_total",
                "Resets of recorded maxima (fencegate fences reset) this fencegate saw in its \
                 shared store; each one cleared its cache of maxima.",
            )?,
            observed: Box::new(observed),
        })
    }
}

impl prometheus::core::Collector for ResetsCollector {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        self.counter.desc()
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        // The store's count only grows: the counter follows it.
        let observed = (self.observed)();
        let counted = self.counter.get();
        if observed > counted {
            self.counter.inc_by(observed - counted);
        }
        self.counter.collect()
    }
}

/// From 100 µs (a cached refusal) to 10 s (a slow upstream).
const LATENCY_BUCKETS: [f64; 15] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    10.0,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_order_matches_discriminants() {
        for (i, o) in Outcome::ALL.iter().enumerate() {
            assert_eq!(*o as usize, i);
        }
    }

    #[test]
    fn renders_spec_names() {
        let m = Metrics::new(Registry::new()).unwrap();
        let r = m.route("accounts");
        let took = Duration::from_millis(1);
        r.finish(Outcome::Stale, &http::Method::PUT, 409, took);
        r.stale.inc();
        r.finish(Outcome::TooFar, &http::Method::PUT, 409, took);
        r.too_far.inc();
        r.increments.inc();
        r.upstream.observe(0.01);
        m.store_raise.observe(0.001);
        m.idempotency.replays.inc();
        m.idempotency.reused.inc();
        let text = m.render();
        for needle in [
            "fencegate_requests_total{code=\"409\",method=\"PUT\",outcome=\"stale\",route=\"accounts\"} 1",
            "fencegate_stale_write_rejected_total{route=\"accounts\"} 1",
            "fencegate_requests_total{code=\"409\",method=\"PUT\",outcome=\"too_far\",route=\"accounts\"} 1",
            "fencegate_token_too_far_rejected_total{route=\"accounts\"} 1",
            "fencegate_fencing_token_increments_total{route=\"accounts\"} 1",
            "fencegate_upstream_duration_seconds_count{route=\"accounts\"} 1",
            "fencegate_store_duration_seconds_count{op=\"raise\"} 1",
            "fencegate_idempotent_replays_total 1",
            "fencegate_idempotency_conflicts_total{reason=\"key_reused\"} 1",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
    }

    /// Each (outcome, method, code) gets its series on its first request and is counted in
    /// it after; methods outside the standard ones share `other`.
    #[test]
    fn requests_by_outcome_method_and_code() {
        let m = Metrics::new(Registry::new()).unwrap();
        let r = m.route("accounts");
        let took = Duration::from_millis(2);
        let purge = http::Method::from_bytes(b"PURGE").unwrap();
        let lock = http::Method::from_bytes(b"LOCK").unwrap();
        for (outcome, method, code) in [
            (Outcome::Admitted, &http::Method::PUT, 200),
            (Outcome::Admitted, &http::Method::PUT, 200),
            (Outcome::Admitted, &http::Method::PUT, 204),
            (Outcome::Stale, &http::Method::PUT, 409),
            (Outcome::Admitted, &purge, 200),
            (Outcome::Admitted, &lock, 200),
            (Outcome::Forwarded, &http::Method::GET, 200),
        ] {
            r.finish(outcome, method, code, took);
        }
        let text = m.render();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("fencegate_requests_total{"))
            .collect();
        assert_eq!(
            lines,
            [
                r#"fencegate_requests_total{code="200",method="GET",outcome="forwarded",route="accounts"} 1"#,
                r#"fencegate_requests_total{code="200",method="PUT",outcome="admitted",route="accounts"} 2"#,
                r#"fencegate_requests_total{code="200",method="other",outcome="admitted",route="accounts"} 2"#,
                r#"fencegate_requests_total{code="204",method="PUT",outcome="admitted",route="accounts"} 1"#,
                r#"fencegate_requests_total{code="409",method="PUT",outcome="stale",route="accounts"} 1"#,
            ]
        );
        assert!(text.contains(
            r#"fencegate_request_duration_seconds_count{code="200",method="PUT",outcome="admitted",route="accounts"} 2"#
        ));
    }
}
