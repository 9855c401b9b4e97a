//! Training from datasets as users have them: Parquet in Hugging Face's layout (PNG bytes), the
//! same model as from MNIST's idx files, the same global batches whatever the worker count, an
//! exact resume at every step around an epoch boundary, a resume on another worker count, a
//! dataset larger than memory, and every bad input named.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

use trainerd_testkit::output::{error_line, error_of, json, params_sha256, stdout, text};
use trainerd_testkit::{dataset, parquet_dataset, trainerd_cmd, RunArgs};

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `trainerd local --workers N` (or `run` for `None`) of `run` on one thread each.
fn train(workers: Option<usize>, run: RunArgs) -> Output {
    let run = run.threads(1);
    let mut cmd = match workers {
        Some(n) => run.local(n),
        None => run.command("run"),
    };
    cmd.output().unwrap()
}

/// `plugin` on `data`.
fn on(plugin_name: &str, data: &Path) -> RunArgs {
    RunArgs::new(plugin_name).data(data)
}

fn ok(out: Output) -> Output {
    assert!(out.status.success(), "{}", text(&out));
    out
}

#[test]
fn mnist_cnn_from_parquet_on_two_workers_reaches_the_in_memory_bar_with_the_idx_runs_parameters() {
    let tmp = tempfile::tempdir().unwrap();
    let s = |name: &str| tmp.path().join(name);
    let args = |data: &Path, summary: &Path| on("mnist-cnn", data).epochs(1).batch(64).seed(3).summary(summary);
    let parquet = ok(train(Some(2), args(&parquet_dataset(), &s("p.json"))));
    let said = stdout(&parquet);
    assert!(said.contains("data: Parquet at "), "{said}");
    assert!(said.contains("(3 train file(s), 60,000 rows; 1 test file(s), 10,000 rows; fingerprint "), "{said}");
    assert!(said.contains("every epoch a uniform shuffle"), "{said}");
    let idx = ok(train(Some(2), args(&dataset(), &s("i.json"))));
    assert!(stdout(&idx).contains("(the plugin's own format)"));
    let (p0, p1) = (json(&s("p.worker0.json")), json(&s("p.worker1.json")));
    let accuracy = p0["test_accuracy"].as_f64().unwrap();
    assert!(accuracy >= 0.85, "test accuracy {accuracy} from Parquet");
    assert_eq!(p0["params_sha256"], p1["params_sha256"], "the workers' parameters differ");
    // A window over the whole split is the in-memory order, and PNG is lossless: the same bits.
    assert_eq!(params_sha256(&s("p.worker0.json")), params_sha256(&s("i.worker0.json")));
    assert_eq!(p0["test_loss"], json(&s("i.worker0.json"))["test_loss"]);
    // Each worker fetched each row group of the training split once, and holds its share at most.
    let d = &p0["data"];
    let projected = d["train_projected_bytes"].as_u64().unwrap();
    assert!(projected > 25_000_000 && projected <= d["train_bytes"].as_u64().unwrap(), "{d}");
    assert_eq!(d["train_epochs"][0][1]["fetched"].as_u64().unwrap(), projected, "{d}");
}

/// Every step's example ids from a run's `--log-examples` files (one per worker): by global step,
/// the workers' slices joined in rank order.
fn global_batches(prefix: &Path, workers: usize) -> BTreeMap<u64, Vec<(u64, u64)>> {
    let mut out: BTreeMap<u64, Vec<(u64, u64)>> = BTreeMap::new();
    for w in 0..workers {
        let file = prefix.with_file_name(format!("ex.worker{w}.jsonl"));
        for line in std::fs::read_to_string(&file).unwrap().lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let ids = v["ids"].as_array().unwrap().iter().map(|i| (i[0].as_u64().unwrap(), i[1].as_u64().unwrap()));
            out.entry(v["global_step"].as_u64().unwrap()).or_default().extend(ids);
        }
    }
    out
}

#[test]
fn two_and_four_workers_see_the_same_global_batches_of_a_windowed_shuffle() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |workers: usize, batch: u32| {
        let dir = tmp.path().join(format!("w{workers}"));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("ex.jsonl");
        let run = on("linear", &parquet_dataset()).epochs(2).steps(40).batch(batch).set("--shuffle-window", 7000);
        ok(train(Some(workers), run.set("--log-examples", path(&log))));
        global_batches(&log, workers)
    };
    let two = run(2, 32);
    let four = run(4, 16);
    assert_eq!(two.len(), 80);
    assert_eq!(two, four);
    let first: Vec<_> = two[&1].clone();
    assert_eq!(first.len(), 64);
    // A window of 7,000 rows: the first step's examples come from its first window's row groups.
    let files: std::collections::BTreeSet<u64> = two.values().flatten().map(|id| id.0).collect();
    assert_eq!(files.len(), 3, "the row groups of every file are shuffled together");
}

