//! `signalweave run` (live jobs), `signalweave up` (gateway + live jobs + serving +
//! maintenance in one process) and `signalweave status`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use signalweave_gateway::Gateway;
use signalweave_lake::{Lake, LakeTable};
use signalweave_model::SchemaRegistry;
use signalweave_runner::{FaultPoint, JobStatus, LiveConfig, LiveJob, RunnerMetrics, SharedStatus};
use signalweave_serve::Serving;
use signalweave_window::JobSpec;
use tokio::sync::watch;

use crate::ingest::{gateway_config, shutdown_signal};
use crate::output::{Format, print_rows};

/// Options shared by `run` and `up`: which jobs, and how they checkpoint.
#[derive(Debug, Args)]
pub struct JobArgs {
    /// Job specs to run live (repeat the option for several).
    #[arg(long = "job", default_values = ["jobs/market_aggregates.toml"])]
    pub jobs: Vec<PathBuf>,
    /// Output namespace.
    #[arg(long, default_value = "live")]
    pub namespace: String,
    /// Epoch length: outputs are committed and state checkpointed this often.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1s")]
    pub checkpoint_interval: Duration,
    /// How often the landing table is polled for new snapshots.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "100ms")]
    pub poll_interval: Duration,
    /// A job whose failures no retry can mend (a corrupt checkpoint, a configuration
    /// error, an invalid input) recovers from its checkpoint until they have lasted this
    /// long, then fails: the process exits with the error instead of retrying for ever.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1m")]
    pub fail_after: Duration,
    /// Most landing-table snapshots read in one step.
    #[arg(long, default_value_t = 32)]
    pub max_snapshots_per_step: usize,
    /// Checkpoints kept before the current one.
    #[arg(long, default_value_t = 3)]
    pub keep_checkpoints: usize,
    /// Follow one event in this many for freshness.
    #[arg(long, default_value_t = 8)]
    pub freshness_sample_every: u64,
    /// Fault drill for tests: `<stage>@<epoch>` (the process aborts there).
    #[arg(long, env = "SIGNALWEAVE_FAULT", hide = true)]
    pub fault: Option<String>,
}

impl JobArgs {
    fn specs(&self) -> Result<Vec<Arc<JobSpec>>> {
        let mut specs = Vec::new();
        for path in &self.jobs {
            let spec = JobSpec::from_file(path)
                .with_context(|| format!("reading job spec {}", path.display()))?;
            if specs.iter().any(|s: &Arc<JobSpec>| s.name == spec.name) {
                bail!("job {} is named twice", spec.name);
            }
            specs.push(Arc::new(spec));
        }
        Ok(specs)
    }

    fn config(&self) -> Result<LiveConfig> {
        let fault = self
            .fault
            .as_deref()
            .filter(|f| !f.is_empty())
            .map(str::parse::<FaultPoint>)
            .transpose()?;
        Ok(LiveConfig {
            namespace: self.namespace.clone(),
            checkpoint_interval: self.checkpoint_interval,
            poll_interval: self.poll_interval,
            max_snapshots_per_step: self.max_snapshots_per_step,
            keep_checkpoints: self.keep_checkpoints,
            freshness_sample_every: self.freshness_sample_every,
            fault,
            permanent_failure_grace: self.fail_after,
            ..LiveConfig::default()
        })
    }
}

/// Options of `signalweave run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The jobs.
    #[command(flatten)]
    pub jobs: JobArgs,
    /// Serve the aggregates API, `/v1/status` and `/metrics` on this address.
    #[arg(long)]
    pub serve: Option<SocketAddr>,
    /// Exit once every job has caught up with the landing table (after a checkpoint).
    #[arg(long)]
    pub until_caught_up: bool,
}

