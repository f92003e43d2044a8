//! The live job as a process: its outputs equal an SQL recount of the landing table; a
//! restart replays harmlessly; the serving API answers the current versions; kill -9 at
//! each checkpoint stage, then a restart, ends with the outputs of a failure-free run and
//! never two values for one output version; an object-store outage stalls the job, shows
//! in `/v1/status` and `/metrics`, and it recovers without loss.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use support::cli::{Proc, count, fetch, get, ok, sql, sw, wait_until};

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use serde_json::Value;

/// A job with a strict lateness (1 s), so the fixture's late events go to `late_events`.
fn strict_job(dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(support::repo().join("jobs/market_aggregates.toml"))
        .unwrap()
        .replace("allowed = \"2h\"", "allowed = \"1s\"")
        .replace(
            "max_out_of_orderness = \"5s\"",
            "max_out_of_orderness = \"1s\"",
        )
        .replace("name = \"market_aggregates\"", "name = \"strict_markets\"")
        .replace(
            "table = \"market_aggregates\"",
            "table = \"strict_markets\"",
        );
    let path = dir.join("strict_markets.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// The fixture, landed in several commits (one snapshot per 300 records).
fn load_fixture(lake: &Path) {
    let sample = support::repo().join("fixtures/sample.ndjson");
    ok(sw(lake)
        .args(["load", sample.to_str().unwrap(), "--chunk-records", "300"])
        .output()
        .unwrap());
}

fn run_caught_up(lake: &Path, job: &Path, fault: Option<&str>) -> Output {
    let mut c = sw(lake);
    c.args(["run", "--job", job.to_str().unwrap(), "--until-caught-up"])
        .args([
            "--max-snapshots-per-step",
            "1",
            "--checkpoint-interval",
            "1ms",
        ]);
    if let Some(f) = fault {
        c.env("SIGNALWEAVE_FAULT", f);
    }
    c.output().unwrap()
}

const CURRENT: &str = "select key, cast(window_start as varchar) w, completeness, events, placed_count, \
     placed_amount_minor, paid_count, paid_amount_minor, cancelled_count, cancelled_amount_minor \
     from signalweave.strict_markets_current order by key, w";

fn no_version_twice(lake: &Path) {
    let dups = sql(
        lake,
        "select key, window_start, output_version, count(*) n from signalweave.strict_markets \
         group by 1, 2, 3 having count(*) > 1",
    );
    assert!(dups.is_empty(), "output versions written twice: {dups:?}");
}

fn recount_matches(lake: &Path, job: &Path) {
    let out = ok(sw(lake)
        .args([
            "recount",
            "--job",
            job.to_str().unwrap(),
            "--format",
            "json",
        ])
        .output()
        .unwrap());
    let rows: Vec<Value> = serde_json::from_str(&out).unwrap();
    let r = &rows[0];
    assert!(
        r["compared"].as_str().unwrap().parse::<u64>().unwrap() > 400,
        "{r}"
    );
    assert_eq!(r["compared"], r["matched"], "{r}");
}

#[test]
fn live_outputs_equal_the_sql_recount_and_a_restart_replays_harmlessly() {
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let job = strict_job(dir.path());
    load_fixture(&lake);
    ok(run_caught_up(&lake, &job, None));
    recount_matches(&lake, &job);
    let late = count(
        &lake,
        "select count(*) from signalweave.late_events where job = 'strict_markets'",
    );
    assert!(late > 0, "the strict job routed nothing to late_events");
    // Each sink commit names its job, namespace and epoch.
    let snaps = ok(sw(&lake)
        .args(["lake", "snapshots", "strict_markets", "--format", "json"])
        .output()
        .unwrap());
    assert!(snaps.contains("job:strict_markets:live"), "{snaps}");
    let rows_before = count(&lake, "select count(*) from signalweave.strict_markets");
    // A restart with nothing new writes nothing new.
    ok(run_caught_up(&lake, &job, None));
    assert_eq!(
        count(&lake, "select count(*) from signalweave.strict_markets"),
        rows_before
    );
    assert_eq!(
        count(
            &lake,
            "select count(*) from signalweave.late_events where job = 'strict_markets'"
        ),
        late
    );
    no_version_twice(&lake);
}

#[test]
fn kill_9_at_every_checkpoint_stage_then_restart_ends_as_a_failure_free_run() {
    let dir = tempfile::tempdir().unwrap();
    let job = strict_job(dir.path());
    let reference = dir.path().join("reference");
    load_fixture(&reference);
    ok(run_caught_up(&reference, &job, None));
    let expected = sql(&reference, CURRENT);
    assert!(expected.len() > 400);
    let expected_late = count(
        &reference,
        "select count(*) from signalweave.late_events where job = 'strict_markets'",
    );
    // The epoch that commits late records: a crash after its outputs' commit leaves its
    // sink commit half done, for the restart to finish.
    let late_commits: Vec<Value> = serde_json::from_str(&ok(sw(&reference)
        .args(["lake", "snapshots", "late_events", "--format", "json"])
        .output()
        .unwrap()))
    .unwrap();
    let late_epoch: u64 = late_commits[0]["batch_seq"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    for stage in [
        "before_checkpoint",
        "after_checkpoint",
        "mid_commit",
        "after_output_commit",
        "after_sink_commit",
    ] {
        let mut epochs = if stage == "after_output_commit" {
            vec![1, late_epoch]
        } else {
            vec![1, 3]
        };
        epochs.dedup();
        for epoch in epochs {
            let lake = dir.path().join(format!("{stage}-{epoch}"));
            load_fixture(&lake);
            let fault = format!("{stage}@{epoch}");
            let crashed = run_caught_up(&lake, &job, Some(&fault));
            assert!(
                !crashed.status.success(),
                "{fault}: the drill did not stop the job: {}",
                String::from_utf8_lossy(&crashed.stderr)
            );
            assert!(
                String::from_utf8_lossy(&crashed.stderr).contains("fault drill"),
                "{fault}: {}",
                String::from_utf8_lossy(&crashed.stderr)
            );
            ok(run_caught_up(&lake, &job, None));
            assert_eq!(
                sql(&lake, CURRENT),
                expected,
                "{fault}: final outputs differ"
            );
            no_version_twice(&lake);
            assert_eq!(
                count(
                    &lake,
                    "select count(*) from signalweave.late_events where job = 'strict_markets'"
                ),
                expected_late,
                "{fault}: late records"
            );
        }
    }
}

#[test]
fn the_serving_api_answers_committed_current_versions_and_status() {
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let job = strict_job(dir.path());
    load_fixture(&lake);
    let port = support::free_port();
    let base = format!("http://127.0.0.1:{port}");
    let mut cmd = sw(&lake);
    cmd.args(["run", "--job", job.to_str().unwrap()])
        .args(["--serve", &format!("127.0.0.1:{port}")]);
    let p = Proc::spawn(cmd);
    p.wait_log("serving on", Duration::from_secs(60));
    wait_until("the job to catch up", Duration::from_secs(60), || {
        get(&format!("{base}/v1/status")).is_some_and(|s| {
            let v: Value = serde_json::from_str(&s).unwrap();
            v[0]["lag_snapshots"] == 0
                && v[0]["epoch"].as_u64().unwrap_or(0) > 0
                && v[0]["outputs"].as_u64().unwrap_or(0) > 0
        })
    });
    let body = get(&format!(
        "{base}/v1/jobs/strict_markets/aggregates?key=m-21&from=2026-01-01T00:00:00Z&to=2026-01-02T00:00:00Z"
    ))
    .unwrap();
    let v: Value = serde_json::from_str(&body).unwrap();
    let windows = v["windows"].as_array().unwrap();
    assert!(!windows.is_empty(), "{v}");
    assert!(v["as_of_snapshot"].as_i64().is_some());
    for w in windows {
        assert_eq!(w["key"], "m-21");
        assert!(w["output_version"].as_i64().unwrap() >= 1);
        assert!(
            ["provisional", "on_time", "corrected"].contains(&w["completeness"].as_str().unwrap())
        );
        assert!(w["watermark"].as_str().unwrap().ends_with('Z'));
        assert!(w["values"]["placed_count"].is_i64());
    }
    // The same windows as the SQL current view.
    let n = count(
        &lake,
        "select count(*) from signalweave.strict_markets_current where key = 'm-21'",
    );
    assert_eq!(windows.len() as i64, n);
    // Classified errors.
    let status = |url: &str| fetch(url).map(|(s, _)| s);
    assert_eq!(
        status(&format!("{base}/v1/jobs/nope/aggregates")),
        Some(404)
    );
    assert_eq!(
        status(&format!(
            "{base}/v1/jobs/strict_markets/aggregates?from=yesterday"
        )),
        Some(400)
    );
    // A mistyped parameter, a repeated one, an unknown path: classified, in JSON.
    for (url, code, error) in [
        (
            format!("{base}/v1/jobs/strict_markets/aggregates?market=m-21"),
            400,
            "invalid_request",
        ),
        (
            format!("{base}/v1/jobs/strict_markets/aggregates?key=m-1&key=m-2"),
            400,
            "invalid_request",
        ),
        (format!("{base}/v1/jobs/strict_markets"), 404, "not_found"),
    ] {
        let (got, body) = fetch(&url).unwrap();
        assert_eq!(got, code, "{url}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap_or_else(|_| panic!("{url}: {body}"));
        assert_eq!(v["error"], error, "{url}: {body}");
    }
    let metrics = get(&format!("{base}/metrics")).unwrap();
    for name in [
        "signalweave_job_lag_snapshots",
        "signalweave_job_lag_records",
        "signalweave_job_oldest_unprocessed_age_seconds",
        "signalweave_job_event_time_age_seconds",
        "signalweave_job_watermark_delay_seconds",
        "signalweave_job_checkpoint_seconds",
        "signalweave_job_checkpoint_age_seconds",
        "signalweave_job_checkpoint_bytes",
        "signalweave_job_sink_commit_seconds",
        "signalweave_job_freshness_seconds",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }
    let table = ok(sw(&lake).args(["status", "--url", &base]).output().unwrap());
    assert!(
        table.contains("strict_markets/live") && table.contains("running"),
        "{table}"
    );
    // One instance at a time: a second one waits for the lease, then fails with a
    // conflict (exit 3); the first runs on untouched.
    let second = run_caught_up(&lake, &job, None);
    assert_eq!(second.status.code(), Some(3), "{second:?}");
    let said = String::from_utf8_lossy(&second.stderr);
    assert!(said.contains("another instance"), "{said}");
    let v = status_json(&base).unwrap();
    assert_eq!(v["state"], "running", "{v}");
    let log = p.terminate();
    assert!(log.contains("stopped at epoch"), "{log}");
    // A clean stop gives the lease up, and a killed instance of this host loses it at
    // once: the next one starts without waiting.
    for kill in [false, true] {
        let p = Proc::spawn({
            let mut cmd = sw(&lake);
            cmd.args(["run", "--job", job.to_str().unwrap()]);
            cmd
        });
        p.wait_log("recovered at epoch", Duration::from_secs(60));
        if kill {
            p.kill();
        } else {
            p.terminate();
        }
        let started = std::time::Instant::now();
        ok(run_caught_up(&lake, &job, None));
        assert!(
            started.elapsed() < Duration::from_secs(8),
            "waited {:?} for the lease (killed: {kill})",
            started.elapsed()
        );
    }
}

/// A serving address in use fails `run` before any job starts: nothing is read or
/// committed, and no lease is left held for the next run to wait out.
#[test]
fn a_serving_address_in_use_fails_the_run_before_its_jobs_start() {
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    load_fixture(&lake);
    let job = strict_job(dir.path());
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = sw(&lake)
        .args(["run", "--job", job.to_str().unwrap(), "--until-caught-up"])
        .args(["--serve", &addr])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("binding the serving API"), "{stderr}");
    assert_eq!(
        count(&lake, "select count(*) from signalweave.late_events"),
        0,
        "nothing was processed"
    );
    // The next run starts at once: no lease was taken.
    let started = std::time::Instant::now();
    ok(run_caught_up(&lake, &job, None));
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
}

fn status_json(base: &str) -> Option<Value> {
    get(&format!("{base}/v1/status")).map(|s| serde_json::from_str::<Value>(&s).unwrap()[0].clone())
}

#[test]
fn an_object_store_outage_stalls_the_job_visibly_and_it_recovers_without_loss() {
    if !support::garage_installed() {
        eprintln!("skipped: garage is not installed");
        return;
    }
    let gdir = tempfile::tempdir().unwrap();
    let port = support::garage_ports();
    support::garage("garage-up.sh", gdir.path(), port);
    let lake = gdir.path().join("profile.toml");
    let job = strict_job(gdir.path());
    // The fixture in two halves: one before the outage, one after.
    let lines: Vec<String> =
        std::fs::read_to_string(support::repo().join("fixtures/sample.ndjson"))
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect();
    let (first, second) = lines.split_at(lines.len() / 2);
    let halves = [
        gdir.path().join("first.ndjson"),
        gdir.path().join("second.ndjson"),
    ];
    std::fs::write(&halves[0], first.join("\n") + "\n").unwrap();
    std::fs::write(&halves[1], second.join("\n") + "\n").unwrap();
    let load = |file: &Path| {
        sw(&lake)
            .args(["load", file.to_str().unwrap(), "--chunk-records", "300"])
            .output()
            .unwrap()
    };
    ok(load(&halves[0]));
    let serve_port = support::free_port();
    let base = format!("http://127.0.0.1:{serve_port}");
    let mut cmd = sw(&lake);
    cmd.args([
        "run",
        "--job",
        job.to_str().unwrap(),
        "--checkpoint-interval",
        "500ms",
    ])
    .args(["--serve", &format!("127.0.0.1:{serve_port}")]);
    let p = Proc::spawn(cmd);
    p.wait_log("serving on", Duration::from_secs(60));
    wait_until("the first half", Duration::from_secs(60), || {
        status_json(&base).is_some_and(|s| s["lag_snapshots"] == 0 && s["epoch"].as_u64() > Some(0))
    });
    support::garage("garage-down.sh", gdir.path(), port);
    let down = Instant::now();
    wait_until(
        "the job to report the outage",
        Duration::from_secs(25),
        || {
            status_json(&base)
                .is_some_and(|s| s["state"] == "stalled" && s["last_error"].is_string())
        },
    );
    let metrics = get(&format!("{base}/metrics")).unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("signalweave_job_stalled{") && l.ends_with(" 1")),
        "{metrics}"
    );
    let status = sw(&lake).args(["status", "--url", &base]).output().unwrap();
    assert_eq!(
        status.status.code(),
        Some(1),
        "status exits 1 while a job is stalled"
    );
    assert!(String::from_utf8_lossy(&status.stdout).contains("stalled"));
    std::thread::sleep(Duration::from_secs(30).saturating_sub(down.elapsed()));
    support::garage("garage-up.sh", gdir.path(), port);
    // The store is back: the second half lands, and the job catches up by itself.
    let start = Instant::now();
    loop {
        let out = load(&halves[1]);
        if out.status.success() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "load after the outage: {out:?}"
        );
        std::thread::sleep(Duration::from_secs(1));
    }
    let current = sql(&lake, "select count(*) n from signalweave.events")[0]["n"]
        .as_i64()
        .unwrap();
    wait_until(
        "the job to recover and catch up",
        Duration::from_secs(90),
        || {
            // A job fenced out of its own lease (two renewals of one owner raced) exits
            // and never recovers.
            let log = p.log();
            assert!(
                !log.contains("lease was taken"),
                "the job lost its own lease:\n{log}"
            );
            status_json(&base).is_some_and(|s| {
                s["state"] == "running" && s["lag_snapshots"] == 0 && s["lag_records"] == 0
            }) && sql(&lake, "select count(*) n from signalweave.events")[0]["n"].as_i64()
                == Some(current)
        },
    );
    p.terminate();
    recount_matches(&lake, &job);
    no_version_twice(&lake);
    support::garage("garage-down.sh", gdir.path(), port);
}

