//! A workload kind's list and watch in protobuf (see `wire` for why). kube-runtime's watcher
//! speaks JSON only, so this is its loop for one resource, yielding the same events into the
//! same `batches::drain_workloads`: list in pages (`Init`, `InitApply`.., `InitDone`), then
//! watch from the list's resourceVersion with bookmarks, resume where the watch ended, list
//! again when the apiserver says the resourceVersion is gone (410), and back off on errors and
//! on watches something closes at once.

use super::wire::{self, ApiStatus, WireError};
use super::workload::WatchedWorkload;
use crate::keys::WorkloadKind;
use bytes::{Bytes, BytesMut};
use futures::{Stream, StreamExt};
use http::{Request, StatusCode, header};
use http_body_util::BodyExt;
use kube::Client;
use kube::client::Body;
use kube::runtime::watcher::Event;
use std::time::Duration;

const LIST_ACCEPT: &str = "application/vnd.kubernetes.protobuf";
const WATCH_ACCEPT: &str = "application/vnd.kubernetes.protobuf;stream=watch";
/// The apiserver ends each watch after this long (kube-runtime's default); we resume from the
/// last resourceVersion seen, so this only spreads watches over apiserver restarts.
const WATCH_TIMEOUT_S: u64 = 290;
/// A watch silent for longer than the apiserver's own timeout is a dead connection (no FIN ever
/// arrived): dropped and resumed.
const WATCH_IDLE: Duration = Duration::from_secs(WATCH_TIMEOUT_S + 5);

