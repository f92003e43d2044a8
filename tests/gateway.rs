//! The ingestion gateway, in process, on an embedded lake: the acknowledgment boundary,
//! duplicates across a restart, classified bad input (table-driven and fuzzed), quotas
//! and tenant isolation, overload answers, compressed bodies.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::HashMap;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use serde_json::{Value, json};
use signalweave_gateway::{CommitterReport, Gateway, GatewayConfig};
use signalweave_lake::{Lake, LakeConfig, LakeTable};
use signalweave_model::{SchemaRegistry, format_rfc3339_micros};
use tokio::sync::oneshot;

const T0: &str = "sw-dev-tenant-0";
const T1: &str = "sw-dev-tenant-1";

fn dev_config() -> GatewayConfig {
    let text = std::fs::read_to_string(support::repo().join("catalog/gateway/dev.toml")).unwrap();
    let mut c: GatewayConfig = toml::from_str(&text).unwrap();
    c.listen = "127.0.0.1:0".parse().unwrap();
    c.commit.interval = Duration::from_millis(100);
    c
}

fn registry() -> Arc<SchemaRegistry> {
    Arc::new(SchemaRegistry::load_dir(support::repo().join("catalog/events")).unwrap())
}

struct Running {
    url: String,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<signalweave_gateway::Result<CommitterReport>>,
}

impl Running {
    async fn stop(mut self) -> CommitterReport {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.task.await.unwrap().unwrap()
    }
}

async fn start(config: GatewayConfig, lake_config: &LakeConfig) -> Running {
    let lake = Lake::open(lake_config.clone()).await.unwrap();
    lake.init().await.unwrap();
    let listener = tokio::net::TcpListener::bind(config.listen).await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let gateway = Gateway::start(config, lake, registry()).await.unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(gateway.serve(listener, async move {
        let _ = rx.await;
    }));
    Running {
        url: format!("http://{addr}"),
        stop: Some(tx),
        task,
    }
}

/// One event time for every event of the test binary: a retry resends its event as it
/// was, so the helpers make the same event for the same id.
fn event_time() -> &'static str {
    static AT: LazyLock<String> =
        LazyLock::new(|| format_rfc3339_micros(chrono::Utc::now().timestamp_micros()));
    &AT
}

fn event(id: &str, tenant: &str, producer: &str) -> Value {
    json!({
        "event_id": id, "event_type": "order_placed", "schema_version": "1.1.0",
        "tenant": tenant, "producer_id": producer, "producer_seq": 1,
        "event_time": event_time(), "order_id": format!("o-{id}"), "customer_id": "c-1",
        "market_id": "m-1", "payload": {"amount_minor": 1250, "currency": "EUR"}
    })
}

struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: Value,
}

async fn post_raw(
    url: &str,
    token: Option<&str>,
    content_type: Option<&str>,
    encoding: Option<&str>,
    body: Vec<u8>,
) -> Answer {
    let client = reqwest::Client::new();
    let mut req = client.post(format!("{url}/v1/events")).body(body);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    if let Some(ct) = content_type {
        req = req.header("content-type", ct);
    }
    if let Some(e) = encoding {
        req = req.header("content-encoding", e);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = resp.bytes().await.unwrap();
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Answer {
        status,
        headers,
        body,
    }
}

async fn post(url: &str, token: &str, events: &[Value]) -> Answer {
    post_raw(
        url,
        Some(token),
        Some("application/json"),
        None,
        serde_json::to_vec(events).unwrap(),
    )
    .await
}

/// The value of the first line of the gateway's `/metrics` that `line` picks.
async fn metric(url: &str, line: impl Fn(&str) -> bool) -> f64 {
    let metrics = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    metrics
        .lines()
        .find(|l| line(l))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("{metrics}"))
}

/// `(tenant, event_id)` → times landed, over the whole events table.
async fn landed(lake_config: &LakeConfig) -> HashMap<(String, String), usize> {
    let lake = Lake::open(lake_config.clone()).await.unwrap();
    let plan = lake
        .plan_time_range(LakeTable::Events, i64::MIN, i64::MAX, None)
        .await
        .unwrap();
    let mut out = HashMap::new();
    if plan.tasks.is_empty() {
        return out;
    }
    let batches: Vec<_> = lake
        .read(LakeTable::Events, plan.tasks)
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    for b in batches {
        let ids = arrow::array::AsArray::as_string::<i32>(b.column_by_name("event_id").unwrap());
        let tenants = arrow::array::AsArray::as_string::<i32>(b.column_by_name("tenant").unwrap());
        for i in 0..b.num_rows() {
            *out.entry((tenants.value(i).to_string(), ids.value(i).to_string()))
                .or_default() += 1;
        }
    }
    out
}

async fn rejection_reasons(lake_config: &LakeConfig) -> Vec<String> {
    let mut out: Vec<String> = rejection_rows(lake_config, &["reason_code"])
        .await
        .into_iter()
        .filter_map(|mut row| row.remove(0))
        .collect();
    out.sort();
    out
}

