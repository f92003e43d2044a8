//! `backfill compare` and `backfill promote`: a backfill's namespace against the current
//! outputs for its range, and making it authoritative.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::DataType;
use datafusion::prelude::SessionContext;
use datafusion::sql::TableReference;
use serde::Serialize;
use signalweave_lake::{
    COMMIT_SEQUENCE_COLUMN, LINEAGE_COLUMN, Lake, LakeTable, LakeTableProvider, NAMESPACE,
    Promotion, SQL_CATALOG, SnapshotChoice,
};
use signalweave_model::{ErrorKind, format_rfc3339_micros};
use signalweave_window::{JobSpec, WindowSpec, micros};

use crate::backfill::{BackfillRecord, BackfillStore};
use crate::error::{Result, RunnerError};
use crate::live::output_table;

/// One window that differs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WindowDifference {
    /// `changed`, `missing` (in the current outputs, not in the namespace) or `extra`.
    pub kind: &'static str,
    /// Key.
    pub key: String,
    /// Window start (RFC 3339).
    pub window_start: String,
    /// Window end (RFC 3339).
    pub window_end: String,
    /// The current values (`events` and each compared aggregate), if any.
    pub current: Option<BTreeMap<String, Option<String>>>,
    /// The namespace's values, if any.
    pub namespace: Option<BTreeMap<String, Option<String>>>,
}

/// A column's total over the range.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ColumnTotal {
    /// Column.
    pub column: String,
    /// Total of the current outputs.
    pub current: f64,
    /// Total of the namespace.
    pub namespace: f64,
    /// namespace − current.
    pub delta: f64,
}

/// The result of `backfill compare`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    /// Job.
    pub job: String,
    /// Namespace compared.
    pub namespace: String,
    /// Its job version.
    pub job_version: u32,
    /// The backfill's state when compared: short of `completed`, the windows of its
    /// sub-ranges not done show as missing.
    pub state: String,
    /// Range (RFC 3339): windows overlapping it are compared.
    pub from: String,
    /// Range end (RFC 3339).
    pub to: String,
    /// Columns compared (`events` and the aggregates both sides have).
    pub columns: Vec<String>,
    /// Aggregates only the current outputs have.
    pub only_current: Vec<String>,
    /// Aggregates only the namespace has.
    pub only_namespace: Vec<String>,
    /// Windows on both sides with equal values.
    pub same: u64,
    /// Windows on both sides whose values differ.
    pub changed: u64,
    /// Windows in the current outputs and not in the namespace.
    pub missing: u64,
    /// Windows in the namespace and not in the current outputs.
    pub extra: u64,
    /// Namespace windows crossing the range's end (`partial`): not compared.
    pub partial: u64,
    /// Totals per column.
    pub totals: Vec<ColumnTotal>,
    /// The differing windows (at most `limit`).
    pub differences: Vec<WindowDifference>,
    /// True when more windows differ than are listed.
    pub truncated: bool,
}

impl Comparison {
    /// True when nothing differs.
    pub fn identical(&self) -> bool {
        self.changed == 0 && self.missing == 0 && self.extra == 0
    }
}

fn strings(batch: &RecordBatch, column: &str) -> Result<arrow::array::StringArray> {
    let c = batch.column_by_name(column).ok_or_else(|| {
        RunnerError::new(ErrorKind::Internal, format!("comparison lacks {column}"))
    })?;
    arrow::compute::cast(c, &DataType::Utf8)
        .map(|a| a.as_string::<i32>().clone())
        .map_err(|e| RunnerError::new(ErrorKind::Internal, format!("{column}: {e}")))
}

fn int64s(batch: &RecordBatch, column: &str) -> Result<arrow::array::Int64Array> {
    batch
        .column_by_name(column)
        .and_then(|c| c.as_primitive_opt::<arrow::datatypes::Int64Type>().cloned())
        .ok_or_else(|| RunnerError::new(ErrorKind::Internal, format!("comparison lacks {column}")))
}

fn value(a: &arrow::array::StringArray, row: usize) -> Option<String> {
    (!a.is_null(row)).then(|| a.value(row).to_string())
}

