//! Failures with the optimizer state sharded (`--shard-optimizer`), under a supervisor with
//! systemd's semantics: a worker or the chief killed, a kill inside the all-gather of the new
//! parameters and a worker gone for good send every member back to the last commit (no other
//! member holds the lost ranges yet), a stop and a return lose nothing, and every worker ends
//! with exactly the parameters of the failure-free run, sharded or not (the two are the same
//! bits).

use std::path::Path;
use std::time::Duration;

use trainerd_testkit::{Cluster, Event, RunArgs};

const DEADLINE: Duration = Duration::from_secs(240);
const RESTART_SEC: Duration = Duration::from_millis(200);
const WORKERS: usize = 3;
const STEPS: u64 = 60;

/// mnist-cnn on 3 workers, 2 epochs of 60 steps, checkpoints every 25 steps in `ckpt`.
fn args(dir: &Path, ckpt: &Path, sharded: bool) -> RunArgs {
    let args = RunArgs::new("mnist-cnn")
        .epochs(2)
        .steps(STEPS)
        .threads(1)
        .seed(11)
        .optimizer("adam", 0.001)
        .set("--clip-norm", 1.0)
        .summary(dir.join("summary.{rank}.json"))
        .checkpoints(ckpt, 25);
    if sharded {
        args.on("--shard-optimizer")
    } else {
        args
    }
}

