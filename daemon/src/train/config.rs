//! What a run is told: [`RunConfig`] (what to train and how, from the command line) and its
//! [`CheckpointConfig`].

use std::path::PathBuf;

use tch::Device;
use trainerd_sdk::{LrSchedule, OptimizerConfig};
use trainerd_storage::{Location, S3Options};

use crate::cluster::member::Settings;
use crate::cluster::{ClusterConfig, Network, Timeouts};
use crate::collective::Backend;
use crate::input::DataSource;

/// The default of `--replica-check-every`: at mnist-cnn's step on this project's CPUs the check
/// costs well under 1% of the step time (bench/multi_worker.sh measures it).
pub(crate) const REPLICA_CHECK_EVERY: u64 = 100;

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
    /// The gradients sharded too (`--shard gradients`): buckets let go once reduced
    /// ([`crate::collective::buckets::Buckets::compact`]). A worker's memory alone: the bits and
    /// the collectives are the same, so workers need not agree on it.
    pub(crate) shard_gradients: bool,
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
    /// Gradient bucket size in bytes (`--bucket-mb`).
    pub(crate) bucket_bytes: usize,
    /// Each bucket's reduction starts during the backward pass, once its gradients are final
    /// (`--overlap`; the ring's, on CPU parameters).
    pub(crate) overlap: bool,
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
            shard_gradients: false,
            catch_up_memory: 1 << 30,
            callbacks: Default::default(),
            steps_per_epoch: None,
            threads: 1,
            cluster: None,
            network: Network::loopback(),
            timeouts: Timeouts::default(),
            bucket_bytes: crate::collective::buckets::DEFAULT_BUCKET_BYTES,
            overlap: true,
            collective: Backend::Ring,
            metrics_log: None,
            checkpoint: None,
            tensorboard_dir: None,
            tensorboard_every: 0,
            log_examples: None,
            state_dir: None,
            replica_check_every: REPLICA_CHECK_EVERY,
            gpus: Vec::new(),
        }
    }
}

impl RunConfig {
    /// How this worker takes part in its cluster.
    pub(crate) fn member_settings(&self) -> Settings<'_> {
        Settings { timeouts: self.timeouts, network: &self.network, state_dir: self.state_dir.as_deref() }
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