/// Compares the backfill `record` (of `spec`, its job version) with the current outputs
/// of `live` (the job's current spec) over the windows overlapping its range; lists at
/// most `limit` differences.
pub async fn compare(
    lake: &Lake,
    live: &JobSpec,
    spec: &JobSpec,
    record: &BackfillRecord,
    limit: usize,
) -> Result<Comparison> {
    let live_table = output_table(live, "live")?;
    let ns_table = record.output_table(spec)?;
    lake.ensure_output_table(live_table).await?;
    lake.ensure_output_table(ns_table).await?;
    let live_aggs: Vec<&str> = live.aggregates.iter().map(|a| a.name.as_str()).collect();
    let ns_aggs: Vec<&str> = spec.aggregates.iter().map(|a| a.name.as_str()).collect();
    let mut columns = vec!["events".to_string()];
    columns.extend(
        live_aggs
            .iter()
            .filter(|a| ns_aggs.contains(a))
            .map(|a| a.to_string()),
    );
    let overlap = format!(
        "arrow_cast(window_end, 'Int64') > {} AND arrow_cast(window_start, 'Int64') < {}",
        record.from_us, record.to_us
    );
    let mut select = vec![
        "coalesce(c.key, n.key) AS sw_key".to_string(),
        "arrow_cast(coalesce(c.window_start, n.window_start), 'Int64') AS sw_start".into(),
        "arrow_cast(coalesce(c.window_end, n.window_end), 'Int64') AS sw_end".into(),
        "c.key IS NOT NULL AS sw_in_current".into(),
        "n.key IS NOT NULL AS sw_in_namespace".into(),
        "n.completeness AS sw_completeness".into(),
    ];
    for (i, col) in columns.iter().enumerate() {
        select.push(format!("CAST(c.\"{col}\" AS VARCHAR) AS c_{i}"));
        select.push(format!("CAST(n.\"{col}\" AS VARCHAR) AS n_{i}"));
    }
    let sql = format!(
        "SELECT {} FROM (SELECT * FROM {}_current WHERE {overlap}) c FULL OUTER JOIN \
         (SELECT * FROM {}_current WHERE {overlap}) n ON c.key = n.key \
         AND c.window_start = n.window_start AND c.window_end = n.window_end \
         ORDER BY sw_start, sw_key, sw_end",
        select.join(", "),
        live_table.name(),
        ns_table.name()
    );
    let ctx = lake.session_context().await?;
    let batches = ctx
        .sql(&sql)
        .await
        .map_err(|e| RunnerError::new(ErrorKind::Internal, format!("compare: {e}")))?
        .collect()
        .await
        .map_err(|e| RunnerError::new(ErrorKind::Unavailable, format!("compare: {e}")))?;
    let mut cmp = Comparison {
        job: record.job.clone(),
        namespace: record.namespace.clone(),
        job_version: record.job_version,
        state: record.state.clone(),
        from: format_rfc3339_micros(record.from_us),
        to: format_rfc3339_micros(record.to_us),
        only_current: live_aggs
            .iter()
            .filter(|a| !ns_aggs.contains(a))
            .map(|a| a.to_string())
            .collect(),
        only_namespace: ns_aggs
            .iter()
            .filter(|a| !live_aggs.contains(a))
            .map(|a| a.to_string())
            .collect(),
        totals: columns
            .iter()
            .map(|c| ColumnTotal {
                column: c.clone(),
                current: 0.0,
                namespace: 0.0,
                delta: 0.0,
            })
            .collect(),
        columns: columns.clone(),
        same: 0,
        changed: 0,
        missing: 0,
        extra: 0,
        partial: 0,
        differences: Vec::new(),
        truncated: false,
    };
    // The namespace's partial windows, by key and start: a live window that starts with
    // one is that window, counted as partial. (A session cut at the range's end ends
    // earlier than the live session it is part of, so their identities differ.)
    let mut partial_starts: HashSet<(String, i64)> = HashSet::new();
    for batch in &batches {
        let key = strings(batch, "sw_key")?;
        let start = int64s(batch, "sw_start")?;
        let in_namespace = strings(batch, "sw_in_namespace")?;
        let completeness = strings(batch, "sw_completeness")?;
        for row in 0..batch.num_rows() {
            if in_namespace.value(row) == "true"
                && value(&completeness, row).as_deref() == Some("partial")
            {
                partial_starts.insert((key.value(row).to_string(), start.value(row)));
            }
        }
    }
    for batch in &batches {
        let key = strings(batch, "sw_key")?;
        let start = int64s(batch, "sw_start")?;
        let end = int64s(batch, "sw_end")?;
        let in_current = strings(batch, "sw_in_current")?;
        let in_namespace = strings(batch, "sw_in_namespace")?;
        let completeness = strings(batch, "sw_completeness")?;
        let cur: Vec<_> = (0..columns.len())
            .map(|i| strings(batch, &format!("c_{i}")))
            .collect::<Result<_>>()?;
        let ns: Vec<_> = (0..columns.len())
            .map(|i| strings(batch, &format!("n_{i}")))
            .collect::<Result<_>>()?;
        for row in 0..batch.num_rows() {
            let has_c = in_current.value(row) == "true";
            let has_n = in_namespace.value(row) == "true";
            if has_n && value(&completeness, row).as_deref() == Some("partial") {
                cmp.partial += 1;
                continue;
            }
            if has_c
                && !has_n
                && partial_starts.contains(&(key.value(row).to_string(), start.value(row)))
            {
                continue;
            }
            let values = |side: &[arrow::array::StringArray]| {
                columns
                    .iter()
                    .zip(side)
                    .map(|(c, a)| (c.clone(), value(a, row)))
                    .collect::<BTreeMap<_, _>>()
            };
            for (i, total) in cmp.totals.iter_mut().enumerate() {
                let num = |a: &arrow::array::StringArray| {
                    value(a, row)
                        .and_then(|v| v.parse::<f64>().ok())
                        .unwrap_or(0.0)
                };
                if has_c {
                    total.current += num(&cur[i]);
                }
                if has_n {
                    total.namespace += num(&ns[i]);
                }
            }
            let kind = match (has_c, has_n) {
                (true, true) => {
                    if (0..columns.len()).all(|i| value(&cur[i], row) == value(&ns[i], row)) {
                        cmp.same += 1;
                        continue;
                    }
                    cmp.changed += 1;
                    "changed"
                }
                (true, false) => {
                    cmp.missing += 1;
                    "missing"
                }
                _ => {
                    cmp.extra += 1;
                    "extra"
                }
            };
            if cmp.differences.len() == limit {
                cmp.truncated = true;
                continue;
            }
            cmp.differences.push(WindowDifference {
                kind,
                key: key.value(row).to_string(),
                window_start: format_rfc3339_micros(start.value(row)),
                window_end: format_rfc3339_micros(end.value(row)),
                current: has_c.then(|| values(&cur)),
                namespace: has_n.then(|| values(&ns)),
            });
        }
    }
    for t in &mut cmp.totals {
        t.delta = t.namespace - t.current;
    }
    Ok(cmp)
}

