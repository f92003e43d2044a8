//! Snapshot and restore of the engine's whole state, or of a range of key groups, as
//! versioned bytes; and the observable state size.
//!
//! Format: the magic `SWWE`, a little-endian `u32` format version, then the
//! [postcard](https://docs.rs/postcard) encoding of [`StateV1`]. A reader refuses other
//! magics, newer versions, and a state written for another job, job version or key-group
//! count.

use std::collections::BTreeMap;
use std::ops::RangeInclusive;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use signalweave_model::ErrorKind;

use crate::engine::{EngineConfig, PaneRef, Session, Timer, WindowEngine, WindowMeta};
use crate::error::{Result, WindowError};
use crate::output::OutputRow;
use crate::spec::JobSpec;
use crate::watermark::Watermarks;

const MAGIC: &[u8; 4] = b"SWWE";
/// Current state format version.
pub const STATE_FORMAT_VERSION: u32 = 1;

#[derive(Debug, Serialize, Deserialize)]
struct KeyState {
    name: String,
    panes: Vec<(i64, Vec<i64>, bool)>,
    windows: Vec<(i64, WindowMeta)>,
    sessions: Vec<(i64, Session)>,
    session_frontier: Option<i64>,
}

/// Version 1 of the serialized state.
#[derive(Debug, Serialize, Deserialize)]
pub struct StateV1 {
    job: String,
    job_version: u32,
    namespace: String,
    key_groups: u16,
    keys: Vec<KeyState>,
    timers: Vec<(i64, Vec<Timer>)>,
    dirty_panes: Vec<(u32, i64)>,
    early_queue: Vec<(u32, i64)>,
    correction_queue: Vec<(u32, i64)>,
    pending: Vec<OutputRow>,
    dedup: Vec<(u128, i64, u16)>,
    dedup_swept_at: i64,
    watermarks: Watermarks,
    next_early_at: Option<i64>,
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
}

impl WindowEngine {
    /// Serializes the whole state.
    pub fn snapshot(&self) -> Result<Vec<u8>> {
        self.snapshot_key_groups(0..=self.config.key_groups.saturating_sub(1))
    }

