#!/usr/bin/env bash
# Builds the real peers the tests run against (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, spire-server, spire-agent), the node that runs Pods (kubelet,
# containerd, runc, CNI plugins, and two images: a sandbox and the workload with a static
# spire-agent) and the tools the chart and monitoring tests use (helm, promtool) from Go modules
# at the versions in versions.env, and cargo-deny from crates.io, into a cache outside the repo.
# Whatever is already cached is not rebuilt. Prints the bin directories on the last lines.
#
#   --peers-only              only the control plane, SPIRE and the node: what tests/demo runs
#   SPIFFE_REGISTRAR_TESTENV  cache root (default ~/.cache/spiffe-registrar/testenv)
set -euo pipefail
peers_only=false
case "${1:-}" in
  --peers-only) peers_only=true ;;
  "") ;;
  *) echo "usage: build.sh [--peers-only]" >&2; exit 2 ;;
esac
here=$(cd "$(dirname "$0")" && pwd)
source "$here/versions.env"
source "$here/paths.sh"

log() { printf '[testenv-build] %s\n' "$*" >&2; }

ensure_prerequisites() {
  command -v go >/dev/null || { log "go is required on PATH"; exit 1; }
  # spire-server's SQLite datastore needs CGO, hence a C compiler.
  if ! command -v gcc >/dev/null; then
    log "installing gcc (needed for spire's CGO SQLite)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev
  fi
  # The registrar's allocator (tikv-jemalloc-sys) builds jemalloc from C with make.
  if ! command -v make >/dev/null; then
    log "installing make (needed to build jemalloc)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq make
  fi
  # runc must be built with seccomp: the kubelet asks for the RuntimeDefault profile.
  if [[ ! -x "$RUNC_BIN/runc" ]] && ! pkg-config --exists libseccomp 2>/dev/null \
      && [[ ! -f /usr/include/seccomp.h ]]; then
    log "installing libseccomp-dev (runc's seccomp support)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libseccomp-dev pkg-config
  fi
}

# build_into DIR MODULE_DIR CGO LDFLAGS PACKAGE... : builds each package's main into DIR/bin,
# through a temporary directory so an interrupted build never leaves a half-written binary.
build_into() {
  local dest=$1 module_dir=$2 cgo=$3 ldflags=$4; shift 4
  local tmp; tmp=$(mktemp -d "${dest}.partial.XXXXXX")
  local start=$SECONDS
  ( cd "$module_dir" && CGO_ENABLED=$cgo GOFLAGS=-mod=readonly go build -p 2 -trimpath \
      -ldflags "$ldflags" -o "$tmp/" "$@" )
  mkdir -p "$dest"
  rm -rf "$dest/bin"
  mv "$tmp" "$dest/bin"
  log "built $(ls "$dest/bin" | tr '\n' ' ')in $((SECONDS - start))s"
}

ensure_prerequisites
mkdir -p "$TESTENV_CACHE"

