//! Scenario tests of the engine's semantics, one rule each.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use std::sync::Arc;

use signalweave_window::{AggValue, Completeness, EngineConfig, JobSpec, LateReason, WindowEngine};

const M: i64 = 60 * S;

#[test]
fn tumbling_on_time_then_corrected_then_late() {
    let spec = spec("kind = \"tumbling\"\nsize = \"1m\"", "0s", "2m", None);
    let mut e = engine(&spec);
    let mut out = Run::default();
    step(
        &mut e,
        &[rec("a", 10 * S, "1", 5), rec("a", 20 * S, "2", 7)],
        0,
        &mut out,
    );
    assert!(
        out.rows.is_empty(),
        "nothing before the watermark passes the end"
    );
    step(&mut e, &[rec("a", 61 * S, "3", 1)], S, &mut out); // watermark -> 61 s
    let on_time: Vec<_> = out.rows.iter().filter(|r| r.window_start == 0).collect();
    assert_eq!(on_time.len(), 1);
    assert_eq!(on_time[0].completeness, Completeness::OnTime);
    assert_eq!(on_time[0].output_version, 1);
    assert_eq!(
        on_time[0].values,
        vec![AggValue::Int(2), AggValue::Int(12), AggValue::Int(7)]
    );
    // Within lateness: a corrected version 2.
    step(&mut e, &[rec("a", 30 * S, "4", 100)], 2 * S, &mut out);
    let last = out.rows.last().unwrap();
    assert_eq!(
        (last.window_start, last.output_version, last.completeness),
        (0, 2, Completeness::Corrected)
    );
    assert_eq!(
        last.values,
        vec![AggValue::Int(3), AggValue::Int(112), AggValue::Int(100)]
    );
    // Move the watermark past end + lateness (60 s + 120 s), then a record for [0, 60 s) is late.
    step(&mut e, &[rec("a", 200 * S, "5", 1)], 3 * S, &mut out);
    let mut late = Run::default();
    step(&mut e, &[rec("a", 40 * S, "6", 9)], 4 * S, &mut late);
    assert_eq!(late.late.len(), 1);
    let outcome = e
        .process_batch(&batch(&[rec("a", 41 * S, "7", 9)]), "src", 5 * S)
        .unwrap();
    assert_eq!(outcome.late[0].reason, LateReason::BeyondAllowedLateness);
    assert_versions_strictly_increase(&out.rows);
}

#[test]
fn duplicates_never_change_an_aggregate() {
    let spec = spec("kind = \"tumbling\"\nsize = \"1m\"", "0s", "1h", None);
    let mut e = engine(&spec);
    let r = run(
        &mut e,
        &[
            vec![rec("a", S, "x", 5), rec("a", 2 * S, "x", 5)],
            vec![rec("a", 3 * S, "x", 5)],
            vec![rec("a", 70 * S, "y", 1)],
            vec![rec("a", 4 * S, "x", 5)],
        ],
        0,
    );
    assert_eq!(r.duplicates, 3);
    let f = finals(&r.rows);
    assert_eq!(f[&("a".into(), 0, M)].0, 1);
}

#[test]
fn early_trigger_emits_provisional_versions_of_changed_windows() {
    let spec = spec(
        "kind = \"tumbling\"\nsize = \"1m\"",
        "0s",
        "1h",
        Some("20s"),
    );
    let mut e = engine(&spec);
    let mut out = Run::default();
    step(&mut e, &[rec("a", S, "1", 1)], 0, &mut out);
    assert!(
        out.rows.is_empty(),
        "the first early firing is 20 s after start"
    );
    step(&mut e, &[rec("a", 2 * S, "2", 1)], 20 * S, &mut out);
    assert_eq!(out.rows.len(), 1);
    assert_eq!(out.rows[0].completeness, Completeness::Provisional);
    assert_eq!(out.rows[0].events, 2);
    step(&mut e, &[], 40 * S, &mut out);
    assert_eq!(
        out.rows.len(),
        1,
        "an unchanged window is not re-emitted early"
    );
    step(&mut e, &[rec("a", 3 * S, "3", 1)], 60 * S, &mut out);
    assert_eq!(out.rows.len(), 2);
    assert_eq!(out.rows[1].output_version, 2);
    step(&mut e, &[rec("a", 61 * S, "4", 1)], 61 * S, &mut out);
    step(&mut e, &[], 62 * S, &mut out);
    let on_time = out
        .rows
        .iter()
        .find(|r| r.completeness == Completeness::OnTime)
        .unwrap();
    assert_eq!(
        (on_time.window_start, on_time.output_version, on_time.events),
        (0, 3, 3)
    );
    assert_versions_strictly_increase(&out.rows);
}

