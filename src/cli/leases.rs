//! `fencegate leases get|list`: the leases in a config's lease backend (`leases.backend`), read
//! without taking part: no subscription, no grant (docs/operations.md, "Inspect"). Exit codes
//! as `fences`: 0 answered (a lease not held included), 1 failure, 2 usage.

use std::path::Path;
use std::process::ExitCode;

use serde_json::json;

use super::fences::Output;
use crate::config::Config;
use crate::lease::admin::{InspectLeases, Lease, LeasePage};

async fn open(config: &Path) -> Result<Box<dyn InspectLeases>, String> {
    let config = Config::load(config).map_err(|e| e.to_string())?;
    // `main` refused an unusable FENCEGATE_LOG before the command started.
    let filter = super::log_filter().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    super::init_logging(config.log.format, filter);
    crate::tls::install_default_provider();
    let Some(leases) = &config.leases else {
        return Err("the config has no `leases` section: no lease backend to read".into());
    };
    crate::lease::open_for_admin(&leases.backend)
        .await
        .map_err(|e| format!("cannot open the lease backend: {e}"))
}

fn failed(e: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {e}");
    ExitCode::from(1)
}

pub(super) async fn get(config: &Path, resource: &str, output: Output) -> ExitCode {
    let backend = match open(config).await {
        Ok(b) => b,
        Err(e) => return failed(e),
    };
    match backend.lease(resource).await {
        Ok(lease) => {
            match output {
                Output::Json => {
                    let mut doc = serde_json::to_value(&lease).expect("plain fields serialise");
                    doc["backend"] = json!(backend.kind());
                    println!("{doc}");
                }
                Output::Table => print!("{}", table(&[lease])),
            }
            ExitCode::SUCCESS
        }
        Err(e) => failed(format!("{resource}: {e}")),
    }
}

pub(super) async fn list(
    config: &Path,
    prefix: &str,
    after: Option<&str>,
    limit: usize,
    output: Output,
) -> ExitCode {
    let backend = match open(config).await {
        Ok(b) => b,
        Err(e) => return failed(e),
    };
    match backend.list(prefix, after, limit).await {
        Ok(LeasePage { leases, next }) => {
            match output {
                Output::Json => println!(
                    "{}",
                    json!({ "leases": leases, "next": next, "backend": backend.kind() })
                ),
                Output::Table => {
                    print!("{}", table(&leases));
                    if let Some(next) = next {
                        println!("# more: --after '{next}'");
                    }
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => failed(e),
    }
}

fn table(leases: &[Lease]) -> String {
    let dash = || "-".to_owned();
    let mut rows = vec![[
        "RESOURCE".to_owned(),
        "HELD".to_owned(),
        "HOLDER".to_owned(),
        "TOKEN".to_owned(),
        "EXPIRES_IN".to_owned(),
        "LEASE_ID".to_owned(),
    ]];
    for lease in leases {
        rows.push([
            lease.resource.clone(),
            if lease.held { "yes" } else { "no" }.to_owned(),
            lease.holder.clone().unwrap_or_else(dash),
            lease.token.map_or_else(dash, |t| t.to_string()),
            lease
                .expires_in_ms
                .map_or_else(dash, |ms| format!("{ms}ms")),
            lease.lease_id.clone().unwrap_or_else(dash),
        ]);
    }
    let widths: Vec<usize> = (0..6)
        .map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in &rows {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}
