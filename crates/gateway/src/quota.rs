//! Per-tenant and per-producer rate quotas, in records/s and bytes/s. A tenant's buckets
//! are its own: one tenant's burst spends only its tokens.
//!
//! Each bucket is a token bucket in the GCRA form (a theoretical arrival time, as
//! governor keeps it) that holds one second of its rate. The gateway's own, rather than
//! governor's, for two things governor's buckets cannot do:
//! - a request takes from all the buckets it asks of, or from none: a request one bucket
//!   refuses spends nothing from the others;
//! - tokens come back: a request the tenant paid for before its body was parsed gets its
//!   records back when a producer's quota then refuses it ([`Quotas::give_back`]), so one
//!   producer's refused retries do not spend the records its tenant's other producers are
//!   owed. The bytes stay spent: they paid for the parsing, so what refused requests can
//!   make the gateway parse stays bounded by the tenant's bytes quota.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::config::{GatewayConfig, TenantConfig};

/// One token, in the units a bucket keeps time in (ns × its rate per second).
const TOKEN: u128 = 1_000_000_000;

/// A token bucket of `rate` tokens a second, holding at most one second of them.
///
/// Time is kept in ns × `rate`, so a token is exactly [`TOKEN`] units whatever the rate
/// and nothing is lost to rounding.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    rate: u32,
    /// When the bucket is full again (ns × rate since the quotas' origin). A bucket whose
    /// time is past is full.
    full_at: u128,
}

impl Bucket {
    fn new(rate: u32) -> Self {
        Self {
            rate: rate.max(1),
            full_at: 0,
        }
    }

    /// The most tokens the bucket holds.
    fn capacity(&self) -> u32 {
        self.rate
    }

    fn scaled(&self, now_ns: u128) -> u128 {
        now_ns * u128::from(self.rate)
    }

    /// The bucket's new `full_at` once `n` tokens are taken at `now_ns`, or how long until
    /// it holds them.
    fn after_taking(&self, n: u32, now_ns: u128) -> Result<u128, Duration> {
        let now = self.scaled(now_ns);
        let full_at = self.full_at.max(now) + u128::from(n) * TOKEN;
        let limit = now + u128::from(self.capacity()) * TOKEN;
        if full_at <= limit {
            return Ok(full_at);
        }
        let short_ns = (full_at - limit).div_ceil(u128::from(self.rate));
        Err(Duration::from_nanos(
            u64::try_from(short_ns).unwrap_or(u64::MAX),
        ))
    }

    /// Gives `n` tokens back at `now_ns` (a full bucket stays full).
    fn give_back(&mut self, n: u32, now_ns: u128) {
        let now = self.scaled(now_ns);
        self.full_at = self
            .full_at
            .saturating_sub(u128::from(n) * TOKEN)
            .max(now.min(self.full_at));
    }

    fn is_full(&self, now_ns: u128) -> bool {
        self.full_at <= self.scaled(now_ns)
    }
}

struct TenantQuota {
    records: Bucket,
    bytes: Bucket,
    producer_rate: u32,
    /// Buckets of the producers heard from lately (a full bucket is forgotten).
    producers: HashMap<String, Bucket>,
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
    /// The bucket that is short longest: `tenant_records`, `tenant_bytes` or
    /// `producer_records`.
    pub bucket: &'static str,
    /// When every bucket the request asks of holds enough tokens again (if nothing else
    /// takes from them).
    pub retry_after: Duration,
}

/// The tenant records one admitted request took, to give back if the request is then
/// refused (see [`Quotas::give_back`]).
#[derive(Debug, Default)]
#[must_use = "what a request took is given back if the request is then refused"]
pub struct Taken {
    tenant_index: usize,
    records: u32,
}

/// All quotas of the gateway.
pub struct Quotas {
    tenants: Vec<Mutex<TenantQuota>>,
    origin: Instant,
}

impl std::fmt::Debug for Quotas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Quotas")
            .field("tenants", &self.tenants.len())
            .finish()
    }
}

impl Quotas {
    /// Buckets for every tenant of `config` (validated: rates are positive).
    pub fn new(config: &GatewayConfig) -> Self {
        Self::of_tenants(&config.tenants)
    }

    fn of_tenants(tenants: &[TenantConfig]) -> Self {
        let tenants = tenants
            .iter()
            .map(|t| {
                Mutex::new(TenantQuota {
                    records: Bucket::new(t.records_per_sec),
                    bytes: Bucket::new(t.bytes_per_sec),
                    producer_rate: t.producer_records_per_sec.max(1),
                    producers: HashMap::new(),
                })
            })
            .collect();
        Self {
            tenants,
            origin: Instant::now(),
        }
    }

    fn now_ns(&self) -> u128 {
        self.origin.elapsed().as_nanos()
    }

