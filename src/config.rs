//! Flags and environment, validated once at start-up into `Settings`. Every error names the
//! flag to fix.

use crate::certs::{CertSource, SecretSettings};
use crate::controller::decide::DecideSettings;
use crate::keys::WorkloadKind;
use crate::leader::ElectionSettings;
use crate::policy::OptIn;
use crate::spire::{ClientSettings, Ownership, SpireEndpoint};
use clap::Args;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    #[command(flatten)]
    pub cluster: ClusterArgs,

    /// How long a replaced entry outlives its replacement's appearance in SPIRE: agents pick
    /// up entries within two 5 s sync periods (server cache, agent sync), and workloads get
    /// the new SVID pushed on the agent's next sync.
    #[arg(long, env = "REGISTRAR_TRANSITION_GRACE", default_value = "60s", value_parser = parse_duration)]
    pub transition_grace: Duration,

    /// How long an entry outlives its service account falling out of scope (namespace label
    /// removed, policy deleted or changed) while its workloads still exist.
    #[arg(long, env = "REGISTRAR_SCOPE_LOSS_GRACE", default_value = "10m", value_parser = parse_duration)]
    pub scope_loss_grace: Duration,

    /// The deletion brake holds one sync's scope-loss deletions when they are more than this
    /// many AND more than --deletion-brake-fraction of our entries, until an operator confirms.
    #[arg(long, env = "REGISTRAR_DELETION_BRAKE_COUNT", default_value_t = 10)]
    pub deletion_brake_count: usize,

    /// See --deletion-brake-count (0 to 1).
    #[arg(long, env = "REGISTRAR_DELETION_BRAKE_FRACTION", default_value_t = 0.1)]
    pub deletion_brake_fraction: f64,

    /// Take over, in place, entries equivalent to ours (same SPIFFE ID, parent ID, selectors)
    /// written by another tool (spire-controller-manager, k8s-workload-registrar): to migrate.
    #[arg(long, env = "REGISTRAR_ADOPT_EQUIVALENT_ENTRIES", default_value_t = false, action = clap::ArgAction::Set)]
    pub adopt_equivalent_entries: bool,

    /// Namespace label (key=value) that opts a namespace in.
    #[arg(
        long,
        env = "REGISTRAR_NAMESPACE_LABEL",
        default_value = "spiffe.io/registrar=enabled"
    )]
    pub namespace_label: String,

    /// The kinds of workload registered (comma-separated): watched by the controller and
    /// stamped by the webhook. Each needs get/list/watch/patch in the registrar's RBAC and a
    /// rule in the webhook configuration; the manifests grant all five.
    #[arg(
        long,
        env = "REGISTRAR_WORKLOAD_KINDS",
        value_delimiter = ',',
        default_value = "Deployment,StatefulSet,DaemonSet,Job,CronJob",
        value_parser = parse_kind
    )]
    pub workload_kinds: Vec<WorkloadKind>,

    /// Also register Pods that no controller owns (`kubectl run`): watched (every Pod of the
    /// cluster is listed and watched, a cost on large clusters, hence off by default),
    /// registered without a finalizer and annotated by the controller. Needs get/list/watch/
    /// patch on pods (the chart's `config.barePods` adds them).
    #[arg(long, env = "REGISTRAR_BARE_PODS", default_value_t = false, action = clap::ArgAction::Set)]
    pub bare_pods: bool,

    /// A CRD's kind registered like the built-in ones (repeatable, or comma-separated):
    /// `<group>/<version>/<Kind>/<plural>[:<template path>]`, the path to its Pod template
    /// defaulting to `spec.template` (Argo Rollouts: `argoproj.io/v1alpha1/Rollout/rollouts`).
    /// Watched in JSON; needs get/list/watch/patch on the resource, get/list/watch on its CRD
    /// (a removal is seen), and a webhook rule (the chart's `customKinds` adds all three).
    /// While the CRD is not installed, the kind is registered as having no workloads.
    #[arg(long = "custom-kind", env = "REGISTRAR_CUSTOM_KINDS", value_delimiter = ',', value_parser = parse_custom_kind)]
    pub custom_kinds: Vec<WorkloadKind>,

    /// HTTPS address of the admission webhook.
    #[arg(long, env = "REGISTRAR_WEBHOOK_ADDR", default_value = "0.0.0.0:8443")]
    pub webhook_addr: SocketAddr,

    /// Plain-HTTP address of /healthz, /readyz and /metrics.
    #[arg(long, env = "REGISTRAR_ADMIN_ADDR", default_value = "0.0.0.0:8080")]
    pub admin_addr: SocketAddr,

    /// Serve this certificate (PEM chain) instead of managing one; re-read when it changes.
    #[arg(long, env = "REGISTRAR_TLS_CERT_FILE", requires = "tls_key_file")]
    pub tls_cert_file: Option<PathBuf>,

    /// Private key (PEM) for --tls-cert-file.
    #[arg(long, env = "REGISTRAR_TLS_KEY_FILE", requires = "tls_cert_file")]
    pub tls_key_file: Option<PathBuf>,

    #[command(flatten)]
    pub installation: InstallationArgs,

    /// Secret holding the generated webhook CA and serving certificate.
    #[arg(
        long,
        env = "REGISTRAR_CERT_SECRET",
        default_value = "spiffe-registrar-webhook-tls"
    )]
    pub cert_secret: String,

    /// DNS names in the generated serving certificate (repeatable). Default:
    /// spiffe-registrar.<namespace>.svc.
    #[arg(
        long = "webhook-dns-name",
        env = "REGISTRAR_WEBHOOK_DNS_NAMES",
        value_delimiter = ','
    )]
    pub webhook_dns_names: Vec<String>,

    /// IP addresses in the generated serving certificate (repeatable).
    #[arg(
        long = "webhook-ip",
        env = "REGISTRAR_WEBHOOK_IPS",
        value_delimiter = ','
    )]
    pub webhook_ips: Vec<IpAddr>,

    /// Lifetime of the generated webhook CA. After 2/3 of it a new CA joins caBundle, signs
    /// once the apiserver trusts it, and the old one stays trusted until it expires.
    #[arg(long, env = "REGISTRAR_WEBHOOK_CA_VALIDITY", default_value = "43800h", value_parser = parse_duration)]
    pub webhook_ca_validity: Duration,

    /// Lifetime of generated serving certificates (renewed after 2/3), e.g. 2160h.
    #[arg(long, env = "REGISTRAR_SERVING_CERT_VALIDITY", default_value = "2160h", value_parser = parse_duration)]
    pub serving_cert_validity: Duration,

    #[command(flatten)]
    pub spire: SpireArgs,

    /// Entries per BatchCreateEntry/BatchUpdateEntry call.
    #[arg(long, env = "REGISTRAR_SPIRE_BATCH_SIZE", default_value_t = 100)]
    pub spire_batch_size: usize,

    /// Client-side limit of SPIRE requests per second (0: none).
    #[arg(long, env = "REGISTRAR_SPIRE_RPS", default_value_t = 50.0)]
    pub spire_rps: f64,

    /// Full resync with SPIRE (list our entries by hint) at least this often.
    #[arg(long, env = "REGISTRAR_RESYNC_INTERVAL", default_value = "5m", value_parser = parse_duration)]
    pub resync_interval: Duration,

    /// Lease duration for leader election: a new leader takes over within this after the
    /// old one dies.
    #[arg(long, env = "REGISTRAR_LEASE_DURATION", default_value = "15s", value_parser = parse_duration)]
    pub lease_duration: Duration,

    /// A leader that has not renewed its Lease for this long stops writing (its in-flight
    /// writes are cancelled). Must be shorter than --lease-duration by more than the longest
    /// single write (4 s).
    #[arg(long, env = "REGISTRAR_RENEW_DEADLINE", default_value = "10s", value_parser = parse_duration)]
    pub renew_deadline: Duration,

    /// Between attempts to acquire or renew the Lease.
    #[arg(long, env = "REGISTRAR_LEASE_RETRY_PERIOD", default_value = "2s", value_parser = parse_duration)]
    pub lease_retry_period: Duration,

    /// A leader that SPIRE has left unanswered for this long (counted from the start of the
    /// first unanswered call, so a stalled connection counts from the stall) releases the
    /// Lease, and competes again only once a probe of its SPIRE succeeds (so a replica that
    /// can reach SPIRE leads). With the other defaults: the Lease goes within 15 s of a stall.
    #[arg(long, env = "REGISTRAR_SPIRE_UNUSABLE_AFTER", default_value = "12s", value_parser = parse_duration)]
    pub spire_unusable_after: Duration,

    /// Identity of this replica in the Lease. Default: the pod name (HOSTNAME).
    #[arg(long, env = "HOSTNAME", default_value = "spiffe-registrar")]
    pub replica_id: String,

    /// Run the controller (leader-elected). `false` serves only the webhook, e.g. for a
    /// webhook-only deployment next to a controller deployment.
    #[arg(long, env = "REGISTRAR_CONTROLLER", default_value_t = true, action = clap::ArgAction::Set)]
    pub controller: bool,

    /// Log as JSON lines.
    #[arg(long, env = "REGISTRAR_LOG_JSON", default_value_t = false)]
    pub log_json: bool,
}

