//! End-to-end tests of the `trainerd` binary with real plugins: training results, determinism,
//! and every refusal with its exact message.
//!
//! The plugins are built by `cargo build --workspace` (scripts/test.sh does it before the
//! tests); the accuracy test reads Fashion-MNIST from /usr/share/datasets/fashion-mnist
//! (scripts/setup.sh installs it) or from `TRAINERD_TEST_DATA`.

use std::path::{Path, PathBuf};
use std::process::Output;

use trainerd_testkit::output::{error_line, error_of, json, stderr, stdout, text};
use trainerd_testkit::{dataset, plugin, trainerd_cmd, RunArgs};

use trainerd_sdk::abi::{ABI_VERSION, LIBTORCH_VERSION, SDK_VERSION, TARGET, TCH_VERSION};
use trainerd_sdk::mnist::{write_idx, IMAGES_MAGIC, LABELS_MAGIC};

/// A small MNIST-format dataset (random pixels, 10 classes).
fn tiny_dataset(dir: &Path, n_train: u32, n_test: u32) {
    for (prefix, n) in [("train", n_train), ("t10k", n_test)] {
        let pixels: Vec<u8> = (0..n * 784).map(|i| (i.wrapping_mul(2654435761) >> 24) as u8).collect();
        let labels: Vec<u8> = (0..n).map(|i| (i % 10) as u8).collect();
        write_idx(&dir.join(format!("{prefix}-images-idx3-ubyte.gz")), IMAGES_MAGIC, &[n, 28, 28], &pixels).unwrap();
        write_idx(&dir.join(format!("{prefix}-labels-idx1-ubyte.gz")), LABELS_MAGIC, &[n], &labels).unwrap();
    }
}

fn run_with(plugin: &Path, data: &Path, extra: &[&str], fault: Option<&str>) -> Output {
    let mut cmd = RunArgs::with_plugin(plugin).data(data).threads(1).extend(extra).command("run");
    if let Some(f) = fault {
        cmd.env("TRAINERD_FIXTURE_FAULT", f);
    }
    cmd.output().unwrap()
}

#[test]
fn mnist_cnn_reaches_85_percent_in_one_epoch_on_fashion_mnist() {
    let tmp = tempfile::tempdir().unwrap();
    let s = tmp.path().join("summary.json");
    let out = RunArgs::new("mnist-cnn").epochs(1).batch(64).threads(2).summary(&s).command("run").output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("Epoch 1/1\n"), "{text}");
    let last = text.lines().find(|l| l.starts_with("937/937 - ")).unwrap_or_else(|| panic!("{text}"));
    assert!(last.contains("ms/step - loss: ") && last.contains(" - val_accuracy: ") && last.ends_with(" examples/s"));
    let s = json(&s);
    assert_eq!(s["steps"], 937);
    assert_eq!(s["epochs"], 1);
    let acc = s["test_accuracy"].as_f64().unwrap();
    assert!(acc >= 0.85, "test accuracy {acc}");
    assert!(s["final_train_loss"].as_f64().unwrap() < 0.6, "{s}");
    assert!(s["examples_per_second"].as_f64().unwrap() > 0.0);
    assert_eq!(s["params_sha256"].as_str().unwrap().len(), 64);
}

#[test]
fn same_seed_gives_the_same_params_sha256() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset();
    let hash = |name: &str, seed: &str| {
        let s = tmp.path().join(name);
        let out = run_with(
            &plugin("mnist-cnn"),
            &data,
            &["--epochs", "2", "--steps-per-epoch", "40", "--seed", seed, "--summary", s.to_str().unwrap()],
            None,
        );
        assert!(out.status.success(), "{}", stderr(&out));
        json(&s)["params_sha256"].as_str().unwrap().to_string()
    };
    let a = hash("a.json", "7");
    assert_eq!(a, hash("b.json", "7"));
    assert_ne!(a, hash("c.json", "8"));
}

#[test]
fn each_optimizer_trains_the_linear_model() {
    let tmp = tempfile::tempdir().unwrap();
    for (optimizer, lr) in [("sgd", "0.1"), ("adam", "0.001"), ("rmsprop", "0.001")] {
        let s = tmp.path().join(format!("{optimizer}.json"));
        let out = run_with(
            &plugin("linear"),
            &dataset(),
            &["--optimizer", optimizer, "--lr", lr, "--steps-per-epoch", "300", "--summary", s.to_str().unwrap()],
            None,
        );
        assert!(out.status.success(), "{}", stderr(&out));
        let s = json(&s);
        assert_eq!(s["optimizer"]["name"], optimizer);
        let acc = s["test_accuracy"].as_f64().unwrap();
        assert!(acc > 0.7, "{optimizer}: test accuracy {acc}");
    }
}

