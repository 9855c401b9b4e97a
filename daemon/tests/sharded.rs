//! `--shard optimizer` (ZeRO stage 1, or `--shard-optimizer`) and `--shard gradients` (ZeRO stage
//! 2) with real daemons on loopback: bit for bit the unsharded run, in the parameters and in the
//! committed optimizer state, for every optimizer and control the CPU runs, and for the GPT example,
//! transformers' Llama and a Keras model; a commit of each level resumes at the others; what each
//! worker holds; and the refusals.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;

use sha2::{Digest, Sha256};
use trainerd_storage::CheckpointStore;
use trainerd_testkit::output::{error_line, json, text};
use trainerd_testkit::{dataset, free_ports, python_examples, tf_config, tokens, RunArgs};

/// A run's end, per worker: `params_sha256` and `optimizer_state_bytes`; and the sha256 of the
/// last commit's optimizer blob.
struct Ended {
    params: Vec<String>,
    state_bytes: Vec<u64>,
    optimizer_blob: String,
    /// How many parts the last commit has (none: written whole by the coordinator).
    parts: usize,
    /// What the workers printed.
    output: String,
    /// Each worker's summary's `memory`.
    memory: Vec<serde_json::Value>,
}

/// The sha256 of the safetensors encoding of blob `name` of the newest commit in the local
/// checkpoint directory `ckpt`, as a reader puts it together (a sharded commit's from its
/// parts).
fn blob_sha256(ckpt: &Path, name: &str) -> String {
    let raw = trainerd_storage::location::local_store(ckpt).unwrap();
    let store = CheckpointStore::new(Arc::new(raw), object_store::path::Path::default(), "ckpt");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let latest = runtime.block_on(store.latest()).unwrap().expect("a commit");
    let mut hasher = Sha256::new();
    trainerd_storage::tensors::encode(&latest.blobs[name]).unwrap().iter().for_each(|c| hasher.update(c));
    trainerd_storage::store::hex(&hasher.finalize())
}

/// The newest commit's manifest in the local checkpoint directory `ckpt`: how many of its
/// entries are parts (written by the members of a sharded commit, each a slice of a blob).
fn parts_in_newest(ckpt: &Path) -> usize {
    let mut records: Vec<_> = std::fs::read_dir(ckpt.join("commits")).unwrap().map(|e| e.unwrap().path()).collect();
    records.sort();
    let record = json(records.last().expect("a commit"));
    let manifest = json(&ckpt.join(record["manifest"].as_str().unwrap()));
    manifest["blobs"].as_array().unwrap().iter().filter(|b| b.get("slices").is_some()).count()
}

/// `args` on `workers` local workers with checkpoints in `dir/ckpt` (every 10 steps).
fn run(args: &RunArgs, workers: usize, dir: &Path) -> Ended {
    let ckpt = dir.join("ckpt");
    let out = args.clone().checkpoints(&ckpt, 10).summary(dir.join("s.json")).local(workers).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let summaries: Vec<_> = (0..workers).map(|w| json(&dir.join(format!("s.worker{w}.json")))).collect();
    Ended {
        params: summaries.iter().map(|s| s["params_sha256"].as_str().unwrap().to_string()).collect(),
        state_bytes: summaries.iter().map(|s| s["optimizer_state_bytes"].as_u64().unwrap()).collect(),
        optimizer_blob: blob_sha256(&ckpt, "optimizer.safetensors"),
        parts: parts_in_newest(&ckpt),
        output: text(&out),
        memory: summaries.iter().map(|s| s["memory"].clone()).collect(),
    }
}

fn cnn(plugin: &str) -> RunArgs {
    RunArgs::new(plugin).epochs(2).steps(12).batch(32).seed(7).threads(1)
}

