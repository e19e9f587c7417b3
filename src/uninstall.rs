//! `spiffe-registrar uninstall`: takes the registrar out of a cluster so that nothing is left
//! stuck. The order is what makes it safe:
//!
//! 1. Refuse while a replica still leads: its controller would stamp the finalizers back.
//! 2. Delete the webhook configuration, so no admission adds them back either.
//! 3. Remove our finalizer and annotations from every workload of every built-in kind, bare
//!    Pods included (guarded JSON Patches, the controller's own builder), so `kubectl delete`
//!    of a workload or a namespace completes.
//! 4. Only with `--delete-entries`, delete our SPIRE entries. By default workloads keep their
//!    identities: the operator may be moving to another registrar, and an entry deleted by
//!    mistake takes identities away from running workloads.
//!
//! Every step is idempotent, so a run that failed half-way is simply run again.

use crate::config::{ClusterArgs, ConfigError, InstallationArgs, SpireArgs};
use crate::controller::decide::MetadataChange;
use crate::controller::record::{api_of, patch_metadata};
use crate::index::WorkloadRecord;
use crate::keys::WorkloadKind;
use crate::leader::LEASE_NAME;
use crate::spire::metrics::SpireMetrics;
use crate::spire::{ClientSettings, EntryApi, GrpcEntryClient, Ownership, SpireError, connect};
use clap::Args;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{DeleteParams, DynamicObject, ListParams};
use kube::{Api, Client};
use std::fmt;
use std::time::Duration;

#[derive(Args, Debug, Clone)]
pub struct UninstallArgs {
    /// Also delete every SPIRE entry this registrar owns (this cluster's and its previous
    /// names'). Workloads then lose their identities as agents drop the entries.
    #[arg(long, default_value_t = false)]
    pub delete_entries: bool,

    /// Kinds configured with --custom-kind, cleaned too (a kind whose CRD is gone is skipped).
    #[arg(long = "custom-kind", env = "REGISTRAR_CUSTOM_KINDS", value_delimiter = ',', value_parser = crate::config::parse_custom_kind)]
    pub custom_kinds: Vec<WorkloadKind>,

    /// Its namespace (the Lease is checked there) and the webhook configuration to delete.
    #[command(flatten)]
    pub installation: InstallationArgs,

    #[command(flatten)]
    pub cluster: ClusterArgs,

    /// Needed with --delete-entries only.
    #[command(flatten)]
    pub spire: SpireArgs,
}

#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    #[error("Kubernetes: {0}")]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Cluster(#[from] crate::run::RunError),
    #[error(
        "replica {holder:?} still holds the Lease {namespace}/{LEASE_NAME} (renewed {renewed_ago_s} s ago): \
         scale the registrar to 0 first (kubectl -n {namespace} scale deployment spiffe-registrar --replicas=0), \
         or its controller puts the finalizers back"
    )]
    StillRunning {
        holder: String,
        namespace: String,
        renewed_ago_s: i64,
    },
    #[error(transparent)]
    Spire(#[from] SpireError),
    #[error(
        "{failed} of {total} {what} could not be cleaned (first error: {first}); run uninstall again"
    )]
    Incomplete {
        what: &'static str,
        failed: usize,
        total: usize,
        first: String,
    },
}

/// What a run did, printed for the operator.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Report {
    pub webhook_configuration_deleted: bool,
    /// Workloads (of every kind) that carried our finalizer or annotations and now do not.
    pub workloads_cleaned: usize,
    /// `None`: entries were not touched (no `--delete-entries`).
    pub entries_deleted: Option<usize>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.webhook_configuration_deleted {
            writeln!(f, "deleted the MutatingWebhookConfiguration")?;
        } else {
            writeln!(f, "the MutatingWebhookConfiguration was already gone")?;
        }
        writeln!(
            f,
            "removed our finalizer and annotations from {} workloads",
            self.workloads_cleaned
        )?;
        match self.entries_deleted {
            Some(count) => writeln!(f, "deleted {count} SPIRE entries"),
            None => writeln!(
                f,
                "SPIRE entries kept (workloads keep their identities); pass --delete-entries to delete them"
            ),
        }
    }
}

