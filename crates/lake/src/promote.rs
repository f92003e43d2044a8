//! Promotions: which output namespace is authoritative for which window range of a job.
//!
//! A backfill writes into its own namespace; nothing reads it as truth until it is
//! promoted. A promotion (`sw_promotions`, in the catalog database) says: for windows of
//! `job` starting in `[from, to)`, the current version is the one in `namespace`'s output
//! table, not the live one. It records who promoted, when, and the job version. A later
//! promotion that overlaps an earlier one wins on the overlap: later by the order the
//! database recorded them in (`seq`), not by the promoting hosts' clocks. A namespace has
//! at most one active promotion per job, which a unique index holds against concurrent
//! promotions. A rollback marks the promotion rolled back (who, when); the row stays as
//! evidence.
//!
//! The SQL view `<output>_current` ([`crate::sql`]) and the serving API honour the active
//! promotions.

use serde::Serialize;
use signalweave_model::ErrorKind;
use sqlx::Row;

use crate::error::{LakeError, Result};
use crate::lake::Lake;

/// One promotion of a namespace for a window range.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Promotion {
    /// Job name.
    pub job: String,
    /// The promoted namespace.
    pub namespace: String,
    /// Job version of the promoted outputs.
    pub job_version: u32,
    /// The job's live output table (`market_aggregates`).
    pub live_table: String,
    /// The namespace's output table (`market_aggregates__fix_fees`).
    pub table: String,
    /// Windows starting at or after this time (µs) ...
    pub from_us: i64,
    /// ... and before this one (µs).
    pub to_us: i64,
    /// Who promoted.
    pub promoted_by: String,
    /// When, ms since the epoch.
    pub promoted_ms: i64,
    /// Who rolled it back, if anyone.
    pub rolled_back_by: Option<String>,
    /// When, ms since the epoch.
    pub rolled_back_ms: Option<i64>,
    /// Its place in the order promotions were recorded (None: recorded before the order
    /// was kept, so before every promotion that has one).
    pub seq: Option<i64>,
    /// Its rollback's place in the same order, once rolled back (None before).
    pub rolled_back_seq: Option<i64>,
}

impl Promotion {
    /// True unless rolled back.
    pub fn active(&self) -> bool {
        self.rolled_back_ms.is_none()
    }

    /// True when it was in force at `ms` (ms since the epoch): recorded by then, and not
    /// rolled back by then. (Recorded on the promoting host's clock, as the snapshots'
    /// times are on the committing host's.)
    pub fn active_at(&self, ms: i64) -> bool {
        self.promoted_ms <= ms && self.rolled_back_ms.is_none_or(|r| r > ms)
    }

    /// True when the promotion covers windows starting at `window_start_us`.
    pub fn covers(&self, window_start_us: i64) -> bool {
        self.active() && self.spans(window_start_us)
    }

    /// True when its range holds `window_start_us`, whether or not it is rolled back.
    pub fn spans(&self, window_start_us: i64) -> bool {
        window_start_us >= self.from_us && window_start_us < self.to_us
    }
}

/// The epoch of a window's authority: the last place in the order of the promotions and
/// rollbacks whose range holds it (0: none). Each change of which namespace serves the
/// window comes with a later epoch, so `(epoch, output_version)` only grows for a window,
/// across promotions and rollbacks, although each namespace counts its versions from 1.
pub fn authority_epoch(promotions: &[Promotion], window_start_us: i64) -> i64 {
    promotions
        .iter()
        .filter(|p| p.spans(window_start_us))
        .filter_map(|p| p.seq.max(p.rolled_back_seq))
        .max()
        .unwrap_or(0)
}

/// A version that only grows for a window across promotions and rollbacks: its authority
/// epoch (see [`authority_epoch`]) above its namespace's `output_version` (32 bits).
pub fn serving_version(epoch: i64, output_version: i64) -> i64 {
    (epoch << 32) | (output_version & 0xFFFF_FFFF)
}

/// The namespace authoritative for a window of a job, given its active promotions in
/// promotion order (the latest covering one wins); `live` when none covers it.
pub fn authoritative(promotions: &[Promotion], window_start_us: i64) -> &str {
    promotions
        .iter()
        .rev()
        .find(|p| p.covers(window_start_us))
        .map_or("live", |p| p.namespace.as_str())
}

