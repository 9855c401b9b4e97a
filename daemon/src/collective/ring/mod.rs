//! The ring, the host backend of [`super::Collective`]: a ring of raw TCP connections (rank r
//! sends to r+1, receives from r-1) and the collectives over it, in host memory.
//!
//! All-reduce is reduce-scatter then all-gather: the buffer is cut into `world` chunks; each
//! chunk is summed hop by hop around the ring in a fixed order, lands complete on one rank, and
//! is then copied to every other rank. So the result is deterministic (the same additions in
//! the same order every time) and bit-identical on every rank (each chunk is computed once).
//! Each step sends one chunk while receiving another on a second thread, and received data is
//! added in pieces as it arrives.
//!
//! A ring belongs to one generation of the cluster. It is formed on each member's persistent
//! [`DataListener`] (connections carry the generation in their hello), and every collective on
//! it can be aborted from another thread through its [`AbortSignal`]: the sockets are shut down
//! and the collective fails with [`CollectiveError::Aborted`] at once. Every socket also has a
//! deadline (the collective timeout), a backstop that turns a silent peer into an error naming
//! it, never a hang.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

pub(crate) mod listener;

use bytemuck::Pod;

use tch::Tensor;

use super::abort::AbortSignal;
use super::slots::Slots;
use super::{host_slice, Collective, CollectiveError, ReduceOp, SetupError, Traffic};
use listener::DataListener;

/// A value the collectives can add.
pub trait Element: Pod + Send + Sync + std::ops::AddAssign {
    /// `self * factor`.
    fn scaled(self, factor: f64) -> Self;
}

impl Element for f32 {
    fn scaled(self, factor: f64) -> f32 {
        self * factor as f32
    }
}

impl Element for f64 {
    fn scaled(self, factor: f64) -> f64 {
        self * factor
    }
}

/// Elements added per piece while receiving (overlaps the next read with the additions).
const PIECE_BYTES: usize = 1 << 20;

/// This rank's place in the ring.
pub struct Ring {
    rank: usize,
    world: usize,
    generation: u64,
    next: Option<TcpStream>,
    prev: Option<TcpStream>,
    next_peer: Peer,
    prev_peer: Peer,
    link: Link,
    slots: Slots,
}

/// A neighbour in the ring: its name (for messages) and rank.
#[derive(Clone, Debug, Default)]
struct Peer {
    name: String,
    rank: usize,
}

/// What a generation's ring is formed with besides its members: the generation, the collective
/// timeout (every socket's deadline, a backstop), the generation's abort switch, and the
/// session's traffic counters. Every socket operation turns its error into the right
/// [`CollectiveError`] with it.
#[derive(Clone, Debug)]
pub struct Link {
    timeout: Duration,
    generation: u64,
    abort: AbortSignal,
    traffic: Traffic,
}

impl Link {
    /// The link of `generation`'s ring: sockets silent for `timeout` fail, `abort` ends its
    /// collectives, and what they send is counted in `traffic`.
    pub fn new(generation: u64, timeout: Duration, abort: &AbortSignal, traffic: &Traffic) -> Link {
        Link { timeout, generation, abort: abort.clone(), traffic: traffic.clone() }
    }

    fn error(&self, op: &'static str, peer: &Peer, source: std::io::Error) -> CollectiveError {
        if let Err(aborted) = self.abort.check(self.generation) {
            return aborted.into();
        }
        match source.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                CollectiveError::Timeout { op, peer: peer.name.clone(), rank: peer.rank, timeout: self.timeout }
            }
            _ => CollectiveError::Io { op, peer: peer.name.clone(), rank: peer.rank, source },
        }
    }

    fn check(&self) -> Result<(), CollectiveError> {
        Ok(self.abort.check(self.generation)?)
    }
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring").field("rank", &self.rank).field("world", &self.world).finish()
    }
}

