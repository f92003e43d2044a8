//! [`DedupSet`]: the dedup identities held within the horizon, each with its expiry (event
//! time, µs) and key group.
//!
//! An identity is an XXH3-128 digest, so its bits are already uniform. The set is two
//! arrays:
//! - a log of the identities held ([`Slot`]: digest, expiry, key group; 32 bytes), in the
//!   order they came, written at its end;
//! - an index of 8-byte entries, kept at most half full and probed linearly from the
//!   digest's bits. An entry holds 32 other bits of the digest (its tag) and the
//!   identity's place in the log.
//!
//! A probe reads the index, and reads the log only where a tag matches: a copy, or one
//! probe in four billion. So the memory read at random is 16 bytes per identity, where a
//! table of whole slots read 64: a million identities' index is 16 MiB, within the
//! third-level cache, where the slots were 64 MiB in memory. The engine prefetches the
//! entry of the identity some records ahead of the one it observes
//! ([`DedupSet::prefetch`]), so the CPU keeps many of these reads in flight.
//!
//! The index lives in an anonymous memory map of its own ([`Index`]), which the kernel
//! hands out zeroed (an empty index), and asked to back with huge pages: read at random,
//! in 4 KiB pages nearly every probe also missed the TLB, and each growth took a page
//! fault per 4 KiB and a pass writing every empty entry before its first use. The log is
//! an ordinary allocation: it is written at its end, and read at random only for copies.

use crate::prefetch::prefetch;

/// An identity held: its digest, expiry and key group.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
struct Slot {
    id: u128,
    expires: i64,
    group: u16,
    _pad: [u8; 6],
}

impl Slot {
    fn new(id: u128, expires: i64, group: u16) -> Self {
        Self {
            id,
            expires,
            group,
            _pad: [0; 6],
        }
    }
}

/// An index entry for the identity at `at` in the log: its tag above, its place plus one
/// below, so an entry is never `0` (empty).
#[inline]
fn entry(id: u128, at: usize) -> u64 {
    let at = u32::try_from(at + 1)
        .unwrap_or_else(|_| panic!("a dedup set holds at most 2^32 - 1 identities"));
    (u64::from(tag(id)) << 32) | u64::from(at)
}

/// The digest bits an entry keeps: the lowest 32, which choose no home (see [`home`]).
#[inline]
fn tag(id: u128) -> u32 {
    id as u32
}

/// The entry array: an anonymous memory map (zeroed by the kernel, so empty at once), or
/// nothing.
#[derive(Debug, Default)]
struct Index(Option<memmap2::MmapMut>);

impl Index {
    /// `n` empty entries. Aborts as a `Vec` would when the memory cannot be had.
    fn zeroed(n: usize) -> Self {
        if n == 0 {
            return Self(None);
        }
        let layout = std::alloc::Layout::array::<u64>(n)
            .unwrap_or_else(|_| std::alloc::handle_alloc_error(std::alloc::Layout::new::<u64>()));
        let map = memmap2::MmapMut::map_anon(layout.size())
            .unwrap_or_else(|_| std::alloc::handle_alloc_error(layout));
        // Huge pages are a hint: where the kernel has none, the set works the same.
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        Self(Some(map))
    }

    fn get(&self) -> &[u64] {
        self.0.as_deref().map_or(&[], bytemuck::cast_slice)
    }

    fn get_mut(&mut self) -> &mut [u64] {
        self.0
            .as_deref_mut()
            .map_or(&mut [], bytemuck::cast_slice_mut)
    }
}

/// The identities seen within the dedup horizon. See the module docs.
#[derive(Debug)]
pub(crate) struct DedupSet {
    /// Empty, or at least twice as long as the log.
    index: Index,
    /// The identities held, each where it first came (a sweep keeps their order). Its
    /// capacity is at least half the index's length, so inserts never reallocate it.
    log: Vec<Slot>,
    /// No identity held expires before this (`i64::MAX` when none is held), so a sweep
    /// at a floor below it would find nothing to drop.
    earliest: i64,
}

impl Default for DedupSet {
    fn default() -> Self {
        Self {
            index: Index::default(),
            log: Vec::new(),
            earliest: i64::MAX,
        }
    }
}

