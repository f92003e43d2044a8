//! Layouts of the SignalWeave tables in namespace `signalweave`: schema, partition
//! spec and properties. Arrow schemas carry Iceberg field ids in `PARQUET:field_id`,
//! so batches built by `signalweave-model` write straight into the tables.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use arrow_schema::{DataType, Field, Schema as ArrowSchema, SchemaRef, TimeUnit};
use iceberg::spec::{Schema, Transform, UnboundPartitionSpec};
use signalweave_model::{ErrorKind, events_arrow_schema};

use crate::error::{LakeError, Result};

/// The namespace of every SignalWeave table.
pub const NAMESPACE: &str = "signalweave";

/// Snapshot summary key: the writer that made a commit.
pub const SUMMARY_WRITER_ID: &str = "signalweave.writer-id";
/// Snapshot summary key: the writer's batch sequence number of the commit.
pub const SUMMARY_BATCH_SEQ: &str = "signalweave.batch-seq";
/// Table property: layout version written by this code.
pub const PROP_LAYOUT_VERSION: &str = "signalweave.layout-version";

/// Table property: when the table was made (ms since the epoch). Time travel to a moment
/// before it reads the table as empty, which no snapshot expiry can make untrue.
pub const PROP_CREATED_MS: &str = "signalweave.created-ms";

/// Default snapshot retention: 2 minutes. Tables take a commit about every second: every
/// retained snapshot is a line of the metadata file that each commit rewrites, so the
/// retention sets both the commit latency and the metadata size. Nothing reads history
/// from retained snapshots: positions that must live longer (a checkpoint, a backfill, a
/// notifier) are held in `sw_snapshot_holds`, commit identities of expired snapshots are
/// kept in `sw_commit_identities`, loads in `sw_loads`, and the gateway rebuilds its
/// duplicate index by ingest time. Time travel reaches back as far as this retention (set
/// `history.expire.max-snapshot-age-ms` on a table to keep more).
pub const DEFAULT_MAX_SNAPSHOT_AGE_MS: i64 = 2 * 60 * 1000;
/// Default number of snapshots always kept.
pub const DEFAULT_MIN_SNAPSHOTS_TO_KEEP: u64 = 100;

/// A table SignalWeave owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LakeTable {
    /// `signalweave.events`: every accepted event (the landing table and the replayable log).
    Events,
    /// `signalweave.rejections`: evidence of every rejected request or record.
    Rejections,
    /// `signalweave.late_events`: records a job classified as later than its allowed lateness.
    LateEvents,
    /// A job's output table (one per job and namespace), registered with
    /// [`LakeTable::output`].
    Output(&'static OutputTable),
}

/// The layout of a job's output table: versioned output rows, partitioned by
/// `day(window_start)`.
///
/// Output tables are interned: one registration per name for the life of the process,
/// so [`LakeTable`] stays `Copy` (a process knows a handful of jobs and namespaces).
#[derive(Debug)]
pub struct OutputTable {
    name: String,
    schema: SchemaRef,
}

impl OutputTable {
    /// Table name inside [`NAMESPACE`].
    pub fn name(&'static self) -> &'static str {
        &self.name
    }
}

impl PartialEq for OutputTable {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl Eq for OutputTable {}

impl std::hash::Hash for OutputTable {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.name.hash(state);
    }
}

/// The time column of every output table.
pub const OUTPUT_TIME_COLUMN: &str = "window_start";

static OUTPUT_TABLES: LazyLock<Mutex<HashMap<String, &'static OutputTable>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

fn valid_table_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
}

impl LakeTable {
    /// Every built-in table.
    pub const ALL: [LakeTable; 3] = [
        LakeTable::Events,
        LakeTable::Rejections,
        LakeTable::LateEvents,
    ];

