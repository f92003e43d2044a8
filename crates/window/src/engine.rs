//! [`WindowEngine`]: keyed event-time windows over Arrow batches.
//!
//! # Lifecycle
//!
//! The caller alternates [`WindowEngine::process_batch`] (route records into windows;
//! returns the records that went elsewhere) and [`WindowEngine::fire`] (advance the
//! watermark with processing time, fire triggers, retire state; returns output rows).
//! [`WindowEngine::finish`] ends the input: every window fires and retires.
//! [`WindowEngine::snapshot`] / [`WindowEngine::restore`] move the whole state through
//! bytes; restore-then-continue emits exactly what an uninterrupted run emits.
//!
//! # Semantics
//!
//! - Records in a batch are classified against the watermark as it was before the batch;
//!   the batch's event times move the watermark at the next `fire`.
//! - Tumbling and sliding windows are pane-based: a record updates the one pane of width
//!   `slide` (`size` for tumbling) it falls in; a window combines `size / slide` panes.
//! - A window `[start, end)` fires `on_time` once the watermark reaches `end`, may emit
//!   `provisional` versions before (early trigger), and `corrected` versions after, until the
//!   watermark reaches `end + allowed lateness`, when it retires. A record whose every window
//!   has retired goes to the late output (`beyond_allowed_lateness`).
//! - Sessions merge on overlap (`[t, t + gap)`); a merge that changes an emitted session's
//!   identity retracts the old identity (a `corrected` version with `retracted = true`).
//! - Duplicates share the dedup identity (default `(tenant, event_id)`) within the horizon
//!   `allowed lateness + window span + replay horizon` of event time; they change nothing.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;

use arrow::array::{Array, AsArray, BooleanArray, RecordBatch};
use arrow::datatypes::{DataType, Int64Type, TimestampMicrosecondType};
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use signalweave_model::ErrorKind;
use smallvec::SmallVec;

use crate::dedup::DedupSet;
use crate::error::{Result, WindowError};
use crate::keys::{self, KeyTable};
use crate::output::{BatchOutcome, Completeness, Emissions, LateReason, LateRecord, Version};
use crate::panes::{AggWords, PaneSlab};
use crate::spec::{AggregateFunction, JobSpec, WindowSpec, micros};
use crate::strs::Strs;
use crate::timers::WindowTimers;
use crate::watermark::Watermarks;

/// Default number of key groups (fixed for the life of a job).
pub const DEFAULT_KEY_GROUPS: u16 = 256;

/// Engine options that are not part of the job spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// Output namespace (`live`, or a backfill's namespace).
    pub namespace: String,
    /// Number of key groups keys hash into.
    pub key_groups: u16,
    /// Judge each record's lateness by a watermark of its own (backfills): an Int64
    /// column (µs) holding, per record, the watermark a live reader had when the record
    /// arrived. A record is late when that watermark had passed its last window's end plus
    /// the allowed lateness (or its dedup horizon), whatever order the records are
    /// processed in. The engine's own watermark still applies when it is later. (Of two
    /// copies of one dedup identity, the one processed first counts; and a dedup floor,
    /// see [`WindowEngine::set_dedup_floor`], refuses records below it.)
    pub watermark_column: Option<String>,
    /// Judge some records for dedup only (backfills): a Boolean column, true for a record
    /// that is read only because it may be an earlier copy of a record that counts (one
    /// outside the range or the key groups being computed). Such a record is classified
    /// as any other (its event type, key and horizon), and when it is the first copy of
    /// its identity it claims it, so later copies are duplicates; it adds to no window,
    /// moves no watermark and is reported nowhere: not as late, duplicate or filtered.
    pub dedup_only_column: Option<String>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            namespace: "live".into(),
            key_groups: DEFAULT_KEY_GROUPS,
            watermark_column: None,
            dedup_only_column: None,
        }
    }
}

/// Accumulator slots of a window or pane: `[events, first, last, aggregate slots...]`.
/// A count takes one slot; an average its sum and count; a sum, minimum or maximum its
/// value and whether it saw one (0 or 1, merged by `max`: null when no record had a
/// value).
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    pub stride: usize,
    /// For each aggregate: (function, first slot).
    pub aggs: Vec<(AggregateFunction, usize)>,
    /// How each slot combines: a flat table, so merging is one tight loop.
    ops: Vec<SlotOp>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SlotOp {
    Add,
    Min,
    Max,
}

pub(crate) const EVENTS: usize = 0;
pub(crate) const FIRST: usize = 1;
pub(crate) const LAST: usize = 2;
/// The slots of an emission's `[first_event_time, last_event_time, events]`.
const HEADER: [usize; 3] = [FIRST, LAST, EVENTS];

impl Layout {
    pub(crate) fn new(spec: &JobSpec) -> Self {
        let mut aggs = Vec::new();
        let mut ops = vec![SlotOp::Add, SlotOp::Min, SlotOp::Max];
        for a in &spec.aggregates {
            aggs.push((a.function, ops.len()));
            match a.function {
                AggregateFunction::Count => ops.push(SlotOp::Add),
                // An average divides by its count; a sum, minimum or maximum only asks
                // whether it saw a value (null over none), a flag (0 or 1).
                AggregateFunction::Avg => ops.extend([SlotOp::Add, SlotOp::Add]),
                AggregateFunction::Sum => ops.extend([SlotOp::Add, SlotOp::Max]),
                AggregateFunction::Min => ops.extend([SlotOp::Min, SlotOp::Max]),
                AggregateFunction::Max => ops.extend([SlotOp::Max, SlotOp::Max]),
            }
        }
        Self {
            stride: ops.len(),
            aggs,
            ops,
        }
    }

    pub fn empty(&self) -> Vec<i64> {
        let mut v = vec![0; self.stride];
        v[FIRST] = i64::MAX;
        v[LAST] = i64::MIN;
        for (f, slot) in &self.aggs {
            match f {
                AggregateFunction::Min => v[*slot] = i64::MAX,
                AggregateFunction::Max => v[*slot] = i64::MIN,
                _ => {}
            }
        }
        v
    }

    /// Appends to `out` version `v`, whose accumulator is `acc`.
    #[inline]
    fn push(&self, out: &mut Emissions, v: Version<'_>, acc: &[i64]) {
        out.push_acc(v, acc, HEADER, &self.aggs);
    }

    /// Merges `src` into `dst`.
    pub fn merge(&self, dst: &mut [i64], src: &[i64]) {
        for ((d, s), op) in dst.iter_mut().zip(src).zip(&self.ops) {
            *d = match op {
                SlotOp::Add => d.wrapping_add(*s),
                SlotOp::Min => (*d).min(*s),
                SlotOp::Max => (*d).max(*s),
            };
        }
    }
}

/// Emission bookkeeping of one window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WindowMeta {
    /// Last emitted version (0 = never emitted).
    pub version: u32,
    /// The watermark has passed the end (on-time fired, or created after it).
    pub closed: bool,
    /// Changed since its last emission.
    pub dirty: bool,
}

/// A tumbling or sliding window of one key, and the pane that starts where it does, if
/// any: its start (pane index), the pane's slot in the slab, its last emitted version,
/// and whether it is closed and changed. Sixteen bytes: the flags take the slot's two
/// high bits, so a key's two windows in place take 40 bytes with their list.
///
/// Every pane has its window (a record creates the windows over its pane, the window
/// starting at the pane among them, and the pane retires with that window), so a key's
/// window list is its pane list too: a tumbling window is its pane. (A sliding key has
/// windows without a pane of their own.) Whether a pane changed since the last fire is
/// `WindowEngine::pane_dirty[slab]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C, packed(4))]
pub(crate) struct Window {
    pub start: i64,
    /// The pane's slab slot ([`SLOT_BITS`] bits; all ones: no pane), then the closed
    /// and dirty flags.
    bits: u32,
    /// Last emitted version (0 = never emitted).
    pub version: u32,
}

/// Bits of a window's pane slot: slab slots run to `2^30 - 2`, a billion panes.
const SLOT_BITS: u32 = 30;
const SLOT_MASK: u32 = (1 << SLOT_BITS) - 1;
const CLOSED: u32 = 1 << SLOT_BITS;
const DIRTY: u32 = 1 << (SLOT_BITS + 1);
/// The most panes a slab holds.
pub(crate) const MAX_PANES: usize = SLOT_MASK as usize;

impl Window {
    /// Window `start`, open or closed, with the pane at `slab` (or [`NO_SLAB`]).
    pub fn new(start: i64, slab: u32, closed: bool) -> Self {
        let mut w = Self {
            start,
            bits: 0,
            version: 0,
        };
        w.set_slab(slab);
        w.set_closed(closed);
        w
    }

    /// The slab slot of the pane starting with it ([`NO_SLAB`]: none).
    #[inline]
    pub fn slab(&self) -> u32 {
        match self.bits & SLOT_MASK {
            SLOT_MASK => NO_SLAB,
            s => s,
        }
    }

    #[inline]
    pub fn set_slab(&mut self, slab: u32) {
        debug_assert!(slab == NO_SLAB || slab < SLOT_MASK);
        self.bits = (self.bits & !SLOT_MASK) | (slab & SLOT_MASK);
    }

    /// The watermark has passed the end (on-time fired, or created after it).
    #[inline]
    pub fn closed(&self) -> bool {
        self.bits & CLOSED != 0
    }

    #[inline]
    pub fn set_closed(&mut self, closed: bool) {
        self.set_flag(CLOSED, closed);
    }

    /// Changed since its last emission.
    #[inline]
    pub fn dirty(&self) -> bool {
        self.bits & DIRTY != 0
    }

    #[inline]
    pub fn set_dirty(&mut self, dirty: bool) {
        self.set_flag(DIRTY, dirty);
    }

    #[inline]
    fn set_flag(&mut self, flag: u32, on: bool) {
        self.bits = if on {
            self.bits | flag
        } else {
            self.bits & !flag
        };
    }

    /// Its emission bookkeeping.
    #[inline]
    pub fn meta(&self) -> WindowMeta {
        WindowMeta {
            version: self.version,
            closed: self.closed(),
            dirty: self.dirty(),
        }
    }

    #[inline]
    pub fn set_meta(&mut self, meta: WindowMeta) {
        self.version = meta.version;
        self.set_closed(meta.closed);
        self.set_dirty(meta.dirty);
    }

    /// The newest of a key's `windows` (the one starting at its newest pane: the pane
    /// nearly every record of an active key goes to), or an entry without a pane.
    #[inline]
    pub fn newest(windows: &[Window]) -> Self {
        windows
            .last()
            .copied()
            .unwrap_or(Self::new(0, NO_SLAB, false))
    }
}

