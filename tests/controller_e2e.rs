//! The controller end to end: the real registrar binary (webhook and controller) against the
//! real kube-apiserver and spire-server. SPIRE's state is read with the spire-server CLI, not
//! with our client.
//!
//! Most scenarios share one stack and one registrar; each uses its own namespaces and its own
//! policy (selecting only namespaces labelled `e2e/test=<scenario>`). Scenarios that stop SPIRE,
//! run two replicas or crash the registrar get a stack of their own.

mod common;

use common::Stack;
use common::k8s::{
    annotation, create_namespace_with, create_webhook_configuration_excluding, deployment,
    eventually, has_finalizer, install_crd, policy,
};
use common::kube_plane::client_for;
use common::registrar::{Options, Registrar};
use common::stack::unique;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Event, Namespace};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use spiffe_registrar::names::{ENTRY_ID_ANNOTATION, SPIFFE_ID_ANNOTATION};
use spiffe_registrar::policy::SpiffeRegistration;
use std::sync::OnceLock;
use std::time::Duration;

const TD: &str = "example.org";
const HOME: &str = "registrar-system";
const CONFIG: &str = "spiffe-registrar-controller-e2e";
/// Namespaces with this label are not sent to the webhook (as if it were not installed).
const NO_WEBHOOK: &str = "e2e/no-webhook";
const WAIT: Duration = Duration::from_secs(45);

fn registrar_args() -> Vec<String> {
    vec![
        "--resync-interval=10s".into(),
        "--lease-duration=8s".into(),
        "--renew-deadline=3s".into(),
        "--lease-retry-period=1s".into(),
        "--spire-rps=0".into(),
        "--scope-loss-grace=2s".into(),
        "--transition-grace=2s".into(),
    ]
}

struct Env {
    stack: &'static Stack,
    _registrar: Registrar,
}

/// The shared stack with CRD, webhook configuration and one registrar.
fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        let stack = Stack::shared();
        let port = common::paths::free_port();
        prepare(stack, port);
        let registrar = Registrar::start_on(
            stack,
            port,
            options("e2e", "registrar", registrar_args(), vec![]),
        );
        stack.track(registrar.process.pgid());
        Env {
            stack,
            _registrar: registrar,
        }
    })
}

fn options(
    cluster: &'static str,
    name: &'static str,
    extra_args: Vec<String>,
    extra_env: Vec<(String, String)>,
) -> Options<'static> {
    Options {
        namespace: HOME,
        webhook_configuration: CONFIG,
        cluster_name: cluster,
        name,
        extra_args,
        extra_env,
    }
}

/// CRD, the registrar's namespace and the webhook configuration on `stack`.
fn prepare(stack: &Stack, webhook_port: u16) {
    let kubeconfig = stack.kube.kubeconfig.clone();
    Stack::block_on_fresh(async move {
        let client = client_for(&kubeconfig).await;
        install_crd(&client).await;
        create_namespace_with(&client, HOME, false, &[]).await;
        create_webhook_configuration_excluding(&client, CONFIG, webhook_port, Some(NO_WEBHOOK))
            .await;
    });
}

/// One scenario's world: a policy selecting namespaces labelled `e2e/test=<tag>`.
struct Scenario {
    client: Client,
    tag: String,
    parent: String,
}

impl Scenario {
    async fn new(stack: &Stack, spec_edit: impl FnOnce(&mut Value)) -> Self {
        let client = stack.kube.client().await;
        let tag = unique("s");
        let parent = format!("spiffe://{TD}/k8s/e2e/{tag}");
        let mut spec = json!({
            "trustDomain": TD,
            "parentID": parent,
            "ttl": "1h",
            "namespaceSelector": { "matchLabels": { "e2e/test": tag } }
        });
        spec_edit(&mut spec);
        Api::<SpiffeRegistration>::all(client.clone())
            .create(&PostParams::default(), &policy(&tag, spec))
            .await
            .expect("policy create");
        Self {
            client,
            tag,
            parent,
        }
    }

    async fn namespace(&self, webhook: bool) -> String {
        let name = unique(&self.tag);
        let mut labels = vec![("e2e/test", self.tag.as_str())];
        if !webhook {
            labels.push((NO_WEBHOOK, "true"));
        }
        create_namespace_with(&self.client, &name, true, &labels).await;
        name
    }

