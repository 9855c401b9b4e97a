//! A worker killed mid-epoch and started again by its supervisor (systemd's Restart=) must end
//! with exactly the model an uninterrupted run gives.

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use trainerd_chaos_tests::{dataset, params_sha256, plugin, Worker};

#[test]
fn sigkill_mid_epoch_then_restart_gives_the_uninterrupted_model() {
    // Without checkpoints a restart trains again from the start, and gets the same model.
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("reference.json");
    assert!(start("run", &[], &linear_run(&reference, None)).wait().success());

    let killed = tmp.path().join("killed.json");
    let mut worker = start("run", &[], &linear_run(&killed, None));
    worker.wait_for_line(|l| l == "Epoch 2/2", Duration::from_secs(120));
    worker.wait_for_line(|l| l.starts_with("100/500 - "), Duration::from_secs(120));
    let status = worker.kill(libc::SIGKILL);
    assert_eq!(status.signal(), Some(libc::SIGKILL));
    assert!(!killed.exists(), "a killed run must not leave a summary");

    assert!(start("run", &[], &linear_run(&killed, None)).wait().success());
    assert_eq!(params_sha256(&killed), params_sha256(&reference));
}

/// Arguments of a run of the linear model (2 epochs of 500 steps), checkpointed every 60 steps
/// into `ckpt` when given.
fn linear_run(summary: &std::path::Path, ckpt: Option<&std::path::Path>) -> Vec<String> {
    let mut args: Vec<String> = [
        "--plugin",
        plugin("linear").to_str().unwrap(),
        "--data",
        dataset().to_str().unwrap(),
        "--epochs",
        "2",
        "--steps-per-epoch",
        "500",
        "--threads",
        "1",
        "--seed",
        "3",
        "--optimizer",
        "adam",
        "--lr",
        "0.001",
        "--summary",
        summary.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec();
    if let Some(dir) = ckpt {
        args.extend(["--checkpoint-dir", dir.to_str().unwrap(), "--checkpoint-every", "60"].map(String::from));
    }
    args
}

fn start(sub: &str, extra: &[&str], args: &[String]) -> Worker {
    let mut all = vec![sub];
    all.extend(extra);
    all.extend(args.iter().map(String::as_str));
    Worker::start(&all)
}

#[test]
fn sigkill_mid_epoch_resumes_at_the_committed_step_with_the_uninterrupted_model() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("reference.json");
    let status = start("run", &[], &linear_run(&reference, Some(&tmp.path().join("ckpt-ref")))).wait();
    assert!(status.success());

    let (killed, ckpt) = (tmp.path().join("killed.json"), tmp.path().join("ckpt"));
    let args = linear_run(&killed, Some(&ckpt));
    let mut worker = start("run", &[], &args);
    worker.wait_for_line(|l| l == "Epoch 2/2", Duration::from_secs(120));
    let committed =
        worker.wait_for_line(|l| l.starts_with("checkpoint ") && l.contains(" committed"), Duration::from_secs(120));
    worker.wait_for_line(|l| l.contains("/500 - "), Duration::from_secs(120));
    assert_eq!(worker.kill(libc::SIGKILL).signal(), Some(libc::SIGKILL));
    assert!(!killed.exists());

    let mut again = start("run", &[], &args);
    let resumed = again.wait_for_line(|l| l.starts_with("trainerd: resumed from checkpoint "), Duration::from_secs(60));
    // The restart resumes from the newest commit, at least the one seen before the kill, mid-epoch 2.
    let seq = |l: &str, prefix: &str| -> u64 { l[prefix.len()..].split(' ').next().unwrap().parse().unwrap() };
    assert!(
        seq(&resumed, "trainerd: resumed from checkpoint ") >= seq(&committed, "checkpoint "),
        "{resumed} / {committed}"
    );
    assert!(resumed.contains(" at epoch 2, step "), "{resumed}");
    assert!(again.wait().success());
    assert_eq!(params_sha256(&killed), params_sha256(&reference));
}

#[test]
fn a_killed_two_worker_cluster_resumes_with_the_uninterrupted_model() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("reference.json");
    let status =
        start("local", &["--workers", "2"], &linear_run(&reference, Some(&tmp.path().join("ckpt-ref")))).wait();
    assert!(status.success());

    let (killed, ckpt) = (tmp.path().join("killed.json"), tmp.path().join("ckpt"));
    let args = linear_run(&killed, Some(&ckpt));
    let mut cluster = start("local", &["--workers", "2"], &args);
    cluster.wait_for_line(|l| l.starts_with("[worker 0] checkpoint 3 committed"), Duration::from_secs(120));
    // SIGTERM to the launcher stops both workers, as systemd stopping the nodes would.
    cluster.kill(libc::SIGTERM);

    let mut again = start("local", &["--workers", "2"], &args);
    again.wait_for_line(|l| l.starts_with("[worker 0] trainerd: resumed from checkpoint "), Duration::from_secs(60));
    assert!(again.wait().success());
    let summary = |i: usize| tmp.path().join(format!("{}.worker{i}.json", "killed"));
    let reference = |i: usize| tmp.path().join(format!("reference.worker{i}.json"));
    assert_eq!(params_sha256(&summary(0)), params_sha256(&reference(0)));
    assert_eq!(params_sha256(&summary(1)), params_sha256(&reference(0)));
}
