//! Checkpoints: the source position, the window-engine state and the sink epoch, recorded
//! together.
//!
//! A checkpoint of epoch `e` is one blob in object storage (`_signalweave/checkpoints/
//! <catalog>/<job>/<namespace>/<e>-<uuid>.ckpt`) and one row in `sw_checkpoints` naming it. The job's
//! current checkpoint is the epoch in `sw_checkpoint_pointers`, moved by compare-and-set
//! in the catalog database (never by S3 conditional writes).
//!
//! The blob (see [`Checkpoint::to_bytes`]) also carries the late records the epoch
//! classified, so the sink can commit them again after a crash: the sink commit of epoch
//! `e` (its outputs first) is the commit point, and a restart that finds it rolls the
//! pointer forward to `e` (see [`crate::live`]). The epoch's outputs are not stored: a
//! checkpoint becomes current only once they are committed.
//!
//! Retention: the current checkpoint and the [`CheckpointStore::retire`]`(keep)` newest
//! before it are kept; older rows and blobs are deleted, and so are prepared checkpoints
//! newer than the pointer that no sink commit made current (a crash's leftovers).

use serde::{Deserialize, Serialize};
use signalweave_lake::{Lake, LeaseFence};
use signalweave_model::ErrorKind;
use signalweave_window::Emissions;

use crate::error::{Result, RunnerError};
use crate::late::LateEvent;

/// Version of the checkpoint blob format.
pub const CHECKPOINT_FORMAT_VERSION: u32 = 1;
const MAGIC: &[u8; 4] = b"SWCK";

/// One checkpoint: what the job had processed and held at the end of an epoch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// Job name.
    pub job: String,
    /// Output namespace.
    pub namespace: String,
    /// Job version of the spec that wrote it.
    pub job_version: u32,
    /// Epoch (1, 2, ...): the sink commits of this checkpoint carry it.
    pub epoch: u64,
    /// Last processed snapshot of the source (None: nothing read yet).
    pub position: Option<i64>,
    /// The window engine's state (its own versioned format).
    pub engine_state: Vec<u8>,
    /// Output rows emitted in this epoch, committed by the sink. Not stored in the blob
    /// (empty after [`Checkpoint::from_bytes`]): a checkpoint is current only once they
    /// are committed.
    pub outputs: Emissions,
    /// The source snapshot each of `outputs` reflects (the position after the step that
    /// emitted it). Not stored either.
    pub output_snapshots: Vec<Option<i64>>,
    /// Late records classified in this epoch, committed to `late_events`.
    pub late: Vec<LateEvent>,
    /// When it was taken, ms since the epoch.
    pub created_ms: i64,
}

/// The checkpoint without its engine state (encoded with postcard; the state follows raw).
#[derive(Serialize, Deserialize)]
struct Meta {
    job: String,
    namespace: String,
    job_version: u32,
    epoch: u64,
    position: Option<i64>,
    late: Vec<LateEvent>,
    created_ms: i64,
}

