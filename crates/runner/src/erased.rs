//! A running job's view of the erasures recorded after it read a subject's events: the
//! windows of an erased customer over the erased events' times are left out of what the
//! job commits (outputs and late rows), until its watermark has passed the last time any
//! of them could change. The job's state still counts the erased events for those
//! windows; this keeps that from reaching the tables. (`lake erase` removes what was
//! committed before it.)

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};

use arrow::array::{Array, AsArray, BooleanArray, RecordBatch};
use arrow::datatypes::TimestampMicrosecondType;
use signalweave_lake::{ErasureNotice, Lake, subject_digest};
use signalweave_model::{ErrorKind, key_parts};
use signalweave_window::{JobSpec, WindowSpec};

use crate::error::{Result, RunnerError};
use crate::late::LateEvent;

/// Keys whose erasures are remembered at most (each is looked at again when forgotten).
const MAX_KEYS_REMEMBERED: usize = 1 << 20;

/// How far before the newest erasure read the next read starts (ms): erasures are timed
/// by the erasing host's clock, and two may commit out of their times' order.
const READ_MARGIN_MS: i64 = 10 * 60 * 1000;

/// The erasures a job's outputs must leave out; see the module docs.
#[derive(Debug)]
pub(crate) struct ErasedWindows {
    /// Key columns: how many, and where the customer id and the tenant are.
    parts: usize,
    customer: usize,
    tenant: Option<usize>,
    /// How long after an event its windows may still change: the window's span and the
    /// allowed lateness (a session, which an event can extend, never settles).
    settle_us: i64,
    notices: Vec<ErasureNotice>,
    /// The erasures read, and the newest time among them (ms).
    read: HashSet<String>,
    read_ms: i64,
    /// Per key seen while some erasure is in force: the notices naming it.
    named: HashMap<String, Vec<usize>>,
}

impl ErasedWindows {
    /// For a job whose key holds a customer id; None otherwise (its outputs name no one).
    pub(crate) fn new(spec: &JobSpec) -> Option<Self> {
        let at = |name: &str| spec.key.columns.iter().position(|c| c == name);
        let settle_us = match spec.window {
            WindowSpec::Session { .. } => i64::MAX,
            _ => spec
                .window
                .span_us()
                .saturating_add(signalweave_window::micros(spec.lateness.allowed)),
        };
        Some(Self {
            parts: spec.key.columns.len(),
            customer: at("customer_id")?,
            tenant: at("tenant"),
            settle_us,
            notices: Vec::new(),
            read: HashSet::new(),
            read_ms: i64::MIN,
            named: HashMap::new(),
        })
    }

    /// Reads the erasures recorded since the last read. Called before each commit, so an
    /// erasure applies to every commit after it was recorded.
    pub(crate) async fn read_new(&mut self, lake: &Lake) -> Result<()> {
        let new: Vec<ErasureNotice> = lake
            .erasures_after(self.read_ms.saturating_sub(READ_MARGIN_MS))
            .await?
            .into_iter()
            .filter(|n| !self.read.contains(&n.erasure_id))
            .collect();
        if new.is_empty() {
            return Ok(());
        }
        for n in &new {
            self.read.insert(n.erasure_id.clone());
            self.read_ms = self.read_ms.max(n.erased_ms);
        }
        self.notices.extend(new);
        self.named.clear();
        Ok(())
    }

    /// Holds `notices`, read by the caller: a backfill keeps the erasures it read, and
    /// its commit applies those its snapshot predates.
    pub(crate) fn hold(&mut self, notices: Vec<ErasureNotice>) {
        self.read
            .extend(notices.iter().map(|n| n.erasure_id.clone()));
        self.notices = notices;
        self.named.clear();
    }

    /// Forgets the erasures whose windows have all settled by `watermark`: the watermark of
    /// a commit just made, below which nothing later is emitted. (Before a commit, its rows
    /// were emitted at lower watermarks, and an erasure must still apply to them.)
    pub(crate) fn expire(&mut self, watermark: i64) {
        let settle = self.settle_us;
        let held = self.notices.len();
        self.notices
            .retain(|n| n.event_to_us.saturating_add(settle) >= watermark);
        // The keys seen are remembered while an erasure is in force, a few hours at most.
        if self.notices.len() != held || self.named.len() > MAX_KEYS_REMEMBERED {
            self.named.clear();
        }
    }