/// Each optimizer and control, sharded and not: the same parameters on every worker, the same
/// committed optimizer state (its bytes), and about 2/W of the state held per worker (its
/// ranges and a buddy copy of its predecessor's).
#[test]
fn a_sharded_run_is_the_unsharded_run_bit_for_bit() {
    let cases: Vec<(&str, RunArgs, usize)> = vec![
        (
            "plain sgd (no state at all) on the linear plugin, 4 workers",
            RunArgs::new("linear").epochs(2).steps(12).batch(16).seed(11).threads(1).optimizer("sgd", 0.1),
            4,
        ),
        ("adam, --clip-norm, 3 workers", cnn("mnist-cnn").optimizer("adam", 1e-3).set("--clip-norm", 0.5), 3),
        (
            "sgd with nesterov momentum and weight decay, --clip-value, --accumulate 2 (2 slots per worker)",
            cnn("mnist-cnn")
                .optimizer("sgd", 0.05)
                .set("--momentum", 0.9)
                .on("--nesterov")
                .set("--weight-decay", 1e-4)
                .set("--clip-value", 0.01)
                .set("--accumulate", 2),
            2,
        ),
        (
            "adamw with its decay groups, batchnorm buffers, dropout, bf16",
            cnn("mnist-bn").optimizer("adamw", 1e-3).set("--weight-decay", 0.1).set("--precision", "bf16"),
            2,
        ),
        (
            "adam, --devices cpu,cpu (two replicas per daemon, each a slot: the daemon shards, replica 0 holds its state)",
            cnn("mnist-cnn").optimizer("adam", 1e-3).set("--devices", "cpu,cpu"),
            3,
        ),
        (
            "rmsprop with momentum, a cosine schedule with warmup",
            cnn("mnist-cnn")
                .optimizer("rmsprop", 1e-3)
                .set("--momentum", 0.5)
                .set("--lr-schedule", "cosine")
                .set("--warmup-steps", 5),
            3,
        ),
    ];
    for (what, args, workers) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let whole = run(&args, workers, &tmp.path().join("whole"));
        for level in ["optimizer", "gradients"] {
            let sharded = run(&args.clone().set("--shard", level), workers, &tmp.path().join(level));
            let what = format!("--shard {level}, {what}");
            same_as_unsharded(&what, (&whole, &sharded), workers);
            let line =
                "trainerd: gradients sharded too (ZeRO stage 2): each gradient is let go once its bucket is staged";
            assert_eq!(sharded.output.contains(line), level == "gradients", "{what}");
        }
        // --shard-optimizer is --shard optimizer.
        if workers == 4 {
            let alias = run(&args.clone().on("--shard-optimizer"), workers, &tmp.path().join("alias"));
            assert_eq!(alias.params, whole.params, "--shard-optimizer, {what}");
        }
    }
}

/// The models language-model and Keras users bring, on 4 workers with `--shard gradients` (which
/// shards the optimizer state too), bit for bit the unsharded run: the small GPT example (its head tied to the embedding, AdamW with its decay
/// groups, a cosine schedule with warmup) and transformers' Llama (rotary embeddings, grouped-query
/// attention, its own head), each in several buckets with `--accumulate 2` and `--clip-norm`; and
/// a Keras model with BatchNormalization and two Dropouts.
#[test]
fn python_modules_sharded_are_the_unsharded_run_bit_for_bit() {
    let module = |file: &Path| {
        RunArgs::new("python-model").plugin_arg(format!("module={}", file.display())).epochs(1).steps(8).threads(1)
    };
    let language_model = |file: &str| {
        module(&python_examples().join(file))
            .data(tokens())
            .batch(2)
            .seed(5)
            .optimizer("adamw", 1e-3)
            .set("--weight-decay", 0.1)
            .set("--lr-schedule", "cosine")
            .set("--warmup-steps", 3)
            .set("--clip-norm", 0.5)
            .set("--bucket-mb", 0.2)
    };
    let tmp = tempfile::tempdir().unwrap();
    let keras = tmp.path().join("bn_dropout.py");
    std::fs::write(&keras, include_str!("fixtures/keras_bn_dropout.py")).unwrap();
    let cases = [
        ("the GPT example", language_model("gpt.py"), true),
        ("transformers' Llama", language_model("hf_llama.py"), true),
        (
            "Keras, BatchNormalization and Dropout",
            module(&keras).data(dataset()).batch(16).seed(3).set("--bucket-mb", 0.1),
            false,
        ),
    ];
    for (what, one_slot, language_model) in cases {
        let dir = tmp.path().join(what.replace(' ', "-"));
        let args = if language_model { one_slot.clone().set("--accumulate", 2) } else { one_slot.clone() };
        let whole = run(&args, 4, &dir.join("whole"));
        let sharded = run(&args.clone().set("--shard", "gradients"), 4, &dir.join("gradients"));
        same_as_unsharded(&format!("--shard gradients, {what}"), (&whole, &sharded), 4);
        assert!(!sharded.output.contains("trainerd: gradients in 1 bucket(s)"), "{what}: {}", sharded.output);
        if language_model {
            let one_slot = one_slot.set("--shard", "gradients").set("--bucket-mb", 0.05);
            let one_slot = run(&one_slot, 4, &dir.join("one-slot"));
            assert_gradients_let_go(what, &whole, &one_slot);
        }
    }
}

