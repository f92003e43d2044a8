//! Erasure of a data subject: the customer's events are removed from `events`, and the
//! rows that identify those events from `late_events` and `rejections`, by rewriting the
//! affected data files (an `overwrite` snapshot on the project's own commit path). The
//! snapshots that still reference the old files are then expired, whatever holds them,
//! and the old files deleted, so the values are gone from storage, not only from the
//! current snapshot. `sw_erasures` records what was erased, when, why and by whom, with
//! counts and a SHA-256 of the subject, never the erased values. The report names the
//! event-time range and keys whose derived outputs must be recomputed by a backfill.
//!
//! Outputs whose key names the customer (`customer_features`, keyed by tenant and
//! customer id, in every namespace) lose every version of the customer's windows the
//! same way. Which output rows those are comes from the jobs' specs, as [`KeyLayout`]s:
//! rows of a job version without one are left and reported, never guessed at.

use std::collections::{BTreeSet, HashSet};

use arrow::array::{Array, AsArray, BooleanArray};
use arrow::datatypes::{Int64Type, TimestampMicrosecondType};
use arrow_array::RecordBatch;
use iceberg::spec::{DataFile, Operation};
use serde::Serialize;
use sha2::{Digest, Sha256};
use signalweave_model::ErrorKind;

use crate::compact::{CONFLICT_ATTEMPTS, ManifestReads, PreparedReplace, RewriteStats};
use crate::error::{LakeError, Result};
use crate::lake::{CommitIdentity, Lake, on_table_schema, whole_file_task};
use crate::layout::LakeTable;
use crate::lineage::has_lineage;
use crate::maintain::{MaintenancePolicy, Retention};

/// How the output key of one job version names a customer: its key columns' positions
/// (see [`signalweave_model::key_parts`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyLayout {
    /// Job name, as output rows carry it.
    pub job: String,
    /// Job version, as output rows carry it.
    pub job_version: i64,
    /// The job's output table in its live namespace, without `signalweave.` (another
    /// namespace's is `<table>__<namespace>`, a backfill's `<table>__bf_<namespace>`).
    pub output_table: String,
    /// How many key columns.
    pub parts: usize,
    /// Which key column is the customer id; None: the key names no customer.
    pub customer: Option<usize>,
    /// Which key column is the tenant, if any.
    pub tenant: Option<usize>,
    /// The job's allowed lateness (µs): how long after its end a window still changes.
    pub lateness_us: i64,
    /// The longest a window of the job spans (µs; a session's gap): an event's windows
    /// end by its time plus this.
    pub span_us: i64,
}

impl KeyLayout {
    /// Whether `table` may be this job's output table, in any namespace. (Another job's
    /// table may be named so too: rows are told apart by their job and version.)
    fn writes(&self, table: &str) -> bool {
        table == self.output_table
            || table
                .strip_prefix(self.output_table.as_str())
                .is_some_and(|rest| rest.starts_with("__"))
    }
}

/// Who is erased, why, and on whose request.
#[derive(Debug, Clone, Default)]
pub struct ErasureRequest {
    /// The data subject: every event with this `customer_id`.
    pub customer_id: String,
    /// Only the subject's events of this tenant (a customer id names another person in
    /// another tenant); None: of every tenant.
    pub tenant: Option<String>,
    /// Why (for example a ticket number); recorded.
    pub reason: String,
    /// Who asked; recorded.
    pub requested_by: String,
    /// The output key of every job version known (empty: outputs are left as they are).
    pub outputs: Vec<KeyLayout>,
}

impl ErasureRequest {
    /// Whether `key`, an output key of `layout`'s job version, is the subject's. A key
    /// without the tenant (a job version keyed by customer id alone) is the subject's
    /// whatever the tenant: it mixes the tenants' customers of that id, this one included.
    pub fn names_subject(&self, layout: &KeyLayout, key: &str) -> bool {
        let Some(customer) = layout.customer else {
            return false;
        };
        let parts = signalweave_model::key_parts(key, layout.parts);
        parts.len() == layout.parts
            && parts[customer] == self.customer_id
            && match (layout.tenant, &self.tenant) {
                (Some(t), Some(want)) => parts[t] == *want,
                _ => true,
            }
    }
}

/// The digest an erasure records of its subject (hex SHA-256): of the customer id within
/// its tenant (`tenant`, a NUL, the id) when the erasure was scoped to one, else of the id.
pub fn subject_digest(customer_id: &str, tenant: Option<&str>) -> String {
    match tenant {
        Some(t) => hex::encode(Sha256::digest(format!("{t}\u{0}{customer_id}").as_bytes())),
        None => hex::encode(Sha256::digest(customer_id.as_bytes())),
    }
}

