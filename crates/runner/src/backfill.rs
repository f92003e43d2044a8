//! Backfills: a job spec run over an event-time range of `signalweave.events`, as its own
//! job identity, into the output table of its own namespace.
//!
//! # Plan
//!
//! `start` pins the landing table's current snapshot (held against expiry until the
//! backfill ends), so every sub-range reads the same input (unless an erasure moves it:
//! see "Erasures"), and cuts `[from, to)` into
//! sub-ranges: time slices (a day by default, aligned to multiples of the slice) ×
//! key-group ranges. Everything lives in the catalog database: `sw_backfills` (one row per
//! job and namespace: range, version, budgets, state, the steering wish, the runner's
//! lease, preemptions) and `sw_backfill_ranges` (one row per sub-range: state and figures).
//!
//! # One sub-range
//!
//! A sub-range `[a, b)` owns the windows whose end is in `(a, b]`, and, when `b` is the
//! range's end, the windows crossing it, marked `partial` (they count only the events
//! before `to`; never silently truncated). So are the windows the input's watermark (the
//! largest event time of the snapshot read, minus the out-of-orderness bound) has not
//! passed: records may still come for them. It reads the events of its key groups from
//! `a − lead-in` to `b`: the lead-in (one window span; the allowed lateness for sessions)
//! makes the first windows complete. A session may have begun before any lead-in, so a
//! session job reads a sub-range again from further back while one of its sessions starts
//! within a gap of where its reading began (see `Running::process`).
//!
//! Records are fed file by file, in order of arrival, to a fresh engine that judges each
//! record's lateness by the watermark the live job had when the record arrived
//! ([`EngineConfig::watermark_column`], from [`Lake::file_statistics`]: the largest event
//! time of the files committed before its `ingest_time`, minus the out-of-orderness
//! bound). A record is beyond allowed lateness when that watermark had passed its last
//! window's end plus the allowed lateness, as it was for the live job; of two copies of
//! one dedup identity, the first to arrive counts, as it did for the live job. The
//! engine's watermark does not move until the end of the sub-range, where every window
//! fires once, so the outputs do not depend on batch sizes. Each window
//! gets one version (`on_time`, or `partial`) whose `watermark` is the sub-range's end.
//!
//! # Copies
//!
//! A sub-range sees only its own records, and the live job counted the first copy of an
//! identity to arrive, wherever its event time (or key) was. Copies that share their event
//! time and key (a retried send) fall in one sub-range, so they are judged as the live job
//! judged them. Copies stamped with other event times may not: with `exact_dedup`, each
//! sub-range also reads the records that may be such an earlier copy, and the engine judges
//! them for dedup only ([`EngineConfig::dedup_only_column`]): the records of the files
//! that arrived before its last file, from the dedup horizon below the first watermark its
//! files arrived at (an identity held for less cannot be a copy of its records), and its
//! records of other key groups. That is up to a dedup horizon of reading on each side of a
//! sub-range (about twice the time with 6-hour slices over 50M events, 10-20% more with
//! 1-day slices), so it is asked for, not the default. A sub-range fails on a file
//! without ingest-time bounds (another writer's), which it could neither place in arrival
//! order nor rule out. Two limits remain:
//! - a copy read at the low end of that reach is judged without the copies before it, so a
//!   third copy of one event, more than a horizon earlier still, that made it a duplicate
//!   for the live job is missed;
//! - files are read whole, in order of their first arrival; where two files' ingest times
//!   interleave (concurrent gateways), copies across them are judged in that file order.
//!
//! A sub-range completes atomically: its outputs are one append to the namespace's output
//! table and its late records one append to `late_events`, each carrying the commit
//! identity `(backfill writer, sub-range)`, and then its row is marked done. A backfill
//! killed at any point resumes at the first sub-range not marked done; commits of that
//! sub-range that exist are recognised by their identity and skipped, so no version is
//! written twice.
//!
//! # Erasures
//!
//! `lake erase` rewrites the landing table without its subject, records itself in
//! `sw_erasures`, and at its end expires every snapshot before its rewrite, whatever holds
//! it. A backfill pinned before an erasure would read deleted files, or until the expiry
//! the erased events. So before each sub-range, and when it resumes, a backfill judges the
//! erasures it has not judged yet against its snapshot (`judge`): by whether the snapshot
//! is still there, and by sequence numbers for an erasure not complete. One its snapshot
//! predates moves it to that erasure's rewrite (the newest such), or to the current
//! snapshot when the rewrite is not known; the new snapshot is held and recorded in
//! the old one's place. Erasures are judged by snapshots, never by the hosts' clocks.
//!
//! A sub-range read from the older snapshot leaves the erased customer's windows out of
//! its commit, as a live job does ([`ErasedWindows`]); one whose reading failed after its
//! snapshot moved is read again from the new one. What such a sub-range adds to an
//! aggregate not keyed by customer still counts the erased events: a backfill of the range
//! after the erasure recomputes it. A snapshot gone for another reason (its hold released
//! by hand) moves the backfill to the current snapshot too, with a warning, rather than
//! fail every resume.
//!
//! # Budgets and live priority
//!
//! Records, bytes read and rows written pass token buckets ([`crate::budget`]); the
//! controller reads the live job's guards and cuts the records budget to its floor when
//! one crosses, then borrows back gradually.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arrow::array::{Array, BooleanArray, RecordBatch};
use futures::TryStreamExt;
use futures::future::BoxFuture;
use prometheus_client::metrics::counter::Counter;
use serde::{Deserialize, Serialize};
use signalweave_lake::{
    ArrivalWatermarks, CommitIdentity, ErasureNotice, FileSpans, Lake, LakeTable,
    TRANSIENT_HOLD_MARKER,
};
use signalweave_model::ErrorKind;
use signalweave_window::{
    Completeness, Emissions, EngineConfig, JobSpec, WindowEngine, WindowSpec,
};
use sqlx::Row;

use crate::budget::{Budgets, Controller, GuardReading, Guards, Operator, Throttle};
use crate::erased::ErasedWindows;
use crate::error::{Result, RunnerError};
use crate::late::{self, LateEvent};
use crate::live::{SUMMARY_JOB, SUMMARY_NAMESPACE, backfill_output_table};
use crate::metrics::{BackfillMetrics, Labels, SharedStatus};

/// Snapshot summary key: the sub-range of a backfill's sink commit.
pub const SUMMARY_SUBRANGE: &str = "signalweave.backfill-subrange";
/// The landing table's arrival column, by which a backfill judges lateness.
pub const ARRIVAL_COLUMN: &str = "ingest_time";
/// The column a backfill adds to each batch: the live watermark at the record's arrival.
const ROW_WATERMARK: &str = "sw_arrival_watermark";
/// The column marking records read only as possible earlier copies of the sub-range's
/// records ([`EngineConfig::dedup_only_column`]).
const DEDUP_ONLY: &str = "sw_dedup_only";
/// The processing time a backfill's engine runs at: early triggers never fire.
const BACKFILL_PROC_TIME: i64 = 0;

/// What `backfill start` asks for.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BackfillRequest {
    /// Job name.
    pub job: String,
    /// Job version whose spec runs.
    pub job_version: u32,
    /// Output namespace (`[a-z0-9_]`, not `live`).
    pub namespace: String,
    /// Event-time range start, µs (inclusive).
    pub from_us: i64,
    /// Event-time range end, µs (exclusive).
    pub to_us: i64,
    /// Length of a time slice.
    pub slice: Duration,
    /// Key-group ranges per slice.
    pub key_group_splits: u16,
    /// Also read, around each sub-range, the records that may be earlier copies of its
    /// records under other event times or keys (see "Copies" in the module docs).
    pub exact_dedup: bool,
    /// Token budgets.
    pub budgets: Budgets,
    /// Who started it.
    pub created_by: String,
}

/// A backfill as recorded in `sw_backfills`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BackfillRecord {
    /// Job name.
    pub job: String,
    /// Namespace.
    pub namespace: String,
    /// Job version.
    pub job_version: u32,
    /// Range start, µs.
    pub from_us: i64,
    /// Range end, µs.
    pub to_us: i64,
    /// Events read before each sub-range, µs.
    pub lead_in_us: i64,
    /// The pinned landing-table snapshot (None: the table was empty).
    pub snapshot_id: Option<i64>,
    /// The sequence number of the snapshot it was planned on: no sub-range read a record
    /// committed after it, but one moved to a newer snapshot by an erasure (a move keeps
    /// it). None: the table was empty, or a version that did not record it.
    pub snapshot_seq: Option<i64>,
    /// `pending`, `running`, `paused`, `completed`, `aborted` or `failed`.
    pub state: String,
    /// What the operator asked for: `run`, `pause` or `abort`.
    pub desired: String,
    /// Budgets.
    pub budgets: Budgets,
    /// Whether each sub-range reads the earlier copies of its records around it.
    pub exact_dedup: bool,
    /// Who started it.
    pub created_by: String,
    /// When, ms since the epoch.
    pub created_ms: i64,
    /// Last change, ms since the epoch.
    pub updated_ms: i64,
    /// The process running it, if any.
    pub runner: Option<String>,
    /// The runner's last heartbeat, ms since the epoch.
    pub heartbeat_ms: Option<i64>,
    /// Times live traffic took capacity back.
    pub preemptions: u64,
    /// The controller's last decision and its cause.
    pub last_decision: Option<String>,
    /// Records per second in force (None: unlimited).
    pub rate_limit: Option<u32>,
    /// The failure that stopped it.
    pub last_error: Option<String>,
}

impl BackfillRecord {
    /// True in a final state.
    pub fn finished(&self) -> bool {
        matches!(self.state.as_str(), "completed" | "aborted")
    }

    /// The output table of its namespace (`<output>__bf_<namespace>`).
    pub fn output_table(&self, spec: &JobSpec) -> Result<LakeTable> {
        backfill_output_table(spec, &self.namespace)
    }

    fn holder(&self) -> String {
        format!("backfill:{}:{}", self.job, self.namespace)
    }
}

/// A sub-range as recorded in `sw_backfill_ranges`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SubRange {
    /// Order of processing (0, 1, ...).
    pub seq: u32,
    /// Slice start, µs.
    pub from_us: i64,
    /// Slice end, µs.
    pub to_us: i64,
    /// First key group.
    pub kg_lo: u16,
    /// Key group after the last.
    pub kg_hi: u16,
    /// Records the sub-range is expected to read: its files' records in its time range
    /// (lead-in included), each file's taken as spread evenly over its event-time span.
    pub planned_records: u64,
    /// `pending` or `done`.
    pub state: String,
    /// Records read.
    pub records: u64,
    /// Bytes of data files read.
    pub bytes_read: u64,
    /// Output rows written.
    pub rows_written: u64,
    /// Records beyond allowed lateness.
    pub late: u64,
    /// Duplicates.
    pub duplicates: u64,
    /// Seconds from its start to its commit: reading, processing and waiting for budgets.
    pub seconds: f64,
    /// Where its time went, once done (none from a version that did not record it).
    pub stages: Option<StageSeconds>,
    /// When done, ms since the epoch.
    pub finished_ms: Option<i64>,
    /// When done, the input's watermark of the snapshot it read (µs): a window ending after
    /// it was written `partial` (none from a version that did not record it).
    pub input_watermark_us: Option<i64>,
}

/// A done sub-range's time by stage, seconds: reading and decoding its files, the engine,
/// waiting for budget tokens or while paused, and committing its outputs and late records.
/// Its processing `seconds` hold the first three and the backfill's own work on batches;
/// the commit comes after them, and so does the wait for the rows budget. Recording the
/// sub-range done in the catalog database, after the commit, is in no stage.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StageSeconds {
    /// Reading and decoding files.
    pub read: f64,
    /// The engine.
    pub engine: f64,
    /// Waiting for budget tokens, or while paused.
    pub throttled: f64,
    /// Committing outputs and late records.
    pub commit: f64,
}

/// The columns of `sw_backfill_ranges` that hold [`StageSeconds`], in ms, in its order.
const STAGE_COLUMNS: [&str; 4] = ["read_ms", "engine_ms", "throttled_ms", "commit_ms"];

/// A value bound into an update.
enum Value {
    Int(Option<i64>),
    Text(Option<String>),
}

