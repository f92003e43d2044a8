//! The HTTP surface (axum): `POST /v1/events`, `/healthz`, `/readyz`, `/metrics`, and
//! the [`Gateway`] that owns the committer task.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use arrow_array::cast::AsArray;
use arrow_array::types::TimestampMicrosecondType;
use axum::Router;
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::TryStreamExt;
use serde::Serialize;
use signalweave_lake::{Lake, LakeTable, rejection_batch_of};
use signalweave_model::{
    CONTENT_COLUMNS, ErrorKind, EventValidator, ReasonCode, Rejection, SchemaRegistry,
    ValidationLimits, content_digests, format_rfc3339_micros,
};
use tokio::sync::{Semaphore, mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use crate::auth::{Authenticator, Grant};
use crate::body::{Undecoded, body_format, decode_within, decoder_memory, split};
use crate::committer::{
    Committer, CommitterOptions, CommitterReport, Outcome, Phase, Pipeline, Submission, Unavailable,
};
use crate::config::GatewayConfig;
use crate::dedup::{DedupIndex, identity};
use crate::error::{GatewayError, Result};
use crate::metrics::Metrics;
use crate::quota::{QuotaRefusal, Quotas};

/// Response header: the oldest event age the gateway still accepts, in seconds.
pub const MAX_EVENT_AGE_HEADER: &str = "signalweave-max-event-age";

/// How long a draining gateway waits for a failing store before answering 503, unless
/// `commit.drain_timeout` says otherwise.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// How long after the drain timeout a stopping gateway waits for its connections to close
/// (their requests are answered by then) before it stops waiting for them.
pub const HTTP_GRACE: Duration = Duration::from_secs(5);

struct AppState {
    config: GatewayConfig,
    auth: Authenticator,
    quotas: Quotas,
    validator: EventValidator,
    pipeline: Arc<Pipeline>,
    metrics: Arc<Metrics>,
    permits: Arc<Semaphore>,
    /// Bytes of request bodies held, as received and decoded, with their decoders' windows
    /// and their events' validated copies ([`RequestLimits::max_bytes_in_flight`]).
    ///
    /// [`RequestLimits::max_bytes_in_flight`]: crate::config::RequestLimits::max_bytes_in_flight
    body_bytes: Arc<Semaphore>,
    tx: mpsc::UnboundedSender<Submission>,
    ready: AtomicBool,
    /// Evidence rows for refusals of requests without a valid key: they name no tenant
    /// whose quota could pay for them, so they share one budget.
    unauthenticated_evidence: governor::DefaultDirectRateLimiter,
    /// Evidence rows for refusals of a tenant's whole requests (malformed, too large, timed
    /// out, ...), which spend none of its quota: one budget per tenant.
    refusal_evidence: governor::DefaultKeyedRateLimiter<usize>,
}

/// Evidence rows per second for refused requests, without a valid key (all together) or
/// of one tenant (each its own), and their burst.
const REFUSAL_EVIDENCE_PER_SEC: u32 = 10;
const REFUSAL_EVIDENCE_BURST: u32 = 100;

fn refusal_evidence_quota() -> governor::Quota {
    governor::Quota::per_second(
        std::num::NonZeroU32::new(REFUSAL_EVIDENCE_PER_SEC).unwrap_or(std::num::NonZeroU32::MIN),
    )
    .allow_burst(
        std::num::NonZeroU32::new(REFUSAL_EVIDENCE_BURST).unwrap_or(std::num::NonZeroU32::MIN),
    )
}

/// A running gateway: the committer task and the state the HTTP handlers share.
pub struct Gateway {
    state: Arc<AppState>,
    committer: JoinHandle<CommitterReport>,
    /// Tells the committer when the stop begins and when the HTTP side is done.
    phase: Arc<watch::Sender<Phase>>,
    writer_id: String,
    dedup_loaded: usize,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("writer_id", &self.writer_id)
            .finish()
    }
}

fn now_us() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

/// Rebuilds the duplicate index from the landing table: the identities (and content
/// digests) of events ingested within `horizon`, read from the current snapshot by `ingest_time` (the data files'
/// column statistics prune everything older), so it needs no snapshot history.
pub async fn rebuild_dedup(lake: &Lake, horizon: Duration) -> Result<DedupIndex> {
    let horizon_us = i64::try_from(horizon.as_micros()).unwrap_or(i64::MAX);
    let now = now_us();
    let cutoff = now.saturating_sub(horizon_us);
    let mut index = DedupIndex::new(horizon_us);
    let columns: Vec<String> = ["event_id", "tenant", "ingest_time"]
        .into_iter()
        .chain(CONTENT_COLUMNS)
        .map(String::from)
        .collect();
    let plan = lake
        .plan_column_range(
            LakeTable::Events,
            "ingest_time",
            cutoff,
            i64::MAX,
            None,
            Some(&columns),
        )
        .await?;
    let tasks = plan.tasks;
    if tasks.is_empty() {
        return Ok(index);
    }
    let mut stream = lake.read(LakeTable::Events, tasks).await?;
    let mut entries = Vec::new();
    while let Some(batch) = stream
        .try_next()
        .await
        .map_err(|e| GatewayError::new(ErrorKind::Unavailable, format!("rebuild dedup: {e}")))?
    {
        let (Some(ids), Some(tenants), Some(ingest)) = (
            batch.column_by_name("event_id"),
            batch.column_by_name("tenant"),
            batch.column_by_name("ingest_time"),
        ) else {
            return Err(GatewayError::new(
                ErrorKind::Internal,
                format!(
                    "rebuild dedup: the events table lacks event_id, tenant or ingest_time: {:?}",
                    batch.schema()
                ),
            ));
        };
        let ids = ids.as_string_opt::<i32>();
        let tenants = tenants.as_string_opt::<i32>();
        let ingest = ingest.as_primitive_opt::<TimestampMicrosecondType>();
        let (Some(ids), Some(tenants), Some(ingest)) = (ids, tenants, ingest) else {
            return Err(GatewayError::new(
                ErrorKind::Internal,
                "rebuild dedup: unexpected column types in the events table",
            ));
        };
        let contents = content_digests(&batch)
            .map_err(|e| GatewayError::new(ErrorKind::Internal, format!("rebuild dedup: {e}")))?;
        for (row, content) in contents.into_iter().enumerate() {
            let at = ingest.value(row);
            if at >= cutoff {
                entries.push((at, identity(tenants.value(row), ids.value(row)), content));
            }
        }
    }
    index.load(entries, now);
    Ok(index)
}

