//! The node alias: one entry of ours per (trust domain, k8s_psat cluster) that every agent of
//! this cluster matches, so that workload entries parented to it reach every node.
//!
//! ```text
//! spiffe://<td>/spire/server
//!   └─ node alias  spiffe://<td>/spiffe-registrar/k8s-psat/<cluster>   selector k8s_psat:cluster:<cluster>
//!        └─ workload entries of policies that leave parentID unset
//! ```
//! SPIRE's `k8s_psat` node attestor gives each agent the selector `k8s_psat:cluster:<name>`,
//! where `<name>` is the key of the server's `clusters` map and the agent's `cluster` setting;
//! SPIRE then makes every agent holding it an alias of this entry's SPIFFE ID. The alias is
//! named by the cluster alone (not by `--cluster-name`), so renaming our entries does not move
//! every workload to a new parent.

use super::types::{Entry, Selector};

/// Path of every node alias we write, before the k8s_psat cluster name.
const ALIAS_PATH: &str = "spiffe-registrar/k8s-psat";
const SELECTOR_TYPE: &str = "k8s_psat";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "invalid --node-alias-cluster {0:?}: use 1-63 characters from [A-Za-z0-9._-] (the cluster name in SPIRE's k8s_psat configuration)"
)]
pub struct InvalidNodeAliasCluster(pub String);

/// Checks a k8s_psat cluster name: it becomes a SPIFFE ID path segment.
pub fn check_cluster(name: &str) -> Result<(), InvalidNodeAliasCluster> {
    let valid = !name.is_empty()
        && name.len() <= 63
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if valid {
        Ok(())
    } else {
        Err(InvalidNodeAliasCluster(name.to_string()))
    }
}

/// The alias's SPIFFE ID in `trust_domain` for the k8s_psat cluster `cluster`.
pub fn spiffe_id(trust_domain: &str, cluster: &str) -> String {
    format!("spiffe://{trust_domain}/{ALIAS_PATH}/{cluster}")
}

/// The alias entry (unclaimed: no ID, no hint) for `cluster` in `trust_domain`.
pub fn entry(trust_domain: &str, cluster: &str) -> Entry {
    Entry {
        spiffe_id: spiffe_id(trust_domain, cluster),
        parent_id: format!("spiffe://{trust_domain}/spire/server"),
        selectors: vec![Selector::new(SELECTOR_TYPE, format!("cluster:{cluster}"))],
        ..Entry::default()
    }
}

/// Whether `entry` has the shape of a node alias of ours (for any cluster name): what SPIRE
/// says, so an alias left by an earlier `--node-alias-cluster` is recognised too.
pub fn is_node_alias(entry: &Entry) -> bool {
    let [selector] = entry.selectors.as_slice() else {
        return false;
    };
    let Some((trust_domain, path)) = entry
        .spiffe_id
        .strip_prefix("spiffe://")
        .and_then(|rest| rest.split_once('/'))
    else {
        return false;
    };
    selector.kind == SELECTOR_TYPE
        && path
            .strip_prefix(ALIAS_PATH)
            .and_then(|rest| rest.strip_prefix('/'))
            .is_some_and(|cluster| selector.value == format!("cluster:{cluster}"))
        && entry.parent_id == format!("spiffe://{trust_domain}/spire/server")
}

/// The trust domain of a SPIFFE ID (`None` for anything else).
pub fn trust_domain_of(spiffe_id: &str) -> Option<&str> {
    let rest = spiffe_id.strip_prefix("spiffe://")?;
    Some(rest.split_once('/').map_or(rest, |(td, _)| td))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_alias_is_recognised_by_its_shape_for_any_cluster() {
        let alias = entry("example.org", "bed");
        assert_eq!(
            alias.spiffe_id,
            "spiffe://example.org/spiffe-registrar/k8s-psat/bed"
        );
        assert_eq!(alias.parent_id, "spiffe://example.org/spire/server");
        assert_eq!(alias.selectors, [Selector::new("k8s_psat", "cluster:bed")]);
        assert!(is_node_alias(&alias));
        assert!(is_node_alias(&entry("td", "other-name")));
    }

    #[test]
    fn anything_else_is_not_an_alias() {
        let alias = entry("example.org", "bed");
        let cases = [
            Entry {
                selectors: vec![Selector::new("k8s_psat", "cluster:other")],
                ..alias.clone()
            },
            Entry {
                parent_id: "spiffe://example.org/elsewhere".into(),
                ..alias.clone()
            },
            Entry {
                selectors: vec![Selector::new("k8s", "ns:a"), Selector::new("k8s", "sa:b")],
                ..alias.clone()
            },
            Entry {
                spiffe_id: "spiffe://example.org/ns/a/sa/b".into(),
                ..alias.clone()
            },
        ];
        for case in cases {
            assert!(!is_node_alias(&case), "{case:?}");
        }
    }

    #[test]
    fn cluster_names_must_fit_a_path_segment() {
        for good in ["bed", "prod.eu-1", "Cluster_A", &"x".repeat(63)] {
            assert_eq!(check_cluster(good), Ok(()), "{good:?}");
        }
        for bad in ["", ".", "..", "a/b", "a b", "é", &"x".repeat(64)] {
            assert!(check_cluster(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn trust_domains_are_read_from_ids() {
        assert_eq!(trust_domain_of("spiffe://td/a/b"), Some("td"));
        assert_eq!(trust_domain_of("spiffe://td"), Some("td"));
        assert_eq!(trust_domain_of("https://td/a"), None);
    }
}
