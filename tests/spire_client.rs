//! The SPIRE Entry API client against a real spire-server, over both transports: the admin
//! Unix socket and TCP with SPIFFE mTLS (our SVID from the real agent's Workload API).

mod common;

use common::Stack;
use common::spire::TRUST_DOMAIN;
use spiffe_registrar::spire::metrics::SpireMetrics;
use spiffe_registrar::spire::proto::entry as pb;
use spiffe_registrar::spire::proto::entry::entry_client::EntryClient;
use spiffe_registrar::spire::transport::Connection;
use spiffe_registrar::spire::{
    ClientSettings, Entry, EntryApi, GrpcEntryClient, ItemError, Ownership, Selector,
    SpireEndpoint, connect,
};
use std::collections::BTreeSet;
use std::time::Duration;

const BULK: usize = 2_000;

fn settings() -> ClientSettings {
    ClientSettings {
        // Small pages so listing 2,000 entries walks several pages.
        page_size: 300,
        requests_per_second: 0.0,
        ..ClientSettings::default()
    }
}

fn uds_endpoint(stack: &Stack) -> SpireEndpoint {
    SpireEndpoint::Unix {
        socket: stack.spire_server.socket.clone(),
    }
}

/// Registers an admin entry for this process's uid (once per stack) and returns the TCP endpoint.
fn tcp_endpoint(stack: &Stack) -> SpireEndpoint {
    static ADMIN: std::sync::Once = std::sync::Once::new();
    ADMIN.call_once(|| {
        let uid = nix::unistd::getuid().as_raw();
        stack.spire_server.cli_ok(
            &["entry", "create"],
            &[
                "-parentID",
                &stack.spire_agent.agent_id,
                "-spiffeID",
                &format!("spiffe://{TRUST_DOMAIN}/test/registrar-admin"),
                "-selector",
                &format!("unix:uid:{uid}"),
                "-admin",
            ],
        );
    });
    SpireEndpoint::Tcp {
        address: format!("127.0.0.1:{}", stack.spire_server.port),
        server_id: format!("spiffe://{TRUST_DOMAIN}/spire/server"),
        workload_api: format!("unix://{}", stack.spire_agent.socket.display()),
    }
}

async fn client(endpoint: &SpireEndpoint, cluster: &str) -> (GrpcEntryClient, Connection) {
    client_with(endpoint, cluster, settings()).await
}

async fn client_with(
    endpoint: &SpireEndpoint,
    cluster: &str,
    settings: ClientSettings,
) -> (GrpcEntryClient, Connection) {
    let connection = connect(endpoint, Duration::from_secs(60))
        .await
        .expect("connect must succeed");
    let ownership = Ownership::new(cluster).expect("valid cluster name");
    let metrics = SpireMetrics::unregistered();
    let client = GrpcEntryClient::new(connection.channel.clone(), ownership, settings, metrics);
    (client, connection)
}

fn workload_entry(ownership: &Ownership, parent: &str, tag: &str, i: usize) -> Entry {
    let spiffe_id = format!("spiffe://{TRUST_DOMAIN}/{tag}/w{i}");
    let selectors = vec![
        Selector::new("k8s", format!("ns:{tag}")),
        Selector::new("k8s", format!("sa:w{i}")),
    ];
    Entry {
        id: ownership.entry_id(&spiffe_id, parent, &selectors),
        spiffe_id,
        parent_id: parent.to_string(),
        selectors,
        x509_svid_ttl: 3600,
        hint: ownership.hint().to_string(),
        ..Entry::default()
    }
    .normalize()
}

/// Every entry with `hint` as SPIRE stores it, without our ownership filter: duplicates with
/// server-generated IDs would show up here.
async fn raw_by_hint(endpoint: &SpireEndpoint, hint: &str) -> Vec<String> {
    let connection = connect(endpoint, Duration::from_secs(60))
        .await
        .expect("connect");
    let mut raw = EntryClient::new(connection.channel.clone());
    let response = raw
        .list_entries(pb::ListEntriesRequest {
            filter: Some(pb::list_entries_request::Filter {
                by_hint: Some(hint.into()),
                ..Default::default()
            }),
            page_size: 0,
            ..Default::default()
        })
        .await
        .expect("raw list must succeed")
        .into_inner();
    response.entries.into_iter().map(|e| e.id).collect()
}