impl Checkpoint {
    /// The blob: magic, format version (`u32`), the length of the metadata (`u64`), the
    /// metadata (postcard), then the engine state as it is (already a versioned format;
    /// copied, not re-encoded).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let meta = Meta {
            job: self.job.clone(),
            namespace: self.namespace.clone(),
            job_version: self.job_version,
            epoch: self.epoch,
            position: self.position,
            late: self.late.clone(),
            created_ms: self.created_ms,
        };
        let meta = postcard::to_stdvec(&meta).map_err(|e| {
            RunnerError::new(ErrorKind::Internal, format!("encode checkpoint: {e}"))
        })?;
        let mut out = Vec::with_capacity(16 + meta.len() + self.engine_state.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&CHECKPOINT_FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&(meta.len() as u64).to_le_bytes());
        out.extend_from_slice(&meta);
        out.extend_from_slice(&self.engine_state);
        Ok(out)
    }

    /// Parses a blob written by [`Checkpoint::to_bytes`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let invalid = |what: &str| {
            RunnerError::new(
                ErrorKind::InvalidInput,
                format!("not a SignalWeave checkpoint: {what}"),
            )
        };
        if bytes.len() < 16 || &bytes[..4] != MAGIC {
            return Err(invalid("bad magic"));
        }
        let version = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
        if version != CHECKPOINT_FORMAT_VERSION {
            return Err(RunnerError::new(
                ErrorKind::Config,
                format!(
                    "checkpoint format {version} is not supported (this build reads {CHECKPOINT_FORMAT_VERSION})"
                ),
            ));
        }
        let mut len = [0u8; 8];
        len.copy_from_slice(&bytes[8..16]);
        let meta_len = usize::try_from(u64::from_le_bytes(len)).map_err(|_| invalid("length"))?;
        let meta_end = 16usize
            .checked_add(meta_len)
            .ok_or_else(|| invalid("length"))?;
        if meta_end > bytes.len() {
            return Err(invalid("truncated"));
        }
        let meta: Meta = postcard::from_bytes(&bytes[16..meta_end]).map_err(|e| {
            RunnerError::new(ErrorKind::InvalidInput, format!("decode checkpoint: {e}"))
        })?;
        Ok(Self {
            job: meta.job,
            namespace: meta.namespace,
            job_version: meta.job_version,
            epoch: meta.epoch,
            position: meta.position,
            engine_state: bytes[meta_end..].to_vec(),
            outputs: Emissions::default(),
            output_snapshots: Vec::new(),
            late: meta.late,
            created_ms: meta.created_ms,
        })
    }
}

/// A recorded checkpoint (its `sw_checkpoints` row).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckpointRef {
    /// Epoch.
    pub epoch: u64,
    /// Blob location.
    pub location: String,
    /// Source position.
    pub position: Option<i64>,
    /// Blob size, bytes.
    pub bytes: u64,
    /// When it was taken, ms since the epoch.
    pub created_ms: i64,
}

/// Checkpoints of one job and namespace.
#[derive(Debug, Clone)]
pub struct CheckpointStore {
    lake: Lake,
    job: String,
    namespace: String,
}

impl CheckpointStore {
    /// The store of `job` in `namespace`. Creates the control tables where missing.
    pub async fn open(lake: Lake, job: &str, namespace: &str) -> Result<Self> {
        let store = Self {
            lake,
            job: job.to_string(),
            namespace: namespace.to_string(),
        };
        store.create_tables().await?;
        Ok(store)
    }

    async fn create_tables(&self) -> Result<()> {
        for ddl in [
            "CREATE TABLE IF NOT EXISTS sw_checkpoints (catalog_name VARCHAR(255) NOT NULL, \
             job VARCHAR(255) NOT NULL, namespace VARCHAR(255) NOT NULL, epoch BIGINT NOT NULL, \
             location VARCHAR(2000) NOT NULL, source_position BIGINT, blob_bytes BIGINT NOT NULL, \
             created_ms BIGINT NOT NULL, PRIMARY KEY (catalog_name, job, namespace, epoch))",
            "CREATE TABLE IF NOT EXISTS sw_checkpoint_pointers (catalog_name VARCHAR(255) NOT NULL, \
             job VARCHAR(255) NOT NULL, namespace VARCHAR(255) NOT NULL, epoch BIGINT NOT NULL, \
             updated_ms BIGINT NOT NULL, PRIMARY KEY (catalog_name, job, namespace))",
        ] {
            sqlx::query(ddl)
                .execute(self.lake.control_pool())
                .await
                .map_err(|e| RunnerError::sql("create checkpoint tables", e))?;
        }
        Ok(())
    }

    /// `$n` placeholders for PostgreSQL, `?n` for SQLite.
    fn q(&self, sql: &str) -> String {
        self.lake.control_sql(sql)
    }

    fn catalog(&self) -> &str {
        &self.lake.config().catalog_name
    }

    /// The holder name of this job's snapshot holds.
    pub fn holder(&self) -> String {
        format!("job:{}:{}", self.job, self.namespace)
    }