/// Where the registrar is installed; shared by `run` and `uninstall`.
#[derive(Args, Debug, Clone)]
pub struct InstallationArgs {
    /// Namespace the registrar runs in (its Secret and Lease live there).
    #[arg(long, env = "POD_NAMESPACE", default_value = "spiffe-registrar")]
    pub namespace: String,

    /// MutatingWebhookConfiguration whose caBundle the registrar keeps set to its CA.
    #[arg(
        long,
        env = "REGISTRAR_WEBHOOK_CONFIGURATION",
        default_value = "spiffe-registrar"
    )]
    pub webhook_configuration: String,
}

/// Which cluster's entries are ours; shared by `run`, `plan` and `uninstall`.
#[derive(Args, Debug, Clone)]
pub struct ClusterArgs {
    /// Name of this cluster; part of every entry ID and of the entry hint, so several clusters
    /// can share one SPIRE server. Lowercase letters, digits and '-'. Default: derived from the
    /// kube-system namespace's UID (`k-<12 hex digits>`), unique per cluster.
    #[arg(long, env = "REGISTRAR_CLUSTER_NAME")]
    pub cluster_name: Option<String>,

    /// Earlier cluster names (repeatable): their entries are migrated to this name in place
    /// (no gap) while needed and deleted when not. Only list names no other cluster still uses.
    #[arg(
        long = "previous-cluster-name",
        env = "REGISTRAR_PREVIOUS_CLUSTER_NAMES",
        value_delimiter = ','
    )]
    pub previous_cluster_names: Vec<String>,

    /// The name SPIRE's k8s_psat node attestor knows this cluster by (the key in the server's
    /// `clusters` map, the agents' `cluster` setting). Policies that leave parentID unset
    /// parent their entries to the node alias the registrar keeps for it, with the selector
    /// `k8s_psat:cluster:<name>`. Default: --cluster-name.
    #[arg(long, env = "REGISTRAR_NODE_ALIAS_CLUSTER")]
    pub node_alias_cluster: Option<String>,
}

