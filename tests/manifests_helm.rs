//! The Helm chart (`manifests/helm/spiffe-registrar`) is proven, not assumed: `helm lint`
//! passes for both layouts; for the same settings it renders the same objects as the kustomize
//! bases (so everything `tests/manifests.rs` proves of those, RBAC included, holds for the
//! chart); every `spiffe-registrar run` flag a user sets can be set through it; and its output
//! is accepted by a real kube-apiserver (helm built by `tests/testenv/build.sh`).

mod common;

use common::kube_plane::KubePlane;
use common::paths::{binary, helm_bin, kube_bin};
use common::process::run;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::process::Command;

const MANIFESTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/manifests");
const CHART: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/manifests/helm/spiffe-registrar"
);

/// Labels and annotations only Helm adds; everything else must match kustomize.
const HELM_ONLY_LABELS: &[&str] = &[
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
];
const HELM_ONLY_ANNOTATIONS: &[&str] = &["helm.sh/resource-policy"];

fn helm(args: &[&str]) -> String {
    let (ok, stdout, stderr) = run(Command::new(binary(helm_bin(), "helm")).args(args));
    assert!(ok, "helm {args:?} failed:\n{stdout}\n{stderr}");
    stdout
}

fn kustomize(dir: &str) -> String {
    let (ok, stdout, stderr) = run(Command::new(binary(kube_bin(), "kubectl"))
        .args(["kustomize", &format!("{MANIFESTS}/{dir}")]));
    assert!(ok, "kubectl kustomize {dir} failed:\n{stderr}");
    stdout
}

fn template(namespace: &str, sets: &[&str]) -> String {
    let mut args = vec![
        "template",
        "spiffe-registrar",
        CHART,
        "--namespace",
        namespace,
    ];
    for set in sets {
        args.extend(["--set", set]);
    }
    helm(&args)
}

/// Objects by kind/namespace/name, as JSON, with Helm's bookkeeping removed.
fn objects(yaml: &str) -> BTreeMap<String, Value> {
    let mut objects = BTreeMap::new();
    for document in serde_norway::Deserializer::from_str(yaml) {
        let mut object: Value =
            serde::Deserialize::deserialize(document).expect("rendered YAML parses");
        if object.is_null() {
            continue;
        }
        let metadata = object["metadata"].as_object_mut().expect("metadata");
        for (field, helm_only) in [
            ("labels", HELM_ONLY_LABELS),
            ("annotations", HELM_ONLY_ANNOTATIONS),
        ] {
            if let Some(map) = metadata.get_mut(field).and_then(Value::as_object_mut) {
                map.retain(|key, _| !helm_only.contains(&key.as_str()));
                if map.is_empty() {
                    metadata.remove(field);
                }
            }
        }
        let key = format!(
            "{}/{}/{}",
            object["kind"].as_str().expect("kind"),
            object["metadata"]["namespace"].as_str().unwrap_or(""),
            object["metadata"]["name"].as_str().expect("name")
        );
        assert!(
            objects.insert(key.clone(), object).is_none(),
            "{key} rendered twice"
        );
    }
    objects
}

fn assert_same_objects(chart: &str, kustomized: &str, what: &str) {
    let chart = objects(chart);
    let kustomized = objects(kustomized);
    assert_eq!(
        chart.keys().collect::<Vec<_>>(),
        kustomized.keys().collect::<Vec<_>>(),
        "{what}: the chart and kustomize render different objects"
    );
    for (key, object) in &chart {
        let pretty = |v: &Value| serde_json::to_string_pretty(v).expect("JSON");
        assert!(
            object == &kustomized[key],
            "{what}: {key} differs\n--- chart\n{}\n--- kustomize\n{}",
            pretty(object),
            pretty(&kustomized[key])
        );
    }
}

#[test]
fn helm_lint_passes_for_both_layouts() {
    helm(&["lint", "--strict", CHART]);
    helm(&[
        "lint",
        "--strict",
        CHART,
        "--set",
        "layout=sidecar",
        "--set",
        "metrics.serviceMonitor.enabled=true",
    ]);
}

