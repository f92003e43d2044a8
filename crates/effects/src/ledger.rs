//! The effect ledger (outbox) in the catalog database.
//!
//! One row per logical effect in `sw_effects`, keyed by (catalog, namespace, effect id);
//! every delivery attempt in `sw_effect_attempts`; the notifier's source position in
//! `sw_effect_positions`. A notifier records its intents and its new position in one
//! transaction, so a crash before it commits re-reads the same outputs and derives the
//! same effect ids, and a crash after it finds them recorded.
//!
//! States: `intended` → `dispatching` → `delivered` | `failed` | `ambiguous` →
//! `reconciled`; `would_send` for a backfill namespace (never dispatched).

use std::collections::BTreeMap;

use serde::Serialize;
use signalweave_lake::Lake;
use signalweave_model::ErrorKind;
use sqlx::Row;

use crate::error::{EffectError, Result};

/// A logical effect the notifier decided on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Intent {
    /// Stable id (see [`crate::effect_id`]).
    pub effect_id: String,
    /// Rule.
    pub rule: String,
    /// The key notified (customer).
    pub key: String,
    /// Window start of the triggering output, µs.
    pub window_start_us: i64,
    /// The value that crossed the threshold.
    pub value: i64,
    /// The message.
    pub message: String,
    /// Largest event time of the triggering output version, µs.
    pub trigger_event_us: i64,
    /// Output table snapshot the notifier read it from.
    pub source_snapshot: i64,
    /// The rule's cooldown, µs: an intent whose key already has an effect of the rule with
    /// a window start less than this far from its own is not recorded (0: none).
    pub cooldown_us: i64,
}

/// An effect as the ledger holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Effect {
    /// Id.
    pub effect_id: String,
    /// Namespace.
    pub namespace: String,
    /// Rule.
    pub rule: String,
    /// Key.
    pub key: String,
    /// Message.
    pub message: String,
    /// State.
    pub state: String,
    /// Attempts made.
    pub attempts: i64,
    /// Largest event time of the triggering output, µs.
    pub trigger_event_us: i64,
    /// Created, ms.
    pub created_ms: i64,
    /// Delivered, ms.
    pub delivered_ms: Option<i64>,
    /// The provider's reference of the delivery.
    pub provider_ref: Option<String>,
    /// Last error.
    pub last_error: Option<String>,
    /// First attempt, ms.
    pub first_attempt_ms: Option<i64>,
}

/// How one dispatch attempt ended, for [`Ledger::settle_all`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settlement {
    /// Effect.
    pub effect_id: String,
    /// Attempt number.
    pub attempt: i64,
    /// New state.
    pub state: &'static str,
    /// The attempt's outcome.
    pub outcome: String,
    /// HTTP status, if answered.
    pub http_status: Option<u16>,
    /// The provider's answer (delivered: its reference) or the error.
    pub answer: Option<String>,
    /// Back to `intended`, due at this time (ms).
    pub retry_at_ms: Option<i64>,
}

