//! What the tutorials' users do beyond `fit`, end to end: models with buffers and dropout, alone
//! and on two workers; evaluating a committed checkpoint; TensorBoard read by TensorBoard's own
//! reader; the learning rate at each epoch's end; typed state; unused parameters; workers whose
//! shards differ.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

use trainerd_storage::{tensors, TensorData};
use trainerd_testkit::output::{error_of, json, stdout, text};
use trainerd_testkit::{free_ports, tf_config, trainerd_cmd, RunArgs};

/// `trainerd run` of `run` on two threads.
fn run(run: RunArgs, fault: Option<&str>) -> Output {
    let mut cmd = run.threads(2).command("run");
    if let Some(f) = fault {
        cmd.env("TRAINERD_FIXTURE_FAULT", f);
    }
    cmd.output().unwrap()
}

/// `trainerd local --workers N` of `run` (one thread per worker).
fn local(workers: usize, run: RunArgs, fault: Option<&str>) -> Output {
    let mut cmd = run.threads(1).local(workers);
    if let Some(f) = fault {
        cmd.env("TRAINERD_FIXTURE_FAULT", f);
    }
    cmd.output().unwrap()
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The model tensors of the newest commit in `ckpt`, as `trainerd ckpt export` writes them.
fn exported(ckpt: &Path) -> Vec<TensorData> {
    let file = ckpt.parent().unwrap().join("export.safetensors");
    let out = trainerd_cmd().args(["ckpt", "export", path(ckpt), "-o", path(&file)]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    tensors::decode(&std::fs::read(&file).unwrap().into()).unwrap()
}

fn tensor<'a>(ts: &'a [TensorData], name: &str) -> &'a TensorData {
    ts.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no {name} in {:?}", ts.iter().map(|t| &t.name)))
}

#[test]
fn a_batchnorm_and_dropout_model_trains_as_well_as_the_tutorial_cnn_alone_and_on_two_workers() {
    let tmp = tempfile::tempdir().unwrap();
    let s = |name: &str| tmp.path().join(name);
    let budget = |name: &str| RunArgs::new(name).epochs(1).steps(300).batch(64);
    let cnn = run(budget("mnist-cnn").summary(s("cnn.json")), None);
    assert!(cnn.status.success(), "{}", text(&cnn));
    let bn = run(budget("mnist-bn").summary(s("bn.json")), None);
    assert!(bn.status.success(), "{}", text(&bn));
    let cnn_accuracy = json(&s("cnn.json"))["test_accuracy"].as_f64().unwrap();
    let bn_alone = json(&s("bn.json"));
    let accuracy = bn_alone["test_accuracy"].as_f64().unwrap();
    assert!(accuracy >= cnn_accuracy, "mnist-bn {accuracy} < mnist-cnn {cnn_accuracy} after the same 300 steps");

    // Two workers, the same examples (half the steps of twice the batch): the same accuracy, and
    // identical parameters and BatchNorm statistics on both.
    let two = local(2, RunArgs::new("mnist-bn").epochs(1).steps(150).summary(s("bn2.json")), None);
    assert!(two.status.success(), "{}", text(&two));
    let (w0, w1) = (json(&s("bn2.worker0.json")), json(&s("bn2.worker1.json")));
    assert_eq!(w0["params_sha256"], w1["params_sha256"], "the replicas (buffers included) differ");
    let accuracy = w0["test_accuracy"].as_f64().unwrap();
    assert!(accuracy >= cnn_accuracy - 0.01, "two workers: mnist-bn {accuracy}, mnist-cnn alone {cnn_accuracy}");
    // Same seed, same everything: the dropout masks and statistics repeat exactly (on a shorter run).
    let short = |name: &str| RunArgs::new("mnist-bn").epochs(1).steps(30).batch(64).summary(s(name));
    let (once, again) = (run(short("once.json"), None), run(short("again.json"), None));
    assert!(once.status.success() && again.status.success(), "{}\n{}", text(&once), text(&again));
    assert_eq!(json(&s("again.json"))["params_sha256"], json(&s("once.json"))["params_sha256"]);
}

