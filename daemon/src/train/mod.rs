//! The training loop: synchronous data parallelism over the ring (a ring of one when there is
//! no cluster). Every worker computes gradients on its slice of each global batch, the ring
//! averages them, and every worker applies the same update, so the replicas stay identical.
//! Each epoch ends with an evaluation on the test split, each worker evaluating its shard, the
//! totals summed over the ring.
//!
//! The loop survives its peers. Its state is one value ([`state::TrainState`]); a step ends as
//! done or abandoned, never as an exit because a peer failed: on a failure the member keeps its
//! process and its state, joins the next generation, and continues from the furthest state any
//! member holds ([`session`]; the protocol is `docs/fault-tolerance.md`). Only the chief touches
//! storage: it restores at start (the state of last resort) and commits.
//!
//! Everything that decides the result is fixed by the configuration: libtorch's generator is
//! seeded before the model is built and re-seeded from (seed, step) before every step, each
//! epoch's data order comes from (seed, epoch), the all-reduce adds in a fixed order, and the
//! learning rate is a function of the global step. The same configuration and thread count give
//! bit-identical parameters, with failures or without.

pub mod session;
pub mod state;
pub mod step;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use sha2::{Digest, Sha256};
use tch::{Device, Tensor};
use trainerd_sdk::{InputContext, LrSchedule, OptimizerConfig, PluginInfo, Split};
use trainerd_storage::{Location, Restored, S3Options};

use crate::checkpoint::{self, Checkpointer, Meta, Position};
use crate::cluster::control::{Formed, FINAL_BARRIER};
use crate::cluster::{ClusterConfig, ClusterError, Network, Timeouts};
use crate::collective::buckets::Buckets;
use crate::collective::{CollectiveError, ReduceOp};
use crate::ops::Telemetry;
use crate::optim::Optimizer;
use crate::plugin::{CallError, Dataset, InputPipeline, ModelInstance, Plugin};
use crate::progress::Progress;
use crate::schedule::lr_at;
use crate::tensorboard::TensorBoard;
use session::{Interrupt, Joined, Session};
use state::TrainState;
use step::Totals;

/// What to train and how.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// Dataset directory, handed to the plugin.
    pub data_dir: PathBuf,
    /// Epochs to run.
    pub epochs: u32,
    /// Per-worker batch size.
    pub batch_size: u32,
    /// Optimizer and hyper-parameters.
    pub optimizer: OptimizerConfig,
    /// Learning-rate schedule.
    pub schedule: LrSchedule,
    /// Seed of the parameters' initialisation and the data order.
    pub seed: u64,
    /// Where the model lives.
    pub device: Device,
    /// Stop each epoch after this many steps (all of them when `None`).
    pub steps_per_epoch: Option<u64>,
    /// libtorch intra-op threads (recorded in the summary; set by the caller).
    pub threads: usize,
    /// The cluster, or `None` for one worker.
    pub cluster: Option<ClusterConfig>,
    /// Where the cluster's listeners bind, and the secret its connections prove.
    pub network: Network,
    /// Every deadline of the cluster.
    pub timeouts: Timeouts,
    /// Gradient bucket size in bytes.
    pub bucket_bytes: usize,
    /// Append one JSON line per step (time, global loss, metrics, learning rate) to this file.
    pub metrics_log: Option<PathBuf>,
    /// Checkpoints, if any.
    pub checkpoint: Option<CheckpointConfig>,
    /// The chief writes TensorBoard event files here: per epoch, and the step loss every
    /// `tensorboard_every` steps (0: per epoch only).
    pub tensorboard_dir: Option<PathBuf>,
    /// See `tensorboard_dir`.
    pub tensorboard_every: u64,
}

impl RunConfig {
    /// What every worker must agree on, as canonical JSON.
    fn agreement_json(&self) -> String {
        serde_json::json!({
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "optimizer": self.optimizer,
            "schedule": self.schedule,
            "seed": self.seed,
            "steps_per_epoch": self.steps_per_epoch,
            "bucket_bytes": self.bucket_bytes,
            // Bitwise agreement needs the same kind of device and the same thread count.
            "device": if self.device.is_cuda() { "cuda" } else { "cpu" },
            "threads": self.threads,
        })
        .to_string()
    }
}

/// Checkpointing settings.
#[derive(Clone, Debug)]
pub struct CheckpointConfig {
    /// Where.
    pub location: Location,
    /// S3 settings beyond the AWS variables.
    pub s3: S3Options,
    /// Commit every this many steps (0: only at each epoch's end).
    pub every: u64,
    /// Keep the newest this many commits (0: all).
    pub keep: usize,
}

/// Why training stopped.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The plugin returned an error or panicked.
    #[error(transparent)]
    Plugin(#[from] CallError),
    /// libtorch failed in the daemon's part of a step.
    #[error("{what}: {source}")]
    Torch {
        /// What the daemon was doing.
        what: &'static str,
        /// libtorch's error.
        source: tch::TchError,
    },
    /// The training split cannot fill a single step.
    #[error(
        "the training split gives no batch: with batch size {batch_size} per worker and {workers} worker(s) the \
         input pipeline yields 0 steps per epoch"
    )]
    NoSteps {
        /// Per-worker batch size.
        batch_size: u32,
        /// Workers.
        workers: usize,
    },
    /// Members' input pipelines yield different numbers of steps per epoch.
    #[error(
        "the workers disagree on steps per epoch: {chief} (the chief) has {chief_steps}, {other} has {other_steps} \
         (batch size {batch_size} per worker); every worker's input pipeline must yield the same number of steps, \
         so the plugin's shards of the training split must be the same size"
    )]
    StepsDiffer {
        /// The chief's name.
        chief: String,
        /// Its steps per epoch.
        chief_steps: u64,
        /// The first member that differs.
        other: String,
        /// Its steps per epoch.
        other_steps: u64,
        /// Per-worker batch size.
        batch_size: u32,
    },
    /// Cluster membership failed.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// A collective failed.
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// Checkpointing failed (opening the location, a checkpoint that does not fit this run).
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// The training state could not be encoded or taken.
    #[error("training state: {0}")]
    State(String),
    /// A local file could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
}

