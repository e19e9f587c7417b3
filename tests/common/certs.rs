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
