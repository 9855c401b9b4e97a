//! Collectives among the workers of a run, behind one interface ([`Collective`]): all-reduce
//! over the run's slots, broadcast, barrier, and abort. Two backends implement it: [`ring`], TCP
//! connections carrying host memory, and [`nccl`], NCCL moving GPU memory beside a ring; both
//! add in the V-slot ring's order, so they give the same bits. [`Backend`] is the choice, made
//! once at start-up (`--collective`, [`choose`]); each generation forms it anew over its ring
//! ([`Backend::form`]), so a third backend is one module and one arm there.
//!
//! What every backend shares: the slots (virtual ranks, [`slots`]), the generation's abort switch
//! ([`abort`]), the session's traffic counters ([`Traffic`]), and the gradient buckets that any
//! backend reduces ([`buckets`]). It knows nothing of training, plugins or membership, and reads
//! no environment: what it needs to know is handed to it.

pub(crate) mod abort;
pub(crate) mod buckets;
pub mod nccl;
pub(crate) mod overlap;
pub(crate) mod ring;
pub(crate) mod slots;

pub use abort::AbortSignal;
pub(crate) use abort::Aborted;
pub use ring::listener::DataListener;
pub use ring::{Link, Ring};
pub use slots::Slots;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tch::{Device, Kind, Tensor};

/// A reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over ranks.
    Mean,
}

/// A collective that failed.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// No data (or no progress) from a peer within the deadline.
    #[error("{op}: {peer} sent nothing for {timeout:?}; it may have died or hung")]
    Timeout {
        /// The collective.
        op: &'static str,
        /// The peer, named.
        peer: String,
        /// Its rank.
        rank: usize,
        /// The deadline.
        timeout: Duration,
    },
    /// The connection to a peer broke.
    #[error("{op}: connection to {peer} failed: {source}")]
    Io {
        /// The collective.
        op: &'static str,
        /// The peer, named.
        peer: String,
        /// Its rank.
        rank: usize,
        /// What the OS said.
        source: std::io::Error,
    },
    /// NCCL failed, or did not complete in time (its communicator is then aborted).
    #[error("{op}: {message}")]
    Nccl {
        /// The collective.
        op: &'static str,
        /// What NCCL or CUDA said.
        message: String,
    },
    /// A collective this backend does not have (the sharded step's halves on NCCL).
    #[error("{op}: not available on this backend")]
    Unsupported {
        /// The collective.
        op: &'static str,
    },
    /// The ring could not be formed.
    #[error("forming the ring: {0}")]
    Setup(#[source] SetupError),
    /// The generation was aborted (a peer failed, or the cluster moved on).
    #[error("generation {generation} aborted: {reason}")]
    Aborted {
        /// The generation.
        generation: u64,
        /// Why.
        reason: String,
    },
}

impl CollectiveError {
    /// The peer this failure points at, when it points at one.
    pub(crate) fn suspect(&self) -> Option<usize> {
        match self {
            CollectiveError::Timeout { rank, .. } | CollectiveError::Io { rank, .. } => Some(*rank),
            _ => None,
        }
    }
}

/// Why a generation's ring could not be formed.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// The previous place's connection did not arrive in time.
    #[error("{peer} did not connect in time")]
    NotConnected {
        /// The peer, named.
        peer: String,
    },
    /// The next place could not be reached in time.
    #[error(
        "could not connect to {peer} at {addr}: {}",
        last.as_ref().map_or("deadline passed".to_string(), ToString::to_string)
    )]
    Unreachable {
        /// The peer, named.
        peer: String,
        /// Its data address.
        addr: std::net::SocketAddr,
        /// The last attempt's failure, if there was an attempt.
        last: Option<std::io::Error>,
    },
    /// The next place did not pass the authentication handshake.
    #[error("authenticating to {peer} at {addr}: {source}")]
    Authentication {
        /// The peer, named.
        peer: String,
        /// Its data address.
        addr: std::net::SocketAddr,
        /// Why.
        source: crate::auth::AuthError,
    },
    /// The connection's hello could not be sent.
    #[error("sending hello to {peer}: {source}")]
    Hello {
        /// The peer, named.
        peer: String,
        /// Why.
        source: std::io::Error,
    },
    /// A connection's options could not be set.
    #[error("{0}")]
    Socket(#[source] std::io::Error),
}

