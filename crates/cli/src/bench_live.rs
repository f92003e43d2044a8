//! `signalweave bench live | recovery | freshness`: the live job's benchmarks.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use signalweave_fixtures::WorkloadSpec;
use signalweave_lake::{CommitIdentity, Lake, LakeConfig, LakeTable};
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
