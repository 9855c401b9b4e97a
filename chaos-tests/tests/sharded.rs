//! Failures with the optimizer state sharded (`--shard-optimizer`) over 4 workers, under a
//! supervisor with systemd's semantics (a killed worker restarts after 2 s): a worker or the
//! chief killed, a kill inside the all-gather of the new parameters or the buddy shift (and, with
//! the gradients sharded too, inside the all-gather or a backward reduce-scatter), the chief
//! killed in the middle of a commit or a worker in the middle of its part of one, a worker gone
//! for good, a worker frozen and thawed, a bit of a parameter flipped, a stop and a return lose
//! no step (the lost worker's ranges come from their buddies); a worker lost together with its buddy, or every
//! worker, sends every member back to the last commit, counting the steps; and every worker
//! ends with exactly the parameters of the failure-free run, sharded or not (the two are the
//! same bits).

use std::path::Path;
use std::time::Duration;

use trainerd_testkit::{Cluster, Event, RunArgs, What};

const DEADLINE: Duration = Duration::from_secs(240);
const RESTART_SEC: Duration = Duration::from_secs(2);
const WORKERS: usize = 4;
const STEPS: u64 = 60;

/// mnist-cnn on 4 workers, 2 epochs of 60 steps, checkpoints every 25 steps in `ckpt`.
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
    CACHE.get_or_init(|| failure_free(|dir| args(dir, &dir.join("ckpt"), false))).clone()
}

/// `--shard gradients` (or unsharded, not `sharded`) in buckets of 0.25 MB: mnist-cnn's gradients
/// in several, reduced during the backward pass and each let go once scattered.
fn in_buckets(dir: &Path, sharded: bool) -> RunArgs {
    let run = args(dir, &dir.join("ckpt"), false).set("--bucket-mb", 0.25);
    if sharded {
        run.set("--shard", "gradients")
    } else {
        run
    }
}

/// The failure-free run's `params_sha256` in buckets of 0.25 MB, unsharded (a bucket's layout
/// decides the ring's order of addition, so these are other bits than [`reference`]'s).
fn reference_in_buckets() -> String {
    static CACHE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    CACHE.get_or_init(|| failure_free(|dir| in_buckets(dir, false))).clone()
}

/// The `params_sha256` of the run `run` makes for a directory, on 4 workers, failure-free.
fn failure_free(run: impl Fn(&Path) -> RunArgs) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = start_run(&run(tmp.path()));
    assert_eq!(c.wait_finished(DEADLINE), vec![0; WORKERS], "{}", c.transcript());
    summary(tmp.path(), 0)["params_sha256"].as_str().unwrap().to_string()
}

fn start(dir: &Path) -> Cluster {
    start_run(&args(dir, &dir.join("ckpt"), true))
}

/// `run` on 4 workers, nothing armed.
fn start_run(run: &RunArgs) -> Cluster {
    Cluster::start(WORKERS, run, &[], vec![], RESTART_SEC)
}

/// The sharded cluster in `dir`, once the commit of step 25 is written and the chief is at step
/// 28: where a failure has survivors' ranges to move and a commit to go back to.
fn past_the_first_commit(dir: &Path) -> Cluster {
    past_the_first_commit_of(start(dir))
}

/// The cluster `c` once the commit of step 25 is written and the chief is at step 28.
fn past_the_first_commit_of(mut c: Cluster) -> Cluster {
    c.wait_line(0, "checkpoint 1 committed to ", 0, DEADLINE);
    c.wait_step(0, 28, DEADLINE);
    c
}

/// `run` on the sharded cluster with the failpoint `point` armed on worker `rank`'s first process.
fn start_armed(run: &RunArgs, rank: usize, point: &str) -> Cluster {
    let mut env = vec![vec![]; rank + 1];
    env[rank] = vec![("TRAINERD_FAILPOINT".to_string(), point.to_string())];
    Cluster::start(WORKERS, run, &[], env, RESTART_SEC)
}

/// Every worker exited 0 with the failure-free run's parameters; the chief's summary.
fn assert_finished_exactly(c: &mut Cluster, dir: &Path) -> serde_json::Value {
    assert_finished_exactly_on(c, dir, &[0, 1, 2, 3])
}

/// Workers `ranks` exited 0 with the failure-free run's parameters, the others were killed for
/// good; the chief's summary.
fn assert_finished_exactly_on(c: &mut Cluster, dir: &Path, ranks: &[usize]) -> serde_json::Value {
    assert_finished_as(c, dir, ranks, &reference())
}