/// `columns` of every row of the rejections table (a null as None), in the table's order.
async fn rejection_rows(lake_config: &LakeConfig, columns: &[&str]) -> Vec<Vec<Option<String>>> {
    let lake = Lake::open(lake_config.clone()).await.unwrap();
    let plan = lake
        .plan_time_range(LakeTable::Rejections, i64::MIN, i64::MAX, None)
        .await
        .unwrap();
    if plan.tasks.is_empty() {
        return Vec::new();
    }
    let mut rows = Vec::new();
    for b in lake
        .read_all(LakeTable::Rejections, plan.tasks)
        .await
        .unwrap()
    {
        let cols: Vec<_> = columns
            .iter()
            .map(|c| arrow::array::AsArray::as_string::<i32>(b.column_by_name(c).unwrap()))
            .collect();
        rows.extend((0..b.num_rows()).map(|i| {
            cols.iter()
                .map(|c| (!arrow::array::Array::is_null(c, i)).then(|| c.value(i).to_string()))
                .collect()
        }));
    }
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acknowledgment_means_committed_and_retries_are_duplicates_across_a_restart() {
    let backend = support::embedded();
    let gw = start(dev_config(), &backend.config).await;
    let a = post(
        &gw.url,
        T0,
        &[
            event("a-1", "tenant-0", "p-1"),
            event("a-2", "tenant-0", "p-1"),
        ],
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.body["accepted"], 2);
    let snapshot = a.body["snapshot_id"].as_i64().unwrap();
    // Visible the moment the acknowledgment arrives: the commit already happened.
    let lake = Lake::open(backend.config.clone()).await.unwrap();
    let snaps = lake.snapshots(LakeTable::Events).await.unwrap();
    let s = snaps
        .iter()
        .find(|s| s.snapshot_id == snapshot)
        .expect("acked snapshot exists");
    assert_eq!(s.added_records, 2);
    assert!(s.writer_id.as_deref().unwrap().starts_with("gateway-dev-"));
    let got = landed(&backend.config).await;
    assert_eq!(got.len(), 2);

    // A retry, and a repeat inside one request: acknowledged as duplicates.
    let b = post(
        &gw.url,
        T0,
        &[
            event("a-1", "tenant-0", "p-1"),
            event("a-3", "tenant-0", "p-1"),
            event("a-3", "tenant-0", "p-1"),
        ],
    )
    .await;
    assert_eq!(b.status, 200, "{}", b.body);
    assert_eq!(
        (b.body["accepted"].as_u64(), b.body["duplicate"].as_u64()),
        (Some(1), Some(2))
    );
    let statuses: Vec<&str> = b.body["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses, ["duplicate", "accepted", "duplicate"]);
    // The same event id under another tenant is a different event.
    let c = post(&gw.url, T1, &[event("a-1", "tenant-1", "producer-1-0")]).await;
    assert_eq!(c.body["accepted"], 1, "{}", c.body);

    // Concurrent retries of one event: exactly one lands.
    let mut joins = Vec::new();
    for _ in 0..8 {
        let url = gw.url.clone();
        joins.push(tokio::spawn(async move {
            post(&url, T0, &[event("race-1", "tenant-0", "p-1")]).await
        }));
    }
    let mut accepted = 0;
    for j in joins {
        let r = j.await.unwrap();
        assert_eq!(r.status, 200);
        accepted += r.body["accepted"].as_u64().unwrap();
    }
    assert_eq!(accepted, 1);
    let report = gw.stop().await;
    assert_eq!(report.abandoned_events, 0);

    // After a restart the index is rebuilt from the landing table.
    let gw = start(dev_config(), &backend.config).await;
    let d = post(
        &gw.url,
        T0,
        &[
            event("a-2", "tenant-0", "p-1"),
            event("race-1", "tenant-0", "p-1"),
        ],
    )
    .await;
    assert_eq!(d.body["duplicate"], 2, "{}", d.body);
    gw.stop().await;
    let got = landed(&backend.config).await;
    assert_eq!(got.len(), 5);
    assert!(got.values().all(|n| *n == 1), "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_event_under_an_accepted_identity_is_refused_as_a_conflict_across_a_restart() {
    let backend = support::embedded();
    let gw = start(dev_config(), &backend.config).await;
    let original = event("c-1", "tenant-0", "p-1");
    let a = post(&gw.url, T0, std::slice::from_ref(&original)).await;
    assert_eq!(a.status, 200, "{}", a.body);

    // The same identity with another amount: refused, with the reason and evidence.
    let mut changed = original.clone();
    changed["payload"]["amount_minor"] = json!(999);
    let b = post(&gw.url, T0, std::slice::from_ref(&changed)).await;
    assert_eq!(b.status, 409, "{}", b.body);
    assert_eq!(b.body["rejected"], 1, "{}", b.body);
    assert_eq!(b.body["results"][0]["reason"], "identity_conflict");
    assert!(
        b.body["results"][0]["detail"]
            .as_str()
            .unwrap()
            .contains("`c-1`"),
        "{}",
        b.body
    );
    // A true retry (the producer may number it anew) is still a duplicate.
    let mut retry = original.clone();
    retry["producer_seq"] = json!(42);
    let c = post(&gw.url, T0, &[retry.clone()]).await;
    assert_eq!(
        (c.status, c.body["duplicate"].as_u64()),
        (200, Some(1)),
        "{}",
        c.body
    );

    // Inside one request: the first lands, its changed twin is refused, others pass.
    let first = event("c-2", "tenant-0", "p-1");
    let mut twin = first.clone();
    twin["market_id"] = json!("m-9");
    let d = post(&gw.url, T0, &[first, twin, event("c-3", "tenant-0", "p-1")]).await;
    assert_eq!(d.status, 207, "{}", d.body);
    let statuses: Vec<&str> = d.body["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses, ["accepted", "rejected", "accepted"], "{}", d.body);
    assert_eq!(
        (d.body["accepted"].as_u64(), d.body["rejected"].as_u64()),
        (Some(2), Some(1))
    );
    gw.stop().await;

    // The index is rebuilt with what each identity's event said.
    let gw = start(dev_config(), &backend.config).await;
    let e = post(&gw.url, T0, &[changed.clone(), retry]).await;
    assert_eq!(e.status, 207, "{}", e.body);
    assert_eq!(
        e.body["results"][0]["reason"], "identity_conflict",
        "{}",
        e.body
    );
    assert_eq!(e.body["results"][1]["status"], "duplicate", "{}", e.body);
    gw.stop().await;

    let got = landed(&backend.config).await;
    assert_eq!(got.len(), 3, "{got:?}");
    assert!(got.values().all(|n| *n == 1), "{got:?}");
    let conflicts: Vec<_> = rejection_rows(&backend.config, &["reason_code", "tenant", "event_id"])
        .await
        .into_iter()
        .filter(|r| r[0].as_deref() == Some("identity_conflict"))
        .collect();
    assert_eq!(conflicts.len(), 3, "{conflicts:?}");
    assert!(
        conflicts
            .iter()
            .all(|r| r[1].as_deref() == Some("tenant-0"))
    );
    let mut ids: Vec<_> = conflicts.iter().filter_map(|r| r[2].as_deref()).collect();
    ids.sort();
    assert_eq!(ids, ["c-1", "c-1", "c-2"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_larger_than_a_chunk_is_encoded_while_it_fills_and_commits_once() {
    let backend = support::embedded();
    let mut config = dev_config();
    config.commit.interval = Duration::from_millis(1500);
    let gw = start(config, &backend.config).await;
    let mut joins = Vec::new();
    for r in 0..3 {
        let url = gw.url.clone();
        joins.push(tokio::spawn(async move {
            let batch: Vec<Value> = (0..4_000)
                .map(|i| event(&format!("big-{r}-{i}"), "tenant-0", "p-1"))
                .collect();
            post(&url, T0, &batch).await
        }));
    }
    let mut snapshots = std::collections::HashSet::new();
    for j in joins {
        let a = j.await.unwrap();
        assert_eq!((a.status, a.body["accepted"].as_u64()), (200, Some(4_000)));
        snapshots.insert(a.body["snapshot_id"].as_i64().unwrap());
    }
    gw.stop().await;
    let got = landed(&backend.config).await;
    assert_eq!(got.len(), 12_000);
    assert!(got.values().all(|n| *n == 1));
    let lake = Lake::open(backend.config.clone()).await.unwrap();
    let snaps = lake.snapshots(LakeTable::Events).await.unwrap();
    // 12,000 rows arrived within one interval: more than one encoding chunk (8,192 rows),
    // and they were committed by as many commits as the acknowledgments named.
    assert_eq!(snaps.len(), snapshots.len());
    assert!(snaps.iter().any(|s| s.added_records > 8_192), "{snaps:?}");
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_classified_4xx_and_only_valid_records_land() {
    let backend = support::embedded();
    let mut config = dev_config();
    config.limits.max_body_bytes = 256 * 1024;
    config.limits.max_decoded_bytes = 512 * 1024;
    config.limits.max_batch_events = 50;
    config.limits.max_event_bytes = 8 * 1024;
    let gw = start(config, &backend.config).await;
    let url = gw.url.as_str();
    let json_ct = Some("application/json");
    let nd = Some("application/x-ndjson");
    let good = |id: &str| serde_json::to_vec(&event(id, "tenant-0", "p-1")).unwrap();

    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let mut deep_event = event("deep", "tenant-0", "p-1");
    deep_event["payload"]["item_count"] = serde_json::from_str("1").unwrap();
    let deep_event = String::from_utf8(serde_json::to_vec(&deep_event).unwrap())
        .unwrap()
        .replace(
            "\"item_count\":1",
            &format!("\"item_count\":{}1{}", "[".repeat(3000), "]".repeat(3000)),
        );
    let mut huge_number = String::from_utf8(good("huge")).unwrap();
    huge_number = huge_number.replace(
        "\"producer_seq\":1",
        "\"producer_seq\":99999999999999999999999",
    );
    let mut invalid_utf8 = good("utf8");
    invalid_utf8.splice(10..10, [0xff, 0xfe]);
    let big_event = {
        let mut e = event("big", "tenant-0", "p-1");
        e["schema_version"] = "1.2.0".into();
        e["payload"]["line_items"] = "x".repeat(10_000).into();
        serde_json::to_vec(&e).unwrap()
    };
    let many: Vec<Value> = (0..51)
        .map(|i| event(&format!("m-{i}"), "tenant-0", "p-1"))
        .collect();
    let bomb = gzip(&vec![b' '; 4 * 1024 * 1024]);

    type Case = (
        &'static str,
        Option<&'static str>,
        Option<&'static str>,
        Option<&'static str>,
        Vec<u8>,
        u16,
        &'static str,
    );
    let cases: Vec<Case> = vec![
        (
            "malformed JSON",
            Some(T0),
            json_ct,
            None,
            b"{\"event_id\": ".to_vec(),
            400,
            "malformed_json",
        ),
        (
            "truncated array",
            Some(T0),
            json_ct,
            None,
            [b"[".to_vec(), good("t1"), b",".to_vec()].concat(),
            400,
            "malformed_body",
        ),
        (
            "not an object",
            Some(T0),
            json_ct,
            None,
            b"\"hello\"".to_vec(),
            400,
            "malformed_body",
        ),
        (
            "empty body",
            Some(T0),
            json_ct,
            None,
            Vec::new(),
            400,
            "malformed_body",
        ),
        (
            "wrong content type",
            Some(T0),
            Some("text/plain"),
            None,
            good("ct"),
            415,
            "unsupported_media_type",
        ),
        (
            "no content type",
            Some(T0),
            None,
            None,
            good("ct2"),
            415,
            "unsupported_media_type",
        ),
        (
            "unknown encoding",
            Some(T0),
            json_ct,
            Some("br"),
            good("enc"),
            415,
            "unsupported_encoding",
        ),
        (
            "garbage gzip",
            Some(T0),
            json_ct,
            Some("gzip"),
            b"not gzip".to_vec(),
            400,
            "malformed_body",
        ),
        (
            "huge number",
            Some(T0),
            json_ct,
            None,
            huge_number.into_bytes(),
            400,
            "wrong_type",
        ),
        (
            "deep nesting (array, huge)",
            Some(T0),
            json_ct,
            None,
            deep.into_bytes(),
            400,
            "event_too_large",
        ),
        (
            "deep nesting (array)",
            Some(T0),
            json_ct,
            None,
            format!("[{}{}]", "[".repeat(3000), "]".repeat(3000)).into_bytes(),
            400,
            "malformed_json",
        ),
        (
            "deep nesting (event)",
            Some(T0),
            nd,
            None,
            deep_event.into_bytes(),
            400,
            "malformed_json",
        ),
        (
            "invalid UTF-8",
            Some(T0),
            nd,
            None,
            invalid_utf8,
            400,
            "invalid_utf8",
        ),
        (
            "missing auth",
            None,
            json_ct,
            None,
            good("auth1"),
            401,
            "missing_credentials",
        ),
        (
            "wrong auth",
            Some("sw-not-a-key"),
            json_ct,
            None,
            good("auth2"),
            401,
            "invalid_credentials",
        ),
        (
            "another tenant's event",
            Some(T1),
            json_ct,
            None,
            serde_json::to_vec(&event("x", "tenant-0", "producer-1-0")).unwrap(),
            403,
            "tenant_mismatch",
        ),
        (
            "producer not allowed",
            Some(T1),
            json_ct,
            None,
            serde_json::to_vec(&event("y", "tenant-1", "producer-9")).unwrap(),
            403,
            "producer_not_allowed",
        ),
        (
            "oversized batch",
            Some(T0),
            json_ct,
            None,
            serde_json::to_vec(&many).unwrap(),
            413,
            "batch_too_large",
        ),
        (
            "oversized body",
            Some(T0),
            nd,
            None,
            vec![b' '; 300 * 1024],
            413,
            "body_too_large",
        ),
        (
            "compression bomb",
            Some(T0),
            nd,
            Some("gzip"),
            bomb,
            413,
            "body_too_large",
        ),
        (
            "oversized event",
            Some(T0),
            nd,
            None,
            big_event,
            400,
            "event_too_large",
        ),
        (
            "unknown event type",
            Some(T0),
            json_ct,
            None,
            String::from_utf8(good("u"))
                .unwrap()
                .replace("order_placed", "order_teleported")
                .into_bytes(),
            400,
            "unknown_event_type",
        ),
    ];
    let mut expected_reasons = Vec::new();
    for (name, token, ct, enc, body, status, reason) in cases {
        let a = post_raw(url, token, ct, enc, body).await;
        assert_eq!(a.status, status, "{name}: {}", a.body);
        let got = a.body["error"]["reason"]
            .as_str()
            .or_else(|| a.body["results"][0]["reason"].as_str())
            .unwrap_or_else(|| panic!("{name}: no reason code in {}", a.body));
        assert_eq!(got, reason, "{name}: {}", a.body);
        expected_reasons.push(reason.to_string());
    }

    // A mixed batch: the valid records land, the bad ones are reported per event.
    let mixed = [
        event("ok-1", "tenant-0", "p-1"),
        json!({"event_id": "bad id with spaces"}),
        event("ok-2", "tenant-0", "p-1"),
    ];
    let a = post(url, T0, &mixed).await;
    assert_eq!(a.status, 207, "{}", a.body);
    assert_eq!(a.body["accepted"], 2);
    assert_eq!(a.body["results"][1]["reason"], "invalid_event_id");
    expected_reasons.push("invalid_event_id".into());

    // Still serving, and gzip and zstd bodies are fine.
    let ndjson = [good("gz-1"), b"\n".to_vec(), good("gz-2")].concat();
    let a = post_raw(url, Some(T0), nd, Some("gzip"), gzip(&ndjson)).await;
    assert_eq!(
        (a.status, a.body["accepted"].as_u64()),
        (200, Some(2)),
        "{}",
        a.body
    );
    let z = zstd::encode_all(&good("zs-1")[..], 3).unwrap();
    let a = post_raw(url, Some(T0), nd, Some("zstd"), z).await;
    assert_eq!(
        (a.status, a.body["accepted"].as_u64()),
        (200, Some(1)),
        "{}",
        a.body
    );
    let health = reqwest::get(format!("{url}/healthz")).await.unwrap();
    assert_eq!(health.status().as_u16(), 200);
    let metrics = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("signalweave_gateway_rejections_total{reason=\"tenant_mismatch\"} 1"),
        "{metrics}"
    );
    gw.stop().await;

    let got = landed(&backend.config).await;
    let mut ids: Vec<&str> = got.keys().map(|(_, id)| id.as_str()).collect();
    ids.sort();
    assert_eq!(ids, ["gz-1", "gz-2", "ok-1", "ok-2", "zs-1"]);
    // Every rejection left evidence with its reason code.
    expected_reasons.sort();
    assert_eq!(rejection_reasons(&backend.config).await, expected_reasons);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_quota_gets_429_while_another_is_acknowledged_promptly() {
    let backend = support::embedded();
    let mut config = dev_config();
    config.commit.interval = Duration::from_millis(200);
    config.tenants[0].records_per_sec = 200;
    config.tenants[0].producer_records_per_sec = 200;
    let gw = start(config, &backend.config).await;
    let url = gw.url.clone();
    let burst = tokio::spawn(async move {
        let mut statuses = Vec::new();
        let mut retry_after = None;
        let mut answers = Vec::new();
        for r in 0..30 {
            let batch: Vec<Value> = (0..50)
                .map(|i| event(&format!("burst-{r}-{i}"), "tenant-0", "p-1"))
                .collect();
            let url = url.clone();
            answers.push(tokio::spawn(async move { post(&url, T0, &batch).await }));
        }
        for a in answers {
            let a = a.await.unwrap();
            if a.status == 429 {
                retry_after = Some((
                    a.headers.get("retry-after").cloned(),
                    a.headers.get("signalweave-max-event-age").cloned(),
                    a.body["error"]["reason"].clone(),
                ));
            }
            statuses.push(a.status);
        }
        (statuses, retry_after)
    });
    let mut worst = Duration::ZERO;
    let mut calm = Vec::new();
    for i in 0..10 {
        let sent_ms = chrono::Utc::now().timestamp_millis();
        let started = Instant::now();
        let a = post(
            &gw.url,
            T1,
            &[event(&format!("calm-{i}"), "tenant-1", "producer-1-0")],
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.body);
        worst = worst.max(started.elapsed());
        calm.push((sent_ms, a.body["snapshot_id"].as_i64().unwrap()));
    }
    let (statuses, retry) = burst.await.unwrap();
    assert!(statuses.contains(&429), "{statuses:?}");
    assert!(statuses.contains(&200), "{statuses:?}");
    let (retry_after, max_age, reason) = retry.unwrap();
    assert!(retry_after.is_some() && max_age.is_some());
    assert_eq!(reason, "quota_exceeded");
    // The other tenant is never refused, and the burst never defers its acknowledgments:
    // each lands in the first commit cut after it arrived, so at most one other commit
    // (the one already under way) finishes between the request and its snapshot. This
    // counts commits, not milliseconds, so a slow machine cannot fail it; the wall-clock
    // bound only catches a hang (the release latency is in BENCHMARKS.md).
    assert!(worst <= Duration::from_secs(5), "worst ack {worst:?}");
    gw.stop().await;
    let lake = Lake::open(backend.config.clone()).await.unwrap();
    let snapshots = lake.snapshots(LakeTable::Events).await.unwrap();
    for (sent_ms, snapshot_id) in calm {
        let acked = snapshots
            .iter()
            .find(|s| s.snapshot_id == snapshot_id)
            .unwrap_or_else(|| panic!("acked snapshot {snapshot_id} not in the table"));
        let between = snapshots
            .iter()
            .filter(|s| s.timestamp_ms > sent_ms && s.sequence_number < acked.sequence_number)
            .count();
        assert!(
            between <= 1,
            "an ack sent at {sent_ms} waited for {between} commits before its own"
        );
    }
}

/// A request a producer's quota refuses gives its tenant's records back: one producer's
/// refused retries do not spend the quota its tenant's other producers are owed. (Before,
/// the tenant paid for each request before its producers were known, and kept the
/// tokens.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_a_producers_quota_refuses_gives_the_tenants_records_back() {
    let backend = support::embedded();
    let mut config = dev_config();
    config.tenants[0].records_per_sec = 50;
    config.tenants[0].producer_records_per_sec = 10;
    let gw = start(config, &backend.config).await;
    let batch = |n: usize, id: &str, producer: &str| -> Vec<Value> {
        (0..n)
            .map(|i| event(&format!("{id}-{i}"), "tenant-0", producer))
            .collect()
    };
    let started = Instant::now();
    let a = post(&gw.url, T0, &batch(10, "greedy", "p-1")).await;
    assert_eq!(a.status, 200, "{}", a.body);
    // Its producer's bucket is empty for a second: each retry is refused by it. Each
    // would have cost the tenant 10 of its 40 tokens left.
    for r in 0..4 {
        let a = post(&gw.url, T0, &batch(10, &format!("retry-{r}"), "p-1")).await;
        assert_eq!(a.status, 429, "{}", a.body);
        assert_eq!(a.body["error"]["reason"], "quota_exceeded");
        let detail = a.body["error"]["detail"].as_str().unwrap();
        assert!(detail.contains("producer_records"), "{detail}");
        assert!(a.headers.contains_key("retry-after"));
    }
    // The tenant's other producers still have its 40 tokens (and what refilled).
    let calm: Vec<Value> = (0..4)
        .flat_map(|p| batch(10, &format!("calm-{p}"), &format!("p-calm-{p}")))
        .collect();
    let a = post(&gw.url, T0, &calm).await;
    assert!(
        started.elapsed() < Duration::from_millis(800),
        "too slow to tell: the tenant's bucket refilled 40 tokens meanwhile"
    );
    assert_eq!(a.status, 200, "{}", a.body);
    gw.stop().await;
    assert_eq!(landed(&backend.config).await.len(), 50);
}

/// A configuration whose queue (64 KiB, all of it the one tenant's) holds one request of
/// [`queue_batch`] until its commit, 1.5 s later.
fn small_queue_config() -> GatewayConfig {
    let mut config = dev_config();
    config.commit.interval = Duration::from_millis(1500);
    config.limits.max_decoded_bytes = 64 * 1024;
    config.queue.max_bytes = 64 * 1024;
    config.queue.tenant_share_percent = 100;
    config
}

/// 120 events of tenant-0 with ids `<p>-<i>`: about 34 KB, so one fills the small queue.
fn queue_batch(p: &str) -> Vec<Value> {
    (0..120)
        .map(|i| event(&format!("{p}-{i}"), "tenant-0", "p-1"))
        .collect()
}

/// Posts [`queue_batch`] `p` in the background and gives it time to be queued; its answer
/// comes once it is committed.
async fn fill_queue(url: &str, p: &str) -> tokio::task::JoinHandle<Answer> {
    let (url, batch) = (url.to_string(), queue_batch(p));
    let first = tokio::spawn(async move { post(&url, T0, &batch).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    first
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_503_with_retry_after_and_recovers() {
    let backend = support::embedded();
    let gw = start(small_queue_config(), &backend.config).await;
    let first = fill_queue(&gw.url, "q1").await;
    let a = post(&gw.url, T0, &queue_batch("q2")).await;
    assert_eq!(a.status, 503, "{}", a.body);
    assert_eq!(a.body["error"]["reason"], "queue_full");
    assert!(a.headers.contains_key("retry-after"));
    assert_eq!(a.body["error"]["max_event_age_s"], 300);
    assert_eq!(first.await.unwrap().status, 200);
    let a = post(&gw.url, T0, &queue_batch("q2")).await;
    assert_eq!(a.status, 200, "{}", a.body);
    gw.stop().await;
    assert_eq!(landed(&backend.config).await.len(), 240);
}

/// A request the full queue refuses spends none of its tenant's tokens: the queue is
/// asked first. (Before, each refused retry paid the tenant's quota, so a tenant whose
/// requests met a full queue soon met its own quota too.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_full_queue_refuses_spends_no_quota() {
    let backend = support::embedded();
    let mut config = small_queue_config();
    // Room for two requests of 120 records a second, no more.
    config.tenants[0].records_per_sec = 300;
    // A share of 100 is the whole queue; a tenant's share must hold one whole request.
    assert_eq!(config.queue.tenant_max_bytes(), 64 * 1024);
    let mut half = config.clone();
    half.queue.tenant_share_percent = 50;
    let e = half.validate().unwrap_err();
    assert!(e.to_string().contains("queue.tenant_share_percent"), "{e}");
    let gw = start(config, &backend.config).await;
    let first = fill_queue(&gw.url, "f1").await;
    // The queue holds the first request until its commit: the next ones find it full,
    // and each again, since none paid the tenant's quota.
    for p in ["f2", "f3", "f4"] {
        let a = post(&gw.url, T0, &queue_batch(p)).await;
        assert_eq!(a.status, 503, "{p}: {}", a.body);
        assert_eq!(a.body["error"]["reason"], "queue_full", "{p}");
    }
    assert_eq!(first.await.unwrap().status, 200);
    gw.stop().await;
    assert_eq!(landed(&backend.config).await.len(), 120);
}

/// A refusal is filed under the tenant whose key made the request, not under the tenant
/// its body claims: a key cannot put rows under another tenant's name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_filed_under_the_authenticated_tenant() {
    let backend = support::embedded();
    let gw = start(dev_config(), &backend.config).await;
    let a = post(&gw.url, T0, &[event("claims-1", "tenant-1", "p-1")]).await;
    assert_eq!(a.status, 403, "{}", a.body);
    let mut broken = event("claims-9", "tenant-9", "p-1");
    broken.as_object_mut().unwrap().remove("market_id");
    let a = post(&gw.url, T0, &[broken]).await;
    assert_eq!(a.status, 400, "{}", a.body);
    let a = post_raw(&gw.url, Some(T0), Some("text/plain"), None, b"x".to_vec()).await;
    assert_eq!(a.status, 415, "{}", a.body);
    gw.stop().await;
    let mut rows: Vec<(String, Option<String>)> =
        rejection_rows(&backend.config, &["reason_code", "tenant"])
            .await
            .into_iter()
            .map(|row| (row[0].clone().unwrap_or_default(), row[1].clone()))
            .collect();
    rows.sort();
    assert_eq!(
        rows,
        [
            ("missing_field".to_string(), Some("tenant-0".to_string())),
            ("tenant_mismatch".to_string(), Some("tenant-0".to_string())),
            (
                "unsupported_media_type".to_string(),
                Some("tenant-0".to_string())
            ),
        ]
    );
}

/// Requests without a valid key cannot flood the evidence table: past a budget they are
/// counted, not recorded. What is recorded names the key's digest and the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_without_a_valid_key_are_recorded_within_a_budget() {
    let backend = support::embedded();
    let gw = start(dev_config(), &backend.config).await;
    let flood = Instant::now();
    for chunk in 0..10 {
        let answers: Vec<_> = (0..40)
            .map(|i| {
                let url = gw.url.clone();
                tokio::spawn(async move { post(&url, &format!("junk-{chunk}-{i}"), &[]).await })
            })
            .collect();
        for a in answers {
            assert_eq!(a.await.unwrap().status, 401);
        }
    }
    // The budget: a burst of 100, then 10 a second.
    let budget = 100.0 + 10.0 * flood.elapsed().as_secs_f64().ceil() + 2.0;
    let unrecorded = metric(&gw.url, |l| {
        l.starts_with("signalweave_gateway_unauthenticated_unrecorded_total")
    })
    .await;
    assert!(
        unrecorded >= 400.0 - budget,
        "{unrecorded} of 400, budget {budget}"
    );
    gw.stop().await;
    let details: Vec<String> = rejection_rows(&backend.config, &["detail"])
        .await
        .into_iter()
        .map(|mut row| row.remove(0).unwrap_or_default())
        .collect();
    assert!(
        details.len() >= 100 && details.len() as f64 <= budget,
        "{} rows recorded, budget {budget}",
        details.len()
    );
    assert_eq!(details.len() as f64 + unrecorded, 400.0);
    assert!(
        details
            .iter()
            .all(|d| d.contains("SHA-256") && d.contains("from 127.0.0.1")),
        "{:?}",
        &details[..3]
    );
}

/// The edges of the HTTP surface answer in the gateway's error shape: 401 names its
/// scheme, an unknown path or method gets a JSON error, a body led by a UTF-8 byte order
/// mark is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_edges_answer_in_the_error_shape() {
    let backend = support::embedded();
    let gw = start(dev_config(), &backend.config).await;
    let a = post(&gw.url, "junk", &[event("e-1", "tenant-0", "p-1")]).await;
    assert_eq!(a.status, 401);
    assert_eq!(
        a.headers.get("www-authenticate").unwrap(),
        "Bearer realm=\"signalweave\""
    );
    let client = reqwest::Client::new();
    for (req, status, reason) in [
        (
            client.get(format!("{}/v2/nothing", gw.url)),
            404,
            "not_found",
        ),
        (
            client.get(format!("{}/v1/events", gw.url)),
            405,
            "method_not_allowed",
        ),
    ] {
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status().as_u16(), status);
        let body: Value = serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap();
        assert_eq!(body["error"]["reason"], reason, "{body}");
    }
    let mut bom = b"\xEF\xBB\xBF".to_vec();
    bom.extend(serde_json::to_vec(&[event("bom-1", "tenant-0", "p-1")]).unwrap());
    let a = post_raw(&gw.url, Some(T0), Some("application/json"), None, bom).await;
    assert_eq!(a.status, 200, "{}", a.body);
    gw.stop().await;
}

/// A request larger than a quota bucket can ever hold is refused 413 with evidence, not
/// 429 forever. One beyond the tenant's capacity takes no tokens: a request that fits is
/// admitted right after. (A producer's share is known only after validation, when the
/// tenant's tokens are taken: refused, it gives the tenant's records back.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_beyond_a_quotas_capacity_gets_413_and_spends_nothing() {
    let backend = support::embedded();
    let mut config = dev_config();
    config.tenants[0].records_per_sec = 100;
    config.tenants[0].producer_records_per_sec = 50;
    let gw = start(config, &backend.config).await;
    let batch = |n: usize, p: &str| -> Vec<Value> {
        (0..n)
            .map(|i| event(&format!("{p}-{i}"), "tenant-0", "p-1"))
            .collect()
    };
    let too_large = |a: &Answer, bucket: &str| {
        assert_eq!(a.status, 413, "{}", a.body);
        assert_eq!(a.body["error"]["reason"], "batch_too_large", "{}", a.body);
        let detail = a.body["error"]["detail"].as_str().unwrap();
        assert!(detail.contains(bucket), "{detail}");
        assert!(!a.headers.contains_key("retry-after"));
    };
    too_large(
        &post(&gw.url, T0, &batch(150, "big")).await,
        "tenant_records",
    );
    // The tenant's 100 tokens are whole: 100 now, from two producers, are admitted.
    let mut fits = batch(50, "fits");
    fits.extend((0..50).map(|i| event(&format!("fits2-{i}"), "tenant-0", "p-2")));
    let a = post(&gw.url, T0, &fits).await;
    assert_eq!(a.status, 200, "{}", a.body);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    too_large(
        &post(&gw.url, T0, &batch(80, "many")).await,
        "producer_records",
    );
    // Refused requests spend no quota, so their evidence has a budget per tenant: a
    // burst of 100, then 10 a second; beyond it they are counted.
    let big = serde_json::to_vec(&batch(150, "flood")).unwrap();
    let flood = Instant::now();
    for _ in 0..160 {
        let a = post_raw(
            &gw.url,
            Some(T0),
            Some("application/json"),
            None,
            big.clone(),
        )
        .await;
        assert_eq!(a.status, 413);
    }
    let budget = 100.0 + 10.0 * flood.elapsed().as_secs_f64().ceil() + 2.0;
    let unrecorded = metric(&gw.url, |l| {
        l.starts_with("signalweave_gateway_refusals_unrecorded_total")
            && l.contains("tenant=\"tenant-0\"")
    })
    .await;
    gw.stop().await;
    let reasons = rejection_reasons(&backend.config).await;
    let recorded = reasons.iter().filter(|r| *r == "batch_too_large").count() as f64;
    assert!(
        recorded >= 100.0 && recorded <= budget,
        "{recorded} recorded, budget {budget}"
    );
    assert_eq!(
        recorded + unrecorded,
        162.0,
        "every refusal recorded or counted"
    );
}

/// A client that sends its headers and then stalls gets 408 once the body timeout
/// passes, with evidence; it holds no request slot after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_body_gets_408_after_the_body_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let backend = support::embedded();
    let mut config = dev_config();
    config.limits.body_timeout = Duration::from_secs(1);
    let gw = start(config, &backend.config).await;
    let addr = gw.url.trim_start_matches("http://").to_string();
    let mut stalled = tokio::net::TcpStream::connect(&addr).await.unwrap();
    stalled
        .write_all(
            format!(
                "POST /v1/events HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {T0}\r\n\
                 Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n[{{\"event_"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let started = Instant::now();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(20), stalled.read(&mut answer))
        .await
        .expect("an answer to the stalled request")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]).to_string();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("body_timeout"), "{answer}");
    assert!(started.elapsed() >= Duration::from_millis(900));
    gw.stop().await;
    let reasons = rejection_reasons(&backend.config).await;
    assert!(reasons.iter().any(|r| r == "body_timeout"), "{reasons:?}");
}

/// The bytes of bodies held at once are bounded: while two stalled clients hold all the
/// room (each took its declared length at once), a request gets 503 `bytes_in_flight` with
/// a Retry-After (nothing is wrong with it: nothing is recorded against it), and once the
/// stalled bodies time out the same request is acknowledged, and every byte of room comes
/// back. A budget too small for one whole request is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bytes_of_bodies_in_flight_are_bounded() {
    let backend = support::embedded();
    let mut config = megabyte_config();
    config.limits.max_bytes_in_flight = 2 << 20;
    let e = config.validate().unwrap_err();
    assert!(e.to_string().contains("limits.max_bytes_in_flight"), "{e}");
    config.limits.max_bytes_in_flight = 13 << 18;
    let gw = start(config, &backend.config).await;
    let addr = gw.url.trim_start_matches("http://").to_string();
    let mut stalled = Vec::new();
    for _ in 0..3 {
        stalled.push(stall(&addr, 1 << 20, &vec![b' '; (1 << 20) - 8 * 1024]).await);
    }
    // Each stalled request took room for the length it declared, before its body came.
    let in_flight = |url: String| async move { body_bytes_in_flight(&url).await };
    wait_for_room_taken(&gw.url, 3 << 20, "the stalled requests").await;
    // Too large for the quarter MiB left, with its events' copies.
    let batch: Vec<Value> = (0..600)
        .map(|i| event(&format!("room-{i}"), "tenant-0", "p-1"))
        .collect();
    let a = post(&gw.url, T0, &batch).await;
    assert_eq!(a.status, 503, "{}", a.body);
    assert_eq!(a.body["error"]["reason"], "bytes_in_flight");
    assert!(a.headers.contains_key("retry-after"));
    assert_eq!(
        metric(&gw.url, |l| l.contains("cause=\"bytes_in_flight\"")).await,
        1.0
    );
    // The stalled bodies time out (408), and their room comes back.
    wait_for_room_given_back(&gw.url).await;
    let a = post(&gw.url, T0, &batch).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        in_flight(gw.url.clone()).await,
        0.0,
        "every request's room came back"
    );
    drop(stalled);
    gw.stop().await;
    assert_eq!(landed(&backend.config).await.len(), 600);
}

