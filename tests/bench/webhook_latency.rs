//! Webhook latency and throughput.
//!
//! Part 1: the webhook in-process over TLS on loopback, one keep-alive HTTP/2 connection:
//! sequential latency (p50/p99) and throughput with concurrent streams.
//! Part 2: Deployment creates through the real kube-apiserver, in a namespace the webhook is
//! called for and in one it is not: the extra latency users see.
//!
//!   cargo build --release && cargo run --release --example webhook-bench [-- REQUESTS CREATES]

#[path = "../common/mod.rs"]
mod common;

use common::Stack;
use common::k8s::{
    create_namespace, create_webhook_configuration, deployment, install_crd, policy,
};
use common::registrar::{Options, Registrar};
use common::views::StaticView;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::{TokioExecutor, TokioIo};
use k8s_openapi::api::apps::v1::Deployment;
use kube::Api;
use kube::api::PostParams;
use serde_json::json;
use spiffe_registrar::certs::generate::{new_ca, new_serving};
use spiffe_registrar::policy::SpiffeRegistration;
use spiffe_registrar::webhook::metrics::WebhookMetrics;
use spiffe_registrar::webhook::tls::{ReloadableCert, serve, server_config};
use spiffe_registrar::webhook::{WebhookState, router};
use std::sync::Arc;
use std::time::{Duration, Instant};

const FIXTURE: &str = include_str!("../fixtures/create-deployment.json");

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn report(what: &str, mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    let p50 = percentile(&samples, 0.5);
    println!(
        "{what:<44} n={:<6} p50={:>8.3} ms  p99={:>8.3} ms  max={:>8.3} ms",
        samples.len(),
        p50.as_secs_f64() * 1e3,
        percentile(&samples, 0.99).as_secs_f64() * 1e3,
        samples.last().expect("samples").as_secs_f64() * 1e3
    );
    p50
}

#[tokio::main]
async fn main() {
    rustls::crypto::ring::default_provider()
        .install_default()
        .expect("one provider");
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers"))
        .collect();
    let requests = args.first().copied().unwrap_or(20_000);
    let creates = args.get(1).copied().unwrap_or(300);
    in_process(requests).await;
    through_apiserver(creates).await;
}

async fn in_process(requests: usize) {
    let ca = new_ca(Duration::from_secs(3600)).expect("ca");
    let leaf =
        new_serving(&ca, &["localhost".into()], &[], Duration::from_secs(3600)).expect("leaf");
    let cert = Arc::new(
        ReloadableCert::new(leaf.cert_pem.as_bytes(), leaf.key_pem.as_bytes()).expect("cert"),
    );
    let policy = policy(
        "bench",
        json!({ "trustDomain": "example.org", "parentID": "spiffe://example.org/nodes" }),
    );
    let registry = prometheus::Registry::new();
    let state = WebhookState {
        view: Arc::new(StaticView::opted_in("bench", vec![Arc::new(policy)])),
        metrics: WebhookMetrics::register(&registry).expect("metrics"),
        registrar_user: None,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let shutdown = tokio_util::sync::CancellationToken::new();
    tokio::spawn(serve(
        listener,
        server_config(cert),
        router(state),
        shutdown.clone(),
    ));

    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from(pem_der(
            &ca.cert_pem,
        )))
        .expect("root");
    let mut client = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    client.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    tcp.set_nodelay(true).expect("nodelay");
    let tls = tokio_rustls::TlsConnector::from(Arc::new(client))
        .connect("localhost".try_into().expect("name"), tcp)
        .await
        .expect("TLS");
    let (sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .expect("h2");
    tokio::spawn(connection);

    let body = Bytes::from_static(FIXTURE.as_bytes());
    let port = addr.port();
    let send = move |mut sender: hyper::client::conn::http2::SendRequest<Full<Bytes>>,
                     body: Bytes| async move {
        let request = hyper::Request::post(format!("https://localhost:{port}/mutate"))
            .header("content-type", "application/json")
            .body(Full::new(body))
            .expect("request");
        let started = Instant::now();
        let response = sender.send_request(request).await.expect("response");
        assert!(response.status().is_success());
        let _ = response.into_body().collect().await.expect("body");
        started.elapsed()
    };
    println!("== webhook in-process, TLS 1.3 + HTTP/2 keep-alive on loopback");
    for _ in 0..500 {
        send(sender.clone(), body.clone()).await; // warm-up
    }
    let started = Instant::now();
    let mut samples = Vec::with_capacity(requests);
    for _ in 0..requests {
        samples.push(send(sender.clone(), body.clone()).await);
    }
    let elapsed = started.elapsed();
    report("sequential (1 stream)", samples);
    println!(
        "{:<44} {:.0} req/s",
        "sequential throughput",
        requests as f64 / elapsed.as_secs_f64()
    );

    let streams = 32;
    let started = Instant::now();
    let tasks: Vec<_> = (0..streams)
        .map(|_| {
            let (sender, body) = (sender.clone(), body.clone());
            tokio::spawn(async move {
                let mut samples = Vec::new();
                for _ in 0..requests / streams {
                    samples.push(send(sender.clone(), body.clone()).await);
                }
                samples
            })
        })
        .collect();
    let mut samples = Vec::new();
    for task in tasks {
        samples.extend(task.await.expect("task"));
    }
    let elapsed = started.elapsed();
    let n = samples.len();
    report(&format!("concurrent ({streams} streams)"), samples);
    println!(
        "{:<44} {:.0} req/s",
        "concurrent throughput",
        n as f64 / elapsed.as_secs_f64()
    );
    shutdown.cancel();
}

fn pem_der(pem: &str) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes())
        .expect("PEM")
        .to_vec()
}

