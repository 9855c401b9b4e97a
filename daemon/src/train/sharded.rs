//! The sharded step's reduction and update (`--shard-optimizer`; docs/fault-tolerance.md,
//! "Sharded optimizer state"): the gradients reduce-scattered, the global facts gathered in one
//! small all-reduce, each owned range clipped and updated, the parameters all-gathered, and only
//! then the owned state stored.

use std::borrow::Cow;

use tch::{Device, Kind, Tensor};
use trainerd_storage::TensorData;
use xxhash_rust::xxh3::Xxh3;

use crate::collective::buckets::{owned, Buckets, Range};
use crate::collective::{Collective, CollectiveError, ReduceOp, Slots};
use crate::optim::clip::{self, Clip};
use crate::optim::elementwise::Write;
use crate::optim::sharded::{Piece, ShardedOptimizer, Values};
use crate::state::host;

/// What a sharded step gave, the same on every member.
#[derive(Debug, PartialEq)]
pub(crate) struct Stepped {
    /// The extra values that rode in the tail, summed over the slots (before the used-flags).
    pub(crate) extra: Vec<f32>,
    /// The gradient's global norm before clipping (with `--clip-norm` or `--clip-value`).
    pub(crate) grad_norm: Option<f64>,
    /// False when float16's loss scaling found a gradient that is not finite: nothing was
    /// updated.
    pub(crate) finite: bool,
    /// The members' parameters differed as the step read them (the per-step check): nothing was
    /// updated, and every member got the same digests.
    pub(crate) differed: Option<Read>,
}

/// The per-step check of the parameters under sharding (docs/fault-tolerance.md, "The replica
/// check"): every member's xxh3-64 of its parameters as its step read them, by place in the
/// ring, and the coordinator's place. The every-N-steps comparison cannot see a parameter
/// corrupted between two steps here: the next all-gather overwrites it, or its owner spreads it.
#[derive(Debug, PartialEq)]
pub(crate) struct Read {
    pub(crate) digests: Vec<u64>,
    pub(crate) coordinator: usize,
}

/// Reduces what the slots held here staged in `buckets` (their `extra` values first in the
/// tail, `extra_len` of them) and applies the update at rate `lr` to the ranges `optimizer`
/// owns; `params` end with every member's ranges, bit for bit the unsharded step's parameters.
/// `loss_scale`: float16's, by which the gradients are divided (a step with a gradient that is
/// not finite is then skipped everywhere). `check`: whether this member coordinates, when the
/// members compare the parameters their step read before anything is updated ([`Read`]).
pub(crate) fn reduce_and_update(
    (buckets, ranges): (&mut Buckets, &[Range]),
    collective: &mut dyn Collective,
    params: &mut [(String, Tensor)],
    optimizer: &mut ShardedOptimizer,
    (clip, lr, loss_scale): (&Clip, f64, Option<f64>),
    (extra_len, check): (usize, Option<bool>),
) -> Result<Stepped, CollectiveError> {
    let slots = collective.slots().clone();
    buckets.reduce_scatter(collective, ranges)?;
    let (mine, buddied) = holding(ranges, collective);
    assert_eq!(mine, optimizer.owned(), "the optimizer owns the ranges of the slots held here");
    assert_eq!(buddied, optimizer.buddied(), "and keeps its predecessor's");
    let tail_len = extra_len + params.len();
    let read = check.map(|coordinates| (params_digest(params), coordinates));
    let facts = global_facts((buckets, ranges), collective, &mine, (clip, loss_scale, tail_len), read)?;
    let (small, not_finite, differed) = facts;
    let tail: Vec<f32> = small[..tail_len].iter().map(|&x| x as f32).collect();
    let used: Vec<bool> = tail[extra_len..].iter().map(|&u| u > 0.0).collect();
    let extra = tail[..extra_len].to_vec();
    if differed.is_some() || (loss_scale.is_some() && not_finite) {
        return Ok(Stepped { extra, grad_norm: None, finite: false, differed });
    }
    let clipping = !clip.is_off();
    let grad_norm =
        (clipping && used.iter().any(|&u| u)).then(|| clip::global_norm(&small[tail_len..tail_len + ranges.len()]));
    let coefficient = grad_norm.and_then(|total| clip.coefficient(total));
    optimizer.begin_step();
    let current = |piece: &Piece| param_values(&params[piece.param].1, piece);
    // Kept until the step completes: each owned range's clipped gradient (the state is stored
    // from it after the all-gather).
    let mut kept = Vec::with_capacity(mine.len());
    for (shard, &r) in mine.iter().enumerate() {
        let range = &ranges[r];
        let grads_len = range.grads_len();
        let values = &mut buckets.owned_mut(&slots, range)[..grads_len];
        clip.clip_slice(values, coefficient);
        let grads = values.to_vec();
        optimizer.update(shard, (&grads, Some(values)), &current, &used, (lr, Write::Params));
        kept.push(grads);
    }
    complete((buckets, ranges), collective, optimizer, kept, (&current, &used, lr))?;
    buckets.write_params(params);
    Ok(Stepped { extra, grad_norm, finite: true, differed: None })
}

