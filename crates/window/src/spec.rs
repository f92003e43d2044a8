//! Job specs: `jobs/*.toml` parsed into a typed, validated [`JobSpec`].
//!
//! ```toml
//! name = "market_aggregates"
//! version = 1
//! [source]
//! table = "signalweave.events"
//! event_types = ["order_placed", "order_paid", "order_cancelled"]
//! [key]
//! columns = ["market_id"]
//! [time]
//! event_time_column = "event_time"
//! max_out_of_orderness = "5s"
//! idle_timeout = "1m"
//! [window]
//! kind = "tumbling"          # tumbling | sliding | session
//! size = "1m"                # tumbling and sliding
//! # slide = "1m"             # sliding: size must be a multiple of slide
//! # gap = "5m"               # session
//! [triggers]
//! early_every = "20s"        # provisional emissions (not for session windows)
//! [lateness]
//! allowed = "2h"
//! [dedup]
//! replay_horizon = "1h"      # horizon = allowed lateness + window span + replay horizon
//! [[aggregates]]
//! name = "placed_count"
//! function = "count"
//! event_type = "order_placed"
//! [output]
//! table = "market_aggregates"
//! ```
//!
//! Validation errors name the offending field (`window.slide`, `aggregates[2].column`).

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Result, WindowError};

/// A validated job spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// Job name: output identities and checkpoints are per job.
    pub name: String,
    /// Job version: a new version is a new spec file; outputs record it.
    pub version: u32,
    /// What the job computes.
    #[serde(default)]
    pub description: Option<String>,
    /// Where events come from.
    pub source: SourceSpec,
    /// Key columns.
    pub key: KeySpec,
    /// Event-time column and watermark rules.
    pub time: TimeSpec,
    /// Window assignment.
    pub window: WindowSpec,
    /// When windows emit.
    #[serde(default)]
    pub triggers: TriggerSpec,
    /// How late an event may be and still correct its window.
    pub lateness: LatenessSpec,
    /// Duplicate suppression.
    #[serde(default)]
    pub dedup: DedupSpec,
    /// Aggregates, in output column order.
    pub aggregates: Vec<AggregateSpec>,
    /// Output table.
    pub output: OutputSpec,
}

/// Source table and filter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceSpec {
    /// Source table, normally `signalweave.events`.
    pub table: String,
    /// Event types the job reads; empty means all.
    #[serde(default)]
    pub event_types: Vec<String>,
}

/// Key columns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeySpec {
    /// Columns whose values form the key; a record with a null key column is routed to
    /// the late output with reason `null_key`.
    pub columns: Vec<String>,
}

/// Event time and watermarks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeSpec {
    /// Timestamp column (microseconds, UTC).
    #[serde(default = "default_event_time_column")]
    pub event_time_column: String,
    /// The watermark trails the largest event time seen per input by this much.
    #[serde(with = "humantime_serde")]
    pub max_out_of_orderness: Duration,
    /// An input silent for this long (processing time) is left out of the watermark.
    #[serde(with = "humantime_serde", default = "default_idle_timeout")]
    pub idle_timeout: Duration,
    /// Column naming the input of each record (for example `producer_id`); without it,
    /// the caller names the input of each batch.
    #[serde(default)]
    pub input_column: Option<String>,
}

fn default_event_time_column() -> String {
    "event_time".into()
}

fn default_idle_timeout() -> Duration {
    Duration::from_secs(60)
}

/// Window assignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum WindowSpec {
    /// Fixed, non-overlapping windows of `size`.
    Tumbling {
        /// Window length.
        #[serde(with = "humantime_serde")]
        size: Duration,
    },
    /// Windows of `size` starting every `slide` (`size` a multiple of `slide`).
    Sliding {
        /// Window length.
        #[serde(with = "humantime_serde")]
        size: Duration,
        /// Distance between window starts.
        #[serde(with = "humantime_serde")]
        slide: Duration,
    },
    /// Per-key sessions closed by `gap` of inactivity.
    Session {
        /// Inactivity that closes a session.
        #[serde(with = "humantime_serde")]
        gap: Duration,
    },
}

impl WindowSpec {
    /// The longest a window spans in event time (size, or gap for sessions), µs.
    pub fn span_us(&self) -> i64 {
        match self {
            WindowSpec::Tumbling { size } | WindowSpec::Sliding { size, .. } => micros(*size),
            WindowSpec::Session { gap } => micros(*gap),
        }
    }

