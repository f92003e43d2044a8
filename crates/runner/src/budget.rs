//! A backfill's budgets, and the controller that gives its capacity back to live traffic.
//!
//! - [`Budgets`]: token buckets (governor) for records processed, bytes read and rows
//!   written per second, and the guaranteed floor of records per second.
//! - [`Guards`]: thresholds on the live job's queue age, watermark delay, checkpoint age
//!   and sink commit latency.
//! - [`Controller`]: a pure state machine from guard readings to decisions. A crossed
//!   guard cuts the backfill to its floor (a pause when the floor is 0) at once. Capacity
//!   is borrowed back only after every guard has stayed below `clear_ratio` × its
//!   threshold for `clear_hold` (hysteresis), doubling the rate every `step_every` up to
//!   the ceiling; a crossing during the climb cuts it to the floor again.
//! - [`Throttle`]: applies decisions to the records bucket and measures the reclaim
//!   latency: from the reading that crossed a guard to the first admission at the floor.

use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use serde::{Deserialize, Serialize};

use crate::metrics::JobStatus;

/// Token budgets of one backfill (None: unlimited).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budgets {
    /// Records processed per second at full speed.
    pub records_per_sec: Option<u32>,
    /// Bytes of data files read per second.
    pub read_bytes_per_sec: Option<u64>,
    /// Output rows written per second.
    pub write_rows_per_sec: Option<u32>,
    /// Records per second guaranteed while live traffic holds the capacity (0: pause).
    pub floor_records_per_sec: u32,
}

/// Thresholds on the live job's health; crossing any reclaims the backfill's capacity.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Guards {
    /// Age of the oldest source commit the live job has not processed, seconds.
    pub queue_age_s: f64,
    /// Processing time minus the live watermark, seconds.
    pub watermark_delay_s: f64,
    /// Seconds processed live work has waited for a checkpoint.
    pub checkpoint_age_s: f64,
    /// Seconds of the live job's last sink commit.
    pub sink_commit_s: f64,
    /// A guard is clear below this fraction of its threshold.
    pub clear_ratio: f64,
    /// How long every guard must stay clear before capacity is borrowed back.
    pub clear_hold: Duration,
    /// Time between borrowing steps (each doubles the rate).
    pub step_every: Duration,
    /// A live status older than this counts as a crossed guard (the live job may be
    /// too busy to answer).
    pub stale_after: Duration,
}

impl Default for Guards {
    fn default() -> Self {
        Self {
            queue_age_s: 2.0,
            watermark_delay_s: 30.0,
            checkpoint_age_s: 5.0,
            sink_commit_s: 2.0,
            clear_ratio: 0.5,
            clear_hold: Duration::from_secs(3),
            step_every: Duration::from_secs(2),
            stale_after: Duration::from_secs(5),
        }
    }
}

/// One reading of the live job's health: the worst over its live jobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GuardReading {
    /// When the values were true (for the reclaim latency).
    pub at: Instant,
    /// Queue age, seconds.
    pub queue_age_s: f64,
    /// Watermark delay, seconds.
    pub watermark_delay_s: f64,
    /// Checkpoint age, seconds.
    pub checkpoint_age_s: f64,
    /// Last sink commit, seconds.
    pub sink_commit_s: f64,
}