/// How this worker's run ended.
#[derive(Debug)]
pub enum Outcome {
    /// Training is complete.
    Finished(Box<Summary>),
    /// Stopped by a signal, after the cluster's commit (or with nothing newer to commit).
    Stopped {
        /// The global step it stopped at.
        step: u64,
        /// What became of the state: the commit holding it, or why none does.
        saved: String,
    },
}

/// Failures and recoveries this worker went through.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Recovery {
    /// Generations this worker abandoned because a member failed (or was stopped).
    pub failures_seen: u64,
    /// Generations formed again after a failure, with this worker in them.
    pub recoveries: u64,
    /// Steps the cluster lost in those recoveries (0 whenever a member kept the state).
    pub steps_lost: u64,
    /// Seconds from each failure (or this process's start, for a restarted worker) to its first
    /// step in the recovered generation.
    pub recovery_seconds: Vec<f64>,
}

/// The result of a run, written as JSON by `--summary`.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// Plugin name.
    pub plugin: String,
    /// Plugin version.
    pub plugin_version: String,
    /// Workers that trained.
    pub workers: usize,
    /// This worker's rank.
    pub rank: usize,
    /// Epochs run.
    pub epochs: u32,
    /// Optimizer steps taken.
    pub steps: u64,
    /// Examples per step over all workers.
    pub global_batch_size: u64,
    /// Optimizer and hyper-parameters.
    pub optimizer: OptimizerConfig,
    /// Learning-rate schedule.
    pub schedule: LrSchedule,
    /// Run seed.
    pub seed: u64,
    /// Device.
    pub device: String,
    /// libtorch intra-op threads.
    pub threads: usize,
    /// Mean training loss over the last epoch, over all workers.
    pub final_train_loss: f64,
    /// Mean of each metric over the last training epoch, over all workers.
    pub final_train_metrics: BTreeMap<String, f64>,
    /// Mean loss on the test split after the last epoch.
    pub test_loss: f64,
    /// Test accuracy after the last epoch, when the plugin reports `accuracy`.
    pub test_accuracy: Option<f64>,
    /// Mean of each metric on the test split.
    pub test_metrics: BTreeMap<String, f64>,
    /// Training examples per second over all workers and epochs (evaluation excluded).
    pub examples_per_second: f64,
    /// Seconds spent in training steps.
    pub train_seconds: f64,
    /// sha256 over every model variable's bytes (parameters and buffers; native-endian,
    /// contiguous), in name order.
    pub params_sha256: String,
    /// Failures and recoveries.
    pub fault_tolerance: Recovery,
    /// Why the last checkpoint commit failed, if it did (the run's result is then not durable).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_error: Option<String>,
}

impl Summary {
    /// Writes the summary as JSON, atomically: a reader (or a restart after a crash) sees the
    /// whole file or none of it.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let json = serde_json::to_string_pretty(self).map_err(std::io::Error::other)? + "\n";
        crate::atomic::write_file(path, &[json.as_bytes()])
    }
}

/// What must match on every worker about the plugin.
pub(crate) fn plugin_identity(plugin: &Plugin) -> String {
    let (i, f) = (plugin.info(), plugin.facts());
    format!(
        "{} {} (trainerd-sdk {}, tch {}, libtorch {}, {})",
        i.name, i.version, f.sdk_version, f.tch_version, f.libtorch_version, f.target
    )
}

/// The checkpoint's position, after checking that it belongs to this run.
fn check_checkpoint(restored: &Restored, info: &PluginInfo, world: usize, cfg: &RunConfig) -> Result<Position, String> {
    let seq = restored.record.sequence;
    let meta: Meta = serde_json::from_value(restored.manifest.meta.clone())
        .map_err(|e| format!("checkpoint {seq} was not written by this version of trainerd: {e}"))?;
    if meta.plugin != info.name {
        return Err(format!(
            "checkpoint {seq} was written by plugin {} {}, this run uses {} {}",
            meta.plugin, meta.plugin_version, info.name, info.version
        ));
    }
    if meta.workers != world {
        return Err(format!(
            "checkpoint {seq} was written by {} worker(s), this run has {world}; an exact resume needs the same \
             cluster size",
            meta.workers
        ));
    }
    let ours: serde_json::Value = serde_json::from_str(&cfg.agreement_json()).expect("our own JSON");
    if meta.run_config != ours {
        return Err(format!(
            "checkpoint {seq} was written with another run configuration: {} in the checkpoint, {} in this run",
            meta.run_config, ours
        ));
    }
    Ok(meta.position)
}

/// How `train` ended.
enum Ended {
    /// Every epoch is done and evaluated.
    Finished,
    /// These ranks asked to stop after the step just taken.
    Stop(Vec<usize>),
}