    /// The start below which every window ends at or before `t` (µs): the earliest start
    /// of a window crossing `t`, or `t` when none crosses it. None for sessions, whose
    /// bounds depend on their events.
    pub fn starts_ending_by(&self, t: i64) -> Option<i64> {
        let (size, slide) = match self {
            WindowSpec::Tumbling { size } => (micros(*size), micros(*size)),
            WindowSpec::Sliding { size, slide } => (micros(*size), micros(*slide)),
            WindowSpec::Session { .. } => return None,
        };
        if slide <= 0 {
            return None;
        }
        // Windows start at multiples of the slide; the first crossing `t` is the first
        // that ends after it.
        let start = t
            .saturating_sub(size)
            .div_euclid(slide)
            .saturating_add(1)
            .saturating_mul(slide);
        Some(start.min(t))
    }
}

/// Triggers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TriggerSpec {
    /// Emit provisional versions of changed windows this often (processing time).
    #[serde(with = "humantime_serde", default)]
    pub early_every: Option<Duration>,
}

/// Lateness.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LatenessSpec {
    /// After the watermark passes a window's end, events may still correct it for this long.
    #[serde(with = "humantime_serde")]
    pub allowed: Duration,
    /// Where events later than that go.
    #[serde(default = "default_late_route")]
    pub route: String,
}

fn default_late_route() -> String {
    "signalweave.late_events".into()
}

/// Dedup.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DedupSpec {
    /// Identity columns; duplicates share all of them.
    #[serde(default = "default_identity")]
    pub identity: Vec<String>,
    /// How far replay can reach back: the horizon is allowed lateness + window span + this.
    #[serde(with = "humantime_serde", default = "default_replay_horizon")]
    pub replay_horizon: Duration,
}

fn default_identity() -> Vec<String> {
    vec!["tenant".into(), "event_id".into()]
}

fn default_replay_horizon() -> Duration {
    Duration::from_secs(3600)
}

impl Default for DedupSpec {
    fn default() -> Self {
        Self {
            identity: default_identity(),
            replay_horizon: default_replay_horizon(),
        }
    }
}

/// A decomposable aggregate function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AggregateFunction {
    /// Number of records (or of non-null `column` values).
    Count,
    /// Sum of an integer column.
    Sum,
    /// Minimum of an integer column (null when no value).
    Min,
    /// Maximum of an integer column (null when no value).
    Max,
    /// Mean of an integer column, derived from sum and count.
    Avg,
}

/// One aggregate output column.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AggregateSpec {
    /// Output column name.
    pub name: String,
    /// Function.
    pub function: AggregateFunction,
    /// Input column (integer); required except for `count`.
    #[serde(default)]
    pub column: Option<String>,
    /// Only records of this event type contribute.
    #[serde(default)]
    pub event_type: Option<String>,
}

/// Output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputSpec {
    /// Output table name (in namespace `signalweave`); a backfill appends `__bf_<namespace>`.
    pub table: String,
}

/// A duration in microseconds (saturating).
pub fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

fn invalid(field: &str, message: impl std::fmt::Display) -> WindowError {
    WindowError::invalid_spec(field, message.to_string())
}

const OUTPUT_RESERVED: [&str; 14] = [
    "job",
    "namespace",
    "job_version",
    "key",
    "window_start",
    "window_end",
    "output_version",
    "completeness",
    "retracted",
    "watermark",
    "emitted_at",
    "first_event_time",
    "last_event_time",
    "events",
];

impl JobSpec {
    /// Parses and validates a TOML spec.
    pub fn from_toml(text: &str) -> Result<Self> {
        let spec: JobSpec = toml::from_str(text).map_err(|e| {
            let field = e
                .span()
                .map(|s| {
                    let upto = &text[..s.start.min(text.len())];
                    upto.lines().count().to_string()
                })
                .map(|line| format!("line {line}"))
                .unwrap_or_else(|| "spec".into());
            WindowError::invalid_spec(&field, e.message().to_string())
        })?;
        spec.validate()?;
        Ok(spec)
    }

