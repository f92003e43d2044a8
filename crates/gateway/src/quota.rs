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
            })
            .collect();
        Self {
            tenants,
            clock: DefaultClock::default(),
        }
    }

    /// Takes `records` and `bytes` tokens from the tenant and `per_producer` records from
    /// each producer's bucket, or says which bucket is short and for how long.
    pub fn check(
        &self,
        tenant_index: usize,
        records: u32,
        bytes: u32,
        per_producer: &[(&str, u32)],
    ) -> Result<(), Throttle> {
        let Some(t) = self.tenants.get(tenant_index) else {
            return Ok(());
        };
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
        }
    }
}