impl Value {
    fn text(s: &str) -> Self {
        Value::Text(Some(s.to_string()))
    }
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// The control tables of backfills.
#[derive(Debug, Clone)]
pub struct BackfillStore {
    lake: Lake,
}

const RECORD_COLUMNS: &str = "job, namespace, job_version, from_us, to_us, lead_in_us, \
     snapshot_id, state, desired, budgets, created_by, created_ms, updated_ms, runner, heartbeat_ms, \
     preemptions, last_decision, rate_limit, last_error, exact_dedup, snapshot_seq";

impl BackfillStore {
    /// Opens the store, creating its tables where missing.
    pub async fn open(lake: Lake) -> Result<Self> {
        let store = Self { lake };
        for ddl in [
            "CREATE TABLE IF NOT EXISTS sw_backfills (catalog_name VARCHAR(255) NOT NULL, \
             job VARCHAR(255) NOT NULL, namespace VARCHAR(255) NOT NULL, job_version BIGINT NOT NULL, \
             from_us BIGINT NOT NULL, to_us BIGINT NOT NULL, lead_in_us BIGINT NOT NULL, \
             snapshot_id BIGINT, state VARCHAR(32) NOT NULL, desired VARCHAR(32) NOT NULL, \
             budgets VARCHAR(1000) NOT NULL, created_by VARCHAR(255) NOT NULL, \
             created_ms BIGINT NOT NULL, updated_ms BIGINT NOT NULL, runner VARCHAR(255), \
             heartbeat_ms BIGINT, preemptions BIGINT NOT NULL, last_decision VARCHAR(1000), \
             rate_limit BIGINT, last_error VARCHAR(2000), exact_dedup BIGINT, \
             PRIMARY KEY (catalog_name, job, namespace))",
            "CREATE TABLE IF NOT EXISTS sw_backfill_ranges (catalog_name VARCHAR(255) NOT NULL, \
             job VARCHAR(255) NOT NULL, namespace VARCHAR(255) NOT NULL, seq BIGINT NOT NULL, \
             from_us BIGINT NOT NULL, to_us BIGINT NOT NULL, kg_lo BIGINT NOT NULL, kg_hi BIGINT NOT NULL, \
             planned_records BIGINT NOT NULL, state VARCHAR(32) NOT NULL, records BIGINT NOT NULL, \
             bytes_read BIGINT NOT NULL, rows_written BIGINT NOT NULL, late BIGINT NOT NULL, \
             duplicates BIGINT NOT NULL, millis BIGINT NOT NULL, finished_ms BIGINT, \
             read_ms BIGINT, engine_ms BIGINT, throttled_ms BIGINT, commit_ms BIGINT, \
             PRIMARY KEY (catalog_name, job, namespace, seq))",
        ] {
            sqlx::query(ddl)
                .execute(store.lake.control_pool())
                .await
                .map_err(|e| RunnerError::sql("create backfill tables", e))?;
        }
        // Added after the tables' first release: a database from before gets them (null:
        // off, and not recorded).
        store.add_column("sw_backfills", "exact_dedup").await?;
        store.add_column("sw_backfills", "snapshot_seq").await?;
        for column in STAGE_COLUMNS {
            store.add_column("sw_backfill_ranges", column).await?;
        }
        store
            .add_column("sw_backfill_ranges", "input_watermark_us")
            .await?;
        Ok(store)
    }

    /// Adds the nullable BIGINT `column` to `table` unless it has it. Another process may
    /// add it meanwhile, so a failed add is checked again.
    async fn add_column(&self, table: &str, column: &str) -> Result<()> {
        let has_column = || async {
            sqlx::query(&format!("SELECT {column} FROM {table} WHERE 1 = 0"))
                .execute(self.lake.control_pool())
                .await
                .is_ok()
        };
        if !has_column().await {
            let added = sqlx::query(&format!("ALTER TABLE {table} ADD COLUMN {column} BIGINT"))
                .execute(self.lake.control_pool())
                .await;
            if let Err(e) = added
                && !has_column().await
            {
                return Err(RunnerError::sql(&format!("add {table}.{column}"), e));
            }
        }
        Ok(())
    }

    fn q(&self, sql: &str) -> String {
        self.lake.control_sql(sql)
    }

    fn catalog(&self) -> &str {
        self.lake.config().catalog_name.as_str()
    }

    fn record(row: &sqlx::any::AnyRow) -> std::result::Result<BackfillRecord, sqlx::Error> {
        let budgets: String = row.try_get("budgets")?;
        Ok(BackfillRecord {
            job: row.try_get("job")?,
            namespace: row.try_get("namespace")?,
            job_version: u32::try_from(row.try_get::<i64, _>("job_version")?).unwrap_or(0),
            from_us: row.try_get("from_us")?,
            to_us: row.try_get("to_us")?,
            lead_in_us: row.try_get("lead_in_us")?,
            snapshot_id: row.try_get("snapshot_id")?,
            snapshot_seq: row.try_get("snapshot_seq")?,
            state: row.try_get("state")?,
            desired: row.try_get("desired")?,
            budgets: serde_json::from_str(&budgets).unwrap_or_default(),
            exact_dedup: row.try_get::<Option<i64>, _>("exact_dedup")?.unwrap_or(0) != 0,
            created_by: row.try_get("created_by")?,
            created_ms: row.try_get("created_ms")?,
            updated_ms: row.try_get("updated_ms")?,
            runner: row.try_get("runner")?,
            heartbeat_ms: row.try_get("heartbeat_ms")?,
            preemptions: u64::try_from(row.try_get::<i64, _>("preemptions")?).unwrap_or(0),
            last_decision: row.try_get("last_decision")?,
            rate_limit: row
                .try_get::<Option<i64>, _>("rate_limit")?
                .and_then(|r| u32::try_from(r).ok()),
            last_error: row.try_get("last_error")?,
        })
    }

    /// The backfill of `job` in `namespace`.
    pub async fn get(&self, job: &str, namespace: &str) -> Result<Option<BackfillRecord>> {
        let sql = self.q(&format!(
            "SELECT {RECORD_COLUMNS} FROM sw_backfills WHERE catalog_name = $1 AND job = $2 AND namespace = $3"
        ));
        let row = sqlx::query(&sql)
            .bind(self.catalog())
            .bind(job)
            .bind(namespace)
            .fetch_optional(self.lake.control_pool())
            .await
            .map_err(|e| RunnerError::sql("read a backfill", e))?;
        row.as_ref()
            .map(Self::record)
            .transpose()
            .map_err(|e| RunnerError::sql("read a backfill", e))
    }

    /// The backfill of `job` in `namespace`, or `NotFound`.
    pub async fn require(&self, job: &str, namespace: &str) -> Result<BackfillRecord> {
        self.get(job, namespace).await?.ok_or_else(|| {
            RunnerError::new(
                ErrorKind::NotFound,
                format!("no backfill of {job} in namespace `{namespace}`"),
            )
        })
    }

    /// Every backfill, newest first.
    pub async fn list(&self) -> Result<Vec<BackfillRecord>> {
        let sql = self.q(&format!(
            "SELECT {RECORD_COLUMNS} FROM sw_backfills WHERE catalog_name = $1 ORDER BY created_ms DESC"
        ));
        let rows = sqlx::query(&sql)
            .bind(self.catalog())
            .fetch_all(self.lake.control_pool())
            .await
            .map_err(|e| RunnerError::sql("list backfills", e))?;
        rows.iter()
            .map(Self::record)
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| RunnerError::sql("list backfills", e))
    }

    /// The sub-ranges of a backfill, in order.
    pub async fn subranges(&self, job: &str, namespace: &str) -> Result<Vec<SubRange>> {
        let sql = self.q(
            "SELECT seq, from_us, to_us, kg_lo, kg_hi, planned_records, state, records, bytes_read, \
             rows_written, late, duplicates, millis, finished_ms, read_ms, engine_ms, \
             throttled_ms, commit_ms, input_watermark_us FROM sw_backfill_ranges \
             WHERE catalog_name = $1 AND job = $2 AND namespace = $3 ORDER BY seq",
        );
        let rows = sqlx::query(&sql)
            .bind(self.catalog())
            .bind(job)
            .bind(namespace)
            .fetch_all(self.lake.control_pool())
            .await
            .map_err(|e| RunnerError::sql("read sub-ranges", e))?;
        let u = |r: &sqlx::any::AnyRow, c: &str| -> std::result::Result<u64, sqlx::Error> {
            Ok(u64::try_from(r.try_get::<i64, _>(c)?).unwrap_or(0))
        };
        rows.iter()
            .map(|r| {
                Ok(SubRange {
                    seq: u32::try_from(r.try_get::<i64, _>("seq")?).unwrap_or(0),
                    from_us: r.try_get("from_us")?,
                    to_us: r.try_get("to_us")?,
                    kg_lo: u16::try_from(r.try_get::<i64, _>("kg_lo")?).unwrap_or(0),
                    kg_hi: u16::try_from(r.try_get::<i64, _>("kg_hi")?).unwrap_or(0),
                    planned_records: u(r, "planned_records")?,
                    state: r.try_get("state")?,
                    records: u(r, "records")?,
                    bytes_read: u(r, "bytes_read")?,
                    rows_written: u(r, "rows_written")?,
                    late: u(r, "late")?,
                    duplicates: u(r, "duplicates")?,
                    seconds: u(r, "millis")? as f64 / 1000.0,
                    stages: {
                        let mut ms = [None; 4];
                        for (v, c) in ms.iter_mut().zip(STAGE_COLUMNS) {
                            *v = r.try_get::<Option<i64>, _>(c)?;
                        }
                        let s = |v: i64| v as f64 / 1000.0;
                        match ms {
                            [Some(read), Some(engine), Some(throttled), Some(commit)] => {
                                Some(StageSeconds {
                                    read: s(read),
                                    engine: s(engine),
                                    throttled: s(throttled),
                                    commit: s(commit),
                                })
                            }
                            _ => None,
                        }
                    },
                    finished_ms: r.try_get("finished_ms")?,
                    input_watermark_us: r.try_get("input_watermark_us")?,
                })
            })
            .collect::<std::result::Result<_, sqlx::Error>>()
            .map_err(|e| RunnerError::sql("read sub-ranges", e))
    }

    async fn insert(&self, record: &BackfillRecord, subranges: &[SubRange]) -> Result<()> {
        let mut tx = self
            .lake
            .control_pool()
            .begin()
            .await
            .map_err(|e| RunnerError::sql("begin", e))?;
        let sql = self.q(
            "INSERT INTO sw_backfills (catalog_name, job, namespace, job_version, from_us, to_us, \
             lead_in_us, snapshot_id, state, desired, budgets, created_by, created_ms, updated_ms, \
             preemptions, exact_dedup, snapshot_seq) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, 0, $15, $16)",
        );
        sqlx::query(&sql)
            .bind(self.catalog())
            .bind(&record.job)
            .bind(&record.namespace)
            .bind(i64::from(record.job_version))
            .bind(record.from_us)
            .bind(record.to_us)
            .bind(record.lead_in_us)
            .bind(record.snapshot_id)
            .bind(&record.state)
            .bind(&record.desired)
            .bind(serde_json::to_string(&record.budgets).unwrap_or_default())
            .bind(&record.created_by)
            .bind(record.created_ms)
            .bind(record.updated_ms)
            .bind(i64::from(record.exact_dedup))
            .bind(record.snapshot_seq)
            .execute(&mut *tx)
            .await
            .map_err(|e| match RunnerError::sql("record the backfill", e) {
                // Another start took the namespace since it was checked.
                e if e.kind() == ErrorKind::Conflict => RunnerError::new(
                    ErrorKind::Conflict,
                    format!(
                        "namespace `{}` of {} was just taken by another start: choose another namespace",
                        record.namespace, record.job
                    ),
                ),
                e => e,
            })?;
        let sql = self.q(
            "INSERT INTO sw_backfill_ranges (catalog_name, job, namespace, seq, from_us, to_us, \
             kg_lo, kg_hi, planned_records, state, records, bytes_read, rows_written, late, \
             duplicates, millis) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'pending', 0, 0, 0, 0, 0, 0)",
        );
        for s in subranges {
            sqlx::query(&sql)
                .bind(self.catalog())
                .bind(&record.job)
                .bind(&record.namespace)
                .bind(i64::from(s.seq))
                .bind(s.from_us)
                .bind(s.to_us)
                .bind(i64::from(s.kg_lo))
                .bind(i64::from(s.kg_hi))
                .bind(s.planned_records as i64)
                .execute(&mut *tx)
                .await
                .map_err(|e| RunnerError::sql("record a sub-range", e))?;
        }
        tx.commit()
            .await
            .map_err(|e| RunnerError::sql("record the backfill", e))
    }

    /// Records what the operator wants (`run`, `pause`, `abort`); the runner obeys within
    /// a second. Fails with `Conflict` on a finished backfill.
    pub async fn set_desired(&self, job: &str, namespace: &str, desired: &str) -> Result<()> {
        let record = self.require(job, namespace).await?;
        if record.finished() {
            return Err(RunnerError::new(
                ErrorKind::Conflict,
                format!(
                    "the backfill of {job} in `{namespace}` is {} already",
                    record.state
                ),
            ));
        }
        self.update(
            job,
            namespace,
            "desired = $4, updated_ms = $5",
            vec![Value::text(desired), Value::Int(Some(now_ms()))],
        )
        .await
    }

    async fn update(
        &self,
        job: &str,
        namespace: &str,
        set: &str,
        values: Vec<Value>,
    ) -> Result<()> {
        let sql = self.q(&format!(
            "UPDATE sw_backfills SET {set} WHERE catalog_name = $1 AND job = $2 AND namespace = $3"
        ));
        let mut query = sqlx::query(&sql)
            .bind(self.catalog())
            .bind(job)
            .bind(namespace);
        for v in values {
            query = match v {
                Value::Int(i) => query.bind(i),
                Value::Text(t) => query.bind(t),
            };
        }
        query
            .execute(self.lake.control_pool())
            .await
            .map_err(|e| RunnerError::sql("update a backfill", e))?;
        Ok(())
    }

    async fn set_state(
        &self,
        job: &str,
        namespace: &str,
        state: &str,
        error: Option<String>,
    ) -> Result<()> {
        self.update(
            job,
            namespace,
            "state = $4, last_error = $5, updated_ms = $6",
            vec![
                Value::text(state),
                Value::Text(error),
                Value::Int(Some(now_ms())),
            ],
        )
        .await
    }

    /// Records that the backfill now reads `snapshot_id` of the landing table.
    async fn set_snapshot(
        &self,
        job: &str,
        namespace: &str,
        snapshot_id: Option<i64>,
    ) -> Result<()> {
        self.update(
            job,
            namespace,
            "snapshot_id = $4, updated_ms = $5",
            vec![Value::Int(snapshot_id), Value::Int(Some(now_ms()))],
        )
        .await
    }

