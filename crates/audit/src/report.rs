//! The reconciliation report as JSON, Markdown and a self-contained HTML page with SVG
//! plots (freshness by stage, late events over time, versions per window, mismatches).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use plotters::prelude::*;
use signalweave_model::ErrorKind;

use crate::error::{AuditError, Result};
use crate::reconcile::{Report, Verdict};

/// Rows of long tables shown in the HTML and Markdown reports (JSON keeps them all).
const SHOWN: usize = 200;

/// Writes `report.json`, `report.md` and `report.html` into `dir` (created if needed).
/// Returns the three paths.
pub fn write_reports(report: &Report, dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| {
        AuditError::new(
            ErrorKind::InvalidInput,
            format!("cannot create {}: {e}", dir.display()),
        )
    })?;
    let json = serde_json::to_string_pretty(report)
        .map_err(|e| AuditError::new(ErrorKind::Internal, format!("report JSON: {e}")))?;
    let files = [
        ("report.json", json),
        ("report.md", markdown(report)),
        ("report.html", html(report)?),
    ];
    let mut paths = Vec::new();
    for (name, text) in files {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|e| {
            AuditError::new(
                ErrorKind::Unavailable,
                format!("cannot write {}: {e}", path.display()),
            )
        })?;
        paths.push(path);
    }
    Ok(paths)
}

fn verdict(r: &Report) -> &'static str {
    match r.verdict() {
        Verdict::NothingFinal => {
            "NOTHING FINAL: no window of the range is final yet, so none was compared; every event is accounted for"
        }
        Verdict::Match => "MATCH: the outputs equal the oracle and every event is accounted for",
        Verdict::Mismatch => "MISMATCH: see the findings",
    }
}

/// The accounting as (label, count) rows, in the order they add up.
fn accounting_rows(r: &Report) -> Vec<(String, u64)> {
    let a = &r.accounting;
    let mut rows = vec![
        ("counted in a matching output window".to_string(), a.counted),
        ("counted in a window not final yet".into(), a.pending),
        (
            "duplicate of an earlier copy (twin listed)".into(),
            a.duplicates,
        ),
        (
            "late beyond allowed lateness, in late_events".into(),
            a.late,
        ),
        (
            "of an event type the job does not read".into(),
            a.out_of_scope,
        ),
        ("UNACCOUNTED".into(), a.unaccounted),
        ("= landed in signalweave.events".into(), a.landed),
    ];
    for (reason, n) in &a.rejected_by_reason {
        rows.push((format!("rejected: {reason}"), *n));
    }
    let received = match &a.rejections_received {
        Some((first, last)) => format!("= rejected (received {first} to {last})"),
        None => "= rejected".into(),
    };
    rows.push((received, a.rejected));
    rows.push(("= received".into(), a.received));
    rows
}

fn versions_histogram(r: &Report) -> BTreeMap<usize, u64> {
    let mut h = BTreeMap::new();
    for w in &r.versions {
        *h.entry(w.versions.len()).or_insert(0) += 1;
    }
    h
}

