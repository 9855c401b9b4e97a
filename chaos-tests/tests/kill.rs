//! A worker killed mid-epoch and started again by its supervisor (systemd's Restart=) must end
//! with exactly the model an uninterrupted run gives.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use trainerd_testkit::events::Record;
use trainerd_testkit::output::params_sha256;
use trainerd_testkit::{Event, RunArgs, Worker};

const WAIT: Duration = Duration::from_secs(120);

/// Step `step` of epoch `epoch` (both 1-based, as the progress lines show them) is done.
fn stepped(epoch: u32, step: u64) -> impl Fn(&Record) -> bool {
    move |r| matches!(r.event, Event::Step { epoch: e, step: s, .. } if e + 1 == epoch && s == step)
}

#[test]
fn sigkill_mid_epoch_then_restart_gives_the_uninterrupted_model() {
    // Without checkpoints a restart trains again from the start, and gets the same model.
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("reference.json");
    assert!(start("run", &[], &linear_run(&reference, None)).wait().success());

    let killed = tmp.path().join("killed.json");
    let mut worker = start("run", &[], &linear_run(&killed, None));
    worker.wait_event(stepped(2, 100), WAIT);
    let status = worker.kill(libc::SIGKILL);
    assert_eq!(status.signal(), Some(libc::SIGKILL));
    assert!(!killed.exists(), "a killed run must not leave a summary");

    assert!(start("run", &[], &linear_run(&killed, None)).wait().success());
    assert_eq!(params_sha256(&killed), params_sha256(&reference));
}

/// Arguments of a run of the linear model (2 epochs of 500 steps), checkpointed every 60 steps
/// into `ckpt` when given.
fn linear_run(summary: &Path, ckpt: Option<&Path>) -> RunArgs {
    let run = RunArgs::new("linear").epochs(2).steps(500).threads(1).seed(3).optimizer("adam", 0.001);
    let run = run.summary(summary);
    match ckpt {
        Some(dir) => run.checkpoints(dir, 60),
        None => run,
    }
}

fn start(sub: &str, extra: &[&str], args: &RunArgs) -> Worker {
    Worker::start(&[&[sub][..], extra, &args.strs()].concat())
}

#[test]
fn sigkill_mid_epoch_resumes_at_the_committed_step_with_the_uninterrupted_model() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = uninterrupted(tmp.path(), "run", &[]);

    let (killed, ckpt) = (tmp.path().join("killed.json"), tmp.path().join("ckpt"));
    let args = linear_run(&killed, Some(&ckpt));
    let mut worker = start("run", &[], &args);
    // A commit in epoch 2, then a step after it: the kill lands mid-epoch, after a commit.
    let committed =
        worker.wait_event(|r| matches!(r.event, Event::Committed { global_step, .. } if global_step > 500), WAIT);
    let Event::Committed { sequence: committed, global_step: at } = committed.event else { unreachable!() };
    worker.wait_event(|r| matches!(r.event, Event::Step { global_step, .. } if global_step > at), WAIT);
    assert_eq!(worker.kill(libc::SIGKILL).signal(), Some(libc::SIGKILL));
    assert!(!killed.exists());

    let mut again = start("run", &[], &args);
    let resumed = again.wait_event(|r| matches!(r.event, Event::Resumed { .. }), Duration::from_secs(60));
    // The restart resumes from the newest commit, at least the one seen before the kill, mid-epoch 2.
    let Event::Resumed { sequence, epoch, .. } = resumed.event else { unreachable!() };
    assert!(sequence >= committed && epoch == 1, "{resumed:?}, committed {committed}");
    let line = again.wait_line(|l| l.starts_with("trainerd: resumed from checkpoint "), Duration::from_secs(60));
    assert!(line.contains(" at epoch 2, step "), "{line}");
    assert!(again.wait().success());
    assert_eq!(params_sha256(&killed), params_sha256(&reference));
}

