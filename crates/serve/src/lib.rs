//! # signalweave-serve
//!
//! The serving API: `GET /v1/jobs/{job}/aggregates?key=…&from=…&to=…` returns the current
//! version of each window, with its completeness, `output_version`, watermark and
//! `generated_at`.
//!
//! **Visible = committed.** The API reads the job's output table only: a version is
//! visible once the sink commit that holds it returned, never before. Each job's current
//! view is kept in memory and brought up to date before every answer by reading the
//! snapshots committed since the view's position (an incremental read of the output
//! table; compaction's replace snapshots add nothing and are skipped). The answer names
//! the snapshot it reflects (`as_of_snapshot`).
//!
//! Also: `GET /v1/status` (every job's [`JobStatus`]), `GET /metrics` (the runner's
//! Prometheus metrics), `GET /healthz`.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{DataType, Float64Type, Int64Type, TimestampMicrosecondType};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use signalweave_lake::{Lake, LakeTable};
use signalweave_model::{ErrorKind, format_rfc3339_micros};
use signalweave_runner::{JobStatus, RunnerMetrics, SharedStatus, output_table};
use signalweave_window::JobSpec;
use tokio::sync::Mutex;

/// Most windows one answer holds.
pub const MAX_WINDOWS: usize = 10_000;

/// One window's current version.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CurrentWindow {
    /// The namespace the version comes from: `live`, or a promoted backfill's.
    pub namespace: String,
    /// Key.
    pub key: String,
    /// Window start (RFC 3339).
    pub window_start: String,
    /// Window end (RFC 3339, exclusive).
    pub window_end: String,
    /// The current version, as its namespace counts it (from 1 in each namespace).
    pub output_version: i64,
    /// A version that only grows for this window, also when a promotion or a rollback
    /// changes the namespace serving it: the window's authority epoch (the last place in
    /// the order of the promotions and rollbacks whose range holds it; 0 when none) times
    /// 2^32, plus `output_version`. Compare this one to tell a newer answer.
    pub serving_version: i64,
    /// `provisional`, `on_time`, `corrected` (or `partial`, from a backfill).
    pub completeness: String,
    /// Watermark when emitted (RFC 3339).
    pub watermark: String,
    /// When the version was generated (RFC 3339).
    pub generated_at: String,
    /// Records counted.
    pub events: i64,
    /// Aggregates by name.
    pub values: serde_json::Map<String, serde_json::Value>,
}

#[derive(Debug, Clone)]
struct Stored {
    version: i64,
    retracted: bool,
    window: CurrentWindow,
}

/// A window's identity in a view: (key, window_start µs, window_end µs).
type WindowId = (String, i64, i64);

#[derive(Debug, Default)]
struct View {
    position: Option<i64>,
    /// Each window's current version.
    rows: BTreeMap<WindowId, Stored>,
}

#[derive(Debug)]
struct ServedJob {
    spec: Arc<JobSpec>,
    table: LakeTable,
    view: Mutex<View>,
    /// Views of promoted namespaces' tables, by table name.
    promoted: Mutex<HashMap<String, View>>,
}

/// How often [`Serving::serve`] brings the served views up to date between requests.
pub const VIEW_REFRESH_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// The serving state: the lake, the served jobs, and the runner's metrics and statuses.
#[derive(Debug, Clone)]
pub struct Serving {
    lake: Lake,
    jobs: Arc<HashMap<(String, String), ServedJob>>,
    metrics: Option<Arc<RunnerMetrics>>,
    statuses: Arc<Vec<SharedStatus>>,
}

/// A classified error answer.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(serde_json::json!({"error": self.code, "message": self.message})),
        )
            .into_response()
    }
}

impl ApiError {
    fn bad(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            code: "invalid_request",
            message: message.into(),
        }
    }
}

impl From<signalweave_lake::LakeError> for ApiError {
    fn from(e: signalweave_lake::LakeError) -> Self {
        let (status, code) = match e.kind() {
            // Not the request's: a table the job's outputs or a promotion name is gone.
            ErrorKind::NotFound => (StatusCode::INTERNAL_SERVER_ERROR, "missing_table"),
            ErrorKind::Unavailable | ErrorKind::Conflict => {
                (StatusCode::SERVICE_UNAVAILABLE, "unavailable")
            }
            // The request was checked before the lake was asked: what the lake refuses is
            // the server's fault (a misconfigured store, a promoted table gone), not the
            // client's.
            ErrorKind::InvalidInput | ErrorKind::Config => {
                (StatusCode::INTERNAL_SERVER_ERROR, "misconfigured")
            }
            ErrorKind::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        Self {
            status,
            code,
            message: e.to_string(),
        }
    }
}

/// Query of the aggregates route. A parameter it does not know is refused (a mistyped
/// `key` would otherwise answer every key's windows).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AggregatesQuery {
    /// Key (absent: every key).
    pub key: Option<String>,
    /// Windows starting at or after this time (RFC 3339).
    pub from: Option<String>,
    /// Windows starting before this time (RFC 3339).
    pub to: Option<String>,
    /// Output namespace (default `live`).
    pub namespace: Option<String>,
}

