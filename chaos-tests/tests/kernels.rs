//! One CPU kernel set per run: libtorch's AVX2 and plain kernels round differently, so a run pins
//! one for every member (the highest all of them run) and records it in every commit. A member
//! with higher kernels starts itself again with the run's; a resume with lower ones is refused,
//! naming both.
//!
//! CI budget: three 2-worker runs of mnist-cnn (60 steps) and three short single-worker runs,
//! about 40 s on 2 cores.

use std::path::Path;
use std::time::Duration;

use trainerd_testkit::output::stderr;
use trainerd_testkit::{Cluster, RunArgs, Worker};

const DEADLINE: Duration = Duration::from_secs(240);
const RESTART_SEC: Duration = Duration::from_millis(200);
const VARIABLE: &str = "ATEN_CPU_CAPABILITY";

fn summary(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

/// Two workers of mnist-cnn, worker `i` started with `ATEN_CPU_CAPABILITY=kernels[i]`; each
/// worker's summary, and the transcript.
fn two_workers(kernels: [&str; 2]) -> (Vec<serde_json::Value>, String) {
    let tmp = tempfile::tempdir().unwrap();
    let args = RunArgs::new("mnist-cnn").epochs(1).steps(60).threads(1).seed(1);
    let args = args.summary(tmp.path().join("summary.{rank}.json"));
    let env = kernels.iter().map(|k| vec![(VARIABLE.to_string(), k.to_string())]).collect();
    let mut c = Cluster::start(2, &args, &[], env, RESTART_SEC);
    assert_eq!(c.wait_finished(DEADLINE), vec![0, 0], "{}", c.transcript());
    let summaries = (0..2).map(|r| summary(&tmp.path().join(format!("summary.{r}.json")))).collect();
    (summaries, c.transcript())
}

fn params(summaries: &[serde_json::Value]) -> Vec<&str> {
    summaries.iter().map(|s| s["params_sha256"].as_str().unwrap()).collect()
}

#[test]
fn workers_started_with_different_cpu_kernels_end_with_the_bits_of_the_pinned_ones() {
    let (mixed, transcript) = two_workers(["avx2", "default"]);
    let (plain, _) = two_workers(["default", "default"]);
    let (avx2, _) = two_workers(["avx2", "avx2"]);
    assert_eq!(params(&mixed), params(&plain), "{transcript}");
    assert!(mixed.iter().all(|s| s["cpu_capability"] == "DEFAULT"), "{mixed:?}");
    assert!(avx2.iter().all(|s| s["cpu_capability"] == "AVX2"), "{avx2:?}");
    // The kernels matter to the bits: the pin is what makes the mixed run the plain one's.
    assert_ne!(params(&avx2)[0], params(&plain)[0]);
    let said = "[worker 0] trainerd: the run computes with DEFAULT CPU kernels, this process with AVX2: starting it \
                again with ATEN_CPU_CAPABILITY=default";
    assert!(transcript.lines().any(|l| l == said), "{transcript}");
    assert!(transcript
        .lines()
        .any(|l| l == "[worker 0] trainerd: CPU kernels: DEFAULT (the run's, pinned by trainerd)"));
    // Worker 1 received the chief's initial model, made with AVX2 kernels: it is not the run's,
    // and worker 1 drops it for the one the chief makes again with the run's.
    let dropped = "with AVX2 CPU kernels, the run's are DEFAULT: it is made again with the run's";
    assert!(
        transcript.lines().any(|l| l.starts_with("[worker 1] trainerd: ")
            && l.contains("the run's initial model was made by worker 0 (")
            && l.contains(dropped)),
        "{transcript}"
    );
}

/// A single worker of the linear plugin committing to `dir` every 10 steps (2 epochs of 20 steps,
/// seed 2).
fn alone_args(dir: &Path) -> RunArgs {
    let args = RunArgs::new("linear").epochs(2).steps(20).threads(1).seed(2).checkpoints(dir.join("ckpt"), 10);
    args.summary(dir.join("summary.json"))
}

/// The whole run in `dir` with `kernels`.
fn alone(dir: &Path, kernels: &str) -> std::process::Output {
    alone_args(dir).command("run").env(VARIABLE, kernels).output().unwrap()
}

#[test]
fn a_resume_with_lower_cpu_kernels_than_the_commits_is_refused_naming_both() {
    let tmp = tempfile::tempdir().unwrap();
    // Killed at step 15 on AVX2 kernels: commit 1 holds step 10.
    let env = [(VARIABLE, "avx2".to_string()), ("TRAINERD_FAILPOINT", "train-step@15".to_string())];
    let args = alone_args(tmp.path());
    let mut first = Worker::start_with(&[&["run"], &args.strs()[..]].concat(), &env);
    first.wait_line(|l| l == "trainerd: failpoint train-step reached", DEADLINE);
    // The commit of step 10 completes in the background (its event would come with the next step).
    let record = tmp.path().join("ckpt/commits/00000000000000000001.json");
    let until = std::time::Instant::now() + DEADLINE;
    while !record.exists() {
        assert!(std::time::Instant::now() < until, "no commit at {}", record.display());
        std::thread::sleep(Duration::from_millis(20));
    }
    first.kill(libc::SIGKILL);
    let refused = alone(tmp.path(), "default");
    assert_eq!(refused.status.code(), Some(1), "{}", stderr(&refused));
    let location = tmp.path().join("ckpt");
    let expected = format!(
        "error: checkpoint 1 in {} was trained with AVX2 CPU kernels; this worker's are DEFAULT \
         (ATEN_CPU_CAPABILITY=default): continuing here would change the run's bits. This CPU runs them: unset \
         ATEN_CPU_CAPABILITY, or set it to avx2.",
        location.display()
    );
    assert!(stderr(&refused).lines().any(|l| l == expected), "expected {expected}\n{}", stderr(&refused));
    // The same kernels resume, and end where the uninterrupted run ends.
    let resumed = alone(tmp.path(), "avx2");
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let whole = tempfile::tempdir().unwrap();
    assert!(alone(whole.path(), "avx2").status.success());
    let (a, b) = (summary(&tmp.path().join("summary.json")), summary(&whole.path().join("summary.json")));
    assert_eq!((&a["params_sha256"], &a["cpu_capability"]), (&b["params_sha256"], &serde_json::json!("AVX2")));
}
