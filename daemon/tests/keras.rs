//! Keras 3 models (their torch backend) as TensorFlow's tutorials write them, trained through the
//! python-model plugin: the two tutorial models (plugins/python-model/examples/keras_*.py) on two
//! workers against Keras's own training (examples/keras_fit.py) from the same initial weights in
//! the same order; BatchNormalization and Dropout on two workers bitwise one worker accumulating
//! two; a kill and resume, and a worker gone for good, bitwise; the export loaded back into Keras
//! by path; a regularizer's penalty in the loss; a subclassed model built from the data's shapes;
//! the identity and the start-up line; and every refusal of what trainerd cannot take.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use trainerd_testkit::output::{error_of, json, params_sha256, stdout, step_losses, text};
use trainerd_testkit::{dataset, parquet_dataset, python, python_examples, trainerd_cmd, Event, RunArgs, Worker};

const SEED: u64 = 3;
/// Per-worker batch of the tutorials' runs (the multi-worker tutorial's 64).
const BATCH: u32 = 64;
/// Steps of the tutorials' runs (of a global batch of 128).
const STEPS: u64 = 150;
const WAIT: Duration = Duration::from_secs(240);

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn file(dir: &Path, name: &str, source: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, source).unwrap();
    p
}

/// A run of the model file `module` on `data`, one thread per worker.
fn keras_run(module: &Path, data: &Path) -> RunArgs {
    RunArgs::new("python-model").data(data).plugin_arg(format!("module={}", module.display())).seed(SEED).threads(1)
}

/// Each step's rows ([file, row] ids), worker 0's then worker 1's: the global batch in slot order.
fn order(dir: &Path, workers: usize) -> serde_json::Value {
    let lines = |w: usize| -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(dir.join(format!("ex.worker{w}.jsonl"))).unwrap();
        text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    let all: Vec<Vec<serde_json::Value>> = (0..workers).map(lines).collect();
    let steps = (0..all[0].len())
        .map(|s| all.iter().flat_map(|w| w[s]["ids"].as_array().unwrap().iter().cloned()).collect::<Vec<_>>())
        .collect::<Vec<_>>();
    serde_json::json!(steps)
}

/// examples/keras_fit.py over `module` (Keras's own training); its JSON.
fn keras_fit(module: &Path, dir: &Path, args: &[&str]) -> serde_json::Value {
    let out = dir.join("keras.json");
    let run = Command::new(python())
        .arg(python_examples().join("keras_fit.py"))
        .args(["--module", path(module), "--data", path(&dataset()), "--parquet", path(&parquet_dataset())])
        .args(["--seed", &SEED.to_string(), "--out", path(&out)])
        .args(args)
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", text(&run));
    json(&out)
}

/// Trains the tutorial model `example` on two workers and checks what its users rely on: both
/// workers end alike; the first 20 losses are Keras's train step's from the same initial weights
/// in the same order (the loss, regularizers and optimizer compile() named, with Keras's rules);
/// the loss falls; the test accuracy is within 0.01 of Keras's after the same steps, and above
/// `bar`.
fn trains_as_keras_does(example: &str, bar: f64) -> (tempfile::TempDir, f64) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let module = python_examples().join(example);
    let run = keras_run(&module, &parquet_dataset())
        .batch(BATCH)
        .epochs(1)
        .steps(STEPS)
        .summary(dir.join("s.json"))
        .checkpoints(dir.join("ckpt"), 0)
        .set("--metrics-log", path(&dir.join("steps.jsonl")))
        .set("--log-examples", path(&dir.join("ex.jsonl")));
    let out = run.local(2).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let said = stdout(&out);
    assert!(said.contains("trainerd: optimizer from compile(): "), "{said}");
    let (w0, w1) = (json(&dir.join("s.worker0.json")), json(&dir.join("s.worker1.json")));
    assert_eq!(w0["params_sha256"], w1["params_sha256"], "{example}: the replicas differ");

    let order_file = dir.join("order.json");
    std::fs::write(&order_file, order(dir, 2).to_string()).unwrap();
    let keras = keras_fit(&module, dir, &["--order", path(&order_file), "--steps", &STEPS.to_string(), "--test"]);
    let ours = step_losses(&dir.join("steps.worker0.jsonl"));
    let theirs: Vec<f64> = keras["losses"].as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).collect();
    assert_eq!(ours.len(), theirs.len());
    for (step, (a, b)) in ours.iter().zip(&theirs).take(20).enumerate() {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{example}: step {} loss {a}, Keras's {b}", step + 1);
    }
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    let (first, last) = (mean(&ours[..10]), mean(&ours[ours.len() - 10..]));
    assert!(last < first, "{example}: the loss went from {first} to {last}");
    let accuracy = w0["test_accuracy"].as_f64().unwrap();
    let theirs_accuracy = keras["test"]["accuracy"].as_f64().unwrap();
    assert!(
        (accuracy - theirs_accuracy).abs() <= 0.01 && accuracy > bar,
        "{example}: test accuracy {accuracy}, Keras's {theirs_accuracy} (bar {bar})"
    );
    (tmp, accuracy)
}

