//! What language-model recipes rely on, end to end: the learning rate every step logs is
//! Hugging Face's warmup and decay; a run started before those formulas resumes with the cosine
//! it started with; AdamW's decay groups are announced and recorded in every commit; raw text,
//! tokenized and packed, resumes bitwise, and 2 workers are 1 accumulating 2.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use sha2::{Digest, Sha256};
use trainerd_testkit::output::{error_line, json, metrics_log, params_sha256, stdout, text};
use trainerd_testkit::{copy_tree, python, python_examples, Event, RunArgs, Worker};

/// Steps of each of the 2 epochs of every run here.
const STEPS: u64 = 30;
const LR: f64 = 0.1;

/// The linear model for 2 epochs of 30 steps, cosine decay from 0.1, a commit every 10 steps
/// (every one kept) in `ckpt`, the metrics log in `log`.
fn cosine_run(ckpt: &Path, log: &Path) -> RunArgs {
    RunArgs::new("linear")
        .epochs(2)
        .steps(STEPS)
        .checkpoints(ckpt, 10)
        .set("--keep-checkpoints", 0)
        .seed(5)
        .threads(1)
        .optimizer("sgd", LR)
        .set("--lr-schedule", "cosine")
        .set("--metrics-log", log.to_str().unwrap())
}

/// Each logged step's (global step, learning rate).
fn rates(log: &Path) -> Vec<(u64, f64)> {
    metrics_log(log).iter().map(|l| (l["global_step"].as_u64().unwrap(), l["lr"].as_f64().unwrap())).collect()
}

/// The commit records of a local checkpoint directory, by global step.
fn records(dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(dir.join("commits"))
        .unwrap()
        .flatten()
        .map(|e| (json(&e.path())["global_step"].as_u64().unwrap(), e.path()))
        .collect();
    out.sort();
    out
}

