//! Desired state, derived from the caches on every sync and never stored: for each
//! (namespace, service account) running live Deployments, the one entry it needs (or why it
//! needs none), and how each Deployment looks to the decisions.
//!
//! ```text
//! Deployments ─group by (ns, SA)─▶ resolve (policy per SA) ─▶ Needs(entry) | Invalid | OutOfScope
//!             └──────────────────▶ workloads: Deployment → its SA, deleting?, what we wrote
//! ```
//! One service account, one identity: SPIRE's selectors (`k8s:ns`, `k8s:sa`) cannot tell two
//! Deployments of one service account apart, so the policy is chosen per service account and
//! its entry is shared (the ref-count is the set of live Deployments running as it).

use crate::index::{NamespaceInfo, WorkloadRecord};
use crate::keys::{SaKey, WorkloadKey};
use crate::policy::render::validate;
use crate::policy::select::validate_selectors;
use crate::policy::{OptIn, Resolution, SpiffeRegistration, resolve};
use crate::spire::{Entry, Ownership};
pub use grouping::Workload;
use grouping::{fading_only, group};
use kube::ResourceExt;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// What one service account needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SaState {
    /// Governed by `policy`: needs `entry` (deterministic ID).
    /// The entry is shared with the plan's creates (a first sync creates them all).
    Needs { policy: String, entry: Arc<Entry> },
    /// Its winning policy cannot render an identity for it. Its entries are held, never
    /// deleted: a typo in a policy must not take identities away.
    Invalid {
        policy: String,
        reason: &'static str,
        message: String,
    },
    /// No policy governs it (namespace not opted in, or no selector matches).
    OutOfScope,
}

#[derive(Clone, Debug)]
pub struct ServiceAccount {
    pub state: SaState,
    /// Live Deployments running as it (never empty), sorted: the ref-count of its entry. A
    /// sorted vector, not a set: nearly every account has one to three, and a set's node is
    /// sized for eleven (a third of a sync's memory at 50,000 Deployments).
    pub deployments: Vec<WorkloadKey>,
    /// Other policies matching its Deployments, which do not govern it.
    pub losers: Vec<String>,
    /// DNS name templates left out of its entry, and why (`None`: every one rendered).
    pub dns_omitted: Option<Arc<str>>,
}

#[derive(Clone, Debug, Default)]
pub struct Desired {
    pub service_accounts: BTreeMap<SaKey, ServiceAccount>,
    pub workloads: BTreeMap<WorkloadKey, Workload>,
    /// Policy name → Deployments it matches but another policy governs.
    pub conflicts: BTreeMap<String, BTreeSet<WorkloadKey>>,
    /// Policies that cannot be used at all: name → (reason, message).
    pub invalid_policies: BTreeMap<String, (&'static str, String)>,
    /// Policies whose selectors cannot be evaluated. Such a policy might govern any service
    /// account, so while one exists nothing is deleted for scope loss or transition.
    pub doubt: BTreeSet<String>,
    /// The service accounts this derive covered, `None` for every one. A scoped derive (after
    /// Deployment events) says nothing about other service accounts: decisions leave their
    /// entries, memory and Deployments alone, and counts over all of them (policy status,
    /// pending deletions) wait for the next full derive.
    pub scope: Option<BTreeSet<SaKey>>,
}

/// Which of our entries a derive covered: every one, or those whose selectors name a service
/// account in its scope. Borrowed (no allocation per entry looked at).
pub struct Coverage<'a>(Option<std::collections::HashSet<(&'a str, &'a str)>>);

impl<'a> Coverage<'a> {
    /// Every service account (`None`), or those of `scope`.
    pub fn of(scope: Option<&'a BTreeSet<SaKey>>) -> Self {
        Coverage(scope.map(|scope| {
            scope
                .iter()
                .map(|sa| (&*sa.namespace, &*sa.service_account))
                .collect()
        }))
    }

    pub fn is_full(&self) -> bool {
        self.0.is_none()
    }

    /// Whether the derive covered the service account `entry` is for. An entry whose selectors
    /// name no service account is covered by full derives only.
    pub fn covers(&self, entry: &Entry) -> bool {
        SaKey::parts_of_entry(entry).map_or(self.is_full(), |parts| self.covers_account(parts))
    }

