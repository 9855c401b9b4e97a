//! When and what the daemon checkpoints (the storage crate does the how).
//!
//! A checkpoint holds everything needed to continue exactly: the parameters
//! (`model.safetensors`), the optimizer's state tensors (`optimizer.safetensors`), and in the
//! manifest's metadata the position (epoch, step in epoch, global step), the optimizer's step
//! count and configuration, the schedule, the data-order seed, the running totals of the epoch,
//! the plugin's identity and the cluster size. The RNG needs no saved state: libtorch's
//! generator is re-seeded from (seed, global step) before every step.
//!
//! Committing is asynchronous: at the step boundary the state is copied into host memory (the
//! only blocking part); hashing and upload run on a background thread while training goes on.
//! At most one commit is in flight; the next waits for it.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};
use trainerd_storage::{Blob, CheckpointStore, CommitRecord, Dtype, NewCheckpoint, Restored, StorageError, TensorData};

/// Blob of the parameters.
pub const MODEL_BLOB: &str = "model.safetensors";
/// Blob of the optimizer state.
pub const OPTIMIZER_BLOB: &str = "optimizer.safetensors";

/// Where training stands, and what must match to continue from it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Position {
    /// Epoch to continue in (0-based).
    pub epoch: u32,
    /// Steps of that epoch already done.
    pub step_in_epoch: u64,
    /// Optimizer steps taken in all.
    pub global_step: u64,
    /// The epoch's running sums so far: loss × examples, examples, metric sums.
    pub totals: Vec<f64>,
    /// The same sums for the last completed epoch (for the summary of a finished run).
    pub last_epoch: Vec<f64>,
    /// Loss and metric sums of the last evaluation on the test split (empty before the first).
    #[serde(default)]
    pub last_eval: Vec<f64>,
}

impl Position {
    /// The start of training, for a plugin with `metrics` metrics.
    pub fn start(metrics: usize) -> Position {
        Position {
            epoch: 0,
            step_in_epoch: 0,
            global_step: 0,
            totals: vec![0.0; 2 + metrics],
            last_epoch: vec![0.0; 2 + metrics],
            last_eval: Vec::new(),
        }
    }
}

/// The manifest metadata of a trainerd checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Meta {
    /// Position.
    pub position: Position,
    /// Plugin name.
    pub plugin: String,
    /// Plugin version.
    pub plugin_version: String,
    /// Workers that trained.
    pub workers: usize,
    /// Everything that must agree to continue exactly (the run configuration as the cluster
    /// checks it).
    pub run_config: serde_json::Value,
    /// How the RNG continues.
    pub rng: String,
}

/// The RNG scheme recorded in checkpoints.
pub const RNG_SCHEME: &str = "libtorch generator re-seeded from (seed, global_step, rank) before every step";

/// The seed of libtorch's generator for `global_step` of a run seeded `seed` (SplitMix64).
pub fn step_seed(seed: u64, global_step: u64) -> i64 {
    let mut z = seed ^ global_step.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) as i64
}

/// The seed of libtorch's generator for `global_step` on the replica of `rank`: dropout masks
/// and any other draws repeat exactly in a resumed run, and differ between replicas (as each
/// replica's examples do). Rank 0's is [`step_seed`]'s.
pub fn replica_seed(seed: u64, global_step: u64, rank: usize) -> i64 {
    step_seed(seed.wrapping_add((rank as u64).wrapping_mul(0xD1B5_4A32_D192_ED03)), global_step)
}

fn dtype(kind: Kind) -> Option<Dtype> {
    Some(match kind {
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        Kind::Uint8 => Dtype::U8,
        _ => return None,
    })
}

fn kind(dtype: Dtype) -> Kind {
    match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::U8 => Kind::Uint8,
    }
}

/// A tensor's elements as contiguous native-endian bytes in host memory.
pub fn host_bytes(t: &Tensor) -> Result<Vec<u8>, tch::TchError> {
    let t = t.detach().to_device(Device::Cpu).contiguous();
    let numel = t.numel();
    let mut data = vec![0u8; numel * t.kind().elt_size_in_bytes()];
    t.f_copy_data_u8(&mut data, numel)?;
    Ok(data)
}

/// Copies a tensor into host memory.
pub fn host_copy(name: &str, t: &Tensor) -> Result<TensorData, String> {
    let dtype = dtype(t.kind()).ok_or_else(|| format!("tensor {name}: unsupported kind {:?}", t.kind()))?;
    let data = host_bytes(t).map_err(|e| format!("tensor {name}: {e}"))?;
    Ok(TensorData {
        name: name.into(),
        dtype,
        shape: t.size().iter().map(|&d| d as usize).collect(),
        data: Bytes::from(data),
    })
}