/// The live job on Garage with a SQLite and with a PostgreSQL catalog: outputs equal the
/// recount, and a kill -9 after the sink commit rolls forward without a second version.
#[test]
fn the_live_job_runs_on_s3_with_sqlite_and_postgresql_catalogs() {
    for (b, path) in support::s3_backends() {
        let job = strict_job(b.dir.path());
        load_fixture(&path);
        let crashed = run_caught_up(&path, &job, Some("after_sink_commit@2"));
        assert!(
            !crashed.status.success(),
            "{}: the drill did not stop the job",
            b.name
        );
        ok(run_caught_up(&path, &job, None));
        recount_matches(&path, &job);
        no_version_twice(&path);
        eprintln!("{}: ok", b.name);
    }
}

/// `signalweave up`: gateway, live job and serving in one process; events sent to the
/// gateway come out of the serving API; SIGTERM drains the gateway, then the job commits a
/// last checkpoint, exit 0.
#[test]
fn up_runs_gateway_job_and_serving_in_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let text = std::fs::read_to_string(support::repo().join("jobs/market_aggregates.toml"))
        .unwrap()
        .replace("early_every = \"20s\"", "early_every = \"1s\"");
    let job = dir.path().join("market_aggregates.toml");
    std::fs::write(&job, text).unwrap();
    let (gw_port, serve_port) = (support::free_port(), support::free_port());
    let gateway = format!("http://127.0.0.1:{gw_port}");
    let base = format!("http://127.0.0.1:{serve_port}");
    let mut cmd = sw(&lake);
    cmd.args(["up", "--job", job.to_str().unwrap()])
        .args(["--gateway-listen", &format!("127.0.0.1:{gw_port}")])
        .args(["--serve-listen", &format!("127.0.0.1:{serve_port}")])
        .args(["--maintain-every", "1s"]);
    let p = Proc::spawn(cmd);
    p.wait_log("signalweave up:", Duration::from_secs(60));
    let produced = sw(&lake)
        .args([
            "produce",
            "--url",
            &gateway,
            "--rate",
            "1000",
            "--duration",
            "3s",
        ])
        .args(["--producer-id", "up-test", "--format", "json"])
        .output()
        .unwrap();
    let report: Vec<Value> = serde_json::from_str(&ok(produced)).unwrap();
    let accepted: i64 = report
        .iter()
        .find(|m| m["measure"] == "accepted")
        .and_then(|m| m["value"].as_str()?.parse().ok())
        .unwrap();
    assert!(accepted > 2_500, "{report:?}");
    wait_until(
        "the job to count every event",
        Duration::from_secs(60),
        || {
            status_json(&base).is_some_and(|s| {
                s["state"] == "running"
                    && s["counted"].as_i64() == Some(accepted)
                    && s["outputs"].as_u64() > Some(0)
            })
        },
    );
    // The last early emission follows the last count by at most a trigger period.
    std::thread::sleep(Duration::from_secs(3));
    let body = get(&format!("{base}/v1/jobs/market_aggregates/aggregates")).unwrap();
    let v: Value = serde_json::from_str(&body).unwrap();
    let events: i64 = v["windows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["events"].as_i64().unwrap())
        .sum();
    assert_eq!(events, accepted, "{v}");
    // Maintenance shows every hold's age (the job's checkpoint holds its source position)
    // and the snapshots holds alone keep.
    let metrics = get(&format!("{base}/metrics")).unwrap();
    let hold = metrics
        .lines()
        .find(|l| {
            l.starts_with("signalweave_job_lake_hold_age_seconds{")
                && l.contains("table=\"events\"")
                && l.contains("market_aggregates")
        })
        .unwrap_or_else(|| panic!("no hold age of the job's source position: {metrics}"));
    let age: f64 = hold.rsplit(' ').next().unwrap().parse().unwrap();
    assert!((0.0..60.0).contains(&age), "{hold}");
    assert!(
        metrics.contains("signalweave_job_lake_held_snapshots{table=\"market_aggregates\"}")
            || metrics.contains("signalweave_job_lake_held_snapshots{table=\"late_events\"}"),
        "{metrics}"
    );
    let log = p.terminate();
    assert!(
        log.contains("gateway stopped: ") && log.contains("0 abandoned"),
        "{log}"
    );
    let epoch: u64 = log
        .split("job market_aggregates stopped at epoch ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("{log}"));
    assert!(epoch > 0, "{log}");
    // Restarted with no traffic, it says at once where it resumed: the restored epoch and
    // source position, not epoch 0 until its next checkpoint.
    let mut cmd = sw(&lake);
    cmd.args(["up", "--job", job.to_str().unwrap()])
        .args(["--gateway-listen", &format!("127.0.0.1:{gw_port}")])
        .args(["--serve-listen", &format!("127.0.0.1:{serve_port}")]);
    let p = Proc::spawn(cmd);
    p.wait_log("signalweave up:", Duration::from_secs(60));
    let s = status_json(&base).expect("status");
    assert_eq!(s["epoch"].as_u64(), Some(epoch), "{s}");
    assert!(s["position"].as_i64().is_some(), "{s}");
    p.terminate();
}

/// A new job holds the snapshot of its first read before it reads it: expiry running
/// meanwhile (the gateway's maintenance, say) cannot remove the position the job then
/// records, which would leave every later step failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_job_holds_its_first_snapshot_before_reading_it() {
    use std::sync::Arc;

    use signalweave_fixtures::{Generator, Record, WorkloadSpec};
    use signalweave_lake::{
        CommitIdentity, Lake, LakeConfig, LakeTable, MaintenancePolicy, Retention,
    };
    use signalweave_runner::{LiveConfig, LiveJob, RunnerMetrics};

    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(LakeConfig::embedded(dir.path())).await.unwrap();
    lake.init().await.unwrap();
    let mut builder = signalweave_model::EventBatchBuilder::with_capacity(500);
    let mut batches = Vec::new();
    let spec = WorkloadSpec {
        events: 2_500,
        late_fraction: 0.0,
        ..Default::default()
    };
    for r in Generator::new(spec) {
        let (Record::Event(e) | Record::Duplicate(e)) = r else {
            continue;
        };
        builder.push(&e);
        if builder.len() == 500 {
            batches.push(builder.finish().unwrap());
        }
    }
    assert!(batches.len() >= 5, "{}", batches.len());
    let total: usize = batches[..5].iter().map(|b| b.num_rows()).sum();
    let append = |i: usize| {
        let (lake, batch) = (lake.clone(), batches[i].clone());
        async move {
            lake.append(
                LakeTable::Events,
                &[batch],
                &CommitIdentity::new("t", i as u64),
            )
            .await
            .unwrap();
        }
    };
    let keep_one = MaintenancePolicy {
        retention: Some(Retention {
            keep_last: 1,
            max_age_ms: 0,
        }),
        ..Default::default()
    };
    // The table's first snapshots are expired: the job's first read is of the one left.
    for i in 0..3 {
        append(i).await;
    }
    lake.maintain(LakeTable::Events, &keep_one).await.unwrap();
    let spec =
        signalweave_window::JobSpec::from_file(support::repo().join("jobs/market_aggregates.toml"))
            .unwrap();
    let config = LiveConfig {
        checkpoint_interval: Duration::from_secs(3600),
        ..LiveConfig::default()
    };
    let mut job = LiveJob::recover(
        lake.clone(),
        Arc::new(spec),
        config,
        Arc::new(RunnerMetrics::new()),
    )
    .await
    .unwrap();
    let first = job.step(false).await.unwrap();
    assert_eq!(first.snapshots, 1);
    // Expiry runs before the first checkpoint: the snapshot read stays.
    append(3).await;
    append(4).await;
    lake.maintain(LakeTable::Events, &keep_one).await.unwrap();
    let second = job.step(true).await.unwrap();
    assert_eq!(second.snapshots, 2);
    assert_eq!((first.records + second.records) as usize, total);
}

