//! Backfills as processes: a backfill over a range equals the live job's final outputs
//! (same job version), late records included; kill -9 between a sub-range's commit and its
//! progress record, then resume, ends with the outputs of an uninterrupted run and no
//! version twice; pause, resume and abort steer a running backfill; a new job version is
//! compared, promoted (the current view and the serving API honour it) and rolled back;
//! a live burst takes the backfill's capacity back.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::cli::{Proc, count, erase_cmd, get, ok, run_market_aggregates, sql, sw, wait_until};

const FROM: &str = "2026-01-01T00:00:00Z";
const TO: &str = "2026-01-01T03:00:00Z";

/// About four hours of event time, 3 % late (5 min to 3 h behind) and 2 % duplicates,
/// loaded in commits of 500 records; then the live job reads it one commit per step.
fn landed_history(dir: &Path) -> PathBuf {
    let lake = dir.join("lake");
    land_history_in(&lake, dir, 24_000, false);
    lake
}

/// [`landed_history`] into `lake` (a directory or a profile), with `events` events, and
/// with copies of every 25th event stamped anew in a second load when `resend` (see
/// [`resends`]).
fn land_history_in(lake: &Path, dir: &Path, events: u64, resend: bool) {
    let file = dir.join("history.ndjson");
    ok(sw(lake)
        .args(["fixtures", "generate", "--out"])
        .arg(&file)
        .args([
            "--events",
            &events.to_string(),
            "--events-per-sec",
            "2",
            "--late-fraction",
            "0.03",
            "--dup-fraction",
            "0.02",
        ])
        .output()
        .unwrap());
    let mut files = vec![file.clone()];
    if resend {
        files.push(resends(&file, dir));
    }
    for f in files {
        ok(sw(lake)
            .arg("load")
            .arg(&f)
            .args(["--chunk-records", "500"])
            .output()
            .unwrap());
    }
    ok(sw(lake)
        .args([
            "run",
            "--job",
            "jobs/market_aggregates.toml",
            "--until-caught-up",
            "--max-snapshots-per-step",
            "1",
        ])
        .output()
        .unwrap());
}

/// Copies of every 25th event of `history`, resent by a producer that stamps an event
/// when it sends it: each copy's event time is 1 to 30 min later or earlier than the
/// original's, so many fall in another sub-range than it. (A load drops the copies within
/// one file; these land, as copies do through separate gateways.) The live job counted
/// the first copy to arrive, unless it came beyond the dedup horizon.
fn resends(history: &Path, dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(history).unwrap();
    let mut out = String::new();
    for (i, line) in text.lines().enumerate().filter(|(i, _)| i % 25 == 0) {
        let mut event: Value = serde_json::from_str(line).unwrap();
        let t =
            chrono::DateTime::parse_from_rfc3339(event["event_time"].as_str().unwrap()).unwrap();
        let minutes = 1 + (i / 25 % 30) as i64;
        let shift = chrono::Duration::minutes(if i / 25 % 2 == 0 { minutes } else { -minutes });
        event["event_time"] = Value::String(
            (t + shift)
                .with_timezone(&chrono::Utc)
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        );
        out.push_str(&event.to_string());
        out.push('\n');
    }
    let path = dir.join("resends.ndjson");
    std::fs::write(&path, out).unwrap();
    path
}

fn start(lake: &Path, namespace: &str, extra: &[&str]) -> std::process::Command {
    let mut c = sw(lake);
    c.args([
        "backfill",
        "start",
        "--job",
        "market_aggregates",
        "--from",
        FROM,
        "--to",
        TO,
        "--namespace",
        namespace,
        "--slice",
        "30m",
        "--quiet",
    ])
    .args(extra);
    c
}

fn try_status(lake: &Path, namespace: &str) -> Option<Value> {
    let out = sw(lake)
        .args([
            "backfill",
            "status",
            "--job",
            "market_aggregates",
            "--namespace",
            namespace,
            "--format",
            "json",
        ])
        .output()
        .unwrap();
    let mut v: Vec<Value> = serde_json::from_slice(&out.stdout).ok()?;
    out.status.success().then(|| v.remove(0))
}

fn status(lake: &Path, namespace: &str) -> Value {
    try_status(lake, namespace).expect("backfill status")
}

fn compare(lake: &Path, namespace: &str) -> Value {
    let out = ok(sw(lake)
        .args([
            "backfill",
            "compare",
            "--job",
            "market_aggregates",
            "--namespace",
            namespace,
            "--format",
            "json",
        ])
        .output()
        .unwrap());
    serde_json::from_str(&out).unwrap()
}

fn backfill_cmd(lake: &Path, verb: &str, namespace: &str) -> Output {
    sw(lake)
        .args([
            "backfill",
            verb,
            "--job",
            "market_aggregates",
            "--namespace",
            namespace,
        ])
        .output()
        .unwrap()
}

/// Promotes `namespace`: the promoted range as printed, and the whole output.
fn promote(lake: &Path, namespace: &str) -> (String, String, String) {
    let out = ok(backfill_cmd(lake, "promote", namespace));
    let (from, to) = promoted_range(&out);
    (from, to, out)
}

/// The range `promote` printed.
fn promoted_range(said: &str) -> (String, String) {
    let range = said
        .split_once(" starting in [")
        .and_then(|(_, r)| r.split_once(')'))
        .and_then(|(r, _)| r.split_once(", "))
        .unwrap_or_else(|| panic!("no range in {said}"));
    (range.0.to_string(), range.1.to_string())
}

const OUTPUTS: &str = "select key, cast(window_start as varchar) w, output_version, completeness, \
     events, placed_count, placed_amount_minor, paid_count, paid_amount_minor, cancelled_count, \
     cancelled_amount_minor from signalweave.{t} order by key, w, output_version";

/// How many sub-ranges a status shows done.
fn done(s: &Value) -> usize {
    s["subranges"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["state"] == "done")
        .count()
}

