//! Per-event freshness: from event time to the moment the output version that includes
//! the event is visible (its sink commit returned: the serving API and SQL read committed
//! snapshots), broken down by stage.
//!
//! One event in `sample_every` is followed. A followed event becomes *emitted* when an
//! output row of its key whose window covers its event time is emitted, and *visible* when
//! the checkpoint that commits that row completes.

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{DataType, TimestampMicrosecondType};
use hdrhistogram::Histogram;
use rustc_hash::FxHashMap;
use signalweave_window::Emissions;

/// The stages, in order, as exported in the `stage` label.
pub const STAGES: [&str; 6] = [
    "producer_transit",
    "durable_ingestion",
    "queue",
    "hold_processing",
    "sink_commit",
    "end_to_end",
];

/// Followed events not visible after this long are dropped (a window that never emits
/// again, for example a record later than allowed lateness), µs.
const GIVE_UP_US: i64 = 15 * 60 * 1_000_000;

#[derive(Debug, Clone)]
struct Sample {
    key: String,
    event_time: i64,
    ingest_time: i64,
    committed_at: i64,
    read_at: i64,
    emitted_at: i64,
    /// The window of the row that covered it, once emitted.
    window: (i64, i64),
}

/// Follows sampled events through the stages.
#[derive(Debug)]
pub struct Freshness {
    sample_every: u64,
    seen: u64,
    pending: Vec<Sample>,
    emitted: Vec<Sample>,
    /// Per stage: microsecond durations.
    histograms: Vec<Histogram<u64>>,
    /// Followed events given up on.
    pub dropped: u64,
}

impl Freshness {
    /// Follows one event in `sample_every` (at least 1).
    pub fn new(sample_every: u64) -> Self {
        Self {
            sample_every: sample_every.max(1),
            seen: 0,
            pending: Vec::new(),
            emitted: Vec::new(),
            histograms: STAGES
                .iter()
                .map(|_| Histogram::new_with_bounds(1, 24 * 3600 * 1_000_000, 3).expect("bounds"))
                .collect(),
            dropped: 0,
        }
    }

    /// Samples rows of an events `batch` read at `read_at` from a snapshot committed at
    /// `committed_at` (µs). `key_columns` are the job's key columns.
    pub fn observe(
        &mut self,
        batch: &RecordBatch,
        key_columns: &[String],
        committed_at: i64,
        read_at: i64,
    ) {
        let n = batch.num_rows() as u64;
        let first = (self.sample_every - self.seen % self.sample_every) % self.sample_every;
        self.seen += n;
        if first >= n {
            return;
        }
        let ts = |name: &str| {
            batch
                .column_by_name(name)
                .and_then(|c| c.as_primitive_opt::<TimestampMicrosecondType>().cloned())
        };
        let (Some(et), Some(it)) = (ts("event_time"), ts("ingest_time")) else {
            return;
        };
        let keys: Option<Vec<_>> = key_columns
            .iter()
            .map(|k| {
                batch
                    .column_by_name(k)
                    .and_then(|c| arrow::compute::cast(c, &DataType::Utf8).ok())
            })
            .collect();
        let Some(keys) = keys else { return };
        let keys: Vec<_> = keys.iter().map(|k| k.as_string::<i32>().clone()).collect();
        let mut row = first;
        while row < n {
            let r = row as usize;
            row += self.sample_every;
            if keys.iter().any(|k| k.is_null(r)) {
                continue;
            }
            // Joined as the engine joins output keys, so a value holding `|` still finds
            // its rows.
            let key =
                signalweave_model::join_key(&keys.iter().map(|k| k.value(r)).collect::<Vec<_>>());
            self.pending.push(Sample {
                key,
                event_time: et.value(r),
                ingest_time: it.value(r),
                committed_at,
                read_at,
                emitted_at: 0,
                window: (0, 0),
            });
        }
    }

    /// `rows` were emitted at `now` (µs): followed events they cover are emitted.
    pub fn emitted(&mut self, rows: &Emissions, now: i64) {
        if self.pending.is_empty() {
            return;
        }
        if !rows.is_empty() {
            let mut windows: FxHashMap<&str, Vec<(i64, i64)>> = FxHashMap::default();
            for i in (0..rows.len()).filter(|i| !rows.retracted()[*i]) {
                windows
                    .entry(rows.key(i))
                    .or_default()
                    .push((rows.window_start()[i], rows.window_end()[i]));
            }
            let mut still = Vec::with_capacity(self.pending.len());
            for mut s in std::mem::take(&mut self.pending) {
                let covered = windows.get(s.key.as_str()).and_then(|ws| {
                    ws.iter()
                        .find(|(start, end)| *start <= s.event_time && s.event_time < *end)
                });
                if let Some(&window) = covered {
                    s.emitted_at = now;
                    s.window = window;
                    self.emitted.push(s);
                } else {
                    still.push(s);
                }
            }
            self.pending = still;
        }
        let before = self.pending.len();
        self.pending.retain(|s| now - s.read_at < GIVE_UP_US);
        self.dropped += (before - self.pending.len()) as u64;
    }

