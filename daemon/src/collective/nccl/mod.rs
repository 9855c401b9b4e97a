//! Gradients reduced on the GPU with NCCL, in trainerd's fixed order, abortable.
//!
//! **Which NCCL.** The one libtorch already loaded: `libtorch_cuda.so` needs `libnccl.so.2`, so
//! [`library`] opens that name with `RTLD_NOLOAD` (the copy in the process, never a second one),
//! and libtorch's CUDA runtime the same way. Below NCCL 2.26 it is refused: `ncclCommAbort` could
//! hang there (pytorch#149153), and abort is how a lost peer is survived.
//!
//! **The order of the sums.** NCCL's own all-reduce adds in an order that follows its topology,
//! channels and rank count, so its bits would change when a worker holds several slots (virtual
//! ranks) or the cluster runs short. trainerd uses NCCL to move bytes only (grouped
//! `ncclSend`/`ncclRecv`) and adds on the device itself, in the ring's order:
//! 1. all-to-all: chunk c of every slot's buffer goes to the worker holding slot c;
//! 2. that worker adds chunk c as the V-slot ring does (slot c, then c+1, ... c+V-1, mod V), with
//!    libtorch's element-wise float32 additions, which round as the host's do;
//! 3. all-gather: each reduced chunk goes to every worker.
//!
//! Each worker sends 2(V-1)/V of the buffer, as a ring all-reduce does, and the result is bit for
//! bit the host ring's ([`crate::collective::ring`]), whoever holds which slots. Two workers with
//! a slot each exchange their whole buffers in one group instead (the same bytes, one NCCL kernel
//! instead of two), and each adds a + b, the ring's one addition.
//!
//! **Transport settings.** `NCCL_P2P_NET_CHUNKSIZE` is 512 KiB unless set ([`crate::sys::accel`]):
//! over the socket transport NCCL's 128 KiB default halved send/recv throughput. Ranks that may
//! share a GPU (`NCCL_HOSTID` set) first wait for their own backward pass and meet at a one-float
//! ring barrier, so that no NCCL kernel spins on the shared GPU while the peer still computes.
//!
//! **No thread stays blocked.** Communicators are non-blocking (`blocking = 0`): their creation
//! and every enqueue return at once and are completed by polling `ncclCommGetAsyncError`; a
//! collective's completion is a CUDA event polled with `cudaEventQuery`, never a synchronising
//! libtorch call behind a kernel that may hang. Between polls the generation's [`AbortSignal`]
//! and the collective timeout are checked; either aborts the communicator (`ncclCommAbort` makes
//! NCCL's kernels return) and the collective fails. A communicator belongs to one generation;
//! the next builds a new one, its creation overlapping the state transfer.
//!
//! [`AbortSignal`]: super::AbortSignal

use std::collections::HashMap;
use std::ffi::{c_char, c_int};
use std::ops::Range;
use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

use super::slots::Slots;
use super::CollectiveError;

mod group;
mod library;

pub(crate) use group::NcclGroup;
pub use group::Settings;

pub use library::{library, Nccl, NcclError};
pub(crate) use library::{unique_id, usable_on, version_text, UNIQUE_ID_BYTES};
use library::{
    Config, CudaEvent, NcclComm, UniqueId, CUDA_EVENT_DISABLE_TIMING, CUDA_NOT_READY, CUDA_SUCCESS, DEFAULT_STREAM,
    NCCL_FLOAT32, NCCL_IN_PROGRESS, NCCL_SUCCESS,
};

/// What a collective checks between polls: `Err` when its generation was aborted.
pub(crate) type AbortCheck<'a> = &'a dyn Fn() -> Result<(), CollectiveError>;

/// A non-blocking NCCL communicator of one generation: this worker's place among `world`.
pub(crate) struct Comm {
    nccl: &'static Nccl,
    comm: NcclComm,
    device: c_int,
    place: usize,
    world: usize,
    /// Whether its creation is known to have completed.
    ready: bool,
    /// When its creation began, and how long it took once known.
    started: Instant,
    created_in: Option<Duration>,
    /// Whether `created_in` was handed out ([`Comm::take_created_in`]).
    told: bool,
    event: CudaEvent,
}

// SAFETY: an NCCL communicator and a CUDA event may be used from any thread, one at a time; the
// `&mut self` methods ensure one at a time.
unsafe impl Send for Comm {}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm").field("place", &self.place).field("world", &self.world).finish()
    }
}

