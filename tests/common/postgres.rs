//! A throwaway PostgreSQL server for spire-server's datastore (`Datastore::Postgres`): the
//! datastore production uses, so the physical limit of a benchmark is measured on it.
//! Debian's package (installed by `tests/testenv/postgres.sh` where missing), one cluster per
//! test bed in its own directory, reachable only over its Unix socket, gone with the bed.

use super::process::{ManagedProcess, run, wait_until};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Where spire-server keeps its entries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Datastore {
    /// As SPIRE ships it.
    #[default]
    Sqlite,
    /// SQLite with query-planner statistics written after SPIRE has made its tables (see
    /// tests/testenv/sqlite-planner-statistics.sql): what `ANALYZE` on a populated datastore
    /// gives an operator.
    SqliteAnalyzed,
    Postgres,
}

impl Datastore {
    pub fn name(self) -> &'static str {
        match self {
            Datastore::Sqlite => "sqlite",
            Datastore::SqliteAnalyzed => "sqlite-analyzed",
            Datastore::Postgres => "postgres",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        [Self::Sqlite, Self::SqliteAnalyzed, Self::Postgres]
            .into_iter()
            .find(|d| d.name() == name)
    }
}

pub struct Postgres {
    pub process: ManagedProcess,
    /// The socket directory (also the data directory's parent).
    socket_dir: PathBuf,
    port: u16,
    _dir: tempfile::TempDir,
}

/// The server refuses to run as root: when we are root it runs as the package's `postgres`
/// user, which must own its directory.
fn run_as() -> Option<(u32, u32)> {
    if !nix::unistd::Uid::effective().is_root() {
        return None;
    }
    let user = nix::unistd::User::from_name("postgres")
        .ok()
        .flatten()
        .expect("Debian's postgresql package creates the postgres user");
    Some((user.uid.as_raw(), user.gid.as_raw()))
}

fn bin_dir() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/testenv/postgres.sh");
    let (ok, stdout, stderr) = run(Command::new("bash").arg(script));
    assert!(ok, "tests/testenv/postgres.sh failed:\n{stderr}");
    PathBuf::from(
        stdout
            .lines()
            .last()
            .expect("the script prints the bin dir")
            .trim(),
    )
}

fn command(bin: &Path, program: &str, user: Option<(u32, u32)>) -> Command {
    let mut command = Command::new(bin.join(program));
    if let Some((uid, gid)) = user {
        command.uid(uid).gid(gid);
    }
    command
}

impl Postgres {
    /// Starts a fresh cluster with a `spire` database; ready when this returns.
    pub fn start(log_dir: &Path) -> Self {
        let bin = bin_dir();
        let user = run_as();
        let dir = tempfile::Builder::new()
            .prefix("sr-pg-")
            .tempdir_in("/tmp")
            .expect("a temp dir must be creatable");
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))
                .expect("chown of the postgres directory");
        }
        let data = dir.path().join("data");
        let (ok, stdout, stderr) = run(command(&bin, "initdb", user)
            .args([
                "--auth=trust",
                "--username=postgres",
                "--no-sync",
                "--encoding=UTF8",
            ])
            .arg("-D")
            .arg(&data));
        assert!(ok, "initdb failed:\n{stdout}\n{stderr}");
        let port = super::paths::free_port();
        let mut server = command(&bin, "postgres", user);
        server
            .arg("-D")
            .arg(&data)
            .arg("-k")
            .arg(dir.path())
            .args(["-p", &port.to_string()])
            // Unix socket only; durability as a production server would have it.
            .args(["-c", "listen_addresses=", "-c", "max_connections=200"]);
        let mut process = ManagedProcess::spawn("postgres", server, log_dir);
        let socket_dir = dir.path().to_path_buf();
        let created = || {
            run(command(&bin, "createdb", user)
                .args(["-h"])
                .arg(&socket_dir)
                .args(["-p", &port.to_string(), "-U", "postgres", "spire"]))
            .0
        };
        wait_until(
            "postgres to accept connections",
            Duration::from_secs(60),
            || {
                process.assert_running();
                created()
            },
        );
        Self {
            process,
            socket_dir,
            port,
            _dir: dir,
        }
    }

    /// spire-server's `connection_string` for the `spire` database.
    pub fn connection_string(&self) -> String {
        format!(
            "dbname=spire user=postgres host={} port={} sslmode=disable",
            self.socket_dir.display(),
            self.port
        )
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.process.stop(Duration::from_secs(10));
    }
}
