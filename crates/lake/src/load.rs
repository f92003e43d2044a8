//! Bulk loading: NDJSON or Parquet files of wire-form events, through the validator the
//! gateway uses, into `signalweave.events`, with evidence of every rejection in
//! `signalweave.rejections`.
//!
//! A file is cut into chunks of [`LoadOptions::chunk_records`] records. Chunk `i` commits
//! its rejections, then its events, each as one append identified by
//! (`load-<file digest>`, `i`). A load killed at any point leaves whole chunks committed
//! and nothing partial; running it again skips the committed chunks, so nothing lands
//! twice, however long ago the first run was: the load is recorded in `sw_loads` (its
//! chunk geometry and validation clock), and its chunk identities outlive the snapshots
//! that carried them. Within a file, a repeated `(tenant, event_id)` is counted as a
//! duplicate and lands once.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::sync::Arc;

use arrow_array::builder::{Int64Builder, StringBuilder, TimestampMicrosecondBuilder};
use arrow_array::{Array, ArrayRef, RecordBatch};
use serde::Serialize;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use signalweave_model::{
    ErrorKind, EventBatchBuilder, EventValidator, ReasonCode, Rejection, format_rfc3339_micros,
};

use crate::error::{LakeError, Result};
use crate::lake::{CommitIdentity, Lake};
use crate::layout::{LakeTable, REJECTIONS_SCHEMA};

/// Options of a load.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Records per chunk (one commit each to events and, if needed, rejections).
    pub chunk_records: usize,
    /// Input bytes per chunk: a chunk also closes when its records reach this size.
    pub chunk_bytes: usize,
    /// The validator's clock and the stamped ingest time (microseconds); None = now.
    pub now_us: Option<i64>,
    /// Name recorded as the rejection `source`.
    pub source_name: String,
}

impl LoadOptions {
    /// Default chunk: 100,000 records.
    pub const DEFAULT_CHUNK_RECORDS: usize = 100_000;
    /// Default chunk byte budget: 64 MiB of input.
    pub const DEFAULT_CHUNK_BYTES: usize = 64 * 1024 * 1024;
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            chunk_records: Self::DEFAULT_CHUNK_RECORDS,
            chunk_bytes: Self::DEFAULT_CHUNK_BYTES,
            now_us: None,
            source_name: "load".into(),
        }
    }
}

/// What a load did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct LoadReport {
    /// Records read from the file.
    pub records: u64,
    /// Events landed by this run.
    pub accepted: u64,
    /// Repeats of an earlier `(tenant, event_id)` in the file; not landed again.
    pub duplicates: u64,
    /// Records rejected, with evidence in `signalweave.rejections`.
    pub rejected: u64,
    /// Rejections by reason code.
    pub rejected_by_reason: BTreeMap<String, u64>,
    /// Chunks committed by this run.
    pub chunks_committed: u64,
    /// Chunks found already committed by an earlier run and skipped.
    pub chunks_skipped: u64,
    /// Events in skipped chunks (landed by the earlier run).
    pub accepted_earlier: u64,
    /// The file digest that names the load's writer id.
    pub file_digest: String,
}

/// File formats `load` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadFormat {
    /// One JSON event per line.
    Ndjson,
    /// Parquet with wire-form columns (see [`Lake::load_file`]).
    Parquet,
}

impl LoadFormat {
    /// The format implied by a file name (`.parquet` or anything else as NDJSON).
    pub fn from_path(path: &Path) -> Self {
        match path.extension().and_then(|e| e.to_str()) {
            Some("parquet") | Some("pq") => LoadFormat::Parquet,
            _ => LoadFormat::Ndjson,
        }
    }
}

fn io_err(path: &Path, e: std::io::Error) -> LakeError {
    LakeError::new(
        ErrorKind::InvalidInput,
        format!("cannot read {}: {e}", path.display()),
    )
}

