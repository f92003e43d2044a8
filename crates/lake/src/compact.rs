//! Data-file compaction: bin-pack the small files of a partition into files of about the
//! target size, committed as one `replace` snapshot on the project's own commit path (see
//! [`crate::maintain`]). The events table's rows are written in their order of arrival,
//! another table's sorted by its time column; every row keeps the commit that landed it
//! in the file's lineage column (see [`crate::lineage`]), so readers that replay commits
//! (a backfill, reconciliation) see the compacted rows where they were.
//!
//! A replace snapshot adds no rows: the live tail skips it, so compacted data is never
//! read twice. The replaced files stay until the snapshots that reference them expire.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use arrow_array::{Array, ArrayRef, RecordBatch};
use futures::{StreamExt, TryStreamExt};
use iceberg::io::FileIO;
use iceberg::spec::{
    DataContentType, DataFile, DataFileBuilder, Manifest, ManifestContentType, ManifestFile,
    ManifestListWriter, ManifestWriterBuilder, Operation, Snapshot, SnapshotRef, Summary,
};
use iceberg::table::Table;
use serde::Serialize;
use signalweave_model::ErrorKind;

use crate::error::{LakeError, Result};
use crate::lake::{CommitIdentity, DEFAULT_TARGET_FILE_SIZE, Lake};
use crate::layout::LakeTable;
use crate::maintain::{current_manifests, data_manifests, live_data};

/// What [`Lake::compact`] does.
#[derive(Debug, Clone)]
pub struct CompactionPolicy {
    /// Size of the files compaction writes (`write.target-file-size-bytes`).
    pub target_file_bytes: u64,
    /// Files smaller than this are candidates.
    pub small_file_bytes: u64,
    /// A partition is compacted once it holds this many small files.
    pub min_input_files: usize,
    /// Only this partition (day number since the epoch, as Iceberg's `day` transform).
    pub partition_day: Option<i32>,
}

impl CompactionPolicy {
    /// Default smallest group worth compacting: 5 files.
    pub const DEFAULT_MIN_INPUT_FILES: usize = 5;
}

impl Default for CompactionPolicy {
    fn default() -> Self {
        let target = DEFAULT_TARGET_FILE_SIZE as u64;
        Self {
            target_file_bytes: target,
            small_file_bytes: target * 3 / 4,
            min_input_files: Self::DEFAULT_MIN_INPUT_FILES,
            partition_day: None,
        }
    }
}

/// What a compaction did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CompactionReport {
    /// Partitions compacted.
    pub partitions: usize,
    /// Files replaced.
    pub files_removed: usize,
    /// Files written.
    pub files_added: usize,
    /// Rows rewritten.
    pub rows: u64,
    /// Bytes of the replaced files.
    pub bytes_removed: u64,
    /// Bytes of the written files.
    pub bytes_added: u64,
    /// The replace snapshot, if one was committed.
    pub snapshot_id: Option<i64>,
    /// Lost CAS races (each rebuilt on the new base).
    pub conflicts: u32,
}

pub(crate) const CONFLICT_ATTEMPTS: u32 = 50;

/// What a rewrite commit changes: its operation and the file, byte and row deltas.
#[derive(Debug, Clone)]
pub(crate) struct RewriteStats {
    pub operation: Operation,
    pub files_added: usize,
    pub files_removed: usize,
    pub bytes_added: u64,
    pub bytes_removed: u64,
    pub rows_added: u64,
    pub rows_removed: u64,
}

/// Manifests read once each, by path: manifests and manifest lists are immutable.
#[derive(Debug, Default)]
pub(crate) struct ManifestReads {
    /// The manifest list read last, by path.
    list: Option<(String, Arc<Vec<ManifestFile>>)>,
    /// Data manifests read, by path.
    loaded: HashMap<String, Arc<Manifest>>,
}

impl ManifestReads {
    /// The manifests `snapshot` lists.
    async fn manifest_list(
        &mut self,
        base: &Table,
        snapshot: &SnapshotRef,
    ) -> Result<Arc<Vec<ManifestFile>>> {
        let path = snapshot.manifest_list();
        if let Some((read, list)) = &self.list
            && read == path
        {
            return Ok(Arc::clone(list));
        }
        let list = Arc::new(current_manifests(base, snapshot).await?);
        self.list = Some((path.to_string(), Arc::clone(&list)));
        Ok(list)
    }

