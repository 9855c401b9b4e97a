//! What a worker's model state holds, by kind (README, "What each worker holds"): the start's
//! line, worked out from the parameters' size, the optimizer's rule and the `--shard` level, and
//! the summary's figures, measured, at their peak. It moves no memory.

use serde::Serialize;
use tch::Tensor;

use crate::collective::buckets::{bytes_of, Buckets, KEPT_PER_SLOT};
use crate::optim::sharded_state::slot_names;
use crate::state::{Optim, TrainState};
use crate::train::config::RunConfig;

/// With `--shard gradients`, the most buckets a worker holding one slot holds whole at once:
/// those handed to the reducing thread and not yet let go (`collective/overlap.rs`,
/// `IN_FLIGHT`), and the one the staging or the all-gather fills; their buffers are kept from
/// step to step (`collective/buckets/pool.rs`).
const WHOLE_BUCKETS: u64 = KEPT_PER_SLOT as u64;

/// What a worker's model state holds, by kind, in bytes, at its peak.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub(crate) struct Memory {
    /// The parameters (one replica's), whole at every `--shard` level so far; with
    /// `--shard gradients`, plus the copy of the held ranges' parameters the step keeps while it
    /// gathers them (what a torn all-gather is put back from).
    pub(crate) parameter_bytes: u64,
    /// The gradients and their buckets at their peak in a step: whole (their buckets, and the
    /// gradients of another slot held); with `--shard gradients`, the gradients of the buckets
    /// not yet staged, the buckets in flight, and the ranges kept (owned and buddy ranges).
    pub(crate) gradient_bytes: u64,
    /// The optimizer state of the ranges this member owns (all of it, unsharded).
    pub(crate) optimizer_state_bytes: u64,
    /// Its buddy copies of another member's ranges' state (sharded).
    pub(crate) buddy_state_bytes: u64,
}

impl Memory {
    /// What this worker's model state held at its peak (`buckets`: the step's gradients';
    /// `shard_gradients`: whether the step kept a copy of the held ranges' parameters).
    pub(crate) fn of(state: &TrainState, buckets: &Buckets, shard_gradients: bool) -> Memory {
        let params: u64 = state.model.params.iter().map(|(_, p)| bytes_of(p)).sum();
        let (optimizer_state_bytes, buddy_state_bytes) = state.optimizer.state_bytes_apart();
        let copied = match &state.optimizer {
            Optim::Sharded(o) if shard_gradients => o.held_param_bytes(),
            _ => 0,
        };
        Memory {
            parameter_bytes: params + copied,
            gradient_bytes: buckets.gauge().peak(),
            optimizer_state_bytes,
            buddy_state_bytes,
        }
    }
}

/// The start's line of what each of `workers` workers' model state holds, for `params` trained
/// as `cfg` says (sharded when `cfg` shards and there are several: a worker's ranges are 1/W of
/// the whole, whatever slots it holds, and its buddy copies the previous worker's).
pub(crate) fn plan(cfg: &RunConfig, params: &[(String, Tensor)], workers: usize) -> String {
    let p: u64 = params.iter().map(|(_, t)| (t.numel() * 4) as u64).sum();
    let k = slot_names(&cfg.optimizer).len() as u64;
    let mb = |bytes: u64| format!("{:.1} MB", bytes as f64 / 1e6);
    let v = workers as u64;
    let sharded = cfg.shard_optimizer && v > 1;
    // A member's ranges and its buddy copy of its predecessor's: 2/V of the whole (all of it
    // with 2).
    let held = |whole: u64| whole * 2.min(v) / v;
    let state = match (sharded, k) {
        (_, 0) => "no optimizer state (the rule keeps none)".to_string(),
        (false, _) => format!("the optimizer state whole ({}, {k} value(s) a parameter)", mb(k * p)),
        (true, _) => format!(
            "the optimizer state of its ranges and a buddy copy of its predecessor's ({} and {})",
            mb(k * p / v),
            mb(held(k * p) - k * p / v)
        ),
    };
    let gradients = match sharded && cfg.shard_gradients {
        false => format!("their gradients whole ({})", mb(p)),
        true => format!(
            "the gradients of its ranges and its predecessor's ({}), and to reduce and gather them at most \
             {WHOLE_BUCKETS} buckets' buffers, kept from step to step (at most {})",
            mb(held(p)),
            mb(p.min(WHOLE_BUCKETS * cfg.bucket_bytes as u64))
        ),
    };
    format!("trainerd: each worker holds the parameters whole ({}), {gradients}, and {state}", mb(p))
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind};

    use super::*;

    /// Adam, the level given, 25 MiB buckets.
    fn config(shard_optimizer: bool, shard_gradients: bool) -> RunConfig {
        let data = crate::input::DataSource::Plugin("/data".into(), true);
        RunConfig { shard_optimizer, shard_gradients, ..RunConfig::plain(data, 64, Device::Cpu) }
    }

    #[test]
    fn the_start_says_what_each_level_holds_with_adam_on_4_workers() {
        // 25 M float32 parameters: 100 MB.
        let params = vec![("w".to_string(), Tensor::zeros([25_000_000], (Kind::Float, Device::Cpu)))];
        assert_eq!(
            plan(&config(false, false), &params, 4),
            "trainerd: each worker holds the parameters whole (100.0 MB), their gradients whole (100.0 MB), and the \
             optimizer state whole (200.0 MB, 2 value(s) a parameter)"
        );
        assert_eq!(
            plan(&config(true, false), &params, 4),
            "trainerd: each worker holds the parameters whole (100.0 MB), their gradients whole (100.0 MB), and the \
             optimizer state of its ranges and a buddy copy of its predecessor's (50.0 MB and 50.0 MB)"
        );
        assert_eq!(
            plan(&config(true, true), &params, 4),
            "trainerd: each worker holds the parameters whole (100.0 MB), the gradients of its ranges and its \
             predecessor's (50.0 MB), and to reduce and gather them at most 3 buckets' buffers, kept from step to \
             step (at most 78.6 MB), and the optimizer state of its ranges and a buddy copy of its predecessor's (50.0 \
             MB and 50.0 MB)"
        );
        // Two workers: each holds every range, its own or a buddy copy.
        assert!(plan(&config(true, true), &params, 2).contains("(100.0 MB and 100.0 MB)"));
    }
}
