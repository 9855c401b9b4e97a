//! The data plane: a ring of raw TCP connections (rank r sends to r+1, receives from r-1) and
//! the collectives over it.
//!
//! All-reduce is reduce-scatter then all-gather: the buffer is cut into `world` chunks; each
//! chunk is summed hop by hop around the ring in a fixed order, lands complete on one rank, and
//! is then copied to every other rank. So the result is deterministic (the same additions in
//! the same order every time) and bit-identical on every rank (each chunk is computed once).
//! Each step sends one chunk while receiving another on a second thread, and received data is
//! added in pieces as it arrives.
//!
//! Every socket has a deadline: a peer that stops sending turns into an error naming it, never
//! a hang. Connections open with a hello carrying the generation and rank, so a connection from
//! an older incarnation of the cluster is told apart and refused.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use bytemuck::Pod;

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
        /// What the OS said.
        source: std::io::Error,
    },
    /// The ring could not be formed.
    #[error("forming the ring: {0}")]
    Setup(String),
}

const HELLO_MAGIC: [u8; 8] = *b"TRDRING1";
/// Elements added per piece while receiving (overlaps the next read with the additions).
const PIECE_BYTES: usize = 1 << 20;

/// This rank's place in the ring.
pub struct Ring {
    rank: usize,
    world: usize,
    next: Option<TcpStream>,
    prev: Option<TcpStream>,
    next_name: String,
    prev_name: String,
    timeout: Duration,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring").field("rank", &self.rank).field("world", &self.world).finish()
    }
}

impl Ring {
    /// A ring of one: every collective is a no-op (mean divides by one).
    pub fn single() -> Ring {
        Ring {
            rank: 0,
            world: 1,
            next: None,
            prev: None,
            next_name: String::new(),
            prev_name: String::new(),
            timeout: Duration::MAX,
        }
    }

