//! Property: whatever body the apiserver (or anyone) sends, the webhook's handler answers with
//! a well-formed response and never panics. 100,000 generated AdmissionReview bodies, built
//! from a real review with parts replaced by values of the wrong type, odd kinds and
//! operations, huge strings, deep nesting, and truncated at random.

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::views::StaticView;
use http_body_util::BodyExt;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{Map, Value, json};
use spiffe_registrar::policy::SpiffeRegistration;
use spiffe_registrar::webhook::metrics::WebhookMetrics;
use spiffe_registrar::webhook::{WebhookState, router};
use std::sync::Arc;
use tower::ServiceExt;

const FIXTURE: &str = include_str!("fixtures/create-deployment.json");
/// 100,000 in the full suite (`tests/run` sets `WEBHOOK_FUZZ_CASES`); plain `cargo test`
/// generates 10,000 to stay fast.
fn cases() -> u32 {
    std::env::var("WEBHOOK_FUZZ_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(10_000)
}

fn app() -> axum::Router {
    let policy: SpiffeRegistration = serde_json::from_value(json!({
        "apiVersion": "registrar.spiffe.io/v1alpha1",
        "kind": "SpiffeRegistration",
        "metadata": { "name": "default", "creationTimestamp": "2026-01-01T00:00:00Z" },
        "spec": { "trustDomain": "example.org", "parentID": "spiffe://example.org/nodes" }
    }))
    .expect("policy");
    let registry = prometheus::Registry::new();
    router(WebhookState {
        // Every namespace opted in, one policy: the full decision path runs for well-formed
        // input.
        view: Arc::new(StaticView::opted_in("fuzz", vec![Arc::new(policy)])),
        metrics: WebhookMetrics::register(&registry).expect("metrics"),
        registrar_user: Some("system:serviceaccount:r:r".into()),
    })
}

/// Where in a review a generated value goes.
const PATHS: &[&[&str]] = &[
    &[],
    &["apiVersion"],
    &["kind"],
    &["request"],
    &["request", "uid"],
    &["request", "kind"],
    &["request", "kind", "kind"],
    &["request", "kind", "group"],
    &["request", "operation"],
    &["request", "namespace"],
    &["request", "userInfo"],
    &["request", "userInfo", "username"],
    &["request", "dryRun"],
    &["request", "object"],
    &["request", "object", "metadata"],
    &["request", "object", "metadata", "name"],
    &["request", "object", "metadata", "annotations"],
    &["request", "object", "metadata", "finalizers"],
    &["request", "object", "metadata", "labels"],
    &["request", "object", "metadata", "deletionTimestamp"],
    &["request", "object", "spec"],
    &[
        "request",
        "object",
        "spec",
        "template",
        "spec",
        "serviceAccountName",
    ],
    &["request", "oldObject"],
];

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,24}".prop_map(Value::String),
        prop_oneof![
            Just("Deployment"),
            Just("Pod"),
            Just("CREATE"),
            Just("UPDATE"),
            Just("DELETE"),
            Just("CONNECT"),
            Just("apps"),
            Just("registrar.spiffe.io/entry-id"),
            Just("spiffe://example.org/ns/a/sa/b"),
        ]
        .prop_map(|s| Value::String(s.into())),
        // Long strings (the 4 MiB body limit itself is tested over HTTP elsewhere).
        (0usize..20_000).prop_map(|n| Value::String("x".repeat(n))),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(6, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(".{0,12}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// How a body is made from the fixture.
#[derive(Debug, Clone)]
enum Body_ {
    /// The fixture with the value at `PATHS[path]` replaced.
    Replaced { path: usize, with: Value },
    /// The above, cut after `at` bytes (modulo its length).
    Truncated { path: usize, with: Value, at: usize },
    /// `depth` nested arrays or objects around the fixture.
    Nested { depth: usize, objects: bool },
    /// Arbitrary bytes.
    Bytes(Vec<u8>),
}

fn bodies() -> impl Strategy<Value = Body_> {
    prop_oneof![
        6 => (0..PATHS.len(), value()).prop_map(|(path, with)| Body_::Replaced { path, with }),
        2 => (0..PATHS.len(), value(), any::<usize>())
            .prop_map(|(path, with, at)| Body_::Truncated { path, with, at }),
        // serde_json refuses nesting past 128 levels; a little past it is enough.
        1 => (0usize..400, any::<bool>()).prop_map(|(depth, objects)| Body_::Nested { depth, objects }),
        1 => prop::collection::vec(any::<u8>(), 0..512).prop_map(Body_::Bytes),
    ]
}

fn replaced(path: &[&str], with: Value) -> Value {
    static PARSED: std::sync::LazyLock<Value> =
        std::sync::LazyLock::new(|| serde_json::from_str(FIXTURE).expect("fixture"));
    let mut review = PARSED.clone();
    let Some((last, parents)) = path.split_last() else {
        return with;
    };
    let mut at = &mut review;
    for key in parents {
        if !at.get(*key).is_some_and(Value::is_object) {
            at[*key] = json!({});
        }
        at = &mut at[*key];
    }
    at[*last] = with;
    review
}

fn render(body: &Body_) -> Vec<u8> {
    match body {
        Body_::Replaced { path, with } => replaced(PATHS[*path], with.clone())
            .to_string()
            .into_bytes(),
        Body_::Truncated { path, with, at } => {
            let bytes = replaced(PATHS[*path], with.clone())
                .to_string()
                .into_bytes();
            bytes[..at % (bytes.len() + 1)].to_vec()
        }
        Body_::Nested { depth, objects } => {
            let (open, close) = if *objects {
                ("{\"a\":", "}")
            } else {
                ("[", "]")
            };
            let mut text = open.repeat(*depth);
            text.push_str(FIXTURE);
            text.push_str(&close.repeat(*depth));
            text.into_bytes()
        }
        Body_::Bytes(bytes) => bytes.clone(),
    }
}

#[test]
fn every_generated_review_gets_a_well_formed_answer() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let app = app();
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    });
    let answered = [0, 1, 2].map(|_| std::cell::Cell::new(0u32));
    let outcome = runner.run(&bodies(), |body| {
        let bytes = render(&body);
        let (status, answer) = runtime.block_on(async {
            let response = app
                .clone()
                .oneshot(
                    Request::post("/mutate")
                        .header("content-type", "application/json")
                        .body(Body::from(bytes.clone()))
                        .expect("request"),
                )
                .await
                .expect("the router is infallible");
            let status = response.status();
            let body = response
                .into_body()
                .collect()
                .await
                .expect("body")
                .to_bytes();
            (status, body)
        });
        match status {
            StatusCode::OK => {
                let review: Value = serde_json::from_slice(&answer)
                    .map_err(|e| TestCaseError::fail(format!("200 without JSON: {e}")))?;
                prop_assert_eq!(&review["kind"], "AdmissionReview");
                prop_assert!(review["response"]["uid"].is_string(), "{review}");
                prop_assert_eq!(&review["response"]["allowed"], true);
                answered[0].set(answered[0].get() + 1);
            }
            StatusCode::BAD_REQUEST => {
                prop_assert!(!answer.is_empty(), "a 400 says why");
                answered[1].set(answered[1].get() + 1);
            }
            StatusCode::PAYLOAD_TOO_LARGE => answered[2].set(answered[2].get() + 1),
            other => prop_assert!(false, "status {other} for {} bytes", bytes.len()),
        }
        Ok(())
    });
    if let Err(error) = outcome {
        panic!("{error}");
    }
    let answered = answered.map(|c| c.get());
    eprintln!(
        "answered: {} reviews, {} bad requests, {} too large",
        answered[0], answered[1], answered[2]
    );
    assert!(
        answered[0] > cases() / 20 && answered[1] > cases() / 20,
        "the generator must reach both the decision path and the error path: {answered:?}"
    );
}
