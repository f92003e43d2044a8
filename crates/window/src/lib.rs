//! # signalweave-window
//!
//! The keyed event-time window engine that the live job and every backfill run. It is
//! pure: no IO and no async runtime. It is fed Arrow `RecordBatch`es of events and
//! processing-time signals, and returns versioned output rows and late records.
//!
//! - [`JobSpec`]: `jobs/*.toml`, typed and validated (errors name the field).
//! - [`WindowEngine`]: tumbling, sliding (pane-based) and session windows; per-input
//!   watermarks with idleness; early, on-time and corrected emissions; allowed lateness and
//!   a late output; dedup by identity within a horizon; key groups; snapshot and restore.
//! - [`Emissions`] (with its row view, [`OutputRow`]) and [`late_rows`]: what the sink
//!   writes.
//!
//! The operator lifecycle (STYLE.md §5): `process_batch` (records in), `fire` (time
//! advances, triggers fire), `finish` (end of input), `snapshot` / `restore` (declared
//! state: panes, windows, sessions, timers, dedup identities, per-input watermarks,
//! pending emissions).

mod dedup;
mod engine;
mod error;
mod keys;
mod output;
mod panes;
mod prefetch;
mod spec;
mod state;
mod strs;
mod timers;
mod watermark;

pub use engine::{DEFAULT_KEY_GROUPS, EngineConfig, WindowEngine};
pub use error::{Result, WindowError};
pub use output::{
    AggValue, BatchOutcome, Completeness, Emissions, LateReason, LateRecord, OutputRow, late_rows,
    output_schema,
};
pub use spec::{
    AggregateFunction, AggregateSpec, DedupSpec, JobSpec, KeySpec, LatenessSpec, OutputSpec,
    SourceSpec, TimeSpec, TriggerSpec, WindowSpec, micros,
};
pub use state::{STATE_FORMAT_VERSION, StateSize};
pub use watermark::{InputProgress, Watermarks};
