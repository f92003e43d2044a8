//! [`PaneSlab`]: the accumulators of tumbling and sliding panes, packed into 32-bit words.
//!
//! A pane's accumulator ([`Layout`]) is a row of `i64` slots, but most of them are
//! counters (events, counts, an average's count), flags (whether a sum, minimum or
//! maximum saw a value) and two event times within the pane. In the slab a counter takes
//! one word, a flag one bit of a shared word, and the first and last event time one word
//! each, as offsets from the pane's start, when a pane is at most `u32::MAX` µs (71
//! minutes) wide. A sum takes one word too, as an `i32`: the sums of one key's pane are
//! small. Only minima and maxima take two words. A market_aggregates pane takes 40 bytes
//! instead of 96.
//!
//! A record is addressed by its slot and its pane's start (pane index): event times are
//! stored as offsets from the start's time, `start * pane_us` in wrapping arithmetic,
//! which gives every time back exactly.
//!
//! A counter that passes `u32::MAX`, or a sum that passes the range of an `i32`, is not
//! wrapped: what it carries is held apart, per record and word, and added back whenever
//! the record is read. Few panes ever carry (a sum past two billion minor units in one
//! pane of one key), so the map stays empty or small, and only its emptiness is checked
//! on the way.
//!
//! Reads and writes go through the wide form, a `Layout` row, so the rest of the engine
//! (emissions, snapshots, sessions) keeps one accumulator format.

use arrow::array::Array;
use bytemuck::{Pod, Zeroable};
use rustc_hash::FxHashMap;

use crate::engine::{AggPlan, EVENTS, FIRST, LAST, Layout, NO_SLAB, SlotOp, Window};
use crate::spec::AggregateFunction;

/// Sixteen words, aligned as a cache line (the slab's unit of growth).
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C, align(64))]
struct Line([u32; 16]);

const LINE_WORDS: usize = 16;

/// How one accumulator slot is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    /// An `i64` in two words (low, high), combined by `op`.
    Wide { word: usize, op: SlotOp },
    /// A counter in one word; what passes `u32::MAX` is carried apart.
    Count { word: usize },
    /// A sum in one word, as an `i32`; what passes its range is carried apart.
    Sum { word: usize },
    /// A flag (a sum's, minimum's or maximum's "saw a value"): the bits `mask` of `word`.
    Seen { word: usize, mask: u32 },
    /// The first event time, as its offset from the pane's start (`u32::MAX`: none).
    First { word: usize },
    /// The last event time, as its offset from the pane's start plus one (`0`: none).
    Last { word: usize },
}

/// Where an aggregate's value and its count or flag are stored: the count's word for a
/// count; with `seen` the flag's bit in `count`, or `0` when `count` is a counter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct AggWords {
    pub value: usize,
    pub count: usize,
    pub seen: u32,
}

/// The packed accumulators of the panes of a tumbling or sliding job, by slot.
#[derive(Debug, Clone)]
pub(crate) struct PaneSlab {
    lines: Vec<Line>,
    /// Records held (slots `0..len`).
    len: usize,
    /// Words per record.
    stride: usize,
    /// Pane width (µs).
    pane_us: i64,
    /// Per accumulator slot of the layout.
    lanes: Vec<Lane>,
    /// The lanes again, by kind, as (slot, word): wide sums, minima and maxima (the first
    /// and last event time among them when wide), counters, one-word sums; and flags as
    /// (slot, word, mask).
    adds: Vec<(usize, usize)>,
    mins: Vec<(usize, usize)>,
    maxes: Vec<(usize, usize)>,
    counts: Vec<(usize, usize)>,
    sums: Vec<(usize, usize)>,
    seen: Vec<(usize, usize, u32)>,
    aggs: Vec<AggWords>,
    events: usize,
    /// The first and last event time as one-word offsets (else as wide lanes).
    narrow_times: bool,
    first: usize,
    last: usize,
    /// The record of an empty accumulator.
    empty: Vec<u32>,
    /// The wide form of an empty accumulator.
    empty_wide: Vec<i64>,
    /// What counters and sums carried past their word, by (slot, word).
    carries: FxHashMap<(u32, u32), i64>,
}