/// Workers `ranks` exited 0 with the parameters `expected`, the others were killed for good; the
/// chief's summary.
fn assert_finished_as(c: &mut Cluster, dir: &Path, ranks: &[usize], expected: &str) -> serde_json::Value {
    let codes = c.wait_finished(DEADLINE);
    for (rank, &code) in codes.iter().enumerate() {
        let expected = if ranks.contains(&rank) { 0 } else { 128 + libc::SIGKILL };
        assert_eq!(code, expected, "worker {rank}\n{}", c.transcript());
    }
    for &rank in ranks {
        assert_eq!(summary(dir, rank)["params_sha256"], expected, "worker {rank}\n{}", c.transcript());
    }
    summary(dir, 0)
}

fn steps_lost(s: &serde_json::Value) -> u64 {
    s["fault_tolerance"]["steps_lost"].as_u64().unwrap()
}

/// Worker `rank` SIGKILLed where the failpoint `name` (armed `at`) paused it: the next worker
/// takes part in the move of the ranges, and nothing is lost.
fn killed_at_failpoint(rank: usize, (name, at): (&str, &str)) {
    let tmp = tempfile::tempdir().unwrap();
    let run = args(tmp.path(), &tmp.path().join("ckpt"), true);
    let mut c = start_armed(&run, rank, &format!("{name}{at}"));
    c.wait_line(rank, &format!("trainerd: failpoint {name} reached"), 0, DEADLINE);
    let mark = c.mark();
    c.signal(rank, libc::SIGKILL);
    assert_moved(&mut c, (rank + 1) % WORKERS, mark);
    assert_nothing_lost(&mut c, tmp.path(), &[0, 1, 2, 3]);
}

/// Worker `rank`'s line saying the ranges moved to the owners of the generation formed after
/// `mark`: this worker holds some, and a buddy copy of its predecessor's, each from its own copy
/// or a neighbour's (one worker lost or back moves only its ranges, between neighbours).
fn assert_moved(c: &mut Cluster, rank: usize, mark: usize) -> String {
    let (_, moved) = c.wait_line(rank, "trainerd: the sharded optimizer state moved to generation ", mark, DEADLINE);
    assert!(moved.contains("'s owners: this worker holds "), "{moved}");
    assert!(!moved.contains("holds 0 range(s)") && !moved.contains("buddy copy of 0,"), "{moved}");
    assert!(moved.contains(" from its own copies and its neighbours' ("), "{moved}");
    moved
}

/// The run ended exactly, no worker lost or trained again a step, and no member went back to a
/// commit.
fn assert_nothing_lost(c: &mut Cluster, dir: &Path, ranks: &[usize]) -> serde_json::Value {
    assert_nothing_lost_as(c, dir, ranks, &reference())
}

/// [`assert_nothing_lost`], ending with the parameters `expected`.
fn assert_nothing_lost_as(c: &mut Cluster, dir: &Path, ranks: &[usize], expected: &str) -> serde_json::Value {
    let chief = assert_finished_as(c, dir, ranks, expected);
    for &rank in ranks {
        let s = summary(dir, rank);
        assert_eq!(steps_lost(&s), 0, "worker {rank}\n{}", c.transcript());
        assert_eq!(s["fault_tolerance"]["steps_trained_again"].as_u64(), Some(0), "worker {rank}\n{}", c.transcript());
    }
    assert!(!c.transcript().contains("goes back to checkpoint"), "{}", c.transcript());
    chief
}

/// A worker SIGKILLed a few steps after the commit of step 25: its ranges come from their
/// buddies as the survivors form the next generation at once, it returns after 2 s and takes
/// ranges back, and the run ends bit for bit the failure-free one without a step lost.
/// With `gradients`, at `--shard gradients` in buckets of 0.25 MB.
fn killed_mid_epoch(rank: usize, gradients: bool) {
    let tmp = tempfile::tempdir().unwrap();
    let (run, expected) = match gradients {
        true => (in_buckets(tmp.path(), true), reference_in_buckets()),
        false => (args(tmp.path(), &tmp.path().join("ckpt"), true), reference()),
    };
    let mut c = past_the_first_commit_of(start_run(&run));
    let mark = c.mark();
    c.signal(rank, libc::SIGKILL);
    let survivor = (rank + 1) % WORKERS;
    assert_moved(&mut c, survivor, mark);
    // Two places from the lost worker: its slots and ranges stay, and nothing moves to it.
    let apart = assert_moved(&mut c, (rank + 2) % WORKERS, mark);
    assert!(apart.contains("; it received 0.0 MB from its own copies"), "{apart}");
    let chief = assert_nothing_lost_as(&mut c, tmp.path(), &[0, 1, 2, 3], &expected);
    assert!(c.starts(rank) >= 2);
    // Its own quarter and a buddy copy of another: about half the state.
    let held = chief["optimizer_state_bytes"].as_u64().unwrap();
    assert!(held > 0, "{chief}");
}

