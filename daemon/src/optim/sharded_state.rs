//! The optimizer state of the element ranges one member owns (`--shard-optimizer`, ZeRO stage
//! 1; docs/fault-tolerance.md, "Sharded optimizer state"), and their update.
//!
//! A range is a span of a gradient bucket; its *pieces* are the parameters' element spans in it,
//! in parameter order. Each owned range keeps its state as flat float32 arrays over its
//! gradient elements, and is updated by the same element-wise loops as the unsharded optimizer
//! ([`super::elementwise`]), so the owned ranges together end bit for bit where the whole
//! model's update does.

use std::borrow::Cow;
use std::ops::Range;

use tch::Tensor;
use trainerd_sdk::OptimizerConfig;

use super::elementwise::Rule;
use super::lanes::{ReadInto, Write};
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

/// Where a piece's current parameter values come from.
/// Borrowed where they lie (a float32 host parameter), else copied.
pub(crate) type Values<'a, 'v> = &'a dyn Fn(&Piece) -> Cow<'v, [f32]>;

/// One held range (owned, or a buddy copy): its pieces and its state.
#[derive(Debug)]
struct Shard {
    /// The range's place among every range of the run, in (bucket, range) order.
    index: usize,
    pieces: Vec<Piece>,
    /// One array per state tensor of the rule (`Rule::state_len`), over the range's gradient
    /// elements.
    state: Vec<Vec<f32>>,
}

/// The ranges a member holds the state of, each its index among the run's ranges and its
/// pieces: those it owns (updates and gathers), and those it keeps a buddy copy of (its
/// predecessor's in ring order, updated alike so that they survive their owner).
pub(crate) type Held<'a> = (&'a [(usize, Vec<Piece>)], &'a [(usize, Vec<Piece>)]);

/// The state of the ranges this member owns, then of those it keeps for its predecessor.
#[derive(Debug)]
pub(crate) struct ShardedOptimizer {
    config: OptimizerConfig,
    /// How many of `shards` (the first) this member owns; the rest are buddy copies.
    own: usize,
    /// The state tensors' names, per parameter, in the order of the rule's state arrays.
    slot_names: Vec<&'static str>,
    /// Each parameter's weight decay (its group's).
    decay: Vec<f64>,
    shards: Vec<Shard>,
    /// Per parameter: whether it has had a gradient (SGD makes its momentum buffer then).
    started: Vec<bool>,
    steps: u64,
    /// The step after `steps` when its collectives failed between this member's update of its
    /// ranges and the storing of their state: what storing it needs, should another member
    /// have completed it (docs/fault-tolerance.md, "A step that fails partway").
    pending: Option<Pending>,
}

/// A step cut short after the update was computed and before any state was stored.
#[derive(Debug)]
struct Pending {
    /// Per held range (in [`ShardedOptimizer::held`]'s order), its clipped gradient; a buddy
    /// copy's is missing when the shift that brings it did not complete.
    grads: Vec<Option<Vec<f32>>>,
    /// Each held piece's parameter values before the update, by (parameter, offset).
    params: std::collections::HashMap<(usize, usize), Vec<f32>>,
    /// Per parameter, whether any slot had a gradient for it.
    used: Vec<bool>,
    lr: f64,
    /// Buckets of the parameters written with the step's values before the failure (`--shard
    /// gradients` writes each as it is gathered): they are torn until put back.
    written: usize,
}

/// Each held piece's parameter values before a step, by (parameter, offset).
pub(crate) type Before = std::collections::HashMap<(usize, usize), Vec<f32>>;