/// The snapshot of `events` an erasure's `tables_json` names, if any.
fn events_snapshot(tables_json: &str) -> Option<i64> {
    #[derive(serde::Deserialize)]
    struct Table {
        table: String,
        snapshot_id: Option<i64>,
    }
    serde_json::from_str::<Vec<Table>>(tables_json)
        .ok()?
        .into_iter()
        .find(|t| t.table == LakeTable::Events.name())?
        .snapshot_id
}

/// An erasure as a running job reads it: whose windows over which event times to leave
/// out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErasureNotice {
    /// The erasure.
    pub erasure_id: String,
    /// [`subject_digest`] of the subject.
    pub subject_sha256: String,
    /// [`subject_digest`] of the customer id alone, whatever the erasure's scope.
    pub customer_sha256: String,
    /// When it was recorded (ms).
    pub erased_ms: i64,
    /// The erased events' event times (µs, inclusive).
    pub event_from_us: i64,
    /// See `event_from_us`.
    pub event_to_us: i64,
    /// The snapshot of `events` that removed the subject's events (None when the erasure
    /// found them in older snapshots only, after a run stopped past its rewrite). A reader
    /// pinned to an earlier snapshot still sees them.
    pub events_snapshot_id: Option<i64>,
    /// The sequence number of a snapshot of `events` from which on none holds the
    /// erased events: of the rewrite, or of the current snapshot when they were in older
    /// snapshots only. (Unknown in records made before it was kept.)
    pub events_sequence: Option<i64>,
    /// Whether it has run to its end: then every snapshot before its rewrite has expired,
    /// held or not.
    pub completed: bool,
}

/// What one table lost.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct TableErasure {
    /// Table name.
    pub table: String,
    /// Rows removed.
    pub rows: u64,
    /// Data files rewritten.
    pub files_rewritten: usize,
    /// The overwrite snapshot, when rows were removed.
    pub snapshot_id: Option<i64>,
}

/// What an erasure did and what it leaves to recompute.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ErasureReport {
    /// Id of the record in `sw_erasures`.
    pub erasure_id: String,
    /// Per table.
    pub tables: Vec<TableErasure>,
    /// Snapshots expired so that no snapshot references the old files.
    pub snapshots_expired: usize,
    /// Old data files deleted.
    pub data_files_deleted: usize,
    /// Event-time range of the erased events (µs), for a backfill of derived outputs.
    pub event_time_range: Option<(i64, i64)>,
    /// Markets whose aggregates included erased events.
    pub markets: BTreeSet<String>,
    /// Event types of the erased events.
    pub event_types: BTreeSet<String>,
    /// What was not examined, and why: an output table no job spec given writes (or one
    /// this build cannot read); the caller adds stores of its own (the effect ledger's
    /// jobs without a spec).
    pub outputs_unknown: BTreeSet<String>,
    /// Job versions whose rows were left in an examined output table: no spec given
    /// tells their key (`job vN in table`).
    pub versions_unknown: BTreeSet<String>,
    /// Until when (event time, µs) the subject's erased windows may still change: a
    /// running job that held their state writes further versions of them until its
    /// watermark passes this, so erase again once it has.
    pub outputs_open_until_us: Option<i64>,
}

/// `range` widened to hold `t`.
fn widen(range: &mut Option<(i64, i64)>, t: i64) {
    *range = Some(range.map_or((t, t), |(lo, hi)| (lo.min(t), hi.max(t))));
}

fn column<'a>(b: &'a RecordBatch, name: &str) -> Result<&'a arrow::array::StringArray> {
    b.column_by_name(name)
        .and_then(|c| c.as_string_opt::<i32>())
        .ok_or_else(|| LakeError::new(ErrorKind::Internal, format!("column {name} is missing")))
}

