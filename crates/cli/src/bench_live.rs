//! `signalweave bench live | recovery | freshness | backfill | reclaim`: the live job's and
//! the backfills' benchmarks.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use signalweave_fixtures::WorkloadSpec;
use signalweave_lake::{CommitIdentity, Lake, LakeConfig, LakeTable};
use signalweave_runner::backfill::{self, BackfillRequest, RunOptions};
use signalweave_runner::budget::{Budgets, GuardReading, Guards};
use signalweave_runner::freshness::STAGES;
use signalweave_runner::{LiveConfig, LiveJob, RunnerMetrics};
use signalweave_window::JobSpec;

use crate::bench::{batches, proc_usage};

fn spec(path: &Path, early_every: Option<Duration>) -> Result<Arc<JobSpec>> {
    let mut spec =
        JobSpec::from_file(path).with_context(|| format!("reading job spec {}", path.display()))?;
    if let Some(e) = early_every {
        spec.triggers.early_every = Some(e);
    }
    Ok(Arc::new(spec))
}

async fn preload(lake: &Lake, spec: WorkloadSpec, batch: usize, writer: &str) -> Result<u64> {
    let data = batches(spec, batch);
    let mut rows = 0;
    for (i, b) in data.iter().enumerate() {
        lake.append(
            LakeTable::Events,
            std::slice::from_ref(b),
            &CommitIdentity::new(writer, i as u64),
        )
        .await?;
        rows += b.num_rows() as u64;
    }
    Ok(rows)
}

fn config(namespace: &str) -> LiveConfig {
    LiveConfig {
        namespace: namespace.to_string(),
        ..LiveConfig::default()
    }
}

/// Live processing throughput: `events` landed first, then one live job from its start
/// to caught up (tail + engine + sink + checkpoints).
pub async fn throughput(lake: Lake, job: &Path, events: u64, batch: usize) -> Result<()> {
    let run = crate::bench::uuid_like();
    let spec = spec(job, None)?;
    let landed = preload(
        &lake,
        WorkloadSpec {
            events,
            events_per_sec: 2_000,
            dup_fraction: 0.0,
            late_fraction: 0.0,
            ..Default::default()
        },
        batch,
        &format!("bench-live-{run}"),
    )
    .await?;
    let (cpu0, _) = proc_usage().unwrap_or_default();
    let start = Instant::now();
    let mut live = LiveJob::recover(
        lake.clone(),
        Arc::clone(&spec),
        config(&format!("bench_{run}")),
        Arc::new(RunnerMetrics::new()),
    )
    .await?;
    let records = live.catch_up().await?;
    let secs = start.elapsed().as_secs_f64();
    let (cpu1, rss) = proc_usage().unwrap_or_default();
    let status = live.status().lock().map(|s| s.clone()).unwrap_or_default();
    println!(
        "live throughput ({}): {records} of {landed} landed events in {secs:.2} s = {:.0} events/s \
         (tail + engine + sink, {} epochs, {} output rows, {} keys); {:.2} CPU s, peak RSS {} MiB",
        spec.name,
        records as f64 / secs,
        live.epoch(),
        status.outputs,
        status.state_keys,
        cpu1 - cpu0,
        rss / 1_048_576
    );
    Ok(())
}