impl ClusterArgs {
    /// Checks the names now, so a typo fails at start-up (the ownership is built once the
    /// name is known, see `run::ownership`).
    pub fn check(&self) -> Result<(), ConfigError> {
        self.ownership(self.cluster_name.as_deref().unwrap_or("x"))
            .map(|_| ())
    }

    /// Our entries' names under `cluster` (explicit or derived), with the previous names and
    /// the node alias.
    pub fn ownership(&self, cluster: &str) -> Result<Ownership, ConfigError> {
        let Self {
            cluster_name: _,
            previous_cluster_names,
            node_alias_cluster,
        } = self;
        let ownership = Ownership::new(cluster)?.with_previous(previous_cluster_names)?;
        Ok(match node_alias_cluster {
            Some(name) => ownership.with_node_alias_cluster(name)?,
            None => ownership,
        })
    }
}

/// How to reach SPIRE's Entry API; shared by `run`, `plan` and `uninstall`.
#[derive(Args, Debug, Clone)]
pub struct SpireArgs {
    /// SPIRE server admin socket (sidecar deployment). Exclusive with --spire-address.
    #[arg(long, env = "REGISTRAR_SPIRE_SOCKET", conflicts_with = "spire_address")]
    pub spire_socket: Option<PathBuf>,

    /// SPIRE server host:port over TCP with SPIFFE mTLS (our SVID from --workload-api).
    #[arg(long, env = "REGISTRAR_SPIRE_ADDRESS")]
    pub spire_address: Option<String>,