fn expected_mismatch(path: &Path, field: &str, found: &str, expected: &str) -> String {
    format!(
        "error: plugin {}: {field} is {found}, this trainerd expects {expected}; rebuild the plugin against \
         trainerd-sdk {SDK_VERSION} (tch {TCH_VERSION}, libtorch {LIBTORCH_VERSION}, target {TARGET})",
        path.display()
    )
}

#[test]
fn header_mismatches_are_refused_naming_file_found_and_expected() {
    let data = tempfile::tempdir().unwrap();
    tiny_dataset(data.path(), 64, 16);
    let fixture = plugin("test-fixture");
    let abi = trainerd_sdk::abi::ABI_VERSION.to_string();
    for (fault, field, found, expected) in [
        ("abi-version", "ABI version", "999", abi.as_str()),
        ("magic", "header magic", "\"NOTAPLUG\"", "\"TRAINERD\""),
        ("tch-version", "tch version", "0.25.0", TCH_VERSION),
        ("libtorch-version", "libtorch version", "2.12.0+cpu", LIBTORCH_VERSION),
    ] {
        let out = run_with(&fixture, data.path(), &[], Some(fault));
        assert_eq!(error_of(&out), expected_mismatch(&fixture, field, found, expected), "{fault}");
    }
    let out = run_with(&fixture, data.path(), &[], Some("panic-abort"));
    assert_eq!(
        error_of(&out),
        format!(
            "error: plugin {}: built with panic = \"abort\"; trainerd needs panic = \"unwind\" so that a panic in \
             the plugin becomes an error instead of killing the daemon: remove `panic = \"abort\"` from the \
             plugin's Cargo profile and rebuild",
            fixture.display()
        )
    );
}

#[test]
fn files_that_are_not_plugins_are_refused() {
    let data = tempfile::tempdir().unwrap();
    tiny_dataset(data.path(), 64, 16);
    let missing = data.path().join("nope.so");
    let out = run_with(&missing, data.path(), &[], None);
    assert_eq!(error_of(&out), format!("error: plugin {}: no such file", missing.display()));

    let text = data.path().join("text.so");
    std::fs::write(&text, "not an ELF file").unwrap();
    let out = run_with(&text, data.path(), &[], None);
    let err = error_of(&out);
    assert!(err.starts_with(&format!("error: plugin {}: not a loadable shared library: ", text.display())), "{err}");
    assert!(err.contains("invalid ELF header") || err.contains("file too short"), "{err}");

    // A real shared library that is not a plugin: the C library every process has loaded.
    let libc = ["/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6", "/lib64/libc.so.6"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .expect("libc.so.6");
    let out = run_with(&libc, data.path(), &[], None);
    assert_eq!(
        error_of(&out),
        format!(
            "error: plugin {}: not a trainerd plugin (it exports no `trainerd_plugin_entry` symbol); build the \
             model crate as a cdylib that calls trainerd_sdk::export_plugin!",
            libc.display()
        )
    );
}

#[test]
fn panics_in_plugin_code_come_back_as_errors() {
    let data = tempfile::tempdir().unwrap();
    tiny_dataset(data.path(), 256, 16);
    let fixture = plugin("test-fixture");
    // A panic in a step is the model's failure, final (exit status 4: every worker would fail the
    // same way); the others may pass with a restart (1).
    for (fault, message, status) in [
        ("panic-forward", "error: plugin test-fixture: step failed: panicked: fixture: forward pass failed on purpose", 4),
        (
            "panic-pipeline",
            "error: plugin test-fixture: input_pipeline failed: panicked: fixture: input pipeline failed on purpose at batch 2",
            1,
        ),
        ("panic-load", "error: plugin test-fixture: load_data failed: panicked: fixture: data loading failed on purpose", 1),
    ] {
        let out = run_with(&fixture, data.path(), &[], Some(fault));
        assert_eq!(error_line(&out), message, "{fault}");
        assert_eq!(out.status.code(), Some(status), "{fault}");
    }
    // Without a fault the same plugin trains.
    let out = run_with(&fixture, data.path(), &[], None);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn data_errors_name_the_file() {
    let linear = plugin("linear");
    let prefix = "error: plugin linear: load_data failed: ";

    let dir = tempfile::tempdir().unwrap();
    tiny_dataset(dir.path(), 64, 16);
    std::fs::remove_file(dir.path().join("train-labels-idx1-ubyte.gz")).unwrap();
    let out = run_with(&linear, dir.path(), &[], None);
    assert_eq!(
        error_of(&out),
        format!(
            "{prefix}data directory {}: missing train-labels-idx1-ubyte (or train-labels-idx1-ubyte.gz)",
            dir.path().display()
        )
    );

    let dir = tempfile::tempdir().unwrap();
    tiny_dataset(dir.path(), 64, 16);
    let truncated = dir.path().join("train-images-idx3-ubyte");
    std::fs::remove_file(dir.path().join("train-images-idx3-ubyte.gz")).unwrap();
    write_idx(&truncated, IMAGES_MAGIC, &[64, 28, 28], &vec![0; 1000]).unwrap();
    let out = run_with(&linear, dir.path(), &[], None);
    assert_eq!(
        error_of(&out),
        format!(
            "{prefix}{}: truncated: the header promises 50176 bytes of data, the file has 1000",
            truncated.display()
        )
    );

    let dir = tempfile::tempdir().unwrap();
    tiny_dataset(dir.path(), 64, 16);
    let wrong = dir.path().join("t10k-labels-idx1-ubyte.gz");
    write_idx(&wrong, IMAGES_MAGIC, &[16], &[0; 16]).unwrap();
    let out = run_with(&linear, dir.path(), &[], None);
    assert_eq!(
        error_of(&out),
        format!("{prefix}{}: wrong magic number 0x00000803, expected 0x00000801 (idx1 labels)", wrong.display())
    );
}

#[test]
fn plugin_check_prints_identity() {
    let path = plugin("mnist-cnn");
    let out = trainerd_cmd().args(["plugin", "check"]).arg(&path).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.starts_with(&format!("plugin: {}\nname: mnist-cnn {}\n", path.display(), env!("CARGO_PKG_VERSION"))),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "built with: abi {ABI_VERSION}, trainerd-sdk {SDK_VERSION}, tch {TCH_VERSION}, libtorch {LIBTORCH_VERSION}, {TARGET}, panic=unwind\n"
        )),
        "{text}"
    );
    assert!(
        text.contains(
            "parameters: 6 tensors, 347,146 values (model.conv.bias [32], model.conv.weight [32, 1, 3, 3], \
             model.dense.bias [64], model.dense.weight [64, 5408], model.logits.bias [10], model.logits.weight \
             [10, 64])\nbuffers: none\narguments: none\n"
        ),
        "{text}"
    );
    // A plugin that takes no arguments refuses one, saying so.
    let out = trainerd_cmd().args(["plugin", "check", "--plugin-arg", "hidden=128"]).arg(&path).output().unwrap();
    assert_eq!(
        error_of(&out),
        format!("error: plugin {}: --plugin-arg hidden: no such key; it takes no --plugin-arg", path.display())
    );
}

