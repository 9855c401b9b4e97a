//! Data order and sharding for input pipelines over in-memory tensors.
//!
//! The order of an epoch is a permutation derived from `(seed, epoch)` alone (ChaCha8 and a
//! hand-written Fisher–Yates, so that no dependency upgrade can change it), identical on every
//! worker. Sharding follows TensorFlow's auto-shard by data: step `s` of the epoch covers global
//! positions `s*G .. (s+1)*G` of the permutation (`G` the global batch), and pipeline `i` takes
//! the `i`-th slice of `per_replica_batch_size` of them. So `N` workers with batch `b` see
//! exactly the batches one worker with batch `N*b` would, split in `N`.
//!
//! Training drops the last partial global batch (every step has the same shape on every
//! worker); evaluation keeps every example once, in order, and a pipeline's last batch may be
//! short or empty.

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::Tensor;

use crate::abi::InputContext;
use crate::batch::Batch;
use crate::error::PluginError;
use crate::model::Pipeline;

/// The order of `n` examples in `epoch` of a run seeded with `seed`.
pub fn epoch_permutation(n: usize, seed: u64, epoch: u64) -> Vec<i64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(epoch);
    let mut order: Vec<i64> = (0..n as i64).collect();
    for i in (1..n).rev() {
        let j = below(&mut rng, i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

/// A uniform integer in `0..bound` without modulo bias (Lemire's method).
fn below(rng: &mut ChaCha8Rng, bound: u64) -> u64 {
    let threshold = bound.wrapping_neg() % bound;
    loop {
        let m = u128::from(rng.next_u64()) * u128::from(bound);
        if (m as u64) >= threshold {
            return (m >> 64) as u64;
        }
    }
}

/// The example indices of each batch this pipeline yields over `n` examples.
pub fn shard_plan(n: usize, ctx: &InputContext) -> Vec<Vec<i64>> {
    let global = ctx.global_batch_size() as usize;
    let local = ctx.per_replica_batch_size as usize;
    let offset = ctx.input_pipeline_id as usize * local;
    if global == 0 {
        return Vec::new();
    }
    if ctx.training {
        let order = epoch_permutation(n, ctx.seed, ctx.epoch);
        (0..n / global).map(|s| order[s * global + offset..s * global + offset + local].to_vec()).collect()
    } else {
        (0..n.div_ceil(global))
            .map(|s| {
                let start = (s * global + offset).min(n);
                let end = (start + local).min(n);
                (start as i64..end as i64).collect()
            })
            .collect()
    }
}

/// An input pipeline over in-memory `inputs` and `labels` (first dimension = examples): batches
/// of two columns, `input` and [`crate::LABEL`].
pub fn sharded_batches(inputs: &Tensor, labels: &Tensor, ctx: &InputContext) -> Result<Pipeline, PluginError> {
    sharded_map((inputs, labels), ctx, ("input", Ok))
}

/// As [`sharded_batches`], the input column named `name` and `prepare` applied to each batch's
/// inputs as it is drawn (u8 pixels to floats, say), so that a dataset stays compact in memory and
/// loads fast: a restarted worker reloads it on its way back into the run.
pub fn sharded_map(
    (inputs, labels): (&Tensor, &Tensor),
    ctx: &InputContext,
    (name, prepare): (&'static str, impl Fn(Tensor) -> Result<Tensor, tch::TchError> + Send + 'static),
) -> Result<Pipeline, PluginError> {
    let n = inputs.size().first().copied().unwrap_or(0);
    let n_labels = labels.size().first().copied().unwrap_or(0);
    if n != n_labels {
        return Err(PluginError::Other(format!("{n} inputs but {n_labels} labels")));
    }
    let plan = shard_plan(n as usize, ctx);
    let (inputs, labels) = (inputs.shallow_clone(), labels.shallow_clone());
    Ok(Pipeline {
        steps: plan.len() as u64,
        first_step: ctx.first_step,
        batches: Box::new(plan.into_iter().skip(ctx.first_step as usize).map(move |idx| {
            let idx = Tensor::from_slice(&idx);
            Ok(Batch::new()
                .with(name, prepare(inputs.f_index_select(0, &idx)?)?)
                .with(crate::LABEL, labels.f_index_select(0, &idx)?))
        })),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ctx(workers: u32, id: u32, batch: u32, training: bool) -> InputContext {
        InputContext {
            num_input_pipelines: workers,
            input_pipeline_id: id,
            per_replica_batch_size: batch,
            training,
            epoch: 3,
            seed: 42,
            first_step: 0,
        }
    }

    #[test]
    fn permutation_is_fixed_by_seed_and_epoch() {
        let a = epoch_permutation(1000, 7, 2);
        assert_eq!(a, epoch_permutation(1000, 7, 2));
        assert_ne!(a, epoch_permutation(1000, 7, 3));
        assert_ne!(a, epoch_permutation(1000, 8, 2));
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
        // Pinned: a change here silently changes every run's data order.
        assert_eq!(epoch_permutation(10, 0, 0), [6, 1, 8, 3, 2, 9, 0, 5, 4, 7]);
    }

    proptest! {
        /// N pipelines with batch b yield, step by step, exactly one pipeline's batch N*b.
        #[test]
        fn shards_concatenate_to_the_single_worker_batch(n in 0usize..300, workers in 1u32..6, batch in 1u32..9) {
            let single = shard_plan(n, &ctx(1, 0, batch * workers, true));
            let shards: Vec<_> = (0..workers).map(|i| shard_plan(n, &ctx(workers, i, batch, true))).collect();
            for plan in &shards {
                prop_assert_eq!(plan.len(), single.len());
            }
            for (s, whole) in single.iter().enumerate() {
                let joined: Vec<i64> = shards.iter().flat_map(|p| p[s].clone()).collect();
                prop_assert_eq!(&joined, whole);
            }
        }

        /// Evaluation covers every example exactly once and every pipeline takes as many steps.
        #[test]
        fn evaluation_covers_every_example_once(n in 0usize..300, workers in 1u32..6, batch in 1u32..9) {
            let plans: Vec<_> = (0..workers).map(|i| shard_plan(n, &ctx(workers, i, batch, false))).collect();
            let steps = plans[0].len();
            prop_assert!(plans.iter().all(|p| p.len() == steps));
            let mut all: Vec<i64> = plans.into_iter().flatten().flatten().collect();
            all.sort();
            prop_assert_eq!(all, (0..n as i64).collect::<Vec<_>>());
        }
    }

    #[test]
    fn sharded_batches_select_rows() {
        let x = Tensor::arange(12, (tch::Kind::Float, tch::Device::Cpu)).view([6, 2]);
        let y = Tensor::arange(6, (tch::Kind::Int64, tch::Device::Cpu));
        let p = sharded_batches(&x, &y, &ctx(2, 1, 2, false)).unwrap();
        assert_eq!(p.steps, 2);
        let batches: Vec<_> = p.batches.map(Result::unwrap).collect();
        assert_eq!(Vec::<i64>::try_from(batches[0].label().unwrap()).unwrap(), [2, 3]);
        assert_eq!(Vec::<f32>::try_from(batches[0].input().unwrap().flatten(0, -1)).unwrap(), [4., 5., 6., 7.]);
        assert_eq!(batches[1].examples(), 0);
    }

    /// A pipeline opened at a step yields what the epoch's pipeline yields from there, and
    /// counts the whole epoch's steps.
    #[test]
    fn a_pipeline_opens_at_its_first_step() {
        let x = Tensor::arange(40, (tch::Kind::Float, tch::Device::Cpu)).view([20, 2]);
        let y = Tensor::arange(20, (tch::Kind::Int64, tch::Device::Cpu));
        let labels = |first_step| {
            let p = sharded_batches(&x, &y, &InputContext { first_step, ..ctx(2, 1, 3, true) }).unwrap();
            (
                p.steps,
                p.first_step,
                p.batches.map(|b| Vec::<i64>::try_from(b.unwrap().label().unwrap()).unwrap()).collect::<Vec<_>>(),
            )
        };
        let (steps, _, all) = labels(0);
        assert_eq!(steps, 3);
        assert_eq!(labels(2), (3, 2, all[2..].to_vec()));
        assert_eq!(labels(3), (3, 3, Vec::new()));
    }
}
