//! A sharded state moved as a generation forms (docs/fault-tolerance.md, "Sharded optimizer
//! state", the reshard; "Sharded gradients and parameters", the torn all-gather): who holds
//! which range at which step (a survey), each range moved to its new owner and buddy from its own
//! copy or a neighbour's, or through reduce-scatters, and parameters a failed all-gather tore put
//! back first.

use tch::{Device, Kind, Tensor};

use super::holding;
use super::with_pieces;
use crate::collective::buckets::{owned, write_group, Buckets, Range};
use crate::collective::{Collective, CollectiveError, ReduceOp, Slots};
use crate::optim::sharded_state::ShardedOptimizer;

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
    let surveyed = survey(collective, held, (ranges.len(), params.len()))?;
    let furthest = surveyed.steps.iter().flatten().copied().max().unwrap_or(0);
    let repaired = match put_back((buckets.groups(), ranges), collective, params, held, (&surveyed, furthest))? {
        Ok(repaired) => repaired,
        Err(lost) => return Ok(Err(Unmoved { ranges: lost, step: furthest, copies: None })),
    };
    let Survey { holders, steps, forward, started, digests, .. } = surveyed;
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
    Ok(Ok((next, went_forward, Moves { repaired, ..moves })))
}

/// Whether two copies of a range differ (per place, per range: its copy's digest, if it holds one).
pub(crate) fn differ(copies: &[Vec<Option<u64>>]) -> bool {
    let ranges = copies.first().map_or(0, Vec::len);
    (0..ranges).any(|r| {
        let mut found = copies.iter().filter_map(|h| h[r]);
        found.next().is_some_and(|first| found.any(|d| d != first))
    })
}

/// What a reshard moved to this member: the bytes of optimizer state it received, whether
/// every range came from its own copy or a neighbour's (otherwise through reduce-scatters), and
/// how many buckets of the parameters, torn by a failed all-gather, it put back ([`put_back`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Moves {
    pub(crate) received: u64,
    pub(crate) by_neighbours: bool,
    pub(crate) repaired: usize,
}

/// Parameters a failed all-gather tore (the first buckets of them written with the step's values
/// on some member, `written` in the survey), where no member completed that step (`furthest` is
/// the step before it), put back to that step (docs/fault-tolerance.md, "Sharded gradients and
/// parameters"): per bucket every member fills a buffer per slot held with -0.0, each range's
/// writer (the lowest place at `furthest` that kept its pieces' values before the step) writes
/// them in its place, and one all-reduce (a sum with one writer per element, so exact) gives
/// every member the bucket, which it writes into `params`. How many buckets were put back; the
/// ranges no member can write come back as `Err`.
fn put_back(
    (groups, ranges): (&[Vec<usize>], &[Range]),
    collective: &mut dyn Collective,
    params: &[(String, Tensor)],
    held: &ShardedOptimizer,
    (survey, furthest): (&Survey, u64),
) -> Result<Result<usize, Vec<usize>>, CollectiveError> {
    let (place, at) = (collective.rank(), |q: usize| survey.steps[q] == Some(furthest));
    let torn = (0..survey.steps.len()).filter(|&q| at(q)).map(|q| survey.written[q]).max().unwrap_or(0);
    if torn == 0 {
        return Ok(Ok(0));
    }
    let writer = |r: usize| (0..survey.steps.len()).find(|&q| survey.holders[q][r] && at(q) && survey.forward[q]);
    let lost: Vec<usize> = (0..ranges.len()).filter(|&r| ranges[r].bucket < torn && writer(r).is_none()).collect();
    if !lost.is_empty() {
        return Ok(Err(lost));
    }
    let values = held.written().1;
    for (b, group) in groups.iter().enumerate().take(torn) {
        let these: Vec<usize> = (0..ranges.len()).filter(|&r| ranges[r].bucket == b).collect();
        let len = these.iter().map(|&r| ranges[r].span.end).max().unwrap_or(0);
        let mut bufs: Vec<Tensor> = (0..collective.slots().len())
            .map(|_| Tensor::full([len as i64], -0.0, (Kind::Float, Device::Cpu)))
            .collect();
        // SAFETY: a buffer just made, ours alone.
        let flat = unsafe { crate::collective::host_slice(&mut bufs[0]) };
        for &r in these.iter().filter(|&&r| writer(r) == Some(place)) {
            let values = values.expect("a writer holds the values before the step");
            for piece in &ranges[r].pieces {
                let at = ranges[r].span.start + piece.at;
                flat[at..at + piece.len].copy_from_slice(&values[&(piece.param, piece.offset)]);
            }
        }
        collective.all_reduce_buffers(&mut bufs)?;
        write_group(group, &bufs[0], params);
    }
    Ok(Ok(torn))
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
    Ok(Moves { received, by_neighbours: true, repaired: 0 })
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
    Ok(Moves { received, by_neighbours: false, repaired: 0 })
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
    /// How many buckets of its parameters its step cut short had written (torn).
    written: Vec<usize>,
}

/// One small all-reduce over the workers for a [`Survey`] of `n` ranges and `p` parameters: each
/// place writes its own row (a flag per range held, 1 + its steps (0: holds none), whether it
/// can go forward, its started flags, each held range's digest in two exact 32-bit halves, the
/// buckets of its parameters its step cut short wrote), zeros elsewhere, so the sum is every row.
fn survey(
    collective: &mut dyn Collective,
    held: &ShardedOptimizer,
    (n, p): (usize, usize),
) -> Result<Survey, CollectiveError> {
    let (world, place) = (collective.world(), collective.rank());
    let (steps_at, forward_at, started_at, digests_at) = (n, n + 1, n + 2, n + 2 + p);
    let written_at = digests_at + 2 * n;
    let row = written_at + 1;
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
    mine[written_at] = held.written().0 as f64;
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
        written: rows.iter().map(|r| r[written_at] as usize).collect(),
    })
}
