//! In-cluster default: the webhook CA and serving certificate live in one Secret that every
//! replica converges on, and the CA is injected into our MutatingWebhookConfiguration.
//!
//! ```text
//! Secret <ns>/<name>: ca.crt ca.key tls.crt tls.key
//!   annotations: registrar.spiffe.io/serving-renew-at (unix s), registrar.spiffe.io/serving-names
//! ```
//! Replicas racing to create it: one create wins, the others get AlreadyExists and read the
//! winner's. Rotation is a replace with the read resourceVersion, so two rotating replicas
//! cannot both win either. The serving certificate is re-issued by the same CA, so the
//! caBundle stays valid across rotations and no admission request fails during one.

use super::generate::{CertError, Pair, new_ca, new_serving};
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const RENEW_AT: &str = "registrar.spiffe.io/serving-renew-at";
const NAMES: &str = "registrar.spiffe.io/serving-names";

#[derive(Clone, Debug)]
pub struct SecretSettings {
    pub namespace: String,
    pub name: String,
    /// MutatingWebhookConfiguration whose webhooks get our CA as caBundle.
    pub webhook_configuration: String,
    pub dns_names: Vec<String>,
    pub ips: Vec<IpAddr>,
    pub ca_lifetime: Duration,
    /// Serving certificates are renewed after 2/3 of this.
    pub serving_lifetime: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("reading or writing Secret {namespace}/{name}: {source}")]
    Api {
        namespace: String,
        name: String,
        source: kube::Error,
    },
    #[error("updating caBundle of MutatingWebhookConfiguration {name}: {source}")]
    Inject { name: String, source: kube::Error },
    #[error(transparent)]
    Cert(#[from] CertError),
    #[error("Secret {0} kept changing under us; will retry")]
    Contended(String),
}

/// The material one replica serves, as read from (or written to) the Secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Material {
    pub ca: Pair,
    pub serving: Pair,
    /// Unix seconds after which the serving certificate is re-issued.
    pub renew_at: u64,
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn names_key(settings: &SecretSettings) -> String {
    let mut names: Vec<String> = settings.dns_names.clone();
    names.extend(settings.ips.iter().map(IpAddr::to_string));
    names.join(",")
}

fn text(data: &BTreeMap<String, ByteString>, key: &str) -> Option<String> {
    data.get(key)
        .and_then(|b| String::from_utf8(b.0.clone()).ok())
        .filter(|s| !s.is_empty())
}

fn parse(secret: &Secret) -> Option<(Material, String)> {
    let data = secret.data.as_ref()?;
    let annotations = secret.metadata.annotations.as_ref()?;
    let material = Material {
        ca: Pair {
            cert_pem: text(data, "ca.crt")?,
            key_pem: text(data, "ca.key")?,
        },
        serving: Pair {
            cert_pem: text(data, "tls.crt")?,
            key_pem: text(data, "tls.key")?,
        },
        renew_at: annotations.get(RENEW_AT)?.parse().ok()?,
    };
    Some((
        material,
        annotations.get(NAMES).cloned().unwrap_or_default(),
    ))
}

fn issue(settings: &SecretSettings, ca: Option<Pair>) -> Result<Material, CertError> {
    let ca = match ca {
        Some(ca) => ca,
        None => new_ca(settings.ca_lifetime)?,
    };
    let serving = new_serving(
        &ca,
        &settings.dns_names,
        &settings.ips,
        settings.serving_lifetime,
    )?;
    let renew_at = now() + settings.serving_lifetime.as_secs() * 2 / 3;
    Ok(Material {
        ca,
        serving,
        renew_at,
    })
}

