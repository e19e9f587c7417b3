//! A real node for the bed: containerd (runc with seccomp, the CNI bridge), a kubelet registered
//! with the bed's apiserver as `system:node:bed-node`, and kube-scheduler, with the bed's images
//! imported. Started on request: tests that run no Pod never pay for it.
//!
//! ```text
//!  kube-apiserver ◀── kubelet (127.0.0.1, webhook authn/authz) ──CRI──▶ containerd ──▶ shim ──▶ runc
//!        ▲                                                                │
//!  kube-scheduler (binds Pods to bed-node)                    CNI bridge registrar-bed0
//! ```
//! Everything lives under `<bed>/node`, except what the kubelet and containerd write elsewhere
//! whatever they are told (`/var/lib/kubelet/device-plugins`, `/var/log/containers` links,
//! `/run/containerd/{runc,s}`, the CNI cache under `/var/lib/cni`, the bridge, `kubepods`
//! cgroups). `teardown.sh`, written at start, removes exactly those, by PID and by exact path;
//! `Node::stop` runs it, and so does the stack's sentinel when the test binary dies.

use super::kube_plane::{KubePlane, kubeconfig_yaml};
use super::paths::{bed_images, binary, cni_bin, containerd_bin, free_port, kube_bin, runc_bin};
use super::process::{ManagedProcess, run, wait_until};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The node's name in the cluster.
pub const NODE_NAME: &str = "bed-node";
/// The CNI network and its bridge.
const NETWORK: &str = "registrar-bed";
const BRIDGE: &str = "registrar-bed0";
/// Image references inside the node (imported from `bed_images()`, never pulled).
pub const PAUSE_IMAGE: &str = "registrar-bed/pause:1";
pub const WORKLOAD_IMAGE: &str = "registrar-bed/workload:1";

pub struct Node {
    pub containerd: ManagedProcess,
    pub kubelet: ManagedProcess,
    pub scheduler: ManagedProcess,
    /// `<bed>/node`.
    pub dir: PathBuf,
    /// The kubelet's secure port (the SPIRE agent's k8s workload attestor talks to it).
    pub kubelet_port: u16,
    teardown: PathBuf,
}

impl Node {
    /// Starts containerd, imports the images, starts the kubelet and kube-scheduler, and waits
    /// until the node is Ready.
    pub fn start(bed: &Path, kube: &KubePlane) -> Self {
        let dir = bed.join("node");
        for sub in [
            "containerd",
            "kubelet",
            "pod-logs",
            "cni/net.d",
            "cni/ipam",
            "certs",
        ] {
            std::fs::create_dir_all(dir.join(sub)).expect("node dirs must be creatable");
        }
        let containerd = start_containerd(&dir);
        import_images(&dir);
        let kubelet_port = free_port();
        let kubelet = start_kubelet(&dir, kube, kubelet_port);
        let scheduler = start_scheduler(&dir, &kube.kubeconfig);
        let teardown = dir.join("teardown.sh");
        let mut node = Self {
            containerd,
            kubelet,
            scheduler,
            dir,
            kubelet_port,
            teardown,
        };
        node.write_teardown();
        node.wait_ready(kube);
        node
    }

    pub fn pgids(&self) -> Vec<i32> {
        vec![
            self.containerd.pgid(),
            self.kubelet.pgid(),
            self.scheduler.pgid(),
        ]
    }

    /// Panics with the log's tail if a node process has exited.
    pub fn assert_alive(&self) {
        self.containerd.assert_alive();
        self.kubelet.assert_alive();
        self.scheduler.assert_alive();
    }

    fn wait_ready(&mut self, kube: &KubePlane) {
        wait_until("the node to be Ready", Duration::from_secs(90), || {
            self.containerd.assert_running();
            self.kubelet.assert_running();
            self.scheduler.assert_running();
            let (ok, out, _) = run(kube.kubectl().args([
                "get",
                "node",
                NODE_NAME,
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
            ]));
            ok && out.trim() == "True"
        });
    }

