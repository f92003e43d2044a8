//! [`PinnedCatalog`]: the catalog as an append's commit sees it, pinned to the table the
//! append was checked against.
//!
//! iceberg's `Transaction::commit` reloads the table before committing and, when another
//! writer has moved it, re-applies the transaction on the new table without saying so. An
//! append checks its commit identity against the table it read ([`crate::Lake::committed`]).
//! Re-applied on a table that another writer with the same identity had just moved, the
//! append would land twice. Pinned, the reload returns the table the append read, so the
//! append's requirement (the main branch still at that table's snapshot) is checked
//! against the catalog's current table: a moved table is a commit conflict, which
//! [`crate::Lake::append`] retries from the identity check.
//!
//! An append fenced by a lease ([`crate::LeaseFence`]) commits through the lake's own
//! compare-and-set ([`Lake::swap_metadata`]) rather than the catalog's: the catalog's
//! commit is a statement of its own, and the fence is checked in the same transaction as
//! the pointer's move.

use std::collections::HashMap;
use std::sync::Mutex;

use async_trait::async_trait;
use iceberg::table::Table;
use iceberg::{
    Catalog, Error, ErrorKind, Namespace, NamespaceIdent, Result, TableCommit, TableCreation,
    TableIdent,
};

use crate::error::LakeError;
use crate::lake::Lake;
use crate::lease::LeaseFence;

/// `inner`, except that loading `base`'s table returns `base`, and that with a `fence`,
/// commits are checked against it.
#[derive(Debug)]
pub(crate) struct PinnedCatalog<'a> {
    pub inner: &'a dyn Catalog,
    pub base: &'a Table,
    pub fence: Option<(&'a Lake, &'a LeaseFence)>,
    /// Why a fenced commit was refused (or failed), as the lake says it: iceberg's error
    /// carries only its text.
    pub refused: Mutex<Option<LakeError>>,
}

impl<'a> PinnedCatalog<'a> {
    pub fn new(inner: &'a dyn Catalog, base: &'a Table) -> Self {
        Self {
            inner,
            base,
            fence: None,
            refused: Mutex::new(None),
        }
    }

    /// The lake's error behind a refused fenced commit, if that is why it failed.
    pub fn take_refusal(&self) -> Option<LakeError> {
        self.refused.lock().ok().and_then(|mut r| r.take())
    }
}

#[async_trait]
impl Catalog for PinnedCatalog<'_> {
    async fn list_namespaces(
        &self,
        parent: Option<&NamespaceIdent>,
    ) -> Result<Vec<NamespaceIdent>> {
        self.inner.list_namespaces(parent).await
    }

    async fn create_namespace(
        &self,
        namespace: &NamespaceIdent,
        properties: HashMap<String, String>,
    ) -> Result<Namespace> {
        self.inner.create_namespace(namespace, properties).await
    }

    async fn get_namespace(&self, namespace: &NamespaceIdent) -> Result<Namespace> {
        self.inner.get_namespace(namespace).await
    }

    async fn namespace_exists(&self, namespace: &NamespaceIdent) -> Result<bool> {
        self.inner.namespace_exists(namespace).await
    }

    async fn update_namespace(
        &self,
        namespace: &NamespaceIdent,
        properties: HashMap<String, String>,
    ) -> Result<()> {
        self.inner.update_namespace(namespace, properties).await
    }

    async fn drop_namespace(&self, namespace: &NamespaceIdent) -> Result<()> {
        self.inner.drop_namespace(namespace).await
    }

    async fn list_tables(&self, namespace: &NamespaceIdent) -> Result<Vec<TableIdent>> {
        self.inner.list_tables(namespace).await
    }

    async fn create_table(
        &self,
        namespace: &NamespaceIdent,
        creation: TableCreation,
    ) -> Result<Table> {
        self.inner.create_table(namespace, creation).await
    }

    async fn load_table(&self, table: &TableIdent) -> Result<Table> {
        if table == self.base.identifier() {
            return Ok(self.base.clone());
        }
        self.inner.load_table(table).await
    }

    async fn drop_table(&self, table: &TableIdent) -> Result<()> {
        self.inner.drop_table(table).await
    }

    async fn purge_table(&self, table: &TableIdent) -> Result<()> {
        self.inner.purge_table(table).await
    }

    async fn table_exists(&self, table: &TableIdent) -> Result<bool> {
        self.inner.table_exists(table).await
    }

    async fn rename_table(&self, src: &TableIdent, dest: &TableIdent) -> Result<()> {
        self.inner.rename_table(src, dest).await
    }

    async fn register_table(&self, table: &TableIdent, metadata_location: String) -> Result<Table> {
        self.inner.register_table(table, metadata_location).await
    }

    async fn update_table(&self, commit: TableCommit) -> Result<Table> {
        let Some((lake, fence)) = self.fence else {
            return self.inner.update_table(commit).await;
        };
        let current = self.inner.load_table(commit.identifier()).await?;
        let staged = commit.apply(current.clone())?;
        let location = staged.metadata_location_result()?.to_string();
        match lake
            .swap_metadata(&current, staged.metadata(), &location, None, Some(fence))
            .await
        {
            Ok(None) => Ok(staged),
            Ok(Some(why)) => Err(Error::new(
                ErrorKind::CatalogCommitConflicts,
                format!("commit conflicted: {why}"),
            )
            .with_retryable(true)),
            Err(e) => {
                let message = e.to_string();
                if let Ok(mut r) = self.refused.lock() {
                    *r = Some(e);
                }
                Err(Error::new(ErrorKind::Unexpected, message))
            }
        }
    }
}
