//! Supervising worker processes with systemd's semantics (`Restart=always`, `RestartSec=`,
//! `RestartPreventExitStatus=0 3`): a worker that dies (a signal, a non-final exit status) is
//! started again after the delay and rejoins its cluster; one that exits with a final status is
//! done. `trainerd local` supervises its workers with it, and so do the test suites.
//!
//! The supervisor learns what a worker did from its events channel ([`crate::events`]), never
//! from its human-readable lines: in particular whether it ever joined its cluster, which decides
//! whether a death before that can be a problem a restart cannot fix (a flag, the plugin, the
//! data). Everything it sees comes out of [`Supervisor::poll`] in the order it arrived.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, Sender};
use std::time::{Duration, Instant};

use crate::events::{self, Event, Pipe, Record};
use crate::exit::Exit;

/// How long, after a worker's exit, the supervisor waits for the end of its events before it
/// decides what the exit means.
const EVENTS_GRACE: Duration = Duration::from_secs(2);

/// How the supervisor treats deaths.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// systemd's `RestartSec=`.
    pub restart_delay: Duration,
    /// A worker that fails before it ever joined its cluster makes the supervisor give up
    /// ([`Happening::GaveUp`]) instead of restarting it.
    pub give_up_before_join: bool,
}

/// Which of a worker's output streams a line came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// What the supervisor saw, in the order it arrived.
#[derive(Debug)]
pub enum Happening {
    /// A worker wrote a line (a terminal's redraws reduced to the latest state of the line).
    Line {
        /// The worker.
        worker: usize,
        /// Where it wrote it.
        stream: Stream,
        /// The line, without its end.
        text: String,
        /// When it arrived.
        at: Instant,
    },
    /// A record from a worker's events channel.
    Event {
        /// The worker.
        worker: usize,
        /// The record.
        record: Record,
        /// When it arrived.
        at: Instant,
    },
    /// A worker exited with a final status: it is done (until brought back).
    Finished {
        /// The worker.
        worker: usize,
        /// Its exit status.
        code: i32,
    },
    /// A worker died; it is started again after the restart delay.
    Died {
        /// The worker.
        worker: usize,
        /// `SIGKILL`, `exit status 1`...
        how: String,
        /// When it died (for the time a recovery took).
        at: Instant,
    },
    /// A worker died before it ever joined its cluster, and the options say to give up.
    GaveUp {
        /// The worker.
        worker: usize,
        /// `SIGKILL`, `exit status 1`...
        how: String,
        /// Its exit status (128 + the signal for a signal).
        code: i32,
    },
    /// A worker was started again.
    Restarted {
        /// The worker.
        worker: usize,
        /// Its new process.
        pid: u32,
    },
}

/// What a worker's reader threads send: (worker, its start number, what).
type Message = (usize, usize, Received);

enum Received {
    Line(Stream, String),
    Record(Record),
    /// Its events channel ended (the process exited).
    EventsEnd,
}

/// One worker.
struct Slot {
    child: Option<Child>,
    /// Processes started for it so far.
    starts: usize,
    /// It joined its cluster at least once.
    joined: bool,
    /// Its current process's events channel ended.
    events_ended: bool,
    /// Its process exited, and when; decided once its events end.
    exited: Option<(ExitStatus, Instant)>,
    /// Its final exit status, once it has one.
    done: Option<i32>,
    restart_at: Option<Instant>,
    /// The exit status of its last death (128 + the signal for a signal).
    died_with: Option<i32>,
    /// Not to be restarted when it dies (a node gone for good).
    held: bool,
    /// Its current process was sent SIGTERM by [`Supervisor::stop`].
    stopped: bool,
}

/// Workers under supervision. Dropping it kills every worker still running.
pub struct Supervisor {
    slots: Vec<Slot>,
    options: Options,
    command: Box<dyn FnMut(usize, usize) -> Command + Send>,
    tx: Sender<Message>,
    rx: Receiver<Message>,
}

impl Supervisor {
    /// Starts `workers` workers, the `i`-th (start number `n`, from 1) as `command(i, n)`
    /// builds it.
    pub fn start(
        workers: usize,
        options: Options,
        command: impl FnMut(usize, usize) -> Command + Send + 'static,
    ) -> std::io::Result<Supervisor> {
        let (tx, rx) = mpsc::channel();
        let mut s = Supervisor { slots: Vec::new(), options, command: Box::new(command), tx, rx };
        for _ in 0..workers {
            s.slots.push(Slot {
                child: None,
                starts: 0,
                joined: false,
                events_ended: false,
                exited: None,
                done: None,
                restart_at: None,
                died_with: None,
                held: false,
                stopped: false,
            });
        }
        for worker in 0..workers {
            s.spawn(worker)?;
        }
        Ok(s)
    }

