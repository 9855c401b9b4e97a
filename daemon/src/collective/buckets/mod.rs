//! Gradient averaging over any backend ([`super::Collective`]): the parameters' gradients are
//! fused into buckets of at most a fixed size (small tensors travel together, one collective per
//! bucket), staged as float32 where the backend takes them (host memory for the ring, on CUDA
//! too, as TensorFlow's RING does; the device for NCCL), one copy per slot this worker holds,
//! averaged over the run's slots, and written back.
//!
//! A few extra values (the step's loss and metric sums) ride along in the first bucket, summed
//! rather than averaged, so that the progress line shows global figures at no extra cost.

use std::sync::Arc;

use tch::{Device, Kind, Tensor};

use super::{host_slice, Collective, CollectiveError};

mod held;
mod pool;
mod ranges;

pub(crate) use held::{bytes_of, values_bytes, Gauge};
pub(crate) use pool::{Pool, KEPT_PER_SLOT};
pub(crate) use ranges::{bucket_views, owned, owned_of, write_group, Range};

/// The bucket the tail rides in (the step's extra values and one used-flag per parameter): the
/// first, whose gradients the backward pass makes final last (the first parameters' come last),
/// so that it is reduced after the backward pass anyway, and every other bucket can be reduced
/// during it ([`super::overlap`]).
pub(crate) const TAIL: usize = 0;

/// Default bucket size in MiB, as PyTorch DDP's `bucket_cap_mb`.
pub(crate) const DEFAULT_BUCKET_MB: f64 = 25.0;
/// The same in bytes.
#[cfg(test)]
pub(crate) const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// Which parameters go in which bucket, and each bucket's host buffer per slot held.
#[derive(Debug)]
pub(crate) struct Buckets {
    /// Parameter indices per bucket, in parameter order.
    groups: Vec<Vec<usize>>,
    /// Per slot held, per bucket: a float32 host buffer, pinned when the parameters are on CUDA,
    /// made on first use and reused every step.
    staging: Vec<Vec<Option<Tensor>>>,
    /// Per slot staged: the length of its extra values.
    extras: Vec<usize>,
    /// Whether the buffers live on the parameters' CUDA device (the backend takes them there) rather than
    /// on the host.
    on_device: bool,
    /// The parameters' device (the first replica's, when several stage into these buffers).
    home: Device,
    /// Per bucket: reduced in this step already, while the backward pass ran
    /// ([`super::overlap`]).
    reduced: Vec<bool>,
    /// The slot held whose buffers are its gradients' own memory (host buffers of CPU
    /// parameters: the last slot this worker computes, whose gradients are views of them, as
    /// DDP's `gradient_as_bucket_view`); the others' gradients are copied into theirs.
    in_place: Option<usize>,
    /// `--shard gradients`: no gradient is a view of a bucket, each is let go once staged, and a
    /// bucket's buffers are let go once reduce-scattered, only the ranges this worker owns kept
    /// (`kept`; docs/fault-tolerance.md, "Sharded gradients and parameters").
    compact: bool,
    /// Per slot held, per bucket (compact): the range that slot owns, as its reduce-scatter left
    /// it (empty: none yet).
    kept: Vec<Vec<Vec<f32>>>,
    /// Per bucket: its buffer's length (its gradients, and the tail in the [`TAIL`] bucket), as
    /// last made.
    lens: Vec<usize>,
    /// Per slot staged, per parameter: whether it had a gradient when its bucket was staged (the
    /// tail's used-flags; compact, the gradient is gone by the time the tail is staged).
    defined: Vec<Vec<bool>>,
    /// Per parameter: a gradient of it was staged before in this process.
    seen: Vec<bool>,
    /// What the gradients and buckets hold, at its peak (shared with the reducing thread).
    gauge: Arc<Gauge>,
    /// Compact: the buffers lent to the buckets and kept from step to step (shared with the
    /// reducing thread, which gives them back).
    pool: Arc<Pool>,
}

/// The staging buffer in `slot`, made (zeros: on `home`'s device when `on_device`, else in host
/// memory, pinned for a CUDA `home`) unless it holds `len` elements already.
fn buffer_of(slot: &mut Option<Tensor>, len: usize, (home, on_device): (Device, bool)) -> &mut Tensor {
    if slot.as_ref().is_none_or(|t| t.numel() != len) {
        *slot = Some(if on_device {
            Tensor::zeros([len as i64], (Kind::Float, home))
        } else {
            host_buffer(len, home, true)
        });
    }
    slot.as_mut().expect("made above")
}

