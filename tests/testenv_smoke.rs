//! Proves the test bed is real: the apiserver stores and serves objects, spire-server accepts
//! an entry over its admin socket, spire-agent issues the SVID for it to this very process, and
//! stopping the stack leaves no child behind.

mod common;

use common::Stack;
use common::process::{group_alive, wait_until};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::api::PostParams;
use std::time::Duration;

fn namespace(name: &str) -> Namespace {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": { "name": name, "labels": { "spiffe.io/registrar": "enabled" } }
    }))
    .expect("namespace JSON must match the type")
}

fn deployment(name: &str) -> Deployment {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": { "name": name },
        "spec": {
            "replicas": 1,
            "selector": { "matchLabels": { "app": name } },
            "template": {
                "metadata": { "labels": { "app": name } },
                "spec": { "containers": [{ "name": "app", "image": "registry.invalid/app:1" }] }
            }
        }
    }))
    .expect("deployment JSON must match the type")
}

#[tokio::test(flavor = "multi_thread")]
async fn stack_is_real_and_leaves_nothing_running() {
    let mut stack = tokio::task::block_in_place(Stack::start);
    let pgids = stack.pgids();

    {
        let client = stack.kube.client().await;
        let namespaces: Api<Namespace> = Api::all(client.clone());
        namespaces
            .create(&PostParams::default(), &namespace("smoke"))
            .await
            .expect("namespace create must succeed");
        let stored = namespaces
            .get("smoke")
            .await
            .expect("namespace must read back");
        assert_eq!(
            stored
                .metadata
                .labels
                .unwrap_or_default()
                .get("spiffe.io/registrar")
                .map(String::as_str),
            Some("enabled")
        );

        let deployments: Api<Deployment> = Api::namespaced(client, "smoke");
        deployments
            .create(&PostParams::default(), &deployment("web"))
            .await
            .expect("deployment create must succeed");
        let stored = deployments
            .get("web")
            .await
            .expect("deployment must read back");
        assert!(stored.metadata.uid.is_some(), "the apiserver assigns a uid");
        assert_eq!(stored.spec.and_then(|s| s.replicas), Some(1));

        let uid = nix::unistd::getuid().as_raw();
        let spiffe_id = format!("spiffe://{}/smoke/uid-{uid}", common::spire::TRUST_DOMAIN);
        let selector = format!("unix:uid:{uid}");
        stack.spire_server.cli_ok(
            &["entry", "create"],
            &[
                "-parentID",
                &stack.spire_agent.agent_id,
                "-spiffeID",
                &spiffe_id,
                "-selector",
                &selector,
            ],
        );
        // Entries reach the agent through the server cache and the agent sync (~5 s each).
        tokio::task::block_in_place(|| {
            wait_until(
                "the agent to issue the X509-SVID",
                Duration::from_secs(60),
                || {
                    stack.spire_agent.fetch_x509().is_some_and(|out| {
                        out.lines()
                            .any(|l| l.starts_with("SPIFFE ID:") && l.ends_with(&spiffe_id))
                    })
                },
            )
        });
    }

    tokio::task::block_in_place(|| stack.stop());
    for pgid in pgids {
        assert!(
            !group_alive(pgid),
            "process group {pgid} survived Stack::stop"
        );
    }
}
