//! [`LakeTableProvider`]: DataFusion reads a SignalWeave table by planning its files with
//! Iceberg (snapshot, day-partition pruning from time-column filters) and scanning them
//! with DataFusion's own Parquet reader (row-group and page pruning, parallel file
//! groups, projection). Filters are `Inexact`: DataFusion still applies them to rows.

use std::any::Any;
use std::sync::Arc;

use arrow_schema::SchemaRef;
use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::common::ScalarValue;
use datafusion::datasource::file_format::FileFormat;
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::{FileGroup, FileScanConfigBuilder, ParquetSource};
use datafusion::datasource::{TableProvider, TableType};
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::logical_expr::{BinaryExpr, Expr, Operator, TableProviderFilterPushDown};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::empty::EmptyExec;

use crate::lake::Lake;
use crate::layout::LakeTable;
use crate::lineage::LINEAGE_COLUMN;

/// Which snapshot a provider reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotChoice {
    /// The current snapshot at each scan.
    Current,
    /// One snapshot.
    At(i64),
    /// Nothing: the table had no snapshot at the requested moment.
    Empty,
    /// The snapshot current at this moment (ms) has been expired: a scan fails, since an
    /// empty answer would be a wrong one.
    Expired(i64),
}

/// The column [`LakeTableProvider::with_commit_sequence`] adds: the sequence number of
/// the data file a row is stored in (the commit order of the append that wrote it, or of
/// the compaction that rewrote it).
pub const COMMIT_SEQUENCE_COLUMN: &str = "sw_commit_sequence";

/// The SQL expression of a row's commit order in a [`LakeTableProvider::with_commit_sequence`]
/// table: its lineage where its file keeps one, else its file's data sequence number.
pub const COMMIT_ORDER: &str = "coalesce(_last_updated_sequence_number, sw_commit_sequence)";

/// A SignalWeave table as a DataFusion table.
#[derive(Debug, Clone)]
pub struct LakeTableProvider {
    lake: Lake,
    table: LakeTable,
    snapshot: SnapshotChoice,
    schema: SchemaRef,
    commit_sequence: bool,
}

impl LakeTableProvider {
    /// A provider of `table` reading `snapshot`.
    ///
    /// String columns are exposed as `Utf8View`, as DataFusion's own Parquet tables do:
    /// the reader then hands out views into the decoded pages instead of copying strings.
    pub fn new(lake: Lake, table: LakeTable, snapshot: SnapshotChoice) -> Self {
        let fields: Vec<arrow_schema::Field> = table
            .arrow_schema()
            .fields()
            .iter()
            .map(|f| match f.data_type() {
                arrow_schema::DataType::Utf8 => f
                    .as_ref()
                    .clone()
                    .with_data_type(arrow_schema::DataType::Utf8View),
                _ => f.as_ref().clone(),
            })
            .collect();
        Self {
            lake,
            table,
            snapshot,
            schema: Arc::new(arrow_schema::Schema::new(fields)),
            commit_sequence: false,
        }
    }

    /// The same table with two more columns, which order its rows by commit as a reader
    /// tailing commits saw them ([`COMMIT_ORDER`] combines them):
    /// - [`LINEAGE_COLUMN`] (`Int64`, null where a file has none): the sequence number
    ///   of the commit that landed the row, in a file the project rewrote (see
    ///   `crate::lineage`);
    /// - [`COMMIT_SEQUENCE_COLUMN`] (`Int64`, from the manifests: a constant per data
    ///   file, read from no data): the data sequence number of the row's file.
    pub fn with_commit_sequence(mut self) -> Self {
        let mut fields: Vec<arrow_schema::FieldRef> =
            self.schema.fields().iter().cloned().collect();
        fields.push(Arc::new(arrow_schema::Field::new(
            LINEAGE_COLUMN,
            arrow_schema::DataType::Int64,
            true,
        )));
        fields.push(Arc::new(arrow_schema::Field::new(
            COMMIT_SEQUENCE_COLUMN,
            arrow_schema::DataType::Int64,
            false,
        )));
        self.schema = Arc::new(arrow_schema::Schema::new(fields));
        self.commit_sequence = true;
        self
    }
}

