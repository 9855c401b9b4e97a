//! The optimizer state of the element ranges one member owns (`--shard-optimizer`, ZeRO stage
//! 1; docs/fault-tolerance.md, "Sharded optimizer state"), and their update.
//!
//! A range is a span of a gradient bucket; its *pieces* are the parameters' element spans in it,
//! in parameter order. Each owned range keeps its state as flat float32 arrays over its
//! gradient elements, and is updated by the same element-wise loops as the unsharded optimizer
//! ([`super::elementwise`]), so the owned ranges together end bit for bit where the whole
//! model's update does.

use tch::Tensor;
use trainerd_sdk::OptimizerConfig;

use super::elementwise::{Rule, Write};
use super::optimizer::{self, Optimizer};

/// A parameter's element span inside a range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    /// The parameter's place in the optimizer's list.
    pub(crate) param: usize,
    /// The span's first element within the parameter (flattened).
    pub(crate) offset: usize,
    /// Its first element within the range's gradient elements.
    pub(crate) at: usize,
    /// Its length.
    pub(crate) len: usize,
}

/// One owned range: its pieces and its state.
#[derive(Debug)]
struct Shard {
    /// The range's place among every range of the run, in (bucket, range) order.
    index: usize,
    pieces: Vec<Piece>,
    /// One array per state tensor of the rule (`Rule::state_len`), over the range's gradient
    /// elements.
    state: Vec<Vec<f32>>,
}

/// The state of the ranges this member owns.
#[derive(Debug)]
pub(crate) struct ShardedOptimizer {
    config: OptimizerConfig,
    /// The state tensors' names, per parameter, in the order of the rule's state arrays.
    slot_names: Vec<&'static str>,
    /// Each parameter's weight decay (its group's).
    decay: Vec<f64>,
    shards: Vec<Shard>,
    /// Per parameter: whether it has had a gradient (SGD makes its momentum buffer then).
    started: Vec<bool>,
    steps: u64,
}

/// The state names of `config`'s rule, in the rule's order (as [`Optimizer::state`] names them).
fn slot_names(config: &OptimizerConfig) -> Vec<&'static str> {
    match *config {
        OptimizerConfig::Sgd { momentum, .. } => {
            if momentum != 0.0 {
                vec!["momentum_buffer"]
            } else {
                vec![]
            }
        }
        OptimizerConfig::Adam { .. } | OptimizerConfig::Adamw { .. } => vec!["exp_avg", "exp_avg_sq"],
        OptimizerConfig::Rmsprop { momentum, centered, .. } => {
            let mut names = vec!["square_avg"];
            if momentum > 0.0 {
                names.push("momentum_buffer");
            }
            if centered {
                names.push("grad_avg");
            }
            names
        }
    }
}

impl ShardedOptimizer {
    /// Zero state for the ranges `owned` (each its index among the run's ranges and its pieces)
    /// of `params`.
    pub(crate) fn new(config: OptimizerConfig, params: &[(String, Tensor)], owned: &[(usize, Vec<Piece>)]) -> Self {
        let slot_names = slot_names(&config);
        let shards = owned
            .iter()
            .map(|(index, pieces)| {
                let len = pieces.iter().map(|p| p.len).sum();
                Shard { index: *index, pieces: pieces.clone(), state: vec![vec![0.0; len]; slot_names.len()] }
            })
            .collect();
        let decay = optimizer::weight_decays(&config, params);
        ShardedOptimizer { config, slot_names, decay, shards, started: vec![false; params.len()], steps: 0 }
    }

    /// The shard of `full`'s state (an unsharded optimizer's, of the same parameters): what a
    /// member owning `owned` holds after the same steps.
    pub(crate) fn of(full: &Optimizer, params: &[(String, Tensor)], owned: &[(usize, Vec<Piece>)]) -> Self {
        let mut sharded = ShardedOptimizer::new(full.config().clone(), params, owned);
        let state: std::collections::HashMap<String, Tensor> = full.state().into_iter().collect();
        let find =
            |param: usize, slot: &str| state.get(&format!("{}/{slot}", params[param].0)).map(Tensor::shallow_clone);
        if let OptimizerConfig::Sgd { momentum, .. } = *full.config() {
            for (i, started) in sharded.started.iter_mut().enumerate() {
                *started = momentum != 0.0 && find(i, "momentum_buffer").is_some();
            }
        }
        for shard in &mut sharded.shards {
            for (k, slot) in sharded.slot_names.iter().enumerate() {
                for piece in &shard.pieces {
                    let Some(t) = find(piece.param, slot) else { continue };
                    let values = Vec::<f32>::try_from(t.to_kind(tch::Kind::Float).view(-1).narrow(
                        0,
                        piece.offset as i64,
                        piece.len as i64,
                    ))
                    .expect("float32 state");
                    shard.state[k][piece.at..piece.at + piece.len].copy_from_slice(&values);
                }
            }
        }
        sharded.steps = full.steps();
        sharded
    }

