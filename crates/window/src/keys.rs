//! [`KeyTable`]: interns key values to dense ids.
//!
//! Every record looks its key up, so the table is laid out for that: the index is one flat
//! array of 16-byte slots, each an id with its key's length and first eight bytes, probed
//! linearly from the key's hash; the key bytes are one contiguous buffer. A short key is
//! confirmed from its slot alone; a longer one reads the buffer only on a likely match.
//! (With an `Arc<str>` per key, the comparison missed the cache on most records: a tenth
//! of the engine's time over 100,000 keys.)
//!
//! The engine hashes a chunk of records' keys first and reads their home slots in a loop
//! of its own ([`KeyTable::touch`]), so the CPU keeps many of these misses in flight; the
//! lookups then find their slots in cache. A general hash map gives no slot to read ahead:
//! over 100,000 keys, its lookups were three-tenths of `process_batch`.

use std::hash::BuildHasher;

use rustc_hash::FxBuildHasher;

/// Key values by dense id, and the index from value to id.
#[derive(Debug, Clone, Default)]
pub(crate) struct KeyTable {
    /// Empty, or a power of two of slots, at most [`MAX_LOAD`] full.
    slots: Vec<Slot>,
    /// Every key's bytes, back to back, in id order.
    bytes: String,
    /// Where each key's bytes end in `bytes` (which holds at most 4 GiB of keys).
    ends: Vec<u32>,
}

/// An index slot: the id (`EMPTY`: none), with the key's length and first eight bytes, so a
/// lookup of a key of up to eight bytes (`m-4711`) is confirmed without reading the key
/// buffer, and a longer one reads it only on a likely match.
#[derive(Debug, Clone, Copy)]
struct Slot {
    id: u32,
    len: u32,
    head: u64,
}

impl Slot {
    /// The slot of key `id`, `key`.
    fn of(id: u32, key: &str) -> Self {
        Self {
            id,
            len: key.len() as u32,
            head: head(key),
        }
    }
}

const EMPTY: u32 = u32::MAX;

const EMPTY_SLOT: Slot = Slot {
    id: EMPTY,
    len: 0,
    head: 0,
};

/// The fullest the index gets, as a fraction `num / den`: linear probes stay short, and
/// 100,000 keys fit 131,072 slots (2 MiB).
const MAX_LOAD: (usize, usize) = (4, 5);

const MIN_SLOTS: usize = 64;

/// The first eight bytes of `key`, zero-padded.
#[inline]
fn head(key: &str) -> u64 {
    let b = key.as_bytes();
    let mut h = [0u8; 8];
    let n = b.len().min(8);
    h[..n].copy_from_slice(&b[..n]);
    u64::from_le_bytes(h)
}

/// The hash a lookup of `key` takes (see [`KeyTable::get_hashed`]).
#[inline]
pub(crate) fn hash(key: &str) -> u64 {
    FxBuildHasher.hash_one(key)
}

/// The slot to probe first for `hash` among `n`: the hash's high bits scaled to `n`.
#[inline]
fn home(hash: u64, n: usize) -> usize {
    ((u128::from(hash) * n as u128) >> 64) as usize
}

/// Key `id` of the buffer `bytes` whose keys end at `ends`.
#[inline]
fn slice<'a>(bytes: &'a str, ends: &[u32], id: u32) -> &'a str {
    let id = id as usize;
    let start = if id == 0 { 0 } else { ends[id - 1] as usize };
    &bytes[start..ends[id] as usize]
}

impl KeyTable {
    /// The value of key `id`.
    #[inline]
    pub fn name(&self, id: u32) -> &str {
        slice(&self.bytes, &self.ends, id)
    }

    /// Keys held (ids are `0..len`).
    #[inline]
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// The id of `key`, if held.
    #[inline]
    pub fn get(&self, key: &str) -> Option<u32> {
        self.get_hashed(key, hash(key))
    }

    /// The id of `key`, whose [`hash`] is `hash`, if held.
    #[inline]
    pub fn get_hashed(&self, key: &str, hash: u64) -> Option<u32> {
        let n = self.slots.len();
        if n == 0 {
            return None;
        }
        let (len, head) = (key.len() as u32, head(key));
        let mut i = home(hash, n);
        loop {
            let s = self.slots[i];
            if s.id == EMPTY {
                return None;
            }
            if s.len == len && s.head == head && (len <= 8 || self.name(s.id) == key) {
                return Some(s.id);
            }
            i = (i + 1) & (n - 1);
        }
    }

    /// Reads the home slot of each of `hashes` and returns a value that depends on them
    /// all, so that the lookups which follow find their slots in cache (see the module
    /// docs). No branch depends on what is read, so the reads do not wait for one
    /// another.
    pub fn touch(&self, hashes: &[u64]) -> u64 {
        let n = self.slots.len();
        if n == 0 {
            return 0;
        }
        hashes
            .iter()
            .fold(0u64, |seen, &h| seen ^ u64::from(self.slots[home(h, n)].id))
    }