fn nccl_failure(op: &'static str, message: String) -> CollectiveError {
    CollectiveError::Nccl { op, message }
}

impl Comm {
    /// Starts creating this worker's communicator (place `place` of `world`, on CUDA device
    /// `device`) from the id every worker received; returns at once.
    pub(crate) fn start(id: &[u8], world: usize, place: usize, device: usize) -> Result<Comm, CollectiveError> {
        let nccl = library().map_err(|e| nccl_failure("creating the communicator", e.to_string()))?;
        let id: [u8; UNIQUE_ID_BYTES] = id
            .try_into()
            .map_err(|_| nccl_failure("creating the communicator", format!("an id of {} bytes", id.len())))?;
        let id = UniqueId { internal: id.map(|b| b as c_char) };
        let device = device as c_int;
        let mut config = Config::non_blocking();
        let mut comm: NcclComm = std::ptr::null_mut();
        let mut event: CudaEvent = std::ptr::null_mut();
        // SAFETY: valid out-pointers and config; the id is the 128 bytes ncclGetUniqueId made.
        unsafe {
            let code = (nccl.cuda_set_device)(device);
            if code != CUDA_SUCCESS {
                return Err(nccl_failure(
                    "creating the communicator",
                    format!("cudaSetDevice({device}): {}", nccl.cuda_error(code)),
                ));
            }
            let code = (nccl.cuda_event_create)(&mut event, CUDA_EVENT_DISABLE_TIMING);
            if code != CUDA_SUCCESS {
                return Err(nccl_failure(
                    "creating the communicator",
                    format!("cudaEventCreate: {}", nccl.cuda_error(code)),
                ));
            }
            let code = (nccl.comm_init_rank_config)(&mut comm, world as c_int, id, place as c_int, &mut config);
            if code != NCCL_SUCCESS && code != NCCL_IN_PROGRESS {
                (nccl.cuda_event_destroy)(event);
                let message = format!("ncclCommInitRankConfig: {}", nccl.nccl_error(code, comm));
                if !comm.is_null() {
                    (nccl.comm_abort)(comm);
                }
                return Err(nccl_failure("creating the communicator", message));
            }
        }
        Ok(Comm {
            nccl,
            comm,
            device,
            place,
            world,
            ready: false,
            started: Instant::now(),
            created_in: None,
            told: false,
            event,
        })
    }

    /// How long the communicator took to create, the first time it is known to be ready (`None`
    /// before, and after).
    pub(crate) fn take_created_in(&mut self) -> Option<Duration> {
        if self.told {
            return None;
        }
        self.told = self.created_in.is_some();
        self.created_in
    }

    /// Waits, polling, until NCCL has finished what it was doing in the background (the
    /// communicator's creation, or an enqueue that returned "in progress"); fails on NCCL's
    /// error, on `check`, or at `deadline` (aborting the communicator).
    fn settle(&mut self, op: &'static str, deadline: Instant, check: AbortCheck<'_>) -> Result<(), CollectiveError> {
        let mut spins = 0u32;
        loop {
            let mut state = NCCL_SUCCESS;
            // SAFETY: a live communicator and a valid out-pointer.
            let code = unsafe { (self.nccl.comm_get_async_error)(self.comm, &mut state) };
            let state = if code == NCCL_SUCCESS { state } else { code };
            match state {
                NCCL_SUCCESS => {
                    if !self.ready {
                        self.ready = true;
                        self.created_in = Some(self.started.elapsed());
                    }
                    return Ok(());
                }
                NCCL_IN_PROGRESS => {}
                e => {
                    let message = self.nccl.nccl_error(e, self.comm);
                    self.abort();
                    return Err(nccl_failure(op, message));
                }
            }
            self.poll_checks(op, deadline, check)?;
            pause(&mut spins);
        }
    }

    fn poll_checks(
        &mut self,
        op: &'static str,
        deadline: Instant,
        check: AbortCheck<'_>,
    ) -> Result<(), CollectiveError> {
        if let Err(e) = check() {
            self.abort();
            return Err(e);
        }
        if Instant::now() >= deadline {
            self.abort();
            let what = if self.ready { "did not complete" } else { "the communicator was not created" };
            return Err(nccl_failure(op, format!("{what} within the collective timeout; communicator aborted")));
        }
        Ok(())
    }

