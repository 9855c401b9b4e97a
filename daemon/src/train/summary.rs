//! How a worker's run ended ([`Outcome`]), and the result of a run, as `--summary` writes it: what trained, how well, how fast, the
//! parameters' fingerprint, and the failures and recoveries this worker went through.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;
use tch::Device;
use trainerd_sdk::{LrSchedule, OptimizerConfig};

use crate::input::DataFigures;

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

/// One mismatch the replicas' comparison found, as the summary tells it.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct ReplicaMismatch {
    /// The global step of the states compared.
    pub(crate) step: u64,
    /// The members whose state differed.
    pub(crate) members: Vec<String>,
    /// The step this worker went back to (none: it dropped its state and took a peer's).
    pub(crate) back_to: Option<u64>,
}

/// What the summary says of the replicas' comparisons.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct ReplicaFigures {
    /// The interval in steps (0: only before commits).
    pub(crate) every: u64,
    /// Comparisons made.
    pub(crate) checks: u64,
    /// Seconds they took (encoding, hashing, the all-reduce), in all.
    pub(crate) seconds: f64,
    /// Each mismatch found.
    pub(crate) mismatches: Vec<ReplicaMismatch>,
}

/// Failures and recoveries this worker went through.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct Recovery {
    /// Generations this worker abandoned because a member failed (or was stopped).
    pub(crate) failures_seen: u64,
    /// Generations formed again after a failure, with this worker in them.
    pub(crate) recoveries: u64,
    /// Steps the cluster lost in those recoveries (0 whenever a member kept the state).
    pub(crate) steps_lost: u64,
    /// Steps trained again after those recoveries: the steps lost, and those a repair of a
    /// corrupted replica went back over.
    pub(crate) steps_trained_again: u64,
    /// Seconds from each failure (or this process's start, for a restarted worker) to its first
    /// step in the recovered generation.
    pub(crate) recovery_seconds: Vec<f64>,
    /// Per generation whose backend builds a communicator beside its ring (on GPUs): seconds from
    /// the start of its creation to when it was known ready (the creation overlaps the state
    /// transfer). Empty on the ring.
    pub(crate) communicator_seconds: Vec<f64>,
    /// Seconds of training in generations with fewer workers than TF_CONFIG's (their slots
    /// spread over those present).
    pub(crate) seconds_short: f64,
    /// Training throughput over those seconds (`null` when the run was never short).
    pub(crate) examples_per_second_short: Option<f64>,
    /// Training throughput with every worker present (`null` when never).
    pub(crate) examples_per_second_full: Option<f64>,
    /// Steps this process replayed to catch up before taking its slots back
    /// (docs/fault-tolerance.md, "A return that does not pause the survivors").
    pub(crate) steps_replayed: u64,
    /// Seconds from this process's start to when it had caught up (`null` when it did not).
    pub(crate) catch_up_seconds: Option<f64>,
    /// On the coordinator: the most bytes of outputs it kept for a returner's catch-up at once.
    pub(crate) catch_up_kept_bytes: u64,
}