fn file_digest(path: &Path) -> Result<String> {
    let mut file = std::fs::File::open(path).map_err(|e| io_err(path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| io_err(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(&hasher.finalize()[..12]))
}

fn now_us() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

/// Rejections of one chunk, columnar.
struct RejectionBatch {
    received_at: TimestampMicrosecondBuilder,
    source: StringBuilder,
    tenant: StringBuilder,
    producer_id: StringBuilder,
    event_id: StringBuilder,
    event_type: StringBuilder,
    reason_code: StringBuilder,
    detail: StringBuilder,
    record_digest: StringBuilder,
    record_bytes: Int64Builder,
    record_position: Int64Builder,
    rows: usize,
}

impl RejectionBatch {
    fn new() -> Self {
        Self::with_capacity(1024, 0)
    }

    /// Room for `rows` rows whose details take `detail_bytes` in all: a batch built for a
    /// few rows holds no more memory than they need (evidence waiting for a commit is
    /// bounded by its bytes).
    fn with_capacity(rows: usize, detail_bytes: usize) -> Self {
        let strings = || StringBuilder::with_capacity(rows, rows * 16);
        Self {
            received_at: TimestampMicrosecondBuilder::with_capacity(rows).with_timezone("+00:00"),
            source: strings(),
            tenant: strings(),
            producer_id: strings(),
            event_id: strings(),
            event_type: strings(),
            reason_code: strings(),
            detail: StringBuilder::with_capacity(rows, detail_bytes),
            record_digest: StringBuilder::with_capacity(rows, rows * 64),
            record_bytes: Int64Builder::with_capacity(rows),
            record_position: Int64Builder::with_capacity(rows),
            rows: 0,
        }
    }

    /// Adds one rejected record. Its tenant is `tenant` when the source authenticated one
    /// (the gateway), else what the record claims.
    fn push(
        &mut self,
        at_us: i64,
        source: &str,
        tenant: Option<&str>,
        raw: &[u8],
        position: u64,
        rejection: &Rejection,
    ) {
        // Identify the record as far as it can be parsed, without keeping its values.
        let parsed: Option<Map<String, Value>> = serde_json::from_slice(raw).ok();
        let field = |name: &str| {
            parsed
                .as_ref()
                .and_then(|o| o.get(name))
                .and_then(Value::as_str)
                .map(|s| s.chars().take(128).collect::<String>())
        };
        self.received_at.append_value(at_us);
        self.source.append_value(source);
        self.tenant
            .append_option(tenant.map(str::to_owned).or_else(|| field("tenant")));
        self.producer_id.append_option(field("producer_id"));
        self.event_id.append_option(field("event_id"));
        self.event_type.append_option(field("event_type"));
        self.reason_code.append_value(rejection.reason.as_str());
        self.detail.append_value(&rejection.detail);
        self.record_digest
            .append_value(hex::encode(Sha256::digest(raw)));
        self.record_bytes.append_value(raw.len() as i64);
        self.record_position.append_value(position as i64);
        self.rows += 1;
    }

    fn finish(&mut self) -> Result<RecordBatch> {
        let columns: Vec<ArrayRef> = vec![
            Arc::new(self.received_at.finish()),
            Arc::new(self.source.finish()),
            Arc::new(self.tenant.finish()),
            Arc::new(self.producer_id.finish()),
            Arc::new(self.event_id.finish()),
            Arc::new(self.event_type.finish()),
            Arc::new(self.reason_code.finish()),
            Arc::new(self.detail.finish()),
            Arc::new(self.record_digest.finish()),
            Arc::new(self.record_bytes.finish()),
            Arc::new(self.record_position.finish()),
        ];
        self.rows = 0;
        RecordBatch::try_new(Arc::clone(&REJECTIONS_SCHEMA), columns)
            .map_err(|e| LakeError::arrow("rejection batch", e))
    }
}

/// Builds a batch of rejection evidence, each row's tenant the one its record claims (for
/// `load`).
pub fn rejection_batch(
    at_us: i64,
    source: &str,
    rejected: &[(&[u8], u64, Rejection)],
) -> Result<RecordBatch> {
    rejection_batch_of(at_us, source, None, rejected)
}

/// Builds a batch of rejection evidence. With `tenant` (the tenant a source authenticated,
/// as the gateway does), every row is that tenant's, whatever its record claims: a
/// tenant's refusals are found under its own name, and no key can file rows under
/// another's. The claimed tenant stays in the record's digest and, for a mismatch, in the
/// detail.
pub fn rejection_batch_of(
    at_us: i64,
    source: &str,
    tenant: Option<&str>,
    rejected: &[(&[u8], u64, Rejection)],
) -> Result<RecordBatch> {
    let detail_bytes = rejected.iter().map(|(_, _, r)| r.detail.len()).sum();
    let mut b = RejectionBatch::with_capacity(rejected.len(), detail_bytes);
    for (raw, pos, r) in rejected {
        b.push(at_us, source, tenant, raw, *pos, r);
    }
    b.finish()
}

struct ChunkState<'a> {
    lake: &'a Lake,
    validator: &'a EventValidator,
    options: &'a LoadOptions,
    writer: String,
    /// Identities seen in this load, with their events' content digests.
    seen: HashMap<(String, String), u64>,
    report: LoadReport,
    chunk: u64,
    events: EventBatchBuilder,
    rejections: RejectionBatch,
    in_chunk: usize,
    chunk_dups: u64,
    chunk_rejected: BTreeMap<String, u64>,
    chunk_bytes: usize,
    clock_us: i64,
}

/// Snapshot summary key: the validation clock of a load, µs.
const SUMMARY_LOAD_CLOCK: &str = "signalweave.load-clock-us";

impl ChunkState<'_> {
    fn record(&mut self, raw: &[u8], position: u64) {
        let now = self.clock_us;
        self.report.records += 1;
        self.in_chunk += 1;
        self.chunk_bytes += raw.len();
        match self.validator.validate_bytes(raw, now, now) {
            Ok(event) => {
                let key = (
                    event.tenant.as_str().to_owned(),
                    event.event_id.as_str().to_owned(),
                );
                let content = event.content_digest();
                match self.seen.entry(key) {
                    Entry::Vacant(slot) => {
                        slot.insert(content);
                        self.events.push(&event);
                    }
                    Entry::Occupied(first) if *first.get() == content => self.chunk_dups += 1,
                    Entry::Occupied(_) => self.reject(
                        raw,
                        position,
                        &Rejection::new(
                            ReasonCode::IdentityConflict,
                            format!(
                                "event_id `{}` appears earlier in the input with other \
                                 content; a new event needs a new event_id",
                                event.event_id
                            ),
                        ),
                    ),
                }
            }
            Err(rejection) => self.reject(raw, position, &rejection),
        }
    }

    fn reject(&mut self, raw: &[u8], position: u64, rejection: &Rejection) {
        let now = self.clock_us;
        *self
            .chunk_rejected
            .entry(rejection.reason.as_str().to_owned())
            .or_default() += 1;
        self.rejections.push(
            now,
            &self.options.source_name,
            None,
            raw,
            position,
            rejection,
        );
    }

    async fn flush(&mut self) -> Result<()> {
        if self.in_chunk == 0 {
            return Ok(());
        }
        let seq = self.chunk;
        self.chunk += 1;
        self.in_chunk = 0;
        self.chunk_bytes = 0;
        let summary: std::collections::HashMap<String, String> =
            [(SUMMARY_LOAD_CLOCK.to_string(), self.clock_us.to_string())]
                .into_iter()
                .collect();
        let rejections = self.rejections.rows;
        let rejected_batch = self.rejections.finish()?;
        let events_batch = self
            .events
            .finish()
            .map_err(|e| LakeError::new(e.kind(), format!("event batch: {}", e.message())))?;
        let identity = CommitIdentity::new(self.writer.clone(), seq);
        let mut skipped = false;
        if rejections > 0 {
            let outcome = self
                .lake
                .append_with_summary(
                    LakeTable::Rejections,
                    &[rejected_batch],
                    &identity,
                    summary.clone(),
                )
                .await?;
            skipped = outcome.already_committed;
        }
        let accepted = events_batch.num_rows() as u64;
        if accepted > 0 {
            let outcome = self
                .lake
                .append_with_summary(LakeTable::Events, &[events_batch], &identity, summary)
                .await?;
            skipped = outcome.already_committed;
        }
        let rejected: u64 = self.chunk_rejected.values().sum();
        self.report.duplicates += std::mem::take(&mut self.chunk_dups);
        self.report.rejected += rejected;
        for (k, v) in std::mem::take(&mut self.chunk_rejected) {
            *self.report.rejected_by_reason.entry(k).or_default() += v;
        }
        if skipped {
            self.report.chunks_skipped += 1;
            self.report.accepted_earlier += accepted;
        } else {
            self.report.chunks_committed += 1;
            self.report.accepted += accepted;
        }
        Ok(())
    }
}