/// Options of `signalweave up`.
#[derive(Debug, Args)]
pub struct UpArgs {
    /// The jobs.
    #[command(flatten)]
    pub jobs: JobArgs,
    /// Gateway configuration (TOML).
    #[arg(long, default_value = "catalog/gateway/dev.toml")]
    pub gateway_config: PathBuf,
    /// Gateway listen address (overrides the configuration).
    #[arg(long)]
    pub gateway_listen: Option<SocketAddr>,
    /// Serving API listen address.
    #[arg(long, default_value = "127.0.0.1:8089")]
    pub serve_listen: SocketAddr,
    /// Maintenance pass over the job output tables and `late_events` this often (the
    /// gateway maintains `events` and `rejections` itself); 0s turns it off.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "60s")]
    pub maintain_every: Duration,
    /// Also run this notification job (for example `jobs/notifications.toml`) on the live
    /// outputs, sending through `--notify-provider`.
    #[arg(long, requires = "notify_provider")]
    pub notify: Option<PathBuf>,
    /// The notification provider (`http://host:port`).
    #[arg(long, requires = "notify")]
    pub notify_provider: Option<String>,
}

/// Options of `signalweave status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Base URL of a running `signalweave up` or `run --serve`.
    #[arg(long, default_value = "http://127.0.0.1:8089")]
    pub url: String,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// Running live jobs.
pub struct Jobs {
    /// Statuses, one per job.
    pub statuses: Vec<SharedStatus>,
    /// Metrics of every job.
    pub metrics: Arc<RunnerMetrics>,
    /// Specs and namespace, for serving.
    pub served: Vec<(Arc<JobSpec>, String)>,
    handles: Vec<tokio::task::JoinHandle<Result<()>>>,
    stop: watch::Sender<bool>,
    failed: Arc<tokio::sync::Notify>,
}

impl Jobs {
    /// Recovers and starts every job of `args` on `lake`.
    pub async fn start(lake: &Lake, args: &JobArgs, until_caught_up: bool) -> Result<Self> {
        let specs = args.specs()?;
        let config = args.config()?;
        let metrics = Arc::new(RunnerMetrics::new());
        let (stop, rx) = watch::channel(false);
        let mut statuses = Vec::new();
        let mut handles = Vec::new();
        let mut served = Vec::new();
        let failed = Arc::new(tokio::sync::Notify::new());
        for spec in specs {
            let job = LiveJob::recover(
                lake.clone(),
                Arc::clone(&spec),
                config.clone(),
                Arc::clone(&metrics),
            )
            .await
            .with_context(|| format!("starting job {}", spec.name))?;
            eprintln!(
                "job {} ({}) recovered at epoch {}, source position {}",
                spec.name,
                config.namespace,
                job.epoch(),
                job.position()
                    .map(|p| p.to_string())
                    .unwrap_or_else(|| "(start)".into())
            );
            statuses.push(job.status());
            served.push((Arc::clone(&spec), config.namespace.clone()));
            let mut rx = rx.clone();
            let failed = Arc::clone(&failed);
            handles.push(tokio::spawn(async move {
                let result = async {
                    if until_caught_up {
                        return run_until_caught_up(job).await;
                    }
                    let stopped = async move {
                        let _ = rx.wait_for(|s| *s).await;
                    };
                    let job = job.run(stopped).await?;
                    eprintln!("job {} stopped at epoch {}", spec.name, job.epoch());
                    Ok(())
                }
                .await;
                if let Err(e) = &result {
                    eprintln!("error: job {} failed: {e:#}", spec.name);
                    failed.notify_one();
                }
                result
            }));
        }
        Ok(Self {
            statuses,
            metrics,
            served,
            handles,
            stop,
            failed,
        })
    }

    /// Resolves once a job has failed for good (its process should stop: another instance
    /// runs it, or it cannot go on).
    pub async fn failed(&self) {
        self.failed.notified().await;
    }

    /// Asks every job to stop (each commits a last checkpoint) and waits for them.
    pub async fn stop(self) -> Result<()> {
        let _ = self.stop.send(true);
        self.wait().await
    }

