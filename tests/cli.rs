//! The `signalweave` binary end to end: load a committed fixture and count it with
//! `sql` (embedded and, where Garage runs, S3), regenerate the golden fixture, bad
//! input exits, a `load` killed with SIGKILL mid-way then rerun, and `bench backfill` on
//! a small lake.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use signalweave_fixtures::ExpectedFigures;

fn sw(lake: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_signalweave"))
        .arg("--lake")
        .arg(lake)
        .arg("--schemas")
        .arg(support::repo().join("catalog/events"))
        .args(args)
        .output()
        .unwrap()
}

fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn sql_i64(lake: &Path, query: &str) -> i64 {
    let out = ok(sw(lake, &["sql", query, "--format", "json"]));
    let rows: Vec<serde_json::Map<String, serde_json::Value>> = serde_json::from_str(&out).unwrap();
    rows[0].values().next().unwrap().as_i64().unwrap()
}

fn expected() -> ExpectedFigures {
    serde_json::from_str(
        &std::fs::read_to_string(support::repo().join("fixtures/sample.expected.json")).unwrap(),
    )
    .unwrap()
}

fn load_and_count(lake: &Path) {
    let sample = support::repo().join("fixtures/sample.ndjson");
    let report: serde_json::Value = serde_json::from_str(&ok(sw(
        lake,
        &["load", sample.to_str().unwrap(), "--format", "json"],
    )))
    .unwrap();
    let e = expected();
    assert_eq!(report["accepted"], e.events);
    assert_eq!(report["rejected"], e.invalid);
    assert_eq!(
        sql_i64(lake, "select count(*) from signalweave.events") as u64,
        e.events
    );
    assert_eq!(
        sql_i64(lake, "select sum(amount_minor) from signalweave.events"),
        e.amount_minor_sum
    );
    assert_eq!(
        sql_i64(lake, "select count(*) from signalweave.rejections") as u64,
        e.invalid
    );
}

#[test]
fn load_then_sql_counts_the_fixture_embedded() {
    let dir = tempfile::tempdir().unwrap();
    load_and_count(&dir.path().join("lake"));
    let tables = ok(sw(
        &dir.path().join("lake"),
        &["lake", "tables", "--format", "csv"],
    ));
    assert!(tables.contains("signalweave.events"), "{tables}");
}

