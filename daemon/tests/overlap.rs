//! `--overlap` with real daemons on loopback: each bucket's reduction starts during the backward
//! pass, and the parameters end bit for bit those of `--overlap off` (every reduction after the
//! backward pass) for a Rust plugin, an eager PyTorch module, a `transformers` model and a Keras
//! model, with AdamW, clipping, accumulation, bfloat16 and the sharded optimizer; and the
//! summary says where a step's time went.

use std::path::Path;

use trainerd_testkit::output::{json, text};
use trainerd_testkit::{dataset, python_examples, tokens, RunArgs};

/// Small buckets, so that a model of these tests has several.
const BUCKET_MB: &str = "0.02";

/// `args` on `workers` local workers with `--overlap` on and off (checkpoints in the run's
/// directory, for the sharded optimizer): each run's summaries, one per worker.
fn on_and_off(args: &RunArgs, workers: usize, dir: &Path) -> [Vec<serde_json::Value>; 2] {
    ["on", "off"].map(|overlap| {
        let run = dir.join(overlap);
        std::fs::create_dir_all(&run).unwrap();
        let args = args.clone().set("--overlap", overlap).set("--bucket-mb", BUCKET_MB);
        let out = args.checkpoints(run.join("ckpt"), 0).summary(run.join("s.json")).local(workers).output().unwrap();
        assert!(out.status.success(), "--overlap {overlap}: {}", text(&out));
        // Several buckets, so that the overlap has something to hide.
        let said = match overlap {
            "on" => "each bucket but the first reduced during the backward pass, as soon as its gradients are final",
            _ => "each reduced after the backward pass (--overlap off",
        };
        let line = text(&out).lines().find(|l| l.contains("trainerd: gradients in ")).map(str::to_string);
        let line = line.unwrap_or_else(|| panic!("no buckets line: {}", text(&out)));
        assert!(line.contains(said) && !line.contains(" in 1 bucket(s)"), "--overlap {overlap}: {line}");
        (0..workers).map(|w| json(&run.join(format!("s.worker{w}.json")))).collect()
    })
}

/// Every worker of both runs ended with the same parameters; the phases of a step are given.
fn assert_same_bits(case: &str, [on, off]: &[Vec<serde_json::Value>; 2]) {
    let params = |s: &serde_json::Value| s["params_sha256"].as_str().unwrap().to_string();
    for (w, s) in on.iter().chain(off).enumerate() {
        assert_eq!(params(s), params(&on[0]), "{case}: summary {w} (the on run's workers, then the off run's)");
    }
    let phases = &on[0]["step_phases"];
    assert!(phases["forward_backward_ms"].as_f64().unwrap() > 0.0, "{case}: {phases}");
    assert!(phases["exposed_communication_ms"].as_f64().unwrap() >= 0.0, "{case}: {phases}");
    assert!(phases["optimizer_ms"].as_f64().is_some(), "{case}: {phases}");
}

fn cnn() -> RunArgs {
    RunArgs::new("mnist-cnn").epochs(1).steps(12).batch(16).seed(7).threads(1)
}

/// The Rust plugin with each optimizer and control the issue names.
#[test]
fn a_rust_plugin_ends_with_the_same_bits_with_overlap_on_and_off() {
    let cases: Vec<(&str, RunArgs, usize)> = vec![
        ("adamw with --clip-norm, 3 workers", cnn().optimizer("adamw", 1e-3).set("--clip-norm", 0.5), 3),
        (
            "sgd with momentum, --accumulate 2, 2 workers",
            cnn().optimizer("sgd", 0.05).set("--momentum", 0.9).set("--accumulate", 2),
            2,
        ),
        ("adam under --precision bf16, 2 workers", cnn().optimizer("adam", 1e-3).set("--precision", "bf16"), 2),
        (
            "adam with --shard-optimizer and --clip-norm, 3 workers",
            cnn().optimizer("adam", 1e-3).on("--shard-optimizer").set("--clip-norm", 0.5),
            3,
        ),
    ];
    for (i, (case, args, workers)) in cases.into_iter().enumerate() {
        let tmp = tempfile::tempdir().unwrap();
        let runs = on_and_off(&args, workers, &tmp.path().join(i.to_string()));
        assert_same_bits(case, &runs);
    }
}

/// The small GPT example (an eager PyTorch module, tied head and embedding, AdamW with decay
/// groups) and transformers' GPT-2.
#[test]
fn python_modules_end_with_the_same_bits_with_overlap_on_and_off() {
    for example in ["gpt.py", "hf_gpt2.py"] {
        let args = RunArgs::new("python-model")
            .data(tokens())
            .plugin_arg(format!("module={}", python_examples().join(example).display()))
            .epochs(1)
            .steps(6)
            .batch(4)
            .seed(5)
            .threads(1)
            .optimizer("adamw", 1e-3)
            .set("--clip-norm", 1.0);
        let tmp = tempfile::tempdir().unwrap();
        assert_same_bits(example, &on_and_off(&args, 2, tmp.path()));
    }
}

/// A Keras model with BatchNormalization (its statistics averaged over the slots) and two
/// Dropouts, one seeded.
#[test]
fn a_keras_model_ends_with_the_same_bits_with_overlap_on_and_off() {
    let tmp = tempfile::tempdir().unwrap();
    let module = tmp.path().join("bn.py");
    // The model of keras.rs's BatchNorm and Dropout tests.
    std::fs::write(&module, include_str!("fixtures/keras_bn_dropout.py")).unwrap();
    let args = RunArgs::new("python-model")
        .data(dataset())
        .plugin_arg(format!("module={}", module.display()))
        .epochs(1)
        .steps(8)
        .batch(16)
        .seed(5)
        .threads(1);
    assert_same_bits("keras", &on_and_off(&args, 3, &tmp.path().join("runs")));
}

/// A bucket size that is not a size is refused, naming the flag.
#[test]
fn a_bucket_size_that_is_not_a_size_is_refused() {
    let out = cnn().set("--bucket-mb", 0).command("run").output().unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out).contains("--bucket-mb 0: expected a size in MB of at least one float32 (4 bytes), such as 25"),
        "{}",
        text(&out)
    );
}