/// What ends a promotion where it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PromotionEnd {
    /// The backfill's range.
    RangeEnd,
    /// The watermark of the input the backfill read: later windows are not final in it.
    InputWatermark,
    /// The live job's watermark minus its allowed lateness: the live job can still correct
    /// a window ending later, and a promotion would hide that correction.
    LiveCanCorrect,
    /// The namespace's first `partial` window.
    Partial,
    /// The first window holding a record committed after the backfill's snapshot that the
    /// live job did not find late: the live outputs count it (or will), the namespace never
    /// read it.
    Unread,
}

impl PromotionEnd {
    /// Why windows end by `at`, in words.
    pub fn describe(self, at: i64) -> String {
        let at = format_rfc3339_micros(at);
        match self {
            Self::RangeEnd => format!("the backfill's range ends at {at}"),
            Self::InputWatermark => format!(
                "the input the backfill read has its watermark at {at}: later windows are not final"
            ),
            Self::LiveCanCorrect => format!(
                "the live job can still correct windows ending after {at} (its watermark minus \
                 its allowed lateness); promote them once they retire, after a rollback"
            ),
            Self::Partial => format!("the backfill wrote the window starting at {at} partial"),
            Self::Unread => format!(
                "a record committed after the backfill's snapshot changes the live windows from \
                 {at} on (the live job counts it, or has not read it yet); backfill again to \
                 promote them"
            ),
        }
    }
}

/// A recorded promotion, and what ends it where it ends.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Promoted {
    /// As recorded in `sw_promotions`.
    pub promotion: Promotion,
    /// What ends it.
    pub end: PromotionEnd,
    /// The point that ends it, µs: the promotion ends there, or earlier, at the start of
    /// the first window (of either version) crossing it.
    pub at_us: i64,
}

impl Promoted {
    /// Why it ends where it does, in words.
    pub fn reason(&self) -> String {
        ends_because(self.end, self.at_us, self.promotion.to_us)
    }
}

/// Why a promotion ends at `to_us`, when `end` at `at_us` ends it.
fn ends_because(end: PromotionEnd, at_us: i64, to_us: i64) -> String {
    let why = end.describe(at_us);
    if to_us < at_us {
        format!(
            "{why}; the windows before {} end by that point",
            format_rfc3339_micros(to_us)
        )
    } else {
        why
    }
}

