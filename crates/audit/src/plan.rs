//! The capacity model: `signalweave plan --sheet fixtures/slo-sheet.toml`.
//!
//! Every figure derives from the sheet's inputs (or, for the inputs a running system
//! measures, from [`Measured`]). Nothing is fitted: the formulas are the ones printed
//! next to each figure.
//! - Freshness ledger: the sum of the stage budgets, against the freshness objective.
//! - Burst: arriving at `burst_rate` for `burst_duration` against `capacity` leaves
//!   `(burst − capacity) × duration` records, drained at `capacity − sustained`.
//! - Scale delay: until added capacity arrives, `(burst − capacity) × scale_delay`
//!   accumulate, caught up at `scaled_capacity − burst`.
//! - Retained bytes: `average_rate × retention × bytes_at_rest`, times `copies`.
//! - Byte flows: ingest `sustained × wire bytes`; replica writes `ingest × copies`;
//!   shuffle `ingest × projected_fraction × (workers − 1) / workers` (a record stays on
//!   its key's worker one time in `workers`); sink `active_keys / early_every × row bytes`.
//! - State: dedup identities `sustained × dedup_horizon × identity_bytes` plus window
//!   state `active_keys × bytes_per_key`; checkpoints keep `checkpoint_copies`.
//! - Backfill lower bounds: `records / rate` at the guaranteed floor and when borrowing.
//!
//! Objectives are checked at the sheet's load, and each is solved for the load
//! multiplier at which it stops holding: the smallest multiplier fails first.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use signalweave_model::ErrorKind;

use crate::error::{AuditError, Result};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
const TIB: f64 = GIB * 1024.0;
const MIB: f64 = 1024.0 * 1024.0;

/// The sheet: objectives and the design's inputs.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Sheet {
    /// What must hold.
    pub objectives: Objectives,
    /// Per-stage freshness budgets, in stage order.
    pub freshness_ledger: Vec<Stage>,
    /// Arrival and processing rates.
    pub traffic: Traffic,
    /// What the lake keeps.
    pub storage: Storage,
    /// What moves between machines.
    pub flows: Flows,
    /// Processor state.
    pub state: StateSheet,
    /// The backfill to plan for.
    pub backfill: BackfillSheet,
}

/// Objectives.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Objectives {
    /// Event time to visible output.
    #[serde(with = "humantime_serde")]
    pub freshness: Duration,
    /// A burst's backlog drains within this after the burst.
    #[serde(with = "humantime_serde")]
    pub burst_drain: Duration,
    /// The scale-delay backlog is caught up within this after capacity arrives.
    #[serde(with = "humantime_serde")]
    pub scale_catch_up: Duration,
    /// Object storage available, GiB (all copies).
    pub storage_budget_gib: f64,
    /// Memory for live state, GiB.
    pub state_memory_gib: f64,
    /// A backfill of the planned range finishes at its floor within this.
    #[serde(with = "humantime_serde")]
    pub backfill_within: Duration,
}

/// One stage of the freshness ledger.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Stage {
    /// Stage name.
    pub stage: String,
    /// Its budget.
    #[serde(with = "humantime_serde")]
    pub budget: Duration,
}

/// Rates.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Traffic {
    /// Steady arrival, records/s.
    pub sustained_rate: f64,
    /// Arrival during a burst, records/s.
    pub burst_rate: f64,
    /// How long a burst lasts.
    #[serde(with = "humantime_serde")]
    pub burst_duration: Duration,
    /// What the processors handle, records/s.
    pub capacity: f64,
    /// Capacity after a scale-out, records/s.
    pub scaled_capacity: f64,
    /// From the start of a burst until added capacity works.
    #[serde(with = "humantime_serde")]
    pub scale_delay: Duration,
    /// Average bytes of an event at the gateway.
    pub event_wire_bytes: f64,
}

/// Retention.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Storage {
    /// Arrival averaged over a day, records/s.
    pub average_rate: f64,
    /// How long the landing table keeps events.
    #[serde(with = "humantime_serde")]
    pub retention: Duration,
    /// Bytes of an event in compressed Parquet.
    pub bytes_at_rest: f64,
    /// Copies object storage keeps.
    pub copies: f64,
}

