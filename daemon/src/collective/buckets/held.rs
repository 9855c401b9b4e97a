//! What a step's gradients and buckets hold, and its peak (the summary's
//! `memory.gradient_bytes`): the gradients autograd made that are not a bucket's memory, the
//! buckets' buffers, those handed to the reducing thread and not yet let go, and the ranges kept
//! of them. It is read when a bucket is staged (its buffer made, its gradients not yet let go:
//! the most they hold), from either thread. It counts bytes; it decides nothing.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use tch::Tensor;

/// The bytes the buckets have handed away (to the reducing thread), and the most ever held.
#[derive(Debug, Default)]
pub(crate) struct Gauge {
    /// Bytes out of the buckets' sight: buffers handed over and ranges the reducing thread
    /// kept, until they come back or are let go.
    away: AtomicU64,
    /// The most held at any reading.
    peak: AtomicU64,
}

impl Gauge {
    /// `bytes` more handed away.
    pub(crate) fn away(&self, bytes: u64) {
        self.away.fetch_add(bytes, Relaxed);
    }

    /// `bytes` handed away are back in the buckets' sight, or let go.
    pub(crate) fn back(&self, bytes: u64) {
        self.away.fetch_sub(bytes, Relaxed);
    }

    /// A step begins: nothing is away (what a failed step's reducing thread held is gone).
    pub(crate) fn settle(&self) {
        self.away.store(0, Relaxed);
    }

    /// A reading: the buckets hold `here`, besides what is away.
    pub(crate) fn read(&self, here: u64) {
        self.peak.fetch_max(here + self.away.load(Relaxed), Relaxed);
    }

    /// The most held at any reading.
    pub(crate) fn peak(&self) -> u64 {
        self.peak.load(Relaxed)
    }
}

/// A tensor's bytes.
pub(crate) fn bytes_of(t: &Tensor) -> u64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as u64
}

/// The bytes of float32 `arrays` (ranges kept, clipped gradients).
pub(crate) fn values_bytes(arrays: &[Vec<f32>]) -> u64 {
    arrays.iter().map(|a| a.len() as u64 * 4).sum()
}

/// The bytes of the gradients of `params` that are not in the memory of any of `buffers` (a
/// gradient that is a view of its bucket, or a bucket staged in a gradient's own memory, counts
/// once).
pub(crate) fn gradients_apart(params: &[&Tensor], buffers: &[&Tensor]) -> u64 {
    let spans: Vec<(usize, usize)> = buffers.iter().map(|b| (b.data_ptr() as usize, bytes_of(b) as usize)).collect();
    let inside = |at: usize| spans.iter().any(|&(from, len)| at >= from && at < from + len);
    params
        .iter()
        .map(|p| p.grad())
        .filter(|g| g.defined() && !inside(g.data_ptr() as usize))
        .map(|g| bytes_of(&g))
        .sum()
}
