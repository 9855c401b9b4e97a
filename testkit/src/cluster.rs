//! Real `trainerd` processes under test. [`Cluster`]: `trainerd run` workers under the daemon's
//! own supervisor (systemd's semantics, the one `trainerd local` uses), everything they print and
//! every event they emit kept in one timestamped transcript. [`Worker`]: one `trainerd` process
//! (`run` or `local`) watched alone. Tests wait on events; they read the human lines only to
//! assert their wording.

use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use trainerd_supervise::events::{self, Event, Pipe, Record};
use trainerd_supervise::supervisor::{Happening, Options, Supervisor};

use crate::paths::trainerd;
use crate::ports::{free_ports, tf_config};
use crate::run::RunArgs;

/// What a worker did.
#[derive(Clone, Debug, PartialEq)]
pub enum What {
    /// It printed a line (standard output or error).
    Line(String),
    /// It emitted an event.
    Event(Event),
    /// It exited with a final status (done, until brought back).
    Finished(i32),
    /// It died (`SIGKILL`, `exit status 1`...) and is restarted.
    Died(String),
    /// Its next process started.
    Restarted,
}

/// One thing seen: whose, when it arrived, what.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// The worker's rank.
    pub worker: usize,
    /// When the test saw it.
    pub at: Instant,
    /// What.
    pub what: What,
}

impl Entry {
    fn of(h: Happening) -> Option<Entry> {
        let (worker, at, what) = match h {
            Happening::Line { worker, text, at, .. } => (worker, at, What::Line(text)),
            Happening::Event { worker, record, at } => (worker, at, What::Event(record.event)),
            Happening::Finished { worker, code } => (worker, Instant::now(), What::Finished(code)),
            Happening::Died { worker, how, at } => (worker, at, What::Died(how)),
            Happening::Restarted { worker, .. } => (worker, Instant::now(), What::Restarted),
            Happening::GaveUp { .. } => return None,
        };
        Some(Entry { worker, at, what })
    }

    /// Its event, if it is one.
    pub fn event(&self) -> Option<&Event> {
        match &self.what {
            What::Event(e) => Some(e),
            _ => None,
        }
    }

    /// Its line, if it is one.
    pub fn line(&self) -> Option<&str> {
        match &self.what {
            What::Line(l) => Some(l),
            _ => None,
        }
    }
}

/// A cluster of real `trainerd run` processes on loopback, supervised with systemd's semantics
/// (`Restart=always`, `RestartSec=`, `RestartPreventExitStatus=0 3`). Dropping it kills every
/// worker.
pub struct Cluster {
    supervisor: Arc<Mutex<Supervisor>>,
    closed: Arc<AtomicBool>,
    entries: Receiver<Entry>,
    /// Everything seen so far, in the order it arrived.
    pub seen: Vec<Entry>,
    poller: Option<std::thread::JoinHandle<()>>,
    /// Environment for each worker's next start only ([`Cluster::arm`]).
    armed: Arc<Mutex<Vec<Env>>>,
    /// The cluster's own `$XDG_STATE_HOME`, where its workers keep their votes: removed with the
    /// cluster (last, once the supervisor has killed every worker). Two tests whose clusters
    /// chose the same ports and run the same job would otherwise share one state directory, and
    /// a vote left by one (a worker elected in a term) would make it coordinate the other's run
    /// from its start.
    _state: tempfile::TempDir,
}

/// Environment variables for a process.
type Env = Vec<(String, String)>;

impl Cluster {
    /// Starts `workers` workers with `args` (for `trainerd run`, without TF_CONFIG; `{rank}` in
    /// an argument becomes the worker's index) and `env`, restarting any that dies after
    /// `restart_sec`. `first_env[i]` is added to worker i's first start only (a failpoint must not
    /// follow it into its restart).
    pub fn start(
        workers: usize,
        args: &RunArgs,
        env: &[(String, String)],
        first_env: Vec<Vec<(String, String)>>,
        restart_sec: Duration,
    ) -> Cluster {
        let ports = free_ports(workers);
        let place = move |rank: usize| (Command::new(trainerd()), tf_config(&ports, rank));
        Cluster::launch(workers, (&args.to_vec(), env, first_env), restart_sec, place)
    }

