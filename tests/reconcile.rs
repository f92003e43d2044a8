//! Reconciliation reports and the capacity model, as an auditor runs them.
//!
//! A history with late events (some beyond allowed lateness), duplicates that land (a
//! second load repeats events of the first) and rejected records is processed by the live
//! job; `signalweave reconcile` then finds every window equal to its oracle and balances
//! the accounting (exit 0). A deliberately wrong output version appended by the test is
//! found (exit 1). The HTML report is rendered by headless Chromium, which must find the
//! four plots drawn. A backfill namespace is reconciled before promotion. `signalweave
//! plan` reproduces the reference figures exactly, and takes measured figures from a
//! running `signalweave up`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use signalweave_lake::{CommitIdentity, Lake, LakeConfig};
use signalweave_window::{AggValue, Completeness, Emissions, JobSpec, OutputRow};
use support::cli::{Proc, count, ok, run_market_aggregates, sql, sw, wait_until};

const FROM: &str = "2026-01-01T00:00:00Z";
const TO: &str = "2026-01-01T04:00:00Z";

/// Lines that the load must reject, each for its own reason.
const BAD_LINES: [&str; 3] = [
    "{\"this is\": not json",
    r#"{"business_version":1,"customer_id":"c-1","event_id":"ev-bad-1","event_time":"2026-01-01T01:00:00Z","event_type":"order_teleported","market_id":"m-1","order_id":"o-x","partition_key":"m-1","payload":{},"producer_id":"producer-1-0","producer_seq":1,"schema_version":"1.0.0","tenant":"tenant-1"}"#,
    r#"{"business_version":1,"customer_id":"c-1","event_id":"ev-bad-2","event_time":"2026-01-01T01:00:00Z","event_type":"order_paid","market_id":"m-1","order_id":"o-y","partition_key":"m-1","payload":{"currency":"USD","payment_method":"card"},"producer_id":"producer-1-0","producer_seq":2,"schema_version":"1.0.0","tenant":"tenant-1"}"#,
];

/// About 3.3 hours of event time (3 % late, some beyond the 2 h lateness), with three
/// rejected lines in the middle, loaded in commits of 500; then 400 of its events again
/// from a second file (they land: a load drops repeats within its own file only), and five
/// stamped 200 minutes later; then the live job reads it one commit per step.
fn history(dir: &Path) -> PathBuf {
    let lake = dir.join("lake");
    let file = dir.join("history.ndjson");
    ok(sw(&lake)
        .args(["fixtures", "generate", "--out"])
        .arg(&file)
        .args([
            "--events",
            "24000",
            "--events-per-sec",
            "2",
            "--late-fraction",
            "0.03",
            "--dup-fraction",
            "0.0",
        ])
        .output()
        .unwrap());
    let text = std::fs::read_to_string(&file).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    let mut repeats: Vec<String> = lines.iter().step_by(60).map(|l| l.to_string()).collect();
    // Copies stamped 3 h 20 min after their first copy (a producer that stamps at send and
    // sends again after a restart): beyond the dedup horizon (3 h 1 min for
    // market_aggregates), so the job counts them again, and the oracle must too.
    for line in lines.iter().skip(7).step_by(97).take(5) {
        let mut event: Value = serde_json::from_str(line).unwrap();
        let t = chrono::DateTime::parse_from_rfc3339(event["event_time"].as_str().unwrap())
            .unwrap()
            + chrono::Duration::minutes(200);
        event["event_time"] = t
            .with_timezone(&chrono::Utc)
            .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
            .into();
        repeats.push(event.to_string());
    }
    for (i, bad) in BAD_LINES.iter().enumerate() {
        lines.insert(5_000 + i * 3_000, bad);
    }
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let load = ok(sw(&lake)
        .arg("load")
        .arg(&file)
        .args(["--chunk-records", "500", "--format", "json"])
        .output()
        .unwrap());
    assert!(load.contains("rejected"), "{load}");
    let again = dir.join("repeats.ndjson");
    std::fs::write(&again, repeats.join("\n") + "\n").unwrap();
    ok(sw(&lake)
        .arg("load")
        .arg(&again)
        .args(["--chunk-records", "100"])
        .output()
        .unwrap());
    ok(sw(&lake)
        .args([
            "run",
            "--job",
            "jobs/market_aggregates.toml",
            "--job",
            "jobs/customer_features.toml",
            "--job",
            "jobs/withdrawals.toml",
            "--until-caught-up",
            "--max-snapshots-per-step",
            "1",
        ])
        .output()
        .unwrap());
    lake
}

/// Runs `reconcile` of market_aggregates; returns the exit code and the JSON report.
fn reconcile(lake: &Path, out: &Path, namespace: &str) -> (i32, Value) {
    reconcile_job(lake, out, "market_aggregates", namespace)
}

