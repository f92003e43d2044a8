//! `signalweave backfill start | status | pause | resume | abort | compare | promote |
//! rollback`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use signalweave_lake::Lake;
use signalweave_model::format_rfc3339_micros;
use signalweave_runner::backfill::{
    self, BackfillFault, BackfillRecord, BackfillRequest, BackfillStore, GuardProbe, LEASE_STALE,
    RunOptions, SharedProgress,
};
use signalweave_runner::budget::{Budgets, GuardReading, Guards};
use signalweave_runner::{BackfillMetrics, JobStatus, compare};
use signalweave_window::JobSpec;

use crate::outln;
use crate::output::{Format, print_rows};

/// Backfill commands.
#[derive(Debug, Subcommand)]
pub enum BackfillCommand {
    /// Plan a backfill of a job version over an event-time range into a namespace, and
    /// run it here (unless `--detach`).
    Start(StartArgs),
    /// Progress per sub-range, rate, budget use, ETA and preemptions.
    Status(StatusArgs),
    /// Ask the running backfill to pause (it finishes nothing half-way).
    Pause(Target),
    /// Resume a paused backfill; runs it here when no process is running it.
    Resume(ResumeArgs),
    /// Stop a backfill for good; the committed sub-ranges stay in its namespace.
    Abort(Target),
    /// The namespace against the current outputs for its range.
    Compare(CompareArgs),
    /// Make a completed backfill's namespace authoritative for its range.
    Promote(PromoteArgs),
    /// Undo a promotion.
    Rollback(PromoteArgs),
}

/// Which backfill.
#[derive(Debug, Args)]
pub struct Target {
    /// Job name.
    #[arg(long)]
    pub job: String,
    /// The backfill's namespace.
    #[arg(long)]
    pub namespace: String,
}

/// Where job specs are, and how a backfill runs in this process.
#[derive(Debug, Args, Clone)]
pub struct RunFlags {
    /// Directory of job specs: `<dir>/*.toml` are the live versions; any spec under it
    /// (for example `<dir>/versions/market_aggregates.v2.toml`) can be backfilled.
    #[arg(long, default_value = "jobs")]
    pub jobs_dir: PathBuf,
    /// The live jobs' status (`http://host:port/v1/status` of `signalweave up`): its
    /// guards take capacity back from the backfill. Without it nothing is protected.
    #[arg(long, env = "SIGNALWEAVE_LIVE_STATUS")]
    pub live_status: Option<String>,
    /// Guard: age of the oldest unprocessed live commit.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2s")]
    pub guard_queue_age: Duration,
    /// Guard: live watermark delay.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30s")]
    pub guard_watermark_delay: Duration,
    /// Guard: live checkpoint age.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5s")]
    pub guard_checkpoint_age: Duration,
    /// Guard: live sink commit latency.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2s")]
    pub guard_sink_commit: Duration,
    /// Every guard must stay below this fraction of its threshold for `--clear-hold`
    /// before capacity is borrowed back.
    #[arg(long, default_value_t = 0.5)]
    pub clear_ratio: f64,
    /// See `--clear-ratio`.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "3s")]
    pub clear_hold: Duration,
    /// Serve the backfill's Prometheus metrics on this address (`/metrics`).
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
    /// Sub-ranges processed at once (memory grows with it).
    #[arg(long, default_value_t = 2)]
    pub parallelism: usize,
    /// Fault drill for tests: abort after committing this sub-range.
    #[arg(long, env = "SIGNALWEAVE_BACKFILL_FAULT", hide = true)]
    pub fault: Option<u32>,
}