/// The global step and sequence of each commit in `ckpt`.
fn commits(ckpt: &Path) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = std::fs::read_dir(ckpt.join("commits"))
        .unwrap()
        .flatten()
        .map(|e| {
            let record = json(&e.path());
            (record["global_step"].as_u64().unwrap(), record["sequence"].as_u64().unwrap())
        })
        .collect();
    out.sort_unstable();
    out
}

/// A copy of `ckpt` whose newest commit is the one of `global_step`.
fn cut_at(ckpt: &Path, global_step: u64, to: &Path) -> u64 {
    let sequence = commits(ckpt).into_iter().find(|c| c.0 == global_step).unwrap().1;
    copy_tree(ckpt, to);
    for e in std::fs::read_dir(to.join("commits")).unwrap().flatten() {
        if json(&e.path())["sequence"].as_u64().unwrap() > sequence {
            std::fs::remove_file(e.path()).unwrap();
        }
    }
    sequence
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

fn lines(file: &Path) -> Vec<String> {
    std::fs::read_to_string(file).unwrap().lines().map(String::from).collect()
}

/// Resumed at each of the last 3 and first 3 steps of an epoch (a windowed shuffle, 8 steps an
/// epoch), a run takes exactly the examples the uninterrupted run took from there, none repeated
/// or skipped, and ends with its parameters.
#[test]
fn a_resume_at_every_step_around_an_epoch_boundary_is_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let args = |ckpt: &Path, summary: &Path, log: &Path| {
        on("linear", &parquet_dataset())
            .epochs(2)
            .steps(8)
            .batch(50)
            .set("--shuffle-window", 3000)
            .checkpoints(ckpt, 1)
            .summary(summary)
            .set("--log-examples", path(log))
            .set("--keep-checkpoints", 0)
    };
    let (ckpt, summary, log) = (tmp.path().join("ref"), tmp.path().join("ref.json"), tmp.path().join("ref.jsonl"));
    ok(train(None, args(&ckpt, &summary, &log)));
    let reference = lines(&log);
    assert_eq!(reference.len(), 16);
    for at in [5, 6, 7, 8, 9, 10] {
        let dir = tmp.path().join(format!("at{at}"));
        let sequence = cut_at(&ckpt, at, &dir.join("ckpt"));
        let (s, l) = (dir.join("s.json"), dir.join("ex.jsonl"));
        let out = ok(train(None, args(&dir.join("ckpt"), &s, &l)));
        let (epoch, step) = (at / 8 + 1, at % 8);
        assert!(
            stdout(&out).contains(&format!(
                "resumed from checkpoint {sequence} in {} at epoch {epoch}, step {step} (global step {at})",
                path(&dir.join("ckpt"))
            )),
            "{}",
            stdout(&out)
        );
        assert_eq!(lines(&l), reference[at as usize..], "resumed at global step {at}");
        assert_eq!(params_sha256(&s), params_sha256(&summary), "resumed at global step {at}");
    }
}

