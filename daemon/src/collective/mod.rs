//! Collectives among the workers of a run: the abortable ring data plane ([`ring`]) on a
//! persistent listener ([`listener`]), its abort switch ([`abort`]), and gradient averaging
//! over fused buckets ([`buckets`]). It knows nothing of training or plugins.

pub mod abort;
pub mod buckets;
pub mod listener;
pub mod ring;
pub mod slots;

pub use abort::AbortSignal;
pub use listener::DataListener;
pub use ring::{CollectiveError, ReduceOp, Ring};
pub use slots::Slots;

use std::sync::atomic::{AtomicU64, Ordering};

static SENT_BYTES: AtomicU64 = AtomicU64::new(0);
static BUSY_NANOS: AtomicU64 = AtomicU64::new(0);

/// Bytes this process sent in all-reduces, and seconds it spent in them, since it started.
pub fn traffic() -> (u64, f64) {
    (SENT_BYTES.load(Ordering::Relaxed), BUSY_NANOS.load(Ordering::Relaxed) as f64 / 1e9)
}

fn count_traffic(bytes: u64, took: std::time::Duration) {
    SENT_BYTES.fetch_add(bytes, Ordering::Relaxed);
    BUSY_NANOS.fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
}