    /// Whether a window `[start, end)` of `key` may count an erased event.
    fn erased_window(&mut self, key: &str, start: i64, end: i64) -> bool {
        if !self.named.contains_key(key) {
            let found = self.naming(key);
            self.named.insert(key.to_string(), found);
        }
        let notices = &self.notices;
        self.named[key].iter().any(|&i| {
            let n = &notices[i];
            start <= n.event_to_us && end > n.event_from_us
        })
    }

    /// The notices naming `key`'s customer. With a tenant in the key: by the digest of
    /// the customer id within it, or alone (an erasure of every tenant). Without one: any
    /// erasure of that customer id, whatever its tenant, as `lake erase` judges such a key
    /// (it mixes the tenants' customers of that id).
    fn naming(&self, key: &str) -> Vec<usize> {
        let parts = key_parts(key, self.parts);
        if parts.len() != self.parts {
            return Vec::new();
        }
        let customer = &parts[self.customer];
        let alone = subject_digest(customer, None);
        let Some(t) = self.tenant else {
            return (0..self.notices.len())
                .filter(|&i| self.notices[i].customer_sha256 == alone)
                .collect();
        };
        let scoped = subject_digest(customer, Some(&parts[t]));
        (0..self.notices.len())
            .filter(|&i| {
                let d = &self.notices[i].subject_sha256;
                *d == alone || *d == scoped
            })
            .collect()
    }

    /// Whether the window `[start, end)` of `key` is left out of commits, as
    /// [`Self::outputs`] leaves its rows out.
    pub(crate) fn leaves_out(&mut self, key: &str, start: i64, end: i64) -> bool {
        !self.notices.is_empty() && self.erased_window(key, start, end)
    }

    /// `batch` (output rows) without the rows of erased windows; None when none is left.
    pub(crate) fn outputs(&mut self, batch: RecordBatch) -> Result<Option<RecordBatch>> {
        if self.notices.is_empty() {
            return Ok(Some(batch));
        }
        let missing = |name: &str| {
            RunnerError::new(ErrorKind::Internal, format!("output batch without {name}"))
        };
        let keys = batch
            .column_by_name("key")
            .and_then(|c| c.as_string_opt::<i32>())
            .ok_or_else(|| missing("key"))?
            .clone();
        let time = |name: &str| {
            batch
                .column_by_name(name)
                .and_then(|c| c.as_primitive_opt::<TimestampMicrosecondType>())
                .cloned()
                .ok_or_else(|| missing(name))
        };
        let (starts, ends) = (time("window_start")?, time("window_end")?);
        let keep: BooleanArray = (0..batch.num_rows())
            .map(|i| {
                Some(
                    !(keys.is_valid(i)
                        && self.erased_window(keys.value(i), starts.value(i), ends.value(i))),
                )
            })
            .collect();
        if keep.true_count() == batch.num_rows() {
            return Ok(Some(batch));
        }
        tracing::info!(
            rows = batch.num_rows() - keep.true_count(),
            "left out output rows of erased windows"
        );
        let kept = arrow::compute::filter_record_batch(&batch, &keep)
            .map_err(|e| RunnerError::new(ErrorKind::Internal, format!("filter outputs: {e}")))?;
        Ok((kept.num_rows() > 0).then_some(kept))
    }

