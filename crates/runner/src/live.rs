//! The live job: tail `signalweave.events` by snapshot, feed the window engine, and once
//! per checkpoint interval commit the epoch's outputs and late records.
//!
//! # The checkpoint protocol
//!
//! Epoch `e` ends with:
//! 1. the checkpoint blob of `e` (source position, engine state, the epoch's late records)
//!    is written and recorded as *prepared*;
//! 2. the sink commits the outputs to the job's output table and then the late records to
//!    `late_events`, each an append whose snapshot summary carries the job, the namespace
//!    and the epoch (commit identity `(sink writer, e)`);
//! 3. the checkpoint pointer moves from `e - 1` to `e` by compare-and-set; the job holds its
//!    source position against expiry.
//!
//! The first sink commit is the commit point. On start the job reads the pointer; if a
//! prepared checkpoint after it has a sink commit, the job finishes that checkpoint's sink
//! commit (commits that exist are recognised by their identity and skipped) and then rolls
//! the pointer forward to it. It then restores the pointer's checkpoint, whose sink commit
//! is whole, and commits nothing of it again. A crash
//! before the first sink commit of `e` loses nothing: the job restarts from `e - 1` and
//! reads the same snapshots again. Output versions that no commit made visible may be
//! emitted again with other values; versions that were committed never are.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use signalweave_lake::{COMMIT_IDENTITY_TTL_MS, CommitIdentity, Lake, LakeTable, LeaseFence};
use signalweave_model::ErrorKind;
use signalweave_window::{Emissions, EngineConfig, JobSpec, WindowEngine};

use crate::checkpoint::{Checkpoint, CheckpointStore};
use crate::erased::ErasedWindows;
use crate::error::{Result, RunnerError};
use crate::freshness::{Freshness, STAGES};
use crate::late::{self, LateEvent};
use crate::metrics::{JobStatus, Labels, RunnerMetrics, SharedStatus};

/// Snapshot summary key: the job of a sink commit.
pub const SUMMARY_JOB: &str = "signalweave.job";
/// Snapshot summary key: the namespace of a sink commit.
pub const SUMMARY_NAMESPACE: &str = "signalweave.namespace";
/// Snapshot summary key: the checkpoint epoch of a sink commit.
pub const SUMMARY_EPOCH: &str = "signalweave.checkpoint-epoch";

/// Where a fault drill stops the process (tests): `std::process::abort()`, which like
/// kill -9 runs no destructor and flushes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultStage {
    /// Before the checkpoint blob is written.
    BeforeCheckpoint,
    /// After the blob is recorded, before the sink commit.
    AfterCheckpoint,
    /// With the output data files written, before their commit.
    MidCommit,
    /// After the outputs' commit, before the late records'.
    AfterOutputCommit,
    /// After the sink commits, before the checkpoint pointer moves.
    AfterSinkCommit,
}

/// A fault drill: stop at `stage` of epoch `epoch` (`<stage>@<epoch>`, for example
/// `after_sink_commit@3`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultPoint {
    /// Where.
    pub stage: FaultStage,
    /// In which epoch.
    pub epoch: u64,
}

impl FromStr for FaultPoint {
    type Err = RunnerError;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            RunnerError::new(
                ErrorKind::InvalidInput,
                format!(
                    "fault point `{s}`: expected <stage>@<epoch> with stage before_checkpoint, \
                     after_checkpoint, mid_commit, after_output_commit or after_sink_commit"
                ),
            )
        };
        let (stage, epoch) = s.split_once('@').ok_or_else(bad)?;
        let stage = match stage {
            "before_checkpoint" => FaultStage::BeforeCheckpoint,
            "after_checkpoint" => FaultStage::AfterCheckpoint,
            "mid_commit" => FaultStage::MidCommit,
            "after_output_commit" => FaultStage::AfterOutputCommit,
            "after_sink_commit" => FaultStage::AfterSinkCommit,
            _ => return Err(bad()),
        };
        Ok(Self {
            stage,
            epoch: epoch.parse().map_err(|_| bad())?,
        })
    }
}

/// Options of a live job that are not part of its spec.
#[derive(Debug, Clone)]
pub struct LiveConfig {
    /// Output namespace (`live`).
    pub namespace: String,
    /// Length of an epoch: outputs are committed and state checkpointed this often.
    pub checkpoint_interval: Duration,
    /// How often the source is polled for new snapshots.
    pub poll_interval: Duration,
    /// Most source snapshots read in one step.
    pub max_snapshots_per_step: usize,
    /// Checkpoints kept before the current one.
    pub keep_checkpoints: usize,
    /// Follow one event in this many for freshness.
    pub freshness_sample_every: u64,
    /// Key groups of the engine.
    pub key_groups: u16,
    /// A fault drill (tests only).
    pub fault: Option<FaultPoint>,
    /// Who runs the job: the owner of its lease (see [`LIVE_LEASE_TTL`]). One per process
    /// by default, so a job recovered in the same process keeps its lease.
    pub instance: String,
    /// How often the job's lease is renewed: every second, at least every 100 ms. Well
    /// under [`LIVE_LEASE_COMMIT_WITHIN`] outside tests, or every commit renews in line
    /// (a test holds the renewals off to see what the fence alone refuses).
    pub lease_renew_every: Duration,
    /// How long failures that no retry can mend ([`ErrorKind::retryable`] false: a
    /// corrupt checkpoint, a configuration error) may last, the job recovering from its
    /// checkpoint meanwhile, before [`LiveJob::run`] fails with the last of them. A
    /// retryable failure in between (an outage) starts the count again. (Some outages
    /// surface as such errors: a torn read is invalid input. So they get this long.)
    pub permanent_failure_grace: Duration,
}

/// How long a live job's lease lasts unless renewed (every second while it runs). A second
/// instance of the job waits this long for it, then fails with a conflict; a holder that
/// was a process of this host and is gone (kill -9) gives it up at once.
pub const LIVE_LEASE_TTL: Duration = Duration::from_secs(10);

/// The lease scope of live jobs.
const LIVE_LEASE: &str = "live";

/// This process's owner name for leases of live jobs.
pub fn process_instance() -> String {
    static INSTANCE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        signalweave_lake::lease_owner(&uuid::Uuid::new_v4().simple().to_string()[..12])
    });
    INSTANCE.clone()
}

/// How recent the last renewal the catalog database took must be for the job to commit.
/// Another instance can take the lease [`LIVE_LEASE_TTL`] after that renewal was sent;
/// the rest of the TTL is for the commit itself and for the clocks of two hosts to
/// disagree.
pub const LIVE_LEASE_COMMIT_WITHIN: Duration = Duration::from_secs(5);

