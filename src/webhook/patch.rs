//! The mutation itself, as a pure function: which JSON Patch operations make a Deployment carry
//! our finalizer and the SPIFFE ID annotation. No I/O, so it is unit-tested exhaustively.

use crate::metadata_patch::{Target, add, remove};
use crate::names::{ENTRY_ID_ANNOTATION, FINALIZER, SPIFFE_ID_ANNOTATION};
use json_patch::PatchOperation;
use kube::api::ObjectMeta;

/// Operations that give `meta` our finalizer and `spiffe_id` as its annotation; empty when it
/// already has both, so an unchanged object gets no patch at all.
pub fn stamp(meta: &ObjectMeta, spiffe_id: &str) -> Vec<PatchOperation> {
    let mut ops = Vec::new();
    match &meta.annotations {
        None => ops.push(add(
            Target::Annotations,
            serde_json::json!({ SPIFFE_ID_ANNOTATION: spiffe_id }),
        )),
        // A user-written value is overwritten: the ID always comes from policy.
        Some(annotations)
            if annotations.get(SPIFFE_ID_ANNOTATION).map(String::as_str) != Some(spiffe_id) =>
        {
            ops.push(add(Target::Annotation(SPIFFE_ID_ANNOTATION), spiffe_id))
        }
        Some(_) => {}
    }
    match &meta.finalizers {
        None => ops.push(add(Target::Finalizers, serde_json::json!([FINALIZER]))),
        Some(finalizers) if !finalizers.iter().any(|f| f == FINALIZER) => {
            ops.push(add(Target::FinalizersEnd, FINALIZER))
        }
        Some(_) => {}
    }
    ops
}

/// An operation that undoes a user-written `entry-id`, and the warning that says so.
pub struct EntryIdFix {
    pub operation: PatchOperation,
    pub warning: String,
}

/// Keeps `entry-id` to what the controller may have written: unchanged from `old`, removed,
/// or the `computed` ID of the entry policy gives this Deployment. Anything else is restored
/// to `old` (or removed), so a value copied from another Deployment never sticks.
pub fn guard_entry_id(
    meta: &ObjectMeta,
    old: Option<&str>,
    computed: Option<&str>,
) -> Option<EntryIdFix> {
    let written = meta.annotations.as_ref()?.get(ENTRY_ID_ANNOTATION)?;
    if Some(written.as_str()) == old || Some(written.as_str()) == computed {
        return None;
    }
    let target = Target::Annotation(ENTRY_ID_ANNOTATION);
    let (operation, what) = match old {
        Some(old) => (add(target, old), format!("restored {old:?}")),
        None => (remove(target), "removed it".to_string()),
    };
    Some(EntryIdFix {
        operation,
        warning: format!(
            "{ENTRY_ID_ANNOTATION} is written by the registrar; {written:?} is not this Deployment's entry, so the webhook {what}"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;
    use std::collections::BTreeMap;

    const ID: &str = "spiffe://example.org/ns/a/sa/b";

    fn apply(mut object: Value, ops: Vec<PatchOperation>) -> Value {
        json_patch::patch(&mut object, &ops).expect("the patch must apply");
        object
    }

    fn meta(object: &Value) -> ObjectMeta {
        serde_json::from_value(object["metadata"].clone()).expect("metadata")
    }

    #[test]
    fn bare_object_gets_both_with_escaped_keys() {
        let object = serde_json::json!({ "metadata": { "name": "web" } });
        let ops = stamp(&meta(&object), ID);
        let text = serde_json::to_string(&ops).expect("serializes");
        assert!(text.contains("/metadata/annotations"), "{text}");
        let patched = apply(object, ops);
        assert_eq!(patched["metadata"]["annotations"][SPIFFE_ID_ANNOTATION], ID);
        assert_eq!(
            patched["metadata"]["finalizers"],
            serde_json::json!([FINALIZER])
        );
    }

    #[test]
    fn existing_maps_and_lists_are_extended_not_replaced() {
        let object = serde_json::json!({ "metadata": {
            "annotations": { "keep": "me" }, "finalizers": ["other.io/x"]
        }});
        let ops = stamp(&meta(&object), ID);
        let text = serde_json::to_string(&ops).expect("serializes");
        assert!(
            text.contains("registrar.spiffe.io~1spiffe-id"),
            "the / in the key is escaped: {text}"
        );
        let patched = apply(object, ops);
        assert_eq!(patched["metadata"]["annotations"]["keep"], "me");
        assert_eq!(
            patched["metadata"]["finalizers"],
            serde_json::json!(["other.io/x", FINALIZER])
        );
    }

    #[test]
    fn user_written_id_is_overwritten() {
        let object = serde_json::json!({ "metadata": {
            "annotations": { SPIFFE_ID_ANNOTATION: "spiffe://example.org/ns/kube-system/sa/admin" },
            "finalizers": [FINALIZER]
        }});
        let patched = apply(object.clone(), stamp(&meta(&object), ID));
        assert_eq!(patched["metadata"]["annotations"][SPIFFE_ID_ANNOTATION], ID);
        assert_eq!(
            patched["metadata"]["finalizers"],
            serde_json::json!([FINALIZER]),
            "no duplicate finalizer"
        );
    }

    #[test]
    fn a_forged_entry_id_is_restored_or_removed_and_the_computed_one_kept() {
        let object = serde_json::json!({ "metadata": {
            "annotations": { ENTRY_ID_ANNOTATION: "sreg.c.someone-elses" }
        }});
        let m = meta(&object);
        let restored = guard_entry_id(&m, Some("sreg.c.mine"), Some("sreg.c.mine")).expect("fix");
        let patched = apply(object.clone(), vec![restored.operation]);
        assert_eq!(
            patched["metadata"]["annotations"][ENTRY_ID_ANNOTATION],
            "sreg.c.mine"
        );
        let removed = guard_entry_id(&m, None, Some("sreg.c.mine")).expect("fix");
        let patched = apply(object, vec![removed.operation]);
        assert_eq!(patched["metadata"]["annotations"], serde_json::json!({}));
        assert!(
            guard_entry_id(&m, Some("sreg.c.someone-elses"), None).is_none(),
            "unchanged"
        );
        assert!(
            guard_entry_id(&m, None, Some("sreg.c.someone-elses")).is_none(),
            "computed"
        );
    }

    #[test]
    fn nothing_to_do_means_no_patch() {
        let meta = ObjectMeta {
            annotations: Some(BTreeMap::from([(
                SPIFFE_ID_ANNOTATION.to_string(),
                ID.to_string(),
            )])),
            finalizers: Some(vec![FINALIZER.to_string()]),
            ..ObjectMeta::default()
        };
        assert!(stamp(&meta, ID).is_empty());
    }
}