async fn through_apiserver(creates: usize) {
    let stack = tokio::task::spawn_blocking(Stack::start)
        .await
        .expect("stack");
    let client = stack.kube.client().await;
    install_crd(&client).await;
    create_namespace(&client, "registrar-system", false).await;
    let webhook_port = common::paths::free_port();
    create_webhook_configuration(&client, "bench", webhook_port).await;
    let policies: Api<SpiffeRegistration> = Api::all(client.clone());
    let spec = json!({ "trustDomain": "example.org", "parentID": "spiffe://example.org/nodes" });
    policies
        .create(&PostParams::default(), &policy("bench", spec))
        .await
        .expect("policy");
    create_namespace(&client, "with-webhook", true).await;
    create_namespace(&client, "without-webhook", false).await;
    let stack = Arc::new(stack);
    let registrar = {
        let stack = stack.clone();
        tokio::task::spawn_blocking(move || {
            Registrar::start_on(
                &stack,
                webhook_port,
                Options {
                    namespace: "registrar-system",
                    webhook_configuration: "bench",
                    cluster_name: "bench",
                    name: "registrar",
                    extra_args: vec![],
                    extra_env: vec![],
                },
            )
        })
        .await
        .expect("registrar")
    };
    stack.track(registrar.process.pgid());
    let with: Api<Deployment> = Api::namespaced(client.clone(), "with-webhook");
    let without: Api<Deployment> = Api::namespaced(client.clone(), "without-webhook");
    // Wait until the apiserver calls the webhook.
    loop {
        let d = with
            .create(
                &PostParams {
                    dry_run: true,
                    ..Default::default()
                },
                &deployment("probe", None),
            )
            .await;
        if d.ok().and_then(|d| d.metadata.finalizers).is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!("== Deployment create through kube-apiserver (sequential)");
    let mut results = Vec::new();
    for (label, api) in [
        ("without webhook (namespace not opted in)", &without),
        ("with webhook", &with),
    ] {
        for i in 0..20 {
            api.create(
                &PostParams::default(),
                &deployment(&format!("warm{i}"), None),
            )
            .await
            .expect("warm-up");
        }
        let mut samples = Vec::with_capacity(creates);
        for i in 0..creates {
            let started = Instant::now();
            api.create(&PostParams::default(), &deployment(&format!("d{i}"), None))
                .await
                .expect("create");
            samples.push(started.elapsed());
        }
        results.push(report(label, samples));
    }
    println!(
        "{:<44} {:+.3} ms at p50",
        "extra latency of the webhook",
        (results[1].as_secs_f64() - results[0].as_secs_f64()) * 1e3
    );
    drop(registrar);
}
