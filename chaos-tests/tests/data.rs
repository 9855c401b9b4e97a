//! Workers killed while they train from Parquet, on local disk and on the S3 test server: alone
//! (restarted, resumed from the last commit with the pipeline opened mid-epoch) and as one of
//! three (restarted, rejoining its peers at the step they hold). Each ends with exactly the
//! uninterrupted run's model. And the S3 server becoming unreachable mid-epoch: training waits,
//! nothing is skipped, and past `--data-timeout` the run ends with one error naming the file.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::time::Duration;

use trainerd_testkit::events::Record;
use trainerd_testkit::notify::NotifySocket;
use trainerd_testkit::output::params_sha256;
use trainerd_testkit::s3::S3Server;
use trainerd_testkit::{dataset, parquet_dataset, trainerd_cmd, Event, RunArgs, Worker};

const WAIT: Duration = Duration::from_secs(180);

/// Where the dataset is: the Parquet copy on local disk, or converted onto a fresh S3 server.
struct Data {
    url: String,
    env: Vec<(&'static str, String)>,
    _server: Option<S3Server>,
}

fn local() -> Data {
    Data { url: parquet_dataset().to_str().unwrap().into(), env: Vec::new(), _server: None }
}

/// Fashion-MNIST written onto a new S3 server by `trainerd data convert`.
fn on_s3() -> Data {
    let server = S3Server::start().unwrap_or_else(|e| panic!("S3-compatible test server: {e}"));
    let env = server.env();
    let url = format!("s3://{}/fashion-mnist", server.bucket);
    let out = trainerd_cmd()
        .args(["data", "convert"])
        .arg(dataset())
        .arg(&url)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", trainerd_testkit::output::text(&out));
    Data { url, env, _server: Some(server) }
}

/// A linear model's run on `data` (2 epochs of 150 steps), checkpointed every 40 steps; remote
/// data cached in `dir` within 8 MB, less than the dataset's 34.
fn args(data: &Data, dir: &Path, name: &str) -> RunArgs {
    args_with(data, dir, name, (20000, "8M"))
}

/// [`args`] with another shuffle window and cache bound.
fn args_with(data: &Data, dir: &Path, name: &str, (window, cache): (u64, &str)) -> RunArgs {
    RunArgs::new("linear")
        .data(&data.url)
        .epochs(2)
        .steps(150)
        .seed(3)
        .optimizer("adam", 0.001)
        .set("--shuffle-window", window)
        .checkpoints(dir.join(format!("{name}-ckpt")), 40)
        .set("--data-cache-size", cache)
        .summary(dir.join(format!("{name}.json")))
        .set("--data-cache", dir.join("cache").to_str().unwrap())
}

fn start(sub: &[&str], args: &RunArgs, data: &Data) -> Worker {
    Worker::start_with(&[sub, &args.strs()].concat(), &data.env)
}

/// One worker, killed mid-epoch 2 after a commit, restarted: it resumes from that commit.
fn alone(data: &Data) {
    let tmp = tempfile::tempdir().unwrap();
    let run = ["run"];
    let args = |name: &str| args(data, tmp.path(), name).threads(1);
    assert!(start(&run, &args("reference"), data).wait().success());
    let killed = args("killed");
    let mut worker = start(&run, &killed, data);
    let committed =
        worker.wait_event(|r| matches!(r.event, Event::Committed { global_step, .. } if global_step > 150), WAIT);
    let Event::Committed { global_step: at, .. } = committed.event else { unreachable!() };
    worker.wait_event(|r| matches!(r.event, Event::Step { global_step, .. } if global_step > at + 5), WAIT);
    assert_eq!(worker.kill(libc::SIGKILL).signal(), Some(libc::SIGKILL));
    let mut again = start(&run, &killed, data);
    again.wait_event(|r| matches!(r.event, Event::Resumed { epoch: 1, .. }), WAIT);
    assert!(again.wait().success());
    assert_eq!(params_sha256(&tmp.path().join("killed.json")), params_sha256(&tmp.path().join("reference.json")));
}

/// Three workers; worker 1 killed mid-epoch 2 and restarted by the launcher: it rejoins, takes
/// the state from a peer, and its pipeline opens at the step they hold.
fn three(data: &Data) {
    let tmp = tempfile::tempdir().unwrap();
    let launcher = ["local", "--workers", "3", "--restart-delay", "0"];
    let args = |name: &str| args(data, tmp.path(), name).threads(1);
    assert!(start(&launcher, &args("reference"), data).wait().success());
    let mut cluster = start(&launcher, &args("killed"), data);
    let at =
        |r: &Record| r.worker == Some(1) && matches!(r.event, Event::Step { global_step, .. } if global_step > 170);
    let pid = cluster.wait_event(at, WAIT).pid;
    // SAFETY: kill(2) on a process of this test's launcher.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) }, 0);
    let rejoined = |r: &Record| r.worker == Some(1) && r.pid != pid && matches!(r.event, Event::Joined { .. });
    cluster.wait_event(rejoined, WAIT);
    assert!(cluster.wait().success());
    let reference = params_sha256(&tmp.path().join("reference.worker0.json"));
    for w in 0..3 {
        assert_eq!(params_sha256(&tmp.path().join(format!("killed.worker{w}.json"))), reference, "worker {w}");
    }
}

#[test]
fn one_worker_killed_mid_epoch_resumes_exactly_from_parquet_on_local_disk() {
    alone(&local());
}

#[test]
fn one_worker_killed_mid_epoch_resumes_exactly_from_parquet_on_s3() {
    alone(&on_s3());
}

#[test]
fn one_of_three_workers_killed_mid_epoch_rejoins_exactly_from_parquet_on_local_disk() {
    three(&local());
}

#[test]
fn one_of_three_workers_killed_mid_epoch_rejoins_exactly_from_parquet_on_s3() {
    three(&on_s3());
}

/// A run on S3 reached through a link the test cuts; windows of 2,000 rows keep it reading
/// through the epoch, and a cache too small to hold a row group sends every read to the server.
fn outage_run(data: &Data, (endpoint, notify): (&str, Option<&NotifySocket>), dir: &Path, extra: &[&str]) -> Worker {
    let run = args_with(data, dir, "outage", (2000, "1K")).threads(1).extend(extra);
    let mut env = data.env.clone();
    env.retain(|(k, _)| *k != "AWS_ENDPOINT_URL");
    env.push(("AWS_ENDPOINT_URL", endpoint.to_string()));
    if let Some(socket) = notify {
        // As systemd runs it: its watchdog every 2 s, so a wait the daemon did not bound would
        // stop the pings within that.
        env.push(("NOTIFY_SOCKET", socket.path.to_str().unwrap().to_string()));
        env.push(("WATCHDOG_USEC", "2000000".into()));
    }
    Worker::start_with(&[&["run"][..], &run.strs()].concat(), &env)
}

#[test]
fn an_s3_outage_mid_epoch_is_waited_out_and_loses_nothing() {
    let data = on_s3();
    let tmp = tempfile::tempdir().unwrap();
    let server = data._server.as_ref().unwrap();
    let link = server.link().unwrap();
    let reference = tmp.path().join("reference");
    std::fs::create_dir_all(&reference).unwrap();
    assert!(outage_run(&data, (&server.endpoint, None), &reference, &[]).wait().success());

    let mut systemd = NotifySocket::new();
    let endpoint = link.endpoint();
    let mut worker = outage_run(&data, (&endpoint, Some(&systemd)), tmp.path(), &["--data-timeout", "60"]);
    worker.wait_event(|r| matches!(r.event, Event::Step { global_step: 60, .. }), WAIT);
    link.cut();
    worker.wait_line(|l| l.contains("retrying in"), WAIT);
    // systemd sees why, and its watchdog stays fed through a wait longer than its period.
    let status = systemd.wait_for("data source retrying s3://", Duration::from_secs(10));
    assert!(status.starts_with("STATUS=data source retrying s3://"), "{status}");
    let mark = systemd.mark();
    std::thread::sleep(Duration::from_secs(5));
    assert!(systemd.pings_sent_after(&mark) >= 3, "the watchdog pings stopped during the outage");
    link.restore();
    worker.wait_line(|l| l.contains(": answering again after "), WAIT);
    assert!(worker.wait().success());
    assert_eq!(params_sha256(&tmp.path().join("outage.json")), params_sha256(&reference.join("outage.json")));
}

#[test]
fn an_s3_outage_past_the_data_timeout_ends_the_run_naming_the_file() {
    let data = on_s3();
    let tmp = tempfile::tempdir().unwrap();
    let link = data._server.as_ref().unwrap().link().unwrap();
    let endpoint = link.endpoint();
    let mut worker = outage_run(&data, (&endpoint, None), tmp.path(), &["--data-timeout", "2"]);
    worker.wait_event(|r| matches!(r.event, Event::Step { global_step: 60, .. }), WAIT);
    link.cut();
    let line = worker.wait_line(|l| l.starts_with("error: "), WAIT);
    let prefix = format!("error: data file s3://{}/fashion-mnist/train-0000", data._server.as_ref().unwrap().bucket);
    assert!(line.starts_with(&prefix), "{line}");
    assert!(line.contains(".parquet: the data source failed for "), "{line}");
    assert!(line.ends_with("; gave up after --data-timeout"), "{line}");
    assert_eq!(worker.wait().code(), Some(1));
}

/// mnist-cnn trained from Fashion-MNIST's Parquet copy on the S3 test server, through a local
/// cache smaller than the data: the same dataset (fingerprint) and the same bits as from the
/// copy on local disk, and the tutorials' accuracy for 300 steps.
#[test]
fn mnist_cnn_trains_from_the_parquet_copy_on_s3_as_from_local_disk() {
    let s3 = on_s3();
    let tmp = tempfile::tempdir().unwrap();
    let run = |data: &Data, name: &str| {
        let summary = tmp.path().join(format!("{name}.json"));
        let cache = tmp.path().join(format!("{name}-cache"));
        let run = RunArgs::new("mnist-cnn").threads(1).data(&data.url).epochs(1).steps(300);
        let run = run.set("--data-cache-size", "8M").summary(&summary).set("--data-cache", cache.to_str().unwrap());
        assert!(Worker::start_with(&[&["run"][..], &run.strs()].concat(), &data.env).wait().success());
        (trainerd_testkit::output::json(&summary), cache)
    };
    let (remote, cache) = run(&s3, "s3");
    let (local, _) = run(&local(), "local");
    assert_eq!(remote["data"]["fingerprint"], local["data"]["fingerprint"], "the same dataset, wherever it lives");
    assert_eq!(remote["params_sha256"], local["params_sha256"]);
    let accuracy = remote["test_accuracy"].as_f64().unwrap();
    assert!(accuracy >= 0.8, "test accuracy {accuracy} after 300 steps");
    let cached: u64 = walk_bytes(&cache);
    // The bound, plus what one writer adds between two looks at the directory (an eighth).
    assert!(cached <= 9 << 20, "the cache holds {cached} bytes, over its 8 MiB bound");
    assert!(remote["data"]["train_epochs"][0][1]["fetched"].as_u64().unwrap() > 0);
}

fn walk_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| if e.path().is_dir() { walk_bytes(&e.path()) } else { e.metadata().map_or(0, |m| m.len()) })
                .sum()
        })
        .unwrap_or(0)
}

