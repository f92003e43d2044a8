//! SQL over the lake: a DataFusion [`SessionContext`] with every SignalWeave table.
//!
//! Tables resolve as `signalweave.<table>` (the default catalog is the lake). Each is a
//! [`LakeTableProvider`]: Iceberg plans the files, DataFusion's Parquet reader scans them.
//! With [`AsOf`], every table is pinned to the snapshot that was current at a moment, or
//! one table to a snapshot id.

use std::sync::Arc;

use datafusion::catalog::{
    CatalogProvider, MemoryCatalogProvider, MemorySchemaProvider, SchemaProvider,
};
use datafusion::prelude::{SessionConfig, SessionContext};
use signalweave_model::ErrorKind;

use crate::config::Warehouse;
use crate::error::{LakeError, Result};
use crate::lake::Lake;
use crate::layout::{LakeTable, NAMESPACE};
use crate::promote::Promotion;
use crate::provider::{LakeTableProvider, SnapshotChoice};

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
    ///
    /// Each job output table `<t>` also gets a view `<t>_current`: the highest
    /// `output_version` of every output identity, without withdrawn (retracted) ones.
    pub async fn session_context(&self) -> Result<SessionContext> {
        let choices: Vec<_> = self
            .all_tables()
            .await?
            .into_iter()
            .map(|t| (t, SnapshotChoice::Current))
            .collect();
        self.context_with(&choices, None).await
    }

    async fn all_tables(&self) -> Result<Vec<LakeTable>> {
        let mut tables = LakeTable::ALL.to_vec();
        tables.extend(self.register_output_tables().await?);
        Ok(tables)
    }

    /// A session whose tables are pinned as `as_of` says. The `_current` views honour the
    /// promotions in force at that moment (of a snapshot id: when that snapshot was made).
    pub async fn session_context_as_of(&self, as_of: AsOf) -> Result<SessionContext> {
        let mut choices = Vec::new();
        let mut pinned_any = false;
        let mut moment = match as_of {
            AsOf::Timestamp(ms) => Some(ms),
            AsOf::Snapshot(_) => None,
        };
        for table in self.all_tables().await? {
            let choice = match as_of {
                // A table whose snapshot of that moment is expired fails when read, not
                // when another table is.
                AsOf::Timestamp(ms) => match self.snapshot_as_of(table, ms).await {
                    Ok(Some(id)) => SnapshotChoice::At(id),
                    Ok(None) => SnapshotChoice::Empty,
                    Err(e) if e.kind() == ErrorKind::NotFound => SnapshotChoice::Expired(ms),
                    Err(e) => return Err(e),
                },
                AsOf::Snapshot(id) => {
                    let t = self.table(table).await?;
                    if let Some(snapshot) = t.metadata().snapshot_by_id(id) {
                        pinned_any = true;
                        moment.get_or_insert(snapshot.timestamp_ms());
                        SnapshotChoice::At(id)
                    } else {
                        SnapshotChoice::Current
                    }
                }
            };
            choices.push((table, choice));
        }
        if let AsOf::Snapshot(id) = as_of
            && !pinned_any
        {
            return Err(LakeError::new(
                ErrorKind::NotFound,
                format!("no table retains snapshot {id}"),
            ));
        }
        self.context_with(&choices, moment).await
    }

    /// A session over `choices`; the `_current` views honour the promotions in force at
    /// `moment` (ms since the epoch; None: now).
    async fn context_with(
        &self,
        choices: &[(LakeTable, SnapshotChoice)],
        moment: Option<i64>,
    ) -> Result<SessionContext> {
        let config = SessionConfig::new()
            .with_default_catalog_and_schema(SQL_CATALOG, NAMESPACE)
            .with_information_schema(true);
        let ctx = SessionContext::new_with_config(config);
        if let Warehouse::S3(s3) = &self.config().warehouse {
            let store = self.s3_store()?;
            let url = url::Url::parse(&format!("s3://{}", s3.bucket))
                .map_err(|e| LakeError::new(ErrorKind::Config, format!("bucket URL: {e}")))?;
            ctx.runtime_env()
                .register_object_store(&url, Arc::new(store));
        }
        let schema = Arc::new(MemorySchemaProvider::new());
        for (table, choice) in choices {
            schema
                .register_table(
                    table.name().to_string(),
                    Arc::new(LakeTableProvider::new(self.clone(), *table, *choice)),
                )
                .map_err(|e| LakeError::datafusion("register table", e))?;
        }
        let catalog = MemoryCatalogProvider::new();
        catalog
            .register_schema(NAMESPACE, schema)
            .map_err(|e| LakeError::datafusion("register schema", e))?;
        ctx.register_catalog(SQL_CATALOG, Arc::new(catalog));
        let promotions = self.promotions(None).await?;
        let registered: Vec<&str> = choices.iter().map(|(t, _)| t.name()).collect();
        for (table, _) in choices.iter().filter(|(t, _)| t.is_output()) {
            let name = table.name();
            // A live table's view honours its active promotions (whose tables exist).
            let promoted: Vec<&Promotion> = promotions
                .iter()
                .filter(|p| {
                    moment.map_or(p.active(), |ms| p.active_at(ms))
                        && p.live_table == name
                        && registered.contains(&p.table.as_str())
                })
                .collect();
            ctx.sql(&format!(
                "CREATE VIEW {SQL_CATALOG}.{NAMESPACE}.{name}_current AS {}",
                current_view(name, &promoted)
            ))
            .await
            .map_err(|e| LakeError::datafusion(format!("create view {name}_current"), e))?;
        }
        Ok(ctx)
    }
}

