//! The webhook CA rotates with an overlap, against the real kube-apiserver: two replicas share
//! one Secret, each gets its own webhook in a configuration that fails closed, and the CA lives
//! 60 s. Sampled through the whole rotation: every replica's certificate verifies against the
//! caBundle the apiserver holds, every Deployment create is admitted and stamped, the bundle's
//! generation never goes back, and both CAs are in it while the new one takes over. Then a
//! replica holding the old Secret cannot write its older bundle back.

mod common;

use common::certs::handshake_trusting;
use common::k8s::{
    create_namespace_with, create_webhook_configuration_per_replica, deployment, has_finalizer,
    install_crd,
};
use common::paths::free_port;
use common::registrar::{Options, Registrar};
use common::stack::Stack;
use common::world::{HOME, Scenario};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::PostParams;
use spiffe_registrar::certs::secret::{Injected, Material, inject_ca_bundle};
use spiffe_registrar::certs::{Pair, split_pem_bundle};
use std::time::{Duration, Instant};

const CONFIG: &str = "rotation";
const SECRET: &str = "rotation-tls";
const GENERATION: &str = "registrar.spiffe.io/ca-bundle-generation";

/// The caBundle every webhook of the configuration carries (they must agree) and its
/// generation annotation.
async fn bundle(configs: &Api<MutatingWebhookConfiguration>) -> (String, u64) {
    let config = configs.get(CONFIG).await.expect("configuration");
    let bundles: Vec<String> = config
        .webhooks
        .iter()
        .flatten()
        .map(|w| {
            let pem = w.client_config.ca_bundle.as_ref().map(|b| b.0.clone());
            String::from_utf8(pem.unwrap_or_default()).expect("PEM")
        })
        .collect();
    assert!(
        bundles.windows(2).all(|w| w[0] == w[1]),
        "the webhooks carry different caBundles"
    );
    let generation = config
        .metadata
        .annotations
        .and_then(|a| a.get(GENERATION).and_then(|g| g.parse().ok()))
        .unwrap_or(0);
    (bundles.into_iter().next().unwrap_or_default(), generation)
}

async fn signing_ca(secrets: &Api<Secret>) -> String {
    let secret = secrets.get(SECRET).await.expect("the registrars' Secret");
    String::from_utf8(secret.data.expect("data")["ca.crt"].0.clone()).expect("PEM")
}

#[tokio::test(flavor = "multi_thread")]
async fn the_webhook_ca_rotates_with_an_overlap_and_no_admission_fails() {
    let stack = Stack::shared_held();
    let s = Scenario::new(&stack.kube).await;
    install_crd(&s.client).await;
    create_namespace_with(&s.client, HOME, false, &[]).await;
    let ports = [("a", free_port()), ("b", free_port())];
    create_webhook_configuration_per_replica(&s.client, CONFIG, &ports).await;
    s.policy("p", s.spec("p")).await;
    let mut namespaces = Vec::new();
    for (label, _) in ports {
        let ns = format!("{}-{label}", s.tag);
        create_namespace_with(
            &s.client,
            &ns,
            true,
            &[("e2e/test", &s.tag), ("e2e/replica", label)],
        )
        .await;
        namespaces.push(ns);
    }
    let replicas: Vec<Registrar> = tokio::task::block_in_place(|| {
        ports
            .iter()
            .map(|(label, port)| {
                Registrar::start_on(
                    &stack,
                    *port,
                    Options {
                        namespace: HOME,
                        webhook_configuration: CONFIG,
                        cluster_name: "rotation",
                        name: label,
                        extra_args: vec![
                            format!("--cert-secret={SECRET}"),
                            "--webhook-ca-validity=60s".into(),
                            "--controller=false".into(),
                        ],
                        extra_env: vec![],
                    },
                )
            })
            .collect()
    });
    for replica in &replicas {
        stack.track(replica.process.pgid());
    }
    let configs: Api<MutatingWebhookConfiguration> = Api::all(s.client.clone());
    let secrets: Api<Secret> = Api::namespaced(s.client.clone(), HOME);
    let first_ca = signing_ca(&secrets).await;
    let (first_bundle, first_generation) = bundle(&configs).await;
    assert_eq!(split_pem_bundle(&first_bundle), vec![first_ca.clone()]);

    // Sample until the old CA has left the bundle (it expires 60 s after issuance).
    let started = Instant::now();
    let (mut last_generation, mut overlapped, mut creates) = (first_generation, false, 0);
    loop {
        let (pem, generation) = bundle(&configs).await;
        assert!(
            generation >= last_generation,
            "caBundle generation went back from {last_generation} to {generation}"
        );
        last_generation = generation;
        let cas = split_pem_bundle(&pem);
        overlapped |= cas.len() == 2 && cas.contains(&first_ca);
        for (replica, (label, _)) in replicas.iter().zip(ports) {
            handshake_trusting(replica.webhook_port, pem.as_bytes())
                .await
                .unwrap_or_else(|e| {
                    panic!(
                        "replica {label} serves a certificate the caBundle does not trust \
                         after {:?}: {e}",
                        started.elapsed()
                    )
                });
        }
        for ns in &namespaces {
            creates += 1;
            let api: Api<Deployment> = Api::namespaced(s.client.clone(), ns);
            let created = api
                .create(
                    &PostParams::default(),
                    &deployment(&format!("d{creates}"), Some("app")),
                )
                .await
                .unwrap_or_else(|e| {
                    panic!(
                        "create {creates} in {ns} failed after {:?}: {e}",
                        started.elapsed()
                    )
                });
            assert!(
                has_finalizer(&created),
                "create {creates} in {ns} was not mutated"
            );
        }
        if !cas.contains(&first_ca) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(150),
            "the old CA is still in the bundle after {:?}",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(
        overlapped,
        "the bundle never held the old and the new CA together"
    );
    let new_ca = signing_ca(&secrets).await;
    assert_ne!(new_ca, first_ca, "a new CA signs");
    for (replica, (label, _)) in replicas.iter().zip(ports) {
        handshake_trusting(replica.webhook_port, new_ca.as_bytes())
            .await
            .unwrap_or_else(|e| panic!("replica {label} does not serve from the new CA: {e}"));
    }
    eprintln!(
        "rotated in {:?}; {creates} creates admitted and mutated throughout",
        started.elapsed()
    );

    // A replica that still holds the first Secret does not write its bundle back.
    let stale = Material {
        ca: Pair {
            cert_pem: first_ca.clone(),
            key_pem: String::new(),
        },
        next_ca: None,
        next_since: 0,
        bundle: vec![first_ca.clone()],
        generation: first_generation,
        serving: Pair {
            cert_pem: String::new(),
            key_pem: String::new(),
        },
        renew_at: 0,
    };
    let before = bundle(&configs).await;
    let outcome = inject_ca_bundle(&s.client, CONFIG, &stale)
        .await
        .expect("injection");
    assert_eq!(outcome, Injected::Newer);
    assert_eq!(bundle(&configs).await, before, "the newer bundle stays");
}