/// Events of the fixture's generator (with its late and repeated events), in one batch.
fn generated_events(events: u64) -> arrow::array::RecordBatch {
    use signalweave_fixtures::{Generator, Record, WorkloadSpec};
    let spec = WorkloadSpec {
        events,
        ..Default::default()
    };
    let mut builder = signalweave_model::EventBatchBuilder::with_capacity(events as usize);
    for r in Generator::new(spec) {
        if let Record::Event(e) | Record::Duplicate(e) = r {
            builder.push(&e);
        }
    }
    builder.finish().unwrap()
}

/// An embedded lake in `dir` holding [`land_in_commits`]' events, the strict job, and a
/// live configuration that reads one commit a step and checkpoints only when told.
async fn strict_setup(
    dir: &Path,
) -> (
    signalweave_lake::Lake,
    std::sync::Arc<signalweave_window::JobSpec>,
    signalweave_runner::LiveConfig,
) {
    let lake = signalweave_lake::Lake::open(signalweave_lake::LakeConfig::embedded(dir))
        .await
        .unwrap();
    lake.init().await.unwrap();
    land_in_commits(&lake).await;
    let spec = signalweave_window::JobSpec::from_file(strict_job(dir)).unwrap();
    let config = signalweave_runner::LiveConfig {
        checkpoint_interval: Duration::from_secs(3600),
        max_snapshots_per_step: 1,
        ..signalweave_runner::LiveConfig::default()
    };
    (lake, std::sync::Arc::new(spec), config)
}