/// Microseconds of a timestamp literal, whatever its unit.
fn literal_us(value: &ScalarValue) -> Option<i64> {
    match value {
        ScalarValue::TimestampMicrosecond(Some(v), _) => Some(*v),
        ScalarValue::TimestampNanosecond(Some(v), _) => Some(v.div_euclid(1_000)),
        ScalarValue::TimestampMillisecond(Some(v), _) => v.checked_mul(1_000),
        ScalarValue::TimestampSecond(Some(v), _) => v.checked_mul(1_000_000),
        _ => None,
    }
}

fn unwrap_cast(e: &Expr) -> &Expr {
    match e {
        Expr::Cast(c) => unwrap_cast(&c.expr),
        Expr::TryCast(c) => unwrap_cast(&c.expr),
        other => other,
    }
}

/// Calls `f` with each conjunct of `expr` (its `AND`s taken apart).
fn each_conjunct<'a>(expr: &'a Expr, f: &mut impl FnMut(&'a Expr)) {
    match expr {
        Expr::BinaryExpr(BinaryExpr {
            left,
            op: Operator::And,
            right,
        }) => {
            each_conjunct(left, f);
            each_conjunct(right, f);
        }
        other => f(other),
    }
}

/// `expr` as `column <op> literal` (either side, casts unwrapped): the operator as seen
/// from the column, and the literal.
fn compared<'a>(expr: &'a Expr, column: &str) -> Option<(Operator, &'a ScalarValue)> {
    let Expr::BinaryExpr(BinaryExpr { left, op, right }) = expr else {
        return None;
    };
    match (unwrap_cast(left), unwrap_cast(right)) {
        (Expr::Column(c), Expr::Literal(v, _)) if c.name == column => Some((*op, v)),
        (Expr::Literal(v, _), Expr::Column(c)) if c.name == column => Some((op.swap()?, v)),
        _ => None,
    }
}

/// Narrows `[from, to)` (µs) by conjuncts of the form `column <op> timestamp literal`.
fn narrow(expr: &Expr, column: &str, from: &mut i64, to: &mut i64) {
    each_conjunct(expr, &mut |e| {
        if let Some((op, value)) = compared(e, column) {
            let Some(v) = literal_us(value) else { return };
            match op {
                Operator::GtEq => *from = (*from).max(v),
                Operator::Gt => *from = (*from).max(v.saturating_add(1)),
                Operator::Lt => *to = (*to).min(v),
                Operator::LtEq => *to = (*to).min(v.saturating_add(1)),
                Operator::Eq => {
                    *from = (*from).max(v);
                    *to = (*to).min(v.saturating_add(1));
                }
                _ => {}
            }
        } else if let Expr::Between(b) = e
            && !b.negated
            && let (Expr::Column(c), Expr::Literal(lo, _), Expr::Literal(hi, _)) = (
                unwrap_cast(&b.expr),
                unwrap_cast(&b.low),
                unwrap_cast(&b.high),
            )
            && c.name == column
        {
            if let Some(lo) = literal_us(lo) {
                *from = (*from).max(lo);
            }
            if let Some(hi) = literal_us(hi) {
                *to = (*to).min(hi.saturating_add(1));
            }
        }
    });
}

/// Raises `lowest`, the least data sequence number a row can be in, by conjuncts of the
/// form `sw_commit_sequence > n` or `>= n` (the column of
/// [`LakeTableProvider::with_commit_sequence`]).
fn lowest_sequence(expr: &Expr, lowest: &mut i64) {
    each_conjunct(expr, &mut |e| {
        let Some((op, value)) = compared(e, COMMIT_SEQUENCE_COLUMN) else {
            return;
        };
        let n = match value {
            ScalarValue::Int64(Some(n)) => *n,
            ScalarValue::Int32(Some(n)) => i64::from(*n),
            _ => return,
        };
        match op {
            Operator::Gt => *lowest = (*lowest).max(n.saturating_add(1)),
            Operator::GtEq => *lowest = (*lowest).max(n),
            _ => {}
        }
    });
}