    /// Takes the runner lease: free, held by `runner`, or with a heartbeat older than
    /// `stale`. Returns false when another live runner holds it.
    async fn acquire(
        &self,
        job: &str,
        namespace: &str,
        runner: &str,
        stale: Duration,
    ) -> Result<bool> {
        let now = now_ms();
        let sql = self.q(
            "UPDATE sw_backfills SET runner = $4, heartbeat_ms = $5, updated_ms = $5 \
             WHERE catalog_name = $1 AND job = $2 AND namespace = $3 \
             AND (runner IS NULL OR runner = $4 OR heartbeat_ms < $6)",
        );
        let done = sqlx::query(&sql)
            .bind(self.catalog())
            .bind(job)
            .bind(namespace)
            .bind(runner)
            .bind(now)
            .bind(now - stale.as_millis() as i64)
            .execute(self.lake.control_pool())
            .await
            .map_err(|e| RunnerError::sql("take the backfill lease", e))?;
        Ok(done.rows_affected() == 1)
    }

    /// Renews the lease; returns the operator's wish, or None when the lease was lost.
    async fn heartbeat(&self, job: &str, namespace: &str, runner: &str) -> Result<Option<String>> {
        let sql = self.q(
            "UPDATE sw_backfills SET heartbeat_ms = $5 WHERE catalog_name = $1 AND job = $2 \
             AND namespace = $3 AND runner = $4",
        );
        let done = sqlx::query(&sql)
            .bind(self.catalog())
            .bind(job)
            .bind(namespace)
            .bind(runner)
            .bind(now_ms())
            .execute(self.lake.control_pool())
            .await
            .map_err(|e| RunnerError::sql("renew the backfill lease", e))?;
        if done.rows_affected() != 1 {
            return Ok(None);
        }
        Ok(Some(self.require(job, namespace).await?.desired))
    }

    async fn release(&self, job: &str, namespace: &str, runner: &str) -> Result<()> {
        let sql = self.q(
            "UPDATE sw_backfills SET runner = NULL, heartbeat_ms = NULL WHERE catalog_name = $1 \
             AND job = $2 AND namespace = $3 AND runner = $4",
        );
        sqlx::query(&sql)
            .bind(self.catalog())
            .bind(job)
            .bind(namespace)
            .bind(runner)
            .execute(self.lake.control_pool())
            .await
            .map_err(|e| RunnerError::sql("release the backfill lease", e))?;
        Ok(())
    }

    async fn record_decision(
        &self,
        job: &str,
        namespace: &str,
        preemption: bool,
        text: &str,
        rate: Option<u32>,
    ) -> Result<()> {
        self.update(
            job,
            namespace,
            "preemptions = preemptions + $4, last_decision = $5, rate_limit = $6, updated_ms = $7",
            vec![
                Value::Int(Some(i64::from(preemption))),
                Value::text(text),
                Value::Int(rate.map(i64::from)),
                Value::Int(Some(now_ms())),
            ],
        )
        .await
    }

    async fn subrange_done(&self, job: &str, namespace: &str, s: &SubRange) -> Result<()> {
        let sql = self.q(
            "UPDATE sw_backfill_ranges SET state = 'done', records = $5, bytes_read = $6, \
             rows_written = $7, late = $8, duplicates = $9, millis = $10, finished_ms = $11, \
             read_ms = $12, engine_ms = $13, throttled_ms = $14, commit_ms = $15, \
             input_watermark_us = $16 \
             WHERE catalog_name = $1 AND job = $2 AND namespace = $3 AND seq = $4",
        );
        let ms = |v: Option<f64>| v.map(|v| (v * 1000.0).round() as i64);
        let stages = s.stages;
        sqlx::query(&sql)
            .bind(self.catalog())
            .bind(job)
            .bind(namespace)
            .bind(i64::from(s.seq))
            .bind(s.records as i64)
            .bind(s.bytes_read as i64)
            .bind(s.rows_written as i64)
            .bind(s.late as i64)
            .bind(s.duplicates as i64)
            .bind((s.seconds * 1000.0) as i64)
            .bind(now_ms())
            .bind(ms(stages.map(|t| t.read)))
            .bind(ms(stages.map(|t| t.engine)))
            .bind(ms(stages.map(|t| t.throttled)))
            .bind(ms(stages.map(|t| t.commit)))
            .bind(s.input_watermark_us)
            .execute(self.lake.control_pool())
            .await
            .map_err(|e| RunnerError::sql("record a sub-range", e))?;
        Ok(())
    }
}

/// Checks a namespace name: 1 to 48 of `[a-z0-9_]`, starting with a letter, not `live`.
pub fn validate_namespace(namespace: &str) -> Result<()> {
    let ok = !namespace.is_empty()
        && namespace.len() <= 48
        && namespace.starts_with(|c: char| c.is_ascii_lowercase())
        && namespace
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !ok {
        return Err(RunnerError::new(
            ErrorKind::InvalidInput,
            format!(
                "namespace `{namespace}`: use 1 to 48 of a-z, 0-9 and _, starting with a letter"
            ),
        ));
    }
    if namespace == "live" {
        return Err(RunnerError::new(
            ErrorKind::InvalidInput,
            "`live` is the live job's namespace: a backfill writes into its own",
        ));
    }
    Ok(())
}

/// The most sub-ranges a backfill plans.
pub const MAX_SUBRANGES: u64 = 20_000;

/// How far before a sub-range a backfill reads so that its first windows are complete.
pub fn lead_in_us(spec: &JobSpec) -> i64 {
    match spec.window {
        WindowSpec::Session { .. } => spec
            .window
            .span_us()
            .max(signalweave_window::micros(spec.lateness.allowed)),
        _ => spec.window.span_us(),
    }
}

/// The time slices of `[from, to)`: boundaries at multiples of `slice`.
fn slices(from_us: i64, to_us: i64, slice_us: i64) -> Vec<(i64, i64)> {
    let mut out = Vec::new();
    let mut a = from_us;
    while a < to_us {
        let next = (a.div_euclid(slice_us) + 1).saturating_mul(slice_us);
        let b = next.min(to_us);
        out.push((a, b));
        a = b;
    }
    out
}

/// Records a new backfill: validates the request against `spec` (the job version's spec),
/// pins and holds the landing table's current snapshot, plans the sub-ranges, and creates
/// the namespace's output table. Fails with `Conflict` when the namespace has a backfill
/// of this job already (a namespace is written by one backfill).
pub async fn create(
    lake: &Lake,
    spec: &JobSpec,
    request: &BackfillRequest,
) -> Result<BackfillRecord> {
    validate_namespace(&request.namespace)?;
    if spec.name != request.job || spec.version != request.job_version {
        return Err(RunnerError::new(
            ErrorKind::Config,
            format!(
                "the spec is {} version {}, the request {} version {}",
                spec.name, spec.version, request.job, request.job_version
            ),
        ));
    }
    if request.from_us >= request.to_us {
        return Err(RunnerError::new(
            ErrorKind::InvalidInput,
            "--from must be before --to",
        ));
    }
    let slice_us = i64::try_from(request.slice.as_micros()).unwrap_or(i64::MAX);
    if slice_us < 60_000_000 {
        return Err(RunnerError::new(
            ErrorKind::InvalidInput,
            "a slice must be at least one minute",
        ));
    }
    let key_groups = signalweave_window::DEFAULT_KEY_GROUPS;
    if request.key_group_splits == 0 || request.key_group_splits > key_groups {
        return Err(RunnerError::new(
            ErrorKind::InvalidInput,
            format!("key-group splits must be 1 to {key_groups}"),
        ));
    }
    if let Some(0) = request.budgets.read_bytes_per_sec {
        return Err(RunnerError::new(
            ErrorKind::InvalidInput,
            "--read-bytes-per-sec must be positive (leave it out for no limit)",
        ));
    }
    if let Some(0) = request.budgets.write_rows_per_sec {
        return Err(RunnerError::new(
            ErrorKind::InvalidInput,
            "--write-rows-per-sec must be positive (leave it out for no limit)",
        ));
    }
    if let Some(0) = request.budgets.records_per_sec {
        return Err(RunnerError::new(
            ErrorKind::InvalidInput,
            "--records-per-sec must be positive (use --floor-records-per-sec 0 to pause under live load)",
        ));
    }
    if let Some(ceiling) = request.budgets.records_per_sec
        && request.budgets.floor_records_per_sec > ceiling
    {
        return Err(RunnerError::new(
            ErrorKind::InvalidInput,
            "the floor is above --records-per-sec",
        ));
    }
    let store = BackfillStore::open(lake.clone()).await?;
    if let Some(existing) = store.get(&request.job, &request.namespace).await? {
        return Err(RunnerError::new(
            ErrorKind::Conflict,
            format!(
                "namespace `{}` of {} belongs to the backfill started by {} (state {}): choose another namespace",
                existing.namespace, existing.job, existing.created_by, existing.state
            ),
        ));
    }
    // Each sub-range is a row read by every status and a commit of its own: a plan of
    // tens of thousands is a mistake (a tiny slice over a long range), not a backfill.
    let count = slices(request.from_us, request.to_us, slice_us).len() as u64
        * u64::from(request.key_group_splits);
    if count > MAX_SUBRANGES {
        return Err(RunnerError::new(
            ErrorKind::InvalidInput,
            format!(
                "the plan would have {count} sub-ranges, more than {MAX_SUBRANGES}: use a \
                 longer --slice or fewer --key-group-splits"
            ),
        ));
    }
    let output = backfill_output_table(spec, &request.namespace)?;
    lake.ensure_output_table(output).await?;
    let events = lake.table(LakeTable::Events).await?;
    let (snapshot_id, snapshot_seq) = events
        .metadata()
        .current_snapshot()
        .map(|s| (s.snapshot_id(), s.sequence_number()))
        .unzip();
    let lead_in = lead_in_us(spec);
    // Each sub-range's records are estimated from the files' event-time spans, as its
    // dedup set is sized: the files it reads counted whole would overstate it about
    // twofold (a file straddles slices), and so the ETA.
    let spans = match snapshot_id {
        Some(_) => Some(
            lake.file_statistics(
                LakeTable::Events,
                snapshot_id,
                &spec.time.event_time_column,
                ARRIVAL_COLUMN,
                signalweave_window::micros(spec.time.max_out_of_orderness),
                &[],
            )
            .await?
            .1,
        ),
        None => None,
    };
    let mut subranges = Vec::new();
    let splits = request.key_group_splits;
    for (a, b) in slices(request.from_us, request.to_us, slice_us) {
        let planned = match &spans {
            Some(spans) => {
                let tasks = lake
                    .plan_time_range(LakeTable::Events, a - lead_in, b, snapshot_id)
                    .await?
                    .tasks;
                spans.estimate_tasks(&tasks, a - lead_in, b)
            }
            None => 0,
        };
        for i in 0..splits {
            let lo = (u32::from(key_groups) * u32::from(i) / u32::from(splits)) as u16;
            let hi = (u32::from(key_groups) * (u32::from(i) + 1) / u32::from(splits)) as u16;
            subranges.push(SubRange {
                seq: subranges.len() as u32,
                from_us: a,
                to_us: b,
                kg_lo: lo,
                kg_hi: hi,
                // Every key-group split reads the slice's records, and keeps its own.
                planned_records: planned,
                state: "pending".into(),
                records: 0,
                bytes_read: 0,
                rows_written: 0,
                late: 0,
                duplicates: 0,
                seconds: 0.0,
                stages: None,
                finished_ms: None,
                input_watermark_us: None,
            });
        }
    }
    let now = now_ms();
    let record = BackfillRecord {
        job: request.job.clone(),
        namespace: request.namespace.clone(),
        job_version: request.job_version,
        from_us: request.from_us,
        to_us: request.to_us,
        lead_in_us: lead_in,
        snapshot_id,
        snapshot_seq,
        state: "pending".into(),
        desired: "run".into(),
        budgets: request.budgets,
        exact_dedup: request.exact_dedup,
        created_by: request.created_by.clone(),
        created_ms: now,
        updated_ms: now,
        runner: None,
        heartbeat_ms: None,
        preemptions: 0,
        last_decision: None,
        rate_limit: request.budgets.records_per_sec,
        last_error: None,
    };
    insert_pinned(lake, &store, &record, &subranges).await?;
    tracing::info!(job = %record.job, namespace = %record.namespace, version = record.job_version, subranges = subranges.len(), snapshot = ?snapshot_id, "backfill planned");
    Ok(record)
}

/// Records `record` with its sub-ranges, its pin held from before the record exists until
/// after. The pin is held first under a name of this call's own: two starts of one
/// namespace racing both get this far, and the one whose record is refused must not move
/// the hold of the one whose record stands (a hold under the namespace's name, moved to a
/// newer snapshot, would leave that backfill's pin unkept). Once the record stands, the
/// namespace's own hold takes over.
async fn insert_pinned(
    lake: &Lake,
    store: &BackfillStore,
    record: &BackfillRecord,
    subranges: &[SubRange],
) -> Result<()> {
    let Some(s) = record.snapshot_id else {
        return store.insert(record, subranges).await;
    };
    // Transient by its name: maintenance drops one a crash left behind (see
    // `TRANSIENT_HOLD_MARKER`).
    let planning = format!(
        "{}{TRANSIENT_HOLD_MARKER}{}",
        record.holder(),
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let release = |why: &'static str| {
        let planning = planning.clone();
        async move {
            if let Err(e) = lake.release_snapshot(LakeTable::Events, &planning).await {
                tracing::warn!(holder = %planning, error = %e, why, "could not release a planning hold");
            }
        }
    };
    if let Err(e) = lake
        .hold_present_snapshot(LakeTable::Events, &planning, s)
        .await
    {
        release("not held").await;
        return Err(e.into());
    }
    if let Err(e) = store.insert(record, subranges).await {
        release("not recorded").await;
        return Err(e);
    }
    // The record stands: the namespace's own hold takes over. Should that keep failing,
    // the planning hold stays (a leftover maintenance drops in time) and the backfill
    // stands all the same: failing now would leave a record its starter was told
    // nothing of.
    let mut held = Err(RunnerError::new(ErrorKind::Internal, "not tried"));
    for attempt in 0..3 {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(200 << attempt)).await;
        }
        held = lake
            .hold_snapshot(LakeTable::Events, &record.holder(), s)
            .await
            .map_err(RunnerError::from);
        if held.is_ok() {
            break;
        }
    }
    match held {
        Ok(()) => release("held by its namespace").await,
        Err(e) => {
            tracing::warn!(job = %record.job, namespace = %record.namespace, error = %e, holder = %planning, "the backfill's pin is held by its planning hold only")
        }
    }
    Ok(())
}