#[inline]
fn get_wide(rec: &[u32], word: usize) -> i64 {
    (u64::from(rec[word]) | (u64::from(rec[word + 1]) << 32)) as i64
}

#[inline]
fn set_wide(rec: &mut [u32], word: usize, v: i64) {
    rec[word] = v as u32;
    rec[word + 1] = ((v as u64) >> 32) as u32;
}

/// Adds one to the counter at `word` of record `slot`, carrying past `u32::MAX`.
#[inline]
fn bump(rec: &mut [u32], word: usize, carries: &mut FxHashMap<(u32, u32), i64>, slot: u32) {
    let (v, carried) = rec[word].overflowing_add(1);
    rec[word] = v;
    if carried {
        let c = carries.entry((slot, word as u32)).or_insert(0);
        *c = c.wrapping_add(1 << 32);
    }
}

/// Adds `delta` to the counter at `word` of record `slot`, carrying past `u32::MAX`.
#[inline]
fn add_count(
    rec: &mut [u32],
    word: usize,
    delta: i64,
    carries: &mut FxHashMap<(u32, u32), i64>,
    slot: u32,
) {
    let sum = i64::from(rec[word]).wrapping_add(delta);
    rec[word] = sum as u32;
    carry(carries, slot, word, sum.wrapping_sub(i64::from(sum as u32)));
}

/// Holds `carried` apart for the word `word` of record `slot`.
#[inline]
fn carry(carries: &mut FxHashMap<(u32, u32), i64>, slot: u32, word: usize, carried: i64) {
    if carried != 0 {
        let c = carries.entry((slot, word as u32)).or_insert(0);
        *c = c.wrapping_add(carried);
    }
}

/// Adds `delta` to the one-word sum at `word` of record `slot`, carrying what passes the
/// range of an `i32` (the sum is the word's `i32` plus its carry, in wrapping `i64`).
#[inline]
fn add_sum(
    rec: &mut [u32],
    word: usize,
    delta: i64,
    carries: &mut FxHashMap<(u32, u32), i64>,
    slot: u32,
) {
    let sum = i64::from(rec[word] as i32).wrapping_add(delta);
    rec[word] = sum as i32 as u32;
    carry(carries, slot, word, sum.wrapping_sub(i64::from(sum as i32)));
}

/// Words per record of `used` words. Records are not padded to a cache line: at 10 words
/// rather than 16 a market pane's record costs 40 bytes instead of 64, and a record that
/// straddles two lines costs the second line's read, which the prefetcher of adjacent
/// lines mostly hides.
fn stride_of(used: usize) -> usize {
    used.next_multiple_of(2).max(2)
}

