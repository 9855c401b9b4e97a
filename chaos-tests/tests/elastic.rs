//! Elastic membership: workers gone for good (not restarted), coming back, and a job started short.
//! Every scenario must end with exactly the parameters of the failure-free run on all of
//! TF_CONFIG's workers: the run's math belongs to its slots (virtual ranks), never to the workers
//! present.
//!
//! CI budget: the seventeen scenarios and their references take about 90 s on 2 cores alone (up
//! to 5 minutes beside the other suites).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use trainerd_testkit::{Cluster, Entry, Event, Return, RunArgs, What};

const DEADLINE: Duration = Duration::from_secs(240);
const RESTART_SEC: Duration = Duration::from_millis(200);

/// A training configuration.
#[derive(Clone, Copy)]
struct Job {
    plugin: &'static str,
    epochs: u32,
    steps: u64,
    workers: usize,
    /// `--batch-size` (the plugin's default when `None`).
    batch: Option<u32>,
}

const LINEAR: Job = Job { plugin: "linear", epochs: 2, steps: 120, workers: 3, batch: None };
const LINEAR4: Job = Job { plugin: "linear", epochs: 2, steps: 150, workers: 4, batch: None };
/// Long enough (1,200 steps) that the survivors cannot finish before a chief frozen until they
/// have replaced it is back, even on a loaded machine.
const LONGER: Job = Job { plugin: "linear", epochs: 2, steps: 600, workers: 3, batch: Some(32) };
/// BatchNorm (running statistics, one copy per slot) and dropout (masks drawn per slot).
const BN: Job = Job { plugin: "mnist-bn", epochs: 1, steps: 40, workers: 3, batch: None };

/// `trainerd run` arguments of `job`, each worker's summary in `dir`, with the defaults a user
/// gets.
fn job_args(job: Job, dir: &Path) -> RunArgs {
    let run = RunArgs::new(job.plugin).epochs(job.epochs).steps(job.steps).threads(1).seed(5);
    let run = run.optimizer("adam", 0.001).summary(dir.join("summary.{rank}.json")).checkpoints(dir.join("ckpt"), 40);
    match job.batch {
        Some(batch) => run.batch(batch),
        None => run,
    }
}

/// [`job_args`] with `extra`; a worker missing for 3 s is replaced.
fn args(job: Job, dir: &Path, extra: &[&str]) -> RunArgs {
    job_args(job, dir).set("--replace-after", 3).extend(extra)
}