#[test]
fn the_multi_worker_tutorial_model_trains_on_two_workers_as_keras_does() {
    // SGD at 0.001 into a softmax learns slowly (the tutorial's own log: 0.43 after its first
    // epoch of 938 steps on MNIST): after these 150 steps it is still near chance, as Keras's is.
    trains_as_keras_does("keras_multi_worker.py", 0.05);
}

/// The custom-training-loop tutorial's model, and its export: named by the variables' paths, it
/// loads back into the same Keras model with the README's one-liner, which then evaluates and
/// predicts as trainerd does.
#[test]
fn the_custom_loop_tutorial_model_trains_on_two_workers_as_keras_does_and_its_export_loads_into_keras() {
    let (tmp, _) = trains_as_keras_does("keras_custom_loop.py", 0.6);
    let dir = tmp.path();
    let module = python_examples().join("keras_custom_loop.py");
    let weights = dir.join("model.safetensors");
    let out = trainerd_cmd().args(["ckpt", "export", path(&dir.join("ckpt")), "--output", path(&weights)]).output();
    assert!(out.as_ref().unwrap().status.success(), "{}", text(&out.unwrap()));
    let names = Command::new(python())
        .args(["-c", "import sys, safetensors; print(sorted(safetensors.safe_open(sys.argv[1], 'np').keys()))"])
        .arg(&weights)
        .output()
        .unwrap();
    assert_eq!(
        stdout(&names).trim(),
        "['sequential/conv2d/bias', 'sequential/conv2d/kernel', 'sequential/dense/bias', 'sequential/dense/kernel', \
         'sequential/dense_1/bias', 'sequential/dense_1/kernel']"
    );
    let keras = keras_fit(&module, dir, &["--init", path(&weights), "--test", "--predict", "64"]);
    let loss = json(&dir.join("s.worker0.json"))["test_loss"].as_f64().unwrap();
    let theirs = keras["test"]["loss"].as_f64().unwrap();
    assert!((theirs - loss).abs() <= 1e-5 * loss, "trainerd's test loss {loss}, the export's in Keras {theirs}");

    let predictions = dir.join("predictions.parquet");
    let out = RunArgs::new("python-model")
        .data(dataset())
        .plugin_arg(format!("module={}", module.display()))
        .threads(1)
        .batch(64)
        .set("--checkpoint", path(&dir.join("ckpt")))
        .set("--output", path(&predictions))
        .command("predict")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let check = r#"
import json, sys, numpy as np, pyarrow.parquet as pq
t = pq.read_table(sys.argv[1])
ids = t.column("example").to_pylist()[:64]
assert ids == list(range(64)), ids[:5]
ours = np.stack(t.column("output").to_numpy(zero_copy_only=False))[:64].reshape(64, -1)
theirs = np.asarray(json.load(open(sys.argv[2]))["predictions"], dtype=np.float32)
assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
worst = float(np.abs(ours - theirs).max())
assert worst <= 1e-5, worst
"#;
    let out =
        Command::new(python()).args(["-c", check]).arg(&predictions).arg(dir.join("keras.json")).output().unwrap();
    assert!(out.status.success(), "trainerd's predictions differ from Keras's of the export: {}", text(&out));
}

/// BatchNormalization (its moving statistics are state), an unseeded Dropout (drawn from torch's
/// generator) and a seeded one (its seed generator's state drawn afresh from trainerd's per-step,
/// per-slot seed).
const BN_DROPOUT: &str = include_str!("fixtures/keras_bn_dropout.py");