/// A job recovered on `lake`, which reads every commit and checkpoints once.
async fn first_epoch(
    lake: &signalweave_lake::Lake,
    spec: std::sync::Arc<signalweave_window::JobSpec>,
    config: signalweave_runner::LiveConfig,
) -> signalweave_runner::LiveJob {
    let metrics = std::sync::Arc::new(signalweave_runner::RunnerMetrics::new());
    let mut job = signalweave_runner::LiveJob::recover(lake.clone(), spec, config, metrics)
        .await
        .unwrap();
    read_all(&mut job).await;
    job.step(true).await.unwrap();
    assert_eq!(job.epoch(), 1);
    job
}

/// Steps `job` until it has read every commit, without a checkpoint.
async fn read_all(job: &mut signalweave_runner::LiveJob) {
    while job.step(false).await.unwrap().snapshots > 0 {}
}

/// 200 s of the generator's events, landed in commits of 1,000.
async fn land_in_commits(lake: &signalweave_lake::Lake) {
    let events = generated_events(20_000);
    for (seq, from) in (0..events.num_rows()).step_by(1_000).enumerate() {
        let len = 1_000.min(events.num_rows() - from);
        lake.append(
            signalweave_lake::LakeTable::Events,
            &[events.slice(from, len)],
            &signalweave_lake::CommitIdentity::new("t", seq as u64),
        )
        .await
        .unwrap();
    }
}