/// The aggregates answer.
#[derive(Debug, Serialize)]
pub struct AggregatesAnswer {
    /// Job.
    pub job: String,
    /// Namespace.
    pub namespace: String,
    /// The output table snapshot the answer reflects.
    pub as_of_snapshot: Option<i64>,
    /// True when more windows matched than [`MAX_WINDOWS`].
    pub truncated: bool,
    /// Promotions applied: the namespaces authoritative for windows starting in a range.
    pub promotions: Vec<AppliedPromotion>,
    /// The windows, by key then start.
    pub windows: Vec<CurrentWindow>,
}

/// A promotion an answer applied.
#[derive(Debug, Serialize)]
pub struct AppliedPromotion {
    /// The promoted namespace.
    pub namespace: String,
    /// Its job version.
    pub job_version: u32,
    /// Windows starting at or after (RFC 3339) ...
    pub from: String,
    /// ... and before.
    pub to: String,
}

fn parse_time(name: &str, v: Option<&str>, default: i64) -> Result<i64, ApiError> {
    match v {
        None => Ok(default),
        Some(s) => chrono::DateTime::parse_from_rfc3339(s)
            .map(|t| t.timestamp_micros())
            .map_err(|e| ApiError::bad(format!("`{name}` is not an RFC 3339 time: {e}"))),
    }
}

impl Serving {
    /// Serves `jobs` (spec and namespace each) from `lake`; `metrics` and `statuses` are
    /// the runner's, when jobs run in this process.
    pub fn new(
        lake: Lake,
        jobs: Vec<(Arc<JobSpec>, String)>,
        metrics: Option<Arc<RunnerMetrics>>,
        statuses: Vec<SharedStatus>,
    ) -> Result<Self, signalweave_runner::RunnerError> {
        let mut served = HashMap::new();
        for (spec, namespace) in jobs {
            let table = output_table(&spec, &namespace)?;
            served.insert(
                (spec.name.clone(), namespace),
                ServedJob {
                    spec,
                    table,
                    view: Mutex::new(View::default()),
                    promoted: Mutex::new(HashMap::new()),
                },
            );
        }
        Ok(Self {
            lake,
            jobs: Arc::new(served),
            metrics,
            statuses: Arc::new(statuses),
        })
    }

