//! Policy: the `SpiffeRegistration` CRD, which policy applies to a Deployment, and the identity
//! it renders. Pure functions only; the webhook and the controller both call `resolve`, so the
//! annotation the webhook stamps is always the ID the controller registers.
//!
//! ```text
//! Namespace labels ─┐                       ┌─ OutOfScope
//! Deployment ───────┼─ resolve(opt-in, …) ──┼─ Invalid { policy, error }
//! policies ─────────┘   select → render     └─ InScope { policy, entry, losers }
//! ```

pub mod crd;
pub mod duration;
pub mod labels;
pub mod render;
pub mod select;
pub mod spiffe_id;

pub use crd::{SpiffeRegistration, SpiffeRegistrationSpec, SpiffeRegistrationStatus};
pub use labels::{LabelSource, Labels};
pub use render::{RenderError, Rendered, Workload};

use crate::keys::WorkloadKind;
use crate::spire::{Entry, Ownership};

use std::collections::BTreeMap;

/// The namespace label that opts a namespace in (`spiffe.io/registrar=enabled` by default).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OptIn {
    pub key: String,
    pub value: String,
}

impl OptIn {
    /// Parses `key=value`.
    pub fn parse(text: &str) -> Option<Self> {
        let (key, value) = text.split_once('=')?;
        (!key.is_empty()).then(|| Self {
            key: key.to_string(),
            value: value.to_string(),
        })
    }

    pub fn admits(&self, namespace_labels: &BTreeMap<String, String>) -> bool {
        namespace_labels.get(&self.key) == Some(&self.value)
    }
}

impl Default for OptIn {
    fn default() -> Self {
        Self {
            key: "spiffe.io/registrar".into(),
            value: "enabled".into(),
        }
    }
}

/// What applies to one Deployment.
#[derive(Debug)]
pub enum Resolution<'p> {
    /// Namespace not opted in (or unknown), or no policy selects the Deployment.
    OutOfScope,
    /// The winning policy cannot render an identity; the Deployment gets none until it is fixed.
    Invalid {
        policy: &'p SpiffeRegistration,
        error: RenderError,
    },
    InScope {
        policy: &'p SpiffeRegistration,
        /// The entry policy gives the service account, claimed by the registrar's ownership.
        entry: Entry,
        losers: Vec<&'p SpiffeRegistration>,
        /// DNS name templates left out of the entry for this service account, each with why.
        dns_omitted: Vec<String>,
    },
}

impl Resolution<'_> {
    pub fn entry(&self) -> Option<&Entry> {
        match self {
            Resolution::InScope { entry, .. } => Some(entry),
            _ => None,
        }
    }
}

/// Resolves the policy and identity of one service account: `namespace` with
/// `namespace_labels` (`None` when the namespace is not known or not opted in), whose live
/// workloads are `workloads` (kind and labels each), its entry named by `ownership`.
/// Resolution is per service account, not per workload, because SPIRE's selectors (`k8s:ns`,
/// `k8s:sa`) cannot tell two workloads of one service account apart: one service account,
/// one identity, whatever kinds run as it.
pub fn resolve<'p, 'l, L: LabelSource + 'l>(
    opt_in: &OptIn,
    namespace: &str,
    namespace_labels: Option<&BTreeMap<String, String>>,
    service_account: &str,
    workloads: impl IntoIterator<Item = (WorkloadKind, &'l L)> + Clone,
    policies: impl IntoIterator<Item = &'p SpiffeRegistration>,
    ownership: &Ownership,
) -> Resolution<'p> {
    let Some(namespace_labels) = namespace_labels.filter(|labels| opt_in.admits(labels)) else {
        return Resolution::OutOfScope;
    };
    let Some(selection) = select::select(policies, namespace_labels, workloads) else {
        return Resolution::OutOfScope;
    };
    let workload = Workload {
        namespace,
        service_account,
    };
    match render::render(&selection.winner.spec, &workload, ownership) {
        Ok(render::Rendered { entry, dns_omitted }) => Resolution::InScope {
            policy: selection.winner,
            entry,
            losers: selection.losers,
            dns_omitted,
        },
        Err(error) => Resolution::Invalid {
            policy: selection.winner,
            error,
        },
    }
}

#[cfg(test)]
pub mod testing;

