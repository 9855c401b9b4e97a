//! The randomized soak: 4 workers train one job round after round while a seeded random schedule
//! applies, mixed, what each chaos test applies alone:
//! - SIGKILLs of any worker, the chief included (restarted 1 s later, as systemd would);
//! - SIGSTOP, then SIGCONT some seconds later;
//! - a worker held down (not restarted) for a while, then brought back;
//! - two workers killed close together;
//! - cuts of the link to the S3 test server that holds the checkpoints;
//! - a partition (a worker's port on the namespaces' bridge taken down), in the rounds run in
//!   network namespaces where the machine allows them (those rounds commit to a shared local
//!   directory, as to a NAS);
//! - a bit flipped in one replica's parameters (failpoint `flip-bit`, armed for a worker's next
//!   process and that worker killed).
//!
//! Every third round shards the optimizer state (`--shard-optimizer`, buddy copies included;
//! there the per-step check of the parameters finds a flipped bit, docs/fault-tolerance.md, "The
//! replica check").
//! Every round must end with every worker exiting 0 with the failure-free run's parameters, no
//! hang (no progress for [`HANG`] fails), and every commit verifying. The steps trained again are
//! counted twice, from the transcript (a global step that generations trained more than once)
//! and as the formations reported them: the two must agree, and no step may be lost (trained
//! again for any reason but the repair of a corrupted replica). Each event is printed with the
//! pause it caused (the longest time without a new global step until the next event), and a
//! table at the end.
//!
//! `SOAK_MINUTES` (default 2) and `SOAK_SEED` (default 1) size and seed it: the suite runs the
//! 2-minute version with seed 1; `bench/soak.sh --minutes N --seed S` runs longer ones.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use trainerd_storage::{CheckpointStore, Location, S3Options};
use trainerd_testkit::proxy::TcpProxy;
use trainerd_testkit::s3::S3Server;
use trainerd_testkit::{Cluster, Event, Netns, RunArgs, What};

const WORKERS: usize = 4;
const RESTART_SEC: Duration = Duration::from_secs(1);
/// No new global step for this long, with nothing planned that explains it, is a hang.
const HANG: Duration = Duration::from_secs(90);
/// Each worker's summary, in the round's directory.
const SUMMARY: &str = "summary.{rank}.json";
/// A round's outer deadline.
const DEADLINE: Duration = Duration::from_secs(1800);

/// splitmix64: the schedule's only source of chance, so a seed replays it.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn seconds(&mut self, lo: f64, hi: f64) -> Duration {
        Duration::from_secs_f64(lo + (hi - lo) * (self.next() >> 11) as f64 / (1u64 << 53) as f64)
    }
}

/// How long and how hard.
#[derive(Clone, Copy)]
struct Soak {
    minutes: f64,
    seed: u64,
    /// Epochs of the round's job (937 steps each: the training split in global batches of 64).
    epochs: u32,
    /// How long a worker is held down.
    hold: (f64, f64),
}

impl Soak {
    fn from_env() -> Soak {
        let var = |name: &str, default: f64| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
        let minutes = var("SOAK_MINUTES", 2.0);
        let seed = var("SOAK_SEED", 1.0) as u64;
        // Long soaks run longer rounds, with workers held down for minutes.
        if minutes >= 10.0 {
            Soak { minutes, seed, epochs: 96, hold: (60.0, 150.0) }
        } else {
            Soak { minutes, seed, epochs: 4, hold: (10.0, 25.0) }
        }
    }
}

/// The kinds of events, in the table's order.
const KINDS: [&str; 9] =
    ["kill", "kill chief", "two close", "freeze", "hold down", "return", "S3 cut", "partition", "bit flip"];

/// An event applied: its kind, what exactly, when, at which global step.
struct Applied {
    kind: &'static str,
    what: String,
    at: Instant,
    step: u64,
}

/// Something to undo later: SIGCONT, a link restored, a worker brought back, a partition healed.
enum Undo {
    Cont(usize),
    Restore,
    BringBack(usize),
    Heal(usize),
}

/// Where a round commits, and how the schedule reaches it.
enum Storage {
    S3 { server: S3Server, link: TcpProxy, prefix: String },
    Shared { dir: std::path::PathBuf },
}