#[test]
fn sliding_windows_combine_panes() {
    let spec = spec(
        "kind = \"sliding\"\nsize = \"3m\"\nslide = \"1m\"",
        "0s",
        "1h",
        None,
    );
    let mut e = engine(&spec);
    let r = run(
        &mut e,
        &[vec![
            rec("a", 30 * S, "1", 1),
            rec("a", 90 * S, "2", 10),
            rec("a", 150 * S, "3", 100),
        ]],
        0,
    );
    let f = finals(&r.rows);
    let sum = |s: i64| match f[&("a".into(), s * M, s * M + 3 * M)].1[1] {
        AggValue::Int(v) => v,
        _ => panic!(),
    };
    assert_eq!(f.len(), 5); // windows starting at -2, -1, 0, 1, 2 minutes
    assert_eq!(sum(0), 111);
    assert_eq!(sum(1), 110);
    assert_eq!(sum(2), 100);
    assert_eq!(sum(-1), 11);
    assert_eq!(sum(-2), 1);
}

#[test]
fn late_event_bridging_two_sessions_retracts_both() {
    let spec = spec("kind = \"session\"\ngap = \"5m\"", "0s", "1h", None);
    let mut e = engine(&spec);
    let mut out = Run::default();
    step(
        &mut e,
        &[rec("a", 0, "1", 1), rec("a", 8 * M, "2", 2)],
        0,
        &mut out,
    );
    step(&mut e, &[rec("b", 30 * M, "x", 0)], S, &mut out); // watermark 30 min: both sessions fire
    let fired: Vec<_> = out.rows.iter().filter(|r| &*r.key == "a").collect();
    assert_eq!(fired.len(), 2);
    assert!(fired.iter().all(|r| r.completeness == Completeness::OnTime));
    // 4 min bridges [0, 5m) and [8m, 13m) into [0, 13m).
    let mut more = Run::default();
    step(&mut e, &[rec("a", 4 * M, "3", 4)], 2 * S, &mut more);
    let retracted: Vec<_> = more.rows.iter().filter(|r| r.retracted).collect();
    assert_eq!(retracted.len(), 2);
    // Newest first.
    assert_eq!(
        retracted.iter().map(|r| r.window_start).collect::<Vec<_>>(),
        [8 * M, 0]
    );
    assert!(
        retracted
            .iter()
            .all(|r| r.output_version == 2 && r.completeness == Completeness::Corrected)
    );
    let merged = more.rows.iter().find(|r| !r.retracted).unwrap();
    assert_eq!(
        (merged.window_start, merged.window_end, merged.events),
        (0, 13 * M, 3)
    );
    let mut all = out.rows.clone();
    all.extend(more.rows);
    all.extend(e.finish(3 * S).rows());
    let f = finals(&all);
    assert_eq!(f.keys().filter(|k| k.0 == "a").count(), 1);
    assert_versions_strictly_increase(&all);
}

/// A record that extends a session already emitted on time, into a session whose end the
/// watermark has not reached: the new session is still open. It is not labelled
/// `corrected` (final); it gets its `on_time` version once the watermark passes its end.
#[test]
fn a_session_extended_past_the_watermark_stays_open_until_it_closes() {
    let spec = spec("kind = \"session\"\ngap = \"5m\"", "0s", "1h", None);
    let mut e = engine(&spec);
    let mut out = Run::default();
    step(
        &mut e,
        &[rec("a", 0, "1", 1), rec("a", M, "2", 2)],
        0,
        &mut out,
    );
    // Watermark 8 min: [0, 6m) fires on time.
    step(&mut e, &[rec("b", 8 * M, "x", 0)], S, &mut out);
    let first: Vec<_> = out.rows.iter().filter(|r| &*r.key == "a").collect();
    assert_eq!(first.len(), 1);
    assert_eq!(
        (first[0].window_end, first[0].completeness),
        (6 * M, Completeness::OnTime)
    );
    // 4 min extends it to [0, 9m), which ends after the watermark (8 min).
    let mut more = Run::default();
    step(&mut e, &[rec("a", 4 * M, "3", 4)], 2 * S, &mut more);
    assert!(
        more.rows
            .iter()
            .filter(|r| &*r.key == "a" && !r.retracted)
            .all(|r| r.completeness != Completeness::Corrected),
        "{:?}",
        more.rows
    );
    // Watermark 20 min: the session closes, on time, with its three events.
    let mut later = Run::default();
    step(&mut e, &[rec("b", 20 * M, "y", 0)], 3 * S, &mut later);
    let closed: Vec<_> = later
        .rows
        .iter()
        .filter(|r| &*r.key == "a" && !r.retracted)
        .collect();
    assert_eq!(closed.len(), 1, "{:?}", later.rows);
    assert_eq!(
        (
            closed[0].window_start,
            closed[0].window_end,
            closed[0].events,
            closed[0].completeness
        ),
        (0, 9 * M, 3, Completeness::OnTime)
    );
    let mut all = out.rows.clone();
    all.extend(more.rows);
    all.extend(later.rows);
    all.extend(e.finish(4 * S).rows());
    assert_versions_strictly_increase(&all);
}