impl Ring {
    /// A ring of one: every collective is a no-op (mean divides by one).
    pub(crate) fn single() -> Ring {
        Ring {
            rank: 0,
            world: 1,
            generation: 0,
            next: None,
            prev: None,
            next_peer: Peer::default(),
            prev_peer: Peer::default(),
            link: Link::new(0, Duration::MAX, &AbortSignal::new(), &Traffic::default()),
            slots: Slots::single(),
        }
    }

    /// Forms the ring of `link`'s generation, this worker at `place` of the workers `names`
    /// names (for messages): takes the connection of place-1 from `listener` and connects to
    /// `next_addr` (place+1), both within the link's timeout and abortable through its signal.
    pub fn form(
        listener: &DataListener,
        place: usize,
        names: &[String],
        next_addr: SocketAddr,
        link: Link,
    ) -> Result<Ring, CollectiveError> {
        let (world, generation, timeout) = (names.len(), link.generation, link.timeout);
        if world == 1 {
            return Ok(Ring { generation, link, slots: Slots::one(place, world), ..Ring::single() });
        }
        let abort = &link.abort;
        abort.arm(generation);
        let prev_rank = (place + world - 1) % world;
        let next_rank = (place + 1) % world;
        let deadline = Instant::now() + timeout;
        let (prev, next) = std::thread::scope(|s| {
            let accept = s.spawn(|| listener.take(generation, prev_rank, deadline, abort, &names[prev_rank]));
            let next = listener.connect(next_addr, place, generation, deadline, abort, &names[next_rank]);
            (accept.join().expect("accept thread"), next)
        });
        let (prev, next) = (prev?, next?);
        for stream in [&prev, &next] {
            let setup = |e: std::io::Error| CollectiveError::Setup(SetupError::Socket(e));
            stream.set_nodelay(true).map_err(setup)?;
            stream.set_read_timeout(Some(timeout)).map_err(setup)?;
            stream.set_write_timeout(Some(timeout)).map_err(setup)?;
            abort.register(generation, stream)?;
        }
        Ok(Ring {
            rank: place,
            world,
            generation,
            next: Some(next),
            prev: Some(prev),
            next_peer: Peer { name: names[next_rank].clone(), rank: next_rank },
            prev_peer: Peer { name: names[prev_rank].clone(), rank: prev_rank },
            link,
            slots: Slots::one(place, world),
        })
    }

    /// The collective timeout: how long a socket may carry no bytes before its collective fails.
    pub(crate) fn timeout(&self) -> Duration {
        self.link.timeout
    }

    /// The counters this ring's traffic goes to.
    pub(crate) fn traffic(&self) -> &Traffic {
        &self.link.traffic
    }

    /// Reduces `buf` element-wise over all ranks (the physical workers of this generation), in
    /// place, on every rank.
    pub fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<(), CollectiveError> {
        let slots = Slots::one(self.rank, self.world);
        self.reduce(&slots, &mut [buf], op)
    }

    /// The all-gather after [`Ring::scatter`]: slot u holds chunk u + 1 complete; this worker's
    /// chunks are gathered into the first buffer, then passed around the ring (at step s, slot u
    /// passes chunk u + 1 - s on to slot u + 1; hops inside a worker are no-ops). `points` name
    /// its failpoints after its first hop and after its second: an all-reduce's `all-gather` and
    /// `all-gather-second`, or the `sharded-all-gather` pair of a sharded optimizer's new
    /// parameters. With a slot per worker, one stopped after its hop s (from 0) lets the s + 1
    /// workers before it in the ring complete; it and the others do not.
    fn gather<T: Element>(
        &mut self,
        slots: &Slots,
        bufs: &mut [&mut [T]],
        points: [&str; 2],
    ) -> Result<(), CollectiveError> {
        let (v, a, b) = (slots.count, slots.held.start, slots.held.end);
        let len = bufs[0].len();
        if v == 1 {
            return Ok(());
        }
        let chunk = |c: usize| chunk_of(c, v, len);
        for u in a + 1..b {
            let c = chunk(u + 1);
            let (first, rest) = bufs.split_at_mut(1);
            first[0][c.clone()].copy_from_slice(&rest[u - a - 1][c]);
        }
        if self.world == 1 {
            return Ok(());
        }
        let began = Instant::now();
        for s in 0..v - 1 {
            let (send, recv) = (chunk(b + v - s), chunk(a + v - s));
            let (first, _) = bufs.split_at_mut(1);
            self.exchange_slots("all-reduce", first, (send, recv), false)?;
            // Chaos tests stop a member here: some peers complete this all-reduce, some not.
            if let Some(point) = points.get(s) {
                trainerd_failpoint::point(point);
            }
        }
        let sent = (v - 1) * len / v * std::mem::size_of::<T>();
        self.link.traffic.count(sent as u64, began.elapsed());
        Ok(())
    }