/// A float32 host buffer of `len` elements, pinned for fast copies to and from `device`: zeros
/// if `zeroed`, else values unspecified (its user writes them all).
fn host_buffer(len: usize, device: Device, zeroed: bool) -> Tensor {
    let options = (Kind::Float, Device::Cpu);
    let t = if zeroed { Tensor::zeros([len as i64], options) } else { Tensor::empty([len as i64], options) };
    if device.is_cuda() {
        // `_pin_memory`, not `pin_memory`: tch passes a device, which `pin_memory` warns about
        // on every call since PyTorch 2.5.
        t.internal_pin_memory(device)
    } else {
        t
    }
}

impl Buckets {
    /// Groups `params` into buckets of at most `cap_bytes` of float32 each (a larger tensor gets
    /// a bucket of its own), in their names' natural order ([`natural_order`]).
    #[cfg(test)]
    pub(crate) fn new(params: &[(String, Tensor)], cap_bytes: usize) -> Buckets {
        Buckets::in_modules_order(params, cap_bytes, &[])
    }

    /// [`Buckets::new`], in the order the model registers its parameters where the plugin gives
    /// it (`modules`: their names, a tied one where it comes first, as [`crate::plugin::registered_names`]
    /// gives them; [`modules_order`]).
    pub(crate) fn in_modules_order(params: &[(String, Tensor)], cap_bytes: usize, modules: &[String]) -> Buckets {
        let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
        let mut bytes = 0;
        for i in modules_order(params, modules) {
            let size = params[i].1.numel() * 4;
            if bytes + size > cap_bytes && !groups.last().expect("one group").is_empty() {
                groups.push(Vec::new());
                bytes = 0;
            }
            groups.last_mut().expect("one group").push(i);
            bytes += size;
        }
        let home = params.first().map_or(Device::Cpu, |(_, p)| p.device());
        let pool = Arc::new(Pool::for_buckets(params, &groups, home));
        let (reduced, lens) = (vec![false; groups.len()], vec![0; groups.len()]);
        let seen = vec![false; params.len()];
        let (staging, extras, kept, defined) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let compact = false;
        Buckets {
            groups,
            staging,
            extras,
            on_device: false,
            home,
            reduced,
            in_place: None,
            compact,
            kept,
            lens,
            defined,
            seen,
            gauge: Arc::default(),
            pool,
        }
    }

    /// `--shard gradients` on or off for the steps that follow (changing it lets every buffer
    /// and kept range go): see [`Buckets::compact`].
    pub(crate) fn set_compact(&mut self, on: bool) {
        if on != self.compact {
            self.compact = on;
            self.staging.clear();
            self.kept.clear();
            self.pool.clear();
            // Gradients that were views of the buffers keep that memory until staged and let go.
            self.in_place = None;
        }
    }

    /// These buckets, compact if `on` ([`Buckets::set_compact`]).
    #[cfg(test)]
    pub(crate) fn compact_if(mut self, on: bool) -> Self {
        self.set_compact(on);
        self
    }

    /// Whether a slot's gradients are views of its buffers (this step's in-place staging).
    pub(crate) fn grads_are_views(&self) -> bool {
        self.in_place.is_some()
    }

    /// Whether the buffers are let go once reduced (`--shard gradients`).
    pub(crate) fn compact(&self) -> bool {
        self.compact
    }

    /// The bytes the buckets hold now: their buffers, the ranges kept of them, and the buffers
    /// kept for the next step ([`Buckets::idle_bytes`]).
    pub(crate) fn bytes(&self) -> u64 {
        let buffers: u64 = self.staging.iter().flatten().flatten().map(held::bytes_of).sum();
        buffers + self.kept.iter().map(|per_slot| values_bytes(per_slot)).sum::<u64>() + self.idle_bytes()
    }

    /// Compact: the bytes of the buffers kept for the next bucket or step and lent to none now.
    pub(crate) fn idle_bytes(&self) -> u64 {
        self.pool.idle_bytes()
    }