    /// Takes `records` and `bytes` tokens from the tenant and `per_producer` records from
    /// each producer's bucket, all or none: or says which bucket is short and when every
    /// one would hold enough. A request larger than a bucket's capacity takes nothing.
    pub fn check(
        &self,
        tenant_index: usize,
        records: u32,
        bytes: u32,
        per_producer: &[(&str, u32)],
    ) -> Result<Taken, QuotaRefusal> {
        self.check_at(tenant_index, records, bytes, per_producer, self.now_ns())
    }

    fn check_at(
        &self,
        tenant_index: usize,
        records: u32,
        bytes: u32,
        per_producer: &[(&str, u32)],
        now_ns: u128,
    ) -> Result<Taken, QuotaRefusal> {
        let Some(t) = self.tenants.get(tenant_index) else {
            return Ok(Taken::default());
        };
        let mut t = t.lock().unwrap_or_else(|e| e.into_inner());
        let most_per_producer = per_producer.iter().map(|(_, n)| *n).max().unwrap_or(0);
        for (bucket, asked, capacity) in [
            ("tenant_records", records, t.records.capacity()),
            ("tenant_bytes", bytes, t.bytes.capacity()),
            ("producer_records", most_per_producer, t.producer_rate),
        ] {
            if asked > capacity {
                return Err(QuotaRefusal::TooLarge(TooLarge {
                    bucket,
                    asked,
                    capacity,
                }));
            }
        }
        // Every bucket's state once this request is taken, checked before any is changed.
        let mut short: Option<Throttle> = None;
        let mut note = |bucket: &'static str, wait: Duration| {
            if short.as_ref().is_none_or(|s| wait > s.retry_after) {
                short = Some(Throttle {
                    bucket,
                    retry_after: wait,
                });
            }
        };
        let records_at = match t.records.after_taking(records, now_ns) {
            Ok(at) => Some(at),
            Err(wait) => {
                note("tenant_records", wait);
                None
            }
        };
        let bytes_at = match t.bytes.after_taking(bytes, now_ns) {
            Ok(at) => Some(at),
            Err(wait) => {
                note("tenant_bytes", wait);
                None
            }
        };
        let fresh = Bucket::new(t.producer_rate);
        let mut producers_at = Vec::with_capacity(per_producer.len());
        for (producer, n) in per_producer {
            let bucket = t.producers.get(*producer).unwrap_or(&fresh);
            match bucket.after_taking(*n, now_ns) {
                Ok(at) => producers_at.push(at),
                Err(wait) => note("producer_records", wait),
            }
        }
        if let Some(s) = short {
            return Err(QuotaRefusal::Throttled(s));
        }
        if let Some(at) = records_at {
            t.records.full_at = at;
        }
        if let Some(at) = bytes_at {
            t.bytes.full_at = at;
        }
        for ((producer, _), full_at) in per_producer.iter().zip(producers_at) {
            match t.producers.get_mut(*producer) {
                Some(b) => b.full_at = full_at,
                None => {
                    t.producers
                        .insert((*producer).to_string(), Bucket { full_at, ..fresh });
                }
            }
        }
        Ok(Taken {
            tenant_index,
            records,
        })
    }

    /// Gives back the tenant records a request took, when the request is then refused:
    /// the tenant's next request may spend them. (Its bytes stay spent: see the module.)
    pub fn give_back(&self, taken: Taken) {
        self.give_back_at(taken, self.now_ns());
    }

    fn give_back_at(&self, taken: Taken, now_ns: u128) {
        let Some(t) = self.tenants.get(taken.tenant_index) else {
            return;
        };
        let mut t = t.lock().unwrap_or_else(|e| e.into_inner());
        t.records.give_back(taken.records, now_ns);
    }

    /// Forgets producers' buckets that are full again (call now and then: the map then
    /// holds the producers heard from within about a second before the call).
    pub fn retain_recent(&self) {
        let now_ns = self.now_ns();
        for t in &self.tenants {
            let mut t = t.lock().unwrap_or_else(|e| e.into_inner());
            t.producers.retain(|_, b| !b.is_full(now_ns));
            t.producers.shrink_to_fit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: u128 = 1_000_000_000;

    fn quotas(records: u32, bytes: u32, producer_records: u32) -> Quotas {
        Quotas::of_tenants(&[TenantConfig {
            id: "tenant-0".into(),
            records_per_sec: records,
            bytes_per_sec: bytes,
            producer_records_per_sec: producer_records,
            keys: Vec::new(),
        }])
    }

    fn throttled(r: Result<Taken, QuotaRefusal>) -> Throttle {
        match r {
            Err(QuotaRefusal::Throttled(t)) => t,
            other => panic!("expected a throttle, got {other:?}"),
        }
    }

    #[test]
    fn a_bucket_holds_one_second_and_refills_at_its_rate() {
        let q = quotas(100, 1_000_000, 1_000);
        let now = 10 * SECOND;
        let _ = q.check_at(0, 100, 1, &[], now).unwrap();
        let t = throttled(q.check_at(0, 1, 1, &[], now));
        assert_eq!(t.bucket, "tenant_records");
        assert_eq!(t.retry_after, Duration::from_millis(10));
        // A quarter of a second later, 25 records fit, and a 26th does not.
        let later = now + SECOND / 4;
        let _ = q.check_at(0, 25, 1, &[], later).unwrap();
        assert!(q.check_at(0, 1, 1, &[], later).is_err());
        // An idle bucket fills to its capacity, no further.
        let idle = later + 60 * SECOND;
        let _ = q.check_at(0, 100, 1, &[], idle).unwrap();
        assert!(q.check_at(0, 1, 1, &[], idle).is_err());
    }

    #[test]
    fn a_request_one_bucket_refuses_takes_from_none() {
        let q = quotas(100, 1_000, 10);
        let now = SECOND;
        // The bytes bucket is short: the records are not spent either.
        let _ = q.check_at(0, 1, 1_000, &[], now).unwrap();
        let t = throttled(q.check_at(0, 99, 1, &[], now));
        assert_eq!(t.bucket, "tenant_bytes");
        let _ = q.check_at(0, 99, 0, &[], now).unwrap();
        // One producer of two is short: the other's tokens are not spent.
        let q = quotas(100, 1_000, 10);
        let _ = q.check_at(0, 0, 0, &[("b", 10)], now).unwrap();
        let t = throttled(q.check_at(0, 0, 0, &[("a", 10), ("b", 1)], now));
        assert_eq!(t.bucket, "producer_records");
        assert_eq!(t.retry_after, Duration::from_millis(100));
        let _ = q.check_at(0, 0, 0, &[("a", 10)], now).unwrap();
    }

    #[test]
    fn the_longest_wait_is_the_one_told() {
        let q = quotas(100, 1_000, 10);
        let now = SECOND;
        let _ = q.check_at(0, 100, 1_000, &[], now).unwrap();
        // Records back in 10 ms, bytes in 500 ms: come back when both fit.
        let t = throttled(q.check_at(0, 1, 500, &[], now));
        assert_eq!(t.bucket, "tenant_bytes");
        assert_eq!(t.retry_after, Duration::from_millis(500));
    }

    #[test]
    fn records_given_back_are_spent_again_and_never_overfill() {
        let q = quotas(100, 1_000, 10);
        let now = SECOND;
        let paid = q.check_at(0, 60, 600, &[], now).unwrap();
        assert!(q.check_at(0, 60, 1, &[], now).is_err());
        q.give_back_at(paid, now);
        // The records came back; the bytes stay spent.
        let _ = q.check_at(0, 100, 400, &[], now).unwrap();
        assert!(q.check_at(0, 1, 0, &[], now).is_err());
        let q = quotas(100, 1_000, 10);
        let paid = q.check_at(0, 10, 600, &[], now).unwrap();
        q.give_back_at(paid, now);
        let t = throttled(q.check_at(0, 1, 401, &[], now));
        assert_eq!(t.bucket, "tenant_bytes");
        // Given back after the bucket refilled: it stays at its capacity.
        let q = quotas(100, 1_000, 10);
        let paid = q.check_at(0, 50, 0, &[], now).unwrap();
        let later = now + 2 * SECOND;
        q.give_back_at(paid, later);
        let _ = q.check_at(0, 100, 0, &[], later).unwrap();
        assert!(q.check_at(0, 1, 0, &[], later).is_err());
    }

    #[test]
    fn a_request_beyond_a_capacity_is_too_large_and_takes_nothing() {
        let q = quotas(100, 1_000, 10);
        let now = SECOND;
        match q.check_at(0, 101, 0, &[], now) {
            Err(QuotaRefusal::TooLarge(t)) => {
                assert_eq!(
                    (t.bucket, t.asked, t.capacity),
                    ("tenant_records", 101, 100)
                )
            }
            other => panic!("{other:?}"),
        }
        match q.check_at(0, 5, 0, &[("p", 11)], now) {
            Err(QuotaRefusal::TooLarge(t)) => assert_eq!(t.bucket, "producer_records"),
            other => panic!("{other:?}"),
        }
        let _ = q.check_at(0, 100, 1_000, &[("p", 10)], now).unwrap();
    }

    #[test]
    fn rates_of_billions_keep_exact_time() {
        // 4 GiB/s: a token is a quarter of a nanosecond.
        let q = quotas(1, u32::MAX, 1);
        let now = 3_600 * SECOND;
        let _ = q.check_at(0, 0, u32::MAX, &[], now).unwrap();
        let t = throttled(q.check_at(0, 0, 4, &[], now));
        assert_eq!(t.retry_after, Duration::from_nanos(1));
        let _ = q.check_at(0, 0, 4, &[], now + 1).unwrap();
    }
}
