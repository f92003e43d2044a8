//! # signalweave
//!
//! The one binary of SignalWeave. It is the only place that reads configuration from
//! files and the environment; it turns them into typed config and passes it down to the
//! library crates. Exit codes: 0 success, 1 a command ran and found a problem, 2 bad
//! usage or input, 3 a dependency (catalog, object store) was unavailable, 4 internal.

mod audit;
mod backfill;
mod bench;
mod bench_live;
mod effects;
mod erase;
mod ingest;
mod live;
#[macro_use]
mod output;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use signalweave_fixtures::{ExpectedFigures, Generator, WorkloadSpec};
use signalweave_lake::{AsOf, Lake, LakeConfig, LakeError, LakeTable, LoadOptions};
use signalweave_model::{ErrorKind, EventValidator, SchemaRegistry, ValidationLimits};

use crate::output::{Format, print_rows, print_stream};

/// SignalWeave: a batch-and-stream replay and backfill engine on an Iceberg lake.
#[derive(Debug, Parser)]
#[command(name = "signalweave", version, about)]
struct Cli {
    /// The lake: a directory for the embedded lake (SQLite catalog + local warehouse), or a
    /// profile file (`*.toml`) naming a catalog URL and a warehouse. Default: ./lake.
    #[arg(long, global = true, env = "SIGNALWEAVE_LAKE", default_value = "lake")]
    lake: PathBuf,

    /// Directory of event-type declarations. Default: ./catalog/events.
    #[arg(
        long,
        global = true,
        env = "SIGNALWEAVE_SCHEMAS",
        default_value = "catalog/events"
    )]
    schemas: PathBuf,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Administer the lake's tables.
    #[command(subcommand)]
    Lake(LakeCommand),
    /// Run a SQL query over the lake (tables are `signalweave.<name>`).
    Sql {
        /// The query.
        query: String,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Table)]
        format: Format,
        /// Read every table as it was at this RFC 3339 moment.
        #[arg(long, conflicts_with = "snapshot")]
        as_of: Option<String>,
        /// Read the table that owns this snapshot id as of that snapshot.
        #[arg(long)]
        snapshot: Option<i64>,
    },
    /// Bulk-load events (NDJSON or Parquet) through the gateway's validation.
    Load {
        /// The file to load (`.ndjson`/`.jsonl` or `.parquet`).
        file: PathBuf,
        /// Records per commit.
        #[arg(long, default_value_t = LoadOptions::DEFAULT_CHUNK_RECORDS)]
        chunk_records: usize,
        /// Output format of the report.
        #[arg(long, value_enum, default_value_t = Format::Table)]
        format: Format,
    },
    /// Generate deterministic fixture events.
    #[command(subcommand)]
    Fixtures(FixturesCommand),
    /// Run live jobs: tail the landing table, checkpoint, commit versioned outputs.
    Run(live::RunArgs),
    /// Run everything in one process: gateway, live jobs, serving API, maintenance.
    Up(live::UpArgs),
    /// Show the live jobs of a running `up` (lag, watermark, checkpoints, freshness).
    Status(live::StatusArgs),
    /// The main job for a newcomer: gateway, live jobs and serving on the lake, a producer
    /// with late and duplicate events, a live view, and a reconciliation at the end.
    Demo(live::DemoArgs),
    /// Compare a job's current outputs with an SQL recount of the landing table.
    Recount {
        /// The job spec.
        #[arg(long, default_value = "jobs/market_aggregates.toml")]
        job: PathBuf,
        /// Output namespace.
        #[arg(long, default_value = "live")]
        namespace: String,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Table)]
        format: Format,
    },
    /// Run the ingestion gateway (HTTP) on the lake, until SIGTERM or SIGINT.
    Gateway(ingest::GatewayArgs),
    /// Send synthetic events to a gateway at a target rate; report acknowledgments,
    /// latency percentiles, rejections and throttles.
    Produce(ingest::ProduceArgs),
    /// Make or hash gateway API keys.
    #[command(subcommand)]
    Key(ingest::KeyCommand),
    /// Backfills: a job version over an event-time range into its own namespace, under
    /// token budgets live traffic takes back; compare, promote, roll back.
    #[command(subcommand)]
    Backfill(backfill::BackfillCommand),
    /// Reconcile a job's outputs with an independent SQL oracle over the landing table:
    /// every window recomputed, every event accounted for; writes report.html, .json and
    /// .md. Exit 0 on a match, 1 otherwise.
    Reconcile(audit::ReconcileArgs),
    /// The capacity model of a sheet (freshness ledger, backlogs, bytes, state, backfill
    /// bounds), optionally with figures measured by a running `signalweave up`.
    Plan(audit::PlanArgs),
    /// Customer notifications: run a notification job, its ledger's status, reconcile
    /// ambiguous effects with the provider, expire settled effects.
    #[command(subcommand)]
    Effects(effects::EffectsCommand),
    /// A notification provider for tests and the demo: honours idempotency keys, answers
    /// lookups, and can be told to fail, delay, or drop answers.
    NotifySink(effects::SinkArgs),
    /// Run a benchmark (release builds only give meaningful figures).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