/// The object-store URL and path of a data file location.
fn split_location(location: &str) -> (ObjectStoreUrl, String) {
    if let Some(rest) = location.strip_prefix("s3://") {
        let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
        let url = ObjectStoreUrl::parse(format!("s3://{bucket}"))
            .unwrap_or_else(|_| ObjectStoreUrl::local_filesystem());
        return (url, key.to_string());
    }
    let path = location.strip_prefix("file://").unwrap_or(location);
    (
        ObjectStoreUrl::local_filesystem(),
        path.trim_start_matches('/').to_string(),
    )
}

#[async_trait]
impl TableProvider for LakeTableProvider {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> datafusion::error::Result<Vec<TableProviderFilterPushDown>> {
        Ok(vec![TableProviderFilterPushDown::Inexact; filters.len()])
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> datafusion::error::Result<Arc<dyn ExecutionPlan>> {
        let empty = || -> datafusion::error::Result<Arc<dyn ExecutionPlan>> {
            let schema = match projection {
                Some(p) => Arc::new(self.schema.project(p)?),
                None => Arc::clone(&self.schema),
            };
            Ok(Arc::new(EmptyExec::new(schema)))
        };
        let snapshot = match self.snapshot {
            SnapshotChoice::Empty => return empty(),
            SnapshotChoice::Expired(ms) => {
                // The lake's own account of what expired (and when the table was made).
                let why = match self.lake.snapshot_as_of(self.table, ms).await {
                    Err(e) => e.message().to_string(),
                    Ok(_) => format!(
                        "`{}` no longer retains its snapshot of {} (older snapshots expired)",
                        self.table.name(),
                        signalweave_model::format_rfc3339_micros(ms.saturating_mul(1000))
                    ),
                };
                return Err(datafusion::error::DataFusionError::Plan(why));
            }
            SnapshotChoice::Current => None,
            SnapshotChoice::At(id) => Some(id),
        };
        let (mut from, mut to) = (i64::MIN, i64::MAX);
        for f in filters {
            narrow(f, self.table.time_column(), &mut from, &mut to);
        }
        if from >= to {
            return empty();
        }
        let plan = self
            .lake
            .plan_time_range(self.table, from, to, snapshot)
            .await
            .map_err(|e| datafusion::error::DataFusionError::External(Box::new(e)))?;
        let Some(first) = plan.tasks.first() else {
            return empty();
        };
        let (url, _) = split_location(&first.data_file_path);
        let partitions = state.config_options().execution.target_partitions.max(1);
        let sequences = if self.commit_sequence {
            Some(
                self.lake
                    .data_file_sequences(self.table, plan.snapshot_id)
                    .await
                    .map_err(|e| datafusion::error::DataFusionError::External(Box::new(e)))?,
            )
        } else {
            None
        };
        // Files of earlier commits than a filter on the commit sequence asks for hold no row
        // it keeps (a compacted file's sequence is that of the compaction, after its rows').
        let mut lowest = i64::MIN;
        if sequences.is_some() {
            for f in filters {
                lowest_sequence(f, &mut lowest);
            }
        }
        let mut files: Vec<PartitionedFile> = plan
            .tasks
            .iter()
            .filter(|t| {
                sequences.as_ref().is_none_or(|seq| {
                    seq.get(&t.data_file_path).copied().unwrap_or(i64::MAX) >= lowest
                })
            })
            .map(|t| {
                let f =
                    PartitionedFile::new(split_location(&t.data_file_path).1, t.file_size_in_bytes);
                match &sequences {
                    Some(seq) => f.with_partition_values(vec![ScalarValue::Int64(Some(
                        seq.get(&t.data_file_path).copied().unwrap_or(i64::MAX),
                    ))]),
                    None => f,
                }
            })
            .collect();
        if files.is_empty() {
            return empty();
        }
        files.sort_by_key(|f| std::cmp::Reverse(f.object_meta.size));
        // Greedy size-balanced file groups, one per target partition.
        let mut groups: Vec<(u64, Vec<PartitionedFile>)> =
            vec![(0, Vec::new()); partitions.min(files.len())];
        for f in files {
            if let Some(g) = groups.iter_mut().min_by_key(|g| g.0) {
                g.0 += f.object_meta.size;
                g.1.push(f);
            }
        }
        let file_groups: Vec<FileGroup> =
            groups.into_iter().map(|(_, f)| FileGroup::new(f)).collect();
        let source = if self.commit_sequence {
            let n = self.schema.fields().len() - 1;
            let file_schema = Arc::new(arrow_schema::Schema::new(
                self.schema.fields()[..n].to_vec(),
            ));
            Arc::new(ParquetSource::new(
                datafusion::datasource::table_schema::TableSchema::new(
                    file_schema,
                    vec![Arc::clone(&self.schema.fields()[n])],
                ),
            ))
        } else {
            Arc::new(ParquetSource::new(Arc::clone(&self.schema)))
        };
        let config = FileScanConfigBuilder::new(url, source)
            .with_file_groups(file_groups)
            .with_projection_indices(projection.cloned())?
            .with_limit(limit)
            .build();
        ParquetFormat::default()
            .create_physical_plan(state, config)
            .await
    }
}

#[cfg(test)]
mod tests {
    use datafusion::prelude::{col, lit};

