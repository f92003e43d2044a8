//! The producer client: a bounded buffer of serialized events and worker tasks that send
//! them in compressed NDJSON batches, retrying throttles and failures with backoff and
//! jitter, within an age budget.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rand::Rng;
use serde::Deserialize;
use tokio::sync::Notify;
use tokio::task::JoinSet;

/// Settings of a [`Producer`]; every field has a named default.
#[derive(Debug, Clone)]
pub struct ProducerConfig {
    /// Gateway base URL, for example `http://127.0.0.1:8088`.
    pub url: String,
    /// The API key (bearer token).
    pub token: String,
    /// Most events per request.
    pub max_batch_events: usize,
    /// Most serialized bytes per request (before compression).
    pub max_batch_bytes: usize,
    /// How long a worker waits for a fuller batch.
    pub linger: Duration,
    /// zstd level for request bodies; 0 sends them uncompressed.
    pub zstd_level: i32,
    /// Unsent bytes kept at most; `send` refuses (and counts) events beyond it.
    pub max_unsent_bytes: usize,
    /// Unsent events older than this are dropped (and counted), never retried forever.
    pub max_unsent_age: Duration,
    /// Timeout of one request.
    pub request_timeout: Duration,
    /// First retry delay after a failure (doubles, with jitter).
    pub backoff_base: Duration,
    /// Longest retry delay.
    pub backoff_max: Duration,
    /// Requests in flight at once.
    pub concurrency: usize,
}

impl ProducerConfig {
    /// Default batch: 1,000 events.
    pub const DEFAULT_MAX_BATCH_EVENTS: usize = 1_000;
    /// Default batch bytes: 2 MiB.
    pub const DEFAULT_MAX_BATCH_BYTES: usize = 2 * 1024 * 1024;
    /// Default linger: 20 ms.
    pub const DEFAULT_LINGER: Duration = Duration::from_millis(20);
    /// Default zstd level: 1 (fast).
    pub const DEFAULT_ZSTD_LEVEL: i32 = 1;
    /// Default unsent byte budget: 64 MiB.
    pub const DEFAULT_MAX_UNSENT_BYTES: usize = 64 * 1024 * 1024;
    /// Default unsent age budget: 5 minutes (below the gateway's default dedup horizon).
    pub const DEFAULT_MAX_UNSENT_AGE: Duration = Duration::from_secs(300);
    /// Default request timeout: 10 s.
    pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
    /// Default first backoff: 100 ms.
    pub const DEFAULT_BACKOFF_BASE: Duration = Duration::from_millis(100);
    /// Default longest backoff: 5 s.
    pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(5);
    /// Default concurrency: 64 requests (a request waits for its group commit, up to the
    /// gateway's commit interval: about interval / linger requests keep latency at one interval).
    pub const DEFAULT_CONCURRENCY: usize = 64;

    /// Defaults for a gateway at `url` with key `token`.
    pub fn new(url: impl Into<String>, token: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            token: token.into(),
            max_batch_events: Self::DEFAULT_MAX_BATCH_EVENTS,
            max_batch_bytes: Self::DEFAULT_MAX_BATCH_BYTES,
            linger: Self::DEFAULT_LINGER,
            zstd_level: Self::DEFAULT_ZSTD_LEVEL,
            max_unsent_bytes: Self::DEFAULT_MAX_UNSENT_BYTES,
            max_unsent_age: Self::DEFAULT_MAX_UNSENT_AGE,
            request_timeout: Self::DEFAULT_REQUEST_TIMEOUT,
            backoff_base: Self::DEFAULT_BACKOFF_BASE,
            backoff_max: Self::DEFAULT_BACKOFF_MAX,
            concurrency: Self::DEFAULT_CONCURRENCY,
        }
    }
}

/// Errors from starting a producer.
#[derive(Debug, thiserror::Error)]
pub enum ProducerError {
    /// The configuration is unusable.
    #[error("producer configuration: {0}")]
    Config(String),
}

/// Why `send` refused an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Dropped {
    /// The unsent byte budget is spent.
    #[error("the producer's unsent byte budget is spent")]
    BufferFull,
    /// The producer is closing.
    #[error("the producer is closing")]
    Closed,
}

struct Pending {
    bytes: Vec<u8>,
    enqueued: Instant,
}

#[derive(Default)]
struct Counters {
    enqueued: AtomicU64,
    accepted: AtomicU64,
    duplicate: AtomicU64,
    rejected: AtomicU64,
    dropped_buffer: AtomicU64,
    dropped_age: AtomicU64,
    throttled: AtomicU64,
    unavailable: AtomicU64,
    failed_requests: AtomicU64,
    requests: AtomicU64,
}

