//! Reductions hidden behind the backward pass, as DDP's (docs/architecture.md, "A step's
//! communication"): while the last slot this worker holds computes its backward pass, each
//! bucket whose gradients are all final is staged and handed to a reducing thread, which reduces
//! it over the ring while the backward pass goes on. The buckets are reduced one at a time in a
//! fixed order, the same on every member (the backward pass makes the last parameters' gradients
//! final first: from the last bucket down to the second), each with exactly the arithmetic
//! [`Buckets::reduce`] gives it, so the bits are those of a step that reduces after the backward
//! pass. The first bucket ([`super::buckets::TAIL`]), whose gradients the backward pass makes final last, carries
//! the tail (the step's totals and flags, and the used-flags only the backward pass's end knows):
//! it is reduced after it, as DDP's last bucket is.
//!
//! A parameter that gets no gradient in the step is staged when the backward pass ends, as DDP's
//! `find_unused_parameters` marks it then, so a bucket never waits for it.

use std::sync::{mpsc, Condvar, Mutex};

use tch::Tensor;

use super::buckets::{bytes_of, owned_of, values_bytes, Buckets, Gauge, Pool};
use super::{Collective, CollectiveError};
use crate::sys::autograd::GradReady;

/// Told on the reducing thread of each bucket reduced whose gradients all came during the
/// backward pass: its index and its first slot's buffer, which holds the bucket's sum over the
/// slots (a returner's catch-up sends its average on: docs/fault-tolerance.md, "By bucket").
pub(crate) type OnReduced<'a> = &'a (dyn Fn(usize, &Tensor) + Sync);

/// A step's reductions behind the last backward pass: which reduction, and who is told of each
/// bucket reduced.
#[derive(Clone, Copy)]
pub(crate) struct Overlap<'a> {
    /// The reduction each bucket gets.
    pub(crate) how: Reduction,
    /// Told of each bucket reduced, if anyone.
    pub(crate) told: Option<OnReduced<'a>>,
}

/// Which reduction a bucket gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reduction {
    /// Every slot gets the sum (the whole step).
    AllReduce,
    /// Each slot gets the sum of its owned range (the sharded step).
    ReduceScatter,
}