/// The state names of `config`'s rule, in the rule's order (as [`Optimizer::state`] names them).
pub(crate) fn slot_names(config: &OptimizerConfig) -> Vec<&'static str> {
    use trainerd_sdk::KerasRule;
    let (momentum, centered) = match *config {
        OptimizerConfig::Sgd { momentum, .. } => return sgd_slots(momentum),
        OptimizerConfig::Adam { .. } | OptimizerConfig::Adamw { .. } => return vec!["exp_avg", "exp_avg_sq"],
        OptimizerConfig::Keras(ref k) => match k.rule {
            KerasRule::Sgd { momentum, .. } => return sgd_slots(momentum),
            KerasRule::Adam { .. } | KerasRule::Adamw { .. } => return vec!["exp_avg", "exp_avg_sq"],
            KerasRule::Rmsprop { momentum, centered, .. } => (momentum, centered),
        },
        OptimizerConfig::Rmsprop { momentum, centered, .. } => (momentum, centered),
    };
    let mut names = vec!["square_avg"];
    if momentum > 0.0 {
        names.push("momentum_buffer");
    }
    if centered {
        names.push("grad_avg");
    }
    names
}

/// SGD's state names (PyTorch's rule or Keras's).
fn sgd_slots(momentum: f64) -> Vec<&'static str> {
    if momentum != 0.0 {
        vec!["momentum_buffer"]
    } else {
        vec![]
    }
}

impl ShardedOptimizer {
    /// Zero state for the ranges `held` (owned, then buddy copies) of `params`.
    pub(crate) fn new(config: OptimizerConfig, params: &[(String, Tensor)], (owned, buddied): Held) -> Self {
        let slot_names = slot_names(&config);
        let shards = owned
            .iter()
            .chain(buddied)
            .map(|(index, pieces)| {
                let len = pieces.iter().map(|p| p.len).sum();
                Shard { index: *index, pieces: pieces.clone(), state: vec![vec![0.0; len]; slot_names.len()] }
            })
            .collect();
        let decay = optimizer::weight_decays(&config, params);
        let started = vec![false; params.len()];
        ShardedOptimizer { config, own: owned.len(), slot_names, decay, shards, started, steps: 0, pending: None }
    }

    /// The shards of `full`'s state (an unsharded optimizer's, of the same parameters): what a
    /// member holding `held` holds after the same steps.
    pub(crate) fn of(full: &Optimizer, params: &[(String, Tensor)], held: Held) -> Self {
        let state: std::collections::HashMap<String, Tensor> = full.state().into_iter().collect();
        let read = |wants: &[(String, Range<usize>)]| -> Result<Vec<Vec<f32>>, std::convert::Infallible> {
            let values = |(name, r): &(String, Range<usize>)| {
                let flat = state[name].to_kind(tch::Kind::Float).view(-1);
                Vec::<f32>::try_from(flat.narrow(0, r.start as i64, r.len() as i64)).expect("float32 state")
            };
            Ok(wants.iter().map(values).collect())
        };
        let config = (full.config().clone(), full.steps());
        ShardedOptimizer::from_ranges(config, params, held, &|name| state.contains_key(name), read)
            .unwrap_or_else(|never| match never {})
    }

    /// What a member holding `held` holds of a whole state of the same parameters after `steps`
    /// steps, taken by element range: `has` says whether the whole state has a tensor (named
    /// `<parameter>/<slot>`: SGD makes its momentum buffer at a parameter's first gradient), and
    /// `read` gives the float32 values of each (tensor, element range) asked, in order. So a whole
    /// optimizer ([`ShardedOptimizer::of`]) and a commit's state, which each member reads its own
    /// ranges of, are cut alike.
    pub(crate) fn from_ranges<E>(
        (config, steps): (OptimizerConfig, u64),
        params: &[(String, Tensor)],
        held: Held,
        has: &dyn Fn(&str) -> bool,
        read: impl FnOnce(&[(String, Range<usize>)]) -> Result<Vec<Vec<f32>>, E>,
    ) -> Result<Self, E> {
        let mut sharded = ShardedOptimizer::new(config, params, held);
        let name = |param: usize, slot: &str| format!("{}/{slot}", params[param].0);
        if let OptimizerConfig::Sgd { momentum, .. } = sharded.config {
            for (i, started) in sharded.started.iter_mut().enumerate() {
                *started = momentum != 0.0 && has(&name(i, "momentum_buffer"));
            }
        }
        // Each piece's values of each state array, asked at once (a commit's reader makes one
        // request per object), and where they go: (shard, array, first element).
        let (mut wants, mut places) = (Vec::new(), Vec::new());
        for (s, shard) in sharded.shards.iter().enumerate() {
            for (k, slot) in sharded.slot_names.iter().enumerate() {
                for piece in shard.pieces.iter().filter(|p| has(&name(p.param, slot))) {
                    wants.push((name(piece.param, slot), piece.offset..piece.offset + piece.len));
                    places.push((s, k, piece.at));
                }
            }
        }
        for ((s, k, at), values) in places.into_iter().zip(read(&wants)?) {
            sharded.shards[s].state[k][at..at + values.len()].copy_from_slice(&values);
        }
        sharded.steps = steps;
        Ok(sharded)
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
        self.shards[..self.own].iter().map(|s| s.index).collect()
    }