/// A language model's run at `--shard gradients` with one slot per worker, in buckets of 50 kB
/// (`sharded`), held less than one whole copy of its gradients (`whole`'s parameters): its
/// buckets, in the module's
/// order, were reduced during the backward pass and let go once scattered. In the names' order
/// the token embedding's bucket was awaited first and made final last, and every gradient was
/// held whole, with the held ranges' clipped ones: 1.3 to 1.5 copies.
fn assert_gradients_let_go(what: &str, whole: &Ended, sharded: &Ended) {
    for w in 0..4 {
        let (held, p) = (&sharded.memory[w]["gradient_bytes"], &whole.memory[w]["parameter_bytes"]);
        assert!(held.as_u64() < p.as_u64(), "{what}: worker {w} held {held} bytes of gradients, of {p}");
    }
}

/// A sharded run ended where the unsharded one did (`whole`), each of its `workers` holding its
/// share of the optimizer state, its commits written in parts.
fn same_as_unsharded(what: &str, (whole, sharded): (&Ended, &Ended), workers: usize) {
    {
        for w in 0..workers {
            assert_eq!(whole.params[w], whole.params[0], "{what}: the unsharded workers agree");
            assert_eq!(sharded.params[w], whole.params[0], "{what}: worker {w}'s parameters");
            let (held, all) = (sharded.state_bytes[w], whole.state_bytes[w]);
            // Its own ranges and a buddy copy of its predecessor's: about 2/W.
            assert!(
                held * workers as u64 <= 2 * all + all / 20 && held * workers as u64 >= 2 * all - all / 20,
                "{what}: worker {w} holds {held} bytes of optimizer state of {all}"
            );
        }
        assert_eq!(sharded.optimizer_blob, whole.optimizer_blob, "{what}: the committed optimizer state");
        // Every worker wrote its parts of the model and of the optimizer state.
        let line = "trainerd: sharded commits: every member writes its parts of each commit to ";
        assert!(sharded.output.contains(line), "{what}: {}", sharded.output);
        assert_eq!((whole.parts, sharded.parts), (0, 2 * workers), "{what}");
    }
}

