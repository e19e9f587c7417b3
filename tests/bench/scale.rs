//! The scale benchmark: N realistic workloads under kube-controller-manager, then the
//! registrar from a cold start. Prints one JSON object on stdout; progress goes to stderr.
//!
//!   cargo run --release --example scale -- --deployments 10000 [--rest-seconds 300]
//!       [--datastore sqlite|sqlite-analyzed|postgres] [--kinds deployments|mixed|statefulsets|daemonsets|jobs|cronjobs]
//!       [--delete 1000] [--no-rollout]
//!
//! `--kinds mixed` makes workload i a Deployment, StatefulSet, DaemonSet, Job or CronJob in
//! turn (i mod 5), so the two workloads of each service account are of different kinds.
//!
//! PostgreSQL is Debian's, installed by `tests/testenv/postgres.sh` where missing.
//! `sqlite-analyzed` gives SPIRE's SQLite planner statistics first: as shipped, each create
//! scans every entry under the same parent (tests/testenv/sqlite-planner-statistics.sql).

#[path = "../common/mod.rs"]
mod common;

use common::args::flag;
use common::scale::Datastore;
use spiffe_registrar::keys::WorkloadKind;
use std::time::Duration;

#[tokio::main]
async fn main() {
    let deployments = flag("--deployments").map_or(1_000, |v| v.parse().expect("a number"));
    let rest = flag("--rest-seconds").map_or(300, |v| v.parse().expect("seconds"));
    let delete = flag("--delete").map_or(1_000, |v| v.parse().expect("a number"));
    let datastore = flag("--datastore").map_or(Datastore::Sqlite, |name| {
        Datastore::parse(&name).unwrap_or_else(|| {
            eprintln!("--datastore {name}: sqlite, sqlite-analyzed or postgres");
            std::process::exit(2);
        })
    });
    let kinds: &'static [WorkloadKind] = match flag("--kinds").as_deref() {
        None | Some("deployments") => &[WorkloadKind::Deployment],
        Some("mixed") => &WorkloadKind::ALL,
        // One kind alone (its memory per workload): statefulsets, daemonsets, jobs, cronjobs.
        Some(other) => match WorkloadKind::parse_builtin(other) {
            Some(kind) if WorkloadKind::ALL.contains(&kind) => Vec::leak(vec![kind]),
            _ => {
                eprintln!("--kinds {other}: deployments, mixed or one kind (e.g. statefulsets)");
                std::process::exit(2);
            }
        },
    };
    let report = common::scale::run(common::scale::Config {
        deployments,
        kinds,
        rest: Duration::from_secs(rest),
        datastore,
        write_queue_bound: None,
        delete,
        rollout: !std::env::args().any(|a| a == "--no-rollout"),
    })
    .await;
    println!("{report}");
}
