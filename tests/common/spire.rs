//! spire-server (SQLite or PostgreSQL, join_token, admin UDS + loopback TCP) and one attested
//! spire-agent.

use super::paths::{binary, free_port, spire_bin};
use super::process::{ManagedProcess, run, wait_until};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

pub const TRUST_DOMAIN: &str = "example.org";

pub struct SpireServer {
    pub process: ManagedProcess,
    pub socket: PathBuf,
    pub port: u16,
    config: PathBuf,
    dir: PathBuf,
}

impl SpireServer {
    /// The SQLite datastore's file (when it runs on SQLite).
    pub fn sqlite_database(&self) -> PathBuf {
        self.dir.join("data/datastore.sqlite3")
    }

    /// A server on SQLite whose agents attest by join token only.
    pub fn start(dir: &Path) -> Self {
        Self::start_with(dir, None, None)
    }

    /// Starts the server on `postgres` when given, else on SQLite in its data directory. Agents
    /// attest by join token, and with `kubeconfig` (the bed's apiserver) by `k8s_psat` too.
    pub fn start_with(
        dir: &Path,
        postgres: Option<&super::postgres::Postgres>,
        kubeconfig: Option<&Path>,
    ) -> Self {
        let dir = dir.join("ss");
        std::fs::create_dir_all(&dir).expect("spire-server dir must be creatable");
        let socket = dir.join("api.sock");
        let port = free_port();
        let config = dir.join("server.conf");
        let data = dir.join("data");
        let (database_type, connection_string) = match postgres {
            Some(postgres) => ("postgres", postgres.connection_string()),
            None => ("sqlite3", format!("{}/datastore.sqlite3", data.display())),
        };
        // KeyManager "disk" keeps the CA across restarts, so the agent stays attested when a
        // test kills and restarts the server.
        std::fs::write(
            &config,
            format!(
                r#"server {{
  bind_address = "127.0.0.1"
  bind_port = "{port}"
  socket_path = "{socket}"
  trust_domain = "{TRUST_DOMAIN}"
  data_dir = "{data}"
  log_level = "DEBUG"
}}
plugins {{
  DataStore "sql" {{
    plugin_data {{
      database_type = "{database_type}"
      connection_string = "{connection_string}"
    }}
  }}
  NodeAttestor "join_token" {{
    plugin_data {{}}
  }}
{psat}  KeyManager "disk" {{
    plugin_data {{
      keys_path = "{data}/keys.json"
    }}
  }}
}}
"#,
                socket = socket.display(),
                data = data.display(),
                psat = kubeconfig.map(psat_attestor).unwrap_or_default(),
            ),
        )
        .expect("server.conf must be writable");
        let process = spawn_server(&config, &dir);
        let mut server = Self {
            process,
            socket,
            port,
            config,
            dir,
        };
        server.wait_ready();
        server
    }

    fn wait_ready(&mut self) {
        wait_until("spire-server healthcheck", Duration::from_secs(60), || {
            self.process.assert_running();
            run(&mut self.cli(&["healthcheck"])).0
        });
    }

    /// `spire-server <subcommand…> -socketPath <admin socket>`.
    pub fn cli(&self, subcommand: &[&str]) -> Command {
        let mut command = Command::new(binary(spire_bin(), "spire-server"));
        command
            .args(subcommand)
            .arg("-socketPath")
            .arg(&self.socket);
        command
    }

    /// Runs a CLI command, panicking with its output when it fails.
    pub fn cli_ok(&self, subcommand: &[&str], extra: &[&str]) -> String {
        let (ok, stdout, stderr) = run(self.cli(subcommand).args(extra));
        assert!(
            ok,
            "spire-server {subcommand:?} {extra:?} failed:\n{stdout}\n{stderr}"
        );
        stdout
    }

    /// Entries matching the CLI filter `args` (e.g. `-spiffeID x`), as SPIRE's JSON.
    pub fn entries(&self, args: &[&str]) -> Vec<serde_json::Value> {
        let (ok, stdout, stderr) = run(self
            .cli(&["entry", "show"])
            .args(args)
            .args(["-output", "json"]));
        let absent =
            |text: &str| text.contains("Found 0 entries") || text.contains("code = NotFound");
        if !ok && (absent(&stdout) || absent(&stderr)) {
            return Vec::new();
        }
        assert!(ok, "entry show {args:?} failed:\n{stdout}\n{stderr}");
        let value: serde_json::Value = serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("entry show JSON: {e}: {stdout}"));
        value["entries"].as_array().cloned().unwrap_or_default()
    }

    /// Kills the server (SIGKILL) without touching its data: a crash.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// Starts the server again on the same config, data, socket and port.
    pub fn restart(&mut self) {
        self.process.stop(Duration::from_secs(10));
        self.process = spawn_server(&self.config, &self.dir);
        self.wait_ready();
    }

    pub fn stop(&mut self) {
        self.process.stop(Duration::from_secs(10));
    }
}