/// The failure-free run's `params_sha256` on all of `job`'s workers (computed once per job).
fn reference(job: Job) -> String {
    type Key = (&'static str, usize, u64, Option<u32>);
    static CACHE: OnceLock<Mutex<HashMap<Key, String>>> = OnceLock::new();
    let mut cache = CACHE.get_or_init(Mutex::default).lock().unwrap();
    let key = (job.plugin, job.workers, job.steps, job.batch);
    if let Some(sha) = cache.get(&key) {
        return sha.clone();
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut cluster = Cluster::start(job.workers, &args(job, tmp.path(), &[]), &[], vec![], RESTART_SEC);
    assert_eq!(cluster.wait_finished(DEADLINE), vec![0; job.workers], "{}", cluster.transcript());
    let s = summary(tmp.path(), 0);
    assert_eq!(
        (s["workers"].as_u64(), s["workers_present"].as_u64()),
        (Some(job.workers as u64), Some(job.workers as u64))
    );
    let sha = s["params_sha256"].as_str().unwrap().to_string();
    cache.insert(key, sha.clone());
    sha
}

fn summary(dir: &Path, rank: usize) -> serde_json::Value {
    let path = dir.join(format!("summary.{rank}.json"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

fn wait_for_step(c: &mut Cluster, job: Job, epoch: u64, step: u64) {
    c.wait_step(0, (epoch - 1) * job.steps + step, DEADLINE);
}

/// The chief formed a generation of `present` workers.
fn formed_with(present: usize, workers: usize) -> impl Fn(&Event) -> bool {
    move |e| match e {
        Event::Joined { present: p, .. } if present < workers => *p == Some(present),
        Event::Joined { present: None, .. } => present == workers,
        _ => false,
    }
}

/// The workers in `ranks` exited 0 with the failure-free run's parameters; the others (gone for
/// good) were killed.
fn assert_finished_exactly(c: &mut Cluster, job: Job, dir: &Path, ranks: &[usize]) {
    let codes = c.wait_finished(DEADLINE);
    for (rank, &code) in codes.iter().enumerate() {
        let expected = if ranks.contains(&rank) { 0 } else { 128 + libc::SIGKILL };
        assert_eq!(code, expected, "worker {rank}\n{}", c.transcript());
    }
    let expected = reference(job);
    for &rank in ranks {
        assert_eq!(summary(dir, rank)["params_sha256"], expected.as_str(), "worker {rank}\n{}", c.transcript());
    }
}

/// Worker `victim` SIGKILLed for good after step `step` of epoch 1: the chief's line of the
/// generation the others form without it.
fn killed_for_good_after(c: &mut Cluster, job: Job, victim: usize, step: u64) -> String {
    c.hold(victim);
    wait_for_step(c, job, 1, step);
    let killed = c.mark();
    c.signal(victim, libc::SIGKILL);
    c.wait_event(0, formed_with(job.workers - 1, job.workers), DEADLINE);
    c.wait_line(0, "trainerd: generation ", killed, DEADLINE).1
}

#[test]
fn a_worker_gone_for_good_is_replaced_and_the_run_is_bitwise_the_full_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = Cluster::start(LINEAR.workers, &args(LINEAR, tmp.path(), &[]), &[], vec![], RESTART_SEC);
    let line = killed_for_good_after(&mut c, LINEAR, 2, 40);
    assert!(
        line.contains("; 2 of 3 workers (")
            && line.contains(": slots 0-1, ")
            && line.contains(": slot 2; 0.67x speed)"),
        "{line}"
    );
    assert_finished_exactly(&mut c, LINEAR, tmp.path(), &[0, 1]);
    let chief = summary(tmp.path(), 0);
    assert_eq!((chief["workers"].as_u64(), chief["workers_present"].as_u64()), (Some(3), Some(2)));
    assert_eq!(chief["slots"], serde_json::json!([0, 1]));
    assert_eq!(summary(tmp.path(), 1)["slots"], serde_json::json!([2]));
    // The time and throughput while short are reported beside the full-size figures.
    let ft = &chief["fault_tolerance"];
    assert!(ft["seconds_short"].as_f64().unwrap() > 0.0, "{ft}");
    assert!(ft["examples_per_second_short"].as_f64().unwrap() > 0.0, "{ft}");
    assert!(ft["examples_per_second_full"].as_f64().unwrap() > 0.0, "{ft}");
}

#[test]
fn a_replaced_worker_that_comes_back_takes_its_slot_back() {
    let tmp = tempfile::tempdir().unwrap();
    // Without a catch-up (tests/catch_up.rs has it), the return pauses the others for a state
    // transfer, as before.
    // Killed at the start of step 30, back while the two others wait at step 100 (a release
    // build trains the rest faster than a restarted worker loads libtorch).
    let run = args(LINEAR, tmp.path(), &["--catch-up-memory", "0"]);
    let staged = Return::new(tmp.path(), 2, 30, &[0, 1], 100);
    let mut c = Cluster::start(LINEAR.workers, &run, &[], staged.env(LINEAR.workers, &[]), RESTART_SEC);
    c.hold(2);
    staged.stop_leaver(&mut c, DEADLINE);
    c.signal(2, libc::SIGKILL);
    c.wait_event(0, formed_with(2, 3), DEADLINE);
    let back = staged.bring_back(&mut c, DEADLINE);
    // It receives the state from a live peer and the run is back to full size.
    let (_, joined) = c.wait_event_after(2, back, |e| matches!(e, Event::Joined { .. }), DEADLINE);
    assert!(matches!(joined, Event::Joined { present: None, source: Some(0 | 1), .. }), "{joined:?}");
    assert_finished_exactly(&mut c, LINEAR, tmp.path(), &[0, 1, 2]);
    let chief = summary(tmp.path(), 0);
    assert_eq!((chief["workers_present"].as_u64(), &chief["slots"]), (Some(3), &serde_json::json!([0])));
    assert_eq!(chief["fault_tolerance"]["steps_lost"].as_u64(), Some(0));
}

/// Every worker keeps its vote (for electing a coordinator) in its own directory.
fn voting(dir: &Path) -> [String; 2] {
    ["--state-dir".to_string(), dir.join("state.{rank}").to_str().unwrap().to_string()]
}

/// A survivor (1 or 2) says it was elected by both, and that it formed a generation of the two in
/// which worker 1, the first in ring order, holds slots 0-1; its rank. Worker 1 stands first, but
/// a vote that does not arrive within the heartbeat deadline (a loaded machine) lets worker 2 win
/// the next term: either is right.
fn elected_after(c: &mut Cluster, mark: usize) -> usize {
    let (rank, _, elected) = c.wait_line_of(|r| r != 0, "trainerd: worker ", mark, DEADLINE);
    assert!(elected.contains(" coordinates from term ") && elected.contains("elected by 2 of 3"), "{elected}");
    let (_, line) = c.wait_line(rank, "trainerd: generation ", mark, DEADLINE);
    assert!(line.contains("; 2 of 3 workers (") && line.contains(": slots 0-1, "), "{line}");
    rank
}

/// Three voting workers, `first_env` added to their first processes; the chief SIGKILLed for
/// good once `stopped` returns: a survivor is elected and forms a generation of the two.
fn chief_killed_for_good(
    job: Job,
    dir: &Path,
    first_env: Vec<Vec<(String, String)>>,
    stopped: impl FnOnce(&mut Cluster),
) -> Cluster {
    let state = voting(dir);
    let extra: Vec<&str> = state.iter().map(String::as_str).collect();
    let mut c = Cluster::start(job.workers, &args(job, dir, &extra), &[], first_env, RESTART_SEC);
    c.hold(0);
    stopped(&mut c);
    let killed = c.mark();
    c.signal(0, libc::SIGKILL);
    elected_after(&mut c, killed);
    c
}

/// The chief is SIGKILLed and never restarted: after --replace-after, worker 1 (the lowest live
/// rank) stands, worker 2 votes for it, and it coordinates a generation of the two survivors,
/// committing to the shared checkpoint directory (or worker 2 does, a term later, if worker 1's
/// votes were late); the run is bitwise the three-worker run's.
#[test]
fn the_chief_killed_for_good_is_replaced_by_an_elected_coordinator() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = chief_killed_for_good(LINEAR, tmp.path(), vec![], |c| wait_for_step(c, LINEAR, 1, 40));
    assert_finished_exactly(&mut c, LINEAR, tmp.path(), &[1, 2]);
    // The new coordinator committed the final state, in a generation above the chief's.
    let s = summary(tmp.path(), 1);
    assert_eq!((s["workers_present"].as_u64(), &s["slots"]), (Some(2), &serde_json::json!([0, 1])));
    assert_eq!(s["checkpoint_error"], serde_json::Value::Null);
    let ckpt = |command: &str| {
        let out = std::process::Command::new(trainerd_testkit::trainerd())
            .args(["ckpt", command, tmp.path().join("ckpt").to_str().unwrap()])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "ckpt {command}: {text}{}", String::from_utf8_lossy(&out.stderr));
        text
    };
    ckpt("verify");
    let list = ckpt("list");
    let newest: Vec<&str> = list.lines().last().unwrap().split_whitespace().collect();
    assert_eq!(newest[1], (2 * LINEAR.steps).to_string(), "the final commit is the new coordinator's:\n{list}");
}

/// The chief comes back while its successor coordinates: it hears of the newer term, joins as a
/// member saying so, takes its slot back, and the run is still bitwise the three-worker run's.
/// It receives the state at its join, or (repeated runs under load, 2026-11-29: 2 of 2) catches
/// up from a peer's first and joins holding the state every member holds. The chief is killed at
/// the start of step 30, and the survivors wait at step 60 until it is back.
#[test]
fn a_chief_that_returns_while_its_successor_coordinates_joins_as_a_member() {
    let tmp = tempfile::tempdir().unwrap();
    let staged = Return::new(tmp.path(), 0, 30, &[1, 2], 60);
    let env = staged.env(LINEAR.workers, &[]);
    let mut c = chief_killed_for_good(LINEAR, tmp.path(), env, |c| staged.stop_leaver(c, DEADLINE));
    let back = staged.bring_back(&mut c, DEADLINE);
    let (_, line) = c.wait_line(0, "trainerd: worker 0 ", back, DEADLINE);
    assert!(line.contains(" coordinates (term ") && line.contains("joining as a member"), "{line}");
    let (_, joined) = c.wait_event_after(0, back, |e| matches!(e, Event::Joined { .. }), DEADLINE);
    let caught_up = !c.lines_of(0, "trainerd: caught up in ").is_empty();
    let received = matches!(joined, Event::Joined { present: None, source: Some(1 | 2), .. });
    let held = matches!(joined, Event::Joined { present: None, source: None, .. }) && caught_up;
    assert!(received || held, "{joined:?}\n{}", c.transcript());
    assert_finished_exactly(&mut c, LINEAR, tmp.path(), &[0, 1, 2]);
    assert_eq!(summary(tmp.path(), 0)["slots"], serde_json::json!([0]));
}

/// The chief frozen (SIGSTOP) for longer than --replace-after: the others elect worker 1 and go
/// on; on SIGCONT the old chief finds its generation gone and a newer term, steps down, joins as a
/// member, and the run is bitwise the three-worker run's.
#[test]
fn a_chief_frozen_past_replace_after_is_replaced_and_joins_as_a_member_when_it_wakes() {
    let tmp = tempfile::tempdir().unwrap();
    let state = voting(tmp.path());
    let extra: Vec<&str> = state.iter().map(String::as_str).collect();
    let mut c = Cluster::start(LONGER.workers, &args(LONGER, tmp.path(), &extra), &[], vec![], RESTART_SEC);
    wait_for_step(&mut c, LONGER, 1, 30);
    let frozen = c.mark();
    c.signal(0, libc::SIGSTOP);
    elected_after(&mut c, frozen);
    let woke = c.mark();
    c.signal(0, libc::SIGCONT);
    let (_, line) = c.wait_line(0, "trainerd: worker 0 ", woke, DEADLINE);
    assert!(line.contains(" coordinates (term ") && line.contains("joining as a member"), "{line}");
    assert_finished_exactly(&mut c, LONGER, tmp.path(), &[0, 1, 2]);
}

#[test]
fn batchnorm_and_dropout_on_two_of_three_workers_are_bitwise_the_three_worker_run() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = Cluster::start(BN.workers, &args(BN, tmp.path(), &[]), &[], vec![], RESTART_SEC);
    killed_for_good_after(&mut c, BN, 1, 8);
    assert_finished_exactly(&mut c, BN, tmp.path(), &[0, 2]);
    // Worker 0 held slots 0 and 1, worker 2 slot 2.
    assert_eq!(summary(tmp.path(), 2)["slots"], serde_json::json!([2]));
}

/// `--devices`: a daemon's replicas are slots of the run, so one daemon of three CPU replicas is,
/// bit for bit, three workers of one (BatchNorm's statistics and dropout's masks per replica).
#[test]
fn one_daemon_of_three_replicas_is_bitwise_three_workers() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = Cluster::start(1, &args(BN, tmp.path(), &["--devices", "cpu,cpu,cpu"]), &[], vec![], RESTART_SEC);
    let (_, line) = c.wait_line(0, "trainerd: mnist-bn ", 0, DEADLINE);
    assert!(line.contains(" on 3 replicas (cpu, cpu, cpu) ") && line.contains(" per replica, "), "{line}");
    assert_eq!(c.wait_finished(DEADLINE), vec![0], "{}", c.transcript());
    let s = summary(tmp.path(), 0);
    assert_eq!(s["params_sha256"], reference(BN).as_str(), "{}", c.transcript());
    assert_eq!((s["workers"].as_u64(), s["replicas"].as_u64()), (Some(1), Some(3)));
    assert_eq!(s["slots"], serde_json::json!([0, 1, 2]));
}

