//! Synthetic commerce events for `signalweave produce` and the gateway benchmark: wire-form
//! `order_placed` v1.2.0 events of a chosen size, with a fraction sent late (beyond the
//! jobs' allowed lateness) and a fraction resent as duplicates.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng, rngs::SmallRng};
use signalweave_model::format_rfc3339_micros;

use crate::client::{Producer, ProducerStats};

/// How the synthetic events look.
#[derive(Debug, Clone)]
pub struct EventShape {
    /// Tenant of every event.
    pub tenant: String,
    /// Producer id of every event (and prefix of its event ids).
    pub producer_id: String,
    /// Target serialized size of an event, in bytes (at least the envelope's ~330 bytes).
    pub event_bytes: usize,
    /// Fraction of events whose event time is 3 h old (beyond the 2 h allowed lateness).
    pub late_fraction: f64,
    /// Fraction of sends that repeat a recent event verbatim (same `event_id`).
    pub dup_fraction: f64,
    /// Markets to spread events over.
    pub markets: u32,
    /// Customers to spread events over.
    pub customers: u32,
    /// Random seed.
    pub seed: u64,
}

impl EventShape {
    /// Defaults for a tenant and producer: ~1.2 KiB events, no late events, no duplicates.
    pub fn new(tenant: impl Into<String>, producer_id: impl Into<String>) -> Self {
        Self {
            tenant: tenant.into(),
            producer_id: producer_id.into(),
            event_bytes: 1_200,
            late_fraction: 0.0,
            dup_fraction: 0.0,
            markets: 1_000,
            customers: 100_000,
            seed: 42,
        }
    }
}

/// Makes events of an [`EventShape`], numbering them with `producer_seq`.
#[derive(Debug)]
pub struct EventFactory {
    shape: EventShape,
    rng: SmallRng,
    seq: u64,
    recent: VecDeque<Vec<u8>>,
}

/// Late events are this old: beyond the shipped jobs' 2 h allowed lateness.
pub const LATE_BY: Duration = Duration::from_secs(3 * 3600);

impl EventFactory {
    /// A factory for `shape`.
    pub fn new(shape: EventShape) -> Self {
        let rng = SmallRng::seed_from_u64(shape.seed);
        Self {
            shape,
            rng,
            seq: 0,
            recent: VecDeque::with_capacity(256),
        }
    }

    /// Events made so far (duplicates not counted).
    pub fn made(&self) -> u64 {
        self.seq
    }

    /// The next event to send: a new one, or (with `dup_fraction`) a recent one again.
    pub fn next_event(&mut self, now_us: i64) -> Vec<u8> {
        if !self.recent.is_empty()
            && self
                .rng
                .random_bool(self.shape.dup_fraction.clamp(0.0, 1.0))
        {
            let i = self.rng.random_range(0..self.recent.len());
            return self.recent[i].clone();
        }
        let event = self.make(now_us);
        if self.shape.dup_fraction > 0.0 {
            if self.recent.len() == 256 {
                self.recent.pop_front();
            }
            self.recent.push_back(event.clone());
        }
        event
    }

    fn make(&mut self, now_us: i64) -> Vec<u8> {
        self.seq += 1;
        let s = &self.shape;
        let late = self.rng.random_bool(s.late_fraction.clamp(0.0, 1.0));
        let jitter_us = self.rng.random_range(0..2_000_000);
        let event_time = if late {
            now_us - LATE_BY.as_micros() as i64 - jitter_us
        } else {
            now_us - jitter_us
        };
        let market = self.rng.random_range(0..s.markets.max(1));
        let customer = self.rng.random_range(0..s.customers.max(1));
        let amount = self.rng.random_range(100..100_000);
        let items = self.rng.random_range(1..6);
        let mut out = String::with_capacity(s.event_bytes + 64);
        let _ = write!(
            out,
            r#"{{"event_id":"{p}-{seq}","event_type":"order_placed","schema_version":"1.2.0","tenant":"{t}","producer_id":"{p}","producer_seq":{seq},"event_time":"{time}","market_id":"m-{market}","customer_id":"c-{customer}","order_id":"o-{p}-{seq}","payload":{{"amount_minor":{amount},"currency":"EUR","item_count":{items},"channel":"web","line_items":""#,
            p = s.producer_id,
            t = s.tenant,
            seq = self.seq,
            time = format_rfc3339_micros(event_time),
        );
        let mut sku = 0u32;
        while out.len() + 4 < s.event_bytes {
            sku += 1;
            let _ = write!(
                out,
                "SKU-{:06}x{}@{};",
                (self.seq as u32).wrapping_mul(31).wrapping_add(sku) % 1_000_000,
                sku % 4 + 1,
                amount / items
            );
        }
        out.push_str("\"}}");
        out.into_bytes()
    }
}

/// What a paced run did.
#[derive(Debug, Clone)]
pub struct DriveReport {
    /// Wall time from the first send to the last acknowledgment (or the flush timeout).
    pub elapsed: Duration,
    /// Sends attempted (including duplicates and sends refused by the buffer).
    pub offered: u64,
    /// The producer's counters at the end.
    pub stats: ProducerStats,
}

impl DriveReport {
    /// Acknowledged events (accepted + duplicate) per second over the run.
    pub fn acked_per_sec(&self) -> f64 {
        (self.stats.accepted + self.stats.duplicate) as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Sends `rate` events/s from `factory` through `producer` for `duration`, then flushes
/// (within `flush_timeout`) and closes the producer.
pub async fn drive(
    producer: Producer,
    mut factory: EventFactory,
    rate: u64,
    duration: Duration,
    flush_timeout: Duration,
) -> DriveReport {
    let started = Instant::now();
    let tick = Duration::from_millis(5);
    let mut offered = 0u64;
    loop {
        let elapsed = started.elapsed();
        if elapsed >= duration {
            break;
        }
        let due = (rate as f64 * elapsed.as_secs_f64()) as u64;
        let now_us = chrono_now_us();
        while offered < due {
            let _ = producer.send(factory.next_event(now_us));
            offered += 1;
        }
        tokio::time::sleep(tick).await;
    }
    let stats = producer.close(flush_timeout).await;
    DriveReport {
        elapsed: started.elapsed(),
        offered,
        stats,
    }
}

fn chrono_now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_have_the_requested_size_and_parse() {
        for size in [300usize, 1200, 4000] {
            let mut f = EventFactory::new(EventShape {
                event_bytes: size,
                ..EventShape::new("tenant-0", "p-1")
            });
            let e = f.next_event(1_767_225_600_000_000);
            let v: serde_json::Value = serde_json::from_slice(&e).unwrap();
            assert_eq!(v["tenant"], "tenant-0");
            assert!(
                e.len() >= size.min(400) - 20 && e.len() <= size.max(400) + 40,
                "{size}: {}",
                e.len()
            );
        }
    }

    #[test]
    fn duplicates_repeat_event_ids() {
        let mut f = EventFactory::new(EventShape {
            dup_fraction: 0.5,
            ..EventShape::new("t", "p")
        });
        let ids: Vec<String> = (0..200)
            .map(|_| {
                let v: serde_json::Value = serde_json::from_slice(&f.next_event(0)).unwrap();
                v["event_id"].as_str().unwrap().to_string()
            })
            .collect();
        let distinct: std::collections::HashSet<_> = ids.iter().collect();
        assert!(distinct.len() < 150 && distinct.len() > 50);
        assert_eq!(f.made() as usize, distinct.len());
    }
}