/// Takes the next place in the order of promotions and rollbacks, after every place taken
/// before (also those recorded in `sw_promotions` alone, by an earlier version). Run in
/// the transaction that records the promotion or rollback: a second taker of the same
/// place waits on the key until the first commits, then fails and takes the next, so
/// places are committed in their order (a place taken but never recorded would let a
/// later one be recorded first).
const TAKE_PLACE: &str = "INSERT INTO sw_promotion_order (catalog_name, seq) \
     SELECT $1, COALESCE(MAX(m.x), 0) + 1 FROM ( \
       SELECT seq AS x FROM sw_promotion_order WHERE catalog_name = $1 \
       UNION ALL SELECT seq FROM sw_promotions WHERE catalog_name = $1 \
       UNION ALL SELECT rolled_back_seq FROM sw_promotions WHERE catalog_name = $1) m \
     RETURNING seq";

/// Attempts at taking a place (or recording a promotion) before giving up.
const PLACE_ATTEMPTS: i64 = 20;

fn unique_violation(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .is_some_and(|d| d.is_unique_violation())
}

impl Lake {
    /// `sql` with the control database's placeholders: `$n` as written for PostgreSQL,
    /// `?` for SQLite.
    pub fn control_sql(&self, sql: &str) -> String {
        if self.config().is_sqlite() {
            sql.replace('$', "?")
        } else {
            sql.to_string()
        }
    }