/// The report in Markdown.
pub fn markdown(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# Reconciliation: {} (namespace {})\n",
        r.job, r.namespace
    );
    let _ = writeln!(s, "**{}**\n", verdict(r));
    let _ = writeln!(
        s,
        "- range: {} to {}\n- job version {}, output table `{}`, job watermark {}\n- oracle: {}, out-of-orderness {} s, allowed lateness {} s, dedup horizon {} s, events snapshot {}\n- generated {}\n",
        r.from,
        r.to,
        r.job_version,
        r.output_table,
        r.job_watermark.as_deref().unwrap_or("none"),
        r.rule.window,
        r.rule.out_of_orderness_s,
        r.rule.allowed_lateness_s,
        r.rule.dedup_horizon_s,
        r.rule
            .events_snapshot
            .map(|s| s.to_string())
            .unwrap_or_else(|| "none".into()),
        r.generated_at
    );
    let _ = writeln!(s, "## Findings\n");
    if r.findings.is_empty() {
        let _ = writeln!(s, "None.\n");
    } else {
        let _ = writeln!(s, "| kind | count | detail |\n|---|---:|---|");
        for f in &r.findings {
            let _ = writeln!(s, "| {} | {} | {} |", f.kind, f.count, f.detail);
        }
        let _ = writeln!(s);
    }
    let _ = writeln!(s, "## Accounting of every event\n");
    let _ = writeln!(s, "| where | events |\n|---|---:|");
    for (label, n) in accounting_rows(r) {
        let _ = writeln!(s, "| {label} | {n} |");
    }
    let _ = writeln!(
        s,
        "\nBalanced: **{}**.\n",
        if r.accounting.balanced { "yes" } else { "no" }
    );
    let w = &r.windows;
    let _ = writeln!(s, "## Windows\n");
    let _ = writeln!(
        s,
        "| compared | matched | mismatched | missing | extra | not final | pending | versions repeated |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n| {} | {} | {} | {} | {} | {} | {} | {} |\n",
        w.compared,
        w.matched,
        w.mismatched,
        w.missing,
        w.extra,
        w.not_final,
        w.pending,
        w.versions_repeated
    );
    if !r.differences.is_empty() {
        let _ = writeln!(
            s,
            "| key | window start | status | version | columns (output / oracle) |\n|---|---|---|---:|---|"
        );
        for d in r.differences.iter().take(SHOWN) {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} |",
                d.key,
                d.window_start,
                d.status,
                d.output_version.map(|v| v.to_string()).unwrap_or_default(),
                columns_text(&d.columns)
            );
        }
        let _ = writeln!(s);
    }
    let _ = writeln!(s, "## Late events\n");
    let _ = writeln!(
        s,
        "Late by the oracle: {}; in late_events: {}; not routed: {}; routed but counted by the oracle: {}.\n",
        r.late.oracle_late,
        r.late.routed_late,
        r.late.not_routed_count,
        r.late.routed_but_counted_count
    );
    let _ = writeln!(s, "## Duplicates\n");
    let _ = writeln!(
        s,
        "{} duplicates; the first {} with their twins:\n",
        r.accounting.duplicates,
        r.duplicates.len().min(SHOWN)
    );
    if !r.duplicates.is_empty() {
        let _ = writeln!(
            s,
            "| tenant | event_id | twin ingested | duplicate ingested |\n|---|---|---|---|"
        );
        for d in r.duplicates.iter().take(SHOWN) {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} |",
                d.tenant, d.event_id, d.twin_ingest_time, d.duplicate_ingest_time
            );
        }
        let _ = writeln!(s);
    }
    let _ = writeln!(s, "## Freshness by stage (seconds)\n");
    let _ = writeln!(
        s,
        "| stage | samples | p50 | p90 | p99 | max |\n|---|---:|---:|---:|---:|---:|"
    );
    for f in &r.freshness {
        let _ = writeln!(
            s,
            "| {} | {} | {:.3} | {:.3} | {:.3} | {:.3} |",
            f.stage, f.samples, f.p50_s, f.p90_s, f.p99_s, f.max_s
        );
    }
    let _ = writeln!(s, "\n## Version history\n");
    let _ = writeln!(s, "| versions per window | windows |\n|---:|---:|");
    for (v, n) in versions_histogram(r) {
        let _ = writeln!(s, "| {v} | {n} |");
    }
    let _ = writeln!(
        s,
        "\nWindows with more than one version (first {SHOWN}; all {} windows are in report.json):\n",
        r.versions.len()
    );
    let _ = writeln!(
        s,
        "| key | window start | versions (version completeness events @ input snapshot) |\n|---|---|---|"
    );
    for h in r
        .versions
        .iter()
        .filter(|h| h.versions.len() > 1)
        .take(SHOWN)
    {
        let chain: Vec<String> = h
            .versions
            .iter()
            .map(|v| {
                format!(
                    "v{} {} {} @ {}",
                    v.version,
                    v.completeness,
                    v.events,
                    v.input_snapshot
                        .map(|s| s.to_string())
                        .unwrap_or_else(|| "?".into())
                )
            })
            .collect();
        let _ = writeln!(
            s,
            "| {} | {} | {} |",
            h.key,
            h.window_start,
            chain.join(" → ")
        );
    }
    s
}