async fn count_rows(lake: &signalweave_lake::Lake, sql: &str) -> i64 {
    use arrow::array::AsArray;
    use arrow::datatypes::Int64Type;
    let ctx = lake.session_context().await.unwrap();
    let batches = ctx.sql(sql).await.unwrap().collect().await.unwrap();
    batches[0].column(0).as_primitive::<Int64Type>().value(0)
}

/// A restart does not commit the current checkpoint's late rows again. They were
/// committed before the checkpoint became current, and their commit's identity is
/// forgotten some days after its snapshot expires: committed again, they would then land
/// twice. The job holds no snapshot of `late_events`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_commits_nothing_of_the_current_checkpoint_again() {
    use std::sync::Arc;

    use signalweave_lake::{Lake, LakeConfig, LakeTable, MaintenancePolicy, Retention};
    use signalweave_runner::{LiveConfig, LiveJob, RunnerMetrics};

    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(LakeConfig::embedded(dir.path())).await.unwrap();
    lake.init().await.unwrap();
    // Read one commit at a time: the watermark moves between them, past the windows of
    // the late events the generator ends with.
    land_in_commits(&lake).await;
    let spec = Arc::new(signalweave_window::JobSpec::from_file(strict_job(dir.path())).unwrap());
    let recover = |namespace: &str| {
        let config = LiveConfig {
            namespace: namespace.to_string(),
            checkpoint_interval: Duration::from_secs(3600),
            max_snapshots_per_step: 1,
            ..LiveConfig::default()
        };
        LiveJob::recover(
            lake.clone(),
            Arc::clone(&spec),
            config,
            Arc::new(RunnerMetrics::new()),
        )
    };
    // One epoch: its checkpoint holds every late row.
    let mut job = recover("live").await.unwrap();
    read_all(&mut job).await;
    job.step(true).await.unwrap();
    assert_eq!(job.epoch(), 1);
    let late_sql = "select count(*) from signalweave.late_events where namespace = 'live'";
    let late = count_rows(&lake, late_sql).await;
    assert!(late > 0, "the fixture's late events are late for this job");
    // The job holds nothing of `late_events`: a hold there moved only with late rows, and
    // a hold keeps every later snapshot, every job's.
    let late_holds = "select count(*) from sw_snapshot_holds \
                      where holder = 'job:strict_markets:live' and table_name = 'late_events'";
    let held = || {
        let lake = lake.clone();
        async move {
            sqlx::query_scalar::<_, i64>(late_holds)
                .fetch_one(lake.control_pool())
                .await
                .unwrap()
        }
    };
    assert_eq!(held().await, 0);
    drop(job);
    // A hold on `late_events` such as an earlier version of the job took: the restart
    // gives it up. (It finishes the checkpoint's sink commit again, as that version
    // moved the pointer before finishing it: every commit is found made.)
    sqlx::query(
        "INSERT INTO sw_snapshot_holds (catalog_name, table_name, holder, snapshot_id, updated_ms) \
         SELECT catalog_name, 'late_events', holder, snapshot_id, updated_ms \
         FROM sw_snapshot_holds WHERE holder = 'job:strict_markets:live' AND table_name = 'events'",
    )
    .execute(lake.control_pool())
    .await
    .unwrap();
    assert_eq!(held().await, 1);
    let job = recover("live").await.unwrap();
    assert_eq!(job.epoch(), 1);
    assert_eq!(count_rows(&lake, late_sql).await, late);
    assert_eq!(held().await, 0);
    drop(job);
    // The snapshot of that commit expires (a later commit kept alone), and its recorded
    // identity is forgotten, 7 days after the commit.
    let mut other = recover("other").await.unwrap();
    read_all(&mut other).await;
    other.step(true).await.unwrap();
    let keep_one = MaintenancePolicy {
        retention: Some(Retention {
            keep_last: 1,
            max_age_ms: 0,
        }),
        ..Default::default()
    };
    lake.maintain(LakeTable::LateEvents, &keep_one)
        .await
        .unwrap();
    sqlx::query("DELETE FROM sw_commit_identities")
        .execute(lake.control_pool())
        .await
        .unwrap();
    // As after 7 days: identities are kept that long after the commit.
    sqlx::query("UPDATE sw_checkpoints SET created_ms = created_ms - 8 * 24 * 3600 * 1000")
        .execute(lake.control_pool())
        .await
        .unwrap();
    // The restart restores the checkpoint and lands none of its late rows again.
    let job = recover("live").await.unwrap();
    assert_eq!(job.epoch(), 1);
    assert_eq!(count_rows(&lake, late_sql).await, late);
}