/// The parameters of `job` trained by one daemon of `replicas` CPU replicas, which stands for as
/// many workers of one (`one_daemon_of_three_replicas_is_bitwise_three_workers`).
fn one_daemon_of(replicas: usize, job: Job) -> String {
    let solo = tempfile::tempdir().unwrap();
    let devices = vec!["cpu"; replicas].join(",");
    let mut one = Cluster::start(1, &args(job, solo.path(), &["--devices", &devices]), &[], vec![], RESTART_SEC);
    assert_eq!(one.wait_finished(DEADLINE), vec![0], "{}", one.transcript());
    summary(solo.path(), 0)["params_sha256"].as_str().unwrap().to_string()
}

/// `--accumulate`: each micro-batch is a slot of the run, so one worker accumulating three is, bit
/// for bit, three workers (BatchNorm and dropout included).
#[test]
fn one_worker_accumulating_three_micro_batches_is_bitwise_three_workers() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = Cluster::start(1, &args(BN, tmp.path(), &["--accumulate", "3"]), &[], vec![], RESTART_SEC);
    let (_, line) = c.wait_line(0, "trainerd: mnist-bn ", 0, DEADLINE);
    assert!(line.contains(" per micro-batch, 3 micro-batches per update per worker, "), "{line}");
    assert_eq!(c.wait_finished(DEADLINE), vec![0], "{}", c.transcript());
    let s = summary(tmp.path(), 0);
    assert_eq!(s["params_sha256"], reference(BN).as_str(), "{}", c.transcript());
    assert_eq!((s["accumulate"].as_u64(), &s["slots"]), (Some(3), &serde_json::json!([0, 1, 2])));
}

