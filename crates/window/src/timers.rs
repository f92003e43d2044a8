//! [`WindowTimers`]: the pending timers of a tumbling or sliding job, by the time they
//! fire.
//!
//! A tumbling or sliding job has one timer per window, and every key's window over the same
//! panes ends at the same time: the timers due at one time share their window start and
//! kind. They are held as runs (a start, a kind and a count) over a list of key ids, 4
//! bytes a timer instead of the 16 of a whole [`Timer`] (a sixteenth of the state per key
//! of market_aggregates). A session's start is its own, so a session job keeps whole
//! timers (`WindowEngine::timers`).

use std::collections::BTreeMap;

use crate::engine::{Timer, TimerKind};

/// Pending timers by firing time. See the module docs.
#[derive(Debug, Clone, Default)]
pub(crate) struct WindowTimers {
    runs: BTreeMap<i64, Runs>,
    len: usize,
}

/// The timers due at one time: `keys`, cut into runs that share a window start and kind.
#[derive(Debug, Clone, Default)]
struct Runs {
    runs: Vec<Run>,
    keys: Vec<u32>,
}

/// `len` consecutive keys of a [`Runs`] whose timers are for window `start`, of `kind`.
#[derive(Debug, Clone, Copy)]
struct Run {
    start: i64,
    kind: TimerKind,
    len: u32,
}

impl WindowTimers {
    /// Timers held.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Adds `timer`, due at `at`.
    #[inline]
    pub fn push(&mut self, at: i64, timer: Timer) {
        self.len += 1;
        let due = self.runs.entry(at).or_default();
        match due.runs.last_mut() {
            // A run repeated further on is harmless: a time's timers are sorted when due.
            Some(run)
                if run.start == timer.start && run.kind == timer.kind && run.len < u32::MAX =>
            {
                run.len += 1
            }
            _ => due.runs.push(Run {
                start: timer.start,
                kind: timer.kind,
                len: 1,
            }),
        }
        due.keys.push(timer.key);
    }

    /// Timers due at or before `wm`.
    #[inline]
    pub fn due(&self, wm: i64) -> usize {
        self.runs.range(..=wm).map(|(_, r)| r.keys.len()).sum()
    }

    /// Removes the timers of the earliest time, if it is at or before `wm`: returns the
    /// time, and sets `out` to its timers in [`Timer::firing_order`].
    #[inline]
    pub fn pop_due(&mut self, wm: i64, out: &mut Vec<Timer>) -> Option<i64> {
        out.clear();
        let entry = self.runs.first_entry().filter(|e| *e.key() <= wm)?;
        let (at, due) = entry.remove_entry();
        let mut keys = due.keys.into_iter();
        for run in due.runs {
            out.extend(keys.by_ref().take(run.len as usize).map(|key| Timer {
                key,
                start: run.start,
                kind: run.kind,
            }));
        }
        self.len -= out.len();
        out.sort_unstable_by_key(Timer::firing_order);
        Some(at)
    }

    /// Every timer held, in firing order (within a time, in the order of scheduling).
    #[cfg(test)]
    pub fn iter(&self) -> impl Iterator<Item = (i64, Timer)> + '_ {
        self.runs.iter().flat_map(|(at, due)| {
            let mut from = 0;
            due.runs
                .iter()
                .map(move |run| {
                    let keys = from..from + run.len as usize;
                    from = keys.end;
                    (run, keys)
                })
                .flat_map(move |(run, keys)| {
                    due.keys[keys].iter().map(move |key| {
                        let timer = Timer {
                            key: *key,
                            start: run.start,
                            kind: run.kind,
                        };
                        (*at, timer)
                    })
                })
        })
    }

    /// Drops every timer.
    pub fn clear(&mut self) {
        self.runs.clear();
        self.len = 0;
    }

    /// Estimated heap bytes held: the timers, and per time its map entry.
    pub fn heap_bytes(&self) -> usize {
        self.runs
            .values()
            .map(|r| {
                r.runs.capacity() * std::mem::size_of::<Run>()
                    + r.keys.capacity() * std::mem::size_of::<u32>()
                    + 64
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timer(key: u32, start: i64, kind: TimerKind) -> Timer {
        Timer { key, start, kind }
    }

    #[test]
    fn runs_give_back_each_timer_sorted_as_whole_timers_are() {
        let pushed = [
            (60, timer(3, 0, TimerKind::OnTime)),
            (60, timer(1, 0, TimerKind::OnTime)),
            (60, timer(2, -120, TimerKind::Retire)),
            (60, timer(1, -120, TimerKind::Retire)),
            (60, timer(0, 0, TimerKind::OnTime)),
            (120, timer(5, 1, TimerKind::OnTime)),
        ];
        let mut timers = WindowTimers::default();
        for (at, t) in pushed {
            timers.push(at, t);
        }
        assert_eq!(timers.len(), 6);
        assert_eq!(timers.iter().collect::<Vec<_>>(), pushed.to_vec());
        assert_eq!(timers.due(59), 0);
        assert_eq!(timers.due(60), 5);
        let mut due = Vec::new();
        assert_eq!(timers.pop_due(59, &mut due), None);
        assert_eq!(timers.pop_due(60, &mut due), Some(60));
        let mut want: Vec<Timer> = pushed[..5].iter().map(|(_, t)| *t).collect();
        want.sort_unstable_by_key(Timer::firing_order);
        assert_eq!(due, want);
        assert_eq!(
            due.iter().map(|t| (t.key, t.start)).collect::<Vec<_>>(),
            [(0, 0), (1, -120), (1, 0), (2, -120), (3, 0)]
        );
        assert_eq!((timers.len(), timers.due(i64::MAX)), (1, 1));
        assert_eq!(timers.pop_due(100, &mut due), None);
        assert_eq!(timers.pop_due(120, &mut due), Some(120));
        assert_eq!(due, [timer(5, 1, TimerKind::OnTime)]);
        assert_eq!(timers.len(), 0);
        assert!(timers.heap_bytes() == 0 && timers.iter().next().is_none());
    }
}