fn summary(dir: &Path, rank: usize) -> serde_json::Value {
    let path = dir.join(format!("summary.{rank}.json"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

/// The failure-free run's `params_sha256`, unsharded.
fn reference() -> String {
    static CACHE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    CACHE
        .get_or_init(|| {
            let tmp = tempfile::tempdir().unwrap();
            let run = args(tmp.path(), &tmp.path().join("ckpt"), false);
            let mut c = Cluster::start(WORKERS, &run, &[], vec![], RESTART_SEC);
            assert_eq!(c.wait_finished(DEADLINE), vec![0; WORKERS], "{}", c.transcript());
            summary(tmp.path(), 0)["params_sha256"].as_str().unwrap().to_string()
        })
        .clone()
}

fn start(dir: &Path) -> Cluster {
    Cluster::start(WORKERS, &args(dir, &dir.join("ckpt"), true), &[], vec![], RESTART_SEC)
}

/// Every worker exited 0 with the failure-free run's parameters; the chief's summary.
fn assert_finished_exactly(c: &mut Cluster, dir: &Path) -> serde_json::Value {
    assert_finished_exactly_on(c, dir, &[0, 1, 2])
}

/// Workers `ranks` exited 0 with the failure-free run's parameters, the others were killed for
/// good; the chief's summary.
fn assert_finished_exactly_on(c: &mut Cluster, dir: &Path, ranks: &[usize]) -> serde_json::Value {
    let codes = c.wait_finished(DEADLINE);
    for (rank, &code) in codes.iter().enumerate() {
        let expected = if ranks.contains(&rank) { 0 } else { 128 + libc::SIGKILL };
        assert_eq!(code, expected, "worker {rank}\n{}", c.transcript());
    }
    let expected = reference();
    for &rank in ranks {
        assert_eq!(summary(dir, rank)["params_sha256"], expected.as_str(), "worker {rank}\n{}", c.transcript());
    }
    summary(dir, 0)
}

/// Worker `rank`'s line saying every member goes back to the commit of step 25, after `mark`.
fn assert_back_to_step_25(c: &mut Cluster, rank: usize, mark: usize) {
    let (_, line) = c.wait_line(rank, "trainerd: the optimizer state was sharded over generation ", mark, DEADLINE);
    assert!(line.contains("every member goes back to checkpoint "), "{line}");
    assert!(line.contains(" at step 25 ("), "{line}\n{}", c.transcript());
}

fn steps_lost(s: &serde_json::Value) -> u64 {
    s["fault_tolerance"]["steps_lost"].as_u64().unwrap()
}

/// A worker SIGKILLed a few steps after the commit of step 25 became durable: every
/// member says it goes back to that commit, the formation counts the steps it lost, and the run
/// ends bit for bit the failure-free one.
fn killed_mid_epoch(rank: usize) {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = start(tmp.path());
    // Once the commit of step 25 is durable (a commit still in flight dies with a killed chief).
    c.wait_line(0, "checkpoint 1 committed to ", 0, DEADLINE);
    c.wait_step(0, 28, DEADLINE);
    let mark = c.mark();
    c.signal(rank, libc::SIGKILL);
    let survivor = (rank + 1) % WORKERS;
    assert_back_to_step_25(&mut c, survivor, mark);
    let chief = assert_finished_exactly(&mut c, tmp.path());
    assert!(c.starts(rank) >= 2);
    let lost = steps_lost(&summary(tmp.path(), survivor));
    assert!(lost >= 1, "the steps since the commit are lost, and counted: {lost}\n{}", c.transcript());
    assert!(chief["optimizer_state_bytes"].as_u64().unwrap() > 0);
}

#[test]
fn a_worker_killed_sends_every_member_back_to_the_last_commit_and_the_run_ends_exactly() {
    killed_mid_epoch(1);
}

#[test]
fn the_chief_killed_sends_every_member_back_to_the_last_commit_and_the_run_ends_exactly() {
    killed_mid_epoch(0);
}

/// A worker stopped inside step 30's all-gather of the new parameters, after its first hop (so
/// that some members complete the step and others do not), then SIGKILLed: no member keeps a
/// mixture of two steps; every member goes back to the commit of step 25, and the run ends exactly.
#[test]
fn a_kill_inside_the_all_gather_goes_back_to_the_last_commit_and_the_run_ends_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let failpoint = vec![("TRAINERD_FAILPOINT".to_string(), "sharded-all-gather@step=30".to_string())];
    let run = args(tmp.path(), &tmp.path().join("ckpt"), true);
    let mut c = Cluster::start(WORKERS, &run, &[], vec![vec![], failpoint], RESTART_SEC);
    c.wait_line(0, "checkpoint 1 committed to ", 0, DEADLINE);
    c.wait_line(1, "trainerd: failpoint sharded-all-gather reached", 0, DEADLINE);
    std::thread::sleep(Duration::from_millis(300));
    let mark = c.mark();
    c.signal(1, libc::SIGKILL);
    assert_back_to_step_25(&mut c, 0, mark);
    assert_back_to_step_25(&mut c, 2, mark);
    let chief = assert_finished_exactly(&mut c, tmp.path());
    assert!(steps_lost(&chief) >= 4, "steps 26 to 29 at least are lost, and counted\n{}", c.transcript());
}

/// The chief killed in the middle of its commit of step 50 (the blobs written, not the record): the
/// cut commit never becomes visible, and every member goes back to the commit of step 25.
#[test]
fn the_chief_killed_in_the_middle_of_a_commit_goes_back_to_the_one_before_and_the_run_ends_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let failpoint = vec![("TRAINERD_FAILPOINT".to_string(), "commit-before-record@2".to_string())];
    let run = args(tmp.path(), &tmp.path().join("ckpt"), true);
    let mut c = Cluster::start(WORKERS, &run, &[], vec![failpoint], RESTART_SEC);
    c.wait_line(0, "trainerd: failpoint commit-before-record reached", 0, DEADLINE);
    let mark = c.mark();
    c.signal(0, libc::SIGKILL);
    assert_back_to_step_25(&mut c, 1, mark);
    assert_finished_exactly(&mut c, tmp.path());
}

/// A worker killed for good: the two others go back to the commit of step 25, go on without it
/// (its slot moves to them), and end exactly.
#[test]
fn a_worker_gone_for_good_sends_the_others_back_to_the_last_commit_and_they_end_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = start(tmp.path());
    c.wait_line(0, "checkpoint 1 committed to ", 0, DEADLINE);
    c.wait_step(0, 28, DEADLINE);
    c.hold(2);
    let mark = c.mark();
    c.signal(2, libc::SIGKILL);
    assert_back_to_step_25(&mut c, 1, mark);
    let chief = assert_finished_exactly_on(&mut c, tmp.path(), &[0, 1]);
    assert_eq!(chief["workers_present"].as_u64(), Some(2), "{chief}");
    assert!(steps_lost(&chief) >= 1, "{}", c.transcript());
}

