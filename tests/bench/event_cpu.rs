//! CPU per event on the two paths a rollout drives through the registrar, in process and on
//! one thread, so the scale benchmark's `cpu_s_per_1000_status_updates` can be split:
//! - a Deployment watch event: the line decoded as kube's watcher decodes it, then applied to
//!   the Deployment store (a status-only change: compared and dropped);
//! - an admission of a Deployment UPDATE: the AdmissionReview (object and oldObject) posted to
//!   the webhook's router.
//!
//! And the decode alone of the same real watch events (tests/fixtures, one apiserver's stream
//! read as JSON and as protobuf at once) in each encoding: what the protobuf watch saves.
//!
//! TLS and HTTP framing are not included on either path (the webhook bench measures them for
//! admissions). The allocator is the system's, not the binary's jemalloc.
//!
//!   cargo run --release --example event-cpu [-- EVENTS]

#[path = "../common/realistic.rs"]
mod realistic;
#[path = "../common/views.rs"]
#[allow(dead_code)]
mod views;

use axum::body::Body;
use axum::http::Request;
use http_body_util::BodyExt;
use kube::api::WatchEvent;
use kube::runtime::watcher;
use realistic::deployment_json;
use serde_json::{Value, json};
use spiffe_registrar::index::workload::WatchedWorkload;
use spiffe_registrar::index::{store, wire};
use spiffe_registrar::keys::WorkloadKind;
use spiffe_registrar::policy::SpiffeRegistration;
use spiffe_registrar::spire::Ownership;
use spiffe_registrar::webhook::metrics::WebhookMetrics;
use spiffe_registrar::webhook::{WebhookState, router};
use std::sync::Arc;
use std::time::Instant;
use tower::ServiceExt;
use views::StaticView;

const FLEET: usize = 1_000;
const NAMESPACES: usize = 50;

/// A Deployment as kube-controller-manager leaves it mid-rollout: the realistic object plus
/// the status and managed fields its controllers write (~11 KB, as measured at 50,000).
fn mid_rollout(i: usize, ownership: &Ownership, round: usize) -> Value {
    let mut object: Value =
        serde_json::from_slice(&deployment_json(i, NAMESPACES, ownership, true)).expect("JSON");
    object["metadata"]["resourceVersion"] = json!(format!("{}", 1_000_000 + round * FLEET + i));
    let condition = |kind: &str, reason: &str| {
        json!({ "type": kind, "status": "True", "reason": reason,
            "message": format!("ReplicaSet \"d{i}-5d8f7c9b6{round}\" is progressing, waiting for {} of 1 new replicas to be available", round % 2),
            "lastUpdateTime": "2026-12-05T10:00:00Z", "lastTransitionTime": "2026-12-05T10:00:00Z" })
    };
    object["status"] = json!({
        "observedGeneration": 2 + round, "replicas": 2, "updatedReplicas": 1,
        "unavailableReplicas": 2, "conditions": [condition("Available", "MinimumReplicasUnavailable"), condition("Progressing", "ReplicaSetUpdated")]
    });
    let fields = |manager: &str, subresource: Option<&str>, body: Value| {
        let mut entry = json!({ "manager": manager, "operation": "Update", "apiVersion": "apps/v1",
            "time": "2026-12-05T10:00:00Z", "fieldsType": "FieldsV1", "fieldsV1": body });
        if let Some(subresource) = subresource {
            entry["subresource"] = json!(subresource);
        }
        entry
    };
    let status_fields = json!({ "f:status": { "f:conditions": { ".": {},
        "k:{\"type\":\"Available\"}": { ".": {}, "f:lastTransitionTime": {}, "f:lastUpdateTime": {}, "f:message": {}, "f:reason": {}, "f:status": {}, "f:type": {} },
        "k:{\"type\":\"Progressing\"}": { ".": {}, "f:lastTransitionTime": {}, "f:lastUpdateTime": {}, "f:message": {}, "f:reason": {}, "f:status": {}, "f:type": {} } },
        "f:observedGeneration": {}, "f:replicas": {}, "f:unavailableReplicas": {}, "f:updatedReplicas": {} } });
    let env: serde_json::Map<String, Value> = (0..40)
        .map(|k| {
            (
                format!("k:{{\"name\":\"SETTING_{k:02}\"}}"),
                json!({ ".": {}, "f:name": {}, "f:value": {} }),
            )
        })
        .collect();
    let spec_fields = json!({ "f:metadata": { "f:annotations": { ".": {}, "f:kubectl.kubernetes.io/last-applied-configuration": {} }, "f:labels": { ".": {}, "f:app": {}, "f:tier": {} } },
        "f:spec": { "f:template": { "f:spec": { "f:containers": { "k:{\"name\":\"app\"}": { ".": {}, "f:env": env, "f:image": {}, "f:name": {} } } } } } });
    let ours = json!({ "f:metadata": { "f:annotations": { "f:registrar.spiffe.io/entry-id": {}, "f:registrar.spiffe.io/spiffe-id": {} }, "f:finalizers": { ".": {}, "v:\"registrar.spiffe.io/entry-cleanup\"": {} } } });
    object["metadata"]["managedFields"] = json!([
        fields("kubectl-client-side-apply", None, spec_fields),
        fields("spiffe-registrar", None, ours),
        fields("kube-controller-manager", Some("status"), status_fields),
    ]);
    object
}