/// Effect states.
pub mod state {
    /// Decided, not yet dispatched (or due for a retry).
    pub const INTENDED: &str = "intended";
    /// A request is (or was, if the dispatcher died) in flight.
    pub const DISPATCHING: &str = "dispatching";
    /// The provider confirmed it.
    pub const DELIVERED: &str = "delivered";
    /// Refused by the provider, or out of retries.
    pub const FAILED: &str = "failed";
    /// Sent, outcome unknown, and the provider cannot be asked.
    pub const AMBIGUOUS: &str = "ambiguous";
    /// Resolved by `effects reconcile`.
    pub const RECONCILED: &str = "reconciled";
    /// A backfill's effect: recorded for comparison, never sent.
    pub const WOULD_SEND: &str = "would_send";
    /// Its subject was erased before it was settled: never sent (again).
    pub const ERASED: &str = "erased";
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// The ledger of one catalog.
#[derive(Debug, Clone)]
pub struct Ledger {
    lake: Lake,
    catalog: String,
}

/// Where a notifier may simulate a crash (`SIGNALWEAVE_EFFECT_FAULT`): it logs
/// `fault point <name> reached` and waits to be killed.
pub fn fault_point(name: &str) {
    if std::env::var("SIGNALWEAVE_EFFECT_FAULT").ok().as_deref() == Some(name) {
        eprintln!("fault point {name} reached");
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
}

impl Ledger {
    /// Opens the ledger, creating its tables if missing.
    pub async fn open(lake: Lake) -> Result<Self> {
        let catalog = lake.config().catalog_name.clone();
        for ddl in [
            "CREATE TABLE IF NOT EXISTS sw_effects (catalog_name VARCHAR(255) NOT NULL, \
             namespace VARCHAR(255) NOT NULL, effect_id VARCHAR(64) NOT NULL, job VARCHAR(255) NOT NULL, \
             rule VARCHAR(255) NOT NULL, effect_key VARCHAR(255) NOT NULL, window_start_us BIGINT NOT NULL, \
             value BIGINT NOT NULL, message TEXT NOT NULL, trigger_event_us BIGINT NOT NULL, \
             source_snapshot BIGINT NOT NULL, state VARCHAR(32) NOT NULL, attempts BIGINT NOT NULL, \
             next_attempt_ms BIGINT NOT NULL, first_attempt_ms BIGINT, created_ms BIGINT NOT NULL, \
             updated_ms BIGINT NOT NULL, delivered_ms BIGINT, provider_ref TEXT, last_error TEXT, \
             PRIMARY KEY (catalog_name, namespace, effect_id))",
            "CREATE TABLE IF NOT EXISTS sw_effect_attempts (catalog_name VARCHAR(255) NOT NULL, \
             namespace VARCHAR(255) NOT NULL, effect_id VARCHAR(64) NOT NULL, attempt BIGINT NOT NULL, \
             started_ms BIGINT NOT NULL, finished_ms BIGINT, outcome VARCHAR(32) NOT NULL, \
             http_status BIGINT, answer TEXT, PRIMARY KEY (catalog_name, namespace, effect_id, attempt))",
            "CREATE TABLE IF NOT EXISTS sw_effect_positions (catalog_name VARCHAR(255) NOT NULL, \
             job VARCHAR(255) NOT NULL, namespace VARCHAR(255) NOT NULL, position BIGINT NOT NULL, \
             updated_ms BIGINT NOT NULL, PRIMARY KEY (catalog_name, job, namespace))",
            "CREATE TABLE IF NOT EXISTS sw_effect_leases (catalog_name VARCHAR(255) NOT NULL, \
             job VARCHAR(255) NOT NULL, namespace VARCHAR(255) NOT NULL, owner VARCHAR(255) NOT NULL, \
             lease_until_ms BIGINT NOT NULL, PRIMARY KEY (catalog_name, job, namespace))",
            "CREATE INDEX IF NOT EXISTS sw_effects_by_key ON sw_effects \
             (catalog_name, namespace, job, rule, effect_key, window_start_us)",
        ] {
            sqlx::query(ddl)
                .execute(lake.control_pool())
                .await
                .map_err(|e| EffectError::sql("create the effect ledger", e))?;
        }
        Ok(Self { lake, catalog })
    }

    fn sql(&self, s: &str) -> String {
        self.lake.control_sql(s)
    }

    /// Takes or renews the lease of (job, namespace) for `owner` until `ttl` from now: one
    /// runner (notifier and dispatcher) per job and namespace. Fails with `Conflict`,
    /// naming the holder, while another owner's lease has not expired.
    pub async fn lease(
        &self,
        job: &str,
        namespace: &str,
        owner: &str,
        ttl: std::time::Duration,
    ) -> Result<()> {
        let now = now_ms();
        let until = now + ttl.as_millis() as i64;
        sqlx::query(&self.sql(
            "INSERT INTO sw_effect_leases (catalog_name, job, namespace, owner, lease_until_ms) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (catalog_name, job, namespace) DO NOTHING",
        ))
        .bind(&self.catalog)
        .bind(job)
        .bind(namespace)
        .bind(owner)
        .bind(until)
        .execute(self.lake.control_pool())
        .await
        .map_err(|e| EffectError::sql("create a lease", e))?;
        let n = sqlx::query(&self.sql(
            "UPDATE sw_effect_leases SET owner = $1, lease_until_ms = $2 \
             WHERE catalog_name = $3 AND job = $4 AND namespace = $5 AND (owner = $6 OR lease_until_ms < $7)",
        ))
        .bind(owner)
        .bind(until)
        .bind(&self.catalog)
        .bind(job)
        .bind(namespace)
        .bind(owner)
        .bind(now)
        .execute(self.lake.control_pool())
        .await
        .map_err(|e| EffectError::sql("take the lease", e))?
        .rows_affected();
        if n == 1 {
            return Ok(());
        }
        let holder = sqlx::query(&self.sql(
            "SELECT owner, lease_until_ms FROM sw_effect_leases WHERE catalog_name = $1 AND job = $2 AND namespace = $3",
        ))
        .bind(&self.catalog)
        .bind(job)
        .bind(namespace)
        .fetch_optional(self.lake.control_pool())
        .await
        .map_err(|e| EffectError::sql("read the lease", e))?
        .map(|r| (r.get::<String, _>(0), r.get::<i64, _>(1)));
        let (who, until) = holder.unwrap_or_default();
        Err(EffectError::new(
            ErrorKind::Conflict,
            format!(
                "{job} ({namespace}) is run by {who} (lease for {} ms more): one runner at a time",
                (until - now).max(0)
            ),
        ))
    }

    /// Gives the lease up (a clean stop), so the next runner need not wait for it.
    pub async fn release(&self, job: &str, namespace: &str, owner: &str) -> Result<()> {
        sqlx::query(&self.sql(
            "UPDATE sw_effect_leases SET lease_until_ms = 0 \
             WHERE catalog_name = $1 AND job = $2 AND namespace = $3 AND owner = $4",
        ))
        .bind(&self.catalog)
        .bind(job)
        .bind(namespace)
        .bind(owner)
        .execute(self.lake.control_pool())
        .await
        .map_err(|e| EffectError::sql("release the lease", e))?;
        Ok(())
    }

    /// The notifier's position for (job, namespace): the last output snapshot read.
    pub async fn position(&self, job: &str, namespace: &str) -> Result<Option<i64>> {
        let row = sqlx::query(&self.sql(
            "SELECT position FROM sw_effect_positions WHERE catalog_name = $1 AND job = $2 AND namespace = $3",
        ))
        .bind(&self.catalog)
        .bind(job)
        .bind(namespace)
        .fetch_optional(self.lake.control_pool())
        .await
        .map_err(|e| EffectError::sql("read the notifier position", e))?;
        Ok(row.map(|r| r.get::<i64, _>(0)))
    }

    /// Records `intents` and moves the position from `from` to `to`, in one transaction.
    /// An intent whose effect id exists is left as it is. Fails with `Conflict` when the
    /// position is not `from` any more (another notifier moved it).
    pub async fn commit_intents(
        &self,
        job: &str,
        namespace: &str,
        from: Option<i64>,
        to: i64,
        intents: &[Intent],
        would_send: bool,
    ) -> Result<u64> {
        let pool = self.lake.control_pool();
        let mut tx = pool
            .begin()
            .await
            .map_err(|e| EffectError::sql("begin the intent transaction", e))?;
        let now = now_ms();
        let insert = self.sql(
            "INSERT INTO sw_effects (catalog_name, namespace, effect_id, job, rule, effect_key, window_start_us, \
             value, message, trigger_event_us, source_snapshot, state, attempts, next_attempt_ms, created_ms, updated_ms) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, 0, $13, $14, $15) \
             ON CONFLICT (catalog_name, namespace, effect_id) DO NOTHING",
        );
        // Once per cooldown and key: sliding windows overlap, so one burst of orders makes
        // several windows cross the threshold, with starts in two cooldown buckets. The
        // first recorded stands; those within the cooldown of it are not effects of their
        // own. A replay finds the effects it made before, so it records nothing new.
        let near = self.sql(
            "SELECT COUNT(*) FROM sw_effects WHERE catalog_name = $1 AND namespace = $2 \
             AND job = $3 AND rule = $4 AND effect_key = $5 \
             AND window_start_us > $6 AND window_start_us < $7",
        );
        let mut recorded = 0;
        for i in intents {
            if i.cooldown_us > 0 {
                let n: i64 = sqlx::query_scalar(&near)
                    .bind(&self.catalog)
                    .bind(namespace)
                    .bind(job)
                    .bind(&i.rule)
                    .bind(&i.key)
                    .bind(i.window_start_us.saturating_sub(i.cooldown_us))
                    .bind(i.window_start_us.saturating_add(i.cooldown_us))
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(|e| EffectError::sql("look for an effect within the cooldown", e))?;
                if n > 0 {
                    continue;
                }
            }
            let r = sqlx::query(&insert)
                .bind(&self.catalog)
                .bind(namespace)
                .bind(&i.effect_id)
                .bind(job)
                .bind(&i.rule)
                .bind(&i.key)
                .bind(i.window_start_us)
                .bind(i.value)
                .bind(&i.message)
                .bind(i.trigger_event_us)
                .bind(i.source_snapshot)
                .bind(if would_send {
                    state::WOULD_SEND
                } else {
                    state::INTENDED
                })
                .bind(now)
                .bind(now)
                .bind(now)
                .execute(&mut *tx)
                .await
                .map_err(|e| EffectError::sql("record an intent", e))?;
            recorded += r.rows_affected();
        }
        fault_point("during_checkpoint");
        let moved = match from {
            Some(from) => sqlx::query(&self.sql(
                "UPDATE sw_effect_positions SET position = $1, updated_ms = $2 \
                 WHERE catalog_name = $3 AND job = $4 AND namespace = $5 AND position = $6",
            ))
            .bind(to)
            .bind(now)
            .bind(&self.catalog)
            .bind(job)
            .bind(namespace)
            .bind(from)
            .execute(&mut *tx)
            .await
            .map_err(|e| EffectError::sql("move the notifier position", e))?
            .rows_affected(),
            None => sqlx::query(&self.sql(
                "INSERT INTO sw_effect_positions (catalog_name, job, namespace, position, updated_ms) \
                 VALUES ($1, $2, $3, $4, $5) ON CONFLICT (catalog_name, job, namespace) DO NOTHING",
            ))
            .bind(&self.catalog)
            .bind(job)
            .bind(namespace)
            .bind(to)
            .bind(now)
            .execute(&mut *tx)
            .await
            .map_err(|e| EffectError::sql("record the notifier position", e))?
            .rows_affected(),
        };
        if moved != 1 {
            return Err(EffectError::new(
                ErrorKind::Conflict,
                format!("the position of {job} ({namespace}) moved: another notifier runs it"),
            ));
        }
        tx.commit()
            .await
            .map_err(|e| EffectError::sql("commit the intents", e))?;
        Ok(recorded)
    }

    /// Claims up to `limit` effects of `job` due for dispatch (`intended`, next attempt
    /// due), in one transaction: each becomes `dispatching` with a new attempt row.
    /// Returns them with their attempt numbers.
    pub async fn claim(&self, job: &str, limit: usize) -> Result<Vec<(Effect, i64)>> {
        let now = now_ms();
        let due = self
            .list_where(
                &format!(
                    "namespace = 'live' AND job = $2 AND state = 'intended' AND next_attempt_ms <= {now} \
                     ORDER BY created_ms, effect_id LIMIT {limit}"
                ),
                &[job],
            )
            .await?;
        if due.is_empty() {
            return Ok(Vec::new());
        }
        let mut tx = self
            .lake
            .control_pool()
            .begin()
            .await
            .map_err(|e| EffectError::sql("begin a claim", e))?;
        let update = self.sql(
            "UPDATE sw_effects SET state = 'dispatching', attempts = attempts + 1, updated_ms = $1, \
             first_attempt_ms = COALESCE(first_attempt_ms, $2) \
             WHERE catalog_name = $3 AND namespace = 'live' AND effect_id = $4 AND state = 'intended'",
        );
        let attempt_row = self.sql(
            "INSERT INTO sw_effect_attempts (catalog_name, namespace, effect_id, attempt, started_ms, outcome) \
             VALUES ($1, 'live', $2, $3, $4, 'sending')",
        );
        let mut claimed = Vec::new();
        for mut effect in due {
            let n = sqlx::query(&update)
                .bind(now)
                .bind(now)
                .bind(&self.catalog)
                .bind(&effect.effect_id)
                .execute(&mut *tx)
                .await
                .map_err(|e| EffectError::sql("claim an effect", e))?
                .rows_affected();
            if n != 1 {
                continue;
            }
            effect.attempts += 1;
            effect.state = state::DISPATCHING.into();
            effect.first_attempt_ms.get_or_insert(now);
            sqlx::query(&attempt_row)
                .bind(&self.catalog)
                .bind(&effect.effect_id)
                .bind(effect.attempts)
                .bind(now)
                .execute(&mut *tx)
                .await
                .map_err(|e| EffectError::sql("record an attempt", e))?;
            let attempt = effect.attempts;
            claimed.push((effect, attempt));
        }
        tx.commit()
            .await
            .map_err(|e| EffectError::sql("commit a claim", e))?;
        Ok(claimed)
    }

    async fn list_where(&self, cond: &str, args: &[&str]) -> Result<Vec<Effect>> {
        let sql = self.sql(&format!(
            "SELECT effect_id, namespace, rule, effect_key, message, state, attempts, trigger_event_us, \
             created_ms, delivered_ms, provider_ref, last_error, first_attempt_ms FROM sw_effects \
             WHERE catalog_name = $1 AND {cond}"
        ));
        let mut q = sqlx::query(&sql).bind(&self.catalog);
        for a in args {
            q = q.bind(*a);
        }
        let rows = q
            .fetch_all(self.lake.control_pool())
            .await
            .map_err(|e| EffectError::sql("read effects", e))?;
        Ok(rows
            .iter()
            .map(|r| Effect {
                effect_id: r.get(0),
                namespace: r.get(1),
                rule: r.get(2),
                key: r.get(3),
                message: r.get(4),
                state: r.get(5),
                attempts: r.get(6),
                trigger_event_us: r.get(7),
                created_ms: r.get(8),
                delivered_ms: r.get(9),
                provider_ref: r.get(10),
                last_error: r.get(11),
                first_attempt_ms: r.get(12),
            })
            .collect())
    }

    /// Effects of `job` in `namespace`, optionally in one state.
    pub async fn effects(
        &self,
        job: &str,
        namespace: &str,
        state: Option<&str>,
    ) -> Result<Vec<Effect>> {
        match state {
            Some(s) => {
                self.list_where(
                    "job = $2 AND namespace = $3 AND state = $4",
                    &[job, namespace, s],
                )
                .await
            }
            None => {
                self.list_where("job = $2 AND namespace = $3", &[job, namespace])
                    .await
            }
        }
    }

    /// Counts by state.
    pub async fn counts(&self, job: &str, namespace: &str) -> Result<BTreeMap<String, u64>> {
        let rows = sqlx::query(&self.sql(
            "SELECT state, COUNT(*) FROM sw_effects WHERE catalog_name = $1 AND job = $2 AND namespace = $3 GROUP BY state",
        ))
        .bind(&self.catalog)
        .bind(job)
        .bind(namespace)
        .fetch_all(self.lake.control_pool())
        .await
        .map_err(|e| EffectError::sql("count effects", e))?;
        Ok(rows
            .iter()
            .map(|r| (r.get::<String, _>(0), r.get::<i64, _>(1).max(0) as u64))
            .collect())
    }

    /// Settles `dispatching` effects, in one transaction: each one's new state and its
    /// attempt's outcome.
    pub async fn settle_all(&self, settlements: &[Settlement]) -> Result<()> {
        if settlements.is_empty() {
            return Ok(());
        }
        let now = now_ms();
        let mut tx = self
            .lake
            .control_pool()
            .begin()
            .await
            .map_err(|e| EffectError::sql("begin settling", e))?;
        let effect = self.sql(
            "UPDATE sw_effects SET state = $1, updated_ms = $2, next_attempt_ms = $3, \
             delivered_ms = COALESCE(delivered_ms, $4), provider_ref = COALESCE($5, provider_ref), last_error = $6 \
             WHERE catalog_name = $7 AND namespace = 'live' AND effect_id = $8 AND state <> 'erased'",
        );
        // An effect erased in flight keeps no answer: the provider's may repeat its message.
        let attempt = self.sql(
            "UPDATE sw_effect_attempts SET finished_ms = $1, outcome = $2, http_status = $3, \
             answer = CASE WHEN EXISTS (SELECT 1 FROM sw_effects e WHERE e.catalog_name = $4 \
             AND e.namespace = 'live' AND e.effect_id = $5 AND e.state = 'erased') THEN NULL ELSE $6 END \
             WHERE catalog_name = $7 AND namespace = 'live' AND effect_id = $8 AND attempt = $9",
        );
        // In effect id order, as an erasure locks them: two transactions that lock rows in
        // one order cannot deadlock.
        let mut settlements: Vec<&Settlement> = settlements.iter().collect();
        settlements.sort_by(|a, b| a.effect_id.cmp(&b.effect_id));
        for st in settlements {
            let delivered =
                (st.state == state::DELIVERED || st.state == state::RECONCILED).then_some(now);
            let answer = st.answer.as_deref();
            sqlx::query(&effect)
                .bind(st.state)
                .bind(now)
                .bind(st.retry_at_ms.unwrap_or(now))
                .bind(delivered)
                .bind(if delivered.is_some() { answer } else { None })
                .bind(if delivered.is_some() { None } else { answer })
                .bind(&self.catalog)
                .bind(&st.effect_id)
                .execute(&mut *tx)
                .await
                .map_err(|e| EffectError::sql("settle an effect", e))?;
            sqlx::query(&attempt)
                .bind(now)
                .bind(&st.outcome)
                .bind(st.http_status.map(i64::from))
                .bind(&self.catalog)
                .bind(&st.effect_id)
                .bind(answer)
                .bind(&self.catalog)
                .bind(&st.effect_id)
                .bind(st.attempt)
                .execute(&mut *tx)
                .await
                .map_err(|e| EffectError::sql("record an attempt's outcome", e))?;
        }
        tx.commit()
            .await
            .map_err(|e| EffectError::sql("commit the settlements", e))?;
        Ok(())
    }

    /// Moves a live effect from state `from` to `to` (compare-and-set), noting why; with
    /// `provider_ref`, records it as delivered by the provider. Returns whether it moved.
    pub async fn transition(
        &self,
        effect_id: &str,
        from: &str,
        to: &str,
        note: &str,
        provider_ref: Option<&str>,
    ) -> Result<bool> {
        let now = now_ms();
        let n = sqlx::query(&self.sql(
            "UPDATE sw_effects SET state = $1, updated_ms = $2, next_attempt_ms = $3, last_error = $4, \
             provider_ref = COALESCE($5, provider_ref), delivered_ms = CASE WHEN $6 = 1 THEN COALESCE(delivered_ms, $7) ELSE delivered_ms END \
             WHERE catalog_name = $8 AND namespace = 'live' AND effect_id = $9 AND state = $10",
        ))
        .bind(to)
        .bind(now)
        .bind(now)
        .bind(note)
        .bind(provider_ref)
        .bind(i64::from(provider_ref.is_some()))
        .bind(now)
        .bind(&self.catalog)
        .bind(effect_id)
        .bind(from)
        .execute(self.lake.control_pool())
        .await
        .map_err(|e| EffectError::sql("move an effect", e))?
        .rows_affected();
        Ok(n == 1)
    }

    /// Moves the live `failed` effects of `job` back to `intended` with a new deadline (an
    /// operator's retry after an outage longer than the deadline). Safe: a failed effect
    /// was refused, never sent, or sent again with its key to a provider that honours
    /// keys. Returns how many.
    pub async fn retry_failed(&self, job: &str) -> Result<u64> {
        let now = now_ms();
        let n = sqlx::query(&self.sql(
            "UPDATE sw_effects SET state = $1, first_attempt_ms = NULL, next_attempt_ms = $2, \
             updated_ms = $3, last_error = $4 \
             WHERE catalog_name = $5 AND namespace = 'live' AND job = $6 AND state = $7",
        ))
        .bind(state::INTENDED)
        .bind(now)
        .bind(now)
        .bind("sent again by the operator after failing")
        .bind(&self.catalog)
        .bind(job)
        .bind(state::FAILED)
        .execute(self.lake.control_pool())
        .await
        .map_err(|e| EffectError::sql("retry failed effects", e))?
        .rows_affected();
        Ok(n)
    }

    /// The notification jobs the ledger holds effects of.
    pub async fn jobs(&self) -> Result<Vec<String>> {
        sqlx::query_scalar(
            &self.sql("SELECT DISTINCT job FROM sw_effects WHERE catalog_name = $1 ORDER BY job"),
        )
        .bind(&self.catalog)
        .fetch_all(self.lake.control_pool())
        .await
        .map_err(|e| EffectError::sql("read the ledger's jobs", e))
    }

    /// Erases a data subject from the effects of `job`, in every namespace: each effect
    /// whose key `names` accepts loses its key, message, value and trigger time, the
    /// provider's reference, and its attempts the provider's answers (any of which may
    /// repeat the message). One not yet delivered is never sent: it becomes
    /// [`state::ERASED`], as does one in flight, whose outcome is then not recorded. Its
    /// id stays, so the same window seen again (a replay) finds it and records nothing
    /// new; the id is a digest of the key, so who knows the customer id can still find
    /// that an effect was made for them, and when (its window's start), but not what it
    /// said. Returns how many effects were erased.
    pub async fn erase_keys(&self, job: &str, names: impl Fn(&str) -> bool) -> Result<u64> {
        let keys: Vec<String> = sqlx::query_scalar(&self.sql(
            "SELECT DISTINCT effect_key FROM sw_effects WHERE catalog_name = $1 AND job = $2",
        ))
        .bind(&self.catalog)
        .bind(job)
        .fetch_all(self.lake.control_pool())
        .await
        .map_err(|e| EffectError::sql("read the effects' keys", e))?;
        let keys: Vec<String> = keys.into_iter().filter(|k| names(k)).collect();
        if keys.is_empty() {
            return Ok(0);
        }
        let mut tx = self
            .lake
            .control_pool()
            .begin()
            .await
            .map_err(|e| EffectError::sql("begin an erasure", e))?;
        // Each effect, then its attempts, in effect id order: the order `settle_all` locks
        // them in.
        let ids = self.sql(
            "SELECT namespace, effect_id FROM sw_effects WHERE catalog_name = $1 AND job = $2 \
             AND effect_key = $3 ORDER BY effect_id, namespace",
        );
        let effects = self.sql(
            "UPDATE sw_effects SET effect_key = '', message = '', value = 0, trigger_event_us = 0, \
             provider_ref = NULL, last_error = NULL, updated_ms = $1, \
             state = CASE WHEN state IN ('intended', 'dispatching', 'failed', 'ambiguous') \
             THEN 'erased' ELSE state END \
             WHERE catalog_name = $2 AND namespace = $3 AND effect_id = $4 AND effect_key = $5",
        );
        let answers = self.sql(
            "UPDATE sw_effect_attempts SET answer = NULL WHERE catalog_name = $1 \
             AND namespace = $2 AND effect_id = $3",
        );
        let now = now_ms();
        let mut erased = 0;
        for key in &keys {
            let of_key: Vec<(String, String)> = sqlx::query_as(&ids)
                .bind(&self.catalog)
                .bind(job)
                .bind(key)
                .fetch_all(&mut *tx)
                .await
                .map_err(|e| EffectError::sql("read the effects of a key", e))?;
            for (namespace, effect_id) in &of_key {
                erased += sqlx::query(&effects)
                    .bind(now)
                    .bind(&self.catalog)
                    .bind(namespace)
                    .bind(effect_id)
                    .bind(key)
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| EffectError::sql("erase an effect", e))?
                    .rows_affected();
                sqlx::query(&answers)
                    .bind(&self.catalog)
                    .bind(namespace)
                    .bind(effect_id)
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| EffectError::sql("erase the attempts' answers", e))?;
            }
        }
        tx.commit()
            .await
            .map_err(|e| EffectError::sql("commit an erasure", e))?;
        Ok(erased)
    }

