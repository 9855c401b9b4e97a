//! Checkpoints through the `trainerd` binary: export read by Python's safetensors, verify and
//! fallback on damage, refusal of a checkpoint that does not fit the run, and S3.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use trainerd_testkit::output::{json, stdout, text};
use trainerd_testkit::{copy_tree, python, trainerd_cmd, RunArgs};

use trainerd_testkit::s3::S3Server;

/// A short checkpointed run of `plugin` into `ckpt` (one epoch unless `extra` says), returning
/// its summary's params_sha256.
fn train(plugin_name: &str, ckpt: &str, summary: &Path, extra: &[&str], env: &[(&str, String)]) -> (Output, String) {
    let run = RunArgs::new(plugin_name).threads(1).steps(120).checkpoints(ckpt, 40);
    let run = if extra.contains(&"--epochs") { run } else { run.epochs(1) };
    let mut cmd = run.summary(summary).extend(extra).command("run");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let sha = if out.status.success() {
        let s: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(summary).unwrap()).unwrap();
        s["params_sha256"].as_str().unwrap().to_string()
    } else {
        String::new()
    };
    (out, sha)
}

/// Python's safetensors package opens an exported checkpoint and finds the trained tensors:
/// their names, shapes, and bytes (sha256 over every tensor in name order = params_sha256).
#[test]
fn python_safetensors_reads_an_exported_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let (out, sha) = train("mnist-cnn", ckpt.to_str().unwrap(), &tmp.path().join("s.json"), &[], &[]);
    assert!(out.status.success(), "{}", text(&out));
    let exported = tmp.path().join("model.safetensors");
    let out = trainerd_cmd().args(["ckpt", "export"]).arg(&ckpt).arg("--output").arg(&exported).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("exported commit "), "{}", text(&out));
    let script = r#"
import hashlib, sys
from safetensors.numpy import load_file
t = load_file(sys.argv[1])
h = hashlib.sha256()
for name in sorted(t):
    h.update(t[name].tobytes())
    print(name, t[name].dtype, list(t[name].shape))
print(h.hexdigest())
"#;
    let out = Command::new(python()).arg("-c").arg(script).arg(&exported).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let lines: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(String::from).collect();
    assert_eq!(
        lines[..6],
        [
            "model.conv.bias float32 [32]",
            "model.conv.weight float32 [32, 1, 3, 3]",
            "model.dense.bias float32 [64]",
            "model.dense.weight float32 [64, 5408]",
            "model.logits.bias float32 [10]",
            "model.logits.weight float32 [10, 64]",
        ]
    );
    assert_eq!(lines[6], sha, "the exported tensors are the trained parameters");
}

fn newest_model_blob(ckpt: &Path) -> PathBuf {
    let mut commits: Vec<PathBuf> =
        std::fs::read_dir(ckpt.join("commits")).unwrap().map(|e| e.unwrap().path()).collect();
    commits.sort();
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(commits.last().unwrap()).unwrap()).unwrap();
    let manifest = record["manifest"].as_str().unwrap();
    ckpt.join(manifest).with_file_name("model.safetensors")
}

#[test]
fn a_damaged_commit_fails_verify_and_the_daemon_resumes_from_the_previous_one() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let (out, _) = train("linear", ckpt.to_str().unwrap(), &tmp.path().join("a.json"), &[], &[]);
    assert!(out.status.success(), "{}", text(&out));
    let out = trainerd_cmd().args(["ckpt", "verify"]).arg(&ckpt).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));

    let blob = newest_model_blob(&ckpt);
    let mut bytes = std::fs::read(&blob).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x80;
    std::fs::write(&blob, bytes).unwrap();

    let out = trainerd_cmd().args(["ckpt", "verify"]).arg(&ckpt).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let relative = blob.strip_prefix(&ckpt).unwrap().display().to_string();
    assert!(
        stdout.contains(&format!("DAMAGED {}: commit 3: blob model.safetensors ({relative}): sha256 ", ckpt.display())),
        "{stdout}"
    );
    assert!(stdout.contains("commit 2: ok"), "{stdout}");

    // A restart skips the damaged newest commit, says so, and resumes from commit 2.
    let (out, _) = train("linear", ckpt.to_str().unwrap(), &tmp.path().join("b.json"), &[], &[]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("warning: skipped a damaged checkpoint: "), "{stdout}");
    assert!(stdout.contains("trainerd: resumed from checkpoint 2 in "), "{stdout}");

    // A commit record that cannot be read: verify names it and fails, list shows it damaged.
    let oldest = std::fs::read_dir(ckpt.join("commits")).unwrap().map(|e| e.unwrap().path()).min().unwrap();
    let seq: u64 = oldest.file_stem().unwrap().to_str().unwrap().parse().unwrap();
    std::fs::write(&oldest, "{damaged").unwrap();
    let out = trainerd_cmd().args(["ckpt", "verify"]).arg(&ckpt).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let name = oldest.file_name().unwrap().to_str().unwrap();
    let damaged = format!("{}: commit {seq}: commit record commits/{name} is not valid: ", ckpt.display());
    assert!(stdout.contains(&format!("DAMAGED {damaged}")), "{stdout}");
    let out = trainerd_cmd().args(["ckpt", "list"]).arg(&ckpt).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains(&format!("{seq:>8}  DAMAGED: {damaged}")), "{stdout}");
}