    /// As [`Cluster::start`], each worker in its namespace of `net` (at port 7000 of its
    /// address).
    pub fn start_in(net: &crate::Netns, workers: usize, args: &RunArgs, restart_sec: Duration) -> Cluster {
        let addrs: Vec<String> = (0..workers).map(|i| format!("{}:7000", net.host(i))).collect();
        let prefixes: Vec<Vec<String>> = (0..workers).map(|i| net.exec(i)).collect();
        let place = move |rank: usize| {
            let mut cmd = Command::new(&prefixes[rank][0]);
            cmd.args(&prefixes[rank][1..]).arg(trainerd());
            let tf = serde_json::json!({"cluster": {"worker": addrs}, "task": {"type": "worker", "index": rank}});
            (cmd, tf.to_string())
        };
        Cluster::launch(workers, (&args.to_vec(), &[], vec![]), restart_sec, place)
    }

    /// Starts the workers, worker `rank` as `place(rank)` (its command, before `run`, and its
    /// TF_CONFIG).
    fn launch(
        workers: usize,
        (args, env, first_env): (&[String], &[(String, String)], Vec<Env>),
        restart_sec: Duration,
        place: impl Fn(usize) -> (Command, String) + Send + 'static,
    ) -> Cluster {
        let (args, env) = (args.to_vec(), env.to_vec());
        let state = tempfile::Builder::new().prefix("trainerd-state-").tempdir().expect("a state directory");
        let state_home = state.path().to_path_buf();
        let armed: Arc<Mutex<Vec<Env>>> = Arc::new(Mutex::new(vec![Vec::new(); workers]));
        let next_env = Arc::clone(&armed);
        let command = move |rank: usize, start: usize| {
            let (mut cmd, tf_config) = place(rank);
            cmd.arg("run").args(args.iter().map(|a| a.replace("{rank}", &rank.to_string())));
            cmd.env("TF_CONFIG", tf_config).env("XDG_STATE_HOME", &state_home).envs(env.iter().cloned());
            if start == 1 {
                cmd.envs(first_env.get(rank).cloned().unwrap_or_default());
            }
            cmd.envs(std::mem::take(&mut next_env.lock().unwrap()[rank]));
            cmd
        };
        let options = Options { restart_delay: restart_sec, give_up_before_join: false };
        let supervisor = Supervisor::start(workers, options, command).expect("start trainerd");
        let supervisor = Arc::new(Mutex::new(supervisor));
        let closed = Arc::new(AtomicBool::new(false));
        let (tx, entries) = mpsc::channel();
        let poller = {
            let (supervisor, closed) = (Arc::clone(&supervisor), Arc::clone(&closed));
            std::thread::spawn(move || {
                while !closed.load(Ordering::Relaxed) {
                    let seen = supervisor.lock().unwrap().poll().expect("supervising");
                    for entry in seen.into_iter().filter_map(Entry::of) {
                        let _ = tx.send(entry);
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            })
        };
        Cluster { supervisor, closed, entries, seen: Vec::new(), poller: Some(poller), armed, _state: state }
    }

    /// Adds `env` to worker `rank`'s next start only (a failpoint for the process that replaces
    /// the one about to be killed).
    pub fn arm(&self, rank: usize, env: Vec<(String, String)>) {
        self.armed.lock().unwrap()[rank] = env;
    }

    /// Takes what has arrived, without waiting.
    pub fn drain(&mut self) {
        while self.take(Duration::ZERO).is_some() {}
    }

    /// The pid of worker `rank`'s current process.
    pub fn pid(&self, rank: usize) -> Option<u32> {
        self.supervisor.lock().unwrap().pid(rank)
    }

    /// How many times worker `rank` was started.
    pub fn starts(&self, rank: usize) -> usize {
        self.supervisor.lock().unwrap().starts(rank)
    }

    /// Sends `signal` to worker `rank`'s current process.
    pub fn signal(&self, rank: usize, signal: i32) {
        self.supervisor.lock().unwrap().signal(rank, signal).unwrap_or_else(|e| panic!("worker {rank}: {e}"));
    }

    /// Does not restart worker `rank` when it dies (a node gone for good).
    pub fn hold(&self, rank: usize) {
        self.supervisor.lock().unwrap().hold(rank);
    }

    /// Starts worker `rank` again after it exited for good (a preempted node coming back).
    pub fn bring_back(&self, rank: usize) {
        self.supervisor.lock().unwrap().bring_back(rank).unwrap_or_else(|e| panic!("{e}"));
    }

    /// The next entry, if one comes within `timeout`.
    fn take(&mut self, timeout: Duration) -> Option<Entry> {
        match self.entries.recv_timeout(timeout) {
            Ok(e) => {
                self.seen.push(e.clone());
                Some(e)
            }
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => None,
        }
    }

    /// Takes what arrives for `d`.
    pub fn idle(&mut self, d: Duration) {
        let until = Instant::now() + d;
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            self.take(left.min(Duration::from_millis(50)));
        }
    }

    /// Waits until an entry satisfies `pred`; panics with the transcript after `timeout`.
    pub fn wait_for(&mut self, pred: impl Fn(&Entry) -> bool, timeout: Duration) -> Entry {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(e) = self.take(Duration::from_millis(50)).filter(|e| pred(e)) {
                return e;
            }
        }
        panic!("nothing matching within {timeout:?}; saw:\n{}", self.transcript())
    }

