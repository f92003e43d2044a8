//! `reconcile`: every window of a job recomputed from the landing table by an independent
//! oracle in DataFusion SQL, compared with the job's current output versions, and every
//! event of the range accounted for.
//!
//! The oracle shares no code with the window engine. It reads `signalweave.events` at one
//! snapshot, with the commit order of every row (the sequence number of the commit that
//! landed it: its data file's, or the one a compaction kept in the row's lineage), and
//! applies the job's rules as the documentation states them:
//! - **Arrival watermark.** A record is judged by the watermark a reader tailing the table
//!   had when the record arrived: the largest event time of the job's records committed
//!   before its own (in commit order, the sequence number, as the job reads them; ingest
//!   times order nothing), minus the out-of-orderness bound.
//! - **Lateness.** A record older than the dedup horizon at arrival is late; otherwise a
//!   record whose every window has ended more than the allowed lateness before the
//!   watermark is late. A record with a null key is late (`null_key`).
//! - **Dedup.** Among the copies of `(tenant, event_id)` that are not late by the horizon,
//!   the first to arrive counts (or is late by its window); the others are duplicates of it.
//! - **Windows.** Tumbling and sliding windows, each counted record adding to every window
//!   it belongs to that had not retired when it arrived.
//!
//! The comparison reads the output table's own rows (the highest `output_version` of each
//! identity), not the promoted `<table>_current` view, so a namespace is reconciled
//! against its own late records.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch};
use arrow::datatypes::{DataType, Float64Type, Int64Type};
use datafusion::prelude::SessionContext;
use serde::Serialize;
use signalweave_lake::{
    COMMIT_ORDER, Lake, LakeTable, LakeTableProvider, NAMESPACE, SQL_CATALOG, SnapshotChoice,
};
use signalweave_model::ErrorKind;
use signalweave_window::{AggregateFunction, JobSpec, WindowSpec, micros};

use crate::error::{AuditError, Result};

/// What to reconcile.
#[derive(Debug, Clone)]
pub struct ReconcileRequest {
    /// The job version that wrote the outputs.
    pub spec: Arc<JobSpec>,
    /// The output namespace (`live`, or a backfill's).
    pub namespace: String,
    /// The output table of that namespace.
    pub output: LakeTable,
    /// Event-time range `[from, to)`, µs. `from` is aligned down to the window slide.
    pub from_us: i64,
    /// End of the range, µs.
    pub to_us: i64,
    /// How many entries of each list the report keeps (differences, duplicates, late
    /// discrepancies); the counts are always complete.
    pub list_limit: usize,
    /// The snapshot of the landing table the outputs were computed from (a backfill's
    /// pin); None: the current one.
    pub events_snapshot: Option<i64>,
}

/// One kind of finding: the oracle and the outputs disagree, or an event is unaccounted.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Finding {
    /// `window_mismatch`, `window_missing`, `window_extra`, `window_not_final`,
    /// `version_repeated`, `late_not_routed`, `routed_late_but_counted`, `no_outputs`,
    /// `unaccounted_events`.
    pub kind: String,
    /// How many.
    pub count: u64,
    /// What it means.
    pub detail: String,
}

/// Window comparison figures.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct WindowFigures {
    /// Windows of the range on either side.
    pub compared: u64,
    /// Current version equals the oracle.
    pub matched: u64,
    /// Values differ.
    pub mismatched: u64,
    /// In the oracle only (closed windows).
    pub missing: u64,
    /// In the outputs only (closed windows).
    pub extra: u64,
    /// Not final yet: the job's watermark has not passed the window's end, or a backfill
    /// wrote it `partial` (beyond the range's end, or the watermark of the snapshot the
    /// sub-range read, which may be below the table's if the backfill moved to a newer
    /// snapshot). Differences there are not findings.
    pub pending: u64,
    /// Closed (the job's watermark passed the window's end), yet the current version is
    /// `provisional`: the job emits the final version in the fire that passes the end, so
    /// it is missing (a lost commit), whatever its values.
    pub not_final: u64,
    /// Output versions of the range written more than once, counted per (identity,
    /// version) (a committed version has one row; a replay must be skipped, not appended
    /// again).
    pub versions_repeated: u64,
}

/// A window where the outputs and the oracle differ.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct WindowDifference {
    /// Key.
    pub key: String,
    /// Window start (RFC 3339).
    pub window_start: String,
    /// Window end (RFC 3339).
    pub window_end: String,
    /// `mismatched`, `missing`, `extra` or `not_final`.
    pub status: String,
    /// Current output version (None when missing).
    pub output_version: Option<i64>,
    /// Completeness of the current version.
    pub completeness: Option<String>,
    /// Per differing column: (column, output value, oracle value).
    pub columns: Vec<(String, Option<f64>, Option<f64>)>,
}

/// Where every event received in the range went. `received` = `landed` + `rejected`;
/// `landed` = `counted` + `pending` + `duplicates` + `late` + `out_of_scope` + `unaccounted`.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Accounting {
    /// Landed copies and rejected records.
    pub received: u64,
    /// Copies in `signalweave.events` with event time in the range.
    pub landed: u64,
    /// Counted in an output window that equals the oracle.
    pub counted: u64,
    /// Counted in a window that is not final yet (open or partial).
    pub pending: u64,
    /// Later copies of an identity, each paired with its twin.
    pub duplicates: u64,
    /// Late beyond allowed lateness (or with a null key), and present in `late_events`.
    pub late: u64,
    /// Of event types the job does not read.
    pub out_of_scope: u64,
    /// Counted by the oracle in a window whose output differs, or late by the oracle but
    /// missing from `late_events`.
    pub unaccounted: u64,
    /// Records rejected at the gateway or by a load, received in the range.
    pub rejected: u64,
    /// Rejections by reason code.
    pub rejected_by_reason: BTreeMap<String, u64>,
    /// The rejections counted were received between these times (RFC 3339): the first
    /// and last ingest time of the range's events.
    pub rejections_received: Option<(String, String)>,
    /// Whether every landed event is accounted for (the sum holds and nothing is
    /// unaccounted).
    pub balanced: bool,
}

/// A duplicate and the copy it repeats.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct DuplicatePair {
    /// Tenant.
    pub tenant: String,
    /// Event id.
    pub event_id: String,
    /// Ingest time of the copy that counts (RFC 3339).
    pub twin_ingest_time: String,
    /// Ingest time of the duplicate.
    pub duplicate_ingest_time: String,
}

/// A late event the oracle and `late_events` disagree on.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct LateDiscrepancy {
    /// Tenant.
    pub tenant: String,
    /// Event id.
    pub event_id: String,
    /// Event time (RFC 3339).
    pub event_time: String,
    /// Ingest time (RFC 3339).
    pub ingest_time: String,
    /// What the oracle says of it (`counted`, `duplicate`, `late_horizon`, ...).
    pub oracle_class: String,
}

/// Late records: the oracle's against `late_events`.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct LateCheck {
    /// Late by the oracle.
    pub oracle_late: u64,
    /// In `late_events` for the job and namespace.
    pub routed_late: u64,
    /// Late by the oracle, not in `late_events`.
    pub not_routed: Vec<LateDiscrepancy>,
    /// Count of `not_routed` (the list may be cut).
    pub not_routed_count: u64,
    /// In `late_events`, but the oracle does not find them late.
    pub routed_but_counted: Vec<LateDiscrepancy>,
    /// Count of `routed_but_counted`.
    pub routed_but_counted_count: u64,
}

/// One output version of a window.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct VersionEntry {
    /// `output_version`.
    pub version: i64,
    /// `provisional`, `on_time`, `corrected`, `partial`.
    pub completeness: String,
    /// Whether it withdraws the window.
    pub retracted: bool,
    /// When it was emitted (RFC 3339).
    pub emitted_at: String,
    /// The job's watermark at emission (RFC 3339).
    pub watermark: String,
    /// Records counted.
    pub events: i64,
    /// The snapshot of `signalweave.events` it reflects.
    pub input_snapshot: Option<i64>,
}

/// The version history of one window.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct WindowHistory {
    /// Key.
    pub key: String,
    /// Window start (RFC 3339).
    pub window_start: String,
    /// Versions, in order.
    pub versions: Vec<VersionEntry>,
}