#[test]
fn a_worker_killed_loses_no_step_and_the_run_ends_exactly() {
    killed_mid_epoch(1, false);
}

#[test]
fn the_chief_killed_loses_no_step_and_the_run_ends_exactly() {
    killed_mid_epoch(0, false);
}

#[test]
fn the_chief_killed_at_the_gradients_level_loses_no_step_and_the_run_ends_exactly() {
    killed_mid_epoch(0, true);
}

/// A worker stopped inside step 30's all-gather of the new parameters, after its first hop, then
/// SIGKILLed: the chief (which receives every range without the stopped worker's later hops)
/// completes step 30, the others do not. The step goes forward: the members behind take the
/// chief's parameters and store their ranges' state from the gradients they kept, the buddies
/// carry the lost ranges, and no step is lost.
#[test]
fn a_kill_inside_the_all_gather_completes_the_step_and_loses_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let run = args(tmp.path(), &tmp.path().join("ckpt"), true);
    let mut c = start_armed(&run, 1, "sharded-all-gather@step=30");
    c.wait_line(1, "trainerd: failpoint sharded-all-gather reached", 0, DEADLINE);
    std::thread::sleep(Duration::from_millis(300));
    let mark = c.mark();
    c.signal(1, libc::SIGKILL);
    let (_, forward) =
        c.wait_line(2, "trainerd: step 30 completed on another member before the failure", mark, DEADLINE);
    assert!(forward.ends_with("(the step goes forward)"), "{forward}");
    assert_moved(&mut c, 0, mark);
    assert_moved(&mut c, 3, mark);
    assert_nothing_lost(&mut c, tmp.path(), &[0, 1, 2, 3]);
}

/// `--shard gradients` with buckets of 0.25 MB (mnist-cnn's gradients in several): a worker stopped
/// in step 30 right after it wrote the first bucket of its parameters as the all-gather brought
/// it, then SIGKILLed. Every survivor's all-gather fails at a later bucket, so no member completes
/// the step and some hold torn parameters: the reshard puts the first bucket back on every member
/// from its ranges' holders (the lost worker's from their buddies), the step is trained again,
/// and the run ends bit for bit the failure-free one (unsharded, the same buckets), no step lost.
#[test]
fn parameters_torn_by_a_kill_inside_the_all_gather_are_put_back_and_nothing_is_lost() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = start_armed(&in_buckets(tmp.path(), true), 1, "sharded-wrote-bucket@step=30");
    c.wait_line(1, "trainerd: failpoint sharded-wrote-bucket reached", 0, DEADLINE);
    std::thread::sleep(Duration::from_millis(300));
    let mark = c.mark();
    c.signal(1, libc::SIGKILL);
    let (_, put_back) = c.wait_line(2, "trainerd: the failed step's all-gather had written into ", mark, DEADLINE);
    // The survivors' all-gathers of the second bucket need the lost worker: none got further than
    // writing the first bucket and beginning the second (gathered into its one parameter's memory).
    let said = " bucket(s) of the parameters on some member (--shard gradients writes each as it is gathered): every \
                member put them back to step 29 from their ranges' holders";
    let into = |n: usize| format!("trainerd: the failed step's all-gather had written into {n}{said}");
    assert!(put_back.ends_with(&into(1)) || put_back.ends_with(&into(2)), "{put_back}");
    assert_moved(&mut c, 2, mark);
    assert_finished_as(&mut c, tmp.path(), &[0, 1, 2, 3], &reference_in_buckets());
    for rank in 0..WORKERS {
        assert_eq!(steps_lost(&summary(tmp.path(), rank)), 0, "worker {rank}\n{}", c.transcript());
    }
    assert!(!c.transcript().contains("goes back to checkpoint"), "{}", c.transcript());
}

