//! A notification provider for tests and the demo (`signalweave notify-sink`).
//!
//! - `POST /v1/notifications` with `Idempotency-Key`: delivers (records) the
//!   notification. Honouring keys (the default), a key already delivered is answered with
//!   its first delivery and not delivered again; with `honour_keys` off every request
//!   delivers.
//! - `GET /v1/notifications/{key}`: deliveries of a key (404: none); 501 with `lookup`
//!   off.
//! - `GET /v1/deliveries`: every delivery, and how many were duplicates.
//! - `POST /v1/control` `{"fail_next": n, "delay_ms": d, "drop_next": n}`: answer the
//!   next n requests 503 without delivering; delay every answer; deliver the next n and
//!   then hold the answer past any client timeout (accepted, response lost).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};

use crate::dispatch::{IDEMPOTENCY_HEADER, Lookup, Notification};

/// How long an answer is held when told to drop it (past any sane client timeout).
const HOLD: Duration = Duration::from_secs(10);

/// How the sink behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SinkConfig {
    /// Deliver a key once.
    pub honour_keys: bool,
    /// Answer lookups by key.
    pub lookup: bool,
}

impl Default for SinkConfig {
    fn default() -> Self {
        Self {
            honour_keys: true,
            lookup: true,
        }
    }
}

/// One delivery.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Delivery {
    /// The sink's reference.
    pub reference: String,
    /// Idempotency key.
    pub key: String,
    /// Recipient.
    pub recipient: String,
    /// Text.
    pub message: String,
    /// When, ms.
    pub at_ms: i64,
}

/// `GET /v1/deliveries`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct DeliveryReport {
    /// Every delivery, in order.
    pub deliveries: Vec<Delivery>,
    /// Deliveries of a key already delivered.
    pub duplicates: u64,
    /// Requests received.
    pub requests: u64,
    /// Requests answered with an earlier delivery (a key already delivered).
    pub replays: u64,
}

/// `POST /v1/control`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Control {
    /// Answer the next n requests 503 without delivering.
    #[serde(default)]
    pub fail_next: Option<u32>,
    /// Delay every answer by this many ms.
    #[serde(default)]
    pub delay_ms: Option<u64>,
    /// Deliver the next n, then hold their answers past any client timeout.
    #[serde(default)]
    pub drop_next: Option<u32>,
}

#[derive(Debug, Default)]
struct Inner {
    report: DeliveryReport,
    by_key: HashMap<String, (u64, String)>,
    fail_next: u32,
    delay_ms: u64,
    drop_next: u32,
}

#[derive(Debug, Clone)]
struct Sink {
    config: SinkConfig,
    inner: Arc<Mutex<Inner>>,
}

/// The sink's routes.
pub fn router(config: SinkConfig) -> Router {
    let sink = Sink {
        config,
        inner: Arc::new(Mutex::new(Inner::default())),
    };
    Router::new()
        .route("/v1/notifications", post(notify))
        .route("/v1/notifications/{key}", get(lookup))
        .route("/v1/deliveries", get(deliveries))
        .route("/v1/control", post(control))
        .with_state(sink)
}

fn lock(s: &Sink) -> std::sync::MutexGuard<'_, Inner> {
    s.inner.lock().unwrap_or_else(|p| p.into_inner())
}

async fn notify(State(s): State<Sink>, headers: HeaderMap, body: axum::body::Bytes) -> Response {
    let Some(key) = headers
        .get(IDEMPOTENCY_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
    else {
        return (StatusCode::BAD_REQUEST, "Idempotency-Key is required").into_response();
    };
    let Ok(n) = serde_json::from_slice::<Notification>(&body) else {
        return (StatusCode::BAD_REQUEST, "not a notification").into_response();
    };
    let (answer, delay, hold) = {
        let mut g = lock(&s);
        g.report.requests += 1;
        if g.fail_next > 0 {
            g.fail_next -= 1;
            return (StatusCode::SERVICE_UNAVAILABLE, "told to fail").into_response();
        }
        let existing = g.by_key.get(&key).cloned();
        let reference = match existing {
            Some((_, reference)) if s.config.honour_keys => {
                g.report.replays += 1;
                reference
            }
            _ => {
                let reference = format!("dlv-{}", g.report.deliveries.len() + 1);
                let entry = g
                    .by_key
                    .entry(key.clone())
                    .or_insert((0, reference.clone()));
                entry.0 += 1;
                if entry.0 > 1 {
                    g.report.duplicates += 1;
                }
                g.report.deliveries.push(Delivery {
                    reference: reference.clone(),
                    key: key.clone(),
                    recipient: n.recipient,
                    message: n.message,
                    at_ms: chrono::Utc::now().timestamp_millis(),
                });
                reference
            }
        };
        let hold = g.drop_next > 0;
        if hold {
            g.drop_next -= 1;
        }
        (reference, g.delay_ms, hold)
    };
    if hold {
        tokio::time::sleep(HOLD).await;
    } else if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    (StatusCode::OK, answer).into_response()
}

async fn lookup(State(s): State<Sink>, Path(key): Path<String>) -> Response {
    if !s.config.lookup {
        return (StatusCode::NOT_IMPLEMENTED, "no lookup").into_response();
    }
    let g = lock(&s);
    match g.by_key.get(&key) {
        Some((n, reference)) => Json(Lookup {
            key,
            deliveries: *n,
            reference: Some(reference.clone()),
        })
        .into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn deliveries(State(s): State<Sink>) -> Json<DeliveryReport> {
    Json(lock(&s).report.clone())
}

async fn control(State(s): State<Sink>, Json(c): Json<Control>) -> StatusCode {
    let mut g = lock(&s);
    if let Some(n) = c.fail_next {
        g.fail_next = n;
    }
    if let Some(d) = c.delay_ms {
        g.delay_ms = d;
    }
    if let Some(n) = c.drop_next {
        g.drop_next = n;
    }
    StatusCode::NO_CONTENT
}

/// Serves the sink on `listener` until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    config: SinkConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(config))
        .with_graceful_shutdown(shutdown)
        .await
}
