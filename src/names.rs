//! Every name we write into the cluster, in one place (one prefix for everything).

/// Keeps a Deployment until its SPIRE entry is deleted (or still needed by a sibling).
pub const FINALIZER: &str = "registrar.spiffe.io/entry-cleanup";
/// The SPIFFE ID the workload gets, computed from policy (set by the webhook and the controller).
pub const SPIFFE_ID_ANNOTATION: &str = "registrar.spiffe.io/spiffe-id";
/// The SPIRE entry ID, set by the controller once the entry exists.
pub const ENTRY_ID_ANNOTATION: &str = "registrar.spiffe.io/entry-id";
/// Field manager for our writes.
pub const FIELD_MANAGER: &str = "spiffe-registrar";
/// The CRD; also where an operator confirms what the deletion brake holds.
pub const CRD_NAME: &str = "spifferegistrations.registrar.spiffe.io";
/// Annotation on the CRD confirming one set of held deletions (its token).
pub const CONFIRM_DELETIONS_ANNOTATION: &str = "registrar.spiffe.io/confirm-deletions";
