//! spiffe-registrar: gives every in-scope Kubernetes Deployment a SPIFFE identity by keeping
//! SPIRE registration entries in step with the cluster (see `../shared/DESIGN.md` for the flow).
#![forbid(unsafe_code)]

pub mod spire;
pub mod version;
