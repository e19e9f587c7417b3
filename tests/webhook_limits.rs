//! The webhook's limits, in-process over real TLS on loopback (no cluster): an oversize body
//! gets 413 over HTTP/1.1 and HTTP/2, a client that never finishes its headers is cut off, and
//! connections beyond the limit wait in the accept backlog until a slot frees.

mod common;

use common::views::StaticView;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::{TokioExecutor, TokioIo};
use spiffe_registrar::certs::generate::{new_ca, new_serving};
use spiffe_registrar::webhook::metrics::WebhookMetrics;
use spiffe_registrar::webhook::router::{DRAIN_CAP_BYTES, MAX_BODY_BYTES};
use spiffe_registrar::webhook::tls::{ReloadableCert, ServeLimits, serve_with, server_config};
use spiffe_registrar::webhook::{WebhookState, router};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::client::TlsStream;
use tokio_util::sync::CancellationToken;

const FIXTURE: &str = include_str!("fixtures/create-deployment.json");

/// A webhook served over TLS on loopback with `limits`, and a client trusting its CA.
struct Served {
    addr: SocketAddr,
    client: Arc<rustls::ClientConfig>,
    shutdown: CancellationToken,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn start(limits: ServeLimits) -> Served {
    use rustls::pki_types::pem::PemObject;
    let ca = new_ca(Duration::from_secs(3600)).expect("CA");
    let leaf = new_serving(&ca, &["localhost".into()], &[], Duration::from_secs(3600))
        .expect("serving certificate");
    let cert = Arc::new(
        ReloadableCert::new(leaf.cert_pem.as_bytes(), leaf.key_pem.as_bytes()).expect("cert"),
    );
    let registry = prometheus::Registry::new();
    let state = WebhookState {
        view: Arc::new(StaticView::empty("limits")),
        metrics: WebhookMetrics::register(&registry).expect("metrics"),
        registrar_user: None,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let shutdown = CancellationToken::new();
    tokio::spawn(serve_with(
        listener,
        server_config(cert),
        router(state),
        shutdown.clone(),
        limits,
    ));
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(
            rustls::pki_types::CertificateDer::from_pem_slice(ca.cert_pem.as_bytes()).expect("PEM"),
        )
        .expect("root");
    let client = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Served {
        addr,
        client: Arc::new(client),
        shutdown,
    }
}

impl Served {
    async fn tls(&self, alpn: &[u8]) -> TlsStream<tokio::net::TcpStream> {
        let mut config = (*self.client).clone();
        config.alpn_protocols = vec![alpn.to_vec()];
        let tcp = tokio::net::TcpStream::connect(self.addr)
            .await
            .expect("connect");
        tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect("localhost".try_into().expect("name"), tcp)
            .await
            .expect("TLS handshake")
    }

    /// Posts `body` over HTTP/1.1 as a client that writes the whole request before it reads
    /// a byte of the response: status and body text.
    async fn post_whole_then_read(&self, body: &[u8]) -> (u16, String) {
        let mut tls = self.tls(b"http/1.1").await;
        let head = format!(
            "POST /mutate HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        tls.write_all(head.as_bytes()).await.expect("head");
        tls.write_all(body)
            .await
            .expect("the whole body is accepted");
        tls.flush().await.expect("flush");
        let mut response = Vec::new();
        let mut buffer = [0u8; 4096];
        // Read until the status line and the whole (short) message are in.
        while !String::from_utf8_lossy(&response).contains("limit") {
            let read = tls
                .read(&mut buffer)
                .await
                .expect("the response, not a reset");
            assert!(read > 0, "closed before the response: {response:?}");
            response.extend_from_slice(&buffer[..read]);
        }
        let text = String::from_utf8_lossy(&response).into_owned();
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse().ok())
            .expect("a status line");
        (status, text)
    }

    /// Posts `body` to /mutate over `alpn` ("h2" or "http/1.1"): status and body text.
    async fn post(&self, alpn: &[u8], body: Bytes) -> (u16, String) {
        let tls = TokioIo::new(self.tls(alpn).await);
        let request =
            hyper::Request::post(format!("https://localhost:{}/mutate", self.addr.port()))
                .header("content-type", "application/json")
                .body(Full::new(body))
                .expect("request");
        let response = if alpn == b"h2" {
            let (mut sender, connection) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), tls)
                    .await
                    .expect("h2");
            tokio::spawn(connection);
            sender.send_request(request).await.expect("response")
        } else {
            let (mut sender, connection) = hyper::client::conn::http1::handshake(tls)
                .await
                .expect("http/1.1");
            tokio::spawn(connection);
            sender.send_request(request).await.expect("response")
        };
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }
}