/// Promotes a completed backfill: its namespace becomes authoritative for the windows
/// starting in its range, up to the first window (of either version) that is not final in
/// it (one crossing the range's end or the input's watermark, or `partial`) or that the
/// live outputs may still change or have changed since the backfill's snapshot (see
/// [`PromotionEnd`]). Requires the namespace's outputs to have the live outputs' columns
/// (the serving API and the current view show one schema per job).
pub async fn promote(
    lake: &Lake,
    live: &JobSpec,
    spec: &JobSpec,
    record: &BackfillRecord,
    by: &str,
) -> Result<Promoted> {
    if record.state != "completed" {
        return Err(RunnerError::new(
            ErrorKind::Conflict,
            format!(
                "the backfill in `{}` is {}: only a completed backfill can be promoted",
                record.namespace, record.state
            ),
        ));
    }
    let live_schema = signalweave_window::output_schema(live);
    let ns_schema = signalweave_window::output_schema(spec);
    if live_schema.fields() != ns_schema.fields() {
        return Err(RunnerError::new(
            ErrorKind::Config,
            format!(
                "{} version {} writes other output columns than the live version {}: \
                 a promotion would mix two schemas in one current view",
                spec.name, spec.version, live.version
            ),
        ));
    }
    // Two window shapes: the promotion may only begin and end where no window of either
    // crosses, or events near its edges would be served twice or not at all.
    let tiles = (tumbling_size(&live.window), tumbling_size(&spec.window));
    let (from_us, edge) = match tiles {
        _ if live.window == spec.window => (record.from_us, None),
        (Some(a), Some(b)) if a == b => (record.from_us, None),
        (Some(a), Some(b)) => {
            let lcm = lcm(a, b);
            (ceil_to(record.from_us, lcm), Some(lcm))
        }
        _ => {
            return Err(RunnerError::new(
                ErrorKind::Config,
                format!(
                    "{} version {} has other windows than the live version {} ({:?} against \
                     {:?}): every point of the range is inside a window of one of them, so \
                     the promotion's edges would count events twice or not at all",
                    spec.name, spec.version, live.version, spec.window, live.window
                ),
            ));
        }
    };
    // What the namespace is authoritative for ends where its windows stop being final:
    // at the range's end, or at the input's watermark where that is earlier. Each done
    // sub-range records the watermark of the snapshot it read (a backfill moved to a newer
    // snapshot by an erasure read some sub-ranges at a lower one): the lowest counts.
    // Sub-ranges recorded before that was kept fall back to the rows' own: each carries
    // the lesser of its sub-range's end and that watermark, so their highest is the end
    // when the last sub-ranges held events, and earlier otherwise, which only leaves more
    // to the live outputs. A window crossing that point is `partial` in the namespace, or
    // missing from it where its key had no events before the point, while the live
    // outputs hold it whole: so the promotion stops at the earliest start of a window (of
    // either version) crossing the point, and at the first partial window.
    let ns_table = record.output_table(spec)?;
    lake.ensure_output_table(ns_table).await?;
    let live_table = output_table(live, "live")?;
    lake.ensure_output_table(live_table).await?;
    let ctx = lake.session_context().await?;
    let recorded: Vec<Option<i64>> = BackfillStore::open(lake.clone())
        .await?
        .subranges(&record.job, &record.namespace)
        .await?
        .iter()
        .filter(|s| s.state == "done")
        .map(|s| s.input_watermark_us)
        .collect();
    let bounds: [_; 2] = one_row(
        &ctx,
        &format!(
            "SELECT min(CASE WHEN completeness = 'partial' THEN arrow_cast(window_start, 'Int64') END), \
             max(arrow_cast(watermark, 'Int64')) FROM {}",
            ns_table.name()
        ),
    )
    .await?;
    let first_partial = bounds[0];
    // Sub-ranges done across an upgrade: the lowest recorded, or the rows' if lower.
    let known = recorded.iter().flatten().copied().min();
    let watermark = if !recorded.is_empty() && recorded.iter().all(Option::is_some) {
        known
    } else {
        [known, bounds[1]].into_iter().flatten().min()
    };
    let Some(watermark) = watermark else {
        return Err(RunnerError::new(
            ErrorKind::Conflict,
            format!(
                "the backfill in `{}` wrote no outputs, and recorded no watermark of what it \
                 read: there is nothing to promote",
                record.namespace
            ),
        ));
    };
    // The live outputs must not change under a promoted window, or the change is never
    // served: the promotion ends where the live job can still correct windows, and before
    // the first window holding a record the backfill never read (committed after its
    // snapshot) that the live job counts. The live job's watermark, as of its last
    // emission, is a lower bound of its watermark now (it never goes back): a window
    // ending later than that minus the allowed lateness has not retired. A session can
    // still begin a gap earlier (a late record opens one there).
    let gap = session_gap(live);
    let [live_watermark] = one_row(
        &ctx,
        &format!(
            "SELECT max(arrow_cast(watermark, 'Int64')) FROM {} WHERE job = '{}'",
            live_table.name(),
            sql_text(&live.name)
        ),
    )
    .await?;
    let seq = match record.snapshot_seq {
        Some(seq) => seq,
        // Recorded by an earlier version: the sequence number of its snapshot, if the
        // table still has it (after an erasure moved the backfill, a later one).
        None => lake
            .snapshots(LakeTable::Events)
            .await?
            .iter()
            .find(|s| Some(s.snapshot_id) == record.snapshot_id)
            .map(|s| s.sequence_number)
            .ok_or_else(|| {
                RunnerError::new(
                    ErrorKind::Conflict,
                    format!(
                        "the backfill in `{}` was recorded by an earlier version, which kept no \
                         sequence number of its snapshot, and that snapshot has expired: the \
                         records committed after it cannot be told apart; run the backfill \
                         again to promote it",
                        record.namespace
                    ),
                )
            })?,
    };
    // Only a record before the range's end (or a gap after, for sessions) can end it.
    let unread = first_unread(
        lake,
        &ctx,
        live,
        seq,
        (
            from_us.saturating_sub(gap),
            record.to_us.saturating_add(gap),
        ),
    )
    .await?;
    let (end, mut cause) = last_end(record.to_us, watermark, live, live_watermark, unread);
    // A window (of either version) crossing `end` is not final, or not retired, on one
    // side: the promotion stops at its start. Sessions have no fixed shape: the outputs
    // tell where they are.
    let mut to_us = [
        Some(end),
        live.window.starts_ending_by(end),
        spec.window.starts_ending_by(end),
    ]
    .into_iter()
    .flatten()
    .min()
    .unwrap_or(end);
    let sessions = matches!(live.window, WindowSpec::Session { .. })
        || matches!(spec.window, WindowSpec::Session { .. });
    if sessions {
        let crossing = |table: &str| {
            format!(
                "SELECT min(arrow_cast(window_start, 'Int64')) FROM {table} \
                 WHERE arrow_cast(window_end, 'Int64') > {end} \
                 AND arrow_cast(window_start, 'Int64') >= {from_us}"
            )
        };
        for table in [ns_table.name(), live_table.name()] {
            if let [Some(t)] = one_row(&ctx, &crossing(table)).await? {
                to_us = to_us.min(t);
            }
        }
    }
    let mut at_us = end;
    if let Some(t) = first_partial
        && t < to_us
    {
        (to_us, cause, at_us) = (t, PromotionEnd::Partial, t);
    }
    if let Some(l) = edge {
        to_us = to_us.div_euclid(l).saturating_mul(l);
    }
    // Sessions have no fixed edges, and the two versions' sessions of a key may differ
    // (that is what a backfill fixes): a session of one crossing an edge would count its
    // events twice, or not at all, next to the other's. So a session promotion begins and
    // ends at points inside no session of either version.
    let mut from_us = from_us;
    if sessions && to_us > from_us {
        match free_edges(&ctx, [ns_table.name(), live_table.name()], from_us, to_us).await? {
            Some((a, b)) if a < b => (from_us, to_us) = (a, b),
            _ => {
                return Err(RunnerError::new(
                    ErrorKind::Conflict,
                    format!(
                        "no session of the backfill in `{}` can be promoted: between {} and {} \
                         ({}) no two points lie outside every session of both versions, and a \
                         session promotion begins and ends at such points (a session crossing \
                         an edge would count its events twice, or not at all)",
                        record.namespace,
                        format_rfc3339_micros(from_us),
                        format_rfc3339_micros(to_us),
                        ends_because(cause, at_us, to_us),
                    ),
                ));
            }
        }
    }
    if to_us <= from_us {
        return Err(RunnerError::new(
            ErrorKind::Conflict,
            format!(
                "no window of the backfill in `{}` can be promoted: the promotion would end at \
                 {}, before any window after {} ends ({})",
                record.namespace,
                format_rfc3339_micros(to_us.max(from_us)),
                format_rfc3339_micros(record.from_us),
                ends_because(cause, at_us, to_us),
            ),
        ));
    }
    let promotion = Promotion {
        job: record.job.clone(),
        namespace: record.namespace.clone(),
        job_version: record.job_version,
        live_table: live_table.name().to_string(),
        table: ns_table.name().to_string(),
        from_us,
        to_us,
        promoted_by: by.to_string(),
        promoted_ms: chrono::Utc::now().timestamp_millis(),
        rolled_back_by: None,
        rolled_back_ms: None,
        seq: None,
        rolled_back_seq: None,
    };
    let promotion = lake.promote(&promotion).await?;
    tracing::info!(job = %promotion.job, namespace = %promotion.namespace, by, ends = ?cause, "namespace promoted");
    Ok(Promoted {
        promotion,
        end: cause,
        at_us,
    })
}

