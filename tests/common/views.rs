//! A fixed `PolicyView` for in-process webhook tests and benchmarks: the caches' answers
//! without a cluster behind them.

use spiffe_registrar::index::PolicyView;
use spiffe_registrar::keys::WorkloadKind;
use spiffe_registrar::policy::{Labels, OptIn, SpiffeRegistration};
use spiffe_registrar::spire::Ownership;
use std::collections::BTreeMap;
use std::sync::Arc;

pub struct StaticView {
    pub opt_in: OptIn,
    pub ownership: Ownership,
    pub policies: Vec<Arc<SpiffeRegistration>>,
    /// Every namespace is opted in (with the default label) when true, none when false.
    pub every_namespace_opted_in: bool,
}

impl StaticView {
    /// Every namespace opted in, governed by `policies`, entries named for `cluster`.
    pub fn opted_in(cluster: &str, policies: Vec<Arc<SpiffeRegistration>>) -> Self {
        Self {
            opt_in: OptIn::default(),
            ownership: Ownership::new(cluster).expect("valid cluster name"),
            policies,
            every_namespace_opted_in: true,
        }
    }

    /// Nothing in scope: every review passes unchanged.
    pub fn empty(cluster: &str) -> Self {
        Self {
            every_namespace_opted_in: false,
            ..Self::opted_in(cluster, Vec::new())
        }
    }
}

impl PolicyView for StaticView {
    fn opt_in(&self) -> &OptIn {
        &self.opt_in
    }
    fn ownership(&self) -> &Ownership {
        &self.ownership
    }
    fn namespace_labels(&self, _: &str) -> Option<BTreeMap<String, String>> {
        self.every_namespace_opted_in
            .then(|| BTreeMap::from([(self.opt_in.key.clone(), self.opt_in.value.clone())]))
    }
    fn policies(&self) -> Vec<Arc<SpiffeRegistration>> {
        self.policies.clone()
    }
    /// Every built-in kind, as with the default flags.
    fn registers(&self, _: WorkloadKind) -> bool {
        true
    }
    fn sibling_labels(
        &self,
        _: &str,
        _: &str,
        _: (WorkloadKind, &str),
    ) -> Vec<(WorkloadKind, Labels)> {
        Vec::new()
    }
}
