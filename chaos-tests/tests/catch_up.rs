//! A worker that comes back while the others train catches up (docs/fault-tolerance.md, "A return
//! that does not pause the survivors"): the coordinator sends it its state and then every step's
//! outputs while training goes on, it replays them, and it takes its slots back with nothing
//! transferred at the switch (with the optimizer state sharded, only its ranges move to it, from
//! its neighbours); past `--catch-up-memory` the return pauses the others as a state transfer,
//! and both sides say so. Every scenario ends with exactly the failure-free run's parameters on
//! all workers.
//!
//! CI budget: about 7 minutes on 2 cores (the 100 MB scenarios and their reference runs dominate).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use trainerd_testkit::{Cluster, Event, Return, RunArgs, What};

const DEADLINE: Duration = Duration::from_secs(300);
const RESTART_SEC: Duration = Duration::from_millis(200);

/// The linear model's wide table at 2.5 M rows: 100 MB of parameters (plain SGD keeps no other
/// state), and 100 MB of gradient in every step's outputs.
const WIDE_100MB: u64 = 2_500_000;

/// A job: the wide table's rows (0: none), the steps of its one epoch, whether it trains with
/// Adam (else plain SGD), whether its gradient is clipped (`--clip-norm`), and whether each
/// parameter is a bucket of its own (`--bucket-mb 0.001`: the bias's bucket is reduced during the
/// backward pass, the weight's, which carries the step's tail, after it).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Job {
    wide: u64,
    steps: u64,
    adam: bool,
    clip: bool,
    buckets: bool,
}

const WIDE: Job = Job { wide: WIDE_100MB, steps: 40, adam: false, clip: false, buckets: false };
const SMALL: Job = Job { wide: 0, steps: 150, adam: false, clip: false, buckets: false };
/// 100 MB of state with Adam: 33 MB of parameters and twice that of moments.
const WIDE_ADAM: Job = Job { wide: WIDE_100MB / 3, steps: 40, adam: true, clip: false, buckets: false };
/// The small job with Adam and its gradient clipped, a parameter a bucket: a clip whose factor is
/// over the whole gradient, whose buckets come before the norm.
const SMALL_CLIPPED: Job = Job { wide: 0, steps: 150, adam: true, clip: true, buckets: true };
/// The small job with Adam, a parameter a bucket.
const SMALL_BUCKETS: Job = Job { wide: 0, steps: 150, adam: true, clip: false, buckets: true };
/// The same, long enough that a worker killed after the return is back before the run ends (one
/// back after the end of a run that commits nothing would wait for a cluster that is gone).
const LONG_BUCKETS: Job = Job { steps: 600, ..SMALL_BUCKETS };

/// `trainerd run` arguments of `job` on 3 workers, each worker's summary in `dir`, with `extra`.
fn args(job: Job, dir: &Path, extra: &[&str]) -> RunArgs {
    let run = RunArgs::new("linear").epochs(1).steps(job.steps).threads(1).seed(5).batch(32);
    let run = if job.wide > 0 { run.plugin_arg(format!("wide={}", job.wide)) } else { run };
    let run = if job.adam { run.optimizer("adam", 0.001) } else { run };
    let run = if job.clip { run.set("--clip-norm", 0.05) } else { run };
    let run = if job.buckets { run.set("--bucket-mb", 0.001) } else { run };
    run.summary(dir.join("summary.{rank}.json")).extend(extra)
}

