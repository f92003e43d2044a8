//! Lake maintenance: the project's own commit path for the snapshot operations
//! iceberg-rust 0.10 cannot commit, manifest merging, snapshot expiry that honours held
//! positions, and deletion of the files nothing references any more.
//!
//! **The commit path.** New table metadata is built with iceberg's public spec types
//! (`ManifestWriter`, `ManifestListWriter`, `Snapshot`, `TableMetadataBuilder`), written
//! as the next `NNNNN-<uuid>.metadata.json`, and made current by the same compare-and-set
//! on the JDBC-catalog row (`iceberg_tables.metadata_location`) that iceberg-catalog-sql
//! performs, so PyIceberg, Spark and Trino reading the catalog see an ordinary commit.
//! A concurrent append that wins the race makes the maintenance commit fail its CAS; it
//! is then rebuilt on the new base and retried. The append is never lost.
//!
//! **Manifest merging** (`rewrite manifests`, operation `replace`): when the current
//! snapshot holds at least `min_manifests_to_merge` manifests, the data manifests smaller
//! than the target size are rewritten, their live entries as `EXISTING` with their
//! original snapshot ids and sequence numbers, into manifests of about the target size.
//! Data does not change; incremental scans skip `replace` snapshots.
//!
//! **Expiry** removes snapshots older than `history.expire.max-snapshot-age-ms` beyond the
//! newest `history.expire.min-snapshots-to-keep`, never the current one and never one held
//! in `sw_snapshot_holds` (a live checkpoint's or a running backfill's position) or any
//! later one (the tail from a held position walks them). Then the
//! manifest lists, manifests and data files that only removed snapshots referenced are
//! deleted, and metadata files older than the metadata log's oldest entry.
//!
//! **The orphan sweep** deletes files under the table's location that no retained
//! snapshot references (left by failed or killed writers) once they are older than a
//! safety age, so a file being written by a commit in flight is never taken. Every pass
//! does this for the metadata directory (the manifest lists and manifests of commits that
//! lost their compare-and-set: about one in fifty appends at one commit per second with
//! maintenance beside them); the whole location, data files included, on request.

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt, stream};
use iceberg::MetadataLocation;
use iceberg::spec::{
    DataContentType, FormatVersion, ManifestContentType, ManifestFile, ManifestListWriter,
    ManifestWriterBuilder, Operation, Snapshot, Summary, TableMetadata,
};
use iceberg::table::Table;
use object_store::ObjectStore;
use serde::Serialize;
use signalweave_model::ErrorKind;

use crate::config::Warehouse;
use crate::error::{LakeError, Result};
use crate::lake::Lake;
use crate::layout::LakeTable;
use crate::lease::LeaseFence;

/// Settings of [`Lake::maintain`]; defaults follow Iceberg's table properties of the
/// same meaning.
#[derive(Debug, Clone)]
pub struct MaintenancePolicy {
    /// Merge manifests once the current snapshot holds this many
    /// (`commit.manifest.min-count-to-merge`).
    pub min_manifests_to_merge: usize,
    /// Target size of a merged manifest (`commit.manifest.target-size-bytes`).
    pub manifest_target_bytes: u64,
    /// Expire snapshots by the table's retention rule.
    pub expire: bool,
    /// Files younger than this are never taken by the orphan sweep; `None` skips it.
    pub orphan_safety_age: Option<Duration>,
    /// Every pass deletes the manifest lists and manifests in the table's metadata
    /// directory that no retained snapshot references once they are this old (what a
    /// commit that lost its compare-and-set, or a killed writer, left); `None` skips it.
    /// It lists the metadata directory only, which each pass lists anyway.
    pub metadata_orphan_age: Option<Duration>,
    /// Overrides the table's retention properties for this pass.
    pub retention: Option<Retention>,
    /// Expire held positions too (erasure only: the old files must go).
    pub override_holds: bool,
    /// Snapshots kept only by holds from which [`Lake::held_history_warning`] warns.
    pub warn_held_snapshots: usize,
    /// Expiry keeps this snapshot and every later one, whatever else applies (an
    /// erasure's own snapshot: readers caught up at it or after it go on).
    pub keep_from: Option<i64>,
}

/// Which snapshots expiry keeps: the newest `keep_last`, and every one younger than
/// `max_age_ms` (plus the current one and every held one, always).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Snapshots always kept, newest first.
    pub keep_last: usize,
    /// Snapshots younger than this are kept, milliseconds.
    pub max_age_ms: i64,
}

impl MaintenancePolicy {
    /// Default merge threshold: 100 manifests.
    pub const DEFAULT_MIN_MANIFESTS_TO_MERGE: usize = 100;
    /// Default merged manifest size: 8 MiB.
    pub const DEFAULT_MANIFEST_TARGET_BYTES: u64 = 8 * 1024 * 1024;
    /// Default warning threshold of snapshots kept only by holds: an hour of commits at
    /// one per second.
    pub const DEFAULT_WARN_HELD_SNAPSHOTS: usize = 3_600;
    /// Default orphan safety age: 1 hour.
    pub const DEFAULT_ORPHAN_SAFETY_AGE: Duration = Duration::from_secs(3600);
}

impl Default for MaintenancePolicy {
    fn default() -> Self {
        Self {
            min_manifests_to_merge: Self::DEFAULT_MIN_MANIFESTS_TO_MERGE,
            manifest_target_bytes: Self::DEFAULT_MANIFEST_TARGET_BYTES,
            expire: true,
            orphan_safety_age: None,
            metadata_orphan_age: Some(Self::DEFAULT_ORPHAN_SAFETY_AGE),
            retention: None,
            override_holds: false,
            warn_held_snapshots: Self::DEFAULT_WARN_HELD_SNAPSHOTS,
            keep_from: None,
        }
    }
}

/// What one maintenance pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct MaintenanceReport {
    /// Manifests in the current snapshot before and after.
    pub manifests_before: usize,
    /// See `manifests_before`.
    pub manifests_after: usize,
    /// The `replace` snapshot that merged manifests, if any.
    pub merge_snapshot: Option<i64>,
    /// Snapshots removed by expiry.
    pub snapshots_expired: usize,
    /// Snapshots kept because a checkpoint or backfill holds them.
    pub snapshots_held: usize,
    /// Files deleted: manifest lists, manifests, data files, metadata files, orphans.
    pub deleted: DeletedFiles,
    /// CAS conflicts lost to concurrent writers (each retried on the new base).
    pub conflicts: u32,
}

/// A position held against expiry (`sw_snapshot_holds`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SnapshotHold {
    /// The table.
    pub table: String,
    /// Who holds it: `job:…` (a checkpoint), `backfill:…`, `effects:…`.
    pub holder: String,
    /// The held snapshot (it and every later one are kept).
    pub snapshot_id: i64,
    /// When the holder last moved it, ms since the epoch.
    pub updated_ms: i64,
}

/// A hold whose holder's name carries this is transient: a planning step's (a backfill's
/// start), held for the moments between choosing a snapshot and recording who holds it
/// for good. One older than [`TRANSIENT_HOLD_TTL_MS`] is the leftover of a process that
/// died meanwhile, and expiry drops it.
pub const TRANSIENT_HOLD_MARKER: &str = ":planning:";