impl Lake {
    /// Records the load `writer` of the file `digest` in `sw_loads` and returns its
    /// validation clock: the one its first run recorded when it is resumed, else `clock_us`.
    /// Refuses the file loaded (perhaps partly) under another chunk geometry, which would
    /// cut other chunks and land its records a second time. Loads made before `sw_loads`
    /// existed are found in the retained snapshots' summaries.
    async fn register_load(
        &self,
        path: &Path,
        digest: &str,
        writer: &str,
        clock_us: i64,
    ) -> Result<i64> {
        let sqlite = self.config().is_sqlite();
        let catalog = self.config().catalog_name.as_str();
        let refuse = |other: String| {
            let geometry = other
                .trim_start_matches(&format!("load-{digest}-"))
                .to_owned();
            LakeError::new(
                ErrorKind::InvalidInput,
                format!(
                    "{} was already loaded (perhaps partly) with chunk geometry {geometry}; rerun with the same --chunk-records to resume",
                    path.display()
                ),
            )
        };
        if let Some(other) = self.other_load_writer(digest, writer).await? {
            return Err(refuse(other));
        }
        let select = if sqlite {
            "SELECT clock_us FROM sw_loads WHERE catalog_name = ? AND writer_id = ?"
        } else {
            "SELECT clock_us FROM sw_loads WHERE catalog_name = $1 AND writer_id = $2"
        };
        let recorded: Option<(i64,)> = sqlx::query_as(select)
            .bind(catalog)
            .bind(writer)
            .fetch_optional(self.control_pool())
            .await
            .map_err(|e| LakeError::sql("read sw_loads", e))?;
        if let Some((clock,)) = recorded {
            return Ok(clock);
        }
        // A load begun before `sw_loads` existed recorded its clock in its snapshots.
        let mut clock = clock_us;
        for table in [LakeTable::Rejections, LakeTable::Events] {
            if let Some(v) = self
                .writer_summary(table, writer, SUMMARY_LOAD_CLOCK)
                .await?
                .and_then(|v| v.parse::<i64>().ok())
            {
                clock = v;
                break;
            }
        }
        let insert = if sqlite {
            "INSERT INTO sw_loads (catalog_name, writer_id, file_digest, clock_us, started_ms) \
             VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
        } else {
            "INSERT INTO sw_loads (catalog_name, writer_id, file_digest, clock_us, started_ms) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING"
        };
        let inserted = sqlx::query(insert)
            .bind(catalog)
            .bind(writer)
            .bind(digest)
            .bind(clock)
            .bind(chrono::Utc::now().timestamp_millis())
            .execute(self.control_pool())
            .await
            .map_err(|e| LakeError::sql("record the load in sw_loads", e))?
            .rows_affected()
            > 0;
        // Two loads of the file with different geometries racing: neither commits.
        if let Some(other) = self.other_load_writer(digest, writer).await? {
            if inserted {
                let delete = if sqlite {
                    "DELETE FROM sw_loads WHERE catalog_name = ? AND writer_id = ?"
                } else {
                    "DELETE FROM sw_loads WHERE catalog_name = $1 AND writer_id = $2"
                };
                sqlx::query(delete)
                    .bind(catalog)
                    .bind(writer)
                    .execute(self.control_pool())
                    .await
                    .map_err(|e| LakeError::sql("forget a refused load", e))?;
            }
            return Err(refuse(other));
        }
        // The row a concurrent run of the same load inserted first wins.
        let (clock,): (i64,) = sqlx::query_as(select)
            .bind(catalog)
            .bind(writer)
            .fetch_one(self.control_pool())
            .await
            .map_err(|e| LakeError::sql("read sw_loads", e))?;
        Ok(clock)
    }

