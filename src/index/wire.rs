//! Workloads (Deployments and the other built-in kinds) in Kubernetes' protobuf encoding, as
//! the apiserver sends lists and watch events when asked for
//! `application/vnd.kubernetes.protobuf`. Under kube-controller-manager almost
//! every watch event is a status rewrite we drop, and decoding the JSON of a ~13 KB Deployment
//! was about a third of the CPU each one cost us. Here only the fields a record is built from
//! are declared: the rest (pod template, status, managed fields) are skipped by length, and
//! the annotation values we do not keep (several KB of `last-applied-configuration`) are
//! sliced, never copied or validated as UTF-8.
//!
//! Every kind is `{metadata = 1, spec = 2}`; only where the Pod template sits in `spec`
//! differs (`template_path`), so one decoder serves them all: the spec is walked down that
//! path field by field, everything beside it skipped unread.
//!
//! The field numbers are Kubernetes' `generated.proto` ones (stable: protobuf is a served wire
//! format); `tests/fixtures/deployment-watch.pb` is a real apiserver's stream they are tested
//! against.

use super::workload::{OUR_ANNOTATION_PREFIX, WatchedWorkload};
use crate::keys::WorkloadKind;
use bytes::{Buf, Bytes, BytesMut};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use prost::Message;
use std::collections::BTreeMap;

/// Every object the apiserver encodes starts with this, then a `runtime.Unknown` envelope.
const MAGIC: &[u8] = b"k8s\0";

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("not a Kubernetes protobuf object (no magic prefix)")]
    NoMagic,
    #[error("protobuf: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("expected a {expected}, got a {got}")]
    UnexpectedKind { expected: &'static str, got: String },
    #[error("unknown watch event type {0:?}")]
    UnknownEventType(String),
    #[error("watch event without an object")]
    NoObject,
    #[error("watch frame of {0} bytes, over the {MAX_FRAME} we accept")]
    FrameTooLarge(usize),
}

/// etcd refuses objects over 1.5 MiB; a frame much larger than that is a broken stream, not a
/// Deployment, and must not make us buffer without bound.
const MAX_FRAME: usize = 16 << 20;

/// What one watch event says.
#[derive(Debug)]
pub enum Event {
    Applied(WatchedWorkload),
    Deleted(WatchedWorkload),
    /// The watch is at this resourceVersion, nothing else changed.
    Bookmark(String),
    /// The apiserver ended the watch with a Status (410 Gone: resume by listing again).
    Failed(ApiStatus),
}

/// A `metav1.Status` the apiserver sent instead of an object.
#[derive(Clone, Debug, Default, PartialEq, Eq, thiserror::Error)]
#[error("{code} {reason}: {message}")]
pub struct ApiStatus {
    pub code: i32,
    pub reason: String,
    pub message: String,
}

impl ApiStatus {
    /// The resourceVersion asked for is older than the apiserver keeps: only a new list helps.
    pub fn is_gone(&self) -> bool {
        self.code == 410 || self.reason == "Expired" || self.reason == "Gone"
    }
}

/// One page of a Deployment list.
#[derive(Debug, Default)]
pub struct Page {
    pub items: Vec<WatchedWorkload>,
    pub resource_version: String,
    /// Empty on the last page.
    pub continue_token: String,
}

/// Takes the next whole frame off a watch stream's buffer: a 4-byte big-endian length, then
/// that many bytes. `None` until the frame has fully arrived.
pub fn split_frame(buffer: &mut BytesMut) -> Result<Option<Bytes>, WireError> {
    let Some(prefix) = buffer.first_chunk::<4>() else {
        return Ok(None);
    };
    let length = u32::from_be_bytes(*prefix) as usize;
    if length > MAX_FRAME {
        return Err(WireError::FrameTooLarge(length));
    }
    if buffer.len() < 4 + length {
        buffer.reserve(4 + length - buffer.len());
        return Ok(None);
    }
    buffer.advance(4);
    Ok(Some(buffer.split_to(length).freeze()))
}