    /// Names the neighbours by the ranks they hold in the cluster (`members`: the rank at each
    /// place of the ring), for the errors that point at a peer.
    pub(crate) fn set_members(&mut self, members: &[usize]) {
        if self.world > 1 {
            self.next_peer.rank = members[(self.rank + 1) % self.world];
            self.prev_peer.rank = members[(self.rank + self.world - 1) % self.world];
        }
    }

    /// Sets which slots this worker holds: every worker of the ring must be told the assignment
    /// of the same (V, workers present).
    pub(crate) fn set_slots(&mut self, slots: Slots) {
        self.slots = slots;
    }

    /// Reduces element-wise over every slot of the run: `bufs` holds this worker's slots' values
    /// (one buffer per held slot, in slot order, of equal lengths); on return `bufs[0]` holds the
    /// result on every worker (the others are scratch). The buffer is cut into V chunks and the
    /// V-slot ring is run step for step (hops between two slots held here are additions in
    /// memory), so the result is bit for bit the V-worker run's, whoever holds which slots.
    pub(crate) fn all_reduce_slots<T: Element>(
        &mut self,
        bufs: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let slots = self.slots.clone();
        self.reduce(&slots, bufs, op)
    }

    fn reduce<T: Element>(
        &mut self,
        slots: &Slots,
        bufs: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.scatter(slots, bufs)?;
        self.gather(slots, bufs, ["all-gather", "all-gather-second"])?;
        if op == ReduceOp::Mean {
            let factor = 1.0 / slots.count as f64;
            bufs[0].iter_mut().for_each(|x| *x = x.scaled(factor));
        }
        Ok(())
    }

    /// The first half of [`Ring::all_reduce_slots`], over this worker's slots: on return each
    /// held slot u's buffer (`bufs[u - first]`) holds chunk u + 1 (mod V) summed over every slot.
    pub(crate) fn reduce_scatter_slots<T: Element>(&mut self, bufs: &mut [&mut [T]]) -> Result<(), CollectiveError> {
        let slots = self.slots.clone();
        self.scatter(&slots, bufs)
    }

    /// The second half: each held slot u's chunk u + 1 (in `bufs[u - first]`) is copied into
    /// every worker's first buffer, which then holds every chunk.
    pub(crate) fn all_gather_slots<T: Element>(&mut self, bufs: &mut [&mut [T]]) -> Result<(), CollectiveError> {
        let slots = self.slots.clone();
        self.gather(&slots, bufs, ["sharded-all-gather", "sharded-all-gather-second"])
    }

