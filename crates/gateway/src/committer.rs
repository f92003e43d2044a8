//! The group committer: one task that admits validated events, drops duplicates, and
//! commits groups to the landing table, acknowledging each request only after the commit
//! that holds its events succeeded.
//!
//! A group closes after `commit.interval` or at `commit.max_bytes`. One commit is in
//! flight at a time; the next group fills meanwhile. A failed commit is retried with the
//! same commit identity (so an attempt whose outcome was unknown never lands twice) until
//! it succeeds; its requests wait, and new requests are refused with 503 by the admission
//! checks while the store is failing or the queue is full.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use futures::Future;
use signalweave_lake::{AppendWriter, CommitIdentity, Lake, LakeError, LakeTable};
use signalweave_model::{Event, EventBatchBuilder};
use tokio::sync::{mpsc, oneshot, watch};

use crate::dedup::{DedupIndex, Seen, identity};
use crate::metrics::Metrics;

/// Rejection evidence rows kept waiting for a commit at most; more are dropped and counted.
pub const MAX_PENDING_EVIDENCE_ROWS: usize = 100_000;

/// Bytes of rejection evidence (Arrow memory) kept waiting for a commit at most; more are
/// dropped and counted. A row's fields are cut at 128 characters, but its detail may
/// quote the record: rows alone do not bound the memory.
pub const MAX_PENDING_EVIDENCE_BYTES: usize = 64 << 20;

/// Rows encoded into the group's data files at a time, while the group fills.
pub const ENCODE_CHUNK_ROWS: usize = 8192;

/// Snapshot summary key: the ingest time of the group's first request, µs.
pub const SUMMARY_INGEST_MIN: &str = "signalweave.ingest-min-us";

/// State the request handlers read to decide admission; the committer writes it.
#[derive(Debug)]
pub struct Pipeline {
    /// Decoded bytes admitted and not yet committed.
    pub queue_bytes: AtomicUsize,
    /// The same, per tenant (by configuration index).
    pub tenant_bytes: Vec<AtomicUsize>,
    /// Ingest time (µs) of the oldest uncommitted event; 0 when none.
    pub oldest_queued_us: AtomicI64,
    /// When the commit in flight started (µs); 0 when none.
    pub commit_started_us: AtomicI64,
    /// Whether the last commit attempt failed.
    pub store_failing: AtomicBool,
    /// The last commit failure, for /readyz.
    pub last_failure: Mutex<Option<String>>,
}

impl Pipeline {
    /// Empty accounting for `tenants` tenants.
    pub fn new(tenants: usize) -> Self {
        Self {
            queue_bytes: AtomicUsize::new(0),
            tenant_bytes: (0..tenants).map(|_| AtomicUsize::new(0)).collect(),
            oldest_queued_us: AtomicI64::new(0),
            commit_started_us: AtomicI64::new(0),
            store_failing: AtomicBool::new(false),
            last_failure: Mutex::new(None),
        }
    }

    fn release(&self, tenant_bytes: &[usize]) {
        for (i, b) in tenant_bytes.iter().enumerate() {
            if *b > 0 {
                self.queue_bytes.fetch_sub(*b, Ordering::AcqRel);
                if let Some(t) = self.tenant_bytes.get(i) {
                    t.fetch_sub(*b, Ordering::AcqRel);
                }
            }
        }
    }
}

/// Validated events of one request, admitted to the queue.
#[derive(Debug)]
pub struct Submission {
    /// The key's tenant (configuration index), for queue accounting.
    pub tenant_index: usize,
    /// Ingest time stamped on the events.
    pub ingest_time_us: i64,
    /// Valid events, in request order.
    pub events: Vec<Event>,
    /// Decoded bytes admitted for this request (released at commit).
    pub bytes: usize,
    /// Evidence of the request's rejected records, for `signalweave.rejections`.
    pub evidence: Option<RecordBatch>,
    /// Where the outcome goes.
    pub reply: oneshot::Sender<Result<Ack, Unavailable>>,
}

/// A request's acknowledgment: its events are committed.
#[derive(Debug, Clone)]
pub struct Ack {
    /// The snapshot that holds the request's events (or their earlier twins).
    pub snapshot_id: Option<i64>,
    /// Per event of the submission, in order: what became of it.
    pub outcome: Vec<Outcome>,
}

/// What the committer did with one valid event of a submission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Landed by this submission's commit.
    Accepted,
    /// A retry of an event accepted within the horizon: landed once, by its original.
    Duplicate,
    /// Another event under the identity of one accepted within the horizon: not landed.
    Conflict,
}

/// Where the gateway is in its life, as its committer is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    /// Accepting requests.
    Serving,
    /// Stopping: no new connections; the drain deadline runs from here.
    Draining,
    /// The HTTP side is done: nothing more will be submitted.
    Closed,
}

