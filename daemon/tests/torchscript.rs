//! Models written in PyTorch, trained by trainerd through the torchscript plugin: each example
//! model (plugins/torchscript/examples) scripted with the venv's PyTorch, trained on two workers,
//! and compared with PyTorch eager training the same initial weights in trainerd's data order;
//! the BatchNorm model killed and resumed; the refusals of a wrong file, of workers whose files
//! differ and of bad arguments, each with its message.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use trainerd_sdk::{mnist::Mnist, Split};
use trainerd_testkit::output::{error_line, error_of, json, params_sha256, stdout, step_losses, text};
use trainerd_testkit::{dataset, free_ports, plugin, python, tf_config, trainerd_cmd, Event, RunArgs, Worker};

/// Per-worker batch and seed of every run here.
const BATCH: usize = 32;
const SEED: u64 = 5;

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins/torchscript/examples")
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `examples/script.py MODEL` run by the venv's PyTorch: the scripted file, in `dir`.
fn script(model: &str, dir: &Path) -> PathBuf {
    let file = dir.join(format!("{model}.pt"));
    let out = Command::new(python()).arg(examples().join("script.py")).args([model, path(&file)]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    file
}

/// The torchscript plugin training `model` scripted to `module`.
fn scripted(model: &str, module: &Path) -> RunArgs {
    let run = RunArgs::new("torchscript").plugin_arg(format!("module={}", module.display()));
    if model == "transformer" {
        return run.plugin_arg("input_shape=28x28");
    }
    run
}

/// The flags of a two-worker run of `model` for `epochs` of `steps` steps.
fn run_args(model: &str, module: &Path, (epochs, steps): (u32, u64), dir: &Path) -> RunArgs {
    scripted(model, module)
        .epochs(epochs)
        .steps(steps)
        .batch(BATCH as u32)
        .seed(SEED)
        .threads(1)
        .summary(dir.join("s.json"))
        .set("--metrics-log", path(&dir.join("steps.jsonl")))
}

/// trainerd's data order for `epochs` epochs of the training split, as little-endian int64s.
fn order_file(dir: &Path, epochs: u64) -> PathBuf {
    let n = Mnist::load(&dataset(), Split::Train).unwrap().len();
    let bytes: Vec<u8> = (0..epochs)
        .flat_map(|e| trainerd_sdk::data::epoch_permutation(n, SEED, e))
        .flat_map(|i| i.to_le_bytes())
        .collect();
    let file = dir.join("order.bin");
    std::fs::write(&file, bytes).unwrap();
    file
}

/// `examples/eager.py`: PyTorch eager from `module`'s weights in trainerd's order, on two emulated
/// workers; its JSON (each step's loss, the test accuracy).
fn eager(model: &str, module: &Path, (epochs, steps): (u32, u64), dir: &Path) -> serde_json::Value {
    let order = order_file(dir, u64::from(epochs));
    let result = dir.join("eager.json");
    let out = Command::new(python())
        .arg(examples().join("eager.py"))
        .args(["--model", model, "--module", path(module), "--data", path(&dataset()), "--order", path(&order)])
        .args(["--workers", "2", "--batch", &BATCH.to_string(), "--steps", &steps.to_string()])
        .args(["--epochs", &epochs.to_string(), "--out", path(&result)])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    json(&result)
}

/// Scripts `model`, trains it on two workers and with PyTorch eager: identical parameters on both
/// workers, the accuracy `bar` reached, the test accuracy within 0.01 of eager's, and the first 20
/// losses within 1e-4 relative error of eager's.
fn trains_as_pytorch_eager_does(model: &str, steps: u64, bar: f64) {
    let tmp = tempfile::tempdir().unwrap();
    let module = script(model, tmp.path());
    let out = run_args(model, &module, (1, steps), tmp.path()).local(2).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let (w0, w1) = (json(&tmp.path().join("s.worker0.json")), json(&tmp.path().join("s.worker1.json")));
    assert_eq!(w0["params_sha256"], w1["params_sha256"], "the replicas differ");
    let accuracy = w0["test_accuracy"].as_f64().unwrap();
    assert!(accuracy >= bar, "{model}: test accuracy {accuracy} < {bar}");

    let eager = eager(model, &module, (1, steps), tmp.path());
    let eager_accuracy = eager["test_accuracy"].as_f64().unwrap();
    assert!((accuracy - eager_accuracy).abs() <= 0.01, "{model}: trainerd {accuracy}, PyTorch eager {eager_accuracy}");
    let ours = step_losses(&tmp.path().join("steps.worker0.jsonl"));
    let theirs: Vec<f64> = eager["losses"].as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).collect();
    assert_eq!(ours.len(), theirs.len());
    for (step, (a, b)) in ours.iter().zip(&theirs).take(20).enumerate() {
        assert!((a - b).abs() <= 1e-4 * b.abs(), "{model}: step {} loss {a}, PyTorch eager {b}", step + 1);
    }
    let worst = ours.iter().zip(&theirs).take(20).map(|(a, b)| (a - b).abs() / b.abs()).fold(0.0, f64::max);
    println!("{model}: test accuracy {accuracy} (PyTorch eager {eager_accuracy}); first 20 losses within {worst:.1e}");
}

