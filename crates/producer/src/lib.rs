//! # signalweave-producer
//!
//! The client side of ingestion. A [`Producer`] buffers serialized events within a byte
//! budget, sends them to the gateway in zstd-compressed NDJSON batches, and retries
//! throttles (429) and unavailability (503) after the server's `Retry-After`, and
//! connection failures with exponential backoff, both with jitter. It never retries
//! forever: an event older than the age budget is dropped and counted. It exposes the
//! age of its oldest unacknowledged event.
//!
//! Retrying is safe because the gateway deduplicates by `(tenant, event_id)` within its
//! horizon (longer than the producer's default age budget): a batch whose answer was
//! lost is acknowledged as duplicates on retry.
//!
//! [`workload`] makes synthetic events and paces them, for `signalweave produce` and the
//! gateway benchmark.

mod client;
pub mod workload;

pub use client::{Dropped, Producer, ProducerConfig, ProducerError, ProducerStats};