/// Quantiles of one freshness stage, seconds.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct StageFigures {
    /// Stage name.
    pub stage: String,
    /// Events measured.
    pub samples: u64,
    /// Median.
    pub p50_s: f64,
    /// 90th percentile.
    pub p90_s: f64,
    /// 99th percentile.
    pub p99_s: f64,
    /// Largest.
    pub max_s: f64,
}

/// Figures of one time bucket (event time).
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Bucket {
    /// Bucket start (RFC 3339).
    pub start: String,
    /// Counted by the oracle.
    pub counted: u64,
    /// Late by the oracle.
    pub late: u64,
    /// In `late_events`.
    pub routed_late: u64,
    /// Duplicates.
    pub duplicates: u64,
    /// Windows starting in the bucket that differ (mismatched, missing, extra).
    pub differing_windows: u64,
}

/// The oracle's rule, as applied.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct OracleRule {
    /// Window definition.
    pub window: String,
    /// Out-of-orderness bound, s.
    pub out_of_orderness_s: f64,
    /// Allowed lateness, s.
    pub allowed_lateness_s: f64,
    /// Dedup horizon, s.
    pub dedup_horizon_s: f64,
    /// Event types the job reads (empty: all).
    pub event_types: Vec<String>,
    /// Snapshot of `signalweave.events` read.
    pub events_snapshot: Option<i64>,
}

/// The reconciliation report.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Report {
    /// Job.
    pub job: String,
    /// Job version of the spec reconciled.
    pub job_version: u32,
    /// Namespace.
    pub namespace: String,
    /// Output table.
    pub output_table: String,
    /// Range start (RFC 3339).
    pub from: String,
    /// Range end (RFC 3339).
    pub to: String,
    /// When the report was made (RFC 3339).
    pub generated_at: String,
    /// The oracle's rule.
    pub rule: OracleRule,
    /// True when there is no finding.
    pub matches: bool,
    /// Findings (empty when the outputs match the oracle and everything is accounted).
    pub findings: Vec<Finding>,
    /// Window comparison.
    pub windows: WindowFigures,
    /// Differing windows (cut at the list limit).
    pub differences: Vec<WindowDifference>,
    /// Where every event went.
    pub accounting: Accounting,
    /// Duplicates with their twins (cut at the list limit).
    pub duplicates: Vec<DuplicatePair>,
    /// Late records.
    pub late: LateCheck,
    /// The job's largest watermark in the output table (RFC 3339).
    pub job_watermark: Option<String>,
    /// Version history of every window of the range.
    pub versions: Vec<WindowHistory>,
    /// Freshness of counted events by stage (from the tables).
    pub freshness: Vec<StageFigures>,
    /// Figures per bucket of event time.
    pub timeline: Vec<Bucket>,
    /// Bucket width, s.
    pub bucket_s: i64,
}

/// What a report concludes, in a word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The final outputs equal the oracle and every event is accounted for.
    Match,
    /// No window of the range is final, so none was compared; every event is accounted
    /// for.
    NothingFinal,
    /// See the findings.
    Mismatch,
}

impl Report {
    /// The report's verdict.
    pub fn verdict(&self) -> Verdict {
        match (self.matches, self.windows.matched) {
            (false, _) => Verdict::Mismatch,
            (true, 0) => Verdict::NothingFinal,
            (true, _) => Verdict::Match,
        }
    }
}

/// RFC 3339 of a µs timestamp.
pub fn rfc3339(us: i64) -> String {
    chrono::DateTime::from_timestamp_micros(us)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true))
        .unwrap_or_else(|| us.to_string())
}

fn ts_literal(us: i64) -> String {
    format!("TIMESTAMP '{}'", rfc3339(us))
}

fn quote(s: &str) -> String {
    s.replace('\'', "''")
}

fn ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// Figure `i` of a one-row answer, as a count (0 when absent or negative).
fn figure(v: &[i64], i: usize) -> u64 {
    v.get(i).copied().unwrap_or(0).max(0) as u64
}

/// A column of `batch` as Utf8 values.
fn strings(batch: &RecordBatch, i: usize) -> Result<Vec<Option<String>>> {
    let c = arrow::compute::cast(batch.column(i), &DataType::Utf8)
        .map_err(|e| AuditError::new(ErrorKind::Internal, format!("cast: {e}")))?;
    let c = c.as_string::<i32>();
    Ok((0..c.len())
        .map(|r| (!c.is_null(r)).then(|| c.value(r).to_string()))
        .collect())
}

fn ints(batch: &RecordBatch, i: usize) -> Result<Vec<Option<i64>>> {
    let c: ArrayRef = arrow::compute::cast(batch.column(i), &DataType::Int64)
        .map_err(|e| AuditError::new(ErrorKind::Internal, format!("cast: {e}")))?;
    let c = c.as_primitive::<Int64Type>();
    Ok((0..c.len())
        .map(|r| (!c.is_null(r)).then(|| c.value(r)))
        .collect())
}

fn floats(batch: &RecordBatch, i: usize) -> Result<Vec<Option<f64>>> {
    let c: ArrayRef = arrow::compute::cast(batch.column(i), &DataType::Float64)
        .map_err(|e| AuditError::new(ErrorKind::Internal, format!("cast: {e}")))?;
    let c = c.as_primitive::<Float64Type>();
    Ok((0..c.len())
        .map(|r| (!c.is_null(r)).then(|| c.value(r)))
        .collect())
}

async fn run(ctx: &SessionContext, what: &str, sql: &str) -> Result<Vec<RecordBatch>> {
    let started = std::time::Instant::now();
    let batches = ctx
        .sql(sql)
        .await
        .map_err(|e| AuditError::datafusion(what, e))?
        .collect()
        .await
        .map_err(|e| AuditError::datafusion(what, e))?;
    tracing::debug!(
        step = what,
        ms = started.elapsed().as_millis(),
        "reconcile step"
    );
    Ok(batches)
}

/// The single row of a query as integers (0 for nulls).
async fn one_row(ctx: &SessionContext, what: &str, sql: &str) -> Result<Vec<i64>> {
    let batches = run(ctx, what, sql).await?;
    let Some(b) = batches.iter().find(|b| b.num_rows() > 0) else {
        return Ok(Vec::new());
    };
    (0..b.num_columns())
        .map(|i| Ok(ints(b, i)?[0].unwrap_or(0)))
        .collect()
}

/// The parts of the SQL that depend on the job.
struct Rules {
    size: i64,
    slide: i64,
    /// Session windows: the gap (then `size` is the gap and `slide` 1 µs).
    gap: Option<i64>,
    bound: i64,
    lateness: i64,
    horizon: i64,
    types: Vec<String>,
}

impl Rules {
    fn of(spec: &JobSpec) -> Result<Self> {
        // What the oracle does not model, it refuses, rather than report findings against
        // a correct job (or none against a wrong one).
        let unmodelled = [
            (
                spec.dedup.identity != ["tenant", "event_id"],
                "a dedup identity other than (tenant, event_id)",
            ),
            (
                spec.time.event_time_column != "event_time",
                "an event time column other than `event_time`",
            ),
            (
                spec.time.input_column.is_some(),
                "per-input watermarks (`time.input_column`): the job's watermark is the least \
                 over the active inputs, with an idleness timeout in processing time, which the \
                 lake does not record",
            ),
        ];
        if let Some((_, what)) = unmodelled.iter().find(|(unmodelled, _)| *unmodelled) {
            return Err(AuditError::new(
                ErrorKind::Config,
                format!(
                    "{} cannot be reconciled: the oracle does not model {what}",
                    spec.name
                ),
            ));
        }
        let (size, slide, gap) = match spec.window {
            WindowSpec::Tumbling { size } => (micros(size), micros(size), None),
            WindowSpec::Sliding { size, slide } => (micros(size), micros(slide), None),
            WindowSpec::Session { gap } => (micros(gap), 1, Some(micros(gap))),
        };
        Ok(Self {
            size,
            slide,
            gap,
            bound: micros(spec.time.max_out_of_orderness),
            lateness: micros(spec.lateness.allowed),
            horizon: spec.dedup_horizon_us(),
            types: spec.source.event_types.clone(),
        })
    }

    /// SQL: true when the row is of a type the job reads.
    fn in_scope(&self) -> String {
        if self.types.is_empty() {
            "TRUE".into()
        } else {
            let list: Vec<String> = self
                .types
                .iter()
                .map(|t| format!("'{}'", quote(t)))
                .collect();
            format!("(event_type IN ({}))", list.join(", "))
        }
    }

