//! The lake's table suite, run against every backend (see `support`): idempotent
//! init, idempotent appends, concurrent writers, range scans with partition pruning,
//! the incremental tail, snapshots and time travel, SQL, and `load`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::Arc;

use arrow::array::{AsArray, RecordBatch};
use arrow::datatypes::Int64Type;
use futures::TryStreamExt;
use futures::future::join_all;
use signalweave_fixtures::{Generator, Record, WorkloadSpec};
use signalweave_lake::{AsOf, CommitIdentity, Lake, LakeTable, LoadOptions};
use signalweave_model::{
    Event, EventBatchBuilder, EventValidator, SchemaRegistry, ValidationLimits,
};

const DAY_US: i64 = 86_400_000_000;

fn events(spec: WorkloadSpec) -> Vec<Event> {
    Generator::new(spec)
        .filter_map(|r| match r {
            Record::Event(mut e) => {
                e.ingest_time_us = e.event_time_us + 500_000;
                Some(e)
            }
            _ => None,
        })
        .collect()
}

fn batch(events: &[Event]) -> RecordBatch {
    let mut b = EventBatchBuilder::with_capacity(events.len());
    for e in events {
        b.push(e);
    }
    b.finish().unwrap()
}

/// Three days of events, 600 per day.
fn three_days() -> Vec<Event> {
    events(WorkloadSpec {
        events: 1_800,
        events_per_sec: 1,
        ..Default::default()
    })
    .into_iter()
    .enumerate()
    .map(|(i, mut e)| {
        e.event_time_us = signalweave_fixtures::DEFAULT_START_US
            + (i as i64 / 600) * DAY_US
            + (i as i64 % 600) * 1_000_000;
        e
    })
    .collect()
}

async fn count(lake: &Lake, sql: &str) -> i64 {
    count_in(&lake.session_context().await.unwrap(), sql).await
}

/// The first value of `sql`'s answer in `ctx`: a count.
async fn count_in(ctx: &datafusion::prelude::SessionContext, sql: &str) -> i64 {
    let batches = ctx.sql(sql).await.unwrap().collect().await.unwrap();
    batches[0].column(0).as_primitive::<Int64Type>().value(0)
}

/// `select count(*)` of `events` in a session pinned as `as_of` says.
async fn count_as_of(lake: &Lake, as_of: AsOf) -> i64 {
    let ctx = lake.session_context_as_of(as_of).await.unwrap();
    let out = ctx
        .sql("select count(*) from signalweave.events")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    out[0].column(0).as_primitive::<Int64Type>().value(0)
}

fn rows(batches: &[RecordBatch]) -> usize {
    batches.iter().map(RecordBatch::num_rows).sum()
}

/// Appends `evs` to `events` in commits of `chunk` events, named `writer`.
async fn land_in_chunks(lake: &Lake, evs: &[Event], chunk: usize, writer: &str) {
    for (i, part) in evs.chunks(chunk).enumerate() {
        lake.append(
            LakeTable::Events,
            &[batch(part)],
            &CommitIdentity::new(writer, i as u64),
        )
        .await
        .unwrap();
    }
}

/// How many of `evs` each customer has.
fn per_customer(evs: &[Event]) -> std::collections::HashMap<&str, usize> {
    let mut n: std::collections::HashMap<&str, usize> = Default::default();
    for e in evs {
        if let Some(c) = e.customer_id.as_deref() {
            *n.entry(c).or_default() += 1;
        }
    }
    n
}