pub async fn uninstall(args: UninstallArgs) -> Result<Report, UninstallError> {
    let UninstallArgs {
        delete_entries,
        custom_kinds,
        installation:
            InstallationArgs {
                namespace,
                webhook_configuration,
            },
        cluster,
        spire,
    } = args;
    cluster.check()?;
    // Checked before anything changes: a typo in the SPIRE flags must not leave a half-done
    // uninstall.
    let spire = delete_entries.then(|| spire.endpoint()).transpose()?;
    let client = Client::try_default().await?;
    refuse_while_leading(&client, &namespace).await?;
    let mut report = Report {
        webhook_configuration_deleted: delete_webhook_configuration(
            &client,
            &webhook_configuration,
        )
        .await?,
        workloads_cleaned: clean_workloads(&client, &custom_kinds).await?,
        entries_deleted: None,
    };
    if let Some(endpoint) = spire {
        let name = crate::run::cluster_name(cluster.cluster_name.as_deref(), &client).await?;
        let ownership = cluster.ownership(&name)?;
        report.entries_deleted = Some(delete_our_entries(&endpoint, ownership).await?);
    }
    Ok(report)
}

/// A Lease renewed within its duration has a live holder (released Leases have none).
async fn refuse_while_leading(client: &Client, namespace: &str) -> Result<(), UninstallError> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), namespace);
    let Some(spec) = leases.get_opt(LEASE_NAME).await?.and_then(|l| l.spec) else {
        return Ok(());
    };
    let Some(holder) = spec.holder_identity.filter(|h| !h.is_empty()) else {
        return Ok(());
    };
    let duration = i64::from(spec.lease_duration_seconds.unwrap_or(15));
    let renewed_ago_s = spec
        .renew_time
        .map(|t| k8s_openapi::jiff::Timestamp::now().as_second() - t.0.as_second())
        .unwrap_or(i64::MAX);
    if renewed_ago_s <= duration {
        return Err(UninstallError::StillRunning {
            holder,
            namespace: namespace.to_string(),
            renewed_ago_s,
        });
    }
    Ok(())
}

/// Whether it existed.
async fn delete_webhook_configuration(client: &Client, name: &str) -> Result<bool, kube::Error> {
    let api: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Every kind's workloads cleaned, bare Pods' annotations and `custom` kinds included: how
/// many carried something of ours.
async fn clean_workloads(
    client: &Client,
    custom: &[WorkloadKind],
) -> Result<usize, UninstallError> {
    let mut cleaned = 0;
    for kind in WorkloadKind::ALL.into_iter().chain([WorkloadKind::Pod]) {
        cleaned += clean_kind(client, kind).await?;
    }
    for &kind in custom {
        match clean_kind(client, kind).await {
            Ok(count) => cleaned += count,
            // Its CRD is not installed: nothing of that kind carries anything.
            Err(UninstallError::Kube(kube::Error::Api(status))) if status.code == 404 => {}
            Err(error) => return Err(error),
        }
    }
    Ok(cleaned)
}

/// Pages through every `kind`'s metadata and cleans those that carry anything of ours.
async fn clean_kind(client: &Client, kind: WorkloadKind) -> Result<usize, UninstallError> {
    let all: Api<DynamicObject> = Api::all_with(client.clone(), &kind.api_resource());
    let mut params = ListParams::default().limit(500);
    let (mut cleaned, mut failed, mut first) = (0, 0, None);
    loop {
        let page = all.list_metadata(&params).await?;
        for meta in page.items {
            let record = WorkloadRecord::from_metadata(kind, &meta.metadata);
            if !carries_ours(&record) {
                continue;
            }
            match clean(client, record).await {
                Ok(()) => cleaned += 1,
                Err(e) => {
                    failed += 1;
                    first.get_or_insert_with(|| e.to_string());
                }
            }
        }
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => break,
        }
    }
    match first {
        None => Ok(cleaned),
        Some(first) => Err(UninstallError::Incomplete {
            what: kind.plural(),
            failed,
            total: cleaned + failed,
            first,
        }),
    }
}

fn carries_ours(record: &WorkloadRecord) -> bool {
    record.has_finalizer() || record.spiffe_id().is_some() || record.entry_id().is_some()
}

const EVERYTHING_OURS: MetadataChange = MetadataChange {
    add_finalizer: false,
    remove_finalizer: true,
    spiffe_id: Some(None),
    entry_id: Some(None),
};

/// One workload; a patch whose guard failed (someone else changed the finalizers meanwhile)
/// is retried on the object as it is now.
async fn clean(client: &Client, mut record: WorkloadRecord) -> Result<(), kube::Error> {
    let api = api_of(client, &record);
    let mut attempts = 0;
    loop {
        attempts += 1;
        match patch_metadata(client, &record, &EVERYTHING_OURS).await {
            Ok(_) => {
                tracing::info!(kind = %record.kind, namespace = %record.namespace, deployment = %record.name, "cleaned");
                return Ok(());
            }
            Err(kube::Error::Api(status)) if status.code == 404 => return Ok(()),
            Err(kube::Error::Api(status)) if status.code == 422 && attempts < 5 => {
                match api.get_metadata_opt(&record.name).await? {
                    Some(current) => {
                        record = WorkloadRecord::from_metadata(record.kind, &current.metadata)
                    }
                    None => return Ok(()),
                }
            }
            Err(e) => return Err(e),
        }
    }
}

