# Where build.sh puts the binaries; sourced after versions.env. The Rust harness derives the
# same paths (tests/common/paths.rs), so both must change together.
TESTENV_CACHE=${SPIFFE_REGISTRAR_TESTENV:-$HOME/.cache/spiffe-registrar/testenv}
KUBE_BIN="$TESTENV_CACHE/kube-${KUBERNETES_VERSION}-etcd-${ETCD_VERSION}/bin"
SPIRE_BIN="$TESTENV_CACHE/spire-${SPIRE_VERSION}/bin"
HELM_BIN="$TESTENV_CACHE/helm-${HELM_VERSION}/bin"
PROMTOOL_BIN="$TESTENV_CACHE/promtool-${PROMETHEUS_VERSION}/bin"
CARGO_DENY_BIN="$TESTENV_CACHE/cargo-deny-${CARGO_DENY_VERSION}/bin"