    /// A transaction of the catalog database, fenced by `fence` when there is one (see
    /// [`Lake::fence`]): what it writes lands only in the lease's tenure.
    async fn begin(
        &self,
        fence: Option<&LeaseFence>,
    ) -> Result<sqlx::Transaction<'static, sqlx::Any>> {
        let mut tx = self
            .lake
            .control_pool()
            .begin()
            .await
            .map_err(|e| RunnerError::sql("begin a checkpoint's record", e))?;
        if let Some(fence) = fence {
            self.lake.fence(&mut tx, fence).await?;
        }
        Ok(tx)
    }

    /// Writes `checkpoint`'s blob and records it as prepared (not yet current), in
    /// `fence`'s lease tenure when there is one.
    pub async fn write(
        &self,
        checkpoint: &Checkpoint,
        fence: Option<&LeaseFence>,
    ) -> Result<CheckpointRef> {
        let t = std::time::Instant::now();
        let bytes = checkpoint.to_bytes()?;
        let size = bytes.len() as u64;
        let encoded_ms = t.elapsed().as_millis();
        let location = self.lake.blob_location(&format!(
            "checkpoints/{}/{}/{}/{:012}-{}.ckpt",
            self.catalog(),
            self.job,
            self.namespace,
            checkpoint.epoch,
            uuid::Uuid::new_v4().simple()
        ));
        self.lake.put_blob(&location, bytes).await?;
        tracing::debug!(job = %self.job, epoch = checkpoint.epoch, encoded_ms, written_ms = t.elapsed().as_millis() - encoded_ms, "checkpoint blob");
        // A crash's leftover row for the same epoch is replaced (its blob is deleted below).
        let old = self.row(checkpoint.epoch).await?;
        let recorded = self.record(checkpoint, &location, size, fence).await;
        if let Err(e) = recorded {
            // Refused (a fence that no longer holds), the blob is garbage: nothing names
            // it. (Another failure may have come after the commit took.)
            if e.kind() == ErrorKind::Conflict
                && let Err(d) = self.lake.delete_blob(&location).await
            {
                tracing::warn!(%location, error = %d, "could not delete an unrecorded checkpoint blob");
            }
            return Err(e);
        }
        if let Some(old) = old
            && old.location != location
            && let Err(e) = self.lake.delete_blob(&old.location).await
        {
            tracing::warn!(location = %old.location, error = %e, "could not delete a replaced checkpoint blob");
        }
        Ok(CheckpointRef {
            epoch: checkpoint.epoch,
            location,
            position: checkpoint.position,
            bytes: size,
            created_ms: checkpoint.created_ms,
        })
    }

    /// Records `checkpoint`, its blob at `location`, as prepared: one transaction replaces
    /// a crash's leftover row of the same epoch.
    async fn record(
        &self,
        checkpoint: &Checkpoint,
        location: &str,
        size: u64,
        fence: Option<&LeaseFence>,
    ) -> Result<()> {
        let mut tx = self.begin(fence).await?;
        sqlx::query(
            &self.q("DELETE FROM sw_checkpoints WHERE catalog_name = $1 AND job = $2 AND namespace = $3 AND epoch = $4"),
        )
        .bind(self.catalog())
        .bind(&self.job)
        .bind(&self.namespace)
        .bind(checkpoint.epoch as i64)
        .execute(&mut *tx)
        .await
        .map_err(|e| RunnerError::sql("replace a prepared checkpoint", e))?;
        sqlx::query(&self.q(
            "INSERT INTO sw_checkpoints (catalog_name, job, namespace, epoch, location, source_position, blob_bytes, created_ms) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        ))
        .bind(self.catalog())
        .bind(&self.job)
        .bind(&self.namespace)
        .bind(checkpoint.epoch as i64)
        .bind(location)
        .bind(checkpoint.position)
        .bind(size as i64)
        .bind(checkpoint.created_ms)
        .execute(&mut *tx)
        .await
        .map_err(|e| RunnerError::sql("record a checkpoint", e))?;
        tx.commit()
            .await
            .map_err(|e| RunnerError::sql("commit a checkpoint's record", e))
    }

    /// The current epoch (None: the job has never checkpointed).
    pub async fn pointer(&self) -> Result<Option<u64>> {
        let row: Option<(i64,)> = sqlx::query_as(
            &self.q("SELECT epoch FROM sw_checkpoint_pointers WHERE catalog_name = $1 AND job = $2 AND namespace = $3"),
        )
        .bind(self.catalog())
        .bind(&self.job)
        .bind(&self.namespace)
        .fetch_optional(self.lake.control_pool())
        .await
        .map_err(|e| RunnerError::sql("read the checkpoint pointer", e))?;
        Ok(row.map(|(e,)| e as u64))
    }

    /// Moves the pointer from `from` to `to` by compare-and-set, in `fence`'s lease
    /// tenure when there is one. `Conflict` when it was not at `from` (another instance of
    /// the job moved it), or when the fence no longer holds.
    pub async fn advance(
        &self,
        from: Option<u64>,
        to: u64,
        fence: Option<&LeaseFence>,
    ) -> Result<()> {
        let now = chrono::Utc::now().timestamp_millis();
        let mut tx = self.begin(fence).await?;
        let moved = match from {
            None => sqlx::query(&self.q(
                "INSERT INTO sw_checkpoint_pointers (catalog_name, job, namespace, epoch, updated_ms) VALUES ($1, $2, $3, $4, $5)",
            ))
            .bind(self.catalog())
            .bind(&self.job)
            .bind(&self.namespace)
            .bind(to as i64)
            .bind(now)
            .execute(&mut *tx)
            .await
            .map(|r| r.rows_affected())
            .or_else(|e| match e {
                sqlx::Error::Database(d) if d.is_unique_violation() => Ok(0),
                e => Err(RunnerError::sql("create the checkpoint pointer", e)),
            })?,
            Some(from) => sqlx::query(&self.q(
                "UPDATE sw_checkpoint_pointers SET epoch = $1, updated_ms = $2 \
                 WHERE catalog_name = $3 AND job = $4 AND namespace = $5 AND epoch = $6",
            ))
            .bind(to as i64)
            .bind(now)
            .bind(self.catalog())
            .bind(&self.job)
            .bind(&self.namespace)
            .bind(from as i64)
            .execute(&mut *tx)
            .await
            .map_err(|e| RunnerError::sql("move the checkpoint pointer", e))?
            .rows_affected(),
        };
        if moved == 1 {
            return tx
                .commit()
                .await
                .map_err(|e| RunnerError::sql("commit the checkpoint pointer", e));
        }
        let _ = tx.rollback().await;
        Err(RunnerError::new(
            ErrorKind::Conflict,
            format!(
                "the checkpoint pointer of {}/{} is no longer at epoch {}: another instance of the job is running",
                self.job,
                self.namespace,
                from.map(|e| e.to_string())
                    .unwrap_or_else(|| "(none)".into())
            ),
        ))
    }

    async fn row(&self, epoch: u64) -> Result<Option<CheckpointRef>> {
        Ok(self
            .rows(&self.q(
                "SELECT epoch, location, source_position, blob_bytes, created_ms FROM sw_checkpoints \
                 WHERE catalog_name = $1 AND job = $2 AND namespace = $3 AND epoch = $4",
            ), Some(epoch))
            .await?
            .pop())
    }

    async fn rows(&self, sql: &str, epoch: Option<u64>) -> Result<Vec<CheckpointRef>> {
        let mut conn = self
            .lake
            .control_pool()
            .acquire()
            .await
            .map_err(|e| RunnerError::sql("read checkpoints", e))?;
        self.rows_in(&mut conn, sql, epoch).await
    }

    /// [`CheckpointStore::rows`] on `conn` (a transaction's, say).
    async fn rows_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        sql: &str,
        epoch: Option<u64>,
    ) -> Result<Vec<CheckpointRef>> {
        let mut query = sqlx::query_as::<_, (i64, String, Option<i64>, i64, i64)>(sql)
            .bind(self.catalog())
            .bind(&self.job)
            .bind(&self.namespace);
        if let Some(e) = epoch {
            query = query.bind(e as i64);
        }
        let rows = query
            .fetch_all(conn)
            .await
            .map_err(|e| RunnerError::sql("read checkpoints", e))?;
        Ok(rows
            .into_iter()
            .map(
                |(epoch, location, position, bytes, created_ms)| CheckpointRef {
                    epoch: epoch as u64,
                    location,
                    position,
                    bytes: bytes as u64,
                    created_ms,
                },
            )
            .collect())
    }

    /// Every recorded checkpoint, newest first.
    pub async fn list(&self) -> Result<Vec<CheckpointRef>> {
        self.rows(&self.list_sql(), None).await
    }

    fn list_sql(&self) -> String {
        self.q(
            "SELECT epoch, location, source_position, blob_bytes, created_ms FROM sw_checkpoints \
             WHERE catalog_name = $1 AND job = $2 AND namespace = $3 ORDER BY epoch DESC",
        )
    }

    /// Loads the checkpoint of `epoch`.
    pub async fn load(&self, epoch: u64) -> Result<(CheckpointRef, Checkpoint)> {
        let r = self.row(epoch).await?.ok_or_else(|| {
            RunnerError::new(
                ErrorKind::NotFound,
                format!(
                    "checkpoint {epoch} of {}/{} is not recorded",
                    self.job, self.namespace
                ),
            )
        })?;
        let bytes = self.lake.get_blob(&r.location).await?;
        let checkpoint = Checkpoint::from_bytes(&bytes)?;
        if checkpoint.epoch != epoch || checkpoint.job != self.job {
            return Err(RunnerError::new(
                ErrorKind::Internal,
                format!(
                    "checkpoint blob {} is not epoch {epoch} of {}",
                    r.location, self.job
                ),
            ));
        }
        Ok((r, checkpoint))
    }

    /// Applies the retention rule around the current epoch `current`: keeps it and the
    /// `keep` newest before it; deletes older checkpoints and every prepared one newer
    /// than `current`. Returns how many it deleted. With a `fence`, only in its lease's
    /// tenure: the newer ones may be another instance's, once it has taken the job over.
    pub async fn retire(
        &self,
        current: u64,
        keep: usize,
        fence: Option<&LeaseFence>,
    ) -> Result<usize> {
        let doomed_of = |all: Vec<CheckpointRef>| {
            let mut older_kept = 0;
            let mut doomed = Vec::new();
            for r in all {
                if r.epoch > current {
                    doomed.push(r);
                } else if r.epoch < current {
                    if older_kept < keep {
                        older_kept += 1;
                    } else {
                        doomed.push(r);
                    }
                }
            }
            doomed
        };
        // Most epochs retire nothing: no write lock is taken for them.
        if doomed_of(self.list().await?).is_empty() {
            return Ok(0);
        }
        // Fenced first: from here to the commit no other tenure writes, so the list read
        // again in the transaction is the one the deletes apply to.
        let mut tx = self.begin(fence).await?;
        let doomed = doomed_of(self.rows_in(&mut tx, &self.list_sql(), None).await?);
        for r in &doomed {
            sqlx::query(
                &self.q(
                    "DELETE FROM sw_checkpoints WHERE catalog_name = $1 AND job = $2 AND namespace = $3 AND epoch = $4",
                ),
            )
            .bind(self.catalog())
            .bind(&self.job)
            .bind(&self.namespace)
            .bind(r.epoch as i64)
            .execute(&mut *tx)
            .await
            .map_err(|e| RunnerError::sql("delete a checkpoint", e))?;
        }
        tx.commit()
            .await
            .map_err(|e| RunnerError::sql("commit a checkpoint's retirement", e))?;
        // The rows went first: a row never names a deleted blob.
        for r in &doomed {
            if let Err(e) = self.lake.delete_blob(&r.location).await {
                tracing::warn!(location = %r.location, error = %e, "could not delete a checkpoint blob");
            }
        }
        Ok(doomed.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_round_trips_and_a_foreign_blob_is_refused() {
        let c = Checkpoint {
            job: "j".into(),
            namespace: "live".into(),
            job_version: 2,
            epoch: 7,
            position: Some(42),
            engine_state: vec![1, 2, 3],
            outputs: Emissions::default(),
            output_snapshots: Vec::new(),
            late: Vec::new(),
            created_ms: 5,
        };
        let bytes = c.to_bytes().unwrap();
        assert_eq!(Checkpoint::from_bytes(&bytes).unwrap(), c);
        assert_eq!(
            Checkpoint::from_bytes(b"PAR1xxxx").unwrap_err().kind(),
            ErrorKind::InvalidInput
        );
        let mut future = bytes.clone();
        future[4] = 9;
        assert_eq!(
            Checkpoint::from_bytes(&future).unwrap_err().kind(),
            ErrorKind::Config
        );
        assert_eq!(
            Checkpoint::from_bytes(&bytes[..18]).unwrap_err().kind(),
            ErrorKind::InvalidInput
        );
    }
}