/// Renews a live job's lease every second; says when another instance took it, and
/// whether the lease is still surely held (see [`LeaseKeeper::check`]).
struct LeaseKeeper {
    lost: Arc<AtomicBool>,
    /// Set once two renewals the database took were so far apart that the lease may have
    /// run out between them: another instance may have run the job meanwhile, so this
    /// one's state is not to be trusted, whatever later renewals say.
    broken: Arc<AtomicBool>,
    /// When the last renewal the database took was sent.
    renewed: Arc<Mutex<Renewal>>,
    task: tokio::task::JoinHandle<()>,
    lake: Lake,
    job: String,
    namespace: String,
    owner: String,
    /// The tenure this keeper took. The job's writes that another instance's work could
    /// be lost to are fenced by it (a checkpoint's record, the sink's commits, the pointer,
    /// the retirement of checkpoints), so none lands once another instance has taken the
    /// job over, however long this one was paused. (Its snapshot holds are not: a stale
    /// one keeps more, never less.)
    fence: LeaseFence,
}

/// When a renewal was sent: on the monotonic clock, and on the wall clock the lease's
/// expiry is written in (the monotonic clock stands still while the host is suspended).
#[derive(Debug, Clone, Copy)]
struct Renewal {
    at: Instant,
    wall_ms: i64,
}

impl Renewal {
    fn now() -> Self {
        Self {
            at: Instant::now(),
            wall_ms: chrono::Utc::now().timestamp_millis(),
        }
    }

    /// How long after `earlier` this is, by the later of the two clocks.
    fn since(self, earlier: Renewal) -> Duration {
        let wall =
            Duration::from_millis(u64::try_from(self.wall_ms - earlier.wall_ms).unwrap_or(0));
        self.at.saturating_duration_since(earlier.at).max(wall)
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl LeaseKeeper {
    /// Takes the lease of `job` in `namespace` for `owner`, waiting up to
    /// [`LIVE_LEASE_TTL`] (and a second) for another holder's to run out, then renews it.
    async fn take(
        lake: &Lake,
        job: &str,
        namespace: &str,
        owner: &str,
        renew_every: Duration,
    ) -> Result<Self> {
        let deadline = Instant::now() + LIVE_LEASE_TTL + Duration::from_secs(1);
        let mut sent;
        let fence = loop {
            sent = Renewal::now();
            match lake
                .take_lease(LIVE_LEASE, job, namespace, owner, LIVE_LEASE_TTL)
                .await
            {
                Ok(fence) => break fence,
                Err(e) if e.kind() == ErrorKind::Conflict && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(e) if e.kind() == ErrorKind::Conflict => {
                    return Err(RunnerError::new(
                        ErrorKind::Conflict,
                        format!("another instance of the job is running: {}", e.message()),
                    ));
                }
                Err(e) => return Err(e.into()),
            }
        };
        let lost = Arc::new(AtomicBool::new(false));
        let broken = Arc::new(AtomicBool::new(false));
        let renewed = Arc::new(Mutex::new(sent));
        let task = {
            let (lake, job, namespace, owner, generation) = (
                lake.clone(),
                job.to_string(),
                namespace.to_string(),
                owner.to_string(),
                fence.generation,
            );
            let (lost, broken, renewed) =
                (Arc::clone(&lost), Arc::clone(&broken), Arc::clone(&renewed));
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(renew_every.max(Duration::from_millis(100))).await;
                    let sent = Renewal::now();
                    match lake
                        .take_lease(LIVE_LEASE, &job, &namespace, &owner, LIVE_LEASE_TTL)
                        .await
                    {
                        Ok(taken) => {
                            renewed_in(&taken, generation, &broken);
                            record(&renewed, &broken, sent)
                        }
                        Err(e) if e.kind() == ErrorKind::Conflict => {
                            tracing::error!(job, namespace, error = %e, "the live job's lease was taken");
                            lost.store(true, Ordering::SeqCst);
                            return;
                        }
                        // The catalog database is down: the job stalls on it too.
                        Err(e) => {
                            tracing::warn!(job, namespace, error = %e, "renewing the lease failed")
                        }
                    }
                }
            })
        };
        Ok(Self {
            lost,
            broken,
            renewed,
            task,
            lake: lake.clone(),
            job: job.to_string(),
            namespace: namespace.to_string(),
            owner: owner.to_string(),
            fence,
        })
    }

    /// Whether the job may commit now: the lease was not taken, and its last renewal the
    /// database took was sent within [`LIVE_LEASE_COMMIT_WITHIN`], by the monotonic clock
    /// and by the wall clock. A job whose renewals fail (the catalog database unreachable
    /// from it) stops committing before another instance can take the lease, instead of
    /// committing over that instance's work: it stalls (a retryable error) and takes the
    /// lease again to recover.
    fn check(&self) -> Result<()> {
        self.check_at(Renewal::now())
    }

    /// How long ago the last renewal the database took was sent, by the later of the two
    /// clocks.
    fn since_renewal(&self) -> Duration {
        self.since_renewal_at(Renewal::now())
    }

    fn since_renewal_at(&self, now: Renewal) -> Duration {
        // A poisoned lock: the renewal time is unknown, so as old as can be.
        let Ok(renewed) = self.renewed.lock().map(|r| *r) else {
            return Duration::MAX;
        };
        now.since(renewed)
    }

    fn check_at(&self, now: Renewal) -> Result<()> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(RunnerError::new(
                ErrorKind::Conflict,
                "another instance of the job took its lease: this one stops",
            ));
        }
        if self.broken.load(Ordering::SeqCst) {
            return Err(RunnerError::new(
                ErrorKind::Unavailable,
                "the job's lease went unrenewed long enough to run out, and another instance \
                 may have run the job meanwhile: it recovers from its checkpoint",
            ));
        }
        let since = self.since_renewal_at(now);
        if since > LIVE_LEASE_COMMIT_WITHIN {
            return Err(RunnerError::new(
                ErrorKind::Unavailable,
                format!(
                    "the job's lease was last renewed {:.1} s ago (another instance may take it \
                     {} s after): no commit until it is renewed",
                    since.as_secs_f64(),
                    LIVE_LEASE_TTL.as_secs()
                ),
            ));
        }
        Ok(())
    }

    /// [`LeaseKeeper::check`], renewing the lease first when its last renewal is too old
    /// (the renewing task may only have been kept from running by the job's own work), but
    /// only while the lease cannot have run out: after that, another instance may have
    /// taken the job, moved its pointer and gone, and the lease be free again, so this job's
    /// state is not to be trusted: it stalls, and recovers from the pointer.
    async fn ensure(&self) -> Result<()> {
        match self.check() {
            Err(e)
                if e.kind() == ErrorKind::Unavailable
                    && !self.broken.load(Ordering::SeqCst)
                    && self.since_renewal() < LIVE_LEASE_CONTINUITY =>
            {
                let sent = Renewal::now();
                match self
                    .lake
                    .take_lease(
                        LIVE_LEASE,
                        &self.job,
                        &self.namespace,
                        &self.owner,
                        LIVE_LEASE_TTL,
                    )
                    .await
                {
                    Ok(taken) => {
                        renewed_in(&taken, self.fence.generation, &self.broken);
                        record(&self.renewed, &self.broken, sent)
                    }
                    Err(r) if r.kind() == ErrorKind::Conflict => {
                        self.lost.store(true, Ordering::SeqCst);
                    }
                    Err(r) => {
                        return Err(RunnerError::new(
                            ErrorKind::Unavailable,
                            format!("{}; renewing it failed: {}", e, r.message()),
                        ));
                    }
                }
                self.check()
            }
            other => other,
        }
    }

    /// [`LeaseKeeper::check`] as a guard of the lake's appends (see [`Lake::append_guarded`]).
    fn guard(&self) -> signalweave_lake::Result<()> {
        self.check()
            .map_err(|e| signalweave_lake::LakeError::new(e.kind(), e.message()))
    }
}

