//! `tests/demo`: the whole product on a local control plane, in front of you.
//! Starts etcd, kube-apiserver, spire-server and spire-agent, runs the registrar (webhook +
//! controller), applies a policy and a Deployment with kubectl, and shows what a user sees.
//! `--keep` leaves everything running until Ctrl-C.

#[path = "../common/mod.rs"]
mod common;

use common::Stack;
use common::k8s::{create_namespace, create_webhook_configuration, eventually};
use common::process::run;
use common::registrar::{Options, Registrar};
use k8s_openapi::api::apps::v1::Deployment;
use kube::Api;
use std::process::Command;
use std::time::{Duration, Instant};

fn show(title: &str, command: &mut Command) {
    println!("\n$ {title}");
    let (ok, stdout, stderr) = run(command);
    print!("{stdout}");
    if !ok {
        eprintln!("{stderr}");
        panic!("`{title}` failed");
    }
}

#[tokio::main]
async fn main() {
    let keep = std::env::args().any(|a| a == "--keep");
    let started = Instant::now();
    let stack = std::sync::Arc::new(
        tokio::task::spawn_blocking(Stack::start)
            .await
            .expect("stack"),
    );
    let manifests = concat!(env!("CARGO_MANIFEST_DIR"), "/manifests");
    let client = stack.kube.client().await;
    let kubeconfig = stack.kube.kubeconfig.clone();
    let kubectl = || common::kube_plane::kubectl_command(&kubeconfig);

    show(
        "kubectl apply --server-side -f manifests/base/crd.yaml",
        kubectl().args([
            "apply",
            "--server-side",
            "-f",
            &format!("{manifests}/base/crd.yaml"),
        ]),
    );
    show(
        "kubectl wait --for=condition=Established crd/spifferegistrations.registrar.spiffe.io",
        kubectl().args([
            "wait",
            "--for=condition=Established",
            "crd/spifferegistrations.registrar.spiffe.io",
        ]),
    );
    create_namespace(&client, "spiffe-registrar", false).await;
    let port = common::paths::free_port();
    create_webhook_configuration(&client, "spiffe-registrar", port).await;
    let registrar = {
        let stack = stack.clone();
        tokio::task::spawn_blocking(move || {
            Registrar::start_on(
                &stack,
                port,
                Options {
                    namespace: "spiffe-registrar",
                    webhook_configuration: "spiffe-registrar",
                    cluster_name: "demo",
                    name: "registrar",
                    extra_args: vec![],
                    extra_env: vec![("RUST_LOG".into(), "info".into())],
                },
            )
        })
        .await
        .expect("registrar")
    };
    stack.track(registrar.process.pgid());
    println!(
        "\n# registrar running (webhook https://127.0.0.1:{port}/mutate, admin http://127.0.0.1:{}/metrics)",
        registrar.admin_port
    );

    // The policy's parent is the demo agent, so the agent is allowed to hand out the SVIDs.
    let policy = format!(
        "apiVersion: registrar.spiffe.io/v1alpha1\nkind: SpiffeRegistration\nmetadata:\n  name: default\nspec:\n  trustDomain: example.org\n  parentID: {}\n  ttl: 1h\n",
        stack.spire_agent.agent_id
    );
    let policy_file = stack.dir().join("policy.yaml");
    std::fs::write(&policy_file, policy).expect("policy file");
    show(
        "kubectl apply -f policy.yaml   # a SpiffeRegistration",
        kubectl().args(["apply", "-f"]).arg(&policy_file),
    );
    // The apiserver learns about new webhook configurations asynchronously.
    tokio::time::sleep(Duration::from_secs(2)).await;
    show(
        "kubectl apply -f manifests/examples/demo-workload.yaml",
        kubectl().args([
            "apply",
            "-f",
            &format!("{manifests}/examples/demo-workload.yaml"),
        ]),
    );

    let api: Api<Deployment> = Api::namespaced(client.clone(), "demo");
    let entry_id = eventually(
        "demo/web to be registered",
        Duration::from_secs(60),
        || async {
            api.get("web")
                .await
                .ok()?
                .metadata
                .annotations?
                .get("registrar.spiffe.io/entry-id")
                .cloned()
        },
    )
    .await;
    let registered_at = started.elapsed();
    // Events are written right after the annotation.
    tokio::time::sleep(Duration::from_millis(500)).await;
    show(
        "kubectl describe deployment web -n demo",
        kubectl().args(["describe", "deployment", "web", "-n", "demo"]),
    );
    show("kubectl get sreg", kubectl().args(["get", "sreg"]));
    show(
        &format!("spire-server entry show -entryID {entry_id}"),
        stack
            .spire_server
            .cli(&["entry", "show"])
            .args(["-entryID", &entry_id]),
    );
    println!(
        "\n# demo/web registered {:.1} s after start; {:.1} s in all",
        registered_at.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    if keep {
        println!("export KUBECONFIG={}", stack.kube.kubeconfig.display());
        println!(
            "# spire-server admin socket: {}",
            stack.spire_server.socket.display()
        );
        println!("# Ctrl-C stops everything.");
        let _ = tokio::signal::ctrl_c().await;
    }
    drop(registrar);
}
