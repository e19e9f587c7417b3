//! `--tls-cert-file/--tls-key-file` (e.g. mounted from cert-manager): re-read when either file
//! changes, so a renewed certificate is served without a restart.

use super::ReloadableCert;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certs::generate::{new_ca, new_serving};

    #[tokio::test]
    async fn a_renewed_pair_is_served_and_a_half_written_one_is_not() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        let ca = new_ca(Duration::from_secs(3600)).expect("ca");
        let first =
            new_serving(&ca, &["a.svc".into()], &[], Duration::from_secs(3600)).expect("leaf");
        std::fs::write(&cert, &first.cert_pem).expect("write");
        std::fs::write(&key, &first.key_pem).expect("write");
        let serving = Arc::new(
            ReloadableCert::new(first.cert_pem.as_bytes(), first.key_pem.as_bytes()).expect("load"),
        );
        let original = serving.leaf_der();
        let task = tokio::spawn(watch(
            cert.clone(),
            key.clone(),
            serving.clone(),
            Duration::from_millis(20),
        ));

        // A certificate whose key has not been written yet: keep serving the old pair.
        let second =
            new_serving(&ca, &["a.svc".into()], &[], Duration::from_secs(3600)).expect("leaf");
        std::fs::write(&cert, &second.cert_pem).expect("write");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            serving.leaf_der(),
            original,
            "a mismatched pair must not be served"
        );

        std::fs::write(&key, &second.key_pem).expect("write");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while serving.leaf_der() == original {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the renewed pair was not picked up"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        task.abort();
    }
}