/// Flows.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Flows {
    /// Fraction of an event's bytes the job reads and ships.
    pub projected_fraction: f64,
    /// Processing workers (key groups spread over them).
    pub workers: f64,
    /// Keys with open windows.
    pub active_keys: f64,
    /// Early trigger interval: each active key emits once per interval.
    #[serde(with = "humantime_serde")]
    pub early_every: Duration,
    /// Bytes of an output row.
    pub output_row_bytes: f64,
}

/// State.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StateSheet {
    /// How long dedup identities are kept (allowed lateness + window + replay horizon).
    #[serde(with = "humantime_serde")]
    pub dedup_horizon: Duration,
    /// Bytes per dedup identity.
    pub identity_bytes: f64,
    /// Window state per active key.
    pub bytes_per_key: f64,
    /// Checkpoint copies kept.
    pub checkpoint_copies: f64,
}

/// The backfill to plan for.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BackfillSheet {
    /// Records in the range.
    pub records: f64,
    /// Guaranteed floor, records/s.
    pub floor_rate: f64,
    /// Rate when borrowing idle capacity, records/s.
    pub borrowed_rate: f64,
}

impl Sheet {
    /// Reads and checks a sheet.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            AuditError::new(
                ErrorKind::NotFound,
                format!("cannot read {}: {e}", path.display()),
            )
        })?;
        Self::from_toml(&text)
            .map_err(|e| AuditError::new(e.kind(), format!("{}: {e}", path.display())))
    }

    /// Parses and checks a sheet.
    pub fn from_toml(text: &str) -> Result<Self> {
        let sheet: Sheet = toml::from_str(text)
            .map_err(|e| AuditError::new(ErrorKind::InvalidInput, format!("sheet: {e}")))?;
        sheet.validate()?;
        Ok(sheet)
    }

    fn validate(&self) -> Result<()> {
        let t = &self.traffic;
        let positive = [
            ("traffic.sustained_rate", t.sustained_rate),
            ("traffic.burst_rate", t.burst_rate),
            ("traffic.capacity", t.capacity),
            ("traffic.scaled_capacity", t.scaled_capacity),
            ("traffic.event_wire_bytes", t.event_wire_bytes),
            ("storage.average_rate", self.storage.average_rate),
            ("storage.bytes_at_rest", self.storage.bytes_at_rest),
            ("storage.copies", self.storage.copies),
            ("flows.workers", self.flows.workers),
            ("flows.output_row_bytes", self.flows.output_row_bytes),
            ("state.identity_bytes", self.state.identity_bytes),
            ("state.checkpoint_copies", self.state.checkpoint_copies),
            ("backfill.records", self.backfill.records),
            ("backfill.floor_rate", self.backfill.floor_rate),
            ("backfill.borrowed_rate", self.backfill.borrowed_rate),
            (
                "objectives.storage_budget_gib",
                self.objectives.storage_budget_gib,
            ),
            (
                "objectives.state_memory_gib",
                self.objectives.state_memory_gib,
            ),
        ];
        for (name, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(AuditError::new(
                    ErrorKind::InvalidInput,
                    format!("{name} must be a positive number (got {v})"),
                ));
            }
        }
        if !(0.0..=1.0).contains(&self.flows.projected_fraction) {
            return Err(AuditError::new(
                ErrorKind::InvalidInput,
                "flows.projected_fraction must be between 0 and 1",
            ));
        }
        if self.flows.early_every.is_zero() {
            return Err(AuditError::new(
                ErrorKind::InvalidInput,
                "flows.early_every must be positive",
            ));
        }
        if self.freshness_ledger.is_empty() {
            return Err(AuditError::new(
                ErrorKind::InvalidInput,
                "freshness_ledger needs at least one stage",
            ));
        }
        Ok(())
    }
}

/// Figures a running system measured (`signalweave status`), replacing assumed ones.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Measured {
    /// Where they came from.
    pub source: String,
    /// Records per second the live jobs read.
    pub sustained_rate: Option<f64>,
    /// End-to-end freshness p99, s.
    pub freshness_p99_s: Option<f64>,
    /// Live state, bytes (all jobs).
    pub state_bytes: Option<f64>,
    /// Keys in state (all jobs).
    pub state_keys: Option<f64>,
    /// Age of the oldest unprocessed commit, s (the queue stage).
    pub queue_age_s: Option<f64>,
    /// Last sink commit, s (the sink stage).
    pub sink_commit_s: Option<f64>,
}

