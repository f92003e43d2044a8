//! Printing data for people (`table`) and for programs (`json`, `csv`).

use std::io::Write;

use anyhow::Result;
use arrow::array::RecordBatch;
use comfy_table::{ContentArrangement, Table, presets::UTF8_FULL_CONDENSED};
use datafusion::execution::SendableRecordBatchStream;
use futures::StreamExt;
use signalweave_lake::LakeError;

/// Writes a line to stdout, returning an error (rather than panicking) when stdout is closed.
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*).map_err($crate::output::OutputError)
    }};
}

/// A write to standard output failed: for a closed pipe (`… | head`), its reader went
/// away, and the command ends quietly (see `main`). Only output writes are wrapped in it,
/// so a broken connection to a store is never taken for one.
#[derive(Debug)]
pub struct OutputError(pub std::io::Error);

impl std::fmt::Display for OutputError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "writing the output: {}", self.0)
    }
}

impl std::error::Error for OutputError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

impl OutputError {
    /// Whether the reader of the output went away.
    pub fn closed(&self) -> bool {
        self.0.kind() == std::io::ErrorKind::BrokenPipe
    }
}

/// Output format of a data-printing command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// A table for people.
    Table,
    /// CSV with a header row.
    Csv,
    /// A JSON array of objects.
    Json,
}

/// Prints string rows under `header`.
pub fn print_rows(format: Format, header: &[&str], rows: Vec<Vec<String>>) -> Result<()> {
    match format {
        Format::Table => {
            let mut t = Table::new();
            t.load_preset(UTF8_FULL_CONDENSED)
                .set_content_arrangement(ContentArrangement::Dynamic)
                .set_header(header.to_vec());
            for r in rows {
                t.add_row(r);
            }
            outln!("{t}")?;
        }
        Format::Csv => {
            outln!("{}", header.join(","))?;
            for r in rows {
                let escaped: Vec<String> = r
                    .into_iter()
                    .map(|v| {
                        if v.contains([',', '"', '\n']) {
                            format!("\"{}\"", v.replace('"', "\"\""))
                        } else {
                            v
                        }
                    })
                    .collect();
                outln!("{}", escaped.join(","))?;
            }
        }
        Format::Json => {
            let out: Vec<serde_json::Map<String, serde_json::Value>> = rows
                .into_iter()
                .map(|r| {
                    header
                        .iter()
                        .map(|h| h.to_string())
                        .zip(r.into_iter().map(serde_json::Value::String))
                        .collect()
                })
                .collect();
            outln!("{}", serde_json::to_string_pretty(&out)?)?;
        }
    }
    Ok(())
}

/// Prints query results as they are computed. CSV and JSON are written batch by batch, so
/// a large result is never held whole; a table needs every row for its column widths. An
/// empty result still prints its columns (a CSV header, a table head) or `[]`.
pub async fn print_stream(format: Format, mut stream: SendableRecordBatchStream) -> Result<()> {
    let schema = stream.schema();
    let next = |b: Option<datafusion::error::Result<RecordBatch>>| {
        b.transpose()
            .map_err(|e| LakeError::datafusion("run query", e))
    };
    match format {
        Format::Table => {
            let mut batches = Vec::new();
            while let Some(b) = next(stream.next().await)? {
                batches.push(b);
            }
            if batches.is_empty() {
                batches.push(RecordBatch::new_empty(schema));
            }
            outln!("{}", arrow::util::pretty::pretty_format_batches(&batches)?)?;
        }
        // Each batch is encoded into a buffer, then written: a closed stdout is then an
        // `io::Error` of its own kind (the CSV writer reports it as text).
        Format::Csv => {
            let mut first = true;
            let write = |b: &RecordBatch, header: bool| -> Result<()> {
                let mut w = arrow::csv::WriterBuilder::new()
                    .with_header(header)
                    .build(Vec::new());
                w.write(b)?;
                std::io::stdout()
                    .lock()
                    .write_all(&w.into_inner())
                    .map_err(OutputError)?;
                Ok(())
            };
            while let Some(b) = next(stream.next().await)? {
                write(&b, first)?;
                first = false;
            }
            if first {
                write(&RecordBatch::new_empty(schema), true)?;
            }
        }
        Format::Json => {
            // Nulls are written as such: a key left out reads as a missing column.
            let mut w = arrow::json::WriterBuilder::new()
                .with_explicit_nulls(true)
                .build::<_, arrow::json::writer::JsonArray>(Vec::new());
            let flush = |buffer: &mut Vec<u8>| -> Result<()> {
                std::io::stdout()
                    .lock()
                    .write_all(buffer)
                    .map_err(OutputError)?;
                buffer.clear();
                Ok(())
            };
            while let Some(b) = next(stream.next().await)? {
                w.write(&b)?;
                flush(w.get_mut())?;
            }
            w.finish()?;
            w.get_mut().push(b'\n');
            flush(w.get_mut())?;
        }
    }
    Ok(())
}
