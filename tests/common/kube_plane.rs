//! etcd + kube-apiserver + kube-controller-manager on loopback, with an admin kubeconfig.
//!
//! kube-controller-manager runs the controllers of every workload kind (deployment, replicaset,
//! statefulset, daemonset, job, cronjob, ttl-after-finished) with node-lifecycle, namespace and
//! garbage-collector, so tests see what a real cluster does to workloads: status rewritten on
//! every rollout step, ReplicaSets, Jobs and Pods created (Pending unless the stack has a node,
//! `node.rs`), finished Jobs deleted by their TTL, and namespaces deleted by the namespace
//! controller.

use super::certs::TestCa;
use super::paths::{binary, free_port, kube_bin};
use super::process::{ManagedProcess, http_get_ok, run, wait_until};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

pub struct KubePlane {
    pub etcd: ManagedProcess,
    pub apiserver: ManagedProcess,
    pub controller_manager: ManagedProcess,
    pub url: String,
    pub kubeconfig: PathBuf,
    /// PEM of the CA that signed the apiserver's serving cert and the admin client cert.
    pub ca_pem: String,
    /// That CA, which the apiserver trusts for client certificates (a node's, for one).
    pub ca: TestCa,
}

impl KubePlane {
    pub fn start(dir: &Path) -> Self {
        let certs = dir.join("kube-certs");
        std::fs::create_dir_all(&certs).expect("cert dir must be creatable");
        let ca = TestCa::new("spiffe-registrar-test-ca");
        let serving = ca.server("kube-apiserver");
        let admin = ca.client("admin", Some("system:masters"));
        let sa_key = rcgen::KeyPair::generate().expect("key generation must work");
        let write = |name: &str, pem: &str| {
            let path = certs.join(name);
            std::fs::write(&path, pem).expect("cert file must be writable");
            path
        };
        let ca_file = write("ca.crt", &ca.cert_pem);
        let tls_cert = write("apiserver.crt", &serving.cert_pem);
        let tls_key = write("apiserver.key", &serving.key_pem);
        let sa_key_file = write("sa.key", &sa_key.serialize_pem());
        let sa_pub_file = write("sa.pub", &sa_key.public_key_pem());

        let etcd = start_etcd(dir);
        let etcd_url = etcd.1;
        let port = free_port();
        let url = format!("https://127.0.0.1:{port}");
        let mut command = Command::new(binary(kube_bin(), "kube-apiserver"));
        command.args([
            format!("--etcd-servers={etcd_url}"),
            format!("--cert-dir={}", certs.display()),
            format!("--tls-cert-file={}", tls_cert.display()),
            format!("--tls-private-key-file={}", tls_key.display()),
            format!("--client-ca-file={}", ca_file.display()),
            format!("--secure-port={port}"),
            "--bind-address=127.0.0.1".into(),
            // No default route in the sandbox: without these two the apiserver either cannot
            // pick an advertise address or fights the loopback Endpoints validation.
            "--advertise-address=127.0.0.1".into(),
            "--endpoint-reconciler-type=none".into(),
            "--service-cluster-ip-range=10.0.0.0/24".into(),
            "--allow-privileged=true".into(),
            // The node registers as 127.0.0.1; its name does not resolve.
            "--kubelet-preferred-address-types=InternalIP,Hostname".into(),
            // No kube-controller-manager runs, so nobody would create `default` ServiceAccounts.
            "--disable-admission-plugins=ServiceAccount".into(),
            "--authorization-mode=RBAC".into(),
            format!("--service-account-issuer={url}/"),
            format!("--service-account-key-file={}", sa_pub_file.display()),
            format!(
                "--service-account-signing-key-file={}",
                sa_key_file.display()
            ),
        ]);
        let apiserver = ManagedProcess::spawn("kube-apiserver", command, dir);

        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            kubeconfig_yaml(&url, &ca.cert_pem, &admin.cert_pem, &admin.key_pem),
        )
        .expect("kubeconfig must be writable");

        let mut apiserver = apiserver;
        wait_apiserver(&mut apiserver, &kubeconfig);
        let controller_manager = start_controller_manager(dir, &kubeconfig);
        let mut plane = Self {
            etcd: etcd.0,
            apiserver,
            controller_manager,
            url,
            kubeconfig,
            ca_pem: ca.cert_pem.clone(),
            ca,
        };
        plane.wait_ready();
        plane
    }

    /// Ready when kube-controller-manager holds its Lease (its controllers start right after).
    fn wait_ready(&mut self) {
        let kubeconfig = self.kubeconfig.clone();
        wait_until(
            "kube-controller-manager to lead",
            Duration::from_secs(60),
            || {
                self.controller_manager.assert_running();
                let (ok, out, _) = run(kubectl_command(&kubeconfig).args([
                    "-n",
                    "kube-system",
                    "get",
                    "lease",
                    "kube-controller-manager",
                    "-o",
                    "jsonpath={.spec.holderIdentity}",
                ]));
                ok && !out.trim().is_empty()
            },
        );
    }

    pub fn kubectl(&self) -> Command {
        kubectl_command(&self.kubeconfig)
    }

    /// A client authenticated as the admin (`system:masters`).
    pub async fn client(&self) -> kube::Client {
        client_for(&self.kubeconfig).await
    }

    pub fn stop(&mut self) {
        self.controller_manager.stop(Duration::from_secs(10));
        self.apiserver.stop(Duration::from_secs(10));
        self.etcd.stop(Duration::from_secs(10));
    }
}