    /// Replaces every gradient with its mean over the ring's slots, and `extra` with its sum:
    /// [`Buckets::stage`] then [`Buckets::reduce`] for a worker holding one slot (the tests' way in;
    /// a step stages each slot it holds, then reduces).
    #[cfg(test)]
    pub(crate) fn all_reduce(
        &mut self,
        ring: &mut dyn Collective,
        params: &mut [(String, Tensor)],
        extra: &mut [f32],
    ) -> Result<(), CollectiveError> {
        self.stage(0, params, extra);
        let reduced = self.reduce(ring, params, 1)?;
        extra.copy_from_slice(&reduced);
        Ok(())
    }

    /// A step begins: staged on the parameters' CUDA device for NCCL (`true`), or in host
    /// memory for the ring, as the generation's backend takes them (changing it drops the buffers
    /// made for the other), and no bucket reduced yet. `last`: the last slot this worker computes,
    /// when it computes them all on the first replica's parameters: with host buffers of CPU
    /// parameters, its gradients become views of its buffers (their own memory), so that the
    /// backward pass accumulates into them and nothing is copied.
    pub(crate) fn begin_step(&mut self, on_device: bool, last: Option<usize>) {
        self.reduced.iter_mut().for_each(|r| *r = false);
        self.gauge.settle();
        let in_place = last.filter(|_| !on_device && self.home == Device::Cpu && !self.compact);
        if in_place != self.in_place {
            // The gradients are views of that slot's buffers: the slot gets buffers of its own,
            // so that the next backward pass does not write over what another slot staged there.
            if let Some(bufs) = self.in_place.and_then(|s| self.staging.get_mut(s)) {
                bufs.iter_mut().for_each(|b| *b = None);
            }
            self.in_place = in_place;
        }
        if self.on_device != on_device {
            self.on_device = on_device;
            self.staging.clear();
        }
        let staged: Vec<&Tensor> = self.staging.iter().flatten().flatten().collect();
        self.pool.reclaim(&staged);
    }

    /// Copies the gradients of the `i`th slot held here (zeros for parameters without one) and
    /// its `extra` values into that slot's host buffers, as float32, with one used-flag per
    /// parameter after `extra` in the [`TAIL`] bucket. On CUDA each bucket's gradients are joined on
    /// the device and cross in one copy; on the CPU each is copied into the buffer directly.
    /// `params` may be another replica's, on another device: the buffers stay where the first
    /// replica's parameters are.
    #[cfg(test)]
    pub(crate) fn stage(&mut self, i: usize, params: &[(String, Tensor)], extra: &[f32]) {
        let params: Vec<&Tensor> = params.iter().map(|(_, p)| p).collect();
        self.stage_buckets(i, &params, extra, 0..self.groups.len());
    }

    /// [`Buckets::stage`] of buckets `which` only: `extra` and the used-flags ride in the [`TAIL`]
    /// bucket, when `which` holds it.
    pub(crate) fn stage_buckets(&mut self, i: usize, params: &[&Tensor], extra: &[f32], which: std::ops::Range<usize>) {
        let _no_grad = tch::no_grad_guard();
        self.slots_up_to(i + 1);
        self.defined[i].resize(params.len(), false);
        for b in which.clone() {
            self.groups[b].iter().for_each(|&p| self.defined[i][p] = params[p].grad().defined());
        }
        let mut tail: Vec<f32> = Vec::new();
        if which.contains(&TAIL) {
            self.extras[i] = extra.len();
            tail.extend_from_slice(extra);
            tail.extend(self.defined[i].iter().map(|&d| if d { 1.0 } else { 0.0 }));
        }
        for b in which {
            let group = &self.groups[b];
            let riding: &[f32] = if b == TAIL { &tail } else { &[] };
            let numels: Vec<usize> = group.iter().map(|&i| params[i].numel()).collect();
            let grads_len: usize = numels.iter().sum();
            let (home, on_device) = (self.home, self.on_device);
            self.lens[b] = grads_len + riding.len();
            if self.compact {
                let (own, slots) = (own_memory(params, group).filter(|_| b != TAIL), self.staging.len());
                self.pool.lend(&mut self.staging[i][b], own, (self.lens[b], slots));
            }
            let buffer = buffer_of(&mut self.staging[i][b], grads_len + riding.len(), (home, on_device));
            if self.in_place == Some(i) {
                stage_as_views(buffer, params, group);
            } else {
                let grads: Vec<Option<Tensor>> = group
                    .iter()
                    .map(|&i| {
                        let g = params[i].grad();
                        g.defined().then(|| g.detach().view(-1))
                    })
                    .collect();
                stage_in(buffer, &grads, &numels, params[group[0]].device());
            }
            // The most the gradients and buckets hold: this buffer made, its gradients not yet
            // let go.
            self.gauge.read(self.held_here(params));
            let buffer = self.staging[i][b].as_mut().expect("made above");
            if self.on_device {
                if !riding.is_empty() {
                    buffer.narrow(0, grads_len as i64, riding.len() as i64).copy_(&Tensor::from_slice(riding));
                }
                continue;
            }
            // SAFETY: our own contiguous float32 host buffer; the copies into it have completed
            // (copy_ waits), and nothing else touches it.
            let flat = unsafe { host_slice(buffer) };
            flat[grads_len..].copy_from_slice(riding);
            if self.compact {
                let_go(flat, (params, group), &mut self.seen);
            }
            group.iter().filter(|&&p| self.defined[i][p]).for_each(|&p| self.seen[p] = true);
        }
    }