impl GuardReading {
    /// The worst values over the `live` namespace jobs of `statuses` (the watermark delay
    /// only of jobs with records waiting).
    pub fn from_statuses<'a>(statuses: impl IntoIterator<Item = &'a JobStatus>) -> Self {
        let mut r = Self {
            at: Instant::now(),
            queue_age_s: 0.0,
            watermark_delay_s: 0.0,
            checkpoint_age_s: 0.0,
            sink_commit_s: 0.0,
        };
        for s in statuses.into_iter().filter(|s| s.namespace == "live") {
            r.queue_age_s = r.queue_age_s.max(s.oldest_unprocessed_age_s);
            // An idle live job's watermark stands still: its delay matters only while
            // records wait.
            if s.lag_records > 0 || s.oldest_unprocessed_age_s > 0.0 {
                r.watermark_delay_s = r.watermark_delay_s.max(s.watermark_delay_s);
            }
            r.checkpoint_age_s = r.checkpoint_age_s.max(s.checkpoint_age_s);
            r.sink_commit_s = r.sink_commit_s.max(s.sink_commit_s);
        }
        r
    }

    fn values(&self) -> [(&'static str, f64); 4] {
        [
            ("queue_age", self.queue_age_s),
            ("watermark_delay", self.watermark_delay_s),
            ("checkpoint_age", self.checkpoint_age_s),
            ("sink_commit", self.sink_commit_s),
        ]
    }
}

impl Guards {
    fn thresholds(&self) -> [f64; 4] {
        [
            self.queue_age_s,
            self.watermark_delay_s,
            self.checkpoint_age_s,
            self.sink_commit_s,
        ]
    }

    /// The first crossed guard of `r`, as a cause (`queue_age 3.1 s > 2 s`).
    pub fn crossed(&self, r: &GuardReading) -> Option<String> {
        r.values()
            .iter()
            .zip(self.thresholds())
            .find(|((_, v), t)| v > t)
            .map(|((name, v), t)| format!("{name} {v:.2} s > {t} s"))
    }

    /// True when every guard of `r` is below `clear_ratio` × its threshold.
    pub fn clear(&self, r: &GuardReading) -> bool {
        r.values()
            .iter()
            .zip(self.thresholds())
            .all(|((_, v), t)| *v < t * self.clear_ratio)
    }
}

/// What the controller decided.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// `reclaim` (cut to the floor), `borrow` (one step up) or `full` (the ceiling).
    pub action: &'static str,
    /// Records per second allowed from now (None: unlimited); 0 pauses.
    pub rate: Option<u32>,
    /// Why.
    pub cause: String,
    /// For a reclaim: when the crossing guard's reading was true.
    pub crossed_at: Option<Instant>,
}

/// Where the backfill stands between the floor and the ceiling.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    /// Before the first reading of the guards: nothing is admitted, since a live job that
    /// cannot be read counts as crossed.
    Starting,
    Full,
    Reclaimed,
    Borrowing(u32),
}

/// The live-priority controller (see the module documentation).
#[derive(Debug, Clone)]
pub struct Controller {
    guards: Guards,
    budgets: Budgets,
    mode: Mode,
    clear_since: Option<Instant>,
    last_step: Instant,
}

/// Borrowing without a ceiling stops doubling here and lifts the limit.
const UNLIMITED_AFTER: u32 = 2_000_000;
/// The first borrowing step when the floor is lower.
const FIRST_STEP: u32 = 5_000;

impl Controller {
    /// A controller that admits nothing until its first reading: then it goes to full
    /// speed if the guards are clear, and to the floor otherwise.
    pub fn new(guards: Guards, budgets: Budgets) -> Self {
        Self {
            guards,
            budgets,
            mode: Mode::Starting,
            clear_since: None,
            last_step: Instant::now(),
        }
    }

    /// The rate at full speed.
    pub fn ceiling(&self) -> Option<u32> {
        self.budgets.records_per_sec
    }

    /// The current rate (None: unlimited).
    pub fn rate(&self) -> Option<u32> {
        match self.mode {
            Mode::Starting => Some(0),
            Mode::Full => self.ceiling(),
            Mode::Reclaimed => Some(self.budgets.floor_records_per_sec),
            Mode::Borrowing(r) => Some(r),
        }
    }