    /// The data manifests `snapshot` lists, each with its entries.
    pub(crate) async fn data_manifests(
        &mut self,
        base: &Table,
        snapshot: &SnapshotRef,
    ) -> Result<Vec<(ManifestFile, Arc<Manifest>)>> {
        let listed: Vec<ManifestFile> = self
            .manifest_list(base, snapshot)
            .await?
            .iter()
            .filter(|m| m.content == ManifestContentType::Data)
            .cloned()
            .collect();
        let io = base.file_io().clone();
        let missing: Vec<ManifestFile> = listed
            .iter()
            .filter(|m| !self.loaded.contains_key(&m.manifest_path))
            .cloned()
            .collect();
        let read: Vec<(String, Manifest)> = futures::stream::iter(missing)
            .map(|m| {
                let io = io.clone();
                async move {
                    let manifest = m.load_manifest(&io).await?;
                    Ok::<_, iceberg::Error>((m.manifest_path, manifest))
                }
            })
            .buffered(8)
            .try_collect()
            .await
            .map_err(ice("read manifest"))?;
        for (path, manifest) in read {
            self.loaded.insert(path, Arc::new(manifest));
        }
        Ok(listed
            .into_iter()
            .map(|m| {
                let manifest = Arc::clone(&self.loaded[&m.manifest_path]);
                (m, manifest)
            })
            .collect())
    }

    /// The data files live in `snapshot`, each with its data sequence number.
    pub(crate) async fn live_files(
        &mut self,
        base: &Table,
        snapshot: &SnapshotRef,
    ) -> Result<Vec<(DataFile, i64)>> {
        Ok(self
            .data_manifests(base, snapshot)
            .await?
            .iter()
            .flat_map(|(_, manifest)| {
                manifest
                    .entries()
                    .iter()
                    .filter(|e| live_data(e))
                    .map(|e| (e.data_file().clone(), e.sequence_number().unwrap_or(0)))
                    .collect::<Vec<_>>()
            })
            .collect())
    }

    /// Forgets the manifests `snapshot`'s list (read last) does not hold.
    fn keep_only_listed(&mut self) {
        if let Some((_, list)) = &self.list {
            let listed: HashSet<&str> = list.iter().map(|m| m.manifest_path.as_str()).collect();
            self.loaded.retain(|path, _| listed.contains(path.as_str()));
        }
    }
}

/// A replace commit's work, kept across the races it loses.
///
/// Manifests are immutable, so a try reads only the manifests listed since the last one.
/// The snapshot id stays the same from try to try, so the manifests written for it (each
/// touched manifest without the replaced files, and the manifest of the added files) are
/// written once and listed again by the next try. A race lost to an append then costs a
/// read of the table's metadata and manifest list and of the appended manifest, not of
/// every manifest: steady appends (the gateway commits every second) no longer outrun a
/// rewrite of a table with many manifests.
#[derive(Debug, Default)]
pub(crate) struct PreparedReplace {
    snapshot_id: Option<i64>,
    commit_uuid: String,
    reads: ManifestReads,
    /// The replaced and added files the written manifests were written for.
    removed: HashSet<String>,
    added: Vec<String>,
    /// Each touched manifest's rewrite, by the path of the manifest it replaces.
    rewritten: HashMap<String, ManifestFile>,
    added_manifest: Option<ManifestFile>,
    /// Manifests written and not committed.
    written: Vec<String>,
    /// When the written manifests were begun.
    prepared_at: Option<std::time::Instant>,
    /// A commit's outcome could not be learnt (see [`Self::outcome_unknown`]).
    outcome_unknown: bool,
    /// The data sequence number an added file keeps, by path (see [`Self::keep_sequence`]).
    sequences: HashMap<String, i64>,
}

/// How long manifests written for a replace are listed again by later tries. Past it they
/// are written anew: the metadata orphan sweep deletes unlisted manifests once they are an
/// hour old (`MaintenancePolicy::metadata_orphan_age`), and one must never be listed after.
const PREPARED_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(600);

impl PreparedReplace {
    /// The data files live in `snapshot` (the table's current one: manifests it no
    /// longer lists are forgotten).
    pub(crate) async fn live_files(
        &mut self,
        base: &Table,
        snapshot: &SnapshotRef,
    ) -> Result<Vec<(DataFile, i64)>> {
        let files = self.reads.live_files(base, snapshot).await?;
        self.reads.keep_only_listed();
        Ok(files)
    }

