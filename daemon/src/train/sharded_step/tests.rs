use std::collections::BTreeMap;

use trainerd_sdk::{KerasOptimizer, KerasRule, NoDecay, OptimizerConfig};

use super::*;
use crate::collective::ring::tests::with_ring;
use crate::collective::slots::{assign, assign_home};
use crate::collective::Slots;
use crate::optim::optimizer::Optimizer;

/// Parameters of several shapes (a matrix, vectors, a scalar), one that no slot uses and one
/// that only slot 0 uses; the same values on every member.
pub(super) fn params() -> Vec<(String, Tensor)> {
    [vec![7i64, 5], vec![5], vec![13], vec![3, 3], vec![1], vec![4], vec![6]]
        .into_iter()
        .enumerate()
        .map(|(i, shape)| {
            let n: i64 = shape.iter().product();
            let values: Vec<f32> = (0..n).map(|k| ((k * 7 + i as i64 * 3) % 11) as f32 * 0.1 - 0.5).collect();
            let name = format!("model.p{i}");
            (name, Tensor::from_slice(&values).view(shape.as_slice()).set_requires_grad(true))
        })
        .collect()
}

const UNUSED: usize = 5;
const ONLY_SLOT_0: usize = 6;

/// Slot `slot`'s gradients at step `step`: those of `0.5·Σ w·p²` (so they follow the
/// parameters), with `w` a function of (parameter, slot, step).
pub(super) fn backward(params: &mut [(String, Tensor)], slot: usize, step: usize) {
    for (i, (_, p)) in params.iter_mut().enumerate() {
        p.zero_grad();
        if i == UNUSED || (i == ONLY_SLOT_0 && slot != 0) {
            continue;
        }
        let n = p.numel();
        let w: Vec<f32> = (0..n).map(|k| ((k + 3 * slot + 7 * step + i) as f32).sin() * 2.0).collect();
        let w = Tensor::from_slice(&w).view_as(p);
        ((&*p * &*p * w).sum(Kind::Float) * 0.5).backward();
    }
}

pub(super) fn bytes(t: &Tensor) -> Vec<u32> {
    Vec::<f32>::try_from(t.detach().reshape(-1)).unwrap().into_iter().map(f32::to_bits).collect()
}

/// A named parameter.
type Param = (String, Tensor);

type Assembled = BTreeMap<(String, usize), Vec<(usize, Vec<u32>)>>;

/// A member's differences found, its unsharded state (bits by name), and its sharded pieces:
/// owned, then its buddy copies.
type Member = (Vec<String>, BTreeMap<String, Vec<u32>>, [Assembled; 2]);