    /// Reads, parses and validates a spec file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| {
            WindowError::invalid_spec("file", format!("cannot read {}: {e}", path.display()))
        })?;
        Self::from_toml(&text).map_err(|e| e.in_file(path))
    }

    /// The dedup horizon: allowed lateness + window span + replay horizon, µs.
    pub fn dedup_horizon_us(&self) -> i64 {
        micros(self.lateness.allowed)
            .saturating_add(self.window.span_us())
            .saturating_add(micros(self.dedup.replay_horizon))
    }

    /// Checks the rules every field documents.
    pub fn validate(&self) -> Result<()> {
        if self.name.is_empty()
            || !self
                .name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            return Err(invalid("name", "must be non-empty snake_case"));
        }
        if self.version == 0 {
            return Err(invalid("version", "must be at least 1"));
        }
        if self.key.columns.is_empty() {
            return Err(invalid("key.columns", "needs at least one column"));
        }
        // Durations are used in microseconds: anything below 1 µs is zero to the engine.
        let positive = |d: Duration| micros(d) > 0;
        match self.window {
            WindowSpec::Tumbling { size } if !positive(size) => {
                return Err(invalid("window.size", "must be at least 1 µs"));
            }
            WindowSpec::Sliding { size, slide } => {
                if !positive(slide) || !positive(size) {
                    return Err(invalid(
                        "window.slide",
                        "size and slide must be at least 1 µs",
                    ));
                }
                if micros(size) % micros(slide) != 0 {
                    return Err(invalid(
                        "window.slide",
                        format!(
                            "size {} must be a multiple of slide {}",
                            humantime_serde::re::humantime::format_duration(size),
                            humantime_serde::re::humantime::format_duration(slide)
                        ),
                    ));
                }
                if micros(size) / micros(slide) > 1024 {
                    return Err(invalid("window.slide", "size/slide must be at most 1024"));
                }
            }
            WindowSpec::Session { gap } => {
                if !positive(gap) {
                    return Err(invalid("window.gap", "must be at least 1 µs"));
                }
                if self.triggers.early_every.is_some() {
                    return Err(invalid(
                        "triggers.early_every",
                        "session windows fire when the watermark passes the session's end; early firing would change their identity",
                    ));
                }
            }
            WindowSpec::Tumbling { .. } => {}
        }
        if !positive(self.time.idle_timeout) {
            return Err(invalid("time.idle_timeout", "must be at least 1 µs"));
        }
        if let Some(every) = self.triggers.early_every
            && !positive(every)
        {
            return Err(invalid("triggers.early_every", "must be at least 1 µs"));
        }
        if self.dedup.identity.is_empty() {
            return Err(invalid("dedup.identity", "needs at least one column"));
        }
        if self.aggregates.is_empty() {
            return Err(invalid("aggregates", "needs at least one aggregate"));
        }
        let mut names = std::collections::HashSet::new();
        for (i, a) in self.aggregates.iter().enumerate() {
            let field = |f: &str| format!("aggregates[{i}].{f}");
            if a.name.is_empty() || OUTPUT_RESERVED.contains(&a.name.as_str()) {
                return Err(invalid(
                    &field("name"),
                    format!("`{}` is empty or reserved", a.name),
                ));
            }
            if !names.insert(a.name.as_str()) {
                return Err(invalid(
                    &field("name"),
                    format!("`{}` is used twice", a.name),
                ));
            }
            if a.function != AggregateFunction::Count && a.column.is_none() {
                return Err(invalid(
                    &field("column"),
                    "required for sum, min, max and avg",
                ));
            }
            if let Some(t) = &a.event_type
                && !self.source.event_types.is_empty()
                && !self.source.event_types.contains(t)
            {
                return Err(invalid(
                    &field("event_type"),
                    format!("`{t}` is filtered out by source.event_types"),
                ));
            }
        }
        if self.output.table.is_empty() {
            return Err(invalid("output.table", "must be set"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_windows_that_end_by_a_time_are_those_starting_before_a_bound() {
        let min = |m: u64| Duration::from_secs(60 * m);
        let us = |m: i64| m * 60_000_000;
        let tumbling = WindowSpec::Tumbling { size: min(1) };
        assert_eq!(tumbling.starts_ending_by(us(60)), Some(us(60)));
        // [60m, 61m) crosses 60m30s.
        assert_eq!(tumbling.starts_ending_by(us(60) + 30_000_000), Some(us(60)));
        let sliding = WindowSpec::Sliding {
            size: min(10),
            slide: min(1),
        };
        // [51m, 61m) is the first to end after 60m; [50m, 60m) ends at it.
        assert_eq!(sliding.starts_ending_by(us(60)), Some(us(51)));
        assert_eq!(sliding.starts_ending_by(us(60) + 1), Some(us(51)));
        assert_eq!(sliding.starts_ending_by(us(-60)), Some(us(-69)));
        let session = WindowSpec::Session { gap: min(5) };
        assert_eq!(session.starts_ending_by(us(60)), None);
        assert!(tumbling.starts_ending_by(i64::MAX).is_some());
        assert!(sliding.starts_ending_by(i64::MIN).is_some());
    }
}
