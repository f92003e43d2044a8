//! Typed gateway configuration. The binary reads it (from TOML) and passes it down; every
//! field has a named default, so an empty `[commit]` or `[limits]` table is valid.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{GatewayError, Result};

/// The whole gateway configuration.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// Address to listen on.
    #[serde(default = "GatewayConfig::default_listen")]
    pub listen: SocketAddr,
    /// Stable name of this gateway instance; commits carry `gateway-<instance>-<run>`.
    #[serde(default = "GatewayConfig::default_instance")]
    pub instance: String,
    /// When accepted events are committed.
    #[serde(default)]
    pub commit: CommitPolicy,
    /// Request and event limits.
    #[serde(default)]
    pub limits: RequestLimits,
    /// The in-memory queue between acceptance and commit.
    #[serde(default)]
    pub queue: QueueLimits,
    /// Duplicate detection.
    #[serde(default)]
    pub dedup: DedupPolicy,
    /// Tenants, their keys and quotas.
    #[serde(default)]
    pub tenants: Vec<TenantConfig>,
}

impl GatewayConfig {
    /// Default listen address.
    pub const DEFAULT_LISTEN: &'static str = "127.0.0.1:8088";

    fn default_listen() -> SocketAddr {
        Self::DEFAULT_LISTEN
            .parse()
            .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 8088)))
    }

    fn default_instance() -> String {
        "gw".to_string()
    }

    /// Checks the rules serde cannot express; errors name the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, why: &str| Err(GatewayError::config(format!("`{field}` {why}")));
        if self.tenants.is_empty() {
            return bad("tenants", "must declare at least one tenant");
        }
        if self.commit.interval.is_zero() {
            return bad("commit.interval", "must be positive");
        }
        if self.commit.drain_timeout.is_zero() {
            return bad("commit.drain_timeout", "must be positive");
        }
        if self.commit.max_bytes == 0 {
            return bad("commit.max_bytes", "must be positive");
        }
        if self.queue.max_bytes < self.limits.max_decoded_bytes {
            return bad(
                "queue.max_bytes",
                "must be at least limits.max_decoded_bytes (one whole request)",
            );
        }
        // A request reserves its whole decoded body in its tenant's share of the queue.
        if self.queue.tenant_max_bytes() < self.limits.max_decoded_bytes {
            return bad(
                "queue.tenant_share_percent",
                "must leave a tenant at least limits.max_decoded_bytes of queue.max_bytes \
                 (one whole request)",
            );
        }
        // Room is taken for a body at once, in one grant of at most u32::MAX bytes.
        for (field, n) in [
            ("limits.max_body_bytes", self.limits.max_body_bytes),
            ("limits.max_decoded_bytes", self.limits.max_decoded_bytes),
        ] {
            if u32::try_from(n).is_err() {
                return bad(field, "must be at most 4 GiB");
            }
        }
        // One request holds its body as received and decoded, then the decoded body and
        // the events' validated copies (at most as large, and each event's struct and
        // allocations).
        let decoded = self.limits.max_decoded_bytes;
        let one_request =
            self.limits
                .max_body_bytes
                .saturating_add(decoded)
                .max(decoded.saturating_add(crate::server::copies_bytes(
                    decoded,
                    self.limits.max_batch_events,
                )));
        if self.limits.max_bytes_in_flight < one_request {
            return bad(
                "limits.max_bytes_in_flight",
                &format!(
                    "must be at least {one_request} bytes: limits.max_body_bytes + \
                     limits.max_decoded_bytes, and twice limits.max_decoded_bytes plus {} \
                     bytes per event of limits.max_batch_events (one whole request: as \
                     received and decoded, then decoded and validated)",
                    signalweave_model::Event::MEMORY_OVERHEAD_BYTES
                ),
            );
        }
        if self.limits.max_bytes_in_flight > tokio::sync::Semaphore::MAX_PERMITS {
            return bad("limits.max_bytes_in_flight", "is too large");
        }
        if self.limits.body_timeout.is_zero() {
            return bad("limits.body_timeout", "must be positive");
        }
        if self.limits.max_batch_events == 0 {
            return bad("limits.max_batch_events", "must be positive");
        }
        let mut seen_keys = std::collections::HashSet::new();
        let mut seen_tenants = std::collections::HashSet::new();
        for (i, t) in self.tenants.iter().enumerate() {
            if t.id.is_empty() {
                return bad(&format!("tenants[{i}].id"), "is empty");
            }
            if !seen_tenants.insert(t.id.as_str()) {
                return bad(&format!("tenants[{i}].id"), "repeats another tenant");
            }
            for (name, value) in [
                ("records_per_sec", t.records_per_sec),
                ("bytes_per_sec", t.bytes_per_sec),
                ("producer_records_per_sec", t.producer_records_per_sec),
            ] {
                if value == 0 {
                    return bad(&format!("tenants[{i}].{name}"), "must be positive");
                }
            }
            for (k, key) in t.keys.iter().enumerate() {
                let field = format!("tenants[{i}].keys[{k}].sha256");
                if key.sha256.len() != 64 || !key.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return bad(&field, "must be 64 hex digits (the SHA-256 of the token)");
                }
                if !seen_keys.insert(key.sha256.to_ascii_lowercase()) {
                    return bad(&field, "is bound to more than one tenant or entry");
                }
                if key.producers.is_empty() {
                    return bad(
                        &format!("tenants[{i}].keys[{k}].producers"),
                        "must list producers (or \"*\")",
                    );
                }
            }
        }
        Ok(())
    }
}