    /// Handles on bucket `b`'s buffers of the first `held` slots, staged, for a reduction on
    /// another thread; compact, the buckets keep none, so that the buffers are freed once that
    /// reduction lets them go ([`Buckets::put_kept`] takes what it kept of them), and they are
    /// away in the [`Buckets::gauge`] until then.
    pub(crate) fn hand_over(&mut self, b: usize, held: usize) -> Vec<Tensor> {
        assert!(!self.on_device && b != TAIL, "host buffers of whole buckets only");
        if !self.compact {
            return self.slot_buffers(b, held);
        }
        let taken: Vec<Tensor> =
            self.staging[..held].iter_mut().map(|per_slot| per_slot[b].take().expect("staged")).collect();
        self.gauge.away(taken.iter().map(held::bytes_of).sum());
        taken
    }

    /// What the gradients and buckets hold, at its peak, shared with the reducing thread (which
    /// counts the buffers handed to it, and the ranges it keeps, until it lets them go or hands
    /// them back).
    pub(crate) fn gauge(&self) -> Arc<Gauge> {
        Arc::clone(&self.gauge)
    }

    /// The buffers compact buckets lend, shared with the reducing thread, which gives back those
    /// handed to it once it lets them go.
    pub(crate) fn pool(&self) -> Arc<Pool> {
        Arc::clone(&self.pool)
    }

    /// The bytes held here now: every buffer, the ranges kept, and the gradients of `params`
    /// (the replica staged) that are no buffer's memory.
    fn held_here(&self, params: &[&Tensor]) -> u64 {
        let buffers: Vec<&Tensor> = self.staging.iter().flatten().flatten().collect();
        self.bytes() + held::gradients_apart(params, &buffers)
    }

    /// Room for the buffers of `n` slots.
    fn slots_up_to(&mut self, n: usize) {
        while self.staging.len() < n {
            self.staging.push(self.groups.iter().map(|_| None).collect());
            self.extras.push(0);
            self.defined.push(Vec::new());
        }
    }

    /// The buffers of bucket `b` of the first `held` slots staged (shallow handles).
    fn slot_buffers(&self, b: usize, held: usize) -> Vec<Tensor> {
        self.staging[..held].iter().map(|per_slot| per_slot[b].as_ref().expect("staged").shallow_clone()).collect()
    }

