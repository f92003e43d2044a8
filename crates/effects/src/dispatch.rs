//! Dispatch: effects to the provider over HTTP, the effect id as the idempotency key.
//!
//! - 2xx: `delivered`. 4xx other than 408/429: `failed` (the provider refused it).
//! - Not sent (connection refused), 5xx, 408, 429: retried with exponential backoff until
//!   the deadline from the first attempt, then `failed`.
//! - Sent, outcome unknown (timeout, connection reset, a response that does not parse):
//!   ambiguous. With `provider_lookup`, the provider is asked (`GET
//!   /v1/notifications/{key}`): delivered, or not received and retried. Otherwise, if the
//!   provider honours idempotency keys, it is retried with the same key; if not, it stays
//!   `ambiguous` for `effects reconcile`: never sent again blindly.
//! - At start, effects a dead dispatcher left `dispatching` are resolved the same way.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use signalweave_model::ErrorKind;

use crate::error::{EffectError, Result};
use crate::ledger::{Effect, Ledger, fault_point, state};
use crate::spec::DispatchSpec;

/// Header carrying the effect id.
pub const IDEMPOTENCY_HEADER: &str = "Idempotency-Key";

/// What the provider says of one idempotency key (`GET /v1/notifications/{key}`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Lookup {
    /// The key.
    pub key: String,
    /// Times the provider delivered a notification with it.
    pub deliveries: u64,
    /// The provider's reference of the first delivery.
    pub reference: Option<String>,
}

/// The notification sent.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Notification {
    /// The recipient (the key the rule watches: a customer).
    pub recipient: String,
    /// The text.
    pub message: String,
    /// The rule that decided it.
    pub rule: String,
}

/// What one dispatch pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DispatchReport {
    /// Delivered.
    pub delivered: u64,
    /// Scheduled again.
    pub retried: u64,
    /// Failed for good.
    pub failed: u64,
    /// Left ambiguous.
    pub ambiguous: u64,
}

/// Sends effects to one provider.
#[derive(Debug, Clone)]
pub struct Dispatcher {
    ledger: Ledger,
    job: String,
    provider: String,
    spec: DispatchSpec,
    client: reqwest::Client,
}

enum Outcome {
    Delivered(u16, String),
    Refused(u16, String),
    Retry(String),
    Ambiguous(String),
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

impl Dispatcher {
    /// A dispatcher of `job`'s live effects to `provider` (`http://host:port`).
    pub fn new(ledger: Ledger, job: &str, provider: &str, spec: DispatchSpec) -> Result<Self> {
        let client = reqwest::Client::builder()
            .timeout(spec.timeout)
            .build()
            .map_err(|e| EffectError::new(ErrorKind::Config, format!("HTTP client: {e}")))?;
        Ok(Self {
            ledger,
            job: job.to_string(),
            provider: provider.trim_end_matches('/').to_string(),
            spec,
            client,
        })
    }

    /// Asks the provider about `key`: None when it cannot answer.
    pub async fn lookup(&self, key: &str) -> Option<Lookup> {
        let url = format!("{}/v1/notifications/{key}", self.provider);
        let resp = self.client.get(&url).send().await.ok()?;
        match resp.status().as_u16() {
            200 => serde_json::from_slice(&resp.bytes().await.ok()?).ok(),
            404 => Some(Lookup {
                key: key.to_string(),
                deliveries: 0,
                reference: None,
            }),
            _ => None,
        }
    }

    async fn send(&self, effect: &Effect) -> Outcome {
        let body = Notification {
            recipient: effect.key.clone(),
            message: effect.message.clone(),
            rule: effect.rule.clone(),
        };
        let Ok(bytes) = serde_json::to_vec(&body) else {
            return Outcome::Refused(0, "cannot encode".into());
        };
        let sent = self
            .client
            .post(format!("{}/v1/notifications", self.provider))
            .header(IDEMPOTENCY_HEADER, &effect.effect_id)
            .header("content-type", "application/json")
            .body(bytes)
            .send()
            .await;
        let resp = match sent {
            Ok(r) => r,
            Err(e) if e.is_connect() => return Outcome::Retry(format!("not sent: {e}")),
            Err(e) => return Outcome::Ambiguous(format!("sent, no answer: {e}")),
        };
        let status = resp.status().as_u16();
        let text = match resp.text().await {
            Ok(t) => t,
            Err(e) => return Outcome::Ambiguous(format!("answer {status} lost: {e}")),
        };
        fault_point("during_dispatch");
        match status {
            200..=299 => Outcome::Delivered(status, text),
            408 | 429 | 500..=599 => Outcome::Retry(format!("{status}: {text}")),
            _ => Outcome::Refused(status, text),
        }
    }

    /// When the effect may be retried, or None past the deadline.
    async fn retry_at(&self, effect: &Effect) -> Result<Option<i64>> {
        let first = self
            .ledger
            .first_attempt_ms(&effect.effect_id)
            .await?
            .unwrap_or_else(now_ms);
        let exp = (effect.attempts.max(1) - 1).min(16) as u32;
        let backoff = self.spec.initial_backoff.as_millis() as i64 * (1i64 << exp);
        let at = now_ms() + backoff.min(10_000);
        Ok((at <= first + self.spec.deadline.as_millis() as i64).then_some(at))
    }

