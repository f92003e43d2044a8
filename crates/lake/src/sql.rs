//! SQL over the lake: a DataFusion [`SessionContext`] with every SignalWeave table.
//!
//! Tables resolve as `signalweave.<table>` (the default catalog is the lake). With
//! [`AsOf`], every table is pinned to the snapshot that was current at a moment, or one
//! table to a snapshot id.

use std::sync::Arc;

use datafusion::catalog::{MemoryCatalogProvider, MemorySchemaProvider, SchemaProvider};
use datafusion::prelude::{SessionConfig, SessionContext};
use iceberg_datafusion::{IcebergCatalogProvider, IcebergStaticTableProvider};
use signalweave_model::ErrorKind;

use crate::error::{LakeError, Result};
use crate::lake::Lake;
use crate::layout::{LakeTable, NAMESPACE};

/// Name of the DataFusion catalog holding the lake.
pub const SQL_CATALOG: &str = "lake";

/// Which version of the tables a query reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AsOf {
    /// Each table as it was at this moment (milliseconds since the epoch).
    Timestamp(i64),
    /// The table owning this snapshot id, at that snapshot; others current.
    Snapshot(i64),
}

impl Lake {
    /// A session with every table registered under `signalweave`, reading current snapshots.
    pub async fn session_context(&self) -> Result<SessionContext> {
        let ctx = new_context();
        let provider = IcebergCatalogProvider::try_new(self.catalog())
            .await
            .map_err(|e| LakeError::iceberg("register the lake with DataFusion", e))?;
        ctx.register_catalog(SQL_CATALOG, Arc::new(provider));
        Ok(ctx)
    }

    /// A session whose tables are pinned as `as_of` says.
    pub async fn session_context_as_of(&self, as_of: AsOf) -> Result<SessionContext> {
        let ctx = new_context();
        let schema = Arc::new(MemorySchemaProvider::new());
        let mut pinned_any = false;
        for table in LakeTable::ALL {
            let t = self.table(table).await?;
            let snapshot = match as_of {
                AsOf::Timestamp(ms) => self.snapshot_as_of(table, ms).await?,
                AsOf::Snapshot(id) => t
                    .metadata()
                    .snapshot_by_id(id)
                    .map(|s| s.snapshot_id())
                    .or(t.metadata().current_snapshot_id()),
            };
            pinned_any |= matches!(as_of, AsOf::Snapshot(id) if snapshot == Some(id));
            let provider = match snapshot {
                Some(id) => IcebergStaticTableProvider::try_new_from_table_snapshot(t, id).await,
                None if matches!(as_of, AsOf::Timestamp(_)) => {
                    // The table had no snapshot yet at that moment: it reads as empty.
                    IcebergStaticTableProvider::try_new_from_table(empty_view(t)?).await
                }
                None => IcebergStaticTableProvider::try_new_from_table(t).await,
            }
            .map_err(|e| LakeError::iceberg(format!("pin {}", table.name()), e))?;
            schema
                .register_table(table.name().to_string(), Arc::new(provider))
                .map_err(|e| LakeError::datafusion("register table", e))?;
        }
        if let AsOf::Snapshot(id) = as_of
            && !pinned_any
        {
            return Err(LakeError::new(
                ErrorKind::NotFound,
                format!("no table retains snapshot {id}"),
            ));
        }
        let catalog = MemoryCatalogProvider::new();
        datafusion::catalog::CatalogProvider::register_schema(&catalog, NAMESPACE, schema)
            .map_err(|e| LakeError::datafusion("register schema", e))?;
        ctx.register_catalog(SQL_CATALOG, Arc::new(catalog));
        Ok(ctx)
    }
}

fn new_context() -> SessionContext {
    let config = SessionConfig::new()
        .with_default_catalog_and_schema(SQL_CATALOG, NAMESPACE)
        .with_information_schema(true);
    SessionContext::new_with_config(config)
}

fn empty_view(t: iceberg::table::Table) -> Result<iceberg::table::Table> {
    let mut metadata = (*t.metadata_ref()).clone();
    metadata = iceberg::spec::TableMetadataBuilder::new_from_metadata(metadata, None)
        .remove_ref(iceberg::spec::MAIN_BRANCH)
        .build()
        .map_err(|e| LakeError::iceberg("empty view", e))?
        .metadata;
    iceberg::table::Table::builder()
        .metadata(metadata)
        .identifier(t.identifier().clone())
        .file_io(t.file_io().clone())
        .readonly(true)
        .runtime(iceberg::Runtime::try_current().map_err(|e| LakeError::iceberg("runtime", e))?)
        .build()
        .map_err(|e| LakeError::iceberg("empty view", e))
}