/// How long a transient hold keeps its snapshot at most (see [`TRANSIENT_HOLD_MARKER`]).
pub const TRANSIENT_HOLD_TTL_MS: i64 = 3_600_000;

/// Files deleted by maintenance, by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DeletedFiles {
    /// Manifest lists.
    pub manifest_lists: usize,
    /// Manifests.
    pub manifests: usize,
    /// Data files.
    pub data_files: usize,
    /// Old table metadata files.
    pub metadata_files: usize,
    /// Orphans (unreferenced, older than the safety age).
    pub orphans: usize,
}

/// Table property: how many previous metadata files the metadata log keeps.
pub const PROP_PREVIOUS_VERSIONS_MAX: &str = "write.metadata.previous-versions-max";
/// Default of [`PROP_PREVIOUS_VERSIONS_MAX`] set by SignalWeave: 10.
pub const DEFAULT_PREVIOUS_VERSIONS_MAX: usize = 10;

const CONFLICT_ATTEMPTS: u32 = 50;

fn ice(context: &str) -> impl FnOnce(iceberg::Error) -> LakeError + '_ {
    move |e| LakeError::iceberg(context, e)
}

pub(crate) fn fresh_snapshot_id(md: &TableMetadata) -> i64 {
    loop {
        let (hi, lo) = uuid::Uuid::new_v4().as_u64_pair();
        let id = ((hi ^ lo) & (i64::MAX as u64)) as i64;
        if id != 0 && md.snapshot_by_id(id).is_none() {
            return id;
        }
    }
}

/// The sequence number of the oldest snapshot of `md` among `held`: a hold keeps its
/// snapshot and every later one (a tail reading from it walks the chain appended since).
fn oldest_held(md: &TableMetadata, held: &HashSet<i64>) -> Option<i64> {
    md.snapshots()
        .filter(|s| held.contains(&s.snapshot_id()))
        .map(|s| s.sequence_number())
        .min()
}

/// A snapshot of `removed` that the holds `held` keep, if there is one.
fn held_among(md: &TableMetadata, held: &HashSet<i64>, removed: &HashSet<i64>) -> Option<i64> {
    let oldest = oldest_held(md, held)?;
    md.snapshots()
        .filter(|s| removed.contains(&s.snapshot_id()) && s.sequence_number() >= oldest)
        .map(|s| s.snapshot_id())
        .next()
}

/// Whether a manifest entry is a data file the snapshot that lists it holds.
pub(crate) fn live_data(e: &iceberg::spec::ManifestEntry) -> bool {
    e.is_alive() && e.data_file().content_type() == DataContentType::Data
}

/// The manifests listed by `snapshot` of `base`.
pub(crate) async fn current_manifests(
    base: &Table,
    snapshot: &iceberg::spec::SnapshotRef,
) -> Result<Vec<ManifestFile>> {
    Ok(base
        .manifest_list_reader(snapshot)
        .load()
        .await
        .map_err(ice("read manifest list"))?
        .consume_entries()
        .into_iter()
        .collect())
}

/// The data manifests listed by `snapshot` of `base`, loaded (8 at a time).
pub(crate) async fn data_manifests(
    base: &Table,
    snapshot: &iceberg::spec::SnapshotRef,
) -> Result<Vec<iceberg::spec::Manifest>> {
    let manifests: Vec<ManifestFile> = current_manifests(base, snapshot)
        .await?
        .into_iter()
        .filter(|m| m.content == iceberg::spec::ManifestContentType::Data)
        .collect();
    let io = base.file_io().clone();
    futures::stream::iter(manifests)
        .map(|m| {
            let io = io.clone();
            async move { m.load_manifest(&io).await }
        })
        .buffered(8)
        .try_collect()
        .await
        .map_err(ice("read manifest"))
}

/// What maintenance has read of immutable manifest lists and manifests, by path: a pass
/// reads only the files new since the last one. Bounded: cleared past a size.
#[derive(Debug, Default)]
pub struct ManifestCache {
    lists: HashMap<String, Arc<Vec<ManifestFile>>>,
    files: HashMap<String, Arc<Vec<String>>>,
}

impl ManifestCache {
    const MAX_ENTRIES: usize = 20_000;

    fn put_list(&mut self, path: String, list: Arc<Vec<ManifestFile>>) {
        if self.lists.len() >= Self::MAX_ENTRIES {
            self.lists.clear();
        }
        self.lists.insert(path, list);
    }

    fn put_manifest(&mut self, path: String, files: Arc<Vec<String>>) {
        if self.files.len() >= Self::MAX_ENTRIES {
            self.files.clear();
        }
        self.files.insert(path, files);
    }

