//! Deployments shaped as the apiserver sends them in a realistic cluster, for the in-process
//! measurements (`tests/memory_budget.rs`, the `event-cpu` benchmark).

use serde_json::{Value, json};
use spiffe_registrar::keys::SaKey;
use spiffe_registrar::names::{ENTRY_ID_ANNOTATION, FINALIZER, SPIFFE_ID_ANNOTATION};
use spiffe_registrar::spire::Ownership;

/// A Deployment as the apiserver sends it: `kubectl apply`'s ~4 KB of
/// last-applied-configuration, managed fields and status (the scale benchmark's shape), and,
/// once `registered`, our annotations and finalizer.
pub fn deployment_json(
    i: usize,
    namespaces: usize,
    ownership: &Ownership,
    registered: bool,
) -> Vec<u8> {
    let namespace = format!("scale-{}", (i / 2) % namespaces);
    let (name, account) = (format!("d{i}"), format!("sa{}", i / 2));
    let env: Vec<Value> = (0..40)
        .map(|k| json!({ "name": format!("SETTING_{k:02}"), "value": format!("value-{k:02}-{}", "x".repeat(48)) }))
        .collect();
    let spec = json!({
        "replicas": 1,
        "selector": { "matchLabels": { "app": name } },
        "template": {
            "metadata": { "labels": { "app": name, "tier": "backend" } },
            "spec": { "serviceAccountName": account, "containers": [{ "name": "app", "image": "registry.invalid/app:1", "env": env }] }
        }
    });
    let applied = json!({ "apiVersion": "apps/v1", "kind": "Deployment", "metadata": { "name": name, "namespace": namespace }, "spec": spec });
    let spiffe_id = format!("spiffe://example.org/ns/{namespace}/sa/{account}");
    let entry_id = ownership.entry_id(
        &spiffe_id,
        "spiffe://example.org/k8s/scale",
        &SaKey {
            namespace: namespace.as_str().into(),
            service_account: account.as_str().into(),
        }
        .selectors(),
    );
    let mut annotations = json!({
        "kubectl.kubernetes.io/last-applied-configuration": applied.to_string(),
        "deployment.kubernetes.io/revision": "1",
    });
    let mut finalizers = json!([]);
    if registered {
        annotations[SPIFFE_ID_ANNOTATION] = json!(spiffe_id);
        annotations[ENTRY_ID_ANNOTATION] = json!(entry_id);
        finalizers = json!([FINALIZER]);
    }
    serde_json::to_vec(&json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": format!("0b7e6f0c-3d2a-4c55-9a51-{:012x}", i),
            "resourceVersion": format!("{}", 100_000 + i),
            "generation": 2,
            "creationTimestamp": "2026-12-01T10:00:00Z",
            "labels": { "app": name, "tier": "backend" },
            "annotations": annotations,
            "finalizers": finalizers,
            "managedFields": [{ "manager": "kubectl-client-side-apply", "operation": "Update", "apiVersion": "apps/v1", "fieldsType": "FieldsV1", "fieldsV1": { "f:spec": { "f:replicas": {}, "f:template": { "f:spec": { "f:containers": {} } } } } }],
        },
        "spec": spec,
        "status": { "observedGeneration": 2, "replicas": 1, "updatedReplicas": 1, "unavailableReplicas": 1, "conditions": [{ "type": "Available", "status": "False", "reason": "MinimumReplicasUnavailable" }] }
    }))
    .expect("serializes")
}
