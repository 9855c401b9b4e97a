//! Workers killed, frozen and stopped in every way the fault-tolerance issue lists, under a
//! supervisor with systemd's semantics (`Restart=always`, `RestartSec=`). Every scenario must
//! finish within its outer deadline, and every worker must end with exactly the parameters of a
//! failure-free run of the same configuration. While the chaos goes on, a sampler keeps checking
//! that the latest commit verifies; at the end no orphaned checkpoint data may remain.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use trainerd_storage::{CheckpointStore, Location, S3Options};
use trainerd_testkit::s3::S3Server;
use trainerd_testkit::{Cluster, Event, Return, RunArgs, What};

/// Every scenario's outer deadline: a hang fails the test.
const DEADLINE: Duration = Duration::from_secs(240);
const RESTART_SEC: Duration = Duration::from_millis(200);
const WORKERS: usize = 3;

/// A training configuration.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Job {
    plugin: &'static str,
    epochs: u32,
    steps: u64,
    workers: usize,
    /// `--bucket-mb` in KiB (0: the default, 25 MB).
    bucket_kib: u32,
}

const LINEAR: Job = Job { plugin: "linear", epochs: 2, steps: 300, workers: WORKERS, bucket_kib: 0 };
const CNN: Job = Job { plugin: "mnist-cnn", epochs: 2, steps: 60, workers: WORKERS, bucket_kib: 0 };
/// The CNN in buckets of 20 KiB: three, the first two reduced during the backward pass.
const CNN_BUCKETS: Job = Job { bucket_kib: 20, ..CNN };
/// BatchNorm (running statistics as state) and dropout (masks from the generator), two workers.
const BN: Job = Job { plugin: "mnist-bn", epochs: 2, steps: 60, workers: 2, bucket_kib: 0 };

/// `trainerd run` arguments of `job`, each worker's summary in `dir`, checkpoints in `ckpt`.
fn args(job: Job, dir: &Path, ckpt: &str) -> RunArgs {
    let args = match job.bucket_kib {
        0 => RunArgs::new(job.plugin),
        kib => RunArgs::new(job.plugin).set("--bucket-mb", f64::from(kib) / 1024.0),
    };
    args.epochs(job.epochs)
        .steps(job.steps)
        .threads(1)
        .seed(11)
        .optimizer("adam", 0.001)
        .summary(dir.join("summary.{rank}.json"))
        .checkpoints(ckpt, 25)
        .set("--keep-checkpoints", 3)
}

/// The failure-free run's `params_sha256` for `job` (computed once per job).
fn reference(job: Job) -> String {
    static CACHE: OnceLock<Mutex<HashMap<Job, String>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Mutex::default);
    let mut cache = cache.lock().unwrap();
    if let Some(sha) = cache.get(&job) {
        return sha.clone();
    }
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let mut cluster =
        Cluster::start(job.workers, &args(job, tmp.path(), ckpt.to_str().unwrap()), &[], vec![], RESTART_SEC);
    assert_eq!(cluster.wait_finished(DEADLINE), vec![0; job.workers], "{}", cluster.transcript());
    let sha = summary(tmp.path(), 0)["params_sha256"].as_str().unwrap().to_string();
    cache.insert(job, sha.clone());
    sha
}