#[derive(Debug, Subcommand)]
enum LakeCommand {
    /// Create the namespace and tables if missing (idempotent).
    Init,
    /// List the tables with their current snapshot, files and records.
    Tables {
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Table)]
        format: Format,
    },
    /// Merge manifests, expire snapshots by the retention rule (never a held position),
    /// delete the files nothing references any more, and optionally sweep orphans.
    Maintain {
        /// One table (default: all).
        #[arg(long)]
        table: Option<String>,
        /// Merge manifests once the current snapshot holds this many.
        #[arg(long, default_value_t = signalweave_lake::MaintenancePolicy::DEFAULT_MIN_MANIFESTS_TO_MERGE)]
        min_manifests: usize,
        /// Also delete unreferenced files older than this (at least `1h`): a file a
        /// writer has written but not yet committed looks unreferenced.
        #[arg(long, value_parser = humantime::parse_duration)]
        orphans_older_than: Option<std::time::Duration>,
        /// Let `--orphans-older-than` be under an hour: only while nothing writes to the
        /// lake (a younger file may be an append in flight, and sweeping it breaks the
        /// table).
        #[arg(long, requires = "orphans_older_than")]
        allow_young_orphans: bool,
        /// Keep running: a pass every this long (at least `1s`, for example `60s`), one at
        /// a time, until SIGINT or SIGTERM; a failed pass is logged and the next one tries
        /// again.
        #[arg(long, value_parser = humantime::parse_duration)]
        every: Option<std::time::Duration>,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Table)]
        format: Format,
    },
    /// Bin-pack the small data files of each partition into files of about the target
    /// size, as one `replace` snapshot (the live tail skips it). Events are kept in
    /// commit order with each row's commit (row lineage), other tables sorted by time.
    Compact {
        /// One table (default: all).
        #[arg(long)]
        table: Option<String>,
        /// Only this day partition (YYYY-MM-DD).
        #[arg(long)]
        partition: Option<chrono::NaiveDate>,
        /// Compact a partition once it holds this many small files.
        #[arg(long, default_value_t = signalweave_lake::CompactionPolicy::DEFAULT_MIN_INPUT_FILES)]
        min_files: usize,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Table)]
        format: Format,
    },
    /// Erase a data subject: remove the customer's events (and the late and rejected rows
    /// that identify them) and every version of the output windows keyed by the customer
    /// by rewriting the affected files, erase their notifications' keys and messages,
    /// expire the snapshots that still reference the old files and delete them; record
    /// the erasure (not the values) and report what derived outputs must be recomputed.
    Erase {
        /// The customer to erase.
        #[arg(long)]
        customer_id: String,
        /// The tenant whose customer it is (a customer id of another tenant names another
        /// person); required unless `--all-tenants`.
        #[arg(long, required_unless_present = "all_tenants")]
        tenant: Option<String>,
        /// Erase the customer id in every tenant.
        #[arg(long, conflicts_with = "tenant")]
        all_tenants: bool,
        /// Why (recorded, for example a ticket id).
        #[arg(long)]
        reason: String,
        /// Who asked (recorded).
        #[arg(long, env = "USER", default_value = "unknown")]
        requested_by: String,
        /// Directory of job specs (every version under it): the outputs whose key names
        /// a customer lose the subject's windows, and the notifications of those jobs
        /// their effects.
        #[arg(long, env = "SIGNALWEAVE_JOBS_DIR", default_value = "jobs")]
        jobs_dir: PathBuf,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Table)]
        format: Format,
    },
    /// Expire snapshots by each table's retention rule and delete the manifest lists,
    /// manifests, data files and old metadata files only they referenced.
    Expire {
        /// One table (default: all).
        #[arg(long)]
        table: Option<String>,
        /// Keep at least this many snapshots (1 or more), overriding the table property
        /// (its age rule still applies unless `--older-than-secs` is given too).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        retain_last: Option<u64>,
        /// Expire snapshots older than this many seconds (0 or more), overriding the table
        /// property.
        #[arg(long, value_parser = clap::value_parser!(i64).range(0..))]
        older_than_secs: Option<i64>,
    },
    /// List the positions held against expiry (live checkpoints, backfills, notifiers);
    /// `--release HOLDER` first releases a retired holder's holds.
    Holds {
        /// Release this holder's holds (for example `effects:notifications:live`).
        #[arg(long)]
        release: Option<String>,
        /// With `--release`: only on this table.
        #[arg(long, requires = "release")]
        table: Option<String>,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Table)]
        format: Format,
    },
    /// List the snapshots of a table.
    Snapshots {
        /// `events`, `rejections` or `late_events`.
        table: String,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Table)]
        format: Format,
    },
}

