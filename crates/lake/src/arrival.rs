//! The watermark a tailing reader had when a record arrived, recovered from metadata.
//!
//! A live job reads the landing table commit by commit; its watermark before a commit is
//! the largest event time of the commits before it, minus the out-of-orderness bound. A
//! backfill that wants to classify late records as the live job did needs that watermark
//! for each record's arrival. Arrival is ordered by (ingest time, sequence number of the
//! data file): ingest time first, and the commit order among files stamped with the same
//! ingest time (a bulk load stamps all its chunks with one clock). The data files' column
//! statistics give the watermark without reading any data: each file contributes its
//! largest event time to every arrival after (its largest ingest time, its sequence
//! number).
//!
//! Files the gateway or a load committed hold one commit each, so the steps are per
//! commit, as a live job reading one commit per step sees them. A compacted file holds
//! many commits and a new sequence number: it contributes only after its last arrival, so
//! around compacted data the recovered watermark can differ from the live one.

use iceberg::spec::{DataContentType, PrimitiveLiteral};
use signalweave_model::ErrorKind;

use crate::error::{LakeError, Result};
use crate::lake::Lake;
use crate::layout::LakeTable;
use crate::maintain::data_manifests;

/// The reader's watermark as a function of arrival time (see the module documentation).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ArrivalWatermarks {
    /// ((largest ingest time, sequence number) of a file, running maximum of event time
    /// up to it), by arrival.
    steps: Vec<((i64, i64), i64)>,
    /// Sequence number of each data file, by path.
    sequence: std::collections::HashMap<String, i64>,
    bound_us: i64,
}

impl ArrivalWatermarks {
    /// From per-file (path, largest ingest time, sequence number, largest event time).
    pub fn from_files(files: Vec<(String, i64, i64, i64)>, bound_us: i64) -> Self {
        let mut keyed: Vec<((i64, i64), i64)> = files
            .iter()
            .map(|(_, ingest, seq, event)| ((*ingest, *seq), *event))
            .collect();
        keyed.sort_unstable();
        let mut running = i64::MIN;
        let steps = keyed
            .into_iter()
            .map(|(arrival, event)| {
                running = running.max(event);
                (arrival, running)
            })
            .collect();
        let sequence = files
            .into_iter()
            .map(|(path, _, seq, _)| (path, seq))
            .collect();
        Self {
            steps,
            sequence,
            bound_us,
        }
    }

    /// The sequence number of the data file at `path` (`i64::MAX` when unknown: only
    /// ingest time then orders its records).
    pub fn sequence_of(&self, path: &str) -> i64 {
        self.sequence.get(path).copied().unwrap_or(i64::MAX)
    }

    /// The watermark a reader had just before a record ingested at `ingest_us` in the
    /// data file with sequence number `sequence`: the largest event time of the files
    /// that arrived entirely before it, minus the bound (`i64::MIN` when none did).
    pub fn at(&self, ingest_us: i64, sequence: i64) -> i64 {
        let key = (ingest_us, sequence);
        let before = self.steps.partition_point(|(a, _)| *a < key);
        match before {
            0 => i64::MIN,
            n => self.steps[n - 1].1.saturating_sub(self.bound_us),
        }
    }

    /// Files that contributed.
    pub fn files(&self) -> usize {
        self.steps.len()
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

    /// The arrival watermarks of `table` as of `snapshot_id` (None: current), from the
    /// upper bounds of `event_column` and `arrival_column` in its data files' statistics.
    /// Files without those statistics contribute nothing.
    pub async fn arrival_watermarks(
        &self,
        table: LakeTable,
        snapshot_id: Option<i64>,
        event_column: &str,
        arrival_column: &str,
        bound_us: i64,
    ) -> Result<ArrivalWatermarks> {
        let base = self.table(table).await?;
        let md = base.metadata();
        let snapshot = match snapshot_id {
            Some(id) => md.snapshot_by_id(id).cloned().ok_or_else(|| {
                LakeError::new(
                    ErrorKind::NotFound,
                    format!("snapshot {id} is not retained by {}", table.name()),
                )
            })?,
            None => match md.current_snapshot() {
                Some(s) => s.clone(),
                None => return Ok(ArrivalWatermarks::from_files(Vec::new(), bound_us)),
            },
        };
        let schema = md.current_schema();
        let field = |name: &str| {
            schema.field_by_name(name).map(|f| f.id).ok_or_else(|| {
                LakeError::new(
                    ErrorKind::Config,
                    format!("{} has no column {name}", table.name()),
                )
            })
        };
        let (event_id, arrival_id) = (field(event_column)?, field(arrival_column)?);
        let loaded = data_manifests(&base, &snapshot).await?;
        let mut files = Vec::new();
        for manifest in &loaded {
            for e in manifest.entries().iter().filter(|e| e.is_alive()) {
                let seq = e.sequence_number().unwrap_or(0);
                let f = e.data_file();
                if f.content_type() != DataContentType::Data {
                    continue;
                }
                let upper = f.upper_bounds();
                if let (Some(a), Some(t)) = (
                    upper.get(&arrival_id).and_then(micros),
                    upper.get(&event_id).and_then(micros),
                ) {
                    files.push((f.file_path().to_string(), a, seq, t));
                }
            }
        }
        Ok(ArrivalWatermarks::from_files(files, bound_us))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watermark_steps_after_each_file_and_never_goes_back() {
        // (largest ingest, sequence, largest event time): the third file is late data.
        let f = |p: &str, a, s, t| (p.to_string(), a, s, t);
        let w = ArrivalWatermarks::from_files(
            vec![f("c", 30, 3, 1_000), f("a", 10, 1, 500), f("b", 20, 2, 100)],
            5,
        );
        assert_eq!(w.at(5, 0), i64::MIN);
        assert_eq!(w.at(10, w.sequence_of("a")), i64::MIN, "not before itself");
        assert_eq!(w.at(11, 0), 495);
        assert_eq!(w.at(21, 0), 495, "late data does not move it back");
        assert_eq!(w.at(31, 0), 995);
        assert_eq!(w.files(), 3);
        // One clock for a whole load: commit order decides.
        let w = ArrivalWatermarks::from_files(
            vec![f("x", 7, 1, 100), f("y", 7, 2, 200), f("z", 7, 3, 50)],
            0,
        );
        assert_eq!(w.at(7, w.sequence_of("x")), i64::MIN);
        assert_eq!(w.at(7, w.sequence_of("y")), 100);
        assert_eq!(w.at(7, w.sequence_of("z")), 200);
        assert_eq!(w.sequence_of("unknown"), i64::MAX);
    }
}