/// When the committer closes a group of accepted events and commits it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommitPolicy {
    /// Longest time a group stays open after its first event.
    #[serde(default = "CommitPolicy::default_interval", with = "humantime_serde")]
    pub interval: Duration,
    /// A group is committed as soon as it holds this many decoded bytes.
    #[serde(default = "CommitPolicy::default_max_bytes")]
    pub max_bytes: usize,
    /// A commit in flight for longer than this marks the pipeline as behind (503).
    #[serde(
        default = "CommitPolicy::default_stall_after",
        with = "humantime_serde"
    )]
    pub stall_after: Duration,
    /// Run a lake maintenance pass (merge manifests, expire snapshots, delete what they
    /// alone referenced) after this many commits; 0 disables it.
    #[serde(default = "CommitPolicy::default_maintain_every")]
    pub maintain_every: u64,
    /// How long a stopping gateway keeps trying to commit what it admitted. Requests still
    /// waiting then are answered 503 and their events abandoned (the gateway exits 3).
    #[serde(
        default = "CommitPolicy::default_drain_timeout",
        with = "humantime_serde"
    )]
    pub drain_timeout: Duration,
}

impl CommitPolicy {
    /// Default maintenance cadence: every 60 commits (a minute at one commit per second).
    pub const DEFAULT_MAINTAIN_EVERY: u64 = 60;
    /// Default group interval: 1 s.
    pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);
    /// Default group size: 16 MiB.
    pub const DEFAULT_MAX_BYTES: usize = 16 * 1024 * 1024;
    /// Default stall threshold: 3 s.
    pub const DEFAULT_STALL_AFTER: Duration = Duration::from_secs(3);

    fn default_interval() -> Duration {
        Self::DEFAULT_INTERVAL
    }
    fn default_max_bytes() -> usize {
        Self::DEFAULT_MAX_BYTES
    }
    fn default_stall_after() -> Duration {
        Self::DEFAULT_STALL_AFTER
    }
    fn default_maintain_every() -> u64 {
        Self::DEFAULT_MAINTAIN_EVERY
    }
    fn default_drain_timeout() -> Duration {
        crate::server::DEFAULT_DRAIN_TIMEOUT
    }
}

impl Default for CommitPolicy {
    fn default() -> Self {
        Self {
            interval: Self::DEFAULT_INTERVAL,
            max_bytes: Self::DEFAULT_MAX_BYTES,
            stall_after: Self::DEFAULT_STALL_AFTER,
            maintain_every: Self::DEFAULT_MAINTAIN_EVERY,
            drain_timeout: crate::server::DEFAULT_DRAIN_TIMEOUT,
        }
    }
}

/// Limits on one request and one event.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestLimits {
    /// Largest request body as sent (possibly compressed).
    #[serde(default = "RequestLimits::default_max_body_bytes")]
    pub max_body_bytes: usize,
    /// Largest request body after decompression.
    #[serde(default = "RequestLimits::default_max_decoded_bytes")]
    pub max_decoded_bytes: usize,
    /// Most events in one request.
    #[serde(default = "RequestLimits::default_max_batch_events")]
    pub max_batch_events: usize,
    /// Largest single event, serialized.
    #[serde(default = "RequestLimits::default_max_event_bytes")]
    pub max_event_bytes: usize,
    /// How far `event_time` may be ahead of the gateway clock.
    #[serde(
        default = "RequestLimits::default_max_future_skew",
        with = "humantime_serde"
    )]
    pub max_future_skew: Duration,
    /// Ingest requests handled at once; more get 503 at once, so that control traffic
    /// (/healthz, /readyz, /metrics) always has capacity.
    #[serde(default = "RequestLimits::default_max_concurrent_requests")]
    pub max_concurrent_requests: usize,
    /// Bytes of request bodies held at once, as received and decoded, over all requests
    /// until each is answered, of a zstd decoder's window while a body decodes, and of
    /// their events' validated copies until they are handed to the committer (estimated
    /// at the decoded body's size). A request that would
    /// take more, as its body arrives or decodes or before it is validated, gets 503
    /// `bytes_in_flight`: without it, `max_concurrent_requests` bodies of
    /// `max_decoded_bytes` each could be held at once (16 GiB by default).
    #[serde(default = "RequestLimits::default_max_bytes_in_flight")]
    pub max_bytes_in_flight: usize,
    /// How long a request's body may take to arrive once its headers have: a client that
    /// stalls or trickles gets 408, so it can neither hold a request slot nor a shutdown.
    #[serde(
        default = "RequestLimits::default_body_timeout",
        with = "humantime_serde"
    )]
    pub body_timeout: Duration,
}

