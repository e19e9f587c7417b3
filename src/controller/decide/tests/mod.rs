//! Table-style tests of the decisions, over a small world built with `World` helpers; one
//! file per decision.

use super::*;
use crate::controller::desired::{Desired, SaState, ServiceAccount, Workload};
use crate::keys::{SaKey, WorkloadKey, WorkloadKind};
use crate::spire::Selector;
use crate::spire::{Entry, Ownership};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod deletions;
mod node_alias;
mod spire_plan;
mod workload_writes;

const GRACE: u64 = 60;
const SCOPE: u64 = 600;

struct World {
    o: Ownership,
    settings: DecideSettings,
    desired: Desired,
    observed: Observed,
    memory: Memory,
    t0: Instant,
    confirmed: Option<String>,
}

fn sa(ns: &str, name: &str) -> SaKey {
    SaKey {
        namespace: ns.into(),
        service_account: name.into(),
    }
}

/// A Deployment's key.
fn dk(ns: &str, name: &str) -> WorkloadKey {
    wk(WorkloadKind::Deployment, ns, name)
}

fn wk(kind: WorkloadKind, ns: &str, name: &str) -> WorkloadKey {
    WorkloadKey {
        kind,
        namespace: ns.into(),
        name: name.into(),
    }
}

/// The entry a policy with `parent` renders for `ns/sa_name` under `o`.
fn rendered(o: &Ownership, ns: &str, sa_name: &str, parent: &str) -> Entry {
    let selectors = sa(ns, sa_name).selectors();
    let spiffe_id = format!("spiffe://td/ns/{ns}/sa/{sa_name}");
    Entry {
        id: o.entry_id(&spiffe_id, parent, &selectors),
        spiffe_id,
        parent_id: parent.into(),
        selectors,
        x509_svid_ttl: 3600,
        hint: o.hint().into(),
        ..Entry::default()
    }
    .normalize()
}

impl World {
    fn new() -> Self {
        Self {
            o: Ownership::new("c").expect("valid"),
            settings: DecideSettings {
                transition_grace: Duration::from_secs(GRACE),
                scope_loss_grace: Duration::from_secs(SCOPE),
                brake_count: 3,
                brake_fraction: 0.25,
                adopt: false,
            },
            desired: Desired::default(),
            observed: BTreeMap::new(),
            memory: Memory::default(),
            t0: Instant::now(),
            confirmed: None,
        }
    }

    /// `ns/sa_name` runs `deployments` (live, with our finalizer) in state `state`.
    fn account(&mut self, ns: &str, sa_name: &str, deployments: &[&str], state: SaState) {
        let keys: Vec<WorkloadKey> = deployments.iter().map(|n| dk(ns, n)).collect();
        self.account_of(ns, sa_name, &keys, state);
    }

    /// `ns/sa_name` runs `workloads` of any kind (live, with our finalizer) in state `state`.
    fn account_of(&mut self, ns: &str, sa_name: &str, workloads: &[WorkloadKey], state: SaState) {
        let key = sa(ns, sa_name);
        for workload in workloads {
            self.desired.workloads.insert(
                workload.clone(),
                Workload {
                    service_account: key.clone(),
                    deleting: false,
                    going_with_its_kind: false,
                    namespace_terminating: false,
                    has_finalizer: true,
                    spiffe_id: None,
                    entry_id: None,
                    created: None,
                },
            );
        }
        self.desired.service_accounts.insert(
            key,
            ServiceAccount {
                state,
                deployments: workloads.to_vec(),
                losers: Vec::new(),
                dns_omitted: None,
            },
        );
    }

    /// `ns/sa_name` needs the entry rendered under `parent`; returns it.
    fn needs(&mut self, ns: &str, sa_name: &str, deployments: &[&str], parent: &str) -> Entry {
        let entry = rendered(&self.o, ns, sa_name, parent);
        self.account(
            ns,
            sa_name,
            deployments,
            SaState::Needs {
                policy: "p".into(),
                entry: entry.clone().into(),
            },
        );
        entry
    }

    fn in_spire(&mut self, entry: &Entry) {
        self.observed
            .insert(entry.id.clone(), Arc::new(entry.clone()));
    }

    /// Deployment `ns/name` (running as `sa_name`) is being deleted; its service account has no
    /// other live Deployment unless declared separately.
    fn deleting(&mut self, ns: &str, name: &str, sa_name: &str) {
        self.deleting_workload(dk(ns, name), sa_name);
    }

    /// Workload `key` (running as `sa_name` in its namespace) is being deleted.
    fn deleting_workload(&mut self, key: WorkloadKey, sa_name: &str) {
        let ns = key.namespace.clone();
        self.desired.workloads.insert(
            key,
            Workload {
                service_account: sa(&ns, sa_name),
                deleting: true,
                going_with_its_kind: false,
                namespace_terminating: false,
                has_finalizer: true,
                spiffe_id: None,
                entry_id: None,
                created: None,
            },
        );
    }

    fn decide(&mut self, at: u64) -> SpirePlan {
        let desired = std::mem::take(&mut self.desired);
        let plan = self.decide_on(&desired, at);
        self.desired = desired;
        plan
    }

    fn decide_on(&mut self, desired: &Desired, at: u64) -> SpirePlan {
        let input = Input {
            ownership: &self.o,
            settings: &self.settings,
            desired,
            observed: &self.observed,
            now: self.t0 + Duration::from_secs(at),
            confirmed: self.confirmed.as_deref(),
        };
        spire_plan(&input, &mut self.memory)
    }

    /// Every write succeeds, as SPIRE would apply it.
    fn apply(&mut self, plan: &SpirePlan) {
        for entry in &plan.delete {
            self.observed.remove(&entry.id);
        }
        for entry in plan.create.iter().map(|e| &**e).chain(&plan.update) {
            let revision_number = self
                .observed
                .get(&entry.id)
                .map_or(0, |stored| stored.revision_number);
            let stored = Entry {
                revision_number,
                ..entry.clone()
            };
            self.observed.insert(entry.id.clone(), Arc::new(stored));
        }
    }

    fn writes(&mut self, plan: &SpirePlan, failures: &Failures) -> Vec<WorkloadWrite> {
        workload_writes(
            &self.desired,
            plan,
            &self.observed,
            failures,
            &mut self.memory,
            None,
            &|_| false,
        )
    }
}

fn ids<E: AsRef<Entry>>(entries: &[E]) -> Vec<&str> {
    entries.iter().map(|e| e.as_ref().id.as_str()).collect()
}

/// The plan's creates, as plain entries.
fn created(plan: &SpirePlan) -> Vec<Entry> {
    plan.create.iter().map(|e| Entry::clone(e)).collect()
}

fn whys(plan: &SpirePlan) -> Vec<(&str, &'static str)> {
    plan.pending
        .iter()
        .map(|p| (p.entry.id.as_str(), p.why.label()))
        .collect()
}

impl World {
    /// Decides as a sync of `accounts` alone would: desired state derived for them only.
    fn decide_scoped(&mut self, at: u64, accounts: &[(&str, &str)]) -> SpirePlan {
        let scope: BTreeSet<SaKey> = accounts.iter().map(|(ns, name)| sa(ns, name)).collect();
        let mut desired = self.desired.clone();
        desired
            .service_accounts
            .retain(|key, _| scope.contains(key));
        desired
            .workloads
            .retain(|_, w| scope.contains(&w.service_account));
        desired.scope = Some(scope);
        self.decide_on(&desired, at)
    }
}
