//! Convergence at scale: 1,000 Deployments over 500 service accounts (500 entries), created
//! through the real kube-apiserver with the registrar (release build) as webhook + controller,
//! against the real spire-server. Reports the time until every Deployment has its entry
//! recorded, the time until all are deleted again, and the registrar's peak RSS.
//!
//!   cargo build --release && cargo run --release --example controller-bench [-- DEPLOYMENTS]

#[path = "../common/mod.rs"]
mod common;

use common::Stack;
use common::k8s::{
    create_namespace, create_webhook_configuration, deployment, install_crd, policy,
};
use common::registrar::{Options, Registrar};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use serde_json::json;
use spiffe_registrar::names::ENTRY_ID_ANNOTATION;
use spiffe_registrar::policy::SpiffeRegistration;
use std::sync::Arc;
use std::time::{Duration, Instant};

const NAMESPACES: usize = 10;

fn peak_rss_mib(pid: i32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map(|kib| kib / 1024.0)
        .unwrap_or(f64::NAN)
}

#[tokio::main]
async fn main() {
    let total: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("a number"))
        .unwrap_or(1_000);
    let stack = Arc::new(
        tokio::task::spawn_blocking(Stack::start)
            .await
            .expect("stack"),
    );
    let client = stack.kube.client().await;
    install_crd(&client).await;
    create_namespace(&client, "registrar-system", false).await;
    let port = common::paths::free_port();
    create_webhook_configuration(&client, "bench", port).await;
    let spec = json!({ "trustDomain": "example.org", "parentID": "spiffe://example.org/k8s/bench", "ttl": "1h" });
    Api::<SpiffeRegistration>::all(client.clone())
        .create(&PostParams::default(), &policy("bench", spec))
        .await
        .expect("policy");
    for n in 0..NAMESPACES {
        create_namespace(&client, &format!("bench-{n}"), true).await;
    }
    let registrar = {
        let stack = stack.clone();
        tokio::task::spawn_blocking(move || {
            Registrar::start_on(
                &stack,
                port,
                Options {
                    namespace: "registrar-system",
                    webhook_configuration: "bench",
                    cluster_name: "bench",
                    name: "registrar",
                    extra_args: vec!["--spire-rps=0".into()],
                    extra_env: vec![("RUST_LOG".into(), "info".into())],
                },
            )
        })
        .await
        .expect("registrar")
    };
    stack.track(registrar.process.pgid());
    let pid = registrar.process.pgid();
    println!("registrar RSS after start: {:.1} MiB", peak_rss_mib(pid));

    // Deployment i runs as service account i/2 in namespace i % NAMESPACES: two per entry.
    let started = Instant::now();
    futures::stream::iter(0..total)
        .for_each_concurrent(16, |i| {
            let client = client.clone();
            async move {
                let api: Api<Deployment> =
                    Api::namespaced(client, &format!("bench-{}", (i / 2) % NAMESPACES));
                let d = deployment(&format!("d{i}"), Some(&format!("sa{}", i / 2)));
                api.create(&PostParams::default(), &d)
                    .await
                    .expect("create");
            }
        })
        .await;
    let created = started.elapsed();
    let all: Api<Deployment> = Api::all(client.clone());
    let registered = loop {
        let list = all.list(&ListParams::default()).await.expect("list");
        let done = list
            .items
            .iter()
            .filter(|d| {
                d.metadata
                    .annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key(ENTRY_ID_ANNOTATION))
            })
            .count();
        if done == total {
            break started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "only {done}/{total} registered after 10 min"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let entries = stack
        .spire_server
        .entries(&["-hint", "spiffe-registrar/bench"])
        .len();
    println!(
        "{total} Deployments ({} service accounts) created through the apiserver in {:.1} s",
        total / 2,
        created.as_secs_f64()
    );
    println!(
        "all {total} registered ({entries} SPIRE entries) {:.1} s after the first create",
        registered.as_secs_f64()
    );
    println!("registrar peak RSS so far: {:.1} MiB", peak_rss_mib(pid));

    let started = Instant::now();
    for n in 0..NAMESPACES {
        let api: Api<Deployment> = Api::namespaced(client.clone(), &format!("bench-{n}"));
        api.delete_collection(&DeleteParams::default(), &ListParams::default())
            .await
            .expect("delete all");
    }
    loop {
        let left = all
            .list(&ListParams::default())
            .await
            .expect("list")
            .items
            .len();
        if left == 0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "{left} Deployments still there after 10 min"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let left = stack
        .spire_server
        .entries(&["-hint", "spiffe-registrar/bench"])
        .len();
    println!(
        "all deleted (finalizers released, {left} entries left) {:.1} s after delete",
        started.elapsed().as_secs_f64()
    );
    println!("registrar peak RSS: {:.1} MiB", peak_rss_mib(pid));
    drop(registrar);
}
