//! [`DedupSet`]: the dedup identities held within the horizon, each with its expiry (event
//! time, µs) and key group.
//!
//! An identity is an XXH3-128 digest, so its bits are already uniform: the set is one flat
//! array of slots probed linearly from the digest's bits, kept at most half full. A lookup
//! touches one cache line, where a general hash map touches a control byte and a bucket.
//! The engine checks a batch's identities in a loop of their own, in which the CPU keeps
//! many of these misses in flight: a million inserts take 62 ms there, against 262 ms
//! with an `FxHashMap`, and a backfill runs 1.8 times as fast. (Probed from inside the
//! loop over whole records, the same set was slower than the map: each probe's miss was
//! waited for.)
//!
//! The slots live in an anonymous memory map of their own ([`Slots`]), which the kernel
//! hands out zeroed (an empty set), and asked to back with huge pages. A set runs to
//! hundreds of megabytes, probed at random: in 4 KiB pages nearly every probe also
//! misses the TLB, and a new set (each growth) took a page fault per 4 KiB and a pass
//! writing every empty slot before its first use.

use bytemuck::{Pod, Zeroable};

/// One slot: an identity digest (`0`: empty), its expiry and its key group. All zeros is
/// an empty slot, so a zeroed map is an empty set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
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

/// The slot array: an anonymous memory map (zeroed by the kernel, so empty at once), or
/// nothing.
#[derive(Debug, Default)]
struct Slots(Option<memmap2::MmapMut>);

impl Slots {
    /// `n` empty slots. Aborts as a `Vec` would when the memory cannot be had.
    fn zeroed(n: usize) -> Self {
        if n == 0 {
            return Self(None);
        }
        let layout = std::alloc::Layout::array::<Slot>(n)
            .unwrap_or_else(|_| std::alloc::handle_alloc_error(std::alloc::Layout::new::<Slot>()));
        let map = memmap2::MmapMut::map_anon(layout.size())
            .unwrap_or_else(|_| std::alloc::handle_alloc_error(layout));
        // Huge pages are a hint: where the kernel has none, the set works the same.
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        Self(Some(map))
    }

    fn get(&self) -> &[Slot] {
        self.0.as_deref().map_or(&[], bytemuck::cast_slice)
    }

    fn get_mut(&mut self) -> &mut [Slot] {
        self.0
            .as_deref_mut()
            .map_or(&mut [], bytemuck::cast_slice_mut)
    }
}

/// The identities seen within the dedup horizon. See the module docs.
#[derive(Debug)]
pub(crate) struct DedupSet {
    /// Empty, or at most half full.
    slots: Slots,
    /// Occupied slots.
    len: usize,
    /// The identity whose digest is `0`, which a slot cannot hold.
    zero: Option<(i64, u16)>,
    /// No identity held expires before this (`i64::MAX` when none is held), so a sweep
    /// at a floor below it would find nothing to drop.
    earliest: i64,
}

impl Default for DedupSet {
    fn default() -> Self {
        Self {
            slots: Slots::default(),
            len: 0,
            zero: None,
            earliest: i64::MAX,
        }
    }
}

const MIN_SLOTS: usize = 1024;

/// The first slot to probe for `id` among `n`: the digest's bits scaled to `n` (a
/// multiply and a shift, so `n` need not be a power of two and a reserve is exact).
#[inline]
fn home(id: u128, n: usize) -> usize {
    let mix = (id as u64) ^ ((id >> 64) as u64);
    ((u128::from(mix) * n as u128) >> 64) as usize
}

/// The slot after `i` among `n`, wrapping.
#[inline]
fn next(i: usize, n: usize) -> usize {
    if i + 1 == n { 0 } else { i + 1 }
}

/// Puts `slot`, whose identity `slots` does not hold, in the first free slot from its home.
fn place(slots: &mut [Slot], slot: Slot) {
    let n = slots.len();
    let mut i = home(slot.id, n);
    while slots[i].id != 0 {
        i = next(i, n);
    }
    slots[i] = slot;
}

impl DedupSet {
    /// Identities held.
    pub fn len(&self) -> usize {
        self.len + usize::from(self.zero.is_some())
    }

    /// Heap bytes held.
    pub fn heap_bytes(&self) -> usize {
        std::mem::size_of_val(self.slots.get())
    }

    /// Makes room for `more` identities without growing. The size is rounded up to a
    /// sixteenth of the next power of two (at most an eighth more), so a set emptied and
    /// reserved again for a run of about the same size (a backfill's next sub-range)
    /// keeps its memory.
    pub fn reserve(&mut self, more: usize) {
        let need = self.len.saturating_add(more).saturating_mul(2);
        if need > self.slots.get().len() {
            let step = (need.next_power_of_two() / 16).max(1);
            self.rebuild(need.div_ceil(step).saturating_mul(step).max(MIN_SLOTS));
        }
    }

