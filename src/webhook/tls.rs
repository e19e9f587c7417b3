//! HTTPS serving with a certificate that can be swapped while running
//! (`certs::ReloadableCert`): every new handshake picks up the current certificate,
//! connections already open keep theirs, so a rotation drops nothing.

pub use crate::certs::ReloadableCert;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// TLS 1.2 and 1.3 on ring, HTTP/2 and HTTP/1.1, certificate from `cert`.
pub fn server_config(cert: Arc<ReloadableCert>) -> Arc<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .expect("ring supports TLS 1.2 and 1.3")
        .with_no_client_auth()
        .with_cert_resolver(cert);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Arc::new(config)
}

/// A slow or silent client may hold a socket at most this long before its handshake completes.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What one client may hold of the webhook. The apiserver keeps a few long-lived HTTP/2
/// connections and sends a review within its `timeoutSeconds` (5 s in our manifests);
/// anything slower or more numerous is not the apiserver, or is broken.
#[derive(Clone, Debug)]
pub struct ServeLimits {
    /// Open connections at most; beyond it, new ones wait in the kernel's accept backlog.
    pub max_connections: usize,
    /// Time to receive a request's headers (HTTP/1.1), idle keep-alive included.
    pub header_read_timeout: Duration,
    /// Concurrent streams per HTTP/2 connection.
    pub max_streams: u32,
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self {
            max_connections: 512,
            header_read_timeout: Duration::from_secs(5),
            max_streams: 256,
        }
    }
}

/// Accepts TLS connections on `listener` and serves `router` until `shutdown`, then lets open
/// connections finish (bounded by the caller's runtime shutdown).
pub async fn serve(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    router: Router,
    shutdown: CancellationToken,
) {
    serve_with(listener, config, router, shutdown, ServeLimits::default()).await;
}

/// `serve` with explicit limits (tests use small ones).
pub async fn serve_with(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    router: Router,
    shutdown: CancellationToken,
    limits: ServeLimits,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    loop {
        // A slot first: at the limit we stop accepting instead of accepting and dropping.
        let slot = tokio::select! {
            _ = shutdown.cancelled() => break,
            slot = slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
        };
        let (tcp, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let service = TowerToHyperService::new(router.clone());
        let watcher = graceful.watcher();
        let limits = limits.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(error)) => {
                    tracing::debug!(%peer, %error, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%peer, "TLS handshake timed out");
                    return;
                }
            };
            let mut builder = auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout);
            builder
                .http2()
                .timer(hyper_util::rt::TokioTimer::new())
                .max_concurrent_streams(limits.max_streams)
                .keep_alive_interval(Duration::from_secs(30));
            let connection = builder.serve_connection_with_upgrades(TokioIo::new(tls), service);
            if let Err(error) = watcher.watch(connection.into_owned()).await {
                tracing::debug!(%peer, %error, "connection ended with an error");
            }
        });
    }
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(Duration::from_secs(10)) => tracing::warn!("open webhook connections did not finish in 10 s"),
    }
}