/// Both modes on a ring of `world` workers over `v` slots, for `steps` steps; per member:
/// whether every step's parameters, tail and norm were equal, the unsharded state (bits by
/// name), and the sharded state's pieces (by (state name, parameter): offset and bits).
fn both_modes(
    (world, v): (usize, usize),
    config: &OptimizerConfig,
    clip: Clip,
    (steps, compact): (usize, bool),
) -> Vec<Member> {
    with_ring(world, |ring| {
        let all: Vec<usize> = (0..world).collect();
        ring.set_slots(Slots::of(v, assign(v, &all), ring.rank()));
        let (held, coordinates) = (ring.slots().clone(), ring.rank() == 0);
        let (mut plain, mut sharded) = (params(), params());
        let cap = 64; // bytes: several buckets, and ranges that cut parameters
        let (mut b_plain, mut b_sharded) = (Buckets::new(&plain, cap), Buckets::new(&sharded, cap).compact_if(compact));
        let mut optimizer = Optimizer::new(config.clone(), &plain);
        let (mut zero, mut follower): (Option<ShardedOptimizer>, Option<ShardedOptimizer>) = (None, None);
        let mut differences = Vec::new();
        for step in 0..steps {
            let lr = 0.05 / (1.0 + step as f64);
            let extra = |slot: usize| [slot as f32 + 0.5, 1.0 / 3.0];
            for (i, slot) in held.iter().enumerate() {
                backward(&mut plain, slot, step);
                b_plain.stage(i, &plain, &extra(slot));
                backward(&mut sharded, slot, step);
                b_sharded.stage(i, &sharded, &extra(slot));
            }
            let (tail, norm) = unsharded_step(ring, (&mut b_plain, &mut plain), (&mut optimizer, clip, lr));
            // Sharded.
            let ranges = b_sharded.ranges(&sharded, v, 2);
            let zero = zero.get_or_insert_with(|| {
                let (mine, buddied) = holding(&ranges, ring);
                let held = (&with_pieces(&ranges, &mine)[..], &with_pieces(&ranges, &buddied)[..]);
                ShardedOptimizer::new(config.clone(), &sharded, held)
            });
            let (send, before) = (zero.owned(), values_of(&sharded));
            let stepped = reduce_and_update(
                (&mut b_sharded, &ranges),
                ring,
                &mut sharded,
                zero,
                (&clip, lr, None),
                (2, Some(coordinates), &send),
            )
            .unwrap();
            assert!(stepped.finite);
            differences.extend(follow(&mut follower, (zero, &ranges, &send), (&stepped, &before, lr), (config, step)));
            differences.extend(step_differences(step, &stepped, (&tail, norm), (&plain, &sharded)));
        }
        // Gathered whole: the unsharded optimizer's state, named and ordered alike.
        let ranges = b_sharded.ranges(&sharded, v, 2);
        let zero = zero.as_ref().unwrap();
        let gathered = gather_state((&mut b_sharded, &ranges), ring, &sharded, (zero, true)).unwrap();
        let gathered: Vec<(String, Vec<u32>)> =
            gathered.iter().map(|t| (t.name.clone(), bytes(&host::to_tensor(t).unwrap()))).collect();
        let whole: Vec<(String, Vec<u32>)> = optimizer.state().into_iter().map(|(n, t)| (n, bytes(&t))).collect();
        if gathered != whole {
            differences.push("the gathered state is not the unsharded optimizer's".into());
        }
        (differences, whole.into_iter().collect(), [pieces_of(zero, &plain, false), pieces_of(zero, &plain, true)])
    })
}

/// The unsharded step on what `buckets` staged: the all-reduce, the clip over the ranges, the
/// whole update. The tail, and the norm.
fn unsharded_step(
    ring: &mut dyn Collective,
    (buckets, params): (&mut Buckets, &mut [(String, Tensor)]),
    (optimizer, clip, lr): (&mut Optimizer, Clip, f64),
) -> (Vec<f32>, Option<f64>) {
    let slots = ring.slots().clone();
    let tail = buckets.reduce(ring, params, slots.len()).unwrap();
    let spans: Vec<Vec<Piece>> = buckets.ranges(params, slots.count, 2).iter().map(pieces).collect();
    let norm = clip.apply_over(params, &spans).unwrap();
    optimizer.step(params, lr);
    (tail, norm)
}

/// Every parameter's values (flattened).
pub(super) fn values_of(params: &[Param]) -> Vec<Vec<f32>> {
    params.iter().map(|(_, p)| Vec::<f32>::try_from(p.detach().reshape(-1)).unwrap()).collect()
}

/// A returner's copy of the ranges an owner holds (docs/fault-tolerance.md, "Ranges streamed"):
/// taken from the owner's state after step 1 as `RANGES` carries it, then each step stored from
/// the clipped gradient the step handed back (`stepped.sent`, for the ranges `send`), reading the
/// parameters before the step (`before`): how it differs from the owner's.
fn follow(
    follower: &mut Option<ShardedOptimizer>,
    (owner, ranges, send): (&ShardedOptimizer, &[Range], &[usize]),
    (stepped, before, lr): (&Stepped, &[Vec<f32>], f64),
    (config, step): (&OptimizerConfig, usize),
) -> Vec<String> {
    let Some(f) = follower.as_mut() else {
        if step == 1 {
            let k = owner.slot_names().len();
            let arrays = (0..send.len()).map(|s| (0..k).map(|k| owner.values(s, k).to_vec()).collect()).collect();
            let (steps, started) = owner.replicated();
            let copy = ShardedOptimizer::streamed(
                config.clone(),
                &params(),
                &with_pieces(ranges, send),
                (arrays, steps, started),
            );
            *follower = Some(copy.unwrap());
        }
        return Vec::new();
    };
    let current = |p: &Piece| Cow::Owned(before[p.param][p.offset..p.offset + p.len].to_vec());
    let mut at = 0;
    let grads: Vec<&[f32]> = (f.held().into_iter().map(|r| ranges[r].grads_len()))
        .map(|n| {
            at += n;
            &stepped.sent[at - n..at]
        })
        .collect();
    f.store_step(&grads, &current, &stepped.used, lr);
    let own = f.held().len();
    if f.digests() != owner.digests()[..own] || f.replicated() != owner.replicated() {
        return vec![format!("step {step}: the ranges streamed differ from their owner's")];
    }
    Vec::new()
}