/// Decodes one watch frame of `workload`s (the length prefix already taken off).
pub fn decode_event(workload: WorkloadKind, frame: Bytes) -> Result<Event, WireError> {
    let WatchEvent { kind, object } = WatchEvent::decode(frame)?;
    let raw = object.ok_or(WireError::NoObject)?.raw;
    match kind.as_str() {
        "ADDED" | "MODIFIED" => Ok(Event::Applied(object_of(workload, raw)?)),
        "DELETED" => Ok(Event::Deleted(object_of(workload, raw)?)),
        "BOOKMARK" => {
            let bookmark = object_of(workload, raw)?;
            Ok(Event::Bookmark(
                bookmark.metadata.resource_version.unwrap_or_default(),
            ))
        }
        "ERROR" => Ok(Event::Failed(decode_status(raw)?)),
        _ => Err(WireError::UnknownEventType(kind)),
    }
}

/// Decodes a list response's body of `workload`s.
pub fn decode_page(workload: WorkloadKind, body: Bytes) -> Result<Page, WireError> {
    let raw = unwrap(body, workload.list_name())?;
    let WorkloadList { metadata, items } = WorkloadList::decode(raw)?;
    let metadata = metadata.unwrap_or_default();
    Ok(Page {
        items: items
            .into_iter()
            .map(|item| item.into_watched(workload))
            .collect(),
        resource_version: metadata.resource_version,
        continue_token: metadata.continue_token,
    })
}

fn object_of(workload: WorkloadKind, raw: Bytes) -> Result<WatchedWorkload, WireError> {
    let raw = unwrap(raw, workload.name())?;
    Ok(Workload::decode(raw)?.into_watched(workload))
}

/// Where the Pod template sits in each kind's `spec`: field numbers, outermost first.
fn template_path(workload: WorkloadKind) -> &'static [u32] {
    match workload {
        // DeploymentSpec.template, StatefulSetSpec.template
        WorkloadKind::Deployment | WorkloadKind::StatefulSet => &[3],
        // DaemonSetSpec.template
        WorkloadKind::DaemonSet => &[2],
        // JobSpec.template
        WorkloadKind::Job => &[6],
        // CronJobSpec.jobTemplate → JobTemplateSpec.spec → JobSpec.template
        WorkloadKind::CronJob => &[5, 2, 6],
        // A Pod's spec is the Pod spec itself (see `into_watched`). A custom kind is a CRD's,
        // which serves no protobuf (see `custom_watch`): never decoded here.
        WorkloadKind::Pod | WorkloadKind::Custom(_) => &[],
    }
}

/// The last occurrence of length-delimited field `tag` in an encoded message, as a slice of
/// it (a repeated embedded message is merged by protobuf; Kubernetes writes each once).
fn field(mut message: Bytes, tag: u32) -> Option<Bytes> {
    use prost::encoding::{DecodeContext, WireType, decode_key, decode_varint, skip_field};
    let mut found = None;
    while message.has_remaining() {
        let (at, wire_type) = decode_key(&mut message).ok()?;
        if at == tag && wire_type == WireType::LengthDelimited {
            let length = usize::try_from(decode_varint(&mut message).ok()?).ok()?;
            if length > message.remaining() {
                return None;
            }
            found = Some(message.split_to(length));
        } else {
            skip_field(wire_type, at, &mut message, DecodeContext::default()).ok()?;
        }
    }
    found
}

/// Decodes a Status: an error response's body, or an ERROR event's object.
pub fn decode_status(raw: Bytes) -> Result<ApiStatus, WireError> {
    let raw = unwrap(raw, "Status")?;
    let Status {
        message,
        reason,
        code,
    } = Status::decode(raw)?;
    Ok(ApiStatus {
        code,
        reason,
        message,
    })
}

/// Strips the magic prefix and the `runtime.Unknown` envelope, checking the kind inside.
fn unwrap(mut raw: Bytes, expected: &'static str) -> Result<Bytes, WireError> {
    if !raw.starts_with(MAGIC) {
        return Err(WireError::NoMagic);
    }
    raw.advance(MAGIC.len());
    let Unknown { type_meta, raw } = Unknown::decode(raw)?;
    let kind = type_meta.map(|t| t.kind).unwrap_or_default();
    if kind != expected {
        return Err(WireError::UnexpectedKind {
            expected,
            got: kind,
        });
    }
    Ok(raw)
}