/// One objective: the figure, the limit, and the load multiplier at which it fails.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ObjectiveCheck {
    /// Objective.
    pub objective: String,
    /// The figure at the sheet's (or measured) load.
    pub figure: String,
    /// The limit.
    pub limit: String,
    /// Whether it holds now.
    pub holds: bool,
    /// Load multiplier (all arrival rates and their state scaled) at which it stops
    /// holding; None when load does not move it.
    pub fails_at_load: Option<f64>,
    /// Whether a measured figure decided it.
    pub measured: bool,
}

/// The computed plan.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Plan {
    /// Freshness ledger: (stage, budget s), in order.
    pub ledger: Vec<(String, f64)>,
    /// Sum of the ledger, s.
    pub ledger_total_s: f64,
    /// Burst backlog, records.
    pub burst_backlog_records: f64,
    /// Drain after the burst, s.
    pub burst_drain_s: f64,
    /// Scale-delay backlog, records.
    pub scale_backlog_records: f64,
    /// Catch-up once scaled, s.
    pub scale_catch_up_s: f64,
    /// Retained logical bytes.
    pub retained_bytes: f64,
    /// Retained bytes with all copies.
    pub retained_bytes_all_copies: f64,
    /// Ingest flow, B/s.
    pub ingest_bytes_per_s: f64,
    /// Replica writes, B/s.
    pub replica_bytes_per_s: f64,
    /// Shuffle, B/s.
    pub shuffle_bytes_per_s: f64,
    /// Sink writes, B/s.
    pub sink_bytes_per_s: f64,
    /// Live state, bytes.
    pub state_bytes: f64,
    /// State with checkpoint copies, bytes.
    pub state_bytes_checkpointed: f64,
    /// Backfill at the floor, s.
    pub backfill_at_floor_s: f64,
    /// Backfill when borrowing, s.
    pub backfill_borrowing_s: f64,
    /// Objectives.
    pub objectives: Vec<ObjectiveCheck>,
    /// The objective with the smallest failing load multiplier.
    pub fails_first: Option<String>,
    /// Measured figures used, if any.
    pub measured: Option<Measured>,
}

/// `12,345,678`.
pub fn thousands(v: f64) -> String {
    let s = format!("{:.0}", v.round());
    let (sign, digits) = match s.strip_prefix('-') {
        Some(d) => ("-", d),
        None => ("", s.as_str()),
    };
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    format!("{sign}{out}")
}

/// `350.19 GiB` / `1.026 TiB` / `58.59 MiB`.
pub fn bytes_text(b: f64) -> String {
    if b >= TIB {
        format!("{:.3} TiB", b / TIB)
    } else if b >= GIB {
        format!("{:.2} GiB", b / GIB)
    } else {
        format!("{:.2} MiB", b / MIB)
    }
}

/// `44.44 h` / `80 min` / `240 s`.
pub fn duration_text(s: f64) -> String {
    if s >= 3.0 * 3600.0 {
        format!("{:.2} h", s / 3600.0)
    } else if s >= 600.0 {
        let m = s / 60.0;
        if (m - m.round()).abs() < 1e-9 {
            format!("{m:.0} min")
        } else {
            format!("{m:.1} min")
        }
    } else {
        format!("{s:.0} s")
    }
}

/// Solves `a·m ≤ b` for the largest m (None when `a ≤ 0`: load does not move it).
fn ratio(b: f64, a: f64) -> Option<f64> {
    (a > 0.0).then(|| b / a)
}

