//! `trainerd local --workers N ...`: the tutorials' localhost cluster in one command. Starts N
//! `trainerd run` daemons on 127.0.0.1, each with its own generated TF_CONFIG, prefixes their
//! output with the worker index, and supervises them as systemd would (`Restart=always`,
//! `RestartSec=--restart-delay`, `RestartPreventExitStatus=0 3`): a worker that dies (a signal,
//! a non-zero exit) is started again and rejoins the run, which goes on without losing a step;
//! a worker that exits 0 has finished or was stopped. A worker that fails before it ever joined
//! the cluster has a problem a restart cannot fix (a flag, the plugin, the data): everyone is
//! stopped. Ctrl-C (or SIGTERM) stops every worker gracefully: the chief commits first.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Flags whose file argument each worker gets its own copy of (`out.json` -> `out.worker1.json`).
const PER_WORKER_FILES: [&str; 2] = ["--summary", "--metrics-log"];
/// Exit statuses that are final: finished or stopped (0), finished but not committed (3).
const FINAL_STATUSES: [i32; 2] = [0, 3];
/// How long stopped workers get to commit and exit before they are killed.
const STOP_GRACE: Duration = Duration::from_secs(90);

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

/// What a worker's output tells the supervisor.
enum Event {
    /// It joined a generation (the first, or a recovered one).
    Joined,
    /// It took its first step after a recovery: the rest of its line.
    Recovered(String),
}

/// One worker under supervision.
struct Slot {
    child: Option<Child>,
    /// It joined the cluster at least once: a later death is a failure to recover from.
    joined: bool,
    /// Its final exit status, once it has one.
    exit: Option<i32>,
    restart_at: Option<Instant>,
    died_at: Option<Instant>,
}

/// Runs the local cluster; returns this process's exit code.
pub fn run(workers: usize, restart_delay: Duration, args: &[String]) -> anyhow::Result<i32> {
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
    let (events, incoming) = mpsc::channel::<(usize, Event)>();
    let start = |i: usize| -> std::io::Result<Child> {
        let tf_config = serde_json::json!({
            "cluster": {"worker": addresses},
            "task": {"type": "worker", "index": i},
        })
        .to_string();
        let mut child = Command::new(&exe)
            .arg("run")
            .args(worker_args(args, i, workers, cores))
            .env("TF_CONFIG", tf_config)
            // `--device auto` puts worker i on cuda:(i mod GPUs).
            .env("LOCAL_RANK", i.to_string())
            // systemd's notifications are the supervisor's to send, not its workers'.
            .env_remove("NOTIFY_SOCKET")
            .env_remove("WATCHDOG_USEC")
            .env_remove("WATCHDOG_PID")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let out = child.stdout.take().expect("piped");
        let err = child.stderr.take().expect("piped");
        let tx = events.clone();
        std::thread::spawn(move || relay(out, i, false, Some(tx)));
        std::thread::spawn(move || relay(err, i, true, None));
        Ok(child)
    };

    let mut slots = Vec::with_capacity(workers);
    for i in 0..workers {
        slots.push(Slot { child: Some(start(i)?), joined: false, exit: None, restart_at: None, died_at: None });
    }
    let pids: Vec<String> = slots
        .iter()
        .enumerate()
        .map(|(i, s)| format!("worker {i} (pid {})", s.child.as_ref().map_or(0, Child::id)))
        .collect();
    say(&format!("started {}", pids.join(", ")));

    loop {
        if stop.load(Ordering::Relaxed) {
            say("interrupted; stopping every worker (the chief commits first)");
            terminate(&mut slots);
            return Ok(130);
        }
        take_events(&incoming, &mut slots);
        for i in 0..slots.len() {
            let Some(status) = slots[i].child.as_mut().map(Child::try_wait).transpose()?.flatten() else { continue };
            slots[i].child = None;
            let signal = std::os::unix::process::ExitStatusExt::signal(&status);
            let code = status.code().unwrap_or(128 + signal.unwrap_or(0));
            if signal.is_none() && FINAL_STATUSES.contains(&code) {
                slots[i].exit = Some(code);
                continue;
            }
            let how = signal.map_or_else(|| format!("exit status {code}"), signal_name);
            take_events(&incoming, &mut slots);
            if !slots[i].joined {
                say(&format!("worker {i} failed ({how}) before joining the cluster; stopping the others"));
                terminate(&mut slots);
                return Ok(code);
            }
            say(&format!("worker {i} died ({how}); restarting in {:.1}s", restart_delay.as_secs_f64()));
            slots[i].restart_at = Some(Instant::now() + restart_delay);
            slots[i].died_at = Some(Instant::now());
        }
        for (i, slot) in slots.iter_mut().enumerate() {
            if slot.restart_at.is_some_and(|t| Instant::now() >= t) {
                slot.restart_at = None;
                let child = start(i)?;
                say(&format!("worker {i} restarted (pid {})", child.id()));
                slot.child = Some(child);
            }
        }
        if slots.iter().all(|s| s.exit.is_some()) {
            return Ok(slots.iter().filter_map(|s| s.exit).max().unwrap_or(0));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A line of the launcher's own.
fn say(text: &str) {
    let _ = writeln!(std::io::stderr().lock(), "trainerd local: {text}");
}

fn take_events(incoming: &Receiver<(usize, Event)>, slots: &mut [Slot]) {
    while let Ok((i, event)) = incoming.try_recv() {
        match event {
            Event::Joined => slots[i].joined = true,
            Event::Recovered(rest) => {
                if let Some(died) = slots[i].died_at.take() {
                    say(&format!(
                        "worker {i} rejoined at {rest}; back to training {:.2}s after it died",
                        died.elapsed().as_secs_f64()
                    ));
                }
            }
        }
    }
}

/// Copies a child's output line by line with a `[worker i]` prefix, and tells the supervisor
/// what the lines say about joining and recovering.
fn relay(stream: impl std::io::Read, worker: usize, to_stderr: bool, events: Option<Sender<(usize, Event)>>) {
    let prefix = format!("[worker {worker}] ");
    for line in BufReader::new(stream).split(b'\n').map_while(Result::ok) {
        // A terminal progress bar redraws with \r: keep only the latest state of the line.
        let line = String::from_utf8_lossy(&line);
        let line = line.rsplit('\r').find(|s| !s.trim().is_empty()).unwrap_or("");
        if let Some(tx) = &events {
            if line.starts_with("trainerd: ") && (line.contains(" joined") || line.contains(" formed at step ")) {
                let _ = tx.send((worker, Event::Joined));
            }
            if let Some(rest) = line.strip_prefix("trainerd: recovered at ") {
                let _ = tx.send((worker, Event::Recovered(rest.to_string())));
            }
        }
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

/// SIGTERM to every running worker (they stop at a step boundary after the chief's commit),
/// SIGKILL after a grace period.
fn terminate(slots: &mut [Slot]) {
    let children: Vec<&mut Child> = slots.iter_mut().filter_map(|s| s.child.as_mut()).collect();
    for child in &children {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    }
    let deadline = Instant::now() + STOP_GRACE;
    for child in children {
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
        assert_eq!(signal_name(libc::SIGKILL), "SIGKILL");
        assert_eq!(signal_name(64), "signal 64");
    }
}