    /// SQL: the start of the latest window containing `t` (µs column).
    fn last_start(&self, t: &str) -> String {
        let s = self.slide;
        format!("({t} - ((({t} % {s}) + {s}) % {s}))")
    }

    /// Windows each record belongs to.
    fn per_record(&self) -> i64 {
        (self.size / self.slide).max(1)
    }
}

/// The key expression of the engine: key columns joined with `|`, `|` and `\` escaped.
fn key_sql(spec: &JobSpec) -> String {
    if spec.key.columns.len() == 1 {
        return format!("CAST({} AS VARCHAR)", ident(&spec.key.columns[0]));
    }
    let parts: Vec<String> = spec
        .key
        .columns
        .iter()
        .map(|c| {
            format!(
                "replace(replace(CAST({} AS VARCHAR), '\\', '\\\\'), '|', '\\|')",
                ident(c)
            )
        })
        .collect();
    let nulls: Vec<String> = spec
        .key
        .columns
        .iter()
        .map(|c| format!("{} IS NULL", ident(c)))
        .collect();
    format!(
        "CASE WHEN {} THEN NULL ELSE concat_ws('|', {}) END",
        nulls.join(" OR "),
        parts.join(", ")
    )
}

/// Reconciles one job's outputs over a range (see the module documentation).
pub async fn reconcile(lake: &Lake, request: &ReconcileRequest) -> Result<Report> {
    let spec = &request.spec;
    let rules = Rules::of(spec)?;
    if request.to_us <= request.from_us {
        return Err(AuditError::new(
            ErrorKind::InvalidInput,
            "the range is empty: --to must be after --from",
        ));
    }
    let from = request.from_us - request.from_us.rem_euclid(rules.slide);
    let to = request.to_us;
    let ctx = lake.session_context().await?;
    // The oracle reads one snapshot of the landing table, with each row's commit order:
    // the one the outputs were computed from, when known.
    let events_snapshot = match request.events_snapshot {
        Some(id) => Some(id),
        None => lake
            .snapshots(LakeTable::Events)
            .await?
            .last()
            .map(|s| s.snapshot_id),
    };
    let choice = match events_snapshot {
        Some(id) => SnapshotChoice::At(id),
        None => SnapshotChoice::Empty,
    };
    ctx.register_table(
        datafusion::sql::TableReference::full(SQL_CATALOG, NAMESPACE, "audit_events"),
        Arc::new(
            LakeTableProvider::new(lake.clone(), LakeTable::Events, choice).with_commit_sequence(),
        ),
    )
    .map_err(|e| AuditError::datafusion("register audit_events", e))?;
    let out = request.output.name();
    // A job that has never committed has no output table yet: it reads as empty (and its
    // windows are then a finding, below), not as an error.
    if let Err(e) = lake.table(request.output).await {
        if e.kind() != ErrorKind::NotFound {
            return Err(e.into());
        }
        let empty = datafusion::datasource::MemTable::try_new(
            request.output.arrow_schema(),
            vec![Vec::new()],
        )
        .map_err(|e| AuditError::datafusion("an empty output table", e))?;
        ctx.register_table(
            datafusion::sql::TableReference::full(SQL_CATALOG, NAMESPACE, out),
            Arc::new(empty),
        )
        .map_err(|e| AuditError::datafusion("register the empty output table", e))?;
    }
    let job = quote(&spec.name);
    let ns = quote(&request.namespace);
    let in_scope = rules.in_scope();
    // Each row's commit, kept through compactions (see `COMMIT_ORDER`).
    let seq = COMMIT_ORDER;
    // Pane windows starting before `to` end by `to + size`. A session starting in the
    // range can last any time, and whether it starts in the range depends on the record
    // before `from` (within a gap it continues an earlier session). Every other copy of an
    // identity read is read too, whatever its event time: whether a copy counts depends
    // on the copies before it (a chain of copies each stamped anew), for dedup only.
    // Copies read for dedup only are marked `extra`, and sessions leave them out: the
    // sessions are formed from the records read in one piece, from a dedup horizon (and
    // the out-of-orderness bound) before `from`, so that the sessions a record before
    // `from` meets at its arrival are there to judge it.
    let (read_from, read_end) = match rules.gap {
        None => (from, Some(to.saturating_add(rules.size))),
        Some(gap) => (
            from.saturating_sub(gap.max(rules.horizon.saturating_add(rules.bound))),
            None,
        ),
    };
    let within = |column: &str| {
        format!(
            "{column} >= {}{}",
            ts_literal(read_from),
            read_end
                .map(|e| format!(" AND {column} < {}", ts_literal(e)))
                .unwrap_or_default()
        )
    };
    let agg_columns: Vec<String> = {
        let mut c: Vec<String> = spec
            .aggregates
            .iter()
            .filter_map(|a| a.column.clone())
            .collect();
        c.sort();
        c.dedup();
        c
    };
    let agg_select: String = agg_columns
        .iter()
        .map(|c| format!(", {}", ident(c)))
        .collect();

    // 1. Commits: the largest ingest time and largest event time of the job's records.
    run(
        &ctx,
        "oracle commits",
        &format!(
            "CREATE TABLE audit_commits AS SELECT {seq} AS seq, \
             max(CAST(event_time AS BIGINT)) AS max_t \
             FROM audit_events WHERE {in_scope} GROUP BY {seq}"
        ),
    )
    .await?;
    // 2. The records of the range (and of the windows starting in it). `rid` numbers
    // them in arrival order, so the first copy of an identity is its smallest `rid`.
    run(
        &ctx,
        "oracle records",
        &format!(
            "CREATE TABLE audit_records AS SELECT \
             row_number() OVER (ORDER BY {seq}, CAST(ingest_time AS BIGINT), tenant, event_id) AS rid, \
             CAST(tenant AS VARCHAR) AS tenant, CAST(event_id AS VARCHAR) AS event_id, \
             CAST(event_type AS VARCHAR) AS event_type, CAST(event_time AS BIGINT) AS t, \
             CAST(ingest_time AS BIGINT) AS ingest, {seq} AS seq, {key} AS key, {in_scope} AS in_scope, \
             extra{agg_select} \
             FROM (SELECT *, FALSE AS extra FROM audit_events WHERE {within} \
                   UNION ALL \
                   SELECT e.*, TRUE AS extra FROM audit_events e \
                   JOIN (SELECT DISTINCT tenant AS c_tenant, event_id AS c_event_id FROM audit_events WHERE {within}) c \
                   ON e.tenant = c.c_tenant AND e.event_id = c.c_event_id \
                   WHERE NOT ({within_e})) r",
            key = key_sql(spec),
            within = within("event_time"),
            within_e = within("e.event_time"),
        ),
    )
    .await?;
    // 3. The watermark at each record's arrival: the running maximum over the commits
    // ordered before it (records sort before a commit with the same order key).
    run(
        &ctx,
        "oracle watermarks",
        &format!(
            "CREATE TABLE audit_wm AS SELECT rid, m - {bound} AS wm FROM ( \
               SELECT rid, kind, max(v) OVER (ORDER BY seq, kind ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS m FROM ( \
                 SELECT CAST(NULL AS BIGINT) AS rid, seq, 1 AS kind, max_t AS v FROM audit_commits \
                 UNION ALL \
                 SELECT rid, seq, 0 AS kind, CAST(NULL AS BIGINT) AS v FROM audit_records WHERE in_scope \
               ) u \
             ) w WHERE kind = 0",
            bound = rules.bound,
        ),
    )
    .await?;
    // 4. Classification. Pane windows: a first copy is late when its latest window had
    // retired at its arrival. Sessions: the first copies are replayed in arrival order
    // against the sessions they would merge with (see `session_late`).
    let first_class = match rules.gap {
        None => format!(
            "CASE WHEN wm IS NOT NULL AND wm >= ({} + {}) + {} THEN 'late_window' ELSE 'counted' END",
            rules.last_start("t"),
            rules.size,
            rules.lateness
        ),
        Some(_) => "'first'".to_string(),
    };
    run(
        &ctx,
        "oracle pre-classification",
        &format!(
            "CREATE TABLE audit_h AS \
             WITH j AS (SELECT r.*, w.wm FROM audit_records r LEFT JOIN audit_wm w ON r.rid = w.rid) \
             SELECT *, CASE WHEN NOT in_scope THEN 'out_of_scope' \
                   WHEN key IS NULL THEN 'null_key' \
                   WHEN wm IS NOT NULL AND t + {horizon} <= wm THEN 'late_horizon' \
                   ELSE 'candidate' END AS pre FROM j",
            horizon = rules.horizon,
        ),
    )
    .await?;
    // Dedup: the copies of identities seen more than once, replayed in arrival order
    // (see `dedup_twins`).
    let copies = run(
        &ctx,
        "copies",
        "SELECT h.rid, h.tenant, h.event_id, h.t, h.wm FROM audit_h h \
         JOIN (SELECT tenant, event_id FROM audit_h WHERE pre = 'candidate' \
               GROUP BY tenant, event_id HAVING count(*) > 1) m \
         ON h.tenant = m.tenant AND h.event_id = m.event_id \
         WHERE h.pre = 'candidate' ORDER BY h.rid",
    )
    .await?;
    let mut rows = Vec::new();
    for b in &copies {
        let (rid, tenant, id, t, wm) = (
            ints(b, 0)?,
            strings(b, 1)?,
            strings(b, 2)?,
            ints(b, 3)?,
            ints(b, 4)?,
        );
        for r in 0..b.num_rows() {
            rows.push(CopySeen {
                rid: rid[r].unwrap_or(0),
                identity: (tenant[r].clone(), id[r].clone()),
                t: t[r].unwrap_or(0),
                wm: wm[r],
            });
        }
    }
    let twins = dedup_twins(rows, rules.horizon);
    let twin_schema = Arc::new(arrow::datatypes::Schema::new(vec![
        arrow::datatypes::Field::new("d_rid", DataType::Int64, false),
        arrow::datatypes::Field::new("twin", DataType::Int64, false),
    ]));
    let twin_batch = RecordBatch::try_new(
        Arc::clone(&twin_schema),
        vec![
            Arc::new(arrow::array::Int64Array::from_iter_values(
                twins.iter().map(|(d, _)| *d),
            )),
            Arc::new(arrow::array::Int64Array::from_iter_values(
                twins.iter().map(|(_, t)| *t),
            )),
        ],
    )
    .map_err(|e| AuditError::new(ErrorKind::Internal, format!("twins: {e}")))?;
    ctx.register_table(
        "audit_twins",
        Arc::new(
            datafusion::datasource::MemTable::try_new(twin_schema, vec![vec![twin_batch]])
                .map_err(|e| AuditError::datafusion("twins", e))?,
        ),
    )
    .map_err(|e| AuditError::datafusion("register twins", e))?;
    run(
        &ctx,
        "oracle classification",
        &format!(
            "CREATE TABLE audit_pre AS SELECT h.*, tw.twin, \
             CASE WHEN h.pre <> 'candidate' THEN h.pre \
                  WHEN tw.twin IS NOT NULL THEN 'duplicate' \
                  ELSE {first_class} END AS class0 \
             FROM audit_h h LEFT JOIN audit_twins tw ON h.rid = tw.d_rid"
        ),
    )
    .await?;
    let late_rids = match rules.gap {
        None => Vec::new(),
        Some(gap) => {
            let batches = run(
                &ctx,
                "session arrivals",
                "SELECT rid, key, t, wm FROM audit_pre WHERE class0 = 'first' AND NOT extra \
                 ORDER BY rid",
            )
            .await?;
            let mut rows = Vec::new();
            for b in &batches {
                let (rid, key, t, wm) = (ints(b, 0)?, strings(b, 1)?, ints(b, 2)?, ints(b, 3)?);
                for r in 0..b.num_rows() {
                    rows.push((
                        rid[r].unwrap_or(0),
                        key[r].clone().unwrap_or_default(),
                        t[r].unwrap_or(0),
                        wm[r],
                    ));
                }
            }
            session_late(rows, gap, rules.lateness)
        }
    };
    let late_schema = Arc::new(arrow::datatypes::Schema::new(vec![
        arrow::datatypes::Field::new("rid", DataType::Int64, false),
    ]));
    let late_batch = RecordBatch::try_new(
        Arc::clone(&late_schema),
        vec![Arc::new(arrow::array::Int64Array::from(late_rids))],
    )
    .map_err(|e| AuditError::new(ErrorKind::Internal, format!("late rids: {e}")))?;
    ctx.register_table(
        "audit_session_late",
        Arc::new(
            datafusion::datasource::MemTable::try_new(late_schema, vec![vec![late_batch]])
                .map_err(|e| AuditError::datafusion("late rids", e))?,
        ),
    )
    .map_err(|e| AuditError::datafusion("register late rids", e))?;
    run(
        &ctx,
        "classes",
        "CREATE TABLE audit_classified AS SELECT p.*, \
         CASE WHEN p.class0 = 'first' AND l.rid IS NOT NULL THEN 'late_window' \
              WHEN p.class0 = 'first' THEN 'counted' ELSE p.class0 END AS class \
         FROM audit_pre p LEFT JOIN audit_session_late l ON p.rid = l.rid",
    )
    .await?;
    // 5. The oracle's windows: each counted record in every window it belongs to that had
    // not retired when it arrived.
    let ws_expr = format!("({} - g.j * {})", rules.last_start("c.t"), rules.slide);
    let mut aggs = Vec::new();
    for a in &spec.aggregates {
        let cond = a
            .event_type
            .as_deref()
            .map(|t| format!("event_type = '{}'", quote(t)))
            .unwrap_or_else(|| "TRUE".into());
        let col = a.column.as_deref().map(ident).unwrap_or_else(|| "1".into());
        let expr = match a.function {
            AggregateFunction::Count => {
                format!("CAST(count(CASE WHEN {cond} THEN {col} END) AS BIGINT)")
            }
            // Exact: a sum past the range of a 64-bit integer is a sum the outputs cannot
            // hold, and the comparison says so (the engine's sums wrap, as DataFusion's
            // would in BIGINT, so both sides would agree on the wrong figure).
            AggregateFunction::Sum => {
                format!("sum(CASE WHEN {cond} THEN CAST({col} AS DECIMAL(38, 0)) END)")
            }
            AggregateFunction::Min => {
                format!("CAST(min(CASE WHEN {cond} THEN {col} END) AS BIGINT)")
            }
            AggregateFunction::Max => {
                format!("CAST(max(CASE WHEN {cond} THEN {col} END) AS BIGINT)")
            }
            AggregateFunction::Avg => {
                format!("avg(CASE WHEN {cond} THEN CAST({col} AS DOUBLE) END)")
            }
        };
        aggs.push(format!("{expr} AS {}", ident(&a.name)));
    }
    let agg_list = if aggs.is_empty() {
        String::new()
    } else {
        format!(", {}", aggs.join(", "))
    };
    let membership = match rules.gap {
        None => format!(
            "SELECT c.rid, c.key, {ws_expr} AS ws, {ws_expr} + {size} AS we FROM audit_classified c \
             CROSS JOIN (SELECT value AS j FROM generate_series(0, {last})) g \
             WHERE c.class = 'counted' AND (c.wm IS NULL OR c.wm < {ws_expr} + {size} + {lateness})",
            size = rules.size,
            lateness = rules.lateness,
            last = rules.per_record() - 1,
        ),
        // Gaps and islands: a record opens a session when the key's previous counted
        // record is a gap or more before it.
        Some(gap) => format!(
            "WITH o AS (SELECT rid, key, t, CASE WHEN lag(t) OVER (PARTITION BY key ORDER BY t, rid) IS NULL \
                    OR t - lag(t) OVER (PARTITION BY key ORDER BY t, rid) >= {gap} THEN 1 ELSE 0 END AS brk \
                    FROM audit_classified WHERE class = 'counted' AND NOT extra), \
                  s AS (SELECT rid, key, t, sum(brk) OVER (PARTITION BY key ORDER BY t, rid \
                    ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS sid FROM o) \
             SELECT rid, key, min(t) OVER (PARTITION BY key, sid) AS ws, \
                    max(t) OVER (PARTITION BY key, sid) + {gap} AS we FROM s"
        ),
    };
    run(
        &ctx,
        "window membership",
        &format!("CREATE TABLE audit_membership AS {membership}"),
    )
    .await?;
    run(
        &ctx,
        "oracle windows",
        &format!(
            "CREATE TABLE audit_oracle AS SELECT m.key, m.ws, m.we, CAST(count(*) AS BIGINT) AS events{agg_list} \
             FROM audit_membership m JOIN audit_classified c ON c.rid = m.rid \
             WHERE m.ws >= {from} AND m.ws < {to} GROUP BY m.key, m.ws, m.we"
        ),
    )
    .await?;
    // 6. The outputs' current versions.
    let out_aggs: String = spec
        .aggregates
        .iter()
        .map(|a| format!(", {}", ident(&a.name)))
        .collect();
    run(
        &ctx,
        "current outputs",
        &format!(
            "CREATE TABLE audit_current AS SELECT CAST(key AS VARCHAR) AS key, CAST(window_start AS BIGINT) AS ws, \
             CAST(window_end AS BIGINT) AS we, output_version, CAST(completeness AS VARCHAR) AS completeness, \
             retracted, events{out_aggs} FROM ( \
               SELECT *, row_number() OVER (PARTITION BY key, window_start, window_end ORDER BY output_version DESC) AS rn \
               FROM {SQL_CATALOG}.{NAMESPACE}.{out} WHERE window_start >= {from_ts} AND window_start < {to_ts}) v \
             WHERE rn = 1 AND NOT retracted",
            from_ts = ts_literal(from),
            to_ts = ts_literal(to),
        ),
    )
    .await?;
    let job_wm = one_row(
        &ctx,
        "job watermark",
        &format!(
            "SELECT max(CAST(watermark AS BIGINT)) AS wm, count(*) AS n FROM {SQL_CATALOG}.{NAMESPACE}.{out}"
        ),
    )
    .await?;
    let job_watermark = match job_wm.as_slice() {
        [wm, n, ..] if *n > 0 => Some(*wm),
        _ => None,
    };
    // With no output at all, the job's progress is unknown and every window would be
    // pending: a job that wrote nothing would read as NOTHING FINAL. The oracle's windows
    // that a job having read the events would have closed (by the watermark of the
    // largest event time read, less the bound) are a finding of their own. Those still
    // open are pending, as a job that emits only on time has written nothing for them.
    let silent = match job_watermark {
        Some(_) => 0,
        None => figure(
            &one_row(
                &ctx,
                "oracle windows closed by the events",
                &format!(
                    "SELECT count(*) FROM audit_oracle WHERE we <= \
                     (SELECT max(t) FROM audit_classified WHERE class <> 'out_of_scope') - {bound}",
                    bound = rules.bound
                ),
            )
            .await?,
            0,
        ),
    };
    // 7. Comparison.
    let mut same = vec!["o.we = r.we".to_string(), "o.events = r.events".to_string()];
    for a in &spec.aggregates {
        let n = ident(&a.name);
        if a.function == AggregateFunction::Avg {
            same.push(format!(
                "((o.{n} IS NULL AND r.{n} IS NULL) OR abs(o.{n} - r.{n}) <= 1e-9 * greatest(1.0, abs(r.{n})))"
            ));
        } else {
            same.push(format!("(o.{n} IS NOT DISTINCT FROM r.{n})"));
        }
    }
    let same = same.join(" AND ");
    let open_after = job_watermark.unwrap_or(i64::MIN);
    let pairs: String = std::iter::once(
        "o.we AS o_window_end, r.we AS r_window_end, o.events AS o_events, r.events AS r_events"
            .to_string(),
    )
    .chain(spec.aggregates.iter().map(|a| {
        let n = ident(&a.name);
        format!(
            "o.{n} AS \"o_{0}\", r.{n} AS \"r_{0}\"",
            a.name.replace('"', "")
        )
    }))
    .collect::<Vec<_>>()
    .join(", ");
    run(
        &ctx,
        "comparison",
        &format!(
            "CREATE TABLE audit_status AS SELECT coalesce(o.key, r.key) AS key, coalesce(o.ws, r.ws) AS ws, \
             coalesce(o.we, r.we) AS we, o.output_version, o.completeness, {pairs}, \
             CASE WHEN coalesce(o.we, r.we) > {open_after} OR o.completeness = 'partial' THEN 'pending' \
                  WHEN o.completeness = 'provisional' THEN 'not_final' \
                  WHEN o.key IS NOT NULL AND r.key IS NOT NULL AND {same} THEN 'matched' \
                  WHEN o.key IS NULL THEN 'missing' \
                  WHEN r.key IS NULL THEN 'extra' \
                  ELSE 'mismatched' END AS status \
             FROM audit_current o FULL OUTER JOIN audit_oracle r ON o.key = r.key AND o.ws = r.ws"
        ),
    )
    .await?;
    let w = one_row(
        &ctx,
        "window figures",
        "SELECT count(*), \
         sum(CASE WHEN status = 'matched' THEN 1 ELSE 0 END), \
         sum(CASE WHEN status = 'mismatched' THEN 1 ELSE 0 END), \
         sum(CASE WHEN status = 'missing' THEN 1 ELSE 0 END), \
         sum(CASE WHEN status = 'extra' THEN 1 ELSE 0 END), \
         sum(CASE WHEN status = 'pending' THEN 1 ELSE 0 END), \
         sum(CASE WHEN status = 'not_final' THEN 1 ELSE 0 END) FROM audit_status",
    )
    .await?;
    let repeated = one_row(
        &ctx,
        "repeated versions",
        &format!(
            "SELECT count(*) FROM (SELECT key, window_start, window_end FROM {SQL_CATALOG}.{NAMESPACE}.{out} \
             WHERE window_start >= {from_ts} AND window_start < {to_ts} \
             GROUP BY key, window_start, window_end, output_version HAVING count(*) > 1) x",
            from_ts = ts_literal(from),
            to_ts = ts_literal(to),
        ),
    )
    .await?;
    let windows = WindowFigures {
        compared: figure(&w, 0),
        matched: figure(&w, 1),
        mismatched: figure(&w, 2),
        missing: figure(&w, 3),
        extra: figure(&w, 4),
        pending: figure(&w, 5),
        not_final: figure(&w, 6),
        versions_repeated: figure(&repeated, 0),
    };
    let differences = differences(&ctx, spec, request.list_limit).await?;

    // 8. Accounting of the records with event time in the range.
    let in_range = format!("t >= {from} AND t < {to}");
    let classes = run(
        &ctx,
        "classes",
        &format!("SELECT class, count(*) FROM audit_classified WHERE {in_range} GROUP BY class"),
    )
    .await?;
    let mut by_class: BTreeMap<String, u64> = BTreeMap::new();
    for b in &classes {
        let (names, counts) = (strings(b, 0)?, ints(b, 1)?);
        for (n, c) in names.into_iter().zip(counts) {
            by_class.insert(n.unwrap_or_default(), c.unwrap_or(0).max(0) as u64);
        }
    }
    let class = |c: &str| by_class.get(c).copied().unwrap_or(0);
    let counted_check = one_row(
        &ctx,
        "counted records against their windows",
        &format!(
            "SELECT sum(CASE WHEN bad > 0 THEN 1 ELSE 0 END), \
                    sum(CASE WHEN bad = 0 AND pending > 0 THEN 1 ELSE 0 END), \
                    sum(CASE WHEN bad = 0 AND pending = 0 THEN 1 ELSE 0 END) FROM ( \
               SELECT m.rid, max(CASE WHEN s.status IN ('mismatched', 'missing', 'extra', 'not_final') THEN 1 ELSE 0 END) AS bad, \
                      max(CASE WHEN s.status = 'pending' THEN 1 ELSE 0 END) AS pending \
               FROM audit_membership m JOIN audit_classified c ON c.rid = m.rid \
               JOIN audit_status s ON s.key = m.key AND s.ws = m.ws \
               WHERE c.t >= {from} AND c.t < {to} GROUP BY m.rid) x"
        ),
    )
    .await?;
    let (counted_bad, counted_pending, counted_ok) = (
        figure(&counted_check, 0),
        figure(&counted_check, 1),
        figure(&counted_check, 2),
    );
    // Counted records none of whose windows starts in the range (a session that began
    // before `from`): counted, not compared.
    let counted_unchecked =
        class("counted").saturating_sub(counted_bad + counted_pending + counted_ok);

    // 9. Late records against late_events.
    run(
        &ctx,
        "routed late records",
        &format!(
            "CREATE TABLE audit_routed AS SELECT DISTINCT CAST(tenant AS VARCHAR) AS tenant, \
             CAST(event_id AS VARCHAR) AS event_id, CAST(ingest_time AS BIGINT) AS ingest, CAST(event_time AS BIGINT) AS t \
             FROM {SQL_CATALOG}.{NAMESPACE}.late_events WHERE job = '{job}' AND namespace = '{ns}' \
             AND event_time >= {from_ts} AND event_time < {to_ts}",
            from_ts = ts_literal(from),
            to_ts = ts_literal(to),
        ),
    )
    .await?;
    let late_classes = "('late_horizon', 'late_window', 'null_key')";
    let not_routed_sql = format!(
        "SELECT c.tenant, c.event_id, c.t, c.ingest, c.class FROM audit_classified c \
         LEFT JOIN audit_routed l ON c.tenant = l.tenant AND c.event_id = l.event_id AND c.ingest = l.ingest \
         WHERE c.class IN {late_classes} AND c.t >= {from} AND c.t < {to} AND l.event_id IS NULL ORDER BY c.t"
    );
    let routed_extra_sql = format!(
        "SELECT l.tenant, l.event_id, l.t, l.ingest, coalesce(c.class, 'not_in_events') FROM audit_routed l \
         LEFT JOIN audit_classified c ON c.tenant = l.tenant AND c.event_id = l.event_id AND c.ingest = l.ingest \
         AND c.t = l.t \
         WHERE c.class IS NULL OR c.class NOT IN {late_classes} ORDER BY l.t"
    );
    let not_routed = late_list(&ctx, &not_routed_sql).await?;
    let routed_extra = late_list(&ctx, &routed_extra_sql).await?;
    let routed_total = one_row(&ctx, "routed count", "SELECT count(*) FROM audit_routed").await?;
    let oracle_late = class("late_horizon") + class("late_window") + class("null_key");
    let late = LateCheck {
        oracle_late,
        routed_late: figure(&routed_total, 0),
        not_routed_count: not_routed.len() as u64,
        routed_but_counted_count: routed_extra.len() as u64,
        not_routed: not_routed
            .iter()
            .take(request.list_limit)
            .cloned()
            .collect(),
        routed_but_counted: routed_extra
            .iter()
            .take(request.list_limit)
            .cloned()
            .collect(),
    };

    // 10. Rejections. A rejected record has no event time the gateway vouches for: those
    // received while the range's events were received (first to last ingest time) count.
    let received = one_row(
        &ctx,
        "reception window",
        &format!("SELECT min(ingest), max(ingest), count(*) FROM audit_records WHERE {in_range}"),
    )
    .await?;
    let reception = match received.as_slice() {
        [first, last, n, ..] if *n > 0 => Some((*first, *last)),
        _ => None,
    };
    let rejections = match reception {
        Some((first, last)) => {
            run(
                &ctx,
                "rejections",
                &format!(
                    "SELECT CAST(reason_code AS VARCHAR), count(*) FROM {SQL_CATALOG}.{NAMESPACE}.rejections \
                     WHERE received_at >= {first_ts} AND received_at <= {last_ts} GROUP BY 1 ORDER BY 1",
                    first_ts = ts_literal(first),
                    last_ts = ts_literal(last),
                ),
            )
            .await?
        }
        None => Vec::new(),
    };
    let mut rejected_by_reason = BTreeMap::new();
    for b in &rejections {
        for (r, c) in strings(b, 0)?.into_iter().zip(ints(b, 1)?) {
            rejected_by_reason.insert(r.unwrap_or_default(), c.unwrap_or(0).max(0) as u64);
        }
    }
    let rejected: u64 = rejected_by_reason.values().sum();
    let landed: u64 = by_class.values().sum();
    let late_accounted = oracle_late.saturating_sub(late.not_routed_count);
    let mut accounting = Accounting {
        received: landed + rejected,
        landed,
        counted: counted_ok + counted_unchecked,
        pending: counted_pending,
        duplicates: class("duplicate"),
        late: late_accounted,
        out_of_scope: class("out_of_scope"),
        unaccounted: counted_bad + late.not_routed_count,
        rejected,
        rejected_by_reason,
        rejections_received: reception.map(|(a, b)| (rfc3339(a), rfc3339(b))),
        balanced: false,
    };
    accounting.balanced = accounting.unaccounted == 0
        && accounting.counted
            + accounting.pending
            + accounting.duplicates
            + accounting.late
            + accounting.out_of_scope
            + accounting.unaccounted
            == accounting.landed;

    let duplicates = duplicate_pairs(&ctx, from, to, request.list_limit).await?;
    let versions = histories(&ctx, out, from, to).await?;
    let freshness = freshness(&ctx, &rules, out, from, to).await?;
    let (timeline, bucket_s) = timeline(&ctx, from, to, rules.slide).await?;

    let mut findings = Vec::new();
    let mut find = |kind: &str, count: u64, detail: String| {
        if count > 0 {
            findings.push(Finding {
                kind: kind.into(),
                count,
                detail,
            });
        }
    };
    find(
        "window_mismatch",
        windows.mismatched,
        "closed windows whose current version differs from the oracle".into(),
    );
    find(
        "window_missing",
        windows.missing,
        "closed windows the oracle finds and the outputs lack".into(),
    );
    find(
        "window_extra",
        windows.extra,
        "closed windows in the outputs that the oracle does not find".into(),
    );
    find(
        "window_not_final",
        windows.not_final,
        "closed windows whose current version is provisional: the final version is missing".into(),
    );
    find(
        "version_repeated",
        windows.versions_repeated,
        "output versions written more than once, per identity and version".into(),
    );
    find(
        "late_not_routed",
        late.not_routed_count,
        "events late by the oracle that are not in late_events".into(),
    );
    find(
        "routed_late_but_counted",
        late.routed_but_counted_count,
        "late_events records the oracle does not find late".into(),
    );
    find(
        "no_outputs",
        silent,
        "windows the events have closed while the output table holds no row at all: the \
         job has written nothing, so its progress is unknown and nothing could be compared"
            .into(),
    );
    find(
        "unaccounted_events",
        accounting.unaccounted,
        "events counted by the oracle in a window whose output differs or is not final, or \
         late and not routed"
            .into(),
    );
    Ok(Report {
        job: spec.name.clone(),
        job_version: spec.version,
        namespace: request.namespace.clone(),
        output_table: out.to_string(),
        from: rfc3339(from),
        to: rfc3339(to),
        generated_at: rfc3339(chrono::Utc::now().timestamp_micros()),
        rule: OracleRule {
            window: format!("{:?}", spec.window),
            out_of_orderness_s: rules.bound as f64 / 1e6,
            allowed_lateness_s: rules.lateness as f64 / 1e6,
            dedup_horizon_s: rules.horizon as f64 / 1e6,
            event_types: rules.types.clone(),
            events_snapshot,
        },
        matches: findings.is_empty(),
        findings,
        windows,
        differences,
        accounting,
        duplicates,
        late,
        job_watermark: job_watermark.map(rfc3339),
        versions,
        freshness,
        timeline,
        bucket_s,
    })
}