/// Recovery after kill -9 with a large state: a job caught up over `events` (about
/// `keys` keys), then `tail` more events land and the job dies without a checkpoint; a
/// fresh process (a new lake handle) recovers and catches up. The time to caught-up is
/// reported.
pub async fn recovery(
    lake: Lake,
    config_: LakeConfig,
    job: &Path,
    keys: u64,
    events: u64,
    tail: u64,
    recover: Option<&str>,
) -> Result<()> {
    let run = crate::bench::uuid_like();
    let spec = spec(job, None)?;
    if let Some(namespace) = recover {
        // The restarted process: recover and catch up.
        let start = Instant::now();
        let mut job = LiveJob::recover(
            lake,
            Arc::clone(&spec),
            config(namespace),
            Arc::new(RunnerMetrics::new()),
        )
        .await?;
        let restored = start.elapsed().as_secs_f64();
        let replayed = job.catch_up().await?;
        let secs = start.elapsed().as_secs_f64();
        let status = job.status().lock().map(|s| s.clone()).unwrap_or_default();
        let (_, rss) = proc_usage().unwrap_or_default();
        println!(
            "recovery (new process): {secs:.2} s from start to caught up ({restored:.2} s restoring {} keys, \
             then {replayed} events replayed and checkpointed); peak RSS {} MiB",
            status.state_keys,
            rss / 1_048_576
        );
        return Ok(());
    }
    let writer = format!("bench-recovery-{run}");
    let workload = |events: u64, seed: u64| WorkloadSpec {
        seed,
        events,
        customers: keys,
        markets: (keys / 10).max(50) as u32,
        events_per_sec: 5_000,
        dup_fraction: 0.0,
        late_fraction: 0.0,
        ..Default::default()
    };
    preload(&lake, workload(events, 7), 250_000, &writer).await?;
    let namespace = format!("bench_{run}");
    let metrics = Arc::new(RunnerMetrics::new());
    let mut first = LiveJob::recover(
        lake.clone(),
        Arc::clone(&spec),
        config(&namespace),
        Arc::clone(&metrics),
    )
    .await?;
    let t = Instant::now();
    first.catch_up().await?;
    let caught_up = t.elapsed().as_secs_f64();
    // A live job at rest: its early trigger has fired since the last records, and a
    // checkpoint followed (what a job that ran for a while looks like when it dies).
    if let Some(early) = spec.triggers.early_every {
        tokio::time::sleep(early + Duration::from_secs(1)).await;
        first.step(true).await?;
    }
    let status = first.status().lock().map(|s| s.clone()).unwrap_or_default();
    println!(
        "recovery: first run caught up over {events} events in {caught_up:.1} s: {} keys, checkpoint {} MiB",
        status.state_keys,
        status.checkpoint_bytes / 1_048_576
    );
    // Work after the last checkpoint, then the crash: the job is dropped without a checkpoint.
    let mut tail_spec = workload(tail, 8);
    tail_spec.start_us += (events / 5_000) as i64 * 1_000_000;
    preload(&lake, tail_spec, 250_000, &format!("{writer}-tail")).await?;
    if std::env::var("SW_BENCH_RECOVERY_KILL").is_ok_and(|v| v == "1") {
        // kill -9 of this process: nothing runs after it; recover in a new process with
        // `bench recovery --recover <namespace>`.
        println!("recovery: killing the job now; recover with --recover {namespace}");
        std::process::abort();
    }
    drop(first);
    let fresh = Lake::open(config_).await?;
    let start = Instant::now();
    let mut job = LiveJob::recover(
        fresh,
        Arc::clone(&spec),
        config(&namespace),
        Arc::new(RunnerMetrics::new()),
    )
    .await?;
    let restored = start.elapsed().as_secs_f64();
    let replayed = job.catch_up().await?;
    let secs = start.elapsed().as_secs_f64();
    println!(
        "recovery: {:.2} s from start to caught up ({restored:.2} s restoring {} keys, then {replayed} events replayed and checkpointed)",
        secs, status.state_keys
    );
    Ok(())
}

/// Options of the freshness benchmark.
pub struct FreshnessBench<'a> {
    /// Events/s.
    pub rate: u64,
    /// How long.
    pub duration: Duration,
    /// Event size, bytes.
    pub event_size: usize,
    /// The job.
    pub job: &'a Path,
    /// Early trigger override.
    pub early_every: Option<Duration>,
    /// Gateway configuration.
    pub gateway_config: &'a Path,
}