    /// Feeds one reading (None: the live status could not be read) at `now`.
    pub fn observe(&mut self, reading: Option<&GuardReading>, now: Instant) -> Option<Decision> {
        let crossed = match reading {
            None => Some("live status unavailable".to_string()),
            Some(r) if now.saturating_duration_since(r.at) > self.guards.stale_after => {
                Some(format!(
                    "live status {:.1} s old",
                    now.saturating_duration_since(r.at).as_secs_f64()
                ))
            }
            Some(r) => self.guards.crossed(r),
        };
        if let Some(cause) = crossed {
            self.clear_since = None;
            if self.mode == Mode::Reclaimed {
                return None;
            }
            self.mode = Mode::Reclaimed;
            return Some(Decision {
                action: "reclaim",
                rate: self.rate(),
                cause,
                crossed_at: Some(reading.map_or(now, |r| r.at)),
            });
        }
        let r = reading?;
        if self.mode == Mode::Starting {
            let clear = self.guards.clear(r);
            self.mode = if clear { Mode::Full } else { Mode::Reclaimed };
            return Some(Decision {
                action: if clear { "full" } else { "reclaim" },
                rate: self.rate(),
                cause: if clear {
                    "guards clear at the start".to_string()
                } else {
                    "guards not clear at the start".to_string()
                },
                crossed_at: None,
            });
        }
        if !self.guards.clear(r) {
            // Between clear and crossed: hold (hysteresis).
            self.clear_since = None;
            return None;
        }
        if self.mode == Mode::Full {
            return None;
        }
        let since = *self.clear_since.get_or_insert(now);
        if now.saturating_duration_since(since) < self.guards.clear_hold
            || now.saturating_duration_since(self.last_step) < self.guards.step_every
        {
            return None;
        }
        self.last_step = now;
        let current = match self.mode {
            Mode::Borrowing(r) => r,
            _ => self.budgets.floor_records_per_sec,
        };
        let next = current.saturating_mul(2).max(FIRST_STEP);
        let reached = match self.ceiling() {
            Some(c) => next >= c,
            None => next >= UNLIMITED_AFTER,
        };
        self.mode = if reached {
            Mode::Full
        } else {
            Mode::Borrowing(next)
        };
        Some(Decision {
            action: if reached { "full" } else { "borrow" },
            rate: self.rate(),
            cause: format!(
                "guards clear for {:.1} s",
                now.saturating_duration_since(since).as_secs_f64()
            ),
            crossed_at: None,
        })
    }
}

/// A token bucket of `per_sec` holding at most a tenth of a second of tokens, and starting
/// empty: a new rate never comes with a free burst (the controller changes rates often).
/// Returns it with its burst.
fn bucket(per_sec: u64) -> Option<(DefaultDirectRateLimiter, u32)> {
    let per_sec = NonZeroU32::new(u32::try_from(per_sec).unwrap_or(u32::MAX))?;
    let burst = NonZeroU32::new((per_sec.get() / 10).max(1))?;
    let limiter = RateLimiter::direct(Quota::per_second(per_sec).allow_burst(burst));
    // Cannot fail: the burst fits.
    let _ = limiter.check_n(burst);
    Some((limiter, burst.get()))
}

/// Waits for `n` tokens of `limiter`, in pieces no larger than its burst.
async fn take(limiter: &DefaultDirectRateLimiter, burst: u32, mut n: u64) {
    while n > 0 {
        let piece = n.min(u64::from(burst.max(1))) as u32;
        if let Some(piece) = NonZeroU32::new(piece) {
            // Cannot fail: the piece fits the burst.
            let _ = limiter.until_n_ready(piece).await;
        }
        n -= u64::from(piece);
    }
}

/// What the operator wants of a running backfill's admissions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operator {
    /// Admit at the rate in force.
    Run,
    /// Admit nothing until told otherwise (pause).
    Hold,
    /// Admit nothing, ever: fail every admission (abort).
    Stop,
}

struct RecordsBucket {
    operator: Operator,
    rate: Option<u32>,
    limiter: Option<(Arc<DefaultDirectRateLimiter>, u32)>,
    generation: u64,
    crossed_at: Option<Instant>,
}