fn summary(dir: &Path, rank: usize) -> serde_json::Value {
    let path = dir.join(format!("summary.{rank}.json"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

/// Where a scenario's checkpoints go: a local directory, or a prefix on a fresh S3 server.
struct Storage {
    url: String,
    env: Vec<(String, String)>,
    store: CheckpointStore,
    _s3: Option<S3Server>,
}

impl Storage {
    fn local(dir: &Path) -> Storage {
        let path = dir.join("ckpt");
        let url = path.to_str().unwrap().to_string();
        let store = url.parse::<Location>().unwrap().open(&S3Options::default()).unwrap();
        Storage { url, env: Vec::new(), store, _s3: None }
    }

    fn s3() -> Storage {
        let server = S3Server::start().unwrap_or_else(|e| panic!("S3-compatible test server: {e}"));
        let prefix = "chaos-run";
        let store = CheckpointStore::new(Arc::new(server.store().unwrap()), prefix.into(), "s3");
        let env = server.env().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        Storage { url: format!("s3://{}/{prefix}", server.bucket), env, store, _s3: Some(server) }
    }

    /// Samples the latest commit every 100 ms until dropped; each sample must verify.
    fn sampler(&self) -> Sampler {
        let (store, stop, samples) =
            (self.store.clone(), Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
        let handle = {
            let (stop, samples) = (Arc::clone(&stop), Arc::clone(&samples));
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                while !stop.load(Ordering::Relaxed) {
                    if let Some(latest) = rt.block_on(store.latest()).unwrap_or_else(|e| panic!("sampling: {e}")) {
                        assert!(
                            latest.fallbacks.is_empty(),
                            "the latest commit did not verify: {:?}",
                            latest.fallbacks
                        );
                        samples.fetch_add(1, Ordering::Relaxed);
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        };
        Sampler { stop, samples, handle: Some(handle) }
    }

    /// Every data id under the location is named by a commit record, and retention held.
    fn assert_no_orphans(&self) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let records = rt.block_on(self.store.list()).unwrap();
        assert!(!records.is_empty() && records.len() <= 3, "{} commits kept", records.len());
        let referenced: BTreeSet<String> = records.iter().filter_map(|r| r.data_id().map(String::from)).collect();
        let ids = rt.block_on(data_ids(&self.store));
        assert_eq!(ids, referenced, "data not named by any commit record remains");
        for r in &records {
            rt.block_on(self.store.load(r.sequence)).unwrap_or_else(|e| panic!("commit {}: {e}", r.sequence));
        }
    }
}

/// Data ids present under a checkpoint location.
async fn data_ids(store: &CheckpointStore) -> BTreeSet<String> {
    let (raw, root) = store.raw();
    trainerd_testkit::fault::data_ids(raw.as_ref(), &root).await
}

struct Sampler {
    stop: Arc<AtomicBool>,
    samples: Arc<AtomicUsize>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    /// Stops sampling; how many samples verified.
    fn finish(mut self) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        if let Err(panic) = self.handle.take().unwrap().join() {
            std::panic::resume_unwind(panic);
        }
        self.samples.load(Ordering::Relaxed)
    }
}

/// Starts `job` on `storage`, with `first_env` for each worker's first start.
fn start(job: Job, dir: &Path, storage: &Storage, first_env: Vec<Vec<(String, String)>>) -> Cluster {
    Cluster::start(job.workers, &args(job, dir, &storage.url), &storage.env, first_env, RESTART_SEC)
}

/// Waits until the chief (any of its processes) has done step `step` (1-based) of epoch `epoch`
/// (1-based) or later.
fn wait_for_step(c: &mut Cluster, job: Job, epoch: u64, step: u64) {
    c.wait_step(0, (epoch - 1) * job.steps + step, DEADLINE);
}

fn recovered(e: &Event) -> bool {
    matches!(e, Event::Recovered { .. })
}

fn resumed(e: &Event) -> bool {
    matches!(e, Event::Resumed { .. })
}

fn rejoined(e: &Event) -> bool {
    matches!(e, Event::Joined { recovery: true, .. })
}

fn abandoned(e: &Event) -> bool {
    matches!(e, Event::Abandoned { .. })
}

/// Waits for the line worker `rank` printed, `text`, to arrive (a failpoint's).
fn wait_for_text(c: &mut Cluster, rank: usize, text: &str) {
    c.wait_for(|e| e.worker == rank && e.line() == Some(text), DEADLINE);
}

/// Every worker exited 0 with the failure-free run's parameters; the chief's summary.
fn assert_finished_exactly(c: &mut Cluster, job: Job, dir: &Path) -> serde_json::Value {
    let codes = c.wait_finished(DEADLINE);
    assert_eq!(codes, vec![0; job.workers], "{}", c.transcript());
    let expected = reference(job);
    for rank in 0..job.workers {
        assert_eq!(summary(dir, rank)["params_sha256"], expected.as_str(), "worker {rank}\n{}", c.transcript());
    }
    summary(dir, 0)
}

fn recovery(s: &serde_json::Value, key: &str) -> u64 {
    s["fault_tolerance"][key].as_u64().unwrap()
}

/// A worker's (steps lost, steps trained again), from its summary.
fn counts(s: &serde_json::Value) -> (u64, u64) {
    (recovery(s, "steps_lost"), recovery(s, "steps_trained_again"))
}

#[test]
fn sigkill_of_a_worker_mid_epoch_loses_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let storage = Storage::local(tmp.path());
    let sampler = storage.sampler();
    let mut c = start(CNN, tmp.path(), &storage, vec![]);
    wait_for_step(&mut c, CNN, 1, 30);
    c.signal(1, libc::SIGKILL);
    c.wait_event(1, recovered, DEADLINE);
    let chief = assert_finished_exactly(&mut c, CNN, tmp.path());
    assert_eq!(c.starts(1), 2);
    // (A heartbeat starved on a loaded machine may add a harmless recovery: at least one.)
    assert!(recovery(&chief, "failures_seen") >= 1 && recovery(&chief, "recoveries") >= 1, "{}", c.transcript());
    assert_eq!(recovery(&chief, "steps_lost"), 0);
    assert!(sampler.finish() > 0);
    storage.assert_no_orphans();
}

#[test]
fn a_batchnorm_model_killed_mid_epoch_then_stopped_and_resumed_is_bitwise_the_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    let storage = Storage::local(tmp.path());
    let mut c = start(BN, tmp.path(), &storage, vec![]);
    // A worker killed mid-epoch: it comes back and takes the survivor's parameters, buffers
    // (BatchNorm statistics) and position; the survivor's abandoned step put its buffers back.
    wait_for_step(&mut c, BN, 1, 20);
    c.wait_step(1, 20, DEADLINE);
    // A fresh start: every worker built the chief's start state from the seed, and nothing was sent.
    let first = c.joined_after(0);
    assert_eq!(first.len(), BN.workers, "{first:?}");
    assert!(first.iter().all(|(_, j)| matches!(j, Event::Joined { generation: 1, source: None, .. })), "{first:?}");
    c.signal(1, libc::SIGKILL);
    c.wait_event(1, recovered, DEADLINE);
    // Then the whole job stopped and started again: it resumes from the checkpoint.
    wait_for_step(&mut c, BN, 2, 10);
    for rank in 0..BN.workers {
        c.signal(rank, libc::SIGTERM);
    }
    assert_eq!(c.wait_finished(DEADLINE), vec![0; BN.workers], "{}", c.transcript());
    drop(c);
    let mut c = start(BN, tmp.path(), &storage, vec![]);
    c.wait_event(0, resumed, DEADLINE);
    // A resume: the chief's state is the commit it restored, and the others receive it.
    for rank in 0..BN.workers {
        c.wait_step(rank, BN.steps + 1, DEADLINE);
    }
    let first = c.joined_after(0);
    assert_eq!(first.len(), BN.workers, "{first:?}");
    assert!(first.iter().all(|(_, j)| matches!(j, Event::Joined { source: Some(0), .. })), "{first:?}");
    let chief = assert_finished_exactly(&mut c, BN, tmp.path());
    assert_eq!(recovery(&chief, "steps_lost"), 0);
    storage.assert_no_orphans();
}

#[test]
fn sigkill_of_the_chief_mid_epoch_on_s3_loses_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let storage = Storage::s3();
    let sampler = storage.sampler();
    // Killed at the start of step 360 (the second epoch's 60th); the others wait at step 420
    // until it is back (99 steps to spare before, 2026-12-01).
    let staged = Return::new(tmp.path(), 0, LINEAR.steps + 60, &[1, 2], LINEAR.steps + 120);
    let mut c = start(LINEAR, tmp.path(), &storage, staged.env(WORKERS, &[]));
    staged.stop_leaver(&mut c, DEADLINE);
    let killed = c.mark();
    c.signal(0, libc::SIGKILL);
    staged.release_when_back(&mut c, killed, DEADLINE);
    // The restarted chief takes the state from a survivor, not from its older commit: it catches
    // up from the elected coordinator while the others train (nobody receives anything at the
    // switch), or, back while they still re-form, it receives the state from one of them.
    let (_, joined) = c.wait_event_after(0, killed, rejoined, DEADLINE);
    assert!(matches!(joined, Event::Joined { steps_lost: 0, source: None | Some(1..), .. }), "{joined:?}");
    let (_, line) = c.wait_line(0, "trainerd: generation ", killed, DEADLINE);
    let from = if matches!(joined, Event::Joined { source: None, .. }) {
        "state every member held it"
    } else {
        "state from worker "
    };
    assert!(line.contains(": 0 step(s) lost, 0 trained again; ") && line.contains(from), "{line}");
    let chief = assert_finished_exactly(&mut c, LINEAR, tmp.path());
    assert_eq!(c.starts(0), 2);
    assert_eq!(recovery(&summary(tmp.path(), 1), "steps_lost"), 0);
    assert!(recovery(&chief, "recoveries") >= 1);
    assert!(sampler.finish() > 0);
    storage.assert_no_orphans();
}

/// The commit after the comparison of step 100 (every commit follows one) is cut short by the
/// chief's death: it never becomes visible, and since the comparison completed, the survivors
/// go on from their compared state: nothing lost, nothing trained again.
#[test]
fn sigkill_of_the_chief_in_the_middle_of_a_commit_that_follows_a_comparison_never_publishes_it() {
    let tmp = tempfile::tempdir().unwrap();
    let storage = Storage::local(tmp.path());
    let failpoint = vec![("TRAINERD_FAILPOINT".to_string(), "commit-before-record@4".to_string())];
    let mut c = start(LINEAR, tmp.path(), &storage, vec![failpoint]);
    wait_for_text(&mut c, 0, "trainerd: failpoint commit-before-record reached");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let before = rt.block_on(storage.store.list()).unwrap();
    c.signal(0, libc::SIGKILL);
    // The half-written commit (its blobs and manifest, not its record) is never visible.
    assert_eq!(rt.block_on(storage.store.list()).unwrap(), before);
    assert!(rt.block_on(data_ids(&storage.store)).len() > before.len(), "the cut commit left its data behind");
    let chief = assert_finished_exactly(&mut c, LINEAR, tmp.path());
    assert_eq!(counts(&chief), (0, 0));
    assert_eq!(counts(&summary(tmp.path(), 1)), (0, 0), "{}", c.transcript());
    assert!(!c.transcript().contains("did not complete"), "{}", c.transcript());
    storage.assert_no_orphans();
}

#[test]
fn sigkill_during_an_all_reduce_leaves_one_state_for_everyone() {
    let tmp = tempfile::tempdir().unwrap();
    let storage = Storage::local(tmp.path());
    // Worker 1 stops after the first hop of step 96's all-gather: worker 0 completes that step,
    // worker 2 does not. Everyone must continue from worker 0's state. (linear's chunks are small
    // enough to sit in the socket buffers whatever worker 1 does.) The point is armed by the step,
    // not by a count of all-gathers, which a recovery or a comparison before it would move: on a
    // loaded machine it once fell on the comparison and commit of step 100.
    let failpoint = vec![("TRAINERD_FAILPOINT".to_string(), "all-gather@step=96".to_string())];
    let mut c = start(LINEAR, tmp.path(), &storage, vec![vec![], failpoint]);
    wait_for_text(&mut c, 1, "trainerd: failpoint all-gather reached");
    std::thread::sleep(Duration::from_millis(300));
    let killed = c.mark();
    c.signal(1, libc::SIGKILL);
    let (_, gave_up) = c.wait_event(2, abandoned, DEADLINE);
    let (_, formed) = c.wait_event(2, rejoined, DEADLINE);
    // Worker 2 abandoned the very step it then received from worker 0.
    let (Event::Abandoned { step, .. }, Event::Joined { global_step, source, .. }) = (&gave_up, &formed) else {
        unreachable!("matched above")
    };
    assert_eq!((step, source), (global_step, &Some(0)), "{gave_up:?} / {formed:?}");
    let (_, line) = c.wait_line(2, "trainerd: generation ", killed, DEADLINE);
    assert_eq!(*step, 96, "{gave_up:?}");
    assert!(line.contains(" formed at step 96: 0 step(s) lost, 0 trained again; state from worker 0 "), "{line}");
    let chief = assert_finished_exactly(&mut c, LINEAR, tmp.path());
    assert_eq!(counts(&chief), (0, 0));
}

/// Worker 1 is stopped inside its backward pass of step 40, just after it handed a bucket's
/// gradients to the reduction (which its peers join from their own backward passes), and
/// SIGKILLed there: the others abandon step 40 and take it up again with nothing lost, and the
/// run ends bitwise the failure-free run's.
#[test]
fn sigkill_inside_the_backward_pass_while_a_bucket_is_reduced_loses_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let storage = Storage::local(tmp.path());
    let failpoint = vec![("TRAINERD_FAILPOINT".to_string(), "backward@step=40".to_string())];
    let mut c = start(CNN_BUCKETS, tmp.path(), &storage, vec![vec![], failpoint]);
    wait_for_text(&mut c, 1, "trainerd: failpoint backward reached");
    c.signal(1, libc::SIGKILL);
    let (_, gave_up) = c.wait_event(2, abandoned, DEADLINE);
    let Event::Abandoned { step, .. } = &gave_up else { unreachable!("matched above") };
    assert_eq!(*step, 40, "{gave_up:?}");
    let chief = assert_finished_exactly(&mut c, CNN_BUCKETS, tmp.path());
    assert_eq!(counts(&chief), (0, 0), "{}", c.transcript());
    assert_eq!(counts(&summary(tmp.path(), 2)), (0, 0), "{}", c.transcript());
}

