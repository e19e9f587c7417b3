//! Kubernetes fixtures for e2e tests: the CRD, namespaces, webhook configurations, Deployments
//! and policies, plus an async polling helper.

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use spiffe_registrar::policy::SpiffeRegistration;
use std::future::Future;
use std::time::{Duration, Instant};

pub const OPT_IN_KEY: &str = "spiffe.io/registrar";

/// Polls `check` every 200 ms until it yields `Some`, panicking after `timeout`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Applies the committed CRD (server-side apply, so every test binary may call it) and waits
/// until it is established.
pub async fn install_crd(client: &Client) {
    let yaml = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/manifests/base/crd.yaml"
    ))
    .expect("manifests/base/crd.yaml must exist");
    let crd: CustomResourceDefinition =
        serde_norway::from_str(&yaml).expect("the CRD YAML must parse");
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let name = crd.metadata.name.clone().expect("the CRD has a name");
    api.patch(
        &name,
        &PatchParams::apply("e2e-tests").force(),
        &Patch::Apply(&crd),
    )
    .await
    .expect("applying the CRD must succeed");
    eventually("the CRD to be established", Duration::from_secs(30), || {
        let api = api.clone();
        let name = name.clone();
        async move {
            let crd = api.get(&name).await.ok()?;
            let established = crd
                .status?
                .conditions?
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True");
            established.then_some(())
        }
    })
    .await;
    // Discovery for the new group can lag a moment behind Established.
    let policies: Api<SpiffeRegistration> = Api::all(client.clone());
    eventually("the CRD to be served", Duration::from_secs(30), || {
        let policies = policies.clone();
        async move { policies.list(&Default::default()).await.ok().map(|_| ()) }
    })
    .await;
}

pub async fn create_namespace(client: &Client, name: &str, opted_in: bool) {
    create_namespace_with(client, name, opted_in, &[]).await
}

pub async fn create_namespace_with(
    client: &Client,
    name: &str,
    opted_in: bool,
    extra: &[(&str, &str)],
) {
    let mut labels = if opted_in {
        json!({ OPT_IN_KEY: "enabled" })
    } else {
        json!({})
    };
    for (key, value) in extra {
        labels[*key] = (*value).into();
    }
    let ns: Namespace =
        serde_json::from_value(json!({ "metadata": { "name": name, "labels": labels } }))
            .expect("namespace");
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("namespace create");
}

/// A webhook configuration pointing at 127.0.0.1:`port`, without a caBundle (the registrar
/// injects it). `failurePolicy: Fail` so a test sees every webhook failure instead of a
/// silently skipped mutation (production uses Ignore).
pub async fn create_webhook_configuration(client: &Client, name: &str, port: u16) {
    create_webhook_configuration_excluding(client, name, port, None).await
}

/// As `create_webhook_configuration`, but namespaces carrying label `exclude` are not sent to
/// the webhook: for them the webhook is as good as absent.
pub async fn create_webhook_configuration_excluding(
    client: &Client,
    name: &str,
    port: u16,
    exclude: Option<&str>,
) {
    create_webhook_configuration_full(client, name, port, exclude, None).await
}

/// As `create_webhook_configuration`, but requests by `username` are not sent to the webhook
/// (the manifests' `matchConditions` for the registrar's own patches).
pub async fn create_webhook_configuration_skipping(
    client: &Client,
    name: &str,
    port: u16,
    username: &str,
) {
    create_webhook_configuration_full(client, name, port, None, Some(username)).await
}

/// One webhook per replica: namespaces labelled `e2e/replica=<label>` are sent to that
/// replica's port (so every replica's certificate is used by the apiserver). Fails closed.
pub async fn create_webhook_configuration_per_replica(
    client: &Client,
    name: &str,
    replicas: &[(&str, u16)],
) {
    let webhooks: Vec<serde_json::Value> = replicas
        .iter()
        .map(|(label, port)| {
            json!({
                "name": format!("{label}.workloads.registrar.spiffe.io"),
                "clientConfig": { "url": format!("https://127.0.0.1:{port}/mutate") },
                "rules": workload_rules(),
                "namespaceSelector": { "matchLabels": { OPT_IN_KEY: "enabled", "e2e/replica": label } },
                "matchConditions": [relevant_update_condition()],
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 5
            })
        })
        .collect();
    let config: MutatingWebhookConfiguration =
        serde_json::from_value(json!({ "metadata": { "name": name }, "webhooks": webhooks }))
            .expect("webhook configuration");
    Api::<MutatingWebhookConfiguration>::all(client.clone())
        .create(&PostParams::default(), &config)
        .await
        .expect("webhook configuration create");
}