/// The first and the last point of `[from_us, to_us]` that no window of `tables` crosses
/// (a window `[start, end)` crosses `t` when `start < t < end`); None when none is free.
async fn free_edges(
    ctx: &SessionContext,
    tables: [&str; 2],
    from_us: i64,
    to_us: i64,
) -> Result<Option<(i64, i64)>> {
    let mut windows: Vec<(i64, i64)> = Vec::new();
    for table in tables {
        let batches = ctx
            .sql(&format!(
                "SELECT arrow_cast(window_start, 'Int64'), arrow_cast(window_end, 'Int64') \
                 FROM {table} WHERE arrow_cast(window_end, 'Int64') > {from_us} \
                 AND arrow_cast(window_start, 'Int64') < {to_us}"
            ))
            .await
            .map_err(|e| RunnerError::new(ErrorKind::Internal, format!("promote: {e}")))?
            .collect()
            .await
            .map_err(|e| RunnerError::new(ErrorKind::Unavailable, format!("promote: {e}")))?;
        for b in &batches {
            let column = |i: usize| {
                b.column(i)
                    .as_primitive_opt::<arrow::datatypes::Int64Type>()
                    .ok_or_else(|| {
                        RunnerError::new(ErrorKind::Internal, "promote: window bounds not Int64")
                    })
            };
            let (starts, ends) = (column(0)?, column(1)?);
            windows.extend(starts.iter().zip(ends.iter()).filter_map(|(s, e)| s.zip(e)));
        }
    }
    Ok(free_points(windows, from_us, to_us))
}

