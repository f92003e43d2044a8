//! Notification job specs (`jobs/notifications.toml`): which job's outputs to watch,
//! the rules that decide a customer must be notified, how to dispatch, and how long the
//! ledger remembers effect ids.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use signalweave_model::ErrorKind;
use signalweave_window::micros;

use crate::error::{EffectError, Result};

/// A notification job.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NotificationSpec {
    /// Job name (the effect ids' namespace).
    pub name: String,
    /// Spec version.
    pub version: u32,
    /// Always `notification` (window job specs have no `kind`).
    pub kind: String,
    /// What it does.
    #[serde(default)]
    pub description: Option<String>,
    /// The outputs it reads.
    pub source: NotificationSource,
    /// The rules.
    pub rules: Vec<Rule>,
    /// Dispatch to the provider.
    #[serde(default)]
    pub dispatch: DispatchSpec,
    /// The ledger.
    pub ledger: LedgerSpec,
}

/// The outputs a notification job reads.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NotificationSource {
    /// The window job whose output versions it reads (live, or a backfill's namespace).
    pub job: String,
}

/// A rule: notify a customer when an output column reaches a threshold.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Rule name (part of the effect id).
    pub name: String,
    /// The output column compared.
    pub column: String,
    /// Notify when the column is at least this.
    pub threshold: i64,
    /// At most one notification per key and cooldown bucket of window start: the effect
    /// id is (job, rule, key, bucket), so a window's later versions, overlapping sliding
    /// windows and every replay name the same effect.
    #[serde(with = "humantime_serde")]
    pub cooldown: Duration,
    /// Message template: `{key}`, `{value}`, `{window_start}` are replaced.
    pub message: String,
}

/// Dispatch settings.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DispatchSpec {
    /// One request's timeout: past it the outcome is ambiguous.
    #[serde(with = "humantime_serde", default = "default_timeout")]
    pub timeout: Duration,
    /// Retries stop this long after the first attempt (the effect then fails).
    #[serde(with = "humantime_serde", default = "default_deadline")]
    pub deadline: Duration,
    /// First backoff; doubles per attempt.
    #[serde(with = "humantime_serde", default = "default_backoff")]
    pub initial_backoff: Duration,
    /// Requests in flight at once.
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// Effects claimed (made `dispatching`) and settled per ledger transaction. A crash
    /// leaves at most one batch `dispatching`: asked about at the restart, or ambiguous
    /// where the provider cannot be asked.
    #[serde(default = "default_batch")]
    pub batch: usize,
    /// Whether the provider answers `GET /v1/notifications/{idempotency key}`: an
    /// ambiguous outcome is then resolved by asking, otherwise left for reconciliation.
    #[serde(default = "default_true")]
    pub provider_lookup: bool,
    /// Whether the provider honours idempotency keys (delivers a key once): an ambiguous
    /// outcome without a lookup is then retried with the same key; otherwise it stays
    /// `ambiguous` and is never sent again blindly.
    #[serde(default = "default_true")]
    pub provider_idempotent: bool,
}

fn default_timeout() -> Duration {
    Duration::from_secs(2)
}
fn default_deadline() -> Duration {
    Duration::from_secs(60)
}
fn default_backoff() -> Duration {
    Duration::from_millis(100)
}
fn default_concurrency() -> usize {
    16
}
fn default_batch() -> usize {
    64
}
fn default_true() -> bool {
    true
}

impl Default for DispatchSpec {
    fn default() -> Self {
        Self {
            timeout: default_timeout(),
            deadline: default_deadline(),
            initial_backoff: default_backoff(),
            concurrency: default_concurrency(),
            batch: default_batch(),
            provider_lookup: true,
            provider_idempotent: true,
        }
    }
}

/// The ledger's dedup horizon.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LedgerSpec {
    /// How long settled effect ids are kept. Must cover the source's replay horizon, its
    /// allowed lateness and the backfill horizon: an output re-emitted within it finds
    /// its effect id and is not sent again.
    #[serde(with = "humantime_serde")]
    pub retention: Duration,
    /// How far back a backfill may replay (part of the required retention).
    #[serde(with = "humantime_serde")]
    pub backfill_horizon: Duration,
}

