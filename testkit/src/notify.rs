//! A datagram socket standing in for systemd's notification socket (`NOTIFY_SOCKET`): what a
//! daemon told systemd (READY, STATUS, WATCHDOG, STOPPING), in order, with when it arrived.

use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A datagram socket standing in for systemd's, and the messages it received with their times.
pub struct NotifySocket {
    dir: PathBuf,
    /// The socket's path: the `NOTIFY_SOCKET` to give a daemon.
    pub path: PathBuf,
    rx: mpsc::Receiver<(Instant, String)>,
    seen: Vec<(Instant, String)>,
}

impl NotifySocket {
    /// A socket in a directory of its own (removed on drop), read by a thread.
    pub fn new() -> NotifySocket {
        let dir = std::env::temp_dir().join(format!("trainerd-notify-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify.sock");
        let socket = UnixDatagram::bind(&path).unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 4096];
            while let Ok(n) = socket.recv(&mut buf) {
                let message = String::from_utf8_lossy(&buf[..n]).into_owned();
                if tx.send((Instant::now(), message)).is_err() {
                    return;
                }
            }
        });
        NotifySocket { dir, path, rx, seen: Vec::new() }
    }

    /// Every message received so far.
    pub fn messages(&mut self) -> &[(Instant, String)] {
        self.seen.extend(self.rx.try_iter());
        &self.seen
    }

    /// Waits until a message holds `needle`.
    pub fn wait_for(&mut self, needle: &str, timeout: Duration) -> String {
        let until = Instant::now() + timeout;
        loop {
            if let Some((_, m)) = self.messages().iter().find(|(_, m)| m.contains(needle)) {
                return m.clone();
            }
            assert!(Instant::now() < until, "no {needle:?} within {timeout:?}; got {:?}", self.seen);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Watchdog pings received after `since`.
    pub fn pings_after(&mut self, since: Instant) -> usize {
        self.messages().iter().filter(|(t, m)| *t > since && m.lines().any(|l| l == "WATCHDOG=1")).count()
    }

    /// Puts a marker datagram in the socket now. The socket keeps the order in which datagrams
    /// were sent, so [`NotifySocket::pings_sent_after`] tells what a worker sent after this
    /// instant however late this test's reader gets to it (a loaded machine delays the reader).
    pub fn mark(&self) -> String {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let mark = format!("TEST-MARK={nanos}");
        UnixDatagram::unbound().unwrap().send_to(mark.as_bytes(), &self.path).unwrap();
        mark
    }

    /// Watchdog pings sent after the marker `mark` (waits until the marker itself arrives).
    pub fn pings_sent_after(&mut self, mark: &str) -> usize {
        self.wait_for(mark, Duration::from_secs(10));
        let at = self.seen.iter().position(|(_, m)| m == mark).unwrap();
        self.seen[at..].iter().filter(|(_, m)| m.lines().any(|l| l == "WATCHDOG=1")).count()
    }
}

impl Default for NotifySocket {
    fn default() -> NotifySocket {
        NotifySocket::new()
    }
}

impl Drop for NotifySocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
