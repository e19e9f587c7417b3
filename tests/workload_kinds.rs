//! Every built-in kind of workload end to end: StatefulSets, DaemonSets, Jobs and CronJobs are
//! stamped at admission, registered, recorded and released exactly as Deployments are, and
//! one entry per service account serves every kind that runs as it (invariant 3: one entry per
//! identity, ref-counted). Asserted from the apiserver's side (the admitted object, the
//! annotations, the Events, the objects' disappearance) and SPIRE's (the spire-server CLI),
//! against the real kube-apiserver, kube-controller-manager (whose job, cronjob and
//! ttl-after-finished controllers act on the objects) and spire-server. Two kinds are
//! configured from CRDs the tests define (`--custom-kind`), installed after the registrar
//! started: one with its Pod template at a path of its own, one whose CRD is removed.
#![cfg(feature = "e2e")]

mod common;

use common::k8s::eventually;
use common::kube_plane::client_for;
use common::stack::Stack;
use common::world::{
    InSuite, Scenario, Suite, WAIT, WEBHOOK_CONFIG, entry_id, flags, options, prepare, spiffe_id,
};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use kube::api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use spiffe_registrar::keys::WorkloadKind::{
    self, CronJob, Custom, DaemonSet, Deployment, Job, Pod, StatefulSet,
};
use spiffe_registrar::names::{ENTRY_ID_ANNOTATION, FINALIZER, SPIFFE_ID_ANNOTATION};
use std::sync::OnceLock;

/// Bare Pods on: the Pods of the other kinds' workloads, which controllers own, are left out.
/// The scope-loss grace is long enough to sample the hold a CRD's removal puts on entries.
const FLAGS: &[&str] = &[
    "--bare-pods=true",
    "--resync-interval=10s",
    "--spire-rps=0",
    "--scope-loss-grace=15s",
    "--transition-grace=2s",
    "--custom-kind=e2e.example.test/v1/Widget/widgets:spec.workload.podTemplate",
    "--custom-kind=e2e.example.test/v1/Gadget/gadgets",
];

/// The custom kinds: CRDs of the test's own group, not installed when the registrar starts.
const GROUP: &str = "e2e.example.test";

fn widget() -> WorkloadKind {
    WorkloadKind::register_custom("e2e.example.test/v1/Widget/widgets:spec.workload.podTemplate")
        .expect("valid")
}

fn gadget() -> WorkloadKind {
    WorkloadKind::register_custom("e2e.example.test/v1/Gadget/gadgets").expect("valid")
}

static SUITE: OnceLock<Suite> = OnceLock::new();

/// The registrar starts (and is ready) with neither custom kind's CRD installed; the webhook
/// configuration also sends the custom kinds, as the chart's `customKinds` makes it.
fn suite() -> InSuite {
    Suite::get_prepared(
        &SUITE,
        |stack, port| {
            prepare(&stack.kube, port);
            let kubeconfig = stack.kube.kubeconfig.clone();
            Stack::block_on_fresh(async move {
                let client = client_for(&kubeconfig).await;
                let rule = json!({ "apiGroups": [GROUP], "apiVersions": ["v1"], "resources": ["widgets", "gadgets"], "operations": ["CREATE", "UPDATE"] });
                let patch: json_patch::Patch = serde_json::from_value(
                    json!([{ "op": "add", "path": "/webhooks/0/rules/-", "value": rule }]),
                )
                .expect("patch");
                Api::<MutatingWebhookConfiguration>::all(client)
                    .patch(
                        WEBHOOK_CONFIG,
                        &PatchParams::default(),
                        &Patch::Json::<()>(patch),
                    )
                    .await
                    .expect("the custom kinds' webhook rule");
            });
        },
        || options("kinds", "registrar", flags(FLAGS, &[])),
    )
}