#[test]
fn null_keys_go_to_the_late_output_with_their_reason() {
    let spec = spec("kind = \"tumbling\"\nsize = \"1m\"", "0s", "1h", None);
    let mut e = engine(&spec);
    let mut b = signalweave_model::EventBatchBuilder::with_capacity(1);
    let mut ev = signalweave_fixtures::Generator::new(Default::default())
        .find_map(|r| match r {
            signalweave_fixtures::Record::Event(e) => Some(e),
            _ => None,
        })
        .unwrap();
    ev.market_id = None;
    b.push(&ev);
    let outcome = e.process_batch(&b.finish().unwrap(), "src", 0).unwrap();
    assert_eq!(outcome.late.len(), 1);
    assert_eq!(outcome.late[0].reason, LateReason::NullKey);
}

#[test]
fn bad_specs_name_the_field() {
    let base = job_text("market_aggregates");
    for (from, to, field) in [
        ("size = \"1m\"", "size = \"0s\"", "window.size"),
        (
            "kind = \"tumbling\"\nsize = \"1m\"",
            "kind = \"sliding\"\nsize = \"10m\"\nslide = \"3m\"",
            "window.slide",
        ),
        (
            "kind = \"tumbling\"\nsize = \"1m\"",
            "kind = \"session\"\ngap = \"5m\"",
            "triggers.early_every",
        ),
        (
            "function = \"sum\"\ncolumn = \"amount_minor\"",
            "function = \"sum\"",
            "aggregates[1].column",
        ),
        (
            "name = \"paid_count\"",
            "name = \"placed_count\"",
            "aggregates[2].name",
        ),
        ("columns = [\"market_id\"]", "columns = []", "key.columns"),
        (
            "event_type = \"order_paid\"",
            "event_type = \"withdrawal_requested\"",
            "aggregates[2].event_type",
        ),
    ] {
        assert!(base.contains(from), "{from}");
        let err = JobSpec::from_toml(&base.replacen(from, to, 1)).unwrap_err();
        assert!(err.message().contains(field), "{field}: {}", err.message());
    }
    let err =
        JobSpec::from_toml(&base.replace("allowed = \"2h\"", "allowed = \"soon\"")).unwrap_err();
    assert!(err.message().contains("line"), "{}", err.message());
}

#[test]
fn shipped_jobs_parse() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../jobs");
    for job in ["market_aggregates", "customer_features", "withdrawals"] {
        let spec = JobSpec::from_file(format!("{dir}/{job}.toml")).unwrap();
        assert_eq!(spec.name, job);
    }
}

#[test]
fn records_at_the_top_of_time_share_one_session() {
    // `t + gap` saturates: the session is [MAX, MAX), and the second record must find it.
    let spec = spec("kind = \"session\"\ngap = \"5m\"", "0s", "10m", None);
    let mut e = engine(&spec);
    let mut out = Run::default();
    step(
        &mut e,
        &[rec("a", i64::MAX, "1", 1), rec("a", i64::MAX, "2", 2)],
        0,
        &mut out,
    );
    out.rows.extend(e.finish(S).rows());
    let a: Vec<_> = out.rows.iter().filter(|r| &*r.key == "a").collect();
    assert_eq!(a.len(), 1, "{a:?}");
    assert_eq!((a[0].window_start, a[0].events), (i64::MAX, 2));
}

#[test]
fn a_session_state_restored_into_a_tumbling_job_is_refused() {
    let sessions = spec("kind = \"session\"\ngap = \"5m\"", "0s", "10m", None);
    let mut e = engine(&sessions);
    step(&mut e, &[rec("a", 0, "1", 1)], 0, &mut Run::default());
    let bytes = e.snapshot().unwrap();
    let tumbling = spec("kind = \"tumbling\"\nsize = \"1m\"", "0s", "10m", None);
    let err = WindowEngine::restore(tumbling, EngineConfig::default(), &bytes).unwrap_err();
    assert!(err.message().contains("sessions"), "{}", err.message());
}