/// The commit could not be made durable (the gateway gave up while draining, or the
/// lake refused the batch). The client may retry: its events did not land, or landed and
/// will be acknowledged as duplicates.
#[derive(Debug, Clone)]
pub struct Unavailable(pub String);

struct Waiter {
    reply: oneshot::Sender<Result<Ack, Unavailable>>,
    outcome: Vec<Outcome>,
    /// The group committing when this request was admitted, when some of its events are
    /// answered `Duplicate` of an event in it while the request waits on a later group:
    /// if that group fails, those events never land, so neither may this answer say so.
    twins_in: Option<u64>,
}

struct Group {
    id: u64,
    builder: EventBatchBuilder,
    /// Finished chunks of the group (kept for a retry through a plain append).
    batches: Vec<RecordBatch>,
    /// The group's data files, encoded while it fills; None until the first chunk, or
    /// after a write failed (the commit then appends `batches` instead).
    writer: Option<Encoder>,
    writer_failed: bool,
    ids: Vec<u128>,
    ingest: Vec<i64>,
    tenant_bytes: Vec<usize>,
    first_ingest_us: i64,
    opened: Option<Instant>,
    waiters: Vec<Waiter>,
}

/// A group's data files as its chunks are encoded: each chunk is encoded on a task of its
/// own, which gives the writer back when done, so the committer's loop goes on admitting
/// requests (and driving the commit in flight) meanwhile. One chunk is encoded at a time,
/// in order. Dropped (a group abandoned), it stops its task: the files are orphans.
struct Encoder(Option<tokio::task::JoinHandle<signalweave_lake::Result<AppendWriter>>>);

impl Drop for Encoder {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

impl Encoder {
    /// Opens the group's data files and encodes its first chunk, `batch`, on a task of
    /// its own (opening reads the table from the catalog: not on the committer's loop).
    fn start(lake: Lake, identity: CommitIdentity, batch: RecordBatch) -> Self {
        Self(Some(tokio::spawn(async move {
            let mut writer = lake.append_writer(LakeTable::Events, &identity).await?;
            writer.write(&batch).await.map(|()| writer)
        })))
    }

    /// Encodes `batch` next, on a task of its own.
    fn encode(mut writer: AppendWriter, batch: RecordBatch) -> Self {
        Self(Some(tokio::spawn(async move {
            writer.write(&batch).await.map(|()| writer)
        })))
    }

    /// The writer, once the chunk in hand is encoded; None when that failed (the commit
    /// then appends the group's rows instead).
    async fn ready(mut self) -> Option<AppendWriter> {
        let task = self.0.take()?;
        match task.await {
            Ok(Ok(w)) => Some(w),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot encode a chunk of the group; the commit appends instead");
                None
            }
            Err(e) => {
                tracing::warn!(error = %e, "the task encoding a chunk of the group failed; the commit appends instead");
                None
            }
        }
    }
}

impl Group {
    fn new(id: u64, tenants: usize) -> Self {
        Self {
            id,
            builder: EventBatchBuilder::with_capacity(ENCODE_CHUNK_ROWS),
            batches: Vec::new(),
            writer: None,
            writer_failed: false,
            ids: Vec::new(),
            ingest: Vec::new(),
            tenant_bytes: vec![0; tenants],
            first_ingest_us: 0,
            opened: None,
            waiters: Vec::new(),
        }
    }

    fn bytes(&self) -> usize {
        self.tenant_bytes.iter().sum()
    }

    fn is_empty(&self) -> bool {
        self.opened.is_none()
    }
}

/// What the committer did by the time it stopped.
#[derive(Debug, Clone, Default)]
pub struct CommitterReport {
    /// Commits made.
    pub commits: u64,
    /// Events committed.
    pub events: u64,
    /// Events whose requests were answered 503 because the drain deadline passed.
    pub abandoned_events: u64,
}

type CommitFuture = Pin<Box<dyn Future<Output = CommitResult> + Send>>;

struct CommitResult {
    events: Result<Option<i64>, LakeError>,
    evidence_left: Vec<RecordBatch>,
    elapsed: Duration,
}

/// Settings of the committer.
#[derive(Debug, Clone)]
pub struct CommitterOptions {
    /// Writer id of this gateway run (commit identities are `(writer_id, group id)`).
    pub writer_id: String,
    /// Group interval.
    pub interval: Duration,
    /// Group byte bound.
    pub max_bytes: usize,
    /// How long a drain may wait for a failing store before answering 503.
    pub drain_timeout: Duration,
    /// Tenants (for accounting).
    pub tenants: usize,
    /// Start a lake maintenance pass (merge manifests, expire, delete unreferenced files)
    /// after this many commits; 0 never. One pass runs at a time, beside the commits.
    pub maintain_every: u64,
}