    /// An opted-in namespace with Deployment `web` (service account `default`), once registered:
    /// (namespace, its Deployments, the recorded entry ID).
    async fn registered_web(&self) -> (String, Api<Deployment>, String) {
        let ns = self.namespace(true).await;
        let api = self.deployments(&ns);
        api.create(&PostParams::default(), &deployment("web", None))
            .await
            .expect("create");
        let entry_id = registered(&api, "web").await;
        (ns, api, entry_id)
    }

    fn deployments(&self, ns: &str) -> Api<Deployment> {
        Api::namespaced(self.client.clone(), ns)
    }

    fn policies(&self) -> Api<SpiffeRegistration> {
        Api::all(self.client.clone())
    }
}

fn spiffe_id(ns: &str, sa: &str) -> String {
    format!("spiffe://{TD}/ns/{ns}/sa/{sa}")
}

fn entries_for(stack: &Stack, id: &str) -> Vec<Value> {
    stack.spire_server.entries(&["-spiffeID", id])
}

fn entry_id(entry: &Value) -> String {
    entry["id"].as_str().expect("entry id").to_string()
}

/// Waits until the Deployment records an entry ID and returns it.
async fn registered(api: &Api<Deployment>, name: &str) -> String {
    eventually(&format!("{name} to be registered"), WAIT, || async {
        let d = api.get(name).await.ok()?;
        annotation(&d, ENTRY_ID_ANNOTATION).map(str::to_string)
    })
    .await
}

async fn gone(api: &Api<Deployment>, name: &str) {
    eventually(&format!("{name} to be gone"), WAIT, || async {
        api.get_opt(name).await.ok()?.is_none().then_some(())
    })
    .await
}

async fn no_entries(stack: &Stack, id: &str) {
    let what = format!("no SPIRE entry for {id}");
    eventually(&what, WAIT, || async {
        entries_for(stack, id).is_empty().then_some(())
    })
    .await
}

async fn events(client: &Client, ns: &str, name: &str, reason: &str) -> Vec<Event> {
    let list = Api::<Event>::namespaced(client.clone(), ns)
        .list(&ListParams::default().fields(&format!("involvedObject.name={name}")))
        .await
        .expect("events");
    list.items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .collect()
}

fn tokio_env() -> &'static Env {
    tokio::task::block_in_place(env)
}

// 1.
#[tokio::test(flavor = "multi_thread")]
async fn deployment_is_registered_with_policy_selectors_parent_and_ttl() {
    let env = tokio_env();
    let _logs = env.stack.logs_on_panic();
    let s = Scenario::new(env.stack, |_| {}).await;
    let ns = s.namespace(true).await;
    let api = s.deployments(&ns);
    api.create(&PostParams::default(), &deployment("web", Some("api")))
        .await
        .expect("create");
    let recorded = registered(&api, "web").await;
    let entries = entries_for(env.stack, &spiffe_id(&ns, "api"));
    assert_eq!(entries.len(), 1, "{entries:?}");
    let entry = &entries[0];
    assert_eq!(entry_id(entry), recorded);
    assert!(recorded.starts_with("sreg.e2e."));
    assert_eq!(entry["parent_id"]["path"], format!("/k8s/e2e/{}", s.tag));
    assert_eq!(entry["x509_svid_ttl"], 3600);
    assert_eq!(entry["hint"], "spiffe-registrar/e2e");
    let mut selectors: Vec<String> = entry["selectors"]
        .as_array()
        .expect("selectors")
        .iter()
        .map(|s| {
            format!(
                "{}:{}",
                s["type"].as_str().unwrap_or(""),
                s["value"].as_str().unwrap_or("")
            )
        })
        .collect();
    selectors.sort();
    assert_eq!(
        selectors,
        vec![format!("k8s:ns:{ns}"), "k8s:sa:api".to_string()]
    );
    let stored = api.get("web").await.expect("get");
    assert!(has_finalizer(&stored));
    assert_eq!(
        annotation(&stored, SPIFFE_ID_ANNOTATION),
        Some(spiffe_id(&ns, "api").as_str())
    );
    let client = s.client.clone();
    eventually("a Registered Event", WAIT, || async {
        (!events(&client, &ns, "web", "Registered").await.is_empty()).then_some(())
    })
    .await;
    let status = eventually("policy status", WAIT, || async {
        let p = s.policies().get(&s.tag).await.ok()?;
        p.status
            .filter(|st| st.selected_workloads == 1 && st.entries == 1)
    })
    .await;
    assert_eq!(status.conditions[0].status, "True");
}