/// End-to-end freshness at `rate`: an in-process gateway and live job on the lake, an
/// in-process producer; per-event freshness by stage from the job's samples.
pub async fn freshness(
    lake: Lake,
    registry: signalweave_model::SchemaRegistry,
    b: FreshnessBench<'_>,
) -> Result<()> {
    use signalweave_producer::workload::{EventFactory, EventShape, drive};
    use signalweave_producer::{Producer, ProducerConfig};
    let run = crate::bench::uuid_like();
    let spec = spec(b.job, b.early_every)?;
    let mut gw_config = crate::ingest::gateway_config(b.gateway_config)?;
    gw_config.listen = "127.0.0.1:0".parse()?;
    let gateway = crate::live::BackgroundGateway::start(&lake, registry, gw_config).await?;
    let addr = gateway.addr;
    let live_config = LiveConfig {
        freshness_sample_every: 16,
        ..config(&format!("bench_{run}"))
    };
    // Start at the current end of the landing table: only this run's events count.
    let mut job = LiveJob::recover(
        lake.clone(),
        Arc::clone(&spec),
        live_config,
        Arc::new(RunnerMetrics::new()),
    )
    .await?;
    job.catch_up().await?;
    let (stop_job, job_stopped) = crate::live::stop_signal();
    let job_task = tokio::spawn(job.run(job_stopped));
    let mut pc = ProducerConfig::new(format!("http://{addr}"), "sw-dev-tenant-0");
    pc.concurrency = 32;
    let producer = Producer::start(pc)?;
    let factory = EventFactory::new(EventShape {
        event_bytes: b.event_size,
        markets: 1_000,
        ..EventShape::new("tenant-0", format!("fresh-{run}"))
    });
    let (cpu0, _) = proc_usage().unwrap_or_default();
    let report = drive(
        producer,
        factory,
        b.rate,
        b.duration,
        Duration::from_secs(60),
    )
    .await;
    // Let the last events become visible: a trigger period and a checkpoint.
    tokio::time::sleep(b.early_every.unwrap_or(Duration::from_secs(20)) + Duration::from_secs(3))
        .await;
    gateway.stop().await?;
    let _ = stop_job.send(true);
    let job = job_task.await??;
    let (cpu1, rss) = proc_usage().unwrap_or_default();
    println!(
        "freshness: {} events/s of {} B for {:?} ({} acknowledged), job {} with early trigger {:?}; {:.1} CPU s, peak RSS {} MiB",
        b.rate,
        b.event_size,
        b.duration,
        report.stats.accepted,
        spec.name,
        spec.triggers.early_every,
        cpu1 - cpu0,
        rss / 1_048_576
    );
    println!(
        "{:<18} {:>9} {:>9} {:>9}",
        "stage", "p50 s", "p99 s", "p99.9 s"
    );
    for (i, stage) in STAGES.iter().enumerate() {
        println!(
            "{stage:<18} {:>9.3} {:>9.3} {:>9.3}",
            job.freshness_quantile(i, 0.5),
            job.freshness_quantile(i, 0.99),
            job.freshness_quantile(i, 0.999)
        );
    }
    println!("samples: {}", job.freshness_samples());
    Ok(())
}

