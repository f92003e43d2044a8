//! `signalweave effects run|status|reconcile|expire` and `signalweave notify-sink`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use signalweave_effects::sink::{DeliveryReport, SinkConfig};
use signalweave_effects::{Dispatcher, Ledger, NotificationSpec, Notifier, state};
use signalweave_lake::Lake;
use signalweave_window::JobSpec;

use crate::backfill::find_spec;
use crate::outln;
use crate::output::{Format, print_rows};

/// `signalweave effects …`.
#[derive(Debug, Subcommand)]
pub enum EffectsCommand {
    /// Run a notification job: tail its source's outputs, record intents in the ledger,
    /// and (live) dispatch them to the provider; over a backfill namespace, record
    /// `would_send` only.
    Run(RunArgs),
    /// Effects by state, the ledger's dedup horizon, and delivery latency.
    Status(StatusArgs),
    /// Resolve ambiguous effects against the provider; report duplicates it saw.
    Reconcile(ReconcileArgs),
    /// Delete settled effects older than the ledger's retention.
    Expire(StatusArgs),
}

/// Which notification job.
#[derive(Debug, Args)]
pub struct SpecArgs {
    /// The notification spec.
    #[arg(long, default_value = "jobs/notifications.toml")]
    pub spec: PathBuf,
    /// Directory of job specs (the source job's).
    #[arg(long, default_value = "jobs")]
    pub jobs_dir: PathBuf,
    /// `live`, or a backfill namespace of the source job.
    #[arg(long, default_value = "live")]
    pub namespace: String,
}

/// Options of `effects run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Which job.
    #[command(flatten)]
    pub target: SpecArgs,
    /// The provider (`http://host:port`); required live.
    #[arg(long)]
    pub provider: Option<String>,
    /// Between two steps when nothing is new.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "500ms")]
    pub poll_interval: Duration,
    /// Output snapshots read per step.
    #[arg(long, default_value_t = 32)]
    pub max_snapshots_per_step: usize,
    /// Exit once the outputs are read and nothing is left to send (or nothing moved for
    /// `--settle-timeout`).
    #[arg(long)]
    pub until_settled: bool,
    /// See `--until-settled`.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30s")]
    pub settle_timeout: Duration,
    /// How long to wait for the lease of a runner that stopped without giving it up (its
    /// lease lapses 5 s after its last heartbeat).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub lease_wait: Duration,
    /// Where a notifier that has never run starts: `earliest`, every retained output (a
    /// backfill namespace, or a replay), or `latest`, only outputs committed from now on
    /// (a new notification job beside a live job with history). Ignored once it has a
    /// position.
    #[arg(long, value_enum, default_value_t = StartAt::Earliest)]
    pub start_at: StartAt,
    /// When the notifier's position has expired (an erasure expires every snapshot
    /// before it, held or not), go on from the output table's current snapshot: the
    /// outputs committed between are not notified. Without it such a notifier stops,
    /// saying so.
    #[arg(long)]
    pub skip_expired: bool,
}

/// See [`RunArgs::start_at`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StartAt {
    /// Every retained output.
    Earliest,
    /// Outputs committed from now on.
    Latest,
}

/// A runner's lease lapses this long after its last renewal.
const LEASE_TTL: Duration = Duration::from_secs(5);

/// Options of `effects status` and `expire`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Which job.
    #[command(flatten)]
    pub target: SpecArgs,
    /// List the effects in this state.
    #[arg(long)]
    pub list: Option<String>,
    /// `table` or `json`.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// Options of `effects reconcile`.
