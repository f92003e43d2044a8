//! What the engine emits: versioned output rows and late records, and their Arrow form.

use std::sync::Arc;

use arrow::array::{
    ArrayRef, BooleanArray, Float64Array, Int64Array, RecordBatch, StringArray, StringBuilder,
    TimestampMicrosecondArray, TimestampMicrosecondBuilder,
};
use arrow::buffer::{Buffer, NullBuffer, OffsetBuffer, ScalarBuffer};
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

/// One emitted version of one output identity `(job, namespace, key, window_start, window_end)`,
/// as a row: [`Emissions`] holds them column by column.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutputRow {
    /// Key value (multi-column keys joined with `|`).
    pub key: String,
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

/// One version the engine emits, apart from its accumulator (see [`Emissions::push_acc`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Version<'a> {
    pub key: &'a str,
    pub window: (i64, i64),
    pub output_version: u32,
    pub completeness: Completeness,
    pub retracted: bool,
    pub watermark: i64,
    pub emitted_at: i64,
}

impl<'a> Version<'a> {
    /// A version that states its window's counts (not a retraction).
    pub fn counted(
        key: &'a str,
        window: (i64, i64),
        output_version: u32,
        completeness: Completeness,
        watermark: i64,
        emitted_at: i64,
    ) -> Self {
        Self {
            key,
            window,
            output_version,
            completeness,
            retracted: false,
            watermark,
            emitted_at,
        }
    }
}

/// One aggregate's values, one per row: an avg as the bits of its `f64`, and whether the
/// row has a value at all.
///
/// `valid` is empty while every row has a value, and filled at the first that has none.
/// A count always has one, and so does a sum or maximum over a column without nulls: their
/// emissions write no flag, and their Arrow column has no null buffer. An emission of the
/// early trigger costs about what its columns cost to write (see BENCHMARKS.md, "Stop
/// 41"): customer_features' sliding job, whose three values are never null, runs about 4%
/// faster without the flags. Two columns compare equal when their values and their
/// validity do, whichever form each holds (states written before hold every flag).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct ValueColumn {
    float: bool,
    values: Vec<i64>,
    /// Empty (every row has a value), or one flag per row.
    valid: Vec<bool>,
}

impl PartialEq for ValueColumn {
    fn eq(&self, other: &Self) -> bool {
        self.float == other.float
            && self.values == other.values
            && (0..self.values.len()).all(|i| self.is_valid(i) == other.is_valid(i))
    }
}

impl ValueColumn {
    #[inline]
    fn is_valid(&self, row: usize) -> bool {
        self.valid.is_empty() || self.valid[row]
    }

    fn get(&self, row: usize) -> AggValue {
        match (self.is_valid(row), self.float) {
            (false, _) => AggValue::Null,
            (true, true) => AggValue::Float(f64::from_bits(self.values[row] as u64)),
            (true, false) => AggValue::Int(self.values[row]),
        }
    }

    /// Appends `value`, or a row without one.
    #[inline]
    fn push_value(&mut self, value: i64, valid: bool) {
        if !valid || !self.valid.is_empty() {
            // Flags for the rows before, if not yet held.
            self.valid.resize(self.values.len(), true);
            self.valid.push(valid);
        }
        self.values.push(value);
    }

    fn push(&mut self, v: AggValue) {
        let (value, valid) = match v {
            AggValue::Int(x) => (x, true),
            AggValue::Float(x) => {
                self.float = true;
                (x.to_bits() as i64, true)
            }
            AggValue::Null => (0, false),
        };
        self.push_value(value, valid);
    }

    /// Moves `other`'s rows to the end of these.
    fn append(&mut self, other: &mut ValueColumn) {
        self.float |= other.float;
        match (self.valid.is_empty(), other.valid.is_empty()) {
            (true, true) => {}
            (true, false) => {
                self.valid.resize(self.values.len(), true);
                self.valid.append(&mut other.valid);
            }
            (false, true) => self
                .valid
                .resize(self.values.len() + other.values.len(), true),
            (false, false) => self.valid.append(&mut other.valid),
        }
        self.values.append(&mut other.values);
    }