/// How far back from a key's newest window [`pane_slab`] looks.
const PANE_LOOKBACK: usize = 3;

/// The slab slot of the pane starting at `pane` among a key's `windows`, if it is held
/// and one of the newest few: the newest pane takes nearly every record of an active key,
/// and the few before it take records that arrive out of order across a pane's boundary.
/// ([`NO_SLAB`] otherwise: the caller takes the full path.)
#[inline]
fn pane_slab(windows: &[Window], pane: i64) -> u32 {
    for w in windows.iter().rev().take(PANE_LOOKBACK) {
        if w.start <= pane {
            return if w.start == pane { w.slab() } else { NO_SLAB };
        }
    }
    NO_SLAB
}

/// A key's tumbling or sliding windows, sorted by start: two of them (a tumbling job's
/// open window and the one before it, held for its lateness) in place, in the key's entry,
/// so the newest is found with one read and a key costs no allocation; more on the heap.
pub(crate) type WindowList = SmallVec<[Window; 2]>;

/// Bounds (µs) of the window starting at pane `start_pane` (free of `&self`, for callers
/// that hold parts of the engine mutably).
pub(crate) fn pane_window_bounds(
    start_pane: i64,
    pane_us: i64,
    panes_per_window: i64,
) -> (i64, i64) {
    let start = start_pane.saturating_mul(pane_us);
    (
        start,
        start.saturating_add(pane_us.saturating_mul(panes_per_window)),
    )
}

/// The end of the index range of the windows whose panes the window at `i` covers (of a
/// key's list, sorted by start): those starting in it, from `i` itself (some without a
/// pane, in a sliding job). A walk, not a search: a window covers at most
/// `panes_per_window` entries, and a caller visiting a key's windows in order passes the
/// end it found for the window before (`to`), so the walk only moves forward.
#[inline]
fn covered(windows: &[Window], i: usize, to: usize, panes_per_window: i64) -> usize {
    let end = windows[i].start.saturating_add(panes_per_window);
    let mut to = to.max(i);
    while to < windows.len() && windows[to].start < end {
        to += 1;
    }
    to
}

/// The range `from..to` of a key's windows without the windows at either end that have
/// no pane: consecutive sliding windows over the same panes then give one range, and
/// share one merge.
#[inline]
fn with_panes(windows: &[Window], mut from: usize, mut to: usize) -> (usize, usize) {
    while from < to && windows[from].slab() == NO_SLAB {
        from += 1;
    }
    while to > from && windows[to - 1].slab() == NO_SLAB {
        to -= 1;
    }
    (from, to)
}

/// Finds `start` in a list sorted by start: `Ok(index)`, or `Err(insertion point)`.
/// Records mostly arrive in time order, so the newest entry is tried first.
#[inline]
pub(crate) fn seek<T>(list: &[T], start: i64, of: impl Fn(&T) -> i64) -> Result<usize, usize> {
    match list.last().map(&of) {
        None => Err(0),
        Some(last) if last < start => Err(list.len()),
        Some(last) if last == start => Ok(list.len() - 1),
        Some(_) => list.binary_search_by_key(&start, of),
    }
}

/// A record of a batch that passed classification, on its way to dedup and its windows.
#[derive(Clone, Copy)]
struct Routed {
    row: u32,
    key: u32,
    type_ix: Option<usize>,
    /// The watermark it is judged by.
    wm: i64,
    /// Its dedup identity, unless an identity column is null. Routing leaves it None;
    /// the dedup loop digests it a chunk ahead of observing it ([`digest_identities`]).
    identity: Option<u128>,
    /// The slab slot of its pane, when found by the fast path (else [`NO_SLAB`]), and its
    /// event time's offset in the pane (for a record judged for dedup only, its key
    /// group).
    slab: u32,
    offset: u32,
}

pub(crate) const NO_SLAB: u32 = u32::MAX;
/// How many records ahead of the one observed the dedup loop prefetches an identity's
/// index entry: far enough that it arrives from memory (about 100 ns) in time, near enough
/// that it is still cached when observed.
const DEDUP_AHEAD: usize = 16;
/// Keys whose state is read ahead at a time: a chunk of records' keys and window lists in
/// `process_batch`, and a fire's keys (see [`touch_windows`]).
const READ_AHEAD: usize = 256;
/// Rows of emission columns [`WindowEngine::recycle`] keeps whatever the recent fires.
const MIN_SPARE_ROWS: usize = 4096;
/// A record's key before it is interned.
const NO_KEY: u32 = u32::MAX;
/// The key of a record judged for dedup only (see [`EngineConfig::dedup_only_column`]):
/// it is never interned, and leaves the batch at dedup.
const DEDUP_ONLY: u32 = u32::MAX - 1;

/// Reads the newest window of each of `keys`, so that the walk that follows finds their
/// lists in cache; with `records`, the first word of its pane's record too (the pane an
/// early emission of an open window merges). A short loop with no branch on what it reads,
/// in which the CPU keeps many keys' cache misses in flight at once, where the walk,
/// branching on each window, waited for each. Returns a value of what was read, for the
/// caller to hand to [`std::hint::black_box`].
#[inline]
fn touch_windows(
    key_windows: &[WindowList],
    records: Option<&PaneSlab>,
    keys: impl Iterator<Item = u32>,
) -> i64 {
    keys.fold(0, |seen, key| {
        let newest = Window::newest(&key_windows[key as usize]);
        let record = records.map_or(0, |slab| slab.touch(newest.slab()));
        seen ^ newest.start ^ i64::from(record)
    })
}

/// Reads the accumulator at each of `slabs` (a pane's slab slot; [`NO_SLAB`] reads
/// nothing), as [`touch_windows`] does.
#[inline]
fn touch_slab(slab: &PaneSlab, slabs: impl Iterator<Item = u32>) -> u32 {
    slabs.fold(0, |seen, s| seen ^ slab.touch(s))
}

/// How one aggregate takes a record.
pub(crate) struct AggPlan<'a> {
    pub function: AggregateFunction,
    /// Its slot in a wide accumulator, and its words in a pane's record.
    pub slot: usize,
    pub words: AggWords,
    /// The event type (index) it counts, when it counts one.
    pub event_type: Option<usize>,
    pub input: Option<&'a arrow::array::PrimitiveArray<Int64Type>>,
}

/// Merges record `row` (event time `t`, event type `type_ix`) into the accumulator `acc`
/// in place: the same as merging the record's own accumulator into it.
#[inline]
pub(crate) fn apply(
    plan: &[AggPlan<'_>],
    acc: &mut [i64],
    t: i64,
    type_ix: Option<usize>,
    row: usize,
) {
    acc[EVENTS] = acc[EVENTS].wrapping_add(1);
    acc[FIRST] = acc[FIRST].min(t);
    acc[LAST] = acc[LAST].max(t);
    for a in plan {
        if a.event_type.is_some() && a.event_type != type_ix {
            continue;
        }
        let s = a.slot;
        let value = match a.input {
            None => {
                acc[s] = acc[s].wrapping_add(1);
                continue;
            }
            Some(c) if c.is_null(row) => continue,
            Some(c) => c.value(row),
        };
        match a.function {
            AggregateFunction::Count => acc[s] = acc[s].wrapping_add(1),
            AggregateFunction::Avg => {
                acc[s] = acc[s].wrapping_add(value);
                acc[s + 1] = acc[s + 1].wrapping_add(1);
            }
            AggregateFunction::Sum => {
                acc[s] = acc[s].wrapping_add(value);
                acc[s + 1] = 1;
            }
            AggregateFunction::Min => {
                acc[s] = acc[s].min(value);
                acc[s + 1] = 1;
            }
            AggregateFunction::Max => {
                acc[s] = acc[s].max(value);
                acc[s + 1] = 1;
            }
        }
    }
}

/// One session of one key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Session {
    pub end: i64,
    pub acc: SessionAcc,
    pub meta: WindowMeta,
}

/// A session's accumulator: in place up to eight words (three slots of its own, one per
/// count, two per sum, minimum, maximum or average: `withdrawals` needs eight), so that a
/// new session allocates nothing. Serialised as a sequence, as the
/// `Vec` it replaced was: the snapshot format is unchanged.
pub(crate) type SessionAcc = SmallVec<[i64; 8]>;

/// The sessions of one key, sorted by start and disjoint (one's end at most the next's
/// start); most keys hold one, in place.
pub(crate) type SessionList = SmallVec<[(i64, Session); 1]>;

/// A key's session state: its sessions, and the end of its latest retired session
/// (`i64::MIN` for none), before which its records are late, so that a retired session is
/// never recreated. Two cache lines (the frontier and the list, whose one session holds
/// its accumulator in place), read ahead of a chunk of records (see `touch_sessions`).
#[derive(Debug, Clone)]
#[repr(align(64))]
pub(crate) struct KeySessions {
    pub frontier: i64,
    pub list: SessionList,
}

impl Default for KeySessions {
    fn default() -> Self {
        Self {
            frontier: i64::MIN,
            list: SessionList::new(),
        }
    }
}

/// Reads the state of each key in `keys` (its frontier, then its newest session's
/// accumulator), so that the loop over the same records after it finds them in cache.
#[inline]
fn touch_sessions(sessions: &[KeySessions], keys: impl Iterator<Item = u32> + Clone) -> i64 {
    let lines = keys.clone().fold(0, |seen, k| {
        seen ^ sessions.get(k as usize).map_or(0, |s| s.frontier)
    });
    keys.fold(lines, |seen, k| {
        let acc = sessions
            .get(k as usize)
            .and_then(|s| s.list.last())
            .and_then(|s| s.1.acc.first());
        seen ^ acc.copied().unwrap_or(0)
    })
}

/// What a timer does when the watermark reaches its time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum TimerKind {
    OnTime,
    Retire,
}

/// A timer: window `start` (pane index, or session start µs) of `key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Timer {
    pub key: u32,
    pub start: i64,
    pub kind: TimerKind,
}

impl Timer {
    /// The canonical order of the timers due at one time: (key, window, kind), not the
    /// order of scheduling, so that a restored engine, which schedules its timers anew,
    /// fires alike.
    pub fn firing_order(&self) -> (u32, i64, bool) {
        (self.key, self.start, matches!(self.kind, TimerKind::Retire))
    }
}

/// Timers compare in [`Timer::firing_order`] (a session job's timer heap orders by time,
/// then by this).
impl Ord for Timer {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.firing_order().cmp(&other.firing_order())
    }
}

impl PartialOrd for Timer {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// Column positions of a batch, resolved once per batch.
struct Columns<'a> {
    keys: Vec<Strs<'a>>,
    time: &'a arrow::array::PrimitiveArray<TimestampMicrosecondType>,
    identity: Vec<Strs<'a>>,
    event_type: Option<Strs<'a>>,
    input: Option<Strs<'a>>,
    agg_inputs: Vec<Option<&'a arrow::array::PrimitiveArray<Int64Type>>>,
    row_watermark: Option<&'a arrow::array::PrimitiveArray<Int64Type>>,
    dedup_only: Option<&'a BooleanArray>,
}