/// Makes the newest commit of `dir` at `step` (dropping the records of later ones) one that
/// trainerd wrote before Hugging Face's formulas: its run configuration without the schedule's
/// version key and its position without the formulas, the record's manifest digest made anew.
fn as_before_the_formulas(dir: &Path, step: u64) {
    for (at, record) in records(dir) {
        if at > step {
            std::fs::remove_file(record).unwrap();
        } else if at == step {
            let mut r = json(&record);
            let manifest_path = dir.join(r["manifest"].as_str().unwrap());
            let mut manifest = json(&manifest_path);
            let meta = manifest["meta"].as_object_mut().unwrap();
            assert_eq!(meta["run_config"]["schedule_version"], 2, "{meta:?}");
            assert_eq!(meta["position"]["schedules"], 2, "{meta:?}");
            meta.get_mut("run_config").unwrap().as_object_mut().unwrap().remove("schedule_version");
            meta.get_mut("position").unwrap().as_object_mut().unwrap().remove("schedules");
            let bytes = serde_json::to_vec_pretty(&manifest).unwrap();
            std::fs::write(&manifest_path, &bytes).unwrap();
            r["manifest_sha256"] = hex(&Sha256::digest(&bytes)).into();
            r["manifest_size"] = bytes.len().into();
            std::fs::write(&record, serde_json::to_vec_pretty(&r).unwrap()).unwrap();
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Hugging Face's `get_cosine_schedule_with_warmup(o, 0, 60)` at step `s` (from 0).
fn hf_cosine(s: u64) -> f64 {
    LR * (0.5 * (1.0 + (std::f64::consts::PI * 0.5 * 2.0 * (s as f64 / 60.0)).cos())).max(0.0)
}

/// trainerd's cosine before Hugging Face's: its floor at the run's last step.
fn old_cosine(s: u64) -> f64 {
    LR * 0.5 * (1.0 + (std::f64::consts::PI * (s as f64 / 59.0)).cos())
}

/// A run logs Hugging Face's cosine at every step; the same run resumed from a commit that an
/// older trainerd wrote continues with the cosine it started with, and resumed from its own
/// commit with Hugging Face's.
#[test]
fn a_run_started_before_hugging_faces_formulas_resumes_with_its_own_cosine() {
    let tmp = tempfile::tempdir().unwrap();
    let (ckpt, log) = (tmp.path().join("ckpt"), tmp.path().join("fresh.jsonl"));
    let out = cosine_run(&ckpt, &log).command("run").output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let fresh = rates(&log);
    assert_eq!(fresh.len(), 60);
    // The log's global step counts the steps done: the rate of step s (from 0) is on line s.
    for (i, &(global_step, lr)) in fresh.iter().enumerate() {
        assert_eq!(global_step, i as u64 + 1);
        assert!(lr == hf_cosine(i as u64), "step {i}: {lr}, Hugging Face's {}", hf_cosine(i as u64));
    }

    for (old, expected) in [(true, old_cosine as fn(u64) -> f64), (false, hf_cosine)] {
        let copy = tmp.path().join(format!("copy-{old}"));
        copy_tree(&ckpt, &copy);
        if old {
            as_before_the_formulas(&copy, 40);
        } else {
            records(&copy).into_iter().filter(|(at, _)| *at > 40).for_each(|(_, r)| std::fs::remove_file(r).unwrap());
        }
        let log = tmp.path().join(format!("resumed-{old}.jsonl"));
        let out = cosine_run(&copy, &log).command("run").output().unwrap();
        assert!(out.status.success(), "{}", text(&out));
        assert!(stdout(&out).contains("resumed from checkpoint"), "{}", text(&out));
        let resumed = rates(&log);
        assert_eq!(resumed.first().map(|r| r.0), Some(41));
        for (global_step, lr) in resumed {
            let want = expected(global_step - 1);
            assert!(lr == want, "older commit {old}: step {}: {lr}, expected {want}", global_step - 1);
        }
    }
}

/// Warmup then a decay, AdamW with its groups: the start-up line says what each group holds, the
/// first step trains at a rate of 0 as Hugging Face's does, and every commit records the groups'
/// rule and the warmup.
#[test]
fn adamw_with_a_warmup_says_its_groups_and_records_them() {
    let tmp = tempfile::tempdir().unwrap();
    let (ckpt, log) = (tmp.path().join("ckpt"), tmp.path().join("m.jsonl"));
    let out = RunArgs::new("mnist-cnn")
        .epochs(1)
        .steps(12)
        .checkpoints(&ckpt, 6)
        .threads(1)
        .optimizer("adamw", 1e-3)
        .set("--weight-decay", 0.1)
        .set("--warmup-steps", 4)
        .set("--lr-schedule", "linear")
        .set("--metrics-log", log.to_str().unwrap())
        .command("run")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let said = stdout(&out);
    assert!(
        said.contains(
            "trainerd: AdamW: weight decay 0.1 on 3 tensor(s), 347040 parameter(s); none on 3 tensor(s), 106 \
             parameter(s) (those of fewer than 2 dimensions: biases and norm weights)"
        ),
        "{said}"
    );
    let lrs: Vec<f64> = rates(&log).into_iter().map(|(_, lr)| lr).collect();
    // get_linear_schedule_with_warmup(o, 4, 12)
    let hf: Vec<f64> =
        (0..12u64).map(|s| if s < 4 { 1e-3 * (s as f64 / 4.0) } else { 1e-3 * ((12 - s) as f64 / 8.0) }).collect();
    assert_eq!(lrs, hf);
    let (_, last) = records(&ckpt).pop().unwrap();
    let manifest = json(&ckpt.join(json(&last)["manifest"].as_str().unwrap()));
    let config = &manifest["meta"]["run_config"];
    assert_eq!(config["optimizer"]["name"], "adamw");
    assert_eq!(config["optimizer"]["no_decay"], "under_two_dims");
    assert_eq!(config["warmup"], serde_json::json!({"steps": 4}));
}

// ---- raw text, tokenized and packed ----

const WAIT: Duration = Duration::from_secs(240);

/// The licenses corpus as raw text (tokenize.py --raw: one document per license, a 512-id BPE's
/// tokenizer.json beside them), made once; and another tokenizer (of 400 ids) beside a copy.
fn raw_text() -> &'static (PathBuf, PathBuf) {
    static DIRS: OnceLock<(tempfile::TempDir, (PathBuf, PathBuf))> = OnceLock::new();
    &DIRS
        .get_or_init(|| {
            let tmp = tempfile::tempdir().unwrap();
            let (raw, other) = (tmp.path().join("text"), tmp.path().join("other"));
            for (dir, vocab) in [(&raw, "512"), (&other, "400")] {
                let out = Command::new(python())
                    .arg(python_examples().join("tokenize.py"))
                    .args(["--raw", "--out", dir.to_str().unwrap(), "--vocab", vocab, "--rows-per-group", "4"])
                    .output()
                    .unwrap();
                assert!(out.status.success(), "{}", text(&out));
            }
            (tmp, (raw, other))
        })
        .1
}

/// The small GPT on the raw licenses, packed into blocks of 32, with dropout (drawn per step and
/// slot), AdamW, a warmup and a cosine; its outputs and token files in `dir`.
fn gpt_on_text(dir: &Path) -> RunArgs {
    module_on_text(dir, &python_examples().join("gpt.py"))
}

/// [`gpt_on_text`] of the model file `module`.
fn module_on_text(dir: &Path, module: &Path) -> RunArgs {
    RunArgs::new("python-model")
        .data(&raw_text().0)
        .plugin_arg(format!("module={}", module.display()))
        .plugin_arg("input=text")
        .plugin_arg("context=32")
        .plugin_arg("d_model=32")
        .plugin_arg("n_layer=1")
        .plugin_arg("dropout=0.1")
        .epochs(2)
        .steps(40)
        .batch(4)
        .seed(3)
        .threads(1)
        .optimizer("adamw", 3e-3)
        .set("--warmup-steps", 8)
        .set("--lr-schedule", "cosine")
        .set("--data-cache", dir.join("cache").to_str().unwrap())
        .summary(dir.join("s.json"))
}

fn launch(extra: &[&str], args: &RunArgs) -> Worker {
    Worker::start(&[&["local", "--restart-delay", "0"][..], extra, &args.strs()].concat())
}

/// On packed text, a worker SIGKILLed mid-epoch rejoins from its peer, then the whole cluster is
/// stopped and resumes from its commit: the end is bitwise the uninterrupted run's; the examples
/// log names each step's blocks, and the global batch of 2 workers is the one of 1 worker
/// accumulating 2 micro-batches, bit for bit.
#[test]
fn packed_text_resumes_bitwise_and_two_workers_are_one_accumulating_two() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str| {
        let dir = tmp.path().join(name);
        std::fs::create_dir(&dir).unwrap();
        (dir.clone(), gpt_on_text(&dir).checkpoints(dir.join("ckpt"), 30))
    };
    let (reference, args) = run("reference");
    let args = args.set("--log-examples", reference.join("ex.jsonl").to_str().unwrap());
    let out = args.local(2).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let said = stdout(&out);
    assert!(said.contains("trainerd: train split: 13 document(s) (0 empty, skipped), "), "{said}");
    assert!(said.contains("packed into blocks of 32 tokens"), "{said}");
    let expected = params_sha256(&reference.join("s.worker0.json"));
    assert_eq!(params_sha256(&reference.join("s.worker1.json")), expected);
    // Each step's blocks, by their own ids: 4 of them from each worker, none twice in an epoch.
    let log = std::fs::read_to_string(reference.join("ex.worker0.jsonl")).unwrap();
    let steps: Vec<serde_json::Value> = log.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(steps.len(), 80);
    let first: Vec<u64> = steps[..40]
        .iter()
        .flat_map(|s| {
            s["ids"].as_array().unwrap().iter().map(|id| {
                assert_eq!(id[0], "block");
                id[1].as_u64().unwrap()
            })
        })
        .collect();
    let distinct: std::collections::BTreeSet<u64> = first.iter().copied().collect();
    assert_eq!((first.len(), distinct.len()), (160, 160));

    let (killed, args) = run("killed");
    let mut cluster = launch(&["--workers", "2"], &args);
    let pid = cluster.wait_event(|r| r.worker == Some(1), WAIT).pid;
    cluster.wait_event(|r| r.worker == Some(0) && matches!(r.event, Event::Step { global_step: 25, .. }), WAIT);
    // SAFETY: kill(2) on the launcher's worker 1, a process this test started through it.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) }, 0);
    let rejoined = |r: &trainerd_testkit::events::Record| r.worker == Some(1) && r.pid != pid;
    cluster.wait_event(|r| rejoined(r) && matches!(r.event, Event::Step { .. }), WAIT);
    let late = |r: &trainerd_testkit::events::Record| {
        r.worker == Some(0) && matches!(r.event, Event::Committed { global_step, .. } if global_step >= 60)
    };
    cluster.wait_event(late, WAIT);
    cluster.kill(libc::SIGTERM);
    let mut again = launch(&["--workers", "2"], &args);
    again.wait_event(|r| r.worker == Some(0) && matches!(r.event, Event::Resumed { .. }), WAIT);
    assert!(again.wait().success());
    assert_eq!(params_sha256(&killed.join("s.worker0.json")), expected);
    assert_eq!(params_sha256(&killed.join("s.worker1.json")), expected);

    let alone = tmp.path().join("alone");
    std::fs::create_dir(&alone).unwrap();
    let out = gpt_on_text(&alone).set("--accumulate", 2).command("run").output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(params_sha256(&alone.join("s.json")), expected, "1 worker accumulating 2 differs from 2 workers");
}

/// Workers whose tokenizers differ are refused, naming both hashes; a tokenizer with more ids than
/// the model's embedding is refused at start, naming both sizes.
#[test]
fn another_tokenizer_is_refused_naming_both_hashes_and_a_larger_one_both_sizes() {
    let tmp = tempfile::tempdir().unwrap();
    let (raw, other) = raw_text();
    let sha = |dir: &Path| hex(&Sha256::digest(std::fs::read(dir.join("tokenizer.json")).unwrap()));
    let spawn = |ports: &[u16], i: usize, extra: &[&str]| {
        let run = gpt_on_text(tmp.path()).steps(2).epochs(1).on("--no-evaluation").set("--rendezvous-timeout", 20);
        let run = extra.chunks(2).fold(run, |run, kv| run.set(kv[0], kv[1]));
        run.command("run")
            .env("TF_CONFIG", trainerd_testkit::tf_config(ports, i))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let ports = trainerd_testkit::free_ports(2);
    let theirs = other.join("tokenizer.json");
    let (chief, worker) = (spawn(&ports, 0, &[]), spawn(&ports, 1, &["--tokenizer", theirs.to_str().unwrap()]));
    let worker = worker.wait_with_output().unwrap();
    let _ = chief.wait_with_output().unwrap();
    let w1 = format!("worker 1 (127.0.0.1:{})", ports[1]);
    let line = error_line(&worker);
    assert!(
        line.starts_with(&format!(
            "error: rendezvous refused by the chief: {w1} has a different run configuration: \
             data.text.tokenizer_sha256 = \"{}\" on {w1}, \"{}\" on the chief",
            sha(other),
            sha(raw)
        )),
        "{line}"
    );

    let out = gpt_on_text(tmp.path()).plugin_arg("vocab=300").command("run").output().unwrap();
    assert!(!out.status.success());
    assert_eq!(
        error_line(&out),
        format!(
            "error: tokenizer {}/tokenizer.json has 512 ids, more than the 300 rows of the token embedding of plugin \
             python-model's model: its ids past 300 would index outside it (give the model a vocabulary of at least \
             512, or use its own tokenizer)",
            raw.display()
        )
    );
}

/// A Python model names its undecayed parameters (`no_decay`, matched against its
/// `named_parameters()` names); a name list of another form is refused naming the file.
#[test]
fn a_python_model_names_its_undecayed_parameters() {
    let tmp = tempfile::tempdir().unwrap();
    let source = std::fs::read_to_string(python_examples().join("gpt.py")).unwrap();
    let file = |name: &str, line: &str| {
        let path = tmp.path().join(name);
        std::fs::write(&path, format!("{source}\n{line}\n")).unwrap();
        path
    };
    let run = |module: &Path| {
        module_on_text(tmp.path(), module).steps(2).epochs(1).on("--no-evaluation").command("run").output().unwrap()
    };
    let named = run(&file("named.py", "no_decay = [\"ln\", \"bias\"]"));
    assert!(named.status.success(), "{}", text(&named));
    // The LayerNorms' weights and biases and the Linear layers' biases: the tied embedding and
    // the position table decay, as the weights do.
    assert!(
        stdout(&named).contains(
            "trainerd: AdamW: weight decay 0.01 on 6 tensor(s), 29696 parameter(s); none on 10 tensor(s), 480 \
             parameter(s) (those whose names contain \"ln\" or \"bias\")"
        ),
        "{}",
        stdout(&named)
    );
    let bad = file("bad.py", "no_decay = \"bias\"");
    let out = run(&bad);
    assert!(!out.status.success());
    assert_eq!(
        error_line(&out),
        format!(
            "error: plugin {}: model file {}: no_decay is 'bias', expected a list of name parts such as [\"bias\", \
             \"norm\"] (AdamW leaves undecayed each parameter whose name contains one)",
            trainerd_testkit::plugin("python-model").display(),
            bad.display()
        )
    );
}

/// `trainerd data inspect` shows a raw-text dataset's tokenizer, documents, tokens and blocks.
#[test]
fn data_inspect_shows_the_tokenizer_documents_tokens_and_blocks() {
    let tmp = tempfile::tempdir().unwrap();
    let (raw, _) = raw_text();
    let out = trainerd_testkit::trainerd_cmd()
        .args(["data", "inspect", raw.to_str().unwrap(), "--length", "128,1024"])
        .env("TRAINERD_DATA_CACHE", tmp.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let said = stdout(&out);
    assert!(said.contains("text: column `text`, tokenizer "), "{said}");
    assert!(said.contains("512 ids; \"<|endoftext|>\" = 1 ends each document)"), "{said}");
    assert!(
        said.contains(
            "  train: 13 documents (0 empty, skipped), 94,253 tokens (end-of-text tokens included); blocks: 736 of 128, \
             92 of 1024"
        ),
        "{said}"
    );
}

/// Raw text and its tokenizer on S3: the tokenizer found beside the Parquet files, the documents
/// tokenized and packed as from a directory (the same blocks: the same parameters).
#[test]
fn raw_text_on_s3_trains_as_from_a_directory() {
    use object_store::ObjectStoreExt;

    let server = trainerd_testkit::s3::S3Server::start().unwrap_or_else(|e| panic!("S3-compatible test server: {e}"));
    let store = server.store().unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (raw, _) = raw_text();
    for entry in std::fs::read_dir(raw).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        let bytes = std::fs::read(&path).unwrap();
        let to = object_store::path::Path::from(format!("text/{name}"));
        runtime.block_on(store.put(&to, bytes.into())).unwrap();
    }
    let url = format!("s3://{}/text", server.bucket);
    let tmp = tempfile::tempdir().unwrap();
    let run = |data: &str, dir: &Path| {
        std::fs::create_dir_all(dir).unwrap();
        let args = gpt_on_text(dir).data(data).steps(6).epochs(1);
        args.command("run").envs(server.env()).output().unwrap()
    };
    let remote = run(&url, &tmp.path().join("s3"));
    assert!(remote.status.success(), "{}", text(&remote));
    assert!(stdout(&remote).contains(&format!("tokenized by {url}/tokenizer.json (sha256 ")), "{}", stdout(&remote));
    let local = run(raw.to_str().unwrap(), &tmp.path().join("local"));
    assert!(local.status.success(), "{}", text(&local));
    assert_eq!(params_sha256(&tmp.path().join("s3/s.json")), params_sha256(&tmp.path().join("local/s.json")));
}