/// How long after a renewal the lease is surely still held: a later renewal taken only
/// after this may follow another instance's tenure.
const LIVE_LEASE_CONTINUITY: Duration = Duration::from_millis(
    LIVE_LEASE_TTL.as_millis() as u64 - LIVE_LEASE_COMMIT_WITHIN.as_millis() as u64 / 2,
);

/// Marks the keeper `broken` when a renewal took the lease in another tenure than the
/// keeper's `generation`: another instance held it in between, so this one's state is not
/// to be trusted (and its fence refuses its writes).
fn renewed_in(taken: &LeaseFence, generation: i64, broken: &AtomicBool) {
    if taken.generation != generation {
        tracing::warn!(job = %taken.job, namespace = %taken.namespace, generation, now = taken.generation, "the live job's lease was held by another instance in between");
        broken.store(true, Ordering::SeqCst);
    }
}

/// Records a renewal sent at `sent` that the database took (never moving it back); marks
/// the keeper `broken` when it came too long after the one before (see
/// [`LIVE_LEASE_CONTINUITY`]).
fn record(renewed: &Mutex<Renewal>, broken: &AtomicBool, sent: Renewal) {
    let Ok(mut r) = renewed.lock() else {
        broken.store(true, Ordering::SeqCst);
        return;
    };
    if sent.at <= r.at {
        return;
    }
    if sent.since(*r) > LIVE_LEASE_CONTINUITY {
        broken.store(true, Ordering::SeqCst);
    }
    *r = sent;
}

impl Default for LiveConfig {
    fn default() -> Self {
        Self {
            namespace: "live".into(),
            checkpoint_interval: Duration::from_secs(1),
            poll_interval: Duration::from_millis(100),
            max_snapshots_per_step: 32,
            keep_checkpoints: 3,
            freshness_sample_every: 8,
            key_groups: signalweave_window::DEFAULT_KEY_GROUPS,
            fault: None,
            permanent_failure_grace: Duration::from_secs(60),
            lease_renew_every: Duration::from_secs(1),
            instance: process_instance(),
        }
    }
}

/// What one step did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Source snapshots read.
    pub snapshots: usize,
    /// Records read.
    pub records: u64,
    /// Output rows emitted (committed at the next checkpoint).
    pub emitted: usize,
    /// True when the step ended with a checkpoint.
    pub checkpointed: bool,
}

/// The output table of `spec` in `namespace`: `<output.table>` for `live`,
/// `<output.table>__<namespace>` otherwise.
pub fn output_table(spec: &JobSpec, namespace: &str) -> Result<LakeTable> {
    let name = if namespace == "live" {
        spec.output.table.clone()
    } else {
        format!("{}__{namespace}", spec.output.table)
    };
    let name = name
        .strip_prefix("signalweave.")
        .unwrap_or(&name)
        .to_string();
    Ok(LakeTable::output(
        &name,
        &signalweave_window::output_schema(spec),
    )?)
}

/// The output table of a backfill of `spec` in `namespace`: `<output.table>__bf_<namespace>`.
pub fn backfill_output_table(spec: &JobSpec, namespace: &str) -> Result<LakeTable> {
    let name = spec.output.table.clone();
    let name = name.strip_prefix("signalweave.").unwrap_or(&name);
    Ok(LakeTable::output(
        &format!("{name}__bf_{namespace}"),
        &signalweave_window::output_schema(spec),
    )?)
}

fn now_us() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

/// A live job: recovered from its checkpoint and ready to step.
pub struct LiveJob {
    lake: Lake,
    spec: Arc<JobSpec>,
    config: LiveConfig,
    engine: WindowEngine,
    store: CheckpointStore,
    output: LakeTable,
    /// Last processed source snapshot.
    position: Option<i64>,
    /// Last committed epoch.
    epoch: u64,
    /// The position of the last checkpoint.
    checkpointed_position: Option<i64>,
    pending_outputs: Emissions,
    /// The source snapshot each pending output reflects.
    pending_snapshots: Vec<Option<i64>>,
    pending_late: Vec<LateEvent>,
    last_checkpoint: Instant,
    last_probe: Instant,
    max_event_time: i64,
    /// How long the oldest commit read by the last step that read had waited when it was
    /// read, µs, and when (reported for a second).
    waited_us: i64,
    waited_at: Instant,
    freshness: Freshness,
    metrics: Arc<RunnerMetrics>,
    status: SharedStatus,
    labels: Labels,
    lease: LeaseKeeper,
    /// Erasures whose windows the sink leaves out (a job keyed by customer).
    erased: Option<ErasedWindows>,
    /// Output rows the last sink commit wrote (less those of erased windows).
    committed_outputs: u64,
}

impl std::fmt::Debug for LiveJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveJob")
            .field("job", &self.spec.name)
            .field("namespace", &self.config.namespace)
            .field("epoch", &self.epoch)
            .field("position", &self.position)
            .finish()
    }
}