#[test]
fn batch_norm_and_dropout_on_two_workers_are_bitwise_one_worker_accumulating_two() {
    let tmp = tempfile::tempdir().unwrap();
    let module = file(tmp.path(), "bn_dropout.py", BN_DROPOUT);
    let run = |name: &str| keras_run(&module, &dataset()).epochs(1).steps(30).summary(tmp.path().join(name));
    let two = run("two.json").batch(16).local(2).output().unwrap();
    assert!(two.status.success(), "{}", text(&two));
    let one = run("one.json").batch(16).set("--accumulate", 2).command("run").output().unwrap();
    assert!(one.status.success(), "{}", text(&one));
    let expected = params_sha256(&tmp.path().join("one.json"));
    assert_eq!(params_sha256(&tmp.path().join("two.worker0.json")), expected);
    assert_eq!(params_sha256(&tmp.path().join("two.worker1.json")), expected);
}

/// A run named `name` of the BatchNorm and Dropout model `module`: its directory under `root`, its
/// flags (batch 16, its summary in the directory).
fn bn_dropout_run(root: &Path, module: &Path, name: &str) -> (PathBuf, RunArgs) {
    let dir = root.join(name);
    std::fs::create_dir(&dir).unwrap();
    let args = keras_run(module, &dataset()).batch(16).summary(dir.join("s.json"));
    (dir, args)
}

fn launch(args: &RunArgs) -> Worker {
    Worker::start(&[&["local", "--restart-delay", "0", "--workers", "2"][..], &args.strs()].concat())
}

/// With BatchNormalization and both Dropouts, worker 1 SIGKILLed mid-epoch comes back, then the
/// whole cluster is stopped and resumes from its checkpoint: the end is bitwise the uninterrupted
/// run's.
#[test]
fn a_keras_model_killed_and_resumed_ends_bitwise() {
    let tmp = tempfile::tempdir().unwrap();
    let module = file(tmp.path(), "bn_dropout.py", BN_DROPOUT);
    let run = |name: &str| {
        let (dir, args) = bn_dropout_run(tmp.path(), &module, name);
        let args = args.epochs(2).steps(40).checkpoints(dir.join("ckpt"), 10);
        (dir, args)
    };
    let (reference, args) = run("reference");
    assert!(launch(&args).wait().success());
    let (killed, args) = run("killed");
    let mut cluster = launch(&args);
    let pid = cluster.wait_event(|r| r.worker == Some(1), WAIT).pid;
    cluster.wait_event(|r| r.worker == Some(0) && matches!(r.event, Event::Step { global_step: 15, .. }), WAIT);
    // SAFETY: kill(2) on the launcher's worker 1, a process this test started through it.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) }, 0);
    let late = |r: &trainerd_testkit::events::Record| {
        r.worker == Some(0) && matches!(r.event, Event::Committed { global_step, .. } if global_step >= 50)
    };
    cluster.wait_event(late, WAIT);
    cluster.kill(libc::SIGTERM);
    let mut again = launch(&args);
    again.wait_event(|r| r.worker == Some(0) && matches!(r.event, Event::Resumed { .. }), WAIT);
    assert!(again.wait().success());
    let expected = params_sha256(&reference.join("s.worker0.json"));
    assert_eq!(params_sha256(&killed.join("s.worker0.json")), expected);
    assert_eq!(params_sha256(&killed.join("s.worker1.json")), expected);
}

/// The custom-loop tutorial's model with its L2 factor as an argument.
const L2: &str = r#"import keras
arguments = {"l2": "1e-5"}

def model(args):
    regularizer = keras.regularizers.L2(float(args["l2"]))
    m = keras.Sequential([
        keras.Input(shape=(28, 28)),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu", kernel_regularizer=regularizer),
        keras.layers.Dense(10, kernel_regularizer=regularizer),
    ])
    m.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              optimizer=keras.optimizers.RMSprop(0.001))
    return m
"#;