#[test]
fn the_tutorials_cnn_scripted_in_pytorch_trains_on_two_workers_as_pytorch_eager_does() {
    trains_as_pytorch_eager_does("cnn", 300, 0.82);
}

#[test]
fn a_transformer_scripted_in_pytorch_trains_on_two_workers_as_pytorch_eager_does() {
    trains_as_pytorch_eager_does("transformer", 300, 0.75);
}

#[test]
fn a_batchnorm_model_scripted_in_pytorch_trains_on_two_workers_as_pytorch_eager_does() {
    trains_as_pytorch_eager_does("bn", 300, 0.82);
}

const WAIT: Duration = Duration::from_secs(120);

/// The BatchNorm model's buffers are state like its weights: a worker SIGKILLed mid-epoch rejoins
/// with them from its peer, and the whole cluster stopped and started again resumes them from a
/// checkpoint; the end is bitwise the uninterrupted run's.
#[test]
fn a_scripted_batchnorm_model_killed_and_resumed_ends_bitwise_as_the_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    let module = script("bn", tmp.path());
    let run = |name: &str| {
        let dir = tmp.path().join(name);
        std::fs::create_dir(&dir).unwrap();
        let args = run_args("bn", &module, (2, 150), &dir).checkpoints(dir.join("ckpt"), 40);
        (dir, args)
    };
    let start = |args: &RunArgs| {
        Worker::start(&[&["local", "--workers", "2", "--restart-delay", "0"][..], &args.strs()].concat())
    };
    let (reference, args) = run("reference");
    assert!(start(&args).wait().success());

    let (killed, args) = run("killed");
    let mut cluster = start(&args);
    let pid = cluster.wait_event(|r| r.worker == Some(1), WAIT).pid;
    cluster.wait_event(|r| r.worker == Some(0) && matches!(r.event, Event::Step { global_step: 70, .. }), WAIT);
    // SAFETY: kill(2) on the launcher's worker 1, a process this test started through it.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) }, 0);
    let rejoined = |r: &trainerd_testkit::events::Record| r.worker == Some(1) && r.pid != pid;
    cluster.wait_event(|r| rejoined(r) && matches!(r.event, Event::Step { .. }), WAIT);
    // Then the whole cluster stops after a commit in epoch 2, and starts again from it.
    let late = |r: &trainerd_testkit::events::Record| {
        r.worker == Some(0) && matches!(r.event, Event::Committed { global_step, .. } if global_step > 150)
    };
    cluster.wait_event(late, WAIT);
    cluster.kill(libc::SIGTERM);
    let mut again = start(&args);
    again.wait_event(|r| r.worker == Some(0) && matches!(r.event, Event::Resumed { .. }), WAIT);
    assert!(again.wait().success());
    let expected = params_sha256(&reference.join("s.worker0.json"));
    assert_eq!(params_sha256(&killed.join("s.worker0.json")), expected);
    assert_eq!(params_sha256(&killed.join("s.worker1.json")), expected);
}

