//! `signalweave gateway`, `signalweave produce` and `signalweave key`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use signalweave_gateway::{Gateway, GatewayConfig, hash_token};
use signalweave_lake::Lake;
use signalweave_model::SchemaRegistry;
use signalweave_producer::workload::{EventFactory, EventShape, drive};
use signalweave_producer::{Producer, ProducerConfig};

use crate::output::{Format, print_rows};

/// Options of `signalweave gateway`.
#[derive(Debug, Args)]
pub struct GatewayArgs {
    /// Gateway configuration (TOML): tenants and their keys, quotas, commit policy, limits.
    #[arg(long, default_value = "catalog/gateway/dev.toml")]
    pub config: PathBuf,
    /// Listen address; overrides `listen` in the configuration (port 0 picks a free port).
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Override the commit interval (for example `200ms`).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub commit_interval: Option<Duration>,
}

/// Options of `signalweave produce`.
#[derive(Debug, Args)]
pub struct ProduceArgs {
    /// Gateway base URL.
    #[arg(long, default_value = "http://127.0.0.1:8088")]
    pub url: String,
    /// API key (bearer token).
    #[arg(long, env = "SIGNALWEAVE_TOKEN", default_value = "sw-dev-tenant-0")]
    pub token: String,
    /// Target events per second.
    #[arg(long, default_value_t = 1000)]
    pub rate: u64,
    /// How long to send, for example `30s`.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub duration: Duration,
    /// Tenant of the events.
    #[arg(long, default_value = "tenant-0")]
    pub tenant: String,
    /// Producer id (default: `produce-<pid>`).
    #[arg(long)]
    pub producer_id: Option<String>,
    /// Fraction of events sent 3 h late (beyond the jobs' allowed lateness).
    #[arg(long, default_value_t = 0.0)]
    pub late_fraction: f64,
    /// Fraction of sends that repeat a recent event (same event id).
    #[arg(long, default_value_t = 0.0)]
    pub dup_fraction: f64,
    /// Serialized size of an event, bytes.
    #[arg(long, default_value_t = 1200)]
    pub event_size: usize,
    /// Most events per request.
    #[arg(long, default_value_t = ProducerConfig::DEFAULT_MAX_BATCH_EVENTS)]
    pub batch_events: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = ProducerConfig::DEFAULT_CONCURRENCY)]
    pub concurrency: usize,
    /// Longest an event may wait unacknowledged before it is dropped.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5m")]
    pub max_unsent_age: Duration,
    /// How long to wait for outstanding acknowledgments at the end.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "60s")]
    pub flush_timeout: Duration,
    /// Random seed of the synthetic events.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Output format of the report.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// `signalweave key …`
#[derive(Debug, Subcommand)]
pub enum KeyCommand {
    /// Make a new API key: prints the token once, and the configuration entry (its hash).
    New {
        /// The tenant the key is bound to.
        #[arg(long)]
        tenant: String,
        /// Producers the key may speak for (comma-separated; `*` for any).
        #[arg(long, default_value = "*", value_delimiter = ',')]
        producers: Vec<String>,
        /// Who holds the key.
        #[arg(long)]
        label: Option<String>,
    },
    /// Print the SHA-256 of an existing token (what the configuration stores).
    Hash {
        /// The token.
        token: String,
    },
}

/// Reads and checks a gateway configuration file.
pub fn gateway_config(path: &Path) -> Result<GatewayConfig> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading gateway configuration {}", path.display()))?;
    let config: GatewayConfig =
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    config
        .validate()
        .with_context(|| format!("checking {}", path.display()))?;
    Ok(config)
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

