//! A throw-away CA for the test control plane: serving and client certificates.

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use std::net::{IpAddr, Ipv4Addr};

pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    pub cert_pem: String,
}

/// A certificate and its private key, PEM-encoded.
pub struct Leaf {
    pub cert_pem: String,
    pub key_pem: String,
}

impl TestCa {
    pub fn new(common_name: &str) -> Self {
        let key = KeyPair::generate().expect("key generation must work");
        let mut params =
            CertificateParams::new(Vec::<String>::new()).expect("empty SANs are valid");
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).expect("self-signing must work");
        Self {
            issuer: Issuer::new(params, key),
            cert_pem: cert.pem(),
        }
    }

    /// A serving certificate for `localhost` and 127.0.0.1.
    pub fn server(&self, common_name: &str) -> Leaf {
        let mut params = CertificateParams::new(vec!["localhost".to_string()])
            .expect("localhost is a valid SAN");
        params
            .subject_alt_names
            .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(params)
    }

    /// A client certificate for Kubernetes user `user`, in `group` if given (one O= only:
    /// rcgen keeps one value per DN attribute).
    pub fn client(&self, user: &str, group: Option<&str>) -> Leaf {
        let mut params =
            CertificateParams::new(Vec::<String>::new()).expect("empty SANs are valid");
        params.distinguished_name.push(DnType::CommonName, user);
        if let Some(group) = group {
            params
                .distinguished_name
                .push(DnType::OrganizationName, group);
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(params)
    }

    fn sign(&self, mut params: CertificateParams) -> Leaf {
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        let key = KeyPair::generate().expect("key generation must work");
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("signing must work");
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}

/// Completes a TLS handshake with 127.0.0.1:`port` trusting only `ca_pem`.
pub async fn handshake_trusting(port: u16, ca_pem: &[u8]) -> Result<(), String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem) {
        roots
            .add(cert.map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").map_err(|e| e.to_string())?;
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(name.to_owned(), tcp)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}
