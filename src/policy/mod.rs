//! Policy: the `SpiffeRegistration` CRD, which policy applies to a Deployment, and the identity
//! it renders. Pure functions only; the webhook and the controller both call `resolve`, so the
//! annotation the webhook stamps is always the ID the controller registers.
//!
//! ```text
//! Namespace labels ─┐                       ┌─ OutOfScope
//! Deployment ───────┼─ resolve(opt-in, …) ──┼─ Invalid { policy, error }
//! policies ─────────┘   select → render     └─ InScope { policy, identity, losers }
//! ```

pub mod crd;
pub mod duration;
pub mod render;
pub mod select;
pub mod spiffe_id;

pub use crd::{SpiffeRegistration, SpiffeRegistrationSpec, SpiffeRegistrationStatus};
pub use render::{Identity, RenderError, Workload};

use k8s_openapi::api::apps::v1::Deployment;
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
        identity: Identity,
        losers: Vec<&'p SpiffeRegistration>,
    },
}

impl Resolution<'_> {
    pub fn identity(&self) -> Option<&Identity> {
        match self {
            Resolution::InScope { identity, .. } => Some(identity),
            _ => None,
        }
    }
}

/// The pod template's service account, `default` when unset (as the kubelet would run it).
pub fn service_account_of(deployment: &Deployment) -> &str {
    deployment
        .spec
        .as_ref()
        .and_then(|spec| spec.template.spec.as_ref())
        .and_then(|pod| {
            pod.service_account_name
                .as_deref()
                .or(pod.service_account.as_deref())
        })
        .filter(|sa| !sa.is_empty())
        .unwrap_or("default")
}

/// Resolves the policy and identity of `deployment` living in a namespace with
/// `namespace_labels` (`None` when the namespace is not known yet: out of scope).
pub fn resolve<'p>(
    opt_in: &OptIn,
    namespace: &str,
    namespace_labels: Option<&BTreeMap<String, String>>,
    deployment: &Deployment,
    policies: impl IntoIterator<Item = &'p SpiffeRegistration>,
) -> Resolution<'p> {
    let Some(namespace_labels) = namespace_labels.filter(|labels| opt_in.admits(labels)) else {
        return Resolution::OutOfScope;
    };
    let empty = BTreeMap::new();
    let deployment_labels = deployment.metadata.labels.as_ref().unwrap_or(&empty);
    let Some(selection) = select::select(policies, namespace_labels, deployment_labels) else {
        return Resolution::OutOfScope;
    };
    let workload = Workload {
        namespace,
        service_account: service_account_of(deployment),
    };
    match render::render(&selection.winner.spec, &workload) {
        Ok(identity) => Resolution::InScope {
            policy: selection.winner,
            identity,
            losers: selection.losers,
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
    use super::testing::{mk_deployment, mk_policy};
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn table_of_resolutions() {
        let opt_in = OptIn::default();
        let enabled = labels(&[("spiffe.io/registrar", "enabled"), ("team", "pay")]);
        let disabled = labels(&[("team", "pay")]);
        let old = mk_policy("old", 100, |_| {});
        let new = mk_policy("new", 200, |s| s.trust_domain = "new.org".into());
        let only_web = mk_policy("only-web", 50, |s| {
            s.deployment_selector = Some(
                serde_json::from_value(serde_json::json!({"matchLabels": {"app": "web"}}))
                    .expect("selector"),
            )
        });
        let broken = mk_policy("broken", 10, |s| {
            s.parent_id = "spiffe://elsewhere/x".into()
        });
        let web = mk_deployment("ns", "web", Some("api"), &[("app", "web")]);
        let db = mk_deployment("ns", "db", None, &[("app", "db")]);

        assert!(matches!(
            resolve(&opt_in, "ns", Some(&disabled), &web, [&old]),
            Resolution::OutOfScope
        ));
        assert!(
            matches!(
                resolve(&opt_in, "ns", None, &web, [&old]),
                Resolution::OutOfScope
            ),
            "unknown namespace"
        );
        assert!(
            matches!(
                resolve(&opt_in, "ns", Some(&enabled), &web, []),
                Resolution::OutOfScope
            ),
            "no policy"
        );

        match resolve(&opt_in, "ns", Some(&enabled), &db, [&new, &old]) {
            Resolution::InScope {
                policy,
                identity,
                losers,
            } => {
                assert_eq!(
                    policy.metadata.name.as_deref(),
                    Some("old"),
                    "oldest wins regardless of order"
                );
                assert_eq!(losers.len(), 1);
                assert_eq!(
                    identity.spiffe_id, "spiffe://example.org/ns/ns/sa/default",
                    "no SA → default"
                );
            }
            other => panic!("{other:?}"),
        }
        match resolve(&opt_in, "ns", Some(&enabled), &web, [&old, &only_web]) {
            Resolution::InScope {
                policy, identity, ..
            } => {
                assert_eq!(policy.metadata.name.as_deref(), Some("only-web"));
                assert_eq!(identity.spiffe_id, "spiffe://example.org/ns/ns/sa/api");
            }
            other => panic!("{other:?}"),
        }
        assert!(
            matches!(
                resolve(&opt_in, "ns", Some(&enabled), &web, [&old, &broken]),
                Resolution::Invalid {
                    error: RenderError::ParentId(_),
                    ..
                }
            ),
            "an invalid oldest policy is reported, not skipped"
        );
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
        assert!(matches!(
            resolve(&OptIn::default(), "ns", Some(&enabled), &web, [&dying]),
            Resolution::OutOfScope
        ));
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