async fn full_sequence(stack: &Stack, endpoint: SpireEndpoint, cluster: &str) {
    let (client, _connection) = client(&endpoint, cluster).await;
    let ownership = client.ownership().clone();
    let parent = stack.spire_agent.agent_id.clone();
    let wanted: Vec<Entry> = (0..BULK)
        .map(|i| workload_entry(&ownership, &parent, cluster, i))
        .collect();
    let wanted_ids: BTreeSet<String> = wanted.iter().map(|e| e.id.clone()).collect();

    // Create 2,000 in batches; every result is the entry as stored, with our ID.
    let created = client.create(wanted.clone()).await;
    assert_eq!(created.len(), BULK);
    for (result, want) in created.iter().zip(&wanted) {
        let got = result
            .as_ref()
            .unwrap_or_else(|e| panic!("create {} failed: {e}", want.id));
        assert_eq!(got.id, want.id);
        assert_eq!(got.selectors, want.selectors);
        assert_eq!(got.x509_svid_ttl, 3600);
    }

    // Listed back by hint over several pages.
    let listed = client.list_ours().await.expect("list must succeed");
    assert_eq!(
        listed.iter().map(|e| e.id.clone()).collect::<BTreeSet<_>>(),
        wanted_ids
    );

    // Re-create: AlreadyExists → success with the same IDs, and no duplicate stored.
    let again = client.create(wanted.clone()).await;
    assert!(
        again
            .iter()
            .zip(&wanted)
            .all(|(r, w)| r.as_ref().is_ok_and(|e| e.id == w.id))
    );
    let raw = raw_by_hint(&endpoint, ownership.hint()).await;
    assert_eq!(raw.len(), BULK, "re-creating must not duplicate entries");

    // Update TTLs through the mask and read them back; the identity triple is untouched.
    let bumped: Vec<Entry> = wanted[..250]
        .iter()
        .map(|e| Entry {
            x509_svid_ttl: 900,
            jwt_svid_ttl: 300,
            dns_names: vec!["w.example.org".into()],
            ..e.clone()
        })
        .collect();
    let updated = client.update(bumped.clone()).await;
    for (result, want) in updated.iter().zip(&bumped) {
        let got = result
            .as_ref()
            .unwrap_or_else(|e| panic!("update {} failed: {e}", want.id));
        assert_eq!((got.x509_svid_ttl, got.jwt_svid_ttl), (900, 300));
        assert!(
            got.revision_number >= 1,
            "SPIRE bumps the revision on update"
        );
    }
    let listed = client.list_ours().await.expect("list");
    let first = listed
        .iter()
        .find(|e| e.id == wanted[0].id)
        .expect("entry 0 listed");
    assert_eq!((first.x509_svid_ttl, first.jwt_svid_ttl), (900, 300));
    assert_eq!(first.dns_names, vec!["w.example.org".to_string()]);
    assert_eq!(first.selectors, wanted[0].selectors);
    let untouched = listed
        .iter()
        .find(|e| e.id == wanted[BULK - 1].id)
        .expect("last entry listed");
    assert_eq!(untouched.x509_svid_ttl, 3600);

    // Delete everything; deleting again is still a success (already gone).
    assert!(
        client
            .delete(wanted.clone())
            .await
            .iter()
            .all(Result::is_ok)
    );
    assert!(
        client
            .delete(wanted[..10].to_vec())
            .await
            .iter()
            .all(Result::is_ok)
    );
    assert!(client.list_ours().await.expect("list").is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn full_sequence_over_the_admin_socket() {
    let stack = Stack::shared_held();
    full_sequence(&stack, uds_endpoint(&stack), "uds").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn full_sequence_over_tcp_mtls_with_an_agent_svid() {
    let stack = Stack::shared_held();
    let endpoint = tokio::task::block_in_place(|| tcp_endpoint(&stack));
    full_sequence(&stack, endpoint, "tcp").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn tcp_refuses_a_server_with_another_spiffe_id() {
    let stack = Stack::shared_held();
    let SpireEndpoint::Tcp {
        address,
        workload_api,
        ..
    } = tokio::task::block_in_place(|| tcp_endpoint(&stack))
    else {
        unreachable!("tcp_endpoint returns Tcp")
    };
    let impostor = SpireEndpoint::Tcp {
        address,
        workload_api,
        server_id: format!("spiffe://{TRUST_DOMAIN}/not-the-server"),
    };
    let mut short = settings();
    short.retry.budget = Duration::from_secs(2);
    let (client, _connection) = client_with(&impostor, "impostor", short).await;
    let error = client
        .list_ours()
        .await
        .expect_err("the server's SPIFFE ID does not match");
    assert!(
        matches!(error, spiffe_registrar::spire::SpireError::Exhausted { .. }),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn other_writers_entries_are_never_ours() {
    let stack = Stack::shared_held();
    let endpoint = uds_endpoint(&stack);
    let (client, _connection) = client(&endpoint, "foreign-check").await;
    let ownership = client.ownership().clone();
    let parent = stack.spire_agent.agent_id.clone();
    let mine = workload_entry(&ownership, &parent, "foreign-check", 0);
    client
        .create(vec![mine.clone()])
        .await
        .remove(0)
        .expect("create ours");

    // Same parent and namespace selector, no hint: another writer's entry.
    let show = stack.spire_server.cli_ok(
        &["entry", "create"],
        &[
            "-parentID",
            &parent,
            "-spiffeID",
            &format!("spiffe://{TRUST_DOMAIN}/foreign-check/theirs"),
            "-selector",
            "k8s:ns:foreign-check",
        ],
    );
    let foreign_id = entry_id_from_cli(&show);
    // Our hint but not our ID: still not ours.
    let show = stack.spire_server.cli_ok(
        &["entry", "create"],
        &[
            "-parentID",
            &parent,
            "-spiffeID",
            &format!("spiffe://{TRUST_DOMAIN}/foreign-check/hinted"),
            "-selector",
            "k8s:ns:foreign-check",
            "-hint",
            ownership.hint(),
        ],
    );
    let hinted_id = entry_id_from_cli(&show);

    let listed: Vec<String> = client
        .list_ours()
        .await
        .expect("list")
        .into_iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(listed, vec![mine.id.clone()]);
    let results = client
        .delete(vec![
            // As SPIRE would list them: no hint, and our hint on a foreign ID.
            Entry {
                id: foreign_id.clone(),
                hint: String::new(),
                ..mine.clone()
            },
            Entry {
                id: hinted_id.clone(),
                ..mine.clone()
            },
            mine.clone(),
        ])
        .await;
    assert_eq!(
        results[0],
        Err(ItemError::NotOurs {
            id: foreign_id.clone()
        })
    );
    assert_eq!(
        results[1],
        Err(ItemError::NotOurs {
            id: hinted_id.clone()
        })
    );
    assert_eq!(results[2], Ok(mine.id.clone()));
    for id in [&foreign_id, &hinted_id] {
        stack
            .spire_server
            .cli_ok(&["entry", "show"], &["-entryID", id]);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_entries_fail_permanently_with_spires_message() {
    let stack = Stack::shared_held();
    let (client, _connection) = client(&uds_endpoint(&stack), "invalid-check").await;
    let ownership = client.ownership().clone();
    let parent = stack.spire_agent.agent_id.clone();
    let good = workload_entry(&ownership, &parent, "invalid-check", 0);
    let mut bad = workload_entry(&ownership, &parent, "invalid-check", 1);
    bad.spiffe_id = format!("spiffe://{TRUST_DOMAIN}/invalid-check/has space//x");
    bad.id = ownership.entry_id(&bad.spiffe_id, &bad.parent_id, &bad.selectors);
    let results = client.create(vec![bad, good.clone()]).await;
    match &results[0] {
        Err(error @ ItemError::Invalid { message, .. }) => {
            assert!(!error.is_retryable());
            assert!(
                message.contains("failed to convert entry"),
                "SPIRE's own message is kept: {message}"
            );
        }
        other => panic!("expected a permanent invalid-argument error, got {other:?}"),
    }
    assert_eq!(
        results[1].as_ref().map(|e| e.id.clone()),
        Ok(good.id.clone()),
        "batches are not atomic"
    );
    client.delete(vec![good]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn survives_a_spire_server_crash_mid_sequence() {
    let mut stack = tokio::task::block_in_place(Stack::start);
    let endpoint = uds_endpoint(&stack);
    // A generous budget: on a loaded 2-core CI machine a restart can take a while, and the
    // claim here is that the client rides it out, not how fast the server comes back.
    let mut patient = settings();
    patient.retry.budget = Duration::from_secs(120);
    let (client, _connection) = client_with(&endpoint, "crash", patient).await;
    let client = std::sync::Arc::new(client);
    let ownership = client.ownership().clone();
    let parent = stack.spire_agent.agent_id.clone();
    let first: Vec<Entry> = (0..300)
        .map(|i| workload_entry(&ownership, &parent, "crash", i))
        .collect();
    let second: Vec<Entry> = (300..600)
        .map(|i| workload_entry(&ownership, &parent, "crash", i))
        .collect();
    assert!(client.create(first.clone()).await.iter().all(Result::is_ok));

    // Crash the server, start writing, bring it back while the client is retrying.
    stack.spire_server.kill();
    let writer = {
        let (client, second) = (client.clone(), second.clone());
        tokio::spawn(async move { client.create(second).await })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !writer.is_finished(),
        "the write must be waiting for the server"
    );
    tokio::task::block_in_place(|| stack.spire_server.restart());
    stack.record_groups();
    let results = writer.await.expect("writer task");
    for result in &results {
        assert!(
            result.is_ok(),
            "after the restart every create succeeds: {result:?}"
        );
    }

    // Crash again before the deletes; they complete once the server is back.
    stack.spire_server.kill();
    let deleter = {
        let client = client.clone();
        let doomed: Vec<Entry> = first.iter().chain(&second).cloned().collect();
        tokio::spawn(async move { client.delete(doomed).await })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    tokio::task::block_in_place(|| stack.spire_server.restart());
    stack.record_groups();
    let deleted = deleter.await.expect("deleter task");
    let failed: Vec<_> = deleted.iter().filter(|r| r.is_err()).collect();
    assert!(
        failed.is_empty(),
        "{} deletes failed after the restart, e.g. {:?}",
        failed.len(),
        failed.first()
    );
    assert!(
        client.list_ours().await.expect("list").is_empty(),
        "final state: nothing of ours left"
    );
    tokio::task::block_in_place(|| stack.stop());
}

fn entry_id_from_cli(output: &str) -> String {
    output
        .lines()
        .find_map(|l| l.strip_prefix("Entry ID"))
        .map(|rest| rest.trim_start_matches([' ', ':', '\t']).trim().to_string())
        .unwrap_or_else(|| panic!("no Entry ID in CLI output: {output}"))
}