    /// Starts worker `worker`'s next process, its output and events read on threads of their own.
    fn spawn(&mut self, worker: usize) -> std::io::Result<u32> {
        let slot = &mut self.slots[worker];
        slot.starts += 1;
        let start = slot.starts;
        let mut cmd = (self.command)(worker, start);
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        // Each worker leads a process group of its own, as under a systemd unit: a terminal's
        // Ctrl-C (or hang-up) reaches the supervisor alone, which stops the workers once, after
        // the chief's commit (the terminal's SIGINT and the supervisor's SIGTERM together were two
        // signals, and a worker's second signal ends it at once, uncommitted); and a worker
        // stopped (SIGSTOP) is never continued by the kernel because the supervisor's group was
        // orphaned.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let pipe = Pipe::new()?;
        pipe.hand_to(&mut cmd);
        let mut child = cmd.spawn()?;
        let events = pipe.into_reader();
        let out = child.stdout.take().expect("piped");
        let err = child.stderr.take().expect("piped");
        relay_lines(out, Stream::Stdout, (worker, start), self.tx.clone());
        relay_lines(err, Stream::Stderr, (worker, start), self.tx.clone());
        let tx = self.tx.clone();
        std::thread::spawn(move || {
            for record in events::records(events) {
                if tx.send((worker, start, Received::Record(record))).is_err() {
                    return;
                }
            }
            let _ = tx.send((worker, start, Received::EventsEnd));
        });
        let pid = child.id();
        let slot = &mut self.slots[worker];
        (slot.child, slot.events_ended, slot.exited, slot.stopped) = (Some(child), false, None, false);
        Ok(pid)
    }

    /// Everything that happened since the last call: lines, events, exits, restarts due now.
    pub fn poll(&mut self) -> std::io::Result<Vec<Happening>> {
        let mut seen = Vec::new();
        for slot in &mut self.slots {
            if let Some(status) = slot.child.as_mut().map(Child::try_wait).transpose()?.flatten() {
                slot.child = None;
                slot.exited = Some((status, Instant::now()));
            }
        }
        while let Ok((worker, start, received)) = self.rx.try_recv() {
            let at = Instant::now();
            let current = self.slots[worker].starts == start;
            match received {
                Received::Line(stream, text) => seen.push(Happening::Line { worker, stream, text, at }),
                Received::Record(record) => {
                    if current && matches!(record.event, Event::Joined { .. }) {
                        self.slots[worker].joined = true;
                    }
                    seen.push(Happening::Event { worker, record, at });
                }
                Received::EventsEnd => self.slots[worker].events_ended |= current,
            }
        }
        for worker in 0..self.slots.len() {
            seen.extend(self.decide(worker));
            if self.slots[worker].restart_at.is_some_and(|t| Instant::now() >= t) {
                self.slots[worker].restart_at = None;
                let pid = self.spawn(worker)?;
                seen.push(Happening::Restarted { worker, pid });
            }
        }
        Ok(seen)
    }

    /// What worker `worker`'s exit means, once its events have ended (or the grace is over).
    fn decide(&mut self, worker: usize) -> Option<Happening> {
        let slot = &mut self.slots[worker];
        let (status, at) = slot.exited?;
        if !slot.events_ended && at.elapsed() < EVENTS_GRACE {
            return None;
        }
        slot.exited = None;
        let signal = std::os::unix::process::ExitStatusExt::signal(&status);
        let code = status.code().unwrap_or(128 + signal.unwrap_or(0));
        if signal.is_none() && Exit::is_final(code) {
            slot.done = Some(code);
            return Some(Happening::Finished { worker, code });
        }
        let how = signal.map_or_else(|| format!("exit status {code}"), signal_name);
        if self.options.give_up_before_join && !slot.joined {
            slot.done = Some(code);
            return Some(Happening::GaveUp { worker, how, code });
        }
        if slot.held {
            // Gone for good: its exit is final until it is brought back.
            slot.done = Some(code);
            return Some(Happening::Died { worker, how, at });
        }
        slot.died_with = Some(code);
        slot.restart_at = Some(Instant::now() + self.options.restart_delay);
        Some(Happening::Died { worker, how, at })
    }