/// A probe of the live job's guards (None: its status could not be read).
pub type GuardProbe = Arc<dyn Fn() -> BoxFuture<'static, Option<GuardReading>> + Send + Sync>;

/// A probe that reads the statuses of live jobs in this process.
pub fn probe_statuses(statuses: Vec<SharedStatus>) -> GuardProbe {
    let statuses = Arc::new(statuses);
    Arc::new(move || {
        let statuses = Arc::clone(&statuses);
        Box::pin(async move {
            let copies: Vec<_> = statuses
                .iter()
                .filter_map(|s| s.lock().ok().map(|s| s.clone()))
                .collect();
            Some(GuardReading::from_statuses(&copies))
        })
    })
}

/// A probe for a lake without a live job: every guard always clear.
pub fn probe_none() -> GuardProbe {
    probe_statuses(Vec::new())
}

/// A fault drill for tests: stop the process (`abort`, like kill -9) after committing the
/// outputs of sub-range `seq`, before it is marked done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackfillFault {
    /// The sub-range.
    pub seq: u32,
}

/// How a backfill runs in this process.
#[derive(Clone)]
pub struct RunOptions {
    /// The live job's guards.
    pub guards: Guards,
    /// Where they are read.
    pub probe: GuardProbe,
    /// How often the controller reads them.
    pub probe_every: Duration,
    /// Metrics.
    pub metrics: Arc<BackfillMetrics>,
    /// Progress, for a terminal view.
    pub progress: SharedProgress,
    /// A fault drill (tests).
    pub fault: Option<BackfillFault>,
    /// Sub-ranges processed at once (each on its own task, with its own memory).
    pub parallelism: usize,
    /// Stops the run where it stands, leaving the backfill paused (the CLI's SIGINT and
    /// SIGTERM).
    pub interrupt: Interrupt,
}

/// Asks a running backfill to stop where it stands: no sub-range starts after it, and the
/// ones in flight are dropped (each commits atomically, so a dropped one is simply done
/// again on `resume`, as after kill -9). The backfill is left `paused`, its snapshot
/// still held.
#[derive(Debug, Clone)]
pub struct Interrupt(Arc<tokio::sync::watch::Sender<bool>>);

impl Default for Interrupt {
    fn default() -> Self {
        Self(Arc::new(tokio::sync::watch::Sender::new(false)))
    }
}

impl Interrupt {
    /// Asks the run to stop.
    pub fn interrupt(&self) {
        self.0.send_replace(true);
    }

    /// Whether the run was asked to stop.
    pub fn is_set(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once the run is asked to stop.
    pub async fn wait(&self) {
        let mut rx = self.0.subscribe();
        // The sender lives in `self`: the channel cannot close while this waits.
        let _ = rx.wait_for(|set| *set).await;
    }
}

impl std::fmt::Debug for RunOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunOptions")
            .field("guards", &self.guards)
            .field("probe_every", &self.probe_every)
            .finish()
    }
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            guards: Guards::default(),
            probe: probe_none(),
            probe_every: Duration::from_millis(100),
            metrics: Arc::new(BackfillMetrics::new()),
            progress: SharedProgress::default(),
            fault: None,
            parallelism: 2,
            interrupt: Interrupt::default(),
        }
    }
}

/// Progress of a running backfill.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Progress {
    /// Sub-ranges in the plan.
    pub subranges: usize,
    /// Sub-ranges done.
    pub done: usize,
    /// Records the sub-ranges are expected to read (see [`SubRange::planned_records`]).
    pub planned_records: u64,
    /// Records read (done sub-ranges and the current one).
    pub records: u64,
    /// Output rows written.
    pub rows_written: u64,
    /// `running`, `paused`, ...
    pub state: String,
    /// Records per second in force (None: unlimited).
    pub rate_limit: Option<u32>,
    /// Preemptions so far.
    pub preemptions: u64,
    /// The controller's last decision.
    pub last_decision: Option<String>,
}

/// Progress, shared with whoever shows it.
pub type SharedProgress = Arc<Mutex<Progress>>;

/// A runner whose lease was not renewed for this long is gone.
pub const LEASE_STALE: Duration = Duration::from_secs(5);

const RUN: u8 = 0;
const PAUSE: u8 = 1;
const ABORT: u8 = 2;
const LOST: u8 = 3;

/// The landing-table snapshot a backfill reads, and what its files' statistics tell of
/// its records' arrivals and event times (see "Erasures" in the module docs).
#[derive(Debug)]
struct Pin {
    /// None: the table was empty when the backfill was planned.
    snapshot_id: Option<i64>,
    arrivals: Arc<ArrivalWatermarks>,
    spans: Arc<FileSpans>,
    /// The erasures judged against this snapshot: it lacks their events.
    reflected: HashSet<String>,
}

impl Pin {
    /// `snapshot_id` of the landing table, its files' statistics read for `spec`: the
    /// live watermark at each arrival, and each file's span of event time (to estimate a
    /// sub-range's records before reading). A file is null-free when none of its records
    /// lacks a key (one that does is late, and reported with its arrival time).
    async fn read(
        lake: &Lake,
        spec: &JobSpec,
        snapshot_id: Option<i64>,
        reflected: HashSet<String>,
    ) -> Result<Self> {
        let keys: Vec<&str> = spec.key.columns.iter().map(String::as_str).collect();
        let (arrivals, spans) = lake
            .file_statistics(
                LakeTable::Events,
                snapshot_id,
                &spec.time.event_time_column,
                ARRIVAL_COLUMN,
                signalweave_window::micros(spec.time.max_out_of_orderness),
                &keys,
            )
            .await?;
        Ok(Self {
            snapshot_id,
            arrivals: Arc::new(arrivals),
            spans: Arc::new(spans),
            reflected,
        })
    }

    /// This pin, with `erasures` judged too.
    fn reflecting(&self, erasures: &[ErasureNotice]) -> Self {
        let mut reflected = self.reflected.clone();
        reflected.extend(erasures.iter().map(|n| n.erasure_id.clone()));
        Self {
            snapshot_id: self.snapshot_id,
            arrivals: Arc::clone(&self.arrivals),
            spans: Arc::clone(&self.spans),
            reflected,
        }
    }
}

/// The erasures a backfill has read, kept so that a read asks only for new ones.
#[derive(Debug, Default)]
struct ErasureLog {
    notices: Vec<ErasureNotice>,
    ids: HashSet<String>,
}

impl ErasureLog {
    /// Every erasure recorded: when one is new, all are read again (an erasure is rare).
    async fn refresh(&mut self, lake: &Lake) -> Result<&[ErasureNotice]> {
        let ids = lake.erasure_ids().await?;
        if ids.iter().any(|id| !self.ids.contains(id)) {
            for n in lake.erasures_after(i64::MIN).await? {
                if self.ids.insert(n.erasure_id.clone()) {
                    self.notices.push(n);
                }
            }
        }
        Ok(&self.notices)
    }
}

/// Why a backfill leaves its snapshot, and for which.
#[derive(Debug, PartialEq, Eq)]
enum Move {
    /// It lacks the events of the erasures judged: it stays.
    Stay,
    /// An erasure's rewrite came after it, and that rewrite's snapshot is the newest
    /// such: the backfill moves there (the erasure keeps it).
    To(i64),
    /// It is gone (expired, by an erasure or after its hold was released), or an
    /// erasure's rewrite is not known to come before or after it: to the current one.
    ToCurrent,
}

/// Where the backfill pinned to `pinned` goes, given `erasures` (those not judged yet).
///
/// An erasure records the sequence number from which on no snapshot holds its events
/// (its rewrite's, or the then current snapshot's when it found them in older snapshots
/// only): a pin at or after it stays. One before it moves to the rewrite, which the
/// erasure keeps, or, when that is not there, to the current snapshot, which lacks the
/// events either way. A record from before the sequence was kept is placed by its
/// rewrite's sequence number; failing that, one that ran to its end expired every
/// snapshot before its rewrite, held or not, so a pin still there lacks its events.
async fn judge(lake: &Lake, pinned: Option<i64>, erasures: &[ErasureNotice]) -> Result<Move> {
    // Planned on an empty table: the backfill reads nothing.
    let Some(pinned) = pinned else {
        return Ok(Move::Stay);
    };
    let events = lake.table(LakeTable::Events).await?;
    let metadata = events.metadata();
    let Some(pin) = metadata.snapshot_by_id(pinned) else {
        return Ok(Move::ToCurrent);
    };
    // (sequence number, id) of the newest rewrite after the pin.
    let mut newest: Option<(i64, i64)> = None;
    for n in erasures {
        let rewrite = n
            .events_snapshot_id
            .and_then(|s| metadata.snapshot_by_id(s));
        // From which snapshot on its events are gone (recorded, or its rewrite's).
        let gone_from = n
            .events_sequence
            .or_else(|| rewrite.map(|s| s.sequence_number()));
        match gone_from {
            Some(seq) if seq > pin.sequence_number() => match rewrite {
                Some(s) if s.sequence_number() == seq => {
                    newest = newest.max(Some((seq, s.snapshot_id())));
                }
                // Found in older snapshots only, or its rewrite expired since.
                _ => return Ok(Move::ToCurrent),
            },
            Some(_) => {}
            // A record from before the sequence was kept.
            None if n.completed => {}
            None => return Ok(Move::ToCurrent),
        }
    }
    Ok(newest.map_or(Move::Stay, |(_, id)| Move::To(id)))
}

/// The pin `record`'s backfill reads from now on: `current` (None: the recorded snapshot,
/// its statistics not read yet), with the erasures not judged yet judged (see [`judge`]).
/// With `check` (when it starts, or a read failed), the pin is checked even when no
/// erasure is new: it may be gone. A new pin is held, then read, then recorded in the old
/// one's place.
async fn settle_pin(
    lake: &Lake,
    store: &BackfillStore,
    spec: &JobSpec,
    record: &BackfillRecord,
    log: &mut ErasureLog,
    current: Option<Arc<Pin>>,
    check: bool,
) -> Result<Arc<Pin>> {
    let reflected = current.as_ref().map(|p| &p.reflected);
    // Every erasure: one is judged by the snapshots, not by its time (hosts' clocks
    // differ).
    let erasures: Vec<ErasureNotice> = log
        .refresh(lake)
        .await?
        .iter()
        .filter(|n| reflected.is_none_or(|r| !r.contains(&n.erasure_id)))
        .cloned()
        .collect();
    if let Some(current) = current.as_ref().filter(|_| erasures.is_empty() && !check) {
        return Ok(Arc::clone(current));
    }
    let pinned = current
        .as_ref()
        .map_or(record.snapshot_id, |p| p.snapshot_id);
    let to = match judge(lake, pinned, &erasures).await? {
        Move::Stay => {
            return Ok(Arc::new(match current {
                Some(c) => c.reflecting(&erasures),
                None => {
                    let ids = erasures.iter().map(|n| n.erasure_id.clone()).collect();
                    Pin::read(lake, spec, pinned, ids).await?
                }
            }));
        }
        Move::To(s) => Some(s),
        Move::ToCurrent => lake
            .table(LakeTable::Events)
            .await?
            .metadata()
            .current_snapshot()
            .map(|s| s.snapshot_id()),
    };
    // Held before its statistics are read: routine expiry may take a snapshot no longer
    // current meanwhile.
    if let Some(s) = to {
        lake.hold_present_snapshot(LakeTable::Events, &record.holder(), s)
            .await?;
    }
    // The new snapshot lacks the events of every erasure read: of those it was judged
    // by, and of those before the old pin.
    let mut ids: HashSet<String> = reflected.cloned().unwrap_or_default();
    ids.extend(erasures.iter().map(|n| n.erasure_id.clone()));
    let pin = Pin::read(lake, spec, to, ids).await?;
    store
        .set_snapshot(&record.job, &record.namespace, to)
        .await?;
    let named: Vec<&str> = erasures.iter().map(|n| n.erasure_id.as_str()).collect();
    tracing::warn!(
        job = %record.job,
        namespace = %record.namespace,
        from = ?pinned,
        to = ?to,
        erasures = ?named,
        "the backfill's snapshot holds erased events or is gone: it reads the landing table's snapshot {to:?} from here on"
    );
    Ok(Arc::new(pin))
}

struct SubRangeOutput {
    /// What it was read from.
    pin: Arc<Pin>,
    rows: Emissions,
    late: Vec<LateEvent>,
    figures: SubRange,
    stages: Stages,
}

/// Where a sub-range's time goes, besides its commit: reading and decoding its files,
/// the engine, and waiting for budget tokens (or while paused). The rest of its time is
/// the backfill's own work on the batches (the arrival watermark, the key-group filter).
/// Each stage's time is added to its metric as it is spent, so a long sub-range shows
/// where it is going before it ends.
#[derive(Debug, Clone)]
struct Stages {
    /// Time per [`Stage`], in its order.
    spent: [Duration; 3],
    /// The metric of each [`Stage`].
    counters: [Counter<f64, AtomicU64>; 3],
}