    /// Table name inside [`NAMESPACE`].
    pub fn name(self) -> &'static str {
        match self {
            LakeTable::Events => "events",
            LakeTable::Rejections => "rejections",
            LakeTable::LateEvents => "late_events",
            LakeTable::Output(t) => t.name(),
        }
    }

    /// Registers (or finds) the output table `name` with the columns of `schema`
    /// (a job's output schema). Field ids are assigned in column order. Fails with
    /// `InvalidInput` for a bad name, a built-in table's name, or a name already
    /// registered with other columns.
    pub fn output(name: &str, schema: &ArrowSchema) -> Result<Self> {
        if !valid_table_name(name) || Self::ALL.iter().any(|t| t.name() == name) {
            return Err(LakeError::new(
                ErrorKind::InvalidInput,
                format!(
                    "`{name}` cannot be an output table: use lower-case letters, digits and \
                     `_`, starting with a letter, and not a built-in table's name"
                ),
            ));
        }
        let with_ids = Arc::new(ArrowSchema::new(
            schema
                .fields()
                .iter()
                .enumerate()
                .map(|(i, f)| field(i + 1, f.name(), f.data_type().clone(), f.is_nullable()))
                .collect::<Vec<_>>(),
        ));
        let mut tables = OUTPUT_TABLES
            .lock()
            .map_err(|_| LakeError::new(ErrorKind::Internal, "output table registry poisoned"))?;
        if let Some(existing) = tables.get(name) {
            if existing.schema.fields() != with_ids.fields() {
                return Err(LakeError::new(
                    ErrorKind::InvalidInput,
                    format!("output table `{name}` is already registered with other columns"),
                ));
            }
            return Ok(LakeTable::Output(existing));
        }
        let table: &'static OutputTable = Box::leak(Box::new(OutputTable {
            name: name.to_string(),
            schema: with_ids,
        }));
        tables.insert(name.to_string(), table);
        Ok(LakeTable::Output(table))
    }

    /// The registered output tables.
    pub fn outputs() -> Vec<LakeTable> {
        let mut out: Vec<LakeTable> = OUTPUT_TABLES
            .lock()
            .map(|m| m.values().map(|t| LakeTable::Output(t)).collect())
            .unwrap_or_default();
        out.sort_by_key(|t| t.name());
        out
    }

    /// True for a job's output table.
    pub fn is_output(self) -> bool {
        matches!(self, LakeTable::Output(_))
    }

    /// Looks a table up by name (`events` or `signalweave.events`); output tables are
    /// found once registered (see [`crate::Lake::register_output_tables`]).
    pub fn from_name(name: &str) -> Result<Self> {
        let short = name.strip_prefix("signalweave.").unwrap_or(name);
        if let Some(t) = Self::ALL.into_iter().find(|t| t.name() == short) {
            return Ok(t);
        }
        if let Some(t) = OUTPUT_TABLES
            .lock()
            .ok()
            .and_then(|m| m.get(short).copied())
        {
            return Ok(LakeTable::Output(t));
        }
        Err(LakeError::new(
            ErrorKind::NotFound,
            format!(
                "no table `{name}`; tables are events, rejections, late_events and the \
                 jobs' output tables"
            ),
        ))
    }

    /// The Arrow schema batches must have.
    pub fn arrow_schema(self) -> SchemaRef {
        match self {
            LakeTable::Events => events_arrow_schema(),
            LakeTable::Rejections => Arc::clone(&REJECTIONS_SCHEMA),
            LakeTable::LateEvents => Arc::clone(&LATE_EVENTS_SCHEMA),
            LakeTable::Output(t) => Arc::clone(&t.schema),
        }
    }

    /// The column partitioned by day.
    pub fn time_column(self) -> &'static str {
        match self {
            LakeTable::Events | LakeTable::LateEvents => "event_time",
            LakeTable::Rejections => "received_at",
            LakeTable::Output(_) => OUTPUT_TIME_COLUMN,
        }
    }

    /// The Iceberg schema.
    pub fn iceberg_schema(self) -> Result<Schema> {
        iceberg::arrow::arrow_schema_to_schema(&self.arrow_schema())
            .map_err(|e| LakeError::iceberg(format!("schema of {}", self.name()), e))
    }

    /// The partition spec: `day(<time column>)`.
    pub fn partition_spec(self, schema: &Schema) -> Result<UnboundPartitionSpec> {
        let column = self.time_column();
        let field = schema.field_by_name(column).ok_or_else(|| {
            LakeError::new(
                ErrorKind::Internal,
                format!("{} lacks {column}", self.name()),
            )
        })?;
        UnboundPartitionSpec::builder()
            .add_partition_field(field.id, format!("{column}_day"), Transform::Day)
            .map(|b| b.build())
            .map_err(|e| LakeError::iceberg("partition spec", e))
    }

    /// Table properties set at creation.
    pub fn properties(self) -> HashMap<String, String> {
        [
            ("write.parquet.compression-codec", "zstd".to_string()),
            (
                "history.expire.max-snapshot-age-ms",
                DEFAULT_MAX_SNAPSHOT_AGE_MS.to_string(),
            ),
            (
                "history.expire.min-snapshots-to-keep",
                DEFAULT_MIN_SNAPSHOTS_TO_KEEP.to_string(),
            ),
            // Conflicts come back to `Lake::append`, which re-checks the commit identity
            // before retrying; iceberg's own retry would re-apply blindly.
            ("commit.retry.num-retries", "0".to_string()),
            (
                crate::maintain::PROP_PREVIOUS_VERSIONS_MAX,
                crate::maintain::DEFAULT_PREVIOUS_VERSIONS_MAX.to_string(),
            ),
            (PROP_LAYOUT_VERSION, "1".to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }
}

fn field(id: usize, name: &str, data_type: DataType, nullable: bool) -> Field {
    Field::new(name, data_type, nullable).with_metadata(
        [("PARQUET:field_id".to_string(), id.to_string())]
            .into_iter()
            .collect(),
    )
}

fn ts() -> DataType {
    DataType::Timestamp(TimeUnit::Microsecond, Some("+00:00".into()))
}

/// Columns of `signalweave.rejections`.
pub static REJECTIONS_SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| {
    use DataType::{Int64, Utf8};
    Arc::new(ArrowSchema::new(vec![
        field(1, "received_at", ts(), false),
        field(2, "source", Utf8, false),
        field(3, "tenant", Utf8, true),
        field(4, "producer_id", Utf8, true),
        field(5, "event_id", Utf8, true),
        field(6, "event_type", Utf8, true),
        field(7, "reason_code", Utf8, false),
        field(8, "detail", Utf8, false),
        field(9, "record_digest", Utf8, false),
        field(10, "record_bytes", Int64, false),
        field(11, "record_position", Int64, true),
    ]))
});