    /// The validity as Arrow holds it: none while every row has a value.
    fn nulls(&self) -> Option<NullBuffer> {
        (!self.valid.is_empty()).then(|| NullBuffer::from(self.valid.clone()))
    }
}

/// Emitted versions, column by column: what [`WindowEngine::fire`] and
/// [`WindowEngine::finish`] return, and what the sink writes with [`Emissions::to_batch`].
///
/// An emission appends a few values to each column, with no allocation of its own: the
/// engine's early trigger emits many versions per event (a sliding window's pane is in
/// every window that covers it), so a version costs what its columns cost. Row views
/// ([`Emissions::rows`]) are for tests, state snapshots and the odd consumer.
///
/// [`WindowEngine::fire`]: crate::WindowEngine::fire
/// [`WindowEngine::finish`]: crate::WindowEngine::finish
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Emissions {
    /// Keys back to back; row `i`'s key is `key_bytes[key_offsets[i]..key_offsets[i + 1]]`
    /// (`key_offsets` is empty or one longer than the rows, as Arrow's offsets).
    key_bytes: String,
    key_offsets: Vec<i32>,
    window_start: Vec<i64>,
    window_end: Vec<i64>,
    output_version: Vec<u32>,
    completeness: Vec<Completeness>,
    retracted: Vec<bool>,
    watermark: Vec<i64>,
    emitted_at: Vec<i64>,
    first_event_time: Vec<i64>,
    last_event_time: Vec<i64>,
    events: Vec<i64>,
    /// Per aggregate, in the spec's order.
    values: Vec<ValueColumn>,
}

impl Emissions {
    /// Versions held.
    pub fn len(&self) -> usize {
        self.window_start.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.window_start.is_empty()
    }

    /// Row `i`'s key value.
    pub fn key(&self, i: usize) -> &str {
        &self.key_bytes[self.key_offsets[i] as usize..self.key_offsets[i + 1] as usize]
    }

    /// Window starts, µs.
    pub fn window_start(&self) -> &[i64] {
        &self.window_start
    }

    /// Window ends, µs.
    pub fn window_end(&self) -> &[i64] {
        &self.window_end
    }

    /// Whether each row withdraws its identity.
    pub fn retracted(&self) -> &[bool] {
        &self.retracted
    }

    /// Completeness of each row, to restate (a backfill marks the windows its range cuts).
    pub fn completeness_mut(&mut self) -> &mut [Completeness] {
        &mut self.completeness
    }

    /// The watermark of each row, to restate.
    pub fn watermark_mut(&mut self) -> &mut [i64] {
        &mut self.watermark
    }

    /// The emission time of each row, to restate.
    pub fn emitted_at_mut(&mut self) -> &mut [i64] {
        &mut self.emitted_at
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> OutputRow {
        OutputRow {
            key: self.key(i).to_string(),
            window_start: self.window_start[i],
            window_end: self.window_end[i],
            output_version: self.output_version[i],
            completeness: self.completeness[i],
            retracted: self.retracted[i],
            watermark: self.watermark[i],
            emitted_at: self.emitted_at[i],
            first_event_time: self.first_event_time[i],
            last_event_time: self.last_event_time[i],
            events: self.events[i],
            values: self.values.iter().map(|c| c.get(i)).collect(),
        }
    }

    /// Every row, in emission order.
    pub fn rows(&self) -> impl ExactSizeIterator<Item = OutputRow> + '_ {
        (0..self.len()).map(|i| self.row(i))
    }

