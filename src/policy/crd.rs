//! The `SpiffeRegistration` CRD: cluster-scoped policy saying which workloads get an identity
//! and how it is rendered. Generated YAML: `spiffe-registrar crd` (checked in under manifests/).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    Condition, LabelSelector, LabelSelectorRequirement,
};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Default SPIFFE ID template: one identity per (namespace, service account).
pub const DEFAULT_SPIFFE_ID_TEMPLATE: &str =
    "spiffe://{trustDomain}/ns/{namespace}/sa/{serviceAccount}";

/// Which workloads get a SPIFFE identity, and its shape. Workloads are in scope only in
/// namespaces carrying the registrar's opt-in label; the selectors and kinds narrow that
/// further.
#[allow(clippy::duplicated_attributes)] // kube's printcolumn(...) repeats keys by design
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "registrar.spiffe.io",
    version = "v1alpha1",
    kind = "SpiffeRegistration",
    shortname = "sreg",
    status = "SpiffeRegistrationStatus",
    printcolumn(
        name = "Trust Domain",
        type_ = "string",
        json_path = ".spec.trustDomain"
    ),
    printcolumn(
        name = "Workloads",
        type_ = "integer",
        json_path = ".status.selectedWorkloads"
    ),
    printcolumn(name = "Entries", type_ = "integer", json_path = ".status.entries"),
    printcolumn(
        name = "Pending",
        type_ = "integer",
        json_path = ".status.pendingDeletions"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new("!has(self.parentID) || self.parentID.startsWith('spiffe://' + self.trustDomain + '/')").message("parentID must be in trustDomain"))]
#[x_kube(validation = Rule::new("!(has(self.workloadSelector) && has(self.deploymentSelector))").message("set workloadSelector or its older name deploymentSelector, not both"))]
#[serde(rename_all = "camelCase")]
pub struct SpiffeRegistrationSpec {
    /// Trust domain of the SPIFFE IDs, e.g. `example.org` (no scheme).
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9._-]{1,255}$')").message("trustDomain: lowercase letters, digits, '.', '_', '-' only, no scheme"))]
    #[schemars(length(max = 255))]
    pub trust_domain: String,

    /// Parent ID of every entry. Unset: the node alias the registrar maintains for this
    /// cluster (`spiffe://<trustDomain>/spiffe-registrar/k8s-psat/<--node-alias-cluster>`,
    /// selector `k8s_psat:cluster:<name>`), which every agent attested by SPIRE's k8s_psat
    /// node attestor in this cluster holds. Set: an ID you maintain (every agent that should
    /// serve these workloads must be, or alias, this ID).
    #[serde(rename = "parentID", default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^spiffe://[a-z0-9._-]+(/[A-Za-z0-9._-]+)+$')").message("parentID must be a SPIFFE ID with a path"))]
    #[schemars(length(max = 2048))]
    pub parent_id: Option<String>,

    /// X.509-SVID lifetime, e.g. `1h` or `90m` (units h, m, s). Unset: the SPIRE server's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^([0-9]+[hms])+$') && duration(self) >= duration('1m') && duration(self) <= duration('720h')").message("ttl must be a duration from 1m to 720h, like 1h or 90m"))]
    #[schemars(length(max = 32))]
    pub ttl: Option<String>,

    /// JWT-SVID lifetime (same format). Unset: the SPIRE server's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^([0-9]+[hms])+$') && duration(self) >= duration('1m') && duration(self) <= duration('720h')").message("jwtTtl must be a duration from 1m to 720h, like 5m"))]
    #[schemars(length(max = 32))]
    pub jwt_ttl: Option<String>,

    /// Namespaces (already opted in by label) this policy applies to. Unset: all of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<PolicySelector>,

    /// Workloads (by their labels) this policy applies to, of every kind in `kinds`. A service
    /// account is governed by a policy when at least one of its workloads matches. Unset: all
    /// of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload_selector: Option<PolicySelector>,

    /// The older name of `workloadSelector`, with the same meaning (it selects workloads of
    /// every kind in `kinds`, not only Deployments). Set one or the other.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deployment_selector: Option<PolicySelector>,

    /// The kinds of workload this policy applies to, among Deployment, StatefulSet,
    /// DaemonSet, Job, CronJob, Pod (bare Pods, with `--bare-pods`) and the kinds configured
    /// with `--custom-kind` (by their kind, e.g. Rollout). Unset or empty: every kind the
    /// registrar registers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(validation = Rule::new("self.all(k, k.matches('^[A-Z][A-Za-z0-9]*$'))").message("kinds: each a kind's name, such as Deployment, StatefulSet, DaemonSet, Job, CronJob, Pod or a configured custom kind"))]
    #[schemars(length(max = 16), inner(length(max = 63)))]
    pub kinds: Vec<String>,

    /// When several policies match workloads of one service account, the highest priority
    /// wins, then the oldest policy, then the name. Default 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = -1000, max = 1000))]
    pub priority: Option<i32>,

    /// SPIFFE ID template; placeholders `{trustDomain}`, `{namespace}`, `{serviceAccount}`.
    /// `{namespace}` and `{serviceAccount}` must each appear exactly once, each as a whole path
    /// segment, namespace first, so two workloads never render the same ID.
    /// Default: `spiffe://{trustDomain}/ns/{namespace}/sa/{serviceAccount}`.
    #[serde(
        rename = "spiffeIDTemplate",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    #[x_kube(validation = Rule::new(TEMPLATE_RULE).message("spiffeIDTemplate: spiffe://<trust domain or {trustDomain}>/<segments>, with {namespace} and {serviceAccount} each exactly once as a whole path segment, namespace first"))]
    #[schemars(length(max = 2048))]
    pub spiffe_id_template: Option<String>,

    /// DNS names for the X.509-SVID; same placeholders as the SPIFFE ID template, each only as
    /// a whole DNS label (`{serviceAccount}.{namespace}.svc`), so a name chosen by a tenant can
    /// never add labels of its own.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), inner(length(max = 253), regex(pattern = DNS_TEMPLATE_PATTERN)))]
    pub dns_names: Vec<String>,

    /// Trust domains the entries federate with (each needs a bundle in SPIRE).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub federates_with: Vec<String>,
}