// 2.
#[tokio::test(flavor = "multi_thread")]
async fn shared_service_account_shares_one_refcounted_entry() {
    let env = tokio_env();
    let _logs = env.stack.logs_on_panic();
    let s = Scenario::new(env.stack, |_| {}).await;
    let ns = s.namespace(true).await;
    let api = s.deployments(&ns);
    api.create(&PostParams::default(), &deployment("one", Some("shared")))
        .await
        .expect("create");
    api.create(&PostParams::default(), &deployment("two", Some("shared")))
        .await
        .expect("create");
    let (a, b) = (registered(&api, "one").await, registered(&api, "two").await);
    assert_eq!(a, b, "one entry for one service account");
    let id = spiffe_id(&ns, "shared");
    assert_eq!(entries_for(env.stack, &id).len(), 1);

    api.delete("one", &DeleteParams::default())
        .await
        .expect("delete one");
    gone(&api, "one").await;
    let left = entries_for(env.stack, &id);
    assert_eq!(left.len(), 1, "the sibling still needs the entry");
    assert_eq!(entry_id(&left[0]), a);

    api.delete("two", &DeleteParams::default())
        .await
        .expect("delete two");
    gone(&api, "two").await;
    assert!(
        entries_for(env.stack, &id).is_empty(),
        "the entry went with the last Deployment"
    );
}

