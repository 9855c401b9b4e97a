//! systemd's notification protocol (`Type=notify`), on a thread of its own that reads the
//! [`Telemetry`]:
//! - `READY=1` once the worker has joined its cluster;
//! - `STATUS=` with epoch, step, loss, generation and workers (at most once a second);
//! - `WATCHDOG=1` every half `WatchdogSec` while the daemon is healthy (training progressed
//!   within the stall period, or it is in a wait it bounds itself), and never otherwise, so a
//!   hung step gets the daemon restarted;
//! - `EXTEND_TIMEOUT_USEC=` during a bounded wait before `READY` (a rendezvous, a restore) or
//!   after `STOPPING` (the final commit), so that systemd's start and stop timeouts follow the
//!   daemon's own bounds;
//! - `STOPPING=1` on a stop signal or at the end of the run.
//!
//! Without `NOTIFY_SOCKET` (not under systemd) nothing runs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use sd_notify::NotifyState;

use super::Telemetry;

const TICK: Duration = Duration::from_millis(100);
const STATUS_EVERY: Duration = Duration::from_secs(1);
/// How far each `EXTEND_TIMEOUT_USEC` reaches (sent every [`STATUS_EVERY`]).
const EXTEND_BY: Duration = Duration::from_secs(10);

/// The watchdog period systemd asked for: `WATCHDOG_USEC`, when `WATCHDOG_PID` is absent or
/// this process (as libsystemd's `sd_watchdog_enabled` reads them).
pub(crate) fn watchdog_period() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok().filter(|&u| u > 0)?;
    match std::env::var("WATCHDOG_PID") {
        Ok(pid) if pid.parse() != Ok(std::process::id()) => None,
        _ => Some(Duration::from_micros(usec)),
    }
}

/// The notifier thread, while it runs.
pub(crate) struct Notifier {
    done: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Notifier {
    /// Starts notifying systemd, if the daemon runs under it. `stop` is the stop-signal flag.
    pub(crate) fn start(telemetry: Arc<Telemetry>, stop: Arc<AtomicBool>) -> Option<Notifier> {
        std::env::var_os("NOTIFY_SOCKET")?;
        let done = Arc::new(AtomicBool::new(false));
        let finished = Arc::clone(&done);
        let thread = std::thread::Builder::new()
            .name("trainerd-notify".into())
            .spawn(move || run(&telemetry, &stop, &finished, watchdog_period()))
            .map_err(|e| tracing::warn!("systemd notifications: cannot start a thread: {e}"))
            .ok()?;
        Some(Notifier { done, thread: Some(thread) })
    }

    /// Sends `STOPPING=1` (if not yet sent) and ends the thread.
    pub(crate) fn finish(mut self) {
        self.end();
    }

    fn end(&mut self) {
        self.done.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Notifier {
    fn drop(&mut self) {
        self.end();
    }
}

fn send(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(false, states) {
        tracing::debug!("systemd notification failed: {e}");
    }
}

fn run(t: &Telemetry, stop: &AtomicBool, done: &AtomicBool, watchdog: Option<Duration>) {
    let (mut ready, mut stopping) = (false, false);
    let mut status = (String::new(), Instant::now() - STATUS_EVERY);
    let mut last_ping: Option<Instant> = None;
    let mut unhealthy_said = false;
    loop {
        let finishing = done.load(Ordering::SeqCst);
        if stop.load(Ordering::Relaxed) || finishing {
            t.set_stopping();
        }
        if !ready && t.ready() && !t.stopping() {
            ready = true;
            let line = t.status_line();
            send(&[NotifyState::Ready, NotifyState::Status(&line)]);
            status = (line, Instant::now());
        }
        if !stopping && t.stopping() {
            stopping = true;
            send(&[NotifyState::Stopping, NotifyState::Status("stopping")]);
            status = ("stopping".into(), Instant::now());
        }
        if finishing {
            return;
        }
        let healthy = t.healthy();
        if status.1.elapsed() >= STATUS_EVERY {
            let line = if stopping { format!("stopping: {}", t.status_line()) } else { t.status_line() };
            let mut states = Vec::new();
            if line != status.0 {
                states.push(NotifyState::Status(&line));
            }
            // systemd's start and stop timeouts follow the daemon's own bounded waits.
            let extend = (!ready || stopping) && healthy.is_ok();
            if extend {
                states.push(NotifyState::ExtendTimeoutUsec(EXTEND_BY.as_micros() as u32));
            }
            if !states.is_empty() {
                send(&states);
            }
            status = (line, Instant::now());
        }
        if let Some(period) = watchdog {
            if last_ping.is_none_or(|p| p.elapsed() >= period / 2) {
                match &healthy {
                    Ok(()) => {
                        send(&[NotifyState::Watchdog]);
                        last_ping = Some(Instant::now());
                        unhealthy_said = false;
                    }
                    Err(why) if !unhealthy_said => {
                        tracing::error!("watchdog: {why}; no longer telling systemd this daemon is alive");
                        unhealthy_said = true;
                    }
                    Err(_) => {}
                }
            }
        }
        std::thread::sleep(TICK);
    }
}
