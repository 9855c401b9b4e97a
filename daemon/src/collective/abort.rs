//! Aborting collectives from another thread. A collective blocks in a socket read; the control
//! plane (a pushed notice from a peer, the coordinator ending a generation, a lost chief) raises
//! this signal, which shuts down every socket of the aborted generation, so the blocked read
//! returns at once and the collective fails with [`crate::collective::CollectiveError::Aborted`]
//! instead of waiting for its timeout.
//!
//! Generations only grow: aborting generation `g` aborts every generation up to `g`, including
//! one that is formed after the notice arrived (a notice can overtake the formation it ends).

use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Mutex};

/// A generation that was aborted, and why (a peer failed, the cluster moved on).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("generation {generation} aborted: {reason}")]
pub(crate) struct Aborted {
    /// The generation.
    pub(crate) generation: u64,
    /// Why, as whoever raised the signal said.
    pub(crate) reason: String,
}

impl From<Aborted> for super::CollectiveError {
    fn from(a: Aborted) -> super::CollectiveError {
        super::CollectiveError::Aborted { generation: a.generation, reason: a.reason }
    }
}

#[derive(Debug, Default)]
struct Inner {
    /// The generation whose sockets are registered.
    armed: u64,
    /// Every generation up to this one is aborted.
    aborted_through: u64,
    /// Why, for the latest abort.
    reason: String,
    sockets: Vec<TcpStream>,
}

/// A shared abort switch for the collectives of one process.
#[derive(Clone, Debug, Default)]
pub struct AbortSignal(Arc<Mutex<Inner>>);

impl AbortSignal {
    /// A signal that nothing has raised.
    pub fn new() -> AbortSignal {
        AbortSignal::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Starts generation `generation`: forgets the sockets of older ones.
    pub(crate) fn arm(&self, generation: u64) {
        let mut inner = self.lock();
        if generation > inner.armed {
            inner.armed = generation;
            inner.sockets.clear();
        }
    }

    /// Registers a socket of `generation`, to be shut down when it is aborted (at once if it
    /// already is).
    pub(crate) fn register(&self, generation: u64, socket: &TcpStream) -> Result<(), Aborted> {
        let mut inner = self.lock();
        if generation <= inner.aborted_through {
            let _ = socket.shutdown(Shutdown::Both);
            return Err(Aborted { generation, reason: inner.reason.clone() });
        }
        if generation == inner.armed {
            if let Ok(clone) = socket.try_clone() {
                inner.sockets.push(clone);
            }
        }
        Ok(())
    }

    /// Aborts every generation up to `generation`; returns true if this raised it (it was not
    /// already aborted).
    pub(crate) fn trigger(&self, generation: u64, reason: &str) -> bool {
        let mut inner = self.lock();
        if generation <= inner.aborted_through {
            return false;
        }
        inner.aborted_through = generation;
        inner.reason = reason.to_string();
        if inner.armed <= generation {
            for s in inner.sockets.drain(..) {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        true
    }

    /// Fails, saying why, when `generation` is aborted.
    pub(crate) fn check(&self, generation: u64) -> Result<(), Aborted> {
        let inner = self.lock();
        if generation <= inner.aborted_through {
            Err(Aborted { generation, reason: inner.reason.clone() })
        } else {
            Ok(())
        }
    }

    /// The highest aborted generation (0: none).
    #[cfg(test)]
    pub(crate) fn aborted_through(&self) -> u64 {
        self.lock().aborted_through
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    #[test]
    fn a_blocked_read_returns_when_its_generation_is_aborted() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_server, _) = listener.accept().unwrap();
        let signal = AbortSignal::new();
        signal.arm(3);
        signal.register(3, &client).unwrap();
        let reader = {
            let mut client = client.try_clone().unwrap();
            std::thread::spawn(move || client.read(&mut [0u8; 8]))
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        signal.trigger(2, "older");
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            signal.check(3).is_ok() && !reader.is_finished(),
            "an older generation's notice leaves generation 3 alone"
        );
        assert!(signal.trigger(3, "worker 2 failed"));
        assert!(matches!(reader.join().unwrap(), Ok(0) | Err(_)), "the read ended");
        assert_eq!(signal.check(3).unwrap_err().reason, "worker 2 failed");
        assert!(!signal.trigger(3, "again"), "raised once");
    }

    #[test]
    fn a_notice_that_overtakes_its_formation_still_aborts_it() {
        let signal = AbortSignal::new();
        signal.trigger(5, "generation 5 ended");
        signal.arm(5);
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        assert_eq!(signal.register(5, &s).unwrap_err().reason, "generation 5 ended");
        signal.arm(6);
        assert!(signal.register(6, &s).is_ok());
        assert_eq!(signal.aborted_through(), 5);
    }
}