fn late_in_range(lake: &Path, namespace: &str) -> i64 {
    count(
        lake,
        &format!(
            "select count(*) from signalweave.late_events where job = 'market_aggregates' \
             and namespace = '{namespace}' and event_time >= '{FROM}' and event_time < '{TO}'"
        ),
    )
}

#[test]
fn a_backfill_equals_the_live_outputs_and_resumes_after_kill_9_without_duplicates() {
    let dir = tempfile::tempdir().unwrap();
    // With copies of one event in different sub-ranges.
    let lake = dir.path().join("lake");
    land_history_in(&lake, dir.path(), 24_000, true);
    ok(start(&lake, "reference", &["--exact-dedup"])
        .output()
        .unwrap());
    let s = status(&lake, "reference");
    assert_eq!(s["backfill"]["state"], "completed", "{s}");
    let subs = s["subranges"].as_array().unwrap();
    assert_eq!(subs.len(), 6, "3 h in 30 min slices");
    assert!(subs.iter().all(|s| s["state"] == "done"));
    // Each done sub-range records where its time went; its processing time holds the
    // reading, the engine and the waits, and the commit came after.
    for sub in subs {
        let t = &sub["stages"];
        let secs = |k: &str| t[k].as_f64().unwrap_or_else(|| panic!("{k}: {sub}"));
        let all = ["read", "engine", "throttled", "commit"];
        assert!(all.iter().all(|k| secs(k) >= 0.0), "{sub}");
        assert!(
            secs("read") + secs("engine") > 0.0 && secs("commit") > 0.0,
            "{sub}"
        );
        let seconds = sub["seconds"].as_f64().unwrap();
        assert!(
            secs("read") + secs("engine") <= seconds + 0.002,
            "stages beyond the sub-range's {seconds} s: {sub}"
        );
    }

    // Equal to the live job's outputs for the range, window by window.
    let c = compare(&lake, "reference");
    assert!(c["same"].as_u64().unwrap() > 1_000, "{c}");
    for k in ["changed", "missing", "extra", "partial"] {
        assert_eq!(c[k], 0, "{k}: {c}");
    }
    // As CSV: one table, the differing windows, under its header even when there are none.
    let csv = sw(&lake)
        .args([
            "backfill",
            "compare",
            "--job",
            "market_aggregates",
            "--namespace",
            "reference",
            "--format",
            "csv",
        ])
        .output()
        .unwrap();
    assert!(csv.status.success(), "{csv:?}");
    assert_eq!(
        String::from_utf8_lossy(&csv.stdout),
        "kind,key,window_start,current,namespace\n"
    );
    assert!(String::from_utf8_lossy(&csv.stderr).contains("changed 0"));
    // The same records were late, by the same rule.
    let live_late = late_in_range(&lake, "live");
    assert!(
        live_late > 20,
        "the fixture has events beyond 2 h: {live_late}"
    );
    assert_eq!(late_in_range(&lake, "reference"), live_late);
    // Every window once, version 1, on time.
    let table = "market_aggregates__bf_reference";
    assert_eq!(
        count(
            &lake,
            &format!(
                "select count(*) from signalweave.{table} where output_version <> 1 \
                 or completeness <> 'on_time'"
            )
        ),
        0
    );

    // kill -9 after the commit of sub-range 2, before its progress is recorded.
    // One sub-range at a time here (the reference ran two at once), and two key-group
    // ranges per slice: the copies of other key groups are judged for dedup only.
    let crashed = start(
        &lake,
        "killed",
        &[
            "--parallelism",
            "1",
            "--exact-dedup",
            "--key-group-splits",
            "2",
        ],
    )
    .env("SIGNALWEAVE_BACKFILL_FAULT", "2")
    .output()
    .unwrap();
    assert!(!crashed.status.success(), "the drill did not stop it");
    let s = status(&lake, "killed");
    let done = s["subranges"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["state"] == "done")
        .count();
    assert_eq!(done, 2, "{s}");
    // Resume right away: the lease of the killed process is still fresh; resume waits
    // for it to go stale rather than run beside a live runner.
    std::thread::sleep(Duration::from_secs(6));
    ok(backfill_cmd(&lake, "resume", "killed"));
    assert_eq!(status(&lake, "killed")["backfill"]["state"], "completed");
    let expected = sql(&lake, &OUTPUTS.replace("{t}", table));
    let resumed = sql(
        &lake,
        &OUTPUTS.replace("{t}", "market_aggregates__bf_killed"),
    );
    assert_eq!(resumed.len(), expected.len(), "no version written twice");
    assert_eq!(resumed, expected);
    assert_eq!(late_in_range(&lake, "killed"), live_late);
    // A finished backfill cannot be resumed, and a namespace has one backfill.
    let again = backfill_cmd(&lake, "resume", "killed");
    assert_eq!(again.status.code(), Some(3), "{again:?}");
    let taken = start(&lake, "killed", &[]).output().unwrap();
    assert_eq!(taken.status.code(), Some(3), "{taken:?}");
    let bad = start(&lake, "Bad-Name", &[]).output().unwrap();
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
}

/// Bad run flags, or a metrics address in use, fail a start before anything is recorded:
/// the namespace stays free.
#[test]
fn a_start_that_fails_its_checks_leaves_no_backfill_behind() {
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    ok(sw(&lake).args(["lake", "init"]).output().unwrap());
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    for flags in [
        vec!["--write-rows-per-sec", "0"],
        vec!["--read-bytes-per-sec", "0"],
        vec!["--parallelism", "0"],
        vec!["--clear-ratio", "2"],
        vec!["--guard-queue-age", "0s"],
        vec!["--live-status", "not-a-url"],
        vec!["--metrics-addr", taken.as_str()],
        // 180 slices of a minute, by 256 key-group ranges: beyond the plan's limit.
        vec!["--slice", "1m", "--key-group-splits", "256"],
    ] {
        let out = start(&lake, "checked", &flags).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {out:?}");
        assert!(
            try_status(&lake, "checked").is_none(),
            "{flags:?} left a backfill"
        );
    }
    // A status of what does not exist says so, filtered by job, namespace or both.
    for filter in [
        vec!["--job", "nosuchjob"],
        vec!["--namespace", "checked"],
        vec!["--job", "market_aggregates", "--namespace", "checked"],
    ] {
        let out = sw(&lake)
            .args(["backfill", "status"])
            .args(&filter)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{filter:?}: {out:?}");
    }
}