    /// Aborts the communicator: NCCL's kernels in flight return, nothing waits for a peer.
    fn abort(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: a live communicator, aborted once (then forgotten).
            unsafe { (self.nccl.comm_abort)(self.comm) };
            self.comm = std::ptr::null_mut();
        }
    }

    fn enqueue(
        &mut self,
        op: &'static str,
        code: c_int,
        deadline: Instant,
        check: AbortCheck<'_>,
    ) -> Result<(), CollectiveError> {
        match code {
            NCCL_SUCCESS => Ok(()),
            NCCL_IN_PROGRESS => self.settle(op, deadline, check),
            e => {
                let message = self.nccl.nccl_error(e, self.comm);
                self.abort();
                Err(nccl_failure(op, message))
            }
        }
    }

    /// One group of sends and receives: `(tensor, peer place, send?)`, in the order both sides
    /// list them.
    fn exchange(
        &mut self,
        op: &'static str,
        moves: &[Move],
        deadline: Instant,
        check: AbortCheck<'_>,
    ) -> Result<(), CollectiveError> {
        if moves.is_empty() {
            return Ok(());
        }
        if self.comm.is_null() {
            return Err(nccl_failure(op, "the communicator was aborted".into()));
        }
        // SAFETY: group calls bracket the sends and receives; each pointer is a contiguous float32
        // CUDA tensor of `numel` elements that `moves` keeps alive until the caller has seen the
        // collective's event complete.
        unsafe {
            let code = (self.nccl.group_start)();
            self.enqueue(op, code, deadline, check)?;
            for (t, peer, send) in moves {
                let (n, peer) = (t.numel(), *peer as c_int);
                let code = if *send {
                    (self.nccl.send)(t.data_ptr(), n, NCCL_FLOAT32, peer, self.comm, DEFAULT_STREAM)
                } else {
                    (self.nccl.recv)(t.data_ptr(), n, NCCL_FLOAT32, peer, self.comm, DEFAULT_STREAM)
                };
                if code != NCCL_SUCCESS && code != NCCL_IN_PROGRESS {
                    let message = self.nccl.nccl_error(code, self.comm);
                    (self.nccl.group_end)();
                    self.abort();
                    return Err(nccl_failure(op, message));
                }
            }
            let code = (self.nccl.group_end)();
            self.enqueue(op, code, deadline, check)
        }
    }

    /// Waits for everything queued on the stream so far by polling a CUDA event.
    fn complete(&mut self, op: &'static str, deadline: Instant, check: AbortCheck<'_>) -> Result<(), CollectiveError> {
        // SAFETY: our event, recorded on the default stream of the current device.
        let code = unsafe { (self.nccl.cuda_event_record)(self.event, DEFAULT_STREAM) };
        if code != CUDA_SUCCESS {
            return Err(nccl_failure(op, format!("cudaEventRecord: {}", self.nccl.cuda_error(code))));
        }
        let mut spins = 0u32;
        loop {
            // SAFETY: our recorded event.
            match unsafe { (self.nccl.cuda_event_query)(self.event) } {
                CUDA_SUCCESS => break,
                CUDA_NOT_READY => {}
                e => {
                    self.abort();
                    return Err(nccl_failure(op, format!("cudaEventQuery: {}", self.nccl.cuda_error(e))));
                }
            }
            // A peer that died can surface as NCCL's asynchronous error before any timeout.
            let mut state = NCCL_SUCCESS;
            let asked = !self.comm.is_null()
                // SAFETY: a live (not aborted) communicator and a valid out-pointer.
                && unsafe { (self.nccl.comm_get_async_error)(self.comm, &mut state) } == NCCL_SUCCESS;
            if asked && state != NCCL_SUCCESS && state != NCCL_IN_PROGRESS {
                let message = self.nccl.nccl_error(state, self.comm);
                self.abort();
                return Err(nccl_failure(op, message));
            }
            self.poll_checks(op, deadline, check)?;
            pause(&mut spins);
        }
        Ok(())
    }

    /// Waits, polling a CUDA event, until the device has done everything queued so far (this
    /// worker's backward pass).
    pub(crate) fn wait_for_device(&mut self, timeout: Duration, check: AbortCheck<'_>) -> Result<(), CollectiveError> {
        // SAFETY: sets this thread's device to the communicator's.
        unsafe { (self.nccl.cuda_set_device)(self.device) };
        self.complete("waiting for the backward pass", Instant::now() + timeout, check)
    }

    /// Sums `bufs` (one contiguous float32 CUDA buffer per slot this worker holds, in slot order,
    /// of equal lengths) over every slot of the run, in the V-slot ring's order; on return
    /// `bufs[0]` holds the sum on every worker, bit for bit the ring's (the others are scratch).
    /// `slots` says which slots this worker holds; every place holds the ranges
    /// [`assign`](super::slots::assign) gives for `world` workers.
    pub(crate) fn all_reduce_slots(
        &mut self,
        bufs: &[Tensor],
        slots: &Slots,
        timeout: Duration,
        check: AbortCheck<'_>,
    ) -> Result<(), CollectiveError> {
        const OP: &str = "all-reduce (NCCL)";
        let deadline = Instant::now() + timeout;
        // SAFETY: sets this thread's device to the communicator's.
        unsafe { (self.nccl.cuda_set_device)(self.device) };
        if !self.ready {
            self.settle("creating the communicator", deadline, check)?;
        }
        let (v, me, len) = (slots.count, self.place, bufs[0].numel());
        if self.world == 2 && v == 2 {
            return self.exchange_and_add(&bufs[0], deadline, check);
        }
        let layout = Layout::new(slots, self.world, me, len);
        // 1. All-to-all: chunk c of each slot to the holder of slot c.
        let (moves, received) = layout.all_to_all(bufs);
        self.exchange(OP, &moves, deadline, check)?;
        // 2. Each chunk held here, added in the ring's order, into the first buffer.
        let sums = layout.add_held_chunks(bufs, &received);
        // 3. All-gather: each reduced chunk from its holder to every other worker.
        let gather = layout.all_gather(&bufs[0]);
        self.exchange(OP, &gather, deadline, check)?;
        self.complete(OP, deadline, check)?;
        drop((moves, received, sums, gather));
        Ok(())
    }
}