#[test]
fn a_checkpoint_resumes_on_another_worker_count_with_the_same_global_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let common = on("linear", &parquet_dataset()).epochs(2).steps(30).seed(4).set("--shuffle-window", 9000);
    let log = tmp.path().join("ex.jsonl");
    // Two workers of batch 32 train the first epoch (--epochs is part of the run configuration:
    // the commit of its end is taken from a copy of a two-epoch run, cut there).
    let two = common.clone().batch(32).checkpoints(&ckpt, 10).set("--keep-checkpoints", 0);
    ok(train(Some(2), two.set("--log-examples", path(&log))));
    let reference = global_batches(&log, 2);
    let cut = tmp.path().join("cut");
    cut_at(&ckpt, 40, &cut);

    let one_log = tmp.path().join("one.jsonl");
    let one = common.clone().batch(64).checkpoints(&cut, 0).set("--log-examples", path(&one_log));
    let out = ok(train(None, one));
    assert!(
        stdout(&out).contains(
            "was written by 2 worker(s), this run has 1: the same global batches continue, but the gradients are summed \
             in other groups"
        ),
        "{}",
        stdout(&out)
    );
    let resumed: BTreeMap<u64, Vec<(u64, u64)>> = lines(&one_log)
        .iter()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let ids = v["ids"].as_array().unwrap().iter().map(|i| (i[0].as_u64().unwrap(), i[1].as_u64().unwrap()));
            (v["global_step"].as_u64().unwrap(), ids.collect())
        })
        .collect();
    assert_eq!(resumed.keys().copied().collect::<Vec<_>>(), (41..=60).collect::<Vec<_>>());
    for (step, ids) in &resumed {
        assert_eq!(ids, &reference[step], "global step {step}");
    }

    // Another global batch is refused (from a fresh copy: the resumed run committed into `cut`).
    let fresh = tmp.path().join("fresh");
    cut_at(&ckpt, 40, &fresh);
    let out = train(None, common.batch(32).checkpoints(&fresh, 0));
    assert_eq!(
        error_of(&out),
        format!(
            "error: checkpoint: {}: checkpoint {} was written by 2 worker(s) with batch 32 each (global batch 64); this \
             run has 1 worker(s) with batch 32 (global batch 32): a resume with another worker count needs the same \
             global batch (give --batch-size 64)",
            path(&fresh),
            commits(&fresh).last().unwrap().1
        )
    );
}

/// The fixture's columns for `scripts/synthetic_parquet.py`'s datasets.
const PIXELS: &str =
    r#"[{"name":"pixels","decode":{"kind":"numbers","shape":[1,28,28]}},{"name":"label","decode":{"kind":"integer"}}]"#;

fn synthetic(rows: u64, out: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/synthetic_parquet.py");
    let made = Command::new("python3")
        .arg(script)
        .args(["--rows", &rows.to_string(), "--out", path(out)])
        .output()
        .expect("python3 with pyarrow (scripts/setup.sh)");
    assert!(made.status.success(), "{}", text(&made));
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir).unwrap().flatten().map(|e| e.metadata().unwrap().len()).sum()
}

/// A dataset four times larger than the memory bound trains with the peak resident memory of a
/// run on a small one plus that bound (RLIMIT_AS cannot be used: libtorch reserves far more
/// address space than it touches).
#[test]
fn a_dataset_several_times_larger_than_the_memory_bound_streams_within_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (small, big) = (tmp.path().join("small"), tmp.path().join("big"));
    synthetic(6_000, &small);
    synthetic(240_000, &big);
    // Held rows: two windows of 4,096 rows plus two row groups of 1,024 (3.2 kB each, about 33 MB);
    // the queue's batches, the row groups being decoded and allocator slack make the rest.
    let bound: u64 = 160 << 20;
    assert!(dir_bytes(&big) > 4 * bound, "{} bytes", dir_bytes(&big));
    let run = |data: &Path, name: &str| {
        let summary = tmp.path().join(name);
        let run = RunArgs::new("test-fixture").threads(1).epochs(1).batch(256).set("--shuffle-window", 4096);
        let mut cmd = run.data(data).summary(&summary).command("run");
        cmd.env("TRAINERD_FIXTURE_COLUMNS", PIXELS);
        ok(cmd.output().unwrap());
        json(&summary)
    };
    let baseline = run(&small, "small.json");
    let streamed = run(&big, "big.json");
    let peak = |s: &serde_json::Value| s["peak_rss_bytes"].as_u64().unwrap();
    assert!(
        peak(&streamed) <= peak(&baseline) + bound,
        "peak RSS {} MB on {} MB of data, {} MB on the small dataset; bound {} MB",
        peak(&streamed) >> 20,
        dir_bytes(&big) >> 20,
        peak(&baseline) >> 20,
        bound >> 20
    );
    assert_eq!(streamed["steps"], 240_000 / 256);
    let held = streamed["data"]["peak_held_bytes"].as_u64().unwrap();
    assert!(held < 40 << 20, "{held} bytes of rows held");
}

