//! Carries a sync's outcome to policies and the CRD: status written when it changed, Events
//! when they are news, and the operator's confirmation of held deletions read back. The
//! texts and statuses come from pure code (`status`, `policy_notes`).

use super::events::EventSink;
use super::metrics::ControllerMetrics;
use super::policy_notes::{Announced, brake_waiting, confirm_command};
use super::record::event;
use super::status;
use super::writer::WorkloadWriter;
use crate::index::WorkloadStore;
use crate::names::{CONFIRM_DELETIONS_ANNOTATION, CRD_NAME};
use crate::policy::{SpiffeRegistration, SpiffeRegistrationStatus};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use std::sync::Arc;
use tracing::{info, warn};

/// The controller's Kubernetes side besides Deployment patches.
pub struct PolicyEffects {
    client: Client,
    events: EventSink,
    /// The deletion-brake confirmation last read from the CRD.
    confirmed: Option<String>,
    announced: Announced,
}

/// One policy's Events after a sync, from `policy_notes::policy_events`.
pub type PolicyEvents = Vec<(&'static str, String)>;

impl PolicyEffects {
    pub fn new(client: Client, replica_id: &str, metrics: &ControllerMetrics) -> Self {
        let events = EventSink::start(
            client.clone(),
            replica_id.to_string(),
            metrics.events_dropped.clone(),
        );
        Self {
            client,
            events,
            confirmed: None,
            announced: Announced::default(),
        }
    }

    /// The operator's confirmation as last read.
    pub fn confirmed(&self) -> Option<&str> {
        self.confirmed.as_deref()
    }

    pub fn events(&self) -> &EventSink {
        &self.events
    }

    /// A writer for this sync's Deployment patches and Events.
    pub fn workload_writer(
        &self,
        metrics: &ControllerMetrics,
        deployments: &WorkloadStore,
    ) -> WorkloadWriter {
        WorkloadWriter::new(
            self.client.clone(),
            self.events.clone(),
            metrics.clone(),
            deployments.clone(),
        )
    }

    /// Reads the operator's confirmation from the CRD; true when it now confirms `token`.
    pub async fn refresh_confirmation(&mut self, token: &str) -> bool {
        if self.confirmed.as_deref() == Some(token) {
            return false;
        }
        let api: Api<CustomResourceDefinition> = Api::all(self.client.clone());
        match api.get(CRD_NAME).await {
            Ok(crd) => {
                self.confirmed = crd.annotations().get(CONFIRM_DELETIONS_ANNOTATION).cloned();
                if self.confirmed.as_deref() == Some(token) {
                    info!(token, "the operator confirmed the held deletions");
                    return true;
                }
                let note = brake_waiting(token);
                if self
                    .announced
                    .first(CRD_NAME, "DeletionBrakeEngaged", &note)
                {
                    warn!(token, command = %confirm_command(token), "deletion brake engaged");
                    event(&self.events, &crd, true, "DeletionBrakeEngaged", note);
                }
            }
            Err(error) => warn!(%error, "reading the deletion confirmation failed"),
        }
        false
    }

    /// Writes each policy's status where it changed and publishes its Events that are news.
    pub async fn record_policies(
        &mut self,
        policies: Vec<(
            Arc<SpiffeRegistration>,
            SpiffeRegistrationStatus,
            PolicyEvents,
        )>,
    ) {
        let api: Api<SpiffeRegistration> = Api::all(self.client.clone());
        for (policy, wanted, events) in policies {
            let name = policy.name_any();
            let unchanged = policy
                .status
                .as_ref()
                .is_some_and(|current| status::same_status(current, &wanted));
            if !unchanged {
                let patch = serde_json::json!({ "status": wanted });
                let params = PatchParams::default();
                let patch = Patch::Merge(&patch);
                if let Err(error) = crate::telemetry::kube_write(
                    "patch",
                    "spiffe_registrations/status",
                    api.patch_status(&name, &params, &patch),
                )
                .await
                {
                    warn!(policy = %name, %error, "status update failed; will retry on the next sync");
                }
            }
            for (reason, note) in events {
                if self.announced.first(&name, reason, &note) {
                    warn!(policy = %name, reason, %note, "policy problem");
                    event(&self.events, policy.as_ref(), true, reason, note);
                }
            }
        }
    }
}
