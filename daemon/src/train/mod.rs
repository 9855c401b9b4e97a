//! The training loop: synchronous data parallelism over the ring (a ring of one when there is
//! no cluster). Every worker computes gradients on its slice of each global batch, the ring
//! averages them, and every worker applies the same update, so the replicas stay identical.
//! Each epoch ends with an evaluation on the test split, each worker evaluating its shard, the
//! totals summed over the ring.
//!
//! The loop survives its peers. Its state is one value ([`crate::state::TrainState`]); a step
//! ends as done or abandoned, never as an exit because a peer failed: on a failure the member
//! keeps its process and its state, joins the next generation, and continues from the furthest
//! state any member holds ([`session`]; the protocol is `docs/fault-tolerance.md`). Only the
//! chief touches storage: it restores at start (the state of last resort) and commits.
//!
//! Everything that decides the result is fixed by the configuration: libtorch's generator is
//! seeded before the model is built and re-seeded from (seed, step, rank) before every step,
//! each epoch's data order comes from (seed, epoch), the all-reduce adds in a fixed order, and
//! the learning rate is a function of the global step. The same configuration and thread count
//! give bit-identical parameters, with failures or without.
//!
//! The parts: [`startup`] builds what a run needs, [`driver`] is the loop (generations, epochs,
//! steps), [`step`] one step and one evaluation pass, [`batches`] the data by (epoch, step),
//! [`replicas`] a daemon's further devices, [`report`] everything the run tells the outside,
//! [`commit`] when the chief commits, [`session`] a member's place in the cluster, [`summary`] the
//! result; [`sharded_step`] the sharded step's reduction and update (`--shard-optimizer`), and
//! [`parts`] a member's parts of a sharded commit.

pub(crate) mod agreement;
pub(crate) mod batches;
pub(crate) mod commit;
pub(crate) mod driver;
pub(crate) mod evaluate;
pub(crate) mod integrity;
pub(crate) mod jobs;
pub(crate) mod kernels;
pub(crate) mod parts;
pub(crate) mod predict;
pub(crate) mod replicas;
pub(crate) mod report;
pub(crate) mod session;
pub(crate) mod sharded_step;
pub(crate) mod startup;
pub(crate) mod step;
pub(crate) mod summary;

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use tch::Device;
use trainerd_sdk::{LrSchedule, OptimizerConfig};
use trainerd_storage::{Location, OpenError, S3Options, StorageError};

use crate::checkpoint::CheckpointError;
use crate::cluster::Timeouts;
use crate::cluster::{ClusterConfig, ClusterError, Network};
use crate::collective::buckets::Buckets;
use crate::collective::{Backend, CollectiveError};
use crate::input::{DataSource, InputError};
use crate::optim::optimizer::Optimizer;
use crate::plugin::{CallError, Plugin};
use crate::state::{MetaError, StateError};
use driver::Driver;
use replicas::Replicas;
use report::{Outputs, Reporter};
pub(crate) use summary::Summary;

