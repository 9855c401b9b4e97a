//! Network partitions, for real: each worker runs in a network namespace of its own, wired to one
//! bridge that this test makes (as root); a cut takes a worker's port down, so its packets are
//! dropped and its peers see only silence. A generation forms only with a majority of TF_CONFIG's
//! workers, so a minority never trains; a coordinator is elected only by a majority, so a chief
//! cut off alone is replaced on the majority's side and never trains alone; only one side
//! commits; and when the link heals, everyone rejoins and the model is bit for bit the
//! failure-free run's. Each worker keeps its vote in its own state directory and commits to its
//! own checkpoint directory (local disks).

use std::path::Path;
use std::time::Duration;

use trainerd_testkit::{Cluster, Event, Netns, RunArgs};

const DEADLINE: Duration = Duration::from_secs(240);
const RESTART_SEC: Duration = Duration::from_millis(200);
const WORKERS: usize = 3;
/// 3 epochs of 600 steps of batch 16: long enough that the majority cannot finish before the healed
/// side is back, even on a loaded machine (a cut worker's reconnection takes a few seconds).
const STEPS: u64 = 600;

fn args(dir: &Path) -> RunArgs {
    RunArgs::new("linear")
        .epochs(3)
        .steps(STEPS)
        .batch(16)
        .threads(1)
        .seed(9)
        .summary(dir.join("summary.{rank}.json"))
        .checkpoints(dir.join("ckpt.{rank}"), 20)
        .set("--replace-after", 3)
        .set("--state-dir", dir.join("state.{rank}").to_str().unwrap())
}

/// [`args`] with a cluster secret (required off loopback).
fn secured(dir: &Path) -> RunArgs {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join("secret");
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).unwrap();
    std::io::Write::write_all(&mut f, b"4f1d2c3b4a5968778695a4b3c2d1e0f00112233445566778899aabbccddeeff").unwrap();
    args(dir).set("--secret-file", path.to_str().unwrap())
}