/// Trains the plugin's model and evaluates it after each epoch, surviving the failure of any
/// member as long as the cluster re-forms. `stop` (SIGTERM) ends the run at the next step
/// boundary after the cluster's commit.
pub fn run(
    plugin: &Plugin,
    cfg: &RunConfig,
    progress: &mut Progress,
    stop: &Arc<AtomicBool>,
    telemetry: &Arc<Telemetry>,
) -> Result<Outcome, TrainError> {
    let started = Instant::now();
    let info = plugin.info().clone();
    let metric_count = info.metrics.len();
    let identity = (plugin_identity(plugin), cfg.agreement_json());
    let mut session = Session::open(cfg.cluster.as_ref(), identity, cfg.timeouts, &cfg.network)?;
    let (rank, world) = (session.rank(), session.world());
    let chief = rank == 0;
    if let Some(listening) = session.listening() {
        let how = if cfg.network.key.is_some() { "peers must prove the cluster secret" } else { "no secret" };
        progress.line(&format!("trainerd: listening on {listening} ({how})"));
    }
    if chief && world > 1 {
        progress.line(&format!("trainerd: waiting for {world} worker(s) to join"));
    }
    tracing::debug!("start-up: control plane up after {:?}", started.elapsed());
    tch::manual_seed(cfg.seed as i64);
    let model = plugin.create_model("model", cfg.device)?;
    let (params, buffers) = split_variables(&model);
    let buckets = Buckets::new(&params, cfg.bucket_bytes);
    let optimizer = Optimizer::new(cfg.optimizer.clone(), &params);
    // The chief's freshly seeded model is the run's state until something better turns up.
    let mut state = TrainState::new((params, buffers), optimizer, metric_count, cfg.device, chief);

    let mut checkpointer = match (&cfg.checkpoint, chief) {
        (Some(c), true) => {
            let store = c.location.open(&c.s3).map_err(|e| TrainError::Checkpoint(e.to_string()))?;
            let checkpointer = Checkpointer::new(store, c.every, c.keep).map_err(TrainError::Checkpoint)?;
            if matches!(c.location, Location::S3 { .. }) {
                let endpoint = c.s3.endpoint_name();
                if c.s3.skip_probe {
                    progress.line(&format!(
                        "warning: --s3-skip-probe: not checking that {endpoint} refuses a second create-if-absent \
                         write; if it does not, two chiefs can overwrite each other's commits"
                    ));
                } else {
                    checkpointer.probe(&endpoint).map_err(|e| TrainError::Checkpoint(e.to_string()))?;
                }
            }
            Some(checkpointer)
        }
        _ => None,
    };
    if let Some(c) = checkpointer.as_mut() {
        c.telemetry = Some(Arc::clone(telemetry));
        telemetry.waiting(&format!("restoring from {}", c.location()), cfg.timeouts.rejoin);
        let (restored, floor) = c.restore().map_err(|e| TrainError::Checkpoint(e.to_string()))?;
        session.set_floor(floor);
        if let Some(r) = restored {
            for why in &r.fallbacks {
                progress.line(&format!("warning: skipped a damaged checkpoint: {why}"));
            }
            let position = check_checkpoint(&r, &info, world, cfg)
                .and_then(|p| state.restore(&r, p))
                .map(|()| state.position.clone())
                .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", c.location())))?;
            progress.line(&if position.epoch >= cfg.epochs {
                format!(
                    "trainerd: checkpoint {} in {} is the end of this run (global step {})",
                    r.record.sequence,
                    c.location(),
                    position.global_step
                )
            } else {
                format!(
                    "trainerd: resumed from checkpoint {} in {} at epoch {}, step {} (global step {})",
                    r.record.sequence,
                    c.location(),
                    position.epoch + 1,
                    position.step_in_epoch,
                    position.global_step
                )
            });
        }
    }

    // Join in the background: the rendezvous, the ring and the state transfer go on while the
    // data loads (a fresh worker reports no state; the chief reports what it restored).
    telemetry.waiting("joining the cluster", cfg.timeouts.rendezvous);
    let early = {
        let stop = Arc::clone(stop);
        std::thread::Builder::new()
            .name("trainerd-join".into())
            .spawn(move || {
                let joined = session.join(Some(&state), &stop);
                (session, state, joined)
            })
            .map_err(|source| TrainError::Io { path: "(thread)".into(), source })?
    };
    tracing::debug!("start-up: model built (and restored) after {:?}", started.elapsed());
    let train_data = model.load_data(&cfg.data_dir, Split::Train)?;
    let test_data = model.load_data(&cfg.data_dir, Split::Test)?;
    tracing::debug!("start-up: data loaded after {:?}", started.elapsed());
    let ctx = InputContext {
        num_input_pipelines: world as u32,
        input_pipeline_id: rank as u32,
        per_replica_batch_size: cfg.batch_size,
        training: true,
        epoch: 0,
        seed: cfg.seed,
    };
    let pipeline_steps = train_data.pipeline(&ctx)?.steps();
    let steps_per_epoch = cfg.steps_per_epoch.map_or(pipeline_steps, |s| s.min(pipeline_steps));
    if steps_per_epoch == 0 {
        return Err(TrainError::NoSteps { batch_size: cfg.batch_size, workers: world });
    }
    let tensorboard = match (&cfg.tensorboard_dir, chief) {
        (Some(dir), true) => {
            let tb = TensorBoard::create(dir, cfg.tensorboard_every)
                .map_err(|source| TrainError::Io { path: dir.clone(), source })?;
            progress.line(&format!("trainerd: TensorBoard events in {}", dir.display()));
            Some(tb)
        }
        _ => None,
    };
    let metrics_log = match &cfg.metrics_log {
        Some(path) => Some(std::io::BufWriter::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|source| TrainError::Io { path: path.clone(), source })?,
        )),
        None => None,
    };

    let mut trainer = Trainer {
        cfg,
        info: &info,
        model: &model,
        test_data: &test_data,
        buckets,
        ctx,
        steps_per_epoch,
        progress,
        metrics_log,
        tensorboard,
        checkpointer,
        stop: Arc::clone(stop),
        batches: Batches { data: &train_data, device: cfg.device, cursor: None },
        shown_epoch: None,
        epoch_time: Duration::ZERO,
        phases: Phases::default(),
        epoch_examples: 0.0,
        train_time: Duration::ZERO,
        examples: 0.0,
        recovery: Recovery::default(),
        interrupted_at: None,
        recovering: None,
        telemetry: Arc::clone(telemetry),
    };
    let (mut session, mut state, joined) = early.join().expect("the joining thread does not panic");
    tracing::debug!("start-up: joined after {:?}", started.elapsed());
    let mut early = Some(joined);
    loop {
        if let Some(why) = session.replaced() {
            return Err(TrainError::Cluster(ClusterError::Replaced(why)));
        }
        let joined = match early.take() {
            Some(joined) => joined,
            None => session.join(Some(&state), stop),
        };
        if let Ok(j) = &joined {
            telemetry.joined(j.formed.generation, world);
        }
        let ended = joined.and_then(|j| trainer.adopt(&mut state, &mut session, j, started)).and_then(|()| {
            let ended = trainer.train(&mut state, &mut session)?;
            trainer.conclude(&mut state, &session, ended)
        });
        match ended {
            Ok(Some(outcome)) => return Ok(outcome),
            Ok(None) => break,
            Err(Interrupt::Abandoned(why)) => trainer.abandoned(&state, &session, &why),
            Err(Interrupt::Stopped) => return trainer.stopped(&state, rank),
            Err(Interrupt::Fatal(e)) => return Err(e),
        }
    }
    trainer.summary(&state, &session)
}

