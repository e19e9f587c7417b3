//! Build identity, printed by `spiffe-registrar version` and logged at start-up so an operator
//! can tell from a log line which build made a decision.

/// The crate version this binary was built from.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// One line naming the program and its version.
pub fn describe() -> String {
    format!("spiffe-registrar {VERSION}")
}