    /// The added file at `path` keeps the data sequence number `sequence` (of the one file
    /// whose rows it holds, less some): readers that order data by it (the arrival order
    /// of a backfill's records, reconciliation's first copy) see the rows where they were.
    /// Without it, an added file takes the commit's, as a file of many files' rows must.
    pub(crate) fn keep_sequence(&mut self, path: &str, sequence: i64) {
        self.sequences.insert(path.to_string(), sequence);
    }

    /// Deletes the manifests written and never committed.
    pub(crate) async fn discard(&mut self, io: &FileIO) {
        for p in self.written.drain(..) {
            let _ = io.delete(&p).await;
        }
        self.unprepare();
    }

    /// Forgets what was prepared for a snapshot (the written manifests' paths aside).
    fn unprepare(&mut self) {
        self.rewritten.clear();
        self.added_manifest = None;
        self.snapshot_id = None;
        self.prepared_at = None;
    }

    /// Whether a commit of unknown outcome may have taken what was written: then neither
    /// its manifests nor the files they list may be deleted.
    pub(crate) fn outcome_unknown(&self) -> bool {
        self.outcome_unknown
    }

    /// Forgets the manifests written, deleting none: a commit of unknown outcome may
    /// list them.
    fn forget_written(&mut self) {
        self.outcome_unknown = true;
        self.written.clear();
        self.unprepare();
    }

    /// After a commit that listed `listed`: what it listed is the table's now; the
    /// manifests written on earlier tries and not listed (their originals were replaced
    /// meanwhile) are deleted.
    async fn committed(&mut self, io: &FileIO, listed: &HashSet<String>) {
        self.written.retain(|p| !listed.contains(p));
        self.discard(io).await;
    }

    /// Drops the written manifests unless they were written for these files and a
    /// snapshot id `md` does not hold yet; returns the snapshot id to commit.
    async fn prepare_for(
        &mut self,
        md: &iceberg::spec::TableMetadata,
        io: &FileIO,
        removed: &HashSet<String>,
        added: &[DataFile],
    ) -> i64 {
        let added: Vec<String> = added.iter().map(|f| f.file_path().to_string()).collect();
        let id_taken = self
            .snapshot_id
            .is_some_and(|id| md.snapshot_by_id(id).is_some());
        let stale = self
            .prepared_at
            .is_some_and(|at| at.elapsed() > PREPARED_MAX_AGE);
        if self.snapshot_id.is_none()
            || id_taken
            || stale
            || self.removed != *removed
            || self.added != added
        {
            self.discard(io).await;
            self.prepared_at = Some(std::time::Instant::now());
            self.snapshot_id = Some(crate::maintain::fresh_snapshot_id(md));
            self.commit_uuid = uuid::Uuid::new_v4().simple().to_string();
            self.removed = removed.clone();
            self.added = added;
        }
        self.snapshot_id.unwrap_or_default()
    }
}

/// `file` without its columns' lower and upper bounds. A replaced file stays in the
/// rewritten manifest as a DELETED entry, which no scan reads; its bounds are the smallest
/// and largest values it held, so an erased subject's id could be one of them.
fn without_bounds(file: &DataFile, spec_id: i32) -> Result<DataFile> {
    let mut b = DataFileBuilder::default();
    b.content(file.content_type())
        .file_path(file.file_path().to_string())
        .file_format(file.file_format())
        .partition(file.partition().clone())
        .record_count(file.record_count())
        .file_size_in_bytes(file.file_size_in_bytes())
        .column_sizes(file.column_sizes().clone())
        .value_counts(file.value_counts().clone())
        .null_value_counts(file.null_value_counts().clone())
        .nan_value_counts(file.nan_value_counts().clone())
        .key_metadata(file.key_metadata().map(<[u8]>::to_vec))
        .split_offsets(file.split_offsets().map(<[i64]>::to_vec))
        .equality_ids(file.equality_ids())
        .first_row_id(file.first_row_id())
        .partition_spec_id(spec_id)
        .referenced_data_file(file.referenced_data_file())
        .content_offset(file.content_offset())
        .content_size_in_bytes(file.content_size_in_bytes());
    if let Some(id) = file.sort_order_id() {
        b.sort_order_id(id);
    }
    b.build().map_err(|e| {
        LakeError::new(
            ErrorKind::Internal,
            format!("a replaced file's entry without its bounds: {e}"),
        )
    })
}

fn ice(context: &str) -> impl FnOnce(iceberg::Error) -> LakeError + '_ {
    move |e| LakeError::iceberg(context, e)
}