/// How a sharded step's results differ from the unsharded step's: the tail's extra values,
/// the gradient's norm, each parameter's bits.
fn step_differences(
    step: usize,
    stepped: &Stepped,
    (tail, norm): (&[f32], Option<f64>),
    (plain, sharded): (&[Param], &[Param]),
) -> Vec<String> {
    let mut differences = Vec::new();
    if stepped.extra != tail[..2] {
        differences.push(format!("step {step}: tail {:?} vs {:?}", stepped.extra, tail));
    }
    if stepped.grad_norm != norm {
        differences.push(format!("step {step}: norm {:?} vs {norm:?}", stepped.grad_norm));
    }
    for ((name, a), (_, b)) in plain.iter().zip(sharded) {
        if bytes(a) != bytes(b) {
            differences.push(format!("step {step}: {name} differs"));
        }
    }
    differences
}

/// The pieces of the state `zero` holds (its buddy copies where `buddies`), by (the state's name
/// for the parameter, the parameter), each at its offset.
fn pieces_of(zero: &ShardedOptimizer, params: &[(String, Tensor)], buddies: bool) -> Assembled {
    let mut pieces: Assembled = BTreeMap::new();
    for (slot, piece, values) in zero.pieces(buddies) {
        let name = format!("{}/{slot}", params[piece.param].0);
        let bits = values.iter().map(|x| x.to_bits()).collect();
        pieces.entry((name, piece.param)).or_default().push((piece.offset, bits));
    }
    pieces
}

/// The sharded update equals the unsharded one bit for bit, in the parameters after every
/// step and in the optimizer state put together from every member's ranges, for every
/// optimizer and clipping, on one slot per worker, several slots per worker, and one worker
/// holding every slot; with a parameter no slot uses and one only slot 0 uses. A returner's copy
/// of each member's owned ranges, taken after step 1 and then stored from the clipped gradients
/// each step hands back (ranges streamed), stays bit for bit its owner's.
#[test]
fn the_sharded_update_is_bit_for_bit_the_unsharded_one() {
    for (((world, v), config, clip), compact) in cases().into_iter().flat_map(|c| [(c.clone(), false), (c, true)]) {
        let out = both_modes((world, v), &config, clip, (6, compact));
        for (differences, state, _) in &out {
            let how = if compact { "--shard gradients" } else { "--shard optimizer" };
            assert!(
                differences.is_empty(),
                "{how} {config:?} {clip:?} on {world} worker(s), {v} slots: {differences:?}"
            );
            assert_eq!(state, &out[0].1, "every member's unsharded state is the same");
        }
        // The owned ranges put together are the unsharded state; so are the buddy copies
        // (none alone).
        for buddies in [false, true] {
            let whole = assembled(&out, buddies);
            if buddies && world == 1 {
                assert!(whole.is_empty());
                continue;
            }
            let what = if buddies { "the buddy copies" } else { "the state" };
            assert_eq!(whole, out[0].1, "{config:?} {clip:?} on {world} worker(s), {v} slots: {what}");
        }
        assert!(clip.is_off() || out.iter().all(|o| o.0.is_empty()));
    }
}

