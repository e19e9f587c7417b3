//! A custom kind's watch (`--custom-kind`): its objects in JSON (a CRD serves no protobuf),
//! each cut down to a `WatchedWorkload` as it arrives, and its CRD, so that the kind being
//! absent or going away is known rather than guessed from errors.
//!
//! ```text
//! CRD watch (by name) ─▶ Absent   ─▶ an empty list: the kind has no workloads (ready)
//!                       Present  ─▶ objects listed and watched
//!                       Removing ─▶ listed again, each object marked `kind_removing`
//! ```
//! A CRD being deleted deletes every object of its kind; our finalizer holds them, and
//! `desired` treats those deletions as a loss of scope (grace, deletion brake) rather than a
//! burst of releases.

use super::workload::WatchedWorkload;
use super::workload_watch::{WatchError, WorkloadEvent};
use crate::keys::WorkloadKind;
use futures::{Stream, StreamExt};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, DynamicObject};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};

/// What the kind's CRD is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrdState {
    Absent,
    Present,
    Removing,
}

impl CrdState {
    fn of(crd: &CustomResourceDefinition) -> Self {
        if crd.metadata.deletion_timestamp.is_some() {
            CrdState::Removing
        } else {
            CrdState::Present
        }
    }
}

/// Every object of the custom `kind`, as `workload_watch::workloads` yields built-in ones;
/// listed again each time its CRD changes state. Never ends.
pub fn workloads(
    client: Client,
    kind: WorkloadKind,
    page: u32,
) -> impl Stream<Item = WorkloadEvent> {
    let custom = kind.custom().expect("a custom kind");
    let crd_name = custom.crd_name();
    let crds = watcher::watcher(
        Api::<CustomResourceDefinition>::all(client.clone()),
        watcher::Config::default().fields(&format!("metadata.name={crd_name}")),
    )
    .default_backoff();
    async_stream::stream! {
        let mut crds = std::pin::pin!(crds);
        let mut tracker = CrdTracker::default();
        // Nothing is yielded before the CRD's first list says what it is doing.
        let mut state = loop {
            if let Some(state) = tracker.follow(next_crd_event(&mut crds).await, &crd_name) {
                break state;
            }
        };
        loop {
            match state {
                CrdState::Absent => {
                    tracing::info!(%kind, crd = %crd_name, "CRD not installed: the kind has no workloads until it is");
                    yield Ok(Event::Init);
                    yield Ok(Event::InitDone);
                }
                CrdState::Removing => {
                    tracing::warn!(%kind, crd = %crd_name, "CRD being deleted: entries of its workloads' service accounts are kept for the scope-loss grace");
                }
                CrdState::Present => tracing::info!(%kind, crd = %crd_name, "watching the kind"),
            }
            let mut objects = match state {
                CrdState::Absent => futures::stream::pending().boxed(),
                current => objects(&client, kind, page, current == CrdState::Removing).boxed(),
            };
            state = loop {
                let step = tokio::select! {
                    event = next_crd_event(&mut crds) => Step::Crd(tracker.follow(event, &crd_name)),
                    Some(event) = objects.next() => Step::Object(event),
                };
                match step {
                    Step::Crd(Some(next)) if next != state => break next,
                    Step::Crd(_) => {}
                    Step::Object(event) => yield event,
                }
            };
        }
    }
}

/// One turn of the loop: the CRD's news, or an object event to pass on (most turns; boxing
/// it would cost an allocation per event).
#[allow(clippy::large_enum_variant)]
enum Step {
    Crd(Option<CrdState>),
    Object(WorkloadEvent),
}

/// The CRD watch's next event; kube's watcher never ends, so neither does this.
async fn next_crd_event<S>(crds: &mut std::pin::Pin<&mut S>) -> CrdEvent
where
    S: Stream<Item = CrdEvent>,
{
    match crds.next().await {
        Some(event) => event,
        None => std::future::pending().await,
    }
}

type CrdEvent = Result<Event<CustomResourceDefinition>, watcher::Error>;

/// Follows the CRD watch (at most one object: it is watched by name).
#[derive(Default)]
struct CrdTracker {
    /// Inside a list: what it has said so far.
    listing: Option<Option<CrdState>>,
}