struct Inner {
    config: ProducerConfig,
    client: reqwest::Client,
    endpoint: String,
    queue: Mutex<VecDeque<Pending>>,
    unsent_bytes: AtomicUsize,
    /// Enqueue time (µs since `epoch`) of the oldest event in a request in flight, per worker.
    in_flight_oldest: Vec<AtomicI64>,
    epoch: Instant,
    notify: Notify,
    closing: std::sync::atomic::AtomicBool,
    counters: Counters,
    rejected_by_reason: Mutex<BTreeMap<String, u64>>,
    latency_us: Mutex<Histogram<u64>>,
}

/// What a producer has done so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProducerStats {
    /// Events handed to `send` and buffered.
    pub enqueued: u64,
    /// Events acknowledged as newly committed.
    pub accepted: u64,
    /// Events acknowledged as duplicates (already committed).
    pub duplicate: u64,
    /// Events the gateway rejected (not retried).
    pub rejected: u64,
    /// Rejections by reason code.
    pub rejected_by_reason: BTreeMap<String, u64>,
    /// Events refused by `send` because the byte budget was spent.
    pub dropped_buffer: u64,
    /// Events dropped because they outlived the age budget before an acknowledgment.
    pub dropped_age: u64,
    /// 429 answers.
    pub throttled: u64,
    /// 503 answers.
    pub unavailable: u64,
    /// Requests that failed without an answer (connection errors, timeouts) or with 5xx.
    pub failed_requests: u64,
    /// Requests sent (attempts).
    pub requests: u64,
    /// Age of the oldest event not yet acknowledged, buffered or in flight.
    pub oldest_unsent_age: Option<Duration>,
    /// Acknowledgment latency percentiles (enqueue → ack): p50, p99, p99.9.
    pub ack_latency: Option<[Duration; 3]>,
}

/// See the module docs.
pub struct Producer {
    inner: Arc<Inner>,
    workers: JoinSet<()>,
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("url", &self.inner.config.url)
            .finish()
    }
}

#[derive(Deserialize)]
struct AckBody {
    #[serde(default)]
    results: Vec<EventResult>,
}

#[derive(Deserialize)]
struct EventResult {
    status: String,
    #[serde(default)]
    reason: Option<String>,
}

#[derive(Deserialize)]
struct ErrorBody {
    error: ErrorDetail,
}

#[derive(Deserialize)]
struct ErrorDetail {
    reason: String,
}