/// [`free_edges`] over `windows` (start, end): besides the bounds themselves, the free
/// points are where a run of overlapping windows begins or ends.
fn free_points(mut windows: Vec<(i64, i64)>, from_us: i64, to_us: i64) -> Option<(i64, i64)> {
    windows.sort_unstable();
    let crosses = |t: i64| windows.iter().any(|&(s, e)| s < t && t < e);
    let mut free = Vec::new();
    let mut reach = i64::MIN;
    for &(s, e) in &windows {
        if reach <= s {
            if reach > i64::MIN {
                free.push(reach);
            }
            free.push(s);
        }
        reach = reach.max(e);
    }
    if reach > i64::MIN {
        free.push(reach);
    }
    let first = if crosses(from_us) {
        free.iter().copied().find(|&t| t >= from_us && t <= to_us)
    } else {
        Some(from_us)
    };
    let last = if crosses(to_us) {
        free.iter()
            .rev()
            .copied()
            .find(|&t| t <= to_us && t >= from_us)
    } else {
        Some(to_us)
    };
    first.zip(last)
}

/// A session job's gap, µs (0 for other windows).
fn session_gap(spec: &JobSpec) -> i64 {
    match spec.window {
        WindowSpec::Session { gap } => micros(gap),
        _ => 0,
    }
}

/// The point every promoted window must end by, and what sets it: the earliest of the
/// range's end, the input's watermark, where the live job can no longer correct windows
/// (`live_watermark` minus the allowed lateness, and a gap for sessions, since a late
/// record can open one up to a gap before that), and the time of the first record the
/// backfill never read (`first_unread`): the live windows holding it change (for
/// sessions, those ending after it, which it extends, and the one it may open).
fn last_end(
    range_end: i64,
    input_watermark: i64,
    live: &JobSpec,
    live_watermark: Option<i64>,
    first_unread: Option<i64>,
) -> (i64, PromotionEnd) {
    let gap = session_gap(live);
    let retired_by = live_watermark.map(|w| {
        w.saturating_sub(micros(live.lateness.allowed))
            .saturating_sub(gap)
    });
    [
        (Some(range_end), PromotionEnd::RangeEnd),
        (Some(input_watermark), PromotionEnd::InputWatermark),
        (retired_by, PromotionEnd::LiveCanCorrect),
        (first_unread, PromotionEnd::Unread),
    ]
    .into_iter()
    .filter_map(|(t, why)| Some((t?, why)))
    .min_by_key(|(t, _)| *t)
    .unwrap_or((range_end, PromotionEnd::RangeEnd))
}

