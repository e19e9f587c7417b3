//! The whole test bed, started once per test binary (`Stack::shared`) or per test
//! (`Stack::start`), plus a sentinel that cleans up when the test binary dies.

use super::kube_plane::KubePlane;
use super::node::Node;
use super::node_agent::NodeAgent;
use super::postgres::{Datastore, Postgres};
use super::process::run;
use super::spire::{SpireAgent, SpireServer};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Instant;

pub struct Stack {
    /// Process groups started on top of the stack (registrars), for the sentinel.
    tracked: std::sync::Mutex<Vec<i32>>,
    pub kube: KubePlane,
    pub spire_server: SpireServer,
    pub spire_agent: SpireAgent,
    /// spire-server's datastore when it is PostgreSQL (stopped after the server).
    pub postgres: Option<Postgres>,
    /// The node and the SPIRE agent DaemonSet on it, for tests that run Pods.
    pub node: Option<(Node, NodeAgent)>,
    sentinel: Child,
    dir: tempfile::TempDir,
}

static SHARED: OnceLock<Stack> = OnceLock::new();
static SHARED_WITH_NODE: OnceLock<Stack> = OnceLock::new();

impl Stack {
    /// Starts etcd, kube-apiserver, spire-server and spire-agent, each ready when this returns.
    pub fn start() -> Self {
        Self::start_with(Datastore::Sqlite)
    }

    /// As `start`, with spire-server on `datastore`.
    pub fn start_with(datastore: Datastore) -> Self {
        Self::start_bed(datastore, false)
    }

    /// As `start`, plus a node (kubelet, containerd, kube-scheduler) running the SPIRE agent
    /// as a DaemonSet attested by k8s_psat: for tests that run Pods.
    pub fn start_with_node() -> Self {
        Self::start_bed(Datastore::Sqlite, true)
    }

    /// `start_with_node`, once per test binary (see `shared`).
    /// The binary's shared stack, as a test holds it (`Held`: its logs printed if the test
    /// fails). Call inside a multi-threaded runtime.
    pub fn shared_held() -> Held<Stack> {
        let stack = tokio::task::block_in_place(Stack::shared);
        Held::new(stack, stack)
    }

    pub fn shared_with_node() -> &'static Stack {
        SHARED_WITH_NODE.get_or_init(Stack::start_with_node)
    }

    fn start_bed(datastore: Datastore, with_node: bool) -> Self {
        let started = Instant::now();
        // Short path: Unix socket paths must stay under ~108 bytes.
        let dir = tempfile::Builder::new()
            .prefix("sr-")
            .tempdir_in("/tmp")
            .expect("a temp dir must be creatable");
        let sentinel = spawn_sentinel(dir.path());
        let kube = KubePlane::start(dir.path());
        let postgres = (datastore == Datastore::Postgres).then(|| Postgres::start(dir.path()));
        let spire_server =
            SpireServer::start_with(dir.path(), postgres.as_ref(), Some(&kube.kubeconfig));
        if datastore == Datastore::SqliteAnalyzed {
            super::sqlite::write_planner_statistics(&spire_server.sqlite_database());
        }
        let spire_agent = SpireAgent::start(dir.path(), &spire_server);
        // Known to the sentinel before the node starts (a kill during a slow start must not
        // leave the control plane running).
        let listed: Vec<String> = core_groups(&kube, &spire_server, &spire_agent)
            .iter()
            .map(i32::to_string)
            .collect();
        std::fs::write(dir.path().join("pgids"), listed.join("\n"))
            .expect("the pgid list must be writable");
        // The node's teardown.sh, which the sentinel runs, covers it from its first process.
        let node = with_node.then(|| {
            let node = Node::start(dir.path(), &kube);
            let agent = NodeAgent::deploy(&kube, &spire_server, &node);
            (node, agent)
        });
        let stack = Self {
            kube,
            spire_server,
            spire_agent,
            postgres,
            node,
            sentinel,
            dir,
            tracked: std::sync::Mutex::new(Vec::new()),
        };
        stack.record_groups();
        eprintln!(
            "test stack ready in {:?} under {}",
            started.elapsed(),
            stack.dir().display()
        );
        stack
    }

    /// One stack for the whole test binary, started on first use. Tests sharing it must use
    /// their own namespaces and SPIFFE paths, and must not stop or restart its processes (a
    /// test that does starts its own). It is torn down by the sentinel at exit.
    pub fn shared() -> &'static Stack {
        SHARED.get_or_init(Stack::start)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Process groups of every child, so the sentinel can kill what is running at exit.
    pub fn pgids(&self) -> Vec<i32> {
        let mut groups = core_groups(&self.kube, &self.spire_server, &self.spire_agent);
        groups.extend(self.postgres.as_ref().map(|p| p.process.pgid()));
        groups.extend(self.node.iter().flat_map(|(node, _)| node.pgids()));
        groups
    }

    /// Re-records the groups (call after restarting a process).
    pub fn record_groups(&self) {
        let tracked = self.tracked.lock().unwrap_or_else(|p| p.into_inner());
        let list: Vec<String> = self
            .pgids()
            .iter()
            .chain(tracked.iter())
            .map(i32::to_string)
            .collect();
        std::fs::write(self.dir().join("pgids"), list.join("\n"))
            .expect("the pgid list must be writable");
    }

    /// Adds a process group (e.g. a registrar) to what the sentinel kills at exit; it stays
    /// listed when `record_groups` rewrites the list after a restart.
    pub fn track(&self, pgid: i32) {
        self.tracked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(pgid);
        self.record_groups();
    }

    /// Runs `f` on a fresh thread with its own runtime: for set-up done once per binary from a
    /// sync `OnceLock` initializer, where the calling test's runtime cannot be blocked on.
    pub fn block_on_fresh<T: Send + 'static>(
        f: impl std::future::Future<Output = T> + Send + 'static,
    ) -> T {
        std::thread::spawn(move || {
            tokio::runtime::Runtime::new()
                .expect("a runtime must build")
                .block_on(f)
        })
        .join()
        .expect("the set-up thread must not panic")
    }

    /// The node and its agent; panics on a stack started without one.
    pub fn node(&self) -> (&Node, &NodeAgent) {
        let (node, agent) = self
            .node
            .as_ref()
            .expect("this stack has no node: start it with Stack::start_with_node");
        (node, agent)
    }

    /// Prints every log's tail; call from a test's failure path.
    pub fn dump_logs(&self) {
        if let Some((node, _)) = &self.node {
            node.dump_logs();
        }
        for process in [
            &self.kube.etcd,
            &self.kube.apiserver,
            &self.kube.controller_manager,
            &self.spire_server.process,
            &self.spire_agent.process,
        ] {
            eprintln!(
                "===== {} ({}) =====\n{}",
                process.name,
                process.log_path.display(),
                process.log_tail(40)
            );
        }
    }

    /// A guard that dumps the logs if the test panics while holding it.
    pub fn logs_on_panic(&self) -> LogsOnPanic<'_> {
        LogsOnPanic(self)
    }

    /// Stops every child and the sentinel.
    pub fn stop(&mut self) {
        // The sentinel goes first (SIGKILL: it must not act on group ids that are about to be
        // freed and could be reused); TempDir's drop removes the directory instead.
        let _ = self.sentinel.kill();
        let _ = self.sentinel.wait();
        if let Some((mut node, _)) = self.node.take() {
            node.stop();
        }
        self.spire_agent.stop();
        self.spire_server.stop();
        self.postgres.take();
        self.kube.stop();
    }
}