// The messages, with only the fields we read. prost skips every other field by its length.

#[derive(Clone, PartialEq, Message)]
struct WatchEvent {
    #[prost(string, tag = "1")]
    kind: String,
    #[prost(message, optional, tag = "2")]
    object: Option<RawExtension>,
}

#[derive(Clone, PartialEq, Message)]
struct RawExtension {
    #[prost(bytes = "bytes", tag = "1")]
    raw: Bytes,
}

#[derive(Clone, PartialEq, Message)]
struct Unknown {
    #[prost(message, optional, tag = "1")]
    type_meta: Option<TypeMeta>,
    #[prost(bytes = "bytes", tag = "2")]
    raw: Bytes,
}

#[derive(Clone, PartialEq, Message)]
struct TypeMeta {
    #[prost(string, tag = "2")]
    kind: String,
}

#[derive(Clone, PartialEq, Message)]
struct Status {
    #[prost(string, tag = "3")]
    message: String,
    #[prost(string, tag = "4")]
    reason: String,
    #[prost(int32, tag = "6")]
    code: i32,
}

#[derive(Clone, PartialEq, Message)]
struct WorkloadList {
    #[prost(message, optional, tag = "1")]
    metadata: Option<ListMeta>,
    #[prost(message, repeated, tag = "2")]
    items: Vec<Workload>,
}

#[derive(Clone, PartialEq, Message)]
struct ListMeta {
    #[prost(string, tag = "2")]
    resource_version: String,
    #[prost(string, tag = "3")]
    continue_token: String,
}

/// Any workload kind: its spec is kept encoded and walked to the Pod template.
#[derive(Clone, PartialEq, Message)]
struct Workload {
    #[prost(message, optional, tag = "1")]
    metadata: Option<Meta>,
    #[prost(bytes = "bytes", optional, tag = "2")]
    spec: Option<Bytes>,
}

#[derive(Clone, PartialEq, Message)]
struct Meta {
    #[prost(string, optional, tag = "1")]
    name: Option<String>,
    #[prost(string, optional, tag = "3")]
    namespace: Option<String>,
    #[prost(string, optional, tag = "5")]
    uid: Option<String>,
    #[prost(string, optional, tag = "6")]
    resource_version: Option<String>,
    #[prost(message, optional, tag = "8")]
    creation_timestamp: Option<ProtoTime>,
    #[prost(message, optional, tag = "9")]
    deletion_timestamp: Option<ProtoTime>,
    #[prost(btree_map = "string, string", tag = "11")]
    labels: BTreeMap<String, String>,
    /// Map entries left encoded: only ours are decoded (`ours`).
    #[prost(bytes = "bytes", repeated, tag = "12")]
    annotations: Vec<Bytes>,
    /// Left encoded: only whether one names a controller is read (`controlled`).
    #[prost(bytes = "bytes", repeated, tag = "13")]
    owner_references: Vec<Bytes>,
    #[prost(string, repeated, tag = "14")]
    finalizers: Vec<String>,
}

/// An OwnerReference, for its `controller` flag alone.
#[derive(Clone, PartialEq, Message)]
struct OwnerReference {
    #[prost(bool, optional, tag = "6")]
    controller: Option<bool>,
}

/// A map entry whose value stays a slice of the frame until we know we keep it.
#[derive(Clone, PartialEq, Message)]
struct AnnotationEntry {
    #[prost(bytes = "bytes", tag = "1")]
    key: Bytes,
    #[prost(bytes = "bytes", tag = "2")]
    value: Bytes,
}

#[derive(Clone, PartialEq, Message)]
struct ProtoTime {
    #[prost(int64, tag = "1")]
    seconds: i64,
    #[prost(int32, tag = "2")]
    nanos: i32,
}

#[derive(Clone, PartialEq, Message)]
struct PodTemplateSpec {
    #[prost(message, optional, tag = "2")]
    spec: Option<PodSpec>,
}