#[test]
fn two_workers_at_once_then_every_worker() {
    let tmp = tempfile::tempdir().unwrap();
    let storage = Storage::local(tmp.path());
    let sampler = storage.sampler();
    let mut c = start(LINEAR, tmp.path(), &storage, vec![]);
    wait_for_step(&mut c, LINEAR, 1, 90);
    c.signal(1, libc::SIGKILL);
    c.signal(2, libc::SIGKILL);
    c.wait_event(0, recovered, DEADLINE);
    wait_for_step(&mut c, LINEAR, 2, 60);
    // Every worker at once: nobody holds the state, so the run goes on from the latest commit.
    for rank in 0..WORKERS {
        c.signal(rank, libc::SIGKILL);
    }
    c.wait_event(0, resumed, DEADLINE);
    assert_finished_exactly(&mut c, LINEAR, tmp.path());
    assert!(sampler.finish() > 0);
    storage.assert_no_orphans();
}

/// Ten SIGKILLs of random workers (the chief among them), some while the cluster still recovers
/// from the one before, on S3: the run ends exactly. The run is long enough to outlast the kills:
/// a return catches up without pausing the others, so a short run could end before the tenth,
/// and a worker killed after the end would come back to a finished run (it exits 0, with no
/// summary).
#[test]
fn ten_random_kills_in_one_run() {
    let tmp = tempfile::tempdir().unwrap();
    let storage = Storage::s3();
    let sampler = storage.sampler();
    let job = Job { plugin: "linear", epochs: 6, steps: 300, workers: WORKERS, bucket_kib: 0 };
    let mut c = start(job, tmp.path(), &storage, vec![]);
    wait_for_step(&mut c, job, 1, 30);
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut random = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut kills = 0;
    while kills < 10 {
        let victim = random(WORKERS as u64) as usize;
        if c.pid(victim).is_none() {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        c.drain();
        let ended = c.seen().iter().any(|e| matches!(e.what, What::Finished(_)));
        assert!(!ended, "the run ended after {kills} kill(s): make it longer\n{}", c.transcript());
        c.signal(victim, libc::SIGKILL);
        kills += 1;
        // Some kills land while the cluster is still recovering from the previous one.
        std::thread::sleep(Duration::from_millis(150 + random(900)));
    }
    assert_finished_exactly(&mut c, job, tmp.path());
    assert!(sampler.finish() > 0);
    storage.assert_no_orphans();
}

#[test]
fn sigterm_preempts_one_worker_and_its_return_loses_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let storage = Storage::local(tmp.path());
    // Stopped at step 150's start, so that the others train on without it from there, and held
    // at step 200 until it is back (a release build would otherwise end the run first).
    let staged = Return::new(tmp.path(), 2, 150, &[0, 1], 200);
    let mut c = start(LINEAR, tmp.path(), &storage, staged.env(WORKERS, &[]));
    staged.stop_leaver(&mut c, DEADLINE);
    let (sent, mark) = (Instant::now(), c.mark());
    c.signal(2, libc::SIGTERM);
    staged.release_leaver();
    let (at, exiting) = c.wait_event(2, |e| matches!(e, Event::Exiting { .. }), DEADLINE);
    assert_eq!(exiting, Event::Exiting { status: 0 });
    assert_eq!(c.wait_exit(2, DEADLINE).1, 0);
    assert!(at - sent < Duration::from_secs(10), "it took {:?} to stop", at - sent);
    let (_, stopped) = c.wait_line(2, "trainerd: stopped by signal at global step ", mark, DEADLINE);
    assert!(stopped.contains("committed as checkpoint") || stopped.contains("held by the coordinator"), "{stopped}");
    // The others train on without it; the node comes back.
    staged.bring_back(&mut c, DEADLINE);
    let chief = assert_finished_exactly(&mut c, LINEAR, tmp.path());
    assert_eq!(recovery(&chief, "steps_lost"), 0);
    storage.assert_no_orphans();
}