impl LiveJob {
    /// Recovers the job from its last checkpoint (rolling forward to a prepared one whose
    /// sink commit exists, after finishing that commit), and returns it ready to continue
    /// from its source position.
    pub async fn recover(
        lake: Lake,
        spec: Arc<JobSpec>,
        config: LiveConfig,
        metrics: Arc<RunnerMetrics>,
    ) -> Result<Self> {
        let namespace = config.namespace.clone();
        let output = output_table(&spec, &namespace)?;
        lake.ensure_output_table(output).await?;
        let store = CheckpointStore::open(lake.clone(), &spec.name, &namespace).await?;
        // One instance at a time: taken before anything is read or committed.
        let lease = LeaseKeeper::take(
            &lake,
            &spec.name,
            &namespace,
            &config.instance,
            config.lease_renew_every,
        )
        .await?;
        let labels: Labels = vec![
            ("job".into(), spec.name.clone()),
            ("namespace".into(), namespace.clone()),
        ];
        let status = Arc::new(Mutex::new(JobStatus {
            job: spec.name.clone(),
            namespace: namespace.clone(),
            state: "starting".into(),
            ..Default::default()
        }));
        let engine_config = EngineConfig {
            namespace: namespace.clone(),
            key_groups: config.key_groups,
            watermark_column: None,
            dedup_only_column: None,
        };
        let erased = ErasedWindows::new(&spec);
        let mut job = Self {
            engine: WindowEngine::new(Arc::clone(&spec), engine_config.clone())?,
            freshness: Freshness::new(config.freshness_sample_every),
            lake,
            spec,
            config,
            store,
            output,
            position: None,
            epoch: 0,
            checkpointed_position: None,
            pending_outputs: Emissions::default(),
            pending_snapshots: Vec::new(),
            pending_late: Vec::new(),
            last_checkpoint: Instant::now(),
            last_probe: Instant::now(),
            max_event_time: i64::MIN,
            waited_us: 0,
            waited_at: Instant::now(),
            metrics,
            status,
            labels,
            lease,
            erased,
            committed_outputs: 0,
        };
        let mut pointer = job.store.pointer().await?;
        // Roll forward: a prepared checkpoint after the pointer whose sink commit exists
        // is the real current one (the crash came before the pointer moved). The pointer
        // moves there once the rest of that sink commit is done (below).
        let mut rolled_from = None;
        for prepared in job.store.list().await? {
            if prepared.epoch <= pointer.unwrap_or(0) {
                break;
            }
            if job.sink_committed(prepared.epoch).await? {
                tracing::info!(job = %job.spec.name, epoch = prepared.epoch, "rolling the checkpoint pointer forward to a committed epoch");
                rolled_from = Some(pointer);
                pointer = Some(prepared.epoch);
                break;
            }
        }
        if let Some(epoch) = pointer {
            let loading = Instant::now();
            let (r, checkpoint) = job.store.load(epoch).await?;
            let loaded_ms = loading.elapsed().as_millis();
            if checkpoint.job_version != job.spec.version {
                return Err(RunnerError::new(
                    ErrorKind::Config,
                    format!(
                        "{} version {} cannot continue from a checkpoint of version {}: run the new \
                         version as a backfill into its own namespace",
                        job.spec.name, job.spec.version, checkpoint.job_version
                    ),
                ));
            }
            job.engine = WindowEngine::restore(
                Arc::clone(&job.spec),
                engine_config,
                &checkpoint.engine_state,
            )?;
            tracing::info!(
                job = %job.spec.name,
                epoch,
                bytes = r.bytes,
                load_ms = loaded_ms,
                restore_ms = loading.elapsed().as_millis() - loaded_ms,
                "checkpoint restored"
            );
            job.position = checkpoint.position;
            job.checkpointed_position = checkpoint.position;
            job.epoch = epoch;
            // The pointer moves only once its epoch's sink commit is whole (an earlier
            // version moved it first, then finished the commit: a crash between the two
            // left it half done). A commit's identity is recognised for
            // COMMIT_IDENTITY_TTL_MS after the commit, so within that (less a day) the sink
            // commit is finished again, harmlessly; past it, nothing of it is committed
            // again (late rows would land twice). After a crash between the sink's first
            // commit and the pointer, the rest of the sink commit is done, then the pointer
            // moves.
            let holder = job.store.holder();
            let age_ms = chrono::Utc::now().timestamp_millis() - r.created_ms;
            let recognised = age_ms < COMMIT_IDENTITY_TTL_MS - 24 * 3600 * 1000;
            let mut out_snapshot = None;
            if rolled_from.is_some() || recognised {
                out_snapshot = job.commit_sink(&checkpoint, false).await?;
            }
            if let Some(from) = rolled_from {
                job.store
                    .advance(from, epoch, Some(&job.lease.fence))
                    .await?;
            }
            job.expire_erasures();
            job.hold(out_snapshot).await?;
            // A hold on `late_events` moved only with an epoch's late rows, and a hold keeps
            // every later snapshot: one job's kept every later commit of every job there.
            job.lake
                .release_snapshot(LakeTable::LateEvents, &holder)
                .await?;
            job.metrics
                .checkpoint_bytes
                .get_or_create(&job.labels)
                .set(r.bytes as i64);
            // The status says where the job is from the start, not from its next
            // checkpoint.
            let size = job.engine.state_size();
            if let Ok(mut s) = job.status.lock() {
                s.epoch = epoch;
                s.position = job.position;
                s.checkpoint_bytes = r.bytes;
                s.state_keys = size.keys as u64;
                s.state_bytes = (size.window_state_bytes + size.dedup_bytes) as u64;
            }
        }
        let retired = job
            .store
            .retire(
                job.epoch,
                job.config.keep_checkpoints,
                Some(&job.lease.fence),
            )
            .await?;
        if retired > 0 {
            tracing::debug!(job = %job.spec.name, retired, "retired checkpoints");
        }
        job.set_state("running", None);
        tracing::info!(job = %job.spec.name, namespace = %job.config.namespace, epoch = job.epoch, position = ?job.position, "live job recovered");
        Ok(job)
    }

    /// The job's status, shared.
    pub fn status(&self) -> SharedStatus {
        Arc::clone(&self.status)
    }

    /// The job's output table.
    pub fn output(&self) -> LakeTable {
        self.output
    }

    /// Last committed epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Last processed source snapshot.
    pub fn position(&self) -> Option<i64> {
        self.position
    }

    /// Freshness so far: quantile `q` of stage `stage` (see [`STAGES`]), seconds.
    pub fn freshness_quantile(&self, stage: usize, q: f64) -> f64 {
        self.freshness.quantile(stage, q)
    }

    /// Freshness samples that became visible.
    pub fn freshness_samples(&self) -> u64 {
        self.freshness.samples()
    }

    fn sink_writer(&self) -> String {
        format!("job:{}:{}", self.spec.name, self.config.namespace)
    }

    fn late_writer(&self) -> String {
        format!("job-late:{}:{}", self.spec.name, self.config.namespace)
    }

    async fn sink_committed(&self, epoch: u64) -> Result<bool> {
        let out = self.lake.table(self.output).await?;
        let sink = CommitIdentity::new(self.sink_writer(), epoch);
        if self
            .lake
            .committed(self.output, &out, &sink)
            .await?
            .is_some()
        {
            return Ok(true);
        }
        let late = self.lake.table(LakeTable::LateEvents).await?;
        let identity = CommitIdentity::new(self.late_writer(), epoch);
        Ok(self
            .lake
            .committed(LakeTable::LateEvents, &late, &identity)
            .await?
            .is_some())
    }

