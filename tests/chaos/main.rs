//! Proof under faults: real fencegate processes, a ledger, leases and injected faults, and a
//! checker over the recorded history.
//!
//! `cargo test --test chaos` runs, in order:
//! 1. the checker's own tests: each invariant fires on a hand-made bad history;
//! 2. the fenced scenario for `FENCEGATE_CHAOS_SECS` seconds of fault injection (default
//!    35, at least three rounds of every fault kind: about three minutes with the failovers),
//!    which must show no violation. The clock-step fault needs libfaketime, the slow-disk
//!    fault a C compiler (`cc`); each is skipped without.
//!    The partition fault needs root, `ip` and `nft`; without them it
//!    is reported as `SKIPPED partition fault: <reason>` and the other faults run. The
//!    failover faults need `redis-server` (Sentinel), PostgreSQL's server binaries and
//!    `etcd`/`etcdctl`; a topology that cannot start is reported as `SKIPPED <fault> fault`;
//! 3. the negative control: workers bypass the fence and write straight to the ledger, one
//!    of them frozen past its TTL, one write slower than its writer's patience (retried with
//!    its key), and a sidecar killed without its drain; the checker must report violations of
//!    all six invariants.
//!
//! `FENCEGATE_CHAOS_NAIVE=1` runs only the checker tests and the negative control.
//! There is no libtest harness (`harness = false`): a name filter that matches none of this
//! binary's tests (as `cargo test hostile` passes to every test binary) runs nothing.

mod checker;
mod clock;
mod ledger;
mod netns;
mod procs;
mod record;
mod relay;
mod replicated;
mod scenario;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use checker::{tally, Invariant};
use scenario::{percentile, Fault, Mode, Outcome};

const FENCED: &str = "chaos::fenced_run_shows_no_violation";
const NAIVE: &str = "chaos::naive_run_is_caught_by_the_checker";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let names: Vec<&str> = checker::self_tests()
        .iter()
        .map(|(n, _)| *n)
        .chain([FENCED, NAIVE])
        .collect();
    if args.iter().any(|a| a == "--list") {
        for n in &names {
            println!("{n}: test");
        }
        return;
    }
    // libtest options that take a value in the next argument: not filters.
    const VALUED: [&str; 7] = [
        "--skip",
        "--format",
        "--test-threads",
        "--color",
        "--logfile",
        "--shuffle-seed",
        "-Z",
    ];
    let mut filters: Vec<&String> = Vec::new();
    let mut skip: Vec<&String> = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        if VALUED.contains(&a.as_str()) {
            if a == "--skip" {
                skip.extend(args.get(i + 1));
            }
            i += 2;
            continue;
        }
        if !a.starts_with('-') {
            filters.push(a);
        }
        i += 1;
    }
    let exact = args.iter().any(|a| a == "--exact");
    let selected = |name: &str| {
        let matches = |f: &&String| {
            if exact {
                name == f.as_str()
            } else {
                name.contains(f.as_str())
            }
        };
        !skip.iter().any(|s| name.contains(s.as_str()))
            && (filters.is_empty() || filters.iter().any(matches))
    };
    if args.iter().any(|a| a == "--ignored") {
        // Nothing here is ignored.
        println!("\nrunning 0 tests\n\ntest result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s\n");
        return;
    }
    let started = Instant::now();
    let naive_only = std::env::var("FENCEGATE_CHAOS_NAIVE").is_ok_and(|v| v == "1");
    let secs = std::env::var("FENCEGATE_CHAOS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(35u64);
    let run_fenced = selected(FENCED) && !naive_only;
    let run_naive = selected(NAIVE);
    let self_tests: Vec<_> = checker::self_tests()
        .into_iter()
        .filter(|(n, _)| selected(n))
        .collect();
    let planned = self_tests.len() + usize::from(run_fenced) + usize::from(run_naive);
    let filtered_out = names.len() - planned;
    println!("\nrunning {planned} tests");
    let (mut passed, mut failed) = (0, 0);
    for (name, result) in self_tests {
        match result {
            Ok(()) => {
                println!("test {name} ... ok");
                passed += 1;
            }
            Err(e) => {
                println!("test {name} ... FAILED\n    {e}");
                failed += 1;
            }
        }
    }
    if run_fenced || run_naive {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        if run_fenced {
            println!("\n== fenced scenario: {secs}s of faults (FENCEGATE_CHAOS_SECS)");
            let outcome = runtime.block_on(scenario::run(Mode::Fenced, secs));
            report(&outcome);
            let counts = tally(&outcome.violations);
            let total: usize = counts.iter().map(|(_, n)| n).sum();
            let evidence_ok = outcome.evidence.iter().all(|(_, ok, all)| ok == all);
            // Every fault kind this machine can inject (a skipped one says why, above).
            let enough = Fault::ALL
                .iter()
                .filter(|f| !outcome.skipped.iter().any(|(s, _)| s == *f))
                .all(|f| outcome.faults.iter().filter(|i| i.fault == *f).count() >= 3);
            if total == 0 && evidence_ok && enough {
                println!("test {FENCED} ... ok");
                passed += 1;
            } else {
                println!(
                    "test {FENCED} ... FAILED (violations {total}, evidence ok {evidence_ok}, every fault 3+ times {enough})"
                );
                failed += 1;
            }
        }
        if run_naive {
            println!("\n== negative control: fence bypassed, workers write straight to the ledger");
            let outcome = runtime.block_on(scenario::run(Mode::Naive, 0));
            report(&outcome);
            let counts = tally(&outcome.violations);
            if counts.iter().all(|&(_, n)| n > 0) {
                println!("  every invariant fired, as it must without the fence");
                println!("test {NAIVE} ... ok");
                passed += 1;
            } else {
                println!("test {NAIVE} ... FAILED: the checker missed violations: {counts:?}");
                failed += 1;
            }
        }
        runtime.shutdown_timeout(Duration::from_secs(5));
    }
    println!(
        "\ntest result: {}. {passed} passed; {failed} failed; 0 ignored; 0 measured; {filtered_out} filtered out; finished in {:.2}s\n",
        if failed == 0 { "ok" } else { "FAILED" },
        started.elapsed().as_secs_f64()
    );
    if failed > 0 {
        std::process::exit(101);
    }
}