/// The manifests' rules: every built-in workload kind.
fn workload_rules() -> serde_json::Value {
    json!([
        { "apiGroups": ["apps"], "apiVersions": ["v1"], "resources": ["deployments", "statefulsets", "daemonsets"], "operations": ["CREATE", "UPDATE"] },
        { "apiGroups": ["batch"], "apiVersions": ["v1"], "resources": ["jobs", "cronjobs"], "operations": ["CREATE", "UPDATE"] },
    ])
}

/// The manifests' condition that keeps UPDATEs the webhook need not see from reaching it.
fn relevant_update_condition() -> serde_json::Value {
    use spiffe_registrar::webhook::{RELEVANT_UPDATE_CONDITION, RELEVANT_UPDATE_CONDITION_NAME};
    json!({ "name": RELEVANT_UPDATE_CONDITION_NAME, "expression": RELEVANT_UPDATE_CONDITION })
}

async fn create_webhook_configuration_full(
    client: &Client,
    name: &str,
    port: u16,
    exclude: Option<&str>,
    skip_user: Option<&str>,
) {
    let mut selector = json!({ "matchLabels": { OPT_IN_KEY: "enabled" } });
    if let Some(label) = exclude {
        selector["matchExpressions"] = json!([{ "key": label, "operator": "DoesNotExist" }]);
    }
    let match_conditions: Vec<serde_json::Value> = skip_user
        .map(|user| {
            json!({ "name": "not-the-registrar", "expression": format!("request.userInfo.username != '{user}'") })
        })
        .into_iter()
        .chain([relevant_update_condition()])
        .collect();
    let config: MutatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": { "name": name },
        "webhooks": [{
            "name": "workloads.registrar.spiffe.io",
            "clientConfig": { "url": format!("https://127.0.0.1:{port}/mutate") },
            "rules": workload_rules(),
            "namespaceSelector": selector,
            "matchConditions": match_conditions,
            "failurePolicy": "Fail",
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "timeoutSeconds": 5
        }]
    }))
    .expect("webhook configuration");
    Api::<MutatingWebhookConfiguration>::all(client.clone())
        .create(&PostParams::default(), &config)
        .await
        .expect("webhook configuration create");
}

pub fn deployment(name: &str, service_account: Option<&str>) -> Deployment {
    let mut pod = json!({ "containers": [{ "name": "app", "image": "registry.invalid/app:1" }] });
    if let Some(sa) = service_account {
        pod["serviceAccountName"] = sa.into();
    }
    serde_json::from_value(json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": { "name": name, "labels": { "app": name } },
        "spec": {
            "replicas": 1,
            "selector": { "matchLabels": { "app": name } },
            "template": { "metadata": { "labels": { "app": name } }, "spec": pod }
        }
    }))
    .expect("deployment JSON")
}

pub fn policy(name: &str, spec: serde_json::Value) -> SpiffeRegistration {
    serde_json::from_value(json!({
        "apiVersion": "registrar.spiffe.io/v1alpha1",
        "kind": "SpiffeRegistration",
        "metadata": { "name": name },
        "spec": spec
    }))
    .expect("policy JSON")
}

/// The value of annotation `key` on a Deployment.
pub fn annotation<'a>(d: &'a Deployment, key: &str) -> Option<&'a str> {
    d.metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

/// Whether the Deployment carries our finalizer.
pub fn has_finalizer(d: &Deployment) -> bool {
    d.metadata
        .finalizers
        .iter()
        .flatten()
        .any(|f| f == spiffe_registrar::names::FINALIZER)
}

/// A kubeconfig for `url` authenticating with a bearer `token` (e.g. a ServiceAccount's).
pub fn token_kubeconfig(url: &str, ca_pem: &str, token: &str) -> String {
    use base64::Engine;
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {url}\n    certificate-authority-data: {ca}\n\
         users:\n- name: registrar\n  user:\n    token: {token}\ncontexts:\n- name: test\n  context:\n    cluster: test\n    user: registrar\n\
         current-context: test\n"
    )
}