    /// Waits for every job to end.
    pub async fn wait(self) -> Result<()> {
        let mut first_error = None;
        for h in self.handles {
            match h.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    first_error.get_or_insert(e);
                }
                Err(e) => {
                    first_error.get_or_insert(anyhow::anyhow!("job task: {e}"));
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Steps `job` until a step reads nothing new, then commits a last checkpoint.
async fn run_until_caught_up(mut job: LiveJob) -> Result<()> {
    job.catch_up().await?;
    job.release_lease().await;
    eprintln!(
        "job caught up: epoch {}, source position {}",
        job.epoch(),
        job.position()
            .map(|p| p.to_string())
            .unwrap_or_else(|| "(start)".into())
    );
    Ok(())
}

/// A stop signal: send `true` on the sender, and the future resolves.
pub(crate) fn stop_signal() -> (
    watch::Sender<bool>,
    impl std::future::Future<Output = ()> + Send + 'static,
) {
    let (tx, mut rx) = watch::channel(false);
    (tx, async move {
        let _ = rx.wait_for(|s| *s).await;
    })
}

/// The gateway serving in the background on the lake.
pub(crate) struct BackgroundGateway {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: watch::Sender<bool>,
    task:
        tokio::task::JoinHandle<signalweave_gateway::Result<signalweave_gateway::CommitterReport>>,
}

impl BackgroundGateway {
    /// Binds `config.listen` and serves.
    pub async fn start(
        lake: &Lake,
        registry: SchemaRegistry,
        config: signalweave_gateway::GatewayConfig,
    ) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("binding {}", config.listen))?;
        let addr = listener.local_addr()?;
        let gateway = Gateway::start(config, lake.clone(), Arc::new(registry)).await?;
        let (stop, stopped) = stop_signal();
        let task = tokio::spawn(gateway.serve(listener, stopped));
        Ok(Self { addr, stop, task })
    }

    /// Drains: every admitted event is committed and acknowledged.
    pub async fn stop(self) -> Result<signalweave_gateway::CommitterReport> {
        let _ = self.stop.send(true);
        let report = self.task.await.context("gateway task")??;
        eprintln!(
            "gateway stopped: {} commits, {} events committed, {} abandoned",
            report.commits, report.events, report.abandoned_events
        );
        Ok(report)
    }
}

/// The serving API of running jobs, in the background.
struct BackgroundServing {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl BackgroundServing {
    /// Binds `addr` for the serving API. Done before the jobs start: an address in use
    /// then fails the command before any job has taken its lease.
    async fn bind(addr: SocketAddr) -> Result<(tokio::net::TcpListener, SocketAddr)> {
        Serving::bind(addr)
            .await
            .with_context(|| format!("binding the serving API to {addr}"))
    }

    /// Serves `jobs` on `bound` (see [`BackgroundServing::bind`]).
    async fn start(
        lake: &Lake,
        jobs: &Jobs,
        bound: (tokio::net::TcpListener, SocketAddr),
    ) -> Result<Self> {
        let serving = Serving::new(
            lake.clone(),
            jobs.served.clone(),
            Some(Arc::clone(&jobs.metrics)),
            jobs.statuses.clone(),
        )?;
        let (listener, addr) = bound;
        let (stop, stopped) = stop_signal();
        let task = tokio::spawn(async move { serving.serve(listener, stopped).await });
        Ok(Self { addr, stop, task })
    }

