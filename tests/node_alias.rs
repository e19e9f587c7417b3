//! The node alias from SPIRE's side (invariant 11: entries reach agents; the alias exists
//! before any entry that hangs from it and outlives the last one), sampled through changes.
//! The workload's side of the alias is in `workload_identity.rs`, on the real node.
#![cfg(feature = "e2e")]

mod common;

use common::k8s::eventually;
use common::registrar::uninstall;
use common::sampler::spire_client;
use common::world::{HOME, Scenario, TD, WEBHOOK_CONFIG, launch, options, own_plane};
use serde_json::json;
use spiffe_registrar::spire::Entry;
use spiffe_registrar::spire::convert::entry_from_proto;
use spiffe_registrar::spire::node_alias::is_node_alias;
use spiffe_registrar::spire::proto::entry::ListEntriesRequest;
use spiffe_registrar::spire::proto::entry::list_entries_request::Filter;
use std::path::Path;
use std::time::{Duration, Instant};

const CLUSTER: &str = "alias";

/// Our entries in SPIRE (by our hint), one look.
async fn ours(socket: &Path) -> Vec<Entry> {
    let mut client = spire_client(socket).await;
    let request = ListEntriesRequest {
        filter: Some(Filter {
            by_hint: Some(format!("spiffe-registrar/{CLUSTER}")),
            ..Default::default()
        }),
        page_size: 1000,
        ..Default::default()
    };
    let response = client
        .list_entries(request)
        .await
        .expect("SPIRE lists entries")
        .into_inner();
    response.entries.into_iter().map(entry_from_proto).collect()
}

fn alias_id(psat: &str) -> String {
    format!("spiffe://{TD}/spiffe-registrar/k8s-psat/{psat}")
}

/// Samples our entries until `done` holds for a sample (or a minute passes), asserting at
/// every sample that each entry hangs from an alias present in that same sample (or from
/// an explicit parent), and that `sa_id` always has an entry. Returns the last sample.
async fn sample_until(socket: &Path, sa_id: &str, done: impl Fn(&[Entry]) -> bool) -> Vec<Entry> {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let sample = ours(socket).await;
        let aliases: Vec<&str> = sample
            .iter()
            .filter(|e| is_node_alias(e))
            .map(|e| e.spiffe_id.as_str())
            .collect();
        for entry in sample.iter().filter(|e| !is_node_alias(e)) {
            assert!(
                !entry.parent_id.contains("/spiffe-registrar/k8s-psat/")
                    || aliases.contains(&entry.parent_id.as_str()),
                "{} hangs from {}, which SPIRE does not hold: {sample:?}",
                entry.id,
                entry.parent_id
            );
        }
        assert!(
            sample.iter().any(|e| e.spiffe_id == sa_id),
            "{sa_id} has no entry: {sample:?}"
        );
        if done(&sample) {
            return sample;
        }
        assert!(Instant::now() < deadline, "timed out: {sample:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_alias_is_kept_repaired_and_moved_make_before_break() {
    let (stack, port) = own_plane();
    let socket = stack.spire_server.socket.clone();
    let start = |name: &str, psat: &str| {
        launch(
            &stack,
            Some(port),
            options(
                CLUSTER,
                name,
                vec![
                    format!("--node-alias-cluster={psat}"),
                    "--transition-grace=5s".into(),
                    // Drift is what notices a wiped alias: look often.
                    "--resync-interval=10s".into(),
                ],
            ),
        )
    };
    let mut registrar = start("registrar-one", "one");
    let s = Scenario::new(&stack.kube).await;
    s.policy(
        "p",
        json!({
            "trustDomain": TD,
            "ttl": "1h",
            "namespaceSelector": { "matchLabels": { "e2e/test": s.tag } }
        }),
    )
    .await;
    let ns = s.namespace(true).await;
    s.registered(&ns, "web", "api").await;
    let sa_id = format!("spiffe://{TD}/ns/{ns}/sa/api");

    // An unset parentID: the entry hangs from the alias of psat cluster "one".
    let sample = sample_until(&socket, &sa_id, |sample| {
        sample.iter().any(|e| e.spiffe_id == alias_id("one"))
    })
    .await;
    let alias = sample
        .iter()
        .find(|e| e.spiffe_id == alias_id("one"))
        .expect("found above")
        .clone();
    assert_eq!(alias.parent_id, format!("spiffe://{TD}/spire/server"));
    assert_eq!(alias.selectors.len(), 1);
    assert_eq!(
        (
            alias.selectors[0].kind.as_str(),
            alias.selectors[0].value.as_str()
        ),
        ("k8s_psat", "cluster:one")
    );
    let workload = sample
        .iter()
        .find(|e| e.spiffe_id == sa_id)
        .expect("registered");
    assert_eq!(workload.parent_id, alias_id("one"));

    // Wiped behind our back: repaired under the same ID.
    stack
        .spire_server
        .cli_ok(&["entry", "delete"], &["-entryID", &alias.id]);
    let repaired = eventually(
        "the alias created again",
        Duration::from_secs(90),
        || async { ours(&socket).await.into_iter().find(|e| e.id == alias.id) },
    )
    .await;
    assert_eq!(repaired.selectors, alias.selectors);

    // A new k8s_psat name: the new alias and entries are made before the old ones go, and
    // the old alias goes last.
    tokio::task::block_in_place(|| registrar.process.stop(Duration::from_secs(10)));
    registrar = start("registrar-two", "two");
    let last = sample_until(&socket, &sa_id, |sample| {
        !sample.iter().any(|e| e.spiffe_id == alias_id("one"))
    })
    .await;
    let moved = last.iter().find(|e| e.spiffe_id == sa_id).expect("kept");
    assert_eq!(moved.parent_id, alias_id("two"));
    assert_eq!(
        last.iter().filter(|e| is_node_alias(e)).count(),
        1,
        "only the new alias remains: {last:?}"
    );

    // The last Deployment gone: its entry goes, then the alias.
    s.delete_deployment(&ns, "web").await;
    eventually(
        "nothing of ours is left in SPIRE",
        Duration::from_secs(90),
        || async { ours(&socket).await.is_empty().then_some(()) },
    )
    .await;

    // Registered again, then uninstalled with its entries: the alias goes too (last).
    s.registered(&ns, "again", "api").await;
    sample_until(&socket, &sa_id, |sample| sample.iter().any(is_node_alias)).await;
    registrar.process.terminate(Duration::from_secs(10));
    let args = [
        format!("--namespace={HOME}"),
        format!("--webhook-configuration={WEBHOOK_CONFIG}"),
        "--delete-entries".to_string(),
        format!("--cluster-name={CLUSTER}"),
        format!("--spire-socket={}", socket.display()),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, stdout, stderr) = uninstall(&stack, &args);
    assert!(ok, "uninstall failed:\n{stdout}\n{stderr}");
    assert!(
        ours(&socket).await.is_empty(),
        "uninstall left entries of ours"
    );
}