    fn set_state(&self, state: &str, error: Option<String>) {
        if let Ok(mut s) = self.status.lock() {
            s.state = state.to_string();
            s.last_error = error;
        }
        self.metrics
            .stalled
            .get_or_create(&self.labels)
            .set(i64::from(state == "stalled"));
        self.metrics
            .failed
            .get_or_create(&self.labels)
            .set(i64::from(state == "failed"));
    }

    fn fault(&self, stage: FaultStage, epoch: u64) {
        if self.config.fault == Some(FaultPoint { stage, epoch }) {
            eprintln!("fault drill: stopping at {stage:?} of epoch {epoch}");
            std::process::abort();
        }
    }

    fn labels_with(&self, name: &str, value: &str) -> Labels {
        let mut l = self.labels.clone();
        l.push((name.to_string(), value.to_string()));
        l
    }

    /// One step: read the snapshots appended since the position (at most
    /// `max_snapshots_per_step`), process them, fire triggers, and checkpoint when the
    /// interval has passed (or `force_checkpoint`).
    pub async fn step(&mut self, force_checkpoint: bool) -> Result<StepReport> {
        let step_started = Instant::now();
        let mut report = StepReport::default();
        let plan = self.plan_step().await?;
        if plan.upto != self.position {
            let read_at = now_us();
            self.waited_us = plan.commit_ms.first().map_or(0, |ms| read_at - ms * 1000);
            self.waited_at = Instant::now();
            let committed_at = plan.commit_ms.last().copied().unwrap_or_default() * 1000;
            let key_columns = self.spec.key.columns.clone();
            let (mut counted, mut filtered, mut dups, mut late_n) = (0u64, 0u64, 0u64, 0u64);
            report.snapshots = plan.snapshots.len();
            let upto = plan.upto;
            // Commit by commit: the watermark advances (and triggers fire) between two
            // commits of one step, so a record is judged by the watermark of the commits
            // before it however many commits a step reads (as a backfill and the
            // reconciliation oracle judge it).
            let runs = plan.by_snapshot();
            let last = runs.len();
            for (i, (snapshot, tasks)) in runs.into_iter().enumerate() {
                let mut stream = self.lake.read(LakeTable::Events, tasks).await?;
                while let Some(batch) = stream.try_next().await.map_err(|e| {
                    RunnerError::new(ErrorKind::Unavailable, format!("read events: {e}"))
                })? {
                    let now = now_us();
                    report.records += batch.num_rows() as u64;
                    self.freshness
                        .observe(&batch, &key_columns, committed_at, read_at);
                    if let Some(col) = batch.column_by_name(&self.spec.time.event_time_column)
                        && let Some(ts) = arrow::array::AsArray::as_primitive_opt::<
                            arrow::datatypes::TimestampMicrosecondType,
                        >(col.as_ref())
                        && let Some(max) = arrow::compute::max(ts)
                    {
                        self.max_event_time = self.max_event_time.max(max);
                    }
                    let outcome = self.engine.process_batch(&batch, "events", now)?;
                    counted += outcome.counted;
                    filtered += outcome.filtered;
                    dups += outcome.duplicates;
                    late_n += outcome.late.len() as u64;
                    if !outcome.late.is_empty() {
                        self.pending_late.extend(late::extract(
                            &batch,
                            &outcome.late,
                            &key_columns,
                            now,
                        )?);
                    }
                }
                if i + 1 < last {
                    let now = now_us();
                    let mut rows = self.engine.fire(now);
                    self.freshness.emitted(&rows, now);
                    report.emitted += rows.len();
                    self.pending_snapshots
                        .extend(std::iter::repeat_n(Some(snapshot), rows.len()));
                    self.pending_outputs.append(&mut rows);
                    self.engine.recycle(rows);
                }
            }
            for (outcome, n) in [
                ("counted", counted),
                ("filtered", filtered),
                ("duplicate", dups),
                ("late", late_n),
            ] {
                self.metrics
                    .records
                    .get_or_create(&self.labels_with("outcome", outcome))
                    .inc_by(n);
            }
            if let Ok(mut s) = self.status.lock() {
                s.records += report.records;
                s.counted += counted;
                s.duplicates += dups;
                s.late += late_n;
            }
            self.position = upto;
        }
        let now = now_us();
        let fire_started = Instant::now();
        let mut rows = self.engine.fire(now);
        let fire_ms = fire_started.elapsed().as_millis();
        self.freshness.emitted(&rows, now);
        report.emitted += rows.len();
        if report.records > 0 || !rows.is_empty() {
            tracing::debug!(
                job = %self.spec.name,
                snapshots = report.snapshots,
                records = report.records,
                read_and_process_ms = step_started.elapsed().as_millis() - fire_ms,
                fire_ms,
                emitted = rows.len(),
                "step"
            );
        }
        self.pending_snapshots
            .extend(std::iter::repeat_n(self.position, rows.len()));
        self.pending_outputs.append(&mut rows);
        self.engine.recycle(rows);
        let due =
            force_checkpoint || self.last_checkpoint.elapsed() >= self.config.checkpoint_interval;
        // An idle job has nothing to commit: the last checkpoint still describes it (a
        // restart from it recomputes only processing-time state, which emitted nothing).
        let changed = self.uncheckpointed();
        if due && changed {
            self.checkpoint().await?;
            report.checkpointed = true;
        } else if report.snapshots == 0
            && self.last_probe.elapsed()
                >= self.config.checkpoint_interval.max(Duration::from_secs(1))
        {
            // Idle: nothing touches the object store, so ask it, and stall visibly when
            // it does not answer.
            self.last_probe = Instant::now();
            self.lake.probe_store().await?;
        }
        self.observe_lag().await;
        Ok(report)
    }

    /// True when the job holds work its last checkpoint does not: records read since, or
    /// outputs and late records not yet committed.
    fn uncheckpointed(&self) -> bool {
        self.position != self.checkpointed_position
            || !self.pending_outputs.is_empty()
            || !self.pending_late.is_empty()
    }

    /// Steps until a step reads nothing new, then checkpoints (so everything read is
    /// committed). Returns the records read.
    pub async fn catch_up(&mut self) -> Result<u64> {
        let mut records = 0;
        loop {
            let r = self.step(false).await?;
            records += r.records;
            if r.snapshots == 0 {
                self.step(true).await?;
                return Ok(records);
            }
        }
    }

