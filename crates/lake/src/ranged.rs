//! A backfill's read of one planned data file: the rows in a time range, with the
//! low-cardinality string columns as dictionaries.
//!
//! Iceberg's reader returns every string column as plain `Utf8`, so a column stored as a
//! dictionary (event type, market, tenant, currency: a handful of values in a million
//! rows) is copied out value by value: a tenth of a backfill's time. This reader asks
//! Parquet for `Dictionary(Int32, Utf8)` wherever every data page of the column is
//! dictionary-encoded, so the values are decoded once per page's dictionary and the rows
//! are indices; the window engine reads both encodings. It selects the pages of the time
//! column's page index that can hold rows in the range, in every column, and filters the
//! rows outside it, as Iceberg's reader does with row selection enabled.
//!
//! It reads only what it can read exactly as Iceberg's reader would: a whole Parquet file
//! without delete files, whose projected columns are found by field id, with the names and
//! the types the table's schema gives them. Anything else is left to Iceberg's reader.

use std::sync::Arc;

use arrow::array::{Array, AsArray, BooleanArray};
use arrow::buffer::BooleanBuffer;
use arrow::datatypes::{DataType, Field, Schema, TimestampMicrosecondType};
use futures::{StreamExt, TryStreamExt};
use iceberg::arrow::{ArrowFileReader, schema_to_arrow_schema};
use iceberg::io::{FileIO, FileMetadata};
use iceberg::scan::{ArrowRecordBatchStream, FileScanTask};
use iceberg::spec::DataFileFormat;
use parquet::arrow::arrow_reader::statistics::StatisticsConverter;
use parquet::arrow::arrow_reader::{
    ArrowPredicateFn, ArrowReaderMetadata, ArrowReaderOptions, RowFilter, RowSelection, RowSelector,
};
use parquet::arrow::{PARQUET_FIELD_ID_META_KEY, ParquetRecordBatchStreamBuilder, ProjectionMask};
use parquet::basic::Encoding;
use parquet::file::metadata::{PageIndexPolicy, ParquetMetaData};

fn parquet_error(e: parquet::errors::ParquetError) -> iceberg::Error {
    iceberg::Error::new(iceberg::ErrorKind::Unexpected, "read a Parquet data file").with_source(e)
}

/// The rows of `task`'s file with `from_us <= time_column < to_us`, `batch_size` at a
/// time, followed by their lineage column when `lineage` asks for it (an error when the
/// file has none: see [`crate::lineage`]); None when the file is not one this reader
/// takes (see the module docs).
pub(crate) async fn open(
    file_io: &FileIO,
    task: &FileScanTask,
    time_column: &str,
    (from_us, to_us): (i64, i64),
    batch_size: usize,
    lineage: bool,
) -> iceberg::Result<Option<ArrowRecordBatchStream>> {
    let Some((file, meta, mut roots)) = open_projected(file_io, task).await? else {
        return Ok(None);
    };
    if lineage {
        match field_index(meta.schema(), crate::lineage::LINEAGE_FIELD_ID) {
            Some(i) if meta.schema().field(i).data_type() == &DataType::Int64 => roots.push(i),
            _ => {
                return Err(iceberg::Error::new(
                    iceberg::ErrorKind::DataInvalid,
                    format!("{}: no row lineage column", task.data_file_path),
                ));
            }
        }
    }
    let file_schema = meta.schema();
    let metadata = meta.metadata();
    let options = ArrowReaderOptions::new().with_page_index_policy(PageIndexPolicy::Optional);
    // The filter reads the time column, projected or not: the table's field of that
    // name, found by its id.
    let Some(time_ix) = task
        .schema
        .field_by_name(time_column)
        .and_then(|f| field_index(file_schema, f.id))
        .filter(|&i| file_schema.field(i).name() == time_column)
    else {
        return Ok(None);
    };
    if !matches!(
        file_schema.field(time_ix).data_type(),
        DataType::Timestamp(arrow::datatypes::TimeUnit::Microsecond, _)
    ) {
        return Ok(None);
    }
    // Strings stored as dictionaries come out as dictionaries.
    let hinted: Vec<Field> = file_schema
        .fields()
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let dictionary = f.data_type() == &DataType::Utf8 && all_dictionary(metadata, i);
            let f = f.as_ref().clone();
            if dictionary {
                f.with_data_type(DataType::Dictionary(
                    Box::new(DataType::Int32),
                    Box::new(DataType::Utf8),
                ))
            } else {
                f
            }
        })
        .collect();
    let hinted = Arc::new(Schema::new_with_metadata(
        hinted,
        file_schema.metadata().clone(),
    ));
    let meta = ArrowReaderMetadata::try_new(Arc::clone(metadata), options.with_schema(hinted))
        .map_err(parquet_error)?;
    let selection = pages_in_range(&meta, time_column, from_us, to_us);
    let descr = meta.metadata().file_metadata().schema_descr_ptr();
    let predicate = ArrowPredicateFn::new(ProjectionMask::roots(&descr, [time_ix]), move |batch| {
        let times = batch.column(0).as_primitive::<TimestampMicrosecondType>();
        let v = times.values();
        let keep = BooleanBuffer::collect_bool(times.len(), |i| v[i] >= from_us && v[i] < to_us);
        Ok(BooleanArray::new(keep, times.nulls().cloned()))
    });
    let mut builder = ParquetRecordBatchStreamBuilder::new_with_metadata(file, meta)
        .with_projection(ProjectionMask::roots(&descr, roots))
        .with_row_filter(RowFilter::new(vec![Box::new(predicate)]))
        .with_batch_size(batch_size);
    if let Some(selection) = selection {
        builder = builder.with_row_selection(selection);
    }
    let stream = builder.build().map_err(parquet_error)?;
    Ok(Some(stream.map_err(parquet_error).boxed()))
}