impl Lake {
    /// Erases a data subject; see the module docs.
    pub async fn erase_customer(&self, request: &ErasureRequest) -> Result<ErasureReport> {
        if request.customer_id.is_empty() || request.reason.trim().is_empty() {
            return Err(LakeError::new(
                ErrorKind::InvalidInput,
                "an erasure needs a customer id and a reason",
            ));
        }
        let erasure_id = format!("erase-{}", uuid::Uuid::new_v4().simple());
        let began_ms = chrono::Utc::now().timestamp_millis();
        let mut report = ErasureReport {
            erasure_id: erasure_id.clone(),
            ..Default::default()
        };
        // Events first: their identities tell which late and rejected rows go too.
        let customer = request.customer_id.clone();
        let tenant = request.tenant.clone();
        let mut identities: HashSet<(String, String)> = HashSet::new();
        let (events, erased) = self
            .rewrite_without(LakeTable::Events, &erasure_id, |b| {
                let c = column(b, "customer_id")?;
                let t = column(b, "tenant")?;
                Ok((0..b.num_rows())
                    .map(|i| {
                        let theirs = c.is_valid(i)
                            && c.value(i) == customer
                            && tenant.as_deref().is_none_or(|want| t.value(i) == want);
                        Some(!theirs)
                    })
                    .collect())
            })
            .await?;
        for b in &erased {
            let ids = column(b, "event_id")?;
            let tenants = column(b, "tenant")?;
            let markets = column(b, "market_id")?;
            let types = column(b, "event_type")?;
            let times = b
                .column_by_name("event_time")
                .and_then(|c| c.as_primitive_opt::<TimestampMicrosecondType>());
            for i in 0..b.num_rows() {
                identities.insert((tenants.value(i).to_string(), ids.value(i).to_string()));
                if markets.is_valid(i) {
                    report.markets.insert(markets.value(i).to_string());
                }
                report.event_types.insert(types.value(i).to_string());
                if let Some(t) = times {
                    widen(&mut report.event_time_range, t.value(i));
                }
            }
        }
        // The subject may still be in the files of older snapshots only: an erasure killed
        // after its rewrite and before its expiry left them. Their rows name identities
        // too, and their presence makes the expiry below necessary.
        // Tables whose older snapshots hold the subject, the current one aside.
        let mut in_history: HashSet<String> = HashSet::new();
        for b in self
            .history_rows(LakeTable::Events, |b| {
                let c = column(b, "customer_id")?;
                let t = column(b, "tenant")?;
                Ok((0..b.num_rows())
                    .map(|i| {
                        c.is_valid(i)
                            && c.value(i) == customer
                            && tenant.as_deref().is_none_or(|want| t.value(i) == want)
                    })
                    .collect())
            })
            .await?
        {
            in_history.extend(
                [
                    LakeTable::Events,
                    LakeTable::LateEvents,
                    LakeTable::Rejections,
                ]
                .map(|t| t.name().to_string()),
            );
            let ids = column(&b, "event_id")?;
            let tenants = column(&b, "tenant")?;
            // A run stopped after the events' rewrite left their times only here.
            let times = b
                .column_by_name("event_time")
                .and_then(|c| c.as_primitive_opt::<TimestampMicrosecondType>());
            for i in 0..b.num_rows() {
                identities.insert((tenants.value(i).to_string(), ids.value(i).to_string()));
                if let Some(t) = times {
                    widen(&mut report.event_time_range, t.value(i));
                }
            }
        }
        // From which snapshot on the events are gone (its id and sequence number): the
        // rewrite, or (found in older snapshots only) the current one. A failed read
        // leaves it unknown: readers then judge by the rewrite itself.
        let events_from: Option<(i64, i64)> = match self.table(LakeTable::Events).await {
            Ok(t) => {
                let md = t.metadata();
                events
                    .snapshot_id
                    .and_then(|id| md.snapshot_by_id(id))
                    .or_else(|| md.current_snapshot())
                    .map(|s| (s.snapshot_id(), s.sequence_number()))
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not read where the erased events end");
                None
            }
        };
        let events_sequence = events_from.map(|(_, sequence)| sequence);
        report.tables.push(events);
        // Recorded as soon as the events are gone, with their event times: from then on a
        // running job leaves the subject's windows over them out of what it commits, and
        // what it committed before is rewritten below. The counts are completed at the end.
        let recorded_early = report.event_time_range.is_some();
        if recorded_early {
            self.record_erasure(request, &report, events_sequence, false)
                .await?;
        }
        // A late row names its event, and its window's key: a job that read the subject's
        // events before the rewrite may commit their late rows after it, when the events
        // that would name them are gone.
        let keyed: Vec<&KeyLayout> = request
            .outputs
            .iter()
            .filter(|l| l.customer.is_some())
            .collect();
        for table in [LakeTable::LateEvents, LakeTable::Rejections] {
            let ids = &identities;
            let (t, _) = self
                .rewrite_without(table, &erasure_id, |b| {
                    let e = column(b, "event_id")?;
                    let t = column(b, "tenant")?;
                    let keys = match table {
                        LakeTable::LateEvents => Some((column(b, "job")?, column(b, "key")?)),
                        _ => None,
                    };
                    Ok((0..b.num_rows())
                        .map(|i| {
                            let named = e.is_valid(i)
                                && t.is_valid(i)
                                && ids.contains(&(t.value(i).to_string(), e.value(i).to_string()));
                            let keyed_by = keys.is_some_and(|(jobs, keys)| {
                                keys.is_valid(i)
                                    && keyed.iter().any(|l| {
                                        l.job == jobs.value(i)
                                            && request.names_subject(l, keys.value(i))
                                    })
                            });
                            Some(!(named || keyed_by))
                        })
                        .collect())
                })
                .await?;
            report.tables.push(t);
        }
        self.erase_outputs(request, &erasure_id, &mut report, &mut in_history)
            .await?;
        // The windows of the erased events, emitted or not yet (a running job fires them
        // later), change until their end plus the lateness.
        if let Some((_, newest)) = report.event_time_range {
            for l in &keyed {
                let open = newest
                    .saturating_add(l.span_us)
                    .saturating_add(l.lateness_us);
                report.outputs_open_until_us =
                    Some(report.outputs_open_until_us.map_or(open, |o| o.max(open)));
            }
        }
        if std::env::var("SIGNALWEAVE_ERASE_FAULT").as_deref() == Ok("before_expiry") {
            eprintln!("fault drill: stopping after the rewrite, before the expiry");
            std::process::abort();
        }
        // Expire every snapshot before the erasure, whatever holds it, and delete the
        // files only they referenced: the old files with the subject's values.
        for t in &report.tables {
            if t.snapshot_id.is_none() && !in_history.contains(&t.table) {
                continue;
            }
            let table = LakeTable::from_name(&t.table)?;
            let policy = MaintenancePolicy {
                min_manifests_to_merge: usize::MAX,
                retention: Some(Retention {
                    keep_last: 1,
                    max_age_ms: 0,
                }),
                override_holds: true,
                // The erasure's own snapshot and those after it reference none of the old
                // files: readers caught up at it, or after it, go on.
                // Found in older snapshots only, the events end at the snapshot current
                // then: a reader pinned at it goes on too.
                keep_from: t.snapshot_id.or_else(|| {
                    (t.table == LakeTable::Events.name())
                        .then_some(events_from.map(|(id, _)| id))
                        .flatten()
                }),
                ..Default::default()
            };
            let r = self.maintain(table, &policy).await?;
            report.snapshots_expired += r.snapshots_expired;
            report.data_files_deleted += r.deleted.data_files;
        }
        if recorded_early {
            self.amend_erasure(&report).await?;
        } else {
            self.record_erasure(request, &report, events_sequence, true)
                .await?;
        }
        self.complete_earlier_runs(request, &report.erasure_id, began_ms)
            .await;
        Ok(report)
    }