impl Gateway {
    /// Starts a gateway on `lake` (initialized): rebuilds the duplicate index and spawns
    /// the committer. Serve it with [`Gateway::serve`] or mount [`Gateway::router`].
    pub async fn start(
        config: GatewayConfig,
        lake: Lake,
        registry: Arc<SchemaRegistry>,
    ) -> Result<Self> {
        config.validate()?;
        let dedup = rebuild_dedup(&lake, config.dedup.horizon).await?;
        let dedup_loaded = dedup.len();
        let metrics = Arc::new(Metrics::new());
        metrics.dedup_entries.set(dedup_loaded as i64);
        let pipeline = Arc::new(Pipeline::new(config.tenants.len()));
        let run = uuid::Uuid::new_v4().simple().to_string();
        let writer_id = format!("gateway-{}-{}", config.instance, &run[..12]);
        let (tx, rx) = mpsc::unbounded_channel();
        let committer = Committer::new(
            lake,
            CommitterOptions {
                writer_id: writer_id.clone(),
                interval: config.commit.interval,
                max_bytes: config.commit.max_bytes,
                drain_timeout: config.commit.drain_timeout,
                tenants: config.tenants.len(),
                maintain_every: config.commit.maintain_every,
            },
            Arc::clone(&pipeline),
            Arc::clone(&metrics),
            dedup,
        );
        let (phase, phase_rx) = watch::channel(Phase::Serving);
        let committer = tokio::spawn(committer.run(rx, phase_rx));
        let limits = ValidationLimits {
            max_event_bytes: config.limits.max_event_bytes,
            max_future_skew_us: i64::try_from(config.limits.max_future_skew.as_micros())
                .unwrap_or(i64::MAX),
            ..ValidationLimits::default()
        };
        let state = Arc::new(AppState {
            auth: Authenticator::new(&config),
            quotas: Quotas::new(&config),
            validator: EventValidator::new(registry, limits),
            permits: Arc::new(Semaphore::new(config.limits.max_concurrent_requests)),
            body_bytes: Arc::new(Semaphore::new(config.limits.max_bytes_in_flight)),
            pipeline,
            metrics,
            tx,
            ready: AtomicBool::new(true),
            unauthenticated_evidence: governor::RateLimiter::direct(refusal_evidence_quota()),
            refusal_evidence: governor::RateLimiter::keyed(refusal_evidence_quota()),
            config,
        });
        // Idle producers' quota buckets are forgotten now and then, so a key that may speak
        // for any producer cannot grow the gateway's memory without bound.
        let weak = Arc::downgrade(&state);
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_secs(30));
            every.tick().await;
            loop {
                every.tick().await;
                let Some(state) = weak.upgrade() else { return };
                state.quotas.retain_recent();
            }
        });
        Ok(Self {
            state,
            committer,
            phase: Arc::new(phase),
            writer_id,
            dedup_loaded,
        })
    }

    /// The writer id this run's commits carry.
    pub fn writer_id(&self) -> &str {
        &self.writer_id
    }

    /// Identities loaded into the duplicate index at start.
    pub fn dedup_loaded(&self) -> usize {
        self.dedup_loaded
    }

    /// The gateway's routes.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/v1/events", post(post_events))
            .route("/healthz", get(healthz))
            .route("/readyz", get(readyz))
            .route("/metrics", get(metrics))
            .fallback(not_served)
            .method_not_allowed_fallback(not_served)
            .layer(DefaultBodyLimit::disable())
            .with_state(Arc::clone(&self.state))
    }

    /// Serves on `listener` until `shutdown` resolves; then stops accepting, lets in-flight
    /// requests finish (their events are committed and acknowledged), commits what is
    /// left, and returns what the committer did.
    ///
    /// The stop is bounded. Requests still waiting on a commit the drain timeout
    /// (`commit.drain_timeout`) after `shutdown` are answered 503 and their events
    /// abandoned (the report counts them); connections still open [`HTTP_GRACE`] after
    /// that are no longer waited for (each ends with its request: the body timeout bounds
    /// a stalled one).
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<CommitterReport> {
        let router = self.router();
        let state = Arc::clone(&self.state);
        let phase = Arc::clone(&self.phase);
        let mut stopping = self.phase.subscribe();
        let served = axum::serve(
            listener,
            router.into_make_service_with_connect_info::<std::net::SocketAddr>(),
        )
        .with_graceful_shutdown(async move {
            shutdown.await;
            state.ready.store(false, Ordering::Release);
            phase.send_replace(Phase::Draining);
        });
        let limit = self.state.config.commit.drain_timeout + HTTP_GRACE;
        let served = tokio::select! {
            served = async move { served.await } => served.err().map(|e| e.to_string()),
            _ = async move {
                let _ = stopping.wait_for(|p| *p >= Phase::Draining).await;
                tokio::time::sleep(limit).await;
            } => {
                tracing::warn!(
                    "connections still open {} s after the stop began: no longer waited for",
                    limit.as_secs()
                );
                None
            }
        };
        self.stop(served).await
    }

    /// Stops the committer after the HTTP side has finished: commits what is admitted.
    pub async fn stop(self, serve_error: Option<String>) -> Result<CommitterReport> {
        let Gateway {
            state,
            committer,
            phase,
            ..
        } = self;
        state.ready.store(false, Ordering::Release);
        drop(state);
        // Requests of connections closed above may still hold the submission channel.
        phase.send_replace(Phase::Closed);
        let report = committer
            .await
            .map_err(|e| GatewayError::new(ErrorKind::Internal, format!("committer: {e}")))?;
        if let Some(e) = serve_error {
            return Err(GatewayError::new(
                ErrorKind::Unavailable,
                format!("serve: {e}"),
            ));
        }
        Ok(report)
    }
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(st): State<Arc<AppState>>) -> Response {
    match admission_refusal(&st) {
        _ if !st.ready.load(Ordering::Acquire) => {
            (StatusCode::SERVICE_UNAVAILABLE, "stopping\n").into_response()
        }
        Some(r) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{}: {}\n", r.reason, r.detail),
        )
            .into_response(),
        None => (StatusCode::OK, "ready\n").into_response(),
    }
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let oldest = st.pipeline.oldest_queued_us.load(Ordering::Acquire);
    let age = if oldest == 0 {
        0.0
    } else {
        (now_us() - oldest).max(0) as f64 / 1e6
    };
    st.metrics.queue_oldest_age_seconds.set(age);
    st.metrics
        .queue_bytes
        .set(st.pipeline.queue_bytes.load(Ordering::Acquire) as i64);
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        st.metrics.render(),
    )
        .into_response()
}