impl CrdTracker {
    /// The CRD's state once a list completes or an event changes it.
    fn follow(&mut self, event: CrdEvent, name: &str) -> Option<CrdState> {
        match event {
            Ok(Event::Init) => {
                self.listing = Some(None);
                None
            }
            Ok(Event::InitApply(crd)) => {
                self.listing = Some(Some(CrdState::of(&crd)));
                None
            }
            Ok(Event::InitDone) => Some(self.listing.take().flatten().unwrap_or(CrdState::Absent)),
            Ok(Event::Apply(crd)) => Some(CrdState::of(&crd)),
            Ok(Event::Delete(_)) => Some(CrdState::Absent),
            Err(error) => {
                tracing::warn!(crd = %name, %error, "CRD watch failed; retrying with backoff");
                None
            }
        }
    }
}

/// The kind's objects, listed then watched, each marked `kind_removing` when `removing`.
/// A kind not yet served (its CRD not established) reads as empty until it is.
fn objects(
    client: &Client,
    kind: WorkloadKind,
    page: u32,
    removing: bool,
) -> impl Stream<Item = WorkloadEvent> + Send + 'static {
    let custom = kind.custom().expect("a custom kind");
    let api = Api::<DynamicObject>::all_with(client.clone(), &kind.api_resource());
    let events =
        watcher::watcher(api, watcher::Config::default().page_size(page)).default_backoff();
    let mut answered_empty = false;
    events.flat_map(move |event| {
        let converted: Vec<WorkloadEvent> = match event {
            Ok(event) => {
                let watched = |object: DynamicObject| {
                    let mut watched = WatchedWorkload::from_dynamic(object, custom.template);
                    watched.kind_removing = removing;
                    watched
                };
                vec![Ok(match event {
                    Event::Apply(object) => Event::Apply(watched(object)),
                    Event::Delete(object) => Event::Delete(watched(object)),
                    Event::InitApply(object) => Event::InitApply(watched(object)),
                    Event::Init => Event::Init,
                    Event::InitDone => Event::InitDone,
                })]
            }
            Err(error) if not_served(&error) && !answered_empty => {
                answered_empty = true;
                tracing::info!(%kind, "the kind is not served yet: no workloads until it is");
                vec![Ok(Event::Init), Ok(Event::InitDone)]
            }
            Err(error) if not_served(&error) => vec![],
            Err(error) => vec![Err(WatchError::Json(error))],
        };
        futures::stream::iter(converted)
    })
}

/// The apiserver does not serve the resource (404): the CRD is absent or not established.
fn not_served(error: &watcher::Error) -> bool {
    matches!(error, watcher::Error::InitialListFailed(kube::Error::Api(status)) if status.code == 404)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn crd(deleting: bool) -> CustomResourceDefinition {
        let mut crd = CustomResourceDefinition::default();
        crd.metadata.name = Some("widgets.example.test".into());
        if deleting {
            crd.metadata.deletion_timestamp =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
                ));
        }
        crd
    }

    #[test]
    fn the_crd_s_state_is_known_once_listed_and_follows_each_event() {
        let mut t = CrdTracker::default();
        assert_eq!(t.follow(Ok(Event::Init), "x"), None);
        assert_eq!(
            t.follow(Ok(Event::InitDone), "x"),
            Some(CrdState::Absent),
            "an empty list"
        );
        assert_eq!(
            t.follow(Ok(Event::Apply(crd(false))), "x"),
            Some(CrdState::Present)
        );
        assert_eq!(
            t.follow(Ok(Event::Apply(crd(true))), "x"),
            Some(CrdState::Removing)
        );
        assert_eq!(
            t.follow(Ok(Event::Delete(crd(true))), "x"),
            Some(CrdState::Absent)
        );
        assert_eq!(t.follow(Ok(Event::Init), "x"), None);
        assert_eq!(t.follow(Ok(Event::InitApply(crd(true))), "x"), None);
        assert_eq!(t.follow(Ok(Event::InitDone), "x"), Some(CrdState::Removing));
    }
}