/// What to train and how.
#[derive(Clone, Debug)]
pub(crate) struct RunConfig {
    /// The data: the plugin's own format, or a columnar dataset.
    pub(crate) data: DataSource,
    /// The plugin's configuration every worker must share ([`crate::plugin::Plugin::agreement`]).
    pub(crate) plugin: Option<serde_json::Value>,
    /// The forward pass's precision.
    pub(crate) precision: crate::optim::precision::Precision,
    /// Evaluate on the test split after each epoch (false: `--no-evaluation`).
    pub(crate) evaluate: bool,
    /// Epochs to run.
    pub(crate) epochs: u32,
    /// Per-worker batch size.
    pub(crate) batch_size: u32,
    /// Optimizer and hyper-parameters.
    pub(crate) optimizer: OptimizerConfig,
    /// Learning-rate schedule.
    pub(crate) schedule: LrSchedule,
    /// A warmup before it (`--warmup-steps`).
    pub(crate) warmup: Option<crate::optim::schedule::Warmup>,
    /// Seed of the parameters' initialisation and the data order.
    pub(crate) seed: u64,
    /// Where the model lives (its first replica, when there are several).
    pub(crate) device: Device,
    /// One device per replica in this daemon (`--devices`, as MirroredStrategy), the first being
    /// `device`: each replica is a slot of the run, so a worker with D replicas counts as D
    /// workers in the math.
    pub(crate) devices: Vec<Device>,
    /// Micro-batches per update on each replica (`--accumulate`), each a slot of the run.
    pub(crate) accumulate: usize,
    /// Gradient clipping before each update.
    pub(crate) clip: crate::optim::clip::Clip,
    /// The optimizer state sharded over the workers (`--shard-optimizer`).
    pub(crate) shard_optimizer: bool,
    /// What a returner's catch-up may keep queued on the coordinator (`--catch-up-memory`; 0:
    /// no catch-up, a return pauses the others).
    pub(crate) catch_up_memory: u64,
    /// Early stopping and learning-rate reduction on a plateau.
    pub(crate) callbacks: crate::optim::callbacks::Callbacks,
    /// Stop each epoch after this many steps (all of them when `None`).
    pub(crate) steps_per_epoch: Option<u64>,
    /// libtorch intra-op threads (recorded in the summary; set by the caller).
    pub(crate) threads: usize,
    /// The cluster, or `None` for one worker.
    pub(crate) cluster: Option<ClusterConfig>,
    /// Where the cluster's listeners bind, and the secret its connections prove.
    pub(crate) network: Network,
    /// Every deadline of the cluster.
    pub(crate) timeouts: Timeouts,
    /// Gradient bucket size in bytes.
    pub(crate) bucket_bytes: usize,
    /// What carries the gradients' all-reduce.
    pub(crate) collective: Backend,
    /// Append one JSON line per step (time, global loss, metrics, learning rate) to this file.
    pub(crate) metrics_log: Option<PathBuf>,
    /// Checkpoints, if any.
    pub(crate) checkpoint: Option<CheckpointConfig>,
    /// The chief writes TensorBoard event files here: per epoch, and the step loss every
    /// `tensorboard_every` steps (0: per epoch only).
    pub(crate) tensorboard_dir: Option<PathBuf>,
    /// See `tensorboard_dir`.
    pub(crate) tensorboard_every: u64,
    /// Append every step's example ids, one JSON line per step, to this file (a columnar dataset
    /// only): a debug mode for comparing runs' data.
    pub(crate) log_examples: Option<PathBuf>,
    /// Where this worker keeps its vote for electing a coordinator (none: it takes no part).
    pub(crate) state_dir: Option<PathBuf>,
    /// Compare the members' states every this many global steps, as well as before commits (0:
    /// before commits only).
    pub(crate) replica_check_every: u64,
    /// On CUDA: the GPU model of each device (libtorch picks cuBLAS and cuDNN kernels by the
    /// GPU's architecture, so the bits are the model's).
    pub(crate) gpus: Vec<String>,
}

#[cfg(test)]
impl RunConfig {
    /// A run of 2 epochs of batch `batch_size` on `data` with Adam (lr 0.001), seed 3, one thread,
    /// alone on `device`, with no option set.
    pub(crate) fn plain(data: DataSource, batch_size: u32, device: Device) -> RunConfig {
        RunConfig {
            data,
            plugin: None,
            precision: Default::default(),
            evaluate: true,
            epochs: 2,
            batch_size,
            optimizer: OptimizerConfig::adam(1e-3),
            schedule: LrSchedule::Constant,
            warmup: None,
            seed: 3,
            device,
            devices: vec![device],
            accumulate: 1,
            clip: Default::default(),
            shard_optimizer: false,
            catch_up_memory: 1 << 30,
            callbacks: Default::default(),
            steps_per_epoch: None,
            threads: 1,
            cluster: None,
            network: Network::loopback(),
            timeouts: Timeouts::default(),
            bucket_bytes: crate::collective::buckets::DEFAULT_BUCKET_BYTES,
            collective: Backend::Ring,
            metrics_log: None,
            checkpoint: None,
            tensorboard_dir: None,
            tensorboard_every: 0,
            log_examples: None,
            state_dir: None,
            replica_check_every: integrity::DEFAULT_EVERY,
            gpus: Vec::new(),
        }
    }
}

impl RunConfig {
    /// When the members compare their states.
    pub(crate) fn integrity(&self) -> integrity::Schedule {
        integrity::Schedule {
            every: self.replica_check_every,
            commits: self.checkpoint.as_ref().map_or(0, |c| c.every),
        }
    }
}

