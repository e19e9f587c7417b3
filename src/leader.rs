//! Leader election over a coordination.k8s.io Lease (kube-lease-manager). Every replica serves
//! the webhook; only the holder of the Lease writes to SPIRE and to the cluster. A replica that
//! dies stops renewing, and another takes over within the lease duration; one that shuts down
//! releases the Lease at once.

use kube::Client;
use kube_lease_manager::LeaseManagerBuilder;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub const LEASE_NAME: &str = "spiffe-registrar-leader";

#[derive(Debug, thiserror::Error)]
#[error("leader election Lease {namespace}/{LEASE_NAME}: {source}")]
pub struct LeaderError {
    namespace: String,
    source: kube_lease_manager::LeaseManagerError,
}

/// Starts competing for the Lease; the receiver says whether we hold it. Dropping it releases
/// the Lease; the handle finishes once that release is done (await it before exiting, so the
/// next leader does not have to wait for the Lease to expire).
pub async fn elect(
    client: Client,
    namespace: &str,
    identity: &str,
    duration: Duration,
) -> Result<(watch::Receiver<bool>, JoinHandle<()>), LeaderError> {
    let seconds = duration.as_secs().max(2);
    let manager = LeaseManagerBuilder::new(client, LEASE_NAME)
        .with_namespace(namespace)
        .with_identity(identity)
        .with_duration(seconds)
        .with_grace((seconds / 3).max(1))
        .build()
        .await
        .map_err(|source| LeaderError {
            namespace: namespace.to_string(),
            source,
        })?;
    let (leader, task) = manager.watch().await;
    let done = tokio::spawn(async move {
        match task.await {
            Ok(Ok(_)) => tracing::info!("released the leader Lease"),
            Ok(Err(error)) => tracing::error!(%error, "leader election stopped"),
            Err(error) => tracing::error!(%error, "leader election task failed"),
        }
    });
    Ok((leader, done))
}
