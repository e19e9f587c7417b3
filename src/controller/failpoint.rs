//! Named crash points for crash-consistency and supervision tests.

/// `SPIFFE_REGISTRAR_FAILPOINT=<name>`: true where the named point is armed. Unset in
/// production; read once.
pub fn failpoint(name: &str) -> bool {
    static FAILPOINT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    FAILPOINT
        .get_or_init(|| std::env::var("SPIFFE_REGISTRAR_FAILPOINT").ok())
        .as_deref()
        == Some(name)
}