    pub(crate) async fn create_promotions_table(&self) -> Result<()> {
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS sw_promotions (catalog_name VARCHAR(255) NOT NULL, \
             job VARCHAR(255) NOT NULL, namespace VARCHAR(255) NOT NULL, job_version BIGINT NOT NULL, \
             live_table VARCHAR(255) NOT NULL, namespace_table VARCHAR(255) NOT NULL, \
             from_us BIGINT NOT NULL, to_us BIGINT NOT NULL, promoted_by VARCHAR(255) NOT NULL, \
             promoted_ms BIGINT NOT NULL, rolled_back_by VARCHAR(255), rolled_back_ms BIGINT, \
             PRIMARY KEY (catalog_name, job, namespace, promoted_ms))",
        )
        .execute(self.control_pool())
        .await
        .map_err(|e| LakeError::sql("create sw_promotions", e))?;
        // Every place in the order, a promotion's or a rollback's, is taken here first: one
        // key holds them all apart, however many promote and roll back at once.
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS sw_promotion_order (catalog_name VARCHAR(255) NOT NULL, \
             seq BIGINT NOT NULL, PRIMARY KEY (catalog_name, seq))",
        )
        .execute(self.control_pool())
        .await
        .map_err(|e| LakeError::sql("create sw_promotion_order", e))?;
        self.migrate_promotions().await
    }

    /// Takes the next place in the order within `tx` (see [`TAKE_PLACE`]).
    async fn take_place(
        &self,
        tx: &mut sqlx::AnyConnection,
    ) -> std::result::Result<i64, sqlx::Error> {
        sqlx::query_scalar::<_, i64>(&self.control_sql(TAKE_PLACE))
            .bind(self.config().catalog_name.as_str())
            .fetch_one(tx)
            .await
    }

    /// Brings an `sw_promotions` made by an earlier version up to date: the `seq` column
    /// and the two unique indexes (one order; one active promotion per namespace). What is
    /// there is read first, in one query each, so DDL runs only when something is missing.
    async fn migrate_promotions(&self) -> Result<()> {
        let sqlite = self.config().is_sqlite();
        let has_seq = sqlx::query("SELECT seq FROM sw_promotions WHERE 1 = 0")
            .execute(self.control_pool())
            .await
            .is_ok();
        let has_rollback_seq = sqlx::query("SELECT rolled_back_seq FROM sw_promotions WHERE 1 = 0")
            .execute(self.control_pool())
            .await
            .is_ok();
        for (column, missing) in [("seq", !has_seq), ("rolled_back_seq", !has_rollback_seq)] {
            if !missing {
                continue;
            }
            let add = if sqlite {
                format!("ALTER TABLE sw_promotions ADD COLUMN {column} BIGINT")
            } else {
                format!("ALTER TABLE sw_promotions ADD COLUMN IF NOT EXISTS {column} BIGINT")
            };
            let added = sqlx::query(&add).execute(self.control_pool()).await;
            // Another process may have added it meanwhile.
            if let Err(e) = added
                && sqlx::query(&format!("SELECT {column} FROM sw_promotions WHERE 1 = 0"))
                    .execute(self.control_pool())
                    .await
                    .is_err()
            {
                return Err(LakeError::sql("add a column to sw_promotions", e));
            }
        }
        let indexes: Vec<String> = sqlx::query_scalar(if sqlite {
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'sw_promotions'"
        } else {
            "SELECT CAST(indexname AS TEXT) FROM pg_indexes WHERE schemaname = current_schema() \
             AND tablename = 'sw_promotions'"
        })
        .fetch_all(self.control_pool())
        .await
        .map_err(|e| LakeError::sql("look for sw_promotions' indexes", e))?;
        for (name, ddl) in [
            (
                "sw_promotions_order",
                "CREATE UNIQUE INDEX IF NOT EXISTS sw_promotions_order ON sw_promotions (catalog_name, seq)",
            ),
            (
                "sw_promotions_one_active",
                "CREATE UNIQUE INDEX IF NOT EXISTS sw_promotions_one_active ON sw_promotions \
                 (catalog_name, job, namespace) WHERE rolled_back_ms IS NULL",
            ),
        ] {
            if indexes.iter().any(|i| i == name) {
                continue;
            }
            if let Err(e) = sqlx::query(ddl).execute(self.control_pool()).await {
                // Two active promotions of one namespace, recorded by concurrent promotions
                // before the index: the lake still opens; rolling one back lets it be made.
                tracing::warn!(index = name, error = %e, "sw_promotions: index not made");
            }
        }
        Ok(())
    }

    /// Every promotion of `job` (None: of every job), active or rolled back, in promotion
    /// order.
    pub async fn promotions(&self, job: Option<&str>) -> Result<Vec<Promotion>> {
        let sql = self.control_sql(
            "SELECT job, namespace, job_version, live_table, namespace_table, from_us, to_us, promoted_by, promoted_ms, \
             rolled_back_by, rolled_back_ms, seq, rolled_back_seq FROM sw_promotions WHERE catalog_name = $1 \
             AND ($2 = '' OR job = $3) ORDER BY COALESCE(seq, 0), promoted_ms, namespace",
        );
        let job = job.unwrap_or("");
        let rows = sqlx::query(&sql)
            .bind(self.config().catalog_name.as_str())
            .bind(job)
            .bind(job)
            .fetch_all(self.control_pool())
            .await
            .map_err(|e| LakeError::sql("read promotions", e))?;
        rows.iter()
            .map(|r| {
                Ok(Promotion {
                    job: r.try_get("job")?,
                    namespace: r.try_get("namespace")?,
                    job_version: u32::try_from(r.try_get::<i64, _>("job_version")?).unwrap_or(0),
                    live_table: r.try_get("live_table")?,
                    table: r.try_get("namespace_table")?,
                    from_us: r.try_get("from_us")?,
                    to_us: r.try_get("to_us")?,
                    promoted_by: r.try_get("promoted_by")?,
                    promoted_ms: r.try_get("promoted_ms")?,
                    rolled_back_by: r.try_get("rolled_back_by")?,
                    rolled_back_ms: r.try_get("rolled_back_ms")?,
                    seq: r.try_get("seq")?,
                    rolled_back_seq: r.try_get("rolled_back_seq")?,
                })
            })
            .collect::<std::result::Result<_, sqlx::Error>>()
            .map_err(|e| LakeError::sql("read promotions", e))
    }

    /// The active promotions of `job`, in promotion order.
    pub async fn active_promotions(&self, job: &str) -> Result<Vec<Promotion>> {
        Ok(self
            .promotions(Some(job))
            .await?
            .into_iter()
            .filter(Promotion::active)
            .collect())
    }

    /// Records `promotion` (its rollback fields and `seq` are ignored: it is placed after
    /// every promotion and rollback recorded) and returns it as recorded. Fails with
    /// `Conflict` when the namespace already has an active promotion of the same job, also
    /// when another is being recorded at once.
    pub async fn promote(&self, promotion: &Promotion) -> Result<Promotion> {
        if promotion.namespace == "live" {
            return Err(LakeError::new(
                ErrorKind::InvalidInput,
                "`live` is authoritative already: promote a backfill namespace",
            ));
        }
        if promotion.from_us >= promotion.to_us {
            return Err(LakeError::new(
                ErrorKind::InvalidInput,
                "a promotion's range must not be empty",
            ));
        }
        if let Some(active) = self
            .active_promotions(&promotion.job)
            .await?
            .into_iter()
            .find(|p| p.namespace == promotion.namespace)
        {
            return Err(LakeError::new(
                ErrorKind::Conflict,
                format!(
                    "namespace `{}` of {} is promoted already (by {} at {}): roll it back first",
                    active.namespace,
                    active.job,
                    active.promoted_by,
                    signalweave_model::format_rfc3339_micros(
                        active.promoted_ms.saturating_mul(1000)
                    )
                ),
            ));
        }
        // A place and the row are recorded in one transaction (see [`TAKE_PLACE`]). A
        // collision on the promotions' key, the same namespace promoted again within the
        // same millisecond, is retried a millisecond later.
        let insert = self.control_sql(
            "INSERT INTO sw_promotions (catalog_name, job, namespace, job_version, live_table, \
             namespace_table, from_us, to_us, promoted_by, promoted_ms, seq) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
        );
        let sql_error = |e| LakeError::sql("record a promotion", e);
        let mut attempt = 0;
        loop {
            attempt += 1;
            let promoted_ms = promotion.promoted_ms + attempt - 1;
            let mut tx = self.control_pool().begin().await.map_err(sql_error)?;
            let seq = match self.take_place(&mut tx).await {
                Ok(seq) => seq,
                Err(e) if unique_violation(&e) && attempt < PLACE_ATTEMPTS => continue,
                Err(e) => return Err(sql_error(e)),
            };
            let recorded = sqlx::query(&insert)
                .bind(self.config().catalog_name.as_str())
                .bind(&promotion.job)
                .bind(&promotion.namespace)
                .bind(i64::from(promotion.job_version))
                .bind(&promotion.live_table)
                .bind(&promotion.table)
                .bind(promotion.from_us)
                .bind(promotion.to_us)
                .bind(&promotion.promoted_by)
                .bind(promoted_ms)
                .bind(seq)
                .execute(&mut *tx)
                .await;
            match recorded {
                Ok(_) => {
                    tx.commit().await.map_err(sql_error)?;
                    return Ok(Promotion {
                        promoted_ms,
                        seq: Some(seq),
                        rolled_back_by: None,
                        rolled_back_ms: None,
                        rolled_back_seq: None,
                        ..promotion.clone()
                    });
                }
                Err(e) if unique_violation(&e) => {
                    drop(tx);
                    let active = self
                        .active_promotions(&promotion.job)
                        .await?
                        .into_iter()
                        .any(|p| p.namespace == promotion.namespace);
                    if active || attempt >= PLACE_ATTEMPTS {
                        return Err(LakeError::new(
                            ErrorKind::Conflict,
                            format!(
                                "namespace `{}` of {} was promoted concurrently: {e}",
                                promotion.namespace, promotion.job
                            ),
                        ));
                    }
                }
                Err(e) => return Err(sql_error(e)),
            }
        }
    }

    /// Rolls back the active promotion of `namespace` for `job`, recording who and when.
    /// Returns it; fails with `NotFound` when there is none.
    pub async fn rollback_promotion(
        &self,
        job: &str,
        namespace: &str,
        by: &str,
    ) -> Result<Promotion> {
        let Some(mut active) = self
            .active_promotions(job)
            .await?
            .into_iter()
            .find(|p| p.namespace == namespace)
        else {
            return Err(LakeError::new(
                ErrorKind::NotFound,
                format!("namespace `{namespace}` of {job} has no active promotion"),
            ));
        };
        let now = chrono::Utc::now().timestamp_millis();
        let sql = self.control_sql(
            "UPDATE sw_promotions SET rolled_back_by = $1, rolled_back_ms = $2, \
             rolled_back_seq = $7 \
             WHERE catalog_name = $3 AND job = $4 AND namespace = $5 AND promoted_ms = $6 \
             AND rolled_back_ms IS NULL",
        );
        let sql_error = |e| LakeError::sql("roll back a promotion", e);
        let mut attempt = 0;
        loop {
            attempt += 1;
            // The place and the rollback in one transaction (see [`TAKE_PLACE`]).
            let mut tx = self.control_pool().begin().await.map_err(sql_error)?;
            let place = match self.take_place(&mut tx).await {
                Ok(place) => place,
                Err(e) if unique_violation(&e) && attempt < PLACE_ATTEMPTS => continue,
                Err(e) => return Err(sql_error(e)),
            };
            let done = sqlx::query(&sql)
                .bind(by)
                .bind(now)
                .bind(self.config().catalog_name.as_str())
                .bind(job)
                .bind(namespace)
                .bind(active.promoted_ms)
                .bind(place)
                .execute(&mut *tx)
                .await
                .map_err(sql_error)?;
            if done.rows_affected() != 1 {
                return Err(LakeError::new(
                    ErrorKind::Conflict,
                    format!("the promotion of `{namespace}` was rolled back concurrently"),
                ));
            }
            tx.commit().await.map_err(sql_error)?;
            break;
        }
        active.rolled_back_by = Some(by.to_string());
        active.rolled_back_ms = Some(now);
        Ok(self
            .promotions(Some(job))
            .await?
            .into_iter()
            .find(|p| p.namespace == namespace && p.promoted_ms == active.promoted_ms)
            .unwrap_or(active))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn p(ns: &str, from: i64, to: i64, rolled_back: bool) -> Promotion {
        Promotion {
            job: "j".into(),
            namespace: ns.into(),
            job_version: 2,
            live_table: "t".into(),
            table: format!("t__{ns}"),
            from_us: from,
            to_us: to,
            promoted_by: "t".into(),
            promoted_ms: 0,
            rolled_back_by: None,
            rolled_back_ms: rolled_back.then_some(1),
            seq: None,
            rolled_back_seq: None,
        }
    }

    #[tokio::test]
    async fn promotions_are_ordered_as_recorded_and_one_is_active_per_namespace() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(crate::LakeConfig::embedded(dir.path()))
            .await
            .unwrap();
        lake.init().await.unwrap();
        // B is recorded after A from a host whose clock is behind: B still wins.
        let a = Promotion {
            promoted_ms: 2_000,
            ..p("a", 0, 100, false)
        };
        let b = Promotion {
            promoted_ms: 1_000,
            ..p("b", 50, 150, false)
        };
        lake.promote(&a).await.unwrap();
        lake.promote(&b).await.unwrap();
        let held = lake.active_promotions("j").await.unwrap();
        assert_eq!(
            held.iter()
                .map(|p| (p.namespace.as_str(), p.seq))
                .collect::<Vec<_>>(),
            vec![("a", Some(1)), ("b", Some(2))]
        );
        assert_eq!(authoritative(&held, 60), "b");
        assert_eq!(authoritative(&held, 10), "a");
        let twice = lake.promote(&a).await.unwrap_err();
        assert_eq!(twice.kind(), ErrorKind::Conflict);
        // A second active row for `a`, as a concurrent promotion would have inserted past
        // the check, is refused by the database itself.
        let raw = lake.control_sql(
            "INSERT INTO sw_promotions (catalog_name, job, namespace, job_version, live_table, \
             namespace_table, from_us, to_us, promoted_by, promoted_ms, seq) \
             VALUES ($1, 'j', 'a', 2, 't', 't__a', 0, 100, 't', 3000, 9)",
        );
        let e = sqlx::query(&raw)
            .bind(lake.config().catalog_name.as_str())
            .execute(lake.control_pool())
            .await
            .unwrap_err();
        assert!(
            e.as_database_error()
                .is_some_and(|d| d.is_unique_violation()),
            "{e}"
        );
        // Rolled back, it may be promoted again, after B.
        let rolled = lake.rollback_promotion("j", "a", "t").await.unwrap();
        assert!(rolled.active_at(2_000) && !rolled.active_at(1_999));
        let back_at = rolled.rolled_back_ms.unwrap();
        assert!(rolled.active_at(back_at - 1) && !rolled.active_at(back_at));
        lake.promote(&Promotion {
            promoted_ms: 3_000,
            ..a.clone()
        })
        .await
        .unwrap();
        let held = lake.active_promotions("j").await.unwrap();
        assert_eq!(authoritative(&held, 60), "a");
        // The rollback took the third place in the order, the new promotion the fourth.
        assert_eq!(rolled.rolled_back_seq, Some(3));
        assert_eq!(held.last().unwrap().seq, Some(4));
        // A window's authority epoch grows with each promotion and rollback spanning it.
        let all = lake.promotions(Some("j")).await.unwrap();
        assert_eq!(authority_epoch(&all, 10), 4);
        assert_eq!(authority_epoch(&all, 120), 2);
        assert_eq!(authority_epoch(&all, 500), 0);
        assert!(serving_version(2, 7) > serving_version(1, 900));
    }

    #[test]
    fn the_latest_covering_promotion_wins() {
        let ps = [p("a", 0, 100, false), p("b", 50, 150, false)];
        assert_eq!(authoritative(&ps, -1), "live");
        assert_eq!(authoritative(&ps, 0), "a");
        assert_eq!(authoritative(&ps, 50), "b");
        assert_eq!(authoritative(&ps, 149), "b");
        assert_eq!(authoritative(&ps, 150), "live");
        let rolled = [p("a", 0, 100, false), p("b", 50, 150, true)];
        assert_eq!(authoritative(&rolled, 60), "a");
    }
}