    /// Appends `row`.
    pub fn push_row(&mut self, row: &OutputRow) {
        self.push_head(
            Version {
                key: &row.key,
                window: (row.window_start, row.window_end),
                output_version: row.output_version,
                completeness: row.completeness,
                retracted: row.retracted,
                watermark: row.watermark,
                emitted_at: row.emitted_at,
            },
            [row.first_event_time, row.last_event_time, row.events],
        );
        if self.values.len() < row.values.len() {
            let filled = ValueColumn {
                float: false,
                values: vec![0; self.len() - 1],
                valid: vec![false; self.len() - 1],
            };
            self.values.resize(row.values.len(), filled);
        }
        for (i, c) in self.values.iter_mut().enumerate() {
            c.push(row.values.get(i).copied().unwrap_or(AggValue::Null));
        }
    }

    /// Appends a version whose accumulator is `acc`, laid out as `aggs` says: each
    /// aggregate's function and first slot (its value, then the values it counted), after
    /// the slots of `[first, last, events]` at `header`.
    pub(crate) fn push_acc(
        &mut self,
        v: Version<'_>,
        acc: &[i64],
        header: [usize; 3],
        aggs: &[(AggregateFunction, usize)],
    ) {
        self.push_head(v, header.map(|s| acc[s]));
        if self.len() == 1 {
            // The first row shapes the value columns (kept from a clear, or new), with as
            // much room as the other columns were given.
            let room = self.window_start.capacity();
            self.values.resize_with(aggs.len(), ValueColumn::default);
            for (c, (f, _)) in self.values.iter_mut().zip(aggs) {
                c.float = *f == AggregateFunction::Avg;
                c.values.reserve(room);
            }
        }
        for (c, (f, s)) in self.values.iter_mut().zip(aggs) {
            let value = acc[*s];
            let (value, valid) = match f {
                AggregateFunction::Count => (value, true),
                _ if acc[*s + 1] == 0 => (0, false),
                AggregateFunction::Avg => {
                    ((value as f64 / acc[*s + 1] as f64).to_bits() as i64, true)
                }
                _ => (value, true),
            };
            c.push_value(value, valid);
        }
    }

    fn push_head(&mut self, v: Version<'_>, [first, last, events]: [i64; 3]) {
        if self.key_offsets.is_empty() {
            self.key_offsets.push(0);
        }
        self.key_bytes.push_str(v.key);
        self.key_offsets.push(self.key_bytes.len() as i32);
        self.window_start.push(v.window.0);
        self.window_end.push(v.window.1);
        self.output_version.push(v.output_version);
        self.completeness.push(v.completeness);
        self.retracted.push(v.retracted);
        self.watermark.push(v.watermark);
        self.emitted_at.push(v.emitted_at);
        self.first_event_time.push(first);
        self.last_event_time.push(last);
        self.events.push(events);
    }

    /// Room for `additional` more rows.
    pub(crate) fn reserve(&mut self, additional: usize) {
        // Keys of the length seen so far (or of 16 bytes).
        let key_len = match self.len() {
            0 => 16,
            n => self.key_bytes.len().div_ceil(n),
        };
        self.key_bytes.reserve(additional.saturating_mul(key_len));
        self.key_offsets.reserve(additional + 1);
        self.window_start.reserve(additional);
        self.window_end.reserve(additional);
        self.output_version.reserve(additional);
        self.completeness.reserve(additional);
        self.retracted.reserve(additional);
        self.watermark.reserve(additional);
        self.emitted_at.reserve(additional);
        self.first_event_time.reserve(additional);
        self.last_event_time.reserve(additional);
        self.events.reserve(additional);
        for c in &mut self.values {
            c.values.reserve(additional);
            if !c.valid.is_empty() {
                c.valid.reserve(additional);
            }
        }
    }