impl NotificationSpec {
    /// Reads and checks a spec.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            EffectError::new(
                ErrorKind::NotFound,
                format!("cannot read {}: {e}", path.display()),
            )
        })?;
        Self::from_toml(&text)
            .map_err(|e| EffectError::new(e.kind(), format!("{}: {e}", path.display())))
    }

    /// Parses and checks a spec.
    pub fn from_toml(text: &str) -> Result<Self> {
        let spec: NotificationSpec = toml::from_str(text)
            .map_err(|e| EffectError::new(ErrorKind::InvalidInput, format!("spec: {e}")))?;
        if spec.kind != "notification" {
            return Err(EffectError::new(
                ErrorKind::InvalidInput,
                "kind must be \"notification\"",
            ));
        }
        if spec.rules.is_empty() {
            return Err(EffectError::new(
                ErrorKind::InvalidInput,
                "rules: at least one rule",
            ));
        }
        for (i, r) in spec.rules.iter().enumerate() {
            if r.cooldown.is_zero() {
                return Err(EffectError::new(
                    ErrorKind::InvalidInput,
                    format!("rules[{i}].cooldown must be positive"),
                ));
            }
        }
        if spec.dispatch.concurrency == 0 || spec.dispatch.batch == 0 {
            return Err(EffectError::new(
                ErrorKind::InvalidInput,
                "dispatch.concurrency and dispatch.batch must be positive",
            ));
        }
        Ok(spec)
    }

    /// The retention the ledger needs for a source job with `replay_horizon` and
    /// `allowed_lateness`: replay + lateness + backfill horizon.
    pub fn required_retention(
        &self,
        replay_horizon: Duration,
        allowed_lateness: Duration,
    ) -> Duration {
        replay_horizon + allowed_lateness + self.ledger.backfill_horizon
    }

    /// Checks the ledger's retention against the source job's horizons.
    pub fn check_retention(
        &self,
        replay_horizon: Duration,
        allowed_lateness: Duration,
    ) -> Result<()> {
        let need = self.required_retention(replay_horizon, allowed_lateness);
        if self.ledger.retention < need {
            return Err(EffectError::new(
                ErrorKind::Config,
                format!(
                    "ledger.retention {} is shorter than the source's replay horizon + allowed \
                     lateness + backfill horizon ({}): a replayed output could be sent again",
                    humantime::format_duration(self.ledger.retention),
                    humantime::format_duration(need)
                ),
            ));
        }
        Ok(())
    }
}

/// The stable id of a logical effect: from (job, rule, key, cooldown bucket of the
/// window start), never from a delivery attempt.
pub fn effect_id(job: &str, rule: &Rule, key: &str, window_start_us: i64) -> String {
    let cooldown = micros(rule.cooldown).max(1);
    let bucket = window_start_us.div_euclid(cooldown);
    let mut h = Sha256::new();
    for part in [job, rule.name.as_str(), key, &bucket.to_string()] {
        h.update(part.as_bytes());
        h.update([0u8]);
    }
    format!("eff-{}", &hex::encode(h.finalize())[..32])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> NotificationSpec {
        NotificationSpec::from_file(Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../jobs/notifications.toml"
        )))
        .unwrap()
    }

    #[test]
    fn effect_ids_are_stable_per_bucket_and_differ_across_keys_and_rules() {
        let s = spec();
        let r = &s.rules[0];
        let minute = 60_000_000;
        let a = effect_id(&s.name, r, "c-1", 0);
        assert_eq!(
            a,
            effect_id(&s.name, r, "c-1", 3 * minute),
            "same 10-minute bucket"
        );
        assert_ne!(a, effect_id(&s.name, r, "c-1", 10 * minute));
        assert_ne!(a, effect_id(&s.name, r, "c-2", 0));
        let mut other = r.clone();
        other.name = "other".into();
        assert_ne!(a, effect_id(&s.name, &other, "c-1", 0));
    }

    #[test]
    fn the_ledger_must_outlive_replay_lateness_and_backfills() {
        let s = spec();
        s.check_retention(Duration::from_secs(3600), Duration::from_secs(7200))
            .unwrap();
        let e = s
            .check_retention(Duration::from_secs(100 * 3600), Duration::from_secs(7200))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        let bad = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../jobs/notifications.toml"
        ))
        .unwrap()
        .replace("kind = \"notification\"", "kind = \"window\"");
        assert_eq!(
            NotificationSpec::from_toml(&bad).unwrap_err().kind(),
            ErrorKind::InvalidInput
        );
    }
}