/// A watch that ends sooner than this was not ended by the apiserver's timeout.
const SHORT_WATCH: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("listing failed: {0}")]
    List(#[source] kube::Error),
    #[error("starting the watch failed: {0}")]
    WatchStart(#[source] kube::Error),
    #[error("reading the watch failed: {0}")]
    Read(#[source] kube::Error),
    #[error("the apiserver refused: {0}")]
    Api(#[source] ApiStatus),
    #[error("undecodable protobuf: {0}")]
    Decode(#[from] WireError),
    /// A custom kind's JSON watch (kube's watcher).
    #[error("{0}")]
    Json(#[source] kube::runtime::watcher::Error),
}

pub type WorkloadEvent = Result<Event<WatchedWorkload>, WatchError>;

/// Every workload of `kind` in the cluster, listed `page` at a time, then watched. Never ends:
/// errors are yielded (for the caller to log, with the kind) and retried after a backoff.
pub fn workloads(
    client: Client,
    kind: WorkloadKind,
    page: u32,
) -> impl Stream<Item = WorkloadEvent> {
    async_stream::stream! {
        let mut backoff = Backoff::default();
        let mut resource_version: Option<String> = None;
        loop {
            let steps = match resource_version.take() {
                None => list(&client, kind, page, &mut backoff).boxed(),
                Some(version) => watch(&client, kind, version, &mut backoff).boxed(),
            };
            for await step in steps {
                match step {
                    Step::Yield(event) => yield event,
                    Step::ResumeAt(version) => resource_version = Some(version),
                }
            }
        }
    }
}

/// What a list or a watch tells the loop: an event to pass on, or where the next watch
/// starts. A list or watch that ends without `ResumeAt` is followed by a fresh list.
// Most steps are events, passed on as the stream yields them: boxing them would cost an
// allocation per event to save a few bytes on the rare `ResumeAt`.
#[allow(clippy::large_enum_variant)]
enum Step {
    Yield(WorkloadEvent),
    ResumeAt(String),
}

/// A list, from its first page, as `Init`, `InitApply`.., `InitDone`.
fn list<'a>(
    client: &'a Client,
    kind: WorkloadKind,
    page: u32,
    backoff: &'a mut Backoff,
) -> impl Stream<Item = Step> + Send + 'a {
    async_stream::stream! {
        yield Step::Yield(Ok(Event::Init));
        let mut token = String::new();
        loop {
            match list_page(client, kind, page, &token).await {
                Ok(listed) => {
                    for object in listed.items {
                        yield Step::Yield(Ok(Event::InitApply(object)));
                    }
                    if listed.continue_token.is_empty() {
                        yield Step::ResumeAt(listed.resource_version);
                        break;
                    }
                    token = listed.continue_token;
                }
                Err(error) => {
                    let expired = matches!(&error, WatchError::Api(status) if status.is_gone());
                    yield Step::Yield(Err(error));
                    backoff.wait().await;
                    if expired {
                        // The continue token outlived the apiserver's history: the pages
                        // read so far may no longer be one snapshot.
                        yield Step::Yield(Ok(Event::Init));
                        token.clear();
                    }
                }
            }
        }
        backoff.reset();
        yield Step::Yield(Ok(Event::InitDone));
    }
}

/// A watch from `version` until it ends, fails or is gone.
fn watch<'a>(
    client: &'a Client,
    kind: WorkloadKind,
    version: String,
    backoff: &'a mut Backoff,
) -> impl Stream<Item = Step> + Send + 'a {
    async_stream::stream! {
        let body = match start_watch(client, kind, &version).await {
            Ok(body) => body,
            // Gone: no resume point, the loop lists again.
            Err(WatchError::Api(status)) if status.is_gone() => return,
            Err(error) => {
                yield Step::Yield(Err(error));
                backoff.wait().await;
                yield Step::ResumeAt(version);
                return;
            }
        };
        let mut frames = Frames::new(body);
        let mut version = version;
        let watching_since = tokio::time::Instant::now();
        loop {
            let frame = match tokio::time::timeout(WATCH_IDLE, frames.next()).await {
                Ok(Ok(Some(frame))) => frame,
                // Ended by the apiserver (timeout) or silent for too long: resume.
                Ok(Ok(None)) | Err(_) => {
                    if watching_since.elapsed() < SHORT_WATCH {
                        // Something between us and the apiserver (a proxy, a load
                        // balancer) closes watches at once: no tight reconnect loop.
                        backoff.wait().await;
                    }
                    yield Step::ResumeAt(version);
                    break;
                }
                Ok(Err(error)) => {
                    yield Step::Yield(Err(error));
                    backoff.wait().await;
                    yield Step::ResumeAt(version);
                    break;
                }
            };
            match wire::decode_event(kind, frame) {
                Ok(wire::Event::Applied(object)) => {
                    version = object.metadata.resource_version.clone().unwrap_or(version);
                    backoff.reset();
                    yield Step::Yield(Ok(Event::Apply(object)));
                }
                Ok(wire::Event::Deleted(object)) => {
                    version = object.metadata.resource_version.clone().unwrap_or(version);
                    backoff.reset();
                    yield Step::Yield(Ok(Event::Delete(object)));
                }
                Ok(wire::Event::Bookmark(at)) => {
                    if !at.is_empty() {
                        version = at;
                    }
                }
                // Gone: no resume point, the loop lists again.
                Ok(wire::Event::Failed(status)) if status.is_gone() => break,
                Ok(wire::Event::Failed(status)) => {
                    yield Step::Yield(Err(WatchError::Api(status)));
                    backoff.wait().await;
                    yield Step::ResumeAt(version);
                    break;
                }
                Err(error) => {
                    // One undecodable event would otherwise be lost for good: list again.
                    yield Step::Yield(Err(error.into()));
                    backoff.wait().await;
                    break;
                }
            }
        }
    }
}

async fn list_page(
    client: &Client,
    kind: WorkloadKind,
    page: u32,
    token: &str,
) -> Result<wire::Page, WatchError> {
    let mut uri = format!("{}?limit={page}", kind.api_path());
    if !token.is_empty() {
        uri.push_str("&continue=");
        uri.push_str(&percent_encode(token));
    }
    let body = send(client, &uri, LIST_ACCEPT, WatchError::List).await?;
    let body = body.collect().await.map_err(WatchError::List)?.to_bytes();
    Ok(wire::decode_page(kind, body)?)
}

async fn start_watch(
    client: &Client,
    kind: WorkloadKind,
    version: &str,
) -> Result<Body, WatchError> {
    let uri = format!(
        "{}?watch=1&allowWatchBookmarks=true&timeoutSeconds={WATCH_TIMEOUT_S}&resourceVersion={}",
        kind.api_path(),
        percent_encode(version)
    );
    send(client, &uri, WATCH_ACCEPT, WatchError::WatchStart).await
}

/// GETs `uri`: the body of a success, the apiserver's Status otherwise. `failed` names the
/// step a transport error happened in.
async fn send(
    client: &Client,
    uri: &str,
    accept: &'static str,
    failed: fn(kube::Error) -> WatchError,
) -> Result<Body, WatchError> {
    let response = client.send(get(uri, accept)).await.map_err(failed)?;
    let status = response.status();
    if status.is_success() {
        return Ok(response.into_body());
    }
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(failed)?
        .to_bytes();
    Err(WatchError::Api(refusal(status, body)))
}

fn get(uri: &str, accept: &'static str) -> Request<Body> {
    Request::get(uri)
        .header(header::ACCEPT, accept)
        // Kubernetes >= 1.37 may compress watch streams per event, which kube's client does
        // not decode (see its `request_events`); identity for lists too, we read them whole.
        .header(header::ACCEPT_ENCODING, "identity")
        .body(Body::empty())
        .expect("a GET with static headers is a valid request")
}

/// The Status an error response carries, or one made of the HTTP status when the body is not
/// a protobuf Status (a proxy's page, a JSON body).
fn refusal(status: StatusCode, body: Bytes) -> ApiStatus {
    wire::decode_status(body.clone()).unwrap_or_else(|_| ApiStatus {
        code: i32::from(status.as_u16()),
        reason: status.canonical_reason().unwrap_or_default().to_owned(),
        message: String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned(),
    })
}

/// Continue tokens are base64 (`+`, `/`, `=`), resourceVersions digits; both go in a query.
fn percent_encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A watch body cut into frames.
struct Frames {
    body: Body,
    buffer: BytesMut,
}

impl Frames {
    fn new(body: Body) -> Self {
        Self {
            body,
            buffer: BytesMut::new(),
        }
    }

    /// The next whole frame; `None` when the body ended cleanly between frames.
    async fn next(&mut self) -> Result<Option<Bytes>, WatchError> {
        loop {
            if let Some(frame) = wire::split_frame(&mut self.buffer)? {
                return Ok(Some(frame));
            }
            match self.body.frame().await {
                None => return Ok(None),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buffer.extend_from_slice(&data);
                    }
                }
                // A connection cut mid-stream: resumable like a clean end (kube does the same).
                Some(Err(error)) if is_eof(&error) => return Ok(None),
                Some(Err(error)) => return Err(WatchError::Read(error)),
            }
        }
    }
}