async fn differences(
    ctx: &SessionContext,
    spec: &JobSpec,
    limit: usize,
) -> Result<Vec<WindowDifference>> {
    let batches = run(
        ctx,
        "differences",
        &format!(
            "SELECT * FROM audit_status WHERE status IN ('mismatched', 'missing', 'extra', 'not_final') ORDER BY ws, key LIMIT {limit}"
        ),
    )
    .await?;
    let mut out = Vec::new();
    let mut names = vec!["window_end".to_string(), "events".to_string()];
    names.extend(spec.aggregates.iter().map(|a| a.name.clone()));
    for b in &batches {
        let schema = b.schema();
        let idx = |n: &str| schema.index_of(n).ok();
        let (Some(k), Some(ws), Some(we), Some(v), Some(c), Some(st)) = (
            idx("key"),
            idx("ws"),
            idx("we"),
            idx("output_version"),
            idx("completeness"),
            idx("status"),
        ) else {
            continue;
        };
        let (keys, starts, ends, versions, comps, statuses) = (
            strings(b, k)?,
            ints(b, ws)?,
            ints(b, we)?,
            ints(b, v)?,
            strings(b, c)?,
            strings(b, st)?,
        );
        let mut pairs = Vec::new();
        for n in &names {
            let clean = n.replace('"', "");
            match (idx(&format!("o_{clean}")), idx(&format!("r_{clean}"))) {
                (Some(o), Some(r)) => pairs.push((n.clone(), floats(b, o)?, floats(b, r)?)),
                _ => continue,
            }
        }
        for row in 0..b.num_rows() {
            let columns = pairs
                .iter()
                .filter(|(_, o, r)| match (o[row], r[row]) {
                    (Some(x), Some(y)) => (x - y).abs() > 1e-9 * y.abs().max(1.0),
                    (None, None) => false,
                    _ => true,
                })
                .map(|(n, o, r)| (n.clone(), o[row], r[row]))
                .collect();
            out.push(WindowDifference {
                key: keys[row].clone().unwrap_or_default(),
                window_start: rfc3339(starts[row].unwrap_or(0)),
                window_end: rfc3339(ends[row].unwrap_or(0)),
                status: statuses[row].clone().unwrap_or_default(),
                output_version: versions[row],
                completeness: comps[row].clone(),
                columns,
            });
        }
    }
    Ok(out)
}

