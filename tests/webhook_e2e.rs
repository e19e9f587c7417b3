//! The webhook as the real registrar binary behind the real kube-apiserver: a
//! MutatingWebhookConfiguration with `url: https://127.0.0.1:<port>/mutate` whose caBundle the
//! registrar injected itself. The serving certificate is short-lived (30 s, renewed every 20 s)
//! so rotation happens while the tests run.

mod common;

use common::Stack;
use common::certs::handshake_trusting;
use common::k8s::{
    annotation, create_namespace, create_webhook_configuration, deployment, eventually,
    has_finalizer, install_crd, policy,
};
use common::kube_plane::client_for;
use common::registrar::{Options, Registrar};
use common::stack::unique;
use common::world::{InSuite, Suite};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use spiffe_registrar::names::{ENTRY_ID_ANNOTATION, FINALIZER, SPIFFE_ID_ANNOTATION};
use spiffe_registrar::policy::SpiffeRegistration;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const CONFIG: &str = "spiffe-registrar-webhook-e2e";
const HOME: &str = "registrar-system";
const SECRET: &str = "spiffe-registrar-webhook-tls";
const TRUST_DOMAIN: &str = "example.org";

static SUITE: OnceLock<Suite> = OnceLock::new();

/// The shared stack with the CRD, a policy, this suite's webhook configuration and one
/// registrar serving the webhook only (the controller would release finalizers on its own).
fn suite() -> InSuite {
    Suite::get_prepared(&SUITE, prepare, || Options {
        namespace: HOME,
        webhook_configuration: CONFIG,
        cluster_name: "webhook-e2e",
        name: "registrar",
        extra_args: vec![
            "--serving-cert-validity=30s".into(),
            "--controller=false".into(),
        ],
        extra_env: vec![],
    })
}

fn prepare(stack: &Stack, webhook_port: u16) {
    let kubeconfig = stack.kube.kubeconfig.clone();
    Stack::block_on_fresh(async move {
        let client = client_for(&kubeconfig).await;
        install_crd(&client).await;
        create_namespace(&client, HOME, false).await;
        create_webhook_configuration(&client, CONFIG, webhook_port).await;
        let policies: Api<SpiffeRegistration> = Api::all(client);
        let spec = json!({ "trustDomain": TRUST_DOMAIN, "parentID": "spiffe://example.org/k8s/nodes", "ttl": "1h" });
        policies
            .create(&PostParams::default(), &policy("webhook-e2e", spec))
            .await
            .expect("policy create");
    });
}

/// A namespace of the test's own, opted in or not, once the webhook is observed working there.
async fn namespace(client: &Client, opted_in: bool) -> String {
    let name = unique("wh");
    create_namespace(client, &name, opted_in).await;
    if opted_in {
        webhook_live_in(client, &name).await;
    }
    name
}