    /// Removes every version of the subject's windows from the output tables whose key
    /// names a customer, in every namespace; see the module docs.
    async fn erase_outputs(
        &self,
        request: &ErasureRequest,
        erasure_id: &str,
        report: &mut ErasureReport,
        in_history: &mut HashSet<String>,
    ) -> Result<()> {
        let tables = self.register_output_tables().await?;
        let ns = iceberg::NamespaceIdent::new(crate::layout::NAMESPACE.to_string());
        let all = self
            .catalog()
            .list_tables(&ns)
            .await
            .map_err(|e| LakeError::iceberg("list tables", e))?;
        for ident in all {
            let name = ident.name();
            if LakeTable::ALL.iter().all(|t| t.name() != name)
                && tables.iter().all(|t| t.name() != name)
            {
                report
                    .outputs_unknown
                    .insert(format!("{name} (not an output table this build reads)"));
            }
        }
        for table in tables {
            let name = table.name();
            let layouts: Vec<&KeyLayout> =
                request.outputs.iter().filter(|l| l.writes(name)).collect();
            if layouts.is_empty() {
                report.outputs_unknown.insert(name.to_string());
                continue;
            }
            if layouts.iter().all(|l| l.customer.is_none()) {
                continue;
            }
            let unknown = std::sync::Mutex::new(BTreeSet::new());
            // Per row: the layout of its job version, when it names the subject.
            let theirs = |b: &RecordBatch| -> Result<Vec<Option<&KeyLayout>>> {
                let (jobs, keys) = (column(b, "job")?, column(b, "key")?);
                let versions = b
                    .column_by_name("job_version")
                    .and_then(|c| c.as_primitive_opt::<Int64Type>())
                    .ok_or_else(|| {
                        LakeError::new(ErrorKind::Internal, "column job_version is missing")
                    })?;
                Ok((0..b.num_rows())
                    .map(|i| {
                        let (job, version) = (jobs.value(i), versions.value(i));
                        let layout = layouts
                            .iter()
                            .find(|l| l.job == job && l.job_version == version);
                        match layout {
                            Some(l) => request.names_subject(l, keys.value(i)).then_some(*l),
                            None => {
                                if let Ok(mut u) = unknown.lock() {
                                    u.insert(format!("{job} v{version} in {name}"));
                                }
                                None
                            }
                        }
                    })
                    .collect())
            };
            let (t, erased) = self
                .rewrite_without(table, erasure_id, |b| {
                    Ok(theirs(b)?.iter().map(|l| Some(l.is_none())).collect())
                })
                .await?;
            for b in &erased {
                let ends = b
                    .column_by_name("window_end")
                    .and_then(|c| c.as_primitive_opt::<TimestampMicrosecondType>());
                let rows = theirs(b)?;
                for (i, layout) in rows.iter().enumerate() {
                    if let (Some(ends), Some(l)) = (ends, layout) {
                        let open = ends.value(i).saturating_add(l.lateness_us);
                        report.outputs_open_until_us =
                            Some(report.outputs_open_until_us.map_or(open, |o| o.max(open)));
                    }
                }
            }
            let older = self
                .history_rows(table, |b| {
                    Ok(theirs(b)?.iter().map(Option::is_some).collect())
                })
                .await?;
            if !older.is_empty() {
                in_history.insert(name.to_string());
            }
            report
                .versions_unknown
                .extend(unknown.into_inner().unwrap_or_default());
            report.tables.push(t);
        }
        Ok(())
    }