/// `--shard gradients` in buckets of 0.25 MB: worker 1 stopped inside its backward pass of step
/// 30, just after it handed a bucket's gradients to their reduce-scatter (which its peers join
/// from their own backward passes), and SIGKILLed there. The survivors abandon step 30, its
/// ranges come from their buddies, and they take the step up again: no step lost or trained
/// again, and the run ends bit for bit the failure-free one (unsharded, the same buckets).
#[test]
fn a_kill_inside_a_backward_reduce_scatter_loses_nothing_at_the_gradients_level() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = start_armed(&in_buckets(tmp.path(), true), 1, "backward@step=30");
    c.wait_line(1, "trainerd: failpoint backward reached", 0, DEADLINE);
    let mark = c.mark();
    c.signal(1, libc::SIGKILL);
    let (_, gave_up) = c.wait_event(2, |e| matches!(e, Event::Abandoned { .. }), DEADLINE);
    assert!(matches!(gave_up, Event::Abandoned { step: 30, .. }), "{gave_up:?}");
    assert_moved(&mut c, 2, mark);
    assert_nothing_lost_as(&mut c, tmp.path(), &[0, 1, 2, 3], &reference_in_buckets());
}

/// `--shard gradients` in buckets of 0.25 MB: a worker and its buddy killed together after the
/// commit of step 25 (the gradients' ranges as well as the state's held by no one): every member
/// says which ranges and goes back to that commit, counting the steps lost, and the run ends bit
/// for bit the failure-free one.
#[test]
fn a_worker_lost_with_its_buddy_at_the_gradients_level_goes_back_to_the_last_commit() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = past_the_first_commit_of(start_run(&in_buckets(tmp.path(), true)));
    let mark = c.mark();
    c.signal(2, libc::SIGKILL);
    c.signal(3, libc::SIGKILL);
    let (_, back) = c.wait_line(0, "trainerd: the optimizer state was sharded over generation ", mark, DEADLINE);
    let lost = " range(s) of the sharded optimizer state were lost with both their owner and their buddy (ranges ";
    assert!(back.contains(lost), "{back}");
    assert!(back.contains("every member goes back to checkpoint 1 at step 25 ("), "{back}\n{}", c.transcript());
    let chief = assert_finished_as(&mut c, tmp.path(), &[0, 1, 2, 3], &reference_in_buckets());
    assert!(steps_lost(&chief) >= 3, "steps 26 to 28 at least are lost, and counted\n{}", c.transcript());
}

/// A worker killed inside the buddy shift of step 30 (its clipped ranges on their way to the
/// next worker): the step completes nowhere, and nothing is lost.
#[test]
fn a_kill_inside_the_buddy_shift_loses_no_step_and_the_run_ends_exactly() {
    killed_at_failpoint(2, ("buddy-shift", "@step=30"));
}

/// The chief killed in the middle of its commit of step 50 (the blobs written, not the record):
/// the cut commit never becomes visible, and the survivors go on from the state they hold.
#[test]
fn the_chief_killed_in_the_middle_of_a_commit_loses_no_step_and_the_run_ends_exactly() {
    killed_at_failpoint(0, ("commit-before-record", "@2"));
}

/// Worker 2 killed in the middle of writing its part of the commit of step 50 (every member
/// writes its own: the failpoint `commit-part`): the coordinator never hears of
/// the part, writes no record, and the survivors go on; the commit of step 25 stays the latest
/// until the next one, and the run ends exactly without a step lost.
#[test]
fn a_worker_killed_while_writing_its_part_of_a_commit_loses_no_step_and_the_run_ends_exactly() {
    killed_at_failpoint(2, ("commit-part", "@step=50"));
}

/// A worker killed for good: the three others go on without it at once (its slot and ranges
/// move to them), and end exactly, without a step lost.
#[test]
fn a_worker_gone_for_good_loses_no_step_and_the_others_end_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = past_the_first_commit(tmp.path());
    c.hold(2);
    let mark = c.mark();
    c.signal(2, libc::SIGKILL);
    assert_moved(&mut c, 1, mark);
    let chief = assert_nothing_lost(&mut c, tmp.path(), &[0, 1, 3]);
    assert_eq!(chief["workers_present"].as_u64(), Some(3), "{chief}");
}

