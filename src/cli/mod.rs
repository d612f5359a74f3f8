//! The command line (README.md, Commands). Exit codes: 0 ok, 1 invalid config or failure, 2 usage error.

mod check;
mod fences;
mod leases;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

use crate::app::Server;
use crate::config::Config;
use crate::inject::SidecarConfigError;
use crate::ttl::{self, TtlInputs};

#[derive(Parser)]
#[command(
    name = "fencegate",
    version,
    about = "Refuses writes that carry stale fencing tokens"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy; logs to stderr, JSON unless stderr is a terminal (see --log-format).
    Run {
        #[arg(long, short, env = "FENCEGATE_CONFIG")]
        config: PathBuf,
        /// json, text, or auto (text on a terminal, JSON otherwise); overrides `log.format`.
        #[arg(long, env = "FENCEGATE_LOG_FORMAT", value_enum)]
        log_format: Option<crate::config::LogFormat>,
    },
    /// Validate a config and print the effective configuration.
    Check {
        #[arg(long, short, env = "FENCEGATE_CONFIG")]
        config: PathBuf,
    },
    /// Derive a lease TTL from latency budgets: ttl = p99 work + p99 rtt + safety margin + drift
    /// buffer, rounded up to a multiple of --round-to (durations: 800ms, 1.5s, 2m).
    Ttl {
        /// The 99th percentile of the work done under one lease, first write to last.
        #[arg(long, value_parser = duration)]
        p99_work: Duration,
        /// The 99th percentile round trip to the lease backend (an acquire or a renewal).
        #[arg(long, value_parser = duration)]
        p99_rtt: Duration,
        /// Extra time on top, for what the percentiles do not show (GC pauses, slow disks).
        #[arg(long, value_parser = duration)]
        safety_margin: Duration,
        /// How far the holder's clock may run slow against the backend's over one TTL; the
        /// holder stops writing this long before the lease ends.
        #[arg(long, value_parser = duration, default_value = "0ms")]
        drift_buffer: Duration,
        /// Round the TTL up to a multiple of this (greater than zero).
        #[arg(long, value_parser = positive_duration, default_value = "500ms")]
        round_to: Duration,
        /// Print JSON (milliseconds) for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Walk through the slow-writer scenario in one process, no external services.
    Demo {
        #[command(subcommand)]
        command: Option<DemoCommand>,
    },
    /// Inspect and repair the recorded maxima in a config's store (exit 0 done, 1 failed or
    /// not confirmed, 2 usage).
    Fences {
        #[command(subcommand)]
        command: FencesCommand,
    },
    /// Read the leases in a config's lease backend (`leases.backend`): holder, token, expiry.
    Leases {
        #[command(subcommand)]
        command: LeasesCommand,
    },
    /// Add the fencegate sidecar to Kubernetes manifests (stdin or FILE to stdout).
    Inject {
        /// Manifests to read (`-` or absent: standard input).
        #[arg(long = "filename", short = 'f')]
        file: Option<PathBuf>,
        /// Put the sidecar in `containers` instead of a native sidecar in `initContainers`
        /// (which needs Kubernetes 1.29 or later).
        #[arg(long)]
        classic: bool,
        /// Sidecar image [default: ghcr.io/fencegate/fencegate:<this version>].
        #[arg(long)]
        image: Option<String>,
        #[command(flatten)]
        sidecar: SidecarArgs,
    },
    /// Serve the mutating admission webhook that injects the sidecar (POST /mutate for pods that opted in, POST /mutate-namespace for pods in namespaces that did).
    #[command(mut_arg("config", |a| a.help(WEBHOOK_CONFIG_HELP)))]
    Webhook {
        /// Serving certificate chain (PEM) for the webhook Service's DNS name.
        #[arg(long)]
        tls_cert: PathBuf,
        /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
        #[arg(long)]
        tls_key: PathBuf,
        /// Address to serve HTTPS on.
        #[arg(long, default_value = "0.0.0.0:8443")]
        listen: std::net::SocketAddr,
        /// Put the sidecar in `containers` instead of `initContainers` (clusters before 1.29).
        #[arg(long)]
        classic: bool,
        /// Sidecar image [default: ghcr.io/fencegate/fencegate:<this version>].
        #[arg(long)]
        image: Option<String>,
        #[command(flatten)]
        sidecar: SidecarArgs,
    },
}