/// A deep MLP (bench/wide_mlp.py: 24 layers, 1.7 M parameters, 6.9 MB in float32) in buckets of
/// about a layer, Adam, 4 workers: the start says what each worker holds at each level, and the
/// summary measures it. `--shard optimizer` holds a quarter of the state and a buddy quarter;
/// `--shard gradients` also holds less gradient than one whole copy of it.
#[test]
fn each_worker_says_what_it_holds_and_the_summary_measures_it() {
    let mlp = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/wide_mlp.py");
    let args = RunArgs::new("python-model")
        .data(trainerd_testkit::paths::dataset())
        .plugin_arg(format!("module={}", mlp.display()))
        .plugin_arg("width=256")
        .plugin_arg("depth=24")
        .epochs(1)
        .steps(6)
        .batch(16)
        .seed(3)
        .threads(1)
        .optimizer("adam", 1e-3)
        .set("--bucket-mb", 0.3);
    let tmp = tempfile::tempdir().unwrap();
    let whole = run(&args, 4, &tmp.path().join("whole"));
    let optimizer = run(&args.clone().set("--shard", "optimizer"), 4, &tmp.path().join("optimizer"));
    let gradients = run(&args.clone().set("--shard", "gradients"), 4, &tmp.path().join("gradients"));
    let bytes = |run: &Ended, w: usize, what: &str| run.memory[w][what].as_u64().unwrap();
    let p = bytes(&whole, 0, "parameter_bytes");
    assert_eq!(p, 1_716_746 * 4, "the MLP's float32 parameters");
    let said = |run: &Ended, line: &str| assert!(run.output.contains(line), "{line}\n{}", run.output);
    said(&whole, "trainerd: each worker holds the parameters whole (6.9 MB), their gradients whole (6.9 MB), and the optimizer state whole (13.7 MB, 2 value(s) a parameter)");
    said(&optimizer, "the optimizer state of its ranges and a buddy copy of its predecessor's (3.4 MB and 3.4 MB)");
    said(&gradients, "the gradients of its ranges and its predecessor's (3.4 MB), and to reduce and gather them at most 3 buckets' buffers, kept from step to step (at most 0.9 MB)");
    for w in 0..4 {
        let (state, buddy) = (bytes(&whole, w, "optimizer_state_bytes"), bytes(&whole, w, "buddy_state_bytes"));
        assert_eq!((state, buddy), (2 * p, 0), "worker {w}: Adam's two moments, whole");
        // Whole gradients, held once: the buckets are their memory (no optimizer buffer takes
        // them back each step); sharded, a copy of each held range's clipped gradient too (its
        // own and its predecessor's, 2/4) while the step completes.
        let about = |run: &Ended, whole: u64, what: &str| {
            let held = bytes(run, w, "gradient_bytes");
            assert!(held.abs_diff(whole) < p / 50, "worker {w}: {held} bytes of gradients ({what}), of {p}");
        };
        about(&whole, p, "whole");
        for sharded in [&optimizer, &gradients] {
            let (own, buddy) = (bytes(sharded, w, "optimizer_state_bytes"), bytes(sharded, w, "buddy_state_bytes"));
            assert_eq!(own + buddy, sharded.state_bytes[w], "worker {w}: the two parts add up");
            for part in [own, buddy] {
                assert!(part.abs_diff(state / 4) <= state / 40, "worker {w}: {part} bytes of state, of {state}");
            }
        }
        assert_eq!(bytes(&optimizer, w, "parameter_bytes"), p, "worker {w}");
        about(&optimizer, p + p / 2, "whole, and the held ranges' clipped");
        // The parameters, and during the all-gather a copy of the held ranges' (about 2/4).
        let params = bytes(&gradients, w, "parameter_bytes");
        assert!(params > p + p / 3 && params < p + p * 2 / 3, "worker {w}: {params} bytes of parameters");
        // The quarter kept (carrying the new parameters into the all-gather) and the held
        // ranges' clipped gradients: 3/4, half the optimizer level's. In the backward pass, less:
        // the ranges kept so far, at most 2 buckets in flight and the first bucket's copy (the
        // first layer, 784 x 256). Besides, the buckets' buffers kept from step to step: as many
        // as were lent at once, at most 3, each the longest bucket's of several parameters (a
        // 256 x 256 layer and its bias).
        let (held, pooled) = (bytes(&gradients, w, "gradient_bytes"), 3 * (256 * 256 + 256) * 4);
        let what = "the ranges kept, the held ranges' clipped, and the buffers kept";
        assert!(held + p / 50 > p * 3 / 4 && held < p * 3 / 4 + pooled + p / 50, "worker {w}: {held} bytes ({what})");
    }
    assert_eq!(gradients.params, whole.params, "the same bits");
}

