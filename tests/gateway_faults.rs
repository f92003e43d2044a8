//! The gateway as a process, under faults: SIGTERM drains; kill -9 while a producer runs
//! loses no acknowledged event and lands nothing twice; an object-store outage of 30 s is
//! answered with 503 + Retry-After, with a bounded queue, and recovers by itself.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use signalweave_model::format_rfc3339_micros;
use signalweave_producer::workload::{DriveReport, EventFactory, EventShape, drive};
use signalweave_producer::{Producer, ProducerConfig};

const T0: &str = "sw-dev-tenant-0";

struct GatewayProc {
    child: Child,
    url: String,
    log: Arc<Mutex<String>>,
}

impl GatewayProc {
    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }
}

fn spawn_gateway(lake: &Path, listen: &str, interval: &str) -> GatewayProc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_signalweave"))
        .current_dir(support::repo())
        .args(["--lake", lake.to_str().unwrap(), "gateway"])
        .args(["--listen", listen, "--commit-interval", interval])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let log = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = std::sync::mpsc::channel();
    let sink = Arc::clone(&log);
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(rest) = line.split("listening on ").nth(1) {
                let url = rest
                    .split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .to_string();
                let _ = tx.send(url);
            }
            let mut l = sink.lock().unwrap();
            l.push_str(&line);
            l.push('\n');
        }
    });
    let url = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("gateway did not start: {}", log.lock().unwrap()));
    GatewayProc { child, url, log }
}