#[test]
fn the_chart_renders_what_kustomize_renders() {
    assert_same_objects(
        &template("spiffe-registrar", &["createNamespace=true"]),
        &kustomize("base"),
        "agent layout vs manifests/base",
    );
    assert_same_objects(
        &template("spire", &["layout=sidecar"]),
        &kustomize("sidecar"),
        "sidecar layout vs manifests/sidecar",
    );
}

#[test]
fn settings_reach_the_container_and_the_webhook() {
    let rendered = objects(&template(
        "identity",
        &[
            "config.clusterName=prod-eu1",
            "config.previousClusterNames={old-a,old-b}",
            "config.namespaceLabel=example.com/spiffe=on",
            "config.controller=false",
            "replicas=3",
            "webhook.failurePolicy=Fail",
        ],
    ));
    let deployment = &rendered["Deployment/identity/spiffe-registrar"];
    assert_eq!(deployment["spec"]["replicas"], 3);
    let args: Vec<&str> = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("string arg"))
        .collect();
    for wanted in [
        "--cluster-name=prod-eu1",
        "--previous-cluster-name=old-a,old-b",
        "--namespace-label=example.com/spiffe=on",
        "--controller=false",
    ] {
        assert!(args.contains(&wanted), "{wanted} missing from {args:?}");
    }
    let webhook = &rendered["MutatingWebhookConfiguration//spiffe-registrar"]["webhooks"][0];
    assert_eq!(webhook["failurePolicy"], "Fail");
    assert_eq!(
        webhook["namespaceSelector"]["matchLabels"]["example.com/spiffe"],
        "on"
    );
    assert_eq!(
        webhook["matchConditions"][0]["expression"],
        "request.userInfo.username != 'system:serviceaccount:identity:spiffe-registrar'"
    );
    assert_eq!(
        webhook["matchConditions"][1],
        json!({
            "name": spiffe_registrar::webhook::RELEVANT_UPDATE_CONDITION_NAME,
            "expression": spiffe_registrar::webhook::RELEVANT_UPDATE_CONDITION,
        }),
        "the chart's webhook conditions differ from the code's"
    );
    let (ok, _, stderr) = run(Command::new(binary(helm_bin(), "helm")).args([
        "template",
        "x",
        CHART,
        "--set",
        "config.noSuchFlag=1",
    ]));
    assert!(
        !ok && stderr.contains("config.noSuchFlag is not a flag"),
        "an unknown config key must fail the render: {stderr}"
    );
}

/// Flags the chart sets from its own structure rather than from `config`.
const SET_BY_THE_CHART: &[&str] = &[
    "spire-address", // spire.address (agent layout)
    "workload-api",  // spire.workloadApi (agent layout)
    "spire-socket",  // spire.socket (sidecar layout)
    "log-json",      // logJson
    "custom-kind",   // customKinds (with the RBAC and webhook rules each needs)
    "namespace",     // POD_NAMESPACE from the downward API
    "replica-id",    // HOSTNAME from the downward API
    "webhook-addr",  // the container's webhook port
    "admin-addr",    // the container's admin port
    "tls-cert-file", // the chart uses the managed Secret; files go through extraArgs
    "tls-key-file",  //   and extraVolumes
];

/// Bare Pods cost a watch of every Pod and a grant on pods: only with `config.barePods`.
#[test]
fn bare_pods_bring_their_flag_and_their_grant_only_when_asked() {
    let pods_rule = |rendered: &BTreeMap<String, Value>| {
        rendered["ClusterRole//spiffe-registrar"]["rules"]
            .as_array()
            .expect("rules")
            .iter()
            .any(|rule| rule["resources"] == json!(["pods"]))
    };
    let args = |rendered: &BTreeMap<String, Value>| {
        rendered["Deployment/identity/spiffe-registrar"]["spec"]["template"]["spec"]["containers"]
            [0]["args"]
            .to_string()
    };
    let off = objects(&template("identity", &[]));
    assert!(!pods_rule(&off) && !args(&off).contains("--bare-pods"));
    let on = objects(&template("identity", &["config.barePods=true"]));
    assert!(pods_rule(&on), "the grant on pods");
    assert!(args(&on).contains("--bare-pods=true"), "{}", args(&on));
}

