//! The webhook's HTTP handler in-process: captured AdmissionReview fixtures posted to the axum
//! router, answers decoded and their patches applied. No network, no cluster.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use base64::Engine;
use serde_json::{Value, json};
use spiffe_registrar::index::PolicyView;
use spiffe_registrar::keys::WorkloadKind;
use spiffe_registrar::names::{FINALIZER, SPIFFE_ID_ANNOTATION};
use spiffe_registrar::policy::{OptIn, SpiffeRegistration};
use spiffe_registrar::spire::Ownership;
use spiffe_registrar::webhook::metrics::WebhookMetrics;
use spiffe_registrar::webhook::{WebhookState, router};
use std::collections::BTreeMap;
use std::sync::Arc;
use tower::ServiceExt;

const FIXTURE: &str = include_str!("fixtures/create-deployment.json");

struct FixedView {
    opt_in: OptIn,
    ownership: Ownership,
    namespaces: BTreeMap<String, BTreeMap<String, String>>,
    policies: Vec<Arc<SpiffeRegistration>>,
    /// The kinds the webhook told the watches to expect, in order.
    admitted: std::sync::Mutex<Vec<WorkloadKind>>,
}

impl PolicyView for FixedView {
    fn opt_in(&self) -> &OptIn {
        &self.opt_in
    }
    fn ownership(&self) -> &Ownership {
        &self.ownership
    }
    fn registers(&self, _: WorkloadKind) -> bool {
        true
    }
    fn sibling_labels(
        &self,
        _: &str,
        _: &str,
        _: (WorkloadKind, &str),
    ) -> Vec<(WorkloadKind, spiffe_registrar::policy::Labels)> {
        Vec::new()
    }
    fn namespace_labels(&self, namespace: &str) -> Option<BTreeMap<String, String>> {
        self.namespaces.get(namespace).cloned()
    }
    fn policies(&self) -> Vec<Arc<SpiffeRegistration>> {
        self.policies.clone()
    }
    fn admitted(&self, kind: WorkloadKind) {
        self.admitted.lock().unwrap().push(kind);
    }
}

fn policy() -> SpiffeRegistration {
    serde_json::from_value(json!({
        "apiVersion": "registrar.spiffe.io/v1alpha1",
        "kind": "SpiffeRegistration",
        "metadata": { "name": "default", "creationTimestamp": "2026-01-01T00:00:00Z" },
        "spec": { "trustDomain": "example.org", "parentID": "spiffe://example.org/k8s/nodes", "ttl": "1h" }
    }))
    .expect("policy JSON")
}

fn view() -> Arc<dyn PolicyView> {
    fixed_view()
}

fn fixed_view() -> Arc<FixedView> {
    Arc::new(FixedView {
        opt_in: OptIn::default(),
        ownership: Ownership::new("router").expect("valid"),
        namespaces: BTreeMap::from([
            (
                "payments".to_string(),
                BTreeMap::from([("spiffe.io/registrar".to_string(), "enabled".to_string())]),
            ),
            ("plain".to_string(), BTreeMap::new()),
        ]),
        policies: vec![Arc::new(policy())],
        admitted: Default::default(),
    })
}

async fn post(body: impl Into<Body>) -> (StatusCode, Vec<u8>) {
    post_to(view(), body).await
}

async fn post_to(view: Arc<dyn PolicyView>, body: impl Into<Body>) -> (StatusCode, Vec<u8>) {
    let registry = prometheus::Registry::new();
    let app = router(WebhookState {
        view,
        metrics: WebhookMetrics::register(&registry).expect("metrics"),
        registrar_user: Some("system:serviceaccount:registrar:spiffe-registrar".into()),
    });
    let response = app
        .oneshot(
            Request::post("/mutate")
                .header("content-type", "application/json")
                .body(body.into())
                .expect("request"),
        )
        .await
        .expect("the router must answer");
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("body");
    (status, bytes.to_vec())
}

fn fixture(edit: impl FnOnce(&mut Value)) -> String {
    let mut review: Value = serde_json::from_str(FIXTURE).expect("fixture JSON");
    edit(&mut review);
    review.to_string()
}