/// `fencegate demo …`.
#[derive(Subcommand)]
enum DemoCommand {
    /// Run the demo's toy ledger alone, until stopped: a service to put fencegate in front of.
    /// PUT, POST and PATCH store the body under the path, GET reads it back, DELETE forgets
    /// it; each answer is one line naming the fencing token received.
    Upstream {
        /// Address to serve plain HTTP on.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: std::net::SocketAddr,
    },
}

/// `webhook --config`: the same file as `inject --config`, which the webhook reads but does not
/// write (the ConfigMap is the chart's).
const WEBHOOK_CONFIG_HELP: &str = "The fencegate.yaml in the ConfigMap the injected pods mount \
    (checked as `inject --config` checks it; not written anywhere: the ConfigMap is created \
    separately, by the chart): its leases and egress listeners become FENCEGATE_LEASE_API and \
    FENCEGATE_EGRESS_URL of the app containers";

/// `fencegate fences …`.
#[derive(Subcommand)]
enum FencesCommand {
    /// Print the recorded maximum of RESOURCE and what else the store knows of it (exit 0
    /// also when nothing is recorded: it says so, `"max_token": null` in JSON).
    Get {
        resource: String,
        #[command(flatten)]
        common: FencesArgs,
    },
    /// List recorded maxima in resource order, a page at a time.
    List {
        #[command(flatten)]
        page: PageArgs,
        #[command(flatten)]
        common: FencesArgs,
    },
    /// Break-glass: set the maximum of RESOURCE (or of every resource under --all-under) to
    /// --to, lower or higher. Asks on the terminal unless --yes; refuses without either.
    /// Running fencegates on a shared store drop their cached maxima within a second.
    Reset {
        #[arg(required_unless_present = "all_under", conflicts_with = "all_under")]
        resource: Option<String>,
        /// Reset every recorded maximum whose resource id starts with PREFIX (a token-space
        /// restart: the tokens' issuer starts over).
        #[arg(long, value_name = "PREFIX")]
        all_under: Option<String>,
        /// The new maximum (a token: at most 2^63-1).
        #[arg(long)]
        to: crate::fence::token::Token,
        /// Why, for the audit line (logged with who ran it, before and after).
        #[arg(long)]
        reason: String,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
        #[command(flatten)]
        common: FencesArgs,
    },
}

/// `fencegate leases …`.
#[derive(Subcommand)]
enum LeasesCommand {
    /// Print the lease of RESOURCE: whether it is held, by whom, its token and expiry (or the
    /// last grant's token when it is not held).
    Get {
        resource: String,
        #[command(flatten)]
        common: FencesArgs,
    },
    /// List the resources ever leased, in resource order, a page at a time.
    List {
        #[command(flatten)]
        page: PageArgs,
        #[command(flatten)]
        common: FencesArgs,
    },
}

/// What every `fences` and `leases` command takes.
#[derive(clap::Args)]
struct FencesArgs {
    #[arg(long, short, env = "FENCEGATE_CONFIG")]
    config: PathBuf,
    #[arg(long, value_enum, default_value = "table")]
    output: fences::Output,
}

/// Which page of a listing (`fences list`, `leases list`).
#[derive(clap::Args)]
struct PageArgs {
    /// Only resources whose id starts with this.
    #[arg(long, default_value = "")]
    prefix: String,
    /// Most resources in the page.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    limit: u64,
    /// Start after this resource: the `next` of the previous page.
    #[arg(long, value_name = "CURSOR")]
    after: Option<String>,
}

impl PageArgs {
    fn limit(&self) -> usize {
        usize::try_from(self.limit).unwrap_or(usize::MAX)
    }
}

/// What `inject` and `webhook` know of the sidecar config, for the pods that mount it.
#[derive(clap::Args)]
struct SidecarArgs {
    /// The sidecar's fencegate.yaml (checked, with `listen` and `admin` on ports 7440 and 7441
    /// of a non-loopback address), written out as the ConfigMap; its leases and egress
    /// listeners become FENCEGATE_LEASE_API and FENCEGATE_EGRESS_URL of the app containers.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// The ConfigMap of pods without the fencegate.io/config annotation, which --config and
    /// --env-from-secret are about.
    #[arg(long, value_name = "NAME", default_value = crate::inject::DEFAULT_CONFIG_MAP, value_parser = k8s_name)]
    config_map: String,
    /// A Secret (in the pod's namespace) whose keys become the sidecar's environment
    /// variables, for ${VARIABLES} in the config such as a store password.
    #[arg(long, value_name = "SECRET", value_parser = k8s_name)]
    env_from_secret: Option<String>,
}