/// The step's second half on this member: its owned ranges' clipped gradients (`kept`) shifted
/// to the next worker for its buddy copies while its predecessor's arrive (before the all-gather,
/// so that a member that completes the all-gather has them), the new parameters all-gathered,
/// and only then every held range's state stored. A failure stores nothing and keeps what
/// completing the step needs ([`ShardedOptimizer::cut_short`]), should another member have
/// completed it.
fn complete(
    (buckets, ranges): (&mut Buckets, &[Range]),
    collective: &mut dyn Collective,
    optimizer: &mut ShardedOptimizer,
    kept: Vec<Vec<f32>>,
    (current, used, lr): (Values, &[bool], f64),
) -> Result<(), CollectiveError> {
    let lens: Vec<usize> = optimizer.buddied().iter().map(|&r| ranges[r].grads_len()).collect();
    let mut theirs = vec![0.0f32; lens.iter().sum()];
    let shifted = match lens.is_empty() {
        true => Ok(()),
        false => collective.shift_to_next(&kept.concat(), &mut theirs),
    };
    let (own, arrived) = (kept.len(), shifted.is_ok());
    let mut grads = kept;
    let mut at = 0;
    for len in lens {
        grads.push(theirs[at..at + len].to_vec());
        at += len;
    }
    if let Err(e) = shifted.and_then(|()| buckets.all_gather(collective)) {
        let grads = grads.into_iter().enumerate().map(|(i, g)| (i < own || arrived).then_some(g)).collect();
        optimizer.cut_short(grads, current, (used, lr));
        return Err(e);
    }
    for (shard, g) in grads.iter().enumerate() {
        optimizer.update(shard, (g, None), current, used, (lr, Write::State));
    }
    optimizer.end_step(used);
    Ok(())
}

/// The small all-reduce after the reduce-scatter: the tail, each range's sum of squares, with
/// `read` every member's [`Read`] row (whether it coordinates, its parameters' digest in two
/// exact halves), and a count of gradients not finite, each place written by one member only
/// (its owner). The others add -0.0, which leaves every value exactly as it is (+0.0 would turn
/// a -0.0 into +0.0), so the sum is an exact all-gather. Under float16's loss scaling each owned
/// range is unscaled first (when finite). Returns the reduced values (the tail, then the sums of
/// squares), whether a gradient anywhere was not finite, and the members' reads where they
/// differ.
fn global_facts(
    (buckets, ranges): (&mut Buckets, &[Range]),
    collective: &mut dyn Collective,
    mine: &[usize],
    (clip, loss_scale, tail_len): (&Clip, Option<f64>, usize),
    read: Option<(u64, bool)>,
) -> Result<(Vec<f64>, bool, Option<Read>), CollectiveError> {
    let slots = collective.slots().clone();
    let (reads_at, world) = (tail_len + ranges.len(), collective.world());
    let not_finite = reads_at + if read.is_some() { 3 * world } else { 0 };
    let mut small = vec![-0.0f64; not_finite + 1];
    small[not_finite] = 0.0;
    if let Some((digest, coordinates)) = read {
        let at = reads_at + 3 * collective.rank();
        small[at..at + 3].copy_from_slice(&[
            f64::from(u8::from(coordinates)),
            (digest >> 32) as f64,
            digest as u32 as f64,
        ]);
    }
    for &r in mine {
        let range = &ranges[r];
        let values = buckets.owned_mut(&slots, range);
        let (grads, tail) = values.split_at_mut(range.grads_len());
        for (place, &x) in range.tail.clone().zip(tail.iter()) {
            small[place] = f64::from(x);
        }
        if let Some(scale) = loss_scale {
            if grads.iter().all(|x| x.is_finite()) {
                // As unscaling divides: times the float32 reciprocal.
                let inverse = (1.0 / scale) as f32;
                grads.iter_mut().for_each(|x| *x *= inverse);
            } else {
                small[not_finite] += 1.0;
            }
        }
        if !clip.is_off() {
            let pieces: Vec<&[f32]> = range.pieces.iter().map(|p| &grads[p.at..p.at + p.len]).collect();
            small[tail_len + r] = clip::range_sum_of_squares(&pieces);
        }
    }
    collective.all_reduce_workers(&mut small, ReduceOp::Sum)?;
    let any = small[not_finite] > 0.0;
    let rows: Vec<&[f64]> = small[reads_at..not_finite].chunks(3).collect();
    let digests: Vec<u64> = rows.iter().map(|row| ((row[1] as u64) << 32) | row[2] as u64).collect();
    let differed = digests
        .iter()
        .any(|&d| d != digests[0])
        .then(|| Read { coordinator: rows.iter().position(|row| row[0] > 0.5).unwrap_or(0), digests });
    small.truncate(reads_at);
    Ok((small, any, differed))
}