#[test]
fn a_killed_two_worker_cluster_resumes_with_the_uninterrupted_model() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = uninterrupted(tmp.path(), "local", &["--workers", "2"]);

    let (killed, ckpt) = (tmp.path().join("killed.json"), tmp.path().join("ckpt"));
    let args = linear_run(&killed, Some(&ckpt));
    let mut cluster = start("local", &["--workers", "2"], &args);
    // The launcher forwards its workers' events, each naming its worker.
    let third = |r: &Record| r.worker == Some(0) && matches!(r.event, Event::Committed { sequence: 3, .. });
    cluster.wait_event(third, WAIT);
    // SIGTERM to the launcher stops both workers, as systemd stopping the nodes would.
    cluster.kill(libc::SIGTERM);

    resumes_like(&args, (&killed, &reference));
}

/// Ctrl-C in the terminal `trainerd local` runs in: the terminal signals the whole foreground job,
/// but the workers lead process groups of their own, so the launcher alone hears it and stops
/// each worker once, the chief committing first. Before, each worker got the terminal's SIGINT
/// and the launcher's SIGTERM, and its second signal ended it at once, exit status 1 and nothing
/// committed. What the workers say while they stop is shown, and a rerun resumes from the stop's
/// commit to the uninterrupted model.
#[test]
fn ctrl_c_in_the_terminal_stops_a_local_cluster_once_after_the_chiefs_commit() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = uninterrupted(tmp.path(), "local", &["--workers", "2"]);

    let (stopped, ckpt) = (tmp.path().join("stopped.json"), tmp.path().join("ckpt"));
    let args = linear_run(&stopped, Some(&ckpt));
    let mut local = start("local", &["--workers", "2"], &args);
    local.wait_event(|r| r.worker == Some(0) && matches!(r.event, Event::Committed { sequence: 1, .. }), WAIT);
    local.wait_event(|r| r.worker == Some(1) && stepped(1, 100)(r), WAIT);
    local.signal_job(libc::SIGINT);
    let (status, lines, records) = local.drain(WAIT);

    assert_eq!(status.code(), Some(130), "{}", lines.join("\n"));
    let said = |text: &str| lines.iter().any(|l| l == text);
    assert!(said("trainerd local: interrupted; stopping every worker (the chief commits first)"), "{lines:#?}");
    for worker in 0..2 {
        let line = format!("trainerd local: worker {worker} stopped (exit status 0)");
        assert!(said(&line), "no '{line}' in {lines:#?}");
    }
    // The chief's stop commit, after the step the interrupt came in. Each worker asks to stop
    // its own slots; where worker 1's request is agreed a round before the chief's, that round's
    // commit holds the step the chief then stops at, and the chief says so.
    let stop = lines.iter().find(|l| l.starts_with("[worker 0] trainerd: stopped by signal at global step "));
    let stop = stop.unwrap_or_else(|| panic!("no stop line from the chief in {lines:#?}"));
    let saved = ["; the state is committed as checkpoint ", "; the state is already committed in "];
    assert!(saved.iter().any(|s| stop.contains(s)), "{stop}");
    let last = records.iter().filter_map(|r| match r.event {
        Event::Committed { global_step, .. } if r.worker == Some(0) => Some(global_step),
        _ => None,
    });
    let at: u64 = stop["[worker 0] trainerd: stopped by signal at global step ".len()..]
        .split(';')
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{stop}"));
    assert_eq!(last.max(), Some(at), "the last commit is the stop's");
    assert!(at >= 100, "{stop}");

    resumes_like(&args, (&stopped, &reference));
}

/// A worker killed while the others finish the run without it (3 workers, a majority left), its
/// restart delay longer than what is left of the run: the launcher does not start it again, which
/// would wait for a cluster that is gone (no commit shows the run's end), says so, and exits 0
/// with the others. Found on a GPU, where a short run outran the restart delay and the launcher
/// then waited for its restarted worker forever.
#[test]
fn local_does_not_restart_a_worker_once_the_others_finished_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let args = linear_run(&tmp.path().join("s.json"), None);
    let mut local = start("local", &["--workers", "3", "--restart-delay", "60"], &args);
    let pid = local.wait_event(|r| r.worker == Some(2), WAIT).pid;
    local.wait_event(|r| r.worker == Some(0) && stepped(1, 100)(r), WAIT);
    // SAFETY: kill(2) on the launcher's worker, a process this test started through it.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) }, 0);
    let killed = std::time::Instant::now();
    let said = local.wait_line(|l| l.contains("not restarted"), WAIT);
    assert_eq!(
        said,
        "trainerd local: worker 2 not restarted: the run finished while it was down (every other worker exited 0)"
    );
    assert!(local.wait().success(), "the launcher exits 0: the run finished");
    assert!(killed.elapsed() < Duration::from_secs(60), "it did not wait for the restart delay");
    assert_eq!(params_sha256(&tmp.path().join("s.worker0.json")), params_sha256(&tmp.path().join("s.worker1.json")));
}