fn is_eof(error: &kube::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(error) = source {
        if error
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::UnexpectedEof)
            || error.to_string().contains("unexpected EOF during chunk")
        {
            return true;
        }
        source = error.source();
    }
    false
}

/// kube-runtime's default: 0.8 s doubling to 30 s, with jitter, reset once things work.
#[derive(Default)]
struct Backoff {
    failures: u32,
}

impl Backoff {
    fn delay(&self) -> Duration {
        let base = Duration::from_millis(800) * 2u32.saturating_pow(self.failures.min(6));
        let capped = base.min(Duration::from_secs(30));
        capped.mul_f64(rand::random_range(0.5..1.0))
    }

    async fn wait(&mut self) {
        let delay = self.delay();
        self.failures += 1;
        tracing::debug!(
            delay_ms = delay.as_millis() as u64,
            "workload watch backing off"
        );
        tokio::time::sleep(delay).await;
    }

    fn reset(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::wire::testing::{error_frame, frame, page, status_body};
    use futures::StreamExt;
    use http::Response;
    use http_body_util::combinators::BoxBody;
    use http_body_util::{Full, StreamBody};
    use std::collections::VecDeque;
    use std::convert::Infallible;
    use std::sync::{Arc, Mutex};

    /// What the fake apiserver answers to one request.
    enum Reply {
        Ok(Bytes),
        Refused(u16, Bytes),
    }

    /// An apiserver that answers a script in order, checking each request's query, and holds
    /// every request after the script open forever (a watch with nothing to say).
    #[derive(Clone, Default)]
    struct Fake {
        script: Arc<Mutex<VecDeque<(&'static str, Reply)>>>,
        asked: Arc<Mutex<Vec<String>>>,
    }

    impl Fake {
        fn then(self, query: &'static str, reply: Reply) -> Self {
            self.script.lock().unwrap().push_back((query, reply));
            self
        }

        fn client(&self) -> Client {
            let fake = self.clone();
            let service = tower::service_fn(move |request: Request<Body>| {
                let fake = fake.clone();
                async move {
                    let query = request.uri().query().unwrap_or_default().to_owned();
                    let accept = request.headers()[header::ACCEPT]
                        .to_str()
                        .unwrap()
                        .to_owned();
                    assert!(accept.starts_with(LIST_ACCEPT), "{accept}");
                    assert_eq!(accept.contains("stream=watch"), query.contains("watch=1"));
                    fake.asked.lock().unwrap().push(query.clone());
                    let next = fake.script.lock().unwrap().pop_front();
                    let response = match next {
                        Some((expected, reply)) => {
                            assert!(
                                query.contains(expected),
                                "asked {query}, scripted {expected}"
                            );
                            match reply {
                                Reply::Ok(body) => Response::new(Full::new(body).boxed()),
                                Reply::Refused(code, body) => {
                                    let mut response = Response::new(Full::new(body).boxed());
                                    *response.status_mut() = StatusCode::from_u16(code).unwrap();
                                    response
                                }
                            }
                        }
                        None => Response::new(BoxBody::new(StreamBody::new(
                            futures::stream::pending::<Result<hyper::body::Frame<Bytes>, Infallible>>(
                            ),
                        ))),
                    };
                    Ok::<_, Infallible>(response)
                }
            });
            Client::new(service, "default")
        }

        fn asked(&self) -> Vec<String> {
            self.asked.lock().unwrap().clone()
        }

        fn done(&self) -> bool {
            self.script.lock().unwrap().is_empty()
        }
    }

    fn frames(frames: &[Vec<u8>]) -> Reply {
        Reply::Ok(frames.concat().into())
    }

    /// The events as `kind name` strings, until `count` of them arrived.
    async fn events(fake: &Fake, count: usize) -> Vec<String> {
        workloads(fake.client(), WorkloadKind::Deployment, 2)
            .take(count)
            .map(|event| match event {
                Ok(Event::Init) => "Init".to_owned(),
                Ok(Event::InitApply(d)) => format!("InitApply {}", d.metadata.name.unwrap()),
                Ok(Event::InitDone) => "InitDone".to_owned(),
                Ok(Event::Apply(d)) => format!("Apply {}", d.metadata.name.unwrap()),
                Ok(Event::Delete(d)) => format!("Delete {}", d.metadata.name.unwrap()),
                Err(error) => format!("Err {error}"),
            })
            .collect()
            .await
    }

    #[tokio::test(start_paused = true)]
    async fn lists_in_pages_then_watches_and_resumes_from_the_last_version_seen() {
        let fake = Fake::default()
            .then("limit=2", Reply::Ok(page(&["x", "y"], "", "tok/1=")))
            .then("continue=tok%2F1%3D", Reply::Ok(page(&["z"], "10", "")))
            .then(
                "resourceVersion=10",
                frames(&[frame("ADDED", "w", "11"), frame("BOOKMARK", "", "15")]),
            )
            // The apiserver ended that watch (its timeout): resumed from the bookmark.
            .then("resourceVersion=15", frames(&[frame("DELETED", "x", "16")]))
            .then(
                "resourceVersion=16",
                frames(&[frame("MODIFIED", "y", "17")]),
            );
        let seen = events(&fake, 8).await;
        assert_eq!(
            seen,
            [
                "Init",
                "InitApply x",
                "InitApply y",
                "InitApply z",
                "InitDone",
                "Apply w",
                "Delete x",
                "Apply y"
            ]
        );
        assert!(fake.done());
        assert!(
            fake.asked()[2].contains("allowWatchBookmarks=true"),
            "{:?}",
            fake.asked()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_gone_resource_version_lists_again_however_it_is_said() {
        let fake = Fake::default()
            .then("limit=2", Reply::Ok(page(&["x"], "10", "")))
            // Said by the watch, as an ERROR event.
            .then("resourceVersion=10", frames(&[error_frame(410, "Expired")]))
            .then("limit=2", Reply::Ok(page(&["y"], "20", "")))
            // Said when the watch starts, as the response's status.
            .then(
                "resourceVersion=20",
                Reply::Refused(410, status_body(410, "Gone")),
            )
            .then("limit=2", Reply::Ok(page(&["z"], "30", "")));
        let seen = events(&fake, 9).await;
        assert_eq!(
            seen,
            [
                "Init",
                "InitApply x",
                "InitDone",
                "Init",
                "InitApply y",
                "InitDone",
                "Init",
                "InitApply z",
                "InitDone"
            ]
        );
        assert!(fake.done());
    }

    #[tokio::test(start_paused = true)]
    async fn watches_closed_at_once_are_retried_with_backoff_not_in_a_loop() {
        let fake = Fake::default()
            .then("limit=2", Reply::Ok(page(&["x"], "10", "")))
            .then("resourceVersion=10", Reply::Ok(Bytes::new()))
            .then("resourceVersion=10", Reply::Ok(Bytes::new()))
            .then("resourceVersion=10", Reply::Ok(Bytes::new()));
        let started = tokio::time::Instant::now();
        let watch = tokio::spawn(
            workloads(fake.client(), WorkloadKind::Deployment, 2).for_each(|_| async {}),
        );
        while !fake.done() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Two ends waited out before the third watch: at least 0.4 + 0.8 s of jittered backoff.
        assert!(
            started.elapsed() >= Duration::from_millis(1_200),
            "{:?}",
            started.elapsed()
        );
        watch.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn failures_back_off_then_resume_where_they_were() {
        let fake = Fake::default()
            .then("limit=2", Reply::Ok(page(&["x", "y"], "", "t")))
            .then(
                "continue=t",
                Reply::Refused(503, Bytes::from_static(b"overloaded")),
            )
            // The same page again, not the list from scratch.
            .then("continue=t", Reply::Ok(page(&["z"], "10", "")))
            .then(
                "resourceVersion=10",
                Reply::Refused(500, status_body(500, "InternalError")),
            )
            .then(
                "resourceVersion=10",
                frames(&[error_frame(500, "InternalError")]),
            )
            // An undecodable event cannot be skipped (it would be lost): list again.
            .then(
                "resourceVersion=10",
                frames(&[[&4u32.to_be_bytes()[..], b"\xff\xff\xff\xff"].concat()]),
            )
            .then("limit=2", Reply::Ok(page(&["w"], "40", "")));
        let started = tokio::time::Instant::now();
        let seen = events(&fake, 12).await;
        assert_eq!(&seen[..3], ["Init", "InitApply x", "InitApply y"]);
        assert!(
            seen[3].starts_with("Err the apiserver refused: 503"),
            "{seen:?}"
        );
        assert_eq!(&seen[4..6], ["InitApply z", "InitDone"]);
        assert!(seen[6].contains("InternalError"), "{seen:?}");
        assert!(seen[7].contains("InternalError"), "{seen:?}");
        assert!(seen[8].starts_with("Err undecodable"), "{seen:?}");
        assert_eq!(&seen[9..], ["Init", "InitApply w", "InitDone"]);
        assert!(fake.done());
        // Four failures in a row, each waited out: at least 0.4 + 0.8 + 1.6 s of jittered
        // backoff (the list's success reset it before the watch failures).
        assert!(
            started.elapsed() >= Duration::from_millis(400 + 400 + 800),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn continue_tokens_survive_the_query_string() {
        assert_eq!(percent_encode("12345"), "12345");
        assert_eq!(percent_encode("eyJ2+Ij/oi=="), "eyJ2%2BIj%2Foi%3D%3D");
    }

    #[test]
    fn backoff_grows_to_its_cap_and_resets() {
        let mut backoff = Backoff::default();
        let first = backoff.delay();
        assert!(first >= Duration::from_millis(400) && first < Duration::from_millis(800));
        backoff.failures = 20;
        let late = backoff.delay();
        assert!(late >= Duration::from_secs(15) && late < Duration::from_secs(30));
        backoff.reset();
        assert!(backoff.delay() < Duration::from_millis(800));
    }
}