async fn late_list(ctx: &SessionContext, sql: &str) -> Result<Vec<LateDiscrepancy>> {
    let mut out = Vec::new();
    for b in run(ctx, "late discrepancies", sql).await? {
        let (tenants, ids, ts, ingests, classes) = (
            strings(&b, 0)?,
            strings(&b, 1)?,
            ints(&b, 2)?,
            ints(&b, 3)?,
            strings(&b, 4)?,
        );
        for r in 0..b.num_rows() {
            out.push(LateDiscrepancy {
                tenant: tenants[r].clone().unwrap_or_default(),
                event_id: ids[r].clone().unwrap_or_default(),
                event_time: rfc3339(ts[r].unwrap_or(0)),
                ingest_time: rfc3339(ingests[r].unwrap_or(0)),
                oracle_class: classes[r].clone().unwrap_or_default(),
            });
        }
    }
    Ok(out)
}

async fn duplicate_pairs(
    ctx: &SessionContext,
    from: i64,
    to: i64,
    limit: usize,
) -> Result<Vec<DuplicatePair>> {
    let mut out = Vec::new();
    let sql = format!(
        "SELECT d.tenant, d.event_id, f.ingest, d.ingest FROM audit_classified d \
         JOIN audit_classified f ON f.rid = d.twin \
         WHERE d.class = 'duplicate' AND d.t >= {from} AND d.t < {to} ORDER BY d.ingest LIMIT {limit}"
    );
    for b in run(ctx, "duplicates", &sql).await? {
        let (tenants, ids, twins, dups) =
            (strings(&b, 0)?, strings(&b, 1)?, ints(&b, 2)?, ints(&b, 3)?);
        for r in 0..b.num_rows() {
            out.push(DuplicatePair {
                tenant: tenants[r].clone().unwrap_or_default(),
                event_id: ids[r].clone().unwrap_or_default(),
                twin_ingest_time: rfc3339(twins[r].unwrap_or(0)),
                duplicate_ingest_time: rfc3339(dups[r].unwrap_or(0)),
            });
        }
    }
    Ok(out)
}