fn partition_day(file: &DataFile) -> Option<i32> {
    file.partition().fields().first().and_then(|f| match f {
        Some(iceberg::spec::Literal::Primitive(iceberg::spec::PrimitiveLiteral::Int(d))) => {
            Some(*d)
        }
        _ => None,
    })
}

/// A small file a compaction may merge.
struct Planned<T> {
    file: T,
    /// The lowest and highest commit its rows came from (see [`Lake::commits_in`]).
    commits: (i64, i64),
    size: u64,
}

/// The bins of `files` that a compaction merges, oldest first: runs of consecutive
/// commits of about `target` bytes, never across a commit of a file left as it is
/// (`between`, each file's lowest and highest commit), so a reader of the partition's
/// files in commit order reads every commit in order. A run of one file stays as it is.
fn runs<T>(mut files: Vec<Planned<T>>, between: &[(i64, i64)], target: u64) -> Vec<Vec<T>> {
    files.sort_by_key(|f| f.commits);
    let mut bins = Vec::new();
    let mut bin: Vec<T> = Vec::new();
    // The highest commit in the bin.
    let mut newest = i64::MIN;
    let mut bytes = 0u64;
    let close = |bin: &mut Vec<T>, bins: &mut Vec<Vec<T>>| {
        if bin.len() >= 2 {
            bins.push(std::mem::take(bin));
        }
        bin.clear();
    };
    for f in files {
        let (first, last) = f.commits;
        let across = !bin.is_empty() && between.iter().any(|&(lo, hi)| hi > newest && lo < first);
        if across {
            close(&mut bin, &mut bins);
            bytes = 0;
        }
        if bin.is_empty() {
            newest = i64::MIN;
        }
        newest = newest.max(last);
        bytes += f.size;
        bin.push(f.file);
        if bytes >= target {
            close(&mut bin, &mut bins);
            bytes = 0;
        }
    }
    close(&mut bin, &mut bins);
    bins
}