impl Drop for Stack {
    /// A stack of a test's own prints its logs when the test fails, then stops.
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.dump_logs();
        }
        self.stop();
    }
}

/// A shared piece of the bed (never dropped) as a test holds it: with a guard that prints
/// the stack's logs if the test fails.
pub struct Held<T: 'static> {
    value: &'static T,
    _logs: LogsOnPanic<'static>,
}

impl<T> Held<T> {
    pub fn new(value: &'static T, stack: &'static Stack) -> Self {
        Self {
            value,
            _logs: stack.logs_on_panic(),
        }
    }
}

impl<T> std::ops::Deref for Held<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.value
    }
}

pub struct LogsOnPanic<'a>(&'a Stack);

impl Drop for LogsOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.dump_logs();
        }
    }
}

/// Process groups of the control plane and SPIRE (what every stack runs).
fn core_groups(kube: &KubePlane, server: &SpireServer, agent: &SpireAgent) -> Vec<i32> {
    vec![
        kube.etcd.pgid(),
        kube.apiserver.pgid(),
        kube.controller_manager.pgid(),
        server.process.pgid(),
        agent.process.pgid(),
    ]
}

/// A shell that waits for this test process to exit (normally, by panic or by a kill), then
/// SIGKILLs every recorded process group and removes the stack's directory. Statics are never
/// dropped, so without it a shared stack would outlive the test binary.
///
/// It notices the exit through its stdin: the write end of that pipe lives only in this process
/// (std opens pipes close-on-exec), so the kernel closes it when the process dies, however it
/// dies, and `read` returns at once. It runs in its own process group so that whoever kills the
/// test binary's group (a CI job runner, a terminal) does not kill the sentinel with it.
fn spawn_sentinel(dir: &Path) -> Child {
    let script = format!(
        "read _; [ -f '{dir}/node/teardown.sh' ] && bash '{dir}/node/teardown.sh'; \
         kill -KILL -- $(sed 's/^/-/' '{dir}/pgids' 2>/dev/null) 2>/dev/null; rm -rf '{dir}'",
        dir = dir.display()
    );
    // bash, not sh: dash's `kill` cannot signal a process group (no `--`, `-pgid` is an option).
    Command::new("bash")
        .arg("-c")
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("bash must be available for the sentinel")
}

/// `kubectl` against this stack, panicking with output when it fails.
pub fn kubectl_ok(stack: &Stack, args: &[&str]) -> String {
    let (ok, stdout, stderr) = run(stack.kube.kubectl().args(args));
    assert!(ok, "kubectl {args:?} failed:\n{stdout}\n{stderr}");
    stdout
}

pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id() % 100_000,
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}