/// Two custom kinds, one with its Pod template at a path of its own.
const CUSTOM_KINDS: [&str; 9] = [
    "customKinds[0].group=argoproj.io",
    "customKinds[0].version=v1alpha1",
    "customKinds[0].kind=Rollout",
    "customKinds[0].plural=rollouts",
    "customKinds[1].group=e2e.example.test",
    "customKinds[1].version=v1",
    "customKinds[1].kind=Widget",
    "customKinds[1].plural=widgets",
    "customKinds[1].podTemplatePath=spec.workload.podTemplate",
];

/// Each custom kind brings its flag, its grants (on the resource, and on its CRD by name) and
/// a webhook rule whose matchConditions compare the service account at its template path.
#[test]
fn custom_kinds_bring_their_flags_grants_and_webhook_rules() {
    let rendered = objects(&template("identity", &CUSTOM_KINDS));
    let args =
        rendered["Deployment/identity/spiffe-registrar"]["spec"]["template"]["spec"]["containers"]
            [0]["args"]
            .to_string();
    assert!(
        args.contains("--custom-kind=argoproj.io/v1alpha1/Rollout/rollouts:spec.template"),
        "{args}"
    );
    assert!(
        args.contains("--custom-kind=e2e.example.test/v1/Widget/widgets:spec.workload.podTemplate"),
        "{args}"
    );
    let rules = rendered["ClusterRole//spiffe-registrar"]["rules"].clone();
    let rules = rules.as_array().expect("rules");
    for (group, plural) in [("argoproj.io", "rollouts"), ("e2e.example.test", "widgets")] {
        assert!(
            rules.iter().any(|r| r["apiGroups"] == json!([group])
                && r["resources"] == json!([plural])
                && r["verbs"] == json!(["get", "list", "watch", "patch"])),
            "{group}/{plural}: {rules:?}"
        );
    }
    assert!(
        rules.iter().any(|r| r["resourceNames"]
            == json!(["rollouts.argoproj.io", "widgets.e2e.example.test"])
            && r["verbs"] == json!(["get", "list", "watch"])),
        "the CRDs, by name: {rules:?}"
    );
    let webhook = &rendered["MutatingWebhookConfiguration//spiffe-registrar"]["webhooks"][0];
    assert!(
        webhook["rules"]
            .as_array()
            .expect("rules")
            .iter()
            .any(|r| r["apiGroups"] == json!(["e2e.example.test"])
                && r["resources"] == json!(["widgets"])),
        "{webhook}"
    );
    let condition = webhook["matchConditions"][1]["expression"]
        .as_str()
        .expect("expression");
    assert!(
        condition.contains("object.?spec.?workload.?podTemplate.?spec.?serviceAccountName"),
        "{condition}"
    );
    let without = objects(&template("identity", &[]));
    let without = without["ClusterRole//spiffe-registrar"]["rules"].to_string();
    assert!(
        !without.contains("argoproj.io"),
        "nothing unless configured"
    );
}