/// A job whose lease renewals fail (the catalog database unreachable from it, here a
/// trigger refusing them) stops committing before another instance could take the
/// lease, stalls with a retryable error, and commits once a renewal succeeds again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_lease_is_not_renewed_commits_nothing() {
    use std::sync::Arc;

    use signalweave_model::ErrorKind;
    use signalweave_runner::{LIVE_LEASE_COMMIT_WITHIN, LiveJob, RunnerMetrics};

    let dir = tempfile::tempdir().unwrap();
    let (lake, spec, config) = strict_setup(dir.path()).await;
    let mut job = LiveJob::recover(
        lake.clone(),
        Arc::clone(&spec),
        config.clone(),
        Arc::new(RunnerMetrics::new()),
    )
    .await
    .unwrap();
    let pool = lake.control_pool();
    sqlx::query(
        "CREATE TRIGGER sw_leases_frozen BEFORE UPDATE ON sw_leases \
         BEGIN SELECT RAISE(ABORT, 'the lease table is frozen'); END",
    )
    .execute(pool)
    .await
    .unwrap();
    let outputs = "select count(*) from signalweave.strict_markets";
    read_all(&mut job).await;
    tokio::time::sleep(LIVE_LEASE_COMMIT_WITHIN + Duration::from_secs(1)).await;
    let e = job.step(true).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.to_string().contains("lease"), "{e}");
    assert_eq!(count_rows(&lake, outputs).await, 0);
    assert_eq!(job.epoch(), 0);
    sqlx::query("DROP TRIGGER sw_leases_frozen")
        .execute(pool)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    drop(job);
    first_epoch(&lake, spec, config).await;
    assert!(count_rows(&lake, outputs).await > 0);
}

