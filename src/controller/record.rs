//! Writes the outcome of a sync back to Kubernetes: annotations and finalizers on workloads
//! (JSON Patch guarded by `test` operations on exactly what the patch relies on, so a stale
//! cache can never clobber someone else's change, while kube-controller-manager's status writes
//! never make our patch fail), Events, and policy status.

use super::decide::MetadataChange;
use super::events::EventSink;
use crate::index::WorkloadRecord;
use crate::metadata_patch::{self as patch, Target, writes_anything};
use crate::names::{ENTRY_ID_ANNOTATION, FINALIZER, SPIFFE_ID_ANNOTATION};
use json_patch::PatchOperation;
use kube::api::{DynamicObject, Patch, PatchParams};
use kube::{Api, Client, Resource};
use std::sync::Arc;

/// JSON Patch operations for `change` against the cached `deployment`, each guarded by a
/// `test` of what it relies on: the finalizer list it edits by index or appends to, and, when
/// it creates the annotation map or finalizer list, the whole object's resourceVersion (an
/// `add` of an existing map would replace it). Status and other fields may change meanwhile.
pub fn operations(deployment: &WorkloadRecord, change: &MetadataChange) -> Vec<PatchOperation> {
    let mut ops = Vec::new();
    let mut guard_version = false;
    let finalizers: Vec<&str> = deployment
        .finalizers
        .iter()
        .flat_map(|list| list.iter())
        .map(AsRef::as_ref)
        .collect();
    let add = change.add_finalizer && !finalizers.contains(&FINALIZER);
    let remove = change.remove_finalizer && finalizers.contains(&FINALIZER);
    if (add || remove) && deployment.finalizers.is_some() {
        ops.push(patch::test(Target::Finalizers, finalizers.clone()));
    }
    if add {
        if deployment.finalizers.is_none() {
            guard_version = true;
            ops.push(patch::add(Target::Finalizers, vec![FINALIZER]));
        } else {
            ops.push(patch::add(Target::FinalizersEnd, FINALIZER));
        }
    }
    if remove && let Some(index) = finalizers.iter().position(|f| *f == FINALIZER) {
        ops.push(patch::remove(Target::FinalizerAt(index)));
    }
    let mut annotations_exist = deployment.annotations.is_some();
    for (key, wanted, current) in [
        (
            SPIFFE_ID_ANNOTATION,
            &change.spiffe_id,
            deployment.spiffe_id(),
        ),
        (ENTRY_ID_ANNOTATION, &change.entry_id, deployment.entry_id()),
    ] {
        let target = Target::Annotation(key);
        match wanted {
            Some(Some(value)) if current != Some(&**value) => {
                if !annotations_exist {
                    guard_version = true;
                    ops.push(patch::add(Target::Annotations, serde_json::Map::new()));
                    annotations_exist = true;
                }
                ops.push(patch::add(target, &**value));
            }
            Some(None) if current.is_some() => ops.push(patch::remove(target)),
            _ => {}
        }
    }
    if guard_version {
        ops.insert(
            0,
            patch::test(
                Target::ResourceVersion,
                deployment.resource_version.to_string(),
            ),
        );
    }
    ops
}

/// The API of `workload`'s kind in its namespace. Dynamic: every kind is patched and read
/// back the same way, through its metadata alone.
pub fn api_of(client: &Client, workload: &WorkloadRecord) -> Api<DynamicObject> {
    Api::namespaced_with(
        client.clone(),
        &workload.namespace,
        &workload.kind.api_resource(),
    )
}

/// Patches one workload. A failed `test` (the cache was stale) is not an error worth more
/// than a debug line: the watch event that made it stale triggers the next sync. The answer
/// is the object's metadata alone: the watch brings the rest, and at thousands of patches a
/// whole object encoded by the apiserver and decoded here per patch is a share of the cores
/// the patches themselves need.
pub async fn patch_metadata(
    client: &Client,
    deployment: &WorkloadRecord,
    change: &MetadataChange,
) -> Result<bool, kube::Error> {
    let ops = operations(deployment, change);
    if !writes_anything(&ops) {
        return Ok(false);
    }
    let api = api_of(client, deployment);
    let patch = Patch::<()>::Json(json_patch::Patch(ops));
    crate::telemetry::kube_write(
        "patch",
        deployment.kind.plural(),
        api.patch_metadata(&deployment.name, &PatchParams::default(), &patch),
    )
    .await?;
    Ok(true)
}