/// A stage of a sub-range's processing (see [`Stages`]).
#[derive(Debug, Clone, Copy)]
enum Stage {
    Read = 0,
    Engine = 1,
    Throttled = 2,
}

/// Each stage's name, as its metric's `stage` label: [`Stage`]'s, then the commit's.
const STAGE_NAMES: [&str; 4] = ["read", "engine", "throttled", "commit"];

impl Stages {
    fn new(metrics: &BackfillMetrics, labels: &Labels) -> Self {
        Self {
            spent: [Duration::ZERO; 3],
            counters: [0, 1, 2].map(|i| stage_counter(metrics, labels, STAGE_NAMES[i])),
        }
    }

    /// Adds the time since `from` to `stage`.
    fn add(&mut self, stage: Stage, from: Instant) {
        let took = from.elapsed();
        self.spent[stage as usize] += took;
        self.counters[stage as usize].inc_by(took.as_secs_f64());
    }

    fn spent(&self, stage: Stage) -> Duration {
        self.spent[stage as usize]
    }

    /// Awaits `wait`, adding its time to `stage` every [`STAGE_TICK`] meanwhile, so a long
    /// wait (a pause, a budget near 0) shows in the metric while it lasts.
    async fn waiting<F: std::future::Future>(&mut self, stage: Stage, wait: F) -> F::Output {
        let mut wait = std::pin::pin!(wait);
        let mut from = Instant::now();
        loop {
            tokio::select! {
                biased;
                out = &mut wait => {
                    self.add(stage, from);
                    return out;
                }
                () = tokio::time::sleep(STAGE_TICK) => {
                    self.add(stage, from);
                    from = Instant::now();
                }
            }
        }
    }
}

/// How often a long wait's time is added to its stage's metric (see [`Stages::waiting`]).
const STAGE_TICK: Duration = Duration::from_millis(500);

/// A backfill's time by stage so far, seconds, as its metrics hold it: each of
/// [`STAGE_NAMES`] with its total over the sub-ranges.
pub fn stage_totals(
    metrics: &BackfillMetrics,
    job: &str,
    namespace: &str,
) -> Vec<(&'static str, f64)> {
    let labels: Labels = vec![
        ("job".into(), job.to_string()),
        ("namespace".into(), namespace.to_string()),
    ];
    STAGE_NAMES
        .into_iter()
        .map(|stage| (stage, stage_counter(metrics, &labels, stage).get()))
        .collect()
}

/// The metric of `stage` for a backfill labelled `labels`.
fn stage_counter(
    metrics: &BackfillMetrics,
    labels: &Labels,
    stage: &str,
) -> Counter<f64, AtomicU64> {
    let mut labels = labels.clone();
    labels.push(("stage".into(), stage.into()));
    metrics.stage_seconds.get_or_create(&labels).clone()
}

/// Runs (or resumes) the backfill of `spec` in `namespace` until it completes, is
/// aborted, or fails. `spec` must be the spec of the backfill's job version.
pub async fn run(
    lake: &Lake,
    spec: Arc<JobSpec>,
    namespace: &str,
    options: RunOptions,
) -> Result<BackfillRecord> {
    let store = BackfillStore::open(lake.clone()).await?;
    let record = store.require(&spec.name, namespace).await?;
    if record.finished() {
        return Ok(record);
    }
    if spec.version != record.job_version {
        return Err(RunnerError::new(
            ErrorKind::Config,
            format!(
                "the backfill runs {} version {}, not {}",
                spec.name, record.job_version, spec.version
            ),
        ));
    }
    let runner = format!("{}:{}", std::process::id(), uuid::Uuid::new_v4().simple());
    if !store
        .acquire(&spec.name, namespace, &runner, LEASE_STALE)
        .await?
    {
        return Err(RunnerError::new(
            ErrorKind::Conflict,
            format!(
                "the backfill of {} in `{namespace}` is running in another process ({})",
                spec.name,
                record.runner.as_deref().unwrap_or("?")
            ),
        ));
    }
    if record.desired == "abort" {
        store
            .set_state(&spec.name, namespace, "aborted", None)
            .await?;
        lake.release_snapshot(LakeTable::Events, &record.holder())
            .await?;
        store.release(&spec.name, namespace, &runner).await?;
        return store.require(&spec.name, namespace).await;
    }
    // A resume clears a pause asked of a process that is gone.
    if record.desired == "pause" && record.state != "running" {
        store.set_desired(&spec.name, namespace, "run").await?;
    }
    // The snapshot to read: the pinned one, unless an erasure has removed events from it
    // since (and expired it).
    let mut erasures = ErasureLog::default();
    let pin = match settle_pin(lake, &store, &spec, &record, &mut erasures, None, true).await {
        Ok(pin) => pin,
        Err(e) => {
            store.release(&spec.name, namespace, &runner).await?;
            return Err(e);
        }
    };
    let throttle = Arc::new(Throttle::new(&record.budgets));
    // Nothing is admitted before the controller's first reading of the live job's guards
    // (see `Controller::new`).
    throttle.set_rate(Some(0), None);
    let control = Arc::new(AtomicU8::new(RUN));
    let labels: Labels = vec![
        ("job".into(), spec.name.clone()),
        ("namespace".into(), namespace.to_string()),
    ];
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let background = tokio::spawn(background(
        store.clone(),
        record.clone(),
        runner.clone(),
        options.clone(),
        Arc::clone(&throttle),
        Arc::clone(&control),
        labels.clone(),
        stop_rx,
    ));
    let backfill = Running {
        pin: Arc::new(tokio::sync::Mutex::new(pin)),
        erasures: Arc::new(tokio::sync::Mutex::new(erasures)),
        lake: lake.clone(),
        spec,
        store: store.clone(),
        record,
        throttle,
        control,
        options,
        labels,
        engines: Arc::default(),
    };
    let result = backfill.run_subranges().await;
    let _ = stop_tx.send(true);
    let _ = background.await;
    let (job, ns) = (&backfill.record.job, &backfill.record.namespace);
    let outcome = match result {
        Ok(state) => {
            store.set_state(job, ns, state, None).await?;
            if state != "paused" {
                lake.release_snapshot(LakeTable::Events, &backfill.record.holder())
                    .await?;
            }
            Ok(())
        }
        Err(e) => {
            let _ = store
                .set_state(job, ns, "failed", Some(e.to_string()))
                .await;
            Err(e)
        }
    };
    store.release(job, ns, &runner).await?;
    outcome?;
    let record = store.require(job, ns).await?;
    if let Ok(mut p) = backfill.options.progress.lock() {
        p.state = record.state.clone();
    }
    Ok(record)
}

/// The controller and the lease, beside the run: reads the guards every `probe_every` and
/// applies decisions; renews the lease (reading the operator's wish) every 500 ms.
#[allow(clippy::too_many_arguments)]
async fn background(
    store: BackfillStore,
    record: BackfillRecord,
    runner: String,
    options: RunOptions,
    throttle: Arc<Throttle>,
    control: Arc<AtomicU8>,
    labels: Labels,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut controller = Controller::new(options.guards, record.budgets);
    // The lease and the operator's wish, every 500 ms, in a task of their own.
    let heartbeat = {
        let (store, record, runner) = (store.clone(), record.clone(), runner.clone());
        let throttle = Arc::clone(&throttle);
        let progress = Arc::clone(&options.progress);
        tokio::spawn(async move {
            let mut paused = false;
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                match store
                    .heartbeat(&record.job, &record.namespace, &runner)
                    .await
                {
                    Ok(Some(desired)) => {
                        let (wish, operator) = match desired.as_str() {
                            "pause" => (PAUSE, Operator::Hold),
                            "abort" => (ABORT, Operator::Stop),
                            _ => (RUN, Operator::Run),
                        };
                        control.store(wish, Ordering::Relaxed);
                        // Also in force mid-batch: a waiting admission holds or fails.
                        throttle.set_operator(operator);
                        if (wish == PAUSE) != paused && wish != ABORT {
                            paused = wish == PAUSE;
                            let state = if paused { "paused" } else { "running" };
                            tracing::info!(job = %record.job, namespace = %record.namespace, "backfill {state}");
                            if let Ok(mut p) = progress.lock() {
                                p.state = state.to_string();
                            }
                            if let Err(e) = store
                                .set_state(&record.job, &record.namespace, state, None)
                                .await
                            {
                                tracing::warn!(error = %e, "could not record the backfill's state");
                            }
                        }
                    }
                    Ok(None) => {
                        control.store(LOST, Ordering::Relaxed);
                        throttle.set_operator(Operator::Stop);
                    }
                    Err(e) => tracing::warn!(error = %e, "backfill heartbeat failed"),
                }
            }
        })
    };
    let _heartbeat = AbortOnDrop(heartbeat);
    let m = &options.metrics;
    let rate_gauge = |rate: Option<u32>| rate.map_or(-1, i64::from);
    m.rate_limit
        .get_or_create(&labels)
        .set(rate_gauge(controller.rate()));
    // The first reading at once: the run waits on it.
    let mut pause = Duration::ZERO;
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        pause = options.probe_every;
        let reading = tokio::time::timeout(Duration::from_secs(1), (options.probe)())
            .await
            .ok()
            .flatten();
        if let Some(r) = &reading {
            for (guard, v) in [
                ("queue_age", r.queue_age_s),
                ("watermark_delay", r.watermark_delay_s),
                ("checkpoint_age", r.checkpoint_age_s),
                ("sink_commit", r.sink_commit_s),
            ] {
                let mut l = labels.clone();
                l.push(("guard".into(), guard.into()));
                m.guard_seconds.get_or_create(&l).set(v);
            }
        }
        if let Some(d) = controller.observe(reading.as_ref(), Instant::now()) {
            throttle.set_rate(d.rate, d.crossed_at);
            let rate = d
                .rate
                .map_or_else(|| "unlimited".to_string(), |r| format!("{r} records/s"));
            let text = format!("{} to {rate}: {}", d.action, d.cause);
            tracing::info!(job = %record.job, namespace = %record.namespace, action = d.action, cause = %d.cause, rate = ?d.rate, "backfill budget decision");
            let mut l = labels.clone();
            l.push(("action".into(), d.action.into()));
            m.decisions.get_or_create(&l).inc();
            m.rate_limit.get_or_create(&labels).set(rate_gauge(d.rate));
            let preemption = d.action == "reclaim";
            if let Ok(mut p) = options.progress.lock() {
                p.rate_limit = d.rate;
                p.last_decision = Some(text.clone());
                p.preemptions += u64::from(preemption);
            }
            // Recorded beside the loop: a busy catalog database must not delay the next
            // reading of the guards.
            let (store, job, ns, rate) = (
                store.clone(),
                record.job.clone(),
                record.namespace.clone(),
                d.rate,
            );
            tokio::spawn(async move {
                if let Err(e) = store
                    .record_decision(&job, &ns, preemption, &text, rate)
                    .await
                {
                    tracing::warn!(error = %e, "could not record a backfill decision");
                }
            });
        }
        if let Ok(mut samples) = m.reclaim_samples.lock() {
            for latency in throttle.reclaim_latencies().iter().skip(samples.len()) {
                let secs = latency.as_secs_f64();
                m.reclaim_seconds.get_or_create(&labels).observe(secs);
                samples.push(secs);
            }
        }
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[derive(Clone)]
struct Running {
    lake: Lake,
    /// What sub-ranges read from now (see [`Pin`]).
    pin: Arc<tokio::sync::Mutex<Arc<Pin>>>,
    /// The erasures read.
    erasures: Arc<tokio::sync::Mutex<ErasureLog>>,
    spec: Arc<JobSpec>,
    store: BackfillStore,
    record: BackfillRecord,
    throttle: Arc<Throttle>,
    control: Arc<AtomicU8>,
    options: RunOptions,
    labels: Labels,
    /// Engines of finished sub-ranges, emptied, for the next ones: each keeps the memory
    /// of its dedup set (see [`WindowEngine::reset`]).
    engines: Arc<std::sync::Mutex<Vec<WindowEngine>>>,
}

impl Running {
    fn writer(&self) -> String {
        format!("backfill:{}:{}", self.record.job, self.record.namespace)
    }

    fn late_writer(&self) -> String {
        format!(
            "backfill-late:{}:{}",
            self.record.job, self.record.namespace
        )
    }

    /// The pin the next sub-range reads from, with the erasures recorded since judged;
    /// with `check`, whether it is gone too (see [`settle_pin`]).
    async fn current_pin(&self, check: bool) -> Result<Arc<Pin>> {
        let mut pin = self.pin.lock().await;
        let mut log = self.erasures.lock().await;
        let settled = settle_pin(
            &self.lake,
            &self.store,
            &self.spec,
            &self.record,
            &mut log,
            Some(Arc::clone(&pin)),
            check,
        )
        .await?;
        *pin = Arc::clone(&settled);
        Ok(settled)
    }