async fn histories(
    ctx: &SessionContext,
    out: &str,
    from: i64,
    to: i64,
) -> Result<Vec<WindowHistory>> {
    let sql = format!(
        "SELECT CAST(key AS VARCHAR) AS k, CAST(window_start AS BIGINT) AS ws, output_version AS v, \
         CAST(completeness AS VARCHAR) AS c, retracted, CAST(emitted_at AS BIGINT) AS at, \
         CAST(watermark AS BIGINT) AS wm, events, input_snapshot FROM {SQL_CATALOG}.{NAMESPACE}.{out} \
         WHERE window_start >= {from_ts} AND window_start < {to_ts} \
         ORDER BY ws, k, v",
        from_ts = ts_literal(from),
        to_ts = ts_literal(to),
    );
    let mut histories: Vec<WindowHistory> = Vec::new();
    for b in run(ctx, "version history", &sql).await? {
        let (keys, starts, versions, comps, retracted) = (
            strings(&b, 0)?,
            ints(&b, 1)?,
            ints(&b, 2)?,
            strings(&b, 3)?,
            strings(&b, 4)?,
        );
        let (emitted, watermarks, events, input_snapshots) =
            (ints(&b, 5)?, ints(&b, 6)?, ints(&b, 7)?, ints(&b, 8)?);
        for r in 0..b.num_rows() {
            let key = keys[r].clone().unwrap_or_default();
            let start = rfc3339(starts[r].unwrap_or(0));
            let entry = VersionEntry {
                version: versions[r].unwrap_or(0),
                completeness: comps[r].clone().unwrap_or_default(),
                retracted: retracted[r].as_deref() == Some("true"),
                emitted_at: rfc3339(emitted[r].unwrap_or(0)),
                watermark: rfc3339(watermarks[r].unwrap_or(0)),
                events: events[r].unwrap_or(0),
                input_snapshot: input_snapshots[r],
            };
            match histories.last_mut() {
                Some(h) if h.key == key && h.window_start == start => h.versions.push(entry),
                _ => histories.push(WindowHistory {
                    key,
                    window_start: start,
                    versions: vec![entry],
                }),
            }
        }
    }
    Ok(histories)
}

