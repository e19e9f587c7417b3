//! `spiffe-registrar run`: wires the caches, the webhook, the admin port and (on the leader)
//! the controller into one process, and shuts them down together on SIGTERM.

use crate::config::Settings;
use crate::telemetry::{Readiness, admin_router};
use crate::webhook::metrics::WebhookMetrics;
use crate::webhook::tls::{serve, server_config};
use crate::webhook::{WebhookState, router};
use crate::{certs, index};
use prometheus::Registry;
use std::sync::Arc;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("Kubernetes client: {0}")]
    Kube(#[from] kube::Error),
    #[error("binding {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("webhook certificate: {0}")]
    Certs(#[from] certs::StartError),
    #[error("metrics registry: {0}")]
    Metrics(#[from] prometheus::Error),
}

pub async fn run(settings: Settings, shutdown: CancellationToken) -> Result<(), RunError> {
    let client = kube::Client::try_default().await?;
    let registry = Registry::new();
    let readiness = Arc::new(Readiness::default());

    let trigger = Arc::new(Notify::new());
    let (index, _watch_tasks) = index::start(
        client.clone(),
        settings.opt_in.clone(),
        trigger.clone(),
        readiness.gate("caches"),
    );

    let (serving, _cert_task) = certs::start(
        settings.certs.clone(),
        client.clone(),
        readiness.gate("certificate"),
    )
    .await?;
    let webhook = router(WebhookState {
        view: Arc::new(index.clone()),
        metrics: WebhookMetrics::register(&registry)?,
    });
    let webhook_listener = tokio::net::TcpListener::bind(settings.webhook_addr)
        .await
        .map_err(|source| RunError::Bind {
            addr: settings.webhook_addr,
            source,
        })?;
    let admin_listener = tokio::net::TcpListener::bind(settings.admin_addr)
        .await
        .map_err(|source| RunError::Bind {
            addr: settings.admin_addr,
            source,
        })?;
    tracing::info!(webhook = %settings.webhook_addr, admin = %settings.admin_addr, cluster = settings.ownership.cluster(), "serving");

    let admin = admin_router(registry.clone(), readiness.clone());
    let admin_shutdown = shutdown.clone();
    let admin_task = tokio::spawn(async move {
        let _ = axum::serve(admin_listener, admin)
            .with_graceful_shutdown(admin_shutdown.cancelled_owned())
            .await;
    });
    serve(
        webhook_listener,
        server_config(serving),
        webhook,
        shutdown.clone(),
    )
    .await;
    let _ = admin_task.await;
    tracing::info!("stopped");
    Ok(())
}

/// Cancels `shutdown` on SIGTERM (kubelet) or SIGINT (a terminal).
pub async fn stop_on_signal(shutdown: CancellationToken) {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(error) => {
            tracing::error!(%error, "cannot listen for SIGTERM");
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
    }
    shutdown.cancel();
}