    /// Rewrites every data file of `table` holding a row `keep` rejects, without those
    /// rows, in one overwrite commit. Returns the removed rows.
    ///
    /// Appends go on meanwhile (the gateway commits every second), so a lost race does not
    /// start over: the files already read stay read, the rows already rewritten stay
    /// written, and only the files appended since are read before the next try. Only when
    /// a file it would replace is gone (a compaction replaced it) does it start over.
    async fn rewrite_without(
        &self,
        table: LakeTable,
        erasure_id: &str,
        keep: impl Fn(&RecordBatch) -> Result<BooleanArray>,
    ) -> Result<(TableErasure, Vec<RecordBatch>)> {
        let mut out = TableErasure {
            table: table.name().to_string(),
            ..Default::default()
        };
        let mut examined: HashSet<String> = HashSet::new();
        let mut removed: HashSet<String> = HashSet::new();
        let mut bytes_removed = 0u64;
        let mut rows_removed_files = 0u64;
        // The rows each file hit keeps, with its data sequence number, not written yet.
        let mut pending: Vec<(i64, bool, Vec<crate::lineage::Lineaged>)> = Vec::new();
        let mut added: Vec<DataFile> = Vec::new();
        let mut erased: Vec<RecordBatch> = Vec::new();
        let mut writes = 0u64;
        let io = self.table(table).await?.file_io().clone();
        // What a try wrote and no commit took: the rewritten files and the manifests.
        async fn discard(io: &iceberg::io::FileIO, added: &[DataFile], prep: &mut PreparedReplace) {
            if prep.outcome_unknown() {
                return;
            }
            prep.discard(io).await;
            for f in added {
                let _ = io.delete(f.file_path()).await;
            }
        }
        let mut prep = PreparedReplace::default();
        // Whatever ends the tries but a commit leaves nothing of theirs behind.
        let outcome = async {
            for _ in 0..CONFLICT_ATTEMPTS {
                let base = self.table(table).await?;
                let md = base.metadata();
                let Some(current) = md.current_snapshot() else {
                    return Ok((out, Vec::new()));
                };
                // The manifests read on an earlier try are not read again: a lost race costs
                // the manifests appended since.
                let files = prep.live_files(&base, current).await?;
                let live: HashSet<&str> = files.iter().map(|(f, _)| f.file_path()).collect();
                if removed.iter().any(|p| !live.contains(p.as_str())) {
                    // A file to replace was replaced by someone else: start over.
                    discard(&io, &added, &mut prep).await;
                    examined.clear();
                    removed.clear();
                    (bytes_removed, rows_removed_files) = (0, 0);
                    pending.clear();
                    added.clear();
                    erased.clear();
                }
                let unexamined: Vec<(DataFile, i64)> = files
                    .iter()
                    .filter(|(f, _)| examined.insert(f.file_path().to_string()))
                    .cloned()
                    .collect();
                for (file, sequence) in unexamined {
                    let path = file.file_path().to_string();
                    let size = file.file_size_in_bytes();
                    // Each row with its lineage, which the rewrite keeps (see
                    // `crate::lineage`).
                    let batches = self.read_lineaged(&base, table, &file, sequence).await?;
                    let mut file_kept = Vec::new();
                    let mut hit = false;
                    let mut rows = 0u64;
                    for (b, lineage) in &batches {
                        rows += b.num_rows() as u64;
                        let mask = keep(b)?;
                        let gone = arrow::compute::not(&mask)
                            .map_err(|e| LakeError::arrow("erasure mask", e))?;
                        let dropped = arrow::compute::filter_record_batch(b, &gone)
                            .map_err(|e| LakeError::arrow("erasure filter", e))?;
                        if dropped.num_rows() > 0 {
                            hit = true;
                            erased.push(dropped);
                        }
                        file_kept.push((
                            arrow::compute::filter_record_batch(b, &mask)
                                .map_err(|e| LakeError::arrow("erasure filter", e))?,
                            arrow::compute::filter(lineage.as_ref(), &mask)
                                .map_err(|e| LakeError::arrow("erasure filter", e))?,
                        ));
                    }
                    if hit {
                        removed.insert(path);
                        bytes_removed += size;
                        rows_removed_files += rows;
                        file_kept.retain(|(b, _)| b.num_rows() > 0);
                        if !file_kept.is_empty() {
                            pending.push((sequence, has_lineage(&file), file_kept));
                        }
                    }
                }
                if removed.is_empty() {
                    return Ok((out, Vec::new()));
                }
                // Each file's rows in files of their own, which keep its data sequence
                // number: the rows stay where they were in the order of arrival. A file
                // that held the rows of many commits (a compacted one) keeps each row's in
                // its lineage column; another stays a file of one commit, whose statistics
                // tell its arrival without reading it.
                for (sequence, lineaged, batches) in pending.drain(..) {
                    let identity =
                        CommitIdentity::new(format!("{erasure_id}-{}", table.name()), writes);
                    writes += 1;
                    let mut w = if lineaged {
                        self.lineage_writer(table, &identity).await?
                    } else {
                        self.append_writer(table, &identity).await?
                    };
                    for (b, lineage) in &batches {
                        if lineaged {
                            w.write_lineaged(b, lineage).await?;
                        } else {
                            w.write(b).await?;
                        }
                    }
                    let files = w.finish().await?.into_files();
                    for f in &files {
                        prep.keep_sequence(f.file_path(), sequence);
                    }
                    added.extend(files);
                }
                let rows_kept: u64 = added.iter().map(|f| f.record_count()).sum();
                let stats = RewriteStats {
                    operation: if added.is_empty() {
                        Operation::Delete
                    } else {
                        Operation::Overwrite
                    },
                    files_added: added.len(),
                    files_removed: removed.len(),
                    bytes_added: added.iter().map(|f| f.file_size_in_bytes()).sum(),
                    bytes_removed,
                    rows_added: rows_kept,
                    rows_removed: rows_removed_files,
                };
                match self
                    .commit_replace(table, &base, &removed, &added, &stats, &mut prep)
                    .await
                {
                    Ok(id) => {
                        out.rows = rows_removed_files - rows_kept;
                        out.files_rewritten = removed.len();
                        out.snapshot_id = Some(id);
                        return Ok((out, erased));
                    }
                    // Lost the race to an append: read what it added, then try again.
                    Err(e) if e.kind() == ErrorKind::Conflict => {
                        tracing::debug!(table = table.name(), "erasure lost a race; rebasing");
                    }
                    Err(e) => return Err(e),
                }
            }
            Err(LakeError::new(
                ErrorKind::Conflict,
                format!(
                    "{}: erasure lost {CONFLICT_ATTEMPTS} races in a row",
                    table.name()
                ),
            ))
        }
        .await;
        if outcome.is_err() {
            discard(&io, &added, &mut prep).await;
        }
        outcome
    }

