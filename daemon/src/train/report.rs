//! Everything a run tells the outside, in one owner: the progress lines (Keras-style), the metrics
//! log, TensorBoard (on the chief), the telemetry that systemd and Prometheus read, and the
//! lifecycle events a supervisor reads. The loop calls one hook per thing that happened (resumed,
//! joined, a step, an epoch's end, abandoned, committed...); each hook decides what every sink
//! shows. It also keeps the run's own figures: throughput and the recovery counts of the summary.
//!
//! Reporting never stops training, except for the metrics log the user asked for: a TensorBoard
//! failure is reported once and ends TensorBoard's output; a failing events channel is dropped.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use trainerd_sdk::{Columns, LrSchedule, PluginInfo};

use super::config::RunConfig;
use super::error::TrainError;
use super::summary::{Recovery, StepPhases};
use crate::checkpoint::Finished;
use crate::events::{Event, Events};
use crate::ops::progress::{with_perplexity, Progress};
use crate::ops::tensorboard::TensorBoard;
use crate::ops::Telemetry;
use crate::state::{Position, Totals};

/// A file of one JSON object per line, appended to: the metrics log (`--metrics-log`) and the
/// example ids (`--log-examples`), a line per step.
struct JsonLines {
    path: PathBuf,
    out: std::io::BufWriter<std::fs::File>,
}

impl JsonLines {
    fn open(path: &PathBuf) -> Result<JsonLines, TrainError> {
        let file = std::fs::OpenOptions::new().create(true).append(true).open(path);
        let file = file.map_err(|source| TrainError::Io { path: path.clone(), source })?;
        Ok(JsonLines { path: path.clone(), out: std::io::BufWriter::new(file) })
    }

    fn write(&mut self, line: &serde_json::Value) -> Result<(), TrainError> {
        writeln!(self.out, "{line}")
            .and_then(|()| self.out.flush())
            .map_err(|source| TrainError::Io { path: self.path.clone(), source })
    }
}

/// Host time per step, by phase, over an epoch (`TRAINERD_LOG=trainerd=debug` shows it).
#[derive(Clone, Copy, Default)]
struct Phases {
    steps: u32,
    /// Forward, loss, backward, waiting for the device, the all-reduce (the prefetch excluded).
    step: Duration,
    /// Making the next batch and queueing its copy to the device.
    prefetch: Duration,
    optimizer: Duration,
    /// Every slot's forward and backward pass.
    forward_backward: Duration,
    /// From the backward pass's end to the last reduction's end.
    exposed: Duration,
}

impl Phases {
    fn add(&mut self, other: Phases) {
        self.steps += other.steps;
        (self.step, self.prefetch, self.optimizer) =
            (self.step + other.step, self.prefetch + other.prefetch, self.optimizer + other.optimizer);
        (self.forward_backward, self.exposed) =
            (self.forward_backward + other.forward_backward, self.exposed + other.exposed);
    }

    /// Milliseconds per step of each phase, as the summary gives them.
    fn per_step(&self) -> StepPhases {
        let per = |d: Duration| d.as_secs_f64() * 1e3 / f64::from(self.steps.max(1));
        StepPhases {
            steps: self.steps,
            compute_ms: per(self.step),
            next_batch_ms: per(self.prefetch),
            optimizer_ms: per(self.optimizer),
            forward_backward_ms: per(self.forward_backward),
            exposed_communication_ms: per(self.exposed),
        }
    }

    fn report(self, epoch: u32) {
        let per = |d: Duration| d.as_secs_f64() * 1e6 / f64::from(self.steps.max(1));
        tracing::debug!(
            "epoch {}: {} steps; per step: {:.0} us forward+backward+all-reduce, {:.0} us next batch, {:.0} us optimizer",
            epoch + 1,
            self.steps,
            per(self.step),
            per(self.prefetch),
            per(self.optimizer)
        );
    }
}

/// The run's clock: the epoch shown, and the time and examples of training steps.
#[derive(Default)]
struct Clock {
    shown_epoch: Option<u32>,
    epoch_time: Duration,
    epoch_examples: f64,
    train_time: Duration,
    examples: f64,
    phases: Phases,
    /// The phases of every epoch done.
    run_phases: Phases,
}