    fn scatter<T: Element>(&mut self, slots: &Slots, bufs: &mut [&mut [T]]) -> Result<(), CollectiveError> {
        let (v, a, b) = (slots.count, slots.held.start, slots.held.end);
        assert_eq!(bufs.len(), b - a, "one buffer per held slot");
        let len = bufs[0].len();
        assert!(bufs.iter().all(|x| x.len() == len), "slot buffers of equal lengths");
        let alone = self.world == 1;
        if v == 1 {
            return Ok(());
        }
        if !alone {
            self.link.check()?;
        }
        let began = Instant::now();
        let chunk = |c: usize| chunk_of(c, v, len);
        // Reduce-scatter: at step s, slot u adds its chunk u - s into slot u + 1's.
        for s in 0..v - 1 {
            for u in a..b - 1 {
                let c = chunk(u + v - s);
                let (lo, hi) = bufs.split_at_mut(u - a + 1);
                add_into(&mut hi[0][c.clone()], &lo[u - a][c]);
            }
            if alone {
                // Every slot is here: the ring's last hop (slot V-1 to slot 0) too.
                let c = chunk(v - 1 + v - s);
                let (first, rest) = bufs.split_at_mut(1);
                add_into(&mut first[0][c.clone()], &rest[v - 2][c]);
            } else {
                let (send, recv) = (chunk(b - 1 + v - s), chunk(a + 2 * v - 1 - s));
                self.exchange_slots("all-reduce", bufs, (send, recv), true)?;
            }
        }
        if !alone {
            // Each worker sends V-1 chunks of about len/V elements.
            let sent = (v - 1) * len / v * std::mem::size_of::<T>();
            self.link.traffic.count(sent as u64, began.elapsed());
        }
        Ok(())
    }

    /// Copies rank `root`'s `buf` to every rank, forwarding piece by piece along the ring.
    pub(crate) fn broadcast_from<T: Pod>(&mut self, root: usize, buf: &mut [T]) -> Result<(), CollectiveError> {
        if self.world == 1 {
            return Ok(());
        }
        self.link.check()?;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
        let forward = (self.rank + 1) % self.world != root;
        for piece in bytes.chunks_mut(PIECE_BYTES) {
            if self.rank != root {
                let prev = self.prev.as_mut().expect("ring");
                read_full(prev, piece, "broadcast", &self.prev_peer, &self.link)?;
            }
            if forward {
                let next = self.next.as_mut().expect("ring");
                write_full(next, piece, "broadcast", &self.next_peer, &self.link)?;
            }
        }
        Ok(())
    }

    /// Sends `send` to the next worker of the ring while receiving the previous worker's into
    /// `recv` (its length known to both): how an owner's ranges reach their buddy. Each side is a
    /// list of slices taken in order, as one stream: what is sent comes from where it lies, and
    /// what arrives goes straight where it belongs, with no gathered copy on either side. Its
    /// failpoint is `buddy-shift`, reached before any byte moves.
    pub(crate) fn shift<T: Element>(&mut self, send: &[&[T]], recv: &mut [&mut [T]]) -> Result<(), CollectiveError> {
        assert!(self.world > 1, "a shift needs a next worker");
        self.link.check()?;
        trainerd_failpoint::point("buddy-shift");
        self.shift_way(send, recv, true)
    }

    /// [`Ring::shift`] the other way round: `send` to the previous rank while the next rank's
    /// data arrives in `recv` (each TCP link carries both ways).
    pub(crate) fn shift_back<T: Element>(
        &mut self,
        send: &[&[T]],
        recv: &mut [&mut [T]],
    ) -> Result<(), CollectiveError> {
        assert!(self.world > 1, "a shift needs a previous worker");
        self.link.check()?;
        self.shift_way(send, recv, false)
    }