#[test]
fn a_retired_session_is_never_recreated() {
    let spec = spec("kind = \"session\"\ngap = \"5m\"", "0s", "10m", None);
    let mut e = engine(&spec);
    let mut out = Run::default();
    step(&mut e, &[rec("a", 0, "1", 1)], 0, &mut out);
    step(&mut e, &[rec("b", 15 * M, "x", 1)], S, &mut out); // watermark 15 min: [0, 5m) retires
    step(&mut e, &[], 2 * S, &mut out);
    let mut late = Run::default();
    step(&mut e, &[rec("a", 4 * M, "2", 1)], 3 * S, &mut late);
    assert_eq!(
        late.late.len(),
        1,
        "a record inside the retired session's span is late"
    );
    out.rows.extend(late.rows);
    out.rows.extend(e.finish(4 * S).rows());
    let f = finals(&out.rows);
    assert_eq!(f.keys().filter(|k| k.0 == "a").count(), 1);
}

#[test]
fn a_long_session_never_counts_a_replayed_record_twice() {
    // Horizon = 10 min lateness + 5 min gap + 1 h replay; the session lasts 3 h.
    let spec = spec("kind = \"session\"\ngap = \"5m\"", "0s", "10m", None);
    let mut e = engine(&spec);
    let mut out = Run::default();
    for m in 0..180 {
        step(
            &mut e,
            &[rec("a", m * M, &format!("e{m}"), 1)],
            m * S,
            &mut out,
        );
    }
    let mut replay = Run::default();
    step(&mut e, &[rec("a", 60 * M, "e60", 1)], 181 * S, &mut replay);
    assert_eq!(
        replay.duplicates + replay.late.len() as u64,
        1,
        "either a duplicate or late, never counted"
    );
    out.rows.extend(replay.rows);
    out.rows.extend(e.finish(182 * S).rows());
    let f = finals(&out.rows);
    assert_eq!(f.values().map(|(n, _)| *n).sum::<i64>(), 180);
}

#[test]
fn merging_parts_of_different_checkpoints_is_refused_and_changes_nothing() {
    let spec = spec("kind = \"tumbling\"\nsize = \"1m\"", "0s", "2m", None);
    let mut a = engine(&spec);
    let mut b = engine(&spec);
    let mut out = Run::default();
    step(&mut a, &[rec("a", 10 * M, "1", 1)], 0, &mut out);
    step(&mut b, &[rec("b", 2 * M, "2", 1)], 0, &mut out);
    let before = a.snapshot().unwrap();
    let err = a.merge_snapshot(&b.snapshot().unwrap()).unwrap_err();
    assert!(
        err.message().contains("one checkpoint"),
        "{}",
        err.message()
    );
    assert_eq!(a.snapshot().unwrap(), before);
}

#[test]
fn multi_column_keys_do_not_collide() {
    let base = job_text("market_aggregates");
    let spec = std::sync::Arc::new(
        JobSpec::from_toml(&base.replace(
            "columns = [\"market_id\"]",
            "columns = [\"market_id\", \"customer_id\"]",
        ))
        .unwrap(),
    );
    let mut e = engine(&spec);
    let mut b = signalweave_model::EventBatchBuilder::with_capacity(2);
    let template = signalweave_fixtures::Generator::new(Default::default())
        .find_map(|r| match r {
            signalweave_fixtures::Record::Event(e) if e.event_type == "order_placed" => Some(e),
            _ => None,
        })
        .unwrap();
    for (i, (m, c)) in [("a|b", "c"), ("a", "b|c")].into_iter().enumerate() {
        let mut ev = template.clone();
        ev.event_id = signalweave_model::EventId::new(format!("k{i}"));
        ev.market_id = Some(m.into());
        ev.customer_id = Some(c.into());
        b.push(&ev);
    }
    e.process_batch(&b.finish().unwrap(), "src", 0).unwrap();
    let rows: Vec<_> = e.finish(S).rows().collect();
    let keys: std::collections::BTreeSet<_> = rows.iter().map(|r| r.key.clone()).collect();
    assert_eq!(keys.len(), 2, "{keys:?}");
}

#[test]
fn sub_microsecond_durations_are_refused() {
    let base = job_text("market_aggregates");
    for (from, to, field) in [
        ("size = \"1m\"", "size = \"500ns\"", "window.size"),
        (
            "idle_timeout = \"1m\"",
            "idle_timeout = \"0s\"",
            "time.idle_timeout",
        ),
        (
            "early_every = \"20s\"",
            "early_every = \"10ns\"",
            "triggers.early_every",
        ),
    ] {
        let err = JobSpec::from_toml(&base.replace(from, to)).unwrap_err();
        assert!(err.message().contains(field), "{field}: {}", err.message());
    }
}