/// A whole request refused: status, reason, detail, and when to come back.
#[derive(Debug, Clone)]
struct Refusal {
    status: StatusCode,
    reason: &'static str,
    detail: String,
    retry_after: Option<Duration>,
}

impl Refusal {
    fn new(status: StatusCode, reason: &'static str, detail: impl Into<String>) -> Self {
        Self {
            status,
            reason,
            detail: detail.into(),
            retry_after: None,
        }
    }

    fn rejection(status: StatusCode, r: &Rejection) -> Self {
        Self::new(status, r.reason.as_str(), r.detail.clone())
    }

    fn retry(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

#[derive(Serialize)]
struct ErrorDetail<'a> {
    reason: &'a str,
    detail: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after_s: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_event_age_s: Option<u64>,
}

fn status_label(status: StatusCode) -> &'static str {
    match status.as_u16() {
        200 => "200",
        207 => "207",
        400 => "400",
        401 => "401",
        403 => "403",
        413 => "413",
        415 => "415",
        429 => "429",
        503 => "503",
        s if s < 500 => "4xx",
        _ => "5xx",
    }
}

fn refuse(st: &AppState, r: Refusal) -> Response {
    st.metrics
        .requests
        .get_or_create(&[("status", status_label(r.status))])
        .inc();
    let capacity = matches!(r.status.as_u16(), 429 | 503);
    if capacity {
        st.metrics
            .throttled
            .get_or_create(&[("cause", r.reason)])
            .inc();
    }
    let max_age = st.config.queue.max_event_age.as_secs();
    let retry_s = r
        .retry_after
        .map(|d| d.as_secs_f64().ceil().max(1.0) as u64);
    let body = ErrorBody {
        error: ErrorDetail {
            reason: r.reason,
            detail: &r.detail,
            retry_after_s: retry_s,
            max_event_age_s: capacity.then_some(max_age),
        },
    };
    let mut resp = (r.status, axum::Json(body)).into_response();
    let headers = resp.headers_mut();
    if let Some(s) = retry_s {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(s));
    }
    if capacity {
        headers.insert(MAX_EVENT_AGE_HEADER, HeaderValue::from(max_age));
    }
    if r.status == StatusCode::UNAUTHORIZED {
        headers.insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"signalweave\""),
        );
    }
    resp
}

/// A path or method the gateway does not serve, answered in its error shape.
async fn not_served(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    let known = matches!(
        uri.path(),
        "/v1/events" | "/healthz" | "/readyz" | "/metrics"
    );
    let (status, reason, detail) = if known {
        (
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            format!("{method} is not served on {}", uri.path()),
        )
    } else {
        (
            StatusCode::NOT_FOUND,
            "not_found",
            format!(
                "nothing is served at {}: events go to POST /v1/events",
                uri.path()
            ),
        )
    };
    let body = ErrorBody {
        error: ErrorDetail {
            reason,
            detail: &detail,
            retry_after_s: None,
            max_event_age_s: None,
        },
    };
    (status, axum::Json(body)).into_response()
}

