//! SPIRE's agent as production runs it on Kubernetes: a DaemonSet Pod on the bed's node
//! (hostPID, hostNetwork, the Workload API socket on a hostPath), attested by the server's
//! `k8s_psat` node attestor from its projected service account token, with the `k8s` workload
//! attestor talking to the kubelet's secure port with its own service account token.
//!
//! ```text
//!  spire-server ◀── k8s_psat (token, audience spire-server) ── spire-agent Pod (ns spire)
//!       │ TokenReview, Pod, Node                                    │ Workload API socket
//!  kube-apiserver                                         <bed>/node/agent-sockets (hostPath)
//!                                                                   ▲
//!                              workload Pods mount it at /run/spire/agent-sockets
//! ```

use super::kube_plane::KubePlane;
use super::node::{Node, WORKLOAD_IMAGE, apply};
use super::paths::{binary, spire_bin};
use super::process::{run, wait_until};
use super::spire::{SpireServer, TRUST_DOMAIN};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// The name SPIRE's k8s_psat attestor knows the bed's cluster by.
pub const PSAT_CLUSTER: &str = "bed";
/// Where Pods mount the agent's socket directory.
pub const SOCKET_DIR_IN_POD: &str = "/run/spire/agent-sockets";

pub struct NodeAgent {
    /// The agent's Workload API socket, on the node (a hostPath).
    pub socket: PathBuf,
    /// The hostPath directory workload Pods write their reports to (`/report` inside).
    pub reports: PathBuf,
}

impl NodeAgent {
    /// Deploys the agent DaemonSet and waits until the agent is attested and serving.
    pub fn deploy(kube: &KubePlane, server: &SpireServer, node: &Node) -> Self {
        let sockets = node.dir.join("agent-sockets");
        let reports = node.dir.join("reports");
        for dir in [&sockets, &reports] {
            std::fs::create_dir_all(dir).expect("hostPath dirs must be creatable");
        }
        let bundle = server.cli_ok(&["bundle", "show"], &[]);
        apply(
            kube,
            &manifests(server.port, node.kubelet_port, &sockets, &bundle),
        );
        let socket = sockets.join("agent.sock");
        wait_until(
            "the spire-agent Pod to be attested and serving",
            Duration::from_secs(120),
            || {
                node.assert_alive();
                run(Command::new(binary(spire_bin(), "spire-agent"))
                    .args(["healthcheck", "-socketPath"])
                    .arg(&socket))
                .0
            },
        );
        Self { socket, reports }
    }

    /// The agent's SPIFFE ID prefix: `spiffe://<td>/spire/agent/k8s_psat/<cluster>/`.
    pub fn id_prefix() -> String {
        format!("spiffe://{TRUST_DOMAIN}/spire/agent/k8s_psat/{PSAT_CLUSTER}/")
    }
}

fn indent(text: &str, by: usize) -> String {
    let pad = " ".repeat(by);
    text.lines().map(|line| format!("{pad}{line}\n")).collect()
}

/// The agent's namespace, RBAC, configuration and DaemonSet, as SPIRE's Helm charts lay them
/// out (the agent reaches the server on the host's loopback, hence hostNetwork).
fn manifests(
    server_port: u16,
    kubelet_port: u16,
    sockets: &std::path::Path,
    bundle: &str,
) -> String {
    let agent_conf = format!(
        r#"agent {{
  data_dir = "/run/spire/data"
  log_level = "DEBUG"
  server_address = "127.0.0.1"
  server_port = "{server_port}"
  socket_path = "{SOCKET_DIR_IN_POD}/agent.sock"
  trust_bundle_path = "/run/spire/bundle/bundle.crt"
  trust_domain = "{TRUST_DOMAIN}"
}}
plugins {{
  NodeAttestor "k8s_psat" {{
    plugin_data {{
      cluster = "{PSAT_CLUSTER}"
    }}
  }}
  KeyManager "memory" {{
    plugin_data {{}}
  }}
  WorkloadAttestor "k8s" {{
    plugin_data {{
      # No node name: the kubelet is reached on 127.0.0.1 (hostNetwork).
      node_name_env = "NO_SUCH_VARIABLE"
      kubelet_secure_port = {kubelet_port}
      skip_kubelet_verification = true
    }}
  }}
}}
"#
    );
    format!(
        r#"apiVersion: v1
kind: Namespace
metadata:
  name: spire
---
apiVersion: v1
kind: ServiceAccount
metadata:
  name: spire-agent
  namespace: spire
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: spire-agent
rules:
- apiGroups: [""]
  resources: ["pods", "nodes", "nodes/proxy"]
  verbs: ["get", "list"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: spire-agent
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: spire-agent
subjects:
- kind: ServiceAccount
  name: spire-agent
  namespace: spire
---
apiVersion: v1
kind: ConfigMap
metadata:
  name: spire-agent
  namespace: spire
data:
  agent.conf: |
{agent_conf}---
apiVersion: v1
kind: ConfigMap
metadata:
  name: spire-bundle
  namespace: spire
data:
  bundle.crt: |
{bundle}---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: spire-agent
  namespace: spire
spec:
  selector:
    matchLabels:
      app: spire-agent
  template:
    metadata:
      labels:
        app: spire-agent
    spec:
      serviceAccountName: spire-agent
      hostPID: true
      hostNetwork: true
      dnsPolicy: Default
      terminationGracePeriodSeconds: 5
      containers:
      - name: spire-agent
        image: {WORKLOAD_IMAGE}
        imagePullPolicy: Never
        command: ["/spire-agent", "run", "-config", "/run/spire/config/agent.conf"]
        volumeMounts:
        - name: config
          mountPath: /run/spire/config
          readOnly: true
        - name: bundle
          mountPath: /run/spire/bundle
          readOnly: true
        - name: sockets
          mountPath: {SOCKET_DIR_IN_POD}
        - name: data
          mountPath: /run/spire/data
        - name: psat
          mountPath: /var/run/secrets/tokens
          readOnly: true
        - name: api-token
          mountPath: /var/run/secrets/kubernetes.io/serviceaccount
          readOnly: true
      volumes:
      - name: config
        configMap:
          name: spire-agent
      - name: bundle
        configMap:
          name: spire-bundle
      - name: sockets
        hostPath:
          path: {sockets}
          type: DirectoryOrCreate
      - name: data
        emptyDir: {{}}
      # The k8s_psat token: audience spire-server, bound to this Pod.
      - name: psat
        projected:
          sources:
          - serviceAccountToken:
              path: spire-agent
              audience: spire-server
              expirationSeconds: 7200
      # The agent's own credentials for the kubelet (the bed runs without the ServiceAccount
      # admission plugin, which would mount this by itself).
      - name: api-token
        projected:
          sources:
          - serviceAccountToken:
              path: token
              expirationSeconds: 7200
"#,
        agent_conf = indent(&agent_conf, 4),
        bundle = indent(bundle.trim_end(), 4),
        sockets = sockets.display(),
    )
}