/// A backfill judges each record by the watermark it carries. A record whose key's newest
/// pane is its own, still held by the engine, is late all the same once its own watermark
/// has passed that window's end plus the allowed lateness; one just before is counted.
#[test]
fn a_records_own_watermark_makes_it_late_even_in_a_held_pane() {
    let spec = spec("kind = \"tumbling\"\nsize = \"1m\"", "0s", "10s", None);
    let config = EngineConfig {
        watermark_column: Some("wm".into()),
        dedup_only_column: None,
        ..EngineConfig::default()
    };
    let mut e = WindowEngine::new(Arc::clone(&spec), config).unwrap();
    // The window [0, 60 s) of key m is created and stays held (the engine's watermark
    // does not move: no fire).
    let first = batch_with_watermarks(&[rec("m", S, "a", 1)], &[None]);
    assert_eq!(e.process_batch(&first, "src", 0).unwrap().counted, 1);
    // Same pane: one record judged at 69.999999 s (counted), one at 70 s (late), one
    // without a watermark of its own (counted).
    let recs = [
        rec("m", 2 * S, "b", 10),
        rec("m", 3 * S, "c", 100),
        rec("m", 4 * S, "d", 1000),
    ];
    let second = batch_with_watermarks(&recs, &[Some(70 * S - 1), Some(70 * S), None]);
    let outcome = e.process_batch(&second, "src", 0).unwrap();
    assert_eq!(outcome.counted, 2);
    assert_eq!(
        outcome
            .late
            .iter()
            .map(|l| (l.row, l.watermark))
            .collect::<Vec<_>>(),
        vec![(1, 70 * S)]
    );
    let rows: Vec<_> = e.finish(1).rows().collect();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].events, 3);
    assert_eq!(
        rows[0].values,
        vec![AggValue::Int(3), AggValue::Int(1011), AggValue::Int(1000)]
    );
}

/// A record judged for dedup only (a backfill's copy from outside its range or key
/// groups) claims its identity when it is the first copy, so a later copy that would
/// count is a duplicate; it is itself a duplicate of an earlier copy; and it adds to no
/// window, creates no key, moves no watermark and is reported nowhere.
#[test]
fn a_record_judged_for_dedup_only_claims_its_identity_and_nothing_else() {
    use arrow::array::BooleanArray;

    let spec = spec("kind = \"tumbling\"\nsize = \"1m\"", "0s", "1h", None);
    let config = EngineConfig {
        dedup_only_column: Some("only".into()),
        ..EngineConfig::default()
    };
    let with_only = |recs: &[Rec], only: &[bool]| {
        with_column(
            batch(recs),
            "only",
            Arc::new(BooleanArray::from(only.to_vec())),
        )
    };
    let mut e = WindowEngine::new(Arc::clone(&spec), config).unwrap();
    let first = with_only(
        &[
            rec("m", 10 * S, "a", 1),
            rec("n", 20 * S, "b", 2),
            rec("m", 30 * S, "b", 4),
            rec("m", 40 * S, "c", 8),
            rec("x", 50 * S, "c", 16),
            rec("y", 100 * 3600 * S, "e", 64),
        ],
        &[false, true, false, false, true, true],
    );
    let outcome = e.process_batch(&first, "src", 0).unwrap();
    assert_eq!(outcome.counted, 2, "a and c");
    assert_eq!(
        outcome.duplicates, 1,
        "b, whose first copy was judged for dedup only"
    );
    assert!(outcome.late.is_empty());
    assert_eq!(outcome.filtered, 0);
    let size = e.state_size();
    assert_eq!(size.keys, 1, "only m is a key");
    assert_eq!(size.dedup_identities, 4, "a, b, c and e are held");
    // Had the copy 100 h ahead moved the watermark, the window would fire here and the
    // next record would be late.
    assert!(e.fire(S).is_empty(), "the watermark is 40 s");
    let second = with_only(
        &[rec("m", 45 * S, "d", 32), rec("m", 50 * S, "e", 128)],
        &[false, false],
    );
    let outcome = e.process_batch(&second, "src", 0).unwrap();
    assert_eq!(
        (outcome.counted, outcome.duplicates),
        (1, 1),
        "d counts; e is a copy"
    );
    assert!(outcome.late.is_empty());
    let rows: Vec<_> = e.finish(1).rows().collect();
    assert_eq!(
        rows.len(),
        1,
        "no window and no key for n, x or y: {rows:?}"
    );
    assert_eq!(&*rows[0].key, "m");
    assert_eq!(rows[0].events, 3);
    assert_eq!(
        rows[0].values,
        vec![AggValue::Int(3), AggValue::Int(41), AggValue::Int(32)]
    );
}