/// The committer task's state.
pub struct Committer {
    lake: Lake,
    options: CommitterOptions,
    pipeline: Arc<Pipeline>,
    metrics: Arc<Metrics>,
    dedup: DedupIndex,
    open: Group,
    committing: Option<Group>,
    next_group: u64,
    evidence: Vec<RecordBatch>,
    evidence_rows: usize,
    evidence_bytes: usize,
    evidence_since: Option<Instant>,
    report: CommitterReport,
    maintenance: Option<tokio::task::JoinHandle<()>>,
    commits_since_maintenance: u64,
}

fn now_us() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

impl Committer {
    /// A committer over `lake`, starting from `dedup` (rebuilt from the landing table).
    pub fn new(
        lake: Lake,
        options: CommitterOptions,
        pipeline: Arc<Pipeline>,
        metrics: Arc<Metrics>,
        dedup: DedupIndex,
    ) -> Self {
        let tenants = options.tenants;
        Self {
            lake,
            options,
            pipeline,
            metrics,
            dedup,
            open: Group::new(1, tenants),
            committing: None,
            next_group: 2,
            evidence: Vec::new(),
            evidence_rows: 0,
            evidence_bytes: 0,
            evidence_since: None,
            report: CommitterReport::default(),
            maintenance: None,
            commits_since_maintenance: 0,
        }
    }

    /// Runs until `rx` is closed (or `phase` says [`Phase::Closed`]) and everything
    /// admitted is committed, or until the drain deadline: the drain timeout after the stop
    /// began ([`Phase::Draining`]). What is still uncommitted then is abandoned, and its
    /// requests are answered 503, so a store that stays down cannot hold the stop.
    pub async fn run(
        mut self,
        mut rx: mpsc::UnboundedReceiver<Submission>,
        mut phase: watch::Receiver<Phase>,
    ) -> CommitterReport {
        let mut closed = false;
        let mut drain_deadline: Option<tokio::time::Instant> = None;
        let mut phase_known = false;
        let mut in_flight: Option<CommitFuture> = None;
        let mut retry_at: Option<tokio::time::Instant> = None;
        let mut backoff = Duration::from_millis(100);
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            // Once the stop began, what is admitted is committed at once: the drain
            // deadline runs.
            let hurry = closed || drain_deadline.is_some();
            if in_flight.is_none()
                && retry_at.is_none()
                && (self.committing.is_some() || self.open_due(hurry))
            {
                in_flight = Some(self.start_commit());
            }
            if closed
                && in_flight.is_none()
                && self.committing.is_none()
                && self.open.is_empty()
                && self.evidence.is_empty()
            {
                break;
            }
            let wake = [self.open.opened, self.evidence_since]
                .into_iter()
                .flatten()
                .min()
                .map(|t| tokio::time::Instant::from_std(t + self.options.interval));
            tokio::select! {
                result = async { in_flight.as_mut().expect("guarded").await }, if in_flight.is_some() => {
                    in_flight = None;
                    if self.finish_commit(result) {
                        backoff = Duration::from_millis(100);
                    } else {
                        retry_at = Some(tokio::time::Instant::now() + backoff);
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                }
                sub = rx.recv(), if !closed => match sub {
                    Some(sub) => self.admit(sub).await,
                    None => {
                        closed = true;
                        drain_deadline.get_or_insert_with(|| {
                            tokio::time::Instant::now() + self.options.drain_timeout
                        });
                    }
                },
                changed = phase.changed(), if !phase_known => {
                    // A dropped sender means the gateway is gone: as closed.
                    let now = if changed.is_ok() { *phase.borrow_and_update() } else { Phase::Closed };
                    if now >= Phase::Draining {
                        drain_deadline.get_or_insert_with(|| {
                            tokio::time::Instant::now() + self.options.drain_timeout
                        });
                    }
                    if now == Phase::Closed {
                        // No more submissions; those already sent are still received
                        // (evidence of refusals among them), then `recv` says closed.
                        rx.close();
                        phase_known = true;
                    }
                }
                _ = async { tokio::time::sleep_until(retry_at.expect("guarded")).await }, if retry_at.is_some() => {
                    retry_at = None;
                }
                _ = async { tokio::time::sleep_until(wake.expect("guarded")).await }, if wake.is_some() && in_flight.is_none() && retry_at.is_none() => {}
                _ = async { tokio::time::sleep_until(drain_deadline.expect("guarded")).await }, if drain_deadline.is_some() => {
                    drop(in_flight.take());
                    self.abandon("the gateway stopped before the landing table accepted the commit");
                    if self.evidence_rows > 0 {
                        // Counted and said, as every evidence the gateway cannot keep.
                        self.metrics.evidence_dropped.inc_by(self.evidence_rows as u64);
                        tracing::warn!(rows = self.evidence_rows, "rejection evidence not committed before the drain deadline: dropped");
                    }
                    break;
                }
                _ = tick.tick() => self.housekeeping(),
            }
        }
        if let Some(h) = self.maintenance.take() {
            // A pass in flight is safe to stop: every step is a CAS commit or a deletion of
            // files nothing references.
            h.abort();
        }
        self.report
    }