impl Storage {
    fn url(&self) -> String {
        match self {
            Storage::S3 { server, prefix, .. } => format!("s3://{}/{prefix}", server.bucket),
            Storage::Shared { dir } => dir.to_str().unwrap().to_string(),
        }
    }

    fn env(&self) -> Vec<(String, String)> {
        match self {
            Storage::S3 { server, link, .. } => {
                let mut env: Vec<(String, String)> =
                    server.env().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
                env.retain(|(k, _)| k != "AWS_ENDPOINT_URL");
                env.push(("AWS_ENDPOINT_URL".into(), link.endpoint()));
                env
            }
            Storage::Shared { .. } => Vec::new(),
        }
    }

    /// Every commit of the round loads and verifies (sha256 of every blob); how many.
    fn verify_all(&self) -> usize {
        let store = match self {
            Storage::S3 { server, prefix, .. } => {
                CheckpointStore::new(Arc::new(server.store().unwrap()), prefix.as_str().into(), "s3")
            }
            Storage::Shared { dir } => {
                dir.to_str().unwrap().parse::<Location>().unwrap().open(&S3Options::default()).unwrap()
            }
        };
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let records = rt.block_on(store.list()).unwrap();
        for r in &records {
            rt.block_on(store.load(r.sequence))
                .unwrap_or_else(|e| panic!("commit {} does not verify: {e}", r.sequence));
        }
        records.len()
    }
}

/// The round's job: linear, batch 16, the replicas compared every 10 steps (the rounds add the
/// commits: every 500 steps, each one kept, to verify them all).
fn job(soak: &Soak, dir: &Path) -> RunArgs {
    let run = RunArgs::new("linear").epochs(soak.epochs).batch(16).threads(1).seed(11).summary(dir.join(SUMMARY));
    // A corrupted replica is caught only while it exists: compared every 10 steps, a flip is
    // caught before another fault can take its worker away (docs/fault-tolerance.md).
    run.set("--replica-check-every", 10)
}

/// The failure-free run's parameters: one process holding the 4 slots (`--accumulate 4`), whose
/// math is the 4 workers' (virtual ranks).
fn reference(soak: &Soak) -> (String, u64) {
    let tmp = tempfile::tempdir().unwrap();
    let out = job(soak, tmp.path()).set("--accumulate", 4).command("run").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // A process alone writes the path as given.
    let s = summary(tmp.path(), SUMMARY);
    (s["params_sha256"].as_str().unwrap().to_string(), s["steps"].as_u64().unwrap())
}

/// The step at which worker `rank`'s last process found the run already finished (started again
/// after the others had ended: it says so, trains nothing and writes no summary), if it did.
fn found_finished(transcript: &str, rank: usize) -> Option<u64> {
    let prefix = format!("[worker {rank}] ");
    let last = transcript.lines().filter_map(|l| l.strip_prefix(prefix.as_str())).rev();
    let said =
        last.take_while(|l| *l != "(Restarted)").find_map(|l| l.strip_prefix("trainerd: the run finished at step "))?;
    said.split(' ').next()?.parse().ok()
}

/// Only the last process of a worker counts, and only its own line (seed 1's round 4, 2026-12-02:
/// worker 1 killed at step 3172 of 3748 came back after the others had ended).
#[test]
fn a_worker_back_after_the_end_is_found_by_its_last_processs_line() {
    let transcript = "[worker 1] (Event(Step { epoch: 3, step: 361, global_step: 3172 }))\n\
                      [worker 1] (Died(\"SIGKILL\"))\n\
                      [worker 0] trainerd: the run finished at step 12 (commit 1 in /x); nothing left to do\n\
                      [worker 1] (Restarted)\n\
                      [worker 1] trainerd: the run finished at step 3748 (commit 11 in /c); nothing left to do\n\
                      [worker 1] (Finished(0))";
    assert_eq!(found_finished(transcript, 1), Some(3748));
    assert_eq!(found_finished(transcript, 2), None);
    let restarted_again = format!("{transcript}\n[worker 1] (Restarted)\n[worker 1] trainerd: step 1");
    assert_eq!(found_finished(&restarted_again, 1), None);
    // Worker 0's line is its first process's: it counts (no restart since).
    assert_eq!(found_finished(transcript, 0), Some(12));
}