/// One copy of an identity seen more than once, for [`dedup_twins`].
struct CopySeen {
    rid: i64,
    identity: (Option<String>, Option<String>),
    t: i64,
    wm: Option<i64>,
}

/// The duplicates among `copies` (in arrival order), each with the copy it repeats, as
/// `(duplicate rid, twin rid)`. An identity is held from the copy that counts until its
/// event time plus the dedup `horizon`: a copy arriving while the watermark is below that
/// is a duplicate; one arriving after counts again and holds it anew.
fn dedup_twins(copies: Vec<CopySeen>, horizon: i64) -> Vec<(i64, i64)> {
    let mut held: std::collections::HashMap<(Option<String>, Option<String>), (i64, i64)> =
        Default::default();
    let mut out = Vec::new();
    for c in copies {
        let wm = c.wm.unwrap_or(i64::MIN);
        match held.get(&c.identity) {
            Some(&(twin, until)) if until > wm => out.push((c.rid, twin)),
            _ => {
                held.insert(c.identity, (c.rid, c.t.saturating_add(horizon)));
            }
        }
    }
    out
}

/// Session windows: replays the first copies, in arrival order, against the sessions of
/// their key as the job's rule states it. At a record's arrival (watermark `wm`), the
/// sessions that ended `lateness` or more before the watermark have retired and move the
/// key's frontier to their end; a record before the frontier is late; otherwise it merges
/// with the sessions it overlaps (`[t, t + gap)` against `[start, end)`), and is late if
/// the merged session had retired. Returns the late records' ids.
fn session_late(rows: Vec<(i64, String, i64, Option<i64>)>, gap: i64, lateness: i64) -> Vec<i64> {
    #[derive(Default)]
    struct KeyState {
        sessions: BTreeMap<i64, i64>,
        frontier: i64,
    }
    let mut keys: std::collections::HashMap<String, KeyState> = Default::default();
    let mut late = Vec::new();
    for (rid, key, t, wm) in rows {
        let wm = wm.unwrap_or(i64::MIN);
        let st = keys.entry(key).or_insert_with(|| KeyState {
            sessions: BTreeMap::new(),
            frontier: i64::MIN,
        });
        let mut frontier = st.frontier;
        st.sessions.retain(|_, end| {
            let retired = end.saturating_add(lateness) <= wm;
            if retired {
                frontier = frontier.max(*end);
            }
            !retired
        });
        st.frontier = frontier;
        if t < st.frontier {
            late.push(rid);
            continue;
        }
        let (mut start, mut end) = (t, t.saturating_add(gap));
        let overlapping: Vec<(i64, i64)> = st
            .sessions
            .range(..end)
            .rev()
            .take_while(|(_, e)| **e > t)
            .map(|(s, e)| (*s, *e))
            .collect();
        for (s, e) in &overlapping {
            start = start.min(*s);
            end = end.max(*e);
        }
        if wm >= end.saturating_add(lateness) {
            late.push(rid);
            continue;
        }
        for (s, _) in overlapping {
            st.sessions.remove(&s);
        }
        st.sessions.insert(start, end);
    }
    late
}

fn quantile(sorted: &[i64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)] as f64 / 1e6
}