impl PaneSlab {
    /// An empty slab for `layout`'s accumulators of panes `pane_us` wide.
    pub fn new(layout: &Layout, pane_us: i64) -> Self {
        #[derive(Clone, Copy, PartialEq)]
        enum Kind {
            Wide(SlotOp),
            Count,
            Sum,
            Seen,
        }
        let narrow_times = (1..=i64::from(u32::MAX)).contains(&pane_us);
        let mut kinds = vec![Kind::Count; layout.stride];
        if !narrow_times {
            kinds[FIRST] = Kind::Wide(SlotOp::Min);
            kinds[LAST] = Kind::Wide(SlotOp::Max);
        }
        for (f, slot) in &layout.aggs {
            let (value, flag) = match f {
                AggregateFunction::Count => continue,
                AggregateFunction::Avg => (Kind::Sum, Kind::Count),
                AggregateFunction::Sum => (Kind::Sum, Kind::Seen),
                AggregateFunction::Min => (Kind::Wide(SlotOp::Min), Kind::Seen),
                AggregateFunction::Max => (Kind::Wide(SlotOp::Max), Kind::Seen),
            };
            kinds[*slot] = value;
            kinds[*slot + 1] = flag;
        }
        // Wide lanes first, at even words; then the one-word lanes; then the flags, 32 to
        // a word.
        let mut lanes = vec![Lane::Count { word: 0 }; layout.stride];
        let mut word = 0;
        for (slot, kind) in kinds.iter().enumerate() {
            if let Kind::Wide(op) = *kind {
                lanes[slot] = Lane::Wide { word, op };
                word += 2;
            }
        }
        for (slot, kind) in kinds.iter().enumerate() {
            lanes[slot] = match (slot, kind) {
                (_, Kind::Wide(_) | Kind::Seen) => continue,
                (FIRST, _) => Lane::First { word },
                (LAST, _) => Lane::Last { word },
                (_, Kind::Sum) => Lane::Sum { word },
                _ => Lane::Count { word },
            };
            word += 1;
        }
        let flags = kinds.iter().filter(|k| **k == Kind::Seen).count();
        for (i, slot) in (0..kinds.len())
            .filter(|s| kinds[*s] == Kind::Seen)
            .enumerate()
        {
            lanes[slot] = Lane::Seen {
                word: word + i / 32,
                mask: 1 << (i % 32),
            };
        }
        word += flags.div_ceil(32);
        let stride = stride_of(word);
        let word_of = |slot: usize| match lanes[slot] {
            Lane::Wide { word, .. }
            | Lane::Count { word }
            | Lane::Sum { word }
            | Lane::Seen { word, .. }
            | Lane::First { word }
            | Lane::Last { word } => word,
        };
        let aggs = layout
            .aggs
            .iter()
            .map(|(f, slot)| match (f, lanes.get(*slot + 1).copied()) {
                (AggregateFunction::Count, _) => AggWords {
                    value: word_of(*slot),
                    count: word_of(*slot),
                    seen: 0,
                },
                (_, Some(Lane::Seen { word, mask })) => AggWords {
                    value: word_of(*slot),
                    count: word,
                    seen: mask,
                },
                _ => AggWords {
                    value: word_of(*slot),
                    count: word_of(*slot + 1),
                    seen: 0,
                },
            })
            .collect();
        let empty_wide = layout.empty();
        let of_kind = |pick: &dyn Fn(Lane) -> Option<usize>| -> Vec<(usize, usize)> {
            lanes
                .iter()
                .enumerate()
                .filter_map(|(slot, lane)| pick(*lane).map(|word| (slot, word)))
                .collect()
        };
        let wide = |op: SlotOp| {
            move |lane: Lane| match lane {
                Lane::Wide { word, op: o } if o == op => Some(word),
                _ => None,
            }
        };
        let adds = of_kind(&wide(SlotOp::Add));
        let mins = of_kind(&wide(SlotOp::Min));
        let maxes = of_kind(&wide(SlotOp::Max));
        let counts = of_kind(&|lane| match lane {
            Lane::Count { word } => Some(word),
            _ => None,
        });
        let sums = of_kind(&|lane| match lane {
            Lane::Sum { word } => Some(word),
            _ => None,
        });
        let seen = lanes
            .iter()
            .enumerate()
            .filter_map(|(slot, lane)| match *lane {
                Lane::Seen { word, mask } => Some((slot, word, mask)),
                _ => None,
            })
            .collect();
        let mut slab = Self {
            adds,
            mins,
            maxes,
            counts,
            sums,
            seen,
            lines: Vec::new(),
            len: 0,
            pane_us,
            stride,
            events: word_of(EVENTS),
            first: word_of(FIRST),
            last: word_of(LAST),
            narrow_times,
            aggs,
            empty: Vec::new(),
            empty_wide,
            lanes,
            carries: FxHashMap::default(),
        };
        let mut empty = vec![0u32; stride];
        for lane in &slab.lanes {
            match *lane {
                Lane::Wide { word, op } => set_wide(
                    &mut empty,
                    word,
                    match op {
                        SlotOp::Add => 0,
                        SlotOp::Min => i64::MAX,
                        SlotOp::Max => i64::MIN,
                    },
                ),
                Lane::First { word } => empty[word] = u32::MAX,
                Lane::Count { .. } | Lane::Sum { .. } | Lane::Seen { .. } | Lane::Last { .. } => {}
            }
        }
        slab.empty = empty;
        slab
    }

    /// The time (µs) that event times in the record of pane `start` are offsets from.
    #[inline]
    fn base(&self, start: i64) -> i64 {
        start.wrapping_mul(self.pane_us)
    }

    /// The offset of event time `t` in pane `start` (the pane that holds it), as
    /// [`PaneSlab::apply`] takes it.
    #[inline]
    pub fn offset(t: i64, start: i64, pane_us: i64) -> u32 {
        t.wrapping_sub(start.wrapping_mul(pane_us)) as u32
    }

