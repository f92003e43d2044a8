//! Customer notifications across crashes: the crash table of the effect boundary.
//!
//! Each crash point of the new design is reached for real (`SIGNALWEAVE_EFFECT_FAULT`
//! makes the process stop there) and the process is killed with SIGKILL; a restart then
//! settles. Against a provider that honours idempotency keys every effect is delivered
//! exactly once; against one that does not (and cannot be asked), the effect in flight
//! is left `ambiguous`, never resent blindly, and an operator's resend makes at most one
//! duplicate, counted and reported. A misbehaving provider (503s, answers lost after
//! accepting) ends with every effect delivered once; a backfill namespace sends nothing.
//! The ledger runs on Garage with SQLite and PostgreSQL catalogs too.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use support::cli::{Proc, erase_cmd, get, ok, sw};

/// A lake with customer_features outputs: 20,000 events loaded in commits of 1,000, the
/// live job run until caught up.
fn landed(dir: &Path) -> PathBuf {
    let lake = dir.join("lake");
    land_in(&lake, dir);
    lake
}

/// [`landed`] into `lake` (a directory or a profile).
fn land_in(lake: &Path, dir: &Path) {
    let file = dir.join("events.ndjson");
    ok(sw(lake)
        .args(["fixtures", "generate", "--out"])
        .arg(&file)
        .args([
            "--events",
            "20000",
            "--events-per-sec",
            "2",
            "--late-fraction",
            "0.01",
        ])
        .output()
        .unwrap());
    ok(sw(lake)
        .arg("load")
        .arg(&file)
        .args(["--chunk-records", "1000"])
        .output()
        .unwrap());
    run_until_caught_up(lake);
}

/// Runs the live customer_features job until it has read every landed event.
fn run_until_caught_up(lake: &Path) {
    ok(sw(lake)
        .args([
            "run",
            "--job",
            "jobs/customer_features.toml",
            "--until-caught-up",
        ])
        .output()
        .unwrap());
}

/// Lands `events` more events (seed 2, from the same start of event time, `per_sec` a
/// second), then runs the live job until caught up.
fn land_more(lake: &Path, dir: &Path, events: u64, per_sec: u64) {
    let more = dir.join("more.ndjson");
    ok(sw(lake)
        .args(["fixtures", "generate", "--seed", "2"])
        .args(["--events", &events.to_string()])
        .args(["--events-per-sec", &per_sec.to_string(), "--out"])
        .arg(&more)
        .output()
        .unwrap());
    ok(sw(lake).arg("load").arg(&more).output().unwrap());
    run_until_caught_up(lake);
}

/// A copy of `lake` (the ledger lives in its catalog database).
fn copy(lake: &Path, to: &Path) -> PathBuf {
    let status = Command::new("cp")
        .arg("-r")
        .arg(lake)
        .arg(to)
        .status()
        .unwrap();
    assert!(status.success());
    to.to_path_buf()
}

struct Sink {
    proc: Proc,
    url: String,
}

impl Sink {
    fn start(extra: &[&str]) -> Self {
        let port = support::free_port();
        let proc = Proc::spawn({
            let mut c = sw(Path::new("unused"));
            c.args(["notify-sink", "--listen", &format!("127.0.0.1:{port}")])
                .args(extra);
            c
        });
        proc.wait_log("notify-sink listening", Duration::from_secs(30));
        Self {
            proc,
            url: format!("http://127.0.0.1:{port}"),
        }
    }

    fn deliveries(&self) -> Value {
        serde_json::from_str(&get(&format!("{}/v1/deliveries", self.url)).unwrap()).unwrap()
    }

    fn control(&self, body: &str) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let status = rt.block_on(async {
            reqwest::Client::new()
                .post(format!("{}/v1/control", self.url))
                .header("content-type", "application/json")
                .body(body.to_string())
                .send()
                .await
                .unwrap()
                .status()
        });
        assert!(status.is_success());
    }

    fn stop(self) {
        self.proc.terminate();
    }
}

fn run_effects(lake: &Path, spec: &Path, provider: &str) -> Command {
    let mut c = sw(lake);
    c.args([
        "effects",
        "run",
        "--until-settled",
        "--settle-timeout",
        "20s",
    ])
    .arg("--spec")
    .arg(spec)
    .args(["--provider", provider]);
    c
}

/// Runs `effects run` until it stops at the fault `point`, then kills it with SIGKILL.
fn crash_at(lake: &Path, spec: &Path, provider: &str, point: &str) {
    let mut victim = Proc::spawn({
        let mut c = run_effects(lake, spec, provider);
        c.env("SIGNALWEAVE_EFFECT_FAULT", point);
        c
    });
    victim.wait_log(
        &format!("fault point {point} reached"),
        Duration::from_secs(120),
    );
    victim.child.kill().unwrap(); // SIGKILL
    victim.child.wait().unwrap();
}