/// The SPIFFE ID template shape, checked by the apiserver (CEL, RE2) and again by
/// `render::check_template` for policies stored before this rule existed.
pub const TEMPLATE_RULE: &str = "self.matches('^spiffe://(\\\\{trustDomain\\\\}|[a-z0-9._-]+)(/([A-Za-z0-9._-]+|\\\\{namespace\\\\}|\\\\{serviceAccount\\\\}))+$') && self.matches('^[^{]*(\\\\{trustDomain\\\\}[^{]*)?/\\\\{namespace\\\\}/([^{]*/)?\\\\{serviceAccount\\\\}(/[^{]*)?$')";

/// A DNS name template: labels are literals or whole placeholders; at most one leading `*.`.
pub const DNS_TEMPLATE_PATTERN: &str = "^(\\*\\.)?((\\{trustDomain\\}|\\{namespace\\}|\\{serviceAccount\\}|[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)\\.)*(\\{trustDomain\\}|\\{namespace\\}|\\{serviceAccount\\}|[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)$";

/// A label selector as Kubernetes defines it, with the schema the apiserver enforces: a
/// misspelt operator, or `In`/`NotIn` without values, fails at `kubectl apply` instead of
/// silently matching nothing. Stored objects from before this schema still deserialize (the
/// operator is a plain string here) and are reported invalid by the controller.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PolicySelector {
    /// Labels that must all be present with these values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 64))]
    pub match_labels: BTreeMap<String, String>,
    /// Requirements that must all hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub match_expressions: Vec<SelectorRequirement>,
}

/// One requirement of a `PolicySelector`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[x_kube(validation = Rule::new("(self.operator == 'In' || self.operator == 'NotIn') ? (has(self.values) && size(self.values) > 0) : (!has(self.values) || size(self.values) == 0)").message("In and NotIn need at least one value; Exists and DoesNotExist take none"))]
pub struct SelectorRequirement {
    #[schemars(length(min = 1, max = 317))]
    pub key: String,
    /// One of In, NotIn, Exists, DoesNotExist.
    #[schemars(extend("enum" = ["In", "NotIn", "Exists", "DoesNotExist"]))]
    pub operator: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(max = 63)))]
    pub values: Vec<String>,
}

impl PolicySelector {
    /// The Kubernetes type, for kube's selector evaluation.
    pub fn to_label_selector(&self) -> LabelSelector {
        LabelSelector {
            match_labels: (!self.match_labels.is_empty()).then(|| self.match_labels.clone()),
            match_expressions: (!self.match_expressions.is_empty()).then(|| {
                self.match_expressions
                    .iter()
                    .map(|r| LabelSelectorRequirement {
                        key: r.key.clone(),
                        operator: r.operator.clone(),
                        values: (!r.values.is_empty()).then(|| r.values.clone()),
                    })
                    .collect()
            }),
        }
    }
}

/// What the controller observed when it last applied the policy.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SpiffeRegistrationStatus {
    /// `Ready`: True when every selected workload is registered; False with a reason otherwise.
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` these counts and conditions describe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Workloads of every kind running as the service accounts this policy governs (it
    /// selects at least one workload of each, and wins for it).
    #[serde(default)]
    pub selected_workloads: u32,
    /// The same, by kind (`Deployment: 3`, `CronJob: 1`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub workloads_by_kind: BTreeMap<String, u32>,
    /// SPIRE entries those workloads need (workloads sharing a service account share one).
    #[serde(default)]
    pub entries: u32,
    /// Service accounts this policy governs that have no entry: the policy cannot render
    /// their identity, or SPIRE refused it. The Ready condition carries the first reason.
    #[serde(default)]
    pub failures: u32,
    /// Entries of this policy waiting to be deleted (scope-loss or transition grace, or the
    /// deletion brake).
    #[serde(default)]
    pub pending_deletions: u32,
}

/// The CRD as YAML, exactly as committed under manifests/ (a test checks they match).
pub fn yaml() -> Result<String, serde_norway::Error> {
    use kube::CustomResourceExt;
    serde_norway::to_string(&SpiffeRegistration::crd())
}
