//! # signalweave-runner
//!
//! Runs SignalWeave jobs on the window engine.
//!
//! - [`LiveJob`]: tails `signalweave.events` by snapshot, feeds the engine, routes late
//!   records to `signalweave.late_events`, and commits versioned outputs once per epoch,
//!   with a checkpoint that joins the source position, the engine state and the sink
//!   epoch (see [`live`] for the protocol and its crash cases).
//! - [`backfill`]: a job version over an event-time range into its own namespace, by
//!   sub-range, under token budgets that the live job takes back ([`budget`]).
//! - [`CheckpointStore`]: checkpoint blobs in object storage, pointers in the catalog
//!   database, moved by compare-and-set.
//! - [`RunnerMetrics`], [`JobStatus`]: lag, watermark delay, checkpoints, sink commits and
//!   per-event freshness by stage.

pub mod backfill;
pub mod budget;
mod checkpoint;
pub mod compare;
mod erased;
mod error;
pub mod freshness;
mod late;
pub mod live;
mod metrics;

pub use checkpoint::{CHECKPOINT_FORMAT_VERSION, Checkpoint, CheckpointRef, CheckpointStore};
pub use error::{Result, RunnerError};
pub use late::{LateEvent, extract as extract_late, to_batch as late_batch};
pub use live::{
    FaultPoint, FaultStage, LIVE_LEASE_COMMIT_WITHIN, LIVE_LEASE_TTL, LiveConfig, LiveJob,
    StepReport, backfill_output_table, output_table,
};
pub use metrics::{BackfillMetrics, JobStatus, Labels, RunnerMetrics, SharedStatus};