/// A commit made at each level of sharding resumes at another (none, optimizer, gradients), each
/// ending where an uninterrupted run does: the run is taken back to its commit at step 10 (the
/// newer records removed) and trained on at the other level.
#[test]
fn a_commit_of_each_level_resumes_at_the_others_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let args = cnn("mnist-cnn").optimizer("adam", 1e-3).set("--keep-checkpoints", 10);
    let straight = run(&args, 2, &tmp.path().join("straight"));
    let mode = |level: &str| if level == "none" { args.clone() } else { args.clone().set("--shard", level) };
    for (first, then) in
        [("optimizer", "none"), ("none", "optimizer"), ("gradients", "optimizer"), ("none", "gradients")]
    {
        let dir = tmp.path().join(format!("{first}-then-{then}"));
        run(&mode(first), 2, &dir);
        let commits = dir.join("ckpt/commits");
        let mut records: Vec<_> = std::fs::read_dir(&commits).unwrap().map(|e| e.unwrap().path()).collect();
        records.sort();
        assert_eq!(json(&records[0])["global_step"], 10);
        records[1..].iter().for_each(|r| std::fs::remove_file(r).unwrap());
        let resumed = run(&mode(then), 2, &dir);
        assert!(resumed.output.contains("resumed from checkpoint 1 in "), "{}", resumed.output);
        assert!(resumed.output.contains("at epoch 1, step 10 (global step 10)"), "{}", resumed.output);
        assert_eq!(resumed.params, straight.params, "--shard {first}, then {then}");
        assert_eq!(resumed.optimizer_blob, straight.optimizer_blob, "--shard {first}, then {then}");
        // Sharded, each worker reads its own ranges of the commit (whole, or in parts), and only
        // those: its owned range and a buddy copy of the other's, half of Adam's state each.
        let reads: Vec<&str> =
            resumed.output.lines().filter(|l| l.contains("trainerd: this worker read its ")).collect();
        assert_eq!(reads.len(), if then == "none" { 0 } else { 2 }, "--shard {first}, then {then}: {reads:?}");
        for line in reads {
            assert!(line.contains(" range(s) of the optimizer state and a buddy copy of "), "{line}");
            assert!(line.contains(" from checkpoint 1 in ") && line.ends_with(": no member holds it whole"), "{line}");
        }
    }
}

/// Two workers started by hand on TF_CONFIG with `--shard-optimizer`, with checkpoints in
/// `ckpt(i)` and each its own failpoints (`TRAINERD_FAILPOINT`, none where empty): their outputs,
/// once both exited 0, and worker 0's parameters.
fn by_hand(
    args: &RunArgs,
    dir: &Path,
    ckpt: &dyn Fn(usize) -> std::path::PathBuf,
    env: [&str; 2],
) -> (Vec<String>, String) {
    let ports = free_ports(2);
    let workers: Vec<_> = (0..2)
        .map(|i| {
            let args = args.clone().on("--shard-optimizer").checkpoints(ckpt(i), 10);
            let mut cmd: Command = args.summary(dir.join(format!("s{i}.json"))).command("run");
            cmd.env("TF_CONFIG", tf_config(&ports, i)).stdout(Stdio::piped()).stderr(Stdio::piped());
            if !env[i].is_empty() {
                cmd.env("TRAINERD_FAILPOINT", env[i]);
            }
            cmd.spawn().unwrap()
        })
        .collect();
    let outputs: Vec<_> = workers.into_iter().map(|w| w.wait_with_output().unwrap()).collect();
    outputs.iter().for_each(|out| assert!(out.status.success(), "{}", text(out)));
    let params = json(&dir.join("s0.json"))["params_sha256"].as_str().unwrap().to_string();
    (outputs.iter().map(text).collect(), params)
}

/// The commit records after the first in the local checkpoint directory `ckpt` removed: the run
/// is taken back to its first commit.
fn back_to_the_first_commit(ckpt: &Path) {
    let mut records: Vec<_> = std::fs::read_dir(ckpt.join("commits")).unwrap().map(|e| e.unwrap().path()).collect();
    records.sort();
    records[1..].iter().for_each(|r| std::fs::remove_file(r).unwrap());
}