/// The 503 causes that do not depend on the request: store failing, commit stalled,
/// queue too old.
fn admission_refusal(st: &AppState) -> Option<Refusal> {
    let p = &st.pipeline;
    if p.store_failing.load(Ordering::Acquire) {
        let why = p
            .last_failure
            .lock()
            .ok()
            .and_then(|l| l.clone())
            .unwrap_or_default();
        return Some(
            Refusal::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store_unavailable",
                format!("the landing table is not accepting commits: {why}"),
            )
            .retry(Duration::from_secs(2)),
        );
    }
    let now = now_us();
    let started = p.commit_started_us.load(Ordering::Acquire);
    let stall = st.config.commit.stall_after;
    if started != 0 && now - started > i64::try_from(stall.as_micros()).unwrap_or(i64::MAX) {
        return Some(
            Refusal::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "commit_pipeline_behind",
                format!("a commit has been in flight for more than {stall:?}"),
            )
            .retry(Duration::from_secs(1)),
        );
    }
    let oldest = p.oldest_queued_us.load(Ordering::Acquire);
    let max_age = st.config.queue.max_age;
    if oldest != 0 && now - oldest > i64::try_from(max_age.as_micros()).unwrap_or(i64::MAX) {
        return Some(
            Refusal::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "queue_too_old",
                format!("the oldest queued event has waited more than {max_age:?}"),
            )
            .retry(Duration::from_secs(1)),
        );
    }
    None
}

/// Records a refused request's evidence in `signalweave.rejections` (via the committer).
fn record_refusal(st: &AppState, grant: Option<&Grant>, body: &[u8], rejection: &Rejection) {
    st.metrics
        .rejections
        .get_or_create(&[("reason", rejection.reason.as_str())])
        .inc();
    match grant {
        None if st.unauthenticated_evidence.check().is_err() => {
            st.metrics.unauthenticated_unrecorded.inc();
            return;
        }
        Some(g) if st.refusal_evidence.check_key(&g.tenant_index).is_err() => {
            st.metrics
                .refusals_unrecorded
                .get_or_create(&vec![("tenant".to_string(), g.tenant.to_string())])
                .inc();
            return;
        }
        _ => {}
    }
    let source = grant.map_or_else(
        || "gateway".to_string(),
        |g| format!("gateway/{}", g.tenant),
    );
    let tenant = grant.map(|g| &*g.tenant);
    if let Ok(batch) =
        rejection_batch_of(now_us(), &source, tenant, &[(body, 0, rejection.clone())])
    {
        let (reply, _) = oneshot::channel();
        let sent = st.tx.send(Submission {
            tenant_index: grant.map_or(0, |g| g.tenant_index),
            ingest_time_us: now_us(),
            events: Vec::new(),
            bytes: 0,
            evidence: Some(batch),
            reply,
        });
        if sent.is_err() {
            // The committer has stopped (the gateway is stopping): counted, not kept.
            st.metrics.evidence_dropped.inc();
        }
    }
}