impl Producer {
    /// Starts the worker tasks (on the current tokio runtime).
    pub fn start(config: ProducerConfig) -> Result<Self, ProducerError> {
        if config.max_batch_events == 0 || config.concurrency == 0 {
            return Err(ProducerError::Config(
                "max_batch_events and concurrency must be positive".into(),
            ));
        }
        let client = reqwest::Client::builder()
            .timeout(config.request_timeout)
            .pool_max_idle_per_host(config.concurrency)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| ProducerError::Config(format!("HTTP client: {e}")))?;
        let endpoint = format!("{}/v1/events", config.url.trim_end_matches('/'));
        let histogram = Histogram::new_with_bounds(1, 3_600_000_000, 3)
            .map_err(|e| ProducerError::Config(format!("histogram: {e}")))?;
        let inner = Arc::new(Inner {
            client,
            endpoint,
            queue: Mutex::new(VecDeque::new()),
            unsent_bytes: AtomicUsize::new(0),
            in_flight_oldest: (0..config.concurrency)
                .map(|_| AtomicI64::new(-1))
                .collect(),
            epoch: Instant::now(),
            notify: Notify::new(),
            closing: std::sync::atomic::AtomicBool::new(false),
            counters: Counters::default(),
            rejected_by_reason: Mutex::new(BTreeMap::new()),
            latency_us: Mutex::new(histogram),
            config,
        });
        let mut workers = JoinSet::new();
        for w in 0..inner.config.concurrency {
            workers.spawn(worker(Arc::clone(&inner), w));
        }
        Ok(Self { inner, workers })
    }

    /// Buffers one serialized event (a JSON object). Refuses, and counts, an event that
    /// would exceed the unsent byte budget.
    pub fn send(&self, event: Vec<u8>) -> Result<(), Dropped> {
        let inner = &self.inner;
        if inner.closing.load(Ordering::Acquire) {
            return Err(Dropped::Closed);
        }
        let len = event.len();
        let after = inner.unsent_bytes.fetch_add(len, Ordering::AcqRel) + len;
        if after > inner.config.max_unsent_bytes {
            inner.unsent_bytes.fetch_sub(len, Ordering::AcqRel);
            inner
                .counters
                .dropped_buffer
                .fetch_add(1, Ordering::Relaxed);
            return Err(Dropped::BufferFull);
        }
        inner.counters.enqueued.fetch_add(1, Ordering::Relaxed);
        let depth = {
            let mut q = lock(&inner.queue);
            q.push_back(Pending {
                bytes: event,
                enqueued: Instant::now(),
            });
            q.len()
        };
        if depth == 1 || depth >= inner.config.max_batch_events {
            inner.notify.notify_one();
        }
        Ok(())
    }

    /// What the producer has done so far.
    pub fn stats(&self) -> ProducerStats {
        let c = &self.inner.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let latency = {
            let h = lock(&self.inner.latency_us);
            (!h.is_empty()).then(|| {
                [50.0, 99.0, 99.9].map(|q| Duration::from_micros(h.value_at_quantile(q / 100.0)))
            })
        };
        ProducerStats {
            enqueued: load(&c.enqueued),
            accepted: load(&c.accepted),
            duplicate: load(&c.duplicate),
            rejected: load(&c.rejected),
            rejected_by_reason: lock(&self.inner.rejected_by_reason).clone(),
            dropped_buffer: load(&c.dropped_buffer),
            dropped_age: load(&c.dropped_age),
            throttled: load(&c.throttled),
            unavailable: load(&c.unavailable),
            failed_requests: load(&c.failed_requests),
            requests: load(&c.requests),
            oldest_unsent_age: self.oldest_unsent_age(),
            ack_latency: latency,
        }
    }

    /// Age of the oldest event not yet acknowledged (buffered or in flight).
    pub fn oldest_unsent_age(&self) -> Option<Duration> {
        let inner = &self.inner;
        let queued = lock(&inner.queue).front().map(|p| p.enqueued.elapsed());
        let now_us = inner.epoch.elapsed().as_micros() as i64;
        let flying = inner
            .in_flight_oldest
            .iter()
            .map(|a| a.load(Ordering::Acquire))
            .filter(|v| *v >= 0)
            .min()
            .map(|oldest| Duration::from_micros((now_us - oldest).max(0) as u64));
        queued.into_iter().chain(flying).max()
    }

    /// Events buffered or in flight.
    pub fn unsent(&self) -> usize {
        let flying = self
            .inner
            .in_flight_oldest
            .iter()
            .filter(|a| a.load(Ordering::Acquire) >= 0)
            .count();
        lock(&self.inner.queue).len() + flying
    }

    /// Waits until every buffered event is acknowledged, rejected or dropped, or until
    /// `timeout`; true when nothing is left.
    pub async fn flush(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            self.inner.notify.notify_waiters();
            if self.unsent() == 0 {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Flushes (within `timeout`) and stops the workers; what is left is dropped and counted.
    pub async fn close(mut self, timeout: Duration) -> ProducerStats {
        self.inner.closing.store(true, Ordering::Release);
        self.flush(timeout).await;
        self.workers.abort_all();
        while self.workers.join_next().await.is_some() {}
        let left = {
            let mut q = lock(&self.inner.queue);
            let n = q.len();
            q.clear();
            n
        };
        self.inner
            .counters
            .dropped_age
            .fetch_add(left as u64, Ordering::Relaxed);
        self.stats()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn jitter(d: Duration) -> Duration {
    let ms = d.as_millis().max(1) as u64;
    d + Duration::from_millis(rand::rng().random_range(0..=ms / 2))
}

async fn worker(inner: Arc<Inner>, slot: usize) {
    loop {
        let batch = loop {
            let ready = {
                let q = lock(&inner.queue);
                q.front().map(|front| {
                    q.len() >= inner.config.max_batch_events
                        || front.enqueued.elapsed() >= inner.config.linger
                        || inner.closing.load(Ordering::Acquire)
                })
            };
            match ready {
                Some(true) => {
                    if let Some(b) = take_batch(&inner) {
                        break b;
                    }
                }
                Some(false) => tokio::time::sleep(inner.config.linger / 4).await,
                None => {
                    tokio::select! {
                        _ = inner.notify.notified() => {}
                        _ = tokio::time::sleep(inner.config.linger) => {}
                    }
                }
            }
        };
        let oldest = batch
            .first()
            .map(|p| p.enqueued)
            .unwrap_or_else(Instant::now);
        inner.in_flight_oldest[slot].store(
            oldest.duration_since(inner.epoch).as_micros() as i64,
            Ordering::Release,
        );
        deliver(&inner, batch).await;
        inner.in_flight_oldest[slot].store(-1, Ordering::Release);
    }
}

fn take_batch(inner: &Inner) -> Option<Vec<Pending>> {
    let mut q = lock(&inner.queue);
    let mut batch = Vec::new();
    let mut bytes = 0usize;
    while let Some(front) = q.front() {
        if !batch.is_empty()
            && (batch.len() >= inner.config.max_batch_events
                || bytes + front.bytes.len() > inner.config.max_batch_bytes)
        {
            break;
        }
        let p = q.pop_front()?;
        bytes += p.bytes.len();
        batch.push(p);
    }
    (!batch.is_empty()).then_some(batch)
}

fn release(inner: &Inner, batch: &[Pending]) {
    let bytes: usize = batch.iter().map(|p| p.bytes.len()).sum();
    inner.unsent_bytes.fetch_sub(bytes, Ordering::AcqRel);
}

async fn deliver(inner: &Inner, batch: Vec<Pending>) {
    let mut body = Vec::with_capacity(batch.iter().map(|p| p.bytes.len() + 1).sum());
    for p in &batch {
        body.extend_from_slice(&p.bytes);
        body.push(b'\n');
    }
    let (body, encoding) = if inner.config.zstd_level > 0 {
        match zstd::bulk::compress(&body, inner.config.zstd_level) {
            Ok(z) => (z, Some("zstd")),
            Err(_) => (body, None),
        }
    } else {
        (body, None)
    };
    let body = bytes::Bytes::from(body);
    let oldest = batch
        .first()
        .map(|p| p.enqueued)
        .unwrap_or_else(Instant::now);
    let c = &inner.counters;
    let mut backoff = inner.config.backoff_base;
    loop {
        if oldest.elapsed() > inner.config.max_unsent_age {
            c.dropped_age
                .fetch_add(batch.len() as u64, Ordering::Relaxed);
            release(inner, &batch);
            return;
        }
        c.requests.fetch_add(1, Ordering::Relaxed);
        let mut req = inner
            .client
            .post(&inner.endpoint)
            .bearer_auth(&inner.config.token)
            .header("content-type", "application/x-ndjson")
            .body(body.clone());
        if let Some(enc) = encoding {
            req = req.header("content-encoding", enc);
        }
        let wait = match req.send().await {
            Ok(resp) => {
                let status = resp.status().as_u16();
                let retry_after = resp
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .map(Duration::from_secs);
                match status {
                    200 | 207 | 400 | 403 | 409 => match resp.bytes().await {
                        Ok(text) => {
                            account(inner, &batch, status, &text);
                            release(inner, &batch);
                            return;
                        }
                        Err(_) => {
                            c.failed_requests.fetch_add(1, Ordering::Relaxed);
                            None
                        }
                    },
                    429 | 503 => {
                        if status == 429 {
                            c.throttled.fetch_add(1, Ordering::Relaxed);
                        } else {
                            c.unavailable.fetch_add(1, Ordering::Relaxed);
                        }
                        Some(retry_after.unwrap_or(backoff))
                    }
                    s if s >= 500 => {
                        c.failed_requests.fetch_add(1, Ordering::Relaxed);
                        None
                    }
                    _ => {
                        // 401, 413, 415 and other refusals of the whole request: not retried.
                        let text = resp.bytes().await.unwrap_or_default();
                        let reason = serde_json::from_slice::<ErrorBody>(&text)
                            .map(|b| b.error.reason)
                            .unwrap_or_else(|_| format!("http_{status}"));
                        c.rejected.fetch_add(batch.len() as u64, Ordering::Relaxed);
                        *lock(&inner.rejected_by_reason).entry(reason).or_default() +=
                            batch.len() as u64;
                        release(inner, &batch);
                        return;
                    }
                }
            }
            Err(_) => {
                c.failed_requests.fetch_add(1, Ordering::Relaxed);
                None
            }
        };
        let delay = match wait {
            Some(server_said) => jitter(server_said.min(inner.config.backoff_max)),
            None => {
                let d = jitter(backoff);
                backoff = (backoff * 2).min(inner.config.backoff_max);
                d
            }
        };
        tokio::time::sleep(delay).await;
    }
}

fn account(inner: &Inner, batch: &[Pending], status: u16, text: &[u8]) {
    let c = &inner.counters;
    let now = Instant::now();
    let results = serde_json::from_slice::<AckBody>(text)
        .map(|b| b.results)
        .unwrap_or_default();
    if results.is_empty() {
        // An answer without results (should not happen): count the batch by status.
        let n = batch.len() as u64;
        if status < 300 {
            c.accepted.fetch_add(n, Ordering::Relaxed);
        } else {
            c.rejected.fetch_add(n, Ordering::Relaxed);
        }
        return;
    }
    let mut hist = lock(&inner.latency_us);
    let mut reasons = lock(&inner.rejected_by_reason);
    for (r, p) in results.iter().zip(batch) {
        match r.status.as_str() {
            "accepted" => {
                c.accepted.fetch_add(1, Ordering::Relaxed);
            }
            "duplicate" => {
                c.duplicate.fetch_add(1, Ordering::Relaxed);
            }
            _ => {
                c.rejected.fetch_add(1, Ordering::Relaxed);
                let reason = r.reason.clone().unwrap_or_else(|| "unknown".into());
                *reasons.entry(reason).or_default() += 1;
                continue;
            }
        }
        let us = now.duration_since(p.enqueued).as_micros() as u64;
        let _ = hist.record(us.max(1));
    }
}
