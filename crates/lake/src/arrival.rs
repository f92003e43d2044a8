//! The watermark a tailing reader had when a record arrived, recovered from metadata.
//!
//! A live job reads the landing table commit by commit, in commit order (sequence
//! number); its watermark before a commit is the largest event time of the commits before
//! it, minus the out-of-orderness bound, and every record of the commit is judged by it. A
//! backfill that wants to classify late records as the live job did needs that watermark
//! for each record's arrival: the commits before its own. Ingest times order nothing: two
//! gateways, a request stamped before its group closed and committed with the next, or a
//! resumed load (stamped with its first run's clock) commit out of the order of their
//! stamps, and the live job reads them in commit order. The data files' column statistics
//! give the watermark without reading any data: each file contributes its largest event
//! time to every commit after its own.
//!
//! Files the gateway or a load committed hold one commit each, so the steps are per
//! commit, as a live job reading one commit per step sees them. A compacted file holds
//! many commits under a new sequence number, but keeps each row's own in its lineage
//! column (see `crate::lineage`): its statistics are then read from its data, commit by
//! commit, so each of its commits is a step of its own, where it was before compaction,
//! and its records are ordered by their own commits ([`ArrivalWatermarks::has_lineage`]).
//!
//! A file an erasure rewrote keeps its sequence number, so its records keep their place;
//! its statistics bound the rows kept, so where an erased row held its largest event or
//! ingest time, its step moves.

use std::collections::HashMap;

use arrow::array::{Array, AsArray};
use arrow::datatypes::{Int64Type, TimestampMicrosecondType};
use futures::TryStreamExt;
use iceberg::scan::FileScanTask;
use iceberg::spec::{DataContentType, DataFile, PrimitiveLiteral};
use signalweave_model::ErrorKind;

use crate::error::{LakeError, Result};
use crate::lake::Lake;
use crate::layout::LakeTable;
use crate::lineage::has_lineage;
use crate::maintain::data_manifests;

/// Paths per query on `sw_file_commits` (a statement's parameters are bounded).
const KEPT_COMMITS_PER_QUERY: usize = 500;

/// The reader's watermark as a function of arrival time (see the module documentation).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ArrivalWatermarks {
    /// (sequence number of a file's commit, running maximum of event time up to it), by
    /// commit.
    steps: Vec<(i64, i64)>,
    /// Of each data file, by path.
    files: std::collections::HashMap<String, FileArrival>,
    bound_us: i64,
}

/// When one data file's records arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileArrival {
    /// Its records' lowest commit sequence number.
    sequence: i64,
    /// The watermark its first record arrived at (`i64::MIN` when unknown).
    first_watermark: i64,
    /// Where its first record arrived, when its lowest ingest time is known.
    first: Option<ArrivalKey>,
    /// Where its last record arrived.
    last: ArrivalKey,
    /// The one watermark all its records arrived at, when that is known (see
    /// [`ArrivalWatermarks::uniform_of`]).
    uniform: Option<i64>,
    /// Its records' commits are in its lineage column, not its sequence number.
    lineage: bool,
}

/// Where a record stands in arrival order: the sequence number of its commit.
pub type ArrivalKey = i64;

/// What a data file's column statistics tell of its arrival: of all its records, or of
/// those of one commit of a file with row lineage (a file is then given once per commit
/// it holds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArrivedFile {
    /// The file's path.
    pub path: String,
    /// Whether the file keeps each record's commit in its lineage column: `sequence` is
    /// then that commit's.
    pub lineage: bool,
    /// The lowest ingest time of its records (µs), when known.
    pub first_ingest: Option<i64>,
    /// The highest ingest time of its records (µs).
    pub last_ingest: i64,
    /// Its sequence number.
    pub sequence: i64,
    /// The highest event time of its records (µs).
    pub last_event: i64,
    /// Whether its statistics count no null in its arrival column, nor in any column
    /// [`Lake::file_statistics`] was asked to vouch for.
    pub null_free: bool,
}