/// The xxh3-64 of `params`' values (float32, in order): what this member's step read.
pub(crate) fn params_digest(params: &[(String, Tensor)]) -> u64 {
    let mut hasher = Xxh3::new();
    for (_, p) in params {
        hasher.update(bytemuck::cast_slice(&host_values(p)));
    }
    hasher.digest()
}

/// Every member's ranges of the optimizer state gathered: the whole state, named and ordered as
/// the unsharded optimizer's ([`crate::optim::optimizer::Optimizer::state`]), bit for bit (each
/// value is copied, never added), on the members that `keep` it (the others take part in the
/// collective and keep nothing: empty). The buckets' buffers carry it, one state tensor at a
/// time.
pub(crate) fn gather_state(
    (buckets, ranges): (&mut Buckets, &[Range]),
    collective: &mut dyn Collective,
    params: &[(String, Tensor)],
    (optimizer, keep): (&ShardedOptimizer, bool),
) -> Result<Vec<TensorData>, CollectiveError> {
    let slots = collective.slots().clone();
    let mine = owned(ranges, &slots);
    let mut per_slot: Vec<Vec<Option<TensorData>>> = Vec::with_capacity(optimizer.slot_names().len());
    for (k, slot) in optimizer.slot_names().iter().enumerate() {
        for (shard, &r) in mine.iter().enumerate() {
            let range = &ranges[r];
            let values = optimizer.values(shard, k);
            buckets.owned_mut(&slots, range)[..values.len()].copy_from_slice(values);
        }
        buckets.all_gather(collective)?;
        if keep {
            // Straight from the buffers to host bytes: one copy, what a commit writes.
            let mut these: Vec<Option<TensorData>> = params.iter().map(|_| None).collect();
            for (i, values) in buckets.first_slot_views(params) {
                if optimizer.has(i, slot) {
                    let name = format!("{}/{slot}", params[i].0);
                    these[i] = Some(host::host_copy(&name, &values).expect("float32 host values"));
                }
            }
            per_slot.push(these);
        }
    }
    let mut out = Vec::new();
    for i in 0..params.len() {
        out.extend(per_slot.iter_mut().filter_map(|these| these[i].take()));
    }
    Ok(out)
}

/// Why a sharded optimizer's state could not move to a generation's owners: these ranges
/// (indices among the run's ranges) are held by no member at the furthest step, `step` (their
/// owner and buddy were both lost); or (`copies`, per place, per range: the digest of its copy
/// at that step) two copies of a range at that step differ.
#[derive(Debug, PartialEq)]
pub(crate) struct Unmoved {
    pub(crate) ranges: Vec<usize>,
    pub(crate) step: u64,
    pub(crate) copies: Option<Vec<Vec<Option<u64>>>>,
}