    /// Serializes the state of the keys whose key group is in `groups`.
    pub fn snapshot_key_groups(&self, groups: RangeInclusive<u16>) -> Result<Vec<u8>> {
        let stride = self.layout.stride;
        let mut keep: Vec<Option<u32>> = vec![None; self.key_names.len()];
        let mut keys: Vec<KeyState> = Vec::new();
        for (id, name) in self.key_names.iter().enumerate() {
            if groups.contains(&self.key_group[id]) {
                keep[id] = Some(keys.len() as u32);
                keys.push(KeyState {
                    name: name.to_string(),
                    panes: Vec::new(),
                    windows: Vec::new(),
                    sessions: Vec::new(),
                    session_frontier: self.session_frontier.get(&(id as u32)).copied(),
                });
            }
        }
        let remap = |id: u32| keep.get(id as usize).copied().flatten();
        let mut panes: Vec<_> = self.panes.iter().collect();
        panes.sort_by_key(|((k, p), _)| (*k, *p));
        for ((key, pane), r) in panes {
            if let Some(n) = remap(*key) {
                let base = r.slab as usize * stride;
                keys[n as usize].panes.push((
                    *pane,
                    self.slab[base..base + stride].to_vec(),
                    r.dirty,
                ));
            }
        }
        let mut windows: Vec<_> = self.windows.iter().collect();
        windows.sort_by_key(|((k, w), _)| (*k, *w));
        for ((key, w), meta) in windows {
            if let Some(n) = remap(*key) {
                keys[n as usize].windows.push((*w, *meta));
            }
        }
        for (key, sessions) in &self.sessions {
            if let Some(n) = remap(*key) {
                keys[n as usize].sessions = sessions.iter().map(|(s, v)| (*s, v.clone())).collect();
            }
        }
        let timers = self
            .timers
            .iter()
            .filter_map(|(at, ts)| {
                let ts: Vec<Timer> = ts
                    .iter()
                    .filter_map(|t| remap(t.key).map(|key| Timer { key, ..*t }))
                    .collect();
                (!ts.is_empty()).then_some((*at, ts))
            })
            .collect();
        let pairs = |v: &[(u32, i64)]| -> Vec<(u32, i64)> {
            v.iter()
                .filter_map(|(k, s)| remap(*k).map(|k| (k, *s)))
                .collect()
        };
        let mut dedup: Vec<(u128, i64, u16)> = self
            .dedup
            .iter()
            .filter(|(_, (_, kg))| groups.contains(kg))
            .map(|(id, (exp, kg))| (*id, *exp, *kg))
            .collect();
        dedup.sort_unstable();
        let state = StateV1 {
            job: self.spec.name.clone(),
            job_version: self.spec.version,
            namespace: self.config.namespace.clone(),
            key_groups: self.config.key_groups,
            keys,
            timers,
            dirty_panes: pairs(&self.dirty_panes),
            early_queue: pairs(&self.early_queue),
            correction_queue: pairs(&self.correction_queue),
            pending: self
                .pending
                .iter()
                .filter(|r| groups.contains(&self.key_group_of(&r.key)))
                .cloned()
                .collect(),
            dedup,
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
        let state: StateV1 = postcard::from_bytes(&bytes[8..])
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
        let fresh = self.key_names.is_empty() && self.watermarks.current() == i64::MIN;
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
        for k in &state.keys {
            if self.key_ids.contains_key(k.name.as_str()) {
                return Err(bad(format!(
                    "key `{}` is already held by this engine",
                    k.name
                )));
            }
            let widths_ok = k.panes.iter().all(|(_, acc, _)| acc.len() == stride)
                && k.sessions.iter().all(|(_, s)| s.acc.len() == stride);
            if !widths_ok {
                return Err(bad(
                    "state accumulators do not match the job's aggregates".into()
                ));
            }
        }
        let mut ids = Vec::with_capacity(state.keys.len());
        for k in state.keys {
            let id = self.key_names.len() as u32;
            let kg = self.key_group_of(&k.name);
            self.key_ids.insert(k.name.as_str().into(), id);
            self.key_names.push(k.name.into());
            self.key_group.push(kg);
            ids.push(id);
            for (pane, acc, dirty) in k.panes {
                let slab = (self.slab.len() / stride) as u32;
                self.slab.extend_from_slice(&acc);
                self.panes.insert((id, pane), PaneRef { slab, dirty });
            }
            for (w, meta) in k.windows {
                self.windows.insert((id, w), meta);
            }
            if !k.sessions.is_empty() {
                let map: BTreeMap<i64, Session> = k.sessions.into_iter().collect();
                self.sessions.insert(id, map);
            }
            if let Some(f) = k.session_frontier {
                self.session_frontier.insert(id, f);
            }
        }
        let id = |k: u32| ids.get(k as usize).copied();
        for (at, timers) in state.timers {
            for t in timers {
                if let Some(key) = id(t.key) {
                    self.timers.entry(at).or_default().push(Timer { key, ..t });
                }
            }
        }
        for (list, target) in [
            (state.dirty_panes, &mut self.dirty_panes),
            (state.early_queue, &mut self.early_queue),
            (state.correction_queue, &mut self.correction_queue),
        ] {
            target.extend(list.into_iter().filter_map(|(k, s)| id(k).map(|k| (k, s))));
        }
        self.pending.extend(state.pending);
        for (h, exp, kg) in state.dedup {
            self.dedup.insert(h, (exp, kg));
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
        let stride_bytes = self.layout.stride * 8;
        let key_bytes: usize = self.key_names.iter().map(|k| k.len() + 16 + 24 + 2).sum();
        let pane_bytes =
            self.panes.len() * (24 + 1 + stride_bytes) + self.free.len() * stride_bytes;
        let window_bytes = self.windows.len() * (24 + 1);
        let timers: usize = self.timers.values().map(Vec::len).sum();
        let timer_bytes = timers * std::mem::size_of::<Timer>() + self.timers.len() * 48;
        let session_count: usize = self.sessions.values().map(BTreeMap::len).sum();
        let session_bytes =
            session_count * (8 + 16 + 24 + stride_bytes + 16) + self.sessions.len() * 40;
        StateSize {
            keys: self.key_names.len(),
            windows: self.windows.len() + session_count,
            panes: self.panes.len(),
            timers,
            dedup_identities: self.dedup.len(),
            window_state_bytes: key_bytes + pane_bytes + window_bytes + timer_bytes + session_bytes,
            dedup_bytes: self.dedup.len() * (16 + 16 + 1),
        }
    }
}
