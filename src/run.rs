//! `spiffe-registrar run`: wires the caches, the webhook, the admin port and (on the leader)
//! the controller into one process, and shuts them down together on SIGTERM.

use crate::config::Settings;
use crate::controller::metrics::ControllerMetrics;
use crate::controller::{Controller, ControllerSettings};
use crate::spire::Ownership;
use crate::spire::metrics::SpireMetrics;
use crate::spire::ownership::derived_cluster_name;
use crate::spire::{GrpcEntryClient, connect};
use crate::supervise::Supervisor;
use crate::telemetry::{Readiness, admin_router};
use crate::webhook::metrics::WebhookMetrics;
use crate::webhook::tls::{serve, server_config};
use crate::webhook::{WebhookState, router};
use crate::{certs, index, leader};
use futures::FutureExt;
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::PostParams;
use prometheus::Registry;
use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

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
    Config(#[from] crate::config::ConfigError),
    #[error("the kube-system namespace has no UID to derive --cluster-name from; set it")]
    NoClusterUid,
    #[error("Kubernetes client for writes: {0}")]
    WriteClient(String),
    #[error(transparent)]
    TaskEnded(#[from] crate::supervise::TaskEnded),
}

/// Our entries' names for this cluster (see `cluster_name`), its previous names and node alias.
async fn ownership(settings: &Settings, client: &kube::Client) -> Result<Ownership, RunError> {
    let name = cluster_name(settings.cluster.cluster_name.as_deref(), client).await?;
    Ok(settings.ownership(&name)?)
}

/// The cluster's name: the one given, or the one derived from kube-system's UID.
pub async fn cluster_name(
    explicit: Option<&str>,
    client: &kube::Client,
) -> Result<String, RunError> {
    if let Some(name) = explicit {
        return Ok(name.to_string());
    }
    let namespaces: kube::Api<Namespace> = kube::Api::all(client.clone());
    let uid = namespaces
        .get("kube-system")
        .await?
        .metadata
        .uid
        .ok_or(RunError::NoClusterUid)?;
    Ok(derived_cluster_name(&uid))
}

/// Our own username, so the webhook lets the controller's `entry-id` writes through. Best
/// effort: without it, the webhook still accepts the one ID policy computes.
async fn registrar_user(client: &kube::Client) -> Option<Arc<str>> {
    let api: kube::Api<SelfSubjectReview> = kube::Api::all(client.clone());
    match api
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await
    {
        Ok(review) => review
            .status
            .and_then(|s| s.user_info)
            .and_then(|u| u.username)
            .map(Arc::from),
        Err(error) => {
            tracing::warn!(%error, "cannot learn our own username (SelfSubjectReview)");
            None
        }
    }
}

pub async fn run(settings: Settings, shutdown: CancellationToken) -> Result<(), RunError> {
    let client = kube::Client::try_default().await?;
    let ownership = ownership(&settings, &client).await?;
    let registrar_user = registrar_user(&client).await;
    let registry = crate::telemetry::new_registry();
    crate::telemetry::register_process_metrics(&registry)?;
    let readiness = Arc::new(Readiness::default());
    let mut tasks = Supervisor::default();

    let trigger = Arc::new(Notify::new());
    let (index, watch_tasks) = index::start(
        client.clone(),
        settings.opt_in.clone(),
        ownership.clone(),
        &settings.workload_kinds,
        trigger.clone(),
        readiness.handle("caches"),
    );
    for (name, task) in watch_tasks {
        tasks.watch(name, task);
    }
    if settings.controller {
        let (ownership, index) = (ownership.clone(), index.clone());
        start_controller(
            &settings, ownership, index, &registry, trigger, &mut tasks, &shutdown,
        )
        .await?;
    } else {
        tracing::info!("controller disabled (--controller=false): serving the webhook only");
    }
    let (serving, cert_task) = certs::start(
        settings.certs.clone(),
        client.clone(),
        readiness.handle("certificate"),
    )
    .await?;
    tasks.watch("certificate rotation", cert_task);
    let webhook = router(WebhookState {
        view: Arc::new(index.clone()),
        metrics: WebhookMetrics::register(&registry)?,
        registrar_user,
    });
    let webhook_listener = bind(settings.webhook_addr).await?;
    let admin_listener = bind(settings.admin_addr).await?;
    tracing::info!(webhook = %settings.webhook_addr, admin = %settings.admin_addr, cluster = ownership.cluster(), "serving");
    // The admin port outlives `shutdown` a little: `/readyz` must say why we are going.
    let admin_stop = CancellationToken::new();
    let admin = admin_router(registry.clone(), readiness.clone());
    let admin_task = tokio::spawn(
        axum::serve(admin_listener, admin)
            .with_graceful_shutdown(admin_stop.clone().cancelled_owned())
            .into_future()
            .map(|_| ())
            .instrument(tracing::info_span!("admin")),
    );
    let webhook_task = tokio::spawn(
        serve(
            webhook_listener,
            server_config(serving),
            webhook,
            shutdown.clone(),
        )
        .instrument(tracing::info_span!("webhook")),
    );
    tasks.watch_graceful("webhook server", webhook_task);
    let result = supervise_until_shutdown(tasks, &readiness, &shutdown).await;
    admin_stop.cancel();
    let _ = tokio::time::timeout(Duration::from_millis(500), admin_task).await;
    tracing::info!("stopped");
    result
}

/// The lease task and the controller, both stopped gracefully by the supervisor.
async fn start_controller(
    settings: &Settings,
    ownership: Ownership,
    index: index::Index,
    registry: &Registry,
    trigger: Arc<Notify>,
    tasks: &mut Supervisor,
    shutdown: &CancellationToken,
) -> Result<(), RunError> {
    let writes = write_client().await?;
    let (leadership, lease_task) =
        leader::elect(writes.clone(), settings.election.clone(), shutdown.clone());
    tasks.watch_graceful("leader election", lease_task);
    let controller = run_controller(
        settings.clone(),
        ownership,
        writes,
        index,
        ControllerMetrics::register(registry)?,
        SpireMetrics::register(registry)?,
        trigger,
        leadership,
        shutdown.clone(),
    );
    tasks.watch_graceful(
        "controller",
        tokio::spawn(controller.instrument(tracing::info_span!("controller"))),
    );
    Ok(())
}

async fn bind(addr: std::net::SocketAddr) -> Result<tokio::net::TcpListener, RunError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| RunError::Bind { addr, source })
}