/// Two workers of two CPU replicas each, accumulating two micro-batches: eight slots, bitwise
/// eight workers (one daemon of eight replicas stands for them).
#[test]
fn two_workers_of_two_replicas_accumulating_two_are_bitwise_eight_slots() {
    let tmp = tempfile::tempdir().unwrap();
    let expected = one_daemon_of(8, LINEAR);
    let split = ["--devices", "cpu,cpu", "--accumulate", "2"];
    let mut c = Cluster::start(2, &args(LINEAR, tmp.path(), &split), &[], vec![], RESTART_SEC);
    assert_eq!(c.wait_finished(DEADLINE), vec![0, 0], "{}", c.transcript());
    for rank in 0..2 {
        let s = summary(tmp.path(), rank);
        assert_eq!(s["params_sha256"], expected.as_str(), "worker {rank}\n{}", c.transcript());
        assert_eq!(s["global_batch_size"].as_u64(), Some(8 * 64), "8 slots of the plugin's batch of 64");
    }
}

/// Losing a daemon loses its replicas together: one failure, recovered as any other, and the run
/// stays bitwise the run of four workers of one replica.
#[test]
fn two_daemons_of_two_replicas_lose_one_and_stay_bitwise_four_workers() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = Cluster::start(2, &args(LINEAR4, tmp.path(), &["--devices", "cpu,cpu"]), &[], vec![], RESTART_SEC);
    wait_for_step(&mut c, LINEAR4, 1, 50);
    let killed = c.mark();
    c.signal(1, libc::SIGKILL);
    let (_, line) = c.wait_line(0, "trainerd: generation ", killed, DEADLINE);
    assert!(line.contains(": 0 step(s) lost, 0 trained again;"), "{line}");
    assert_eq!(c.wait_finished(DEADLINE), vec![0, 0], "{}", c.transcript());
    for rank in 0..2 {
        let s = summary(tmp.path(), rank);
        assert_eq!(s["params_sha256"], reference(LINEAR4).as_str(), "worker {rank}\n{}", c.transcript());
        assert_eq!(s["slots"], serde_json::json!([2 * rank, 2 * rank + 1]));
    }
}

/// A daemon of two replicas gone for good: its two slots go to the survivors, dealt over their
/// replicas, and the run stays bitwise one daemon of all six slots.
#[test]
fn a_daemon_of_two_replicas_gone_for_good_leaves_its_slots_to_the_survivors_replicas() {
    let tmp = tempfile::tempdir().unwrap();
    let expected = one_daemon_of(6, LINEAR);
    let mut c =
        Cluster::start(LINEAR.workers, &args(LINEAR, tmp.path(), &["--devices", "cpu,cpu"]), &[], vec![], RESTART_SEC);
    let line = killed_for_good_after(&mut c, LINEAR, 2, 40);
    assert!(line.contains(": slots 0-2, ") && line.contains(": slots 3-5; 0.67x speed)"), "{line}");
    let codes = c.wait_finished(DEADLINE);
    assert_eq!(codes, vec![0, 0, 128 + libc::SIGKILL], "{}", c.transcript());
    for rank in 0..2 {
        assert_eq!(summary(tmp.path(), rank)["params_sha256"], expected.as_str(), "worker {rank}\n{}", c.transcript());
    }
}