    /// Reduces what the first `held` slots staged over every slot of the ring (the gradients
    /// averaged over the run's V slots, the extra values summed), in the V-slot ring's order;
    /// writes the averages into every parameter's gradient and returns the summed extras.
    ///
    /// A parameter that no slot has a gradient for keeps none (the optimizer skips it, exactly as
    /// it does with one worker); one that some slot has a gradient for gets the average here.
    pub(crate) fn reduce(
        &mut self,
        collective: &mut dyn Collective,
        params: &mut [(String, Tensor)],
        held: usize,
    ) -> Result<Vec<f32>, CollectiveError> {
        let _no_grad = tch::no_grad_guard();
        let scale = 1.0 / collective.slots().count as f32;
        let extra = self.extras[0];
        let mut tail = Vec::new();
        // Parameters without a gradient here, with their average.
        let mut missing = Vec::new();
        for b in 0..self.groups.len() {
            let mut bufs = self.slot_buffers(b, held);
            if !std::mem::take(&mut self.reduced[b]) {
                collective.all_reduce_buffers(&mut bufs)?;
            }
            if self.on_device {
                let riding = self.on_device_result(params, (b, &bufs[0]), scale, &mut missing);
                if b == TAIL {
                    tail = riding;
                }
                continue;
            }
            let group = &self.groups[b];
            let grads_len: usize = group.iter().map(|&i| params[i].1.numel()).sum();
            // SAFETY: the first slot's own staging buffer, reduced above, touched by nothing else.
            let flat = unsafe { host_slice(&mut bufs[0]) };
            flat[..grads_len].iter_mut().for_each(|x| *x *= scale);
            if b == TAIL {
                tail = flat[grads_len..].to_vec();
            }
            let buffer = self.staging[0][b].as_ref().expect("staged");
            let device = params[group[0]].1.device();
            let averaged = buffer.narrow(0, 0, grads_len as i64);
            let averaged = if device.is_cuda() { averaged.to_device(device) } else { averaged };
            write_back(params, group, &averaged, &mut missing);
        }
        for (i, averaged) in missing {
            if tail[extra + i] > 0.0 {
                // Used elsewhere: give it a gradient here and take the average.
                let p = &params[i].1;
                crate::sys::autograd::ensure_grad(p);
                p.grad().copy_(&averaged.view_as(p));
            }
        }
        tail.truncate(extra);
        Ok(tail)
    }
}

/// The places of `params` in the order the model registers them (`modules`, a Python module's
/// `state_dict()` order: a tied weight where it comes first, with the token embedding), those it
/// does not name after them in their names' natural order ([`natural_order`]). The backward pass
/// makes gradients final in about the reverse of that order, the token embedding's (used first,
/// and by a tied head last) at its very end: so the bucket that holds it is the first, reduced
/// after the backward pass, and every other is complete in turn from the last down while the
/// backward pass goes on. By names alone, `tok.weight` or `transformer.wte.weight` would sort
/// after the blocks, into the bucket the reducing thread awaits first, and no bucket could be
/// reduced or let go before the backward pass ended (bench/fsdp.sh's GPT, 2026-11-30). Every
/// member has the same plugin file and arguments, so the same order.
fn modules_order(params: &[(String, Tensor)], modules: &[String]) -> Vec<usize> {
    let place: std::collections::HashMap<&str, usize> =
        modules.iter().enumerate().rev().map(|(at, name)| (name.as_str(), at)).collect();
    let mut order = natural_order(params);
    // Stable: those not named keep their natural order, after the named ones.
    order.sort_by_key(|&i| place.get(params[i].0.as_str()).copied().unwrap_or(usize::MAX));
    order
}

/// The places of `params` in their names' natural order: a run of digits compares as the number
/// it spells, so that layer 2 comes before layer 10 (`h.2.` before `h.10.`, `dense_2` before
/// `dense_10`), as the model makes them, while the names' plain order (the parameters' order
/// everywhere else) puts 10 before 2. The backward pass makes the last layers' gradients final
/// first: buckets in this order are complete in turn, from the last down, as DDP's (in the
/// modules' order) are, and the reducing thread takes them as they come. Every member has the
/// same names, so the same buckets.
fn natural_order(params: &[(String, Tensor)]) -> Vec<usize> {
    #[derive(PartialEq, Eq, PartialOrd, Ord)]
    enum Run<'a> {
        Number(u128, usize),
        Text(&'a str),
    }
    fn key(name: &str) -> Vec<Run<'_>> {
        let mut runs = Vec::new();
        let mut rest = name;
        while let Some(c) = rest.chars().next() {
            let digit = c.is_ascii_digit();
            let end = rest.find(|c: char| c.is_ascii_digit() != digit).unwrap_or(rest.len());
            let (run, tail) = rest.split_at(end);
            // The run's length too: "01" and "1" stay apart, in a fixed order.
            runs.push(match run.parse() {
                Ok(n) if digit => Run::Number(n, run.len()),
                _ => Run::Text(run),
            });
            rest = tail;
        }
        runs
    }
    let mut order: Vec<usize> = (0..params.len()).collect();
    order.sort_by(|&a, &b| key(&params[a].0).cmp(&key(&params[b].0)).then(a.cmp(&b)));
    order
}

