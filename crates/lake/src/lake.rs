//! [`Lake`]: the opened catalog and warehouse, and every table operation.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use arrow_array::RecordBatch;
use futures::{StreamExt, TryStreamExt, stream};
use iceberg::expr::Reference;
use iceberg::io::StorageFactory;
use iceberg::scan::{ArrowRecordBatchStream, FileScanTask};
use iceberg::spec::{DataContentType, DataFile, Datum, ManifestStatus, Operation, Snapshot};
use iceberg::table::Table;
use iceberg::transaction::{ApplyTransactionAction, Transaction};
use iceberg::writer::base_writer::data_file_writer::DataFileWriterBuilder;
use iceberg::writer::file_writer::ParquetWriterBuilder;
use iceberg::writer::file_writer::location_generator::{
    DefaultFileNameGenerator, DefaultLocationGenerator,
};
use iceberg::writer::file_writer::rolling_writer::RollingFileWriterBuilder;
use iceberg::writer::partitioning::PartitioningWriter;
use iceberg::writer::partitioning::fanout_writer::FanoutWriter;
use iceberg::{Catalog, CatalogBuilder, NamespaceIdent, TableCreation, TableIdent};
use iceberg_catalog_sql::{SqlBindStyle, SqlCatalog, SqlCatalogBuilder};
use iceberg_storage_opendal::OpenDalStorageFactory;
use parquet::basic::{Compression, Encoding, ZstdLevel};
use parquet::file::properties::WriterProperties;
use parquet::schema::types::ColumnPath;
use serde::Serialize;
use signalweave_model::ErrorKind;
use sqlx::AnyPool;
use sqlx::any::AnyPoolOptions;

use crate::config::{LakeConfig, Warehouse};
use crate::error::{LakeError, Result};
use crate::layout::{LakeTable, NAMESPACE, SUMMARY_BATCH_SEQ, SUMMARY_WRITER_ID};
use crate::lease::LeaseFence;
use crate::pinned::PinnedCatalog;

/// Default target size of a data file written by an append: 128 MiB.
pub const DEFAULT_TARGET_FILE_SIZE: usize = 128 * 1024 * 1024;
/// How many times an append retries a transient failure (after iceberg's own conflict retries).
pub const DEFAULT_APPEND_ATTEMPTS: u32 = 30;
/// How long `sw_commit_identities` remembers the identity of a commit whose snapshot
/// expired: a retry (a gateway's spooled group, a live job's replayed epoch) within it is
/// recognised. Seven days. A load's chunk identities are kept as long as `sw_loads`
/// records the load, and each writer's last commit (by sequence) for good.
pub const COMMIT_IDENTITY_TTL_MS: i64 = 7 * 24 * 3600 * 1000;

/// How long an append waits before its next attempt.
///
/// A lost compare-and-set means another writer committed first (an append, or a
/// maintenance pass every minute or so): its commit is the new base, so the first retry
/// goes at once; writers that keep colliding spread out over up to 4, 8, … 128 ms. A
/// transient failure (catalog or object store unavailable) backs off from 50 ms to 2 s.
/// Each pause is randomised (jitter) so that colliding writers do not collide again.
#[derive(Debug)]
pub(crate) struct RetryPause {
    conflicts: u32,
    backoff: Duration,
}

impl Default for RetryPause {
    fn default() -> Self {
        Self {
            conflicts: 0,
            backoff: Duration::from_millis(50),
        }
    }
}

impl RetryPause {
    fn next(&mut self, error: &LakeError) -> Duration {
        if error.kind() == ErrorKind::Conflict {
            self.conflicts += 1;
            if self.conflicts == 1 {
                return Duration::ZERO;
            }
            return jitter(Duration::from_millis(1 << self.conflicts.min(7)));
        }
        let pause = self.backoff + jitter(self.backoff / 2);
        self.backoff = (self.backoff * 2).min(Duration::from_secs(2));
        pause
    }

    pub(crate) async fn wait(&mut self, error: &LakeError) {
        let pause = self.next(error);
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
    }
}

/// A random duration in `[0, max)`.
fn jitter(max: Duration) -> Duration {
    max.mul_f64(f64::from(uuid::Uuid::new_v4().as_fields().1) / 65_536.0)
}

/// Who made a commit: the writer's stable id and its batch sequence number.
///
/// An append records both in its snapshot summary. Before committing, and before every
/// retry, the lake looks for a retained snapshot with the same pair: if it exists the
/// batch was already applied and is not applied again.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct CommitIdentity {
    /// Stable id of the writer (a gateway instance, a `load` of one file, a job sink).
    pub writer_id: String,
    /// The writer's sequence number for this batch.
    pub batch_seq: u64,
}

impl CommitIdentity {
    /// An identity from its parts.
    pub fn new(writer_id: impl Into<String>, batch_seq: u64) -> Self {
        Self {
            writer_id: writer_id.into(),
            batch_seq,
        }
    }
}

/// What an append did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AppendOutcome {
    /// The snapshot that holds the batch.
    pub snapshot_id: i64,
    /// Rows in the batch.
    pub rows: u64,
    /// Data files written (0 when already committed).
    pub data_files: usize,
    /// True when an earlier attempt had already committed this identity.
    pub already_committed: bool,
}

/// What an expiry did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ExpireOutcome {
    /// Snapshots before.
    pub snapshots_before: usize,
    /// Snapshots retained.
    pub snapshots_after: usize,
}

/// One snapshot of a table, as `lake snapshots` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SnapshotInfo {
    /// Snapshot id.
    pub snapshot_id: i64,
    /// Parent snapshot id.
    pub parent_id: Option<i64>,
    /// Sequence number.
    pub sequence_number: i64,
    /// Commit time, milliseconds since the epoch.
    pub timestamp_ms: i64,
    /// Operation (`append`, `replace`, ...).
    pub operation: String,
    /// Writer id from the summary, if a SignalWeave writer made it.
    pub writer_id: Option<String>,
    /// Batch sequence from the summary.
    pub batch_seq: Option<u64>,
    /// Records added.
    pub added_records: u64,
    /// Data files added.
    pub added_files: u64,
    /// Records in the table after it.
    pub total_records: u64,
}

/// A planned read: the files to scan and how many the plan skipped.
#[derive(Debug, Clone)]
pub struct ScanPlan {
    /// Snapshot read (None for an empty table).
    pub snapshot_id: Option<i64>,
    /// Files to read.
    pub tasks: Vec<FileScanTask>,
    /// Data files in the snapshot before pruning.
    pub total_files: u64,
}

/// The data files appended after one position, up to another: the live tail's read.
#[derive(Debug, Clone)]
pub struct IncrementalPlan {
    /// The position read after (exclusive); None means from the table's start.
    pub after: Option<i64>,
    /// The position read up to (inclusive): the next `after`.
    pub upto: Option<i64>,
    /// Snapshots in (after, upto] in commit order.
    pub snapshots: Vec<i64>,
    /// Commit time of each of `snapshots`, ms since the epoch.
    pub commit_ms: Vec<i64>,
    /// Files appended by those snapshots, in commit order.
    pub tasks: Vec<FileScanTask>,
    /// The snapshot that appended each of `tasks` (a whole-table read: the snapshot read).
    pub task_snapshots: Vec<i64>,
    /// Whether a snapshot in (after, upto] removed rows (an erasure's `overwrite` or
    /// `delete`; compaction's `replace` removes none): a reader that keeps rows it read
    /// before must read the table again to let them go.
    pub removed_rows: bool,
}

impl IncrementalPlan {
    /// The tasks in runs of one snapshot each, in commit order: a reader that advances its
    /// watermark between commits reads them run by run.
    pub fn by_snapshot(self) -> Vec<(i64, Vec<FileScanTask>)> {
        let mut runs: Vec<(i64, Vec<FileScanTask>)> = Vec::new();
        for (task, snapshot) in self.tasks.into_iter().zip(self.task_snapshots) {
            match runs.last_mut() {
                Some((s, tasks)) if *s == snapshot => tasks.push(task),
                _ => runs.push((snapshot, vec![task])),
            }
        }
        runs
    }
}

/// What a tailing reader has not read yet (see [`Lake::backlog`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Backlog {
    /// Snapshots after the reader's position.
    pub snapshots: u64,
    /// Data files they added.
    pub files: u64,
    /// Records they added.
    pub records: u64,
    /// Bytes of the files they added.
    pub bytes: u64,
    /// Commit time of the oldest unread snapshot, ms since the epoch.
    pub oldest_commit_ms: Option<i64>,
}

/// The opened lake: catalog database, warehouse, and SignalWeave's tables.
#[derive(Debug, Clone)]
pub struct Lake {
    config: LakeConfig,
    catalog: Arc<SqlCatalog>,
    control: AnyPool,
    /// Loaded tables (with their manifest caches), reused while their metadata location
    /// is still the catalog's current one.
    loaded: Arc<std::sync::Mutex<HashMap<LakeTable, Table>>>,
    /// Contents of manifest lists and manifests read by maintenance (immutable files).
    pub(crate) manifest_cache: Arc<std::sync::Mutex<crate::maintain::ManifestCache>>,
    /// Set once `sw_leases` is known to exist.
    pub(crate) leases_table: Arc<tokio::sync::OnceCell<()>>,
}

fn sqlx_url(config: &LakeConfig) -> String {
    if config.is_sqlite() && !config.catalog_url.contains('?') {
        format!("{}?mode=rwc", config.catalog_url)
    } else {
        config.catalog_url.clone()
    }
}