/// The pid of a launcher's worker 0, from its first record.
/// The run a test's interrupted one must end like: `trainerd COMMAND FLAGS` of [`linear_run`],
/// uninterrupted, committing in `tmp`; the path of its summary (under `local`, worker 0's: every
/// worker ends with the same parameters).
fn uninterrupted(tmp: &Path, command: &str, flags: &[&str]) -> PathBuf {
    let reference = tmp.join("reference.json");
    assert!(start(command, flags, &linear_run(&reference, Some(&tmp.join("ckpt-ref")))).wait().success());
    match command {
        "local" => tmp.join("reference.worker0.json"),
        _ => reference,
    }
}

/// `trainerd local` of 2 workers run again with `args` (whose summary is `summary`): it resumes
/// from the interrupted run's last commit, and both workers end with the `reference` run's
/// parameters.
fn resumes_like(args: &RunArgs, (summary, reference): (&Path, &Path)) {
    let mut again = start("local", &["--workers", "2"], args);
    again.wait_event(|r| r.worker == Some(0) && matches!(r.event, Event::Resumed { .. }), Duration::from_secs(60));
    assert!(again.wait().success());
    for w in 0..2 {
        let worker =
            summary.with_file_name(format!("{}.worker{w}.json", summary.file_stem().unwrap().to_str().unwrap()));
        assert_eq!(params_sha256(&worker), params_sha256(reference), "worker {w}");
    }
}

fn worker_pid(launcher: &mut Worker) -> u32 {
    launcher.wait_event(|r| r.worker == Some(0), WAIT).pid
}

#[test]
fn local_with_one_worker_restarts_a_killed_worker_and_resumes_from_its_last_commit() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = uninterrupted(tmp.path(), "local", &["--workers", "1", "--restart-delay", "0"]);

    let killed = tmp.path().join("killed.json");
    let mut local = start(
        "local",
        &["--workers", "1", "--restart-delay", "0"],
        &linear_run(&killed, Some(&tmp.path().join("ckpt"))),
    );
    let pid = worker_pid(&mut local);
    local.wait_event(|r| matches!(r.event, Event::Committed { global_step, .. } if global_step > 500), WAIT);
    local.wait_event(stepped(2, 150), WAIT);
    // SAFETY: kill(2) on the launcher's worker, a process this test started through it.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) }, 0);
    let resumed = local.wait_event(|r| matches!(r.event, Event::Resumed { .. }), WAIT);
    assert_ne!(resumed.pid, pid, "the restarted worker resumed");
    assert!(local.wait().success(), "the launcher exits 0 once its worker finished");
    assert_eq!(params_sha256(&tmp.path().join("killed.worker0.json")), params_sha256(&reference));
}

#[test]
fn local_with_one_worker_and_no_checkpoints_starts_a_killed_worker_over_and_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("reference.json");
    assert!(start("run", &[], &linear_run(&reference, None)).wait().success());

    let killed = tmp.path().join("killed.json");
    let mut local = start("local", &["--workers", "1", "--restart-delay", "0"], &linear_run(&killed, None));
    let pid = worker_pid(&mut local);
    local.wait_event(stepped(2, 100), WAIT);
    // SAFETY: kill(2) on the launcher's worker, a process this test started through it.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) }, 0);
    let said = local.wait_line(|l| l.starts_with("trainerd local: worker 0 died (SIGKILL)"), WAIT);
    assert_eq!(
        said,
        "trainerd local: worker 0 died (SIGKILL); restarting in 0.0s; no other worker holds the state and there is \
         no --checkpoint-dir, so training starts over from the first step"
    );
    assert!(local.wait().success());
    assert_eq!(params_sha256(&tmp.path().join("killed.worker0.json")), params_sha256(&reference));
}