    /// Log tails of the node's processes.
    pub fn dump_logs(&self) {
        for process in [&self.containerd, &self.kubelet, &self.scheduler] {
            eprintln!(
                "===== {} ({}) =====\n{}",
                process.name,
                process.log_path.display(),
                process.log_tail(40)
            );
        }
    }

    /// Removes everything the node created (see the module doc). Idempotent.
    pub fn stop(&mut self) {
        let (ok, out, err) = run(Command::new("bash").arg(&self.teardown));
        if !ok {
            eprintln!("node teardown reported:\n{out}\n{err}");
        }
        for process in [&mut self.kubelet, &mut self.scheduler, &mut self.containerd] {
            process.stop(Duration::from_secs(5));
        }
    }

    /// The script that undoes the node, written once its processes run (their groups are in
    /// it). Order matters: the kubelet first (nothing restarts Pods), then every container
    /// task and its shim, then containerd, then mounts, network, cgroups and files.
    fn write_teardown(&self) {
        let node = self.dir.display();
        let ctr = binary(containerd_bin(), "ctr");
        let shim = binary(containerd_bin(), "containerd-shim-runc-v2");
        let script = format!(
            r#"#!/usr/bin/env bash
# Generated by tests/common/node.rs: removes what the bed's node created, by PID and exact path.
set -u
node='{node}'
ctr() {{ '{ctr}' --address "$node/containerd/containerd.sock" -n k8s.io "$@"; }}
kill -KILL -- -{kubelet} -{scheduler} 2>/dev/null
if [ -S "$node/containerd/containerd.sock" ]; then
  for id in $(ctr tasks ls -q 2>/dev/null); do ctr tasks kill -s SIGKILL "$id" >/dev/null 2>&1; done
  for _ in 1 2 3 4 5 6 7 8 9 10; do [ -z "$(ctr tasks ls -q 2>/dev/null)" ] && break; sleep 0.2; done
  for id in $(ctr tasks ls -q 2>/dev/null); do ctr tasks delete -f "$id" >/dev/null 2>&1; done
  for id in $(ctr containers ls -q 2>/dev/null); do
    # The CNI plugins cache each sandbox's result under /var/lib/cni/results, by its ID.
    rm -f /var/lib/cni/results/*-"$id"-*
    ctr containers delete "$id" >/dev/null 2>&1
  done
fi
# Processes left in the Pods' cgroups, and shims (they leave containerd's group): by cgroup
# path and by executable path with our containerd's socket in their arguments.
for proc in /proc/[0-9]*; do
  pid=${{proc#/proc/}}
  if grep -q ':/kubepods' "$proc/cgroup" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null; continue; fi
  if [ "$(readlink "$proc/exe" 2>/dev/null)" = '{shim}' ] \
     && tr '\0' ' ' < "$proc/cmdline" 2>/dev/null | grep -qF "$node/containerd/"; then
    kill -KILL "$pid" 2>/dev/null
  fi
done
kill -KILL -- -{containerd} 2>/dev/null
sleep 0.2
grep -F " $node/" /proc/self/mountinfo | awk '{{print $5}}' | sort -r | while read -r mount; do
  umount -l "$mount" 2>/dev/null
done
ip link delete '{BRIDGE}' 2>/dev/null
rm -rf '/var/lib/cni/networks/{NETWORK}' /var/lib/cni/results/{NETWORK}-*
for link in /var/log/containers/*.log; do
  case "$(readlink "$link" 2>/dev/null)" in "$node"/*) rm -f "$link" ;; esac
done
for hierarchy in /sys/fs/cgroup /sys/fs/cgroup/*/; do
  [ -d "$hierarchy/kubepods" ] && find "$hierarchy/kubepods" -depth -type d -exec rmdir {{}} \; 2>/dev/null
done
rm -f /var/lib/kubelet/device-plugins/kubelet.sock
rmdir /var/lib/kubelet/device-plugins /var/lib/kubelet /var/lib/cni/results /var/lib/cni 2>/dev/null
rmdir /run/containerd/runc/k8s.io /run/containerd/runc /run/containerd/s /run/containerd 2>/dev/null
exit 0
"#,
            ctr = ctr.display(),
            shim = shim.display(),
            kubelet = self.kubelet.pgid(),
            scheduler = self.scheduler.pgid(),
            containerd = self.containerd.pgid(),
        );
        std::fs::write(&self.teardown, script).expect("teardown.sh must be writable");
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop();
    }
}