/// A sharded optimizer's state moved to a generation's owners and their buddies (a return, or a
/// failure that the buddy copies outlive: the ranges follow the new generation's slots). One
/// small all-reduce tells every member who holds which range and at which step. The furthest
/// step is the state's (the formation took the furthest replicated state); a member a step
/// behind that kept what completing that step needs completes it first (a failure inside the
/// all-gather: [`ShardedOptimizer::cut_short`]), and the ranges of members further behind (one
/// that was frozen or cut off while the others went on) are stale and not used. What every
/// member has alike (the steps, SGD's started flags) comes from the first member at the furthest
/// step. Each range then comes from this member's own copy, or from a neighbour in the ring
/// ([`by_neighbours`]: with home slots a worker lost or back moves only its own ranges, and
/// they sit next to it), or else through one reduce-scatter per state array
/// ([`by_reduce_scatter`]). `held` is this member's optimizer (a member without ranges holds
/// none). Returns the state moved, whether this member went forward, and what moved.
pub(crate) fn reshard(
    (buckets, ranges, extra_len): (&mut Buckets, &[Range], usize),
    collective: &mut dyn Collective,
    params: &[(String, Tensor)],
    held: &mut ShardedOptimizer,
) -> Result<Result<(ShardedOptimizer, bool, Moves), Unmoved>, CollectiveError> {
    let (world, place) = (collective.world(), collective.rank());
    let Survey { holders, steps, forward, started, digests } = survey(collective, held, (ranges.len(), params.len()))?;
    let furthest = steps.iter().flatten().copied().max().unwrap_or(0);
    let current = |q: usize| match steps[q] {
        Some(s) => s == furthest || (s + 1 == furthest && forward[q]),
        None => false,
    };
    let has: Vec<Vec<bool>> = (0..world).map(|q| holders[q].iter().map(|&h| h && current(q)).collect()).collect();
    let missing: Vec<usize> = (0..ranges.len()).filter(|&r| (0..world).all(|q| !has[q][r])).collect();
    // A rule without state (plain SGD) loses nothing with its ranges.
    if !missing.is_empty() && !held.slot_names().is_empty() {
        return Ok(Err(Unmoved { ranges: missing, step: furthest, copies: None }));
    }
    // The copies at the furthest step (an owner's and its buddy's) are equal bit for bit, unless
    // one was corrupted since the last comparison: then neither is known right.
    let copies: Vec<Vec<Option<u64>>> =
        (0..world).map(|q| digests[q].iter().map(|&d| d.filter(|_| steps[q] == Some(furthest))).collect()).collect();
    if differ(&copies) {
        return Ok(Err(Unmoved { ranges: Vec::new(), step: furthest, copies: Some(copies) }));
    }
    let went_forward = current(place) && steps[place] != Some(furthest);
    if went_forward {
        held.go_forward();
    }
    let (mine, buddied) = holding(ranges, collective);
    let mut next = ShardedOptimizer::new(
        held.config().clone(),
        params,
        (&with_pieces(ranges, &mine)[..], &with_pieces(ranges, &buddied)[..]),
    );
    let mine_started = held.replicated().1.to_vec();
    let first = (0..world).find(|&q| steps[q] == Some(furthest));
    next.set_replicated(furthest, first.map_or(&mine_started, |q| &started[q]));
    let moves = match plan(ranges, collective.slots(), &has) {
        Some(plan) => by_neighbours(collective, (held, &mut next), &plan)?,
        None => by_reduce_scatter((buckets, ranges, extra_len), collective, params, (held, &mut next), &has)?,
    };
    Ok(Ok((next, went_forward, moves)))
}

/// Whether two copies of a range differ (per place, per range: its copy's digest, if it holds one).
pub(crate) fn differ(copies: &[Vec<Option<u64>>]) -> bool {
    let ranges = copies.first().map_or(0, Vec::len);
    (0..ranges).any(|r| {
        let mut found = copies.iter().filter_map(|h| h[r]);
        found.next().is_some_and(|first| found.any(|d| d != first))
    })
}

/// What a reshard moved to this member: the bytes of optimizer state it received, and whether
/// every range came from its own copy or a neighbour's (otherwise through reduce-scatters).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Moves {
    pub(crate) received: u64,
    pub(crate) by_neighbours: bool,
}

/// Where a range a member needs in the new generation comes from.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Source {
    Own,
    Previous,
    Next,
}

/// Per place, the ranges it holds in the new generation (owned, then its buddy copies: the
/// order of [`holding`]) and where each comes from: its own current copy, else the previous
/// worker's, else the next's. `None` when some range is at none of them (several workers lost
/// or back next to each other). `has`: per place, per range, whether it holds it current.
fn plan(ranges: &[Range], slots: &Slots, has: &[Vec<bool>]) -> Option<Vec<Vec<(usize, Source)>>> {
    let world = slots.layout.len();
    (0..world)
        .map(|q| {
            let at = Slots::of(slots.count, slots.layout.clone(), q);
            let needed =
                owned(ranges, &at).into_iter().chain(if world > 1 { owned(ranges, &at.before()) } else { vec![] });
            let (previous, next) = ((q + world - 1) % world, (q + 1) % world);
            needed
                .map(|r| match () {
                    _ if has[q][r] => Some((r, Source::Own)),
                    _ if world > 1 && has[previous][r] => Some((r, Source::Previous)),
                    _ if world > 1 && has[next][r] => Some((r, Source::Next)),
                    _ => None,
                })
                .collect()
        })
        .collect()
}