impl ArrivalWatermarks {
    /// From the files' statistics.
    pub fn from_files(files: Vec<ArrivedFile>, bound_us: i64) -> Self {
        let mut keyed: Vec<(i64, i64)> = files.iter().map(|f| (f.sequence, f.last_event)).collect();
        keyed.sort_unstable();
        let mut running = i64::MIN;
        let steps = keyed
            .into_iter()
            .map(|(arrival, event)| {
                running = running.max(event);
                (arrival, running)
            })
            .collect();
        let mut w = Self {
            steps,
            files: Default::default(),
            bound_us,
        };
        let mut by_path: std::collections::HashMap<String, FileArrival> = Default::default();
        for f in files {
            // Every record of a commit arrived at the watermark before it.
            let first_key = f.first_ingest.map(|_| f.sequence);
            let first = first_key.map_or(i64::MIN, |s| w.at(s));
            let last = f.sequence;
            let uniform = first_key.filter(|_| f.null_free).map(|_| first);
            let arrival = FileArrival {
                sequence: f.sequence,
                first_watermark: first,
                first: first_key,
                last,
                uniform,
                lineage: f.lineage,
            };
            by_path
                .entry(f.path)
                .and_modify(|a| {
                    // Another commit of a file with lineage: the file spans them all.
                    a.sequence = a.sequence.min(arrival.sequence);
                    a.first_watermark = a.first_watermark.min(arrival.first_watermark);
                    a.first = a.first.zip(arrival.first).map(|(x, y)| x.min(y));
                    a.last = a.last.max(arrival.last);
                    a.uniform = None;
                    a.lineage = true;
                })
                .or_insert(arrival);
        }
        w.files = by_path;
        w
    }

    /// Whether the data file at `path` keeps its records' commits in its lineage column
    /// (a compacted file): they must be read with it and ordered by it, not by the
    /// file's sequence number.
    pub fn has_lineage(&self, path: &str) -> bool {
        self.files.get(path).is_some_and(|f| f.lineage)
    }

    /// The sequence number of the data file at `path` (`i64::MAX` when unknown: its
    /// records then come after every commit); of a file with lineage, its records' lowest.
    pub fn sequence_of(&self, path: &str) -> i64 {
        self.files.get(path).map_or(i64::MAX, |f| f.sequence)
    }

    /// The lowest watermark a record of the data file at `path` arrived at: the one before
    /// its (first) commit, since the watermark never goes back. `i64::MIN` when the file's
    /// lowest ingest time is unknown (its records are refused, or judged with care).
    pub fn first_of(&self, path: &str) -> i64 {
        self.files.get(path).map_or(i64::MIN, |f| f.first_watermark)
    }

    /// The one watermark every record of the data file at `path` arrived at, when its
    /// statistics prove there is one: a file of one commit (not a compacted one) that
    /// holds no record without an arrival time or a value of the columns vouched for
    /// ([`ArrivedFile::null_free`]). Its records can then be judged without reading their
    /// arrival times.
    pub fn uniform_of(&self, path: &str) -> Option<i64> {
        self.files.get(path).and_then(|f| f.uniform)
    }

    /// When the data file at `path` arrived: the commit of its first record (`None` when
    /// its lowest ingest time is unknown) and of its last, which order records as
    /// [`ArrivalWatermarks::at`] does. `None` for a file without statistics.
    pub fn arrival_of(&self, path: &str) -> Option<(Option<ArrivalKey>, ArrivalKey)> {
        self.files.get(path).map(|f| (f.first, f.last))
    }

    /// The watermark a reader had just before a record of the commit with sequence
    /// number `sequence`: the largest event time of the commits before it, minus the
    /// bound (`i64::MIN` when none came before).
    pub fn at(&self, sequence: i64) -> i64 {
        self.after_steps(self.steps.partition_point(|(s, _)| *s < sequence))
    }

    /// A cursor that answers [`ArrivalWatermarks::at`] for a run of records, searching
    /// only when a record falls outside the previous one's step: the records of one data
    /// file share their commit, so a file's records search once.
    pub fn cursor(&self) -> ArrivalCursor<'_> {
        ArrivalCursor {
            watermarks: self,
            before: 0,
        }
    }

    /// The watermark after the first `n` steps.
    fn after_steps(&self, n: usize) -> i64 {
        match n {
            0 => i64::MIN,
            n => self.steps[n - 1].1.saturating_sub(self.bound_us),
        }
    }

    /// Commits that contributed: a data file each, or each commit of a file with row
    /// lineage.
    pub fn files(&self) -> usize {
        self.steps.len()
    }
}