    /// Ends the epoch: checkpoint, sink commit, pointer (see the module documentation).
    pub async fn checkpoint(&mut self) -> Result<()> {
        let started = Instant::now();
        let epoch = self.epoch + 1;
        self.fault(FaultStage::BeforeCheckpoint, epoch);
        // Nothing is written, not even the blob (a write replaces an epoch's blob), unless
        // the lease is surely held and the pointer is where this job left it.
        self.lease.ensure().await?;
        if let Some(pointer) = self.store.pointer().await?
            && pointer >= epoch
        {
            return Err(RunnerError::new(
                ErrorKind::Conflict,
                format!(
                    "another instance of the job moved its checkpoint pointer to epoch {pointer}, \
                     past this one's {}: this one stops",
                    self.epoch
                ),
            ));
        }
        let checkpoint = Checkpoint {
            job: self.spec.name.clone(),
            namespace: self.config.namespace.clone(),
            job_version: self.spec.version,
            epoch,
            position: self.position,
            engine_state: {
                let t = Instant::now();
                let state = self.engine.snapshot()?;
                tracing::debug!(job = %self.spec.name, epoch, bytes = state.len(), ms = t.elapsed().as_millis(), "engine state snapshot");
                state
            },
            outputs: std::mem::take(&mut self.pending_outputs),
            output_snapshots: std::mem::take(&mut self.pending_snapshots),
            late: std::mem::take(&mut self.pending_late),
            created_ms: chrono::Utc::now().timestamp_millis(),
        };
        let encoded_at = Instant::now();
        let written = self
            .store
            .write(&checkpoint, Some(&self.lease.fence))
            .await?;
        tracing::debug!(job = %self.spec.name, epoch, bytes = written.bytes, snapshot_and_write_ms = (encoded_at - started).as_millis() + encoded_at.elapsed().as_millis(), "checkpoint written");
        self.fault(FaultStage::AfterCheckpoint, epoch);
        // The sink commit is the commit point: never after another instance took over.
        self.lease.ensure().await?;
        let sink_started = Instant::now();
        let out_snapshot = self.commit_sink(&checkpoint, true).await?;
        self.expire_erasures();
        if !checkpoint.outputs.is_empty() || !checkpoint.late.is_empty() {
            let secs = sink_started.elapsed().as_secs_f64();
            self.metrics
                .sink_commit_seconds
                .get_or_create(&self.labels)
                .observe(secs);
            if let Ok(mut s) = self.status.lock() {
                s.sink_commit_s = secs;
            }
        }
        let visible_at = now_us();
        self.fault(FaultStage::AfterSinkCommit, epoch);
        self.store
            .advance(
                Some(self.epoch).filter(|e| *e > 0),
                epoch,
                Some(&self.lease.fence),
            )
            .await?;
        self.epoch = epoch;
        self.checkpointed_position = self.position;
        self.last_checkpoint = Instant::now();
        self.hold(out_snapshot).await?;
        for stages in self.freshness.visible(visible_at) {
            for (stage, secs) in STAGES.iter().zip(stages) {
                self.metrics
                    .freshness_seconds
                    .get_or_create(&self.labels_with("stage", stage))
                    .observe(secs);
            }
        }
        if let Err(e) = self
            .store
            .retire(epoch, self.config.keep_checkpoints, Some(&self.lease.fence))
            .await
        {
            tracing::warn!(job = %self.spec.name, error = %e, "could not retire old checkpoints");
        }
        self.metrics
            .checkpoint_seconds
            .get_or_create(&self.labels)
            .observe(started.elapsed().as_secs_f64());
        self.metrics.checkpoints.get_or_create(&self.labels).inc();
        self.metrics
            .checkpoint_bytes
            .get_or_create(&self.labels)
            .set(written.bytes as i64);
        self.metrics
            .outputs
            .get_or_create(&self.labels)
            .inc_by(self.committed_outputs);
        let size = self.engine.state_size();
        if let Ok(mut s) = self.status.lock() {
            s.epoch = epoch;
            s.position = self.position;
            s.checkpoint_bytes = written.bytes;
            s.outputs += self.committed_outputs;
            s.state_keys = size.keys as u64;
            s.state_bytes = (size.window_state_bytes + size.dedup_bytes) as u64;
            s.freshness_s = [
                self.freshness.quantile(5, 0.5),
                self.freshness.quantile(5, 0.99),
                self.freshness.quantile(5, 0.999),
            ];
            s.freshness_samples = self.freshness.samples();
        }
        self.metrics
            .state_keys
            .get_or_create(&self.labels)
            .set(size.keys as i64);
        self.metrics
            .state_bytes
            .get_or_create(&self.labels)
            .set((size.window_state_bytes + size.dedup_bytes) as i64);
        // Committed: the outputs' columns go back to the engine to be filled again.
        self.engine.recycle(checkpoint.outputs);
        Ok(())
    }