    fn housekeeping(&mut self) {
        self.dedup.expire(now_us());
        self.metrics.dedup_entries.set(self.dedup.len() as i64);
        let oldest = self.pipeline.oldest_queued_us.load(Ordering::Acquire);
        let age = if oldest == 0 {
            0.0
        } else {
            (now_us() - oldest).max(0) as f64 / 1e6
        };
        self.metrics.queue_oldest_age_seconds.set(age);
        self.metrics
            .queue_bytes
            .set(self.pipeline.queue_bytes.load(Ordering::Acquire) as i64);
    }

    fn open_due(&self, closed: bool) -> bool {
        let Some(opened) = self.open.opened else {
            // Evidence alone is committed on the same schedule as events.
            return self.evidence_since.is_some_and(|since| {
                closed
                    || since.elapsed() >= self.options.interval
                    || self.evidence_rows >= MAX_PENDING_EVIDENCE_ROWS / 2
                    || self.evidence_bytes >= MAX_PENDING_EVIDENCE_BYTES / 2
            });
        };
        closed
            || opened.elapsed() >= self.options.interval
            || self.open.bytes() >= self.options.max_bytes
    }

    /// Keeps `evidence` for the next commit.
    fn keep_evidence(&mut self, evidence: RecordBatch) {
        self.evidence_rows += evidence.num_rows();
        self.evidence_bytes += evidence.get_array_memory_size();
        self.evidence.push(evidence);
        self.evidence_since.get_or_insert_with(Instant::now);
    }

    async fn admit(&mut self, sub: Submission) {
        if let Some(evidence) = sub.evidence {
            let bytes = evidence.get_array_memory_size();
            if self.evidence_rows + evidence.num_rows() > MAX_PENDING_EVIDENCE_ROWS
                || self.evidence_bytes + bytes > MAX_PENDING_EVIDENCE_BYTES
            {
                self.metrics
                    .evidence_dropped
                    .inc_by(evidence.num_rows() as u64);
            } else {
                self.keep_evidence(evidence);
            }
        }
        if sub.events.is_empty() {
            self.pipeline.release(&per_tenant(
                sub.tenant_index,
                sub.bytes,
                self.options.tenants,
            ));
            let _ = sub.reply.send(Ok(Ack {
                snapshot_id: None,
                outcome: Vec::new(),
            }));
            return;
        }
        let mut outcome = Vec::with_capacity(sub.events.len());
        let mut duplicates = 0u64;
        let mut wait_for: u64 = 0;
        let mut twins_in: Option<u64> = None;
        let mut added = 0usize;
        for event in &sub.events {
            let id = identity(event.tenant.as_str(), event.event_id.as_str());
            let content = event.content_digest();
            match self.dedup.check(id, content) {
                Seen::New => {
                    self.open.builder.push(event);
                    self.open.ids.push(id);
                    self.open.ingest.push(event.ingest_time_us);
                    self.dedup.hold(id, self.open.id, content);
                    wait_for = wait_for.max(self.open.id);
                    outcome.push(Outcome::Accepted);
                    added += 1;
                }
                Seen::InFlight(group) => {
                    wait_for = wait_for.max(group);
                    twins_in = Some(twins_in.map_or(group, |g: u64| g.min(group)));
                    outcome.push(Outcome::Duplicate);
                    duplicates += 1;
                }
                Seen::Committed => {
                    outcome.push(Outcome::Duplicate);
                    duplicates += 1;
                }
                Seen::Conflict => outcome.push(Outcome::Conflict),
            }
        }
        self.metrics
            .events
            .get_or_create(&[("outcome", "duplicate")])
            .inc_by(duplicates);
        let waiter = Waiter {
            reply: sub.reply,
            outcome,
            twins_in: twins_in.filter(|g| *g < wait_for),
        };
        if self.open.builder.len() >= ENCODE_CHUNK_ROWS {
            self.encode_chunk().await;
        }
        if added > 0 {
            if let Some(slot) = self.open.tenant_bytes.get_mut(sub.tenant_index) {
                *slot += sub.bytes;
            }
            if self.open.opened.is_none() {
                self.open.opened = Some(Instant::now());
                self.open.first_ingest_us = sub.ingest_time_us;
                self.note_oldest();
            }
        } else {
            self.pipeline.release(&per_tenant(
                sub.tenant_index,
                sub.bytes,
                self.options.tenants,
            ));
        }
        if wait_for == 0 {
            let _ = waiter.reply.send(Ok(Ack {
                snapshot_id: None,
                outcome: waiter.outcome,
            }));
        } else if wait_for == self.open.id {
            self.open.waiters.push(waiter);
        } else if let Some(c) = self.committing.as_mut().filter(|c| c.id == wait_for) {
            c.waiters.push(waiter);
        } else {
            // The twin's group is no longer waiting: it committed (or was abandoned, in which
            // case the identity was released and `check` would not have said InFlight).
            let _ = waiter.reply.send(Ok(Ack {
                snapshot_id: None,
                outcome: waiter.outcome,
            }));
        }
    }