    /// The ranges this member keeps a buddy copy of, in order (their places among its shards
    /// follow the owned ones').
    pub(crate) fn buddied(&self) -> Vec<usize> {
        self.shards[self.own..].iter().map(|s| s.index).collect()
    }

    /// Every range whose state this member holds: owned, then buddy copies (the places
    /// [`ShardedOptimizer::values`] takes).
    pub(crate) fn held(&self) -> Vec<usize> {
        self.shards.iter().map(|s| s.index).collect()
    }

    /// Each held range's digest (xxh3-64 of its state arrays' bytes, in order), in
    /// [`ShardedOptimizer::held`]'s order: what an owner and its buddy compare.
    pub(crate) fn digests(&self) -> Vec<(usize, u64)> {
        let digest = |shard: &Shard| {
            let mut hasher = xxhash_rust::xxh3::Xxh3::new();
            shard.state.iter().for_each(|a| hasher.update(bytemuck::cast_slice(a)));
            hasher.digest()
        };
        self.shards.iter().map(|s| (s.index, digest(s))).collect()
    }

    /// Flips one bit of the first held range's first state value (a chaos test's failpoint
    /// `flip-state-bit`: faulty memory, on purpose); which, or `None` without state.
    pub(crate) fn flip_bit(&mut self) -> Option<String> {
        let shard = self.shards.first_mut()?;
        let x = shard.state.first_mut()?.first_mut()?;
        let before = *x;
        *x = f32::from_bits(before.to_bits() ^ (1 << 12));
        Some(format!("flipped bit 12 of range {}'s {}[0]: {before:e} is now {:e}", shard.index, self.slot_names[0], *x))
    }

    /// Bytes of optimizer state this member holds, buddy copies included.
    pub(crate) fn state_bytes(&self) -> u64 {
        let (own, buddy) = self.state_bytes_apart();
        own + buddy
    }

    /// Bytes of optimizer state this member holds: of the ranges it owns, and its buddy copies.
    pub(crate) fn state_bytes_apart(&self) -> (u64, u64) {
        let bytes = |shards: &[Shard]| shards.iter().flat_map(|s| &s.state).map(|a| a.len() as u64 * 4).sum();
        (bytes(&self.shards[..self.own]), bytes(&self.shards[self.own..]))
    }

    /// Bytes of the held pieces' parameters, as float32 (what [`ShardedOptimizer::params_before`]
    /// copies).
    pub(crate) fn held_param_bytes(&self) -> u64 {
        self.shards.iter().flat_map(|s| &s.pieces).map(|p| p.len as u64 * 4).sum()
    }

    /// The pieces of the ranges this member owns, in range order.
    pub(crate) fn owned_pieces(&self) -> impl Iterator<Item = &Piece> {
        self.shards[..self.own].iter().flat_map(|s| &s.pieces)
    }

