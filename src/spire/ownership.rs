//! Which entries are ours, and what we call them.
//!
//! ```text
//! entry ID = "sreg." <cluster> "." hex(sha256(spiffe_id \n parent_id \n sorted selectors))[..32]
//! hint     = "spiffe-registrar/" <cluster>
//! ```
//! The ID is a pure function of what SPIRE itself uses to decide that two entries are "similar"
//! (SPIFFE ID, parent ID, selector set), so a crash between creating an entry and recording it
//! can never yield a duplicate: the retry asks for the same ID and gets AlreadyExists.
//! An entry is ours only if both the ID prefix and the hint say so; we never delete anything else.
//!
//! Two ways an entry with another ID becomes ours, both explicit:
//! - **adoption** (`--adopt-equivalent-entries`): SPIRE refuses a second entry with the same
//!   (SPIFFE ID, parent ID, selectors), so an equivalent entry written by another tool is taken
//!   over in place by setting its hint to `spiffe-registrar/<cluster>/adopted`. Its ID stays.
//! - **rename** (`--previous-cluster-name`): entries named `sreg.<old>.…` with the old hint
//!   are recognised, kept in place while needed (re-hinted as adopted) and deleted when not.

use super::node_alias;
use super::types::{Entry, Selector};
use sha2::{Digest, Sha256};

/// Hex digits of the hash kept in the ID: 128 bits, collision-free in practice.
const HASH_HEX_LEN: usize = 32;
const ID_PREFIX: &str = "sreg";
const HINT_PREFIX: &str = "spiffe-registrar/";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "invalid --cluster-name {0:?}: use 1-63 characters from [a-z0-9-], starting and ending with a letter or digit"
)]
pub struct InvalidClusterName(pub String);

/// The default cluster name: `k-` and the first 12 hex digits of the kube-system namespace's
/// UID, which is unique per cluster and stable for its life. Two clusters sharing a SPIRE
/// server with default settings therefore never touch each other's entries.
pub fn derived_cluster_name(kube_system_uid: &str) -> String {
    let hex: String = kube_system_uid
        .chars()
        .filter(char::is_ascii_hexdigit)
        .map(|c| c.to_ascii_lowercase())
        .take(12)
        .collect();
    format!("k-{hex}")
}

/// Names and recognises the entries of one registrar deployment (one cluster).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ownership {
    cluster: String,
    id_prefix: String,
    hint: String,
    adopted_hint: String,
    /// (ID prefix, hint) of earlier cluster names whose entries migrate to this one.
    previous: Vec<(String, String)>,
    /// The name SPIRE's k8s_psat node attestor knows this cluster by (`node_alias`).
    node_alias_cluster: String,
}

impl Ownership {
    /// `cluster` ends up in entry IDs, so it must fit SPIRE's ID alphabet and contain no `.`
    /// (the separator of our prefix).
    pub fn new(cluster: &str) -> Result<Self, InvalidClusterName> {
        let valid = !cluster.is_empty()
            && cluster.len() <= 63
            && cluster
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !cluster.starts_with('-')
            && !cluster.ends_with('-');
        if !valid {
            return Err(InvalidClusterName(cluster.to_string()));
        }
        Ok(Self {
            cluster: cluster.to_string(),
            id_prefix: format!("{ID_PREFIX}.{cluster}."),
            hint: format!("{HINT_PREFIX}{cluster}"),
            adopted_hint: format!("{HINT_PREFIX}{cluster}/adopted"),
            previous: Vec::new(),
            node_alias_cluster: cluster.to_string(),
        })
    }

    /// Names the node alias after `cluster` (SPIRE's k8s_psat name for this cluster) instead
    /// of our own cluster name.
    pub fn with_node_alias_cluster(
        mut self,
        cluster: &str,
    ) -> Result<Self, node_alias::InvalidNodeAliasCluster> {
        node_alias::check_cluster(cluster)?;
        self.node_alias_cluster = cluster.to_string();
        Ok(self)
    }

    /// The k8s_psat cluster name our node alias selects.
    pub fn node_alias_cluster(&self) -> &str {
        &self.node_alias_cluster
    }

    /// The SPIFFE ID of our node alias in `trust_domain`: the parent of entries whose policy
    /// leaves parentID unset.
    pub fn node_alias_id(&self, trust_domain: &str) -> String {
        node_alias::spiffe_id(trust_domain, &self.node_alias_cluster)
    }

    /// Our node alias entry (claimed) when `parent_id` is our node alias's SPIFFE ID.
    pub fn node_alias_for(&self, parent_id: &str) -> Option<Entry> {
        let trust_domain = node_alias::trust_domain_of(parent_id)?;
        (parent_id == self.node_alias_id(trust_domain))
            .then(|| self.claim(node_alias::entry(trust_domain, &self.node_alias_cluster)))
    }