/// Every member's pieces (their buddy copies where `buddies`) put together, by name, each
/// covered once and in order.
fn assembled(out: &[Member], buddies: bool) -> BTreeMap<String, Vec<u32>> {
    let mut assembled: Assembled = BTreeMap::new();
    for (_, _, pieces) in out {
        for (key, parts) in &pieces[usize::from(buddies)] {
            assembled.entry(key.clone()).or_default().extend(parts.iter().cloned());
        }
    }
    let mut whole = BTreeMap::new();
    for ((name, _), mut parts) in assembled {
        parts.sort();
        let mut bits = Vec::new();
        for (offset, values) in parts {
            assert_eq!(offset, bits.len(), "{name}: the ranges cover it once, in order");
            bits.extend(values);
        }
        whole.insert(name, bits);
    }
    whole
}

/// Every optimizer and clipping on one slot per worker, several slots per worker, and one
/// worker holding every slot.
fn cases() -> Vec<((usize, usize), OptimizerConfig, Clip)> {
    let sgd = |momentum, dampening, weight_decay, nesterov| OptimizerConfig::Sgd {
        lr: 0.05,
        momentum,
        dampening,
        weight_decay,
        nesterov,
    };
    let rms = |momentum, weight_decay, centered| OptimizerConfig::Rmsprop {
        lr: 0.01,
        alpha: 0.9,
        eps: 1e-7,
        momentum,
        weight_decay,
        centered,
    };
    let adamw = OptimizerConfig::Adamw {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        no_decay: NoDecay::UnderTwoDims,
    };
    let adam = OptimizerConfig::Adam { lr: 1e-2, beta1: 0.8, beta2: 0.99, eps: 1e-6, weight_decay: 1e-2 };
    // Keras's rules (a Keras model's compile()), their decoupled decay on every optimizer.
    let keras = |rule, weight_decay| {
        let k = KerasOptimizer::defaults("sgd", 0.01).expect("Keras's SGD");
        OptimizerConfig::Keras(KerasOptimizer { rule, weight_decay, ..k })
    };
    let keras_sgd = keras(KerasRule::Sgd { momentum: 0.9, nesterov: true }, 0.01);
    let keras_adamw = keras(KerasRule::Adamw { beta1: 0.9, beta2: 0.99, eps: 1e-7 }, 0.004);
    let keras_rms = keras(KerasRule::Rmsprop { rho: 0.9, momentum: 0.5, eps: 1e-7, centered: true }, 0.0);
    let (norm, value) = (Clip { norm: Some(0.5), value: None }, Clip { norm: None, value: Some(0.05) });
    let both = Clip { norm: Some(0.8), value: Some(0.1) };
    let cases = [
        ((2, 2), sgd(0.0, 0.0, 0.0, false), Clip::default()),
        ((3, 3), sgd(0.9, 0.0, 1e-3, true), norm),
        ((2, 4), sgd(0.8, 0.1, 0.0, false), value),
        ((3, 3), adam, both),
        ((2, 4), adamw.clone(), norm),
        ((1, 3), adamw, Clip::default()),
        ((2, 3), rms(0.5, 1e-3, true), both),
        ((2, 2), rms(0.0, 0.0, false), value),
        ((2, 3), keras_sgd, norm),
        ((3, 3), keras_adamw, Clip::default()),
        ((2, 2), keras_rms, value),
    ];
    cases.into()
}

/// One member's view after a reshard: its owned and buddied ranges, steps, started flags, and
/// the elements whose bits are not those written by their holder.
type Moved = (Vec<usize>, Vec<usize>, u64, Vec<bool>, Vec<(usize, usize, usize)>);