    /// SPIFFE ID the SPIRE server must present over TCP. Default: spiffe://<trust domain of
    /// our own SVID>/spire/server.
    #[arg(long, env = "REGISTRAR_SPIRE_SERVER_ID")]
    pub spire_server_id: Option<String>,

    /// SPIRE agent Workload API for our own SVID (TCP transport only).
    #[arg(
        long,
        env = "SPIFFE_ENDPOINT_SOCKET",
        default_value = "unix:///run/spire/agent-sockets/api.sock"
    )]
    pub workload_api: String,
}

impl SpireArgs {
    pub fn endpoint(self) -> Result<SpireEndpoint, ConfigError> {
        match (self.spire_socket, self.spire_address) {
            (Some(socket), None) => Ok(SpireEndpoint::Unix { socket }),
            (None, Some(address)) => Ok(SpireEndpoint::Tcp {
                address,
                server_id: self.spire_server_id.unwrap_or_default(),
                workload_api: self.workload_api,
            }),
            _ => Err(ConfigError::SpireTransport),
        }
    }
}

/// A workload kind with a Pod template, by name or plural, any case (bare Pods have a flag of
/// their own).
pub fn parse_kind(text: &str) -> Result<WorkloadKind, String> {
    WorkloadKind::parse(text.trim())
        .filter(|kind| WorkloadKind::ALL.contains(kind))
        .ok_or_else(|| {
            let known: Vec<_> = WorkloadKind::ALL.iter().map(|k| k.name()).collect();
            format!(
                "{text:?} is not a workload kind; known: {} (bare Pods: --bare-pods)",
                known.join(", ")
            )
        })
}

/// A `--custom-kind`, registered for the process's life (see `keys::custom`).
pub fn parse_custom_kind(text: &str) -> Result<WorkloadKind, String> {
    WorkloadKind::register_custom(text).map_err(|error| error.to_string())
}

