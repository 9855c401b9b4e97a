//! A link to a server that a test cuts and restores: a storage outage without touching the
//! server.

use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A loopback TCP forwarder in front of a server, which a test cuts to make the server
/// unreachable without touching it (an outage of the network or of a load balancer's backend):
/// while cut, every open connection is shut down and every new one is closed at once; restored,
/// it forwards again. The server itself keeps running, so it answers at full speed the moment the
/// link comes back, and how long a real server takes to restart plays no part in a test.
pub struct TcpProxy {
    addr: std::net::SocketAddr,
    state: Arc<ProxyState>,
}

#[derive(Default)]
struct ProxyState {
    cut: std::sync::atomic::AtomicBool,
    closed: std::sync::atomic::AtomicBool,
    /// Both ends of every connection forwarded since the last cut, to shut down on the next.
    open: std::sync::Mutex<Vec<std::net::TcpStream>>,
}

impl ProxyState {
    /// Sets `cut` and shuts every open connection, under the lock new connections register by.
    fn cut_all(&self) {
        let mut open = self.open.lock().expect("not poisoned");
        self.cut.store(true, Ordering::SeqCst);
        for s in open.drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl TcpProxy {
    /// Forwards a new port on 127.0.0.1 to `target`.
    pub fn start(target: std::net::SocketAddr) -> std::io::Result<TcpProxy> {
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
        let addr = listener.local_addr()?;
        let state = Arc::new(ProxyState::default());
        let shared = Arc::clone(&state);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if shared.closed.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = std::net::TcpStream::connect(target) else {
                    let _ = client.shutdown(std::net::Shutdown::Both);
                    continue;
                };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let ends = [client.try_clone(), server.try_clone(), client.try_clone(), server.try_clone()];
                let [Ok(c1), Ok(s1), Ok(c2), Ok(s2)] = ends else { continue };
                {
                    // Under the lock `cut` takes: a connection is either shut by a cut or refused.
                    let mut open = shared.open.lock().expect("not poisoned");
                    if shared.cut.load(Ordering::SeqCst) {
                        let _ = (client.shutdown(std::net::Shutdown::Both), server.shutdown(std::net::Shutdown::Both));
                        continue;
                    }
                    open.extend([c2, s2]);
                }
                for (mut from, mut to) in [(client, server), (s1, c1)] {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Write);
                    });
                }
            }
        });
        Ok(TcpProxy { addr, state })
    }

    /// `http://127.0.0.1:PORT` of the forwarder.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Cuts the link: open connections are shut down, new ones closed at once.
    pub fn cut(&self) {
        self.state.cut_all();
    }

    /// Restores the link.
    pub fn restore(&self) {
        self.state.cut.store(false, Ordering::SeqCst);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.state.closed.store(true, Ordering::SeqCst);
        self.state.cut_all();
        // Wakes the accept loop so that it sees `closed`.
        let _ = std::net::TcpStream::connect(self.addr);
    }
}