    /// The routes.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/v1/jobs/{job}/aggregates", get(aggregates))
            .route("/v1/status", get(status))
            .route("/metrics", get(metrics))
            .route("/healthz", get(|| async { "ok" }))
            .fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .with_state(self.clone())
    }

    /// Serves on `listener` until `shutdown` resolves. Meanwhile every served view is
    /// brought up to date every [`VIEW_REFRESH_INTERVAL`], so its position never falls
    /// behind the output table's snapshot retention (which would make the next request
    /// rebuild the view from the whole table) and requests find it nearly current.
    pub async fn serve(
        &self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let keeper = tokio::spawn({
            let serving = self.clone();
            async move { serving.keep_fresh(VIEW_REFRESH_INTERVAL).await }
        });
        let served = axum::serve(listener, self.router())
            .with_graceful_shutdown(shutdown)
            .await;
        keeper.abort();
        served
    }

    async fn keep_fresh(&self, every: std::time::Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            for ((job, namespace), served) in self.jobs.iter() {
                let mut view = served.view.lock().await;
                if let Err(e) = self.refresh(served.table, &served.spec, &mut view).await {
                    tracing::warn!(%job, %namespace, error = %e.message, "refresh of a served view failed");
                }
            }
        }
    }

    /// Binds `addr` (port 0 picks one) and returns the listener with its address.
    pub async fn bind(addr: SocketAddr) -> std::io::Result<(tokio::net::TcpListener, SocketAddr)> {
        let l = tokio::net::TcpListener::bind(addr).await?;
        let a = l.local_addr()?;
        Ok((l, a))
    }

    /// The current versions of `job` in `namespace` matching the query, brought up to date
    /// with the output table first.
    pub async fn current(
        &self,
        job: &str,
        q: &AggregatesQuery,
    ) -> Result<AggregatesAnswer, ApiError> {
        let namespace = q.namespace.clone().unwrap_or_else(|| "live".into());
        let served = self
            .jobs
            .get(&(job.to_string(), namespace.clone()))
            .ok_or_else(|| ApiError {
                status: StatusCode::NOT_FOUND,
                code: "unknown_job",
                message: format!("no job `{job}` in namespace `{namespace}` is served here"),
            })?;
        let from = parse_time("from", q.from.as_deref(), i64::MIN)?;
        let to = parse_time("to", q.to.as_deref(), i64::MAX)?;
        if from > to {
            return Err(ApiError::bad("`from` is after `to`"));
        }
        // The live namespace honours promotions: a window a promotion covers is served
        // from the promoted namespace (the latest covering promotion wins).
        let history = if namespace == "live" {
            self.lake.promotions(Some(job)).await?
        } else {
            Vec::new()
        };
        let promotions: Vec<signalweave_lake::Promotion> =
            history.iter().filter(|p| p.active()).cloned().collect();
        let mut view = served.view.lock().await;
        self.refresh(served.table, &served.spec, &mut view).await?;
        let mut promoted = served.promoted.lock().await;
        for p in &promotions {
            let table =
                LakeTable::output(&p.table, &signalweave_window::output_schema(&served.spec))?;
            let v = promoted.entry(p.table.clone()).or_default();
            self.refresh(table, &served.spec, v).await?;
        }
        let wanted = |key: &str, start: i64, stored: &Stored, source: &str| {
            !stored.retracted
                && q.key.as_deref().is_none_or(|k| k == key)
                && start >= from
                && start < to
                && signalweave_lake::authoritative(&promotions, start) == source
        };
        let mut windows = select(&view.rows, q.key.as_deref(), (from, to), |k, t, s| {
            wanted(k, t, s, "live")
        });
        // A namespace's windows are read once, whatever promotions name its table (a
        // database from before the unique index may hold two active ones).
        let mut read = std::collections::HashSet::new();
        for p in &promotions {
            if read.insert(p.table.as_str())
                && let Some(v) = promoted.get(&p.table)
            {
                windows.extend(select(&v.rows, q.key.as_deref(), (from, to), |k, t, s| {
                    wanted(k, t, s, &p.namespace)
                }));
            }
        }
        if !promotions.is_empty() {
            windows.sort_by(|a, b| a.0.cmp(b.0));
        }
        let truncated = windows.len() > MAX_WINDOWS;
        let windows = windows
            .into_iter()
            .take(MAX_WINDOWS)
            .map(|((_, start, _), s)| {
                let mut w = s.window.clone();
                w.serving_version = signalweave_lake::serving_version(
                    signalweave_lake::authority_epoch(&history, *start),
                    w.output_version,
                );
                w
            })
            .collect();
        Ok(AggregatesAnswer {
            job: job.to_string(),
            namespace,
            as_of_snapshot: view.position,
            truncated,
            promotions: promotions
                .iter()
                .map(|p| AppliedPromotion {
                    namespace: p.namespace.clone(),
                    job_version: p.job_version,
                    from: format_rfc3339_micros(p.from_us),
                    to: format_rfc3339_micros(p.to_us),
                })
                .collect(),
            windows,
        })
    }

    async fn refresh(
        &self,
        table: LakeTable,
        spec: &JobSpec,
        view: &mut View,
    ) -> Result<(), ApiError> {
        let plan = match self.lake.plan_appended_since(table, view.position).await {
            // Rows were removed since (an erasure): the view lets them go by being
            // rebuilt from the current snapshot.
            Ok(p) if p.removed_rows => {
                *view = View::default();
                self.lake.plan_appended_since(table, None).await?
            }
            Ok(p) => p,
            Err(e) if e.kind() == ErrorKind::NotFound && view.position.is_some() => {
                // The view's position expired: rebuild from the current snapshot.
                *view = View::default();
                self.lake.plan_appended_since(table, None).await?
            }
            Err(e) => return Err(e.into()),
        };
        if plan.upto == view.position {
            return Ok(());
        }
        let batches = self.lake.read_all(table, plan.tasks).await?;
        for batch in &batches {
            apply(spec, batch, &mut view.rows).map_err(|message| ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                code: "internal",
                message,
            })?;
        }
        view.position = plan.upto;
        Ok(())
    }
}

/// The rows of a view that `keep` keeps, of `key` (all keys: None) with starts in
/// `[from, to)`, in (key, start) order: a key reads only its own range, and no more than an
/// answer can hold (and one more, to tell it was cut) is taken from any source. (Without a
/// key, every key's rows are looked at.)
fn select<'a>(
    rows: &'a BTreeMap<WindowId, Stored>,
    key: Option<&str>,
    (from, to): (i64, i64),
    keep: impl Fn(&str, i64, &Stored) -> bool,
) -> Vec<(&'a WindowId, &'a Stored)> {
    let matching: Box<dyn Iterator<Item = (&'a WindowId, &'a Stored)>> = match key {
        Some(k) => {
            Box::new(rows.range((k.to_string(), from, i64::MIN)..(k.to_string(), to, i64::MIN)))
        }
        None => Box::new(rows.iter()),
    };
    matching
        .filter(|((key, start, _), stored)| keep(key, *start, stored))
        .take(MAX_WINDOWS + 1)
        .collect()
}