#[derive(Debug, Subcommand)]
enum FixturesCommand {
    /// Write generated events as NDJSON.
    Generate {
        /// Output file.
        #[arg(long)]
        out: PathBuf,
        /// Distinct events.
        #[arg(long, default_value_t = 10_000)]
        events: u64,
        /// Seed.
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Fraction resent as duplicates.
        #[arg(long, default_value_t = 0.01)]
        dup_fraction: f64,
        /// Fraction arriving late.
        #[arg(long, default_value_t = 0.01)]
        late_fraction: f64,
        /// Fraction of extra invalid records.
        #[arg(long, default_value_t = 0.0)]
        invalid_fraction: f64,
        /// Distinct events per second of event time.
        #[arg(long, default_value_t = 100)]
        events_per_sec: u64,
        /// Also write the figures the fixture must produce once loaded (JSON).
        #[arg(long)]
        expected: Option<PathBuf>,
    },
}

/// The tables a `--table` option names: one, or all when it is absent.
fn tables_arg(table: Option<&str>) -> Result<Vec<LakeTable>> {
    Ok(match table {
        Some(t) => vec![LakeTable::from_name(t)?],
        None => LakeTable::ALL
            .into_iter()
            .chain(LakeTable::outputs())
            .collect(),
    })
}

/// Reads the lake option: a directory (embedded) or a TOML profile file.
fn lake_config(path: &Path) -> Result<LakeConfig> {
    if path.extension().is_some_and(|e| e == "toml") {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading lake profile {}", path.display()))?;
        let config: LakeConfig =
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        Ok(config)
    } else {
        Ok(LakeConfig::embedded(path))
    }
}

async fn open_lake(cli: &Cli) -> Result<Lake> {
    let lake = Lake::open(lake_config(&cli.lake)?).await?;
    lake.init().await?;
    lake.register_output_tables().await?;
    Ok(lake)
}

