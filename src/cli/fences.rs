//! `fencegate fences`: inspect and repair the recorded maxima of a config's store
//! (docs/operations.md, "Inspect" and "Repair (break-glass)").
//!
//! Exit codes: 0 done (`get` of a resource with nothing recorded included: it says so, and
//! prints `"max_token": null` in JSON), 1 the store failed or a reset was not confirmed (nothing
//! changed), 2 usage errors (clap). The store is opened with [`store::open_for_admin`]: no
//! background task, and nothing written but a reset.

use crate::fence::token::Token;
use std::io::{BufRead, IsTerminal, Write};
use std::path::Path;
use std::process::ExitCode;

use serde_json::json;

use crate::config::Config;
use crate::store::admin::{Fence, Inspect, Page};
use crate::store::{self, StoreError};

/// How results are printed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Aligned columns for people.
    #[default]
    Table,
    /// One JSON document, for scripts.
    Json,
}

/// Resources a reset with `--all-under` reads per page.
const RESET_PAGE: usize = 1000;

/// What `fences reset` resets: one resource, or every one under a resource prefix.
pub enum Target {
    One(String),
    AllUnder(String),
}

/// A reset, as asked on the command line.
pub struct Reset {
    pub target: Target,
    pub to: Token,
    pub reason: String,
    pub yes: bool,
}

/// Loads `config`, starts logging as `run` would (the audit line of a reset goes there), and
/// opens its store for inspection.
async fn open(config: &Path) -> Result<Box<dyn Inspect>, String> {
    let config = Config::load(config).map_err(|e| e.to_string())?;
    // `main` refused an unusable FENCEGATE_LOG before the command started.
    let filter = super::log_filter().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    super::init_logging(config.log.format, filter);
    crate::tls::install_default_provider();
    store::open_for_admin(&config.store)
        .await
        .map_err(|e| format!("cannot open the store: {e}"))
}

fn failed(e: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {e}");
    ExitCode::from(1)
}