#[test]
fn tensorboard_reads_the_scalars_and_the_epoch_line_shows_the_learning_rate() {
    let tmp = tempfile::tempdir().unwrap();
    let (tb, summary) = (tmp.path().join("tb"), tmp.path().join("s.json"));
    let out = run(
        RunArgs::new("linear")
            .epochs(2)
            .steps(40)
            .set("--lr-schedule", "step:40:0.1")
            .set("--lr", 0.1)
            .set("--tensorboard-dir", path(&tb))
            .set("--tensorboard-every", 10)
            .summary(&summary),
        None,
    );
    assert!(out.status.success(), "{}", text(&out));
    let ends: Vec<String> = stdout(&out).lines().filter(|l| l.starts_with("40/40 - ")).map(String::from).collect();
    assert_eq!(ends.len(), 2, "{}", stdout(&out));
    assert!(ends[0].contains(" - learning_rate: 0.1000 - "), "{}", ends[0]);
    assert!(ends[1].contains(" - learning_rate: 0.0100 - "), "{}", ends[1]);
    // A constant rate is not repeated on every line (Keras's PrintLR is for schedules).
    let constant = run(RunArgs::new("linear").epochs(1).steps(5), None);
    assert!(!stdout(&constant).contains("learning_rate"), "{}", stdout(&constant));

    // TensorBoard's own reader, from the tensorboard package.
    let script = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
out = {}
for run in ("train", "validation"):
    ea = EventAccumulator(sys.argv[1] + "/" + run)
    ea.Reload()
    out[run] = {tag: [[e.step, e.value] for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}
print(json.dumps(out))
"#;
    let read = Command::new("python3").arg("-c").arg(script).arg(&tb).output().unwrap();
    assert!(read.status.success(), "{}", text(&read));
    let scalars: serde_json::Value = serde_json::from_slice(&read.stdout).unwrap();
    let (train, validation) = (&scalars["train"], &scalars["validation"]);
    let steps =
        |v: &serde_json::Value| -> Vec<u64> { v.as_array().unwrap().iter().map(|p| p[0].as_u64().unwrap()).collect() };
    assert_eq!(steps(&train["batch_loss"]), [10, 20, 30, 40, 50, 60, 70, 80]);
    // The learning rate of each step, beside its loss.
    let batch_lr: Vec<f64> =
        train["batch_learning_rate"].as_array().unwrap().iter().map(|p| p[1].as_f64().unwrap()).collect();
    assert_eq!(steps(&train["batch_learning_rate"]), steps(&train["batch_loss"]));
    assert!((batch_lr[3] - 0.1).abs() < 1e-7 && (batch_lr[4] - 0.01).abs() < 1e-8, "{batch_lr:?}");
    assert_eq!(steps(&train["epoch_loss"]), [0, 1]);
    assert_eq!(steps(&validation["epoch_accuracy"]), [0, 1]);
    assert_eq!(steps(&validation["evaluation_loss_vs_iterations"]), [40, 80]);
    let lr: Vec<f64> =
        train["epoch_learning_rate"].as_array().unwrap().iter().map(|p| p[1].as_f64().unwrap()).collect();
    assert!((lr[0] - 0.1).abs() < 1e-7 && (lr[1] - 0.01).abs() < 1e-8, "{lr:?}");
    assert!(train["epoch_examples_per_second"][1][1].as_f64().unwrap() > 0.0);
    // The last evaluation is the summary's (as float32).
    let s = json(&summary);
    let last = |v: &serde_json::Value| v[1][1].as_f64().unwrap();
    assert!((last(&validation["epoch_loss"]) - s["test_loss"].as_f64().unwrap()).abs() < 1e-6);
    assert!((last(&validation["epoch_accuracy"]) - s["test_accuracy"].as_f64().unwrap()).abs() < 1e-6);
    assert!((last(&train["epoch_loss"]) - s["final_train_loss"].as_f64().unwrap()).abs() < 1e-6);
}

/// `trainerd evaluate` of `plugin` on one thread, the commits in `ckpt`.
fn evaluate(plugin_name: &str, ckpt: &Path) -> RunArgs {
    RunArgs::new(plugin_name).threads(1).set("--checkpoint", path(ckpt))
}

/// `command(i)` as member `i` of an `n`-worker TF_CONFIG cluster on loopback, for each `i`; each
/// must succeed.
fn on_cluster(n: usize, command: impl Fn(usize) -> Command) {
    let ports = free_ports(n);
    let members: Vec<Child> = (0..n)
        .map(|i| {
            let mut cmd = command(i);
            cmd.env("TF_CONFIG", tf_config(&ports, i)).stdout(Stdio::piped()).stderr(Stdio::piped());
            cmd.spawn().unwrap()
        })
        .collect();
    for m in members {
        let out = m.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", text(&out));
    }
}

/// `trainerd predict` of a Rust plugin's commit: alone, one file of every test example in order
/// with its 10 logits; sharded over a two-worker TF_CONFIG cluster, two files that together hold
/// every example once, with the same logits.
#[test]
fn predict_writes_every_example_once_alone_and_sharded() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let out = RunArgs::new("mnist-cnn").threads(1).epochs(1).steps(20).checkpoints(&ckpt, 0).command("run").output();
    let out = out.unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let predict = |output: &Path| evaluate("mnist-cnn", &ckpt).set("--output", path(output)).command("predict");
    let alone = tmp.path().join("alone.parquet");
    let out = predict(&alone).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        stdout(&out).contains("predicted 10000 test examples with checkpoint 1 on 1 worker(s) in ")
            && stdout(&out).contains(&format!("outputs of shape [10] each in {}", alone.display())),
        "{}",
        stdout(&out)
    );
    let sharded = tmp.path().join("sharded.parquet");
    on_cluster(2, |_| predict(&sharded));
    let check = r#"