/// What carries one generation's collectives among its workers. Every method but the accessors
/// is collective: each worker of the generation calls it, in the same order. A failure names the
/// peer it points at, and every backend's collectives end at once when the generation's
/// [`AbortSignal`] is raised (a peer failed, or the cluster moved on): that is how a collective
/// is aborted, from any thread.
pub trait Collective: Send + std::fmt::Debug {
    /// The generation it belongs to.
    fn generation(&self) -> u64;
    /// This worker's place among the generation's workers (the ring's order).
    fn rank(&self) -> usize;
    /// Workers in the generation.
    fn world(&self) -> usize;
    /// The run's slots, and the ones this worker holds.
    fn slots(&self) -> &Slots;
    /// Whether [`Collective::all_reduce_buffers`] takes buffers on the model's CUDA device
    /// (`true`) or in host memory (`false`).
    fn on_device(&self) -> bool;
    /// Sums `bufs` (one contiguous float32 buffer per slot held here, in slot order, of equal
    /// lengths, where [`Collective::on_device`] says) over every slot of the run, in the V-slot
    /// ring's order: on return `bufs[0]` holds the sum on every worker, bit for bit the same
    /// whichever backend and whoever holds which slots (the others are scratch). Nothing else
    /// may touch the buffers meanwhile.
    fn all_reduce_buffers(&mut self, bufs: &mut [Tensor]) -> Result<(), CollectiveError>;
    /// The first half of [`Collective::all_reduce_buffers`] (its operands the same): on return,
    /// for each slot u held here, `bufs[u - first]` holds range u + 1 (mod V) of the buffer
    /// (elements `[c·len/V, (c+1)·len/V)`, the ranges of [`buckets::Ranges`]) summed over every
    /// slot, bit for bit what the all-reduce gives there; the rest is scratch.
    fn reduce_scatter_buffers(&mut self, bufs: &mut [Tensor]) -> Result<(), CollectiveError> {
        let _ = bufs;
        Err(CollectiveError::Unsupported { op: "reduce-scatter" })
    }
    /// The second half: each held slot u's range u + 1 (in `bufs[u - first]`, whatever it now
    /// holds) is copied into `bufs[0]` on every worker, which then holds every range.
    fn all_gather_buffers(&mut self, bufs: &mut [Tensor]) -> Result<(), CollectiveError> {
        let _ = bufs;
        Err(CollectiveError::Unsupported { op: "all-gather" })
    }
    /// Sends `send` (host values) to the next worker of the generation's ring while receiving the
    /// previous worker's into `recv`, whose length both know: how an owner's ranges of a sharded
    /// optimizer reach their buddy. Each side is a list of slices taken in order as one stream
    /// (the values sent from where they lie, those received written where they belong). Only
    /// with two workers or more.
    fn shift_to_next(&mut self, send: &[&[f32]], recv: &mut [&mut [f32]]) -> Result<(), CollectiveError> {
        let _ = (send, recv);
        Err(CollectiveError::Unsupported { op: "shift" })
    }
    /// [`Collective::shift_to_next`] the other way round: `send` to the previous worker, the
    /// next worker's into `recv` (a sharded optimizer's range moving back to a neighbour).
    fn shift_to_previous(&mut self, send: &[&[f32]], recv: &mut [&mut [f32]]) -> Result<(), CollectiveError> {
        let _ = (send, recv);
        Err(CollectiveError::Unsupported { op: "shift" })
    }
    /// Reduces host values over every slot of the run (one buffer per slot held here, in slot
    /// order, of equal lengths), as [`Collective::all_reduce_buffers`] does; the result in
    /// `bufs[0]`.
    fn all_reduce_values(&mut self, bufs: &mut [&mut [f64]], op: ReduceOp) -> Result<(), CollectiveError>;
    /// Reduces one host buffer per worker (not per slot) over the generation's workers.
    fn all_reduce_workers(&mut self, buf: &mut [f64], op: ReduceOp) -> Result<(), CollectiveError>;
    /// Copies place `root`'s `buf` to every worker.
    fn broadcast(&mut self, root: usize, buf: &mut [u8]) -> Result<(), CollectiveError>;
    /// Copies place `root`'s bytes, of any length, to every worker (`bytes` is ignored
    /// elsewhere).
    fn broadcast_bytes(&mut self, root: usize, bytes: Vec<u8>) -> Result<Vec<u8>, CollectiveError>;
    /// Returns once every worker of the generation has reached it.
    fn barrier(&mut self) -> Result<(), CollectiveError>;
    /// Fails when the generation was aborted: long work between collectives checks it, so as
    /// not to finish what the cluster has abandoned.
    fn check_abort(&self) -> Result<(), CollectiveError>;
    /// What this backend built for the generation beside its connections (NCCL's
    /// communicator), and how long that took: once, when first known.
    fn take_setup(&mut self) -> Option<(&'static str, Duration)> {
        None
    }
}