/// Options of `backfill start`.
#[derive(Debug, Args)]
pub struct StartArgs {
    /// Job name.
    #[arg(long)]
    pub job: String,
    /// Event-time range start (RFC 3339, inclusive).
    #[arg(long)]
    pub from: String,
    /// Event-time range end (RFC 3339, exclusive).
    #[arg(long)]
    pub to: String,
    /// Job version to run (default: the live spec's).
    #[arg(long)]
    pub job_version: Option<u32>,
    /// Output namespace: outputs go to `<output table>__bf_<namespace>`.
    #[arg(long)]
    pub namespace: String,
    /// Records per second at full speed (default: unlimited).
    #[arg(long)]
    pub records_per_sec: Option<u32>,
    /// Bytes of data files read per second (default: unlimited).
    #[arg(long)]
    pub read_bytes_per_sec: Option<u64>,
    /// Output rows written per second (default: unlimited).
    #[arg(long)]
    pub write_rows_per_sec: Option<u32>,
    /// Records per second kept while live traffic takes capacity back (0: pause).
    #[arg(long, default_value_t = 0)]
    pub floor_records_per_sec: u32,
    /// Time slice of a sub-range.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1day")]
    pub slice: Duration,
    /// Key-group ranges per slice (smaller sub-ranges, less memory, more reads).
    #[arg(long, default_value_t = 1)]
    pub key_group_splits: u16,
    /// Count each event once across sub-ranges as the live job did, also when its copies
    /// carry other event times or keys: each sub-range also reads, for dedup only, the
    /// records up to a dedup horizon around it (about twice the time with 6-hour slices,
    /// 10-20% more with 1-day slices).
    #[arg(long)]
    pub exact_dedup: bool,
    /// Who starts it (default: $USER).
    #[arg(long)]
    pub by: Option<String>,
    /// Only record the plan; run it later with `backfill resume`.
    #[arg(long)]
    pub detach: bool,
    /// How it runs.
    #[command(flatten)]
    pub run: RunFlags,
}

/// Options of `backfill resume`.
#[derive(Debug, Args)]
pub struct ResumeArgs {
    /// Which backfill.
    #[command(flatten)]
    pub target: Target,
    /// How it runs.
    #[command(flatten)]
    pub run: RunFlags,
}

/// Options of `backfill status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Job name (default: every backfill).
    #[arg(long)]
    pub job: Option<String>,
    /// Namespace (with `--job`: that backfill, with its sub-ranges).
    #[arg(long)]
    pub namespace: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// Options of `backfill compare`.
#[derive(Debug, Args)]
pub struct CompareArgs {
    /// Which backfill.
    #[command(flatten)]
    pub target: Target,
    /// Directory of job specs.
    #[arg(long, default_value = "jobs")]
    pub jobs_dir: PathBuf,
    /// Most differing windows listed.
    #[arg(long, default_value_t = 50)]
    pub limit: usize,
    /// `table` or `json`.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Exit 1 when anything differs.
    #[arg(long)]
    pub fail_on_difference: bool,
}

/// Options of `backfill promote` and `rollback`.
#[derive(Debug, Args)]
pub struct PromoteArgs {
    /// Which backfill.
    #[command(flatten)]
    pub target: Target,
    /// Directory of job specs.
    #[arg(long, default_value = "jobs")]
    pub jobs_dir: PathBuf,
    /// Who (default: $USER).
    #[arg(long)]
    pub by: Option<String>,
}

fn who(by: &Option<String>) -> String {
    by.clone()
        .or_else(|| std::env::var("USER").ok())
        .unwrap_or_else(|| "unknown".into())
}

pub fn parse_time(name: &str, s: &str) -> Result<i64> {
    let t = chrono::DateTime::parse_from_rfc3339(s).map_err(|e| {
        signalweave_runner::RunnerError::new(
            signalweave_model::ErrorKind::InvalidInput,
            format!("--{name} `{s}` is not an RFC 3339 time: {e}"),
        )
    })?;
    Ok(t.timestamp_micros())
}

pub(crate) fn spec_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            spec_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "toml") {
            out.push(path);
        }
    }
    Ok(())
}