/// A client from a kubeconfig file (for set-up threads that only have the path).
pub async fn client_for(kubeconfig: &Path) -> kube::Client {
    let kubeconfig =
        kube::config::Kubeconfig::read_from(kubeconfig).expect("the test kubeconfig must parse");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .expect("the test kubeconfig must yield a client config");
    kube::Client::try_from(config).expect("a client must build from the test kubeconfig")
}

pub fn kubectl_command(kubeconfig: &Path) -> Command {
    let mut command = Command::new(binary(kube_bin(), "kubectl"));
    command.env("KUBECONFIG", kubeconfig);
    command
}

fn wait_apiserver(apiserver: &mut ManagedProcess, kubeconfig: &Path) {
    wait_until("kube-apiserver /readyz", Duration::from_secs(90), || {
        apiserver.assert_running();
        run(kubectl_command(kubeconfig).args(["get", "--raw", "/readyz"])).0
    });
    // The apiserver creates the system namespaces itself, shortly after it is ready.
    wait_until("namespace default", Duration::from_secs(30), || {
        run(kubectl_command(kubeconfig).args(["get", "namespace", "default"])).0
    });
}

/// The controllers a workload's life touches. Client rate limits are raised from the
/// defaults (20/s) so thousands of Deployments settle in test time on loopback.
fn start_controller_manager(dir: &Path, kubeconfig: &Path) -> ManagedProcess {
    let mut command = Command::new(binary(kube_bin(), "kube-controller-manager"));
    command.args([
        format!("--kubeconfig={}", kubeconfig.display()),
        "--controllers=deployment-controller,replicaset-controller,statefulset-controller,daemonset-controller,job-controller,cronjob-controller,ttl-after-finished-controller,namespace-controller,garbage-collector-controller,node-lifecycle-controller".into(),
        "--secure-port=0".into(),
        "--leader-elect=true".into(),
        // It is the only candidate: a long term keeps it leading while 50,000 Deployments hold
        // the apiserver busy for minutes (at the defaults, 15 s / 10 s, it lost its Lease and
        // exited mid-benchmark on a slow machine).
        "--leader-elect-lease-duration=120s".into(),
        "--leader-elect-renew-deadline=100s".into(),
        "--leader-elect-retry-period=5s".into(),
        "--kube-api-qps=500".into(),
        "--kube-api-burst=1000".into(),
        "--concurrent-deployment-syncs=10".into(),
        "--concurrent-replicaset-syncs=10".into(),
    ]);
    ManagedProcess::spawn("kube-controller-manager", command, dir)
}

fn start_etcd(dir: &Path) -> (ManagedProcess, String) {
    let client_port = free_port();
    let peer_port = free_port();
    let client_url = format!("http://127.0.0.1:{client_port}");
    let peer_url = format!("http://127.0.0.1:{peer_port}");
    let mut command = Command::new(binary(kube_bin(), "etcd"));
    command.args([
        "--name=default".to_string(),
        format!("--data-dir={}", dir.join("etcd-data").display()),
        format!("--listen-client-urls={client_url}"),
        format!("--advertise-client-urls={client_url}"),
        format!("--listen-peer-urls={peer_url}"),
        format!("--initial-advertise-peer-urls={peer_url}"),
        format!("--initial-cluster=default={peer_url}"),
        // Test data is thrown away; fsync only costs time.
        "--unsafe-no-fsync=true".into(),
        // 50,000 Deployments with their ReplicaSets and Pods outgrow etcd's default 2 GiB
        // quota ("mvcc: database space exceeded"); 8 GiB is etcd's suggested maximum.
        "--quota-backend-bytes=8589934592".into(),
    ]);
    let mut etcd = ManagedProcess::spawn("etcd", command, dir);
    wait_until("etcd /health", Duration::from_secs(30), || {
        etcd.assert_running();
        http_get_ok(client_port, "/health")
    });
    (etcd, client_url)
}

pub fn kubeconfig_yaml(url: &str, ca_pem: &str, cert_pem: &str, key_pem: &str) -> String {
    use base64_pem as b64;
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {url}\n    \
         certificate-authority-data: {}\nusers:\n- name: admin\n  user:\n    client-certificate-data: {}\n    \
         client-key-data: {}\ncontexts:\n- name: test\n  context:\n    cluster: test\n    user: admin\n\
         current-context: test\n",
        b64(ca_pem),
        b64(cert_pem),
        b64(key_pem)
    )
}

fn base64_pem(pem: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(pem)
}