/// A session has no greatest length: a market whose withdrawals never pause for five
/// minutes holds one session for hours, across many of a backfill's slices. Each slice's
/// sessions must be the live job's, not the part of them after its lead-in.
#[test]
fn session_backfills_equal_the_live_sessions_that_cross_their_slices() {
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let file = dir.path().join("history.ndjson");
    ok(sw(&lake)
        .args(["fixtures", "generate", "--out"])
        .arg(&file)
        .args(["--events", "24000", "--events-per-sec", "2"])
        .output()
        .unwrap());
    ok(sw(&lake)
        .arg("load")
        .arg(&file)
        .args(["--chunk-records", "2000"])
        .output()
        .unwrap());
    ok(sw(&lake)
        .args(["run", "--job", "jobs/withdrawals.toml", "--until-caught-up"])
        .output()
        .unwrap());
    // The case is there: live sessions begin before a slice's lead-in (10 min) and end
    // in that slice.
    let long = count(
        &lake,
        "select count(*) from signalweave.withdrawals_current \
         where window_end <= '2026-01-01T03:00:00Z' \
         and cast(window_end as bigint) / 1800000000 * 1800000000 \
             - cast(window_start as bigint) > 600000000",
    );
    assert!(long >= 3, "sessions crossing a slice's lead-in: {long}");
    ok(sw(&lake)
        .args([
            "backfill",
            "start",
            "--job",
            "withdrawals",
            "--from",
            FROM,
            "--to",
            TO,
            "--namespace",
            "sessions",
            "--slice",
            "30m",
            "--key-group-splits",
            "2",
            "--quiet",
        ])
        .output()
        .unwrap());
    let out = ok(sw(&lake)
        .args([
            "backfill",
            "compare",
            "--job",
            "withdrawals",
            "--namespace",
            "sessions",
            "--format",
            "json",
        ])
        .output()
        .unwrap());
    let c: Value = serde_json::from_str(&out).unwrap();
    assert!(c["same"].as_u64().unwrap() > 50, "{c}");
    // Sessions cut by the range's end are partial, and counted as such only.
    assert!(c["partial"].as_u64().unwrap() > 0, "{c}");
    for k in ["changed", "missing", "extra"] {
        assert_eq!(c[k], 0, "{k}: {c}");
    }
    // Promoted between two points no session of either version crosses, before the
    // first session crossing the range's end (the live job's watermark, about 03:20, less
    // its lateness and a gap, 15 min, is past that end).
    let said = ok(sw(&lake)
        .args(["backfill", "promote", "--job", "withdrawals"])
        .args(["--namespace", "sessions"])
        .output()
        .unwrap());
    let (from, to) = promoted_range(&said);
    let time = |t: &str| chrono::DateTime::parse_from_rfc3339(t).unwrap();
    assert!(
        time(&from) >= time(FROM) && time(&from) < time(&to) && time(&to) < time(TO),
        "{said}"
    );
    assert!(
        said.contains("the backfill's range ends at 2026-01-01T03:00:00"),
        "{said}"
    );
    // Every session of either version lies on one side of each edge.
    for (table, namespace) in [
        ("withdrawals", "live"),
        ("withdrawals__bf_sessions", "sessions"),
    ] {
        let crossing = count(
            &lake,
            &format!(
                "select count(*) from signalweave.{table} where \
                 (window_start < '{from}' and window_end > '{from}') \
                 or (window_start < '{to}' and window_end > '{to}')"
            ),
        );
        assert_eq!(crossing, 0, "{namespace}: {said}");
    }
    let rows = sql(
        &lake,
        &format!(
            "select namespace, count(*) n from signalweave.withdrawals_current \
             where window_start >= '{from}' and window_start < '{to}' group by namespace"
        ),
    );
    assert!(rows.len() <= 1, "{rows:?}");
    if let Some(row) = rows.first() {
        assert_eq!(row["namespace"], "sessions", "{rows:?}: {said}");
    }
    eprintln!("sessions promoted: {said}");
}

