//! # fencegate
//!
//! A reverse proxy that refuses writes carrying stale fencing tokens. It sits in front of an
//! HTTP service, extracts a resource id from each write, and forwards the write only if its
//! token is at least the highest token recorded for that resource (compare-and-raise).
//!
//! # Layout
//! - [`config`]: the YAML schema, parsed into validated types (errors with line and column).
//! - [`fence`]: the pure decisions: [`fence::token`] grammar and header hygiene,
//!   [`fence::path`] normalisation, [`fence::routes`] route and resource matching,
//!   [`fence::barrier`] the `ordering: serialize` in-flight barrier.
//! - [`store`]: recorded maxima behind one trait: `memory`, `embedded` (redb, fsync'd,
//!   group commit), Redis, PostgreSQL, etcd; each also keeps the idempotency records.
//!   `etcd` is the small etcd v3 client the etcd store and lease backend share, over
//!   committed generated gRPC code.
//! - [`idempotency`]: records of writes carrying an `Idempotency-Key`, and the pure decision
//!   of what a retry gets.
//! - [`lease`]: the lease agent: backends (embedded, Redis, PostgreSQL, etcd), renewal,
//!   the local lease API and the egress proxy.
//! - [`proxy`]: the request path, refusals as problem+json, header surgery, streaming bodies.
//! - [`server`]: accept loop with TLS, HTTP/1 + HTTP/2, limits and graceful drain;
//!   [`timer`]: the timers a connection keeps from request to request.
//! - [`admin`]: metrics, probes and the fence inspection API; [`metrics`]: their definitions.
//! - [`reload`]: live configuration (file change or SIGHUP).
//! - [`duration`]: the duration syntax of the config, the lease API and the CLI.
//! - [`app`]: wiring and the shutdown order; [`cli`]: the command line; [`demo`]: the
//!   slow-writer walk-through; [`ttl`]: TTL derivation.
//! - [`inject`]: the Kubernetes sidecar, defined once, added to manifests
//!   ([`inject::manifest`]) and to pods by the admission webhook ([`inject::webhook`]).
#![forbid(unsafe_code)]

pub mod admin;
pub mod app;
pub mod body;
pub mod cli;
pub mod config;
pub mod demo;
pub mod duration;
mod etcd;
pub mod fence;
pub mod idempotency;
pub mod inject;
pub mod lease;
pub mod metrics;
pub mod problem;
pub mod proxy;
pub mod reload;
pub mod server;
pub mod store;
pub mod timer;
pub mod tls;
pub mod ttl;