const MIN_ENTRIES: usize = 1024;

/// The first entry to probe for `id` among `n`: the digest's bits above the tag, folded
/// to 64 and scaled to `n` (a multiply and a shift, so `n` need not be a power of two and
/// a reserve is exact).
#[inline]
fn home(id: u128, n: usize) -> usize {
    let mix = ((id >> 32) as u64) ^ ((id >> 96) as u64);
    ((u128::from(mix) * n as u128) >> 64) as usize
}

/// The entry after `i` among `n`, wrapping.
#[inline]
fn next(i: usize, n: usize) -> usize {
    if i + 1 == n { 0 } else { i + 1 }
}

/// Indexes the identity `id` at `at` in the log, whose identity `index` does not hold, at
/// the first free entry from its home.
fn place(index: &mut [u64], id: u128, at: usize) {
    let n = index.len();
    let mut i = home(id, n);
    while index[i] != 0 {
        i = next(i, n);
    }
    index[i] = entry(id, at);
}

impl DedupSet {
    /// Identities held.
    pub fn len(&self) -> usize {
        self.log.len()
    }

    /// Heap bytes held.
    pub fn heap_bytes(&self) -> usize {
        std::mem::size_of_val(self.index.get()) + self.log.capacity() * size_of::<Slot>()
    }

    /// Index entries.
    fn entries(&self) -> usize {
        self.index.get().len()
    }

    /// Makes room for `more` identities without growing. The size is rounded up to a
    /// sixteenth of the next power of two (at most an eighth more), so a set emptied and
    /// reserved again for a run of about the same size (a backfill's next sub-range)
    /// keeps its memory.
    pub fn reserve(&mut self, more: usize) {
        let need = self.len().saturating_add(more).saturating_mul(2);
        if need > self.entries() {
            let step = (need.next_power_of_two() / 16).max(1);
            self.rebuild(need.div_ceil(step).saturating_mul(step).max(MIN_ENTRIES));
        }
    }

    /// Makes room for `more` identities as inserts would, by doubling: after it, `more`
    /// observes move no entry, so where each identity is probed is known beforehand (see
    /// [`DedupSet::prefetch`]).
    ///
    /// `floor` is a watermark no record to come is judged below, so an identity that
    /// expires by then counts as absent to every one of them (`i64::MIN`: none known).
    /// Before the set grows, it drops those; it grows only when that leaves it more than
    /// three-eighths full. So a set holds about what the horizon holds, whatever the
    /// run's length, and a sweep (which reads every identity and indexes the survivors
    /// again) comes at most once per eighth of the entries inserted.
    pub fn make_room(&mut self, more: usize, floor: i64) {
        let need = |len: usize| len.saturating_add(more).saturating_mul(2);
        let mut n = self.entries();
        if need(self.len()) <= n {
            return;
        }
        if floor >= self.earliest && n > 0 {
            self.retain(|expires, _| expires > floor);
            if need(self.len()).saturating_mul(4) <= n.saturating_mul(3) {
                return;
            }
            n = n.saturating_mul(2);
        }
        n = n.max(MIN_ENTRIES);
        while n < need(self.len()) {
            n = n.saturating_mul(2);
        }
        self.rebuild(n);
    }

    /// Asks the CPU to fetch the entry `id` is first probed at (see [`prefetch`]), for an
    /// observe some records later. Make room for those records first, so that no observe
    /// between moves the entry.
    #[inline]
    pub fn prefetch(&self, id: u128) {
        if let Some(entry) = self.first_probed(id) {
            prefetch(entry);
        }
    }

    /// The entry a probe for `id` reads first (none in an empty set).
    #[inline]
    fn first_probed(&self, id: u128) -> Option<&u64> {
        let index = self.index.get();
        index.get(home(id, index.len()))
    }

