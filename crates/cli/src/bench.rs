//! `signalweave bench`: the benchmarks behind BENCHMARKS.md. Build with `--release`;
//! figures from a debug build are not comparable.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use datafusion::prelude::{ParquetReadOptions, SessionConfig, SessionContext};
use signalweave_fixtures::{Generator, Record, WorkloadSpec};
use signalweave_lake::{CommitIdentity, Lake, LakeConfig, LakeTable, Warehouse};
use signalweave_model::EventBatchBuilder;

/// Benchmarks.
#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {
    /// Append throughput into `events`: one writer, `--batch` events per commit.
    Append {
        /// Events to append in total.
        #[arg(long, default_value_t = 2_000_000)]
        events: u64,
        /// Events per commit.
        #[arg(long, default_value_t = 250_000)]
        batch: usize,
    },
    /// Commit latency as the table grows: `--commits` small appends, reporting the
    /// latency around commit 1, 1,000, 10,000 (those reached) and metadata bytes.
    Commits {
        /// Number of commits.
        #[arg(long, default_value_t = 1_000)]
        commits: u64,
        /// Rows per commit.
        #[arg(long, default_value_t = 100)]
        rows: usize,
        /// Every N commits, expire all but the last 100 snapshots, whatever their age; 0 = never.
        #[arg(long, default_value_t = 0)]
        expire_every: u64,
        /// Every N commits, start a maintenance pass (merge manifests, expire, delete
        /// unreferenced files) beside the appends, as the gateway does; 0 = never.
        #[arg(long, default_value_t = 0)]
        maintain_every: u64,
        /// Snapshots the maintenance keeps: a simulated day at one commit per second
        /// keeps the 2 minutes of the default retention, 120 snapshots.
        #[arg(long, default_value_t = 120)]
        keep_snapshots: usize,
        /// Fence each commit by a lease, as a live job's sink commits are: the commit goes
        /// through the lake's own compare-and-set, with the lease checked in its
        /// transaction.
        #[arg(long)]
        fenced: bool,
        /// Age after which a pass deletes the manifest lists and manifests no retained
        /// snapshot references (lost races). The loops' default is 1 hour, 3,600 commits
        /// at one per second: about 45 s of this simulated day.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "1h")]
        metadata_orphan_age: std::time::Duration,
    },
    /// Acknowledged events/s through the gateway: an in-process gateway on the lake and
    /// `--producers` separate `signalweave produce` processes at `--rate` in total.
    /// Reports ack latency percentiles, gateway CPU seconds per 100k events, peak RSS.
    Gateway {
        /// Target events/s over all producers.
        #[arg(long, default_value_t = 85_000)]
        rate: u64,
        /// How long the producers send.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "20s")]
        duration: std::time::Duration,
        /// Serialized event size, bytes.
        #[arg(long, default_value_t = 1200)]
        event_size: usize,
        /// Producer processes.
        #[arg(long, default_value_t = 2)]
        producers: usize,
        /// Most events per request.
        #[arg(long, default_value_t = 2000)]
        batch_events: usize,
        /// Requests in flight per producer.
        #[arg(long, default_value_t = 64)]
        concurrency: usize,
        /// Gateway configuration.
        #[arg(long, default_value = "catalog/gateway/dev.toml")]
        config: std::path::PathBuf,
    },
    /// Query time over many small files (one per commit, as the gateway lands them),
    /// before and after `lake compact`, and the ratio.
    Compaction {
        /// Small files (commits) to land first.
        #[arg(long, default_value_t = 3_600)]
        files: u64,
        /// Rows per file.
        #[arg(long, default_value_t = 250)]
        rows: usize,
        /// Runs of the query before and after (the median is reported).
        #[arg(long, default_value_t = 5)]
        runs: usize,
    },
    /// Live processing throughput: `--events` landed, then one live job from its start to
    /// caught up (tail + engine + sink + checkpoints).
    Live {
        /// Events to land first.
        #[arg(long, default_value_t = 4_000_000)]
        events: u64,
        /// Events per landed commit.
        #[arg(long, default_value_t = 100_000)]
        batch: usize,
        /// The job.
        #[arg(long, default_value = "jobs/market_aggregates.toml")]
        job: std::path::PathBuf,
    },
    /// Recovery after kill -9 with a large state, to caught up.
    Recovery {
        /// Distinct keys (customers) in the workload.
        #[arg(long, default_value_t = 1_000_000)]
        keys: u64,
        /// Events before the last checkpoint (5M over 1M customers: about 1M keys).
        #[arg(long, default_value_t = 5_000_000)]
        events: u64,
        /// Events landed after the last checkpoint (replayed on recovery).
        #[arg(long, default_value_t = 100_000)]
        tail: u64,
        /// The job.
        #[arg(long, default_value = "jobs/customer_features.toml")]
        job: std::path::PathBuf,
        /// Recover the job of this namespace (left by a run with
        /// `SW_BENCH_RECOVERY_KILL=1`, which aborts itself) in this new process.
        #[arg(long)]
        recover: Option<String>,
    },
    /// End-to-end freshness (event time to visible output) through an in-process gateway
    /// and live job, with the stage breakdown.
    Freshness {
        /// Events/s.
        #[arg(long, default_value_t = 20_000)]
        rate: u64,
        /// How long the producer sends.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "60s")]
        duration: std::time::Duration,
        /// Serialized event size, bytes.
        #[arg(long, default_value_t = 1200)]
        event_size: usize,
        /// The job.
        #[arg(long, default_value = "jobs/market_aggregates.toml")]
        job: std::path::PathBuf,
        /// Override the job's early trigger (the freshness floor of an open window).
        #[arg(long, value_parser = humantime::parse_duration)]
        early_every: Option<std::time::Duration>,
        /// Gateway configuration.
        #[arg(long, default_value = "catalog/gateway/dev.toml")]
        config: std::path::PathBuf,
    },
    /// Backfill throughput over `--events` landed events with no live traffic, against
    /// DataFusion computing the same GROUP BY over the same Parquet files; peak RSS.
    Backfill {
        /// Events to land (reused when `events` holds that many already).
        #[arg(long, default_value_t = 50_000_000)]
        events: u64,
        /// Events per second of event time (sets the range: 50M at 100/s is 5.8 days).
        #[arg(long, default_value_t = 100)]
        events_per_sec: u64,
        /// Sub-range time slice.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "1day")]
        slice: std::time::Duration,
        /// Runs of each side (medians).
        #[arg(long, default_value_t = 1)]
        runs: usize,
        /// Sub-ranges at once.
        #[arg(long, default_value_t = 2)]
        parallelism: usize,
        /// The job.
        #[arg(long, default_value = "jobs/market_aggregates.toml")]
        job: std::path::PathBuf,
        /// Run the backfill with `--exact-dedup`.
        #[arg(long)]
        exact_dedup: bool,
    },
    /// Effects dispatched per second to a local notification sink (in this process),
    /// and the latency from intent to delivered.
    Effects {
        /// Effects to record and dispatch.
        #[arg(long, default_value_t = 20_000)]
        effects: u64,
        /// Requests in flight.
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        /// Effects claimed and settled per ledger transaction.
        #[arg(long, default_value_t = 64)]
        batch: usize,
    },
    /// Reclaim latency: guard crossed to the backfill at its floor, over repeated crossings.
    Reclaim {
        /// Events to land (reused when `events` holds that many already).
        #[arg(long, default_value_t = 5_000_000)]
        events: u64,
        /// Guard crossings.
        #[arg(long, default_value_t = 100)]
        crossings: usize,
        /// The backfill's floor, records/s (0: pause).
        #[arg(long, default_value_t = 1000)]
        floor: u32,
        /// The backfill's ceiling, records/s (so that it outlasts the crossings).
        #[arg(long, default_value_t = 200_000)]
        records_per_sec: u32,
        /// The job.
        #[arg(long, default_value = "jobs/market_aggregates.toml")]
        job: std::path::PathBuf,
    },
    /// Range scan + GROUP BY through `signalweave sql` vs DataFusion on the same Parquet files.
    Scan {
        /// Events to land first (skipped if `events` already holds at least this many).
        #[arg(long, default_value_t = 10_000_000)]
        events: u64,
        /// Runs of each query (the median is reported).
        #[arg(long, default_value_t = 5)]
        runs: usize,
    },
}