#[test]
fn load_then_sql_counts_the_fixture_on_s3() {
    let Some(s3) = support::s3_config(&format!("cli/{}", std::process::id())) else {
        eprintln!("SW_S3_ENDPOINT not set: S3 profile not exercised here");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("profile.toml");
    let config = signalweave_lake::LakeConfig {
        catalog_name: "signalweave".into(),
        catalog_url: format!("sqlite://{}", dir.path().join("catalog.db").display()),
        warehouse: signalweave_lake::Warehouse::S3(s3),
    };
    std::fs::write(&profile, support::s3_profile(&config)).unwrap();
    load_and_count(&profile);
}

/// `bench backfill` on a small lake: the backfill, DataFusion's two queries and the
/// backfill's reading alone (with and without the dedup identity's columns) all run, and
/// the reading reads every landed event once.
#[test]
fn bench_backfill_runs_on_a_small_lake_and_reads_every_event_alone() {
    let dir = tempfile::tempdir().unwrap();
    let job = support::repo().join("jobs/market_aggregates.toml");
    let out = ok(sw(
        dir.path(),
        &[
            "bench",
            "backfill",
            "--events",
            "30000",
            "--slice",
            "1h",
            "--job",
            job.to_str().unwrap(),
        ],
    ));
    assert!(out.contains("ratio backfill / DataFusion"), "{out}");
    let read = out
        .lines()
        .find(|l| l.starts_with("the backfill's reading alone"))
        .unwrap_or_else(|| panic!("no reading-alone line in\n{out}"));
    assert!(read.contains("(30000 rows)"), "{read}");
    let identity = out
        .lines()
        .find(|l| l.starts_with("of which the dedup identity's columns (tenant, event_id): "))
        .unwrap_or_else(|| panic!("no identity line in\n{out}"));
    assert!(
        identity.contains("the same reading without them: "),
        "{identity}"
    );
    let stages = out
        .lines()
        .find(|l| l.starts_with("the backfill's time by stage"))
        .unwrap_or_else(|| panic!("no stage line in\n{out}"));
    let secs = |stage: &str| -> f64 {
        let at = stages
            .find(&format!("{stage} "))
            .unwrap_or_else(|| panic!("{stages}"));
        stages[at + stage.len() + 1..]
            .split(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{stages}"))
    };
    assert!(
        secs("read") > 0.0 && secs("engine") > 0.0 && secs("commit") > 0.0,
        "{stages}"
    );
}

#[test]
fn committed_fixture_is_the_generator_output() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sample.ndjson");
    let exp = dir.path().join("sample.expected.json");
    ok(sw(
        dir.path(),
        &[
            "fixtures",
            "generate",
            "--out",
            out.to_str().unwrap(),
            "--expected",
            exp.to_str().unwrap(),
            "--events",
            "2000",
            "--seed",
            "42",
            "--dup-fraction",
            "0.02",
            "--late-fraction",
            "0.02",
            "--invalid-fraction",
            "0.02",
            "--events-per-sec",
            "2",
        ],
    ));
    let committed = support::repo().join("fixtures");
    assert!(
        std::fs::read(&out).unwrap() == std::fs::read(committed.join("sample.ndjson")).unwrap(),
        "fixtures/sample.ndjson differs from the generator: regenerate it (see fixtures/README.md)"
    );
    assert_eq!(
        std::fs::read_to_string(&exp).unwrap(),
        std::fs::read_to_string(committed.join("sample.expected.json")).unwrap()
    );
}

#[test]
fn bad_input_exits_classified() {
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let missing = sw(&lake, &["load", "/nonexistent/file.ndjson"]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("cannot read"));
    // Commands on a lake that must be there refuse a mistyped one instead of making an
    // empty lake and answering as if nothing were in it.
    let typo = dir.path().join("lkae");
    for args in [
        &[
            "lake",
            "erase",
            "--customer-id",
            "c-1",
            "--tenant",
            "t",
            "--reason",
            "r",
        ][..],
        &["lake", "maintain"],
        &["lake", "compact"],
        &["lake", "expire"],
        &["lake", "holds"],
        &["backfill", "status"],
        &["effects", "status"],
    ] {
        let out = sw(&typo, args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("no lake at"),
            "{args:?}: {out:?}"
        );
    }
    assert!(!typo.exists());
    assert_eq!(sw(&lake, &["lake", "init"]).status.code(), Some(0));
    // Flags that would break the table or spin are refused before anything runs.
    for args in [
        &["lake", "maintain", "--orphans-older-than", "10m"][..],
        &["lake", "maintain", "--every", "0s"],
        &["lake", "expire", "--retain-last", "0"],
        &["lake", "expire", "--older-than-secs=-5"],
    ] {
        let out = sw(&lake, args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
    }
    // Nothing serving at the status URL: a dependency unavailable, exit 3.
    let nobody = sw(&lake, &["status", "--url", "http://127.0.0.1:1"]);
    assert_eq!(nobody.status.code(), Some(3), "{nobody:?}");
    let bad_sql = sw(&lake, &["sql", "selec nonsense"]);
    assert_eq!(
        bad_sql.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&bad_sql.stderr)
    );
    let no_table = sw(&lake, &["lake", "snapshots", "orders"]);
    assert_eq!(no_table.status.code(), Some(2));
    // Reading a lake that is not there is an error, and makes no lake.
    let typo = dir.path().join("lake_typo");
    let out = sw(&typo, &["sql", "select count(*) from signalweave.events"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("no lake at"));
    assert!(!typo.exists());
    // A user's SQL naming what is not there is bad input, said once.
    assert_eq!(sw(&lake, &["lake", "init"]).status.code(), Some(0));
    // `sql` only reads: writing files, DDL and session statements are refused before
    // they run, and nothing is written.
    let target = dir.path().join("written.parquet");
    for query in [
        format!(
            "copy (select * from signalweave.events limit 0) to '{}' stored as parquet",
            target.display()
        ),
        "drop table signalweave.events".to_string(),
        "create table signalweave.foo as select 1 x".to_string(),
        "set datafusion.execution.batch_size = 10".to_string(),
    ] {
        let out = sw(&lake, &["sql", &query]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{query}: {stderr}");
        assert!(stderr.contains("only reads the lake"), "{query}: {stderr}");
    }
    assert!(!target.exists());
    // A reader that goes away (`sql … | head`) ends the command quietly, exit 0.
    let mut child = Command::new(env!("CARGO_BIN_EXE_signalweave"))
        .arg("--lake")
        .arg(&lake)
        .args([
            "sql",
            "select value from generate_series(1, 300000)",
            "--format",
            "csv",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // An empty result still names its columns; CSV and JSON come out batch by batch.
    let empty = |format: &str| {
        let out = sw(
            &lake,
            &[
                "sql",
                "select event_id, amount_minor from signalweave.events where false",
                "--format",
                format,
            ],
        );
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    assert_eq!(empty("csv"), "event_id,amount_minor\n");
    assert_eq!(empty("json").trim(), "[]");
    assert!(empty("table").contains("amount_minor"));
    let many = sw(
        &lake,
        &[
            "sql",
            "select value from generate_series(1, 20000) order by value",
            "--format",
            "json",
        ],
    );
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&many.stdout).unwrap();
    assert_eq!(rows.len(), 20_000);
    assert_eq!(rows[19_999]["value"], 20_000);
    let csv = sw(
        &lake,
        &[
            "sql",
            "select value from generate_series(1, 20000)",
            "--format",
            "csv",
        ],
    );
    let text = String::from_utf8(csv.stdout).unwrap();
    assert_eq!(text.lines().count(), 20_001, "one header, then the rows");
    assert_eq!(text.lines().filter(|l| *l == "value").count(), 1);
    for query in [
        "select nosuchcol from signalweave.events",
        "select * from signalweave.nosuchtable",
    ] {
        let out = sw(&lake, &["sql", query]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{query}: {stderr}");
        let said = stderr.matches("nosuch").count();
        assert!((1..=2).contains(&said), "{query}: {stderr}");
    }
    let bad_profile = dir.path().join("p.toml");
    std::fs::write(&bad_profile, "catalog_url = 3").unwrap();
    assert_eq!(sw(&bad_profile, &["lake", "init"]).status.code(), Some(2));
    let unreachable = dir.path().join("pg.toml");
    std::fs::write(
        &unreachable,
        "catalog_url = \"postgres://nobody@127.0.0.1:1/none\"\n[warehouse]\nkind = \"local\"\npath = \"/tmp/x\"\n",
    )
    .unwrap();
    assert_eq!(sw(&unreachable, &["lake", "init"]).status.code(), Some(3));
}

/// An erasure killed after its rewrite and before its expiry left the subject readable in
/// older snapshots; running it again finds them there and expires them.
#[test]
fn an_erasure_killed_before_its_expiry_completes_when_run_again() {
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    load_and_count(&lake);
    let subject = "customer_id = 'c-7' and tenant = 'tenant-0'";
    let theirs = sql_i64(
        &lake,
        &format!("select count(*) from signalweave.events where {subject}"),
    );
    assert!(theirs > 0);
    let snapshots: Vec<serde_json::Value> = serde_json::from_str(&ok(sw(
        &lake,
        &["lake", "snapshots", "events", "--format", "json"],
    )))
    .unwrap();
    let before = snapshots.last().unwrap()["snapshot_id"].clone();
    let before = before
        .as_i64()
        .or_else(|| before.as_str().and_then(|s| s.parse().ok()))
        .unwrap();
    let erase = |fault: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_signalweave"));
        c.current_dir(support::repo())
            .arg("--lake")
            .arg(&lake)
            .args([
                "lake",
                "erase",
                "--customer-id",
                "c-7",
                "--tenant",
                "tenant-0",
                "--reason",
                "ticket-9",
                "--format",
                "json",
            ]);
        if let Some(f) = fault {
            c.env("SIGNALWEAVE_ERASE_FAULT", f);
        }
        c.output().unwrap()
    };
    let killed = erase(Some("before_expiry"));
    assert!(!killed.status.success(), "{killed:?}");
    // Gone from the current snapshot, still in the one before the erasure.
    assert_eq!(
        sql_i64(
            &lake,
            &format!("select count(*) from signalweave.events where {subject}")
        ),
        0
    );
    let old = sw(
        &lake,
        &[
            "sql",
            &format!("select count(*) from signalweave.events where {subject}"),
            "--snapshot",
            &before.to_string(),
            "--format",
            "csv",
        ],
    );
    assert_eq!(
        String::from_utf8_lossy(&old.stdout).lines().nth(1),
        Some(theirs.to_string().as_str())
    );
    // Run again: the older snapshots holding the subject are expired.
    let again = erase(None);
    assert!(again.status.success(), "{again:?}");
    let report: Vec<serde_json::Value> = serde_json::from_slice(&again.stdout).unwrap();
    let expired = report
        .iter()
        .find(|r| r["table"] == "(old files deleted)")
        .and_then(|r| r["snapshot"].as_str())
        .unwrap_or_default();
    assert!(
        !expired.is_empty() && !expired.starts_with("0 "),
        "{report:?}"
    );
    assert!(String::from_utf8_lossy(&again.stderr).contains("older snapshots did"));
    let old = sw(
        &lake,
        &[
            "sql",
            "select count(*) from signalweave.events",
            "--snapshot",
            &before.to_string(),
        ],
    );
    assert!(
        !old.status.success(),
        "the snapshot before the erasure is gone"
    );
}

/// kill -9 a load mid-way: whole chunks are committed and nothing partial; the rerun
/// lands the rest and nothing twice.
#[test]
fn load_killed_mid_way_resumes_without_duplicates() {
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let file = dir.path().join("big.ndjson");
    let exp = dir.path().join("big.expected.json");
    ok(sw(
        dir.path(),
        &[
            "fixtures",
            "generate",
            "--out",
            file.to_str().unwrap(),
            "--expected",
            exp.to_str().unwrap(),
            "--events",
            "60000",
            "--seed",
            "9",
            "--invalid-fraction",
            "0.01",
        ],
    ));
    let e: ExpectedFigures = serde_json::from_str(&std::fs::read_to_string(&exp).unwrap()).unwrap();
    ok(sw(&lake, &["lake", "init"]));
    let snapshots_file = lake.join("warehouse/signalweave/events/metadata");
    let mut child = Command::new(env!("CARGO_BIN_EXE_signalweave"))
        .arg("--lake")
        .arg(&lake)
        .arg("--schemas")
        .arg(support::repo().join("catalog/events"))
        .args(["load", file.to_str().unwrap(), "--chunk-records", "2000"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Wait until a few chunks have committed (metadata files appear per commit), then SIGKILL.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let commits = std::fs::read_dir(&snapshots_file)
            .map(|d| {
                d.filter(|f| {
                    f.as_ref()
                        .is_ok_and(|f| f.file_name().to_string_lossy().ends_with(".metadata.json"))
                })
                .count()
            })
            .unwrap_or(0);
        if commits >= 4 {
            break;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "load finished before it could be killed"
        );
        assert!(Instant::now() < deadline, "load made no progress");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let landed = sql_i64(&lake, "select count(*) from signalweave.events");
    assert!(
        landed > 0 && (landed as u64) < e.events,
        "killed mid-way: {landed} of {}",
        e.events
    );
    assert_eq!(
        sql_i64(
            &lake,
            "select count(distinct event_id) from signalweave.events"
        ),
        landed
    );
    // Whole chunks only: the landed snapshots are this load's chunks 0..n, each once.
    let snaps: Vec<serde_json::Value> = serde_json::from_str(&ok(sw(
        &lake,
        &["lake", "snapshots", "events", "--format", "json"],
    )))
    .unwrap();
    let seqs: Vec<u64> = snaps
        .iter()
        .map(|s| s["batch_seq"].as_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(
        seqs,
        (0..seqs.len() as u64).collect::<Vec<_>>(),
        "contiguous chunks from 0"
    );
    let writer = snaps[0]["writer"].as_str().unwrap().to_string();
    assert!(
        writer.starts_with("load-") && writer.contains("-r2000-"),
        "{writer}"
    );
    assert!(snaps.iter().all(|s| s["writer"] == writer.as_str()));
    // A chunk of 2,000 records lands at most 2,000 events.
    assert!(
        snaps
            .iter()
            .all(|s| s["added_records"].as_str().unwrap().parse::<u64>().unwrap() <= 2000)
    );
    let report: serde_json::Value = serde_json::from_str(&ok(sw(
        &lake,
        &[
            "load",
            file.to_str().unwrap(),
            "--chunk-records",
            "2000",
            "--format",
            "json",
        ],
    )))
    .unwrap();
    assert!(report["chunks_skipped"].as_u64().unwrap() >= 1);
    // The same file with another chunk size would cut other chunks: refused, nothing lands.
    let other = sw(
        &lake,
        &["load", file.to_str().unwrap(), "--chunk-records", "3000"],
    );
    assert_eq!(other.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&other.stderr).contains("--chunk-records"));
    assert_eq!(
        sql_i64(&lake, "select count(*) from signalweave.events") as u64,
        e.events
    );
    assert_eq!(
        sql_i64(
            &lake,
            "select count(distinct event_id) from signalweave.events"
        ) as u64,
        e.events
    );
    assert_eq!(
        sql_i64(&lake, "select count(*) from signalweave.rejections") as u64,
        e.invalid
    );
}

/// kill -9 a maintenance pass mid-way: the table stays readable with every row, and the
/// next pass completes the work.
#[test]
fn maintenance_killed_mid_way_leaves_the_table_readable_and_the_rerun_completes() {
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let sample = support::repo().join("fixtures/sample.ndjson");
    ok(sw(&lake, &["lake", "init"]));
    // About 200 small commits, so the merge has real work.
    ok(sw(
        &lake,
        &["load", sample.to_str().unwrap(), "--chunk-records", "10"],
    ));
    let rows = sql_i64(&lake, "select count(*) from signalweave.events");
    for delay_ms in [150u64, 400] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_signalweave"))
            .arg("--lake")
            .arg(&lake)
            .args([
                "lake",
                "maintain",
                "--table",
                "events",
                "--min-manifests",
                "10",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay_ms));
        let _ = child.kill(); // SIGKILL, wherever it is
        child.wait().unwrap();
        assert_eq!(
            sql_i64(&lake, "select count(*) from signalweave.events"),
            rows
        );
    }
    let out = ok(sw(
        &lake,
        &[
            "lake",
            "maintain",
            "--table",
            "events",
            "--min-manifests",
            "10",
            "--orphans-older-than",
            "0s",
            "--allow-young-orphans",
            "--format",
            "json",
        ],
    ));
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let manifests = report[0]["manifests"].as_str().unwrap().to_string();
    let after: usize = manifests.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(after < 10, "merged: {manifests}");
    assert_eq!(
        sql_i64(&lake, "select count(*) from signalweave.events"),
        rows
    );
    assert_eq!(
        sql_i64(
            &lake,
            "select count(distinct event_id) from signalweave.events"
        ),
        rows
    );
}
