//! The ranges of the buckets (docs/fault-tolerance.md, "Sharded optimizer state"): each bucket
//! cut into V ranges, each finished by one slot, which owns it; the sharded step's reduce-scatter
//! and all-gather over them; and, with `--shard gradients`, a bucket's buffer let go once it is
//! reduced, only the ranges this worker owns kept.

use tch::Tensor;

use super::super::ring::chunk_of;
use super::super::{host_slice, Collective, CollectiveError, Slots};
use super::{buffer_of, Buckets, TAIL};

/// A range of the gradient buckets (docs/fault-tolerance.md, "Sharded optimizer state"): range
/// `chunk` of V of bucket `bucket`'s buffer, the elements the ring finishes on one slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Range {
    /// The bucket.
    pub(crate) bucket: usize,
    /// Which of the bucket's V ranges.
    pub(crate) chunk: usize,
    /// Its elements in the bucket's buffer.
    pub(crate) span: std::ops::Range<usize>,
    /// The parameters' element spans in it (its gradient elements come first, in order).
    pub(crate) pieces: Vec<Span>,
    /// The tail's elements in it (the values riding after the [`TAIL`] bucket's gradients), as
    /// places in the tail.
    pub(crate) tail: std::ops::Range<usize>,
}

/// A parameter's element span inside a [`Range`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    /// The parameter's place in the list the buckets were made of.
    pub(crate) param: usize,
    /// The span's first element within the parameter (flattened).
    pub(crate) offset: usize,
    /// Its first element within the range.
    pub(crate) at: usize,
    /// Its length.
    pub(crate) len: usize,
}

impl Range {
    /// Its gradient elements.
    pub(crate) fn grads_len(&self) -> usize {
        self.pieces.iter().map(|p| p.len).sum()
    }
}

impl Buckets {
    /// Every range of the buckets over a run of `v` slots, in (bucket, range) order: the order in
    /// which the global clip norm adds them. `params` are the parameters staged (their sizes);
    /// the tail is the step's `extra_len` extra values and one used-flag per parameter.
    pub(crate) fn ranges(&self, params: &[(String, Tensor)], v: usize, extra_len: usize) -> Vec<Range> {
        let tail_len = extra_len + params.len();
        let mut out = Vec::with_capacity(self.groups.len() * v);
        for (b, group) in self.groups.iter().enumerate() {
            let numels: Vec<usize> = group.iter().map(|&i| params[i].1.numel()).collect();
            let grads_len: usize = numels.iter().sum();
            let len = grads_len + if b == TAIL { tail_len } else { 0 };
            for c in 0..v {
                let span = chunk_of(c, v, len);
                let mut pieces = Vec::new();
                let mut start = 0;
                for (&i, &n) in group.iter().zip(&numels) {
                    let (lo, hi) = (span.start.max(start), span.end.min(start + n));
                    if lo < hi {
                        pieces.push(Span { param: i, offset: lo - start, at: lo - span.start, len: hi - lo });
                    }
                    start += n;
                }
                let tail = span.start.max(grads_len) - grads_len..span.end.max(grads_len) - grads_len;
                out.push(Range { bucket: b, chunk: c, span, pieces, tail });
            }
        }
        out
    }

    /// The sharded step's first half: every bucket of what the slots held here staged is
    /// reduce-scattered, and the gradient elements of each range this worker owns (range u + 1
    /// of each slot u it holds) averaged over the run's slots, as [`Buckets::reduce`] averages
    /// them. Host buffers only.
    pub(crate) fn reduce_scatter(
        &mut self,
        collective: &mut dyn Collective,
        ranges: &[Range],
    ) -> Result<(), CollectiveError> {
        let slots = collective.slots().clone();
        let scale = 1.0 / slots.count as f32;
        self.reduce_scatter_sums(collective)?;
        for r in owned(ranges, &slots) {
            let range = &ranges[r];
            let grads = range.grads_len();
            self.owned_mut(&slots, range)[..grads].iter_mut().for_each(|x| *x *= scale);
        }
        Ok(())
    }