    /// The optimizer's settings.
    pub(crate) fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    /// Steps taken.
    pub(crate) fn steps(&self) -> u64 {
        self.steps
    }

    /// The owned ranges' indices among the run's ranges, in order.
    pub(crate) fn owned(&self) -> Vec<usize> {
        self.shards.iter().map(|s| s.index).collect()
    }

    /// Bytes of optimizer state this member holds.
    pub(crate) fn state_bytes(&self) -> u64 {
        self.shards.iter().flat_map(|s| &s.state).map(|a| a.len() as u64 * 4).sum()
    }

    /// Every owned piece's state, as (state name, piece, values): how a whole state is put
    /// together from every member's.
    #[cfg(test)]
    pub(crate) fn pieces(&self) -> Vec<(&'static str, &Piece, &[f32])> {
        let mut out = Vec::new();
        for shard in &self.shards {
            for (k, slot) in self.slot_names.iter().enumerate() {
                for piece in &shard.pieces {
                    if !self.has(piece.param, slot) {
                        continue; // made at the first gradient: none yet
                    }
                    out.push((*slot, piece, &shard.state[k][piece.at..piece.at + piece.len]));
                }
            }
        }
        out
    }

    /// The state tensors' names, in the order of the rule's state arrays.
    pub(crate) fn slot_names(&self) -> &[&'static str] {
        &self.slot_names
    }

    /// Whether parameter `param` has state `slot` (SGD makes its momentum buffer at its first
    /// gradient).
    pub(crate) fn has(&self, param: usize, slot: &str) -> bool {
        !(slot == "momentum_buffer" && matches!(self.config, OptimizerConfig::Sgd { .. }) && !self.started[param])
    }

    /// Owned range `shard`'s values of state array `k` (over its gradient elements).
    pub(crate) fn values(&self, shard: usize, k: usize) -> &[f32] {
        &self.shards[shard].state[k]
    }

    /// [`ShardedOptimizer::values`], to be written (a range's state moved here from its holder).
    pub(crate) fn values_mut(&mut self, shard: usize, k: usize) -> &mut [f32] {
        &mut self.shards[shard].state[k]
    }

    /// What every member's optimizer has alike: the steps taken, and per parameter whether it
    /// has started (had a gradient).
    pub(crate) fn replicated(&self) -> (u64, &[bool]) {
        (self.steps, &self.started)
    }

    /// Takes [`ShardedOptimizer::replicated`]'s values from another member's.
    pub(crate) fn set_replicated(&mut self, steps: u64, started: &[bool]) {
        self.steps = steps;
        self.started.copy_from_slice(started);
    }

    /// Counts the step about to be updated (its rules use the new count).
    pub(crate) fn begin_step(&mut self) {
        self.steps += 1;
    }

    /// After both passes of every owned range: the parameters that had a gradient (`used`) have
    /// started (SGD's momentum buffer exists from now on).
    pub(crate) fn end_step(&mut self, used: &[bool]) {
        self.started.iter_mut().zip(used).for_each(|(s, &u)| *s |= u);
    }

    /// One pass of the update of owned range `shard` (its place among this member's ranges, as
    /// [`ShardedOptimizer::owned`] lists them) at rate `lr`: `grads` its (clipped, averaged)
    /// gradient elements, `param` each piece's current values, `used` per parameter whether any
    /// slot had a gradient for it. The new parameters go into `out` (the range's elements in the
    /// buffer the all-gather carries; a piece of an unused parameter gets its current values);
    /// what is stored follows `write` ([`Write::Params`] first, then [`Write::State`] once the
    /// step completed).
    pub(crate) fn update(
        &mut self,
        shard: usize,
        (grads, out): (&[f32], Option<&mut [f32]>),
        param: &dyn Fn(&Piece) -> Vec<f32>,
        used: &[bool],
        (lr, write): (f64, Write),
    ) {
        let shard = &mut self.shards[shard];
        let mut out = out;
        for piece in &shard.pieces {
            let span = piece.at..piece.at + piece.len;
            let mut values = param(piece);
            if !used[piece.param] {
                if let Some(out) = out.as_deref_mut() {
                    out[span].copy_from_slice(&values);
                }
                continue;
            }
            let rule: Rule = optimizer::rule(&self.config, (self.decay[piece.param], lr), self.steps);
            let first = !self.started[piece.param];
            let mut state: Vec<&mut [f32]> = shard.state.iter_mut().map(|a| &mut a[span.clone()]).collect();
            let target = out.as_deref_mut().map(|o| &mut o[span.clone()]);
            rule.apply((&mut values, target), &grads[span.clone()], &mut state, first, write);
        }
    }
}