/// Opens `task`'s file and finds its projected columns by field id, with the names and
/// types the table's schema gives them: the file, its metadata and those columns' roots.
/// None when the file is not one this module reads (see the module docs).
async fn open_projected(
    file_io: &FileIO,
    task: &FileScanTask,
) -> iceberg::Result<Option<(ArrowFileReader, ArrowReaderMetadata, Vec<usize>)>> {
    if !task.deletes.is_empty()
        || task.data_file_format != DataFileFormat::Parquet
        || task.start != 0
        || task.length < task.file_size_in_bytes
    {
        return Ok(None);
    }
    let reader = file_io.new_input(&task.data_file_path)?.reader().await?;
    let mut file = ArrowFileReader::new(
        FileMetadata {
            size: task.file_size_in_bytes,
        },
        reader,
    );
    let options = ArrowReaderOptions::new().with_page_index_policy(PageIndexPolicy::Optional);
    let meta = ArrowReaderMetadata::load_async(&mut file, options)
        .await
        .map_err(parquet_error)?;
    let expected = schema_to_arrow_schema(&task.schema)?;
    let file_schema = meta.schema();
    let metadata = meta.metadata();
    // Flat files only: a field's index is its leaf column's.
    if metadata.file_metadata().schema_descr().num_columns() != file_schema.fields().len() {
        return Ok(None);
    }
    let mut roots = Vec::new();
    for id in &task.project_field_ids {
        let Some(field) = task.schema.field_by_id(*id) else {
            return Ok(None);
        };
        let Some(i) = field_index(file_schema, *id) else {
            return Ok(None);
        };
        let want = expected.field_with_name(&field.name).ok();
        let got = &file_schema.fields()[i];
        if got.name() != &field.name || want.is_none_or(|w| w.data_type() != got.data_type()) {
            return Ok(None);
        }
        roots.push(i);
    }
    Ok(Some((file, meta, roots)))
}

/// The index of the field of `schema` with Parquet field id `id`.
fn field_index(schema: &Schema, id: i32) -> Option<usize> {
    schema.fields().iter().position(|f| {
        f.metadata()
            .get(PARQUET_FIELD_ID_META_KEY)
            .is_some_and(|v| v.parse::<i32>().ok() == Some(id))
    })
}