/// A training file rewritten on the S3 server while the run reads it: its ETag no longer matches
/// the one listed at start (`If-Match` fails), and the run ends naming it; nothing stale is read.
#[test]
fn a_file_rewritten_on_s3_under_the_run_is_refused_naming_it() {
    let data = on_s3();
    let tmp = tempfile::tempdir().unwrap();
    let server = data._server.as_ref().unwrap();
    let mut worker = outage_run(&data, (&server.endpoint, None), tmp.path(), &[]);
    worker.wait_event(|r| matches!(r.event, Event::Step { global_step: 60, .. }), WAIT);
    // Another file's bytes under a training file's name: another size, another ETag.
    let store = server.store().unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        use object_store::ObjectStoreExt;
        let other =
            store.get(&"fashion-mnist/test-00000-of-00001.parquet".into()).await.unwrap().bytes().await.unwrap();
        for i in 0..3 {
            let name = format!("fashion-mnist/train-{i:05}-of-00003.parquet");
            store.put(&name.as_str().into(), other.clone().into()).await.unwrap();
        }
    });
    let line = worker.wait_line(|l| l.starts_with("error: "), WAIT);
    let prefix = format!("error: data file s3://{}/fashion-mnist/train-0000", server.bucket);
    assert!(line.starts_with(&prefix), "{line}");
    assert!(
        line.contains(".parquet: it is not the file it was (its ETag is no longer ")
            && line.ends_with(
                ") since the run started; a dataset must not change under a running job (restart the run to train on \
                 the new data)"
            ),
        "{line}"
    );
    assert_eq!(worker.wait().code(), Some(1));
}