/// A body several MiB over the limit, sent by a client that writes all of it before reading
/// anything: the 413 reaches it over both protocols (the server reads the rest and drops it,
/// up to `DRAIN_CAP_BYTES`), and the server serves the next request.
#[tokio::test]
async fn an_oversize_body_gets_413_over_http1_and_http2() {
    let served = start(ServeLimits::default()).await;
    let huge = Bytes::from(vec![b' '; 3 * MAX_BODY_BYTES]);
    for alpn in [b"http/1.1".as_slice(), b"h2".as_slice()] {
        let (status, text) = if alpn == b"h2" {
            served.post(alpn, huge.clone()).await
        } else {
            served.post_whole_then_read(&huge).await
        };
        assert_eq!(status, 413, "{}: {text}", String::from_utf8_lossy(alpn));
        assert!(
            text.to_lowercase().contains("length limit"),
            "the 413 says why: {text:?}"
        );
        // The server is still fine after it.
        let (status, _) = served
            .post(alpn, Bytes::from_static(FIXTURE.as_bytes()))
            .await;
        assert_eq!(status, 200);
    }
    // Announced past what is ever read: refused at once, and the connection closed.
    let (status, text) = served
        .post(b"http/1.1", Bytes::from(vec![b' '; DRAIN_CAP_BYTES + 1]))
        .await;
    assert_eq!(status, 413, "{text}");
}

#[tokio::test]
async fn a_client_that_never_finishes_its_headers_is_cut_off() {
    let limit = Duration::from_millis(500);
    let served = start(ServeLimits {
        header_read_timeout: limit,
        ..ServeLimits::default()
    })
    .await;
    let mut tls = served.tls(b"http/1.1").await;
    let started = Instant::now();
    tls.write_all(b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: app")
        .await
        .expect("write");
    let mut buffer = Vec::new();
    // The server answers (408) or just closes; either way the read ends with the connection.
    let closed = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut buffer)).await;
    assert!(
        closed.is_ok(),
        "a half-sent request held the connection for 10 s"
    );
    let held = started.elapsed();
    assert!(
        held >= limit && held < limit * 6,
        "cut off after {held:?}, limit {limit:?}"
    );
}

#[tokio::test]
async fn connections_beyond_the_limit_wait_until_a_slot_frees() {
    let served = start(ServeLimits {
        max_connections: 2,
        ..ServeLimits::default()
    })
    .await;
    let first = served.tls(b"h2").await;
    let _second = served.tls(b"h2").await;
    // The third is accepted by the kernel, not by us: its handshake does not complete.
    let third = tokio::spawn({
        let (addr, client) = (served.addr, served.client.clone());
        async move {
            let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
            tokio_rustls::TlsConnector::from(client)
                .connect("localhost".try_into().expect("name"), tcp)
                .await
                .expect("TLS handshake once a slot is free")
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !third.is_finished(),
        "a third connection was served over the limit of 2"
    );
    drop(first);
    tokio::time::timeout(Duration::from_secs(5), third)
        .await
        .expect("the third connection is served once one closes")
        .expect("task");
}