    fn shift_way<T: Element>(
        &mut self,
        send: &[&[T]],
        recv: &mut [&mut [T]],
        forward: bool,
    ) -> Result<(), CollectiveError> {
        let began = Instant::now();
        let link = &self.link;
        let (next, prev) = (self.next.as_mut().expect("ring"), self.prev.as_mut().expect("ring"));
        let (next_peer, prev_peer) = (&self.next_peer, &self.prev_peer);
        let ((to, to_peer), (from, from_peer), op) = match forward {
            true => ((next, next_peer), (prev, prev_peer), "buddy shift"),
            false => ((prev, prev_peer), (next, next_peer), "shift to the previous worker"),
        };
        std::thread::scope(|s| {
            let sender = s.spawn(move || {
                send.iter().try_for_each(|part| write_full(to, bytemuck::cast_slice(part), op, to_peer, link))
            });
            let received = recv
                .iter_mut()
                .try_for_each(|part| read_full(from, bytemuck::cast_slice_mut(part), op, from_peer, link));
            let sent = sender.join().expect("sender thread");
            // A failed receive is the cause; a send that failed after it is its echo.
            received.and(sent)
        })?;
        let bytes: usize = send.iter().map(|part| std::mem::size_of_val(*part)).sum();
        self.link.traffic.count(bytes as u64, began.elapsed());
        Ok(())
    }

    /// Sends the last buffer's `send` elements to the next rank while receiving the previous
    /// rank's data into the first buffer's `recv` elements (added when `add`, copied otherwise).
    fn exchange_slots<T: Element>(
        &mut self,
        op: &'static str,
        bufs: &mut [&mut [T]],
        (send, recv): (std::ops::Range<usize>, std::ops::Range<usize>),
        add: bool,
    ) -> Result<(), CollectiveError> {
        let (send_part, recv_part): (&[T], &mut [T]) = if bufs.len() == 1 {
            disjoint(bufs[0], send, recv)
        } else {
            let (first, rest) = bufs.split_at_mut(1);
            (&rest[rest.len() - 1][send], &mut first[0][recv])
        };
        let link = &self.link;
        let (next, prev) = (self.next.as_mut().expect("ring"), self.prev.as_mut().expect("ring"));
        let (next_peer, prev_peer) = (&self.next_peer, &self.prev_peer);
        std::thread::scope(|s| {
            let sender = s.spawn(move || write_full(next, bytemuck::cast_slice(send_part), op, next_peer, link));
            let received = receive(prev, recv_part, add, op, prev_peer, link);
            let sent = sender.join().expect("sender thread");
            // A failed receive is the cause; a send that failed after it is its echo.
            received.and(sent)
        })
    }
}