/// Defines `kind`'s CRD (namespaced, v1, any spec) and waits until it is served.
async fn define(s: &Scenario, kind: WorkloadKind) {
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "metadata": { "name": format!("{}.{GROUP}", kind.plural()) },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": { "plural": kind.plural(), "kind": kind.name(), "listKind": kind.list_name() },
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "schema": { "openAPIV3Schema": { "type": "object", "properties": {
                    "spec": { "type": "object", "x-kubernetes-preserve-unknown-fields": true }
                } } }
            }]
        }
    }))
    .expect("CRD JSON");
    let crds: Api<CustomResourceDefinition> = Api::all(s.client.clone());
    crds.create(&PostParams::default(), &crd)
        .await
        .expect("create the CRD");
    let name = crd.metadata.name.clone().expect("named");
    eventually(&format!("{name} to be established"), WAIT, || async {
        let crd = crds.get(&name).await.ok()?;
        let conditions = crd.status?.conditions?;
        conditions
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True")
            .then_some(())
    })
    .await;
    // Served to clients a moment after it is established.
    eventually(&format!("{name} to be served"), WAIT, || async {
        api(s, "default", kind)
            .list(&ListParams::default())
            .await
            .ok()
            .map(|_| ())
    })
    .await;
}

/// The suite, a scenario with the default policy, and an opted-in namespace of its own.
async fn opted_in() -> (InSuite, Scenario, String) {
    let bed = suite();
    let s = Scenario::new(&bed.stack.kube).await;
    s.default_policy().await;
    let ns = s.namespace(true).await;
    (bed, s, ns)
}

/// `kind`'s objects in `ns`.
fn api(s: &Scenario, ns: &str, kind: WorkloadKind) -> Api<DynamicObject> {
    Api::namespaced_with(s.client.clone(), ns, &kind.api_resource())
}

/// A bare Pod (no controller owns it) running as `sa`.
fn bare_pod(name: &str, sa: &str) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name, "labels": { "app": name } },
        "spec": {
            "serviceAccountName": sa,
            "containers": [{ "name": "app", "image": "registry.invalid/app:1" }]
        }
    }))
    .expect("Pod JSON")
}

/// A minimal valid object of `kind` whose Pods run as `sa`; `spec` is merged into its spec.
fn manifest(kind: WorkloadKind, name: &str, sa: &str, spec: Value) -> DynamicObject {
    let restart = if matches!(kind, Job | CronJob) {
        "Never"
    } else {
        "Always"
    };
    let template = json!({
        "metadata": { "labels": { "app": name } },
        "spec": {
            "serviceAccountName": sa,
            "restartPolicy": restart,
            "containers": [{ "name": "app", "image": "registry.invalid/app:1" }]
        }
    });
    let selector = json!({ "matchLabels": { "app": name } });
    let mut object_spec = match kind {
        Deployment => json!({ "replicas": 1, "selector": selector, "template": template }),
        StatefulSet => {
            json!({ "replicas": 1, "serviceName": name, "selector": selector, "template": template })
        }
        DaemonSet => json!({ "selector": selector, "template": template }),
        Job => json!({ "backoffLimit": 0, "template": template }),
        // Never due in a test's lifetime: the CronJob alone must hold its identity.
        CronJob => {
            json!({ "schedule": "0 0 1 1 *", "jobTemplate": { "spec": { "template": template } } })
        }
        Pod => return bare_pod(name, sa),
        // Widget keeps its template at the path configured for it, Gadget at spec.template.
        kind if kind == widget() => json!({ "workload": { "podTemplate": template } }),
        Custom(_) => json!({ "template": template }),
    };
    if let (Some(into), Value::Object(extra)) = (object_spec.as_object_mut(), spec) {
        into.extend(extra);
    }
    serde_json::from_value(json!({
        "apiVersion": kind.api_version(),
        "kind": kind.name(),
        "metadata": { "name": name, "labels": { "app": name } },
        "spec": object_spec,
    }))
    .expect("workload JSON")
}

fn annotation<'a>(object: &'a DynamicObject, key: &str) -> Option<&'a str> {
    object
        .metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

fn has_finalizer(object: &DynamicObject) -> bool {
    object
        .metadata
        .finalizers
        .iter()
        .flatten()
        .any(|f| f == FINALIZER)
}

/// Creates the workload; returns it as admitted (what the webhook made of it).
async fn create(
    s: &Scenario,
    ns: &str,
    object: &DynamicObject,
    kind: WorkloadKind,
) -> DynamicObject {
    api(s, ns, kind)
        .create(&PostParams::default(), object)
        .await
        .unwrap_or_else(|e| panic!("create {kind}: {e}"))
}

/// Creates a minimal `kind` named `name` whose Pods run as `sa`.
async fn make(s: &Scenario, ns: &str, kind: WorkloadKind, name: &str, sa: &str) -> DynamicObject {
    create(s, ns, &manifest(kind, name, sa, json!({})), kind).await
}