#[test]
fn sigterm_to_every_worker_commits_once_and_the_next_start_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let storage = Storage::local(tmp.path());
    let mut c = start(LINEAR, tmp.path(), &storage, vec![]);
    wait_for_step(&mut c, LINEAR, 1, 200);
    for rank in 0..WORKERS {
        c.signal(rank, libc::SIGTERM);
    }
    assert_eq!(c.wait_finished(DEADLINE), vec![0; WORKERS], "{}", c.transcript());
    let stopped = c.lines_of(0, "trainerd: stopped by signal at global step ");
    assert_eq!(stopped.len(), 1, "{}", c.transcript());
    // Either this stop committed the state, or a periodic commit had already taken it.
    assert!(
        stopped[0].contains("committed as checkpoint") || stopped[0].contains("the state is already committed in"),
        "{}",
        stopped[0]
    );
    drop(c);
    // The whole job starts again and resumes at the very step it stopped at.
    let step: u64 =
        stopped[0]["trainerd: stopped by signal at global step ".len()..].split(';').next().unwrap().parse().unwrap();
    let mut c = start(LINEAR, tmp.path(), &storage, vec![]);
    let (_, event) = c.wait_event(0, resumed, DEADLINE);
    assert!(matches!(event, Event::Resumed { global_step, .. } if global_step == step), "{event:?}");
    let (_, resumed) = c.wait_line(0, "trainerd: resumed from checkpoint ", 0, DEADLINE);
    assert!(resumed.ends_with(&format!("(global step {step})")), "{resumed}");
    assert_finished_exactly(&mut c, LINEAR, tmp.path());
    storage.assert_no_orphans();
}