/// An epoch's input pipeline, positioned at a step, keeping the last two batches it handed out
/// (already on the device): the step in flight's, which a step abandoned and taken again needs
/// again, and the next one, taken while the device computes the current step.
struct Cursor<'d> {
    epoch: u32,
    next: u64,
    pipeline: InputPipeline<'d>,
    recent: Vec<(u64, Tensor, Tensor)>,
}

/// Batches `(epoch, step)` (0-based step) from `data`, on `device`, reopening the pipeline only
/// when it is not positioned there.
struct Batches<'d> {
    data: &'d Dataset<'d>,
    device: Device,
    cursor: Option<Cursor<'d>>,
}

impl<'d> Batches<'d> {
    fn get(&mut self, ctx: &InputContext, step: u64) -> Result<(Tensor, Tensor), TrainError> {
        let epoch = ctx.epoch as u32;
        if let Some(c) = self.cursor.as_ref().filter(|c| c.epoch == epoch) {
            if let Some((_, xs, ys)) = c.recent.iter().find(|(s, ..)| *s == step) {
                return Ok((xs.shallow_clone(), ys.shallow_clone()));
            }
        }
        if !self.cursor.as_ref().is_some_and(|c| c.epoch == epoch && c.next == step) {
            let mut pipeline = self.data.pipeline(ctx)?;
            for _ in 0..step {
                pipeline.next_batch()?;
            }
            self.cursor = Some(Cursor { epoch, next: step, pipeline, recent: Vec::new() });
        }
        let c = self.cursor.as_mut().expect("positioned");
        let next = match c.pipeline.next_batch() {
            Ok(next) => next,
            Err(e) => {
                // A pipeline that failed is not trusted to go on: the next request starts afresh
                // (and meets the same error, if a prefetch swallowed it).
                self.cursor = None;
                return Err(e.into());
            }
        };
        let (xs, ys) = next.ok_or(TrainError::NoSteps {
            batch_size: ctx.per_replica_batch_size,
            workers: ctx.num_input_pipelines as usize,
        })?;
        let (xs, ys) = (to_device(xs, self.device)?, to_device(ys, self.device)?);
        c.next = step + 1;
        if c.recent.len() == 2 {
            let _ = c.recent.remove(0);
        }
        c.recent.push((step, xs.shallow_clone(), ys.shallow_clone()));
        Ok((xs, ys))
    }
}

/// `t` on `device`; to a GPU from page-locked memory without waiting, so the copy queues behind
/// the step in flight instead of stalling the host.
fn to_device(t: Tensor, device: Device) -> Result<Tensor, TrainError> {
    let moved = match device {
        // `_pin_memory`: see `collective::buckets`.
        Device::Cuda(_) => t.f_internal_pin_memory(device).and_then(|p| p.f_to_device_(device, p.kind(), true, false)),
        _ => t.f_to_device(device),
    };
    moved.map_err(|source| TrainError::Torch { what: "moving the batch to the device", source })
}