    /// Moves `other`'s rows to the end of these, leaving `other` empty, to hand back to
    /// [`WindowEngine::recycle`]. As [`Vec::append`], `other` keeps its memory, except
    /// when these are empty: then the two swap columns whole, and `other` keeps these
    /// ones' memory.
    ///
    /// [`WindowEngine::recycle`]: crate::WindowEngine::recycle
    pub fn append(&mut self, other: &mut Emissions) {
        if self.is_empty() {
            std::mem::swap(self, other);
            other.clear();
            return;
        }
        if other.is_empty() {
            return;
        }
        let base = *self.key_offsets.last().unwrap_or(&0);
        self.key_bytes.push_str(&other.key_bytes);
        self.key_offsets
            .extend(other.key_offsets[1..].iter().map(|o| o + base));
        self.window_start.append(&mut other.window_start);
        self.window_end.append(&mut other.window_end);
        self.output_version.append(&mut other.output_version);
        self.completeness.append(&mut other.completeness);
        self.retracted.append(&mut other.retracted);
        self.watermark.append(&mut other.watermark);
        self.emitted_at.append(&mut other.emitted_at);
        self.first_event_time.append(&mut other.first_event_time);
        self.last_event_time.append(&mut other.last_event_time);
        self.events.append(&mut other.events);
        for (c, o) in self.values.iter_mut().zip(other.values.iter_mut()) {
            c.append(o);
        }
        other.clear();
    }

    /// Removes every row, keeping the memory of every column. The result holds no rows
    /// but still an (empty) column per aggregate, so it does not compare equal to
    /// [`Emissions::default`].
    pub fn clear(&mut self) {
        self.key_bytes.clear();
        self.key_offsets.clear();
        self.window_start.clear();
        self.window_end.clear();
        self.output_version.clear();
        self.completeness.clear();
        self.retracted.clear();
        self.watermark.clear();
        self.emitted_at.clear();
        self.first_event_time.clear();
        self.last_event_time.clear();
        self.events.clear();
        for c in &mut self.values {
            c.float = false;
            c.values.clear();
            c.valid.clear();
        }
    }

    /// Rows held without growing.
    pub(crate) fn capacity(&self) -> usize {
        self.window_start.capacity()
    }

    /// Heap bytes of the columns, held or free.
    pub(crate) fn heap_bytes(&self) -> usize {
        fn bytes<T>(v: &Vec<T>) -> usize {
            v.capacity() * std::mem::size_of::<T>()
        }
        let values: usize = self
            .values
            .iter()
            .map(|c| bytes(&c.values) + bytes(&c.valid))
            .sum();
        self.key_bytes.capacity()
            + bytes(&self.key_offsets)
            + [
                &self.window_start,
                &self.window_end,
                &self.watermark,
                &self.emitted_at,
                &self.first_event_time,
                &self.last_event_time,
                &self.events,
            ]
            .into_iter()
            .map(bytes)
            .sum::<usize>()
            + bytes(&self.output_version)
            + bytes(&self.completeness)
            + bytes(&self.retracted)
            + values
    }

    /// Keeps the rows `keep` says to keep (one flag per row), in order.
    pub fn retain(&mut self, keep: &[bool]) {
        fn each<T>(v: &mut Vec<T>, keep: &[bool]) {
            let mut i = 0;
            v.retain(|_| {
                i += 1;
                keep[i - 1]
            });
        }
        assert_eq!(keep.len(), self.len(), "one flag per row");
        let mut bytes = String::new();
        let mut offsets = vec![0];
        for i in (0..self.len()).filter(|i| keep[*i]) {
            bytes.push_str(self.key(i));
            offsets.push(bytes.len() as i32);
        }
        self.key_bytes = bytes;
        self.key_offsets = offsets;
        each(&mut self.window_start, keep);
        each(&mut self.window_end, keep);
        each(&mut self.output_version, keep);
        each(&mut self.completeness, keep);
        each(&mut self.retracted, keep);
        each(&mut self.watermark, keep);
        each(&mut self.emitted_at, keep);
        each(&mut self.first_event_time, keep);
        each(&mut self.last_event_time, keep);
        each(&mut self.events, keep);
        for c in &mut self.values {
            each(&mut c.values, keep);
            if !c.valid.is_empty() {
                each(&mut c.valid, keep);
            }
        }
    }

