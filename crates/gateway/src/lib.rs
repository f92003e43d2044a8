//! # signalweave-gateway
//!
//! The front door of SignalWeave: an HTTP gateway (axum) that authenticates producers by
//! API key, validates events against the schema registry, applies per-tenant and
//! per-producer quotas, stamps `ingest_time`, and group-commits accepted events to the
//! landing table `signalweave.events`.
//!
//! **The acknowledgment boundary.** A request is answered 200/207 only after the commit
//! that holds its events succeeded; the answer names that snapshot. A retried event with
//! the same `(tenant, event_id)` within the dedup horizon is acknowledged as a
//! duplicate and not landed twice; the horizon survives a restart because the index is
//! rebuilt from the landing table's recent snapshots. Every rejected record gets a reason
//! code in the response and a row of evidence in `signalweave.rejections`.
//!
//! **Overload.** A spent quota answers 429; spent durable-ingest capacity (store failing,
//! commit stalled, queue full in bytes or too old) answers 503. Both carry `Retry-After`
//! and `SignalWeave-Max-Event-Age`. Control routes (`/healthz`, `/readyz`, `/metrics`)
//! are never queued behind ingest.
//!
//! The API is documented in `crates/gateway/openapi.yaml`.

mod auth;
mod body;
mod committer;
mod config;
mod dedup;
mod error;
mod metrics;
mod quota;
mod server;

pub use auth::{Authenticator, Grant, hash_token};
pub use body::{BodyFormat, Undecoded, body_format, decode, decode_within, split};
pub use committer::{CommitterReport, MAX_PENDING_EVIDENCE_ROWS, SUMMARY_INGEST_MIN};
pub use config::{
    CommitPolicy, DedupPolicy, GatewayConfig, KeyConfig, QueueLimits, RequestLimits, TenantConfig,
};
pub use dedup::{DedupIndex, Seen, identity};
pub use error::{GatewayError, Result};
pub use metrics::Metrics;
pub use quota::{QuotaRefusal, Quotas, Throttle, TooLarge};
pub use server::{DEFAULT_DRAIN_TIMEOUT, Gateway, MAX_EVENT_AGE_HEADER, rebuild_dedup};
