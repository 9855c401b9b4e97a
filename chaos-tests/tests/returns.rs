//! A process that joins a generation lands wherever the others are: the run's first step, a step,
//! an epoch's end (its comparison, evaluation and commit), the run's end (the last epoch's end,
//! the last commit and the final barrier), the final barrier itself, or after the run ended. For
//! each place, with the optimizer state plain and sharded, for a worker and for the chief, with
//! one shared checkpoint location and with each worker's own (node-local, where the coordinator
//! gathers a sharded commit and writes it alone): the run ends bitwise the failure-free one, every
//! process exits 0, and none panics (docs/fault-tolerance.md, "Returns, wherever they land"). The
//! chief restarted during a sharded run's last steps, with node-local locations, panicked in the
//! epoch's end commit before (2026-11-28).
//!
//! A plain return (`--catch-up-memory 0`; catch-up's own tests are `catch_up.rs`) places the
//! landing: the returner is held down, the survivors are held by a failpoint before the place,
//! the returner is brought back, and the survivors are released once the coordinator has its
//! join (its `asks to join` debug line, or its `came back` line).
//!
//! CI budget: 48 runs of 3 workers of the linear plugin (60 steps each) and one reference, about
//! four minutes on 2 cores.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use trainerd_testkit::{Cluster, Event, RunArgs, What};

const DEADLINE: Duration = Duration::from_secs(240);
const RESTART_SEC: Duration = Duration::from_millis(200);
const WORKERS: usize = 3;
/// Steps per epoch; the run has 2 epochs.
const STEPS: u64 = 30;
const LAST: u64 = 2 * STEPS;

/// Where the returner lands: the first thing the generation it joins does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// The run's first step: it joins the formation at step 0.
    FirstStep,
    /// A step in the middle of an epoch.
    Step,
    /// The first epoch's end: comparison, evaluation, commit.
    EpochEnd,
    /// The run's end: the last epoch's end, then the last comparison, commit and barrier.
    RunEnd,
    /// The final barrier, where the others wait.
    FinalBarrier,
    /// After every other process exited.
    AfterEnd,
}

/// Where the checkpoints go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Location {
    /// One directory every worker reaches.
    Shared,
    /// A directory per worker, as on each node's own disk.
    NodeLocal,
}

/// The run: linear on 3 workers, 2 epochs of 30 steps, commits every 10 steps, plain returns.
fn args(dir: &Path, sharded: bool, location: Location) -> RunArgs {
    let ckpt = match location {
        Location::Shared => dir.join("ckpt"),
        Location::NodeLocal => dir.join("ckpt.{rank}"),
    };
    let run = RunArgs::new("linear")
        .epochs(2)
        .steps(STEPS)
        .threads(1)
        .seed(7)
        .optimizer("adam", 0.001)
        .summary(dir.join("summary.{rank}.json"))
        .checkpoints(ckpt, 10)
        .set("--catch-up-memory", 0);
    if sharded {
        run.on("--shard-optimizer")
    } else {
        run
    }
}

fn summary(dir: &Path, rank: usize) -> serde_json::Value {
    let path = dir.join(format!("summary.{rank}.json"));
    std::fs::read_to_string(&path).map(|s| serde_json::from_str(&s).unwrap()).unwrap_or(serde_json::Value::Null)
}

/// The failure-free run's parameters (sharded or not, the same bits).
fn reference() -> &'static str {
    static REFERENCE: OnceLock<String> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let mut c = Cluster::start(WORKERS, &args(tmp.path(), false, Location::Shared), &[], vec![], RESTART_SEC);
        assert_eq!(c.wait_finished(DEADLINE), vec![0; WORKERS], "{}", c.transcript());
        summary(tmp.path(), 0)["params_sha256"].as_str().unwrap().to_string()
    })
}

/// The environment of worker `rank`'s first process: the coordinator's joins logged, and `point`
/// armed with its own release file in `dir`.
fn armed(dir: &Path, rank: usize, point: Option<&str>) -> Vec<(String, String)> {
    let mut env = vec![("TRAINERD_LOG".to_string(), "warn,trainerd::cluster::coordinator=debug".to_string())];
    if let Some(point) = point {
        env.push(("TRAINERD_FAILPOINT".to_string(), point.to_string()));
        env.push(("TRAINERD_FAILPOINT_RELEASE".to_string(), release(dir, rank).to_str().unwrap().to_string()));
    }
    env
}

fn release(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("release.{rank}"))
}