/// The ranges held by the last generation's members (`before`: the workers it had; a member
/// in `empty` holds none, as one that came back or lost its state) move to their owners and
/// buddies in a generation of 3, every value bit for bit (signed zeros included), with the
/// step count and SGD's started flags; or the reshard says why not. `steps`: each member's
/// optimizer's steps (none can go forward).
fn reshard_on_3(before: usize, empty: &[usize], steps: [u64; 3]) -> Vec<Result<Moved, Unmoved>> {
    let v = 6;
    let config =
        OptimizerConfig::Rmsprop { lr: 0.01, alpha: 0.9, eps: 1e-7, momentum: 0.5, weight_decay: 0.0, centered: true };
    let value = |r: usize, k: usize, e: usize| match e % 5 {
        0 => -0.0,
        1 => 0.0,
        _ => ((r * 1000 + k * 100 + e) as f32).sqrt() * -1.5,
    };
    with_ring(3, |ring| {
        let params = params();
        let mut buckets = Buckets::new(&params, 64);
        let ranges = buckets.ranges(&params, v, 2);
        let place = ring.rank();
        let was: Vec<usize> = (0..before).collect();
        let (mine, buddied) = if place < before && !empty.contains(&place) {
            let layout = assign(v, &was);
            let of = |q: usize| owned(&ranges, &Slots::of(v, layout.clone(), q));
            (of(place), if before > 1 { of((place + before - 1) % before) } else { vec![] })
        } else {
            (vec![], vec![])
        };
        let held = (&with_pieces(&ranges, &mine)[..], &with_pieces(&ranges, &buddied)[..]);
        let mut held = ShardedOptimizer::new(config.clone(), &params, held);
        for (shard, r) in held.held().into_iter().enumerate() {
            for k in 0..3 {
                held.values_mut(shard, k).iter_mut().enumerate().for_each(|(e, x)| *x = value(r, k, e));
            }
        }
        let started: Vec<bool> = (0..params.len()).map(|i| i % 2 == 0).collect();
        if !held.held().is_empty() {
            held.set_replicated(steps[place], &started);
        }
        ring.set_slots(Slots::of(v, assign(v, &[0, 1, 2]), place));
        let (next, _, _) = reshard((&mut buckets, &ranges, 2), ring, &params, &mut held).unwrap()?;
        let mut wrong = Vec::new();
        for (shard, r) in next.held().into_iter().enumerate() {
            for k in 0..3 {
                for (e, x) in next.values(shard, k).iter().enumerate() {
                    if x.to_bits() != value(r, k, e).to_bits() {
                        wrong.push((r, k, e));
                    }
                }
            }
        }
        let (steps, started) = next.replicated();
        Ok((next.owned(), next.buddied(), steps, started.to_vec(), wrong))
    })
}

/// A return (the last generation had ranks 0 and 1; rank 2 holds nothing), a loss that the
/// buddies outlive (rank 1's or rank 0's state gone), and a member whose ranges are stale (a
/// step behind, nothing kept to complete it: not used): every range reaches its new owner and
/// buddy bit for bit, at the furthest step. Ranks 1 and 2 both lost: the ranges rank 1 owned
/// (rank 2 their buddy) are named; rank 2 a step ahead of the others: rank 0's ranges, which
/// only stale members hold, are named.
#[test]
fn a_reshard_moves_every_range_to_its_new_owner_and_buddy_bit_for_bit() {
    let v = 6;
    let ranges = Buckets::new(&params(), 64).ranges(&params(), v, 2);
    let cases = [(2, vec![], [7, 7, 7]), (3, vec![1], [7; 3]), (3, vec![0], [7; 3]), (3, vec![], [7, 6, 7])];
    for (before, empty, steps) in cases {
        let moved = reshard_on_3(before, &empty, steps);
        let mut all = Vec::new();
        for (rank, m) in moved.iter().enumerate() {
            let (owned_now, buddied, steps, started, wrong) = m.as_ref().unwrap();
            assert!(wrong.is_empty(), "{before} before, {empty:?} lost: rank {rank}: {wrong:?}");
            assert_eq!(*steps, 7);
            assert_eq!(started, &(0..7).map(|i| i % 2 == 0).collect::<Vec<_>>());
            let before_me = &moved[(rank + 2) % 3].as_ref().unwrap().0;
            assert_eq!(buddied, before_me, "rank {rank} keeps its predecessor's ranges");
            all.extend(owned_now.iter().copied());
        }
        all.sort();
        assert_eq!(all, (0..ranges.len()).collect::<Vec<_>>(), "every range has one owner");
    }
    let of = |q: usize| owned(&ranges, &Slots::of(v, assign(v, &[0, 1, 2]), q));
    for m in reshard_on_3(3, &[1, 2], [7; 3]) {
        assert_eq!(m.unwrap_err(), Unmoved { ranges: of(1), step: 7, copies: None });
    }
    for m in reshard_on_3(3, &[], [7, 7, 8]) {
        assert_eq!(m.unwrap_err(), Unmoved { ranges: of(0), step: 8, copies: None });
    }
}