/// Freshness of counted events, by the stages the tables record: event time → ingest
/// (producer transit and durable ingestion), ingest → emission of the first output
/// version that includes the event (queue, hold and processing), and end to end. The
/// version that includes the `n`-th record of a window (by arrival) is its first version
/// counting at least `n` records.
async fn freshness(
    ctx: &SessionContext,
    rules: &Rules,
    out: &str,
    from: i64,
    to: i64,
) -> Result<Vec<StageFigures>> {
    let sql = format!(
        "WITH r AS (SELECT m.rid, m.key, m.ws, c.t, c.ingest, \
                    row_number() OVER (PARTITION BY m.key, m.ws ORDER BY c.rid) AS n \
                    FROM audit_membership m JOIN audit_classified c ON c.rid = m.rid \
                    WHERE c.t >= {from} AND c.t < {to}), \
              v AS (SELECT CAST(key AS VARCHAR) AS key, CAST(window_start AS BIGINT) AS ws, events, \
                    CAST(emitted_at AS BIGINT) AS at FROM {SQL_CATALOG}.{NAMESPACE}.{out} \
                    WHERE window_start >= {from_ts} AND NOT retracted) \
         SELECT r.ingest - r.t, min(v.at) - r.ingest, min(v.at) - r.t FROM r \
         JOIN v ON r.key = v.key AND r.ws = v.ws AND v.events >= r.n GROUP BY r.rid, r.t, r.ingest",
        from_ts = ts_literal(from.saturating_sub(rules.size)),
    );
    let mut stages: [Vec<i64>; 3] = Default::default();
    for b in run(ctx, "freshness", &sql).await? {
        for (i, s) in stages.iter_mut().enumerate() {
            s.extend(ints(&b, i)?.into_iter().flatten());
        }
    }
    let names = [
        "producer_transit_and_durable_ingestion",
        "queue_hold_processing",
        "end_to_end_to_emission",
    ];
    Ok(names
        .iter()
        .zip(stages.iter_mut())
        .map(|(name, v)| {
            v.sort_unstable();
            StageFigures {
                stage: name.to_string(),
                samples: v.len() as u64,
                p50_s: quantile(v, 0.5),
                p90_s: quantile(v, 0.9),
                p99_s: quantile(v, 0.99),
                max_s: v.last().map(|x| *x as f64 / 1e6).unwrap_or(0.0),
            }
        })
        .collect())
}

/// Figures per bucket of event time: about 48 buckets, a whole number of slides each.
async fn timeline(
    ctx: &SessionContext,
    from: i64,
    to: i64,
    slide: i64,
) -> Result<(Vec<Bucket>, i64)> {
    let width = ((to - from) / 48).max(slide);
    let width = (width + slide - 1) / slide * slide;
    let n = ((to - from) + width - 1) / width;
    let mut buckets: Vec<Bucket> = (0..n)
        .map(|i| Bucket {
            start: rfc3339(from + i * width),
            ..Default::default()
        })
        .collect();
    let bucket = |col: &str| format!("CAST(({col} - {from}) / {width} AS BIGINT)");
    let records = run(
        ctx,
        "timeline",
        &format!(
            "SELECT {b}, sum(CASE WHEN class = 'counted' THEN 1 ELSE 0 END), \
             sum(CASE WHEN class IN ('late_horizon', 'late_window', 'null_key') THEN 1 ELSE 0 END), \
             sum(CASE WHEN class = 'duplicate' THEN 1 ELSE 0 END) \
             FROM audit_classified WHERE t >= {from} AND t < {to} GROUP BY 1",
            b = bucket("t")
        ),
    )
    .await?;
    for b in &records {
        let (i, c, l, d) = (ints(b, 0)?, ints(b, 1)?, ints(b, 2)?, ints(b, 3)?);
        for r in 0..b.num_rows() {
            if let Some(x) = i[r].and_then(|i| buckets.get_mut(i as usize)) {
                x.counted = c[r].unwrap_or(0) as u64;
                x.late = l[r].unwrap_or(0) as u64;
                x.duplicates = d[r].unwrap_or(0) as u64;
            }
        }
    }
    let routed = run(
        ctx,
        "timeline late_events",
        &format!(
            "SELECT {b}, count(*) FROM audit_routed GROUP BY 1",
            b = bucket("t")
        ),
    )
    .await?;
    for b in &routed {
        let (i, c) = (ints(b, 0)?, ints(b, 1)?);
        for r in 0..b.num_rows() {
            if let Some(x) = i[r].and_then(|i| buckets.get_mut(i as usize)) {
                x.routed_late = c[r].unwrap_or(0) as u64;
            }
        }
    }
    let differing = run(
        ctx,
        "timeline differences",
        &format!(
            "SELECT {b}, count(*) FROM audit_status WHERE status IN ('mismatched', 'missing', 'extra', 'not_final') GROUP BY 1",
            b = bucket("ws")
        ),
    )
    .await?;
    for b in &differing {
        let (i, c) = (ints(b, 0)?, ints(b, 1)?);
        for r in 0..b.num_rows() {
            if let Some(x) = i[r].and_then(|i| buckets.get_mut(i as usize)) {
                x.differing_windows = c[r].unwrap_or(0) as u64;
            }
        }
    }
    Ok((buckets, width / 1_000_000))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_the_oracle_does_not_model_is_refused() {
        let shipped = include_str!("../../../jobs/market_aggregates.toml");
        assert!(Rules::of(&JobSpec::from_toml(shipped).unwrap()).is_ok());
        for (from, to, what) in [
            (
                "identity = [\"tenant\", \"event_id\"]",
                "identity = [\"tenant\", \"event_id\", \"event_type\"]",
                "dedup identity",
            ),
            (
                "idle_timeout = \"1m\"",
                "idle_timeout = \"1m\"\ninput_column = \"producer_id\"",
                "per-input watermarks",
            ),
        ] {
            assert!(shipped.contains(from), "{from}");
            let spec = JobSpec::from_toml(&shipped.replace(from, to)).unwrap();
            let e = Rules::of(&spec).err().expect("refused");
            assert_eq!(e.kind(), ErrorKind::Config);
            assert!(e.to_string().contains(what), "{e}");
        }
    }

    #[test]
    fn a_copy_is_a_duplicate_while_the_copy_that_counted_is_within_the_horizon() {
        let copy = |rid: i64, id: &str, t: i64, wm: Option<i64>| CopySeen {
            rid,
            identity: (Some("t".into()), Some(id.into())),
            t,
            wm,
        };
        let horizon = 100;
        let twins = dedup_twins(
            vec![
                copy(1, "a", 0, None),
                copy(2, "b", 5, Some(0)),
                copy(3, "a", 50, Some(99)),
                // The first copy's horizon is over: this one counts, and holds anew.
                copy(4, "a", 150, Some(100)),
                copy(5, "a", 150, Some(249)),
                copy(6, "b", 5, Some(104)),
                copy(7, "a", 20, Some(250)),
            ],
            horizon,
        );
        assert_eq!(twins, vec![(3, 1), (5, 4), (6, 2)]);
    }

    const GAP: i64 = 300;
    const LATENESS: i64 = 600;

    fn rec(rid: i64, key: &str, t: i64, wm: Option<i64>) -> (i64, String, i64, Option<i64>) {
        (rid, key.to_string(), t, wm)
    }

    #[test]
    fn a_late_record_bridging_two_open_sessions_merges_them() {
        // Sessions [0, 300) and [400, 700); a record at 200 bridges them while both are
        // open: not late.
        let rows = vec![
            rec(1, "k", 0, None),
            rec(2, "k", 400, Some(0)),
            rec(3, "k", 200, Some(395)),
        ];
        assert!(session_late(rows, GAP, LATENESS).is_empty());
    }

    #[test]
    fn records_behind_a_retired_session_are_late_even_if_alone_they_would_not_be() {
        let rows = vec![
            rec(1, "k", 0, None),
            // The session [0, 300) retires once the watermark reaches 900.
            rec(2, "k", 2_000, Some(900)),
            // 250 + 300 + 600 = 1150 > 1000: alone it would be open, but it is before
            // the frontier (300).
            rec(3, "k", 250, Some(1_000)),
            // Another key has its own frontier.
            rec(4, "j", 250, Some(1_000)),
            // Past the frontier, but its own session [1000, 1300) retired at 1900.
            rec(5, "k", 1_000, Some(1_900)),
        ];
        assert_eq!(session_late(rows, GAP, LATENESS), vec![3, 5]);
    }

    #[test]
    fn a_record_extending_an_open_session_is_judged_by_the_merged_end() {
        let rows = vec![
            rec(1, "k", 1_000, None),
            rec(2, "k", 1_250, Some(0)),
            // Alone, [100, 400) would have retired (400 + 600 <= 1100); it does not
            // overlap [1000, 1550), so it is late.
            rec(3, "k", 100, Some(1_100)),
        ];
        assert_eq!(session_late(rows, GAP, LATENESS), vec![3]);
    }
}