/// A record judged for dedup only that the live job would not have held claims nothing: one
/// of an event type the job filters out, or one with a null key (which the live job
/// reports as late). A later copy of either that counts is counted.
#[test]
fn a_record_judged_for_dedup_only_that_the_job_would_not_hold_claims_nothing() {
    use arrow::array::BooleanArray;
    use arrow::compute::nullif;

    let mut filtered = (*spec("kind = \"tumbling\"\nsize = \"1m\"", "0s", "1h", None)).clone();
    filtered.source.event_types = vec!["order_placed".into()];
    let config = EngineConfig {
        dedup_only_column: Some("only".into()),
        ..EngineConfig::default()
    };
    let mut e = WindowEngine::new(Arc::new(filtered), config).unwrap();
    let paid = |key: &str, t: i64, id: &str, amount: i64| Rec {
        event_type: "order_paid",
        ..rec(key, t, id, amount)
    };
    // a: of a filtered type; b: with a null key; c: of a filtered type, not dedup-only.
    let first = batch(&[
        paid("m", 10 * S, "a", 1),
        rec("m", 20 * S, "b", 2),
        paid("m", 25 * S, "c", 4),
    ]);
    let market = first.schema().index_of("market_id").unwrap();
    let mut columns = first.columns().to_vec();
    columns[market] = nullif(
        &columns[market],
        &BooleanArray::from(vec![false, true, false]),
    )
    .unwrap();
    let first = with_column(
        arrow::array::RecordBatch::try_new(first.schema(), columns).unwrap(),
        "only",
        Arc::new(BooleanArray::from(vec![true, true, false])),
    );
    let outcome = e.process_batch(&first, "src", 0).unwrap();
    assert_eq!(
        (outcome.counted, outcome.duplicates, outcome.filtered),
        (0, 0, 1),
        "only c, which counts, is reported as filtered"
    );
    assert!(outcome.late.is_empty(), "b's null key is not reported");
    assert_eq!(e.state_size().dedup_identities, 0);
    let second = with_column(
        batch(&[rec("m", 30 * S, "a", 8), rec("m", 40 * S, "b", 16)]),
        "only",
        Arc::new(BooleanArray::from(vec![false, false])),
    );
    let outcome = e.process_batch(&second, "src", 0).unwrap();
    assert_eq!(
        (outcome.counted, outcome.duplicates),
        (2, 0),
        "neither a nor b was claimed"
    );
    let rows: Vec<_> = e.finish(1).rows().collect();
    assert_eq!(rows.len(), 1);
    assert_eq!(
        rows[0].values,
        vec![AggValue::Int(2), AggValue::Int(24), AggValue::Int(16)]
    );
}

/// A reset engine (a backfill's next sub-range) holds nothing of its last run, dedup
/// identities included, and runs the next input exactly as a new engine does.
#[test]
fn a_reset_engine_runs_like_a_new_one() {
    let spec = spec(
        "kind = \"sliding\"\nsize = \"3m\"\nslide = \"1m\"",
        "5s",
        "1h",
        Some("20s"),
    );
    let first = [
        vec![rec("a", 30 * S, "x", 1), rec("b", 40 * S, "y", 2)],
        vec![rec("a", 90 * S, "z", 10)],
    ];
    let second = [
        vec![rec("a", 10 * S, "x", 5), rec("c", 20 * S, "w", 7)],
        vec![rec("a", 10 * S, "x", 5), rec("a", 200 * S, "v", 3)],
    ];
    let mut reused = engine(&spec);
    reused.reserve(1_000);
    run(&mut reused, &first, 0);
    reused.reset();
    assert_eq!(reused.state_size().keys, 0);
    assert_eq!(reused.state_size().dedup_identities, 0);
    let again = run(&mut reused, &second, 0);
    let fresh = run(&mut engine(&spec), &second, 0);
    assert_eq!(again.rows, fresh.rows);
    assert_eq!(again.duplicates, 1, "`x` of the first run is forgotten");
    assert_eq!(again.late, fresh.late);
}

/// At the end of input every window makes its last emission: an open one its on-time
/// version, a closed one the correction a late record made it await.
#[test]
fn the_end_of_input_emits_each_window_once_more_only_if_due() {
    let spec = spec(
        "kind = \"sliding\"\nsize = \"2m\"\nslide = \"1m\"",
        "0s",
        "1h",
        None,
    );
    let mut e = engine(&spec);
    let mut out = Run::default();
    step(&mut e, &[rec("a", 10 * S, "1", 5)], 0, &mut out);
    step(&mut e, &[rec("a", 130 * S, "2", 7)], S, &mut out); // windows ending by 130 s close
    let closed: Vec<_> = out.rows.iter().map(|r| r.window_start).collect();
    assert_eq!(closed, [-M, 0], "on time: [-1m, 1m) and [0, 2m)");
    // A late record for [0, 1m) changes two closed windows; no fire before the end.
    e.process_batch(&batch(&[rec("a", 20 * S, "3", 100)]), "src", 2 * S)
        .unwrap();
    let end: Vec<_> = e.finish(3 * S).rows().collect();
    let got: Vec<_> = end
        .iter()
        .map(|r| (r.window_start, r.output_version, r.completeness, r.events))
        .collect();
    assert_eq!(
        got,
        [
            (-M, 2, Completeness::Corrected, 2),
            (0, 2, Completeness::Corrected, 2),
            (M, 1, Completeness::OnTime, 1),
            (2 * M, 1, Completeness::OnTime, 1),
        ]
    );
    assert_eq!(e.state_size().windows, 0);
    assert_eq!(e.state_size().panes, 0);
    assert_eq!(e.state_size().timers, 0);
}