/// The refusal of a request the quotas of `who` did not admit: 429 when a bucket is short
/// for now; 413, with evidence, when one can never hold what the request asks for (a
/// retry would be refused forever).
fn quota_refusal(
    st: &AppState,
    grant: &Grant,
    body: &[u8],
    refusal: QuotaRefusal,
    who: &str,
) -> Refusal {
    match refusal {
        QuotaRefusal::Throttled(t) => Refusal::new(
            StatusCode::TOO_MANY_REQUESTS,
            "quota_exceeded",
            format!("{who}: the {} quota is spent", t.bucket),
        )
        .retry(t.retry_after),
        QuotaRefusal::TooLarge(t) => {
            let r = Rejection::new(
                ReasonCode::BatchTooLarge,
                format!(
                    "{who}: the request asks {} tokens of the {} quota, which holds at most {} \
                     (one second of its rate): send smaller requests",
                    t.asked, t.bucket, t.capacity
                ),
            );
            record_refusal(st, Some(grant), body, &r);
            Refusal::rejection(StatusCode::PAYLOAD_TOO_LARGE, &r)
        }
    }
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

fn header_str(headers: &HeaderMap, name: header::HeaderName) -> Option<&str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

#[derive(Serialize)]
struct AckBody {
    status: &'static str,
    snapshot_id: Option<i64>,
    ingest_time: String,
    accepted: usize,
    duplicate: usize,
    rejected: usize,
    results: Vec<EventResult>,
}

#[derive(Serialize)]
struct EventResult {
    index: usize,
    status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
}

async fn post_events(State(st): State<Arc<AppState>>, request: Request) -> Response {
    let arrived = Instant::now();
    let response = ingest(&st, request).await;
    let response = match response {
        Ok(r) => r,
        Err(refusal) => return refuse(&st, refusal),
    };
    st.metrics
        .ack_seconds
        .observe(arrived.elapsed().as_secs_f64());
    response
}

async fn ingest(st: &AppState, request: Request) -> Result<Response, Refusal> {
    let Ok(_permit) = Arc::clone(&st.permits).try_acquire_owned() else {
        return Err(Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "too_many_requests_in_flight",
            format!(
                "more than {} ingest requests are in flight",
                st.config.limits.max_concurrent_requests
            ),
        )
        .retry(Duration::from_secs(1)));
    };
    let (parts, body) = request.into_parts();
    let headers = &parts.headers;
    // Who sent a request without a valid key: its address, when the server knows it.
    let from = parts
        .extensions
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map_or_else(String::new, |c| format!(" (from {})", c.0));
    let Some(token) = bearer(headers) else {
        let r = Rejection::new(
            ReasonCode::MissingCredentials,
            format!("an `Authorization: Bearer <key>` header is required{from}"),
        );
        record_refusal(st, None, b"", &r);
        return Err(Refusal::rejection(StatusCode::UNAUTHORIZED, &r));
    };
    let Some(grant) = st.auth.authenticate(token).cloned() else {
        // The key itself is not kept: the start of its SHA-256 tells keys apart.
        let digest = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(token.as_bytes()));
        let r = Rejection::new(
            ReasonCode::InvalidCredentials,
            format!(
                "the API key is not known (SHA-256 {}…){from}",
                &digest[..12]
            ),
        );
        record_refusal(st, None, b"", &r);
        return Err(Refusal::rejection(StatusCode::UNAUTHORIZED, &r));
    };
    let format = match body_format(header_str(headers, header::CONTENT_TYPE)) {
        Ok(f) => f,
        Err(r) => {
            record_refusal(st, Some(&grant), b"", &r);
            return Err(Refusal::rejection(StatusCode::UNSUPPORTED_MEDIA_TYPE, &r));
        }
    };
    if let Some(refusal) = admission_refusal(st) {
        return Err(refusal);
    }
    let limits = &st.config.limits;
    // The body's bytes are taken from the gateway's room for bodies as they arrive and
    // decode, and given back when the request is answered (`room` dropped).
    let mut room = Room::new(&st.body_bytes, &st.metrics.body_bytes_in_flight);
    let declared = header_str(headers, header::CONTENT_LENGTH).and_then(|v| v.parse().ok());
    let raw = tokio::time::timeout(
        limits.body_timeout,
        read_body(body, declared, limits.max_body_bytes, &mut room),
    )
    .await
    .unwrap_or_else(|_| {
        Err(Rejection::new(
            ReasonCode::BodyTimeout,
            format!(
                "the request body did not arrive within {} s",
                limits.body_timeout.as_secs_f64()
            ),
        )
        .into())
    });
    let raw = match raw {
        Ok(raw) => raw,
        Err(Undecoded::NoRoom) => return Err(no_room(st)),
        Err(Undecoded::Rejected(r)) => {
            record_refusal(st, Some(&grant), b"", &r);
            let status = match r.reason {
                ReasonCode::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
                ReasonCode::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
                _ => StatusCode::BAD_REQUEST,
            };
            return Err(Refusal::rejection(status, &r));
        }
    };
    // What the body as received holds (its buffer's capacity).
    let raw_room = room.held();
    // The decoder's own memory (a zstd window), while the body decodes: counted up to what
    // the room holds beyond one whole request, so a request the configuration says fits
    // is never refused for ever.
    let beyond_one = limits
        .max_bytes_in_flight
        .saturating_sub(limits.max_body_bytes + limits.max_decoded_bytes);
    let encoding = header_str(headers, header::CONTENT_ENCODING);
    let decoder = decoder_memory(encoding, &raw).min(beyond_one);
    if !room.take(decoder) {
        return Err(no_room(st));
    }
    let decoded = match decode_within(encoding, raw.clone(), limits.max_decoded_bytes, &mut |n| {
        room.take(n)
    }) {
        Ok(d) => d,
        Err(Undecoded::NoRoom) => return Err(no_room(st)),
        Err(Undecoded::Rejected(r)) => {
            record_refusal(st, Some(&grant), &raw, &r);
            let status = match r.reason {
                ReasonCode::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
                ReasonCode::MalformedBody => StatusCode::BAD_REQUEST,
                _ => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            };
            return Err(Refusal::rejection(status, &r));
        }
    };
    // A body sent compressed is freed once decoded: its room goes back. (One sent as is
    // is the decoded body itself.)
    let sent_as_is = decoded.as_ptr() == raw.as_ptr();
    drop(raw);
    room.give_back(decoder);
    if !sent_as_is {
        room.give_back(raw_room);
    }
    let events = match split(format, &decoded, limits.max_batch_events) {
        Ok(e) => e,
        Err(r) => {
            record_refusal(st, Some(&grant), &decoded, &r);
            let status = if r.reason == ReasonCode::BatchTooLarge {
                StatusCode::PAYLOAD_TOO_LARGE
            } else {
                StatusCode::BAD_REQUEST
            };
            return Err(Refusal::rejection(status, &r));
        }
    };
    // Room for the events' validated copies, estimated at the decoded body's size (their
    // strings' bytes are fewer) and each event's own struct and allocations, taken before
    // any quota is paid and given back once they are handed to the committer, whose queue
    // counts them from then on: the room bounds what requests hold, copies included.
    let copies = copies_bytes(decoded.len(), events.len());
    if !room.take(copies) {
        return Err(no_room(st));
    }
    // Room in the queue first, for the whole decoded body (what is accepted of it is
    // less): a request the queue refuses spends none of the tenant's tokens. Given back
    // when the request ends, but for what is handed to the committer.
    let mut queued = reserve_queue(st, &grant, decoded.len())?;
    // The tenant's buckets pay for what the request carries, before any parsing work.
    let records = u32::try_from(events.len()).unwrap_or(u32::MAX);
    let bytes = u32::try_from(decoded.len()).unwrap_or(u32::MAX);
    let tenant_paid = match st.quotas.check(grant.tenant_index, records, bytes, &[]) {
        Ok(paid) => paid,
        Err(q) => {
            return Err(quota_refusal(
                st,
                &grant,
                &decoded,
                q,
                &format!("tenant `{}`", grant.tenant),
            ));
        }
    };

    let now = now_us();
    let ingest_time = now;
    let mut accepted = Vec::with_capacity(events.len());
    let mut positions = Vec::with_capacity(events.len());
    let mut rejected: Vec<(usize, Rejection)> = Vec::new();
    for (i, raw_event) in events.iter().enumerate() {
        match st.validator.validate_bytes(raw_event, now, ingest_time) {
            Ok(event) if event.tenant.as_str() != &*grant.tenant => rejected.push((
                i,
                Rejection::new(
                    ReasonCode::TenantMismatch,
                    format!(
                        "event tenant `{}` differs from the key's tenant `{}`",
                        event.tenant, grant.tenant
                    ),
                ),
            )),
            Ok(event) if !grant.allows_producer(event.producer_id.as_str()) => rejected.push((
                i,
                Rejection::new(
                    ReasonCode::ProducerNotAllowed,
                    format!("the key may not speak for producer `{}`", event.producer_id),
                ),
            )),
            Ok(event) => {
                accepted.push(event);
                positions.push(i);
            }
            Err(r) => rejected.push((i, r)),
        }
    }
    let mut per_producer: HashMap<&str, u32> = HashMap::new();
    for e in &accepted {
        *per_producer.entry(e.producer_id.as_str()).or_default() += 1;
    }
    let per_producer: Vec<(&str, u32)> = per_producer.into_iter().collect();
    // A producer's quota refuses the request, or takes from every producer of it. Refused,
    // the request gives the tenant's records back: one producer's retries must not spend
    // what its tenant's other producers are owed. (The bytes, which paid for the parsing,
    // stay spent.)
    if let Err(q) = st.quotas.check(grant.tenant_index, 0, 0, &per_producer) {
        st.quotas.give_back(tenant_paid);
        return Err(quota_refusal(
            st,
            &grant,
            &decoded,
            q,
            &format!("a producer of tenant `{}`", grant.tenant),
        ));
    }
    let accepted_bytes: usize = positions.iter().map(|&i| events[i].len()).sum();
    queued.shrink_to(if accepted.is_empty() {
        0
    } else {
        accepted_bytes
    });

    for (_, r) in &rejected {
        st.metrics
            .rejections
            .get_or_create(&[("reason", r.reason.as_str())])
            .inc();
    }
    st.metrics
        .events
        .get_or_create(&[("outcome", "rejected")])
        .inc_by(rejected.len() as u64);
    let evidence = if rejected.is_empty() {
        None
    } else {
        let rows: Vec<(&[u8], u64, Rejection)> = rejected
            .iter()
            .map(|(i, r)| (events[*i], *i as u64, r.clone()))
            .collect();
        rejection_batch_of(
            now,
            &format!("gateway/{}", grant.tenant),
            Some(&grant.tenant),
            &rows,
        )
        .ok()
    };
    st.metrics.accepted_bytes.inc_by(accepted_bytes as u64);
    let candidates = accepted.len();
    let (reply, ack) = oneshot::channel();
    let submitted = st.tx.send(Submission {
        tenant_index: grant.tenant_index,
        ingest_time_us: ingest_time,
        events: accepted,
        bytes: queued.hand_over(),
        evidence,
        reply,
    });
    // The copies are the committer's now (or dropped, below).
    room.give_back(copies);
    if let Err(mpsc::error::SendError(sub)) = submitted {
        // Never admitted: its bytes go back to the queue.
        drop(QueueHold {
            pipeline: &st.pipeline,
            tenant: sub.tenant_index,
            bytes: sub.bytes,
        });
        return Err(Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting_down",
            "the gateway is stopping",
        )
        .retry(Duration::from_secs(1)));
    }
    let ack = match ack.await {
        Ok(Ok(ack)) => ack,
        Ok(Err(Unavailable(why))) => {
            return Err(
                Refusal::new(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", why)
                    .retry(Duration::from_secs(2)),
            );
        }
        Err(_) => {
            return Err(Refusal::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting_down",
                "the gateway stopped before the commit",
            )
            .retry(Duration::from_secs(1)));
        }
    };

    let mut results: Vec<EventResult> = Vec::with_capacity(events.len());
    let mut duplicates = 0;
    let mut conflicts: Vec<(usize, Rejection)> = Vec::new();
    for (k, &i) in positions.iter().enumerate() {
        match ack.outcome.get(k).copied().unwrap_or(Outcome::Accepted) {
            Outcome::Accepted => results.push(EventResult {
                index: i,
                status: "accepted",
                reason: None,
                detail: None,
            }),
            Outcome::Duplicate => {
                duplicates += 1;
                results.push(EventResult {
                    index: i,
                    status: "duplicate",
                    reason: None,
                    detail: None,
                });
            }
            Outcome::Conflict => conflicts.push((
                i,
                Rejection::new(
                    ReasonCode::IdentityConflict,
                    format!(
                        "event_id `{}` was accepted within the dedup horizon with other \
                         content; a retry must resend the same event, and a new event needs \
                         a new event_id",
                        raw_event_id(events[i])
                    ),
                ),
            )),
        }
    }
    if !conflicts.is_empty() {
        record_conflicts(st, &grant, &events, &conflicts);
    }
    let candidates = candidates - conflicts.len();
    let all_conflicts = candidates == 0 && rejected.is_empty() && !conflicts.is_empty();
    rejected.extend(conflicts);
    let all_authz = rejected.iter().all(|(_, r)| {
        matches!(
            r.reason,
            ReasonCode::TenantMismatch | ReasonCode::ProducerNotAllowed
        )
    });
    let n_rejected = rejected.len();
    for (i, r) in rejected {
        results.push(EventResult {
            index: i,
            status: "rejected",
            reason: Some(r.reason.as_str()),
            detail: Some(r.detail),
        });
    }
    results.sort_by_key(|r| r.index);
    let (status, label) = if n_rejected == 0 {
        (StatusCode::OK, "accepted")
    } else if candidates > 0 {
        (StatusCode::MULTI_STATUS, "partial")
    } else if all_conflicts {
        (StatusCode::CONFLICT, "rejected")
    } else if all_authz {
        (StatusCode::FORBIDDEN, "rejected")
    } else {
        (StatusCode::BAD_REQUEST, "rejected")
    };
    st.metrics
        .requests
        .get_or_create(&[("status", status_label(status))])
        .inc();
    let body = AckBody {
        status: label,
        snapshot_id: ack.snapshot_id,
        ingest_time: format_rfc3339_micros(ingest_time),
        accepted: candidates - duplicates,
        duplicate: duplicates,
        rejected: n_rejected,
        results,
    };
    Ok((status, axum::Json(body)).into_response())
}