/// A tensor (on the CPU) from host memory.
pub fn to_tensor(t: &TensorData) -> Result<Tensor, String> {
    let shape: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
    Tensor::f_from_data_size(&t.data, &shape, kind(t.dtype)).map_err(|e| format!("tensor {}: {e}", t.name))
}

/// Copies restored values into `dst` (name, tensor) in place, checking names, types and
/// shapes. `what` names the source in messages ("checkpoint 3's model").
pub fn copy_into(dst: &mut [(String, Tensor)], src: &[TensorData], what: &str) -> Result<(), String> {
    let _no_grad = tch::no_grad_guard();
    for (name, t) in dst.iter_mut() {
        let s = src.iter().find(|s| &s.name == name).ok_or_else(|| format!("{what} has no tensor {name}"))?;
        let value = to_tensor(s)?;
        if value.size() != t.size() {
            return Err(format!("{what} tensor {name} has shape {:?}, the model's has {:?}", value.size(), t.size()));
        }
        if value.kind() != t.kind() {
            return Err(format!("{what} tensor {name} is {:?}, the model's is {:?}", value.kind(), t.kind()));
        }
        t.f_copy_(&value).map_err(|e| format!("{name}: {e}"))?;
    }
    Ok(())
}

/// Background commit work runs at a lower scheduling priority (nice 10), so that on a busy
/// machine it yields the CPU to training: a commit takes a little longer, training is barely
/// slowed (bench/checkpoint.sh measures both).
fn lower_priority() {
    // SAFETY: setpriority(2) on the calling thread (Linux applies PRIO_PROCESS with who = 0 to
    // the calling thread); failure only leaves the default priority.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, 0, 10);
    }
}

/// A commit running in the background: the progress it saves, its start time, and its thread.
type InFlight = ((u64, u64), Instant, JoinHandle<Result<CommitRecord, StorageError>>);

/// Commits checkpoints in the background, one at a time, fenced by the cluster's generation and
/// this process's writer id.
pub struct Checkpointer {
    store: CheckpointStore,
    runtime: Arc<tokio::runtime::Runtime>,
    /// Commit every this many steps (0: only at epoch ends).
    pub every: u64,
    keep: usize,
    generation: u64,
    writer: u64,
    in_flight: Option<InFlight>,
    /// The store's transient failures when the commit in flight began.
    failures_before: u64,
    /// Progress (global step, epoch) of the newest state committed or restored.
    committed: Option<(u64, u64)>,
    /// The last commit's failure, if it failed.
    pub last_error: Option<String>,
    /// Where commits are counted for Prometheus.
    pub telemetry: Option<Arc<crate::ops::Telemetry>>,
}

