//! Window-engine throughput, and DataFusion computing the same GROUP BY over the same
//! in-memory batches on one core (target_partitions = 1), in the same run.
//!
//! `cargo bench -p signalweave-window --bench engine`
//!
//! Also prints the state held per active key and per open window for market_aggregates.

#![allow(missing_docs, clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;

use arrow::array::RecordBatch;
use criterion::measurement::WallTime;
use criterion::{
    BatchSize, BenchmarkGroup, Criterion, Throughput, criterion_group, criterion_main,
};
use datafusion::datasource::MemTable;
use datafusion::prelude::{SessionConfig, SessionContext};
use signalweave_fixtures::{Generator, Record, WorkloadSpec};
use signalweave_model::EventBatchBuilder;
use signalweave_window::{EngineConfig, JobSpec, WindowEngine};

const EVENTS: u64 = 1_000_000;
const BATCH: usize = 8192;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn batches(markets: u32, customers: u64, events_per_sec: u64) -> Vec<RecordBatch> {
    let spec = WorkloadSpec {
        events: EVENTS,
        events_per_sec,
        markets,
        hot_markets: 0,
        customers,
        whales: 0,
        dup_fraction: 0.0,
        late_fraction: 0.0,
        ..Default::default()
    };
    let mut out = Vec::new();
    let mut b = EventBatchBuilder::with_capacity(BATCH);
    for r in Generator::new(spec) {
        if let Record::Event(mut e) = r {
            e.ingest_time_us = e.event_time_us;
            b.push(&e);
            if b.len() == BATCH {
                out.push(b.finish().unwrap());
            }
        }
    }
    if !b.is_empty() {
        out.push(b.finish().unwrap());
    }
    out
}

fn job(name: &str) -> Arc<JobSpec> {
    Arc::new(JobSpec::from_file(repo().join(format!("jobs/{name}.toml"))).unwrap())
}

/// Runs the engine over `data`, firing after each batch. The processing time advances by
/// `step_us` per batch: a second, as the live job sees it, or 0, as a backfill runs (one
/// processing time, so early triggers never fire).
fn run_stepped(spec: &Arc<JobSpec>, data: &[RecordBatch], step_us: i64) -> usize {
    let mut e = WindowEngine::new(Arc::clone(spec), EngineConfig::default()).unwrap();
    run_on(&mut e, data, step_us)
}

/// Runs `e` over `data` as [`run_stepped`] does.
fn run_on(e: &mut WindowEngine, data: &[RecordBatch], step_us: i64) -> usize {
    let mut emitted = 0;
    let mut proc = 0;
    for b in data {
        e.process_batch(b, "bench", proc).unwrap();
        // As the live job does: the rows are handed on, and their columns handed back.
        let rows = e.fire(proc);
        emitted += rows.len();
        e.recycle(rows);
        proc += step_us;
    }
    emitted + e.finish(proc).len()
}

fn run(spec: &Arc<JobSpec>, data: &[RecordBatch]) -> usize {
    run_stepped(spec, data, 1_000_000)
}

/// Benches DataFusion running `sql` on `ctx` as `name` in `g`.
fn bench_sql(
    g: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    (rt, ctx): &(tokio::runtime::Runtime, SessionContext),
    sql: &str,
) {
    g.bench_function(name, |b| {
        b.iter(|| rt.block_on(async { ctx.sql(sql).await.unwrap().collect().await.unwrap() }))
    });
}

fn datafusion_market(data: &[RecordBatch]) -> (tokio::runtime::Runtime, SessionContext) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let ctx = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(1));
    let table = MemTable::try_new(data[0].schema(), vec![data.to_vec()]).unwrap();
    ctx.register_table("events", Arc::new(table)).unwrap();
    (rt, ctx)
}

/// The job's GROUP BY over `source`.
fn market_sql(source: &str) -> String {
    format!(
        "SELECT market_id, date_bin(INTERVAL '1 minute', event_time) AS window_start, \
         count(*) FILTER (WHERE event_type = 'order_placed') AS placed_count, \
         sum(amount_minor) FILTER (WHERE event_type = 'order_placed') AS placed_amount_minor, \
         count(*) FILTER (WHERE event_type = 'order_paid') AS paid_count, \
         sum(amount_minor) FILTER (WHERE event_type = 'order_paid') AS paid_amount_minor, \
         count(*) FILTER (WHERE event_type = 'order_cancelled') AS cancelled_count, \
         sum(amount_minor) FILTER (WHERE event_type = 'order_cancelled') AS cancelled_amount_minor \
         FROM {source} WHERE event_type IN ('order_placed', 'order_paid', 'order_cancelled') \
         GROUP BY market_id, window_start"
    )
}

/// The input without repeats of an identity `(tenant, event_id)`, as the engine counts it
/// (the backfill bench's second peer, too).
const DEDUPLICATED: &str = "(SELECT DISTINCT tenant, event_id, market_id, event_type, event_time, \
    amount_minor FROM events)";

