//! `signalweave reconcile` and `signalweave plan`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args;
use signalweave_audit::{Measured, ReconcileRequest, Sheet};
use signalweave_lake::Lake;
use signalweave_runner::JobStatus;

use crate::backfill::{find_spec, parse_time};
use crate::live::fetch_statuses;
use crate::outln;
use crate::output::{Format, print_rows};

/// Options of `signalweave reconcile`.
#[derive(Debug, Args)]
pub struct ReconcileArgs {
    /// The job.
    #[arg(long)]
    pub job: String,
    /// Start of the event-time range (RFC 3339), aligned down to the window slide.
    #[arg(long)]
    pub from: String,
    /// End of the event-time range (RFC 3339, exclusive).
    #[arg(long)]
    pub to: String,
    /// Output namespace: `live`, or a backfill's (before its promotion).
    #[arg(long, default_value = "live")]
    pub namespace: String,
    /// Directory for report.html, report.json and report.md.
    #[arg(long, default_value = "report")]
    pub out: PathBuf,
    /// Directory of job specs.
    #[arg(long, default_value = "jobs")]
    pub jobs_dir: PathBuf,
    /// Entries kept per list in the report (differences, duplicates, late discrepancies).
    #[arg(long, default_value_t = 1000)]
    pub list_limit: usize,
    /// `table` or `json` (the summary printed).
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// `signalweave reconcile`: exit 0 when the outputs match the oracle and every event is
/// accounted for, 1 otherwise.
pub async fn reconcile(lake: Lake, args: &ReconcileArgs) -> Result<ExitCode> {
    let from_us = parse_time("from", &args.from)?;
    let to_us = parse_time("to", &args.to)?;
    let (spec, output, events_snapshot) = if args.namespace == "live" {
        let spec = find_spec(&args.jobs_dir, &args.job, None)?;
        let output = signalweave_runner::output_table(&spec, "live")?;
        (spec, output, None)
    } else {
        let record =
            signalweave_runner::compare::backfill_record(&lake, &args.job, &args.namespace).await?;
        let spec = find_spec(&args.jobs_dir, &record.job, Some(record.job_version))?;
        let output = record.output_table(&spec)?;
        // A backfill read the snapshot it pinned: events landed after it are not in its
        // outputs, so the oracle reads that snapshot too while it is retained.
        let retained = lake
            .snapshots(signalweave_lake::LakeTable::Events)
            .await?
            .iter()
            .any(|s| Some(s.snapshot_id) == record.snapshot_id);
        if record.snapshot_id.is_some() && !retained {
            tracing::warn!(
                namespace = %args.namespace,
                "the snapshot the backfill read is expired: the oracle reads the current one, \
                 so events landed since count against the backfill"
            );
        }
        (spec, output, record.snapshot_id.filter(|_| retained))
    };
    let request = ReconcileRequest {
        spec,
        namespace: args.namespace.clone(),
        output,
        from_us,
        to_us,
        list_limit: args.list_limit,
        events_snapshot,
    };
    let report = signalweave_audit::reconcile(&lake, &request).await?;
    let paths = signalweave_audit::write_reports(&report, &args.out)?;
    if args.format == Format::Json {
        outln!("{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        let a = &report.accounting;
        let w = &report.windows;
        print_rows(
            args.format,
            &["figure", "value"],
            vec![
                vec![
                    "verdict".into(),
                    match report.verdict() {
                        signalweave_audit::Verdict::Match => "match",
                        signalweave_audit::Verdict::NothingFinal => "nothing final",
                        signalweave_audit::Verdict::Mismatch => "MISMATCH",
                    }
                    .into(),
                ],
                vec!["windows compared".into(), w.compared.to_string()],
                vec!["matched".into(), w.matched.to_string()],
                vec![
                    "mismatched / missing / extra".into(),
                    format!("{} / {} / {}", w.mismatched, w.missing, w.extra),
                ],
                vec!["closed, version not final".into(), w.not_final.to_string()],
                vec![
                    "versions written twice".into(),
                    w.versions_repeated.to_string(),
                ],
                vec!["pending (not final)".into(), w.pending.to_string()],
                vec!["received".into(), a.received.to_string()],
                vec!["counted".into(), a.counted.to_string()],
                vec!["counted, pending".into(), a.pending.to_string()],
                vec!["duplicates".into(), a.duplicates.to_string()],
                vec!["late (in late_events)".into(), a.late.to_string()],
                vec!["out of the job's scope".into(), a.out_of_scope.to_string()],
                vec!["rejected".into(), a.rejected.to_string()],
                vec!["unaccounted".into(), a.unaccounted.to_string()],
                vec!["balanced".into(), a.balanced.to_string()],
            ],
        )?;
        for f in &report.findings {
            outln!("finding: {} ({}): {}", f.kind, f.count, f.detail)?;
        }
        for p in &paths {
            outln!("wrote {}", p.display())?;
        }
    }
    Ok(if report.matches {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Options of `signalweave plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The capacity sheet.
    #[arg(long, default_value = "fixtures/slo-sheet.toml")]
    pub sheet: PathBuf,
    /// Take measured figures (input rate, freshness p99, state, queue age, sink commit)
    /// from a running `signalweave up` (`http://host:port`) instead of the sheet's.
    #[arg(long)]
    pub status: Option<String>,
    /// How long to watch the status for the input rate.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5s")]
    pub measure_for: Duration,
    /// `table` or `json`.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// The figures `/v1/status` gives, over `window` (the rate is the difference of the
/// records read by the busiest live job).
async fn measure(base: &str, window: Duration) -> Result<Measured> {
    let url = format!("{}/v1/status", base.trim_end_matches('/'));
    let first = fetch_statuses(base).await?;
    let started = Instant::now();
    tokio::time::sleep(window).await;
    let second = fetch_statuses(base).await?;
    let seconds = started.elapsed().as_secs_f64();
    let live: Vec<&JobStatus> = second.iter().filter(|s| s.namespace == "live").collect();
    let rate = live
        .iter()
        .filter_map(|s| {
            first
                .iter()
                .find(|f| f.job == s.job && f.namespace == s.namespace)
                .map(|f| s.records.saturating_sub(f.records) as f64 / seconds)
        })
        .fold(None, |m: Option<f64>, r| Some(m.map_or(r, |m| m.max(r))));
    let with_samples: Vec<&&JobStatus> = live.iter().filter(|s| s.freshness_samples > 0).collect();
    let max = |v: Vec<f64>| {
        v.into_iter()
            .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))))
    };
    Ok(Measured {
        source: url,
        sustained_rate: rate,
        freshness_p99_s: max(with_samples.iter().map(|s| s.freshness_s[1]).collect()),
        state_bytes: (!live.is_empty()).then(|| live.iter().map(|s| s.state_bytes as f64).sum()),
        state_keys: (!live.is_empty()).then(|| live.iter().map(|s| s.state_keys as f64).sum()),
        queue_age_s: max(live.iter().map(|s| s.oldest_unprocessed_age_s).collect()),
        sink_commit_s: max(live.iter().map(|s| s.sink_commit_s).collect()),
    })
}

/// `signalweave plan`: exit 0 when every objective holds, 1 when one fails now.
pub async fn plan(args: &PlanArgs) -> Result<ExitCode> {
    let sheet = Sheet::from_file(&args.sheet)?;
    let measured = match &args.status {
        Some(url) => Some(measure(url, args.measure_for).await?),
        None => None,
    };
    let plan = signalweave_audit::plan(&sheet, measured.as_ref());
    if args.format == Format::Json {
        outln!("{}", serde_json::to_string_pretty(&plan)?)?;
    } else {
        print_rows(
            args.format,
            &["section", "figure", "value", "from"],
            plan.rows(&sheet).into_iter().map(|r| r.to_vec()).collect(),
        )?;
        print_rows(
            args.format,
            &[
                "objective",
                "figure",
                "limit",
                "holds",
                "fails at load",
                "measured",
            ],
            plan.objectives
                .iter()
                .map(|o| {
                    vec![
                        o.objective.clone(),
                        o.figure.clone(),
                        o.limit.clone(),
                        if o.holds { "yes" } else { "NO" }.into(),
                        o.fails_at_load
                            .map(|m| format!("×{m:.3}"))
                            .unwrap_or_else(|| "—".into()),
                        if o.measured { "yes" } else { "" }.into(),
                    ]
                })
                .collect(),
        )?;
        if let Some(m) = &plan.measured {
            outln!(
                "measured from {}: input {} rec/s, freshness p99 {} s, state {} bytes, queue age {} s, sink commit {} s",
                m.source,
                m.sustained_rate
                    .map(|v| format!("{v:.0}"))
                    .unwrap_or_else(|| "?".into()),
                m.freshness_p99_s
                    .map(|v| format!("{v:.2}"))
                    .unwrap_or_else(|| "?".into()),
                m.state_bytes
                    .map(|v| format!("{v:.0}"))
                    .unwrap_or_else(|| "?".into()),
                m.queue_age_s
                    .map(|v| format!("{v:.2}"))
                    .unwrap_or_else(|| "?".into()),
                m.sink_commit_s
                    .map(|v| format!("{v:.2}"))
                    .unwrap_or_else(|| "?".into()),
            )?;
        }
        if let Some(first) = &plan.fails_first {
            outln!("fails first: {first}")?;
        }
    }
    Ok(if plan.objectives.iter().all(|o| o.holds) {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
