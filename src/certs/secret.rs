//! In-cluster default: the webhook CA and serving certificate live in one Secret that every
//! replica converges on, and the CA bundle is injected into our MutatingWebhookConfiguration.
//!
//! ```text
//! Secret <ns>/<name>:
//!   ca.crt ca.key           the CA that signs serving certificates now
//!   next-ca.crt next-ca.key a CA being introduced (only during a CA rotation)
//!   ca-bundle.crt           every CA the apiserver must trust: the signing one, the one being
//!                           introduced, and retired ones until they expire
//!   tls.crt tls.key         the serving certificate
//!   annotations: registrar.spiffe.io/serving-renew-at (unix s), …/serving-names,
//!                …/ca-bundle-generation (unix ms when the bundle last changed),
//!                …/next-ca-since (unix s when the next CA entered the bundle)
//! ```
//! Replicas racing to create it: one create wins, the others get AlreadyExists and read the
//! winner's. Every change is a replace with the read resourceVersion, so two replicas cannot
//! both win. Serving certificates are re-issued by the same CA, so the caBundle stays valid.
//!
//! A CA is rotated with an overlap, in steps that each keep every served certificate trusted:
//! after 2/3 of its lifetime a next CA is added to the bundle (nothing signs with it yet); once
//! the webhook configuration carries that bundle, and the apiserver has had `PROMOTION_DELAY`
//! to pick it up, the next CA signs a new serving certificate and the old CA stays in the
//! bundle until it expires, long after every replica re-read the Secret (every ≤30 s). The
//! injected bundle carries its generation, and a replica never replaces a newer one: a
//! replica still holding an old Secret cannot take the new CA out of `caBundle`.

use super::generate::{BACKDATE, CertError, Pair, new_ca, new_serving};
use super::reloadable::{split_pem_bundle, validity_of_pem};
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
const GENERATION: &str = "registrar.spiffe.io/ca-bundle-generation";
const NEXT_SINCE: &str = "registrar.spiffe.io/next-ca-since";

/// How long a next CA sits in an injected bundle before it signs: the apiserver reloads a
/// webhook configuration's caBundle from its watch within about a second.
pub const PROMOTION_DELAY: Duration = Duration::from_secs(10);

#[derive(Clone, Debug)]
pub struct SecretSettings {
    pub namespace: String,
    pub name: String,
    /// MutatingWebhookConfiguration whose webhooks get our CA bundle as caBundle.
    pub webhook_configuration: String,
    pub dns_names: Vec<String>,
    pub ips: Vec<IpAddr>,
    /// CAs are rotated after 2/3 of this.
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
    /// Signs serving certificates.
    pub ca: Pair,
    /// Being introduced: in the bundle, not signing yet.
    pub next_ca: Option<Pair>,
    /// Unix seconds when `next_ca` entered the bundle.
    pub next_since: u64,
    /// PEM certificates of every CA to trust, one per element.
    pub bundle: Vec<String>,
    /// Unix milliseconds when the bundle last changed: orders bundles across replicas.
    pub generation: u64,
    pub serving: Pair,
    /// Unix seconds after which the serving certificate is re-issued.
    pub renew_at: u64,
}