    /// Workers supervised.
    pub fn workers(&self) -> usize {
        self.slots.len()
    }

    /// The pid of worker `worker`'s running process.
    pub fn pid(&self, worker: usize) -> Option<u32> {
        self.slots[worker].child.as_ref().map(Child::id)
    }

    /// How many processes were started for worker `worker`.
    pub fn starts(&self, worker: usize) -> usize {
        self.slots[worker].starts
    }

    /// Every worker's final exit status, once every worker has one.
    pub fn finished(&self) -> Option<Vec<i32>> {
        (0..self.slots.len()).map(|w| self.exited_for_good(w)).collect()
    }

    /// Sends `signal` to worker `worker`'s running process.
    pub fn signal(&self, worker: usize, signal: i32) -> std::io::Result<()> {
        let pid = self.pid(worker).ok_or_else(|| std::io::Error::other(format!("worker {worker} is not running")))?;
        // SAFETY: kill(2) on a child of this process.
        if unsafe { libc::kill(pid as libc::pid_t, signal) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Whether worker `worker` is held (not restarted when it dies).
    pub fn held(&self, worker: usize) -> bool {
        self.slots[worker].held
    }

    /// Does not restart worker `worker` when it dies (a node gone for good): its exit status is
    /// final, until [`Supervisor::bring_back`].
    pub fn hold(&mut self, worker: usize) {
        self.slots[worker].held = true;
    }

    /// Worker `worker`'s exit status once it has exited for good (a final status, or held), with
    /// no process running and no restart pending.
    pub fn exited_for_good(&self, worker: usize) -> Option<i32> {
        let slot = &self.slots[worker];
        slot.done.filter(|_| slot.child.is_none() && slot.restart_at.is_none())
    }

    /// Drops worker `worker`'s pending restart, if any, and holds it (a node gone for good): the
    /// run it would come back to is over. Whether a restart was pending.
    pub fn drop_restart(&mut self, worker: usize) -> bool {
        let slot = &mut self.slots[worker];
        if slot.child.is_some() || slot.restart_at.take().is_none() {
            return false;
        }
        slot.held = true;
        slot.done = Some(slot.died_with.unwrap_or(0));
        true
    }

    /// Starts worker `worker` again after it exited with a final status (a preempted node
    /// coming back), and restarts it again whenever it dies.
    pub fn bring_back(&mut self, worker: usize) -> std::io::Result<()> {
        let slot = &mut self.slots[worker];
        if slot.child.is_some() || slot.done.is_none() {
            return Err(std::io::Error::other(format!("worker {worker} has not exited for good")));
        }
        slot.held = false;
        slot.done = None;
        slot.restart_at = Some(Instant::now());
        Ok(())
    }

    /// Stops every worker gracefully: SIGTERM to each running process (it stops at a step
    /// boundary, after the chief's commit), and none is started again: a pending restart is
    /// dropped, and each exit from now on is final. [`Supervisor::poll`] goes on telling what the
    /// workers say and how each ends, until [`Supervisor::finished`]; [`Supervisor::kill`] ends
    /// those that outlast the caller's patience. Sends each process one signal only, however
    /// often it is called: a worker's second SIGTERM ends it at once, uncommitted.
    pub fn stop(&mut self) {
        for worker in 0..self.slots.len() {
            self.drop_restart(worker);
            let slot = &mut self.slots[worker];
            slot.held = true;
            if let Some(child) = slot.child.as_ref().filter(|_| !slot.stopped) {
                // SAFETY: kill(2) on our own child's pid.
                unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
                slot.stopped = true;
            }
        }
    }

    /// SIGKILL to every worker still running, none started again; the workers killed.
    pub fn kill(&mut self) -> Vec<usize> {
        let mut killed = Vec::new();
        for (worker, slot) in self.slots.iter_mut().enumerate() {
            if let Some(mut child) = slot.child.take() {
                if matches!(child.try_wait(), Ok(None)) {
                    let _ = child.kill();
                    killed.push(worker);
                }
                let _ = child.wait();
            }
            slot.restart_at = None;
        }
        killed
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        for child in self.slots.iter_mut().filter_map(|s| s.child.as_mut()) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Reads `stream` line by line on a thread of its own; a terminal progress bar redraws with
/// `\r`: only the latest state of the line is kept.
fn relay_lines(
    stream: impl Read + Send + 'static,
    which: Stream,
    (worker, start): (usize, usize),
    tx: Sender<Message>,
) {
    std::thread::spawn(move || {
        for line in BufReader::new(stream).split(b'\n').map_while(Result::ok) {
            let line = String::from_utf8_lossy(&line);
            let text = line.rsplit('\r').find(|s| !s.trim().is_empty()).unwrap_or("").to_string();
            if tx.send((worker, start, Received::Line(which, text))).is_err() {
                return;
            }
        }
    });
}

/// `SIGKILL`, `SIGSEGV`..., or `signal N`.
pub fn signal_name(signal: i32) -> String {
    let name = match signal {
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGILL => "SIGILL",
        libc::SIGHUP => "SIGHUP",
        libc::SIGPIPE => "SIGPIPE",
        _ => return format!("signal {signal}"),
    };
    name.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(give_up_before_join: bool) -> Options {
        Options { restart_delay: Duration::from_millis(10), give_up_before_join }
    }

    /// A shell worker that writes `script` (`$TRAINERD_EVENTS` is its events channel).
    fn sh(script: &'static str) -> impl FnMut(usize, usize) -> Command + Send + 'static {
        move |worker, start| {
            let mut c = Command::new("sh");
            c.args(["-c", script]).env("WORKER", worker.to_string()).env("START", start.to_string());
            c
        }
    }

    /// Polls until every worker is finished, or `GaveUp`; everything seen.
    fn run_out(s: &mut Supervisor) -> Vec<Happening> {
        let until = Instant::now() + Duration::from_secs(20);
        let mut all = Vec::new();
        while s.finished().is_none() && Instant::now() < until {
            let batch = s.poll().unwrap();
            let gave_up = batch.iter().any(|h| matches!(h, Happening::GaveUp { .. }));
            all.extend(batch);
            if gave_up {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        all
    }

    const JOIN: &str = r#"echo '{"time":0,"event":"joined","generation":1,"rank":0,"workers":1,"global_step":0,"recovery":false,"steps_lost":0,"source":null}' > "$TRAINERD_EVENTS""#;

    #[test]
    fn a_worker_killed_after_joining_is_restarted_and_a_final_status_ends_it() {
        // The first process joins, then dies by SIGKILL; the second exits 0.
        let script = Box::leak(
            format!(r#"{JOIN}; echo "start $START"; if [ "$START" = 1 ]; then kill -9 $$; fi; exit 0"#)
                .into_boxed_str(),
        );
        let mut s = Supervisor::start(1, options(true), sh(script)).unwrap();
        let seen = run_out(&mut s);
        assert_eq!(s.finished(), Some(vec![0]), "{seen:?}");
        assert_eq!(s.starts(0), 2);
        let died: Vec<&String> =
            seen.iter().filter_map(|h| if let Happening::Died { how, .. } = h { Some(how) } else { None }).collect();
        assert_eq!(died, ["SIGKILL"]);
        let lines: Vec<&str> = seen
            .iter()
            .filter_map(|h| if let Happening::Line { text, .. } = h { Some(text.as_str()) } else { None })
            .collect();
        assert_eq!(lines, ["start 1", "start 2"]);
    }

    #[test]
    fn a_worker_that_fails_before_joining_is_given_up_on_or_restarted_as_asked() {
        let mut s = Supervisor::start(1, options(true), sh("exit 1")).unwrap();
        let seen = run_out(&mut s);
        assert!(matches!(seen.last(), Some(Happening::GaveUp { code: 1, .. })), "{seen:?}");
        assert_eq!(s.starts(0), 1);
        // Without giving up, it is restarted (here until its third start exits 3, a final status).
        let mut s = Supervisor::start(1, options(false), sh(r#"[ "$START" = 3 ] && exit 3; exit 1"#)).unwrap();
        run_out(&mut s);
        assert_eq!((s.finished(), s.starts(0)), (Some(vec![3]), 3));
    }

    #[test]
    fn a_finished_worker_can_be_brought_back() {
        let mut s =
            Supervisor::start(2, options(false), sh(r#"[ "$WORKER" = 1 ] && [ "$START" = 1 ] && exit 0; sleep 0.2"#))
                .unwrap();
        let until = Instant::now() + Duration::from_secs(10);
        while !s.poll().unwrap().iter().any(|h| matches!(h, Happening::Finished { worker: 1, .. })) {
            assert!(Instant::now() < until);
        }
        s.bring_back(1).unwrap();
        run_out(&mut s);
        assert_eq!((s.finished(), s.starts(1)), (Some(vec![0, 0]), 2));
    }
}
