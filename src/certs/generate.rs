//! Making certificates with rcgen: a webhook CA and serving certificates it signs.

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use std::net::IpAddr;
use std::time::Duration;
use time::OffsetDateTime;

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("certificate generation failed: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("invalid DNS name {0:?} for the serving certificate")]
    DnsName(String),
}

/// PEM material. `Debug` is written by hand so keys never reach a log.
#[derive(Clone, PartialEq, Eq)]
pub struct Pair {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for Pair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pair")
            .field("cert_pem", &format!("{} bytes", self.cert_pem.len()))
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

/// Backdating covers clock skew between us and the apiserver.
pub const BACKDATE: Duration = Duration::from_secs(300);

fn validity(params: &mut CertificateParams, lifetime: Duration) -> OffsetDateTime {
    let now = OffsetDateTime::now_utc();
    params.not_before = now - BACKDATE;
    params.not_after = now + lifetime;
    params.not_after
}

/// A self-signed CA for webhook serving certificates.
pub fn new_ca(lifetime: Duration) -> Result<Pair, CertError> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params
        .distinguished_name
        .push(DnType::CommonName, "spiffe-registrar webhook CA");
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity(&mut params, lifetime);
    let cert = params.self_signed(&key)?;
    Ok(Pair {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// A serving certificate for `dns_names` and `ips`, signed by `ca`.
pub fn new_serving(
    ca: &Pair,
    dns_names: &[String],
    ips: &[IpAddr],
    lifetime: Duration,
) -> Result<Pair, CertError> {
    let ca_key = KeyPair::from_pem(&ca.key_pem)?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert_pem, ca_key)?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    for name in dns_names {
        if !crate::policy::render::valid_dns_name(name) {
            return Err(CertError::DnsName(name.clone()));
        }
        let dns = name
            .clone()
            .try_into()
            .map_err(|_| CertError::DnsName(name.clone()))?;
        params.subject_alt_names.push(SanType::DnsName(dns));
    }
    for ip in ips {
        params.subject_alt_names.push(SanType::IpAddress(*ip));
    }
    let common_name = dns_names
        .first()
        .cloned()
        .unwrap_or_else(|| "spiffe-registrar".into());
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    validity(&mut params, lifetime);
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer)?;
    Ok(Pair {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certs::certified_key;

    #[test]
    fn serving_certs_load_into_rustls_and_keys_stay_out_of_debug() {
        let ca = new_ca(Duration::from_secs(3600)).expect("ca");
        let leaf = new_serving(
            &ca,
            &["svc.ns.svc".into()],
            &["127.0.0.1".parse().expect("ip")],
            Duration::from_secs(60),
        )
        .expect("leaf");
        certified_key(leaf.cert_pem.as_bytes(), leaf.key_pem.as_bytes())
            .expect("rustls accepts the pair");
        assert!(!format!("{leaf:?}").contains("PRIVATE KEY"));
        assert!(matches!(
            new_serving(&ca, &["bad name".into()], &[], Duration::from_secs(60)),
            Err(CertError::DnsName(_))
        ));
    }
}