    /// The rows `hit` selects in the data files that only older retained snapshots of
    /// `table` reference (not the current one).
    async fn history_rows(
        &self,
        table: LakeTable,
        hit: impl Fn(&RecordBatch) -> Result<Vec<bool>>,
    ) -> Result<Vec<RecordBatch>> {
        let t = self.table(table).await?;
        let md = t.metadata();
        let Some(newest) = md.current_snapshot() else {
            return Ok(Vec::new());
        };
        // Each manifest read once, however many snapshots list it.
        let mut reads = ManifestReads::default();
        let current: HashSet<String> = reads
            .live_files(&t, newest)
            .await?
            .iter()
            .map(|(f, _)| f.file_path().to_string())
            .collect();
        let (mut manifests_seen, mut seen) = (HashSet::new(), HashSet::new());
        let mut files = Vec::new();
        for snap in md.snapshots() {
            if snap.snapshot_id() == newest.snapshot_id() {
                continue;
            }
            for (m, manifest) in reads.data_manifests(&t, snap).await? {
                if !manifests_seen.insert(m.manifest_path) {
                    continue;
                }
                for e in manifest.entries().iter().filter(|e| e.is_alive()) {
                    let path = e.file_path();
                    if !current.contains(path) && seen.insert(path.to_string()) {
                        files.push(e.data_file().clone());
                    }
                }
            }
        }
        let schema = md.current_schema().clone();
        let field_ids: Vec<i32> = schema.as_struct().fields().iter().map(|f| f.id).collect();
        let spec = Some(md.default_partition_spec().clone());
        let tasks: Vec<_> = files
            .iter()
            .map(|f| whole_file_task(f, &schema, &field_ids, spec.clone()))
            .collect();
        let mut out = Vec::new();
        for task in tasks {
            for b in on_table_schema(table, self.read_all(table, vec![task]).await?)? {
                let mask = BooleanArray::from(hit(&b)?);
                let rows = arrow::compute::filter_record_batch(&b, &mask)
                    .map_err(|e| LakeError::new(ErrorKind::Internal, format!("filter: {e}")))?;
                if rows.num_rows() > 0 {
                    out.push(rows);
                }
            }
        }
        Ok(out)
    }

