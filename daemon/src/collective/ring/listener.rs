//! The data plane's persistent listener: bound once per process, it accepts ring connections for
//! every generation. Each connection opens with a hello (magic, generation, rank); connections
//! are filed by (generation, rank) until the ring of that generation takes them. A connection of
//! a generation older than the newest one asked for is closed; one of a newer generation waits
//! (its sender may have learned of the generation first). A connection without a valid hello is
//! closed and logged. With a cluster secret, every connection first passes the authentication
//! handshake ([`crate::auth`]); one that fails is closed and logged before its hello is
//! read.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::{CollectiveError, SetupError};
use crate::auth::{self, ClusterKey, Plane};
use crate::collective::abort::AbortSignal;

const HELLO_MAGIC: [u8; 8] = *b"TRDRING2";
/// Bytes of a hello.
pub(crate) const HELLO_BYTES: usize = 24;
/// How long an accepted connection may take to send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(2);

/// The hello a connection from `rank` of `generation` opens with.
pub(crate) fn hello(generation: u64, rank: usize) -> [u8; HELLO_BYTES] {
    let mut h = [0u8; HELLO_BYTES];
    h[..8].copy_from_slice(&HELLO_MAGIC);
    h[8..16].copy_from_slice(&generation.to_le_bytes());
    h[16..].copy_from_slice(&(rank as u64).to_le_bytes());
    h
}

fn parse_hello(h: &[u8; HELLO_BYTES]) -> Option<(u64, usize)> {
    if h[..8] != HELLO_MAGIC {
        return None;
    }
    let generation = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
    let rank = u64::from_le_bytes(h[16..].try_into().expect("8 bytes"));
    Some((generation, usize::try_from(rank).ok()?))
}

#[derive(Default)]
struct Pending {
    /// Generations below this are refused.
    oldest: u64,
    conns: HashMap<(u64, usize), TcpStream>,
}

struct Shared {
    key: Option<ClusterKey>,
    pending: Mutex<Pending>,
    arrived: Condvar,
    closed: AtomicBool,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A listener that outlives every ring formed on it.
pub struct DataListener {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for DataListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataListener").field("addr", &self.addr).finish()
    }
}

impl DataListener {
    /// Binds `addr` (port 0 for any) and starts accepting; with `key`, only peers that prove
    /// they hold it.
    pub fn bind(addr: SocketAddr, key: Option<ClusterKey>) -> std::io::Result<DataListener> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            key,
            pending: Mutex::default(),
            arrived: Condvar::new(),
            closed: AtomicBool::new(false),
        });
        let accepting = Arc::clone(&shared);
        std::thread::Builder::new().name("trainerd-data-accept".into()).spawn(move || {
            for stream in listener.incoming() {
                if accepting.closed.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(stream) = stream else { continue };
                let filing = Arc::clone(&accepting);
                // A peer slow to send its hello must not hold up the others.
                let _ = std::thread::Builder::new()
                    .name("trainerd-data-hello".into())
                    .spawn(move || file_connection(&filing, stream));
            }
        })?;
        Ok(DataListener { addr, shared })
    }

    /// The address peers connect to.
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits for the connection of `rank` in `generation`, until `deadline` or an abort.
    /// Connections of older generations are closed from now on.
    pub(crate) fn take(
        &self,
        generation: u64,
        rank: usize,
        deadline: Instant,
        abort: &AbortSignal,
        name: &str,
    ) -> Result<TcpStream, CollectiveError> {
        let mut pending = self.shared.lock();
        if generation > pending.oldest {
            pending.oldest = generation;
            pending.conns.retain(|(g, _), _| *g >= generation);
        }
        loop {
            if let Some(stream) = pending.conns.remove(&(generation, rank)) {
                return Ok(stream);
            }
            abort.check(generation)?;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CollectiveError::Setup(SetupError::NotConnected { peer: name.into() }));
            }
            // Short waits: an abort raised meanwhile is seen within 10 ms.
            pending = self
                .shared
                .arrived
                .wait_timeout(pending, left.min(Duration::from_millis(10)))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }
}

impl Drop for DataListener {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        // Wakes the blocked accept so that its thread sees the flag and ends.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(100));
    }
}

fn file_connection(shared: &Shared, mut stream: TcpStream) {
    let peer = stream.peer_addr().map_or_else(|_| "?".into(), |a| a.to_string());
    let _ = stream.set_read_timeout(Some(HELLO_TIMEOUT));
    if let Some(key) = &shared.key {
        if let Err(e) = auth::accept_blocking(&mut stream, key, Plane::Data) {
            if !shared.closed.load(Ordering::SeqCst) {
                tracing::warn!("data plane: refused a connection from {peer}: {}", auth::refusal(&e));
            }
            return;
        }
    }
    let mut h = [0u8; HELLO_BYTES];
    let parsed = stream.read_exact(&mut h).ok().and_then(|()| parse_hello(&h));
    let Some((generation, rank)) = parsed else {
        if !shared.closed.load(Ordering::SeqCst) {
            tracing::warn!("data plane: closed a connection from {peer} that sent no valid hello");
        }
        return;
    };
    let _ = stream.set_read_timeout(None);
    let mut pending = shared.lock();
    if generation < pending.oldest {
        tracing::info!("data plane: closed a connection of generation {generation} from {peer} (stale)");
        return;
    }
    pending.conns.insert((generation, rank), stream);
    shared.arrived.notify_all();
}