    async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// `signalweave run`.
pub async fn run(lake: Lake, args: &RunArgs) -> Result<ExitCode> {
    let bound = match args.serve {
        Some(addr) => Some(BackgroundServing::bind(addr).await?),
        None => None,
    };
    let jobs = Jobs::start(&lake, &args.jobs, args.until_caught_up).await?;
    let serving = match bound {
        Some(bound) => {
            let serving = BackgroundServing::start(&lake, &jobs, bound).await?;
            eprintln!("serving on http://{}", serving.addr);
            Some(serving)
        }
        None => None,
    };
    let result = if args.until_caught_up {
        jobs.wait().await
    } else {
        tokio::select! {
            () = shutdown_signal() => eprintln!("stopping: committing a last checkpoint"),
            () = jobs.failed() => eprintln!("stopping: a job failed"),
        }
        jobs.stop().await
    };
    if let Some(s) = serving {
        s.stop().await;
    }
    result?;
    Ok(ExitCode::SUCCESS)
}

/// `signalweave up`: the gateway, the live jobs, the serving API and a maintenance loop in
/// one process, until SIGTERM or SIGINT. The gateway drains first, then the jobs commit
/// their last checkpoint.
pub async fn up(lake: Lake, registry: SchemaRegistry, args: &UpArgs) -> Result<ExitCode> {
    // The notifications read their source job's spec from the directory of the `--job`
    // that runs it, wherever `up` was started from.
    let mut notify_jobs_dir = PathBuf::from("jobs");
    if let Some(spec) = &args.notify {
        let watched = signalweave_effects::NotificationSpec::from_file(spec)?
            .source
            .job;
        let source = args
            .jobs
            .jobs
            .iter()
            .find(|p| JobSpec::from_file(p).is_ok_and(|s| s.name == watched));
        match source.and_then(|p| p.parent()) {
            Some(dir) if !dir.as_os_str().is_empty() => notify_jobs_dir = dir.to_path_buf(),
            Some(_) => notify_jobs_dir = PathBuf::from("."),
            None => eprintln!(
                "warning: the notifications watch {watched}, which this `up` does not run \
                 (add --job for it): they wait for its outputs from elsewhere"
            ),
        }
    }
    let mut gw_config = gateway_config(&args.gateway_config)?;
    if let Some(listen) = args.gateway_listen {
        gw_config.listen = listen;
    }
    let bound = BackgroundServing::bind(args.serve_listen).await?;
    let gateway = BackgroundGateway::start(&lake, registry, gw_config).await?;
    let jobs = Jobs::start(&lake, &args.jobs, false).await?;
    let serving = BackgroundServing::start(&lake, &jobs, bound).await?;
    let (stop_maintenance, maintenance_stopped) = stop_signal();
    let maintenance = (!args.maintain_every.is_zero()).then(|| {
        let tables: Vec<LakeTable> = jobs
            .served
            .iter()
            .filter_map(|(spec, ns)| signalweave_runner::output_table(spec, ns).ok())
            .chain([LakeTable::LateEvents])
            .collect();
        tokio::spawn(maintenance_loop(
            lake.clone(),
            tables,
            args.maintain_every,
            maintenance_stopped,
            Arc::clone(&jobs.metrics),
        ))
    });
    let (stop_notify, notify_stopped) = stop_signal();
    let notify_failed = Arc::new(tokio::sync::Notify::new());
    let notifications = match (&args.notify, &args.notify_provider) {
        (Some(spec), Some(provider)) => {
            let run = crate::effects::run_beside_up(
                lake.clone(),
                spec.clone(),
                notify_jobs_dir,
                provider.clone(),
                args.jobs.poll_interval,
                Box::pin(notify_stopped),
            );
            let failed = Arc::clone(&notify_failed);
            Some(tokio::spawn(async move {
                let result = run.await;
                if let Err(e) = &result {
                    eprintln!("error: notifications failed: {e:#}");
                    failed.notify_one();
                }
                result
            }))
        }
        _ => None,
    };
    eprintln!(
        "signalweave up: gateway http://{} · serving http://{} · {} job(s) · lake {}",
        gateway.addr,
        serving.addr,
        jobs.served.len(),
        lake.config().warehouse_location()
    );
    tokio::select! {
        () = shutdown_signal() => eprintln!(
            "stopping: draining the gateway, then committing the jobs' last checkpoints"
        ),
        // A job that cannot go on stops the whole process, so a supervisor sees it.
        () = jobs.failed() => eprintln!("stopping: a job failed; draining the gateway"),
        () = notify_failed.notified() => {
            eprintln!("stopping: notifications failed; draining the gateway");
        }
    }
    let _ = stop_maintenance.send(true);
    let drained = gateway.stop().await;
    // The jobs read what the gateway committed last, then stop.
    tokio::time::sleep(args.jobs.poll_interval * 2).await;
    let jobs_stopped = jobs.stop().await;
    // Notifications read the last outputs, then stop (their lease given up).
    tokio::time::sleep(args.jobs.poll_interval * 2).await;
    let _ = stop_notify.send(true);
    let notified = match notifications {
        Some(n) => match n.await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(e),
            Err(e) => Err(anyhow::anyhow!("notifications task: {e}")),
        },
        None => Ok(()),
    };
    serving.stop().await;
    if let Some(m) = maintenance {
        let _ = m.await;
    }
    drained?;
    jobs_stopped?;
    notified?;
    Ok(ExitCode::SUCCESS)
}

/// One maintenance pass over `tables` every `every`, one at a time, until `stop`: its
/// budget is one table at a time and the gaps between passes, so it never competes with
/// ingestion for more than one commit slot. After each round, `metrics` show the
/// snapshots kept only by holds and every hold's age.
async fn maintenance_loop(
    lake: Lake,
    tables: Vec<LakeTable>,
    every: Duration,
    stop: impl std::future::Future<Output = ()>,
    metrics: Arc<RunnerMetrics>,
) {
    tokio::pin!(stop);
    let policy = signalweave_lake::MaintenancePolicy::default();
    loop {
        tokio::select! {
            _ = &mut stop => return,
            _ = tokio::time::sleep(every) => {}
        }
        for t in &tables {
            match lake.maintain(*t, &policy).await {
                Ok(r) => {
                    tracing::debug!(table = t.name(), report = ?r, "maintenance pass");
                    metrics
                        .lake_held_snapshots
                        .get_or_create(&vec![("table".to_string(), t.name().to_string())])
                        .set(r.snapshots_held as i64);
                    if let Ok(Some(warning)) = lake.held_history_warning(*t, &r, &policy).await {
                        tracing::warn!("{warning}");
                    }
                }
                Err(e) => tracing::warn!(table = t.name(), error = %e, "maintenance pass failed"),
            }
        }
        match lake.snapshot_holds().await {
            Ok(holds) => metrics.record_holds(&holds, chrono::Utc::now().timestamp_millis()),
            Err(e) => tracing::warn!(error = %e, "reading snapshot holds failed"),
        }
    }
}

/// The jobs' status of a running `up` or `run --serve` at `base` (`http://host:port`).
pub async fn fetch_statuses(base: &str) -> Result<Vec<JobStatus>> {
    let url = format!("{}/v1/status", base.trim_end_matches('/'));
    // Nothing answering is a dependency unavailable (exit 3), not bad input.
    let unavailable = |e: reqwest::Error| {
        anyhow::Error::new(signalweave_lake::LakeError::new(
            signalweave_model::ErrorKind::Unavailable,
            format!("GET {url}: {e}; is `signalweave up` (or `run --serve`) running there?"),
        ))
    };
    let body = reqwest::get(&url)
        .await
        .map_err(unavailable)?
        .error_for_status()
        .map_err(unavailable)?
        .text()
        .await
        .map_err(unavailable)?;
    serde_json::from_str(&body).with_context(|| format!("parsing {url}"))
}

/// `signalweave status`: the jobs of a running `up` or `run --serve`, as a table.
pub async fn status(args: &StatusArgs) -> Result<ExitCode> {
    let statuses = fetch_statuses(&args.url).await?;
    if args.format == Format::Json {
        // The statuses as the API gives them: numbers as numbers.
        crate::outln!("{}", serde_json::to_string_pretty(&statuses)?)?;
    } else {
        print_rows(
            args.format,
            &STATUS_HEADER,
            statuses.iter().map(status_row).collect(),
        )?;
    }
    let stalled = statuses
        .iter()
        .any(|s| matches!(s.state.as_str(), "stalled" | "failed"));
    Ok(if stalled {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// Columns of `signalweave status`.
pub const STATUS_HEADER: [&str; 14] = [
    "job",
    "state",
    "epoch",
    "watermark",
    "lag snapshots",
    "lag records",
    "oldest unprocessed s",
    "watermark delay s",
    "checkpoint age s",
    "records",
    "late",
    "outputs",
    "freshness p50/p99/p99.9 s",
    "error",
];

/// One row of `signalweave status`.
pub fn status_row(s: &JobStatus) -> Vec<String> {
    vec![
        format!("{}/{}", s.job, s.namespace),
        s.state.clone(),
        s.epoch.to_string(),
        s.watermark_us
            .map(signalweave_model::format_rfc3339_micros)
            .unwrap_or_else(|| "-".into()),
        s.lag_snapshots.to_string(),
        s.lag_records.to_string(),
        format!("{:.1}", s.oldest_unprocessed_age_s),
        format!("{:.1}", s.watermark_delay_s),
        format!("{:.1}", s.checkpoint_age_s),
        s.records.to_string(),
        s.late.to_string(),
        s.outputs.to_string(),
        format!(
            "{:.2} / {:.2} / {:.2}",
            s.freshness_s[0], s.freshness_s[1], s.freshness_s[2]
        ),
        s.last_error.clone().unwrap_or_default(),
    ]
}

/// Outputs against an SQL recount of the landing table, for one job (see [`reconcile`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Reconciliation {
    /// Job.
    pub job: String,
    /// Closed windows compared (the watermark passed their end).
    pub compared: u64,
    /// Windows whose current version equals the recount.
    pub matched: u64,
    /// Windows whose values differ.
    pub mismatched: u64,
    /// Closed windows in the outputs only.
    pub only_in_outputs: u64,
    /// Closed windows in the recount only.
    pub only_in_recount: u64,
}

impl Reconciliation {
    /// Column names of [`Reconciliation::row`].
    pub const HEADER: [&'static str; 6] = [
        "job",
        "compared",
        "matched",
        "mismatched",
        "only_in_outputs",
        "only_in_recount",
    ];

    /// The figures as a table row.
    pub fn row(&self) -> Vec<String> {
        vec![
            self.job.clone(),
            self.compared.to_string(),
            self.matched.to_string(),
            self.mismatched.to_string(),
            self.only_in_outputs.to_string(),
            self.only_in_recount.to_string(),
        ]
    }

    /// True when every compared window matched and none is on one side only.
    pub fn agrees(&self) -> bool {
        self.mismatched + self.only_in_outputs + self.only_in_recount == 0
    }
}

/// The recount of a tumbling-window job straight from the landing table, in SQL: the
/// events of the job's types, first copy of each `(tenant, event_id)`, without the records
/// the job routed to `late_events`, grouped by key and window. Other window kinds are the
/// reconciliation report's job.
pub fn recount_sql(spec: &JobSpec, namespace: &str) -> Result<String> {
    let signalweave_window::WindowSpec::Tumbling { size } = spec.window else {
        bail!(
            "the SQL recount covers tumbling windows; {} is not one",
            spec.name
        );
    };
    let q = |s: &str| s.replace('\'', "''");
    let types = spec
        .source
        .event_types
        .iter()
        .map(|t| format!("'{}'", q(t)))
        .collect::<Vec<_>>()
        .join(", ");
    let filter = if types.is_empty() {
        String::new()
    } else {
        format!("WHERE event_type IN ({types})")
    };
    let key = if spec.key.columns.len() == 1 {
        format!("CAST({} AS VARCHAR)", spec.key.columns[0])
    } else {
        format!("concat_ws('|', {})", spec.key.columns.join(", "))
    };
    let mut aggs = Vec::new();
    for a in &spec.aggregates {
        let cond = a
            .event_type
            .as_deref()
            .map(|t| format!("event_type = '{}'", q(t)))
            .unwrap_or_else(|| "TRUE".into());
        let col = a.column.as_deref().unwrap_or("1");
        let expr = match a.function {
            signalweave_window::AggregateFunction::Count => {
                format!("CAST(count(CASE WHEN {cond} THEN {col} END) AS BIGINT)")
            }
            signalweave_window::AggregateFunction::Sum => {
                format!("CAST(sum(CASE WHEN {cond} THEN {col} END) AS BIGINT)")
            }
            signalweave_window::AggregateFunction::Min => {
                format!("min(CASE WHEN {cond} THEN {col} END)")
            }
            signalweave_window::AggregateFunction::Max => {
                format!("max(CASE WHEN {cond} THEN {col} END)")
            }
            signalweave_window::AggregateFunction::Avg => {
                format!("avg(CASE WHEN {cond} THEN CAST({col} AS DOUBLE) END)")
            }
        };
        aggs.push(format!("{expr} AS {}", a.name));
    }
    Ok(format!(
        "WITH ev AS (SELECT *, row_number() OVER (PARTITION BY tenant, event_id ORDER BY ingest_time, event_time) AS sw_copy \
         FROM signalweave.events {filter}), \
         late AS (SELECT DISTINCT tenant AS late_tenant, event_id AS late_event_id FROM signalweave.late_events \
         WHERE job = '{job}' AND namespace = '{ns}') \
         SELECT {key} AS key, date_bin(INTERVAL '{secs} seconds', {time}, TIMESTAMP '1970-01-01T00:00:00Z') AS window_start, \
         CAST(count(*) AS BIGINT) AS events, {aggs} \
         FROM ev LEFT JOIN late ON ev.tenant = late.late_tenant AND ev.event_id = late.late_event_id \
         WHERE sw_copy = 1 AND late.late_event_id IS NULL GROUP BY 1, 2",
        job = q(&spec.name),
        ns = q(namespace),
        secs = size.as_secs_f64(),
        time = spec.time.event_time_column,
        aggs = aggs.join(", "),
    ))
}

/// Compares the current outputs of `spec` in `namespace` with [`recount_sql`], over the
/// windows the job's watermark has closed.
pub async fn reconcile(lake: &Lake, spec: &JobSpec, namespace: &str) -> Result<Reconciliation> {
    let table = signalweave_runner::output_table(spec, namespace)?;
    let ctx = lake.session_context().await?;
    let recount = recount_sql(spec, namespace)?;
    let same = std::iter::once("o.events = r.events".to_string())
        .chain(
            spec.aggregates
                .iter()
                .map(|a| format!("(o.{0} IS NOT DISTINCT FROM r.{0})", a.name)),
        )
        .collect::<Vec<_>>()
        .join(" AND ");
    let sql = format!(
        "WITH wm AS (SELECT max(watermark) AS wm FROM signalweave.{t}), \
         o AS (SELECT * FROM signalweave.{t}_current WHERE window_end <= (SELECT wm FROM wm)), \
         r AS (SELECT * FROM ({recount}) WHERE window_start + INTERVAL '{secs} seconds' <= (SELECT wm FROM wm)) \
         SELECT CAST(count(*) AS BIGINT) AS compared, \
         CAST(sum(CASE WHEN o.key IS NOT NULL AND r.key IS NOT NULL AND {same} THEN 1 ELSE 0 END) AS BIGINT) AS matched, \
         CAST(sum(CASE WHEN o.key IS NOT NULL AND r.key IS NOT NULL AND NOT ({same}) THEN 1 ELSE 0 END) AS BIGINT) AS mismatched, \
         CAST(sum(CASE WHEN r.key IS NULL THEN 1 ELSE 0 END) AS BIGINT) AS only_in_outputs, \
         CAST(sum(CASE WHEN o.key IS NULL THEN 1 ELSE 0 END) AS BIGINT) AS only_in_recount \
         FROM o FULL OUTER JOIN r ON o.key = r.key AND o.window_start = r.window_start",
        t = table.name(),
        secs = spec.window.span_us() as f64 / 1e6,
    );
    let batches = ctx.sql(&sql).await?.collect().await?;
    let mut out = Reconciliation {
        job: spec.name.clone(),
        ..Default::default()
    };
    if let Some(b) = batches.iter().find(|b| b.num_rows() > 0) {
        let get = |i: usize| -> u64 {
            use arrow::array::{Array, AsArray};
            let c = b.column(i).as_primitive::<arrow::datatypes::Int64Type>();
            if c.is_null(0) {
                0
            } else {
                c.value(0).max(0) as u64
            }
        };
        out.compared = get(0);
        out.matched = get(1);
        out.mismatched = get(2);
        out.only_in_outputs = get(3);
        out.only_in_recount = get(4);
    }
    Ok(out)
}

/// Options of `signalweave demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// The jobs.
    #[command(flatten)]
    pub jobs: JobArgs,
    /// How long the producer sends.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "60s")]
    pub duration: Duration,
    /// Events per second.
    #[arg(long, default_value_t = 2_000)]
    pub rate: u64,
    /// Fraction of events sent 3 h late (beyond the jobs' allowed lateness).
    #[arg(long, default_value_t = 0.01)]
    pub late_fraction: f64,
    /// Fraction of sends that repeat an event.
    #[arg(long, default_value_t = 0.02)]
    pub dup_fraction: f64,
    /// Gateway configuration (TOML).
    #[arg(long, default_value = "catalog/gateway/dev.toml")]
    pub gateway_config: PathBuf,
}

/// `signalweave demo`: gateway, live jobs and serving on the lake, a producer sending live,
/// late and duplicate events, a live terminal view, then a reconciliation of the outputs
/// against an SQL recount of the landing table. Exit 1 when they disagree.
pub async fn demo(lake: Lake, registry: SchemaRegistry, args: &DemoArgs) -> Result<ExitCode> {
    use signalweave_producer::workload::{EventFactory, EventShape, drive};
    use signalweave_producer::{Producer, ProducerConfig};

    let mut gw_config = gateway_config(&args.gateway_config)?;
    gw_config.listen = "127.0.0.1:0".parse()?;
    let token = "sw-dev-tenant-0";
    let gateway = BackgroundGateway::start(&lake, registry, gw_config).await?;
    let gw_addr = gateway.addr;
    let bound = BackgroundServing::bind("127.0.0.1:0".parse()?).await?;
    let jobs = Jobs::start(&lake, &args.jobs, false).await?;
    let serving = BackgroundServing::start(&lake, &jobs, bound).await?;
    eprintln!(
        "gateway http://{gw_addr} · serving http://{0} (try http://{0}/v1/jobs/{1}/aggregates?key=m-1) · lake {2}",
        serving.addr,
        jobs.served
            .first()
            .map(|(s, _)| s.name.as_str())
            .unwrap_or("-"),
        lake.config().warehouse_location()
    );
    let mut config = ProducerConfig::new(format!("http://{gw_addr}"), token);
    config.concurrency = 16;
    let producer = Producer::start(config)?;
    let factory = EventFactory::new(EventShape {
        event_bytes: 400,
        late_fraction: args.late_fraction,
        dup_fraction: args.dup_fraction,
        markets: 50,
        ..EventShape::new("tenant-0", format!("demo-{}", std::process::id()))
    });
    let driver = tokio::spawn(drive(
        producer,
        factory,
        args.rate,
        args.duration,
        Duration::from_secs(60),
    ));
    let bar = indicatif::ProgressBar::new(args.duration.as_secs().max(1));
    bar.set_style(
        indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:24}] {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let started = std::time::Instant::now();
    let mut last_records = 0u64;
    while !driver.is_finished() {
        tokio::time::sleep(Duration::from_secs(1)).await;
        bar.set_position(started.elapsed().as_secs().min(args.duration.as_secs()));
        if let Some(s) = jobs
            .statuses
            .first()
            .and_then(|s| s.lock().ok().map(|g| g.clone()))
        {
            bar.set_message(format!(
                "{} rec/s · lag {} snapshots · watermark {} · late {} · dups {} · freshness p99 {:.1} s",
                s.records.saturating_sub(last_records),
                s.lag_snapshots,
                s.watermark_us
                    .map(|w| signalweave_model::format_rfc3339_micros(w)[11..19].to_string())
                    .unwrap_or_else(|| "-".into()),
                s.late,
                s.duplicates,
                s.freshness_s[1]
            ));
            last_records = s.records;
        }
    }
    bar.finish();
    let sent = driver.await.context("producer task")?;
    let gw = gateway.stop().await?;
    // Let the jobs read the gateway's last commit.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let current = lake
        .table(LakeTable::Events)
        .await?
        .metadata()
        .current_snapshot_id();
    while std::time::Instant::now() < deadline {
        let done = jobs.statuses.iter().all(|s| {
            s.lock()
                .is_ok_and(|g| g.position == current || g.lag_snapshots == 0)
        });
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let statuses = jobs.statuses.clone();
    let served = jobs.served.clone();
    jobs.stop().await?;
    serving.stop().await;
    println!(
        "producer: {} sent, {} accepted, {} duplicates, {} rejected, ack p99 {} · gateway: {} commits, {} events",
        sent.offered,
        sent.stats.accepted,
        sent.stats.duplicate,
        sent.stats.rejected,
        sent.stats
            .ack_latency
            .map(|l| format!("{:.0} ms", l[1].as_secs_f64() * 1e3))
            .unwrap_or_else(|| "-".into()),
        gw.commits,
        gw.events
    );
    let rows: Vec<Vec<String>> = statuses
        .iter()
        .filter_map(|s| s.lock().ok().map(|g| status_row(&g)))
        .collect();
    print_rows(Format::Table, &STATUS_HEADER, rows)?;
    let mut disagree = false;
    let mut rows = Vec::new();
    for (spec, ns) in &served {
        if !matches!(spec.window, signalweave_window::WindowSpec::Tumbling { .. }) {
            continue;
        }
        let r = reconcile(&lake, spec, ns).await?;
        disagree |= !r.agrees();
        rows.push(r.row());
    }
    println!(
        "reconciliation: closed windows, current outputs against an SQL recount of signalweave.events"
    );
    print_rows(Format::Table, &Reconciliation::HEADER, rows)?;
    Ok(if disagree {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}