fn summary(dir: &Path, rank: usize) -> serde_json::Value {
    let path = dir.join(format!("summary.{rank}.json"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

/// The failure-free run's `params_sha256` (computed once per job).
fn reference(job: Job) -> String {
    static CACHE: OnceLock<Mutex<HashMap<Job, String>>> = OnceLock::new();
    let mut cache = CACHE.get_or_init(Mutex::default).lock().unwrap();
    if let Some(sha) = cache.get(&job) {
        return sha.clone();
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut c = Cluster::start(3, &args(job, tmp.path(), &[]), &[], vec![], RESTART_SEC);
    assert_eq!(c.wait_finished(DEADLINE), vec![0; 3], "{}", c.transcript());
    let sha = summary(tmp.path(), 0)["params_sha256"].as_str().unwrap().to_string();
    cache.insert(job, sha.clone());
    sha
}

/// Every worker exited 0 with the failure-free run's parameters.
fn assert_bitwise(c: &mut Cluster, job: Job, dir: &Path) {
    assert_eq!(c.wait_finished(DEADLINE), vec![0; 3], "{}", c.transcript());
    let expected = reference(job);
    for rank in 0..3 {
        assert_eq!(summary(dir, rank)["params_sha256"], expected.as_str(), "worker {rank}\n{}", c.transcript());
    }
}

/// `job` on 3 workers with `extra` flags and the failpoints `also` (a worker's, released by its
/// [`Return::release_file`]), staged for a return: worker 2 stops at the start of step `step`
/// and is killed there, the two others form a generation without it, train `then` steps in it,
/// and wait there until the chief says it came back to catch up, whatever the build's speed (a
/// release build trains the small jobs' remaining steps before a restarted worker has loaded
/// libtorch). Every process logs its service's requests (a donor's line that a returner asks for
/// its ranges).
fn start_for_a_return(
    job: Job,
    dir: &Path,
    extra: &[&str],
    (step, then): (u64, u64),
    also: &[(usize, &str)],
) -> (Cluster, Return) {
    let staged = Return::new(dir, 2, step, &[0, 1], step + then);
    let log = [("TRAINERD_LOG".to_string(), "warn,trainerd::cluster::service=info".to_string())];
    let c = Cluster::start(3, &args(job, dir, extra), &log, staged.env(3, also), RESTART_SEC);
    (c, staged)
}

/// Worker 2 killed where `staged` stops it and held down until the two others have formed a
/// generation without it and reached their hold; then it comes back, and they go on once the
/// chief says it came back to catch up. The mark before it came back.
fn back_while_they_train(c: &mut Cluster, staged: &Return) -> usize {
    c.hold(2);
    staged.stop_leaver(c, DEADLINE);
    c.signal(2, libc::SIGKILL);
    c.wait_event(0, |e| matches!(e, Event::Joined { present: Some(2), .. }), DEADLINE);
    staged.bring_back(c, DEADLINE)
}

/// The number before `after` in `line` (`12 step(s) replayed` with `after` = " step(s) replayed").
fn number_before(line: &str, after: &str) -> u64 {
    let head = &line[..line.find(after).unwrap_or_else(|| panic!("{after:?} in {line:?}"))];
    head.rsplit(' ').next().unwrap().parse().unwrap_or_else(|e| panic!("{line:?}: {e}"))
}

/// The longest gap between two of worker `rank`'s steps seen after `mark`, and the median one
/// before it.
fn gaps(c: &Cluster, rank: usize, mark: usize) -> (Duration, Duration) {
    let steps: Vec<(usize, Instant)> = c
        .seen()
        .iter()
        .enumerate()
        .filter(|(_, e)| e.worker == rank && matches!(e.what, What::Event(Event::Step { .. })))
        .map(|(i, e)| (i, e.at))
        .collect();
    let between: Vec<(usize, Duration)> = steps.windows(2).map(|w| (w[1].0, w[1].1 - w[0].1)).collect();
    let longest = between.iter().filter(|(i, _)| *i >= mark).map(|(_, d)| *d).max().unwrap_or_default();
    let mut before: Vec<Duration> = between.iter().filter(|(i, _)| *i < mark).map(|(_, d)| *d).collect();
    before.sort();
    (longest, before.get(before.len() / 2).copied().unwrap_or_default())
}

/// 100 MB of state: worker 2 killed, and back while the two others train. It catches up from the
/// chief (its state, then every step's outputs, replayed), takes its slots back after a step
/// every member ends at, and the generation that follows forms with nobody receiving anything
/// (every member held the state: the joins' lineage digests are equal, nobody hashed 100 MB);
/// the run is bitwise the failure-free one, and the summaries count the steps replayed and the
/// outputs the chief kept. The survivors' longest gap around the return is printed beside their
/// median step (`bench/recovery.sh --state-mb` measures it on the release build).
#[test]
fn a_worker_back_while_the_others_train_catches_up_and_takes_its_slots_back_with_nothing_sent() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut c, staged) = start_for_a_return(WIDE, tmp.path(), &[], (5, 2), &[]);
    let back = back_while_they_train(&mut c, &staged);
    let replayed = assert_caught_up_with_nothing_sent(&mut c, WIDE, tmp.path(), back);
    assert_eq!(updated_by_range(&mut c, back), replayed, "each update ran range by range as the gradient came");
    let returner = &summary(tmp.path(), 2)["fault_tolerance"];
    assert_eq!(returner["steps_replayed"].as_u64(), Some(replayed));
    assert!(returner["catch_up_seconds"].as_f64().is_some_and(|s| s > 0.0), "{returner}");
    let kept = summary(tmp.path(), 0)["fault_tolerance"]["catch_up_kept_bytes"].as_u64().unwrap();
    assert!(kept >= 100_000_000, "at least one step's 100 MB of gradient was kept: {kept}");
}

/// The same return with the optimizer state and the gradients sharded (`--shard gradients`, Adam,
/// 100 MB of state: the gradients let go once reduce-scattered, the 100 MB matrix's staged and
/// gathered in its own memory):
/// the chief sends the parameters and buffers at a step, then the parameters after every step
/// (no member holds a step's averaged gradient whole), and the returner takes them; the member
/// that owns the ranges the returner will hold streams their state, then each step's clipped
/// gradient of them, and the returner stores each step as a buddy does (docs/fault-tolerance.md,
/// "Ranges streamed"). At the switch nobody receives a model and nothing of the optimizer state
/// moves: the reshard finds the returner holding its ranges at the others' step (their digests
/// equal to the owners' copies, or the formation would have sent everyone back). Bitwise the
/// failure-free run, unsharded.
#[test]
fn a_sharded_worker_back_while_the_others_train_catches_up_and_takes_only_its_ranges() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let sharded = ["--shard", "gradients", "--checkpoint-dir", ckpt.to_str().unwrap()];
    let (mut c, staged) = start_for_a_return(WIDE_ADAM, tmp.path(), &sharded, (5, 2), &[]);
    let back = back_while_they_train(&mut c, &staged);
    let replayed = assert_caught_up_with_nothing_sent(&mut c, WIDE_ADAM, tmp.path(), back);
    assert_eq!(updated_by_range(&mut c, back), 0, "a sharded step's parameters are taken, not updated");
    assert_eq!(summary(tmp.path(), 2)["fault_tolerance"]["steps_replayed"].as_u64(), Some(replayed));
    let (_, caught) = c.wait_line(2, "trainerd: caught up in ", back, DEADLINE);
    let switch: u64 = caught.rsplit(' ').next().unwrap().parse().unwrap_or_else(|e| panic!("{caught}: {e}"));
    let streamed = c.lines_of(2, "trainerd: catching up: 4 range(s) of the optimizer state it will hold came from ");
    let at = format!(" member(s) and are at step {switch} (44.5 MB)");
    assert!(streamed.len() == 1 && streamed[0].ends_with(&at), "{streamed:?} (the switch after step {switch})");
    let sent = c.lines_of(1, "trainerd: worker 2 (");
    let takes =
        ") takes the 4 range(s) of the optimizer state it will hold that this worker owns (44.5 MB, after step ";
    assert!(sent.iter().any(|l| l.contains(takes) && l.ends_with("), then each step's gradient of them")), "{sent:?}");
    for rank in 0..3 {
        let (_, moved) =
            c.wait_line(rank, "trainerd: the sharded optimizer state moved to generation ", back, DEADLINE);
        assert!(moved.contains("; it received 0.0 MB from its own copies and its neighbours' ("), "{moved}");
        assert!(moved.contains("holds 2 range(s) and a buddy copy of 2, 44.5 MB"), "{moved}");
    }
    let kept = summary(tmp.path(), 0)["fault_tolerance"]["catch_up_kept_bytes"].as_u64().unwrap();
    assert!(kept >= 33_000_000, "at least one step's 33 MB of parameters was kept: {kept}");
}

/// The member that streams a sharded returner's ranges (worker 1: it holds the returner's slot
/// meanwhile, the chief streams the model) killed during the catch-up: the generation ends, the
/// chief stops the catch-up, and the returner drops its state and its ranges and joins as before.
/// Every range survives in a buddy copy, so 0 steps are lost, and the run ends bitwise the
/// failure-free one.
#[test]
fn a_sharded_returners_range_donor_lost_mid_stream_stops_its_catch_up_and_loses_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let sharded = ["--shard-optimizer", "--checkpoint-dir", ckpt.to_str().unwrap()];
    let (mut c, staged) = start_for_a_return(WIDE_ADAM, tmp.path(), &sharded, (5, 2), &[]);
    let back = back_while_they_train(&mut c, &staged);
    let asks = |l: &str| l.contains("worker 2 (") && l.ends_with(") asks for the ranges it will hold");
    c.wait_for(|e| e.worker == 1 && e.line().is_some_and(asks), DEADLINE);
    c.signal(1, libc::SIGKILL);
    let (_, said) = c.wait_line(2, "trainerd: the catch-up stopped: ", back, DEADLINE);
    assert_bitwise(&mut c, WIDE_ADAM, tmp.path());
    let joined = c.joined_after(back);
    let returner = joined.iter().find(|(rank, _)| *rank == 2);
    assert!(matches!(returner, Some((_, Event::Joined { steps_lost: 0, .. }))), "{joined:?}");
    println!("the returner: {said}");
}