#[derive(Debug, Args)]
pub struct ReconcileArgs {
    /// Which job.
    #[command(flatten)]
    pub target: SpecArgs,
    /// The provider.
    #[arg(long)]
    pub provider: String,
    /// Send ambiguous effects again when the provider cannot be asked (each at most once
    /// more: at most one duplicate each, counted below).
    #[arg(long)]
    pub resend_ambiguous: bool,
    /// Send the `failed` effects again, with a new deadline (after a provider outage
    /// longer than the deadline).
    #[arg(long)]
    pub retry_failed: bool,
    /// `table` or `json`.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// Options of `notify-sink`.
#[derive(Debug, Args)]
pub struct SinkArgs {
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:8099")]
    pub listen: String,
    /// Deliver every request, even a key already delivered (a provider without
    /// idempotency).
    #[arg(long)]
    pub ignore_idempotency_keys: bool,
    /// Do not answer lookups by key.
    #[arg(long)]
    pub no_lookup: bool,
}

async fn load(lake: &Lake, t: &SpecArgs) -> Result<(Arc<NotificationSpec>, Arc<JobSpec>)> {
    let spec = Arc::new(NotificationSpec::from_file(&t.spec)?);
    let source = if t.namespace == "live" {
        find_spec(&t.jobs_dir, &spec.source.job, None)?
    } else {
        let record =
            signalweave_runner::compare::backfill_record(lake, &spec.source.job, &t.namespace)
                .await?;
        find_spec(&t.jobs_dir, &record.job, Some(record.job_version))?
    };
    Ok((spec, source))
}

/// `signalweave effects …`.
pub async fn run(lake: Lake, cmd: &EffectsCommand) -> Result<ExitCode> {
    let ledger = Ledger::open(lake.clone()).await?;
    match cmd {
        EffectsCommand::Run(a) => {
            run_job(lake, ledger, a, Box::pin(crate::ingest::shutdown_signal())).await
        }
        EffectsCommand::Status(a) => status(&lake, &ledger, a).await,
        EffectsCommand::Reconcile(a) => reconcile(&lake, &ledger, a).await,
        EffectsCommand::Expire(a) => {
            let (spec, _) = load(&lake, &a.target).await?;
            let cutoff =
                chrono::Utc::now().timestamp_millis() - spec.ledger.retention.as_millis() as i64;
            let n = ledger
                .expire(&spec.name, &a.target.namespace, cutoff)
                .await?;
            outln!(
                "expired {n} settled effects of `{}` older than {}",
                a.target.namespace,
                humantime::format_duration(spec.ledger.retention)
            )?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// A future that ends the runner.
pub type Stop = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// Runs a notification job on the live namespace beside `signalweave up`'s jobs, until
/// `stop`: `spec` through `provider`.
pub async fn run_beside_up(
    lake: Lake,
    spec: PathBuf,
    jobs_dir: PathBuf,
    provider: String,
    poll_interval: Duration,
    stop: Stop,
) -> Result<ExitCode> {
    let ledger = Ledger::open(lake.clone()).await?;
    let args = RunArgs {
        target: SpecArgs {
            spec,
            jobs_dir,
            namespace: "live".into(),
        },
        provider: Some(provider),
        poll_interval,
        max_snapshots_per_step: 32,
        until_settled: false,
        settle_timeout: Duration::from_secs(30),
        lease_wait: Duration::from_secs(10),
        start_at: StartAt::Earliest,
        // Beside the gateway and the live jobs, a notifier whose position an erasure
        // expired goes on (saying so) rather than stopping them all, at every restart.
        skip_expired: true,
    };
    run_job(lake, ledger, &args, stop).await
}

async fn run_job(lake: Lake, ledger: Ledger, a: &RunArgs, stop: Stop) -> Result<ExitCode> {
    let (spec, source) = load(&lake, &a.target).await?;
    // One runner per job and namespace: a second one would resolve the first one's
    // requests in flight as ambiguous.
    let owner = format!("effects-{}-{}", std::process::id(), uuid::Uuid::new_v4());
    let (job, ns) = (spec.name.clone(), a.target.namespace.clone());
    let waited = std::time::Instant::now();
    loop {
        match ledger.lease(&job, &ns, &owner, LEASE_TTL).await {
            Ok(()) => break,
            Err(e)
                if e.kind() == signalweave_model::ErrorKind::Conflict
                    && waited.elapsed() < a.lease_wait =>
            {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
    let lost = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let heartbeat = {
        let (ledger, job, ns, owner, lost) = (
            ledger.clone(),
            job.clone(),
            ns.clone(),
            owner.clone(),
            Arc::clone(&lost),
        );
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                if let Err(e) = ledger.lease(&job, &ns, &owner, LEASE_TTL).await {
                    eprintln!("lost the lease: {e}");
                    lost.store(true, std::sync::atomic::Ordering::SeqCst);
                    return;
                }
            }
        })
    };
    let result = run_leased(&lake, &ledger, a, &spec, &source, &lost, stop).await;
    heartbeat.abort();
    ledger.release(&job, &ns, &owner).await?;
    result
}

async fn run_leased(
    lake: &Lake,
    ledger: &Ledger,
    a: &RunArgs,
    spec: &Arc<NotificationSpec>,
    source: &JobSpec,
    lost: &std::sync::atomic::AtomicBool,
    mut stop: Stop,
) -> Result<ExitCode> {
    let notifier = Notifier::new(
        lake.clone(),
        ledger.clone(),
        Arc::clone(spec),
        source,
        &a.target.namespace,
    )
    .await?;
    if a.skip_expired
        && let Some((from, to)) = notifier.skip_expired().await?
    {
        eprintln!(
            "effects: the position {from} had expired; going on from snapshot {to}: outputs \
             committed between are not notified"
        );
    }
    if a.start_at == StartAt::Latest && notifier.start_at_latest().await? {
        eprintln!(
            "effects: first start at the latest output snapshot: outputs already there are not \
             notified"
        );
    }
    let dispatcher = if notifier.dry() {
        None
    } else {
        let Some(provider) = &a.provider else {
            bail!("--provider is required for the live namespace");
        };
        let d = Arc::new(Dispatcher::new(
            ledger.clone(),
            &spec.name,
            provider,
            spec.dispatch.clone(),
        )?);
        let recovered = d.recover().await?;
        if recovered != Default::default() {
            eprintln!("recovered effects left dispatching: {recovered:?}");
        }
        Some(d)
    };
    eprintln!(
        "effects: {} on {} ({}){}",
        spec.name,
        spec.source.job,
        a.target.namespace,
        if notifier.dry() {
            ": records would_send, sends nothing"
        } else {
            ""
        }
    );
    loop {
        if lost.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(signalweave_effects::EffectError::new(
                signalweave_model::ErrorKind::Conflict,
                format!(
                    "stopped: the lease of {} ({}) was lost",
                    spec.name, a.target.namespace
                ),
            )
            .into());
        }
        let step = match notifier.step(a.max_snapshots_per_step).await {
            Err(e) if a.skip_expired && e.kind() == signalweave_model::ErrorKind::NotFound => {
                if let Some((from, to)) = notifier.skip_expired().await? {
                    eprintln!(
                        "effects: the position {from} had expired; going on from snapshot \
                         {to}: outputs committed between are not notified"
                    );
                    continue;
                }
                return Err(e.into());
            }
            step => step?,
        };
        if let Some(d) = &dispatcher {
            d.pass().await?;
        }
        if a.until_settled && step.snapshots == 0 {
            if let Some(d) = &dispatcher {
                d.until_settled(a.settle_timeout).await?;
            }
            break;
        }
        if step.snapshots == 0 {
            tokio::select! {
                _ = &mut stop => break,
                _ = tokio::time::sleep(a.poll_interval) => {}
            }
        }
    }
    let counts = ledger.counts(&spec.name, &a.target.namespace).await?;
    outln!(
        "effects of {} ({}): {}",
        spec.name,
        a.target.namespace,
        counts
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    )?;
    Ok(ExitCode::SUCCESS)
}

fn quantile(v: &[i64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v[(((v.len() - 1) as f64) * q).round() as usize] as f64 / 1000.0
}

async fn status(lake: &Lake, ledger: &Ledger, a: &StatusArgs) -> Result<ExitCode> {
    let (spec, source) = load(lake, &a.target).await?;
    let ns = &a.target.namespace;
    let counts = ledger.counts(&spec.name, ns).await?;
    let effects = ledger.effects(&spec.name, ns, None).await?;
    let mut latency: Vec<i64> = effects
        .iter()
        // An erased effect keeps no trigger time.
        .filter(|e| e.trigger_event_us != 0)
        .filter_map(|e| e.delivered_ms.map(|d| d - e.trigger_event_us / 1000))
        .collect();
    latency.sort_unstable();
    let need = spec.required_retention(source.dedup.replay_horizon, source.lateness.allowed);
    if a.format == Format::Json {
        outln!(
            "{}",
            serde_json::json!({
                "job": spec.name,
                "namespace": ns,
                "counts": counts,
                "retention_s": spec.ledger.retention.as_secs(),
                "required_retention_s": need.as_secs(),
                "delivered_latency_s": {"p50": quantile(&latency, 0.5), "p99": quantile(&latency, 0.99), "samples": latency.len()},
                "effects": a.list.as_ref().map(|s| effects.iter().filter(|e| &e.state == s).collect::<Vec<_>>()),
            })
        )?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut rows: Vec<Vec<String>> = counts
        .iter()
        .map(|(k, v)| vec![k.clone(), v.to_string()])
        .collect();
    rows.push(vec![
        "dedup horizon".into(),
        format!(
            "effect ids kept {} (needs {}: replay {} + lateness {} + backfills {})",
            humantime::format_duration(spec.ledger.retention),
            humantime::format_duration(need),
            humantime::format_duration(source.dedup.replay_horizon),
            humantime::format_duration(source.lateness.allowed),
            humantime::format_duration(spec.ledger.backfill_horizon),
        ),
    ]);
    rows.push(vec![
        "event time → delivered".into(),
        format!(
            "p50 {:.2} s, p99 {:.2} s ({} delivered)",
            quantile(&latency, 0.5),
            quantile(&latency, 0.99),
            latency.len()
        ),
    ]);
    print_rows(a.format, &["state", "effects"], rows)?;
    if let Some(s) = &a.list {
        print_rows(
            a.format,
            &["effect", "key", "attempts", "last error", "provider ref"],
            effects
                .iter()
                .filter(|e| &e.state == s)
                .map(|e| {
                    vec![
                        e.effect_id.clone(),
                        e.key.clone(),
                        e.attempts.to_string(),
                        e.last_error.clone().unwrap_or_default(),
                        e.provider_ref.clone().unwrap_or_default(),
                    ]
                })
                .collect(),
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

async fn provider_report(provider: &str) -> Option<DeliveryReport> {
    let url = format!("{}/v1/deliveries", provider.trim_end_matches('/'));
    let body = reqwest::get(&url)
        .await
        .ok()?
        .error_for_status()
        .ok()?
        .text()
        .await
        .ok()?;
    serde_json::from_str(&body).ok()
}

/// `effects reconcile`: exit 0 when nothing is left ambiguous and the provider saw no
/// duplicate, 1 otherwise.
async fn reconcile(lake: &Lake, ledger: &Ledger, a: &ReconcileArgs) -> Result<ExitCode> {
    let (spec, _) = load(lake, &a.target).await?;
    if a.target.namespace != "live" {
        bail!("only live effects are sent: a backfill namespace has nothing to reconcile");
    }
    // The runner's lease: what a running dispatcher has in flight is not ambiguous, and
    // resolving it here would send it twice. Refused (exit 3) while a runner holds it.
    let owner = format!(
        "effects-reconcile-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4()
    );
    ledger
        .lease(&spec.name, "live", &owner, LEASE_TTL)
        .await
        .context("`effects reconcile` runs only while no `effects run` does (stop it first)")?;
    let result = reconcile_leased(ledger, a, &spec).await;
    ledger.release(&spec.name, "live", &owner).await?;
    result
}

async fn reconcile_leased(
    ledger: &Ledger,
    a: &ReconcileArgs,
    spec: &NotificationSpec,
) -> Result<ExitCode> {
    let d = Arc::new(Dispatcher::new(
        ledger.clone(),
        &spec.name,
        &a.provider,
        spec.dispatch.clone(),
    )?);
    // Effects a dead dispatcher left in flight are ambiguous too.
    d.recover().await?;
    let (mut delivered, mut resend, mut unresolved) = (0u64, 0u64, 0u64);
    for e in ledger
        .effects(&spec.name, "live", Some(state::AMBIGUOUS))
        .await?
    {
        match d.lookup(&e.effect_id).await {
            Some(l) if l.deliveries > 0 => {
                let reference = l.reference.unwrap_or_default();
                if ledger
                    .transition(
                        &e.effect_id,
                        state::AMBIGUOUS,
                        state::RECONCILED,
                        "the provider delivered it",
                        Some(&reference),
                    )
                    .await?
                {
                    delivered += 1;
                }
            }
            Some(_) => {
                ledger
                    .transition(
                        &e.effect_id,
                        state::AMBIGUOUS,
                        state::INTENDED,
                        "the provider never received it",
                        None,
                    )
                    .await?;
                resend += 1;
            }
            None if a.resend_ambiguous => {
                ledger
                    .transition(
                        &e.effect_id,
                        state::AMBIGUOUS,
                        state::INTENDED,
                        "resent by the operator (the provider cannot be asked)",
                        None,
                    )
                    .await?;
                resend += 1;
            }
            None => unresolved += 1,
        }
    }
    let retried = if a.retry_failed {
        ledger.retry_failed(&spec.name).await?
    } else {
        0
    };
    if resend + retried > 0 {
        d.until_settled(spec.dispatch.deadline).await?;
    }
    let ours: std::collections::HashSet<String> = ledger
        .effects(&spec.name, "live", None)
        .await?
        .into_iter()
        .map(|e| e.effect_id)
        .collect();
    let report = provider_report(&a.provider).await;
    let duplicates = report.as_ref().map(|r| {
        let mut seen = std::collections::HashMap::<&str, u64>::new();
        for dl in r.deliveries.iter().filter(|d| ours.contains(&d.key)) {
            *seen.entry(dl.key.as_str()).or_default() += 1;
        }
        seen.values().map(|n| n.saturating_sub(1)).sum::<u64>()
    });
    let counts = ledger.counts(&spec.name, "live").await?;
    let left = counts.get(state::AMBIGUOUS).copied().unwrap_or(0);
    let failed = counts.get(state::FAILED).copied().unwrap_or(0);
    let summary = serde_json::json!({
        "resolved_delivered": delivered,
        "sent_again": resend,
        "unresolved": unresolved,
        "ambiguous_left": left,
        "failed_retried": retried,
        "failed_left": failed,
        "duplicates_seen_by_provider": duplicates,
        "counts": counts,
    });
    if a.format == Format::Json {
        outln!("{summary}")?;
    } else {
        print_rows(
            a.format,
            &["figure", "value"],
            vec![
                vec!["resolved: delivered".into(), delivered.to_string()],
                vec!["sent again".into(), resend.to_string()],
                vec!["still ambiguous".into(), left.to_string()],
                vec!["failed, sent again".into(), retried.to_string()],
                vec![
                    "failed (--retry-failed sends them again)".into(),
                    failed.to_string(),
                ],
                vec![
                    "duplicates seen by the provider".into(),
                    duplicates
                        .map(|d| d.to_string())
                        .unwrap_or_else(|| "unknown (no delivery report)".into()),
                ],
            ],
        )?;
    }
    Ok(
        if left == 0 && failed == 0 && duplicates.unwrap_or(0) == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        },
    )
}

/// `signalweave notify-sink`: until SIGTERM/SIGINT.
pub async fn sink(a: &SinkArgs) -> Result<ExitCode> {
    let listener = tokio::net::TcpListener::bind(&a.listen)
        .await
        .with_context(|| format!("listen on {}", a.listen))?;
    let addr = listener.local_addr()?;
    let config = SinkConfig {
        honour_keys: !a.ignore_idempotency_keys,
        lookup: !a.no_lookup,
    };
    eprintln!("notify-sink listening on http://{addr} ({config:?})");
    signalweave_effects::sink::serve(listener, config, crate::ingest::shutdown_signal()).await?;
    Ok(ExitCode::SUCCESS)
}

/// `signalweave bench effects`: records `n` intents, serves a sink in this process, and
/// dispatches them all; prints effects/s and the intent → delivered latency.
pub async fn bench(lake: Lake, n: u64, concurrency: usize, batch: usize) -> Result<()> {
    use signalweave_effects::Intent;
    let ledger = Ledger::open(lake.clone()).await?;
    let job = format!("bench_{}", chrono::Utc::now().timestamp_micros());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(signalweave_effects::sink::serve(
        listener,
        SinkConfig::default(),
        std::future::pending(),
    ));
    let now = chrono::Utc::now().timestamp_micros();
    let intents: Vec<Intent> = (0..n)
        .map(|i| Intent {
            effect_id: format!("eff-bench-{i:012}"),
            rule: "bench".into(),
            key: format!("c-{}", i % 10_000),
            window_start_us: now,
            value: 1,
            message: "bench".into(),
            trigger_event_us: now,
            source_snapshot: 0,
            cooldown_us: 0,
        })
        .collect();
    let recorded_at = std::time::Instant::now();
    ledger
        .commit_intents(&job, "live", None, 1, &intents, false)
        .await?;
    let record_s = recorded_at.elapsed().as_secs_f64();
    let spec = signalweave_effects::spec::DispatchSpec {
        concurrency,
        batch,
        ..Default::default()
    };
    let d = Arc::new(Dispatcher::new(ledger.clone(), &job, &url, spec)?);
    let started = std::time::Instant::now();
    let report = d.until_settled(Duration::from_secs(30)).await?;
    let seconds = started.elapsed().as_secs_f64();
    let effects = ledger.effects(&job, "live", Some(state::DELIVERED)).await?;
    let mut latency: Vec<i64> = effects
        .iter()
        .filter_map(|e| e.delivered_ms.map(|d| d - e.trigger_event_us / 1000))
        .collect();
    latency.sort_unstable();
    outln!(
        "effects: {} intents recorded in {record_s:.2} s ({:.0}/s, one transaction); {} delivered in {seconds:.2} s = {:.0} effects/s \
         (concurrency {concurrency}, batch {batch}; {report:?}); intent → delivered p50 {:.3} s, p99 {:.3} s",
        n,
        n as f64 / record_s,
        effects.len(),
        effects.len() as f64 / seconds,
        quantile(&latency, 0.5),
        quantile(&latency, 0.99),
    )?;
    Ok(())
}
