//! Snapshot and restore of the engine's whole state, or of a range of key groups, as
//! versioned bytes; and the observable state size.
//!
//! Format: the magic `SWWE`, a little-endian `u32` format version, then the
//! [postcard](https://docs.rs/postcard) encoding of [`StateV2`] (flat columns). A reader refuses other
//! magics, newer versions, and a state written for another job, job version or key-group
//! count.

use std::cmp::Reverse;
use std::ops::RangeInclusive;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use signalweave_model::ErrorKind;

use crate::engine::{
    EngineConfig, KeySessions, MAX_PANES, NO_SLAB, Session, Timer, TimerKind, Window, WindowEngine,
    WindowList, WindowMeta, pane_window_bounds,
};
use crate::error::{Result, WindowError};
use crate::output::OutputRow;
use crate::spec::JobSpec;
use crate::watermark::Watermarks;

const MAGIC: &[u8; 4] = b"SWWE";
/// Current state format version.
pub const STATE_FORMAT_VERSION: u32 = 2;

/// Version 2 of the serialized state: flat columns, the big ones as raw little-endian
/// bytes (no allocation per key or pane, no per-value encoding), so snapshot and restore
/// of millions of panes stay a few memory copies. Local key ids index `key_names`.
#[derive(Debug, Serialize, Deserialize)]
pub struct StateV2 {
    job: String,
    job_version: u32,
    namespace: String,
    key_groups: u16,
    key_names: Vec<String>,
    session_frontier: Vec<(u32, i64)>,
    /// Panes, sorted by (key, pane): key (`u32`), start (`i64`), dirty (`u8`).
    pane_keys: Column,
    pane_starts: Column,
    pane_dirty: Column,
    /// `stride` accumulator slots (`i64`) per pane, in pane order.
    slab: Column,
    /// Windows, sorted by (key, start): key (`u32`), start (`i64`), last version (`u32`),
    /// flags (`u8`: 1 closed, 2 dirty).
    window_keys: Column,
    window_starts: Column,
    window_versions: Column,
    window_flags: Column,
    sessions: Vec<(u32, i64, Session)>,
    /// Timers in firing order: time (`i64`), key (`u32`), window start (`i64`), kind
    /// (`u8`: 0 on time, 1 retire). Empty for tumbling and sliding windows, whose one timer
    /// per window follows from the window (on time at its end while open, retire at end +
    /// allowed lateness once closed) and is rebuilt on restore.
    timer_at: Column,
    timer_keys: Column,
    timer_starts: Column,
    timer_kinds: Column,
    dirty_panes: Vec<(u32, i64)>,
    early_queue: Vec<(u32, i64)>,
    correction_queue: Vec<(u32, i64)>,
    pending: Vec<OutputRow>,
    /// Dedup identities, sorted: hash (`u128`), expiry (`i64`), key group (`u16`).
    dedup_ids: Column,
    dedup_expiry: Column,
    dedup_groups: Column,
    dedup_swept_at: i64,
    watermarks: Watermarks,
    next_early_at: Option<i64>,
}

/// A column of fixed-width little-endian values, serialized as one byte string.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Column(#[serde(with = "serde_bytes")] Vec<u8>);

macro_rules! column_codec {
    ($put:ident, $get:ident, $t:ty) => {
        fn $put(values: impl ExactSizeIterator<Item = $t>) -> Column {
            let mut out = Vec::with_capacity(values.len() * std::mem::size_of::<$t>());
            for v in values {
                out.extend_from_slice(&v.to_le_bytes());
            }
            Column(out)
        }

        fn $get(column: &Column, n: usize) -> Result<Vec<$t>> {
            const W: usize = std::mem::size_of::<$t>();
            if column.0.len() != n * W {
                return Err(WindowError::new(
                    ErrorKind::InvalidInput,
                    "corrupt window state: columns disagree",
                ));
            }
            Ok(column
                .0
                .chunks_exact(W)
                .map(|c| {
                    let mut b = [0u8; W];
                    b.copy_from_slice(c);
                    <$t>::from_le_bytes(b)
                })
                .collect())
        }
    };
}