/// See [`ArrivalWatermarks::cursor`].
#[derive(Debug, Clone)]
pub struct ArrivalCursor<'a> {
    watermarks: &'a ArrivalWatermarks,
    /// Steps strictly before the previous record's arrival.
    before: usize,
}

impl ArrivalCursor<'_> {
    /// [`ArrivalWatermarks::at`].
    #[inline]
    pub fn at(&mut self, sequence: i64) -> i64 {
        let steps = &self.watermarks.steps;
        let n = self.before;
        let still =
            (n == 0 || steps[n - 1].0 < sequence) && steps.get(n).is_none_or(|s| s.0 >= sequence);
        if !still {
            self.before = steps.partition_point(|(s, _)| *s < sequence);
        }
        self.watermarks.after_steps(self.before)
    }
}

fn micros(d: &iceberg::spec::Datum) -> Option<i64> {
    match d.literal() {
        PrimitiveLiteral::Long(v) => Some(*v),
        PrimitiveLiteral::Int(v) => Some(i64::from(*v)),
        _ => None,
    }
}

impl Lake {
    /// The sequence number of every live data file of `table` as of `snapshot_id` (None:
    /// current), by path.
    pub async fn data_file_sequences(
        &self,
        table: LakeTable,
        snapshot_id: Option<i64>,
    ) -> Result<std::collections::HashMap<String, i64>> {
        let base = self.table(table).await?;
        let md = base.metadata();
        let snapshot = match snapshot_id {
            Some(id) => md.snapshot_by_id(id).cloned(),
            None => md.current_snapshot().cloned(),
        };
        let Some(snapshot) = snapshot else {
            return Ok(Default::default());
        };
        let loaded = data_manifests(&base, &snapshot).await?;
        Ok(loaded
            .iter()
            .flat_map(|m| m.entries().iter().filter(|e| e.is_alive()))
            .map(|e| {
                (
                    e.data_file().file_path().to_string(),
                    e.sequence_number().unwrap_or(0),
                )
            })
            .collect())
    }

    /// What the data files' statistics tell of `table` as of `snapshot_id` (None:
    /// current), from one read of its manifests: the arrival watermarks, from the upper
    /// bounds of `event_column` and `arrival_column`, and each file's span of
    /// `event_column`. A file without those statistics contributes nothing to either.
    /// A file is null-free ([`ArrivedFile::null_free`]) when its null counts of
    /// `arrival_column` and of each of `null_free` are known to be 0.
    pub async fn file_statistics(
        &self,
        table: LakeTable,
        snapshot_id: Option<i64>,
        event_column: &str,
        arrival_column: &str,
        bound_us: i64,
        null_free: &[&str],
    ) -> Result<(ArrivalWatermarks, FileSpans)> {
        let columns: Vec<&str> = [event_column, arrival_column]
            .into_iter()
            .chain(null_free.iter().copied())
            .collect();
        let (files, ids, base) = self.live_data_files(table, snapshot_id, &columns).await?;
        let (event_id, arrival_id) = (ids[0], ids[1]);
        let compacted: Vec<&DataFile> = files
            .iter()
            .map(|(f, _)| f)
            .filter(|f| has_lineage(f))
            .collect();
        let arrivals = self
            .commits_of_files(&base, &compacted, event_id, arrival_id)
            .await?;
        let arrivals = arrivals
            .into_iter()
            .chain(
                files
                    .iter()
                    .filter(|(f, _)| !has_lineage(f))
                    .filter_map(|(f, seq)| {
                        let upper = f.upper_bounds();
                        Some(ArrivedFile {
                            path: f.file_path().to_string(),
                            lineage: false,
                            first_ingest: f.lower_bounds().get(&arrival_id).and_then(micros),
                            last_ingest: upper.get(&arrival_id).and_then(micros)?,
                            sequence: *seq,
                            last_event: upper.get(&event_id).and_then(micros)?,
                            null_free: ids[1..]
                                .iter()
                                .all(|id| f.null_value_counts().get(id) == Some(&0)),
                        })
                    }),
            )
            .collect();
        let spans = files
            .iter()
            .filter_map(|(f, _)| {
                Some((
                    f.file_path().to_string(),
                    (
                        f.lower_bounds().get(&event_id).and_then(micros)?,
                        f.upper_bounds().get(&event_id).and_then(micros)?,
                    ),
                ))
            })
            .collect();
        Ok((
            ArrivalWatermarks::from_files(arrivals, bound_us),
            FileSpans { spans },
        ))
    }