/// The optimizer state a member held before a reshard from a generation of `before` (ranks
/// of `world`, `v` home slots): its ranges and buddy copies, every element `value(range, k,
/// e)`, replicated at step 7 (none where `rank` was not in it); and the slots it held, if it
/// was.
fn held_before(
    (config, params, ranges): (&OptimizerConfig, &[(String, Tensor)], &[Range]),
    (v, world, before): (usize, usize, &[usize]),
    rank: usize,
    value: impl Fn(usize, usize, usize) -> f32,
) -> (ShardedOptimizer, Option<Slots>) {
    let was = before.iter().position(|&r| r == rank).map(|p| Slots::of(v, assign_home(v, world, before), p));
    let (mine, buddied) =
        was.as_ref().map_or((vec![], vec![]), |was| (owned(ranges, was), owned(ranges, &was.before())));
    let held = (&with_pieces(ranges, &mine)[..], &with_pieces(ranges, &buddied)[..]);
    let mut held = ShardedOptimizer::new(config.clone(), params, held);
    for (shard, r) in held.held().into_iter().enumerate() {
        for k in 0..2 {
            held.values_mut(shard, k).iter_mut().enumerate().for_each(|(e, x)| *x = value(r, k, e));
        }
    }
    if !held.held().is_empty() {
        held.set_replicated(7, &vec![true; params.len()]);
    }
    (held, was)
}

type Resharded = (Vec<usize>, Vec<usize>, Moves, usize);

/// Per member of the ring of `after` (ranks of `world`, one slot each, home slots), the
/// ranges it owns and keeps a buddy copy of after a reshard from a generation of `before`,
/// what moved to it, and the elements that are not the holders' bits. Rank `flip`'s copies
/// have one bit flipped.
fn reshard_home(
    world: usize,
    before: &[usize],
    after: &[usize],
    flip: Option<usize>,
) -> Vec<Result<Resharded, Unmoved>> {
    let v = world;
    let config = OptimizerConfig::Adam { lr: 1e-2, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.0 };
    let value = |r: usize, k: usize, e: usize| ((r * 1000 + k * 100 + e) as f32).sqrt() * -1.5;
    with_ring(after.len(), |ring| {
        let params = params();
        let mut buckets = Buckets::new(&params, 64);
        let ranges = buckets.ranges(&params, v, 2);
        let rank = after[ring.rank()];
        let (mut held, _) = held_before((&config, &params, &ranges), (v, world, before), rank, value);
        if flip == Some(rank) {
            held.flip_bit();
        }
        ring.set_slots(Slots::of(v, assign_home(v, world, after), ring.rank()));
        let (next, _, moves) = reshard((&mut buckets, &ranges, 2), ring, &params, &mut held).unwrap()?;
        let mut wrong = 0;
        for (shard, r) in next.held().into_iter().enumerate() {
            for k in 0..2 {
                let bits = next.values(shard, k).iter().enumerate();
                wrong += bits.filter(|&(e, x)| x.to_bits() != value(r, k, e).to_bits()).count();
            }
        }
        Ok((next.owned(), next.buddied(), moves, wrong))
    })
}