/// Checkpointing settings.
#[derive(Clone, Debug)]
pub(crate) struct CheckpointConfig {
    /// Where.
    pub(crate) location: Location,
    /// S3 settings beyond the AWS variables.
    pub(crate) s3: S3Options,
    /// Commit every this many steps (0: only at each epoch's end).
    pub(crate) every: u64,
    /// Keep the newest this many commits (0: all).
    pub(crate) keep: usize,
    /// Keep the commit with the best value of this epoch-end figure, too.
    pub(crate) best: Option<(String, trainerd_storage::Mode)>,
}

/// Why training stopped.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TrainError {
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
    /// The data could not be read.
    #[error(transparent)]
    Input(#[from] InputError),
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
    /// The run's CPU kernels are not the ones this worker runs, and it cannot run them.
    #[error(
        "{whose} was trained with {} CPU kernels; this worker's are {} ({mine_why}): continuing here would \
         change the run's bits. {hint}",
        run.name(),
        mine.name()
    )]
    CpuCapability {
        /// Whose capability it is ("checkpoint 3 in /ckpt", "the run").
        whose: String,
        /// The run's.
        run: crate::sys::cpu::Capability,
        /// This worker's.
        mine: crate::sys::cpu::Capability,
        /// How this worker's was chosen.
        mine_why: String,
        /// What to do.
        hint: String,
    },
    /// The CPU kernels could not be pinned.
    #[error(transparent)]
    Cpu(#[from] crate::sys::cpu::CpuError),
    /// Cluster membership failed.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// A collective failed.
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// The checkpoint location could not be opened.
    #[error("checkpoint: {0}")]
    OpenCheckpoints(#[from] OpenError),
    /// Storage failed (its error names the location, the operation and the object).
    #[error("checkpoint: {0}")]
    Storage(#[from] StorageError),
    /// Committing failed before storage was reached.
    #[error("checkpoint: {0}")]
    Checkpointer(#[from] CheckpointError),
    /// A commit that does not belong to this run (or evaluation).
    #[error("checkpoint: {location}: {source}")]
    Unfit {
        /// The checkpoint location.
        location: String,
        /// How the commit differs.
        source: MetaError,
    },
    /// A commit whose state cannot be taken.
    #[error("checkpoint: {location}: {source}")]
    Restore {
        /// The checkpoint location.
        location: String,
        /// Why.
        source: Box<StateError>,
    },
    /// Nothing was committed where an evaluation looks.
    #[error("checkpoint: {location}: no checkpoint has been committed there")]
    NoCommit {
        /// The checkpoint location.
        location: String,
    },
    /// The training state could not be encoded or taken.
    #[error("training state: {0}")]
    State(Box<StateError>),
    /// A generation whose optimizer state was sharded ended on a failure, and no member found a
    /// commit to go back to.
    #[error(
        "the sharded optimizer state is lost (generation {generation} formed after a failure) and no member found a \
         commit to go back to: the run starts over"
    )]
    ShardedStateLost {
        /// The generation that formed without a state.
        generation: u64,
    },
    /// The coordinator chose this member as the state's source, and it holds none (a protocol
    /// fault).
    #[error("training state: chosen as the state's source without a state")]
    NoStateToSend,

    /// The data gave another batch than the one asked for (a fault of the input pipeline).
    #[error(
        "training state: the data gave epoch {} step {} where epoch {} step {} was asked for",
        .got.0, .got.1, .asked.0, .asked.1
    )]
    OutOfStep {
        /// What the data gave.
        got: (u32, u64),
        /// What was asked for.
        asked: (u32, u64),
    },
    /// The plugin's predictions do not fit the file.
    #[error("predict: {0}")]
    Predict(String),
    /// The predictions file could not be written.
    #[error("writing the predictions to {}: {source}", path.display())]
    Predictions {
        /// The file.
        path: PathBuf,
        /// Why.
        source: trainerd_data::predictions::WriteError,
    },
    /// An evaluation's cluster lost a member: an evaluation keeps no state to wait with, so it
    /// ends (run it again).
    #[error("the evaluation was abandoned: {0}; run trainerd evaluate again")]
    EvaluationAbandoned(String),
    /// A stop signal came while waiting for the cluster, before an evaluation began.
    #[error("stopped by a signal before the evaluation")]
    Stopped,
    /// A thread or runtime of the daemon's could not start.
    #[error("{what} could not start: {source}")]
    Start {
        /// What.
        what: &'static str,
        /// Why.
        source: std::io::Error,
    },
    /// A local file could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
}

