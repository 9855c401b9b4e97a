//! Compact buckets' buffers reused from step to step (`--shard gradients`): a bucket's buffer is
//! made while the backward pass stages it and let go once its reduce-scatter has kept the ranges
//! owned here, and the step's all-gather makes and lets go one more per bucket. Made anew each
//! time, those were a few large allocations and frees per bucket and step, which glibc keeps as
//! resident memory anyway (README, "It saves little memory"), each first written through fresh
//! pages. The pool keeps a few buffers of the largest bucket's length and lends a view of one at
//! each bucket's length; a buffer it lent comes back when its user is done with it, or when the
//! next step begins (a step that failed drops what it had). It decides nothing about the bits: a
//! buffer is written whole before it is read, as a new one was.

use std::sync::{Mutex, PoisonError};

use tch::{Device, Tensor};

use super::TAIL;

/// How many buffers per slot held the pool keeps: the buckets a reducing thread may hold (the
/// one it reduces and the next, `collective/overlap.rs`'s `IN_FLIGHT`) and the one the backward
/// pass has staged and hands over before it waits for room (the step's all-gather uses one per
/// bucket). A step that needs more, a worker holding several slots whose first slots' buckets
/// wait whole for the last, gets the others made apart, as before.
pub(crate) const KEPT_PER_SLOT: usize = 3;

/// Buffers lent and kept (see the module's paragraph).
#[derive(Debug)]
pub(crate) struct Pool {
    /// Each buffer's length: the largest bucket's that needs one (a longer one is made apart).
    len: usize,
    /// Where the buffers live: host memory, pinned for a CUDA device.
    home: Device,
    /// The buffers, each with whether it is lent now.
    buffers: Mutex<Vec<(Tensor, bool)>>,
}

impl Pool {
    /// An empty pool of buffers of `len` float32 elements, for parameters on `home`.
    pub(crate) fn new(len: usize, home: Device) -> Pool {
        Pool { len, home, buffers: Mutex::new(Vec::new()) }
    }

    /// An empty pool for the buckets `groups` of `params` (their places), on `home`. Its buffers'
    /// length is the longest bucket's of several parameters among those reduced during the
    /// backward pass, the ones in flight together (a bucket of one is staged in its gradient's
    /// own memory). The [`TAIL`] bucket, staged alone after the backward pass, borrows one where
    /// it fits, with its tail, and is made apart where it does not: a token embedding there (the
    /// GPT example's) would make every buffer its size.
    pub(crate) fn for_buckets(params: &[(String, Tensor)], groups: &[Vec<usize>], home: Device) -> Pool {
        let len = |group: &Vec<usize>| group.iter().map(|&p| params[p].1.numel()).sum::<usize>();
        let early = groups.iter().enumerate().filter(|&(b, g)| b != TAIL && g.len() > 1);
        // The tail: the step's extra values (a few sums: the loss's, the metrics') and a
        // used-flag per parameter.
        let tail = || groups.get(TAIL).map_or(0, len) + params.len() + 64;
        Pool::new(early.map(|(_, g)| len(g)).max().unwrap_or_else(tail), home)
    }