/// Lets worker `rank` past its held failpoint.
fn let_go(dir: &Path, rank: usize) {
    std::fs::write(release(dir, rank), b"").unwrap();
}

/// The failpoint that holds the survivors before `place`, if any.
fn hold_before(place: Place) -> Option<String> {
    match place {
        // Before step 1; the returner, killed there, too.
        Place::FirstStep => Some("train-step@step=1".into()),
        // The return flag rides the step after the one they are held before: it ends the
        // generation after that step, which is the place's.
        Place::Step => Some(format!("train-step@step={}", STEPS / 2)),
        Place::EpochEnd => Some(format!("train-step@step={}", STEPS - 1)),
        Place::RunEnd => Some(format!("train-step@step={}", LAST - 1)),
        Place::FinalBarrier | Place::AfterEnd => None,
    }
}

/// Whether `line` is the coordinator's word that `returner` came back or asked to join.
fn has_its_join(line: &str, returner: usize) -> bool {
    let name = format!("worker {returner} (");
    (line.contains(&format!("trainerd: {name}")) && line.contains(") came back; generation "))
        || (line.contains("trainerd::cluster::coordinator: ")
            && line.contains(&name)
            && line.contains(") asks to join"))
}

/// Worker `returner` down and back so that it lands at `place`; the cluster, once every worker
/// has exited, and the mark from which the returner is back.
fn lands(dir: &Path, (place, sharded, location): (Place, bool, Location), returner: usize) -> (Cluster, usize) {
    let survivors: Vec<usize> = (0..WORKERS).filter(|&r| r != returner).collect();
    // Whoever coordinates while the returner is away: the chief, or the worker elected after it.
    let coordinator = survivors[0];
    let point = hold_before(place);
    let mut first_env: Vec<_> = (0..WORKERS).map(|r| armed(dir, r, point.as_deref())).collect();
    if place == Place::FinalBarrier {
        // The other survivor is held before the barrier, where the coordinator waits.
        first_env[survivors[1]] = armed(dir, survivors[1], Some("final-barrier@1"));
    }
    let mut c = Cluster::start(WORKERS, &args(dir, sharded, location), &[], first_env, RESTART_SEC);
    c.hold(returner);
    if place == Place::FirstStep {
        for rank in 0..WORKERS {
            c.wait_line(rank, "trainerd: failpoint train-step reached", 0, DEADLINE);
        }
    } else {
        c.wait_step(coordinator, 5, DEADLINE);
    }
    c.signal(returner, libc::SIGKILL);
    c.wait_for(|e| e.worker == returner && matches!(e.what, What::Died(_)), DEADLINE);
    // The survivors held before the place (for the first step, they already are).
    let held: Vec<usize> = match place {
        Place::FirstStep => survivors.clone(),
        Place::Step | Place::EpochEnd | Place::RunEnd => {
            for &rank in &survivors {
                c.wait_line(rank, "trainerd: failpoint train-step reached", 0, DEADLINE);
            }
            survivors.clone()
        }
        Place::FinalBarrier => {
            c.wait_line(survivors[1], "trainerd: failpoint final-barrier reached", 0, DEADLINE);
            vec![survivors[1]]
        }
        Place::AfterEnd => {
            // The survivors exited, the returner is held down.
            let codes = c.wait_finished(DEADLINE);
            assert_eq!(survivors.iter().map(|&r| codes[r]).collect::<Vec<_>>(), vec![0; WORKERS - 1]);
            vec![]
        }
    };
    let back = c.mark();
    c.bring_back(returner);
    if !held.is_empty() {
        // The coordinator has the returner's join, and its heartbeat stream (a member counts as
        // back only while live).
        let joined_and_live = |c: &Cluster| {
            let lines = || c.seen()[back..].iter().filter(|e| e.worker != returner).filter_map(|e| e.line());
            let stream = format!("worker {returner} (");
            lines().any(|l| has_its_join(l, returner))
                && lines().any(|l| l.contains(&stream) && l.contains(")'s heartbeat stream is open"))
        };
        while !joined_and_live(&c) {
            c.wait_for(|e| e.worker != returner && e.line().is_some(), DEADLINE);
        }
        if place == Place::FinalBarrier {
            // The coordinator ends the generation at once (a member waits in the final barrier)
            // before the held one arrives there: else the barrier could complete first.
            c.wait_line(coordinator, "trainerd: step ", back, DEADLINE);
        }
        held.iter().for_each(|&rank| let_go(dir, rank));
    }
    if place == Place::AfterEnd && location == Location::NodeLocal {
        // Nothing it reads shows the run's end (the others committed on their own disks): it
        // waits for its cluster, saying so, as any worker whose cluster is down; SIGTERM ends the
        // wait cleanly.
        let said = match returner {
            0 => "trainerd: waiting for 3 worker(s) to join",
            _ => "trainerd: no coordinator has answered for ",
        };
        let waits = |l: &str| {
            l.starts_with(said)
                && (returner == 0 || l.contains("holds no commit that ends this run: waiting for the cluster"))
        };
        c.wait_for(|e| e.worker == returner && e.line().is_some_and(waits), DEADLINE);
        c.signal(returner, libc::SIGTERM);
    }
    c.wait_finished(DEADLINE);
    (c, back)
}