#[test]
fn a_frozen_worker_is_abandoned_within_the_heartbeat_deadline_and_rejoins_after_sigcont() {
    let tmp = tempfile::tempdir().unwrap();
    let storage = Storage::local(tmp.path());
    let mut c = start(LINEAR, tmp.path(), &storage, vec![]);
    wait_for_step(&mut c, LINEAR, 1, 120);
    let (frozen, mark) = (Instant::now(), c.mark());
    c.signal(1, libc::SIGSTOP);
    let mut took = Vec::new();
    for (at, _) in c.wait_events_each(&[0, 2], abandoned, DEADLINE) {
        took.push(at - frozen);
    }
    for rank in [0, 2] {
        let (_, line) = c.wait_line(rank, "trainerd: step ", mark, DEADLINE);
        assert!(line.contains("worker 1 ") && line.contains("sent no heartbeat"), "{line}");
    }
    // Heartbeats every 0.1 s, deadline 1.5 s (the defaults); the notice travels on loopback. The
    // bound leaves a loaded 2-core machine room and is far below the 120 s collective timeout,
    // the only other way a survivor could leave a step with a frozen peer.
    for took in &took {
        assert!(*took < Duration::from_secs(4), "a survivor abandoned the step {took:?} after the freeze");
    }
    // Woken at once (frozen for longer than the deadline already): the survivors finish the
    // remaining steps of the linear plugin in well under a second on an idle machine.
    c.signal(1, libc::SIGCONT);
    c.wait_event(1, rejoined, DEADLINE);
    let chief = assert_finished_exactly(&mut c, LINEAR, tmp.path());
    assert_eq!(c.starts(1), 1, "the frozen worker rejoined without a restart");
    // Nothing is lost to the freeze, and its return is no failure: it ends the survivors'
    // generation at a step boundary (or at once, when they already wait in the final barrier),
    // never inside a comparison of the replicas (before each commit, every 25 steps here), so
    // nothing is trained again either.
    let transcript = c.transcript();
    assert_eq!(counts(&chief), (0, 0), "{transcript}");
    assert!(!transcript.contains("did not complete"), "{transcript}");
}