    /// Another writer that loaded (perhaps partly) the file `digest`.
    async fn other_load_writer(&self, digest: &str, writer: &str) -> Result<Option<String>> {
        let sql = if self.config().is_sqlite() {
            "SELECT writer_id FROM sw_loads WHERE catalog_name = ? AND file_digest = ? \
             AND writer_id <> ? ORDER BY writer_id LIMIT 1"
        } else {
            "SELECT writer_id FROM sw_loads WHERE catalog_name = $1 AND file_digest = $2 \
             AND writer_id <> $3 ORDER BY writer_id LIMIT 1"
        };
        let row: Option<(String,)> = sqlx::query_as(sql)
            .bind(self.config().catalog_name.as_str())
            .bind(digest)
            .bind(writer)
            .fetch_optional(self.control_pool())
            .await
            .map_err(|e| LakeError::sql("read sw_loads", e))?;
        if let Some((other,)) = row {
            return Ok(Some(other));
        }
        let prefix = format!("load-{digest}-");
        for table in [LakeTable::Events, LakeTable::Rejections] {
            if let Some(other) = self
                .writers_with_prefix(table, &prefix)
                .await?
                .into_iter()
                .find(|w| w != writer)
            {
                return Ok(Some(other));
            }
        }
        Ok(None)
    }