/// Whether the workload now shows everything `change` asked for (read back after a patch
/// whose outcome is unknown).
async fn landed(client: &Client, deployment: &WorkloadRecord, change: &MetadataChange) -> bool {
    let api = api_of(client, deployment);
    match api.get_metadata_opt(&deployment.name).await {
        Ok(Some(current)) => shows(&current.metadata, change),
        _ => false,
    }
}

/// Whether `meta` shows everything `change` asks for.
fn shows(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    change: &MetadataChange,
) -> bool {
    let annotation = |key: &str| {
        meta.annotations
            .as_ref()
            .and_then(|a| a.get(key))
            .map(String::as_str)
    };
    let has_finalizer = meta.finalizers.iter().flatten().any(|f| f == FINALIZER);
    (!change.add_finalizer || has_finalizer)
        && (!change.remove_finalizer || !has_finalizer)
        && change
            .spiffe_id
            .as_ref()
            .is_none_or(|want| annotation(SPIFFE_ID_ANNOTATION) == want.as_deref())
        && change
            .entry_id
            .as_ref()
            .is_none_or(|want| annotation(ENTRY_ID_ANNOTATION) == want.as_deref())
}

/// Queues an Event about a policy or the CRD (Events are advisory: never waited on).
pub fn event<K: Resource<DynamicType = ()>>(
    events: &EventSink,
    object: &K,
    warning: bool,
    reason: &str,
    note: String,
) {
    events.publish(object.object_ref(&()), warning, reason, note.into());
}

/// Patches one workload and queues its Events. When the patch failed (the sync is
/// retried) its Events are handed back unpublished: they announce a change that may not be
/// there.
pub async fn write_workload(
    client: &Client,
    events: &EventSink,
    deployment: Arc<WorkloadRecord>,
    change: MetadataChange,
    announce: Vec<super::decide::Announce>,
) -> Result<(), Vec<super::decide::Announce>> {
    if !change.is_empty() {
        match patch_metadata(client, &deployment, &change).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => return Ok(()),
            // Timed out or cut mid-request: the patch may have landed. If it did, the next
            // sync finds nothing to write, so this is the last chance to count it.
            Err(error)
                if !matches!(error, kube::Error::Api(_))
                    && landed(client, &deployment, &change).await =>
            {
                tracing::debug!(kind = %deployment.kind, deployment = %deployment.name, namespace = %deployment.namespace, %error, "patch outcome was unknown; it landed");
            }
            Err(error) => {
                tracing::warn!(kind = %deployment.kind, deployment = %deployment.name, namespace = %deployment.namespace, %error, "patch failed (stale cache?); will retry");
                return Err(announce);
            }
        }
    }
    publish(events, &deployment, announce);
    Ok(())
}