/// A job whose lease another instance has taken over commits nothing, even before its
/// own renewals notice (held off here; its recency check still passes): each of its
/// writes to the catalog database (the checkpoint's record, the sink's commits, the
/// pointer) is fenced by the lease's tenure, in the write's own transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_lease_was_taken_over_commits_nothing() {
    use std::sync::Arc;

    use signalweave_model::ErrorKind;
    use signalweave_runner::{LiveConfig, LiveJob, RunnerMetrics};

    let dir = tempfile::tempdir().unwrap();
    let (lake, spec, config) = strict_setup(dir.path()).await;
    let config = LiveConfig {
        lease_renew_every: Duration::from_secs(3_600),
        ..config
    };
    let taken = std::time::Instant::now();
    let mut job = LiveJob::recover(
        lake.clone(),
        Arc::clone(&spec),
        config.clone(),
        Arc::new(RunnerMetrics::new()),
    )
    .await
    .unwrap();
    read_all(&mut job).await;
    // The lease runs out (as it would while the job was paused), and another instance
    // takes the job over.
    sqlx::query("UPDATE sw_leases SET lease_until_ms = 0")
        .execute(lake.control_pool())
        .await
        .unwrap();
    lake.take_lease(
        "live",
        &spec.name,
        &config.namespace,
        "another-host:1:b",
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    let e = job.step(true).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Conflict, "{e}");
    // (Once its lease's last renewal is older than the commit window, the job renews it
    // in line, and that renewal finds the takeover first. A setup that slow says nothing of
    // the fence.)
    if taken.elapsed() < signalweave_runner::LIVE_LEASE_COMMIT_WITHIN - Duration::from_secs(1) {
        assert!(e.to_string().contains("taken over since"), "{e}");
    }
    assert_eq!(job.epoch(), 0);
    let outputs = "select count(*) from signalweave.strict_markets";
    assert_eq!(count_rows(&lake, outputs).await, 0);
    let recorded: i64 = sqlx::query_scalar("SELECT count(*) FROM sw_checkpoints")
        .fetch_one(lake.control_pool())
        .await
        .unwrap();
    assert_eq!(recorded, 0, "no checkpoint recorded");
}