fn report(o: &Outcome) {
    let mode = match o.mode {
        Mode::Fenced => "fenced",
        Mode::Naive => "naive",
    };
    println!("  -- {mode} run: {:.1}s", o.ran_for.as_secs_f64());
    let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
    for op in &o.ops {
        let key = match (&op.status, &op.problem) {
            (0, _) => "no answer".to_owned(),
            (s, Some(p)) => format!("{s} {}", p.trim_start_matches("urn:fencegate:")),
            (s, None) => s.to_string(),
        };
        *statuses.entry(key).or_default() += 1;
    }
    println!(
        "  operations: {} writes sent, {} committed by the ledger, {} lease grants",
        o.ops.len(),
        o.commits,
        o.grants
    );
    for (k, n) in &statuses {
        println!("    {k:<40} {n}");
    }
    let h = &o.history;
    println!(
        "  history: {} records ({} commits, {} admissions, {} holds, {} responses, {} exits)",
        h.commits.len() + h.admissions.len() + h.holds.len() + h.responses.len() + h.exits.len(),
        h.commits.len(),
        h.admissions.len(),
        h.holds.len(),
        h.responses.len(),
        h.exits.len()
    );
    let late_commits = o
        .ops
        .iter()
        .filter(|op| op.status == 504 && o.history.commits.iter().any(|c| c.op == op.op))
        .count();
    if late_commits > 0 {
        println!("    answered 504 yet committed later by the ledger: {late_commits}");
    }
    for (f, reason) in &o.skipped {
        println!(
            "  SKIPPED {} fault: {reason}",
            format!("{f:?}").to_lowercase()
        );
    }
    if !o.faults.is_empty() {
        println!("  faults injected (count, recovery = fault end -> next successful write: min / median / max;");
        println!("  a failover ends at its kill and lasts until the promotion, or a new leader):");
        for f in Fault::ALL {
            let of: Vec<_> = o.faults.iter().filter(|i| i.fault == f).collect();
            if of.is_empty() {
                continue;
            }
            let rec: Vec<Duration> = of.iter().filter_map(|i| i.recovery).collect();
            let dur: Vec<Duration> = of.iter().map(|i| i.duration).collect();
            let ms = |d: Option<Duration>| d.map_or("-".into(), |d| format!("{}ms", d.as_millis()));
            println!(
                "    {:<16} {:>3}  recovery {} / {} / {}  (fault lasted median {}; {} without recovery)  {}",
                format!("{f:?}"),
                of.len(),
                ms(percentile(rec.clone(), 0.0)),
                ms(percentile(rec.clone(), 0.5)),
                ms(percentile(rec.clone(), 1.0)),
                ms(percentile(dur, 0.5)),
                of.len() - rec.len(),
                f.describe()
            );
        }
    }
    let keys: std::collections::HashSet<(&str, &str)> = o
        .history
        .commits
        .iter()
        .filter_map(|c| c.key.as_deref().map(|k| (c.resource.as_str(), k)))
        .collect();
    let keyed = o.history.commits.iter().filter(|c| c.key.is_some()).count();
    println!(
        "  idempotency keys: {} applied, {} applications ({} beyond the first; see (e))",
        keys.len(),
        keyed,
        keyed - keys.len()
    );
    for e in &o.history.exits {
        println!(
            "  stopped sidecar {} ({}): backend held {:?} after its exit",
            e.holder, e.how, e.held
        );
    }
    for (what, ok, all) in &o.evidence {
        println!("  check: {what}: {ok}/{all}");
    }
    println!("  violations:");
    for (inv, n) in tally(&o.violations) {
        println!("    {:<52} {n}", inv.label());
    }
    for inv in Invariant::ALL {
        for v in o.violations.iter().filter(|v| v.invariant == inv).take(3) {
            println!("      e.g. {v}");
        }
    }
}