/// A notification job (`kind = "notification"`), not a window job.
pub(crate) fn is_notification_spec(path: &Path) -> bool {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| toml::from_str::<toml::Table>(&t).ok())
        .is_some_and(|t| t.get("kind").and_then(|k| k.as_str()) == Some("notification"))
}

/// The live spec of `job` (a `<dir>/*.toml`), and with `version` the spec of that version
/// (anywhere under `dir`).
pub fn find_spec(dir: &Path, job: &str, version: Option<u32>) -> Result<Arc<JobSpec>> {
    let mut files = Vec::new();
    spec_files(dir, &mut files)?;
    files.sort();
    let mut found = Vec::new();
    for path in files {
        let top_level = path.parent() == Some(dir);
        if is_notification_spec(&path) {
            continue;
        }
        let Ok(spec) = JobSpec::from_file(&path) else {
            if top_level {
                // A live spec that does not parse is an error worth seeing.
                JobSpec::from_file(&path)
                    .with_context(|| format!("reading job spec {}", path.display()))?;
            }
            continue;
        };
        if spec.name != job {
            continue;
        }
        let wanted = match version {
            Some(v) => spec.version == v,
            None => top_level,
        };
        if wanted {
            found.push((path, spec));
        }
    }
    match found.len() {
        1 => Ok(Arc::new(found.remove(0).1)),
        0 => Err(signalweave_runner::RunnerError::new(
            signalweave_model::ErrorKind::NotFound,
            match version {
                Some(v) => format!("no spec of {job} version {v} under {}", dir.display()),
                None => format!("no live spec of {job} in {}", dir.display()),
            },
        )
        .into()),
        _ => bail!(
            "{job} version {version:?} is defined by {} files: {}",
            found.len(),
            found
                .iter()
                .map(|(p, _)| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

fn http_probe(url: String) -> GuardProbe {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(800))
        .build()
        .unwrap_or_default();
    Arc::new(move || {
        let (client, url) = (client.clone(), url.clone());
        Box::pin(async move {
            let body = client.get(&url).send().await.ok()?.bytes().await.ok()?;
            let statuses: Vec<JobStatus> = serde_json::from_slice(&body).ok()?;
            Some(GuardReading::from_statuses(&statuses))
        })
    })
}

fn run_options(flags: &RunFlags) -> RunOptions {
    let guards = Guards {
        queue_age_s: flags.guard_queue_age.as_secs_f64(),
        watermark_delay_s: flags.guard_watermark_delay.as_secs_f64(),
        checkpoint_age_s: flags.guard_checkpoint_age.as_secs_f64(),
        sink_commit_s: flags.guard_sink_commit.as_secs_f64(),
        clear_ratio: flags.clear_ratio,
        clear_hold: flags.clear_hold,
        ..Guards::default()
    };
    RunOptions {
        guards,
        probe: match &flags.live_status {
            Some(url) => http_probe(url.clone()),
            None => backfill::probe_none(),
        },
        fault: flags.fault.map(|seq| BackfillFault { seq }),
        parallelism: flags.parallelism,
        ..RunOptions::default()
    }
}

/// Runs the backfill here, with progress bars and a metrics endpoint.
async fn run_here(
    lake: &Lake,
    spec: Arc<JobSpec>,
    namespace: &str,
    flags: &RunFlags,
    metrics_listener: Option<tokio::net::TcpListener>,
) -> Result<ExitCode> {
    let options = run_options(flags);
    let metrics = Arc::clone(&options.metrics);
    let server = metrics_listener.map(|l| serve_metrics(l, Arc::clone(&metrics)));
    let progress = Arc::clone(&options.progress);
    let bar = (!flags.quiet).then(|| show_progress(progress));
    // SIGINT or SIGTERM stops the run where it stands and leaves the backfill paused.
    let on_signal = {
        let interrupt = options.interrupt.clone();
        tokio::spawn(async move {
            crate::ingest::shutdown_signal().await;
            tracing::info!("signal received: stopping the backfill where it stands");
            interrupt.interrupt();
        })
    };
    let interrupt = options.interrupt.clone();
    let result = backfill::run(lake, spec, namespace, options).await;
    on_signal.abort();
    if let Some((bar, task)) = bar {
        task.abort();
        bar.finish_and_clear();
    }
    if let Some(server) = server {
        server.abort();
    }
    let record = result?;
    print_record(&record)?;
    if interrupt.is_set() && record.state == "paused" {
        eprintln!(
            "stopped by a signal: the backfill is paused; `signalweave backfill resume --job {} \
             --namespace {}` continues it",
            record.job, record.namespace
        );
    }
    Ok(if record.state == "completed" {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Checks the run flags and binds the metrics address, before anything is recorded: a
/// start that fails here leaves no backfill behind.
async fn prepare_run(flags: &RunFlags) -> Result<Option<tokio::net::TcpListener>> {
    let bad = |what: String| {
        anyhow::Error::new(signalweave_runner::RunnerError::new(
            signalweave_model::ErrorKind::InvalidInput,
            what,
        ))
    };
    if flags.parallelism == 0 {
        return Err(bad("--parallelism must be at least 1".into()));
    }
    if !(flags.clear_ratio > 0.0 && flags.clear_ratio < 1.0) {
        return Err(bad(format!(
            "--clear-ratio {} must be between 0 and 1 (exclusive)",
            flags.clear_ratio
        )));
    }
    for (name, d) in [
        ("--guard-queue-age", flags.guard_queue_age),
        ("--guard-watermark-delay", flags.guard_watermark_delay),
        ("--guard-checkpoint-age", flags.guard_checkpoint_age),
        ("--guard-sink-commit", flags.guard_sink_commit),
    ] {
        if d.is_zero() {
            return Err(bad(format!("{name} must be positive")));
        }
    }
    if let Some(url) = &flags.live_status {
        let parsed =
            reqwest::Url::parse(url).map_err(|e| bad(format!("--live-status `{url}`: {e}")))?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host().is_none() {
            return Err(bad(format!(
                "--live-status `{url}`: an http(s) URL of the live job's /v1/status"
            )));
        }
    }
    match flags.metrics_addr {
        Some(addr) => Ok(Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding the metrics address {addr}"))?,
        )),
        None => Ok(None),
    }
}

fn serve_metrics(
    listener: tokio::net::TcpListener,
    metrics: Arc<BackfillMetrics>,
) -> tokio::task::JoinHandle<()> {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let m = Arc::clone(&metrics);
            async move { m.render() }
        }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    })
}

fn show_progress(
    progress: SharedProgress,
) -> (indicatif::ProgressBar, tokio::task::JoinHandle<()>) {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:30}] {human_pos}/{human_len} records · {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    let b = bar.clone();
    let task = tokio::spawn(async move {
        loop {
            if let Ok(p) = progress.lock() {
                b.set_length(p.planned_records.max(p.records));
                b.set_position(p.records);
                b.set_message(format!(
                    "sub-ranges {}/{} · {} · limit {} · preemptions {}{}",
                    p.done,
                    p.subranges,
                    p.state,
                    p.rate_limit
                        .map_or_else(|| "none".to_string(), |r| format!("{r}/s")),
                    p.preemptions,
                    p.last_decision
                        .as_deref()
                        .map(|d| format!(" · {d}"))
                        .unwrap_or_default()
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    (bar, task)
}

fn print_record(r: &BackfillRecord) -> Result<()> {
    outln!(
        "backfill {} of {} version {} [{}, {}): {}{}",
        r.namespace,
        r.job,
        r.job_version,
        format_rfc3339_micros(r.from_us),
        format_rfc3339_micros(r.to_us),
        r.state,
        r.last_error
            .as_deref()
            .map(|e| format!(" ({e})"))
            .unwrap_or_default()
    )?;
    Ok(())
}

/// The budgets of `r` as configured, with the records rate in force while it runs (the
/// controller's: the ceiling, the floor or a step between).
fn budget_text(r: &BackfillRecord, running: bool) -> String {
    let b = &r.budgets;
    let per_sec = |x: Option<u32>| x.map_or_else(|| "unlimited".to_string(), |x| format!("{x}/s"));
    let mut parts = vec![format!("records {}", per_sec(b.records_per_sec))];
    if running && r.rate_limit != b.records_per_sec {
        parts.push(format!("now {}", per_sec(r.rate_limit)));
    }
    parts.push(format!("floor {}/s", b.floor_records_per_sec));
    if let Some(x) = b.read_bytes_per_sec {
        parts.push(format!("read {x} B/s"));
    }
    if let Some(x) = b.write_rows_per_sec {
        parts.push(format!("write {x} rows/s"));
    }
    parts.join(", ")
}

/// Runs a backfill command.
pub async fn run(lake: Lake, cmd: &BackfillCommand) -> Result<ExitCode> {
    match cmd {
        BackfillCommand::Start(a) => {
            let metrics_listener = prepare_run(&a.run).await?;
            let live = find_spec(&a.run.jobs_dir, &a.job, None)?;
            let spec = match a.job_version {
                Some(v) if v != live.version => find_spec(&a.run.jobs_dir, &a.job, Some(v))?,
                _ => live,
            };
            let request = BackfillRequest {
                job: a.job.clone(),
                job_version: spec.version,
                namespace: a.namespace.clone(),
                from_us: parse_time("from", &a.from)?,
                to_us: parse_time("to", &a.to)?,
                slice: a.slice,
                key_group_splits: a.key_group_splits,
                exact_dedup: a.exact_dedup,
                budgets: Budgets {
                    records_per_sec: a.records_per_sec,
                    read_bytes_per_sec: a.read_bytes_per_sec,
                    write_rows_per_sec: a.write_rows_per_sec,
                    floor_records_per_sec: a.floor_records_per_sec,
                },
                created_by: who(&a.by),
            };
            let record = backfill::create(&lake, &spec, &request).await?;
            let subranges = BackfillStore::open(lake.clone())
                .await?
                .subranges(&record.job, &record.namespace)
                .await?;
            outln!(
                "planned {} sub-ranges over snapshot {} of signalweave.events, into {}",
                subranges.len(),
                record
                    .snapshot_id
                    .map_or_else(|| "(empty)".to_string(), |s| s.to_string()),
                record.output_table(&spec)?.name()
            )?;
            if subranges.iter().all(|s| s.planned_records == 0) {
                outln!("warning: no landed event falls in the range: every window will be empty")?;
            }
            if a.detach {
                print_record(&record)?;
                return Ok(ExitCode::SUCCESS);
            }
            run_here(&lake, spec, &a.namespace, &a.run, metrics_listener).await
        }
        BackfillCommand::Resume(a) => {
            let metrics_listener = prepare_run(&a.run).await?;
            // Refused (a conflict) when the backfill is finished.
            let record = backfill::steer(&lake, &a.target.job, &a.target.namespace, "run").await?;
            if backfill::has_live_runner(&record, LEASE_STALE) {
                outln!(
                    "resume asked of the running process ({})",
                    record.runner.as_deref().unwrap_or("?")
                )?;
                return Ok(ExitCode::SUCCESS);
            }
            let spec = find_spec(&a.run.jobs_dir, &record.job, Some(record.job_version))?;
            run_here(&lake, spec, &record.namespace, &a.run, metrics_listener).await
        }
        BackfillCommand::Pause(t) | BackfillCommand::Abort(t) => {
            let desired = if matches!(cmd, BackfillCommand::Pause(_)) {
                "pause"
            } else {
                "abort"
            };
            let record = backfill::steer(&lake, &t.job, &t.namespace, desired).await?;
            let running = backfill::has_live_runner(&record, LEASE_STALE);
            if desired == "abort" && !running {
                // Nobody runs it: abort it here (releasing its snapshot hold).
                let r = backfill::abort_idle(&lake, &record.job, &record.namespace).await?;
                print_record(&r)?;
                return Ok(ExitCode::SUCCESS);
            }
            outln!(
                "{desired} asked{}",
                if running {
                    "; the running process obeys within a second"
                } else {
                    "; no process is running it"
                }
            )?;
            Ok(ExitCode::SUCCESS)
        }
        BackfillCommand::Status(a) => status(&lake, a).await,
        BackfillCommand::Compare(a) => {
            let record =
                compare::backfill_record(&lake, &a.target.job, &a.target.namespace).await?;
            let live = find_spec(&a.jobs_dir, &record.job, None)?;
            let spec = find_spec(&a.jobs_dir, &record.job, Some(record.job_version))?;
            let cmp = compare::compare(&lake, &live, &spec, &record, a.limit).await?;
            match a.format {
                Format::Json => outln!("{}", serde_json::to_string_pretty(&cmp)?)?,
                _ => print_comparison(a.format, &cmp)?,
            }
            Ok(if a.fail_on_difference && !cmp.identical() {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            })
        }
        BackfillCommand::Promote(a) => {
            let record =
                compare::backfill_record(&lake, &a.target.job, &a.target.namespace).await?;
            let live = find_spec(&a.jobs_dir, &record.job, None)?;
            let spec = find_spec(&a.jobs_dir, &record.job, Some(record.job_version))?;
            let promoted = compare::promote(&lake, &live, &spec, &record, &who(&a.by)).await?;
            let p = &promoted.promotion;
            outln!(
                "promoted {} (version {}) for windows of {} starting in [{}, {}), by {}",
                p.namespace,
                p.job_version,
                p.job,
                format_rfc3339_micros(p.from_us),
                format_rfc3339_micros(p.to_us),
                p.promoted_by
            )?;
            if p.to_us < record.to_us {
                outln!(
                    "it ends at {}: {}",
                    format_rfc3339_micros(p.to_us),
                    promoted.reason()
                )?;
            }
            Ok(ExitCode::SUCCESS)
        }
        BackfillCommand::Rollback(a) => {
            let p = lake
                .rollback_promotion(&a.target.job, &a.target.namespace, &who(&a.by))
                .await?;
            outln!(
                "rolled back the promotion of {} for {} (promoted by {}), by {}",
                p.namespace,
                p.job,
                p.promoted_by,
                p.rolled_back_by.as_deref().unwrap_or("?")
            )?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn print_comparison(format: Format, c: &compare::Comparison) -> Result<()> {
    if format == Format::Csv {
        return print_differences_csv(c);
    }
    outln!(
        "{} `{}` (version {}, {}) against the current outputs, windows overlapping [{}, {}):",
        c.job,
        c.namespace,
        c.job_version,
        c.state,
        c.from,
        c.to
    )?;
    if c.state != "completed" {
        outln!(
            "the backfill is {}: the windows of its sub-ranges not done show as missing",
            c.state
        )?;
    }
    print_rows(
        format,
        &[
            "same",
            "changed",
            "missing",
            "extra",
            "partial (not compared)",
        ],
        vec![vec![
            c.same.to_string(),
            c.changed.to_string(),
            c.missing.to_string(),
            c.extra.to_string(),
            c.partial.to_string(),
        ]],
    )?;
    print_rows(
        format,
        &["column", "current total", "namespace total", "delta"],
        c.totals
            .iter()
            .map(|t| {
                vec![
                    t.column.clone(),
                    t.current.to_string(),
                    t.namespace.to_string(),
                    t.delta.to_string(),
                ]
            })
            .collect(),
    )?;
    if !c.only_current.is_empty() || !c.only_namespace.is_empty() {
        outln!(
            "not compared: only current {:?}, only namespace {:?}",
            c.only_current,
            c.only_namespace
        )?;
    }
    if !c.differences.is_empty() {
        let show = |m: &Option<std::collections::BTreeMap<String, Option<String>>>| {
            m.as_ref().map_or_else(
                || "-".to_string(),
                |m| {
                    m.iter()
                        .map(|(k, v)| format!("{k}={}", v.as_deref().unwrap_or("null")))
                        .collect::<Vec<_>>()
                        .join(" ")
                },
            )
        };
        print_rows(format, &DIFFERENCE_HEADER, difference_rows(c, show))?;
        if c.truncated {
            outln!("(more differences not listed: raise --limit)")?;
        }
    }
    Ok(())
}

/// `compare --format csv`: one table a program can read, the windows that differ (each
/// with its kind), under a header even when none does. The counts and the totals are in
/// the table and JSON forms; what the table form says around them goes to stderr here.
fn print_differences_csv(c: &compare::Comparison) -> Result<()> {
    eprintln!(
        "{} `{}` (version {}, {}) against the current outputs, windows overlapping [{}, {}): \
         same {}, changed {}, missing {}, extra {}, partial {}",
        c.job,
        c.namespace,
        c.job_version,
        c.state,
        c.from,
        c.to,
        c.same,
        c.changed,
        c.missing,
        c.extra,
        c.partial
    );
    if c.truncated {
        eprintln!("(more differences not listed: raise --limit)");
    }
    let json = |m: &Option<std::collections::BTreeMap<String, Option<String>>>| {
        m.as_ref()
            .map(|m| serde_json::to_string(m).unwrap_or_default())
            .unwrap_or_default()
    };
    print_rows(Format::Csv, &DIFFERENCE_HEADER, difference_rows(c, json))
}

const DIFFERENCE_HEADER: [&str; 5] = ["kind", "key", "window_start", "current", "namespace"];

/// One row per differing window, its two sides' figures written by `show`.
fn difference_rows(
    c: &compare::Comparison,
    show: impl Fn(&Option<std::collections::BTreeMap<String, Option<String>>>) -> String,
) -> Vec<Vec<String>> {
    c.differences
        .iter()
        .map(|d| {
            vec![
                d.kind.to_string(),
                d.key.clone(),
                d.window_start.clone(),
                show(&d.current),
                show(&d.namespace),
            ]
        })
        .collect()
}

/// Records per second over the done sub-ranges.
fn rate(subranges: &[backfill::SubRange]) -> Option<f64> {
    let (records, secs) = subranges
        .iter()
        .filter(|s| s.state == "done")
        .fold((0u64, 0f64), |(r, t), s| (r + s.records, t + s.seconds));
    (secs > 0.0).then(|| records as f64 / secs)
}

async fn status(lake: &Lake, a: &StatusArgs) -> Result<ExitCode> {
    let store = BackfillStore::open(lake.clone()).await?;
    let records: Vec<BackfillRecord> = match (&a.job, &a.namespace) {
        (Some(job), Some(ns)) => vec![store.require(job, ns).await?],
        (job, ns) => {
            let records: Vec<BackfillRecord> = store
                .list()
                .await?
                .into_iter()
                .filter(|r| job.as_ref().is_none_or(|j| *j == r.job))
                .filter(|r| ns.as_ref().is_none_or(|n| *n == r.namespace))
                .collect();
            if records.is_empty() && (job.is_some() || ns.is_some()) {
                return Err(anyhow::Error::new(signalweave_runner::RunnerError::new(
                    signalweave_model::ErrorKind::NotFound,
                    format!(
                        "no backfill{}{}",
                        job.as_ref().map_or(String::new(), |j| format!(" of {j}")),
                        ns.as_ref()
                            .map_or(String::new(), |n| format!(" in namespace `{n}`"))
                    ),
                )));
            }
            records
        }
    };
    let mut rows = Vec::new();
    let mut json = Vec::new();
    let mut last_subs = Vec::new();
    for r in &records {
        let subs = store.subranges(&r.job, &r.namespace).await?;
        let done = subs.iter().filter(|s| s.state == "done").count();
        let records_done: u64 = subs.iter().map(|s| s.records).sum();
        let remaining: u64 = subs
            .iter()
            .filter(|s| s.state != "done")
            .map(|s| s.planned_records)
            .sum();
        let rate = rate(&subs);
        // A lower bound: the backlog over the rate, with the budget as a cap.
        let effective = match (rate, r.rate_limit) {
            (Some(x), Some(limit)) if limit > 0 => Some(x.min(f64::from(limit))),
            (x, _) => x,
        };
        let running = backfill::has_live_runner(r, LEASE_STALE);
        let finished = matches!(r.state.as_str(), "completed" | "aborted");
        let eta = effective
            .filter(|x| *x > 0.0 && !finished)
            .map(|x| remaining as f64 / x);
        rows.push(vec![
            r.job.clone(),
            r.namespace.clone(),
            r.job_version.to_string(),
            format!(
                "{} → {}",
                format_rfc3339_micros(r.from_us),
                format_rfc3339_micros(r.to_us)
            ),
            match (r.state.as_str(), running) {
                (state, true) => format!("{state} (live runner)"),
                // Its runner is gone (killed, or the machine lost): nothing moves until
                // `resume`.
                ("running", false) => "interrupted (resume to continue)".to_string(),
                ("paused", false) => "paused (resume to continue)".to_string(),
                (state, false) => state.to_string(),
            },
            format!("{done}/{}", subs.len()),
            records_done.to_string(),
            rate.map_or_else(|| "-".into(), |x| format!("{x:.0}/s")),
            budget_text(r, running),
            eta.map_or_else(|| "-".into(), |s| format!("{s:.0} s")),
            r.preemptions.to_string(),
            r.last_decision.clone().unwrap_or_default(),
        ]);
        json.push(serde_json::json!({
            "backfill": r,
            "running": running,
            "subranges": subs,
            "records_per_sec": rate,
            "eta_lower_bound_s": eta,
        }));
        last_subs = subs;
    }
    if a.format == Format::Json {
        outln!("{}", serde_json::to_string_pretty(&json)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    print_rows(
        a.format,
        &[
            "job",
            "namespace",
            "version",
            "range",
            "state",
            "sub-ranges",
            "records",
            "rate",
            "budget",
            "eta ≥",
            "preemptions",
            "last decision",
        ],
        rows,
    )?;
    if let [_] = records.as_slice()
        && a.namespace.is_some()
    {
        let subs = last_subs;
        print_rows(
            a.format,
            &[
                "seq",
                "from",
                "to",
                "key groups",
                "state",
                "planned",
                "records",
                "rows",
                "late",
                "dups",
                "seconds",
                "rate",
                "read / engine / throttled / commit s",
            ],
            subs.iter()
                .map(|s| {
                    vec![
                        s.seq.to_string(),
                        format_rfc3339_micros(s.from_us),
                        format_rfc3339_micros(s.to_us),
                        format!("{}..{}", s.kg_lo, s.kg_hi),
                        s.state.clone(),
                        s.planned_records.to_string(),
                        s.records.to_string(),
                        s.rows_written.to_string(),
                        s.late.to_string(),
                        s.duplicates.to_string(),
                        format!("{:.2}", s.seconds),
                        if s.seconds > 0.0 {
                            format!("{:.0}/s", s.records as f64 / s.seconds)
                        } else {
                            "-".into()
                        },
                        s.stages.map_or_else(
                            || "-".into(),
                            |t| {
                                format!(
                                    "{:.2} / {:.2} / {:.2} / {:.2}",
                                    t.read, t.engine, t.throttled, t.commit
                                )
                            },
                        ),
                    ]
                })
                .collect(),
        )?;
    }
    Ok(ExitCode::SUCCESS)
}
