//! [`KeyTable`]: interns key values to dense ids.
//!
//! Every record looks its key up, so the table is laid out for that: the index holds only
//! ids with each key's length and first eight bytes, and the key bytes are one contiguous
//! buffer. A short key is confirmed from the index entry alone; a longer one reads the
//! buffer, a few hundred kilobytes that stay in cache, rather than one heap allocation per
//! key. (With an
//! `Arc<str>` per key, the comparison missed the cache on most records: a tenth of the
//! engine's time over 100,000 keys.)

use std::hash::BuildHasher;

use hashbrown::HashTable;
use rustc_hash::FxBuildHasher;

/// Key values by dense id, and the index from value to id.
#[derive(Debug, Clone, Default)]
pub(crate) struct KeyTable {
    index: HashTable<Entry>,
    /// Every key's bytes, back to back, in id order.
    bytes: String,
    /// Where each key's bytes end in `bytes` (which holds at most 4 GiB of keys).
    ends: Vec<u32>,
}

/// An index entry: the id, with the key's length and first eight bytes, so a lookup of a
/// key of up to eight bytes (`m-4711`) is confirmed without reading the key buffer, and a
/// longer one reads it only on a likely match.
#[derive(Debug, Clone, Copy)]
struct Entry {
    id: u32,
    len: u32,
    head: u64,
}

/// The first eight bytes of `key`, zero-padded.
#[inline]
fn head(key: &str) -> u64 {
    let b = key.as_bytes();
    let mut h = [0u8; 8];
    let n = b.len().min(8);
    h[..n].copy_from_slice(&b[..n]);
    u64::from_le_bytes(h)
}

fn hash(key: &str) -> u64 {
    FxBuildHasher.hash_one(key)
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
        let (len, head) = (key.len() as u32, head(key));
        self.index
            .find(hash(key), |e| {
                e.len == len && e.head == head && (len <= 8 || self.name(e.id) == key)
            })
            .map(|e| e.id)
    }

    /// Adds `key`, which must not be held, and returns its id.
    pub fn push(&mut self, key: &str) -> u32 {
        let id = self.ends.len() as u32;
        self.bytes.push_str(key);
        let end =
            u32::try_from(self.bytes.len()).expect("a window engine holds at most 4 GiB of keys");
        self.ends.push(end);
        let (bytes, ends) = (&self.bytes, &self.ends);
        let entry = Entry {
            id,
            len: key.len() as u32,
            head: head(key),
        };
        self.index
            .insert_unique(hash(key), entry, |e| hash(slice(bytes, ends, e.id)));
        id
    }

    /// Makes room for `keys` more keys of about `bytes` bytes in all.
    pub fn reserve(&mut self, keys: usize, bytes: usize) {
        self.bytes.reserve(bytes);
        self.ends.reserve(keys);
        let (bytes, ends) = (&self.bytes, &self.ends);
        self.index.reserve(keys, |e| hash(slice(bytes, ends, e.id)));
    }

    /// Heap bytes held: the index's buckets (an entry and a control byte each, a table
    /// being at most seven-eighths full), the key bytes and their ends.
    pub fn heap_bytes(&self) -> usize {
        let capacity = self.index.capacity();
        let buckets = match capacity {
            0 => 0,
            c if c < 8 => (c + 1).next_power_of_two(),
            c => (c * 8 / 7).next_power_of_two(),
        };
        self.bytes.capacity()
            + self.ends.capacity() * std::mem::size_of::<u32>()
            + buckets * (std::mem::size_of::<Entry>() + 1)
    }
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