impl Clock {
    /// Training examples per second in the current epoch.
    fn epoch_rate(&self) -> f64 {
        self.epoch_examples / self.epoch_time.as_secs_f64().max(1e-9)
    }
}

/// A recovery whose first step is not done yet.
struct Recovering {
    since: Instant,
    generation: u64,
    step: u64,
    /// Steps lost, and steps trained again.
    steps: (u64, u64),
}

/// A step just done, as the hooks see it.
pub(crate) struct StepDone<'t> {
    /// The epoch (0-based).
    pub(crate) epoch: u32,
    /// The step in the epoch (1-based).
    pub(crate) step: u64,
    /// Steps in the epoch.
    pub(crate) steps_per_epoch: u64,
    /// Where training stands after it.
    pub(crate) position: &'t Position,
    /// Its totals over every worker.
    pub(crate) totals: &'t Totals,
    /// The learning rate it used.
    pub(crate) lr: f64,
    /// The averaged gradient's global 2-norm before clipping (with `--clip-norm`/`--clip-value`).
    pub(crate) grad_norm: Option<f64>,
    /// The whole step (forward, backward, all-reduce, the prefetch included, and the update), of
    /// which making the next batch, and of which the optimizer's update.
    pub(crate) timing: (Duration, Duration, Duration),
    /// Of the step before its update: the forward and backward passes, and the exposed
    /// communication.
    pub(crate) times: super::step::StepTimes,
    /// This worker's example ids, when the data has them.
    pub(crate) ids: Option<&'t [crate::input::ExampleId]>,
    /// Bytes this worker's all-reduces have sent, and seconds they took, so far.
    pub(crate) traffic: (u64, f64),
}

/// A generation this worker is in, as the hooks see it.
pub(crate) struct JoinedGeneration<'n> {
    /// Its number.
    pub(crate) generation: u64,
    /// This worker's rank.
    pub(crate) rank: usize,
    /// Slots of the run (every training task of TF_CONFIG).
    pub(crate) workers: usize,
    /// Workers in it.
    pub(crate) present: usize,
    /// Who holds which slots, when some worker holds more than one (`worker 0: slots 0-1, ...`).
    pub(crate) layout: Option<String>,
    /// The global step it continues from.
    pub(crate) global_step: u64,
    /// A generation had formed before.
    pub(crate) recovery: bool,
    /// Steps lost, and steps trained again (those lost, and those a repair went back over).
    pub(crate) steps: (u64, u64),
    /// Whom the state came from (its rank and name), when some member received it.
    pub(crate) source: Option<(usize, &'n str)>,
}

/// Where a run's outputs go: the progress lines, the telemetry, the lifecycle events.
pub(crate) struct Outputs<'p> {
    /// Progress and messages (standard output).
    pub(crate) progress: &'p mut Progress,
    /// What systemd and Prometheus see.
    pub(crate) telemetry: Arc<Telemetry>,
    /// What a supervisor reads.
    pub(crate) events: Events,
}

/// The one owner of a run's outputs.
pub(crate) struct Reporter<'p> {
    progress: &'p mut Progress,
    telemetry: Arc<Telemetry>,
    events: Events,
    metrics_log: Option<JsonLines>,
    examples_log: Option<JsonLines>,
    tensorboard: Option<TensorBoard>,
    metric_names: Vec<String>,
    /// Tokens in an example, when the model reads a token column: the lines then show tokens/s.
    tokens_per_example: Option<u32>,
    /// The loss is a language model's: the lines show its perplexity.
    perplexity: bool,
    epochs: u32,
    schedule_moves: bool,
    /// Bounds of the waits the telemetry reports.
    rejoin: Duration,
    collective: Duration,
    clock: Clock,
    recovery: Recovery,
    /// Whether the current generation is short of workers, and the (examples, seconds) trained
    /// short and full.
    short: bool,
    trained: [(f64, f64); 2],
    /// When this worker abandoned its last step (a recovery's time counts from there).
    interrupted_at: Option<Instant>,
    recovering: Option<Recovering>,
}

