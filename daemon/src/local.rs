//! `trainerd local --workers N ...`: the tutorials' localhost cluster in one command. Starts N
//! `trainerd run` daemons on 127.0.0.1, each with its own generated TF_CONFIG, prefixes their
//! output with the worker index, and stops them all together on Ctrl-C or when one fails.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Flags whose file argument each worker gets its own copy of (`out.json` -> `out.worker1.json`).
const PER_WORKER_FILES: [&str; 2] = ["--summary", "--metrics-log"];

/// `path` with `.workerN` before its extension.
pub fn per_worker_path(path: &str, worker: usize) -> String {
    let p = Path::new(path);
    let stem = p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let name = match p.extension() {
        Some(ext) => format!("{stem}.worker{worker}.{}", ext.to_string_lossy()),
        None => format!("{stem}.worker{worker}"),
    };
    p.with_file_name(name).to_string_lossy().into_owned()
}

/// The `trainerd run` arguments for worker `i`: per-worker file flags rewritten, and a thread
/// count that shares the machine's cores when none is given.
pub fn worker_args(args: &[String], worker: usize, workers: usize, cores: usize) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len() + 2);
    let mut it = args.iter();
    let mut has_threads = false;
    while let Some(arg) = it.next() {
        has_threads |= arg == "--threads" || arg.starts_with("--threads=");
        if let Some((flag, value)) = arg.split_once('=').filter(|(f, _)| PER_WORKER_FILES.contains(f)) {
            out.push(format!("{flag}={}", per_worker_path(value, worker)));
        } else if PER_WORKER_FILES.contains(&arg.as_str()) {
            out.push(arg.clone());
            if let Some(value) = it.next() {
                out.push(per_worker_path(value, worker));
            }
        } else {
            out.push(arg.clone());
        }
    }
    if !has_threads {
        out.push("--threads".into());
        out.push((cores / workers).max(1).to_string());
    }
    out
}

/// Free loopback ports (bound and released: another process could take one in between, which
/// the daemon then reports as a port in use).
fn free_ports(n: usize) -> std::io::Result<Vec<u16>> {
    let listeners: Vec<std::net::TcpListener> =
        (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0")).collect::<Result<_, _>>()?;
    listeners.iter().map(|l| Ok(l.local_addr()?.port())).collect()
}

/// Runs the local cluster; returns this process's exit code.
pub fn run(workers: usize, args: &[String]) -> anyhow::Result<i32> {
    anyhow::ensure!(workers >= 1, "--workers {workers}: expected at least 1");
    anyhow::ensure!(
        !args.iter().any(|a| a == "--tf-config" || a.starts_with("--tf-config=")),
        "trainerd local writes each worker's TF_CONFIG itself: remove --tf-config"
    );
    let exe: PathBuf = std::env::current_exe()?;
    let ports = free_ports(workers)?;
    let addresses: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());

    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop))?;
    }

    let mut children: Vec<Child> = Vec::new();
    let mut readers = Vec::new();
    for i in 0..workers {
        let tf_config = serde_json::json!({
            "cluster": {"worker": addresses},
            "task": {"type": "worker", "index": i},
        })
        .to_string();
        let mut child = Command::new(&exe)
            .arg("run")
            .args(worker_args(args, i, workers, cores))
            .env("TF_CONFIG", tf_config)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let out = child.stdout.take().expect("piped");
        let err = child.stderr.take().expect("piped");
        readers.push(std::thread::spawn(move || relay(out, i, false)));
        readers.push(std::thread::spawn(move || relay(err, i, true)));
        children.push(child);
    }

    let mut codes: Vec<Option<i32>> = vec![None; workers];
    let mut failed: Option<usize> = None;
    while codes.iter().any(Option::is_none) {
        if stop.load(Ordering::Relaxed) {
            eprintln!("trainerd local: interrupted; stopping every worker");
            terminate(&mut children);
            return Ok(130);
        }
        for (i, child) in children.iter_mut().enumerate() {
            if codes[i].is_none() {
                if let Some(status) = child.try_wait()? {
                    let signal = std::os::unix::process::ExitStatusExt::signal(&status);
                    codes[i] = Some(status.code().unwrap_or(128 + signal.unwrap_or(0)));
                }
            }
        }
        if failed.is_none() {
            if let Some(i) = codes.iter().position(|c| c.is_some_and(|c| c != 0)) {
                failed = Some(i);
                eprintln!(
                    "trainerd local: worker {i} failed (exit status {}); stopping the others",
                    codes[i].unwrap_or(1)
                );
                terminate(&mut children);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for r in readers {
        let _ = r.join();
    }
    Ok(match failed {
        Some(i) => codes[i].unwrap_or(1),
        None => 0,
    })
}

/// Copies a child's output line by line with a `[worker i]` prefix.
fn relay(stream: impl std::io::Read, worker: usize, to_stderr: bool) {
    let prefix = format!("[worker {worker}] ");
    for line in BufReader::new(stream).split(b'\n').map_while(Result::ok) {
        // A terminal progress bar redraws with \r: keep only the latest state of the line.
        let line = String::from_utf8_lossy(&line);
        let line = line.rsplit('\r').find(|s| !s.trim().is_empty()).unwrap_or("");
        let text = format!("{prefix}{line}\n");
        if to_stderr {
            let _ = std::io::stderr().lock().write_all(text.as_bytes());
        } else {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(text.as_bytes());
            let _ = out.flush();
        }
    }
}

/// SIGTERM to every child still running, SIGKILL after a grace period.
fn terminate(children: &mut [Child]) {
    for child in children.iter_mut() {
        if matches!(child.try_wait(), Ok(None)) {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for child in children.iter_mut() {
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if matches!(child.try_wait(), Ok(None)) {
            let _ = child.kill();
        }
        let _ = child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_and_threads_are_per_worker() {
        let args: Vec<String> =
            ["--plugin", "p.so", "--summary", "out/s.json", "--metrics-log=m.jsonl"].map(String::from).to_vec();
        assert_eq!(
            worker_args(&args, 1, 2, 2),
            ["--plugin", "p.so", "--summary", "out/s.worker1.json", "--metrics-log=m.worker1.jsonl", "--threads", "1"]
        );
        let args: Vec<String> = ["--threads", "3"].map(String::from).to_vec();
        assert_eq!(worker_args(&args, 0, 4, 2), ["--threads", "3"]);
        assert_eq!(per_worker_path("summary", 2), "summary.worker2");
    }
}
