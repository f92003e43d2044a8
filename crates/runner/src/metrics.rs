//! The runner's Prometheus metrics, labelled by job and namespace, and the per-job status
//! that `signalweave status` and the demo's live view print.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};

/// Label set: `job`, `namespace`, and a third label where a metric has one.
pub type Labels = Vec<(String, String)>;

type HistogramFamily = Family<Labels, Histogram, fn() -> Histogram>;

fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 16))
}

/// Every metric of every job in the process.
#[derive(Debug)]
pub struct RunnerMetrics {
    registry: Registry,
    /// Snapshots of the source after the job's position.
    pub lag_snapshots: Family<Labels, Gauge>,
    /// Data files those snapshots added.
    pub lag_files: Family<Labels, Gauge>,
    /// Records not yet processed.
    pub lag_records: Family<Labels, Gauge>,
    /// Bytes not yet processed.
    pub lag_bytes: Family<Labels, Gauge>,
    /// Age of the oldest unprocessed source commit, seconds.
    pub oldest_unprocessed_age_seconds: Family<Labels, Gauge<f64, AtomicU64>>,
    /// Processing time minus the largest event time processed, seconds.
    pub event_time_age_seconds: Family<Labels, Gauge<f64, AtomicU64>>,
    /// Processing time minus each input's watermark contribution, seconds (label `input`).
    pub watermark_delay_seconds: Family<Labels, Gauge<f64, AtomicU64>>,
    /// Seconds per checkpoint (state blob, sink commits, pointer).
    pub checkpoint_seconds: HistogramFamily,
    /// Seconds processed work has waited for a checkpoint (0 when idle and checkpointed).
    pub checkpoint_age_seconds: Family<Labels, Gauge<f64, AtomicU64>>,
    /// Size of the last checkpoint blob, bytes.
    pub checkpoint_bytes: Family<Labels, Gauge>,
    /// Checkpoints completed.
    pub checkpoints: Family<Labels, Counter>,
    /// Failed steps or checkpoints (the job restarts from its last checkpoint).
    pub failures: Family<Labels, Counter>,
    /// 1 while the job is stalled on a failure.
    pub stalled: Family<Labels, Gauge>,
    /// 1 once the job has failed for good (another instance took its lease).
    pub failed: Family<Labels, Gauge>,
    /// Seconds per sink commit (outputs and late records of one epoch).
    pub sink_commit_seconds: HistogramFamily,
    /// Per-event freshness by stage, seconds (label `stage`).
    pub freshness_seconds: HistogramFamily,
    /// Records read, by outcome (label `outcome`: counted, filtered, duplicate, late).
    pub records: Family<Labels, Counter>,
    /// Output versions committed.
    pub outputs: Family<Labels, Counter>,
    /// Keys in the window state.
    pub state_keys: Family<Labels, Gauge>,
    /// Bytes of window and dedup state (estimate).
    pub state_bytes: Family<Labels, Gauge>,
    /// Snapshots the last maintenance pass of a table kept only because of holds (label
    /// `table`).
    pub lake_held_snapshots: Family<Labels, Gauge>,
    /// Seconds since each hold last moved (labels `table`, `holder`): a hold that stops
    /// moving belongs to a stopped or retired holder, and keeps every later snapshot.
    pub lake_hold_age_seconds: Family<Labels, Gauge<f64, AtomicU64>>,
}

