//! Where `tests/testenv/build.sh` caches the binaries. Mirrors `tests/testenv/paths.sh`.

use std::path::PathBuf;

const VERSIONS_ENV: &str = include_str!("../testenv/versions.env");

fn pinned(name: &str) -> String {
    VERSIONS_ENV
        .lines()
        .filter_map(|line| line.split_once('='))
        .find(|(key, _)| key.trim() == name)
        .map(|(_, value)| value.trim().to_string())
        .unwrap_or_else(|| panic!("tests/testenv/versions.env must define {name}"))
}

fn cache_root() -> PathBuf {
    match std::env::var_os("SPIFFE_REGISTRAR_TESTENV") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let home =
                std::env::var_os("HOME").expect("HOME must be set to find the testenv cache");
            PathBuf::from(home).join(".cache/spiffe-registrar/testenv")
        }
    }
}

/// Directory holding `etcd`, `kube-apiserver` and `kubectl`.
pub fn kube_bin() -> PathBuf {
    cache_root().join(format!(
        "kube-{}-etcd-{}/bin",
        pinned("KUBERNETES_VERSION"),
        pinned("ETCD_VERSION")
    ))
}

/// Directory holding `spire-server` and `spire-agent`.
pub fn spire_bin() -> PathBuf {
    cache_root().join(format!("spire-{}/bin", pinned("SPIRE_VERSION")))
}

/// Directory holding `helm`.
pub fn helm_bin() -> PathBuf {
    cache_root().join(format!("helm-{}/bin", pinned("HELM_VERSION")))
}

/// Directory holding `promtool`.
pub fn promtool_bin() -> PathBuf {
    cache_root().join(format!("promtool-{}/bin", pinned("PROMETHEUS_VERSION")))
}

/// A binary from the cache, with a message naming the script that builds it when it is missing.
pub fn binary(dir: PathBuf, name: &str) -> PathBuf {
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is missing: run `bash tests/testenv/build.sh` first",
        path.display()
    );
    path
}

/// A loopback TCP port that was free a moment ago. Racy by nature; callers start quickly.
pub fn free_port() -> u16 {
    // The kernel may hand the same port out again as soon as the probe's listener closes
    // (etcd once got one port for both its client and peer URLs): a port is never handed out
    // twice by one test process.
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .map(|addr| addr.port())
            .expect("binding 127.0.0.1:0 must succeed");
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// Directory holding `containerd`, `ctr` and `containerd-shim-runc-v2`.
pub fn containerd_bin() -> PathBuf {
    cache_root().join(format!("containerd-{}/bin", pinned("CONTAINERD_VERSION")))
}

/// Directory holding `runc` (built with seccomp).
pub fn runc_bin() -> PathBuf {
    cache_root().join(format!("runc-{}-seccomp/bin", pinned("RUNC_VERSION")))
}

/// Directory holding the CNI plugins `bridge`, `host-local` and `loopback`.
pub fn cni_bin() -> PathBuf {
    cache_root().join(format!("cni-plugins-{}/bin", pinned("CNI_PLUGINS_VERSION")))
}

/// Directory holding the node's image archives (`pause.tar`, `workload.tar`): keyed like
/// `BED_IMAGES` in paths.sh, by the SPIRE version and a hash of the workload module's files.
pub fn bed_images() -> PathBuf {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    for part in [
        &include_bytes!("../testenv/go/workload/go.mod")[..],
        include_bytes!("../testenv/go/workload/go.sum"),
        include_bytes!("../testenv/go/workload/pause/main.go"),
        include_bytes!("../testenv/go/workload/svid-watch/main.go"),
    ] {
        hasher.update(part);
    }
    let hex: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    cache_root().join(format!("images-{}-{}", pinned("SPIRE_VERSION"), &hex[..12]))
}