fn status(lake: &Path, spec: &Path, namespace: &str) -> Value {
    let out = ok(sw(lake)
        .args([
            "effects",
            "status",
            "--format",
            "json",
            "--namespace",
            namespace,
        ])
        .arg("--spec")
        .arg(spec)
        .output()
        .unwrap());
    serde_json::from_str(&out).unwrap()
}

fn count(status: &Value, state: &str) -> u64 {
    status["counts"][state].as_u64().unwrap_or(0)
}

fn shipped_spec() -> PathBuf {
    support::repo().join("jobs/notifications.toml")
}

/// Every key delivered once; the delivered keys are exactly the ledger's effects.
/// The shipped notification spec with `changes` made, written into `dir`.
fn spec_with(dir: &Path, changes: &[(&str, &str)]) -> PathBuf {
    let mut text = std::fs::read_to_string(shipped_spec()).unwrap();
    for (from, to) in changes {
        assert!(text.contains(from), "the shipped spec has no `{from}`");
        text = text.replace(from, to);
    }
    let spec = dir.join("notifications.toml");
    std::fs::write(&spec, text).unwrap();
    spec
}

fn assert_exactly_once(sink: &Sink, expected: u64, what: &str) {
    let d = sink.deliveries();
    let deliveries = d["deliveries"].as_array().unwrap();
    let mut keys: Vec<&str> = deliveries
        .iter()
        .map(|x| x["key"].as_str().unwrap())
        .collect();
    keys.sort_unstable();
    let n = keys.len();
    keys.dedup();
    assert_eq!(n, keys.len(), "{what}: a key delivered twice");
    assert_eq!(n as u64, expected, "{what}: deliveries");
    assert_eq!(d["duplicates"], 0, "{what}");
}

/// A customer is told at most once per 10 minutes of window starts, although its sliding
/// windows overlap and their starts fall in two cooldown buckets.
fn once_per_cooldown(sink: &Sink) {
    let d = sink.deliveries();
    let mut by_customer: HashMap<String, Vec<i64>> = HashMap::new();
    for x in d["deliveries"].as_array().unwrap() {
        let recipient = x["recipient"].as_str().unwrap().to_string();
        // A customer is a tenant's: the key names both, so tenants never share one.
        assert!(recipient.starts_with("tenant-"), "{recipient}");
        let message = x["message"].as_str().unwrap();
        let start = message
            .rsplit("from ")
            .next()
            .map(|t| t.trim_end_matches('.'))
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
            .unwrap_or_else(|| panic!("no window start in {message}"));
        by_customer
            .entry(recipient)
            .or_default()
            .push(start.timestamp());
    }
    for (customer, mut starts) in by_customer {
        starts.sort_unstable();
        for pair in starts.windows(2) {
            assert!(
                pair[1] - pair[0] >= 600,
                "{customer} told twice within 10 minutes: {starts:?}"
            );
        }
    }
}

