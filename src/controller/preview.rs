//! `spiffe-registrar plan`: the decision a fresh leader would take now, against the live
//! caches and SPIRE, told as text. Reads only.

use super::decide::{SpirePlan, Why};
use super::desired::Desired;
use super::policy_notes::confirm_command;
use super::state::ControllerSettings;
use super::sync::fresh_plan;
use super::view::SpireView;
use crate::index::Index;
use crate::keys::SaKey;
use crate::spire::node_alias::is_node_alias;
use crate::spire::{Entry, EntryApi, SpireError};
use std::fmt::Write;
use std::time::Instant;

/// Lists our entries in SPIRE, decides against the caches, and says what a sync would do.
pub async fn preview(
    settings: &ControllerSettings,
    index: &Index,
    api: &impl EntryApi,
) -> Result<String, SpireError> {
    let mut view = SpireView::default();
    view.refresh(api).await?;
    let (desired, plan) = fresh_plan(settings, index, &view.entries);
    Ok(render(
        settings,
        &desired,
        &plan,
        view.entries.len(),
        Instant::now(),
    ))
}

/// The preview's text: a summary line, then one line per write and per pending deletion.
fn render(
    settings: &ControllerSettings,
    desired: &Desired,
    plan: &SpirePlan,
    ours_in_spire: usize,
    now: Instant,
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "cluster {}: {} Deployments seen, {} service accounts with entries desired, {} ours in SPIRE",
        settings.ownership.cluster(),
        desired.workloads.len(),
        plan.serving.len(),
        ours_in_spire
    );
    for entry in &plan.create {
        let _ = writeln!(
            out,
            "create {} {} (for {})",
            entry.id,
            entry.spiffe_id,
            needed_by(desired, entry)
        );
    }
    for entry in &plan.update {
        let _ = writeln!(
            out,
            "update {} {} (x509 ttl {}s, jwt ttl {}s, hint {})",
            entry.id, entry.spiffe_id, entry.x509_svid_ttl, entry.jwt_svid_ttl, entry.hint
        );
    }
    for entry in &plan.delete {
        let _ = writeln!(out, "delete {} {}", entry.id, entry.spiffe_id);
    }
    for pending in &plan.pending {
        let _ = writeln!(
            out,
            "pending-delete {} {} ({})",
            pending.entry.id,
            pending.entry.spiffe_id,
            kept_because(&pending.why, now)
        );
    }
    if let Some(brake) = &plan.brake {
        let _ = writeln!(
            out,
            "deletion brake: {} of {} entries would go at once; confirm with: {}",
            brake.count,
            brake.total,
            confirm_command(&brake.token)
        );
    }
    if plan.writes() == 0 && plan.pending.is_empty() {
        let _ = writeln!(out, "in sync: nothing to do");
    }
    out
}

/// Who needs an entry about to be created: its Deployments, or every agent (node alias).
fn needed_by(desired: &Desired, entry: &Entry) -> String {
    match SaKey::of_entry(entry).and_then(|sa| desired.service_accounts.get(&sa)) {
        Some(account) => account
            .deployments
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        None if is_node_alias(entry) => "the node alias: every agent of the cluster".to_string(),
        None => String::new(),
    }
}

fn kept_because(why: &Why, now: Instant) -> String {
    match why {
        Why::Transition { by, due: Some(due) } => format!(
            "replaced by {by}; deleted in {}s",
            due.saturating_duration_since(now).as_secs()
        ),
        Why::Transition { by, due: None } => {
            format!("replaced by {by}, which is not in SPIRE yet; kept")
        }
        Why::ScopeLoss { due } => format!(
            "out of scope; deleted in {}s (scope-loss grace) unless back in scope",
            due.saturating_duration_since(now).as_secs()
        ),
        Why::Brake => "waits for confirmation (deletion brake)".to_string(),
        Why::Held(reason) => format!("held: {reason}"),
    }
}
