//! The sharded step's reduction and update (`--shard-optimizer`; docs/fault-tolerance.md,
//! "Sharded optimizer state"): the gradients reduce-scattered, the global facts gathered in one
//! small all-reduce, each owned range clipped and updated, the parameters all-gathered, and only
//! then the owned state stored.

use std::borrow::Cow;

use tch::{Device, Kind, Tensor};
use trainerd_storage::TensorData;
use xxhash_rust::xxh3::Xxh3;

use crate::collective::buckets::{bucket_views, owned, values_bytes, write_group, Buckets, Range};
use crate::collective::{Collective, CollectiveError, ReduceOp};
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
    let grads = complete((buckets, ranges, params), collective, optimizer, kept, (&current, &used, lr))?;
    let of = |r: &usize| grads[mine.iter().position(|m| m == r).expect("an owned range")].as_slice();
    let sent = send.iter().map(of).collect::<Vec<_>>().concat();
    match buckets.compact() {
        // What the ranges kept held is in the parameters now.
        true => buckets.let_kept_go(),
        false => buckets.write_params(params),
    }
    Ok(Stepped { extra, grad_norm, finite: true, differed: None, used, sent })
}

/// The step's second half on this member: its owned ranges' clipped gradients (`kept`) shifted
/// to the next worker for its buddy copies while its predecessor's arrive (before the all-gather,
/// so that a member that completes the all-gather has them), the new parameters all-gathered,
/// and only then every held range's state stored. A failure stores nothing and keeps what
/// completing the step needs ([`ShardedOptimizer::cut_short`]), should another member have
/// completed it. Every held range's clipped gradient, owned ones first. Compact buckets
/// (`--shard gradients`) write each bucket into `params` as it is gathered: the state's pass
/// then reads the held pieces' values before the step from a copy of them, and a failure notes
/// how many buckets it had written ([`ShardedOptimizer::cut_short`]).
fn complete(
    (buckets, ranges, params): (&mut Buckets, &[Range], &[(String, Tensor)]),
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
    // What the gradients hold in the step's second half: the buckets (compact, the ranges kept),
    // and every held range's clipped gradient.
    buckets.gauge().read(buckets.bytes() + values_bytes(&grads));
    let compact = buckets.compact();
    let before = compact.then(|| optimizer.params_before(current));
    let from_before = |piece: &Piece| {
        let values = &before.as_ref().expect("compact")[&(piece.param, piece.offset)];
        Cow::Borrowed(values.as_slice())
    };
    let mut written = 0;
    let mut write = |group: &[usize], buffer: &Tensor| {
        if compact {
            write_group(group, buffer, params);
            written += 1;
            // Chaos tests stop a member here: its parameters torn, this bucket of them written.
            trainerd_failpoint::point("sharded-wrote-bucket");
        }
    };
    let into = compact.then_some(params);
    if let Err(e) = shifted.and_then(|()| buckets.all_gather_each(collective, into, &mut write)) {
        let grads = grads.into_iter().enumerate().map(|(i, g)| (i < own || arrived).then_some(g)).collect();
        // The bucket whose all-gather failed is torn too where it was gathered in place.
        let partly = arrived && written < buckets.groups().len() && buckets.gathers_in_place(written, params).is_some();
        let before = before.unwrap_or_else(|| optimizer.params_before(current));
        optimizer.cut_short((grads, before), (used, lr), written + usize::from(partly));
        return Err(e);
    }
    match compact {
        true => store(optimizer, &grads, &from_before, (used, lr)),
        false => store(optimizer, &grads, current, (used, lr)),
    }
    Ok(grads)
}

/// Every held range's state stored from its clipped gradient (`grads`), `current` the held
/// pieces' values before the step, and the step ended.
fn store(optimizer: &mut ShardedOptimizer, grads: &[Vec<f32>], current: Values, (used, lr): (&[bool], f64)) {
    for (shard, g) in grads.iter().enumerate() {
        optimizer.update(shard, (g, None), current, used, (lr, Write::State));
    }
    optimizer.end_step(used);
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
        // Straight from the buffers to host bytes, a bucket at a time: one copy, what a commit
        // writes.
        let mut these: Vec<Option<TensorData>> = params.iter().map(|_| None).collect();
        buckets.all_gather_each(collective, None, &mut |group, buffer| {
            if !keep {
                return;
            }
            for (i, values) in bucket_views(group, buffer, params) {
                if optimizer.has(i, slot) {
                    let name = format!("{}/{slot}", params[i].0);
                    these[i] = Some(host::host_copy(&name, &values).expect("float32 host values"));
                }
            }
        })?;
        if keep {
            per_slot.push(these);
        }
    }
    let mut out = Vec::new();
    for i in 0..params.len() {
        out.extend(per_slot.iter_mut().filter_map(|these| these[i].take()));
    }
    Ok(out)
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

mod reshard;

#[cfg(test)]
use reshard::{differ, Unmoved};
pub(crate) use reshard::{reshard, Moves};

#[cfg(test)]
mod tests;
#[cfg(test)]
mod torn_tests;