/// A Deployment of the bed's workload (`svid-watch`): each Pod reports the SVIDs it holds to
/// `<reports>/<pod name>.jsonl`.
pub fn workload_deployment(
    namespace: &str,
    name: &str,
    service_account: &str,
    replicas: u32,
    reports: &std::path::Path,
    sockets: &std::path::Path,
) -> String {
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: {name}
  namespace: {namespace}
  labels:
    app: {name}
spec:
  replicas: {replicas}
  selector:
    matchLabels:
      app: {name}
  template:
    metadata:
      labels:
        app: {name}
    spec:
{pod}"#,
        pod = indent(&pod_spec(service_account, reports, sockets), 6),
    )
}

/// A workload of `kind` (StatefulSet, DaemonSet, Job or CronJob) whose Pods run the bed's
/// workload as `service_account`, labelled `app: <name>` like a Deployment's. A CronJob is
/// never due in a test's lifetime: its Jobs are made with `kubectl create job --from`.
pub fn workload_of_kind(
    kind: spiffe_registrar::keys::WorkloadKind,
    namespace: &str,
    name: &str,
    service_account: &str,
    reports: &std::path::Path,
    sockets: &std::path::Path,
) -> String {
    use spiffe_registrar::keys::WorkloadKind::{
        CronJob, Custom, DaemonSet, Deployment, Job, Pod, StatefulSet,
    };
    if kind == Pod {
        return bare_pod(namespace, name, service_account, reports, sockets);
    }
    let mut pod = pod_spec(service_account, reports, sockets);
    if matches!(kind, Job | CronJob) {
        pod.push_str("restartPolicy: Never\n");
    }
    let template = format!(
        "metadata:\n  labels:\n    app: {name}\nspec:\n{}",
        indent(&pod, 2)
    );
    let selector = format!("selector:\n  matchLabels:\n    app: {name}\n");
    let spec = match kind {
        Deployment | StatefulSet => format!(
            "replicas: 1\nserviceName: {name}\n{selector}template:\n{}",
            indent(&template, 2)
        ),
        DaemonSet => format!("{selector}template:\n{}", indent(&template, 2)),
        Job => format!("backoffLimit: 0\ntemplate:\n{}", indent(&template, 2)),
        CronJob => format!(
            "schedule: \"0 0 1 1 *\"\njobTemplate:\n  spec:\n    backoffLimit: 0\n    template:\n{}",
            indent(&template, 6)
        ),
        Pod => unreachable!("returned above"),
        Custom(_) => unreachable!("custom kinds run no Pods on the node"),
    };
    let spec = if kind == Deployment {
        spec.replace(&format!("serviceName: {name}\n"), "")
    } else {
        spec
    };
    format!(
        "apiVersion: {}\nkind: {}\nmetadata:\n  name: {name}\n  namespace: {namespace}\n  labels:\n    app: {name}\nspec:\n{}",
        kind.api_version(),
        kind.name(),
        indent(&spec, 2)
    )
}

/// A bare Pod of the bed's workload (no controller owns it).
pub fn bare_pod(
    namespace: &str,
    name: &str,
    service_account: &str,
    reports: &std::path::Path,
    sockets: &std::path::Path,
) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {namespace}\nspec:\n{}",
        indent(&pod_spec(service_account, reports, sockets), 2)
    )
}

/// The workload Pod's spec (a Deployment's template, or a bare Pod).
pub fn pod_spec(
    service_account: &str,
    reports: &std::path::Path,
    sockets: &std::path::Path,
) -> String {
    format!(
        r#"serviceAccountName: {service_account}
terminationGracePeriodSeconds: 1
containers:
- name: svid-watch
  image: {WORKLOAD_IMAGE}
  imagePullPolicy: Never
  args: ["-socket", "unix://{SOCKET_DIR_IN_POD}/agent.sock"]
  env:
  - name: POD_NAME
    valueFrom:
      fieldRef:
        fieldPath: metadata.name
  volumeMounts:
  - name: sockets
    mountPath: {SOCKET_DIR_IN_POD}
    readOnly: true
  - name: reports
    mountPath: /report
volumes:
- name: sockets
  hostPath:
    path: {sockets}
    type: Directory
- name: reports
  hostPath:
    path: {reports}
    type: Directory
"#,
        sockets = sockets.display(),
        reports = reports.display(),
    )
}