/// A multi-column key of `row` into `buf`: the values joined with `|`, each escaped, so
/// ("a|b", "c") and ("a", "b|c") stay different keys.
fn join_key(keys: &[Strs<'_>], row: usize, buf: &mut String) {
    buf.clear();
    for (i, k) in keys.iter().enumerate() {
        if i > 0 {
            buf.push('|');
        }
        for ch in k.value(row).chars() {
            if ch == '|' || ch == '\\' {
                buf.push('\\');
            }
            buf.push(ch);
        }
    }
}

/// The engine. See the module docs.
#[derive(Debug)]
pub struct WindowEngine {
    pub(crate) spec: Arc<JobSpec>,
    pub(crate) config: EngineConfig,
    pub(crate) layout: Arc<Layout>,
    pub(crate) empty_acc: Vec<i64>,
    /// Pane width (µs) and panes per window; unused for sessions.
    pub(crate) pane_us: i64,
    pub(crate) panes_per_window: i64,
    pub(crate) lateness_us: i64,
    pub(crate) horizon_us: i64,
    pub(crate) early_us: Option<i64>,
    pub(crate) keys: KeyTable,
    pub(crate) key_group: Vec<u16>,
    /// Tumbling and sliding windows: per key id, its windows with their panes, sorted by
    /// start (dense by key id, so a record or an emission finds its key's state with one
    /// index; empty for session jobs).
    pub(crate) key_windows: Vec<WindowList>,
    /// The panes' accumulators, by slab slot.
    pub(crate) slab: PaneSlab,
    /// Per slab slot, whether its pane changed since the last fire.
    pub(crate) pane_dirty: Vec<bool>,
    pub(crate) free: Vec<u32>,
    /// Session jobs: per key id, its sessions and their frontier (dense by key id, as
    /// `key_windows`; empty for tumbling and sliding jobs).
    pub(crate) sessions: Vec<KeySessions>,
    /// Session jobs' timers, earliest first (a session's start is its own, so its timers
    /// are not derived from shared window starts as `window_timers` are). A timer whose
    /// session has since changed its end is stale, and skipped when due.
    pub(crate) timers: BinaryHeap<Reverse<(i64, Timer)>>,
    /// Tumbling and sliding jobs' timers (one per window, derived from the windows).
    pub(crate) window_timers: WindowTimers,
    pub(crate) dirty_panes: Vec<(u32, i64)>,
    /// Keys with an open window changed since the early trigger last fired (repeats
    /// allowed): the trigger walks each key's windows for the changed ones.
    pub(crate) early_keys: Vec<u32>,
    pub(crate) correction_queue: Vec<(u32, i64)>,
    pub(crate) pending: Emissions,
    pub(crate) dedup: DedupSet,
    pub(crate) dedup_swept_at: i64,
    /// A watermark no record to come is judged below (see [`Self::set_dedup_floor`]).
    dedup_floor: i64,
    pub(crate) watermarks: Watermarks,
    pub(crate) next_early_at: Option<i64>,
    key_buf: String,
    /// Scratch for digesting identities, and for an emission's accumulator.
    digests: DigestScratch,
    acc_buf: Vec<i64>,
    /// Scratch for the key hashes of a chunk of records.
    hash_buf: Vec<u64>,
    /// Scratch for the timers due at one time.
    timer_buf: Vec<Timer>,
    /// Emptied emissions handed back by [`Self::recycle`], whose columns the next fire
    /// fills.
    pub(crate) spare: Emissions,
    /// Rows handed back lately, decaying (see [`Self::recycle`]).
    recent_rows: usize,
}

fn col<'a>(batch: &'a RecordBatch, name: &str) -> Result<&'a Arc<dyn Array>> {
    batch.column_by_name(name).ok_or_else(|| {
        WindowError::new(
            ErrorKind::InvalidInput,
            format!("input batch has no column `{name}`"),
        )
    })
}

fn str_col<'a>(batch: &'a RecordBatch, name: &str) -> Result<Strs<'a>> {
    Strs::of(col(batch, name)?.as_ref()).ok_or_else(|| {
        WindowError::new(
            ErrorKind::InvalidInput,
            format!("column `{name}` must be Utf8 or Dictionary(Int32, Utf8)"),
        )
    })
}

fn str_cols<'a>(batch: &'a RecordBatch, names: &[String]) -> Result<Vec<Strs<'a>>> {
    names.iter().map(|c| str_col(batch, c)).collect()
}

impl WindowEngine {
    /// A new, empty engine for `spec`.
    pub fn new(spec: Arc<JobSpec>, config: EngineConfig) -> Result<Self> {
        spec.validate()?;
        if config.key_groups == 0 {
            return Err(WindowError::new(
                ErrorKind::Config,
                "key_groups must be positive",
            ));
        }
        Ok(Self::empty(spec, config))
    }

    /// Empties the engine for another run of its job (a backfill's next sub-range), as
    /// if new, but keeps the memory of its dedup set. A set sized for a sub-range runs to
    /// hundreds of megabytes, and a fresh one pays a page fault for each 4 KiB of it on
    /// first touch: a ninth of a backfill's time.
    pub fn reset(&mut self) {
        let mut dedup = std::mem::take(&mut self.dedup);
        dedup.clear();
        *self = Self::empty(Arc::clone(&self.spec), self.config.clone());
        self.dedup = dedup;
    }

    /// An empty engine for a validated `spec` and `config`.
    fn empty(spec: Arc<JobSpec>, config: EngineConfig) -> Self {
        let (pane_us, panes_per_window) = match spec.window {
            WindowSpec::Tumbling { size } => (micros(size), 1),
            WindowSpec::Sliding { size, slide } => (micros(slide), micros(size) / micros(slide)),
            WindowSpec::Session { .. } => (1, 1),
        };
        let layout = Arc::new(Layout::new(&spec));
        let slab = PaneSlab::new(&layout, pane_us);
        Self {
            empty_acc: layout.empty(),
            layout,
            pane_us,
            panes_per_window,
            lateness_us: micros(spec.lateness.allowed),
            horizon_us: spec.dedup_horizon_us(),
            early_us: spec.triggers.early_every.map(micros),
            watermarks: Watermarks::new(
                micros(spec.time.max_out_of_orderness),
                micros(spec.time.idle_timeout),
            ),
            spec,
            config,
            keys: KeyTable::default(),
            key_group: Vec::new(),
            key_windows: Vec::new(),
            slab,
            pane_dirty: Vec::new(),
            free: Vec::new(),
            sessions: Vec::new(),
            timers: BinaryHeap::new(),
            window_timers: WindowTimers::default(),
            dirty_panes: Vec::new(),
            early_keys: Vec::new(),
            correction_queue: Vec::new(),
            pending: Emissions::default(),
            dedup: DedupSet::default(),
            dedup_swept_at: i64::MIN,
            dedup_floor: i64::MIN,
            next_early_at: None,
            key_buf: String::new(),
            digests: DigestScratch::default(),
            hash_buf: Vec::new(),
            acc_buf: Vec::new(),
            timer_buf: Vec::new(),
            spare: Emissions::default(),
            recent_rows: 0,
        }
    }

    /// The job spec.
    pub fn spec(&self) -> &JobSpec {
        &self.spec
    }

    /// The engine options.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The current watermark, µs (`i64::MIN` before any input).
    pub fn watermark(&self) -> i64 {
        self.watermarks.current()
    }

    /// Per-input watermark progress (for metrics: watermark delay per input).
    pub fn watermarks(&self) -> &Watermarks {
        &self.watermarks
    }

    /// Makes room for the dedup identities of about `records` more records (a backfill
    /// knows how many it will read; growing the table as it goes rehashes it repeatedly).
    pub fn reserve(&mut self, records: usize) {
        self.dedup.reserve(records);
    }

    /// Promises that no record from now on is judged by a watermark below `floor` (its
    /// row's, or the engine's). The dedup set then drops identities that expire by
    /// `floor` before it grows, so it holds about what the horizon holds. A backfill,
    /// whose engine watermark stands still until the end of a sub-range while each row
    /// carries the watermark it arrived at, knows such a floor from the files it has yet
    /// to read; the engine's own watermark is one anyway.
    pub fn set_dedup_floor(&mut self, floor: i64) {
        self.dedup_floor = self.dedup_floor.max(floor);
    }

    /// The end of the latest window a record at event time `t` belongs to, µs: its pane's
    /// newest window for tumbling and sliding windows, `t + gap` (its own session extent)
    /// for sessions. A record is beyond allowed lateness once the watermark reaches this
    /// end plus the allowed lateness.
    pub fn latest_window_end(&self, t: i64) -> i64 {
        if self.is_session() {
            t.saturating_add(self.spec.window.span_us())
        } else {
            self.window_bounds(t.div_euclid(self.pane_us)).1
        }
    }

    /// Whether every record with a key, at event time `earliest` or later, that is judged
    /// by watermark `wm` (its row's, or the engine's when that is higher) is taken: within
    /// the allowed lateness of its newest window (or of the session it would start or
    /// join, which ends after it) and within the dedup horizon. When this holds of the
    /// earliest record of an input whose keys are never null, none of its records is late,
    /// and a caller may leave out what it reads only to report late records.
    pub fn on_time_from(&self, earliest: i64, wm: i64) -> bool {
        let wm = wm.max(self.watermarks.current());
        earliest.saturating_add(self.lateness_us.min(self.horizon_us)) > wm
    }

    /// The key group `key` hashes into.
    pub fn key_group_of(&self, key: &str) -> u16 {
        (xxhash_rust::xxh3::xxh3_64(key.as_bytes()) % u64::from(self.config.key_groups)) as u16
    }

    /// The key group of every row of `batch` (None where a key column is null), keyed as
    /// [`WindowEngine::process_batch`] keys them: a backfill's key-group range filter.
    pub fn key_groups_of_rows(&self, batch: &RecordBatch) -> Result<Vec<Option<u16>>> {
        let keys = str_cols(batch, &self.spec.key.columns)?;
        let mut buf = String::new();
        Ok((0..batch.num_rows())
            .map(|row| {
                if keys.iter().any(|k| k.is_null(row)) {
                    return None;
                }
                if keys.len() == 1 {
                    return Some(self.key_group_of(keys[0].value(row)));
                }
                join_key(&keys, row, &mut buf);
                Some(self.key_group_of(&buf))
            })
            .collect())
    }