    /// The first entry at or after `mark` that satisfies `pred`, waiting for it when none has
    /// arrived yet; panics with the transcript after `timeout`.
    pub fn wait_after(&mut self, mark: usize, pred: impl Fn(&Entry) -> bool, timeout: Duration) -> Entry {
        match self.seen.iter().skip(mark).find(|e| pred(e)) {
            Some(e) => e.clone(),
            None => self.wait_for(pred, timeout),
        }
    }

    /// Waits until worker `rank` emits an event satisfying `pred`; when it arrived, and the event.
    pub fn wait_event(&mut self, rank: usize, pred: impl Fn(&Event) -> bool, timeout: Duration) -> (Instant, Event) {
        let e = self.wait_for(|e| e.worker == rank && e.event().is_some_and(&pred), timeout);
        (e.at, e.event().cloned().expect("an event"))
    }

    /// As [`Cluster::wait_event`], looking from `mark` (entries taken since by other waits too:
    /// a staged return's wait may have taken the returner's join).
    pub fn wait_event_after(
        &mut self,
        rank: usize,
        mark: usize,
        pred: impl Fn(&Event) -> bool,
        timeout: Duration,
    ) -> (Instant, Event) {
        let e = self.wait_after(mark, |e| e.worker == rank && e.event().is_some_and(&pred), timeout);
        (e.at, e.event().cloned().expect("an event"))
    }

    /// Waits until each of `ranks` emits an event satisfying `pred`, in whatever order they come;
    /// the first such event of each, in `ranks`' order.
    pub fn wait_events_each(
        &mut self,
        ranks: &[usize],
        pred: impl Fn(&Event) -> bool,
        timeout: Duration,
    ) -> Vec<(Instant, Event)> {
        let mut found: Vec<Option<(Instant, Event)>> = vec![None; ranks.len()];
        while found.iter().any(Option::is_none) {
            let missing = |r: usize| ranks.iter().zip(&found).any(|(&want, f)| want == r && f.is_none());
            let e = self.wait_for(|e| missing(e.worker) && e.event().is_some_and(&pred), timeout);
            let i = ranks.iter().zip(&found).position(|(&want, f)| want == e.worker && f.is_none()).expect("missing");
            found[i] = Some((e.at, e.event().cloned().expect("an event")));
        }
        found.into_iter().map(|f| f.expect("found")).collect()
    }

    /// Waits until worker `rank` has done global step `global_step` (1-based) or more.
    pub fn wait_step(&mut self, rank: usize, global_step: u64, timeout: Duration) {
        let done = |e: &Event| matches!(e, Event::Step { global_step: g, .. } if *g >= global_step);
        if !self.seen.iter().any(|e| e.worker == rank && e.event().is_some_and(done)) {
            self.wait_event(rank, done, timeout);
        }
    }

    /// A mark in the transcript: what arrives from now on is at or after it.
    pub fn mark(&self) -> usize {
        self.seen.len()
    }

    /// The first formation every worker joined at or after `mark` (seen so far): (rank, its
    /// `Joined` event), by rank.
    pub fn joined_after(&self, mark: usize) -> Vec<(usize, Event)> {
        let mut joined: Vec<(usize, Event)> = Vec::new();
        for e in &self.seen[mark..] {
            if let What::Event(j @ Event::Joined { .. }) = &e.what {
                if !joined.iter().any(|(r, _)| *r == e.worker) {
                    joined.push((e.worker, j.clone()));
                }
            }
        }
        joined.sort_by_key(|(r, _)| *r);
        joined
    }

    /// The first line of worker `rank` at or after `mark` that starts with `prefix`, waiting for
    /// it when it has not arrived yet (after the event that says it was printed, its line can
    /// still be on its way); when it arrived, and the line.
    pub fn wait_line(&mut self, rank: usize, prefix: &str, mark: usize, timeout: Duration) -> (Instant, String) {
        let (_, at, line) = self.wait_line_of(|r| r == rank, prefix, mark, timeout);
        (at, line)
    }