fn start_containerd(dir: &Path) -> ManagedProcess {
    let root = dir.join("containerd");
    let config = root.join("config.toml");
    let cni = dir.join("cni");
    std::fs::write(
        cni.join("net.d/10-registrar-bed.conflist"),
        format!(
            r#"{{
  "cniVersion": "1.0.0",
  "name": "{NETWORK}",
  "plugins": [
    {{
      "type": "bridge",
      "bridge": "{BRIDGE}",
      "isGateway": false,
      "ipMasq": false,
      "ipam": {{
        "type": "host-local",
        "dataDir": "{ipam}",
        "ranges": [[{{ "subnet": "10.217.0.0/24" }}]]
      }}
    }},
    {{ "type": "loopback" }}
  ]
}}
"#,
            ipam = cni.join("ipam").display()
        ),
    )
    .expect("the CNI config must be writable");
    let runc = binary(runc_bin(), "runc");
    std::fs::write(
        &config,
        format!(
            r#"version = 3
root = "{root}/root"
state = "{root}/state"

[grpc]
  address = "{root}/containerd.sock"

[ttrpc]
  address = "{root}/containerd.sock.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{root}/opt"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"

[plugins."io.containerd.cri.v1.images".pinned_images]
  sandbox = "{PAUSE_IMAGE}"

[plugins."io.containerd.cri.v1.runtime"]
  # The VM withholds CAP_SYS_RESOURCE: a sandbox asking for oom_score_adj -998 would fail.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_cdi = false

[plugins."io.containerd.cri.v1.runtime".cni]
  bin_dirs = ["{cni_bin}"]
  conf_dir = "{cni}/net.d"

[plugins."io.containerd.cri.v1.runtime".containerd]
  default_runtime_name = "runc"

[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
  BinaryName = "{runc}"
  SystemdCgroup = false

[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
"#,
            root = root.display(),
            cni = cni.display(),
            cni_bin = cni_bin().display(),
            runc = runc.display(),
        ),
    )
    .expect("containerd's config must be writable");
    let mut command = Command::new(binary(containerd_bin(), "containerd"));
    command.arg("--config").arg(&config);
    // containerd finds its shim on PATH.
    let path = std::env::var("PATH").unwrap_or_default();
    command.env(
        "PATH",
        format!(
            "{}:{}:{path}",
            containerd_bin().display(),
            runc_bin().display()
        ),
    );
    let mut process = ManagedProcess::spawn("containerd", command, dir);
    let socket = root.join("containerd.sock");
    wait_until("containerd's socket", Duration::from_secs(30), || {
        process.assert_running();
        run(ctr(dir).args(["version"])).0 && socket.exists()
    });
    process
}

/// `ctr` against the node's containerd, in the CRI's namespace.
pub fn ctr(dir: &Path) -> Command {
    let mut command = Command::new(binary(containerd_bin(), "ctr"));
    command
        .arg("--address")
        .arg(dir.join("containerd/containerd.sock"))
        .args(["-n", "k8s.io"]);
    command
}

fn import_images(dir: &Path) {
    for archive in ["pause.tar", "workload.tar"] {
        let path = bed_images().join(archive);
        assert!(
            path.is_file(),
            "{} is missing: run `bash tests/testenv/build.sh` first",
            path.display()
        );
        let (ok, out, err) = run(ctr(dir)
            .args(["images", "import", "--local", "--no-unpack=false"])
            .arg(&path));
        assert!(ok, "importing {archive} failed:\n{out}\n{err}");
    }
}

fn start_kubelet(dir: &Path, kube: &KubePlane, port: u16) -> ManagedProcess {
    let certs = dir.join("certs");
    let client = kube
        .ca
        .client(&format!("system:node:{NODE_NAME}"), Some("system:nodes"));
    let kubeconfig = dir.join("kubelet.kubeconfig");
    std::fs::write(
        &kubeconfig,
        kubeconfig_yaml(&kube.url, &kube.ca_pem, &client.cert_pem, &client.key_pem),
    )
    .expect("the kubelet's kubeconfig must be writable");
    let ca_file = certs.join("ca.crt");
    std::fs::write(&ca_file, &kube.ca_pem).expect("the CA must be writable");
    // With RBAC as the only authorizer, a node's rights come from a binding to system:node.
    let binding = format!(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata:\n  name: bed-node\n\
         roleRef:\n  apiGroup: rbac.authorization.k8s.io\n  kind: ClusterRole\n  name: system:node\n\
         subjects:\n- apiGroup: rbac.authorization.k8s.io\n  kind: User\n  name: system:node:{NODE_NAME}\n"
    );
    apply(kube, &binding);
    let config = dir.join("kubelet.yaml");
    std::fs::write(
        &config,
        format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# The machine runs cgroup v1, which kubelet 1.36 refuses unless told otherwise.
failCgroupV1: false
cgroupDriver: cgroupfs
failSwapOn: false
address: 127.0.0.1
port: {port}
readOnlyPort: 0
healthzPort: 0
containerRuntimeEndpoint: unix://{containerd}/containerd.sock
podLogsDir: {logs}
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: {ca}
authorization:
  mode: Webhook
# Test images are imported, never pulled: they must never be collected either.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "100Mi"
  nodefs.available: "1%"
  imagefs.available: "1%"
nodeStatusReportFrequency: 10s
syncFrequency: 10s
resolvConf: ""
"#,
            containerd = dir.join("containerd").display(),
            logs = dir.join("pod-logs").display(),
            ca = ca_file.display(),
        ),
    )
    .expect("the kubelet's config must be writable");
    let mut command = Command::new(binary(kube_bin(), "kubelet"));
    command.args([
        format!("--config={}", config.display()),
        format!("--kubeconfig={}", kubeconfig.display()),
        format!("--root-dir={}", dir.join("kubelet").display()),
        format!("--cert-dir={}", certs.display()),
        format!("--hostname-override={NODE_NAME}"),
        "--node-ip=127.0.0.1".into(),
        "--v=1".into(),
    ]);
    ManagedProcess::spawn("kubelet", command, dir)
}

fn start_scheduler(dir: &Path, kubeconfig: &Path) -> ManagedProcess {
    let mut command = Command::new(binary(kube_bin(), "kube-scheduler"));
    command.args([
        format!("--kubeconfig={}", kubeconfig.display()),
        format!("--authentication-kubeconfig={}", kubeconfig.display()),
        format!("--authorization-kubeconfig={}", kubeconfig.display()),
        "--leader-elect=false".into(),
        "--secure-port=0".into(),
    ]);
    ManagedProcess::spawn("kube-scheduler", command, dir)
}

/// `kubectl apply -f -` of `yaml` against the bed.
pub fn apply(kube: &KubePlane, yaml: &str) {
    use std::io::Write;
    let mut child = kube
        .kubectl()
        .args(["apply", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kubectl must start");
    child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(yaml.as_bytes())
        .expect("kubectl's stdin must take the manifest");
    let output = child.wait_with_output().expect("kubectl must finish");
    assert!(
        output.status.success(),
        "kubectl apply failed:\n{yaml}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}