/// `--min-workers 2` of 4 is exactly half: accepted only with `--allow-even-split`, which takes the
/// risk that two halves of a partition both train (this test's cluster cannot be partitioned).
#[test]
fn four_workers_lose_two_one_after_the_other_and_both_come_back() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = ["--min-workers", "2", "--allow-even-split"];
    // Worker 3 killed at the start of step 30, worker 1 at step 60's; the two others wait at step
    // 100 until both are back (a release build trains the rest faster than a restart loads).
    let staged = Return::new(tmp.path(), 3, 30, &[0, 2], 100);
    let env = staged.env(LINEAR4.workers, &[(1, "train-step@step=60")]);
    let mut c = Cluster::start(LINEAR4.workers, &args(LINEAR4, tmp.path(), &extra), &[], env, RESTART_SEC);
    c.hold(1);
    c.hold(3);
    staged.stop_leaver(&mut c, DEADLINE);
    c.signal(3, libc::SIGKILL);
    c.wait_event(0, formed_with(3, 4), DEADLINE);
    c.wait_line(1, "trainerd: failpoint train-step reached", 0, DEADLINE);
    c.signal(1, libc::SIGKILL);
    c.wait_event(0, formed_with(2, 4), DEADLINE);
    let back = staged.bring_back_also(&mut c, 1, DEADLINE);
    staged.bring_back(&mut c, DEADLINE);
    c.wait_event_after(0, back, formed_with(4, 4), DEADLINE);
    assert_finished_exactly(&mut c, LINEAR4, tmp.path(), &[0, 1, 2, 3]);
}

#[test]
fn a_job_starts_with_two_of_three_workers_and_the_third_joins_mid_epoch() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = ["--rendezvous-timeout", "4"];
    // Worker 2's node is down at the start: its first process dies at once and is not restarted;
    // the two others wait at step 50 until it is back.
    let staged = Return::held_for(tmp.path(), 2, &[0, 1], 50);
    let env = staged.env(LINEAR.workers, &[]);
    let mut c = Cluster::start(LINEAR.workers, &args(LINEAR, tmp.path(), &extra), &[], env, RESTART_SEC);
    c.hold(2);
    c.signal(2, libc::SIGKILL);
    c.wait_event(0, formed_with(2, 3), DEADLINE);
    let back = staged.bring_back(&mut c, DEADLINE);
    c.wait_event_after(0, back, formed_with(3, 3), DEADLINE);
    assert_finished_exactly(&mut c, LINEAR, tmp.path(), &[0, 1, 2]);
}

/// Worker `victim` stopped at `point` (its `n`-th visit), then killed for good: the others replace
/// it (electing a new coordinator when it is the chief) and the run is bitwise the full run's.
fn killed_for_good_at(point: &str, n: u32, victim: usize) {
    let tmp = tempfile::tempdir().unwrap();
    let state = voting(tmp.path());
    let extra: Vec<&str> = state.iter().map(String::as_str).collect();
    let mut failpoint = vec![vec![]; LINEAR.workers];
    failpoint[victim] = vec![("TRAINERD_FAILPOINT".to_string(), format!("{point}@{n}"))];
    let mut c = Cluster::start(LINEAR.workers, &args(LINEAR, tmp.path(), &extra), &[], failpoint, RESTART_SEC);
    c.hold(victim);
    c.wait_for(|e| e.worker == victim && e.line() == Some(&format!("trainerd: failpoint {point} reached")), DEADLINE);
    c.signal(victim, libc::SIGKILL);
    let lead = if victim == 0 { 1 } else { 0 };
    c.wait_event(lead, formed_with(2, 3), DEADLINE);
    let survivors: Vec<usize> = (0..LINEAR.workers).filter(|&w| w != victim).collect();
    assert_finished_exactly(&mut c, LINEAR, tmp.path(), &survivors);
}

#[test]
fn a_worker_gone_for_good_in_the_middle_of_an_evaluation() {
    killed_for_good_at("evaluate", 3, 2);
}

#[test]
fn a_worker_gone_for_good_while_a_generation_forms() {
    killed_for_good_at("formed", 1, 2);
}

/// A fresh start sends nothing (every member built the chief's start state), so the state moves
/// here at a return: worker 1 killed and back, joining as before (no catch-up), receives it; worker
/// 2 stops as it moves (the `state-transfer` point, reached by every member of a formation with a
/// receiver) and is killed for good: the others form without it, and the run is the full run's.
#[test]
fn a_worker_gone_for_good_while_the_state_moves() {
    let tmp = tempfile::tempdir().unwrap();
    let state = voting(tmp.path());
    let mut extra: Vec<&str> = state.iter().map(String::as_str).collect();
    extra.extend(["--catch-up-memory", "0"]);
    let mut failpoint = vec![vec![]; LINEAR.workers];
    failpoint[2] = vec![("TRAINERD_FAILPOINT".to_string(), "state-transfer@1".to_string())];
    let mut c = Cluster::start(LINEAR.workers, &args(LINEAR, tmp.path(), &extra), &[], failpoint, RESTART_SEC);
    c.hold(2);
    c.wait_step(1, 10, DEADLINE);
    c.signal(1, libc::SIGKILL);
    c.wait_for(|e| e.worker == 2 && e.line() == Some("trainerd: failpoint state-transfer reached"), DEADLINE);
    c.signal(2, libc::SIGKILL);
    c.wait_event(0, formed_with(2, 3), DEADLINE);
    assert_finished_exactly(&mut c, LINEAR, tmp.path(), &[0, 1]);
}

/// The chief killed for good in the middle of a commit (its data written, its record not): the
/// elected coordinator commits from then on, and the half-written commit never shows.
#[test]
fn the_chief_gone_for_good_in_the_middle_of_a_commit() {
    killed_for_good_at("commit-before-record", 2, 0);
}