/// Runs the gateway until SIGTERM or SIGINT, then drains.
pub async fn run_gateway(
    args: &GatewayArgs,
    lake: Lake,
    registry: SchemaRegistry,
) -> Result<ExitCode> {
    let mut config = gateway_config(&args.config)?;
    if let Some(listen) = args.listen {
        config.listen = listen;
    }
    if let Some(interval) = args.commit_interval {
        config.commit.interval = interval;
    }
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding {}", config.listen))?;
    let addr = listener.local_addr()?;
    let gateway = Gateway::start(config, lake, Arc::new(registry)).await?;
    eprintln!(
        "signalweave gateway listening on http://{addr} (writer {}, {} identities in the dedup index)",
        gateway.writer_id(),
        gateway.dedup_loaded()
    );
    let report = gateway.serve(listener, shutdown_signal()).await?;
    eprintln!(
        "signalweave gateway stopped: {} commits, {} events committed, {} abandoned",
        report.commits, report.events, report.abandoned_events
    );
    if report.abandoned_events > 0 {
        return Ok(ExitCode::from(3));
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs `signalweave produce`; exit 1 when any event was dropped or rejected.
pub async fn run_produce(args: &ProduceArgs) -> Result<ExitCode> {
    if !(0.0..=1.0).contains(&args.late_fraction) || !(0.0..=1.0).contains(&args.dup_fraction) {
        bail!("--late-fraction and --dup-fraction must be within 0..=1");
    }
    let producer_id = args
        .producer_id
        .clone()
        .unwrap_or_else(|| format!("produce-{}", std::process::id()));
    let mut config = ProducerConfig::new(&args.url, &args.token);
    config.max_batch_events = args.batch_events;
    config.concurrency = args.concurrency;
    config.max_unsent_age = args.max_unsent_age;
    let producer = Producer::start(config)?;
    let factory = EventFactory::new(EventShape {
        event_bytes: args.event_size,
        late_fraction: args.late_fraction,
        dup_fraction: args.dup_fraction,
        seed: args.seed,
        ..EventShape::new(&args.tenant, &producer_id)
    });
    let report = drive(
        producer,
        factory,
        args.rate,
        args.duration,
        args.flush_timeout,
    )
    .await;
    let s = &report.stats;
    let ms = |d: Option<Duration>| {
        d.map_or("-".to_string(), |d| format!("{:.1}", d.as_secs_f64() * 1e3))
    };
    let lat = s.ack_latency;
    let mut rows: Vec<(String, String)> = vec![
        ("producer".into(), producer_id),
        ("offered".into(), report.offered.to_string()),
        ("accepted".into(), s.accepted.to_string()),
        ("duplicate".into(), s.duplicate.to_string()),
        ("rejected".into(), s.rejected.to_string()),
        ("dropped (buffer full)".into(), s.dropped_buffer.to_string()),
        ("dropped (too old)".into(), s.dropped_age.to_string()),
        ("throttled (429)".into(), s.throttled.to_string()),
        ("unavailable (503)".into(), s.unavailable.to_string()),
        ("failed requests".into(), s.failed_requests.to_string()),
        ("requests".into(), s.requests.to_string()),
        (
            "elapsed s".into(),
            format!("{:.2}", report.elapsed.as_secs_f64()),
        ),
        (
            "acked events/s".into(),
            format!("{:.0}", report.acked_per_sec()),
        ),
        ("ack p50 ms".into(), ms(lat.map(|l| l[0]))),
        ("ack p99 ms".into(), ms(lat.map(|l| l[1]))),
        ("ack p99.9 ms".into(), ms(lat.map(|l| l[2]))),
    ];
    if let Some((cpu, rss)) = crate::bench::proc_usage() {
        rows.push(("cpu s".into(), format!("{cpu:.2}")));
        rows.push((
            "peak rss MiB".into(),
            format!("{:.0}", rss as f64 / 1048576.0),
        ));
    }
    for (reason, n) in &s.rejected_by_reason {
        rows.push((format!("rejected: {reason}"), n.to_string()));
    }
    print_rows(
        args.format,
        &["measure", "value"],
        rows.into_iter().map(|(k, v)| vec![k, v]).collect(),
    )?;
    let lost = s.dropped_age + s.dropped_buffer;
    Ok(if lost > 0 || s.rejected > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// Runs `signalweave key …`.
pub fn run_key(cmd: &KeyCommand) -> Result<()> {
    match cmd {
        KeyCommand::New {
            tenant,
            producers,
            label,
        } => {
            let token = format!(
                "sw_{}{}",
                uuid::Uuid::new_v4().simple(),
                uuid::Uuid::new_v4().simple()
            );
            println!("token (shown once; give it to the producer): {token}");
            println!();
            println!("# add under the [[tenants]] entry with id = {tenant:?}:");
            println!("[[tenants.keys]]");
            if let Some(l) = label {
                println!("label = {l:?}");
            }
            println!("sha256 = {:?}", hash_token(&token));
            println!("producers = {producers:?}");
        }
        KeyCommand::Hash { token } => println!("{}", hash_token(token)),
    }
    Ok(())
}