#[test]
fn bad_datasets_are_refused_before_training_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("fm");
    copy_tree(&parquet_dataset(), &data);
    let first = data.join("train-00000-of-00003.parquet");

    // A plugin without columns.
    let mut cmd = RunArgs::new("test-fixture").data(&data).command("run");
    let out = cmd.env("TRAINERD_FIXTURE_COLUMNS", "none").output().unwrap();
    assert_eq!(
        error_of(&out),
        format!(
            "error: plugin test-fixture declares no columns, so it cannot train on the Parquet dataset at {}: it \
             reads only its own format from a directory (rebuild it declaring PluginInfo::columns)",
            data.display()
        )
    );
    // Columns the files do not have.
    let mut cmd = RunArgs::new("test-fixture").data(&data).command("run");
    let out = cmd.env("TRAINERD_FIXTURE_COLUMNS", PIXELS).output().unwrap();
    assert_eq!(
        error_of(&out),
        format!(
            "error: data file {}: no column `pixels` (the plugin reads it as a list of 784 numbers (shape [1, 28, 28])); \
             the file has: image (struct<bytes: binary, path: string>), label (int64)",
            first.display()
        )
    );
    // A codec this build does not read (brotli), refused before training.
    let brotli = tmp.path().join("brotli");
    std::fs::create_dir_all(&brotli).unwrap();
    let script = "import sys, pyarrow as pa, pyarrow.parquet as pq\n\
image = pa.array([{'bytes': b'x', 'path': None}], pa.struct([('bytes', pa.binary()), ('path', pa.string())]))\n\
t = pa.table({'image': image, 'label': pa.array([1], pa.int64())})\n\
for s in ('train', 'test'):\n    pq.write_table(t, f'{sys.argv[1]}/{s}-00000-of-00001.parquet', compression='brotli')";
    let made = Command::new("python3").args(["-c", script]).arg(&brotli).output().unwrap();
    assert!(made.status.success(), "{}", text(&made));
    let out = train(None, on("linear", &brotli));
    assert_eq!(
        error_of(&out),
        format!(
            "error: data file {}: column `image.bytes` is compressed with BROTLI, which this trainerd does not read (it \
             reads uncompressed, snappy, gzip, lz4 and zstd); rewrite the file with one of those (pyarrow and pandas \
             write snappy by default)",
            brotli.join("train-00000-of-00001.parquet").display()
        )
    );
    // A missing shard.
    std::fs::rename(data.join("train-00001-of-00003.parquet"), tmp.path().join("away")).unwrap();
    let out = train(None, on("linear", &data));
    assert_eq!(
        error_of(&out),
        format!(
            "error: data location {}: missing train-00001-of-00003.parquet (train has 3 files by its names: 2 found)",
            data.display()
        )
    );
    std::fs::rename(tmp.path().join("away"), data.join("train-00001-of-00003.parquet")).unwrap();
    // A damaged row group: one clear error naming the file and the row group.
    let damaged = data.join("train-00002-of-00003.parquet");
    damage_row_group(&damaged, 7);
    let out = train(None, on("linear", &data).epochs(1));
    let line = error_line(&out);
    assert_eq!(out.status.code(), Some(1));
    assert!(line.starts_with(&format!("error: data file {}, row group 7: ", damaged.display())), "{line}");
}

/// Overwrites the first bytes of row group `group`'s first column chunk of `file`, keeping its
/// size and modification time (as a bad sector would).
fn damage_row_group(file: &Path, group: usize) {
    let bytes = std::fs::read(file).unwrap();
    let meta = parquet_offsets(file);
    let start = meta[group] as usize;
    let mut damaged = bytes.clone();
    damaged[start..start + 32].fill(0xee);
    let mtime = std::fs::metadata(file).unwrap().modified().unwrap();
    std::fs::write(file, damaged).unwrap();
    std::fs::File::options().append(true).open(file).unwrap().set_modified(mtime).unwrap();
}

/// Each row group's first column chunk offset, read with pyarrow (as a user's tool sees it).
fn parquet_offsets(file: &Path) -> Vec<u64> {
    let script = "import sys, pyarrow.parquet as pq\nm = pq.ParquetFile(sys.argv[1]).metadata\nprint(' '.join(str(m.row_group(i).column(0).data_page_offset) for i in range(m.num_row_groups)))";
    let out = Command::new("python3").args(["-c", script]).arg(file).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    String::from_utf8_lossy(&out.stdout).split_whitespace().map(|n| n.parse().unwrap()).collect()
}

/// `data inspect` shows the files, rows, row groups, schema and split sizes.
#[test]
fn data_inspect_shows_files_rows_row_groups_and_schema() {
    let data = parquet_dataset();
    let out = ok(trainerd_cmd().args(["data", "inspect"]).arg(&data).output().unwrap());
    let said = stdout(&out);
    for expected in [
        format!("dataset: {}", data.display()),
        "train: 60,000 rows in 3 file(s), 600 row groups, ".to_string(),
        "  train-00000-of-00003.parquet: 20,000 rows, 200 row groups (largest 100 rows), ".to_string(),
        "test: 10,000 rows in 1 file(s), 100 row groups, ".to_string(),
        "  image: struct<bytes: binary, path: string>\n  label: int64\n".to_string(),
    ] {
        assert!(said.contains(&expected), "{expected:?} not in:\n{said}");
    }
}

