//! `--tls-cert-file/--tls-key-file` (e.g. mounted from cert-manager): re-read when either file
//! changes, so a renewed certificate is served without a restart.

use crate::webhook::tls::ReloadableCert;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

/// Polls both files every `interval`; a pair that fails to parse (e.g. caught mid-write) is
/// skipped and the previous certificate keeps serving.
pub async fn watch(cert: PathBuf, key: PathBuf, serving: Arc<ReloadableCert>, interval: Duration) {
    let mut last = (stamp(&cert), stamp(&key));
    loop {
        tokio::time::sleep(interval).await;
        let now = (stamp(&cert), stamp(&key));
        if now == last {
            continue;
        }
        match (tokio::fs::read(&cert).await, tokio::fs::read(&key).await) {
            (Ok(cert_pem), Ok(key_pem)) => match serving.replace(&cert_pem, &key_pem) {
                Ok(()) => {
                    tracing::info!(cert = %cert.display(), "reloaded serving certificate");
                    last = now;
                }
                Err(error) => {
                    tracing::warn!(%error, cert = %cert.display(), "new certificate files do not load yet; keeping the old pair")
                }
            },
            (Err(error), _) | (_, Err(error)) => {
                tracing::warn!(%error, "reading certificate files failed; keeping the old pair")
            }
        }
    }
}