// 3.
#[tokio::test(flavor = "multi_thread")]
async fn policy_ttl_change_updates_the_entry_in_place() {
    let env = tokio_env();
    let _logs = env.stack.logs_on_panic();
    let s = Scenario::new(env.stack, |_| {}).await;
    let (ns, _api, before) = s.registered_web().await;
    let patch = json!({ "spec": { "ttl": "15m", "jwtTtl": "5m" } });
    s.policies()
        .patch(&s.tag, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("policy patch");
    let id = spiffe_id(&ns, "default");
    let entry = eventually("the TTL update", WAIT, || async {
        entries_for(env.stack, &id)
            .into_iter()
            .find(|e| e["x509_svid_ttl"] == 900)
    })
    .await;
    assert_eq!(entry_id(&entry), before, "updated in place, same ID");
    assert_eq!(entry["jwt_svid_ttl"], 300);
    assert_eq!(entries_for(env.stack, &id).len(), 1);
}

// 4.
#[tokio::test(flavor = "multi_thread")]
async fn entry_deleted_by_hand_is_recreated_within_a_resync() {
    let env = tokio_env();
    let _logs = env.stack.logs_on_panic();
    let s = Scenario::new(env.stack, |_| {}).await;
    let (ns, _api, recorded) = s.registered_web().await;
    env.stack
        .spire_server
        .cli_ok(&["entry", "delete"], &["-entryID", &recorded]);
    assert!(entries_for(env.stack, &spiffe_id(&ns, "default")).is_empty());
    // Resync is 10 s; allow two.
    let entry = eventually(
        "the entry to come back",
        Duration::from_secs(25),
        || async {
            entries_for(env.stack, &spiffe_id(&ns, "default"))
                .into_iter()
                .next()
        },
    )
    .await;
    assert_eq!(entry_id(&entry), recorded, "same deterministic ID");
}

// 5a.
#[tokio::test(flavor = "multi_thread")]
async fn namespace_label_removed_deletes_entries_and_releases_finalizers() {
    let env = tokio_env();
    let _logs = env.stack.logs_on_panic();
    let s = Scenario::new(env.stack, |_| {}).await;
    let (ns, api, _) = s.registered_web().await;
    let patch = json!({ "metadata": { "labels": { "spiffe.io/registrar": null } } });
    Api::<Namespace>::all(s.client.clone())
        .patch(&ns, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("unlabel");
    no_entries(env.stack, &spiffe_id(&ns, "default")).await;
    let released = eventually("finalizer and annotations removed", WAIT, || async {
        let d = api.get("web").await.ok()?;
        (!has_finalizer(&d) && annotation(&d, ENTRY_ID_ANNOTATION).is_none()).then_some(d)
    })
    .await;
    assert_eq!(annotation(&released, SPIFFE_ID_ANNOTATION), None);
}

// 5b.
#[tokio::test(flavor = "multi_thread")]
async fn policy_deleted_deletes_entries_and_releases_finalizers() {
    let env = tokio_env();
    let _logs = env.stack.logs_on_panic();
    let s = Scenario::new(env.stack, |_| {}).await;
    let (ns, api, _) = s.registered_web().await;
    s.policies()
        .delete(&s.tag, &DeleteParams::default())
        .await
        .expect("policy delete");
    no_entries(env.stack, &spiffe_id(&ns, "default")).await;
    eventually("finalizer removed", WAIT, || async {
        let d = api.get("web").await.ok()?;
        (!has_finalizer(&d)).then_some(())
    })
    .await;
}

// 7.
#[tokio::test(flavor = "multi_thread")]
async fn without_the_webhook_the_controller_backfills_then_registers() {
    let env = tokio_env();
    let _logs = env.stack.logs_on_panic();
    let s = Scenario::new(env.stack, |_| {}).await;
    let ns = s.namespace(false).await;
    let api = s.deployments(&ns);
    let created = api
        .create(&PostParams::default(), &deployment("web", Some("api")))
        .await
        .expect("create");
    assert!(
        !has_finalizer(&created),
        "the webhook is not called for this namespace"
    );
    let recorded = registered(&api, "web").await;
    let stored = api.get("web").await.expect("get");
    assert!(has_finalizer(&stored), "finalizer backfilled");
    assert_eq!(
        annotation(&stored, SPIFFE_ID_ANNOTATION),
        Some(spiffe_id(&ns, "api").as_str())
    );
    assert_eq!(
        entry_id(&entries_for(env.stack, &spiffe_id(&ns, "api"))[0]),
        recorded
    );
}

// 10.
#[tokio::test(flavor = "multi_thread")]
async fn another_writers_entries_survive_every_gc() {
    let env = tokio_env();
    let _logs = env.stack.logs_on_panic();
    let s = Scenario::new(env.stack, |_| {}).await;
    let ns = s.namespace(true).await;
    let api = s.deployments(&ns);
    // Same parent, same namespace selector, different service account; no hint.
    let theirs = spiffe_id(&ns, "theirs");
    env.stack.spire_server.cli_ok(
        &["entry", "create"],
        &[
            "-parentID",
            &s.parent,
            "-spiffeID",
            &theirs,
            "-selector",
            &format!("k8s:ns:{ns}"),
            "-selector",
            "k8s:sa:theirs",
        ],
    );
    // And one exactly equal to what our Deployment needs, written first by someone else.
    let clash = spiffe_id(&ns, "clash");
    env.stack.spire_server.cli_ok(
        &["entry", "create"],
        &[
            "-parentID",
            &s.parent,
            "-spiffeID",
            &clash,
            "-selector",
            &format!("k8s:ns:{ns}"),
            "-selector",
            "k8s:sa:clash",
        ],
    );
    api.create(&PostParams::default(), &deployment("web", None))
        .await
        .expect("create");
    api.create(
        &PostParams::default(),
        &deployment("clashing", Some("clash")),
    )
    .await
    .expect("create");
    registered(&api, "web").await;
    let client = s.client.clone();
    eventually(
        "an EquivalentEntryExists Event for the clash",
        WAIT,
        || async {
            (!events(&client, &ns, "clashing", "EquivalentEntryExists")
                .await
                .is_empty())
            .then_some(())
        },
    )
    .await;
    api.delete("web", &DeleteParams::default())
        .await
        .expect("delete");
    api.delete("clashing", &DeleteParams::default())
        .await
        .expect("delete");
    gone(&api, "web").await;
    gone(&api, "clashing").await;
    // Two resyncs (10 s each) with GC.
    tokio::time::sleep(Duration::from_secs(22)).await;
    assert_eq!(
        entries_for(env.stack, &theirs).len(),
        1,
        "their entry survives"
    );
    assert_eq!(
        entries_for(env.stack, &clash).len(),
        1,
        "their equivalent entry is not adopted, not deleted"
    );
    assert!(entries_for(env.stack, &spiffe_id(&ns, "default")).is_empty());
}

// 11.
#[tokio::test(flavor = "multi_thread")]
async fn invalid_policy_reports_a_condition_and_an_event_and_registers_nothing() {
    let env = tokio_env();
    let _logs = env.stack.logs_on_panic();
    // Passes the CRD's pattern, fails SPIFFE ID rules ('..' segment).
    let s = Scenario::new(env.stack, |spec| {
        spec["parentID"] = format!("spiffe://{TD}/k8s/..").into()
    })
    .await;
    let ns = s.namespace(true).await;
    let api = s.deployments(&ns);
    api.create(&PostParams::default(), &deployment("web", None))
        .await
        .expect("create");
    let condition = eventually("Ready=False", WAIT, || async {
        let p = s.policies().get(&s.tag).await.ok()?;
        p.status?
            .conditions
            .into_iter()
            .find(|c| c.type_ == "Ready" && c.status == "False")
    })
    .await;
    assert_eq!(condition.reason, "InvalidParentID");
    assert!(
        condition.message.contains("parentID"),
        "{}",
        condition.message
    );
    let client = s.client.clone();
    let tag = s.tag.clone();
    eventually("an InvalidParentID Event on the policy", WAIT, || async {
        (!events(&client, "default", &tag, "InvalidParentID")
            .await
            .is_empty())
        .then_some(())
    })
    .await;
    eventually(
        "a RegistrationFailed Event on the Deployment",
        WAIT,
        || async {
            (!events(&client, &ns, "web", "RegistrationFailed")
                .await
                .is_empty())
            .then_some(())
        },
    )
    .await;
    assert!(entries_for(env.stack, &spiffe_id(&ns, "default")).is_empty());
    assert_eq!(
        annotation(&api.get("web").await.expect("get"), ENTRY_ID_ANNOTATION),
        None
    );
}

/// Starts a registrar on `stack` (webhook on `port` when given) and hands it to the sentinel.
fn launch(
    stack: &Stack,
    port: Option<u16>,
    cluster: &'static str,
    name: &'static str,
    env: Vec<(String, String)>,
) -> Registrar {
    let options = options(cluster, name, registrar_args(), env);
    let registrar = tokio::task::block_in_place(|| match port {
        Some(port) => Registrar::start_on(stack, port, options),
        None => Registrar::start(stack, options),
    });
    stack.track(registrar.process.pgid());
    registrar
}

/// A stack of its own with CRD and webhook configuration, for scenarios that break things.
fn own_stack() -> (Stack, u16) {
    let stack = Stack::start();
    let port = common::paths::free_port();
    prepare(&stack, port);
    (stack, port)
}

// 6.
#[tokio::test(flavor = "multi_thread")]
async fn with_spire_down_deletion_waits_then_completes() {
    let (mut stack, port) = tokio::task::block_in_place(own_stack);
    let registrar = launch(&stack, Some(port), "down", "registrar", vec![]);
    let s = Scenario::new(&stack, |_| {}).await;
    let (ns, api, _) = s.registered_web().await;

    stack.spire_server.stop();
    api.delete("web", &DeleteParams::default())
        .await
        .expect("delete");
    // Several sync attempts while SPIRE is down.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let held = api.get("web").await.expect("still there");
    assert!(
        held.metadata.deletion_timestamp.is_some() && has_finalizer(&held),
        "Terminating while SPIRE is down"
    );

    tokio::task::block_in_place(|| stack.spire_server.restart());
    stack.record_groups();
    gone(&api, "web").await;
    assert!(
        stack
            .spire_server
            .entries(&["-spiffeID", &spiffe_id(&ns, "default")])
            .is_empty()
    );
    drop(registrar);
    tokio::task::block_in_place(|| stack.stop());
}

// 8.
#[tokio::test(flavor = "multi_thread")]
async fn two_replicas_one_writer_and_failover() {
    let (mut stack, port) = tokio::task::block_in_place(own_stack);
    let a = launch(&stack, Some(port), "ha", "replica-a", vec![]);
    let b = launch(&stack, None, "ha", "replica-b", vec![]);
    let s = Scenario::new(&stack, |_| {}).await;
    // The webhook configuration points at replica-a, which may be killed: use a namespace the
    // webhook skips, so only the controllers act.
    let ns = s.namespace(false).await;
    let api = s.deployments(&ns);
    api.create(&PostParams::default(), &deployment("before", None))
        .await
        .expect("create");
    registered(&api, "before").await;
    let leader = holder(&s.client).await;
    // SPIRE writes, from each replica's metrics (creates, updates, deletes; not lists).
    let writes = |r: &Registrar| {
        ["create", "update", "delete"]
            .iter()
            .map(|op| r.metric("spire_api_entries_total", &[("op", op)]))
            .sum::<f64>()
    };
    let (writes_a, writes_b) = (writes(&a), writes(&b));
    assert!(
        (writes_a > 0.0) != (writes_b > 0.0),
        "exactly one replica writes (a: {writes_a}, b: {writes_b}, lease holder: {leader})"
    );
    let (mut old_leader, survivor) = if writes_a > 0.0 { (a, b) } else { (b, a) };
    assert_eq!(leader, old_leader.process.name);
    old_leader.process.kill();
    api.create(&PostParams::default(), &deployment("after", Some("late")))
        .await
        .expect("create");
    registered(&api, "after").await;
    assert_eq!(
        holder(&s.client).await,
        survivor.process.name,
        "the other replica took the Lease"
    );
    assert!(writes(&survivor) > 0.0, "and wrote");
    drop(survivor);
    tokio::task::block_in_place(|| stack.stop());
}

async fn holder(client: &Client) -> String {
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), HOME);
    let lease = leases
        .get(spiffe_registrar::leader::LEASE_NAME)
        .await
        .expect("the Lease exists");
    lease
        .spec
        .and_then(|s| s.holder_identity)
        .expect("a holder")
}