/// Lands `events` generated events (no duplicates, nothing late) in commits of 1M,
/// streaming, unless `signalweave.events` holds that many already. Returns the range of
/// event time they cover, µs.
async fn land_history(lake: &Lake, events: u64, events_per_sec: u64) -> Result<(i64, i64)> {
    let spec = WorkloadSpec {
        seed: 11,
        events,
        events_per_sec,
        customers: 100_000,
        dup_fraction: 0.0,
        late_fraction: 0.0,
        ..Default::default()
    };
    let start = spec.start_us;
    let end = start + (events as i128 * 1_000_000 / events_per_sec.max(1) as i128) as i64;
    let landed = lake
        .snapshots(LakeTable::Events)
        .await?
        .last()
        .map(|s| s.total_records)
        .unwrap_or(0);
    if landed >= events {
        println!("{landed} events landed already: reusing them");
        return Ok((start, end));
    }
    let run = crate::bench::uuid_like();
    let t = Instant::now();
    let mut b = signalweave_model::EventBatchBuilder::with_capacity(1_000_000);
    let mut seq = 0u64;
    let identity = |seq: u64| CommitIdentity::new(format!("bench-backfill-{run}"), seq);
    // Ingest times as a gateway's clock stamps them: forward by at least a microsecond per
    // record, and a second after the event time or later. So each commit's records arrived
    // after the last one's: events come out of order, and event time plus a second alone
    // would interleave commits' arrivals, as no gateway does.
    let mut clock = i64::MIN;
    for r in signalweave_fixtures::Generator::new(spec) {
        let (signalweave_fixtures::Record::Event(mut e)
        | signalweave_fixtures::Record::Duplicate(mut e)) = r
        else {
            continue;
        };
        clock = clock.saturating_add(1).max(e.event_time_us + 1_000_000);
        e.ingest_time_us = clock;
        b.push(&e);
        if b.len() >= 1_000_000 {
            lake.append(LakeTable::Events, &[b.finish()?], &identity(seq))
                .await?;
            seq += 1;
        }
    }
    if !b.is_empty() {
        lake.append(LakeTable::Events, &[b.finish()?], &identity(seq))
            .await?;
    }
    println!(
        "landed {events} events in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    Ok((start, end))
}

fn backfill_request(
    spec: &JobSpec,
    namespace: &str,
    range: (i64, i64),
    slice: Duration,
) -> BackfillRequest {
    BackfillRequest {
        job: spec.name.clone(),
        job_version: spec.version,
        namespace: namespace.to_string(),
        from_us: range.0,
        to_us: range.1,
        slice,
        key_group_splits: 1,
        exact_dedup: false,
        budgets: Budgets::default(),
        created_by: "bench".into(),
    }
}

/// Backfill throughput over landed events with no live traffic, against DataFusion
/// computing the same GROUP BY over the same Parquet files in the same run; peak RSS.
#[allow(clippy::too_many_arguments)]
pub async fn backfill(
    lake: Lake,
    config: &LakeConfig,
    job: &Path,
    events: u64,
    events_per_sec: u64,
    slice: Duration,
    runs: usize,
    parallelism: usize,
    exact_dedup: bool,
) -> Result<()> {
    let signalweave_lake::Warehouse::Local { .. } = &config.warehouse else {
        anyhow::bail!(
            "bench backfill compares with DataFusion on local Parquet files: use an embedded lake"
        );
    };
    let spec = spec(job, None)?;
    let range = land_history(&lake, events, events_per_sec).await?;
    let (_, rss_before) = proc_usage().unwrap_or_default();
    let mut bf_secs = Vec::new();
    let mut records = 0;
    // Where the last run's time went, by stage, summed over its sub-ranges.
    let mut stages = Vec::new();
    for _ in 0..runs.max(1) {
        let namespace = format!("bench_{}", crate::bench::uuid_like());
        let mut request = backfill_request(&spec, &namespace, range, slice);
        request.exact_dedup = exact_dedup;
        backfill::create(&lake, &spec, &request).await?;
        let options = RunOptions {
            parallelism,
            ..RunOptions::default()
        };
        let progress = Arc::clone(&options.progress);
        let metrics = Arc::clone(&options.metrics);
        let t = Instant::now();
        let record = backfill::run(&lake, Arc::clone(&spec), &namespace, options).await?;
        bf_secs.push(t.elapsed().as_secs_f64());
        stages = backfill::stage_totals(&metrics, &spec.name, &namespace);
        anyhow::ensure!(record.state == "completed", "backfill {}", record.state);
        records = progress.lock().map(|p| p.records).unwrap_or(0);
    }
    let (_, rss_after) = proc_usage().unwrap_or_default();
    // The backfill's reading alone: its columns of the same files, read by pages in its
    // range as its sub-ranges read them, `parallelism` files at a time, with no engine.
    let read_range = (range.0 - backfill::lead_in_us(&spec), range.1);
    // And the same less the dedup identity's columns, which DataFusion's GROUP BY does not
    // read: what reading the identity costs the backfill, before it is digested.
    let columns = backfill::source_columns(&spec);
    let without_identity: Vec<String> = columns
        .iter()
        .filter(|c| !spec.dedup.identity.contains(c))
        .cloned()
        .collect();
    let (mut read_secs, mut unkeyed_secs) = (Vec::new(), Vec::new());
    let (mut read_rows, mut unkeyed_rows) = (0, 0);
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        read_rows = read_alone(&lake, &spec, &columns, read_range, parallelism).await?;
        read_secs.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        unkeyed_rows = read_alone(&lake, &spec, &without_identity, read_range, parallelism).await?;
        unkeyed_secs.push(t.elapsed().as_secs_f64());
    }
    anyhow::ensure!(
        unkeyed_rows == read_rows,
        "the reads with and without the identity columns read {read_rows} and {unkeyed_rows} rows"
    );
    // DataFusion: the job's GROUP BY (per market and minute, count and sum by event type)
    // straight over the Parquet files, with and without the dedup by (tenant, event_id).
    let files: Vec<String> = lake
        .current_data_files(LakeTable::Events)
        .await?
        .into_iter()
        .collect();
    let ctx = datafusion::prelude::SessionContext::new();
    let mut parts = Vec::new();
    for (i, f) in files.iter().enumerate() {
        ctx.register_parquet(
            &format!("f{i}"),
            f,
            datafusion::prelude::ParquetReadOptions::default(),
        )
        .await?;
        parts.push(format!("SELECT * FROM f{i}"));
    }
    ctx.sql(&format!(
        "CREATE VIEW direct AS {}",
        parts.join(" UNION ALL ")
    ))
    .await?
    .collect()
    .await?;
    let types = spec
        .source
        .event_types
        .iter()
        .map(|t| format!("'{t}'"))
        .collect::<Vec<_>>()
        .join(", ");
    let aggs = spec
        .aggregates
        .iter()
        .map(|a| {
            let filter = a
                .event_type
                .as_deref()
                .map(|t| format!(" FILTER (WHERE event_type = '{t}')"))
                .unwrap_or_default();
            match (&a.function, &a.column) {
                (signalweave_window::AggregateFunction::Count, _) => format!("count(*){filter}"),
                (f, Some(c)) => format!("{}({c}){filter}", format!("{f:?}").to_lowercase()),
                (f, None) => format!("{}(1){filter}", format!("{f:?}").to_lowercase()),
            }
        })
        .collect::<Vec<_>>()
        .join(", ");
    let key = spec.key.columns.join(", ");
    let window = spec.window.span_us();
    let predicate = format!(
        "event_time >= to_timestamp_micros({}) AND event_time < to_timestamp_micros({}) AND event_type IN ({types})",
        range.0, range.1
    );
    let group = |source: &str| {
        format!(
            "SELECT {key}, date_bin(INTERVAL '{window} microseconds', event_time) AS w, count(*) AS events, {aggs} \
             FROM {source} GROUP BY {key}, w"
        )
    };
    let plain = group(&format!("(SELECT * FROM direct WHERE {predicate})"));
    let dedup = group(&format!(
        "(SELECT DISTINCT tenant, event_id, {key}, event_type, event_time, amount_minor FROM direct WHERE {predicate})"
    ));
    let timed = |sql: String| {
        let ctx = ctx.clone();
        async move {
            let mut secs = Vec::new();
            let mut rows = 0;
            for _ in 0..runs.max(1) {
                let t = Instant::now();
                let out = ctx.sql(&sql).await?.collect().await?;
                secs.push(t.elapsed().as_secs_f64());
                rows = out.iter().map(|b| b.num_rows()).sum::<usize>();
            }
            anyhow::Ok((crate::bench::median(secs), rows))
        }
    };
    let (df_plain, plain_rows) = timed(plain).await?;
    let (df_dedup, _) = timed(dedup).await?;
    let bf = crate::bench::median(bf_secs);
    println!(
        "backfill ({}, slice {}, {parallelism} at a time{}): {records} records in {bf:.2} s = {:.0} records/s; \
         peak RSS {} MiB (before the backfill {} MiB)",
        spec.name,
        humantime::format_duration(slice),
        if exact_dedup { ", exact dedup" } else { "" },
        records as f64 / bf,
        rss_after / 1_048_576,
        rss_before / 1_048_576,
    );
    println!(
        "DataFusion GROUP BY over the same {} Parquet files: {df_plain:.2} s ({plain_rows} groups), \
         with dedup {df_dedup:.2} s",
        files.len()
    );
    println!(
        "ratio backfill / DataFusion (throughput): {:.2} (with dedup: {:.2}); target >= 0.8",
        df_plain / bf,
        df_dedup / bf
    );
    let read = crate::bench::median(read_secs);
    println!(
        "the backfill's reading alone (its {} columns of the same files, less the arrival time \
         and currency where a file's records all arrived at one watermark, by pages in range, no engine): \
         {read:.2} s ({read_rows} rows) = {:.0}% of the backfill's time{}",
        backfill::source_columns(&spec).len(),
        100.0 * read / bf,
        if exact_dedup {
            " (the range's files only: --exact-dedup also reads the copies of other files)"
        } else {
            ""
        }
    );
    println!(
        "the backfill's time by stage, summed over its sub-ranges (last run; {parallelism} at a time, \
         and commits beside them): {}",
        stages
            .iter()
            .map(|(stage, secs)| format!("{stage} {secs:.2} s"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let unkeyed = crate::bench::median(unkeyed_secs);
    // Medians of separate runs: on a noisy machine the difference can come out below 0.
    let identity = (read - unkeyed).max(0.0);
    println!(
        "of which the dedup identity's columns ({}): {:.2} s = {:.0}% of the backfill's time \
         (the same reading without them: {unkeyed:.2} s)",
        spec.dedup.identity.join(", "),
        identity,
        100.0 * identity / bf,
    );
    Ok(())
}

/// Reads `columns` (those a backfill of `spec` reads, or some of them), from every landed
/// file over `range` by pages in range, `parallelism` files at a time (each on a task of
/// its own, as the backfill's sub-ranges are); returns the rows read. As the backfill, it leaves out the
/// arrival time of a file whose records all arrived at one watermark (the backfill also
/// asks that none of them be late by it: none of the bench's are).
async fn read_alone(
    lake: &Lake,
    spec: &JobSpec,
    columns: &[String],
    range: (i64, i64),
    parallelism: usize,
) -> Result<u64> {
    use futures::TryStreamExt;
    let tasks = lake
        .plan_time_range_of(LakeTable::Events, range.0, range.1, None, Some(columns))
        .await?
        .tasks;
    let keys: Vec<&str> = spec.key.columns.iter().map(String::as_str).collect();
    let (arrivals, _) = lake
        .file_statistics(
            LakeTable::Events,
            None,
            &spec.time.event_time_column,
            backfill::ARRIVAL_COLUMN,
            signalweave_window::micros(spec.time.max_out_of_orderness),
            &keys,
        )
        .await?;
    let permits = Arc::new(tokio::sync::Semaphore::new(parallelism.max(1)));
    let mut reads = tokio::task::JoinSet::new();
    let late_only = backfill::late_only_columns(spec);
    for mut task in tasks {
        if arrivals.uniform_of(&task.data_file_path).is_some() {
            signalweave_lake::project_without(&mut task, &late_only);
        }
        let (lake, permits) = (lake.clone(), Arc::clone(&permits));
        reads.spawn(async move {
            let _permit = permits.acquire_owned().await?;
            let mut batches = lake
                .read_pages_in_range(LakeTable::Events, task, range.0, range.1)
                .await?;
            let mut rows = 0u64;
            while let Some(batch) = batches.try_next().await? {
                rows += batch.num_rows() as u64;
            }
            anyhow::Ok(rows)
        });
    }
    let mut rows = 0;
    while let Some(read) = reads.join_next().await {
        rows += read??;
    }
    Ok(rows)
}

/// Reclaim latency: a backfill runs at full speed while a simulated live job's queue age
/// crosses its guard every `period` (and clears half a period later); the time from each
/// crossing to the backfill at its floor is measured.
pub async fn reclaim(
    lake: Lake,
    job: &Path,
    events: u64,
    crossings: usize,
    floor: u32,
    ceiling: u32,
) -> Result<()> {
    let spec = spec(job, None)?;
    let range = land_history(&lake, events, 100).await?;
    let namespace = format!("reclaim_{}", crate::bench::uuid_like());
    let mut request = backfill_request(&spec, &namespace, range, Duration::from_secs(3600));
    request.budgets.floor_records_per_sec = floor;
    request.budgets.records_per_sec = Some(ceiling);
    backfill::create(&lake, &spec, &request).await?;
    let reading = Arc::new(std::sync::Mutex::new(GuardReading::from_statuses(&[])));
    let probe: backfill::GuardProbe = {
        let reading = Arc::clone(&reading);
        Arc::new(move || {
            let r = reading.lock().map(|r| *r).ok();
            Box::pin(async move { r })
        })
    };
    let options = RunOptions {
        probe,
        guards: Guards {
            clear_hold: Duration::from_millis(300),
            step_every: Duration::from_millis(100),
            ..Guards::default()
        },
        ..RunOptions::default()
    };
    let metrics = Arc::clone(&options.metrics);
    let running = tokio::spawn({
        let (lake, spec, namespace) = (lake.clone(), Arc::clone(&spec), namespace.clone());
        async move { backfill::run(&lake, spec, &namespace, options).await }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    for _ in 0..crossings {
        if running.is_finished() {
            break;
        }
        if let Ok(mut r) = reading.lock() {
            *r = GuardReading {
                at: Instant::now(),
                queue_age_s: 10.0,
                ..GuardReading::from_statuses(&[])
            };
        }
        tokio::time::sleep(Duration::from_millis(700)).await;
        if let Ok(mut r) = reading.lock() {
            *r = GuardReading::from_statuses(&[]);
        }
        // Clear long enough to borrow back to full speed.
        tokio::time::sleep(Duration::from_millis(1_300)).await;
    }
    backfill::steer(&lake, &spec.name, &namespace, "abort")
        .await
        .ok();
    let _ = running.await;
    let mut samples = metrics
        .reclaim_samples
        .lock()
        .map(|s| s.clone())
        .unwrap_or_default();
    samples.sort_by(f64::total_cmp);
    anyhow::ensure!(!samples.is_empty(), "no reclaim was measured");
    let q = |p: f64| samples[((samples.len() - 1) as f64 * p).round() as usize] * 1000.0;
    let rendered = metrics.render();
    let reclaims: f64 = rendered
        .lines()
        .filter(|l| {
            l.starts_with("signalweave_backfill_decisions_total")
                && l.contains("action=\"reclaim\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    println!(
        "{reclaims} reclaim decisions, {} latencies measured",
        samples.len()
    );
    println!(
        "reclaim latency (guard crossed -> backfill at its floor of {floor} records/s, from {ceiling}), {} crossings: \
         p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; target p99 <= 1000 ms",
        samples.len(),
        q(0.5),
        q(0.99),
        q(1.0)
    );
    Ok(())
}
