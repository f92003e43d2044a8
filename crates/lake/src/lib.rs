//! # signalweave-lake
//!
//! The lake is SignalWeave's durable, replayable event history and its output store:
//! Apache Iceberg tables in an SQL catalog (the JDBC-catalog schema, so PyIceberg, Spark
//! and Trino read the same tables) over a local or S3 warehouse.
//!
//! - [`LakeConfig`]: the embedded default (SQLite + `./lake`) or an S3 profile, with a
//!   SQLite or PostgreSQL catalog.
//! - [`Lake::init`]: creates `signalweave.events`, `signalweave.rejections` and
//!   `signalweave.late_events`, partitioned by day, idempotently.
//! - [`Lake::append`]: one fast-append commit per batch, identified by a
//!   [`CommitIdentity`] in the snapshot summary, so a retried commit is never applied twice.
//! - [`Lake::plan_time_range`], [`Lake::plan_appended_since`], [`Lake::read`]: range scans
//!   with partition pruning, the live tail's incremental read, and reading planned files.
//! - [`Lake::snapshots`], [`Lake::snapshot_as_of`], [`AsOf`]: positions and time travel.
//! - [`Lake::session_context`], [`LakeTableProvider`]: DataFusion SQL over every table;
//!   Iceberg plans the files, DataFusion's Parquet reader scans them.
//!
//! iceberg-rust 0.10 commits appends only; everything here is an append or a read.

mod arrival;
mod blob;
mod compact;
mod config;
mod erase;
mod error;
mod lake;
mod layout;
mod lease;
mod lineage;
mod load;
mod maintain;
mod pinned;
mod promote;
mod provider;
mod ranged;
mod sql;

pub use arrival::{ArrivalCursor, ArrivalKey, ArrivalWatermarks, ArrivedFile, FileSpans};
pub use compact::{CompactionPolicy, CompactionReport};
pub use config::{DEFAULT_CATALOG_NAME, LakeConfig, S3Config, Warehouse};
pub use erase::{
    ErasureNotice, ErasureReport, ErasureRequest, KeyLayout, TableErasure, subject_digest,
};
pub use error::{LakeError, Result};
pub use lake::{
    AppendOutcome, AppendWriter, Backlog, COMMIT_IDENTITY_TTL_MS, CommitIdentity,
    DEFAULT_TARGET_FILE_SIZE, ExpireOutcome, IncrementalPlan, Lake, ScanPlan, SnapshotInfo,
    WrittenFiles, project_without,
};
pub use layout::{
    LATE_EVENTS_SCHEMA, LakeTable, NAMESPACE, OUTPUT_TIME_COLUMN, OutputTable, REJECTIONS_SCHEMA,
    SUMMARY_BATCH_SEQ, SUMMARY_WRITER_ID,
};
pub use lease::{LeaseFence, lease_owner};
pub use lineage::{LINEAGE_COLUMN, LINEAGE_FIELD_ID};
pub use load::{LoadFormat, LoadOptions, LoadReport, rejection_batch, rejection_batch_of};
pub use maintain::{
    DEFAULT_PREVIOUS_VERSIONS_MAX, DeletedFiles, MaintenancePolicy, MaintenanceReport,
    PROP_PREVIOUS_VERSIONS_MAX, Retention, SnapshotHold, TRANSIENT_HOLD_MARKER,
    TRANSIENT_HOLD_TTL_MS,
};
pub use promote::{Promotion, authoritative, authority_epoch, serving_version};
pub use provider::{COMMIT_ORDER, COMMIT_SEQUENCE_COLUMN, LakeTableProvider, SnapshotChoice};
pub use sql::{AsOf, SQL_CATALOG};