/// The `event_id` of a raw event that validated (so it is a JSON object with one).
fn raw_event_id(raw: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(raw)
        .ok()
        .and_then(|v| v.get("event_id")?.as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// Counts the request's identity conflicts and hands their evidence to the committer, as
/// a submission of evidence only (the conflicts are known once the committer has seen the
/// request's events, after the other rejections' evidence went with them).
fn record_conflicts(
    st: &AppState,
    grant: &Grant,
    events: &[&[u8]],
    conflicts: &[(usize, Rejection)],
) {
    st.metrics
        .rejections
        .get_or_create(&[("reason", ReasonCode::IdentityConflict.as_str())])
        .inc_by(conflicts.len() as u64);
    st.metrics
        .events
        .get_or_create(&[("outcome", "rejected")])
        .inc_by(conflicts.len() as u64);
    let rows: Vec<(&[u8], u64, Rejection)> = conflicts
        .iter()
        .map(|(i, r)| (events[*i], *i as u64, r.clone()))
        .collect();
    let Ok(evidence) = rejection_batch_of(
        now_us(),
        &format!("gateway/{}", grant.tenant),
        Some(&grant.tenant),
        &rows,
    ) else {
        return;
    };
    let (reply, _) = oneshot::channel();
    let sent = st.tx.send(Submission {
        tenant_index: grant.tenant_index,
        ingest_time_us: now_us(),
        events: Vec::new(),
        bytes: 0,
        evidence: Some(evidence),
        reply,
    });
    if sent.is_err() {
        st.metrics.evidence_dropped.inc_by(conflicts.len() as u64);
    }
}

/// Decoded bytes of a request reserved in the queue ([`reserve_queue`]): given back when
/// dropped, except what was handed to the committer with the request's events (it gives
/// those back once they are committed).
struct QueueHold<'a> {
    pipeline: &'a Pipeline,
    tenant: usize,
    bytes: usize,
}

impl QueueHold<'_> {
    /// Gives back all but `n` of the bytes held.
    fn shrink_to(&mut self, n: usize) {
        let excess = self.bytes.saturating_sub(n);
        self.give_back(excess);
    }

    /// The bytes held, now the committer's to give back.
    fn hand_over(mut self) -> usize {
        std::mem::take(&mut self.bytes)
    }

    fn give_back(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        self.pipeline.queue_bytes.fetch_sub(n, Ordering::AcqRel);
        if let Some(t) = self.pipeline.tenant_bytes.get(self.tenant) {
            t.fetch_sub(n, Ordering::AcqRel);
        }
        self.bytes -= n;
    }
}

