//! Late records: what the window engine routed away from the windows, as rows of
//! `signalweave.late_events` (the reconciliation stream).

use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, Int64Builder, RecordBatch, StringBuilder, TimestampMicrosecondBuilder,
};
use arrow::datatypes::{DataType, Int64Type, TimestampMicrosecondType};
use serde::{Deserialize, Serialize};
use signalweave_lake::LATE_EVENTS_SCHEMA;
use signalweave_model::ErrorKind;
use signalweave_window::LateRecord;

use crate::error::{Result, RunnerError};

/// One row of `signalweave.late_events`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LateEvent {
    /// Why it is late (`beyond_allowed_lateness`, `null_key`).
    pub reason: String,
    /// Watermark when classified, µs.
    pub watermark: i64,
    /// Processing time of the classification, µs.
    pub classified_at: i64,
    /// Tenant.
    pub tenant: String,
    /// Event id.
    pub event_id: String,
    /// Event type.
    pub event_type: String,
    /// Event time, µs.
    pub event_time: i64,
    /// Ingest time, µs.
    pub ingest_time: i64,
    /// The job's key value, when it has one.
    pub key: Option<String>,
    /// Amount in minor units.
    pub amount_minor: Option<i64>,
    /// Currency.
    pub currency: Option<String>,
}

fn column_as_strings(batch: &RecordBatch, name: &str) -> Result<Option<ArrayRef>> {
    let Some(col) = batch.column_by_name(name) else {
        return Ok(None);
    };
    arrow::compute::cast(col, &DataType::Utf8)
        .map(Some)
        .map_err(|e| RunnerError::new(ErrorKind::Internal, format!("column {name}: {e}")))
}

/// The late records of `batch` (an events batch) as late-event rows. `key_columns` are
/// the job's key columns (joined with `|`, as the engine keys them).
pub fn extract(
    batch: &RecordBatch,
    late: &[LateRecord],
    key_columns: &[String],
    classified_at: i64,
) -> Result<Vec<LateEvent>> {
    if late.is_empty() {
        return Ok(Vec::new());
    }
    let text = |name: &str| -> Result<ArrayRef> {
        column_as_strings(batch, name)?.ok_or_else(|| {
            RunnerError::new(
                ErrorKind::InvalidInput,
                format!("source lacks column {name}"),
            )
        })
    };
    let ts = |name: &str| -> Result<arrow::array::PrimitiveArray<TimestampMicrosecondType>> {
        let col = batch.column_by_name(name).ok_or_else(|| {
            RunnerError::new(
                ErrorKind::InvalidInput,
                format!("source lacks column {name}"),
            )
        })?;
        Ok(col
            .as_primitive_opt::<TimestampMicrosecondType>()
            .ok_or_else(|| {
                RunnerError::new(
                    ErrorKind::InvalidInput,
                    format!("{name} is not a timestamp"),
                )
            })?
            .clone())
    };
    let (tenant, event_id, event_type) = (text("tenant")?, text("event_id")?, text("event_type")?);
    let (tenant, event_id, event_type) = (
        tenant.as_string::<i32>(),
        event_id.as_string::<i32>(),
        event_type.as_string::<i32>(),
    );
    let (event_time, ingest_time) = (ts("event_time")?, ts("ingest_time")?);
    let currency = column_as_strings(batch, "currency")?;
    let currency = currency.as_ref().map(|c| c.as_string::<i32>());
    let amount = batch
        .column_by_name("amount_minor")
        .and_then(|c| c.as_primitive_opt::<Int64Type>());
    let keys: Vec<ArrayRef> = key_columns.iter().map(|k| text(k)).collect::<Result<_>>()?;
    let keys: Vec<_> = keys.iter().map(|k| k.as_string::<i32>()).collect();
    let mut out = Vec::with_capacity(late.len());
    for l in late {
        let row = l.row as usize;
        let key = if keys.iter().any(|k| k.is_null(row)) {
            None
        } else {
            // Joined as the engine joins an output's key (escaped), so an erasure finds it.
            Some(signalweave_model::join_key(
                &keys.iter().map(|k| k.value(row)).collect::<Vec<_>>(),
            ))
        };
        let opt_str =
            |a: &arrow::array::StringArray| (!a.is_null(row)).then(|| a.value(row).to_string());
        out.push(LateEvent {
            reason: l.reason.as_str().to_string(),
            watermark: l.watermark,
            classified_at,
            tenant: tenant.value(row).to_string(),
            event_id: event_id.value(row).to_string(),
            event_type: event_type.value(row).to_string(),
            event_time: event_time.value(row),
            ingest_time: ingest_time.value(row),
            key,
            amount_minor: amount.and_then(|a| (!a.is_null(row)).then(|| a.value(row))),
            currency: currency.and_then(opt_str),
        });
    }
    Ok(out)
}

/// Late-event rows of `job` in `namespace` as a batch of `signalweave.late_events`.
pub fn to_batch(job: &str, namespace: &str, rows: &[LateEvent]) -> Result<RecordBatch> {
    let n = rows.len();
    let ts = || TimestampMicrosecondBuilder::with_capacity(n).with_timezone("+00:00");
    let s = || StringBuilder::with_capacity(n, n * 16);
    let (mut j, mut ns, mut reason, mut tenant, mut id, mut ty, mut key, mut cur) =
        (s(), s(), s(), s(), s(), s(), s(), s());
    let (mut wm, mut at, mut et, mut it) = (ts(), ts(), ts(), ts());
    let mut amount = Int64Builder::with_capacity(n);
    for r in rows {
        j.append_value(job);
        ns.append_value(namespace);
        reason.append_value(&r.reason);
        wm.append_value(r.watermark);
        at.append_value(r.classified_at);
        tenant.append_value(&r.tenant);
        id.append_value(&r.event_id);
        ty.append_value(&r.event_type);
        et.append_value(r.event_time);
        it.append_value(r.ingest_time);
        key.append_option(r.key.as_deref());
        amount.append_option(r.amount_minor);
        cur.append_option(r.currency.as_deref());
    }
    let columns: Vec<ArrayRef> = vec![
        Arc::new(j.finish()),
        Arc::new(ns.finish()),
        Arc::new(reason.finish()),
        Arc::new(wm.finish()),
        Arc::new(at.finish()),
        Arc::new(tenant.finish()),
        Arc::new(id.finish()),
        Arc::new(ty.finish()),
        Arc::new(et.finish()),
        Arc::new(it.finish()),
        Arc::new(key.finish()),
        Arc::new(amount.finish()),
        Arc::new(cur.finish()),
    ];
    RecordBatch::try_new(Arc::clone(&LATE_EVENTS_SCHEMA), columns)
        .map_err(|e| RunnerError::new(ErrorKind::Internal, format!("late events batch: {e}")))
}