    /// Commits a checkpoint's outputs, then its late records; returns the outputs'
    /// snapshot. With `fresh` false (replay after a restart) every commit that exists is
    /// skipped.
    async fn commit_sink(&mut self, checkpoint: &Checkpoint, fresh: bool) -> Result<Option<i64>> {
        if let Some(erased) = self.erased.as_mut() {
            erased.read_new(&self.lake).await?;
        }
        let summary: HashMap<String, String> = [
            (SUMMARY_JOB, self.spec.name.clone()),
            (SUMMARY_NAMESPACE, self.config.namespace.clone()),
            (SUMMARY_EPOCH, checkpoint.epoch.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        self.committed_outputs = 0;
        let mut out_snapshot = None;
        let batch = if checkpoint.outputs.is_empty() {
            None
        } else {
            let batch = checkpoint.outputs.to_batch(
                &self.spec,
                &self.config.namespace,
                &checkpoint.output_snapshots,
            )?;
            let batch = arrow::array::RecordBatch::try_new(
                self.output.arrow_schema(),
                batch.columns().to_vec(),
            )
            .map_err(|e| RunnerError::new(ErrorKind::Internal, format!("output batch: {e}")))?;
            // None when every row was an erased window's: nothing to commit.
            match self.erased.as_mut() {
                Some(erased) => erased.outputs(batch)?,
                None => Some(batch),
            }
        };
        // The events followed into rows left out never become visible.
        if let Some(erased) = self.erased.as_mut() {
            self.freshness
                .drop_emitted(|key, start, end| erased.leaves_out(key, start, end));
        }
        if let Some(batch) = batch {
            let identity = CommitIdentity::new(self.sink_writer(), checkpoint.epoch);
            if fresh
                && self.config.fault
                    == Some(FaultPoint {
                        stage: FaultStage::MidCommit,
                        epoch: checkpoint.epoch,
                    })
            {
                let mut writer = self.lake.append_writer(self.output, &identity).await?;
                writer.write(&batch).await?;
                let _files = writer.finish().await?;
                self.fault(FaultStage::MidCommit, checkpoint.epoch);
            }
            self.committed_outputs = batch.num_rows() as u64;
            self.lease.ensure().await?;
            let lease = &self.lease;
            let outcome = self
                .lake
                .append_guarded(
                    self.output,
                    &[batch],
                    &identity,
                    summary.clone(),
                    &|| lease.guard(),
                    Some(&lease.fence),
                )
                .await?;
            out_snapshot = Some(outcome.snapshot_id);
        }
        if fresh {
            self.fault(FaultStage::AfterOutputCommit, checkpoint.epoch);
        }
        self.commit_late(checkpoint, summary).await?;
        Ok(out_snapshot)
    }

    /// After a sink commit: the erasures whose windows have all settled are forgotten.
    fn expire_erasures(&mut self) {
        let watermark = self.engine.watermark();
        if let Some(erased) = self.erased.as_mut() {
            erased.expire(watermark);
        }
    }

    /// Commits a checkpoint's late records, less those of erased windows.
    async fn commit_late(
        &mut self,
        checkpoint: &Checkpoint,
        summary: HashMap<String, String>,
    ) -> Result<()> {
        let late = match self.erased.as_mut() {
            Some(erased) => {
                // Read again: an erasure rewrites late rows first, right after its record.
                erased.read_new(&self.lake).await?;
                erased.late(&checkpoint.late)
            }
            None => std::borrow::Cow::Borrowed(&checkpoint.late[..]),
        };
        if late.is_empty() {
            return Ok(());
        }
        let batch = late::to_batch(&self.spec.name, &self.config.namespace, &late)?;
        let identity = CommitIdentity::new(self.late_writer(), checkpoint.epoch);
        // Checked again before each commit (the one before may have taken a while), and
        // by the append before each of its attempts' commits.
        self.lease.ensure().await?;
        let lease = &self.lease;
        self.lake
            .append_guarded(
                LakeTable::LateEvents,
                &[batch],
                &identity,
                summary,
                &|| lease.guard(),
                Some(&lease.fence),
            )
            .await?;
        Ok(())
    }

    /// The next step's read. A job's first read plans at a retained snapshot, which
    /// nothing holds yet, and expiry (the gateway's maintenance, say) may remove it while
    /// the table is read: the position would then name a snapshot that is gone, and every
    /// later step fail. So that snapshot is held before it is read, and the read planned
    /// again if it went before the hold took.
    async fn plan_step(&self) -> Result<signalweave_lake::IncrementalPlan> {
        let mut attempts = 0;
        loop {
            attempts += 1;
            let plan = self
                .lake
                .plan_appended_bounded(
                    LakeTable::Events,
                    self.position,
                    self.config.max_snapshots_per_step,
                )
                .await?;
            let (None, Some(upto)) = (self.position, plan.upto) else {
                return Ok(plan);
            };
            match self
                .lake
                .hold_present_snapshot(LakeTable::Events, &self.store.holder(), upto)
                .await
            {
                Ok(()) => return Ok(plan),
                Err(e) if e.kind() == ErrorKind::Conflict && attempts < 5 => {
                    tracing::info!(job = %self.spec.name, snapshot = upto, "the first snapshot to read expired before it was held; planning again");
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Holds the source position against expiry, and the epoch's output commit: a restart
    /// reads on from the one, and after a crash before the pointer moved, recognises the
    /// other (the hold keeps it, and every later commit of the job's own output table).
    /// Nothing of `late_events` is held: the table is shared, and a hold moves only with
    /// a commit.
    async fn hold(&self, out_snapshot: Option<i64>) -> Result<()> {
        let holder = self.store.holder();
        if let Some(p) = self.position {
            self.lake
                .hold_snapshot(LakeTable::Events, &holder, p)
                .await?;
        }
        if let Some(s) = out_snapshot {
            self.lake.hold_snapshot(self.output, &holder, s).await?;
        }
        Ok(())
    }

    async fn observe_lag(&self) {
        let now = now_us();
        let backlog = self.lake.backlog(LakeTable::Events, self.position).await;
        let watermark = self.engine.watermark();
        let secs = |us: i64| (us as f64 / 1e6).max(0.0);
        let event_time_age = if self.max_event_time == i64::MIN {
            0.0
        } else {
            secs(now - self.max_event_time)
        };
        let wm_delay = if watermark == i64::MIN {
            0.0
        } else {
            secs(now - watermark)
        };
        // How long processed work has waited for a checkpoint (0 when there is none).
        let changed = self.uncheckpointed();
        let checkpoint_age = if changed {
            self.last_checkpoint.elapsed().as_secs_f64()
        } else {
            0.0
        };
        let m = &self.metrics;
        m.event_time_age_seconds
            .get_or_create(&self.labels)
            .set(event_time_age);
        m.checkpoint_age_seconds
            .get_or_create(&self.labels)
            .set(checkpoint_age);
        let bound = self.spec.time.max_out_of_orderness.as_micros() as i64;
        for (input, p) in self.engine.watermarks().inputs() {
            if !p.idle {
                m.watermark_delay_seconds
                    .get_or_create(&self.labels_with("input", input))
                    .set(secs(now - (p.max_event_time - bound)));
            }
        }
        let Ok(mut s) = self.status.lock() else {
            return;
        };
        s.watermark_us = (watermark != i64::MIN).then_some(watermark);
        s.event_time_age_s = event_time_age;
        s.watermark_delay_s = wm_delay;
        s.checkpoint_age_s = checkpoint_age;
        if let Ok(b) = backlog {
            m.lag_snapshots
                .get_or_create(&self.labels)
                .set(b.snapshots as i64);
            m.lag_files.get_or_create(&self.labels).set(b.files as i64);
            m.lag_records
                .get_or_create(&self.labels)
                .set(b.records as i64);
            m.lag_bytes.get_or_create(&self.labels).set(b.bytes as i64);
            // The queue age: the oldest commit still waiting, or, when the step caught
            // up, how long the oldest commit it read had waited (a gauge sampled only
            // after reading would never show a wait).
            let oldest = b
                .oldest_commit_ms
                .map(|ms| secs(now - ms * 1000))
                .unwrap_or(0.0)
                .max(if self.waited_at.elapsed() < Duration::from_secs(1) {
                    secs(self.waited_us)
                } else {
                    0.0
                });
            m.oldest_unprocessed_age_seconds
                .get_or_create(&self.labels)
                .set(oldest);
            s.lag_snapshots = b.snapshots;
            s.lag_files = b.files;
            s.lag_records = b.records;
            s.oldest_unprocessed_age_s = oldest;
        }
    }

    /// Runs until `shutdown` resolves, then commits a last checkpoint. A failed step
    /// (object store or catalog down) stalls the job: it reports the failure in its status
    /// and metrics, then recovers from its last checkpoint with backoff, and resumes.
    pub async fn run(mut self, shutdown: impl std::future::Future<Output = ()>) -> Result<Self> {
        tokio::pin!(shutdown);
        let mut backoff = Duration::from_millis(200);
        // Since when every failure has been one no retry can mend.
        let mut permanent_since: Option<Instant> = None;
        loop {
            let step = self.step(false).await;
            match step {
                Ok(r) => {
                    backoff = Duration::from_millis(200);
                    permanent_since = None;
                    let idle = r.snapshots == 0;
                    if idle {
                        tokio::select! {
                            _ = &mut shutdown => break,
                            _ = tokio::time::sleep(self.config.poll_interval) => {}
                        }
                    } else if futures::FutureExt::now_or_never(&mut shutdown).is_some() {
                        break;
                    }
                }
                Err(e) if self.fatal(&e, &mut permanent_since) => {
                    tracing::error!(job = %self.spec.name, error = %e, "live job failed");
                    self.set_state("failed", Some(e.to_string()));
                    return Err(e);
                }
                Err(e) => {
                    tracing::warn!(job = %self.spec.name, error = %e, "live job stalled; recovering from its last checkpoint");
                    self.metrics.failures.get_or_create(&self.labels).inc();
                    let status = Arc::clone(&self.status);
                    self.set_state("stalled", Some(e.to_string()));
                    loop {
                        tokio::select! {
                            _ = &mut shutdown => return Ok(self),
                            _ = tokio::time::sleep(backoff) => {}
                        }
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                        match Self::recover(
                            self.lake.clone(),
                            Arc::clone(&self.spec),
                            self.config.clone(),
                            Arc::clone(&self.metrics),
                        )
                        .await
                        {
                            Ok(mut job) => {
                                // Keep one status (readers hold it) and the freshness history.
                                if let (Ok(mut old), Ok(new)) = (status.lock(), job.status.lock()) {
                                    old.state = new.state.clone();
                                    old.last_error = None;
                                    old.epoch = new.epoch;
                                }
                                job.status = Arc::clone(&status);
                                job.freshness =
                                    std::mem::replace(&mut self.freshness, Freshness::new(1));
                                job.freshness.reset_in_flight();
                                job.max_event_time = self.max_event_time;
                                self = job;
                                break;
                            }
                            Err(e) if self.fatal(&e, &mut permanent_since) => {
                                tracing::error!(job = %self.spec.name, error = %e, "live job failed: it cannot recover");
                                self.set_state("failed", Some(e.to_string()));
                                return Err(e);
                            }
                            Err(e) => {
                                if let Ok(mut s) = status.lock() {
                                    s.last_error = Some(e.to_string());
                                }
                                tracing::warn!(job = %self.spec.name, error = %e, "recovery failed; retrying");
                            }
                        }
                    }
                }
            }
        }
        // Drain: the last epoch's outputs are committed before the job stops.
        self.step(true).await?;
        self.release_lease().await;
        self.set_state("stopped", None);
        Ok(self)
    }

    /// Whether failure `e` ends [`LiveJob::run`]: another instance runs the job, or every
    /// failure since `permanent_since` (which this updates) has been one no retry can
    /// mend, for [`LiveConfig::permanent_failure_grace`].
    fn fatal(&self, e: &RunnerError, permanent_since: &mut Option<Instant>) -> bool {
        if e.kind() == ErrorKind::Conflict && e.to_string().contains("another instance") {
            return true;
        }
        if e.retryable() {
            *permanent_since = None;
            return false;
        }
        let since = *permanent_since.get_or_insert_with(Instant::now);
        since.elapsed() >= self.config.permanent_failure_grace
    }

    /// Gives the lease up after a clean stop, so the next instance need not wait for it
    /// ([`LiveJob::run`] does when it stops; after [`LiveJob::catch_up`], the caller does).
    pub async fn release_lease(&self) {
        self.lease.task.abort();
        if let Err(e) = self
            .lake
            .release_lease(
                LIVE_LEASE,
                &self.spec.name,
                &self.config.namespace,
                &self.config.instance,
            )
            .await
        {
            tracing::warn!(job = %self.spec.name, error = %e, "could not release the lease");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use signalweave_lake::LakeConfig;

    /// The keeper of a fresh lease, its last renewal set back by `ago`.
    async fn keeper_renewed(lake: &Lake, ago: Duration) -> LeaseKeeper {
        let keeper = LeaseKeeper::take(
            lake,
            "job",
            "live",
            &process_instance(),
            Duration::from_secs(1),
        )
        .await
        .expect("the lease");
        keeper.task.abort();
        let now = Renewal::now();
        *keeper.renewed.lock().expect("renewal") = Renewal {
            at: now.at.checked_sub(ago).expect("an instant that long ago"),
            wall_ms: now.wall_ms - i64::try_from(ago.as_millis()).expect("ms"),
        };
        keeper
    }

    /// A renewal too old to commit on is renewed in line while the lease cannot have run
    /// out; past that, the job may not go on from its state (another instance may have run
    /// it meanwhile) and stalls, whatever a renewal now would say.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stale_lease_is_renewed_in_line_only_while_it_cannot_have_run_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        let lake = Lake::open(LakeConfig::embedded(dir.path()))
            .await
            .expect("open");
        lake.init().await.expect("init");
        let fresh = keeper_renewed(&lake, Duration::from_secs(1)).await;
        fresh.ensure().await.expect("a recent renewal commits");
        let stale = keeper_renewed(&lake, LIVE_LEASE_COMMIT_WITHIN + Duration::from_secs(1)).await;
        assert!(stale.check().is_err());
        stale.ensure().await.expect("renewed in line");
        assert!(stale.since_renewal() < Duration::from_secs(1));
        let expired = keeper_renewed(&lake, LIVE_LEASE_TTL + Duration::from_secs(1)).await;
        let e = expired.ensure().await.expect_err("may have run out");
        assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
        assert!(expired.since_renewal() > LIVE_LEASE_TTL, "not renewed");
        // By the wall clock alone (a suspended host's monotonic clock stood still).
        let suspended = keeper_renewed(&lake, Duration::ZERO).await;
        if let Ok(mut r) = suspended.renewed.lock() {
            r.wall_ms -= 60_000;
        }
        assert!(suspended.check().is_err());
        assert!(suspended.ensure().await.is_err());
    }

    /// Two renewals so far apart that the lease may have run out between them: the later
    /// one does not make the keeper good again (another instance may have run the job).
    #[test]
    fn a_renewal_after_a_gap_the_lease_may_have_run_out_in_breaks_continuity() {
        let renewed = Mutex::new(Renewal::now());
        let broken = AtomicBool::new(false);
        let later = |after: Duration| {
            let r = *renewed.lock().expect("renewal");
            Renewal {
                at: r.at + after,
                wall_ms: r.wall_ms + i64::try_from(after.as_millis()).expect("ms"),
            }
        };
        record(&renewed, &broken, later(Duration::from_secs(1)));
        assert!(!broken.load(Ordering::SeqCst));
        record(
            &renewed,
            &broken,
            later(LIVE_LEASE_CONTINUITY + Duration::from_millis(1)),
        );
        assert!(broken.load(Ordering::SeqCst));
    }
}
