//! The `SpiffeRegistration` CRD: cluster-scoped policy saying which Deployments get an identity
//! and how it is rendered. Generated YAML: `spiffe-registrar crd` (checked in under manifests/).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// Default SPIFFE ID template: one identity per (namespace, service account).
pub const DEFAULT_SPIFFE_ID_TEMPLATE: &str =
    "spiffe://{trustDomain}/ns/{namespace}/sa/{serviceAccount}";

/// Which Deployments get a SPIFFE identity, and its shape. Deployments are in scope only in
/// namespaces carrying the registrar's opt-in label; the selectors narrow that further.
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
#[x_kube(validation = Rule::new("self.parentID.startsWith('spiffe://' + self.trustDomain + '/')").message("parentID must be in trustDomain"))]
#[serde(rename_all = "camelCase")]
pub struct SpiffeRegistrationSpec {
    /// Trust domain of the SPIFFE IDs, e.g. `example.org` (no scheme).
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9._-]{1,255}$')").message("trustDomain: lowercase letters, digits, '.', '_', '-' only, no scheme"))]
    #[schemars(length(max = 255))]
    pub trust_domain: String,

    /// Parent ID of every entry, e.g. the SPIFFE ID of a node-alias entry for this cluster.
    #[serde(rename = "parentID")]
    #[x_kube(validation = Rule::new("self.matches('^spiffe://[a-z0-9._-]+(/[A-Za-z0-9._-]+)+$')").message("parentID must be a SPIFFE ID with a path"))]
    #[schemars(length(max = 2048))]
    pub parent_id: String,

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
    pub namespace_selector: Option<LabelSelector>,

    /// Deployments (by their labels) this policy applies to. Unset: all of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deployment_selector: Option<LabelSelector>,

    /// SPIFFE ID template; placeholders `{trustDomain}`, `{namespace}`, `{serviceAccount}`.
    /// Default: `spiffe://{trustDomain}/ns/{namespace}/sa/{serviceAccount}`.
    #[serde(
        rename = "spiffeIDTemplate",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(length(max = 2048))]
    pub spiffe_id_template: Option<String>,

    /// DNS names for the X.509-SVID; same placeholders as the SPIFFE ID template.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dns_names: Vec<String>,

    /// Trust domains the entries federate with (each needs a bundle in SPIRE).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub federates_with: Vec<String>,
}

/// What the controller observed when it last applied the policy.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SpiffeRegistrationStatus {
    /// `Ready`: True when every selected Deployment is registered; False with a reason otherwise.
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` these counts and conditions describe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Deployments this policy selects (and wins for).
    #[serde(default)]
    pub selected_workloads: u32,
    /// SPIRE entries those Deployments need (Deployments sharing a service account share one).
    #[serde(default)]
    pub entries: u32,
    /// Entries that could not be written in the last sync.
    #[serde(default)]
    pub failures: u32,
}

/// The CRD as YAML, exactly as committed under manifests/ (a test checks they match).
pub fn yaml() -> Result<String, serde_yaml::Error> {
    use kube::CustomResourceExt;
    serde_yaml::to_string(&SpiffeRegistration::crd())
}