impl<'p> Reporter<'p> {
    /// The outputs of a run with `cfg` on a worker that is the chief or not; opens the metrics
    /// log and (on the chief) TensorBoard's event files.
    pub(crate) fn open(
        cfg: &RunConfig,
        info: &PluginInfo,
        chief: bool,
        Outputs { progress, telemetry, events }: Outputs<'p>,
    ) -> Result<Reporter<'p>, TrainError> {
        let tensorboard = match (&cfg.tensorboard_dir, chief) {
            (Some(dir), true) => {
                let tb = TensorBoard::create(dir, cfg.tensorboard_every)
                    .map_err(|source| TrainError::Io { path: dir.clone(), source })?;
                progress.line(&format!("trainerd: TensorBoard events in {}", dir.display()));
                Some(tb)
            }
            _ => None,
        };
        let metrics_log = cfg.metrics_log.as_ref().map(JsonLines::open).transpose()?;
        let examples_log = cfg.log_examples.as_ref().map(JsonLines::open).transpose()?;
        Ok(Reporter {
            progress,
            telemetry,
            events,
            metrics_log,
            examples_log,
            tensorboard,
            metric_names: info.metrics.clone(),
            tokens_per_example: info.columns.as_ref().and_then(Columns::tokens_per_example),
            perplexity: info.language_model,
            epochs: cfg.epochs,
            schedule_moves: cfg.schedule != LrSchedule::Constant
                || cfg.warmup.is_some()
                || cfg.callbacks.reduce_lr_on_plateau.is_some(),
            rejoin: cfg.timeouts.rejoin,
            collective: cfg.timeouts.collective,
            clock: Clock::default(),
            recovery: Recovery::default(),
            short: false,
            trained: [(0.0, 0.0); 2],
            interrupted_at: None,
            recovering: None,
        })
    }

    /// A line as it is.
    pub(crate) fn line(&mut self, text: &str) {
        self.progress.line(text);
    }

    /// The members compared their states.
    pub(crate) fn replica_checked(&self) {
        self.telemetry.replica_checked();
    }

    /// Their states differed: `line` tells it, `members` differed.
    pub(crate) fn replica_mismatch(&mut self, line: &str, members: &[String]) {
        for m in members {
            self.telemetry.replica_mismatch(m);
        }
        self.line(line);
    }

    /// A wait the daemon bounds itself (systemd and `/healthz` see it alive until `bound`).
    pub(crate) fn waiting(&self, what: &str, bound: Duration) {
        self.telemetry.waiting(what, bound);
    }

    /// A wait bounded by the rejoin deadline (the cluster gathering, a commit, a barrier).
    pub(crate) fn waiting_for_cluster(&self, what: &str) {
        self.telemetry.waiting(what, self.rejoin);
    }

    /// The chief restored commit `sequence` from `location`.
    pub(crate) fn resumed(&mut self, sequence: u64, location: &str, position: &Position) {
        let (epoch, step, global_step) = (position.epoch, position.step_in_epoch, position.global_step);
        self.progress.line(&if epoch >= self.epochs {
            format!("trainerd: checkpoint {sequence} in {location} is the end of this run (global step {global_step})")
        } else {
            format!(
                "trainerd: resumed from checkpoint {sequence} in {location} at epoch {}, step {step} (global step \
                 {global_step})",
                epoch + 1
            )
        });
        self.events.emit(Event::Resumed { sequence, epoch, step_in_epoch: step, global_step });
    }

    /// Generation `generation` formed with `workers` workers, this one in it holding the slots
    /// `held` (systemd's readiness, the metrics).
    pub(crate) fn formed(&self, generation: u64, workers: usize, held: &crate::collective::Slots) {
        let described = crate::collective::slots::describe(held.count, &held.held);
        self.telemetry.joined(generation, workers, (held.len(), described));
    }

    /// This worker is admitted to generation `g` and trains from here; `started` is when this
    /// process started (a restarted worker's recovery counts from there).
    pub(crate) fn joined(&mut self, g: &JoinedGeneration<'_>, started: Instant) {
        self.events.emit(Event::Joined {
            generation: g.generation,
            rank: g.rank,
            workers: g.workers,
            global_step: g.global_step,
            recovery: g.recovery,
            steps_lost: g.steps.0,
            steps_trained_again: g.steps.1,
            source: g.source.map(|(rank, _)| rank),
            present: (g.present < g.workers).then_some(g.present),
            layout: g.layout.clone(),
        });
        self.short = g.present < g.workers;
        if g.workers == 1 {
            return;
        }
        let (world, generation, step) = (g.workers, g.generation, g.global_step);
        let short = match &g.layout {
            Some(layout) => {
                format!("; {} of {world} workers ({layout}; {:.2}x speed)", g.present, g.present as f64 / world as f64)
            }
            None => String::new(),
        };
        if !g.recovery {
            self.progress.line(&if g.rank == 0 {
                format!("trainerd: {} worker(s) joined (generation {generation}{short})", g.present)
            } else {
                format!("trainerd: joined as worker {} of {world} (generation {generation}{short})", g.rank)
            });
            return;
        }
        let source = match g.source {
            None => "every member held it".to_string(),
            Some((_, name)) => format!("from {name} (sha256 verified)"),
        };
        let (lost, again) = g.steps;
        let repaired = if again > lost { " (a corrupted replica repaired)" } else { "" };
        self.progress.line(&format!(
            "trainerd: generation {generation} formed at step {step}: {lost} step(s) lost, {again} trained \
             again{repaired}; state {source}{short}"
        ));
        self.recovery.recoveries += 1;
        self.recovery.steps_lost += lost;
        self.recovery.steps_trained_again += again;
        let since = self.interrupted_at.take().unwrap_or(started);
        self.recovering = Some(Recovering { since, generation, step, steps: g.steps });
    }

    /// The generation ended after global step `step` at a boundary every member learned from the
    /// step's all-reduce (`why`: a worker came back); nothing was abandoned. The pause until the
    /// next generation's first step counts from here.
    pub(crate) fn generation_ends(&mut self, step: u64, generation: u64, why: &str) {
        self.interrupted_at.get_or_insert_with(Instant::now);
        self.progress.line(&format!("trainerd: generation {generation} ends after step {step}: {why}; rejoining"));
        self.events.emit(Event::Ended { generation, step, reason: why.to_string() });
    }

    /// Step `step` (1-based, global) of `generation` was abandoned because of `why`.
    pub(crate) fn abandoned(&mut self, step: u64, generation: u64, why: &str) {
        self.recovery.failures_seen += 1;
        self.telemetry.abandoned(why, self.rejoin);
        self.interrupted_at.get_or_insert_with(Instant::now);
        self.progress.line(&format!(
            "trainerd: step {step} abandoned (generation {generation}): {why}; waiting for the cluster to re-form"
        ));
        self.events.emit(Event::Abandoned { generation, step, reason: why.to_string() });
    }

    /// This process caught up, replaying `replayed` steps, `took` after its start's catch-up began.
    pub(crate) fn caught_up(&mut self, replayed: u64, since_start: std::time::Duration) {
        self.recovery.steps_replayed += replayed;
        self.recovery.catch_up_seconds = Some(since_start.as_secs_f64());
    }

    /// This process fed a returner's catch-up, keeping at most `peak` bytes of outputs at once.
    pub(crate) fn served_catch_up(&mut self, peak: u64) {
        self.recovery.catch_up_kept_bytes = self.recovery.catch_up_kept_bytes.max(peak);
    }

    /// Training is in `epoch` (0-based): its header, once.
    pub(crate) fn epoch(&mut self, epoch: u32) {
        if self.clock.shown_epoch != Some(epoch) {
            self.progress.epoch_start(epoch, self.epochs);
            let c = &mut self.clock;
            (c.shown_epoch, c.epoch_time, c.epoch_examples) = (Some(epoch), Duration::ZERO, 0.0);
        }
    }

    /// A step is done: the telemetry, TensorBoard, a recovery's report, the metrics log, the
    /// event. The progress line comes with [`Reporter::step_line`].
    pub(crate) fn step(&mut self, s: &StepDone<'_>) -> Result<(), TrainError> {
        let (c, (took, prefetch, optimizer)) = (&mut self.clock, s.timing);
        c.phases.steps += 1;
        c.phases.forward_backward += s.times.compute;
        c.phases.exposed += s.times.exposed;
        self.telemetry.step_times(s.times.compute, s.times.exposed, optimizer);
        c.phases.step += took.saturating_sub(prefetch + optimizer);
        c.phases.prefetch += prefetch;
        c.phases.optimizer += optimizer;
        let examples = s.totals.examples();
        (c.epoch_time, c.train_time) = (c.epoch_time + took, c.train_time + took);
        c.epoch_examples += examples;
        c.examples += examples;
        let t = &mut self.trained[usize::from(self.short)];
        (t.0, t.1) = (t.0 + examples, t.1 + took.as_secs_f64());
        let global_step = s.position.global_step;
        let mut named = s.totals.named(&self.metric_names, "");
        named.extend(s.grad_norm.map(|n| ("grad_norm".to_string(), n)));
        let rate = self.clock.epoch_rate();
        self.telemetry.traffic(s.traffic);
        self.telemetry.step((s.epoch, s.step, s.steps_per_epoch), global_step, &named, examples, rate, s.lr);
        let lr = ("learning_rate".to_string(), s.lr);
        self.tensorboard(|tb| tb.step(global_step, &[&named[..], &[lr]].concat()));
        self.recovered();
        self.log_step(s)?;
        self.events.emit(Event::Step { epoch: s.epoch, step: s.step, global_step });
        Ok(())
    }

    /// The step's progress line, when the progress wants one (computing it waits for the
    /// device).
    pub(crate) fn step_line(&mut self, s: &StepDone<'_>) {
        if self.progress.wants(s.step, s.steps_per_epoch) {
            let mut values = self.shown(s.position.totals.named(&self.metric_names, ""));
            if self.schedule_moves {
                // The rate this step used, as the epoch line shows the last one's.
                values.push(("learning_rate".into(), s.lr));
            }
            self.progress.step(s.step, s.steps_per_epoch, self.clock.epoch_time, &values);
        }
    }

    /// What generation `generation`'s backend built beside its ring (`what`) was ready `took`
    /// after its creation began.
    pub(crate) fn backend_ready(&mut self, generation: u64, what: &str, took: std::time::Duration) {
        self.recovery.communicator_seconds.push(took.as_secs_f64());
        self.progress.line(&format!(
            "trainerd: generation {generation}: {what} ready {:.2}s after it was started (alongside the state \
             transfer)",
            took.as_secs_f64()
        ));
    }

    /// The first step of a recovery is done: how long it took since the failure.
    fn recovered(&mut self) {
        let Some(r) = self.recovering.take() else { return };
        let took = r.since.elapsed().as_secs_f64();
        tracing::debug!("recovery: first step done after {took:.3}s");
        self.recovery.recovery_seconds.push(took);
        let (lost, again) = r.steps;
        self.telemetry.recovered(r.steps, took);
        self.progress.line(&format!(
            "trainerd: recovered at step {} (generation {}): {lost} step(s) lost, {again} trained again, {took:.2}s",
            r.step, r.generation
        ));
        self.events.emit(Event::Recovered {
            generation: r.generation,
            global_step: r.step,
            steps_lost: lost,
            steps_trained_again: again,
            seconds: took,
        });
    }

    fn log_step(&mut self, s: &StepDone<'_>) -> Result<(), TrainError> {
        if let (Some(log), Some(ids)) = (self.examples_log.as_mut(), s.ids) {
            let line = serde_json::json!({
                "epoch": s.epoch,
                "step": s.step,
                "global_step": s.position.global_step,
                "ids": ids,
            });
            log.write(&line)?;
        }
        let Some(log) = self.metrics_log.as_mut() else { return Ok(()) };
        let time = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let p = s.position;
        let mut line = serde_json::json!({
            "time": time,
            "epoch": p.epoch,
            "step": p.step_in_epoch,
            "global_step": p.global_step,
            "lr": s.lr,
        });
        for (name, value) in s.totals.named(&self.metric_names, "") {
            line[name] = value.into();
        }
        if let Some(norm) = s.grad_norm {
            line["grad_norm"] = norm.into();
        }
        log.write(&line)
    }

    /// The test split is being evaluated after `epoch` (0-based).
    pub(crate) fn evaluating(&self, epoch: u32) {
        self.telemetry.waiting(&format!("evaluating epoch {}", epoch + 1), self.collective);
    }

    /// `epoch` (0-based) is done, with `train` its totals and `eval` the evaluation's, its last
    /// step at `lr`; `global_step` steps done.
    pub(crate) fn epoch_end(
        &mut self,
        (epoch, global_step, steps): (u32, u64, u64),
        totals: &Totals,
        eval: Option<&Totals>,
        lr: f64,
    ) {
        let train = totals.named(&self.metric_names, "");
        let validation = eval.map(|e| e.named(&self.metric_names, "")).unwrap_or_default();
        self.telemetry.evaluated(&validation);
        self.telemetry.progress();
        let rate = self.clock.epoch_rate();
        let mut values = self.shown(crate::state::epoch_figures(&self.metric_names, totals, eval));
        if self.schedule_moves {
            // The rate the epoch's last step used (what Keras's PrintLR shows at the epoch's end).
            values.push(("learning_rate".into(), lr));
        }
        let mut scalars = train;
        scalars.extend([("learning_rate".to_string(), lr), ("examples_per_second".to_string(), rate)]);
        self.tensorboard(|tb| tb.epoch((epoch, global_step), &scalars, &validation));
        let phases = std::mem::take(&mut self.clock.phases);
        self.clock.run_phases.add(phases);
        phases.report(epoch);
        let tokens = self.tokens_per_example.map(|t| rate * f64::from(t));
        self.progress.epoch_end(steps, self.clock.epoch_time, &values, (rate, tokens));
    }

    /// `values` as the lines show them: a language model's perplexity after each loss.
    fn shown(&self, values: Vec<(String, f64)>) -> Vec<(String, f64)> {
        if self.perplexity {
            return with_perplexity(values);
        }
        values
    }

    /// The chief waits for its commit to `location`.
    pub(crate) fn committing(&self, location: &str) {
        // The store retries a failing request within a bounded policy; the rejoin deadline
        // bounds the wait well beyond it.
        self.waiting_for_cluster(&format!("committing to {location}"));
    }

    /// A commit to `location` finished.
    pub(crate) fn commit_finished(&mut self, location: &str, finished: &Finished) {
        match finished {
            Finished::Committed { sequence, step, bytes, seconds } => {
                self.telemetry.committed(*seconds, *bytes);
                self.progress.line(&format!(
                    "checkpoint {sequence} committed to {location} (step {step}, {:.1} MB, {seconds:.2}s)",
                    *bytes as f64 / 1e6
                ));
                self.events.emit(Event::Committed { sequence: *sequence, global_step: *step });
            }
            Finished::Failed { message, .. } => {
                tracing::error!("{message}");
                self.telemetry.commit_failed();
                self.progress.line(&format!("warning: {message}; training goes on, the last good commit stays"));
            }
        }
    }

    /// Writes to TensorBoard; a failure is reported once and ends the TensorBoard output.
    fn tensorboard(&mut self, write: impl FnOnce(&mut TensorBoard) -> std::io::Result<()>) {
        let Some(tb) = self.tensorboard.as_mut() else { return };
        if let Err(e) = write(tb) {
            let dir = tb.dir().display().to_string();
            self.tensorboard = None;
            self.progress.line(&format!("warning: TensorBoard events in {dir}: {e}; no more events are written"));
        }
    }

    /// The run is over: closes the metrics log; (examples per second, seconds of training
    /// steps, failures and recoveries) for the summary.
    pub(crate) fn finish(mut self) -> (f64, f64, Recovery, StepPhases) {
        self.metrics_log.take();
        let c = &self.clock;
        let rate = |(examples, seconds): (f64, f64)| (seconds > 0.0).then(|| examples / seconds);
        self.recovery.seconds_short = self.trained[1].1;
        self.recovery.examples_per_second_short = rate(self.trained[1]);
        self.recovery.examples_per_second_full = rate(self.trained[0]);
        let mut phases = c.run_phases;
        phases.add(c.phases);
        (
            c.examples / c.train_time.as_secs_f64().max(1e-9),
            c.train_time.as_secs_f64(),
            self.recovery,
            phases.per_step(),
        )
    }
}