impl Default for RunnerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl RunnerMetrics {
    /// Registers every metric under the `signalweave_job` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("signalweave_job");
        let hist = || HistogramFamily::new_with_constructor(seconds_histogram as fn() -> Histogram);
        let m = Self {
            lag_snapshots: Family::default(),
            lag_files: Family::default(),
            lag_records: Family::default(),
            lag_bytes: Family::default(),
            oldest_unprocessed_age_seconds: Family::default(),
            event_time_age_seconds: Family::default(),
            watermark_delay_seconds: Family::default(),
            checkpoint_seconds: hist(),
            checkpoint_age_seconds: Family::default(),
            checkpoint_bytes: Family::default(),
            checkpoints: Family::default(),
            failures: Family::default(),
            stalled: Family::default(),
            failed: Family::default(),
            sink_commit_seconds: hist(),
            freshness_seconds: hist(),
            records: Family::default(),
            outputs: Family::default(),
            state_keys: Family::default(),
            state_bytes: Family::default(),
            lake_held_snapshots: Family::default(),
            lake_hold_age_seconds: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "lag_snapshots",
            "Source snapshots after the job's position",
            m.lag_snapshots.clone(),
        );
        registry.register(
            "lag_files",
            "Data files not yet processed",
            m.lag_files.clone(),
        );
        registry.register(
            "lag_records",
            "Records not yet processed",
            m.lag_records.clone(),
        );
        registry.register("lag_bytes", "Bytes not yet processed", m.lag_bytes.clone());
        registry.register(
            "oldest_unprocessed_age_seconds",
            "Age of the oldest unprocessed source commit",
            m.oldest_unprocessed_age_seconds.clone(),
        );
        registry.register(
            "event_time_age_seconds",
            "Processing time minus the largest event time processed",
            m.event_time_age_seconds.clone(),
        );
        registry.register(
            "watermark_delay_seconds",
            "Processing time minus the watermark, per input",
            m.watermark_delay_seconds.clone(),
        );
        registry.register(
            "checkpoint_seconds",
            "Seconds per checkpoint",
            m.checkpoint_seconds.clone(),
        );
        registry.register(
            "checkpoint_age_seconds",
            "Seconds processed work has waited for a checkpoint",
            m.checkpoint_age_seconds.clone(),
        );
        registry.register(
            "checkpoint_bytes",
            "Size of the last checkpoint blob",
            m.checkpoint_bytes.clone(),
        );
        registry.register(
            "checkpoints",
            "Checkpoints completed",
            m.checkpoints.clone(),
        );
        registry.register(
            "failures",
            "Failed steps or checkpoints",
            m.failures.clone(),
        );
        registry.register(
            "stalled",
            "1 while the job is stalled on a failure",
            m.stalled.clone(),
        );
        registry.register(
            "failed",
            "1 once the job has failed for good (another instance took its lease)",
            m.failed.clone(),
        );
        registry.register(
            "sink_commit_seconds",
            "Seconds per sink commit",
            m.sink_commit_seconds.clone(),
        );
        registry.register(
            "freshness_seconds",
            "Per-event freshness by stage",
            m.freshness_seconds.clone(),
        );
        registry.register("records", "Records read, by outcome", m.records.clone());
        registry.register("outputs", "Output versions committed", m.outputs.clone());
        registry.register(
            "state_keys",
            "Keys in the window state",
            m.state_keys.clone(),
        );
        registry.register(
            "state_bytes",
            "Bytes of window and dedup state",
            m.state_bytes.clone(),
        );
        registry.register(
            "lake_held_snapshots",
            "Snapshots the last maintenance pass of a table kept only because of holds",
            m.lake_held_snapshots.clone(),
        );
        registry.register(
            "lake_hold_age_seconds",
            "Seconds since each snapshot hold last moved",
            m.lake_hold_age_seconds.clone(),
        );
        Self { registry, ..m }
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        render(&self.registry)
    }

    /// Sets the hold ages to `holds` at `now_ms` (ms since the epoch); released holds
    /// drop out.
    pub fn record_holds(&self, holds: &[signalweave_lake::SnapshotHold], now_ms: i64) {
        self.lake_hold_age_seconds.clear();
        for h in holds {
            let labels = vec![
                ("table".to_string(), h.table.clone()),
                ("holder".to_string(), h.holder.clone()),
            ];
            self.lake_hold_age_seconds
                .get_or_create(&labels)
                .set((now_ms - h.updated_ms).max(0) as f64 / 1000.0);
        }
    }
}

/// The metrics of the backfills in this process (prefix `signalweave_backfill`), labelled
/// by job and namespace.
#[derive(Debug)]
pub struct BackfillMetrics {
    registry: Registry,
    /// Records read: the work done, so a session job's sub-range read again from
    /// further back counts again (its progress counts it once).
    pub records: Family<Labels, Counter>,
    /// Bytes of data files read.
    pub bytes_read: Family<Labels, Counter>,
    /// Output rows written.
    pub rows_written: Family<Labels, Counter>,
    /// Sub-ranges completed.
    pub subranges_done: Family<Labels, Counter>,
    /// Seconds of sub-ranges' time by stage (label `stage`: `read`, `engine`,
    /// `throttled`, `commit`), summed over the sub-ranges that ran at once.
    pub stage_seconds: Family<Labels, Counter<f64, AtomicU64>>,
    /// Records per second in force (-1: unlimited; 0: paused).
    pub rate_limit: Family<Labels, Gauge>,
    /// Controller decisions (label `action`: reclaim, borrow, full).
    pub decisions: Family<Labels, Counter>,
    /// The live job's guard values as last read, seconds (label `guard`).
    pub guard_seconds: Family<Labels, Gauge<f64, AtomicU64>>,
    /// Reclaim latency: guard crossed to the backfill at its floor, seconds.
    pub reclaim_seconds: HistogramFamily,
    /// Every reclaim latency observed, seconds (for percentiles beyond the buckets).
    pub reclaim_samples: Mutex<Vec<f64>>,
}

