//! Webhook serving certificates: generated (rcgen) and kept in a Secret by default, or read
//! from files managed by someone else; either way served through a `ReloadableCert`.

pub mod files;
pub mod generate;
pub mod reloadable;
pub mod secret;

use crate::telemetry::ReadyHandle;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use generate::{CertError, Pair};
pub use reloadable::{
    ReloadableCert, TlsError, certified_key, not_after, split_pem_bundle, validity_of_pem,
};
pub use secret::SecretSettings;

#[derive(Clone, Debug)]
pub enum CertSource {
    Files { cert: PathBuf, key: PathBuf },
    Secret(SecretSettings),
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Secret(#[from] secret::SecretError),
}

/// Loads the first certificate (so the server can start) and spawns whatever keeps it fresh.
/// `ready` flips once a certificate is loaded and, for the Secret source, the CA injected.
pub async fn start(
    source: CertSource,
    client: kube::Client,
    ready: ReadyHandle,
) -> Result<(Arc<ReloadableCert>, tokio::task::JoinHandle<()>), StartError> {
    match source {
        CertSource::Files { cert, key } => {
            let read = |path: &PathBuf| {
                std::fs::read(path).map_err(|source| StartError::Read {
                    path: path.clone(),
                    source,
                })
            };
            let serving = Arc::new(ReloadableCert::new(&read(&cert)?, &read(&key)?)?);
            ready.release();
            let task = tokio::spawn(files::watch(
                cert,
                key,
                serving.clone(),
                Duration::from_secs(10),
            ));
            Ok((serving, task))
        }
        CertSource::Secret(settings) => {
            let material = secret::ensure(&client, &settings).await?;
            let serving = Arc::new(ReloadableCert::new(
                material.serving.cert_pem.as_bytes(),
                material.serving.key_pem.as_bytes(),
            )?);
            let task = tokio::spawn(keep_secret_fresh(
                client,
                settings,
                serving.clone(),
                material,
                ready,
            ));
            Ok((serving, task))
        }
    }
}

/// Injects the bundle, then re-reads (and advances) the Secret when due, serving what it
/// holds. Readiness waits for the first injection.
async fn keep_secret_fresh(
    client: kube::Client,
    settings: SecretSettings,
    serving: Arc<ReloadableCert>,
    mut material: secret::Material,
    ready: ReadyHandle,
) {
    let mut ready = Some(ready);
    loop {
        match secret::inject_ca_bundle(&client, &settings.webhook_configuration, &material).await {
            Ok(injected) => {
                if injected == secret::Injected::Newer {
                    tracing::info!(secret = %settings.name, "caBundle is newer than our copy of the Secret; re-reading it");
                }
                if let Some(ready) = ready.take() {
                    ready.release();
                }
            }
            Err(error) => tracing::warn!(%error, "caBundle injection failed; will retry"),
        }
        tokio::time::sleep(secret::next_check(&material)).await;
        match secret::ensure(&client, &settings).await {
            Ok(next) if next != material => {
                if next.serving != material.serving {
                    if let Err(error) = serving.replace(
                        next.serving.cert_pem.as_bytes(),
                        next.serving.key_pem.as_bytes(),
                    ) {
                        tracing::error!(%error, "the Secret's serving certificate does not load; keeping the old one");
                        continue;
                    }
                    tracing::info!(secret = %settings.name, "serving the rotated webhook certificate");
                }
                material = next;
            }
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(%error, "webhook certificate Secret check failed; will retry");
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
    }
}

/// `spiffe-registrar certs generate`: a CA and a serving certificate as files.
pub fn write_files(
    out: &std::path::Path,
    dns_names: &[String],
    ips: &[std::net::IpAddr],
    lifetime: Duration,
) -> Result<(), WriteError> {
    std::fs::create_dir_all(out).map_err(|e| WriteError::Io(out.to_path_buf(), e))?;
    let ca = generate::new_ca(lifetime * 4)?;
    let serving = generate::new_serving(&ca, dns_names, ips, lifetime)?;
    for (name, contents, private) in [
        ("ca.crt", &ca.cert_pem, false),
        ("ca.key", &ca.key_pem, true),
        ("tls.crt", &serving.cert_pem, false),
        ("tls.key", &serving.key_pem, true),
    ] {
        let path = out.join(name);
        std::fs::write(&path, contents).map_err(|e| WriteError::Io(path.clone(), e))?;
        if private {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| WriteError::Io(path.clone(), e))?;
        }
    }
    Ok(())
}

/// Errors of `write_files`.
pub use write_error::WriteError;

mod write_error {
    #[derive(Debug, thiserror::Error)]
    pub enum WriteError {
        #[error("writing {0}: {1}")]
        Io(std::path::PathBuf, std::io::Error),
        #[error(transparent)]
        Cert(#[from] super::CertError),
    }
}