    /// Obeys the operator between batches: returns Ok(false) on abort, waits while paused.
    async fn obey(&self) -> Result<bool> {
        loop {
            match self.control.load(Ordering::Relaxed) {
                RUN => return Ok(true),
                ABORT => return Ok(false),
                LOST => {
                    return Err(RunnerError::new(
                        ErrorKind::Conflict,
                        "the backfill's lease was taken by another process",
                    ));
                }
                // Paused: the heartbeat reports it, and holds admissions mid-batch.
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    async fn state(&self, state: &str) -> Result<()> {
        if let Ok(mut p) = self.options.progress.lock() {
            p.state = state.to_string();
        }
        self.store
            .set_state(&self.record.job, &self.record.namespace, state, None)
            .await
    }

    /// Runs the pending sub-ranges; returns the state they leave: `completed`, `aborted`,
    /// or `paused` when the run was interrupted.
    async fn run_subranges(&self) -> Result<&'static str> {
        let (job, ns) = (&self.record.job, &self.record.namespace);
        let subranges = self.store.subranges(job, ns).await?;
        if let Ok(mut p) = self.options.progress.lock() {
            p.subranges = subranges.len();
            p.done = subranges.iter().filter(|s| s.state == "done").count();
            p.planned_records = subranges.iter().map(|s| s.planned_records).sum();
            p.records = subranges.iter().map(|s| s.records).sum();
            p.rows_written = subranges.iter().map(|s| s.rows_written).sum();
            p.rate_limit = self.record.budgets.records_per_sec;
            p.preemptions = self.record.preemptions;
        }
        self.state("running").await?;
        let mut pending = subranges.into_iter().filter(|s| s.state != "done");
        let mut running = tokio::task::JoinSet::new();
        let mut aborted = false;
        // Up to `parallelism` sub-ranges are read and processed at once, each holding a
        // permit of `processing`, and as many more may be committing: a sub-range gives
        // its permit back before its commit (object-store writes and catalog round trips,
        // about a twentieth of its time), so the next one is processed meanwhile, where a
        // core sat idle. Permits are taken here, in sub-range order.
        let parallelism = self.options.parallelism.max(1);
        let processing = Arc::new(tokio::sync::Semaphore::new(parallelism));
        let interrupt = &self.options.interrupt;
        loop {
            while !aborted && running.len() < parallelism * 2 {
                let Some(sub) = pending.next() else { break };
                let admitted = async {
                    let permit = Arc::clone(&processing).acquire_owned().await.map_err(|e| {
                        RunnerError::new(ErrorKind::Internal, format!("processing permits: {e}"))
                    })?;
                    // A pause before the sub-range starts is throttled time too (in no
                    // sub-range's own figures).
                    let mut between = Stages::new(&self.options.metrics, &self.labels);
                    let go = between.waiting(Stage::Throttled, self.obey()).await?;
                    Ok::<_, RunnerError>(go.then_some(permit))
                };
                let permit = tokio::select! {
                    biased;
                    () = interrupt.wait() => return Ok(Self::interrupted(running).await),
                    admitted = admitted => admitted?,
                };
                let Some(permit) = permit else {
                    aborted = true;
                    break;
                };
                let me = self.clone();
                running.spawn(async move { me.run_one(sub, permit).await });
            }
            let joined = tokio::select! {
                biased;
                () = interrupt.wait() => return Ok(Self::interrupted(running).await),
                joined = running.join_next() => joined,
            };
            let Some(joined) = joined else {
                break;
            };
            let done = joined.map_err(|e| {
                RunnerError::new(ErrorKind::Internal, format!("a sub-range task failed: {e}"))
            });
            match done {
                Ok(Ok(true)) => {}
                Ok(Ok(false)) => aborted = true,
                Ok(Err(e)) | Err(e) => {
                    running.abort_all();
                    return Err(e);
                }
            }
        }
        Ok(if aborted { "aborted" } else { "completed" })
    }

    /// Drops the sub-ranges in flight and waits until they are gone: what they did not
    /// record as done is done again on `resume`.
    async fn interrupted(mut running: tokio::task::JoinSet<Result<bool>>) -> &'static str {
        running.abort_all();
        while running.join_next().await.is_some() {}
        "paused"
    }

    /// Processes one sub-range under its `processing` permit, then commits it; false when
    /// aborted meanwhile.
    async fn run_one(
        &self,
        sub: SubRange,
        processing: tokio::sync::OwnedSemaphorePermit,
    ) -> Result<bool> {
        let (job, ns) = (&self.record.job, &self.record.namespace);
        let output = self.record.output_table(&self.spec)?;
        let started = Instant::now();
        let pin = self.current_pin(false).await?;
        let processed = match self.process(&sub, &pin).await {
            // An erasure may have expired the snapshot while it was read, and deleted its
            // files: the sub-range is read again from the snapshot the erasure left.
            Err(e) => {
                let Ok(now) = self.current_pin(true).await else {
                    return Err(e);
                };
                if now.snapshot_id == pin.snapshot_id {
                    return Err(e);
                }
                tracing::warn!(job = %job, namespace = %ns, seq = sub.seq, error = %e, "reading the sub-range again from the snapshot an erasure left");
                self.process(&sub, &now).await?
            }
            done => done?,
        };
        let Some(mut out) = processed else {
            return Ok(false);
        };
        drop(processing);
        // The rows budget is spent on the rows made, some of which an erasure may leave
        // out of the commit (`rows_written` counts those committed).
        out.stages
            .waiting(
                Stage::Throttled,
                self.throttle.admit_rows(out.rows.len() as u64),
            )
            .await;
        // Up to the commit, the wait for the rows budget included, so the sub-range's rate
        // is what its budgets allowed.
        out.figures.seconds = started.elapsed().as_secs_f64();
        let committing = Instant::now();
        let out_snapshot = self.commit(output, &sub, &mut out).await?;
        let commit = committing.elapsed();
        let m = &self.options.metrics;
        stage_counter(m, &self.labels, STAGE_NAMES[3]).inc_by(commit.as_secs_f64());
        let stages = &out.stages;
        out.figures.stages = Some(StageSeconds {
            read: stages.spent(Stage::Read).as_secs_f64(),
            engine: stages.spent(Stage::Engine).as_secs_f64(),
            throttled: stages.spent(Stage::Throttled).as_secs_f64(),
            commit: commit.as_secs_f64(),
        });
        if self.options.fault == Some(BackfillFault { seq: sub.seq }) {
            eprintln!(
                "fault drill: stopping after the commit of sub-range {}",
                sub.seq
            );
            std::process::abort();
        }
        self.store.subrange_done(job, ns, &out.figures).await?;
        if let Some(s) = out_snapshot {
            self.lake
                .hold_snapshot(output, &self.record.holder(), s)
                .await?;
        }
        m.subranges_done.get_or_create(&self.labels).inc();
        m.rows_written
            .get_or_create(&self.labels)
            .inc_by(out.figures.rows_written);
        if let Ok(mut p) = self.options.progress.lock() {
            p.done += 1;
            p.rows_written += out.figures.rows_written;
        }
        tracing::info!(job = %job, namespace = %ns, seq = sub.seq, records = out.figures.records, rows = out.figures.rows_written, late = out.figures.late, seconds = out.figures.seconds, read_s = stages.spent(Stage::Read).as_secs_f64(), engine_s = stages.spent(Stage::Engine).as_secs_f64(), throttled_s = stages.spent(Stage::Throttled).as_secs_f64(), commit_s = commit.as_secs_f64(), "backfill sub-range done");
        Ok(true)
    }

    /// Reads and processes one sub-range; None when aborted meanwhile.
    ///
    /// A session has no greatest length, so no lead-in makes a session job's first
    /// sessions complete: a key whose events never pause for a gap chains its session back
    /// past any bound. A sub-range of a session job is read again from further back
    /// (twice the reach each time) while one of its sessions starts within a gap of where
    /// the reading started and events exist before that: such a session may have begun
    /// earlier. It ends when every session it owns is known to start where it does, so its
    /// sessions are those of the live job, whatever their length.
    async fn process(&self, sub: &SubRange, pin: &Arc<Pin>) -> Result<Option<SubRangeOutput>> {
        let lead_in = self.record.lead_in_us;
        let mut read_from = sub.from_us.saturating_sub(lead_in);
        let WindowSpec::Session { gap } = self.spec.window else {
            return self.process_from(sub, read_from, pin).await;
        };
        let gap = signalweave_window::micros(gap);
        loop {
            let Some(out) = self.process_from(sub, read_from, pin).await? else {
                return Ok(None);
            };
            // The earliest session that might have begun before the events read.
            let Some(unproven) = out
                .rows
                .window_start()
                .iter()
                .copied()
                .filter(|&start| start.saturating_sub(gap) < read_from)
                .min()
            else {
                return Ok(Some(out));
            };
            let before = self
                .plan_events(pin, unproven.saturating_sub(gap), read_from, None)
                .await?
                .tasks;
            if before.is_empty() {
                return Ok(Some(out));
            }
            // The pass is done again: its records count once, in the pass that stands.
            // (The records counter of the metrics counts every record read, as work.)
            if let Ok(mut p) = self.options.progress.lock() {
                p.records = p.records.saturating_sub(out.figures.records);
            }
            let reach = sub.from_us.saturating_sub(read_from);
            let next = unproven
                .saturating_sub(lead_in)
                .min(sub.from_us.saturating_sub(reach.saturating_mul(2)));
            tracing::info!(
                job = %self.record.job,
                namespace = %self.record.namespace,
                seq = sub.seq,
                from_us = next,
                "a session may have begun before the events read: reading the sub-range again from further back"
            );
            read_from = next;
        }
    }

    /// The landing table's files with events in `[from, to)` of `pin`'s snapshot, read for
    /// `columns` (all when None).
    async fn plan_events(
        &self,
        pin: &Pin,
        from: i64,
        to: i64,
        columns: Option<&[String]>,
    ) -> Result<signalweave_lake::ScanPlan> {
        // A backfill planned on an empty landing table has no input.
        if pin.snapshot_id.is_none() {
            return Ok(signalweave_lake::ScanPlan {
                snapshot_id: None,
                tasks: Vec::new(),
                total_files: 0,
            });
        }
        Ok(self
            .lake
            .plan_time_range_of(LakeTable::Events, from, to, pin.snapshot_id, columns)
            .await?)
    }

    /// [`Self::process`], reading events from `read_from`.
    async fn process_from(
        &self,
        sub: &SubRange,
        read_from: i64,
        pin: &Arc<Pin>,
    ) -> Result<Option<SubRangeOutput>> {
        let recycled = self.engines.lock().ok().and_then(|mut e| e.pop());
        let mut engine = match recycled {
            Some(engine) => engine,
            None => WindowEngine::new(
                Arc::clone(&self.spec),
                EngineConfig {
                    namespace: self.record.namespace.clone(),
                    key_groups: signalweave_window::DEFAULT_KEY_GROUPS,
                    watermark_column: Some(ROW_WATERMARK.into()),
                    dedup_only_column: self.record.exact_dedup.then(|| DEDUP_ONLY.into()),
                },
            )?,
        };
        let all_groups = sub.kg_lo == 0 && sub.kg_hi >= signalweave_window::DEFAULT_KEY_GROUPS;
        let arrivals = &pin.arrivals;
        let columns = source_columns(&self.spec);
        let plan = |from: i64, to: i64| {
            let columns = &columns;
            async move {
                Ok::<_, RunnerError>(self.plan_events(pin, from, to, Some(columns)).await?.tasks)
            }
        };
        let main = plan(read_from, sub.to_us).await?;
        // Earlier copies of the sub-range's records may have other event times (or keys
        // of other key groups), and the live job counted the first copy to arrive: they
        // are read too, judged for dedup only (`DEDUP_ONLY`). A copy matters to a record
        // when it arrived first (so in a file that arrived before the last of the
        // sub-range's files) and was still held when the record arrived: its event time
        // plus the dedup horizon is above that record's watermark, which is at least the
        // first watermark of the sub-range's files. Rows of the sub-range's own files
        // outside it are such rows too.
        let horizon = self.spec.dedup_horizon_us();
        let exact = self.record.exact_dedup;
        // The tasks, where the copies are read from, and the event-time range every task
        // was planned for (`plan` above: its reads filter by it).
        let (mut tasks, copies_from, planned) = if exact && !main.is_empty() {
            let floor = main
                .iter()
                .map(|t| arrivals.first_of(&t.data_file_path))
                .min()
                .unwrap_or(i64::MAX);
            let copies_from = floor.saturating_sub(horizon).min(read_from);
            let last = main
                .iter()
                .map(|t| {
                    arrivals
                        .arrival_of(&t.data_file_path)
                        .map_or(i64::MAX, |a| a.1)
                })
                .max()
                .unwrap_or(i64::MAX);
            let own: std::collections::HashSet<&str> =
                main.iter().map(|t| t.data_file_path.as_str()).collect();
            // Where a file arrived is known from its ingest-time bounds; a file without
            // them (another writer's) could be neither placed nor ruled out.
            let mut kept = Vec::new();
            for t in plan(copies_from, i64::MAX).await? {
                let Some((Some(first), _)) = arrivals.arrival_of(&t.data_file_path) else {
                    return Err(RunnerError::new(
                        ErrorKind::InvalidInput,
                        format!(
                            "--exact-dedup needs the ingest-time bounds of every file it may \
                             read, and {} has none: run the backfill without it",
                            t.data_file_path
                        ),
                    ));
                };
                if own.contains(t.data_file_path.as_str()) || first < last {
                    kept.push(t);
                }
            }
            (kept, copies_from, (copies_from, i64::MAX))
        } else {
            (main, read_from, (read_from, sub.to_us))
        };
        // Files in order of arrival (of their first records), as the live job read them:
        // of two copies of one identity the first to arrive counts. The watermark a file's
        // first record arrived at is then a floor for every record still to come, so the
        // dedup set drops the identities that expire by then rather than grow (see
        // `WindowEngine::set_dedup_floor`).
        tasks.sort_by_cached_key(|t| {
            (
                arrivals.first_of(&t.data_file_path),
                arrivals.sequence_of(&t.data_file_path),
            )
        });
        // The dedup set is sized for the records expected (each file's share of its span
        // of event time), not for the whole files read: sized from the files, it took
        // about twice the memory, every page of it faulted in on first use. Since a floor
        // lets it drop what expires, it holds the records of about a horizon plus the file
        // being read, and is kept at most three-eighths full after a sweep: the records of
        // four horizons leave room for that without a growth, which holds the old and the
        // new log at once. An estimate short of what comes grows the set.
        let held_to = copies_from
            .saturating_add(horizon.saturating_mul(4))
            .min(sub.to_us);
        // Without `exact_dedup`, the set holds only the sub-range's key groups.
        let share = if exact {
            (1, 1)
        } else {
            (
                u64::from(sub.kg_hi.saturating_sub(sub.kg_lo)),
                u64::from(signalweave_window::DEFAULT_KEY_GROUPS),
            )
        };
        let expected =
            pin.spans.estimate_tasks(&tasks, copies_from, held_to) * share.0 / share.1.max(1);
        engine.reserve(expected.min(16_000_000) as usize);
        let mut figures = sub.clone();
        let mut stages = Stages::new(&self.options.metrics, &self.labels);
        let mut late_events = Vec::new();
        let key_columns = self.spec.key.columns.clone();
        let late_only = late_only_columns(&self.spec);
        let event_time = self.spec.time.event_time_column.clone();
        let m = &self.options.metrics;
        let records_counter = m.records.get_or_create(&self.labels).clone();
        let bytes_counter = m.bytes_read.get_or_create(&self.labels).clone();
        for mut task in tasks {
            let bytes = task.length;
            let path = task.data_file_path.clone();
            let sequence = arrivals.sequence_of(&task.data_file_path);
            engine.set_dedup_floor(arrivals.first_of(&task.data_file_path));
            // A file whose records all arrived at one watermark, with keys, and none early
            // enough to be late by it (see `ArrivalWatermarks::uniform_of`), is read
            // without its arrival times: they serve only to find that watermark and to
            // report late records. A sixth of the bytes a backfill decompresses. So is
            // the currency, which only a late record reports.
            let uniform = arrivals.uniform_of(&task.data_file_path).filter(|&wm| {
                pin.spans
                    .span_of(&task.data_file_path)
                    .is_some_and(|(lowest, _)| engine.on_time_from(lowest, wm))
            });
            if uniform.is_some() {
                signalweave_lake::project_without(&mut task, &late_only);
            }
            stages
                .waiting(Stage::Throttled, self.throttle.admit_bytes(bytes))
                .await;
            figures.bytes_read += bytes;
            bytes_counter.inc_by(bytes);
            let opened = Instant::now();
            // A compacted file's records carry their own commits, read with them.
            let mut stream = if arrivals.has_lineage(&path) {
                self.lake
                    .read_pages_with_lineage(LakeTable::Events, task, planned.0, planned.1)
                    .await?
            } else {
                self.lake
                    .read_pages_in_range(LakeTable::Events, task, planned.0, planned.1)
                    .await?
            };
            stages.add(Stage::Read, opened);
            loop {
                let reading = Instant::now();
                let next = stream.try_next().await.map_err(|e| {
                    RunnerError::new(ErrorKind::Unavailable, format!("read events: {e}"))
                })?;
                stages.add(Stage::Read, reading);
                let Some(batch) = next else { break };
                let run = stages.waiting(Stage::Throttled, self.obey()).await?;
                if !run {
                    return Ok(None);
                }
                let (batch, n) = if exact {
                    // A record of the sub-range: its event time in the range read, its key
                    // in the sub-range's key groups. The others are judged for dedup only.
                    let times = event_times(&batch, &event_time)?;
                    let groups = if all_groups {
                        None
                    } else {
                        Some(engine.key_groups_of_rows(&batch)?)
                    };
                    let dedup_only: BooleanArray = (0..batch.num_rows())
                        .map(|row| {
                            let t = times.value(row);
                            let ours = t >= read_from
                                && t < sub.to_us
                                && groups.as_ref().is_none_or(|g| in_groups(g[row], sub));
                            Some(!ours)
                        })
                        .collect();
                    let n = (batch.num_rows() - dedup_only.true_count()) as u64;
                    // The records budget is spent on the sub-range's records; the copies
                    // read around them spend the bytes budget. A batch of copies alone
                    // takes one token, so it waits as the others do while the backfill is
                    // held at a floor of 0.
                    let admitted = stages
                        .waiting(Stage::Throttled, self.throttle.admit_records(n.max(1)))
                        .await;
                    if !admitted {
                        // Stopped: an abort, or a lost lease (an error).
                        self.obey().await?;
                        return Ok(None);
                    }
                    (with_column(&batch, DEDUP_ONLY, Arc::new(dedup_only))?, n)
                } else {
                    let n = batch.num_rows() as u64;
                    let admitted = stages
                        .waiting(Stage::Throttled, self.throttle.admit_records(n))
                        .await;
                    if !admitted {
                        // Stopped: an abort, or a lost lease (an error).
                        self.obey().await?;
                        return Ok(None);
                    }
                    let batch = if all_groups {
                        batch
                    } else {
                        let groups = engine.key_groups_of_rows(&batch)?;
                        let mask: BooleanArray =
                            groups.iter().map(|&g| Some(in_groups(g, sub))).collect();
                        arrow::compute::filter_record_batch(&batch, &mask).map_err(|e| {
                            RunnerError::new(ErrorKind::Internal, format!("key-group filter: {e}"))
                        })?
                    };
                    (batch, n)
                };
                figures.records += n;
                records_counter.inc_by(n);
                if let Ok(mut p) = self.options.progress.lock() {
                    p.records += n;
                }
                let batch = match uniform {
                    Some(wm) => with_column(
                        &batch,
                        ROW_WATERMARK,
                        Arc::new(arrow::array::Int64Array::from_value(wm, batch.num_rows())),
                    )?,
                    None => with_arrival_watermark(&batch, arrivals, sequence)?,
                };
                let processing = Instant::now();
                let outcome = engine.process_batch(&batch, "events", BACKFILL_PROC_TIME)?;
                stages.add(Stage::Engine, processing);
                figures.duplicates += outcome.duplicates;
                if outcome.late.is_empty() {
                    continue;
                }
                if uniform.is_some() {
                    // Its statistics said no record could be late: they or the engine lied.
                    return Err(RunnerError::new(
                        ErrorKind::Internal,
                        format!(
                            "{} late records in {}, whose statistics ruled out any",
                            outcome.late.len(),
                            path
                        ),
                    ));
                }
                // Late records are the business of the sub-range their event time is in.
                let times = event_times(&batch, &event_time)?;
                let owned: Vec<_> = outcome
                    .late
                    .into_iter()
                    .filter(|l| {
                        let t = times.value(l.row as usize);
                        !times.is_null(l.row as usize) && t >= sub.from_us && t < sub.to_us
                    })
                    .collect();
                late_events.extend(late::extract(
                    &batch,
                    &owned,
                    &key_columns,
                    chrono::Utc::now().timestamp_micros(),
                )?);
            }
        }
        let generated_at = chrono::Utc::now().timestamp_micros();
        let last = sub.to_us == self.record.to_us;
        // The input's watermark: a window it has not passed may still gain records (in the
        // live job, later); it is as partial as one crossing the range's end.
        let input_watermark = pin.arrivals.at(i64::MAX);
        let finishing = Instant::now();
        let mut rows = engine.finish(BACKFILL_PROC_TIME);
        stages.add(Stage::Engine, finishing);
        engine.reset();
        if let Ok(mut engines) = self.engines.lock() {
            engines.push(engine);
        }
        let keep: Vec<bool> = rows
            .window_start()
            .iter()
            .zip(rows.window_end())
            .map(|(&start, &end)| {
                let owned = end > sub.from_us && end <= sub.to_us;
                let crossing_end = last && start < sub.to_us && end > sub.to_us;
                owned || crossing_end
            })
            .collect();
        rows.retain(&keep);
        let completeness: Vec<Completeness> = rows
            .window_end()
            .iter()
            .map(|&end| {
                if end > self.record.to_us || end > input_watermark {
                    Completeness::Partial
                } else {
                    Completeness::OnTime
                }
            })
            .collect();
        rows.completeness_mut().copy_from_slice(&completeness);
        rows.watermark_mut().fill(sub.to_us.min(input_watermark));
        rows.emitted_at_mut().fill(generated_at);
        figures.rows_written = rows.len() as u64;
        figures.late = late_events.len() as u64;
        figures.input_watermark_us = Some(input_watermark);
        Ok(Some(SubRangeOutput {
            pin: Arc::clone(pin),
            rows,
            late: late_events,
            figures,
            stages,
        }))
    }

    /// Commits a sub-range's outputs, then its late records, less the windows of erasures
    /// its snapshot predates; commits that exist are recognised by their identity and
    /// skipped. Returns the output snapshot; `out`'s figures count what was committed.
    async fn commit(
        &self,
        output: LakeTable,
        sub: &SubRange,
        out: &mut SubRangeOutput,
    ) -> Result<Option<i64>> {
        let summary: HashMap<String, String> = [
            (SUMMARY_JOB, self.record.job.clone()),
            (SUMMARY_NAMESPACE, self.record.namespace.clone()),
            (SUMMARY_SUBRANGE, sub.seq.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        // Read at the commit: an erasure recorded after the sub-range's snapshot was judged
        // applies. (One recorded after this read, whose rewrite of this table commits
        // before the append below, leaves the rows this append adds: `lake erase` says
        // until when to run it again.)
        let mut erased = match ErasedWindows::new(&self.spec) {
            Some(mut w) => {
                let mut log = self.erasures.lock().await;
                let applying = log
                    .refresh(&self.lake)
                    .await?
                    .iter()
                    .filter(|n| !out.pin.reflected.contains(&n.erasure_id))
                    .cloned()
                    .collect();
                w.hold(applying);
                Some(w)
            }
            None => None,
        };
        let mut snapshot = None;
        let batch = if out.rows.is_empty() {
            None
        } else {
            let batch = out.rows.to_batch(
                &self.spec,
                &self.record.namespace,
                &vec![out.pin.snapshot_id; out.rows.len()],
            )?;
            let batch = RecordBatch::try_new(output.arrow_schema(), batch.columns().to_vec())
                .map_err(|e| RunnerError::new(ErrorKind::Internal, format!("output batch: {e}")))?;
            match erased.as_mut() {
                Some(w) => w.outputs(batch)?,
                None => Some(batch),
            }
        };
        out.figures.rows_written = batch.as_ref().map_or(0, |b| b.num_rows() as u64);
        if let Some(batch) = batch {
            let identity = CommitIdentity::new(self.writer(), u64::from(sub.seq));
            let outcome = self
                .lake
                .append_with_summary(output, &[batch], &identity, summary.clone())
                .await?;
            snapshot = Some(outcome.snapshot_id);
        }
        let late = match erased.as_mut() {
            Some(w) => w.late(&out.late),
            None => std::borrow::Cow::Borrowed(&out.late[..]),
        };
        out.figures.late = late.len() as u64;
        if !late.is_empty() {
            let batch = late::to_batch(&self.record.job, &self.record.namespace, &late)?;
            let identity = CommitIdentity::new(self.late_writer(), u64::from(sub.seq));
            self.lake
                .append_with_summary(LakeTable::LateEvents, &[batch], &identity, summary)
                .await?;
        }
        Ok(snapshot)
    }
}

/// The landing-table columns a backfill of `spec` reads: the engine's, the arrival time,
/// and those of a late record.
pub fn source_columns(spec: &JobSpec) -> Vec<String> {
    let mut columns: Vec<String> = [
        "tenant",
        "event_id",
        "event_type",
        ARRIVAL_COLUMN,
        "amount_minor",
        "currency",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    columns.extend(engine_columns(spec).cloned());
    columns.sort();
    columns.dedup();
    columns
}

/// The landing-table columns the engine reads for `spec`: event time, key, dedup identity,
/// input and aggregate inputs.
fn engine_columns(spec: &JobSpec) -> impl Iterator<Item = &String> {
    std::iter::once(&spec.time.event_time_column)
        .chain(&spec.key.columns)
        .chain(&spec.dedup.identity)
        .chain(&spec.time.input_column)
        .chain(spec.aggregates.iter().filter_map(|a| a.column.as_ref()))
}

/// The columns of [`source_columns`] that serve only the arrival watermark and late
/// records: the arrival time and the currency, unless `spec` reads them itself. A file
/// whose records all arrived at one watermark, none late by it, is read without them (see
/// `ArrivalWatermarks::uniform_of`).
pub fn late_only_columns(spec: &JobSpec) -> Vec<String> {
    [ARRIVAL_COLUMN, "currency"]
        .into_iter()
        .filter(|c| !engine_columns(spec).any(|e| e == c))
        .map(String::from)
        .collect()
}

/// `batch` with the live watermark at each record's arrival ([`ROW_WATERMARK`]).
fn with_arrival_watermark(
    batch: &RecordBatch,
    arrivals: &signalweave_lake::ArrivalWatermarks,
    sequence: i64,
) -> Result<RecordBatch> {
    let arrival = batch
        .column_by_name(ARRIVAL_COLUMN)
        .and_then(|c| {
            arrow::array::AsArray::as_primitive_opt::<arrow::datatypes::TimestampMicrosecondType>(
                c.as_ref(),
            )
            .cloned()
        })
        .ok_or_else(|| {
            RunnerError::new(
                ErrorKind::InvalidInput,
                format!("events lack the arrival column {ARRIVAL_COLUMN}"),
            )
        })?;
    // A record's arrival bounds the watermark it is judged by from below, as the dedup
    // floor relies on: one without it cannot be judged as the live job judged it.
    if arrival.null_count() > 0 {
        return Err(RunnerError::new(
            ErrorKind::InvalidInput,
            format!(
                "{} events lack their arrival time ({ARRIVAL_COLUMN} is null)",
                arrival.null_count()
            ),
        ));
    }
    // The records of a file arrived in its commit, at the watermark before it; those of a
    // file with row lineage (a compacted file) in their own commits, which the batch's
    // lineage column holds.
    let Some(at) = batch
        .schema()
        .index_of(signalweave_lake::LINEAGE_COLUMN)
        .ok()
    else {
        let wm = arrow::array::Int64Array::from_value(arrivals.at(sequence), batch.num_rows());
        return with_column(batch, ROW_WATERMARK, Arc::new(wm));
    };
    let mut cursor = arrivals.cursor();
    let lineage = arrow::array::AsArray::as_primitive_opt::<arrow::datatypes::Int64Type>(
        batch.column(at).as_ref(),
    )
    .filter(|l| l.null_count() == 0)
    .ok_or_else(|| {
        RunnerError::new(
            ErrorKind::Internal,
            "events read with their lineage lack it for some rows",
        )
    })?;
    let wm =
        arrow::array::Int64Array::from_iter_values(lineage.values().iter().map(|&s| cursor.at(s)));
    let others: Vec<usize> = (0..batch.num_columns()).filter(|&i| i != at).collect();
    let batch = batch
        .project(&others)
        .map_err(|e| RunnerError::new(ErrorKind::Internal, format!("drop lineage: {e}")))?;
    with_column(&batch, ROW_WATERMARK, Arc::new(wm))
}

/// Whether a record of key group `group` (None: a null key) belongs to `sub`. A record
/// with a null key (late) belongs to the first key-group range of its slice, so it is
/// reported once.
fn in_groups(group: Option<u16>, sub: &SubRange) -> bool {
    match group {
        Some(g) => g >= sub.kg_lo && g < sub.kg_hi,
        None => sub.kg_lo == 0,
    }
}

/// `batch` with `column` added as `name`.
fn with_column(
    batch: &RecordBatch,
    name: &str,
    column: arrow::array::ArrayRef,
) -> Result<RecordBatch> {
    let mut fields: Vec<_> = batch.schema().fields().iter().cloned().collect();
    fields.push(Arc::new(arrow::datatypes::Field::new(
        name,
        column.data_type().clone(),
        true,
    )));
    let mut columns = batch.columns().to_vec();
    columns.push(column);
    RecordBatch::try_new(Arc::new(arrow::datatypes::Schema::new(fields)), columns)
        .map_err(|e| RunnerError::new(ErrorKind::Internal, format!("column {name}: {e}")))
}

/// The event times of `batch` (column `name`).
fn event_times(
    batch: &RecordBatch,
    name: &str,
) -> Result<arrow::array::PrimitiveArray<arrow::datatypes::TimestampMicrosecondType>> {
    batch
        .column_by_name(name)
        .and_then(|c| {
            arrow::array::AsArray::as_primitive_opt::<arrow::datatypes::TimestampMicrosecondType>(
                c.as_ref(),
            )
            .cloned()
        })
        .ok_or_else(|| RunnerError::new(ErrorKind::InvalidInput, "events lack the event time"))
}

/// Asks a backfill to pause, resume or abort (the running process obeys within a second).
pub async fn steer(
    lake: &Lake,
    job: &str,
    namespace: &str,
    desired: &str,
) -> Result<BackfillRecord> {
    let store = BackfillStore::open(lake.clone()).await?;
    store.set_desired(job, namespace, desired).await?;
    store.require(job, namespace).await
}

/// Aborts a backfill no process is running: takes its lease, marks it aborted and
/// releases its snapshot hold. Fails with `Conflict` when a process runs it (ask that one).
pub async fn abort_idle(lake: &Lake, job: &str, namespace: &str) -> Result<BackfillRecord> {
    let store = BackfillStore::open(lake.clone()).await?;
    let record = store.require(job, namespace).await?;
    let runner = format!("{}:{}", std::process::id(), uuid::Uuid::new_v4().simple());
    if !store.acquire(job, namespace, &runner, LEASE_STALE).await? {
        return Err(RunnerError::new(
            ErrorKind::Conflict,
            format!("the backfill of {job} in `{namespace}` is running in another process"),
        ));
    }
    store.set_state(job, namespace, "aborted", None).await?;
    lake.release_snapshot(LakeTable::Events, &record.holder())
        .await?;
    store.release(job, namespace, &runner).await?;
    store.require(job, namespace).await
}

/// True when a process holds the backfill's lease and renewed it within `stale`.
pub fn has_live_runner(record: &BackfillRecord, stale: Duration) -> bool {
    record.runner.is_some()
        && record
            .heartbeat_ms
            .is_some_and(|h| now_ms() - h < stale.as_millis() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_record_gets_the_watermark_it_arrived_at_and_one_without_an_arrival_is_refused() {
        use arrow::array::{AsArray, TimestampMicrosecondArray};
        use arrow::datatypes::{DataType, Field, Int64Type, Schema, TimeUnit};
        use signalweave_lake::ArrivedFile;

        // Two files, the second arriving at 20 after the first (events up to 1,000).
        let file = |path: &str, first, last, sequence, last_event| ArrivedFile {
            path: path.into(),
            lineage: false,
            first_ingest: Some(first),
            last_ingest: last,
            sequence,
            last_event,
            null_free: false,
        };
        let arrivals = signalweave_lake::ArrivalWatermarks::from_files(
            vec![file("a", 0, 10, 1, 1_000), file("b", 20, 30, 2, 2_000)],
            100,
        );
        let batch = |ingest: Vec<Option<i64>>| {
            let schema = Schema::new(vec![Field::new(
                ARRIVAL_COLUMN,
                DataType::Timestamp(TimeUnit::Microsecond, None),
                true,
            )]);
            RecordBatch::try_new(
                Arc::new(schema),
                vec![Arc::new(TimestampMicrosecondArray::from(ingest))],
            )
            .unwrap()
        };
        let out = with_arrival_watermark(&batch(vec![Some(25), Some(20)]), &arrivals, 2).unwrap();
        let wm = out.column_by_name(ROW_WATERMARK).unwrap();
        assert_eq!(wm.as_primitive::<Int64Type>().values(), &[900, 900]);
        assert!(
            arrivals.first_of("b") <= 900,
            "the file's floor is below its records'"
        );
        let e = with_arrival_watermark(&batch(vec![Some(25), None]), &arrivals, 2).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        assert!(
            e.to_string().contains("1 events lack their arrival time"),
            "{e}"
        );
    }

    /// The arrival time and the currency are left unread only where the job itself does
    /// not read them.
    #[test]
    fn late_only_columns_are_those_the_job_does_not_read() {
        let text = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../jobs/market_aggregates.toml"),
        )
        .unwrap();
        let spec = JobSpec::from_toml(&text).unwrap();
        assert_eq!(late_only_columns(&spec), vec![ARRIVAL_COLUMN, "currency"]);
        let by_currency = JobSpec::from_toml(&text.replace(
            r#"columns = ["market_id"]"#,
            r#"columns = ["market_id", "currency"]"#,
        ))
        .unwrap();
        assert_eq!(by_currency.key.columns, ["market_id", "currency"]);
        assert_eq!(late_only_columns(&by_currency), vec![ARRIVAL_COLUMN]);
        let columns = source_columns(&by_currency);
        assert!(columns.iter().any(|c| c == "currency"), "{columns:?}");
    }

    /// A catalog database from before the stage columns (and `exact_dedup`) gets them,
    /// reads its sub-ranges without a split, and records one for a sub-range done after.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_catalog_from_before_gets_the_stage_columns() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(signalweave_lake::LakeConfig::embedded(dir.path()))
            .await
            .unwrap();
        lake.init().await.unwrap();
        // The tables as their first release made them, with a pending sub-range.
        for ddl in [
            "CREATE TABLE sw_backfills (catalog_name VARCHAR(255) NOT NULL, \
             job VARCHAR(255) NOT NULL, namespace VARCHAR(255) NOT NULL, job_version BIGINT NOT NULL, \
             from_us BIGINT NOT NULL, to_us BIGINT NOT NULL, lead_in_us BIGINT NOT NULL, \
             snapshot_id BIGINT, state VARCHAR(32) NOT NULL, desired VARCHAR(32) NOT NULL, \
             budgets VARCHAR(1000) NOT NULL, created_by VARCHAR(255) NOT NULL, \
             created_ms BIGINT NOT NULL, updated_ms BIGINT NOT NULL, runner VARCHAR(255), \
             heartbeat_ms BIGINT, preemptions BIGINT NOT NULL, last_decision VARCHAR(1000), \
             rate_limit BIGINT, last_error VARCHAR(2000), \
             PRIMARY KEY (catalog_name, job, namespace))",
            "CREATE TABLE sw_backfill_ranges (catalog_name VARCHAR(255) NOT NULL, \
             job VARCHAR(255) NOT NULL, namespace VARCHAR(255) NOT NULL, seq BIGINT NOT NULL, \
             from_us BIGINT NOT NULL, to_us BIGINT NOT NULL, kg_lo BIGINT NOT NULL, kg_hi BIGINT NOT NULL, \
             planned_records BIGINT NOT NULL, state VARCHAR(32) NOT NULL, records BIGINT NOT NULL, \
             bytes_read BIGINT NOT NULL, rows_written BIGINT NOT NULL, late BIGINT NOT NULL, \
             duplicates BIGINT NOT NULL, millis BIGINT NOT NULL, finished_ms BIGINT, \
             PRIMARY KEY (catalog_name, job, namespace, seq))",
            "INSERT INTO sw_backfill_ranges VALUES ('signalweave', 'j', 'n', 0, 0, 60, 0, 256, \
             10, 'pending', 0, 0, 0, 0, 0, 0, NULL)",
        ] {
            sqlx::query(ddl).execute(lake.control_pool()).await.unwrap();
        }
        let store = BackfillStore::open(lake.clone()).await.unwrap();
        let before = store.subranges("j", "n").await.unwrap();
        assert_eq!(before.len(), 1);
        assert_eq!(before[0].stages, None, "not recorded then");
        let stages = StageSeconds {
            read: 1.25,
            engine: 2.5,
            throttled: 0.0,
            commit: 0.125,
        };
        let done = SubRange {
            state: "done".into(),
            records: 10,
            seconds: 4.0,
            stages: Some(stages),
            input_watermark_us: Some(7),
            ..before[0].clone()
        };
        store.subrange_done("j", "n", &done).await.unwrap();
        // Opening again finds the columns there.
        let store = BackfillStore::open(lake).await.unwrap();
        let after = store.subranges("j", "n").await.unwrap();
        assert_eq!(after[0].stages, Some(stages));
        assert_eq!((after[0].state.as_str(), after[0].records), ("done", 10));
        assert_eq!(after[0].input_watermark_us, Some(7));
    }

    /// Two starts of one namespace race: the one whose record is refused leaves the hold
    /// of the one whose record stands where it was, and holds nothing itself.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refused_start_leaves_the_standing_backfills_hold_alone() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(signalweave_lake::LakeConfig::embedded(dir.path()))
            .await
            .unwrap();
        lake.init().await.unwrap();
        let mut pins = Vec::new();
        for seq in 1..=2 {
            let mut b = signalweave_model::EventBatchBuilder::with_capacity(10);
            let spec = signalweave_fixtures::WorkloadSpec {
                events: 10,
                seed: seq,
                ..Default::default()
            };
            for r in signalweave_fixtures::Generator::new(spec) {
                if let signalweave_fixtures::Record::Event(e) = r {
                    b.push(&e);
                }
            }
            let batch = b.finish().unwrap();
            let outcome = lake
                .append(
                    LakeTable::Events,
                    &[batch],
                    &signalweave_lake::CommitIdentity::new("landed", seq),
                )
                .await
                .unwrap();
            pins.push(outcome.snapshot_id);
        }
        let store = BackfillStore::open(lake.clone()).await.unwrap();
        let record = |snapshot_id: i64| BackfillRecord {
            job: "j".into(),
            namespace: "n".into(),
            job_version: 1,
            from_us: 0,
            to_us: 60_000_000,
            lead_in_us: 0,
            snapshot_id: Some(snapshot_id),
            snapshot_seq: None,
            state: "pending".into(),
            desired: "run".into(),
            budgets: Budgets::default(),
            exact_dedup: false,
            created_by: "test".into(),
            created_ms: 0,
            updated_ms: 0,
            runner: None,
            heartbeat_ms: None,
            preemptions: 0,
            last_decision: None,
            rate_limit: None,
            last_error: None,
        };
        insert_pinned(&lake, &store, &record(pins[0]), &[])
            .await
            .unwrap();
        let e = insert_pinned(&lake, &store, &record(pins[1]), &[])
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Conflict, "{e}");
        let holds: Vec<(String, i64)> = lake
            .snapshot_holds()
            .await
            .unwrap()
            .into_iter()
            .map(|h| (h.holder, h.snapshot_id))
            .collect();
        assert_eq!(holds, [("backfill:j:n".to_string(), pins[0])]);
    }

    #[test]
    fn slices_align_to_multiples_of_the_slice() {
        let day = 86_400_000_000;
        assert_eq!(slices(0, day, day), vec![(0, day)]);
        assert_eq!(
            slices(day / 2, 2 * day + 5, day),
            vec![(day / 2, day), (day, 2 * day), (2 * day, 2 * day + 5)]
        );
        assert!(slices(5, 5, day).is_empty());
    }

    #[test]
    fn namespaces_are_checked() {
        assert!(validate_namespace("fix_fees").is_ok());
        for bad in ["", "live", "Fix", "1a", "a-b", &"a".repeat(49)] {
            assert_eq!(
                validate_namespace(bad).map_err(|e| e.kind()),
                Err(ErrorKind::InvalidInput),
                "{bad}"
            );
        }
    }
}