impl Comm {
    /// Two workers holding a slot each: the whole buffers cross in one group (each sends what it
    /// would send in the two phases together), and each adds the two, which for V = 2 is the
    /// ring's one addition per element (a + b, the same bits whichever side adds). One NCCL
    /// kernel per all-reduce instead of two: on a GPU shared by both ranks, each NCCL kernel
    /// waits on the GPU for its peer's.
    fn exchange_and_add(
        &mut self,
        mine: &Tensor,
        deadline: Instant,
        check: AbortCheck<'_>,
    ) -> Result<(), CollectiveError> {
        const OP: &str = "all-reduce (NCCL)";
        let other = 1 - self.place;
        let theirs = Tensor::empty([mine.numel() as i64], (Kind::Float, mine.device()));
        let moves = [(mine.shallow_clone(), other, true), (theirs.shallow_clone(), other, false)];
        self.exchange(OP, &moves, deadline, check)?;
        let _no_grad = tch::no_grad_guard();
        let mut sum = mine.shallow_clone();
        sum += &theirs;
        self.complete(OP, deadline, check)?;
        drop((moves, theirs));
        Ok(())
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // Abort rather than destroy: destroying waits for peers, which may be gone.
        self.abort();
        // SAFETY: our event, no longer recorded on anything we wait for.
        unsafe { (self.nccl.cuda_event_destroy)(self.event) };
    }
}

/// One send (`true`) or receive of a tensor with the worker at a place.
type Move = (Tensor, usize, bool);

/// Who holds what in a V-slot all-reduce over `world` workers (each holding the contiguous slots
/// [`assign`](super::slots::assign) gives), seen from the worker at place `me`; buffers of `len` elements.
struct Layout {
    v: usize,
    len: usize,
    me: usize,
    world: usize,
    /// The first slot held here.
    first: usize,
    ranges: Vec<Range<usize>>,
}

fn part(t: &Tensor, r: &Range<usize>) -> Tensor {
    t.narrow(0, r.start as i64, r.len() as i64)
}

impl Layout {
    fn new(slots: &Slots, world: usize, me: usize, len: usize) -> Layout {
        let ranges = slots.layout.clone();
        debug_assert_eq!((ranges.len(), &ranges[me]), (world, &slots.held));
        debug_assert!(ranges.iter().all(|r| r.end <= slots.count), "NCCL's layout does not wrap past the last slot");
        Layout { v: slots.count, len, me, world, first: slots.held.start, ranges }
    }

    fn holder(&self, slot: usize) -> usize {
        self.ranges.iter().position(|r| r.contains(&slot)).expect("every slot is held")
    }