/// The `k8s_psat` node attestor for the bed's cluster: agents of service account
/// spire/spire-agent, their tokens reviewed by the apiserver behind `kubeconfig`.
fn psat_attestor(kubeconfig: &Path) -> String {
    format!(
        r#"  NodeAttestor "k8s_psat" {{
    plugin_data {{
      clusters = {{
        "{cluster}" = {{
          service_account_allow_list = ["spire:spire-agent"]
          kube_config_file = "{kubeconfig}"
        }}
      }}
    }}
  }}
"#,
        cluster = super::node_agent::PSAT_CLUSTER,
        kubeconfig = kubeconfig.display(),
    )
}

fn spawn_server(config: &Path, log_dir: &Path) -> ManagedProcess {
    let mut command = Command::new(binary(spire_bin(), "spire-server"));
    command.arg("run").arg("-config").arg(config);
    ManagedProcess::spawn("spire-server", command, log_dir)
}

pub struct SpireAgent {
    pub process: ManagedProcess,
    /// The agent's Workload API socket.
    pub socket: PathBuf,
    /// `spiffe://<td>/spire/agent/join_token/<token>`: the parent ID for test entries.
    pub agent_id: String,
}

impl SpireAgent {
    pub fn start(dir: &Path, server: &SpireServer) -> Self {
        let dir = dir.join("sa");
        std::fs::create_dir_all(&dir).expect("spire-agent dir must be creatable");
        let bundle = dir.join("bundle.pem");
        std::fs::write(&bundle, server.cli_ok(&["bundle", "show"], &[]))
            .expect("bundle must be writable");
        let token_output = server.cli_ok(&["token", "generate"], &["-ttl", "600"]);
        let token = token_output
            .lines()
            .find_map(|line| line.strip_prefix("Token: "))
            .unwrap_or_else(|| panic!("no token in `token generate` output: {token_output}"))
            .trim()
            .to_string();
        let socket = dir.join("api.sock");
        let config = dir.join("agent.conf");
        std::fs::write(
            &config,
            format!(
                r#"agent {{
  data_dir = "{data}"
  log_level = "DEBUG"
  server_address = "127.0.0.1"
  server_port = "{port}"
  socket_path = "{socket}"
  trust_bundle_path = "{bundle}"
  trust_domain = "{TRUST_DOMAIN}"
  join_token = "{token}"
}}
plugins {{
  NodeAttestor "join_token" {{
    plugin_data {{}}
  }}
  KeyManager "disk" {{
    plugin_data {{
      directory = "{data}"
    }}
  }}
  WorkloadAttestor "unix" {{
    plugin_data {{}}
  }}
}}
"#,
                data = dir.join("data").display(),
                port = server.port,
                socket = socket.display(),
                bundle = bundle.display(),
            ),
        )
        .expect("agent.conf must be writable");
        let mut command = Command::new(binary(spire_bin(), "spire-agent"));
        command.arg("run").arg("-config").arg(&config);
        let mut process = ManagedProcess::spawn("spire-agent", command, &dir);
        wait_until("spire-agent healthcheck", Duration::from_secs(60), || {
            process.assert_running();
            run(Command::new(binary(spire_bin(), "spire-agent"))
                .args(["healthcheck", "-socketPath"])
                .arg(&socket))
            .0
        });
        let agent_id = format!("spiffe://{TRUST_DOMAIN}/spire/agent/join_token/{token}");
        Self {
            process,
            socket,
            agent_id,
        }
    }

    /// `spire-agent api fetch x509` against this agent; stdout on success.
    pub fn fetch_x509(&self) -> Option<String> {
        let (ok, stdout, _) = run(Command::new(binary(spire_bin(), "spire-agent"))
            .args(["api", "fetch", "x509", "-socketPath"])
            .arg(&self.socket));
        ok.then_some(stdout)
    }

    pub fn stop(&mut self) {
        self.process.stop(Duration::from_secs(10));
    }
}