/// A return in a run whose gradient is clipped (`--clip-norm`, Adam), whose clip's factor is over
/// the whole gradient: the chief sends each step's gradient as its clipping left it, and the
/// returner runs the optimizer's rule on it range by range as it arrives, as without clipping;
/// the bucket that came before the norm (the chief's backward pass reduced it) is held, then
/// clipped and updated once the norm comes. It catches up, and the run is bitwise the
/// failure-free one.
#[test]
fn a_clipped_run_catches_up_updating_range_by_range_from_the_gradient_clipped_by_the_chief() {
    assert_each_bucket_sent_first(SMALL_CLIPPED);
}

/// A return in a run of several buckets (`--bucket-mb`): the chief sends the returner each bucket
/// as its reducing thread ends it during the backward pass, before the step's other outputs, and
/// the returner updates that bucket's parameters as it comes. It catches up, and the run is
/// bitwise the failure-free one.
#[test]
fn a_return_in_a_run_of_several_buckets_takes_each_as_the_chiefs_backward_pass_reduces_it() {
    assert_each_bucket_sent_first(SMALL_BUCKETS);
}

/// Worker 2 back while the others train `job` (a parameter a bucket): it catches up, each step's
/// update run range by range as its gradient came, and every step after the state's bucket sent
/// before the step's outputs; the run ends bitwise the failure-free one.
fn assert_each_bucket_sent_first(job: Job) {
    let tmp = tempfile::tempdir().unwrap();
    let (mut c, staged) = start_for_a_return(job, tmp.path(), &[], (20, 5), &[]);
    let back = back_while_they_train(&mut c, &staged);
    let replayed = assert_caught_up_with_nothing_sent(&mut c, job, tmp.path(), back);
    assert_eq!(updated_by_range(&mut c, back), replayed, "each update ran range by range as the gradient came");
    assert_eq!(buckets_sent(&mut c, back), replayed - 1, "every step after the state's sent its bucket first");
}

