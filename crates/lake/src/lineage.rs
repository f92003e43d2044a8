//! Row lineage: the commit that landed each row, kept through the files the project
//! rewrites.
//!
//! Readers that replay the landing table as a live reader tailed it (a backfill's
//! arrival watermark, reconciliation's oracle) order its rows by commit: the data
//! sequence number of each row's data file. A compaction merges the files of many commits
//! into one, which has one data sequence number, so that order would be lost. So every
//! file the project rewrites (compaction, erasure) carries one more Parquet column,
//! [`LINEAGE_COLUMN`]: each row's data sequence number where it first landed, kept from
//! rewrite to rewrite. It is Iceberg v3's `_last_updated_sequence_number`, with that
//! reserved field id ([`LINEAGE_FIELD_ID`]); it is not in the table's schema, so every
//! Iceberg reader leaves it out of a table scan, as it does a dropped column. A file
//! without the column (one an append wrote) inherits its own data sequence number, as
//! Iceberg's row lineage inherits it.
//!
//! Compaction bins a partition's files in commit order and writes the events table's rows
//! in commit order, each commit's rows as it landed them, so a compacted file read from
//! start to end replays its commits as a reader tailing them read them.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};
use futures::TryStreamExt;
use iceberg::spec::DataFile;
use iceberg::table::Table;
use parquet::arrow::PARQUET_FIELD_ID_META_KEY;
use signalweave_model::ErrorKind;

use crate::error::{LakeError, Result};
use crate::lake::{Lake, on_table_schema, whole_file_task};
use crate::layout::LakeTable;

/// The reserved field id of a row's lineage (Iceberg's `_last_updated_sequence_number`).
pub const LINEAGE_FIELD_ID: i32 =
    iceberg::metadata_columns::RESERVED_FIELD_ID_LAST_UPDATED_SEQUENCE_NUMBER;

/// The name of the lineage column in the files that hold one.
pub const LINEAGE_COLUMN: &str =
    iceberg::metadata_columns::RESERVED_COL_NAME_LAST_UPDATED_SEQUENCE_NUMBER;

/// Rows read back to be rewritten: a batch on the table's schema, and each row's lineage.
pub(crate) type Lineaged = (RecordBatch, ArrayRef);

/// Whether `file` was written with a lineage column (its metrics count the column).
pub(crate) fn has_lineage(file: &DataFile) -> bool {
    file.value_counts().contains_key(&LINEAGE_FIELD_ID)
}

/// `schema` with the lineage field after its own.
pub(crate) fn with_lineage(schema: &iceberg::spec::Schema) -> Result<iceberg::spec::Schema> {
    schema
        .clone()
        .into_builder()
        .with_fields([Arc::clone(
            iceberg::metadata_columns::last_updated_sequence_number_field(),
        )])
        .build()
        .map_err(|e| LakeError::iceberg("a schema with row lineage", e))
}

/// The Arrow schema of `table`'s rows with their lineage after them, as a lineage
/// writer takes them.
pub(crate) fn lineage_schema(table: LakeTable) -> SchemaRef {
    let mut fields: Vec<Arc<Field>> = table.arrow_schema().fields().iter().cloned().collect();
    fields.push(Arc::new(
        Field::new(LINEAGE_COLUMN, DataType::Int64, false).with_metadata(HashMap::from([(
            PARQUET_FIELD_ID_META_KEY.to_string(),
            LINEAGE_FIELD_ID.to_string(),
        )])),
    ));
    Arc::new(Schema::new(fields))
}

/// `batch` (on `table`'s schema) with `lineage` after its columns.
pub(crate) fn attach(
    table: LakeTable,
    batch: &RecordBatch,
    lineage: &ArrayRef,
) -> Result<RecordBatch> {
    let mut columns = batch.columns().to_vec();
    columns.push(Arc::clone(lineage));
    RecordBatch::try_new(lineage_schema(table), columns)
        .map_err(|e| LakeError::arrow(format!("{} rows with their lineage", table.name()), e))
}

impl Lake {
    /// Every row of `file` (a data file of `base`, `table`'s loaded state, with data
    /// sequence number `sequence`) and its lineage: the file's own column when it has one,
    /// else `sequence` for every row. Rewrites read with this, so no row's lineage is lost.
    pub(crate) async fn read_lineaged(
        &self,
        base: &Table,
        table: LakeTable,
        file: &DataFile,
        sequence: i64,
    ) -> Result<Vec<Lineaged>> {
        let md = base.metadata();
        let schema = md.current_schema().clone();
        let field_ids: Vec<i32> = schema.as_struct().fields().iter().map(|f| f.id).collect();
        let task = whole_file_task(
            file,
            &schema,
            &field_ids,
            Some(md.default_partition_spec().clone()),
        );
        let opened = crate::ranged::open_whole(base.file_io(), &task, 8192)
            .await
            .map_err(|e| LakeError::iceberg("read a data file to rewrite", e))?;
        let constant = |b: &RecordBatch| -> ArrayRef {
            Arc::new(Int64Array::from_value(sequence, b.num_rows()))
        };
        let Some((stream, with_column)) = opened else {
            // Not a file the project's reader takes (another writer's): Iceberg's reader
            // reads it, and it must not have a lineage to keep.
            if has_lineage(file) {
                return Err(LakeError::new(
                    ErrorKind::Internal,
                    format!(
                        "{}: a file with row lineage that cannot be read with it",
                        file.file_path()
                    ),
                ));
            }
            let batches = on_table_schema(table, self.read_all(table, vec![task]).await?)?;
            return Ok(batches
                .into_iter()
                .map(|b| {
                    let l = constant(&b);
                    (b, l)
                })
                .collect());
        };
        let batches: Vec<RecordBatch> = stream
            .try_collect()
            .await
            .map_err(|e| LakeError::iceberg("read a data file to rewrite", e))?;
        let schema = table.arrow_schema();
        let own = schema.fields().len();
        batches
            .into_iter()
            .map(|b| {
                let lineage = if with_column {
                    let l = b.column(own);
                    if l.null_count() > 0 || l.as_primitive_opt::<Int64Type>().is_none() {
                        return Err(LakeError::new(
                            ErrorKind::Internal,
                            format!("{}: a row without its lineage", file.file_path()),
                        ));
                    }
                    Arc::clone(l)
                } else {
                    constant(&b)
                };
                let rows = RecordBatch::try_new(Arc::clone(&schema), b.columns()[..own].to_vec())
                    .map_err(|e| LakeError::arrow(format!("{} batch", table.name()), e))?;
                Ok((rows, lineage))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lineage_field_is_icebergs_reserved_one() {
        assert_eq!(LINEAGE_FIELD_ID, i32::MAX - 108);
        assert_eq!(LINEAGE_COLUMN, "_last_updated_sequence_number");
        let schema = lineage_schema(LakeTable::Events);
        let last = schema.fields().last().unwrap();
        assert_eq!(last.name(), LINEAGE_COLUMN);
        assert_eq!(
            last.metadata().get(PARQUET_FIELD_ID_META_KEY),
            Some(&LINEAGE_FIELD_ID.to_string())
        );
    }
}