impl Lake {
    /// Opens the lake described by `config`, creating the SQLite file and the local
    /// warehouse directory if they do not exist. Tables are created by [`Lake::init`].
    pub async fn open(config: LakeConfig) -> Result<Self> {
        sqlx::any::install_default_drivers();
        if let Some(path) = config.sqlite_path()
            && let Some(dir) = path.parent()
        {
            create_dir(dir)?;
        }
        if let Warehouse::Local { path } = &config.warehouse {
            create_dir(path)?;
        }
        let url = sqlx_url(&config);
        let control = AnyPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(10))
            .connect(&url)
            .await
            .map_err(|e| {
                LakeError::sql(
                    format!(
                        "cannot connect to catalog {}",
                        config.redacted_catalog_url()
                    ),
                    e,
                )
            })?;
        if config.is_sqlite() {
            // WAL lets readers (sql, the live tail) run while a writer commits.
            sqlx::query("PRAGMA journal_mode=WAL")
                .execute(&control)
                .await
                .map_err(|e| LakeError::sql("enable WAL on the SQLite catalog", e))?;
        }
        // The catalog creates its tables when it loads; concurrent DDL on a fresh
        // PostgreSQL database can fail, so it runs under an advisory lock.
        let ddl_lock = ddl_lock(&config, &control).await?;
        let factory: Arc<dyn StorageFactory> = match &config.warehouse {
            Warehouse::Local { .. } => Arc::new(OpenDalStorageFactory::Fs),
            Warehouse::S3(_) => Arc::new(OpenDalStorageFactory::S3 {
                customized_credential_load: None,
            }),
        };
        let bind = if config.is_sqlite() {
            SqlBindStyle::QMark
        } else {
            SqlBindStyle::DollarNumeric
        };
        let mut props = config.storage_props();
        props.insert("pool.max-connections".into(), "4".into());
        let catalog = SqlCatalogBuilder::default()
            .uri(url)
            .warehouse_location(config.warehouse_location())
            .sql_bind_style(bind)
            .props(props)
            .with_storage_factory(factory)
            .load(config.catalog_name.clone(), HashMap::new())
            .await
            .map_err(|e| {
                LakeError::iceberg(
                    format!("cannot open catalog {}", config.redacted_catalog_url()),
                    e,
                )
            })?;
        // Commit identities outlive the snapshots that carried them (see
        // `Lake::record_commit_identities`); lakes made before this table existed get it here.
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS sw_commit_identities (catalog_name VARCHAR(255) NOT NULL, \
             table_name VARCHAR(255) NOT NULL, writer_id VARCHAR(255) NOT NULL, \
             batch_seq BIGINT NOT NULL, snapshot_id BIGINT NOT NULL, committed_ms BIGINT NOT NULL, \
             PRIMARY KEY (catalog_name, table_name, writer_id, batch_seq))",
        )
        .execute(&control)
        .await
        .map_err(|e| LakeError::sql("create sw_commit_identities", e))?;
        // Every load, by writer: its file, chunk geometry and validation clock (see
        // `load.rs`). A resumed load reads them here, whatever the snapshot retention.
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS sw_loads (catalog_name VARCHAR(255) NOT NULL, \
             writer_id VARCHAR(255) NOT NULL, file_digest VARCHAR(255) NOT NULL, \
             clock_us BIGINT NOT NULL, started_ms BIGINT NOT NULL, \
             PRIMARY KEY (catalog_name, writer_id))",
        )
        .execute(&control)
        .await
        .map_err(|e| LakeError::sql("create sw_loads", e))?;
        drop(ddl_lock);
        Ok(Self {
            config,
            catalog: Arc::new(catalog),
            control,
            loaded: Arc::default(),
            manifest_cache: Arc::default(),
            leases_table: Arc::default(),
        })
    }

    /// The profile this lake was opened with.
    pub fn config(&self) -> &LakeConfig {
        &self.config
    }

    /// The Iceberg catalog.
    pub fn catalog(&self) -> Arc<dyn Catalog> {
        Arc::clone(&self.catalog) as Arc<dyn Catalog>
    }

    /// The catalog database pool, home of SignalWeave's `sw_` control tables.
    pub fn control_pool(&self) -> &AnyPool {
        &self.control
    }

    /// Identifier of a built-in table.
    pub fn ident(table: LakeTable) -> TableIdent {
        TableIdent::new(
            NamespaceIdent::new(NAMESPACE.to_string()),
            table.name().to_string(),
        )
    }

    /// Creates the namespace, the built-in tables and the control tables, where missing.
    /// Returns each table with whether this call created it. Safe to run concurrently and repeatedly.
    pub async fn init(&self) -> Result<Vec<(LakeTable, bool)>> {
        let _ddl = ddl_lock(&self.config, &self.control).await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS sw_meta (meta_key VARCHAR(255) PRIMARY KEY, meta_value VARCHAR(1000) NOT NULL)",
        )
        .execute(&self.control)
        .await
        .map_err(|e| LakeError::sql("create sw_meta", e))?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS sw_snapshot_holds (catalog_name VARCHAR(255) NOT NULL, \
             table_name VARCHAR(255) NOT NULL, holder VARCHAR(255) NOT NULL, \
             snapshot_id BIGINT NOT NULL, updated_ms BIGINT NOT NULL, \
             PRIMARY KEY (catalog_name, table_name, holder))",
        )
        .execute(&self.control)
        .await
        .map_err(|e| LakeError::sql("create sw_snapshot_holds", e))?;
        // What each data file with row lineage holds of each commit (see
        // `Lake::file_statistics`), kept once read.
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS sw_file_commits (catalog_name VARCHAR(255) NOT NULL, \
             file_path VARCHAR(2000) NOT NULL, fields VARCHAR(64) NOT NULL, commits TEXT NOT NULL, \
             PRIMARY KEY (catalog_name, file_path, fields))",
        )
        .execute(&self.control)
        .await
        .map_err(|e| LakeError::sql("create sw_file_commits", e))?;
        self.create_promotions_table().await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS sw_erasures (erasure_id VARCHAR(255) PRIMARY KEY, \
             catalog_name VARCHAR(255) NOT NULL, subject_sha256 VARCHAR(64) NOT NULL, \
             reason VARCHAR(1000) NOT NULL, requested_by VARCHAR(255) NOT NULL, \
             erased_ms BIGINT NOT NULL, tables_json TEXT NOT NULL, \
             event_from_us BIGINT, event_to_us BIGINT, completed_ms BIGINT, \
             customer_sha256 VARCHAR(64), events_sequence BIGINT)",
        )
        .execute(&self.control)
        .await
        .map_err(|e| LakeError::sql("create sw_erasures", e))?;
        self.migrate_erasures().await?;
        let ns = NamespaceIdent::new(NAMESPACE.to_string());
        let exists = self
            .catalog
            .namespace_exists(&ns)
            .await
            .map_err(|e| LakeError::iceberg("check namespace", e))?;
        if !exists && let Err(e) = self.catalog.create_namespace(&ns, HashMap::new()).await {
            // A concurrent init may have won the race (SQLite reports it as a constraint
            // violation, not as "already exists"): only a namespace still missing is an error.
            let now_exists = self.catalog.namespace_exists(&ns).await.unwrap_or(false);
            if !now_exists {
                return Err(LakeError::iceberg("create namespace signalweave", e));
            }
        }
        let mut created = Vec::new();
        for table in LakeTable::ALL {
            created.push((table, self.create_if_missing(table).await?));
        }
        let upsert = if self.config.is_sqlite() {
            "INSERT OR IGNORE INTO sw_meta (meta_key, meta_value) VALUES ('layout_version', '1')"
        } else {
            "INSERT INTO sw_meta (meta_key, meta_value) VALUES ('layout_version', '1') ON CONFLICT (meta_key) DO NOTHING"
        };
        sqlx::query(upsert)
            .execute(&self.control)
            .await
            .map_err(|e| LakeError::sql("record layout version", e))?;
        Ok(created)
    }

    /// Creates `table` where missing; true when this call created it. A concurrent creator
    /// that wins the race is not an error.
    async fn create_if_missing(&self, table: LakeTable) -> Result<bool> {
        let ns = NamespaceIdent::new(NAMESPACE.to_string());
        let ident = Self::ident(table);
        let exists = self
            .catalog
            .table_exists(&ident)
            .await
            .map_err(|e| LakeError::iceberg(format!("check {ident}"), e))?;
        if exists {
            return Ok(false);
        }
        let schema = table.iceberg_schema()?;
        let spec = table.partition_spec(&schema)?;
        let mut properties = table.properties();
        properties.insert(
            crate::layout::PROP_CREATED_MS.to_string(),
            chrono::Utc::now().timestamp_millis().to_string(),
        );
        let creation = TableCreation::builder()
            .name(table.name().to_string())
            .schema(schema)
            .partition_spec(spec)
            .properties(properties)
            .build();
        match self.catalog.create_table(&ns, creation).await {
            Ok(_) => Ok(true),
            Err(e) => {
                // As for the namespace: a concurrent creator may have won.
                if self.catalog.table_exists(&ident).await.unwrap_or(false) {
                    Ok(false)
                } else {
                    Err(LakeError::iceberg(format!("create {ident}"), e))
                }
            }
        }
    }

    /// Creates a job's output table where missing (see [`LakeTable::output`]); true when
    /// this call created it. An existing table must have the registered columns.
    pub async fn ensure_output_table(&self, table: LakeTable) -> Result<bool> {
        if !table.is_output() {
            return Err(LakeError::new(
                ErrorKind::InvalidInput,
                format!("{} is not an output table", table.name()),
            ));
        }
        let created = {
            let _ddl = ddl_lock(&self.config, &self.control).await?;
            self.create_if_missing(table).await?
        };
        if !created {
            let existing = self.table(table).await?;
            let arrow =
                iceberg::arrow::schema_to_arrow_schema(existing.metadata().current_schema())
                    .map_err(|e| LakeError::iceberg(format!("schema of {}", table.name()), e))?;
            let names = |fields: &arrow_schema::Fields| -> Vec<(String, arrow_schema::DataType)> {
                fields
                    .iter()
                    .map(|f| (f.name().clone(), f.data_type().clone()))
                    .collect()
            };
            if names(arrow.fields()) != names(table.arrow_schema().fields()) {
                return Err(LakeError::new(
                    ErrorKind::Conflict,
                    format!(
                        "output table {} exists with other columns (a job's aggregates changed?): \
                         write the new job version to a new output table or namespace",
                        table.name()
                    ),
                ));
            }
        }
        Ok(created)
    }

    /// Registers every output table in the catalog's `signalweave` namespace (tables that
    /// are not built-in), so [`LakeTable::from_name`] and SQL find them. Returns them.
    pub async fn register_output_tables(&self) -> Result<Vec<LakeTable>> {
        let ns = NamespaceIdent::new(NAMESPACE.to_string());
        if !self
            .catalog
            .namespace_exists(&ns)
            .await
            .map_err(|e| LakeError::iceberg("check namespace", e))?
        {
            return Ok(Vec::new());
        }
        let idents = self
            .catalog
            .list_tables(&ns)
            .await
            .map_err(|e| LakeError::iceberg("list tables", e))?;
        let mut out = Vec::new();
        for ident in idents {
            let name = ident.name();
            if LakeTable::ALL.iter().any(|t| t.name() == name) {
                continue;
            }
            let t = self
                .catalog
                .load_table(&ident)
                .await
                .map_err(|e| LakeError::iceberg(format!("load {ident}"), e))?;
            let arrow = iceberg::arrow::schema_to_arrow_schema(t.metadata().current_schema())
                .map_err(|e| LakeError::iceberg(format!("schema of {ident}"), e))?;
            match LakeTable::output(name, &arrow) {
                Ok(table) => out.push(table),
                Err(e) => {
                    tracing::warn!(table = name, error = %e, "skipping a table SignalWeave cannot read")
                }
            }
        }
        Ok(out)
    }

    /// Brings an `sw_erasures` made by an earlier version up to date: it had no event
    /// range and no digest of the customer id alone (running jobs read them to leave the
    /// erased windows out), no mark of an erasure's end, and on PostgreSQL a `tables_json`
    /// of 4,000 characters (an erasure now counts a row per output table of every
    /// namespace; SQLite does not limit a VARCHAR). The columns are read first, in one
    /// query: every command opens the lake, and DDL on PostgreSQL locks the table.
    async fn migrate_erasures(&self) -> Result<()> {
        let sqlite = self.config.is_sqlite();
        let columns: Vec<(String, String)> = sqlx::query_as(if sqlite {
            "SELECT name, type FROM pragma_table_info('sw_erasures')"
        } else {
            "SELECT CAST(column_name AS TEXT), CAST(data_type AS TEXT) FROM information_schema.columns \
             WHERE table_schema = current_schema() AND table_name = 'sw_erasures'"
        })
        .fetch_all(&self.control)
        .await
        .map_err(|e| LakeError::sql("read sw_erasures' columns", e))?;
        let type_of = |name: &str| {
            columns
                .iter()
                .find(|(c, _)| c.eq_ignore_ascii_case(name))
                .map(|(_, t)| t.to_ascii_lowercase())
        };
        for (column, kind) in [
            ("event_from_us", "BIGINT"),
            ("event_to_us", "BIGINT"),
            ("completed_ms", "BIGINT"),
            ("customer_sha256", "VARCHAR(64)"),
            ("events_sequence", "BIGINT"),
        ] {
            if type_of(column).is_some() {
                continue;
            }
            let add = if sqlite {
                format!("ALTER TABLE sw_erasures ADD COLUMN {column} {kind}")
            } else {
                format!("ALTER TABLE sw_erasures ADD COLUMN IF NOT EXISTS {column} {kind}")
            };
            let added = sqlx::query(&add).execute(&self.control).await;
            // Another process may have added it meanwhile.
            let probe = format!("SELECT {column} FROM sw_erasures WHERE 1 = 0");
            if let Err(e) = added
                && sqlx::query(&probe).execute(&self.control).await.is_err()
            {
                return Err(LakeError::sql("add a column to sw_erasures", e));
            }
        }
        if !sqlite && type_of("tables_json").is_some_and(|t| t != "text") {
            sqlx::query("ALTER TABLE sw_erasures ALTER COLUMN tables_json TYPE TEXT")
                .execute(&self.control)
                .await
                .map_err(|e| LakeError::sql("widen sw_erasures.tables_json", e))?;
        }
        let indexed: i64 = sqlx::query_scalar(if sqlite {
            "SELECT COUNT(*) FROM sqlite_master WHERE type = 'index' \
             AND name = 'sw_erasures_by_time'"
        } else {
            "SELECT COUNT(*) FROM pg_indexes WHERE schemaname = current_schema() \
             AND indexname = 'sw_erasures_by_time'"
        })
        .fetch_one(&self.control)
        .await
        .map_err(|e| LakeError::sql("look for sw_erasures' index", e))?;
        if indexed == 0 {
            sqlx::query(
                "CREATE INDEX IF NOT EXISTS sw_erasures_by_time ON sw_erasures (catalog_name, erased_ms)",
            )
            .execute(&self.control)
            .await
            .map_err(|e| LakeError::sql("index sw_erasures", e))?;
        }
        Ok(())
    }

    /// Loads a built-in table's current metadata.
    ///
    /// A table loaded before is reused (with its cache of manifests) when one query on the
    /// catalog shows its metadata location is still current; otherwise it is loaded anew.
    pub async fn table(&self, table: LakeTable) -> Result<Table> {
        let ident = Self::ident(table);
        let cached = self.loaded.lock().ok().and_then(|m| m.get(&table).cloned());
        if let Some(cached) = cached
            && let Some(current) = self.current_metadata_location(table).await?
            && cached.metadata_location() == Some(current.as_str())
        {
            return Ok(cached);
        }
        let loaded = self.catalog.load_table(&ident).await.map_err(|e| {
            let mut err = LakeError::iceberg(format!("load {ident}"), e);
            if err.kind() == ErrorKind::NotFound {
                err = LakeError::new(
                    ErrorKind::NotFound,
                    format!("table {ident} does not exist; run `signalweave lake init`"),
                );
            }
            err
        })?;
        if let Ok(mut m) = self.loaded.lock() {
            m.insert(table, loaded.clone());
        }
        Ok(loaded)
    }

    /// The catalog's current metadata location of `table` (the JDBC-catalog row).
    async fn current_metadata_location(&self, table: LakeTable) -> Result<Option<String>> {
        let sql = if self.config.is_sqlite() {
            "SELECT metadata_location FROM iceberg_tables WHERE catalog_name = ? AND table_namespace = ? AND table_name = ?"
        } else {
            "SELECT metadata_location FROM iceberg_tables WHERE catalog_name = $1 AND table_namespace = $2 AND table_name = $3"
        };
        let row: Option<(Option<String>,)> = sqlx::query_as(sql)
            .bind(self.config.catalog_name.as_str())
            .bind(NAMESPACE)
            .bind(table.name())
            .fetch_optional(&self.control)
            .await
            .map_err(|e| LakeError::sql("read the catalog's metadata location", e))?;
        Ok(row.and_then(|(loc,)| loc))
    }

    /// A summary property of the first retained snapshot `writer_id` committed to `table`.
    pub async fn writer_summary(
        &self,
        table: LakeTable,
        writer_id: &str,
        key: &str,
    ) -> Result<Option<String>> {
        let t = self.table(table).await?;
        Ok(t.metadata()
            .snapshots()
            .filter(|s| {
                s.summary()
                    .additional_properties
                    .get(SUMMARY_WRITER_ID)
                    .map(String::as_str)
                    == Some(writer_id)
            })
            .min_by_key(|s| s.sequence_number())
            .and_then(|s| s.summary().additional_properties.get(key).cloned()))
    }

    /// Distinct writer ids of retained snapshots of `table` that start with `prefix`.
    pub async fn writers_with_prefix(&self, table: LakeTable, prefix: &str) -> Result<Vec<String>> {
        let t = self.table(table).await?;
        let mut ids: Vec<String> = t
            .metadata()
            .snapshots()
            .filter_map(|s| s.summary().additional_properties.get(SUMMARY_WRITER_ID))
            .filter(|w| w.starts_with(prefix))
            .cloned()
            .collect();
        ids.sort();
        ids.dedup();
        Ok(ids)
    }

    /// The snapshot of `table` committed with `identity`: a retained snapshot carrying it, or
    /// the record expiry left of one it removed (kept [`COMMIT_IDENTITY_TTL_MS`]). So a
    /// retried commit is recognised whatever the table's snapshot retention.
    pub async fn committed(
        &self,
        table: LakeTable,
        current: &Table,
        identity: &CommitIdentity,
    ) -> Result<Option<i64>> {
        if let Some(id) = Self::find_commit(current, identity) {
            return Ok(Some(id));
        }
        let sql = if self.config.is_sqlite() {
            "SELECT snapshot_id FROM sw_commit_identities WHERE catalog_name = ? AND table_name = ? \
             AND writer_id = ? AND batch_seq = ?"
        } else {
            "SELECT snapshot_id FROM sw_commit_identities WHERE catalog_name = $1 AND table_name = $2 \
             AND writer_id = $3 AND batch_seq = $4"
        };
        let row: Option<(i64,)> = sqlx::query_as(sql)
            .bind(self.config.catalog_name.as_str())
            .bind(table.name())
            .bind(identity.writer_id.as_str())
            .bind(identity.batch_seq as i64)
            .fetch_optional(&self.control)
            .await
            .map_err(|e| LakeError::sql("read commit identities", e))?;
        Ok(row.map(|(id,)| id))
    }

    /// Records the commit identities carried by `snapshots`, which an expiry is about to
    /// remove from `table`'s metadata, and forgets records older than
    /// [`COMMIT_IDENTITY_TTL_MS`], except a load's (recorded in `sw_loads`: a load can be
    /// resumed whenever, and its chunks must still be recognised) and each writer's last
    /// (a writer retries its last commit whenever it comes back: a live job that crashed
    /// between its sink commit and its checkpoint pointer finds its epoch committed
    /// however long it stayed down). Runs before the expiry commits: every identity ever
    /// committed is always in a retained snapshot or in `sw_commit_identities`.
    pub(crate) async fn record_commit_identities<'a>(
        &self,
        table: LakeTable,
        snapshots: impl Iterator<Item = &'a Snapshot>,
    ) -> Result<usize> {
        let rows: Vec<(String, i64, i64, i64)> = snapshots
            .filter_map(|s| {
                let p = &s.summary().additional_properties;
                let writer = p.get(SUMMARY_WRITER_ID)?;
                let seq = p.get(SUMMARY_BATCH_SEQ)?.parse::<i64>().ok()?;
                Some((writer.clone(), seq, s.snapshot_id(), s.timestamp_ms()))
            })
            .collect();
        let (insert, prune) = if self.config.is_sqlite() {
            (
                "INSERT INTO sw_commit_identities (catalog_name, table_name, writer_id, batch_seq, \
                 snapshot_id, committed_ms) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                "DELETE FROM sw_commit_identities WHERE catalog_name = ? AND table_name = ? \
                 AND committed_ms < ? AND NOT EXISTS (SELECT 1 FROM sw_loads l \
                 WHERE l.catalog_name = sw_commit_identities.catalog_name \
                 AND l.writer_id = sw_commit_identities.writer_id) \
                 AND batch_seq < (SELECT max(m.batch_seq) FROM sw_commit_identities m \
                 WHERE m.catalog_name = sw_commit_identities.catalog_name \
                 AND m.table_name = sw_commit_identities.table_name \
                 AND m.writer_id = sw_commit_identities.writer_id)",
            )
        } else {
            (
                "INSERT INTO sw_commit_identities (catalog_name, table_name, writer_id, batch_seq, \
                 snapshot_id, committed_ms) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
                "DELETE FROM sw_commit_identities WHERE catalog_name = $1 AND table_name = $2 \
                 AND committed_ms < $3 AND NOT EXISTS (SELECT 1 FROM sw_loads l \
                 WHERE l.catalog_name = sw_commit_identities.catalog_name \
                 AND l.writer_id = sw_commit_identities.writer_id) \
                 AND batch_seq < (SELECT max(m.batch_seq) FROM sw_commit_identities m \
                 WHERE m.catalog_name = sw_commit_identities.catalog_name \
                 AND m.table_name = sw_commit_identities.table_name \
                 AND m.writer_id = sw_commit_identities.writer_id)",
            )
        };
        let mut tx = self
            .control
            .begin()
            .await
            .map_err(|e| LakeError::sql("record commit identities", e))?;
        for (writer, seq, snapshot, at) in &rows {
            sqlx::query(insert)
                .bind(self.config.catalog_name.as_str())
                .bind(table.name())
                .bind(writer.as_str())
                .bind(*seq)
                .bind(*snapshot)
                .bind(*at)
                .execute(&mut *tx)
                .await
                .map_err(|e| LakeError::sql("record commit identities", e))?;
        }
        sqlx::query(prune)
            .bind(self.config.catalog_name.as_str())
            .bind(table.name())
            .bind(chrono::Utc::now().timestamp_millis() - COMMIT_IDENTITY_TTL_MS)
            .execute(&mut *tx)
            .await
            .map_err(|e| LakeError::sql("forget old commit identities", e))?;
        tx.commit()
            .await
            .map_err(|e| LakeError::sql("record commit identities", e))?;
        Ok(rows.len())
    }

    /// The snapshot of `table` committed with `identity`, if one is retained (see
    /// [`Lake::committed`], which also finds expired ones).
    pub fn find_commit(table: &Table, identity: &CommitIdentity) -> Option<i64> {
        let seq = identity.batch_seq.to_string();
        table
            .metadata()
            .snapshots()
            .find(|s| {
                let props = &s.summary().additional_properties;
                props.get(SUMMARY_WRITER_ID) == Some(&identity.writer_id)
                    && props.get(SUMMARY_BATCH_SEQ) == Some(&seq)
            })
            .map(|s| s.snapshot_id())
    }

    /// Appends `batches` to `table` as Parquet data files in one fast-append commit
    /// recorded under `identity`.
    ///
    /// Idempotent: if the table already carries `identity` (see [`Lake::committed`]),
    /// nothing is written and the outcome says `already_committed`. Commit conflicts and
    /// transient failures (catalog or object store unavailable) are retried here, checking
    /// `identity` before each retry, so neither a racing writer with the same identity nor
    /// an attempt whose outcome was unknown is ever applied twice.
    pub async fn append(
        &self,
        table: LakeTable,
        batches: &[RecordBatch],
        identity: &CommitIdentity,
    ) -> Result<AppendOutcome> {
        self.append_with_summary(table, batches, identity, HashMap::new())
            .await
    }

    /// [`Lake::append`], recording `summary` properties in the snapshot summary as well.
    pub async fn append_with_summary(
        &self,
        table: LakeTable,
        batches: &[RecordBatch],
        identity: &CommitIdentity,
        summary: HashMap<String, String>,
    ) -> Result<AppendOutcome> {
        self.append_guarded(table, batches, identity, summary, &|| Ok(()), None)
            .await
    }

    /// [`Lake::append_with_summary`], asking `guard` whether it may go on before each
    /// attempt and again just before each attempt's catalog commit: a guard that says no
    /// ends the append with its error, retries or not. (A live job's guard is its lease: an
    /// append retried through a catalog outage must not commit once another instance may
    /// have taken the job over.)
    ///
    /// With a `fence`, each commit lands only while the fence's lease tenure holds,
    /// checked in the commit's own transaction (see [`Lake::fence`]); a fence that no
    /// longer holds ends the append with `Conflict`. The guard says when to stop trying;
    /// the fence makes sure a commit already under way when the lease was lost is refused.
    pub async fn append_guarded(
        &self,
        table: LakeTable,
        batches: &[RecordBatch],
        identity: &CommitIdentity,
        summary: HashMap<String, String>,
        guard: &(dyn Fn() -> Result<()> + Send + Sync),
        fence: Option<&LeaseFence>,
    ) -> Result<AppendOutcome> {
        let expected = table.arrow_schema();
        for b in batches {
            if b.schema().fields() != expected.fields() {
                return Err(LakeError::new(
                    ErrorKind::InvalidInput,
                    format!("batch schema does not match {}", table.name()),
                ));
            }
        }
        let rows: u64 = batches.iter().map(|b| b.num_rows() as u64).sum();
        let mut pause = RetryPause::default();
        let mut written: Option<Vec<DataFile>> = None;
        let mut attempt = 0;
        loop {
            attempt += 1;
            guard()?;
            let result = self
                .append_attempt(
                    table,
                    batches,
                    identity,
                    rows,
                    &summary,
                    &mut written,
                    guard,
                    fence,
                )
                .await;
            match result {
                Ok(outcome) => return Ok(outcome),
                Err(e) if e.retryable() && attempt < DEFAULT_APPEND_ATTEMPTS => {
                    // A guard that says no now ends the append at once, not after a pause,
                    // and so does a fence that no longer holds (each attempt would write
                    // its manifests for nothing).
                    guard()?;
                    // (Only a refusal ends it: a check that fails for want of the database
                    // is no reason to stop retrying through an outage, and the fence in
                    // the commit's own transaction is what protects the write.)
                    if let Some(fence) = fence
                        && let Err(refused) = self.check_fence(fence).await
                        && refused.kind() == ErrorKind::Conflict
                    {
                        return Err(refused);
                    }
                    if e.kind() != ErrorKind::Conflict {
                        tracing::warn!(table = table.name(), attempt, error = %e, "append failed; retrying");
                    }
                    pause.wait(&e).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn append_attempt(
        &self,
        table: LakeTable,
        batches: &[RecordBatch],
        identity: &CommitIdentity,
        rows: u64,
        summary: &HashMap<String, String>,
        written: &mut Option<Vec<DataFile>>,
        guard: &(dyn Fn() -> Result<()> + Send + Sync),
        fence: Option<&LeaseFence>,
    ) -> Result<AppendOutcome> {
        let current = self.table(table).await?;
        if let Some(snapshot_id) = self.committed(table, &current, identity).await? {
            return Ok(AppendOutcome {
                snapshot_id,
                rows,
                data_files: 0,
                already_committed: true,
            });
        }
        if rows == 0 {
            return Err(LakeError::new(
                ErrorKind::InvalidInput,
                "an append needs at least one row",
            ));
        }
        let files = match written.take() {
            Some(files) => files,
            None => self.write_data_files(&current, batches, identity).await?,
        };
        let data_files = files.len();
        let mut props = summary.clone();
        props.insert(SUMMARY_WRITER_ID.to_string(), identity.writer_id.clone());
        props.insert(
            SUMMARY_BATCH_SEQ.to_string(),
            identity.batch_seq.to_string(),
        );
        let tx = Transaction::new(&current);
        let action = tx
            .fast_append()
            .with_check_duplicate(false)
            .set_snapshot_properties(props)
            .add_data_files(files.clone());
        let tx = action
            .apply(tx)
            .map_err(|e| LakeError::iceberg("plan append", e))?;
        // Pinned to `current`: a table another writer moved since the identity check is a
        // conflict, retried from that check, never a silent re-apply (see `pinned`).
        let mut pinned = PinnedCatalog::new(self.catalog.as_ref(), &current);
        pinned.fence = fence.map(|f| (self, f));
        if let Err(e) = guard() {
            *written = Some(files);
            return Err(e);
        }
        match tx.commit(&pinned).await {
            Ok(committed) => {
                let snapshot_id = Self::find_commit(&committed, identity)
                    .or_else(|| committed.metadata().current_snapshot_id())
                    .unwrap_or_default();
                // The committed table is the next append's base, unless another writer
                // moves it first: `table()` revalidates its location before reuse, which
                // spares re-reading the metadata file this commit just wrote.
                if committed.metadata_location().is_some()
                    && let Ok(mut m) = self.loaded.lock()
                {
                    m.insert(table, committed.clone());
                }
                Ok(AppendOutcome {
                    snapshot_id,
                    rows,
                    data_files,
                    already_committed: false,
                })
            }
            Err(e) => {
                *written = Some(files);
                if let Some(refused) = pinned.take_refusal() {
                    return Err(refused);
                }
                Err(LakeError::iceberg(
                    format!("commit to {}", Self::ident(table)),
                    e,
                ))
            }
        }
    }

    fn open_writer(
        &self,
        table: &Table,
        identity: &CommitIdentity,
        lineage: bool,
    ) -> Result<OpenWriter> {
        let metadata = table.metadata();
        let schema = if lineage {
            Arc::new(crate::lineage::with_lineage(metadata.current_schema())?)
        } else {
            metadata.current_schema().clone()
        };
        let spec = metadata.default_partition_spec().clone();
        let props = writer_properties(&schema, lineage)?;
        let location = DefaultLocationGenerator::new(metadata)
            .map_err(|e| LakeError::iceberg("location generator", e))?;
        let safe_writer: String = identity
            .writer_id
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .take(48)
            .collect();
        let names = DefaultFileNameGenerator::new(
            format!(
                "{safe_writer}-{}-{}",
                identity.batch_seq,
                uuid::Uuid::new_v4().simple()
            ),
            None,
            iceberg::spec::DataFileFormat::Parquet,
        );
        let rolling = RollingFileWriterBuilder::new(
            ParquetWriterBuilder::new(props, schema.clone()),
            DEFAULT_TARGET_FILE_SIZE,
            table.file_io().clone(),
            location,
            names,
        );
        let writer = FanoutWriter::new(DataFileWriterBuilder::new(rolling));
        let splitter = iceberg::arrow::RecordBatchPartitionSplitter::try_new_with_computed_values(
            schema, spec,
        )
        .map_err(|e| LakeError::iceberg("partition splitter", e))?;
        Ok(OpenWriter { writer, splitter })
    }

    async fn write_data_files(
        &self,
        table: &Table,
        batches: &[RecordBatch],
        identity: &CommitIdentity,
    ) -> Result<Vec<DataFile>> {
        let mut open = self.open_writer(table, identity, false)?;
        for batch in batches {
            open.write(batch).await?;
        }
        open.close().await
    }

    /// Starts an append whose data files are written while its batch grows: write batches
    /// as they arrive with [`AppendWriter::write`], then commit them all at once with
    /// [`Lake::commit_written`]. A group commit then pays only for closing the files and
    /// the metadata commit when it closes, not for encoding the whole group.
    pub async fn append_writer(
        &self,
        table: LakeTable,
        identity: &CommitIdentity,
    ) -> Result<AppendWriter> {
        self.writer(table, identity, false).await
    }

    /// An [`AppendWriter`] for rewritten rows, whose files keep each row's lineage (see
    /// [`crate::lineage`]): write with [`AppendWriter::write_lineaged`].
    pub(crate) async fn lineage_writer(
        &self,
        table: LakeTable,
        identity: &CommitIdentity,
    ) -> Result<AppendWriter> {
        self.writer(table, identity, true).await
    }

    async fn writer(
        &self,
        table: LakeTable,
        identity: &CommitIdentity,
        lineage: bool,
    ) -> Result<AppendWriter> {
        let t = self.table(table).await?;
        let open = self.open_writer(&t, identity, lineage)?;
        Ok(AppendWriter {
            table,
            identity: identity.clone(),
            open,
            rows: 0,
            lineage,
        })
    }

    /// Commits the files of a finished [`AppendWriter`] in one fast-append recorded under
    /// the writer's identity, with the same idempotence and retries as [`Lake::append`].
    pub async fn commit_written(
        &self,
        written: WrittenFiles,
        summary: HashMap<String, String>,
    ) -> Result<AppendOutcome> {
        let WrittenFiles {
            table,
            identity,
            files,
            rows,
        } = written;
        let mut pause = RetryPause::default();
        let mut files = Some(files);
        let mut attempt = 0;
        loop {
            attempt += 1;
            let result = self
                .append_attempt(
                    table,
                    &[],
                    &identity,
                    rows,
                    &summary,
                    &mut files,
                    &|| Ok(()),
                    None,
                )
                .await;
            match result {
                Ok(outcome) => return Ok(outcome),
                Err(e) if e.retryable() && attempt < DEFAULT_APPEND_ATTEMPTS => {
                    if e.kind() != ErrorKind::Conflict {
                        tracing::warn!(table = table.name(), attempt, error = %e, "commit failed; retrying");
                    }
                    pause.wait(&e).await;
                    if files.is_none() {
                        // The attempt failed before it could keep its files (for example
                        // while loading the table): nothing was committed, so nothing to
                        // retry with; the caller falls back to a full append.
                        return Err(e);
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Expires snapshots of `table` by its retention rule (table properties
    /// `history.expire.max-snapshot-age-ms` and `history.expire.min-snapshots-to-keep`;
    /// `retain_last` overrides the latter, `older_than_ms` the age cut-off). The current
    /// snapshot is always kept.
    ///
    /// This removes snapshots from the table metadata only; deleting the files they alone
    /// referenced is the orphan-file sweep's job (lake maintenance). A retried append is
    /// recognised by its snapshot while retained and by `sw_commit_identities` after (see
    /// [`Lake::committed`]).
    pub async fn expire_snapshots(
        &self,
        table: LakeTable,
        retain_last: Option<usize>,
        older_than_ms: Option<i64>,
    ) -> Result<ExpireOutcome> {
        let current = self.table(table).await?;
        let before = current.metadata().snapshots().len();
        let mut action = Transaction::new(&current).expire_snapshots();
        if let Some(n) = retain_last {
            action = action.retain_last(n.max(1));
        }
        if let Some(ms) = older_than_ms {
            action = action.expire_older_than_ms(ms);
        }
        let tx = action
            .apply(Transaction::new(&current))
            .map_err(|e| LakeError::iceberg("plan expiry", e))?;
        // Which snapshots go is iceberg's decision: record every identity first.
        self.record_commit_identities(table, current.metadata().snapshots().map(|s| s.as_ref()))
            .await?;
        let after_table = tx
            .commit(self.catalog.as_ref())
            .await
            .map_err(|e| LakeError::iceberg(format!("expire snapshots of {}", table.name()), e))?;
        let after = after_table.metadata().snapshots().len();
        Ok(ExpireOutcome {
            snapshots_before: before,
            snapshots_after: after,
        })
    }

    /// The snapshots of `table`, oldest first.
    pub async fn snapshots(&self, table: LakeTable) -> Result<Vec<SnapshotInfo>> {
        let t = self.table(table).await?;
        let mut out: Vec<SnapshotInfo> = t
            .metadata()
            .snapshots()
            .map(|s| {
                let p = &s.summary().additional_properties;
                let num = |k: &str| p.get(k).and_then(|v| v.parse().ok()).unwrap_or(0);
                SnapshotInfo {
                    snapshot_id: s.snapshot_id(),
                    parent_id: s.parent_snapshot_id(),
                    sequence_number: s.sequence_number(),
                    timestamp_ms: s.timestamp_ms(),
                    operation: s.summary().operation.as_str().to_string(),
                    writer_id: p.get(SUMMARY_WRITER_ID).cloned(),
                    batch_seq: p.get(SUMMARY_BATCH_SEQ).and_then(|v| v.parse().ok()),
                    added_records: num("added-records"),
                    added_files: num("added-data-files"),
                    total_records: num("total-records"),
                }
            })
            .collect();
        out.sort_by_key(|s| (s.sequence_number, s.timestamp_ms));
        Ok(out)
    }

    /// The snapshot of `table` that was current at `timestamp_ms`; None when the table
    /// had none yet. Fails (`NotFound`) when the snapshot current then has been expired:
    /// the table held data at that time that it no longer retains, and an empty answer
    /// would be a wrong one. A moment before the table was made is None, whatever has
    /// expired since.
    pub async fn snapshot_as_of(&self, table: LakeTable, timestamp_ms: i64) -> Result<Option<i64>> {
        let t = self.table(table).await?;
        let meta = t.metadata();
        let created = meta
            .properties()
            .get(crate::layout::PROP_CREATED_MS)
            .and_then(|v| v.parse::<i64>().ok());
        if created.is_some_and(|created| timestamp_ms < created) {
            return Ok(None);
        }
        let then = meta
            .history()
            .iter()
            .filter(|entry| entry.timestamp_ms <= timestamp_ms)
            .max_by_key(|entry| entry.timestamp_ms)
            .map(|entry| entry.snapshot_id);
        let oldest = meta.snapshots().min_by_key(|s| s.sequence_number());
        let expired = match then {
            Some(id) => meta.snapshot_by_id(id).is_none(),
            // Before the first entry kept: the table was empty then only if its oldest
            // retained snapshot is its first.
            None => oldest.is_some_and(|s| s.parent_snapshot_id().is_some()),
        };
        if expired {
            let since = oldest.map_or_else(
                || "none".to_string(),
                |s| signalweave_model::format_rfc3339_micros(s.timestamp_ms().saturating_mul(1000)),
            );
            return Err(LakeError::new(
                ErrorKind::NotFound,
                format!(
                    "`{}` no longer retains its snapshot of {}: its history starts at {since} \
                     (older snapshots expired){}",
                    table.name(),
                    signalweave_model::format_rfc3339_micros(timestamp_ms.saturating_mul(1000)),
                    match created {
                        Some(ms) => format!(
                            "; the table was made at {}",
                            signalweave_model::format_rfc3339_micros(ms.saturating_mul(1000))
                        ),
                        None => String::new(),
                    }
                ),
            ));
        }
        Ok(then)
    }

    /// Plans a scan of `table` for `from_us <= time column < to_us` (microseconds),
    /// as of `snapshot_id` or the current snapshot. Day partitions outside the range are
    /// pruned from the manifests; rows outside it are filtered when read.
    pub async fn plan_time_range(
        &self,
        table: LakeTable,
        from_us: i64,
        to_us: i64,
        snapshot_id: Option<i64>,
    ) -> Result<ScanPlan> {
        self.plan_time_range_of(table, from_us, to_us, snapshot_id, None)
            .await
    }

    /// [`Lake::plan_time_range`] reading only `columns` (None: all).
    pub async fn plan_time_range_of(
        &self,
        table: LakeTable,
        from_us: i64,
        to_us: i64,
        snapshot_id: Option<i64>,
        columns: Option<&[String]>,
    ) -> Result<ScanPlan> {
        self.plan_column_range(
            table,
            table.time_column(),
            from_us,
            to_us,
            snapshot_id,
            columns,
        )
        .await
    }

    /// Plans a scan of `table` for `from_us <= column < to_us`, where `column` is any of
    /// its timestamp columns, as of `snapshot_id` or the current snapshot, reading only
    /// `columns` (None: all). Files whose bounds for `column` lie outside the range are
    /// pruned (by partition for the time column, by the data files' column statistics
    /// for the others); rows outside it are filtered when read.
    pub async fn plan_column_range(
        &self,
        table: LakeTable,
        column: &str,
        from_us: i64,
        to_us: i64,
        snapshot_id: Option<i64>,
        columns: Option<&[String]>,
    ) -> Result<ScanPlan> {
        let t = self.table(table).await?;
        let predicate = Reference::new(column)
            .greater_than_or_equal_to(Datum::timestamptz_micros(from_us))
            .and(Reference::new(column).less_than(Datum::timestamptz_micros(to_us)));
        let snapshot = match snapshot_id {
            Some(id) => Some(t.metadata().snapshot_by_id(id).cloned().ok_or_else(|| {
                LakeError::new(
                    ErrorKind::NotFound,
                    format!("snapshot {id} is not retained by {}", table.name()),
                )
            })?),
            None => t.metadata().current_snapshot().cloned(),
        };
        let Some(snapshot) = snapshot else {
            return Ok(ScanPlan {
                snapshot_id: None,
                tasks: Vec::new(),
                total_files: 0,
            });
        };
        let total_files = snapshot
            .summary()
            .additional_properties
            .get("total-data-files")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let mut scan = t
            .scan()
            .snapshot_id(snapshot.snapshot_id())
            .with_filter(predicate);
        if let Some(columns) = columns {
            scan = scan.select(columns.iter().cloned());
        }
        let scan = scan
            .build()
            .map_err(|e| LakeError::iceberg("plan range scan", e))?;
        let tasks: Vec<FileScanTask> = scan
            .plan_files()
            .await
            .map_err(|e| LakeError::iceberg("plan range scan", e))?
            .try_collect()
            .await
            .map_err(|e| LakeError::iceberg("plan range scan", e))?;
        Ok(ScanPlan {
            snapshot_id: Some(snapshot.snapshot_id()),
            tasks,
            total_files,
        })
    }

    /// Plans the live tail's read: the data files appended by snapshots after `after`
    /// (exclusive; None = from the start) up to the current snapshot. Only appends are
    /// read: `replace` (compaction), `overwrite` and `delete` (erasure) add no new rows.
    /// Fails with `NotFound` when
    /// `after` is no longer an ancestor of the current snapshot (expired position).
    pub async fn plan_appended_since(
        &self,
        table: LakeTable,
        after: Option<i64>,
    ) -> Result<IncrementalPlan> {
        self.plan_appended_bounded(table, after, usize::MAX).await
    }

    /// [`Lake::plan_appended_since`], reading at most `max_snapshots` snapshots after
    /// `after` (the plan's `upto` is the last one read), so a reader far behind catches
    /// up in bounded steps. Reading from the start is one step: the current snapshot.
    pub async fn plan_appended_bounded(
        &self,
        table: LakeTable,
        after: Option<i64>,
        max_snapshots: usize,
    ) -> Result<IncrementalPlan> {
        let t = self.table(table).await?;
        let metadata = t.metadata();
        if metadata.current_snapshot().is_none() {
            return Ok(IncrementalPlan {
                after,
                upto: after,
                snapshots: Vec::new(),
                commit_ms: Vec::new(),
                tasks: Vec::new(),
                task_snapshots: Vec::new(),
                removed_rows: false,
            });
        }
        let mut chain = snapshots_after(metadata, table, after)?;
        let removes_rows = |s: &iceberg::spec::SnapshotRef| {
            matches!(
                s.summary().operation,
                Operation::Overwrite | Operation::Delete
            )
        };
        // The newest snapshot that removed rows: the files appended before it may hold
        // rows it removed (an erasure's), so a read from the start begins no earlier.
        let last_removal = chain.iter().rposition(removes_rows);
        // From the start of a table whose first snapshot is retained, the appends are read
        // one by one like any other position's.
        let from_root = after.is_none()
            && last_removal.is_none()
            && chain
                .first()
                .is_some_and(|s| s.parent_snapshot_id().is_none());
        if after.is_some() || from_root {
            chain.truncate(max_snapshots.max(1));
        } else {
            // Earlier snapshots expired (or removed rows): the first step reads every live
            // file of one snapshot (including files added by expired snapshots): the
            // oldest retained one since the last removal for a bounded read, the current
            // one otherwise.
            let target = if max_snapshots == usize::MAX {
                chain.len().saturating_sub(1)
            } else {
                last_removal.unwrap_or(0)
            };
            chain = chain.split_off(target);
            chain.truncate(1);
        }
        let removed_rows = after.is_some() && chain.iter().any(removes_rows);
        let snapshots: Vec<i64> = chain.iter().map(|s| s.snapshot_id()).collect();
        let commit_ms: Vec<i64> = chain.iter().map(|s| s.timestamp_ms()).collect();
        if after.is_none() && !from_root {
            let plan = self
                .plan_time_range(table, i64::MIN, i64::MAX, snapshots.first().copied())
                .await?;
            let read = snapshots.first().copied().unwrap_or_default();
            return Ok(IncrementalPlan {
                after,
                upto: snapshots.first().copied(),
                snapshots,
                commit_ms,
                task_snapshots: vec![read; plan.tasks.len()],
                tasks: plan.tasks,
                removed_rows,
            });
        }
        let schema = metadata.current_schema().clone();
        let field_ids: Vec<i32> = schema.as_struct().fields().iter().map(|f| f.id).collect();
        let mut tasks = Vec::new();
        let mut task_snapshots = Vec::new();
        for snapshot in &chain {
            // Only appends bring new rows: replace (compaction) rewrites rows already read,
            // overwrite and delete (erasure) rewrite or remove them.
            if snapshot.summary().operation != Operation::Append {
                continue;
            }
            let list = t
                .manifest_list_reader(snapshot)
                .load()
                .await
                .map_err(|e| LakeError::iceberg("read manifest list", e))?;
            let added: Vec<_> = list
                .entries()
                .iter()
                .filter(|m| m.added_snapshot_id == snapshot.snapshot_id() && m.has_added_files())
                .cloned()
                .collect();
            let manifests: Vec<_> = stream::iter(added)
                .map(|m| {
                    let io = t.file_io().clone();
                    async move {
                        let spec_id = m.partition_spec_id;
                        m.load_manifest(&io)
                            .await
                            .map(|manifest| (spec_id, manifest))
                    }
                })
                .buffered(8)
                .try_collect()
                .await
                .map_err(|e| LakeError::iceberg("read manifest", e))?;
            for (spec_id, manifest) in manifests {
                let spec = metadata.partition_spec_by_id(spec_id).cloned();
                for entry in manifest.entries() {
                    if entry.status() != ManifestStatus::Added
                        || entry.content_type() != DataContentType::Data
                    {
                        continue;
                    }
                    let file = entry.data_file();
                    tasks.push(whole_file_task(file, &schema, &field_ids, spec.clone()));
                    task_snapshots.push(snapshot.snapshot_id());
                }
            }
        }
        Ok(IncrementalPlan {
            after,
            upto: snapshots.last().copied().or(after),
            snapshots,
            commit_ms,
            tasks,
            task_snapshots,
            removed_rows,
        })
    }

    /// What a reader at position `after` has not read yet: the snapshots after it up to the
    /// current one (replace snapshots count as positions but add nothing), from their
    /// summaries alone. Fails like [`Lake::plan_appended_since`] for an expired position.
    pub async fn backlog(&self, table: LakeTable, after: Option<i64>) -> Result<Backlog> {
        let t = self.table(table).await?;
        let mut backlog = Backlog::default();
        // Newest first: the last one seen is the oldest unread.
        for s in snapshots_after(t.metadata(), table, after)?.iter().rev() {
            backlog.snapshots += 1;
            if s.summary().operation != Operation::Replace {
                let p = &s.summary().additional_properties;
                let num = |k: &str| p.get(k).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
                backlog.files += num("added-data-files");
                backlog.records += num("added-records");
                backlog.bytes += num("added-files-size");
            }
            backlog.oldest_commit_ms = Some(s.timestamp_ms());
        }
        Ok(backlog)
    }

    /// Reads planned files of `table` as Arrow batches.
    pub async fn read(
        &self,
        table: LakeTable,
        tasks: Vec<FileScanTask>,
    ) -> Result<ArrowRecordBatchStream> {
        self.read_with(table, tasks, false).await
    }

    /// Reads one planned file of `table` as [`Lake::read`] does, but only the pages that
    /// can match the task's predicate (a time range) by the statistics of the file's page
    /// index, in every column. A file that straddles a backfill's sub-ranges is then
    /// decompressed a part per sub-range, not whole in each; rows of those pages outside
    /// the range are still filtered out.
    ///
    /// The reader requires a page index to select pages, and a file from another writer
    /// may have none: a read that fails before its first batch is read again whole, and
    /// fails as that read does.
    ///
    /// `[from_us, to_us)` is the range of the table's time column the task was planned
    /// for. The strings stored as dictionaries come out as `Dictionary(Int32, Utf8)` (see
    /// `ranged`) where the file allows; other files are read by Iceberg's reader.
    pub async fn read_pages_in_range(
        &self,
        table: LakeTable,
        task: FileScanTask,
        from_us: i64,
        to_us: i64,
    ) -> Result<ArrowRecordBatchStream> {
        let t = self.table(table).await?;
        // A read that fails before its first batch is left to Iceberg's reader.
        let failed = match Self::ranged(&t, table, &task, (from_us, to_us), false).await {
            Ok(Some(mut ranged)) => match ranged.next().await {
                Some(Err(e)) => Some(e),
                first => return Ok(stream::iter(first).chain(ranged).boxed()),
            },
            Ok(None) => None,
            Err(e) => Some(e),
        };
        if let Some(e) = failed {
            tracing::debug!(file = %task.data_file_path, error = %e, "ranged read failed; reading with Iceberg's reader");
        }
        let mut pages = self.read_with(table, vec![task.clone()], true).await?;
        match pages.next().await {
            Some(Err(e)) => {
                tracing::debug!(file = %task.data_file_path, error = %e, "read by pages failed; reading the file whole");
                self.read(table, vec![task]).await
            }
            first => Ok(stream::iter(first).chain(pages).boxed()),
        }
    }

    /// [`Lake::read_pages_in_range`] of a data file with row lineage (see
    /// [`crate::lineage`]; a compacted file): each batch is followed by its rows'
    /// [`LINEAGE_COLUMN`](crate::LINEAGE_COLUMN). Iceberg's reader cannot read that
    /// column, so a file the project's reader does not take fails, classified `Internal`.
    pub async fn read_pages_with_lineage(
        &self,
        table: LakeTable,
        task: FileScanTask,
        from_us: i64,
        to_us: i64,
    ) -> Result<ArrowRecordBatchStream> {
        let t = self.table(table).await?;
        let ranged = Self::ranged(&t, table, &task, (from_us, to_us), true)
            .await
            .map_err(|e| LakeError::iceberg("read a data file with row lineage", e))?;
        ranged.ok_or_else(|| {
            LakeError::new(
                ErrorKind::Internal,
                format!(
                    "{}: a file with row lineage that cannot be read with it",
                    task.data_file_path
                ),
            )
        })
    }

    /// `ranged::open` of `task`, a data file of `table` (loaded as `t`), in `range` of
    /// its time column.
    async fn ranged(
        t: &Table,
        table: LakeTable,
        task: &FileScanTask,
        range: (i64, i64),
        lineage: bool,
    ) -> iceberg::Result<Option<ArrowRecordBatchStream>> {
        crate::ranged::open(t.file_io(), task, table.time_column(), range, 8192, lineage).await
    }

    async fn read_with(
        &self,
        table: LakeTable,
        tasks: Vec<FileScanTask>,
        select_pages: bool,
    ) -> Result<ArrowRecordBatchStream> {
        let t = self.table(table).await?;
        let reader = t
            .reader_builder()
            .with_batch_size(8192)
            .with_row_selection_enabled(select_pages)
            .build();
        let tasks = stream::iter(tasks.into_iter().map(Ok)).boxed();
        reader
            .read(tasks)
            .map(|r| r.stream())
            .map_err(|e| LakeError::iceberg("read data files", e))
    }

    /// Reads planned files of `table` into memory.
    pub async fn read_all(
        &self,
        table: LakeTable,
        tasks: Vec<FileScanTask>,
    ) -> Result<Vec<RecordBatch>> {
        self.read(table, tasks)
            .await?
            .try_collect()
            .await
            .map_err(|e| LakeError::iceberg("read data files", e))
    }

    /// Distinct data-file paths referenced by the current snapshot of `table`.
    pub async fn current_data_files(&self, table: LakeTable) -> Result<HashSet<String>> {
        let plan = self
            .plan_time_range(table, i64::MIN, i64::MAX, None)
            .await?;
        Ok(plan.tasks.into_iter().map(|t| t.data_file_path).collect())
    }
}

/// The snapshots of `metadata` after `after` (exclusive; None: every ancestor) up to the
/// current one, oldest first. `after` may itself be expired, as long as the snapshot that
/// followed it is retained: an erasure expires every snapshot before its own, and a reader
/// caught up at the erasure's parent continues from the erasure. `NotFound` when the
/// snapshots after `after` are gone too (a position expired before it was read past).
fn snapshots_after(
    metadata: &iceberg::spec::TableMetadata,
    table: LakeTable,
    after: Option<i64>,
) -> Result<Vec<iceberg::spec::SnapshotRef>> {
    let mut chain = Vec::new();
    let mut cursor = metadata.current_snapshot().cloned();
    let mut reached = after.is_none();
    while let Some(s) = cursor {
        if Some(s.snapshot_id()) == after {
            reached = true;
            break;
        }
        let parent = s.parent_snapshot_id();
        cursor = parent.and_then(|p| metadata.snapshot_by_id(p).cloned());
        chain.push(s);
        if after.is_some() && parent == after {
            // `after` is expired, but its child is here: nothing between is lost.
            reached = true;
            break;
        }
    }
    if !reached {
        return Err(LakeError::new(
            ErrorKind::NotFound,
            format!(
                "position {} of {} was expired before it was read past: the snapshots \
                 that followed it are gone too, so what they added cannot be told apart \
                 (recompute the range with a backfill and start the reader afresh)",
                after.unwrap_or_default(),
                table.name()
            ),
        ));
    }
    chain.reverse();
    Ok(chain)
}

/// A transaction-scoped advisory lock on PostgreSQL, held until the returned transaction
/// ends (dropping it rolls back, which releases the lock); nothing on SQLite, which
/// serializes DDL through its file lock.
pub(crate) async fn ddl_lock(
    config: &LakeConfig,
    pool: &AnyPool,
) -> Result<Option<sqlx::Transaction<'static, sqlx::Any>>> {
    if config.is_sqlite() {
        return Ok(None);
    }
    let mut tx = pool
        .begin()
        .await
        .map_err(|e| LakeError::sql("open a catalog transaction", e))?;
    sqlx::query("SELECT pg_advisory_xact_lock(7512293)")
        .execute(&mut *tx)
        .await
        .map_err(|e| LakeError::sql("take the DDL lock", e))?;
    Ok(Some(tx))
}

fn create_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| {
        LakeError::new(
            ErrorKind::Unavailable,
            format!("cannot create {}: {e}", dir.display()),
        )
    })
}

type DataWriter = FanoutWriter<
    DataFileWriterBuilder<ParquetWriterBuilder, DefaultLocationGenerator, DefaultFileNameGenerator>,
>;

struct OpenWriter {
    writer: DataWriter,
    splitter: iceberg::arrow::RecordBatchPartitionSplitter,
}

impl OpenWriter {
    async fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        let parts = self
            .splitter
            .split(batch)
            .map_err(|e| LakeError::iceberg("split batch by partition", e))?;
        for (key, part) in parts {
            self.writer
                .write(key, part)
                .await
                .map_err(|e| LakeError::iceberg("write data file", e))?;
        }
        Ok(())
    }

    async fn close(self) -> Result<Vec<DataFile>> {
        self.writer
            .close()
            .await
            .map_err(|e| LakeError::iceberg("close data files", e))
    }
}

/// Rows of a row group in a rewritten file (see [`writer_properties`]).
const REWRITTEN_ROW_GROUP_ROWS: usize = 65_536;

/// How every data file is written: Zstandard at level 1, and each string, integer, date
/// and timestamp column dictionary-encoded until its dictionary outgrows a page, then in a
/// delta encoding in place of `PLAIN`:
/// - strings in `DELTA_LENGTH_BYTE_ARRAY` (the lengths bit-packed, the bytes back to
///   back), not each value after its length;
/// - integers and times in `DELTA_BINARY_PACKED` (each value's difference from the last,
///   bit-packed by blocks), not eight bytes each.
///
/// The fallback is what a column of distinct values such as `event_id` or `event_time`
/// is stored in. `DELTA_LENGTH_BYTE_ARRAY` compresses as well as `PLAIN` and reads about a
/// quarter faster: the decoder copies the values' bytes in one piece. Times that mostly
/// rise shrink to a byte or two before Zstandard sees them, so the landed events take 7%
/// less space and a backfill reads them about a sixth faster (BENCHMARKS.md, stop 42).
/// Low-cardinality columns stay dictionaries, which readers keep as such.
///
/// A rewritten file (`rewritten`: compaction's, an erasure's of a compacted file) holds
/// many commits, a day partition's at most, in commit order: its row groups hold
/// [`REWRITTEN_ROW_GROUP_ROWS`] rows, so a narrow range of event time reads the groups
/// whose bounds it meets rather than the whole file (BENCHMARKS.md, issue 5, stop 54).
fn writer_properties(schema: &iceberg::spec::Schema, rewritten: bool) -> Result<WriterProperties> {
    let zstd = ZstdLevel::try_new(1)
        .map_err(|e| LakeError::new(ErrorKind::Internal, format!("zstd level: {e}")))?;
    let mut props = WriterProperties::builder().set_compression(Compression::ZSTD(zstd));
    if rewritten {
        props = props.set_max_row_group_row_count(Some(REWRITTEN_ROW_GROUP_ROWS));
    }
    for field in schema.as_struct().fields() {
        use iceberg::spec::PrimitiveType as P;
        let fallback = match *field.field_type {
            iceberg::spec::Type::Primitive(P::String) => Encoding::DELTA_LENGTH_BYTE_ARRAY,
            iceberg::spec::Type::Primitive(
                P::Int | P::Long | P::Date | P::Timestamp | P::Timestamptz,
            ) => Encoding::DELTA_BINARY_PACKED,
            _ => continue,
        };
        props = props.set_column_encoding(ColumnPath::from(field.name.as_str()), fallback);
    }
    Ok(props.build())
}

/// An append in progress: data files written batch by batch (see [`Lake::append_writer`]).
pub struct AppendWriter {
    table: LakeTable,
    identity: CommitIdentity,
    open: OpenWriter,
    rows: u64,
    /// Its files hold each row's lineage ([`Lake::lineage_writer`]).
    lineage: bool,
}

impl std::fmt::Debug for AppendWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppendWriter")
            .field("table", &self.table)
            .field("identity", &self.identity)
            .field("rows", &self.rows)
            .finish()
    }
}

impl AppendWriter {
    /// Encodes `batch` into the append's data files (schema checked).
    pub async fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        if self.lineage || batch.schema().fields() != self.table.arrow_schema().fields() {
            return Err(LakeError::new(
                ErrorKind::InvalidInput,
                format!("batch schema does not match {}", self.table.name()),
            ));
        }
        self.open.write(batch).await?;
        self.rows += batch.num_rows() as u64;
        Ok(())
    }

    /// Encodes `batch` (on the table's schema) and each row's `lineage` into the files of
    /// a [`Lake::lineage_writer`].
    pub(crate) async fn write_lineaged(
        &mut self,
        batch: &RecordBatch,
        lineage: &arrow::array::ArrayRef,
    ) -> Result<()> {
        if !self.lineage || batch.schema().fields() != self.table.arrow_schema().fields() {
            return Err(LakeError::new(
                ErrorKind::Internal,
                format!(
                    "batch schema does not match {} with lineage",
                    self.table.name()
                ),
            ));
        }
        let with = crate::lineage::attach(self.table, batch, lineage)?;
        self.open.write(&with).await?;
        self.rows += batch.num_rows() as u64;
        Ok(())
    }

    /// Rows written so far.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Closes the data files; commit them with [`Lake::commit_written`].
    pub async fn finish(self) -> Result<WrittenFiles> {
        let files = self.open.close().await?;
        Ok(WrittenFiles {
            table: self.table,
            identity: self.identity,
            files,
            rows: self.rows,
        })
    }
}

/// Closed data files of an [`AppendWriter`], not yet committed.
#[derive(Debug, Clone)]
pub struct WrittenFiles {
    table: LakeTable,
    identity: CommitIdentity,
    files: Vec<DataFile>,
    rows: u64,
}

impl WrittenFiles {
    /// Rows in the files.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    pub(crate) fn into_files(self) -> Vec<DataFile> {
        self.files
    }
}

/// A task that reads all of `file` with `schema`, projecting `field_ids`.
pub(crate) fn whole_file_task(
    file: &DataFile,
    schema: &iceberg::spec::SchemaRef,
    field_ids: &[i32],
    spec: Option<iceberg::spec::PartitionSpecRef>,
) -> FileScanTask {
    FileScanTask::builder()
        .with_file_size_in_bytes(file.file_size_in_bytes())
        .with_start(0)
        .with_length(file.file_size_in_bytes())
        .with_record_count(Some(file.record_count()))
        .with_data_file_path(file.file_path().to_string())
        .with_data_file_format(file.file_format())
        .with_schema(schema.clone())
        .with_project_field_ids(field_ids.to_vec())
        .with_partition(Some(file.partition().clone()))
        .with_partition_spec(spec)
        .with_case_sensitive(true)
        .build()
}

/// Batches read from `table` rebuilt on its Arrow schema (with field ids), so that a
/// writer of the same table takes them.
pub(crate) fn on_table_schema(
    table: LakeTable,
    batches: Vec<RecordBatch>,
) -> Result<Vec<RecordBatch>> {
    let schema = table.arrow_schema();
    batches
        .into_iter()
        .map(|b| RecordBatch::try_new(Arc::clone(&schema), b.columns().to_vec()))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| LakeError::arrow(format!("{} batch", table.name()), e))
}

