//! Property tests against a brute-force oracle.
//!
//! The oracle knows nothing of panes, timers or versions. It replays the batches,
//! computes the watermark after each batch with the documented rule (largest event time
//! seen − out-of-orderness bound, never backwards), and for each record decides directly:
//! a duplicate (its identity was seen, and the horizon has not passed), counted in every
//! window `[start, end)` containing it with `watermark < end + allowed lateness`, or late
//! (no such window). The final version of each window must equal the oracle's aggregate
//! of the records it counted, and the late output must hold exactly the rest.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use common::*;
use proptest::prelude::*;
use signalweave_window::{AggValue, EngineConfig, JobSpec, WindowEngine};

#[derive(Debug, Clone, Copy)]
enum Shape {
    Tumbling(i64),
    Sliding(i64, i64),
}

impl Shape {
    fn toml(self) -> String {
        match self {
            Shape::Tumbling(size) => format!("kind = \"tumbling\"\nsize = \"{}s\"", size / S),
            Shape::Sliding(size, slide) => {
                format!(
                    "kind = \"sliding\"\nsize = \"{}s\"\nslide = \"{}s\"",
                    size / S,
                    slide / S
                )
            }
        }
    }

    fn windows(self, t: i64) -> Vec<(i64, i64)> {
        let (size, slide) = match self {
            Shape::Tumbling(s) => (s, s),
            Shape::Sliding(s, sl) => (s, sl),
        };
        let p = t.div_euclid(slide);
        ((p - size / slide + 1)..=p)
            .map(|w| (w * slide, w * slide + size))
            .collect()
    }

    fn span(self) -> i64 {
        match self {
            Shape::Tumbling(s) | Shape::Sliding(s, _) => s,
        }
    }
}

fn aggregate(recs: &[&Rec]) -> (i64, Vec<AggValue>) {
    let n = recs.len() as i64;
    let sum: i64 = recs.iter().map(|r| r.amount).sum();
    let max = recs.iter().map(|r| r.amount).max().unwrap();
    (
        n,
        vec![AggValue::Int(n), AggValue::Int(sum), AggValue::Int(max)],
    )
}

struct Oracle {
    finals: Finals,
    late: Vec<String>,
    duplicates: u64,
}

fn oracle(shape: Shape, bound: i64, lateness: i64, batches: &[Vec<Rec>]) -> Oracle {
    let horizon = lateness + shape.span() + 3600 * S;
    let mut wm = i64::MIN;
    let mut seen: HashMap<String, i64> = HashMap::new();
    let mut windows: BTreeMap<(String, i64, i64), Vec<&Rec>> = BTreeMap::new();
    let mut late = Vec::new();
    let mut duplicates = 0;
    for batch in batches {
        let mut max_t = i64::MIN;
        for r in batch {
            max_t = max_t.max(r.t);
            if seen.contains_key(&r.id) && r.t + horizon > wm {
                duplicates += 1;
                continue;
            }
            if r.t + horizon > wm {
                seen.insert(r.id.clone(), r.t);
            }
            let open: Vec<_> = shape
                .windows(r.t)
                .into_iter()
                .filter(|(_, end)| wm < end + lateness)
                .collect();
            if open.is_empty() {
                late.push(r.id.clone());
            }
            for (s, e) in open {
                windows.entry((r.key.clone(), s, e)).or_default().push(r);
            }
        }
        if max_t > i64::MIN {
            wm = wm.max(max_t - bound);
        }
    }
    Oracle {
        finals: windows
            .into_iter()
            .map(|(k, v)| (k, aggregate(&v)))
            .collect(),
        late,
        duplicates,
    }
}