pub(super) async fn get(config: &Path, resource: &str, output: Output) -> ExitCode {
    let store = match open(config).await {
        Ok(s) => s,
        Err(e) => return failed(e),
    };
    match store.fence(resource).await {
        Ok(fence) => {
            match output {
                Output::Json => {
                    let mut doc = serde_json::to_value(&fence).expect("plain fields serialise");
                    doc["store"] = json!(store.kind());
                    println!("{doc}");
                }
                Output::Table if fence.max_token.is_none() => {
                    println!("{resource}: nothing recorded in the {} store", store.kind())
                }
                Output::Table => print!("{}", table(&[fence])),
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
    let store = match open(config).await {
        Ok(s) => s,
        Err(e) => return failed(e),
    };
    match store.list(prefix, after, limit).await {
        Ok(Page { fences, next }) => {
            match output {
                Output::Json => println!(
                    "{}",
                    json!({ "fences": fences, "next": next, "store": store.kind() })
                ),
                Output::Table => {
                    print!("{}", table(&fences));
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

/// Who runs this, for the audit line: `$USER` (or `$LOGNAME`) and the process's uid.
fn who() -> (String, Option<u32>) {
    use std::os::unix::fs::MetadataExt;
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "unknown".into());
    let uid = std::fs::metadata("/proc/self").ok().map(|m| m.uid());
    (user, uid)
}

/// Whether the operator confirms on the terminal: they type `expected` or `yes`.
fn confirmed(question: &str, expected: &str) -> bool {
    eprint!("{question}\nType `{expected}` (or `yes`) to go on: ");
    let _ = std::io::stderr().flush();
    let mut line = String::new();
    if std::io::stdin().lock().read_line(&mut line).is_err() {
        return false;
    }
    let answer = line.trim();
    answer == expected || answer == "yes"
}

pub(super) async fn reset(config: &Path, reset: Reset, output: Output) -> ExitCode {
    if reset.reason.trim().is_empty() {
        return failed("--reason must say why (it goes in the audit line)");
    }
    let store = match open(config).await {
        Ok(s) => s,
        Err(e) => return failed(e),
    };
    // What would change, read first: the confirmation shows it.
    let (before, confirm, question) = match &reset.target {
        Target::One(resource) => match store.fence(resource).await {
            Ok(fence) => {
                let question = format!(
                    "Reset the maximum of {resource} in the {} store from {} to {}.",
                    store.kind(),
                    fence
                        .max_token
                        .map_or("nothing recorded".to_owned(), |t| t.to_string()),
                    reset.to
                );
                (vec![fence], resource.clone(), question)
            }
            Err(e) => return failed(format!("{resource}: {e}")),
        },
        Target::AllUnder(prefix) => match all_under(store.as_ref(), prefix).await {
            Ok(fences) => {
                let question = format!(
                    "Reset {} maxima under `{prefix}` in the {} store to {}.",
                    fences.len(),
                    store.kind(),
                    reset.to
                );
                (fences, prefix.clone(), question)
            }
            Err(e) => return failed(e),
        },
    };
    if !reset.yes {
        if !std::io::stdin().is_terminal() {
            return failed(
                "not resetting: no terminal to confirm on and no --yes; nothing changed",
            );
        }
        if !confirmed(&question, &confirm) {
            return failed("not confirmed; nothing changed");
        }
    }
    let (user, uid) = who();
    let mut done = Vec::new();
    for fence in &before {
        let resource = fence.resource.as_str();
        match store.reset(resource, reset.to).await {
            Ok(previous) => {
                tracing::warn!(
                    audit = "fence_reset",
                    user = user.as_str(),
                    uid,
                    store = store.kind(),
                    resource,
                    before = previous.map(Token::get),
                    after = reset.to.get(),
                    reason = reset.reason.as_str(),
                    "fence maximum reset"
                );
                done.push(json!({ "resource": resource, "before": previous, "after": reset.to }));
            }
            Err(e) => {
                tracing::error!(
                    audit = "fence_reset",
                    user = user.as_str(),
                    uid,
                    store = store.kind(),
                    resource,
                    after = reset.to.get(),
                    reason = reset.reason.as_str(),
                    error = %e,
                    "fence maximum not reset"
                );
                print_resets(&done, &reset.target, store.kind(), output);
                return failed(format!(
                    "{resource}: {e} (the resets listed before went through)"
                ));
            }
        }
    }
    print_resets(&done, &reset.target, store.kind(), output);
    ExitCode::SUCCESS
}

/// Every recorded maximum under `prefix`.
async fn all_under(store: &dyn Inspect, prefix: &str) -> Result<Vec<Fence>, StoreError> {
    let mut all = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = store.list(prefix, after.as_deref(), RESET_PAGE).await?;
        all.extend(page.fences);
        match page.next {
            Some(next) => after = Some(next),
            None => return Ok(all),
        }
    }
}

fn print_resets(done: &[serde_json::Value], target: &Target, kind: &str, output: Output) {
    match (output, target) {
        (Output::Json, Target::One(_)) => {
            if let Some(one) = done.first() {
                let mut doc = one.clone();
                doc["store"] = json!(kind);
                println!("{doc}");
            }
        }
        (Output::Json, Target::AllUnder(prefix)) => println!(
            "{}",
            json!({ "prefix": prefix, "resets": done, "store": kind })
        ),
        (Output::Table, _) => {
            for reset in done {
                let before = match &reset["before"] {
                    serde_json::Value::Null => "nothing".to_owned(),
                    v => v.to_string(),
                };
                let resource = reset["resource"].as_str().unwrap_or_default();
                println!("{resource}: {before} -> {}", reset["after"]);
            }
            if done.is_empty() {
                println!("nothing recorded: nothing reset");
            }
        }
    }
}

/// The fences as aligned columns: resource, maximum, and what else the store knows.
fn table(fences: &[Fence]) -> String {
    let mut rows = vec![[
        "RESOURCE".to_owned(),
        "MAX_TOKEN".to_owned(),
        "DETAILS".to_owned(),
    ]];
    for fence in fences {
        let mut details = Vec::new();
        if let Some(previous) = fence.previous_token {
            details.push(format!("previous {previous}"));
        }
        if let Some(ms) = fence.raised_at_ms {
            details.push(format!("raised at {ms} ms (Unix)"));
        }
        if let Some(ms) = fence.expires_in_ms {
            details.push(format!("expires in {ms} ms"));
        }
        if let Some(revision) = fence.mod_revision {
            details.push(format!("revision {revision}"));
        }
        rows.push([
            fence.resource.clone(),
            fence.max_token.map_or("-".to_owned(), |t| t.to_string()),
            details.join(", "),
        ]);
    }
    let width = |i: usize| rows.iter().map(|r| r[i].len()).max().unwrap_or(0);
    let (w0, w1) = (width(0), width(1));
    let mut out = String::new();
    for [resource, max, details] in &rows {
        out.push_str(format!("{resource:w0$}  {max:w1$}  {details}").trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_aligns_columns_and_names_what_the_store_knows() {
        let mut expiring = Fence::recorded("account:10", Some(9.into()));
        expiring.expires_in_ms = Some(1500);
        let text = table(&[Fence::recorded("a", Some(12345.into())), expiring]);
        assert_eq!(
            text,
            "RESOURCE    MAX_TOKEN  DETAILS\n\
             a           12345\n\
             account:10  9          expires in 1500 ms\n"
        );
    }
}