impl From<StateError> for TrainError {
    fn from(e: StateError) -> TrainError {
        TrainError::State(Box::new(e))
    }
}

/// How this worker's run ended.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// Training is complete.
    Finished(Box<Summary>),
    /// The run had finished when this worker came back (its coordinator did not answer, and the
    /// latest commit holds the final state of this run's configuration): nothing is left to do.
    /// What to say: at which step and commit it finished.
    AlreadyFinished(String),
    /// Stopped by a signal, after the cluster's commit (or with nothing newer to commit).
    Stopped {
        /// The global step it stopped at.
        step: u64,
        /// What became of the state: the commit holding it, or why none does.
        saved: String,
    },
}

/// Trains the plugin's model and evaluates it after each epoch, surviving the failure of any
/// member as long as the cluster re-forms. `stop` (SIGTERM) ends the run at the next step
/// boundary after the cluster's commit.
pub(crate) fn run(
    plugin: &Plugin,
    cfg: &RunConfig,
    outputs: Outputs<'_>,
    stop: &Arc<AtomicBool>,
) -> Result<Outcome, TrainError> {
    let started = Instant::now();
    let info = plugin.info().clone();
    // What every worker must agree on, which every commit records and a resume checks.
    let run_config = agreement::agreement(agreement::Job::Training(cfg));
    let mut session = startup::open_session(plugin, (cfg, &run_config), outputs.progress)?;
    // The math's world: every replica of every worker is a slot.
    let (rank, world) = (session.rank(), session.slot_count());
    tracing::debug!("start-up: control plane up after {:?}", started.elapsed());
    let mut report = Reporter::open(cfg, &info, rank == 0, outputs)?;
    tch::manual_seed(cfg.seed as i64);
    let model = plugin.create_model(crate::plugin::MODEL_PATH, cfg.device)?;
    // A process that coordinates reads its checkpoint location before it joins only where it
    // cannot join first (alone, or without a state directory): else its state is a placeholder,
    // and it reads the location only if the formation finds no member holding a state.
    let reads_now = session.coordinates() && !session.unread();
    let mut state = startup::initial_state(&model, cfg, &info, reads_now);
    if let Some(groups) = Optimizer::describe_groups(&cfg.optimizer, &state.model.params) {
        report.line(&format!("trainerd: {groups}"));
    }
    let replicas = Replicas::build(plugin, &cfg.devices, cfg.precision)?;
    let buckets = Buckets::new(&state.model.params, cfg.bucket_bytes);
    let mut checkpointer = startup::checkpointer(cfg, &mut report)?;
    let resumed = match checkpointer.as_mut().filter(|_| reads_now) {
        Some(c) => {
            let at = (&mut session, &mut state, &mut report);
            startup::resume(c, &run_config, (&info, world), at, (false, stop))?
        }
        None => false,
    };
    // A coordinator too: the chief, or a worker whose kept vote won a term, restarted after the
    // others finished under another coordinator, finds no member to form a generation with.
    if let Some(probe) = startup::finished_probe((cfg, &run_config), (&info, world))? {
        session.set_finished_probe(probe);
    }
    tracing::debug!("start-up: model built (and restored) after {:?}", started.elapsed());
    // The data first, then the join: a worker that returns to a running cluster ends its
    // generation by joining, so everything slow is done before (the peers wait from then on).
    let data = startup::load_data(&model, cfg, (rank, world))?;
    tracing::debug!("start-up: data loaded after {:?}", started.elapsed());
    let joining = startup::join_in_background(session, state, stop, &report, cfg)?;
    let committer = startup::committer(checkpointer, (cfg, &run_config), (&info, world), data.steps_per_epoch);
    let (session, state, joined) = joining.join().expect("the joining thread does not panic");
    tracing::debug!("start-up: joined after {:?}", started.elapsed());
    let driver = Driver::new((cfg, &info), (&model, replicas, &data), buckets, (report, committer), stop);
    driver.resumed(resumed).run(session, state, joined, started)
}
