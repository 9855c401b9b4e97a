//! NCCL as a backend of [`Collective`]: a generation's communicator, made over the generation's
//! ring, carries the slot buffers on the GPU; the ring carries everything else (host values,
//! broadcasts, barriers), as NCCL moves CUDA memory only.

use std::time::{Duration, Instant};

use tch::Tensor;

use super::{unique_id, Comm};
use crate::collective::{Collective, CollectiveError, ReduceOp, Ring, Slots};

/// What a worker's NCCL backend is, as start-up chose it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// NCCL's version code (`22809` for 2.28.9): every worker must use one version.
    pub version: i32,
    /// The CUDA device whose memory NCCL moves.
    pub device: usize,
    /// Ranks may share a GPU: each waits for its own backward pass, and they meet at a one-float
    /// ring barrier before entering NCCL, so that no NCCL kernel spins on the shared GPU while
    /// the peer still computes.
    pub enter_together: bool,
}

/// A generation's collectives with NCCL: its ring, and the communicator made over it.
pub(crate) struct NcclGroup {
    ring: Ring,
    comm: Comm,
    enter_together: bool,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup").field("ring", &self.ring).field("comm", &self.comm).finish()
    }
}

impl NcclGroup {
    /// NCCL over `ring` on `settings`' device: place 0 makes the communicator's id and sends it
    /// over the ring; the creation goes on in NCCL's background while the caller does other work
    /// (the state transfer), and the first NCCL collective waits for it. A ring of one needs none
    /// and stays a ring.
    pub(crate) fn over(mut ring: Ring, settings: Settings) -> Result<Box<dyn Collective>, CollectiveError> {
        if ring.world() == 1 {
            return Ok(Box::new(ring));
        }
        let id = if ring.rank() == 0 {
            unique_id()
                .map_err(|e| CollectiveError::Nccl { op: "creating the communicator", message: e.to_string() })?
        } else {
            Vec::new()
        };
        let id = ring.broadcast_bytes(0, id)?;
        let comm = Comm::start(&id, ring.world(), ring.rank(), settings.device)?;
        Ok(Box::new(NcclGroup { ring, comm, enter_together: settings.enter_together }))
    }
}

impl Collective for NcclGroup {
    fn generation(&self) -> u64 {
        self.ring.generation()
    }

    fn rank(&self) -> usize {
        self.ring.rank()
    }

    fn world(&self) -> usize {
        self.ring.world()
    }

    fn slots(&self) -> &Slots {
        self.ring.slots()
    }

    fn on_device(&self) -> bool {
        true
    }

    /// The ring's sums on the device, over NCCL ([`Comm::all_reduce_slots`]): abortable through
    /// the generation's signal, bounded by the collective timeout.
    fn all_reduce_buffers(&mut self, bufs: &mut [Tensor]) -> Result<(), CollectiveError> {
        let began = Instant::now();
        let timeout = self.ring.timeout();
        if self.enter_together {
            let ring = &self.ring;
            self.comm.wait_for_device(timeout, &|| ring.check_abort())?;
            self.ring.barrier()?;
        }
        let ring = &self.ring;
        self.comm.all_reduce_slots(bufs, ring.slots(), timeout, &|| ring.check_abort())?;
        let (v, len) = (ring.slots().count, bufs[0].numel());
        ring.traffic().count((2 * (v - 1) * len / v * 4) as u64, began.elapsed());
        Ok(())
    }

    fn all_reduce_values(&mut self, bufs: &mut [&mut [f64]], op: ReduceOp) -> Result<(), CollectiveError> {
        self.ring.all_reduce_values(bufs, op)
    }

    fn all_reduce_workers(&mut self, buf: &mut [f64], op: ReduceOp) -> Result<(), CollectiveError> {
        self.ring.all_reduce_workers(buf, op)
    }

    fn broadcast(&mut self, root: usize, buf: &mut [u8]) -> Result<(), CollectiveError> {
        Collective::broadcast(&mut self.ring, root, buf)
    }

    fn broadcast_bytes(&mut self, root: usize, bytes: Vec<u8>) -> Result<Vec<u8>, CollectiveError> {
        self.ring.broadcast_bytes(root, bytes)
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.ring.barrier()
    }

    fn check_abort(&self) -> Result<(), CollectiveError> {
        self.ring.check_abort()
    }

    fn take_setup(&mut self) -> Option<(&'static str, Duration)> {
        self.comm.take_created_in().map(|took| ("NCCL communicator", took))
    }
}