#[test]
fn a_checkpoint_of_another_run_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let (out, _) = train("linear", ckpt.to_str().unwrap(), &tmp.path().join("a.json"), &[], &[]);
    assert!(out.status.success(), "{}", text(&out));
    let (out, _) = train("linear", ckpt.to_str().unwrap(), &tmp.path().join("b.json"), &["--batch-size", "32"], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "error: checkpoint: {}: checkpoint 3 was written with another run configuration: ",
            ckpt.display()
        )),
        "{err}"
    );
    let (out, _) = train("mnist-cnn", ckpt.to_str().unwrap(), &tmp.path().join("c.json"), &[], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("checkpoint 3 was written by plugin linear 0.1.0, this run uses mnist-cnn 0.1.0"),
        "{}",
        text(&out)
    );
}

/// Training commits to a real S3-compatible server and resumes from it; `ckpt` reads it.
#[test]
fn checkpoints_on_s3() {
    let server = S3Server::start().unwrap_or_else(|e| panic!("S3-compatible test server: {e}"));
    let env = server.env();
    let tmp = tempfile::tempdir().unwrap();
    let url = format!("s3://{}/runs/linear", server.bucket);
    let (out, first) = train("linear", &url, &tmp.path().join("a.json"), &["--epochs", "2"], &env);
    assert!(out.status.success(), "{}", text(&out));
    let out = trainerd_cmd().args(["ckpt", "list", &url]).envs(env.iter().map(|(k, v)| (k, v))).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let listing = String::from_utf8_lossy(&out.stdout);
    assert_eq!(listing.lines().count(), 4, "a header and the 3 newest commits:\n{listing}");
    assert!(listing.lines().last().unwrap().trim_start().starts_with("6 "), "{listing}");
    let out = trainerd_cmd().args(["ckpt", "verify", &url]).envs(env.iter().map(|(k, v)| (k, v))).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let (out, again) = train("linear", &url, &tmp.path().join("b.json"), &["--epochs", "2"], &env);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("trainerd: checkpoint 6 in {url} is the end of this run (global step 240)")),
        "{stdout}"
    );
    assert_eq!(first, again);
}

/// A child's stdout and stderr lines as they come, and those seen so far.
struct Transcript {
    lines: std::sync::mpsc::Receiver<String>,
    seen: Vec<String>,
    deadline: std::time::Instant,
}

impl Transcript {
    /// `cmd` started against `server` through `link` (the connection a test cuts), and its output.
    fn through(
        cmd: &mut Command,
        (server, link): (&S3Server, &trainerd_testkit::proxy::TcpProxy),
        within: std::time::Duration,
    ) -> (std::process::Child, Transcript) {
        let mut child = cmd
            .envs(server.env().iter().map(|(k, v)| (k, v)))
            .env("AWS_ENDPOINT_URL", link.endpoint())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let transcript = Transcript::of(&mut child, within);
        (child, transcript)
    }

    /// `child`'s output, read until `within` from now at the latest.
    fn of(child: &mut std::process::Child, within: std::time::Duration) -> Transcript {
        use std::io::BufRead;
        let (tx, lines) = std::sync::mpsc::channel();
        for stream in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(stream).lines().map_while(Result::ok) {
                    let _ = tx.send(line);
                }
            });
        }
        Transcript { lines, seen: Vec::new(), deadline: std::time::Instant::now() + within }
    }

    fn left(&self) -> std::time::Duration {
        self.deadline.saturating_duration_since(std::time::Instant::now())
    }

    /// Reads up to the first line that starts with `prefix`.
    fn until(&mut self, prefix: &str) {
        loop {
            let line =
                self.lines.recv_timeout(self.left()).unwrap_or_else(|_| panic!("no more output:\n{}", self.text()));
            self.seen.push(line);
            if self.seen.last().unwrap().starts_with(prefix) {
                return;
            }
        }
    }

    /// Reads every line left.
    fn rest(&mut self) {
        while let Ok(line) = self.lines.recv_timeout(self.left()) {
            self.seen.push(line);
        }
    }

    fn text(&self) -> String {
        self.seen.join("\n")
    }
}

