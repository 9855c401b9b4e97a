//! What the workers of a job must agree on, in one place for training and evaluation: the run
//! configuration every member's admission compares, and (for training) every commit records
//! and a resume checks ([`crate::state::Meta`]). The keys a job may differ in without changing
//! the math (how slots are spread over processes) are the state's to leave out on resume.
//!
//! Keys enter only when they are used, so that the configuration of a run without a feature,
//! and of every checkpoint made before it existed, stays as it was.

use serde_json::json;

use super::config::RunConfig;
use super::jobs::{EvalConfig, PredictConfig};
use crate::state::{
    ACCUMULATE_KEY, GPU_KEY, PLUGIN_KEY, REPLICAS_KEY, REPLICA_CHECK_KEY, SCHEDULE_VERSION_KEY, SHARD_KEY,
};

/// A job whose workers must agree.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Job<'a> {
    /// A training run.
    Training(&'a RunConfig),
    /// An evaluation of a commit.
    Evaluation(&'a EvalConfig),
    /// A prediction of a split by a commit.
    Prediction(&'a PredictConfig),
}

/// What every worker of `job` must agree on, as canonical JSON.
pub(crate) fn agreement(job: Job<'_>) -> String {
    let (data, plugin, precision, device, threads, batch_size) = match job {
        Job::Training(c) => (&c.data, &c.plugin, c.precision, c.device, c.threads, c.batch_size),
        Job::Evaluation(c) | Job::Prediction(PredictConfig { eval: c, .. }) => {
            (&c.data, &c.plugin, c.precision, c.device, c.threads, c.batch_size)
        }
    };
    // Bitwise agreement needs the same kind of device and the same thread count.
    let mut agreement = json!({
        "batch_size": batch_size,
        "device": if device.is_cuda() { "cuda" } else { "cpu" },
        "threads": threads,
    });
    // Only a columnar dataset adds its identity (a plugin's own format is the plugin's).
    if let Some(data) = data.agreement() {
        agreement["data"] = data;
    }
    // Only a plugin that takes arguments or states an identity adds them.
    if let Some(plugin) = plugin {
        agreement[PLUGIN_KEY] = plugin.clone();
    }
    if let Some(precision) = precision.agreement() {
        agreement["precision"] = precision.into();
    }
    match job {
        Job::Training(c) => training(c, &mut agreement),
        Job::Evaluation(c) => {
            agreement["evaluate"] = c.location.to_string().into();
            agreement["sequence"] = json!(c.sequence);
        }
        Job::Prediction(p) => {
            agreement["predict"] = p.eval.location.to_string().into();
            agreement["sequence"] = json!(p.eval.sequence);
            agreement["split"] = json!(p.split);
        }
    }
    agreement.to_string()
}

/// The keys of a training run.
fn training(c: &RunConfig, agreement: &mut serde_json::Value) {
    agreement["epochs"] = c.epochs.into();
    agreement["optimizer"] = json!(c.optimizer);
    agreement["schedule"] = json!(c.schedule);
    if let Some(warmup) = c.warmup {
        agreement["warmup"] = json!(warmup);
    }
    // A moving rate is a formula: every worker must compute the same.
    if c.schedule != trainerd_sdk::LrSchedule::Constant || c.warmup.is_some() {
        agreement[SCHEDULE_VERSION_KEY] = crate::optim::schedule::FORMULAS.into();
    }
    agreement["seed"] = c.seed.into();
    agreement["steps_per_epoch"] = json!(c.steps_per_epoch);
    agreement["bucket_bytes"] = c.bucket_bytes.into();
    // Every backend gives the ring's bits, but workers must use one backend, and one version of it.
    if let Some(collective) = c.collective.agreement() {
        agreement["collective"] = collective.into();
    }
    // The run's slots are the workers times the replicas each times the micro-batches each
    // accumulates: every worker must have as many. (A checkpoint's worker count is its slot
    // count, so these keys are not compared on resume.)
    if c.devices.len() > 1 {
        agreement[REPLICAS_KEY] = c.devices.len().into();
    }
    if c.accumulate > 1 {
        agreement[ACCUMULATE_KEY] = c.accumulate.into();
    }
    // Every worker shards alike (the step's collectives differ); a commit holds the whole state
    // either way, so a resume does not compare it.
    if c.shard_optimizer {
        agreement[SHARD_KEY] = true.into();
    }
    if !c.clip.is_off() {
        agreement["clip"] = serde_json::to_value(c.clip).expect("plain numbers");
    }
    if !c.callbacks.is_empty() {
        agreement["callbacks"] = serde_json::to_value(&c.callbacks).expect("plain values");
    }
    // An evaluation is a collective: every worker takes it or none does.
    if !c.evaluate {
        agreement["evaluate"] = false.into();
    }
    // On CUDA the bits are the GPU model's (cuBLAS and cuDNN pick kernels by its architecture).
    if !c.gpus.is_empty() {
        agreement[GPU_KEY] = json!(c.gpus);
    }
    // So is the replicas' comparison, which falls on these steps (and on every member's commit
    // steps, exchanged as each generation forms); not compared on resume: it does not change
    // the math.
    agreement[REPLICA_CHECK_KEY] = json!({"every": c.replica_check_every});
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{Network, Timeouts};
    use crate::input::DataSource;
    use tch::Device;
    use trainerd_sdk::{LrSchedule, OptimizerConfig};

    fn data() -> DataSource {
        DataSource::Plugin("/data".into(), true)
    }

    /// A plain run's configuration is what checkpoints have recorded from the first on: a resume
    /// compares it, so it must not change.
    #[test]
    fn a_plain_runs_configuration_is_the_one_checkpoints_recorded() {
        let cfg = RunConfig::plain(data(), 64, Device::Cpu);
        let a: serde_json::Value = serde_json::from_str(&agreement(Job::Training(&cfg))).unwrap();
        let expected = json!({
            "batch_size": 64,
            "bucket_bytes": crate::collective::buckets::DEFAULT_BUCKET_BYTES,
            "device": "cpu",
            "epochs": 2,
            "optimizer": OptimizerConfig::adam(1e-3),
            "schedule": LrSchedule::Constant,
            "seed": 3,
            "steps_per_epoch": null,
            "threads": 1,
            // Added after checkpoints existed; a resume does not compare it.
            REPLICA_CHECK_KEY: {"every": 100},
        });
        assert_eq!(a, expected);
    }

    #[test]
    fn an_evaluation_agrees_on_the_shared_keys_and_its_commit() {
        let cfg = EvalConfig {
            data: data(),
            plugin: None,
            precision: Default::default(),
            location: "/ckpt".parse().unwrap(),
            s3: Default::default(),
            sequence: Some(7),
            batch_size: 64,
            device: Device::Cpu,
            threads: 1,
            cluster: None,
            network: Network::loopback(),
            timeouts: Timeouts::default(),
        };
        let a: serde_json::Value = serde_json::from_str(&agreement(Job::Evaluation(&cfg))).unwrap();
        let expected = json!({"batch_size": 64, "device": "cpu", "evaluate": "/ckpt", "sequence": 7, "threads": 1});
        assert_eq!(a, expected);
    }
}