    /// Makes room for `more` identities as inserts would, by doubling: after it, `more`
    /// observes move no slot, so where each identity is probed is known beforehand (see
    /// [`DedupSet::touch`]).
    ///
    /// `floor` is a watermark no record to come is judged below, so an identity that
    /// expires by then counts as absent to every one of them (`i64::MIN`: none known).
    /// Before the set grows, it drops those; it grows only when that leaves it more than
    /// three-eighths full. So a set holds about what the horizon holds, whatever the
    /// run's length, and a sweep (which reads every slot) comes at most once per eighth
    /// of the slots inserted.
    pub fn make_room(&mut self, more: usize, floor: i64) {
        let need = |len: usize| len.saturating_add(more).saturating_mul(2);
        let mut n = self.slots.get().len();
        if need(self.len) <= n {
            return;
        }
        if floor >= self.earliest && n > 0 {
            self.retain(|expires, _| expires > floor);
            if need(self.len).saturating_mul(4) <= n.saturating_mul(3) {
                return;
            }
            n = n.saturating_mul(2);
        }
        n = n.max(MIN_SLOTS);
        while n < need(self.len) {
            n = n.saturating_mul(2);
        }
        self.rebuild(n);
    }

    /// Reads the first slot each of `ids` is probed at, so that the observes that follow
    /// find them in cache. A short loop with no branch on what it reads: the CPU keeps as
    /// many of these misses in flight as it can, where a probe's own loop, branching on
    /// each slot it reads, overlaps only a few. Returns a value of what was read, for the
    /// caller to hand to [`std::hint::black_box`].
    #[inline]
    pub fn touch(&self, ids: impl Iterator<Item = u128>) -> u64 {
        let slots = self.slots.get();
        let n = slots.len();
        if n == 0 {
            return 0;
        }
        ids.fold(0u64, |seen, id| seen ^ slots[home(id, n)].id as u64)
    }