    /// Adds `key`, which must not be held, and returns its id.
    pub fn push(&mut self, key: &str) -> u32 {
        self.push_hashed(key, hash(key))
    }

    /// Adds `key`, whose [`hash`] is `hash` and which must not be held, and returns its id.
    pub fn push_hashed(&mut self, key: &str, hash: u64) -> u32 {
        let id = self.ends.len() as u32;
        assert!(id < EMPTY, "a window engine holds fewer than 2^32 - 1 keys");
        if (self.len() + 1) * MAX_LOAD.1 > self.slots.len() * MAX_LOAD.0 {
            self.rebuild(self.len() + 1);
        }
        self.bytes.push_str(key);
        let end =
            u32::try_from(self.bytes.len()).expect("a window engine holds at most 4 GiB of keys");
        self.ends.push(end);
        place(&mut self.slots, hash, Slot::of(id, key));
        id
    }

    /// Makes room for `keys` more keys of about `bytes` bytes in all.
    pub fn reserve(&mut self, keys: usize, bytes: usize) {
        self.bytes.reserve(bytes);
        self.ends.reserve(keys);
        let want = self.len().saturating_add(keys);
        if want.saturating_mul(MAX_LOAD.1) > self.slots.len() * MAX_LOAD.0 {
            self.rebuild(want);
        }
    }

    /// A new index with room for `keys` keys, holding every key.
    fn rebuild(&mut self, keys: usize) {
        let n = (keys * MAX_LOAD.1)
            .div_ceil(MAX_LOAD.0)
            .next_power_of_two()
            .max(MIN_SLOTS)
            .max(self.slots.len() * 2);
        let mut slots = vec![EMPTY_SLOT; n];
        for id in 0..self.len() as u32 {
            let key = self.name(id);
            place(&mut slots, hash(key), Slot::of(id, key));
        }
        self.slots = slots;
    }

    /// Heap bytes held: the index's slots, the key bytes and their ends.
    pub fn heap_bytes(&self) -> usize {
        self.bytes.capacity()
            + self.ends.capacity() * std::mem::size_of::<u32>()
            + self.slots.capacity() * std::mem::size_of::<Slot>()
    }
}

/// Puts `slot` in the first empty slot from `hash`'s home.
fn place(slots: &mut [Slot], hash: u64, slot: Slot) {
    let n = slots.len();
    let mut i = home(hash, n);
    while slots[i].id != EMPTY {
        i = (i + 1) & (n - 1);
    }
    slots[i] = slot;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interns_to_dense_ids_and_finds_them_after_growth() {
        let mut keys = KeyTable::default();
        assert_eq!(keys.get("a"), None);
        let names: Vec<String> = (0..10_000).map(|i| format!("m-{i}")).collect();
        for (i, n) in names.iter().enumerate() {
            assert_eq!(keys.push(n), i as u32);
        }
        keys.reserve(50_000, 400_000);
        assert_eq!(keys.push(""), 10_000, "the empty key is a key");
        for (i, n) in names.iter().enumerate() {
            assert_eq!(keys.get(n), Some(i as u32));
            assert_eq!(keys.name(i as u32), n);
        }
        assert_eq!(keys.get(""), Some(10_000));
        assert_eq!(keys.name(10_000), "");
        assert_eq!(keys.get("m-10000"), None);
        // Keys that share their first eight bytes and length differ after them.
        let long = ["customer-0001", "customer-0002", "customer-0001x"];
        let ids: Vec<u32> = long.iter().map(|k| keys.push(k)).collect();
        for (k, id) in long.iter().zip(&ids) {
            assert_eq!(keys.get(k), Some(*id));
        }
        assert_eq!(keys.get("customer-0003"), None);
        assert_eq!(keys.get("customer"), None);
    }
}

#[cfg(test)]
mod properties {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Any keys, including ones that share a length and first eight bytes, intern to
        /// the ids a map would give them, through every growth of the index; a key never
        /// pushed is absent.
        #[test]
        fn interns_as_a_map_does(
            keys in prop::collection::vec("[ab]{0,12}", 1..400),
            reserve_at in 0usize..400,
        ) {
            let mut table = KeyTable::default();
            let mut oracle: HashMap<String, u32> = HashMap::new();
            for (i, k) in keys.iter().enumerate() {
                if i == reserve_at {
                    table.reserve(1_000, 8_000);
                }
                let id = match table.get(k) {
                    Some(id) => id,
                    None => table.push(k),
                };
                let expected = oracle.len() as u32;
                prop_assert_eq!(id, *oracle.entry(k.clone()).or_insert(expected));
            }
            prop_assert_eq!(table.len(), oracle.len());
            for (k, id) in &oracle {
                prop_assert_eq!(table.get(k), Some(*id));
                prop_assert_eq!(table.name(*id), k.as_str());
            }
            prop_assert_eq!(table.get("c"), None);
        }
    }
}