    fn intern(&mut self, key: &str) -> u32 {
        self.intern_hashed(key, keys::hash(key))
    }

    /// [`Self::intern`] of a key whose hash is known.
    fn intern_hashed(&mut self, key: &str, hash: u64) -> u32 {
        if let Some(id) = self.keys.get_hashed(key, hash) {
            return id;
        }
        let id = self.keys.push_hashed(key, hash);
        let kg = self.key_group_of(key);
        self.key_group.push(kg);
        if self.is_session() {
            self.sessions.push(KeySessions::default());
        } else {
            self.key_windows.push(WindowList::new());
        }
        id
    }

    pub(crate) fn is_session(&self) -> bool {
        matches!(self.spec.window, WindowSpec::Session { .. })
    }

    pub(crate) fn window_bounds(&self, start_pane: i64) -> (i64, i64) {
        pane_window_bounds(start_pane, self.pane_us, self.panes_per_window)
    }

    /// Schedules a session's `timer` at `at`.
    fn schedule(&mut self, at: i64, timer: Timer) {
        self.timers.push(Reverse((at, timer)));
    }

    /// Removes the session timers of the earliest time, if it is at or before `wm`:
    /// returns the time, and sets `out` to its timers in [`Timer::firing_order`]. Timers
    /// scheduled meanwhile for the same time are the next call's.
    fn pop_session_timers(&mut self, wm: i64, out: &mut Vec<Timer>) -> Option<i64> {
        out.clear();
        let Reverse((at, _)) = *self.timers.peek().filter(|t| t.0.0 <= wm)?;
        while let Some(&Reverse((_, timer))) = self.timers.peek().filter(|t| t.0.0 == at) {
            out.push(timer);
            self.timers.pop();
        }
        Some(at)
    }