fn sql_row(lake: &Path, query: &str) -> Vec<i64> {
    let out = Command::new(env!("CARGO_BIN_EXE_signalweave"))
        .current_dir(support::repo())
        .args([
            "--lake",
            lake.to_str().unwrap(),
            "sql",
            query,
            "--format",
            "csv",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let row = text.lines().nth(1).unwrap_or_default();
    row.split(',').map(|v| v.trim().parse().unwrap()).collect()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn producer(url: &str, max_age: Duration) -> Producer {
    let mut c = ProducerConfig::new(url, T0);
    c.max_batch_events = 200;
    c.concurrency = 4;
    c.request_timeout = Duration::from_secs(3);
    c.backoff_max = Duration::from_millis(500);
    c.max_unsent_age = max_age;
    Producer::start(c).unwrap()
}

fn assert_all_acknowledged(r: &DriveReport) {
    let s = &r.stats;
    assert_eq!(
        (s.dropped_age, s.dropped_buffer, s.rejected),
        (0, 0, 0),
        "{s:?}"
    );
    assert_eq!(s.accepted + s.duplicate, r.offered, "{s:?}");
}

#[test]
fn sigterm_drains_acknowledges_in_flight_requests_and_exits_zero() {
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let gw = spawn_gateway(&lake, "127.0.0.1:0", "3s");
    let rt = runtime();
    let events: Vec<Value> = (0..100)
        .map(|i| {
            json!({
                "event_id": format!("drain-{i}"), "event_type": "order_placed",
                "schema_version": "1.0.0", "tenant": "tenant-0", "producer_id": "p-1",
                "producer_seq": i, "event_time": format_rfc3339_micros(chrono::Utc::now().timestamp_micros()),
                "order_id": "o", "customer_id": "c", "market_id": "m",
                "payload": {"amount_minor": 100, "currency": "EUR"}
            })
        })
        .collect();
    let url = gw.url.clone();
    let answer = rt.block_on(async {
        let req = tokio::spawn(async move {
            let r = reqwest::Client::new()
                .post(format!("{url}/v1/events"))
                .bearer_auth(T0)
                .header("content-type", "application/json")
                .body(serde_json::to_vec(&events).unwrap())
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let body: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
            (status, body)
        });
        // The request waits for its group (3 s); SIGTERM arrives meanwhile.
        tokio::time::sleep(Duration::from_millis(700)).await;
        gw.signal("-TERM");
        req.await.unwrap()
    });
    assert_eq!(answer.0, 200, "{}", answer.1);
    assert_eq!(answer.1["accepted"], 100);
    let mut gw = gw;
    let status = gw.child.wait().unwrap();
    assert!(status.success(), "exit {status:?}: {}", gw.log());
    assert!(
        gw.log().contains("100 events committed, 0 abandoned"),
        "{}",
        gw.log()
    );
    assert_eq!(
        sql_row(
            &lake,
            "select count(*), count(distinct event_id) from signalweave.events"
        ),
        [100, 100]
    );
}

#[test]
fn kill_9_while_producing_loses_no_acknowledged_event_and_lands_none_twice() {
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let listen = format!("127.0.0.1:{}", support::free_port());
    let mut gw = spawn_gateway(&lake, &listen, "200ms");
    let rt = runtime();
    let url = gw.url.clone();
    let report = rt.block_on(async {
        let factory = EventFactory::new(EventShape {
            event_bytes: 400,
            ..EventShape::new("tenant-0", "kill9")
        });
        let run = tokio::spawn(drive(
            producer(&url, Duration::from_secs(120)),
            factory,
            2_000,
            Duration::from_secs(5),
            Duration::from_secs(60),
        ));
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        gw.child.kill().unwrap(); // SIGKILL
        gw.child.wait().unwrap();
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        let lake = lake.clone();
        let listen = listen.clone();
        let restarted = tokio::task::spawn_blocking(move || spawn_gateway(&lake, &listen, "200ms"))
            .await
            .unwrap();
        let report = run.await.unwrap();
        (report, restarted)
    });
    let (report, restarted) = report;
    assert_all_acknowledged(&report);
    assert!(
        report.stats.failed_requests > 0,
        "the kill was not felt: {:?}",
        report.stats
    );
    restarted.signal("-TERM");
    let mut restarted = restarted;
    assert!(
        restarted.child.wait().unwrap().success(),
        "{}",
        restarted.log()
    );
    assert!(restarted.log().contains("identities in the dedup index"));
    let n = report.offered as i64;
    assert_eq!(
        sql_row(
            &lake,
            "select count(*), count(distinct event_id), min(producer_seq), max(producer_seq) \
             from signalweave.events where producer_id = 'kill9'"
        ),
        [n, n, 1, n]
    );
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[test]
fn an_object_store_outage_is_answered_503_with_a_bounded_queue_and_recovers() {
    if !support::garage_installed() {
        eprintln!("skipped: garage is not installed");
        return;
    }
    let gdir = tempfile::tempdir().unwrap();
    let port = support::garage_ports();
    support::garage("garage-up.sh", gdir.path(), port);
    let profile = gdir.path().join("profile.toml");
    let gw = spawn_gateway(&profile, "127.0.0.1:0", "500ms");
    let rt = runtime();
    let url = gw.url.clone();
    let (report, refusals, max_queue) = rt.block_on(async {
        let factory = EventFactory::new(EventShape {
            event_bytes: 400,
            ..EventShape::new("tenant-0", "outage")
        });
        let run = tokio::spawn(drive(
            producer(&url, Duration::from_secs(180)),
            factory,
            500,
            Duration::from_secs(45),
            Duration::from_secs(90),
        ));
        tokio::time::sleep(Duration::from_secs(4)).await;
        let d = gdir.path().to_path_buf();
        tokio::task::spawn_blocking(move || support::garage("garage-down.sh", &d, port))
            .await
            .unwrap();
        let down_at = Instant::now();
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap();
        let mut refusals = Vec::new();
        let mut max_queue: f64 = 0.0;
        let mut probe = 0;
        while down_at.elapsed() < Duration::from_secs(30) {
            probe += 1;
            let event = json!({
                "event_id": format!("probe-{probe}"), "event_type": "order_placed",
                "schema_version": "1.0.0", "tenant": "tenant-0", "producer_id": "probe",
                "producer_seq": probe, "event_time": format_rfc3339_micros(chrono::Utc::now().timestamp_micros()),
                "order_id": "o", "customer_id": "c", "market_id": "m",
                "payload": {"amount_minor": 100, "currency": "EUR"}
            });
            if let Ok(r) = client
                .post(format!("{url}/v1/events"))
                .bearer_auth(T0)
                .header("content-type", "application/json")
                .body(serde_json::to_vec(&[event]).unwrap())
                .send()
                .await
                && r.status().as_u16() == 503
            {
                let retry = r.headers().get("retry-after").cloned();
                let body: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
                refusals.push((retry, body["error"]["reason"].as_str().unwrap().to_string()));
            }
            if let Ok(r) = client.get(format!("{url}/metrics")).send().await {
                let text = r.text().await.unwrap();
                max_queue = max_queue.max(metric(&text, "signalweave_gateway_queue_bytes"));
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let d = gdir.path().to_path_buf();
        tokio::task::spawn_blocking(move || support::garage("garage-up.sh", &d, port))
            .await
            .unwrap();
        (run.await.unwrap(), refusals, max_queue)
    });
    assert!(!refusals.is_empty(), "no 503 during the outage");
    assert!(
        refusals.iter().all(|(retry, _)| retry.is_some()),
        "{refusals:?}"
    );
    assert!(
        refusals
            .iter()
            .any(|(_, r)| r == "store_unavailable" || r == "commit_pipeline_behind"),
        "{refusals:?}"
    );
    // 30 s of this producer's traffic is ~6 MB; the gateway held a few seconds at most.
    assert!(max_queue < 2_000_000.0, "queue grew to {max_queue} bytes");
    assert!(report.stats.unavailable > 0, "{:?}", report.stats);
    assert_all_acknowledged(&report);
    gw.signal("-TERM");
    let mut gw = gw;
    assert!(gw.child.wait().unwrap().success(), "{}", gw.log());
    let n = report.offered as i64;
    assert_eq!(
        sql_row(
            &profile,
            "select count(*), count(distinct event_id) from signalweave.events where producer_id = 'outage'"
        ),
        [n, n]
    );
    support::garage("garage-down.sh", gdir.path(), port);
}