    /// Also recognises the entries written under earlier cluster names (a rename).
    pub fn with_previous(mut self, names: &[String]) -> Result<Self, InvalidClusterName> {
        for name in names {
            let old = Ownership::new(name)?;
            if old.cluster != self.cluster {
                self.previous.push((old.id_prefix, old.hint));
            }
        }
        Ok(self)
    }

    /// Every hint our entries may carry: what to list.
    pub fn hints(&self) -> Vec<&str> {
        let mut hints = vec![self.hint.as_str(), self.adopted_hint.as_str()];
        hints.extend(self.previous.iter().map(|(_, hint)| hint.as_str()));
        hints
    }

    /// The hint an entry of ours with this ID must carry: ours for our deterministic IDs, the
    /// adopted hint for any other ID we took over.
    pub fn hint_for(&self, id: &str) -> &str {
        if self.id_is_ours(id) {
            &self.hint
        } else {
            &self.adopted_hint
        }
    }

    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    /// The hint every entry of ours carries; also the list filter.
    pub fn hint(&self) -> &str {
        &self.hint
    }

    /// The deterministic entry ID for this identity triple. Selector order does not matter.
    pub fn entry_id(&self, spiffe_id: &str, parent_id: &str, selectors: &[Selector]) -> String {
        let mut sorted: Vec<&Selector> = selectors.iter().collect();
        sorted.sort();
        sorted.dedup();
        let mut hasher = Sha256::new();
        hasher.update(spiffe_id.as_bytes());
        hasher.update(b"\n");
        hasher.update(parent_id.as_bytes());
        for selector in sorted {
            hasher.update(b"\n");
            hasher.update(selector.to_string().as_bytes());
        }
        let digest = hasher.finalize();
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        format!("{}{}", self.id_prefix, &hex[..HASH_HEX_LEN])
    }

    /// Makes `entry` ours: its deterministic ID (from the identity triple) and our hint.
    pub fn claim(&self, mut entry: Entry) -> Entry {
        entry.id = self.entry_id(&entry.spiffe_id, &entry.parent_id, &entry.selectors);
        entry.hint = self.hint.clone();
        entry
    }

    /// True when the ID has our prefix *and* the hint is ours; or the entry carries our
    /// adopted hint (only we write it); or prefix and hint are those of a previous name.
    pub fn is_ours(&self, entry: &Entry) -> bool {
        (self.id_is_ours(&entry.id) && entry.hint == self.hint)
            || entry.hint == self.adopted_hint
            || self
                .previous
                .iter()
                .any(|(prefix, hint)| entry.id.starts_with(prefix) && entry.hint == *hint)
    }

    /// The ID half of `is_ours`, for deletes where only IDs are at hand.
    pub fn id_is_ours(&self, id: &str) -> bool {
        id.starts_with(&self.id_prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ownership() -> Ownership {
        Ownership::new("prod-eu1").expect("valid cluster name")
    }

    #[test]
    fn ids_are_deterministic_and_order_independent() {
        let o = ownership();
        let a = Selector::new("k8s", "ns:a");
        let b = Selector::new("k8s", "sa:b");
        let id1 = o.entry_id(
            "spiffe://td/ns/a/sa/b",
            "spiffe://td/agent",
            &[a.clone(), b.clone()],
        );
        let id2 = o.entry_id("spiffe://td/ns/a/sa/b", "spiffe://td/agent", &[b, a]);
        assert_eq!(id1, id2);
        assert!(id1.starts_with("sreg.prod-eu1."));
        assert_eq!(id1.len(), "sreg.prod-eu1.".len() + HASH_HEX_LEN);
        assert!(
            id1.bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c))
        );
    }

    #[test]
    fn every_part_of_the_triple_changes_the_id() {
        let o = ownership();
        let s = [Selector::new("k8s", "ns:a")];
        let base = o.entry_id("spiffe://td/x", "spiffe://td/p", &s);
        assert_ne!(base, o.entry_id("spiffe://td/y", "spiffe://td/p", &s));
        assert_ne!(base, o.entry_id("spiffe://td/x", "spiffe://td/q", &s));
        assert_ne!(
            base,
            o.entry_id(
                "spiffe://td/x",
                "spiffe://td/p",
                &[Selector::new("k8s", "ns:b")]
            )
        );
        let other_cluster = Ownership::new("other").expect("valid");
        assert_ne!(
            base,
            other_cluster.entry_id("spiffe://td/x", "spiffe://td/p", &s)
        );
    }

