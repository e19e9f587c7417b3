//! Everything that talks to SPIRE.
//!
//! ```text
//! controller ──EntryApi (our types)──▶ GrpcEntryClient ──batches, retries, rate limit──▶ tonic
//!                                           │ convert.rs (the only protobuf-aware code)
//!                                           └ transport.rs: admin UDS | TCP + SPIFFE mTLS
//! ```
pub mod api;
pub mod client;
pub mod convert;
// The in-memory SPIRE of unit tests; never in the release binary.
#[cfg(test)]
pub mod memory;
pub mod metrics;
pub mod node_alias;
pub mod ownership;
pub mod proto;
pub mod rate_limit;
pub mod results;
pub mod retry;
pub mod transport;
pub mod types;

pub use api::{EntryApi, SpireError};
pub use client::{ClientSettings, GrpcEntryClient};
pub use ownership::Ownership;
pub use transport::{SpireEndpoint, connect};
pub use types::{Entry, ItemError, MutableField, Selector};