import sys, numpy as np, pyarrow.parquet as pq
def read(*files):
    ids, out = [], []
    for f in files:
        t = pq.read_table(f)
        assert t.schema.metadata[b"trainerd.shape"] == b"10", t.schema.metadata
        ids += t.column("example").to_pylist()
        out.append(np.stack(t.column("output").to_numpy(zero_copy_only=False)))
    return ids, np.concatenate(out)
ids, alone = read(sys.argv[1])
assert ids == list(range(10000)), ids[:10]
shard_ids, shards = read(sys.argv[2], sys.argv[3])
assert sorted(shard_ids) == ids, "every example once"
assert np.allclose(shards, alone[shard_ids], rtol=1e-5, atol=1e-6), np.abs(shards - alone[shard_ids]).max()
"#;
    let shard = |r: usize| tmp.path().join(format!("sharded-{r:05}-of-00002.parquet"));
    let out = Command::new(trainerd_testkit::python())
        .args(["-c", check, path(&alone), path(&shard(0)), path(&shard(1))])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn evaluate_gives_the_runs_test_figures_alone_sharded_and_for_an_older_commit() {
    let tmp = tempfile::tempdir().unwrap();
    let (ckpt, summary) = (tmp.path().join("ckpt"), tmp.path().join("s.json"));
    let flags = RunArgs::new("mnist-bn").epochs(1).steps(60).batch(50).checkpoints(&ckpt, 25);
    let out = local(2, flags.summary(&summary), None);
    assert!(out.status.success(), "{}", text(&out));
    let trained = json(&tmp.path().join("s.worker0.json"));

    // Alone, the newest commit (the end of the run): the run's own figures.
    let alone = tmp.path().join("alone.json");
    let out = evaluate("mnist-bn", &ckpt).batch(50).summary(&alone).command("evaluate").output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(stdout(&out).contains("trainerd: evaluating checkpoint 3 of "), "{}", stdout(&out));
    let alone = json(&alone);
    assert_eq!(alone["sequence"], 3);
    assert_eq!((alone["global_step"].as_u64(), alone["examples"].as_u64()), (Some(60), Some(10_000)));
    assert_eq!(alone["params_sha256"], trained["params_sha256"]);
    assert_eq!(alone["test_accuracy"], trained["test_accuracy"]);
    let loss = |v: &serde_json::Value| v["test_loss"].as_f64().unwrap();
    assert!((loss(&alone) - loss(&trained)).abs() < 1e-9, "{} vs {}", loss(&alone), loss(&trained));

    // Sharded over a two-worker TF_CONFIG cluster, commit 1 (step 25): both members agree.
    on_cluster(2, |i| {
        let out = tmp.path().join(format!("shard{i}.json"));
        evaluate("mnist-bn", &ckpt).set("--sequence", 1).summary(&out).command("evaluate")
    });
    let (s0, s1) = (json(&tmp.path().join("shard0.json")), json(&tmp.path().join("shard1.json")));
    assert_eq!(
        (s0["sequence"].as_u64(), s0["global_step"].as_u64(), s0["workers"].as_u64()),
        (Some(1), Some(25), Some(2))
    );
    assert_eq!(s0["test_loss"], s1["test_loss"]);
    assert_eq!(s0["params_sha256"], s1["params_sha256"]);
    assert_eq!(s0["examples"], 10_000);
    assert_ne!(s0["params_sha256"], alone["params_sha256"], "commit 1 is not the last commit");

    // What goes wrong is named.
    let empty = tmp.path().join("empty");
    let out = evaluate("mnist-bn", &empty).command("evaluate").output().unwrap();
    assert_eq!(
        error_of(&out),
        format!("error: checkpoint: {}: no checkpoint has been committed there", empty.display())
    );
    let out = evaluate("mnist-cnn", &ckpt).command("evaluate").output().unwrap();
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        error_of(&out),
        format!(
            "error: checkpoint: {}: checkpoint 3 was written by plugin mnist-bn {version}, not by mnist-cnn {version}",
            ckpt.display()
        )
    );
}

