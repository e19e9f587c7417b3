//! `spiffe-registrar run`: wires the caches, the webhook, the admin port and (on the leader)
//! the controller into one process, and shuts them down together on SIGTERM.

use crate::config::Settings;
use crate::controller::metrics::ControllerMetrics;
use crate::controller::{Controller, ControllerSettings};
use crate::spire::metrics::SpireMetrics;
use crate::spire::{GrpcEntryClient, connect};
use crate::telemetry::{Readiness, admin_router};
use crate::webhook::metrics::WebhookMetrics;
use crate::webhook::tls::{serve, server_config};
use crate::webhook::{WebhookState, router};
use crate::{certs, index, leader};
use prometheus::Registry;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;
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
    #[error(transparent)]
    Leader(#[from] leader::LeaderError),
}

pub async fn run(settings: Settings, shutdown: CancellationToken) -> Result<(), RunError> {
    let client = kube::Client::try_default().await?;
    let registry = Registry::new();
    let readiness = Arc::new(Readiness::default());

    let trigger = Arc::new(Notify::new());
    let synced = readiness.gate("caches");
    let (index, _watch_tasks) = index::start(
        client.clone(),
        settings.opt_in.clone(),
        trigger.clone(),
        synced.clone(),
    );

    let controller_task = if settings.controller {
        let (leader, lease_task) = leader::elect(
            client.clone(),
            &settings.namespace,
            &settings.replica_id,
            settings.lease_duration,
        )
        .await?;
        Some((
            lease_task,
            tokio::spawn(run_controller(
                settings.clone(),
                client.clone(),
                index.clone(),
                ControllerMetrics::register(&registry)?,
                SpireMetrics::register(&registry)?,
                trigger,
                leader,
                synced,
                shutdown.clone(),
            )),
        ))
    } else {
        tracing::info!("controller disabled (--controller=false): serving the webhook only");
        None
    };

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
    if let Some((lease_task, controller)) = controller_task {
        // The controller drops its leadership receiver when it ends; the Lease is then released
        // so another replica takes over at once instead of after the lease duration.
        let _ = controller.await;
        let _ = tokio::time::timeout(Duration::from_secs(5), lease_task).await;
    }
    tracing::info!("stopped");
    Ok(())
}

/// Connects to SPIRE (retrying: the webhook serves meanwhile) and runs the controller.
#[allow(clippy::too_many_arguments)]
async fn run_controller(
    settings: Settings,
    client: kube::Client,
    index: index::Index,
    metrics: ControllerMetrics,
    spire_metrics: SpireMetrics,
    trigger: Arc<Notify>,
    leader: tokio::sync::watch::Receiver<bool>,
    synced: Arc<AtomicBool>,
    shutdown: CancellationToken,
) {
    let mut delay = Duration::from_secs(1);
    let connection = loop {
        match connect(&settings.spire, Duration::from_secs(30)).await {
            Ok(connection) => break connection,
            Err(error) => {
                tracing::error!(%error, "cannot set up the SPIRE connection; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(delay) => {}
                }
                delay = (delay * 2).min(Duration::from_secs(30));
            }
        }
    };
    let api = Arc::new(GrpcEntryClient::new(
        connection.channel.clone(),
        settings.ownership.clone(),
        settings.client.clone(),
        spire_metrics,
    ));
    let controller_settings = ControllerSettings {
        ownership: settings.ownership.clone(),
        opt_in: settings.opt_in.clone(),
        resync_interval: settings.resync_interval,
        debounce: Duration::from_millis(200),
        replica_id: settings.replica_id.clone(),
    };
    Controller::new(api, client, index, controller_settings, metrics)
        .run(trigger, leader, synced, shutdown)
        .await;
    connection.shutdown().await;
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

/// `spiffe-registrar plan`: what a sync would change right now, against the live cluster and
/// SPIRE. Reads only; writes nothing.
pub async fn plan(settings: Settings) -> Result<String, PlanError> {
    use std::fmt::Write;
    let client = kube::Client::try_default().await.map_err(RunError::from)?;
    let synced = Arc::new(AtomicBool::new(false));
    let (index, tasks) = index::start(
        client,
        settings.opt_in.clone(),
        Arc::new(Notify::new()),
        synced.clone(),
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !synced.load(std::sync::atomic::Ordering::SeqCst) {
        if tokio::time::Instant::now() > deadline {
            return Err(PlanError::NotSynced);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let connection = connect(&settings.spire, Duration::from_secs(30)).await?;
    let api = GrpcEntryClient::new(
        connection.channel.clone(),
        settings.ownership.clone(),
        settings.client.clone(),
        SpireMetrics::unregistered(),
    );
    let mut view = crate::controller::view::SpireView::default();
    view.refresh(&api).await?;
    let (desired, plan) = crate::controller::sync::plan_against(
        &settings.ownership,
        &settings.opt_in,
        &index,
        &view.entries,
    );
    for task in tasks {
        task.abort();
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "cluster {}: {} Deployments seen, {} entries desired, {} ours in SPIRE",
        settings.ownership.cluster(),
        desired.workloads.len(),
        desired.entries.len(),
        view.entries.len()
    );
    for entry in &plan.create {
        let needed_by = desired
            .entries
            .get(&entry.id)
            .map(|d| {
                d.needed_by
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "create {} {} (for {needed_by})",
            entry.id, entry.spiffe_id
        );
    }
    for entry in &plan.update {
        let _ = writeln!(
            out,
            "update {} {} (x509 ttl {}s, jwt ttl {}s)",
            entry.id, entry.spiffe_id, entry.x509_svid_ttl, entry.jwt_svid_ttl
        );
    }
    for id in &plan.delete {
        let spiffe_id = view
            .entries
            .get(id)
            .map(|e| e.spiffe_id.as_str())
            .unwrap_or("?");
        let _ = writeln!(out, "delete {id} {spiffe_id}");
    }
    if plan.is_empty() {
        let _ = writeln!(out, "in sync: nothing to do");
    }
    connection.shutdown().await;
    Ok(out)
}

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Run(#[from] RunError),
    #[error("the caches did not sync within 60 s")]
    NotSynced,
    #[error(transparent)]
    Spire(#[from] crate::spire::SpireError),
}