#[derive(Clone, PartialEq, Message)]
struct PodSpec {
    #[prost(string, optional, tag = "8")]
    service_account_name: Option<String>,
    #[prost(string, optional, tag = "9")]
    service_account: Option<String>,
}

impl Workload {
    fn into_watched(self, workload: WorkloadKind) -> WatchedWorkload {
        let meta = self.metadata.unwrap_or_default();
        let spec = self.spec.unwrap_or_default();
        let pod = match workload {
            WorkloadKind::Pod => PodSpec::decode(spec).ok(),
            _ => template_path(workload)
                .iter()
                .try_fold(spec, |inner, tag| field(inner, *tag))
                .and_then(|t| PodTemplateSpec::decode(t).ok())
                .and_then(|t| t.spec),
        };
        let (service_account_name, service_account) = pod.map_or((None, None), |p| {
            (p.service_account_name, p.service_account)
        });
        WatchedWorkload::from_parts(
            meta.into_object_meta(),
            service_account_name,
            service_account,
        )
    }
}

impl Meta {
    /// As the JSON watch would have decoded it. An empty map or list is absent: Go omits
    /// both from JSON (`omitempty`), so the two encodings agree on what "no annotations" is.
    fn into_object_meta(self) -> ObjectMeta {
        let Self {
            name,
            namespace,
            uid,
            resource_version,
            creation_timestamp,
            deletion_timestamp,
            labels,
            annotations,
            owner_references,
            finalizers,
        } = self;
        let controlled = owner_references.into_iter().any(|reference| {
            OwnerReference::decode(reference).is_ok_and(|r| r.controller == Some(true))
        });
        ObjectMeta {
            name,
            namespace,
            uid,
            resource_version,
            creation_timestamp: creation_timestamp.and_then(ProtoTime::into_time),
            deletion_timestamp: deletion_timestamp.and_then(ProtoTime::into_time),
            labels: (!labels.is_empty()).then_some(labels),
            annotations: (!annotations.is_empty()).then(|| ours(annotations)),
            finalizers: (!finalizers.is_empty()).then_some(finalizers),
            owner_references: controlled.then(super::workload::controller_reference),
            ..ObjectMeta::default()
        }
    }
}

/// Our annotations out of the encoded entries; a malformed entry or value is dropped like a
/// foreign one (the decision then sees the annotation missing and rewrites it).
fn ours(entries: Vec<Bytes>) -> BTreeMap<String, String> {
    entries
        .into_iter()
        .filter_map(|entry| {
            let AnnotationEntry { key, value } = AnnotationEntry::decode(entry).ok()?;
            if !key.starts_with(OUR_ANNOTATION_PREFIX.as_bytes()) {
                return None;
            }
            let key = std::str::from_utf8(&key).ok()?;
            let value = std::str::from_utf8(&value).ok()?;
            Some((key.to_owned(), value.to_owned()))
        })
        .collect()
}

impl ProtoTime {
    fn into_time(self) -> Option<Time> {
        Timestamp::new(self.seconds, self.nanos).ok().map(Time)
    }
}

/// Encodes what a fake apiserver sends, for the watch loop's tests.
#[cfg(test)]
pub mod testing {
    use super::*;

    fn enveloped(kind: &str, raw: Vec<u8>) -> Bytes {
        let envelope = Unknown {
            type_meta: Some(TypeMeta { kind: kind.into() }),
            raw: raw.into(),
        };
        [MAGIC, &envelope.encode_to_vec()].concat().into()
    }

    fn deployment(name: &str, resource_version: &str) -> Vec<u8> {
        Workload {
            metadata: Some(Meta {
                name: Some(name.into()),
                namespace: Some("a".into()),
                uid: Some(format!("uid-{name}")),
                resource_version: Some(resource_version.into()),
                ..Meta::default()
            }),
            spec: None,
        }
        .encode_to_vec()
    }

    fn status(code: i32, reason: &str) -> Vec<u8> {
        Status {
            message: format!("{reason} for a test"),
            reason: reason.into(),
            code,
        }
        .encode_to_vec()
    }

