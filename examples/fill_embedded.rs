//! Bench helper: records `account:0` .. `account:N-1` with one token each straight into an
//! embedded store's file, as N fenced PUTs through fencegate would (resource ids as
//! bench/fencegate.yaml.in makes them), without sending N requests. bench/run's memory part
//! uses it for 10 million resources (`--memory-fill direct`).
//!
//! ```console
//! $ cargo run --example fill_embedded -- PATH N [TOKEN] [PREFIX]
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use fencegate::store::EmbeddedStore;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(path), Some(Ok(n))) = (args.first(), args.get(1).map(|n| n.parse::<u64>())) else {
        eprintln!("usage: fill_embedded PATH N [TOKEN] [PREFIX]");
        return ExitCode::from(2);
    };
    let token = args.get(2).map_or(Ok(1), |t| t.parse::<u64>());
    let Ok(token) = token else {
        eprintln!("fill_embedded: TOKEN is a number");
        return ExitCode::from(2);
    };
    let prefix = args.get(3).map_or("fencegate", String::as_str);
    let path = PathBuf::from(path);
    let start = Instant::now();
    let maxima = (0..n).map(|i| (format!("account:{i}"), token));
    match EmbeddedStore::prefill(&path, prefix, maxima, 100_000) {
        Ok(raised) => {
            let bytes = std::fs::metadata(&path).map_or(0, |m| m.len());
            println!(
                "RESULT resources={n} raised={raised} seconds={:.1} db_bytes={bytes}",
                start.elapsed().as_secs_f64()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("fill_embedded: {e}");
            ExitCode::from(1)
        }
    }
}