#[test]
fn workers_whose_shards_differ_are_refused_naming_both_counts() {
    let ports = free_ports(2);
    let workers: Vec<Child> = (0..2)
        .map(|i| {
            let mut cmd = RunArgs::new("test-fixture").threads(1).epochs(1).batch(100).command("run");
            cmd.env("TF_CONFIG", tf_config(&ports, i))
                .env("TRAINERD_FIXTURE_FAULT", "uneven-shards")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            cmd.spawn().unwrap()
        })
        .collect();
    let expected = format!(
        "error: the workers disagree on steps per epoch: worker 0 (127.0.0.1:{}) (the chief) has 300, worker 1 \
         (127.0.0.1:{}) has 299 (batch size 100 per worker); every worker's input pipeline must yield the same number \
         of steps, so the plugin's shards of the training split must be the same size",
        ports[0], ports[1]
    );
    for w in workers {
        let out = w.wait_with_output().unwrap();
        assert_eq!(error_of(&out), expected);
        assert!(!stdout(&out).contains("Epoch 1/1"), "no step was taken: {}", stdout(&out));
    }
}

#[test]
fn an_unused_parameter_stays_put_with_one_worker_and_with_two() {
    let tmp = tempfile::tempdir().unwrap();
    // Weight decay would move a parameter that got a zero gradient: an unused one must get none.
    let flags = RunArgs::new("test-fixture").epochs(1).steps(20).set("--optimizer", "sgd").set("--weight-decay", 0.1);
    for workers in [1, 2] {
        let ckpt = tmp.path().join(format!("ckpt{workers}"));
        let out = local(workers, flags.clone().checkpoints(&ckpt, 0), Some("unused-param"));
        assert!(out.status.success(), "{}", text(&out));
        let model = exported(&ckpt);
        let unused = tensor(&model, "model.unused");
        assert_eq!(
            unused.data.as_ref(),
            1f32.to_ne_bytes().repeat(4),
            "{workers} worker(s) moved the unused parameter"
        );
        let dense = tensor(&model, "model.dense.weight");
        assert_ne!(dense.data.iter().map(|&b| u64::from(b)).sum::<u64>(), 0, "the used parameters trained");
    }
}