    /// One length-prefixed watch frame: `kind` (ADDED, DELETED, BOOKMARK..) of Deployment
    /// `a/name` at `resource_version`.
    pub fn frame(kind: &str, name: &str, resource_version: &str) -> Vec<u8> {
        framed(
            kind,
            enveloped("Deployment", deployment(name, resource_version)),
        )
    }

    /// A watch frame ending the watch with a Status.
    pub fn error_frame(code: i32, reason: &str) -> Vec<u8> {
        framed("ERROR", enveloped("Status", status(code, reason)))
    }

    fn framed(kind: &str, object: Bytes) -> Vec<u8> {
        let event = WatchEvent {
            kind: kind.into(),
            object: Some(RawExtension { raw: object }),
        }
        .encode_to_vec();
        let length = u32::try_from(event.len()).expect("small").to_be_bytes();
        [&length[..], &event].concat()
    }

    /// A list response's body: Deployments `a/name` at resourceVersion 1.
    pub fn page(names: &[&str], resource_version: &str, continue_token: &str) -> Bytes {
        let list = WorkloadList {
            metadata: Some(ListMeta {
                resource_version: resource_version.into(),
                continue_token: continue_token.into(),
            }),
            items: names
                .iter()
                .map(|name| Workload::decode(&deployment(name, "1")[..]).expect("round trip"))
                .collect(),
        };
        enveloped("DeploymentList", list.encode_to_vec())
    }