column_codec!(put_u8, get_u8, u8);
column_codec!(put_u16, get_u16, u16);
column_codec!(put_u32, get_u32, u32);
column_codec!(put_i64, get_i64, i64);
column_codec!(put_u128, get_u128, u128);

/// For each window of the columns (sorted by key and start), the index of the pane that
/// starts with it in the pane columns (sorted alike), or [`NO_SLAB`]; `None` when a pane
/// has no such window.
fn panes_of_windows(
    window_keys: &[u32],
    window_starts: &[i64],
    pane_keys: &[u32],
    pane_starts: &[i64],
) -> Option<Vec<u32>> {
    let mut next = 0;
    let of_windows = window_keys
        .iter()
        .zip(window_starts)
        .map(|(k, s)| {
            if pane_keys.get(next) == Some(k) && pane_starts.get(next) == Some(s) {
                next += 1;
                next as u32 - 1
            } else {
                NO_SLAB
            }
        })
        .collect();
    (next == pane_keys.len()).then_some(of_windows)
}

/// How much state the engine holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StateSize {
    /// Keys with state.
    pub keys: usize,
    /// Open windows (tumbling/sliding) or sessions.
    pub windows: usize,
    /// Panes (tumbling/sliding).
    pub panes: usize,
    /// Pending timers.
    pub timers: usize,
    /// Dedup identities held.
    pub dedup_identities: usize,
    /// Estimated heap bytes of window state (keys, panes, windows, sessions, timers).
    pub window_state_bytes: usize,
    /// Estimated heap bytes of dedup identities.
    pub dedup_bytes: usize,
    /// Heap bytes of emission columns kept for reuse ([`WindowEngine::recycle`]): not
    /// state, and not in a snapshot.
    pub spare_output_bytes: usize,
}

impl WindowEngine {
    /// Serializes the whole state.
    pub fn snapshot(&self) -> Result<Vec<u8>> {
        self.snapshot_key_groups(0..=self.config.key_groups.saturating_sub(1))
    }

