//! Harness for chaos tests: start real `trainerd` processes, watch their output, and kill them
//! at chosen moments. The binaries are the workspace's own build (`cargo build --workspace`).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
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