    /// Joins the ring: accepts the connection from rank-1 on `listener` and connects to
    /// `next_addr` (rank+1), both within `timeout`. `names` names every rank for messages.
    pub fn connect(
        rank: usize,
        names: &[String],
        listener: TcpListener,
        next_addr: SocketAddr,
        generation: u64,
        timeout: Duration,
    ) -> Result<Ring, CollectiveError> {
        let world = names.len();
        if world == 1 {
            return Ok(Ring::single());
        }
        let prev_rank = (rank + world - 1) % world;
        let next_rank = (rank + 1) % world;
        let deadline = Instant::now() + timeout;
        let (prev, next) = std::thread::scope(|s| {
            let accept = s.spawn(|| accept_prev(&listener, prev_rank, generation, deadline, &names[prev_rank]));
            let next = connect_next(next_addr, rank, generation, deadline, &names[next_rank]);
            (accept.join().expect("accept thread"), next)
        });
        let (prev, next) = (prev?, next?);
        for stream in [&prev, &next] {
            stream.set_nodelay(true).map_err(|e| CollectiveError::Setup(e.to_string()))?;
            stream.set_read_timeout(Some(timeout)).map_err(|e| CollectiveError::Setup(e.to_string()))?;
            stream.set_write_timeout(Some(timeout)).map_err(|e| CollectiveError::Setup(e.to_string()))?;
        }
        Ok(Ring {
            rank,
            world,
            next: Some(next),
            prev: Some(prev),
            next_name: names[next_rank].clone(),
            prev_name: names[prev_rank].clone(),
            timeout,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the ring.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Reduces `buf` element-wise over all ranks, in place, on every rank.
    pub fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<(), CollectiveError> {
        let (n, r) = (self.world, self.rank);
        if n > 1 {
            let len = buf.len();
            let chunk = |c: usize| c * len / n..(c + 1) * len / n;
            for s in 0..n - 1 {
                self.exchange("all-reduce", buf, chunk((r + n - s) % n), chunk((r + 2 * n - s - 1) % n), true)?;
            }
            for s in 0..n - 1 {
                self.exchange("all-reduce", buf, chunk((r + 1 + n - s) % n), chunk((r + n - s) % n), false)?;
            }
        }
        if op == ReduceOp::Mean {
            let factor = 1.0 / n as f64;
            buf.iter_mut().for_each(|x| *x = x.scaled(factor));
        }
        Ok(())
    }

    /// Copies rank 0's `buf` to every rank, forwarding piece by piece along the ring.
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T]) -> Result<(), CollectiveError> {
        if self.world == 1 {
            return Ok(());
        }
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
        let forward = self.rank + 1 < self.world;
        for piece in bytes.chunks_mut(PIECE_BYTES) {
            if self.rank != 0 {
                let (prev, name) = (self.prev.as_mut().expect("ring"), &self.prev_name);
                read_full(prev, piece, "broadcast", name, self.timeout)?;
            }
            if forward {
                let next = self.next.as_mut().expect("ring");
                write_full(next, piece, "broadcast", &self.next_name, self.timeout)?;
            }
        }
        Ok(())
    }

    /// Sends `buf[send]` to the next rank while receiving the previous rank's data into
    /// `buf[recv]` (added when `add`, copied otherwise).
    fn exchange<T: Element>(
        &mut self,
        op: &'static str,
        buf: &mut [T],
        send: std::ops::Range<usize>,
        recv: std::ops::Range<usize>,
        add: bool,
    ) -> Result<(), CollectiveError> {
        let (send_part, recv_part) = disjoint(buf, send, recv);
        let timeout = self.timeout;
        let (next, prev) = (self.next.as_mut().expect("ring"), self.prev.as_mut().expect("ring"));
        let (next_name, prev_name) = (&self.next_name, &self.prev_name);
        std::thread::scope(|s| {
            let sender = s.spawn(move || write_full(next, bytemuck::cast_slice(send_part), op, next_name, timeout));
            let received = receive(prev, recv_part, add, op, prev_name, timeout);
            let sent = sender.join().expect("sender thread");
            received.and(sent)
        })
    }
}

/// Receives `dst.len()` elements, adding them into `dst` piece by piece, or copying.
fn receive<T: Element>(
    stream: &mut TcpStream,
    dst: &mut [T],
    add: bool,
    op: &'static str,
    peer: &str,
    timeout: Duration,
) -> Result<(), CollectiveError> {
    if !add {
        return read_full(stream, bytemuck::cast_slice_mut(dst), op, peer, timeout);
    }
    let piece = (PIECE_BYTES / std::mem::size_of::<T>()).max(1);
    let mut scratch: Vec<T> = vec![T::zeroed(); piece.min(dst.len())];
    for part in dst.chunks_mut(piece) {
        let incoming = &mut scratch[..part.len()];
        read_full(stream, bytemuck::cast_slice_mut(incoming), op, peer, timeout)?;
        part.iter_mut().zip(incoming.iter()).for_each(|(x, y)| *x += *y);
    }
    Ok(())
}

fn io_error(op: &'static str, peer: &str, timeout: Duration, source: std::io::Error) -> CollectiveError {
    match source.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            CollectiveError::Timeout { op, peer: peer.to_string(), timeout }
        }
        _ => CollectiveError::Io { op, peer: peer.to_string(), source },
    }
}

fn read_full(
    stream: &mut TcpStream,
    buf: &mut [u8],
    op: &'static str,
    peer: &str,
    timeout: Duration,
) -> Result<(), CollectiveError> {
    stream.read_exact(buf).map_err(|e| io_error(op, peer, timeout, e))
}