/// The chief killed, then the worker elected in its place (once the chief is back as a member):
/// restarted, that worker holds its term's vote, so it coordinates at its start and restores the
/// last commit (the whole optimizer state), then follows the chief's newer term into a generation
/// whose state is sharded. The state it receives says so: it takes the sharded kind with the
/// parameters (it stayed whole, and with Adam could not take the state; the soak's plain SGD sent
/// every member back to the commit), its ranges come from its neighbours, and nothing is lost.
/// Its peers may tell it the chief's newer term before it reads the commit (a repeated run under
/// load, 2026-11-29): it then joins as a member at once, and ends the same; it may then catch up
/// while the others train, its ranges streamed to it before the switch (a release build's run,
/// 2026-12-01), so that the formation moves nothing to it.
#[test]
fn an_elected_coordinator_killed_comes_back_from_a_commit_and_takes_the_sharded_state() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = past_the_first_commit(tmp.path());
    c.signal(0, libc::SIGKILL);
    c.wait_for(|e| e.worker == 0 && e.what == What::Restarted, DEADLINE);
    c.wait_event(0, |e| matches!(e, Event::Step { .. }), DEADLINE);
    let elected = c.lines_of(1, "trainerd: worker 1 ");
    assert!(elected.iter().any(|l| l.contains(" coordinates from term ")), "{}", c.transcript());
    let mark = c.mark();
    c.signal(1, libc::SIGKILL);
    let moved = assert_moved(&mut c, 1, mark);
    let said: Vec<&str> = c.seen()[mark..].iter().filter(|e| e.worker == 1).filter_map(|e| e.line()).collect();
    let restored = said.iter().any(|l| l.starts_with("trainerd: resumed from checkpoint "));
    let followed = said.iter().any(|l| l.contains("; joining as a member (this worker coordinated term "));
    assert!(restored || followed, "{}", c.transcript());
    // Its ranges came at the formation, or, caught up while the others trained, streamed before it.
    let streamed = said.iter().any(|l| {
        l.starts_with("trainerd: catching up: ")
            && l.contains(" range(s) of the optimizer state it will hold came from ")
    });
    assert!(streamed || !moved.contains("; it received 0.0 MB"), "{moved}\n{}", c.transcript());
    assert_nothing_lost(&mut c, tmp.path(), &[0, 1, 2, 3]);
    // Killed once each, and no error after (the restored worker took the received state: it
    // exited with "the received state: optimizer state: missing model.conv.bias/exp_avg" and
    // went on only once restarted again, following the chief's term).
    assert_eq!((c.starts(0), c.starts(1)), (2, 2), "{}", c.transcript());
}

/// A worker frozen (SIGSTOP) past the heartbeat deadline while the others go on without it, then
/// thawed: by then its ranges are many steps behind and not used (their buddies' are), it takes
/// ranges back from the others, and nothing is lost.
#[test]
fn a_frozen_worker_comes_back_with_stale_ranges_and_nothing_is_lost() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = start(tmp.path());
    c.wait_step(0, 20, DEADLINE);
    let mark = c.mark();
    c.signal(2, libc::SIGSTOP);
    assert_moved(&mut c, 1, mark);
    c.wait_step(0, 40, DEADLINE);
    let thawed = c.mark();
    c.signal(2, libc::SIGCONT);
    assert_moved(&mut c, 2, thawed);
    assert_nothing_lost(&mut c, tmp.path(), &[0, 1, 2, 3]);
    assert_eq!(c.starts(2), 1, "the frozen worker went on in its own process\n{}", c.transcript());
}

/// A worker and its buddy (the next worker) killed together after the commit of step 25: the
/// ranges the first owned are held by no one, and every member says which and goes back to that
/// commit, counting the steps lost, each reading its own ranges of it; the run ends exactly.
#[test]
fn a_worker_lost_with_its_buddy_sends_every_member_back_to_the_last_commit_and_the_run_ends_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = past_the_first_commit(tmp.path());
    let mark = c.mark();
    c.signal(1, libc::SIGKILL);
    c.signal(2, libc::SIGKILL);
    let (_, back) = c.wait_line(3, "trainerd: the optimizer state was sharded over generation ", mark, DEADLINE);
    assert!(
        back.contains(
            " range(s) of the sharded optimizer state were lost with both their owner and their buddy (ranges "
        ),
        "{back}"
    );
    assert!(back.contains("every member goes back to checkpoint 1 at step 25 ("), "{back}\n{}", c.transcript());
    // Back at the commit, each member reads its own ranges of it: none holds the state whole.
    let (_, read) = c.wait_line(3, "trainerd: this worker read its ", mark, DEADLINE);
    assert!(read.contains(" from checkpoint 1 in ") && read.ends_with(": no member holds it whole"), "{read}");
    let chief = assert_finished_exactly(&mut c, tmp.path());
    assert!(steps_lost(&chief) >= 3, "steps 26 to 28 at least are lost, and counted\n{}", c.transcript());
}