#[cfg(test)]
mod tests {
    use super::testing::{mk_deployment, mk_policy, ownership};
    use super::*;
    use k8s_openapi::api::apps::v1::Deployment;
    use kube::ResourceExt;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn one(
        namespace_labels: Option<&BTreeMap<String, String>>,
        deployment: &Deployment,
        policies: &[&SpiffeRegistration],
    ) -> String {
        let record = crate::index::WorkloadRecord::from(deployment);
        let resolution = resolve(
            &OptIn::default(),
            "ns",
            namespace_labels,
            &record.service_account,
            [(record.kind, &record.labels)],
            policies.iter().copied(),
            &ownership(),
        );
        match resolution {
            Resolution::OutOfScope => "out".into(),
            Resolution::Invalid { policy, error } => {
                format!("invalid {} {}", policy.name_any(), error.reason())
            }
            Resolution::InScope {
                policy,
                entry,
                losers,
                ..
            } => format!(
                "{} {} losers={}",
                policy.name_any(),
                entry.spiffe_id,
                losers.len()
            ),
        }
    }

    /// (what, namespace labels, Deployment, policies, expected resolution).
    type Case<'a> = (
        &'a str,
        Option<&'a BTreeMap<String, String>>,
        &'a Deployment,
        Vec<&'a SpiffeRegistration>,
        String,
    );

    #[test]
    fn table_of_resolutions() {
        let enabled = labels(&[("spiffe.io/registrar", "enabled"), ("team", "pay")]);
        let disabled = labels(&[("team", "pay")]);
        let old = mk_policy("old", 100, |_| {});
        let new = mk_policy("new", 200, |s| s.trust_domain = "new.org".into());
        let urgent = mk_policy("urgent", 300, |s| s.priority = Some(10));
        let only_web = mk_policy("only-web", 50, |s| {
            s.deployment_selector = Some(crate::policy::testing::mk_selector(&[("app", "web")]))
        });
        let broken = mk_policy("broken", 10, |s| {
            s.parent_id = Some("spiffe://elsewhere/x".into())
        });
        let web = mk_deployment("ns", "web", Some("api"), &[("app", "web")]);
        let db = mk_deployment("ns", "db", None, &[("app", "db")]);
        let id = |sa: &str| format!("spiffe://example.org/ns/ns/sa/{sa}");
        let cases: Vec<Case> = vec![
            (
                "namespace not opted in",
                Some(&disabled),
                &web,
                vec![&old],
                "out".into(),
            ),
            ("unknown namespace", None, &web, vec![&old], "out".into()),
            ("no policy", Some(&enabled), &web, vec![], "out".into()),
            (
                "oldest wins regardless of order; no SA is default",
                Some(&enabled),
                &db,
                vec![&new, &old],
                format!("old {} losers=1", id("default")),
            ),
            (
                "selector narrows",
                Some(&enabled),
                &web,
                vec![&old, &only_web],
                format!("only-web {} losers=1", id("api")),
            ),
            (
                "priority beats age",
                Some(&enabled),
                &web,
                vec![&old, &urgent, &only_web],
                format!("urgent {} losers=2", id("api")),
            ),
            (
                "an invalid winner is reported, not skipped",
                Some(&enabled),
                &web,
                vec![&old, &broken],
                "invalid broken InvalidParentID".into(),
            ),
        ];
        for (what, ns_labels, deployment, policies, expected) in cases {
            assert_eq!(one(ns_labels, deployment, &policies), expected, "{what}");
        }
    }

    #[test]
    fn one_matching_deployment_brings_its_whole_service_account_in() {
        let enabled = labels(&[("spiffe.io/registrar", "enabled")]);
        let only_web = mk_policy("only-web", 50, |s| {
            s.deployment_selector = Some(crate::policy::testing::mk_selector(&[("app", "web")]))
        });
        let web = labels(&[("app", "web")]);
        let worker = labels(&[("app", "worker")]);
        let resolution = resolve(
            &OptIn::default(),
            "ns",
            Some(&enabled),
            "api",
            [
                (WorkloadKind::Deployment, &worker),
                (WorkloadKind::Deployment, &web),
            ],
            [&only_web],
            &ownership(),
        );
        assert!(matches!(resolution, Resolution::InScope { .. }));
        let alone = resolve(
            &OptIn::default(),
            "ns",
            Some(&enabled),
            "api",
            [(WorkloadKind::Deployment, &worker)],
            [&only_web],
            &ownership(),
        );
        assert!(matches!(alone, Resolution::OutOfScope));
    }

    #[test]
    fn policies_being_deleted_no_longer_select() {
        let mut dying = mk_policy("dying", 1, |_| {});
        dying.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        let enabled = labels(&[("spiffe.io/registrar", "enabled")]);
        let web = mk_deployment("ns", "web", None, &[]);
        assert_eq!(one(Some(&enabled), &web, &[&dying]), "out");
    }

    #[test]
    fn opt_in_parsing() {
        assert_eq!(
            OptIn::parse("a/b=c"),
            Some(OptIn {
                key: "a/b".into(),
                value: "c".into()
            })
        );
        assert_eq!(OptIn::parse("novalue"), None);
        assert_eq!(OptIn::parse("=x"), None);
    }
}