#[test]
fn float64_and_int64_buffers_stay_exact_and_identical_on_every_worker() {
    let tmp = tempfile::tempdir().unwrap();
    let (ckpt, summary) = (tmp.path().join("ckpt"), tmp.path().join("s.json"));
    let flags = RunArgs::new("test-fixture").epochs(2).steps(15).checkpoints(&ckpt, 0);
    let out = local(2, flags.clone().summary(&summary), Some("typed-buffers"));
    assert!(out.status.success(), "{}", text(&out));
    let (w0, w1) = (json(&tmp.path().join("s.worker0.json")), json(&tmp.path().join("s.worker1.json")));
    assert_eq!(w0["params_sha256"], w1["params_sha256"]);
    let model = exported(&ckpt);
    let steps = tensor(&model, "model.steps");
    assert_eq!(format!("{:?}", steps.dtype), "I64");
    // 2^40 + 30 training passes: an integer float32 cannot hold, exact through the run, the
    // per-step synchronisation and the checkpoint.
    assert_eq!(i64::from_ne_bytes(steps.data.as_ref().try_into().unwrap()), (1 << 40) + 30);
    let mean = tensor(&model, "model.mean");
    assert_eq!(format!("{:?}", mean.dtype), "F64");
    let mean = f64::from_ne_bytes(mean.data.as_ref().try_into().unwrap());
    assert!(mean > 0.0 && (mean as f32) as f64 != mean, "a float64 value with more than float32's precision: {mean}");

    // A run resumed from that checkpoint continues with the same state (it is the end: nothing to
    // train, the same parameters and buffers).
    let again = local(2, flags.summary(tmp.path().join("r.json")), Some("typed-buffers"));
    assert!(again.status.success(), "{}", text(&again));
    assert_eq!(json(&tmp.path().join("r.worker0.json"))["params_sha256"], w0["params_sha256"]);
}

/// Little-endian float32 bytes of `t`, in hex.
fn hex_of(t: &tch::Tensor) -> String {
    let values = Vec::<f32>::try_from(t.reshape(-1)).unwrap();
    values.iter().flat_map(|v| v.to_le_bytes()).map(|b| format!("{b:02x}")).collect()
}

