//! Integration tests: the real server on port 0 in front of a real, recording HTTP upstream.
//! One test binary (link time dominates on small machines); one module per concern.

mod common;

mod access_bytes;
mod admin;
mod authority;
mod check_cli;
mod cluster;
mod concurrency;
mod dashboards;
mod failover;
mod fence;
mod fences_cli;
mod grants;
mod grpc;
mod hostile;
mod idempotency;
mod idempotency_stores;
mod inject;
mod layer;
mod layer_keyed;
mod lease_acquiring;
mod lease_agent;
mod lease_e2e;
mod leases;
mod leases_cli;
mod linearizable;
mod logs;
mod poison;
mod process;
mod proxy;
mod retention;
mod route_table;
mod sentinel;
mod services;
mod store_tls;
mod stores;
mod tls;
mod upstream_conn;
