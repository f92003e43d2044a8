//! Golden outputs: every version the three shipped jobs emit over the committed fixture
//! `fixtures/sample.ndjson`, fed in file order in batches of 100 records with processing
//! time advancing 5 s per batch. For `customer_features` (ten windows per order) the file
//! keeps the whale customers `c-0`..`c-9` only; the header line counts every row.
//! Regenerate with `SW_REGENERATE_GOLDEN=1`.

#![allow(clippy::unwrap_used)]

use std::fmt::Write;
use std::path::PathBuf;
use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema};
use signalweave_model::{
    EventBatchBuilder, EventValidator, SchemaRegistry, ValidationLimits, format_rfc3339_micros,
};
use signalweave_window::{AggValue, EngineConfig, JobSpec, WindowEngine};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `batch` with every `Utf8` column dictionary-encoded, as a backfill reads them.
fn dictionary_encoded(batch: RecordBatch) -> RecordBatch {
    let dict = DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8));
    let (fields, columns): (Vec<Field>, Vec<ArrayRef>) = batch
        .schema()
        .fields()
        .iter()
        .zip(batch.columns())
        .map(|(f, c)| match f.data_type() {
            DataType::Utf8 => (
                Field::new(f.name(), dict.clone(), f.is_nullable()),
                arrow::compute::cast(c, &dict).unwrap(),
            ),
            _ => (f.as_ref().clone(), Arc::clone(c)),
        })
        .unzip();
    RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).unwrap()
}

/// The rendered outputs of `job`; `dictionary`: its string columns dictionary-encoded.
fn render(job: &str, dictionary: bool) -> String {
    let spec = Arc::new(JobSpec::from_file(repo().join(format!("jobs/{job}.toml"))).unwrap());
    let registry = SchemaRegistry::load_dir(repo().join("catalog/events")).unwrap();
    let validator = EventValidator::new(Arc::new(registry), ValidationLimits::default());
    let text = std::fs::read_to_string(repo().join("fixtures/sample.ndjson")).unwrap();
    let far_future = i64::MAX / 4;
    let events: Vec<_> = text
        .lines()
        .filter_map(|l| validator.validate_bytes(l.as_bytes(), far_future, 0).ok())
        .collect();
    let mut engine = WindowEngine::new(Arc::clone(&spec), EngineConfig::default()).unwrap();
    let mut rows = Vec::new();
    let (mut late, mut dups) = (0, 0);
    let mut proc = 1_767_225_600_000_000;
    for chunk in events.chunks(100) {
        let mut b = EventBatchBuilder::with_capacity(chunk.len());
        for e in chunk {
            b.push(e);
        }
        let mut batch = b.finish().unwrap();
        if dictionary {
            batch = dictionary_encoded(batch);
        }
        let outcome = engine.process_batch(&batch, "fixture", proc).unwrap();
        late += outcome.late.len();
        dups += outcome.duplicates;
        let fired = engine.fire(proc);
        rows.extend(fired.rows());
        engine.recycle(fired);
        proc += 5_000_000;
    }
    rows.extend(engine.finish(proc).rows());
    let mut out = String::new();
    let names: Vec<&str> = spec.aggregates.iter().map(|a| a.name.as_str()).collect();
    writeln!(
        out,
        "# {job}: {} rows, {late} late, {dups} duplicates",
        rows.len()
    )
    .unwrap();
    writeln!(
        out,
        "key,window_start,window_end,output_version,completeness,retracted,watermark,events,{}",
        names.join(",")
    )
    .unwrap();
    let whales: Vec<String> = (0..10).map(|i| format!("c-{i}")).collect();
    for r in rows {
        // customer_features is keyed by `tenant|customer_id`: the whales of every tenant.
        let customer = r.key.rsplit('|').next().unwrap_or_default().to_string();
        if job == "customer_features" && !whales.contains(&customer) {
            continue;
        }
        let values: Vec<String> = r
            .values
            .iter()
            .map(|v| match v {
                AggValue::Int(i) => i.to_string(),
                AggValue::Float(f) => format!("{f:.4}"),
                AggValue::Null => String::new(),
            })
            .collect();
        let wm = if r.watermark == i64::MAX {
            "end".to_string()
        } else {
            format_rfc3339_micros(r.watermark)
        };
        writeln!(
            out,
            "{},{},{},{},{},{},{},{},{}",
            r.key,
            format_rfc3339_micros(r.window_start),
            format_rfc3339_micros(r.window_end),
            r.output_version,
            r.completeness.as_str(),
            r.retracted,
            wm,
            r.events,
            values.join(",")
        )
        .unwrap();
    }
    out
}

#[test]
fn shipped_jobs_match_their_golden_outputs() {
    for job in ["market_aggregates", "customer_features", "withdrawals"] {
        let got = render(job, false);
        let path = repo().join(format!("fixtures/golden/{job}.csv"));
        if std::env::var("SW_REGENERATE_GOLDEN").is_ok_and(|v| v == "1") {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &got).unwrap();
            continue;
        }
        let want = std::fs::read_to_string(&path).unwrap_or_else(|_| {
            panic!(
                "{} is missing: run with SW_REGENERATE_GOLDEN=1",
                path.display()
            )
        });
        assert!(
            got == want,
            "{job} differs from {}; if the change is intended, regenerate with SW_REGENERATE_GOLDEN=1",
            path.display()
        );
        // Read as a backfill reads them: the same rows, late records and duplicates.
        assert!(
            render(job, true) == want,
            "{job} with dictionary-encoded strings differs from {}",
            path.display()
        );
    }
}