impl Lake {
    /// Compacts the small files of `table` (or of one day partition): see the module docs.
    pub async fn compact(
        &self,
        table: LakeTable,
        policy: &CompactionPolicy,
    ) -> Result<CompactionReport> {
        let mut report = CompactionReport::default();
        let base = self.table(table).await?;
        let md = base.metadata();
        let Some(current) = md.current_snapshot() else {
            return Ok(report);
        };
        let loaded = data_manifests(&base, current).await?;
        // Each small file with its data sequence number, the lineage of its rows that
        // hold none of their own (see `crate::lineage`).
        let mut by_day: HashMap<Option<i32>, Vec<(DataFile, i64)>> = HashMap::new();
        // The commits of the files left as they are, by partition.
        let mut kept: HashMap<Option<i32>, Vec<(i64, i64)>> = HashMap::new();
        for manifest in &loaded {
            for e in manifest.entries().iter().filter(|e| e.is_alive()) {
                let f = e.data_file();
                if f.content_type() != DataContentType::Data {
                    continue;
                }
                let day = partition_day(f);
                if policy.partition_day.is_some() && policy.partition_day != day {
                    continue;
                }
                let sequence = e.sequence_number().ok_or_else(|| {
                    LakeError::new(
                        ErrorKind::Internal,
                        format!(
                            "{}: a live data file without a sequence number",
                            f.file_path()
                        ),
                    )
                })?;
                if f.file_size_in_bytes() >= policy.small_file_bytes {
                    let commits = self.commits_in(&base, table, f, sequence).await?;
                    kept.entry(day).or_default().push(commits);
                } else {
                    by_day.entry(day).or_default().push((f.clone(), sequence));
                }
            }
        }
        // Bins of about the target size, per partition (see `runs`).
        let mut bins: Vec<Vec<(DataFile, i64)>> = Vec::new();
        for (day, files) in by_day {
            if files.len() < policy.min_input_files.max(2) {
                continue;
            }
            let between = kept.remove(&day).unwrap_or_default();
            let mut planned = Vec::new();
            for (f, seq) in files {
                let commits = self.commits_in(&base, table, &f, seq).await?;
                let size = f.file_size_in_bytes();
                planned.push(Planned {
                    file: (f, seq),
                    commits,
                    size,
                });
            }
            let found = runs(planned, &between, policy.target_file_bytes);
            report.partitions += usize::from(!found.is_empty());
            bins.extend(found);
        }
        if bins.is_empty() {
            return Ok(report);
        }
        let identity = CommitIdentity::new(
            format!("compact-{}", uuid::Uuid::new_v4().simple()),
            current.snapshot_id() as u64,
        );
        let mut added: Vec<DataFile> = Vec::new();
        let mut removed: Vec<DataFile> = Vec::new();
        for bin in bins {
            let rows_in: u64 = bin.iter().map(|(f, _)| f.record_count()).sum();
            let (batch, lineage) = self.read_sorted(&base, table, &bin).await?;
            if batch.num_rows() as u64 != rows_in {
                return Err(LakeError::new(
                    ErrorKind::Internal,
                    format!(
                        "compaction read {} rows from files that hold {rows_in}",
                        batch.num_rows()
                    ),
                ));
            }
            let mut w = self.lineage_writer(table, &identity).await?;
            w.write_lineaged(&batch, &lineage).await?;
            let written = w.finish().await?;
            report.rows += rows_in;
            added.extend(written.into_files());
            removed.extend(bin.into_iter().map(|(f, _)| f));
        }
        report.files_removed = removed.len();
        report.files_added = added.len();
        report.bytes_removed = removed.iter().map(|f| f.file_size_in_bytes()).sum();
        report.bytes_added = added.iter().map(|f| f.file_size_in_bytes()).sum();
        let removed_paths: HashSet<String> =
            removed.iter().map(|f| f.file_path().to_string()).collect();
        let stats = RewriteStats {
            operation: Operation::Replace,
            files_added: report.files_added,
            files_removed: report.files_removed,
            bytes_added: report.bytes_added,
            bytes_removed: report.bytes_removed,
            rows_added: report.rows,
            rows_removed: report.rows,
        };
        let mut prep = PreparedReplace::default();
        let io = base.file_io().clone();
        let outcome = async {
            for _ in 0..CONFLICT_ATTEMPTS {
                let base = self.table(table).await?;
                match self
                    .commit_replace(table, &base, &removed_paths, &added, &stats, &mut prep)
                    .await
                {
                    Ok(id) => return Ok(id),
                    Err(e) if e.kind() == ErrorKind::Conflict => report.conflicts += 1,
                    Err(e) => return Err(e),
                }
            }
            Err(LakeError::new(
                ErrorKind::Conflict,
                format!(
                    "{}: compaction lost {CONFLICT_ATTEMPTS} races in a row",
                    table.name()
                ),
            ))
        }
        .await;
        match outcome {
            Ok(id) => {
                report.snapshot_id = Some(id);
                Ok(report)
            }
            Err(e) => {
                // Unless a commit may have taken them, the files and manifests written go.
                if !prep.outcome_unknown() {
                    prep.discard(&io).await;
                    for f in &added {
                        let _ = io.delete(f.file_path()).await;
                    }
                }
                Err(e)
            }
        }
    }

    /// The rows of `files` (each with its data sequence number) in one batch, with each
    /// row's lineage: the events table's in commit order, each commit's rows in the order
    /// it landed them, so the file replays its commits as a reader tailing them read
    /// them; another table's sorted by its time column.
    /// The lowest and highest commit whose rows the data file `file` (of `table`, loaded
    /// as `base`; data sequence number `sequence`) holds: its own, or, for a file of
    /// events with row lineage, those its lineage spans (see `Lake::file_statistics`).
    /// Only the events table's order of commits matters to its readers.
    async fn commits_in(
        &self,
        base: &Table,
        table: LakeTable,
        file: &DataFile,
        sequence: i64,
    ) -> Result<(i64, i64)> {
        if table != LakeTable::Events || !crate::lineage::has_lineage(file) {
            return Ok((sequence, sequence));
        }
        let schema = base.metadata().current_schema();
        let id = |name: &str| {
            schema.field_by_name(name).map(|f| f.id).ok_or_else(|| {
                LakeError::new(ErrorKind::Config, format!("events has no column {name}"))
            })
        };
        let commits = self
            .commits_of(base, file, id("event_time")?, id("ingest_time")?)
            .await?;
        Ok(commits
            .iter()
            .map(|c| (c.sequence, c.sequence))
            .reduce(|(lo, hi), (a, b)| (lo.min(a), hi.max(b)))
            .unwrap_or((sequence, sequence)))
    }