    /// Forgets the emitted followed events whose covering row `gone` names by key and
    /// window (start, end): such rows were left out of the commit (an erasure), so they
    /// never become visible. Counted as given up on.
    pub fn drop_emitted(&mut self, mut gone: impl FnMut(&str, i64, i64) -> bool) {
        let before = self.emitted.len();
        self.emitted
            .retain(|s| !gone(&s.key, s.window.0, s.window.1));
        self.dropped += (before - self.emitted.len()) as u64;
    }

    /// The emitted rows became visible at `now` (µs). Returns each followed event's stage
    /// durations in seconds, in [`STAGES`] order.
    pub fn visible(&mut self, now: i64) -> Vec<[f64; 6]> {
        let mut out = Vec::with_capacity(self.emitted.len());
        for s in std::mem::take(&mut self.emitted) {
            let stages = [
                s.ingest_time - s.event_time,
                s.committed_at - s.ingest_time,
                s.read_at - s.committed_at,
                s.emitted_at - s.read_at,
                now - s.emitted_at,
                now - s.event_time,
            ];
            for (h, d) in self.histograms.iter_mut().zip(stages) {
                h.saturating_record(d.max(1) as u64);
            }
            out.push(stages.map(|d| d.max(0) as f64 / 1e6));
        }
        out
    }

    /// Quantile `q` of stage `stage` (index into [`STAGES`]), seconds.
    pub fn quantile(&self, stage: usize, q: f64) -> f64 {
        self.histograms
            .get(stage)
            .map(|h| h.value_at_quantile(q) as f64 / 1e6)
            .unwrap_or(0.0)
    }

    /// Followed events that became visible.
    pub fn samples(&self) -> u64 {
        self.histograms.last().map(|h| h.len()).unwrap_or(0)
    }

    /// Forgets followed events not yet visible (after a restart from a checkpoint, they
    /// are read again).
    pub fn reset_in_flight(&mut self) {
        self.pending.clear();
        self.emitted.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{StringArray, TimestampMicrosecondArray};
    use arrow::datatypes::{Field, Schema, TimeUnit};
    use std::sync::Arc;

    fn events(customers: &[&str], times: &[i64]) -> RecordBatch {
        let ts = || DataType::Timestamp(TimeUnit::Microsecond, None);
        let schema = Schema::new(vec![
            Field::new("tenant", DataType::Utf8, false),
            Field::new("customer_id", DataType::Utf8, false),
            Field::new("event_time", ts(), false),
            Field::new("ingest_time", ts(), false),
        ]);
        RecordBatch::try_new(
            Arc::new(schema),
            vec![
                Arc::new(StringArray::from(vec!["t"; customers.len()])),
                Arc::new(StringArray::from(customers.to_vec())),
                Arc::new(TimestampMicrosecondArray::from(times.to_vec())),
                Arc::new(TimestampMicrosecondArray::from(times.to_vec())),
            ],
        )
        .unwrap()
    }

    /// Samples of every event, emitted by rows keyed as the engine joins keys.
    fn emitted(customers: &[&str]) -> Freshness {
        let mut f = Freshness::new(1);
        let times: Vec<i64> = (0..customers.len() as i64).map(|i| 10 + i).collect();
        let keys = ["tenant".to_string(), "customer_id".to_string()];
        f.observe(&events(customers, &times), &keys, 100, 200);
        let mut rows = Emissions::default();
        for c in customers {
            rows.push_row(&signalweave_window::OutputRow {
                key: signalweave_model::join_key(&["t", c]),
                window_start: 0,
                window_end: 60_000_000,
                output_version: 1,
                completeness: signalweave_window::Completeness::OnTime,
                retracted: false,
                watermark: 0,
                emitted_at: 300,
                first_event_time: 10,
                last_event_time: 10,
                events: 1,
                values: Vec::new(),
            });
        }
        f.emitted(&rows, 300);
        f
    }

    #[test]
    fn a_key_holding_the_separator_is_followed_to_its_rows() {
        let mut f = emitted(&["a|b", "c"]);
        assert_eq!(f.visible(400).len(), 2, "both followed events are visible");
    }

    #[test]
    fn samples_of_rows_left_out_are_given_up_on() {
        let mut f = emitted(&["a", "b"]);
        let erased = signalweave_model::join_key(&["t", "a"]);
        f.drop_emitted(|key, start, end| key == erased && (start, end) == (0, 60_000_000));
        assert_eq!(f.visible(400).len(), 1);
        assert_eq!(f.dropped, 1);
    }
}
