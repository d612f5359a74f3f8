//! A ledger service in axum with the fence in-process ([`fencegate::layer::FenceLayer`]) in
//! front of `PUT /accounts/{id}`: a write carrying a stale `Fencing-Token` gets the same `409`
//! problem+json the fencegate sidecar gives, and never reaches the handler (docs/library.md).
//!
//! ```console
//! $ cargo run --release --example axum_ledger -- --listen 127.0.0.1:3000 [--config FILE]
//! $ curl -X PUT -H 'Fencing-Token: 34' -d 100 http://127.0.0.1:3000/accounts/42   # stored
//! $ curl -X PUT -H 'Fencing-Token: 33' -d 90 http://127.0.0.1:3000/accounts/42    # 409
//! $ curl http://127.0.0.1:3000/accounts/42                                          # 100
//! ```
//!
//! Without `--config` the fence keeps its maxima in memory; a fencegate configuration file
//! (`store`, `routes`, `token`, `fence`; docs/configuration.md) chooses any other store.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::put;
use axum::Router;
use fencegate::config::Config;
use fencegate::layer::FenceLayer;

/// The fence when no `--config` is given: `PUT /accounts/{id}` fenced as `account:{id}`, the
/// maxima in memory.
pub const DEFAULT_CONFIG: &str = "\
store: { kind: memory }
routes:
  - { name: accounts, path: '/accounts/{id}', methods: [PUT], resource: 'account:{id}' }
";

/// Balances by account id.
type Ledger = Arc<Mutex<HashMap<String, String>>>;

/// Reached only by writes the fence admitted.
async fn store(
    State(ledger): State<Ledger>,
    Path(id): Path<String>,
    headers: HeaderMap,
    balance: String,
) -> String {
    let token = headers
        .get("fencing-token")
        .and_then(|t| t.to_str().ok())
        .unwrap_or("none");
    ledger.lock().unwrap().insert(id.clone(), balance.clone());
    format!("account {id} = {balance} (token {token})\n")
}

async fn balance(
    State(ledger): State<Ledger>,
    Path(id): Path<String>,
) -> Result<String, StatusCode> {
    let balance = ledger.lock().unwrap().get(&id).cloned();
    balance.map(|b| b + "\n").ok_or(StatusCode::NOT_FOUND)
}

/// The ledger's routes behind `fence`.
pub fn app(fence: FenceLayer) -> Router {
    Router::new()
        .route("/accounts/{id}", put(store).get(balance))
        .with_state(Ledger::default())
        // The fence in front of every route: its own routes say which requests it fences.
        .layer(fence)
}

pub struct Args {
    pub listen: SocketAddr,
    pub config: Option<PathBuf>,
}

/// What the command line asks for.
pub enum Asked {
    Run(Args),
    Help,
}

pub const USAGE: &str = "\
usage: axum_ledger [--listen ADDR] [--config FILE]

A ledger service with the fence in-process: PUT /accounts/{id} stores a balance, GET reads it;
a write with a stale Fencing-Token gets 409 and never reaches the handler.

  --listen ADDR   address to serve on [default: 127.0.0.1:3000]
  --config FILE   a fencegate configuration (store, routes, token, fence) [default: the
                  fence on PUT /accounts/{id}, maxima in memory]
  -h, --help      print this help
";

/// Reads the arguments after the program name.
pub fn parse_args(given: impl IntoIterator<Item = String>) -> Result<Asked, String> {
    let mut args = Args {
        listen: SocketAddr::from(([127, 0, 0, 1], 3000)),
        config: None,
    };
    let mut given = given.into_iter();
    while let Some(arg) = given.next() {
        let mut value = || given.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "-h" | "--help" => return Ok(Asked::Help),
            "--listen" => {
                let addr = value()?;
                args.listen = addr.parse().map_err(|e| format!("--listen {addr}: {e}"))?;
            }
            "--config" => args.config = Some(PathBuf::from(value()?)),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(Asked::Run(args))
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(Asked::Run(args)) => args,
        Ok(Asked::Help) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("axum_ledger: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let config = match &args.config {
        Some(path) => Config::load_fence(path).map_err(|e| e.to_string()),
        None => Config::parse_fence(DEFAULT_CONFIG).map_err(|e| e.to_string()),
    };
    let fence = match config {
        Ok(config) => FenceLayer::open(&config).await.map_err(|e| e.to_string()),
        Err(e) => Err(e),
    };
    let fence = match fence {
        Ok(fence) => fence,
        Err(e) => {
            eprintln!("axum_ledger: {e}");
            return ExitCode::FAILURE;
        }
    };
    let app = app(fence);
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("axum_ledger: cannot listen on {}: {e}", args.listen);
            return ExitCode::FAILURE;
        }
    };
    println!(
        "axum_ledger listening on {}",
        listener.local_addr().unwrap_or(args.listen)
    );
    if let Err(e) = axum::serve(listener, app).await {
        eprintln!("axum_ledger: {e}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
