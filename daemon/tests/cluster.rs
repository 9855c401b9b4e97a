//! Multi-worker training with real daemons on loopback: results, replica identity, equivalence
//! with one bigger worker, and every refusal with its message.

use std::process::{Child, Stdio};

use trainerd_testkit::output::{error_line, error_of, json, step_losses, text};
use trainerd_testkit::{free_ports, tf_config, RunArgs};

/// `trainerd local --workers N` on mnist-cnn for one epoch: accuracy and identical replicas.
fn cnn_on(workers: usize) {
    let tmp = tempfile::tempdir().unwrap();
    let summary = tmp.path().join("s.json");
    let out = RunArgs::new("mnist-cnn").epochs(1).batch(64).summary(&summary).local(workers).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("[worker 0] Epoch 1/1"), "{stdout}");
    let steps = 60_000 / (64 * workers);
    let summaries: Vec<_> = (0..workers).map(|i| json(&tmp.path().join(format!("s.worker{i}.json")))).collect();
    for (i, s) in summaries.iter().enumerate() {
        assert_eq!(s["workers"], workers, "worker {i}");
        assert_eq!(s["rank"], i);
        assert_eq!(s["steps"], steps);
        assert_eq!(s["global_batch_size"], 64 * workers);
        let acc = s["test_accuracy"].as_f64().unwrap();
        assert!(acc >= 0.85, "worker {i}: test accuracy {acc}");
        assert_eq!(s["params_sha256"], summaries[0]["params_sha256"], "worker {i} diverged from worker 0");
        assert_eq!(s["test_loss"], summaries[0]["test_loss"], "the test loss is a global mean");
    }
}

#[test]
fn two_workers_train_mnist_cnn_to_85_percent_with_identical_parameters() {
    cnn_on(2);
}

#[test]
fn three_workers_train_mnist_cnn_to_85_percent_with_identical_parameters() {
    cnn_on(3);
}

/// N workers with batch b follow one worker with batch N*b, step by step.
#[test]
fn n_workers_follow_one_worker_with_n_times_the_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let common = RunArgs::new("linear").epochs(2).steps(60).seed(5).threads(1);
    for workers in [2usize, 3] {
        let b = 32;
        let single = tmp.path().join(format!("single{workers}.jsonl"));
        let one = common.clone().batch(b * workers as u32).set("--metrics-log", single.to_str().unwrap());
        let out = one.command("run").output().unwrap();
        assert!(out.status.success(), "{}", text(&out));

        let multi = tmp.path().join(format!("multi{workers}.jsonl"));
        let many = common.clone().batch(b).set("--metrics-log", multi.to_str().unwrap());
        let out = many.local(workers).output().unwrap();
        assert!(out.status.success(), "{}", text(&out));

        let one = step_losses(&single);
        assert_eq!(one.len(), 120);
        for w in 0..workers {
            let many = step_losses(&tmp.path().join(format!("multi{workers}.worker{w}.jsonl")));
            assert_eq!(many.len(), one.len());
            for (step, (a, b)) in one.iter().zip(&many).enumerate() {
                let rel = (a - b).abs() / a.abs().max(1e-12);
                assert!(rel <= 1e-5, "{workers} workers, worker {w}, step {step}: loss {b} vs one worker's {a}");
            }
        }
    }
}

fn spawn_worker(ports: &[u16], index: usize, extra: &[&str], env: &[(&str, &str)]) -> Child {
    let mut cmd = RunArgs::new("test-fixture").threads(1).steps(20).epochs(1).extend(extra).command("run");
    cmd.env("TF_CONFIG", tf_config(ports, index)).stdout(Stdio::piped()).stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap()
}

#[test]
fn a_worker_with_a_different_tf_config_is_refused() {
    let ports = free_ports(3);
    // Long enough for the stray to start on a loaded machine before the chief gives up on it.
    let chief = spawn_worker(&ports[..2], 0, &["--rendezvous-timeout", "8"], &[]);
    // Worker 1 believes in a third worker.
    let stray = spawn_worker(&ports, 1, &["--rendezvous-timeout", "20"], &[]);
    let stray = stray.wait_with_output().unwrap();
    let chief = chief.wait_with_output().unwrap();
    let addrs = |n: usize| {
        serde_json::to_string(
            &serde_json::json!({"worker": ports[..n].iter().map(|p| format!("127.0.0.1:{p}")).collect::<Vec<_>>()}),
        )
        .unwrap()
    };
    let w1 = format!("worker 1 (127.0.0.1:{})", ports[1]);
    assert_eq!(
        error_line(&stray),
        format!(
            "error: rendezvous refused by the chief: {w1} has a different TF_CONFIG cluster: {} on {w1}, {} on \
             the chief, worker 0 (127.0.0.1:{})",
            addrs(3),
            addrs(2),
            ports[0]
        )
    );
    assert_eq!(error_line(&chief), format!("error: rendezvous: {w1} did not join within 8s"));
}