/// Bytes sent in all-reduces and seconds spent in them: a session's counters, which every
/// generation's backend adds to.
#[derive(Clone, Debug, Default)]
pub struct Traffic(Arc<Counters>);

#[derive(Debug, Default)]
struct Counters {
    bytes: AtomicU64,
    nanos: AtomicU64,
}

impl Traffic {
    /// An all-reduce sent `bytes` and took `took`.
    pub(crate) fn count(&self, bytes: u64, took: Duration) {
        self.0.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.0.nanos.fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Bytes sent and seconds spent so far.
    pub(crate) fn totals(&self) -> (u64, f64) {
        (self.0.bytes.load(Ordering::Relaxed), self.0.nanos.load(Ordering::Relaxed) as f64 / 1e9)
    }
}

/// The elements of a contiguous float32 host tensor.
///
/// # Safety
/// Nothing else may read or write `t`'s storage while the slice lives.
pub(crate) unsafe fn host_slice(t: &mut Tensor) -> &mut [f32] {
    assert!(
        t.device() == Device::Cpu && t.kind() == Kind::Float && t.is_contiguous(),
        "a contiguous float32 host tensor"
    );
    let len = t.numel();
    // SAFETY: the storage holds `len` f32 values (checked above), exclusively ours per the
    // contract, and outlives the borrow of `t`.
    unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, len) }
}

/// Why `--collective` cannot be what it says.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub(crate) enum BackendError {
    /// No backend of that name.
    #[error("--collective {choice}: expected ring, nccl or auto")]
    Unknown {
        /// What was given.
        choice: String,
    },
    /// NCCL on a worker that does not train on CUDA.
    #[error("--collective nccl needs CUDA: NCCL moves CUDA tensors only, and this worker trains on {device}")]
    NeedsCuda {
        /// The worker's device.
        device: String,
    },
    /// NCCL cannot be used in this process.
    #[error("--collective nccl: {0}")]
    Nccl(#[from] nccl::NcclError),
}

/// What carries the gradients, chosen once at start-up (`--collective`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The host-staged TCP ring ([`ring`]).
    Ring,
    /// NCCL on the device ([`nccl`]).
    Nccl(nccl::Settings),
}

impl Backend {
    /// How it enters the run configuration every worker must agree on (`None` for the ring, so
    /// that the configuration of ring runs, and of their checkpoints, stays as it was).
    pub(crate) fn agreement(self) -> Option<String> {
        match self {
            Backend::Ring => None,
            Backend::Nccl(n) => Some(format!("nccl {} (send/recv, ring-order sums)", nccl::version_text(n.version))),
        }
    }

    /// For the start-up line.
    pub(crate) fn describe(self) -> String {
        match self {
            Backend::Ring => "host-staged ring".into(),
            Backend::Nccl(n) => format!("NCCL {} (ring-order sums on the device)", nccl::version_text(n.version)),
        }
    }