/// Worker 1 killed while the chief, feeding a returner, has sent it the first bucket of a step
/// and goes on with that step (the chief is held just after sending it): the chief's step fails,
/// its generation ends and the catch-up with it; the returner, holding a step half taken, drops
/// its state and joins as before, receiving one. Nothing is lost, and the run ends bitwise the
/// failure-free one.
#[test]
fn a_member_lost_after_a_bucket_went_to_a_returner_stops_its_catch_up_and_loses_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut c, staged) = start_for_a_return(LONG_BUCKETS, tmp.path(), &[], (20, 5), &[(0, "bucket-sent@1")]);
    let back = back_while_they_train(&mut c, &staged);
    c.wait_line(0, "trainerd: failpoint bucket-sent reached", back, DEADLINE);
    c.signal(1, libc::SIGKILL);
    std::fs::write(staged.release_file(0), b"").unwrap();
    let (_, said) = c.wait_line(2, "trainerd: the catch-up stopped: ", back, DEADLINE);
    assert!(said.ends_with(" half taken: its first buckets came); joining with a pause"), "{said}");
    assert_bitwise(&mut c, LONG_BUCKETS, tmp.path());
    let stopped = c.lines_of(0, "trainerd: worker 2 (");
    assert!(stopped.iter().any(|l| l.contains("'s catch-up stopped: generation ")), "{stopped:?}");
    println!("the returner: {said}\nthe chief: {}", stopped.join("\n"));
    let joined = c.joined_after(back);
    let returner = joined.iter().find(|(rank, _)| *rank == 2);
    assert!(matches!(returner, Some((_, Event::Joined { source: Some(0 | 1), steps_lost: 0, .. }))), "{joined:?}");
}

