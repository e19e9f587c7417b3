//! `tests/testenv/up [--node]`: the tests' stack in the foreground, for humans (with `--node`,
//! the node and the SPIRE agent DaemonSet too). Prints how to reach it and stops everything on
//! Ctrl-C (or when killed: the sentinel cleans up).

#[path = "../common/mod.rs"]
mod common;

fn main() {
    let stack = if std::env::args().any(|arg| arg == "--node") {
        common::Stack::start_with_node()
    } else {
        common::Stack::start()
    };
    let server_cli = common::paths::spire_bin().join("spire-server");
    let kube_bin = common::paths::kube_bin();
    println!("export KUBECONFIG={}", stack.kube.kubeconfig.display());
    println!(
        "export PATH={}:{}:$PATH",
        kube_bin.display(),
        common::paths::spire_bin().display()
    );
    println!("# kube-apiserver:          {}", stack.kube.url);
    println!(
        "# spire-server admin UDS:  {}",
        stack.spire_server.socket.display()
    );
    println!(
        "# spire-server TCP:        127.0.0.1:{}",
        stack.spire_server.port
    );
    println!(
        "# spire-agent Workload API: {}",
        stack.spire_agent.socket.display()
    );
    println!("# agent SPIFFE ID:         {}", stack.spire_agent.agent_id);
    if let Some((node, agent)) = &stack.node {
        println!("# node:                    {}", node.dir.display());
        println!("# node agent Workload API: {}", agent.socket.display());
        println!("# workload reports:        {}", agent.reports.display());
    }
    println!("# logs:                    {}", stack.dir().display());
    println!(
        "# e.g. {} entry show -socketPath {}",
        server_cli.display(),
        stack.spire_server.socket.display()
    );
    println!("# Ctrl-C stops everything.");
    let (tx, rx) = std::sync::mpsc::channel();
    ctrlc_wait(tx);
    let _ = rx.recv();
    drop(stack);
}

/// Waits for SIGINT/SIGTERM on a helper thread without installing unsafe handlers.
fn ctrlc_wait(tx: std::sync::mpsc::Sender<()>) {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a signal runtime must build");
        runtime.block_on(async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("SIGTERM handler must install");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        });
        let _ = tx.send(());
    });
}