    #[test]
    fn field_boundaries_cannot_be_shifted() {
        let o = ownership();
        // "a\nb" + "c" must not hash like "a" + "b\nc"; SPIFFE IDs cannot contain newlines, but
        // the separator keeps the encoding unambiguous regardless.
        assert_ne!(
            o.entry_id("spiffe://td/a", "spiffe://td/bc", &[]),
            o.entry_id("spiffe://td/ab", "spiffe://td/c", &[])
        );
    }

    #[test]
    fn ownership_needs_prefix_and_hint() {
        let o = ownership();
        let mut entry = Entry {
            id: o.entry_id("spiffe://td/x", "spiffe://td/p", &[]),
            hint: o.hint().into(),
            ..Entry::default()
        };
        assert!(o.is_ours(&entry));
        entry.hint = "someone-else".into();
        assert!(
            !o.is_ours(&entry),
            "our prefix with a foreign hint is not ours"
        );
        entry.hint = o.hint().into();
        entry.id = "0b0e3f9a-uuid".into();
        assert!(!o.is_ours(&entry), "our hint with a foreign ID is not ours");
        assert!(
            !Ownership::new("prod").expect("valid").is_ours(&Entry {
                id: o.entry_id("spiffe://td/x", "spiffe://td/p", &[]),
                hint: "spiffe-registrar/prod".into(),
                ..Entry::default()
            }),
            "a cluster whose name is a prefix of ours does not own our entries"
        );
    }

    #[test]
    fn adopted_and_previous_names_are_ours_and_nothing_else() {
        let o = ownership()
            .with_previous(&["default".to_string()])
            .expect("valid");
        let adopted = Entry {
            id: "0b0e3f9a-uuid".into(),
            hint: "spiffe-registrar/prod-eu1/adopted".into(),
            ..Entry::default()
        };
        assert!(o.is_ours(&adopted));
        assert_eq!(o.hint_for(&adopted.id), adopted.hint);
        let old = Ownership::new("default").expect("valid");
        let legacy = Entry {
            id: old.entry_id("spiffe://td/x", "spiffe://td/p", &[]),
            hint: old.hint().into(),
            ..Entry::default()
        };
        assert!(o.is_ours(&legacy));
        assert!(!ownership().is_ours(&legacy), "not without the flag");
        assert!(
            !o.is_ours(&Entry {
                hint: "spiffe-registrar/default/adopted".into(),
                ..adopted
            }),
            "another cluster's adopted entries are not ours"
        );
        assert_eq!(o.hints().len(), 3);
    }

    #[test]
    fn the_node_alias_is_ours_and_named_by_the_psat_cluster() {
        let o = ownership()
            .with_node_alias_cluster("bed")
            .expect("valid psat name");
        let id = o.node_alias_id("example.org");
        assert_eq!(id, "spiffe://example.org/spiffe-registrar/k8s-psat/bed");
        let alias = o.node_alias_for(&id).expect("our alias's ID");
        assert!(o.is_ours(&alias));
        assert!(node_alias::is_node_alias(&alias));
        assert_eq!(
            alias.id,
            o.entry_id(&alias.spiffe_id, &alias.parent_id, &alias.selectors)
        );
        assert_eq!(o.node_alias_for("spiffe://example.org/k8s/nodes"), None);
        assert_eq!(
            o.node_alias_for("spiffe://example.org/spiffe-registrar/k8s-psat/other"),
            None,
            "another psat name's alias is not the one we maintain"
        );
        assert_eq!(
            ownership().node_alias_cluster(),
            "prod-eu1",
            "defaults to --cluster-name"
        );
        assert!(ownership().with_node_alias_cluster("a/b").is_err());
    }

    #[test]
    fn derived_names_are_valid_and_distinct() {
        let a = derived_cluster_name("3f2a9b1c-4d5e-6f70-8192-a3b4c5d6e7f8");
        let b = derived_cluster_name("9a2a9b1c-4d5e-6f70-8192-a3b4c5d6e7f8");
        assert_eq!(a, "k-3f2a9b1c4d5e");
        assert_ne!(a, b);
        assert!(Ownership::new(&a).is_ok());
    }

    #[test]
    fn cluster_names_are_validated() {
        for bad in ["", "-a", "a-", "a.b", "A", "a_b", &"x".repeat(64)] {
            assert_eq!(
                Ownership::new(bad),
                Err(InvalidClusterName(bad.to_string())),
                "{bad:?}"
            );
        }
        for good in ["a", "prod-eu1", &"x".repeat(63)] {
            assert!(Ownership::new(good).is_ok(), "{good:?}");
        }
    }
}