    /// Every bucket of what the slots held here staged reduce-scattered: each held slot u's
    /// buffer then holds range u + 1 summed over the run's slots (compact, that range alone is
    /// kept and the buffers are let go). Host buffers only.
    pub(crate) fn reduce_scatter_sums(&mut self, collective: &mut dyn Collective) -> Result<(), CollectiveError> {
        let slots = collective.slots().clone();
        for b in 0..self.groups.len() {
            // Reduced during the backward pass: its results are where that left them.
            if std::mem::take(&mut self.reduced[b]) {
                continue;
            }
            let mut bufs = self.slot_buffers(b, slots.len());
            collective.reduce_scatter_buffers(&mut bufs)?;
            if self.compact {
                let kept = owned_of(&bufs, &slots);
                drop(bufs);
                let done: Vec<Tensor> = self.staging.iter_mut().filter_map(|per_slot| per_slot[b].take()).collect();
                self.pool.give_back(done);
                self.put_kept(b, kept);
            }
        }
        Ok(())
    }

    /// Compact: bucket `b`'s ranges owned by the slots held here (one per slot, in order), as its
    /// reduce-scatter left them ([`owned_of`]).
    pub(crate) fn put_kept(&mut self, b: usize, kept: Vec<Vec<f32>>) {
        for (i, values) in kept.into_iter().enumerate() {
            *self.kept_slot(i, b) = values;
        }
    }

    /// Compact: the ranges kept let go, once the step's all-gather has written them into the
    /// parameters (the next reduce-scatter, or a gather of the state, makes them again).
    pub(crate) fn let_kept_go(&mut self) {
        self.kept.clear();
    }

    /// Compact: the kept range of bucket `b` owned by the `i`th slot held, made where missing.
    fn kept_slot(&mut self, i: usize, b: usize) -> &mut Vec<f32> {
        while self.kept.len() <= i {
            self.kept.push(Vec::new());
        }
        self.kept[i].resize_with(self.groups.len(), Vec::new);
        &mut self.kept[i][b]
    }

    /// The elements of `range`, owned here, where the reduce-scatter left them: in the host
    /// buffer, or compact, in the range kept of it (made, zeros, where missing).
    pub(crate) fn owned_mut(&mut self, slots: &Slots, range: &Range) -> &mut [f32] {
        let v = slots.count;
        let u = (range.chunk + v - 1) % v;
        let i = slots.index(u);
        let i = i.unwrap_or_else(|| panic!("range {} of bucket {} is not owned here", range.chunk, range.bucket));
        if !self.compact {
            return self.range_mut(i, range);
        }
        let kept = self.kept_slot(i, range.bucket);
        kept.resize(range.span.len(), 0.0);
        kept
    }

    /// The elements of `range` in the host buffer of the `i`th slot held here.
    pub(crate) fn range_mut(&mut self, i: usize, range: &Range) -> &mut [f32] {
        let buffer = self.staging[i][range.bucket].as_mut().expect("staged");
        // SAFETY: our own contiguous float32 host buffer, touched by nothing else while the
        // returned slice (which borrows `self`) lives.
        let flat = unsafe { host_slice(buffer) };
        &mut flat[range.span.clone()]
    }

    /// Every bucket's host buffers of the first `held` slots, made where missing (as
    /// [`Buckets::stage`] makes them, the [`TAIL`] bucket with `extra_len` extra values and a
    /// used-flag per parameter) and filled with `value`: -0.0 leaves whatever a single slot
    /// writes over it unchanged by a sum over the slots. Compact too: a reduce-scatter of them
    /// lets them go again.
    pub(crate) fn fill(&mut self, held: usize, params: &[(String, Tensor)], extra_len: usize, value: f32) {
        self.make(held, params, extra_len, Some(value));
    }