/// Files under `dir` whose names end with `suffix`.
fn files_ending(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.to_string_lossy().ends_with(suffix) {
                out.push(path);
            }
        }
    }
    out
}

/// A job that stalls and then cannot recover, for a reason no retry mends (here its
/// checkpoint corrupt), fails once that has lasted its grace, with the error, instead of
/// retrying every few seconds for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_cannot_recover_fails_instead_of_retrying_for_ever() {
    use signalweave_lake::{CommitIdentity, LakeTable};
    use signalweave_model::ErrorKind;
    use signalweave_runner::LiveConfig;

    let dir = tempfile::tempdir().unwrap();
    let (lake, spec, config) = strict_setup(dir.path()).await;
    let config = LiveConfig {
        permanent_failure_grace: Duration::from_secs(1),
        ..config
    };
    let job = first_epoch(&lake, spec, config).await;
    let checkpoints = files_ending(dir.path(), ".ckpt");
    assert!(!checkpoints.is_empty());
    for c in checkpoints {
        std::fs::write(c, b"not a checkpoint").unwrap();
    }
    // The next read fails (a data file gone), so the job stalls and recovers.
    let before = files_ending(dir.path(), ".parquet");
    lake.append(
        LakeTable::Events,
        &[generated_events(100)],
        &CommitIdentity::new("after", 0),
    )
    .await
    .unwrap();
    for f in files_ending(dir.path(), ".parquet") {
        if !before.contains(&f) {
            std::fs::remove_file(f).unwrap();
        }
    }
    let status = job.status();
    let ended = tokio::time::timeout(Duration::from_secs(60), job.run(std::future::pending()))
        .await
        .expect("the job fails instead of retrying for ever");
    let Err(e) = ended else {
        panic!("the job cannot recover, yet its run ended well");
    };
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    let status = status.lock().unwrap();
    assert_eq!(status.state, "failed");
    assert_eq!(status.last_error.as_deref(), Some(e.to_string().as_str()));
}

/// A job whose checkpoint pointer another instance moved on (it took the job over while
/// this one was cut off) writes nothing more, not even a checkpoint blob (a write
/// replaces that epoch's), and stops with a conflict that ends its run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_pointer_moved_on_writes_nothing_more() {
    use std::sync::Arc;

    use signalweave_model::ErrorKind;
    use signalweave_runner::{LiveJob, RunnerMetrics};

    let dir = tempfile::tempdir().unwrap();
    let (lake, spec, config) = strict_setup(dir.path()).await;
    let mut job = LiveJob::recover(lake.clone(), spec, config, Arc::new(RunnerMetrics::new()))
        .await
        .unwrap();
    for _ in 0..5 {
        job.step(false).await.unwrap();
    }
    job.step(true).await.unwrap();
    assert_eq!(job.epoch(), 1);
    sqlx::query("UPDATE sw_checkpoint_pointers SET epoch = 2")
        .execute(lake.control_pool())
        .await
        .unwrap();
    let rows = "select count(*) from signalweave.strict_markets";
    let before = count_rows(&lake, rows).await;
    read_all(&mut job).await;
    let e = job.step(true).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Conflict, "{e}");
    assert!(e.to_string().contains("another instance"), "{e}");
    let written: i64 = sqlx::query_scalar("SELECT count(*) FROM sw_checkpoints WHERE epoch = 2")
        .fetch_one(lake.control_pool())
        .await
        .unwrap();
    assert_eq!(written, 0, "no checkpoint blob of epoch 2");
    assert_eq!(count_rows(&lake, rows).await, before);
}