    fn chunk(&self, c: usize) -> Range<usize> {
        chunk_of(c, self.v, self.len)
    }

    /// The all-to-all's sends and receives, listed in (chunk, slot) order on both sides so that
    /// each pair of workers matches them in order; the receive buffers by (chunk, slot).
    fn all_to_all(&self, bufs: &[Tensor]) -> (Vec<Move>, HashMap<(usize, usize), Tensor>) {
        let (mut moves, mut received) = (Vec::new(), HashMap::new());
        for c in 0..self.v {
            let r = self.chunk(c);
            for s in 0..self.v {
                let (owner, from) = (self.holder(c), self.holder(s));
                if owner == from || r.is_empty() {
                    continue;
                }
                if from == self.me {
                    moves.push((part(&bufs[s - self.first], &r), owner, true));
                } else if owner == self.me {
                    let t = Tensor::empty([r.len() as i64], (Kind::Float, bufs[0].device()));
                    received.insert((c, s), t.shallow_clone());
                    moves.push((t, from, false));
                }
            }
        }
        (moves, received)
    }

    /// Adds each chunk held here over every slot in the ring's order into `bufs[0]`; returns the
    /// sums (to be kept until the device is done with them).
    fn add_held_chunks(&self, bufs: &[Tensor], received: &HashMap<(usize, usize), Tensor>) -> Vec<Tensor> {
        let _no_grad = tch::no_grad_guard();
        let mut sums = Vec::new();
        for c in self.ranges[self.me].clone() {
            let r = self.chunk(c);
            if r.is_empty() {
                continue;
            }
            let of = |s: usize| {
                if self.holder(s) == self.me {
                    part(&bufs[s - self.first], &r)
                } else {
                    received[&(c, s)].shallow_clone()
                }
            };
            let parts: Vec<Tensor> = (0..self.v).map(of).collect();
            let sum = ring_order_sum(&parts, c);
            part(&bufs[0], &r).copy_(&sum);
            sums.push(sum);
        }
        sums
    }

    /// The all-gather's sends and receives of `first` (the reduced buffer), in chunk order.
    fn all_gather(&self, first: &Tensor) -> Vec<Move> {
        let mut moves = Vec::new();
        for c in 0..self.v {
            let (r, owner) = (self.chunk(c), self.holder(c));
            if r.is_empty() {
                continue;
            }
            if owner == self.me {
                moves.extend((0..self.world).filter(|&p| p != self.me).map(|p| (part(first, &r), p, true)));
            } else {
                moves.push((part(first, &r), owner, false));
            }
        }
        moves
    }
}