async fn open(b: &support::Backend) -> Lake {
    let lake = Lake::open(b.config.clone()).await.unwrap();
    lake.init().await.unwrap();
    lake
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_is_idempotent_and_safe_concurrently() {
    for b in support::backends() {
        let lake = Lake::open(b.config.clone()).await.unwrap();
        let results = join_all((0..3).map(|_| lake.init())).await;
        let mut created = 0;
        for r in results {
            created += r.unwrap().into_iter().filter(|(_, new)| *new).count();
        }
        assert_eq!(created, 3, "{}: each table created exactly once", b.name);
        let again = lake.init().await.unwrap();
        assert!(again.iter().all(|(_, new)| !new), "{}", b.name);
        // A second process opening the same lake sees the same tables.
        let other = Lake::open(b.config.clone()).await.unwrap();
        for t in LakeTable::ALL {
            other.table(t).await.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn append_is_idempotent_under_retry() {
    for b in support::backends() {
        let lake = open(&b).await;
        let evs = three_days();
        let data = batch(&evs[..500]);
        let id = CommitIdentity::new("writer-a", 7);
        let first = lake
            .append(LakeTable::Events, std::slice::from_ref(&data), &id)
            .await
            .unwrap();
        assert!(!first.already_committed);
        assert_eq!(first.rows, 500);
        let retry = lake
            .append(LakeTable::Events, std::slice::from_ref(&data), &id)
            .await
            .unwrap();
        assert!(retry.already_committed, "{}: retry recognised", b.name);
        assert_eq!(retry.snapshot_id, first.snapshot_id);
        // Same writer, next sequence: a new commit.
        let next = lake
            .append(
                LakeTable::Events,
                &[data],
                &CommitIdentity::new("writer-a", 8),
            )
            .await
            .unwrap();
        assert!(!next.already_committed);
        assert_eq!(
            count(&lake, "select count(*) from signalweave.events").await,
            1000,
            "{}",
            b.name
        );
        let snaps = lake.snapshots(LakeTable::Events).await.unwrap();
        assert_eq!(snaps.len(), 2);
        assert_eq!(snaps[0].writer_id.as_deref(), Some("writer-a"));
        assert_eq!(snaps[0].batch_seq, Some(7));
        // Idempotency outlives snapshot retention: expiry (iceberg's, then a maintenance
        // pass) records the identities of the snapshots it removes, and a late retry of
        // either commit is still recognised.
        lake.expire_snapshots(LakeTable::Events, Some(1), Some(i64::MAX))
            .await
            .unwrap();
        let late_retry = lake
            .append(LakeTable::Events, &[batch(&evs[..500])], &id)
            .await
            .unwrap();
        assert!(late_retry.already_committed, "{}: after expiry", b.name);
        assert_eq!(late_retry.snapshot_id, first.snapshot_id);
        lake.append(
            LakeTable::Events,
            &[batch(&evs[500..600])],
            &CommitIdentity::new("writer-a", 9),
        )
        .await
        .unwrap();
        let policy = signalweave_lake::MaintenancePolicy {
            retention: Some(signalweave_lake::Retention {
                keep_last: 1,
                max_age_ms: 0,
            }),
            ..Default::default()
        };
        let report = lake.maintain(LakeTable::Events, &policy).await.unwrap();
        assert_eq!(report.snapshots_expired, 1, "{}", b.name);
        let retry_8 = lake
            .append(
                LakeTable::Events,
                &[batch(&evs[..500])],
                &CommitIdentity::new("writer-a", 8),
            )
            .await
            .unwrap();
        assert!(retry_8.already_committed, "{}: after maintenance", b.name);
        assert_eq!(retry_8.snapshot_id, next.snapshot_id);
        assert_eq!(
            count(&lake, "select count(*) from signalweave.events").await,
            1100,
            "{}",
            b.name
        );
        // Seven days on, the identities are forgotten, but for each writer's last: a live
        // job down since the commit of its last epoch still finds it made.
        let age = |lake: &Lake| {
            let lake = lake.clone();
            async move {
                sqlx::query(&lake.control_sql(
                    "UPDATE sw_commit_identities SET committed_ms = committed_ms - 8 * 86400000 \
                     WHERE catalog_name = $1",
                ))
                .bind(lake.config().catalog_name.as_str())
                .execute(lake.control_pool())
                .await
                .unwrap();
            }
        };
        for c in 0..2 {
            age(&lake).await;
            lake.append(
                LakeTable::Events,
                &[batch(&evs[600 + c..601 + c])],
                &CommitIdentity::new("writer-c", c as u64),
            )
            .await
            .unwrap();
            lake.maintain(LakeTable::Events, &policy).await.unwrap();
        }
        let table = lake.table(LakeTable::Events).await.unwrap();
        for (writer, seq, kept) in [
            ("writer-a", 7, false),
            ("writer-a", 8, false),
            ("writer-a", 9, true),
            ("writer-c", 0, true),
        ] {
            let found = lake
                .committed(LakeTable::Events, &table, &CommitIdentity::new(writer, seq))
                .await
                .unwrap();
            assert_eq!(found.is_some(), kept, "{}: {writer} {seq}", b.name);
        }
        // A batch of another table's shape is refused, classified, and nothing lands.
        let wrong = signalweave_lake::rejection_batch(
            0,
            "test",
            &[(
                &b"{}"[..],
                1,
                signalweave_model::Rejection::new(signalweave_model::ReasonCode::MissingField, "x"),
            )],
        )
        .unwrap();
        let before = lake.snapshots(LakeTable::Events).await.unwrap();
        let err = lake
            .append(
                LakeTable::Events,
                &[wrong],
                &CommitIdentity::new("writer-b", 0),
            )
            .await
            .unwrap_err();
        assert_eq!(err.kind(), signalweave_model::ErrorKind::InvalidInput);
        assert_eq!(
            lake.snapshots(LakeTable::Events).await.unwrap().len(),
            before.len()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_append_commits_once_across_partitions() {
    for b in support::backends() {
        let lake = open(&b).await;
        let evs = three_days();
        let id = CommitIdentity::new("writer-s", 1);
        let mut w = lake.append_writer(LakeTable::Events, &id).await.unwrap();
        // Chunks that span day partitions, written as they arrive.
        for chunk in evs.chunks(700) {
            w.write(&batch(chunk)).await.unwrap();
        }
        assert_eq!(w.rows(), 1_800);
        // Nothing is visible before the commit.
        assert!(lake.snapshots(LakeTable::Events).await.unwrap().is_empty());
        let files = w.finish().await.unwrap();
        let first = lake
            .commit_written(files.clone(), Default::default())
            .await
            .unwrap();
        assert!(!first.already_committed);
        assert_eq!(first.data_files, 3, "{}: one file per day", b.name);
        // Committing the same files again (an unknown outcome retried) is recognised, and
        // so is a plain append under the same identity.
        let again = lake
            .commit_written(files, Default::default())
            .await
            .unwrap();
        assert!(again.already_committed);
        let plain = lake
            .append(LakeTable::Events, &[batch(&evs)], &id)
            .await
            .unwrap();
        assert!(plain.already_committed);
        assert_eq!(
            count(&lake, "select count(*) from signalweave.events").await,
            1_800,
            "{}",
            b.name
        );
        // A batch of another table's shape is refused before anything is written.
        let mut w = lake
            .append_writer(LakeTable::Events, &CommitIdentity::new("writer-s", 2))
            .await
            .unwrap();
        let wrong = signalweave_lake::rejection_batch(
            0,
            "test",
            &[(
                &b"{}"[..],
                1,
                signalweave_model::Rejection::new(signalweave_model::ReasonCode::MissingField, "x"),
            )],
        )
        .unwrap();
        let err = w.write(&wrong).await.unwrap_err();
        assert_eq!(err.kind(), signalweave_model::ErrorKind::InvalidInput);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintenance_merges_manifests_expires_unheld_snapshots_and_keeps_every_row() {
    use signalweave_lake::{MaintenancePolicy, Retention};
    for b in support::backends() {
        let lake = open(&b).await;
        let evs = three_days();
        let append = |i: usize| {
            let lake = lake.clone();
            let data = batch(&evs[i * 30..(i + 1) * 30]);
            async move {
                lake.append(
                    LakeTable::Events,
                    &[data],
                    &CommitIdentity::new("m", i as u64),
                )
                .await
                .unwrap()
            }
        };
        for i in 0..10 {
            append(i).await;
        }
        // A live tail's position, held against expiry.
        let held = lake.snapshots(LakeTable::Events).await.unwrap()[9].snapshot_id;
        lake.hold_snapshot(LakeTable::Events, "tail-test", held)
            .await
            .unwrap();
        for i in 10..30 {
            append(i).await;
        }
        let policy = MaintenancePolicy {
            min_manifests_to_merge: 10,
            retention: Some(Retention {
                keep_last: 5,
                max_age_ms: 0,
            }),
            ..Default::default()
        };
        let r = lake.maintain(LakeTable::Events, &policy).await.unwrap();
        assert_eq!(r.manifests_before, 30, "{}", b.name);
        assert!(
            r.merge_snapshot.is_some() && r.manifests_after < 5,
            "{}: {r:?}",
            b.name
        );
        // 31 snapshots (30 appends + the merge): the 9 before the held position expire;
        // it and the 21 after it stay (17 of them only because of the hold).
        assert_eq!(r.snapshots_expired, 9, "{}: {r:?}", b.name);
        assert_eq!(r.snapshots_held, 17);
        // The loops warn when holds keep this much history, naming the holder.
        let warn_at = |n| MaintenancePolicy {
            warn_held_snapshots: n,
            ..policy.clone()
        };
        let warning = lake
            .held_history_warning(LakeTable::Events, &r, &warn_at(17))
            .await
            .unwrap()
            .expect("17 snapshots kept only by the hold");
        assert!(
            warning.contains("tail-test (moved") && warning.contains("--release"),
            "{warning}"
        );
        assert_eq!(
            lake.held_history_warning(LakeTable::Events, &r, &warn_at(18))
                .await
                .unwrap(),
            None
        );
        assert!(r.deleted.manifest_lists >= 9, "{}: {r:?}", b.name);
        assert_eq!(
            r.deleted.data_files, 0,
            "{}: no data file is garbage",
            b.name
        );
        let snaps = lake.snapshots(LakeTable::Events).await.unwrap();
        assert!(snaps.iter().any(|s| s.snapshot_id == held));
        assert_eq!(snaps.len(), 22);
        assert_eq!(
            count(&lake, "select count(*) from signalweave.events").await,
            900
        );
        // The tail from the held position reads the 20 later appends once each and skips
        // the merge (a replace snapshot adds no rows).
        let plan = lake
            .plan_appended_since(LakeTable::Events, Some(held))
            .await
            .unwrap();
        let read = lake.read_all(LakeTable::Events, plan.tasks).await.unwrap();
        assert_eq!(rows(&read), 600, "{}", b.name);

        // Maintenance racing appends: CAS conflicts are retried, no append is lost.
        let racing = async {
            let mut n = 0;
            for _ in 0..3 {
                n += lake
                    .maintain(LakeTable::Events, &policy)
                    .await
                    .unwrap()
                    .conflicts;
            }
            n
        };
        let appends = async {
            for i in 30..50 {
                append(i % 60).await;
            }
        };
        let (_conflicts, ()) = tokio::join!(racing, appends);
        assert_eq!(
            count(&lake, "select count(*) from signalweave.events").await,
            1_500,
            "{}",
            b.name
        );
        let r = lake.maintain(LakeTable::Events, &policy).await.unwrap();
        assert!(r.snapshots_held >= 17, "{r:?}");
        lake.release_snapshot(LakeTable::Events, "tail-test")
            .await
            .unwrap();
        lake.maintain(LakeTable::Events, &policy).await.unwrap();
        let snaps = lake.snapshots(LakeTable::Events).await.unwrap();
        assert!(
            !snaps.iter().any(|s| s.snapshot_id == held),
            "{}: released, then expired",
            b.name
        );
        assert_eq!(
            count(&lake, "select count(*) from signalweave.events").await,
            1_500
        );
        // Stale metadata files beyond the metadata log are gone.
        let t = lake.table(LakeTable::Events).await.unwrap();
        assert!(
            t.metadata().metadata_log().len() <= signalweave_lake::DEFAULT_PREVIOUS_VERSIONS_MAX
        );
    }
}

fn dir_bytes(path: &std::path::Path) -> u64 {
    std::fs::read_dir(path)
        .map(|rd| {
            rd.flatten()
                .map(|e| match e.metadata() {
                    Ok(m) if m.is_dir() => dir_bytes(&e.path()),
                    Ok(m) => m.len(),
                    Err(_) => 0,
                })
                .sum()
        })
        .unwrap_or(0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Small commits back to back with maintenance passes running beside them (as the gateway
/// runs them): the metadata file each commit rewrites stops growing, the metadata on disk
/// grows with the data files only, and commit latency stays flat. Without maintenance
/// every one of these grows with the commit count (the metadata file by a snapshot line
/// per commit, the manifest list by a manifest per commit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_small_commits_with_maintenance_keep_latency_flat_and_metadata_bounded() {
    use signalweave_lake::{MaintenancePolicy, MaintenanceReport, Retention};
    const COMMITS: usize = 3_000;
    let b = support::embedded();
    let lake = open(&b).await;
    let data = batch(&events(WorkloadSpec {
        events: 10,
        dup_fraction: 0.0,
        ..Default::default()
    }));
    // Orphans of lost races go after 5 s here (1 h by default): far longer than an
    // append takes from writing its manifest list to its compare-and-set.
    let policy = MaintenancePolicy {
        retention: Some(Retention {
            keep_last: 120,
            max_age_ms: 0,
        }),
        metadata_orphan_age: Some(std::time::Duration::from_secs(5)),
        ..Default::default()
    };
    // The metadata file each commit rewrites, and the table's metadata directory on disk.
    let metadata = |lake: Lake| async move {
        let t = lake.table(LakeTable::Events).await.unwrap();
        let file = std::path::PathBuf::from(
            t.metadata_location()
                .unwrap()
                .trim_start_matches("file://")
                .to_string(),
        );
        let bytes = std::fs::metadata(&file).unwrap().len();
        (bytes, dir_bytes(file.parent().unwrap()))
    };
    let mut latency_ms = Vec::with_capacity(COMMITS);
    let mut maintenance: Option<
        tokio::task::JoinHandle<Result<MaintenanceReport, signalweave_lake::LakeError>>,
    > = None;
    let mut at_1000 = (0, 0);
    for i in 0..COMMITS {
        if i > 0 && i % 60 == 0 && maintenance.as_ref().is_none_or(|h| h.is_finished()) {
            if let Some(h) = maintenance.take() {
                h.await.unwrap().unwrap();
            }
            let (lake, policy) = (lake.clone(), policy.clone());
            maintenance = Some(tokio::spawn(async move {
                lake.maintain(LakeTable::Events, &policy).await
            }));
        }
        let started = std::time::Instant::now();
        lake.append(
            LakeTable::Events,
            std::slice::from_ref(&data),
            &CommitIdentity::new("many", i as u64),
        )
        .await
        .unwrap();
        latency_ms.push(started.elapsed().as_secs_f64() * 1e3);
        if i + 1 == 1_000 {
            at_1000 = metadata(lake.clone()).await;
        }
    }
    if let Some(h) = maintenance.take() {
        h.await.unwrap().unwrap();
    }
    let at_end = metadata(lake.clone()).await;
    assert_eq!(
        count(&lake, "select count(*) from signalweave.events").await,
        10 * COMMITS as i64
    );
    let snapshots = lake.snapshots(LakeTable::Events).await.unwrap().len();
    assert!(snapshots <= 120 + 2 * 60, "{snapshots} snapshots retained");
    let manifests = lake
        .maintain(LakeTable::Events, &policy)
        .await
        .unwrap()
        .manifests_before;
    // Once past the orphan age, a pass leaves only referenced manifest lists and manifests
    // in the metadata directory.
    tokio::time::sleep(std::time::Duration::from_secs(6)).await;
    lake.maintain(LakeTable::Events, &policy).await.unwrap();
    let t = lake.table(LakeTable::Events).await.unwrap();
    let mut referenced = std::collections::HashSet::new();
    for snapshot in t.metadata().snapshots() {
        referenced.insert(
            snapshot
                .manifest_list()
                .trim_start_matches("file://")
                .to_string(),
        );
        let list = t.manifest_list_reader(snapshot).load().await.unwrap();
        for m in list.entries() {
            referenced.insert(m.manifest_path.trim_start_matches("file://").to_string());
        }
    }
    let dir =
        std::path::PathBuf::from(t.metadata_location().unwrap().trim_start_matches("file://"));
    let unreferenced: Vec<_> = std::fs::read_dir(dir.parent().unwrap())
        .unwrap()
        .flatten()
        .map(|e| e.path().display().to_string())
        .filter(|p| p.ends_with(".avro") && !referenced.contains(p))
        .collect();
    assert!(
        unreferenced.is_empty(),
        "{} unreferenced: {unreferenced:?}",
        unreferenced.len()
    );
    assert!(manifests <= 100 + 2 * 60, "{manifests} manifests current");
    // The metadata file each commit rewrites: bounded by the retained snapshots.
    assert!(
        (at_end.0 as f64) < 1.5 * at_1000.0 as f64,
        "metadata file {} bytes at commit 1,000, {} at {COMMITS}",
        at_1000.0,
        at_end.0
    );
    // Metadata on disk: at most linear in the data files (3x the commits, 3x the bytes).
    assert!(
        (at_end.1 as f64) < 3.5 * at_1000.1 as f64,
        "metadata on disk {} bytes at commit 1,000, {} at {COMMITS}",
        at_1000.1,
        at_end.1
    );
    let early = median(latency_ms[900..1_000].to_vec());
    let late = median(latency_ms[COMMITS - 100..].to_vec());
    eprintln!(
        "commit latency median {early:.1} ms at 1,000, {late:.1} ms at {COMMITS}; metadata file \
         {} -> {} bytes, on disk {} -> {} bytes; {snapshots} snapshots, {manifests} manifests",
        at_1000.0, at_end.0, at_1000.1, at_end.1
    );
    assert!(
        late < 2.0 * early,
        "commit latency median {early:.1} ms at commit 1,000, {late:.1} ms at {COMMITS}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_while_appending_loses_nothing_and_the_tail_reads_nothing_twice() {
    use signalweave_lake::{CompactionPolicy, MaintenancePolicy, Retention};
    for b in support::backends() {
        let lake = open(&b).await;
        let evs = three_days();
        let extra = events(WorkloadSpec {
            seed: 99,
            events: 400,
            events_per_sec: 1,
            ..Default::default()
        });
        let append = |i: u64, data: RecordBatch| {
            let lake = lake.clone();
            async move {
                lake.append(LakeTable::Events, &[data], &CommitIdentity::new("c", i))
                    .await
                    .unwrap()
            }
        };
        // 18 small files, 6 per day.
        let appended: Vec<String> = evs.iter().map(|e| e.event_id.to_string()).collect();
        for (i, chunk) in evs.chunks(100).enumerate() {
            append(i as u64, batch(chunk)).await;
        }
        let position = lake.snapshots(LakeTable::Events).await.unwrap()[5].snapshot_id;
        // Compaction races four appends.
        let policy = CompactionPolicy {
            min_input_files: 3,
            ..Default::default()
        };
        let compact = lake.compact(LakeTable::Events, &policy);
        let appends = async {
            for (k, chunk) in extra.chunks(100).enumerate() {
                append(100 + k as u64, batch(chunk)).await;
            }
        };
        let (report, ()) = tokio::join!(compact, appends);
        let report = report.unwrap();
        assert_eq!(
            (report.partitions, report.files_removed),
            (3, 18),
            "{}: {report:?}",
            b.name
        );
        assert_eq!(report.files_added, 3);
        assert_eq!(report.rows, 1_800);
        assert_eq!(
            count(&lake, "select count(*) from signalweave.events").await,
            2_200,
            "{}",
            b.name
        );
        assert_eq!(
            count(
                &lake,
                "select count(distinct event_id) from signalweave.events"
            )
            .await,
            2_200
        );
        // The tail from after the 6th append reads the 12 later appends and the 4 racing
        // ones, once each: the replace snapshot adds no rows.
        let plan = lake
            .plan_appended_since(LakeTable::Events, Some(position))
            .await
            .unwrap();
        let read = lake.read_all(LakeTable::Events, plan.tasks).await.unwrap();
        assert_eq!(rows(&read), 1_600, "{}", b.name);
        // Each compacted file holds its rows in their order of arrival, and keeps the
        // commit that landed each: the 18 appends it merged are 18 commits of 100 rows
        // still, as the 4 racing appends are (before row lineage, the compacted rows
        // were 3 commits of 600).
        let ctx = lake.session_context().await.unwrap();
        ctx.register_table(
            "ordered",
            Arc::new(
                signalweave_lake::LakeTableProvider::new(
                    lake.clone(),
                    LakeTable::Events,
                    signalweave_lake::SnapshotChoice::Current,
                )
                .with_commit_sequence(),
            ),
        )
        .unwrap();
        let by_commit = format!(
            "select count(*) from (select {} as s, count(*) as n from ordered group by 1) c \
             where n = 100",
            signalweave_lake::COMMIT_ORDER
        );
        assert_eq!(count_in(&ctx, &by_commit).await, 22, "{}", b.name);
        // A backfill's arrival watermarks step once per commit, the compacted ones too,
        // read from the compacted files' data once, then from what the catalog database
        // keeps of them.
        let kept = |lake: &Lake| {
            let lake = lake.clone();
            async move {
                // The PostgreSQL catalog is shared with other tests' lakes.
                let (n,): (i64,) =
                    sqlx::query_as(&lake.control_sql(
                        "SELECT count(*) FROM sw_file_commits WHERE catalog_name = $1",
                    ))
                    .bind(lake.config().catalog_name.as_str())
                    .fetch_one(lake.control_pool())
                    .await
                    .unwrap();
                n
            }
        };
        for read in 0..2 {
            let (arrivals, _) = lake
                .file_statistics(LakeTable::Events, None, "event_time", "ingest_time", 0, &[])
                .await
                .unwrap();
            assert_eq!(arrivals.files(), 22, "{}: read {read}", b.name);
            assert_eq!(kept(&lake).await, 3, "{}: read {read}", b.name);
        }
        // What is kept is what a plan reads: kept as empty, the compacted files' commits
        // are gone from it; forgotten, they are read from the data again.
        let set_kept = |sql: &'static str| {
            let lake = lake.clone();
            async move {
                sqlx::query(&lake.control_sql(sql))
                    .bind(lake.config().catalog_name.as_str())
                    .execute(lake.control_pool())
                    .await
                    .unwrap();
            }
        };
        set_kept("UPDATE sw_file_commits SET commits = '[]' WHERE catalog_name = $1").await;
        let (arrivals, _) = lake
            .file_statistics(LakeTable::Events, None, "event_time", "ingest_time", 0, &[])
            .await
            .unwrap();
        assert!(arrivals.files() < 22, "{}: {}", b.name, arrivals.files());
        set_kept("DELETE FROM sw_file_commits WHERE catalog_name = $1").await;
        let (arrivals, _) = lake
            .file_statistics(LakeTable::Events, None, "event_time", "ingest_time", 0, &[])
            .await
            .unwrap();
        assert_eq!(arrivals.files(), 22, "{}", b.name);
        assert_eq!(kept(&lake).await, 3, "{}", b.name);
        let current = lake.current_data_files(LakeTable::Events).await.unwrap();
        assert!(
            current.len() <= 3 + 4,
            "{}: {} files",
            b.name,
            current.len()
        );
        let full = lake
            .plan_time_range(LakeTable::Events, i64::MIN, i64::MAX, None)
            .await
            .unwrap();
        let mut checked = 0;
        for task in full
            .tasks
            .into_iter()
            .filter(|t| t.record_count == Some(600))
        {
            checked += 1;
            // A day's six commits, in commit order, each commit's rows as it landed
            // them: a run of the events as they were appended.
            let got = lake.read_all(LakeTable::Events, vec![task]).await.unwrap();
            let ids: Vec<String> = got
                .iter()
                .flat_map(|b| {
                    let c = b.column_by_name("event_id").unwrap();
                    (0..b.num_rows())
                        .map(|i| arrow::util::display::array_value_to_string(c, i).unwrap())
                        .collect::<Vec<_>>()
                })
                .collect();
            let start = appended.iter().position(|id| *id == ids[0]).unwrap();
            assert!(
                appended[start..].starts_with(&ids),
                "{}: in commit order",
                b.name
            );
        }
        assert_eq!(checked, 3, "{}: compacted files", b.name);
        // Once the snapshots that referenced them expire, the replaced files are deleted.
        let r = lake
            .maintain(
                LakeTable::Events,
                &MaintenancePolicy {
                    retention: Some(Retention {
                        keep_last: 1,
                        max_age_ms: 0,
                    }),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(r.deleted.data_files, 18, "{}: {r:?}", b.name);
        assert_eq!(
            count(&lake, "select count(*) from signalweave.events").await,
            2_200
        );
        // An erasure that rewrites compacted files keeps each remaining row's commit: the
        // 22 commits are all still there.
        let out = ctx
            .sql("select min(customer_id) from ordered")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        let subject = arrow::util::display::array_value_to_string(out[0].column(0), 0).unwrap();
        let erased = lake
            .erase_customer(&signalweave_lake::ErasureRequest {
                customer_id: subject,
                tenant: None,
                reason: "lineage".into(),
                requested_by: "test".into(),
                outputs: Vec::new(),
            })
            .await
            .unwrap();
        assert!(erased.tables[0].rows > 0, "{}: {erased:?}", b.name);
        let commits = format!(
            "select count(distinct {}) from ordered",
            signalweave_lake::COMMIT_ORDER
        );
        assert_eq!(
            count_in(&ctx, &commits).await,
            22,
            "{}: commits after an erasure",
            b.name
        );
        // The rewritten files step once per commit still; what was kept of the replaced
        // ones goes with them.
        let (arrivals, _) = lake
            .file_statistics(LakeTable::Events, None, "event_time", "ingest_time", 0, &[])
            .await
            .unwrap();
        assert_eq!(arrivals.files(), 22, "{}: after the erasure", b.name);
        assert_eq!(kept(&lake).await, 3, "{}: after the erasure", b.name);
    }
}

/// Appends go on while an erasure rewrites: the gateway commits every second. A race the
/// erasure loses costs it the manifests appended since, not every manifest of the table,
/// so it commits even when appends come back to back and the table lists hundreds of
/// manifests (reading them all on every try, it lost all its tries).
/// Two renewals of one owner's lease in flight at once (a live job's renewer and the one
/// its recovery starts) both hold: neither fences the owner out of its own lease, while
/// another owner is still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_of_one_owner_never_fence_it_out() {
    let b = support::embedded();
    let lake = open(&b).await;
    let ttl = std::time::Duration::from_secs(10);
    let owner = "host:1:run-a";
    lake.take_lease("live", "job", "live", owner, ttl)
        .await
        .unwrap();
    for round in 0..300 {
        let (a, b) = tokio::join!(
            lake.take_lease("live", "job", "live", owner, ttl),
            lake.take_lease("live", "job", "live", owner, ttl),
        );
        assert!(a.is_ok() && b.is_ok(), "round {round}: {a:?} {b:?}");
    }
    let other = lake
        .take_lease("live", "job", "live", "host:1:run-b", ttl)
        .await
        .unwrap_err();
    assert_eq!(
        other.kind(),
        signalweave_model::ErrorKind::Conflict,
        "{other}"
    );
}

/// A lease's fence locks the lease while its transaction runs: another owner's takeover
/// waits for it to end, so what the transaction writes lands in the tenure it checked. Once
/// taken over, the fence refuses, and a renewal of the taker keeps its generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_transaction_shuts_a_takeover_out_until_it_ends() {
    for b in support::backends() {
        let lake = open(&b).await;
        let a = lake
            .take_lease(
                "live",
                "fenced",
                "live",
                "host:1:a",
                std::time::Duration::ZERO,
            )
            .await
            .unwrap();
        // Run out: a takeover needs the lease's end to be past.
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        let mut tx = lake.control_pool().begin().await.unwrap();
        lake.fence(&mut tx, &a).await.unwrap();
        let taker = {
            let lake = lake.clone();
            tokio::spawn(async move {
                lake.take_lease(
                    "live",
                    "fenced",
                    "live",
                    "host:1:b",
                    std::time::Duration::from_secs(60),
                )
                .await
            })
        };
        tokio::time::sleep(std::time::Duration::from_millis(400)).await;
        assert!(
            !taker.is_finished(),
            "{}: a takeover went through while a fenced transaction ran",
            b.name
        );
        tx.commit().await.unwrap();
        let b_fence = taker.await.unwrap().unwrap();
        assert_eq!(b_fence.generation, a.generation + 1, "{}", b.name);
        let mut tx = lake.control_pool().begin().await.unwrap();
        let e = lake.fence(&mut tx, &a).await.unwrap_err();
        assert_eq!(
            e.kind(),
            signalweave_model::ErrorKind::Conflict,
            "{}: {e}",
            b.name
        );
        drop(tx);
        let renewed = lake
            .take_lease(
                "live",
                "fenced",
                "live",
                "host:1:b",
                std::time::Duration::from_secs(60),
            )
            .await
            .unwrap();
        assert_eq!(renewed, b_fence, "{}", b.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_erasure_commits_while_appends_keep_coming() {
    let b = support::embedded();
    let lake = open(&b).await;
    let evs = events(WorkloadSpec {
        events: 3_000,
        events_per_sec: 5,
        ..Default::default()
    });
    // One manifest per append: 300 of them.
    land_in_chunks(&lake, &evs, 10, "landed").await;
    // The smallest customer id: the lower bound of `customer_id` in every file that
    // holds one of their events.
    let (subject, theirs) = per_customer(&evs)
        .iter()
        .min_by_key(|(c, _)| **c)
        .map(|(c, n)| (c.to_string(), *n))
        .unwrap();
    // The live traffic: other customers' events, appended every 100 ms until the erasure
    // is done.
    let more: Vec<Event> = evs
        .iter()
        .filter(|e| e.customer_id.as_deref() != Some(subject.as_str()))
        .take(5)
        .cloned()
        .collect();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let appender = tokio::spawn({
        let (lake, done, more) = (lake.clone(), Arc::clone(&done), more.clone());
        async move {
            let mut n = 0u64;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                lake.append(
                    LakeTable::Events,
                    &[batch(&more)],
                    &CommitIdentity::new("live", n),
                )
                .await
                .unwrap();
                n += 1;
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            n
        }
    });
    // The appender is under way before the erasure starts.
    while lake.snapshots(LakeTable::Events).await.unwrap().len() < 302 {
        tokio::task::yield_now().await;
    }
    let erased = lake
        .erase_customer(&signalweave_lake::ErasureRequest {
            customer_id: subject.clone(),
            tenant: None,
            reason: "ticket-9".into(),
            requested_by: "test".into(),
            outputs: Vec::new(),
        })
        .await;
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let appended = appender.await.unwrap();
    let report = erased.unwrap();
    assert_eq!(report.tables[0].rows, theirs as u64, "{report:?}");
    assert!(appended >= 2, "appends during the erasure: {appended}");
    // Expiry took every snapshot before the erasure's and none after it: a reader caught
    // up at it, or at an append after it, goes on.
    let snaps = lake.snapshots(LakeTable::Events).await.unwrap();
    assert_eq!(snaps[0].snapshot_id, report.tables[0].snapshot_id.unwrap());
    assert_eq!(snaps[0].operation, "overwrite");
    let q = format!("select count(*) from signalweave.events where customer_id = '{subject}'");
    assert_eq!(count(&lake, &q).await, 0);
    // Nothing appended meanwhile is lost, before the erasure's commit or after it.
    assert_eq!(
        count(&lake, "select count(*) from signalweave.events").await,
        (evs.len() - theirs) as i64 + appended as i64 * more.len() as i64
    );
    // No manifest entry names them in its column bounds, the entries of the files the
    // erasure replaced included.
    let t = lake.table(LakeTable::Events).await.unwrap();
    let md = t.metadata();
    let field = md.current_schema().field_by_name("customer_id").unwrap().id;
    let named = iceberg::spec::Datum::string(subject.as_str());
    let list = t
        .manifest_list_reader(md.current_snapshot().unwrap())
        .load()
        .await
        .unwrap();
    let mut entries = 0;
    for m in list.entries() {
        for e in m.load_manifest(t.file_io()).await.unwrap().entries() {
            entries += 1;
            let f = e.data_file();
            assert!(
                f.lower_bounds().get(&field) != Some(&named)
                    && f.upper_bounds().get(&field) != Some(&named),
                "{} ({:?}) keeps the erased id in its bounds",
                f.file_path(),
                e.status()
            );
        }
    }
    assert!(entries > 300, "{entries}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn erasure_removes_a_customer_everywhere_and_deletes_the_old_files() {
    for b in support::backends() {
        let lake = open(&b).await;
        let evs = three_days();
        land_in_chunks(&lake, &evs, 300, "e").await;
        let subject = per_customer(&evs)
            .iter()
            .max_by_key(|(c, n)| (**n, std::cmp::Reverse(**c)))
            .map(|(c, _)| c.to_string())
            .unwrap();
        let theirs: Vec<&Event> = evs
            .iter()
            .filter(|e| e.customer_id.as_deref() == Some(subject.as_str()))
            .collect();
        assert!(theirs.len() > 1);
        // Rejection evidence that names one of the subject's events, and one that does not.
        let raw_theirs = format!(
            r#"{{"tenant":"{}","event_id":"{}","producer_id":"p"}}"#,
            theirs[0].tenant, theirs[0].event_id
        );
        let raw_other =
            r#"{"tenant":"tenant-0","event_id":"unrelated","producer_id":"p"}"#.to_string();
        let rej = signalweave_lake::rejection_batch(
            evs[0].event_time_us,
            "test",
            &[
                (
                    raw_theirs.as_bytes(),
                    1,
                    signalweave_model::Rejection::new(
                        signalweave_model::ReasonCode::WrongType,
                        "x",
                    ),
                ),
                (
                    raw_other.as_bytes(),
                    2,
                    signalweave_model::Rejection::new(
                        signalweave_model::ReasonCode::WrongType,
                        "y",
                    ),
                ),
            ],
        )
        .unwrap();
        lake.append(LakeTable::Rejections, &[rej], &CommitIdentity::new("r", 0))
            .await
            .unwrap();
        // Late rows of a job keyed by customer: one of the subject's window, of an event
        // the events table does not hold (a job committed it after the events' rewrite),
        // and one of another customer's.
        let late = [
            late_row(
                "customer_features",
                theirs[0].tenant.as_str(),
                "gone-1",
                &subject,
            ),
            late_row(
                "customer_features",
                theirs[0].tenant.as_str(),
                "gone-2",
                "someone-else",
            ),
        ];
        lake.append(LakeTable::LateEvents, &late, &CommitIdentity::new("l", 0))
            .await
            .unwrap();
        // An earlier run of the same erasure, stopped before its end.
        let stopped = format!("erase-stopped-{}", uuid::Uuid::new_v4().simple());
        sqlx::query(&lake.control_sql(
            "INSERT INTO sw_erasures (erasure_id, catalog_name, subject_sha256, reason, \
             requested_by, erased_ms, tables_json) VALUES ($1, $2, $3, $4, $5, $6, $7)",
        ))
        .bind(stopped.as_str())
        .bind(lake.config().catalog_name.as_str())
        .bind(signalweave_lake::subject_digest(&subject, None))
        .bind("a ticket")
        .bind("test")
        .bind(1_i64)
        .bind("[]")
        .execute(lake.control_pool())
        .await
        .unwrap();
        let old_files = lake.current_data_files(LakeTable::Events).await.unwrap();
        // A reader caught up before the erasure, and one behind.
        let snaps = lake.snapshots(LakeTable::Events).await.unwrap();
        let (behind, caught_up) = (snaps[0].snapshot_id, snaps.last().unwrap().snapshot_id);
        let report = lake
            .erase_customer(&signalweave_lake::ErasureRequest {
                customer_id: subject.clone(),
                tenant: None,
                reason: "ticket-7".into(),
                requested_by: "test".into(),
                outputs: vec![signalweave_lake::KeyLayout {
                    job: "customer_features".into(),
                    job_version: 2,
                    output_table: "customer_features".into(),
                    parts: 2,
                    customer: Some(1),
                    tenant: Some(0),
                    lateness_us: 0,
                    span_us: 0,
                }],
            })
            .await
            .unwrap();
        let completed: Option<i64> = sqlx::query_scalar(
            &lake.control_sql("SELECT completed_ms FROM sw_erasures WHERE erasure_id = $1"),
        )
        .bind(stopped.as_str())
        .fetch_one(lake.control_pool())
        .await
        .unwrap();
        assert!(
            completed.is_some(),
            "the run completes the one stopped before it"
        );
        assert_eq!(
            report.tables[0].rows,
            theirs.len() as u64,
            "{}: {report:?}",
            b.name
        );
        assert_eq!(
            report.tables[1].rows, 1,
            "{}: the late row of their window",
            b.name
        );
        assert_eq!(
            count(
                &lake,
                "select count(*) from signalweave.late_events where event_id = 'gone-2'"
            )
            .await,
            1
        );
        assert_eq!(
            report.tables[2].rows, 1,
            "{}: the rejection naming their event",
            b.name
        );
        assert!(report.event_time_range.is_some());
        let q = format!("select count(*) from signalweave.events where customer_id = '{subject}'");
        assert_eq!(count(&lake, &q).await, 0, "{}", b.name);
        assert_eq!(
            count(&lake, "select count(*) from signalweave.events").await,
            (evs.len() - theirs.len()) as i64
        );
        assert_eq!(
            count(&lake, "select count(*) from signalweave.rejections").await,
            1
        );
        // No snapshot before the erasure survives, and the rewritten files are gone.
        let snaps = lake.snapshots(LakeTable::Events).await.unwrap();
        assert_eq!(snaps.len(), 1, "{}", b.name);
        assert_eq!(snaps[0].operation, "overwrite");
        let t = lake.table(LakeTable::Events).await.unwrap();
        let now = lake.current_data_files(LakeTable::Events).await.unwrap();
        let mut deleted = 0;
        for f in old_files.difference(&now) {
            assert!(
                !t.file_io().exists(f).await.unwrap(),
                "{}: {f} still exists",
                b.name
            );
            deleted += 1;
        }
        assert_eq!(deleted, report.tables[0].files_rewritten);
        // The caught-up reader's position is expired with the rest, but the erasure that
        // followed it is kept: it goes on from there, reading no rewritten row again and
        // every row appended after. The reader behind cannot: what the expired snapshots
        // after it added is gone.
        let plan = lake
            .plan_appended_since(LakeTable::Events, Some(caught_up))
            .await
            .unwrap();
        assert!(plan.tasks.is_empty(), "{}: {:?}", b.name, plan.snapshots);
        let err = lake
            .plan_appended_since(LakeTable::Events, Some(behind))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), signalweave_model::ErrorKind::NotFound, "{err}");
        lake.append(
            LakeTable::Events,
            &[batch(&evs[..10])],
            &CommitIdentity::new("after-erasure", 0),
        )
        .await
        .unwrap();
        let plan = lake
            .plan_appended_since(LakeTable::Events, Some(caught_up))
            .await
            .unwrap();
        assert_eq!(plan.snapshots.len(), 2, "{}", b.name);
        assert_eq!(
            plan.tasks
                .iter()
                .map(|t| t.record_count.unwrap_or(0))
                .sum::<u64>(),
            10,
            "{}",
            b.name
        );
        // The record names the erasure, not the subject.
        let pool = lake.control_pool();
        let rows: Vec<(String, String)> =
            sqlx::query_as("SELECT subject_sha256, tables_json FROM sw_erasures")
                .fetch_all(pool)
                .await
                .unwrap();
        assert!(
            rows.iter()
                .all(|(h, t)| h.len() == 64 && !t.contains(&subject) && !h.contains(&subject))
        );
        assert!(!rows.is_empty());

        // Scoped to a tenant: a customer id another tenant also uses names another person,
        // whose events stay.
        let mut tenants_of: std::collections::HashMap<&str, std::collections::BTreeSet<&str>> =
            Default::default();
        for e in &evs {
            if let Some(c) = e.customer_id.as_deref()
                && c != subject
            {
                tenants_of.entry(c).or_default().insert(e.tenant.as_str());
            }
        }
        let (shared, tenants) = tenants_of
            .iter()
            .filter(|(_, t)| t.len() > 1)
            .min_by_key(|(c, _)| **c)
            .expect("a customer id in two tenants");
        let (erased_tenant, kept_tenant) = (
            tenants.iter().next().unwrap().to_string(),
            tenants.iter().nth(1).unwrap().to_string(),
        );
        let in_tenant = |t: &str| {
            format!(
                "select count(*) from signalweave.events where customer_id = '{shared}' \
                 and tenant = '{t}'"
            )
        };
        let kept_before = count(&lake, &in_tenant(&kept_tenant)).await;
        assert!(kept_before > 0 && count(&lake, &in_tenant(&erased_tenant)).await > 0);
        let scoped = lake
            .erase_customer(&signalweave_lake::ErasureRequest {
                customer_id: shared.to_string(),
                tenant: Some(erased_tenant.clone()),
                reason: "ticket-8".into(),
                requested_by: "test".into(),
                outputs: Vec::new(),
            })
            .await
            .unwrap();
        assert!(scoped.tables[0].rows > 0, "{scoped:?}");
        assert_eq!(
            count(&lake, &in_tenant(&erased_tenant)).await,
            0,
            "{}",
            b.name
        );
        assert_eq!(
            count(&lake, &in_tenant(&kept_tenant)).await,
            kept_before,
            "{}",
            b.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_never_lose_appends() {
    for b in support::backends() {
        let lake = open(&b).await;
        let evs = three_days();
        let writers = 3;
        let commits = 4;
        let chunk = 50;
        let tasks = (0..writers).map(|w| {
            let lake = lake.clone();
            let evs = evs.clone();
            tokio::spawn(async move {
                for c in 0..commits {
                    let start = (w * commits + c) * chunk;
                    let data = batch(&evs[start..start + chunk]);
                    lake.append(
                        LakeTable::Events,
                        &[data],
                        &CommitIdentity::new(format!("w{w}"), c as u64),
                    )
                    .await
                    .unwrap();
                }
            })
        });
        for t in join_all(tasks).await {
            t.unwrap();
        }
        let expected = (writers * commits * chunk) as i64;
        assert_eq!(
            count(&lake, "select count(*) from signalweave.events").await,
            expected,
            "{}",
            b.name
        );
        assert_eq!(
            count(
                &lake,
                "select count(distinct event_id) from signalweave.events"
            )
            .await,
            expected,
            "{}",
            b.name
        );
        assert_eq!(
            lake.snapshots(LakeTable::Events).await.unwrap().len(),
            writers * commits
        );
    }
}

/// Two writers racing with the same identity (a rerun while the first run still commits):
/// exactly one lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_identity_racing_lands_once() {
    for b in support::backends() {
        let lake = open(&b).await;
        let evs = three_days();
        for round in 0..4u64 {
            let data = batch(&evs[round as usize * 100..(round as usize + 1) * 100]);
            let tasks = (0..3).map(|_| {
                let lake = lake.clone();
                let data = data.clone();
                tokio::spawn(async move {
                    lake.append(
                        LakeTable::Events,
                        &[data],
                        &CommitIdentity::new("racer", round),
                    )
                    .await
                    .unwrap()
                })
            });
            let outcomes: Vec<_> = join_all(tasks)
                .await
                .into_iter()
                .map(|r| r.unwrap())
                .collect();
            let fresh = outcomes.iter().filter(|o| !o.already_committed).count();
            assert_eq!(fresh, 1, "{}: round {round}: {outcomes:?}", b.name);
            assert!(
                outcomes
                    .iter()
                    .all(|o| o.snapshot_id == outcomes[0].snapshot_id)
            );
        }
        assert_eq!(
            count(&lake, "select count(*) from signalweave.events").await,
            400,
            "{}",
            b.name
        );
    }
}

/// `batches` as one batch's columns by name, dictionaries decoded to plain strings.
fn as_plain(batches: &[RecordBatch]) -> Vec<(String, arrow::array::ArrayRef)> {
    let all = arrow::compute::concat_batches(&batches[0].schema(), batches).unwrap();
    all.schema()
        .fields()
        .iter()
        .zip(all.columns())
        .map(|(f, c)| {
            let c = match f.data_type() {
                arrow::datatypes::DataType::Dictionary(_, v) => arrow::compute::cast(c, v).unwrap(),
                _ => Arc::clone(c),
            };
            (f.name().clone(), c)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn range_scan_prunes_day_partitions() {
    for b in support::backends() {
        let lake = open(&b).await;
        let evs = three_days();
        // One commit per day, so each day is its own file.
        for (i, day) in evs.chunks(600).enumerate() {
            lake.append(
                LakeTable::Events,
                &[batch(day)],
                &CommitIdentity::new("days", i as u64),
            )
            .await
            .unwrap();
        }
        let start = signalweave_fixtures::DEFAULT_START_US;
        // The middle day, and half of it.
        let plan = lake
            .plan_time_range(LakeTable::Events, start + DAY_US, start + 2 * DAY_US, None)
            .await
            .unwrap();
        assert_eq!(plan.total_files, 3, "{}", b.name);
        // The same range through SQL: Iceberg prunes the files, DataFusion filters the rows.
        let day = |d: i64| format!("to_timestamp_micros({})", start + d * DAY_US);
        let sql = format!(
            "select count(*) from signalweave.events where event_time >= {} and event_time < {}",
            day(1),
            day(2)
        );
        assert_eq!(count(&lake, &sql).await, 600, "{}", b.name);
        let ctx = lake.session_context().await.unwrap();
        let explain = ctx
            .sql(&format!("explain {sql}"))
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        let plan_text = arrow::util::pretty::pretty_format_batches(&explain)
            .unwrap()
            .to_string();
        assert_eq!(
            plan_text.matches(".parquet").count(),
            1,
            "{}: one file scanned:\n{plan_text}",
            b.name
        );
        assert_eq!(plan.tasks.len(), 1, "{}: the other days are pruned", b.name);
        let read = lake.read_all(LakeTable::Events, plan.tasks).await.unwrap();
        assert_eq!(rows(&read), 600);
        let plan = lake
            .plan_time_range(
                LakeTable::Events,
                start + DAY_US,
                start + DAY_US + 300_000_000,
                None,
            )
            .await
            .unwrap();
        let read = lake
            .read_all(LakeTable::Events, plan.tasks.clone())
            .await
            .unwrap();
        assert_eq!(
            rows(&read),
            300,
            "{}: rows outside the range are filtered",
            b.name
        );
        for batch in &read {
            let t = batch
                .column_by_name("event_time")
                .unwrap()
                .as_primitive::<arrow::datatypes::TimestampMicrosecondType>();
            assert!(
                t.values()
                    .iter()
                    .all(|v| *v >= start + DAY_US && *v < start + DAY_US + 300_000_000)
            );
        }
        // Read by pages, as a backfill does: the same rows. A file that cannot be read
        // fails so after the retry that reads it whole.
        // Strings stored as dictionaries come out as dictionaries, with the same values.
        let range = (start + DAY_US, start + DAY_US + 300_000_000);
        let task = plan.tasks[0].clone();
        let by_pages: Vec<RecordBatch> = lake
            .read_pages_in_range(LakeTable::Events, task.clone(), range.0, range.1)
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        let dictionary = |batches: &[RecordBatch], name: &str| {
            matches!(
                batches[0].column_by_name(name).unwrap().data_type(),
                arrow::datatypes::DataType::Dictionary(..)
            )
        };
        assert!(dictionary(&by_pages, "event_type"), "{}", b.name);
        assert_eq!(as_plain(&by_pages), as_plain(&read), "{}", b.name);
        let mut gone = task;
        gone.data_file_path.push_str(".gone");
        let failed = match lake
            .read_pages_in_range(LakeTable::Events, gone, range.0, range.1)
            .await
        {
            Ok(s) => s.try_collect::<Vec<_>>().await.is_err(),
            Err(_) => true,
        };
        assert!(failed, "{}: a missing file is an error", b.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incremental_scan_reads_each_append_once() {
    for b in support::backends() {
        let lake = open(&b).await;
        let evs = three_days();
        let empty = lake
            .plan_appended_since(LakeTable::Events, None)
            .await
            .unwrap();
        assert!(empty.tasks.is_empty() && empty.upto.is_none());
        let mut position = None;
        let mut first_position = None;
        let mut seen = 0;
        for round in 0..3 {
            for k in 0..2 {
                let i = round * 2 + k;
                lake.append(
                    LakeTable::Events,
                    &[batch(&evs[i * 100..(i + 1) * 100])],
                    &CommitIdentity::new("tail", i as u64),
                )
                .await
                .unwrap();
            }
            let plan = lake
                .plan_appended_since(LakeTable::Events, position)
                .await
                .unwrap();
            assert_eq!(plan.snapshots.len(), 2, "{}", b.name);
            let read = lake.read_all(LakeTable::Events, plan.tasks).await.unwrap();
            assert_eq!(rows(&read), 200, "{}: round {round}", b.name);
            seen += rows(&read);
            if first_position.is_none() {
                first_position = plan.upto;
            }
            position = plan.upto;
        }
        assert_eq!(seen, 600);
        let caught_up = lake
            .plan_appended_since(LakeTable::Events, position)
            .await
            .unwrap();
        assert!(caught_up.tasks.is_empty());
        assert_eq!(caught_up.upto, position);
        // From the start after expiry: every live file, though its snapshots are gone.
        let outcome = lake
            .expire_snapshots(LakeTable::Events, Some(1), Some(i64::MAX))
            .await
            .unwrap();
        assert_eq!(
            (outcome.snapshots_before, outcome.snapshots_after),
            (6, 1),
            "{}",
            b.name
        );
        let all = lake
            .plan_appended_since(LakeTable::Events, None)
            .await
            .unwrap();
        assert_eq!(
            rows(&lake.read_all(LakeTable::Events, all.tasks).await.unwrap()),
            600,
            "{}",
            b.name
        );
        // The old position is no longer an ancestor: the tail is told, not silently wrong.
        let expired = lake
            .plan_appended_since(LakeTable::Events, Some(first_position.unwrap()))
            .await
            .unwrap_err();
        assert_eq!(expired.kind(), signalweave_model::ErrorKind::NotFound);
        let gone = lake
            .plan_appended_since(LakeTable::Events, Some(42))
            .await
            .unwrap_err();
        assert_eq!(gone.kind(), signalweave_model::ErrorKind::NotFound);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_and_time_travel() {
    for b in support::backends() {
        let lake = open(&b).await;
        let evs = three_days();
        let first = lake
            .append(
                LakeTable::Events,
                &[batch(&evs[..100])],
                &CommitIdentity::new("tt", 0),
            )
            .await
            .unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let between = chrono::Utc::now().timestamp_millis();
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        lake.append(
            LakeTable::Events,
            &[batch(&evs[100..300])],
            &CommitIdentity::new("tt", 1),
        )
        .await
        .unwrap();
        assert_eq!(
            lake.snapshot_as_of(LakeTable::Events, between)
                .await
                .unwrap(),
            Some(first.snapshot_id)
        );
        for as_of in [AsOf::Timestamp(between), AsOf::Snapshot(first.snapshot_id)] {
            assert_eq!(
                count_as_of(&lake, as_of).await,
                100,
                "{}: {as_of:?}",
                b.name
            );
        }
        // Before anything was committed the table reads as empty.
        assert_eq!(count_as_of(&lake, AsOf::Timestamp(0)).await, 0);
        assert!(lake.session_context_as_of(AsOf::Snapshot(1)).await.is_err());
        // Expiry by the retention rule keeps the current snapshot and every row.
        let kept = lake
            .expire_snapshots(LakeTable::Events, None, None)
            .await
            .unwrap();
        assert_eq!(
            kept.snapshots_after, 2,
            "{}: younger than the 7-day rule",
            b.name
        );
        let outcome = lake
            .expire_snapshots(LakeTable::Events, Some(1), Some(i64::MAX))
            .await
            .unwrap();
        assert_eq!(
            (outcome.snapshots_before, outcome.snapshots_after),
            (2, 1),
            "{}",
            b.name
        );
        assert!(
            lake.session_context_as_of(AsOf::Snapshot(first.snapshot_id))
                .await
                .is_err()
        );
        // The moment of the expired snapshot: the table held 100 rows then, so it says it
        // no longer knows, rather than answer 0. Before the table's first commit, it was
        // empty, and that it still knows.
        let err = lake
            .snapshot_as_of(LakeTable::Events, between)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), signalweave_model::ErrorKind::NotFound, "{err}");
        assert!(err.to_string().contains("the table was made at"), "{err}");
        let ctx = lake
            .session_context_as_of(AsOf::Timestamp(between))
            .await
            .unwrap();
        let read = async {
            ctx.sql("select count(*) from signalweave.events")
                .await?
                .collect()
                .await
        };
        let err = read.await.unwrap_err().to_string();
        assert!(err.contains("no longer retains"), "{err}");
        assert!(err.contains("the table was made at"), "{err}");
        assert_eq!(
            count_as_of(&lake, AsOf::Timestamp(0)).await,
            0,
            "{}: before the table was made, after the expiry",
            b.name
        );
        assert_eq!(
            count(&lake, "select count(*) from signalweave.events").await,
            300
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_refuses_a_reused_event_id_with_other_content() {
    let registry = SchemaRegistry::load_dir(support::repo().join("catalog/events")).unwrap();
    let validator = EventValidator::new(Arc::new(registry), ValidationLimits::default());
    let b = support::embedded();
    let lake = open(&b).await;
    let line = |id: &str, amount: i64| {
        serde_json::json!({
            "event_id": id, "event_type": "order_placed", "schema_version": "1.1.0",
            "tenant": "acme", "producer_id": "shop-1", "producer_seq": 1,
            "event_time": "2026-01-01T00:00:00Z", "order_id": "o-1", "customer_id": "c-1",
            "market_id": "m-1", "payload": {"amount_minor": amount, "currency": "EUR"}
        })
        .to_string()
    };
    let input = b.dir.path().join("input.ndjson");
    let text = [
        line("e-1", 100),
        line("e-1", 100),
        line("e-1", 250),
        line("e-2", 5),
    ]
    .join("\n");
    std::fs::write(&input, text).unwrap();
    let options = LoadOptions {
        now_us: Some(signalweave_fixtures::DEFAULT_START_US + DAY_US),
        source_name: "test".into(),
        ..Default::default()
    };
    let report = lake.load_file(&input, &validator, &options).await.unwrap();
    assert_eq!(
        (report.accepted, report.duplicates, report.rejected),
        (2, 1, 1)
    );
    assert_eq!(
        count(&lake, "select sum(amount_minor) from signalweave.events").await,
        105
    );
    assert_eq!(
        count(
            &lake,
            "select count(*) from signalweave.rejections \
             where reason_code = 'identity_conflict' and event_id = 'e-1' and record_position = 3"
        )
        .await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_lands_valid_records_and_evidences_rejections() {
    let registry = SchemaRegistry::load_dir(support::repo().join("catalog/events")).unwrap();
    let validator = EventValidator::new(Arc::new(registry), ValidationLimits::default());
    let sample = support::repo().join("fixtures/sample.ndjson");
    let expected: signalweave_fixtures::ExpectedFigures = serde_json::from_str(
        &std::fs::read_to_string(support::repo().join("fixtures/sample.expected.json")).unwrap(),
    )
    .unwrap();
    for b in support::backends() {
        let lake = open(&b).await;
        let options = LoadOptions {
            chunk_records: 500,
            now_us: Some(signalweave_fixtures::DEFAULT_START_US + DAY_US),
            source_name: "test".into(),
            ..Default::default()
        };
        let report = lake.load_file(&sample, &validator, &options).await.unwrap();
        assert_eq!(report.records, expected.records);
        assert_eq!(report.accepted, expected.events, "{}", b.name);
        assert_eq!(report.duplicates, expected.duplicates);
        assert_eq!(report.rejected, expected.invalid);
        assert_eq!(
            count(&lake, "select count(*) from signalweave.events").await as u64,
            expected.events
        );
        assert_eq!(
            count(&lake, "select sum(amount_minor) from signalweave.events").await,
            expected.amount_minor_sum
        );
        assert_eq!(
            count(&lake, "select count(*) from signalweave.rejections").await as u64,
            expected.invalid
        );
        assert_eq!(
            count(&lake, "select count(*) from signalweave.rejections where reason_code = '' or record_digest = ''").await,
            0
        );
        // Running the same load again lands nothing twice.
        let again = lake.load_file(&sample, &validator, &options).await.unwrap();
        assert_eq!(again.accepted, 0);
        assert_eq!(again.accepted_earlier, expected.events);
        assert_eq!(
            count(&lake, "select count(*) from signalweave.events").await as u64,
            expected.events
        );
        assert_eq!(
            count(&lake, "select count(*) from signalweave.rejections").await as u64,
            expected.invalid
        );
        // Another writer commits to both tables, then every snapshot but that one expires:
        // no retained snapshot names the load, which is still known: its chunks by their
        // recorded identities, its geometry by `sw_loads`.
        let bad = validator
            .validate_bytes(b"not json", DAY_US, DAY_US)
            .unwrap_err();
        let raw: &[u8] = b"not json";
        lake.append(
            LakeTable::Rejections,
            &[signalweave_lake::rejection_batch(DAY_US, "other", &[(raw, 1, bad)]).unwrap()],
            &CommitIdentity::new("other", 0),
        )
        .await
        .unwrap();
        lake.append(
            LakeTable::Events,
            &[batch(&events(WorkloadSpec {
                events: 10,
                dup_fraction: 0.0,
                ..Default::default()
            }))],
            &CommitIdentity::new("other", 0),
        )
        .await
        .unwrap();
        let later = chrono::Utc::now().timestamp_millis() + 1_000;
        for table in [LakeTable::Events, LakeTable::Rejections] {
            let out = lake
                .expire_snapshots(table, Some(1), Some(later))
                .await
                .unwrap();
            assert_eq!(out.snapshots_after, 1, "{}", b.name);
        }
        let third = lake.load_file(&sample, &validator, &options).await.unwrap();
        assert_eq!(third.accepted, 0, "{}", b.name);
        assert_eq!(third.accepted_earlier, expected.events);
        assert_eq!(
            count(&lake, "select count(*) from signalweave.events").await as u64,
            expected.events + 10
        );
        assert_eq!(
            count(&lake, "select count(*) from signalweave.rejections").await as u64,
            expected.invalid + 1
        );
        let other = LoadOptions {
            chunk_records: 400,
            ..options.clone()
        };
        let refused = lake
            .load_file(&sample, &validator, &other)
            .await
            .unwrap_err();
        assert_eq!(refused.kind(), signalweave_model::ErrorKind::InvalidInput);
        assert!(
            refused.to_string().contains("chunk geometry r500"),
            "{refused}"
        );
    }
}

/// The gateway's duplicate index after a restart holds the events ingested within the
/// horizon, read by ingest time from the current snapshot: no snapshot history needed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_duplicate_index_is_rebuilt_by_ingest_time_without_snapshot_history() {
    use signalweave_gateway::{Seen, identity};
    let now = chrono::Utc::now().timestamp_micros();
    let mut all = events(WorkloadSpec {
        events: 900,
        dup_fraction: 0.0,
        ..Default::default()
    });
    assert_eq!(all.len(), 900);
    // Three commits: ingested an hour ago, five minutes ago, a second ago.
    for (i, e) in all.iter_mut().enumerate() {
        e.ingest_time_us = match i / 300 {
            0 => now - 3_600_000_000,
            1 => now - 300_000_000,
            _ => now - 1_000_000,
        };
    }
    for b in support::backends() {
        let lake = open(&b).await;
        for (i, part) in all.chunks(300).enumerate() {
            lake.append(
                LakeTable::Events,
                &[batch(part)],
                &CommitIdentity::new("dedup-test", i as u64),
            )
            .await
            .unwrap();
        }
        let later = chrono::Utc::now().timestamp_millis() + 1_000;
        lake.expire_snapshots(LakeTable::Events, Some(1), Some(later))
            .await
            .unwrap();
        // The hour-old commit's files are pruned by their ingest_time statistics.
        let plan = |from| {
            lake.plan_column_range(LakeTable::Events, "ingest_time", from, i64::MAX, None, None)
        };
        let all_files = plan(i64::MIN).await.unwrap().tasks.len();
        let recent_files = plan(now - 600_000_000).await.unwrap().tasks.len();
        assert!(
            recent_files > 0 && recent_files < all_files,
            "{recent_files} of {all_files}"
        );
        let index = signalweave_gateway::rebuild_dedup(&lake, std::time::Duration::from_secs(600))
            .await
            .unwrap();
        assert_eq!(index.len(), 600, "{}", b.name);
        for (i, e) in all.iter().enumerate() {
            let id = identity(e.tenant.as_str(), e.event_id.as_str());
            let seen = index.check(id, e.content_digest());
            let want = if i < 300 { Seen::New } else { Seen::Committed };
            assert_eq!(seen, want, "{}: event {i}", b.name);
            if i >= 300 {
                // What each event said was rebuilt too.
                assert_eq!(index.check(id, !e.content_digest()), Seen::Conflict);
            }
        }
    }
}

/// A `late_events` row of `job`'s window of (`tenant`, `customer`).
fn late_row(job: &str, tenant: &str, event_id: &str, customer: &str) -> RecordBatch {
    use arrow::array::{ArrayRef, Int64Array, StringArray};
    let schema = signalweave_lake::LATE_EVENTS_SCHEMA.clone();
    let text = |v: &str| -> ArrayRef { Arc::new(StringArray::from(vec![v.to_string()])) };
    let columns: Vec<ArrayRef> = schema
        .fields()
        .iter()
        .map(|f| match f.name().as_str() {
            "job" => text(job),
            "namespace" => text("live"),
            "reason" => text("beyond_allowed_lateness"),
            "tenant" => text(tenant),
            "event_id" => text(event_id),
            "event_type" => text("order_placed"),
            "key" => text(&signalweave_model::join_key(&[tenant, customer])),
            "currency" => text("EUR"),
            "amount_minor" => Arc::new(Int64Array::from(vec![100])) as ArrayRef,
            _ => arrow::compute::cast(
                &Int64Array::from(vec![1_767_225_600_000_000]),
                f.data_type(),
            )
            .unwrap(),
        })
        .collect();
    RecordBatch::try_new(schema, columns).unwrap()
}

/// Promotions on every backend: recorded in order (the database's, not the hosts'
/// clocks), one active per namespace also when two promote at once, and each rollback
/// given its place in the same order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promotions_are_ordered_and_one_is_active_per_namespace_on_every_backend() {
    use signalweave_lake::{Promotion, authoritative, authority_epoch};
    for b in support::backends() {
        let lake = open(&b).await;
        let p = |ns: &str, from: i64, to: i64, ms: i64| Promotion {
            job: "j".into(),
            namespace: ns.into(),
            job_version: 2,
            live_table: "t".into(),
            table: format!("t__{ns}"),
            from_us: from,
            to_us: to,
            promoted_by: "suite".into(),
            promoted_ms: ms,
            rolled_back_by: None,
            rolled_back_ms: None,
            seq: None,
            rolled_back_seq: None,
        };
        lake.promote(&p("a", 0, 100, 2_000)).await.unwrap();
        lake.promote(&p("b", 50, 150, 1_000)).await.unwrap();
        // Two promotions of one namespace at once: one is recorded.
        let (c1, c2) = (p("c", 200, 300, 5_000), p("c", 200, 300, 5_001));
        let (x, y) = tokio::join!(lake.promote(&c1), lake.promote(&c2));
        assert!(x.is_ok() != y.is_ok(), "{}: {x:?} {y:?}", b.name);
        let refused = x.err().or(y.err()).unwrap();
        assert_eq!(
            refused.kind(),
            signalweave_model::ErrorKind::Conflict,
            "{}: {refused}",
            b.name
        );
        let active = lake.active_promotions("j").await.unwrap();
        let seqs: Vec<i64> = active.iter().map(|p| p.seq.unwrap()).collect();
        // The refused promotion's place may have been taken and left unused.
        assert_eq!(&seqs[..2], &[1, 2], "{}", b.name);
        assert!(seqs[2] == 3 || seqs[2] == 4, "{}: {seqs:?}", b.name);
        assert_eq!(authoritative(&active, 60), "b", "{}", b.name);
        let rolled = lake.rollback_promotion("j", "b", "suite").await.unwrap();
        let place = rolled.rolled_back_seq.unwrap();
        assert!(place > seqs[2], "{}: {place}", b.name);
        let all = lake.promotions(Some("j")).await.unwrap();
        assert_eq!(authority_epoch(&all, 60), place, "{}", b.name);
        assert_eq!(authority_epoch(&all, 10), 1, "{}", b.name);
        let active = lake.active_promotions("j").await.unwrap();
        assert_eq!(authoritative(&active, 60), "a", "{}", b.name);
    }
}