fn apply(
    spec: &JobSpec,
    batch: &RecordBatch,
    rows: &mut BTreeMap<(String, i64, i64), Stored>,
) -> Result<(), String> {
    let col = |name: &str| {
        batch
            .column_by_name(name)
            .ok_or_else(|| format!("output table lacks {name}"))
    };
    let text = |name: &str| -> Result<arrow::array::StringArray, String> {
        arrow::compute::cast(col(name)?, &DataType::Utf8)
            .map(|a| a.as_string::<i32>().clone())
            .map_err(|e| format!("{name}: {e}"))
    };
    let ts =
        |name: &str| -> Result<arrow::array::PrimitiveArray<TimestampMicrosecondType>, String> {
            col(name)?
                .as_primitive_opt::<TimestampMicrosecondType>()
                .cloned()
                .ok_or_else(|| format!("{name} is not a timestamp"))
        };
    let int = |name: &str| -> Result<arrow::array::PrimitiveArray<Int64Type>, String> {
        col(name)?
            .as_primitive_opt::<Int64Type>()
            .cloned()
            .ok_or_else(|| format!("{name} is not an integer"))
    };
    let (key, completeness, namespace) = (text("key")?, text("completeness")?, text("namespace")?);
    let (start, end, wm, at) = (
        ts("window_start")?,
        ts("window_end")?,
        ts("watermark")?,
        ts("emitted_at")?,
    );
    let (version, events) = (int("output_version")?, int("events")?);
    let retracted = col("retracted")?
        .as_boolean_opt()
        .cloned()
        .ok_or("retracted is not a boolean")?;
    let aggs: Vec<(&str, &Arc<dyn Array>)> = spec
        .aggregates
        .iter()
        .map(|a| col(&a.name).map(|c| (a.name.as_str(), c)))
        .collect::<Result<_, _>>()?;
    for i in 0..batch.num_rows() {
        let id = (key.value(i).to_string(), start.value(i), end.value(i));
        let v = version.value(i);
        if rows.get(&id).is_some_and(|s| s.version >= v) {
            continue;
        }
        let mut values = serde_json::Map::new();
        for (name, c) in &aggs {
            let value = if c.is_null(i) {
                serde_json::Value::Null
            } else if let Some(a) = c.as_primitive_opt::<Int64Type>() {
                a.value(i).into()
            } else if let Some(a) = c.as_primitive_opt::<Float64Type>() {
                a.value(i).into()
            } else {
                serde_json::Value::Null
            };
            values.insert(name.to_string(), value);
        }
        let window = CurrentWindow {
            namespace: namespace.value(i).to_string(),
            key: id.0.clone(),
            window_start: format_rfc3339_micros(id.1),
            window_end: format_rfc3339_micros(id.2),
            output_version: v,
            serving_version: v,
            completeness: completeness.value(i).to_string(),
            watermark: format_rfc3339_micros(wm.value(i)),
            generated_at: format_rfc3339_micros(at.value(i)),
            events: events.value(i),
            values,
        };
        rows.insert(
            id,
            Stored {
                version: v,
                retracted: retracted.value(i),
                window,
            },
        );
    }
    Ok(())
}

async fn aggregates(
    State(s): State<Serving>,
    Path(job): Path<String>,
    query: Result<Query<AggregatesQuery>, QueryRejection>,
) -> Result<Json<AggregatesAnswer>, ApiError> {
    let Query(q) = query.map_err(|r| ApiError::bad(r.body_text()))?;
    s.current(&job, &q).await.map(Json)
}

/// A path the API does not serve: 404 in the API's error shape.
async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        code: "not_found",
        message: format!(
            "no such path: {}; the API serves /v1/jobs/{{job}}/aggregates, /v1/status, \
             /metrics and /healthz",
            uri.path()
        ),
    }
}

/// A method the path does not serve: 405 in the API's error shape.
async fn method_not_allowed(method: axum::http::Method) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        code: "method_not_allowed",
        message: format!("{method} is not served here: the API only answers GET"),
    }
}

async fn status(State(s): State<Serving>) -> Json<Vec<JobStatus>> {
    Json(
        s.statuses
            .iter()
            .filter_map(|st| st.lock().ok().map(|g| g.clone()))
            .collect(),
    )
}

async fn metrics(State(s): State<Serving>) -> Response {
    let body = s.metrics.as_ref().map(|m| m.render()).unwrap_or_default();
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
        .into_response()
}