/// Every row of `task`'s file, its projected columns on the table's types, followed by
/// the file's row lineage column ([`crate::lineage`]) when it has one (the flag says
/// whether it does); `batch_size` rows at a time. None when the file is not one this
/// module reads (see the module docs).
pub(crate) async fn open_whole(
    file_io: &FileIO,
    task: &FileScanTask,
    batch_size: usize,
) -> iceberg::Result<Option<(ArrowRecordBatchStream, bool)>> {
    let Some((file, meta, mut roots)) = open_projected(file_io, task).await? else {
        return Ok(None);
    };
    let lineage = field_index(meta.schema(), crate::lineage::LINEAGE_FIELD_ID);
    if let Some(i) = lineage {
        if meta.schema().field(i).data_type() != &DataType::Int64 {
            return Err(iceberg::Error::new(
                iceberg::ErrorKind::DataInvalid,
                format!(
                    "{}: its row lineage column is not a 64-bit integer",
                    task.data_file_path
                ),
            ));
        }
        roots.push(i);
    }
    let descr = meta.metadata().file_metadata().schema_descr_ptr();
    // Parquet returns the columns in the file's order; they are handed on in the order
    // asked for.
    let mut in_file = roots.clone();
    in_file.sort_unstable();
    in_file.dedup();
    let order: Vec<usize> = roots
        .iter()
        .map(|r| in_file.partition_point(|x| x < r))
        .collect();
    let stream = ParquetRecordBatchStreamBuilder::new_with_metadata(file, meta)
        .with_projection(ProjectionMask::roots(&descr, roots.iter().copied()))
        .with_batch_size(batch_size)
        .build()
        .map_err(parquet_error)?;
    let stream = stream.map_err(parquet_error).and_then(move |b| {
        std::future::ready(b.project(&order).map_err(|e| {
            iceberg::Error::new(iceberg::ErrorKind::Unexpected, "reorder columns read")
                .with_source(e)
        }))
    });
    Ok(Some((stream.boxed(), lineage.is_some())))
}

/// Whether every data page of column `i`, in every row group, is dictionary-encoded.
fn all_dictionary(metadata: &ParquetMetaData, i: usize) -> bool {
    metadata.row_groups().iter().all(|rg| {
        let c = rg.column(i);
        c.dictionary_page_offset().is_some()
            && c.page_encoding_stats_mask().is_some_and(|mask| {
                mask.is_only(Encoding::PLAIN_DICTIONARY) || mask.is_only(Encoding::RLE_DICTIONARY)
            })
    })
}

/// The pages whose `column` statistics can hold a value in `[from_us, to_us)`, as a row
/// selection over the file; None without a usable page index (every page is read).
/// (Iceberg's file reader requires the page index when it loads the metadata, so a file
/// without one fails to open here and goes to Iceberg's reader.)
fn pages_in_range(
    meta: &ArrowReaderMetadata,
    column: &str,
    from_us: i64,
    to_us: i64,
) -> Option<RowSelection> {
    let metadata = meta.metadata();
    let (columns, offsets) = (metadata.column_index()?, metadata.offset_index()?);
    let converter = StatisticsConverter::try_new(
        column,
        meta.schema(),
        metadata.file_metadata().schema_descr(),
    )
    .ok()?;
    let mut selectors = Vec::new();
    for rg in 0..metadata.num_row_groups() {
        // An empty row group has no rows to select; one with rows but without page
        // locations is read whole.
        if metadata.row_group(rg).num_rows() == 0 {
            continue;
        }
        let locations = offsets.get(rg)?.get(converter.parquet_column_index()?)?;
        if locations.page_locations().is_empty() {
            return None;
        }
        let mins = converter.data_page_mins(columns, offsets, [&rg]).ok()?;
        let maxes = converter.data_page_maxes(columns, offsets, [&rg]).ok()?;
        let counts = converter
            .data_page_row_counts(offsets, metadata.row_groups(), [&rg])
            .ok()??;
        let (mins, maxes) = (
            mins.as_primitive_opt::<TimestampMicrosecondType>()?,
            maxes.as_primitive_opt::<TimestampMicrosecondType>()?,
        );
        if mins.len() != counts.len() || maxes.len() != counts.len() {
            return None;
        }
        for p in 0..counts.len() {
            let rows = counts.is_valid(p).then(|| counts.value(p) as usize)?;
            // A page without statistics may hold anything.
            let may_match = mins.is_null(p)
                || maxes.is_null(p)
                || (maxes.value(p) >= from_us && mins.value(p) < to_us);
            selectors.push(if may_match {
                RowSelector::select(rows)
            } else {
                RowSelector::skip(rows)
            });
        }
    }
    Some(RowSelection::from(selectors))
}
