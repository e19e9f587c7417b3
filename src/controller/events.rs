//! Events, written off the critical path. kube-runtime's `Recorder` keeps every Event it
//! published for six minutes and scans that cache on each publish: at a cold start of 50,000
//! Deployments that is tens of MiB and quadratic CPU, and each Event write also competes with
//! the patch that actually registers a Deployment. Here an Event is queued (bounded) and
//! written slowly while workload writes wait, and one after another, at the apiserver's pace,
//! once none does (so a first install's Events are written within seconds of its last
//! annotation rather than trickling on for minutes after convergence); when the queue is full
//! the Event is dropped and counted, as Kubernetes' own event broadcaster does. Repeats are
//! already suppressed by `decide::Memory`, so no cache is needed.

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::PostParams;
use kube::{Api, Client};
use prometheus::IntCounter;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::MissedTickBehavior;
use tracing::Instrument;

/// Events waiting to be written; beyond this they are dropped (and counted).
const QUEUE: usize = 1024;
/// Events written per second at most while workload writes wait, one at a time. A first
/// install on a large cluster registers thousands of Deployments in one sync; written as fast
/// as the patches, their Events took a third of the apiserver's writes (10,000 Deployments on
/// 2 cores) and slowed the patches that matter. Paced, they cost a few percent and the excess
/// is dropped.
const EVENTS_PER_SECOND: u64 = 10;
/// Event writes in flight at once when no workload write waits: a first install's queue
/// (up to `QUEUE`) is written within a couple of seconds of its last annotation, instead of
/// keeping the process busy for minutes after convergence.
const IDLE_CONCURRENCY: usize = 8;
const REPORTING_CONTROLLER: &str = "spiffe-registrar";

struct Pending {
    regarding: ObjectReference,
    warning: bool,
    reason: String,
    note: Arc<str>,
}

/// Cheap to clone; every clone feeds the same writers.
#[derive(Clone)]
pub struct EventSink {
    queue: mpsc::Sender<Pending>,
    dropped: IntCounter,
    /// Workload writes queued or in flight (`writer::Progress`): Events yield to them.
    yield_to: Arc<std::sync::atomic::AtomicUsize>,
}

impl EventSink {
    /// Starts the writer; it stops once every clone of the sink is dropped.
    pub fn start(client: Client, replica_id: String, dropped: IntCounter) -> Self {
        let (queue, mut pending) = mpsc::channel::<Pending>(QUEUE);
        let yield_to = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let busy = yield_to.clone();
        tokio::spawn(
            async move {
                let mut pace =
                    tokio::time::interval(Duration::from_millis(1000 / EVENTS_PER_SECOND));
                pace.set_missed_tick_behavior(MissedTickBehavior::Delay);
                let idle_writes = Arc::new(tokio::sync::Semaphore::new(IDLE_CONCURRENCY));
                while let Some(event) = pending.recv().await {
                    if busy.load(std::sync::atomic::Ordering::Relaxed) > 0 {
                        pace.tick().await;
                        write(&client, &replica_id, event).await;
                        continue;
                    }
                    let Ok(permit) = idle_writes.clone().acquire_owned().await else {
                        break;
                    };
                    let (client, replica_id) = (client.clone(), replica_id.clone());
                    tokio::spawn(
                        async move {
                            write(&client, &replica_id, event).await;
                            drop(permit);
                        }
                        .in_current_span(),
                    );
                }
            }
            .instrument(tracing::info_span!("event_writer")),
        );
        Self {
            queue,
            dropped,
            yield_to,
        }
    }

    /// The count of workload writes Events yield to (kept by `writer::Progress`).
    pub fn yield_to(&self) -> Arc<std::sync::atomic::AtomicUsize> {
        self.yield_to.clone()
    }

    /// Queues an Event about `regarding`; never waits.
    pub fn publish(&self, regarding: ObjectReference, warning: bool, reason: &str, note: Arc<str>) {
        let pending = Pending {
            regarding,
            warning,
            reason: reason.to_string(),
            note,
        };
        if let Err(mpsc::error::TrySendError::Full(dropped)) = self.queue.try_send(pending) {
            self.dropped.inc();
            tracing::debug!(reason = %dropped.reason, object = ?dropped.regarding.name, "event queue full; Event dropped");
        }
    }
}

/// The Event object, as `kubectl describe` shows it under Events.
fn event_object(replica_id: &str, pending: Pending) -> Event {
    let Pending {
        regarding,
        warning,
        reason,
        note,
    } = pending;
    // Cluster-scoped objects (policies, the CRD) get their Events in `default`, as kubectl
    // looks for them there.
    let namespace = regarding
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let name = format!(
        "{}.{:016x}",
        regarding.name.as_deref().unwrap_or("object"),
        rand::random::<u64>()
    );
    Event {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(namespace),
            ..ObjectMeta::default()
        },
        event_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
        action: Some("Reconcile".into()),
        reason: Some(reason),
        note: Some(note.to_string()),
        type_: Some(if warning { "Warning" } else { "Normal" }.into()),
        regarding: Some(regarding),
        reporting_controller: Some(REPORTING_CONTROLLER.into()),
        reporting_instance: Some(replica_id.to_string()),
        ..Event::default()
    }
}

async fn write(client: &Client, replica_id: &str, pending: Pending) {
    let event = event_object(replica_id, pending);
    let namespace = event.metadata.namespace.clone().unwrap_or_default();
    let api: Api<Event> = Api::namespaced(client.clone(), &namespace);
    let params = PostParams::default();
    if let Err(error) =
        crate::telemetry::kube_write("create", "events", api.create(&params, &event)).await
    {
        let regarding = event.regarding.as_ref();
        tracing::warn!(
            %error,
            reason = ?event.reason,
            object = ?regarding.and_then(|r| r.name.as_deref()),
            namespace = ?regarding.and_then(|r| r.namespace.as_deref()),
            "publishing an Event failed"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_name_their_object_and_land_beside_it() {
        let regarding = ObjectReference {
            kind: Some("Deployment".into()),
            name: Some("web".into()),
            namespace: Some("a".into()),
            ..ObjectReference::default()
        };
        let pending = |regarding| Pending {
            regarding,
            warning: true,
            reason: "RegistrationFailed".into(),
            note: "n".into(),
        };
        let event = event_object("r-1", pending(regarding));
        assert_eq!(event.metadata.namespace.as_deref(), Some("a"));
        assert!(
            event
                .metadata
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with("web."))
        );
        assert_eq!(event.type_.as_deref(), Some("Warning"));
        assert_eq!(event.reporting_instance.as_deref(), Some("r-1"));

        let policy = ObjectReference {
            kind: Some("SpiffeRegistration".into()),
            name: Some("p".into()),
            ..ObjectReference::default()
        };
        let event = event_object("r-1", pending(policy));
        assert_eq!(event.metadata.namespace.as_deref(), Some("default"));
    }
}