/// The S3-compatible server becomes unreachable for longer than a commit interval in the middle
/// of a run (every connection to it cut, new ones closed at once), then comes back: training
/// never stops (failed or skipped commits are warnings), commits resume, the run exits 0, its
/// final commit verifies, and the model resumed from it is bitwise the uninterrupted run's.
#[test]
fn a_storage_outage_in_the_middle_of_a_run_loses_nothing() {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};
    let tmp = tempfile::tempdir().unwrap();
    let args = |ckpt: &str, summary: &Path| {
        RunArgs::new("linear").threads(1).seed(5).epochs(40).checkpoints(ckpt, 200).summary(summary).command("run")
    };
    let reference = args(tmp.path().join("local").to_str().unwrap(), &tmp.path().join("ref.json")).output().unwrap();
    assert!(reference.status.success(), "{}", text(&reference));
    let expected = json(&tmp.path().join("ref.json"))["params_sha256"].as_str().unwrap().to_string();

    let server = S3Server::start().unwrap_or_else(|e| panic!("S3-compatible test server: {e}"));
    let env = server.env();
    // The run reaches the server through a link the test cuts: the server itself stays up, so
    // it answers at once when the link comes back, however slowly a restart would go.
    let link = server.link().unwrap();
    let url = format!("s3://{}/outage", server.bucket);
    let log = tmp.path().join("steps.jsonl");
    let mut cmd = args(&url, &tmp.path().join("a.json"));
    let (mut child, mut t) =
        Transcript::through(cmd.arg("--metrics-log").arg(&log), (&server, &link), Duration::from_secs(120));
    t.until("checkpoint 1 committed");
    let now = || SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64();
    link.cut();
    let down = now();
    std::thread::sleep(Duration::from_secs(3));
    link.restore();
    let up = now();
    t.rest();
    let status = child.wait().unwrap();
    let seen = &t.seen;
    let transcript = format!("{}\n--- the S3 server's log ---\n{}", t.text(), server.log_tail(40));
    assert!(status.success(), "{status}\n{transcript}");
    // Training went on while the server was away, and said what happened to the commits.
    let steps_while_down = trainerd_testkit::output::metrics_log(&log)
        .iter()
        .map(|l| l["time"].as_f64().unwrap())
        .filter(|t| *t > down + 1.0 && *t < up)
        .count();
    assert!(steps_while_down > 100, "{steps_while_down} steps while storage was down\n{transcript}");
    assert!(transcript.contains("is still retrying"), "{transcript}");
    // Commits resumed before the end of training (the last epoch's line comes after them).
    let after: Vec<&str> =
        seen.iter().skip_while(|l| !l.starts_with("checkpoint 1 committed")).skip(1).map(String::as_str).collect();
    let resumed_at = after.iter().position(|l| l.starts_with("checkpoint ") && l.contains(" committed to "));
    let last_epoch = after.iter().position(|l| l.starts_with("Epoch 40/40"));
    assert!(resumed_at.is_some() && resumed_at < last_epoch, "{transcript}");
    assert_eq!(json(&tmp.path().join("a.json"))["params_sha256"].as_str().unwrap(), expected, "{transcript}");
    let out = trainerd_cmd().args(["ckpt", "verify", &url]).envs(env.iter().map(|(k, v)| (k, v))).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    // The model resumed from the final commit is the uninterrupted run's.
    let resumed = args(&url, &tmp.path().join("b.json")).envs(env.iter().map(|(k, v)| (k, v))).output().unwrap();
    assert!(resumed.status.success(), "{}", text(&resumed));
    assert!(String::from_utf8_lossy(&resumed.stdout).contains(" is the end of this run "), "{}", text(&resumed));
    assert_eq!(
        json(&tmp.path().join("b.json"))["params_sha256"].as_str().unwrap(),
        expected,
        "{}\n{transcript}",
        text(&resumed)
    );
}