    /// The rows as one batch of [`output_schema`]. `input_snapshots[i]` is the snapshot of
    /// the source that row `i` reflects (the input position of its emission; `None` or a
    /// short slice: unknown).
    pub fn to_batch(
        &self,
        spec: &JobSpec,
        namespace: &str,
        input_snapshots: &[Option<i64>],
    ) -> Result<RecordBatch> {
        let n = self.len();
        let internal =
            |e: String| WindowError::new(ErrorKind::Internal, format!("output batch: {e}"));
        if !self.is_empty() && self.values.len() != spec.aggregates.len() {
            return Err(internal(format!(
                "{} value columns for {} aggregates",
                self.values.len(),
                spec.aggregates.len()
            )));
        }
        let ts = |v: &[i64]| -> ArrayRef {
            Arc::new(TimestampMicrosecondArray::from(v.to_vec()).with_timezone("+00:00"))
        };
        let repeat = |s: &str| -> ArrayRef {
            Arc::new(StringArray::from_iter_values(std::iter::repeat_n(s, n)))
        };
        let keys = if self.is_empty() {
            StringArray::from(Vec::<&str>::new())
        } else {
            StringArray::try_new(
                OffsetBuffer::new(ScalarBuffer::from(self.key_offsets.clone())),
                Buffer::from(self.key_bytes.as_bytes()),
                None,
            )
            .map_err(|e| internal(e.to_string()))?
        };
        let mut columns: Vec<ArrayRef> = vec![
            repeat(&spec.name),
            repeat(namespace),
            Arc::new(Int64Array::from_value(i64::from(spec.version), n)),
            Arc::new(keys),
            ts(&self.window_start),
            ts(&self.window_end),
            Arc::new(Int64Array::from_iter_values(
                self.output_version.iter().map(|v| i64::from(*v)),
            )),
            Arc::new(StringArray::from_iter_values(
                self.completeness.iter().map(|c| c.as_str()),
            )),
            Arc::new(BooleanArray::from(self.retracted.clone())),
            ts(&self.watermark),
            ts(&self.emitted_at),
            Arc::new(Int64Array::from_iter(
                (0..n).map(|i| input_snapshots.get(i).copied().flatten()),
            )),
            ts(&self.first_event_time),
            ts(&self.last_event_time),
            Arc::new(Int64Array::from(self.events.clone())),
        ];
        for (i, a) in spec.aggregates.iter().enumerate() {
            let Some(c) = self.values.get(i) else {
                columns.push(if a.function == AggregateFunction::Avg {
                    Arc::new(Float64Array::from(Vec::<f64>::new()))
                } else {
                    Arc::new(Int64Array::from(Vec::<i64>::new()))
                });
                continue;
            };
            let nulls = c.nulls();
            columns.push(if a.function == AggregateFunction::Avg {
                let v: Vec<f64> = c.values.iter().map(|b| f64::from_bits(*b as u64)).collect();
                Arc::new(Float64Array::new(v.into(), nulls))
            } else {
                Arc::new(Int64Array::new(c.values.clone().into(), nulls))
            });
        }
        RecordBatch::try_new(output_schema(spec), columns).map_err(|e| internal(e.to_string()))
    }
}

impl FromIterator<OutputRow> for Emissions {
    fn from_iter<I: IntoIterator<Item = OutputRow>>(rows: I) -> Self {
        let mut out = Emissions::default();
        for r in rows {
            out.push_row(&r);
        }
        out
    }
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

#[cfg(test)]
mod tests {
    use arrow::array::AsArray;
    use arrow::datatypes::{Float64Type, Int64Type};

    use super::*;

    fn spec() -> JobSpec {
        JobSpec::from_toml(
            r#"
            name = "t"
            version = 3
            [source]
            table = "signalweave.events"
            [key]
            columns = ["market_id"]
            [time]
            max_out_of_orderness = "5s"
            [window]
            kind = "tumbling"
            size = "1m"
            [triggers]
            [lateness]
            allowed = "2h"
            [output]
            table = "t"
            [[aggregates]]
            name = "n"
            function = "count"
            [[aggregates]]
            name = "mean"
            function = "avg"
            column = "amount_minor"
            [[aggregates]]
            name = "low"
            function = "min"
            column = "amount_minor"
            "#,
        )
        .unwrap()
    }