    /// What `file`, a file with row lineage, holds of each commit: its records' ingest
    /// and event times (fields `arrival_id` and `event_id`), since its statistics span its
    /// commits. Never null-free: its statistics do not vouch for any column.
    ///
    /// They are read from its data once, then kept in the catalog database
    /// (`sw_file_commits`, by path: a data file never changes), so a plan reads a row
    /// per compacted file, not its data. A database without the table (a lake not
    /// initialised by this version) is read from the data every time.
    pub(crate) async fn commits_of(
        &self,
        base: &iceberg::table::Table,
        file: &DataFile,
        event_id: i32,
        arrival_id: i32,
    ) -> Result<Vec<ArrivedFile>> {
        self.commits_of_files(base, &[file], event_id, arrival_id)
            .await
    }

    /// [`Lake::commits_of`] of each of `files`, their kept summaries read a few hundred
    /// files per query.
    pub(crate) async fn commits_of_files(
        &self,
        base: &iceberg::table::Table,
        files: &[&DataFile],
        event_id: i32,
        arrival_id: i32,
    ) -> Result<Vec<ArrivedFile>> {
        let fields = format!("{event_id}/{arrival_id}");
        let paths: Vec<&str> = files.iter().map(|f| f.file_path()).collect();
        let kept = self.kept_commits(&paths, &fields).await;
        let mut out = Vec::new();
        for file in files {
            let summary = match kept.get(file.file_path()) {
                Some(json) => match serde_json::from_str::<Vec<[i64; 4]>>(json) {
                    Ok(commits) => Some(commits),
                    Err(e) => {
                        tracing::warn!(file = file.file_path(), error = %e, "unreadable commit summary; reading the file");
                        None
                    }
                },
                None => None,
            };
            let commits = match summary {
                Some(commits) => commits,
                None => {
                    let commits = self.read_commits(base, file, event_id, arrival_id).await?;
                    let json = serde_json::to_string(&commits).unwrap_or_default();
                    let kept = sqlx::query(&self.control_sql(
                        "INSERT INTO sw_file_commits (catalog_name, file_path, fields, commits) \
                         VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
                    ))
                    .bind(self.config().catalog_name.as_str())
                    .bind(file.file_path())
                    .bind(&fields)
                    .bind(json)
                    .execute(self.control_pool())
                    .await;
                    if let Err(e) = kept {
                        tracing::debug!(file = file.file_path(), error = %e, "could not keep a commit summary");
                    }
                    commits
                }
            };
            out.extend(
                commits
                    .into_iter()
                    .map(|[sequence, first, last, event]| ArrivedFile {
                        path: file.file_path().to_string(),
                        lineage: true,
                        first_ingest: Some(first),
                        last_ingest: last,
                        sequence,
                        last_event: event,
                        null_free: false,
                    }),
            );
        }
        Ok(out)
    }

    /// The summaries `sw_file_commits` keeps of `paths` for `fields`, by path. One that
    /// cannot be read (a database without the table) is missing: its file is read.
    async fn kept_commits(&self, paths: &[&str], fields: &str) -> HashMap<String, String> {
        let mut kept = HashMap::new();
        for chunk in paths.chunks(KEPT_COMMITS_PER_QUERY) {
            let places: Vec<String> = (3..chunk.len() + 3).map(|i| format!("${i}")).collect();
            let sql = self.control_sql(&format!(
                "SELECT file_path, commits FROM sw_file_commits WHERE catalog_name = $1 \
                 AND fields = $2 AND file_path IN ({})",
                places.join(", ")
            ));
            let mut q = sqlx::query_as::<_, (String, String)>(&sql)
                .bind(self.config().catalog_name.as_str())
                .bind(fields);
            for p in chunk {
                q = q.bind(*p);
            }
            match q.fetch_all(self.control_pool()).await {
                Ok(rows) => kept.extend(rows),
                Err(e) => {
                    tracing::debug!(error = %e, "no commit summaries kept; reading the files");
                    return kept;
                }
            }
        }
        kept
    }