fn summary(dir: &Path, name: &str) -> serde_json::Value {
    let path = dir.join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

/// The highest global step any worker reported so far, and when it was first reached.
fn progress(c: &Cluster) -> (u64, Instant) {
    let mut best = (0, Instant::now());
    for e in &c.seen {
        if let Some(Event::Step { global_step, .. }) = e.event() {
            if *global_step > best.0 {
                best = (*global_step, e.at);
            }
        }
    }
    best
}

/// One round under the schedule; the events applied.
struct Round<'a> {
    soak: &'a Soak,
    c: Cluster,
    storage: Storage,
    net: Option<Netns>,
    rng: &'a mut Rng,
    applied: Vec<Applied>,
    pending: Vec<(Instant, Undo)>,
    /// The worker held down or frozen, if any (one at a time).
    down: Option<usize>,
    /// The workers a bit was flipped in.
    flipped: Vec<usize>,
    started: Instant,
    /// The round's number, naming its kept transcript.
    number: usize,
}

impl Round<'_> {
    /// Where the round's whole transcript is kept, for whoever reads the table or a failure.
    fn keep_transcript(&self) -> std::path::PathBuf {
        let kept = std::env::temp_dir().join(format!("trainerd-soak-seed{}-round{}.log", self.soak.seed, self.number));
        std::fs::write(&kept, self.c.transcript()).unwrap();
        kept
    }

    fn running(&self, rank: usize) -> bool {
        self.c.pid(rank).is_some() && self.down != Some(rank)
    }

    /// A running worker other than `except`, at random.
    fn pick(&mut self, except: Option<usize>) -> Option<usize> {
        let choices: Vec<usize> = (0..WORKERS).filter(|&r| Some(r) != except && self.running(r)).collect();
        (!choices.is_empty()).then(|| choices[self.rng.below(choices.len() as u64) as usize])
    }

    fn apply(&mut self, kind: &'static str, what: String) {
        let step = progress(&self.c).0;
        println!("[+{:6.1}s step {step:6}] {kind}: {what}", self.started.elapsed().as_secs_f64());
        self.applied.push(Applied { kind, what, at: Instant::now(), step });
    }

    fn kill(&mut self, rank: usize) {
        self.c.signal(rank, libc::SIGKILL);
    }

    /// One event of the schedule, drawn at random among those possible now.
    fn inject(&mut self) {
        let roll = self.rng.below(100);
        let partitions = self.net.is_some();
        match roll {
            0..=19 => {
                if let Some(r) = self.pick(Some(0)) {
                    self.kill(r);
                    self.apply("kill", format!("SIGKILL worker {r}"));
                }
            }
            20..=31 if self.running(0) => {
                self.kill(0);
                self.apply("kill chief", "SIGKILL worker 0 (TF_CONFIG's chief)".into());
            }
            32..=41 => {
                let Some(a) = self.pick(None) else { return };
                let Some(b) = self.pick(Some(a)) else { return };
                let gap = self.rng.seconds(0.05, 1.0);
                self.kill(a);
                self.c.idle(gap);
                self.kill(b);
                self.apply("two close", format!("SIGKILL worker {a}, then worker {b} {:.2}s later", gap.as_secs_f64()));
            }
            42..=53 if self.down.is_none() => {
                let Some(r) = self.pick(None) else { return };
                let secs = self.rng.seconds(1.0, 8.0);
                self.c.signal(r, libc::SIGSTOP);
                self.down = Some(r);
                self.pending.push((Instant::now() + secs, Undo::Cont(r)));
                self.apply("freeze", format!("SIGSTOP worker {r}, SIGCONT after {:.1}s", secs.as_secs_f64()));
            }
            54..=61 if self.down.is_none() => {
                let Some(r) = self.pick(None) else { return };
                let secs = self.rng.seconds(self.soak.hold.0, self.soak.hold.1);
                self.c.hold(r);
                self.kill(r);
                self.down = Some(r);
                self.pending.push((Instant::now() + secs, Undo::BringBack(r)));
                self.apply("hold down", format!("worker {r} killed and kept down for {:.0}s", secs.as_secs_f64()));
            }
            62..=77 if !partitions => {
                let Storage::S3 { link, .. } = &self.storage else { return };
                if self.pending.iter().any(|(_, u)| matches!(u, Undo::Restore)) {
                    return;
                }
                let secs = self.rng.seconds(2.0, 20.0);
                link.cut();
                self.pending.push((Instant::now() + secs, Undo::Restore));
                self.apply(
                    "S3 cut",
                    format!("the link to the checkpoints' S3 server cut for {:.1}s", secs.as_secs_f64()),
                );
            }
            62..=77 if self.down.is_none() => {
                let Some(r) = self.pick(None) else { return };
                let secs = self.rng.seconds(3.0, 12.0);
                self.net.as_ref().unwrap().cut(r);
                self.down = Some(r);
                self.pending.push((Instant::now() + secs, Undo::Heal(r)));
                self.apply("partition", format!("worker {r} cut off for {:.1}s", secs.as_secs_f64()));
            }
            78..=87 => {
                let Some(r) = self.pick(None) else { return };
                let n = 10 + self.rng.below(190);
                self.c.arm(r, vec![("TRAINERD_FAILPOINT".into(), format!("flip-bit@{n}"))]);
                self.kill(r);
                self.flipped.push(r);
                self.apply(
                    "bit flip",
                    format!("worker {r} restarted to flip a bit of its parameters after its step {n}"),
                );
            }
            _ => {}
        }
    }

    /// Carries out what is due.
    fn undo_due(&mut self, all: bool) {
        let now = Instant::now();
        let (due, later): (Vec<_>, Vec<_>) = self.pending.drain(..).partition(|(at, _)| all || *at <= now);
        self.pending = later;
        for (_, undo) in due {
            match undo {
                Undo::Cont(r) => {
                    self.c.signal(r, libc::SIGCONT);
                    self.down = None;
                }
                Undo::Restore => {
                    if let Storage::S3 { link, .. } = &self.storage {
                        link.restore();
                    }
                }
                Undo::BringBack(r) => {
                    self.c.bring_back(r);
                    self.down = None;
                    self.apply("return", format!("worker {r} brought back"));
                }
                Undo::Heal(r) => {
                    self.net.as_ref().unwrap().heal(r);
                    self.down = None;
                }
            }
        }
    }

    /// Fails on a hang: no new global step for [`HANG`] while nothing planned explains it.
    fn check_progress(&self) {
        let (step, at) = progress(&self.c);
        let waiting = self.pending.iter().any(|(_, u)| matches!(u, Undo::BringBack(_)));
        if !waiting && step > 0 && at.elapsed() > HANG {
            let tail: Vec<String> = self.c.transcript().lines().rev().take(80).map(String::from).collect();
            panic!(
                "hang: no new global step since step {step}, {:.0}s ago; the last lines:\n{}",
                at.elapsed().as_secs_f64(),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
    }

    /// Applies the schedule until the job is 85% done or the soak's time is up, then undoes
    /// everything and waits for the end.
    fn run(&mut self, total_steps: u64, until: Instant) {
        let mut next = Instant::now() + self.rng.seconds(3.0, 8.0);
        loop {
            self.c.idle(Duration::from_millis(100));
            self.undo_due(false);
            self.check_progress();
            let step = progress(&self.c).0;
            if step * 100 >= total_steps * 85 || Instant::now() >= until {
                break;
            }
            if Instant::now() >= next && step > 0 {
                self.inject();
                next = Instant::now() + self.rng.seconds(3.0, 10.0);
            }
        }
        // Whatever is still cut, frozen or held comes back.
        self.undo_due(true);
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(codes) = self.finished() {
                assert_eq!(codes, vec![0; WORKERS], "{}", self.c.transcript());
                return;
            }
            assert!(Instant::now() < deadline, "the round did not end within {DEADLINE:?}");
            self.c.idle(Duration::from_millis(200));
            self.check_progress_at_end();
        }
    }

    /// The workers' final statuses, once every one has exited for good.
    fn finished(&self) -> Option<Vec<i32>> {
        let mut codes = vec![None; WORKERS];
        for e in &self.c.seen {
            match e.what {
                What::Finished(code) => codes[e.worker] = Some(code),
                What::Restarted => codes[e.worker] = None,
                _ => {}
            }
        }
        codes.into_iter().collect()
    }

    /// At the end the workers may be done while the last ones leave: a hang is only no step and
    /// no exit for [`HANG`].
    fn check_progress_at_end(&self) {
        let last = self.c.seen.last().map_or(self.started, |e| e.at);
        assert!(last.elapsed() < HANG, "hang at the end: nothing for {HANG:?}\n{}", self.c.transcript());
    }
}