    /// Whether the derive covered (namespace, service account).
    pub fn covers_account(&self, parts: (&str, &str)) -> bool {
        self.0
            .as_ref()
            .is_none_or(|covered| covered.contains(&parts))
    }
}

impl Desired {
    /// Which entries this derive covered.
    pub fn coverage(&self) -> Coverage<'_> {
        Coverage::of(self.scope.as_ref())
    }

    /// A SPIFFE ID this scoped derive renders for one of its service accounts that `taken`
    /// (entries SPIRE holds or refused) gives to another service account: a collision a
    /// scoped derive cannot see on its own. Always `None` for a full derive, which compares
    /// every service account (`refuse_shared_ids`).
    pub fn collides_outside<'e>(&self, taken: impl Iterator<Item = &'e Entry>) -> Option<String> {
        self.scope.as_ref()?;
        let rendered: std::collections::HashMap<&str, &SaKey> = self
            .service_accounts
            .iter()
            .filter_map(|(sa, account)| match &account.state {
                SaState::Needs { entry, .. } => Some((entry.spiffe_id.as_str(), sa)),
                _ => None,
            })
            .collect();
        taken
            .filter(|entry| {
                rendered.get(entry.spiffe_id.as_str()).is_some_and(|sa| {
                    SaKey::parts_of_entry(entry) != Some((&*sa.namespace, &*sa.service_account))
                })
            })
            .map(|entry| entry.spiffe_id.clone())
            .next()
    }

    /// The entry `sa` needs, if it needs one.
    pub fn needs(&self, sa: &SaKey) -> Option<&Entry> {
        match &self.service_accounts.get(sa)?.state {
            SaState::Needs { entry, .. } => Some(entry),
            _ => None,
        }
    }
}

/// Why a policy is not usable at all, if it is not: (reason, message).
pub fn policy_problem(policy: &SpiffeRegistration) -> Option<(&'static str, String)> {
    if let Err(error) = validate_selectors(policy) {
        return Some(("InvalidSelector", error.to_string()));
    }
    validate(&policy.spec)
        .err()
        .map(|error| (error.reason(), error.to_string()))
}

/// Derives desired state from a snapshot of the caches: every Deployment.
pub fn compute(
    ownership: &Ownership,
    opt_in: &OptIn,
    deployments: &[Arc<WorkloadRecord>],
    namespaces: &dyn Fn(&str) -> Option<NamespaceInfo>,
    policies: &[Arc<SpiffeRegistration>],
) -> Desired {
    compute_for(
        ownership,
        opt_in,
        deployments,
        namespaces,
        policies,
        None,
        &BTreeMap::new(),
    )
}

/// Derives desired state for `scope`'s service accounts (every one when `None`), from
/// `deployments`: every Deployment running as them, and only those. An entry rendered exactly
/// as one in `known` (our entries in SPIRE, by ID) is that one, shared.
pub fn compute_for(
    ownership: &Ownership,
    opt_in: &OptIn,
    deployments: &[Arc<WorkloadRecord>],
    namespaces: &dyn Fn(&str) -> Option<NamespaceInfo>,
    policies: &[Arc<SpiffeRegistration>],
    scope: Option<BTreeSet<SaKey>>,
    known: &BTreeMap<String, Arc<Entry>>,
) -> Desired {
    let mut desired = Desired {
        scope,
        ..Desired::default()
    };
    note_policy_problems(&mut desired, policies);
    let grouped = group(deployments, namespaces);
    desired.workloads = grouped.workloads.into_iter().collect();
    let mut service_accounts = Vec::with_capacity(grouped.live.len());
    // Accounts only workloads going away with their kind's CRD run as: out of scope, so that
    // their entries have the scope-loss grace (and the deletion brake), and the workloads keep
    // our finalizer (as live ones out of scope do) until that is settled.
    for (sa, keys) in fading_only(grouped.fading, &grouped.live) {
        for key in &keys {
            if let Some(workload) = desired.workloads.get_mut(key) {
                workload.deleting = false;
                workload.going_with_its_kind = true;
            }
        }
        let account = ServiceAccount {
            state: SaState::OutOfScope,
            deployments: keys,
            losers: Vec::new(),
            dns_omitted: None,
        };
        service_accounts.push((sa, account));
    }
    for (sa, members) in grouped.live {
        let labels = grouped
            .namespaces
            .get(&sa.namespace)
            .cloned()
            .flatten()
            .map(|ns| ns.labels);
        let resolution = resolve(
            opt_in,
            &sa.namespace,
            labels.as_ref(),
            &sa.service_account,
            members.iter().map(|(_, d)| (d.kind, &d.labels)),
            policies.iter().map(Arc::as_ref),
            ownership,
        );
        let mut keys: Vec<WorkloadKey> = members.into_iter().map(|(k, _)| k).collect();
        keys.sort_unstable();
        keys.shrink_to_fit();
        let account = account(&mut desired, resolution, keys, known);
        service_accounts.push((sa, account));
    }
    desired.service_accounts = service_accounts.into_iter().collect();
    refuse_shared_ids(&mut desired);
    desired
}