impl Buckets {
    /// The start-up line about them: how many, and whether their reductions overlap the
    /// backward pass (`overlap`).
    pub(crate) fn describe(&self, cap_bytes: usize, overlap: bool) -> String {
        let n = self.groups.len();
        let cap = (cap_bytes as f64 / f64::from(1 << 20) * 1e3).round() / 1e3;
        let how = match (overlap, n) {
            (false, _) => "each reduced after the backward pass (--overlap off, or not the ring on CPU parameters)",
            (true, 1) => {
                "one bucket, reduced after the backward pass (a smaller --bucket-mb lets reductions start during it)"
            }
            (true, _) => {
                "each bucket but the first reduced during the backward pass, as soon as its gradients are final"
            }
        };
        format!("gradients in {n} bucket(s) of at most {cap} MB: {how}")
    }

    /// The buckets, as parameter places in parameter order.
    pub(crate) fn groups(&self) -> &[Vec<usize>] {
        &self.groups
    }

    /// The buckets a reduction may take during the backward pass: every one after the [`TAIL`]
    /// bucket, whose used-flags only the backward pass's end knows.
    pub(crate) fn early(&self) -> std::ops::Range<usize> {
        TAIL + 1..self.groups.len()
    }

    /// Buckets `which` were reduced in this step already: [`Buckets::reduce`] and
    /// [`Buckets::reduce_scatter_sums`] take their results as they are.
    pub(crate) fn mark_reduced(&mut self, which: impl IntoIterator<Item = usize>) {
        which.into_iter().for_each(|b| self.reduced[b] = true);
    }
}

impl Buckets {
    /// Bucket `b`'s sum over the slots (`sum`, on the device): its gradients averaged into the
    /// parameters (or into `missing`); returns the values riding after them, summed.
    fn on_device_result(
        &self,
        params: &[(String, Tensor)],
        (b, sum): (usize, &Tensor),
        scale: f32,
        missing: &mut Vec<(usize, Tensor)>,
    ) -> Vec<f32> {
        let group = &self.groups[b];
        let grads_len: usize = group.iter().map(|&i| params[i].1.numel()).sum();
        // As the host does: float32 times the float32 1/V.
        let mut averaged = sum.narrow(0, 0, grads_len as i64);
        averaged *= f64::from(scale);
        write_back(params, group, &averaged, missing);
        let rest = sum.numel() - grads_len;
        if rest == 0 {
            return Vec::new();
        }
        let riding = sum.narrow(0, grads_len as i64, rest as i64).to_device(Device::Cpu);
        Vec::<f32>::try_from(riding).expect("float32 values")
    }
}

/// Copies a bucket's `averaged` values into the gradients of its parameters (`group`); those
/// without a gradient here go to `missing`, with their average.
fn write_back(params: &[(String, Tensor)], group: &[usize], averaged: &Tensor, missing: &mut Vec<(usize, Tensor)>) {
    let mut at = 0;
    for &i in group {
        let n = params[i].1.numel() as i64;
        let mut g = params[i].1.grad();
        let average = averaged.narrow(0, at, n);
        if g.defined() && g.data_ptr() == average.data_ptr() {
            // The gradient is a view of the bucket: averaged where it is.
        } else if g.defined() {
            g.copy_(&average.view_as(&g));
        } else {
            missing.push((i, averaged.narrow(0, at, n)));
        }
        at += n;
    }
}

/// Stages a bucket's gradients (`group` of `params`) in the front of its host `buffer` where they
/// are: a float32 gradient on the CPU that is not a view of its place in the buffer yet is copied
/// there once and made that view, so that the next backward passes accumulate into it; a
/// missing one is zeros there.
fn stage_as_views(buffer: &Tensor, params: &[&Tensor], group: &[usize]) {
    let mut at = 0;
    for &i in group {
        let p = params[i];
        let n = p.numel() as i64;
        let mut place = buffer.narrow(0, at, n);
        let g = p.grad();
        if !g.defined() {
            let _ = place.fill_(0.0);
        } else if g.data_ptr() != place.data_ptr() {
            place.copy_(&g.reshape(-1).to_kind(Kind::Float));
            if p.kind() == Kind::Float && p.device() == Device::Cpu {
                crate::sys::autograd::set_grad(p, &place.view(p.size().as_slice())).expect("a view of its own shape");
            }
        }
        at += n;
    }
}