/// The longest time without a new global step from each event until the next one (a pause that
/// goes on past the next event is that one's from there: two events in one pause).
fn pauses(c: &Cluster, applied: &[Applied], end: Instant) -> Vec<f64> {
    let mut advances: Vec<Instant> = Vec::new();
    let mut best = 0;
    for e in &c.seen {
        if let Some(Event::Step { global_step, .. }) = e.event() {
            if *global_step > best {
                best = *global_step;
                advances.push(e.at);
            }
        }
    }
    (0..applied.len())
        .map(|i| {
            let (from, to) = (applied[i].at, applied.get(i + 1).map_or(end, |a| a.at));
            let mut longest = Duration::ZERO;
            for w in advances.windows(2) {
                if w[1] > from && w[0] < to {
                    longest = longest.max(w[1].min(to).saturating_duration_since(w[0].max(from)));
                }
            }
            longest.as_secs_f64()
        })
        .collect()
}

/// A failed round's transcript is kept too: a panic's message shows only its last lines.
impl Drop for Round<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("soak: round {}'s whole transcript: {}", self.number, self.keep_transcript().display());
        }
    }
}

/// What a round's transcript says of its steps trained again.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Counted {
    /// Steps trained again, as the formations reported them (each generation's once, whoever
    /// reported it), and of those the steps lost.
    reported: (u64, u64),
    /// Steps trained again, from the steps themselves: for each global step, the generations
    /// that trained it, less one.
    trained: u64,
    /// Of those, the ones whose earlier completion was held only by workers that died before the
    /// next formation or are not in it: the formation counts them when a beat or a join told a
    /// living coordinator (a killed chief takes the beats it heard with it, a worker killed before
    /// it joins again tells no one, and a worker cut off while the others form without it, the
    /// coordinator among them, tells the new coordinator nothing: its later join reports an older
    /// generation, which counts for nothing), so the formations' count may fall short of the
    /// transcript's by these.
    unheard: u64,
    /// Mismatches the comparisons found (each once: every member names it).
    repaired: usize,
    /// The steps lost that the transcript does not explain: a step is lost only where every
    /// worker that completed it died before the formation that lost it (two faults close
    /// together: the second kills the only holder of the furthest state), or where every member
    /// said it goes back to the last commit since the formation before (a sharded optimizer's
    /// ranges lost with their owner and buddy, or its replicas found to differ).
    unexplained: Vec<u64>,
}

