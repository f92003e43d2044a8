//! `lake erase`: a data subject erased from the lake's tables, from the outputs whose key
//! names them, and from the effect ledger.

use std::path::Path;

use anyhow::{Context, Result};
use signalweave_effects::{Ledger, NotificationSpec};
use signalweave_lake::{ErasureReport, ErasureRequest, KeyLayout, Lake, TableErasure};
use signalweave_window::JobSpec;

use crate::backfill::{is_notification_spec, spec_files};
use crate::output::{Format, print_rows};

/// The output key of every job version under `dir` (live specs and older versions), and
/// the notification jobs there. A spec that does not parse fails the erasure: a job left
/// out would leave its outputs unexamined.
pub fn specs(dir: &Path) -> Result<(Vec<KeyLayout>, Vec<NotificationSpec>)> {
    if !dir.is_dir() {
        return Err(signalweave_runner::RunnerError::new(
            signalweave_model::ErrorKind::InvalidInput,
            format!(
                "no job specs at {}: an erasure reads them to find the outputs keyed by the \
                 customer; run it from the repository, or pass --jobs-dir (or set \
                 SIGNALWEAVE_JOBS_DIR)",
                dir.display()
            ),
        )
        .into());
    }
    let mut files = Vec::new();
    spec_files(dir, &mut files)?;
    files.sort();
    let (mut layouts, mut notifications) = (Vec::new(), Vec::new());
    for path in files {
        if is_notification_spec(&path) {
            notifications.push(
                NotificationSpec::from_file(&path)
                    .with_context(|| format!("reading notification spec {}", path.display()))?,
            );
            continue;
        }
        let spec = JobSpec::from_file(&path)
            .with_context(|| format!("reading job spec {}", path.display()))?;
        let at = |name: &str| spec.key.columns.iter().position(|c| c == name);
        layouts.push(KeyLayout {
            job: spec.name.clone(),
            job_version: i64::from(spec.version),
            output_table: spec
                .output
                .table
                .strip_prefix("signalweave.")
                .unwrap_or(&spec.output.table)
                .to_string(),
            parts: spec.key.columns.len(),
            customer: at("customer_id"),
            tenant: at("tenant"),
            lateness_us: signalweave_window::micros(spec.lateness.allowed),
            span_us: spec.window.span_us(),
        });
    }
    Ok((layouts, notifications))
}

/// Erases `request`'s subject (its `outputs` are filled from `jobs_dir`) and prints what
/// went.
pub async fn run(
    lake: &Lake,
    mut request: ErasureRequest,
    jobs_dir: &Path,
    format: Format,
) -> Result<()> {
    let (layouts, notifications) = specs(jobs_dir)?;
    request.outputs = layouts;
    let mut report = lake.erase_customer(&request).await?;
    // The ledger last: an effect is made from an output row, and those are gone now. What
    // the lake's part found is printed even when the ledger's fails.
    let ledger = erase_effects(lake, &request, &notifications, &mut report).await;
    print(&report, jobs_dir, format)?;
    // A backfill not finished moves to a snapshot without the erased events before its
    // next sub-range (see `signalweave_runner::backfill`, "Erasures").
    let unfinished: Vec<String> = signalweave_runner::backfill::BackfillStore::open(lake.clone())
        .await?
        .list()
        .await?
        .into_iter()
        .filter(|b| !b.finished())
        .map(|b| format!("{} ({}, {})", b.job, b.namespace, b.state))
        .collect();
    if !unfinished.is_empty() {
        eprintln!(
            "Backfills not finished: {}. Each reads a snapshot without the erased events from \
             its next sub-range on (a paused one when it resumes). A sub-range it was reading \
             meanwhile leaves the subject's windows out of its commit in a job keyed by \
             customer; in other jobs' aggregates it counts the erased events, as aggregates \
             committed before do.",
            unfinished.join(", ")
        );
    }
    ledger
}

