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
use futures::StreamExt;

use crate::ledger::{Effect, Ledger, Settlement, fault_point, state};
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
    fn retry_at(&self, effect: &Effect) -> Option<i64> {
        let first = effect.first_attempt_ms.unwrap_or_else(now_ms);
        let exp = (effect.attempts.max(1) - 1).min(16) as u32;
        let backoff = self.spec.initial_backoff.as_millis() as i64 * (1i64 << exp);
        let at = now_ms() + backoff.min(10_000);
        (at <= first + self.spec.deadline.as_millis() as i64).then_some(at)
    }

    fn settlement(
        effect: &Effect,
        attempt: i64,
        state: &'static str,
        outcome: &str,
        http_status: Option<u16>,
        answer: Option<String>,
    ) -> Settlement {
        Settlement {
            effect_id: effect.effect_id.clone(),
            attempt,
            state,
            outcome: outcome.to_string(),
            http_status,
            answer,
            retry_at_ms: None,
        }
    }

    /// An outcome that was sent but is unknown: ask, retry with the same key, or leave it.
    async fn resolve_ambiguous(&self, effect: &Effect, attempt: i64, why: &str) -> Settlement {
        if self.spec.provider_lookup
            && let Some(l) = self.lookup(&effect.effect_id).await
        {
            if l.deliveries > 0 {
                return Self::settlement(
                    effect,
                    attempt,
                    state::DELIVERED,
                    "delivered (provider lookup)",
                    None,
                    Some(l.reference.unwrap_or_default()),
                );
            }
            // The provider never received it: sending again cannot duplicate it.
            return self.retry(effect, attempt, why);
        }
        // No answer to the lookup (or none offered): a provider that honours the key makes
        // sending again safe, so it is retried until the deadline rather than left
        // ambiguous because the provider was briefly unreachable.
        if self.spec.provider_idempotent {
            return self.retry(effect, attempt, why);
        }
        Self::settlement(
            effect,
            attempt,
            state::AMBIGUOUS,
            "ambiguous",
            None,
            Some(why.into()),
        )
    }

    fn retry(&self, effect: &Effect, attempt: i64, why: &str) -> Settlement {
        match self.retry_at(effect) {
            Some(at) => Settlement {
                retry_at_ms: Some(at),
                ..Self::settlement(
                    effect,
                    attempt,
                    state::INTENDED,
                    "retry",
                    None,
                    Some(why.into()),
                )
            },
            None => Self::settlement(
                effect,
                attempt,
                state::FAILED,
                "deadline",
                None,
                Some(format!("deadline passed; last: {why}")),
            ),
        }
    }

    async fn dispatch_one(&self, effect: Effect, attempt: i64) -> Settlement {
        match self.send(&effect).await {
            Outcome::Delivered(status, answer) => {
                fault_point("after_delivery");
                Self::settlement(
                    &effect,
                    attempt,
                    state::DELIVERED,
                    "delivered",
                    Some(status),
                    Some(answer),
                )
            }
            Outcome::Refused(status, answer) => Self::settlement(
                &effect,
                attempt,
                state::FAILED,
                "refused",
                Some(status),
                Some(answer),
            ),
            Outcome::Retry(why) => Settlement {
                http_status: why.get(..3).and_then(|c| c.parse().ok()),
                ..self.retry(&effect, attempt, &why)
            },
            Outcome::Ambiguous(why) => self.resolve_ambiguous(&effect, attempt, &why).await,
        }
    }

    /// Resolves the effects a dead dispatcher left `dispatching` (call once, before
    /// dispatching: one dispatcher runs a job at a time).
    pub async fn recover(&self) -> Result<DispatchReport> {
        let mut report = DispatchReport::default();
        let mut settled = Vec::new();
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
                .await;
            report.count(s.state);
            settled.push(s);
        }
        self.ledger.settle_all(&settled).await?;
        Ok(report)
    }

    /// One pass: claims a batch of due effects in one transaction, sends them with at
    /// most `concurrency` in flight, and settles them in one transaction.
    pub async fn pass(self: &Arc<Self>) -> Result<DispatchReport> {
        let claimed = self.ledger.claim(&self.job, self.spec.batch).await?;
        let settled: Vec<Settlement> = futures::stream::iter(claimed)
            .map(|(effect, attempt)| {
                let me = Arc::clone(self);
                async move { me.dispatch_one(effect, attempt).await }
            })
            .buffer_unordered(self.spec.concurrency)
            .collect()
            .await;
        let mut report = DispatchReport::default();
        for s in &settled {
            report.count(s.state);
        }
        self.ledger.settle_all(&settled).await?;
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