/// Prints the state `spec` holds after `data`, before `finish`.
fn print_state(name: &str, spec: &Arc<JobSpec>, data: &[RecordBatch]) {
    let mut e = WindowEngine::new(Arc::clone(spec), EngineConfig::default()).unwrap();
    for (i, b) in data.iter().enumerate() {
        e.process_batch(b, "bench", i as i64).unwrap();
        e.fire(i as i64);
    }
    let s = e.state_size();
    eprintln!(
        "{name} state: {} keys, {} open windows, {} panes, {} timers; window state {} B = {:.0} B per active key, {:.0} B per open window; dedup {} identities, {} B",
        s.keys,
        s.windows,
        s.panes,
        s.timers,
        s.window_state_bytes,
        s.window_state_bytes as f64 / s.keys as f64,
        s.window_state_bytes as f64 / s.windows as f64,
        s.dedup_identities,
        s.dedup_bytes
    );
}

fn bench(c: &mut Criterion) {
    // The backfill's shape: 50 markets at 100 events/s, so the keys' state stays in cache
    // and the engine's cost per record is its own, not its cache misses'.
    let narrow = batches(50, 5_000, 100);
    let market = job("market_aggregates");
    let mut g = c.benchmark_group("market_aggregates_50_keys");
    g.sample_size(10);
    g.throughput(Throughput::Elements(EVENTS));
    g.bench_function("signalweave_engine", |b| {
        b.iter(|| run_stepped(&market, &narrow, 0))
    });
    let df = datafusion_market(&narrow);
    bench_sql(
        &mut g,
        "datafusion_sql_1_partition",
        &df,
        &market_sql("events"),
    );
    g.finish();
    // 100k markets, 10k events/s: each key sees about one event per window.
    let market_data = batches(100_000, 100_000, 10_000);
    let market = job("market_aggregates");
    print_state("market_aggregates", &market, &market_data);
    // As a backfill's worker runs each sub-range: one engine, its dedup set reserved for
    // the records to come, emptied between runs (`reset`), so the set's memory is not
    // allocated and faulted in again each time.
    let mut reused = WindowEngine::new(Arc::clone(&market), EngineConfig::default()).unwrap();
    reused.reserve(EVENTS as usize);
    // Before any run is timed: held still, a new engine and a reset one each return the
    // rows DataFusion does, so the figures compare like with like.
    let df = datafusion_market(&market_data);
    let groups: usize =
        df.0.block_on(async {
            let sql = market_sql("events");
            df.1.sql(&sql).await.unwrap().collect().await.unwrap()
        })
        .iter()
        .map(RecordBatch::num_rows)
        .sum();
    assert_eq!(
        run_stepped(&market, &market_data, 0),
        groups,
        "held still, the engine emits one row per group DataFusion returns"
    );
    reused.reset();
    assert_eq!(
        run_on(&mut reused, &market_data, 0),
        groups,
        "an engine reset emits what a new one does"
    );
    let mut g = c.benchmark_group("market_aggregates_100k_keys");
    g.sample_size(10);
    g.throughput(Throughput::Elements(EVENTS));
    g.bench_function("signalweave_engine", |b| {
        b.iter(|| run(&market, &market_data))
    });
    // With processing time held, as a backfill runs: no early trigger, so the engine
    // returns the rows DataFusion does (one per window), the like-for-like figure.
    g.bench_function("signalweave_engine_final_only", |b| {
        b.iter(|| run_stepped(&market, &market_data, 0))
    });
    // The engine held as a backfill's worker holds it (`reused`, above).
    g.bench_function("signalweave_engine_final_only_reused", |b| {
        b.iter(|| {
            reused.reset();
            run_on(&mut reused, &market_data, 0)
        })
    });
    bench_sql(
        &mut g,
        "datafusion_sql_1_partition",
        &df,
        &market_sql("events"),
    );
    bench_sql(
        &mut g,
        "datafusion_sql_with_dedup_1_partition",
        &df,
        &market_sql(DEDUPLICATED),
    );
    g.finish();

    // customer_features: sliding 10 min / 1 min over 100k customers, against tumbling on the same data.
    let customer_data = batches(1_000, 100_000, 10_000);
    let sliding = job("customer_features");
    let tumbling = Arc::new(
        JobSpec::from_toml(
            &std::fs::read_to_string(repo().join("jobs/customer_features.toml"))
                .unwrap()
                .replace(
                    "kind = \"sliding\"\nsize = \"10m\"\nslide = \"1m\"",
                    "kind = \"tumbling\"\nsize = \"1m\"",
                ),
        )
        .unwrap(),
    );
    let mut g = c.benchmark_group("customer_features_100k_keys");
    g.sample_size(10);
    g.throughput(Throughput::Elements(EVENTS));
    g.bench_function("sliding_10m_1m", |b| {
        b.iter(|| run(&sliding, &customer_data))
    });
    g.bench_function("tumbling_1m", |b| b.iter(|| run(&tumbling, &customer_data)));
    g.finish();

    // Sessions over 1M customers.
    let session_data = batches(1_000, 1_000_000, 10_000);
    let sessions = Arc::new(
        JobSpec::from_toml(
            &std::fs::read_to_string(repo().join("jobs/withdrawals.toml"))
                .unwrap()
                .replace("columns = [\"market_id\"]", "columns = [\"customer_id\"]")
                .replace(
                    "event_types = [\"withdrawal_requested\"]",
                    "event_types = []",
                ),
        )
        .unwrap(),
    );
    print_state("sessions", &sessions, &session_data);
    let mut g = c.benchmark_group("sessions_1m_customers");
    g.sample_size(10);
    g.throughput(Throughput::Elements(EVENTS));
    g.bench_function("session_5m_gap", |b| {
        b.iter_batched(
            || (),
            |_| run(&sessions, &session_data),
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