#[test]
fn a_worker_with_a_different_plugin_version_is_refused() {
    let ports = free_ports(2);
    let chief = spawn_worker(&ports, 0, &["--rendezvous-timeout", "8"], &[]);
    let other = spawn_worker(&ports, 1, &[], &[("TRAINERD_FIXTURE_VERSION", "9.9.9")]);
    let other = other.wait_with_output().unwrap();
    let _ = chief.wait_with_output().unwrap();
    let err = error_line(&other);
    let w1 = format!("worker 1 (127.0.0.1:{})", ports[1]);
    assert!(
        err.starts_with(&format!(
            "error: rendezvous refused by the chief: {w1} runs a different plugin: test-fixture 9.9.9 (trainerd-sdk "
        )),
        "{err}"
    );
    assert!(err.contains(&format!("on {w1}, test-fixture 0.1.0 (trainerd-sdk ")), "{err}");
}

/// The run's slots are every worker's replicas: workers with different `--devices` counts would
/// disagree on them.
#[test]
fn a_worker_with_another_number_of_replicas_is_refused() {
    let ports = free_ports(2);
    let chief = spawn_worker(&ports, 0, &["--rendezvous-timeout", "8", "--devices", "cpu,cpu"], &[]);
    let other = spawn_worker(&ports, 1, &["--device", "cpu"], &[]);
    let other = other.wait_with_output().unwrap();
    let _ = chief.wait_with_output().unwrap();
    let w1 = format!("worker 1 (127.0.0.1:{})", ports[1]);
    assert_eq!(
        error_line(&other),
        format!(
            "error: rendezvous refused by the chief: {w1} has a different run configuration: replicas_per_worker = \
             (absent) on {w1}, 2 on the chief, worker 0 (127.0.0.1:{})",
            ports[0]
        )
    );
}

#[test]
fn a_port_already_in_use_is_named() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let ports = [port, free_ports(1)[0]];
    let out = spawn_worker(&ports, 0, &[], &[]).wait_with_output().unwrap();
    assert_eq!(
        error_line(&out),
        format!(
            "error: cannot listen on 127.0.0.1:{port} (worker 0 (127.0.0.1:{port})'s address in TF_CONFIG): \
             Address already in use (os error 98)"
        )
    );
}

#[test]
fn a_peer_that_never_comes_is_named_after_the_deadline() {
    let ports = free_ports(3);
    // Every worker is required (by default 2 of 3 would start without it).
    let chief = spawn_worker(&ports, 0, &["--rendezvous-timeout", "2", "--min-workers", "3"], &[]);
    // The member would wait far longer: a chief slow to start (a loaded machine) must not make it
    // give up on the chief first.
    let one = spawn_worker(&ports, 1, &["--rendezvous-timeout", "60"], &[]);
    let chief = chief.wait_with_output().unwrap();
    let one = one.wait_with_output().unwrap();
    // The chief gives up, and tells the member that waits with it whom they waited for.
    let expected = format!("error: rendezvous: worker 2 (127.0.0.1:{}) did not join within 2s", ports[2]);
    assert_eq!(error_of(&chief), expected);
    assert_eq!(error_of(&one), expected);
}

#[test]
fn a_member_whose_chief_never_comes_names_it_after_the_deadline() {
    let ports = free_ports(2);
    let out = spawn_worker(&ports, 1, &["--rendezvous-timeout", "2"], &[]).wait_with_output().unwrap();
    let err = error_of(&out);
    assert!(
        err.starts_with(&format!(
            "error: rendezvous: no answer from the chief, worker 0 (127.0.0.1:{}), within 2s: cannot connect to \
             127.0.0.1:{}",
            ports[0], ports[0]
        )),
        "{err}"
    );
}

#[test]
fn a_bad_tf_config_is_refused_naming_the_field() {
    let out = RunArgs::new("linear")
        .command("run")
        .env("TF_CONFIG", r#"{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 4}}"#)
        .output()
        .unwrap();
    assert_eq!(error_line(&out), "error: TF_CONFIG: task index 4 is out of range: cluster.worker has 1 task");
    let out = RunArgs::new("linear")
        .set("--tf-config", "{\"cluster\": {\"ps\": [\"a:1\"], \"worker\": [\"b:1\"]}}")
        .command("run")
        .output()
        .unwrap();
    assert_eq!(
        error_line(&out),
        "error: --tf-config: parameter-server training is not supported (\"cluster\" has a \"ps\" job); trainerd \
         trains with synchronous all-reduce among chief and worker tasks"
    );
}

#[test]
fn local_stops_every_worker_when_one_fails() {
    let tmp = tempfile::tempdir().unwrap();
    let out = RunArgs::new("linear").data(tmp.path()).local(2).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("trainerd local: worker "), "{err}");
    assert!(err.contains("] error: plugin linear: load_data failed: data directory "), "{err}");
}

#[test]
fn local_refuses_a_tf_config_of_its_own() {
    let out = RunArgs::new("linear").set("--tf-config", "{}").local(2).output().unwrap();
    assert_eq!(error_of(&out), "error: trainerd local writes each worker's TF_CONFIG itself: remove --tf-config");
}