    /// Moves the builder's rows into a chunk and encodes it into the group's data files.
    async fn encode_chunk(&mut self) {
        let batch = match self.open.builder.finish() {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "cannot build a chunk of the group");
                return;
            }
        };
        self.open.batches.push(batch.clone());
        if self.open.writer_failed {
            return;
        }
        // The chunk before is encoded first (waiting here only when encoding falls behind
        // the requests).
        match self.open.writer.take() {
            None => {
                let identity = CommitIdentity::new(self.options.writer_id.clone(), self.open.id);
                self.open.writer = Some(Encoder::start(self.lake.clone(), identity, batch));
            }
            Some(encoder) => match encoder.ready().await {
                Some(w) => self.open.writer = Some(Encoder::encode(w, batch)),
                None => self.open.writer_failed = true,
            },
        }
    }

    fn note_oldest(&self) {
        let oldest = [self.committing.as_ref(), Some(&self.open)]
            .into_iter()
            .flatten()
            .filter(|g| !g.is_empty())
            .map(|g| g.first_ingest_us)
            .min()
            .unwrap_or(0);
        self.pipeline
            .oldest_queued_us
            .store(oldest, Ordering::Release);
    }

    /// Closes the open group (unless a failed one is being retried) and starts its commit.
    fn start_commit(&mut self) -> CommitFuture {
        if self.committing.is_none() {
            let next = Group::new(self.next_group, self.options.tenants);
            self.next_group += 1;
            self.committing = Some(std::mem::replace(&mut self.open, next));
        }
        let group = self.committing.as_mut().expect("set above");
        let identity = CommitIdentity::new(self.options.writer_id.clone(), group.id);
        // The rows are fixed once: a retry commits the very same rows.
        let tail = if group.builder.is_empty() {
            Ok(None)
        } else {
            group.builder.finish().map(Some).map_err(|e| {
                LakeError::new(
                    signalweave_model::ErrorKind::Internal,
                    format!("cannot build the commit batch: {e}"),
                )
            })
        };
        let tail = match tail {
            Ok(t) => {
                if let Some(b) = &t {
                    group.batches.push(b.clone());
                }
                Ok(t)
            }
            Err(e) => Err(e),
        };
        let batches = group.batches.clone();
        let writer = group.writer.take();
        group.writer_failed |= writer.is_none();
        let evidence = std::mem::take(&mut self.evidence);
        self.evidence_rows = 0;
        self.evidence_bytes = 0;
        self.evidence_since = None;
        let lake = self.lake.clone();
        let first_ingest = group.first_ingest_us;
        self.pipeline
            .commit_started_us
            .store(now_us(), Ordering::Release);
        Box::pin(async move {
            let started = Instant::now();
            let summary: HashMap<String, String> =
                [(SUMMARY_INGEST_MIN.to_string(), first_ingest.to_string())].into();
            // The last chunk handed to the encoder first. Its files are used only if they
            // hold every chunk but the tail (else the rows are appended).
            let encoded_rows: usize = batches.iter().map(RecordBatch::num_rows).sum::<usize>()
                - tail
                    .as_ref()
                    .ok()
                    .and_then(Option::as_ref)
                    .map_or(0, RecordBatch::num_rows);
            let writer = match writer {
                Some(encoder) => encoder
                    .ready()
                    .await
                    .filter(|w| w.rows() == encoded_rows as u64),
                None => None,
            };
            let events = match (tail, writer) {
                (Err(e), _) => Err(e),
                (Ok(_), _) if batches.is_empty() => Ok(None),
                (Ok(tail), Some(mut writer)) => {
                    // The group's files were encoded while it filled: write the tail,
                    // close, commit.
                    let written = match &tail {
                        Some(t) => writer.write(t).await,
                        None => Ok(()),
                    };
                    let committed = match written {
                        Ok(()) => match writer.finish().await {
                            Ok(files) => lake.commit_written(files, summary.clone()).await,
                            Err(e) => Err(e),
                        },
                        Err(e) => Err(e),
                    };
                    match committed {
                        Ok(o) => Ok(Some(o.snapshot_id)),
                        // Fall back to a plain append of the same rows under the same
                        // identity: it finds the commit if the failed attempt landed.
                        Err(_) => lake
                            .append_with_summary(LakeTable::Events, &batches, &identity, summary)
                            .await
                            .map(|o| Some(o.snapshot_id)),
                    }
                }
                (Ok(_), None) => lake
                    .append_with_summary(LakeTable::Events, &batches, &identity, summary)
                    .await
                    .map(|o| Some(o.snapshot_id)),
            };
            let mut evidence_left = evidence;
            if events.is_ok() && !evidence_left.is_empty() {
                let id = CommitIdentity::new(
                    format!("{}-rejections", identity.writer_id),
                    identity.batch_seq,
                );
                match lake
                    .append(LakeTable::Rejections, &evidence_left, &id)
                    .await
                {
                    Ok(_) => evidence_left.clear(),
                    Err(e) => {
                        tracing::warn!(error = %e, "rejection evidence not committed; kept for the next commit")
                    }
                }
            }
            CommitResult {
                events,
                evidence_left,
                elapsed: started.elapsed(),
            }
        })
    }

    /// Applies a commit's outcome; false when it must be retried.
    fn finish_commit(&mut self, result: CommitResult) -> bool {
        self.pipeline.commit_started_us.store(0, Ordering::Release);
        for b in result.evidence_left {
            self.keep_evidence(b);
        }
        let snapshot_id = match result.events {
            Ok(s) => s,
            Err(e) => {
                self.metrics.commit_failures.inc();
                self.pipeline.store_failing.store(true, Ordering::Release);
                if let Ok(mut last) = self.pipeline.last_failure.lock() {
                    *last = Some(e.to_string());
                }
                tracing::warn!(error = %e, "commit failed; retrying with the same identity");
                if !e.retryable() {
                    // The lake refused the batch itself: retrying cannot help. The batch is
                    // given up, so nothing is left failing: the next group is admitted and
                    // tried (were the flag kept, no request would be admitted, and no
                    // commit would ever clear it).
                    self.fail_committing(&format!("the landing table refused the batch: {e}"));
                    self.pipeline.store_failing.store(false, Ordering::Release);
                    return true;
                }
                return false;
            }
        };
        self.pipeline.store_failing.store(false, Ordering::Release);
        let Some(group) = self.committing.take() else {
            return true;
        };
        if !group.ids.is_empty() {
            self.report.commits += 1;
            self.report.events += group.ids.len() as u64;
            self.metrics.commits.inc();
            self.metrics
                .commit_seconds
                .observe(result.elapsed.as_secs_f64());
            self.metrics.commit_events.observe(group.ids.len() as f64);
            self.metrics
                .events
                .get_or_create(&[("outcome", "accepted")])
                .inc_by(group.ids.len() as u64);
        }
        self.dedup.committed(&group.ids, &group.ingest);
        self.commits_since_maintenance += 1;
        self.maybe_maintain();
        self.pipeline.release(&group.tenant_bytes);
        for w in group.waiters {
            let _ = w.reply.send(Ok(Ack {
                snapshot_id,
                outcome: w.outcome,
            }));
        }
        self.note_oldest();
        true
    }

    /// Starts a maintenance pass of the landing and rejection tables when one is due and
    /// none is running. It runs as its own task: a lost CAS race costs it a retry, never
    /// an append.
    fn maybe_maintain(&mut self) {
        let every = self.options.maintain_every;
        if every == 0 || self.commits_since_maintenance < every {
            return;
        }
        if self.maintenance.as_ref().is_some_and(|h| !h.is_finished()) {
            return;
        }
        self.commits_since_maintenance = 0;
        let lake = self.lake.clone();
        self.maintenance = Some(tokio::spawn(async move {
            let policy = signalweave_lake::MaintenancePolicy::default();
            for table in [LakeTable::Events, LakeTable::Rejections] {
                match lake.maintain(table, &policy).await {
                    Ok(r) => {
                        tracing::debug!(table = table.name(), report = ?r, "maintenance pass");
                        if let Ok(Some(warning)) =
                            lake.held_history_warning(table, &r, &policy).await
                        {
                            tracing::warn!("{warning}");
                        }
                    }
                    Err(e) => {
                        tracing::warn!(table = table.name(), error = %e, "maintenance pass failed")
                    }
                }
            }
        }));
    }

    fn fail_committing(&mut self, why: &str) {
        if let Some(group) = self.committing.take() {
            self.dedup.release(&group.ids);
            self.pipeline.release(&group.tenant_bytes);
            self.report.abandoned_events += group.ids.len() as u64;
            for w in group.waiters {
                let _ = w.reply.send(Err(Unavailable(why.to_string())));
            }
            // Requests waiting on the open group that were told some of their events were
            // in this one: those events did not land. Their own events of the open group
            // still land; a retry finds them duplicates and lands the rest.
            let (failed, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.open.waiters)
                .into_iter()
                .partition(|w| w.twins_in == Some(group.id));
            self.open.waiters = waiting;
            for w in failed {
                let _ = w.reply.send(Err(Unavailable(format!(
                    "{why} (it held this request's duplicates' twins)"
                ))));
            }
        }
        self.note_oldest();
    }

    fn abandon(&mut self, why: &str) {
        self.fail_committing(why);
        let open = std::mem::replace(&mut self.open, Group::new(0, self.options.tenants));
        self.committing = Some(open);
        self.fail_committing(why);
    }
}

