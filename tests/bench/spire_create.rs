//! Raw batch-create throughput of the local spire-server: the physical limit of how fast the
//! controller can converge. Starts its own spire-server (sqlite, as in the tests), creates
//! 10,000 entries per batch size through our client, deletes them again, prints a table.
//!
//!   cargo run --release --example spire-bench [-- ENTRIES [BATCH_SIZE...]]

#[path = "../common/mod.rs"]
mod common;

use spiffe_registrar::spire::metrics::SpireMetrics;
use spiffe_registrar::spire::{
    ClientSettings, Entry, EntryApi, GrpcEntryClient, Ownership, Selector, SpireEndpoint, connect,
};
use std::time::{Duration, Instant};

#[tokio::main]
async fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers only"))
        .collect();
    let entries = args.first().copied().unwrap_or(10_000);
    let batch_sizes = if args.len() > 1 {
        args[1..].to_vec()
    } else {
        vec![10, 50, 100, 250, 500, 1000]
    };

    let dir = tempfile::Builder::new()
        .prefix("sr-bench-")
        .tempdir_in("/tmp")
        .expect("temp dir");
    let server = tokio::task::spawn_blocking({
        let path = dir.path().to_path_buf();
        move || common::spire::SpireServer::start(&path)
    })
    .await
    .expect("server start");
    let endpoint = SpireEndpoint::Unix {
        socket: server.socket.clone(),
    };
    let connection = connect(&endpoint, Duration::from_secs(10))
        .await
        .expect("connect");

    println!("spire-server (sqlite, local UDS), {entries} entries per run");
    println!(
        "{:>10} {:>12} {:>14} {:>12} {:>14}",
        "batch", "create s", "create ent/s", "delete s", "delete ent/s"
    );
    for (run, batch) in batch_sizes.into_iter().enumerate() {
        let ownership = Ownership::new(&format!("bench{run}")).expect("valid");
        let settings = ClientSettings {
            create_batch: batch,
            delete_batch: batch,
            requests_per_second: 0.0,
            ..ClientSettings::default()
        };
        let client = GrpcEntryClient::new(
            connection.channel.clone(),
            ownership.clone(),
            settings,
            SpireMetrics::unregistered(),
        );
        let wanted: Vec<Entry> = (0..entries).map(|i| entry(&ownership, run, i)).collect();
        let doomed = wanted.clone();

        let started = Instant::now();
        let created = client.create(wanted).await;
        let create_secs = started.elapsed().as_secs_f64();
        let failures = created.iter().filter(|r| r.is_err()).count();
        assert_eq!(failures, 0, "batch {batch}: {failures} creates failed");

        let started = Instant::now();
        let deleted = client.delete(doomed).await;
        let delete_secs = started.elapsed().as_secs_f64();
        assert!(
            deleted.iter().all(Result::is_ok),
            "batch {batch}: deletes failed"
        );

        println!(
            "{batch:>10} {create_secs:>12.2} {:>14.0} {delete_secs:>12.2} {:>14.0}",
            entries as f64 / create_secs,
            entries as f64 / delete_secs
        );
    }
    drop(server);
}

fn entry(ownership: &Ownership, run: usize, i: usize) -> Entry {
    let spiffe_id = format!(
        "spiffe://{}/bench{run}/ns/n{}/sa/s{i}",
        common::spire::TRUST_DOMAIN,
        i % 100
    );
    let parent = format!(
        "spiffe://{}/spire/agent/k8s_psat/bench/node",
        common::spire::TRUST_DOMAIN
    );
    let selectors = vec![
        Selector::new("k8s", format!("ns:n{}", i % 100)),
        Selector::new("k8s", format!("sa:s{i}")),
    ];
    Entry {
        id: ownership.entry_id(&spiffe_id, &parent, &selectors),
        spiffe_id,
        parent_id: parent,
        selectors,
        x509_svid_ttl: 3600,
        hint: ownership.hint().to_string(),
        ..Entry::default()
    }
}