impl Default for BackfillMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl BackfillMetrics {
    /// Registers every metric under the `signalweave_backfill` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("signalweave_backfill");
        let m = Self {
            records: Family::default(),
            bytes_read: Family::default(),
            rows_written: Family::default(),
            subranges_done: Family::default(),
            stage_seconds: Family::default(),
            rate_limit: Family::default(),
            decisions: Family::default(),
            guard_seconds: Family::default(),
            reclaim_seconds: HistogramFamily::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.001, 2.0, 14))
            }),
            reclaim_samples: Mutex::new(Vec::new()),
            registry: Registry::default(),
        };
        registry.register(
            "records",
            "Records read, each read again counted again",
            m.records.clone(),
        );
        registry.register(
            "read_bytes",
            "Bytes of data files read",
            m.bytes_read.clone(),
        );
        registry.register(
            "rows_written",
            "Output rows written",
            m.rows_written.clone(),
        );
        registry.register(
            "subranges_done",
            "Sub-ranges completed",
            m.subranges_done.clone(),
        );
        registry.register(
            "stage_seconds",
            "Sub-ranges' seconds by stage: reading and decoding files, the engine, waiting for \
             budget tokens or while paused, committing (summed over sub-ranges run at once)",
            m.stage_seconds.clone(),
        );
        registry.register(
            "rate_limit_records_per_second",
            "Records per second in force (-1 unlimited, 0 paused)",
            m.rate_limit.clone(),
        );
        registry.register(
            "decisions",
            "Live-priority controller decisions, by action",
            m.decisions.clone(),
        );
        registry.register(
            "live_guard_seconds",
            "The live job's guard values as last read",
            m.guard_seconds.clone(),
        );
        registry.register(
            "reclaim_seconds",
            "Guard crossed to the backfill at its floor",
            m.reclaim_seconds.clone(),
        );
        Self { registry, ..m }
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        render(&self.registry)
    }
}

fn render(registry: &Registry) -> String {
    let mut out = String::new();
    if encode(&mut out, registry).is_err() {
        out.clear();
    }
    out
}

/// A job's status for people: `signalweave status`, the demo's live view, `/v1/status`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct JobStatus {
    /// Job name.
    pub job: String,
    /// Output namespace.
    pub namespace: String,
    /// `starting`, `running`, `stalled` or `stopped`.
    pub state: String,
    /// The failure the job is stalled on.
    pub last_error: Option<String>,
    /// Last committed epoch.
    pub epoch: u64,
    /// Last processed source snapshot.
    pub position: Option<i64>,
    /// Watermark, µs.
    pub watermark_us: Option<i64>,
    /// Source snapshots not yet processed.
    pub lag_snapshots: u64,
    /// Data files not yet processed.
    pub lag_files: u64,
    /// Records not yet processed.
    pub lag_records: u64,
    /// Age of the oldest unprocessed source commit, seconds.
    pub oldest_unprocessed_age_s: f64,
    /// Processing time minus the largest event time processed, seconds.
    pub event_time_age_s: f64,
    /// Processing time minus the watermark, seconds.
    pub watermark_delay_s: f64,
    /// Seconds since the last checkpoint.
    pub checkpoint_age_s: f64,
    /// Seconds of the last sink commit that wrote something.
    #[serde(default)]
    pub sink_commit_s: f64,
    /// Last checkpoint blob, bytes.
    pub checkpoint_bytes: u64,
    /// Records read since start.
    pub records: u64,
    /// Records counted into windows since start.
    pub counted: u64,
    /// Duplicates since start.
    pub duplicates: u64,
    /// Late records since start.
    pub late: u64,
    /// Output versions committed since start.
    pub outputs: u64,
    /// Keys in state.
    pub state_keys: u64,
    /// State bytes (estimate).
    pub state_bytes: u64,
    /// End-to-end freshness (event time to visible output) p50 / p99 / p99.9, seconds,
    /// over the samples since start.
    pub freshness_s: [f64; 3],
    /// Freshness samples so far.
    pub freshness_samples: u64,
}

/// A job's status, shared between the job and whoever reports it.
pub type SharedStatus = Arc<Mutex<JobStatus>>;