/// `trainerd local --no-restart W`: the launcher leaves worker `gone` dead, says so, says who
/// holds its slots once the others go on, and the survivors end with the full run's parameters.
/// `check` sees the launcher once the others went on.
fn local_without(gone: usize, check: impl FnOnce(&mut trainerd_testkit::Worker, &str)) {
    use trainerd_testkit::Worker;
    let tmp = tempfile::tempdir().unwrap();
    let launcher = ["local", "--workers", "3", "--restart-delay", "0", "--no-restart", &gone.to_string()];
    // The launcher gives each worker its own file: s.workerN.json (and its own vote directory).
    let run = args(LINEAR, tmp.path(), &[]).summary(tmp.path().join("s.json"));
    let all: Vec<&str> = [&launcher[..], &run.strs()].concat();
    let mut local = Worker::start(&all);
    let at = |r: &trainerd_testkit::events::Record| {
        r.worker == Some(gone) && matches!(r.event, Event::Step { global_step, .. } if global_step > 30)
    };
    let pid = local.wait_event(at, DEADLINE).pid;
    // SAFETY: kill(2) on a process of this test's launcher.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) }, 0);
    let prefix = format!("trainerd local: worker {gone} died");
    let died = local.wait_line(|l| l.starts_with(&prefix), DEADLINE);
    let coordinator = if gone == 0 { ", electing a new coordinator among them" } else { "" };
    assert_eq!(
        died,
        format!(
            "trainerd local: worker {gone} died (SIGKILL); not restarted (--no-restart): the others go on without it \
             (after --replace-after, when given) if a majority of the workers remains{coordinator}"
        )
    );
    let prefix = format!("trainerd local: worker {gone} gone for ");
    let moved = local.wait_line(|l| l.starts_with(&prefix), DEADLINE);
    assert!(moved.contains(" s: its slots move to the others (worker "), "{moved}");
    assert!(moved.ends_with("; 2 of 3 workers, 0.67x speed"), "{moved}");
    check(&mut local, &moved);
    assert!(local.wait().success());
    let sha = |w: usize| {
        let path = tmp.path().join(format!("s.worker{w}.json"));
        let s: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        s["params_sha256"].as_str().unwrap().to_string()
    };
    for w in (0..3).filter(|&w| w != gone) {
        assert_eq!(sha(w), reference(LINEAR), "worker {w}");
    }
}

/// `trainerd local --no-restart 2`: worker 2's slot moves to worker 1.
#[test]
fn trainerd_local_can_leave_a_worker_dead_and_says_what_happens() {
    local_without(2, |_, moved| assert!(moved.contains(": slot 2); 2 of 3 workers"), "{moved}"));
}

/// `trainerd local --no-restart 0`: the chief stays dead; the launcher gives every worker a vote
/// directory, so workers 1 and 2 elect a coordinator (worker 1, or worker 2 a term later) and go
/// on, worker 1 holding slots 0-1.
#[test]
fn trainerd_local_can_leave_the_chief_dead_and_a_new_coordinator_takes_over() {
    local_without(0, |local, moved| {
        assert!(moved.contains(": slots 0-1, worker 2 (127.0.0.1:"), "{moved}");
        let elected =
            local.wait_line(|l| l.contains("] trainerd: worker ") && l.contains(" coordinates from term "), DEADLINE);
        assert!(elected.contains("elected by 2 of 3"), "{elected}");
    });
}

/// The systemd unit's `RestartSec=`: a killed worker's new process starts 2 s later.
const UNIT_RESTART: Duration = Duration::from_secs(2);

/// `trainerd run` arguments of `job` with the defaults a user gets: no `--replace-after` (the
/// survivors go on at once) and no `--state-dir` (each worker keeps its vote in its default
/// state directory, here under `dir`).
fn at_once(job: Job, dir: &Path) -> (RunArgs, Vec<(String, String)>) {
    (job_args(job, dir), vec![("XDG_STATE_HOME".to_string(), dir.join("state").to_str().unwrap().to_string())])
}

/// Whether `e` is the chief's formation without worker `victim` (2 of 3) or `victim`'s new
/// process starting: whichever comes first says whether the survivors waited for it.
fn short_formation_or_restart(coordinators: &[usize], victim: usize) -> impl Fn(&Entry) -> bool + '_ {
    move |e: &Entry| {
        let formed = coordinators.contains(&e.worker) && e.event().is_some_and(formed_with(2, 3));
        formed || (e.worker == victim && e.what == What::Restarted)
    }
}

/// A worker SIGKILLed and restarted 2 s later, as the unit does: the survivors form a generation
/// without it before its new process starts, it takes its slot back when it returns, and the run
/// is bitwise the failure-free one.
#[test]
fn a_killed_worker_is_not_waited_for_and_takes_its_slot_back_when_it_returns() {
    let tmp = tempfile::tempdir().unwrap();
    let (run, env) = at_once(LINEAR, tmp.path());
    // Killed at the start of step 30; the others wait at step 60 until its restart is back.
    let staged = Return::new(tmp.path(), 2, 30, &[0, 1], 60);
    let mut c = Cluster::start(LINEAR.workers, &run, &env, staged.env(LINEAR.workers, &[]), UNIT_RESTART);
    staged.stop_leaver(&mut c, DEADLINE);
    let killed = c.mark();
    c.signal(2, libc::SIGKILL);
    let first = c.wait_for(short_formation_or_restart(&[0], 2), DEADLINE);
    assert_eq!(first.worker, 0, "the survivors waited for the restart:\n{}", c.transcript());
    staged.release_when_back(&mut c, killed, DEADLINE);
    // Back while the others train, it catches up and nobody receives anything (source none); back
    // while they still re-form (a loaded machine), it receives the state from one of them.
    let (_, joined) = c.wait_event_after(2, killed, |e| matches!(e, Event::Joined { .. }), DEADLINE);
    assert!(matches!(joined, Event::Joined { present: None, source: None | Some(0 | 1), .. }), "{joined:?}");
    assert_finished_exactly(&mut c, LINEAR, tmp.path(), &[0, 1, 2]);
    assert_eq!(summary(tmp.path(), 0)["fault_tolerance"]["steps_lost"].as_u64(), Some(0));
    let replayed = summary(tmp.path(), 2)["fault_tolerance"]["steps_replayed"].as_u64().unwrap();
    assert_eq!(replayed > 0, matches!(joined, Event::Joined { source: None, .. }), "{joined:?}, {replayed} replayed");
}

