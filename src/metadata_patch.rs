//! JSON Patch operations on an object's metadata: the one builder behind the webhook's
//! mutation (`webhook::patch`) and the controller's and uninstall's writes
//! (`controller::record`). Paths are named, never formatted by hand, so an annotation key's
//! `/` is escaped (`~1`) in exactly one place.

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, PatchOperation, RemoveOperation, TestOperation};
use serde_json::Value;
use std::borrow::Cow;

/// What an operation points at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target<'a> {
    /// The whole annotation map (`/metadata/annotations`).
    Annotations,
    /// One annotation, by its unescaped key.
    Annotation(&'a str),
    /// The whole finalizer list.
    Finalizers,
    /// One finalizer, by index.
    FinalizerAt(usize),
    /// The position after the last finalizer (`-`): where `add` appends.
    FinalizersEnd,
    /// `/metadata/resourceVersion`: what a `test` guards a whole-object assumption with.
    ResourceVersion,
}

impl Target<'_> {
    fn pointer(self) -> PointerBuf {
        let (field, item): (&str, Option<Cow<str>>) = match self {
            Target::Annotations => ("annotations", None),
            Target::Annotation(key) => ("annotations", Some(key.into())),
            Target::Finalizers => ("finalizers", None),
            Target::FinalizerAt(index) => ("finalizers", Some(index.to_string().into())),
            Target::FinalizersEnd => ("finalizers", Some("-".into())),
            Target::ResourceVersion => ("resourceVersion", None),
        };
        match item {
            Some(item) => PointerBuf::from_tokens(["metadata", field, &item]),
            None => PointerBuf::from_tokens(["metadata", field]),
        }
    }
}

pub fn add(target: Target, value: impl Into<Value>) -> PatchOperation {
    PatchOperation::Add(AddOperation {
        path: target.pointer(),
        value: value.into(),
    })
}

pub fn remove(target: Target) -> PatchOperation {
    PatchOperation::Remove(RemoveOperation {
        path: target.pointer(),
    })
}

/// Makes the whole patch fail unless `target` still holds `value`.
pub fn test(target: Target, value: impl Into<Value>) -> PatchOperation {
    PatchOperation::Test(TestOperation {
        path: target.pointer(),
        value: value.into(),
    })
}

/// Whether `ops` change anything (tests alone do not), so an empty change sends no request.
pub fn writes_anything(ops: &[PatchOperation]) -> bool {
    ops.iter().any(|op| !matches!(op, PatchOperation::Test(_)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn paths_are_escaped_and_shaped_as_the_apiserver_expects() {
        let ops = vec![
            test(Target::ResourceVersion, "7"),
            add(Target::Annotations, json!({})),
            add(Target::Annotation("registrar.spiffe.io/entry-id"), "id"),
            remove(Target::Annotation("a~b")),
            test(Target::Finalizers, json!(["x"])),
            add(Target::FinalizersEnd, "f"),
            remove(Target::FinalizerAt(1)),
        ];
        assert_eq!(
            serde_json::to_value(&ops).expect("serializes"),
            json!([
                { "op": "test", "path": "/metadata/resourceVersion", "value": "7" },
                { "op": "add", "path": "/metadata/annotations", "value": {} },
                { "op": "add", "path": "/metadata/annotations/registrar.spiffe.io~1entry-id", "value": "id" },
                { "op": "remove", "path": "/metadata/annotations/a~0b" },
                { "op": "test", "path": "/metadata/finalizers", "value": ["x"] },
                { "op": "add", "path": "/metadata/finalizers/-", "value": "f" },
                { "op": "remove", "path": "/metadata/finalizers/1" },
            ])
        );
        assert!(writes_anything(&ops));
        assert!(!writes_anything(&ops[..1]));
    }
}