/// A sharded run's resume where a member cannot read its ranges of the commit: once the chief
/// itself (every member keeps the state unread, and the next generation reads it again), then
/// the other worker (the chief reads every range, and they move to their owners); and each worker
/// on its own directory, where the other's holds no such commit. Each ends as the uninterrupted
/// run does.
#[test]
fn a_resume_where_a_member_cannot_read_its_ranges_ends_as_the_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    let args = cnn("mnist-cnn").optimizer("adam", 1e-3).set("--keep-checkpoints", 10);
    let whole = run(&args, 2, &tmp.path().join("whole"));
    let shared = tmp.path().join("shared");
    by_hand(&args, tmp.path(), &|_| shared.clone(), ["", ""]);
    back_to_the_first_commit(&shared);
    let armed = ["committed-read-fails@1", "committed-read-fails@2"];
    let (outputs, params) = by_hand(&args, tmp.path(), &|_| shared.clone(), armed);
    assert_eq!(params, whole.params[0], "{}", outputs.join("\n"));
    let chief_failed =
        "could not read their ranges of the optimizer state from checkpoint 1 (the coordinator among them)";
    assert!(outputs[0].contains(chief_failed), "{}", outputs[0]);
    assert!(outputs[0].contains("could not read its ranges of the optimizer state from checkpoint 1 in "));
    let moved = "could not read their ranges of the optimizer state from checkpoint 1 (a checkpoint directory local \
                 to each node?): the coordinator read it whole, and the ranges move to their owners";
    assert!(outputs.iter().all(|o| o.contains(moved)), "{}", outputs.join("\n"));
    let own = "trainerd: this worker could not read its ranges of the optimizer state from checkpoint 1 in ";
    assert!(outputs[1].contains(&format!("{}: failpoint committed-read-fails", shared.display())), "{}", outputs[1]);
    assert!(outputs[1].contains(own), "{}", outputs[1]);
    // Each worker on a directory of its own: the other's has no commit 1.
    let node = |i: usize| tmp.path().join(format!("node{i}"));
    by_hand(&args, tmp.path(), &node, ["", ""]);
    back_to_the_first_commit(&node(0));
    let (outputs, params) = by_hand(&args, tmp.path(), &node, ["", ""]);
    assert_eq!(params, whole.params[0], "{}", outputs.join("\n"));
    assert!(outputs[1].contains(own), "{}", outputs[1]);
    assert!(outputs.iter().all(|o| o.contains(moved)), "{}", outputs.join("\n"));
}

/// Sharding where it cannot run yet is refused, naming what to do.
#[test]
fn sharding_without_checkpoints_in_a_cluster_is_refused() {
    let out = cnn("mnist-cnn").on("--shard-optimizer").local(2).output().unwrap();
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains(
            "--shard-optimizer needs --checkpoint-dir: a worker lost together with its buddy (the next worker) takes \
             their ranges of the optimizer state with them, and the cluster goes back to the last commit"
        ),
        "{}",
        error_line(&out)
    );
}

/// Workers that do not reach one location (each its own directory, as node-local disks on a
/// multi-node cluster would be): the probe finds it, the start says so, and the coordinator
/// gathers the state and writes every commit alone, whole, in its own directory, as the
/// unsharded run commits it.
#[test]
fn a_location_not_every_member_reaches_keeps_single_writer_commits() {
    let tmp = tempfile::tempdir().unwrap();
    let args = cnn("mnist-cnn").optimizer("adam", 1e-3);
    let whole = run(&args, 2, &tmp.path().join("whole"));
    let ports = free_ports(2);
    let workers: Vec<_> = (0..2)
        .map(|i| {
            let ckpt = tmp.path().join(format!("node{i}"));
            let args = args.clone().on("--shard-optimizer").checkpoints(&ckpt, 10);
            let mut cmd: Command = args.summary(tmp.path().join(format!("s{i}.json"))).command("run");
            cmd.env("TF_CONFIG", tf_config(&ports, i)).stdout(Stdio::piped()).stderr(Stdio::piped());
            cmd.spawn().unwrap()
        })
        .collect();
    let outputs: Vec<_> = workers.into_iter().map(|w| w.wait_with_output().unwrap()).collect();
    for out in &outputs {
        assert!(out.status.success(), "{}", text(out));
        let line = "trainerd: sharded commits: worker 0 (";
        assert!(text(out).contains(line), "{}", text(out));
        let alone = "a directory local to each node?";
        assert!(text(out).contains(alone) && text(out).contains("the coordinator gathers the state and writes each"));
    }
    let chief = tmp.path().join("node0");
    assert_eq!(parts_in_newest(&chief), 0, "written whole");
    assert_eq!(blob_sha256(&chief, "optimizer.safetensors"), whole.optimizer_blob);
    assert!(
        !tmp.path().join("node1/commits").exists()
            || std::fs::read_dir(tmp.path().join("node1/commits")).unwrap().count() == 0
    );
    let params = json(&tmp.path().join("s0.json"))["params_sha256"].clone();
    assert_eq!(params, whole.params[0].as_str());
}