    fn columns<'a>(&self, batch: &'a RecordBatch) -> Result<Columns<'a>> {
        let spec = &self.spec;
        let keys = str_cols(batch, &spec.key.columns)?;
        let time = col(batch, &spec.time.event_time_column)?
            .as_primitive_opt::<TimestampMicrosecondType>()
            .ok_or_else(|| {
                WindowError::new(
                    ErrorKind::InvalidInput,
                    format!(
                        "column `{}` must be a microsecond timestamp",
                        spec.time.event_time_column
                    ),
                )
            })?;
        let identity = str_cols(batch, &spec.dedup.identity)?;
        let needs_type = !spec.source.event_types.is_empty()
            || spec.aggregates.iter().any(|a| a.event_type.is_some());
        let event_type = if needs_type {
            Some(str_col(batch, "event_type")?)
        } else {
            None
        };
        let input = match &spec.time.input_column {
            Some(c) => Some(str_col(batch, c)?),
            None => None,
        };
        let row_watermark =
            match &self.config.watermark_column {
                Some(c) => Some(col(batch, c)?.as_primitive_opt::<Int64Type>().ok_or_else(
                    || {
                        WindowError::new(
                            ErrorKind::InvalidInput,
                            format!("watermark column `{c}` must be Int64 (µs)"),
                        )
                    },
                )?),
                None => None,
            };
        let dedup_only = match &self.config.dedup_only_column {
            Some(c) => Some(col(batch, c)?.as_boolean_opt().ok_or_else(|| {
                WindowError::new(
                    ErrorKind::InvalidInput,
                    format!("dedup-only column `{c}` must be Boolean"),
                )
            })?),
            None => None,
        };
        let agg_inputs = spec
            .aggregates
            .iter()
            .map(|a| match &a.column {
                None => Ok(None),
                Some(c) => {
                    let array = col(batch, c)?;
                    if array.data_type() != &DataType::Int64 {
                        return Err(WindowError::new(
                            ErrorKind::InvalidInput,
                            format!("aggregate column `{c}` must be Int64"),
                        ));
                    }
                    Ok(Some(array.as_primitive::<Int64Type>()))
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Columns {
            keys,
            time,
            identity,
            event_type,
            input,
            agg_inputs,
            row_watermark,
            dedup_only,
        })
    }

    /// Routes the records of `batch` into windows. `input` names the batch's input
    /// (source partition or producer) unless the spec names an `input_column`;
    /// `proc_time_us` is the processing time of arrival.
    pub fn process_batch(
        &mut self,
        batch: &RecordBatch,
        input: &str,
        proc_time_us: i64,
    ) -> Result<BatchOutcome> {
        let cols = self.columns(batch)?;
        let mut outcome = BatchOutcome::default();
        let wm = self.watermarks.current();
        let mut batch_max: FxHashMap<&str, i64> = FxHashMap::default();
        let mut single_input_max = i64::MIN;
        let spec = Arc::clone(&self.spec);
        let layout = Arc::clone(&self.layout);
        let agg_type: Vec<Option<&str>> = spec
            .aggregates
            .iter()
            .map(|a| a.event_type.as_deref())
            .collect();
        let mut delta = vec![0i64; self.layout.stride];
        // Event types the job names, resolved once per row to a small index.
        let mut type_names: Vec<&str> =
            spec.source.event_types.iter().map(String::as_str).collect();
        for t in agg_type.iter().flatten() {
            if !type_names.contains(t) {
                type_names.push(t);
            }
        }
        // The job's own event types come first: a row passes the filter when its type is
        // one of them (or when the job reads every type).
        let filtered_types = spec.source.event_types.len();
        let agg_type_ix: Vec<Option<usize>> = agg_type
            .iter()
            .map(|t| t.and_then(|t| type_names.iter().position(|n| *n == t)))
            .collect();
        // Passes over the batch: classify each record; intern its key; check its dedup
        // identity; find its pane when that is its key's newest; apply it. The lookups
        // each have a short loop of their own, in which the CPU keeps many of their
        // cache misses in flight at once. In the loop of a whole record they came one at
        // a time: the dedup probes alone were four-tenths of a backfill's time.
        let type_of = |v: &str| {
            type_names
                .iter()
                .position(|n| n.len() == v.len() && *n == v)
        };
        // A dictionary's types are resolved once per value.
        let dict_types: Option<Vec<Option<usize>>> =
            cols.event_type.and_then(|c| c.values()).map(|values| {
                (0..values.len())
                    .map(|i| type_of(values.value(i)))
                    .collect()
            });
        let mut routed: Vec<Routed> = Vec::with_capacity(batch.num_rows());
        for row in 0..batch.num_rows() {
            let dedup_only = cols
                .dedup_only
                .is_some_and(|c| c.is_valid(row) && c.value(row));
            let type_ix = cols
                .event_type
                .and_then(|c| match (c.code(row), &dict_types) {
                    (Some(_), _) if c.is_null(row) => None,
                    (Some(code), Some(types)) => types.get(code).copied().flatten(),
                    _ => type_of(c.value(row)),
                });
            if filtered_types > 0 && type_ix.is_none_or(|i| i >= filtered_types) {
                outcome.filtered += u64::from(!dedup_only);
                continue;
            }
            let t = cols.time.value(row);
            // The watermark this record is judged by: its own, when so configured.
            let wm = match cols.row_watermark {
                Some(a) if !a.is_null(row) => wm.max(a.value(row)),
                _ => wm,
            };
            if wm < self.dedup_floor {
                // The caller broke its promise: identities this record could repeat may
                // have been dropped already.
                return Err(WindowError::new(
                    ErrorKind::Internal,
                    format!(
                        "row {row} is judged by watermark {wm}, below the dedup floor {} promised",
                        self.dedup_floor
                    ),
                ));
            }
            if dedup_only {
                // Claims its identity, if it is the first copy, and nothing else. A
                // record with a null key is late, not a copy that counts.
                if cols.keys.iter().all(|k| !k.is_null(row))
                    && cols.identity.iter().all(|c| !c.is_null(row))
                {
                    // Its key group, in place of a pane offset.
                    let group = if let [k] = cols.keys[..] {
                        self.key_group_of(k.value(row))
                    } else {
                        let mut buf = std::mem::take(&mut self.key_buf);
                        join_key(&cols.keys, row, &mut buf);
                        let group = self.key_group_of(&buf);
                        self.key_buf = buf;
                        group
                    };
                    routed.push(Routed {
                        row: row as u32,
                        key: DEDUP_ONLY,
                        type_ix,
                        wm,
                        // Digested below, with the batch's others.
                        identity: None,
                        slab: NO_SLAB,
                        offset: u32::from(group),
                    });
                }
                continue;
            }
            match cols.input {
                Some(c) => {
                    let name = if c.is_null(row) { "" } else { c.value(row) };
                    let e = batch_max.entry(name).or_insert(i64::MIN);
                    *e = (*e).max(t);
                }
                None => single_input_max = single_input_max.max(t),
            }
            // Key.
            if cols.keys.iter().any(|k| k.is_null(row)) {
                outcome.late.push(LateRecord {
                    row: row as u32,
                    reason: LateReason::NullKey,
                    watermark: wm,
                });
                continue;
            }
            // A key of one column is interned in a loop of its own, below.
            let key_id = if let [_] = cols.keys[..] {
                NO_KEY
            } else {
                let mut buf = std::mem::take(&mut self.key_buf);
                join_key(&cols.keys, row, &mut buf);
                let id = self.intern(&buf);
                self.key_buf = buf;
                id
            };
            routed.push(Routed {
                row: row as u32,
                key: key_id,
                type_ix,
                wm,
                // Digested below.
                identity: None,
                slab: NO_SLAB,
                offset: 0,
            });
        }
        // Keys of one column, in record order (ids are given in order of first sight), a
        // chunk at a time: the chunk's keys are hashed and their home slots read in a loop
        // of their own (see `KeyTable::touch`), then looked up from cache.
        if let [k] = cols.keys[..]
            && let Some(values) = k.values()
        {
            // A dictionary's keys are hashed and interned once per value, in the order of
            // first sight (the ids a plain column gives).
            let mut ids: Vec<u32> = vec![NO_KEY; values.len()];
            for r in routed.iter_mut().filter(|r| r.key != DEDUP_ONLY) {
                let Some(code) = k.code(r.row as usize) else {
                    continue;
                };
                if ids[code] == NO_KEY {
                    let key = values.value(code);
                    ids[code] = self.intern_hashed(key, keys::hash(key));
                }
                r.key = ids[code];
            }
        } else if let [k] = cols.keys[..] {
            let mut hashes = std::mem::take(&mut self.hash_buf);
            for chunk in routed.chunks_mut(READ_AHEAD) {
                hashes.clear();
                hashes.extend(chunk.iter().map(|r| keys::hash(k.value(r.row as usize))));
                std::hint::black_box(self.keys.touch(&hashes));
                for (r, &h) in chunk.iter_mut().zip(&hashes) {
                    if r.key != DEDUP_ONLY {
                        r.key = self.intern_hashed(k.value(r.row as usize), h);
                    }
                }
            }
            self.hash_buf = hashes;
        }
        // A record older than the dedup horizon is late whatever its window: the horizon is
        // what makes dedup exact (a session can outlive it).
        let horizon = self.horizon_us;
        routed.retain_mut(|r| {
            let t = cols.time.value(r.row as usize);
            if t.saturating_add(horizon) <= r.wm {
                if r.key != DEDUP_ONLY {
                    outcome.late.push(LateRecord {
                        row: r.row,
                        reason: LateReason::BeyondAllowedLateness,
                        watermark: r.wm,
                    });
                }
                return false;
            }
            true
        });
        // Dedup, in record order. An identity held past its horizon (not yet swept)
        // counts as absent, so classification never depends on when the sweep ran.
        // The set makes room for the batch first, so no observe moves an index entry and
        // each identity's first probe is known: the loop prefetches the entry of the
        // record `DEDUP_AHEAD` on (see `DedupSet::prefetch`), which is in cache when
        // that record is observed. The identities are digested a chunk ahead of the
        // records observed, in the same loop, so the digests' work runs while those
        // entries come from memory.
        let candidates = routed.len();
        self.dedup
            .make_room(candidates, self.dedup_floor.max(self.watermarks.current()));
        let first = candidates.min(DIGEST_CHUNK);
        digest_identities(&cols.identity, &mut routed[..first], &mut self.digests);
        let mut kept = 0;
        let mut duplicates = 0;
        for i in 0..candidates {
            if i % DIGEST_CHUNK == 0 {
                // The next chunk, which holds the records prefetched from here on.
                let (from, to) = (i + DIGEST_CHUNK, (i + 2 * DIGEST_CHUNK).min(candidates));
                if from < to {
                    digest_identities(&cols.identity, &mut routed[from..to], &mut self.digests);
                }
            }
            if let Some(ahead) = routed.get(i + DEDUP_AHEAD).and_then(|r| r.identity) {
                self.dedup.prefetch(ahead);
            }
            let r = routed[i];
            let dedup_only = r.key == DEDUP_ONLY;
            let duplicate = r.identity.is_some_and(|id| {
                let t = cols.time.value(r.row as usize);
                let group = if dedup_only {
                    r.offset as u16
                } else {
                    self.key_group[r.key as usize]
                };
                self.dedup
                    .observe(id, t.saturating_add(horizon), group, r.wm)
            });
            if dedup_only {
                continue;
            }
            if duplicate {
                duplicates += 1;
            } else {
                routed[kept] = r;
                kept += 1;
            }
        }
        routed.truncate(kept);

        outcome.duplicates += duplicates;
        // How each aggregate takes a record: its slot, the event type it counts (if
        // one), and its input column.
        let plan: Vec<AggPlan<'_>> = layout
            .aggs
            .iter()
            .enumerate()
            .map(|(i, (f, slot))| AggPlan {
                function: *f,
                slot: *slot,
                words: self.slab.agg_words().get(i).copied().unwrap_or_default(),
                event_type: agg_type[i].and(agg_type_ix[i]),
                input: cols.agg_inputs[i],
            })
            .collect();
        if !self.is_session() {
            self.find_newest_panes(&mut routed, cols.time);
        }
        // The accumulators of a chunk of records whose pane was found (or the session
        // state of their keys) are read ahead (see `touch_slab`), then applied from cache.
        let session = self.is_session();
        for chunk in routed.chunks(READ_AHEAD) {
            if session {
                std::hint::black_box(touch_sessions(&self.sessions, chunk.iter().map(|r| r.key)));
            } else {
                std::hint::black_box(touch_slab(&self.slab, chunk.iter().map(|r| r.slab)));
            }
            for &r in chunk {
                let (row, key_id, wm) = (r.row as usize, r.key, r.wm);
                let t = cols.time.value(row);
                // A record whose pane an earlier record of this batch made (a batch can
                // span more than a pane: a backfill's nearly always does) finds it here.
                let held = if r.slab != NO_SLAB {
                    Some((r.slab, r.offset))
                } else if session {
                    None
                } else {
                    self.claim_held_pane(key_id, t, wm)
                };
                if let Some((slab, offset)) = held {
                    self.slab.apply(slab, t, offset, &plan, r.type_ix, row);
                    outcome.counted += 1;
                    continue;
                }
                // The record's contribution.
                delta.copy_from_slice(&self.empty_acc);
                apply(&plan, &mut delta, t, r.type_ix, row);
                let accepted = if self.is_session() {
                    self.add_to_session(key_id, t, &delta, wm)
                } else {
                    self.add_to_pane(key_id, t, &delta, wm)
                };
                if accepted {
                    outcome.counted += 1;
                } else {
                    outcome.late.push(LateRecord {
                        row: row as u32,
                        reason: LateReason::BeyondAllowedLateness,
                        watermark: wm,
                    });
                }
            }
        }
        // Late records in row order, as one pass would have found them.
        if !outcome.late.is_sorted_by_key(|l| l.row) {
            outcome.late.sort_by_key(|l| l.row);
        }
        match cols.input {
            Some(_) => {
                for (name, max) in batch_max {
                    self.watermarks.observe(name, max, proc_time_us);
                }
            }
            None if single_input_max > i64::MIN => {
                self.watermarks
                    .observe(input, single_input_max, proc_time_us)
            }
            None => self.watermarks.touch(input, proc_time_us),
        }
        Ok(outcome)
    }

    /// Sets the slab slot of each record whose pane is held among its key's newest few
    /// (see [`pane_slab`]: nearly every record of a key that is still active), marking the
    /// pane changed. A short loop of its own, reading one small entry per key, so the CPU
    /// keeps many records' cache misses in flight at once; in the loop of a whole record,
    /// through the key's pane list, they came one at a time (process_batch 1.5 times as
    /// fast). Late records and records of panes not yet held keep [`NO_SLAB`]; the apply
    /// loop looks again for the latter, as a record before them may make their pane.
    fn find_newest_panes(
        &mut self,
        routed: &mut [Routed],
        time: &arrow::array::PrimitiveArray<TimestampMicrosecondType>,
    ) {
        // Each chunk's window lists are read ahead (see `touch_windows`): over 100,000 keys,
        // the walk's wait for each key's list was about a seventh of `process_batch`.
        for chunk in routed.chunks_mut(READ_AHEAD) {
            std::hint::black_box(touch_windows(
                &self.key_windows,
                None,
                chunk.iter().map(|r| r.key),
            ));
            self.newest_panes_of(chunk, time);
        }
    }

    /// [`Self::find_newest_panes`] of one chunk, read ahead.
    fn newest_panes_of(
        &mut self,
        routed: &mut [Routed],
        time: &arrow::array::PrimitiveArray<TimestampMicrosecondType>,
    ) {
        for r in routed {
            if let Some((slab, offset)) =
                self.claim_held_pane(r.key, time.value(r.row as usize), r.wm)
            {
                r.slab = slab;
                r.offset = offset;
            }
        }
    }

    /// The slab slot of the pane that holds `t` for `key`, and `t`'s offset in it, if the
    /// pane is held among the key's newest few windows (see [`pane_slab`]) and a record
    /// judged by watermark `wm` is on time for it; the pane is marked changed. `None`
    /// otherwise: the record takes the full path ([`Self::add_to_pane`]).
    #[inline]
    fn claim_held_pane(&mut self, key: u32, t: i64, wm: i64) -> Option<(u32, u32)> {
        let pane_us = self.pane_us;
        let pane = t.div_euclid(pane_us);
        let newest_end = pane_window_bounds(pane, pane_us, self.panes_per_window).1;
        if wm >= newest_end.saturating_add(self.lateness_us) {
            return None;
        }
        let slab = pane_slab(&self.key_windows[key as usize], pane);
        if slab == NO_SLAB {
            return None;
        }
        let dirty = &mut self.pane_dirty[slab as usize];
        if !*dirty {
            *dirty = true;
            self.dirty_panes.push((key, pane));
        }
        Some((slab, PaneSlab::offset(t, pane, pane_us)))
    }

    fn add_to_pane(&mut self, key: u32, t: i64, delta: &[i64], wm: i64) -> bool {
        let pane = t.div_euclid(self.pane_us);
        let newest_end = self.window_bounds(pane).1;
        if wm >= newest_end.saturating_add(self.lateness_us) {
            return false;
        }
        let windows = &mut self.key_windows[key as usize];
        if let Ok(i) = seek(windows, pane, |w| w.start)
            && windows[i].slab() != NO_SLAB
        {
            let slab = windows[i].slab();
            self.slab.merge_wide(slab, pane, delta);
            if !self.pane_dirty[slab as usize] {
                self.pane_dirty[slab as usize] = true;
                self.dirty_panes.push((key, pane));
            }
            return true;
        }
        // A new pane: its record, and the windows over it that are not yet held (the one
        // starting at it among them, unless a record of a later pane made it).
        let slab = match self.free.pop() {
            Some(s) => {
                self.slab.write(s, pane, delta);
                s
            }
            None => {
                assert!(
                    self.slab.len() < MAX_PANES,
                    "a window engine holds at most {MAX_PANES} panes"
                );
                let s = self.slab.push(pane, delta);
                self.pane_dirty.push(false);
                s
            }
        };
        self.pane_dirty[slab as usize] = true;
        self.dirty_panes.push((key, pane));
        if windows.is_empty() {
            // A key's first record makes every window over its pane at once: one
            // allocation, not a growth per doubling.
            windows.reserve(self.panes_per_window as usize);
        }
        for w in pane.saturating_sub(self.panes_per_window - 1)..=pane {
            let own = if w == pane { slab } else { NO_SLAB };
            let at = match seek(windows, w, |w| w.start) {
                Ok(i) => {
                    if own != NO_SLAB {
                        windows[i].set_slab(own);
                    }
                    continue;
                }
                Err(at) => at,
            };
            let (_, end) = pane_window_bounds(w, self.pane_us, self.panes_per_window);
            let retire_at = end.saturating_add(self.lateness_us);
            // (Never the window starting at the pane: the record would be late.)
            if wm >= retire_at {
                continue;
            }
            let closed = wm >= end;
            windows.insert(at, Window::new(w, own, closed));
            let (at, kind) = if closed {
                (retire_at, TimerKind::Retire)
            } else {
                (end, TimerKind::OnTime)
            };
            self.window_timers.push(
                at,
                Timer {
                    key,
                    start: w,
                    kind,
                },
            );
        }
        true
    }

    fn add_to_session(&mut self, key: u32, t: i64, delta: &[i64], wm: i64) -> bool {
        let gap = self.spec.window.span_us();
        let lateness = self.lateness_us;
        let state = &mut self.sessions[key as usize];
        if t < state.frontier {
            return false;
        }
        let layout = &self.layout;
        let sessions = &mut state.list;
        let mut start = t;
        let mut end = t.saturating_add(gap);
        // The sessions that overlap [t, t + gap): sorted and disjoint, they are the run
        // [lo, hi) that starts before its end and ends after `t`. (Or starts at `t`: at
        // the top of time the extent saturates to nothing, and a second record there must
        // still find the first one's session.)
        let hi = sessions.partition_point(|(s, _)| *s < end || *s == t);
        let mut lo = hi;
        while lo > 0 && (sessions[lo - 1].1.end > t || sessions[lo - 1].0 == t) {
            lo -= 1;
        }
        for (s, sess) in &sessions[lo..hi] {
            start = start.min(*s);
            end = end.max(sess.end);
        }
        if wm >= end.saturating_add(lateness) {
            return false;
        }
        // Most records fall inside a session that already spans them: it keeps its
        // identity (start and end), its version and its timer, and takes the record in
        // place.
        if hi - lo == 1 && sessions[lo].0 == start && sessions[lo].1.end == end {
            let sess = &mut sessions[lo].1;
            layout.merge(&mut sess.acc, delta);
            sess.meta.dirty = true;
            if sess.meta.closed {
                self.correction_queue.push((key, start));
            }
            return true;
        }
        // Otherwise the record starts a session, or extends or bridges sessions into one
        // of a new identity; those already emitted are retracted.
        let mut acc = SessionAcc::from_slice(&self.empty_acc);
        layout.merge(&mut acc, delta);
        let mut retractions = Vec::new();
        // Newest first: the order their retractions are emitted in.
        for (s, old) in sessions.drain(lo..hi).rev() {
            layout.merge(&mut acc, &old.acc);
            if old.meta.version > 0 {
                retractions.push((s, old));
            }
        }
        // The new session is closed only once the watermark has passed its end: merging
        // with a session already emitted on time does not make it final, since more events
        // may still extend it. (Its predecessors' versions are retracted below.)
        let meta = WindowMeta {
            dirty: true,
            closed: wm >= end,
            ..WindowMeta::default()
        };
        let closed = meta.closed;
        sessions.insert(lo, (start, Session { end, acc, meta }));
        for (s, old) in retractions {
            // A retraction counts nothing, but says which events it withdraws.
            let mut withdrawn = layout.empty();
            withdrawn[FIRST] = old.acc[FIRST];
            withdrawn[LAST] = old.acc[LAST];
            let v = Version {
                key: self.keys.name(key),
                window: (s, old.end),
                output_version: old.meta.version + 1,
                completeness: Completeness::Corrected,
                retracted: true,
                watermark: wm,
                emitted_at: 0,
            };
            layout.push(&mut self.pending, v, &withdrawn);
        }
        if closed {
            self.correction_queue.push((key, start));
            self.schedule(
                end.saturating_add(lateness),
                Timer {
                    key,
                    start,
                    kind: TimerKind::Retire,
                },
            );
        } else {
            self.schedule(
                end,
                Timer {
                    key,
                    start,
                    kind: TimerKind::OnTime,
                },
            );
        }
        true
    }

    /// Advances processing time to `proc_time_us`: updates the watermark (idleness
    /// included), fires on-time windows, emits corrections, fires the early trigger when
    /// due, and retires closed state. Returns the emitted rows in emission order.
    pub fn fire(&mut self, proc_time_us: i64) -> Emissions {
        self.watermarks.recompute(proc_time_us);
        self.fire_at(proc_time_us)
    }

    /// Ends the input: the watermark moves past every window, every window fires and retires.
    pub fn finish(&mut self, proc_time_us: i64) -> Emissions {
        self.watermarks.set_end();
        self.fire_at(proc_time_us)
    }

    /// Takes back emissions the caller is done with (emptied by [`Emissions::append`], or
    /// written by the sink), so that the next fire with nothing pending fills their
    /// columns instead of new ones.
    ///
    /// Large fresh columns cost a page fault per page, and the allocator hands large freed
    /// ones back to the kernel: sliding windows' early trigger spent about a quarter of its
    /// fire time so (BENCHMARKS.md, stop 24).
    ///
    /// Columns are kept up to four times the rows handed back lately (at least
    /// [`MIN_SPARE_ROWS`]), a figure that decays by a thirty-second each hand-back: a
    /// burst's columns serve the next burst, and are freed some dozens of hand-backs after
    /// the fires shrink. [`StateSize::spare_output_bytes`] reports what is kept.
    pub fn recycle(&mut self, mut rows: Emissions) {
        self.recent_rows = rows.len().max(self.recent_rows - self.recent_rows / 32);
        let bound = self.recent_rows.max(MIN_SPARE_ROWS).saturating_mul(4);
        if self.spare.capacity() > bound {
            self.spare = Emissions::default();
        }
        if rows.capacity() > self.spare.capacity() && rows.capacity() <= bound {
            rows.clear();
            self.spare = rows;
        }
    }

    fn fire_at(&mut self, proc_time_us: i64) -> Emissions {
        let wm = self.watermarks.current();
        let mut out = std::mem::take(&mut self.pending);
        if out.is_empty() {
            out = std::mem::take(&mut self.spare);
        }
        out.emitted_at_mut().fill(proc_time_us);
        // 1. Changed panes mark their windows. Every changed pane is in the list, so all
        // are unchanged after it: one fill, instead of finding each pane again.
        let dirty = std::mem::take(&mut self.dirty_panes);
        if !dirty.is_empty() {
            self.pane_dirty.fill(false);
        }
        // Each key's window list is read ahead a chunk at a time (see `touch_windows`).
        for chunk in dirty.chunks(READ_AHEAD) {
            std::hint::black_box(touch_windows(
                &self.key_windows,
                None,
                chunk.iter().map(|(key, _)| *key),
            ));
            for &(key, pane) in chunk {
                let windows = &mut self.key_windows[key as usize];
                let first = pane.saturating_sub(self.panes_per_window - 1);
                let mut open = false;
                // From the newest window back: a changed pane is mostly the newest, and
                // the walk reads no more than the windows it marks (the queues it fills
                // are sorted before use).
                for w in windows
                    .iter_mut()
                    .rev()
                    .skip_while(|w| w.start > pane)
                    .take_while(|w| w.start >= first)
                {
                    if !w.dirty() {
                        w.set_dirty(true);
                        if w.closed() {
                            self.correction_queue.push((key, w.start));
                        } else {
                            open = true;
                        }
                    }
                }
                if open {
                    self.early_keys.push(key);
                }
            }
        }
        // 2. Timers up to the watermark, in time order (room made for all first). At the
        // end of input, windows and sessions end in one walk instead.
        if wm == i64::MAX {
            if self.is_session() {
                self.end_sessions(wm, proc_time_us, &mut out);
            } else {
                self.end_windows(wm, proc_time_us, &mut out);
            }
        }
        out.reserve(self.window_timers.due(wm));
        let mut due = std::mem::take(&mut self.timer_buf);
        if self.is_session() {
            while let Some(at) = self.pop_session_timers(wm, &mut due) {
                for &timer in &due {
                    self.run_timer(at, timer, wm, proc_time_us, &mut out);
                }
            }
        } else {
            while let Some(at) = self.window_timers.pop_due(wm, &mut due) {
                for &timer in &due {
                    self.run_timer(at, timer, wm, proc_time_us, &mut out);
                }
            }
        }
        self.timer_buf = due;
        // 3. Corrections of closed windows. This queue and the early one are emitted by key
        // id, so an emission walks the per-key state in memory order instead of jumping
        // about it (a fifth off the early trigger's cost over 100,000 keys).
        let mut corrections = std::mem::take(&mut self.correction_queue);
        corrections.sort_unstable();
        out.reserve(corrections.len());
        for (key, start) in corrections {
            self.emit(
                key,
                start,
                Completeness::Corrected,
                wm,
                proc_time_us,
                &mut out,
            );
        }
        // 4. The early trigger.
        if let Some(every) = self.early_us {
            let due = *self
                .next_early_at
                .get_or_insert(proc_time_us.saturating_add(every));
            if proc_time_us >= due {
                let mut early = std::mem::take(&mut self.early_keys);
                early.sort_unstable();
                early.dedup();
                // Sized first: the columns of a sliding job's emissions run to hundreds of
                // megabytes, and growing them copies that again.
                let due: usize = early
                    .iter()
                    .map(|k| {
                        self.key_windows[*k as usize]
                            .iter()
                            .filter(|w| w.dirty() && !w.closed())
                            .count()
                    })
                    .sum();
                out.reserve(due);
                for chunk in early.chunks(READ_AHEAD) {
                    std::hint::black_box(touch_windows(
                        &self.key_windows,
                        Some(&self.slab),
                        chunk.iter().copied(),
                    ));
                    for &key in chunk {
                        self.emit_early(key, wm, proc_time_us, &mut out);
                    }
                }
                early.clear();
                self.early_keys = early;
                self.next_early_at = Some(proc_time_us.saturating_add(every));
            }
        } else {
            self.early_keys.clear();
        }
        // 5. Dedup identities past their horizon, once the set is a quarter full: a
        // sweep reads every identity and indexes the survivors again, and before then it cannot save the set a growth (a
        // backfill sizes its set for the whole sub-range). Identities past their horizon
        // count as absent whether swept or not.
        if wm == i64::MAX {
            // The end of input: every identity is past its horizon, so the set is emptied
            // whole, its memory kept for a reset (a backfill finishes each sub-range;
            // sweeping its set identity by identity cost a twelfth of the backfill).
            self.dedup.clear();
            self.dedup_swept_at = wm;
        } else if wm > self.dedup_swept_at.saturating_add(self.horizon_us / 8 + 1)
            && self.dedup.worth_sweeping()
        {
            self.dedup.retain(|expires, _| expires > wm);
            self.dedup_swept_at = wm;
        }
        out
    }

    fn run_timer(&mut self, at: i64, timer: Timer, wm: i64, now: i64, out: &mut Emissions) {
        let Timer { key, start, kind } = timer;
        if self.is_session() {
            let Some(end) = self.session(key, start).map(|s| s.end) else {
                return;
            };
            match kind {
                TimerKind::OnTime if end == at => {
                    self.emit(key, start, Completeness::OnTime, wm, now, out);
                    self.schedule(
                        end.saturating_add(self.lateness_us),
                        Timer {
                            key,
                            start,
                            kind: TimerKind::Retire,
                        },
                    );
                }
                TimerKind::Retire if end.saturating_add(self.lateness_us) == at => {
                    self.emit(key, start, Completeness::Corrected, wm, now, out);
                    let state = &mut self.sessions[key as usize];
                    if let Ok(i) = seek(&state.list, start, |s| s.0) {
                        state.list.remove(i);
                    }
                    state.frontier = state.frontier.max(end);
                }
                _ => {}
            }
            return;
        }
        match kind {
            TimerKind::OnTime => {
                if seek(&self.key_windows[key as usize], start, |w| w.start).is_err() {
                    return;
                }
                self.emit(key, start, Completeness::OnTime, wm, now, out);
                let (_, end) = self.window_bounds(start);
                self.window_timers.push(
                    end.saturating_add(self.lateness_us),
                    Timer {
                        key,
                        start,
                        kind: TimerKind::Retire,
                    },
                );
            }
            TimerKind::Retire => self.retire(key, start, wm, now, out),
        }
    }

    /// The end of input for tumbling and sliding windows, key by key: each window makes
    /// the one emission its two timers would make (on-time if still open, else the
    /// correction it awaits) and retires with its panes. A walk over each key's windows
    /// and panes, instead of two timer runs per window, each finding the window again.
    fn end_windows(&mut self, wm: i64, now: i64, out: &mut Emissions) {
        out.reserve(self.key_windows.iter().map(|l| l.len()).sum());
        let mut acc = std::mem::take(&mut self.acc_buf);
        for (key, list) in self.key_windows.iter_mut().enumerate() {
            let windows = std::mem::take(list);
            let mut to = 0;
            // As in `emit_early`: windows over the same panes share one merge.
            let mut merged = None;
            for (i, w) in windows.iter().enumerate() {
                let completeness = match (w.closed(), w.dirty()) {
                    (false, _) => Completeness::OnTime,
                    (true, true) => Completeness::Corrected,
                    (true, false) => continue,
                };
                to = covered(&windows, i, to, self.panes_per_window);
                let panes = with_panes(&windows, i, to);
                if merged != Some(panes) {
                    self.slab.merge_panes(&mut acc, &windows[panes.0..panes.1]);
                    merged = Some(panes);
                }
                if acc[EVENTS] != 0 {
                    let window = pane_window_bounds(w.start, self.pane_us, self.panes_per_window);
                    let name = self.keys.name(key as u32);
                    let v = Version::counted(name, window, w.version + 1, completeness, wm, now);
                    self.layout.push(out, v, &acc);
                }
            }
        }
        self.acc_buf = acc;
        self.slab.clear();
        self.pane_dirty.clear();
        self.free.clear();
        self.window_timers.clear();
        self.correction_queue.clear();
        self.early_keys.clear();
    }

    /// The end of input for a session job: emits every session that is open (on time)
    /// or changed since its last emission (corrected), then drops them all, as their
    /// timers would at an infinite watermark, in one walk by key.
    fn end_sessions(&mut self, wm: i64, now: i64, out: &mut Emissions) {
        out.reserve(self.sessions.iter().map(|k| k.list.len()).sum());
        for (key, state) in self.sessions.iter_mut().enumerate() {
            for (start, s) in std::mem::take(&mut state.list) {
                state.frontier = state.frontier.max(s.end);
                let completeness = match (s.meta.closed, s.meta.dirty) {
                    (false, _) => Completeness::OnTime,
                    (true, true) => Completeness::Corrected,
                    (true, false) => continue,
                };
                if s.acc[EVENTS] != 0 {
                    let name = self.keys.name(key as u32);
                    let v = Version::counted(
                        name,
                        (start, s.end),
                        s.meta.version + 1,
                        completeness,
                        wm,
                        now,
                    );
                    self.layout.push(out, v, &s.acc);
                }
            }
        }
        self.timers.clear();
        self.correction_queue.clear();
    }

    /// Session `start` of `key`, if open.
    pub(crate) fn session(&self, key: u32, start: i64) -> Option<&Session> {
        let sessions = &self.sessions.get(key as usize)?.list;
        seek(sessions, start, |s| s.0).ok().map(|i| &sessions[i].1)
    }

    fn session_mut(&mut self, key: u32, start: i64) -> Option<&mut Session> {
        let sessions = &mut self.sessions.get_mut(key as usize)?.list;
        let i = seek(sessions, start, |s| s.0).ok()?;
        Some(&mut sessions[i].1)
    }

    /// Retires window `start` of `key` (tumbling or sliding), with its last correction if
    /// one is due. Windows of a key retire in start order: a pane goes with the youngest
    /// window over it, once every older window over it has made its last correction.
    fn retire(&mut self, key: u32, start: i64, wm: i64, now: i64, out: &mut Emissions) {
        self.emit(key, start, Completeness::Corrected, wm, now, out);
        let windows = &mut self.key_windows[key as usize];
        let Ok(i) = seek(windows, start, |w| w.start) else {
            return;
        };
        // Pane `start` belongs to no younger window than this one: it is done too.
        let slab = windows.remove(i).slab();
        if slab != NO_SLAB {
            self.slab.release(slab);
            self.pane_dirty[slab as usize] = false;
            self.free.push(slab);
        }
    }

    /// The windows the early trigger will emit, as `(key, window start)` in order (the
    /// state's early queue).
    pub(crate) fn early_queue(&self) -> Vec<(u32, i64)> {
        let mut keys = self.early_keys.clone();
        keys.sort_unstable();
        keys.dedup();
        keys.into_iter()
            .flat_map(|k| {
                self.key_windows[k as usize]
                    .iter()
                    .filter(|w| w.dirty() && !w.closed())
                    .map(move |w| (k, w.start))
            })
            .collect()
    }

    /// The provisional versions of `key`'s changed open windows, in window order: one walk
    /// over its windows and panes, each window merging the panes it covers (a sliding
    /// window's pane is in every window over it, so one change emits many windows).
    fn emit_early(&mut self, key: u32, wm: i64, now: i64, out: &mut Emissions) {
        let windows = &mut self.key_windows[key as usize];
        let mut acc = std::mem::take(&mut self.acc_buf);
        let mut to = 0;
        // The panes merged into `acc`: consecutive windows over the same panes (a key
        // with few panes, in a sliding job) share one merge.
        let mut merged = None;
        for i in 0..windows.len() {
            let w = windows[i];
            if w.closed() || !w.dirty() {
                continue;
            }
            windows[i].set_dirty(false);
            to = covered(windows, i, to, self.panes_per_window);
            let panes = with_panes(windows, i, to);
            if merged != Some(panes) {
                self.slab.merge_panes(&mut acc, &windows[panes.0..panes.1]);
                merged = Some(panes);
            }
            if acc[EVENTS] != 0 {
                windows[i].version += 1;
                let window = pane_window_bounds(w.start, self.pane_us, self.panes_per_window);
                let v = Version::counted(
                    self.keys.name(key),
                    window,
                    windows[i].version,
                    Completeness::Provisional,
                    wm,
                    now,
                );
                self.layout.push(out, v, &acc);
            }
        }
        self.acc_buf = acc;
    }

    /// Emits window `start` of `key` when it has something to say for `completeness`.
    fn emit(
        &mut self,
        key: u32,
        start: i64,
        completeness: Completeness,
        wm: i64,
        now: i64,
        out: &mut Emissions,
    ) {
        /// Whether `completeness` has something to say, updating the window's bookkeeping.
        fn due(meta: &mut WindowMeta, completeness: Completeness) -> bool {
            match completeness {
                // The on-time version is the completeness transition of an open window.
                Completeness::OnTime if meta.closed => return false,
                Completeness::OnTime => meta.closed = true,
                // Stale queue entries must not clear a change that awaits a correction.
                Completeness::Provisional if meta.closed || !meta.dirty => return false,
                Completeness::Corrected if !meta.dirty => return false,
                _ => {}
            }
            meta.dirty = false;
            true
        }
        // The accumulator is built in a buffer the engine keeps (no allocation per emission).
        let mut acc = std::mem::take(&mut self.acc_buf);
        acc.clear();
        // The window's bounds and its new version, when it emits.
        let emitted = if self.is_session() {
            match self.session_mut(key, start) {
                Some(s) => (due(&mut s.meta, completeness) && s.acc[EVENTS] != 0).then(|| {
                    acc.extend_from_slice(&s.acc);
                    s.meta.version += 1;
                    ((start, s.end), s.meta.version)
                }),
                None => None,
            }
        } else {
            let bounds = self.window_bounds(start);
            let windows = &mut self.key_windows[key as usize];
            match seek(windows, start, |w| w.start) {
                Ok(i) => {
                    let mut meta = windows[i].meta();
                    let emits = due(&mut meta, completeness) && {
                        let to = covered(windows, i, i, self.panes_per_window);
                        self.slab.merge_panes(&mut acc, &windows[i..to]);
                        acc[EVENTS] != 0
                    };
                    if emits {
                        meta.version += 1;
                    }
                    windows[i].set_meta(meta);
                    emits.then_some((bounds, meta.version))
                }
                Err(_) => None,
            }
        };
        if let Some((bounds, version)) = emitted {
            let v = Version::counted(self.keys.name(key), bounds, version, completeness, wm, now);
            self.layout.push(out, v, &acc);
        }
        self.acc_buf = acc;
    }
}