minor=${KUBERNETES_VERSION#v1.}; minor=${minor%%.*}
kube_stamp="-s -w -X k8s.io/component-base/version.gitVersion=${KUBERNETES_VERSION}"
kube_stamp+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=${minor}"
kube_stamp+=" -X k8s.io/component-base/version.gitTreeState=clean"
if [[ -x "$KUBE_BIN/kube-apiserver" && -x "$KUBE_BIN/etcd" && -x "$KUBE_BIN/kubectl" ]]; then
  log "cached: $KUBE_BIN"
else
  log "building kube-apiserver ${KUBERNETES_VERSION}, kube-controller-manager, kubectl, etcd ${ETCD_VERSION} (about 12 minutes on 2 cores; go prints nothing meanwhile)"
  build_into "$(dirname "$KUBE_BIN")" "$here/go/kube" 0 "$kube_stamp" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kubectl go.etcd.io/etcd/server/v3
  # `go build` names the etcd binary after its package directory ("server").
  mv "$KUBE_BIN/server" "$KUBE_BIN/etcd"
fi
# Components that joined the bed after its first cache was made are added to it, nothing
# rebuilt: kube-controller-manager, and the node's kubelet and kube-scheduler.
for component in kube-controller-manager kubelet kube-scheduler; do
  [[ -x "$KUBE_BIN/$component" ]] && continue
  log "adding $component ${KUBERNETES_VERSION} to $KUBE_BIN"
  tmp=$(mktemp -d "${KUBE_BIN}.partial.XXXXXX")
  start=$SECONDS
  ( cd "$here/go/kube" && CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -p 2 -trimpath \
      -ldflags "$kube_stamp" -o "$tmp/" "k8s.io/kubernetes/cmd/$component" )
  mv "$tmp/$component" "$KUBE_BIN/$component"
  rmdir "$tmp"
  log "built $component in $((SECONDS - start))s"
done

if [[ -x "$SPIRE_BIN/spire-server" && -x "$SPIRE_BIN/spire-agent" ]]; then
  log "cached: $SPIRE_BIN"
else
  log "building spire-server and spire-agent ${SPIRE_VERSION} (about 5 minutes on 2 cores)"
  build_into "$(dirname "$SPIRE_BIN")" "$here/go/spire" 1 "-s -w" \
    github.com/spiffe/spire/cmd/spire-server github.com/spiffe/spire/cmd/spire-agent
fi

# A single-binary Go tool, cached under its own versioned directory: build_tool BIN_DIR NAME
# MODULE_DIR VERSION LDFLAGS PACKAGE.
build_tool() {
  local bin_dir=$1 name=$2 module_dir=$3 version=$4 ldflags=$5 package=$6
  if [[ -x "$bin_dir/$name" ]]; then
    log "cached: $bin_dir"
  else
    log "building $name $version (a few minutes on 2 cores)"
    build_into "$(dirname "$bin_dir")" "$module_dir" 0 "$ldflags" "$package"
  fi
}

# The node's runtime: each piece cached under its own version (build_node_piece DEST_BIN CGO
# TAGS MODULE_DIR PACKAGE...).
build_node_piece() {
  local dest=$1 cgo=$2 tags=$3 module_dir=$4; shift 4
  if [[ -x "$dest/$(basename "$1")" ]]; then
    log "cached: $dest"
    return
  fi
  log "building $(printf '%s ' "$@" | sed 's#[^ ]*/##g')(node runtime)"
  build_into "$(dirname "$dest")" "$module_dir" "$cgo" "-s -w" -tags "$tags" "$@"
}
build_node_piece "$CONTAINERD_BIN" 1 "no_btrfs urfave_cli_no_docs" "$here/go/containerd" \
  github.com/containerd/containerd/v2/cmd/containerd github.com/containerd/containerd/v2/cmd/ctr \
  github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2
build_node_piece "$RUNC_BIN" 1 "seccomp urfave_cli_no_docs" "$here/go/runc" \
  github.com/opencontainers/runc
build_node_piece "$CNI_BIN" 0 "" "$here/go/cni" \
  github.com/containernetworking/plugins/plugins/main/bridge \
  github.com/containernetworking/plugins/plugins/ipam/host-local \
  github.com/containernetworking/plugins/plugins/main/loopback

# image_archive OUT REPO:TAG ENTRYPOINT ROOT: a one-layer docker-archive (what
# `ctr images import` reads) of the directory ROOT, without a registry.
image_archive() {
  local out=$1 ref=$2 entrypoint=$3 root=$4 work
  work=$(mktemp -d)
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$root" -cf "$work/layer.tar" .
  local diff_id; diff_id=$(sha256sum "$work/layer.tar" | cut -d' ' -f1)
  printf '{"architecture":"amd64","os":"linux","config":{"Entrypoint":["%s"]},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
    "$entrypoint" "$diff_id" > "$work/config.json"
  local config_id; config_id=$(sha256sum "$work/config.json" | cut -d' ' -f1)
  mv "$work/config.json" "$work/$config_id.json"
  printf '[{"Config":"%s.json","RepoTags":["%s"],"Layers":["layer.tar"]}]' "$config_id" "$ref" \
    > "$work/manifest.json"
  tar -C "$work" -cf "$out" manifest.json "$config_id.json" layer.tar
  rm -rf "$work"
}

# The node's images: the sandbox (pause) and the workload (svid-watch, and spire-agent built
# without CGO so that it runs in an image with no libc, as the agent DaemonSet's container).
if [[ -f "$BED_IMAGES/workload.tar" ]]; then
  log "cached: $BED_IMAGES"
else
  log "building the node's images (pause, svid-watch, a static spire-agent ${SPIRE_VERSION})"
  start=$SECONDS
  tmp=$(mktemp -d "${BED_IMAGES}.partial.XXXXXX")
  ( cd "$here/go/workload" && CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -p 2 -trimpath \
      -ldflags "-s -w" -o "$tmp/pause/" ./pause && \
    CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -p 2 -trimpath -ldflags "-s -w" \
      -o "$tmp/workload/" ./svid-watch )
  ( cd "$here/go/spire" && CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -p 2 -trimpath \
      -ldflags "-s -w" -o "$tmp/workload/" github.com/spiffe/spire/cmd/spire-agent )
  image_archive "$tmp/pause.tar" registrar-bed/pause:1 /pause "$tmp/pause"
  image_archive "$tmp/workload.tar" registrar-bed/workload:1 /svid-watch "$tmp/workload"
  rm -rf "$tmp/pause" "$tmp/workload"
  rm -rf "$BED_IMAGES"
  mv "$tmp" "$BED_IMAGES"
  log "built the node's images in $((SECONDS - start))s"
fi

echo "KUBE_BIN=$KUBE_BIN"
echo "SPIRE_BIN=$SPIRE_BIN"
echo "CONTAINERD_BIN=$CONTAINERD_BIN"
echo "RUNC_BIN=$RUNC_BIN"
echo "CNI_BIN=$CNI_BIN"
echo "BED_IMAGES=$BED_IMAGES"
if $peers_only; then exit 0; fi

build_tool "$HELM_BIN" helm "$here/go/helm" "$HELM_VERSION" \
  "-s -w -X helm.sh/helm/v4/internal/version.version=${HELM_VERSION}" helm.sh/helm/v4/cmd/helm
build_tool "$PROMTOOL_BIN" promtool "$here/go/promtool" "$PROMETHEUS_VERSION" \
  "-s -w" github.com/prometheus/prometheus/cmd/promtool

# cargo-deny is a Rust tool: installed from crates.io at the pinned version, through a temporary
# root so an interrupted install never leaves a half-written binary.
if [[ -x "$CARGO_DENY_BIN/cargo-deny" ]]; then
  log "cached: $CARGO_DENY_BIN"
else
  log "installing cargo-deny ${CARGO_DENY_VERSION} from crates.io (about 3 minutes on 2 cores)"
  start=$SECONDS
  tmp=$(mktemp -d "$(dirname "$CARGO_DENY_BIN").partial.XXXXXX")
  cargo install --quiet --locked cargo-deny --version "${CARGO_DENY_VERSION#v}" --root "$tmp"
  mkdir -p "$(dirname "$CARGO_DENY_BIN")"
  rm -rf "$CARGO_DENY_BIN"
  mv "$tmp/bin" "$CARGO_DENY_BIN"
  rm -rf "$tmp"
  log "installed cargo-deny in $((SECONDS - start))s"
fi

echo "HELM_BIN=$HELM_BIN"
echo "PROMTOOL_BIN=$PROMTOOL_BIN"
echo "CARGO_DENY_BIN=$CARGO_DENY_BIN"