/// A gather of the state right after a reshard, on members that staged no step in the
/// generation: the returner's buffers are made where missing (the chief restarted during a
/// sharded run's last steps panicked here: its first operation was a commit, 2026-11-28), and
/// what the buffers held before does not change a bit of what is gathered (the survivors'
/// hold another generation's values).
#[test]
fn a_returner_that_staged_no_step_gathers_the_same_state_as_every_member() {
    let v = 4;
    let config = OptimizerConfig::Adam { lr: 1e-2, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.0 };
    let out = with_ring(4, |ring| {
        let params = params();
        let mut buckets = Buckets::new(&params, 64);
        let ranges = buckets.ranges(&params, v, 2);
        let value = |r: usize, k: usize, e: usize| (r * 7 + k + e) as f32;
        let (mut held, was) = held_before((&config, &params, &ranges), (v, 4, &[0, 2, 3]), ring.rank(), value);
        if let Some(was) = was {
            buckets.fill(was.len(), &params, 2, 123.0);
        }
        ring.set_slots(Slots::of(v, assign_home(v, 4, &[0, 1, 2, 3]), ring.rank()));
        let (next, _, _) = reshard((&mut buckets, &ranges, 2), ring, &params, &mut held).unwrap().unwrap();
        let gathered = |buckets: &mut Buckets, ring: &mut dyn Collective| {
            let state = gather_state((buckets, &ranges), ring, &params, (&next, true)).unwrap();
            state.iter().map(|t| (t.name.clone(), bytes(&host::to_tensor(t).unwrap()))).collect::<Vec<_>>()
        };
        buckets.make(ring.slots().len(), &params, 2, None);
        let first = gathered(&mut buckets, ring);
        buckets.fill(ring.slots().len(), &params, 2, -0.0);
        (first, gathered(&mut buckets, ring))
    });
    for (rank, (first, again)) in out.iter().enumerate() {
        assert!(!first.is_empty());
        assert_eq!(first, again, "worker {rank}: the buffers' old values leaked into the gathered state");
        assert_eq!(first, &out[0].0, "worker {rank} gathered another state");
    }
}

/// With home slots, a worker lost or back moves only its own ranges, from or to its
/// neighbours in the ring, bit for bit: the others receive nothing but the buddy copies that
/// changed hands. Three workers back at once next to each other, one of them two places from
/// its ranges' holders: every range through the reduce-scatters, bit for bit too.
#[test]
fn with_home_slots_a_loss_or_a_return_moves_only_that_workers_ranges_between_neighbours() {
    // The bytes of both Adam arrays of every range that chunk `c` of a bucket is, of 4 slots.
    let ranges = Buckets::new(&params(), 64).ranges(&params(), 4, 2);
    let chunk = |c: usize| ranges.iter().filter(|r| r.chunk == c).map(|r| r.grads_len() as u64 * 4 * 2).sum::<u64>();
    let received = |out: &[Result<Resharded, Unmoved>]| {
        let moved = |r: &Result<Resharded, Unmoved>| {
            let (_, _, m, wrong) = r.as_ref().unwrap();
            assert_eq!(*wrong, 0, "bit for bit");
            assert!(m.by_neighbours);
            m.received
        };
        out.iter().map(moved).collect::<Vec<u64>>()
    };
    // Rank 1 of 4 lost: rank 0 takes its slot, so the ranges it finishes (chunk 2), from
    // rank 2 (their buddy), and rank 2 keeps a buddy copy of rank 0's own (chunk 1); rank 3
    // receives nothing.
    let lost = reshard_home(4, &[0, 1, 2, 3], &[0, 2, 3], None);
    assert_eq!(received(&lost), vec![chunk(2), chunk(1), 0]);
    // Rank 0 lost: rank 3 takes its slot (wrapping past the last).
    let first = reshard_home(4, &[0, 1, 2, 3], &[1, 2, 3], None);
    assert_eq!(received(&first)[1], 0, "rank 2 keeps its own and its buddy copies");
    // Rank 1 back: it alone receives, its own ranges and a buddy copy of rank 0's.
    let back = reshard_home(4, &[0, 2, 3], &[0, 1, 2, 3], None);
    assert_eq!(received(&back), vec![0, chunk(2) + chunk(1), 0, 0]);
    // Of 8, only ranks 0 and 4 left; all back at once: rank 2's ranges are two places away.
    let all = reshard_home(8, &[0, 4], &(0..8).collect::<Vec<_>>(), None);
    for (rank, r) in all.iter().enumerate() {
        let (_, _, moves, wrong) = r.as_ref().unwrap();
        assert_eq!((*wrong, moves.by_neighbours), (0, false), "rank {rank}");
    }
}