/// Waits for shutdown or the first long-lived task to end; then stops every task. A task
/// that ended on its own is an error: readiness says why for a moment, then the process
/// exits so the pod is restarted.
async fn supervise_until_shutdown(
    mut tasks: Supervisor,
    readiness: &Readiness,
    shutdown: &CancellationToken,
) -> Result<(), RunError> {
    let failure = tokio::select! {
        _ = shutdown.cancelled() => None,
        ended = tasks.first_to_end() => (!shutdown.is_cancelled()).then_some(ended),
    };
    if let Some(ended) = &failure {
        tracing::error!(task = %ended.task, how = %ended.how, "a long-lived task ended; not ready, exiting so the pod is restarted");
        readiness.fail(ended.to_string());
        shutdown.cancel();
        // Long enough for a probe to see the reason, short enough to restart promptly.
        tokio::time::sleep(FAILURE_NOTICE).await;
    }
    // Shutdown ends the leadership term (cancelling the controller's writes) and releases the
    // Lease, so another replica takes over at once instead of after the lease duration.
    tasks.stop(Duration::from_secs(3)).await;
    match failure {
        Some(ended) => Err(RunError::TaskEnded(ended)),
        None => Ok(()),
    }
}

/// How long `/readyz` reports a failed task before the process exits.
const FAILURE_NOTICE: Duration = Duration::from_secs(2);

/// Connects to SPIRE (retrying: the webhook serves meanwhile) and runs the controller.
#[allow(clippy::too_many_arguments)]
async fn run_controller(
    settings: Settings,
    ownership: Ownership,
    client: kube::Client,
    index: index::Index,
    metrics: ControllerMetrics,
    spire_metrics: SpireMetrics,
    trigger: Arc<Notify>,
    leader: leader::Leadership,
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
        ownership.clone(),
        settings.client.clone(),
        spire_metrics,
    ));
    let controller_settings = controller_settings(&settings, ownership);
    Controller::new(api, client, index, controller_settings, metrics)
        .run(trigger, leader, shutdown)
        .await;
    connection.shutdown().await;
}

fn controller_settings(settings: &Settings, ownership: Ownership) -> ControllerSettings {
    ControllerSettings {
        ownership,
        opt_in: settings.opt_in.clone(),
        resync_interval: settings.resync_interval,
        debounce: Duration::from_millis(200),
        replica_id: settings.replica_id.clone(),
        decide: settings.decide.clone(),
        spire_unusable_after: settings.spire_unusable_after,
    }
}

/// A client for writes (Lease, patches, status, Events) whose requests time out after
/// `KUBE_WRITE_TIMEOUT`: a write must never outlive the leadership it was issued under. The
/// watches keep the default client (a watch is a long-lived request).
async fn write_client() -> Result<kube::Client, RunError> {
    let mut config = kube::Config::infer()
        .await
        .map_err(|error| RunError::WriteClient(error.to_string()))?;
    config.read_timeout = Some(crate::config::KUBE_WRITE_TIMEOUT);
    config.write_timeout = Some(crate::config::KUBE_WRITE_TIMEOUT);
    Ok(kube::Client::try_from(config)?)
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
    let client = kube::Client::try_default().await.map_err(RunError::from)?;
    let ownership = ownership(&settings, &client).await?;
    let readiness = Readiness::default();
    let (index, tasks) = index::start(
        client,
        settings.opt_in.clone(),
        ownership.clone(),
        &settings.workload_kinds,
        Arc::new(Notify::new()),
        readiness.handle("caches"),
    );
    tokio::time::timeout(Duration::from_secs(60), index.synced())
        .await
        .map_err(|_| PlanError::NotSynced)?;
    let connection = connect(&settings.spire, Duration::from_secs(30)).await?;
    let api = GrpcEntryClient::new(
        connection.channel.clone(),
        ownership.clone(),
        settings.client.clone(),
        SpireMetrics::unregistered(),
    );
    let controller_settings = controller_settings(&settings, ownership.clone());
    let out = crate::controller::preview(&controller_settings, &index, &api).await;
    for (_, task) in tasks {
        task.abort();
    }
    connection.shutdown().await;
    Ok(out?)
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