    /// Deletes the settled effects of `job` in `namespace` (and their attempts) created
    /// before `older_than_ms`. Returns how many effects went.
    pub async fn expire(&self, job: &str, namespace: &str, older_than_ms: i64) -> Result<u64> {
        let settled = "('delivered', 'reconciled', 'failed', 'would_send', 'erased')";
        // Attempts are matched by namespace too: a backfill namespace's effect ids are the
        // live ones (the same windows), and the live attempts stay.
        sqlx::query(&self.sql(&format!(
            "DELETE FROM sw_effect_attempts WHERE catalog_name = $1 AND namespace = $2 \
             AND effect_id IN (SELECT effect_id FROM sw_effects WHERE catalog_name = $3 \
             AND namespace = $4 AND job = $5 AND created_ms < $6 AND state IN {settled})"
        )))
        .bind(&self.catalog)
        .bind(namespace)
        .bind(&self.catalog)
        .bind(namespace)
        .bind(job)
        .bind(older_than_ms)
        .execute(self.lake.control_pool())
        .await
        .map_err(|e| EffectError::sql("expire attempts", e))?;
        let n = sqlx::query(&self.sql(&format!(
            "DELETE FROM sw_effects WHERE catalog_name = $1 AND namespace = $2 AND job = $3 \
             AND created_ms < $4 AND state IN {settled}"
        )))
        .bind(&self.catalog)
        .bind(namespace)
        .bind(job)
        .bind(older_than_ms)
        .execute(self.lake.control_pool())
        .await
        .map_err(|e| EffectError::sql("expire effects", e))?
        .rows_affected();
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use signalweave_lake::LakeConfig;

    fn intent(id: &str, key: &str) -> Intent {
        Intent {
            effect_id: id.into(),
            rule: "big_spender".into(),
            key: key.into(),
            window_start_us: 0,
            value: 1,
            message: format!("Customer {key}: orders of 1"),
            trigger_event_us: 5,
            source_snapshot: 1,
            cooldown_us: 0,
        }
    }

    /// An effect erased while it is in flight stays erased: its outcome, when it comes,
    /// brings back neither a state that would send it again nor the provider's answer.
    /// One not yet sent is never claimed; one delivered stays delivered, without what
    /// the provider answered; the other customers' effects go on.
    /// On SQLite, and on PostgreSQL too when `SW_PG_URL` names one (CI starts it).
    #[tokio::test]
    async fn an_effect_erased_in_flight_stays_erased() {
        let dir = tempfile::tempdir().unwrap();
        erased_in_flight(LakeConfig::embedded(dir.path())).await;
        if let Ok(url) = std::env::var("SW_PG_URL") {
            erased_in_flight(LakeConfig {
                // A catalog of its own isolates this run's rows in the shared database.
                catalog_name: format!("t{}_{}", std::process::id(), now_ms()),
                catalog_url: url,
                warehouse: signalweave_lake::Warehouse::Local {
                    path: dir.path().join("pg-warehouse"),
                },
            })
            .await;
        }
    }

    async fn erased_in_flight(config: LakeConfig) {
        let lake = Lake::open(config).await.unwrap();
        let catalog = lake.config().catalog_name.clone();
        let ledger = Ledger::open(lake.clone()).await.unwrap();
        let intents = [
            intent("e1", "t|c-1"),
            intent("e2", "t|c-2"),
            intent("e3", "t|c-1"),
            intent("e4", "t|c-1"),
        ];
        ledger
            .commit_intents(
                "n",
                "live",
                None,
                1,
                &[intents[0].clone(), intents[1].clone(), intents[3].clone()],
                false,
            )
            .await
            .unwrap();
        let claimed = ledger.claim("n", 10).await.unwrap();
        assert_eq!(claimed.len(), 3);
        let settlement = |id: &str, state: &'static str, answer: &str| {
            let (e, attempt) = claimed.iter().find(|(e, _)| e.effect_id == id).unwrap();
            Settlement {
                effect_id: e.effect_id.clone(),
                attempt: *attempt,
                state,
                outcome: "answered".into(),
                http_status: Some(200),
                answer: Some(format!("{answer}: {}", e.message)),
                retry_at_ms: (state == state::INTENDED).then_some(0),
            }
        };
        ledger
            .settle_all(&[settlement("e4", state::DELIVERED, "ref")])
            .await
            .unwrap();
        // A later effect of the subject, not yet sent.
        ledger
            .commit_intents("n", "live", Some(1), 2, &intents[2..3], false)
            .await
            .unwrap();
        let erased = ledger.erase_keys("n", |k| k == "t|c-1").await.unwrap();
        assert_eq!(erased, 3);
        ledger
            .settle_all(&[
                settlement("e1", state::INTENDED, "busy"),
                settlement("e2", state::INTENDED, "busy"),
            ])
            .await
            .unwrap();
        let effects = ledger.effects("n", "live", None).await.unwrap();
        let by_id = |id: &str| effects.iter().find(|e| e.effect_id == id).unwrap();
        for (id, state) in [
            ("e1", state::ERASED),
            ("e3", state::ERASED),
            ("e4", state::DELIVERED),
        ] {
            let e = by_id(id);
            assert_eq!(
                (
                    e.state.as_str(),
                    e.key.as_str(),
                    e.message.as_str(),
                    e.provider_ref.as_deref()
                ),
                (state, "", "", None),
                "{id}"
            );
        }
        assert_eq!(by_id("e2").state, state::INTENDED);
        // Only the other customer's effect is claimed again.
        let again = ledger.claim("n", 10).await.unwrap();
        assert_eq!(
            again
                .iter()
                .map(|(e, _)| e.effect_id.as_str())
                .collect::<Vec<_>>(),
            ["e2"]
        );
        let answers: Vec<(String, Option<String>)> = sqlx::query_as(&lake.control_sql(
            "SELECT effect_id, answer FROM sw_effect_attempts WHERE attempt = 1 \
             AND catalog_name = $1 ORDER BY effect_id",
        ))
        .bind(&catalog)
        .fetch_all(lake.control_pool())
        .await
        .unwrap();
        assert_eq!(answers[0], ("e1".to_string(), None));
        assert!(answers[1].1.as_deref().unwrap().contains("c-2"));
        assert_eq!(answers[2], ("e4".to_string(), None));
        let values: Vec<(i64, i64)> = sqlx::query_as(&lake.control_sql(
            "SELECT value, trigger_event_us FROM sw_effects \
             WHERE effect_id IN ('e1', 'e3', 'e4') AND catalog_name = $1",
        ))
        .bind(&catalog)
        .fetch_all(lake.control_pool())
        .await
        .unwrap();
        assert!(values.iter().all(|v| *v == (0, 0)), "{values:?}");
    }
}