/// Every range from its own copy or a neighbour's: one shift to the next worker and one to the
/// previous (each skipped when no member sends that way), each carrying every state array of
/// the ranges its receiver takes from it, in the receiver's order.
fn by_neighbours(
    collective: &mut dyn Collective,
    (held, next): (&ShardedOptimizer, &mut ShardedOptimizer),
    plan: &[Vec<(usize, Source)>],
) -> Result<Moves, CollectiveError> {
    let (world, place) = (collective.world(), collective.rank());
    let arrays = held.slot_names().len();
    // Each optimizer's held ranges, listed once: a range's place among them is its shard.
    let (was, now) = (held.held(), next.held());
    let shard_of = |list: &[usize], r: usize| list.iter().position(|&h| h == r).expect("held");
    // Each held range's length in elements, over every state array.
    let lens: Vec<usize> = (0..now.len()).map(|j| (0..arrays).map(|k| next.values(j, k).len()).sum()).collect();
    for (shard, &(r, from)) in plan[place].iter().enumerate() {
        if from == Source::Own {
            let own = shard_of(&was, r);
            (0..arrays).for_each(|k| next.values_mut(shard, k).copy_from_slice(held.values(own, k)));
        }
    }
    let mut received = 0;
    for (way, to) in [(Source::Previous, (place + 1) % world), (Source::Next, (place + world - 1) % world)] {
        if world < 2 || arrays == 0 || plan.iter().all(|p| p.iter().all(|&(_, f)| f != way)) {
            continue;
        }
        let theirs: Vec<usize> = plan[to].iter().filter(|&&(_, f)| f == way).map(|&(r, _)| r).collect();
        let mine: Vec<usize> = plan[place].iter().filter(|&&(_, f)| f == way).map(|&(r, _)| r).collect();
        let send: Vec<f32> = theirs
            .iter()
            .flat_map(|&r| {
                let shard = shard_of(&was, r);
                (0..arrays).flat_map(move |k| held.values(shard, k).iter().copied())
            })
            .collect();
        let mut recv = vec![0.0f32; mine.iter().map(|&r| lens[shard_of(&now, r)]).sum()];
        match way {
            Source::Previous => collective.shift_to_next(&send, &mut recv)?,
            _ => collective.shift_to_previous(&send, &mut recv)?,
        }
        let mut at = 0;
        for &r in &mine {
            let shard = shard_of(&now, r);
            for k in 0..arrays {
                let values = next.values_mut(shard, k);
                let n = values.len();
                values.copy_from_slice(&recv[at..at + n]);
                at += n;
            }
        }
        received += std::mem::size_of_val(&recv[..]) as u64;
    }
    Ok(Moves { received, by_neighbours: true })
}

/// Every range through the buckets' buffers: per state array every member fills its buffers with
/// -0.0, each range's writer (the lowest place holding it current, `has`) writes its values over
/// them, and one reduce-scatter leaves every range summed, so copied bit for bit, at its new
/// owner, which shifts its ranges on to its buddy (the next worker).
fn by_reduce_scatter(
    (buckets, ranges, extra_len): (&mut Buckets, &[Range], usize),
    collective: &mut dyn Collective,
    params: &[(String, Tensor)],
    (held, next): (&ShardedOptimizer, &mut ShardedOptimizer),
    has: &[Vec<bool>],
) -> Result<Moves, CollectiveError> {
    let slots = collective.slots().clone();
    let place = collective.rank();
    let writer = |r: usize| (0..has.len()).find(|&q| has[q][r]);
    let (mine, buddied) = (next.owned(), next.buddied());
    let mut received = 0;
    for k in 0..held.slot_names().len() {
        buckets.fill(slots.len(), params, extra_len, -0.0);
        for (shard, &r) in held.held().iter().enumerate() {
            if writer(r) == Some(place) {
                let values = held.values(shard, k);
                buckets.range_mut(0, &ranges[r])[..values.len()].copy_from_slice(values);
            }
        }
        buckets.reduce_scatter_sums(collective)?;
        let mut ours = Vec::new();
        for (shard, &r) in mine.iter().enumerate() {
            let moved = &buckets.owned_mut(&slots, &ranges[r])[..];
            let values = next.values_mut(shard, k);
            let len = values.len();
            values.copy_from_slice(&moved[..len]);
            ours.extend_from_slice(values);
        }
        // What this member's link received in the reduce-scatter: (W - 1)/W of the buffers.
        let world = has.len() as u64;
        received += ranges.iter().map(Range::grads_len).sum::<usize>() as u64 * 4 * (world - 1) / world.max(1);
        if !buddied.is_empty() {
            to_buddy(collective, next, (mine.len(), k), &ours)?;
        }
    }
    Ok(Moves { received, by_neighbours: false })
}