#[test]
fn every_crash_point_ends_with_each_effect_delivered_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let lake = landed(dir.path());
    let spec = shipped_spec();

    // The reference: an uninterrupted run.
    let clean = copy(&lake, &dir.path().join("clean"));
    let sink = Sink::start(&[]);
    ok(run_effects(&clean, &spec, &sink.url).output().unwrap());
    let st = status(&clean, &spec, "live");
    let expected = count(&st, "delivered");
    assert!(expected > 50, "{st}");
    assert_exactly_once(&sink, expected, "uninterrupted");
    once_per_cooldown(&sink);
    // Replaying the same outputs derives the same effect ids: nothing new is sent.
    ok(run_effects(&clean, &spec, &sink.url).output().unwrap());
    assert_exactly_once(&sink, expected, "replayed");
    // The notifier's position is held: later outputs land, expiry keeps only the newest
    // snapshot it may, and the notifier resumes from its position.
    land_more(&clean, dir.path(), 30_000, 2);
    ok(sw(&clean)
        .args([
            "lake",
            "expire",
            "--table",
            "customer_features",
            "--retain-last",
            "1",
        ])
        .args(["--older-than-secs", "0"])
        .output()
        .unwrap());
    ok(run_effects(&clean, &spec, &sink.url).output().unwrap());
    let resumed = count(&status(&clean, &spec, "live"), "delivered");
    assert!(resumed > expected, "{resumed} after {expected}");
    // `lake holds` lists the notifier's hold; a retired notifier's hold is released.
    let holds = |lake: &Path| -> Vec<Value> {
        let out = ok(sw(lake)
            .args(["lake", "holds", "--format", "json"])
            .output()
            .unwrap());
        serde_json::from_str(&out).unwrap()
    };
    let notifier_hold = |h: &Value| {
        h["holder"] == "effects:notifications:live" && h["table"] == "customer_features"
    };
    assert!(
        holds(&clean).iter().any(notifier_hold),
        "{:?}",
        holds(&clean)
    );
    ok(sw(&clean)
        .args(["lake", "holds", "--release", "effects:notifications:live"])
        .output()
        .unwrap());
    assert!(!holds(&clean).iter().any(notifier_hold));
    let again = sw(&clean)
        .args(["lake", "holds", "--release", "effects:notifications:live"])
        .output()
        .unwrap();
    assert_eq!(
        again.status.code(),
        Some(2),
        "nothing to release is bad input"
    );
    sink.stop();

    for point in [
        "before_intent",
        "during_checkpoint",
        "after_intent",
        "during_dispatch",
        "after_delivery",
    ] {
        let lake = copy(&lake, &dir.path().join(point));
        let sink = Sink::start(&[]);
        crash_at(&lake, &spec, &sink.url, point);
        let before = status(&lake, &spec, "live");
        match point {
            "before_intent" | "during_checkpoint" => {
                assert!(
                    before["counts"].as_object().unwrap().is_empty(),
                    "{point}: {before}"
                );
            }
            "after_intent" => assert_eq!(count(&before, "intended"), expected, "{point}"),
            _ => assert!(count(&before, "dispatching") >= 1, "{point}: {before}"),
        }
        let out = ok(run_effects(&lake, &spec, &sink.url).output().unwrap());
        let after = status(&lake, &spec, "live");
        assert_eq!(
            count(&after, "delivered"),
            expected,
            "{point}: {after} {out}"
        );
        assert_exactly_once(&sink, expected, point);
        sink.stop();
    }
}

#[test]
fn a_provider_without_idempotency_sees_at_most_one_duplicate_counted_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    let lake = landed(dir.path());
    // The provider neither honours idempotency keys nor answers lookups.
    let spec = spec_with(
        dir.path(),
        &[
            ("provider_lookup = true", "provider_lookup = false"),
            ("provider_idempotent = true", "provider_idempotent = false"),
        ],
    );
    let sink = Sink::start(&["--ignore-idempotency-keys", "--no-lookup"]);
    crash_at(&lake, &spec, &sink.url, "during_dispatch");
    // While a runner's lease stands (here the killed one's, for up to 5 s), reconcile
    // keeps off what it has in flight: refused, exit 3.
    let early = sw(&lake)
        .args([
            "effects",
            "reconcile",
            "--resend-ambiguous",
            "--provider",
            &sink.url,
        ])
        .arg("--spec")
        .arg(&spec)
        .output()
        .unwrap();
    assert_eq!(early.status.code(), Some(3), "{early:?}");
    assert!(
        String::from_utf8_lossy(&early.stderr).contains("one runner at a time"),
        "{early:?}"
    );
    let in_flight = count(&status(&lake, &spec, "live"), "dispatching");
    assert!(in_flight >= 1);
    // The restart never resends what was in flight: it is ambiguous.
    ok(run_effects(&lake, &spec, &sink.url).output().unwrap());
    let st = status(&lake, &spec, "live");
    assert_eq!(count(&st, "ambiguous"), in_flight, "{st}");
    let delivered_once = sink.deliveries()["deliveries"].as_array().unwrap().len();
    assert_eq!(sink.deliveries()["duplicates"], 0);
    // Reconciliation cannot ask this provider: without the operator's resend it leaves
    // them ambiguous (exit 1); with it, each is sent once more.
    let o = sw(&lake)
        .args([
            "effects",
            "reconcile",
            "--format",
            "json",
            "--provider",
            &sink.url,
        ])
        .arg("--spec")
        .arg(&spec)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let o = sw(&lake)
        .args([
            "effects",
            "reconcile",
            "--format",
            "json",
            "--resend-ambiguous",
            "--provider",
            &sink.url,
        ])
        .arg("--spec")
        .arg(&spec)
        .output()
        .unwrap();
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    let dups = sink.deliveries()["duplicates"].as_u64().unwrap();
    assert!(
        dups <= in_flight,
        "at most one duplicate per effect in flight"
    );
    assert_eq!(r["duplicates_seen_by_provider"], dups, "{r}");
    assert_eq!(r["ambiguous_left"], 0, "{r}");
    assert_eq!(o.status.code(), Some(if dups > 0 { 1 } else { 0 }));
    assert_eq!(
        sink.deliveries()["deliveries"].as_array().unwrap().len() as u64,
        delivered_once as u64 + in_flight
    );
    sink.stop();
}

