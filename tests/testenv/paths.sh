# Where build.sh puts the binaries; sourced after versions.env. The Rust harness derives the
# same paths (tests/common/paths.rs), so both must change together.
TESTENV_CACHE=${SPIFFE_REGISTRAR_TESTENV:-$HOME/.cache/spiffe-registrar/testenv}
KUBE_BIN="$TESTENV_CACHE/kube-${KUBERNETES_VERSION}-etcd-${ETCD_VERSION}/bin"
SPIRE_BIN="$TESTENV_CACHE/spire-${SPIRE_VERSION}/bin"
HELM_BIN="$TESTENV_CACHE/helm-${HELM_VERSION}/bin"
PROMTOOL_BIN="$TESTENV_CACHE/promtool-${PROMETHEUS_VERSION}/bin"
CARGO_DENY_BIN="$TESTENV_CACHE/cargo-deny-${CARGO_DENY_VERSION}/bin"
# The node's runtime.
CONTAINERD_BIN="$TESTENV_CACHE/containerd-${CONTAINERD_VERSION}/bin"
RUNC_BIN="$TESTENV_CACHE/runc-${RUNC_VERSION}-seccomp/bin"
CNI_BIN="$TESTENV_CACHE/cni-plugins-${CNI_PLUGINS_VERSION}/bin"
# The node's images (pause; svid-watch + a static spire-agent), keyed by the SPIRE version and a
# hash of the workload module, in the order tests/common/paths.rs hashes it.
workload_module="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/go/workload"
workload_hash=$(cat "$workload_module/go.mod" "$workload_module/go.sum" \
  "$workload_module/pause/main.go" "$workload_module/svid-watch/main.go" | sha256sum | cut -c1-12)
BED_IMAGES="$TESTENV_CACHE/images-${SPIRE_VERSION}-${workload_hash}"