#[test]
fn pause_resume_and_abort_steer_a_running_backfill() {
    let dir = tempfile::tempdir().unwrap();
    let lake = landed_history(dir.path());
    let metrics_port = support::free_port();
    let runner = Proc::spawn({
        let mut c = start(
            &lake,
            "steered",
            &[
                "--records-per-sec",
                "3000",
                "--metrics-addr",
                &format!("127.0.0.1:{metrics_port}"),
            ],
        );
        c.env("SIGNALWEAVE_LOG", "signalweave_runner=info");
        c
    });
    wait_until("a running backfill", Duration::from_secs(30), || {
        try_status(&lake, "steered").is_some_and(|s| s["running"] == true)
    });
    let metrics_text =
        || get(&format!("http://127.0.0.1:{metrics_port}/metrics")).unwrap_or_default();
    // Seconds of one stage, as the metric shows them now.
    let stage = |name: &str| {
        metrics_text()
            .lines()
            .filter(|l| {
                l.starts_with("signalweave_backfill_stage_seconds_total{")
                    && l.contains("namespace=\"steered\"")
                    && l.contains(&format!("stage=\"{name}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    ok(backfill_cmd(&lake, "pause", "steered"));
    wait_until("paused", Duration::from_secs(5), || {
        status(&lake, "steered")["backfill"]["state"] == "paused"
    });
    let throttled_at_pause = stage("throttled");
    let records = |lake: &Path| {
        status(lake, "steered")["subranges"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["records"].as_u64().unwrap())
            .sum::<u64>()
    };
    let metric = || {
        get(&format!("http://127.0.0.1:{metrics_port}/metrics"))
            .unwrap_or_default()
            .lines()
            .find(|l| l.starts_with("signalweave_backfill_records_total"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let paused_at = metric();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(metric(), paused_at, "a paused backfill reads nothing");
    // The pause shows as throttled time while it lasts (added every half second).
    let held = stage("throttled") - throttled_at_pause;
    assert!(
        held >= 1.0,
        "paused for 2 s, throttled grew by {held} s:\n{}",
        metrics_text()
    );
    ok(backfill_cmd(&lake, "resume", "steered"));
    wait_until("resumed", Duration::from_secs(10), || metric() > paused_at);
    // A backfill held to 3,000 records a second waits more than it works.
    let (throttled, engine, read) = (stage("throttled"), stage("engine"), stage("read"));
    assert!(
        read + engine > 0.0 && throttled > engine,
        "read {read} s, engine {engine} s, throttled {throttled} s"
    );
    ok(backfill_cmd(&lake, "abort", "steered"));
    let mut runner = runner;
    let status_code = runner.wait_exit(Duration::from_secs(15), "abort");
    assert_eq!(status_code, Some(1), "an aborted backfill exits 1");
    let s = status(&lake, "steered");
    assert_eq!(s["backfill"]["state"], "aborted", "{s}");
    assert!(records(&lake) < 24_000, "aborted before the end");
    let again = backfill_cmd(&lake, "resume", "steered");
    assert_eq!(again.status.code(), Some(3), "{again:?}");

    // SIGTERM stops a run where it stands and leaves it paused, not half-running; a
    // resume finishes it with every window written once.
    let signalled = Proc::spawn(start(&lake, "signalled", &["--records-per-sec", "4000"]));
    wait_until("a sub-range done", Duration::from_secs(30), || {
        try_status(&lake, "signalled").is_some_and(|s| {
            s["subranges"]
                .as_array()
                .unwrap()
                .iter()
                .any(|s| s["state"] == "done")
        })
    });
    let code = signalled.stop_with("-TERM", Duration::from_secs(10));
    assert_eq!(code, Some(1), "an interrupted backfill exits 1");
    let s = status(&lake, "signalled");
    assert_eq!(s["backfill"]["state"], "paused", "{s}");
    assert_eq!(s["running"], false, "{s}");
    assert!(done(&s) < 6, "stopped before the end: {s}");
    let table = sw(&lake)
        .args(["backfill", "status", "--namespace", "signalled"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("paused (resume to continue)"), "{text}");
    ok(backfill_cmd(&lake, "resume", "signalled"));
    let s = status(&lake, "signalled");
    assert_eq!(
        (s["backfill"]["state"].as_str(), done(&s)),
        (Some("completed"), 6),
        "{s}"
    );
    let c = compare(&lake, "signalled");
    for k in ["changed", "missing", "extra"] {
        assert_eq!(c[k], 0, "{k}: {c}");
    }
    assert_eq!(
        count(
            &lake,
            "select count(*) from signalweave.market_aggregates__bf_signalled \
             where output_version <> 1"
        ),
        0,
        "no window written twice"
    );
}

#[test]
fn a_new_version_is_compared_promoted_served_and_rolled_back() {
    let dir = tempfile::tempdir().unwrap();
    let lake = landed_history(dir.path());
    // First, the same version without `--exact-dedup` (no copies here with other event
    // times) and in two key-group ranges per slice: equal to the live outputs, with the
    // same late records, each reported once.
    ok(start(&lake, "split", &["--key-group-splits", "2"])
        .output()
        .unwrap());
    let c = compare(&lake, "split");
    assert!(c["same"].as_u64().unwrap() > 1_000, "{c}");
    for k in ["changed", "missing", "extra", "partial"] {
        assert_eq!(c[k], 0, "{k}: {c}");
    }
    assert_eq!(late_in_range(&lake, "split"), late_in_range(&lake, "live"));
    // Version 2 allows 4 h of lateness: the records version 1 found late now count.
    ok(start(&lake, "fix_lateness", &["--job-version", "2"])
        .output()
        .unwrap());
    let c = compare(&lake, "fix_lateness");
    let live_late = late_in_range(&lake, "live");
    assert_eq!(late_in_range(&lake, "fix_lateness"), 0);
    assert!(c["changed"].as_u64().unwrap() > 0, "{c}");
    let events = c["totals"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["column"] == "events")
        .unwrap();
    assert_eq!(
        events["delta"].as_f64().unwrap() as i64,
        live_late,
        "every record version 1 found late is counted by version 2: {c}"
    );

    // A record committed after the backfill's snapshot: the namespace never read it, and
    // until the live job has found it late, the promotion stops before its window.
    let market_record = |id: &str, at: &str| {
        serde_json::json!({
            "business_version": 1, "customer_id": "c-1", "event_id": id, "event_time": at,
            "event_type": "order_paid", "market_id": "m-0", "order_id": "o-late",
            "partition_key": "m-0",
            "payload": {"amount_minor": 100, "currency": "GBP", "payment_method": "card"},
            "producer_id": "producer-late", "producer_seq": 0, "schema_version": "1.0.0",
            "tenant": "tenant-0"
        })
    };
    let land = |name: &str, record: Value| {
        let file = dir.path().join(name);
        std::fs::write(&file, format!("{record}\n")).unwrap();
        ok(sw(&lake).arg("load").arg(&file).output().unwrap());
    };
    land(
        "unread.ndjson",
        market_record("ev-unread", "2026-01-01T00:30:10Z"),
    );
    // An exact copy of a record the backfill read (a producer's resend) changes nothing:
    // the live job drops it as a duplicate.
    let history = std::fs::read_to_string(dir.path().join("history.ndjson")).unwrap();
    let resent: Value = history
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|e| {
            e["event_type"] == "order_paid"
                && e["event_time"].as_str().unwrap() > "2026-01-01T00:10"
        })
        .unwrap();
    land("resent.ndjson", resent);
    let (_, to, said) = promote(&lake, "fix_lateness");
    assert_eq!(
        chrono::DateTime::parse_from_rfc3339(&to).unwrap(),
        chrono::DateTime::parse_from_rfc3339("2026-01-01T00:30:00Z").unwrap(),
        "{said}"
    );
    assert!(
        said.contains("committed after the backfill's snapshot"),
        "{said}"
    );
    ok(backfill_cmd(&lake, "rollback", "fix_lateness"));
    run_market_aggregates(&lake);
    assert_eq!(
        count(
            &lake,
            "select count(*) from signalweave.late_events where event_id = 'ev-unread' \
             and namespace = 'live'"
        ),
        1
    );

    // Promotion: the current view and the serving API take the range from the namespace,
    // up to where the live job can still correct windows: the history ends at about
    // 03:20, and version 1 allows 2 h of lateness, so later windows stay live and a late
    // record for one of them is served.
    let before_promotion = chrono::Utc::now();
    std::thread::sleep(Duration::from_millis(20));
    let (from, promoted_to, said) = promote(&lake, "fix_lateness");
    assert_eq!(
        chrono::DateTime::parse_from_rfc3339(&from).unwrap(),
        chrono::DateTime::parse_from_rfc3339(FROM).unwrap()
    );
    let promoted_end = chrono::DateTime::parse_from_rfc3339(&promoted_to).unwrap();
    assert!(
        promoted_end > chrono::DateTime::parse_from_rfc3339("2026-01-01T01:10:00Z").unwrap()
            && promoted_end < chrono::DateTime::parse_from_rfc3339("2026-01-01T01:30:00Z").unwrap(),
        "{said}"
    );
    assert!(said.contains("the live job can still correct"), "{said}");
    let by_ns_query = |from: &str, to: &str| {
        format!(
            "select namespace, count(*) n from signalweave.market_aggregates_current \
             where window_start >= '{from}' and window_start < '{to}' group by namespace"
        )
    };
    let by_ns = |lake: &Path| sql(lake, &by_ns_query(FROM, &promoted_to));
    let rows = by_ns(&lake);
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["namespace"], "fix_lateness");
    let after = sql(&lake, &by_ns_query(&promoted_to, TO));
    assert_eq!(after.len(), 1, "{after:?}");
    assert_eq!(after[0]["namespace"], "live");
    // Read as of a moment before it, the view is as it was then.
    let as_of = ok(sw(&lake)
        .args(["sql", &by_ns_query(FROM, TO), "--format", "json", "--as-of"])
        .arg(before_promotion.to_rfc3339())
        .output()
        .unwrap());
    let rows: Vec<Value> = serde_json::from_str(&as_of).unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["namespace"], "live", "{rows:?}");
    let twice = backfill_cmd(&lake, "promote", "fix_lateness");
    assert_eq!(twice.status.code(), Some(3), "{twice:?}");

    let port = support::free_port();
    let base = format!("http://127.0.0.1:{port}");
    let serving = Proc::spawn({
        let mut c = sw(&lake);
        c.args(["run", "--job", "jobs/market_aggregates.toml"])
            .args(["--serve", &format!("127.0.0.1:{port}")]);
        c
    });
    wait_until("serving", Duration::from_secs(30), || {
        get(&format!("{base}/healthz")).is_some()
    });
    let answer = |base: &str| -> Value {
        serde_json::from_str(
            &get(&format!(
                "{base}/v1/jobs/market_aggregates/aggregates?key=m-0&from={FROM}&to={TO}"
            ))
            .unwrap(),
        )
        .unwrap()
    };
    let a = answer(&base);
    assert_eq!(a["promotions"][0]["namespace"], "fix_lateness", "{a}");
    let windows = a["windows"].as_array().unwrap();
    assert!(windows.len() > 100, "{a}");
    let promoted_window = |w: &Value| {
        chrono::DateTime::parse_from_rfc3339(w["window_start"].as_str().unwrap()).unwrap()
            < promoted_end
    };
    assert!(
        windows
            .iter()
            .all(|w| (w["namespace"] == "fix_lateness") == promoted_window(w))
    );
    // A late record for a window after the promotion's end: the live job corrects it, and
    // the correction is served.
    // (Well after the end: the live job's watermark may be a little past its last output's.)
    let unpromoted = windows
        .iter()
        .find(|w| {
            chrono::DateTime::parse_from_rfc3339(w["window_start"].as_str().unwrap()).unwrap()
                >= promoted_end + chrono::Duration::minutes(20)
        })
        .unwrap()
        .clone();
    land(
        "late.ndjson",
        market_record(
            "ev-late-after-promotion",
            unpromoted["window_start"].as_str().unwrap(),
        ),
    );
    let corrected = || {
        answer(&base)["windows"]
            .as_array()?
            .iter()
            .find(|w| w["window_start"] == unpromoted["window_start"])
            .cloned()
    };
    let before_events = unpromoted["events"].as_i64().unwrap();
    wait_until("the correction served", Duration::from_secs(30), || {
        corrected().is_some_and(|w| w["events"].as_i64() == Some(before_events + 1))
    });
    let served = corrected().unwrap();
    assert_eq!(served["namespace"], "live", "{served}");
    assert_eq!(served["completeness"], "corrected", "{served}");
    // The serving version only grows for a window when the namespace serving it changes,
    // although each namespace counts its output versions from 1.
    let promoted = windows[0].clone();
    let live_version = count(
        &lake,
        &format!(
            "select max(output_version) from signalweave.market_aggregates where key = 'm-0' \
             and window_start = '{}'",
            promoted["window_start"].as_str().unwrap()
        ),
    );
    assert!(
        promoted["serving_version"].as_i64().unwrap() > live_version,
        "{promoted} against live version {live_version}"
    );

    ok(backfill_cmd(&lake, "rollback", "fix_lateness"));
    let rows = by_ns(&lake);
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["namespace"], "live");
    let a = answer(&base);
    assert!(a["promotions"].as_array().unwrap().is_empty(), "{a}");
    let back = a["windows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["window_start"] == promoted["window_start"])
        .unwrap();
    assert_eq!(
        back["output_version"].as_i64().unwrap(),
        live_version,
        "{back}"
    );
    assert!(
        back["serving_version"].as_i64().unwrap() > promoted["serving_version"].as_i64().unwrap(),
        "{back} after {promoted}"
    );
    assert!(
        a["windows"]
            .as_array()
            .unwrap()
            .iter()
            .all(|w| w["namespace"] == "live")
    );
    serving.terminate();
    let again = backfill_cmd(&lake, "rollback", "fix_lateness");
    assert_eq!(again.status.code(), Some(2), "{again:?}");
}

/// The worst live queue age in `/v1/status`.
fn live_queue_age(base: &str) -> Option<f64> {
    let statuses: Vec<Value> = serde_json::from_str(&get(&format!("{base}/v1/status"))?).ok()?;
    statuses
        .iter()
        .filter_map(|s| s["oldest_unprocessed_age_s"].as_f64())
        .reduce(f64::max)
}

fn metric_value(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn a_live_burst_takes_the_backfills_capacity_back_and_it_returns_after() {
    let dir = tempfile::tempdir().unwrap();
    let lake = landed_history(dir.path());
    let (gw_port, serve_port, metrics_port) = (
        support::free_port(),
        support::free_port(),
        support::free_port(),
    );
    let gateway = format!("http://127.0.0.1:{gw_port}");
    let base = format!("http://127.0.0.1:{serve_port}");
    let up = Proc::spawn({
        let mut c = sw(&lake);
        // A live job that polls every second: each commit of the burst waits up to that
        // long (longer than 200 ms four times in five), which crosses the backfill's 200 ms
        // queue-age guard; without traffic there is no queue. (At 400 ms, a burst whose few
        // commits all happened to be read within 200 ms never crossed it.)
        c.args(["up", "--job", "jobs/market_aggregates.toml"])
            .args(["--poll-interval", "1s"])
            .args(["--gateway-listen", &format!("127.0.0.1:{gw_port}")])
            .args(["--serve-listen", &format!("127.0.0.1:{serve_port}")]);
        c
    });
    up.wait_log("signalweave up:", Duration::from_secs(60));
    // A slow backfill (1,500 records/s: about 15 s for the range) that pauses under load.
    let guard = 0.2;
    let backfill = Proc::spawn({
        let mut c = start(
            &lake,
            "yielding",
            &[
                "--records-per-sec",
                "1500",
                "--floor-records-per-sec",
                "0",
                "--live-status",
                &format!("{base}/v1/status"),
                "--guard-queue-age",
                "200ms",
                "--clear-hold",
                "2s",
                "--metrics-addr",
                &format!("127.0.0.1:{metrics_port}"),
            ],
        );
        c.env("SIGNALWEAVE_LOG", "signalweave_runner=info");
        c
    });
    let metrics = || get(&format!("http://127.0.0.1:{metrics_port}/metrics")).unwrap_or_default();
    wait_until("the backfill to read", Duration::from_secs(30), || {
        metric_value(&metrics(), "signalweave_backfill_records_total") > 0.0
    });
    // The burst: 15,000 events/s for 4 s into the live path. Small events (about 340 B, not the
    // default 1,200): a dev-build gateway sharing two cores with the other tests of this
    // file accepted about 7,000 events/s, and 1,200-byte events then filled the producer's
    // 64 MiB buffer, which drops events and exits 1; what this test needs is the live job's
    // queue, not bytes.
    let burst = std::thread::spawn({
        let lake = lake.clone();
        move || {
            sw(&lake)
                .args(["produce", "--url", &gateway, "--rate", "15000"])
                .args(["--duration", "4s", "--producer-id", "burst"])
                .args(["--event-size", "300"])
                .output()
                .unwrap()
        }
    });
    let started = Instant::now();
    let mut worst_age = 0.0f64;
    let mut reclaimed_at = None;
    while started.elapsed() < Duration::from_secs(12) {
        if let Some(age) = live_queue_age(&base) {
            worst_age = worst_age.max(age);
        }
        let m = metrics();
        if reclaimed_at.is_none()
            && metric_value(&m, "signalweave_backfill_decisions_total{") > 0.0
            && m.lines().any(|l| l.contains("action=\"reclaim\""))
        {
            reclaimed_at = Some(started.elapsed());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    ok(burst.join().unwrap());
    let log = backfill.log();
    assert!(
        reclaimed_at.is_some(),
        "the burst never crossed the guard: worst queue age {worst_age:.2} s\n{log}"
    );
    assert!(
        log.contains("backfill budget decision")
            && log.contains("reclaim")
            && log.contains("cause"),
        "the decision and its cause are logged: {log}"
    );
    // The live job's queue age crossed the guard (that is what reclaims), and stayed
    // within its service objective (5 s) while the backfill was paused.
    assert!(
        worst_age > guard && worst_age < 5.0,
        "live queue age peaked at {worst_age:.2} s (guard {guard} s)"
    );
    // Capacity comes back, and the backfill completes.
    let mut child = backfill.child;
    let deadline = Instant::now() + Duration::from_secs(90);
    let code = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s.code();
        }
        assert!(Instant::now() < deadline, "the backfill never finished");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(code, Some(0));
    let s = status(&lake, "yielding");
    assert_eq!(s["backfill"]["state"], "completed", "{s}");
    assert!(s["backfill"]["preemptions"].as_u64().unwrap() >= 1, "{s}");
    up.terminate();
}

#[test]
fn backfills_run_on_s3_with_sqlite_and_postgresql_catalogs() {
    for (b, lake) in support::s3_backends() {
        land_history_in(&lake, b.dir.path(), 8_000, false);
        // Killed after a sub-range's commit, then resumed: the lease and the progress rows
        // live in this catalog database.
        let crashed = start(&lake, "resumed", &["--parallelism", "1"])
            .env("SIGNALWEAVE_BACKFILL_FAULT", "1")
            .output()
            .unwrap();
        assert!(
            !crashed.status.success(),
            "{}: the drill did not stop it",
            b.name
        );
        std::thread::sleep(Duration::from_secs(6));
        ok(backfill_cmd(&lake, "resume", "resumed"));
        let c = compare(&lake, "resumed");
        assert!(c["same"].as_u64().unwrap() > 100, "{}: {c}", b.name);
        for k in ["changed", "missing", "extra"] {
            assert_eq!(c[k], 0, "{}: {k}: {c}", b.name);
        }
        assert_eq!(
            late_in_range(&lake, "resumed"),
            late_in_range(&lake, "live"),
            "{}",
            b.name
        );
        // Its 8,000 events end about an hour after the range starts, and the live job
        // allows 2 h of lateness: it can still correct every window, so none is promoted.
        let refused = backfill_cmd(&lake, "promote", "resumed");
        assert_eq!(refused.status.code(), Some(3), "{}: {refused:?}", b.name);
        let said = String::from_utf8_lossy(&refused.stderr);
        assert!(
            said.contains("the live job can still correct"),
            "{}: {said}",
            b.name
        );
        eprintln!("{}: ok", b.name);
    }
}

/// The status of `job`'s backfill in `namespace`.
fn status_of(lake: &Path, job: &str, namespace: &str) -> Value {
    let out = ok(sw(lake)
        .args(["backfill", "status", "--job", job, "--namespace", namespace])
        .args(["--format", "json"])
        .output()
        .unwrap());
    let mut v: Vec<Value> = serde_json::from_str(&out).unwrap();
    v.remove(0)
}

/// Backfills planned before an erasure go on from a snapshot without the erased events:
/// - one resumed while the erasure is stopped before its expiry (its snapshot still
///   there, events appended since) moves by sequence numbers to the erasure's rewrite,
///   not to the current snapshot;
/// - one resumed after the erasure completed (its snapshot expired) moves too, and, once
///   moved, stays when it resumes again, though the stopped run's rewrite has expired;
/// - one whose first sub-range waits to commit when the erasure is recorded leaves the
///   subject's windows out of that commit, then moves.
///
/// Each equals a backfill planned after the erasure, and holds none of the subject's
/// windows. Before, the ones resumed failed on their expired snapshot, and the running
/// one wrote the subject's windows back (30 rows) and then failed.
#[test]
fn backfills_unfinished_at_an_erasure_go_on_from_the_snapshot_it_left() {
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    // 50 minutes of events.
    land_history_in(&lake, dir.path(), 6_000, false);
    let to = "2026-01-01T00:45:00Z";
    let features = |namespace: &str, extra: &[&str]| {
        let mut c = sw(&lake);
        c.args(["backfill", "start", "--job", "customer_features"])
            .args(["--from", FROM, "--to", to, "--namespace", namespace])
            .args(["--slice", "15m", "--quiet"])
            .args(extra);
        c
    };
    let resume = |namespace: &str| {
        ok(sw(&lake)
            .args(["backfill", "resume", "--job", "customer_features"])
            .args(["--namespace", namespace])
            .output()
            .unwrap())
    };
    // Planned (their snapshot pinned) before the erasure, run after it.
    for ns in ["halted", "resumed", "twice"] {
        ok(features(ns, &["--detach"]).output().unwrap());
    }
    let pinned =
        status_of(&lake, "customer_features", "resumed")["backfill"]["snapshot_id"].clone();
    assert!(pinned.is_i64(), "{pinned}");
    // The subject: the customer with the most orders in the first sub-range.
    let subject = sql(
        &lake,
        &format!(
            "select tenant, customer_id, count(*) n from signalweave.events \
             where event_type = 'order_placed' and event_time >= '{FROM}' \
             and event_time < '2026-01-01T00:15:00Z' \
             group by tenant, customer_id order by n desc, customer_id limit 1"
        ),
    );
    let (tenant, customer) = (
        subject[0]["tenant"].as_str().unwrap().to_string(),
        subject[0]["customer_id"].as_str().unwrap().to_string(),
    );
    let key = signalweave_model::join_key(&[tenant.as_str(), customer.as_str()]);
    // Running: its first sub-range read, and waiting for its rows budget (the only budget
    // it has, so its only throttled time), when the erasure comes.
    let metrics_port = support::free_port();
    let mut running = Proc::spawn(features(
        "running",
        &[
            "--write-rows-per-sec",
            "400",
            "--parallelism",
            "1",
            "--metrics-addr",
            &format!("127.0.0.1:{metrics_port}"),
        ],
    ));
    let throttled = || {
        get(&format!("http://127.0.0.1:{metrics_port}/metrics"))
            .unwrap_or_default()
            .lines()
            .filter(|l| {
                l.starts_with("signalweave_backfill_stage_seconds_total{")
                    && l.contains("stage=\"throttled\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    wait_until(
        "the first sub-range waiting for its rows budget",
        Duration::from_secs(60),
        || throttled() > 0.5,
    );
    // The erasure stops after its rewrites and record, before its expiry.
    let stopped = erase_cmd(&lake, &key)
        .env("SIGNALWEAVE_ERASE_FAULT", "before_expiry")
        .output()
        .unwrap();
    assert!(!stopped.status.success(), "{stopped:?}");
    let s = status_of(&lake, "customer_features", "running");
    assert_eq!(
        done(&s),
        0,
        "the first sub-range was to commit after the erasure's record (raise its rows' wait): {s}"
    );
    // An event of the next day lands: the erasure's rewrite is no longer current.
    let history = std::fs::read_to_string(dir.path().join("history.ndjson")).unwrap();
    let mut event: Value = serde_json::from_str(history.lines().next().unwrap()).unwrap();
    event["event_id"] = Value::String("e-appended-after-the-erasure".into());
    event["customer_id"] = Value::String("c-appended".into());
    event["event_time"] = Value::String("2026-01-02T00:00:00Z".into());
    let appended = dir.path().join("appended.ndjson");
    std::fs::write(&appended, format!("{event}\n")).unwrap();
    ok(sw(&lake).arg("load").arg(&appended).output().unwrap());
    // Its snapshot still there, the halted backfill moves by sequence numbers to the
    // rewrite.
    resume("halted");
    let moved = status_of(&lake, "customer_features", "halted")["backfill"]["snapshot_id"].clone();
    assert_ne!(moved, pinned);
    // Run again, the erasure completes: the older snapshots expire.
    ok(erase_cmd(&lake, &key).output().unwrap());
    assert_eq!(
        running.wait_exit(Duration::from_secs(120), "the running backfill"),
        Some(0)
    );
    let log = running.log();
    assert!(log.contains("holds erased events or is gone"), "{log}");
    resume("resumed");
    // Stopped after its first sub-range's commit, then resumed: it moved once, then
    // stays, the stopped run's rewrite expired or not.
    let first = sw(&lake)
        .args(["backfill", "resume", "--job", "customer_features"])
        .args(["--namespace", "twice"])
        .env("SIGNALWEAVE_BACKFILL_FAULT", "1")
        .output()
        .unwrap();
    assert!(!first.status.success(), "{first:?}");
    assert!(
        String::from_utf8_lossy(&first.stderr).contains("holds erased events or is gone"),
        "{first:?}"
    );
    // The stopped process's lease goes stale first.
    std::thread::sleep(Duration::from_secs(6));
    let again = sw(&lake)
        .args(["backfill", "resume", "--job", "customer_features"])
        .args(["--namespace", "twice"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&again.stderr);
    assert!(again.status.success(), "{again:?}");
    assert!(
        !said.contains("holds erased events or is gone"),
        "moved again: {said}"
    );
    // Planned after the erasure.
    ok(features("after", &[]).output().unwrap());
    let current = status_of(&lake, "customer_features", "after")["backfill"]["snapshot_id"].clone();
    assert_ne!(
        moved, current,
        "the halted backfill moved to the rewrite, not to the newest"
    );

    for ns in ["halted", "running", "resumed", "twice", "after"] {
        let s = status_of(&lake, "customer_features", ns);
        assert_eq!(
            (s["backfill"]["state"].as_str(), done(&s)),
            (Some("completed"), 3),
            "{s}"
        );
        assert_ne!(s["backfill"]["snapshot_id"], pinned, "{ns} moved on: {s}");
        assert_eq!(
            count(
                &lake,
                &format!(
                    "select count(*) from signalweave.customer_features__bf_{ns} \
                     where key = '{}'",
                    key.replace('\'', "''")
                )
            ),
            0,
            "{ns} holds none of the subject's windows"
        );
    }
    // Read from the snapshot the erasure left, the backfills resumed equal one planned
    // after it; so do the running one's later sub-ranges. So does its first, read from
    // the older snapshot, but for the subject's windows: the erasure kept the other
    // records where they arrived.
    let rows = |ns: &str| {
        sql(
            &lake,
            &format!(
                "select key, cast(window_start as varchar) s, cast(window_end as varchar) e, \
                 output_version, completeness, order_count, amount_minor_sum, amount_minor_max \
                 from signalweave.customer_features__bf_{ns} order by key, s, output_version"
            ),
        )
    };
    let after = rows("after");
    assert!(after.len() > 1_000, "{}", after.len());
    for ns in ["halted", "resumed", "twice", "running"] {
        assert!(
            rows(ns) == after,
            "{ns} differs from a backfill planned after the erasure"
        );
    }
}

/// An erasure rewrites each data file holding its subject into files that keep its data
/// sequence number, so the other records stay where they arrived: a backfill after it
/// judges the same records late as one before it, and as the live job did. (Given the
/// erasure's commit's sequence number, the rewritten files of a bulk load, whose chunks
/// share one ingest time, came last in the order of arrival: their records were judged
/// against the watermark of the whole load.)
#[test]
fn an_erasure_keeps_the_other_records_where_they_arrived() {
    let dir = tempfile::tempdir().unwrap();
    let lake = landed_history(dir.path());
    ok(start(&lake, "before", &[]).output().unwrap());
    let subject = sql(
        &lake,
        &format!(
            "select tenant, customer_id, count(*) n from signalweave.events \
             where event_time >= '{FROM}' and event_time < '{TO}' \
             group by tenant, customer_id order by n desc, customer_id limit 1"
        ),
    );
    let key = signalweave_model::join_key(&[
        subject[0]["tenant"].as_str().unwrap(),
        subject[0]["customer_id"].as_str().unwrap(),
    ]);
    ok(erase_cmd(&lake, &key).output().unwrap());
    ok(start(&lake, "after", &[]).output().unwrap());
    let late = |namespace: &str| {
        sql(
            &lake,
            &format!(
                "select tenant, event_id from signalweave.late_events \
                 where job = 'market_aggregates' and namespace = '{namespace}' \
                 and event_time >= '{FROM}' and event_time < '{TO}' order by tenant, event_id"
            ),
        )
    };
    let before = late("before");
    assert!(
        before.len() > 20,
        "the fixture has events beyond 2 h: {}",
        before.len()
    );
    assert!(
        late("after") == before,
        "the same records are late after the erasure"
    );
    assert!(late("live") == before, "as they were for the live job");
}