/// Posts a review, checks the envelope, returns (response, object after applying the patch).
async fn review(body: String) -> (Value, Value) {
    let request: Value = serde_json::from_str(&body).expect("JSON");
    let (status, bytes) = post(body).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&bytes)
    );
    let answer: Value = serde_json::from_slice(&bytes).expect("answer JSON");
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(answer["kind"], "AdmissionReview");
    let response = answer["response"].clone();
    assert_eq!(
        response["uid"], request["request"]["uid"],
        "the uid is echoed"
    );
    assert_eq!(response["allowed"], true, "we never deny");
    let mut object = request["request"]["object"].clone();
    if let Some(patch) = response["patch"].as_str() {
        assert_eq!(response["patchType"], "JSONPatch");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(patch)
            .expect("patch is base64");
        let patch: json_patch::Patch =
            serde_json::from_slice(&bytes).expect("patch is a JSON Patch");
        json_patch::patch(&mut object, &patch).expect("patch applies to the object");
    }
    (response, object)
}

#[tokio::test]
async fn create_in_scope_gets_finalizer_and_policy_id() {
    let (response, object) = review(fixture(|_| {})).await;
    assert!(response.get("patch").is_some());
    assert_eq!(
        object["metadata"]["annotations"][SPIFFE_ID_ANNOTATION],
        "spiffe://example.org/ns/payments/sa/api"
    );
    assert_eq!(object["metadata"]["finalizers"], json!([FINALIZER]));
    assert_eq!(
        object["metadata"]["labels"]["app"], "web",
        "the rest is untouched"
    );
}

#[tokio::test]
async fn user_chosen_id_is_replaced_with_a_warning() {
    let body = fixture(
        |r| r["request"]["object"]["metadata"]["annotations"] = json!({ SPIFFE_ID_ANNOTATION: "spiffe://example.org/ns/kube-system/sa/admin", "team": "pay" }),
    );
    let (response, object) = review(body).await;
    assert_eq!(
        object["metadata"]["annotations"][SPIFFE_ID_ANNOTATION],
        "spiffe://example.org/ns/payments/sa/api"
    );
    assert_eq!(object["metadata"]["annotations"]["team"], "pay");
    assert!(
        response["warnings"][0]
            .as_str()
            .expect("a warning")
            .contains("kube-system")
    );
}

#[tokio::test]
async fn already_stamped_update_gets_no_patch() {
    let body = fixture(|r| {
        r["request"]["operation"] = "UPDATE".into();
        r["request"]["object"]["metadata"]["annotations"] =
            json!({ SPIFFE_ID_ANNOTATION: "spiffe://example.org/ns/payments/sa/api" });
        r["request"]["object"]["metadata"]["finalizers"] = json!([FINALIZER]);
        r["request"]["oldObject"] = r["request"]["object"].clone();
    });
    let (response, _) = review(body).await;
    assert!(response.get("patch").is_none(), "{response}");
}

