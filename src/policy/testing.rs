//! `mk_*` builders for unit tests across the crate.

use super::crd::{SpiffeRegistration, SpiffeRegistrationSpec};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// The ownership unit tests name entries with (cluster `test`).
pub fn ownership() -> crate::spire::Ownership {
    crate::spire::Ownership::new("test").expect("valid cluster name")
}

/// A valid policy spec: example.org, parent `spiffe://example.org/k8s/nodes`, 1h TTL.
pub fn mk_spec() -> SpiffeRegistrationSpec {
    SpiffeRegistrationSpec {
        trust_domain: "example.org".into(),
        parent_id: Some("spiffe://example.org/k8s/nodes".into()),
        ttl: Some("1h".into()),
        jwt_ttl: None,
        namespace_selector: None,
        workload_selector: None,
        deployment_selector: None,
        kinds: Vec::new(),
        priority: None,
        spiffe_id_template: None,
        dns_names: vec![],
        federates_with: vec![],
    }
}

/// A valid policy named `name`, created `created` seconds after the epoch, edited by `edit`.
pub fn mk_policy(
    name: &str,
    created: i64,
    edit: impl FnOnce(&mut SpiffeRegistrationSpec),
) -> SpiffeRegistration {
    let mut spec = mk_spec();
    edit(&mut spec);
    let mut policy = SpiffeRegistration::new(name, spec);
    policy.metadata.creation_timestamp = Some(Time(
        k8s_openapi::jiff::Timestamp::from_second(created).expect("valid timestamp"),
    ));
    policy.metadata.generation = Some(1);
    policy.metadata.uid = Some(format!("uid-{name}"));
    policy
}

/// A Deployment in `namespace` running as `service_account` (unset when `None`).
pub fn mk_deployment(
    namespace: &str,
    name: &str,
    service_account: Option<&str>,
    labels: &[(&str, &str)],
) -> Deployment {
    let labels: serde_json::Map<String, serde_json::Value> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), serde_json::Value::from(*v)))
        .collect();
    let mut pod_spec = serde_json::json!({ "containers": [{ "name": "app", "image": "app:1" }] });
    if let Some(sa) = service_account {
        pod_spec["serviceAccountName"] = sa.into();
    }
    serde_json::from_value(serde_json::json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": labels,
            "uid": format!("uid-{namespace}-{name}")
        },
        "spec": {
            "selector": { "matchLabels": { "app": name } },
            "template": { "metadata": { "labels": { "app": name } }, "spec": pod_spec }
        }
    }))
    .expect("deployment JSON must match the type")
}

/// `mk_deployment` as the Deployment watch decodes it, at `resource_version`.
pub fn mk_watched(
    namespace: &str,
    name: &str,
    service_account: &str,
    resource_version: &str,
) -> crate::index::workload::WatchedWorkload {
    let mut d = mk_deployment(namespace, name, Some(service_account), &[("app", name)]);
    d.metadata.resource_version = Some(resource_version.into());
    serde_json::from_value(serde_json::to_value(d).expect("serializes")).expect("decodes")
}

/// `deployment` as the cache holds it.
pub fn recorded(deployment: Deployment) -> std::sync::Arc<crate::index::WorkloadRecord> {
    std::sync::Arc::new(crate::index::WorkloadRecord::from(&deployment))
}

/// An entry of ours for service account `sa` in namespace `a` under parent `spiffe://td/p`.
pub fn mk_entry(ownership: &crate::spire::Ownership, sa: &str, ttl: i32) -> crate::spire::Entry {
    use crate::spire::{Entry, Selector};
    let selectors = vec![
        Selector::new("k8s", "ns:a"),
        Selector::new("k8s", format!("sa:{sa}")),
    ];
    let spiffe_id = format!("spiffe://td/ns/a/sa/{sa}");
    Entry {
        id: ownership.entry_id(&spiffe_id, "spiffe://td/p", &selectors),
        spiffe_id,
        parent_id: "spiffe://td/p".into(),
        selectors,
        x509_svid_ttl: ttl,
        hint: ownership.hint().into(),
        ..Entry::default()
    }
    .normalize()
}

/// A selector matching these labels exactly.
pub fn mk_selector(labels: &[(&str, &str)]) -> super::crd::PolicySelector {
    super::crd::PolicySelector {
        match_labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        match_expressions: Vec::new(),
    }
}