/// [`open_lake`] for commands that only read: an embedded lake that does not exist is an
/// error, not a new empty lake whose tables answer zero (a mistyped `--lake`, or another
/// working directory than the lake's).
async fn open_existing_lake(cli: &Cli) -> Result<Lake> {
    let is_profile = cli.lake.extension().is_some_and(|e| e == "toml");
    if !is_profile && !cli.lake.join("catalog.db").exists() {
        return Err(anyhow::Error::new(LakeError::new(
            signalweave_model::ErrorKind::NotFound,
            format!(
                "no lake at {}: `signalweave lake init` makes one there, or pass --lake",
                cli.lake.display()
            ),
        )));
    }
    open_lake(cli).await
}

/// The event types of `--schemas`.
fn registry(cli: &Cli) -> Result<SchemaRegistry> {
    SchemaRegistry::load_dir(&cli.schemas)
        .with_context(|| format!("loading event types from {}", cli.schemas.display()))
}

fn validator(cli: &Cli) -> Result<EventValidator> {
    Ok(EventValidator::new(
        Arc::new(registry(cli)?),
        ValidationLimits::default(),
    ))
}

async fn run(cli: Cli) -> Result<ExitCode> {
    match &cli.command {
        Command::Lake(LakeCommand::Init) => {
            let lake = Lake::open(lake_config(&cli.lake)?).await?;
            let created = lake.init().await?;
            for (table, new) in created {
                outln!(
                    "signalweave.{:<12} {}",
                    table.name(),
                    if new { "created" } else { "exists" }
                )?;
            }
            outln!(
                "catalog {} · warehouse {}",
                lake.config().redacted_catalog_url(),
                lake.config().warehouse_location()
            )?;
        }
        Command::Lake(LakeCommand::Tables { format }) => {
            let lake = open_existing_lake(&cli).await?;
            let mut rows = Vec::new();
            for table in LakeTable::ALL.into_iter().chain(LakeTable::outputs()) {
                let snaps = lake.snapshots(table).await?;
                let t = lake.table(table).await?;
                let current = t.metadata().current_snapshot();
                let props = current.map(|s| s.summary().additional_properties.clone());
                let get = |k: &str| {
                    props
                        .as_ref()
                        .and_then(|p| p.get(k).cloned())
                        .unwrap_or_else(|| "0".into())
                };
                rows.push(vec![
                    format!("signalweave.{}", table.name()),
                    current
                        .map(|s| s.snapshot_id().to_string())
                        .unwrap_or_else(|| "-".into()),
                    snaps.len().to_string(),
                    get("total-data-files"),
                    get("total-records"),
                    t.metadata().location().to_string(),
                ]);
            }
            print_rows(
                *format,
                &[
                    "table",
                    "current_snapshot",
                    "snapshots",
                    "data_files",
                    "records",
                    "location",
                ],
                rows,
            )?;
        }
        Command::Lake(LakeCommand::Expire {
            table,
            retain_last,
            older_than_secs,
        }) => {
            let max_age_ms = older_than_secs.map(|s| s.saturating_mul(1000));
            let lake = open_existing_lake(&cli).await?;
            let tables = tables_arg(table.as_deref())?;
            for t in tables {
                let before = lake.snapshots(t).await?.len();
                // `--retain-last` alone keeps the table's age rule; `--older-than-secs`
                // alone keeps the newest snapshot at least (as Iceberg's procedure does).
                let own = lake.retention_of(t).await?;
                let retention = (retain_last.is_some() || max_age_ms.is_some()).then_some(
                    signalweave_lake::Retention {
                        keep_last: retain_last
                            .map_or(1, |n| usize::try_from(n).unwrap_or(usize::MAX)),
                        max_age_ms: max_age_ms.unwrap_or(own.max_age_ms),
                    },
                );
                let policy = signalweave_lake::MaintenancePolicy {
                    min_manifests_to_merge: usize::MAX,
                    retention,
                    ..Default::default()
                };
                let report = lake.maintain(t, &policy).await?;
                outln!(
                    "signalweave.{:<12} snapshots {} -> {}; deleted {} manifest lists, {} manifests, {} data files, {} metadata files",
                    t.name(),
                    before,
                    before - report.snapshots_expired,
                    report.deleted.manifest_lists,
                    report.deleted.manifests,
                    report.deleted.data_files,
                    report.deleted.metadata_files
                )?;
            }
        }
        Command::Lake(LakeCommand::Compact {
            table,
            partition,
            min_files,
            format,
        }) => {
            let lake = open_existing_lake(&cli).await?;
            let tables = tables_arg(table.as_deref())?;
            let epoch = chrono::NaiveDate::from_ymd_opt(1970, 1, 1).unwrap_or_default();
            let policy = signalweave_lake::CompactionPolicy {
                min_input_files: *min_files,
                partition_day: partition.map(|d| (d - epoch).num_days() as i32),
                ..Default::default()
            };
            let mut rows = Vec::new();
            for t in tables {
                let r = lake.compact(t, &policy).await?;
                rows.push(vec![
                    t.name().to_string(),
                    r.partitions.to_string(),
                    format!("{} -> {}", r.files_removed, r.files_added),
                    r.rows.to_string(),
                    format!("{} -> {}", r.bytes_removed, r.bytes_added),
                    r.snapshot_id.map(|s| s.to_string()).unwrap_or_default(),
                ]);
            }
            print_rows(
                *format,
                &["table", "partitions", "files", "rows", "bytes", "snapshot"],
                rows,
            )?;
        }
        Command::Lake(LakeCommand::Erase {
            customer_id,
            tenant,
            all_tenants: _,
            reason,
            requested_by,
            jobs_dir,
            format,
        }) => {
            let lake = open_existing_lake(&cli).await?;
            let request = signalweave_lake::ErasureRequest {
                customer_id: customer_id.clone(),
                tenant: tenant.clone(),
                reason: reason.clone(),
                requested_by: requested_by.clone(),
                outputs: Vec::new(),
            };
            erase::run(&lake, request, jobs_dir, *format).await?;
        }
        Command::Lake(LakeCommand::Maintain {
            table,
            min_manifests,
            orphans_older_than,
            allow_young_orphans,
            every,
            format,
        }) => {
            if let Some(age) = orphans_older_than
                && *age < MIN_ORPHAN_AGE
                && !allow_young_orphans
            {
                bail!(
                    "--orphans-older-than {} is under an hour: a file a writer has written but \
                     not yet committed (a manifest list, a data file) would be swept, and its \
                     commit would then break the table; give 1h or more, or add \
                     --allow-young-orphans when nothing writes to the lake",
                    humantime::format_duration(*age)
                );
            }
            if every.is_some_and(|e| e < std::time::Duration::from_secs(1)) {
                bail!("--every must be 1s or more");
            }
            let lake = open_existing_lake(&cli).await?;
            let tables = tables_arg(table.as_deref())?;
            let policy = signalweave_lake::MaintenancePolicy {
                min_manifests_to_merge: *min_manifests,
                orphan_safety_age: *orphans_older_than,
                ..Default::default()
            };
            if let Some(every) = every {
                let stop = ingest::shutdown_signal();
                tokio::pin!(stop);
                loop {
                    for t in &tables {
                        match lake.maintain(*t, &policy).await {
                            Ok(r) => {
                                eprintln!(
                                    "{} {}: manifests {} -> {}, {} snapshots expired ({} held), {} files deleted",
                                    chrono::Utc::now().format("%H:%M:%S"),
                                    t.name(),
                                    r.manifests_before,
                                    r.manifests_after,
                                    r.snapshots_expired,
                                    r.snapshots_held,
                                    r.deleted.manifest_lists
                                        + r.deleted.manifests
                                        + r.deleted.data_files
                                        + r.deleted.metadata_files
                                        + r.deleted.orphans
                                );
                                if let Ok(Some(w)) =
                                    lake.held_history_warning(*t, &r, &policy).await
                                {
                                    eprintln!("warning: {w}");
                                }
                            }
                            Err(e) => eprintln!("{}: maintenance pass failed: {e}", t.name()),
                        }
                    }
                    tokio::select! {
                        _ = &mut stop => break,
                        _ = tokio::time::sleep(*every) => {}
                    }
                }
                return Ok(ExitCode::SUCCESS);
            }
            let mut rows = Vec::new();
            for t in tables {
                let r = lake.maintain(t, &policy).await?;
                if let Some(w) = lake.held_history_warning(t, &r, &policy).await? {
                    eprintln!("warning: {w}");
                }
                rows.push(vec![
                    t.name().to_string(),
                    format!("{} -> {}", r.manifests_before, r.manifests_after),
                    r.snapshots_expired.to_string(),
                    r.snapshots_held.to_string(),
                    (r.deleted.manifest_lists + r.deleted.manifests).to_string(),
                    r.deleted.data_files.to_string(),
                    r.deleted.metadata_files.to_string(),
                    r.deleted.orphans.to_string(),
                ]);
            }
            print_rows(
                *format,
                &[
                    "table",
                    "manifests",
                    "snapshots expired",
                    "held",
                    "manifest files deleted",
                    "data files deleted",
                    "metadata files deleted",
                    "orphans deleted",
                ],
                rows,
            )?;
        }
        Command::Lake(LakeCommand::Holds {
            release,
            table,
            format,
        }) => {
            let lake = open_existing_lake(&cli).await?;
            if let Some(holder) = release {
                let n = lake.release_holder(holder, table.as_deref()).await?;
                if n == 0 {
                    return Err(LakeError::new(
                        ErrorKind::NotFound,
                        format!(
                            "no hold of `{holder}`{} to release",
                            table
                                .as_deref()
                                .map(|t| format!(" on {t}"))
                                .unwrap_or_default()
                        ),
                    )
                    .into());
                }
                eprintln!("released {n} hold(s) of {holder}");
            }
            let now = chrono::Utc::now().timestamp_millis();
            let rows = lake
                .snapshot_holds()
                .await?
                .into_iter()
                .map(|h| {
                    vec![
                        h.table,
                        h.holder,
                        h.snapshot_id.to_string(),
                        chrono::DateTime::from_timestamp_millis(h.updated_ms)
                            .map(|t| t.to_rfc3339())
                            .unwrap_or_default(),
                        format!("{:.0}", (now - h.updated_ms).max(0) as f64 / 1000.0),
                    ]
                })
                .collect();
            print_rows(
                *format,
                &["table", "holder", "snapshot_id", "updated_at", "age_s"],
                rows,
            )?;
        }
        Command::Lake(LakeCommand::Snapshots { table, format }) => {
            let lake = open_existing_lake(&cli).await?;
            let table = LakeTable::from_name(table)?;
            let rows = lake
                .snapshots(table)
                .await?
                .into_iter()
                .map(|s| {
                    vec![
                        s.snapshot_id.to_string(),
                        s.parent_id.map(|p| p.to_string()).unwrap_or_default(),
                        s.sequence_number.to_string(),
                        chrono::DateTime::from_timestamp_millis(s.timestamp_ms)
                            .map(|t| t.to_rfc3339())
                            .unwrap_or_default(),
                        s.operation,
                        s.writer_id.unwrap_or_default(),
                        s.batch_seq.map(|b| b.to_string()).unwrap_or_default(),
                        s.added_records.to_string(),
                        s.added_files.to_string(),
                        s.total_records.to_string(),
                    ]
                })
                .collect();
            print_rows(
                *format,
                &[
                    "snapshot_id",
                    "parent_id",
                    "sequence",
                    "committed_at",
                    "operation",
                    "writer",
                    "batch_seq",
                    "added_records",
                    "added_files",
                    "total_records",
                ],
                rows,
            )?;
        }
        Command::Sql {
            query,
            format,
            as_of,
            snapshot,
        } => {
            let lake = open_existing_lake(&cli).await?;
            let ctx = match (as_of, snapshot) {
                (Some(t), _) => {
                    let at = chrono::DateTime::parse_from_rfc3339(t)
                        .with_context(|| format!("--as-of `{t}` is not RFC 3339"))?;
                    lake.session_context_as_of(AsOf::Timestamp(at.timestamp_millis()))
                        .await?
                }
                (None, Some(id)) => lake.session_context_as_of(AsOf::Snapshot(*id)).await?,
                (None, None) => lake.session_context().await?,
            };
            // `sql` reads the lake: statements that would write files (COPY), create or
            // drop objects, or change the session are refused before they run. (A COPY
            // into a data file's path would overwrite committed data.)
            let read_only = datafusion::execution::context::SQLOptions::new()
                .with_allow_ddl(false)
                .with_allow_dml(false)
                .with_allow_statements(false);
            let df = ctx.sql_with_options(query, read_only).await.map_err(|e| {
                let refused = matches!(
                    e.find_root(),
                    datafusion::error::DataFusionError::Plan(m) if m.contains("not supported")
                );
                let context = if refused {
                    "plan query (`sql` only reads the lake: SELECT, WITH, EXPLAIN)"
                } else {
                    "plan query"
                };
                LakeError::datafusion(context, e)
            })?;
            let stream = df
                .execute_stream()
                .await
                .map_err(|e| LakeError::datafusion("run query", e))?;
            print_stream(*format, stream).await?;
        }
        Command::Load {
            file,
            chunk_records,
            format,
        } => {
            let validator = validator(&cli)?;
            let lake = open_lake(&cli).await?;
            let options = LoadOptions {
                chunk_records: *chunk_records,
                source_name: format!("load:{}", file.display()),
                ..Default::default()
            };
            let report = lake.load_file(file, &validator, &options).await?;
            let mut rows = vec![
                vec!["records".to_string(), report.records.to_string()],
                vec!["accepted".into(), report.accepted.to_string()],
                vec![
                    "accepted_earlier".into(),
                    report.accepted_earlier.to_string(),
                ],
                vec!["duplicates".into(), report.duplicates.to_string()],
                vec!["rejected".into(), report.rejected.to_string()],
                vec![
                    "chunks_committed".into(),
                    report.chunks_committed.to_string(),
                ],
                vec!["chunks_skipped".into(), report.chunks_skipped.to_string()],
            ];
            for (reason, n) in &report.rejected_by_reason {
                rows.push(vec![format!("rejected:{reason}"), n.to_string()]);
            }
            if *format == Format::Json {
                outln!("{}", serde_json::to_string_pretty(&report)?)?;
            } else {
                print_rows(*format, &["measure", "value"], rows)?;
            }
        }
        Command::Fixtures(FixturesCommand::Generate {
            out,
            events,
            seed,
            dup_fraction,
            late_fraction,
            invalid_fraction,
            events_per_sec,
            expected,
        }) => {
            use std::io::Write;
            let spec = WorkloadSpec {
                seed: *seed,
                events: *events,
                dup_fraction: *dup_fraction,
                late_fraction: *late_fraction,
                invalid_fraction: *invalid_fraction,
                events_per_sec: *events_per_sec,
                ..Default::default()
            };
            let file = std::fs::File::create(out)
                .with_context(|| format!("creating {}", out.display()))?;
            let mut w = std::io::BufWriter::new(file);
            let mut figures = ExpectedFigures::default();
            for record in Generator::new(spec) {
                writeln!(w, "{}", record.to_json_line())?;
                figures.count(&record);
            }
            w.flush()?;
            if let Some(path) = expected {
                std::fs::write(path, serde_json::to_string_pretty(&figures)? + "\n")
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            eprintln!("wrote {} records to {}", figures.records, out.display());
        }
        Command::Gateway(args) => {
            let lake = open_lake(&cli).await?;
            let registry = registry(&cli)?;
            return ingest::run_gateway(args, lake, registry).await;
        }
        Command::Produce(args) => return ingest::run_produce(args).await,
        Command::Run(args) => {
            let lake = open_lake(&cli).await?;
            return live::run(lake, args).await;
        }
        Command::Up(args) => {
            let lake = open_lake(&cli).await?;
            let registry = registry(&cli)?;
            return live::up(lake, registry, args).await;
        }
        Command::Status(args) => return live::status(args).await,
        Command::Demo(args) => {
            let lake = open_lake(&cli).await?;
            let registry = registry(&cli)?;
            return live::demo(lake, registry, args).await;
        }
        Command::Recount {
            job,
            namespace,
            format,
        } => {
            let lake = open_existing_lake(&cli).await?;
            let spec = signalweave_window::JobSpec::from_file(job)
                .with_context(|| format!("reading job spec {}", job.display()))?;
            let r = live::reconcile(&lake, &spec, namespace).await?;
            print_rows(*format, &live::Reconciliation::HEADER, vec![r.row()])?;
            if !r.agrees() {
                return Ok(ExitCode::from(1));
            }
        }
        Command::Backfill(cmd) => {
            let lake = open_existing_lake(&cli).await?;
            return backfill::run(lake, cmd).await;
        }
        Command::Reconcile(args) => {
            let lake = open_existing_lake(&cli).await?;
            return audit::reconcile(lake, args).await;
        }
        Command::Plan(args) => return audit::plan(args).await,
        Command::Effects(cmd) => {
            let lake = open_existing_lake(&cli).await?;
            return effects::run(lake, cmd).await;
        }
        Command::NotifySink(args) => return effects::sink(args).await,
        Command::Key(cmd) => ingest::run_key(cmd)?,
        Command::Bench(cmd) => {
            let config = lake_config(&cli.lake)?;
            bench::run(cmd, config, &cli.schemas).await?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The youngest files `lake maintain --orphans-older-than` sweeps without
/// `--allow-young-orphans`: older than any append in flight.
const MIN_ORPHAN_AGE: std::time::Duration = std::time::Duration::from_secs(3600);

fn exit_code(err: &anyhow::Error) -> u8 {
    let kind = err
        .chain()
        .find_map(|e| e.downcast_ref::<LakeError>().map(LakeError::kind))
        .or_else(|| {
            err.chain().find_map(|e| {
                e.downcast_ref::<signalweave_gateway::GatewayError>()
                    .map(|e| e.kind())
            })
        })
        .or_else(|| {
            err.chain().find_map(|e| {
                e.downcast_ref::<signalweave_runner::RunnerError>()
                    .map(|e| e.kind())
            })
        })
        .or_else(|| {
            err.chain().find_map(|e| {
                e.downcast_ref::<signalweave_model::Error>()
                    .map(|e| e.kind())
            })
        })
        .or_else(|| {
            err.chain().find_map(|e| {
                e.downcast_ref::<signalweave_audit::AuditError>()
                    .map(|e| e.kind())
            })
        })
        .or_else(|| {
            err.chain().find_map(|e| {
                e.downcast_ref::<signalweave_effects::EffectError>()
                    .map(|e| e.kind())
            })
        });
    match kind {
        Some(ErrorKind::InvalidInput | ErrorKind::NotFound | ErrorKind::Config) => 2,
        Some(ErrorKind::Unavailable | ErrorKind::Conflict) => 3,
        Some(ErrorKind::Internal) => 4,
        None => 2,
    }
}

/// `err` and its causes, joined by `: `, leaving out a cause whose text the message
/// already holds (the crates' errors quote the error they wrap and keep it as their source,
/// so `{:#}` printed it twice or more).
fn error_text(err: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        let part = cause.to_string();
        if text.contains(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    text
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SIGNALWEAVE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::from(4);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        // The reader of our output went away (`sql … | head`): nothing to say to it.
        Err(err)
            if err.chain().any(|e| {
                e.downcast_ref::<output::OutputError>()
                    .is_some_and(output::OutputError::closed)
            }) =>
        {
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("error: {}", error_text(&err));
            ExitCode::from(exit_code(&err))
        }
    }
}