/// Waits (20 s at most) until no request holds room: stalled bodies timed out.
async fn wait_for_room_given_back(url: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while body_bytes_in_flight(url).await > 0.0 {
        assert!(
            Instant::now() < deadline,
            "the stalled bodies kept their room"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Bodies of 1 MiB at most (received and decoded) and of 2,600 events, a queue of 1 MiB
/// all of it the one tenant's, room for 3.25 MiB of bodies in flight (one whole request
/// needs about 3.15 MiB: the body decoded, and its events' copies), and a body timeout of
/// 2 s.
fn megabyte_config() -> GatewayConfig {
    let mut config = dev_config();
    config.limits.max_body_bytes = 1 << 20;
    config.limits.max_decoded_bytes = 1 << 20;
    config.limits.max_batch_events = 2_600;
    config.queue.max_bytes = 1 << 20;
    config.queue.tenant_share_percent = 100;
    config.limits.max_bytes_in_flight = 13 << 18;
    config.limits.body_timeout = Duration::from_secs(2);
    config
}

/// A request to `addr` that declares a JSON body of `len` bytes, sends `sent` of it, and
/// stalls.
async fn stall(addr: &str, len: usize, sent: &[u8]) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    c.write_all(
        format!(
            "POST /v1/events HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {T0}\r\n\
             Content-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    c.write_all(sent).await.unwrap();
    c
}

/// The gateway's gauge of the bytes of bodies in flight.
async fn body_bytes_in_flight(url: &str) -> f64 {
    metric(url, |l| {
        l.starts_with("signalweave_gateway_body_bytes_in_flight ")
    })
    .await
}

/// Waits (10 s at most) until the bodies in flight hold `bytes`, which `who` took.
async fn wait_for_room_taken(url: &str, bytes: u32, who: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while body_bytes_in_flight(url).await < f64::from(bytes) {
        assert!(Instant::now() < deadline, "{who} never took their room");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The events' validated copies take room too, until they are handed to the committer:
/// with half the room held by a stalled body, a request of 600 KB (1.2 MB with its
/// copies) gets 503 `bytes_in_flight` before any quota is paid, and is acknowledged once
/// the stalled body times out. (Before, only the body was counted, and it was admitted.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_validated_copies_of_events_take_room_too() {
    let backend = support::embedded();
    let config = megabyte_config();
    // Twice the decoded limit, and each event's own overhead, is one whole request now,
    // whatever the body limit.
    let mut small_body = config.clone();
    small_body.limits.max_body_bytes = 1 << 10;
    small_body.limits.max_bytes_in_flight =
        (2 << 20) + 1_000 * signalweave_model::Event::MEMORY_OVERHEAD_BYTES;
    let e = small_body.validate().unwrap_err();
    assert!(e.to_string().contains("twice"), "{e}");
    // A request of 700 KB, made while a stalled one holds 1 MiB of the 3.25: its body and
    // its copies' strings alone would fit in the 2.25 MiB left, but not with each event's
    // struct and allocations.
    let one = serde_json::to_vec(&event("copy-0", "tenant-0", "p-1"))
        .unwrap()
        .len();
    let batch: Vec<Value> = (0..700 * 1024 / one + 1)
        .map(|i| event(&format!("copy-{i}"), "tenant-0", "p-1"))
        .collect();
    let body = serde_json::to_vec(&batch).unwrap();
    let overhead = batch.len() * signalweave_model::Event::MEMORY_OVERHEAD_BYTES;
    let left = (13 << 18) - (1 << 20);
    assert!(2 * body.len() < left && 2 * body.len() + overhead > left);
    let gw = start(config, &backend.config).await;
    let addr = gw.url.trim_start_matches("http://").to_string();
    let stalled = stall(&addr, 1 << 20, &[]).await;
    let in_flight = || body_bytes_in_flight(&gw.url);
    wait_for_room_taken(&gw.url, 1 << 20, "the stalled request").await;
    let a = post(&gw.url, T0, &batch).await;
    assert_eq!(a.status, 503, "{}", a.body["error"]);
    assert_eq!(a.body["error"]["reason"], "bytes_in_flight");
    wait_for_room_given_back(&gw.url).await;
    let a = post(&gw.url, T0, &batch).await;
    assert_eq!(a.status, 200, "{}", a.body["error"]);
    assert_eq!(in_flight().await, 0.0, "every request's room came back");
    drop(stalled);
    gw.stop().await;
    assert_eq!(landed(&backend.config).await.len(), batch.len());
}

/// A zstd body takes room for its decoder's window while it decodes: with 8 MiB of room
/// left, a small body streamed at level 19 (an 8 MiB window) gets 503 `bytes_in_flight`,
/// and the same events compressed in one shot (a window of their size) are acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zstd_decoders_window_takes_room_while_it_decodes() {
    let backend = support::embedded();
    let mut config = megabyte_config();
    config.limits.max_bytes_in_flight = 12 << 20;
    config.limits.body_timeout = Duration::from_secs(30);
    let gw = start(config, &backend.config).await;
    let addr = gw.url.trim_start_matches("http://").to_string();
    let mut stalled = Vec::new();
    for _ in 0..4 {
        stalled.push(stall(&addr, 1 << 20, &[]).await);
    }
    wait_for_room_taken(&gw.url, 4 << 20, "the stalled requests").await;
    let batch: Vec<Value> = (0..20)
        .map(|i| event(&format!("window-{i}"), "tenant-0", "p-1"))
        .collect();
    let json = serde_json::to_vec(&batch).unwrap();
    let mut streamed = Vec::new();
    {
        let mut enc = zstd::stream::write::Encoder::new(&mut streamed, 19).unwrap();
        enc.write_all(&json).unwrap();
        enc.finish().unwrap();
    }
    let post_zstd = |body: Vec<u8>| {
        post_raw(
            &gw.url,
            Some(T0),
            Some("application/json"),
            Some("zstd"),
            body,
        )
    };
    let a = post_zstd(streamed).await;
    assert_eq!(a.status, 503, "{}", a.body);
    assert_eq!(a.body["error"]["reason"], "bytes_in_flight");
    let a = post_zstd(zstd::bulk::compress(&json, 19).unwrap()).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(body_bytes_in_flight(&gw.url).await, f64::from(4 << 20));
    drop(stalled);
    gw.stop().await;
    assert_eq!(landed(&backend.config).await.len(), 20);
}

/// SIGTERM while the store is down and a client stalls: the stop still ends. Requests
/// waiting on a commit get 503 after the drain timeout, their events are counted as
/// abandoned (the gateway exits 3), and connections still open a grace later are closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_ends_while_the_store_stays_down_and_a_client_stalls() {
    use tokio::io::AsyncWriteExt;
    let backend = support::embedded();
    let mut config = dev_config();
    config.commit.drain_timeout = Duration::from_secs(2);
    // Longer than the whole stop: the stalled client is closed by the stop, not timed out.
    config.limits.body_timeout = Duration::from_secs(120);
    let gw = start(config, &backend.config).await;
    let a = post(&gw.url, T0, &[event("before", "tenant-0", "p-1")]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    // The store goes away: the events table's metadata directory becomes a file, so no
    // commit can load or write the table's metadata.
    let meta = backend
        .dir
        .path()
        .join("lake/warehouse/signalweave/events/metadata");
    assert!(meta.is_dir(), "{}", meta.display());
    let away = meta.with_extension("away");
    std::fs::rename(&meta, &away).unwrap();
    std::fs::write(&meta, b"not a directory").unwrap();
    let url = gw.url.clone();
    let waiting =
        tokio::spawn(async move { post(&url, T0, &[event("during", "tenant-0", "p-1")]).await });
    let addr = gw.url.trim_start_matches("http://").to_string();
    let mut stalled = tokio::net::TcpStream::connect(&addr).await.unwrap();
    stalled
        .write_all(
            format!(
                "POST /v1/events HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {T0}\r\n\
                 Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n["
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stopping = Instant::now();
    let report = tokio::time::timeout(Duration::from_secs(30), gw.stop())
        .await
        .expect("the stop ended");
    let took = stopping.elapsed();
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(2 + 5 + 3),
        "{took:?}"
    );
    assert_eq!(report.abandoned_events, 1, "{report:?}");
    let w = waiting.await.unwrap();
    assert_eq!(w.status, 503, "{}", w.body);
    assert_eq!(w.body["error"]["reason"], "store_unavailable", "{}", w.body);
    drop(stalled);
    std::fs::remove_file(&meta).unwrap();
    std::fs::rename(&away, &meta).unwrap();
    assert_eq!(landed(&backend.config).await.len(), 1);
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    fn mutate(base: Vec<u8>, ops: &[(usize, u8, u8)]) -> Vec<u8> {
        let mut b = base;
        for &(pos, op, byte) in ops {
            if b.is_empty() {
                b.push(byte);
                continue;
            }
            let p = pos % b.len();
            match op % 3 {
                0 => b[p] = byte,
                1 => {
                    b.remove(p);
                }
                _ => b.insert(p, byte),
            }
        }
        b
    }

    #[test]
    fn random_and_mutated_bodies_never_break_the_gateway() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let backend = support::embedded();
        let gw = rt.block_on(start(dev_config(), &backend.config));
        let url = gw.url.clone();
        let base = serde_json::to_vec(&[
            event("fz-0", "tenant-0", "p-1"),
            event("fz-1", "tenant-0", "p-1"),
        ])
        .unwrap();
        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
            cases: 96,
            ..ProptestConfig::default()
        });
        let strategy = (
            proptest::collection::vec((any::<usize>(), any::<u8>(), any::<u8>()), 0..6),
            proptest::collection::vec(any::<u8>(), 0..200),
            any::<bool>(),
            prop::sample::select(vec!["application/json", "application/x-ndjson"]),
        );
        runner
            .run(&strategy, |(ops, noise, use_noise, ct)| {
                let body = if use_noise {
                    noise
                } else {
                    mutate(base.clone(), &ops)
                };
                let a = rt.block_on(post_raw(&url, Some(T0), Some(ct), None, body));
                prop_assert!(
                    matches!(a.status, 200 | 207 | 400 | 403 | 409 | 413 | 415),
                    "status {} body {}",
                    a.status,
                    a.body
                );
                if a.status >= 400 {
                    let reason = a.body["error"]["reason"]
                        .as_str()
                        .or_else(|| a.body["results"][0]["reason"].as_str());
                    prop_assert!(reason.is_some(), "no reason code: {}", a.body);
                }
                Ok(())
            })
            .unwrap();
        let a = rt.block_on(post(&url, T0, &[event("after-fuzz", "tenant-0", "p-1")]));
        assert_eq!(a.status, 200);
        rt.block_on(gw.stop());
        // Whatever landed is valid and landed once.
        let got = rt.block_on(landed(&backend.config));
        assert!(got.values().all(|n| *n == 1));
        assert!(got.contains_key(&("tenant-0".to_string(), "after-fuzz".to_string())));
    }
}