/// A summary covers its process only, and most workers were restarted, so the transcript tells
/// what the round trained again.
fn counted(c: &Cluster) -> Counted {
    let mut reported = BTreeMap::new();
    let mut generation = [0u64; WORKERS];
    // Who completed each step in each generation (worker, where in the transcript), where each
    // generation formed (its first join), and where each worker died.
    let mut held_in: BTreeMap<(u64, u64), Vec<(usize, usize)>> = BTreeMap::new();
    let mut formed: BTreeMap<u64, usize> = BTreeMap::new();
    let mut members: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    let mut died: Vec<Vec<usize>> = vec![Vec::new(); WORKERS];
    let (mut unexplained, mut formed_at, mut went_back) = (Vec::new(), 0, 0);
    for (i, e) in c.seen.iter().enumerate() {
        // Every member going back to the last commit, or finding none (a sharded state lost).
        if e.line().is_some_and(|l| l.contains("trainerd: the optimizer state was sharded over generation ")) {
            went_back = i;
        }
        match (&e.what, e.event()) {
            (_, Some(Event::Joined { generation: g, global_step, steps_lost, steps_trained_again, .. })) => {
                generation[e.worker] = *g;
                formed.entry(*g).or_insert(i);
                members.entry(*g).or_default().push(e.worker);
                if reported.insert(*g, (*steps_trained_again, *steps_lost)).is_none() {
                    // Completed since the formation before this one, by workers all dead since.
                    let since = |&&(_, at): &&(usize, usize)| at > formed_at;
                    let dead = |&(w, at): &(usize, usize)| died[w].iter().any(|&d| at < d && d < i);
                    for lost in global_step + 1..=global_step + steps_lost {
                        let held: Vec<&(usize, usize)> =
                            held_in.range((lost, 0)..=(lost, u64::MAX)).flat_map(|(_, h)| h).filter(since).collect();
                        if went_back <= formed_at && (held.is_empty() || !held.into_iter().all(dead)) {
                            unexplained.push(lost);
                        }
                    }
                    formed_at = i;
                }
            }
            (_, Some(Event::Step { global_step, .. })) => {
                held_in.entry((*global_step, generation[e.worker])).or_default().push((e.worker, i));
            }
            (What::Died(_), _) => died[e.worker].push(i),
            _ => {}
        }
    }
    let found: std::collections::BTreeSet<&str> = c
        .seen
        .iter()
        .filter_map(|e| e.line()?.split_once("trainerd: replica check at step ")?.1.split_once(';').map(|(m, _)| m))
        .collect();
    // A generation's completion of a step that a later generation trained again, held only by
    // workers that died before the next formation, or that are not in it (cut off).
    let unheard = held_in
        .iter()
        .filter(|((step, g), held)| {
            let later = held_in.range((*step, g + 1)..=(*step, u64::MAX)).next().is_some();
            let next_formed = formed.range(g + 1..).next();
            let next = next_formed.map_or(usize::MAX, |(_, &at)| at);
            let absent = |w: usize| next_formed.is_some_and(|(n, _)| !members[n].contains(&w));
            later && held.iter().all(|&(w, at)| absent(w) || died[w].iter().any(|&d| at < d && d < next))
        })
        .count() as u64;
    let sum = |f: fn(&(u64, u64)) -> u64| reported.values().map(f).sum();
    // Each step once, and once more for each further generation that trained it.
    let steps: std::collections::BTreeSet<u64> = held_in.keys().map(|&(step, _)| step).collect();
    Counted {
        reported: (sum(|r| r.0), sum(|r| r.1)),
        trained: (held_in.len() - steps.len()) as u64,
        unheard,
        repaired: found.len(),
        unexplained,
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

#[test]
fn soak() {
    let soak = Soak::from_env();
    let mut rng = Rng(soak.seed);
    println!(
        "soak: {} minute(s), seed {}: rounds of 4 workers x {} epochs (linear, batch 16)",
        soak.minutes, soak.seed, soak.epochs
    );
    let (expected, steps) = reference(&soak);
    println!("soak: the failure-free run ends at step {steps} with params sha256 {expected}");
    let netns_works = Netns::create(1).is_ok();
    if !netns_works {
        println!("soak: no network namespaces here (needs root and ip): no partitions");
    }
    let began = Instant::now();
    let until = began + Duration::from_secs_f64(soak.minutes * 60.0);
    let mut rows: BTreeMap<&str, (Vec<f64>, usize)> = BTreeMap::new();
    let mut catch_ups = CatchUps::default();
    let (mut rounds, mut commits, mut repaired, mut lost, mut trained_again) = (0, 0, 0, 0, 0);
    let mut transcript = (0, 0);
    while rounds == 0 || Instant::now() < until {
        rounds += 1;
        let in_netns = netns_works && rounds % 2 == 0;
        let tmp = tempfile::tempdir().unwrap();
        let storage = if in_netns {
            Storage::Shared { dir: tmp.path().join("ckpt") }
        } else {
            let server = S3Server::start().unwrap_or_else(|e| panic!("S3-compatible test server: {e}"));
            let link = server.link().unwrap();
            Storage::S3 { server, link, prefix: format!("soak-{rounds}") }
        };
        let args = job(&soak, tmp.path())
            .checkpoints(storage.url(), 500)
            .set("--keep-checkpoints", 0)
            .set("--state-dir", tmp.path().join("state.{rank}").to_str().unwrap());
        // Every third round shards the optimizer state (with buddy copies), bit for bit the same.
        let sharded = rounds % 3 == 2;
        let args = if sharded { args.on("--shard-optimizer") } else { args };
        let (c, net) = if in_netns {
            let net = Netns::create(WORKERS).unwrap();
            let args = args.set("--secret-file", secret(tmp.path()).to_str().unwrap());
            (Cluster::start_in(&net, WORKERS, &args, RESTART_SEC), Some(net))
        } else {
            (Cluster::start(WORKERS, &args, &storage.env(), vec![], RESTART_SEC), None)
        };
        let how = match (in_netns, sharded) {
            (true, false) => "network namespaces, checkpoints in a shared directory",
            (true, true) => "network namespaces, checkpoints in a shared directory, --shard-optimizer",
            (false, false) => "loopback, checkpoints on S3",
            (false, true) => "loopback, checkpoints on S3, --shard-optimizer",
        };
        println!("soak: round {rounds} ({how})");
        let mut round = Round {
            soak: &soak,
            c,
            storage,
            net,
            rng: &mut rng,
            applied: Vec::new(),
            pending: Vec::new(),
            down: None,
            flipped: Vec::new(),
            started: Instant::now(),
            number: rounds,
        };
        round.run(steps, until);
        let end = Instant::now();
        let kept = round.keep_transcript();
        // A replica may differ only where a bit was flipped on purpose.
        for line in round.c.transcript().lines().filter(|l| l.contains("trainerd: replica check at step")) {
            println!("  {line}");
            let named = |r: &usize| [format!("the state of worker {r} ("), format!("the parameters of worker {r} (")];
            let flipped = round.flipped.iter().any(|r| named(r).iter().any(|n| line.contains(n.as_str())));
            assert!(flipped, "round {rounds}: a replica differed with no bit flipped in it: {line}");
        }
        for rank in 0..WORKERS {
            // A worker killed late and back after the others had ended trains nothing and writes
            // no summary: its last process must find the run finished at the failure-free run's
            // last step (the schedule stops at 85% of the steps, and a fast round trains the rest
            // within the restart delay).
            if let Some(at) = found_finished(&round.c.transcript(), rank) {
                assert_eq!(at, steps, "round {rounds}, worker {rank}\n{}", round.c.transcript());
                println!("  round {rounds}: worker {rank} came back after the run had finished at step {at}");
                continue;
            }
            let s = summary(tmp.path(), &format!("summary.{rank}.json"));
            assert_eq!(
                s["params_sha256"],
                expected.as_str(),
                "round {rounds}, worker {rank}\n{}",
                round.c.transcript()
            );
        }
        let verified = round.storage.verify_all();
        let counted = counted(&round.c);
        let ((again, l), r) = (counted.reported, counted.repaired);
        let (trained, unheard) = (counted.trained, counted.unheard);
        assert!(
            trained - unheard <= again && again <= trained,
            "round {rounds}: the formations reported {again} step(s) trained again, the transcript shows \
             {trained} ({unheard} of them completed only by workers killed before the next formation or absent from it)\n{}",
            round.c.transcript()
        );
        assert!(
            counted.unexplained.is_empty() && (again == l || r > 0),
            "round {rounds}: {l} step(s) lost ({:?} held by a worker that lived), {again} trained again with {r} \
             repair(s)\n{}",
            counted.unexplained,
            round.c.transcript()
        );
        let returns = CatchUps::of(&round.c.transcript());
        println!("  round {rounds}: {returns}");
        catch_ups.add(&returns);
        let found = pauses(&round.c, &round.applied, end);
        for (a, p) in round.applied.iter().zip(&found) {
            println!("  round {rounds} step {:6}  {:10}  {:60} pause {p:6.2}s", a.step, a.kind, a.what);
            let row = rows.entry(a.kind).or_default();
            row.0.push(*p);
            row.1 += 1;
        }
        println!(
            "soak: round {rounds} ended bitwise equal to the failure-free run on all {WORKERS} workers; {verified} \
             commits verified; {again} step(s) trained again by the formations' count, {trained} by the \
             transcript's ({unheard} of them completed only by workers killed before the next formation or absent from it, \
             which counts them only if it heard of them), {l} lost \
             (each held only by workers killed before the next formation); {r} replica mismatch(es) named and \
             repaired; transcript in {}",
            kept.display()
        );
        (commits, repaired, lost, trained_again) = (commits + verified, repaired + r, lost + l, trained_again + again);
        transcript = (transcript.0 + trained, transcript.1 + unheard);
    }
    println!(
        "\nsoak: seed {}, {:.1} minutes, {rounds} round(s), 0 hangs",
        soak.seed,
        began.elapsed().as_secs_f64() / 60.0
    );
    println!("| event | count | median pause | longest pause |");
    println!("|---|---|---|---|");
    for kind in KINDS {
        if let Some((p, n)) = rows.get_mut(kind) {
            let max = p.iter().copied().fold(0.0, f64::max);
            println!("| {kind} | {n} | {:.2} s | {max:.2} s |", median(p));
        }
    }
    println!("returns: {catch_ups}");
    println!(
        "every round bitwise equal to the failure-free run; {commits} commits verified; {trained_again} step(s) \
         trained again by the formations' count ({} by the transcript's, {} of them completed only by workers \
         killed before the next formation): {} for repairs, {lost} lost (each held only by workers killed \
         before the next formation); {repaired} corrupted replica(s) named and repaired",
        transcript.0,
        transcript.1,
        trained_again - lost
    );
}

/// What a transcript says of its returners' catch-ups (docs/fault-tolerance.md, "A return that
/// does not pause the survivors"): how many caught up and the steps they replayed, and why the
/// others took their slots back with a pause (the donor's reason, or the returner's when nobody
/// fed it), each reason with its count.
#[derive(Default)]
struct CatchUps {
    caught: usize,
    replayed: u64,
    paused: BTreeMap<String, usize>,
}

impl CatchUps {
    fn of(transcript: &str) -> CatchUps {
        let mut c = CatchUps::default();
        for line in transcript.lines() {
            if let Some(rest) = line.split_once("trainerd: caught up in ").map(|(_, r)| r) {
                c.caught += 1;
                let replayed = rest.split(" step(s) replayed").next().and_then(|h| h.rsplit(' ').next());
                c.replayed += replayed.and_then(|n| n.parse::<u64>().ok()).unwrap_or(0);
            }
            let why = line
                .split_once("trainerd: the catch-up stopped: ")
                .or_else(|| line.split_once("trainerd: no catch-up: "))
                .and_then(|(_, r)| r.rsplit_once("; joining with a pause"))
                .map(|(why, _)| why);
            if let Some(why) = why {
                // Sizes and steps vary: the reason's words are what is counted.
                let words: String = why
                    .split(' ')
                    .filter(|w| !w.starts_with(|c: char| c.is_ascii_digit()))
                    .collect::<Vec<_>>()
                    .join(" ");
                *c.paused.entry(words).or_default() += 1;
            }
        }
        c
    }

    fn add(&mut self, other: &CatchUps) {
        self.caught += other.caught;
        self.replayed += other.replayed;
        for (why, n) in &other.paused {
            *self.paused.entry(why.clone()).or_default() += n;
        }
    }
}

impl std::fmt::Display for CatchUps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let paused: usize = self.paused.values().sum();
        write!(
            f,
            "{} returner(s) caught up ({} step(s) replayed), {paused} took their slots back with a pause",
            self.caught, self.replayed
        )?;
        let whys: Vec<String> = self.paused.iter().map(|(why, n)| format!("{n}x {why}")).collect();
        if !whys.is_empty() {
            write!(f, " ({})", whys.join("; "))?;
        }
        Ok(())
    }
}

/// A cluster secret (the namespaces are not loopback).
fn secret(dir: &Path) -> std::path::PathBuf {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join("secret");
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).unwrap();
    std::io::Write::write_all(&mut f, b"6a1d2c3b4a5968778695a4b3c2d1e0f00112233445566778899aabbccddeeff").unwrap();
    path
}