    fn forget(&mut self, paths: &[String]) {
        for p in paths {
            self.lists.remove(p);
            self.files.remove(p);
        }
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Merged manifests written for a merge snapshot, kept across lost races.
struct PreparedMerge {
    snapshot_id: i64,
    commit_uuid: String,
    created: Vec<ManifestFile>,
    replaced: HashSet<String>,
    written: Vec<String>,
    entries: u64,
}

/// Everything a set of snapshots references.
#[derive(Debug, Default)]
struct Reachable {
    manifest_lists: HashSet<String>,
    manifests: HashSet<String>,
    data_files: HashSet<String>,
}

impl Lake {
    /// The retention rule `table` keeps by its properties (or the defaults):
    /// `history.expire.min-snapshots-to-keep` and `history.expire.max-snapshot-age-ms`.
    pub async fn retention_of(&self, table: LakeTable) -> Result<Retention> {
        let t = self.table(table).await?;
        let prop = |k: &str, d: i64| {
            t.metadata()
                .properties()
                .get(k)
                .and_then(|v| v.parse::<i64>().ok())
                .unwrap_or(d)
        };
        Ok(Retention {
            keep_last: prop(
                "history.expire.min-snapshots-to-keep",
                crate::layout::DEFAULT_MIN_SNAPSHOTS_TO_KEEP as i64,
            )
            .max(1) as usize,
            max_age_ms: prop(
                "history.expire.max-snapshot-age-ms",
                crate::layout::DEFAULT_MAX_SNAPSHOT_AGE_MS,
            ),
        })
    }

    /// Makes `new_md` the current metadata of `table` if `base` is still current: writes
    /// the next metadata file, then compare-and-sets the catalog row. `Conflict` when
    /// another writer committed first (the written file is removed again).
    ///
    /// An expiry passes the snapshots it removes as `expiring`. The holds are then read
    /// again in the transaction that moves the pointer, with new holds shut out until it
    /// ends (PostgreSQL: a `SHARE` lock on `sw_snapshot_holds`; SQLite: the write lock the
    /// update takes), and a hold taken meanwhile on a snapshot the commit would remove
    /// (or on one before it: a hold keeps every later snapshot) is a `Conflict`. A holder
    /// that checks its snapshot after its hold is written is then never left holding one
    /// that is gone: either the expiry saw the hold, or the hold was written after the
    /// expiry's commit, and the holder's check sees the snapshot gone.
    pub(crate) async fn commit_metadata(
        &self,
        base: &Table,
        new_md: TableMetadata,
        expiring: Option<&HashSet<i64>>,
    ) -> Result<()> {
        let base_loc = base.metadata_location().ok_or_else(|| {
            LakeError::new(ErrorKind::Internal, "the table has no metadata location")
        })?;
        let new_loc = MetadataLocation::from_str(base_loc)
            .map_err(ice("parse the metadata location"))?
            .with_next_version()
            .with_new_metadata(&new_md)
            .to_string();
        match self
            .swap_metadata(base, &new_md, &new_loc, expiring, None)
            .await?
        {
            None => Ok(()),
            Some(why) => Err(LakeError::new(
                ErrorKind::Conflict,
                format!("{why} while maintenance prepared its commit"),
            )),
        }
    }

    /// Writes `new_md` at `new_loc` and moves `base`'s catalog pointer to it by
    /// compare-and-set, in one transaction of the catalog database that also checks
    /// `expiring` against the holds (see [`Lake::commit_metadata`]) and, first, `fence`
    /// (see [`Lake::fence`]). `Some(why)` when the commit lost to another writer or to a
    /// hold: a conflict to retry. An error (a fence that no longer holds is `Conflict`)
    /// ends the commit. Either way, nothing committed leaves no metadata file behind.
    pub(crate) async fn swap_metadata(
        &self,
        base: &Table,
        new_md: &TableMetadata,
        new_loc: &str,
        expiring: Option<&HashSet<i64>>,
        fence: Option<&LeaseFence>,
    ) -> Result<Option<String>> {
        let base_loc = base.metadata_location().ok_or_else(|| {
            LakeError::new(ErrorKind::Internal, "the table has no metadata location")
        })?;
        let ident = base.identifier();
        let new_loc_s = new_loc.to_string();
        let parsed =
            MetadataLocation::from_str(new_loc).map_err(ice("parse the metadata location"))?;
        new_md
            .write_to(base.file_io(), &parsed)
            .await
            .map_err(ice("write table metadata"))?;
        let sql = if self.config().is_sqlite() {
            "UPDATE iceberg_tables SET metadata_location = ?, previous_metadata_location = ? \
             WHERE catalog_name = ? AND table_name = ? AND table_namespace = ? \
             AND (iceberg_type = 'TABLE' OR iceberg_type IS NULL) AND metadata_location = ?"
        } else {
            "UPDATE iceberg_tables SET metadata_location = $1, previous_metadata_location = $2 \
             WHERE catalog_name = $3 AND table_name = $4 AND table_namespace = $5 \
             AND (iceberg_type = 'TABLE' OR iceberg_type IS NULL) AND metadata_location = $6"
        };
        let sql_error = |what: &'static str| move |e| LakeError::sql(what, e);
        let mut tx = match self.control_pool().begin().await {
            Ok(tx) => tx,
            Err(e) => {
                let _ = base.file_io().delete(&new_loc_s).await;
                return Err(LakeError::sql("begin the metadata commit", e));
            }
        };
        let checked = async {
            if let Some(fence) = fence {
                self.fence(&mut tx, fence).await?;
            }
            if expiring.is_some() && !self.config().is_sqlite() {
                sqlx::query("LOCK TABLE sw_snapshot_holds IN SHARE MODE")
                    .execute(&mut *tx)
                    .await
                    .map_err(sql_error("shut out new snapshot holds"))?;
            }
            let swapped = sqlx::query(sql)
                .bind(new_loc_s.as_str())
                .bind(base_loc)
                .bind(self.config().catalog_name.as_str())
                .bind(ident.name())
                .bind(ident.namespace().join("."))
                .bind(base_loc)
                .execute(&mut *tx)
                .await
                .map_err(sql_error("swap the table's metadata pointer"))?
                .rows_affected();
            if swapped == 0 {
                return Ok(Some(format!("{} changed", ident.name())));
            }
            let Some(removed) = expiring else {
                return Ok(None);
            };
            let held: HashSet<i64> = sqlx::query_as::<_, (i64,)>(self.holds_sql())
                .bind(self.config().catalog_name.as_str())
                .bind(ident.name())
                .fetch_all(&mut *tx)
                .await
                .map_err(sql_error("read snapshot holds"))?
                .into_iter()
                .map(|(id,)| id)
                .collect();
            Ok(held_among(base.metadata(), &held, removed)
                .map(|id| format!("{}: snapshot {id} was held", ident.name())))
        }
        .await;
        // Refused or failed before its commit, the transaction is rolled back and the
        // metadata file is garbage. (A failed commit may still have taken: its file stays.)
        if !matches!(checked, Ok(None)) {
            let _ = tx.rollback().await;
            let _ = base.file_io().delete(&new_loc_s).await;
            return checked;
        }
        tx.commit()
            .await
            .map_err(sql_error("commit the metadata pointer"))?;
        Ok(None)
    }

    /// One maintenance pass over `table`: merge manifests, expire snapshots and delete
    /// what they alone referenced, delete stale metadata files, sweep orphans.
    pub async fn maintain(
        &self,
        table: LakeTable,
        policy: &MaintenancePolicy,
    ) -> Result<MaintenanceReport> {
        let mut report = MaintenanceReport::default();
        self.merge_manifests(table, policy, &mut report).await?;
        if policy.expire {
            self.expire_and_clean(
                table,
                chrono::Utc::now().timestamp_millis(),
                policy.retention,
                policy.override_holds,
                policy.keep_from,
                &mut report,
            )
            .await?;
        }
        let (stale, orphans) = self
            .clean_metadata_dir(table, policy.metadata_orphan_age)
            .await?;
        report.deleted.metadata_files += stale;
        report.deleted.orphans += orphans;
        if let Some(age) = policy.orphan_safety_age {
            report.deleted.orphans += self.sweep_orphans(table, age).await?;
        }
        Ok(report)
    }

    async fn merge_manifests(
        &self,
        table: LakeTable,
        policy: &MaintenancePolicy,
        report: &mut MaintenanceReport,
    ) -> Result<()> {
        // Merged manifests survive a lost race: appends only add manifests, so while every
        // merged one is still in the new base, only the manifest list and the metadata
        // are redone (a few milliseconds), not the merge.
        let mut prepared: Option<PreparedMerge> = None;
        for attempt in 0..CONFLICT_ATTEMPTS {
            let base = self.table(table).await?;
            let md = base.metadata();
            let Some(current) = md.current_snapshot() else {
                return Ok(());
            };
            if md.format_version() != FormatVersion::V2 {
                return Err(LakeError::new(
                    ErrorKind::Config,
                    format!(
                        "{}: manifest merging supports format version 2 tables",
                        table.name()
                    ),
                ));
            }
            let manifests = current_manifests(&base, current).await?;
            if attempt == 0 {
                report.manifests_before = manifests.len();
                report.manifests_after = manifests.len();
            }
            let present: HashSet<&str> =
                manifests.iter().map(|m| m.manifest_path.as_str()).collect();
            let reusable = prepared.as_ref().is_some_and(|p| {
                md.snapshot_by_id(p.snapshot_id).is_none()
                    && p.replaced.iter().all(|r| present.contains(r.as_str()))
            });
            if !reusable {
                if let Some(p) = prepared.take() {
                    delete_all(base.file_io(), p.written).await;
                }
                let Some(small) = merge_candidates(&manifests, policy) else {
                    return Ok(());
                };
                prepared = Some(self.write_merged(&base, current, small, policy).await?);
            }
            let Some(p) = prepared.as_ref() else {
                return Ok(());
            };
            let kept: Vec<ManifestFile> = manifests
                .into_iter()
                .filter(|m| !p.replaced.contains(&m.manifest_path))
                .collect();
            let sequence = md.next_sequence_number();
            let io = base.file_io();
            let list_path = format!(
                "{}/metadata/snap-{}-{attempt}-{}.avro",
                md.location(),
                p.snapshot_id,
                p.commit_uuid
            );
            let mut list = ManifestListWriter::v2(
                io.new_output(&list_path)
                    .map_err(ice("open manifest list"))?
                    .writer()
                    .await
                    .map_err(ice("open manifest list"))?,
                p.snapshot_id,
                Some(current.snapshot_id()),
                sequence,
            );
            let after = p.created.len() + kept.len();
            list.add_manifests(p.created.iter().cloned().chain(kept.iter().cloned()))
                .map_err(ice("write manifest list"))?;
            list.close().await.map_err(ice("close manifest list"))?;
            let mut props: HashMap<String, String> = current
                .summary()
                .additional_properties
                .iter()
                .filter(|(k, _)| k.starts_with("total-"))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            props.insert("manifests-created".into(), p.created.len().to_string());
            props.insert("manifests-replaced".into(), p.replaced.len().to_string());
            props.insert("manifests-kept".into(), kept.len().to_string());
            props.insert("entries-processed".into(), p.entries.to_string());
            let snapshot = Snapshot::builder()
                .with_snapshot_id(p.snapshot_id)
                .with_parent_snapshot_id(Some(current.snapshot_id()))
                .with_sequence_number(sequence)
                .with_timestamp_ms(chrono::Utc::now().timestamp_millis())
                .with_manifest_list(list_path.clone())
                .with_summary(Summary {
                    operation: Operation::Replace,
                    additional_properties: props,
                })
                .with_schema_id(md.current_schema_id())
                .build();
            let base_loc = base.metadata_location().map(str::to_string);
            let new_md = md
                .clone()
                .into_builder(base_loc)
                .set_branch_snapshot(snapshot, iceberg::spec::MAIN_BRANCH)
                .map_err(ice("add the merge snapshot"))?
                .build()
                .map_err(ice("build table metadata"))?
                .metadata;
            match self.commit_metadata(&base, new_md, None).await {
                Ok(()) => {
                    report.merge_snapshot = Some(p.snapshot_id);
                    report.manifests_after = after;
                    return Ok(());
                }
                Err(e) if e.kind() == ErrorKind::Conflict => {
                    report.conflicts += 1;
                    let _ = io.delete(&list_path).await;
                }
                Err(e) => return Err(e),
            }
        }
        if let Some(p) = prepared.take() {
            let base = self.table(table).await?;
            delete_all(base.file_io(), p.written).await;
        }
        Err(LakeError::new(
            ErrorKind::Conflict,
            format!(
                "{}: manifest merge lost {CONFLICT_ATTEMPTS} races in a row",
                table.name()
            ),
        ))
    }

    /// Rewrites the live entries of `small` as EXISTING into manifests of about the target
    /// size, for a snapshot id chosen here.
    async fn write_merged(
        &self,
        base: &Table,
        current: &Snapshot,
        small: Vec<ManifestFile>,
        policy: &MaintenancePolicy,
    ) -> Result<PreparedMerge> {
        let md = base.metadata();
        let io = base.file_io();
        let location = md.location();
        let snapshot_id = fresh_snapshot_id(md);
        let commit_uuid = uuid::Uuid::new_v4().simple().to_string();
        let replaced: HashSet<String> = small.iter().map(|m| m.manifest_path.clone()).collect();
        let mut by_spec: HashMap<i32, Vec<ManifestFile>> = HashMap::new();
        for m in small {
            by_spec.entry(m.partition_spec_id).or_default().push(m);
        }
        let mut created: Vec<ManifestFile> = Vec::new();
        let mut written: Vec<String> = Vec::new();
        let mut entries = 0u64;
        let mut n = 0usize;
        for (spec_id, group) in by_spec {
            let spec = md
                .partition_spec_by_id(spec_id)
                .ok_or_else(|| {
                    LakeError::new(
                        ErrorKind::Internal,
                        format!("partition spec {spec_id} is missing"),
                    )
                })?
                .as_ref()
                .clone();
            let loaded: Vec<_> = stream::iter(group)
                .map(|m| {
                    let io = io.clone();
                    async move {
                        let bytes = m.manifest_length.max(0) as u64;
                        m.load_manifest(&io).await.map(|l| (bytes, l))
                    }
                })
                .buffered(8)
                .try_collect()
                .await
                .map_err(ice("read manifest"))?;
            let mut writer: Option<iceberg::spec::ManifestWriter> = None;
            let mut bytes_in_writer = 0u64;
            for (bytes, manifest) in loaded {
                let per_entry = bytes / (manifest.entries().len().max(1) as u64);
                for entry in manifest.entries().iter().filter(|e| e.is_alive()) {
                    if writer.is_none() || bytes_in_writer >= policy.manifest_target_bytes {
                        if let Some(w) = writer.take() {
                            created.push(
                                w.write_manifest_file()
                                    .await
                                    .map_err(ice("write merged manifest"))?,
                            );
                        }
                        let path = format!("{location}/metadata/{commit_uuid}-m{n}.avro");
                        n += 1;
                        written.push(path.clone());
                        writer = Some(
                            ManifestWriterBuilder::new(
                                io.new_output(&path).map_err(ice("open manifest"))?,
                                Some(snapshot_id),
                                md.current_schema().clone(),
                                spec.clone(),
                            )
                            .build_v2_data(),
                        );
                        bytes_in_writer = 0;
                    }
                    let seq = entry.sequence_number().unwrap_or(0);
                    if let Some(w) = writer.as_mut() {
                        w.add_existing_file(
                            entry.data_file().clone(),
                            entry.snapshot_id().unwrap_or(current.snapshot_id()),
                            seq,
                            Some(entry.file_sequence_number.unwrap_or(seq)),
                        )
                        .map_err(ice("add entry to merged manifest"))?;
                    }
                    bytes_in_writer += per_entry;
                    entries += 1;
                }
            }
            if let Some(w) = writer.take() {
                created.push(
                    w.write_manifest_file()
                        .await
                        .map_err(ice("write merged manifest"))?,
                );
            }
        }
        Ok(PreparedMerge {
            snapshot_id,
            commit_uuid,
            created,
            replaced,
            written,
            entries,
        })
    }

    /// Snapshots held in `sw_snapshot_holds` for `table`.
    pub async fn held_snapshots(&self, table: LakeTable) -> Result<HashSet<i64>> {
        let rows: Vec<(i64,)> = sqlx::query_as(self.holds_sql())
            .bind(self.config().catalog_name.as_str())
            .bind(table.name())
            .fetch_all(self.control_pool())
            .await
            .map_err(|e| LakeError::sql("read snapshot holds", e))?;
        Ok(rows.into_iter().map(|(id,)| id).collect())
    }

    /// Drops the transient holds (see [`TRANSIENT_HOLD_MARKER`]) last moved more than
    /// [`TRANSIENT_HOLD_TTL_MS`] before `now_ms`: leftovers of planning steps whose process
    /// died. Returns how many.
    pub async fn drop_stale_transient_holds(&self, now_ms: i64) -> Result<u64> {
        let dropped = sqlx::query(&self.control_sql(
            "DELETE FROM sw_snapshot_holds WHERE catalog_name = $1 AND holder LIKE $2 \
             AND updated_ms < $3",
        ))
        .bind(self.config().catalog_name.as_str())
        .bind(format!("%{TRANSIENT_HOLD_MARKER}%"))
        .bind(now_ms - TRANSIENT_HOLD_TTL_MS)
        .execute(self.control_pool())
        .await
        .map_err(|e| LakeError::sql("drop stale transient holds", e))?
        .rows_affected();
        if dropped > 0 {
            tracing::warn!(
                dropped,
                "dropped snapshot holds left by planning steps that never finished"
            );
        }
        Ok(dropped)
    }

    fn holds_sql(&self) -> &'static str {
        if self.config().is_sqlite() {
            "SELECT snapshot_id FROM sw_snapshot_holds WHERE catalog_name = ? AND table_name = ?"
        } else {
            "SELECT snapshot_id FROM sw_snapshot_holds WHERE catalog_name = $1 AND table_name = $2"
        }
    }

    /// [`Self::hold_snapshot`], then checks the snapshot is still in the table: a
    /// `Conflict` when an expiry removed it first. A holder's first hold needs the check
    /// (moving a hold forward does not: the earlier hold kept the later snapshot). An
    /// expiry reads the holds again as it commits, so once this returns `Ok` the snapshot
    /// stays until released (or an erasure expires it: erasures override holds).
    pub async fn hold_present_snapshot(
        &self,
        table: LakeTable,
        holder: &str,
        snapshot_id: i64,
    ) -> Result<()> {
        self.hold_snapshot(table, holder, snapshot_id).await?;
        if self
            .table(table)
            .await?
            .metadata()
            .snapshot_by_id(snapshot_id)
            .is_none()
        {
            return Err(LakeError::new(
                ErrorKind::Conflict,
                format!(
                    "{}: snapshot {snapshot_id} was expired before {holder} held it; try again",
                    table.name()
                ),
            ));
        }
        Ok(())
    }

    /// Holds `snapshot_id` of `table` for `holder` (a checkpoint or backfill), replacing
    /// the holder's previous position: expiry keeps it until released.
    pub async fn hold_snapshot(
        &self,
        table: LakeTable,
        holder: &str,
        snapshot_id: i64,
    ) -> Result<()> {
        let now = chrono::Utc::now().timestamp_millis();
        let sql = if self.config().is_sqlite() {
            "INSERT INTO sw_snapshot_holds (catalog_name, table_name, holder, snapshot_id, updated_ms) \
             VALUES (?, ?, ?, ?, ?) ON CONFLICT (catalog_name, table_name, holder) \
             DO UPDATE SET snapshot_id = excluded.snapshot_id, updated_ms = excluded.updated_ms"
        } else {
            "INSERT INTO sw_snapshot_holds (catalog_name, table_name, holder, snapshot_id, updated_ms) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (catalog_name, table_name, holder) \
             DO UPDATE SET snapshot_id = excluded.snapshot_id, updated_ms = excluded.updated_ms"
        };
        sqlx::query(sql)
            .bind(self.config().catalog_name.as_str())
            .bind(table.name())
            .bind(holder)
            .bind(snapshot_id)
            .bind(now)
            .execute(self.control_pool())
            .await
            .map_err(|e| LakeError::sql("hold a snapshot", e))?;
        Ok(())
    }

    /// Releases `holder`'s hold on `table`.
    pub async fn release_snapshot(&self, table: LakeTable, holder: &str) -> Result<()> {
        self.release_holder(holder, Some(table.name())).await?;
        Ok(())
    }

    /// After a pass over `table` under `policy` that kept at least
    /// `policy.warn_held_snapshots` snapshots only because of holds, a warning naming the holders (with how long ago each moved) and how to
    /// release a retired one; `None` otherwise. The maintenance loops log it: a hold
    /// never expires by itself, and one a retired job, backfill or notifier left keeps
    /// every later snapshot, so the metadata grows again.
    pub async fn held_history_warning(
        &self,
        table: LakeTable,
        report: &MaintenanceReport,
        policy: &MaintenancePolicy,
    ) -> Result<Option<String>> {
        if report.snapshots_held < policy.warn_held_snapshots {
            return Ok(None);
        }
        let now = chrono::Utc::now().timestamp_millis();
        let holders: Vec<String> = self
            .snapshot_holds()
            .await?
            .into_iter()
            .filter(|h| h.table == table.name())
            .map(|h| {
                format!(
                    "{} (moved {} s ago)",
                    h.holder,
                    (now - h.updated_ms).max(0) / 1000
                )
            })
            .collect();
        Ok(Some(format!(
            "{}: {} snapshots are kept only by holds: {}; if a holder is retired, release it \
             with `signalweave lake holds --release HOLDER`",
            table.name(),
            report.snapshots_held,
            holders.join(", ")
        )))
    }

    /// Every hold of the catalog, by table and holder: the positions expiry keeps (with
    /// every later snapshot of their table).
    pub async fn snapshot_holds(&self) -> Result<Vec<SnapshotHold>> {
        let sql = if self.config().is_sqlite() {
            "SELECT table_name, holder, snapshot_id, updated_ms FROM sw_snapshot_holds \
             WHERE catalog_name = ? ORDER BY table_name, holder"
        } else {
            "SELECT table_name, holder, snapshot_id, updated_ms FROM sw_snapshot_holds \
             WHERE catalog_name = $1 ORDER BY table_name, holder"
        };
        let rows: Vec<(String, String, i64, i64)> = sqlx::query_as(sql)
            .bind(self.config().catalog_name.as_str())
            .fetch_all(self.control_pool())
            .await
            .map_err(|e| LakeError::sql("read snapshot holds", e))?;
        Ok(rows
            .into_iter()
            .map(|(table, holder, snapshot_id, updated_ms)| SnapshotHold {
                table,
                holder,
                snapshot_id,
                updated_ms,
            })
            .collect())
    }

    /// Releases `holder`'s holds (on `table` only, or on every table): for a job,
    /// backfill or notifier retired for good, whose position would otherwise keep every
    /// later snapshot. Returns how many holds were released.
    pub async fn release_holder(&self, holder: &str, table: Option<&str>) -> Result<u64> {
        let sqlite = self.config().is_sqlite();
        let sql = match (sqlite, table.is_some()) {
            (true, false) => "DELETE FROM sw_snapshot_holds WHERE catalog_name = ? AND holder = ?",
            (true, true) => {
                "DELETE FROM sw_snapshot_holds WHERE catalog_name = ? AND holder = ? \
                 AND table_name = ?"
            }
            (false, false) => {
                "DELETE FROM sw_snapshot_holds WHERE catalog_name = $1 AND holder = $2"
            }
            (false, true) => {
                "DELETE FROM sw_snapshot_holds WHERE catalog_name = $1 AND holder = $2 \
                 AND table_name = $3"
            }
        };
        let mut q = sqlx::query(sql)
            .bind(self.config().catalog_name.as_str())
            .bind(holder);
        if let Some(t) = table {
            q = q.bind(t);
        }
        let done = q
            .execute(self.control_pool())
            .await
            .map_err(|e| LakeError::sql("release snapshot holds", e))?;
        Ok(done.rows_affected())
    }

    /// The manifest lists of `snapshot_ids` and the manifests they list (lists read
    /// through the cache).
    async fn manifest_lists_of(
        &self,
        base: &Table,
        snapshot_ids: &HashSet<i64>,
    ) -> Result<(HashSet<String>, HashMap<String, ManifestFile>)> {
        let md = base.metadata();
        let mut lists = HashSet::new();
        let mut manifests: HashMap<String, ManifestFile> = HashMap::new();
        for s in md
            .snapshots()
            .filter(|s| snapshot_ids.contains(&s.snapshot_id()))
        {
            let path = s.manifest_list().to_string();
            lists.insert(path.clone());
            let cached = lock(&self.manifest_cache).lists.get(&path).cloned();
            let list = match cached {
                Some(l) => l,
                None => {
                    let l: Arc<Vec<ManifestFile>> = Arc::new(
                        base.manifest_list_reader(s)
                            .load()
                            .await
                            .map_err(ice("read manifest list"))?
                            .consume_entries()
                            .into_iter()
                            .collect(),
                    );
                    lock(&self.manifest_cache).put_list(path, Arc::clone(&l));
                    l
                }
            };
            for m in list.iter() {
                manifests
                    .entry(m.manifest_path.clone())
                    .or_insert_with(|| m.clone());
            }
        }
        Ok((lists, manifests))
    }

    async fn reachable(&self, base: &Table, snapshot_ids: &HashSet<i64>) -> Result<Reachable> {
        let io = base.file_io();
        let (manifest_lists, manifests) = self.manifest_lists_of(base, snapshot_ids).await?;
        let mut out = Reachable {
            manifest_lists,
            ..Default::default()
        };
        let mut missing = Vec::new();
        {
            let cache = lock(&self.manifest_cache);
            for (path, m) in manifests {
                match cache.files.get(&path) {
                    Some(files) => {
                        out.data_files.extend(files.iter().cloned());
                        out.manifests.insert(path);
                    }
                    None => missing.push(m),
                }
            }
        }
        let loaded: Vec<_> = stream::iter(missing)
            .map(|m| {
                let io = io.clone();
                async move { m.load_manifest(&io).await.map(|l| (m.manifest_path, l)) }
            })
            .buffered(8)
            .try_collect()
            .await
            .map_err(ice("read manifest"))?;
        for (path, manifest) in loaded {
            let files: Arc<Vec<String>> = Arc::new(
                manifest
                    .entries()
                    .iter()
                    .filter(|e| live_data(e))
                    .map(|e| e.file_path().to_string())
                    .collect(),
            );
            out.data_files.extend(files.iter().cloned());
            out.manifests.insert(path.clone());
            lock(&self.manifest_cache).put_manifest(path, files);
        }
        Ok(out)
    }

    async fn expire_and_clean(
        &self,
        table: LakeTable,
        now_ms: i64,
        retention: Option<Retention>,
        override_holds: bool,
        keep_from: Option<i64>,
        report: &mut MaintenanceReport,
    ) -> Result<()> {
        if !override_holds {
            self.drop_stale_transient_holds(now_ms).await?;
        }
        let mut pause = crate::lake::RetryPause::default();
        let mut failed = None;
        for _ in 0..CONFLICT_ATTEMPTS {
            let base = self.table(table).await?;
            let md = base.metadata();
            let Some(current) = md.current_snapshot_id() else {
                return Ok(());
            };
            let prop = |k: &str, d: i64| {
                md.properties()
                    .get(k)
                    .and_then(|v| v.parse::<i64>().ok())
                    .unwrap_or(d)
            };
            let max_age = prop(
                "history.expire.max-snapshot-age-ms",
                crate::layout::DEFAULT_MAX_SNAPSHOT_AGE_MS,
            );
            let min_keep = prop(
                "history.expire.min-snapshots-to-keep",
                crate::layout::DEFAULT_MIN_SNAPSHOTS_TO_KEEP as i64,
            )
            .max(1) as usize;
            let (min_keep, max_age) = match retention {
                Some(r) => (r.keep_last.max(1), r.max_age_ms),
                None => (min_keep, max_age),
            };
            let held = if override_holds {
                HashSet::new()
            } else {
                self.held_snapshots(table).await?
            };
            let mut all: Vec<&Arc<Snapshot>> = md.snapshots().collect();
            all.sort_by_key(|s| std::cmp::Reverse((s.sequence_number(), s.timestamp_ms())));
            // A held position keeps itself and every later snapshot: a tail reading
            // from it walks the chain of snapshots appended since.
            let oldest_held = oldest_held(md, &held);
            let keep_from = keep_from
                .and_then(|id| md.snapshot_by_id(id))
                .map(|s| s.sequence_number());
            let mut remove = Vec::new();
            let mut kept_by_hold = 0;
            for (i, s) in all.iter().enumerate() {
                let id = s.snapshot_id();
                if id == current
                    || i < min_keep
                    || s.timestamp_ms() >= now_ms - max_age
                    || keep_from.is_some_and(|seq| s.sequence_number() >= seq)
                {
                    continue;
                }
                if oldest_held.is_some_and(|seq| s.sequence_number() >= seq) {
                    kept_by_hold += 1;
                    continue;
                }
                remove.push(id);
            }
            report.snapshots_held = kept_by_hold;
            if remove.is_empty() {
                return Ok(());
            }
            let all_ids: HashSet<i64> = md.snapshots().map(|s| s.snapshot_id()).collect();
            let removed: HashSet<i64> = remove.iter().copied().collect();
            let retained: HashSet<i64> = all_ids.difference(&removed).copied().collect();
            let base_loc = base.metadata_location().map(str::to_string);
            let new_md = md
                .clone()
                .into_builder(base_loc)
                .remove_snapshots(&remove)
                .build()
                .map_err(ice("build table metadata"))?
                .metadata;
            // Idempotency outlives the removed snapshots.
            self.record_commit_identities(
                table,
                md.snapshots()
                    .filter(|s| removed.contains(&s.snapshot_id()))
                    .map(|s| s.as_ref()),
            )
            .await?;
            let expiring = (!override_holds).then_some(&removed);
            match self.commit_metadata(&base, new_md, expiring).await {
                Ok(()) => {
                    report.snapshots_expired += remove.len();
                    // What only the removed snapshots referenced is garbage now.
                    let before = self.reachable(&base, &removed).await?;
                    let after = self.reachable(&base, &retained).await?;
                    let io = base.file_io();
                    let gone = |a: &HashSet<String>, b: &HashSet<String>| -> Vec<String> {
                        a.difference(b).cloned().collect()
                    };
                    let lists = gone(&before.manifest_lists, &after.manifest_lists);
                    let manifests = gone(&before.manifests, &after.manifests);
                    let data = gone(&before.data_files, &after.data_files);
                    {
                        let mut cache = lock(&self.manifest_cache);
                        cache.forget(&lists);
                        cache.forget(&manifests);
                    }
                    report.deleted.manifest_lists += delete_all(io, lists).await;
                    report.deleted.manifests += delete_all(io, manifests).await;
                    self.forget_file_commits(&data).await;
                    report.deleted.data_files += delete_all(io, data).await;
                    return Ok(());
                }
                Err(e) if e.kind() == ErrorKind::Conflict => report.conflicts += 1,
                // The catalog database busy or briefly away (a lock held by another
                // writer): tried again after a pause, from a fresh read of the table (a
                // commit the failure hid is then seen as done: nothing left to remove).
                Err(e) if e.retryable() => {
                    tracing::warn!(table = table.name(), error = %e, "expiry's commit failed; retrying");
                    pause.wait(&e).await;
                    failed = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        Err(failed.unwrap_or_else(|| {
            LakeError::new(
                ErrorKind::Conflict,
                format!(
                    "{}: expiry lost {CONFLICT_ATTEMPTS} races in a row",
                    table.name()
                ),
            )
        }))
    }

    /// Deletes metadata files older than the oldest one the current metadata log keeps
    /// (versions are monotonic, so a commit in flight only writes newer ones), and, with
    /// `orphan_age`, the manifest lists and manifests no retained snapshot references that
    /// are older than it. Returns both counts.
    async fn clean_metadata_dir(
        &self,
        table: LakeTable,
        orphan_age: Option<Duration>,
    ) -> Result<(usize, usize)> {
        let base = self.table(table).await?;
        let md = base.metadata();
        let version_of = |path: &str| -> Option<u64> {
            let name = path.rsplit('/').next()?;
            name.split('-').next()?.parse().ok()
        };
        let mut keep: Vec<u64> = md
            .metadata_log()
            .iter()
            .filter_map(|l| version_of(&l.metadata_file))
            .collect();
        if let Some(v) = base.metadata_location().and_then(version_of) {
            keep.push(v);
        }
        let Some(oldest) = keep.into_iter().min() else {
            return Ok((0, 0));
        };
        let files = self
            .list_files(&format!("{}/metadata", md.location()))
            .await?;
        let is_metadata =
            |p: &str| p.ends_with(".metadata.json") || p.ends_with(".metadata.json.gz");
        let stale: Vec<String> = files
            .iter()
            .filter(|(p, _)| is_metadata(p))
            .filter(|(p, _)| version_of(p).is_some_and(|v| v < oldest))
            .map(|(p, _)| p.clone())
            .collect();
        let stale = delete_all(base.file_io(), stale).await;
        let Some(age) = orphan_age else {
            return Ok((stale, 0));
        };
        let cutoff = chrono::Utc::now()
            - chrono::Duration::from_std(age).unwrap_or(chrono::Duration::hours(1));
        let old: Vec<&String> = files
            .iter()
            .filter(|(p, modified)| *modified < cutoff && p.ends_with(".avro"))
            .map(|(p, _)| p)
            .collect();
        if old.is_empty() {
            return Ok((stale, 0));
        }
        let ids: HashSet<i64> = md.snapshots().map(|s| s.snapshot_id()).collect();
        let (lists, manifests) = self.manifest_lists_of(&base, &ids).await?;
        let orphans: Vec<String> = old
            .into_iter()
            .filter(|p| !lists.contains(*p) && !manifests.contains_key(*p))
            .cloned()
            .collect();
        {
            let mut cache = lock(&self.manifest_cache);
            cache.forget(&orphans);
        }
        Ok((stale, delete_all(base.file_io(), orphans).await))
    }

    /// Deletes files under the table's location that no retained snapshot or metadata
    /// file references and that are older than `safety_age`.
    pub async fn sweep_orphans(&self, table: LakeTable, safety_age: Duration) -> Result<usize> {
        let base = self.table(table).await?;
        let md = base.metadata();
        let ids: HashSet<i64> = md.snapshots().map(|s| s.snapshot_id()).collect();
        let reach = self.reachable(&base, &ids).await?;
        let mut metadata_files: HashSet<String> = md
            .metadata_log()
            .iter()
            .map(|l| l.metadata_file.clone())
            .collect();
        if let Some(l) = base.metadata_location() {
            metadata_files.insert(l.to_string());
        }
        let cutoff = chrono::Utc::now()
            - chrono::Duration::from_std(safety_age).unwrap_or(chrono::Duration::hours(1));
        let files = self.list_files(md.location()).await?;
        let orphans: Vec<String> = files
            .into_iter()
            .filter(|(_, modified)| *modified < cutoff)
            .map(|(p, _)| p)
            .filter(|p| {
                !reach.data_files.contains(p)
                    && !reach.manifests.contains(p)
                    && !reach.manifest_lists.contains(p)
                    && !metadata_files.contains(p)
            })
            // A metadata file newer than the log's oldest is left to the version rule.
            .filter(|p| !p.ends_with(".metadata.json"))
            .collect();
        Ok(delete_all(base.file_io(), orphans).await)
    }

    /// Files under `location` (a table path as Iceberg writes it), with their modification times.
    async fn list_files(
        &self,
        location: &str,
    ) -> Result<Vec<(String, chrono::DateTime<chrono::Utc>)>> {
        let unavailable = |e: object_store::Error| {
            LakeError::new(ErrorKind::Unavailable, format!("list files: {e}"))
        };
        match &self.config().warehouse {
            Warehouse::Local { .. } => {
                let root = location.trim_start_matches("file://");
                let store = object_store::local::LocalFileSystem::new();
                let prefix = object_store::path::Path::from_filesystem_path(root).map_err(|e| {
                    LakeError::new(ErrorKind::Internal, format!("path {root}: {e}"))
                })?;
                let metas: Vec<_> = store
                    .list(Some(&prefix))
                    .try_collect()
                    .await
                    .map_err(unavailable)?;
                Ok(metas
                    .into_iter()
                    .map(|m| {
                        let p = format!("/{}", m.location);
                        let p = if location.starts_with("file://") {
                            format!("file://{p}")
                        } else {
                            p
                        };
                        (p, m.last_modified)
                    })
                    .collect())
            }
            Warehouse::S3(_) => {
                let (bucket, key) = location
                    .trim_start_matches("s3://")
                    .trim_start_matches("s3a://")
                    .split_once('/')
                    .unwrap_or((location, ""));
                let store = self.s3_store()?;
                let prefix = object_store::path::Path::from(key);
                let metas: Vec<_> = store
                    .list(Some(&prefix))
                    .try_collect()
                    .await
                    .map_err(unavailable)?;
                Ok(metas
                    .into_iter()
                    .map(|m| (format!("s3://{bucket}/{}", m.location), m.last_modified))
                    .collect())
            }
        }
    }
}

/// Which manifests to merge, in two tiers so that no pass rewrites everything: fresh
/// manifests (one per append, under 64 KiB) once there are `min_manifests_to_merge` of
/// them, and merged ones still under the target size once there are 10 of them. Manifests
/// at the target size stay as they are. The current snapshot thus holds fewer than
/// `min_manifests_to_merge` + 10 manifests, plus one per target size of manifest data.
fn merge_candidates(
    manifests: &[ManifestFile],
    policy: &MaintenancePolicy,
) -> Option<Vec<ManifestFile>> {
    let len = |m: &ManifestFile| m.manifest_length.max(0) as u64;
    let data = || {
        manifests
            .iter()
            .filter(|m| m.content == ManifestContentType::Data)
    };
    let fresh: Vec<ManifestFile> = data()
        .filter(|m| len(m) < FRESH_MANIFEST_BYTES)
        .cloned()
        .collect();
    let mid: Vec<ManifestFile> = data()
        .filter(|m| len(m) >= FRESH_MANIFEST_BYTES && len(m) < policy.manifest_target_bytes)
        .cloned()
        .collect();
    let fresh_due = fresh.len() >= policy.min_manifests_to_merge.max(2);
    let mid_due = mid.len() >= MID_MANIFESTS_TO_MERGE;
    let mut out = Vec::new();
    if fresh_due {
        out.extend(fresh);
    }
    if mid_due {
        out.extend(mid);
    }
    (out.len() >= 2).then_some(out)
}

/// A manifest under this size is fresh (written by one append).
const FRESH_MANIFEST_BYTES: u64 = 64 * 1024;
/// Merged manifests under the target size are merged again once there are this many.
const MID_MANIFESTS_TO_MERGE: usize = 10;

async fn delete_all(io: &iceberg::io::FileIO, paths: Vec<String>) -> usize {
    stream::iter(paths)
        .map(|p| {
            let io = io.clone();
            async move { io.delete(&p).await.is_ok() }
        })
        .buffer_unordered(16)
        .filter(|ok| futures::future::ready(*ok))
        .count()
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LakeConfig;
    use crate::lake::CommitIdentity;
    use crate::lake::tests::events;

    /// A fresh embedded lake at `dir` whose events table has four commits of ten events.
    async fn four_commits(dir: &std::path::Path) -> Lake {
        let lake = Lake::open(LakeConfig::embedded(dir)).await.expect("open");
        lake.init().await.expect("init");
        let data = events(40);
        for i in 0..4 {
            lake.append(
                LakeTable::Events,
                &[data.slice(i * 10, 10)],
                &CommitIdentity::new("four", i as u64),
            )
            .await
            .expect("append");
        }
        lake
    }

    /// A transient hold (a planning step's) a crash left behind is dropped once older
    /// than its time to live; a fresh one, and an old hold of another kind, stay.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_transient_hold_left_behind_is_dropped_in_time() {
        let dir = tempfile::tempdir().expect("tempdir");
        let lake = four_commits(dir.path()).await;
        let s = lake
            .table(LakeTable::Events)
            .await
            .expect("table")
            .metadata()
            .current_snapshot_id()
            .expect("a snapshot");
        let left = format!("backfill:j:n{TRANSIENT_HOLD_MARKER}0123");
        let fresh = format!("backfill:j:m{TRANSIENT_HOLD_MARKER}4567");
        for holder in [left.as_str(), fresh.as_str(), "job:j:live"] {
            lake.hold_snapshot(LakeTable::Events, holder, s)
                .await
                .expect("hold");
        }
        let now = chrono::Utc::now().timestamp_millis();
        for holder in [left.as_str(), "job:j:live"] {
            sqlx::query("UPDATE sw_snapshot_holds SET updated_ms = ? WHERE holder = ?")
                .bind(now - TRANSIENT_HOLD_TTL_MS - 1)
                .bind(holder)
                .execute(lake.control_pool())
                .await
                .expect("age the hold");
        }
        assert_eq!(lake.drop_stale_transient_holds(now).await.expect("drop"), 1);
        let mut holders: Vec<String> = lake
            .snapshot_holds()
            .await
            .expect("holds")
            .into_iter()
            .map(|h| h.holder)
            .collect();
        holders.sort();
        assert_eq!(holders, [fresh, "job:j:live".to_string()]);
    }

    /// A commit of expiry that fails for a while (the catalog database busy) is tried
    /// again in the same pass, after a pause, and expires once the database takes it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_expiry_whose_commit_fails_for_a_while_retries_in_the_same_pass() {
        let dir = tempfile::tempdir().expect("tempdir");
        let lake = four_commits(dir.path()).await;
        // The catalog refuses to move any table's pointer, as a database whose lock
        // another writer holds would, until the trigger goes.
        sqlx::query(
            "CREATE TRIGGER sw_test_busy BEFORE UPDATE ON iceberg_tables \
             BEGIN SELECT RAISE(ABORT, 'database is locked'); END",
        )
        .execute(lake.control_pool())
        .await
        .expect("trigger");
        let expiry = {
            let lake = lake.clone();
            tokio::spawn(async move {
                let mut report = MaintenanceReport::default();
                let retention = Retention {
                    keep_last: 1,
                    max_age_ms: 0,
                };
                lake.expire_and_clean(
                    LakeTable::Events,
                    chrono::Utc::now().timestamp_millis() + 1,
                    Some(retention),
                    false,
                    None,
                    &mut report,
                )
                .await
                .map(|()| report)
            })
        };
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(
            !expiry.is_finished(),
            "the expiry gave up in the first pass"
        );
        sqlx::query("DROP TRIGGER sw_test_busy")
            .execute(lake.control_pool())
            .await
            .expect("drop the trigger");
        let report = expiry.await.expect("join").expect("expired once it could");
        assert_eq!(report.snapshots_expired, 3, "{report:?}");
        let t = lake.table(LakeTable::Events).await.expect("table");
        assert_eq!(t.metadata().snapshots().count(), 1);
    }

    /// An expiry's commit reads the holds again in its own transaction: a hold taken
    /// after the expiry chose what to remove, on a removed snapshot or on one before it
    /// (a hold keeps every later snapshot), refuses the commit; a hold after them does
    /// not. (Before, expiry read the holds once, then committed: a holder that wrote its
    /// hold and checked its snapshot in between kept a snapshot that was then removed.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_expiry_commit_refuses_what_a_hold_taken_meanwhile_keeps() {
        let dir = tempfile::tempdir().expect("tempdir");
        let lake = four_commits(dir.path()).await;
        let base = lake.table(LakeTable::Events).await.expect("table");
        let mut ids: Vec<(i64, i64)> = base
            .metadata()
            .snapshots()
            .map(|s| (s.sequence_number(), s.snapshot_id()))
            .collect();
        ids.sort();
        let remove: Vec<i64> = ids[..2].iter().map(|(_, id)| *id).collect();
        let removed: HashSet<i64> = remove.iter().copied().collect();
        let new_md = || {
            base.metadata()
                .clone()
                .into_builder(base.metadata_location().map(str::to_string))
                .remove_snapshots(&remove)
                .build()
                .expect("metadata")
                .metadata
        };
        let snapshots = || async {
            let t = lake.table(LakeTable::Events).await.expect("table");
            t.metadata().snapshots().count()
        };
        for held in [ids[0].1, ids[1].1] {
            lake.hold_snapshot(LakeTable::Events, "late-holder", held)
                .await
                .expect("hold");
            let e = lake
                .commit_metadata(&base, new_md(), Some(&removed))
                .await
                .expect_err("a held snapshot is not removed");
            assert_eq!(e.kind(), ErrorKind::Conflict, "{e}");
            assert!(e.message().contains("was held"), "{e}");
            assert_eq!(snapshots().await, 4);
        }
        // With the hold after what is removed, the commit goes through.
        lake.hold_snapshot(LakeTable::Events, "late-holder", ids[2].1)
            .await
            .expect("hold");
        lake.commit_metadata(&base, new_md(), Some(&removed))
            .await
            .expect("nothing removed is held");
        assert_eq!(snapshots().await, 2);
    }
}