/// The regularizers' penalties are in the loss trainerd minimises: the same model with its L2
/// factor scaled up ends with a smaller weight norm, and a higher loss at the first step.
#[test]
fn a_scaled_up_regularizer_ends_with_a_smaller_weight_norm() {
    let tmp = tempfile::tempdir().unwrap();
    let module = file(tmp.path(), "l2.py", L2);
    let train = |l2: &str| {
        let dir = tmp.path().join(l2);
        std::fs::create_dir(&dir).unwrap();
        let run = keras_run(&module, &dataset())
            .plugin_arg(format!("l2={l2}"))
            .epochs(1)
            .steps(60)
            .batch(64)
            .on("--no-evaluation")
            .checkpoints(dir.join("ckpt"), 0)
            .set("--metrics-log", path(&dir.join("steps.jsonl")));
        let out = run.command("run").output().unwrap();
        assert!(out.status.success(), "{}", text(&out));
        let weights = dir.join("w.safetensors");
        let out = trainerd_cmd().args(["ckpt", "export", path(&dir.join("ckpt")), "--output", path(&weights)]).output();
        assert!(out.unwrap().status.success());
        let norm = Command::new(python())
            .args([
                "-c",
                "import sys, numpy as np; from safetensors.numpy import load_file; w = load_file(sys.argv[1]); \
                          print(sum(float((v ** 2).sum()) for k, v in w.items() if k.endswith('kernel')) ** 0.5)",
            ])
            .arg(&weights)
            .output()
            .unwrap();
        assert!(norm.status.success(), "{}", text(&norm));
        (stdout(&norm).trim().parse::<f64>().unwrap(), step_losses(&dir.join("steps.jsonl"))[0])
    };
    let (small, small_first) = train("1e-5");
    let (large, large_first) = train("0.05");
    assert!(large < 0.85 * small, "kernel norm {large} with L2 0.05, {small} with 1e-5");
    assert!(large_first > small_first + 1.0, "first loss {large_first} with L2 0.05, {small_first} with 1e-5");
}

/// `trainerd run` of `source` for 1 step; its output.
fn run_source(dir: &Path, source: &str, flags: &[&str]) -> Output {
    let module = file(dir, "m.py", source);
    let run = keras_run(&module, &dataset()).epochs(1).steps(1).batch(8).on("--no-evaluation");
    run.extend(flags).command("run").output().unwrap()
}

/// A model of the tutorial's shape whose compile() and layers are `compile` and `layers`.
fn source(layers: &str, compile: &str) -> String {
    format!(
        "import keras\n\ndef model(args):\n    m = keras.Sequential([keras.Input(shape=(28, 28, 1)), keras.layers.Flatten(), \
         {layers}keras.layers.Dense(10)])\n    {compile}\n    return m\n"
    )
}

const LOSS: &str = "loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)";

