//! A worker killed mid-epoch and started again by its supervisor (systemd's Restart=) must end
//! with exactly the model an uninterrupted run gives.

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use trainerd_chaos_tests::{dataset, params_sha256, plugin, Worker};

#[test]
fn sigkill_mid_epoch_then_restart_gives_the_uninterrupted_model() {
    let tmp = tempfile::tempdir().unwrap();
    let (plugin, data) = (plugin("linear"), dataset());
    let args = |summary: &std::path::Path| -> Vec<String> {
        [
            "run",
            "--plugin",
            plugin.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--epochs",
            "2",
            "--steps-per-epoch",
            "500",
            "--threads",
            "1",
            "--seed",
            "11",
            "--summary",
            summary.to_str().unwrap(),
        ]
        .map(String::from)
        .to_vec()
    };
    let run = |summary: &std::path::Path| {
        let a = args(summary);
        Worker::start(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };

    let reference = tmp.path().join("reference.json");
    assert!(run(&reference).wait().success());

    let killed = tmp.path().join("killed.json");
    let mut worker = run(&killed);
    worker.wait_for_line(|l| l == "Epoch 2/2", Duration::from_secs(120));
    worker.wait_for_line(|l| l.starts_with("100/500 - "), Duration::from_secs(120));
    let status = worker.kill(libc::SIGKILL);
    assert_eq!(status.signal(), Some(libc::SIGKILL));
    assert!(!killed.exists(), "a killed run must not leave a summary");

    assert!(run(&killed).wait().success());
    assert_eq!(params_sha256(&killed), params_sha256(&reference));
}