    /// Records what `report` now holds of its erasure: the counts of stores outside the
    /// lake (the effect ledger) are added to it after the lake's erasure is recorded.
    pub async fn amend_erasure(&self, report: &ErasureReport) -> Result<()> {
        let counts = serde_json::to_string(&report.tables).unwrap_or_default();
        let done = sqlx::query(&self.control_sql(
            "UPDATE sw_erasures SET tables_json = $1, completed_ms = $2 \
             WHERE erasure_id = $3 AND catalog_name = $4",
        ))
        .bind(counts)
        .bind(chrono::Utc::now().timestamp_millis())
        .bind(report.erasure_id.as_str())
        .bind(self.config().catalog_name.as_str())
        .execute(self.control_pool())
        .await
        .map_err(|e| LakeError::sql("amend the erasure record", e))?;
        if done.rows_affected() != 1 {
            return Err(LakeError::new(
                ErrorKind::NotFound,
                format!("no erasure {} is recorded", report.erasure_id),
            ));
        }
        Ok(())
    }

    /// Marks complete the runs of `request`'s erasure begun before `began_ms` (the same
    /// subject, or, unscoped, the same customer id in any tenant) that stopped before
    /// their end: `erasure_id`, run to its end, did what they left, and its expiry took
    /// every snapshot before their rewrites. (Readers judge a complete erasure by that.)
    /// A run begun since may still be going, and is left. A failure is logged: the
    /// erasure itself is done.
    async fn complete_earlier_runs(
        &self,
        request: &ErasureRequest,
        erasure_id: &str,
        began_ms: i64,
    ) {
        let (matching, digest) = match &request.tenant {
            Some(t) => (
                "subject_sha256 = $3",
                subject_digest(&request.customer_id, Some(t)),
            ),
            None => (
                "(subject_sha256 = $3 OR customer_sha256 = $3)",
                subject_digest(&request.customer_id, None),
            ),
        };
        let done = sqlx::query(&self.control_sql(&format!(
            "UPDATE sw_erasures SET completed_ms = $1 WHERE catalog_name = $2 AND {matching} \
             AND completed_ms IS NULL AND erasure_id <> $4 AND erased_ms < $5"
        )))
        .bind(chrono::Utc::now().timestamp_millis())
        .bind(self.config().catalog_name.as_str())
        .bind(digest)
        .bind(erasure_id)
        .bind(began_ms)
        .execute(self.control_pool())
        .await;
        if let Err(e) = done {
            tracing::warn!(error = %e, "could not mark the earlier runs of the erasure complete");
        }
    }

    /// Records the erasure; `completed`: it is done (else [`Lake::amend_erasure`] marks
    /// it so).
    async fn record_erasure(
        &self,
        request: &ErasureRequest,
        report: &ErasureReport,
        events_sequence: Option<i64>,
        completed: bool,
    ) -> Result<()> {
        let now = chrono::Utc::now().timestamp_millis();
        let subject = subject_digest(&request.customer_id, request.tenant.as_deref());
        let counts = serde_json::to_string(&report.tables).unwrap_or_default();
        let (from, to) = report.event_time_range.unzip();
        sqlx::query(&self.control_sql(
            "INSERT INTO sw_erasures (erasure_id, catalog_name, subject_sha256, reason, \
             requested_by, erased_ms, tables_json, event_from_us, event_to_us, completed_ms, \
             customer_sha256, events_sequence) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
        ))
        .bind(report.erasure_id.as_str())
        .bind(self.config().catalog_name.as_str())
        .bind(subject)
        .bind(request.reason.as_str())
        .bind(request.requested_by.as_str())
        .bind(now)
        .bind(counts)
        .bind(from)
        .bind(to)
        .bind(completed.then_some(now))
        // A job keyed by customer id alone mixes the tenants' customers of that id: its
        // windows are the subject's whatever the tenant (see `names_subject`).
        .bind(subject_digest(&request.customer_id, None))
        .bind(events_sequence)
        .execute(self.control_pool())
        .await
        .map_err(|e| LakeError::sql("record the erasure", e))?;
        Ok(())
    }

    /// The erasures recorded after `after_ms` whose events had event times: a running job
    /// leaves their subjects' windows over those times out of what it commits. (Times are
    /// the erasing host's clock: a reader asks from a margin before the newest it read.)
    pub async fn erasures_after(&self, after_ms: i64) -> Result<Vec<ErasureNotice>> {
        let rows: Vec<ErasureRow> = sqlx::query_as(&self.control_sql(&format!(
            "SELECT {ERASURE_COLUMNS} FROM sw_erasures WHERE catalog_name = $1 \
             AND erased_ms > $2 AND event_from_us IS NOT NULL AND event_to_us IS NOT NULL \
             ORDER BY erased_ms"
        )))
        .bind(self.config().catalog_name.as_str())
        .bind(after_ms)
        .fetch_all(self.control_pool())
        .await
        .map_err(|e| LakeError::sql("read the erasures", e))?;
        Ok(rows.into_iter().filter_map(notice).collect())
    }