#[test]
fn what_trainerd_cannot_take_of_a_keras_model_is_refused_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let module = tmp.path().join("m.py");
    let refused = |layers: &str, compile: &str| -> String {
        let out = run_source(tmp.path(), &source(layers, compile), &[]);
        assert!(!out.status.success(), "{}", text(&out));
        let told = error_of(&out);
        let at = format!("model file {}: ", module.display());
        told.find(&at).map(|i| told[i + at.len()..].to_string()).unwrap_or(told)
    };
    let cases = [
        ("", "pass", "model(args) returned a Keras model that is not compiled: call model.compile(loss=..., optimizer=..., metrics=[...]) before returning it".to_string()),
        ("", "m.compile(optimizer='sgd')", "the Keras model was compiled without a loss: compile(loss=...) names the loss trainerd minimises".into()),
        ("", "m.compile(optimizer='sgd', loss=keras.losses.SparseCategoricalCrossentropy(reduction='sum'))", "compile(loss=...) SparseCategoricalCrossentropy has reduction='sum', which is not the batch's mean; trainerd averages the workers' mean losses: use reduction='sum_over_batch_size' (Keras's default)".into()),
        ("", "m.compile(optimizer='sgd', loss=[keras.losses.MeanSquaredError()])", "compile(loss=...) is a list of losses (one per output); trainerd trains a Keras model of one output with one loss".into()),
        ("", &format!("m.compile(optimizer='sgd', {LOSS}, metrics=[keras.metrics.AUC()])"), format!("compile(metrics=[...]) AUC ('auc') is not a mean over examples, which is what trainerd adds up over the workers; it takes {}", "those that are a mean over examples: accuracy (and binary_, categorical_, sparse_categorical_, top_k_ and sparse_top_k_categorical_accuracy), mean_squared_error, mean_absolute_error, mean_absolute_percentage_error, mean_squared_logarithmic_error, the crossentropies, hinge, kl_divergence, log_cosh_error, poisson, cosine_similarity")),
        ("", &format!("m.compile(optimizer='sgd', {LOSS}, metrics=['precision'])"), "compile(metrics=[...]) Precision ('precision') is not a mean over examples".into()),
        ("", &format!("m.compile(optimizer=keras.optimizers.Adagrad(), {LOSS})"), "compile(optimizer=...) Adagrad is not taken; trainerd runs SGD, Adam, AdamW and RMSprop with Keras's rules".into()),
        ("", &format!("m.compile(optimizer=keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 100, 0.9)), {LOSS})"), "compile(optimizer=...) SGD's learning_rate is a schedule (ExponentialDecay); trainerd's schedules are flags: give a number and --lr-schedule (constant, step, exponential, cosine, linear, wsd) with --warmup-steps".into()),
        ("", &format!("m.compile(optimizer=keras.optimizers.Adam(amsgrad=True), {LOSS})"), "compile(optimizer=...) Adam(amsgrad=True) is not taken: trainerd's Adam has no AMSGrad".into()),
        ("", &format!("m.compile(optimizer=keras.optimizers.SGD(gradient_accumulation_steps=2), {LOSS})"), "compile(optimizer=...) SGD(gradient_accumulation_steps=2) is not taken: use --accumulate N (micro-batches per update)".into()),
        ("", &format!("m.compile(optimizer='sgd', {LOSS}, jit_compile=True)"), "compile(jit_compile=True) is not taken: trainerd runs the model eagerly (torch.compile is not used); leave jit_compile at its default".into()),
        ("keras.layers.Dense(16, dtype='float64'), ", &format!("m.compile(optimizer='sgd', {LOSS})"), "the Keras variable sequential/dense/kernel is float64; trainerd trains float32 variables (keep the layers' dtype and keras.config.floatx() at float32)".into()),
        ("keras.layers.Dense(16, dtype='mixed_float16'), ", &format!("m.compile(optimizer='sgd', {LOSS})"), "layer 'dense' (Dense) computes in float16 (dtype policy 'mixed_float16'); trainerd trains float32 layers: for mixed precision, give --precision bf16 (fp16 on CUDA) and leave the policy at float32".into()),
    ];
    for (layers, compile, expected) in cases {
        let told = refused(layers, compile);
        assert!(told.starts_with(&expected), "{compile}:\n  told:     {told}\n  expected: {expected}");
    }
    // Keras on another backend than torch (the file set it; JAX is not installed).
    let jax = format!("import os\nos.environ['KERAS_BACKEND'] = 'jax'\n{}", source("", "pass"));
    let out = run_source(tmp.path(), &jax, &[]);
    assert!(!out.status.success());
    assert!(
        error_of(&out).contains(&format!(
            "model file {}: Keras's backend is jax here, not torch: trainerd trains Keras models on the torch \
             backend, and the plugin sets KERAS_BACKEND=torch before the file runs; do not set it in the file \
             (importing it raised ModuleNotFoundError: No module named 'jax')",
            module.display()
        )),
        "{}",
        error_of(&out)
    );
    // A flag of another optimizer's, over compile()'s.
    let adam = source("", &format!("m.compile(optimizer=keras.optimizers.Adam(), {LOSS})"));
    let out = run_source(tmp.path(), &adam, &["--momentum", "0.9"]);
    assert!(!out.status.success());
    assert_eq!(error_of(&out), "error: --momentum does not apply to optimizer adam");
}