fn reconcile_job(lake: &Path, out: &Path, job: &str, namespace: &str) -> (i32, Value) {
    let o = sw(lake)
        .args([
            "reconcile",
            "--job",
            job,
            "--from",
            FROM,
            "--to",
            TO,
            "--namespace",
            namespace,
            "--out",
        ])
        .arg(out)
        .output()
        .unwrap();
    let code = o.status.code().unwrap_or(-1);
    assert!(
        code == 0 || code == 1,
        "exit {code}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let json = std::fs::read_to_string(out.join("report.json")).unwrap();
    (code, serde_json::from_str(&json).unwrap())
}

/// The kinds of a report's findings.
fn finding_kinds(r: &Value) -> Vec<&str> {
    r["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["kind"].as_str().unwrap())
        .collect()
}

fn u(v: &Value, path: &str) -> u64 {
    v.pointer(path)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("no {path} in {v}"))
}

/// Appends one more version of an existing window with one event too many.
fn tamper(lake: &Path) -> (String, String) {
    tamper_with(lake, 0, 1, Completeness::Corrected, 1, 1)
}

/// Appends a version of the `nth` closed window of the live outputs (from 01:00, by start
/// and key): its current version plus `step`, with `completeness`, and its events and
/// `placed_count` plus `more`, under commit `commit`.
fn tamper_with(
    lake: &Path,
    nth: usize,
    step: u32,
    completeness: Completeness,
    more: i64,
    commit: u64,
) -> (String, String) {
    let spec = JobSpec::from_file(support::repo().join("jobs/market_aggregates.toml")).unwrap();
    let row = &sql(
        lake,
        &format!(
            "SELECT key, CAST(window_start AS BIGINT) AS ws, CAST(window_end AS BIGINT) AS we, output_version, \
             events, placed_count, placed_amount_minor, paid_count, paid_amount_minor, cancelled_count, \
             cancelled_amount_minor FROM signalweave.market_aggregates_current \
             WHERE window_start >= TIMESTAMP '2026-01-01T01:00:00Z' ORDER BY window_start, key \
             LIMIT 1 OFFSET {nth}"
        ),
    )[0];
    let i = |k: &str| row[k].as_i64();
    let value = |k: &str| i(k).map(AggValue::Int).unwrap_or(AggValue::Null);
    let out = OutputRow {
        key: row["key"].as_str().unwrap().into(),
        window_start: i("ws").unwrap(),
        window_end: i("we").unwrap(),
        output_version: i("output_version").unwrap() as u32 + step,
        completeness,
        retracted: false,
        watermark: i("we").unwrap(),
        emitted_at: i("we").unwrap(),
        first_event_time: i("ws").unwrap(),
        last_event_time: i("ws").unwrap(),
        events: i("events").unwrap() + more,
        values: vec![
            AggValue::Int(i("placed_count").unwrap() + more),
            value("placed_amount_minor"),
            value("paid_count"),
            value("paid_amount_minor"),
            value("cancelled_count"),
            value("cancelled_amount_minor"),
        ],
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let lake = Lake::open(LakeConfig::embedded(lake)).await.unwrap();
        let table = signalweave_runner::output_table(&spec, "live").unwrap();
        let batch = Emissions::from_iter([out.clone()])
            .to_batch(&spec, "live", &[None])
            .unwrap();
        let batch =
            arrow::array::RecordBatch::try_new(table.arrow_schema(), batch.columns().to_vec())
                .unwrap();
        lake.append(table, &[batch], &CommitIdentity::new("test-tamper", commit))
            .await
            .unwrap();
    });
    (out.key.to_string(), row["ws"].to_string())
}

/// The Chromium binary Debian installs, if any.
fn chromium() -> Option<PathBuf> {
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .find_map(|name| {
            let out = Command::new("which").arg(name).output().ok()?;
            out.status
                .success()
                .then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
        })
}

