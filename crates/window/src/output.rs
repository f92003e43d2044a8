//! What the engine emits: versioned output rows and late records, and their Arrow form.

use std::sync::Arc;

use arrow::array::{
    ArrayRef, BooleanBuilder, Float64Builder, Int64Builder, RecordBatch, StringBuilder,
    TimestampMicrosecondBuilder,
};
use arrow::compute::take;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use serde::{Deserialize, Serialize};
use signalweave_model::ErrorKind;

use crate::error::{Result, WindowError};
use crate::spec::{AggregateFunction, JobSpec};

/// How complete an emitted version is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Completeness {
    /// An early result: the watermark has not passed the window's end.
    Provisional,
    /// The result when the watermark passed the window's end.
    OnTime,
    /// A later result: late events (within allowed lateness) changed the window, or a
    /// session merge retracted it.
    Corrected,
    /// A backfill's window that crosses the end of its range: it counts only the events
    /// before the range's end.
    Partial,
}

impl Completeness {
    /// The stored string.
    pub fn as_str(self) -> &'static str {
        match self {
            Completeness::Provisional => "provisional",
            Completeness::OnTime => "on_time",
            Completeness::Corrected => "corrected",
            Completeness::Partial => "partial",
        }
    }
}

/// An aggregate's value in an output row.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum AggValue {
    /// Count, sum, min or max.
    Int(i64),
    /// Avg.
    Float(f64),
    /// No contributing value (sum/min/max/avg over nothing).
    Null,
}

/// One emitted version of one output identity `(job, namespace, key, window_start, window_end)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutputRow {
    /// Key value (multi-column keys joined with `|`), shared with the engine's key table.
    #[serde(with = "shared_str")]
    pub key: Arc<str>,
    /// Window start, µs (inclusive).
    pub window_start: i64,
    /// Window end, µs (exclusive).
    pub window_end: i64,
    /// Strictly increasing per identity, from 1.
    pub output_version: u32,
    /// Completeness of this version.
    pub completeness: Completeness,
    /// True when this version withdraws the identity (a session merged into another).
    pub retracted: bool,
    /// The watermark when emitted, µs.
    pub watermark: i64,
    /// Processing time of the emission, µs.
    pub emitted_at: i64,
    /// Smallest event time counted, µs.
    pub first_event_time: i64,
    /// Largest event time counted, µs.
    pub last_event_time: i64,
    /// Records counted.
    pub events: i64,
    /// Aggregate values, in the spec's order.
    pub values: Vec<AggValue>,
}

/// A record the job did not count in any window, with why.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LateRecord {
    /// Row in the input batch.
    pub row: u32,
    /// Why.
    pub reason: LateReason,
    /// Watermark when classified, µs.
    pub watermark: i64,
}

/// Why a record went to the late output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LateReason {
    /// Every window it belongs to was closed: later than allowed lateness.
    BeyondAllowedLateness,
    /// A key column was null: it belongs to no key.
    NullKey,
}

impl LateReason {
    /// The stored string.
    pub fn as_str(self) -> &'static str {
        match self {
            LateReason::BeyondAllowedLateness => "beyond_allowed_lateness",
            LateReason::NullKey => "null_key",
        }
    }
}

/// The result of processing one batch: records routed away from the windows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchOutcome {
    /// Records that updated a window.
    pub counted: u64,
    /// Records filtered out by `source.event_types`.
    pub filtered: u64,
    /// Repeats of an identity within the dedup horizon.
    pub duplicates: u64,
    /// Records sent to the late output.
    pub late: Vec<LateRecord>,
}

/// The Arrow schema of a job's output table (types an Iceberg table stores as they are:
/// versions and counts are `Int64`).
pub fn output_schema(spec: &JobSpec) -> SchemaRef {
    let ts = || DataType::Timestamp(TimeUnit::Microsecond, Some("+00:00".into()));
    let mut fields = vec![
        Field::new("job", DataType::Utf8, false),
        Field::new("namespace", DataType::Utf8, false),
        Field::new("job_version", DataType::Int64, false),
        Field::new("key", DataType::Utf8, false),
        Field::new("window_start", ts(), false),
        Field::new("window_end", ts(), false),
        Field::new("output_version", DataType::Int64, false),
        Field::new("completeness", DataType::Utf8, false),
        Field::new("retracted", DataType::Boolean, false),
        Field::new("watermark", ts(), false),
        Field::new("emitted_at", ts(), false),
        Field::new("input_snapshot", DataType::Int64, true),
        Field::new("first_event_time", ts(), false),
        Field::new("last_event_time", ts(), false),
        Field::new("events", DataType::Int64, false),
    ];
    for a in &spec.aggregates {
        let dt = match a.function {
            AggregateFunction::Avg => DataType::Float64,
            _ => DataType::Int64,
        };
        fields.push(Field::new(&a.name, dt, true));
    }
    Arc::new(Schema::new(fields))
}