/// A backfill reads files in order of arrival and promises, per file, a floor no record
/// to come is judged below: the dedup set then drops what expires by it instead of
/// growing. The outputs, duplicates and late records are those of a run without floors,
/// while the set stays smaller; a record below a promised floor is refused.
#[test]
fn a_dedup_floor_changes_no_output_and_bounds_the_set() {
    let spec = spec("kind = \"tumbling\"\nsize = \"1m\"", "0s", "10s", None);
    let horizon = spec.dedup_horizon_us();
    let config = EngineConfig {
        watermark_column: Some("wm".into()),
        dedup_only_column: None,
        ..EngineConfig::default()
    };
    let with_watermark =
        |recs: &[Rec], wm: i64| batch_with_watermarks(recs, &vec![Some(wm); recs.len()]);
    // 40 files of 400 records, each spanning 20 minutes after the one before; a file's
    // records arrived at the watermark of its start. Every 5th record repeats one from
    // 3 s to 2 h before it: inside the horizon (1 h 1 min 10 s) or past it.
    let span = 20 * 60 * S;
    let files: Vec<(i64, Vec<Rec>)> = (0..40i64)
        .map(|f| {
            let recs = (0..400i64)
                .map(|i| {
                    let t = f * span + i * (span / 400);
                    let n = f * 400 + i;
                    let id = if n % 5 == 4 {
                        // 1 to 2,400 records (3 s each) back.
                        let back = n * 7919 % 2_400 + 1;
                        (n - back).max(0)
                    } else {
                        n
                    };
                    rec(&format!("m{}", n % 13), t, &format!("e{id}"), n % 100)
                })
                .collect();
            (f * span, recs)
        })
        .collect();
    let mut results = Vec::new();
    for floors in [false, true] {
        let mut e = WindowEngine::new(Arc::clone(&spec), config.clone()).unwrap();
        let (mut duplicates, mut late) = (0, 0);
        for (wm, recs) in &files {
            if floors {
                e.set_dedup_floor(*wm);
            }
            let outcome = e
                .process_batch(&with_watermark(recs, *wm), "src", 0)
                .unwrap();
            duplicates += outcome.duplicates;
            late += outcome.late.len();
        }
        let bytes = e.state_size().dedup_bytes;
        let mut rows: Vec<_> = e
            .finish(1)
            .rows()
            .map(|r| (r.key.clone(), r.window_start, r.events, r.values.clone()))
            .collect();
        rows.sort_unstable_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        results.push((rows, duplicates, late, bytes));
    }
    let (plain, floored) = (&results[0], &results[1]);
    assert!(plain.1 > 1_000, "{} duplicates", plain.1);
    assert_eq!(
        (&floored.0, floored.1, floored.2),
        (&plain.0, plain.1, plain.2)
    );
    assert!(
        floored.3 * 4 <= plain.3,
        "the set held {} bytes with floors, {} without",
        floored.3,
        plain.3
    );
    // A floor is a promise: a record judged below it is refused.
    let mut e = WindowEngine::new(Arc::clone(&spec), config).unwrap();
    e.set_dedup_floor(horizon);
    let err = e
        .process_batch(
            &with_watermark(&[rec("m", S, "x", 1)], horizon - 1),
            "src",
            0,
        )
        .unwrap_err();
    assert_eq!(err.kind(), signalweave_model::ErrorKind::Internal);
}