/// A provider down longer than the deadline: the effects fail, reconcile says so (exit 1),
/// and `--retry-failed` sends each once.
#[test]
fn failed_effects_are_reported_and_sent_again_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let lake = landed(dir.path());
    let spec = spec_with(dir.path(), &[("deadline = \"60s\"", "deadline = \"1s\"")]);
    // Nothing listens on port 9: every attempt fails until the deadline.
    ok(run_effects(&lake, &spec, "http://127.0.0.1:9")
        .output()
        .unwrap());
    let st = status(&lake, &spec, "live");
    let failed = count(&st, "failed");
    assert!(failed > 50 && count(&st, "delivered") == 0, "{st}");
    let sink = Sink::start(&[]);
    let reconcile = |retry: bool| {
        let mut c = sw(&lake);
        c.args(["effects", "reconcile", "--format", "json"])
            .args(["--provider", &sink.url])
            .arg("--spec")
            .arg(&spec);
        if retry {
            c.arg("--retry-failed");
        }
        c.output().unwrap()
    };
    let told = reconcile(false);
    assert_eq!(told.status.code(), Some(1), "{told:?}");
    let v: Value = serde_json::from_slice(&told.stdout).unwrap();
    assert_eq!(v["failed_left"], failed, "{v}");
    let retried = reconcile(true);
    assert_eq!(retried.status.code(), Some(0), "{retried:?}");
    let v: Value = serde_json::from_slice(&retried.stdout).unwrap();
    assert_eq!(
        (v["failed_retried"].as_u64(), v["failed_left"].as_u64()),
        (Some(failed), Some(0)),
        "{v}"
    );
    assert_exactly_once(&sink, failed, "retried");

    // A new notification job started at the latest output notifies none of the history.
    let fresh = dir.path().join("fresh.toml");
    std::fs::write(
        &fresh,
        std::fs::read_to_string(&spec)
            .unwrap()
            .replace("name = \"notifications\"", "name = \"notifications_fresh\""),
    )
    .unwrap();
    let mut c = run_effects(&lake, &fresh, &sink.url);
    c.args(["--start-at", "latest"]);
    let out = c.output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("first start at the latest"));
    let st = status(&lake, &fresh, "live");
    assert_eq!(count(&st, "delivered") + count(&st, "intended"), 0, "{st}");
    assert_exactly_once(&sink, failed, "nothing more sent");
    sink.stop();
}