    /// Every bucket's host buffers of the first `held` slots, made where missing (zeros) as
    /// [`Buckets::fill`] makes them, and filled with `value` if given. A member that staged no
    /// step in this generation (a returner whose first operation is a commit, or a survivor that
    /// now holds more slots) lacks some, and a gather of the sharded state passes through them
    /// (the chief restarted during a sharded run's last steps panicked here, 2026-11-28).
    /// Compact, without a `value`, only the buckets' lengths are noted: a gather makes one
    /// bucket's buffers at a time.
    pub(crate) fn make(&mut self, held: usize, params: &[(String, Tensor)], extra_len: usize, value: Option<f32>) {
        assert!(!self.on_device, "host buffers only");
        self.slots_up_to(held);
        for i in 0..held {
            self.extras[i] = extra_len;
            for (b, group) in self.groups.iter().enumerate() {
                let tail = if b == TAIL { extra_len + params.len() } else { 0 };
                let len = group.iter().map(|&p| params[p].1.numel()).sum::<usize>() + tail;
                self.lens[b] = len;
                if self.compact && value.is_none() {
                    continue;
                }
                let buffer = buffer_of(&mut self.staging[i][b], len, (self.home, false));
                if let Some(value) = value {
                    // SAFETY: as in `range_mut`.
                    unsafe { host_slice(buffer) }.fill(value);
                }
            }
        }
    }

    /// The sharded step's second half: every bucket's owned ranges (now holding the updated
    /// parameters) gathered into the first slot's buffer on every worker, one bucket after the
    /// other, `each` told of each (its parameters' places and that buffer) once gathered.
    /// Compact, a bucket's buffers are made for its gather from the ranges kept, and let go after
    /// `each`; a bucket of one parameter of `into` is gathered straight into that parameter's
    /// memory ([`Buckets::gathers_in_place`]).
    pub(crate) fn all_gather_each(
        &mut self,
        collective: &mut dyn Collective,
        into: Option<&[(String, Tensor)]>,
        each: &mut dyn FnMut(&[usize], &Tensor),
    ) -> Result<(), CollectiveError> {
        let slots = collective.slots().clone();
        for b in 0..self.groups.len() {
            let mut bufs = match self.compact {
                true => self.gathering(b, &slots, into.and_then(|params| self.gathers_in_place(b, params))),
                false => self.slot_buffers(b, slots.len()),
            };
            collective.all_gather_buffers(&mut bufs)?;
            each(&self.groups[b], &bufs[0]);
            if self.compact {
                self.pool.give_back(bufs);
            }
        }
        Ok(())
    }

    /// Compact: the memory of bucket `b`'s one parameter of `params`, flattened, where the
    /// bucket's all-gather can write into it: a contiguous float32 host tensor, and no tail. A
    /// failure inside that all-gather leaves it torn.
    pub(crate) fn gathers_in_place(&self, b: usize, params: &[(String, Tensor)]) -> Option<Tensor> {
        let [p] = self.groups[b][..] else { return None };
        let p = &params[p].1;
        let fits = p.kind() == tch::Kind::Float && p.device() == tch::Device::Cpu && p.is_contiguous();
        (self.compact && b != TAIL && fits).then(|| p.detach().view(-1))
    }

    /// Compact: bucket `b`'s buffers for its all-gather, one per slot held, each with the range
    /// that slot owns in its place (the gather writes every other element); the first is `first`
    /// where given (a parameter's own memory), the others lent by the pool.
    fn gathering(&mut self, b: usize, slots: &Slots, mut first: Option<Tensor>) -> Vec<Tensor> {
        let len = self.lens[b];
        (0..slots.len())
            .map(|i| {
                let lent = || self.pool.take(len, slots.len());
                let mut buffer = first.take().filter(|_| i == 0).unwrap_or_else(lent);
                // SAFETY: a buffer just made or lent, ours alone.
                let flat = unsafe { host_slice(&mut buffer) };
                let span = owned_span(slots, i, len);
                flat[span].copy_from_slice(self.kept_slot(i, b));
                buffer
            })
            .collect()
    }

