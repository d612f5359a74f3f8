//! # fencegate
//!
//! A reverse proxy that refuses writes carrying stale fencing tokens. It sits in front of an
//! HTTP service, extracts a resource id from each write, and forwards the write only if its
//! token is at least the highest token recorded for that resource (compare-and-raise).
//!
//! # Layout
//! Top to bottom, roughly: a module imports modules listed below it; `scripts/check-cycles`
//! checks that no modules (at the level of top-level modules and their direct submodules)
//! import each other in a cycle.
//!
//! - [`cli`]: the command line; [`demo`]: the slow-writer walk-through.
//! - [`app`]: wiring and the shutdown order.
//! - [`inject`]: the Kubernetes sidecar, defined once, added to manifests
//!   ([`inject::manifest`]) and to pods by the admission webhook ([`inject::webhook`]).
//! - [`server`]: accept loop with TLS, HTTP/1 + HTTP/2, limits, `server::drain` (graceful
//!   drain) and `server::head_timer` (the header-read timer); [`admin`]: metrics, probes and
//!   the fence inspection API; [`reload`]: live configuration (file change or SIGHUP).
//! - [`layer`]: the fence in-process: a [`fence::Fence`] in front of any tower service, as
//!   a tower `Layer`, with the proxy's own decision, refusals and idempotency keys.
//! - [`proxy`]: a [`fence::Fence`] in front of an upstream, along the request's way:
//!   `handle_on` in [`proxy`] itself, `build`, [`proxy::idempotent`] (writes with an
//!   `Idempotency-Key`), `forwarding` over
//!   [`proxy::upstream`] with [`headers`] (header surgery), `access` (the access log).
//! - [`fence::Fence`]: what decides a write (routes, token rules, the store or the lease
//!   agent, barriers, authority, metrics) and the decision itself (`fence::decide`: route,
//!   token, authority, compare-and-raise, verdict, barrier); refusals are counted and logged
//!   there.
//! - [`lease`]: the lease agent ([`lease::agent`]): backends behind one trait
//!   ([`lease::backend`]; embedded, Redis, PostgreSQL, etcd, with `lease::shared` helpers),
//!   renewal timing ([`lease::schedule`]), the grant cache ([`lease::grants`]) and the local
//!   lease API ([`lease::api`]).
//! - [`store`]: recorded maxima behind one trait: `memory`, `embedded` (redb, fsync'd,
//!   group commit), Redis, PostgreSQL, etcd; each also keeps the idempotency records.
//!   [`store::StoreError`] and [`lease::LeaseError`] are one [`store::BackendError`] naming
//!   its system: what failed (a [`store::ErrorKind`]: unreachable, timeout, refused, corrupt,
//!   …), in the backend's words, whose fault it is, and the error it came from.
//! - `conn`: what the stores and the lease backends share to reach their systems: the
//!   `BoxFuture` their traits answer with, Redis connections (`conn::redis`), PostgreSQL pools
//!   and TLS (`conn::postgres`), etcd clients (`conn::etcd`), how a call failed, and the one
//!   error both report (`conn::error`).
//! - `etcd`: the small etcd v3 client the etcd store and lease backend share, over committed
//!   generated gRPC code.
//! - [`idempotency`]: records of writes carrying an `Idempotency-Key`, the pure decision of
//!   what a retry gets, and [`idempotency::recording`], which records an executed write's
//!   answer as it is sent (the proxy's and the Layer's); `fence::keyed` claims a keyed write
//!   for both.
//! - [`problem`]: problem+json bodies, the same on every listener; [`problem::refusal`]:
//!   every refusal kind in one table (status, type, title, gRPC code, outcome, fault,
//!   `Retry-After`); [`problem::grpc`]: refusals of gRPC calls as gRPC statuses; [`body`]:
//!   the response body every listener sends.
//! - below [`fence::Fence`], the pure decisions: [`fence::token`] grammar and header hygiene,
//!   [`fence::path`] normalisation, [`fence::routes`] route and resource matching,
//!   [`fence::method`] method overrides, [`fence::verdict`] compare-and-raise,
//!   [`fence::barrier`] the `ordering: serialize` in-flight barrier.
//! - [`tls`]: server and client TLS from the configured files.
//! - [`config`]: the YAML schema, parsed into validated types (errors with line and column).
//! - [`fault`]: whose fault a failure is (the client's, ours, the upstream's, the store's).
//! - [`maxima`]: a bounded cache of maxima that only rise, which the fence stores and the
//!   lease grant cache keep.
//! - [`metrics`]: the metric definitions; [`ttl`]: TTL derivation and lease duration limits;
//!   [`duration`]: the duration syntax of the config, the lease API and the CLI; [`timer`]:
//!   the timers a connection keeps from request to request.
#![forbid(unsafe_code)]
#![warn(missing_docs)]
// A build without every store leaves parts shared by the networked stores unused; the full
// build (the default, which CI lints) still reports dead code.
#![cfg_attr(
    not(all(
        feature = "redis",
        feature = "postgres",
        feature = "etcd",
        feature = "embedded",
        feature = "proxy"
    )),
    allow(dead_code, unused_imports, unused_variables)
)]

#[cfg(feature = "proxy")]
pub(crate) mod admin;
#[cfg(feature = "proxy")]
#[doc(hidden)]
pub mod app;
pub mod body;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod cli;
pub mod config;
mod conn;
#[cfg(feature = "demo")]
#[doc(hidden)]
pub mod demo;
pub(crate) mod duration;
#[cfg(feature = "etcd")]
mod etcd;
pub(crate) mod fault;
pub mod fence;
pub(crate) mod headers;
pub mod idempotency;
#[cfg(feature = "kubernetes")]
#[doc(hidden)]
pub mod inject;
pub mod layer;
pub mod lease;
pub(crate) mod maxima;
pub mod metrics;
pub(crate) mod problem;
#[cfg(feature = "proxy")]
#[doc(hidden)]
pub mod proxy;
#[cfg(feature = "proxy")]
#[doc(hidden)]
pub mod reload;
#[cfg(feature = "proxy")]
#[doc(hidden)]
pub mod server;
pub mod store;
pub(crate) mod sync;
#[cfg(feature = "proxy")]
pub(crate) mod timer;
pub mod tls;
pub(crate) mod ttl;
