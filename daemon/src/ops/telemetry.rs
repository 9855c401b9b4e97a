//! [`Telemetry`]: what the training loop reports into, and what systemd ([`super::notify`]),
//! Prometheus ([`super::serve`]) and the journal read of it.
//!
//! Liveness is driven by training progress, not by a timer: each step moves a deadline one
//! stall period ahead ([`Telemetry::progress`]); a wait the daemon bounds itself (a rendezvous,
//! a re-formation, an evaluation, a final commit) moves it to the end of that bound
//! ([`Telemetry::waiting`]). A step that hangs lets the deadline pass: the watchdog pings stop,
//! `/healthz` answers 503, and systemd restarts the daemon.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Why the daemon counts as hung: no training progress, and no bounded wait, for this long.
#[derive(Clone, Copy, Debug, PartialEq, thiserror::Error)]
#[error("no training progress for {:.0}s", since.as_secs_f64())]
pub(crate) struct Stalled {
    /// Since the last progress.
    pub(crate) since: Duration,
}

type FloatGauge = Gauge<f64, AtomicU64>;
type Labels = Vec<(&'static str, String)>;

/// Every series `/metrics` serves.
struct Series {
    steps: Counter,
    examples: Counter,
    examples_per_second: FloatGauge,
    epoch: Gauge,
    global_step: Gauge,
    loss: Family<Labels, FloatGauge>,
    metric: Family<Labels, FloatGauge>,
    learning_rate: FloatGauge,
    allreduce_bytes: Counter,
    allreduce_seconds: Counter<f64, AtomicU64>,
    forward_backward_seconds: Counter<f64, AtomicU64>,
    exposed_seconds: Counter<f64, AtomicU64>,
    update_seconds: Counter<f64, AtomicU64>,
    commits: Counter,
    commit_seconds: Histogram,
    commit_bytes: Counter,
    commit_failures: Counter,
    failures: Counter,
    recoveries: Counter,
    steps_lost: Counter,
    steps_trained_again: Counter,
    recovery_seconds: Histogram,
    generation: Gauge,
    slots_held: Gauge,
    peers_up: Gauge,
    replica_checks: Counter,
    replica_mismatches: Family<Labels, Counter>,
}

impl Series {
    fn new() -> Series {
        Series {
            steps: Counter::default(),
            examples: Counter::default(),
            examples_per_second: FloatGauge::default(),
            epoch: Gauge::default(),
            global_step: Gauge::default(),
            loss: Family::default(),
            metric: Family::default(),
            learning_rate: FloatGauge::default(),
            allreduce_bytes: Counter::default(),
            allreduce_seconds: Counter::default(),
            forward_backward_seconds: Counter::default(),
            exposed_seconds: Counter::default(),
            update_seconds: Counter::default(),
            commits: Counter::default(),
            commit_seconds: Histogram::new(exponential_buckets(0.05, 2.0, 12)),
            commit_bytes: Counter::default(),
            commit_failures: Counter::default(),
            failures: Counter::default(),
            recoveries: Counter::default(),
            steps_lost: Counter::default(),
            steps_trained_again: Counter::default(),
            recovery_seconds: Histogram::new(exponential_buckets(0.1, 2.0, 12)),
            generation: Gauge::default(),
            slots_held: Gauge::default(),
            peers_up: Gauge::default(),
            replica_checks: Counter::default(),
            replica_mismatches: Family::default(),
        }
    }

    /// Every series, registered in `registry`.
    fn register(registry: &mut Registry) -> Series {
        let s = Series::new();
        s.register_training(registry);
        s.register_traffic_and_commits(registry);
        s.register_recovery(registry);
        s.register_integrity(registry);
        s
    }

    /// The replicas' comparisons.
    fn register_integrity(&self, r: &mut Registry) {
        r.register("trainerd_replica_checks", "Comparisons of every member's state", self.replica_checks.clone());
        r.register(
            "trainerd_replica_mismatches",
            "Comparisons in which this member's state differed from the agreed one, by member",
            self.replica_mismatches.clone(),
        );
    }

    /// Steps, examples, epoch, loss and metrics, learning rate.
    fn register_training(&self, r: &mut Registry) {
        r.register("trainerd_steps", "Optimizer steps this worker took", self.steps.clone());
        r.register(
            "trainerd_examples",
            "Training examples over all workers, as this worker counts them",
            self.examples.clone(),
        );
        r.register(
            "trainerd_examples_per_second",
            "Training throughput over all workers in the current epoch",
            self.examples_per_second.clone(),
        );
        r.register("trainerd_epoch", "Current epoch, from 1", self.epoch.clone());
        r.register("trainerd_global_step", "Global step of the state this worker holds", self.global_step.clone());
        r.register(
            "trainerd_loss",
            "Loss over all workers: the last step's (split=train), the last evaluation's (split=validation)",
            self.loss.clone(),
        );
        r.register("trainerd_metric", "The plugin's metrics, labelled as trainerd_loss", self.metric.clone());
        r.register("trainerd_learning_rate", "Learning rate of the last step", self.learning_rate.clone());
    }

    /// The all-reduce's traffic and the chief's commits.
    fn register_traffic_and_commits(&self, r: &mut Registry) {
        r.register("trainerd_allreduce_bytes", "Bytes this worker sent in all-reduces", self.allreduce_bytes.clone());
        r.register(
            "trainerd_allreduce_seconds",
            "Seconds this worker spent in all-reduces",
            self.allreduce_seconds.clone(),
        );
        r.register(
            "trainerd_step_forward_backward_seconds",
            "Seconds of the steps' forward and backward passes (divided by trainerd_steps: per step)",
            self.forward_backward_seconds.clone(),
        );
        r.register(
            "trainerd_step_exposed_communication_seconds",
            "Seconds from the steps' backward passes' end to their last reduction's end: the communication not hidden",
            self.exposed_seconds.clone(),
        );
        r.register("trainerd_step_update_seconds", "Seconds of the steps' updates", self.update_seconds.clone());
        r.register("trainerd_commits", "Checkpoints committed (chief)", self.commits.clone());
        r.register(
            "trainerd_commit_seconds",
            "Seconds from a commit's start to its record (chief)",
            self.commit_seconds.clone(),
        );
        r.register("trainerd_commit_bytes", "Bytes committed (chief)", self.commit_bytes.clone());
        r.register("trainerd_commit_failures", "Commits that failed (chief)", self.commit_failures.clone());
    }

    /// Failures, recoveries and membership.
    fn register_recovery(&self, r: &mut Registry) {
        r.register(
            "trainerd_failures_detected",
            "Generations this worker abandoned because a member failed",
            self.failures.clone(),
        );
        r.register(
            "trainerd_recoveries",
            "Generations formed again after a failure, with this worker",
            self.recoveries.clone(),
        );
        r.register("trainerd_steps_lost", "Steps the cluster lost in recoveries", self.steps_lost.clone());
        r.register(
            "trainerd_steps_trained_again",
            "Steps trained again after recoveries: those lost, and those a repair of a corrupted replica went back over",
            self.steps_trained_again.clone(),
        );
        r.register(
            "trainerd_recovery_seconds",
            "Seconds from a failure to the first step after it",
            self.recovery_seconds.clone(),
        );
        r.register(
            "trainerd_generation",
            "The cluster's current generation (0 before the first)",
            self.generation.clone(),
        );
        r.register(
            "trainerd_slots_held",
            "Slots (virtual ranks) this worker computes each step: more than 1 while workers are missing",
            self.slots_held.clone(),
        );
        r.register(
            "trainerd_peers_up",
            "Workers in the current generation, this one included (0 while the cluster re-forms)",
            self.peers_up.clone(),
        );
    }
}

/// What `STATUS=` shows.
#[derive(Clone, Debug, Default)]
struct Status {
    epoch: u32,
    epochs: u32,
    step: u64,
    steps: u64,
    loss: Option<f64>,
    generation: u64,
    peers: usize,
    world: usize,
    /// The slots this worker holds, when it holds more than one.
    slots: Option<String>,
    waiting: Option<String>,
}

impl Status {
    fn line(&self) -> String {
        let mut parts = Vec::new();
        if let Some(w) = &self.waiting {
            parts.push(w.clone());
        }
        if self.epoch > 0 {
            parts.push(format!("epoch {}/{}", self.epoch.min(self.epochs), self.epochs));
        }
        if self.steps > 0 {
            parts.push(format!("step {}/{}", self.step, self.steps));
        }
        if let Some(l) = self.loss {
            parts.push(format!("loss {l:.4}"));
        }
        if self.world > 1 {
            parts.push(format!("generation {}", self.generation));
            parts.push(format!("{}/{} workers", self.peers, self.world));
            if let Some(slots) = &self.slots {
                parts.push(slots.clone());
            }
        }
        if parts.is_empty() {
            "training".into()
        } else {
            parts.join(", ")
        }
    }
}

/// The daemon's health and figures, shared by the training loop (which writes them) and the
/// notifier and metrics server (which read them).
pub(crate) struct Telemetry {
    registry: Registry,
    series: Series,
    started: Instant,
    /// How long a step may take before the daemon counts as hung.
    stall: Duration,
    /// Milliseconds since `started` until which the daemon counts as alive.
    deadline_ms: AtomicU64,
    status: Mutex<Status>,
    ready: AtomicBool,
    stopping: AtomicBool,
    /// The all-reduce totals already added to the counters.
    traffic_seen: Mutex<(u64, f64)>,
}

impl Telemetry {
    /// Telemetry for a run of `epochs` epochs on `world` workers, hung after `stall` without
    /// progress.
    pub(crate) fn new(stall: Duration, epochs: u32, world: usize) -> Telemetry {
        let mut registry = Registry::default();
        let series = Series::register(&mut registry);
        let status = Status { epochs, world, ..Status::default() };
        let t = Telemetry {
            registry,
            series,
            started: Instant::now(),
            stall,
            deadline_ms: AtomicU64::new(0),
            status: Mutex::new(status),
            ready: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            traffic_seen: Mutex::new((0, 0.0)),
        };
        t.waiting("starting", Duration::from_secs(3600));
        t
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn status(&self) -> std::sync::MutexGuard<'_, Status> {
        self.status.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Training made progress: alive for another stall period.
    pub(crate) fn progress(&self) {
        self.deadline_ms.store(self.now_ms() + self.stall.as_millis() as u64, Ordering::Relaxed);
        self.status().waiting = None;
    }

    /// A wait the daemon bounds itself, at most `bound` long: alive until then.
    pub(crate) fn waiting(&self, what: &str, bound: Duration) {
        let until = self.now_ms() + (bound + self.stall).as_millis() as u64;
        self.deadline_ms.store(until, Ordering::Relaxed);
        self.status().waiting = Some(what.to_string());
    }

    /// `Ok` while the daemon makes progress or waits within a bound; otherwise why not.
    pub(crate) fn healthy(&self) -> Result<(), Stalled> {
        let (now, deadline) = (self.now_ms(), self.deadline_ms.load(Ordering::Relaxed));
        if now <= deadline {
            return Ok(());
        }
        Err(Stalled { since: Duration::from_millis(now - deadline) + self.stall })
    }

    /// Whether the worker has joined its cluster (once true, stays true).
    pub(crate) fn ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// The daemon is shutting down (a signal, or the end of the run).
    pub(crate) fn set_stopping(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }

    /// Whether the daemon is shutting down.
    pub(crate) fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }

    /// A generation formed with `world` workers, this one in it holding `held` slots, `slots` as
    /// people read them (`slots 0-1`).
    pub(crate) fn joined(&self, generation: u64, world: usize, (held, slots): (usize, String)) {
        self.series.generation.set(generation as i64);
        self.series.peers_up.set(world as i64);
        self.series.slots_held.set(held as i64);
        {
            let mut s = self.status();
            s.generation = generation;
            s.peers = world;
            s.slots = (held > 1).then_some(slots);
        }
        self.progress();
        self.ready.store(true, Ordering::Relaxed);
    }

    /// This worker abandoned a generation because of `why`; it re-forms within `bound`.
    pub(crate) fn abandoned(&self, why: &str, bound: Duration) {
        self.series.failures.inc();
        self.series.peers_up.set(0);
        self.status().peers = 0;
        self.waiting(&format!("re-forming: {why}"), bound);
    }

    /// The members compared their states.
    pub(crate) fn replica_checked(&self) {
        self.series.replica_checks.inc();
    }

    /// `member`'s state differed from the agreed one.
    pub(crate) fn replica_mismatch(&self, member: &str) {
        self.series.replica_mismatches.get_or_create(&vec![("member", member.to_string())]).inc();
    }

    /// A recovery finished: its first step is done; it lost and trained again `steps`.
    pub(crate) fn recovered(&self, (lost, again): (u64, u64), seconds: f64) {
        self.series.recoveries.inc();
        self.series.steps_lost.inc_by(lost);
        self.series.steps_trained_again.inc_by(again);
        self.series.recovery_seconds.observe(seconds);
    }

    /// A step finished.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn step(
        &self,
        (epoch, step, steps): (u32, u64, u64),
        global_step: u64,
        named: &[(String, f64)],
        examples: f64,
        examples_per_second: f64,
        lr: f64,
    ) {
        let s = &self.series;
        s.steps.inc();
        s.examples.inc_by(examples as u64);
        s.examples_per_second.set(examples_per_second);
        s.epoch.set(i64::from(epoch) + 1);
        s.global_step.set(global_step as i64);
        s.learning_rate.set(lr);
        self.values("train", named);
        {
            let mut st = self.status();
            (st.epoch, st.step, st.steps) = (epoch + 1, step, steps);
            st.loss = named.iter().find(|(n, _)| n == "loss").map(|(_, v)| *v);
        }
        self.progress();
    }

    /// A step's forward and backward passes took `compute`, its communication left `exposed`
    /// after them, its update `update`.
    pub(crate) fn step_times(&self, compute: Duration, exposed: Duration, update: Duration) {
        let s = &self.series;
        s.forward_backward_seconds.inc_by(compute.as_secs_f64());
        s.exposed_seconds.inc_by(exposed.as_secs_f64());
        s.update_seconds.inc_by(update.as_secs_f64());
    }

    /// The all-reduces have sent `bytes` and taken `seconds` so far (the session's totals).
    pub(crate) fn traffic(&self, (bytes, seconds): (u64, f64)) {
        let s = &self.series;
        let mut seen = self.traffic_seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        s.allreduce_bytes.inc_by(bytes.saturating_sub(seen.0));
        s.allreduce_seconds.inc_by((seconds - seen.1).max(0.0));
        *seen = (bytes, seconds);
    }

    /// An evaluation's values (`loss`, then the metrics, unprefixed).
    pub(crate) fn evaluated(&self, named: &[(String, f64)]) {
        self.values("validation", named);
    }

    fn values(&self, split: &str, named: &[(String, f64)]) {
        for (name, value) in named {
            let labels = |extra: Option<&str>| {
                let mut l: Labels = vec![("split", split.to_string())];
                if let Some(n) = extra {
                    l.insert(0, ("name", n.to_string()));
                }
                l
            };
            if name == "loss" {
                self.series.loss.get_or_create(&labels(None)).set(*value);
            } else {
                self.series.metric.get_or_create(&labels(Some(name))).set(*value);
            }
        }
    }

    /// The chief committed `bytes` in `seconds`.
    pub(crate) fn committed(&self, seconds: f64, bytes: u64) {
        self.series.commits.inc();
        self.series.commit_seconds.observe(seconds);
        self.series.commit_bytes.inc_by(bytes);
    }

    /// A commit failed.
    pub(crate) fn commit_failed(&self) {
        self.series.commit_failures.inc();
    }

    /// The `STATUS=` line.
    pub(crate) fn status_line(&self) -> String {
        self.status().line()
    }

    /// Every series in the OpenMetrics text format.
    pub(crate) fn encode(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).expect("writing to a String");
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_keeps_the_daemon_alive_for_one_stall_period_and_bounded_waits_for_their_bound() {
        let t = Telemetry::new(Duration::from_millis(100), 2, 2);
        t.joined(3, 2, (1, "slot 1".into()));
        assert_eq!(t.healthy(), Ok(()));
        std::thread::sleep(Duration::from_millis(250));
        assert!(t.healthy().unwrap_err().to_string().starts_with("no training progress for "));
        t.waiting("re-forming", Duration::from_millis(300));
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(t.healthy(), Ok(()), "a bounded wait is alive");
        t.step((0, 5, 10), 5, &[("loss".into(), 0.5), ("accuracy".into(), 0.75)], 64.0, 1000.0, 0.01);
        assert_eq!(t.status_line(), "epoch 1/2, step 5/10, loss 0.5000, generation 3, 2/2 workers");
        let short = Telemetry::new(Duration::from_millis(100), 2, 3);
        short.joined(4, 2, (2, "slots 0-1".into()));
        assert_eq!(short.status_line(), "generation 4, 2/3 workers, slots 0-1");
        assert!(short.encode().contains("trainerd_slots_held 2"));
        let text = t.encode();
        for line in [
            "trainerd_steps_total 1",
            "trainerd_loss{split=\"train\"} 0.5",
            "trainerd_metric{name=\"accuracy\",split=\"train\"} 0.75",
            "trainerd_generation 3",
            "trainerd_peers_up 2",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
    }

    #[test]
    fn a_member_whose_state_differed_is_named_in_the_metrics() {
        let t = Telemetry::new(Duration::from_secs(60), 2, 3);
        t.replica_checked();
        t.replica_checked();
        t.replica_mismatch("worker 2 (127.0.0.1:7002)");
        let text = t.encode();
        for line in [
            "trainerd_replica_checks_total 2",
            "trainerd_replica_mismatches_total{member=\"worker 2 (127.0.0.1:7002)\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
    }
}