/// The README's pandas recipe, run as written (its code block, after the lines that give it
/// `images` and `labels`: Fashion-MNIST's first rows), makes a dataset trainerd trains on.
#[test]
fn the_readmes_pandas_recipe_makes_a_dataset_that_trains() {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md")).unwrap();
    let start = readme.find("```python\n# pandas:").expect("the README's pandas recipe") + "```python\n".len();
    let recipe = &readme[start..start + readme[start..].find("```").unwrap()];
    let tmp = tempfile::tempdir().unwrap();
    let prelude = r#"
import gzip, os, sys
import numpy as np
os.chdir(sys.argv[2])
def idx(name, offset):
    return np.frombuffer(gzip.open(os.path.join(sys.argv[1], name)).read(), np.uint8, offset=offset)
split = {"train": ("train", 3000), "test": ("t10k", 600)}
for name, (prefix, n) in split.items():
    images = idx(f"{prefix}-images-idx3-ubyte.gz", 16).reshape(-1, 28, 28)[:n]
    labels = idx(f"{prefix}-labels-idx1-ubyte.gz", 8).astype(np.int64)[:n]
    file = f"fm/{name}-00000-of-00001.parquet"
"#;
    let indented: String = recipe.lines().map(|l| format!("    {l}\n")).collect();
    let script = format!("{prelude}{indented}");
    let made = Command::new("python3").args(["-c", &script]).arg(dataset()).arg(tmp.path()).output().unwrap();
    assert!(made.status.success(), "{}", text(&made));
    let data = tmp.path().join("fm");
    let said = stdout(&ok(trainerd_cmd().args(["data", "inspect"]).arg(&data).output().unwrap()));
    assert!(said.contains("train: 3,000 rows in 1 file(s), 30 row groups, "), "{said}");
    assert!(said.contains("  image: struct<bytes: binary, path: string>\n  label: int64\n"), "{said}");
    let summary = tmp.path().join("s.json");
    ok(train(None, on("mnist-cnn", &data).epochs(1).summary(&summary)));
    let s = json(&summary);
    assert_eq!(s["steps"], 3000 / 64);
    assert!(s["test_accuracy"].as_f64().unwrap() > 0.5, "{s}");
}

/// A dataset without a test split: refused, naming the way out; trained without evaluation when
/// asked; evaluated on its validation split when it has one.
#[test]
fn a_dataset_without_a_test_split_trains_without_evaluation_only_when_asked() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("fm");
    copy_tree(&parquet_dataset(), &data);
    let test = data.join("test-00000-of-00001.parquet");
    let away = tmp.path().join("test.parquet");
    std::fs::rename(&test, &away).unwrap();
    let short = |data: &Path| on("linear", data).epochs(1).steps(20);
    let out = train(None, short(&data));
    assert_eq!(
        error_of(&out),
        format!(
            "error: data location {}: no test or validation split (test-00000-of-0000N.parquet or validation-…): every \
             epoch ends with an evaluation on it; give --no-evaluation to train without one",
            data.display()
        )
    );
    let summary = tmp.path().join("s.json");
    let out = ok(train(None, short(&data).on("--no-evaluation").summary(&summary)));
    let said = stdout(&out);
    assert!(said.contains("; no evaluation (--no-evaluation); fingerprint "), "{said}");
    let last = said.lines().find(|l| l.starts_with("20/20 - ")).unwrap_or_else(|| panic!("{said}"));
    assert!(last.contains(" - accuracy: ") && !last.contains("val_"), "{last}");
    assert!(said.contains("done: 20 steps, not evaluated (--no-evaluation), "), "{said}");
    let s = json(&summary);
    assert!(s["test_loss"].is_null() && s["test_accuracy"].is_null(), "{s}");

    // The validation split serves where there is no test split.
    std::fs::rename(&away, data.join("validation-00000-of-00001.parquet")).unwrap();
    let out = ok(train(None, short(&data).summary(&summary)));
    assert!(
        stdout(&out).contains("; 1 validation file(s), 10,000 rows, evaluated as the test split; "),
        "{}",
        stdout(&out)
    );
    let reference = tmp.path().join("r.json");
    ok(train(None, short(&parquet_dataset()).summary(&reference)));
    assert_eq!(json(&summary)["test_loss"], json(&reference)["test_loss"], "the same rows evaluated");
}