    /// After [`Buckets::all_gather_each`] (not compact): every bucket's gathered values copied
    /// into `params`.
    pub(crate) fn write_params(&self, params: &mut [(String, Tensor)]) {
        for (b, group) in self.groups.iter().enumerate() {
            write_group(group, self.staging[0][b].as_ref().expect("staged"), params);
        }
    }

    /// Each parameter's place and its values in the first slot's buffers, shaped as it is (views
    /// of the buffers: after [`Buckets::all_gather_each`], the gathered values).
    #[cfg(test)]
    pub(crate) fn first_slot_views(&self, params: &[(String, Tensor)]) -> Vec<(usize, Tensor)> {
        let buffer = |b: usize| self.staging[0][b].as_ref().expect("staged");
        self.groups.iter().enumerate().flat_map(|(b, group)| bucket_views(group, buffer(b), params)).collect()
    }

    /// Bucket `b`'s buffer of the first slot (a shallow handle).
    #[cfg(test)]
    pub(crate) fn first_slot_buffer(&self, b: usize) -> Tensor {
        self.slot_buffers(b, 1).remove(0)
    }
}

/// A bucket's values in `buffer` (its first slot's, gathered) copied into its parameters
/// (`group`: their places in `params`).
pub(crate) fn write_group(group: &[usize], buffer: &Tensor, params: &[(String, Tensor)]) {
    let _no_grad = tch::no_grad_guard();
    for (i, values) in bucket_views(group, buffer, params) {
        let mut p = params[i].1.shallow_clone();
        if p.data_ptr() == values.data_ptr() {
            continue; // gathered in place
        }
        p.copy_(&if p.device().is_cuda() { values.to_device(p.device()) } else { values });
    }
}

/// Each parameter of a bucket (`group`: their places in `params`) with its values in `buffer`
/// (that bucket's), shaped as it is (views of the buffer).
pub(crate) fn bucket_views(group: &[usize], buffer: &Tensor, params: &[(String, Tensor)]) -> Vec<(usize, Tensor)> {
    let mut at = 0;
    let mut out = Vec::with_capacity(group.len());
    for &i in group {
        let p = &params[i].1;
        let n = p.numel() as i64;
        out.push((i, buffer.narrow(0, at, n).view(p.size().as_slice())));
        at += n;
    }
    out
}

/// The elements of a bucket of `len` that the `i`th slot of `slots` owns: range u + 1 of it, for
/// its slot u.
fn owned_span(slots: &Slots, i: usize, len: usize) -> std::ops::Range<usize> {
    let u = slots.iter().nth(i).expect("a slot held");
    chunk_of((u + 1) % slots.count, slots.count, len)
}

/// Compact: the ranges a bucket's reduce-scatter left in `buffers` (one per slot held) that their
/// slots own, copied out.
pub(crate) fn owned_of(buffers: &[Tensor], slots: &Slots) -> Vec<Vec<f32>> {
    buffers
        .iter()
        .enumerate()
        .map(|(i, buffer)| {
            let mut buffer = buffer.shallow_clone();
            // SAFETY: a bucket's buffer its reduction has finished with, read here alone.
            let flat = unsafe { host_slice(&mut buffer) };
            flat[owned_span(slots, i, flat.len())].to_vec()
        })
        .collect()
}

/// The places in `ranges` of those owned by a worker holding `slots`: range u + 1 of every
/// bucket, for each slot u held.
pub(crate) fn owned(ranges: &[Range], slots: &Slots) -> Vec<usize> {
    let v = slots.count;
    (0..ranges.len()).filter(|&r| slots.holds((ranges[r].chunk + v - 1) % v)).collect()
}