#[test]
fn plugin_check_reports_a_mismatch_and_survives_a_crash() {
    let fixture = plugin("test-fixture");
    let out = trainerd_cmd()
        .args(["plugin", "check"])
        .arg(&fixture)
        .env("TRAINERD_FIXTURE_FAULT", "abi-version")
        .output()
        .unwrap();
    let abi = trainerd_sdk::abi::ABI_VERSION.to_string();
    assert_eq!(error_of(&out), expected_mismatch(&fixture, "ABI version", "999", &abi));

    let out = trainerd_cmd()
        .args(["plugin", "check"])
        .arg(&fixture)
        .env("TRAINERD_FIXTURE_FAULT", "segfault-on-load")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(128 + 11), "{}", stderr(&out));
    assert!(stderr(&out).contains(&format!(
        "error: plugin {}: the plugin crashed the checking process with signal 11 (SIGSEGV) while loading",
        fixture.display()
    )));
}

#[test]
fn bad_flags_are_refused_with_the_flag_named() {
    let data = tempfile::tempdir().unwrap();
    tiny_dataset(data.path(), 64, 16);
    let linear = plugin("linear");
    let out = run_with(&linear, data.path(), &["--optimizer", "adam", "--momentum", "0.9"], None);
    assert_eq!(error_of(&out), "error: --momentum does not apply to optimizer adam");
    let out = run_with(&linear, data.path(), &["--device", "tpu"], None);
    assert_eq!(error_of(&out), "error: --device tpu: expected auto, cpu, cuda or cuda:N");
    let out = run_with(&linear, data.path(), &["--devices", "cpu,tpu"], None);
    assert_eq!(
        error_of(&out),
        "error: --devices cpu,tpu: expected all, or a list of cpu, cuda or cuda:N such as cuda:0,cuda:1"
    );
    let out = run_with(&linear, data.path(), &["--accumulate", "0"], None);
    assert_eq!(error_of(&out), "error: --accumulate 0: expected at least 1 (micro-batches per update)");
    let out = run_with(&linear, data.path(), &["--batch-size", "1000"], None);
    assert_eq!(
        error_of(&out),
        "error: the training split gives no batch: with batch size 1000 per worker and 1 worker(s) the input \
         pipeline yields 0 steps per epoch"
    );
    // Two timeouts given by hand that contradict each other are refused, naming both.
    let out = run_with(&linear, data.path(), &["--heartbeat-deadline", "200", "--collective-timeout", "120"], None);
    assert_eq!(
        error_of(&out),
        "error: --heartbeat-deadline 200s must be less than --collective-timeout 120s (the timeouts must grow: \
         heartbeat interval < heartbeat deadline < collective timeout < rejoin deadline)"
    );
    let out = run_with(&linear, data.path(), &["--rejoin-deadline", "0"], None);
    assert_eq!(error_of(&out), "error: --rejoin-deadline 0: expected a positive number of seconds");
    let out = run_with(&linear, data.path(), &["--data-timeout", "150", "--collective-timeout", "120"], None);
    assert_eq!(
        error_of(&out),
        "error: --data-timeout 150s must be less than --collective-timeout 120s: a worker waiting for its data must \
         give up before its peers waiting in a collective do"
    );
    let out = run_with(&linear, data.path(), &["--data-cache-size", "lots"], None);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(stderr(&out).contains("\"lots\": expected a size such as 512M or 10G"), "{}", text(&out));
}