    async fn read_sorted(
        &self,
        base: &Table,
        table: LakeTable,
        files: &[(DataFile, i64)],
    ) -> Result<(RecordBatch, ArrayRef)> {
        let mut batches = Vec::new();
        let mut lineages = Vec::new();
        for (file, sequence) in files {
            for (b, l) in self.read_lineaged(base, table, file, *sequence).await? {
                batches.push(b);
                lineages.push(l);
            }
        }
        let arrow_schema = table.arrow_schema();
        let all = arrow::compute::concat_batches(&arrow_schema, &batches)
            .map_err(|e| LakeError::arrow("concatenate for compaction", e))?;
        let lineage: Vec<&dyn Array> = lineages.iter().map(|l| l.as_ref()).collect();
        let lineage = if lineage.is_empty() {
            Arc::new(arrow_array::Int64Array::from(Vec::<i64>::new())) as ArrayRef
        } else {
            arrow::compute::concat(&lineage)
                .map_err(|e| LakeError::arrow("concatenate lineage for compaction", e))?
        };
        let column = |name: &str| {
            all.column_by_name(name).cloned().ok_or_else(|| {
                LakeError::new(ErrorKind::Internal, format!("the {name} column is missing"))
            })
        };
        let sort = |values: ArrayRef| arrow::compute::SortColumn {
            values,
            options: None,
        };
        // Each commit's rows are in one input file, in their order, and the inputs are
        // concatenated in order: their place breaks ties.
        let place: ArrayRef = Arc::new(arrow_array::UInt64Array::from_iter_values(
            0..all.num_rows() as u64,
        ));
        let keys = if table == LakeTable::Events {
            vec![sort(Arc::clone(&lineage)), sort(place)]
        } else {
            vec![sort(column(table.time_column())?), sort(place)]
        };
        let order = arrow::compute::lexsort_to_indices(&keys, None)
            .map_err(|e| LakeError::arrow("sort for compaction", e))?;
        let rows = arrow::compute::take_record_batch(&all, &order)
            .map_err(|e| LakeError::arrow("reorder for compaction", e))?;
        let lineage = arrow::compute::take(&lineage, &order, None)
            .map_err(|e| LakeError::arrow("reorder lineage for compaction", e))?;
        Ok((rows, lineage))
    }