/// A checkpoint committed by trainerd before its running totals were typed and its position moved
/// (commit 592db11: `daemon/tests/fixtures/checkpoint-592db11`, the linear model at global step
/// 40, mid-epoch 2, with every total set) resumes, and ends bit for bit as the uninterrupted run,
/// its summary's figures included.
#[test]
fn a_checkpoint_committed_by_an_older_trainerd_resumes_bitwise() {
    let tmp = tempfile::tempdir().unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/checkpoint-592db11");
    let ckpt = tmp.path().join("old");
    copy_tree(&fixture, &ckpt);
    let run = |ckpt: &Path, summary: &Path| {
        let out = RunArgs::new("linear")
            .epochs(2)
            .steps(30)
            .checkpoints(ckpt, 10)
            .set("--keep-checkpoints", 0)
            .seed(5)
            .threads(1)
            .optimizer("adam", 0.001)
            .summary(summary)
            .command("run")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out));
        (stdout(&out), json(summary))
    };
    let (said, resumed) = run(&ckpt, &tmp.path().join("resumed.json"));
    assert!(
        said.contains(&format!(
            "trainerd: resumed from checkpoint 4 in {} at epoch 2, step 10 (global step 40)",
            ckpt.display()
        )),
        "{said}"
    );
    let fresh = tmp.path().join("fresh");
    let (_, uninterrupted) = run(&fresh, &tmp.path().join("fresh.json"));
    // The fixture was committed on another machine. An uninterrupted run here reaches the
    // fixture's step 40 bit for bit only where this CPU's kernels round as that one's did
    // (libtorch picks AVX-512 or AVX2 code by CPU); elsewhere the last bits differ from the
    // start, and the resumed run can only be close to the uninterrupted one.
    let model_at_40 = |dir: &Path| -> Option<String> {
        let data = std::fs::read_dir(dir.join("data")).unwrap();
        data.flatten().find_map(|d| {
            let manifest = json(&d.path().join("manifest.json"));
            let blob = manifest["blobs"].as_array()?.iter().find(|b| b["name"] == "model.safetensors")?;
            (manifest["global_step"] == 40).then(|| blob["sha256"].as_str().unwrap().to_string())
        })
    };
    let keys = ["params_sha256", "steps", "final_train_loss", "final_train_metrics", "test_loss", "test_metrics"];
    if model_at_40(&fixture) == model_at_40(&fresh) {
        for key in keys {
            assert_eq!(resumed[key], uninterrupted[key], "{key}");
        }
    } else {
        eprintln!("this CPU does not reproduce the fixture's step 40 bit for bit: comparing figures, not bits");
        assert_eq!(resumed["steps"], uninterrupted["steps"]);
        for key in ["final_train_loss", "test_loss"] {
            let (a, b) = (resumed[key].as_f64().unwrap(), uninterrupted[key].as_f64().unwrap());
            assert!((a - b).abs() <= 1e-4 * b.abs(), "{key}: {a} resumed, {b} uninterrupted");
        }
    }
}

/// `--keep-best`: every epoch-end commit carries its score, retention keeps the best one beside
/// the newest K, `ckpt list` names it, and `evaluate --best` evaluates it. `val_accuracy:min`
/// makes the first epoch (the least trained) the best, so that the best is the oldest commit.
#[test]
fn the_best_commit_survives_retention_and_is_evaluated_by_evaluate_best() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let extra = ["--epochs", "3", "--keep-checkpoints", "1", "--keep-best", "val_accuracy:min"];
    let (out, _) = train("linear", ckpt.to_str().unwrap(), &tmp.path().join("s.json"), &extra, &[]);
    assert!(out.status.success(), "{}", text(&out));
    let val_accuracy = |epoch: usize| {
        let printed = stdout(&out);
        let line = printed.lines().filter(|l| l.contains(" - val_accuracy: ")).nth(epoch - 1).unwrap().to_string();
        line.split(" - val_accuracy: ").nth(1).unwrap().split(' ').next().unwrap().parse::<f64>().unwrap()
    };
    assert!(val_accuracy(1) < val_accuracy(3), "the first epoch is the least trained");
    let listed = trainerd_cmd().args(["ckpt", "list"]).arg(&ckpt).output().unwrap();
    assert!(listed.status.success(), "{}", text(&listed));
    let listed = stdout(&listed);
    let rows: Vec<&str> = listed.lines().skip(1).collect();
    // 3 epochs of 120 steps, committed every 40 steps: epoch 1 ends at step 120.
    assert_eq!(rows.len(), 2, "the best and the newest:\n{listed}");
    let fields = |row: &str| row.split_whitespace().map(String::from).collect::<Vec<_>>();
    let (best, newest) = (fields(rows[0]), fields(rows[1]));
    assert_eq!((best[1].as_str(), best[2].as_str()), ("120", "1"), "{listed}");
    assert_eq!(&best[7..], ["val_accuracy", &format!("{:.4}", val_accuracy(1)), "best"], "{listed}");
    assert_eq!(newest[1], "360", "{listed}");
    assert_eq!(&newest[7..], ["val_accuracy", &format!("{:.4}", val_accuracy(3))], "{listed}");

    let evaluated = tmp.path().join("best.json");
    let out = RunArgs::new("linear")
        .on("--best")
        .threads(1)
        .set("--checkpoint", ckpt.to_str().unwrap())
        .summary(&evaluated)
        .command("evaluate")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let e = json(&evaluated);
    assert_eq!(e["sequence"].as_u64().unwrap().to_string(), best[0]);
    assert_eq!(e["global_step"], 120);
    assert_eq!(format!("{:.4}", e["test_accuracy"].as_f64().unwrap()), format!("{:.4}", val_accuracy(1)));
}