impl Material {
    /// The bundle as the PEM text injected into `caBundle`.
    pub fn bundle_pem(&self) -> String {
        self.bundle.concat()
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
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
    let pair = |cert: &str, key: &str| {
        Some(Pair {
            cert_pem: text(data, cert)?,
            key_pem: text(data, key)?,
        })
    };
    let ca = pair("ca.crt", "ca.key")?;
    // Secrets written before CA rotation existed hold no bundle: theirs is the CA alone.
    let bundle = text(data, "ca-bundle.crt")
        .map(|pem| split_pem_bundle(&pem))
        .filter(|certs| !certs.is_empty())
        .unwrap_or_else(|| split_pem_bundle(&ca.cert_pem));
    let number = |key: &str| annotations.get(key).and_then(|v| v.parse().ok());
    let material = Material {
        next_ca: pair("next-ca.crt", "next-ca.key"),
        next_since: number(NEXT_SINCE).unwrap_or(0),
        bundle,
        generation: number(GENERATION).unwrap_or(0),
        serving: pair("tls.crt", "tls.key")?,
        renew_at: number(RENEW_AT)?,
        ca,
    };
    Some((
        material,
        annotations.get(NAMES).cloned().unwrap_or_default(),
    ))
}

/// When a CA should be replaced: after 2/3 of the lifetime it was issued for (its validity
/// starts `BACKDATE` before issuance).
fn ca_renew_at(ca: &Pair) -> u64 {
    validity_of_pem(&ca.cert_pem)
        .map(|(from, until)| {
            let lifetime = (until - from - BACKDATE.as_secs() as i64).max(0);
            (until - lifetime / 3).max(0) as u64
        })
        .unwrap_or(0)
}

fn expired(cert_pem: &str, at: u64) -> bool {
    validity_of_pem(cert_pem).is_none_or(|(_, until)| until <= at as i64)
}

/// A serving certificate from `ca`, never outliving it.
fn serve_from(settings: &SecretSettings, ca: &Pair, at: u64) -> Result<(Pair, u64), CertError> {
    let ca_left = validity_of_pem(&ca.cert_pem)
        .map(|(_, until)| until.saturating_sub(at as i64).max(60) as u64)
        .unwrap_or(u64::MAX);
    let lifetime = settings.serving_lifetime.min(Duration::from_secs(ca_left));
    let serving = new_serving(ca, &settings.dns_names, &settings.ips, lifetime)?;
    Ok((serving, at + lifetime.as_secs() * 2 / 3))
}

fn fresh(settings: &SecretSettings, at: u64) -> Result<Material, CertError> {
    let ca = new_ca(settings.ca_lifetime)?;
    let (serving, renew_at) = serve_from(settings, &ca, at)?;
    Ok(Material {
        bundle: split_pem_bundle(&ca.cert_pem),
        ca,
        next_ca: None,
        next_since: 0,
        generation: now_ms(),
        serving,
        renew_at,
    })
}

/// What the Secret should become at `at`, or `None` when it is fine as it is. `injected`:
/// the webhook configuration carries this material's bundle (or does not exist yet, so no
/// apiserver call can fail).
fn advance(
    settings: &SecretSettings,
    current: Option<(Material, String)>,
    at: u64,
    injected: bool,
) -> Result<Option<Material>, CertError> {
    let Some((mut material, names)) = current else {
        return fresh(settings, at).map(Some);
    };
    let mut changed = false;
    let mut bundle_changed = false;
    // A CA that expired can no longer be trusted usefully; one that is still signing has to be
    // replaced at once (nothing it signs verifies any more).
    if expired(&material.ca.cert_pem, at) && material.next_ca.is_none() {
        tracing::warn!(secret = %settings.name, "the webhook CA has expired; replacing it");
        return fresh(settings, at).map(Some);
    }
    let promote = material.next_ca.is_some()
        && injected
        && at >= material.next_since + PROMOTION_DELAY.as_secs();
    if promote && let Some(next) = material.next_ca.take() {
        tracing::info!(secret = %settings.name, "the next webhook CA is in caBundle; it signs from now on");
        material.ca = next;
        let (serving, renew_at) = serve_from(settings, &material.ca, at)?;
        material.serving = serving;
        material.renew_at = renew_at;
        changed = true;
    }
    if material.next_ca.is_none() && at >= ca_renew_at(&material.ca) {
        let next = new_ca(settings.ca_lifetime)?;
        tracing::info!(secret = %settings.name, "introducing the next webhook CA into caBundle");
        material.bundle.push(next.cert_pem.clone());
        material.next_ca = Some(next);
        material.next_since = at;
        bundle_changed = true;
    }
    let before = material.bundle.len();
    let keep = |pem: &String| {
        !expired(pem, at)
            || *pem == material.ca.cert_pem
            || material
                .next_ca
                .as_ref()
                .is_some_and(|n| n.cert_pem == *pem)
    };
    let kept: Vec<String> = material
        .bundle
        .iter()
        .filter(|p| keep(p))
        .cloned()
        .collect();
    if kept.len() != before {
        material.bundle = kept;
        bundle_changed = true;
    }
    if !material.bundle.contains(&material.ca.cert_pem) {
        material.bundle.push(material.ca.cert_pem.clone());
        bundle_changed = true;
    }
    if bundle_changed {
        material.generation = now_ms().max(material.generation + 1);
        changed = true;
    }
    if !promote && (names != names_key(settings) || material.renew_at <= at) {
        let (serving, renew_at) = serve_from(settings, &material.ca, at)?;
        material.serving = serving;
        material.renew_at = renew_at;
        changed = true;
    }
    Ok(changed.then_some(material))
}

fn to_secret(
    settings: &SecretSettings,
    material: &Material,
    resource_version: Option<String>,
) -> Secret {
    let bytes = |s: &str| ByteString(s.as_bytes().to_vec());
    let mut annotations = BTreeMap::from([
        (RENEW_AT.to_string(), material.renew_at.to_string()),
        (NAMES.to_string(), names_key(settings)),
        (GENERATION.to_string(), material.generation.to_string()),
    ]);
    let mut data = BTreeMap::from([
        ("ca.crt".to_string(), bytes(&material.ca.cert_pem)),
        ("ca.key".to_string(), bytes(&material.ca.key_pem)),
        ("ca-bundle.crt".to_string(), bytes(&material.bundle_pem())),
        ("tls.crt".to_string(), bytes(&material.serving.cert_pem)),
        ("tls.key".to_string(), bytes(&material.serving.key_pem)),
    ]);
    if let Some(next) = &material.next_ca {
        annotations.insert(NEXT_SINCE.to_string(), material.next_since.to_string());
        data.insert("next-ca.crt".to_string(), bytes(&next.cert_pem));
        data.insert("next-ca.key".to_string(), bytes(&next.key_pem));
    }
    Secret {
        metadata: ObjectMeta {
            name: Some(settings.name.clone()),
            namespace: Some(settings.namespace.clone()),
            resource_version,
            annotations: Some(annotations),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/managed-by".to_string(),
                "spiffe-registrar".to_string(),
            )])),
            ..ObjectMeta::default()
        },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(data),
        ..Secret::default()
    }
}

