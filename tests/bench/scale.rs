//! The scale benchmark: N realistic Deployments under kube-controller-manager, then the
//! registrar from a cold start. Prints one JSON object on stdout; progress goes to stderr.
//!
//!   cargo run --release --example scale -- --deployments 10000 [--rest-seconds 300]
//!
//! `--datastore postgres` is not in the test bed yet (issue 11); SQLite is what runs.

#[path = "../common/mod.rs"]
mod common;

use std::time::Duration;

fn flag(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main]
async fn main() {
    let deployments = flag("--deployments").map_or(1_000, |v| v.parse().expect("a number"));
    let rest = flag("--rest-seconds").map_or(300, |v| v.parse().expect("seconds"));
    if let Some(datastore) = flag("--datastore").filter(|d| d != "sqlite") {
        eprintln!("--datastore {datastore}: only sqlite is in the test bed so far");
        std::process::exit(2);
    }
    let report = common::scale::run(common::scale::Config {
        deployments,
        rest: Duration::from_secs(rest),
    })
    .await;
    println!("{report}");
}