/// Output rows as one batch of [`output_schema`]. `input_snapshots[i]` is the snapshot of
/// the source that row `i` reflects (the input position of its emission; `None` or a
/// short slice: unknown).
pub fn outputs_to_batch(
    spec: &JobSpec,
    namespace: &str,
    rows: &[OutputRow],
    input_snapshots: &[Option<i64>],
) -> Result<RecordBatch> {
    let n = rows.len();
    let ts = || TimestampMicrosecondBuilder::with_capacity(n).with_timezone("+00:00");
    let (mut job, mut ns, mut key, mut comp) = (
        StringBuilder::new(),
        StringBuilder::new(),
        StringBuilder::new(),
        StringBuilder::new(),
    );
    let mut jv = Int64Builder::with_capacity(n);
    let mut ver = Int64Builder::with_capacity(n);
    let mut retracted = BooleanBuilder::with_capacity(n);
    let (mut ws, mut we, mut wm, mut at, mut first, mut last) =
        (ts(), ts(), ts(), ts(), ts(), ts());
    let mut events = Int64Builder::with_capacity(n);
    let mut input = Int64Builder::with_capacity(n);
    let mut ints: Vec<Int64Builder> = Vec::new();
    let mut floats: Vec<Float64Builder> = Vec::new();
    for a in &spec.aggregates {
        match a.function {
            AggregateFunction::Avg => floats.push(Float64Builder::with_capacity(n)),
            _ => ints.push(Int64Builder::with_capacity(n)),
        }
    }
    for (i, r) in rows.iter().enumerate() {
        input.append_option(input_snapshots.get(i).copied().flatten());
        job.append_value(&spec.name);
        ns.append_value(namespace);
        jv.append_value(i64::from(spec.version));
        key.append_value(&r.key);
        ws.append_value(r.window_start);
        we.append_value(r.window_end);
        ver.append_value(i64::from(r.output_version));
        comp.append_value(r.completeness.as_str());
        retracted.append_value(r.retracted);
        wm.append_value(r.watermark);
        at.append_value(r.emitted_at);
        first.append_value(r.first_event_time);
        last.append_value(r.last_event_time);
        events.append_value(r.events);
        let (mut i, mut f) = (0, 0);
        for (a, v) in spec.aggregates.iter().zip(&r.values) {
            if a.function == AggregateFunction::Avg {
                match v {
                    AggValue::Float(x) => floats[f].append_value(*x),
                    _ => floats[f].append_null(),
                }
                f += 1;
            } else {
                match v {
                    AggValue::Int(x) => ints[i].append_value(*x),
                    _ => ints[i].append_null(),
                }
                i += 1;
            }
        }
    }
    let mut columns: Vec<ArrayRef> = vec![
        Arc::new(job.finish()),
        Arc::new(ns.finish()),
        Arc::new(jv.finish()),
        Arc::new(key.finish()),
        Arc::new(ws.finish()),
        Arc::new(we.finish()),
        Arc::new(ver.finish()),
        Arc::new(comp.finish()),
        Arc::new(retracted.finish()),
        Arc::new(wm.finish()),
        Arc::new(at.finish()),
        Arc::new(input.finish()),
        Arc::new(first.finish()),
        Arc::new(last.finish()),
        Arc::new(events.finish()),
    ];
    let (mut i, mut f) = (0, 0);
    for a in &spec.aggregates {
        if a.function == AggregateFunction::Avg {
            columns.push(Arc::new(floats[f].finish()));
            f += 1;
        } else {
            columns.push(Arc::new(ints[i].finish()));
            i += 1;
        }
    }
    RecordBatch::try_new(output_schema(spec), columns)
        .map_err(|e| WindowError::new(ErrorKind::Internal, format!("output batch: {e}")))
}

/// The late records of `batch` as rows of that batch plus `reason` and `watermark` columns.
pub fn late_rows(batch: &RecordBatch, late: &[LateRecord]) -> Result<RecordBatch> {
    let indices = arrow::array::UInt32Array::from_iter_values(late.iter().map(|l| l.row));
    let mut columns: Vec<ArrayRef> = batch
        .columns()
        .iter()
        .map(|c| take(c, &indices, None))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| WindowError::new(ErrorKind::Internal, format!("late rows: {e}")))?;
    let mut reason = StringBuilder::new();
    let mut wm = TimestampMicrosecondBuilder::new().with_timezone("+00:00");
    for l in late {
        reason.append_value(l.reason.as_str());
        wm.append_value(l.watermark);
    }
    columns.push(Arc::new(reason.finish()));
    columns.push(Arc::new(wm.finish()));
    let mut fields: Vec<Field> = batch
        .schema()
        .fields()
        .iter()
        .map(|f| f.as_ref().clone())
        .collect();
    fields.push(Field::new("late_reason", DataType::Utf8, false));
    fields.push(Field::new(
        "late_watermark",
        DataType::Timestamp(TimeUnit::Microsecond, Some("+00:00".into())),
        false,
    ));
    RecordBatch::try_new(Arc::new(Schema::new(fields)), columns)
        .map_err(|e| WindowError::new(ErrorKind::Internal, format!("late rows: {e}")))
}

/// Serde for a shared string, as a plain string.
mod shared_str {
    use std::sync::Arc;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Arc<str>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(value)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Arc<str>, D::Error> {
        String::deserialize(d).map(Arc::from)
    }
}