#[test]
fn every_run_flag_can_be_set_through_the_chart() {
    let (ok, help, stderr) =
        run(Command::new(env!("CARGO_BIN_EXE_spiffe-registrar")).args(["run", "--help"]));
    assert!(ok, "run --help failed: {stderr}");
    let helpers =
        std::fs::read_to_string(format!("{CHART}/templates/_helpers.tpl")).expect("_helpers.tpl");
    let values = std::fs::read_to_string(format!("{CHART}/values.yaml")).expect("values.yaml");
    let flags: Vec<&str> = help
        .lines()
        .filter_map(|line| line.trim_start().split_once("--"))
        .filter(|(before, _)| before.is_empty() || before.ends_with(", "))
        .filter_map(|(_, rest)| rest.split([' ', '=', '<']).next())
        .filter(|flag| !flag.is_empty() && *flag != "help")
        .collect();
    assert!(flags.len() > 20, "parsed only {flags:?} from run --help");
    for flag in flags {
        if SET_BY_THE_CHART.contains(&flag) {
            continue;
        }
        let mapping = helpers
            .lines()
            .find(|line| line.contains(&format!(" \"{flag}\")")))
            .unwrap_or_else(|| panic!("--{flag} cannot be set through the chart's config"));
        let key = mapping
            .split('"')
            .nth(1)
            .expect("a (list \"key\" \"flag\") mapping");
        assert!(
            values.contains(&format!("  {key}: null")),
            "config.{key} (--{flag}) is not documented in values.yaml"
        );
    }
}

#[test]
fn the_chart_version_and_crd_are_the_crate_s() {
    let chart: Value = serde_norway::from_str(
        &std::fs::read_to_string(format!("{CHART}/Chart.yaml")).expect("Chart.yaml"),
    )
    .expect("Chart.yaml parses");
    assert_eq!(chart["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(chart["appVersion"], env!("CARGO_PKG_VERSION"));
    assert_eq!(
        std::fs::read_to_string(format!("{CHART}/files/crd.yaml")).expect("chart CRD"),
        spiffe_registrar::policy::crd::yaml().expect("CRD"),
        "the chart's files/crd.yaml is stale: run `cargo run -- crd > {CHART}/files/crd.yaml`"
    );
}

#[test]
fn the_rendered_chart_is_accepted_by_a_real_apiserver() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut plane = KubePlane::start(dir.path());
    let apply = |plane: &KubePlane, rendered: &str, extra: &[&str]| {
        let path = dir.path().join("rendered.yaml");
        std::fs::write(&path, rendered).expect("write rendered chart");
        let mut kubectl = plane.kubectl();
        kubectl
            .args(["apply", "--server-side", "-f"])
            .arg(&path)
            .args(extra);
        let (ok, stdout, stderr) = run(&mut kubectl);
        assert!(ok, "the apiserver refused the chart:\n{stdout}\n{stderr}");
    };
    let kubectl_ok = |plane: &KubePlane, args: &[&str]| {
        let (ok, stdout, stderr) = run(plane.kubectl().args(args));
        assert!(ok, "kubectl {args:?} failed:\n{stdout}\n{stderr}");
        stdout
    };
    // With custom kinds: their webhook rules and matchConditions must compile too.
    let mut sets = vec!["createNamespace=true"];
    sets.extend(CUSTOM_KINDS);
    apply(&plane, &template("spiffe-registrar", &sets), &[]);
    kubectl_ok(
        &plane,
        &[
            "wait",
            "--for=condition=Established",
            "crd/spifferegistrations.registrar.spiffe.io",
            "--timeout=60s",
        ],
    );
    let webhook = kubectl_ok(
        &plane,
        &[
            "get",
            "mutatingwebhookconfiguration",
            "spiffe-registrar",
            "-o",
            "jsonpath={.webhooks[0].clientConfig.service.namespace}/{.webhooks[0].matchConditions[0].name}",
        ],
    );
    assert_eq!(webhook, "spiffe-registrar/not-the-registrar");
    let deployment = kubectl_ok(
        &plane,
        &[
            "-n",
            "spiffe-registrar",
            "get",
            "deployment",
            "spiffe-registrar",
            "-o",
            "jsonpath={.spec.template.spec.serviceAccountName}",
        ],
    );
    assert_eq!(deployment, "spiffe-registrar");
    // The sidecar layout, into spire-server's namespace, must be accepted as well.
    kubectl_ok(&plane, &["create", "namespace", "spire"]);
    apply(
        &plane,
        &template("spire", &["layout=sidecar"]),
        &["--dry-run=server", "--force-conflicts"],
    );
    plane.stop();
}