    use super::*;

    fn ts(v: i64) -> Expr {
        lit(ScalarValue::TimestampMicrosecond(
            Some(v),
            Some("+00:00".into()),
        ))
    }

    #[test]
    fn narrows_by_time_conjuncts_only() {
        let (mut from, mut to) = (i64::MIN, i64::MAX);
        let e = col("event_time")
            .gt_eq(ts(10))
            .and(col("event_time").lt(ts(20)))
            .and(col("tenant").eq(lit("a")));
        narrow(&e, "event_time", &mut from, &mut to);
        assert_eq!((from, to), (10, 20));
        let (mut from, mut to) = (i64::MIN, i64::MAX);
        narrow(
            &ts(5).lt(col("event_time")),
            "event_time",
            &mut from,
            &mut to,
        );
        assert_eq!((from, to), (6, i64::MAX));
        let (mut from, mut to) = (i64::MIN, i64::MAX);
        narrow(
            &col("event_time")
                .gt_eq(ts(1))
                .or(col("event_time").lt(ts(0))),
            "event_time",
            &mut from,
            &mut to,
        );
        assert_eq!(
            (from, to),
            (i64::MIN, i64::MAX),
            "a disjunction does not narrow"
        );
    }

    #[test]
    fn a_lower_bound_on_the_commit_sequence_is_read_from_conjuncts_only() {
        let seq = || col(COMMIT_SEQUENCE_COLUMN);
        let lowest = |e: Expr| {
            let mut lowest = i64::MIN;
            lowest_sequence(&e, &mut lowest);
            lowest
        };
        assert_eq!(lowest(seq().gt(lit(7_i64))), 8);
        assert_eq!(lowest(seq().gt_eq(lit(7_i64)).and(seq().gt(lit(3_i64)))), 7);
        assert_eq!(lowest(lit(7_i64).lt(seq())), 8);
        assert_eq!(
            lowest(seq().gt(lit(7_i64)).or(seq().lt(lit(2_i64)))),
            i64::MIN
        );
        assert_eq!(lowest(col("other").gt(lit(7_i64))), i64::MIN);
        assert_eq!(lowest(seq().lt(lit(7_i64))), i64::MIN);
    }

    #[test]
    fn splits_locations() {
        let (url, path) = split_location("s3://lake/warehouse/signalweave/events/data/x.parquet");
        assert_eq!(url.as_str(), "s3://lake/");
        assert_eq!(path, "warehouse/signalweave/events/data/x.parquet");
        let (url, path) = split_location("/tmp/w/x.parquet");
        assert_eq!(url, ObjectStoreUrl::local_filesystem());
        assert_eq!(path, "tmp/w/x.parquet");
    }
}