impl DataListener {
    /// Connects to `addr` as `rank` of `generation`, retrying until `deadline` or an abort, and
    /// proves this listener's key there.
    pub(crate) fn connect(
        &self,
        addr: SocketAddr,
        rank: usize,
        generation: u64,
        deadline: Instant,
        abort: &AbortSignal,
        name: &str,
    ) -> Result<TcpStream, CollectiveError> {
        let mut last_error = None;
        loop {
            abort.check(generation)?;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CollectiveError::Setup(SetupError::Unreachable {
                    peer: name.into(),
                    addr,
                    last: last_error,
                }));
            }
            match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(1))) {
                Ok(mut stream) => {
                    if let Some(key) = &self.shared.key {
                        let _ = stream.set_read_timeout(Some(auth::HANDSHAKE_TIMEOUT));
                        auth::connect_blocking(&mut stream, key, Plane::Data).map_err(|source| {
                            CollectiveError::Setup(SetupError::Authentication { peer: name.into(), addr, source })
                        })?;
                        let _ = stream.set_read_timeout(None);
                    }
                    stream
                        .write_all(&hello(generation, rank))
                        .map_err(|source| CollectiveError::Setup(SetupError::Hello { peer: name.into(), source }))?;
                    return Ok(stream);
                }
                Err(e) => {
                    last_error = Some(e);
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send_hello(addr: SocketAddr, generation: u64, rank: usize) -> TcpStream {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&hello(generation, rank)).unwrap();
        s
    }

    #[test]
    fn connections_are_filed_by_generation_and_stale_ones_refused() {
        let l = DataListener::bind("127.0.0.1:0".parse().unwrap(), None).unwrap();
        let abort = AbortSignal::new();
        let soon = || Instant::now() + Duration::from_secs(5);
        // A newer generation's connection waits while an older one is formed.
        let _g3 = send_hello(l.local_addr(), 3, 1);
        let _g2 = send_hello(l.local_addr(), 2, 1);
        assert!(l.take(2, 1, soon(), &abort, "worker 1").is_ok());
        assert!(l.take(3, 1, soon(), &abort, "worker 1").is_ok());
        // Now generation 2 is stale: its connection is closed, never handed out.
        let mut stale = send_hello(l.local_addr(), 2, 1);
        let err = l.take(2, 1, Instant::now() + Duration::from_millis(200), &abort, "worker 1").unwrap_err();
        assert_eq!(err.to_string(), "forming the ring: worker 1 did not connect in time");
        stale.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(stale.read(&mut [0u8; 1]).unwrap(), 0, "the stale connection was closed");
        // Garbage is refused; the listener goes on.
        let mut junk = TcpStream::connect(l.local_addr()).unwrap();
        junk.write_all(&[7u8; HELLO_BYTES]).unwrap();
        let _g4 = send_hello(l.local_addr(), 4, 0);
        assert!(l.take(4, 0, soon(), &abort, "worker 0").is_ok());
    }

    #[test]
    fn with_a_key_only_peers_that_prove_it_are_filed() {
        let key = ClusterKey::from_bytes(b"the-cluster-secret-0123456789");
        let l = DataListener::bind("127.0.0.1:0".parse().unwrap(), Some(key)).unwrap();
        let abort = AbortSignal::new();
        let soon = || Instant::now() + Duration::from_millis(300);
        // A hello without the handshake, and a peer with another secret: neither is filed.
        let mut bare = send_hello(l.local_addr(), 1, 1);
        let wrong = DataListener::bind(
            "127.0.0.1:0".parse().unwrap(),
            Some(ClusterKey::from_bytes(b"another-secret-0123456789")),
        )
        .unwrap();
        let err = wrong.connect(l.local_addr(), 1, 1, soon(), &abort, "worker 0").unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "forming the ring: authenticating to worker 0 at {}: the cluster secrets differ (is the same \
                 --secret-file set on every worker?)",
                l.local_addr()
            )
        );
        assert!(l.take(1, 1, soon(), &abort, "worker 1").is_err());
        bare.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut got = Vec::new();
        let _ = bare.read_to_end(&mut got);
        assert_eq!(got.len(), auth::CHALLENGE_BYTES, "the refused peer got the challenge and nothing else");
        // A peer with the key is.
        let right = DataListener::bind(
            "127.0.0.1:0".parse().unwrap(),
            Some(ClusterKey::from_bytes(b"the-cluster-secret-0123456789")),
        )
        .unwrap();
        let _s = right.connect(l.local_addr(), 1, 2, soon(), &abort, "worker 0").unwrap();
        assert!(l.take(2, 1, soon(), &abort, "worker 1").is_ok());
    }

    #[test]
    fn waiting_for_a_connection_ends_on_abort() {
        let l = DataListener::bind("127.0.0.1:0".parse().unwrap(), None).unwrap();
        let abort = AbortSignal::new();
        abort.arm(7);
        let trigger = abort.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            trigger.trigger(7, "worker 2 failed");
        });
        let started = Instant::now();
        let err = l.take(7, 2, Instant::now() + Duration::from_secs(30), &abort, "worker 2").unwrap_err();
        assert_eq!(err.to_string(), "generation 7 aborted: worker 2 failed");
        assert!(started.elapsed() < Duration::from_secs(5));
        t.join().unwrap();
    }
}