/// A provider that honours idempotency keys but answers no lookups (501). An effect whose
/// answer was lost cannot be looked up; with `provider_idempotent` it is sent again under
/// its key, and the provider answers with the first delivery. Without it, it stays
/// ambiguous: nothing shows that sending again is safe.
#[test]
fn an_unanswered_lookup_is_retried_only_when_the_provider_honours_keys() {
    let dir = tempfile::tempdir().unwrap();
    let lake = landed(dir.path());
    let spec = shipped_spec();
    let sink = Sink::start(&["--no-lookup"]);
    sink.control(r#"{"drop_next": 3}"#);
    ok(run_effects(&lake, &spec, &sink.url).output().unwrap());
    let st = status(&lake, &spec, "live");
    let delivered = count(&st, "delivered");
    assert!(delivered > 50, "{st}");
    assert_eq!(st["counts"].as_object().unwrap().len(), 1, "{st}");
    assert_exactly_once(&sink, delivered, "keys honoured");
    // The three lost answers were sent again and answered with their first delivery.
    assert_eq!(sink.deliveries()["replays"], 3, "{}", sink.deliveries());

    // The same job under another name, not trusting the provider with its keys.
    let strict = spec_with(
        dir.path(),
        &[
            (
                "name = \"notifications\"",
                "name = \"notifications_strict\"",
            ),
            ("provider_idempotent = true", "provider_idempotent = false"),
        ],
    );
    sink.control(r#"{"drop_next": 3}"#);
    let _ = run_effects(&lake, &strict, &sink.url).output().unwrap();
    let st = status(&lake, &strict, "live");
    assert_eq!(count(&st, "ambiguous"), 3, "{st}");
    assert_eq!(count(&st, "delivered"), delivered - 3, "{st}");
    // Nothing was sent twice: the sink delivered each key of both jobs once.
    assert_exactly_once(&sink, 2 * delivered, "ambiguous left alone");
    assert_eq!(sink.deliveries()["replays"], 3, "{}", sink.deliveries());
    sink.stop();
}

#[test]
fn a_misbehaving_provider_and_a_backfill_namespace() {
    let dir = tempfile::tempdir().unwrap();
    let lake = landed(dir.path());
    let spec = shipped_spec();
    let sink = Sink::start(&[]);
    // 503 for the first 20 requests, then the answers of 3 accepted requests are held
    // past the client's timeout: retries and lookups end with each delivered once.
    sink.control(r#"{"fail_next": 20, "drop_next": 3}"#);
    ok(run_effects(&lake, &spec, &sink.url).output().unwrap());
    let st = status(&lake, &spec, "live");
    let delivered = count(&st, "delivered");
    assert!(delivered > 50, "{st}");
    assert_eq!(st["counts"].as_object().unwrap().len(), 1, "{st}");
    assert_exactly_once(&sink, delivered, "misbehaving provider");
    assert!(sink.deliveries()["requests"].as_u64().unwrap() >= delivered + 20);
    let listed: Value = serde_json::from_str(&ok(sw(&lake)
        .args([
            "effects",
            "status",
            "--format",
            "json",
            "--list",
            "delivered",
        ])
        .output()
        .unwrap()))
    .unwrap();
    let retried = listed["effects"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["attempts"].as_i64().unwrap() > 1)
        .count();
    assert!(retried >= 16, "503s were retried: {retried}");
    let horizon = &st["required_retention_s"];
    assert!(st["retention_s"].as_u64() >= horizon.as_u64(), "{st}");

    // One runner per job and namespace: a second one is refused while the first holds
    // the lease; a clean stop gives it up at once.
    let first = Proc::spawn({
        let mut c = sw(&lake);
        c.args(["effects", "run", "--provider", &sink.url]);
        c
    });
    first.wait_log("effects: notifications", Duration::from_secs(60));
    let second = || {
        sw(&lake)
            .args([
                "effects",
                "run",
                "--until-settled",
                "--lease-wait",
                "1s",
                "--provider",
                &sink.url,
            ])
            .output()
            .unwrap()
    };
    let o = second();
    assert_eq!(
        o.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("one runner at a time"));
    first.terminate();
    ok(second());

    // A backfill of the source job: the same spec records would_send, sends nothing.
    ok(sw(&lake)
        .args([
            "backfill",
            "start",
            "--job",
            "customer_features",
            "--from",
            "2026-01-01T00:00:00Z",
            "--to",
            "2026-01-01T12:00:00Z",
            "--namespace",
            "replay",
            "--quiet",
        ])
        .output()
        .unwrap());
    let requests = sink.deliveries()["requests"].as_u64().unwrap();
    ok(sw(&lake)
        .args(["effects", "run", "--until-settled", "--namespace", "replay"])
        .output()
        .unwrap());
    let bf = status(&lake, &spec, "replay");
    assert!(count(&bf, "would_send") > 50, "{bf}");
    assert_eq!(bf["counts"].as_object().unwrap().len(), 1, "{bf}");
    assert_eq!(sink.deliveries()["requests"].as_u64().unwrap(), requests);
    sink.stop();

    // Expiry is per namespace: the backfill's effects, made old, go; the live effects and
    // their attempts (the same effect ids) stay.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let figures = || {
        rt.block_on(async {
            let l = signalweave_lake::Lake::open(signalweave_lake::LakeConfig::embedded(&lake))
                .await
                .unwrap();
            let n = |sql: &'static str| {
                let pool = l.control_pool().clone();
                async move {
                    sqlx::query_scalar::<_, i64>(sql)
                        .fetch_one(&pool)
                        .await
                        .unwrap()
                }
            };
            (
                n("SELECT COUNT(*) FROM sw_effects WHERE namespace = 'live'").await,
                n("SELECT COUNT(*) FROM sw_effect_attempts WHERE namespace = 'live'").await,
                n("SELECT COUNT(*) FROM sw_effects WHERE namespace = 'replay'").await,
            )
        })
    };
    let (live, live_attempts, replay) = figures();
    assert!(live > 0 && live_attempts > 0 && replay > 0);
    rt.block_on(async {
        let l = signalweave_lake::Lake::open(signalweave_lake::LakeConfig::embedded(&lake))
            .await
            .unwrap();
        sqlx::query("UPDATE sw_effects SET created_ms = 0 WHERE namespace = 'replay'")
            .execute(l.control_pool())
            .await
            .unwrap();
    });
    ok(sw(&lake)
        .args(["effects", "expire", "--namespace", "replay"])
        .output()
        .unwrap());
    assert_eq!(figures(), (live, live_attempts, 0));

    // Bad input: a classified error.
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        std::fs::read_to_string(&spec)
            .unwrap()
            .replace("retention = \"8days\"", "retention = \"1h\""),
    )
    .unwrap();
    let o = sw(&lake)
        .args([
            "effects",
            "run",
            "--until-settled",
            "--provider",
            "http://127.0.0.1:9",
        ])
        .arg("--spec")
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("ledger.retention"));
    let o = sw(&lake)
        .args(["effects", "run", "--until-settled"])
        .output()
        .unwrap();
    assert_ne!(o.status.code(), Some(0));
}