/// Dictionary-encoded columns (as a backfill reads them): a null event type is filtered
/// (also with an empty dictionary, whose null keys point nowhere), and a key that points
/// at a null value is a null key.
#[test]
fn dictionary_columns_with_null_types_and_null_values_are_filtered_and_late() {
    use arrow::array::{ArrayRef, DictionaryArray, Int32Array, RecordBatch, StringArray};
    use arrow::datatypes::Int32Type;

    let mut filtered = (*spec("kind = \"tumbling\"\nsize = \"1m\"", "0s", "1h", None)).clone();
    filtered.source.event_types = vec!["order_placed".into()];
    let mut e = WindowEngine::new(Arc::new(filtered), EngineConfig::default()).unwrap();
    let dict = |keys: Vec<Option<i32>>, values: Vec<Option<&str>>| -> ArrayRef {
        Arc::new(
            DictionaryArray::<Int32Type>::try_new(
                Int32Array::from(keys),
                Arc::new(StringArray::from(values)),
            )
            .unwrap(),
        )
    };
    let replace = |b: RecordBatch, name: &str, column: ArrayRef| {
        let i = b.schema().index_of(name).unwrap();
        let mut fields: Vec<_> = b.schema().fields().iter().map(|f| (**f).clone()).collect();
        fields[i] = arrow::datatypes::Field::new(name, column.data_type().clone(), true);
        let mut columns = b.columns().to_vec();
        columns[i] = column;
        RecordBatch::try_new(Arc::new(arrow::datatypes::Schema::new(fields)), columns).unwrap()
    };
    // a: null type; b: its key points at a null value; c: counts.
    let first = batch(&[
        rec("m", 10 * S, "a", 1),
        rec("m", 20 * S, "b", 2),
        rec("m", 30 * S, "c", 4),
    ]);
    let first = replace(
        first,
        "event_type",
        dict(vec![None, Some(0), Some(0)], vec![Some("order_placed")]),
    );
    let first = replace(
        first,
        "market_id",
        dict(vec![Some(0), Some(1), Some(0)], vec![Some("m"), None]),
    );
    let outcome = e.process_batch(&first, "src", 0).unwrap();
    assert_eq!((outcome.counted, outcome.filtered), (1, 1));
    assert_eq!(outcome.late.len(), 1);
    assert_eq!(
        (outcome.late[0].row, outcome.late[0].reason),
        (1, LateReason::NullKey)
    );
    // Every type null: the dictionary is empty.
    let second = batch(&[rec("m", 40 * S, "d", 8), rec("m", 50 * S, "e", 16)]);
    let second = replace(second, "event_type", dict(vec![None, None], vec![]));
    let outcome = e.process_batch(&second, "src", 0).unwrap();
    assert_eq!((outcome.counted, outcome.filtered), (0, 2));
    let rows: Vec<_> = e.finish(0).rows().collect();
    assert_eq!(rows.len(), 1);
    assert_eq!(
        rows[0].values,
        vec![AggValue::Int(1), AggValue::Int(4), AggValue::Int(4)]
    );
}

proptest::proptest! {
    /// `on_time_from` never vouches for an input that holds a late record: after any earlier
    /// records (and fires, which move the engine's watermark, close windows and retire
    /// sessions), records at or after `earliest` judged by a watermark it accepts are all
    /// taken, whatever the window kind and lateness.
    #[test]
    fn on_time_from_vouches_only_for_records_that_are_taken(
        kind in 0usize..3,
        lateness_min in proptest::sample::select(vec![0i64, 1, 10, 120]),
        before in proptest::collection::vec((0i64..4, 0i64..(4 * 3600)), 0..40),
        earliest in 0i64..(5 * 3600),
        wm in 0i64..(6 * 3600),
        after in proptest::collection::vec((0i64..4, 0i64..3600), 1..40),
    ) {
        let window = [
            "kind = \"tumbling\"\nsize = \"1m\"",
            "kind = \"sliding\"\nsize = \"10m\"\nslide = \"1m\"",
            "kind = \"session\"\ngap = \"5m\"",
        ][kind];
        let spec = spec(window, "0s", &format!("{lateness_min}m"), None);
        let config = EngineConfig {
            watermark_column: Some("wm".into()),
            dedup_only_column: None,
            ..EngineConfig::default()
        };
        let mut e = WindowEngine::new(Arc::clone(&spec), config).unwrap();
        let recs: Vec<Rec> = before
            .iter()
            .enumerate()
            .map(|(i, &(k, t))| rec(&format!("m{k}"), t * S, &format!("b{i}"), 1))
            .collect();
        for chunk in recs.chunks(7) {
            e.process_batch(&batch_with_watermarks(chunk, &vec![None; chunk.len()]), "src", 0)
                .unwrap();
            e.fire(0);
        }
        let (earliest, wm) = (earliest * S, wm * S);
        if e.on_time_from(earliest, wm) {
            let recs: Vec<Rec> = after
                .iter()
                .enumerate()
                .map(|(i, &(k, dt))| rec(&format!("m{k}"), earliest + dt * S, &format!("a{i}"), 1))
                .collect();
            let outcome = e
                .process_batch(&batch_with_watermarks(&recs, &vec![Some(wm); recs.len()]), "src", 0)
                .unwrap();
            proptest::prop_assert!(outcome.late.is_empty(), "{:?}", outcome.late);
            proptest::prop_assert_eq!(outcome.counted as usize, recs.len());
        }
    }
}