/// The result of a run, written as JSON by `--summary`.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Summary {
    /// Plugin name.
    pub(crate) plugin: String,
    /// Plugin version.
    pub(crate) plugin_version: String,
    /// Workers in TF_CONFIG.
    pub(crate) workers: usize,
    /// Workers present at the end (fewer than `workers` when some were replaced).
    pub(crate) workers_present: usize,
    /// Replicas in each worker (`--devices`).
    pub(crate) replicas: usize,
    /// Micro-batches per update on each replica (`--accumulate`): the run's slots (virtual
    /// ranks), whose math it is, are `workers` times `replicas` times this.
    pub(crate) accumulate: usize,
    /// The forward pass's precision (`fp32`, `bf16`, `fp16`).
    pub(crate) precision: &'static str,
    /// Float16's loss scale at the end, and the steps it skipped (`--precision fp16` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) loss_scale: Option<crate::optim::precision::LossScale>,
    /// The slots this worker held at the end.
    pub(crate) slots: Vec<usize>,
    /// This worker's rank.
    pub(crate) rank: usize,
    /// Epochs run.
    pub(crate) epochs: u32,
    /// Early stopping ended the run after this epoch (1-based).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) stopped_early_after_epoch: Option<u32>,
    /// Optimizer steps taken.
    pub(crate) steps: u64,
    /// Examples per step over all workers.
    pub(crate) global_batch_size: u64,
    /// Optimizer and hyper-parameters.
    pub(crate) optimizer: OptimizerConfig,
    /// Learning-rate schedule.
    pub(crate) schedule: LrSchedule,
    /// Run seed.
    pub(crate) seed: u64,
    /// Device.
    pub(crate) device: String,
    /// libtorch intra-op threads.
    pub(crate) threads: usize,
    /// Mean training loss over the last epoch, over all workers.
    pub(crate) final_train_loss: f64,
    /// Mean of each metric over the last training epoch, over all workers.
    pub(crate) final_train_metrics: BTreeMap<String, f64>,
    /// Mean loss on the test split after the last epoch (none: the run did not evaluate).
    pub(crate) test_loss: Option<f64>,
    /// Test accuracy after the last epoch, when the plugin reports `accuracy`.
    pub(crate) test_accuracy: Option<f64>,
    /// Mean of each metric on the test split.
    pub(crate) test_metrics: BTreeMap<String, f64>,
    /// Training examples per second over all workers and epochs (evaluation excluded).
    pub(crate) examples_per_second: f64,
    /// The same in tokens, when the model reads a token column (examples times its length).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tokens_per_second: Option<f64>,
    /// A language model's perplexity on the test split (`exp` of the test loss).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) test_perplexity: Option<f64>,
    /// Seconds spent in training steps.
    pub(crate) train_seconds: f64,
    /// Where a training step's time went, on average.
    pub(crate) step_phases: StepPhases,
    /// sha256 over every model variable's bytes (parameters and buffers; native-endian,
    /// contiguous), in name order.
    pub(crate) params_sha256: String,
    /// The CPU kernels the run computed with (libtorch's name; pinned for every member), when
    /// known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) cpu_capability: Option<String>,
    /// Failures and recoveries.
    pub(crate) fault_tolerance: Recovery,
    /// The replicas' comparisons, and every mismatch found (docs/fault-tolerance.md).
    pub(crate) integrity: ReplicaFigures,
    /// Why the last checkpoint commit failed, if it did (the run's result is then not durable).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) checkpoint_error: Option<String>,
    /// What this worker read of a columnar dataset (none for a plugin's own format).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) data: Option<DataFigures>,
    /// This process's peak resident memory (VmHWM), in bytes, where the kernel tells it.
    pub(crate) peak_rss_bytes: Option<u64>,
    /// Bytes of optimizer state this member held at the end: all of it, or with
    /// `--shard-optimizer` its ranges and buddy copies.
    pub(crate) optimizer_state_bytes: u64,
    /// What this worker's model state held, by kind, at its peak.
    pub(crate) memory: crate::train::memory::Memory,
}

/// Where a training step's time goes, in milliseconds per step: the forward and backward passes
/// with the all-reduce, the wait for the next batch (made ahead: the time the step waits for its
/// input), and the optimizer.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub(crate) struct StepPhases {
    /// Steps timed.
    pub(crate) steps: u32,
    /// Forward, loss, backward, the all-reduce.
    pub(crate) compute_ms: f64,
    /// Getting the next batch.
    pub(crate) next_batch_ms: f64,
    /// The update.
    pub(crate) optimizer_ms: f64,
    /// Every slot's forward and backward pass (with `--overlap on`, the reductions hidden
    /// behind the last one run meanwhile).
    pub(crate) forward_backward_ms: f64,
    /// The communication the backward pass did not hide: from its end to the last reduction's
    /// end (with `--shard-optimizer`, to the end of the reduction's update and all-gather).
    pub(crate) exposed_communication_ms: f64,
}

/// This process's peak resident memory so far (`VmHWM` in `/proc/self/status`), in bytes.
pub(crate) fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

impl Summary {
    /// Writes the summary as JSON, atomically: a reader (or a restart after a crash) sees the
    /// whole file or none of it.
    pub(crate) fn write(&self, path: &Path) -> std::io::Result<()> {
        let json = serde_json::to_string_pretty(self).map_err(std::io::Error::other)? + "\n";
        crate::sys::atomic::write_file(path, &[json.as_bytes()])
    }
}

/// `cpu` or `cuda:N`, as `--device` spells it.
pub(crate) fn device_name(device: Device) -> String {
    match device {
        Device::Cuda(n) => format!("cuda:{n}"),
        other => format!("{other:?}").to_lowercase(),
    }
}