// 9.
#[tokio::test(flavor = "multi_thread")]
async fn crash_between_create_and_annotate_leaves_no_duplicate() {
    let (mut stack, port) = tokio::task::block_in_place(own_stack);
    let env = vec![(
        "SPIFFE_REGISTRAR_FAILPOINT".to_string(),
        "pause-after-create".to_string(),
    )];
    let mut crashing = launch(&stack, Some(port), "crash", "registrar", env);
    let s = Scenario::new(&stack, |_| {}).await;
    let ns = s.namespace(true).await;
    let api = s.deployments(&ns);
    api.create(&PostParams::default(), &deployment("web", None))
        .await
        .expect("create");
    let id = spiffe_id(&ns, "default");
    eventually("the entry to be created", WAIT, || async {
        (!stack.spire_server.entries(&["-spiffeID", &id]).is_empty()).then_some(())
    })
    .await;
    crashing.process.kill();
    assert_eq!(
        annotation(&api.get("web").await.expect("get"), ENTRY_ID_ANNOTATION),
        None,
        "killed before annotating"
    );

    let restarted = launch(&stack, Some(port), "crash", "restarted", vec![]);
    let recorded = registered(&api, "web").await;
    let entries = stack.spire_server.entries(&["-spiffeID", &id]);
    assert_eq!(
        entries.len(),
        1,
        "no duplicate after the crash: {entries:?}"
    );
    assert_eq!(entry_id(&entries[0]), recorded);
    drop(restarted);
    drop(crashing);
    tokio::task::block_in_place(|| stack.stop());
}