/// `--clip-norm` and `--clip-value` are PyTorch's `clip_grad_norm_` and `clip_grad_value_` on the
/// same gradients. Clipping by value gives their bits. The global norm is taken in float64 over
/// fixed ranges (so that a sharded optimizer clips alike), not as PyTorch's float32 norm of
/// per-tensor norms: the norm agrees to float32's precision, and each element clipped by norm
/// to an ulp or two.
#[test]
fn clipping_is_pytorchs_clip_grad_norm_and_clip_grad_value() {
    use tch::{Device, Kind, Tensor};
    use trainerd::optim::clip::Clip;
    let script = r#"
import json, sys, torch
req = json.load(sys.stdin)
params = []
for hexes, shape in zip(req["grads"], req["shapes"]):
    p = torch.zeros(shape, requires_grad=True)
    p.grad = torch.frombuffer(bytearray.fromhex(hexes), dtype=torch.float32).reshape(shape).clone()
    params.append(p)
total = None
if req["norm"] is not None:
    total = torch.nn.utils.clip_grad_norm_(params, req["norm"]).item()
if req["value"] is not None:
    torch.nn.utils.clip_grad_value_(params, req["value"])
print(json.dumps({"total": total, "grads": [p.grad.numpy().tobytes().hex() for p in params]}))
"#;
    let shapes: [&[i64]; 3] = [&[7, 5], &[5], &[3, 2, 2]];
    for (norm, value) in [(Some(1.0), None), (Some(1e4), None), (None, Some(0.5)), (Some(2.0), Some(0.05))] {
        tch::manual_seed(3);
        let params: Vec<(String, Tensor)> = shapes
            .iter()
            .enumerate()
            .map(|(i, &shape)| {
                let p = Tensor::zeros(shape, (Kind::Float, Device::Cpu)).set_requires_grad(true);
                let r = Tensor::randn(shape, (Kind::Float, Device::Cpu)) * 3.0;
                (&p * &r).sum(Kind::Float).backward();
                (format!("p{i}"), p)
            })
            .collect();
        let request = serde_json::json!({
            "grads": params.iter().map(|(_, p)| hex_of(&p.grad())).collect::<Vec<_>>(),
            "shapes": shapes,
            "norm": norm,
            "value": value,
        });
        let total = Clip { norm, value }.apply(&params).unwrap().expect("gradients to clip");
        let mut child = Command::new(trainerd_testkit::python())
            .args(["-c", script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(child.stdin.as_mut().unwrap(), request.to_string().as_bytes()).unwrap();
        drop(child.stdin.take());
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", text(&out));
        let torch: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let ours: Vec<String> = params.iter().map(|(_, p)| hex_of(&p.grad())).collect();
        let floats = |hexes: &str| -> Vec<f32> {
            let bytes: Vec<u8> =
                (0..hexes.len()).step_by(2).map(|i| u8::from_str_radix(&hexes[i..i + 2], 16).unwrap()).collect();
            bytes.chunks(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
        };
        let clipped_by_norm = norm.is_some_and(|n| n < total);
        for (i, ours) in ours.iter().enumerate() {
            let theirs = torch["grads"][i].as_str().unwrap();
            if !clipped_by_norm {
                assert_eq!(ours, theirs, "clip {norm:?} {value:?}: parameter {i}, bit for bit");
                continue;
            }
            for (a, b) in floats(ours).into_iter().zip(floats(theirs)) {
                assert!((a - b).abs() <= 2.5e-7 * b.abs().max(1e-30), "clip {norm:?} {value:?}: {a} vs {b}");
            }
        }
        if let Some(max) = norm {
            let theirs = torch["total"].as_f64().unwrap();
            assert!(
                (total - theirs).abs() <= 1e-6 * theirs,
                "clip {max}: the norm before clipping: {total} vs {theirs}"
            );
            assert!(total > 2.0, "the gradients are clipped (norm {total})");
        }
    }
}

/// A run with `--clip-norm` shows each step's gradient norm in the metrics log, and the clip
/// changes the result (the same run without it ends elsewhere).
#[test]
fn a_clipped_run_logs_each_steps_gradient_norm() {
    let tmp = tempfile::tempdir().unwrap();
    let log = tmp.path().join("metrics.jsonl");
    let common = RunArgs::new("linear").epochs(1).steps(30).on("--no-evaluation");
    let clipped = run(common.clone().set("--clip-norm", 0.1).set("--metrics-log", path(&log)), None);
    assert!(clipped.status.success(), "{}", text(&clipped));
    let lines = trainerd_testkit::output::metrics_log(&log);
    assert_eq!(lines.len(), 30);
    assert!(lines.iter().all(|l| l["grad_norm"].as_f64().is_some_and(|n| n > 0.1)), "{:?}", lines[0]);
    let free = run(common, None);
    let sha =
        |o: &Output| stdout(o).lines().last().unwrap_or_default().rsplit(' ').next().unwrap_or_default().to_string();
    assert_ne!(sha(&clipped), sha(&free), "{}\n{}", text(&clipped), text(&free));
}

/// Runs `cmd` until its step `step` pauses at the `train-step` failpoint and its checkpoint
/// directory `ckpt` holds commit `sequence` (a commit goes on in the background while the step is
/// held), and SIGKILLs it there.
fn killed_at_step(cmd: &mut Command, step: u64, (ckpt, sequence): (&Path, u64)) {
    use std::io::BufRead;
    let mut child = cmd
        .env("TRAINERD_FAILPOINT", format!("train-step@{step}"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let reached = stderr.lines().map_while(Result::ok).any(|l| l.contains("failpoint train-step reached"));
    let newest = || {
        let names = std::fs::read_dir(ckpt.join("commits")).into_iter().flatten().flatten();
        names.filter_map(|e| e.file_name().to_str()?.strip_suffix(".json")?.parse::<u64>().ok()).max().unwrap_or(0)
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while reached && newest() < sequence && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(reached, "step {step} was never reached");
    assert!(newest() >= sequence, "{}: commit {sequence} not made (newest {})", ckpt.display(), newest());
}

/// A run of the linear model that learns next to nothing (SGD at 1e-9): val_loss moves by less
/// than 0.001 an epoch, so `--early-stopping val_loss:2:0.001` stops it after epoch 3; `extra`
/// flags and `env` added.
fn barely_learning(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Command {
    let run = RunArgs::new("linear").threads(1);
    let run = if extra.contains(&"--epochs") { run } else { run.epochs(8) };
    let run = run.steps(20).optimizer("sgd", 1e-9).set("--early-stopping", "val_loss:2:0.001");
    let run = run.checkpoints(dir.join("ckpt"), 10).summary(dir.join("summary.json")).extend(extra);
    let mut cmd = run.command("run");
    cmd.envs(env.iter().copied());
    cmd
}

/// Early stopping's state is part of the training state: a run killed in epoch 3 (after epoch 2
/// had not improved) and resumed stops after epoch 3, as the uninterrupted run does, with the
/// same parameters. Without that state, the resumed run would take epoch 3 as its first and stop
/// two epochs later.
#[test]
fn early_stopping_stops_at_the_same_epoch_after_a_kill_and_a_resume() {
    let (whole, killed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let out = barely_learning(whole.path(), &[], &[]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        stdout(&out)
            .contains("trainerd: early stopping: val_loss has not improved by more than 0.001 for 2 epoch(s) (best ")
            && stdout(&out).contains("): stopping after epoch 3"),
        "{}",
        text(&out)
    );
    let summary = |dir: &Path| json(&dir.join("summary.json"));
    let expected = summary(whole.path());
    assert_eq!((expected["stopped_early_after_epoch"].as_u64(), expected["steps"].as_u64()), (Some(3), Some(60)));
    // The 45th step pauses at a failpoint (in epoch 3, after the commit of step 40); it is
    // SIGKILLed there.
    killed_at_step(&mut barely_learning(killed.path(), &[], &[]), 45, (&killed.path().join("ckpt"), 4));
    let resumed = barely_learning(killed.path(), &[], &[]).output().unwrap();
    assert!(resumed.status.success(), "{}", text(&resumed));
    assert!(stdout(&resumed).contains("resumed from checkpoint"), "{}", text(&resumed));
    let s = summary(killed.path());
    assert_eq!(s["stopped_early_after_epoch"], expected["stopped_early_after_epoch"], "{}", text(&resumed));
    assert_eq!(s["params_sha256"], expected["params_sha256"]);
}

/// `--reduce-lr-on-plateau`: the learning rate is multiplied after each epoch without improvement,
/// and the next epoch's line shows the reduced rate.
#[test]
fn a_plateau_reduces_the_learning_rate_and_the_epoch_line_shows_it() {
    let tmp = tempfile::tempdir().unwrap();
    let out = barely_learning(tmp.path(), &["--reduce-lr-on-plateau", "val_loss:0.5:1", "--epochs", "3"], &[])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let printed = stdout(&out);
    let lines: Vec<&str> = printed.lines().collect();
    let reductions: Vec<&&str> = lines.iter().filter(|l| l.starts_with("trainerd: reduce-lr-on-plateau: ")).collect();
    assert_eq!(reductions.len(), 2, "epochs 2 and 3\n{}", text(&out));
    assert!(reductions[1].ends_with("learning rate x0.5 (x0.25 in all)"), "{}", reductions[1]);
    // The epochs' last lines (the step lines show each step's rate too).
    let rates: Vec<&str> = lines
        .iter()
        .filter(|l| l.contains(" - val_loss: "))
        .filter_map(|l| l.split(" - learning_rate: ").nth(1))
        .map(|r| r.split(' ').next().unwrap())
        .collect();
    assert_eq!(rates.len(), 3, "{}", text(&out));
    assert_eq!(rates[0], rates[1], "epoch 2 ended without improvement, then the rate was halved: {rates:?}");
    assert_ne!(rates[1], rates[2], "epoch 3 trained at half the rate: {rates:?}");
}

/// `--precision bf16`: autocast's bfloat16 forward pass trains mnist-cnn to within 0.01 of float32's
/// test accuracy on the same steps (and computes otherwise: other parameters), and a bf16 run
/// killed mid-epoch and resumed from its checkpoint ends bitwise as the uninterrupted bf16 run.
#[test]
fn bf16_trains_as_well_as_fp32_and_a_killed_bf16_run_resumes_bitwise() {
    let tmp = tempfile::tempdir().unwrap();
    let s = |name: &str| tmp.path().join(name);
    let budget = RunArgs::new("mnist-cnn").epochs(1).steps(300).batch(64);
    let fp32 = run(budget.clone().summary(s("fp32.json")), None);
    assert!(fp32.status.success(), "{}", text(&fp32));
    let bf16 = run(budget.clone().set("--precision", "bf16").summary(s("bf16.json")), None);
    assert!(bf16.status.success(), "{}", text(&bf16));
    assert!(stdout(&bf16).contains("trainerd: mixed precision: the forward pass under autocast to bfloat16"));
    let (a, b) = (json(&s("fp32.json")), json(&s("bf16.json")));
    assert_eq!(b["precision"], "bf16");
    let (fp32_accuracy, bf16_accuracy) = (a["test_accuracy"].as_f64().unwrap(), b["test_accuracy"].as_f64().unwrap());
    assert!((fp32_accuracy - bf16_accuracy).abs() <= 0.01, "fp32 {fp32_accuracy}, bf16 {bf16_accuracy}");
    assert_ne!(a["params_sha256"], b["params_sha256"], "bf16 computed in float32");

    // A shorter bf16 run killed at step 30 (after the commit of step 20), then resumed, ends as
    // the same run uninterrupted.
    let short = |name: &str| {
        let bf16 = RunArgs::new("mnist-cnn").epochs(1).steps(40).batch(64).set("--precision", "bf16");
        bf16.summary(s(&format!("{name}.json"))).checkpoints(s(&format!("{name}-ckpt")), 20)
    };
    let whole = run(short("whole"), None);
    assert!(whole.status.success(), "{}", text(&whole));
    let killed = short("killed").threads(2);
    killed_at_step(&mut killed.command("run"), 30, (&s("killed-ckpt"), 1));
    let resumed = run(killed, None);
    assert!(resumed.status.success(), "{}", text(&resumed));
    assert!(stdout(&resumed).contains("resumed from checkpoint"), "{}", text(&resumed));
    assert_eq!(json(&s("killed.json"))["params_sha256"], json(&s("whole.json"))["params_sha256"]);
}

/// float16 with loss scaling is for GPUs: asked for on the CPU, it is refused, naming bf16 as the
/// CPU's.
#[test]
fn fp16_on_the_cpu_is_refused_naming_bf16() {
    let out = run(RunArgs::new("linear").set("--precision", "fp16").set("--device", "cpu"), None);
    assert_eq!(
        error_of(&out),
        "error: --precision fp16 needs CUDA: float16 with loss scaling is for GPUs' tensor cores; train with \
         --precision bf16 on the CPU"
    );
}