#[test]
fn the_ledger_works_on_s3_with_sqlite_and_postgresql_catalogs() {
    for (b, lake) in support::s3_backends() {
        land_in(&lake, b.dir.path());
        let spec = shipped_spec();
        let sink = Sink::start(&[]);
        crash_at(&lake, &spec, &sink.url, "during_dispatch");
        assert!(
            count(&status(&lake, &spec, "live"), "dispatching") >= 1,
            "{}",
            b.name
        );
        ok(run_effects(&lake, &spec, &sink.url).output().unwrap());
        let st = status(&lake, &spec, "live");
        let delivered = count(&st, "delivered");
        assert!(delivered > 50, "{}: {st}", b.name);
        assert_eq!(
            st["counts"].as_object().unwrap().len(),
            1,
            "{}: {st}",
            b.name
        );
        assert_exactly_once(&sink, delivered, b.name);
        sink.stop();
    }
}

#[test]
fn up_runs_notifications_beside_the_live_jobs() {
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    // The synthetic producer's orders rarely reach the shipped threshold in 10 minutes.
    let spec = spec_with(dir.path(), &[("threshold = 1000000", "threshold = 100000")]);
    let sink = Sink::start(&[]);
    let (gw, serve) = (support::free_port(), support::free_port());
    // Started elsewhere than the repository, with absolute paths: the notifications find
    // their source job's spec beside the `--job` that runs it.
    let repo = support::repo();
    let up = Proc::spawn({
        let mut c = sw(&lake);
        c.current_dir(dir.path())
            .arg("--schemas")
            .arg(repo.join("catalog/events"))
            .arg("up")
            .arg("--job")
            .arg(repo.join("jobs/customer_features.toml"))
            .arg("--gateway-config")
            .arg(repo.join("catalog/gateway/dev.toml"))
            .args(["--poll-interval", "300ms"])
            .args(["--gateway-listen", &format!("127.0.0.1:{gw}")])
            .args(["--serve-listen", &format!("127.0.0.1:{serve}")])
            .arg("--notify")
            .arg(&spec)
            .args(["--notify-provider", &sink.url]);
        c
    });
    up.wait_log("signalweave up:", Duration::from_secs(60));
    ok(sw(&lake)
        .args(["produce", "--url", &format!("http://127.0.0.1:{gw}")])
        .args([
            "--rate",
            "1000",
            "--duration",
            "5s",
            "--producer-id",
            "notify-test",
        ])
        .output()
        .unwrap());
    support::cli::wait_until("notifications delivered", Duration::from_secs(90), || {
        sink.deliveries()["deliveries"].as_array().unwrap().len() > 10
    });
    up.terminate();
    let st = status(&lake, &spec, "live");
    let delivered = count(&st, "delivered");
    assert!(delivered > 10, "{st}");
    assert_eq!(count(&st, "ambiguous") + count(&st, "failed"), 0, "{st}");
    // Whatever was still intended at the stop is sent by the next runner, once.
    ok(run_effects(&lake, &spec, &sink.url).output().unwrap());
    let st = status(&lake, &spec, "live");
    assert_exactly_once(&sink, count(&st, "delivered"), "up");
    sink.stop();
}