/// Spins briefly, then yields, then sleeps: completion is usually microseconds away.
fn pause(spins: &mut u32) {
    *spins += 1;
    if *spins < 1000 {
        std::hint::spin_loop();
    } else if *spins < 5000 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Chunk `c` (taken modulo `v`) of a buffer of `len` elements cut into `v` chunks: the ring's.
pub(crate) fn chunk_of(c: usize, v: usize, len: usize) -> Range<usize> {
    (c % v) * len / v..(c % v + 1) * len / v
}

/// The sum of `parts` (one tensor per slot, in slot order) for chunk `c`, in the V-slot ring's
/// order: slot c first, then c+1, ... c+V-1 (mod V).
pub(crate) fn ring_order_sum(parts: &[Tensor], c: usize) -> Tensor {
    let v = parts.len();
    let mut sum = &parts[c % v] + &parts[(c + 1) % v];
    for k in 2..v {
        sum += &parts[(c + k) % v];
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::slots::assign;
    use crate::collective::{ReduceOp, Ring};
    use tch::Device;

    /// The claim the NCCL path rests on, checked on the CPU: chunk by chunk, the ring order's
    /// sums of libtorch's float32 additions are bit for bit the host ring's, for any V.
    #[test]
    fn ring_order_sums_on_tensors_are_the_host_rings_bits() {
        for (v, len) in [(2, 1000), (3, 1001), (4, 7), (5, 4096), (8, 333)] {
            let slots: Vec<Vec<f32>> = (0..v)
                .map(|s| {
                    let t = Tensor::randn([len as i64], (Kind::Float, Device::Cpu)) * (10f64).powi(s as i32 % 4 - 2);
                    Vec::<f32>::try_from(t).unwrap()
                })
                .collect();
            // The host ring, one worker holding every slot (the V-slot ring's hops in memory).
            let mut ring = Ring::single();
            ring.set_slots(Slots::all(v));
            let mut copies = slots.clone();
            let mut views: Vec<&mut [f32]> = copies.iter_mut().map(|b| b.as_mut_slice()).collect();
            ring.all_reduce_slots(&mut views, ReduceOp::Sum).unwrap();
            // Chunk by chunk, as the NCCL path's holder of each chunk adds it.
            let tensors: Vec<Tensor> = slots.iter().map(|b| Tensor::from_slice(b)).collect();
            let mut ours = Vec::with_capacity(len);
            for c in 0..v {
                let r = chunk_of(c, v, len);
                if r.is_empty() {
                    continue;
                }
                let parts: Vec<Tensor> = tensors.iter().map(|t| t.narrow(0, r.start as i64, r.len() as i64)).collect();
                ours.extend(Vec::<f32>::try_from(ring_order_sum(&parts, c)).unwrap());
            }
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&ours), bits(&copies[0]), "V = {v}, {len} elements");
        }
    }

    /// The three phases over W workers holding V slots, with NCCL's matching of each pair's
    /// sends and receives in order played on the CPU: every worker ends with the host ring's bits.
    #[test]
    fn the_phases_pair_up_and_give_the_host_rings_bits_whoever_holds_the_slots() {
        for (v, world, len) in [(3, 2, 1000), (4, 3, 999), (5, 5, 4096), (4, 2, 3), (7, 3, 5000)] {
            let slots: Vec<Tensor> = (0..v).map(|_| Tensor::randn([len as i64], (Kind::Float, Device::Cpu))).collect();
            let mut ring = Ring::single();
            ring.set_slots(Slots::all(v));
            let mut copies: Vec<Vec<f32>> = slots.iter().map(|t| Vec::<f32>::try_from(t).unwrap()).collect();
            let mut views: Vec<&mut [f32]> = copies.iter_mut().map(|b| b.as_mut_slice()).collect();
            ring.all_reduce_slots(&mut views, ReduceOp::Sum).unwrap();
            let ranges = assign(v, &(0..world).collect::<Vec<_>>());
            let layouts: Vec<Layout> =
                (0..world).map(|me| Layout::new(&Slots::of(v, ranges.clone(), me), world, me, len)).collect();
            let bufs: Vec<Vec<Tensor>> = ranges.iter().map(|r| r.clone().map(|s| slots[s].copy()).collect()).collect();
            let (moves, received): (Vec<_>, Vec<_>) = layouts.iter().zip(&bufs).map(|(l, b)| l.all_to_all(b)).unzip();
            deliver(&moves);
            for ((l, b), r) in layouts.iter().zip(&bufs).zip(&received) {
                l.add_held_chunks(b, r);
            }
            deliver(&layouts.iter().zip(&bufs).map(|(l, b)| l.all_gather(&b[0])).collect::<Vec<_>>());
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            for (w, b) in bufs.iter().enumerate() {
                let ours = Vec::<f32>::try_from(&b[0]).unwrap();
                assert_eq!(bits(&ours), bits(&copies[0]), "V = {v}, {world} workers, worker {w}");
            }
        }
    }

    /// NCCL's pairing: the n-th send from place a to b fills the n-th receive at b from a.
    fn deliver(moves: &[Vec<Move>]) {
        for (from, sends) in moves.iter().enumerate() {
            for (to, theirs) in moves.iter().enumerate() {
                let out: Vec<&Tensor> = sends.iter().filter(|m| m.2 && m.1 == to).map(|m| &m.0).collect();
                let into: Vec<&Tensor> = theirs.iter().filter(|m| !m.2 && m.1 == from).map(|m| &m.0).collect();
                assert_eq!(out.len(), into.len(), "sends from {from} to {to} and receives match");
                for (o, i) in out.iter().zip(into) {
                    assert_eq!(o.numel(), i.numel());
                    i.shallow_clone().copy_(o);
                }
            }
        }
    }

    #[test]
    fn nccl_is_refused_on_the_cpu_naming_nccl_and_cuda() {
        let e = usable_on(Device::Cpu).err().unwrap().to_string();
        assert_eq!(e, "--collective nccl needs CUDA: NCCL moves CUDA tensors only, and this worker trains on cpu");
    }

    #[test]
    fn versions_read_as_nccl_writes_them() {
        assert_eq!(version_text(22907), "2.29.7");
        assert_eq!(version_text(library::MIN_VERSION), "2.26.0");
    }
}