pub(crate) fn batches(spec: WorkloadSpec, batch: usize) -> Vec<arrow::array::RecordBatch> {
    let mut out = Vec::new();
    let mut b = EventBatchBuilder::with_capacity(batch);
    for r in Generator::new(spec) {
        let (Record::Event(mut e) | Record::Duplicate(mut e)) = r else {
            continue;
        };
        e.ingest_time_us = e.event_time_us + 1_000_000;
        b.push(&e);
        if b.len() >= batch
            && let Ok(done) = b.finish()
        {
            out.push(done);
        }
    }
    if !b.is_empty()
        && let Ok(done) = b.finish()
    {
        out.push(done);
    }
    out
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

fn dir_bytes(path: &std::path::Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok())
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// Runs one benchmark against the lake `config` and prints its figures.
pub async fn run(cmd: &BenchCommand, config: LakeConfig, schemas: &std::path::Path) -> Result<()> {
    let lake = Lake::open(config.clone()).await?;
    lake.init().await?;
    if let BenchCommand::Gateway {
        rate,
        duration,
        event_size,
        producers,
        batch_events,
        concurrency,
        config,
    } = cmd
    {
        let registry = signalweave_model::SchemaRegistry::load_dir(schemas)?;
        let opts = GatewayBench {
            rate: *rate,
            duration: *duration,
            event_size: *event_size,
            producers: *producers,
            batch_events: *batch_events,
            concurrency: *concurrency,
        };
        return gateway_bench(lake, registry, config, opts).await;
    }
    match cmd {
        BenchCommand::Live { events, batch, job } => {
            return crate::bench_live::throughput(lake, job, *events, *batch).await;
        }
        BenchCommand::Recovery {
            keys,
            events,
            tail,
            job,
            recover,
        } => {
            return crate::bench_live::recovery(
                lake,
                config,
                job,
                *keys,
                *events,
                *tail,
                recover.as_deref(),
            )
            .await;
        }
        BenchCommand::Backfill {
            events,
            events_per_sec,
            slice,
            runs,
            parallelism,
            job,
            exact_dedup,
        } => {
            return crate::bench_live::backfill(
                lake,
                &config,
                job,
                *events,
                *events_per_sec,
                *slice,
                *runs,
                *parallelism,
                *exact_dedup,
            )
            .await;
        }
        BenchCommand::Effects {
            effects,
            concurrency,
            batch,
        } => {
            return crate::effects::bench(lake, *effects, *concurrency, *batch).await;
        }
        BenchCommand::Reclaim {
            events,
            crossings,
            floor,
            records_per_sec,
            job,
        } => {
            return crate::bench_live::reclaim(
                lake,
                job,
                *events,
                *crossings,
                *floor,
                *records_per_sec,
            )
            .await;
        }
        BenchCommand::Freshness {
            rate,
            duration,
            event_size,
            job,
            early_every,
            config: gw,
        } => {
            let registry = signalweave_model::SchemaRegistry::load_dir(schemas)?;
            return crate::bench_live::freshness(
                lake,
                registry,
                crate::bench_live::FreshnessBench {
                    rate: *rate,
                    duration: *duration,
                    event_size: *event_size,
                    job,
                    early_every: *early_every,
                    gateway_config: gw,
                },
            )
            .await;
        }
        _ => {}
    }
    let run_id = uuid_like();
    match cmd {
        BenchCommand::Append { events, batch } => {
            let spec = WorkloadSpec {
                events: *events,
                events_per_sec: 2_000,
                dup_fraction: 0.0,
                late_fraction: 0.0,
                ..Default::default()
            };
            let data = batches(spec, *batch);
            let bytes: usize = data.iter().map(|b| b.get_array_memory_size()).sum();
            let rows: usize = data.iter().map(|b| b.num_rows()).sum();
            let start = Instant::now();
            for (i, b) in data.iter().enumerate() {
                lake.append(
                    LakeTable::Events,
                    std::slice::from_ref(b),
                    &CommitIdentity::new(format!("bench-append-{run_id}"), i as u64),
                )
                .await?;
            }
            let secs = start.elapsed().as_secs_f64();
            println!(
                "append: {rows} events in {} commits, {secs:.2} s, {:.0} events/s, {:.0} in-memory bytes/event, {:.1} MiB/s",
                data.len(),
                rows as f64 / secs,
                bytes as f64 / rows as f64,
                bytes as f64 / secs / 1048576.0
            );
        }
        BenchCommand::Commits {
            commits,
            rows,
            expire_every,
            maintain_every,
            keep_snapshots,
            metadata_orphan_age,
            fenced,
        } => {
            let fence = if *fenced {
                Some(
                    lake.take_lease(
                        "bench",
                        &format!("bench-commits-{run_id}"),
                        "live",
                        &signalweave_lake::lease_owner(&run_id),
                        Duration::from_secs(3_600),
                    )
                    .await?,
                )
            } else {
                None
            };
            // A pool of at most 1,000 distinct batches, appended round robin.
            let spec = WorkloadSpec {
                events: (*commits).min(1_000) * (*rows as u64),
                events_per_sec: 1_000,
                dup_fraction: 0.0,
                late_fraction: 0.0,
                ..Default::default()
            };
            let data = batches(spec, *rows);
            let mut lat = Vec::with_capacity(*commits as usize);
            let mut maintenance: Option<
                tokio::task::JoinHandle<
                    Result<signalweave_lake::MaintenanceReport, signalweave_lake::LakeError>,
                >,
            > = None;
            let mut totals = signalweave_lake::MaintenanceReport::default();
            let mut passes = 0u64;
            let policy = signalweave_lake::MaintenancePolicy {
                retention: Some(signalweave_lake::Retention {
                    keep_last: *keep_snapshots,
                    max_age_ms: 0,
                }),
                metadata_orphan_age: Some(*metadata_orphan_age),
                ..Default::default()
            };
            for i in 0..(*commits as usize) {
                let b = &data[i % data.len()];
                if *maintain_every > 0 && (i as u64).is_multiple_of(*maintain_every) && i > 0 {
                    if let Some(h) = maintenance.take() {
                        if h.is_finished() {
                            let r = h.await??;
                            passes += 1;
                            totals.snapshots_expired += r.snapshots_expired;
                            totals.conflicts += r.conflicts;
                            totals.deleted.manifests += r.deleted.manifests;
                            totals.deleted.manifest_lists += r.deleted.manifest_lists;
                            totals.deleted.metadata_files += r.deleted.metadata_files;
                            totals.deleted.orphans += r.deleted.orphans;
                            totals.manifests_after = r.manifests_after;
                        } else {
                            maintenance = Some(h);
                        }
                    }
                    if maintenance.is_none() {
                        let lake = lake.clone();
                        let policy = policy.clone();
                        maintenance = Some(tokio::spawn(async move {
                            lake.maintain(LakeTable::Events, &policy).await
                        }));
                    }
                }
                let start = Instant::now();
                lake.append_guarded(
                    LakeTable::Events,
                    std::slice::from_ref(b),
                    &CommitIdentity::new(format!("bench-commits-{run_id}"), i as u64),
                    HashMap::new(),
                    &|| Ok(()),
                    fence.as_ref(),
                )
                .await?;
                lat.push(start.elapsed().as_secs_f64() * 1000.0);
                if *expire_every > 0 && (i as u64 + 1).is_multiple_of(*expire_every) {
                    let now = chrono::Utc::now().timestamp_millis();
                    lake.expire_snapshots(LakeTable::Events, Some(100), Some(now))
                        .await?;
                }
            }
            if let Some(h) = maintenance.take() {
                let r = h.await??;
                passes += 1;
                totals.snapshots_expired += r.snapshots_expired;
                totals.conflicts += r.conflicts;
                totals.manifests_after = r.manifests_after;
            }
            for at in [1usize, 100, 1_000, 10_000, 20_000, 86_400] {
                if at > lat.len() {
                    break;
                }
                let lo = at.saturating_sub(1_000).max(1);
                let mut window: Vec<f64> = lat[lo - 1..at].to_vec();
                window.sort_by(f64::total_cmp);
                let p99 = window[((window.len() as f64 * 0.99) as usize).min(window.len() - 1)];
                println!(
                    "commit {at:>6}: {:.1} ms; commits {lo}..={at}: p50 {:.1} ms, p99 {p99:.1} ms",
                    lat[at - 1],
                    median(window.clone()),
                );
            }
            if *maintain_every > 0 {
                println!(
                    "maintenance: {passes} passes; {} snapshots expired; {} CAS conflicts retried; {} orphan manifest lists and manifests deleted; {} manifests in the current snapshot; {} snapshots retained",
                    totals.snapshots_expired,
                    totals.conflicts,
                    totals.deleted.orphans,
                    totals.manifests_after,
                    lake.snapshots(LakeTable::Events).await?.len()
                );
            }
            if let Warehouse::Local { path } = &config.warehouse {
                let table = path.join("signalweave.db").join("events").join("metadata");
                let alt = path.join("signalweave").join("events").join("metadata");
                let bytes = dir_bytes(&table).max(dir_bytes(&alt));
                println!("metadata on disk: {:.1} MB", bytes as f64 / 1e6);
            }
        }
        BenchCommand::Gateway { .. }
        | BenchCommand::Live { .. }
        | BenchCommand::Backfill { .. }
        | BenchCommand::Reclaim { .. }
        | BenchCommand::Effects { .. }
        | BenchCommand::Recovery { .. }
        | BenchCommand::Freshness { .. } => unreachable!("handled above"),
        BenchCommand::Compaction { files, rows, runs } => {
            let spec = WorkloadSpec {
                seed: 11,
                events: files * (*rows as u64),
                // About a day of event time over all files.
                events_per_sec: (files * (*rows as u64) / 86_400).max(1),
                dup_fraction: 0.0,
                late_fraction: 0.0,
                ..Default::default()
            };
            let data = batches(spec, *rows);
            let started = Instant::now();
            let merge = signalweave_lake::MaintenancePolicy {
                expire: false,
                ..Default::default()
            };
            for (i, b) in data.iter().enumerate() {
                lake.append(
                    LakeTable::Events,
                    std::slice::from_ref(b),
                    &CommitIdentity::new(format!("bench-compaction-{run_id}"), i as u64),
                )
                .await?;
                if (i + 1) % 100 == 0 {
                    lake.maintain(LakeTable::Events, &merge).await?;
                }
            }
            println!(
                "landed {} files of {rows} rows in {:.1} s",
                data.len(),
                started.elapsed().as_secs_f64()
            );
            let query = "SELECT market_id, event_type, count(*) AS n, sum(amount_minor) AS amount \
                         FROM signalweave.events GROUP BY market_id, event_type";
            // Ten minutes of event time from the middle of the day: what pruning by the
            // files' and row groups' time statistics saves. Compaction writes events in
            // commit order, not time order, so this is where it could cost.
            let bounds: Vec<i64> = data
                .iter()
                .filter_map(|b| {
                    let t = b
                        .column_by_name("event_time")?
                        .as_any()
                        .downcast_ref::<arrow::array::TimestampMicrosecondArray>()?;
                    Some([arrow::compute::min(t)?, arrow::compute::max(t)?])
                })
                .flatten()
                .collect();
            let (first, last) = (
                bounds.iter().copied().min().unwrap_or(0),
                bounds.iter().copied().max().unwrap_or(0),
            );
            let narrow_from = first + (last - first) / 2;
            let literal = |us: i64| {
                chrono::DateTime::from_timestamp_micros(us)
                    .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true))
                    .unwrap_or_default()
            };
            let narrow = format!(
                "SELECT count(*) AS n, sum(amount_minor) AS amount FROM signalweave.events \
                 WHERE event_time >= TIMESTAMP '{}' AND event_time < TIMESTAMP '{}'",
                literal(narrow_from),
                literal(narrow_from + 600_000_000)
            );
            // The median time of `sql` over the runs, and the last run's answer.
            let time_sql = |lake: Lake, sql: String| async move {
                let mut times = Vec::new();
                let mut answer = Vec::new();
                for _ in 0..*runs {
                    let ctx = lake.session_context().await?;
                    let t = Instant::now();
                    answer = ctx.sql(&sql).await?.collect().await?;
                    times.push(t.elapsed().as_secs_f64() * 1000.0);
                }
                anyhow::Ok((median(times), answer))
            };
            let time_query = |lake: Lake| async move {
                let (ms, out) = time_sql(lake, query.to_string()).await?;
                anyhow::Ok((ms, out.iter().map(|b| b.num_rows()).sum::<usize>()))
            };
            let time_narrow = |lake: Lake| {
                let narrow = narrow.clone();
                async move {
                    let (ms, out) = time_sql(lake, narrow).await?;
                    let answer = arrow::util::pretty::pretty_format_batches(&out)?.to_string();
                    anyhow::Ok((ms, answer))
                }
            };
            // A backfill's plan reads the arrival watermarks: from the manifests' statistics
            // before compaction; after it, from the compacted files' data once (their
            // commits), then from what the catalog database keeps of them.
            let time_plan = |lake: Lake| async move {
                let t = Instant::now();
                let (arrivals, _) = lake
                    .file_statistics(
                        LakeTable::Events,
                        None,
                        "event_time",
                        "ingest_time",
                        5_000_000,
                        &[],
                    )
                    .await?;
                anyhow::Ok((t.elapsed().as_secs_f64() * 1000.0, arrivals.files()))
            };
            let (plan_before, steps_before) = time_plan(lake.clone()).await?;
            let (before, g1) = time_query(lake.clone()).await?;
            let (narrow_before, n1) = time_narrow(lake.clone()).await?;
            let files_before = lake.current_data_files(LakeTable::Events).await?.len();
            let t = Instant::now();
            let report = lake
                .compact(
                    LakeTable::Events,
                    &signalweave_lake::CompactionPolicy::default(),
                )
                .await?;
            let compact_secs = t.elapsed().as_secs_f64();
            let files_after = lake.current_data_files(LakeTable::Events).await?.len();
            let (after, g2) = time_query(lake.clone()).await?;
            if g1 != g2 {
                bail!("the query's answer changed with compaction: {g1} groups, then {g2}");
            }
            let (narrow_after, n2) = time_narrow(lake.clone()).await?;
            if n1 != n2 {
                bail!("the narrow query's answer changed with compaction:\n{n1}\nthen\n{n2}");
            }
            println!(
                "compaction: {} -> {} files ({} partitions, {} rows) in {compact_secs:.1} s",
                files_before, files_after, report.partitions, report.rows
            );
            println!(
                "GROUP BY over the day: before {before:.1} ms, after {after:.1} ms (median of {runs}); ratio before/after {:.2}",
                before / after.max(1e-9)
            );
            println!(
                "ten minutes of event time: before {narrow_before:.1} ms, after {narrow_after:.1} ms (median of {runs}); ratio before/after {:.2}",
                narrow_before / narrow_after.max(1e-9)
            );
            let (plan_read, steps_read) = time_plan(lake.clone()).await?;
            let (plan_kept, steps_kept) = time_plan(lake.clone()).await?;
            if steps_read != steps_before || steps_kept != steps_before {
                bail!(
                    "compaction changed the commits a backfill sees: {steps_before}, then {steps_read} and {steps_kept}"
                );
            }
            println!(
                "a backfill's arrival watermarks ({steps_before} commits): before compaction {plan_before:.1} ms; after, read from the data {plan_read:.1} ms, then kept {plan_kept:.1} ms"
            );
        }
        BenchCommand::Scan { events, runs } => {
            let current: u64 = lake
                .snapshots(LakeTable::Events)
                .await?
                .last()
                .map(|s| s.total_records)
                .unwrap_or(0);
            if current < *events {
                let spec = WorkloadSpec {
                    seed: 7,
                    events: events - current,
                    events_per_sec: 8,
                    customers: 100_000,
                    dup_fraction: 0.0,
                    late_fraction: 0.0,
                    ..Default::default()
                };
                let data = batches(spec, 1_000_000);
                for (i, b) in data.iter().enumerate() {
                    lake.append(
                        LakeTable::Events,
                        std::slice::from_ref(b),
                        &CommitIdentity::new(format!("bench-scan-{run_id}"), i as u64),
                    )
                    .await?;
                }
            }
            let Warehouse::Local { .. } = &config.warehouse else {
                bail!(
                    "bench scan compares with DataFusion on local Parquet files: use an embedded lake"
                );
            };
            let files: Vec<String> = lake
                .current_data_files(LakeTable::Events)
                .await?
                .into_iter()
                .collect();
            let total: u64 = lake
                .snapshots(LakeTable::Events)
                .await?
                .last()
                .map(|s| s.total_records)
                .unwrap_or(0);
            // Four of the ~14.5 days at 8 events/s (from 2026-01-03 to 2026-01-07).
            let predicate = "event_time >= TIMESTAMP '2026-01-03T00:00:00Z' AND event_time < TIMESTAMP '2026-01-07T00:00:00Z'";
            let query = |table: &str| {
                format!(
                    "SELECT market_id, event_type, count(*) AS n, sum(amount_minor) AS total \
                     FROM {table} WHERE {predicate} GROUP BY market_id, event_type"
                )
            };
            let sw = lake.session_context().await?;
            let direct = SessionContext::new_with_config(SessionConfig::new());
            let mut tables = Vec::new();
            for (i, f) in files.iter().enumerate() {
                let name = format!("f{i}");
                direct
                    .register_parquet(&name, f, ParquetReadOptions::default())
                    .await?;
                tables.push(format!("SELECT * FROM {name}"));
            }
            direct
                .sql(&format!(
                    "CREATE VIEW direct AS {}",
                    tables.join(" UNION ALL ")
                ))
                .await?
                .collect()
                .await?;
            let mut sw_t = Vec::new();
            let mut df_t = Vec::new();
            let mut scanned = 0usize;
            for _ in 0..*runs {
                let t = Instant::now();
                let a = sw
                    .sql(&query("signalweave.events"))
                    .await?
                    .collect()
                    .await?;
                sw_t.push(t.elapsed().as_secs_f64());
                let t = Instant::now();
                let b = direct.sql(&query("direct")).await?.collect().await?;
                df_t.push(t.elapsed().as_secs_f64());
                let rows = |v: &Vec<arrow::array::RecordBatch>| {
                    v.iter().map(|b| b.num_rows()).sum::<usize>()
                };
                if rows(&a) != rows(&b) {
                    bail!(
                        "signalweave and DataFusion disagree: {} vs {} groups",
                        rows(&a),
                        rows(&b)
                    );
                }
                scanned = rows(&a);
            }
            let in_range = sw
                .sql(&format!(
                    "SELECT count(*) FROM signalweave.events WHERE {predicate}"
                ))
                .await?
                .collect()
                .await?;
            let in_range = arrow::array::AsArray::as_primitive::<arrow::datatypes::Int64Type>(
                in_range[0].column(0),
            )
            .value(0) as f64;
            let (s, d) = (median(sw_t), median(df_t));
            println!(
                "scan: {total} events in the table, {in_range} in range, {scanned} groups, {} files",
                files.len()
            );
            println!(
                "signalweave sql: {:.3} s median, {:.0} rows/s in range ({:.0} rows/s of table)",
                s,
                in_range / s,
                total as f64 / s
            );
            println!(
                "datafusion direct parquet: {d:.3} s median, {:.0} rows/s in range",
                in_range / d
            );
            println!(
                "ratio (signalweave rows/s / datafusion rows/s): {:.2}",
                d / s
            );
        }
    }
    Ok(())
}