/// Waits until the workload records an entry ID and returns it.
async fn recorded(s: &Scenario, ns: &str, kind: WorkloadKind, name: &str) -> String {
    let api = api(s, ns, kind);
    eventually(&format!("{kind} {name} to be registered"), WAIT, || async {
        let object = api.get(name).await.ok()?;
        annotation(&object, ENTRY_ID_ANNOTATION).map(str::to_string)
    })
    .await
}

/// Deletes the workload and waits until it is gone: its finalizer was released.
async fn delete(s: &Scenario, ns: &str, kind: WorkloadKind, name: &str) {
    let api = api(s, ns, kind);
    api.delete(name, &DeleteParams::background())
        .await
        .unwrap_or_else(|e| panic!("delete {kind} {name}: {e}"));
    gone(&api, kind, name).await;
}

async fn gone(api: &Api<DynamicObject>, kind: WorkloadKind, name: &str) {
    eventually(&format!("{kind} {name} to be gone"), WAIT, || async {
        api.get_opt(name).await.ok()?.is_none().then_some(())
    })
    .await
}

/// The reasons of the Events about `kind` `name` in `ns`.
async fn event_reasons(s: &Scenario, ns: &str, kind: WorkloadKind, name: &str) -> Vec<String> {
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(s.client.clone(), ns);
    let fields = format!(
        "involvedObject.name={name},involvedObject.kind={}",
        kind.name()
    );
    let list = events.list(&ListParams::default().fields(&fields)).await;
    list.map(|l| l.items.into_iter().filter_map(|e| e.reason).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread")]
async fn every_kind_is_stamped_at_admission_registered_recorded_and_released() {
    let (bed, s, ns) = opted_in().await;
    let kinds = [StatefulSet, DaemonSet, Job, CronJob];
    for kind in kinds {
        let sa = format!("{}-sa", kind.plural());
        let admitted = create(&s, &ns, &manifest(kind, "app", &sa, json!({})), kind).await;
        assert!(has_finalizer(&admitted), "{kind}: finalizer at admission");
        assert_eq!(
            annotation(&admitted, SPIFFE_ID_ANNOTATION),
            Some(spiffe_id(&ns, &sa).as_str()),
            "{kind}: the identity it will get, at admission"
        );
    }
    for kind in kinds {
        let sa = format!("{}-sa", kind.plural());
        let recorded = recorded(&s, &ns, kind, "app").await;
        let entries = bed.stack.spire_server.entries_for(&spiffe_id(&ns, &sa));
        assert_eq!(entries.len(), 1, "{kind}: {entries:?}");
        assert_eq!(entry_id(&entries[0]), recorded, "{kind}");
        assert_eq!(
            entries[0]["selectors"],
            json!([{ "type": "k8s", "value": format!("ns:{ns}") }, { "type": "k8s", "value": format!("sa:{sa}") }]),
            "{kind}"
        );
        eventually(
            &format!("a Registered Event on the {kind}"),
            WAIT,
            || async {
                let reasons = event_reasons(&s, &ns, kind, "app").await;
                reasons.iter().any(|r| r == "Registered").then_some(())
            },
        )
        .await;
    }
    // A CronJob's Pods come from Jobs it has not made yet: the identity is there before them.
    let jobs = api(&s, &ns, Job)
        .list(&ListParams::default())
        .await
        .expect("list");
    assert_eq!(
        jobs.items.len(),
        1,
        "only the test's own Job: {:?}",
        jobs.items
    );

    for kind in kinds {
        delete(&s, &ns, kind, "app").await;
        let sa = format!("{}-sa", kind.plural());
        bed.stack
            .spire_server
            .wait_none_for(&spiffe_id(&ns, &sa))
            .await;
    }
}

/// Invariant 3 across kinds: a Deployment, a StatefulSet of the same name and a CronJob share
/// one entry, which outlives every one of them but the last.
#[tokio::test(flavor = "multi_thread")]
async fn one_entry_serves_every_kind_of_a_service_account_until_the_last_is_gone() {
    let (bed, s, ns) = opted_in().await;
    let members = [(Deployment, "web"), (StatefulSet, "web"), (CronJob, "tick")];
    for (kind, name) in members {
        make(&s, &ns, kind, name, "shared").await;
    }
    let mut ids = Vec::new();
    for (kind, name) in members {
        ids.push(recorded(&s, &ns, kind, name).await);
    }
    assert!(ids.windows(2).all(|w| w[0] == w[1]), "one entry: {ids:?}");
    let id = spiffe_id(&ns, "shared");
    let spire = &bed.stack.spire_server;
    assert_eq!(spire.entries_for(&id).len(), 1);

    for (kind, name) in &members[..2] {
        let api = api(&s, &ns, *kind);
        api.delete(name, &DeleteParams::background())
            .await
            .expect("delete");
        // Sampled through the deletion: the entry is there at every look, and still there
        // once the workload is gone (its finalizer is released only after the decision).
        eventually(&format!("{kind} {name} to be gone"), WAIT, || async {
            let left = spire.entries_for(&id);
            assert_eq!(left.len(), 1, "while {kind} {name} goes: {left:?}");
            assert_eq!(entry_id(&left[0]), ids[0]);
            api.get_opt(name).await.ok()?.is_none().then_some(())
        })
        .await;
        assert_eq!(spire.entries_for(&id).len(), 1, "after {kind} {name}");
    }
    delete(&s, &ns, CronJob, "tick").await;
    spire.wait_none_for(&id).await;
}

/// A finished Job keeps its identity until the Job object is deleted: here kube-controller-
/// manager fails it by its deadline (no node runs its Pod), then its TTL controller deletes
/// it, which our finalizer holds until the controller has released the entry.
#[tokio::test(flavor = "multi_thread")]
async fn a_finished_job_keeps_its_identity_until_its_ttl_deletes_it() {
    let (bed, s, ns) = opted_in().await;
    let jobs = api(&s, &ns, Job);
    let id = spiffe_id(&ns, "batch");
    let spire = &bed.stack.spire_server;

    // A finished Job that has not been deleted yet: no TTL.
    let held = manifest(Job, "held", "batch", json!({ "activeDeadlineSeconds": 1 }));
    create(&s, &ns, &held, Job).await;
    let entry = recorded(&s, &ns, Job, "held").await;
    eventually("the Job to fail by its deadline", WAIT, || async {
        let job = jobs.get("held").await.ok()?;
        let conditions = job.data["status"]["conditions"].as_array()?.clone();
        conditions
            .iter()
            .any(|c| c["type"] == "Failed" && c["status"] == "True")
            .then_some(())
    })
    .await;
    // A sync after the Job finished (the status write is an event of the watch) leaves it.
    bed.registrar.wait_syncs(bed.registrar.syncs(), 2.0).await;
    let left = spire.entries_for(&id);
    assert_eq!(left.len(), 1, "a finished Job keeps its identity: {left:?}");
    assert_eq!(entry_id(&left[0]), entry);

    // The TTL controller deletes a finished Job; its reference goes with it.
    let spec = json!({ "activeDeadlineSeconds": 1, "ttlSecondsAfterFinished": 1 });
    create(&s, &ns, &manifest(Job, "ttl", "other", spec), Job).await;
    recorded(&s, &ns, Job, "ttl").await;
    gone(&jobs, Job, "ttl").await;
    spire.wait_none_for(&spiffe_id(&ns, "other")).await;

    delete(&s, &ns, Job, "held").await;
    spire.wait_none_for(&id).await;
}

/// A policy limited by `kinds` governs only the service accounts a workload of those kinds
/// runs as; its status counts what it governs by kind.
#[tokio::test(flavor = "multi_thread")]
async fn a_policy_limited_to_a_kind_registers_that_kind_and_counts_by_kind() {
    let bed = suite();
    let s = Scenario::new(&bed.stack.kube).await;
    let mut spec = s.spec("p");
    spec["kinds"] = json!(["StatefulSet"]);
    spec["workloadSelector"] = json!({ "matchLabels": { "app": "db" } });
    let policy = s.policy("p", spec).await;
    let ns = s.namespace(true).await;
    let db = manifest(StatefulSet, "db", "store", json!({}));
    create(&s, &ns, &db, StatefulSet).await;
    let web = manifest(Deployment, "web", "front", json!({}));
    let admitted = create(&s, &ns, &web, Deployment).await;
    assert!(
        !has_finalizer(&admitted),
        "no policy governs the Deployment's account"
    );
    assert_eq!(annotation(&admitted, SPIFFE_ID_ANNOTATION), None);

    let recorded = recorded(&s, &ns, StatefulSet, "db").await;
    let entries = bed.stack.spire_server.entries_for(&spiffe_id(&ns, "store"));
    assert_eq!(entries.len(), 1);
    assert_eq!(entry_id(&entries[0]), recorded);
    eventually("workloadsByKind in the policy's status", WAIT, || async {
        let status = s.policies().get(&policy).await.ok()?.status?;
        let by_kind = serde_json::to_value(&status.workloads_by_kind).ok()?;
        (by_kind == json!({ "StatefulSet": 1 }) && status.selected_workloads == 1).then_some(())
    })
    .await;
    bed.registrar.wait_syncs(bed.registrar.syncs(), 2.0).await;
    assert!(
        bed.stack
            .spire_server
            .entries_for(&spiffe_id(&ns, "front"))
            .is_empty(),
        "a Deployment is not a StatefulSet"
    );
    let web = api(&s, &ns, Deployment).get("web").await.expect("get");
    assert!(!has_finalizer(&web) && annotation(&web, ENTRY_ID_ANNOTATION).is_none());
}

/// `--bare-pods`: a Pod no controller owns is registered and annotated by the controller,
/// never carries our finalizer, and counts toward its service account like any workload; the
/// Pods controllers own (a Deployment's) are not workloads of their own.
#[tokio::test(flavor = "multi_thread")]
async fn a_bare_pod_is_registered_without_a_finalizer_and_released_when_deleted() {
    let (bed, s, ns) = opted_in().await;
    let spire = &bed.stack.spire_server;
    make(&s, &ns, Deployment, "web", "shared").await;
    let shared = recorded(&s, &ns, Deployment, "web").await;
    for (name, sa) in [("solo", "solo"), ("buddy", "shared")] {
        let admitted = create(&s, &ns, &bare_pod(name, sa), Pod).await;
        assert!(!has_finalizer(&admitted), "the webhook never stamps a Pod");
    }
    let pods = api(&s, &ns, Pod);
    // Sampled until it is recorded: never a finalizer on the way.
    let solo = eventually("the bare Pod's entry-id", WAIT, || async {
        let pod = pods.get("solo").await.ok()?;
        assert!(!has_finalizer(&pod), "{:?}", pod.metadata.finalizers);
        annotation(&pod, ENTRY_ID_ANNOTATION).map(str::to_string)
    })
    .await;
    let entries = spire.entries_for(&spiffe_id(&ns, "solo"));
    assert_eq!(entries.len(), 1);
    assert_eq!(entry_id(&entries[0]), solo);
    let pod = pods.get("solo").await.expect("get");
    assert_eq!(
        annotation(&pod, SPIFFE_ID_ANNOTATION),
        Some(spiffe_id(&ns, "solo").as_str())
    );
    assert_eq!(
        recorded(&s, &ns, Pod, "buddy").await,
        shared,
        "one entry per account"
    );
    eventually("a Registered Event on the bare Pod", WAIT, || async {
        let reasons = event_reasons(&s, &ns, Pod, "solo").await;
        reasons.iter().any(|r| r == "Registered").then_some(())
    })
    .await;
    let owned = pods
        .list(&ListParams::default().labels("app=web"))
        .await
        .expect("list");
    for pod in &owned.items {
        assert_eq!(
            annotation(pod, ENTRY_ID_ANNOTATION),
            None,
            "a Deployment's Pod"
        );
    }

    pods.delete("buddy", &DeleteParams::default())
        .await
        .expect("delete");
    gone(&pods, Pod, "buddy").await;
    bed.registrar.wait_syncs(bed.registrar.syncs(), 2.0).await;
    let left = spire.entries_for(&spiffe_id(&ns, "shared"));
    assert_eq!(left.len(), 1, "the Deployment still runs as it: {left:?}");
    pods.delete("solo", &DeleteParams::default())
        .await
        .expect("delete");
    spire.wait_none_for(&spiffe_id(&ns, "solo")).await;
}

/// A configured kind whose CRD is installed after the registrar started (which was ready
/// without it) is stamped at admission, registered from the service account at its own
/// template path, recorded and released like a built-in kind.
#[tokio::test(flavor = "multi_thread")]
async fn a_configured_kind_is_registered_from_its_template_path_once_its_crd_exists() {
    let (bed, s, ns) = opted_in().await;
    let kind = widget();
    define(&s, kind).await;
    let admitted = eventually("a Widget to be admitted", WAIT, || async {
        let object = manifest(kind, "app", "widget-sa", json!({}));
        api(&s, &ns, kind)
            .create(&PostParams::default(), &object)
            .await
            .ok()
    })
    .await;
    assert!(has_finalizer(&admitted), "finalizer at admission");
    assert_eq!(
        annotation(&admitted, SPIFFE_ID_ANNOTATION),
        Some(spiffe_id(&ns, "widget-sa").as_str()),
        "the identity of the account at spec.workload.podTemplate, at admission"
    );
    let recorded = recorded(&s, &ns, kind, "app").await;
    let entries = bed
        .stack
        .spire_server
        .entries_for(&spiffe_id(&ns, "widget-sa"));
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(entry_id(&entries[0]), recorded);
    eventually("a Registered Event on the Widget", WAIT, || async {
        let reasons = event_reasons(&s, &ns, kind, "app").await;
        reasons.iter().any(|r| r == "Registered").then_some(())
    })
    .await;
    delete(&s, &ns, kind, "app").await;
    bed.stack
        .spire_server
        .wait_none_for(&spiffe_id(&ns, "widget-sa"))
        .await;
}

/// Removing a configured kind's CRD deletes every object of the kind at once. Our finalizer
/// holds them, and their service accounts' entries go through the scope-loss grace (and, in
/// numbers, the deletion brake) instead of being deleted in a burst; an account a live
/// Deployment also runs as keeps its entry and releases its Gadget at once.
#[tokio::test(flavor = "multi_thread")]
async fn removing_a_configured_kind_s_crd_holds_its_entries_for_the_scope_loss_grace() {
    let (bed, s, ns) = opted_in().await;
    let kind = gadget();
    define(&s, kind).await;
    make(&s, &ns, Deployment, "web", "shared").await;
    let gadgets = [("g-shared", "shared"), ("g-one", "one"), ("g-two", "two")];
    for (name, sa) in gadgets {
        make(&s, &ns, kind, name, sa).await;
    }
    for (name, _) in gadgets {
        recorded(&s, &ns, kind, name).await;
    }
    recorded(&s, &ns, Deployment, "web").await;
    let spire = &bed.stack.spire_server;
    let held: Vec<String> = ["one", "two"].map(|sa| spiffe_id(&ns, sa)).into();

    let crds: Api<CustomResourceDefinition> = Api::all(s.client.clone());
    crds.delete(&format!("gadgets.{GROUP}"), &DeleteParams::default())
        .await
        .expect("delete the CRD");
    let gadget_api = api(&s, &ns, kind);
    eventually("the CRD's removal to delete the Gadgets", WAIT, || async {
        let object = gadget_api.get("g-one").await.ok()?;
        object.metadata.deletion_timestamp.map(|_| ())
    })
    .await;
    // Sampled for a while after the deletions began: every held entry stays, and so do its
    // Gadgets (our finalizer), told why.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(6);
    while std::time::Instant::now() < until {
        for id in &held {
            assert_eq!(spire.entries_for(id).len(), 1, "{id} while its CRD goes");
        }
        for name in ["g-one", "g-two"] {
            assert!(
                gadget_api.get_opt(name).await.expect("get").is_some(),
                "{name} is held while its entry is"
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    let reasons = event_reasons(&s, &ns, kind, "g-one").await;
    assert!(
        reasons.iter().any(|r| r == "DeregistrationPending"),
        "{reasons:?}"
    );
    // The Gadget sharing the Deployment's account was released at once, its entry kept.
    gone(&gadget_api, kind, "g-shared").await;
    assert_eq!(spire.entries_for(&spiffe_id(&ns, "shared")).len(), 1);

    // After the grace: the entries go, then the Gadgets, then the CRD.
    for id in &held {
        spire.wait_none_for(id).await;
    }
    eventually("the CRD to be gone", WAIT, || async {
        crds.get_opt(&format!("gadgets.{GROUP}"))
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    assert_eq!(spire.entries_for(&spiffe_id(&ns, "shared")).len(), 1);
}