/// A bit of one range's optimizer state flipped on worker 2 after its step 27 (faulty memory): the
/// replicas' comparison at step 30 finds that range's two copies (worker 2's, its owner's, and
/// worker 3's, its buddy's) differ and names them; with no majority, every member goes back to the
/// commit of step 25, and the run ends exactly.
#[test]
fn a_range_whose_two_copies_differ_sends_every_member_back_to_the_last_commit() {
    let tmp = tempfile::tempdir().unwrap();
    let run = args(tmp.path(), &tmp.path().join("ckpt"), true).set("--replica-check-every", 10);
    let mut c = start_armed(&run, 2, "flip-state-bit@step=27");
    let prefix = "trainerd: replica check at step 30: 1 range(s) of the sharded optimizer state differ between their";
    let (_, _, found) = c.wait_line_of(|_| true, prefix, 0, DEADLINE);
    assert!(found.contains(" on worker 2 (") && found.contains(" on worker 3 ("), "{found}");
    let (_, back) = c.wait_line(0, "trainerd: the optimizer state was sharded over generation ", 0, DEADLINE);
    assert!(back.contains("every member goes back to checkpoint 1 at step 25 ("), "{back}\n{}", c.transcript());
    assert!(found.ends_with("; this worker drops its state and goes back to the last commit"), "{found}");
    let chief = assert_finished_exactly(&mut c, tmp.path());
    let again = chief["fault_tolerance"]["steps_trained_again"].as_u64().unwrap();
    assert!(again >= 5, "steps 26 to 30 are trained again: {again}\n{}", c.transcript());
}

/// A bit of a parameter flipped on worker 2 after its step 27 (faulty memory): before step 28
/// updates anything, the per-step check finds worker 2's parameters differ from the others' as
/// the step read them and names it (a comparison every 10 steps would not: the all-gather
/// overwrites or spreads a corrupted parameter first). The other three agree, so worker 2 drops
/// its parameters and takes theirs, keeping its ranges; step 28 is trained again, and nothing is
/// lost. Every right member names the mismatch: the finders, and those whose exchange the
/// finders' leaving cut short (told by a finder; in CI only workers 2 and 3 completed it).
#[test]
fn a_flipped_parameter_is_found_before_the_next_update_and_nothing_is_lost() {
    let tmp = tempfile::tempdir().unwrap();
    let run = args(tmp.path(), &tmp.path().join("ckpt"), true).set("--replica-check-every", 10);
    let mut c = start_armed(&run, 2, "flip-bit@step=27");
    let found = "replica check at step 28, before its update, of the parameters it read: the parameters of worker 2 (";
    let chief = assert_nothing_lost(&mut c, tmp.path(), &[0, 1, 2, 3]);
    assert_dropped_its_parameters(&c, 2, found);
    let mismatches = &chief["integrity"]["mismatches"];
    assert_eq!(mismatches.as_array().map(Vec::len), Some(1), "{chief}");
    for right in [0, 1, 3] {
        assert_named_the_mismatch(&c, right, found);
    }
}

/// Worker `odd` dropped its parameters for the mismatch `found` (the finding after "trainerd: ")
/// and kept its ranges: found by its own comparison, or told by a finder that left first.
fn assert_dropped_its_parameters(c: &Cluster, odd: usize, found: &str) {
    let drops = "; no step is lost: this worker drops its parameters and takes a right member's, and keeps its ranges \
                 of the optimizer state";
    let dropped = c.lines_of(odd, "trainerd: ").into_iter().any(|l| l.contains(found) && l.ends_with(drops));
    assert!(dropped, "worker {odd} did not drop its parameters:\n{}", c.transcript());
}

/// Worker `right`, a right member, named the mismatch `found` (the finding after "trainerd: "):
/// found by its own comparison and kept its state, or, its exchange cut short by a finder's
/// leaving first (which a loaded machine does at any member), told by the finder.
fn assert_named_the_mismatch(c: &Cluster, right: usize, found: &str) {
    let named = c.lines_of(right, "trainerd: ").into_iter().any(|l| {
        let itself = l.starts_with(&format!("trainerd: {found}"))
            && l.ends_with("; no step is lost: this worker keeps its state");
        let told = l.contains(&format!(" found: {found}")) && l.ends_with("; no step is lost");
        itself || told
    });
    assert!(named, "worker {right} did not name the mismatch:\n{}", c.transcript());
}