fn to_secret(
    settings: &SecretSettings,
    material: &Material,
    resource_version: Option<String>,
) -> Secret {
    let bytes = |s: &str| ByteString(s.as_bytes().to_vec());
    Secret {
        metadata: ObjectMeta {
            name: Some(settings.name.clone()),
            namespace: Some(settings.namespace.clone()),
            resource_version,
            annotations: Some(BTreeMap::from([
                (RENEW_AT.to_string(), material.renew_at.to_string()),
                (NAMES.to_string(), names_key(settings)),
            ])),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/managed-by".to_string(),
                "spiffe-registrar".to_string(),
            )])),
            ..ObjectMeta::default()
        },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(BTreeMap::from([
            ("ca.crt".to_string(), bytes(&material.ca.cert_pem)),
            ("ca.key".to_string(), bytes(&material.ca.key_pem)),
            ("tls.crt".to_string(), bytes(&material.serving.cert_pem)),
            ("tls.key".to_string(), bytes(&material.serving.key_pem)),
        ])),
        ..Secret::default()
    }
}

/// Reads the Secret, creating or rotating it when needed, and returns what to serve.
pub async fn ensure(client: &Client, settings: &SecretSettings) -> Result<Material, SecretError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), &settings.namespace);
    let api_error = |source| SecretError::Api {
        namespace: settings.namespace.clone(),
        name: settings.name.clone(),
        source,
    };
    for _ in 0..5 {
        let current = api.get_opt(&settings.name).await.map_err(api_error)?;
        let Some(secret) = current else {
            let material = issue(settings, None)?;
            match api
                .create(
                    &PostParams::default(),
                    &to_secret(settings, &material, None),
                )
                .await
            {
                Ok(_) => {
                    tracing::info!(secret = %settings.name, "created webhook certificate Secret");
                    return Ok(material);
                }
                // Another replica created it first: read theirs.
                Err(kube::Error::Api(status)) if status.code == 409 => continue,
                Err(error) => return Err(api_error(error)),
            }
        };
        let resource_version = secret.metadata.resource_version.clone();
        let next = match parse(&secret) {
            Some((material, names))
                if names == names_key(settings) && material.renew_at > now() =>
            {
                return Ok(material);
            }
            // Same CA, new serving certificate: the caBundle stays valid throughout.
            Some((material, _)) => issue(settings, Some(material.ca))?,
            None => {
                tracing::warn!(secret = %settings.name, "webhook certificate Secret is incomplete; regenerating");
                issue(settings, None)?
            }
        };
        match api
            .replace(
                &settings.name,
                &PostParams::default(),
                &to_secret(settings, &next, resource_version),
            )
            .await
        {
            Ok(_) => {
                tracing::info!(secret = %settings.name, renew_at = next.renew_at, "rotated webhook serving certificate");
                return Ok(next);
            }
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            Err(error) => return Err(api_error(error)),
        }
    }
    Err(SecretError::Contended(settings.name.clone()))
}

/// Sets `ca_pem` as the caBundle of every webhook in the configuration. A missing
/// configuration is not an error: it may be installed later, and the next round injects.
pub async fn inject_ca_bundle(
    client: &Client,
    configuration: &str,
    ca_pem: &str,
) -> Result<bool, SecretError> {
    let api: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let inject_error = |source| SecretError::Inject {
        name: configuration.to_string(),
        source,
    };
    let Some(mut config) = api.get_opt(configuration).await.map_err(inject_error)? else {
        tracing::debug!(
            configuration,
            "MutatingWebhookConfiguration not found; nothing to inject yet"
        );
        return Ok(false);
    };
    let wanted = ByteString(ca_pem.as_bytes().to_vec());
    let mut changed = false;
    for webhook in config.webhooks.iter_mut().flatten() {
        if webhook.client_config.ca_bundle.as_ref() != Some(&wanted) {
            webhook.client_config.ca_bundle = Some(wanted.clone());
            changed = true;
        }
    }
    if changed {
        config.metadata.managed_fields = None;
        api.replace(configuration, &PostParams::default(), &config)
            .await
            .map_err(inject_error)?;
        tracing::info!(configuration, "injected webhook CA into caBundle");
    }
    Ok(true)
}

/// Seconds until `material` wants renewing, capped so the Secret is re-read regularly (another
/// replica may have rotated it, or someone deleted it).
pub fn next_check(material: &Material) -> Duration {
    Duration::from_secs(material.renew_at.saturating_sub(now()).clamp(1, 30))
}