/// The budgets in force: applies the controller's decisions to the records bucket.
pub struct Throttle {
    records: Mutex<RecordsBucket>,
    bytes: Option<(DefaultDirectRateLimiter, u32)>,
    rows: Option<(DefaultDirectRateLimiter, u32)>,
    reclaim_latencies: Mutex<Vec<Duration>>,
    changed: tokio::sync::Notify,
}

impl std::fmt::Debug for Throttle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Throttle")
            .field("rate", &self.rate())
            .finish()
    }
}

impl Throttle {
    /// Buckets for `budgets`, at full speed.
    pub fn new(budgets: &Budgets) -> Self {
        let limited = |per_sec: Option<u64>| per_sec.and_then(bucket);
        let t = Self {
            records: Mutex::new(RecordsBucket {
                operator: Operator::Run,
                rate: None,
                limiter: None,
                generation: 0,
                crossed_at: None,
            }),
            bytes: limited(budgets.read_bytes_per_sec),
            rows: limited(budgets.write_rows_per_sec.map(u64::from)),
            reclaim_latencies: Mutex::new(Vec::new()),
            changed: tokio::sync::Notify::new(),
        };
        t.set_rate(budgets.records_per_sec, None);
        t
    }

    /// The records per second in force (None: unlimited; 0: paused).
    pub fn rate(&self) -> Option<u32> {
        self.records.lock().map(|r| r.rate).unwrap_or(None)
    }

    /// Sets the records rate. `crossed_at` (a reclaim) starts the reclaim-latency clock,
    /// stopped by the backfill's next budget request under the new rate (at once for a
    /// pause).
    pub fn set_rate(&self, rate: Option<u32>, crossed_at: Option<Instant>) {
        if let Ok(mut r) = self.records.lock() {
            r.rate = rate;
            r.limiter = rate
                .and_then(|n| bucket(u64::from(n)))
                .map(|(l, burst)| (Arc::new(l), burst));
            r.generation += 1;
            // A crossing not yet met by an admission stays pending (the earliest one), so
            // a backfill busy elsewhere when it came is measured when it next asks.
            let pending = r.crossed_at.or(crossed_at);
            r.crossed_at = None;
            match (rate, pending) {
                // A pause is in force at once: nothing is admitted from here on.
                (Some(0), Some(crossed)) => {
                    if let Ok(mut l) = self.reclaim_latencies.lock() {
                        l.push(crossed.elapsed());
                    }
                }
                (_, pending) => r.crossed_at = pending,
            }
        }
        self.changed.notify_waiters();
    }

    /// Reclaim latencies measured so far.
    pub fn reclaim_latencies(&self) -> Vec<Duration> {
        self.reclaim_latencies
            .lock()
            .map(|l| l.clone())
            .unwrap_or_default()
    }

    /// Admits `n` records: waits for their tokens at the rate in force; while paused or
    /// held, waits. A change while waiting applies to the rest of `n`. Returns false when
    /// the operator stops the backfill.
    pub async fn admit_records(&self, mut n: u64) -> bool {
        while n > 0 {
            let (limiter, rate, generation, operator) = {
                let Ok(mut r) = self.records.lock() else {
                    return true;
                };
                if r.operator == Operator::Run
                    && let Some(crossed) = r.crossed_at.take()
                    && let Ok(mut l) = self.reclaim_latencies.lock()
                {
                    l.push(crossed.elapsed());
                }
                (r.limiter.clone(), r.rate, r.generation, r.operator)
            };
            match (operator, rate, limiter) {
                (Operator::Stop, _, _) => return false,
                (Operator::Run, None, _) => return true,
                (Operator::Run, Some(rate), Some(limiter)) if rate > 0 => {
                    // Small pieces, so that a lower rate applies within a fraction of a second.
                    let piece = n.min(u64::from((rate / 10).max(1)));
                    let changed = self.changed.notified();
                    tokio::select! {
                        _ = take(&limiter.0, limiter.1, piece) => n -= piece,
                        _ = changed => {}
                    }
                }
                // Held by the operator, or paused by the controller: wait for a change.
                _ => {
                    let changed = self.changed.notified();
                    tokio::pin!(changed);
                    changed.as_mut().enable();
                    if self.records.lock().map(|r| r.generation).unwrap_or(0) != generation {
                        continue;
                    }
                    changed.await;
                }
            }
        }
        true
    }