/// libtorch's kernel variable is checked before libtorch reads it: a value it does not know is
/// refused, naming what it expects (kernels the CPU lacks would die of an illegal instruction,
/// and are refused the same way, naming the missing features).
#[test]
fn an_unknown_cpu_kernel_set_is_refused_naming_what_is_expected() {
    let data = tempfile::tempdir().unwrap();
    tiny_dataset(data.path(), 64, 16);
    let mut cmd = RunArgs::with_plugin(plugin("linear")).data(data.path()).threads(1).command("run");
    let out = cmd.env("ATEN_CPU_CAPABILITY", "avx9").output().unwrap();
    assert_eq!(error_of(&out), "error: ATEN_CPU_CAPABILITY=avx9: expected default, avx2 or avx512");
}

/// A timeout given alone never contradicts a default: the ones not given follow from it (the
/// refusal "--data-timeout 60s must be less than --collective-timeout 10s" of a user who set only
/// the collective timeout is gone).
#[test]
fn every_timeout_flag_alone_starts() {
    let data = tempfile::tempdir().unwrap();
    tiny_dataset(data.path(), 64, 16);
    let linear = plugin("linear");
    for flag in [
        ["--collective-timeout", "10"],
        ["--collective-timeout", "2"],
        ["--heartbeat-interval", "1"],
        ["--heartbeat-deadline", "200"],
        ["--heartbeat-deadline", "0.3"],
        ["--rejoin-deadline", "5"],
        ["--replace-after", "900"],
        ["--replace-after", "0"],
        ["--rendezvous-timeout", "1"],
        ["--data-timeout", "150"],
    ] {
        let out = run_with(&linear, data.path(), &flag, None);
        assert!(out.status.success(), "{flag:?}: {}", text(&out));
    }
}

/// Rust links with `--as-needed`, so a plain link drops `libtorch_cuda.so` and libtorch never
/// registers CUDA: `--device auto` then trains on the CPU on a GPU node without a word. A CUDA
/// device asked for loads it; only libtorch's CUDA library knows the CUDA runtime's version, so
/// the refusal of a GPU that does not exist proves it was loaded (on any machine).
#[test]
fn a_cuda_device_loads_libtorchs_cuda_and_a_missing_gpu_is_one_line_naming_it() {
    let out = RunArgs::new("linear").set("--device", "cuda:99").command("run").output().unwrap();
    let err = error_of(&out);
    assert!(err.starts_with("error: --device cuda:99: there is no cuda:99; libtorch "), "{err}");
    assert!(err.contains(" (CUDA 1") && err.contains(", cuDNN "), "libtorch's CUDA was not loaded: {err}");
    assert_eq!(stderr(&out).lines().count(), 1, "{}", text(&out));
}

/// `--collective nccl` where the worker trains on the CPU (any machine without a GPU, or
/// `--device cpu`): one line naming NCCL and CUDA. A backend that does not exist names the three.
#[test]
fn nccl_without_cuda_and_an_unknown_backend_are_one_line_each() {
    let run = |collective: &str| {
        RunArgs::new("linear").set("--device", "cpu").set("--collective", collective).command("run").output().unwrap()
    };
    let out = run("nccl");
    assert_eq!(
        error_of(&out),
        "error: --collective nccl needs CUDA: NCCL moves CUDA tensors only, and this worker trains on cpu"
    );
    assert_eq!(stderr(&out).lines().count(), 1, "{}", text(&out));
    let out = run("mpi");
    assert_eq!(error_of(&out), "error: --collective mpi: expected ring, nccl or auto");
}