pub(crate) fn uuid_like() -> String {
    format!(
        "{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default()
    )
}

/// CPU seconds (user + system) and peak RSS bytes of this process, from /proc.
pub fn proc_usage() -> Option<(f64, u64)> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let hwm_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    // Linux reports CPU time in USER_HZ ticks, 100 per second on every mainstream platform.
    Some((ticks / 100.0, hwm_kib * 1024))
}

struct GatewayBench {
    rate: u64,
    duration: std::time::Duration,
    event_size: usize,
    producers: usize,
    batch_events: usize,
    concurrency: usize,
}

async fn gateway_bench(
    lake: Lake,
    registry: signalweave_model::SchemaRegistry,
    config_path: &std::path::Path,
    o: GatewayBench,
) -> Result<()> {
    let mut config = crate::ingest::gateway_config(config_path)?;
    config.listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    let listener = tokio::net::TcpListener::bind(config.listen).await?;
    let url = format!("http://{}", listener.local_addr()?);
    let interval = config.commit.interval;
    let gateway =
        signalweave_gateway::Gateway::start(config, lake, std::sync::Arc::new(registry)).await?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(gateway.serve(listener, async move {
        let _ = stopped.await;
    }));
    let (cpu0, _) = proc_usage().unwrap_or_default();
    let exe = std::env::current_exe()?;
    let per = (o.rate / o.producers.max(1) as u64).max(1);
    let started = Instant::now();
    let mut children = Vec::new();
    for i in 0..o.producers.max(1) {
        let child = tokio::process::Command::new(&exe)
            .args([
                "produce",
                "--url",
                &url,
                "--rate",
                &per.to_string(),
                "--duration",
                &format!("{}ms", o.duration.as_millis()),
                "--event-size",
                &o.event_size.to_string(),
                "--producer-id",
                &format!("bench-{i}"),
                "--seed",
                &(i as u64 + 1).to_string(),
                "--batch-events",
                &o.batch_events.to_string(),
                "--concurrency",
                &o.concurrency.to_string(),
                "--format",
                "json",
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()?;
        children.push(child);
    }
    let mut reports = Vec::new();
    for child in children {
        let out = child.wait_with_output().await?;
        let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)?;
        let map: std::collections::HashMap<String, String> = rows
            .into_iter()
            .filter_map(|r| {
                Some((
                    r.get("measure")?.as_str()?.to_string(),
                    r.get("value")?.as_str()?.to_string(),
                ))
            })
            .collect();
        reports.push(map);
    }
    let wall = started.elapsed().as_secs_f64();
    let (cpu1, rss) = proc_usage().unwrap_or_default();
    let _ = stop.send(());
    let committed = server.await??;
    let num = |m: &std::collections::HashMap<String, String>, k: &str| -> f64 {
        m.get(k).and_then(|v| v.parse().ok()).unwrap_or(0.0)
    };
    let acked: f64 = reports
        .iter()
        .map(|m| num(m, "accepted") + num(m, "duplicate"))
        .sum();
    let rate: f64 = reports.iter().map(|m| num(m, "acked events/s")).sum();
    let worst = |k: &str| reports.iter().map(|m| num(m, k)).fold(0.0, f64::max);
    let lost: f64 = reports
        .iter()
        .map(|m| num(m, "dropped (buffer full)") + num(m, "dropped (too old)") + num(m, "rejected"))
        .sum();
    let throttled: f64 = reports
        .iter()
        .map(|m| num(m, "throttled (429)") + num(m, "unavailable (503)"))
        .sum();
    let producer_cpu: f64 = reports.iter().map(|m| num(m, "cpu s")).sum();
    let gateway_cpu = cpu1 - cpu0;
    println!(
        "gateway: {} B events, offered {} ev/s by {} producers for {:?}; commit interval {:?}",
        o.event_size, o.rate, o.producers, o.duration, interval
    );
    println!(
        "  acked {acked:.0} events ({rate:.0} ev/s over the producers' runs, wall {wall:.1} s); {} commits; lost {lost:.0}; 429/503 answers {throttled:.0}",
        committed.commits
    );
    println!(
        "  ack latency (enqueue -> ack, worst producer): p50 {:.0} ms, p99 {:.0} ms, p99.9 {:.0} ms",
        worst("ack p50 ms"),
        worst("ack p99 ms"),
        worst("ack p99.9 ms")
    );
    println!(
        "  gateway CPU {:.2} s = {:.2} CPU s per 100k events; producers CPU {:.2} s; gateway peak RSS {:.0} MiB",
        gateway_cpu,
        gateway_cpu / acked.max(1.0) * 100_000.0,
        producer_cpu,
        rss as f64 / 1048576.0
    );
    Ok(())
}