/// Reads the Secret, creating or advancing it (serving renewal, CA rotation steps) when
/// needed, and returns what to serve and inject.
pub async fn ensure(client: &Client, settings: &SecretSettings) -> Result<Material, SecretError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), &settings.namespace);
    let api_error = |source| SecretError::Api {
        namespace: settings.namespace.clone(),
        name: settings.name.clone(),
        source,
    };
    for _ in 0..5 {
        let current = api.get_opt(&settings.name).await.map_err(api_error)?;
        let resource_version = current
            .as_ref()
            .and_then(|s| s.metadata.resource_version.clone());
        let parsed = match &current {
            Some(secret) => match parse(secret) {
                Some(parsed) => Some(parsed),
                None => {
                    tracing::warn!(secret = %settings.name, "webhook certificate Secret is incomplete; regenerating");
                    None
                }
            },
            None => None,
        };
        let injected = match &parsed {
            Some((material, _)) if material.next_ca.is_some() => {
                carries_bundle(client, &settings.webhook_configuration, material).await?
            }
            _ => false,
        };
        let unchanged = parsed.as_ref().map(|(m, _)| m.clone());
        let Some(next) = advance(settings, parsed, now(), injected)? else {
            return Ok(unchanged.expect("advance keeps only existing material"));
        };
        let written = match current {
            None => {
                api.create(&PostParams::default(), &to_secret(settings, &next, None))
                    .await
            }
            Some(_) => {
                api.replace(
                    &settings.name,
                    &PostParams::default(),
                    &to_secret(settings, &next, resource_version),
                )
                .await
            }
        };
        match written {
            Ok(_) => {
                tracing::info!(secret = %settings.name, renew_at = next.renew_at, bundle_generation = next.generation, "wrote webhook certificate Secret");
                return Ok(next);
            }
            // Another replica wrote first: read theirs.
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            Err(error) => return Err(api_error(error)),
        }
    }
    Err(SecretError::Contended(settings.name.clone()))
}