    fn row(key: &str, start: i64, values: Vec<AggValue>) -> OutputRow {
        OutputRow {
            key: key.into(),
            window_start: start,
            window_end: start + 60,
            output_version: 1,
            completeness: Completeness::Provisional,
            retracted: false,
            watermark: 7,
            emitted_at: 8,
            first_event_time: start,
            last_event_time: start + 1,
            events: 2,
            values,
        }
    }

    fn rows() -> Vec<OutputRow> {
        vec![
            row(
                "m-1",
                0,
                vec![AggValue::Null, AggValue::Null, AggValue::Null],
            ),
            row(
                "market-two",
                60,
                vec![AggValue::Int(2), AggValue::Float(2.5), AggValue::Int(-4)],
            ),
            row(
                "",
                120,
                vec![AggValue::Int(0), AggValue::Null, AggValue::Int(9)],
            ),
        ]
    }

    #[test]
    fn rows_survive_the_columns_append_and_retain() {
        let all: Emissions = rows().into_iter().collect();
        assert_eq!(all.rows().collect::<Vec<_>>(), rows());
        let mut joined: Emissions = rows()[..1].iter().cloned().collect();
        let mut rest: Emissions = rows()[1..].iter().cloned().collect();
        joined.append(&mut rest);
        assert!(rest.is_empty());
        joined.append(&mut Emissions::default());
        assert_eq!(joined, all);
        joined.retain(&[false, true, true]);
        assert_eq!(joined.rows().collect::<Vec<_>>(), rows()[1..]);
        assert_eq!(joined.key(0), "market-two");
        joined.retain(&[true, false]);
        assert_eq!(joined.rows().collect::<Vec<_>>(), rows()[1..2]);
        // Cleared, the columns keep their memory and take rows as new ones do.
        let room = joined.capacity();
        joined.clear();
        assert!(joined.is_empty() && joined.rows().next().is_none());
        assert_eq!(joined.capacity(), room);
        for r in rows() {
            joined.push_row(&r);
        }
        assert_eq!(joined.rows().collect::<Vec<_>>(), rows());
    }

    #[test]
    fn a_value_column_keeps_flags_only_from_its_first_null() {
        let a = vec![
            row(
                "a",
                0,
                vec![AggValue::Int(1), AggValue::Float(2.0), AggValue::Int(3)],
            ),
            row(
                "a",
                60,
                vec![AggValue::Int(2), AggValue::Null, AggValue::Int(4)],
            ),
        ];
        let b = vec![row(
            "b",
            0,
            vec![AggValue::Int(3), AggValue::Float(1.5), AggValue::Null],
        )];
        let flags = |e: &Emissions| e.values.iter().map(|c| c.valid.len()).collect::<Vec<_>>();
        let all: Emissions = a.iter().chain(&b).cloned().collect();
        assert_eq!(
            all.rows().collect::<Vec<_>>(),
            [a.clone(), b.clone()].concat()
        );
        // The count has no null: no flags. The others have one from their first null.
        assert_eq!(flags(&all), [0, 3, 3]);
        // Appended either way round, the rows and the columns are the same.
        for (first, second) in [(&a, &b), (&b, &a)] {
            let mut joined: Emissions = first.iter().cloned().collect();
            let mut rest: Emissions = second.iter().cloned().collect();
            joined.append(&mut rest);
            let sequential: Emissions = first.iter().chain(second).cloned().collect();
            assert_eq!(joined, sequential);
            assert_eq!(flags(&joined), flags(&sequential));
        }
        // Flags written for every row (as states written before this form hold them)
        // compare equal to none, and read the same.
        let mut full = all.clone();
        full.values[0].valid = vec![true; 3];
        assert_eq!(full, all);
        assert_eq!(
            full.rows().collect::<Vec<_>>(),
            all.rows().collect::<Vec<_>>()
        );
        let restored: Emissions =
            postcard::from_bytes(&postcard::to_allocvec(&full).unwrap()).unwrap();
        assert_eq!(restored, all);
        let mut other = all.clone();
        other.values[0].valid = vec![true, false, true];
        assert_ne!(other, all, "a flag that differs");
        // Kept rows keep their flags; the batch has no null buffer where no row is null.
        let mut kept = all.clone();
        kept.retain(&[true, false, true]);
        assert_eq!(
            kept.rows().collect::<Vec<_>>(),
            [a[0].clone(), b[0].clone()]
        );
        let batch = all.to_batch(&spec(), "ns", &[]).unwrap();
        let n = batch.column_by_name("n").unwrap();
        assert!(n.nulls().is_none());
        let mean = batch.column_by_name("mean").unwrap();
        assert_eq!(mean.null_count(), 1);
        assert!(mean.is_null(1));
    }

