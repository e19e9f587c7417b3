//! The dashboard and alerts in `manifests/monitoring` are proven, not assumed: every metric a
//! panel or an alert queries is one the binary exports (or one of the few named apiserver
//! metrics), every alert has a runbook in docs/operations.md, and the rules pass `promtool check rules`
//! (promtool built by `tests/testenv/build.sh`).

mod common;

use serde_json::Value;
use spiffe_registrar::controller::metrics::ControllerMetrics;
use spiffe_registrar::spire::metrics::SpireMetrics;
use spiffe_registrar::telemetry::{self, heap::HeapCollector};
use spiffe_registrar::webhook::metrics::WebhookMetrics;
use std::collections::BTreeSet;

const MONITORING: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/manifests/monitoring");
const OPERATIONS: &str = include_str!("../docs/operations.md");

/// Metrics queried that the registrar does not export, each with why it is needed.
const FOREIGN_METRICS: &[&str] = &[
    // kube-apiserver: admissions let through because the webhook did not answer.
    "apiserver_admission_webhook_fail_open_count",
];

/// PromQL keywords that open a list of label names.
const GROUPING_KEYWORDS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// Other PromQL words that are not metric names.
const PROMQL_WORDS: &[&str] = &["and", "or", "unless", "bool", "offset", "inf", "nan"];

/// The metric names in a PromQL expression: identifiers outside strings, label matchers,
/// ranges and grouping lists that are not functions or keywords.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut plain = String::new();
    let mut depth_braces = 0;
    let mut depth_brackets = 0;
    let mut in_string = false;
    for c in expr.chars() {
        match c {
            '"' => in_string = !in_string,
            _ if in_string => {}
            '{' => depth_braces += 1,
            '}' => depth_braces -= 1,
            '[' => depth_brackets += 1,
            ']' => depth_brackets -= 1,
            _ if depth_braces > 0 || depth_brackets > 0 => {}
            _ => {
                plain.push(c);
                continue;
            }
        }
        plain.push(' ');
    }
    // Grouping lists name labels, not metrics.
    let grouping = blank_groupings(&plain);
    let mut names = BTreeSet::new();
    let chars: Vec<char> = grouping.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if chars[i].is_ascii_alphabetic() || chars[i] == '_' || chars[i] == ':' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
            {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let next = chars[i..].iter().find(|c| !c.is_whitespace());
            let is_function = next == Some(&'(');
            let is_number_suffix = start > 0 && chars[start - 1].is_ascii_digit();
            if !is_function
                && !is_number_suffix
                && !PROMQL_WORDS.contains(&word.as_str())
                && !GROUPING_KEYWORDS.contains(&word.as_str())
            {
                names.insert(word);
            }
        } else {
            i += 1;
        }
    }
    names
}

/// Blanks `by (...)`-style lists, keyword included, so that `sum by (le) (x)` reads as the
/// function call `sum (x)`.
fn blank_groupings(text: &str) -> String {
    let mut out = text.to_string();
    for keyword in GROUPING_KEYWORDS {
        let mut from = 0;
        while let Some(found) = out[from..].find(keyword) {
            let at = from + found;
            let before_ok = at == 0 || !out.as_bytes()[at - 1].is_ascii_alphanumeric();
            let rest = &out[at + keyword.len()..];
            let open = rest.len() - rest.trim_start().len();
            if before_ok && rest.trim_start().starts_with('(') {
                let start = at + keyword.len() + open;
                let end = start + out[start..].find(')').expect("balanced grouping");
                out.replace_range(at..=end, &" ".repeat(end - at + 1));
            }
            from = at + keyword.len();
        }
    }
    out
}

/// The series name a query reads, without the histogram suffixes.
fn family(name: &str) -> &str {
    ["_bucket", "_count", "_sum"]
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix))
        .unwrap_or(name)
}

fn rules() -> Value {
    let text = std::fs::read_to_string(format!("{MONITORING}/prometheusrule.yaml"))
        .expect("manifests/monitoring/prometheusrule.yaml");
    serde_norway::from_str(&text).expect("the PrometheusRule is YAML")
}

fn alert_rules() -> Vec<Value> {
    rules()["spec"]["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|group| group["rules"].as_array().expect("rules").clone())
        .collect()
}

fn alert_exprs() -> Vec<(String, String)> {
    alert_rules()
        .iter()
        .map(|rule| {
            (
                rule["alert"]
                    .as_str()
                    .expect("every rule is an alert")
                    .to_string(),
                rule["expr"].as_str().expect("expr").to_string(),
            )
        })
        .collect()
}

fn panel_exprs() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(format!("{MONITORING}/grafana-dashboard.json"))
        .expect("manifests/monitoring/grafana-dashboard.json");
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            exprs.push((
                panel["title"].as_str().expect("title").to_string(),
                target["expr"].as_str().expect("expr").to_string(),
            ));
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .expect("variables")
    {
        if let Some(query) = variable["query"].as_str().filter(|q| q.contains('(')) {
            let inner = query
                .trim_start_matches("label_values(")
                .split(',')
                .next()
                .expect("a metric");
            exprs.push((format!("variable {}", variable["name"]), inner.to_string()));
        }
    }
    exprs
}