/// Queues `announce` as Events about `deployment`.
pub fn publish(
    events: &EventSink,
    deployment: &WorkloadRecord,
    announce: Vec<super::decide::Announce>,
) {
    for announce in announce {
        events.publish(
            deployment.object_ref(),
            announce.warning,
            announce.reason,
            announce.note,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::mk_deployment;
    use k8s_openapi::api::apps::v1::Deployment;
    use serde_json::{Value, json};
    use std::collections::BTreeMap;

    fn apply(deployment: &Deployment, change: &MetadataChange) -> Value {
        let mut object = serde_json::to_value(deployment).expect("serializes");
        let record = WorkloadRecord::from(deployment);
        json_patch::patch(&mut object, &operations(&record, change)).expect("applies");
        object
    }

    #[test]
    fn backfill_onto_a_bare_deployment() {
        let mut d = mk_deployment("a", "web", None, &[]);
        d.metadata.resource_version = Some("7".into());
        let change = MetadataChange {
            add_finalizer: true,
            spiffe_id: Some(Some("spiffe://td/x".into())),
            entry_id: Some(Some("sreg.c.1".into())),
            ..Default::default()
        };
        let out = apply(&d, &change);
        assert_eq!(out["metadata"]["finalizers"], json!([FINALIZER]));
        assert_eq!(
            out["metadata"]["annotations"][SPIFFE_ID_ANNOTATION],
            "spiffe://td/x"
        );
        assert_eq!(
            out["metadata"]["annotations"][ENTRY_ID_ANNOTATION],
            "sreg.c.1"
        );
    }

    #[test]
    fn removal_keeps_other_finalizers_and_annotations() {
        let mut d = mk_deployment("a", "web", None, &[]);
        d.metadata.resource_version = Some("7".into());
        d.metadata.finalizers = Some(vec!["x.io/a".into(), FINALIZER.into(), "x.io/b".into()]);
        d.metadata.annotations = Some(BTreeMap::from([
            ("keep".to_string(), "1".to_string()),
            (
                SPIFFE_ID_ANNOTATION.to_string(),
                "spiffe://td/x".to_string(),
            ),
        ]));
        let change = MetadataChange {
            remove_finalizer: true,
            spiffe_id: Some(None),
            entry_id: Some(None),
            ..Default::default()
        };
        let out = apply(&d, &change);
        assert_eq!(out["metadata"]["finalizers"], json!(["x.io/a", "x.io/b"]));
        assert_eq!(out["metadata"]["annotations"], json!({ "keep": "1" }));
    }

    fn try_apply(object: &mut Value, ops: Vec<PatchOperation>) -> bool {
        json_patch::patch(object, &ops).is_ok()
    }

    #[test]
    fn creating_a_map_or_list_needs_the_cached_version() {
        let mut d = mk_deployment("a", "web", None, &[]);
        d.metadata.resource_version = Some("7".into());
        let ops = operations(
            &WorkloadRecord::from(&d),
            &MetadataChange {
                add_finalizer: true,
                ..Default::default()
            },
        );
        let mut newer = serde_json::to_value(&d).expect("serializes");
        newer["metadata"]["resourceVersion"] = "8".into();
        newer["metadata"]["finalizers"] = json!(["someone/else"]);
        assert!(
            !try_apply(&mut newer, ops),
            "would have replaced their list"
        );
    }

    #[test]
    fn status_writes_never_fail_our_patch_but_a_changed_finalizer_list_does() {
        let mut d = mk_deployment("a", "web", None, &[]);
        d.metadata.resource_version = Some("7".into());
        d.metadata.finalizers = Some(vec![FINALIZER.into(), "x.io/b".into()]);
        d.metadata.annotations = Some(BTreeMap::new());
        let change = MetadataChange {
            remove_finalizer: true,
            spiffe_id: Some(Some("spiffe://td/x".into())),
            ..Default::default()
        };
        let mut status_written = serde_json::to_value(&d).expect("serializes");
        status_written["metadata"]["resourceVersion"] = "8".into();
        status_written["status"] = json!({ "observedGeneration": 2 });
        assert!(try_apply(
            &mut status_written,
            operations(&WorkloadRecord::from(&d), &change)
        ));
        assert_eq!(status_written["metadata"]["finalizers"], json!(["x.io/b"]));

        let mut reordered = serde_json::to_value(&d).expect("serializes");
        reordered["metadata"]["finalizers"] = json!(["x.io/b", FINALIZER]);
        assert!(
            !try_apply(
                &mut reordered,
                operations(&WorkloadRecord::from(&d), &change)
            ),
            "an index into a list that changed must not remove someone else's finalizer"
        );
    }

    #[test]
    fn nothing_to_change_writes_nothing() {
        let mut d = mk_deployment("a", "web", None, &[]);
        d.metadata.finalizers = Some(vec![FINALIZER.into()]);
        let change = MetadataChange {
            add_finalizer: true,
            entry_id: Some(None),
            ..Default::default()
        };
        assert!(!writes_anything(&operations(
            &WorkloadRecord::from(&d),
            &change
        )));
    }

    #[test]
    fn a_read_back_shows_a_change_only_when_all_of_it_landed() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
        let change = MetadataChange {
            add_finalizer: true,
            entry_id: Some(Some("sreg.c.1".into())),
            ..MetadataChange::default()
        };
        let mut meta = ObjectMeta {
            finalizers: Some(vec![FINALIZER.into()]),
            annotations: Some(BTreeMap::from([(
                ENTRY_ID_ANNOTATION.into(),
                "sreg.c.1".into(),
            )])),
            ..ObjectMeta::default()
        };
        assert!(shows(&meta, &change));
        meta.finalizers = None;
        assert!(!shows(&meta, &change), "the finalizer is missing");
        meta.finalizers = Some(vec![FINALIZER.into()]);
        meta.annotations = Some(BTreeMap::from([(
            ENTRY_ID_ANNOTATION.into(),
            "sreg.c.2".into(),
        )]));
        assert!(!shows(&meta, &change), "another entry ID");
        let removal = MetadataChange {
            remove_finalizer: true,
            entry_id: Some(None),
            ..MetadataChange::default()
        };
        assert!(!shows(&meta, &removal));
        assert!(shows(&ObjectMeta::default(), &removal));
    }
}