fn summary(dir: &Path, rank: usize) -> serde_json::Value {
    let path = dir.join(format!("summary.{rank}.json"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

/// The failure-free run's parameters (on loopback).
fn reference() -> String {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = Cluster::start(WORKERS, &args(tmp.path()), &[], vec![], RESTART_SEC);
    assert_eq!(c.wait_finished(DEADLINE), vec![0; WORKERS], "{}", c.transcript());
    summary(tmp.path(), 0)["params_sha256"].as_str().unwrap().to_string()
}

fn namespaces() -> Netns {
    Netns::create(WORKERS).unwrap_or_else(|e| {
        panic!("this test partitions its workers in network namespaces it makes, as root, with `ip`: {e}")
    })
}

/// What worker `rank` trained between transcript marks `from` and `to`, after it abandoned its
/// generation there: the steps it completed from the one it abandoned on, and the generations it
/// joined. (Steps before the one abandoned are the last ones before the cut, arriving late.)
fn trained_after_abandoning(c: &Cluster, rank: usize, from: usize, to: usize) -> (Vec<u64>, Vec<u64>) {
    let events: Vec<&Event> = c.seen[from..to].iter().filter(|e| e.worker == rank).filter_map(|e| e.event()).collect();
    let abandoned = events.iter().find_map(|e| match e {
        Event::Abandoned { step, .. } => Some(*step),
        _ => None,
    });
    let abandoned =
        abandoned.unwrap_or_else(|| panic!("worker {rank} never abandoned its generation\n{}", c.transcript()));
    let steps = events
        .iter()
        .filter_map(|e| match e {
            Event::Step { global_step, .. } if *global_step >= abandoned => Some(*global_step),
            _ => None,
        })
        .collect();
    let joined = events
        .iter()
        .filter_map(|e| match e {
            Event::Joined { generation, .. } => Some(*generation),
            _ => None,
        })
        .collect();
    (steps, joined)
}

/// Commits in worker `rank`'s checkpoint directory.
fn commits(dir: &Path, rank: usize) -> usize {
    let out = trainerd_testkit::trainerd_cmd()
        .args(["ckpt", "list", dir.join(format!("ckpt.{rank}")).to_str().unwrap()])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.trim_start().starts_with(char::is_numeric)).count()
}

#[test]
fn a_minority_cut_off_never_trains_the_majority_goes_on_and_after_healing_all_end_bitwise_equal() {
    let expected = reference();
    let net = namespaces();
    let tmp = tempfile::tempdir().unwrap();
    let mut c = Cluster::start_in(&net, WORKERS, &secured(tmp.path()), RESTART_SEC);
    c.wait_step(0, 30, DEADLINE);
    // Worker 2 alone on one side, the chief and worker 1 on the other.
    net.cut(2);
    let cut = c.mark();
    c.wait_event(0, |e| matches!(e, Event::Joined { present: Some(2), .. }), DEADLINE);
    let chief_step = |c: &Cluster| {
        c.seen.iter().rev().find_map(|e| match (e.worker, e.event()) {
            (0, Some(Event::Step { global_step, .. })) => Some(*global_step),
            _ => None,
        })
    };
    let before = chief_step(&c).unwrap();
    c.wait_step(0, before + 40, DEADLINE);
    let healed = c.mark();
    // The majority trained on; the minority did not take a single step.
    assert!(chief_step(&c).unwrap() >= before + 40);
    let minority = trained_after_abandoning(&c, 2, cut, healed);
    assert_eq!(minority, (vec![], vec![]), "worker 2 trained while cut off (steps, generations)\n{}", c.transcript());
    net.heal(2);
    c.wait_event(0, |e| matches!(e, Event::Joined { present: None, .. }), DEADLINE);
    assert_eq!(c.wait_finished(DEADLINE), vec![0; WORKERS], "{}", c.transcript());
    for rank in 0..WORKERS {
        assert_eq!(summary(tmp.path(), rank)["params_sha256"], expected.as_str(), "worker {rank}\n{}", c.transcript());
    }
    // Only the chief commits; worker 2, cut off alone, never stood (a pre-vote it could not win
    // raises no term), so the chief went on coordinating when it came back.
    assert!(commits(tmp.path(), 0) > 0);
    assert_eq!((commits(tmp.path(), 1), commits(tmp.path(), 2)), (0, 0));
    assert!(!c.transcript().contains("coordinates from term"), "{}", c.transcript());
}

#[test]
fn a_chief_cut_off_alone_never_trains_the_majority_elects_a_coordinator_and_only_it_commits() {
    let expected = reference();
    let net = namespaces();
    let tmp = tempfile::tempdir().unwrap();
    let mut c = Cluster::start_in(&net, WORKERS, &secured(tmp.path()), RESTART_SEC);
    c.wait_step(0, 30, DEADLINE);
    net.cut(0);
    let cut = c.mark();
    // Workers 1 and 2, a majority, elect worker 1 after --replace-after and train on; the chief,
    // 1 of 3, can neither form a generation nor win a vote.
    let (elected, _, line) = c.wait_line_of(|r| r != 0, "trainerd: worker ", cut, DEADLINE);
    assert!(line.contains(" coordinates from term ") && line.contains("elected by 2 of 3"), "{line}");
    let (_, line) = c.wait_line(elected, "trainerd: generation ", cut, DEADLINE);
    assert!(line.contains("; 2 of 3 workers ("), "{line}");
    let commits_cut = commits(tmp.path(), 0);
    let step = |c: &Cluster, rank: usize| {
        c.seen.iter().rev().find_map(|e| match (e.worker, e.event()) {
            (w, Some(Event::Step { global_step, .. })) if w == rank => Some(*global_step),
            _ => None,
        })
    };
    let before = step(&c, elected).unwrap();
    c.wait_step(elected, before + 50, DEADLINE);
    let healed = c.mark();
    let chief = trained_after_abandoning(&c, 0, cut, healed);
    assert_eq!(chief, (vec![], vec![]), "the chief trained while cut off (steps, generations)\n{}", c.transcript());
    // Only the majority's side committed during the partition (to its coordinator's own directory;
    // worker 1 stands first, worker 2 a term later if worker 1's votes came late).
    assert_eq!(commits(tmp.path(), 0), commits_cut, "the chief committed while cut off");
    assert!(commits(tmp.path(), elected) > 0, "the new coordinator committed nothing");
    net.heal(0);
    let (_, member) = c.wait_line(0, "trainerd: worker 0 ", healed, DEADLINE);
    assert!(member.contains(" coordinates (term ") && member.contains("joining as a member"), "{member}");
    assert_eq!(c.wait_finished(DEADLINE), vec![0; WORKERS], "{}", c.transcript());
    for rank in 0..WORKERS {
        assert_eq!(summary(tmp.path(), rank)["params_sha256"], expected.as_str(), "worker {rank}\n{}", c.transcript());
    }
    assert_eq!(commits(tmp.path(), 3 - elected), 0, "only the coordinator commits");
}