    /// Forgets what `sw_file_commits` keeps of the data files at `paths` (deleted). A
    /// failure leaves rows no live file will ask for, and is only logged.
    pub(crate) async fn forget_file_commits(&self, paths: &[String]) {
        for chunk in paths.chunks(KEPT_COMMITS_PER_QUERY) {
            let places: Vec<String> = (2..chunk.len() + 2).map(|i| format!("${i}")).collect();
            let sql = self.control_sql(&format!(
                "DELETE FROM sw_file_commits WHERE catalog_name = $1 AND file_path IN ({})",
                places.join(", ")
            ));
            let mut q = sqlx::query(&sql).bind(self.config().catalog_name.as_str());
            for p in chunk {
                q = q.bind(p.as_str());
            }
            if let Err(e) = q.execute(self.control_pool()).await {
                tracing::debug!(error = %e, "could not forget the commit summaries of deleted files");
                return;
            }
        }
    }

    /// [`Lake::commits_of`] read from the data: (sequence, lowest and highest ingest time,
    /// highest event time) of each commit, by sequence. A commit none of whose records
    /// has both times is left out, as a file without those statistics is.
    async fn read_commits(
        &self,
        base: &iceberg::table::Table,
        file: &DataFile,
        event_id: i32,
        arrival_id: i32,
    ) -> Result<Vec<[i64; 4]>> {
        let md = base.metadata();
        let task = crate::lake::whole_file_task(
            file,
            md.current_schema(),
            &[event_id, arrival_id],
            Some(md.default_partition_spec().clone()),
        );
        let unreadable = || {
            LakeError::new(
                ErrorKind::Internal,
                format!(
                    "{}: a file with row lineage whose commits cannot be read",
                    file.file_path()
                ),
            )
        };
        let (stream, true) = crate::ranged::open_whole(base.file_io(), &task, 65_536)
            .await
            .map_err(|e| LakeError::iceberg("read the commits of a data file", e))?
            .ok_or_else(unreadable)?
        else {
            return Err(unreadable());
        };
        let batches: Vec<arrow::array::RecordBatch> = stream
            .try_collect()
            .await
            .map_err(|e| LakeError::iceberg("read the commits of a data file", e))?;
        // By commit: (lowest ingest time, highest ingest time, highest event time).
        let mut commits: std::collections::BTreeMap<i64, (i64, i64, i64)> = Default::default();
        for b in &batches {
            let (Some(events), Some(ingests), Some(lineage)) = (
                b.column(0).as_primitive_opt::<TimestampMicrosecondType>(),
                b.column(1).as_primitive_opt::<TimestampMicrosecondType>(),
                b.column(2).as_primitive_opt::<Int64Type>(),
            ) else {
                return Err(unreadable());
            };
            for row in 0..b.num_rows() {
                if events.is_null(row) || ingests.is_null(row) || lineage.is_null(row) {
                    continue;
                }
                let (t, a) = (events.value(row), ingests.value(row));
                let c = commits.entry(lineage.value(row)).or_insert((a, a, t));
                *c = (c.0.min(a), c.1.max(a), c.2.max(t));
            }
        }
        Ok(commits
            .into_iter()
            .map(|(sequence, (first, last, event))| [sequence, first, last, event])
            .collect())
    }