#[test]
fn the_name_extraction_finds_metrics_and_only_metrics() {
    let names = metric_names(
        r#"histogram_quantile(0.99, sum by (le, op) (rate(a_bucket{code!="Ok", x=~"y(z)"}[5m]))) - time() < 7 * 86400 or absent(b) and on (ns) c offset 5m"#,
    );
    assert_eq!(
        names,
        BTreeSet::from(["a_bucket".into(), "b".into(), "c".into()])
    );
}

/// The full name of every metric the binary exports, vectors included (a vector with no
/// labelled child yet is absent from a scrape, so a scrape cannot answer this). The
/// monitoring test checks every name a dashboard panel or an alert queries against it.
fn exported_metric_names() -> Vec<String> {
    use prometheus::core::Collector;
    let registry = prometheus::Registry::new();
    let ControllerMetrics {
        registrations,
        errors,
        reconcile,
        entries,
        admission_to_registered,
        pending_deletions,
        deletion_brake,
        rejected,
        foreign,
        derive,
        syncs,
        events_dropped,
        leader,
        transitions,
        spire_reachable,
        last_success,
        drift_checks,
    } = ControllerMetrics::register(&registry).expect("a fresh registry accepts our metrics");
    let SpireMetrics {
        call_duration,
        entries: spire_entries,
    } = SpireMetrics::register(&registry).expect("likewise");
    let WebhookMetrics { requests, duration } =
        WebhookMetrics::register(&registry).expect("likewise");
    let heap = HeapCollector::new().expect("likewise");
    let collectors: Vec<&dyn Collector> = vec![
        &registrations,
        &errors,
        &reconcile,
        &entries,
        &admission_to_registered,
        &pending_deletions,
        &deletion_brake,
        &rejected,
        &foreign,
        &derive,
        &syncs,
        &events_dropped,
        &leader,
        &transitions,
        &spire_reachable,
        &last_success,
        &drift_checks,
        &call_duration,
        &spire_entries,
        &requests,
        &duration,
        &heap,
        telemetry::kube_writes(),
        telemetry::serving_cert_expiry(),
    ];
    let mut names: Vec<String> = collectors
        .iter()
        .flat_map(|collector| collector.desc())
        .map(|desc| format!("{}_{}", telemetry::METRIC_NAMESPACE, desc.fq_name))
        .collect();
    names.sort();
    names.dedup();
    names
}

#[test]
fn every_queried_metric_is_exported_by_the_binary() {
    let exported: BTreeSet<String> = exported_metric_names().into_iter().collect();
    assert!(
        exported.contains("spiffe_registrar_leader"),
        "the exported names carry the namespace: {exported:?}"
    );
    let mut queried = 0;
    for (source, expr) in alert_exprs().into_iter().chain(panel_exprs()) {
        let names = metric_names(&expr);
        assert!(!names.is_empty(), "{source}: no metric found in {expr:?}");
        for name in names {
            queried += 1;
            assert!(
                exported.contains(family(&name)) || FOREIGN_METRICS.contains(&name.as_str()),
                "{source} queries {name}, which the binary does not export (exported: {exported:?})"
            );
        }
    }
    assert!(queried > 20, "only {queried} metric references found");
}

#[test]
fn every_alert_has_a_runbook_in_the_operations_guide() {
    let rules = alert_rules();
    assert_eq!(
        rules.len(),
        10,
        "the alerts listed in docs/operations.md's runbooks"
    );
    for rule in rules {
        let alert = rule["alert"].as_str().expect("alert");
        assert!(
            OPERATIONS
                .lines()
                .any(|line| line == format!("### {alert}")),
            "docs/operations.md has no runbook heading `### {alert}`"
        );
        // GitHub's anchor for a heading of one word is the word in lower case.
        assert_eq!(
            rule["annotations"]["runbook_url"].as_str(),
            Some(format!("docs/operations.md#{}", alert.to_lowercase()).as_str()),
            "{alert}'s runbook annotation points at its heading in docs/operations.md"
        );
    }
}

/// Needs promtool from the test bed, so it belongs to the `e2e` tier.
#[cfg(feature = "e2e")]
#[test]
fn promtool_accepts_the_rules() {
    let promtool = common::paths::binary(common::paths::promtool_bin(), "promtool");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("rules.yaml");
    let spec = serde_norway::to_string(&rules()["spec"]).expect("spec as YAML");
    std::fs::write(&path, spec).expect("write rules");
    let output = std::process::Command::new(promtool)
        .args(["check", "rules"])
        .arg(&path)
        .output()
        .expect("run promtool");
    assert!(
        output.status.success(),
        "promtool check rules failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let report = String::from_utf8_lossy(&output.stdout);
    let alerts = alert_exprs().len();
    assert!(
        report.contains(&format!("SUCCESS: {alerts} rules found")),
        "promtool did not see all {alerts} alerts:\n{report}"
    );
}
