//! Per-input watermarks with idleness.
//!
//! Each input (a source partition or a producer) reports the largest event time it has
//! shown. The watermark is the minimum over *active* inputs of (max event time −
//! out-of-orderness bound), and never moves backwards.
//!
//! - An input silent for `idle_timeout` of processing time becomes idle and is left out of
//!   the minimum, so one quiet producer does not hold every window open.
//! - Reactivation rule: when an idle input shows records again it rejoins the minimum at
//!   no less than the current watermark (its max is raised to `watermark + bound`). Its
//!   records behind the watermark go through the lateness policy like any late record.
//! - When every input is idle the watermark holds.

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

/// One input's progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputProgress {
    /// Largest event time shown, µs.
    pub max_event_time: i64,
    /// Processing time of its last batch, µs.
    pub last_active: i64,
    /// Left out of the minimum for now.
    pub idle: bool,
}

/// The watermark tracker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Watermarks {
    bound_us: i64,
    idle_timeout_us: i64,
    inputs: FxHashMap<String, InputProgress>,
    current: i64,
}

impl Watermarks {
    /// A tracker with an out-of-orderness bound and an idleness timeout, µs.
    pub fn new(bound_us: i64, idle_timeout_us: i64) -> Self {
        Self {
            bound_us,
            idle_timeout_us,
            inputs: FxHashMap::default(),
            current: i64::MIN,
        }
    }

    /// The watermark, µs (`i64::MIN` before any input).
    pub fn current(&self) -> i64 {
        self.current
    }

    /// Per-input progress, for metrics (watermark delay per input).
    pub fn inputs(&self) -> impl Iterator<Item = (&str, &InputProgress)> {
        self.inputs.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// `input` showed records up to `max_event_time` at processing time `now`.
    pub fn observe(&mut self, input: &str, max_event_time: i64, now: i64) {
        let floor = self.current.saturating_add(self.bound_us);
        match self.inputs.get_mut(input) {
            Some(p) => {
                if p.idle {
                    p.idle = false;
                    p.max_event_time = p.max_event_time.max(floor);
                }
                p.max_event_time = p.max_event_time.max(max_event_time);
                p.last_active = now;
            }
            None => {
                let start = if self.current == i64::MIN {
                    max_event_time
                } else {
                    max_event_time.max(floor)
                };
                self.inputs.insert(
                    input.to_owned(),
                    InputProgress {
                        max_event_time: start,
                        last_active: now,
                        idle: false,
                    },
                );
            }
        }
    }

    /// `input` was active at `now` without records (an empty batch).
    pub fn touch(&mut self, input: &str, now: i64) {
        if let Some(p) = self.inputs.get_mut(input) {
            p.last_active = now;
        }
    }

    /// Marks inputs idle by `now` and recomputes the watermark (never backwards).
    pub fn recompute(&mut self, now: i64) {
        let mut min: Option<i64> = None;
        for p in self.inputs.values_mut() {
            if !p.idle && now.saturating_sub(p.last_active) >= self.idle_timeout_us {
                p.idle = true;
            }
            if !p.idle {
                let w = p.max_event_time.saturating_sub(self.bound_us);
                min = Some(min.map_or(w, |m: i64| m.min(w)));
            }
        }
        if let Some(m) = min {
            self.current = self.current.max(m);
        }
    }

    /// The end of input: the watermark passes every event time.
    pub fn set_end(&mut self) {
        self.current = i64::MAX;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimum_over_active_inputs_never_backwards() {
        let mut w = Watermarks::new(10, 1_000);
        w.observe("a", 100, 0);
        w.observe("b", 50, 0);
        w.recompute(0);
        assert_eq!(w.current(), 40);
        w.observe("b", 200, 1);
        w.recompute(1);
        assert_eq!(w.current(), 90);
        w.observe("a", 20, 2); // an old record does not move it back
        w.recompute(2);
        assert_eq!(w.current(), 90);
    }

    #[test]
    fn idle_input_is_left_out_and_rejoins_without_regression() {
        let mut w = Watermarks::new(0, 100);
        w.observe("fast", 1_000, 0);
        w.observe("slow", 10, 0);
        w.recompute(50);
        assert_eq!(w.current(), 10);
        w.observe("fast", 2_000, 150);
        w.recompute(150); // slow silent for 150 >= 100: idle
        assert_eq!(w.current(), 2_000);
        w.observe("slow", 20, 160); // reactivates at no less than the watermark
        w.recompute(160);
        assert_eq!(w.current(), 2_000);
        assert!(!w.inputs().any(|(_, p)| p.idle));
    }

    #[test]
    fn all_idle_holds() {
        let mut w = Watermarks::new(0, 10);
        w.observe("a", 100, 0);
        w.recompute(0);
        w.recompute(1_000);
        assert_eq!(w.current(), 100);
    }
}