    /// The ids of the erasures whose events had event times: a reader that keeps the
    /// notices it read learns whether one is new, whatever the hosts' clocks.
    pub async fn erasure_ids(&self) -> Result<Vec<String>> {
        sqlx::query_scalar(&self.control_sql(
            "SELECT erasure_id FROM sw_erasures WHERE catalog_name = $1 \
             AND event_from_us IS NOT NULL AND event_to_us IS NOT NULL",
        ))
        .bind(self.config().catalog_name.as_str())
        .fetch_all(self.control_pool())
        .await
        .map_err(|e| LakeError::sql("list the erasures", e))
    }
}

/// The columns of `sw_erasures` a notice is read from, in [`ErasureRow`]'s order.
const ERASURE_COLUMNS: &str = "erasure_id, subject_sha256, erased_ms, event_from_us, \
    event_to_us, customer_sha256, tables_json, completed_ms, events_sequence";

/// Id, subject, time, the event times (unknown when no event was erased), the customer
/// id's digest alone (unknown in records made before it was kept), what each table lost,
/// when it completed, and the sequence number from which the events are gone.
type ErasureRow = (
    String,
    String,
    i64,
    Option<i64>,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<i64>,
);

/// The notice of a row; None when no event was erased.
fn notice(row: ErasureRow) -> Option<ErasureNotice> {
    let (erasure_id, subject_sha256, erased_ms, from, to, customer, tables, completed, sequence) =
        row;
    Some(ErasureNotice {
        erasure_id,
        customer_sha256: customer.unwrap_or_else(|| subject_sha256.clone()),
        subject_sha256,
        erased_ms,
        event_from_us: from?,
        event_to_us: to?,
        events_snapshot_id: tables.as_deref().and_then(events_snapshot),
        events_sequence: sequence,
        completed: completed.is_some(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(columns: &[&str]) -> KeyLayout {
        let at = |name: &str| columns.iter().position(|c| *c == name);
        KeyLayout {
            job: "customer_features".into(),
            job_version: 2,
            output_table: "customer_features".into(),
            parts: columns.len(),
            customer: at("customer_id"),
            tenant: at("tenant"),
            lateness_us: 0,
            span_us: 0,
        }
    }

    #[test]
    fn a_record_names_the_snapshot_that_removed_the_events() {
        let report = ErasureReport {
            tables: vec![
                TableErasure {
                    table: "late_events".into(),
                    snapshot_id: Some(7),
                    ..Default::default()
                },
                TableErasure {
                    table: "events".into(),
                    rows: 3,
                    files_rewritten: 1,
                    snapshot_id: Some(42),
                },
            ],
            ..Default::default()
        };
        let json = serde_json::to_string(&report.tables).unwrap();
        assert_eq!(events_snapshot(&json), Some(42));
        // Found in older snapshots only, by a run after one stopped past its rewrite.
        let none = r#"[{"table":"events","rows":0,"files_rewritten":0,"snapshot_id":null}]"#;
        assert_eq!(events_snapshot(none), None);
        assert_eq!(events_snapshot("[]"), None);
        assert_eq!(events_snapshot("not json"), None);
    }

    #[test]
    fn a_key_names_the_subject_by_its_layout() {
        let scoped = ErasureRequest {
            customer_id: "c|7".into(),
            tenant: Some("t-0".into()),
            ..Default::default()
        };
        let everywhere = ErasureRequest {
            tenant: None,
            ..scoped.clone()
        };
        let by_tenant = layout(&["tenant", "customer_id"]);
        let key = |values: &[&str]| signalweave_model::join_key(values);
        assert!(scoped.names_subject(&by_tenant, &key(&["t-0", "c|7"])));
        assert!(!scoped.names_subject(&by_tenant, &key(&["t-1", "c|7"])));
        assert!(everywhere.names_subject(&by_tenant, &key(&["t-1", "c|7"])));
        // "c|7" is not the key of customer "c" and "7".
        assert!(!scoped.names_subject(&by_tenant, "t-0|c|7"));
        assert!(!scoped.names_subject(&by_tenant, &key(&["t-0", "c"])));
        // Keyed by customer alone, the key mixes tenants: it is the subject's in any.
        let alone = layout(&["customer_id"]);
        assert!(scoped.names_subject(&alone, &key(&["c|7"])));
        // As the engine writes a key of one column: its value as it is.
        assert!(scoped.names_subject(&alone, "c|7"));
        assert!(!scoped.names_subject(&alone, "c\\|7"));
        assert!(!scoped.names_subject(&layout(&["market_id"]), &key(&["c|7"])));
        assert!(by_tenant.writes("customer_features"));
        assert!(by_tenant.writes("customer_features__bf_fix"));
        assert!(by_tenant.writes("customer_features__eu"));
        assert!(!by_tenant.writes("customer_features_v2"));
    }
}
