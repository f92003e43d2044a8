//! The notifier: tails a window job's output table by snapshot, applies the rules, and
//! records the intents with its new position in one ledger transaction (the outbox). Live
//! (namespace `live`) the intents are dispatched; over a backfill namespace they are
//! recorded as `would_send` and never sent.

use std::collections::HashSet;
use std::sync::Arc;

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{DataType, Int64Type, TimestampMicrosecondType};
use futures::TryStreamExt;
use serde::Serialize;
use signalweave_lake::{Lake, LakeTable};
use signalweave_model::ErrorKind;
use signalweave_window::{JobSpec, micros};

use crate::error::{EffectError, Result};
use crate::ledger::{Intent, Ledger, fault_point};
use crate::spec::{NotificationSpec, effect_id};

/// What one step did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct NotifyStep {
    /// Output snapshots read.
    pub snapshots: usize,
    /// Output rows read.
    pub rows: u64,
    /// Intents derived (after dedup within the step).
    pub intents: u64,
    /// Intents new to the ledger.
    pub recorded: u64,
}

/// A notification job over one namespace of its source job's outputs.
#[derive(Debug, Clone)]
pub struct Notifier {
    lake: Lake,
    ledger: Ledger,
    spec: Arc<NotificationSpec>,
    table: LakeTable,
    namespace: String,
}

impl Notifier {
    /// A notifier of `spec` reading `source`'s outputs in `namespace` (`live`, or a
    /// backfill's). Checks the ledger's retention against the source's horizons.
    pub async fn new(
        lake: Lake,
        ledger: Ledger,
        spec: Arc<NotificationSpec>,
        source: &JobSpec,
        namespace: &str,
    ) -> Result<Self> {
        if source.name != spec.source.job {
            return Err(EffectError::new(
                ErrorKind::Config,
                format!(
                    "{} reads {}, not {}",
                    spec.name, spec.source.job, source.name
                ),
            ));
        }
        spec.check_retention(source.dedup.replay_horizon, source.lateness.allowed)?;
        let schema = signalweave_window::output_schema(source);
        for r in &spec.rules {
            let ok = schema
                .field_with_name(&r.column)
                .is_ok_and(|f| matches!(f.data_type(), DataType::Int64 | DataType::Float64));
            if !ok {
                return Err(EffectError::new(
                    ErrorKind::Config,
                    format!(
                        "rule {}: {} has no numeric output column {}",
                        r.name, source.name, r.column
                    ),
                ));
            }
        }
        let table = if namespace == "live" {
            signalweave_runner::output_table(source, "live")?
        } else {
            signalweave_runner::backfill_output_table(source, namespace)?
        };
        if namespace == "live" {
            lake.ensure_output_table(table).await?;
        }
        Ok(Self {
            lake,
            ledger,
            spec,
            table,
            namespace: namespace.to_string(),
        })
    }

    /// Whether it records `would_send` instead of sending.
    pub fn dry(&self) -> bool {
        self.namespace != "live"
    }

    fn intents_of(&self, batch: &RecordBatch, snapshot: i64, out: &mut Vec<Intent>) -> Result<u64> {
        let col = |name: &str| {
            batch.column_by_name(name).ok_or_else(|| {
                EffectError::new(ErrorKind::Internal, format!("output batch has no {name}"))
            })
        };
        let keys = arrow::compute::cast(col("key")?, &DataType::Utf8)
            .map_err(|e| EffectError::new(ErrorKind::Internal, format!("key: {e}")))?;
        let keys = keys.as_string::<i32>();
        let starts = col("window_start")?
            .as_primitive_opt::<TimestampMicrosecondType>()
            .ok_or_else(|| EffectError::new(ErrorKind::Internal, "window_start type"))?
            .clone();
        let last = col("last_event_time")?
            .as_primitive_opt::<TimestampMicrosecondType>()
            .ok_or_else(|| EffectError::new(ErrorKind::Internal, "last_event_time type"))?
            .clone();
        let retracted = col("retracted")?.as_boolean().clone();
        for rule in &self.spec.rules {
            let values =
                arrow::compute::cast(col(&rule.column)?, &DataType::Int64).map_err(|e| {
                    EffectError::new(ErrorKind::Internal, format!("{}: {e}", rule.column))
                })?;
            let values = values.as_primitive::<Int64Type>();
            for row in 0..batch.num_rows() {
                if retracted.value(row) || values.is_null(row) || keys.is_null(row) {
                    continue;
                }
                let value = values.value(row);
                if value < rule.threshold {
                    continue;
                }
                let key = keys.value(row);
                let ws = starts.value(row);
                let message = rule
                    .message
                    .replace("{key}", key)
                    .replace("{value}", &value.to_string())
                    .replace(
                        "{window_start}",
                        &chrono::DateTime::from_timestamp_micros(ws)
                            .map(|t| t.to_rfc3339())
                            .unwrap_or_default(),
                    );
                out.push(Intent {
                    effect_id: effect_id(&self.spec.name, rule, key, ws),
                    rule: rule.name.clone(),
                    key: key.to_string(),
                    window_start_us: ws,
                    value,
                    message,
                    trigger_event_us: last.value(row),
                    source_snapshot: snapshot,
                    cooldown_us: micros(rule.cooldown),
                });
            }
        }
        Ok(batch.num_rows() as u64)
    }

