//! Test support: building event batches, specs, runs and final outputs.

#![allow(dead_code, clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::RecordBatch;
use signalweave_model::{Event, EventBatchBuilder, EventId, ProducerId, SchemaVersion, TenantId};
use signalweave_window::{AggValue, EngineConfig, JobSpec, OutputRow, WindowEngine};

pub const S: i64 = 1_000_000;

/// A test record: key, event time (µs), identity, amount, event type.
#[derive(Debug, Clone, PartialEq)]
pub struct Rec {
    pub key: String,
    pub t: i64,
    pub id: String,
    pub amount: i64,
    pub event_type: &'static str,
}

pub fn rec(key: &str, t: i64, id: &str, amount: i64) -> Rec {
    Rec {
        key: key.into(),
        t,
        id: id.into(),
        amount,
        event_type: "order_placed",
    }
}

pub fn batch(recs: &[Rec]) -> RecordBatch {
    let mut b = EventBatchBuilder::with_capacity(recs.len());
    for r in recs {
        b.push(&Event {
            event_id: EventId::new(r.id.clone()),
            event_type: r.event_type.into(),
            schema_version: SchemaVersion::new(1, 0, 0),
            tenant: TenantId::new("t"),
            producer_id: ProducerId::new("p"),
            producer_seq: 0,
            event_time_us: r.t,
            ingest_time_us: r.t,
            partition_key: r.key.clone(),
            order_id: Some("o".into()),
            customer_id: Some(r.key.clone()),
            market_id: Some(r.key.clone()),
            business_version: 1,
            amount_minor: Some(r.amount),
            currency: Some("EUR".into()),
            attributes: None,
        });
    }
    b.finish().unwrap()
}

/// [`batch`] with a column `wm`: each record's own watermark (a backfill's arrival
/// watermark; `None` for none).
pub fn batch_with_watermarks(recs: &[Rec], wms: &[Option<i64>]) -> RecordBatch {
    let wm = arrow::array::Int64Array::from(wms.to_vec());
    with_column(batch(recs), "wm", Arc::new(wm))
}

/// `b` with `column` added as the nullable column `name`.
pub fn with_column(b: RecordBatch, name: &str, column: arrow::array::ArrayRef) -> RecordBatch {
    use arrow::datatypes::{Field, Schema};

    let mut fields: Vec<Field> = b.schema().fields().iter().map(|f| (**f).clone()).collect();
    fields.push(Field::new(name, column.data_type().clone(), true));
    let mut columns = b.columns().to_vec();
    columns.push(column);
    RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).unwrap()
}

/// A spec with count, sum and max of `amount_minor` keyed by `market_id`.
pub fn spec(window: &str, bound: &str, lateness: &str, early: Option<&str>) -> Arc<JobSpec> {
    let triggers = early
        .map(|e| format!("[triggers]\nearly_every = \"{e}\"\n"))
        .unwrap_or_default();
    Arc::new(
        JobSpec::from_toml(&format!(
            r#"
name = "t"
version = 1
[source]
table = "signalweave.events"
[key]
columns = ["market_id"]
[time]
max_out_of_orderness = "{bound}"
idle_timeout = "100000h"
[window]
{window}
{triggers}
[lateness]
allowed = "{lateness}"
[[aggregates]]
name = "n"
function = "count"
[[aggregates]]
name = "total"
function = "sum"
column = "amount_minor"
[[aggregates]]
name = "largest"
function = "max"
column = "amount_minor"
[output]
table = "t"
"#
        ))
        .unwrap(),
    )
}

pub fn engine(spec: &Arc<JobSpec>) -> WindowEngine {
    WindowEngine::new(Arc::clone(spec), EngineConfig::default()).unwrap()
}

/// What a run produced.
#[derive(Debug, Default)]
pub struct Run {
    pub rows: Vec<OutputRow>,
    pub late: Vec<Rec>,
    pub duplicates: u64,
}

/// Feeds `batches` (one fire after each, processing time advancing 1 s per batch) and finishes.
pub fn run(engine: &mut WindowEngine, batches: &[Vec<Rec>], proc_start: i64) -> Run {
    let mut out = Run::default();
    let mut proc = proc_start;
    for b in batches {
        step(engine, b, proc, &mut out);
        proc += S;
    }
    out.rows.extend(engine.finish(proc).rows());
    out
}

pub fn step(engine: &mut WindowEngine, recs: &[Rec], proc: i64, out: &mut Run) {
    if !recs.is_empty() {
        let outcome = engine.process_batch(&batch(recs), "src", proc).unwrap();
        out.duplicates += outcome.duplicates;
        out.late
            .extend(outcome.late.iter().map(|l| recs[l.row as usize].clone()));
    }
    // Columns handed back as the live job hands them: a fire must fill them afresh.
    let rows = engine.fire(proc);
    out.rows.extend(rows.rows());
    engine.recycle(rows);
}

/// Final result per identity: the highest version, without retracted identities.
pub type Finals = BTreeMap<(String, i64, i64), (i64, Vec<AggValue>)>;

pub fn finals(rows: &[OutputRow]) -> Finals {
    let mut best: BTreeMap<(String, i64, i64), &OutputRow> = BTreeMap::new();
    for r in rows {
        let id = (r.key.to_string(), r.window_start, r.window_end);
        match best.get(&id) {
            Some(prev) if prev.output_version >= r.output_version => {
                assert_ne!(
                    prev.output_version, r.output_version,
                    "two rows with one version: {id:?}"
                );
            }
            _ => {
                best.insert(id, r);
            }
        }
    }
    best.into_iter()
        .filter(|(_, r)| !r.retracted)
        .map(|(k, r)| (k, (r.events, r.values.clone())))
        .collect()
}

/// Versions per identity must be 1, 2, 3, ... in emission order.
pub fn assert_versions_strictly_increase(rows: &[OutputRow]) {
    let mut last: BTreeMap<(String, i64, i64), u32> = BTreeMap::new();
    for r in rows {
        let id = (r.key.to_string(), r.window_start, r.window_end);
        let prev = last.insert(id.clone(), r.output_version).unwrap_or(0);
        assert_eq!(
            r.output_version,
            prev + 1,
            "version gap or repeat for {id:?}"
        );
    }
}

/// The text of a shipped job spec, for tests that derive variants of it.
pub fn job_text(job: &str) -> String {
    std::fs::read_to_string(format!(
        "{}/../../jobs/{job}.toml",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
}