/// Records every policy that cannot be used, and puts the cluster in doubt while a live
/// policy's selectors cannot be evaluated.
fn note_policy_problems(desired: &mut Desired, policies: &[Arc<SpiffeRegistration>]) {
    for policy in policies {
        if let Some((reason, message)) = policy_problem(policy) {
            if reason == "InvalidSelector" && policy.metadata.deletion_timestamp.is_none() {
                desired.doubt.insert(policy.name_any());
            }
            desired
                .invalid_policies
                .insert(policy.name_any(), (reason, message));
        }
    }
}

/// One service account's state from its policy resolution; conflicts are noted on the
/// policies that lost. A rendered entry identical to the one SPIRE holds is shared with the
/// view.
fn account(
    desired: &mut Desired,
    resolution: Resolution,
    keys: Vec<WorkloadKey>,
    known: &BTreeMap<String, Arc<Entry>>,
) -> ServiceAccount {
    let mut loser_names = Vec::new();
    let mut dns_omitted = None;
    let state = match resolution {
        Resolution::OutOfScope => SaState::OutOfScope,
        Resolution::Invalid { policy, error } => SaState::Invalid {
            policy: policy.name_any(),
            reason: error.reason(),
            message: error.to_string(),
        },
        Resolution::InScope {
            policy,
            entry,
            losers,
            dns_omitted: omitted,
        } => {
            dns_omitted = (!omitted.is_empty()).then(|| Arc::from(omitted.join("; ")));
            for loser in losers {
                loser_names.push(loser.name_any());
                desired
                    .conflicts
                    .entry(loser.name_any())
                    .or_default()
                    .extend(keys.iter().cloned());
            }
            let entry = match known.get(&entry.id) {
                Some(stored) if stored.renders_as(&entry) => stored.clone(),
                _ => Arc::new(entry.shrunk()),
            };
            SaState::Needs {
                policy: policy.name_any(),
                entry,
            }
        }
    };
    ServiceAccount {
        state,
        deployments: keys,
        losers: loser_names,
        dns_omitted,
    }
}

/// Two service accounts must never get one SPIFFE ID (possible only across policies with
/// different templates). Both are held, with a reason, rather than picking one.
fn refuse_shared_ids(desired: &mut Desired) {
    let mut by_id: BTreeMap<String, Vec<SaKey>> = BTreeMap::new();
    for (sa, account) in &desired.service_accounts {
        if let SaState::Needs { entry, .. } = &account.state {
            by_id
                .entry(entry.spiffe_id.clone())
                .or_default()
                .push(sa.clone());
        }
    }
    for (spiffe_id, holders) in by_id.into_iter().filter(|(_, h)| h.len() > 1) {
        let names: Vec<String> = holders.iter().map(ToString::to_string).collect();
        for sa in holders {
            let account = desired
                .service_accounts
                .get_mut(&sa)
                .expect("collected from this map");
            if let SaState::Needs { policy, .. } = &account.state {
                account.state = SaState::Invalid {
                    policy: policy.clone(),
                    reason: "SpiffeIDCollision",
                    message: format!(
                        "{spiffe_id} would be the identity of {}; fix the policies' templates",
                        names.join(" and ")
                    ),
                };
            }
        }
    }
}

mod grouping;
#[cfg(test)]
mod tests;