    /// Records `id` as seen until `expires`, unless it is held and still live at `wm`
    /// (held until after `wm`): then it is a duplicate, nothing changes, and this returns
    /// true. An identity held past its expiry (not yet swept) counts as absent.
    #[inline]
    pub fn observe(&mut self, id: u128, expires: i64, group: u16, wm: i64) -> bool {
        if (self.len() + 1) * 2 > self.entries() {
            self.rebuild((self.entries() * 2).max(MIN_ENTRIES));
        }
        let index = self.index.get_mut();
        let n = index.len();
        let tag = tag(id);
        let mut i = home(id, n);
        loop {
            let e = index[i];
            if e == 0 {
                index[i] = entry(id, self.log.len());
                self.log.push(Slot::new(id, expires, group));
                self.earliest = self.earliest.min(expires);
                return false;
            }
            if (e >> 32) as u32 == tag {
                let slot = &mut self.log[(e as u32 - 1) as usize];
                if slot.id == id {
                    if slot.expires > wm {
                        return true;
                    }
                    slot.expires = expires;
                    slot.group = group;
                    self.earliest = self.earliest.min(expires);
                    return false;
                }
            }
            i = next(i, n);
        }
    }

    /// Holds `id` until `expires`, replacing what was held for it.
    pub fn insert(&mut self, id: u128, expires: i64, group: u16) {
        self.observe(id, expires, group, i64::MAX);
    }