/// Computes the plan of `sheet`, with `measured` figures where given.
pub fn plan(sheet: &Sheet, measured: Option<&Measured>) -> Plan {
    let t = &sheet.traffic;
    let o = &sheet.objectives;
    let s = measured
        .and_then(|m| m.sustained_rate)
        .unwrap_or(t.sustained_rate);
    let (b, c, c2) = (t.burst_rate, t.capacity, t.scaled_capacity);
    let burst_s = t.burst_duration.as_secs_f64();
    let delay_s = t.scale_delay.as_secs_f64();

    let mut ledger: Vec<(String, f64)> = sheet
        .freshness_ledger
        .iter()
        .map(|st| (st.stage.clone(), st.budget.as_secs_f64()))
        .collect();
    if let Some(m) = measured {
        for (stage, v) in ledger.iter_mut() {
            match stage.as_str() {
                "queue" => *v = m.queue_age_s.unwrap_or(*v),
                "sink_commit" => *v = m.sink_commit_s.unwrap_or(*v),
                _ => {}
            }
        }
    }
    // The measured stages count in the total, and so in the freshness figure when no
    // p99 was measured.
    let ledger_total_s: f64 = ledger.iter().map(|(_, v)| v).sum();

    let burst_backlog = (b - c).max(0.0) * burst_s;
    let burst_drain = if c > s {
        burst_backlog / (c - s)
    } else {
        f64::INFINITY
    };
    let scale_backlog = (b - c).max(0.0) * delay_s;
    let catch_up = if c2 > b {
        scale_backlog / (c2 - b)
    } else {
        f64::INFINITY
    };

    let st = &sheet.storage;
    let retained = st.average_rate * st.retention.as_secs_f64() * st.bytes_at_rest;
    let retained_all = retained * st.copies;

    let f = &sheet.flows;
    let ingest = s * t.event_wire_bytes;
    let replica = ingest * st.copies;
    let shuffle = ingest * f.projected_fraction * (f.workers - 1.0) / f.workers;
    let sink = f.active_keys / f.early_every.as_secs_f64() * f.output_row_bytes;

    let sh = &sheet.state;
    let dedup = s * sh.dedup_horizon.as_secs_f64() * sh.identity_bytes;
    let windows = f.active_keys * sh.bytes_per_key;
    let computed_state = dedup + windows;
    let state = measured
        .and_then(|m| m.state_bytes)
        .unwrap_or(computed_state);
    let state_ckpt = state * sh.checkpoint_copies;

    let bf = &sheet.backfill;
    let at_floor = bf.records / bf.floor_rate;
    let borrowing = bf.records / bf.borrowed_rate;

    // Objectives, and the load multiplier m at which each fails (rates × m; the burst
    // and sustained rates scale together, capacities do not).
    let mut objectives = Vec::new();
    let freshness_figure = measured
        .and_then(|m| m.freshness_p99_s)
        .unwrap_or(ledger_total_s);
    let fresh_limit = o.freshness.as_secs_f64();
    objectives.push(ObjectiveCheck {
        objective: "freshness (p99, event time to visible)".into(),
        figure: format!("{freshness_figure:.1} s"),
        limit: format!("{fresh_limit:.0} s"),
        holds: freshness_figure <= fresh_limit,
        fails_at_load: None,
        measured: measured.and_then(|m| m.freshness_p99_s).is_some(),
    });
    objectives.push(ObjectiveCheck {
        objective: "sustained load below capacity".into(),
        figure: format!("{} rec/s", thousands(s)),
        limit: format!("{} rec/s", thousands(c)),
        holds: s < c,
        fails_at_load: ratio(c, s),
        measured: measured.and_then(|m| m.sustained_rate).is_some(),
    });
    // (b·m − c)·T ≤ L·(c − s·m)  ⇔  m ≤ c·(L + T) / (b·T + L·s)
    let l = o.burst_drain.as_secs_f64();
    objectives.push(ObjectiveCheck {
        objective: "burst backlog drains".into(),
        figure: duration_text(burst_drain),
        limit: duration_text(l),
        holds: burst_drain <= l,
        fails_at_load: ratio(c * (l + burst_s), b * burst_s + l * s),
        measured: false,
    });
    // (b·m − c)·d ≤ L·(c2 − b·m)  ⇔  m ≤ (L·c2 + c·d) / (b·(d + L))
    let l = o.scale_catch_up.as_secs_f64();
    objectives.push(ObjectiveCheck {
        objective: "scale-delay backlog caught up".into(),
        figure: duration_text(catch_up),
        limit: duration_text(l),
        holds: catch_up <= l,
        fails_at_load: ratio(l * c2 + c * delay_s, b * (delay_s + l)),
        measured: false,
    });
    let budget = o.storage_budget_gib * GIB;
    objectives.push(ObjectiveCheck {
        objective: "retained bytes within storage".into(),
        figure: bytes_text(retained_all),
        limit: bytes_text(budget),
        holds: retained_all <= budget,
        fails_at_load: ratio(budget, retained_all),
        measured: false,
    });
    let memory = o.state_memory_gib * GIB;
    objectives.push(ObjectiveCheck {
        objective: "state within memory".into(),
        figure: bytes_text(state),
        limit: bytes_text(memory),
        holds: state <= memory,
        fails_at_load: ratio(memory, state),
        measured: measured.and_then(|m| m.state_bytes).is_some(),
    });
    let within = o.backfill_within.as_secs_f64();
    objectives.push(ObjectiveCheck {
        objective: "backfill at its floor within the window".into(),
        figure: duration_text(at_floor),
        limit: duration_text(within),
        holds: at_floor <= within,
        fails_at_load: ratio(within, at_floor),
        measured: false,
    });
    let fails_first = objectives
        .iter()
        .filter(|o| !o.holds)
        .map(|o| o.objective.clone())
        .next()
        .or_else(|| {
            objectives
                .iter()
                .filter_map(|o| o.fails_at_load.map(|m| (m, &o.objective)))
                .min_by(|a, b| a.0.total_cmp(&b.0))
                .map(|(_, name)| name.clone())
        });
    Plan {
        ledger,
        ledger_total_s,
        burst_backlog_records: burst_backlog,
        burst_drain_s: burst_drain,
        scale_backlog_records: scale_backlog,
        scale_catch_up_s: catch_up,
        retained_bytes: retained,
        retained_bytes_all_copies: retained_all,
        ingest_bytes_per_s: ingest,
        replica_bytes_per_s: replica,
        shuffle_bytes_per_s: shuffle,
        sink_bytes_per_s: sink,
        state_bytes: state,
        state_bytes_checkpointed: state_ckpt,
        backfill_at_floor_s: at_floor,
        backfill_borrowing_s: borrowing,
        objectives,
        fails_first,
        measured: measured.cloned(),
    }
}

