//! Per-tenant and per-producer rate quotas (governor token buckets), in records/s and
//! bytes/s. A tenant's bucket is its own: one tenant's burst spends only its tokens.

use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, DefaultKeyedRateLimiter, Quota, RateLimiter};

use crate::config::GatewayConfig;

struct TenantQuota {
    records: DefaultDirectRateLimiter,
    bytes: DefaultDirectRateLimiter,
    producers: DefaultKeyedRateLimiter<String>,
    /// Each bucket's burst (one second of its rate): the most one request can take.
    capacity: Capacity,
}

#[derive(Debug, Clone, Copy)]
struct Capacity {
    records: u32,
    bytes: u32,
    producer_records: u32,
}

/// A request that no bucket of its quota can ever admit: it asks for more tokens than the
/// bucket holds when full.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TooLarge {
    /// The bucket: `tenant_records`, `tenant_bytes` or `producer_records`.
    pub bucket: &'static str,
    /// Tokens the request asks for.
    pub asked: u32,
    /// The most the bucket holds.
    pub capacity: u32,
}

/// Why a request was not admitted by the quotas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuotaRefusal {
    /// A bucket is short now; the request fits once it refills.
    Throttled(Throttle),
    /// A bucket can never hold what the request asks for: retrying cannot help.
    TooLarge(TooLarge),
}

/// Why a request was throttled, and when to come back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Throttle {
    /// Which bucket ran dry: `tenant_records`, `tenant_bytes` or `producer_records`.
    pub bucket: &'static str,
    /// When the bucket will hold enough tokens again.
    pub retry_after: Duration,
}

/// All quotas of the gateway.
pub struct Quotas {
    tenants: Vec<TenantQuota>,
    clock: DefaultClock,
}

impl std::fmt::Debug for Quotas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Quotas")
            .field("tenants", &self.tenants.len())
            .finish()
    }
}

fn per_second(n: u32) -> Quota {
    Quota::per_second(NonZeroU32::new(n.max(1)).unwrap_or(NonZeroU32::MIN))
}

impl Quotas {
    /// Buckets for every tenant of `config` (validated: rates are positive).
    pub fn new(config: &GatewayConfig) -> Self {
        let tenants = config
            .tenants
            .iter()
            .map(|t| TenantQuota {
                records: RateLimiter::direct(per_second(t.records_per_sec)),
                bytes: RateLimiter::direct(per_second(t.bytes_per_sec)),
                producers: RateLimiter::keyed(per_second(t.producer_records_per_sec)),
                capacity: Capacity {
                    records: t.records_per_sec.max(1),
                    bytes: t.bytes_per_sec.max(1),
                    producer_records: t.producer_records_per_sec.max(1),
                },
            })
            .collect();
        Self {
            tenants,
            clock: DefaultClock::default(),
        }
    }

    /// Takes `records` and `bytes` tokens from the tenant and `per_producer` records from
    /// each producer's bucket, or says which bucket is short and for how long. A request
    /// larger than a bucket's capacity takes nothing from any bucket.
    pub fn check(
        &self,
        tenant_index: usize,
        records: u32,
        bytes: u32,
        per_producer: &[(&str, u32)],
    ) -> Result<(), QuotaRefusal> {
        let Some(t) = self.tenants.get(tenant_index) else {
            return Ok(());
        };
        let most_per_producer = per_producer.iter().map(|(_, n)| *n).max().unwrap_or(0);
        for (bucket, asked, capacity) in [
            ("tenant_records", records, t.capacity.records),
            ("tenant_bytes", bytes, t.capacity.bytes),
            (
                "producer_records",
                most_per_producer,
                t.capacity.producer_records,
            ),
        ] {
            if asked > capacity {
                return Err(QuotaRefusal::TooLarge(TooLarge {
                    bucket,
                    asked,
                    capacity,
                }));
            }
        }
        self.take(t, records, bytes, per_producer)
            .map_err(QuotaRefusal::Throttled)
    }

    fn take(
        &self,
        t: &TenantQuota,
        records: u32,
        bytes: u32,
        per_producer: &[(&str, u32)],
    ) -> Result<(), Throttle> {
        let now = self.clock.now();
        let short = |bucket: &'static str, wait: Option<Duration>| Throttle {
            bucket,
            retry_after: wait.unwrap_or(Duration::from_secs(1)),
        };
        if let Some(n) = NonZeroU32::new(records) {
            match t.records.check_n(n) {
                Ok(Ok(())) => {}
                Ok(Err(not_until)) => {
                    return Err(short("tenant_records", Some(not_until.wait_time_from(now))));
                }
                Err(_) => return Err(short("tenant_records", None)),
            }
        }
        if let Some(n) = NonZeroU32::new(bytes) {
            match t.bytes.check_n(n) {
                Ok(Ok(())) => {}
                Ok(Err(not_until)) => {
                    return Err(short("tenant_bytes", Some(not_until.wait_time_from(now))));
                }
                Err(_) => return Err(short("tenant_bytes", None)),
            }
        }
        for (producer, n) in per_producer {
            let Some(n) = NonZeroU32::new(*n) else {
                continue;
            };
            let key = (*producer).to_string();
            match t.producers.check_key_n(&key, n) {
                Ok(Ok(())) => {}
                Ok(Err(not_until)) => {
                    return Err(short(
                        "producer_records",
                        Some(not_until.wait_time_from(now)),
                    ));
                }
                Err(_) => return Err(short("producer_records", None)),
            }
        }
        Ok(())
    }

    /// Forgets idle producers' buckets (call now and then, so the key map stays bounded).
    pub fn retain_recent(&self) {
        for t in &self.tenants {
            t.producers.retain_recent();
            t.producers.shrink_to_fit();
        }
    }
}