impl RequestLimits {
    /// Default body limit: 8 MiB.
    pub const DEFAULT_MAX_BODY_BYTES: usize = 8 * 1024 * 1024;
    /// Default decoded body limit: 32 MiB.
    pub const DEFAULT_MAX_DECODED_BYTES: usize = 32 * 1024 * 1024;
    /// Default batch limit: 10,000 events.
    pub const DEFAULT_MAX_BATCH_EVENTS: usize = 10_000;
    /// Default event limit: 64 KiB.
    pub const DEFAULT_MAX_EVENT_BYTES: usize = 64 * 1024;
    /// Default future skew: 5 minutes.
    pub const DEFAULT_MAX_FUTURE_SKEW: Duration = Duration::from_secs(300);
    /// Default concurrent ingest requests: 512.
    pub const DEFAULT_MAX_CONCURRENT_REQUESTS: usize = 512;
    /// Default bytes of bodies in flight: 1 GiB (the default queue, 256 MiB, and the
    /// requests on their way to it).
    pub const DEFAULT_MAX_BYTES_IN_FLIGHT: usize = 1024 * 1024 * 1024;
    /// Default body timeout: 30 seconds (8 MiB at about 280 KB/s).
    pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);

    fn default_max_body_bytes() -> usize {
        Self::DEFAULT_MAX_BODY_BYTES
    }
    fn default_max_decoded_bytes() -> usize {
        Self::DEFAULT_MAX_DECODED_BYTES
    }
    fn default_max_batch_events() -> usize {
        Self::DEFAULT_MAX_BATCH_EVENTS
    }
    fn default_max_event_bytes() -> usize {
        Self::DEFAULT_MAX_EVENT_BYTES
    }
    fn default_max_future_skew() -> Duration {
        Self::DEFAULT_MAX_FUTURE_SKEW
    }
    fn default_max_concurrent_requests() -> usize {
        Self::DEFAULT_MAX_CONCURRENT_REQUESTS
    }
    fn default_max_bytes_in_flight() -> usize {
        Self::DEFAULT_MAX_BYTES_IN_FLIGHT
    }
    fn default_body_timeout() -> Duration {
        Self::DEFAULT_BODY_TIMEOUT
    }
}

impl Default for RequestLimits {
    fn default() -> Self {
        Self {
            max_body_bytes: Self::DEFAULT_MAX_BODY_BYTES,
            max_decoded_bytes: Self::DEFAULT_MAX_DECODED_BYTES,
            max_batch_events: Self::DEFAULT_MAX_BATCH_EVENTS,
            max_event_bytes: Self::DEFAULT_MAX_EVENT_BYTES,
            max_future_skew: Self::DEFAULT_MAX_FUTURE_SKEW,
            max_concurrent_requests: Self::DEFAULT_MAX_CONCURRENT_REQUESTS,
            max_bytes_in_flight: Self::DEFAULT_MAX_BYTES_IN_FLIGHT,
            body_timeout: Self::DEFAULT_BODY_TIMEOUT,
        }
    }
}

/// Bounds of the queue between acceptance and commit.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueLimits {
    /// Decoded bytes waiting for a commit, over all tenants; beyond it: 503.
    #[serde(default = "QueueLimits::default_max_bytes")]
    pub max_bytes: usize,
    /// A tenant's share of `max_bytes`, in percent; beyond it that tenant gets 429 while
    /// others are still served.
    #[serde(default = "QueueLimits::default_tenant_share_percent")]
    pub tenant_share_percent: u8,
    /// Oldest queued event age beyond which new requests get 503: the gateway refuses
    /// before its queue eats the freshness budget.
    #[serde(default = "QueueLimits::default_max_age", with = "humantime_serde")]
    pub max_age: Duration,
    /// The freshness budget producers are told (`SignalWeave-Max-Event-Age`): events
    /// older than this are no longer worth sending.
    #[serde(
        default = "QueueLimits::default_max_event_age",
        with = "humantime_serde"
    )]
    pub max_event_age: Duration,
}