    /// What the operator wants of admissions: [`Operator::Hold`] makes them wait (a pause
    /// in force within one piece, even mid-batch), [`Operator::Stop`] fails them (abort).
    pub fn set_operator(&self, operator: Operator) {
        if let Ok(mut r) = self.records.lock()
            && r.operator != operator
        {
            r.operator = operator;
            r.generation += 1;
        }
        self.changed.notify_waiters();
    }

    /// Stops the reclaim-latency clock at a budget request other than records.
    fn met(&self) {
        if let Ok(mut r) = self.records.lock()
            && let Some(crossed) = r.crossed_at.take()
            && let Ok(mut l) = self.reclaim_latencies.lock()
        {
            l.push(crossed.elapsed());
        }
    }

    /// Admits `n` bytes read.
    pub async fn admit_bytes(&self, n: u64) {
        self.met();
        if let Some((l, burst)) = &self.bytes {
            take(l, *burst, n).await;
        }
    }

    /// Admits `n` rows written.
    pub async fn admit_rows(&self, n: u64) {
        self.met();
        if let Some((l, burst)) = &self.rows {
            take(l, *burst, n).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(at: Instant, queue_age_s: f64) -> GuardReading {
        GuardReading {
            at,
            queue_age_s,
            watermark_delay_s: 0.0,
            checkpoint_age_s: 0.0,
            sink_commit_s: 0.0,
        }
    }

    fn controller(floor: u32, ceiling: Option<u32>) -> Controller {
        Controller::new(
            Guards::default(),
            Budgets {
                records_per_sec: ceiling,
                floor_records_per_sec: floor,
                ..Budgets::default()
            },
        )
    }

    #[test]
    fn a_crossed_guard_cuts_to_the_floor_once() {
        let mut c = controller(1_000, Some(100_000));
        let t0 = Instant::now();
        let d = c.observe(Some(&reading(t0, 3.0)), t0).expect("reclaim");
        assert_eq!((d.action, d.rate), ("reclaim", Some(1_000)));
        assert!(d.cause.starts_with("queue_age 3.00 s > 2 s"), "{}", d.cause);
        assert_eq!(d.crossed_at, Some(t0));
        assert_eq!(c.observe(Some(&reading(t0, 5.0)), t0), None);
        assert_eq!(c.rate(), Some(1_000));
    }

    #[test]
    fn borrowing_waits_for_clear_guards_and_doubles_to_the_ceiling() {
        let mut c = controller(1_000, Some(40_000));
        let t0 = Instant::now();
        c.observe(Some(&reading(t0, 3.0)), t0);
        // In the hysteresis band (below the threshold, above half of it): hold.
        let t = t0 + Duration::from_secs(10);
        assert_eq!(c.observe(Some(&reading(t, 1.5)), t), None);
        // Clear, but not for long enough.
        let t1 = t + Duration::from_secs(1);
        assert_eq!(c.observe(Some(&reading(t1, 0.1)), t1), None);
        let mut rates = Vec::new();
        let mut now = t1;
        for _ in 0..20 {
            now += Duration::from_secs(1);
            if let Some(d) = c.observe(Some(&reading(now, 0.1)), now) {
                rates.push((d.action, d.rate));
            }
        }
        assert_eq!(
            rates,
            vec![
                ("borrow", Some(5_000)),
                ("borrow", Some(10_000)),
                ("borrow", Some(20_000)),
                ("full", Some(40_000)),
            ]
        );
        // A crossing during the climb, or at full speed, cuts again.
        now += Duration::from_secs(1);
        let d = c.observe(Some(&reading(now, 2.5)), now).expect("reclaim");
        assert_eq!(d.rate, Some(1_000));
    }

    #[test]
    fn nothing_is_admitted_before_the_first_reading() {
        let t0 = Instant::now();
        let mut c = controller(1_000, Some(40_000));
        assert_eq!(c.rate(), Some(0));
        let d = c.observe(Some(&reading(t0, 0.1)), t0).expect("full");
        assert_eq!((d.action, d.rate), ("full", Some(40_000)));
        // In the hysteresis band at the start: the floor, until the guards clear.
        let mut c = controller(1_000, Some(40_000));
        let d = c.observe(Some(&reading(t0, 1.5)), t0).expect("reclaim");
        assert_eq!((d.action, d.rate), ("reclaim", Some(1_000)));
        // Unreadable at the start: the floor, as when crossed.
        let mut c = controller(0, None);
        let d = c.observe(None, t0).expect("reclaim");
        assert_eq!(d.rate, Some(0));
    }

    #[test]
    fn an_unreadable_or_stale_status_counts_as_crossed() {
        let mut c = controller(0, None);
        let t0 = Instant::now();
        let d = c.observe(None, t0).expect("reclaim");
        assert_eq!(
            (d.rate, d.cause.as_str()),
            (Some(0), "live status unavailable")
        );
        let mut c = controller(0, None);
        let later = t0 + Duration::from_secs(6);
        let d = c.observe(Some(&reading(t0, 0.0)), later).expect("reclaim");
        assert!(d.cause.contains("old"), "{}", d.cause);
    }

    #[tokio::test]
    async fn the_operator_holds_and_stops_admissions_mid_batch() {
        let t = Arc::new(Throttle::new(&Budgets {
            records_per_sec: Some(1_000),
            ..Budgets::default()
        }));
        let batch = {
            let t = Arc::clone(&t);
            tokio::spawn(async move { t.admit_records(8_192).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        t.set_operator(Operator::Hold);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!batch.is_finished(), "held");
        t.set_operator(Operator::Stop);
        let admitted = tokio::time::timeout(Duration::from_secs(1), batch)
            .await
            .expect("a stop is in force at once")
            .expect("join");
        assert!(!admitted, "a stopped admission fails");
    }

    #[tokio::test]
    async fn a_new_rate_comes_without_a_free_burst() {
        let t = Throttle::new(&Budgets {
            records_per_sec: Some(10_000),
            ..Budgets::default()
        });
        let start = Instant::now();
        t.admit_records(3_000).await;
        t.set_rate(Some(10_000), None);
        t.admit_records(3_000).await;
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(550),
            "6,000 records at 10,000/s took {took:?}"
        );
    }

    #[tokio::test]
    async fn the_throttle_pauses_and_measures_the_reclaim_latency() {
        let t = Arc::new(Throttle::new(&Budgets::default()));
        t.admit_records(1_000_000).await; // unlimited
        t.set_rate(Some(0), Some(Instant::now()));
        let waiting = {
            let t = Arc::clone(&t);
            tokio::spawn(async move { t.admit_records(100).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiting.is_finished(), "paused: no admission");
        assert_eq!(
            t.reclaim_latencies().len(),
            1,
            "a pause is in force at once"
        );
        t.set_rate(Some(100_000), None);
        tokio::time::timeout(Duration::from_secs(2), waiting)
            .await
            .expect("resumed")
            .expect("join");
        // A cut to a non-zero floor counts at the first admission under it.
        t.set_rate(Some(50_000), Some(Instant::now()));
        assert_eq!(t.reclaim_latencies().len(), 1);
        t.admit_records(10).await;
        assert_eq!(t.reclaim_latencies().len(), 2);
    }
}