impl Drop for QueueHold<'_> {
    fn drop(&mut self) {
        self.give_back(self.bytes);
    }
}

/// Reserves `bytes` of the queue for `grant`'s tenant, or refuses: 429 when the tenant's
/// share is spent (others are still served), 503 when the whole queue is.
fn reserve_queue<'a>(
    st: &'a AppState,
    grant: &Grant,
    bytes: usize,
) -> Result<QueueHold<'a>, Refusal> {
    let p = &st.pipeline;
    let q = &st.config.queue;
    let total = p.queue_bytes.fetch_add(bytes, Ordering::AcqRel) + bytes;
    if total > q.max_bytes {
        p.queue_bytes.fetch_sub(bytes, Ordering::AcqRel);
        return Err(Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "queue_full",
            format!("{} bytes are waiting for a commit", total - bytes),
        )
        .retry(Duration::from_secs(1)));
    }
    let hold = QueueHold {
        pipeline: p,
        tenant: grant.tenant_index,
        bytes,
    };
    let Some(tenant) = p.tenant_bytes.get(grant.tenant_index) else {
        return Ok(hold);
    };
    let mine = tenant.fetch_add(bytes, Ordering::AcqRel) + bytes;
    if mine > q.tenant_max_bytes() {
        // `hold`, dropped, gives both back.
        return Err(Refusal::new(
            StatusCode::TOO_MANY_REQUESTS,
            "tenant_queue_full",
            format!(
                "tenant `{}` holds {} of its {} queued bytes",
                grant.tenant,
                mine - bytes,
                q.tenant_max_bytes()
            ),
        )
        .retry(Duration::from_secs(1)));
    }
    Ok(hold)
}