    /// Serializes the state of the keys whose key group is in `groups`.
    pub fn snapshot_key_groups(&self, groups: RangeInclusive<u16>) -> Result<Vec<u8>> {
        let stride = self.layout.stride;
        let mut keep: Vec<Option<u32>> = vec![None; self.keys.len()];
        let mut key_names: Vec<String> = Vec::new();
        for (id, kg) in self.key_group.iter().enumerate() {
            if groups.contains(kg) {
                keep[id] = Some(key_names.len() as u32);
                key_names.push(self.keys.name(id as u32).to_string());
            }
        }
        let remap = |id: u32| keep.get(id as usize).copied().flatten();
        // Key ids map to new ids in order: these come out sorted by key.
        let session_frontier: Vec<(u32, i64)> = self
            .sessions
            .iter()
            .enumerate()
            .filter(|(_, s)| s.frontier != i64::MIN)
            .filter_map(|(k, s)| remap(k as u32).map(|k| (k, s.frontier)))
            .collect();
        // Panes on one thread, windows and timers on another: the big columns are built
        // side by side.
        let ((pane_keys, pane_starts, pane_dirty, slab), (window_cols, timer_cols)) =
            std::thread::scope(|scope| {
                let windows_and_timers = scope.spawn(|| {
                    // Key ids map to new ids in the same order and each key's list is
                    // sorted: the columns come out sorted by (key, start).
                    let windows: Vec<(u32, i64, WindowMeta)> = self
                        .key_windows
                        .iter()
                        .enumerate()
                        .filter_map(|(k, list)| remap(k as u32).map(|k| (k, list)))
                        .flat_map(|(k, list)| list.iter().map(move |w| (k, w.start, w.meta())))
                        .collect();
                    let window_cols = (
                        put_u32(windows.iter().map(|w| w.0)),
                        put_i64(windows.iter().map(|w| w.1)),
                        put_u32(windows.iter().map(|w| w.2.version)),
                        put_u8(
                            windows
                                .iter()
                                .map(|w| u8::from(w.2.closed) | (u8::from(w.2.dirty) << 1)),
                        ),
                    );
                    drop(windows);
                    // A session job's timers, in the order they fire.
                    let mut timers: Vec<(i64, Timer)> = self
                        .timers
                        .iter()
                        .filter_map(|&Reverse((at, t))| {
                            remap(t.key).map(|key| (at, Timer { key, ..t }))
                        })
                        .collect();
                    timers.sort_unstable();
                    let timer_cols = (
                        put_i64(timers.iter().map(|t| t.0)),
                        put_u32(timers.iter().map(|t| t.1.key)),
                        put_i64(timers.iter().map(|t| t.1.start)),
                        put_u8(timers.iter().map(|t| match t.1.kind {
                            TimerKind::OnTime => 0,
                            TimerKind::Retire => 1,
                        })),
                    );
                    (window_cols, timer_cols)
                });
                let panes: Vec<(u32, i64, u32, bool)> = self
                    .key_windows
                    .iter()
                    .enumerate()
                    .filter_map(|(k, list)| remap(k as u32).map(|k| (k, list)))
                    .flat_map(|(k, list)| {
                        list.iter().filter(|w| w.slab() != NO_SLAB).map(move |w| {
                            let slab = w.slab();
                            (k, w.start, slab, self.pane_dirty[slab as usize])
                        })
                    })
                    .collect();
                let mut slab = Vec::with_capacity(panes.len() * stride * 8);
                for (_, start, at, _) in &panes {
                    for v in self.slab.read(*at, *start) {
                        slab.extend_from_slice(&v.to_le_bytes());
                    }
                }
                let pane_cols = (
                    put_u32(panes.iter().map(|p| p.0)),
                    put_i64(panes.iter().map(|p| p.1)),
                    put_u8(panes.iter().map(|p| u8::from(p.3))),
                    Column(slab),
                );
                let others = windows_and_timers
                    .join()
                    .unwrap_or_else(|e| std::panic::resume_unwind(e));
                (pane_cols, others)
            });
        // Sorted by (key, start), as the lists are.
        let sessions: Vec<(u32, i64, Session)> = self
            .sessions
            .iter()
            .enumerate()
            .filter_map(|(k, state)| remap(k as u32).map(|k| (k, &state.list)))
            .flat_map(|(k, list)| list.iter().map(move |(s, v)| (k, *s, v.clone())))
            .collect();
        let pairs = |v: &[(u32, i64)]| -> Vec<(u32, i64)> {
            v.iter()
                .filter_map(|(k, s)| remap(*k).map(|k| (k, *s)))
                .collect()
        };
        let mut dedup: Vec<(u128, i64, u16)> = self
            .dedup
            .iter()
            .filter(|(_, _, kg)| groups.contains(kg))
            .collect();
        dedup.sort_unstable();
        let state = StateV2 {
            job: self.spec.name.clone(),
            job_version: self.spec.version,
            namespace: self.config.namespace.clone(),
            key_groups: self.config.key_groups,
            key_names,
            session_frontier,
            pane_keys,
            pane_starts,
            pane_dirty,
            slab,
            window_keys: window_cols.0,
            window_starts: window_cols.1,
            window_versions: window_cols.2,
            window_flags: window_cols.3,
            sessions,
            timer_at: timer_cols.0,
            timer_keys: timer_cols.1,
            timer_starts: timer_cols.2,
            timer_kinds: timer_cols.3,
            dirty_panes: pairs(&self.dirty_panes),
            early_queue: pairs(&self.early_queue()),
            correction_queue: pairs(&self.correction_queue),
            pending: self
                .pending
                .rows()
                .filter(|r| groups.contains(&self.key_group_of(&r.key)))
                .collect(),
            dedup_ids: put_u128(dedup.iter().map(|d| d.0)),
            dedup_expiry: put_i64(dedup.iter().map(|d| d.1)),
            dedup_groups: put_u16(dedup.iter().map(|d| d.2)),
            dedup_swept_at: self.dedup_swept_at,
            watermarks: self.watermarks.clone(),
            next_early_at: self.next_early_at,
        };
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&STATE_FORMAT_VERSION.to_le_bytes());
        postcard::to_extend(&state, out)
            .map_err(|e| WindowError::new(ErrorKind::Internal, format!("serialize state: {e}")))
    }

    /// A new engine holding the state in `bytes` (a full or key-group snapshot).
    pub fn restore(spec: Arc<JobSpec>, config: EngineConfig, bytes: &[u8]) -> Result<Self> {
        let mut engine = Self::new(spec, config)?;
        engine.merge_snapshot(bytes)?;
        Ok(engine)
    }

    /// Adds the keys of a snapshot to this engine (for rescaling: restore several key-group
    /// ranges of one checkpoint into one engine). The keys must not already be held, and
    /// the parts must share the engine's watermark (parts of one checkpoint do); otherwise
    /// nothing changes and the merge fails.
    pub fn merge_snapshot(&mut self, bytes: &[u8]) -> Result<()> {
        let bad = |m: String| WindowError::new(ErrorKind::InvalidInput, m);
        if bytes.len() < 8 || &bytes[..4] != MAGIC {
            return Err(bad("not a SignalWeave window-state snapshot".into()));
        }
        let version = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
        if version != STATE_FORMAT_VERSION {
            return Err(bad(format!(
                "state format {version} is not readable by this build (reads {STATE_FORMAT_VERSION})"
            )));
        }
        let state: StateV2 = postcard::from_bytes(&bytes[8..])
            .map_err(|e| bad(format!("corrupt window state: {e}")))?;
        if state.job != self.spec.name || state.job_version != self.spec.version {
            return Err(bad(format!(
                "state of {} v{} cannot restore {} v{}",
                state.job, state.job_version, self.spec.name, self.spec.version
            )));
        }
        if state.key_groups != self.config.key_groups {
            return Err(bad(format!(
                "state has {} key groups, the engine {}",
                state.key_groups, self.config.key_groups
            )));
        }
        let fresh = self.keys.len() == 0 && self.watermarks.current() == i64::MIN;
        if !fresh && state.watermarks.current() != self.watermarks.current() {
            // A part behind the others would reopen windows the others already closed, and
            // emit versions they already used: parts must come from one checkpoint.
            return Err(bad(format!(
                "cannot merge a state at watermark {} into an engine at {}: merge parts of one checkpoint",
                state.watermarks.current(),
                self.watermarks.current()
            )));
        }
        let stride = self.layout.stride;
        // Validate everything before changing anything.
        let n_keys = state.key_names.len();
        let panes = state.pane_keys.0.len() / 4;
        let windows = state.window_keys.0.len() / 4;
        let dedups = state.dedup_ids.0.len() / 16;
        let pane_keys = get_u32(&state.pane_keys, panes)?;
        let pane_starts = get_i64(&state.pane_starts, panes)?;
        let pane_dirty = get_u8(&state.pane_dirty, panes)?;
        let slab = get_i64(&state.slab, panes * stride)?;
        let window_keys = get_u32(&state.window_keys, windows)?;
        let window_starts = get_i64(&state.window_starts, windows)?;
        let window_versions = get_u32(&state.window_versions, windows)?;
        let window_flags = get_u8(&state.window_flags, windows)?;
        let dedup_ids = get_u128(&state.dedup_ids, dedups)?;
        let dedup_expiry = get_i64(&state.dedup_expiry, dedups)?;
        let dedup_groups = get_u16(&state.dedup_groups, dedups)?;
        let timers = state.timer_at.0.len() / 8;
        let timer_at = get_i64(&state.timer_at, timers)?;
        let timer_keys = get_u32(&state.timer_keys, timers)?;
        let timer_starts = get_i64(&state.timer_starts, timers)?;
        let timer_kinds = get_u8(&state.timer_kinds, timers)?;
        let consistent = pane_keys.iter().all(|k| (*k as usize) < n_keys)
            && window_keys.iter().all(|k| (*k as usize) < n_keys)
            && timer_keys.iter().all(|k| (*k as usize) < n_keys)
            && timer_kinds.iter().all(|k| *k <= 1)
            && state
                .sessions
                .iter()
                .all(|(k, _, _)| (*k as usize) < n_keys);
        if !consistent {
            return Err(bad("corrupt window state: key ids out of range".into()));
        }
        // Each key's panes and windows are lists sorted by start: the columns must come
        // sorted by (key, start), without repeats.
        let increasing = |keys: &[u32], starts: &[i64]| {
            keys.windows(2)
                .zip(starts.windows(2))
                .all(|(k, s)| (k[0], s[0]) < (k[1], s[1]))
        };
        if !increasing(&pane_keys, &pane_starts) || !increasing(&window_keys, &window_starts) {
            return Err(bad(
                "corrupt window state: panes or windows out of order".into()
            ));
        }
        // A key's sessions are sorted by start and disjoint.
        let sessions_ordered = state.sessions.windows(2).all(|w| {
            let ((k0, s0, a), (k1, s1, _)) = (&w[0], &w[1]);
            k0 < k1 || (k0 == k1 && s0 < s1 && a.end <= *s1)
        });
        if !sessions_ordered {
            return Err(bad(
                "corrupt window state: sessions out of order or overlapping".into(),
            ));
        }
        if self.is_session() && (panes > 0 || windows > 0) {
            return Err(bad(
                "corrupt window state: panes in the state of a session job".into(),
            ));
        }
        let holds_sessions = !state.sessions.is_empty()
            || !state.session_frontier.is_empty()
            || !timer_at.is_empty();
        if holds_sessions && !self.is_session() {
            return Err(bad(
                "corrupt window state: sessions in the state of a tumbling or sliding job".into(),
            ));
        }
        // Each pane goes with the window that starts where it does.
        let Some(window_panes) =
            panes_of_windows(&window_keys, &window_starts, &pane_keys, &pane_starts)
        else {
            return Err(bad(
                "corrupt window state: a pane without the window that starts with it".into(),
            ));
        };
        if self.slab.len() + panes > MAX_PANES {
            return Err(bad(format!(
                "the state holds more panes than an engine can ({MAX_PANES})"
            )));
        }
        if !(0..panes).all(|i| {
            self.slab
                .fits(pane_starts[i], &slab[i * stride..(i + 1) * stride])
        }) {
            return Err(bad(
                "corrupt window state: a pane's event times lie outside the pane".into(),
            ));
        }
        if !state.sessions.iter().all(|(_, _, s)| s.acc.len() == stride) {
            return Err(bad(
                "state accumulators do not match the job's aggregates".into()
            ));
        }
        // One pass over the names: none held already, none repeated (a repeat would take
        // a second id that no lookup reaches).
        let mut names = std::collections::HashSet::with_capacity(n_keys);
        for k in &state.key_names {
            if self.keys.get(k).is_some() {
                return Err(bad(format!("key `{k}` is already held by this engine")));
            }
            if !names.insert(k.as_str()) {
                return Err(bad(format!(
                    "corrupt window state: key `{k}` is held twice"
                )));
            }
        }
        // One allocation per map instead of repeated growth (millions of entries).
        self.keys
            .reserve(n_keys, state.key_names.iter().map(String::len).sum());
        self.key_group.reserve(n_keys);
        self.slab.reserve(panes);
        self.dedup.reserve(dedups);
        let mut ids = Vec::with_capacity(n_keys);
        for name in state.key_names {
            let id = self.keys.push(&name);
            let kg = self.key_group_of(&name);
            self.key_group.push(kg);
            ids.push(id);
        }
        let pane_job = !self.is_session();
        if pane_job {
            self.key_windows
                .resize_with(self.keys.len(), WindowList::new);
        } else {
            self.sessions
                .resize_with(self.keys.len(), KeySessions::default);
        }
        let id = |k: u32| ids.get(k as usize).copied();
        let first_slab = self.slab.len() as u32;
        for (i, acc) in slab.chunks_exact(stride).enumerate() {
            self.slab.push(pane_starts[i], acc);
        }
        self.pane_dirty.extend(pane_dirty.iter().map(|d| *d != 0));
        let lateness = self.lateness_us;
        let (pane_us, panes_per_window) = (self.pane_us, self.panes_per_window);
        // Rows of one key are adjacent: each key's list is allocated once, at its size.
        fn runs(keys: &[u32]) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
            let mut i = 0;
            std::iter::from_fn(move || {
                let start = i;
                let key = *keys.get(i)?;
                while keys.get(i) == Some(&key) {
                    i += 1;
                }
                Some(start..i)
            })
        }
        // Windows, their panes and timers on one thread, dedup identities on another
        // (disjoint fields).
        let (key_windows, window_timers, timers_map, dedup_map) = (
            &mut self.key_windows,
            &mut self.window_timers,
            &mut self.timers,
            &mut self.dedup,
        );
        std::thread::scope(|scope| {
            let other = scope.spawn(|| {
                for run in runs(&window_keys) {
                    let Some(key) = id(window_keys[run.start]) else {
                        continue;
                    };
                    let mut list = WindowList::with_capacity(run.len());
                    for i in run {
                        let start = window_starts[i];
                        let closed = window_flags[i] & 1 != 0;
                        let slab = match window_panes[i] {
                            NO_SLAB => NO_SLAB,
                            pane => first_slab + pane,
                        };
                        let mut window = Window::new(start, slab, closed);
                        window.set_meta(WindowMeta {
                            version: window_versions[i],
                            closed,
                            dirty: window_flags[i] & 2 != 0,
                        });
                        list.push(window);
                        // The one timer of a tumbling or sliding window follows from it.
                        let (_, end) = pane_window_bounds(start, pane_us, panes_per_window);
                        let (at, kind) = if closed {
                            (end.saturating_add(lateness), TimerKind::Retire)
                        } else {
                            (end, TimerKind::OnTime)
                        };
                        window_timers.push(at, Timer { key, start, kind });
                    }
                    key_windows[key as usize] = list;
                }
                // Session timers, in firing order.
                for i in 0..timer_at.len() {
                    if let Some(key) = id(timer_keys[i]) {
                        let kind = if timer_kinds[i] == 0 {
                            TimerKind::OnTime
                        } else {
                            TimerKind::Retire
                        };
                        let start = timer_starts[i];
                        let timer = Timer { key, start, kind };
                        timers_map.push(Reverse((timer_at[i], timer)));
                    }
                }
            });
            for i in 0..dedups {
                dedup_map.insert(dedup_ids[i], dedup_expiry[i], dedup_groups[i]);
            }
            other
                .join()
                .unwrap_or_else(|e| std::panic::resume_unwind(e));
        });
        // Sorted by (key, start): each list is filled in order.
        for (k, start, session) in state.sessions {
            if let Some(key) = id(k) {
                self.sessions[key as usize].list.push((start, session));
            }
        }
        for (k, f) in state.session_frontier {
            if let Some(key) = id(k) {
                self.sessions[key as usize].frontier = f;
            }
        }
        for (list, target) in [
            (state.dirty_panes, &mut self.dirty_panes),
            (state.correction_queue, &mut self.correction_queue),
        ] {
            target.extend(list.into_iter().filter_map(|(k, s)| id(k).map(|k| (k, s))));
        }
        self.early_keys
            .extend(state.early_queue.into_iter().filter_map(|(k, _)| id(k)));
        for row in &state.pending {
            self.pending.push_row(row);
        }
        if fresh {
            self.watermarks = state.watermarks;
            self.dedup_swept_at = state.dedup_swept_at;
            self.next_early_at = state.next_early_at;
        }
        Ok(())
    }

    /// The state held now.
    pub fn state_size(&self) -> StateSize {
        let record_bytes = self.slab.record_bytes();
        // Per key: its key group, and its entry and bytes in the key table.
        let key_bytes = self.key_group.capacity() * 2 + self.keys.heap_bytes();
        let panes = self.slab.len() - self.free.len();
        let windows: usize = self.key_windows.iter().map(|l| l.len()).sum();
        // A list per key, holding two windows in place; the windows of a longer list are
        // on the heap.
        let list_bytes = self.key_windows.len() * std::mem::size_of::<WindowList>()
            + self
                .key_windows
                .iter()
                .filter(|l| l.spilled())
                .map(|l| l.capacity() * std::mem::size_of::<Window>())
                .sum::<usize>();
        // Per pane, its record and its changed flag.
        let pane_bytes = list_bytes
            + panes * (record_bytes + 1)
            + self.free.len() * (record_bytes + 1)
            + self.slab.carry_bytes();
        let session_timers = self.timers.len();
        let timers = session_timers + self.window_timers.len();
        let timer_bytes = self.timers.capacity() * std::mem::size_of::<(i64, Timer)>()
            + self.window_timers.heap_bytes();
        // Per key its frontier and a list holding one session in place; per session its
        // accumulator, on the heap only when too wide to be held in place, and the place
        // of any session beyond the first.
        let session_count: usize = self.sessions.iter().map(|s| s.list.len()).sum();
        let session_bytes = self.sessions.capacity() * std::mem::size_of::<KeySessions>()
            + self
                .sessions
                .iter()
                .map(|s| {
                    let list = if s.list.spilled() {
                        s.list.capacity() * std::mem::size_of::<(i64, Session)>()
                    } else {
                        0
                    };
                    let accs: usize = s
                        .list
                        .iter()
                        .filter(|(_, v)| v.acc.spilled())
                        .map(|(_, v)| v.acc.capacity() * 8)
                        .sum();
                    list + accs
                })
                .sum::<usize>();
        StateSize {
            keys: self.keys.len(),
            windows: windows + session_count,
            panes,
            timers,
            dedup_identities: self.dedup.len(),
            window_state_bytes: key_bytes + pane_bytes + timer_bytes + session_bytes,
            dedup_bytes: self.dedup.heap_bytes(),
            spare_output_bytes: self.spare.heap_bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use signalweave_model::{
        Event, EventBatchBuilder, EventId, ProducerId, SchemaVersion, TenantId,
    };

    use super::*;

    fn sliding_engine_with_two_keys() -> WindowEngine {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../jobs/customer_features.toml"
        ))
        .unwrap();
        let spec = Arc::new(JobSpec::from_toml(&text).unwrap());
        let mut engine = WindowEngine::new(spec, EngineConfig::default()).unwrap();
        let mut b = EventBatchBuilder::with_capacity(4);
        for (i, (customer, minute)) in [("c1", 3), ("c2", 5), ("c1", 7)].iter().enumerate() {
            b.push(&Event {
                event_id: EventId::new(format!("e{i}")),
                event_type: "order_placed".into(),
                schema_version: SchemaVersion::new(1, 0, 0),
                tenant: TenantId::new("t"),
                producer_id: ProducerId::new("p"),
                producer_seq: i as i64,
                event_time_us: minute * 60_000_000,
                ingest_time_us: minute * 60_000_000,
                partition_key: (*customer).into(),
                order_id: Some("o".into()),
                customer_id: Some((*customer).into()),
                market_id: Some("m".into()),
                business_version: 1,
                amount_minor: Some(100),
                currency: Some("EUR".into()),
                attributes: None,
            });
        }
        engine.process_batch(&b.finish().unwrap(), "p", 0).unwrap();
        engine
    }

    fn decode(bytes: &[u8]) -> StateV2 {
        postcard::from_bytes(&bytes[8..]).unwrap()
    }

    /// The error restoring `state` into `engine`'s job gives: a classified refusal of
    /// the caller's input.
    fn refused(engine: &WindowEngine, state: &StateV2) -> crate::WindowError {
        let err = WindowEngine::restore(
            Arc::clone(&engine.spec),
            engine.config.clone(),
            &encode(state),
        )
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        err
    }

    fn encode(state: &StateV2) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&STATE_FORMAT_VERSION.to_le_bytes());
        postcard::to_extend(state, out).unwrap()
    }

    #[test]
    fn restore_round_trips_each_keys_lists() {
        let engine = sliding_engine_with_two_keys();
        let bytes = engine.snapshot().unwrap();
        let restored =
            WindowEngine::restore(Arc::clone(&engine.spec), engine.config.clone(), &bytes).unwrap();
        // Slab slots are renumbered; starts, flags and accumulators are kept.
        type Kept = (i64, WindowMeta, Option<(bool, Vec<i64>)>);
        let windows = |e: &WindowEngine| -> Vec<Vec<Kept>> {
            e.key_windows
                .iter()
                .map(|list| {
                    list.iter()
                        .map(|w| {
                            let pane = (w.slab() != NO_SLAB).then(|| {
                                let slab = w.slab();
                                (e.pane_dirty[slab as usize], e.slab.read(slab, w.start))
                            });
                            (w.start, w.meta(), pane)
                        })
                        .collect()
                })
                .collect()
        };
        assert_eq!(windows(&restored), windows(&engine));
        // A sliding key has windows without a pane of their own.
        assert!(
            windows(&engine)
                .iter()
                .flatten()
                .any(|(_, _, pane)| pane.is_none())
        );
        assert_eq!(restored.snapshot().unwrap(), bytes);
        // The same state, in lists allocated at their size (not grown).
        let (size, again) = (engine.state_size(), restored.state_size());
        assert!(again.window_state_bytes <= size.window_state_bytes);
        let counts = |s: StateSize| (s.keys, s.windows, s.panes, s.timers, s.dedup_identities);
        assert_eq!(counts(again), counts(size));
    }

    #[test]
    fn a_state_with_a_pane_without_its_window_is_refused() {
        let engine = sliding_engine_with_two_keys();
        let mut state = decode(&engine.snapshot().unwrap());
        // Move the first pane one pane later, where no window starts (it is the newest).
        let keys = get_u32(&state.pane_keys, state.pane_keys.0.len() / 4).unwrap();
        let last = keys.iter().rposition(|k| *k == keys[0]).unwrap();
        let mut starts = get_i64(&state.pane_starts, keys.len()).unwrap();
        starts[last] += 1;
        state.pane_starts = put_i64(starts.into_iter());
        let err = refused(&engine, &state);
        assert!(
            err.message().contains("a pane without the window"),
            "{}",
            err.message()
        );
    }

    #[test]
    fn recycled_columns_are_kept_while_fires_are_as_large() {
        let mut engine = sliding_engine_with_two_keys();
        let spare = |e: &WindowEngine| e.state_size().spare_output_bytes;
        let handed_back = |rows: usize| {
            let mut e = crate::Emissions::default();
            e.reserve(rows);
            e
        };
        engine.recycle(handed_back(1_000));
        let small = spare(&engine);
        assert!(small > 0);
        // Larger than recent hand-backs warrant: not kept.
        engine.recycle(handed_back(100_000));
        assert_eq!(spare(&engine), small);
        // Kept while hand-backs as large come back (here, emptied and reserved again).
        let row = crate::output::OutputRow {
            key: "k".into(),
            window_start: 0,
            window_end: 60_000_000,
            output_version: 1,
            completeness: crate::Completeness::OnTime,
            retracted: false,
            watermark: 0,
            emitted_at: 0,
            first_event_time: 0,
            last_event_time: 0,
            events: 1,
            values: Vec::new(),
        };
        engine.recycle((0..50_000).map(|_| row.clone()).collect());
        let kept = spare(&engine);
        assert!(kept > small);
        // Once hand-backs stay small, the large columns are freed.
        for _ in 0..200 {
            engine.recycle(crate::Emissions::default());
        }
        assert_eq!(spare(&engine), 0);
        // A fire fills kept columns with its own rows only: as an engine's that kept none.
        engine.recycle((0..100).map(|_| row.clone()).collect());
        assert!(spare(&engine) > 0);
        let mut fresh = sliding_engine_with_two_keys();
        let rows = |e: crate::Emissions| e.rows().collect::<Vec<_>>();
        assert_eq!(rows(engine.finish(1)), rows(fresh.finish(1)));
    }

    #[test]
    fn a_state_holding_a_key_twice_is_refused() {
        let engine = sliding_engine_with_two_keys();
        let mut state = decode(&engine.snapshot().unwrap());
        assert_eq!(state.key_names.len(), 2);
        state.key_names[1] = state.key_names[0].clone();
        let err = refused(&engine, &state);
        assert!(err.message().contains("held twice"), "{}", err.message());
    }

    #[test]
    fn a_state_with_windows_out_of_order_is_refused() {
        let engine = sliding_engine_with_two_keys();
        let mut state = decode(&engine.snapshot().unwrap());
        // Swap the first two windows of the first key.
        let starts = &mut state.window_starts.0;
        assert!(starts.len() >= 16);
        let (a, b) = starts.split_at_mut(8);
        a.swap_with_slice(&mut b[..8]);
        let err = refused(&engine, &state);
        assert!(err.message().contains("out of order"), "{}", err.message());
    }
}