    /// A slot's buffer for a bucket of `len` elements, in `slot`: `own` where given (a bucket of
    /// one gradient is staged in that gradient's own memory, not copied), else the one in `slot`
    /// already if it fits, else one lent (to a worker holding `slots`).
    pub(crate) fn lend(&self, slot: &mut Option<Tensor>, own: Option<Tensor>, (len, slots): (usize, usize)) {
        let mut there = slot.take();
        if there.as_ref().is_some_and(|t| own.is_some() || t.numel() != len) {
            self.give_back(there.take());
        }
        *slot = Some(own.or(there).unwrap_or_else(|| self.take(len, slots)));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(Tensor, bool)>> {
        // Plain handles and flags: whatever a thread that held them did, they are whole.
        self.buffers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A host buffer of `len` float32 elements, its values unspecified (the caller writes them
    /// all): a view of a kept buffer not lent, else of one made for the pool while it keeps
    /// fewer than [`KEPT_PER_SLOT`] per slot of the `slots` held, else one made apart.
    pub(crate) fn take(&self, len: usize, slots: usize) -> Tensor {
        if len > self.len {
            return super::host_buffer(len, self.home, false);
        }
        let mut buffers = self.lock();
        if let Some((buffer, lent)) = buffers.iter_mut().find(|(_, lent)| !lent) {
            *lent = true;
            return buffer.narrow(0, 0, len as i64);
        }
        if buffers.len() >= KEPT_PER_SLOT * slots.max(1) {
            return super::host_buffer(len, self.home, false);
        }
        let buffer = super::host_buffer(self.len, self.home, false);
        let view = buffer.narrow(0, 0, len as i64);
        buffers.push((buffer, true));
        view
    }

    /// `done`, lent by [`Pool::take`] and no longer used (nor any other view of it), comes
    /// back; a buffer made apart, or a gradient's own memory, is simply dropped.
    pub(crate) fn give_back(&self, done: impl IntoIterator<Item = Tensor>) {
        let mut buffers = self.lock();
        for t in done {
            let at = t.data_ptr();
            if let Some((_, lent)) = buffers.iter_mut().find(|(b, _)| b.data_ptr() == at) {
                *lent = false;
            }
        }
    }

    /// A step begins: every buffer comes back but those `still` holds (the buckets staged and
    /// not yet handed over); a failed step dropped the rest where it was.
    pub(crate) fn reclaim(&self, still: &[&Tensor]) {
        let kept: Vec<usize> = still.iter().map(|t| t.data_ptr() as usize).collect();
        for (buffer, lent) in self.lock().iter_mut() {
            *lent = kept.contains(&(buffer.data_ptr() as usize));
        }
    }

    /// Lets every buffer go (the buckets changed their kind).
    pub(crate) fn clear(&self) {
        self.lock().clear();
    }

    /// The bytes of the buffers kept and not lent (those lent count where they are used).
    pub(crate) fn idle_bytes(&self) -> u64 {
        self.lock().iter().filter(|(_, lent)| !lent).map(|(b, _)| super::bytes_of(b)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_given_back_is_lent_again_and_each_slot_keeps_a_bounded_few() {
        let pool = Pool::new(100, Device::Cpu);
        let a = pool.take(60, 1);
        let a_at = a.data_ptr();
        assert_eq!(a.numel(), 60, "a view at the bucket's length");
        pool.give_back([a]);
        let again = pool.take(80, 1);
        assert_eq!(again.data_ptr(), a_at, "the same memory, lent again");
        // One slot: three kept at most; a fourth is made apart, and not kept when given back.
        let more: Vec<Tensor> = (0..3).map(|_| pool.take(100, 1)).collect();
        let kept: Vec<_> = std::iter::once(&again).chain(&more[..2]).map(Tensor::data_ptr).collect();
        assert!(!kept.contains(&more[2].data_ptr()));
        pool.give_back(more);
        pool.give_back([again]);
        assert_eq!(pool.idle_bytes(), 3 * 100 * 4);
        // Longer than the pool's buffers: made apart.
        assert_eq!(pool.take(101, 1).numel(), 101);
        // Two slots: six kept.
        let lent: Vec<Tensor> = (0..6).map(|_| pool.take(10, 2)).collect();
        assert_eq!(pool.idle_bytes(), 0);
        pool.give_back(lent);
        assert_eq!(pool.idle_bytes(), 6 * 100 * 4, "each lent from a buffer the pool keeps");
    }

    #[test]
    fn a_new_step_takes_back_what_a_failed_one_dropped_but_not_what_is_still_staged() {
        let pool = Pool::new(10, Device::Cpu);
        let (staged, dropped) = (pool.take(10, 1), pool.take(10, 1));
        drop(dropped);
        pool.reclaim(&[&staged]);
        assert_eq!(pool.idle_bytes(), 40);
        assert_ne!(pool.take(10, 1).data_ptr(), staged.data_ptr(), "the staged buffer stays lent");
    }
}
