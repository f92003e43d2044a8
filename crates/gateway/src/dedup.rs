//! The duplicate index: identities `(tenant, event_id)` accepted within the horizon,
//! plus those waiting in a commit group. Owned by the committer task, so checks and
//! inserts are serialized without a lock.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;
use xxhash_rust::xxh3::Xxh3;

/// A 128-bit hash of `(tenant, event_id)`.
pub fn identity(tenant: &str, event_id: &str) -> u128 {
    let mut h = Xxh3::new();
    h.update(tenant.as_bytes());
    h.update(&[0]);
    h.update(event_id.as_bytes());
    h.digest128()
}

/// What the index knows about an identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// Never seen within the horizon.
    New,
    /// Committed within the horizon, with the same content.
    Committed,
    /// Waiting in the commit group with this id, with the same content.
    InFlight(u64),
    /// Accepted within the horizon (committed or waiting) with other content.
    Conflict,
}

/// See the module docs. Each identity keeps its event's content digest
/// ([`Event::content_digest`](signalweave_model::Event::content_digest)), so a retry is
/// told apart from another event under a reused identity.
#[derive(Debug, Default)]
pub struct DedupIndex {
    horizon_us: i64,
    /// Identity → (ingest time, content digest).
    committed: FxHashMap<u128, (i64, u64)>,
    order: VecDeque<(i64, u128)>,
    /// Identity → (commit group, content digest).
    inflight: FxHashMap<u128, (u64, u64)>,
}

impl DedupIndex {
    /// An empty index remembering identities for `horizon_us` of ingest time.
    pub fn new(horizon_us: i64) -> Self {
        Self {
            horizon_us,
            ..Self::default()
        }
    }

    /// Loads committed identities as `(ingest time, identity, content digest)` (for example
    /// rebuilt from the landing table).
    pub fn load(&mut self, mut entries: Vec<(i64, u128, u64)>, now_us: i64) {
        entries.sort_unstable();
        for (ingest_us, id, content) in entries {
            if self.committed.insert(id, (ingest_us, content)).is_none() {
                self.order.push_back((ingest_us, id));
            }
        }
        self.expire(now_us);
    }

    /// What the index knows about `id`, carrying content digested to `content`.
    pub fn check(&self, id: u128, content: u64) -> Seen {
        if let Some(&(group, held)) = self.inflight.get(&id) {
            if held == content {
                Seen::InFlight(group)
            } else {
                Seen::Conflict
            }
        } else if let Some(&(_, held)) = self.committed.get(&id) {
            if held == content {
                Seen::Committed
            } else {
                Seen::Conflict
            }
        } else {
            Seen::New
        }
    }

    /// Records `id`, carrying `content`, as waiting in `group`.
    pub fn hold(&mut self, id: u128, group: u64, content: u64) {
        self.inflight.insert(id, (group, content));
    }

    /// Moves a committed group's identities from waiting to committed.
    pub fn committed(&mut self, ids: &[u128], ingest_us: &[i64]) {
        for (id, at) in ids.iter().zip(ingest_us) {
            let Some((_, content)) = self.inflight.remove(id) else {
                continue;
            };
            if self.committed.insert(*id, (*at, content)).is_none() {
                self.order.push_back((*at, *id));
            }
        }
    }

    /// Forgets identities of a group that will not commit.
    pub fn release(&mut self, ids: &[u128]) {
        for id in ids {
            self.inflight.remove(id);
        }
    }

    /// Drops identities older than the horizon.
    pub fn expire(&mut self, now_us: i64) {
        let cutoff = now_us.saturating_sub(self.horizon_us);
        while let Some(&(at, id)) = self.order.front() {
            if at >= cutoff {
                break;
            }
            self.order.pop_front();
            if self.committed.get(&id).map(|e| e.0) == Some(at) {
                self.committed.remove(&id);
            }
        }
    }

    /// Identities held (committed and waiting).
    pub fn len(&self) -> usize {
        self.committed.len() + self.inflight.len()
    }

    /// Whether the index is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_move_from_waiting_to_committed_and_expire() {
        let mut ix = DedupIndex::new(1_000);
        let a = identity("t", "e-1");
        assert_ne!(a, identity("u", "e-1"));
        assert_ne!(identity("ab", "c"), identity("a", "bc"));
        assert_eq!(ix.check(a, 1), Seen::New);
        ix.hold(a, 7, 1);
        assert_eq!(ix.check(a, 1), Seen::InFlight(7));
        assert_eq!(ix.check(a, 2), Seen::Conflict);
        ix.committed(&[a], &[100]);
        assert_eq!(ix.check(a, 1), Seen::Committed);
        assert_eq!(ix.check(a, 2), Seen::Conflict);
        ix.expire(1_100);
        assert_eq!(ix.check(a, 1), Seen::Committed);
        ix.expire(1_101);
        assert_eq!(ix.check(a, 1), Seen::New);
        assert_eq!(ix.check(a, 2), Seen::New);
        assert!(ix.is_empty());
        let b = identity("t", "e-2");
        ix.hold(b, 8, 3);
        ix.release(&[b]);
        assert_eq!(ix.check(b, 3), Seen::New);
        ix.load(vec![(50, b, 3), (40, a, 1)], 1_000);
        assert_eq!(ix.check(a, 1), Seen::Committed);
        assert_eq!(ix.check(b, 4), Seen::Conflict);
        ix.expire(1_045);
        assert_eq!(ix.check(a, 1), Seen::New);
        assert_eq!(ix.check(b, 3), Seen::Committed);
    }
}