fn columns_text(columns: &[(String, Option<f64>, Option<f64>)]) -> String {
    let f = |v: &Option<f64>| v.map(|x| format!("{x}")).unwrap_or_else(|| "null".into());
    columns
        .iter()
        .map(|(n, o, r)| format!("{n}: {} / {}", f(o), f(r)))
        .collect::<Vec<_>>()
        .join("; ")
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

type Series<'a> = (&'a str, RGBColor, Vec<f64>);

fn plot_error(e: impl std::fmt::Display) -> AuditError {
    AuditError::new(ErrorKind::Internal, format!("plot: {e}"))
}

/// Grouped bars: one group per label, one bar per series; with `log`, a logarithmic
/// value axis (from 1 ms).
fn bar_chart(
    title: &str,
    y_desc: &str,
    labels: &[String],
    series: &[Series<'_>],
    log: bool,
) -> Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (720, 340)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let top = series
            .iter()
            .flat_map(|s| s.2.iter().copied())
            .fold(0.0f64, f64::max);
        let n = labels.len().max(1);
        // Group i is centred on x = i, so the axis' round ticks fall on the groups.
        let x = -0.5f64..n as f64 - 0.5;
        let labels_owned = labels.to_vec();
        let label = move |x: &f64| {
            if (x - x.round()).abs() > 1e-6 || *x < 0.0 {
                return String::new();
            }
            labels_owned
                .get(x.round() as usize)
                .cloned()
                .unwrap_or_default()
        };
        let width = 0.8 / series.len().max(1) as f64;
        let floor = 1e-3;
        macro_rules! draw {
            ($chart:expr, $base:expr) => {{
                let mut chart = $chart;
                chart
                    .configure_mesh()
                    .disable_x_mesh()
                    .x_labels(n)
                    .x_label_formatter(&label)
                    .y_desc(y_desc)
                    .draw()
                    .map_err(plot_error)?;
                for (k, (name, color, values)) in series.iter().enumerate() {
                    let color = *color;
                    chart
                        .draw_series(values.iter().enumerate().map(|(i, v)| {
                            let x0 = i as f64 - 0.4 + k as f64 * width;
                            Rectangle::new(
                                [(x0, $base), (x0 + width, v.max($base))],
                                color.filled(),
                            )
                        }))
                        .map_err(plot_error)?
                        .label(*name)
                        .legend(move |(x, y)| {
                            Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled())
                        });
                }
                chart
                    .configure_series_labels()
                    .border_style(BLACK)
                    .background_style(WHITE.mix(0.8))
                    .draw()
                    .map_err(plot_error)?;
            }};
        }
        let mut builder = ChartBuilder::on(&root);
        builder
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70);
        if log {
            let top = (top * 2.0).max(floor * 10.0);
            let chart = builder
                .build_cartesian_2d(x.clone(), (floor..top).log_scale())
                .map_err(plot_error)?;
            draw!(chart, floor);
        } else {
            let top = if top > 0.0 { top * 1.1 } else { 1.0 };
            let chart = builder
                .build_cartesian_2d(x, 0f64..top)
                .map_err(plot_error)?;
            draw!(chart, 0.0);
        }
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}

/// Lines over bucket indices.
fn line_chart(
    title: &str,
    y_desc: &str,
    labels: &[String],
    series: &[Series<'_>],
) -> Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (720, 340)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let top = series
            .iter()
            .flat_map(|s| s.2.iter().copied())
            .fold(0.0f64, f64::max);
        let top = if top > 0.0 { top * 1.1 } else { 1.0 };
        let n = labels.len().max(2);
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..(n - 1) as f64, 0f64..top)
            .map_err(plot_error)?;
        let labels_owned = labels.to_vec();
        chart
            .configure_mesh()
            .x_labels(6)
            .x_label_formatter(&|x| {
                let i = x.round() as usize;
                labels_owned
                    .get(i)
                    .map(|l| l.get(5..16).unwrap_or(l).to_string())
                    .unwrap_or_default()
            })
            .y_desc(y_desc)
            .draw()
            .map_err(plot_error)?;
        for (name, color, values) in series {
            let color = *color;
            chart
                .draw_series(LineSeries::new(
                    values.iter().enumerate().map(|(i, v)| (i as f64, *v)),
                    color.stroke_width(2),
                ))
                .map_err(plot_error)?
                .label(*name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
        }
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()
            .map_err(plot_error)?;
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}