#[test]
fn keep_best_names_what_it_needs() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let (out, _) =
        train("linear", ckpt.to_str().unwrap(), &tmp.path().join("s.json"), &["--keep-best", "val_acc"], &[]);
    assert_eq!(
        trainerd_testkit::output::error_of(&out),
        "error: --keep-best val_acc: no figure named val_acc; this run has loss, accuracy, val_loss, val_accuracy"
    );
    // A run without scores has no best to evaluate.
    let (out, _) = train("linear", ckpt.to_str().unwrap(), &tmp.path().join("s.json"), &[], &[]);
    assert!(out.status.success(), "{}", text(&out));
    let out = RunArgs::new("linear")
        .on("--best")
        .set("--checkpoint", ckpt.to_str().unwrap())
        .command("evaluate")
        .output()
        .unwrap();
    assert_eq!(
        trainerd_testkit::output::error_of(&out),
        format!(
            "error: {}: no commit has a score to be best by (train with --keep-best METRIC to score each epoch's \
             commit)",
            ckpt.display()
        )
    );
}

/// The best epoch's commit is skipped while storage is out (the commit before it is stuck
/// retrying): the chief keeps that state in memory and commits it when storage returns, so the
/// best commit exists and survives retention; the run ends bitwise as without the outage.
/// `val_accuracy:min` makes the first epoch, whose end falls in the outage, the best.
#[test]
fn the_best_epoch_skipped_during_an_outage_is_committed_when_storage_returns() {
    use std::time::Duration;
    let tmp = tempfile::tempdir().unwrap();
    let args = |ckpt: &str, summary: &Path| {
        RunArgs::new("mnist-cnn")
            .threads(1)
            .seed(5)
            .epochs(4)
            .steps(150)
            .checkpoints(ckpt, 50)
            .set("--keep-checkpoints", 1)
            .set("--keep-best", "val_accuracy:min")
            .summary(summary)
            .command("run")
    };
    let reference = args(tmp.path().join("local").to_str().unwrap(), &tmp.path().join("ref.json")).output().unwrap();
    assert!(reference.status.success(), "{}", text(&reference));

    let server = S3Server::start().unwrap_or_else(|e| panic!("S3-compatible test server: {e}"));
    let env = server.env();
    let link = server.link().unwrap();
    let url = format!("s3://{}/best", server.bucket);
    let mut cmd = args(&url, &tmp.path().join("a.json"));
    let (mut child, mut t) = Transcript::through(&mut cmd, (&server, &link), Duration::from_secs(180));
    // Cut after the first commit (step 50): the commit of step 100 is stuck, epoch 1's end (step
    // 150) is skipped and kept; storage returns once epoch 1 has ended.
    t.until("checkpoint 1 committed");
    link.cut();
    t.until("trainerd: keeping the state of epoch 1 (val_accuracy ");
    link.restore();
    t.rest();
    let status = child.wait().unwrap();
    let transcript = t.text();
    assert!(status.success(), "{status}\n{transcript}");
    assert_eq!(json(&tmp.path().join("a.json"))["params_sha256"], json(&tmp.path().join("ref.json"))["params_sha256"]);
    let listed = trainerd_cmd().args(["ckpt", "list", &url]).envs(env.iter().map(|(k, v)| (k, v))).output().unwrap();
    assert!(listed.status.success(), "{}", text(&listed));
    let listed = stdout(&listed);
    let best: Vec<&str> = listed.lines().filter(|l| l.ends_with("  best")).collect();
    assert_eq!(best.len(), 1, "{listed}\n{transcript}");
    let fields: Vec<&str> = best[0].split_whitespace().collect();
    assert_eq!((fields[1], fields[2]), ("150", "1"), "epoch 1's end is the best commit:\n{listed}\n{transcript}");
}
