//! The scale benchmark: N realistic Deployments under kube-controller-manager, then the
//! registrar from a cold start. Prints one JSON object on stdout; progress goes to stderr.
//!
//!   cargo run --release --example scale -- --deployments 10000 [--rest-seconds 300]
//!       [--datastore sqlite|sqlite-analyzed|postgres]
//!
//! PostgreSQL is Debian's, installed by `tests/testenv/postgres.sh` where missing.
//! `sqlite-analyzed` gives SPIRE's SQLite planner statistics first: as shipped, each create
//! scans every entry under the same parent (tests/testenv/sqlite-planner-statistics.sql).

#[path = "../common/mod.rs"]
mod common;

use common::args::flag;
use common::scale::Datastore;
use std::time::Duration;

#[tokio::main]
async fn main() {
    let deployments = flag("--deployments").map_or(1_000, |v| v.parse().expect("a number"));
    let rest = flag("--rest-seconds").map_or(300, |v| v.parse().expect("seconds"));
    let datastore = flag("--datastore").map_or(Datastore::Sqlite, |name| {
        Datastore::parse(&name).unwrap_or_else(|| {
            eprintln!("--datastore {name}: sqlite, sqlite-analyzed or postgres");
            std::process::exit(2);
        })
    });
    let report = common::scale::run(common::scale::Config {
        deployments,
        rest: Duration::from_secs(rest),
        datastore,
        write_queue_bound: None,
    })
    .await;
    println!("{report}");
}