    /// Every owned piece's state (`buddies`: every buddy copy's), as (state name, piece,
    /// values): how a whole state is put together from every member's (a sharded commit's
    /// parts).
    pub(crate) fn pieces(&self, buddies: bool) -> Vec<(&'static str, &Piece, &[f32])> {
        let mut out = Vec::new();
        let shards = if buddies { &self.shards[self.own..] } else { &self.shards[..self.own] };
        for shard in shards {
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

    /// Held range `shard`'s values (its place in [`ShardedOptimizer::held`]) of state array `k`
    /// (over its gradient elements).
    pub(crate) fn values(&self, shard: usize, k: usize) -> &[f32] {
        &self.shards[shard].state[k]
    }

    /// [`ShardedOptimizer::values`], to be written (a range's state moved here from its holder).
    pub(crate) fn values_mut(&mut self, shard: usize, k: usize) -> &mut [f32] {
        &mut self.shards[shard].state[k]
    }

    /// The state arrays of the held ranges at `shards` (places among
    /// [`ShardedOptimizer::held`], each listed once), shard by shard and each one's arrays in
    /// order: where a shift writes the ranges that move here.
    pub(crate) fn arrays_mut(&mut self, shards: &[usize]) -> Vec<&mut [f32]> {
        let mut places: Vec<Option<&mut Shard>> = self.shards.iter_mut().map(Some).collect();
        shards
            .iter()
            .flat_map(|&j| places[j].take().expect("each shard listed once").state.iter_mut().map(Vec::as_mut_slice))
            .collect()
    }

    /// The held range at `shard`'s state arrays, taken out (empty arrays left in their place):
    /// how a range this member keeps through a reshard moves to its next optimizer uncopied.
    pub(crate) fn take_arrays(&mut self, shard: usize) -> Vec<Vec<f32>> {
        let left = vec![Vec::new(); self.slot_names.len()];
        std::mem::replace(&mut self.shards[shard].state, left)
    }

    /// Puts `arrays` (another optimizer's [`ShardedOptimizer::take_arrays`] of the same range) as
    /// the held range at `shard`'s state.
    pub(crate) fn put_arrays(&mut self, shard: usize, arrays: Vec<Vec<f32>>) {
        let state = &mut self.shards[shard].state;
        assert!(
            arrays.len() == state.len() && arrays.iter().zip(state.iter()).all(|(a, b)| a.len() == b.len()),
            "the same range's arrays"
        );
        *state = arrays;
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
        self.pending = None;
    }

    /// A step whose collectives failed after [`ShardedOptimizer::begin_step`] and before any
    /// state was stored: uncounted (every held range stays at the step before), and what storing
    /// it would need kept, should another member have completed it: each held range's clipped
    /// gradient (`grads`, in [`ShardedOptimizer::held`]'s order; `None` for a buddy copy whose
    /// shift failed), each held piece's values before the update (`params`, as
    /// [`ShardedOptimizer::params_before`] copies them), and how many buckets of the parameters
    /// the step had `written` when it failed (`--shard gradients`: they are torn).
    pub(crate) fn cut_short(
        &mut self,
        (grads, params): (Vec<Option<Vec<f32>>>, Before),
        (used, lr): (&[bool], f64),
        written: usize,
    ) {
        self.steps -= 1;
        self.pending = Some(Pending { grads, params, used: used.to_vec(), lr, written });
    }

    /// A copy of each held piece's values in `param`.
    pub(crate) fn params_before(&self, param: Values) -> Before {
        self.shards.iter().flat_map(|s| &s.pieces).map(|p| ((p.param, p.offset), param(p).into_owned())).collect()
    }

    /// How many buckets of the parameters the step cut short here had written (0: none, or no
    /// step cut short), and the held pieces' values before it.
    pub(crate) fn written(&self) -> (usize, Option<&Before>) {
        self.pending.as_ref().map_or((0, None), |p| (p.written, Some(&p.params)))
    }

    /// Whether the step after this state's was cut short here with every held range's gradient
    /// kept: it can be completed ([`ShardedOptimizer::go_forward`]).
    pub(crate) fn can_go_forward(&self) -> bool {
        self.pending.as_ref().is_some_and(|p| p.grads.iter().all(Option::is_some))
    }

    /// Completes the step cut short here, as another member completed it: every held range's
    /// state stored from its kept gradient and parameters, the same arithmetic as the step's
    /// (so the same bits).
    pub(crate) fn go_forward(&mut self) {
        let Pending { grads, params, used, lr, .. } = self.pending.take().expect("a step cut short");
        let current = |piece: &Piece| Cow::Borrowed(&params[&(piece.param, piece.offset)][..]);
        let grads: Vec<&[f32]> = grads.iter().map(|g| g.as_deref().expect("every held range's gradient")).collect();
        self.store_step(&grads, &current, &used, lr);
    }

    /// One step of every held range stored from its clipped gradient (`grads`, in
    /// [`ShardedOptimizer::held`]'s order), `param` the parameters before the step, `used` and
    /// `lr` the step's: what the step's second pass stores on its owner and its buddy, the same
    /// arithmetic (a step gone forward, a returner's streamed ranges).
    pub(crate) fn store_step(&mut self, grads: &[&[f32]], param: Values, used: &[bool], lr: f64) {
        self.begin_step();
        for (shard, grads) in grads.iter().enumerate() {
            self.update(shard, (grads, None), param, used, (lr, Write::State));
        }
        self.end_step(used);
    }

    /// A returner's copy of ranges it will hold (docs/fault-tolerance.md, "Ranges streamed"):
    /// `held`, each with its state `arrays` (the rule's, in order) as its owner had them after
    /// `steps` steps, and the parameters' `started` flags; why not, when they do not fit.
    pub(crate) fn streamed(
        config: OptimizerConfig,
        params: &[(String, Tensor)],
        held: &[(usize, Vec<Piece>)],
        (arrays, steps, started): (Vec<Vec<Vec<f32>>>, u64, &[bool]),
    ) -> Result<Self, String> {
        let mut o = ShardedOptimizer::new(config, params, (held, &[]));
        if arrays.len() != held.len() || started.len() != params.len() {
            return Err(format!(
                "{} range(s) and {} started flag(s) came for {} range(s) and {} parameter(s)",
                arrays.len(),
                started.len(),
                held.len(),
                params.len()
            ));
        }
        for (shard, (index, a)) in o.shards.iter_mut().zip(held.iter().map(|(i, _)| i).zip(arrays)) {
            if a.len() != shard.state.len() || a.iter().zip(&shard.state).any(|(x, y)| x.len() != y.len()) {
                return Err(format!("range {index}'s state does not fit it"));
            }
            shard.state = a;
        }
        o.set_replicated(steps, started);
        Ok(o)
    }

    /// `other`'s owned ranges added to this optimizer's, as its own: ranges streamed from several
    /// members, made one optimizer once each is at the same step; why not.
    pub(crate) fn absorb(&mut self, other: ShardedOptimizer) -> Result<(), String> {
        if other.steps != self.steps || other.started != self.started {
            return Err(format!("ranges at optimizer step {} and at {}", self.steps, other.steps));
        }
        let added = other.own;
        self.shards.splice(self.own..self.own, other.shards.into_iter().take(added));
        self.own += added;
        Ok(())
    }

    /// After both passes of every held range: the parameters that had a gradient (`used`) have
    /// started (SGD's momentum buffer exists from now on).
    pub(crate) fn end_step(&mut self, used: &[bool]) {
        self.started.iter_mut().zip(used).for_each(|(s, &u)| *s |= u);
    }

    /// One pass of the update of held range `shard` (its place among this member's ranges, as
    /// [`ShardedOptimizer::held`] lists them) at rate `lr`: `grads` its (clipped, averaged)
    /// gradient elements, `param` each piece's current values, `used` per parameter whether any
    /// slot had a gradient for it. The new parameters go into `out` (the range's elements in the
    /// buffer the all-gather carries; a piece of an unused parameter gets its current values);
    /// what is stored follows `write` ([`Write::Params`] first, then [`Write::State`] once the
    /// step completed).
    pub(crate) fn update(
        &mut self,
        shard: usize,
        (grads, out): (&[f32], Option<&mut [f32]>),
        param: Values,
        used: &[bool],
        (lr, write): (f64, Write),
    ) {
        let shard = &mut self.shards[shard];
        let mut out = out;
        for piece in &shard.pieces {
            let span = piece.at..piece.at + piece.len;
            let values = param(piece);
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
            rule.apply(&mut ReadInto::new(&values, target), &grads[span.clone()], &mut state, first, write);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(o: &ShardedOptimizer) -> Vec<Vec<u32>> {
        let mut out = Vec::new();
        for shard in 0..o.held().len() {
            for k in 0..o.slot_names().len() {
                out.push(o.values(shard, k).iter().map(|x| x.to_bits()).collect());
            }
        }
        out
    }

    /// A step cut short after its update was computed, then completed from what was kept (the
    /// gradients, the parameters before the update), stores bit for bit what the uninterrupted
    /// step stores, owned ranges and buddy copies alike, for each optimizer; one whose buddy
    /// gradient never arrived cannot go forward.
    #[test]
    fn a_step_cut_short_goes_forward_to_the_same_bits() {
        let params: Vec<(String, Tensor)> = vec![
            ("a".into(), Tensor::from_slice(&[0.5f32, -1.0, 2.0, 0.25])),
            ("b".into(), Tensor::from_slice(&[1.5f32, -0.5])),
        ];
        let owned =
            vec![(0, vec![Piece { param: 0, offset: 1, at: 0, len: 3 }, Piece { param: 1, offset: 0, at: 3, len: 2 }])];
        let buddied = vec![(1, vec![Piece { param: 0, offset: 0, at: 0, len: 1 }])];
        let configs = [
            OptimizerConfig::Adam { lr: 0.1, beta1: 0.8, beta2: 0.99, eps: 1e-6, weight_decay: 0.01 },
            OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, dampening: 0.0, weight_decay: 1e-3, nesterov: true },
            OptimizerConfig::Rmsprop {
                lr: 0.01,
                alpha: 0.9,
                eps: 1e-7,
                momentum: 0.5,
                weight_decay: 1e-3,
                centered: true,
            },
        ];
        let values = |p: &Piece| -> Cow<'static, [f32]> {
            let all = Vec::<f32>::try_from(&params[p.param].1).unwrap();
            Cow::Owned(all[p.offset..p.offset + p.len].to_vec())
        };
        let used = [true, true];
        for config in configs {
            let make = || ShardedOptimizer::new(config.clone(), &params, (&owned, &buddied));
            let (mut straight, mut cut) = (make(), make());
            for step in 0..3 {
                let grads: Vec<Vec<f32>> =
                    [5, 1].iter().map(|&n| (0..n).map(|e| ((e * 3 + step * 7) as f32).sin()).collect()).collect();
                straight.begin_step();
                for (shard, g) in grads.iter().enumerate() {
                    straight.update(shard, (g, None), &values, &used, (0.1, Write::State));
                }
                straight.end_step(&used);
                cut.begin_step();
                let mut out = vec![0.0f32; 5];
                cut.update(0, (&grads[0], Some(&mut out)), &values, &used, (0.1, Write::Params));
                cut.cut_short((grads.iter().cloned().map(Some).collect(), cut.params_before(&values)), (&used, 0.1), 0);
                assert_eq!(cut.steps(), step as u64, "{config:?}: uncounted until it goes forward");
                assert!(cut.can_go_forward());
                cut.go_forward();
                assert_eq!(cut.steps(), straight.steps());
                assert_eq!(bits(&cut), bits(&straight), "{config:?}, step {step}");
            }
            cut.begin_step();
            cut.cut_short((vec![Some(vec![0.0; 5]), None], cut.params_before(&values)), (&used, 0.1), 0);
            assert!(!cut.can_go_forward(), "the buddy copy's gradient is missing");
        }
    }
}