fn write_full(
    stream: &mut TcpStream,
    buf: &[u8],
    op: &'static str,
    peer: &str,
    timeout: Duration,
) -> Result<(), CollectiveError> {
    stream.write_all(buf).map_err(|e| io_error(op, peer, timeout, e))
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

fn hello(generation: u64, rank: usize) -> [u8; 24] {
    let mut h = [0u8; 24];
    h[..8].copy_from_slice(&HELLO_MAGIC);
    h[8..16].copy_from_slice(&generation.to_le_bytes());
    h[16..].copy_from_slice(&(rank as u64).to_le_bytes());
    h
}

fn connect_next(
    addr: SocketAddr,
    rank: usize,
    generation: u64,
    deadline: Instant,
    name: &str,
) -> Result<TcpStream, CollectiveError> {
    let mut last_error = None;
    while Instant::now() < deadline {
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        match TcpStream::connect_timeout(&addr, left) {
            Ok(mut stream) => {
                stream
                    .write_all(&hello(generation, rank))
                    .map_err(|e| CollectiveError::Setup(format!("sending hello to {name}: {e}")))?;
                return Ok(stream);
            }
            Err(e) => {
                last_error = Some(e);
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    Err(CollectiveError::Setup(format!(
        "could not connect to {name} at {addr}: {}",
        last_error.map_or("deadline passed".into(), |e| e.to_string())
    )))
}

fn accept_prev(
    listener: &TcpListener,
    expected_rank: usize,
    generation: u64,
    deadline: Instant,
    name: &str,
) -> Result<TcpStream, CollectiveError> {
    let setup = |what: &str, e: std::io::Error| CollectiveError::Setup(format!("{what}: {e}"));
    listener.set_nonblocking(true).map_err(|e| setup("listener", e))?;
    loop {
        match listener.accept() {
            Ok((mut stream, _)) => {
                stream.set_nonblocking(false).map_err(|e| setup("accepted connection", e))?;
                stream
                    .set_read_timeout(Some(
                        deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)),
                    ))
                    .map_err(|e| setup("accepted connection", e))?;
                let mut h = [0u8; 24];
                // A connection that sends a wrong or stale hello is dropped; keep waiting.
                if stream.read_exact(&mut h).is_ok() && h == hello(generation, expected_rank) {
                    return Ok(stream);
                }
                tracing::warn!("ring: refused a connection that is not {name} of generation {generation}");
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(CollectiveError::Setup(format!("{name} did not connect in time")));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(setup("accepting", e)),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Forms a ring of `world` ranks on loopback and runs `f` on each, in threads.
    pub(crate) fn with_ring<R: Send>(world: usize, f: impl Fn(&mut Ring) -> R + Sync) -> Vec<R> {
        let listeners: Vec<TcpListener> = (0..world).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        let names: Vec<String> = (0..world).map(|r| format!("worker {r}")).collect();
        std::thread::scope(|s| {
            let handles: Vec<_> = listeners
                .into_iter()
                .enumerate()
                .map(|(rank, listener)| {
                    let (names, addrs, f) = (&names, &addrs, &f);
                    s.spawn(move || {
                        let mut ring =
                            Ring::connect(rank, names, listener, addrs[(rank + 1) % world], 1, Duration::from_secs(20))
                                .unwrap();
                        f(&mut ring)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// For random sets of tensors and world sizes 1-5, all-reduce equals the directly
        /// computed sum and is bit-identical on every rank.
        #[test]
        fn all_reduce_is_the_sum_and_identical_everywhere(
            world in 1usize..=5,
            lens in proptest::collection::vec(prop_oneof![0usize..8, 0usize..3000], 1..4),
            seed in any::<u64>(),
        ) {
            let data = |rank: usize, t: usize, i: usize| -> f32 {
                let x = (seed ^ ((rank as u64) << 40) ^ ((t as u64) << 20) ^ i as u64).wrapping_mul(0x9E3779B97F4A7C15);
                ((x >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            };
            let results = with_ring(world, |ring| {
                let rank = ring.rank();
                lens.iter()
                    .enumerate()
                    .map(|(t, &len)| {
                        let mut buf: Vec<f32> = (0..len).map(|i| data(rank, t, i)).collect();
                        ring.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                        buf
                    })
                    .collect::<Vec<_>>()
            });
            for (t, &len) in lens.iter().enumerate() {
                for (i, &got) in results[0][t].iter().enumerate().take(len) {
                    let direct: f64 = (0..world).map(|r| f64::from(data(r, t, i))).sum();
                    prop_assert!((f64::from(got) - direct).abs() < 1e-5, "tensor {t}[{i}]");
                }
                for (r, result) in results.iter().enumerate().skip(1) {
                    let same = result[t].iter().zip(&results[0][t]).all(|(a, b)| a.to_bits() == b.to_bits());
                    prop_assert!(same, "rank {r} differs from rank 0 in tensor {t}");
                }
            }
        }
    }

    #[test]
    fn buffers_shorter_than_the_ring() {
        for world in 2..=4 {
            let out = with_ring(world, |ring| {
                let mut x = [ring.rank() as f32 + 1.0];
                ring.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                let mut empty: [f32; 0] = [];
                ring.all_reduce(&mut empty, ReduceOp::Sum).unwrap();
                x[0]
            });
            let expected = (world * (world + 1) / 2) as f32;
            assert!(out.iter().all(|&x| x == expected), "{world}: {out:?}");
        }
    }

    #[test]
    fn disjoint_handles_empty_chunks() {
        let mut buf = [1, 2, 3];
        let (a, b) = disjoint(&mut buf, 0..0, 0..1);
        assert_eq!((a.len(), b.len()), (0, 1));
        let (a, b) = disjoint(&mut buf, 0..1, 1..1);
        assert_eq!((a, b.len()), (&[1][..], 0));
        let (a, b) = disjoint(&mut buf, 2..3, 0..2);
        assert_eq!((a, &*b), (&[3][..], &[1, 2][..]));
    }

    #[test]
    fn mean_and_broadcast() {
        let out = with_ring(3, |ring| {
            let mut m = vec![ring.rank() as f64 + 1.0; 5];
            ring.all_reduce(&mut m, ReduceOp::Mean).unwrap();
            let mut b: Vec<f32> =
                if ring.rank() == 0 { (0..3_000_000).map(|i| i as f32).collect() } else { vec![0.0; 3_000_000] };
            ring.broadcast(&mut b).unwrap();
            (m, b[2_999_999], b[12345])
        });
        for (m, last, mid) in out {
            assert_eq!(m, vec![2.0; 5]);
            assert_eq!((last, mid), (2_999_999.0, 12345.0));
        }
    }

    #[test]
    fn a_silent_peer_is_a_timeout_naming_it() {
        let listeners: Vec<TcpListener> = (0..2).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        let names = vec!["worker 0 (a)".to_string(), "worker 1 (b)".to_string()];
        let mut it = listeners.into_iter();
        let (l0, l1) = (it.next().unwrap(), it.next().unwrap());
        std::thread::scope(|s| {
            let names = &names;
            let first = addrs[0];
            let quiet = s.spawn(move || {
                let ring = Ring::connect(1, names, l1, first, 1, Duration::from_millis(500)).unwrap();
                std::thread::sleep(Duration::from_millis(1500));
                drop(ring);
            });
            let mut ring = Ring::connect(0, names, l0, addrs[1], 1, Duration::from_millis(500)).unwrap();
            let mut buf = vec![1.0f32; 10];
            let err = ring.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err().to_string();
            assert_eq!(err, "all-reduce: worker 1 (b) sent nothing for 500ms; it may have died or hung");
            quiet.join().unwrap();
        });
    }

    #[test]
    fn a_stale_generation_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stale = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(&hello(1, 0)).unwrap();
            std::thread::sleep(Duration::from_millis(300));
        });
        let err = accept_prev(&listener, 0, 2, Instant::now() + Duration::from_millis(200), "worker 0").unwrap_err();
        assert_eq!(err.to_string(), "forming the ring: worker 0 did not connect in time");
        stale.join().unwrap();
    }
}