impl Collective for Ring {
    fn generation(&self) -> u64 {
        self.generation
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn slots(&self) -> &Slots {
        &self.slots
    }

    fn on_device(&self) -> bool {
        false
    }

    fn all_reduce_buffers(&mut self, bufs: &mut [Tensor]) -> Result<(), CollectiveError> {
        // SAFETY: each buffer is a contiguous float32 host tensor of the caller's, which nothing
        // else touches while the collective runs (the trait's contract); `host_slice` checks the
        // layout.
        let mut views: Vec<&mut [f32]> = bufs.iter_mut().map(|t| unsafe { host_slice(t) }).collect();
        self.all_reduce_slots(&mut views, ReduceOp::Sum)
    }

    fn reduce_scatter_buffers(&mut self, bufs: &mut [Tensor]) -> Result<(), CollectiveError> {
        // SAFETY: as in `all_reduce_buffers`.
        let mut views: Vec<&mut [f32]> = bufs.iter_mut().map(|t| unsafe { host_slice(t) }).collect();
        self.reduce_scatter_slots(&mut views)
    }

    fn all_gather_buffers(&mut self, bufs: &mut [Tensor]) -> Result<(), CollectiveError> {
        // SAFETY: as in `all_reduce_buffers`.
        let mut views: Vec<&mut [f32]> = bufs.iter_mut().map(|t| unsafe { host_slice(t) }).collect();
        self.all_gather_slots(&mut views)
    }

    fn shift_to_next(&mut self, send: &[&[f32]], recv: &mut [&mut [f32]]) -> Result<(), CollectiveError> {
        self.shift(send, recv)
    }

    fn shift_to_previous(&mut self, send: &[&[f32]], recv: &mut [&mut [f32]]) -> Result<(), CollectiveError> {
        self.shift_back(send, recv)
    }

    fn all_reduce_values(&mut self, bufs: &mut [&mut [f64]], op: ReduceOp) -> Result<(), CollectiveError> {
        self.all_reduce_slots(bufs, op)
    }

    fn all_reduce_workers(&mut self, buf: &mut [f64], op: ReduceOp) -> Result<(), CollectiveError> {
        self.all_reduce(buf, op)
    }

    fn broadcast(&mut self, root: usize, buf: &mut [u8]) -> Result<(), CollectiveError> {
        self.broadcast_from(root, buf)
    }

    fn broadcast_bytes(&mut self, root: usize, bytes: Vec<u8>) -> Result<Vec<u8>, CollectiveError> {
        let mut len = [if self.rank == root { bytes.len() as u64 } else { 0 }];
        self.broadcast_from(root, &mut len)?;
        let mut buf = if self.rank == root { bytes } else { vec![0u8; len[0] as usize] };
        self.broadcast_from(root, &mut buf)?;
        Ok(buf)
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.all_reduce(&mut [0f32], ReduceOp::Sum)
    }

    fn check_abort(&self) -> Result<(), CollectiveError> {
        if self.world == 1 {
            return Ok(()); // a ring of one has no peer to fail, and its signal is never armed
        }
        self.link.check()
    }
}

/// Chunk `c` (taken modulo `v`) of a buffer of `len` elements cut into `v` chunks.
pub(crate) fn chunk_of(c: usize, v: usize, len: usize) -> std::ops::Range<usize> {
    (c % v) * len / v..(c % v + 1) * len / v
}

/// `dst += src`, element-wise (an addition the ring would have made at the receiving rank).
fn add_into<T: Element>(dst: &mut [T], src: &[T]) {
    dst.iter_mut().zip(src).for_each(|(x, y)| *x += *y);
}

/// Receives `dst.len()` elements, adding them into `dst` piece by piece, or copying.
fn receive<T: Element>(
    stream: &mut TcpStream,
    dst: &mut [T],
    add: bool,
    op: &'static str,
    peer: &Peer,
    link: &Link,
) -> Result<(), CollectiveError> {
    if !add {
        return read_full(stream, bytemuck::cast_slice_mut(dst), op, peer, link);
    }
    let piece = (PIECE_BYTES / std::mem::size_of::<T>()).max(1);
    let mut scratch: Vec<T> = vec![T::zeroed(); piece.min(dst.len())];
    for part in dst.chunks_mut(piece) {
        let incoming = &mut scratch[..part.len()];
        read_full(stream, bytemuck::cast_slice_mut(incoming), op, peer, link)?;
        part.iter_mut().zip(incoming.iter()).for_each(|(x, y)| *x += *y);
    }
    Ok(())
}

fn read_full(
    stream: &mut TcpStream,
    buf: &mut [u8],
    op: &'static str,
    peer: &Peer,
    link: &Link,
) -> Result<(), CollectiveError> {
    stream.read_exact(buf).map_err(|e| link.error(op, peer, e))
}

fn write_full(
    stream: &mut TcpStream,
    buf: &[u8],
    op: &'static str,
    peer: &Peer,
    link: &Link,
) -> Result<(), CollectiveError> {
    stream.write_all(buf).map_err(|e| link.error(op, peer, e))
}

/// Two disjoint sub-slices of `buf`: one to read, one to write.
fn disjoint<T>(buf: &mut [T], a: std::ops::Range<usize>, b: std::ops::Range<usize>) -> (&[T], &mut [T]) {
    assert!(a.end <= b.start || b.end <= a.start, "chunks overlap");
    // Decide by the ends, not the starts: an empty chunk may start where the other one does.
    if a.end <= b.start {
        let (left, right) = buf.split_at_mut(b.start);
        (&left[a], &mut right[..b.end - b.start])
    } else {
        let (left, right) = buf.split_at_mut(a.start);
        (&right[..a.end - a.start], &mut left[b])
    }
}

#[cfg(test)]
pub(crate) mod tests;