    /// Records `id` as seen until `expires`, unless it is held and still live at `wm`
    /// (held until after `wm`): then it is a duplicate, nothing changes, and this returns
    /// true. An identity held past its expiry (not yet swept) counts as absent.
    #[inline]
    pub fn observe(&mut self, id: u128, expires: i64, group: u16, wm: i64) -> bool {
        if id == 0 {
            return match &mut self.zero {
                Some((held, _)) if *held > wm => true,
                zero => {
                    *zero = Some((expires, group));
                    self.earliest = self.earliest.min(expires);
                    false
                }
            };
        }
        if (self.len + 1) * 2 > self.slots.get().len() {
            self.rebuild((self.slots.get().len() * 2).max(MIN_SLOTS));
        }
        let slots = self.slots.get_mut();
        let n = slots.len();
        let mut i = home(id, n);
        loop {
            let slot = &mut slots[i];
            if slot.id == id {
                if slot.expires > wm {
                    return true;
                }
                slot.expires = expires;
                slot.group = group;
                self.earliest = self.earliest.min(expires);
                return false;
            }
            if slot.id == 0 {
                *slot = Slot::new(id, expires, group);
                self.len += 1;
                self.earliest = self.earliest.min(expires);
                return false;
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
        self.zero.map(|(e, g)| (0, e, g)).into_iter().chain(
            self.slots
                .get()
                .iter()
                .filter(|s| s.id != 0)
                .map(|s| (s.id, s.expires, s.group)),
        )
    }

    /// Removes every identity, keeping the slots' memory.
    pub fn clear(&mut self) {
        if self.len > 0 {
            self.slots.get_mut().fill(Slot::default());
            self.len = 0;
        }
        self.zero = None;
        self.earliest = i64::MAX;
    }

    /// Whether a sweep can be worth its cost: more than a quarter of the slots are held
    /// (the set grows at half).
    pub fn worth_sweeping(&self) -> bool {
        self.len * 4 > self.slots.get().len()
    }

    /// Keeps the identities for which `keep(expires, group)` holds, in place.
    pub fn retain(&mut self, keep: impl Fn(i64, u16) -> bool) {
        if self.zero.is_some_and(|(e, g)| !keep(e, g)) {
            self.zero = None;
        }
        // Recomputed over what is kept.
        self.earliest = self.zero.map_or(i64::MAX, |(e, _)| e);
        if self.len == 0 {
            return;
        }
        // A slot empty before any removal: no probe sequence crosses it, so walking the
        // slots once from there meets every sequence from its start.
        let slots = self.slots.get_mut();
        let n = slots.len();
        let Some(start) = slots.iter().position(|s| s.id == 0) else {
            self.earliest = i64::MIN;
            return;
        };
        // One walk. A removal cuts the probe sequences through its slot, so each survivor
        // after it in the same run of held slots is taken out and put back at the first
        // free slot from its home, which is at or before where it was. Survivors in a run
        // with no removal before them, or at their home, stay. An empty slot ahead of the
        // walk was empty before it (survivors only move back), and ends a run.
        let mut cut = false;
        let mut at = start;
        for _ in 0..n {
            at = next(at, n);
            let slot = slots[at];
            if slot.id == 0 {
                cut = false;
            } else if !keep(slot.expires, slot.group) {
                slots[at] = Slot::default();
                self.len -= 1;
                cut = true;
            } else {
                self.earliest = self.earliest.min(slot.expires);
                if cut && home(slot.id, n) != at {
                    slots[at] = Slot::default();
                    place(slots, slot);
                }
            }
        }
    }

    /// Moves every identity into `slots` slots (at least twice `len`).
    fn rebuild(&mut self, slots: usize) {
        if self.len == 0 {
            // Nothing to move: the old slots go first, so the two are never held at once.
            self.slots = Slots::default();
            self.slots = Slots::zeroed(slots);
            return;
        }
        let old = std::mem::replace(&mut self.slots, Slots::zeroed(slots));
        let new = self.slots.get_mut();
        for slot in old.get().iter().filter(|s| s.id != 0) {
            place(new, *slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    /// Distinct digests crowded into two home slots, the first and the last (the bits
    /// that choose it are all zero or all one), so probe sequences run long, cross, and
    /// wrap around the end.
    fn crowd(i: u64) -> u128 {
        u128::from(if i.is_multiple_of(2) { i } else { u64::MAX - i })
    }

    #[test]
    fn a_cleared_set_forgets_all_and_keeps_its_memory_for_a_like_reserve() {
        let mut set = DedupSet::default();
        set.reserve(100_000);
        let slots = set.slots.get().len();
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
        set.clear();
        set.reserve(99_000);
        assert_eq!(set.slots.get().len(), slots, "kept");
        set.reserve(300_000);
        assert!(set.slots.get().len() >= 600_000);
    }

    #[test]
    fn after_making_room_the_batch_moves_no_slot() {
        let mut set = DedupSet::default();
        assert_eq!(
            set.touch([1u128, 2].into_iter()),
            0,
            "an empty set reads nothing"
        );
        for i in 1..=3_000u128 {
            set.make_room(1, i64::MIN);
            set.insert(i, 0, 0);
        }
        set.make_room(5_000, i64::MIN);
        let bytes = set.heap_bytes();
        assert!(bytes >= (3_000 + 5_000) * 2 * 32);
        let ids: Vec<u128> = (10_001..15_001u128)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835))
            .collect();
        std::hint::black_box(set.touch(ids.iter().copied()));
        for id in &ids {
            assert!(!set.observe(*id, 10, 0, 0));
        }
        assert_eq!(set.heap_bytes(), bytes, "no growth within the batch");
        assert_eq!(set.len(), 8_000);
        assert!(ids.iter().all(|id| set.observe(*id, 10, 0, 0)), "all held");
        // What touch reads is what the slots hold: the home slot of a held identity
        // that is alone at home is itself.
        let mut lone = DedupSet::default();
        lone.insert(crowd(2), 1, 0);
        assert_eq!(lone.touch([crowd(2)].into_iter()), crowd(2) as u64);
    }

    #[test]
    fn a_slot_is_the_size_of_its_fields() {
        assert_eq!(std::mem::size_of::<Slot>(), 32);
        assert_eq!(
            Slot::zeroed(),
            Slot::default(),
            "all zeros is an empty slot"
        );
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
        fn agrees_with_a_map(ops in prop::collection::vec((0u8..4, 0u64..300, 0i64..50), 1..600)) {
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
            most = most.max(floored.slots.get().len());
        }
        // About 10,100 identities are live at once: the set stays within 8 times that.
        assert!(most <= 8 * 10_100, "{most} slots");
        assert!(plain.slots.get().len() >= 1_000_000);
    }

    #[test]
    fn a_sweep_at_the_floor_drops_what_expires_by_it_and_keeps_what_expires_after() {
        let mut set = DedupSet::default();
        set.make_room(1, i64::MIN);
        let slots = set.slots.get().len();
        let floor = 1_000;
        // Half the slots: the next batch sweeps. Identities 1..: expiring at the floor
        // (even) or just after it (odd).
        let of = |i: u64| u128::from(i).wrapping_mul(SPREAD);
        let held = slots as u64 / 2;
        for i in 1..=held {
            set.insert(of(i), floor + (i % 2) as i64, 0);
        }
        set.make_room(1, floor);
        assert_eq!(set.slots.get().len(), slots, "swept, not grown");
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
        assert!(set.heap_bytes() >= 200_000 * 32);
        for i in survivors() {
            assert!(set.observe(crowd(i), 0, 0, -1), "identity {i} after growth");
        }
        assert!(
            !set.observe(crowd(3), 7, 0, -1),
            "a swept identity is absent"
        );
    }
}
