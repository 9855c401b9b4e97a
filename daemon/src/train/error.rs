//! Why training stopped: [`TrainError`], each cause the room's parts meet, kept as its source.

use std::path::PathBuf;

use trainerd_storage::{OpenError, StorageError};

use crate::checkpoint::CheckpointError;
use crate::cluster::ClusterError;
use crate::collective::CollectiveError;
use crate::input::InputError;
use crate::plugin::CallError;
use crate::state::{MetaError, StateError};

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
