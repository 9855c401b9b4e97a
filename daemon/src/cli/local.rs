//! `trainerd local --workers N ...`: the tutorials' localhost cluster in one command. Starts N
//! `trainerd run` daemons on 127.0.0.1, each with its own generated TF_CONFIG, prefixes their
//! output with the worker index, and supervises them as systemd would ([`crate::supervise`]): a
//! worker that dies (a signal, a non-zero exit) is started again and rejoins the run, which goes
//! on without losing a step; a worker that exits 0 has finished or was stopped. A worker that
//! fails before it ever joined has a problem a restart cannot fix (a flag, the plugin, the data):
//! everyone is stopped. Ctrl-C (or SIGTERM, or the terminal's hang-up) stops every worker
//! gracefully, once: the chief commits first.
//!
//! What the launcher says about joins, deaths and recoveries comes from its workers' events,
//! never from their human lines; with `--events` it forwards every worker's events, each naming
//! its worker.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::args::LocalArgs;
use crate::events::{Event, Events};
use crate::exit::Exit;
use crate::supervise::{Happening, Options, Stream, Supervisor};
use trainerd_supervise::loopback;

/// Flags whose file argument each worker gets its own copy of (`out.json` -> `out.worker1.json`).
const PER_WORKER_FILES: [&str; 4] = ["--summary", "--metrics-log", "--log-examples", "--state-dir"];
/// How long stopped workers get to commit and exit before they are killed.
const STOP_GRACE: Duration = Duration::from_secs(90);

/// `path` with `.workerN` before its extension.
pub(crate) fn per_worker_path(path: &str, worker: usize) -> String {
    let p = Path::new(path);
    let stem = p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let name = match p.extension() {
        Some(ext) => format!("{stem}.worker{worker}.{}", ext.to_string_lossy()),
        None => format!("{stem}.worker{worker}"),
    };
    p.with_file_name(name).to_string_lossy().into_owned()
}

/// Whether `args` hold `flag` (as `--flag value` or `--flag=value`).
fn has_flag(args: &[String], flag: &str) -> bool {
    args.iter().any(|a| a == flag || a.strip_prefix(flag).is_some_and(|rest| rest.starts_with('=')))
}

/// The `trainerd run` arguments for worker `i`: per-worker file flags rewritten, and a thread
/// count that shares the machine's cores when none is given.
pub(crate) fn worker_args(args: &[String], worker: usize, workers: usize, cores: usize) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len() + 2);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
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
    if !has_flag(args, "--threads") {
        out.push("--threads".into());
        out.push((cores / workers).max(1).to_string());
    }
    out
}

/// Refuses what `trainerd local` cannot do, naming the flag.
fn check(workers: usize, no_restart: &[usize], args: &[String]) -> anyhow::Result<()> {
    anyhow::ensure!(workers >= 1, "--workers {workers}: expected at least 1");
    if let Some(w) = no_restart.iter().find(|&&w| w >= workers) {
        anyhow::bail!("--no-restart {w}: expected a worker index below --workers {workers}");
    }
    anyhow::ensure!(
        !has_flag(args, "--tf-config"),
        "trainerd local writes each worker's TF_CONFIG itself: remove --tf-config"
    );
    anyhow::ensure!(
        !has_flag(args, "--events"),
        "trainerd local reads each worker's events itself: give --events before the arguments for trainerd run"
    );
    Ok(())
}

/// Runs `trainerd local`; its exit status.
pub(crate) fn run(args: LocalArgs) -> anyhow::Result<i32> {
    let LocalArgs { workers, restart_delay, no_restart, events, args } = args;
    let delay = Duration::try_from_secs_f64(restart_delay)
        .map_err(|_| anyhow::anyhow!("--restart-delay {restart_delay}: expected a number of seconds"))?;
    launch(workers, (delay, &no_restart), events.as_deref(), &args)
}