/// Every worker killed after the commit of step 25, and only two of the three come back: after
/// the rendezvous timeout they resume that commit (committed whole, sharded anew over two
/// workers) and end exactly.
#[test]
fn a_resume_on_fewer_workers_ends_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let run = args(tmp.path(), &tmp.path().join("ckpt"), true).set("--rendezvous-timeout", 4);
    let mut c = Cluster::start(WORKERS, &run, &[], vec![], RESTART_SEC);
    c.wait_line(0, "checkpoint 1 committed to ", 0, DEADLINE);
    c.wait_step(0, 28, DEADLINE);
    c.hold(2);
    for rank in 0..WORKERS {
        c.signal(rank, libc::SIGKILL);
    }
    let chief = assert_finished_exactly_on(&mut c, tmp.path(), &[0, 1]);
    assert_eq!(chief["workers_present"].as_u64(), Some(2), "{chief}");
    assert!(c.transcript().contains("checkpoint 1"), "{}", c.transcript());
}

/// A worker stopped (SIGTERM) and brought back: the stop makes the state whole first, the return
/// moves the ranges to their new owners as the generation forms, so nothing is lost.
#[test]
fn a_stop_and_a_return_lose_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = start(tmp.path());
    c.wait_step(0, 40, DEADLINE);
    c.signal(2, libc::SIGTERM);
    let (_, exiting) = c.wait_event(2, |e| matches!(e, Event::Exiting { .. }), DEADLINE);
    assert_eq!(exiting, Event::Exiting { status: 0 });
    std::thread::sleep(Duration::from_secs(1));
    let mark = c.mark();
    c.bring_back(2);
    // The return: the returner receives the model alone, and the ranges move to it.
    let (_, moved) = c.wait_line(2, "trainerd: the sharded optimizer state moved to generation ", mark, DEADLINE);
    assert!(moved.contains("'s owners: this worker holds "), "{moved}");
    assert!(!moved.contains("holds 0 range(s)"), "{moved}");
    let chief = assert_finished_exactly(&mut c, tmp.path());
    for rank in 0..WORKERS {
        assert_eq!(steps_lost(&summary(tmp.path(), rank)), 0, "worker {rank}\n{}", c.transcript());
    }
    assert!(!c.transcript().contains("goes back to checkpoint"), "{}", c.transcript());
    assert_eq!(steps_lost(&chief), 0);
}

/// A worker killed before the first commit: no member holds the lost ranges and there is no
/// commit, so the members that find nothing say so and exit; restarted, the run starts over from
/// step 0 and still ends exactly.
#[test]
fn a_loss_before_any_commit_starts_the_run_over_and_ends_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = start(tmp.path());
    c.wait_step(0, 5, DEADLINE);
    let mark = c.mark();
    c.signal(1, libc::SIGKILL);
    let (_, line) = c.wait_line(0, "error: the sharded optimizer state is lost (generation ", mark, DEADLINE);
    assert!(line.ends_with("no member found a commit to go back to: the run starts over"), "{line}");
    assert_finished_exactly(&mut c, tmp.path());
    // The chief exited and was restarted (a survivor may take its fresh state instead of
    // exiting too), and a generation formed at step 0 after the error.
    assert!(c.starts(0) >= 2, "{}", c.transcript());
    let transcript = c.transcript();
    let after = &transcript[transcript.find("error: the sharded optimizer state is lost").unwrap()..];
    assert!(after.contains("Joined { generation: ") && after.contains("global_step: 0, "), "{transcript}");
}