    /// Every identity held: (digest, expiry, key group), in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u128, i64, u16)> + '_ {
        self.log.iter().map(|s| (s.id, s.expires, s.group))
    }

    /// Removes every identity, keeping the memory.
    pub fn clear(&mut self) {
        if !self.log.is_empty() {
            self.index.get_mut().fill(0);
            self.log.clear();
        }
        self.earliest = i64::MAX;
    }

    /// Whether a sweep can be worth its cost: more than a quarter of the entries are held
    /// (the set grows at half).
    pub fn worth_sweeping(&self) -> bool {
        self.len() * 4 > self.entries()
    }

    /// Keeps the identities for which `keep(expires, group)` holds, in the order they
    /// came, and indexes them again.
    pub fn retain(&mut self, keep: impl Fn(i64, u16) -> bool) {
        let before = self.log.len();
        // Recomputed over what is kept, in the same pass.
        let mut earliest = i64::MAX;
        self.log.retain(|s| {
            let kept = keep(s.expires, s.group);
            if kept {
                earliest = earliest.min(s.expires);
            }
            kept
        });
        self.earliest = earliest;
        if self.log.len() < before {
            let index = self.index.get_mut();
            index.fill(0);
            for (at, s) in self.log.iter().enumerate() {
                place(index, s.id, at);
            }
        }
    }

    /// Indexes every identity in `entries` entries (at least twice `len`), and gives the
    /// log room for half that many.
    fn rebuild(&mut self, entries: usize) {
        // The old index goes first, so two indexes are never held at once (the log's
        // growth may hold two logs, unless the allocator moves its pages).
        self.index = Index::default();
        self.index = Index::zeroed(entries);
        let index = self.index.get_mut();
        for (at, s) in self.log.iter().enumerate() {
            place(index, s.id, at);
        }
        let room = entries / 2;
        if room > self.log.capacity() {
            self.log.reserve_exact(room - self.log.len());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    /// Distinct digests crowded into two home entries, the first and the last (the bits
    /// that choose it are all zero or all one), so probe sequences run long, cross, and
    /// wrap around the end. A third of them share one tag, so a probe meets tags that
    /// match identities that do not.
    fn crowd(i: u64) -> u128 {
        match i % 3 {
            0 => u128::from(i),
            1 => u128::MAX - u128::from(i),
            _ => (u128::from(i) << 96) | 0x5EED,
        }
    }

    #[test]
    fn a_cleared_set_forgets_all_and_keeps_its_memory_for_a_like_reserve() {
        let mut set = DedupSet::default();
        set.reserve(100_000);
        let slots = set.entries();
        assert!(
            (200_000..=225_000).contains(&slots),
            "{slots}: an eighth at most over"
        );
        for id in 0..1_000u128 {
            set.insert(id, 10, 0);
        }
        set.clear();
        assert_eq!(set.len(), 0);
        assert!(!set.observe(7, 10, 0, 0), "forgotten");
        assert!(!set.observe(0, 10, 0, 0), "the zero digest too");
        let bytes = set.heap_bytes();
        set.clear();
        set.reserve(99_000);
        assert_eq!(set.entries(), slots, "kept");
        assert_eq!(set.heap_bytes(), bytes, "the log's memory kept too");
        set.reserve(300_000);
        assert!(set.entries() >= 600_000);
    }

    #[test]
    fn after_making_room_the_batch_moves_no_slot() {
        let mut set = DedupSet::default();
        set.prefetch(1);
        for i in 1..=3_000u128 {
            set.make_room(1, i64::MIN);
            set.insert(i, 0, 0);
        }
        set.make_room(5_000, i64::MIN);
        let bytes = set.heap_bytes();
        assert!(bytes >= (3_000 + 5_000) * (2 * 8 + 32));
        let ids: Vec<u128> = (10_001..15_001u128)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835))
            .collect();
        for id in &ids {
            set.prefetch(*id);
        }
        for id in &ids {
            assert!(!set.observe(*id, 10, 0, 0));
        }
        assert_eq!(set.heap_bytes(), bytes, "no growth within the batch");
        assert_eq!(set.len(), 8_000);
        assert!(ids.iter().all(|id| set.observe(*id, 10, 0, 0)), "all held");
        // What a prefetch asks for is where the probe starts: the home entry of a held
        // identity alone at home is its own.
        let mut lone = DedupSet::default();
        assert_eq!(
            lone.first_probed(crowd(2)),
            None,
            "an empty set has no entry"
        );
        lone.insert(crowd(2), 1, 0);
        assert_eq!(lone.first_probed(crowd(2)), Some(&entry(crowd(2), 0)));
    }

    #[test]
    fn a_slot_is_the_size_of_its_fields_and_an_entry_is_never_empty() {
        assert_eq!(std::mem::size_of::<Slot>(), 32);
        assert_ne!(entry(0, 0), 0, "the zero digest, first in the log");
        assert_eq!(entry(u128::MAX, 5) as u32, 6);
        assert_eq!(entry(u128::MAX, 5) >> 32, u64::from(u32::MAX));
    }

    #[test]
    fn observe_reports_live_duplicates_only() {
        let mut set = DedupSet::default();
        assert!(!set.observe(42, 100, 3, 0));
        assert!(set.observe(42, 200, 4, 99), "held until 100, live at 99");
        assert!(
            !set.observe(42, 300, 5, 100),
            "expired at 100: counts as absent"
        );
        assert_eq!(set.iter().collect::<Vec<_>>(), vec![(42, 300, 5)]);
        assert!(
            !set.observe(0, 10, 1, 0),
            "the zero digest is an identity too"
        );
        assert!(set.observe(0, 10, 1, 5));
        assert_eq!(set.len(), 2);
    }

    proptest! {
        /// Against a map: random observes, inserts and sweeps, with digests crowded
        /// into few home slots, agree on every answer and on what is held.
        #[test]
        fn agrees_with_a_map(ops in prop::collection::vec((0u8..4, 0u64..1_500, 0i64..50), 1..1_500)) {
            let mut set = DedupSet::default();
            let mut map: HashMap<u128, (i64, u16)> = HashMap::new();
            for (op, raw, t) in ops {
                let id = if raw % 50 == 0 { 0 } else { crowd(raw) };
                let group = (raw % 11) as u16;
                match op {
                    0 | 1 => {
                        let wm = t - 10;
                        let dup = map.get(&id).is_some_and(|(e, _)| *e > wm);
                        if !dup {
                            map.insert(id, (t, group));
                        }
                        prop_assert_eq!(set.observe(id, t, group, wm), dup);
                    }
                    2 => {
                        map.insert(id, (t, group));
                        set.insert(id, t, group);
                    }
                    _ => {
                        map.retain(|_, (e, _)| *e > t);
                        set.retain(|e, _| e > t);
                    }
                }
                prop_assert_eq!(set.len(), map.len());
            }
            let mut held: Vec<_> = set.iter().collect();
            held.sort_unstable();
            let mut expected: Vec<_> = map.iter().map(|(id, (e, g))| (*id, *e, *g)).collect();
            expected.sort_unstable();
            prop_assert_eq!(held, expected);
        }
    }

    /// An odd multiplier that spreads small numbers over the high bits, which choose a
    /// digest's home slot, as a digest's bits are spread.
    const SPREAD: u128 = 0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835;

    #[test]
    fn with_a_floor_the_set_holds_about_the_horizon_and_answers_the_same() {
        // A million records in time order, a horizon of 10,000, every 7th a duplicate of
        // the record 5,000 before it (inside the horizon) or 20,000 before (outside it).
        let horizon = 10_000;
        let (mut floored, mut plain) = (DedupSet::default(), DedupSet::default());
        let mut most = 0;
        for t in 0..1_000_000i64 {
            let of = |record: i64| (record.max(0) as u128 + 1).wrapping_mul(SPREAD);
            let id = match t % 7 {
                3 => of(t - 5_000),
                5 => of(t - 20_000),
                _ => of(t),
            };
            let wm = t - 100;
            floored.make_room(1, wm);
            plain.make_room(1, i64::MIN);
            assert_eq!(
                floored.observe(id, t + horizon, 0, wm),
                plain.observe(id, t + horizon, 0, wm),
                "record {t}"
            );
            most = most.max(floored.entries());
        }
        // About 10,100 identities are live at once: the set stays within 8 times that.
        assert!(most <= 8 * 10_100, "{most} slots");
        assert!(plain.entries() >= 1_000_000);
    }

    #[test]
    fn a_sweep_at_the_floor_drops_what_expires_by_it_and_keeps_what_expires_after() {
        let mut set = DedupSet::default();
        set.make_room(1, i64::MIN);
        let slots = set.entries();
        let floor = 1_000;
        // Half the slots: the next batch sweeps. Identities 1..: expiring at the floor
        // (even) or just after it (odd).
        let of = |i: u64| u128::from(i).wrapping_mul(SPREAD);
        let held = slots as u64 / 2;
        for i in 1..=held {
            set.insert(of(i), floor + (i % 2) as i64, 0);
        }
        set.make_room(1, floor);
        assert_eq!(set.entries(), slots, "swept, not grown");
        assert_eq!(
            set.len() as u64,
            held / 2,
            "the ones expiring at the floor dropped"
        );
        for i in 1..=held {
            assert_eq!(
                set.observe(of(i), floor + 5, 0, floor),
                i % 2 == 1,
                "identity {i}"
            );
        }
    }

    proptest! {
        /// Sweeping at a floor no later record is judged below changes no answer. Each
        /// record repeats the identity of one a little before it (or is new), so
        /// repeats fall on both sides of their expiry, and the set fills with expired
        /// identities until it sweeps.
        #[test]
        fn a_floor_changes_no_answer(
            ops in prop::collection::vec((0i64..60, 0i64..10, 0i64..3, 0usize..4), 1..3_000),
        ) {
            let (mut floored, mut plain) = (DedupSet::default(), DedupSet::default());
            for (step, (back, dt, lag, more)) in ops.into_iter().enumerate() {
                let step = step as i64;
                let origin = (step - back).max(0);
                let id = if origin % 101 == 0 { 0 } else { (origin as u128).wrapping_mul(SPREAD) };
                // Judged at or above the floor, which trails the records.
                let (floor, wm) = (step - 5, step - 5 + lag);
                floored.make_room(more, floor);
                plain.make_room(more, i64::MIN);
                let expires = origin + dt + 20;
                prop_assert_eq!(
                    floored.observe(id, expires, (origin % 5) as u16, wm),
                    plain.observe(id, expires, (origin % 5) as u16, wm),
                    "record {}", step
                );
            }
        }
    }

    #[test]
    fn a_sweep_keeps_every_survivor_reachable() {
        let mut set = DedupSet::default();
        for i in 1..=5_000 {
            set.insert(crowd(i), i as i64, 0);
        }
        set.retain(|e, _| e % 3 != 0);
        assert_eq!(set.len(), 3_334);
        let survivors = || (1..=5_000u64).filter(|i| i % 3 != 0);
        for i in survivors() {
            assert!(set.observe(crowd(i), 0, 0, -1), "identity {i}");
        }
        set.reserve(100_000);
        assert!(set.entries() >= 200_000);
        for i in survivors() {
            assert!(set.observe(crowd(i), 0, 0, -1), "identity {i} after growth");
        }
        assert!(
            !set.observe(crowd(3), 7, 0, -1),
            "a swept identity is absent"
        );
    }
}