/// The report as one HTML page: no external resource, the plots inline SVG.
pub fn html(r: &Report) -> Result<String> {
    let stages: Vec<String> = r
        .freshness
        .iter()
        .map(|f| match f.stage.as_str() {
            "producer_transit_and_durable_ingestion" => "event → ingest".to_string(),
            "queue_hold_processing" => "ingest → emitted".to_string(),
            "end_to_end_to_emission" => "event → emitted".to_string(),
            other => other.replace('_', " "),
        })
        .collect();
    let freshness = bar_chart(
        "Freshness by stage (from the tables)",
        "seconds (log)",
        &stages,
        &[
            (
                "p50",
                RGBColor(70, 130, 180),
                r.freshness.iter().map(|f| f.p50_s).collect(),
            ),
            (
                "p90",
                RGBColor(240, 160, 40),
                r.freshness.iter().map(|f| f.p90_s).collect(),
            ),
            (
                "p99",
                RGBColor(200, 60, 60),
                r.freshness.iter().map(|f| f.p99_s).collect(),
            ),
        ],
        true,
    )?;
    let buckets: Vec<String> = r.timeline.iter().map(|b| b.start.clone()).collect();
    let late = line_chart(
        "Late events over event time",
        "events per bucket",
        &buckets,
        &[
            (
                "late by the oracle",
                RGBColor(200, 60, 60),
                r.timeline.iter().map(|b| b.late as f64).collect(),
            ),
            (
                "in late_events",
                RGBColor(70, 130, 180),
                r.timeline.iter().map(|b| b.routed_late as f64).collect(),
            ),
            (
                "duplicates",
                RGBColor(120, 120, 120),
                r.timeline.iter().map(|b| b.duplicates as f64).collect(),
            ),
        ],
    )?;
    let hist = versions_histogram(r);
    let versions = bar_chart(
        "Versions per window",
        "windows",
        &hist
            .keys()
            .map(|v| format!("{v} version(s)"))
            .collect::<Vec<_>>(),
        &[(
            "windows",
            RGBColor(90, 160, 90),
            hist.values().map(|n| *n as f64).collect(),
        )],
        false,
    )?;
    let mismatches = bar_chart(
        "Windows differing from the oracle, by event time",
        "windows",
        &r.timeline
            .iter()
            .map(|b| b.start.get(5..16).unwrap_or(&b.start).to_string())
            .collect::<Vec<_>>(),
        &[(
            "mismatched / missing / extra / not final",
            RGBColor(200, 60, 60),
            r.timeline
                .iter()
                .map(|b| b.differing_windows as f64)
                .collect(),
        )],
        false,
    )?;
    let mut s = String::new();
    let _ = write!(
        s,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Reconciliation: {job} ({ns})</title>\n<style>\n\
         body{{font-family:sans-serif;margin:2em;max-width:1100px}} table{{border-collapse:collapse;margin:1em 0}} \
         td,th{{border:1px solid #bbb;padding:3px 8px;font-size:13px}} td.n{{text-align:right}} \
         .ok{{color:#176317}} .bad{{color:#b01b1b}} figure.plot{{display:inline-block;margin:1em 1em 1em 0}} \
         details{{margin:0.3em 0}}\n</style></head>\n<body>\n<h1>Reconciliation: {job} <small>(namespace {ns})</small></h1>\n\
         <p class=\"{cls}\" id=\"verdict\"><strong>{verdict}</strong></p>\n<ul><li>range {from} to {to}</li>\
         <li>job version {jv}, output table <code>{table}</code>, job watermark {wm}</li>\
         <li>oracle: {window}; out-of-orderness {oo} s; allowed lateness {al} s; dedup horizon {dh} s; events snapshot {snap}</li>\
         <li>generated {gen}</li></ul>\n",
        job = esc(&r.job),
        ns = esc(&r.namespace),
        cls = if r.matches { "ok" } else { "bad" },
        verdict = esc(verdict(r)),
        from = esc(&r.from),
        to = esc(&r.to),
        jv = r.job_version,
        table = esc(&r.output_table),
        wm = esc(r.job_watermark.as_deref().unwrap_or("none")),
        window = esc(&r.rule.window),
        oo = r.rule.out_of_orderness_s,
        al = r.rule.allowed_lateness_s,
        dh = r.rule.dedup_horizon_s,
        snap = r
            .rule
            .events_snapshot
            .map(|s| s.to_string())
            .unwrap_or_else(|| "none".into()),
        gen = esc(&r.generated_at),
    );
    s.push_str("<h2>Findings</h2>\n");
    if r.findings.is_empty() {
        s.push_str("<p>None.</p>\n");
    } else {
        s.push_str("<table id=\"findings\"><tr><th>kind</th><th>count</th><th>detail</th></tr>\n");
        for f in &r.findings {
            let _ = writeln!(
                s,
                "<tr><td>{}</td><td class=\"n\">{}</td><td>{}</td></tr>",
                esc(&f.kind),
                f.count,
                esc(&f.detail)
            );
        }
        s.push_str("</table>\n");
    }
    s.push_str("<h2>Accounting of every event</h2>\n<table id=\"accounting\"><tr><th>where</th><th>events</th></tr>\n");
    for (label, n) in accounting_rows(r) {
        let _ = writeln!(
            s,
            "<tr><td>{}</td><td class=\"n\">{n}</td></tr>",
            esc(&label)
        );
    }
    let _ = writeln!(
        s,
        "</table>\n<p>Balanced: <strong class=\"{}\">{}</strong></p>",
        if r.accounting.balanced { "ok" } else { "bad" },
        if r.accounting.balanced { "yes" } else { "no" }
    );
    s.push_str("<h2>Plots</h2>\n");
    for (id, caption, svg) in [
        (
            "plot-freshness",
            "Freshness by stage: event time to ingest, ingest to the first output version that counts the event, and end to end (sink commit and visibility are measured by the live job's signalweave_freshness_seconds)",
            &freshness,
        ),
        (
            "plot-late",
            "Late events over event time, by the oracle and in late_events; duplicates",
            &late,
        ),
        (
            "plot-versions",
            "How many versions each window of the range has",
            &versions,
        ),
        (
            "plot-mismatches",
            "Windows that differ from the oracle, by the bucket of their start",
            &mismatches,
        ),
    ] {
        let _ = writeln!(
            s,
            "<figure class=\"plot\" id=\"{id}\">{svg}<figcaption>{}</figcaption></figure>",
            esc(caption)
        );
    }
    let w = &r.windows;
    let _ = writeln!(
        s,
        "<h2>Windows</h2>\n<table id=\"windows\"><tr><th>compared</th><th>matched</th><th>mismatched</th><th>missing</th><th>extra</th><th>not final</th><th>pending</th><th>versions repeated</th></tr>\
         <tr><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td></tr></table>",
        w.compared,
        w.matched,
        w.mismatched,
        w.missing,
        w.extra,
        w.not_final,
        w.pending,
        w.versions_repeated
    );
    if !r.differences.is_empty() {
        s.push_str("<table id=\"differences\"><tr><th>key</th><th>window start</th><th>status</th><th>version</th><th>completeness</th><th>columns (output / oracle)</th></tr>\n");
        for d in r.differences.iter().take(SHOWN) {
            let _ = writeln!(
                s,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td class=\"n\">{}</td><td>{}</td><td>{}</td></tr>",
                esc(&d.key),
                esc(&d.window_start),
                esc(&d.status),
                d.output_version.map(|v| v.to_string()).unwrap_or_default(),
                esc(d.completeness.as_deref().unwrap_or("")),
                esc(&columns_text(&d.columns))
            );
        }
        s.push_str("</table>\n");
    }
    let _ = writeln!(
        s,
        "<h2>Late events</h2>\n<p>Late by the oracle: {}; in late_events: {}; not routed: {}; routed but counted by the oracle: {}.</p>",
        r.late.oracle_late,
        r.late.routed_late,
        r.late.not_routed_count,
        r.late.routed_but_counted_count
    );
    for (title, list) in [
        ("Late by the oracle, not in late_events", &r.late.not_routed),
        (
            "In late_events, not late by the oracle",
            &r.late.routed_but_counted,
        ),
    ] {
        if list.is_empty() {
            continue;
        }
        let _ = writeln!(
            s,
            "<h3>{}</h3><table><tr><th>tenant</th><th>event_id</th><th>event time</th><th>ingest time</th><th>oracle</th></tr>",
            esc(title)
        );
        for l in list.iter().take(SHOWN) {
            let _ = writeln!(
                s,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(&l.tenant),
                esc(&l.event_id),
                esc(&l.event_time),
                esc(&l.ingest_time),
                esc(&l.oracle_class)
            );
        }
        s.push_str("</table>\n");
    }
    let _ = writeln!(
        s,
        "<h2>Duplicates</h2>\n<p>{} duplicates; the first {} with their twins (report.json lists up to the list limit).</p>",
        r.accounting.duplicates,
        r.duplicates.len().min(SHOWN)
    );
    if !r.duplicates.is_empty() {
        s.push_str("<table id=\"duplicates\"><tr><th>tenant</th><th>event_id</th><th>twin ingested</th><th>duplicate ingested</th></tr>\n");
        for d in r.duplicates.iter().take(SHOWN) {
            let _ = writeln!(
                s,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(&d.tenant),
                esc(&d.event_id),
                esc(&d.twin_ingest_time),
                esc(&d.duplicate_ingest_time)
            );
        }
        s.push_str("</table>\n");
    }
    s.push_str("<h2>Freshness by stage (seconds)</h2>\n<table id=\"freshness\"><tr><th>stage</th><th>samples</th><th>p50</th><th>p90</th><th>p99</th><th>max</th></tr>\n");
    for f in &r.freshness {
        let _ = writeln!(
            s,
            "<tr><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{:.3}</td><td class=\"n\">{:.3}</td><td class=\"n\">{:.3}</td><td class=\"n\">{:.3}</td></tr>",
            esc(&f.stage),
            f.samples,
            f.p50_s,
            f.p90_s,
            f.p99_s,
            f.max_s
        );
    }
    s.push_str("</table>\n");
    let _ = writeln!(
        s,
        "<h2>Version history</h2>\n<p>{} windows; those with more than one version first (up to {SHOWN} shown, all in report.json). Each version names the snapshot of <code>signalweave.events</code> it reflects.</p>",
        r.versions.len()
    );
    let mut shown: Vec<_> = r.versions.iter().filter(|h| h.versions.len() > 1).collect();
    shown.extend(r.versions.iter().filter(|h| h.versions.len() <= 1));
    for h in shown.into_iter().take(SHOWN) {
        let _ = writeln!(
            s,
            "<details><summary>{} {} — {} version(s), now {}</summary><table><tr><th>version</th><th>completeness</th><th>events</th><th>emitted</th><th>watermark</th><th>input snapshot</th></tr>",
            esc(&h.key),
            esc(&h.window_start),
            h.versions.len(),
            esc(h
                .versions
                .last()
                .map(|v| v.completeness.as_str())
                .unwrap_or(""))
        );
        for v in &h.versions {
            let _ = writeln!(
                s,
                "<tr><td class=\"n\">{}</td><td>{}{}</td><td class=\"n\">{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                v.version,
                esc(&v.completeness),
                if v.retracted { " (retracted)" } else { "" },
                v.events,
                esc(&v.emitted_at),
                esc(&v.watermark),
                v.input_snapshot.map(|x| x.to_string()).unwrap_or_default()
            );
        }
        s.push_str("</table></details>\n");
    }
    // Marks the page once laid out: how many plots have drawn marks and a visible box.
    s.push_str(
        "<script>\nwindow.addEventListener('load', function () {\n  var n = 0;\n  document.querySelectorAll('figure.plot svg').forEach(function (svg) {\n    var box = svg.getBoundingClientRect();\n    var marks = svg.querySelectorAll('rect, polyline, path, line, circle').length;\n    if (box.width > 0 && box.height > 0 && marks > 0) { n += 1; }\n  });\n  document.body.setAttribute('data-plots-rendered', String(n));\n});\n</script>\n</body></html>\n",
    );
    Ok(s)
}
