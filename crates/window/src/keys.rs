//! [`KeyTable`]: interns key values to dense ids.
//!
//! Every record looks its key up, so the table is laid out for that: the index holds only
//! ids, and the key bytes are one contiguous buffer, so confirming a match reads a few
//! hundred kilobytes that stay in cache rather than one heap allocation per key. (With an
//! `Arc<str>` per key, the comparison missed the cache on most records: a tenth of the
//! engine's time over 100,000 keys.)

use std::hash::BuildHasher;

use hashbrown::HashTable;
use rustc_hash::FxBuildHasher;

/// Key values by dense id, and the index from value to id.
#[derive(Debug, Clone, Default)]
pub(crate) struct KeyTable {
    index: HashTable<u32>,
    /// Every key's bytes, back to back, in id order.
    bytes: String,
    /// Where each key's bytes end in `bytes`.
    ends: Vec<usize>,
}

fn hash(key: &str) -> u64 {
    FxBuildHasher.hash_one(key)
}

/// Key `id` of the buffer `bytes` whose keys end at `ends`.
#[inline]
fn slice<'a>(bytes: &'a str, ends: &[usize], id: u32) -> &'a str {
    let id = id as usize;
    let start = if id == 0 { 0 } else { ends[id - 1] };
    &bytes[start..ends[id]]
}

impl KeyTable {
    /// The value of key `id`.
    #[inline]
    pub fn name(&self, id: u32) -> &str {
        slice(&self.bytes, &self.ends, id)
    }

    /// The id of `key`, if held.
    #[inline]
    pub fn get(&self, key: &str) -> Option<u32> {
        self.index
            .find(hash(key), |id| self.name(*id) == key)
            .copied()
    }

    /// Adds `key`, which must not be held, and returns its id.
    pub fn push(&mut self, key: &str) -> u32 {
        let id = self.ends.len() as u32;
        self.bytes.push_str(key);
        self.ends.push(self.bytes.len());
        let (bytes, ends) = (&self.bytes, &self.ends);
        self.index
            .insert_unique(hash(key), id, |id| hash(slice(bytes, ends, *id)));
        id
    }

    /// Makes room for `keys` more keys of about `bytes` bytes in all.
    pub fn reserve(&mut self, keys: usize, bytes: usize) {
        self.bytes.reserve(bytes);
        self.ends.reserve(keys);
        let (bytes, ends) = (&self.bytes, &self.ends);
        self.index.reserve(keys, |id| hash(slice(bytes, ends, *id)));
    }

    /// Heap bytes held.
    pub fn heap_bytes(&self) -> usize {
        self.bytes.capacity()
            + self.ends.capacity() * std::mem::size_of::<usize>()
            + self.index.capacity() * (std::mem::size_of::<u32>() + 1)
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
    }
}