/// The same bit of a range flipped, with the commit of step 25 still being written as the
/// comparison at step 30 finds it (every member's part held until then; a repeated run under load
/// found it, 2026-11-29: the members went back to no commit, and the run could not go on). Every
/// member was alive to give its digest, so the coordinator records that commit first, once their
/// parts are written, and every member goes back to it.
#[test]
fn a_range_found_different_while_the_last_commit_is_written_goes_back_to_that_commit() {
    let tmp = tempfile::tempdir().unwrap();
    let run = args(tmp.path(), &tmp.path().join("ckpt"), true).set("--replica-check-every", 10);
    let release = tmp.path().join("release");
    let held = |also: &str| {
        vec![
            ("TRAINERD_FAILPOINT".to_string(), format!("commit-part@step=25{also}")),
            ("TRAINERD_FAILPOINT_RELEASE".to_string(), release.to_str().unwrap().to_string()),
        ]
    };
    let env = (0..WORKERS).map(|w| held(if w == 2 { ",flip-state-bit@step=27" } else { "" })).collect();
    let mut c = Cluster::start(WORKERS, &run, &[], env, RESTART_SEC);
    // Found by whichever members' comparisons complete (a finder's leaving can cut another's short).
    let prefix = "trainerd: replica check at step 30: 1 range(s) of the sharded optimizer state differ between their";
    c.wait_line_of(|_| true, prefix, 0, DEADLINE);
    assert!(c.lines_of(0, "checkpoint 1 committed to ").is_empty(), "{}", c.transcript());
    // Each member's held part, released one at a time (each process takes the file it finds).
    for n in 1..=WORKERS {
        std::fs::write(&release, b"").unwrap();
        let since = std::time::Instant::now();
        while release.exists() {
            let waited = since.elapsed();
            assert!(waited < DEADLINE, "release {n} of {WORKERS} not taken in {waited:?}: \n{}", c.transcript());
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let (_, back) = c.wait_line(0, "trainerd: the optimizer state was sharded over generation ", 0, DEADLINE);
    assert!(back.contains("every member goes back to checkpoint 1 at step 25 ("), "{back}\n{}", c.transcript());
    let chief = assert_finished_exactly(&mut c, tmp.path());
    let again = chief["fault_tolerance"]["steps_trained_again"].as_u64().unwrap();
    assert!(again >= 5, "steps 26 to 30 are trained again: {again}\n{}", c.transcript());
}

/// The same flip, with worker 2 itself stopped inside the per-step check's exchange (after its
/// first hop: only worker 1 completes it) until the others have abandoned the generation. Worker 1
/// tells what it found before it leaves: worker 2, whose own exchange was cut short, drops its
/// parameters and keeps its ranges as if it had found it (else the formation would see its state
/// differ and send everyone back to the commit), every member's summary names the mismatch, and
/// nothing is lost.
#[test]
fn a_flip_found_by_one_member_alone_is_repaired_in_place_by_the_member_it_names() {
    let tmp = tempfile::tempdir().unwrap();
    let run = args(tmp.path(), &tmp.path().join("ckpt"), true).set("--replica-check-every", 10);
    let release = tmp.path().join("release");
    let mut env = vec![vec![]; 3];
    env[2] = vec![
        ("TRAINERD_FAILPOINT".to_string(), "flip-bit@step=27,all-gather@step=28".to_string()),
        ("TRAINERD_FAILPOINT_RELEASE".to_string(), release.to_str().unwrap().to_string()),
    ];
    let mut c = Cluster::start(WORKERS, &run, &[], env, RESTART_SEC);
    c.wait_line(2, "trainerd: failpoint all-gather reached", 0, DEADLINE);
    let found = "replica check at step 28, before its update, of the parameters it read: the parameters of worker 2 (";
    let (_, finding) = c.wait_line(1, &format!("trainerd: {found}"), 0, DEADLINE);
    assert!(finding.ends_with("; no step is lost: this worker keeps its state"), "{finding}");
    c.wait_line(0, "trainerd: step 28 abandoned (generation 1): ", 0, DEADLINE);
    std::fs::write(&release, b"").unwrap();
    assert_nothing_lost(&mut c, tmp.path(), &[0, 1, 2, 3]);
    for rank in 0..WORKERS {
        let mismatches = &summary(tmp.path(), rank)["integrity"]["mismatches"];
        assert_eq!(mismatches.as_array().map(Vec::len), Some(1), "worker {rank}: {mismatches}");
    }
    let told = |rank: usize, what: &str| {
        let lines = c.lines_of(rank, "trainerd: worker 1 (");
        lines.iter().any(|l| l.contains(&format!(" found: {found}")) && l.ends_with(what))
    };
    let drops = "; no step is lost: this worker drops its parameters and takes a right member's, and keeps its ranges \
                 of the optimizer state";
    assert!(told(2, drops), "{}", c.transcript());
    assert!(told(0, "; no step is lost") && told(3, "; no step is lost"), "{}", c.transcript());
    assert!(c.lines_of(2, &format!("trainerd: {found}")).is_empty(), "worker 2 found it itself:\n{}", c.transcript());
}

/// A bit of a parameter flipped on worker 1 after step 30, a step the replicas are compared at
/// (every 10): the comparison finds worker 1's parameters alone differ. Every step's per-step
/// check saw equal parameters, so no gradient carried the corruption: worker 1 takes the others'
/// parameters and keeps its ranges, and nothing is lost (not every member back to the commit).
#[test]
fn a_parameter_flipped_before_a_comparison_is_repaired_without_going_back() {
    let tmp = tempfile::tempdir().unwrap();
    let run = args(tmp.path(), &tmp.path().join("ckpt"), true).set("--replica-check-every", 10);
    let mut c = start_armed(&run, 1, "flip-bit@step=30");
    let found = "replica check at step 30: the parameters of worker 1 (";
    assert_nothing_lost(&mut c, tmp.path(), &[0, 1, 2, 3]);
    // Found by its own comparison or told (a right finder can leave first): it drops its
    // parameters and keeps its ranges.
    assert_dropped_its_parameters(&c, 1, found);
    let said = "), and nothing else of the replicated state; ";
    assert!(c.lines_of(1, "trainerd: ").iter().any(|l| l.contains(found) && l.contains(said)), "{}", c.transcript());
    for right in [0, 2, 3] {
        assert_named_the_mismatch(&c, right, found);
    }
}

/// Every worker killed after the commit of step 25, and only three of the four come back: after
/// the rendezvous timeout they resume that commit (committed whole, sharded anew over three
/// workers) and end exactly.
#[test]
fn a_resume_on_fewer_workers_ends_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let run = args(tmp.path(), &tmp.path().join("ckpt"), true).set("--rendezvous-timeout", 4);
    let mut c = start_run(&run);
    c.wait_line(0, "checkpoint 1 committed to ", 0, DEADLINE);
    c.wait_step(0, 28, DEADLINE);
    c.hold(2);
    for rank in 0..WORKERS {
        c.signal(rank, libc::SIGKILL);
    }
    let chief = assert_finished_exactly_on(&mut c, tmp.path(), &[0, 1, 3]);
    assert_eq!(chief["workers_present"].as_u64(), Some(3), "{chief}");
    assert!(c.transcript().contains("checkpoint 1"), "{}", c.transcript());
}

/// A worker stopped (SIGTERM) and brought back: the stop makes the state whole first, the return
/// moves the ranges to their new owners and buddies as the generation forms, so nothing is lost.
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
    assert_moved(&mut c, 2, mark);
    assert_nothing_lost(&mut c, tmp.path(), &[0, 1, 2, 3]);
}