    /// The first line at or after `mark` of a worker whose rank `of` accepts, that starts with
    /// `prefix` (waiting for it); the worker, when it arrived, and the line.
    pub fn wait_line_of(
        &mut self,
        of: impl Fn(usize) -> bool,
        prefix: &str,
        mark: usize,
        timeout: Duration,
    ) -> (usize, Instant, String) {
        let matches = |e: &Entry| of(e.worker) && e.line().is_some_and(|l| l.starts_with(prefix));
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(e) = self.seen.iter().skip(mark).find(|e| matches(e)) {
                return (e.worker, e.at, e.line().expect("a line").to_string());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "no line starting with {prefix:?} at or after mark {mark}; saw:\n{}",
                self.transcript()
            );
            self.take(left.min(Duration::from_millis(50)));
        }
    }

    /// Waits until worker `rank` exits with a final status; when, and the status.
    pub fn wait_exit(&mut self, rank: usize, timeout: Duration) -> (Instant, i32) {
        let e = self.wait_for(|e| e.worker == rank && matches!(e.what, What::Finished(_)), timeout);
        let What::Finished(code) = e.what else { unreachable!("matched above") };
        (e.at, code)
    }

    /// Waits until every worker has exited for good; their exit statuses. Panics after `timeout`
    /// (the outer deadline: a hang fails the test).
    pub fn wait_finished(&mut self, timeout: Duration) -> Vec<i32> {
        let deadline = Instant::now() + timeout;
        loop {
            let finished = self.supervisor.lock().unwrap().finished();
            if let Some(codes) = finished {
                while self.take(Duration::from_millis(100)).is_some() {}
                return codes;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not finish within {timeout:?}; saw:\n{}",
                self.transcript()
            );
            self.take(Duration::from_millis(50));
        }
    }

    /// Everything seen, one line each, prefixed with its worker.
    pub fn transcript(&self) -> String {
        let show = |e: &Entry| match &e.what {
            What::Line(l) => format!("[worker {}] {l}", e.worker),
            other => format!("[worker {}] ({other:?})", e.worker),
        };
        self.seen.iter().map(show).collect::<Vec<_>>().join("\n")
    }

    /// Lines of worker `rank` that start with `prefix`.
    /// Everything seen so far, in order (a [`Cluster::mark`] indexes it).
    pub fn seen(&self) -> &[Entry] {
        &self.seen
    }

    /// Every line of worker `rank` seen so far that starts with `prefix`.
    pub fn lines_of(&self, rank: usize, prefix: &str) -> Vec<String> {
        let of = |e: &Entry| e.line().filter(|l| e.worker == rank && l.starts_with(prefix)).map(String::from);
        self.seen.iter().filter_map(of).collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.closed.store(true, Ordering::Relaxed);
        if let Some(h) = self.poller.take() {
            let _ = h.join();
        }
        // A failing test keeps the whole transcript (its message may show only part of it, and a
        // test binary run in a loop overwrites its output); every test does with
        // TRAINERD_KEEP_TRANSCRIPTS=1 (to read how close a passing run came to a deadline or the
        // run's end).
        let every = std::env::var_os("TRAINERD_KEEP_TRANSCRIPTS").is_some_and(|v| v == "1");
        if std::thread::panicking() || every {
            while self.take(Duration::from_millis(10)).is_some() {}
            keep_transcript(&self.transcript());
        }
        // The supervisor, dropped with the last reference, kills every worker still running.
    }
}

/// Writes a failing test's `transcript` to `$TRAINERD_TRANSCRIPTS` (default: the temporary
/// directory's `trainerd-transcripts`), named for the test and the time, and says where.
fn keep_transcript(transcript: &str) {
    let dir = std::env::var_os("TRAINERD_TRANSCRIPTS")
        .map_or_else(|| std::env::temp_dir().join("trainerd-transcripts"), std::path::PathBuf::from);
    let test = std::thread::current().name().unwrap_or("test").replace("::", "-");
    let at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
    let path = dir.join(format!("{test}-{at}.log"));
    match std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, transcript)) {
        Ok(()) => eprintln!("the cluster's transcript is kept in {}", path.display()),
        Err(e) => eprintln!("the cluster's transcript could not be kept in {}: {e}", path.display()),
    }
}

/// What a watched process gives.
enum Out {
    Line(String),
    Record(Record),
}

/// One `trainerd` process, its output (standard output and error) and its events read as they
/// come.
pub struct Worker {
    child: Child,
    out: Receiver<Out>,
    /// Lines seen so far, standard output's and error's.
    pub lines: Vec<String>,
    /// Events seen so far.
    pub records: Vec<Record>,
}

impl Worker {
    /// Starts `trainerd` with `args`, its events on a pipe of their own.
    pub fn start(args: &[&str]) -> Worker {
        Worker::start_with(args, &[])
    }