    /// The live data files of `table` as of `snapshot_id` (None: current; none for an
    /// empty table) with their sequence numbers, the field id of each of `columns`, and
    /// the table as loaded to find them.
    async fn live_data_files(
        &self,
        table: LakeTable,
        snapshot_id: Option<i64>,
        columns: &[&str],
    ) -> Result<(Vec<(DataFile, i64)>, Vec<i32>, iceberg::table::Table)> {
        let base = self.table(table).await?;
        let md = base.metadata();
        let schema = md.current_schema();
        let ids = columns
            .iter()
            .map(|name| {
                schema.field_by_name(name).map(|f| f.id).ok_or_else(|| {
                    LakeError::new(
                        ErrorKind::Config,
                        format!("{} has no column {name}", table.name()),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let snapshot = match snapshot_id {
            Some(id) => md.snapshot_by_id(id).cloned().ok_or_else(|| {
                LakeError::new(
                    ErrorKind::NotFound,
                    format!("snapshot {id} is not retained by {}", table.name()),
                )
            })?,
            None => match md.current_snapshot() {
                Some(s) => s.clone(),
                None => return Ok((Vec::new(), ids, base)),
            },
        };
        let files = data_manifests(&base, &snapshot)
            .await?
            .iter()
            .flat_map(|m| m.entries().iter().filter(|e| e.is_alive()))
            .filter(|e| e.data_file().content_type() == DataContentType::Data)
            .map(|e| (e.data_file().clone(), e.sequence_number().unwrap_or(0)))
            .collect();
        Ok((files, ids, base))
    }
}

/// The span (lowest, highest value, µs) of one timestamp column in each data file, from
/// the files' statistics: how many records of a planned read fall in a range can be
/// estimated before reading any.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileSpans {
    spans: std::collections::HashMap<String, (i64, i64)>,
}

impl FileSpans {
    /// About how many records of `files` (path, record count: a planned read) have the
    /// column in `[from_us, to_us)`: each file's records are taken as spread evenly over
    /// its span. A file of unknown span counts whole.
    pub fn estimate<'a>(
        &self,
        files: impl IntoIterator<Item = (&'a str, u64)>,
        from_us: i64,
        to_us: i64,
    ) -> u64 {
        files
            .into_iter()
            .map(|(path, records)| {
                let Some(&(lo, hi)) = self.spans.get(path) else {
                    return records;
                };
                // In i128: a span's bounds can be the extremes of i64.
                let span = i128::from(hi) - i128::from(lo) + 1;
                let inside = (i128::from(hi) + 1).min(i128::from(to_us))
                    - i128::from(lo).max(i128::from(from_us));
                if span <= 0 || inside <= 0 {
                    return 0;
                }
                // `inside` is at most `span`.
                let share = i128::from(records).saturating_mul(inside);
                (share / span + i128::from(share % span != 0)) as u64
            })
            .sum()
    }

    /// The lowest and highest value in the data file at `path`, when known.
    pub fn span_of(&self, path: &str) -> Option<(i64, i64)> {
        self.spans.get(path).copied()
    }

    /// [`FileSpans::estimate`] of a planned read's tasks.
    pub fn estimate_tasks(&self, tasks: &[FileScanTask], from_us: i64, to_us: i64) -> u64 {
        self.estimate(
            tasks
                .iter()
                .map(|t| (t.data_file_path.as_str(), t.record_count.unwrap_or(0))),
            from_us,
            to_us,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watermark_steps_after_each_commit_and_never_goes_back() {
        // (largest ingest, sequence, largest event time): the second commit is late data.
        let f = |p: &str, a, s, t| ArrivedFile {
            path: p.to_string(),
            lineage: false,
            first_ingest: Some(a - 3),
            last_ingest: a,
            sequence: s,
            last_event: t,
            null_free: true,
        };
        let w = ArrivalWatermarks::from_files(
            vec![f("c", 30, 3, 1_000), f("a", 10, 1, 500), f("b", 20, 2, 100)],
            5,
        );
        assert_eq!(w.at(1), i64::MIN, "not after its own commit");
        assert_eq!(w.at(2), 495);
        assert_eq!(w.at(3), 495, "late data does not move it back");
        assert_eq!(w.at(4), 995);
        assert_eq!(w.files(), 3);
        assert_eq!(w.first_of("a"), i64::MIN);
        assert_eq!(w.first_of("b"), 495);
        assert_eq!(w.first_of("c"), 495);
        assert_eq!(w.first_of("unknown"), i64::MIN);
        assert_eq!(w.uniform_of("c"), Some(495), "one commit, one watermark");
        // Commit order decides, whatever the stamps: a load resumed with its first run's
        // clock, or a gateway's group stamped before another's and committed after it.
        let w = ArrivalWatermarks::from_files(
            vec![f("x", 90, 1, 100), f("y", 7, 2, 200), f("z", 50, 3, 50)],
            0,
        );
        assert_eq!(w.at(w.sequence_of("x")), i64::MIN);
        assert_eq!(w.at(w.sequence_of("y")), 100);
        assert_eq!(w.at(w.sequence_of("z")), 200);
        assert_eq!(w.sequence_of("unknown"), i64::MAX);
        // Two files of one commit (two days of a gateway's group): neither is before the
        // other.
        let w = ArrivalWatermarks::from_files(
            vec![f("d1", 10, 1, 100), f("d2", 20, 1, 900), f("e", 30, 2, 0)],
            0,
        );
        assert_eq!(w.first_of("d2"), i64::MIN);
        assert_eq!(w.at(2), 900);
    }

    #[test]
    fn a_range_is_estimated_from_each_files_share_of_its_span() {
        let spans = FileSpans {
            spans: [
                ("a".to_string(), (0, 99)),
                ("b".to_string(), (100, 100)),
                ("c".to_string(), (i64::MIN, i64::MAX)),
            ]
            .into(),
        };
        // a: [50, 100) is half of [0, 99]; b: one instant, inside.
        assert_eq!(spans.estimate([("a", 1_000), ("b", 7)], 50, 150), 500 + 7);
        assert_eq!(spans.estimate([("a", 1_000)], 100, 200), 0, "past its end");
        assert_eq!(
            spans.estimate([("a", 1_000)], -50, 1_000),
            1_000,
            "all of it"
        );
        assert_eq!(
            spans.estimate([("b", 7)], 0, 100),
            0,
            "the end is exclusive"
        );
        assert_eq!(spans.estimate([("unknown", 9)], 0, 1), 9, "counts whole");
        assert_eq!(
            spans.estimate([("c", 1 << 40)], 0, 1 << 62),
            1 << 38,
            "no overflow"
        );
    }

    proptest::proptest! {
        /// The cursor answers as a search from scratch, whatever order records come in:
        /// runs of one commit, jumps back, ties with a step.
        #[test]
        fn the_cursor_answers_as_a_search(
            files in proptest::collection::vec((0i64..50, 0i64..4, -100i64..100), 0..12),
            records in proptest::collection::vec(0i64..5, 0..60),
        ) {
            let w = ArrivalWatermarks::from_files(
                files.iter().enumerate().map(|(i, &(a, s, t))| ArrivedFile {
                    path: format!("f{i}"),
                    lineage: false,
                    first_ingest: (i % 3 != 0).then_some(a - i as i64 % 5),
                    last_ingest: a,
                    sequence: s,
                    last_event: t,
                    null_free: i % 2 == 0,
                }).collect(),
                3,
            );
            let mut cursor = w.cursor();
            let mut sorted = records.clone();
            sorted.sort_unstable();
            for seq in records.into_iter().chain(sorted) {
                proptest::prop_assert_eq!(cursor.at(seq), w.at(seq));
            }
            for (i, &(_, s, _)) in files.iter().enumerate() {
                let path = format!("f{i}");
                // No record of a file arrives below the file's first watermark, and each
                // arrives at the watermark before its commit.
                proptest::prop_assert!(w.first_of(&path) <= w.at(s));
                if i % 3 != 0 {
                    proptest::prop_assert_eq!(w.first_of(&path), w.at(s));
                }
                // The watermark before a commit is the bound off the largest event time
                // of the commits before it.
                let before = files.iter().filter(|f| f.1 < s).map(|f| f.2).max();
                proptest::prop_assert_eq!(w.at(s), before.map_or(i64::MIN, |t| t - 3));
                // A uniform watermark is known whenever the bounds and null counts prove it.
                let uniform = w.uniform_of(&path);
                proptest::prop_assert_eq!(uniform.is_some(), i % 3 != 0 && i % 2 == 0);
                if let Some(wm) = uniform {
                    proptest::prop_assert_eq!(w.at(s), wm);
                }
            }
        }
    }
}