/// An erasure takes the customer from every output keyed by them, live and backfilled,
/// and from the effect ledger: no key, no message and no answer of the provider's is left
/// of them; the other customers' rows and effects are as they were. Run again, it finds
/// nothing more.
#[test]
fn an_erasure_takes_the_customer_from_outputs_and_effects() {
    let dir = tempfile::tempdir().unwrap();
    let lake = landed(dir.path());
    let spec = shipped_spec();
    let sink = Sink::start(&[]);
    ok(run_effects(&lake, &spec, &sink.url).output().unwrap());
    ok(sw(&lake)
        .args(["backfill", "start", "--job", "customer_features"])
        .args([
            "--from",
            "2026-01-01T00:00:00Z",
            "--to",
            "2026-01-01T12:00:00Z",
        ])
        .args(["--namespace", "replay", "--quiet"])
        .output()
        .unwrap());
    ok(sw(&lake)
        .args(["effects", "run", "--until-settled", "--namespace", "replay"])
        .output()
        .unwrap());

    // More outputs the live notifier has not read: it is behind at the erasure. (The
    // events of the last 1,200 s are within the live job's allowed lateness.)
    land_more(&lake, dir.path(), 4_000, 1);

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let control = rt.block_on(async {
        signalweave_lake::Lake::open(signalweave_lake::LakeConfig::embedded(&lake))
            .await
            .unwrap()
            .control_pool()
            .clone()
    });
    let scalar = |sql: &str, key: &str| -> i64 {
        rt.block_on(
            sqlx::query_scalar::<_, i64>(sql)
                .bind(key.to_string())
                .fetch_one(&control),
        )
        .unwrap()
    };
    // The subject: a customer told of their orders.
    let key: String = rt
        .block_on(
            sqlx::query_scalar(
                "SELECT effect_key FROM sw_effects WHERE namespace = 'live' \
                 AND state = 'delivered' ORDER BY effect_id LIMIT 1",
            )
            .fetch_one(&control),
        )
        .unwrap();
    let customer = signalweave_model::split_key(&key).pop().unwrap();
    let effects_of =
        |key: &str| scalar("SELECT COUNT(*) FROM sw_effects WHERE effect_key = ?", key);
    let answered_of = |key: &str| {
        scalar(
            "SELECT COUNT(*) FROM sw_effect_attempts a JOIN sw_effects e ON \
             e.catalog_name = a.catalog_name AND e.namespace = a.namespace \
             AND e.effect_id = a.effect_id WHERE e.effect_key = ? AND a.answer IS NOT NULL",
            key,
        )
    };
    let mentions = || {
        scalar(
            "SELECT COUNT(*) FROM sw_effects WHERE message LIKE ?",
            &format!("%{key}:%"),
        )
    };
    let rows = |table: &str, cond: &str| {
        support::cli::count(
            &lake,
            &format!("select count(*) from signalweave.{table} where {cond}"),
        )
    };
    let theirs = format!("key = '{}'", key.replace('\'', "''"));
    let tables = ["customer_features", "customer_features__bf_replay"];
    let before: Vec<(i64, i64)> = tables
        .iter()
        .map(|t| (rows(t, &theirs), rows(t, "true")))
        .collect();
    for (t, (mine, _)) in tables.iter().zip(&before) {
        assert!(*mine > 0, "{t} has no rows of {key}");
    }
    let plain = |sql: &str| -> i64 {
        rt.block_on(sqlx::query_scalar::<_, i64>(sql).fetch_one(&control))
            .unwrap()
    };
    let (effects, all_effects) = (effects_of(&key), plain("SELECT COUNT(*) FROM sw_effects"));
    assert!(
        effects >= 2,
        "a live and a replayed effect of {key}: {effects}"
    );
    assert!(mentions() > 0);
    let answered = answered_of(&key);
    let answers = "SELECT COUNT(*) FROM sw_effect_attempts WHERE answer IS NOT NULL";
    let others_answered = plain(answers) - answered;

    let erase = || {
        let out = ok(erase_cmd(&lake, &key)
            .args(["--format", "json"])
            .output()
            .unwrap());
        let report: Vec<Value> = serde_json::from_str(&out).unwrap();
        report
            .into_iter()
            .map(|r| {
                let n = r["rows erased"]
                    .as_str()
                    .unwrap_or("0")
                    .parse()
                    .unwrap_or(0);
                (r["table"].as_str().unwrap().to_string(), n)
            })
            .collect::<HashMap<String, i64>>()
    };
    let erased = erase();
    for (t, (mine, all)) in tables.iter().zip(&before) {
        assert_eq!(erased[*t], *mine, "{t}: {erased:?}");
        assert_eq!(rows(t, &theirs), 0, "{t}");
        assert_eq!(
            rows(t, "true"),
            all - mine,
            "{t}: other customers' rows stay"
        );
    }
    assert_eq!(erased["sw_effects"], effects, "{erased:?}");
    assert_eq!(effects_of(&key), 0);
    assert_eq!(mentions(), 0);
    assert_eq!(
        plain("SELECT COUNT(*) FROM sw_effects"),
        all_effects,
        "effects are kept, without the subject"
    );
    assert_eq!(
        plain("SELECT COUNT(*) FROM sw_effects WHERE effect_key = '' AND message = ''"),
        effects
    );
    assert_eq!(
        plain(answers),
        others_answered,
        "{answered} answers of the subject's went, no other"
    );
    // The record counts the ledger's rows too, and names no value.
    let record: String = rt
        .block_on(
            sqlx::query_scalar(
                "SELECT tables_json FROM sw_erasures ORDER BY erased_ms DESC LIMIT 1",
            )
            .fetch_one(&control),
        )
        .unwrap();
    assert!(record.contains("sw_effects"), "{record}");
    assert!(!record.contains(customer.as_str()), "{record}");

    // The readers caught up at the erasure go on from it: the live job, and the
    // notifier of the backfill's outputs, which records nothing new.
    run_until_caught_up(&lake);
    ok(sw(&lake)
        .args(["effects", "run", "--until-settled", "--namespace", "replay"])
        .output()
        .unwrap());
    assert_eq!(plain("SELECT COUNT(*) FROM sw_effects"), all_effects);
    // The live notifier was behind: its position expired with the snapshots before the
    // erasure. It stops, saying how to go on, and goes on when told to.
    let stuck = run_effects(&lake, &spec, &sink.url).output().unwrap();
    assert!(!stuck.status.success(), "{stuck:?}");
    assert!(
        String::from_utf8_lossy(&stuck.stderr).contains("--skip-expired"),
        "{stuck:?}"
    );
    ok(run_effects(&lake, &spec, &sink.url)
        .arg("--skip-expired")
        .output()
        .unwrap());
    ok(run_effects(&lake, &spec, &sink.url).output().unwrap());
    sink.stop();
    assert_eq!(plain("SELECT COUNT(*) FROM sw_effects"), all_effects);
    let again = erase();
    for t in tables.iter().chain(&["sw_effects"]) {
        assert_eq!(again[*t], 0, "{t}: {again:?}");
    }
}