/// `task` without the columns of `names` (those of them it projects): a read of it decodes
/// them no more.
pub fn project_without(task: &mut FileScanTask, names: &[String]) {
    let ids: Vec<i32> = names
        .iter()
        .filter_map(|n| task.schema.field_by_name(n).map(|f| f.id))
        .collect();
    task.project_field_ids.retain(|id| !ids.contains(id));
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `n` generated events, as one batch.
    pub(crate) fn events(n: u64) -> RecordBatch {
        let mut b = signalweave_model::EventBatchBuilder::with_capacity(n as usize);
        let spec = signalweave_fixtures::WorkloadSpec {
            events: n,
            ..Default::default()
        };
        for r in signalweave_fixtures::Generator::new(spec) {
            if let signalweave_fixtures::Record::Event(e) = r {
                b.push(&e);
            }
        }
        b.finish().expect("a batch of generated events")
    }

    /// An embedded lake in `dir`, its tables created.
    async fn initialised(dir: &std::path::Path) -> Lake {
        let lake = Lake::open(LakeConfig::embedded(dir)).await.expect("open");
        lake.init().await.expect("init");
        lake
    }

    /// A rewritten file's row groups hold at most [`REWRITTEN_ROW_GROUP_ROWS`] rows, so a
    /// narrow range reads the groups it meets; an append's file keeps Parquet's default.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_compacted_file_is_written_in_row_groups_a_narrow_range_can_skip() {
        use parquet::file::reader::{FileReader, SerializedFileReader};

        let dir = tempfile::tempdir().expect("tempdir");
        let lake = initialised(dir.path()).await;
        let data = events(150_000);
        for i in 0..6 {
            lake.append(
                LakeTable::Events,
                &[data.slice(i * 25_000, 25_000)],
                &CommitIdentity::new("row-groups", i as u64),
            )
            .await
            .expect("append");
        }
        let groups = |lake: Lake| async move {
            let mut out = Vec::new();
            for f in lake
                .current_data_files(LakeTable::Events)
                .await
                .expect("files")
            {
                let path = f.strip_prefix("file://").unwrap_or(&f).to_string();
                let reader =
                    SerializedFileReader::new(std::fs::File::open(&path).expect("open the file"))
                        .expect("a Parquet file");
                out.push(
                    reader
                        .metadata()
                        .row_groups()
                        .iter()
                        .map(|rg| rg.num_rows() as usize)
                        .collect::<Vec<_>>(),
                );
            }
            out
        };
        // Each append's file is one group.
        assert!(groups(lake.clone()).await.iter().all(|g| g.len() == 1));
        let report = lake
            .compact(LakeTable::Events, &crate::CompactionPolicy::default())
            .await
            .expect("compact");
        assert_eq!(report.rows, 150_000);
        let after = groups(lake.clone()).await;
        let rows: usize = after.iter().flatten().sum();
        assert_eq!(rows, 150_000);
        assert!(
            after
                .iter()
                .flatten()
                .all(|&n| n <= REWRITTEN_ROW_GROUP_ROWS)
                && after.iter().map(Vec::len).sum::<usize>() >= 3,
            "{after:?}"
        );
    }

    /// A column of distinct strings falls back from its dictionary to
    /// `DELTA_LENGTH_BYTE_ARRAY`, and one of distinct integers or times to
    /// `DELTA_BINARY_PACKED`, never to `PLAIN`; a column of a few values stays a
    /// dictionary; and the file reads back as it was written.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn distinct_values_fall_back_to_delta_encodings_and_few_stay_dictionaries() {
        use arrow::array::AsArray;
        use parquet::file::reader::{FileReader, SerializedFileReader};

        let dir = tempfile::tempdir().expect("tempdir");
        let lake = initialised(dir.path()).await;
        // More distinct event ids and event times than a dictionary page holds (1 MiB:
        // 131,072 times).
        let data = events(150_000);
        lake.append(
            LakeTable::Events,
            std::slice::from_ref(&data),
            &CommitIdentity::new("encodings", 1),
        )
        .await
        .expect("append");
        let files = lake
            .current_data_files(LakeTable::Events)
            .await
            .expect("files");
        let mut seen = 0;
        let mut fell_back = 0;
        let mut times_fell_back = 0;
        for f in &files {
            let path = f.strip_prefix("file://").unwrap_or(f);
            let reader =
                SerializedFileReader::new(std::fs::File::open(path).expect("open the file"))
                    .expect("a Parquet file");
            for rg in reader.metadata().row_groups() {
                for c in rg.columns() {
                    // The encodings of the data pages (the dictionary page is `PLAIN`).
                    let pages = c.page_encoding_stats_mask().expect("page encodings");
                    let name = c.column_path().string();
                    match name.as_str() {
                        "event_id" => {
                            assert!(!pages.is_set(Encoding::PLAIN), "{name}: {pages:?}");
                            fell_back +=
                                usize::from(pages.is_set(Encoding::DELTA_LENGTH_BYTE_ARRAY));
                            seen += 1;
                        }
                        "event_time" | "producer_seq" => {
                            assert!(!pages.is_set(Encoding::PLAIN), "{name}: {pages:?}");
                            times_fell_back +=
                                usize::from(pages.is_set(Encoding::DELTA_BINARY_PACKED));
                        }
                        "event_type" | "tenant" => {
                            assert!(pages.is_only(Encoding::RLE_DICTIONARY), "{name}: {pages:?}");
                        }
                        _ => {}
                    }
                }
            }
        }
        assert!(seen > 0, "no event_id column in {files:?}");
        assert!(fell_back > 0, "no event_id column outgrew its dictionary");
        assert!(
            times_fell_back > 0,
            "no event_time or producer_seq column outgrew its dictionary"
        );
        // Read back: the same ids with the same times, in some order.
        let plan = lake
            .plan_time_range(LakeTable::Events, i64::MIN, i64::MAX, None)
            .await
            .expect("plan");
        let batches = lake
            .read_all(LakeTable::Events, plan.tasks)
            .await
            .expect("read");
        let ids = |b: &RecordBatch| -> Vec<(Option<String>, i64)> {
            let ids = b.column_by_name("event_id").expect("event_id");
            let times = b.column_by_name("event_time").expect("event_time");
            ids.as_string::<i32>()
                .iter()
                .map(|v| v.map(str::to_string))
                .zip(
                    times
                        .as_primitive::<arrow::datatypes::TimestampMicrosecondType>()
                        .values()
                        .iter()
                        .copied(),
                )
                .collect()
        };
        let mut read: Vec<(Option<String>, i64)> = batches.iter().flat_map(ids).collect();
        let mut written = ids(&data);
        read.sort_unstable();
        written.sort_unstable();
        assert_eq!(read, written);
    }

    /// A guard that says no ends an append, retried or not: one that says no at once
    /// writes nothing; one that says no only just before the catalog commit (the files
    /// written) commits nothing, and the append returns its error rather than retrying.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_guard_that_says_no_ends_an_append_before_its_commit() {
        use std::sync::atomic::{AtomicUsize, Ordering};

        let dir = tempfile::tempdir().expect("tempdir");
        let lake = initialised(dir.path()).await;
        let data = events(50);
        let snapshots = || async {
            let t = lake.table(LakeTable::Events).await.expect("table");
            t.metadata().snapshots().count()
        };
        let before = snapshots().await;
        let refused = || Err(LakeError::new(ErrorKind::Unavailable, "the lease is stale"));
        let e = lake
            .append_guarded(
                LakeTable::Events,
                std::slice::from_ref(&data),
                &CommitIdentity::new("guarded", 1),
                HashMap::new(),
                &refused,
                None,
            )
            .await
            .expect_err("refused at once");
        assert!(e.message().contains("stale"), "{e}");
        let asked = AtomicUsize::new(0);
        let late = || {
            // Yes to the attempt, no to its commit, and no from then on.
            if asked.fetch_add(1, Ordering::SeqCst) == 0 {
                Ok(())
            } else {
                refused()
            }
        };
        let e = lake
            .append_guarded(
                LakeTable::Events,
                std::slice::from_ref(&data),
                &CommitIdentity::new("guarded", 2),
                HashMap::new(),
                &late,
                None,
            )
            .await
            .expect_err("refused before the commit");
        assert!(e.message().contains("stale"), "{e}");
        assert_eq!(
            asked.load(Ordering::SeqCst),
            3,
            "asked before the attempt, its commit and the retry"
        );
        assert_eq!(snapshots().await, before);
        // With the guard's yes, the same append commits.
        lake.append_guarded(
            LakeTable::Events,
            std::slice::from_ref(&data),
            &CommitIdentity::new("guarded", 2),
            HashMap::new(),
            &|| Ok(()),
            None,
        )
        .await
        .expect("append");
        assert_eq!(snapshots().await, before + 1);
    }

    /// A fenced append commits only in its lease's tenure, whatever its guard says: once
    /// another owner took the lease over, even one that has given it up and whose lease the
    /// first owner then took back, the append is a conflict, commits nothing and leaves no
    /// metadata file behind. The tenure taken back commits.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_fenced_append_commits_only_in_its_leases_tenure() {
        let dir = tempfile::tempdir().expect("tempdir");
        let lake = initialised(dir.path()).await;
        let data = events(20);
        let ttl = std::time::Duration::from_secs(60);
        let gone = std::time::Duration::ZERO;
        let append = |fence: LeaseFence, seq: u64| {
            let (lake, data) = (lake.clone(), data.clone());
            async move {
                lake.append_guarded(
                    LakeTable::Events,
                    std::slice::from_ref(&data),
                    &CommitIdentity::new("fenced", seq),
                    HashMap::new(),
                    &|| Ok(()),
                    Some(&fence),
                )
                .await
            }
        };
        let state = || async {
            let t = lake.table(LakeTable::Events).await.expect("table");
            let location = t.metadata_location().expect("location");
            let metadata_dir = std::path::Path::new(location.trim_start_matches("file://"))
                .parent()
                .expect("metadata directory")
                .to_path_buf();
            let metadata_files = std::fs::read_dir(metadata_dir)
                .expect("metadata directory")
                .filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().ends_with(".metadata.json"))
                .count();
            (t.metadata().snapshots().count(), metadata_files)
        };
        let a = lake
            .take_lease("live", "job", "ns", "host:1:a", ttl)
            .await
            .expect("lease");
        append(a.clone(), 1).await.expect("its own tenure commits");
        // The lease runs out, and b takes it over, then gives it up.
        lake.take_lease("live", "job", "ns", "host:1:a", gone)
            .await
            .expect("renewed, to run out at once");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        let b = lake
            .take_lease("live", "job", "ns", "host:1:b", ttl)
            .await
            .expect("taken over");
        assert_eq!(b.generation, a.generation + 1);
        lake.release_lease("live", "job", "ns", "host:1:b")
            .await
            .expect("release");
        let before = state().await;
        let files = |dir: &std::path::Path| {
            let mut n = 0;
            let mut stack = vec![dir.to_path_buf()];
            while let Some(d) = stack.pop() {
                for e in std::fs::read_dir(d).expect("read dir").flatten() {
                    if e.path().is_dir() {
                        stack.push(e.path());
                    } else {
                        n += 1;
                    }
                }
            }
            n
        };
        let files_before = files(dir.path());
        let e = append(a.clone(), 2)
            .await
            .expect_err("b's tenure came between");
        // One attempt, not retried: its data file and its manifests are all it wrote.
        let written = files(dir.path()) - files_before;
        assert!(written <= 3, "{written} files written");
        assert_eq!(e.kind(), ErrorKind::Conflict, "{e}");
        assert!(e.message().contains("no longer"), "{e}");
        assert_eq!(
            state().await,
            before,
            "nothing committed, nothing left behind"
        );
        // a takes the lease back: a new tenure, and its fence commits.
        let again = lake
            .take_lease("live", "job", "ns", "host:1:a", ttl)
            .await
            .expect("taken back");
        assert_eq!(again.generation, b.generation + 1);
        append(a, 2)
            .await
            .expect_err("the old tenure still refused");
        append(again, 2).await.expect("the new tenure commits");
        assert_eq!(state().await.0, before.0 + 1);
    }

    /// Two writers with one identity read the table before either commits. iceberg's own
    /// commit re-applies the second on the table the first moved: the append would land
    /// twice. Pinned to the table it read, the second commit is a conflict instead, and
    /// `append` then finds the first writer's commit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_racer_with_the_same_identity_conflicts_instead_of_landing_twice() {
        let dir = tempfile::tempdir().expect("tempdir");
        let lake = initialised(dir.path()).await;
        let identity = CommitIdentity::new("racer", 1);
        let data = events(50);
        let stale = lake.table(LakeTable::Events).await.expect("table");
        assert_eq!(
            lake.committed(LakeTable::Events, &stale, &identity)
                .await
                .ok(),
            Some(None)
        );
        let files = lake
            .write_data_files(&stale, std::slice::from_ref(&data), &identity)
            .await
            .expect("write");
        let first = lake
            .append(LakeTable::Events, std::slice::from_ref(&data), &identity)
            .await
            .expect("first append");
        assert!(!first.already_committed);
        let racer = |files: Vec<DataFile>| {
            let tx = Transaction::new(&stale);
            tx.fast_append()
                .with_check_duplicate(false)
                .add_data_files(files)
                .apply(Transaction::new(&stale))
                .expect("plan")
        };
        let pinned = PinnedCatalog::new(lake.catalog.as_ref(), &stale);
        let lost = racer(files.clone()).commit(&pinned).await;
        assert!(
            matches!(&lost, Err(e) if e.kind() == iceberg::ErrorKind::CatalogCommitConflicts),
            "{lost:?}"
        );
        // The hazard itself: unpinned, iceberg re-applies the stale append on the new table.
        let doubled = racer(files)
            .commit(lake.catalog.as_ref())
            .await
            .expect("iceberg re-applies the append");
        assert_eq!(doubled.metadata().snapshots().count(), 2);
        let again = lake
            .append(LakeTable::Events, std::slice::from_ref(&data), &identity)
            .await
            .expect("retry");
        assert!(again.already_committed);
    }

    #[test]
    fn a_lost_race_is_retried_at_once_and_an_outage_backs_off() {
        let conflict = LakeError::new(ErrorKind::Conflict, "lost the race");
        let outage = LakeError::new(ErrorKind::Unavailable, "store down");
        let mut p = RetryPause::default();
        assert_eq!(p.next(&conflict), Duration::ZERO);
        for n in 2..40 {
            let cap = Duration::from_millis(1 << n.min(7));
            assert!(p.next(&conflict) < cap, "conflict {n}");
        }
        let mut p = RetryPause::default();
        let mut floor = Duration::from_millis(50);
        for _ in 0..10 {
            let pause = p.next(&outage);
            assert!(
                pause >= floor && pause < floor + floor / 2,
                "{pause:?} at {floor:?}"
            );
            floor = (floor * 2).min(Duration::from_secs(2));
        }
    }
}