#[test]
fn reconcile_balances_finds_a_wrong_version_and_renders_its_plots() {
    let dir = tempfile::tempdir().unwrap();
    let lake = history(dir.path());
    let report_dir = dir.path().join("report");
    let (code, r) = reconcile(&lake, &report_dir, "live");
    assert_eq!(code, 0, "findings: {}", r["findings"]);
    assert_eq!(r["matches"], true);
    // Every window compared equals its oracle.
    assert!(u(&r, "/windows/compared") > 500, "{}", r["windows"]);
    assert_eq!(
        u(&r, "/windows/mismatched") + u(&r, "/windows/missing") + u(&r, "/windows/extra"),
        0
    );
    // The accounting balances, with every kind of fate present.
    let a = &r["accounting"];
    assert_eq!(a["balanced"], true, "{a}");
    assert_eq!(u(a, "/unaccounted"), 0);
    let landed = count(
        &lake,
        &format!(
            "SELECT count(*) FROM signalweave.events WHERE event_time >= TIMESTAMP '{FROM}' AND event_time < TIMESTAMP '{TO}'"
        ),
    ) as u64;
    assert_eq!(u(a, "/landed"), landed);
    assert_eq!(
        u(a, "/counted")
            + u(a, "/pending")
            + u(a, "/duplicates")
            + u(a, "/late")
            + u(a, "/out_of_scope"),
        landed
    );
    assert_eq!(u(a, "/received"), landed + u(a, "/rejected"));
    assert!(u(a, "/duplicates") > 100, "{a}");
    assert!(u(a, "/late") > 50, "{a}");
    assert!(u(a, "/out_of_scope") > 0, "{a}");
    assert_eq!(u(a, "/rejected"), 3, "{a}");
    assert_eq!(a["rejected_by_reason"].as_object().unwrap().len(), 3, "{a}");
    // Counted events are those of the current versions, but for windows not final yet
    // (their outputs may count fewer: the job's watermark has not passed them).
    let in_outputs = count(
        &lake,
        &format!(
            "SELECT CAST(sum(events) AS BIGINT) FROM signalweave.market_aggregates_current \
             WHERE window_start >= TIMESTAMP '{FROM}' AND window_start < TIMESTAMP '{TO}'"
        ),
    ) as u64;
    assert!(
        u(a, "/counted") <= in_outputs && in_outputs <= u(a, "/counted") + u(a, "/pending"),
        "{in_outputs} in outputs; {a}"
    );
    assert!(u(a, "/pending") < 1_000, "{a}");
    // Late: the oracle's late events are exactly the job's late_events.
    assert_eq!(u(&r, "/late/oracle_late"), u(&r, "/late/routed_late"));
    // Each duplicate names its twin.
    let dup = &r["duplicates"][0];
    assert!(
        dup["twin_ingest_time"].as_str().unwrap() < dup["duplicate_ingest_time"].as_str().unwrap()
    );
    // Version history with input snapshots: some window went provisional → on_time → corrected.
    let versions = r["versions"].as_array().unwrap();
    assert!(versions.iter().any(|w| {
        let v = w["versions"].as_array().unwrap();
        v.len() >= 3
            && v.iter().all(|e| e["input_snapshot"].is_i64())
            && v.iter().any(|e| e["completeness"] == "corrected")
    }));
    for f in ["report.html", "report.md", "report.json"] {
        assert!(report_dir.join(f).exists(), "{f}");
    }
    let md = std::fs::read_to_string(report_dir.join("report.md")).unwrap();
    assert!(
        md.contains("MATCH") && md.contains("Balanced: **yes**"),
        "{md}"
    );

    // Headless Chromium lays the page out and finds the four plots drawn.
    match chromium() {
        Some(bin) => {
            let profile = dir.path().join("chromium-profile");
            let out = Command::new(bin)
                .args([
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                ])
                .arg(format!("--user-data-dir={}", profile.display()))
                .args(["--virtual-time-budget=5000", "--dump-dom"])
                .arg(format!(
                    "file://{}",
                    report_dir.join("report.html").display()
                ))
                .output()
                .unwrap();
            let dom = String::from_utf8_lossy(&out.stdout);
            assert!(
                dom.contains("data-plots-rendered=\"4\""),
                "chromium: {}\n{}",
                String::from_utf8_lossy(&out.stderr),
                dom.chars().take(2000).collect::<String>()
            );
            for id in [
                "plot-freshness",
                "plot-late",
                "plot-versions",
                "plot-mismatches",
            ] {
                assert!(dom.contains(&format!("id=\"{id}\"")), "{id}");
            }
        }
        None if support::required() => panic!("chromium is required (apt-get install chromium)"),
        None => eprintln!("skipped: chromium is not installed"),
    }

    // After a compaction of the landing table (the small files of many commits merged
    // into one per day), the oracle still replays each row in its own commit: the same
    // match, with the same late records and the same accounting.
    let compacted = ok(sw(&lake)
        .args(["lake", "compact", "--table", "events", "--min-files", "2"])
        .args(["--format", "json"])
        .output()
        .unwrap());
    let compacted: Value = serde_json::from_str(&compacted).unwrap();
    let merged: Vec<u64> = compacted[0]["files"]
        .as_str()
        .unwrap()
        .split(" -> ")
        .map(|n| n.parse().unwrap())
        .collect();
    assert!(merged[0] > 10 && merged[1] < merged[0], "{compacted}");
    let (code, after) = reconcile(&lake, &dir.path().join("report-compacted"), "live");
    assert_eq!(
        code, 0,
        "after compaction ({compacted}): {}",
        after["findings"]
    );
    assert_eq!(after["windows"], r["windows"]);
    assert_eq!(after["accounting"], r["accounting"]);
    assert_eq!(after["late"], r["late"]);
    // The same duplicates, each with the same twin (listed in another order).
    let pairs = |r: &Value| {
        let mut p: Vec<String> = r["duplicates"]
            .as_array()
            .unwrap()
            .iter()
            .map(Value::to_string)
            .collect();
        p.sort();
        p
    };
    assert!(
        pairs(&after) == pairs(&r),
        "other duplicates after compaction"
    );

    // A deliberately wrong output version is found: exit 1, the window named.
    let (key, ws) = tamper(&lake);
    let (code, r) = reconcile(&lake, &dir.path().join("report-wrong"), "live");
    assert_eq!(code, 1);
    assert_eq!(r["matches"], false);
    assert_eq!(u(&r, "/windows/mismatched"), 1, "{}", r["windows"]);
    let d = &r["differences"][0];
    assert_eq!(d["key"], key.as_str());
    assert_eq!(d["status"], "mismatched");
    let cols: Vec<&str> = d["columns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c[0].as_str().unwrap())
        .collect();
    assert_eq!(cols, ["events", "placed_count"], "{d}");
    let kinds = finding_kinds(&r);
    assert!(
        kinds.contains(&"window_mismatch") && kinds.contains(&"unaccounted_events"),
        "{kinds:?}"
    );
    assert!(u(&r, "/accounting/unaccounted") > 0);
    assert_eq!(r["accounting"]["balanced"], false);
    let _ = ws;
    let html = std::fs::read_to_string(dir.path().join("report-wrong/report.html")).unwrap();
    assert!(html.contains("MISMATCH") && html.contains(&key));

    // A closed window whose current version is provisional (its final version lost), and
    // a version written twice, are found too, whatever their values.
    let (stale, _) = tamper_with(&lake, 1, 1, Completeness::Provisional, 0, 2);
    tamper_with(&lake, 2, 0, Completeness::OnTime, 0, 3);
    let (code, r) = reconcile(&lake, &dir.path().join("report-stale"), "live");
    assert_eq!(code, 1);
    assert_eq!(u(&r, "/windows/mismatched"), 1, "{}", r["windows"]);
    assert_eq!(u(&r, "/windows/not_final"), 1, "{}", r["windows"]);
    assert_eq!(u(&r, "/windows/versions_repeated"), 1, "{}", r["windows"]);
    let stale_row = r["differences"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["status"] == "not_final")
        .unwrap();
    assert_eq!(stale_row["key"], stale.as_str(), "{stale_row}");
    assert_eq!(stale_row["completeness"], "provisional", "{stale_row}");
    let kinds = finding_kinds(&r);
    assert!(
        kinds.contains(&"window_not_final") && kinds.contains(&"version_repeated"),
        "{kinds:?}"
    );

    // A backfill namespace, before its promotion.
    ok(sw(&lake)
        .args([
            "backfill",
            "start",
            "--job",
            "market_aggregates",
            "--from",
            FROM,
            "--to",
            TO,
            "--namespace",
            "audit_me",
            "--slice",
            "1h",
            "--quiet",
        ])
        .output()
        .unwrap());
    let (code, r) = reconcile(&lake, &dir.path().join("report-bf"), "audit_me");
    assert_eq!(code, 0, "findings: {} {}", r["findings"], r["late"]);
    assert_eq!(r["output_table"], "market_aggregates__bf_audit_me");
    assert!(u(&r, "/windows/matched") > 500);
    let r_backfill = r;

    // Sliding windows (customer_features) and session windows (withdrawals, late events
    // bridging sessions included) reconcile too.
    for job in ["customer_features", "withdrawals"] {
        let (code, r) = reconcile_job(
            &lake,
            &dir.path().join(format!("report-{job}")),
            job,
            "live",
        );
        assert_eq!(code, 0, "{job}: {} {}", r["findings"], r["windows"]);
        assert!(u(&r, "/windows/matched") > 100, "{job}: {}", r["windows"]);
        assert_eq!(r["accounting"]["balanced"], true, "{job}");
    }

    // Bad input: a classified error, exit 2, no report.
    let o = sw(&lake)
        .args([
            "reconcile",
            "--job",
            "market_aggregates",
            "--from",
            TO,
            "--to",
            FROM,
            "--out",
        ])
        .arg(dir.path().join("report-bad"))
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o = sw(&lake)
        .args([
            "reconcile",
            "--job",
            "nosuchjob",
            "--from",
            FROM,
            "--to",
            TO,
            "--out",
        ])
        .arg(dir.path().join("report-bad"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let o = sw(&lake)
        .args([
            "reconcile",
            "--job",
            "market_aggregates",
            "--from",
            "yesterday",
            "--to",
            TO,
            "--out",
        ])
        .arg(dir.path().join("report-bad"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("RFC 3339"));
    assert!(!dir.path().join("report-bad").exists());

    // An event landed after the backfill read its snapshot is not held against it: the
    // oracle reads the snapshot the backfill read.
    let pinned = r_backfill["rule"]["events_snapshot"].clone();
    let after = dir.path().join("after.ndjson");
    let history = std::fs::read_to_string(dir.path().join("history.ndjson")).unwrap();
    let mut event: Value = serde_json::from_str(history.lines().nth(100).unwrap()).unwrap();
    event["event_id"] = "ev-after-1".into();
    event["event_time"] = "2026-01-01T01:30:00Z".into();
    std::fs::write(&after, event.to_string() + "\n").unwrap();
    let landed: Value = serde_json::from_str(&ok(sw(&lake)
        .arg("load")
        .arg(&after)
        .args(["--format", "json"])
        .output()
        .unwrap()))
    .unwrap();
    assert_eq!(landed["accepted"], 1, "{landed}");
    let (code, r) = reconcile(&lake, &dir.path().join("report-bf-after"), "audit_me");
    assert_eq!(code, 0, "findings: {} {}", r["findings"], r["late"]);
    assert_eq!(r["rule"]["events_snapshot"], pinned);
}

/// A window the job has not closed is not compared, even where its provisional values
/// equal the oracle's: it is pending, and a range of such windows alone is NOTHING FINAL,
/// not a MATCH.
#[test]
fn windows_not_final_are_pending_not_matched() {
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let file = dir.path().join("events.ndjson");
    // About 16 minutes of event time from 00:00, nothing late; the job's watermark stops
    // a few seconds short of the last event, inside the minute starting 00:16.
    ok(sw(&lake)
        .args(["fixtures", "generate", "--out"])
        .arg(&file)
        .args([
            "--events",
            "2000",
            "--events-per-sec",
            "2",
            "--late-fraction",
            "0",
            "--dup-fraction",
            "0",
        ])
        .output()
        .unwrap());
    ok(sw(&lake)
        .arg("load")
        .arg(&file)
        .args(["--chunk-records", "200"])
        .output()
        .unwrap());
    // The shipped job, but with an early result after every commit read: the windows
    // still open at the end have provisional versions, equal to the oracle's so far.
    let spec = dir.path().join("market_aggregates.toml");
    let text = std::fs::read_to_string(support::repo().join("jobs/market_aggregates.toml"))
        .unwrap()
        .replace("early_every = \"20s\"", "early_every = \"1ms\"");
    std::fs::write(&spec, text).unwrap();
    ok(sw(&lake)
        .args(["run", "--job"])
        .arg(&spec)
        .args(["--until-caught-up", "--max-snapshots-per-step", "1"])
        .output()
        .unwrap());
    let open = count(
        &lake,
        "SELECT count(*) FROM signalweave.market_aggregates_current \
         WHERE completeness = 'provisional'",
    ) as u64;
    assert!(open > 0, "the last minute's windows are still open");
    let run =
        |from: &str, to: &str, out: &str| reconcile_range(&lake, from, to, &dir.path().join(out));
    // The open windows alone.
    let (o, r) = run("2026-01-01T00:16:00Z", "2026-01-01T01:00:00Z", "open");
    assert_eq!(o.status.code(), Some(0), "{}", r["findings"]);
    assert_eq!(u(&r, "/windows/matched"), 0, "{}", r["windows"]);
    assert_eq!(u(&r, "/windows/pending"), open, "{}", r["windows"]);
    let verdict = |o: &std::process::Output| {
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        out.lines()
            .find(|l| l.contains("verdict"))
            .map(|l| l.to_string())
            .unwrap_or_else(|| panic!("no verdict in {out}"))
    };
    assert!(verdict(&o).contains("nothing final"), "{}", verdict(&o));
    let md = std::fs::read_to_string(dir.path().join("open/report.md")).unwrap();
    assert!(md.contains("NOTHING FINAL"), "{md}");
    // With the closed ones before them: those match, the open ones stay pending.
    let (o, r) = run("2026-01-01T00:10:00Z", "2026-01-01T01:00:00Z", "both");
    assert_eq!(o.status.code(), Some(0), "{}", r["findings"]);
    assert!(u(&r, "/windows/matched") > 0, "{}", r["windows"]);
    assert_eq!(u(&r, "/windows/pending"), open, "{}", r["windows"]);
    assert!(verdict(&o).contains(" match "), "{}", verdict(&o));
}

/// The oracle's sums are exact. Three orders of one market and minute whose amounts add
/// up past the range of a 64-bit integer make a sum the output cannot hold (the engine's
/// wraps): that window is a mismatch, with the exact sum beside the output's, and every
/// other window matches. And a job that has written nothing is not NOTHING FINAL: its
/// windows are a `no_outputs` finding.
#[test]
fn a_sum_past_64_bits_and_a_job_that_wrote_nothing_are_findings() {
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let file = dir.path().join("events.ndjson");
    ok(sw(&lake)
        .args(["fixtures", "generate", "--out"])
        .arg(&file)
        .args([
            "--events",
            "2000",
            "--events-per-sec",
            "2",
            "--late-fraction",
            "0",
            "--dup-fraction",
            "0",
        ])
        .output()
        .unwrap());
    let mut events: Vec<Value> = std::fs::read_to_string(&file)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // The first market and minute (of the first ten) with three orders placed.
    let minute = |e: &Value| e["event_time"].as_str().unwrap()[..16].to_string();
    let mut seen: std::collections::HashMap<(String, String), Vec<usize>> = Default::default();
    for (i, e) in events.iter().enumerate() {
        if e["event_type"] == "order_placed" && minute(e).as_str() < "2026-01-01T00:10" {
            seen.entry((e["market_id"].as_str().unwrap().to_string(), minute(e)))
                .or_default()
                .push(i);
        }
    }
    let (market, at) = seen
        .iter()
        .filter(|(_, v)| v.len() >= 3)
        .map(|(k, _)| k.clone())
        .min()
        .expect("a market and minute with three orders placed");
    for &i in &seen[&(market.clone(), at.clone())][..3] {
        events[i]["payload"]["amount_minor"] = Value::from(4_000_000_000_000_000_000_i64);
    }
    let text: String = events.iter().map(|e| e.to_string() + "\n").collect();
    std::fs::write(&file, text).unwrap();
    ok(sw(&lake)
        .arg("load")
        .arg(&file)
        .args(["--chunk-records", "200"])
        .output()
        .unwrap());
    let run =
        |from: &str, to: &str, out: &str| reconcile_range(&lake, from, to, &dir.path().join(out));
    // Before the job has run: the last minute's window, which the events have not
    // closed yet, is pending (a job that emits on time only has written nothing for it).
    let (o, open) = run("2026-01-01T00:16:00Z", "2026-01-01T00:17:00Z", "open");
    assert_eq!(o.status.code(), Some(0), "{}", open["findings"]);
    assert!(u(&open, "/windows/pending") > 0, "{}", open["windows"]);
    // The closed ones are a finding.
    let (o, r) = run("2026-01-01T00:00:00Z", "2026-01-01T00:10:00Z", "before");
    assert_eq!(o.status.code(), Some(1), "{}", r["findings"]);
    assert_eq!(finding_kinds(&r), ["no_outputs"], "{}", r["findings"]);
    assert!(u(&r, "/findings/0/count") > 0, "{}", r["findings"]);
    // After.
    run_market_aggregates(&lake);
    let (o, r) = run("2026-01-01T00:00:00Z", "2026-01-01T00:10:00Z", "after");
    assert_eq!(o.status.code(), Some(1), "{}", r["findings"]);
    assert_eq!(u(&r, "/windows/mismatched"), 1, "{}", r["windows"]);
    assert!(u(&r, "/windows/matched") > 0, "{}", r["windows"]);
    let d = &r["differences"][0];
    assert_eq!(d["key"], market.as_str(), "{d}");
    assert!(d["window_start"].as_str().unwrap().starts_with(&at), "{d}");
    let column = d["columns"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c[0] == "placed_amount_minor")
        .unwrap_or_else(|| panic!("{d}"));
    let exact = column[2].as_f64().unwrap();
    assert!(exact >= 1.2e19, "the oracle's sum is exact: {column}");
    assert!(
        column[1].as_f64().unwrap() < 0.0,
        "the output's wrapped: {column}"
    );
}

/// `reconcile` of market_aggregates over `[from, to)`, its report written to `out`: the
/// process's output and the JSON report.
/// Commits out of the order of their stamps (a gateway's group stamped before another's
/// and committed after it, a second gateway, a resumed load): the live job reads them in
/// commit order, and so do the oracle and a backfill. A record the commit before it made
/// late is late for all three.
#[test]
fn records_are_judged_in_commit_order_not_by_their_stamps() {
    use signalweave_model::{
        Event, EventBatchBuilder, EventId, ProducerId, SchemaVersion, TenantId,
    };
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let minute = 60_000_000_i64;
    let t0 = 1_767_225_600_000_000_i64; // 2026-01-01T00:00:00Z
    let event = |id: &str, market: &str, t: i64, ingest: i64| Event {
        event_id: EventId::new(id.to_string()),
        event_type: "order_placed".into(),
        schema_version: SchemaVersion::new(1, 0, 0),
        tenant: TenantId::new("tenant-0"),
        producer_id: ProducerId::new("p"),
        producer_seq: 0,
        event_time_us: t,
        ingest_time_us: ingest,
        partition_key: market.to_string(),
        order_id: Some(format!("o-{id}")),
        customer_id: Some("c-1".into()),
        market_id: Some(market.to_string()),
        business_version: 1,
        amount_minor: Some(100),
        currency: Some("EUR".into()),
        attributes: None,
    };
    let commits = [
        // Commit 1, stamped at 05:00: events until 03:00.
        (0..60)
            .map(|i| {
                event(
                    &format!("a{i}"),
                    "m-1",
                    t0 + i * 3 * minute,
                    t0 + 300 * minute,
                )
            })
            .collect::<Vec<_>>(),
        // Commit 2, stamped earlier (04:00) but committed after: a record at 00:30, whose
        // window retired (00:31 + 2 h) by commit 1's watermark, and one at 02:30.
        vec![
            event("b0", "m-2", t0 + 30 * minute, t0 + 240 * minute),
            event("b1", "m-2", t0 + 150 * minute, t0 + 240 * minute),
        ],
    ];
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let lake = Lake::open(LakeConfig::embedded(&lake)).await.unwrap();
        lake.init().await.unwrap();
        for (i, events) in commits.iter().enumerate() {
            let mut b = EventBatchBuilder::with_capacity(events.len());
            for e in events {
                b.push(e);
            }
            lake.append(
                signalweave_lake::LakeTable::Events,
                &[b.finish().unwrap()],
                &CommitIdentity::new("out-of-order", i as u64),
            )
            .await
            .unwrap();
        }
    });
    run_market_aggregates(&lake);
    let late = |namespace: &str| {
        sql(
            &lake,
            &format!(
                "select event_id from signalweave.late_events where namespace = '{namespace}' \
                 order by event_id"
            ),
        )
    };
    assert_eq!(late("live").len(), 1, "{:?}", late("live"));
    assert_eq!(late("live")[0]["event_id"], "b0");
    let (o, r) = reconcile_range(
        &lake,
        "2026-01-01T00:00:00Z",
        "2026-01-01T03:00:00Z",
        &dir.path().join("report"),
    );
    assert_eq!(o.status.code(), Some(0), "{}", r["findings"]);
    assert_eq!(r["matches"], true, "{}", r["findings"]);
    assert!(u(&r, "/windows/matched") > 0, "{}", r["windows"]);
    // A backfill judges it late too, and equals the live outputs.
    ok(sw(&lake)
        .args(["backfill", "start", "--job", "market_aggregates"])
        .args([
            "--from",
            "2026-01-01T00:00:00Z",
            "--to",
            "2026-01-01T03:00:00Z",
        ])
        .args(["--namespace", "again", "--quiet"])
        .output()
        .unwrap());
    assert_eq!(late("again"), late("live"));
    let compared = ok(sw(&lake)
        .args(["backfill", "compare", "--job", "market_aggregates"])
        .args(["--namespace", "again", "--format", "json"])
        .output()
        .unwrap());
    let c: Value = serde_json::from_str(&compared).unwrap();
    for k in ["changed", "missing", "extra"] {
        assert_eq!(c[k], 0, "{k}: {c}");
    }
}

fn reconcile_range(lake: &Path, from: &str, to: &str, out: &Path) -> (std::process::Output, Value) {
    let o = sw(lake)
        .args(["reconcile", "--job", "market_aggregates"])
        .args(["--from", from, "--to", to, "--out"])
        .arg(out)
        .output()
        .unwrap();
    let json = std::fs::read_to_string(out.join("report.json")).unwrap();
    (o, serde_json::from_str(&json).unwrap())
}

fn plan_json(args: &[&str]) -> (i32, Value) {
    let o = sw(Path::new("unused"))
        .args(["plan", "--sheet"])
        .arg(support::repo().join("fixtures/slo-sheet.toml"))
        .args(["--format", "json"])
        .args(args)
        .output()
        .unwrap();
    let v = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stderr)));
    (o.status.code().unwrap_or(-1), v)
}

fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or_else(|| panic!("no {k}"))
}

#[test]
fn plan_reproduces_the_reference_figures() {
    let (code, p) = plan_json(&[]);
    assert_eq!(code, 0, "{p}");
    const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
    const MIB: f64 = 1024.0 * 1024.0;
    assert_eq!(f(&p, "ledger_total_s"), 300.0);
    assert_eq!(f(&p, "burst_backlog_records"), 72_000_000.0);
    assert_eq!(f(&p, "burst_drain_s"), 80.0 * 60.0);
    assert_eq!(f(&p, "scale_backlog_records"), 2_400_000.0);
    assert_eq!(f(&p, "scale_catch_up_s"), 240.0);
    let r2 = |x: f64| (x * 100.0).round() / 100.0;
    assert_eq!(r2(f(&p, "retained_bytes") / GIB), 350.19);
    assert_eq!(
        (f(&p, "retained_bytes_all_copies") / GIB / 1024.0 * 1000.0).round() / 1000.0,
        1.026
    );
    assert_eq!(r2(f(&p, "ingest_bytes_per_s") / MIB), 58.59);
    assert_eq!(r2(f(&p, "replica_bytes_per_s") / MIB), 175.78);
    assert_eq!(r2(f(&p, "shuffle_bytes_per_s") / MIB), 23.44);
    assert_eq!(r2(f(&p, "sink_bytes_per_s") / MIB), 17.09);
    assert_eq!(r2(f(&p, "state_bytes") / GIB), 13.41);
    assert_eq!(r2(f(&p, "state_bytes_checkpointed") / GIB), 26.82);
    assert_eq!(r2(f(&p, "backfill_at_floor_s") / 3600.0), 44.44);
    assert_eq!(r2(f(&p, "backfill_borrowing_s") / 3600.0), 12.12);
    // Every objective holds at the sheet's load; the burst drain is the first to fail.
    assert!(
        p["objectives"]
            .as_array()
            .unwrap()
            .iter()
            .all(|o| o["holds"] == true)
    );
    assert_eq!(p["fails_first"], "burst backlog drains");

    // The table a person reads prints the same figures.
    let o = sw(Path::new("unused"))
        .args(["plan", "--sheet"])
        .arg(support::repo().join("fixtures/slo-sheet.toml"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    for needle in [
        "300 s",
        "72,000,000 records",
        "80 min",
        "2,400,000 records",
        "240 s",
        "350.19 GiB",
        "1.026 TiB",
        "58.59 MiB/s",
        "175.78 MiB/s",
        "23.44 MiB/s",
        "17.09 MiB/s",
        "13.41 GiB",
        "26.82 GiB",
        "44.44 h",
        "12.12 h",
        "fails first: burst backlog drains",
    ] {
        assert!(text.contains(needle), "no `{needle}` in:\n{text}");
    }

    // A bad sheet is refused with the field named.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    let sheet = std::fs::read_to_string(support::repo().join("fixtures/slo-sheet.toml")).unwrap();
    std::fs::write(&bad, sheet.replace("workers = 5", "workers = 0")).unwrap();
    let o = sw(Path::new("unused"))
        .args(["plan", "--sheet"])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("flows.workers"));
}

#[test]
fn plan_takes_measured_figures_from_a_running_up() {
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let (gw, serve) = (support::free_port(), support::free_port());
    let up = Proc::spawn({
        let mut c = sw(&lake);
        c.args(["up", "--job", "jobs/market_aggregates.toml"])
            .args(["--poll-interval", "300ms"])
            .args(["--gateway-listen", &format!("127.0.0.1:{gw}")])
            .args(["--serve-listen", &format!("127.0.0.1:{serve}")]);
        c
    });
    up.wait_log("signalweave up:", Duration::from_secs(60));
    let producer = Proc::spawn({
        let mut c = sw(&lake);
        c.args(["produce", "--url", &format!("http://127.0.0.1:{gw}")])
            .args(["--rate", "400", "--duration", "30s"]);
        c
    });
    let base = format!("http://127.0.0.1:{serve}");
    wait_until(
        "the live job counts events",
        Duration::from_secs(60),
        || {
            support::cli::get(&format!("{base}/v1/status"))
                .and_then(|b| serde_json::from_str::<Value>(&b).ok())
                .is_some_and(|v| v[0]["counted"].as_u64().unwrap_or(0) > 500)
        },
    );
    let (code, p) = plan_json(&["--status", &base, "--measure-for", "3s"]);
    assert!(code == 0 || code == 1, "{p}");
    let m = &p["measured"];
    assert!(m["source"].as_str().unwrap().ends_with("/v1/status"));
    let rate = f(m, "sustained_rate");
    assert!(
        (100.0..2_000.0).contains(&rate),
        "measured {rate} rec/s while producing 400/s"
    );
    assert!(f(m, "state_bytes") > 0.0);
    // The measured rate replaces the sheet's: the ingest flow follows it.
    assert!(f(&p, "ingest_bytes_per_s") < 1228.8 * 2_000.0);
    let measured: Vec<&str> = p["objectives"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["measured"] == true)
        .map(|o| o["objective"].as_str().unwrap())
        .collect();
    assert!(
        measured.contains(&"sustained load below capacity"),
        "{measured:?}"
    );
    assert!(p["fails_first"].is_string());
    let mut producer = producer;
    let _ = producer.child.kill();
    let _ = producer.child.wait();
    up.terminate();
}