/// Erases the subject from the effects of the notification jobs whose source is keyed by
/// the customer, and records their count with the erasure.
async fn erase_effects(
    lake: &Lake,
    request: &ErasureRequest,
    notifications: &[NotificationSpec],
    report: &mut ErasureReport,
) -> Result<()> {
    let ledger = Ledger::open(lake.clone()).await?;
    let mut effects = 0;
    for job in ledger.jobs().await? {
        let Some(n) = notifications.iter().find(|n| n.name == job) else {
            report
                .outputs_unknown
                .insert(format!("the effects of {job} (no notification spec of it)"));
            continue;
        };
        let sources: Vec<&KeyLayout> = request
            .outputs
            .iter()
            .filter(|l| l.job == n.source.job)
            .collect();
        if sources.is_empty() {
            report.outputs_unknown.insert(format!(
                "the effects of {job} (no spec of its source job {})",
                n.source.job
            ));
            continue;
        }
        // An effect's key is its source output's; the ledger does not say which version
        // made it, and the versions' keys differ in their number of parts.
        effects += ledger
            .erase_keys(&job, |key| {
                sources.iter().any(|l| request.names_subject(l, key))
            })
            .await?;
    }
    report.tables.push(TableErasure {
        table: "sw_effects".into(),
        rows: effects,
        ..Default::default()
    });
    lake.amend_erasure(report).await?;
    Ok(())
}

fn print(report: &ErasureReport, jobs_dir: &Path, format: Format) -> Result<()> {
    let mut rows: Vec<Vec<String>> = report
        .tables
        .iter()
        .map(|t| {
            vec![
                t.table.clone(),
                t.rows.to_string(),
                t.files_rewritten.to_string(),
                t.snapshot_id.map(|s| s.to_string()).unwrap_or_default(),
            ]
        })
        .collect();
    rows.push(vec![
        "(old files deleted)".into(),
        String::new(),
        report.data_files_deleted.to_string(),
        format!("{} snapshots expired", report.snapshots_expired),
    ]);
    print_rows(format, &["table", "rows erased", "files", "snapshot"], rows)?;
    let time = signalweave_model::format_rfc3339_micros;
    let list =
        |s: &std::collections::BTreeSet<String>| s.iter().cloned().collect::<Vec<_>>().join(", ");
    let in_current = report.tables.first().is_some_and(|t| t.rows > 0);
    if !in_current && report.snapshots_expired > 0 {
        eprintln!(
            "erasure {} recorded; the current snapshot held no events of this customer, \
             older snapshots did (an erasure stopped before its expiry): {} expired.",
            report.erasure_id, report.snapshots_expired
        );
    } else if report.event_time_range.is_none() {
        eprintln!(
            "erasure {} recorded; no events of this customer were found.",
            report.erasure_id
        );
    } else {
        eprintln!("erasure {} recorded.", report.erasure_id);
    }
    if let Some((lo, hi)) = report.event_time_range {
        eprintln!(
            "Recompute derived outputs with a backfill over {} .. {} (markets: {}; event types: {}).",
            time(lo),
            time(hi),
            list(&report.markets),
            list(&report.event_types),
        );
    }
    if let Some(until) = report.outputs_open_until_us {
        eprintln!(
            "The customer's windows may change until {}. A live job keyed by customer leaves \
             their versions out from now on; one that committed them just before the \
             rewrite, or a notifier that read them then, may have left a row or an effect of \
             them. Run this erasure again once the jobs' watermarks have passed that time.",
            time(until)
        );
    }
    if !report.outputs_unknown.is_empty() {
        eprintln!(
            "Not examined (job specs read from {}): {}.",
            jobs_dir.display(),
            list(&report.outputs_unknown)
        );
    }
    if !report.versions_unknown.is_empty() {
        eprintln!(
            "Rows left, as no job spec under {} gives their key: {}.",
            jobs_dir.display(),
            list(&report.versions_unknown)
        );
    }
    Ok(())
}