/// The run finishing while worker 2, back, catches up, in a run that commits nothing (no commit
/// can show it the end): the chief tells it the run finished, and it exits 0 at once saying so,
/// instead of joining a cluster that is gone and waiting for it. Once with its request still
/// waiting at the last step (the survivors held before it), once with its replay under way (held
/// before the step before: the chief's snapshot is taken at the last step, whose outputs follow).
/// The survivors end bitwise the failure-free run.
#[test]
fn a_returner_the_run_finishes_without_is_told_so_and_exits_0() {
    for (held_before, replaying) in [(SMALL.steps, false), (SMALL.steps - 1, true)] {
        let tmp = tempfile::tempdir().unwrap();
        let staged = Return::held_for(tmp.path(), 2, &[0, 1], held_before);
        let mut c = Cluster::start(3, &args(SMALL, tmp.path(), &[]), &[], staged.env(3, &[]), RESTART_SEC);
        c.hold(2);
        c.wait_step(0, 20, DEADLINE);
        c.signal(2, libc::SIGKILL);
        c.wait_for(|e| e.worker == 2 && matches!(e.what, What::Died(_)), DEADLINE);
        // The survivors go on once the chief says it came back to catch up.
        let back = staged.bring_back(&mut c, DEADLINE);
        let codes = c.wait_finished(DEADLINE);
        let transcript = c.transcript();
        assert_eq!(codes, vec![0; 3], "{transcript}");
        assert!(!transcript.contains("panicked at"), "{transcript}");
        let told = c.lines_of(0, "trainerd: worker 2 (");
        let last = SMALL.steps;
        assert!(told
            .iter()
            .any(|l| l.ends_with(&format!(") is told the run finished at step {last}, as it catches up"))));
        let (_, said) = c.wait_line(2, "trainerd: the run finished at step ", back, DEADLINE);
        let how = match replaying {
            true => format!("while this worker caught up (the coordinator said so; its replay reached step {last})"),
            false => "as this worker came back (the coordinator said so)".to_string(),
        };
        assert_eq!(said, format!("trainerd: the run finished at step {last} {how}; nothing left to do"));
        assert_eq!(c.lines_of(2, "trainerd: catching up: the state at step ").len(), usize::from(replaying));
        for rank in [0, 1] {
            assert_eq!(summary(tmp.path(), rank)["params_sha256"], reference(SMALL).as_str(), "worker {rank}");
        }
        println!("held before step {held_before}: the chief: {}\nthe returner: {said}", told.join("\n"));
    }
}

/// How many buckets worker 2's catch-up after line `back` took as the chief's backward pass
/// reduced them (its `caught up` line).
fn buckets_sent(c: &mut Cluster, back: usize) -> u64 {
    let (_, caught) = c.wait_line(2, "trainerd: caught up in ", back, DEADLINE);
    number_before(&caught, " bucket(s) sent as the donor's backward pass reduced them")
}