/// Columns of `signalweave.late_events`.
pub static LATE_EVENTS_SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| {
    use DataType::{Int64, Utf8};
    Arc::new(ArrowSchema::new(vec![
        field(1, "job", Utf8, false),
        field(2, "namespace", Utf8, false),
        field(3, "reason", Utf8, false),
        field(4, "watermark", ts(), false),
        field(5, "classified_at", ts(), false),
        field(6, "tenant", Utf8, false),
        field(7, "event_id", Utf8, false),
        field(8, "event_type", Utf8, false),
        field(9, "event_time", ts(), false),
        field(10, "ingest_time", ts(), false),
        field(11, "key", Utf8, true),
        field(12, "amount_minor", Int64, true),
        field(13, "currency", Utf8, true),
    ]))
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layout_converts_and_partitions_by_day() {
        for t in LakeTable::ALL {
            let schema = t.iceberg_schema().unwrap();
            let spec = t.partition_spec(&schema).unwrap();
            assert_eq!(spec.fields().len(), 1, "{}", t.name());
            assert_eq!(
                LakeTable::from_name(&format!("signalweave.{}", t.name())).unwrap(),
                t
            );
        }
        assert_eq!(
            LakeTable::from_name("nope").unwrap_err().kind(),
            ErrorKind::NotFound
        );
    }
}