/// A worker and its buddy killed before the first commit: no member holds their ranges and there
/// is no commit, so the members that find nothing say so and exit; restarted, the run starts over
/// from step 0 and still ends exactly.
#[test]
fn a_double_loss_before_any_commit_starts_the_run_over_and_ends_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = start(tmp.path());
    c.wait_step(0, 5, DEADLINE);
    let mark = c.mark();
    c.signal(1, libc::SIGKILL);
    c.signal(2, libc::SIGKILL);
    assert_finished_exactly(&mut c, tmp.path());
    // A survivor that found nothing said so and exited (the other may take a restarted peer's
    // fresh state instead of exiting too), and a generation formed at step 0 after the error.
    let transcript = c.transcript();
    let said = "error: the sharded optimizer state is lost (generation ";
    let line = c.seen[mark..].iter().filter_map(|e| e.line()).find(|l| l.starts_with(said));
    let line = line.unwrap_or_else(|| panic!("no survivor said the state is lost\n{transcript}"));
    assert!(line.ends_with("no member found a commit to go back to: the run starts over"), "{line}");
    assert!(c.starts(0) >= 2 || c.starts(3) >= 2, "{transcript}");
    let after = &transcript[transcript.find("error: the sharded optimizer state is lost").unwrap()..];
    assert!(after.contains("Joined { generation: ") && after.contains("global_step: 0, "), "{transcript}");
}