/// The dedup identity of `row`: XXH3-128 over each column's value as a little-endian `u32`
/// length and its bytes (null as empty), except that the last of two columns goes without its
/// length. One-shot over the laid-out bytes (the same digest as streaming the parts).
///
/// Two columns whose bytes fit [`INLINE_IDENTITY`] (a tenant and an event id) are laid out
/// on the stack by fixed-size copies ([`lay_out_two`]): copied into `buf`, each value was a
/// call to `memcpy`, which cost about as much as the digest. A batch's identities are
/// digested by [`digest_identities`].
fn identity_hash<'a>(columns: &[Strs<'a>], row: usize, buf: &mut Vec<u8>) -> u128 {
    let value = |c: &Strs<'a>| -> &'a [u8] {
        if c.is_null(row) {
            b""
        } else {
            c.value(row).as_bytes()
        }
    };
    if let [first, last] = columns {
        let mut out = [0u8; INLINE_IDENTITY];
        if let Some(len) = lay_out_two(value(first), value(last), &mut out) {
            return xxhash_rust::xxh3::xxh3_128(&out[..len]);
        }
    }
    buf.clear();
    let two = columns.len() == 2;
    for (i, c) in columns.iter().enumerate() {
        let v = value(c);
        if !(two && i == 1) {
            buf.extend_from_slice(&(v.len() as u32).to_le_bytes());
        }
        buf.extend_from_slice(v);
    }
    xxhash_rust::xxh3::xxh3_128(buf)
}

