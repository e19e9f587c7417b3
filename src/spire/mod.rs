//! Everything that talks to SPIRE: our entry types, ownership (IDs and hint), the protobuf
//! conversion, and the Entry API client with its transports.
pub mod convert;
pub mod ownership;
pub mod proto;
pub mod types;