/// The earliest event time in `[from_us, until_us)` of the records `live` reads that
/// were committed after sequence number `seq` and that the live job counts or may count:
/// not routed late by it (one it has not read yet counts), and not a copy of a record
/// committed by `seq` that claimed its identity (of the job's types, its key and identity
/// not null) with the same event time, which it drops as a duplicate. A copy stamped
/// with another event time counts here, though the live job may drop it too: the
/// promotion only ends earlier.
async fn first_unread(
    lake: &Lake,
    ctx: &SessionContext,
    live: &JobSpec,
    seq: i64,
    (from_us, until_us): (i64, i64),
) -> Result<Option<i64>> {
    let events = TableReference::full(SQL_CATALOG, NAMESPACE, "promote_events");
    ctx.register_table(
        events.clone(),
        Arc::new(
            LakeTableProvider::new(lake.clone(), LakeTable::Events, SnapshotChoice::Current)
                .with_commit_sequence(),
        ),
    )
    .map_err(|e| RunnerError::new(ErrorKind::Internal, format!("promote: {e}")))?;
    let ident = |c: &str| format!("\"{}\"", c.replace('"', "\"\""));
    let types = |t: &str| {
        if live.source.event_types.is_empty() {
            return String::new();
        }
        let list: Vec<String> = live
            .source
            .event_types
            .iter()
            .map(|e| format!("'{}'", sql_text(e)))
            .collect();
        format!("AND {t}.event_type IN ({})", list.join(", "))
    };
    let order = |t: &str| format!("coalesce({t}.{LINEAGE_COLUMN}, {t}.{COMMIT_SEQUENCE_COLUMN})");
    let time = ident(&live.time.event_time_column);
    let identity: Vec<String> = live.dedup.identity.iter().map(|c| ident(c)).collect();
    // The records committed after `seq` (a file's sequence is never below its rows', so
    // the files of earlier commits are not read) that the live job did not route late.
    // The landing table's own columns identify a late record, as the job records them.
    let unread = format!(
        "SELECT e.tenant, e.event_id, e.event_time, e.ingest_time, {ids}, e.{time} AS t \
         FROM {events} e \
         WHERE e.{COMMIT_SEQUENCE_COLUMN} > {seq} AND {order_e} > {seq} \
         AND e.{time} >= TIMESTAMP '{from}' AND e.{time} < TIMESTAMP '{until}' {types_e} \
         AND NOT EXISTS (SELECT 1 FROM {SQL_CATALOG}.{NAMESPACE}.late_events l \
         WHERE l.job = '{job}' AND l.namespace = 'live' AND l.tenant = e.tenant \
         AND l.event_id = e.event_id AND l.event_time = e.event_time \
         AND l.ingest_time = e.ingest_time)",
        ids = identity
            .iter()
            .enumerate()
            .map(|(i, c)| format!("e.{c} AS id{i}"))
            .collect::<Vec<_>>()
            .join(", "),
        order_e = order("e"),
        types_e = types("e"),
        job = sql_text(&live.name),
        from = format_rfc3339_micros(from_us),
        until = format_rfc3339_micros(until_us),
    );
    let [Some(lo), Some(hi)] = one_row(
        ctx,
        &format!(
            "SELECT min(arrow_cast(t, 'Int64')), max(arrow_cast(t, 'Int64')) FROM ({unread}) x"
        ),
    )
    .await?
    else {
        return Ok(None);
    };
    // The copies that claimed the identity before (committed by `seq`, of the job's types,
    // key and identity not null) lie in the same span of event time.
    let same_identity: Vec<String> = identity
        .iter()
        .enumerate()
        .map(|(i, c)| format!("p.{c} = u.id{i}"))
        .collect();
    let not_null: Vec<String> = live
        .key
        .columns
        .iter()
        .map(|c| ident(c))
        .chain(identity.iter().cloned())
        .map(|c| format!("p.{c} IS NOT NULL"))
        .collect();
    let [first] = one_row(
        ctx,
        &format!(
            "SELECT min(arrow_cast(u.t, 'Int64')) FROM ({unread}) u WHERE NOT EXISTS ( \
             SELECT 1 FROM {events} p WHERE p.{time} >= TIMESTAMP '{lo}' \
             AND p.{time} <= TIMESTAMP '{hi}' AND {order_p} <= {seq} {types_p} \
             AND {not_null} AND {same_identity} AND p.{time} = u.t)",
            order_p = order("p"),
            types_p = types("p"),
            not_null = not_null.join(" AND "),
            same_identity = same_identity.join(" AND "),
            lo = format_rfc3339_micros(lo),
            hi = format_rfc3339_micros(hi),
        ),
    )
    .await?;
    Ok(first)
}

/// `text` as the inside of an SQL string literal.
fn sql_text(text: &str) -> String {
    text.replace('\'', "''")
}

/// The first `N` integer columns of a one-row answer to `sql` (null, missing or no row:
/// None).
async fn one_row<const N: usize>(ctx: &SessionContext, sql: &str) -> Result<[Option<i64>; N]> {
    let batches = ctx
        .sql(sql)
        .await
        .map_err(|e| RunnerError::new(ErrorKind::Internal, format!("promote: {e}")))?
        .collect()
        .await
        .map_err(|e| RunnerError::new(ErrorKind::Unavailable, format!("promote: {e}")))?;
    Ok(std::array::from_fn(|i| {
        let c = batches
            .iter()
            .find(|b| b.num_rows() > 0)?
            .columns()
            .get(i)?
            .as_primitive_opt::<arrow::datatypes::Int64Type>()?;
        (!c.is_null(0)).then(|| c.value(0))
    }))
}