#[tokio::test]
async fn objects_being_deleted_are_never_stamped() {
    let body = fixture(|r| {
        r["request"]["operation"] = "UPDATE".into();
        r["request"]["object"]["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z".into();
    });
    let (response, _) = review(body).await;
    assert!(
        response.get("patch").is_none(),
        "finalizer removal during deletion must not be undone"
    );
}

/// Every kind with a Pod template is stamped with the identity of the account its Pods run
/// as: a CronJob's is under `spec.jobTemplate.spec.template`, a configured kind's where its
/// configuration says. A Pod (bare Pods are the controller's) and a kind of another group or
/// not configured are left alone.
#[tokio::test]
async fn every_workload_kind_is_stamped_from_its_pod_template() {
    let template = |sa: &str| json!({ "metadata": { "labels": { "app": "web" } }, "spec": { "serviceAccountName": sa, "containers": [] } });
    WorkloadKind::register_custom("example.test/v1/Widget/widgets:spec.workload.podTemplate")
        .expect("valid");
    let custom =
        json!({ "template": template("decoy"), "workload": { "podTemplate": template("runner") } });
    let cases = [
        (
            "apps",
            "StatefulSet",
            json!({ "serviceName": "web", "template": template("db") }),
            Some("db"),
        ),
        (
            "apps",
            "DaemonSet",
            json!({ "template": template("agent") }),
            Some("agent"),
        ),
        (
            "batch",
            "Job",
            json!({ "template": template("batch") }),
            Some("batch"),
        ),
        (
            "batch",
            "CronJob",
            json!({ "schedule": "* * * * *", "jobTemplate": { "spec": { "template": template("cron") } } }),
            Some("cron"),
        ),
        (
            "",
            "Pod",
            json!({ "serviceAccountName": "solo", "containers": [] }),
            None,
        ),
        (
            "extensions",
            "Deployment",
            json!({ "template": template("old") }),
            None,
        ),
        // Configured (`--custom-kind`): its template at its own path, not at the decoy.
        ("example.test", "Widget", custom.clone(), Some("runner")),
        ("example.test", "Gizmo", custom, None),
    ];
    for (group, kind, spec, sa) in cases {
        let body = fixture(|r| {
            r["request"]["kind"] = json!({ "group": group, "version": "v1", "kind": kind });
            r["request"]["object"]["kind"] = kind.into();
            r["request"]["object"]["spec"] = spec;
        });
        let (response, object) = review(body).await;
        match sa {
            Some(sa) => {
                assert_eq!(
                    object["metadata"]["annotations"][SPIFFE_ID_ANNOTATION],
                    format!("spiffe://example.org/ns/payments/sa/{sa}"),
                    "{kind}"
                );
                assert_eq!(
                    object["metadata"]["finalizers"],
                    json!([FINALIZER]),
                    "{kind}"
                );
            }
            None => assert!(response.get("patch").is_none(), "{kind}: {response}"),
        }
    }
}

#[tokio::test]
async fn out_of_scope_and_other_kinds_pass_unchanged() {
    for body in [
        fixture(|r| r["request"]["namespace"] = "plain".into()),
        fixture(|r| r["request"]["namespace"] = "unknown".into()),
        fixture(|r| {
            r["request"]["kind"] = json!({ "group": "", "version": "v1", "kind": "ConfigMap" })
        }),
        fixture(|r| r["request"]["operation"] = "DELETE".into()),
    ] {
        let (response, _) = review(body).await;
        assert!(response.get("patch").is_none(), "{response}");
    }
}

/// A created or edited workload of a registered kind tells its kind's watch to stop idling (the
/// controller then sees it as soon as the apiserver stores it); deletions and other kinds do
/// not.
#[tokio::test]
async fn creates_and_updates_tell_the_watch_of_their_kind() {
    let view = fixed_view();
    let bodies = [
        fixture(|_| {}),
        fixture(|r| r["request"]["operation"] = "UPDATE".into()),
        fixture(|r| r["request"]["operation"] = "DELETE".into()),
        fixture(|r| {
            r["request"]["kind"] = json!({ "group": "", "version": "v1", "kind": "ConfigMap" })
        }),
    ];
    for body in bodies {
        let (status, _) = post_to(view.clone(), body).await;
        assert_eq!(status, StatusCode::OK);
    }
    assert_eq!(
        *view.admitted.lock().unwrap(),
        [WorkloadKind::Deployment, WorkloadKind::Deployment]
    );
}

#[tokio::test]
async fn dry_run_is_answered_the_same() {
    let (response, object) = review(fixture(|r| r["request"]["dryRun"] = true.into())).await;
    assert!(response.get("patch").is_some());
    assert_eq!(object["metadata"]["finalizers"], json!([FINALIZER]));
}

#[tokio::test]
async fn malformed_bodies_get_a_clear_400() {
    for (body, needle) in [
        ("not json".to_string(), "not JSON"),
        (json!({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}).to_string(), "admission.k8s.io/v1"),
        (json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}).to_string(), "not a valid AdmissionReview"),
        (json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": 5}}).to_string(), "not a valid"),
        (String::new(), "not JSON"),
    ] {
        let (status, bytes) = post(body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.contains(needle), "{body} → {text}");
    }
}

#[tokio::test]
async fn oversized_bodies_are_refused() {
    let (status, _) = post(vec![b' '; 5 * 1024 * 1024]).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn garbage_never_panics() {
    // A crude fuzz: truncations and byte flips of the fixture all get an answer.
    let bytes = FIXTURE.as_bytes();
    for cut in (0..bytes.len()).step_by(37) {
        let (status, _) = post(bytes[..cut].to_vec()).await;
        assert!(status == StatusCode::OK || status == StatusCode::BAD_REQUEST);
    }
    for flip in (0..bytes.len()).step_by(53) {
        let mut mutated = bytes.to_vec();
        mutated[flip] ^= 0x20;
        let (status, _) = post(mutated).await;
        assert!(status == StatusCode::OK || status == StatusCode::BAD_REQUEST);
    }
}