/// Host time per step, by phase, over an epoch.
#[derive(Default)]
struct Phases {
    steps: u32,
    /// Forward, loss, backward, waiting for the device, the all-reduce (the prefetch excluded).
    step: Duration,
    /// Making the next batch and queueing its copy to the device.
    prefetch: Duration,
    optimizer: Duration,
}

impl Phases {
    fn report(self, epoch: u32) {
        let per = |d: Duration| d.as_secs_f64() * 1e6 / f64::from(self.steps.max(1));
        tracing::debug!(
            "epoch {}: {} steps; per step: {:.0} us forward+backward+all-reduce, {:.0} us next batch, {:.0} us optimizer",
            epoch + 1,
            self.steps,
            per(self.step.saturating_sub(self.prefetch)),
            per(self.prefetch),
            per(self.optimizer)
        );
    }
}

/// Everything the loop needs besides the state and the session.
struct Trainer<'a> {
    cfg: &'a RunConfig,
    info: &'a PluginInfo,
    model: &'a ModelInstance<'a>,
    test_data: &'a Dataset<'a>,
    buckets: Buckets,
    ctx: InputContext,
    steps_per_epoch: u64,
    progress: &'a mut Progress,
    metrics_log: Option<std::io::BufWriter<std::fs::File>>,
    /// The chief's TensorBoard writers.
    tensorboard: Option<TensorBoard>,
    checkpointer: Option<Checkpointer>,
    stop: Arc<AtomicBool>,
    batches: Batches<'a>,
    shown_epoch: Option<u32>,
    epoch_time: Duration,
    /// Where this epoch's step time went (`TRAINERD_LOG=trainerd=debug` shows it).
    phases: Phases,
    epoch_examples: f64,
    train_time: Duration,
    examples: f64,
    recovery: Recovery,
    /// When this worker abandoned its last step (for the recovery time).
    interrupted_at: Option<Instant>,
    /// A recovery in progress: when it began, and the formation it formed.
    recovering: Option<(Instant, Formed)>,
    /// What systemd and Prometheus see.
    telemetry: Arc<Telemetry>,
}

impl<'a> Trainer<'a> {
    fn ctx(&self, epoch: u32, training: bool) -> InputContext {
        InputContext { epoch: u64::from(epoch), training, ..self.ctx }
    }

    fn metrics(&self) -> usize {
        self.info.metrics.len()
    }

    /// The learning rate of global step `global_step` (from 0).
    fn lr(&self, global_step: u64) -> f64 {
        let total_steps = self.steps_per_epoch * u64::from(self.cfg.epochs);
        lr_at(&self.cfg.schedule, self.cfg.optimizer.lr(), global_step, total_steps)
    }

    /// Writes to TensorBoard; a failure is reported once and ends the TensorBoard output (it
    /// never stops training).
    fn tensorboard(&mut self, write: impl FnOnce(&mut TensorBoard) -> std::io::Result<()>) {
        let Some(tb) = self.tensorboard.as_mut() else { return };
        if let Err(e) = write(tb) {
            let dir = tb.dir().display().to_string();
            self.tensorboard = None;
            self.progress.line(&format!("warning: TensorBoard events in {dir}: {e}; no more events are written"));
        }
    }

    /// Takes the state a formation settled on, and says what happened.
    fn adopt(
        &mut self,
        state: &mut TrainState,
        session: &mut Session,
        joined: Joined,
        started: Instant,
    ) -> Result<(), Interrupt> {
        let Joined { formed, received } = joined;
        if let Some(bytes) = received {
            state.decode(&bytes).map_err(|e| Interrupt::Fatal(TrainError::State(e)))?;
        }
        tracing::debug!("generation {} adopted after {:?}", formed.generation, started.elapsed());
        state.live = true;
        if let Some(c) = self.checkpointer.as_mut() {
            c.set_generation(formed.generation);
        }
        let world = session.world();
        if world == 1 {
            return Ok(());
        }
        self.agree_on_steps(session)?;
        let (g, step) = (formed.generation, state.position.global_step);
        if !formed.recovery {
            self.progress.line(&if session.rank() == 0 {
                format!("trainerd: {world} worker(s) joined (generation {g})")
            } else {
                format!("trainerd: joined as worker {} of {world} (generation {g})", session.rank())
            });
            return Ok(());
        }
        let source = if formed.receivers.is_empty() {
            "every member held it".to_string()
        } else {
            format!("from {} (sha256 verified)", session.name(formed.source))
        };
        self.progress.line(&format!(
            "trainerd: generation {g} formed at step {step}: {} step(s) lost; state {source}",
            formed.steps_lost
        ));
        self.recovery.recoveries += 1;
        self.recovery.steps_lost += formed.steps_lost;
        self.recovering = Some((self.interrupted_at.take().unwrap_or(started), formed));
        Ok(())
    }

    /// Every member's steps per epoch, exchanged once per generation before any step: members
    /// whose input pipelines yield different counts would desynchronise the collectives (one
    /// member would evaluate while the others still train), so the run is refused, naming both
    /// counts. Every member sees the same counts, so every member refuses.
    fn agree_on_steps(&mut self, session: &mut Session) -> Result<(), Interrupt> {
        let (rank, world) = (session.rank(), session.world());
        let mut counts = vec![0f64; world];
        counts[rank] = self.steps_per_epoch as f64;
        session.ring().all_reduce(&mut counts, ReduceOp::Sum).map_err(|e| session.interrupt(e.into()))?;
        match counts.iter().position(|&c| c != counts[0]) {
            None => Ok(()),
            Some(other) => Err(Interrupt::Fatal(TrainError::StepsDiffer {
                chief: session.name(0),
                chief_steps: counts[0] as u64,
                other: session.name(other),
                other_steps: counts[other] as u64,
                batch_size: self.cfg.batch_size,
            })),
        }
    }

