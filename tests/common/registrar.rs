//! The registrar as its real binary, against the test stack.

use super::paths::free_port;
use super::process::{ManagedProcess, http_get_ok, run, wait_until};
use super::stack::Stack;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// The registrar binary: Cargo names it for integration tests; examples (benchmarks) find it
/// next to their own directory (`target/<profile>/examples/..`).
pub fn binary() -> std::path::PathBuf {
    if let Some(path) = option_env!("CARGO_BIN_EXE_spiffe-registrar") {
        return path.into();
    }
    let exe = std::env::current_exe().expect("current_exe must resolve");
    let path = exe
        .parent()
        .and_then(Path::parent)
        .map(|profile| profile.join("spiffe-registrar"))
        .expect("examples live under target/<profile>/examples");
    assert!(
        path.is_file(),
        "{} is missing: build it first (cargo build --release)",
        path.display()
    );
    path
}

pub struct Registrar {
    pub process: ManagedProcess,
    pub webhook_port: u16,
    pub admin_port: u16,
}

/// What differs between test registrars.
pub struct Options<'a> {
    /// Namespace of its Secret (and Lease); must exist.
    pub namespace: &'a str,
    pub webhook_configuration: &'a str,
    /// Empty: none given, the registrar derives one from the cluster.
    pub cluster_name: &'a str,
    /// Log name, unique per registrar in a test.
    pub name: &'a str,
    pub extra_args: Vec<String>,
    pub extra_env: Vec<(String, String)>,
}

impl Registrar {
    pub fn start(stack: &Stack, options: Options) -> Self {
        Self::start_full(stack, free_port(), &stack.kube.kubeconfig, options)
    }

    /// Starts it with its webhook on a port chosen beforehand (e.g. already in a webhook
    /// configuration).
    pub fn start_on(stack: &Stack, webhook_port: u16, options: Options) -> Self {
        Self::start_full(stack, webhook_port, &stack.kube.kubeconfig, options)
    }

    /// Runs it with other credentials than the admin's (e.g. a ServiceAccount token).
    pub fn start_with_kubeconfig(stack: &Stack, kubeconfig: &Path, options: Options) -> Self {
        Self::start_full(stack, free_port(), kubeconfig, options)
    }

    /// Full control: webhook port and credentials (e.g. another cluster's kubeconfig).
    pub fn start_full(
        stack: &Stack,
        webhook_port: u16,
        kubeconfig: &Path,
        options: Options,
    ) -> Self {
        let admin_port = free_port();
        let mut command = Command::new(binary());
        command
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "info,spiffe_registrar=debug")
            .env_remove("HOSTNAME")
            .arg("run")
            .args(
                (!options.cluster_name.is_empty())
                    .then(|| format!("--cluster-name={}", options.cluster_name)),
            )
            .arg(format!("--namespace={}", options.namespace))
            .arg(format!(
                "--webhook-configuration={}",
                options.webhook_configuration
            ))
            .arg(format!("--webhook-addr=127.0.0.1:{webhook_port}"))
            .arg(format!("--admin-addr=127.0.0.1:{admin_port}"))
            .arg("--webhook-ip=127.0.0.1")
            .arg(format!("--replica-id={}", options.name))
            .args(
                // A test may point a registrar at its own socket (a proxy it can cut).
                (!options
                    .extra_args
                    .iter()
                    .any(|a| a.starts_with("--spire-socket=")))
                .then(|| format!("--spire-socket={}", stack.spire_server.socket.display())),
            )
            .args(&options.extra_args)
            .envs(
                options
                    .extra_env
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str())),
            );
        let process = ManagedProcess::spawn(options.name, command, stack.dir());
        let mut registrar = Self {
            process,
            webhook_port,
            admin_port,
        };
        registrar.wait_ready();
        registrar
    }

    fn wait_ready(&mut self) {
        let port = self.admin_port;
        wait_until("registrar /readyz", Duration::from_secs(60), || {
            self.process.assert_running();
            http_get_ok(port, "/readyz")
        });
    }
}

/// `spiffe-registrar uninstall <args>` against the stack's apiserver; (ok, stdout, stderr).
pub fn uninstall(stack: &Stack, args: &[&str]) -> (bool, String, String) {
    run(Command::new(binary())
        .env("KUBECONFIG", &stack.kube.kubeconfig)
        .env("RUST_LOG", "info")
        .arg("uninstall")
        .args(args))
}
