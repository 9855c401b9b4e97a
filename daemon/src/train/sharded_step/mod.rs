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
use crate::optim::elementwise::host_f32;
use crate::optim::lanes::Write;
use crate::optim::sharded_state::{Piece, ShardedOptimizer, Values};
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
    /// Per parameter, whether any slot had a gradient for it.
    pub(crate) used: Vec<bool>,
    /// The clipped gradient of each range asked for (owned here), one after the other in that
    /// order: what a returner that will hold them replays (docs/fault-tolerance.md, "Ranges
    /// streamed").
    pub(crate) sent: Vec<f32>,
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
/// `send`: owned ranges whose clipped gradient comes back ([`Stepped::sent`]).
pub(crate) fn reduce_and_update(
    (buckets, ranges): (&mut Buckets, &[Range]),
    collective: &mut dyn Collective,
    params: &mut [(String, Tensor)],
    optimizer: &mut ShardedOptimizer,
    (clip, lr, loss_scale): (&Clip, f64, Option<f64>),
    (extra_len, check, send): (usize, Option<bool>, &[usize]),
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
        return Ok(Stepped { extra, grad_norm: None, finite: false, differed, used, sent: Vec::new() });
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
    let grads = complete((buckets, ranges), collective, optimizer, kept, (&current, &used, lr))?;
    let of = |r: &usize| grads[mine.iter().position(|m| m == r).expect("an owned range")].as_slice();
    let sent = send.iter().map(of).collect::<Vec<_>>().concat();
    buckets.write_params(params);
    Ok(Stepped { extra, grad_norm, finite: true, differed: None, used, sent })
}

/// The step's second half on this member: its owned ranges' clipped gradients (`kept`) shifted
/// to the next worker for its buddy copies while its predecessor's arrive (before the all-gather,
/// so that a member that completes the all-gather has them), the new parameters all-gathered,
/// and only then every held range's state stored. A failure stores nothing and keeps what
/// completing the step needs ([`ShardedOptimizer::cut_short`]), should another member have
/// completed it. Every held range's clipped gradient, owned ones first.
fn complete(
    (buckets, ranges): (&mut Buckets, &[Range]),
    collective: &mut dyn Collective,
    optimizer: &mut ShardedOptimizer,
    kept: Vec<Vec<f32>>,
    (current, used, lr): (Values, &[bool], f64),
) -> Result<Vec<Vec<f32>>, CollectiveError> {
    // The predecessor's clipped gradients arrive straight in their own arrays.
    let mut theirs: Vec<Vec<f32>> = optimizer.buddied().iter().map(|&r| vec![0.0f32; ranges[r].grads_len()]).collect();
    let shifted = match theirs.is_empty() {
        true => Ok(()),
        false => {
            let send: Vec<&[f32]> = kept.iter().map(Vec::as_slice).collect();
            let mut recv: Vec<&mut [f32]> = theirs.iter_mut().map(Vec::as_mut_slice).collect();
            collective.shift_to_next(&send, &mut recv)
        }
    };
    let (own, arrived) = (kept.len(), shifted.is_ok());
    let mut grads = kept;
    grads.append(&mut theirs);
    if let Err(e) = shifted.and_then(|()| buckets.all_gather(collective)) {
        let grads = grads.into_iter().enumerate().map(|(i, g)| (i < own || arrived).then_some(g)).collect();
        optimizer.cut_short(grads, current, (used, lr));
        return Err(e);
    }
    for (shard, g) in grads.iter().enumerate() {
        optimizer.update(shard, (g, None), current, used, (lr, Write::State));
    }
    optimizer.end_step(used);
    Ok(grads)
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
        hasher.update(bytemuck::cast_slice(&host_values(p, 0..p.numel())));
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
    (held, next): (&mut ShardedOptimizer, &mut ShardedOptimizer),
    plan: &[Vec<(usize, Source)>],
) -> Result<Moves, CollectiveError> {
    let (world, place) = (collective.world(), collective.rank());
    let arrays = held.slot_names().len();
    // Each optimizer's held ranges, listed once: a range's place among them is its shard.
    let (was, now) = (held.held(), next.held());
    let shard_of = |list: &[usize], r: usize| list.iter().position(|&h| h == r).expect("held");
    let mut received = 0;
    // Each way, the ranges go from where they lie in this member's state to where they belong in
    // the neighbour's next one: no gathered copy on either side.
    for (way, to) in [(Source::Previous, (place + 1) % world), (Source::Next, (place + world - 1) % world)] {
        if world < 2 || arrays == 0 || plan.iter().all(|p| p.iter().all(|&(_, f)| f != way)) {
            continue;
        }
        let sending: &ShardedOptimizer = held;
        let theirs = plan[to].iter().filter(|&&(_, f)| f == way).map(|&(r, _)| shard_of(&was, r));
        let send: Vec<&[f32]> = theirs.flat_map(|shard| (0..arrays).map(move |k| sending.values(shard, k))).collect();
        let mine: Vec<usize> =
            plan[place].iter().filter(|&&(_, f)| f == way).map(|&(r, _)| shard_of(&now, r)).collect();
        let mut recv = next.arrays_mut(&mine);
        received += recv.iter().map(|part| std::mem::size_of_val(&**part) as u64).sum::<u64>();
        match way {
            Source::Previous => collective.shift_to_next(&send, &mut recv)?,
            _ => collective.shift_to_previous(&send, &mut recv)?,
        }
    }
    // The ranges this member keeps move last (a failed shift above leaves its state whole, for
    // the next formation to move from).
    for &(r, from) in &plan[place] {
        if from == Source::Own {
            next.put_arrays(shard_of(&now, r), held.take_arrays(shard_of(&was, r)));
        }
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
    let shards: Vec<usize> = (own..next.held().len()).collect();
    // Each buddy copy's array `k` (of all its arrays, in order), written as it arrives.
    let arrays = next.slot_names().len();
    let mut recv: Vec<&mut [f32]> = next.arrays_mut(&shards).into_iter().skip(k).step_by(arrays).collect();
    collective.shift_to_next(&[ours], &mut recv)
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
pub(crate) fn param_values<'p>(p: &'p Tensor, piece: &Piece) -> Cow<'p, [f32]> {
    host_values(p, piece.offset..piece.offset + piece.len)
}

/// The elements `span` of a parameter (flattened) as float32: borrowed where they lie (a
/// contiguous float32 host tensor), else that span alone converted on the host.
fn host_values(p: &Tensor, span: std::ops::Range<usize>) -> Cow<'_, [f32]> {
    if let Some(all) = host_f32(p) {
        return Cow::Borrowed(&all[span]);
    }
    let values = p.detach().reshape(-1).narrow(0, span.start as i64, span.len() as i64);
    Cow::Owned(Vec::<f32>::try_from(values.to_kind(Kind::Float).to_device(Device::Cpu)).expect("float32 values"))
}

#[cfg(test)]
mod tests;