    /// A step, a formation or a barrier was abandoned: say so once, and go back to join.
    fn abandoned(&mut self, state: &TrainState, session: &Session, why: &str) {
        self.recovery.failures_seen += 1;
        self.telemetry.abandoned(why, self.cfg.timeouts.rejoin);
        self.interrupted_at.get_or_insert_with(Instant::now);
        self.progress.line(&format!(
            "trainerd: step {} abandoned (generation {}): {why}; waiting for the cluster to re-form",
            state.position.global_step + 1,
            session.generation()
        ));
    }

    fn meta(&self, position: Position, world: usize) -> Meta {
        Meta {
            position,
            plugin: self.info.name.clone(),
            plugin_version: self.info.version.clone(),
            workers: world,
            run_config: serde_json::from_str(&self.cfg.agreement_json()).expect("our own JSON"),
            rng: checkpoint::RNG_SCHEME.into(),
        }
    }

    /// On the chief: starts committing `state` unless it is already committed, after the
    /// previous commit. A periodic commit (`last` false) is skipped while the previous one is
    /// stuck on failing storage: training waits for an outage only at the end of the run or a
    /// stop.
    fn commit(&mut self, state: &TrainState, world: usize, last: bool) -> Result<(), TrainError> {
        let meta = self.meta(state.position.clone(), world);
        let Some(c) = self.checkpointer.as_mut() else { return Ok(()) };
        if c.has(state.progress()) {
            return Ok(());
        }
        if !last && c.stuck() {
            self.progress.line(&format!(
                "warning: checkpoint at step {} skipped: the previous commit to {} is still retrying",
                state.position.global_step,
                c.location()
            ));
            return Ok(());
        }
        let blobs = state.blobs().map_err(TrainError::State)?;
        let progress = &mut *self.progress;
        c.commit(blobs, &meta, &mut |m| progress.line(&m)).map_err(TrainError::Checkpoint)
    }

    /// Waits for the chief's commit in flight; its sequence, if it committed.
    fn commit_wait(&mut self) -> Option<u64> {
        if let Some(c) = &self.checkpointer {
            // The store retries a failing request within a bounded policy; the rejoin deadline
            // bounds the wait well beyond it.
            self.telemetry.waiting(&format!("committing to {}", c.location()), self.cfg.timeouts.rejoin);
        }
        let progress = &mut *self.progress;
        self.checkpointer.as_mut()?.wait(&mut |m| progress.line(&m))
    }

    /// Trains until every epoch is done and evaluated, or a member asks to stop.
    fn train(&mut self, state: &mut TrainState, session: &mut Session) -> Result<Ended, Interrupt> {
        let (cfg, spe) = (self.cfg, self.steps_per_epoch);
        while state.position.epoch < cfg.epochs {
            let epoch = state.position.epoch;
            if self.shown_epoch != Some(epoch) {
                self.progress.epoch_start(epoch, cfg.epochs);
                (self.shown_epoch, self.epoch_time, self.epoch_examples) = (Some(epoch), Duration::ZERO, 0.0);
            }
            if state.position.step_in_epoch >= spe {
                self.end_epoch(state, session)?;
                continue;
            }
            let step = state.position.step_in_epoch + 1;
            let ctx = self.ctx(epoch, true);
            let batch = self.batches.get(&ctx, step - 1).map_err(Interrupt::Fatal)?;
            let global_step = state.position.global_step;
            let lr = self.lr(global_step);
            let batches = &mut self.batches;
            let phases = &mut self.phases;
            // The next batch is made while the device computes this step (an error shows when
            // that step asks for it).
            let mut prefetch = || {
                let began = Instant::now();
                if step < spe {
                    let _ = batches.get(&ctx, step);
                }
                phases.prefetch += began.elapsed();
            };
            tch::manual_seed(checkpoint::replica_seed(cfg.seed, global_step, session.rank()));
            let stopping = self.stop.load(Ordering::Relaxed);
            // Chaos tests hang a step here (as a stuck kernel would) to see the watchdog stop.
            trainerd_storage::failpoint::point("train-step");
            // A forward pass updates buffers in place: an abandoned step puts them back.
            let saved = if session.world() > 1 { state.save_buffers() } else { Vec::new() };
            let began = Instant::now();
            let result = step::train_step(
                self.model,
                &mut state.params,
                &mut state.buffers,
                &mut self.buckets,
                session.ring(),
                (&batch.0, &batch.1),
                stopping,
                &mut prefetch,
            );
            let result = result.map_err(|e| {
                state.restore_buffers(&saved);
                session.interrupt(e)
            })?;
            let stepped = Instant::now();
            state.optimizer.step(&mut state.params, lr);
            self.phases.step += stepped - began;
            self.phases.optimizer += stepped.elapsed();
            self.phases.steps += 1;
            let position = &mut state.position;
            position.global_step += 1;
            position.step_in_epoch = step;
            let mut totals = Totals::from_sums(&position.totals, self.metrics());
            totals.add(&result.sums);
            position.totals = totals.sums();
            let took = began.elapsed();
            (self.epoch_time, self.train_time) = (self.epoch_time + took, self.train_time + took);
            self.epoch_examples += result.sums[1];
            self.examples += result.sums[1];
            session.set_step(position.global_step);
            let named = Totals::from_sums(&result.sums, self.metrics()).named(&self.info.metrics, "");
            let rate = self.epoch_examples / self.epoch_time.as_secs_f64().max(1e-9);
            self.telemetry.step((epoch, step, spe), position.global_step, &named, result.sums[1], rate, lr);
            let global_step = position.global_step;
            self.tensorboard(|tb| tb.step(global_step, &named));
            self.after_step(state, session.world(), &result.sums, lr)?;
            if self.progress.wants(step, spe) {
                let values = totals.named(&self.info.metrics, "");
                self.progress.step(step, spe, self.epoch_time, &values);
            }
            if !result.stopping.is_empty() {
                return Ok(Ended::Stop(result.stopping));
            }
        }
        if state.position.last_eval.is_empty() && cfg.epochs > 0 {
            // A checkpoint of an older trainerd holds no evaluation: make it.
            let eval = self.evaluate(cfg.epochs - 1, session)?;
            state.position.last_eval = eval.sums();
        }
        Ok(Ended::Finished)
    }