/// A copy corrupted since the last comparison (one bit of rank 2's first range, of which
/// rank 1 or 3 holds the other copy) is found as the generation forms: every member gets the
/// same digests, naming the two copies, and nothing moves.
#[test]
fn two_copies_that_differ_are_found_as_a_generation_forms() {
    for out in
        [reshard_home(4, &[0, 1, 2, 3], &[0, 2, 3], Some(2)), reshard_home(4, &[0, 2, 3], &[0, 1, 2, 3], Some(2))]
    {
        let found: Vec<Unmoved> = out.into_iter().map(|r| r.unwrap_err()).collect();
        assert!(found.iter().all(|u| u == &found[0]), "the same verdict everywhere");
        let copies = found[0].copies.as_ref().expect("the copies differ");
        assert!(differ(copies) && found[0].ranges.is_empty() && found[0].step == 7);
    }
}

/// A bit flipped in one member's parameters (of 3) is found by the per-step check before any
/// range is updated: every member gets the same digests, the flipped member's alone differs,
/// and no parameter, optimizer state or step count changed anywhere. On equal parameters the
/// check finds nothing and the step is the unchecked one's.
#[test]
fn the_per_step_check_finds_a_flipped_parameter_before_any_update() {
    let (v, config) = (3, OptimizerConfig::Adam { lr: 1e-2, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.0 });
    let out = with_ring(3, |ring| {
        ring.set_slots(Slots::of(v, assign(v, &[0, 1, 2]), ring.rank()));
        let mut params = params();
        let mut buckets = Buckets::new(&params, 64);
        let ranges = buckets.ranges(&params, v, 2);
        let (mine, buddied) = holding(&ranges, ring);
        let held = (&with_pieces(&ranges, &mine)[..], &with_pieces(&ranges, &buddied)[..]);
        let mut optimizer = ShardedOptimizer::new(config.clone(), &params, held);
        let mut steps = Vec::new();
        for step in 0..2 {
            if step == 1 && ring.rank() == 2 {
                let _no_grad = tch::no_grad_guard();
                let flat = params[3].1.flatten(0, -1);
                let x = flat.double_value(&[4]) as f32;
                let _ = flat.get(4).fill_(f64::from(f32::from_bits(x.to_bits() ^ (1 << 12))));
            }
            let slot = ring.slots().held.start;
            backward(&mut params, slot, step);
            buckets.stage(0, &params, &[1.0, 2.0]);
            let before: Vec<Vec<u32>> = params.iter().map(|(_, p)| bytes(p)).collect();
            let check = (2, Some(ring.rank() == 1));
            let clip = Clip::default();
            let stepped = reduce_and_update(
                (&mut buckets, &ranges),
                ring,
                &mut params,
                &mut optimizer,
                (&clip, 0.01, None),
                (check.0, check.1, &[]),
            )
            .unwrap();
            let after: Vec<Vec<u32>> = params.iter().map(|(_, p)| bytes(p)).collect();
            steps.push((stepped.differed, before == after, optimizer.steps(), params_digest(&params)));
        }
        steps
    });
    for (rank, steps) in out.iter().enumerate() {
        let (differed, unchanged, count, _) = &steps[0];
        assert_eq!((differed, *unchanged, *count), (&None, false, 1), "rank {rank}: step 0 is checked and taken");
        let (differed, unchanged, count, _) = &steps[1];
        let read = differed.as_ref().unwrap_or_else(|| panic!("rank {rank}: the flip is found"));
        assert_eq!(read.coordinator, 1);
        assert_eq!(read.digests[0], read.digests[1]);
        assert_ne!(read.digests[2], read.digests[0], "rank 2's parameters differ");
        assert_eq!(read.digests[rank], steps[1].3, "each member's own digest is its parameters'");
        assert_eq!((*unchanged, *count), (true, 1), "rank {rank}: nothing was updated");
    }
}