/// Whether every webhook of the configuration trusts `material`'s bundle (an absent
/// configuration sends no request, so nothing can fail).
async fn carries_bundle(
    client: &Client,
    configuration: &str,
    material: &Material,
) -> Result<bool, SecretError> {
    let api: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let config = api
        .get_opt(configuration)
        .await
        .map_err(|source| SecretError::Inject {
            name: configuration.to_string(),
            source,
        })?;
    let wanted = ByteString(material.bundle_pem().into_bytes());
    Ok(config.is_none_or(|config| {
        config
            .webhooks
            .iter()
            .flatten()
            .all(|w| w.client_config.ca_bundle.as_ref() == Some(&wanted))
    }))
}

/// What an injection did.
#[derive(Debug, PartialEq, Eq)]
pub enum Injected {
    /// The configuration carries our bundle (now or already).
    Ours,
    /// It carries a newer bundle than ours: this replica has not re-read the Secret yet.
    Newer,
    /// No such configuration (yet).
    Absent,
}

/// Sets `material`'s bundle as the caBundle of every webhook in the configuration, unless the
/// configuration already carries a newer generation. The replace carries the read
/// resourceVersion, so two replicas cannot interleave.
pub async fn inject_ca_bundle(
    client: &Client,
    configuration: &str,
    material: &Material,
) -> Result<Injected, SecretError> {
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
        return Ok(Injected::Absent);
    };
    let theirs: u64 = config
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(GENERATION))
        .and_then(|g| g.parse().ok())
        .unwrap_or(0);
    if theirs > material.generation {
        return Ok(Injected::Newer);
    }
    let wanted = ByteString(material.bundle_pem().into_bytes());
    let mut changed = theirs != material.generation;
    for webhook in config.webhooks.iter_mut().flatten() {
        if webhook.client_config.ca_bundle.as_ref() != Some(&wanted) {
            webhook.client_config.ca_bundle = Some(wanted.clone());
            changed = true;
        }
    }
    if changed {
        config.metadata.managed_fields = None;
        config
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(GENERATION.to_string(), material.generation.to_string());
        api.replace(configuration, &PostParams::default(), &config)
            .await
            .map_err(inject_error)?;
        tracing::info!(
            configuration,
            cas = material.bundle.len(),
            bundle_generation = material.generation,
            "injected the webhook CA bundle into caBundle"
        );
    }
    Ok(Injected::Ours)
}