    fn evaluate(&mut self, epoch: u32, session: &mut Session) -> Result<Totals, Interrupt> {
        let ctx = self.ctx(epoch, false);
        // A pass over the test split, each collective bounded by the collective timeout.
        self.telemetry.waiting(&format!("evaluating epoch {}", epoch + 1), self.cfg.timeouts.collective);
        step::evaluate(self.model, self.test_data, &ctx, session.ring(), self.cfg.device, self.metrics())
            .map_err(|e| session.interrupt(e))
    }

    /// Bookkeeping after a step: a recovery's report, the metrics log, a periodic commit.
    fn after_step(&mut self, state: &TrainState, world: usize, sums: &[f64], lr: f64) -> Result<(), Interrupt> {
        let position = &state.position;
        if let Some((since, formed)) = self.recovering.take() {
            let took = since.elapsed().as_secs_f64();
            tracing::debug!("recovery: first step done after {took:.3}s");
            self.recovery.recovery_seconds.push(took);
            self.telemetry.recovered(formed.steps_lost, took);
            self.progress.line(&format!(
                "trainerd: recovered at step {} (generation {}): {} step(s) lost, {took:.2}s",
                formed.progress.0, formed.generation, formed.steps_lost
            ));
        }
        if let Some(log) = self.metrics_log.as_mut() {
            let time = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
            let mut line = serde_json::json!({
                "time": time,
                "epoch": position.epoch,
                "step": position.step_in_epoch,
                "global_step": position.global_step,
                "lr": lr,
            });
            for (name, value) in Totals::from_sums(sums, self.info.metrics.len()).named(&self.info.metrics, "") {
                line[name] = value.into();
            }
            let path = self.cfg.metrics_log.clone().unwrap_or_default();
            writeln!(log, "{line}")
                .and_then(|()| log.flush())
                .map_err(|source| Interrupt::Fatal(TrainError::Io { path, source }))?;
        }
        let Some(c) = self.checkpointer.as_mut() else { return Ok(()) };
        let progress = &mut *self.progress;
        c.poll(&mut |m| progress.line(&m));
        if c.every > 0 && position.global_step % c.every == 0 && position.step_in_epoch < self.steps_per_epoch {
            self.commit(state, world, false)?;
        }
        Ok(())
    }

    /// The epoch's evaluation, its last line, and the chief's commit.
    fn end_epoch(&mut self, state: &mut TrainState, session: &mut Session) -> Result<(), Interrupt> {
        let epoch = state.position.epoch;
        let eval = self.evaluate(epoch, session)?;
        let totals = Totals::from_sums(&state.position.totals, self.metrics());
        let p = &mut state.position;
        p.epoch += 1;
        p.step_in_epoch = 0;
        p.last_epoch = totals.sums();
        p.last_eval = eval.sums();
        p.totals = Totals::new(self.metrics()).sums();
        let global_step = p.global_step;
        let train = totals.named(&self.info.metrics, "");
        let validation = eval.named(&self.info.metrics, "");
        self.telemetry.evaluated(&validation);
        self.telemetry.progress();
        let rate = self.epoch_examples / self.epoch_time.as_secs_f64().max(1e-9);
        // The rate the epoch's last step used (what Keras's PrintLR shows at the epoch's end).
        let lr = self.lr(global_step.saturating_sub(1));
        let mut values = train.clone();
        values.extend(eval.named(&self.info.metrics, "val_"));
        if self.cfg.schedule != LrSchedule::Constant {
            values.push(("learning_rate".into(), lr));
        }
        let mut scalars = train;
        scalars.extend([("learning_rate".to_string(), lr), ("examples_per_second".to_string(), rate)]);
        self.tensorboard(|tb| tb.epoch((epoch, global_step), &scalars, &validation));
        std::mem::take(&mut self.phases).report(epoch);
        self.progress.epoch_end(self.steps_per_epoch, self.epoch_time, &values, rate);
        Ok(self.commit(state, session.world(), false)?)
    }