/// Copies a bucket's gradients (zeros for the missing ones) into the front of its host `buffer`
/// as float32: on CUDA joined on the device first and copied in one piece, on the CPU one by one.
fn stage_in(buffer: &mut Tensor, grads: &[Option<Tensor>], numels: &[usize], device: Device) {
    if device.is_cuda() {
        let parts: Vec<Tensor> = grads
            .iter()
            .zip(numels)
            .map(|(g, &n)| match g {
                Some(g) => g.to_kind(Kind::Float),
                None => Tensor::zeros([n as i64], (Kind::Float, device)),
            })
            .collect();
        let joined = Tensor::cat(&parts, 0);
        buffer.narrow(0, 0, joined.numel() as i64).copy_(&joined);
        return;
    }
    let mut at = 0;
    for (g, &n) in grads.iter().zip(numels) {
        let mut slot = buffer.narrow(0, at, n as i64);
        match g {
            Some(g) => slot.copy_(&g.to_kind(Kind::Float)),
            None => _ = slot.fill_(0.0),
        }
        at += n as i64;
    }
}

/// The gradient of a bucket of one parameter (`group` of `params`), flattened, where it can be the
/// bucket's buffer itself: a contiguous float32 host tensor.
fn own_memory(params: &[&Tensor], group: &[usize]) -> Option<Tensor> {
    let [p] = group else { return None };
    let g = params[*p].grad();
    let fits = g.defined() && g.kind() == Kind::Float && g.device() == Device::Cpu && g.is_contiguous();
    fits.then(|| g.detach().view(-1))
}

