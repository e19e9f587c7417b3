//! The manifests are proven, not assumed: the CRD is the one the code generates, the kustomize
//! bases apply to a real kube-apiserver (server-side), and the registrar registers a Deployment
//! with nothing but the manifests' ServiceAccount credentials (a TokenRequest token), so a
//! missing RBAC rule fails here.

mod common;

use common::Stack;
use common::k8s::{create_namespace, deployment, eventually, policy, token_kubeconfig};
use common::process::run;
use common::registrar::{Options, Registrar};
use common::stack::kubectl_ok;
use k8s_openapi::api::apps::v1::Deployment;
use kube::Api;
use kube::api::PostParams;
use serde_json::json;
use spiffe_registrar::names::ENTRY_ID_ANNOTATION;
use spiffe_registrar::policy::SpiffeRegistration;
use std::time::Duration;

const MANIFESTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/manifests");

#[test]
fn checked_in_crd_is_what_the_code_generates() {
    let generated = spiffe_registrar::policy::crd::yaml().expect("the CRD serializes");
    let committed = std::fs::read_to_string(format!("{MANIFESTS}/base/crd.yaml"))
        .expect("manifests/base/crd.yaml");
    assert!(
        generated == committed,
        "manifests/base/crd.yaml is stale: run `cargo run -- crd > manifests/base/crd.yaml`"
    );
}

#[test]
fn crd_subcommand_prints_the_same_bytes() {
    let (ok, stdout, stderr) =
        run(std::process::Command::new(env!("CARGO_BIN_EXE_spiffe-registrar")).arg("crd"));
    assert!(ok, "{stderr}");
    let committed =
        std::fs::read_to_string(format!("{MANIFESTS}/base/crd.yaml")).expect("crd.yaml");
    assert!(
        stdout == committed,
        "`spiffe-registrar crd` differs from manifests/base/crd.yaml"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn manifests_apply_and_their_rbac_is_enough_to_register() {
    let mut stack = tokio::task::block_in_place(Stack::start);
    let base = format!("{MANIFESTS}/base");
    tokio::task::block_in_place(|| {
        kubectl_ok(&stack, &["apply", "--server-side", "-k", &base]);
        kubectl_ok(
            &stack,
            &[
                "wait",
                "--for=condition=Established",
                "crd/spifferegistrations.registrar.spiffe.io",
                "--timeout=60s",
            ],
        );
        // The webhook's conditions compiled on the apiserver, and are the code's own.
        let conditions = kubectl_ok(
            &stack,
            &[
                "get",
                "mutatingwebhookconfiguration",
                "spiffe-registrar",
                "-o",
                "jsonpath={.webhooks[0].matchConditions[1]}",
            ],
        );
        let condition: serde_json::Value =
            serde_json::from_str(&conditions).expect("a matchCondition");
        assert_eq!(
            condition,
            json!({
                "name": spiffe_registrar::webhook::RELEVANT_UPDATE_CONDITION_NAME,
                "expression": spiffe_registrar::webhook::RELEVANT_UPDATE_CONDITION,
            }),
            "manifests/base/webhook.yaml differs from webhook::RELEVANT_UPDATE_CONDITION"
        );
        // The sidecar variant must at least be accepted by the apiserver.
        kubectl_ok(&stack, &["create", "namespace", "spire"]);
        kubectl_ok(
            &stack,
            &[
                "apply",
                "--server-side",
                "--dry-run=server",
                "-k",
                &format!("{MANIFESTS}/sidecar"),
            ],
        );
    });

    // Credentials of the manifests' ServiceAccount, and nothing else.
    let token = tokio::task::block_in_place(|| {
        kubectl_ok(
            &stack,
            &[
                "-n",
                "spiffe-registrar",
                "create",
                "token",
                "spiffe-registrar",
                "--duration=1h",
            ],
        )
    });
    let kubeconfig = stack.dir().join("registrar.kubeconfig");
    let ca = std::fs::read_to_string(stack.dir().join("kube-certs/ca.crt")).expect("CA");
    std::fs::write(
        &kubeconfig,
        token_kubeconfig(&stack.kube.url, &ca, token.trim()),
    )
    .expect("kubeconfig");

    let client = stack.kube.client().await;
    let spec = json!({ "trustDomain": "example.org", "parentID": "spiffe://example.org/k8s/manifests", "ttl": "1h" });
    Api::<SpiffeRegistration>::all(client.clone())
        .create(&PostParams::default(), &policy("default", spec))
        .await
        .expect("policy");
    create_namespace(&client, "shop", true).await;

    let registrar = tokio::task::block_in_place(|| {
        Registrar::start_with_kubeconfig(
            &stack,
            &kubeconfig,
            Options {
                namespace: "spiffe-registrar",
                webhook_configuration: "spiffe-registrar",
                // Derived from kube-system's UID, under the manifests' RBAC.
                cluster_name: "",
                name: "registrar",
                extra_args: vec!["--resync-interval=10s".into()],
                extra_env: vec![],
            },
        )
    });
    stack.track(registrar.process.pgid());

    let api: Api<Deployment> = Api::namespaced(client.clone(), "shop");
    api.create(&PostParams::default(), &deployment("web", Some("api")))
        .await
        .expect("create");
    let entry_id = eventually("web to be registered", Duration::from_secs(60), || async {
        let d = api.get("web").await.ok()?;
        d.metadata.annotations?.get(ENTRY_ID_ANNOTATION).cloned()
    })
    .await;
    assert!(
        entry_id.starts_with("sreg.k-"),
        "cluster name derived from kube-system: {entry_id}"
    );
    let entries = stack.spire_server.entries(&["-entryID", &entry_id]);
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0]["spiffe_id"]["path"], "/ns/shop/sa/api");
    // Status and Events need their own rules; wait for both.
    eventually("policy status written", Duration::from_secs(30), || async {
        let p = Api::<SpiffeRegistration>::all(client.clone())
            .get("default")
            .await
            .ok()?;
        p.status.filter(|s| s.entries == 1).map(|_| ())
    })
    .await;
    // Events are queued and paced: wait for it rather than reading once.
    eventually(
        "a Registered Event published",
        Duration::from_secs(30),
        || async {
            let events = tokio::task::block_in_place(|| {
                kubectl_ok(&stack, &["-n", "shop", "get", "events", "-o", "json"])
            });
            events.contains("\"Registered\"").then_some(())
        },
    )
    .await;
    let forbidden = registrar.metric(
        "kube_write_duration_seconds_count",
        &[("result", "forbidden")],
    );
    assert_eq!(
        forbidden, 0.0,
        "the registrar hit an RBAC denial on a write"
    );
    drop(registrar);
    tokio::task::block_in_place(|| stack.stop());
}