/// A flag's duration, in the same grammar as the CRD's TTL (`policy::duration`): 90s, 15m,
/// 2160h, 1h30m.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    crate::policy::duration::parse_seconds(text)
        .map(Duration::from_secs)
        .ok_or_else(|| format!("{text:?} is not a duration like 30s, 5m, 1h or 1h30m"))
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    ClusterName(#[from] crate::spire::ownership::InvalidClusterName),
    #[error(transparent)]
    NodeAliasCluster(#[from] crate::spire::node_alias::InvalidNodeAliasCluster),
    #[error("invalid --namespace-label {0:?}: expected key=value")]
    NamespaceLabel(String),
    #[error("set exactly one of --spire-socket or --spire-address")]
    SpireTransport,
    #[error("--spire-batch-size must be between 1 and 1000, got {0}")]
    BatchSize(usize),
    #[error("--resync-interval must be at least 10s")]
    Resync,
    #[error("--workload-kinds names no kind")]
    NoWorkloadKinds,
    #[error("--deletion-brake-fraction must be between 0 and 1, got {0}")]
    BrakeFraction(f64),
    #[error("leader election flags: {0}")]
    Election(#[from] crate::leader::ElectionSettingsError),
}

/// Everything `run` needs, validated.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Our cluster name (`None`: derived from the cluster), previous names, node alias.
    pub cluster: ClusterArgs,
    pub decide: DecideSettings,
    pub opt_in: OptIn,
    /// Registered kinds, each once, in `WorkloadKind::ALL`'s order, then `Pod` with
    /// `--bare-pods`, then the custom kinds.
    pub workload_kinds: Vec<WorkloadKind>,
    pub webhook_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub certs: CertSource,
    pub spire: SpireEndpoint,
    pub client: ClientSettings,
    pub namespace: String,
    pub resync_interval: Duration,
    pub election: ElectionSettings,
    pub spire_unusable_after: Duration,
    pub replica_id: String,
    pub controller: bool,
}

/// Timeout of one Kubernetes write (patch, status, Event), so a write can never outlive the
/// leadership it was issued under (see `leader`).
pub const KUBE_WRITE_TIMEOUT: Duration = Duration::from_secs(4);

impl Settings {
    /// Our entries' names under `cluster` (explicit or derived), with the previous names and
    /// the node alias.
    pub fn ownership(&self, cluster: &str) -> Result<Ownership, ConfigError> {
        self.cluster.ownership(cluster)
    }
}

impl RunArgs {
    /// Every kind registered, each once: `--workload-kinds` in `WorkloadKind::ALL`'s order,
    /// `Pod` with `--bare-pods`, then the custom kinds.
    fn registered_kinds(&self) -> Result<Vec<WorkloadKind>, ConfigError> {
        let mut kinds = self.workload_kinds.clone();
        kinds.sort();
        kinds.dedup();
        if kinds.is_empty() {
            return Err(ConfigError::NoWorkloadKinds);
        }
        if self.bare_pods {
            kinds.push(WorkloadKind::Pod);
        }
        for kind in &self.custom_kinds {
            if !kinds.contains(kind) {
                kinds.push(*kind);
            }
        }
        Ok(kinds)
    }

    pub fn validate(self) -> Result<Settings, ConfigError> {
        self.cluster.check()?;
        let workload_kinds = self.registered_kinds()?;
        if !(0.0..=1.0).contains(&self.deletion_brake_fraction) {
            return Err(ConfigError::BrakeFraction(self.deletion_brake_fraction));
        }
        let opt_in = OptIn::parse(&self.namespace_label)
            .ok_or_else(|| ConfigError::NamespaceLabel(self.namespace_label.clone()))?;
        let certs = match (self.tls_cert_file, self.tls_key_file) {
            (Some(cert), Some(key)) => CertSource::Files { cert, key },
            _ => CertSource::Secret(SecretSettings {
                namespace: self.installation.namespace.clone(),
                name: self.cert_secret,
                webhook_configuration: self.installation.webhook_configuration,
                dns_names: if self.webhook_dns_names.is_empty() {
                    vec![format!(
                        "spiffe-registrar.{}.svc",
                        self.installation.namespace
                    )]
                } else {
                    self.webhook_dns_names
                },
                ips: self.webhook_ips,
                ca_lifetime: self.webhook_ca_validity,
                serving_lifetime: self.serving_cert_validity,
            }),
        };
        let spire = self.spire.endpoint()?;
        if !(1..=1000).contains(&self.spire_batch_size) {
            return Err(ConfigError::BatchSize(self.spire_batch_size));
        }
        if self.resync_interval < Duration::from_secs(10) {
            return Err(ConfigError::Resync);
        }
        let client = ClientSettings {
            create_batch: self.spire_batch_size,
            update_batch: self.spire_batch_size,
            requests_per_second: self.spire_rps,
            ..ClientSettings::default()
        };
        let election = ElectionSettings {
            namespace: self.installation.namespace.clone(),
            identity: self.replica_id.clone(),
            lease_duration: self.lease_duration,
            renew_deadline: self.renew_deadline,
            retry_period: self.lease_retry_period,
        };
        election.check(client.retry.call_timeout.max(KUBE_WRITE_TIMEOUT))?;
        Ok(Settings {
            cluster: self.cluster,
            decide: DecideSettings {
                transition_grace: self.transition_grace,
                scope_loss_grace: self.scope_loss_grace,
                brake_count: self.deletion_brake_count,
                brake_fraction: self.deletion_brake_fraction,
                adopt: self.adopt_equivalent_entries,
            },
            opt_in,
            workload_kinds,
            webhook_addr: self.webhook_addr,
            admin_addr: self.admin_addr,
            certs,
            spire,
            client,
            namespace: self.installation.namespace,
            resync_interval: self.resync_interval,
            election,
            spire_unusable_after: self.spire_unusable_after,
            replica_id: self.replica_id,
            controller: self.controller,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert!(
            parse_duration("30d").is_err(),
            "one grammar: the CRD has no days either"
        );
        assert!(parse_duration("1.5h").is_err());
        assert!(parse_duration("h").is_err());
        assert!(parse_duration("5").is_err());
    }

    #[test]
    fn workload_kinds_by_name_or_plural() {
        assert_eq!(parse_kind("StatefulSet"), Ok(WorkloadKind::StatefulSet));
        assert_eq!(parse_kind(" cronjobs"), Ok(WorkloadKind::CronJob));
        assert_eq!(parse_kind("job"), Ok(WorkloadKind::Job));
        let error = parse_kind("ReplicaSet").expect_err("not a workload kind");
        assert!(error.contains("Deployment, StatefulSet"), "{error}");
        assert!(parse_kind("Pod").is_err(), "bare Pods have --bare-pods");
    }
}