/// The query of `<t>_current`: the current version of every output identity of `t`.
///
/// With `promoted` (the active promotions of `t`'s job, in promotion order), windows a
/// promotion covers come from its namespace's table instead: the latest covering
/// promotion wins, as in [`crate::authoritative`].
fn current_view(table: &str, promoted: &[&Promotion]) -> String {
    let current = |t: &str, filter: String| {
        format!(
            "SELECT * EXCLUDE (sw_rank) FROM (SELECT *, row_number() OVER \
             (PARTITION BY job, namespace, key, window_start, window_end ORDER BY output_version DESC) \
             AS sw_rank FROM {SQL_CATALOG}.{NAMESPACE}.{t}) WHERE sw_rank = 1 AND NOT retracted{filter}"
        )
    };
    let within = |p: &Promotion| {
        format!(
            "(arrow_cast(window_start, 'Int64') >= {} AND arrow_cast(window_start, 'Int64') < {})",
            p.from_us, p.to_us
        )
    };
    let mut parts = Vec::new();
    let outside_all: String = promoted
        .iter()
        .map(|p| format!(" AND NOT {}", within(p)))
        .collect();
    parts.push(current(table, outside_all));
    for (i, p) in promoted.iter().enumerate() {
        let later: String = promoted[i + 1..]
            .iter()
            .map(|l| format!(" AND NOT {}", within(l)))
            .collect();
        parts.push(current(&p.table, format!(" AND {}{later}", within(p))));
    }
    parts.join(" UNION ALL ")
}

impl Lake {
    /// An object_store client for the S3 warehouse's bucket (listing, DataFusion scans).
    pub(crate) fn s3_store(&self) -> Result<object_store::aws::AmazonS3> {
        let Warehouse::S3(s3) = &self.config().warehouse else {
            return Err(LakeError::new(
                ErrorKind::Config,
                "the warehouse is not on S3",
            ));
        };
        let store = object_store::aws::AmazonS3Builder::new()
            .with_bucket_name(&s3.bucket)
            .with_region(&s3.region)
            .with_access_key_id(&s3.access_key_id)
            .with_secret_access_key(&s3.secret_access_key)
            .with_virtual_hosted_style_request(!s3.path_style)
            .with_allow_http(true);
        match &s3.endpoint {
            Some(e) => store.with_endpoint(e),
            None => store,
        }
        .build()
        .map_err(|e| LakeError::new(ErrorKind::Config, format!("S3 object store: {e}")))
    }
}
