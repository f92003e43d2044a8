//! Blobs beside the tables: checkpoint state and other files SignalWeave keeps in the
//! warehouse outside any table, under `<warehouse>/_signalweave/`. The leading `_` keeps
//! the directory out of every table's location (table names start with a letter), so no
//! table's orphan sweep ever sees it.

use bytes::Bytes;
use signalweave_model::ErrorKind;

use crate::error::{LakeError, Result};
use crate::lake::Lake;
use crate::layout::LakeTable;

impl Lake {
    /// The location of the blob `relative` (a `/`-separated path) in the warehouse.
    pub fn blob_location(&self, relative: &str) -> String {
        format!(
            "{}/_signalweave/{}",
            self.config().warehouse_location().trim_end_matches('/'),
            relative.trim_start_matches('/')
        )
    }

    /// Writes `bytes` to `location` (whole-object put: the object appears complete or not at all).
    pub async fn put_blob(&self, location: &str, bytes: Vec<u8>) -> Result<()> {
        let io = self.table(LakeTable::Events).await?.file_io().clone();
        io.new_output(location)
            .map_err(|e| LakeError::iceberg(format!("open {location}"), e))?
            .write(Bytes::from(bytes))
            .await
            .map_err(|e| LakeError::iceberg(format!("write {location}"), e))
    }

    /// Reads the blob at `location`; `NotFound` when it does not exist.
    pub async fn get_blob(&self, location: &str) -> Result<Bytes> {
        let io = self.table(LakeTable::Events).await?.file_io().clone();
        let input = io
            .new_input(location)
            .map_err(|e| LakeError::iceberg(format!("open {location}"), e))?;
        if !input
            .exists()
            .await
            .map_err(|e| LakeError::iceberg(format!("check {location}"), e))?
        {
            return Err(LakeError::new(
                ErrorKind::NotFound,
                format!("blob {location} does not exist"),
            ));
        }
        input
            .read()
            .await
            .map_err(|e| LakeError::iceberg(format!("read {location}"), e))
    }

    /// Deletes the blob at `location` (nothing when it does not exist).
    pub async fn delete_blob(&self, location: &str) -> Result<()> {
        let io = self.table(LakeTable::Events).await?.file_io().clone();
        io.delete(location)
            .await
            .map_err(|e| LakeError::iceberg(format!("delete {location}"), e))
    }

    /// Checks that the object store answers: the current metadata file of `events` must
    /// be readable. `Unavailable` when it is not (a reader that is idle otherwise learns
    /// of an outage here).
    pub async fn probe_store(&self) -> Result<()> {
        let t = self.table(LakeTable::Events).await?;
        let Some(location) = t.metadata_location() else {
            return Ok(());
        };
        let exists = t.file_io().exists(location).await.map_err(|e| {
            LakeError::new(
                ErrorKind::Unavailable,
                format!("object store probe ({location}): {e}"),
            )
        })?;
        if exists {
            Ok(())
        } else {
            Err(LakeError::new(
                ErrorKind::Unavailable,
                format!("object store probe: {location} is missing"),
            ))
        }
    }
}
