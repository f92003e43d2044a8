//! `signalweave bench`: the benchmarks behind BENCHMARKS.md. Build with `--release`;
//! figures from a debug build are not comparable.

use std::time::Instant;

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

fn batches(spec: WorkloadSpec, batch: usize) -> Vec<arrow::array::RecordBatch> {
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

fn median(mut v: Vec<f64>) -> f64 {
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
pub async fn run(cmd: &BenchCommand, config: LakeConfig) -> Result<()> {
    let lake = Lake::open(config.clone()).await?;
    lake.init().await?;
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
        } => {
            let spec = WorkloadSpec {
                events: commits * (*rows as u64),
                events_per_sec: 1_000,
                dup_fraction: 0.0,
                late_fraction: 0.0,
                ..Default::default()
            };
            let data = batches(spec, *rows);
            let mut lat = Vec::with_capacity(data.len());
            for (i, b) in data.iter().enumerate() {
                let start = Instant::now();
                lake.append(
                    LakeTable::Events,
                    std::slice::from_ref(b),
                    &CommitIdentity::new(format!("bench-commits-{run_id}"), i as u64),
                )
                .await?;
                lat.push(start.elapsed().as_secs_f64() * 1000.0);
                if *expire_every > 0 && (i as u64 + 1).is_multiple_of(*expire_every) {
                    let now = chrono::Utc::now().timestamp_millis();
                    lake.expire_snapshots(LakeTable::Events, Some(100), Some(now))
                        .await?;
                }
            }
            for at in [1usize, 100, 1_000, 10_000, 86_400] {
                if at > lat.len() {
                    break;
                }
                let lo = at.saturating_sub(10).max(1);
                let window: Vec<f64> = lat[lo - 1..at].to_vec();
                println!(
                    "commit {at:>6}: {:.1} ms (median of commits {lo}..={at}: {:.1} ms)",
                    lat[at - 1],
                    median(window)
                );
            }
            if let Warehouse::Local { path } = &config.warehouse {
                let table = path.join("signalweave.db").join("events").join("metadata");
                let alt = path.join("signalweave").join("events").join("metadata");
                let bytes = dir_bytes(&table).max(dir_bytes(&alt));
                println!("metadata on disk: {:.1} MB", bytes as f64 / 1e6);
            }
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

fn uuid_like() -> String {
    format!(
        "{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default()
    )
}
