//! The chart's alert rules and Grafana dashboard name only metrics that fencegate exports, so
//! renaming a metric cannot break them silently.

use std::collections::BTreeSet;
use std::path::Path;

use crate::common::*;
use crate::process::Process;

const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/fencegate");

/// The `fencegate_*` names in `text`, a histogram's `_bucket`, `_sum` and `_count` as the
/// histogram itself.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut at = 0;
    while let Some(found) = text[at..].find("fencegate_") {
        let start = at + found;
        let before = start.checked_sub(1).map(|i| bytes[i]);
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_lowercase() || bytes[end] == b'_') {
            end += 1;
        }
        // Not part of a longer word (a label value such as `app_fencegate_x`).
        if !before.is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_') {
            names.insert(text[start..end].to_owned());
        }
        at = end;
    }
    names
}

fn exported(scrape: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in scrape.lines().filter(|l| !l.starts_with('#')) {
        let name = line.split(['{', ' ']).next().unwrap_or("");
        names.insert(name.to_owned());
        for suffix in ["_bucket", "_sum", "_count"] {
            if let Some(base) = name.strip_suffix(suffix) {
                names.insert(base.to_owned());
            }
        }
    }
    names
}

/// The alert rules' expressions: the template's `expr:` blocks (Helm directives inside them
/// are only thresholds).
fn alert_exprs(rules: &str) -> String {
    let mut exprs = String::new();
    let mut inside = false;
    for line in rules.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("expr:") {
            inside = true;
            exprs.push_str(trimmed);
            exprs.push('\n');
            continue;
        }
        if inside && (trimmed.starts_with("labels:") || trimmed.starts_with("- alert:")) {
            inside = false;
        }
        if inside {
            exprs.push_str(line);
            exprs.push('\n');
        }
    }
    exprs
}

#[tokio::test]
async fn alert_rules_and_the_dashboard_name_only_exported_metrics() {
    let chart = Path::new(CHART);
    let rules = std::fs::read_to_string(chart.join("templates/prometheusrule.yaml")).unwrap();
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(chart.join("files/dashboard.json")).unwrap())
            .expect("the dashboard is JSON");
    // Every panel's queries and the variables' queries.
    let mut queries = String::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            queries.push_str(target["expr"].as_str().unwrap());
            queries.push('\n');
        }
    }
    for variable in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(q) = variable["definition"].as_str() {
            queries.push_str(q);
            queries.push('\n');
        }
    }
    let exprs = alert_exprs(&rules);
    assert_eq!(
        exprs.matches("expr:").count(),
        rules.matches("- alert:").count()
    );
    let referenced: BTreeSet<String> = metric_names(&exprs)
        .into_iter()
        .chain(metric_names(&queries))
        .collect();
    assert!(referenced.len() >= 10, "{referenced:?}");

    // A store that cannot be reached and an upstream that is not there: the requests, the
    // store's errors and the upstream's failures all have series.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fencegate.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://127.0.0.1:9\nstore: {{ kind: redis, url: 'redis://127.0.0.1:9/' }}\ntimeouts: {{ store: 1s }}\n{ACCOUNTS}"
        ),
    )
    .unwrap();
    let p = Process::start(&config).await;
    let read = send("GET", &format!("http://{}/accounts/1", p.proxy), &[], "").await;
    assert_eq!(read.status, 502);
    let write = send(
        "PUT",
        &format!("http://{}/accounts/1", p.proxy),
        &[("fencing-token", "1")],
        "w",
    )
    .await;
    assert_eq!(write.status, 503);
    let scrape = send("GET", &format!("http://{}/metrics", p.admin), &[], "")
        .await
        .text();
    let exported = exported(&scrape);
    let missing: Vec<&String> = referenced.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "named by the alert rules or the dashboard but not exported: {missing:?}\n{scrape}"
    );
}