    #[test]
    fn an_accumulator_becomes_values_with_nulls_where_nothing_counted() {
        let aggs = [
            (AggregateFunction::Count, 3),
            (AggregateFunction::Avg, 4),
            (AggregateFunction::Min, 6),
        ];
        let v = Version {
            key: "k",
            window: (0, 60),
            output_version: 4,
            completeness: Completeness::OnTime,
            retracted: false,
            watermark: 60,
            emitted_at: 61,
        };
        let mut e = Emissions::default();
        // [events, first, last, count, avg sum, avg counted, min, min counted]
        e.push_acc(v, &[3, 10, 20, 3, 9, 2, -1, 2], [1, 2, 0], &aggs);
        e.push_acc(v, &[1, 10, 10, 1, 0, 0, i64::MAX, 0], [1, 2, 0], &aggs);
        let r = e.row(0);
        assert_eq!(
            (r.events, r.first_event_time, r.last_event_time),
            (3, 10, 20)
        );
        assert_eq!(
            r.values,
            [AggValue::Int(3), AggValue::Float(4.5), AggValue::Int(-1)]
        );
        assert_eq!(
            e.row(1).values,
            [AggValue::Int(1), AggValue::Null, AggValue::Null]
        );
        // The count wrote no flags; the others, one per row from their first null.
        let flags: Vec<usize> = e.values.iter().map(|c| c.valid.len()).collect();
        assert_eq!(flags, [0, 2, 2]);
    }

    #[test]
    fn the_batch_holds_every_row_as_the_schema_types_it() {
        let spec = spec();
        let all: Emissions = rows().into_iter().collect();
        let batch = all.to_batch(&spec, "ns", &[Some(5)]).unwrap();
        assert_eq!(batch.schema(), output_schema(&spec));
        assert_eq!(batch.num_rows(), 3);
        let keys = batch.column_by_name("key").unwrap().as_string::<i32>();
        assert_eq!(
            keys.iter().collect::<Vec<_>>(),
            [Some("m-1"), Some("market-two"), Some("")]
        );
        let input = batch.column_by_name("input_snapshot").unwrap();
        let input = input.as_primitive::<Int64Type>();
        assert_eq!(input.iter().collect::<Vec<_>>(), [Some(5), None, None]);
        let mean = batch
            .column_by_name("mean")
            .unwrap()
            .as_primitive::<Float64Type>();
        assert_eq!(mean.iter().collect::<Vec<_>>(), [None, Some(2.5), None]);
        let low = batch
            .column_by_name("low")
            .unwrap()
            .as_primitive::<Int64Type>();
        assert_eq!(low.iter().collect::<Vec<_>>(), [None, Some(-4), Some(9)]);
        let version = batch.column_by_name("job_version").unwrap();
        assert_eq!(version.as_primitive::<Int64Type>().value(2), 3);
        let empty = Emissions::default().to_batch(&spec, "ns", &[]).unwrap();
        assert_eq!(empty.num_rows(), 0);
    }
}