/// `trainerd run --plugin torchscript` of worker `index` of a cluster on `ports`, with the plugin
/// arguments `args` (`KEY=VALUE`).
fn spawn_worker(ports: &[u16], index: usize, args: &[String]) -> Child {
    let run = RunArgs::new("torchscript").threads(1).steps(5).epochs(1).set("--rendezvous-timeout", 8);
    args.iter()
        .fold(run, |run, kv| run.plugin_arg(kv))
        .command("run")
        .env("TF_CONFIG", tf_config(ports, index))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The refusal worker 1 gets when it starts with `theirs` against a chief with `ours`.
fn refusal(ours: &[String], theirs: &[String]) -> (String, String) {
    let ports = free_ports(2);
    let chief = spawn_worker(&ports, 0, ours);
    let other = spawn_worker(&ports, 1, theirs).wait_with_output().unwrap();
    let _ = chief.wait_with_output().unwrap();
    (error_line(&other), format!("worker 1 (127.0.0.1:{})", ports[1]))
}

fn sha256_hex(file: &Path) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(std::fs::read(file).unwrap()).iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn workers_with_different_files_or_arguments_are_refused_naming_both() {
    let tmp = tempfile::tempdir().unwrap();
    let cnn = script("cnn", tmp.path());
    let bn = script("bn", tmp.path());
    let arg = |kv: String| vec![kv];
    let (line, w1) = refusal(&arg(format!("module={}", cnn.display())), &arg(format!("module={}", bn.display())));
    assert_eq!(
        line.split(" on the chief").next().unwrap(),
        format!(
            "error: rendezvous refused by the chief: {w1} has a different run configuration: \
             plugin.identity.module_sha256 = \"{}\" on {w1}, \"{}\"",
            sha256_hex(&bn),
            sha256_hex(&cnn)
        )
    );
    // The same file under another path is the same model, and a default given is the default
    // left out; an agreed argument that differs is refused.
    let copy = tmp.path().join("copy-of-cnn.pt");
    std::fs::copy(&cnn, &copy).unwrap();
    let chief = [arg(format!("module={}", cnn.display())), arg("loss=cross_entropy".into())].concat();
    let ports = free_ports(2);
    let (a, b) = (spawn_worker(&ports, 0, &chief), spawn_worker(&ports, 1, &arg(format!("module={}", copy.display()))));
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    assert!(a.status.success() && b.status.success(), "{}\n{}", text(&a), text(&b));
    let chief = [arg(format!("module={}", cnn.display())), arg("metrics=none".into())].concat();
    let (line, w1) = refusal(&chief, &arg(format!("module={}", copy.display())));
    assert!(
        line.starts_with(&format!(
            "error: rendezvous refused by the chief: {w1} has a different run configuration: plugin.args.metrics = \
             (absent) on {w1}, \"none\" on the chief"
        )),
        "{line}"
    );
}

/// `trainerd run` of the torchscript plugin with the plugin arguments `args` (`KEY=VALUE`), alone,
/// for a few steps.
fn run_alone(args: &[&str]) -> Output {
    let run = RunArgs::new("torchscript").threads(1).steps(3).epochs(1).on("--no-evaluation");
    args.iter().fold(run, |run, kv| run.plugin_arg(kv)).command("run").output().unwrap()
}

#[test]
fn a_wrong_file_or_argument_is_one_error_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let so = plugin("torchscript");
    let prefix = format!("error: plugin {}: ", so.display());
    let not_script = tmp.path().join("weights.pt");
    std::fs::write(&not_script, b"not a zip archive").unwrap();
    let module = |p: &Path| format!("module={}", p.display());
    let out = run_alone(&[&module(&not_script)]);
    assert!(
        error_of(&out).starts_with(&format!(
            "{prefix}module {} is not a TorchScript file that this libtorch can load (torch.jit.script(model)\
             .save(PATH) writes one): PytorchStreamReader failed reading zip archive",
            not_script.display()
        )),
        "{}",
        text(&out)
    );
    assert_eq!(
        error_of(&run_alone(&[&module(&tmp.path().join("absent.pt"))])),
        format!(
            "{prefix}module {}: cannot be read: No such file or directory (os error 2)",
            tmp.path().join("absent.pt").display()
        )
    );
    assert_eq!(
        error_of(&run_alone(&[])),
        format!(
            "{prefix}--plugin-arg module=PATH is required: the TorchScript file to train, as \
             torch.jit.script(model).save(PATH) writes it"
        )
    );
    // The transformer takes rows as a sequence: fed images, it fails on the sample batch.
    let transformer = script("transformer", tmp.path());
    let out = run_alone(&[&module(&transformer)]);
    assert_eq!(
        error_of(&out),
        format!(
            "{prefix}module {} fails on a sample batch [2, 1, 28, 28] float32: RuntimeError: Expected 3 elements in a \
             list but found 4 (give the input's shape and dtype with --plugin-arg input_shape= and input_dtype=)",
            transformer.display()
        )
    );
    let out = run_alone(&[&module(&transformer), "input_shape=28x27"]);
    assert_eq!(
        error_of(&out),
        format!(
            "{prefix}--plugin-arg input_shape=28x27: 756 values per example, but an image of 1x28x28 has 784 (the \
             input is the image reshaped)"
        )
    );
    let out = run_alone(&[&module(&transformer), "loss=hinge"]);
    assert_eq!(error_of(&out), format!("{prefix}--plugin-arg loss=hinge: expected cross_entropy or mse"));
    let out = run_alone(&[&module(&transformer), "inputshape=28x28"]);
    assert_eq!(
        error_of(&out),
        format!(
            "{prefix}--plugin-arg inputshape: no such key; it accepts module, image_shape, input_shape, \
             input_dtype, loss, metrics"
        )
    );
    // A module with nothing to train.
    let frozen = tmp.path().join("frozen.pt");
    let freeze = "import sys, torch\nm = torch.nn.Linear(784, 10)\nm.requires_grad_(False)\n\
                  torch.jit.script(torch.nn.Sequential(torch.nn.Flatten(), m)).save(sys.argv[1])\n";
    let made = Command::new(python()).args(["-c", freeze, path(&frozen)]).output().unwrap();
    assert!(made.status.success(), "{}", text(&made));
    assert_eq!(
        error_of(&run_alone(&[&module(&frozen)])),
        format!("{prefix}module {} has no trainable parameters: nothing to train", frozen.display())
    );
}