/// Random events, some duplicated, in a random arrival order (delays up to `max_delay`),
/// cut into random batches.
fn scenario(max_delay_s: i64) -> impl Strategy<Value = Vec<Vec<Rec>>> {
    let event = (
        0..3usize,
        0..1200i64,
        1..1000i64,
        0..=max_delay_s,
        prop::bool::weighted(0.15),
        0..=max_delay_s,
    );
    prop::collection::vec(event, 1..80).prop_flat_map(|events| {
        let mut arrivals: Vec<(i64, usize, Rec)> = Vec::new();
        for (i, (k, t, amount, delay, dup, dup_delay)) in events.into_iter().enumerate() {
            let r = rec(["a", "b", "c"][k], t * S, &format!("e{i}"), amount);
            if dup {
                arrivals.push(((t + dup_delay) * S, arrivals.len(), r.clone()));
            }
            arrivals.push(((t + delay) * S, arrivals.len(), r));
        }
        arrivals.sort_by_key(|(at, n, _)| (*at, *n));
        let recs: Vec<Rec> = arrivals.into_iter().map(|(_, _, r)| r).collect();
        let n = recs.len();
        // Mostly small batches (many arrival interleavings), some large enough that the
        // engine's passes over a batch work in several chunks.
        let size = prop_oneof![4 => 1..8usize, 1 => 20..100usize];
        prop::collection::vec(size, n).prop_map(move |sizes| {
            let mut out = Vec::new();
            let mut i = 0;
            for s in sizes {
                if i >= recs.len() {
                    break;
                }
                let end = (i + s).min(recs.len());
                out.push(recs[i..end].to_vec());
                i = end;
            }
            out
        })
    })
}

fn shapes() -> impl Strategy<Value = Shape> {
    prop_oneof![
        Just(Shape::Tumbling(60 * S)),
        Just(Shape::Sliding(180 * S, 60 * S)),
        Just(Shape::Sliding(60 * S, 20 * S))
    ]
}

