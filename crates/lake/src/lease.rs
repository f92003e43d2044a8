//! Leases in the catalog database: one owner at a time for a (scope, job, namespace), such
//! as the one process that runs a live job. An owner renews its lease well within its time
//! to live; another owner takes it only once it has run out, or at once when the holder
//! was a process of this host that is gone (a kill -9 and restart need not wait).
//!
//! Each tenure has a generation: a takeover counts it up, a renewal keeps it. A lease
//! taken is a [`LeaseFence`], and a write that passes it to the catalog database (a
//! table's commit, a checkpoint's record) lands only while the lease is still that
//! tenure's, checked in the write's own transaction with the lease's row locked. Time
//! bounds when a holder stops trying; the fence is what keeps a holder that was paused
//! past its lease, and then wakes, from committing over the next owner's work.

use std::time::Duration;

use signalweave_model::ErrorKind;
use sqlx::Row;

use crate::error::{LakeError, Result};
use crate::lake::Lake;

/// A lease as its owner took it: the tenure its writes are fenced by (see the module
/// documentation and [`Lake::fence`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseFence {
    /// What kind of lease (the live jobs' is `live`).
    pub scope: String,
    /// The job it is the lease of.
    pub job: String,
    /// The job's namespace.
    pub namespace: String,
    /// Who took it (see [`lease_owner`]).
    pub owner: String,
    /// Counted up by every takeover; a renewal keeps it.
    pub generation: i64,
}

/// Who takes a lease: this host, this process, and a run of it (so two runs in one process
/// are two owners).
pub fn lease_owner(run: &str) -> String {
    format!("{}:{}:{run}", host_name(), std::process::id())
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into())
}

