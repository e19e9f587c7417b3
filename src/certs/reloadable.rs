//! The certificate being served, replaceable at run time; parsing PEM into what rustls serves.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use std::sync::{Arc, RwLock};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("no certificate in the PEM data")]
    NoCertificate,
    #[error("bad certificate PEM: {0}")]
    CertPem(String),
    #[error("bad or unsupported private key: {0}")]
    Key(String),
}

/// Parses a PEM chain and key into what rustls serves.
pub fn certified_key(cert_pem: &[u8], key_pem: &[u8]) -> Result<CertifiedKey, TlsError> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::CertPem(e.to_string()))?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate);
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| TlsError::Key(e.to_string()))?;
    let signing_key = rustls::crypto::ring::sign::any_supported_type(&key)
        .map_err(|e| TlsError::Key(e.to_string()))?;
    let certified = CertifiedKey::new(chain, signing_key);
    // A certificate and key from different pairs (e.g. files caught mid-renewal) would fail
    // every handshake; refuse them here instead.
    certified
        .keys_match()
        .map_err(|e| TlsError::Key(format!("key does not match the certificate: {e}")))?;
    Ok(certified)
}

/// The serving certificate, replaceable at run time.
#[derive(Debug)]
pub struct ReloadableCert {
    current: RwLock<Arc<CertifiedKey>>,
}

/// The leaf's notAfter, in Unix seconds.
pub fn not_after(leaf_der: &[u8]) -> Option<i64> {
    let (_, cert) = x509_parser::parse_x509_certificate(leaf_der).ok()?;
    Some(cert.validity().not_after.timestamp())
}

/// Publishes the served leaf's expiry (`webhook_certificate_expiry_timestamp_seconds`).
fn publish_expiry(certified: &CertifiedKey) {
    if let Some(expiry) = certified.cert.first().and_then(|leaf| not_after(leaf)) {
        crate::telemetry::serving_cert_expiry().set(expiry as f64);
    }
}

impl ReloadableCert {
    pub fn new(cert_pem: &[u8], key_pem: &[u8]) -> Result<Self, TlsError> {
        let certified = certified_key(cert_pem, key_pem)?;
        publish_expiry(&certified);
        Ok(Self {
            current: RwLock::new(Arc::new(certified)),
        })
    }

    /// Serves `cert_pem`/`key_pem` from the next handshake on; on error the old pair stays.
    pub fn replace(&self, cert_pem: &[u8], key_pem: &[u8]) -> Result<(), TlsError> {
        let next = certified_key(cert_pem, key_pem)?;
        publish_expiry(&next);
        *self
            .current
            .write()
            .expect("cert lock must not be poisoned") = Arc::new(next);
        Ok(())
    }

    /// DER of the leaf currently served (to tell rotations apart).
    pub fn leaf_der(&self) -> Vec<u8> {
        let current = self.current.read().expect("cert lock must not be poisoned");
        current.cert.first().map(|c| c.to_vec()).unwrap_or_default()
    }
}

impl ResolvesServerCert for ReloadableCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .expect("cert lock must not be poisoned")
                .clone(),
        )
    }
}

/// The first certificate's (notBefore, notAfter) in a PEM text, in Unix seconds.
pub fn validity_of_pem(pem: &str) -> Option<(i64, i64)> {
    let der = CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()?
        .ok()?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der).ok()?;
    Some((
        cert.validity().not_before.timestamp(),
        cert.validity().not_after.timestamp(),
    ))
}

/// The certificates of a PEM bundle, each as its own PEM block (other text is dropped).
pub fn split_pem_bundle(bundle: &str) -> Vec<String> {
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
    const END: &str = "-----END CERTIFICATE-----";
    let mut blocks = Vec::new();
    let mut rest = bundle;
    while let Some(start) = rest.find(BEGIN) {
        let Some(end) = rest[start..].find(END) else {
            break;
        };
        let stop = start + end + END.len();
        blocks.push(format!("{}\n", &rest[start..stop]));
        rest = &rest[stop..];
    }
    blocks
}