async fn delete_our_entries(
    endpoint: &crate::spire::SpireEndpoint,
    ownership: Ownership,
) -> Result<usize, UninstallError> {
    let connection = connect(endpoint, Duration::from_secs(30)).await?;
    let api = GrpcEntryClient::new(
        connection.channel.clone(),
        ownership,
        ClientSettings::default(),
        SpireMetrics::unregistered(),
    );
    let entries = api.list_ours().await;
    let outcome = match entries {
        Ok(entries) => {
            let total = entries.len();
            // Node aliases last: they outlive every entry that hangs from them.
            let (aliases, children): (Vec<_>, Vec<_>) = entries
                .into_iter()
                .partition(crate::spire::node_alias::is_node_alias);
            let mut results = api.delete(children).await;
            results.extend(api.delete(aliases).await);
            let failures: Vec<String> = results
                .iter()
                .filter_map(|r| r.as_ref().err().map(|e| format!("{e:?}")))
                .collect();
            match failures.first() {
                None => Ok(total),
                Some(first) => Err(UninstallError::Incomplete {
                    what: "SPIRE entries",
                    failed: failures.len(),
                    total,
                    first: first.clone(),
                }),
            }
        }
        Err(e) => Err(e.into()),
    };
    connection.shutdown().await;
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::record::operations;
    use crate::names::{ENTRY_ID_ANNOTATION, FINALIZER, SPIFFE_ID_ANNOTATION};

    fn meta(finalizers: Option<&[&str]>, annotations: &[(&str, &str)]) -> kube::api::ObjectMeta {
        kube::api::ObjectMeta {
            name: Some("web".into()),
            namespace: Some("shop".into()),
            resource_version: Some("7".into()),
            finalizers: finalizers.map(|f| f.iter().map(ToString::to_string).collect()),
            annotations: (!annotations.is_empty()).then(|| {
                annotations
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn only_workloads_carrying_something_of_ours_are_touched() {
        /// Finalizers, annotations, and whether uninstall touches the workload.
        type Case<'a> = (Option<&'a [&'a str]>, &'a [(&'a str, &'a str)], bool);
        let cases: &[Case] = &[
            (None, &[], false),
            (Some(&["other.io/keep"]), &[("app", "x")], false),
            (Some(&[FINALIZER]), &[], true),
            (None, &[(SPIFFE_ID_ANNOTATION, "spiffe://td/x")], true),
            (None, &[(ENTRY_ID_ANNOTATION, "id")], true),
        ];
        for (finalizers, annotations, expected) in cases {
            let record = WorkloadRecord::from_metadata(
                WorkloadKind::StatefulSet,
                &meta(*finalizers, annotations),
            );
            assert_eq!(
                carries_ours(&record),
                *expected,
                "{finalizers:?} {annotations:?}"
            );
        }
    }

    #[test]
    fn the_patch_removes_ours_and_keeps_everything_else() {
        let record = WorkloadRecord::from_metadata(
            WorkloadKind::StatefulSet,
            &meta(
                Some(&["other.io/keep", FINALIZER]),
                &[
                    ("app", "x"),
                    (SPIFFE_ID_ANNOTATION, "spiffe://td/x"),
                    (ENTRY_ID_ANNOTATION, "id"),
                ],
            ),
        );
        let ops = operations(&record, &EVERYTHING_OURS);
        assert_eq!(
            serde_json::to_value(ops).expect("serializes"),
            serde_json::json!([
                { "op": "test", "path": "/metadata/finalizers", "value": ["other.io/keep", FINALIZER] },
                { "op": "remove", "path": "/metadata/finalizers/1" },
                { "op": "remove", "path": "/metadata/annotations/registrar.spiffe.io~1spiffe-id" },
                { "op": "remove", "path": "/metadata/annotations/registrar.spiffe.io~1entry-id" },
            ])
        );
    }

    #[test]
    fn the_report_says_whether_entries_were_kept() {
        let kept = Report {
            webhook_configuration_deleted: true,
            workloads_cleaned: 3,
            entries_deleted: None,
        }
        .to_string();
        assert!(
            kept.contains("from 3 workloads") && kept.contains("--delete-entries"),
            "{kept}"
        );
        let deleted = Report {
            webhook_configuration_deleted: false,
            workloads_cleaned: 0,
            entries_deleted: Some(4),
        }
        .to_string();
        assert!(deleted.contains("deleted 4 SPIRE entries"), "{deleted}");
    }
}
