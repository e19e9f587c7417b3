//! Every long-lived task of the process, watched: one that ends before shutdown (returns or
//! panics) is a failure the process cannot repair by itself. A watch that stopped would leave
//! the caches frozen while `/readyz` stayed green; the right answer is to go unready and exit
//! non-zero so Kubernetes restarts the pod.

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use std::borrow::Cow;
use std::time::Duration;
use tokio::task::JoinHandle;

/// How a supervised task ended.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Ended {
    #[error("returned")]
    Returned,
    #[error("panicked: {0}")]
    Panicked(String),
    #[error("was cancelled")]
    Cancelled,
}

/// A named task that ended.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("task {task:?} {how}")]
pub struct TaskEnded {
    pub task: Cow<'static, str>,
    pub how: Ended,
}

#[derive(Default)]
pub struct Supervisor {
    running: FuturesUnordered<Named>,
    /// Tasks that do not watch the shutdown signal (watches, certificate rotation): aborted
    /// at shutdown instead of waited for.
    abort_at_shutdown: Vec<tokio::task::AbortHandle>,
}

type Named = std::pin::Pin<Box<dyn Future<Output = TaskEnded> + Send>>;

impl Supervisor {
    /// Watches a task that runs until the process stops; aborted at shutdown.
    pub fn watch(&mut self, task: impl Into<Cow<'static, str>>, handle: JoinHandle<()>) {
        self.abort_at_shutdown.push(handle.abort_handle());
        self.watch_graceful(task, handle);
    }

    /// Watches a task that ends by itself on shutdown (it is waited for).
    pub fn watch_graceful(&mut self, task: impl Into<Cow<'static, str>>, handle: JoinHandle<()>) {
        let task = task.into();
        self.running.push(Box::pin(async move {
            let how = match handle.await {
                Ok(()) => Ended::Returned,
                Err(error) if error.is_panic() => {
                    let payload = error.into_panic();
                    let message = payload
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| payload.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "(no message)".into());
                    Ended::Panicked(message)
                }
                Err(_) => Ended::Cancelled,
            };
            TaskEnded { task, how }
        }));
    }

    /// The first task to end. Pending forever when nothing is watched.
    pub async fn first_to_end(&mut self) -> TaskEnded {
        match self.running.next().await {
            Some(ended) => ended,
            None => std::future::pending().await,
        }
    }

    /// At shutdown: aborts the tasks that do not stop by themselves and waits for the rest,
    /// at most `limit` (what is still running then is left to the runtime's shutdown).
    pub async fn stop(mut self, limit: Duration) {
        for task in &self.abort_at_shutdown {
            task.abort();
        }
        let drain = async { while self.running.next().await.is_some() {} };
        let _ = tokio::time::timeout(limit, drain).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_first_task_to_end_is_named_with_how() {
        let mut supervisor = Supervisor::default();
        supervisor.watch("forever", tokio::spawn(std::future::pending()));
        let stops = tokio_util::sync::CancellationToken::new();
        supervisor.watch_graceful(
            "graceful",
            tokio::spawn({
                let stops = stops.clone();
                async move { stops.cancelled().await }
            }),
        );
        supervisor.watch("panics", tokio::spawn(async { panic!("boom") }));
        let ended = supervisor.first_to_end().await;
        assert_eq!(
            ended,
            TaskEnded {
                task: "panics".into(),
                how: Ended::Panicked("boom".into())
            }
        );
        supervisor.watch("returns", tokio::spawn(async {}));
        assert_eq!(supervisor.first_to_end().await.how, Ended::Returned);
        tokio::time::timeout(Duration::from_millis(50), supervisor.first_to_end())
            .await
            .expect_err("a task still running has not ended");
        stops.cancel();
        let started = std::time::Instant::now();
        supervisor.stop(Duration::from_secs(10)).await;
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "stop aborts what does not stop by itself and waits for the rest"
        );
    }
}