/// The global step of the returner's first formation after `back`.
fn landed_at(c: &Cluster, returner: usize, back: usize) -> Option<u64> {
    c.seen().iter().skip(back).find_map(|e| match e.event() {
        Some(Event::Joined { global_step, .. }) if e.worker == returner => Some(*global_step),
        _ => None,
    })
}

/// Each worker's last exit status (the returner's killed process died, held down: it has none).
fn last_exits(c: &Cluster) -> Vec<Option<i32>> {
    let mut codes = vec![None; WORKERS];
    for e in c.seen() {
        if let What::Finished(code) = e.what {
            codes[e.worker] = Some(code);
        }
    }
    codes
}

/// Where the returner's first generation after it came back begins.
fn expected_landing(place: Place) -> Option<u64> {
    match place {
        Place::FirstStep => Some(0),
        Place::Step => Some(STEPS / 2 + 1),
        Place::EpochEnd => Some(STEPS),
        Place::RunEnd | Place::FinalBarrier => Some(LAST),
        Place::AfterEnd => None,
    }
}

/// Every cell of `place`'s row for the optimizer state `sharded`: a worker and the chief, with
/// shared and node-local checkpoints.
fn row(place: Place, sharded: bool) {
    let expected = reference();
    for location in [Location::Shared, Location::NodeLocal] {
        for returner in [2, 0] {
            let cell = format!("{place:?}, sharded {sharded}, {location:?}, worker {returner}");
            let tmp = tempfile::tempdir().unwrap();
            let (c, back) = lands(tmp.path(), (place, sharded, location), returner);
            let transcript = c.transcript();
            assert!(!transcript.contains("panicked at"), "{cell}\n{transcript}");
            assert_eq!(last_exits(&c), vec![Some(0); WORKERS], "{cell}\n{transcript}");
            if place == Place::AfterEnd && location == Location::NodeLocal {
                continue;
            }
            if place == Place::AfterEnd {
                let said = c.lines_of(returner, "trainerd: the run finished at step ");
                assert_eq!(said.len(), 1, "{cell}\n{transcript}");
                assert!(
                    said[0].starts_with(&format!("trainerd: the run finished at step {LAST} ")),
                    "{cell}: {}",
                    said[0]
                );
                continue;
            }
            assert_eq!(landed_at(&c, returner, back), expected_landing(place), "{cell}\n{transcript}");
            for rank in 0..WORKERS {
                assert_eq!(summary(tmp.path(), rank)["params_sha256"], expected, "{cell}: worker {rank}\n{transcript}");
            }
        }
    }
}

#[test]
fn a_return_at_the_runs_first_step() {
    row(Place::FirstStep, false);
}

#[test]
fn a_return_at_the_runs_first_step_sharded() {
    row(Place::FirstStep, true);
}

#[test]
fn a_return_at_a_step() {
    row(Place::Step, false);
}

#[test]
fn a_return_at_a_step_sharded() {
    row(Place::Step, true);
}

#[test]
fn a_return_at_an_epochs_end() {
    row(Place::EpochEnd, false);
}

#[test]
fn a_return_at_an_epochs_end_sharded() {
    row(Place::EpochEnd, true);
}

#[test]
fn a_return_at_the_runs_end() {
    row(Place::RunEnd, false);
}

#[test]
fn a_return_at_the_runs_end_sharded() {
    row(Place::RunEnd, true);
}

#[test]
fn a_return_into_the_final_barrier() {
    row(Place::FinalBarrier, false);
}

#[test]
fn a_return_into_the_final_barrier_sharded() {
    row(Place::FinalBarrier, true);
}

#[test]
fn a_return_after_the_end() {
    row(Place::AfterEnd, false);
}

#[test]
fn a_return_after_the_end_sharded() {
    row(Place::AfterEnd, true);
}
