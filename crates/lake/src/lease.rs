//! Leases in the catalog database: one owner at a time for a (scope, job, namespace), such
//! as the one process that runs a live job. An owner renews its lease well within its time
//! to live; another owner takes it only once it has run out, or at once when the holder
//! was a process of this host that is gone (a kill -9 and restart need not wait).

use std::time::Duration;

use signalweave_model::ErrorKind;
use sqlx::Row;

use crate::error::{LakeError, Result};
use crate::lake::Lake;

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
                     lease_until_ms BIGINT NOT NULL, \
                     PRIMARY KEY (catalog_name, scope, job, namespace))",
                )
                .execute(self.control_pool())
                .await
                .map_err(|e| LakeError::sql("create sw_leases", e))?;
                Ok::<_, LakeError>(())
            })
            .await?;
        Ok(())
    }

    /// Takes or renews the lease of (`scope`, `job`, `namespace`) for `owner` until `ttl`
    /// from now. Fails with `Conflict`, naming the holder and how long its lease still
    /// runs, while another owner holds it; a holder that was a process of this host and is
    /// gone loses it at once.
    pub async fn take_lease(
        &self,
        scope: &str,
        job: &str,
        namespace: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<()> {
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
            "SELECT owner, lease_until_ms FROM sw_leases \
             WHERE catalog_name = $1 AND scope = $2 AND job = $3 AND namespace = $4",
        ))
        .bind(catalog)
        .bind(scope)
        .bind(job)
        .bind(namespace)
        .fetch_optional(self.control_pool())
        .await
        .map_err(|e| LakeError::sql("read a lease", e))?
        .map(|r| (r.get::<String, _>(0), r.get::<i64, _>(1)));
        let Some((held_by, held_until)) = holder else {
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
            // another taker has one winner.
            let n = sqlx::query(&self.control_sql(
                "UPDATE sw_leases SET owner = $1, lease_until_ms = $2 \
                 WHERE catalog_name = $3 AND scope = $4 AND job = $5 AND namespace = $6 \
                 AND owner = $7 AND (owner = $1 OR lease_until_ms = $8)",
            ))
            .bind(owner)
            .bind(until)
            .bind(catalog)
            .bind(scope)
            .bind(job)
            .bind(namespace)
            .bind(&held_by)
            .bind(held_until)
            .execute(self.control_pool())
            .await
            .map_err(|e| LakeError::sql("take a lease", e))?
            .rows_affected();
            if n == 1 {
                if held_by != owner {
                    tracing::info!(scope, job, namespace, previous = %held_by, "lease taken over");
                }
                return Ok(());
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