/// Lays out the identity of two columns' values as [`identity_hash`] digests it (`first`'s
/// length, `first`, `last`) at the start of `out`, and returns its length; None when it
/// does not fit.
#[inline(always)]
fn lay_out_two(first: &[u8], last: &[u8], out: &mut [u8; INLINE_IDENTITY]) -> Option<usize> {
    let len = 4 + first.len() + last.len();
    if len > INLINE_IDENTITY {
        return None;
    }
    out[..4].copy_from_slice(&(first.len() as u32).to_le_bytes());
    put_small(&mut out[4..4 + first.len()], first);
    put_small(&mut out[4 + first.len()..len], last);
    Some(len)
}

/// Identities [`digest_identities`] lays out before it digests them. The dedup loop
/// digests a chunk ahead, so this is at least [`DEDUP_AHEAD`].
const DIGEST_CHUNK: usize = 32;
const _: () = assert!(DIGEST_CHUNK >= DEDUP_AHEAD);

/// What [`digest_identities`] works in, kept by the engine: it is called for each chunk of
/// a batch, and a fresh chunk's worth of stack cleared 3 KiB each time.
#[derive(Debug)]
struct DigestScratch {
    /// A chunk's identities, laid out.
    laid: Box<[[u8; INLINE_IDENTITY]; DIGEST_CHUNK]>,
    /// Per record of the chunk: its laid-out length, or [`NULL_IDENTITY`] or
    /// [`LONG_IDENTITY`].
    lens: [usize; DIGEST_CHUNK],
    /// An identity too long to lay out on the stack (see [`identity_hash`]).
    long: Vec<u8>,
}

