//! Code generated from `proto/` at build time, in modules that mirror the proto packages (the
//! generated code refers across packages by relative paths). Only `convert.rs` touches these
//! types; the rest of the crate speaks `spire::types`.
#![allow(clippy::all, missing_docs)]

pub mod spire {
    pub mod api {
        pub mod types {
            tonic::include_proto!("spire.api.types");
        }
        pub mod server {
            pub mod entry {
                pub mod v1 {
                    tonic::include_proto!("spire.api.server.entry.v1");
                }
            }
        }
    }
}

pub use spire::api::server::entry::v1 as entry;
pub use spire::api::types;