    /// Sets `acc` to the empty accumulator merged with the records of the panes of
    /// `windows` (those that have one).
    #[inline]
    pub fn merge_panes(&self, acc: &mut Vec<i64>, windows: &[Window]) {
        acc.clear();
        acc.extend_from_slice(&self.empty_wide);
        for w in windows {
            let slab = w.slab();
            if slab != NO_SLAB {
                self.merge_into(acc, slab, w.start);
            }
        }
    }

    /// Where each of the layout's aggregates is stored, in its order.
    pub fn agg_words(&self) -> &[AggWords] {
        &self.aggs
    }

    /// Bytes a record takes.
    pub fn record_bytes(&self) -> usize {
        self.stride * 4
    }

    /// Records held (free ones included).
    pub fn len(&self) -> usize {
        self.len
    }

    fn words(&self) -> &[u32] {
        bytemuck::cast_slice(&self.lines)
    }

    fn record(&self, slot: u32) -> &[u32] {
        let at = slot as usize * self.stride;
        &self.words()[at..at + self.stride]
    }

    /// Makes room for `n` more records.
    pub fn reserve(&mut self, n: usize) {
        let words = (self.len + n) * self.stride;
        self.lines
            .reserve(words.div_ceil(LINE_WORDS).saturating_sub(self.lines.len()));
    }

    /// Appends the record of the wide accumulator `acc` of the pane starting at `start`
    /// (which [`PaneSlab::fits`]), and returns its slot.
    pub fn push(&mut self, start: i64, acc: &[i64]) -> u32 {
        let slot = self.len as u32;
        self.len += 1;
        let lines = (self.len * self.stride).div_ceil(LINE_WORDS);
        if lines > self.lines.len() {
            self.lines.resize(lines, Line([0; LINE_WORDS]));
        }
        self.write(slot, start, acc);
        slot
    }

    /// Sets record `slot` to the wide accumulator `acc` of the pane starting at `start`.
    pub fn write(&mut self, slot: u32, start: i64, acc: &[i64]) {
        self.release(slot);
        let at = slot as usize * self.stride;
        let stride = self.stride;
        let words: &mut [u32] = bytemuck::cast_slice_mut(&mut self.lines);
        words[at..at + stride].copy_from_slice(&self.empty);
        self.merge_wide(slot, start, acc);
    }

    /// Forgets what record `slot` carried (its pane is gone, or rewritten).
    pub fn release(&mut self, slot: u32) {
        if !self.carries.is_empty() {
            self.carries.retain(|(s, _), _| *s != slot);
        }
    }

    /// Empties the slab, keeping its memory.
    pub fn clear(&mut self) {
        self.lines.clear();
        self.len = 0;
        self.carries.clear();
    }

    /// Whether the wide accumulator `acc` can be stored for the pane starting at
    /// `start`: its event times lie within the pane (always so for a pane's own records;
    /// a restored state is checked).
    pub fn fits(&self, start: i64, acc: &[i64]) -> bool {
        if !self.narrow_times {
            return true;
        }
        let base = self.base(start);
        let within = |t: i64| (t.wrapping_sub(base) as u64) < self.pane_us as u64;
        (acc[FIRST] == i64::MAX || within(acc[FIRST]))
            && (acc[LAST] == i64::MIN || within(acc[LAST]))
    }

    /// Merges the wide accumulator `acc` (of the pane starting at `start`) into record
    /// `slot`.
    pub fn merge_wide(&mut self, slot: u32, start: i64, acc: &[i64]) {
        let base = self.base(start);
        let at = slot as usize * self.stride;
        let stride = self.stride;
        let words: &mut [u32] = bytemuck::cast_slice_mut(&mut self.lines);
        let rec = &mut words[at..at + stride];
        for (lane, v) in self.lanes.iter().zip(acc) {
            match *lane {
                Lane::Wide { word, op } => {
                    let d = get_wide(rec, word);
                    set_wide(
                        rec,
                        word,
                        match op {
                            SlotOp::Add => d.wrapping_add(*v),
                            SlotOp::Min => d.min(*v),
                            SlotOp::Max => d.max(*v),
                        },
                    );
                }
                Lane::Count { word } => add_count(rec, word, *v, &mut self.carries, slot),
                Lane::Sum { word } => add_sum(rec, word, *v, &mut self.carries, slot),
                Lane::Seen { word, mask } if *v != 0 => rec[word] |= mask,
                Lane::Seen { .. } => {}
                Lane::First { word } if *v != i64::MAX => {
                    rec[word] = rec[word].min(v.wrapping_sub(base) as u32);
                }
                Lane::Last { word } if *v != i64::MIN => {
                    rec[word] = rec[word].max(v.wrapping_sub(base).wrapping_add(1) as u32);
                }
                Lane::First { .. } | Lane::Last { .. } => {}
            }
        }
    }