/// Runs `backward` (the `i`th slot held's backward pass, the last this worker computes in the
/// step, with `params` its parameters; `held` slots held) while the buckets after the first are
/// reduced as their gradients become final; they end staged and reduced (marked so in
/// `buckets`), the first ([`super::buckets::TAIL`]) neither; `overlap.told` hears of each of
/// those handed over while `backward` ran, once reduced. Returns `backward`'s value and how many
/// buckets were handed over while it ran (the others had a parameter without a gradient).
/// `backward`'s own error comes back as it is; a reduction that failed, as a [`CollectiveError`]
/// once `backward` has returned.
pub(crate) fn overlapped<T, E: From<CollectiveError>>(
    (buckets, collective): (&mut Buckets, &mut dyn Collective),
    ((i, held), params, overlap): ((usize, usize), &[&Tensor], Overlap<'_>),
    backward: impl FnOnce() -> Result<T, E>,
) -> Result<(T, usize), E> {
    let early = buckets.early();
    if early.is_empty() {
        return backward().map(|value| (value, 0));
    }
    let compact = buckets.compact();
    let bucket_of: Vec<usize> = bucket_places(buckets.groups(), params.len());
    let mut waiting: Vec<usize> = buckets.groups().iter().map(Vec::len).collect();
    let (tx, rx) = mpsc::channel::<Arrived>();
    let (flight, gauge, pool) =
        (Flight::new(compact.then_some(IN_FLIGHT), early.end - 1), buckets.gauge(), buckets.pool());
    std::thread::scope(|scope| {
        let (first, count, flight, held_by) = (early.start, early.len(), &flight, (&*gauge, &*pool));
        let reducer =
            scope.spawn(move || reduce_in_order(collective, (first, count, compact), rx, (overlap, flight, held_by)));
        let mut staged = vec![false; early.end]; // Per bucket (the tail's never is here).
        let mut stage = |b: usize, staged: &mut Vec<bool>, during: bool| {
            buckets.stage_buckets(i, params, &[], b..b + 1);
            let handles = buckets.hand_over(b, held);
            staged[b] = true;
            flight.handed();
            // A member gone sends nothing more: the error comes from the reducer.
            let _ = tx.send(Arrived { bucket: b, during, handles });
            flight.wait_for_room(staged);
        };
        let result = {
            let mut on_ready = |p: usize| {
                let b = bucket_of[p];
                if early.contains(&b) {
                    waiting[b] -= 1;
                    if waiting[b] == 0 {
                        stage(b, &mut staged, true);
                        // Chaos tests stop a member here: inside its backward pass, a bucket's
                        // reduction in flight.
                        trainerd_failpoint::point("backward");
                    }
                }
            };
            hooked(params, &mut on_ready, backward)
        };
        let during = staged.iter().filter(|&&s| s).count();
        // The buckets with a parameter that got no gradient: staged now, zeros for it (a
        // backward pass that failed stages nothing more: the reducing thread ends at the first
        // bucket that does not come).
        for b in early.clone().filter(|_| result.is_ok()) {
            if !staged[b] {
                stage(b, &mut staged, false);
            }
        }
        drop(tx);
        let reduced = reducer.join().expect("the reducing thread does not panic");
        let value = result?;
        take_back(buckets, reduced?, early);
        Ok((value, during))
    })
}

/// The buckets `early`, reduced: each one's ranges `kept` (compact) back in the buckets' sight.
fn take_back(buckets: &mut Buckets, kept: Kept, early: std::ops::Range<usize>) {
    let gauge = buckets.gauge();
    for (b, kept) in kept {
        gauge.back(values_bytes(&kept));
        buckets.put_kept(b, kept);
    }
    buckets.mark_reduced(early);
}

/// `backward` run with `on_ready` told of each of `params` whose gradient is final.
fn hooked<R>(params: &[&Tensor], on_ready: &mut dyn FnMut(usize), backward: impl FnOnce() -> R) -> R {
    let handles: Vec<Tensor> = params.iter().map(|p| p.shallow_clone()).collect();
    // Installing fails only where libtorch cannot allocate.
    let hooks = GradReady::install(handles, on_ready).expect("hooking the parameters' gradients");
    let result = backward();
    hooks.remove();
    result
}

/// Per bucket reduced (compact), the ranges owned here, one per slot held.
type Kept = Vec<(usize, Vec<Vec<f32>>)>;

/// A bucket staged for the reducing thread: its index, whether it came during the backward pass,
/// and its buffers, one per slot held.
struct Arrived {
    bucket: usize,
    during: bool,
    handles: Vec<Tensor>,
}

/// Each parameter's bucket.
fn bucket_places(groups: &[Vec<usize>], params: usize) -> Vec<usize> {
    let mut out = vec![0; params];
    for (b, group) in groups.iter().enumerate() {
        group.iter().for_each(|&p| out[p] = b);
    }
    out
}

/// With `--shard gradients`, how many buckets may be handed to the reducing thread and not yet
/// let go before the backward pass waits for it: the one it reduces and the next (FSDP's
/// `limit_all_gathers` bounds its gathers in flight the same way). Without the bound, where the
/// reductions fall behind the backward pass, every bucket waits whole at once.
const IN_FLIGHT: usize = 2;

/// The buckets handed to the reducing thread and not yet let go, and the bucket it awaits next;
/// the backward pass waits for room where a bound is set ([`IN_FLIGHT`]: compact buckets, whose
/// buffers are memory the gradients did not otherwise need).
///
/// The backward pass waits only while the bucket the reducing thread awaits has been handed to
/// it: that thread is then reducing or about to, and lets a bucket go once its peers have staged
/// theirs. Where it awaits a bucket not yet staged (the backward pass made a later bucket's
/// gradients final first), the backward pass goes on, as it must for that bucket to come: so no
/// member waits on a reduction that waits on it, and every member's reducing thread takes the
/// buckets in the same order.
struct Flight {
    bound: Option<usize>,
    /// (buckets handed and not let go, the bucket awaited: `None` once the thread has ended).
    now: Mutex<(usize, Option<usize>)>,
    room: Condvar,
}

impl Flight {
    /// Nothing in flight yet, the reducing thread's first bucket (`first`) awaited (whether or
    /// not that thread has begun).
    fn new(bound: Option<usize>, first: usize) -> Flight {
        Flight { bound, now: Mutex::new((0, Some(first))), room: Condvar::new() }
    }

    /// Its counts, whatever a thread that held them did (they are plain numbers, and
    /// [`Ends`] takes the lock while a panic unwinds).
    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, Option<usize>)> {
        self.now.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A bucket handed to the reducing thread.
    fn handed(&self) {
        self.lock().0 += 1;
    }

    /// The backward pass's thread, after handing a bucket over: waits while more than the bound
    /// are in flight and the bucket awaited is among those `staged`.
    fn wait_for_room(&self, staged: &[bool]) {
        let Some(bound) = self.bound else { return };
        let mut now = self.lock();
        while now.0 > bound && now.1.is_some_and(|b| staged[b]) {
            now = self.room.wait(now).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    /// The reducing thread awaits bucket `b` next (`None`: it has ended).
    fn awaiting(&self, b: Option<usize>) {
        self.lock().1 = b;
        self.room.notify_all();
    }

    /// The reducing thread let a bucket go.
    fn let_go(&self) {
        self.lock().0 -= 1;
        self.room.notify_all();
    }
}

/// The reducing thread has ended, however it ended (an error, or a panic unwinding): the
/// backward pass no longer waits for it.
struct Ends<'a>(&'a Flight);

impl Drop for Ends<'_> {
    fn drop(&mut self) {
        self.0.awaiting(None);
    }
}

/// The reducing thread: the `count` buckets from bucket `first` on, reduced from the last down
/// to the first, each once it has arrived on `ready` (when it came during the backward pass,
/// `overlap.told` hears of it once reduced), `flight` told of each awaited and let go.
/// `compact`: each bucket's ranges owned here are kept ([`owned_of`]) and its buffers given back
/// to `pool` (`gauge` counts both); returns those, by bucket.
fn reduce_in_order(
    collective: &mut dyn Collective,
    (first, count, compact): (usize, usize, bool),
    ready: mpsc::Receiver<Arrived>,
    (overlap, flight, (gauge, pool)): (Overlap<'_>, &Flight, (&Gauge, &Pool)),
) -> Result<Kept, CollectiveError> {
    let _ends = Ends(flight);
    let mut arrived: Vec<Option<Arrived>> = (0..count).map(|_| None).collect();
    let mut kept = Vec::new();
    for b in (0..count).rev() {
        flight.awaiting(Some(first + b));
        while arrived[b].is_none() {
            match ready.recv() {
                Ok(a) => {
                    let at = a.bucket - first;
                    arrived[at] = Some(a);
                }
                // Every bucket is sent before the sender is dropped, unless the backward pass's
                // thread is unwinding a panic.
                Err(mpsc::RecvError) => return Ok(kept),
            }
        }
        let Arrived { bucket, during, mut handles } = arrived[b].take().expect("arrived");
        match overlap.how {
            Reduction::AllReduce => collective.all_reduce_buffers(&mut handles)?,
            Reduction::ReduceScatter => collective.reduce_scatter_buffers(&mut handles)?,
        }
        if let (Some(told), true) = (overlap.told, during) {
            told(bucket, &handles[0]);
        }
        if compact {
            let owned = owned_of(&handles, collective.slots());
            gauge.away(values_bytes(&owned));
            gauge.back(handles.iter().map(bytes_of).sum());
            pool.give_back(handles);
            kept.push((bucket, owned));
        }
        flight.let_go();
    }
    Ok(kept)
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind};

    use super::*;
    use crate::collective::buckets::TAIL;
    use crate::collective::ring::tests::with_ring;
    use crate::collective::slots::assign;
    use crate::collective::Slots;

    /// A small MLP's parameters, the same on every worker, and one that no step uses.
    fn params() -> Vec<(String, Tensor)> {
        let shapes: [&[i64]; 7] = [&[8, 6], &[8], &[8, 8], &[8], &[3, 8], &[3], &[4]];
        shapes
            .iter()
            .enumerate()
            .map(|(i, s)| (format!("p{i}"), wave(s, 0.37 + i as f64).set_requires_grad(true)))
            .collect()
    }

    /// Values of `shape` that differ everywhere, without the generator (which the ring's
    /// threads would share).
    fn wave(shape: &[i64], f: f64) -> Tensor {
        let n: i64 = shape.iter().product();
        (Tensor::arange(n, (Kind::Float, Device::Cpu)) * f).sin().view(shape)
    }

    /// Slot `slot`'s backward pass in step `step`: its gradients in `params`.
    fn backward(params: &[(String, Tensor)], (step, slot): (usize, usize)) {
        crate::sys::autograd::zero_grads(params);
        let x = wave(&[5, 6], 1.3 + slot as f64 + 0.1 * step as f64);
        let p = |i: usize| &params[i].1;
        let h = x.matmul(&p(0).tr()).g_add(p(1)).relu().matmul(&p(2).tr()).g_add(p(3)).tanh();
        h.matmul(&p(4).tr()).g_add(p(5)).pow_tensor_scalar(2).sum(Kind::Float).backward();
    }

    /// Two steps of every slot held computed and reduced, the last slot with `overlap` (its
    /// buckets reduced during its backward pass, its gradients views of its buffers) or after it
    /// (copied into them): each parameter's gradient bits (none: no gradient), and every bucket's
    /// first staging buffer's bits.
    fn step(ring: &mut dyn Collective, overlap: bool, how: Reduction) -> (Vec<Option<Vec<u32>>>, Vec<u32>) {
        let mut params = params();
        let mut buckets = Buckets::new(&params, 64);
        let held: Vec<usize> = ring.slots().iter().collect();
        for step in 0..2 {
            buckets.begin_step(false, overlap.then_some(held.len() - 1));
            slots_of_step(ring, (&mut buckets, &mut params), (step, &held), (overlap, how));
        }
        let bits = |t: &Tensor| Vec::<f32>::try_from(t.reshape(-1)).unwrap().iter().map(|x| x.to_bits()).collect();
        let grads = params.iter().map(|(_, p)| p.grad().defined().then(|| bits(&p.grad()))).collect();
        let staged = buckets.first_slot_views(&params).iter().flat_map(|(_, v)| bits(v)).collect();
        (grads, staged)
    }

    /// Step `step` of the slots `held`: each computed and staged, then reduced.
    fn slots_of_step(
        ring: &mut dyn Collective,
        (buckets, params): (&mut Buckets, &mut [(String, Tensor)]),
        (step, held): (usize, &[usize]),
        (overlap, how): (bool, Reduction),
    ) {
        let extra = [1.0f32];
        for (i, &slot) in held.iter().enumerate() {
            let handles: Vec<&Tensor> = params.iter().map(|(_, p)| p).collect();
            let n = buckets.groups().len();
            if overlap && i + 1 == held.len() {
                // Each bucket told of, with its sum's bits as the reducing thread saw them.
                let told_of = std::sync::Mutex::new(Vec::new());
                let told = |b: usize, sum: &Tensor| told_of.lock().unwrap().push((b, bits(sum)));
                let on = ((i, held.len()), handles.as_slice(), Overlap { how, told: Some(&told) });
                let during = overlapped::<_, CollectiveError>((&mut *buckets, &mut *ring), on, || {
                    backward(params, (step, slot));
                    Ok(())
                });
                // Every bucket but the first (the tail's) and the last (its 7th parameter is
                // never used: that bucket is staged when the backward pass ends).
                assert_eq!(during.unwrap().1, n - 2, "handed over during the backward pass");
                // Told of those, once each, from the last down, as reduced (the sums the
                // reduction after the backward pass reads).
                let told_of = told_of.into_inner().unwrap();
                assert_eq!(told_of.iter().map(|(b, _)| *b).collect::<Vec<_>>(), (1..n - 1).rev().collect::<Vec<_>>());
                // (Compact buckets have let their buffers go.)
                for (b, sum) in told_of.into_iter().filter(|_| !buckets.compact()) {
                    assert_eq!(sum, bits(&buckets.first_slot_buffer(b)), "bucket {b}'s sum");
                }
                buckets.stage_buckets(i, &handles, &extra, TAIL..TAIL + 1);
            } else {
                backward(params, (step, slot));
                buckets.stage_buckets(i, &handles, &extra, 0..n);
            }
        }
        match how {
            Reduction::AllReduce => _ = buckets.reduce(ring, params, held.len()).unwrap(),
            Reduction::ReduceScatter => buckets.reduce_scatter_sums(ring).unwrap(),
        }
    }

    #[test]
    fn buckets_reduced_during_the_backward_pass_give_the_bits_of_buckets_reduced_after_it() {
        for how in [Reduction::AllReduce, Reduction::ReduceScatter] {
            // 3 workers of a slot each, and 3 slots on 2 workers (one holds two).
            for (workers, count) in [(3, 3), (2, 3)] {
                let out = with_ring(workers, |ring| {
                    ring.set_slots(Slots::of(count, assign(count, &(0..workers).collect::<Vec<_>>()), ring.rank()));
                    (step(ring, false, how), step(ring, true, how))
                });
                for (w, (off, on)) in out.iter().enumerate() {
                    let case = format!("{how:?}, worker {w} of {workers} holding {count} slots");
                    assert_eq!(on.1, off.1, "{case}: the reduced buffers");
                    assert_eq!(on.0[6], None, "the parameter no slot used keeps no gradient");
                    // The sharded step reads its ranges from the buffers; a gradient that is a
                    // view of one holds what the reduce-scatter left there.
                    if how == Reduction::AllReduce {
                        assert_eq!(on.0, off.0, "{case}: the averaged gradients");
                        assert_eq!(on.0, out[0].1 .0, "the same averaged gradient on every worker");
                    }
                }
            }
        }
    }

    /// Two steps of 3 slots on 2 workers, the slots moving between them (a worker lost, another
    /// back): whose gradients are views of which slot's buffers changes with them.
    fn steps_as_slots_move(ring: &mut crate::collective::Ring, in_place: bool) -> Vec<Option<Vec<u32>>> {
        let mut params = params();
        let mut buckets = Buckets::new(&params, 64);
        let place = ring.rank();
        for (step, layout) in [vec![0..2, 2..3], vec![0..1, 1..3]].into_iter().enumerate() {
            let slots = Slots::of(3, layout, place);
            let held: Vec<usize> = slots.iter().collect();
            ring.set_slots(slots);
            buckets.begin_step(false, in_place.then_some(held.len() - 1));
            slots_of_step(ring, (&mut buckets, &mut params), (step, &held), (in_place, Reduction::AllReduce));
        }
        params.iter().map(|(_, p)| p.grad().defined().then(|| bits(&p.grad()))).collect()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        Vec::<f32>::try_from(t.reshape(-1)).unwrap().iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn gradients_that_are_views_of_a_slots_buffers_follow_the_slots_as_they_move() {
        let out = with_ring(2, |ring| (steps_as_slots_move(ring, false), steps_as_slots_move(ring, true)));
        for (w, (copied, viewed)) in out.iter().enumerate() {
            assert_eq!(viewed, copied, "worker {w}");
        }
    }

    /// Two steps of the slots held reduce-scattered, the buckets `compact` or not, reduced during
    /// the last backward pass (`overlap`) or after it: the bits of the ranges this worker owns,
    /// and the bytes the buckets hold then, besides the buffers kept for the next step.
    fn owned_after(ring: &mut dyn Collective, compact: bool, overlap: bool) -> (Vec<Vec<u32>>, u64) {
        let mut params = params();
        let mut buckets = Buckets::new(&params, 64);
        buckets.set_compact(compact);
        let held: Vec<usize> = ring.slots().iter().collect();
        for step in 0..2 {
            buckets.begin_step(false, overlap.then_some(held.len() - 1));
            slots_of_step(ring, (&mut buckets, &mut params), (step, &held), (overlap, Reduction::ReduceScatter));
        }
        if compact {
            assert!(params.iter().all(|(_, p)| !p.grad().defined()), "every gradient let go");
        }
        // The buffers kept for the next step apart (the pool's).
        (owned_bits(&mut buckets, ring, &params), buckets.bytes() - buckets.idle_bytes())
    }

    #[test]
    fn compact_buckets_keep_only_the_ranges_owned_here_with_the_bits_of_whole_ones() {
        for (workers, count) in [(3, 3), (2, 3)] {
            let out = with_ring(workers, |ring| {
                ring.set_slots(Slots::of(count, assign(count, &(0..workers).collect::<Vec<_>>()), ring.rank()));
                [owned_after(ring, false, true), owned_after(ring, true, true), owned_after(ring, true, false)]
            });
            for (w, [whole, during, after]) in out.iter().enumerate() {
                let case = format!("worker {w} of {workers} holding {count} slots");
                assert_eq!(during.0, whole.0, "{case}: reduced during the backward pass");
                assert_eq!(after.0, whole.0, "{case}: reduced after it");
                // The ranges owned here alone: about (slots held)/V of the buckets' elements.
                let owned: usize = whole.0.iter().map(Vec::len).sum();
                assert_eq!((during.1, after.1), (owned as u64 * 4, owned as u64 * 4), "{case}");
                // Whole buckets: every slot's of every element, V times the ranges owned.
                assert!(whole.1 >= during.1 * (count as u64 - 1), "{case}: whole buckets held {}", whole.1);
            }
        }
    }

    /// A chain of `layers` 32x32 float32 matrices, each a bucket of its own at `cap` = 4096 bytes.
    fn chain(layers: usize) -> Vec<(String, Tensor)> {
        (0..layers).map(|i| (format!("w{i}"), wave(&[32, 32], 0.11 + i as f64).set_requires_grad(true))).collect()
    }

    /// One compact step of `chain` on a ring whose reductions fall behind the backward pass (each
    /// takes 10 ms more): the most its gradients and buckets held, and the ranges kept at the end.
    fn compact_peak(ring: &mut dyn Collective, layers: usize) -> (u64, Vec<Vec<u32>>) {
        let params = chain(layers);
        let mut buckets = Buckets::new(&params, 4096).compact_if(true);
        buckets.begin_step(false, Some(0));
        let handles: Vec<&Tensor> = params.iter().map(|(_, p)| p).collect();
        let slow = |_: usize, _: &Tensor| std::thread::sleep(std::time::Duration::from_millis(10));
        let on = ((0, 1), handles.as_slice(), Overlap { how: Reduction::ReduceScatter, told: Some(&slow) });
        let x = wave(&[4, 32], 1.7 + ring.rank() as f64);
        overlapped::<_, CollectiveError>((&mut buckets, &mut *ring), on, || {
            params.iter().fold(x, |h, (_, w)| h.matmul(w).tanh()).sum(Kind::Float).backward();
            Ok(())
        })
        .unwrap();
        buckets.stage_buckets(0, &handles, &[1.0], TAIL..TAIL + 1);
        buckets.reduce_scatter_sums(ring).unwrap();
        (buckets.gauge().peak(), owned_bits(&mut buckets, ring, &params))
    }

    /// The bits of the ranges owned here, as the buckets kept them.
    fn owned_bits(buckets: &mut Buckets, ring: &dyn Collective, params: &[(String, Tensor)]) -> Vec<Vec<u32>> {
        let slots = ring.slots().clone();
        let ranges = buckets.ranges(params, slots.count, 1);
        let owned = crate::collective::buckets::owned(&ranges, &slots);
        owned.iter().map(|&r| buckets.owned_mut(&slots, &ranges[r]).iter().map(|x| x.to_bits()).collect()).collect()
    }

    #[test]
    fn compact_buckets_in_flight_are_bounded_where_the_reductions_fall_behind() {
        let layers = 24;
        let out = with_ring(2, |ring| compact_peak(ring, layers));
        let bucket = 32 * 32 * 4;
        // Kept: each bucket's half owned here (the tail's a value and a flag more).
        let kept_all = (layers * bucket / 2 + 8) as u64;
        // The bound's buckets, the one autograd is making, and the tail's gradient (final last).
        let most = kept_all + ((IN_FLIGHT + 2) * bucket) as u64;
        for (w, (peak, _)) in out.iter().enumerate() {
            assert!(*peak <= most, "worker {w}: the buckets held {peak} bytes at their peak, more than {most}");
            assert!(*peak >= (IN_FLIGHT * bucket) as u64, "worker {w}: {peak} bytes: a reading missed");
        }
        // The same ranges as buckets reduced after the backward pass.
        let after = with_ring(2, |ring| {
            let params = chain(layers);
            let mut buckets = Buckets::new(&params, 4096).compact_if(true);
            buckets.begin_step(false, None);
            let x = wave(&[4, 32], 1.7 + ring.rank() as f64);
            params.iter().fold(x, |h, (_, w)| h.matmul(w).tanh()).sum(Kind::Float).backward();
            let handles: Vec<&Tensor> = params.iter().map(|(_, p)| p).collect();
            buckets.stage_buckets(0, &handles, &[1.0], 0..layers);
            buckets.reduce_scatter_sums(ring).unwrap();
            owned_bits(&mut buckets, ring, &params)
        });
        for (w, ((_, during), after)) in out.iter().zip(&after).enumerate() {
            assert_eq!(during, after, "worker {w}: the ranges kept");
        }
    }

    #[test]
    fn a_member_lost_while_a_bucket_is_reduced_fails_the_step_once_the_backward_pass_ends() {
        let out =
            crate::collective::ring::tests::with_ring_timeout(2, std::time::Duration::from_millis(500), |ring, _| {
                let params = params();
                let mut buckets = Buckets::new(&params, 64);
                buckets.begin_step(false, Some(0));
                let handles: Vec<&Tensor> = params.iter().map(|(_, p)| p).collect();
                if ring.rank() == 1 {
                    return None; // gone before its first bucket
                }
                let on = ((0, 1), handles.as_slice(), Overlap { how: Reduction::AllReduce, told: None });
                let result = overlapped::<_, CollectiveError>((&mut buckets, &mut *ring), on, || {
                    backward(&params, (0, 0));
                    Ok("the backward pass ended")
                });
                Some(result.map_err(|e| e.to_string()))
            });
        let failed = out[0].clone().expect("worker 0 stepped").unwrap_err();
        assert!(failed.contains("all-reduce"), "{failed}");
    }
}