/// Whether `owner` (as [`lease_owner`] wrote it) names a process of this host that no
/// longer exists. Unknown when it cannot tell: then false.
fn owner_gone(owner: &str) -> bool {
    let mut parts = owner.splitn(3, ':');
    let (Some(host), Some(pid)) = (parts.next(), parts.next()) else {
        return false;
    };
    let Ok(pid) = pid.parse::<u32>() else {
        return false;
    };
    host == host_name()
        && pid != std::process::id()
        && std::path::Path::new("/proc/self").exists()
        && !std::path::Path::new(&format!("/proc/{pid}")).exists()
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

impl Lake {
    async fn create_leases_table(&self) -> Result<()> {
        self.leases_table
            .get_or_try_init(|| async {
                let _ddl = crate::lake::ddl_lock(self.config(), self.control_pool()).await?;
                sqlx::query(
                    "CREATE TABLE IF NOT EXISTS sw_leases (catalog_name VARCHAR(255) NOT NULL, \
                     scope VARCHAR(64) NOT NULL, job VARCHAR(255) NOT NULL, \
                     namespace VARCHAR(255) NOT NULL, owner VARCHAR(255) NOT NULL, \
                     lease_until_ms BIGINT NOT NULL, generation BIGINT NOT NULL DEFAULT 0, \
                     PRIMARY KEY (catalog_name, scope, job, namespace))",
                )
                .execute(self.control_pool())
                .await
                .map_err(|e| LakeError::sql("create sw_leases", e))?;
                // Tables created before generations were counted get the column. (While
                // a binary from before still runs, its takeovers do not count it up.)
                let has_generation = sqlx::query("SELECT generation FROM sw_leases WHERE 1 = 0")
                    .execute(self.control_pool())
                    .await
                    .is_ok();
                if !has_generation
                    && let Err(e) = sqlx::query(
                        "ALTER TABLE sw_leases ADD COLUMN generation BIGINT NOT NULL DEFAULT 0",
                    )
                    .execute(self.control_pool())
                    .await
                {
                    // Another process may have added it meanwhile (the DDL lock does not
                    // reach across processes on SQLite).
                    let added = sqlx::query("SELECT generation FROM sw_leases WHERE 1 = 0")
                        .execute(self.control_pool())
                        .await
                        .is_ok();
                    if !added {
                        return Err(LakeError::sql("add sw_leases.generation", e));
                    }
                }
                Ok::<_, LakeError>(())
            })
            .await?;
        Ok(())
    }

    /// Takes or renews the lease of (`scope`, `job`, `namespace`) for `owner` until `ttl`
    /// from now, and returns its fence: the generation is the one held before when this
    /// renews `owner`'s own lease, and the next one when it takes the lease over. Fails
    /// with `Conflict`, naming the holder and how long its lease still runs, while another
    /// owner holds it; a holder that was a process of this host and is gone loses it at
    /// once.
    pub async fn take_lease(
        &self,
        scope: &str,
        job: &str,
        namespace: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<LeaseFence> {
        self.create_leases_table().await?;
        let catalog = self.config().catalog_name.as_str();
        let now = now_ms();
        let until = now + i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX / 2);
        sqlx::query(&self.control_sql(
            "INSERT INTO sw_leases (catalog_name, scope, job, namespace, owner, lease_until_ms) \
             VALUES ($1, $2, $3, $4, $5, $6) \
             ON CONFLICT (catalog_name, scope, job, namespace) DO NOTHING",
        ))
        .bind(catalog)
        .bind(scope)
        .bind(job)
        .bind(namespace)
        .bind(owner)
        .bind(until)
        .execute(self.control_pool())
        .await
        .map_err(|e| LakeError::sql("create a lease", e))?;
        let holder = sqlx::query(&self.control_sql(
            "SELECT owner, lease_until_ms, generation FROM sw_leases \
             WHERE catalog_name = $1 AND scope = $2 AND job = $3 AND namespace = $4",
        ))
        .bind(catalog)
        .bind(scope)
        .bind(job)
        .bind(namespace)
        .fetch_optional(self.control_pool())
        .await
        .map_err(|e| LakeError::sql("read a lease", e))?
        .map(|r| {
            (
                r.get::<String, _>(0),
                r.get::<i64, _>(1),
                r.get::<i64, _>(2),
            )
        });
        let Some((held_by, held_until, held_generation)) = holder else {
            return Err(LakeError::new(
                ErrorKind::Unavailable,
                format!("the lease of {job} ({namespace}) vanished while it was taken"),
            ));
        };
        let free = held_by == owner || held_until < now || owner_gone(&held_by);
        if free {
            // A renewal holds while the owner does, whatever another renewal of the same
            // owner wrote meanwhile (two in flight must not fence the owner out of its own
            // lease). A takeover holds only from the holder just read: a race with
            // another taker has one winner. Either holds only in the tenure just read.
            let generation = if held_by == owner {
                held_generation
            } else {
                held_generation + 1
            };
            let n = sqlx::query(&self.control_sql(
                "UPDATE sw_leases SET owner = $1, lease_until_ms = $2, generation = $9 \
                 WHERE catalog_name = $3 AND scope = $4 AND job = $5 AND namespace = $6 \
                 AND owner = $7 AND (owner = $1 OR lease_until_ms = $8) AND generation = $10",
            ))
            .bind(owner)
            .bind(until)
            .bind(catalog)
            .bind(scope)
            .bind(job)
            .bind(namespace)
            .bind(&held_by)
            .bind(held_until)
            .bind(generation)
            .bind(held_generation)
            .execute(self.control_pool())
            .await
            .map_err(|e| LakeError::sql("take a lease", e))?
            .rows_affected();
            if n == 1 {
                if held_by != owner {
                    tracing::info!(scope, job, namespace, previous = %held_by, generation, "lease taken over");
                }
                return Ok(LeaseFence {
                    scope: scope.to_string(),
                    job: job.to_string(),
                    namespace: namespace.to_string(),
                    owner: owner.to_string(),
                    generation,
                });
            }
        }
        Err(LakeError::new(
            ErrorKind::Conflict,
            format!(
                "{job} ({namespace}) is run by {held_by} (its lease runs {} ms more): one \
                 instance at a time",
                (held_until - now).max(0)
            ),
        ))
    }

    /// Checks, inside `tx`, that `fence`'s tenure still holds its lease, and locks the
    /// lease's row until `tx` ends (it is updated in place), so that no takeover commits
    /// in between: what `tx` then writes lands only in that tenure. `Conflict` when another
    /// owner has taken the lease since, even if it has given it up again. The lease need
    /// not still be in time: while no one took it over, no one else wrote.
    ///
    /// Call it first in `tx`: on SQLite, the update takes the database's write lock
    /// before anything is read.
    pub async fn fence(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Any>,
        fence: &LeaseFence,
    ) -> Result<()> {
        let held = sqlx::query(&self.control_sql(
            "UPDATE sw_leases SET generation = generation \
             WHERE catalog_name = $1 AND scope = $2 AND job = $3 AND namespace = $4 \
             AND owner = $5 AND generation = $6",
        ))
        .bind(self.config().catalog_name.as_str())
        .bind(&fence.scope)
        .bind(&fence.job)
        .bind(&fence.namespace)
        .bind(&fence.owner)
        .bind(fence.generation)
        .execute(&mut **tx)
        .await
        .map_err(|e| LakeError::sql("check the lease", e))?
        .rows_affected();
        if held == 1 {
            return Ok(());
        }
        Err(LakeError::new(
            ErrorKind::Conflict,
            format!(
                "the lease of {} ({}) is no longer {}'s: it has been taken over since tenure {} \
                 began, and this write was refused",
                fence.job, fence.namespace, fence.owner, fence.generation
            ),
        ))
    }

    /// Whether `fence`'s tenure still holds its lease now ([`Lake::fence`] in a
    /// transaction of its own, rolled back).
    pub async fn check_fence(&self, fence: &LeaseFence) -> Result<()> {
        let mut tx = self
            .control_pool()
            .begin()
            .await
            .map_err(|e| LakeError::sql("begin a lease check", e))?;
        let held = self.fence(&mut tx, fence).await;
        let _ = tx.rollback().await;
        held
    }

    /// Gives a lease up (a clean stop), so the next owner need not wait for it.
    pub async fn release_lease(
        &self,
        scope: &str,
        job: &str,
        namespace: &str,
        owner: &str,
    ) -> Result<()> {
        self.create_leases_table().await?;
        sqlx::query(&self.control_sql(
            "UPDATE sw_leases SET lease_until_ms = 0 \
             WHERE catalog_name = $1 AND scope = $2 AND job = $3 AND namespace = $4 AND owner = $5",
        ))
        .bind(self.config().catalog_name.as_str())
        .bind(scope)
        .bind(job)
        .bind(namespace)
        .bind(owner)
        .execute(self.control_pool())
        .await
        .map_err(|e| LakeError::sql("release a lease", e))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lease table from before generations were counted gets the column; its leases
    /// stay in their tenure, and a takeover counts it up.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lease_table_without_generations_gets_them() {
        let dir = tempfile::tempdir().expect("tempdir");
        let lake = Lake::open(crate::LakeConfig::embedded(dir.path()))
            .await
            .expect("open");
        sqlx::query(
            "CREATE TABLE sw_leases (catalog_name VARCHAR(255) NOT NULL, \
             scope VARCHAR(64) NOT NULL, job VARCHAR(255) NOT NULL, \
             namespace VARCHAR(255) NOT NULL, owner VARCHAR(255) NOT NULL, \
             lease_until_ms BIGINT NOT NULL, \
             PRIMARY KEY (catalog_name, scope, job, namespace))",
        )
        .execute(lake.control_pool())
        .await
        .expect("the old table");
        sqlx::query("INSERT INTO sw_leases VALUES ($1, 'live', 'job', 'ns', 'host:1:a', 0)")
            .bind(lake.config().catalog_name.as_str())
            .execute(lake.control_pool())
            .await
            .expect("an old lease");
        let ttl = Duration::from_secs(60);
        let a = lake
            .take_lease("live", "job", "ns", "host:1:a", ttl)
            .await
            .expect("renewed");
        assert_eq!(a.generation, 0);
        lake.release_lease("live", "job", "ns", "host:1:a")
            .await
            .expect("released");
        let b = lake
            .take_lease("live", "job", "ns", "host:1:b", ttl)
            .await
            .expect("taken over");
        assert_eq!(b.generation, 1);
    }

    #[test]
    fn a_gone_process_of_this_host_is_told_apart() {
        let me = lease_owner("a");
        assert!(!owner_gone(&me), "this process is not gone");
        // No process has pid 4,000,000,000 (above Linux's pid_max).
        let gone = format!("{}:4000000000:run", host_name());
        assert!(owner_gone(&gone));
        assert!(!owner_gone("another-host:4000000000:run"));
        assert!(!owner_gone("garbage"));
    }
}