/// Seconds until `material` wants attention (serving renewal, CA rotation, a CA in the bundle
/// expiring), capped so the Secret is re-read regularly (another replica may have rotated it,
/// or someone deleted it); every second while a next CA waits to be promoted.
pub fn next_check(material: &Material) -> Duration {
    if material.next_ca.is_some() {
        return Duration::from_secs(1);
    }
    let retired_expiry = material
        .bundle
        .iter()
        .filter_map(|pem| validity_of_pem(pem))
        .map(|(_, until)| until.max(0) as u64 + 1)
        .min()
        .unwrap_or(u64::MAX);
    let due = material
        .renew_at
        .min(ca_renew_at(&material.ca))
        .min(retired_expiry);
    Duration::from_secs(due.saturating_sub(now()).clamp(1, 30))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(ca_lifetime: u64) -> SecretSettings {
        SecretSettings {
            namespace: "ns".into(),
            name: "tls".into(),
            webhook_configuration: "wh".into(),
            dns_names: vec!["svc.ns.svc".into()],
            ips: vec![],
            ca_lifetime: Duration::from_secs(ca_lifetime),
            serving_lifetime: Duration::from_secs(3600),
        }
    }

    fn step(s: &SecretSettings, m: &Material, at: u64, injected: bool) -> Option<Material> {
        advance(s, Some((m.clone(), names_key(s))), at, injected).expect("advance")
    }

    fn until(pem: &str) -> u64 {
        validity_of_pem(pem).expect("a certificate").1 as u64
    }

    #[test]
    fn a_ca_is_rotated_with_both_in_the_bundle_until_the_old_one_expires() {
        let s = settings(3000);
        let start = now();
        let first = advance(&s, None, start, false)
            .expect("issue")
            .expect("created");
        assert_eq!(first.bundle, vec![first.ca.cert_pem.clone()]);
        assert_eq!(
            step(&s, &first, start, false),
            None,
            "fresh material is kept"
        );

        // After 2/3 of the CA's life: a next CA joins the bundle; the serving cert is unchanged.
        // (Certificates are dated from the real clock, not `at`: the next CA gets a longer life
        // so that it is not itself due when the simulated clock reaches the old one's expiry.)
        let due = ca_renew_at(&first.ca);
        let s = settings(30_000);
        // The serving certificate not being due shows the CA steps alone.
        let first = Material {
            renew_at: u64::MAX / 2,
            ..first
        };
        let introduced = step(&s, &first, due, false).expect("introduced");
        let next = introduced.next_ca.clone().expect("next CA");
        assert_eq!(introduced.ca, first.ca, "the old CA still signs");
        assert_eq!(introduced.serving, first.serving);
        assert_eq!(
            introduced.bundle,
            vec![first.ca.cert_pem.clone(), next.cert_pem.clone()]
        );
        assert!(introduced.generation > first.generation);

        // Not promoted before the bundle is injected, nor before the apiserver had time.
        assert_eq!(step(&s, &introduced, due + 60, false), None);
        assert_eq!(step(&s, &introduced, due + 1, true), None);
        let promoted =
            step(&s, &introduced, due + PROMOTION_DELAY.as_secs(), true).expect("promoted");
        assert_eq!(promoted.ca, next, "the next CA signs");
        assert_ne!(promoted.serving, first.serving, "a new serving certificate");
        assert_eq!(
            promoted.bundle, introduced.bundle,
            "the old CA stays trusted"
        );
        assert_eq!(
            promoted.generation, introduced.generation,
            "same bundle, same generation"
        );
        assert!(until(&promoted.serving.cert_pem) <= until(&next.cert_pem));

        // The old CA leaves the bundle only once it has expired.
        let old_until = until(&first.ca.cert_pem);
        let quiet = Material {
            renew_at: old_until + 10_000,
            ..promoted.clone()
        };
        assert_eq!(step(&s, &quiet, old_until - 1, false), None);
        let pruned = step(&s, &quiet, old_until + 1, false).expect("pruned");
        assert_eq!(pruned.bundle, vec![next.cert_pem.clone()]);
        assert!(pruned.generation > promoted.generation);
    }

    #[test]
    fn serving_certificates_are_renewed_by_the_same_ca_and_never_outlive_it() {
        let s = settings(4 * 3600);
        let start = now();
        let first = advance(&s, None, start, false)
            .expect("issue")
            .expect("created");
        let renewed = step(&s, &first, first.renew_at, false).expect("renewed");
        assert_eq!(renewed.ca, first.ca);
        assert_eq!(renewed.bundle, first.bundle);
        assert_eq!(
            renewed.generation, first.generation,
            "the bundle did not change"
        );
        assert_ne!(renewed.serving, first.serving);
        let short = settings(600);
        let m = advance(&short, None, start, false)
            .expect("issue")
            .expect("created");
        assert!(until(&m.serving.cert_pem) <= until(&m.ca.cert_pem));
    }

    #[test]
    fn a_secret_from_before_rotation_existed_trusts_its_ca_alone() {
        let s = settings(3000);
        let m = advance(&s, None, now(), false)
            .expect("issue")
            .expect("created");
        let mut secret = to_secret(&s, &m, None);
        let data = secret.data.as_mut().expect("data");
        data.remove("ca-bundle.crt");
        secret
            .metadata
            .annotations
            .as_mut()
            .expect("annotations")
            .remove(GENERATION);
        let (parsed, _) = parse(&secret).expect("parses");
        assert_eq!(parsed.bundle, vec![m.ca.cert_pem.clone()]);
        assert_eq!(parsed.generation, 0);
        let round_trip = parse(&to_secret(&s, &m, None)).expect("parses").0;
        assert_eq!(round_trip, m);
    }

    #[test]
    fn an_expired_signing_ca_is_replaced_at_once() {
        let s = settings(3000);
        let m = advance(&s, None, now(), false)
            .expect("issue")
            .expect("created");
        let later = until(&m.ca.cert_pem) + 1;
        let replaced = step(&s, &m, later, false).expect("replaced");
        assert_ne!(replaced.ca, m.ca);
        assert_eq!(replaced.bundle, vec![replaced.ca.cert_pem.clone()]);
    }
}
