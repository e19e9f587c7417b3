//! `Datastore::SqliteAnalyzed`: spire-server's SQLite datastore with query-planner statistics
//! (tests/testenv/sqlite-planner-statistics.sql says why), written with Debian's sqlite3 shell
//! (installed by tests/testenv/sqlite3.sh where missing) while the server runs.

use super::process::run;
use std::path::Path;
use std::process::{Command, Stdio};

pub fn write_planner_statistics(database: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/testenv");
    let (ok, stdout, stderr) = run(Command::new("bash").arg(root.join("sqlite3.sh")));
    assert!(ok, "tests/testenv/sqlite3.sh failed:\n{stderr}");
    let shell = stdout
        .lines()
        .last()
        .expect("the script prints the path")
        .trim();
    let script = std::fs::File::open(root.join("sqlite-planner-statistics.sql"))
        .expect("the statistics script is in the repository");
    let output = Command::new(shell)
        .arg("-bail")
        .arg(database)
        .stdin(Stdio::from(script))
        .output()
        .expect("sqlite3 must start");
    assert!(
        output.status.success(),
        "writing planner statistics into {} failed: {}",
        database.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    // SPIRE's connections reload statistics with the schema (sqlite_stat1 is new to it).
    let (ok, stats, _) = run(Command::new(shell)
        .arg(database)
        .arg("SELECT stat FROM sqlite_stat1 WHERE idx = 'idx_registered_entries_spiffe_id'"));
    assert!(ok && !stats.trim().is_empty(), "no statistics were stored");
}