/// Runs `batches` whole, and again with a snapshot and restore after `cut` of them (then
/// split by key-group range and merged): the restored runs give the whole run's rows.
fn snapshot_restore_continue(
    spec: &Arc<JobSpec>,
    batches: &[Vec<Rec>],
    cut: usize,
) -> Result<(), TestCaseError> {
    let whole = run(&mut engine(spec), batches, 0);
    let cut = cut.min(batches.len());
    let mut first = engine(spec);
    let mut out = Run::default();
    for (i, b) in batches[..cut].iter().enumerate() {
        step(&mut first, b, i as i64 * S, &mut out);
    }
    let bytes = first.snapshot().unwrap();
    drop(first);
    let mut restored =
        WindowEngine::restore(spec.clone(), EngineConfig::default(), &bytes).unwrap();
    for (i, b) in batches[cut..].iter().enumerate() {
        step(&mut restored, b, (cut + i) as i64 * S, &mut out);
    }
    out.rows
        .extend(restored.finish(batches.len() as i64 * S).rows());
    prop_assert_eq!(&out.rows, &whole.rows);

    // Rescaling: split by key-group range, restore both halves into one engine.
    let mut again = engine(spec);
    let mut out2 = Run::default();
    for (i, b) in batches[..cut].iter().enumerate() {
        step(&mut again, b, i as i64 * S, &mut out2);
    }
    let low = again.snapshot_key_groups(0..=127).unwrap();
    let high = again.snapshot_key_groups(128..=255).unwrap();
    let mut merged = WindowEngine::restore(spec.clone(), EngineConfig::default(), &high).unwrap();
    merged.merge_snapshot(&low).unwrap();
    for (i, b) in batches[cut..].iter().enumerate() {
        step(&mut merged, b, (cut + i) as i64 * S, &mut out2);
    }
    out2.rows
        .extend(merged.finish(batches.len() as i64 * S).rows());
    prop_assert_eq!(finals(&out2.rows), finals(&whole.rows));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn final_versions_equal_the_oracle(
        shape in shapes(),
        bound_s in prop_oneof![Just(0i64), Just(5), Just(30)],
        lateness_s in prop_oneof![Just(0i64), Just(30), Just(120), Just(600)],
        batches in scenario(900),
    ) {
        let spec = spec(&shape.toml(), &format!("{bound_s}s"), &format!("{lateness_s}s"), Some("20s"));
        let mut e = engine(&spec);
        let got = run(&mut e, &batches, 0);
        assert_versions_strictly_increase(&got.rows);
        let want = oracle(shape, bound_s * S, lateness_s * S, &batches);
        prop_assert_eq!(finals(&got.rows), want.finals);
        let mut late: Vec<String> = got.late.iter().map(|r| r.id.clone()).collect();
        let mut want_late = want.late.clone();
        late.sort();
        want_late.sort();
        prop_assert_eq!(late, want_late);
        prop_assert_eq!(got.duplicates, want.duplicates);
    }

    /// Every arrival order within the lateness bound gives the same final outputs.
    #[test]
    fn order_independent_within_lateness(
        shape in shapes(),
        a in scenario(300),
        seed in any::<u64>(),
    ) {
        // The same records in another order: shuffle within the 300 s delay by reversing
        // random runs of batches (every record still arrives within 600 s of its time).
        let flat: Vec<Rec> = a.iter().flatten().cloned().collect();
        let mut b = flat.clone();
        let mut x = seed | 1;
        for i in (1..b.len()).rev() {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            let j = (x % (i as u64 + 1)) as usize;
            if (b[i].t - b[j].t).abs() <= 150 * S { b.swap(i, j); }
        }
        let spec = spec(&shape.toml(), "0s", "20m", None);
        let one = run(&mut engine(&spec), &a, 0);
        let other = run(&mut engine(&spec), &[b], 0);
        prop_assert!(one.late.is_empty() && other.late.is_empty());
        prop_assert_eq!(finals(&one.rows), finals(&other.rows));
    }

    /// Snapshot at a random point, restore, continue: exactly the uninterrupted run's rows.
    #[test]
    fn snapshot_restore_continue_equals_uninterrupted(
        shape in shapes(),
        batches in scenario(600),
        cut in 0usize..40,
    ) {
        let spec = spec(&shape.toml(), "5s", "2m", Some("20s"));
        snapshot_restore_continue(&spec, &batches, cut)?;
    }

    /// The same for sessions, with a lateness shorter than the gap: sessions retire, and
    /// their frontiers (which turn away records that would reopen them) and their pending
    /// timers go through the snapshot.
    #[test]
    fn session_snapshot_restore_continue_equals_uninterrupted(
        batches in scenario(600),
        cut in 0usize..40,
    ) {
        let spec = spec("kind = \"session\"\ngap = \"2m\"", "5s", "30s", None);
        snapshot_restore_continue(&spec, &batches, cut)?;
    }

    /// Sessions with nothing beyond lateness: the final sessions are the brute-force
    /// sessionization of the deduplicated records.
    #[test]
    fn sessions_equal_brute_force(
        batches in scenario(900),
        bound_s in prop_oneof![Just(0i64), Just(30)],
    ) {
        let gap = 120 * S;
        let spec = spec("kind = \"session\"\ngap = \"2m\"", &format!("{bound_s}s"), "1000h", None);
        let got = run(&mut engine(&spec), &batches, 0);
        assert_versions_strictly_increase(&got.rows);
        let mut by_key: BTreeMap<String, BTreeMap<String, Rec>> = BTreeMap::new();
        for r in batches.iter().flatten() {
            by_key.entry(r.key.clone()).or_default().insert(r.id.clone(), r.clone());
        }
        let mut want = Finals::new();
        for (key, recs) in by_key {
            let mut recs: Vec<Rec> = recs.into_values().collect();
            recs.sort_by_key(|r| r.t);
            let mut session: Vec<&Rec> = Vec::new();
            let close = |s: &mut Vec<&Rec>, want: &mut Finals| {
                if let (Some(f), Some(l)) = (s.first(), s.last()) {
                    want.insert((key.clone(), f.t, l.t + gap), aggregate(s));
                }
                s.clear();
            };
            for r in &recs {
                if session.last().is_some_and(|l| r.t - l.t >= gap) {
                    close(&mut session, &mut want);
                }
                session.push(r);
            }
            close(&mut session, &mut want);
        }
        prop_assert_eq!(finals(&got.rows), want);
        prop_assert!(got.late.is_empty());
    }
}