/// State array `k` of this member's owned ranges (`ours`) shifted to its buddy while its
/// predecessor's arrive, into `next`'s buddy copies (its shards from `own` on).
fn to_buddy(
    collective: &mut dyn Collective,
    next: &mut ShardedOptimizer,
    (own, k): (usize, usize),
    ours: &[f32],
) -> Result<(), CollectiveError> {
    let shards = own..next.held().len();
    let mut theirs = vec![0.0f32; shards.clone().map(|j| next.values(j, k).len()).sum()];
    collective.shift_to_next(ours, &mut theirs)?;
    let mut at = 0;
    for j in shards {
        let values = next.values_mut(j, k);
        let len = values.len();
        values.copy_from_slice(&theirs[at..at + len]);
        at += len;
    }
    Ok(())
}

/// What a reshard needs to know of every member, per place: the ranges it holds (a flag per
/// range), its optimizer's steps (none: it holds no range), whether it can complete the step
/// after them, its started flags, and its held ranges' digests (xxh3-64 of their state).
struct Survey {
    holders: Vec<Vec<bool>>,
    steps: Vec<Option<u64>>,
    forward: Vec<bool>,
    started: Vec<Vec<bool>>,
    digests: Vec<Vec<Option<u64>>>,
}

/// One small all-reduce over the workers for a [`Survey`] of `n` ranges and `p` parameters: each
/// place writes its own row (a flag per range held, 1 + its steps (0: holds none), whether it
/// can go forward, its started flags, each held range's digest in two exact 32-bit halves),
/// zeros elsewhere, so the sum is every row.
fn survey(
    collective: &mut dyn Collective,
    held: &ShardedOptimizer,
    (n, p): (usize, usize),
) -> Result<Survey, CollectiveError> {
    let (world, place) = (collective.world(), collective.rank());
    let (steps_at, forward_at, started_at, digests_at) = (n, n + 1, n + 2, n + 2 + p);
    let row = digests_at + 2 * n;
    let mut facts = vec![0.0f64; world * row];
    let mine = &mut facts[place * row..(place + 1) * row];
    let holds = held.held();
    holds.iter().for_each(|&r| mine[r] = 1.0);
    if !holds.is_empty() {
        let (steps, started) = held.replicated();
        mine[steps_at] = steps as f64 + 1.0;
        mine[forward_at] = if held.can_go_forward() { 1.0 } else { 0.0 };
        started.iter().enumerate().for_each(|(i, &s)| mine[started_at + i] = if s { 1.0 } else { 0.0 });
    }
    for (r, d) in held.digests() {
        mine[digests_at + 2 * r..digests_at + 2 * r + 2].copy_from_slice(&[(d >> 32) as f64, d as u32 as f64]);
    }
    collective.all_reduce_workers(&mut facts, ReduceOp::Sum)?;
    let rows: Vec<&[f64]> = facts.chunks(row).collect();
    let flags = |values: &[f64]| values.iter().map(|&x| x > 0.5).collect::<Vec<bool>>();
    Ok(Survey {
        holders: rows.iter().map(|r| flags(&r[..n])).collect(),
        steps: rows.iter().map(|r| (r[steps_at] > 0.5).then(|| r[steps_at] as u64 - 1)).collect(),
        forward: rows.iter().map(|r| r[forward_at] > 0.5).collect(),
        started: rows.iter().map(|r| flags(&r[started_at..digests_at])).collect(),
        digests: rows
            .iter()
            .map(|row| {
                let held = |r: usize| row[r] > 0.5;
                let digest = |r: usize| ((row[digests_at + 2 * r] as u64) << 32) | row[digests_at + 2 * r + 1] as u64;
                (0..n).map(|r| held(r).then(|| digest(r))).collect()
            })
            .collect(),
    })
}