    /// Merges record `slot` (of the pane starting at `start`) into the wide `acc`.
    #[inline]
    pub fn merge_into(&self, acc: &mut [i64], slot: u32, start: i64) {
        let rec = self.record(slot);
        // Lane by lane kind, each a loop without a branch on the kind.
        for &(at, word) in &self.adds {
            acc[at] = acc[at].wrapping_add(get_wide(rec, word));
        }
        for &(at, word) in &self.mins {
            acc[at] = acc[at].min(get_wide(rec, word));
        }
        for &(at, word) in &self.maxes {
            acc[at] = acc[at].max(get_wide(rec, word));
        }
        for &(at, word, mask) in &self.seen {
            acc[at] = acc[at].max(i64::from(rec[word] & mask != 0));
        }
        if self.carries.is_empty() {
            for &(at, word) in &self.counts {
                acc[at] = acc[at].wrapping_add(i64::from(rec[word]));
            }
            for &(at, word) in &self.sums {
                acc[at] = acc[at].wrapping_add(i64::from(rec[word] as i32));
            }
        } else {
            let carried =
                |word: usize| self.carries.get(&(slot, word as u32)).copied().unwrap_or(0);
            for &(at, word) in &self.counts {
                let v = i64::from(rec[word]).wrapping_add(carried(word));
                acc[at] = acc[at].wrapping_add(v);
            }
            for &(at, word) in &self.sums {
                let v = i64::from(rec[word] as i32).wrapping_add(carried(word));
                acc[at] = acc[at].wrapping_add(v);
            }
        }
        if self.narrow_times {
            let base = self.base(start);
            let (first, last) = (rec[self.first], rec[self.last]);
            if first != u32::MAX {
                acc[FIRST] = acc[FIRST].min(base.wrapping_add(i64::from(first)));
            }
            if last != 0 {
                acc[LAST] = acc[LAST].max(base.wrapping_add(i64::from(last) - 1));
            }
        }
    }

    /// The wide accumulator of record `slot` (of the pane starting at `start`).
    pub fn read(&self, slot: u32, start: i64) -> Vec<i64> {
        let mut acc = self.empty_wide.clone();
        self.merge_into(&mut acc, slot, start);
        acc
    }

    /// Reads the first and last word of record `slot` (for a read-ahead; a slot past the
    /// end reads nothing).
    #[inline]
    pub fn touch(&self, slot: u32) -> u32 {
        let words = self.words();
        let at = slot as usize * self.stride;
        // A record may straddle two lines.
        let first = words.get(at).copied().unwrap_or(0);
        first ^ words.get(at + self.stride - 1).copied().unwrap_or(0)
    }