    /// Starts `trainerd` with `args` and the variables `env` (an S3 server's, say).
    pub fn start_with(args: &[&str], env: &[(&str, String)]) -> Worker {
        let mut cmd = Command::new(trainerd());
        cmd.args(args).envs(env.iter().map(|(k, v)| (k, v))).stdout(Stdio::piped()).stderr(Stdio::piped());
        // It leads a process group of its own, as a shell's job does ([`Worker::signal_job`]).
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let pipe = Pipe::new().expect("a pipe");
        pipe.hand_to(&mut cmd);
        let mut child = cmd.spawn().expect("start trainerd");
        let (tx, out) = mpsc::channel();
        let streams: [Box<dyn std::io::Read + Send>; 2] =
            [Box::new(child.stdout.take().expect("piped")), Box::new(child.stderr.take().expect("piped"))];
        for stream in streams {
            let lines = tx.clone();
            std::thread::spawn(move || {
                use std::io::BufRead;
                for line in std::io::BufReader::new(stream).lines().map_while(Result::ok) {
                    if lines.send(Out::Line(line)).is_err() {
                        return;
                    }
                }
            });
        }
        let reader = pipe.into_reader();
        std::thread::spawn(move || {
            for record in events::records(reader) {
                if tx.send(Out::Record(record)).is_err() {
                    return;
                }
            }
        });
        Worker { child, out, lines: Vec::new(), records: Vec::new() }
    }

    fn take(&mut self, left: Duration) -> Result<(), RecvTimeoutError> {
        match self.out.recv_timeout(left)? {
            Out::Line(l) => self.lines.push(l),
            Out::Record(r) => self.records.push(r),
        }
        Ok(())
    }

    /// Takes what the process gives until `find` finds something in what was seen; panics
    /// naming `what` after `timeout`, or when the process ends first.
    fn wait_until<T>(&mut self, what: &str, find: impl Fn(&Worker) -> Option<T>, timeout: Duration) -> T {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(found) = find(self) {
                return found;
            }
            if let Err(why) = self.take(deadline.saturating_duration_since(Instant::now())) {
                let ended = if why == RecvTimeoutError::Disconnected { "trainerd ended first" } else { "timed out" };
                panic!("no {what} within {timeout:?} ({ended}); saw:\n{}\n{:?}", self.lines.join("\n"), self.records)
            }
        }
    }

    /// Waits until an event satisfies `pred` (one seen already counts).
    pub fn wait_event(&mut self, pred: impl Fn(&Record) -> bool, timeout: Duration) -> Record {
        self.wait_until("matching event", |w| w.records.iter().find(|r| pred(r)).cloned(), timeout)
    }

    /// Waits until a line satisfies `pred` (one seen already counts).
    pub fn wait_line(&mut self, pred: impl Fn(&str) -> bool, timeout: Duration) -> String {
        self.wait_until("matching line", |w| w.lines.iter().find(|l| pred(l)).cloned(), timeout)
    }

    /// Sends `signal` and waits for the process to end.
    pub fn kill(mut self, signal: i32) -> ExitStatus {
        // SAFETY: kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        assert_eq!(rc, 0, "kill: {}", std::io::Error::last_os_error());
        self.child.wait().expect("wait for trainerd")
    }

    /// Sends `signal` to the process's whole group, as a terminal sends Ctrl-C (SIGINT) or its
    /// hang-up to the job in front: every process in the group that has not left it gets it.
    pub fn signal_job(&self, signal: i32) {
        // SAFETY: kill(2) on the group our own child leads (it was started as its leader).
        let rc = unsafe { libc::kill(-(self.child.id() as libc::pid_t), signal) };
        assert_eq!(rc, 0, "kill: {}", std::io::Error::last_os_error());
    }

    /// Waits for the process to end and its output to close (at most `timeout`): its exit
    /// status, every line it wrote and every event.
    pub fn drain(mut self, timeout: Duration) -> (ExitStatus, Vec<String>, Vec<Record>) {
        let deadline = Instant::now() + timeout;
        while let Err(RecvTimeoutError::Timeout) | Ok(()) =
            self.take(deadline.saturating_duration_since(Instant::now()))
        {
            if Instant::now() >= deadline {
                panic!("trainerd's output still open after {timeout:?}; saw:\n{}", self.lines.join("\n"));
            }
        }
        let status = self.child.wait().expect("wait for trainerd");
        (status, self.lines, self.records)
    }

    /// Waits for a normal end.
    pub fn wait(mut self) -> ExitStatus {
        self.child.wait().expect("wait for trainerd")
    }
}