    /// On a notifier's first start (no position yet), takes the output table's current
    /// snapshot as its position without recording any intent: what is already there is not
    /// notified, only what comes next. Returns whether it set the position.
    pub async fn start_at_latest(&self) -> Result<bool> {
        let from = self
            .ledger
            .position(&self.spec.name, &self.namespace)
            .await?;
        if from.is_some() {
            return Ok(false);
        }
        Ok(self.move_to_latest(None).await?.is_some())
    }

    /// When the position has expired (see [`Notifier::step`]), moves it to the output
    /// table's current snapshot without recording any intent: the outputs committed
    /// between are not notified. Returns the expired position and the new one; None when
    /// the position stands.
    pub async fn skip_expired(&self) -> Result<Option<(i64, i64)>> {
        let Some(from) = self
            .ledger
            .position(&self.spec.name, &self.namespace)
            .await?
        else {
            return Ok(None);
        };
        match self
            .lake
            .plan_appended_bounded(self.table, Some(from), 1)
            .await
        {
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
            Ok(_) => return Ok(None),
        }
        Ok(self.move_to_latest(Some(from)).await?.map(|to| (from, to)))
    }

    /// Moves the position from `from` (compare-and-set) to the output table's current
    /// snapshot, holding it, without recording any intent. Returns the new position; None
    /// when the table has no snapshot.
    async fn move_to_latest(&self, from: Option<i64>) -> Result<Option<i64>> {
        let Some(latest) = self
            .lake
            .snapshots(self.table)
            .await?
            .last()
            .map(|s| s.snapshot_id)
        else {
            return Ok(None);
        };
        self.ledger
            .commit_intents(
                &self.spec.name,
                &self.namespace,
                from,
                latest,
                &[],
                self.dry(),
            )
            .await?;
        self.lake
            .hold_snapshot(
                self.table,
                &format!("effects:{}:{}", self.spec.name, self.namespace),
                latest,
            )
            .await?;
        Ok(Some(latest))
    }

    /// The read of a step from `from`: an expired position is an error that says why and
    /// what to do.
    async fn plan_step(
        &self,
        from: Option<i64>,
        max_snapshots: usize,
    ) -> Result<signalweave_lake::IncrementalPlan> {
        match self
            .lake
            .plan_appended_bounded(self.table, from, max_snapshots)
            .await
        {
            Ok(plan) => Ok(plan),
            Err(e) if e.kind() == ErrorKind::NotFound && from.is_some() => Err(EffectError::new(
                ErrorKind::NotFound,
                format!(
                    "{} ({}): its position on {} has expired ({e}); an erasure expires \
                         every snapshot before it, held or not. The outputs committed since \
                         can no longer be told from those before: run with --skip-expired to \
                         go on from the current snapshot without notifying them",
                    self.spec.name,
                    self.namespace,
                    self.table.name()
                ),
            )),
            Err(e) => Err(e.into()),
        }
    }

    /// Reads the output snapshots after the position (at most `max_snapshots`) and records
    /// their intents with the new position. Returns what it did (nothing when caught up).
    pub async fn step(&self, max_snapshots: usize) -> Result<NotifyStep> {
        let from = self
            .ledger
            .position(&self.spec.name, &self.namespace)
            .await?;
        let mut attempts = 0;
        let plan = loop {
            attempts += 1;
            let plan = self.plan_step(from, max_snapshots).await?;
            let (None, Some(upto)) = (from, plan.upto) else {
                break plan;
            };
            // A first read plans from a retained snapshot nothing holds yet, which expiry
            // may remove while the outputs are read: the position would then name a
            // snapshot that is gone. It is held before it is read, and the read planned
            // again if it went first.
            let holder = format!("effects:{}:{}", self.spec.name, self.namespace);
            match self
                .lake
                .hold_present_snapshot(self.table, &holder, upto)
                .await
            {
                Ok(()) => break plan,
                Err(e) if e.kind() == ErrorKind::Conflict && attempts < 5 => {
                    tracing::info!(job = %self.spec.name, namespace = %self.namespace, snapshot = upto, "the first snapshot to read expired before it was held; planning again");
                }
                Err(e) => return Err(e.into()),
            }
        };
        let Some(upto) = plan.upto else {
            return Ok(NotifyStep::default());
        };
        if Some(upto) == from {
            return Ok(NotifyStep::default());
        }
        let mut report = NotifyStep {
            snapshots: plan.snapshots.len(),
            ..Default::default()
        };
        let mut intents = Vec::new();
        for (snapshot, tasks) in plan.by_snapshot() {
            let mut stream = self.lake.read(self.table, tasks).await?;
            while let Some(batch) = stream.try_next().await.map_err(|e| {
                EffectError::new(ErrorKind::Unavailable, format!("read outputs: {e}"))
            })? {
                report.rows += self.intents_of(&batch, snapshot, &mut intents)?;
            }
        }
        let mut seen = HashSet::new();
        intents.retain(|i| seen.insert(i.effect_id.clone()));
        report.intents = intents.len() as u64;
        fault_point("before_intent");
        report.recorded = self
            .ledger
            .commit_intents(
                &self.spec.name,
                &self.namespace,
                from,
                upto,
                &intents,
                self.dry(),
            )
            .await?;
        fault_point("after_intent");
        // The new position is held like a checkpoint's: expiry keeps it and every later
        // snapshot, so a notifier stopped for longer than the table's retention resumes.
        self.lake
            .hold_snapshot(
                self.table,
                &format!("effects:{}:{}", self.spec.name, self.namespace),
                upto,
            )
            .await?;
        tracing::debug!(job = %self.spec.name, namespace = %self.namespace, ?report, "notifier step");
        Ok(report)
    }
}