    /// `late` without the rows of erased events' windows.
    pub(crate) fn late<'a>(&mut self, late: &'a [LateEvent]) -> Cow<'a, [LateEvent]> {
        if self.notices.is_empty() {
            return Cow::Borrowed(late);
        }
        Cow::Owned(
            late.iter()
                .filter(|r| {
                    !r.key.as_deref().is_some_and(|k| {
                        self.erased_window(k, r.event_time, r.event_time.saturating_add(1))
                    })
                })
                .cloned()
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;

    use arrow::array::{ArrayRef, StringArray, TimestampMicrosecondArray};
    use arrow::datatypes::{DataType, Field, Schema, TimeUnit};

    use super::*;

    const MIN: i64 = 60_000_000;

    fn windows() -> ErasedWindows {
        windows_of(include_str!("../../../jobs/customer_features.toml"))
    }

    /// The job of `spec`, with a tenant-scoped erasure of customer `c|1` of `t-0`.
    fn windows_of(spec: &str) -> ErasedWindows {
        let spec = JobSpec::from_toml(spec).unwrap();
        let mut w = ErasedWindows::new(&spec).unwrap();
        w.notices.push(ErasureNotice {
            erasure_id: "erase-1".into(),
            subject_sha256: subject_digest("c|1", Some("t-0")),
            customer_sha256: subject_digest("c|1", None),
            erased_ms: 1,
            event_from_us: 100 * MIN,
            event_to_us: 105 * MIN,
            events_snapshot_id: None,
            events_sequence: None,
            completed: true,
        });
        w
    }

    fn late(key: &str, event_time: i64) -> LateEvent {
        LateEvent {
            reason: "beyond_allowed_lateness".into(),
            watermark: 0,
            classified_at: 0,
            tenant: "t-0".into(),
            event_id: "e".into(),
            event_type: "order_placed".into(),
            event_time,
            ingest_time: 0,
            key: Some(key.into()),
            amount_minor: None,
            currency: None,
        }
    }

    /// The subject's windows over the erased times go, with its late rows of those times;
    /// its later windows, another tenant's same customer id and other customers stay.
    #[test]
    fn an_erased_customers_windows_over_the_erased_times_are_left_out() {
        let mut w = windows();
        let subject = signalweave_model::join_key(&["t-0", "c|1"]);
        let rows = [
            (subject.as_str(), 96, 106),
            (subject.as_str(), 104, 114),
            (subject.as_str(), 106, 116),
            ("t-1|c\\|1", 100, 110),
            ("t-0|c-2", 100, 110),
        ];
        let ts = |v: Vec<i64>| -> ArrayRef {
            Arc::new(TimestampMicrosecondArray::from(v).with_timezone("+00:00"))
        };
        let ts_type = DataType::Timestamp(TimeUnit::Microsecond, Some("+00:00".into()));
        let batch = RecordBatch::try_new(
            Arc::new(Schema::new(vec![
                Field::new("key", DataType::Utf8, false),
                Field::new("window_start", ts_type.clone(), false),
                Field::new("window_end", ts_type, false),
            ])),
            vec![
                Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.0))),
                ts(rows.iter().map(|r| r.1 * MIN).collect()),
                ts(rows.iter().map(|r| r.2 * MIN).collect()),
            ],
        )
        .unwrap();
        let kept = w.outputs(batch).unwrap().unwrap();
        let keys = kept.column(0).as_string::<i32>();
        let starts = kept.column(1).as_primitive::<TimestampMicrosecondType>();
        let left: Vec<(&str, i64)> = (0..kept.num_rows())
            .map(|i| (keys.value(i), starts.value(i) / MIN))
            .collect();
        assert_eq!(
            left,
            [
                (subject.as_str(), 106),
                ("t-1|c\\|1", 100),
                ("t-0|c-2", 100)
            ]
        );
        let rows = [late(&subject, 103 * MIN), late(&subject, 107 * MIN)];
        let kept = w.late(&rows);
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].event_time, 107 * MIN);
        // In force until a commit's watermark has passed the last change any of the
        // erased events' windows could see (their end and the allowed lateness).
        let settled = 105 * MIN + w.settle_us;
        w.expire(settled);
        assert_eq!(w.late(&rows).len(), 1);
        w.expire(settled + 1);
        assert!(matches!(w.late(&rows), Cow::Borrowed(_)));
    }

    /// A job keyed by customer id alone mixes the tenants' customers of that id: a
    /// tenant-scoped erasure leaves its windows of that id out, as `lake erase` removes
    /// them.
    #[test]
    fn a_scoped_erasure_reaches_a_job_keyed_by_customer_alone() {
        let mut w = windows_of(include_str!(
            "../../../jobs/versions/customer_features.v1.toml"
        ));
        assert!(w.erased_window(&signalweave_model::join_key(&["c|1"]), 100 * MIN, 110 * MIN));
        assert!(!w.erased_window("c-2", 100 * MIN, 110 * MIN));
        assert!(!w.erased_window(&signalweave_model::join_key(&["c|1"]), 106 * MIN, 116 * MIN));
    }
}