    /// After `train`: the end of the run (every member's final barrier, the chief's last commit
    /// done before it), or a stop (the chief commits; then the stopped members leave). `None`
    /// when the run is complete.
    fn conclude(
        &mut self,
        state: &mut TrainState,
        session: &Session,
        ended: Ended,
    ) -> Result<Option<Outcome>, Interrupt> {
        let rank = session.rank();
        match ended {
            Ended::Finished => {
                // The last commit completes before anyone leaves: a chief lost during it is
                // recovered from a member that still holds the final state.
                self.commit(state, session.world(), true)?;
                self.commit_wait();
                self.telemetry.waiting("waiting for every worker to finish", self.cfg.timeouts.rejoin);
                session.barrier(FINAL_BARRIER)?;
                session.finish();
                Ok(None)
            }
            Ended::Stop(stopping) => {
                let names: Vec<String> = stopping.iter().map(|&r| session.name(r)).collect();
                let step = state.position.global_step;
                self.commit(state, session.world(), true)?;
                let saved = self.commit_wait();
                self.telemetry.waiting("waiting for every worker to stop", self.cfg.timeouts.rejoin);
                session.barrier(&format!("stop@{step}"))?;
                if stopping.contains(&rank) {
                    session.leave("was stopped (SIGTERM)");
                    return Ok(Some(Outcome::Stopped { step, saved: self.saved(saved, state) }));
                }
                Err(Interrupt::Abandoned(format!("{} stopped (SIGTERM) after step {step}", names.join(", "))))
            }
        }
    }

    /// Where the state of a stopped worker lives on.
    fn saved(&self, sequence: Option<u64>, state: &TrainState) -> String {
        match (&self.checkpointer, sequence) {
            (Some(c), Some(seq)) => format!("committed as checkpoint {seq} in {}", c.location()),
            (Some(c), None) if c.has(state.progress()) => format!("already committed in {}", c.location()),
            (Some(c), None) => format!(
                "not committed: {}",
                c.last_error.clone().unwrap_or_else(|| format!("no commit to {}", c.location()))
            ),
            (None, _) if self.cfg.checkpoint.is_some() => "held by the chief".into(),
            (None, _) => "not saved (no --checkpoint-dir)".into(),
        }
    }

    /// Stopped while waiting for the cluster: the chief commits what it holds first.
    fn stopped(&mut self, state: &TrainState, rank: usize) -> Result<Outcome, TrainError> {
        let mut saved = None;
        if rank == 0 && state.live {
            self.commit(state, self.ctx.num_input_pipelines as usize, true)?;
            saved = self.commit_wait();
        }
        Ok(Outcome::Stopped { step: state.position.global_step, saved: self.saved(saved, state) })
    }

    fn summary(mut self, state: &TrainState, session: &Session) -> Result<Outcome, TrainError> {
        self.metrics_log.take();
        let metrics = self.metrics();
        let last_train = Totals::from_sums(&state.position.last_epoch, metrics);
        let last_eval = Totals::from_sums(&state.position.last_eval, metrics);
        let named =
            |values: Vec<f64>| -> BTreeMap<String, f64> { self.info.metrics.iter().cloned().zip(values).collect() };
        let test_metrics = named(last_eval.metric_means());
        let world = session.world();
        Ok(Outcome::Finished(Box::new(Summary {
            plugin: self.info.name.clone(),
            plugin_version: self.info.version.clone(),
            workers: world,
            rank: session.rank(),
            epochs: self.cfg.epochs,
            steps: state.position.global_step,
            global_batch_size: u64::from(self.cfg.batch_size) * world as u64,
            optimizer: self.cfg.optimizer.clone(),
            schedule: self.cfg.schedule.clone(),
            seed: self.cfg.seed,
            device: device_name(self.cfg.device),
            threads: self.cfg.threads,
            final_train_loss: last_train.loss_mean(),
            final_train_metrics: named(last_train.metric_means()),
            test_loss: last_eval.loss_mean(),
            test_accuracy: test_metrics.get("accuracy").copied(),
            test_metrics,
            examples_per_second: self.examples / self.train_time.as_secs_f64().max(1e-9),
            train_seconds: self.train_time.as_secs_f64(),
            params_sha256: params_sha256(
                &state.variables().map(|(n, t)| (n.clone(), t.shallow_clone())).collect::<Vec<_>>(),
            ),
            fault_tolerance: self.recovery.clone(),
            checkpoint_error: self.checkpointer.as_ref().and_then(|c| c.last_error.clone()),
        })))
    }
}

/// The model's variables as (trainable parameters, buffers), each in name order: a variable
/// that requires no gradient (BatchNorm's running statistics, a frozen layer) is state that the
/// optimizer never touches.
pub fn split_variables(model: &ModelInstance<'_>) -> (state::Named, state::Named) {
    model.parameters().iter().map(|(n, t)| (n.clone(), t.shallow_clone())).partition(|(_, t)| t.requires_grad())
}

/// `cpu` or `cuda:N`, as `--device` spells it.
pub fn device_name(device: Device) -> String {
    match device {
        Device::Cuda(n) => format!("cuda:{n}"),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// sha256 over every variable's bytes (parameters and buffers), in name order.
pub fn params_sha256(params: &[(String, Tensor)]) -> String {
    let mut sorted: Vec<&(String, Tensor)> = params.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let mut hasher = Sha256::new();
    for (name, p) in sorted {
        hasher.update(checkpoint::host_bytes(p).unwrap_or_else(|e| panic!("reading parameter {name}: {e}")));
    }
    format!("{:x}", hasher.finalize())
}