    /// An outcome that was sent but is unknown: ask, retry with the same key, or leave it.
    async fn resolve_ambiguous(
        &self,
        effect: &Effect,
        attempt: i64,
        why: &str,
    ) -> Result<&'static str> {
        if self.spec.provider_lookup
            && let Some(l) = self.lookup(&effect.effect_id).await
        {
            if l.deliveries > 0 {
                self.ledger
                    .settle(
                        &effect.effect_id,
                        attempt,
                        state::DELIVERED,
                        "delivered (provider lookup)",
                        None,
                        l.reference.as_deref().or(Some("")),
                        None,
                    )
                    .await?;
                return Ok(state::DELIVERED);
            }
            // The provider never received it: sending again cannot duplicate it.
            return self.schedule_retry(effect, attempt, why).await;
        }
        if self.spec.provider_idempotent && !self.spec.provider_lookup {
            return self.schedule_retry(effect, attempt, why).await;
        }
        self.ledger
            .settle(
                &effect.effect_id,
                attempt,
                state::AMBIGUOUS,
                "ambiguous",
                None,
                Some(why),
                None,
            )
            .await?;
        Ok(state::AMBIGUOUS)
    }

    async fn schedule_retry(
        &self,
        effect: &Effect,
        attempt: i64,
        why: &str,
    ) -> Result<&'static str> {
        match self.retry_at(effect).await? {
            Some(at) => {
                self.ledger
                    .settle(
                        &effect.effect_id,
                        attempt,
                        state::INTENDED,
                        "retry",
                        None,
                        Some(why),
                        Some(at),
                    )
                    .await?;
                Ok(state::INTENDED)
            }
            None => {
                self.ledger
                    .settle(
                        &effect.effect_id,
                        attempt,
                        state::FAILED,
                        "deadline",
                        None,
                        Some(&format!("deadline passed; last: {why}")),
                        None,
                    )
                    .await?;
                Ok(state::FAILED)
            }
        }
    }

    async fn dispatch_one(&self, effect: Effect, attempt: i64) -> Result<&'static str> {
        match self.send(&effect).await {
            Outcome::Delivered(status, answer) => {
                fault_point("after_delivery");
                self.ledger
                    .settle(
                        &effect.effect_id,
                        attempt,
                        state::DELIVERED,
                        "delivered",
                        Some(status),
                        Some(&answer),
                        None,
                    )
                    .await?;
                Ok(state::DELIVERED)
            }
            Outcome::Refused(status, answer) => {
                self.ledger
                    .settle(
                        &effect.effect_id,
                        attempt,
                        state::FAILED,
                        "refused",
                        Some(status),
                        Some(&answer),
                        None,
                    )
                    .await?;
                Ok(state::FAILED)
            }
            Outcome::Retry(why) => self.schedule_retry(&effect, attempt, &why).await,
            Outcome::Ambiguous(why) => self.resolve_ambiguous(&effect, attempt, &why).await,
        }
    }

    /// Resolves the effects a dead dispatcher left `dispatching` (call once, before
    /// dispatching: one dispatcher runs a job at a time).
    pub async fn recover(&self) -> Result<DispatchReport> {
        let mut report = DispatchReport::default();
        for effect in self
            .ledger
            .effects(&self.job, "live", Some(state::DISPATCHING))
            .await?
        {
            let attempt = effect.attempts;
            let s = self
                .resolve_ambiguous(
                    &effect,
                    attempt,
                    "the dispatcher stopped during the attempt",
                )
                .await?;
            report.count(s);
        }
        Ok(report)
    }

    /// One pass: claims the due effects (up to the concurrency) and sends them at once.
    pub async fn pass(self: &Arc<Self>) -> Result<DispatchReport> {
        let claimed = self.ledger.claim(&self.job, self.spec.concurrency).await?;
        let mut tasks = tokio::task::JoinSet::new();
        for (effect, attempt) in claimed {
            let me = Arc::clone(self);
            tasks.spawn(async move { me.dispatch_one(effect, attempt).await });
        }
        let mut report = DispatchReport::default();
        while let Some(r) = tasks.join_next().await {
            let s = r.map_err(|e| {
                EffectError::new(ErrorKind::Internal, format!("dispatch task: {e}"))
            })??;
            report.count(s);
        }
        Ok(report)
    }

    /// Whether effects remain to send now or later (`intended` or `dispatching`).
    pub async fn pending(&self) -> Result<u64> {
        let counts = self.ledger.counts(&self.job, "live").await?;
        Ok(counts.get(state::INTENDED).copied().unwrap_or(0)
            + counts.get(state::DISPATCHING).copied().unwrap_or(0))
    }

    /// Passes until nothing is pending, or `max_wait` passes without progress.
    pub async fn until_settled(self: &Arc<Self>, max_wait: Duration) -> Result<DispatchReport> {
        let mut total = DispatchReport::default();
        let mut idle_since = tokio::time::Instant::now();
        loop {
            let r = self.pass().await?;
            let did = r.delivered + r.failed + r.ambiguous + r.retried;
            total.add(r);
            if self.pending().await? == 0 {
                return Ok(total);
            }
            if did > 0 {
                idle_since = tokio::time::Instant::now();
            } else if idle_since.elapsed() > max_wait {
                return Ok(total);
            } else {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

impl DispatchReport {
    fn count(&mut self, s: &str) {
        match s {
            state::DELIVERED => self.delivered += 1,
            state::FAILED => self.failed += 1,
            state::AMBIGUOUS => self.ambiguous += 1,
            _ => self.retried += 1,
        }
    }

    fn add(&mut self, o: DispatchReport) {
        self.delivered += o.delivered;
        self.retried += o.retried;
        self.failed += o.failed;
        self.ambiguous += o.ambiguous;
    }
}
