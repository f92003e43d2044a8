//! The gateway's Prometheus metrics (served at `/metrics` in the text exposition format).

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// One label, with static names and values.
pub type Label = [(&'static str, &'static str); 1];

/// Every metric the gateway exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Requests answered, by HTTP status class and code.
    pub requests: Family<Label, Counter>,
    /// Events by outcome: accepted, duplicate, rejected.
    pub events: Family<Label, Counter>,
    /// Rejected events and requests, by reason code.
    pub rejections: Family<Label, Counter>,
    /// Requests refused for capacity, by cause (429 quota buckets, 503 causes).
    pub throttled: Family<Label, Counter>,
    /// Decoded bytes accepted.
    pub accepted_bytes: Counter,
    /// Commits to the landing table.
    pub commits: Counter,
    /// Failed commit attempts (each is retried with the same commit identity).
    pub commit_failures: Counter,
    /// Seconds per successful commit (including retries).
    pub commit_seconds: Histogram,
    /// Events per commit.
    pub commit_events: Histogram,
    /// Seconds from a request's arrival to its acknowledgment.
    pub ack_seconds: Histogram,
    /// Decoded bytes waiting for a commit.
    pub queue_bytes: Gauge,
    /// Bytes of request bodies held, as received and decoded, with their decoders'
    /// windows and their events' validated copies (room taken of
    /// `limits.max_bytes_in_flight`).
    pub body_bytes_in_flight: Gauge,
    /// Age of the oldest event waiting for a commit, seconds.
    pub queue_oldest_age_seconds: Gauge<f64, AtomicU64>,
    /// Identities held by the duplicate index.
    pub dedup_entries: Gauge,
    /// Rejection evidence rows dropped: the evidence queue was full, or the gateway stopped
    /// before they were committed.
    pub evidence_dropped: Counter,
    /// Refusals of requests without a valid key left unrecorded: beyond their evidence
    /// budget (so such requests cannot flood `signalweave.rejections`).
    pub unauthenticated_unrecorded: Counter,
    /// Refusals of a tenant's whole requests left unrecorded, by tenant: beyond the
    /// tenant's evidence budget (a refused request spends no quota).
    pub refusals_unrecorded: Family<Vec<(String, String)>, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric under the `signalweave_gateway` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("signalweave_gateway");
        let requests = Family::<Label, Counter>::default();
        let events = Family::<Label, Counter>::default();
        let rejections = Family::<Label, Counter>::default();
        let throttled = Family::<Label, Counter>::default();
        let accepted_bytes = Counter::default();
        let commits = Counter::default();
        let commit_failures = Counter::default();
        let commit_seconds = Histogram::new(exponential_buckets(0.002, 2.0, 14));
        let commit_events = Histogram::new(exponential_buckets(1.0, 4.0, 12));
        let ack_seconds = Histogram::new(exponential_buckets(0.005, 2.0, 14));
        let queue_bytes = Gauge::default();
        let body_bytes_in_flight = Gauge::default();
        let queue_oldest_age_seconds = Gauge::<f64, AtomicU64>::default();
        let dedup_entries = Gauge::default();
        let evidence_dropped = Counter::default();
        let unauthenticated_unrecorded = Counter::default();
        let refusals_unrecorded = Family::<Vec<(String, String)>, Counter>::default();
        registry.register("requests", "Requests answered, by status", requests.clone());
        registry.register("events", "Events by outcome", events.clone());
        registry.register(
            "rejections",
            "Rejections by reason code",
            rejections.clone(),
        );
        registry.register(
            "throttled",
            "Requests refused for capacity, by cause",
            throttled.clone(),
        );
        registry.register(
            "accepted_bytes",
            "Decoded bytes accepted",
            accepted_bytes.clone(),
        );
        registry.register("commits", "Commits to the landing table", commits.clone());
        registry.register(
            "commit_failures",
            "Failed commit attempts (retried under the same identity)",
            commit_failures.clone(),
        );
        registry.register(
            "commit_seconds",
            "Seconds per commit",
            commit_seconds.clone(),
        );
        registry.register("commit_events", "Events per commit", commit_events.clone());
        registry.register(
            "ack_seconds",
            "Seconds from request arrival to acknowledgment",
            ack_seconds.clone(),
        );
        registry.register(
            "queue_bytes",
            "Decoded bytes waiting for a commit",
            queue_bytes.clone(),
        );
        registry.register(
            "body_bytes_in_flight",
            "Bytes of request bodies held, as received and decoded, with decoder windows and validated copies (of limits.max_bytes_in_flight)",
            body_bytes_in_flight.clone(),
        );
        registry.register(
            "queue_oldest_age_seconds",
            "Age of the oldest event waiting for a commit",
            queue_oldest_age_seconds.clone(),
        );
        registry.register(
            "dedup_entries",
            "Identities in the duplicate index",
            dedup_entries.clone(),
        );
        registry.register(
            "evidence_dropped",
            "Rejection evidence rows dropped (evidence queue full, or not committed by the stop)",
            evidence_dropped.clone(),
        );
        registry.register(
            "unauthenticated_unrecorded",
            "Refusals of requests without a valid key beyond their evidence budget, not recorded",
            unauthenticated_unrecorded.clone(),
        );
        registry.register(
            "refusals_unrecorded",
            "Refusals of a tenant's whole requests beyond its evidence budget, not recorded",
            refusals_unrecorded.clone(),
        );
        Self {
            registry,
            requests,
            events,
            rejections,
            throttled,
            accepted_bytes,
            commits,
            commit_failures,
            commit_seconds,
            commit_events,
            ack_seconds,
            queue_bytes,
            body_bytes_in_flight,
            queue_oldest_age_seconds,
            dedup_entries,
            evidence_dropped,
            unauthenticated_unrecorded,
            refusals_unrecorded,
        }
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