    /// Loads a file of wire-form events (NDJSON, or Parquet with the wire columns
    /// `event_id, event_type, schema_version, tenant, producer_id, producer_seq,
    /// event_time, partition_key, order_id, customer_id, market_id, business_version,
    /// amount_minor, currency, attributes`). See the module docs for the guarantees.
    pub async fn load_file(
        &self,
        path: &Path,
        validator: &EventValidator,
        options: &LoadOptions,
    ) -> Result<LoadReport> {
        if options.chunk_records == 0 {
            return Err(LakeError::new(
                ErrorKind::InvalidInput,
                "chunk_records must be > 0",
            ));
        }
        if options.chunk_bytes == 0 {
            return Err(LakeError::new(
                ErrorKind::InvalidInput,
                "chunk_bytes must be > 0",
            ));
        }
        let digest = file_digest(path)?;
        let writer = format!(
            "load-{digest}-r{}-b{}",
            options.chunk_records, options.chunk_bytes
        );
        let clock_us = self
            .register_load(
                path,
                &digest,
                &writer,
                options.now_us.unwrap_or_else(now_us),
            )
            .await?;
        let mut state = ChunkState {
            lake: self,
            validator,
            options,
            writer,
            seen: HashMap::new(),
            report: LoadReport {
                file_digest: digest,
                ..Default::default()
            },
            chunk: 0,
            events: EventBatchBuilder::with_capacity(options.chunk_records.min(65_536)),
            rejections: RejectionBatch::new(),
            in_chunk: 0,
            chunk_dups: 0,
            chunk_rejected: BTreeMap::new(),
            chunk_bytes: 0,
            clock_us,
        };
        match LoadFormat::from_path(path) {
            LoadFormat::Ndjson => {
                let file = std::fs::File::open(path).map_err(|e| io_err(path, e))?;
                let mut reader = BufReader::with_capacity(1 << 20, file);
                let mut line = Vec::with_capacity(1024);
                let mut position = 0u64;
                loop {
                    line.clear();
                    let n = reader
                        .read_until(b'\n', &mut line)
                        .map_err(|e| io_err(path, e))?;
                    if n == 0 {
                        break;
                    }
                    position += 1;
                    let trimmed = trim_ascii(&line);
                    if trimmed.is_empty() {
                        continue;
                    }
                    state.record(trimmed, position);
                    if state.in_chunk >= options.chunk_records
                        || state.chunk_bytes >= options.chunk_bytes
                    {
                        state.flush().await?;
                    }
                }
            }
            LoadFormat::Parquet => {
                let file = std::fs::File::open(path).map_err(|e| io_err(path, e))?;
                let reader =
                    parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
                        .and_then(|b| b.with_batch_size(8192).build())
                        .map_err(|e| {
                            LakeError::new(
                                ErrorKind::InvalidInput,
                                format!("{} is not readable Parquet: {e}", path.display()),
                            )
                        })?;
                let mut position = 0u64;
                for batch in reader {
                    let batch = batch.map_err(|e| LakeError::arrow("read parquet", e))?;
                    for row in wire_rows(&batch)? {
                        position += 1;
                        state.record(row.as_bytes(), position);
                        if state.in_chunk >= options.chunk_records
                            || state.chunk_bytes >= options.chunk_bytes
                        {
                            state.flush().await?;
                        }
                    }
                }
            }
        }
        state.flush().await?;
        Ok(state.report)
    }
}