/// Returns once the webhook mutates creates in `namespace`: the apiserver picks up webhook
/// configurations and namespace labels asynchronously, so probe (dry-run) until mutated.
async fn webhook_live_in(client: &Client, namespace: &str) {
    let api: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    eventually("the webhook to be called", Duration::from_secs(30), || {
        let api = api.clone();
        async move {
            let probe = api
                .create(
                    &PostParams {
                        dry_run: true,
                        ..Default::default()
                    },
                    &deployment("probe", None),
                )
                .await
                .ok()?;
            probe
                .metadata
                .finalizers
                .filter(|f| f.iter().any(|f| f == FINALIZER))
                .map(|_| ())
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn labelled_namespace_gets_finalizer_and_policy_id() {
    let bed = suite();
    let client = bed.stack.kube.client().await;
    let ns = namespace(&client, true).await;
    let api: Api<Deployment> = Api::namespaced(client, &ns);
    api.create(&PostParams::default(), &deployment("web", Some("api")))
        .await
        .expect("create");
    let stored = api.get("web").await.expect("stored");
    assert!(has_finalizer(&stored));
    assert_eq!(
        annotation(&stored, SPIFFE_ID_ANNOTATION),
        Some(format!("spiffe://{TRUST_DOMAIN}/ns/{ns}/sa/api").as_str())
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn unlabelled_namespace_is_untouched() {
    let bed = suite();
    let client = bed.stack.kube.client().await;
    // Make sure the webhook is live before concluding anything from its absence.
    namespace(&client, true).await;
    let ns = namespace(&client, false).await;
    let api: Api<Deployment> = Api::namespaced(client, &ns);
    api.create(&PostParams::default(), &deployment("web", None))
        .await
        .expect("create");
    let stored = api.get("web").await.expect("stored");
    assert!(!has_finalizer(&stored));
    assert_eq!(annotation(&stored, SPIFFE_ID_ANNOTATION), None);
}

#[tokio::test(flavor = "multi_thread")]
async fn user_written_spiffe_id_is_replaced() {
    let bed = suite();
    let client = bed.stack.kube.client().await;
    let ns = namespace(&client, true).await;
    let api: Api<Deployment> = Api::namespaced(client, &ns);
    let mut sneaky = deployment("web", Some("api"));
    sneaky.metadata.annotations = Some(
        [(
            SPIFFE_ID_ANNOTATION.to_string(),
            format!("spiffe://{TRUST_DOMAIN}/ns/kube-system/sa/admin"),
        )]
        .into(),
    );
    api.create(&PostParams::default(), &sneaky)
        .await
        .expect("create");
    let expected = format!("spiffe://{TRUST_DOMAIN}/ns/{ns}/sa/api");
    assert_eq!(
        annotation(&api.get("web").await.expect("stored"), SPIFFE_ID_ANNOTATION),
        Some(expected.as_str())
    );
    // And on UPDATE too.
    let patch = json!({ "metadata": { "annotations": { SPIFFE_ID_ANNOTATION: "spiffe://example.org/evil" } } });
    api.patch("web", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("patch");
    assert_eq!(
        annotation(&api.get("web").await.expect("stored"), SPIFFE_ID_ANNOTATION),
        Some(expected.as_str())
    );
}

/// A rollout or a scale never reaches the webhook (the manifests' `matchConditions`); an edit
/// of what it reads does. Seen from the apiserver: this registrar runs no controller, so only
/// the webhook can stamp a Deployment that was created before its namespace opted in.
#[tokio::test(flavor = "multi_thread")]
async fn only_updates_of_what_the_webhook_reads_reach_it() {
    let bed = suite();
    let client = bed.stack.kube.client().await;
    let ns = namespace(&client, false).await;
    let api: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    api.create(&PostParams::default(), &deployment("web", Some("api")))
        .await
        .expect("create");
    let opt_in = json!({ "metadata": { "labels": { "spiffe.io/registrar": "enabled" } } });
    Api::<Namespace>::all(client.clone())
        .patch(&ns, &PatchParams::default(), &Patch::Merge(&opt_in))
        .await
        .expect("opt the namespace in");
    webhook_live_in(&client, &ns).await;
    let stamped =
        |d: &Deployment| has_finalizer(d) || annotation(d, SPIFFE_ID_ANNOTATION).is_some();

    let before = api.get("web").await.expect("stored");
    for (what, patch) in [
        ("a scale", json!({ "spec": { "replicas": 3 } })),
        (
            "a rollout",
            json!({ "spec": { "template": { "metadata": { "annotations": { "rollout": "2" } } } } }),
        ),
        (
            "another writer's annotation",
            json!({ "metadata": { "annotations": { "example.com/note": "x" } } }),
        ),
    ] {
        let after = api
            .patch("web", &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_ne!(
            after.metadata.resource_version, before.metadata.resource_version,
            "{what} was written"
        );
        assert!(!stamped(&after), "{what} reached the webhook");
    }

    let relabel = json!({ "metadata": { "labels": { "tier": "web" } } });
    let after = api
        .patch("web", &PatchParams::default(), &Patch::Merge(&relabel))
        .await
        .expect("relabel");
    assert!(has_finalizer(&after), "a label change reaches the webhook");
    assert_eq!(
        annotation(&after, SPIFFE_ID_ANNOTATION),
        Some(format!("spiffe://{TRUST_DOMAIN}/ns/{ns}/sa/api").as_str())
    );
    // A forged entry-id (by someone other than the registrar) is an edit of what the webhook
    // reads, whatever else the UPDATE does: refused with a warning.
    let forged = json!({ "metadata": { "annotations": { ENTRY_ID_ANNOTATION: "someone-elses-entry" } }, "spec": { "replicas": 1 } }).to_string();
    let (ok, _, warned) = tokio::task::block_in_place(|| {
        common::process::run(bed.stack.kube.kubectl().args([
            "--as=mallory",
            "--as-group=system:masters",
            "-n",
            &ns,
            "patch",
            "deployment",
            "web",
            "--type=merge",
            "-p",
            &forged,
        ]))
    });
    assert!(ok, "{warned}");
    assert!(
        warned.contains("is written by the registrar"),
        "the webhook warns: {warned}"
    );
    let stored = api.get("web").await.expect("stored");
    assert_eq!(
        stored.spec.as_ref().and_then(|s| s.replicas),
        Some(1),
        "the rest of the UPDATE applied"
    );
    assert_ne!(
        annotation(&stored, ENTRY_ID_ANNOTATION),
        Some("someone-elses-entry")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn server_side_dry_run_returns_the_patched_object_and_persists_nothing() {
    let bed = suite();
    let client = bed.stack.kube.client().await;
    let ns = namespace(&client, true).await;
    let api: Api<Deployment> = Api::namespaced(client, &ns);
    let answered = api
        .create(
            &PostParams {
                dry_run: true,
                ..Default::default()
            },
            &deployment("dry", None),
        )
        .await
        .expect("dry-run create");
    assert!(has_finalizer(&answered));
    assert_eq!(
        annotation(&answered, SPIFFE_ID_ANNOTATION),
        Some(format!("spiffe://{TRUST_DOMAIN}/ns/{ns}/sa/default").as_str())
    );
    assert!(
        api.get_opt("dry").await.expect("get").is_none(),
        "dry-run persists nothing"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn finalizer_removal_during_deletion_is_not_undone() {
    let bed = suite();
    let client = bed.stack.kube.client().await;
    let ns = namespace(&client, true).await;
    let api: Api<Deployment> = Api::namespaced(client, &ns);
    api.create(&PostParams::default(), &deployment("doomed", None))
        .await
        .expect("create");
    api.delete("doomed", &DeleteParams::default())
        .await
        .expect("delete");
    let terminating = api.get("doomed").await.expect("held by our finalizer");
    assert!(terminating.metadata.deletion_timestamp.is_some());
    let remove = json!([{ "op": "remove", "path": "/metadata/finalizers" }]);
    api.patch(
        "doomed",
        &PatchParams::default(),
        &Patch::<()>::Json(serde_json::from_value(remove).expect("patch")),
    )
    .await
    .expect("removing the finalizer must succeed");
    assert!(
        api.get_opt("doomed").await.expect("get").is_none(),
        "the webhook must not re-add the finalizer"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn ca_bundle_is_the_registrars_own_ca() {
    let bed = suite();
    let client = bed.stack.kube.client().await;
    let secret = Api::<Secret>::namespaced(client.clone(), HOME)
        .get(SECRET)
        .await
        .expect("the registrar made its Secret");
    let ca = secret.data.expect("data")["ca.crt"].0.clone();
    let config = Api::<MutatingWebhookConfiguration>::all(client)
        .get(CONFIG)
        .await
        .expect("config");
    let bundle = config.webhooks.expect("webhooks")[0]
        .client_config
        .ca_bundle
        .clone()
        .expect("caBundle injected");
    assert_eq!(bundle.0, ca);
}

#[tokio::test(flavor = "multi_thread")]
async fn serving_cert_rotation_fails_no_create() {
    let bed = suite();
    let client = bed.stack.kube.client().await;
    let ns = namespace(&client, true).await;
    let api: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let secrets: Api<Secret> = Api::namespaced(client, HOME);
    let serving = |s: Secret| s.data.expect("data")["tls.crt"].0.clone();
    let first = serving(secrets.get(SECRET).await.expect("secret"));
    let mut certificates = vec![first];
    let started = Instant::now();
    let mut created = 0;
    // Keep creating until two rotations were observed (the cert lives 30 s, renewed at 20 s).
    while certificates.len() < 3 {
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "no rotation within 90 s"
        );
        let name = format!("r{created}");
        let stored = api
            .create(&PostParams::default(), &deployment(&name, None))
            .await
            .unwrap_or_else(|e| panic!("create {created} failed during rotation: {e}"));
        assert!(has_finalizer(&stored), "create {created} was not mutated");
        created += 1;
        let current = serving(secrets.get(SECRET).await.expect("secret"));
        if certificates.last() != Some(&current) {
            certificates.push(current);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "{created} creates across {} serving certificates, none failed",
        certificates.len()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn replicas_racing_for_the_secret_serve_one_certificate() {
    let bed = suite();
    let secret = unique("race-tls");
    let stack = bed.stack;
    // Both start at once against an absent Secret.
    let start = |name: &'static str| {
        let secret = secret.clone();
        std::thread::spawn(move || {
            Registrar::start(
                stack,
                Options {
                    namespace: HOME,
                    webhook_configuration: "absent-configuration",
                    cluster_name: "race",
                    name,
                    extra_args: vec![
                        format!("--cert-secret={secret}"),
                        "--controller=false".into(),
                    ],
                    extra_env: vec![],
                },
            )
        })
    };
    let (a, b) = (start("race-a"), start("race-b"));
    let (a, b) = (a.join().expect("replica a"), b.join().expect("replica b"));
    stack.track(a.process.pgid());
    stack.track(b.process.pgid());
    let client = stack.kube.client().await;
    let stored = Api::<Secret>::namespaced(client, HOME)
        .get(&secret)
        .await
        .expect("one Secret");
    let ca = stored.data.expect("data")["ca.crt"].0.clone();
    for (name, registrar) in [("a", &a), ("b", &b)] {
        handshake_trusting(registrar.webhook_port, &ca)
            .await
            .unwrap_or_else(|e| {
                panic!("replica {name} does not serve a certificate of the Secret's CA: {e}")
            });
    }
}
