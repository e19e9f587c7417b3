//! The scale benchmark at a small N, so it cannot rot; the large runs are in docs/benchmarks.md. It
//! runs on PostgreSQL, so that test-bed option cannot rot either (every other test bed uses
//! SQLite), and with every kind of workload in turn (the two of each service account are of
//! different kinds).

mod common;

use std::time::Duration;

#[tokio::test(flavor = "multi_thread")]
async fn the_scale_benchmark_runs_and_reports_every_figure() {
    let report = common::scale::run(common::scale::Config {
        // 250 entries: two create chunks, the second created while the writer's queue (16
        // here) is full, so its Deployments are handed over as the queue drains.
        deployments: 500,
        kinds: &spiffe_registrar::keys::WorkloadKind::ALL,
        rest: Duration::from_secs(10),
        datastore: common::scale::Datastore::Postgres,
        write_queue_bound: Some(16),
        delete: 200,
        rollout: true,
    })
    .await;
    eprintln!("{report}");
    assert_eq!(report["entries"], 250);
    assert_eq!(report["datastore"], "postgres");
    for key in [
        "entries_s",
        "annotations_s",
        "live_annotations_s",
        "raw_create_s",
        "ratio_to_raw",
        "peak_rss_mib",
        "steady_rss_mib",
        "peak_heap_mib",
        "steady_heap_mib",
        "cpu_s_per_1000_status_updates",
        "namespace_delete_s",
        "rollout_s",
        // The cold start derives every service account; the live Deployments only theirs.
        "full_syncs",
        "changed_syncs",
        // At least one drift check falls in the rest (asserted below): its count took time.
        "count_ms_at_rest",
        "entries_ratio_to_raw_create",
        "entry_ids_ratio_to_raw",
        // The deleted entry came back; the deleted workloads and their entries are gone
        // (the phases wait for both, from the apiserver's side and SPIRE's).
        "drift_repair_s",
        "delete_s",
        "raw_delete_s",
        "delete_ratio_to_raw_patch",
        "restart_first_sync_s",
        "restart_peak_rss_mib",
    ] {
        let value = report[key].as_f64().unwrap_or(f64::NAN);
        assert!(value.is_finite() && value > 0.0, "{key} = {value}");
    }
    for key in [
        "cpu_s_per_min_at_rest",
        "spire_cpu_s_per_min_at_rest",
        "rest_cpu_s_per_min",
        "rest_kube_writes_per_min",
        "rest_event_writes_per_min",
    ] {
        let idle = report[key].as_f64().unwrap_or(f64::NAN);
        assert!(idle.is_finite() && idle >= 0.0, "{key} = {idle}");
    }
    // 550 rolled: the 330 Deployments, StatefulSets and DaemonSets among them write status.
    assert!(
        report["status_updates"].as_u64().unwrap_or(0) >= 330,
        "{report}"
    );
    let (heap, rss) = (
        report["steady_heap_mib"].as_f64().unwrap_or(f64::NAN),
        report["steady_rss_mib"].as_f64().unwrap_or(f64::NAN),
    );
    assert!(
        heap < rss,
        "the counted heap ({heap} MiB) is part of RSS ({rss} MiB)"
    );
    assert_eq!(report["deleted"], 200);
    assert_eq!(
        (
            report["restart_spire_writes"].as_f64(),
            report["restart_kube_writes"].as_f64()
        ),
        (Some(0.0), Some(0.0)),
        "a restart over a registered cluster writes nothing to SPIRE or to workloads"
    );
    assert_eq!(
        report["spire_lists_at_rest"], 0.0,
        "no SPIRE list at rest between resyncs"
    );
    let at_rest = report["spire_calls_per_min_at_rest"]
        .as_f64()
        .unwrap_or(f64::NAN);
    assert!(
        (1.0..=12.0).contains(&at_rest),
        "at rest: drift checks only, one count per hint every 10 s ({at_rest}/min)"
    );
}