/// The checkpoint tools read a commit written in parts: `ckpt verify` verifies every part, `ckpt
/// export` writes the unsharded commit's file byte for byte, and a part with a flipped byte fails
/// verification, naming the part.
#[test]
fn the_checkpoint_tools_read_a_commit_written_in_parts() {
    let tmp = tempfile::tempdir().unwrap();
    let args = cnn("mnist-cnn").optimizer("adam", 1e-3);
    let (a, b) = (tmp.path().join("whole"), tmp.path().join("sharded"));
    run(&args, 2, &a);
    assert_eq!(run(&args.clone().on("--shard-optimizer"), 2, &b).parts, 4);
    let ckpt = |dir: &Path| dir.join("ckpt");
    let tool = |args: &[&std::ffi::OsStr]| trainerd_testkit::trainerd_cmd().arg("ckpt").args(args).output().unwrap();
    let export = |dir: &Path| {
        let file = dir.join("exported.safetensors");
        let out = tool(&["export".as_ref(), ckpt(dir).as_os_str(), "--output".as_ref(), file.as_os_str()]);
        assert!(out.status.success(), "{}", text(&out));
        std::fs::read(file).unwrap()
    };
    assert!(export(&a) == export(&b), "the export of a commit in parts is the unsharded commit's");
    let verify = |dir: &Path| tool(&["verify".as_ref(), ckpt(dir).as_os_str()]);
    let out = verify(&b);
    assert!(out.status.success(), "{}", text(&out));
    let data = ckpt(&b).join("data");
    let mut parts: Vec<_> = std::fs::read_dir(&data)
        .unwrap()
        .map(|d| d.unwrap().path().join("model.part-1.safetensors"))
        .filter(|p| p.exists())
        .collect();
    parts.sort_by_key(|p| std::fs::metadata(p).unwrap().modified().unwrap());
    let newest = parts.last().expect("a part of worker 1");
    let mut bytes = std::fs::read(newest).unwrap();
    bytes[100] ^= 0x80;
    std::fs::write(newest, bytes).unwrap();
    let out = verify(&b);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("DAMAGED") && text(&out).contains("model.part-1.safetensors"), "{}", text(&out));
}