/// `plugin check` describes the module: its parameters and buffers with their shapes, its input,
/// the keys the plugin accepts, and the file's sha256; the same keys come from
/// `TRAINERD_PLUGIN_ARGS`.
#[test]
fn plugin_check_describes_the_module_and_lists_the_keys() {
    let tmp = tempfile::tempdir().unwrap();
    let bn = script("bn", tmp.path());
    let out = trainerd_cmd()
        .args(["plugin", "check"])
        .arg(plugin("torchscript"))
        .env("TRAINERD_PLUGIN_ARGS", format!("module={} loss=cross_entropy", bn.display()))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let text = stdout(&out);
    for expected in [
        format!(
            "description: TorchScript module {}: input [batch, 1, 28, 28] float32 -> [batch, 10], loss \
             cross_entropy; 7 parameter(s), 3 buffer(s)\n",
            bn.display()
        ),
        "parameters: 7 tensors, 347,178 values (model.bn.bias [32], ".into(),
        "buffers: 3 tensors (model.bn.num_batches_tracked [], model.bn.running_mean [32], model.bn.running_var [32])\n"
            .into(),
        format!("  module: the TorchScript file to train, as torch.jit.script(model).save(PATH) writes it (required; its sha256 is the model's identity, so the path may differ between workers) = {}\n", bn.display()),
        "  loss: cross_entropy (the module returns class logits) or mse (one output per example, the label as a number) (default cross_entropy) = cross_entropy\n".into(),
        format!("identity:\n  module_sha256: {}\n", sha256_hex(&bn)),
    ] {
        assert!(text.contains(&expected), "no {expected:?} in\n{text}");
    }
}

/// A scripted model reads Fashion-MNIST as Parquet (the plugin declares Hugging Face's image
/// columns) exactly as it reads the idx files: the same parameters, bit for bit. Its checkpoint is
/// evaluated and predicts with the same file, and is refused with another, naming both hashes.
#[test]
fn a_scripted_model_trains_from_parquet_as_from_idx_and_its_checkpoint_is_its_files_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let cnn = script("cnn", tmp.path());
    let train = |data: &Path, name: &str| {
        let out = scripted("cnn", &cnn)
            .threads(1)
            .epochs(1)
            .steps(40)
            .on("--no-evaluation")
            .data(data)
            .checkpoints(tmp.path().join(name), 0)
            .summary(tmp.path().join(format!("{name}.json")))
            .command("run")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out));
        params_sha256(&tmp.path().join(format!("{name}.json")))
    };
    assert_eq!(train(&trainerd_testkit::parquet_dataset(), "parquet"), train(&dataset(), "idx"));

    let evaluate = |module: &Path| {
        let run = RunArgs::new("torchscript").threads(1).set("--checkpoint", path(&tmp.path().join("idx")));
        run.plugin_arg(format!("module={}", module.display())).command("evaluate").output().unwrap()
    };
    let same = evaluate(&cnn);
    assert!(same.status.success(), "{}", text(&same));
    // Its predictions: every test example's 10 logits.
    let predictions = tmp.path().join("predictions.parquet");
    let out = RunArgs::new("torchscript")
        .threads(1)
        .plugin_arg(format!("module={}", cnn.display()))
        .set("--checkpoint", path(&tmp.path().join("idx")))
        .set("--output", path(&predictions))
        .command("predict")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(stdout(&out).contains("predicted 10000 test examples with checkpoint 1"), "{}", stdout(&out));
    assert!(stdout(&out).contains("outputs of shape [10] each"), "{}", stdout(&out));
    let bn = script("bn", tmp.path());
    assert_eq!(
        error_of(&evaluate(&bn)),
        format!(
            "error: checkpoint: {}: checkpoint 1 was written by another model of plugin torchscript: \
             plugin.identity.module_sha256 is \"{}\" in the checkpoint, \"{}\" in this run",
            tmp.path().join("idx").display(),
            sha256_hex(&cnn),
            sha256_hex(&bn)
        )
    );
}