fn trim_ascii(mut s: &[u8]) -> &[u8] {
    while let [first, rest @ ..] = s {
        if first.is_ascii_whitespace() {
            s = rest;
        } else {
            break;
        }
    }
    while let [rest @ .., last] = s {
        if last.is_ascii_whitespace() {
            s = rest;
        } else {
            break;
        }
    }
    s
}

/// Turns a Parquet batch with wire columns into wire JSON texts, one per row, so that
/// Parquet input goes through exactly the validation NDJSON does.
fn wire_rows(batch: &RecordBatch) -> Result<Vec<String>> {
    use arrow::array::AsArray;
    use arrow::datatypes::{Int64Type, TimestampMicrosecondType};
    let n = batch.num_rows();
    let mut rows: Vec<Map<String, Value>> = vec![Map::new(); n];
    let mut payloads: Vec<Map<String, Value>> = vec![Map::new(); n];
    for (field, column) in batch.schema().fields().iter().zip(batch.columns()) {
        let name = field.name().as_str();
        let column = arrow::compute::cast(
            column,
            match column.data_type() {
                arrow::datatypes::DataType::Timestamp(_, _) => {
                    &arrow::datatypes::DataType::Timestamp(
                        arrow::datatypes::TimeUnit::Microsecond,
                        None,
                    )
                }
                arrow::datatypes::DataType::Int8
                | arrow::datatypes::DataType::Int16
                | arrow::datatypes::DataType::Int32
                | arrow::datatypes::DataType::Int64 => &arrow::datatypes::DataType::Int64,
                _ => &arrow::datatypes::DataType::Utf8,
            },
        )
        .map_err(|e| LakeError::arrow(format!("column {name}"), e))?;
        for (i, (row, payload)) in rows.iter_mut().zip(payloads.iter_mut()).enumerate() {
            if column.is_null(i) {
                continue;
            }
            let value: Value = match column.data_type() {
                arrow::datatypes::DataType::Timestamp(_, _) => format_rfc3339_micros(
                    column.as_primitive::<TimestampMicrosecondType>().value(i),
                )
                .into(),
                arrow::datatypes::DataType::Int64 => {
                    column.as_primitive::<Int64Type>().value(i).into()
                }
                _ => column.as_string::<i32>().value(i).to_owned().into(),
            };
            match name {
                "amount_minor" | "currency" => {
                    payload.insert(name.to_owned(), value);
                }
                "attributes" => {
                    if let Some(Value::Object(extra)) =
                        value.as_str().and_then(|s| serde_json::from_str(s).ok())
                    {
                        payload.extend(extra);
                    }
                }
                "ingest_time" => {}
                _ => {
                    row.insert(name.to_owned(), value);
                }
            }
        }
    }
    Ok(rows
        .into_iter()
        .zip(payloads)
        .map(|(mut row, payload)| {
            row.insert("payload".into(), Value::Object(payload));
            Value::Object(row).to_string()
        })
        .take(n)
        .collect())
}
