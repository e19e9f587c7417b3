//! The only place that knows the generated protobuf types: conversions both ways, and the
//! masks we send. Conversions are lenient on purpose: SPIRE validates, and its message is the
//! one an operator should see.

use super::proto::types as pb;
use super::types::{Entry, MutableField, Selector};

/// Splits `spiffe://td/path` into SPIRE's (trust domain, path). Anything malformed is passed
/// through as-is for SPIRE to reject with its own message.
pub fn spiffe_id_to_proto(id: &str) -> pb::Spiffeid {
    let rest = id.strip_prefix("spiffe://").unwrap_or(id);
    match rest.find('/') {
        Some(slash) => pb::Spiffeid {
            trust_domain: rest[..slash].to_string(),
            path: rest[slash..].to_string(),
        },
        None => pb::Spiffeid {
            trust_domain: rest.to_string(),
            path: String::new(),
        },
    }
}

pub fn spiffe_id_from_proto(id: Option<&pb::Spiffeid>) -> String {
    match id {
        Some(id) => format!("spiffe://{}{}", id.trust_domain, id.path),
        None => String::new(),
    }
}

pub fn entry_to_proto(entry: &Entry) -> pb::Entry {
    pb::Entry {
        id: entry.id.clone(),
        spiffe_id: Some(spiffe_id_to_proto(&entry.spiffe_id)),
        parent_id: Some(spiffe_id_to_proto(&entry.parent_id)),
        selectors: entry
            .selectors
            .iter()
            .map(|s| pb::Selector {
                r#type: s.kind.clone(),
                value: s.value.clone(),
            })
            .collect(),
        x509_svid_ttl: entry.x509_svid_ttl,
        federates_with: entry.federates_with.clone(),
        admin: false,
        dns_names: entry.dns_names.clone(),
        revision_number: 0,
        jwt_svid_ttl: entry.jwt_svid_ttl,
        hint: entry.hint.clone(),
        created_at: 0,
    }
}

pub fn entry_from_proto(entry: pb::Entry) -> Entry {
    Entry {
        spiffe_id: spiffe_id_from_proto(entry.spiffe_id.as_ref()),
        parent_id: spiffe_id_from_proto(entry.parent_id.as_ref()),
        selectors: entry
            .selectors
            .into_iter()
            .map(|s| Selector::new(s.r#type, s.value))
            .collect(),
        id: entry.id,
        x509_svid_ttl: entry.x509_svid_ttl,
        jwt_svid_ttl: entry.jwt_svid_ttl,
        dns_names: entry.dns_names,
        federates_with: entry.federates_with,
        hint: entry.hint,
        revision_number: entry.revision_number,
    }
    .normalize()
}

/// What we read back: every field our `Entry` models.
pub fn output_mask() -> pb::EntryMask {
    pb::EntryMask {
        spiffe_id: true,
        parent_id: true,
        selectors: true,
        x509_svid_ttl: true,
        federates_with: true,
        admin: false,
        dns_names: true,
        revision_number: true,
        jwt_svid_ttl: true,
        hint: true,
        created_at: false,
    }
}

/// What an update writes: exactly the `MutableField`s, the ones the diff compares. Never
/// nil, because a nil mask makes SPIRE replace every field, clearing those we do not model.
pub fn update_mask() -> pb::EntryMask {
    let mut mask = pb::EntryMask::default();
    for field in MutableField::ALL {
        let bit = match field {
            MutableField::X509SvidTtl => &mut mask.x509_svid_ttl,
            MutableField::JwtSvidTtl => &mut mask.jwt_svid_ttl,
            MutableField::DnsNames => &mut mask.dns_names,
            MutableField::FederatesWith => &mut mask.federates_with,
            MutableField::Hint => &mut mask.hint,
        };
        *bit = true;
    }
    mask
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spiffe_ids_round_trip() {
        let proto = spiffe_id_to_proto("spiffe://example.org/ns/a/sa/b");
        assert_eq!(proto.trust_domain, "example.org");
        assert_eq!(proto.path, "/ns/a/sa/b");
        assert_eq!(
            spiffe_id_from_proto(Some(&proto)),
            "spiffe://example.org/ns/a/sa/b"
        );
    }

    #[test]
    fn malformed_ids_pass_through_for_spire_to_judge() {
        assert_eq!(spiffe_id_to_proto("spiffe://example.org").path, "");
        assert_eq!(spiffe_id_to_proto("not an id").trust_domain, "not an id");
    }

    #[test]
    fn entries_round_trip_and_come_back_normalized() {
        let entry = Entry {
            id: "sreg.c.1".into(),
            spiffe_id: "spiffe://td/w".into(),
            parent_id: "spiffe://td/agent".into(),
            selectors: vec![Selector::new("k8s", "sa:x"), Selector::new("k8s", "ns:y")],
            x509_svid_ttl: 60,
            jwt_svid_ttl: 30,
            dns_names: vec!["b.example".into(), "a.example".into()],
            federates_with: vec![],
            hint: "spiffe-registrar/c".into(),
            revision_number: 0,
        };
        let back = entry_from_proto(entry_to_proto(&entry));
        assert_eq!(back, entry.clone().normalize());
        assert_ne!(
            back.selectors, entry.selectors,
            "input was unsorted; output is sorted"
        );
    }

    #[test]
    fn update_mask_never_touches_the_identity_triple() {
        let mask = update_mask();
        assert!(!mask.spiffe_id && !mask.parent_id && !mask.selectors && !mask.admin);
        assert!(
            mask.x509_svid_ttl
                && mask.jwt_svid_ttl
                && mask.dns_names
                && mask.federates_with
                && mask.hint
        );
    }
}