    /// Merges record `row` (event time `t`, event type `type_ix`) into record `slot`, of
    /// the pane that holds `t` at `offset` ([`PaneSlab::offset`]): as [`crate::engine`]'s
    /// `apply` does to a wide accumulator.
    #[inline]
    pub fn apply(
        &mut self,
        slot: u32,
        t: i64,
        offset: u32,
        plan: &[AggPlan<'_>],
        type_ix: Option<usize>,
        row: usize,
    ) {
        let at = slot as usize * self.stride;
        let stride = self.stride;
        let words: &mut [u32] = bytemuck::cast_slice_mut(&mut self.lines);
        let rec = &mut words[at..at + stride];
        let carries = &mut self.carries;
        bump(rec, self.events, carries, slot);
        if self.narrow_times {
            rec[self.first] = rec[self.first].min(offset);
            rec[self.last] = rec[self.last].max(offset.wrapping_add(1));
        } else {
            let (f, l) = (self.first, self.last);
            set_wide(rec, f, get_wide(rec, f).min(t));
            set_wide(rec, l, get_wide(rec, l).max(t));
        }
        for a in plan {
            if a.event_type.is_some() && a.event_type != type_ix {
                continue;
            }
            let value = match a.input {
                None => {
                    bump(rec, a.words.count, carries, slot);
                    continue;
                }
                Some(c) if c.is_null(row) => continue,
                Some(c) => c.value(row),
            };
            let w = a.words.value;
            match a.function {
                AggregateFunction::Count => {}
                AggregateFunction::Sum | AggregateFunction::Avg => {
                    add_sum(rec, w, value, carries, slot);
                }
                AggregateFunction::Min => set_wide(rec, w, get_wide(rec, w).min(value)),
                AggregateFunction::Max => set_wide(rec, w, get_wide(rec, w).max(value)),
            }
            match a.words.seen {
                0 => bump(rec, a.words.count, carries, slot),
                mask => rec[a.words.count] |= mask,
            }
        }
    }

    /// Bytes held for counters past `u32::MAX` (none, but for panes of four billion
    /// events).
    pub fn carry_bytes(&self) -> usize {
        self.carries.capacity() * 24
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use arrow::array::Int64Array;
    use proptest::prelude::*;

    use super::*;
    use crate::engine::apply;
    use crate::spec::JobSpec;

    /// A job of every aggregate function, over windows `size` wide.
    fn layout(size: &str) -> Layout {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../jobs/customer_features.toml"
        ))
        .unwrap();
        let text = text.replace(
            "kind = \"sliding\"\nsize = \"10m\"\nslide = \"1m\"",
            &format!("kind = \"tumbling\"\nsize = \"{size}\""),
        );
        let mut text = text.replace("[output]", "");
        text.truncate(text.find("table = \"customer_features\"").unwrap());
        for (i, f) in ["min", "avg", "count"].iter().enumerate() {
            text.push_str(&format!(
                "[[aggregates]]\nname = \"a{i}\"\nfunction = \"{f}\"\ncolumn = \"amount_minor\"\n\n"
            ));
        }
        text.push_str("[output]\ntable = \"customer_features\"\n");
        let spec = JobSpec::from_toml(&text).unwrap();
        assert_eq!(spec.aggregates.len(), 6);
        Layout::new(&spec)
    }