/// A sharded run of 3 workers committing every `every` steps (comparing the replicas every
/// `check_every`, where given), failpoint `point` armed on each and each pause released 3 s after
/// it began (`pauses` of them, one file each: each process takes the file it finds): its output,
/// and the global steps of its records, every one verified.
fn held_at(point: &str, pauses: usize, (every, check_every): (u64, Option<u64>)) -> (String, Vec<u64>) {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let release = tmp.path().join("release");
    let mut args = cnn("mnist-cnn").optimizer("adam", 1e-3).on("--shard-optimizer").set("--keep-checkpoints", 0);
    if let Some(n) = check_every {
        args = args.set("--replica-check-every", n);
    }
    let mut cmd = args.checkpoints(&ckpt, every).summary(tmp.path().join("s.json")).local(3);
    cmd.env("TRAINERD_FAILPOINT", point).env("TRAINERD_FAILPOINT_RELEASE", &release);
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    // The hold counts from the point's first arrival, not from the start (a loaded machine can
    // take longer than the hold to get there, and would then hold nothing).
    let (reached, arrived) = std::sync::mpsc::channel();
    let read = |pipe: Box<dyn std::io::Read + Send>, reached: std::sync::mpsc::Sender<()>| {
        std::thread::spawn(move || {
            let mut all = String::new();
            for line in std::io::BufRead::lines(std::io::BufReader::new(pipe)).map_while(Result::ok) {
                if line.contains("trainerd: failpoint ") && line.ends_with(" reached") {
                    let _ = reached.send(());
                }
                all.push_str(&line);
                all.push('\n');
            }
            all
        })
    };
    let stdout = read(Box::new(child.stdout.take().unwrap()), reached.clone());
    let stderr = read(Box::new(child.stderr.take().unwrap()), reached);
    let releasing = std::thread::spawn(move || {
        if arrived.recv_timeout(std::time::Duration::from_secs(300)).is_err() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_secs(3));
        for _ in 0..pauses {
            std::fs::write(&release, b"").unwrap();
            let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
            while release.exists() && std::time::Instant::now() < until {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
    });
    let status = child.wait().unwrap();
    let log = format!("stdout:\n{}\nstderr:\n{}", stdout.join().unwrap(), stderr.join().unwrap());
    releasing.join().unwrap();
    assert!(status.success(), "{log}");
    let raw = trainerd_storage::location::local_store(&ckpt).unwrap();
    let store = CheckpointStore::new(Arc::new(raw), object_store::path::Path::default(), "ckpt");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let records = runtime.block_on(store.list()).unwrap();
    let steps = records.iter().map(|r| r.global_step).collect();
    for r in records {
        runtime
            .block_on(store.load(r.sequence))
            .unwrap_or_else(|e| panic!("commit {} does not verify: {e}\n{log}", r.sequence));
    }
    (log, steps)
}

/// Commits every step, the first held for 3 s before its collection (which deletes this writer's
/// data that no record names but its own; failpoint `commit-before-collect`, on the coordinator)
/// while training goes on: the next commit's parts are written only after it ends, and every
/// commit kept verifies (the soak found a record naming parts that the previous commit's
/// collection had deleted).
#[test]
fn every_commit_of_a_sharded_run_committing_every_step_verifies_and_a_held_commit_holds_no_step_back() {
    let (log, steps) = held_at("commit-before-collect@1", 1, (1, None));
    // The steps' commits due meanwhile are skipped (training never waits for storage); the
    // epoch's end waits for it, and the run's end is committed.
    assert!(log.contains("skipped: the previous commit to"), "{log}");
    assert!(steps.len() >= 2 && steps.len() < 24, "{steps:?}: {log}");
    assert_eq!(steps.last(), Some(&24), "the run's end is committed: {log}");
}

/// Every worker's part of the first commit (step 4) held for 3 s as it is written (failpoint
/// `commit-part`, in each worker's writing thread): training goes on meanwhile (the commit due at
/// step 8 is skipped, said in a line, where the loop used to wait for its parts; the comparisons
/// of steps 6 and 9 skip nothing, no commit being due), the epoch's end waits for it, and the held
/// commit and the epoch's are both recorded and verify.
#[test]
fn training_goes_on_while_the_parts_of_a_sharded_commit_are_written() {
    let (log, steps) = held_at("commit-part@1", 3, (4, Some(3)));
    assert_eq!(log.matches("trainerd: failpoint commit-part reached").count(), 3, "{log}");
    assert!(log.contains("warning: checkpoint at step 8 skipped: the previous commit to "), "{log}");
    for step in [5, 6, 7, 9, 10, 11] {
        assert!(!log.contains(&format!("checkpoint at step {step} skipped")), "step {step} was not due: {log}");
    }
    assert!(steps.contains(&4) && steps.contains(&12) && steps.contains(&24), "{steps:?}: {log}");
}

/// A sharded run's chief that restored a commit and is stopped while it waits for the others to
/// join (its optimizer state still the commit's, not yet read by range) exits as a stop does,
/// saying that the commit it restored is its state.
#[test]
fn a_chief_stopped_before_its_peers_join_says_the_commit_it_restored_is_its_state() {
    let tmp = tempfile::tempdir().unwrap();
    let args = cnn("mnist-cnn").optimizer("adam", 1e-3).set("--keep-checkpoints", 10).set("--shard", "optimizer");
    let dir = tmp.path().join("run");
    run(&args, 2, &dir);
    let ckpt = dir.join("ckpt");
    back_to_the_first_commit(&ckpt);
    let argv: Vec<String> =
        ["run".to_string()].into_iter().chain(args.checkpoints(&ckpt, 10).on("--no-failover").to_vec()).collect();
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let mut chief = trainerd_testkit::Worker::start_with(&argv, &[("TF_CONFIG", tf_config(&free_ports(2), 0))]);
    chief.wait_line(|l| l.contains("resumed from checkpoint 1 in "), std::time::Duration::from_secs(120));
    chief.signal_job(libc::SIGTERM);
    let (status, lines, _) = chief.drain(std::time::Duration::from_secs(60));
    let said = format!(
        "trainerd: stopped by signal at global step 10; the state is already committed as checkpoint 1 in {}, which \
         it was restored from",
        ckpt.display()
    );
    assert!(status.success() && lines.contains(&said), "{status:?}\n{}", lines.join("\n"));
}