/// How many of the steps worker 2 replayed in its catch-up after line `back` it updated range by
/// range as their pieces came (its `caught up` line).
fn updated_by_range(c: &mut Cluster, back: usize) -> u64 {
    let (_, caught) = c.wait_line(2, "trainerd: caught up in ", back, DEADLINE);
    let Some(head) = caught.split(" updated range by range as their pieces came").nth(1).map(|_| &caught) else {
        return 0;
    };
    let count = head.split(" step(s) replayed (").nth(1).and_then(|r| r.split(' ').next());
    count.and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("a count of steps updated by range in {caught:?}"))
}

/// Worker 2, back after `back`, caught up and took its slots back with nothing sent at the
/// switch, and the run ended bitwise the failure-free `job`'s: the steps it replayed.
fn assert_caught_up_with_nothing_sent(c: &mut Cluster, job: Job, dir: &Path, back: usize) -> u64 {
    let (_, caught) = c.wait_line(2, "trainerd: caught up in ", back, DEADLINE);
    let replayed = number_before(&caught, " step(s) replayed");
    assert!(replayed >= 1, "{caught}");
    assert_bitwise(c, job, dir);
    // The generation formed with it: nobody received a state (every join said the same lineage).
    let joined = c.joined_after(back);
    assert_eq!(joined.iter().map(|(rank, _)| *rank).collect::<Vec<_>>(), [0, 1, 2], "{joined:?}");
    for (rank, joined) in &joined {
        assert!(matches!(joined, Event::Joined { source: None, steps_lost: 0, .. }), "worker {rank}: {joined:?}");
    }
    let formed = c.lines_of(0, "trainerd: generation ");
    let after = formed.iter().skip_while(|l| !l.contains(" came back: it takes its slots back")).nth(1);
    assert!(after.is_some_and(|l| l.ends_with("state every member held it")), "{formed:?}");
    let said = c.lines_of(0, "trainerd: worker 2 (");
    assert!(said.iter().any(|l| l.contains(") catches up: sending the state at step ")), "{said:?}");
    assert!(said.iter().any(|l| l.contains(") caught up: it takes its slots back after step ")), "{said:?}");
    let (longest, step) = gaps(c, 0, back);
    println!("survivors' longest gap around the return: {longest:?} (median step before: {step:?})");
    replayed
}

/// A bound no step's outputs fit under (`--catch-up-memory 1K`): the chief stops the catch-up at
/// the first step and says why, the returner says it joins with a pause, receives the state at
/// the formation as before, and the run is bitwise the failure-free one.
#[test]
fn a_return_past_the_memory_bound_pauses_the_others_and_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut c, staged) = start_for_a_return(SMALL, tmp.path(), &["--catch-up-memory", "1K"], (20, 5), &[]);
    let back = back_while_they_train(&mut c, &staged);
    // Its formation's line follows the catch-up's end, or a refusal of it (said, and not expected).
    c.wait_line(2, "trainerd: generation ", back, DEADLINE);
    let refused = c.lines_of(2, "trainerd: no catch-up: ");
    assert!(refused.is_empty(), "{refused:?}");
    c.wait_line(2, "trainerd: the catch-up stopped: ", back, DEADLINE);
    assert_bitwise(&mut c, SMALL, tmp.path());
    let joined = c.joined_after(back);
    let returner = joined.iter().find(|(rank, _)| *rank == 2);
    assert!(matches!(returner, Some((_, Event::Joined { source: Some(0 | 1), present: None, .. }))), "{joined:?}");
    let said = c.lines_of(0, "trainerd: worker 2 (");
    let stopped = said.iter().find(|l| l.contains("'s catch-up stopped: ")).unwrap_or_else(|| panic!("{said:?}"));
    assert!(
        stopped.contains("'s catch-up stopped: its kept outputs would take ")
            && stopped.ends_with(", above --catch-up-memory 1.0 KB; it takes its slots back with a pause"),
        "{stopped}"
    );
    let (_, said) = c.wait_line(2, "trainerd: the catch-up stopped: ", back, DEADLINE);
    assert!(said.ends_with("above --catch-up-memory 1.0 KB; joining with a pause"), "{said}");
    assert_eq!(summary(tmp.path(), 2)["fault_tolerance"]["steps_replayed"].as_u64(), Some(0));
}