/// The chief SIGKILLed and restarted 2 s later, with no `--state-dir` (the default state
/// directory keeps the votes): a survivor is elected at once and forms a generation of the two
/// before the chief's new process starts; the chief returns as a member, and the run is bitwise
/// the failure-free one.
#[test]
fn a_killed_chief_is_replaced_at_once_and_returns_as_a_member() {
    let tmp = tempfile::tempdir().unwrap();
    let (run, env) = at_once(LINEAR, tmp.path());
    // Killed at the start of step 30; the others wait at step 60 until its restart is back.
    let staged = Return::new(tmp.path(), 0, 30, &[1, 2], 60);
    let mut c = Cluster::start(LINEAR.workers, &run, &env, staged.env(LINEAR.workers, &[]), UNIT_RESTART);
    staged.stop_leaver(&mut c, DEADLINE);
    let killed = c.mark();
    c.signal(0, libc::SIGKILL);
    let first = c.wait_for(short_formation_or_restart(&[1, 2], 0), DEADLINE);
    assert_ne!(first.worker, 0, "the survivors waited for the chief's restart:\n{}", c.transcript());
    elected_after(&mut c, killed);
    staged.release_when_back(&mut c, killed, DEADLINE);
    let (_, line) = c.wait_line(0, "trainerd: worker 0 ", killed, DEADLINE);
    assert!(line.contains(" coordinates (term ") && line.contains("joining as a member"), "{line}");
    assert_finished_exactly(&mut c, LINEAR, tmp.path(), &[0, 1, 2]);
    let state = std::fs::read_dir(tmp.path().join("state/trainerd")).unwrap().count();
    assert_eq!(state, 1, "one default state directory for the job");
}

/// Four workers with the defaults a user gets, worker 3 killed and held down after step 20: the
/// other three have formed without it. Workers 1 and 2 wait at step 200 until it is back (where
/// they are restarted, [`Return::arm_held`] arms their new processes to wait there too).
fn four_training_while_worker_3_is_held_down(dir: &Path) -> (Cluster, Return) {
    let (run, env) = at_once(LINEAR4, dir);
    let staged = Return::held_for(dir, 3, &[1, 2], 200);
    let mut c = Cluster::start(LINEAR4.workers, &run, &env, staged.env(LINEAR4.workers, &[]), RESTART_SEC);
    c.hold(3);
    wait_for_step(&mut c, LINEAR4, 1, 20);
    c.signal(3, libc::SIGKILL);
    c.wait_event(0, formed_with(3, 4), DEADLINE);
    (c, staged)
}

/// Found by the randomized soak: the chief killed while another worker is held down. The two
/// survivors of four (no majority) wait for the chief's restart, whose new coordinator has never
/// seen the worker held down. Before, it counted that worker gone only a heartbeat deadline (1.5
/// s) after its start, while the survivors were ready; now their joins say their generation was
/// formed without it, and it forms as soon as the three have joined. The pause from the chief's
/// restart to the formation is printed (the closing note gives it before and after).
#[test]
fn a_restarted_chief_forms_at_once_with_the_survivors_while_another_worker_is_held_down() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut c, staged) = four_training_while_worker_3_is_held_down(tmp.path());
    c.signal(0, libc::SIGKILL);
    let restarted = c.wait_for(|e| e.worker == 0 && e.what == What::Restarted, DEADLINE);
    let (formed, joined) = c.wait_event(1, formed_with(3, 4), DEADLINE);
    assert!(matches!(joined, Event::Joined { steps_lost: 0, steps_trained_again: 0, .. }), "{joined:?}");
    println!(
        "elastic: the chief's restart to the formation with worker 3 held down: {:.2} s",
        formed.saturating_duration_since(restarted.at).as_secs_f64()
    );
    staged.bring_back(&mut c, DEADLINE);
    assert_finished_exactly(&mut c, LINEAR4, tmp.path(), &[0, 1, 2, 3]);
}

/// Found by the soak: with worker 3 held down, every other process was killed, so no live state
/// was left and the chief resumed the latest commit. Nobody's join reported a generation, and the
/// coordinator waited the rendezvous timeout (300 s) for worker 3 as at a job's start. The commit
/// names its generation, made without worker 3: the three form at once, and the run, back at the
/// commit, ends bitwise.
#[test]
fn every_process_restarted_while_a_worker_is_held_down_forms_without_it_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut c, staged) = four_training_while_worker_3_is_held_down(tmp.path());
    c.wait_event(0, |e| matches!(e, Event::Committed { .. }), DEADLINE);
    staged.arm_held(&c);
    for rank in 0..3 {
        c.signal(rank, libc::SIGKILL);
    }
    let restarted = c.wait_for(|e| e.worker == 0 && e.what == What::Restarted, DEADLINE);
    c.wait_event(0, |e| matches!(e, Event::Resumed { .. }), DEADLINE);
    let (formed, _) = c.wait_event(0, formed_with(3, 4), DEADLINE);
    let waited = formed.saturating_duration_since(restarted.at);
    assert!(waited < Duration::from_secs(30), "waited {waited:?} for a worker gone before the commit");
    staged.bring_back(&mut c, DEADLINE);
    assert_finished_exactly(&mut c, LINEAR4, tmp.path(), &[0, 1, 2, 3]);
}