impl Default for DigestScratch {
    fn default() -> Self {
        Self {
            laid: Box::new([[0; INLINE_IDENTITY]; DIGEST_CHUNK]),
            lens: [NULL_IDENTITY; DIGEST_CHUNK],
            long: Vec::new(),
        }
    }
}

/// A record of the chunk with a null identity column.
const NULL_IDENTITY: usize = usize::MAX;
/// A record of the chunk whose identity does not fit [`INLINE_IDENTITY`] (a laid-out
/// identity is never empty: it starts with a length).
const LONG_IDENTITY: usize = 0;

/// Gives each record of `routed` its dedup identity: the digest of its row's identity
/// columns ([`identity_hash`]), or None when one of them is null.
///
/// Two columns are laid out a chunk of records at a time, then digested. The digest reads
/// its input in 8-byte words, and a word that spans two of the stores that laid it out (the
/// length and the first value, say) cannot be forwarded from them while they are in
/// flight: it waits until they are written to the cache. Digested as soon as laid out, the
/// identities of a backfill waited so, at one load, for four-tenths of the digest's time.
fn digest_identities(columns: &[Strs<'_>], routed: &mut [Routed], scratch: &mut DigestScratch) {
    let present = |row: usize| columns.iter().all(|c| !c.is_null(row));
    let DigestScratch { laid, lens, long } = scratch;
    let [first, last] = columns else {
        for r in routed {
            let row = r.row as usize;
            r.identity = present(row).then(|| identity_hash(columns, row, long));
        }
        return;
    };
    for chunk in routed.chunks_mut(DIGEST_CHUNK) {
        for ((r, out), len) in chunk.iter().zip(laid.iter_mut()).zip(lens.iter_mut()) {
            let row = r.row as usize;
            *len = if present(row) {
                let (a, b) = (first.value(row).as_bytes(), last.value(row).as_bytes());
                lay_out_two(a, b, out).unwrap_or(LONG_IDENTITY)
            } else {
                NULL_IDENTITY
            };
        }
        for ((r, out), &len) in chunk.iter_mut().zip(laid.iter()).zip(lens.iter()) {
            r.identity = match len {
                NULL_IDENTITY => None,
                LONG_IDENTITY => Some(identity_hash(columns, r.row as usize, long)),
                len => Some(xxhash_rust::xxh3::xxh3_128(&out[..len])),
            };
        }
    }
}

/// The longest identity of two columns [`identity_hash`] lays out on the stack.
const INLINE_IDENTITY: usize = 96;

/// Copies `v` into `out` (of its length). Up to 32 bytes, by two overlapping copies of a
/// fixed size, which compile to a load and a store each; longer, by `memcpy`.
#[inline(always)]
fn put_small(out: &mut [u8], v: &[u8]) {
    let n = v.len();
    match n {
        16..=32 => {
            out[..16].copy_from_slice(&v[..16]);
            out[n - 16..].copy_from_slice(&v[n - 16..]);
        }
        8..=15 => {
            out[..8].copy_from_slice(&v[..8]);
            out[n - 8..].copy_from_slice(&v[n - 8..]);
        }
        4..=7 => {
            out[..4].copy_from_slice(&v[..4]);
            out[n - 4..].copy_from_slice(&v[n - 4..]);
        }
        _ => out.copy_from_slice(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::StringArray;

    /// The engine's keys are the model's joined keys: an erasure splits them with
    /// [`signalweave_model::key_parts`]. (A key of one column is its value.)
    #[test]
    fn keys_are_joined_as_the_model_joins_them() {
        let tenants = StringArray::from(vec!["t|1", "t", "", "t\\"]);
        let customers = StringArray::from(vec!["c", "c|\\x", "", "|"]);
        let columns = [Strs::Plain(&tenants), Strs::Plain(&customers)];
        let mut buf = String::new();
        for row in 0..tenants.len() {
            join_key(&columns, row, &mut buf);
            let values = [tenants.value(row), customers.value(row)];
            assert_eq!(buf, signalweave_model::join_key(&values));
            assert_eq!(signalweave_model::key_parts(&buf, 2), values);
        }
    }

    /// Checkpoints written when a session's accumulator was a `Vec` restore into the
    /// in-place one: both serialise to the same bytes.
    #[test]
    fn a_session_accumulator_serialises_as_a_vec_did() {
        for values in [vec![], vec![1i64, -2, i64::MAX], (0..12).collect()] {
            let acc = SessionAcc::from_slice(&values);
            let bytes = postcard::to_allocvec(&values).unwrap();
            assert_eq!(postcard::to_allocvec(&acc).unwrap(), bytes);
            assert_eq!(postcard::from_bytes::<SessionAcc>(&bytes).unwrap(), acc);
        }
    }

    proptest::proptest! {
        /// Laid out on the stack or in the buffer, short or long, null or not, two
        /// columns' digest is the streaming one of their parts.
        #[test]
        fn two_columns_digest_as_streamed(
            first in proptest::option::of("[a-z0-9-]{0,70}"),
            last in proptest::option::of("[A-Za-z0-9._:-]{0,90}"),
        ) {
            let (a, b) = (
                StringArray::from(vec![first.clone()]),
                StringArray::from(vec![last.clone()]),
            );
            let mut streamed = xxhash_rust::xxh3::Xxh3::new();
            let first = first.unwrap_or_default();
            streamed.update(&(first.len() as u32).to_le_bytes());
            streamed.update(first.as_bytes());
            streamed.update(last.unwrap_or_default().as_bytes());
            let mut buf = Vec::new();
            proptest::prop_assert_eq!(
                identity_hash(&[Strs::Plain(&a), Strs::Plain(&b)], 0, &mut buf),
                streamed.digest128()
            );
        }
    }

    proptest::proptest! {
        /// A batch's identities, digested a chunk at a time, are each row's digest, and
        /// None where an identity column is null: of two columns (long or short), of one,
        /// and of three, over more rows than a chunk holds, in any order.
        #[test]
        fn a_batch_digests_each_row_as_alone(
            rows in proptest::collection::vec(
                (
                    proptest::option::weighted(0.9, "[a-z0-9-]{0,12}"),
                    proptest::option::weighted(0.9, "[A-Za-z0-9._:-]{0,100}"),
                    proptest::option::weighted(0.9, "[a-z]{0,3}"),
                ),
                0..3 * DIGEST_CHUNK,
            ),
            order in proptest::collection::vec(0usize..1000, 0..3 * DIGEST_CHUNK),
        ) {
            let (a, b, c) = (
                StringArray::from(rows.iter().map(|r| r.0.clone()).collect::<Vec<_>>()),
                StringArray::from(rows.iter().map(|r| r.1.clone()).collect::<Vec<_>>()),
                StringArray::from(rows.iter().map(|r| r.2.clone()).collect::<Vec<_>>()),
            );
            // Records in some order, as routing leaves them: rows may be skipped or repeated.
            let routed: Vec<Routed> = if rows.is_empty() {
                Vec::new()
            } else {
                order
                    .iter()
                    .map(|&i| Routed {
                        row: (i % rows.len()) as u32,
                        key: 0,
                        type_ix: None,
                        wm: 0,
                        identity: Some(7),
                        slab: NO_SLAB,
                        offset: 0,
                    })
                    .collect()
            };
            let (mut scratch, mut buf) = (DigestScratch::default(), Vec::new());
            for columns in [
                vec![Strs::Plain(&a), Strs::Plain(&b)],
                vec![Strs::Plain(&b)],
                vec![Strs::Plain(&a), Strs::Plain(&b), Strs::Plain(&c)],
            ] {
                let mut digested = routed.clone();
                digest_identities(&columns, &mut digested, &mut scratch);
                for r in &digested {
                    let row = r.row as usize;
                    let alone = columns
                        .iter()
                        .all(|c| !c.is_null(row))
                        .then(|| identity_hash(&columns, row, &mut buf));
                    proptest::prop_assert_eq!(r.identity, alone, "row {}", row);
                }
            }
        }
    }

    /// Checkpoints hold identity digests: the one-shot digest must equal the streaming one
    /// earlier builds wrote.
    #[test]
    fn identity_digest_is_stable() {
        let tenant = StringArray::from(vec![Some("acme"), None]);
        let event = StringArray::from(vec![Some("e-1"), Some("e-2")]);
        let mut buf = Vec::new();
        let mut streamed = xxhash_rust::xxh3::Xxh3::new();
        streamed.update(&4u32.to_le_bytes());
        streamed.update(b"acme");
        streamed.update(b"e-1");
        assert_eq!(
            identity_hash(&[Strs::Plain(&tenant), Strs::Plain(&event)], 0, &mut buf),
            streamed.digest128()
        );
        let mut streamed = xxhash_rust::xxh3::Xxh3::new();
        for v in [&b"acme"[..], b"e-1", b""] {
            streamed.update(&(v.len() as u32).to_le_bytes());
            streamed.update(v);
        }
        let third = StringArray::from(vec![None::<&str>]);
        let (t, e) = (
            StringArray::from(vec!["acme"]),
            StringArray::from(vec!["e-1"]),
        );
        assert_eq!(
            identity_hash(
                &[Strs::Plain(&t), Strs::Plain(&e), Strs::Plain(&third)],
                0,
                &mut buf
            ),
            streamed.digest128()
        );
    }
}