    /// An error response's body.
    pub fn status_body(code: i32, reason: &str) -> Bytes {
        enveloped("Status", status(code, reason))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::workload::WorkloadRecord;

    /// One real apiserver (v1.36) watch of one Deployment, read twice at once: as protobuf and
    /// as JSON. Between them: our entry-id and a foreign annotation added, a label changed, a
    /// delete held by our finalizer, the finalizer removed, the delete, a bookmark.
    const WATCH_PB: &[u8] = include_bytes!("../../tests/fixtures/deployment-watch.pb");
    const WATCH_JSON: &str = include_str!("../../tests/fixtures/deployment-watch.json");

    fn frames(mut stream: BytesMut) -> Vec<Bytes> {
        let mut frames = Vec::new();
        while let Some(frame) = split_frame(&mut stream).expect("well-formed") {
            frames.push(frame);
        }
        assert!(stream.is_empty(), "nothing left over");
        frames
    }

    #[test]
    fn protobuf_and_json_watches_of_the_same_changes_give_the_same_records() {
        let events: Vec<Event> = frames(BytesMut::from(WATCH_PB))
            .into_iter()
            .map(|frame| decode_event(WorkloadKind::Deployment, frame).expect("decodes"))
            .collect();
        let json: Vec<kube::api::WatchEvent<WatchedWorkload>> = WATCH_JSON
            .lines()
            .map(|line| serde_json::from_str(line).expect("JSON event"))
            .collect();
        assert_eq!(events.len(), 7);
        assert_eq!(events.len(), json.len());
        let record = |d: &WatchedWorkload| -> WorkloadRecord { d.record(WorkloadKind::Deployment) };
        for (i, (pb, json)) in events.iter().zip(&json).enumerate() {
            use kube::api::WatchEvent as J;
            match (pb, json) {
                (Event::Applied(pb), J::Modified(json))
                | (Event::Deleted(pb), J::Deleted(json)) => {
                    assert_eq!(record(pb), record(json), "event {i}");
                }
                (Event::Bookmark(rv), J::Bookmark(json)) => {
                    assert_eq!(rv, &json.metadata.resource_version, "event {i}");
                }
                other => panic!("event {i}: {other:?}"),
            }
        }
        let Event::Applied(first) = &events[0] else {
            panic!("MODIFIED first")
        };
        let first = first.record(WorkloadKind::Deployment);
        assert_eq!(&*first.service_account, "api");
        assert_eq!(first.entry_id(), Some("abc123"));
        assert_eq!(first.spiffe_id(), Some("spiffe://example.org/ns/pb/sa/api"));
        assert!(first.has_finalizer());
        assert!(first.created.is_some());
        let Event::Applied(held) = &events[3] else {
            panic!("the held delete is a MODIFIED")
        };
        assert!(held.record(WorkloadKind::Deployment).deleting);
    }

    #[test]
    fn only_our_annotations_are_kept() {
        let Some(Event::Applied(first)) = frames(BytesMut::from(WATCH_PB))
            .into_iter()
            .next()
            .map(|frame| decode_event(WorkloadKind::Deployment, frame).expect("decodes"))
        else {
            panic!("MODIFIED first")
        };
        let annotations = first
            .metadata
            .annotations
            .expect("the object has annotations");
        let keys: Vec<&str> = annotations.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "registrar.spiffe.io/entry-id",
                "registrar.spiffe.io/spiffe-id"
            ]
        );
    }

    #[test]
    fn frames_split_at_every_boundary_a_stream_can_cut() {
        let whole = frames(BytesMut::from(WATCH_PB));
        for cut in [1, 3, 4, 5, 100, 9_552, 9_553, 20_000] {
            let mut buffer = BytesMut::new();
            let mut got = Vec::new();
            for piece in WATCH_PB.chunks(cut) {
                buffer.extend_from_slice(piece);
                while let Some(frame) = split_frame(&mut buffer).expect("well-formed") {
                    got.push(frame);
                }
            }
            assert_eq!(got, whole, "cut every {cut} bytes");
        }
    }

    #[test]
    fn an_oversized_frame_is_refused_before_it_is_buffered() {
        let mut buffer = BytesMut::from(&u32::MAX.to_be_bytes()[..]);
        assert!(matches!(
            split_frame(&mut buffer),
            Err(WireError::FrameTooLarge(_))
        ));
    }

    #[test]
    fn a_status_is_read_from_an_error_body_and_a_gone_watch() {
        let status = decode_status(Bytes::from_static(include_bytes!(
            "../../tests/fixtures/status-not-found.pb"
        )))
        .expect("a Status");
        assert_eq!(status.code, 404);
        assert_eq!(status.reason, "NotFound");
        assert!(status.message.contains("\"nope\" not found"), "{status}");
        assert!(!status.is_gone());

        // A watch the apiserver ends because its resourceVersion is too old, as it encodes it.
        let gone = Status {
            message: "too old resource version: 1 (300)".into(),
            reason: "Expired".into(),
            code: 410,
        };
        let envelope = Unknown {
            type_meta: Some(TypeMeta {
                kind: "Status".into(),
            }),
            raw: gone.encode_to_vec().into(),
        };
        let event = WatchEvent {
            kind: "ERROR".into(),
            object: Some(RawExtension {
                raw: [MAGIC, &envelope.encode_to_vec()].concat().into(),
            }),
        };
        let Event::Failed(status) =
            decode_event(WorkloadKind::Deployment, event.encode_to_vec().into()).expect("decodes")
        else {
            panic!("an ERROR event is a failure")
        };
        assert!(status.is_gone(), "{status}");
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for bytes in [
            &b""[..],
            b"\x0a\x05ADDED",
            b"\x0a\x05ADDED\x12\x03\x0a\x01x",
            b"\xff\xff",
        ] {
            assert!(
                decode_event(WorkloadKind::Deployment, Bytes::copy_from_slice(bytes)).is_err(),
                "{bytes:?}"
            );
        }
        assert!(matches!(
            decode_page(
                WorkloadKind::Deployment,
                Bytes::from_static(b"{\"kind\":\"DeploymentList\"}")
            ),
            Err(WireError::NoMagic)
        ));
    }
    /// `inner` as length-delimited field `tag`.
    fn wrapped(tag: u32, inner: Vec<u8>) -> Vec<u8> {
        use prost::encoding::{WireType, encode_key, encode_varint};
        let mut out = Vec::new();
        encode_key(tag, WireType::LengthDelimited, &mut out);
        encode_varint(inner.len() as u64, &mut out);
        out.extend(inner);
        out
    }

    /// Fields beside the template at every level, which the walk must step over: a varint and
    /// a length-delimited one, at tags no kind uses.
    fn beside() -> Vec<u8> {
        use prost::encoding::{WireType, encode_key, encode_varint};
        let mut out = Vec::new();
        encode_key(98, WireType::Varint, &mut out);
        encode_varint(300, &mut out);
        out.extend(wrapped(99, b"not the template".to_vec()));
        out
    }

    #[test]
    fn every_kind_yields_the_service_account_of_its_pod_template() {
        for kind in WorkloadKind::ALL {
            let service_account = format!("sa-of-{}", kind.plural());
            let mut spec = PodTemplateSpec {
                spec: Some(PodSpec {
                    service_account_name: Some(service_account.clone()),
                    service_account: None,
                }),
            }
            .encode_to_vec();
            for tag in template_path(kind).iter().rev() {
                let mut level = beside();
                level.extend(wrapped(*tag, spec));
                level.extend(beside());
                spec = level;
            }
            let object = Workload {
                metadata: Some(Meta {
                    name: Some("w".into()),
                    namespace: Some("a".into()),
                    resource_version: Some("7".into()),
                    ..Meta::default()
                }),
                spec: Some(spec.into()),
            };
            let envelope = |kind: &str, raw: Vec<u8>| -> Bytes {
                let unknown = Unknown {
                    type_meta: Some(TypeMeta { kind: kind.into() }),
                    raw: raw.into(),
                };
                [MAGIC, &unknown.encode_to_vec()].concat().into()
            };
            let event = WatchEvent {
                kind: "ADDED".into(),
                object: Some(RawExtension {
                    raw: envelope(kind.name(), object.encode_to_vec()),
                }),
            };
            let Event::Applied(watched) =
                decode_event(kind, event.encode_to_vec().into()).expect("decodes")
            else {
                panic!("{kind:?}: not an applied event");
            };
            assert_eq!(
                &*watched.record(kind).service_account,
                service_account,
                "{kind:?}"
            );
            let list = WorkloadList {
                metadata: Some(ListMeta::default()),
                items: vec![object],
            };
            let page = decode_page(kind, envelope(kind.list_name(), list.encode_to_vec()))
                .expect("decodes");
            assert_eq!(
                &*page.items[0].record(kind).service_account,
                service_account,
                "{kind:?} in a list"
            );
            // The other kinds' names are refused: a watch never mixes kinds.
            let other = WorkloadKind::ALL
                .into_iter()
                .find(|k| *k != kind)
                .expect("five");
            assert!(decode_event(other, event.encode_to_vec().into()).is_err());
        }
    }

    #[test]
    fn a_kind_without_a_pod_template_runs_as_the_default_service_account() {
        let object = Workload {
            metadata: Some(Meta::default()),
            spec: Some(beside().into()),
        };
        let watched = object.into_watched(WorkloadKind::CronJob);
        assert_eq!(
            &*watched.record(WorkloadKind::CronJob).service_account,
            "default"
        );
    }

    /// A Pod's spec is the Pod spec itself; its owner references say whether it is bare.
    #[test]
    fn a_pod_yields_its_service_account_and_whether_a_controller_owns_it() {
        let owner = |controller: Option<bool>| OwnerReference { controller }.encode_to_vec().into();
        for (references, controlled) in [
            (vec![], false),
            (vec![owner(None), owner(Some(false))], false),
            (vec![owner(Some(false)), owner(Some(true))], true),
        ] {
            let mut spec = beside();
            spec.extend(
                PodSpec {
                    service_account_name: Some("solo".into()),
                    service_account: None,
                }
                .encode_to_vec(),
            );
            let object = Workload {
                metadata: Some(Meta {
                    name: Some("p".into()),
                    owner_references: references,
                    ..Meta::default()
                }),
                spec: Some(spec.into()),
            };
            let watched = object.into_watched(WorkloadKind::Pod);
            assert_eq!(watched.controlled(), controlled);
            assert_eq!(&*watched.record(WorkloadKind::Pod).service_account, "solo");
        }
    }
}
