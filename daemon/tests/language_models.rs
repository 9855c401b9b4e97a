//! What language-model recipes rely on, end to end: the learning rate every step logs is
//! Hugging Face's warmup and decay; a run started before those formulas resumes with the cosine
//! it started with; AdamW's decay groups are announced and recorded in every commit.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use trainerd_testkit::output::{json, metrics_log, stdout, text};
use trainerd_testkit::RunArgs;

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

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}
