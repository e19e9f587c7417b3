//! The mutation itself, as a pure function: which JSON Patch operations make a Deployment carry
//! our finalizer and the SPIFFE ID annotation. No I/O, so it is unit-tested exhaustively.

use crate::names::{FINALIZER, SPIFFE_ID_ANNOTATION};
use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, PatchOperation};
use kube::api::ObjectMeta;
use serde_json::Value;

/// Operations that give `meta` our finalizer and `spiffe_id` as its annotation; empty when it
/// already has both, so an unchanged object gets no patch at all.
pub fn stamp(meta: &ObjectMeta, spiffe_id: &str) -> Vec<PatchOperation> {
    let mut ops = Vec::new();
    match &meta.annotations {
        None => ops.push(add(
            &["metadata", "annotations"],
            serde_json::json!({ SPIFFE_ID_ANNOTATION: spiffe_id }),
        )),
        // A user-written value is overwritten: the ID always comes from policy.
        Some(annotations)
            if annotations.get(SPIFFE_ID_ANNOTATION).map(String::as_str) != Some(spiffe_id) =>
        {
            ops.push(add(
                &["metadata", "annotations", SPIFFE_ID_ANNOTATION],
                Value::from(spiffe_id),
            ))
        }
        Some(_) => {}
    }
    match &meta.finalizers {
        None => ops.push(add(
            &["metadata", "finalizers"],
            serde_json::json!([FINALIZER]),
        )),
        Some(finalizers) if !finalizers.iter().any(|f| f == FINALIZER) => ops.push(add(
            &["metadata", "finalizers", "-"],
            Value::from(FINALIZER),
        )),
        Some(_) => {}
    }
    ops
}

/// An `add` at the path made of `tokens` (each escaped: `/` → `~1`, `~` → `~0`).
fn add(tokens: &[&str], value: Value) -> PatchOperation {
    PatchOperation::Add(AddOperation {
        path: PointerBuf::from_tokens(tokens.iter().copied()),
        value,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
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