/// Why the sidecar config given to `inject` or `webhook` cannot be used.
#[derive(Debug, thiserror::Error)]
enum SidecarFileError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Invalid {
        path: PathBuf,
        source: SidecarConfigError,
    },
}

impl SidecarArgs {
    /// The injection options; the error names the config file.
    fn options(
        self,
        image: Option<String>,
        classic: bool,
    ) -> Result<crate::inject::Options, SidecarFileError> {
        let config = match &self.config {
            None => None,
            Some(path) => {
                let text =
                    std::fs::read_to_string(path).map_err(|source| SidecarFileError::Read {
                        path: path.clone(),
                        source,
                    })?;
                let config = crate::inject::SidecarConfig::parse(&text).map_err(|source| {
                    SidecarFileError::Invalid {
                        path: path.clone(),
                        source,
                    }
                })?;
                Some(config)
            }
        };
        Ok(crate::inject::Options {
            image: image.unwrap_or_else(crate::inject::Options::default_image),
            native: !classic,
            config_map: self.config_map,
            config,
            env_from_secret: self.env_from_secret,
        })
    }
}

/// A command-line value that is not a Kubernetes object name.
#[derive(Debug, thiserror::Error)]
#[error("a Kubernetes object name: lowercase letters, digits, `-` and `.`")]
struct NotAnObjectName;

fn k8s_name(s: &str) -> Result<String, NotAnObjectName> {
    if crate::inject::is_dns_subdomain(s) {
        Ok(s.to_owned())
    } else {
        Err(NotAnObjectName)
    }
}

fn duration(s: &str) -> Result<Duration, String> {
    crate::duration::parse(s)
}