/// The ranges this member owns in the collective's generation (those its slots finish), and
/// those it keeps a buddy copy of: its predecessor's in ring order (none alone).
pub(crate) fn holding(ranges: &[Range], collective: &dyn Collective) -> (Vec<usize>, Vec<usize>) {
    let slots = collective.slots();
    let mine = owned(ranges, slots);
    if collective.world() < 2 {
        return (mine, Vec::new());
    }
    (mine, owned(ranges, &slots.before()))
}

/// `held`'s ranges with their pieces, for [`ShardedOptimizer::new`].
pub(crate) fn with_pieces(ranges: &[Range], held: &[usize]) -> Vec<(usize, Vec<Piece>)> {
    held.iter().map(|&r| (r, pieces(&ranges[r]))).collect()
}

/// The optimizer's pieces of `range`: its parameters' spans, as the buckets cut them.
pub(crate) fn pieces(range: &Range) -> Vec<Piece> {
    range.pieces.iter().map(|s| Piece { param: s.param, offset: s.offset, at: s.at, len: s.len }).collect()
}

/// A piece's current values in its parameter.
pub(crate) fn param_values(p: &Tensor, piece: &Piece) -> Vec<f32> {
    host_values(p)[piece.offset..piece.offset + piece.len].to_vec()
}