impl Checkpointer {
    /// A checkpointer over `store`, committing every `every` steps and at epoch ends, keeping
    /// the newest `keep` commits.
    pub fn new(store: CheckpointStore, every: u64, keep: usize) -> Result<Checkpointer, String> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("trainerd-storage")
            .on_thread_start(lower_priority)
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Checkpointer {
            store,
            runtime: Arc::new(runtime),
            every,
            keep,
            generation: 1,
            writer: rand::random::<u64>() >> 1,
            in_flight: None,
            failures_before: 0,
            committed: None,
            last_error: None,
            telemetry: None,
        })
    }

    /// Proves that the location's server refuses a second create-if-absent write (see
    /// [`CheckpointStore::probe_create_if_absent`]); `endpoint` names it.
    pub fn probe(&self, endpoint: &str) -> Result<(), StorageError> {
        self.runtime.block_on(self.store.probe_create_if_absent(endpoint))
    }

    /// The location's name.
    pub fn location(&self) -> &str {
        self.store.name()
    }

    /// The newest verified commit, if any, and the newest generation the location has seen, in
    /// a commit record or in data a writer left (which the cluster's next generation must
    /// exceed, so that every earlier writer is fenced).
    pub fn restore(&mut self) -> Result<(Option<Restored>, u64), StorageError> {
        let latest = self.runtime.block_on(self.store.latest())?;
        let newest = self.runtime.block_on(self.store.latest_record()).ok().flatten();
        let written = self.runtime.block_on(self.store.newest_data_generation())?;
        let floor =
            newest.map_or(0, |r| r.generation).max(latest.as_ref().map_or(0, |r| r.record.generation)).max(written);
        self.generation = floor + 1;
        if let Some(r) = &latest {
            self.committed = Some((r.record.global_step, r.record.epoch));
        }
        Ok((latest, floor))
    }

    /// Commits from now on carry `generation` (the cluster's current one).
    pub fn set_generation(&mut self, generation: u64) {
        self.generation = generation;
    }

    /// Whether the state at `progress` is already committed (or on its way).
    pub fn has(&self, progress: (u64, u64)) -> bool {
        self.committed.is_some_and(|c| c >= progress) || self.in_flight.as_ref().is_some_and(|(p, _, _)| *p >= progress)
    }

    /// Reports a commit that has finished, without waiting.
    pub fn poll(&mut self, report: &mut dyn FnMut(String)) {
        if self.in_flight.as_ref().is_some_and(|(_, _, h)| h.is_finished()) {
            self.wait(report);
        }
    }

    /// Waits for the commit in flight, if any, and reports it. Returns its sequence when it
    /// committed.
    pub fn wait(&mut self, report: &mut dyn FnMut(String)) -> Option<u64> {
        let (progress, started, handle) = self.in_flight.take()?;
        match handle.join() {
            Ok(Ok(record)) => {
                self.last_error = None;
                if let Some(t) = &self.telemetry {
                    t.committed(started.elapsed().as_secs_f64(), record.bytes);
                }
                self.committed = self.committed.max(Some(progress));
                report(format!(
                    "checkpoint {} committed to {} (step {}, {:.1} MB, {:.2}s)",
                    record.sequence,
                    self.store.name(),
                    progress.0,
                    record.bytes as f64 / 1e6,
                    started.elapsed().as_secs_f64()
                ));
                Some(record.sequence)
            }
            Ok(Err(e)) => {
                let message = format!("checkpoint at step {} failed: {e}", progress.0);
                tracing::error!("{message}");
                if let Some(t) = &self.telemetry {
                    t.commit_failed();
                }
                report(format!("warning: {message}; training goes on, the last good commit stays"));
                self.last_error = Some(message);
                None
            }
            Err(_) => {
                self.last_error = Some(format!("checkpoint at step {}: the commit thread panicked", progress.0));
                None
            }
        }
    }

    /// Whether a commit is still uploading and the storage failed under it since it began (a
    /// slow but healthy store is waited for; a failing one is not).
    pub fn stuck(&self) -> bool {
        self.in_flight.as_ref().is_some_and(|(_, _, h)| !h.is_finished())
            && self.store.transient_failures() > self.failures_before
    }

    /// Starts committing `blobs` (a snapshot in host memory) with `meta`, after the previous
    /// commit finishes.
    pub fn commit(&mut self, blobs: Vec<Blob>, meta: &Meta, report: &mut dyn FnMut(String)) -> Result<(), String> {
        self.wait(report);
        let position = &meta.position;
        let checkpoint = NewCheckpoint {
            generation: self.generation,
            writer: self.writer,
            global_step: position.global_step,
            epoch: u64::from(position.epoch),
            meta: serde_json::to_value(meta).map_err(|e| e.to_string())?,
            blobs,
        };
        let (store, runtime, keep) = (self.store.clone(), Arc::clone(&self.runtime), self.keep);
        let handle = std::thread::Builder::new()
            .name("trainerd-commit".into())
            .spawn(move || {
                lower_priority();
                runtime.block_on(store.commit(&checkpoint, keep))
            })
            .map_err(|e| e.to_string())?;
        self.failures_before = self.store.transient_failures();
        self.in_flight = Some(((position.global_step, u64::from(position.epoch)), Instant::now(), handle));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_copies_round_trip() {
        let t = Tensor::arange(12, (Kind::Float, Device::Cpu)).view([3, 4]);
        let d = host_copy("t", &t).unwrap();
        assert_eq!((d.dtype, d.shape.clone(), d.data.len()), (Dtype::F32, vec![3, 4], 48));
        let back = to_tensor(&d).unwrap();
        assert_eq!(back, t);
        let mut dst = vec![("t".to_string(), Tensor::zeros([3, 4], (Kind::Float, Device::Cpu)))];
        copy_into(&mut dst, std::slice::from_ref(&d), "the checkpoint's model").unwrap();
        assert_eq!(dst[0].1, t);
        let mut wrong = vec![("t".to_string(), Tensor::zeros([4], (Kind::Float, Device::Cpu)))];
        assert_eq!(
            copy_into(&mut wrong, &[d], "the checkpoint's model").unwrap_err(),
            "the checkpoint's model tensor t has shape [3, 4], the model's has [4]"
        );
    }

    #[test]
    fn step_seeds_differ_and_repeat() {
        assert_eq!(step_seed(1, 5), step_seed(1, 5));
        assert_ne!(step_seed(1, 5), step_seed(1, 6));
        assert_ne!(step_seed(1, 5), step_seed(2, 5));
        assert_eq!(replica_seed(1, 5, 0), step_seed(1, 5));
        assert_ne!(replica_seed(1, 5, 1), replica_seed(1, 5, 0));
        assert_eq!(replica_seed(1, 5, 1), replica_seed(1, 5, 1));
    }
}