/// A duration greater than zero.
fn positive_duration(s: &str) -> Result<Duration, String> {
    match crate::duration::parse(s)? {
        d if d.is_zero() => Err("must be greater than zero".into()),
        d => Ok(d),
    }
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // What the environment asks of the runtime and the logs, read before either starts: a
    // value that cannot be used is an error, not ignored.
    let env = || -> Result<(Option<usize>, tracing_subscriber::EnvFilter), ExitCode> {
        workers_env()
            .and_then(|workers| Ok((workers, log_filter()?)))
            .map_err(|e| {
                eprintln!("error: {e}");
                ExitCode::from(1)
            })
    };
    match cli.command {
        Command::Check { config } => check::command(&config),
        Command::Ttl {
            p99_work,
            p99_rtt,
            safety_margin,
            drift_buffer,
            round_to,
            json,
        } => {
            let inputs = TtlInputs {
                p99_work,
                p99_rtt,
                safety_margin,
                drift_buffer,
                round_to,
            };
            let derived = ttl::derive(&inputs);
            if let Some(warning) = derived.as_ref().ok().and_then(ttl::Derived::floor_warning) {
                eprintln!("warning: {warning}");
            }
            match derived {
                Ok(d) if json => {
                    let doc = serde_json::to_string(&ttl::DerivedJson::from(d))
                        .expect("plain numbers serialise");
                    println!("{doc}");
                    ExitCode::SUCCESS
                }
                Ok(d) => {
                    print!("{}", ttl::render(&inputs, &d));
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Command::Run { config, log_format } => {
            let (workers, filter) = match env() {
                Ok(env) => env,
                Err(code) => return code,
            };
            let path = config;
            // The configuration names the log format, so it is read before logging starts; a
            // configuration that cannot be read is reported in the format of the flag (or
            // `auto`).
            let config = match Config::load(&path) {
                Ok(c) => c,
                Err(e) => {
                    init_logging(log_format.unwrap_or_default(), filter);
                    tracing::error!(error = %e, "invalid configuration");
                    return ExitCode::from(1);
                }
            };
            init_logging(log_format.unwrap_or(config.log.format), filter);
            for warning in config.warnings() {
                tracing::warn!(warning, "configuration warning");
            }
            let embedded = matches!(config.store, crate::config::StoreConfig::Embedded { .. });
            runtime(embedded, workers).block_on(run(config, path))
        }
        Command::Demo { .. } | Command::Fences { .. } | Command::Leases { .. } => {
            let workers = match env() {
                Ok((workers, _)) => workers,
                Err(code) => return code,
            };
            let rt = runtime(false, workers);
            match cli.command {
                Command::Fences { command } => rt.block_on(fences_command(command)),
                Command::Leases { command } => rt.block_on(leases_command(command)),
                Command::Demo {
                    command: Some(DemoCommand::Upstream { listen }),
                } => rt.block_on(crate::demo::upstream(listen)),
                _ => rt.block_on(crate::demo::run()),
            }
        }
        Command::Inject {
            file,
            classic,
            image,
            sidecar,
        } => {
            let options = match sidecar.options(image, classic) {
                Ok(options) => options,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(1);
                }
            };
            let (name, input) = match file.as_deref().filter(|p| p.as_os_str() != "-") {
                None => (
                    "stdin".to_owned(),
                    std::io::read_to_string(std::io::stdin()),
                ),
                Some(p) => (p.display().to_string(), std::fs::read_to_string(p)),
            };
            let input = match input {
                Ok(text) => text,
                Err(e) => {
                    eprintln!("error: cannot read {name}: {e}");
                    return ExitCode::from(1);
                }
            };
            match crate::inject::inject_manifests_with_warnings(&input, &options) {
                Ok(injected) => {
                    for warning in &injected.warnings {
                        eprintln!("warning: {name}: {warning}");
                    }
                    print!("{}", injected.output);
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {name}: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Command::Webhook {
            tls_cert,
            tls_key,
            listen,
            classic,
            image,
            sidecar,
        } => {
            let (workers, filter) = match env() {
                Ok(env) => env,
                Err(code) => return code,
            };
            init_logging(crate::config::LogFormat::Auto, filter);
            let options = match sidecar.options(image, classic) {
                Ok(options) => options,
                Err(e) => {
                    tracing::error!(error = %e, "invalid sidecar config");
                    return ExitCode::from(1);
                }
            };
            let tls = crate::config::TlsConfig {
                cert: tls_cert,
                key: tls_key,
                client_ca: None,
            };
            let fields = crate::tls::ServerFields {
                cert: "--tls-cert",
                key: "--tls-key",
                client_ca: "client_ca",
                pair: "--tls-cert and --tls-key",
            };
            let tls = match crate::tls::server_config(&tls, &fields) {
                Ok(t) => t,
                Err(e) => {
                    tracing::error!(error = %e, "invalid webhook TLS");
                    return ExitCode::from(1);
                }
            };
            runtime(false, workers).block_on(async move {
                let listener = match tokio::net::TcpListener::bind(listen).await {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::error!(error = %e, %listen, "cannot listen");
                        return ExitCode::from(1);
                    }
                };
                let addr = listener
                    .local_addr()
                    .map(|a| a.to_string())
                    .unwrap_or_default();
                tracing::info!(
                    listen = %addr,
                    image = %options.image,
                    native = options.native,
                    config_map = %options.config_map,
                    lease_api = options.config.as_ref().and_then(|c| c.lease_api.as_deref()),
                    egress_url = options.config.as_ref().and_then(|c| c.egress_url.as_deref()),
                    env_from_secret = options.env_from_secret.as_deref(),
                    "webhook started"
                );
                let shutdown = async {
                    let signal = shutdown_signal().await;
                    tracing::info!(signal, "shutting down: draining webhook connections");
                };
                crate::inject::webhook::serve_webhook(listener, tls, options, shutdown).await;
                tracing::info!("stopped");
                ExitCode::SUCCESS
            })
        }
    }
}

/// `FENCEGATE_WORKERS`, read; `None` when unset (or empty). A value that is not a number of
/// threads stops the command: ignored, it would leave the runtime sized other than asked.
fn workers_env() -> Result<Option<usize>, String> {
    match std::env::var("FENCEGATE_WORKERS") {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Ok(v) if v.is_empty() => Ok(None),
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(Some(n)),
            _ => Err(format!(
                "FENCEGATE_WORKERS=`{v}`: the number of runtime worker threads is a whole number, \
                 1 or more"
            )),
        },
        Err(std::env::VarError::NotUnicode(_)) => {
            Err("FENCEGATE_WORKERS is not UTF-8: the number of worker threads, 1 or more".into())
        }
    }
}

/// The log filter of `FENCEGATE_LOG` (`info` when unset or empty). A value that does not parse
/// stops the command: ignored, it would log other than asked.
fn log_filter() -> Result<tracing_subscriber::EnvFilter, String> {
    match std::env::var("FENCEGATE_LOG") {
        Err(std::env::VarError::NotPresent) => Ok(tracing_subscriber::EnvFilter::new("info")),
        Ok(v) if v.is_empty() => Ok(tracing_subscriber::EnvFilter::new("info")),
        Ok(v) => tracing_subscriber::EnvFilter::try_new(&v).map_err(|e| {
            format!(
                "FENCEGATE_LOG=`{v}`: not a log filter ({e}); write one like `warn` or \
                 `info,hyper=debug`"
            )
        }),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err("FENCEGATE_LOG is not UTF-8: write a filter like `warn`".into())
        }
    }
}

/// The async runtime. `FENCEGATE_WORKERS` ([`workers_env`]) sets the number of worker threads (default: one per
/// core the process may use, from its CPU affinity and cgroup quota); one runs everything on
/// one thread without the work-stealing scheduler, which is cheapest for a sidecar given a
/// single core. `embedded_store`: the fence store is the embedded one, whose writer the
/// runtime wakes when it parks (a hook every park would otherwise run for nothing).
fn runtime(embedded_store: bool, workers: Option<usize>) -> tokio::runtime::Runtime {
    let workers = workers.or_else(|| {
        std::thread::available_parallelism()
            .ok()
            .map(usize::from)
            .filter(|&n| n == 1)
    });
    let mut builder = match workers {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(n) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    #[cfg(feature = "embedded")]
    if embedded_store {
        crate::store::defer_wakes_to_park(&mut builder);
    }
    builder
        .enable_all()
        .build()
        .expect("cannot start the async runtime")
}

async fn fences_command(command: FencesCommand) -> ExitCode {
    match command {
        FencesCommand::Get { resource, common } => {
            fences::get(&common.config, &resource, common.output).await
        }
        FencesCommand::List { page, common } => {
            let limit = page.limit();
            fences::list(
                &common.config,
                &page.prefix,
                page.after.as_deref(),
                limit,
                common.output,
            )
            .await
        }
        FencesCommand::Reset {
            resource,
            all_under,
            to,
            reason,
            yes,
            common,
        } => {
            let target = match (resource, all_under) {
                (_, Some(prefix)) => fences::Target::AllUnder(prefix),
                (Some(resource), None) => fences::Target::One(resource),
                (None, None) => unreachable!("clap requires one"),
            };
            let reset = fences::Reset {
                target,
                to,
                reason,
                yes,
            };
            fences::reset(&common.config, reset, common.output).await
        }
    }
}

async fn leases_command(command: LeasesCommand) -> ExitCode {
    match command {
        LeasesCommand::Get { resource, common } => {
            leases::get(&common.config, &resource, common.output).await
        }
        LeasesCommand::List { page, common } => {
            let limit = page.limit();
            leases::list(
                &common.config,
                &page.prefix,
                page.after.as_deref(),
                limit,
                common.output,
            )
            .await
        }
    }
}

async fn run(config: Config, path: PathBuf) -> ExitCode {
    let server = match Server::start_watching(&config, path).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot start");
            return ExitCode::from(1);
        }
    };
    let signal = shutdown_signal().await;
    tracing::info!(
        signal,
        "shutting down: readiness off, draining in-flight requests"
    );
    server.shutdown();
    server.wait().await;
    tracing::info!("stopped");
    ExitCode::SUCCESS
}

async fn shutdown_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("cannot install a SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("cannot install a SIGINT handler");
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}

fn init_logging(format: crate::config::LogFormat, filter: tracing_subscriber::EnvFilter) {
    let lines = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if format.json() {
        lines
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .init();
    } else {
        lines.init();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether a task on `rt` finds the embedded store's park hook on the thread it runs on.
    /// Each sleep parks the threads of an idle runtime; a multi-thread runtime may resume the
    /// task on a worker that has not parked yet, so it looks after each of several sleeps.
    fn hooked(rt: tokio::runtime::Runtime) -> bool {
        rt.block_on(async {
            tokio::spawn(async {
                for _ in 0..50 {
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                    if crate::store::parks_here() {
                        return true;
                    }
                }
                false
            })
            .await
            .expect("the task ran")
        })
    }

    #[test]
    fn the_park_hook_comes_with_the_embedded_store_only() {
        // Each on a fresh thread: with one core the runtime runs on the thread that builds it,
        // and the hook's mark is per thread.
        let on_own_thread = |embedded| {
            std::thread::spawn(move || hooked(runtime(embedded, None)))
                .join()
                .expect("the check ran")
        };
        assert!(on_own_thread(true));
        assert!(!on_own_thread(false));
    }
}