/// Microseconds per call of `f`, over `n` calls after a warm-up.
async fn per_call<F, Fut>(n: usize, mut f: F) -> f64
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for i in 0..n / 10 {
        f(i).await;
    }
    let started = Instant::now();
    for i in 0..n {
        f(i).await;
    }
    started.elapsed().as_secs_f64() * 1e6 / n as f64
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let events: usize = std::env::args()
        .nth(1)
        .map_or(50_000, |a| a.parse().expect("a number of events"));
    let ownership = Ownership::new("scale").expect("valid");

    // The watch: status-only MODIFIED events for a fleet already cached.
    let (_store, writer) = store::store();
    writer.apply(watcher::Event::Init);
    for i in 0..FLEET {
        let object = serde_json::from_value(mid_rollout(i, &ownership, 0)).expect("decodes");
        writer.apply(watcher::Event::InitApply(object));
    }
    writer.apply(watcher::Event::InitDone);
    let lines: Vec<String> = (0..FLEET)
        .map(|i| {
            json!({ "type": "MODIFIED", "object": mid_rollout(i, &ownership, 1 + i % 7) })
                .to_string()
        })
        .collect();
    let line_bytes = lines.iter().map(String::len).sum::<usize>() / lines.len();
    let watch_us = per_call(events, |i| {
        let line = &lines[i % FLEET];
        let event: WatchEvent<WatchedWorkload> = serde_json::from_str(line).expect("a watch event");
        let WatchEvent::Modified(object) = event else {
            panic!("built as MODIFIED");
        };
        assert!(
            !writer.apply(watcher::Event::Apply(object)),
            "a status-only change is no change"
        );
        std::future::ready(())
    })
    .await;

    // The same real watch (tests/fixtures) decoded from each encoding the apiserver serves.
    let json_lines: Vec<&str> = include_str!("../fixtures/deployment-watch.json")
        .lines()
        .filter(|line| line.contains("\"MODIFIED\""))
        .collect();
    let mut stream = bytes::BytesMut::from(&include_bytes!("../fixtures/deployment-watch.pb")[..]);
    let mut frames = Vec::new();
    while let Some(frame) = wire::split_frame(&mut stream).expect("a well-formed stream") {
        frames.push(frame);
    }
    frames.truncate(json_lines.len());
    let json_us = per_call(events, |i| {
        let event: WatchEvent<WatchedWorkload> =
            serde_json::from_str(json_lines[i % json_lines.len()]).expect("a watch event");
        let WatchEvent::Modified(object) = event else {
            panic!("MODIFIED only");
        };
        std::hint::black_box(object.record(spiffe_registrar::keys::WorkloadKind::Deployment));
        std::future::ready(())
    })
    .await;
    let protobuf_us = per_call(events, |i| {
        let event = wire::decode_event(WorkloadKind::Deployment, frames[i % frames.len()].clone())
            .expect("a watch event");
        let wire::Event::Applied(object) = event else {
            panic!("MODIFIED only");
        };
        std::hint::black_box(object.record(spiffe_registrar::keys::WorkloadKind::Deployment));
        std::future::ready(())
    })
    .await;

    // The webhook: UPDATE admissions of the same objects (a rollout's spec change).
    let policy: SpiffeRegistration = serde_json::from_value(json!({
        "apiVersion": "registrar.spiffe.io/v1alpha1", "kind": "SpiffeRegistration",
        "metadata": { "name": "scale", "creationTimestamp": "2026-01-01T00:00:00Z" },
        "spec": { "trustDomain": "example.org", "parentID": "spiffe://example.org/k8s/scale", "ttl": "1h" }
    }))
    .expect("policy");
    let registry = prometheus::Registry::new();
    let app = router(WebhookState {
        view: Arc::new(StaticView::opted_in("scale", vec![Arc::new(policy)])),
        metrics: WebhookMetrics::register(&registry).expect("metrics"),
        registrar_user: None,
    });
    let reviews: Vec<String> = (0..FLEET)
        .map(|i| {
            let old = mid_rollout(i, &ownership, 0);
            let mut new = old.clone();
            new["spec"]["template"]["metadata"]["annotations"] = json!({ "rollout": "2" });
            json!({
                "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "request": {
                    "uid": format!("705ab4f5-6393-11e8-b7cc-{i:012x}"),
                    "kind": { "group": "apps", "version": "v1", "kind": "Deployment" },
                    "resource": { "group": "apps", "version": "v1", "resource": "deployments" },
                    "name": old["metadata"]["name"], "namespace": old["metadata"]["namespace"],
                    "operation": "UPDATE",
                    "userInfo": { "username": "bench", "groups": ["system:authenticated"] },
                    "object": new, "oldObject": old, "dryRun": false
                }
            })
            .to_string()
        })
        .collect();
    let review_bytes = reviews.iter().map(String::len).sum::<usize>() / reviews.len();
    let admissions = events / 10;
    let webhook_us = per_call(admissions, |i| {
        let request = Request::post("/mutate")
            .header("content-type", "application/json")
            .body(Body::from(reviews[i % FLEET].clone()))
            .expect("request");
        let app = app.clone();
        async move {
            let response = app.oneshot(request).await.expect("infallible");
            assert!(response.status().is_success());
            let body = response.into_body().collect().await.expect("body");
            assert!(!body.to_bytes().is_empty());
        }
    })
    .await;

    println!(
        "{}",
        json!({
            "watch_event_bytes": line_bytes,
            "watch_event_us": (watch_us * 10.0).round() / 10.0,
            "real_event_json_decode_us": (json_us * 10.0).round() / 10.0,
            "real_event_protobuf_decode_us": (protobuf_us * 10.0).round() / 10.0,
            "admission_bytes": review_bytes,
            "admission_us": (webhook_us * 10.0).round() / 10.0,
        })
    );
}