/// The bytes of request bodies one request holds, taken from the gateway's room for them
/// ([`AppState::body_bytes`]) and given back when dropped.
struct Room {
    budget: Arc<Semaphore>,
    held: Option<tokio::sync::OwnedSemaphorePermit>,
    gauge: prometheus_client::metrics::gauge::Gauge,
}

impl Drop for Room {
    fn drop(&mut self) {
        if let Some(held) = &self.held {
            self.gauge.dec_by(held.num_permits() as i64);
        }
    }
}

impl Room {
    fn new(budget: &Arc<Semaphore>, gauge: &prometheus_client::metrics::gauge::Gauge) -> Self {
        Self {
            budget: Arc::clone(budget),
            held: None,
            gauge: gauge.clone(),
        }
    }

    /// Takes `n` more bytes, if the room has them now (a request never waits for room).
    fn take(&mut self, n: usize) -> bool {
        let Ok(n) = u32::try_from(n) else {
            return false;
        };
        if n == 0 {
            return true;
        }
        match Arc::clone(&self.budget).try_acquire_many_owned(n) {
            Ok(p) => {
                self.gauge.inc_by(i64::from(n));
                match &mut self.held {
                    Some(held) => held.merge(p),
                    None => self.held = Some(p),
                }
                true
            }
            Err(_) => false,
        }
    }

    /// Bytes held.
    fn held(&self) -> usize {
        self.held.as_ref().map_or(0, |h| h.num_permits())
    }

    /// Gives `n` of the bytes held back.
    fn give_back(&mut self, n: usize) {
        if let Some(held) = &mut self.held
            && let Some(given) = held.split(n.min(held.num_permits()))
        {
            self.gauge.dec_by(given.num_permits() as i64);
        }
    }
}

/// The room `events` events validated from `decoded` bytes take, at most: their strings
/// hold fewer bytes than the body they came from, and each event adds its struct and its
/// strings' allocations ([`signalweave_model::Event::MEMORY_OVERHEAD_BYTES`]).
pub(crate) fn copies_bytes(decoded: usize, events: usize) -> usize {
    decoded.saturating_add(events.saturating_mul(signalweave_model::Event::MEMORY_OVERHEAD_BYTES))
}

/// The refusal of a request whose body found no room: 503, retry in a second.
fn no_room(st: &AppState) -> Refusal {
    Refusal::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "bytes_in_flight",
        format!(
            "the gateway holds {} bytes of request bodies (with their decoding and \
             validated events), its most (limits.max_bytes_in_flight)",
            st.config.limits.max_bytes_in_flight
        ),
    )
    .retry(Duration::from_secs(1))
}

/// Reads `body` whole, up to `limit` bytes. Room is taken for a `declared` length
/// (`Content-Length`) at once, before anything is read, so a refusal comes before the
/// client sends its body; otherwise for each growth of the buffer as parts arrive.
async fn read_body(
    body: Body,
    declared: Option<usize>,
    limit: usize,
    room: &mut Room,
) -> Result<bytes::Bytes, Undecoded> {
    use http_body_util::BodyExt;
    let too_large = || {
        Rejection::new(
            ReasonCode::BodyTooLarge,
            format!("the request body exceeds {limit} bytes"),
        )
    };
    let mut out: Vec<u8> = Vec::new();
    if let Some(n) = declared {
        if n > limit {
            return Err(too_large().into());
        }
        if !room.take(n) {
            return Err(Undecoded::NoRoom);
        }
        out.reserve_exact(n);
    }
    let mut body = body;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            Rejection::new(
                ReasonCode::MalformedBody,
                format!("the request body could not be read: {e}"),
            )
        })?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if out.len() + data.len() > limit {
            return Err(too_large().into());
        }
        if out.len() + data.len() > out.capacity() {
            // A body longer than it declared is hyper's to refuse; one without a length
            // pays for each growth, doubled as a vector grows.
            let grown = (out.capacity() * 2).max(out.len() + data.len()).min(limit);
            if !room.take(grown - out.capacity()) {
                return Err(Undecoded::NoRoom);
            }
            out.reserve_exact(grown - out.len());
        }
        out.extend_from_slice(&data);
    }
    Ok(out.into())
}