// Break-glass: a finalizer removed by hand (the registrar never sees the Deployment go through
// its finalizer); the orphaned entry is garbage-collected.
#[tokio::test(flavor = "multi_thread")]
async fn forcibly_removed_finalizer_orphans_are_garbage_collected() {
    let env = tokio_env();
    let _logs = env.stack.logs_on_panic();
    let s = Scenario::new(env.stack, |_| {}).await;
    let (ns, api, recorded) = s.registered_web().await;
    let remove = json!([{ "op": "remove", "path": "/metadata/finalizers" }]);
    api.patch(
        "web",
        &PatchParams::default(),
        &Patch::<()>::Json(serde_json::from_value(remove).expect("patch")),
    )
    .await
    .expect("finalizer removal");
    api.delete("web", &DeleteParams::default())
        .await
        .expect("delete");
    gone(&api, "web").await;
    no_entries(env.stack, &spiffe_id(&ns, "default")).await;
    assert!(
        env.stack
            .spire_server
            .entries(&["-entryID", &recorded])
            .is_empty()
    );
}

// `spiffe-registrar plan` shows what a sync would do and changes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn plan_prints_the_changes_and_writes_nothing() {
    let env = tokio_env();
    let _logs = env.stack.logs_on_panic();
    let s = Scenario::new(env.stack, |_| {}).await;
    let (ns, _api, _) = s.registered_web().await;
    // A cluster name with no entries yet: everything in scope is a create.
    let output = tokio::task::block_in_place(|| {
        common::process::run(
            std::process::Command::new(common::registrar::binary())
                .env("KUBECONFIG", &env.stack.kube.kubeconfig)
                .args(["plan", "--cluster-name=e2e-plan"])
                .arg(format!(
                    "--spire-socket={}",
                    env.stack.spire_server.socket.display()
                )),
        )
    });
    let (ok, stdout, stderr) = output;
    assert!(ok, "plan failed: {stderr}");
    let wanted = format!("{} (for {ns}/web)", spiffe_id(&ns, "default"));
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("create sreg.e2e-plan.") && l.ends_with(&wanted)),
        "{stdout}"
    );
    assert!(
        env.stack
            .spire_server
            .entries(&["-hint", "spiffe-registrar/e2e-plan"])
            .is_empty(),
        "plan wrote to SPIRE"
    );
}