/// The size of a window shape that tiles time (tumbling, or sliding by its own size), µs.
fn tumbling_size(window: &WindowSpec) -> Option<i64> {
    match window {
        WindowSpec::Tumbling { size } => Some(micros(*size)),
        WindowSpec::Sliding { size, slide } if size == slide => Some(micros(*size)),
        _ => None,
    }
}

/// The least common multiple of two positive lengths (saturating).
fn lcm(a: i64, b: i64) -> i64 {
    let (mut x, mut y) = (a.max(1), b.max(1));
    while y != 0 {
        (x, y) = (y, x % y);
    }
    (a.max(1) / x).saturating_mul(b.max(1))
}

/// `t` rounded up to a multiple of `step`.
fn ceil_to(t: i64, step: i64) -> i64 {
    let r = t.rem_euclid(step);
    if r == 0 {
        t
    } else {
        t.saturating_add(step - r)
    }
}

/// The backfill of `job` in `namespace`, or `NotFound`.
pub async fn backfill_record(lake: &Lake, job: &str, namespace: &str) -> Result<BackfillRecord> {
    BackfillStore::open(lake.clone())
        .await?
        .require(job, namespace)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_promotion_ends_where_the_live_outputs_can_still_change() {
        let min = 60_000_000;
        let sessions = JobSpec::from_toml(include_str!("../../../jobs/withdrawals.toml")).unwrap();
        let tumbling =
            JobSpec::from_toml(include_str!("../../../jobs/market_aggregates.toml")).unwrap();
        // Withdrawals: 10 min of lateness, sessions of a 5-minute gap. A late record at
        // the watermark less 15 min opens a session there; one just after is late.
        assert_eq!(
            last_end(600 * min, 590 * min, &sessions, Some(500 * min), None),
            (485 * min, PromotionEnd::LiveCanCorrect)
        );
        // Market aggregates: 2 h of lateness, tumbling: the window ending 2 h before the
        // watermark has retired.
        assert_eq!(
            last_end(600 * min, 590 * min, &tumbling, Some(500 * min), None),
            (380 * min, PromotionEnd::LiveCanCorrect)
        );
        // A record the backfill never read: the windows holding it (the crossing ones are
        // found apart).
        assert_eq!(
            last_end(
                600 * min,
                590 * min,
                &sessions,
                Some(900 * min),
                Some(300 * min)
            ),
            (300 * min, PromotionEnd::Unread)
        );
        assert_eq!(
            last_end(600 * min, 590 * min, &tumbling, None, Some(300 * min)),
            (300 * min, PromotionEnd::Unread)
        );
        // No live outputs: the input's watermark, or the range.
        assert_eq!(
            last_end(600 * min, 590 * min, &tumbling, None, None),
            (590 * min, PromotionEnd::InputWatermark)
        );
        assert_eq!(
            last_end(500 * min, 590 * min, &tumbling, None, None),
            (500 * min, PromotionEnd::RangeEnd)
        );
    }

    #[test]
    fn a_session_promotion_begins_and_ends_where_no_session_crosses() {
        // Two versions' sessions of a key, (10, 30) and (25, 50), and another's (60, 70).
        let windows = vec![(10, 30), (25, 50), (60, 70), (60, 65)];
        assert_eq!(free_points(windows.clone(), 0, 100), Some((0, 100)));
        assert_eq!(free_points(windows.clone(), 20, 62), Some((50, 60)));
        assert_eq!(free_points(windows.clone(), 20, 68), Some((50, 60)));
        assert_eq!(free_points(windows.clone(), 12, 55), Some((50, 55)));
        assert_eq!(free_points(windows.clone(), 12, 28), None);
        assert_eq!(free_points(windows.clone(), 30, 40), None);
        assert_eq!(free_points(windows, 50, 60), Some((50, 60)));
    }

    #[test]
    fn edges_no_window_of_two_tumbling_shapes_crosses() {
        let min = 60_000_000;
        assert_eq!(lcm(min, 5 * min), 5 * min);
        assert_eq!(lcm(4 * min, 6 * min), 12 * min);
        assert_eq!(ceil_to(61 * min, 5 * min), 65 * min);
        assert_eq!(ceil_to(60 * min, 5 * min), 60 * min);
        assert_eq!(ceil_to(-min, 5 * min), 0);
        let minute = std::time::Duration::from_secs(60);
        assert_eq!(
            tumbling_size(&WindowSpec::Sliding {
                size: minute,
                slide: minute
            }),
            tumbling_size(&WindowSpec::Tumbling { size: minute })
        );
        assert_eq!(
            tumbling_size(&WindowSpec::Sliding {
                size: 10 * minute,
                slide: minute
            }),
            None
        );
    }
}
