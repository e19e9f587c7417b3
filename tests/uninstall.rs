//! `spiffe-registrar uninstall` against the real kube-apiserver (with kube-controller-manager's
//! namespace controller) and spire-server: it refuses while a replica leads, then removes the
//! webhook configuration, our finalizers and annotations (nothing of anyone else's), keeps the
//! SPIRE entries unless `--delete-entries` is given, and then deletes only ours.

mod common;

use common::k8s::{annotation, deployment, eventually, has_finalizer};
use common::paths::free_port;
use common::registrar::{Options, Registrar, uninstall};
use common::stack::Stack;
use common::world::{HOME, Scenario, WAIT, WEBHOOK_CONFIG, prepare};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use spiffe_registrar::names::{ENTRY_ID_ANNOTATION, SPIFFE_ID_ANNOTATION};
use std::time::Duration;

const CLUSTER: &str = "un";
const FOREIGN_ID: &str = "spiffe://example.org/other-tool/x";

fn ours_gone(d: &Deployment) -> bool {
    !has_finalizer(d)
        && annotation(d, SPIFFE_ID_ANNOTATION).is_none()
        && annotation(d, ENTRY_ID_ANNOTATION).is_none()
}

#[tokio::test(flavor = "multi_thread")]
async fn uninstall_leaves_nothing_stuck_and_deletes_only_our_entries_when_asked() {
    let stack = Stack::shared_held();
    let port = free_port();
    tokio::task::block_in_place(|| prepare(&stack.kube, port));
    let mut registrar = tokio::task::block_in_place(|| {
        Registrar::start_on(
            &stack,
            port,
            Options {
                namespace: HOME,
                webhook_configuration: WEBHOOK_CONFIG,
                cluster_name: CLUSTER,
                name: "registrar",
                extra_args: vec!["--spire-rps=0".into()],
                extra_env: vec![],
            },
        )
    });
    stack.track(registrar.process.pgid());
    let s = Scenario::new(&stack.kube).await;
    s.policy("p", s.spec("p")).await;
    let ns = s.namespace(true).await;
    s.registered(&ns, "a", "shared").await;
    s.registered(&ns, "b", "shared").await;
    // Someone else's finalizer and annotation stay.
    let mut kept = deployment("c", Some("own"));
    kept.metadata.finalizers = Some(vec!["e2e.io/keep".into()]);
    kept.metadata.annotations = Some([("team".to_string(), "payments".to_string())].into());
    s.deployments(&ns)
        .create(&PostParams::default(), &kept)
        .await
        .expect("create");
    common::world::entry_id_of(&s.deployments(&ns), "c").await;
    let mut ids = Vec::new();
    for name in ["a", "c"] {
        let d = s.deployments(&ns).get(name).await.expect("get");
        ids.push(
            annotation(&d, SPIFFE_ID_ANNOTATION)
                .expect("stamped")
                .to_string(),
        );
    }
    let spire = &stack.spire_server;
    spire.cli_ok(
        &["entry", "create"],
        &[
            "-spiffeID",
            FOREIGN_ID,
            "-parentID",
            "spiffe://example.org/other-tool",
            "-selector",
            "k8s:ns:elsewhere",
        ],
    );

    // While the registrar leads, nothing is touched.
    let (ok, stdout, stderr) = uninstall(&stack, &[&format!("--namespace={HOME}")]);
    assert!(
        !ok,
        "uninstall must refuse while a replica leads:\n{stdout}"
    );
    assert!(stderr.contains("still holds the Lease"), "{stderr}");
    let configs: Api<MutatingWebhookConfiguration> = Api::all(s.client.clone());
    assert!(
        configs
            .get_opt(WEBHOOK_CONFIG)
            .await
            .expect("get")
            .is_some()
    );
    let all = s
        .deployments(&ns)
        .list(&Default::default())
        .await
        .expect("list");
    assert!(all.items.iter().all(has_finalizer), "nothing changed");

    // Scaled to 0 (SIGTERM releases the Lease), then uninstalled without deleting entries.
    registrar.process.terminate(Duration::from_secs(10));
    let args = [
        format!("--namespace={HOME}"),
        format!("--webhook-configuration={WEBHOOK_CONFIG}"),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, stdout, stderr) = uninstall(&stack, &args);
    assert!(ok, "uninstall failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("from 3 workloads"), "{stdout}");
    assert!(
        configs
            .get_opt(WEBHOOK_CONFIG)
            .await
            .expect("get")
            .is_none()
    );
    for d in s
        .deployments(&ns)
        .list(&Default::default())
        .await
        .expect("list")
        .items
    {
        assert!(ours_gone(&d), "{:?} still carries ours", d.metadata);
    }
    let c = s.deployments(&ns).get("c").await.expect("get");
    assert_eq!(c.metadata.finalizers, Some(vec!["e2e.io/keep".to_string()]));
    assert_eq!(annotation(&c, "team"), Some("payments"));
    for id in &ids {
        assert_eq!(spire.entries(&["-spiffeID", id]).len(), 1, "{id} is kept");
    }
    // A second run finds nothing left to do.
    let (ok, stdout, _) = uninstall(&stack, &args);
    assert!(
        ok && stdout.contains("from 0 workloads") && stdout.contains("already gone"),
        "{stdout}"
    );

    // Without the webhook, new Deployments are not stamped; and the namespace deletes.
    s.deployments(&ns)
        .create(&PostParams::default(), &deployment("late", Some("shared")))
        .await
        .expect("create");
    assert!(ours_gone(
        &s.deployments(&ns).get("late").await.expect("get")
    ));
    s.deployments(&ns)
        .patch(
            "c",
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "finalizers": null } })),
        )
        .await
        .expect("drop the test's own finalizer");
    let namespaces: Api<Namespace> = Api::all(s.client.clone());
    namespaces
        .delete(&ns, &DeleteParams::default())
        .await
        .expect("delete namespace");
    eventually("the namespace to be deleted", WAIT, || async {
        namespaces.get_opt(&ns).await.ok()?.is_none().then_some(())
    })
    .await;

    // Entries only with the flag, and only ours.
    let socket = format!("--spire-socket={}", spire.socket.display());
    let cluster = format!("--cluster-name={CLUSTER}");
    let mut with_entries = args.clone();
    with_entries.extend(["--delete-entries", &socket, &cluster]);
    let (ok, stdout, stderr) = uninstall(&stack, &with_entries);
    assert!(ok, "uninstall --delete-entries failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("deleted 2 SPIRE entries"), "{stdout}");
    for id in &ids {
        assert!(
            spire.entries(&["-spiffeID", id]).is_empty(),
            "{id} is deleted"
        );
    }
    assert_eq!(
        spire.entries(&["-spiffeID", FOREIGN_ID]).len(),
        1,
        "not ours: kept"
    );
}

#[test]
fn delete_entries_without_a_spire_endpoint_fails_before_changing_anything() {
    let stack = Stack::shared();
    let (ok, stdout, stderr) = uninstall(
        stack,
        &["--delete-entries", "--webhook-configuration=never-touched"],
    );
    assert!(!ok, "{stdout}");
    assert!(
        stderr.contains("--spire-socket or --spire-address"),
        "the error names the flags: {stderr}"
    );
}