/// A parameter's values as float32: borrowed from a contiguous float32 host tensor, else copied.
fn host_values(p: &Tensor) -> Cow<'_, [f32]> {
    if p.kind() == Kind::Float && p.device() == Device::Cpu && p.is_contiguous() {
        // SAFETY: a contiguous float32 host tensor of `numel` elements, only read while `p` is
        // borrowed.
        return Cow::Borrowed(unsafe { std::slice::from_raw_parts(p.data_ptr() as *const f32, p.numel()) });
    }
    let values = p.detach().reshape(-1).to_kind(Kind::Float).to_device(Device::Cpu);
    Cow::Owned(Vec::<f32>::try_from(values).expect("float32 values"))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use trainerd_sdk::{KerasOptimizer, KerasRule, NoDecay, OptimizerConfig};

    use super::*;
    use crate::collective::ring::tests::with_ring;
    use crate::collective::slots::{assign, assign_home};
    use crate::collective::Slots;
    use crate::optim::optimizer::Optimizer;

    /// Parameters of several shapes (a matrix, vectors, a scalar), one that no slot uses and one
    /// that only slot 0 uses; the same values on every member.
    fn params() -> Vec<(String, Tensor)> {
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
    fn backward(params: &mut [(String, Tensor)], slot: usize, step: usize) {
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

    fn bytes(t: &Tensor) -> Vec<u32> {
        Vec::<f32>::try_from(t.detach().reshape(-1)).unwrap().into_iter().map(f32::to_bits).collect()
    }

    type Assembled = BTreeMap<(String, usize), Vec<(usize, Vec<u32>)>>;

    /// A member's differences found, its unsharded state (bits by name), and its sharded pieces:
    /// owned, then its buddy copies.
    type Member = (Vec<String>, BTreeMap<String, Vec<u32>>, [Assembled; 2]);

    /// Both modes on a ring of `world` workers over `v` slots, for `steps` steps; per member:
    /// whether every step's parameters, tail and norm were equal, the unsharded state (bits by
    /// name), and the sharded state's pieces (by (state name, parameter): offset and bits).
    fn both_modes((world, v): (usize, usize), config: &OptimizerConfig, clip: Clip, steps: usize) -> Vec<Member> {
        with_ring(world, |ring| {
            let all: Vec<usize> = (0..world).collect();
            ring.set_slots(Slots::of(v, assign(v, &all), ring.rank()));
            let (held, coordinates) = (ring.slots().clone(), ring.rank() == 0);
            let (mut plain, mut sharded) = (params(), params());
            let cap = 64; // bytes: several buckets, and ranges that cut parameters
            let (mut b_plain, mut b_sharded) = (Buckets::new(&plain, cap), Buckets::new(&sharded, cap));
            let mut optimizer = Optimizer::new(config.clone(), &plain);
            let mut zero: Option<ShardedOptimizer> = None;
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
                // Unsharded: the all-reduce, the clip over the ranges, the whole update.
                let tail = b_plain.reduce(ring, &mut plain, held.len()).unwrap();
                let ranges = b_plain.ranges(&plain, v, 2);
                let spans: Vec<Vec<Piece>> = ranges.iter().map(pieces).collect();
                let norm = clip.apply_over(&plain, &spans).unwrap();
                optimizer.step(&mut plain, lr);
                // Sharded.
                let ranges = b_sharded.ranges(&sharded, v, 2);
                let zero = zero.get_or_insert_with(|| {
                    let (mine, buddied) = holding(&ranges, ring);
                    let held = (&with_pieces(&ranges, &mine)[..], &with_pieces(&ranges, &buddied)[..]);
                    ShardedOptimizer::new(config.clone(), &sharded, held)
                });
                let stepped = reduce_and_update(
                    (&mut b_sharded, &ranges),
                    ring,
                    &mut sharded,
                    zero,
                    (&clip, lr, None),
                    (2, Some(coordinates)),
                )
                .unwrap();
                assert!(stepped.finite);
                if stepped.extra != tail[..2] {
                    differences.push(format!("step {step}: tail {:?} vs {:?}", stepped.extra, tail));
                }
                if stepped.grad_norm != norm {
                    differences.push(format!("step {step}: norm {:?} vs {norm:?}", stepped.grad_norm));
                }
                for ((name, a), (_, b)) in plain.iter().zip(&sharded) {
                    if bytes(a) != bytes(b) {
                        differences.push(format!("step {step}: {name} differs"));
                    }
                }
            }
            // Gathered whole: the unsharded optimizer's state, named and ordered alike.
            let ranges = b_sharded.ranges(&sharded, v, 2);
            let gathered =
                gather_state((&mut b_sharded, &ranges), ring, &sharded, (zero.as_ref().unwrap(), true)).unwrap();
            let gathered: Vec<(String, Vec<u32>)> =
                gathered.iter().map(|t| (t.name.clone(), bytes(&host::to_tensor(t).unwrap()))).collect();
            let whole: Vec<(String, Vec<u32>)> = optimizer.state().into_iter().map(|(n, t)| (n, bytes(&t))).collect();
            if gathered != whole {
                differences.push("the gathered state is not the unsharded optimizer's".into());
            }
            let state = whole.into_iter().collect();
            let assemble = |buddies: bool| {
                let mut pieces: Assembled = BTreeMap::new();
                for (slot, piece, values) in zero.as_ref().unwrap().pieces(buddies) {
                    let name = format!("{}/{slot}", plain[piece.param].0);
                    let bits = values.iter().map(|x| x.to_bits()).collect();
                    pieces.entry((name, piece.param)).or_default().push((piece.offset, bits));
                }
                pieces
            };
            (differences, state, [assemble(false), assemble(true)])
        })
    }

    /// The sharded update equals the unsharded one bit for bit, in the parameters after every
    /// step and in the optimizer state put together from every member's ranges, for every
    /// optimizer and clipping, on one slot per worker, several slots per worker, and one worker
    /// holding every slot; with a parameter no slot uses and one only slot 0 uses.
    #[test]
    fn the_sharded_update_is_bit_for_bit_the_unsharded_one() {
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
        for ((world, v), config, clip) in cases {
            let out = both_modes((world, v), &config, clip, 6);
            for (differences, state, _) in &out {
                assert!(differences.is_empty(), "{config:?} {clip:?} on {world} worker(s), {v} slots: {differences:?}");
                assert_eq!(state, &out[0].1, "every member's unsharded state is the same");
            }
            // The owned ranges put together are the unsharded state; so are the buddy copies
            // (none alone).
            for buddies in [false, true] {
                let mut assembled: Assembled = BTreeMap::new();
                for (_, _, pieces) in &out {
                    for (key, parts) in &pieces[usize::from(buddies)] {
                        assembled.entry(key.clone()).or_default().extend(parts.iter().cloned());
                    }
                }
                if buddies && world == 1 {
                    assert!(assembled.is_empty());
                    continue;
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
                let what = if buddies { "the buddy copies" } else { "the state" };
                assert_eq!(whole, out[0].1, "{config:?} {clip:?} on {world} worker(s), {v} slots: {what}");
            }
            assert!(clip.is_off() || out.iter().all(|o| o.0.is_empty()));
        }
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
        let config = OptimizerConfig::Rmsprop {
            lr: 0.01,
            alpha: 0.9,
            eps: 1e-7,
            momentum: 0.5,
            weight_decay: 0.0,
            centered: true,
        };
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
        let chunk =
            |c: usize| ranges.iter().filter(|r| r.chunk == c).map(|r| r.grads_len() as u64 * 4 * 2).sum::<u64>();
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
        let (v, config) =
            (3, OptimizerConfig::Adam { lr: 1e-2, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.0 });
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
                    check,
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
}
