#!/usr/bin/env bash
# Regenerates the Go helper modules' go.mod/go.sum from versions.env. Run by hand when a
# version changes; the results are committed so build.sh needs no module resolution.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/versions.env"
kube_minor=${KUBERNETES_VERSION#v1.}          # 36.3
staging_version="v0.${kube_minor}"            # v0.36.3

kube_dir="$here/go/kube"
rm -f "$kube_dir/go.mod" "$kube_dir/go.sum"
( cd "$kube_dir"
  go mod init spiffe-registrar.test/testenv/kube >/dev/null
  go mod edit -go=1.26.0
  mod_file=$(go mod download -json "k8s.io/kubernetes@${KUBERNETES_VERSION}" | sed -n 's/.*"GoMod": "\(.*\)",/\1/p')
  # Every staging module k8s.io/kubernetes replaces with ./staging/... must be replaced here with
  # the published module of the matching v0.x version: replace directives only work in the main
  # module, and the required v0.0.0 versions do not exist.
  for module in $(sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$mod_file"); do
    go mod edit "-replace=${module}=${module}@${staging_version}"
  done
  go get "k8s.io/kubernetes@${KUBERNETES_VERSION}"
  go get -tool "k8s.io/kubernetes/cmd/kube-apiserver@${KUBERNETES_VERSION}"
  go get -tool "k8s.io/kubernetes/cmd/kube-controller-manager@${KUBERNETES_VERSION}"
  go get -tool "k8s.io/kubernetes/cmd/kubectl@${KUBERNETES_VERSION}"
  go get -tool "k8s.io/kubernetes/cmd/kubelet@${KUBERNETES_VERSION}"
  go get -tool "k8s.io/kubernetes/cmd/kube-scheduler@${KUBERNETES_VERSION}"
  go get -tool "go.etcd.io/etcd/server/v3@${ETCD_VERSION}"
  go mod tidy
)

# A helper module whose only content is `tool` requirements: tool_module NAME PACKAGE@VERSION...
tool_module() {
  local name=$1; shift
  local dir="$here/go/$name"
  rm -f "$dir/go.mod" "$dir/go.sum"
  ( cd "$dir"
    go mod init "spiffe-registrar.test/testenv/$name" >/dev/null
    for tool in "$@"; do go get -tool "$tool"; done
    go mod tidy
  )
}

tool_module spire "github.com/spiffe/spire/cmd/spire-server@${SPIRE_VERSION}" \
  "github.com/spiffe/spire/cmd/spire-agent@${SPIRE_VERSION}"
tool_module containerd "github.com/containerd/containerd/v2/cmd/containerd@${CONTAINERD_VERSION}" \
  "github.com/containerd/containerd/v2/cmd/ctr@${CONTAINERD_VERSION}" \
  "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@${CONTAINERD_VERSION}"
tool_module runc "github.com/opencontainers/runc@${RUNC_VERSION}"
tool_module cni "github.com/containernetworking/plugins/plugins/main/bridge@${CNI_PLUGINS_VERSION}" \
  "github.com/containernetworking/plugins/plugins/ipam/host-local@${CNI_PLUGINS_VERSION}" \
  "github.com/containernetworking/plugins/plugins/main/loopback@${CNI_PLUGINS_VERSION}"
# The bed's workload module has code of its own (svid-watch, pause): only its requirements are
# refreshed.
( cd "$here/go/workload" && go get "github.com/spiffe/go-spiffe/v2@${GO_SPIFFE_VERSION}" && go mod tidy )
tool_module helm "helm.sh/helm/v4/cmd/helm@${HELM_VERSION}"
tool_module promtool "github.com/prometheus/prometheus/cmd/promtool@${PROMETHEUS_VERSION}"
