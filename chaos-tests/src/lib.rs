//! Harness for chaos tests: start real `trainerd` processes, watch their output, and kill them
//! at chosen moments. The binaries are the workspace's own build (`cargo build --workspace`).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The directory holding the workspace's binaries and plugins (the test executable lives in its
/// `deps/`).
pub fn build_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>").to_path_buf()
}

/// The `trainerd` binary.
pub fn trainerd() -> PathBuf {
    let path = build_dir().join("trainerd");
    assert!(path.exists(), "{} is missing: run `cargo build --workspace` first", path.display());
    path
}

/// A plugin library, by crate name.
pub fn plugin(name: &str) -> PathBuf {
    let path = build_dir().join(format!("lib{}.so", name.replace('-', "_")));
    assert!(path.exists(), "{} is missing: run `cargo build --workspace` first", path.display());
    path
}

/// Fashion-MNIST, or the MNIST-format directory in `TRAINERD_TEST_DATA`.
pub fn dataset() -> PathBuf {
    let dir = std::env::var_os("TRAINERD_TEST_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/usr/share/datasets/fashion-mnist".into());
    assert!(dir.join("train-images-idx3-ubyte.gz").exists(), "no dataset in {}: run scripts/setup.sh", dir.display());
    dir
}

/// A running daemon whose standard output is read line by line.
pub struct Worker {
    child: Child,
    lines: Receiver<String>,
    seen: Vec<String>,
}

impl Worker {
    /// Starts `trainerd` with `args`.
    pub fn start(args: &[&str]) -> Worker {
        let mut child = Command::new(trainerd())
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start trainerd");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Worker { child, lines, seen: Vec::new() }
    }

    /// Waits until a line satisfies `pred`; panics with everything seen on timeout or exit.
    pub fn wait_for_line(&mut self, pred: impl Fn(&str) -> bool, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if pred(&line) {
                        return line;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    panic!("no matching line within {timeout:?}; saw:\n{}", self.seen.join("\n"))
                }
                Err(RecvTimeoutError::Disconnected) => panic!("trainerd ended first; saw:\n{}", self.seen.join("\n")),
            }
        }
    }

    /// Sends `signal` and waits for the process to end.
    pub fn kill(mut self, signal: i32) -> ExitStatus {
        // SAFETY: kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        assert_eq!(rc, 0, "kill: {}", std::io::Error::last_os_error());
        self.child.wait().expect("wait for trainerd")
    }

    /// Waits for a normal end.
    pub fn wait(mut self) -> ExitStatus {
        self.child.wait().expect("wait for trainerd")
    }
}

/// `params_sha256` from a summary file.
pub fn params_sha256(summary: &Path) -> String {
    let text = std::fs::read_to_string(summary).unwrap_or_else(|e| panic!("{}: {e}", summary.display()));
    let json: serde_json::Value = serde_json::from_str(&text).expect("summary is JSON");
    json["params_sha256"].as_str().expect("params_sha256").to_string()
}

/// Exit statuses after which the supervisor does not restart a worker, as the systemd unit's
/// `RestartPreventExitStatus=0 3`: the run finished (or the worker was stopped), or finished
/// without its last commit.
pub const FINAL_STATUSES: [i32; 2] = [0, 3];

