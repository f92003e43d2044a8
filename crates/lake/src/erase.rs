//! Erasure of a data subject: the customer's events are removed from `events`, and the
//! rows that identify those events from `late_events` and `rejections`, by rewriting the
//! affected data files (an `overwrite` snapshot on the project's own commit path). The
//! snapshots that still reference the old files are then expired, whatever holds them,
//! and the old files deleted, so the values are gone from storage, not only from the
//! current snapshot. `sw_erasures` records what was erased, when, why and by whom, with
//! counts and a SHA-256 of the subject, never the erased values. The report names the
//! event-time range and keys whose derived outputs must be recomputed by a backfill.

use std::collections::{BTreeSet, HashSet};

use arrow::array::{Array, AsArray, BooleanArray};
use arrow::datatypes::TimestampMicrosecondType;
use arrow_array::RecordBatch;
use iceberg::spec::{DataFile, Operation};
use serde::Serialize;
use sha2::{Digest, Sha256};
use signalweave_model::ErrorKind;

use crate::compact::{CONFLICT_ATTEMPTS, ManifestReads, PreparedReplace, RewriteStats};
use crate::error::{LakeError, Result};
use crate::lake::{CommitIdentity, Lake, on_table_schema, whole_file_task};
use crate::layout::LakeTable;
use crate::maintain::{MaintenancePolicy, Retention};

/// Who is erased, why, and on whose request.
#[derive(Debug, Clone)]
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
                    let v = t.value(i);
                    report.event_time_range = Some(match report.event_time_range {
                        None => (v, v),
                        Some((lo, hi)) => (lo.min(v), hi.max(v)),
                    });
                }
            }
        }
        // The subject may still be in the files of older snapshots only: an erasure killed
        // after its rewrite and before its expiry left them. Their rows name identities
        // too, and their presence makes the expiry below necessary.
        let mut in_history = false;
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
            in_history = true;
            let ids = column(&b, "event_id")?;
            let tenants = column(&b, "tenant")?;
            for i in 0..b.num_rows() {
                identities.insert((tenants.value(i).to_string(), ids.value(i).to_string()));
            }
        }
        report.tables.push(events);
        for table in [LakeTable::LateEvents, LakeTable::Rejections] {
            let ids = &identities;
            let (t, _) = self
                .rewrite_without(table, &erasure_id, |b| {
                    let e = column(b, "event_id")?;
                    let t = column(b, "tenant")?;
                    Ok((0..b.num_rows())
                        .map(|i| {
                            let hit = e.is_valid(i)
                                && t.is_valid(i)
                                && ids.contains(&(t.value(i).to_string(), e.value(i).to_string()));
                            Some(!hit)
                        })
                        .collect())
                })
                .await?;
            report.tables.push(t);
        }
        if std::env::var("SIGNALWEAVE_ERASE_FAULT").as_deref() == Ok("before_expiry") {
            eprintln!("fault drill: stopping after the rewrite, before the expiry");
            std::process::abort();
        }
        // Expire every snapshot before the erasure, whatever holds it, and delete the
        // files only they referenced: the old files with the subject's values.
        for t in &report.tables {
            if t.snapshot_id.is_none() && !in_history {
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
                ..Default::default()
            };
            let r = self.maintain(table, &policy).await?;
            report.snapshots_expired += r.snapshots_expired;
            report.data_files_deleted += r.deleted.data_files;
        }
        self.record_erasure(request, &report).await?;
        Ok(report)
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
        let mut pending: Vec<RecordBatch> = Vec::new();
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
                let live: HashSet<&str> = files.iter().map(|f| f.file_path()).collect();
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
                let schema = md.current_schema().clone();
                let field_ids: Vec<i32> =
                    schema.as_struct().fields().iter().map(|f| f.id).collect();
                let spec = Some(md.default_partition_spec().clone());
                let tasks: Vec<_> = files
                    .iter()
                    .filter(|f| examined.insert(f.file_path().to_string()))
                    .map(|f| whole_file_task(f, &schema, &field_ids, spec.clone()))
                    .collect();
                for task in tasks {
                    let path = task.data_file_path.clone();
                    let size = task.file_size_in_bytes;
                    let batches = on_table_schema(table, self.read_all(table, vec![task]).await?)?;
                    let mut file_kept = Vec::new();
                    let mut hit = false;
                    let mut rows = 0u64;
                    for b in &batches {
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
                        file_kept.push(
                            arrow::compute::filter_record_batch(b, &mask)
                                .map_err(|e| LakeError::arrow("erasure filter", e))?,
                        );
                    }
                    if hit {
                        removed.insert(path);
                        bytes_removed += size;
                        rows_removed_files += rows;
                        pending.extend(file_kept.into_iter().filter(|b| b.num_rows() > 0));
                    }
                }
                if removed.is_empty() {
                    return Ok((out, Vec::new()));
                }
                if !pending.is_empty() {
                    let identity =
                        CommitIdentity::new(format!("{erasure_id}-{}", table.name()), writes);
                    writes += 1;
                    let mut w = self.append_writer(table, &identity).await?;
                    for b in &pending {
                        w.write(b).await?;
                    }
                    added.extend(w.finish().await?.into_files());
                    pending.clear();
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
            .map(|f| f.file_path().to_string())
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

    async fn record_erasure(&self, request: &ErasureRequest, report: &ErasureReport) -> Result<()> {
        // The subject: its customer id, within its tenant when the erasure was scoped.
        let subject = match &request.tenant {
            Some(t) => hex::encode(Sha256::digest(
                format!("{t}\u{0}{}", request.customer_id).as_bytes(),
            )),
            None => hex::encode(Sha256::digest(request.customer_id.as_bytes())),
        };
        let counts = serde_json::to_string(&report.tables).unwrap_or_default();
        let sql = if self.config().is_sqlite() {
            "INSERT INTO sw_erasures (erasure_id, catalog_name, subject_sha256, reason, requested_by, erased_ms, tables_json) VALUES (?, ?, ?, ?, ?, ?, ?)"
        } else {
            "INSERT INTO sw_erasures (erasure_id, catalog_name, subject_sha256, reason, requested_by, erased_ms, tables_json) VALUES ($1, $2, $3, $4, $5, $6, $7)"
        };
        sqlx::query(sql)
            .bind(report.erasure_id.as_str())
            .bind(self.config().catalog_name.as_str())
            .bind(subject)
            .bind(request.reason.as_str())
            .bind(request.requested_by.as_str())
            .bind(chrono::Utc::now().timestamp_millis())
            .bind(counts)
            .execute(self.control_pool())
            .await
            .map_err(|e| LakeError::sql("record the erasure", e))?;
        Ok(())
    }
}