/// A compact bucket's gradients (`group` of `params`), staged in `flat`, let go (`.grad` reset).
/// Those `seen` before are where a kept gradient would have been zeroed and added to, which turns
/// a -0.0 into +0.0: adding +0.0 here does the same, so that the bits are the whole gradients'.
fn let_go(flat: &mut [f32], (params, group): (&[&Tensor], &[usize]), seen: &mut [bool]) {
    let mut at = 0;
    for &p in group {
        let n = params[p].numel();
        if params[p].grad().defined() {
            if seen[p] {
                flat[at..at + n].iter_mut().for_each(|x| *x += 0.0);
            }
            crate::sys::autograd::release_grad(params[p]);
        }
        at += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parameter_unused_everywhere_keeps_no_gradient_and_one_used_somewhere_gets_the_average() {
        let out = crate::collective::ring::tests::with_ring(2, |ring| {
            let mut ps = params(&[3, 2, 4]);
            // p0: used by both; p1: used only by rank 1; p2: used by nobody.
            (ps[0].1.sum(Kind::Float) * 2.0).backward();
            if ring.rank() == 1 {
                (ps[1].1.sum(Kind::Float) * 4.0).backward();
            }
            let mut extra = [1.0f32];
            Buckets::new(&ps, 8).all_reduce(ring, &mut ps, &mut extra).unwrap();
            let grad = |i: usize| {
                let g = ps[i].1.grad();
                g.defined().then(|| Vec::<f32>::try_from(g).unwrap())
            };
            (grad(0), grad(1), grad(2), extra)
        });
        for (g0, g1, g2, extra) in out {
            assert_eq!(g0, Some(vec![2.0; 3]));
            assert_eq!(g1, Some(vec![2.0; 2]), "the average of 4 and a zero from the member that did not use it");
            assert_eq!(g2, None, "unused on every member: no gradient, as with one worker");
            assert_eq!(extra, [2.0]);
        }
    }

    fn params(sizes: &[i64]) -> Vec<(String, Tensor)> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (format!("p{i}"), Tensor::zeros([n], (Kind::Float, Device::Cpu)).set_requires_grad(true)))
            .collect()
    }

    #[test]
    fn buckets_follow_the_layers_in_their_names_natural_order() {
        let named = |names: &[&str]| -> Vec<(String, Tensor)> {
            names.iter().map(|n| (n.to_string(), Tensor::zeros([4], (Kind::Float, Device::Cpu)))).collect()
        };
        // A Sequential of 12 layers, as the model lists its names (plain order: 10 before 2).
        let mut names: Vec<String> = (0..12).flat_map(|l| [format!("{l}.bias"), format!("{l}.weight")]).collect();
        names.sort();
        let params = named(&names.iter().map(String::as_str).collect::<Vec<_>>());
        let b = Buckets::new(&params, 32);
        let grouped: Vec<Vec<&str>> =
            b.groups.iter().map(|g| g.iter().map(|&i| params[i].0.as_str()).collect()).collect();
        let layers: Vec<Vec<String>> = (0..12).map(|l| vec![format!("{l}.bias"), format!("{l}.weight")]).collect();
        assert_eq!(grouped, layers);
        // Keras's names, and numbers that are not layers.
        let params = named(&["dense_10/kernel", "dense/kernel", "dense_2/kernel", "h.01.w", "h.1.w"]);
        let order: Vec<&str> = natural_order(&params).iter().map(|&i| params[i].0.as_str()).collect();
        assert_eq!(order, ["dense/kernel", "dense_2/kernel", "dense_10/kernel", "h.1.w", "h.01.w"]);
    }

    #[test]
    fn buckets_follow_the_modules_order_where_the_plugin_gives_it() {
        let named = |names: &[&str]| -> Vec<(String, Tensor)> {
            names.iter().map(|n| (n.to_string(), Tensor::zeros([4], (Kind::Float, Device::Cpu)))).collect()
        };
        // The GPT example's names as the daemon lists them, and its state_dict()'s order.
        let params = named(&["blocks.0.w", "blocks.1.w", "ln_f.w", "pos.w", "spare", "tok.w"]);
        let modules: Vec<String> =
            ["tok.w", "pos.w", "blocks.0.w", "blocks.1.w", "ln_f.w", "tok.w"].iter().map(|n| n.to_string()).collect();
        let b = Buckets::in_modules_order(&params, 32, &modules);
        let grouped: Vec<Vec<&str>> =
            b.groups.iter().map(|g| g.iter().map(|&i| params[i].0.as_str()).collect()).collect();
        // The embeddings in the first bucket (reduced after the backward pass); one the plugin
        // does not name, last.
        assert_eq!(grouped, [vec!["tok.w", "pos.w"], vec!["blocks.0.w", "blocks.1.w"], vec!["ln_f.w", "spare"]]);
        // Without the plugin's order: the names' natural order, the embeddings last.
        let b = Buckets::in_modules_order(&params, 32, &[]);
        assert_eq!(b.groups, Buckets::new(&params, 32).groups);
        assert_eq!(
            b.groups.last().unwrap().iter().map(|&i| params[i].0.as_str()).collect::<Vec<_>>(),
            ["spare", "tok.w"]
        );
    }

    #[test]
    fn small_tensors_share_buckets() {
        let b = Buckets::new(&params(&[10, 10, 10, 1000, 5]), 100);
        assert_eq!(b.groups, vec![vec![0, 1], vec![2], vec![3], vec![4]]);
        let b = Buckets::new(&params(&[10, 10, 10]), DEFAULT_BUCKET_BYTES);
        assert_eq!(b.groups, vec![vec![0, 1, 2]]);
    }

    #[test]
    fn gradients_are_averaged_and_extras_summed() {
        let out = crate::collective::ring::tests::with_ring(3, |ring| {
            let mut ps = params(&[4, 6]);
            let r = ring.rank() as f64;
            for (_, p) in ps.iter_mut() {
                (p.sum(Kind::Float) * (r + 1.0)).backward();
            }
            let mut extra = [r as f32, 1.0];
            Buckets::new(&ps, 16).all_reduce(ring, &mut ps, &mut extra).unwrap();
            let g: Vec<f32> = ps.iter().flat_map(|(_, p)| Vec::<f32>::try_from(p.grad()).unwrap()).collect();
            (g, extra)
        });
        for (g, extra) in out {
            assert_eq!(g, vec![2.0; 10]);
            assert_eq!(extra, [3.0, 3.0]);
        }
    }
}