/// The chief restarted while the storage is down (the soak's longest pauses: a restarted chief
/// read the latest commit before its own join, and the survivors waited out the storage's
/// retries). Of 3 workers, worker 2 is held down, the link to the S3 server is cut, and the chief
/// is SIGKILLed: worker 1, alone (no majority), waits for the chief's new process, which joins
/// first. Worker 1 holds the state of the newest generation, so they form at once and the chief
/// receives it, reading nothing. The link comes back after 20 s, worker 2 returns, and the run
/// ends bitwise the failure-free one (worker 2 joins, or finds the run ended).
#[test]
fn the_chief_restarted_during_a_storage_outage_joins_first_and_the_survivors_do_not_wait_for_it() {
    let tmp = tempfile::tempdir().unwrap();
    let server = S3Server::start().unwrap_or_else(|e| panic!("S3-compatible test server: {e}"));
    let link = server.link().unwrap();
    let mut env: Vec<(String, String)> = server.env().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    env.retain(|(k, _)| k != "AWS_ENDPOINT_URL");
    env.push(("AWS_ENDPOINT_URL".into(), link.endpoint()));
    let url = format!("s3://{}/outage", server.bucket);
    let mut c = Cluster::start(WORKERS, &args(LINEAR, tmp.path(), &url), &env, vec![], RESTART_SEC);
    c.hold(2);
    wait_for_step(&mut c, LINEAR, 1, 10);
    c.signal(2, libc::SIGKILL);
    c.wait_line(0, "checkpoint 2 committed to ", 0, DEADLINE);
    wait_for_step(&mut c, LINEAR, 1, 60);
    link.cut();
    let cut = Instant::now();
    let mark = c.mark();
    c.signal(0, libc::SIGKILL);
    let restarted = c.wait_for(|e| e.worker == 0 && e.what == What::Restarted, DEADLINE).at;
    let (_, joined) = c.wait_event(1, |e| matches!(e, Event::Joined { .. }), DEADLINE);
    assert!(matches!(joined, Event::Joined { source: Some(1), .. }), "{joined:?}\n{}", c.transcript());
    let (next_step, _) = c.wait_event(1, |e| matches!(e, Event::Step { .. }), DEADLINE);
    // Formed and training while the storage is still down (a time is not asserted: the soak and
    // this line report it; before, the survivor waited out the storage's retries, 23 s and more).
    assert!(cut.elapsed() < Duration::from_secs(20), "the survivor waited for the storage\n{}", c.transcript());
    let up = c.seen()[mark..].iter().find(|e| e.worker == 0 && e.line().is_some()).map_or(restarted, |e| e.at);
    println!(
        "the chief's restart to the survivor's next step, the storage down: {:.2} s ({:.2} s from its first line)",
        next_step.saturating_duration_since(restarted).as_secs_f64(),
        next_step.saturating_duration_since(up).as_secs_f64()
    );
    let read = c.seen()[mark..].iter().any(|e| e.worker == 0 && e.event().is_some_and(resumed));
    assert!(!read, "the restarted chief read the storage\n{}", c.transcript());
    std::thread::sleep(Duration::from_secs(20).saturating_sub(cut.elapsed()));
    link.restore();
    c.bring_back(2);
    let codes = c.wait_finished(DEADLINE);
    assert_eq!(codes, vec![0; LINEAR.workers], "{}", c.transcript());
    let expected = reference(LINEAR);
    for rank in 0..2 {
        assert_eq!(summary(tmp.path(), rank)["params_sha256"], expected.as_str(), "worker {rank}\n{}", c.transcript());
    }
    // Worker 2 came back while the run still trained (it joined: its summary), or, on a quiet
    // machine, after the survivors had trained to the end during the cut and made the final
    // commit as the link came back: then it reads that commit and leaves, as a return after the
    // end does ("Returns, wherever they land").
    if tmp.path().join("summary.2.json").exists() {
        assert_eq!(summary(tmp.path(), 2)["params_sha256"], expected.as_str(), "{}", c.transcript());
    } else {
        let ended = c.lines_of(2, "trainerd: the run finished at step 600 (commit ");
        assert!(ended.iter().any(|l| l.ends_with("; nothing left to do")), "{}", c.transcript());
    }
}