/// The start-up line says the optimizer is compile()'s, with Keras's rules, and which flags won.
#[test]
fn the_start_up_line_says_which_of_compile_and_the_flags_won() {
    let tmp = tempfile::tempdir().unwrap();
    let rms = source("", &format!("m.compile(optimizer=keras.optimizers.RMSprop(0.001, clipnorm=1.0), {LOSS})"));
    let out = run_source(tmp.path(), &rms, &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        stdout(&out).contains(
            "trainerd: optimizer from compile(): rmsprop with Keras's update rules, learning_rate 0.001, rho 0.9, \
             momentum 0, epsilon 0.0000001, centered false, clipnorm 1\n"
        ),
        "{}",
        stdout(&out)
    );
    let out = run_source(tmp.path(), &rms, &["--lr", "0.01", "--momentum", "0.5"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        stdout(&out).contains(
            "trainerd: optimizer from compile(), --lr, --momentum from the command line over it: rmsprop with Keras's \
             update rules, learning_rate 0.01, rho 0.9, momentum 0.5, epsilon 0.0000001, centered false, clipnorm 1\n"
        ),
        "{}",
        stdout(&out)
    );
}

/// A subclassed model: no variables until it is called.
const SUBCLASSED: &str = r#"import keras

class Net(keras.Model):
    def __init__(self):
        super().__init__()
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.logits = keras.layers.Dense(10)

    def call(self, x, training=False):
        return self.logits(self.hidden(self.flatten(x)))

def model(args):
    m = Net()
    m.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              optimizer=keras.optimizers.Adam(1e-3), metrics=["sparse_categorical_accuracy"])
    return m
"#;

/// A subclassed model is built from a batch of the data's shapes before its variables are taken;
/// `plugin check` shows them under their paths, the metric under its Keras name, compile()'s
/// optimizer, and the identity with Keras's settings; two workers train it and end alike.
#[test]
fn a_subclassed_model_is_built_from_the_datas_shapes_and_its_identity_names_keras() {
    let tmp = tempfile::tempdir().unwrap();
    let module = file(tmp.path(), "net.py", SUBCLASSED);
    let out = trainerd_cmd()
        .args(["plugin", "check", "--plugin-arg", &format!("module={}", module.display())])
        .arg(trainerd_testkit::plugin("python-model"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let said = stdout(&out);
    for part in [
        "metrics: sparse_categorical_accuracy\n",
        "optimizer adam with Keras's update rules (learning_rate 0.001, beta_1 0.9, beta_2 0.999, epsilon \
         0.0000001; from compile())\n",
        "net/dense/kernel [784, 32]",
        "net/dense_1/bias [10]",
        "  keras: 3.15.1\n",
        "  keras backend: torch\n",
        "  keras epsilon: 1e-07\n",
        "  keras floatx: float32\n",
        "  keras image_data_format: channels_last\n",
    ] {
        assert!(said.contains(part), "no {part:?} in:\n{said}");
    }
    let run = keras_run(&module, &dataset()).epochs(1).steps(20).batch(16).summary(tmp.path().join("s.json"));
    let out = run.local(2).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(params_sha256(&tmp.path().join("s.worker0.json")), params_sha256(&tmp.path().join("s.worker1.json")));
    assert!(stdout(&out).contains("val_sparse_categorical_accuracy: "), "{}", stdout(&out));
}

/// Three workers, worker 2 SIGKILLed and never restarted: after --replace-after its slot moves to
/// worker 1, and the survivors end with the three-worker run's parameters (BatchNormalization and
/// both Dropouts included).
#[test]
fn a_keras_model_with_a_worker_gone_for_good_ends_bitwise_as_three_workers() {
    let tmp = tempfile::tempdir().unwrap();
    let module = file(tmp.path(), "bn_dropout.py", BN_DROPOUT);
    let run = |name: &str| {
        let (dir, args) = bn_dropout_run(tmp.path(), &module, name);
        (dir, args.epochs(1).steps(30).set("--replace-after", 3))
    };
    let three = |args: &RunArgs, extra: &[&str]| {
        Worker::start(&[&["local", "--restart-delay", "0", "--workers", "3"][..], extra, &args.strs()].concat())
    };
    let (reference, args) = run("reference");
    assert!(three(&args, &[]).wait().success());
    let (short, args) = run("short");
    let mut cluster = three(&args, &["--no-restart", "2"]);
    let at = |r: &trainerd_testkit::events::Record| {
        r.worker == Some(2) && matches!(r.event, Event::Step { global_step, .. } if global_step > 8)
    };
    let pid = cluster.wait_event(at, WAIT).pid;
    // SAFETY: kill(2) on the launcher's worker 2, a process this test started through it.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) }, 0);
    assert!(cluster.wait().success());
    let expected = params_sha256(&reference.join("s.worker0.json"));
    assert_eq!(params_sha256(&short.join("s.worker0.json")), expected);
    assert_eq!(params_sha256(&short.join("s.worker1.json")), expected);
}
