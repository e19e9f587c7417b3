//! The apply-to-SVID benchmark: from `kubectl apply` of a Deployment to its Pod holding its
//! X.509-SVID, on the bed's real node, p50 and p99, and how much of it is SPIRE's agent.
//! Prints one JSON object on stdout; progress goes to stderr.
//!
//!   cargo run --release --example apply-to-svid -- [--deployments 50] [--interval-ms 1000]

#[path = "../common/mod.rs"]
mod common;

use common::apply_to_svid::{measure, summary};
use common::args::flag;
use common::k8s::create_namespace_with;
use common::node_agent::PSAT_CLUSTER;
use common::world::{TD, options, prepare};
use common::{Stack, paths::free_port, registrar::Registrar};
use std::time::{Duration, Instant};

#[tokio::main]
async fn main() {
    let count: usize = flag("--deployments").map_or(50, |v| v.parse().expect("a number"));
    let interval = Duration::from_millis(
        flag("--interval-ms").map_or(1000, |v| v.parse().expect("milliseconds")),
    );
    let started = Instant::now();
    let stack = tokio::task::spawn_blocking(Stack::start_with_node)
        .await
        .expect("the bed starts");
    eprintln!(
        "bed with a node ready in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let port = free_port();
    let registrar = tokio::task::block_in_place(|| {
        prepare(&stack.kube, port);
        Registrar::start_on(
            &stack,
            port,
            options(
                "bench",
                "registrar",
                vec![format!("--node-alias-cluster={PSAT_CLUSTER}")],
            ),
        )
    });
    stack.track(registrar.process.pgid());
    let client = stack.kube.client().await;
    let policy = serde_json::json!({
        "apiVersion": "registrar.spiffe.io/v1alpha1",
        "kind": "SpiffeRegistration",
        "metadata": { "name": "bench" },
        "spec": { "trustDomain": TD, "ttl": "1h" }
    });
    let policies: kube::Api<spiffe_registrar::policy::SpiffeRegistration> =
        kube::Api::all(client.clone());
    policies
        .create(
            &Default::default(),
            &serde_json::from_value(policy).expect("a valid policy"),
        )
        .await
        .expect("the policy is accepted");
    create_namespace_with(&client, "bench", true, &[]).await;
    eprintln!("applying {count} Deployments, one every {interval:?}");
    let timings = measure(&stack, "bench", "spiffe-registrar/bench", count, interval).await;
    println!("{}", summary(&timings));
    drop(registrar);
}