/// `n` free loopback ports (held together while chosen, so they differ).
pub fn free_ports(n: usize) -> Vec<u16> {
    let ls: Vec<_> = (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    ls.iter().map(|l| l.local_addr().unwrap().port()).collect()
}

/// A worker's TF_CONFIG in a cluster of loopback `ports`.
pub fn tf_config(ports: &[u16], index: usize) -> String {
    let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    serde_json::json!({"cluster": {"worker": addrs}, "task": {"type": "worker", "index": index}}).to_string()
}

/// One supervised worker.
struct Slot {
    child: Option<Child>,
    starts: usize,
    /// Its final exit status, once it exited with one of [`FINAL_STATUSES`].
    done: Option<i32>,
    restart_at: Option<Instant>,
    /// Environment for its first start only (a failpoint must not follow it into its restart).
    first_env: Vec<(String, String)>,
}

struct Shared {
    slots: Vec<Slot>,
    restart_sec: Duration,
    closed: bool,
}

/// A cluster of real `trainerd run` processes under a supervisor with systemd's semantics
/// (`Restart=always`, `RestartSec=`, `RestartPreventExitStatus=0 3`). Every line a worker
/// prints is timestamped and kept. Dropping it kills every worker.
pub struct Cluster {
    shared: Arc<Mutex<Shared>>,
    lines: Receiver<(usize, Instant, String)>,
    /// Every line seen so far: (worker, when, text).
    pub seen: Vec<(usize, Instant, String)>,
    supervisor: Option<std::thread::JoinHandle<()>>,
}

fn spawn_worker(
    rank: usize,
    args: &[String],
    env: &[(String, String)],
    tf_config: &str,
    tx: &std::sync::mpsc::Sender<(usize, Instant, String)>,
) -> Child {
    let mut cmd = Command::new(trainerd());
    let args = args.iter().map(|a| a.replace("{rank}", &rank.to_string()));
    cmd.arg("run").args(args).env("TF_CONFIG", tf_config).stdout(Stdio::piped()).stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("start trainerd");
    for stream in [
        Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
        Box::new(child.stderr.take().unwrap()),
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                if tx.send((rank, Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
    }
    child
}

impl Cluster {
    /// Starts `workers` workers with `args` (for `trainerd run`, without TF_CONFIG; `{rank}` in
    /// an argument becomes the worker's index) and `env`,
    /// restarting any that dies after `restart_sec`. `first_env[i]` is added to worker i's first
    /// start only.
    pub fn start(
        workers: usize,
        args: &[String],
        env: &[(String, String)],
        first_env: Vec<Vec<(String, String)>>,
        restart_sec: Duration,
    ) -> Cluster {
        let ports = free_ports(workers);
        let (tx, lines) = mpsc::channel();
        let mut slots = Vec::new();
        for rank in 0..workers {
            let extra = first_env.get(rank).cloned().unwrap_or_default();
            let all: Vec<(String, String)> = env.iter().cloned().chain(extra).collect();
            let child = spawn_worker(rank, args, &all, &tf_config(&ports, rank), &tx);
            slots.push(Slot { child: Some(child), starts: 1, done: None, restart_at: None, first_env: Vec::new() });
        }
        let shared = Arc::new(Mutex::new(Shared { slots, restart_sec, closed: false }));
        let supervisor = {
            let (shared, args, env) = (Arc::clone(&shared), args.to_vec(), env.to_vec());
            std::thread::spawn(move || loop {
                {
                    let mut s = shared.lock().unwrap();
                    if s.closed {
                        return;
                    }
                    let delay = s.restart_sec;
                    for (rank, slot) in s.slots.iter_mut().enumerate() {
                        if let Some(status) = slot.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
                            slot.child = None;
                            let _ =
                                tx.send((rank, Instant::now(), format!("supervisor: worker {rank} exited: {status}")));
                            match status.code() {
                                Some(code) if FINAL_STATUSES.contains(&code) => slot.done = Some(code),
                                _ => slot.restart_at = Some(Instant::now() + delay),
                            }
                        }
                        if slot.restart_at.is_some_and(|t| Instant::now() >= t) {
                            slot.restart_at = None;
                            let all: Vec<(String, String)> =
                                env.iter().cloned().chain(std::mem::take(&mut slot.first_env)).collect();
                            slot.child = Some(spawn_worker(rank, &args, &all, &tf_config(&ports, rank), &tx));
                            slot.starts += 1;
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
            })
        };
        Cluster { shared, lines, seen: Vec::new(), supervisor: Some(supervisor) }
    }

    /// The pid of worker `rank`'s current process.
    pub fn pid(&self, rank: usize) -> Option<u32> {
        self.shared.lock().unwrap().slots[rank].child.as_ref().map(Child::id)
    }

    /// How many times worker `rank` was started.
    pub fn starts(&self, rank: usize) -> usize {
        self.shared.lock().unwrap().slots[rank].starts
    }

    /// Sends `signal` to worker `rank`'s current process.
    pub fn signal(&self, rank: usize, signal: i32) {
        let pid = self.pid(rank).unwrap_or_else(|| panic!("worker {rank} is not running"));
        // SAFETY: kill(2) on a child of this process.
        let rc = unsafe { libc::kill(pid as libc::pid_t, signal) };
        assert_eq!(rc, 0, "kill: {}", std::io::Error::last_os_error());
    }

    /// Starts worker `rank` again after it exited for good (a preempted node coming back).
    pub fn bring_back(&self, rank: usize) {
        let mut s = self.shared.lock().unwrap();
        let slot = &mut s.slots[rank];
        assert!(slot.child.is_none() && slot.done.is_some(), "worker {rank} has not exited for good");
        slot.done = None;
        slot.restart_at = Some(Instant::now());
    }

    fn take(&mut self, timeout: Duration) -> Option<(usize, Instant, String)> {
        match self.lines.recv_timeout(timeout) {
            Ok(l) => {
                self.seen.push(l.clone());
                Some(l)
            }
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => {
                std::thread::sleep(timeout);
                None
            }
        }
    }

    /// Waits until a worker prints a line satisfying `pred` (worker, text); panics with every
    /// line seen after `timeout`.
    pub fn wait_for(&mut self, pred: impl Fn(usize, &str) -> bool, timeout: Duration) -> (usize, Instant, String) {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(l) = self.take(Duration::from_millis(50)) {
                if pred(l.0, &l.2) {
                    return l;
                }
            }
        }
        panic!("no matching line within {timeout:?}; saw:\n{}", self.transcript())
    }

    /// Waits until each of `ranks` prints a line satisfying `pred` (text), in whatever order
    /// they come; the first such line of each, in `ranks`' order.
    pub fn wait_for_each(
        &mut self,
        ranks: &[usize],
        pred: impl Fn(&str) -> bool,
        timeout: Duration,
    ) -> Vec<(usize, Instant, String)> {
        let mut found: Vec<Option<(usize, Instant, String)>> = vec![None; ranks.len()];
        while found.iter().any(Option::is_none) {
            let missing = |r: usize| ranks.iter().zip(&found).any(|(&want, f)| want == r && f.is_none());
            let l = self.wait_for(|r, l| missing(r) && pred(l), timeout);
            let i = ranks.iter().zip(&found).position(|(&want, f)| want == l.0 && f.is_none()).expect("a missing rank");
            found[i] = Some(l);
        }
        found.into_iter().map(|f| f.expect("found")).collect()
    }

    /// Waits until every worker has exited for good; their exit statuses. Panics after `timeout`
    /// (the outer deadline: a hang fails the test).
    pub fn wait_finished(&mut self, timeout: Duration) -> Vec<i32> {
        let deadline = Instant::now() + timeout;
        loop {
            let done: Option<Vec<i32>> = {
                let s = self.shared.lock().unwrap();
                s.slots
                    .iter()
                    .map(|slot| slot.done.filter(|_| slot.child.is_none() && slot.restart_at.is_none()))
                    .collect()
            };
            if let Some(codes) = done {
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

    /// Every line seen, prefixed with its worker.
    pub fn transcript(&self) -> String {
        self.seen.iter().map(|(r, _, l)| format!("[worker {r}] {l}")).collect::<Vec<_>>().join("\n")
    }

    /// Lines of worker `rank` that start with `prefix`.
    pub fn lines_of(&self, rank: usize, prefix: &str) -> Vec<String> {
        self.seen.iter().filter(|(r, _, l)| *r == rank && l.starts_with(prefix)).map(|(_, _, l)| l.clone()).collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let mut s = self.shared.lock().unwrap();
        s.closed = true;
        for slot in &mut s.slots {
            if let Some(c) = slot.child.as_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        drop(s);
        if let Some(h) = self.supervisor.take() {
            let _ = h.join();
        }
    }
}