impl Plan {
    /// The figures as (section, figure, value, how) rows.
    pub fn rows(&self, sheet: &Sheet) -> Vec<[String; 4]> {
        let t = &sheet.traffic;
        let mut rows = Vec::new();
        let mut row = |a: &str, b: &str, c: String, d: String| {
            rows.push([a.to_string(), b.to_string(), c, d]);
        };
        for (stage, v) in &self.ledger {
            row(
                "freshness ledger",
                stage,
                format!("{v:.0} s"),
                "budget".into(),
            );
        }
        row(
            "freshness ledger",
            "total",
            format!("{:.0} s", self.ledger_total_s),
            format!(
                "sum of the stage budgets (objective {:.0} s)",
                sheet.objectives.freshness.as_secs_f64()
            ),
        );
        row(
            "burst",
            "backlog",
            format!("{} records", thousands(self.burst_backlog_records)),
            format!(
                "({} − {}) rec/s × {}",
                thousands(t.burst_rate),
                thousands(t.capacity),
                duration_text(t.burst_duration.as_secs_f64())
            ),
        );
        row(
            "burst",
            "drain",
            duration_text(self.burst_drain_s),
            "backlog / (capacity − sustained)".into(),
        );
        row(
            "scale delay",
            "backlog",
            format!("{} records", thousands(self.scale_backlog_records)),
            format!(
                "(burst − capacity) × {}",
                duration_text(t.scale_delay.as_secs_f64())
            ),
        );
        row(
            "scale delay",
            "catch-up",
            duration_text(self.scale_catch_up_s),
            "backlog / (scaled capacity − burst)".into(),
        );
        row(
            "retention",
            "logical",
            bytes_text(self.retained_bytes),
            "average rate × retention × bytes at rest".into(),
        );
        row(
            "retention",
            "all copies",
            bytes_text(self.retained_bytes_all_copies),
            format!("× {} copies", sheet.storage.copies),
        );
        row(
            "byte flows",
            "ingest",
            format!("{:.2} MiB/s", self.ingest_bytes_per_s / MIB),
            "sustained × event wire bytes".into(),
        );
        row(
            "byte flows",
            "replica writes",
            format!("{:.2} MiB/s", self.replica_bytes_per_s / MIB),
            "ingest × copies".into(),
        );
        row(
            "byte flows",
            "shuffle",
            format!("{:.2} MiB/s", self.shuffle_bytes_per_s / MIB),
            "ingest × projected fraction × (workers − 1) / workers".into(),
        );
        row(
            "byte flows",
            "sink",
            format!("{:.2} MiB/s", self.sink_bytes_per_s / MIB),
            "active keys / early interval × output row bytes".into(),
        );
        row(
            "state",
            "live",
            bytes_text(self.state_bytes),
            "dedup identities + window state per key".into(),
        );
        row(
            "state",
            "with checkpoints",
            bytes_text(self.state_bytes_checkpointed),
            format!("× {} checkpoint copies", sheet.state.checkpoint_copies),
        );
        row(
            "backfill",
            "at the floor",
            duration_text(self.backfill_at_floor_s),
            format!(
                "{} records / {} rec/s",
                thousands(sheet.backfill.records),
                thousands(sheet.backfill.floor_rate)
            ),
        );
        row(
            "backfill",
            "borrowing",
            duration_text(self.backfill_borrowing_s),
            format!(
                "{} records / {} rec/s",
                thousands(sheet.backfill.records),
                thousands(sheet.backfill.borrowed_rate)
            ),
        );
        rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn number_formats() {
        assert_eq!(thousands(72_000_000.0), "72,000,000");
        assert_eq!(thousands(999.0), "999");
        assert_eq!(thousands(-1234.0), "-1,234");
        assert_eq!(duration_text(4800.0), "80 min");
        assert_eq!(duration_text(240.0), "240 s");
        assert_eq!(duration_text(160_000.0), "44.44 h");
        assert_eq!(bytes_text(376_012_800_000.0), "350.19 GiB");
    }

    fn sheet() -> Sheet {
        Sheet::from_file(Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../fixtures/slo-sheet.toml"
        )))
        .unwrap()
    }

    #[test]
    fn measured_figures_replace_assumed_ones_and_name_what_fails_first() {
        let s = sheet();
        let assumed = plan(&s, None);
        assert!(assumed.objectives.iter().all(|o| o.holds));
        // At the sheet's load the burst drain has the least headroom: ×585/576.
        assert_eq!(assumed.fails_first.as_deref(), Some("burst backlog drains"));
        let drain = &assumed.objectives[2];
        assert!((drain.fails_at_load.unwrap() - 585.0 / 576.0).abs() < 1e-12);
        // A measured p99 above the objective fails now, whatever the headroom elsewhere.
        let slow = Measured {
            source: "test".into(),
            freshness_p99_s: Some(350.0),
            sustained_rate: Some(10_000.0),
            ..Default::default()
        };
        let p = plan(&s, Some(&slow));
        assert_eq!(
            p.fails_first.as_deref(),
            Some("freshness (p99, event time to visible)")
        );
        assert!(!p.objectives[0].holds && p.objectives[0].measured);
        // The measured rate replaces the sheet's: ingest and dedup state follow it.
        assert!((p.ingest_bytes_per_s - 10_000.0 * 1228.8).abs() < 1e-6);
        assert!(p.state_bytes < assumed.state_bytes);
        // More load than capacity: that objective fails now.
        let hot = Measured {
            sustained_rate: Some(70_000.0),
            ..Default::default()
        };
        let p = plan(&s, Some(&hot));
        assert_eq!(
            p.fails_first.as_deref(),
            Some("sustained load below capacity")
        );
        assert!(p.burst_drain_s.is_infinite());
        // Measured stage times replace the sheet's in the ledger and in its total.
        let queued = Measured {
            queue_age_s: Some(1_000.0),
            ..Default::default()
        };
        let p = plan(&s, Some(&queued));
        let queue = assumed.ledger.iter().find(|(s, _)| s == "queue").unwrap().1;
        assert!((p.ledger_total_s - (assumed.ledger_total_s - queue + 1_000.0)).abs() < 1e-9);
        assert!(
            !p.objectives[0].holds,
            "the total is the freshness figure: {p:?}"
        );
    }

    #[test]
    fn a_bad_sheet_names_the_field() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../fixtures/slo-sheet.toml"
        ))
        .unwrap();
        let bad = text.replace("capacity = 65000", "capacity = -1");
        let e = Sheet::from_toml(&bad).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        assert!(e.to_string().contains("traffic.capacity"), "{e}");
        let e = Sheet::from_toml(&text.replace("[backfill]", "[backfil]")).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
    }
}