    /// Commits a snapshot of `base` in which the `removed` files are replaced by the
    /// `added` ones. `Conflict` when another commit came first: the manifests written
    /// stay in `prep`, for the next try (see [`PreparedReplace`]); the caller discards
    /// them when it gives up.
    pub(crate) async fn commit_replace(
        &self,
        table: LakeTable,
        base: &Table,
        removed: &HashSet<String>,
        added: &[DataFile],
        report: &RewriteStats,
        prep: &mut PreparedReplace,
    ) -> Result<i64> {
        let md = base.metadata();
        let current = md.current_snapshot().ok_or_else(|| {
            LakeError::new(ErrorKind::Conflict, "the table lost its current snapshot")
        })?;
        let io = base.file_io().clone();
        let snapshot_id = prep.prepare_for(md, &io, removed, added).await;
        let commit_uuid = prep.commit_uuid.clone();
        let other_manifests: Vec<ManifestFile> = prep
            .reads
            .manifest_list(base, current)
            .await?
            .iter()
            .filter(|m| m.content != ManifestContentType::Data)
            .cloned()
            .collect();
        // Delete files (another engine's: this one writes none) apply to the files they
        // name or by sequence number, and a rewrite would bring back the rows they delete.
        if other_manifests
            .iter()
            .any(|m| m.has_added_files() || m.has_existing_files())
        {
            return Err(LakeError::new(
                ErrorKind::InvalidInput,
                format!(
                    "{}: the table holds delete files, which a rewrite here does not apply",
                    table.name()
                ),
            ));
        }
        let manifests = prep.reads.data_manifests(base, current).await?;
        prep.reads.keep_only_listed();
        let sequence = md.next_sequence_number();
        let location = md.location();
        let spec = md.default_partition_spec().as_ref().clone();
        let schema = md.current_schema().clone();
        let mut new_manifests: Vec<ManifestFile> = other_manifests;
        let mut still_live = 0usize;
        for (m, manifest) in manifests {
            let replaced_here = manifest
                .entries()
                .iter()
                .filter(|e| e.is_alive() && removed.contains(e.file_path()))
                .count();
            if replaced_here == 0 {
                new_manifests.push(m);
                continue;
            }
            still_live += replaced_here;
            if let Some(rewrite) = prep.rewritten.get(&m.manifest_path) {
                new_manifests.push(rewrite.clone());
                continue;
            }
            let path = format!(
                "{location}/metadata/{commit_uuid}-r{}.avro",
                prep.rewritten.len()
            );
            prep.written.push(path.clone());
            let spec_m = md
                .partition_spec_by_id(m.partition_spec_id)
                .map(|s| s.as_ref().clone())
                .unwrap_or_else(|| spec.clone());
            let mut w = ManifestWriterBuilder::new(
                io.new_output(&path).map_err(ice("open manifest"))?,
                Some(snapshot_id),
                schema.clone(),
                spec_m,
            )
            .build_v2_data();
            for e in manifest.entries().iter().filter(|e| e.is_alive()) {
                let seq = e.sequence_number().unwrap_or(0);
                let file_seq = Some(e.file_sequence_number.unwrap_or(seq));
                if removed.contains(e.file_path()) {
                    let gone = without_bounds(e.data_file(), m.partition_spec_id)?;
                    w.add_delete_file(gone, seq, file_seq)
                        .map_err(ice("record a replaced file"))?;
                } else {
                    w.add_existing_file(
                        e.data_file().clone(),
                        e.snapshot_id().unwrap_or(current.snapshot_id()),
                        seq,
                        file_seq,
                    )
                    .map_err(ice("carry a file over"))?;
                }
            }
            let rewrite = w
                .write_manifest_file()
                .await
                .map_err(ice("write manifest"))?;
            prep.rewritten
                .insert(m.manifest_path.clone(), rewrite.clone());
            new_manifests.push(rewrite);
        }
        if still_live != removed.len() {
            return Err(LakeError::new(
                ErrorKind::InvalidInput,
                format!(
                    "{}: {} of the files to replace are no longer live (another compaction?)",
                    table.name(),
                    removed.len() - still_live
                ),
            ));
        }
        if prep.added_manifest.is_none() {
            let path = format!("{location}/metadata/{commit_uuid}-a.avro");
            prep.written.push(path.clone());
            let mut w = ManifestWriterBuilder::new(
                io.new_output(&path).map_err(ice("open manifest"))?,
                Some(snapshot_id),
                schema.clone(),
                spec.clone(),
            )
            .build_v2_data();
            for f in added {
                // Without a sequence number kept, an added file takes the snapshot's,
                // whichever try commits it.
                let sequence = prep.sequences.get(f.file_path()).copied().unwrap_or(-1);
                w.add_file(f.clone(), sequence)
                    .map_err(ice("add a rewritten file"))?;
            }
            prep.added_manifest = Some(
                w.write_manifest_file()
                    .await
                    .map_err(ice("write manifest"))?,
            );
        }
        new_manifests.extend(prep.added_manifest.clone());
        let list_path = format!(
            "{location}/metadata/snap-{snapshot_id}-{sequence}-{}.avro",
            uuid::Uuid::new_v4().simple()
        );
        // The list is this try's alone: removed again unless a commit may have taken it.
        let attempt = async {
            let mut list = ManifestListWriter::v2(
                io.new_output(&list_path)
                    .map_err(ice("open manifest list"))?
                    .writer()
                    .await
                    .map_err(ice("open manifest list"))?,
                snapshot_id,
                Some(current.snapshot_id()),
                sequence,
            );
            let listed: HashSet<String> = new_manifests
                .iter()
                .map(|m| m.manifest_path.clone())
                .collect();
            list.add_manifests(new_manifests.into_iter())
                .map_err(ice("write manifest list"))?;
            list.close().await.map_err(ice("close manifest list"))?;

            let prev = &current.summary().additional_properties;
            let total = |k: &str| prev.get(k).and_then(|v| v.parse::<i64>().ok());
            let mut props: HashMap<String, String> = prev
                .iter()
                .filter(|(k, _)| k.starts_with("total-"))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let files_delta = report.files_added as i64 - report.files_removed as i64;
            let bytes_delta = report.bytes_added as i64 - report.bytes_removed as i64;
            if let Some(t) = total("total-data-files") {
                props.insert(
                    "total-data-files".into(),
                    (t + files_delta).max(0).to_string(),
                );
            }
            if let Some(t) = total("total-files-size") {
                props.insert(
                    "total-files-size".into(),
                    (t + bytes_delta).max(0).to_string(),
                );
            }
            if let Some(t) = total("total-records") {
                let delta = report.rows_added as i64 - report.rows_removed as i64;
                props.insert("total-records".into(), (t + delta).max(0).to_string());
            }
            props.insert("added-data-files".into(), report.files_added.to_string());
            props.insert(
                "deleted-data-files".into(),
                report.files_removed.to_string(),
            );
            props.insert("added-records".into(), report.rows_added.to_string());
            props.insert("deleted-records".into(), report.rows_removed.to_string());
            props.insert("added-files-size".into(), report.bytes_added.to_string());
            props.insert(
                "removed-files-size".into(),
                report.bytes_removed.to_string(),
            );
            let snapshot = Snapshot::builder()
                .with_snapshot_id(snapshot_id)
                .with_parent_snapshot_id(Some(current.snapshot_id()))
                .with_sequence_number(sequence)
                .with_timestamp_ms(chrono::Utc::now().timestamp_millis())
                .with_manifest_list(list_path.clone())
                .with_summary(Summary {
                    operation: report.operation.clone(),
                    additional_properties: props,
                })
                .with_schema_id(md.current_schema_id())
                .build();
            let new_md = md
                .clone()
                .into_builder(base.metadata_location().map(str::to_string))
                .set_branch_snapshot(snapshot, iceberg::spec::MAIN_BRANCH)
                .map_err(ice("add the replace snapshot"))?
                .build()
                .map_err(ice("build table metadata"))?
                .metadata;
            Ok::<_, LakeError>((listed, new_md))
        };
        let (listed, new_md) = match attempt.await {
            Ok(prepared) => prepared,
            Err(e) => {
                let _ = io.delete(&list_path).await;
                return Err(e);
            }
        };
        match self.commit_metadata(base, new_md, None).await {
            Ok(()) => {
                prep.committed(&io, &listed).await;
                Ok(snapshot_id)
            }
            // Another commit came first: nothing of this try is the table's.
            Err(e) if e.kind() == ErrorKind::Conflict => {
                let _ = io.delete(&list_path).await;
                Err(e)
            }
            // The swap may have happened all the same (an error after the database took
            // it): the table says whether it holds the snapshot.
            Err(e) => match self.table(table).await {
                Ok(t) if t.metadata().snapshot_by_id(snapshot_id).is_some() => {
                    prep.committed(&io, &listed).await;
                    Ok(snapshot_id)
                }
                Ok(_) => {
                    let _ = io.delete(&list_path).await;
                    Err(e)
                }
                // Nothing written is deleted: the orphan sweep removes what no snapshot
                // lists.
                Err(_) => {
                    prep.forget_written();
                    Err(e)
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Planned, runs};

    fn plan(files: &[(&'static str, (i64, i64), u64)]) -> Vec<Planned<&'static str>> {
        files
            .iter()
            .map(|&(file, commits, size)| Planned {
                file,
                commits,
                size,
            })
            .collect()
    }

    #[test]
    fn bins_are_runs_of_consecutive_commits_of_about_the_target_size() {
        // Out of order by name and commit: binned by commit.
        let files = plan(&[
            ("d", (4, 4), 40),
            ("a", (1, 1), 40),
            ("c", (3, 3), 40),
            ("b", (2, 2), 40),
            ("e", (5, 5), 40),
        ]);
        assert_eq!(runs(files, &[], 100), [vec!["a", "b", "c"], vec!["d", "e"]]);
    }

    #[test]
    fn no_bin_spans_a_commit_left_as_it_is() {
        let files = plan(&[
            ("a", (1, 1), 10),
            ("b", (2, 2), 10),
            ("c", (4, 4), 10),
            ("d", (5, 5), 10),
            ("e", (7, 7), 10),
        ]);
        // Commits 3 and 6 are large files: a, b | c, d | e (alone, left as it is).
        assert_eq!(
            runs(files, &[(3, 3), (6, 6)], 100),
            [vec!["a", "b"], vec!["c", "d"]]
        );
    }

    #[test]
    fn compacted_files_are_placed_by_the_commits_they_hold() {
        // "ab" and "ce" were compacted before (commits 1-6 and 11-19, their files' own
        // sequence numbers far later); commit 10 is a large file left as it is, and
        // commit 8 a small one.
        let files = plan(&[("ce", (11, 19), 10), ("ab", (1, 6), 10), ("x", (8, 8), 10)]);
        assert_eq!(runs(files, &[(10, 10)], 100), [vec!["ab", "x"]]);
        // A large compacted file whose commits interleave with two small ones keeps them
        // apart.
        let files = plan(&[("p", (5, 5), 10), ("q", (7, 7), 10)]);
        assert!(runs(files, &[(1, 9)], 100).is_empty());
    }
}
