//! `tests/demo`: the whole product on a local cluster, in front of you.
//! Starts etcd, kube-apiserver, kube-controller-manager, spire-server and a node (kubelet,
//! containerd, kube-scheduler) running SPIRE's agent as a DaemonSet attested by k8s_psat; runs
//! the registrar (webhook + controller), applies the example policy and a Deployment with
//! kubectl, shows what a user sees, and ends with the SVID the Deployment's Pod fetched from
//! the Workload API. `--keep` leaves everything running until Ctrl-C.

#[path = "../common/mod.rs"]
mod common;

use common::Stack;
use common::k8s::{create_namespace, create_webhook_configuration, eventually};
use common::node_agent::{PSAT_CLUSTER, workload_deployment};
use common::process::run;
use common::registrar::{Options, Registrar};
use common::reports;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
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
        tokio::task::spawn_blocking(Stack::start_with_node)
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
                    // The name SPIRE's k8s_psat attestor knows the bed's cluster by.
                    extra_args: vec![format!("--node-alias-cluster={PSAT_CLUSTER}")],
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

    show(
        "kubectl apply -f manifests/examples/spiffe-registration.yaml   # no parentID: the node alias",
        kubectl().args([
            "apply",
            "-f",
            &format!("{manifests}/examples/spiffe-registration.yaml"),
        ]),
    );
    // The apiserver learns about new webhook configurations asynchronously.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (node, agent) = stack.node();
    let workload = format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: demo\n  labels:\n    spiffe.io/registrar: enabled\n---\n{}",
        workload_deployment(
            "demo",
            "web",
            "api",
            1,
            &agent.reports,
            &node.dir.join("agent-sockets")
        )
    );
    let workload_file = stack.dir().join("workload.yaml");
    std::fs::write(&workload_file, workload).expect("workload file");
    show(
        &format!(
            "kubectl apply -f {}   # namespace demo (opted in), Deployment web as service account api",
            workload_file.display()
        ),
        kubectl().args(["apply", "-f"]).arg(&workload_file),
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
    show(
        "kubectl get pods -n demo -o wide",
        kubectl().args(["get", "pods", "-n", "demo", "-o", "wide"]),
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), "demo");
    let pod = eventually("demo/web's Pod", Duration::from_secs(90), || async {
        pods.list(&ListParams::default().labels("app=web"))
            .await
            .ok()?
            .items
            .into_iter()
            .find_map(|p| p.metadata.name)
    })
    .await;
    let svid = eventually(
        "the Pod to hold its SVID",
        Duration::from_secs(90),
        || async {
            let lines = reports::read(&agent.reports, &pod);
            reports::svid_sets(&lines)
                .into_iter()
                .rev()
                .find_map(|set| set.first().cloned())
        },
    )
    .await;
    let held_at = started.elapsed();
    let report = agent.reports.join(format!("{pod}.jsonl"));
    println!(
        "\n$ grep '\"svids\"' {}   # what the Pod fetched from the Workload API",
        report.display()
    );
    println!(
        "SPIFFE ID {}  DNS names {:?}  serial {}  expires {}",
        svid.spiffe_id,
        svid.dns_names.unwrap_or_default(),
        svid.serial,
        k8s_openapi::jiff::Timestamp::from_millisecond(svid.not_after_ms)
            .map(|t| t.to_string())
            .unwrap_or_default()
    );
    println!(
        "\n# demo/web registered {:.1} s after start; its Pod held its SVID at {:.1} s; {:.1} s in all",
        registered_at.as_secs_f64(),
        held_at.as_secs_f64(),
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