    /// A generation's collectives over its newly formed `ring`: the ring itself, or NCCL beside
    /// it (whose communicator's creation goes on while the caller moves the state).
    pub fn form(self, ring: Ring) -> Result<Box<dyn Collective>, CollectiveError> {
        match self {
            Backend::Ring => Ok(Box::new(ring)),
            Backend::Nccl(settings) => nccl::NcclGroup::over(ring, settings),
        }
    }
}

/// What a worker's host offers NCCL: the other workers of its cluster on it, the GPUs visible,
/// and whether ranks may share a GPU (`NCCL_HOSTID` set), and then whether they enter NCCL
/// together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Host {
    /// Other workers of the cluster on this host.
    pub(crate) sharing: usize,
    /// GPUs visible here.
    pub(crate) gpus: usize,
    /// Each rank has its own `NCCL_HOSTID`, so that NCCL accepts two on one GPU.
    pub(crate) hostid: bool,
    /// Ranks sharing a GPU wait for their backward pass and meet at a barrier before NCCL
    /// (`TRAINERD_NCCL_ENTER_TOGETHER=0` turns it off, to measure what it does).
    pub(crate) enter_together: bool,
}

/// The backend `--collective CHOICE` gives a worker training on `device` on `host`; with `auto`,
/// also why not NCCL. `auto` is NCCL only when it can run here and no two workers can land on one
/// GPU (NCCL refuses two ranks on one GPU unless each has its own `NCCL_HOSTID`).
pub(crate) fn choose(choice: &str, device: Device, host: Host) -> Result<(Backend, Option<String>), BackendError> {
    let settings = |n: &nccl::Nccl| {
        let Device::Cuda(index) = device else { unreachable!("NCCL is usable on CUDA only") };
        Backend::Nccl(nccl::Settings { version: n.version(), device: index, enter_together: host.enter_together })
    };
    match choice {
        "ring" => Ok((Backend::Ring, None)),
        "nccl" => nccl::usable_on(device).map(|n| (settings(n), None)),
        "auto" => {
            let nccl = match nccl::usable_on(device) {
                Ok(n) => n,
                Err(why) => return Ok((Backend::Ring, Some(why.to_string().replace("--collective nccl", "NCCL")))),
            };
            if host.hostid || host.sharing < host.gpus {
                Ok((settings(nccl), None))
            } else {
                Ok((
                    Backend::Ring,
                    Some(format!(
                        "{} workers share this host's {} GPU(s) and NCCL refuses two ranks on one GPU (set NCCL_HOSTID \
                         per worker to use it anyway)",
                        host.sharing + 1,
                        host.gpus
                    )),
                ))
            }
        }
        other => Err(BackendError::Unknown { choice: other.into() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backend_follows_the_flag_and_auto_says_why_not_nccl() {
        assert_eq!(choose("ring", Device::Cpu, Host::default()), Ok((Backend::Ring, None)));
        assert_eq!(
            choose("nccl", Device::Cpu, Host::default()).unwrap_err().to_string(),
            "--collective nccl needs CUDA: NCCL moves CUDA tensors only, and this worker trains on cpu"
        );
        assert_eq!(
            choose("auto", Device::Cpu, Host { sharing: 1, ..Host::default() }),
            Ok((
                Backend::Ring,
                Some("NCCL needs CUDA: NCCL moves CUDA tensors only, and this worker trains on cpu".into())
            ))
        );
        assert_eq!(
            choose("gloo", Device::Cpu, Host::default()).unwrap_err().to_string(),
            "--collective gloo: expected ring, nccl or auto"
        );
        assert_eq!(Backend::Ring.agreement(), None, "ring runs keep their run configuration");
        assert_eq!(
            Backend::Nccl(nccl::Settings { version: 22809, device: 0, enter_together: false }).agreement().as_deref(),
            Some("nccl 2.28.9 (send/recv, ring-order sums)")
        );
    }
}