/// The chief killed for good, with the README's cluster command (no `--state-dir`, no
/// `--replace-after`): the survivors elect a coordinator, go on, and finish bitwise.
#[test]
fn the_chief_killed_for_good_without_a_state_dir_is_replaced_by_default() {
    let tmp = tempfile::tempdir().unwrap();
    let (run, env) = at_once(LINEAR, tmp.path());
    let mut c = Cluster::start(LINEAR.workers, &run, &env, vec![], RESTART_SEC);
    c.hold(0);
    wait_for_step(&mut c, LINEAR, 1, 40);
    let killed = c.mark();
    c.signal(0, libc::SIGKILL);
    elected_after(&mut c, killed);
    assert_finished_exactly(&mut c, LINEAR, tmp.path(), &[1, 2]);
}

/// Worker `rank` killed near the end and held down until the two others have finished the run
/// (in either order; without the chief, under a coordinator they elect), then back: it exits 0
/// at once, naming the step and commit the run finished at, instead of waiting for a cluster that
/// is gone.
fn returning_after_the_end(rank: usize) {
    let tmp = tempfile::tempdir().unwrap();
    let (run, env) = at_once(LINEAR, tmp.path());
    let mut c = Cluster::start(LINEAR.workers, &run, &env, vec![], RESTART_SEC);
    c.hold(rank);
    wait_for_step(&mut c, LINEAR, 2, 100);
    c.signal(rank, libc::SIGKILL);
    let mut finished = 0;
    while finished < LINEAR.workers - 1 {
        let e = c.wait_for(|e| e.worker != rank && matches!(e.what, What::Finished(_)), DEADLINE);
        assert_eq!(e.what, What::Finished(0), "worker {}:\n{}", e.worker, c.transcript());
        finished += 1;
    }
    let back = c.mark();
    c.bring_back(rank);
    let (_, code) = c.wait_exit(rank, DEADLINE);
    assert_eq!(code, 0, "{}", c.transcript());
    let (_, line) = c.wait_line(rank, "trainerd: the run finished", back, DEADLINE);
    let steps = 2 * LINEAR.steps;
    assert!(line.starts_with(&format!("trainerd: the run finished at step {steps} (commit ")), "{line}");
    assert!(line.ends_with("); nothing left to do"), "{line}");
}

/// A worker back after the run finished: its join gets no answer, and it exits 0.
#[test]
fn a_worker_returning_after_the_end_exits_0_naming_where_the_run_finished() {
    returning_after_the_end(2);
}

/// The chief back after the others finished under a coordinator they elected: it coordinates at
/// its start (the chief, with no term kept) and no member joins it, so it exits 0 the same way
/// (found by `fault_tolerance.rs`'s ten kills, which outlasted a short run: a worker whose kept
/// vote had won a term came back after the end and waited for members that were gone).
#[test]
fn the_chief_returning_after_the_end_exits_0_naming_where_the_run_finished() {
    returning_after_the_end(0);
}

/// A step that only processes that died completed is counted (position records): of 4 workers,
/// worker 2 is stopped inside step 60's all-gather after its second hop, so that workers 0 (the
/// chief) and 1 complete step 60 and workers 2 and 3 do not; the chief, worker 1 and worker 2 are
/// then SIGKILLed together (worker 2, released, would complete the step from its socket's
/// buffer). Worker 3, left alone (no majority), waits for their new processes, which report the
/// position their predecessors recorded, and the formation at step 59 counts step 60 as trained
/// again and lost, as the transcript shows it (before, it counted 0 and 0: nobody alive had
/// reported step 60). The run ends bitwise the failure-free one.
#[test]
fn a_step_only_processes_that_died_completed_is_counted_by_the_formation() {
    let tmp = tempfile::tempdir().unwrap();
    let mut first_env = vec![vec![]; LINEAR4.workers];
    first_env[2] = vec![("TRAINERD_FAILPOINT".to_string(), "all-gather-second@step=60".to_string())];
    let mut c = Cluster::start(LINEAR4.workers, &args(LINEAR4, tmp.path(), &[]), &[], first_env, RESTART_SEC);
    c.wait_line(2, "trainerd: failpoint all-gather-second reached", 0, DEADLINE);
    c.wait_step(0, 60, DEADLINE);
    c.wait_step(1, 60, DEADLINE);
    let killed = c.mark();
    for rank in [0, 1, 2] {
        c.signal(rank, libc::SIGKILL);
    }
    let steps = c.seen()[..killed].iter().filter_map(|e| match e.event() {
        Some(Event::Step { global_step, .. }) => Some(*global_step),
        _ => None,
    });
    let furthest = steps.max().unwrap();
    assert_eq!(furthest, 60);
    let (_, formed) = c.wait_event(3, |e| matches!(e, Event::Joined { .. }), DEADLINE);
    let Event::Joined { global_step, steps_lost, steps_trained_again, .. } = formed else { unreachable!("matched") };
    assert_eq!(global_step, 59, "{}", c.transcript());
    assert_eq!((steps_trained_again, steps_lost), (furthest - global_step, 1), "{}", c.transcript());
    assert_finished_exactly(&mut c, LINEAR4, tmp.path(), &[0, 1, 2, 3]);
}
