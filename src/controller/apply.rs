//! Carries a plan's SPIRE writes out, stage by stage in the order `SpirePlan::stages` gives,
//! and hands each create chunk's Deployments to the writer as their entries exist. Identity
//! first: the writer starts no patch until SPIRE has every write of the plan
//! (`WorkloadWriter::behind_spire`), because the entries are what Pods wait for and the
//! annotations are bookkeeping that competes for the same cores (the apiserver absorbing
//! patches, kube-controller-manager copying them to ReplicaSets, spire-server creating). SPIRE
//! is never kept waiting for the apiserver: once the writer's queue is full, a chunk's
//! Deployments are handed over after the last SPIRE write, as the queue drains.

use super::decide::{self, SpirePlan, StageKind};
use super::desired::Desired;
use super::failpoint::failpoint;
use super::state::Controller;
use super::view::ApplyReport;
use super::writer::WorkloadWriter;
use crate::keys::SaKey;
use crate::leader::Term;
use crate::spire::EntryApi;
use std::collections::BTreeSet;
use tracing::{info, warn};

/// Entries created before their Deployments are handed to the writer: a few SPIRE batches,
/// so the writer's queue fills while SPIRE creates, without recomputing writes too often.
const CREATE_CHUNK: usize = 200;

impl<A: EntryApi> Controller<A> {
    /// Applies the SPIRE writes of `plan`. Leadership is re-checked between stages (the
    /// term's guard also cancels anything in flight when it ends).
    pub(super) async fn apply(
        &mut self,
        term: &Term,
        plan: &SpirePlan,
        desired: &Desired,
        writer: &mut WorkloadWriter,
    ) -> ApplyReport {
        let mut report = ApplyReport::default();
        // Created, but their Deployments not yet handed to the writer (its queue was full).
        let mut waiting: Vec<BTreeSet<SaKey>> = Vec::new();
        let spire_first = if plan.create.is_empty() {
            None
        } else {
            Some(writer.behind_spire().await)
        };
        for stage in plan.stages(CREATE_CHUNK) {
            match stage.kind {
                StageKind::DeleteReplaced => {}
                // A term that ended writes nothing more, not even to Deployments.
                StageKind::Create if !term.is_valid() => return report,
                StageKind::UpdateAndDelete if !term.is_valid() => continue,
                StageKind::Create | StageKind::UpdateAndDelete => {}
            }
            let done = self
                .view
                .apply(self.api.as_ref(), &self.settings.ownership, &stage.writes)
                .await;
            report.absorb(done);
            if stage.kind != StageKind::Create || failpoint("pause-after-create") {
                continue;
            }
            let scope: BTreeSet<SaKey> = stage
                .writes
                .create
                .iter()
                .filter_map(|e| SaKey::of_entry(e))
                .collect();
            if writer.has_room() {
                self.hand_over(desired, plan, &report, writer, &scope);
            } else {
                waiting.push(scope);
            }
        }
        drop(spire_first);
        for scope in waiting {
            writer.room().await;
            self.hand_over(desired, plan, &report, writer, &scope);
        }
        if !plan.create.is_empty() && failpoint("pause-after-create") {
            // Crash tests: stop between writing entries and recording them; the test SIGKILLs
            // the process here.
            warn!(
                created = report.created,
                "failpoint pause-after-create: pausing forever"
            );
            std::future::pending::<()>().await;
        }
        log_applied(plan, &report);
        report
    }

    /// Hands the writer the Deployments of `scope`'s service accounts, decided against SPIRE
    /// as it is now.
    fn hand_over(
        &mut self,
        desired: &Desired,
        plan: &SpirePlan,
        report: &ApplyReport,
        writer: &mut WorkloadWriter,
        scope: &BTreeSet<SaKey>,
    ) {
        let writes = decide::workload_writes(
            desired,
            plan,
            &self.view.entries,
            &report.failures,
            &mut self.memory,
            Some(scope),
            &|key| writer.wrote(key),
        );
        writer.spawn(desired, writes);
    }
}

fn log_applied(plan: &SpirePlan, report: &ApplyReport) {
    info!(
        creates = plan.create.len(),
        updates = plan.update.len(),
        deletes = plan.delete.len(),
        created = report.created,
        updated = report.updated,
        deleted = report.deleted,
        failed = report.failures.len(),
        "applied SPIRE changes"
    );
    for entry in &plan.delete {
        if !report.failures.contains_key(&entry.id) {
            info!(entry_id = %entry.id, spiffe_id = %entry.spiffe_id, "deleted entry");
        }
    }
    for (entry_id, error) in &report.failures {
        warn!(%entry_id, %error, "SPIRE write failed");
    }
}