/// Runs the local cluster, its workers' events forwarded to `events` when given; returns this
/// process's exit code.
fn launch(
    workers: usize,
    (restart_delay, no_restart): (Duration, &[usize]),
    events: Option<&Path>,
    args: &[String],
) -> anyhow::Result<i32> {
    check(workers, no_restart, args)?;
    let forward = match events {
        Some(path) => Events::open(path).map_err(|e| anyhow::anyhow!("--events {}: {e}", path.display()))?,
        None => Events::none(),
    };
    let stop = Arc::new(AtomicBool::new(false));
    // The workers lead process groups of their own: a terminal's signals reach the launcher
    // alone, which stops them (a closed terminal too, rather than leaving them running).
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM, signal_hook::consts::SIGHUP] {
        signal_hook::flag::register(signal, Arc::clone(&stop))?;
    }
    let options = Options { restart_delay, give_up_before_join: true };
    // Each worker keeps its vote (for electing a coordinator if the chief is lost for good) for
    // as long as the launcher runs, unless --state-dir says where.
    let votes = (!has_flag(args, "--state-dir") && !has_flag(args, "--no-failover"))
        .then(|| tempfile::Builder::new().prefix("trainerd-local-votes.").tempdir())
        .transpose()?;
    let command = worker_command(workers, args, votes.as_ref().map(|d| d.path().to_path_buf()))?;
    let mut supervisor = Supervisor::start(workers, options, command)?;
    for &w in no_restart {
        supervisor.hold(w);
    }
    let pids: Vec<String> =
        (0..workers).map(|i| format!("worker {i} (pid {})", supervisor.pid(i).unwrap_or(0))).collect();
    say(&format!("started {}", pids.join(", ")));
    let mut launcher = Launcher {
        forward,
        restart_delay,
        checkpoints: has_flag(args, "--checkpoint-dir"),
        told: 0,
        died: vec![None; workers],
        stopping: None,
    };
    loop {
        if stop.load(Ordering::Relaxed) && launcher.stopping.is_none() {
            say("interrupted; stopping every worker (the chief commits first)");
            launcher.stop(&mut supervisor, Exit::Interrupted.code());
        }
        for happening in supervisor.poll()? {
            if let Some(code) = launcher.tell(happening, &supervisor) {
                launcher.stop(&mut supervisor, code);
            }
        }
        if let Some(code) = launcher.ended(&mut supervisor) {
            return Ok(code);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// How worker `i`'s `n`-th process is started: `trainerd run` with its TF_CONFIG on free
/// loopback ports.
fn worker_command(
    workers: usize,
    args: &[String],
    votes: Option<PathBuf>,
) -> anyhow::Result<impl FnMut(usize, usize) -> Command + Send> {
    let exe: PathBuf = std::env::current_exe()?;
    let ports = loopback::free_ports(workers)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let args = args.to_vec();
    Ok(move |i: usize, _start: usize| {
        let mut cmd = Command::new(&exe);
        cmd.arg("run").args(worker_args(&args, i, workers, cores));
        if let Some(dir) = &votes {
            cmd.arg("--state-dir").arg(dir.join(format!("worker{i}")));
        }
        cmd.env("TF_CONFIG", loopback::tf_config(&ports, i))
            // `--device auto` puts worker i on cuda:(i mod GPUs).
            .env("LOCAL_RANK", i.to_string())
            // systemd's notifications are the supervisor's to send, not its workers'.
            .env_remove("NOTIFY_SOCKET")
            .env_remove("WATCHDOG_USEC")
            .env_remove("WATCHDOG_PID");
        cmd
    })
}

/// Drops the pending restart of a worker that died while the run finished without it: once
/// every other worker exited 0 (the run's end, or each stopped), a new process would wait for a
/// cluster that is gone (with no commit showing the run's end, as without `--checkpoint-dir`).
/// Workers gone for good (`--no-restart`) do not count; a worker alone is always restarted. Seen
/// on a GPU, where a short run outran `--restart-delay`. The launcher's exit status is then the
/// others'.
fn forgo_restarts_after_the_end(supervisor: &mut Supervisor) {
    let workers = supervisor.workers();
    for worker in 0..workers {
        let mut others = (0..workers).filter(|&w| w != worker && !supervisor.held(w)).peekable();
        let others_done = others.peek().is_some() && others.all(|w| supervisor.exited_for_good(w) == Some(0));
        if others_done && supervisor.drop_restart(worker) {
            say(&format!(
                "worker {worker} not restarted: the run finished while it was down (every other worker exited 0)"
            ));
        }
    }
}

/// What the launcher says and forwards.
struct Launcher {
    forward: Events,
    restart_delay: Duration,
    /// The run commits checkpoints (a worker alone that dies resumes from its last commit).
    checkpoints: bool,
    /// The latest generation formed short that was told of.
    told: u64,
    /// When each worker last died, until it is back to training.
    died: Vec<Option<Instant>>,
    /// Since when every worker is being stopped, and the launcher's exit status then.
    stopping: Option<(Instant, i32)>,
}

impl Launcher {
    /// Shows or forwards `h`; `Some(code)` when the launcher must give up.
    fn tell(&mut self, h: Happening, supervisor: &Supervisor) -> Option<i32> {
        match h {
            Happening::Finished { worker, code } | Happening::GaveUp { worker, code, .. }
                if self.stopping.is_some() =>
            {
                say(&format!("worker {worker} stopped (exit status {code})"))
            }
            Happening::Died { worker, how, .. } if self.stopping.is_some() => {
                say(&format!("worker {worker} stopped ({how})"))
            }
            Happening::Line { worker, stream, text, .. } => relay(worker, stream, &text),
            Happening::Event { worker, mut record, .. } => {
                if let Event::Joined { present: Some(present), layout: Some(layout), workers, generation, .. } =
                    &record.event
                {
                    self.short(*generation, (*present, *workers), layout);
                }
                if let Event::Recovered { global_step, generation, steps_lost, .. } = &record.event {
                    if let Some(died) = self.died[worker].take() {
                        say(&format!(
                            "worker {worker} rejoined at step {global_step} (generation {generation}): {steps_lost} step(s) \
                             lost; back to training {:.2}s after it died",
                            died.elapsed().as_secs_f64()
                        ));
                    }
                }
                record.worker = Some(worker);
                self.forward.write(&record);
            }
            Happening::Died { worker, how, at } if supervisor.held(worker) => {
                self.died[worker] = Some(at);
                let coordinator = if worker == 0 { ", electing a new coordinator among them" } else { "" };
                say(&format!(
                    "worker {worker} died ({how}); not restarted (--no-restart): the others go on without it (after \
                     --replace-after, when given) if a majority of the workers remains{coordinator}"
                ));
            }
            Happening::Died { worker, how, at } => {
                self.died[worker] = Some(at);
                let delay = self.restart_delay.as_secs_f64();
                let alone = (0..supervisor.workers()).all(|w| w == worker || supervisor.pid(w).is_none());
                if alone && !self.checkpoints {
                    say(&format!(
                        "worker {worker} died ({how}); restarting in {delay:.1}s; no other worker holds the state and there \
                         is no --checkpoint-dir, so training starts over from the first step"
                    ));
                } else {
                    say(&format!("worker {worker} died ({how}); restarting in {delay:.1}s"));
                }
            }
            Happening::Restarted { worker, pid } => say(&format!("worker {worker} restarted (pid {pid})")),
            Happening::GaveUp { worker, how, code } => {
                say(&format!("worker {worker} failed ({how}) before joining the cluster; stopping the others"));
                return Some(code);
            }
            Happening::Finished { .. } => {}
        }
        None
    }
}

impl Launcher {
    /// The launcher's exit status once the run has ended: every worker exited (a worker gone for
    /// good, not restarted as asked, does not make the run fail), or, once stopped, every worker
    /// exited or killed [`STOP_GRACE`] after the stop.
    fn ended(&self, supervisor: &mut Supervisor) -> Option<i32> {
        let Some((since, code)) = self.stopping else {
            forgo_restarts_after_the_end(supervisor);
            let codes = supervisor.finished()?;
            let kept = codes.into_iter().enumerate().filter(|&(w, _)| !supervisor.held(w));
            return Some(kept.map(|(_, code)| code).max().unwrap_or(0));
        };
        if supervisor.finished().is_some() {
            return Some(code);
        }
        // Until then, what the workers say while they stop (the chief's commit, each exit) is
        // shown.
        if since.elapsed() < STOP_GRACE {
            return None;
        }
        let killed: Vec<String> = supervisor.kill().iter().map(usize::to_string).collect();
        say(&format!("worker(s) {} still running {}s after the stop: killed", killed.join(", "), STOP_GRACE.as_secs()));
        Some(code)
    }

    /// Stops every worker (once), the launcher's exit status then `code`.
    fn stop(&mut self, supervisor: &mut Supervisor, code: i32) {
        if self.stopping.is_none() {
            supervisor.stop();
            self.stopping = Some((Instant::now(), code));
        }
    }

    /// A generation formed without some workers (said once per generation, by whichever worker
    /// tells first): who is gone, for how long, and who holds their slots now.
    fn short(&mut self, generation: u64, (present, workers): (usize, usize), layout: &str) {
        if self.told >= generation {
            return;
        }
        self.told = generation;
        // The workers that died and are not back.
        let gone: Vec<String> = (0..workers)
            .filter_map(|w| self.died[w].map(|at| format!("worker {w} gone for {:.0} s", at.elapsed().as_secs_f64())))
            .collect();
        // The survivors can form before this launcher has seen the death.
        let who = match gone.is_empty() {
            true => format!("{} worker(s) lost", workers - present),
            false => gone.join(", "),
        };
        say(&format!(
            "{who}: its slots move to the others ({layout}); {present} of {workers} workers, {:.2}x speed",
            present as f64 / workers as f64
        ));
    }
}

/// A line of the launcher's own.
fn say(text: &str) {
    let _ = writeln!(std::io::stderr().lock(), "trainerd local: {text}");
}

/// A worker's line, prefixed with its index, on the launcher's stream of the same kind.
fn relay(worker: usize, stream: Stream, line: &str) {
    let text = format!("[worker {worker}] {line}\n");
    match stream {
        Stream::Stderr => {
            let _ = std::io::stderr().lock().write_all(text.as_bytes());
        }
        Stream::Stdout => {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(text.as_bytes());
            let _ = out.flush();
        }
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
        assert!(
            has_flag(&["--tf-config={}".into()], "--tf-config") && !has_flag(&["--tf-configs".into()], "--tf-config")
        );
    }
}