fn per_tenant(index: usize, bytes: usize, tenants: usize) -> Vec<usize> {
    let mut v = vec![0; tenants.max(index + 1)];
    v[index] = bytes;
    v
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use signalweave_model::{ErrorKind, Event, SchemaVersion};

    use super::*;

    fn event(id: &str) -> Event {
        Event {
            event_id: id.into(),
            event_type: "order_placed".into(),
            schema_version: SchemaVersion::new(1, 0, 0),
            tenant: "t".into(),
            producer_id: "p".into(),
            producer_seq: 1,
            event_time_us: 1_000_000,
            ingest_time_us: 2_000_000,
            partition_key: "k".into(),
            order_id: None,
            customer_id: None,
            market_id: Some("m".into()),
            business_version: 1,
            amount_minor: Some(5),
            currency: Some("EUR".into()),
            attributes: None,
        }
    }

    type Reply = oneshot::Receiver<Result<Ack, Unavailable>>;

    async fn submit(c: &mut Committer, ids: &[&str]) -> Reply {
        let (reply, rx) = oneshot::channel();
        c.admit(Submission {
            tenant_index: 0,
            ingest_time_us: 2_000_000,
            events: ids.iter().map(|id| event(id)).collect(),
            bytes: 100,
            evidence: None,
            reply,
        })
        .await;
        rx
    }

    async fn committer(dir: &std::path::Path) -> Committer {
        let lake = Lake::open(signalweave_lake::LakeConfig::embedded(dir))
            .await
            .unwrap();
        lake.init().await.unwrap();
        let options = CommitterOptions {
            writer_id: "w".into(),
            interval: Duration::from_millis(10),
            max_bytes: 1 << 20,
            drain_timeout: Duration::from_secs(1),
            tenants: 1,
            maintain_every: 0,
        };
        Committer::new(
            lake,
            options,
            Arc::new(Pipeline::new(1)),
            Arc::new(Metrics::new()),
            DedupIndex::new(60_000_000),
        )
    }

    /// Evidence waiting for a commit is bounded by its bytes as well as its rows: rows
    /// whose details quote large records are dropped (and counted) once the bytes are full,
    /// while their rows are far fewer than the row bound.
    #[tokio::test]
    async fn waiting_evidence_is_bounded_by_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = committer(dir.path()).await;
        let raw = vec![b'x'; 1 << 10];
        let detail = "y".repeat(256 << 10);
        let rows: Vec<(&[u8], u64, signalweave_model::Rejection)> = (0..16)
            .map(|i| {
                (
                    raw.as_slice(),
                    i,
                    signalweave_model::Rejection::new(
                        signalweave_model::ReasonCode::MalformedJson,
                        detail.clone(),
                    ),
                )
            })
            .collect();
        let batch = signalweave_lake::rejection_batch_of(1, "test", Some("t"), &rows).unwrap();
        let per_batch = batch.get_array_memory_size();
        assert!(per_batch >= 4 << 20, "{per_batch}");
        let sent = 64;
        for _ in 0..sent {
            let (reply, _rx) = oneshot::channel();
            c.admit(Submission {
                tenant_index: 0,
                ingest_time_us: 2_000_000,
                events: Vec::new(),
                bytes: 0,
                evidence: Some(batch.clone()),
                reply,
            })
            .await;
        }
        assert!(
            c.evidence_bytes <= MAX_PENDING_EVIDENCE_BYTES,
            "{}",
            c.evidence_bytes
        );
        assert_eq!(
            c.evidence_rows,
            16 * (MAX_PENDING_EVIDENCE_BYTES / per_batch)
        );
        assert!(c.evidence_rows < MAX_PENDING_EVIDENCE_ROWS);
        assert_eq!(
            c.metrics.evidence_dropped.get() as usize,
            16 * sent - c.evidence_rows
        );
        // A batch of one small rejection takes about what its buffers need (a builder's
        // default room for 1,024 rows would be some 65 KiB): about 40,000 requests with
        // one rejection each wait before the bytes are full.
        let one = signalweave_lake::rejection_batch_of(
            1,
            "test",
            Some("t"),
            &[(
                b"{}".as_slice(),
                0,
                signalweave_model::Rejection::new(
                    signalweave_model::ReasonCode::MalformedJson,
                    "not an event",
                ),
            )],
        )
        .unwrap();
        let bytes = one.get_array_memory_size();
        assert!(bytes < 4 << 10, "a one-row batch takes {bytes} bytes");
    }

    /// A group of several chunks is encoded chunk by chunk on tasks of their own while
    /// requests keep coming, and commits every row once, through its encoded files.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_group_encoded_chunk_by_chunk_commits_every_row_once() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = committer(dir.path()).await;
        let total = 3 * ENCODE_CHUNK_ROWS + 100;
        let ids: Vec<String> = (0..total).map(|i| format!("e-{i}")).collect();
        let mut replies = Vec::new();
        for chunk in ids.chunks(1_000) {
            let refs: Vec<&str> = chunk.iter().map(String::as_str).collect();
            replies.push(submit(&mut c, &refs).await);
            if c.open.batches.len() == 1 {
                assert!(c.open.writer.is_some(), "the first chunk is being encoded");
            }
        }
        // Requests of 1,000: a chunk is cut at the first request past 8,192 rows.
        assert_eq!(c.open.batches.len(), 2, "two chunks handed to the encoder");
        // Both encoded into the group's files, in one writer (handed back to the group).
        let writer = c.open.writer.take().unwrap().ready().await.unwrap();
        assert_eq!(writer.rows(), 18_000);
        c.open.writer = Some(Encoder(Some(tokio::spawn(async move { Ok(writer) }))));
        let result = c.start_commit().await;
        assert!(c.finish_commit(result));
        for r in replies {
            let ack = r.await.unwrap().unwrap();
            assert!(ack.outcome.iter().all(|o| *o == Outcome::Accepted));
        }
        let t = c.lake.table(LakeTable::Events).await.unwrap();
        let snapshot = t.metadata().current_snapshot().unwrap();
        assert_eq!(
            snapshot
                .summary()
                .additional_properties
                .get("added-records"),
            Some(&total.to_string())
        );
        assert_eq!(c.report.events, total as u64);
    }

    fn refused(kind: ErrorKind) -> CommitResult {
        CommitResult {
            events: Err(LakeError::new(kind, "refused")),
            evidence_left: Vec::new(),
            elapsed: Duration::ZERO,
        }
    }

    #[tokio::test]
    async fn a_batch_the_lake_refuses_fails_its_requests_and_those_told_their_events_were_in_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = committer(dir.path()).await;
        // A lands in group 1, which starts committing; a request of A and B then finds A
        // in flight and puts B in group 2.
        let first = submit(&mut c, &["a"]).await;
        drop(c.start_commit());
        let mixed = submit(&mut c, &["a", "b"]).await;
        let unrelated = submit(&mut c, &["c"]).await;

        // A retryable failure keeps the group and refuses admission meanwhile.
        assert!(!c.finish_commit(refused(ErrorKind::Unavailable)));
        assert!(c.pipeline.store_failing.load(Ordering::Acquire));
        assert!(c.committing.is_some());

        // A refusal gives the group up: its request, and the one told A was a duplicate
        // of it, are answered 503; the other waits for its own commit.
        assert!(c.finish_commit(refused(ErrorKind::InvalidInput)));
        let (mut first, mut mixed) = (first, mixed);
        assert!(first.try_recv().unwrap().is_err());
        assert!(mixed.try_recv().unwrap().is_err(), "A never landed");
        assert!(
            !c.pipeline.store_failing.load(Ordering::Acquire),
            "nothing is left failing, so the next requests are admitted"
        );
        assert_eq!(c.open.waiters.len(), 1);
        assert_eq!(
            c.dedup
                .check(identity("t", "a"), event("a").content_digest()),
            Seen::New
        );

        // The retry of the mixed request lands A, and answers B a duplicate of group 2.
        let retry = submit(&mut c, &["a", "b"]).await;
        let mut unrelated = unrelated;
        assert!(unrelated.try_recv().is_err(), "still waiting");
        let result = c.start_commit().await;
        assert!(c.finish_commit(result));
        let ack = retry.await.unwrap().unwrap();
        assert_eq!(ack.outcome, vec![Outcome::Accepted, Outcome::Duplicate]);
        assert!(ack.snapshot_id.is_some());
        assert!(unrelated.await.unwrap().is_ok());
    }
}