impl QueueLimits {
    /// Default queue bound: 256 MiB.
    pub const DEFAULT_MAX_BYTES: usize = 256 * 1024 * 1024;
    /// Default tenant share: 50 %.
    pub const DEFAULT_TENANT_SHARE_PERCENT: u8 = 50;
    /// Default queue age bound: 5 s.
    pub const DEFAULT_MAX_AGE: Duration = Duration::from_secs(5);
    /// Default freshness budget: 300 s (the reference design's ledger).
    pub const DEFAULT_MAX_EVENT_AGE: Duration = Duration::from_secs(300);

    fn default_max_bytes() -> usize {
        Self::DEFAULT_MAX_BYTES
    }
    fn default_tenant_share_percent() -> u8 {
        Self::DEFAULT_TENANT_SHARE_PERCENT
    }
    fn default_max_age() -> Duration {
        Self::DEFAULT_MAX_AGE
    }
    fn default_max_event_age() -> Duration {
        Self::DEFAULT_MAX_EVENT_AGE
    }

    /// The most queued bytes one tenant may hold.
    pub fn tenant_max_bytes(&self) -> usize {
        let share = self.tenant_share_percent.clamp(1, 100);
        // Without rounding down first: a share of 100 is the whole queue.
        usize::try_from(self.max_bytes as u128 * u128::from(share) / 100).unwrap_or(usize::MAX)
    }
}

impl Default for QueueLimits {
    fn default() -> Self {
        Self {
            max_bytes: Self::DEFAULT_MAX_BYTES,
            tenant_share_percent: Self::DEFAULT_TENANT_SHARE_PERCENT,
            max_age: Self::DEFAULT_MAX_AGE,
            max_event_age: Self::DEFAULT_MAX_EVENT_AGE,
        }
    }
}

/// How long accepted event identities are remembered.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DedupPolicy {
    /// A retried `(tenant, event_id)` within this long of the first acceptance (by ingest
    /// time) is acknowledged as a duplicate (or refused as `identity_conflict` when it says
    /// something else). It survives a restart: the gateway rebuilds
    /// it from the landing table's events ingested in the last `horizon` (by ingest time,
    /// whatever the snapshot retention). Memory: about 56 bytes
    /// per event accepted within the horizon. Must exceed the producers' unsent-age budget.
    #[serde(default = "DedupPolicy::default_horizon", with = "humantime_serde")]
    pub horizon: Duration,
}

impl DedupPolicy {
    /// Default horizon: 10 minutes (twice the producer's default unsent-age budget).
    pub const DEFAULT_HORIZON: Duration = Duration::from_secs(600);

    fn default_horizon() -> Duration {
        Self::DEFAULT_HORIZON
    }
}

impl Default for DedupPolicy {
    fn default() -> Self {
        Self {
            horizon: Self::DEFAULT_HORIZON,
        }
    }
}

/// One tenant: its keys and quotas.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// Tenant id, as events carry it.
    pub id: String,
    /// Sustained records per second for the tenant (burst: one second's worth).
    #[serde(default = "TenantConfig::default_records_per_sec")]
    pub records_per_sec: u32,
    /// Sustained decoded bytes per second for the tenant (burst: one second's worth).
    #[serde(default = "TenantConfig::default_bytes_per_sec")]
    pub bytes_per_sec: u32,
    /// Sustained records per second for each producer of the tenant.
    #[serde(default = "TenantConfig::default_producer_records_per_sec")]
    pub producer_records_per_sec: u32,
    /// API keys bound to this tenant.
    #[serde(default)]
    pub keys: Vec<KeyConfig>,
}

impl TenantConfig {
    /// Default tenant rate: 200,000 records/s.
    pub const DEFAULT_RECORDS_PER_SEC: u32 = 200_000;
    /// Default tenant byte rate: 256 MiB/s.
    pub const DEFAULT_BYTES_PER_SEC: u32 = 256 * 1024 * 1024;
    /// Default producer rate: 100,000 records/s.
    pub const DEFAULT_PRODUCER_RECORDS_PER_SEC: u32 = 100_000;

    fn default_records_per_sec() -> u32 {
        Self::DEFAULT_RECORDS_PER_SEC
    }
    fn default_bytes_per_sec() -> u32 {
        Self::DEFAULT_BYTES_PER_SEC
    }
    fn default_producer_records_per_sec() -> u32 {
        Self::DEFAULT_PRODUCER_RECORDS_PER_SEC
    }
}

/// One API key: stored as the SHA-256 of the bearer token, never the token.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyConfig {
    /// Lower-case hex SHA-256 of the token.
    pub sha256: String,
    /// Producer ids this key may speak for; `"*"` allows any producer of the tenant.
    pub producers: Vec<String>,
    /// A free-form label for people (who holds the key).
    #[serde(default)]
    pub label: Option<String>,
}
