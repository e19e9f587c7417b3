//! SPIFFE ID syntax, as SPIRE (go-spiffe) checks it, so a bad policy is caught and reported by
//! us, with the field to fix, before anything reaches SPIRE.

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpiffeIdError {
    #[error("{0:?} does not start with spiffe://")]
    Scheme(String),
    #[error("{0:?} has an invalid trust domain (lowercase letters, digits, '.', '_', '-')")]
    TrustDomain(String),
    #[error("{0:?} has no path")]
    NoPath(String),
    #[error(
        "{0:?} has an invalid path segment {1:?} (letters, digits, '.', '_', '-'; no empty, '.' or '..')"
    )]
    Segment(String, String),
    #[error("{0:?} is under /spire, which SPIRE reserves")]
    Reserved(String),
    #[error("{0:?} is not in trust domain {1:?}")]
    WrongTrustDomain(String, String),
}

pub fn valid_trust_domain(td: &str) -> bool {
    !td.is_empty()
        && td.len() <= 255
        && td
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
}

fn valid_segment(segment: &str) -> bool {
    !segment.is_empty()
        && segment != "."
        && segment != ".."
        && segment
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// Checks `id` is a SPIFFE ID with a path in `trust_domain`. `workload` additionally rejects
/// SPIRE's reserved `/spire` namespace (a parent ID may live there, a workload ID may not).
pub fn check(id: &str, trust_domain: &str, workload: bool) -> Result<(), SpiffeIdError> {
    let rest = id
        .strip_prefix("spiffe://")
        .ok_or_else(|| SpiffeIdError::Scheme(id.into()))?;
    let (td, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    if !valid_trust_domain(td) {
        return Err(SpiffeIdError::TrustDomain(id.into()));
    }
    if td != trust_domain {
        return Err(SpiffeIdError::WrongTrustDomain(
            id.into(),
            trust_domain.into(),
        ));
    }
    if path.is_empty() || path == "/" {
        return Err(SpiffeIdError::NoPath(id.into()));
    }
    for segment in path[1..].split('/') {
        if !valid_segment(segment) {
            return Err(SpiffeIdError::Segment(id.into(), segment.into()));
        }
    }
    if workload && (path == "/spire" || path.starts_with("/spire/")) {
        return Err(SpiffeIdError::Reserved(id.into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table() {
        let td = "example.org";
        assert_eq!(check("spiffe://example.org/ns/a/sa/b", td, true), Ok(()));
        assert_eq!(
            check("spiffe://example.org/spire/agent/x", td, false),
            Ok(()),
            "parents may be under /spire"
        );
        assert!(matches!(
            check("spiffe://example.org/spire/x", td, true),
            Err(SpiffeIdError::Reserved(_))
        ));
        assert!(matches!(
            check("http://example.org/a", td, true),
            Err(SpiffeIdError::Scheme(_))
        ));
        assert!(matches!(
            check("spiffe://Example.org/a", td, true),
            Err(SpiffeIdError::TrustDomain(_))
        ));
        assert!(matches!(
            check("spiffe://other.org/a", td, true),
            Err(SpiffeIdError::WrongTrustDomain(..))
        ));
        assert!(matches!(
            check("spiffe://example.org", td, true),
            Err(SpiffeIdError::NoPath(_))
        ));
        assert!(matches!(
            check("spiffe://example.org/", td, true),
            Err(SpiffeIdError::NoPath(_))
        ));
        for bad in ["/a//b", "/a/", "/a/./b", "/a/../b", "/a b", "/ü"] {
            let id = format!("spiffe://example.org{bad}");
            assert!(
                matches!(check(&id, td, true), Err(SpiffeIdError::Segment(..))),
                "{id}"
            );
        }
    }
}