/// A serving view drops an erased customer's windows as soon as the erasure's rewrite
/// commits, before its expiry: the view reads the table again when rows were removed,
/// where it used to skip the rewrite and keep serving them.
#[test]
fn a_serving_view_lets_an_erased_customer_go_at_the_rewrite() {
    let dir = tempfile::tempdir().unwrap();
    let lake = landed(dir.path());
    let key = support::cli::sql(
        &lake,
        "select key from signalweave.customer_features order by key limit 1",
    )[0]["key"]
        .as_str()
        .unwrap()
        .to_string();
    let port = support::free_port();
    let base = format!("http://127.0.0.1:{port}");
    let serving = Proc::spawn({
        let mut c = sw(&lake);
        c.args(["run", "--job", "jobs/customer_features.toml"])
            .args(["--serve", &format!("127.0.0.1:{port}")]);
        c
    });
    support::cli::wait_until("serving", Duration::from_secs(30), || {
        get(&format!("{base}/healthz")).is_some()
    });
    let windows = || -> usize {
        let url = format!(
            "{base}/v1/jobs/customer_features/aggregates?key={}",
            key.replace('|', "%7C")
        );
        let answer: Value = serde_json::from_str(&get(&url).unwrap()).unwrap();
        answer["windows"].as_array().unwrap().len()
    };
    assert!(windows() > 0, "{key} is served");
    let stopped = erase_cmd(&lake, &key)
        .env("SIGNALWEAVE_ERASE_FAULT", "before_expiry")
        .output()
        .unwrap();
    assert!(!stopped.status.success(), "{stopped:?}");
    assert_eq!(windows(), 0, "{key} is served after its erasure's rewrite");
    serving.terminate();
}

/// A job whose state holds an erased customer's open windows leaves them out of what it
/// commits after the erasure: restored from its checkpoint, it fires them on time as the
/// watermark passes, and none of their versions reaches the table, while other windows'
/// do. (Before, the erased events came back in those versions.)
#[test]
fn a_running_job_leaves_an_erased_customers_windows_out() {
    let dir = tempfile::tempdir().unwrap();
    let lake = landed(dir.path());
    // The customer of the newest order: its windows are still open.
    let newest = support::cli::sql(
        &lake,
        "select tenant, customer_id from signalweave.events where event_type = 'order_placed' \
         order by event_time desc, event_id limit 1",
    );
    let (tenant, customer) = (
        newest[0]["tenant"].as_str().unwrap(),
        newest[0]["customer_id"].as_str().unwrap(),
    );
    let key = signalweave_model::join_key(&[tenant, customer]);
    let range = support::cli::sql(
        &lake,
        &format!(
            "select cast(min(event_time) as varchar) lo, cast(max(event_time) as varchar) hi \
             from signalweave.events where tenant = '{tenant}' and customer_id = '{customer}'"
        ),
    );
    let (lo, hi) = (
        range[0]["lo"].as_str().unwrap().to_string(),
        range[0]["hi"].as_str().unwrap().to_string(),
    );
    let erased_windows = || {
        support::cli::count(
            &lake,
            &format!(
                "select count(*) from signalweave.customer_features where key = '{key}' \
                 and window_start <= '{hi}' and window_end > '{lo}'"
            ),
        )
    };
    let all = || support::cli::count(&lake, "select count(*) from signalweave.customer_features");
    // (Its newest windows are in the job's state only: no version of them is written yet.)
    ok(erase_cmd(&lake, &key).output().unwrap());
    assert_eq!(erased_windows(), 0);
    let before = all();
    // Event time moves on past every window the state holds open, and further than they
    // can change (6 h 40 min, where they settle 2 h 10 min after their events).
    land_more(&lake, dir.path(), 24_000, 1);
    assert!(all() > before, "other windows go on being written");
    assert_eq!(
        erased_windows(),
        0,
        "versions of {key}'s erased windows were written after the erasure"
    );
}