    fn plan<'a>(layout: &Layout, slab: &PaneSlab, input: &'a Int64Array) -> Vec<AggPlan<'a>> {
        layout
            .aggs
            .iter()
            .zip(slab.agg_words())
            .map(|((f, slot), words)| AggPlan {
                function: *f,
                slot: *slot,
                words: *words,
                event_type: None,
                input: (*f != AggregateFunction::Count || *slot != 3).then_some(input),
            })
            .collect()
    }

    #[test]
    fn a_market_pane_takes_ten_words() {
        // And a key's two windows (with their panes) in place take 40 bytes with their
        // list.
        assert_eq!(std::mem::size_of::<crate::engine::WindowList>(), 40);
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../jobs/market_aggregates.toml"
        ))
        .unwrap();
        let layout = Layout::new(&JobSpec::from_toml(&text).unwrap());
        assert_eq!(layout.stride, 12);
        // Events, first and last, three counts, three sums and a word of flags.
        let slab = PaneSlab::new(&layout, 60_000_000);
        assert_eq!(slab.record_bytes(), 40);
        // Two-hour panes keep their event times wide.
        let wide = PaneSlab::new(&layout, 7_200_000_000);
        assert_eq!(wide.stride, 12);
    }

    #[test]
    fn counters_and_sums_carry_past_their_word_and_forget_it_when_released() {
        let layout = layout("1m");
        let mut slab = PaneSlab::new(&layout, 60_000_000);
        let mut acc = layout.empty();
        acc[EVENTS] = i64::from(u32::MAX);
        acc[FIRST] = 7 * 60_000_000 + 5;
        acc[LAST] = 7 * 60_000_000 + 9;
        acc[3] = (1 << 40) + 3;
        // A sum past an `i32`, and an average's sum below it.
        acc[4] = 3_000_000_000;
        acc[5] = 1;
        acc[10] = -5_000_000_000;
        acc[11] = 2;
        let slot = slab.push(7, &acc);
        // Carried: the count past `u32::MAX` and both sums (the events not yet).
        assert_eq!(slab.carries.len(), 3);
        assert_eq!(slab.read(slot, 7), acc);
        let input = Int64Array::from(vec![Some(11)]);
        let plan = plan(&layout, &slab, &input);
        slab.apply(slot, 7 * 60_000_000 + 1, 1, &plan, None, 0);
        let mut want = acc.clone();
        apply(&plan, &mut want, 7 * 60_000_000 + 1, None, 0);
        assert_eq!(want[EVENTS], 1 << 32);
        assert_eq!(slab.read(slot, 7), want);
        let mut small = layout.empty();
        small[EVENTS] = 1;
        small[FIRST] = 8 * 60_000_000;
        small[LAST] = 8 * 60_000_000;
        slab.write(slot, 8, &small);
        assert_eq!(slab.read(slot, 8), small);
        assert!(slab.carries.is_empty());
    }

    #[test]
    fn restored_times_outside_their_pane_do_not_fit() {
        let layout = layout("1m");
        let slab = PaneSlab::new(&layout, 60_000_000);
        let mut acc = layout.empty();
        assert!(slab.fits(3, &acc), "an empty accumulator fits any pane");
        acc[FIRST] = 3 * 60_000_000;
        acc[LAST] = 4 * 60_000_000 - 1;
        assert!(slab.fits(3, &acc));
        acc[LAST] = 4 * 60_000_000;
        assert!(!slab.fits(3, &acc));
        acc[LAST] = 3 * 60_000_000;
        acc[FIRST] = 3 * 60_000_000 - 1;
        assert!(!slab.fits(3, &acc));
    }

    proptest! {
        /// Records applied in place, or merged as one-record accumulators, leave the
        /// record that a wide accumulator would hold, for narrow and wide event times and
        /// for panes at the ends of time; and a record written from its own wide form
        /// reads back the same.
        #[test]
        fn packed_records_match_wide_accumulators(
            wide_times in any::<bool>(),
            end in 0..3u8,
            near in -5i64..5,
            records in proptest::collection::vec(
                (0i64..7_200_000_000, proptest::option::of(any::<i64>()), any::<bool>()),
                1..40,
            ),
        ) {
            let (size, pane_us) = if wide_times { ("2h", 7_200_000_000) } else { ("1m", 60_000_000) };
            // The first pane of time, a pane near zero, or the last.
            let start = match end {
                0 => i64::MIN.div_euclid(pane_us),
                1 => near,
                _ => i64::MAX.div_euclid(pane_us),
            };
            let layout = layout(size);
            let mut slab = PaneSlab::new(&layout, pane_us);
            // Another record first, so the one under test is not at slot 0.
            slab.push(start.wrapping_add(1), &layout.empty());
            let input = Int64Array::from(records.iter().map(|r| r.1).collect::<Vec<_>>());
            let plan = plan(&layout, &slab, &input);
            let base = start.wrapping_mul(pane_us);
            let mut want = layout.empty();
            let mut slot = None;
            for (row, (off, _, in_place)) in records.iter().enumerate() {
                let off = off % pane_us;
                let t = base.wrapping_add(off);
                if t.div_euclid(pane_us) != start {
                    // Past the end of time: no event time is in this part of the pane.
                    continue;
                }
                apply(&plan, &mut want, t, None, row);
                prop_assert_eq!(PaneSlab::offset(t, start, pane_us), off as u32);
                let mut delta = layout.empty();
                apply(&plan, &mut delta, t, None, row);
                prop_assert!(slab.fits(start, &delta));
                match slot {
                    None => slot = Some(slab.push(start, &delta)),
                    Some(s) if *in_place => slab.apply(s, t, off as u32, &plan, None, row),
                    Some(s) => slab.merge_wide(s, start, &delta),
                }
            }
            let Some(slot) = slot else { return Ok(()) };
            prop_assert_eq!(&slab.read(slot, start), &want);
            let again = slab.push(start, &want);
            prop_assert_eq!(slab.read(again, start), want);
        }
    }
}