// A replica stopped with SIGTERM (a rollout, a drain) releases the Lease before exiting, and
// the other replica takes it within one lease duration. (kube-lease-manager's followers only
// look again when the lease they last saw would expire, so the handover is not instant.)
#[tokio::test(flavor = "multi_thread")]
async fn graceful_shutdown_releases_the_lease_for_the_other_replica() {
    let (mut stack, port) = tokio::task::block_in_place(own_stack);
    let args = || {
        vec![
            "--resync-interval=10s".to_string(),
            "--lease-duration=10s".to_string(),
            "--renew-deadline=5s".to_string(),
        ]
    };
    let mut first = tokio::task::block_in_place(|| {
        Registrar::start_on(&stack, port, options("handover", "first", args(), vec![]))
    });
    stack.track(first.process.pgid());
    let client = stack.kube.client().await;
    eventually("first to lead", WAIT, || async {
        (holder_opt(&client).await.as_deref() == Some("first")).then_some(())
    })
    .await;
    let second = tokio::task::block_in_place(|| {
        Registrar::start(&stack, options("handover", "second", args(), vec![]))
    });
    stack.track(second.process.pgid());

    let stopped = std::time::Instant::now();
    tokio::task::block_in_place(|| first.process.stop(Duration::from_secs(15)));
    let after_exit = holder_opt(&client).await;
    assert!(
        matches!(after_exit.as_deref(), None | Some("") | Some("second")),
        "the Lease is released on exit, not left to expire: held by {after_exit:?}"
    );
    eventually("second to take over", Duration::from_secs(20), || async {
        (holder_opt(&client).await.as_deref() == Some("second")).then_some(())
    })
    .await;
    // A Lease left to expire would keep `second` out for its whole 10 s after the last renewal.
    assert!(
        stopped.elapsed() < Duration::from_secs(8),
        "took over after {:?}",
        stopped.elapsed()
    );
    drop(second);
    tokio::task::block_in_place(|| stack.stop());
}

async fn holder_opt(client: &Client) -> Option<String> {
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), HOME);
    leases
        .get(spiffe_registrar::leader::LEASE_NAME)
        .await
        .ok()?
        .spec?
        .holder_identity
}
