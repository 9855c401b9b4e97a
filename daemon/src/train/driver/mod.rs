//! The loop: generations, epochs, steps. Each generation is joined (the state taken from its
//! source), admitted (every member's steps per epoch agree), and trained until the run is done,
//! a member asks to stop, or a failure abandons it; then the next generation is joined with the
//! state as it stands. What to show is the reporter's ([`super::report`]), when to commit the
//! policy's ([`super::commit`]); a member's side of commits is [`commits`], a returner's
//! catch-up [`catch_up`].

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use trainerd_sdk::{InputContext, PluginInfo};

use super::batches::Batches;
use super::commit::{Committer, Moment};
use super::config::RunConfig;
use super::error::TrainError;
use super::integrity::{self, Integrity};
use super::replicas::Replicas;
use super::report::{Reporter, StepDone};
use super::session::{lineage, First, Interrupt, Session};
use super::sharded_step::{self, Stepped};
use super::startup::Data;
use super::step::{self, Raised, SlotBatch, StepResult};
use super::summary::Outcome;
use crate::cluster::ClusterError;
use crate::collective::buckets::{Buckets, Range};
use crate::collective::overlap::{OnReduced, Overlap, Reduction};
use crate::collective::slots;
use crate::collective::Collective;
use crate::input::Data as Input;
use crate::optim::schedule::Curve;
use crate::optim::sharded_state::Piece;
use crate::plugin::ModelInstance;
use crate::state::{Optim, Position, Shareable, Totals, TrainState};

mod catch_up;
mod commits;
mod committed;
mod end;
mod formation;
mod sharding;

/// How training in a generation ended.
enum Ended {
    /// Every epoch is done and evaluated.
    Finished,
    /// The workers of these slots asked to stop after the step just taken.
    Stop(Vec<usize>),
    /// These ranks came back: the generation ends after the step just taken.
    Return(Vec<usize>),
}

/// What a sharded step's reduction applied, and how long that took.
type Applied = (Stepped, Duration);

/// What follows a generation.
enum Next {
    /// The run is complete for every member.
    Complete,
    /// This worker's run ends with this outcome.
    Exit(Outcome),
    /// The generation ended at a step boundary (why): every member joins the next one.
    Rejoin(String),
}

/// What the loop drives with, besides the state and the session.
pub(super) struct Driver<'a> {
    cfg: &'a RunConfig,
    info: &'a PluginInfo,
    model: &'a ModelInstance<'a>,
    /// The model on this daemon's further devices, if any.
    replicas: Replicas<'a>,
    data: &'a Input<'a>,
    batches: Batches<'a>,
    buckets: Buckets,
    ctx: InputContext,
    steps_per_epoch: u64,
    stop: Arc<AtomicBool>,
    report: Reporter<'a>,
    committer: Option<Committer>,
    /// The test split's sums per slot already evaluated, and the global step of the parameters.
    evaluated: (u64, BTreeMap<u32, Vec<f64>>),
    /// This worker coordinates the current generation: it commits.
    coordinates: bool,
    /// The replicas' comparisons.
    integrity: Integrity,
    /// The pieces of the buckets' ranges the clip norm adds over, for a run of so many slots.
    clip_ranges: Option<(usize, Vec<Vec<Piece>>)>,
    /// With the optimizer state sharded: the generation it was sharded in, and the buckets'
    /// ranges.
    sharding: Option<(u64, Vec<Range>)>,
    /// This process has adopted a generation's state (a state it holds no longer is one it
    /// dropped, not a fresh one).
    adopted_once: bool,
    /// The last formation found the sharded optimizer state incomplete (a range's owner and
    /// buddy both lost, or holders steps apart): every member goes back to the last commit.
    sharded_lost: bool,
    /// The coordinator's place in the current generation's ring.
    coordinator: usize,
    /// Whether the members write sharded commits in parallel (they all reach the location).
    reach: commits::Reach,
    /// The current generation's formation digest (the root of its lineage digests).
    formation: String,
    /// A returner's catch-up fed from here (this process coordinates), and its ranges.
    donor: catch_up::Donor,
    range_donor: catch_up::RangeDonor,
    /// This process caught up: its state came from a peer.
    caught_up: bool,
    /// The state this process brought to its first formation is a commit it resumed, not the
    /// placeholder a fresh process builds (the chief's, live until something better turns up).
    resumed: bool,
    /// On the coordinator: the sharded commit whose parts the members are writing.
    open: Option<commits::Open>,
}

impl<'a> Driver<'a> {
    /// A loop over `model` (and its `replicas`) and its `data`.
    pub(super) fn new(
        (cfg, info): (&'a RunConfig, &'a PluginInfo),
        (model, replicas, data): (&'a ModelInstance<'a>, Replicas<'a>, &'a Data<'a>),
        buckets: Buckets,
        (report, committer): (Reporter<'a>, Option<Committer>),
        stop: &Arc<AtomicBool>,
    ) -> Driver<'a> {
        Driver {
            cfg,
            info,
            model,
            replicas,
            data: &data.input,
            batches: Batches::new(&data.input, cfg.device, (cfg.epochs, data.steps_per_epoch)),
            buckets,
            ctx: data.ctx,
            steps_per_epoch: data.steps_per_epoch,
            stop: Arc::clone(stop),
            report,
            committer,
            evaluated: (u64::MAX, BTreeMap::new()),
            coordinates: true,
            integrity: Integrity::new(integrity::Schedule::of(cfg)).keeping_in(cfg.state_dir.as_deref()),
            clip_ranges: None,
            sharding: None,
            adopted_once: false,
            sharded_lost: false,
            coordinator: 0,
            reach: commits::Reach::default(),
            formation: String::new(),
            donor: catch_up::Donor::new(cfg.catch_up_memory),
            range_donor: catch_up::RangeDonor::default(),
            caught_up: false,
            resumed: false,
            open: None,
        }
    }

    /// Whether this process resumed a commit at its start.
    pub(super) fn resumed(mut self, resumed: bool) -> Driver<'a> {
        self.resumed = resumed;
        self
    }

    /// Trains from the first generation's join (`first`) until the run ends, joining again after
    /// every failure; `started` is when this process started.
    pub(super) fn run(
        mut self,
        mut session: Session,
        mut state: TrainState,
        first: First,
        started: Instant,
    ) -> Result<Outcome, TrainError> {
        let mut first = Some(first);
        self.coordinates = session.coordinates();
        loop {
            if let Some(why) = session.replaced() {
                return Err(TrainError::Cluster(ClusterError::Replaced(why)));
            }
            let joined = match first.take() {
                Some(First::Joined(joined, refused)) => {
                    if let Some(why) = refused {
                        self.report.line(&format!("trainerd: no catch-up: {why}; joining with a pause"));
                    }
                    joined
                }
                Some(First::CatchUp(catching)) => self
                    .catch_up(&mut state, &mut session, (catching, started))
                    .and_then(|()| session.join(Some(&state as &dyn Shareable), &self.stop)),
                None => session.join(Some(&state as &dyn Shareable), &self.stop),
            };
            let ended = joined.and_then(|j| self.adopt(&mut state, &mut session, j, started)).and_then(|()| {
                let ended = self.train(&mut state, &mut session)?;
                self.conclude(&mut state, &mut session, ended)
            });
            let generation = session.generation();
            match &ended {
                Ok(Next::Rejoin(why)) | Err(Interrupt::Abandoned(why)) => {
                    self.donor.stop(&format!("generation {generation} ended: {why}"), &mut self.report)
                }
                Ok(Next::Complete) => self.donor.finish(state.position().global_step, &session, &mut self.report),
                // Before any generation: nothing is fed.
                Err(Interrupt::ReadFirst) => {}
                _ => self.donor.stop("this worker exits", &mut self.report),
            }
            match ended {
                Ok(Next::Exit(outcome)) => return Ok(outcome),
                Ok(Next::Complete) => break,
                Ok(Next::Rejoin(why)) => {
                    self.report.generation_ends(state.position().global_step, session.generation(), &why)
                }
                Err(Interrupt::Abandoned(why)) => {
                    self.report.abandoned(state.position().global_step + 1, session.generation(), &why);
                    self.unshard_after_failure(&mut state, &session, (session.generation(), &why))?;
                }
                Err(Interrupt::Stopped) => return self.stopped(&state),
                Err(Interrupt::ReadFirst) => self.read_first(&mut state, &mut session)?,
                Err(Interrupt::Fatal(TrainError::Cluster(ClusterError::Finished(said)))) => {
                    return Ok(Outcome::AlreadyFinished(said))
                }
                Err(Interrupt::Fatal(e)) => return Err(e),
            }
        }
        Ok(Outcome::Finished(Box::new(self.summary(&state, &session))))
    }

    /// The input contexts of the slots this worker holds, in slot order.
    fn ctxs(&self, held: &crate::collective::Slots, epoch: u32, training: bool) -> Vec<InputContext> {
        held.iter()
            .map(|slot| InputContext { epoch: u64::from(epoch), training, input_pipeline_id: slot as u32, ..self.ctx })
            .collect()
    }

    fn metrics(&self) -> usize {
        self.info.metrics.len()
    }

    /// The values riding in a step's tail before the used-flags, in a run of `v` slots: the
    /// totals, then a stop flag and a return flag per slot ([`step::train_step`]).
    fn extra_len(&self, v: usize) -> usize {
        Totals::new(self.metrics()).flat().len() + 2 * v
    }

    /// The learning rate of global step `global_step` (from 0), times the plateau's reductions
    /// in `p`.
    fn lr(&self, global_step: u64, p: &Position) -> f64 {
        let total_steps = self.steps_per_epoch * u64::from(self.cfg.epochs);
        let curve = Curve { schedule: &self.cfg.schedule, warmup: self.cfg.warmup, formulas: p.schedules };
        curve.lr(self.cfg.optimizer.lr(), global_step, total_steps) * p.callbacks.lr_scale
    }

    /// Whether the training loop's next move from `p` is a step (else an epoch's end, or the
    /// run's, each of which begins with a comparison of the replicas).
    fn steps_next(&self, p: &Position) -> bool {
        p.epoch < self.cfg.epochs && p.callbacks.stopped_after.is_none() && p.step_in_epoch < self.steps_per_epoch
    }

    /// Trains until every epoch is done and evaluated, or a member asks to stop.
    fn train(&mut self, state: &mut TrainState, session: &mut Session) -> Result<Ended, Interrupt> {
        let epochs = self.cfg.epochs;
        while state.position().epoch < epochs && state.position().callbacks.stopped_after.is_none() {
            self.report.epoch(state.position().epoch);
            if state.position().step_in_epoch >= self.steps_per_epoch {
                self.end_epoch(state, session)?;
                continue;
            }
            let StepResult { stopping, returning, caught_up, .. } = self.step(state, session)?;
            if !stopping.is_empty() {
                return Ok(Ended::Stop(stopping));
            }
            if !returning.is_empty() {
                if caught_up {
                    // Every member holds this generation's state at this step, the returner too.
                    let step = state.position().global_step;
                    session.set_lineage(lineage(&self.formation, session.generation(), step));
                }
                return Ok(Ended::Return(slots::ranks_of(session.slot_count(), session.world(), &returning)));
            }
        }
        if state.position().last_eval.is_none() && epochs > 0 && self.cfg.evaluate {
            // A checkpoint of an older trainerd holds no evaluation: make it.
            let eval = self.evaluate((epochs - 1, state.position().global_step), session)?;
            state.model.position.last_eval = Some(eval);
        }
        Ok(Ended::Finished)
    }

    /// One step on this worker's slice of the global batch, the update, and what follows it (its
    /// comparison of the replicas and its commit, when due); the slots that asked to stop after
    /// it, and the ranks that came back.
    fn step(&mut self, state: &mut TrainState, session: &mut Session) -> Result<StepResult, Interrupt> {
        let p = state.position();
        let (epoch, step, global_step) = (p.epoch, p.step_in_epoch + 1, p.global_step);
        trainerd_failpoint::set_step(global_step + 1);
        // The open sharded commit's record, once every member has said what its parts came to.
        self.settle(session, false)?;
        let held = session.collective().slots().clone();
        let ctxs = self.ctxs(&held, epoch, true);
        let batches = ctxs.iter().map(|ctx| self.batches.get(ctx, step - 1)).collect::<Result<Vec<_>, _>>();
        let batches = batches.map_err(Interrupt::Fatal)?;
        let seeds: Vec<i64> = held.iter().map(|slot| p.step_seed(self.cfg.seed, slot)).collect();
        let lr = self.lr(global_step, p);
        let (back, caught_up, buckets) = self.back(state, session);
        let raised = Raised { stop: self.stop.load(Ordering::Relaxed), back: &back, caught_up };
        // Chaos tests hang a step here (as a stuck kernel would) to see the watchdog stop.
        trainerd_failpoint::point("train-step");
        let began = Instant::now();
        let slot_batches: Vec<SlotBatch<'_>> =
            batches.iter().zip(&seeds).map(|(b, &seed)| SlotBatch { columns: &b.columns, seed }).collect();
        let reduced = self.gradients(state, session, (&ctxs, step, lr), (&slot_batches, buckets.as_ref()), raised);
        // Before the update writes the state: the snapshot's copy complete, the outputs kept.
        let clip_norm = self.outputs_kept(state, (reduced.is_ok(), buckets), session.slot_count())?;
        let (result, prefetch, stepped) = reduced?;
        if let Some((what, took)) = session.collective().take_setup() {
            self.report.backend_ready(session.generation(), what, took);
        }
        let (grad_norm, optimizer) = match stepped {
            // The sharded step's reduction applied the update.
            Some((stepped, took)) => {
                self.flip_bit(state);
                (stepped.grad_norm, took)
            }
            None => self.update(state, (global_step + 1, lr, clip_norm), session.slot_count())?,
        };
        state.model.position.stepped(&result.totals);
        self.donor.moved(state, &mut self.report);
        let took = began.elapsed();
        session.set_step(state.position().global_step);
        let steps_per_epoch = self.steps_per_epoch;
        let (position, totals) = (state.position(), &result.totals);
        let ids: Option<Vec<crate::input::ExampleId>> =
            batches.iter().map(|b| b.ids.clone()).collect::<Option<Vec<Vec<_>>>>().map(|v| v.concat());
        let ids = ids.as_deref();
        let timing = (took, prefetch, optimizer);
        let traffic = session.traffic();
        let times = result.times;
        let done =
            StepDone { epoch, step, steps_per_epoch, position, totals, lr, grad_norm, timing, times, ids, traffic };
        // Told before its comparison: a comparison cut short is finished, not undone, so the step
        // stays (a mismatch's repair tells the steps it trains again once more).
        self.report.step(&done).map_err(Interrupt::Fatal)?;
        self.report.step_line(&done);
        // Compared before it is committed: no commit holds a state that was not compared.
        if self.integrity.due(state.position(), steps_per_epoch) {
            self.check(state, session)?;
        }
        self.commit(Moment::Step, state, session)?;
        self.donor.passed(state.position().global_step, &mut self.report);
        Ok(result)
    }

    /// After the step's reduction (`ok`: it went through), a returner's feed told
    /// ([`catch_up::Donor::reduced`]). With the gradient clipped (not sharded, no float16 loss
    /// scale), the global norm the update will clip at is found first and returned, so that the
    /// returner's outputs carry it before the gradient, which it clips range by range as it comes
    /// ([`crate::state::catch_up::Carried::Clipped`]).
    fn outputs_kept(
        &mut self,
        state: &TrainState,
        (ok, buckets): (bool, Option<catch_up::BucketFeed>),
        v: usize,
    ) -> Result<Option<f64>, Interrupt> {
        let unscaled = state.model.position.loss_scale.is_none() && !state.optimizer.sharded();
        let mut clip_norm = None;
        if ok && unscaled && !self.cfg.clip.is_off() && self.donor.feeding() {
            self.make_clip_ranges(&state.model.params, v);
            let ranges = self.clip_ranges.as_ref().map_or(&[][..], |(_, r)| r.as_slice());
            let norm = self.cfg.clip.norm_over(&state.model.params, ranges);
            clip_norm = norm.map_err(|source| Interrupt::Fatal(TrainError::Torch { what: "clipping", source }))?;
        }
        let sent = buckets.map(catch_up::BucketFeed::sent).unwrap_or_default();
        self.donor.reduced((ok, clip_norm), (state, sent), &self.formation, &mut self.report);
        Ok(clip_norm)
    }

    /// The ranges the global norm is taken over in a run of `v` slots (the buckets'), made once.
    fn make_clip_ranges(&mut self, params: &[(String, tch::Tensor)], v: usize) {
        if !self.cfg.clip.is_off() && self.clip_ranges.as_ref().is_none_or(|(of, _)| *of != v) {
            let ranges = self.buckets.ranges(params, v, self.extra_len(v));
            self.clip_ranges = Some((v, ranges.iter().map(sharded_step::pieces).collect()));
        }
    }

    /// The update of global step `global_step` (1-based) at rate `lr` from the averaged gradient
    /// (clipped, over the buckets' ranges of a run of `v` slots, or at the global norm found
    /// already, `clip_norm`; and unscaled under float16's loss scaling); the gradient's norm
    /// before clipping, and the time it took.
    fn update(
        &mut self,
        state: &mut TrainState,
        (global_step, lr, clip_norm): (u64, f64, Option<f64>),
        v: usize,
    ) -> Result<(Option<f64>, Duration), Interrupt> {
        let began = Instant::now();
        let grad_norm = match self.unscaled(state, global_step).map_err(Interrupt::Fatal)? {
            true => {
                self.make_clip_ranges(&state.model.params, v);
                let ranges = self.clip_ranges.as_ref().map_or(&[][..], |(_, r)| r.as_slice());
                let params = &state.model.params;
                let clipped = match clip_norm {
                    Some(norm) => self.cfg.clip.apply_at(params, norm).map(|()| Some(norm)),
                    None => self.cfg.clip.apply_over(params, ranges),
                };
                let torch = |source| Interrupt::Fatal(TrainError::Torch { what: "clipping", source });
                let grad_norm = clipped.map_err(torch)?;
                match &mut state.optimizer {
                    Optim::Whole(optimizer) => {
                        if self.buckets.grads_are_views() {
                            optimizer.leave_grads();
                        }
                        optimizer.step(&mut state.model.params, lr)
                    }
                    Optim::Sharded(_) => unreachable!("a sharded optimizer updates in the step's reduction"),
                    Optim::Fresh(_) | Optim::Committed { .. } => {
                        unreachable!("made whole or sharded at the step's start, read as the generation formed")
                    }
                }
                grad_norm
            }
            false => None,
        };
        let took = began.elapsed();
        self.flip_bit(state);
        Ok((grad_norm, took))
    }

    /// Chaos tests corrupt a replica here, after the update, as faulty memory would.
    fn flip_bit(&mut self, state: &mut TrainState) {
        if trainerd_failpoint::hit("flip-bit") {
            let flipped = integrity::flip_bit(state).unwrap_or_else(|| "no parameter to flip".into());
            self.report.line(&format!("trainerd: failpoint flip-bit: {flipped}"));
        }
        if let (true, Optim::Sharded(o)) = (trainerd_failpoint::hit("flip-state-bit"), &mut state.optimizer) {
            let flipped = o.flip_bit().unwrap_or_else(|| "no optimizer state to flip".into());
            self.report.line(&format!("trainerd: failpoint flip-state-bit: {flipped}"));
        }
    }

    /// Under float16's loss scaling, the averaged gradient divided by the scale and the scale
    /// moved on; whether to apply the update of global step `global_step` (false: it overflowed,
    /// and is skipped, said in a line).
    fn unscaled(&mut self, state: &mut TrainState, global_step: u64) -> Result<bool, TrainError> {
        let Some(scale) = state.model.position.loss_scale.as_mut() else { return Ok(true) };
        let finite = crate::optim::precision::unscale(&state.model.params, scale.scale)
            .map_err(|source| TrainError::Torch { what: "unscaling the gradients", source })?;
        let before = scale.scale;
        if !scale.update(finite) {
            self.report.line(&format!(
                "trainerd: fp16: step {global_step} skipped: the gradient overflowed at loss scale {before}; the \
                 scale is now {} ({} step(s) skipped so far)",
                scale.scale, scale.skipped
            ));
            return Ok(false);
        }
        Ok(true)
    }

    /// Forward, backward and all-reduce of step `step` (1-based) of the epoch of `ctxs` (one per
    /// slot held) on `batches`, with the flags this worker `raised`; the next batches are
    /// made while the device computes (the time that took is returned). A forward pass updates
    /// buffers in place: each slot starts from their values at the step's start, and an abandoned
    /// step puts them back.
    ///
    /// With the optimizer state sharded, the reduction also applies the update at rate `lr`
    /// ([`sharded::reduce_and_update`]): what it gave, and the time its update took, come back too.
    fn gradients(
        &mut self,
        state: &mut TrainState,
        session: &mut Session,
        (ctxs, step, lr): (&[InputContext], u64, f64),
        (batches, feed): (&[SlotBatch<'_>], Option<&catch_up::BucketFeed>),
        raised: Raised<'_>,
    ) -> Result<(StepResult, Duration, Option<Applied>), Interrupt> {
        let sharded = self.shard(state, session);
        self.buckets.set_compact(sharded && self.cfg.shard_gradients);
        let extra_len = self.extra_len(session.slot_count());
        let saved = if session.collective().slots().count > 1 { state.model.save_buffers() } else { Vec::new() };
        let mut prefetch = Duration::ZERO;
        let mut prefetch_next = next_batches(&mut self.batches, ctxs, (step, self.steps_per_epoch), &mut prefetch);
        let model = &mut state.model;
        let scale = loss_scale(self.cfg.precision, &mut model.position);
        let (clip, optimizer, ranges) = (self.cfg.clip, &mut state.optimizer, self.sharding.as_ref().map(|(_, r)| r));
        // The members compare the parameters each step read (a corrupted one would be
        // overwritten by the all-gather, or spread by its owner, before the next comparison).
        let (check, send) = (Some(self.coordinates), self.range_donor.wanted());
        let mut stepped = None;
        let mut whole = |b: &mut Buckets, c: &mut dyn Collective, p: &mut [(String, tch::Tensor)], held: usize| {
            b.reduce(c, p, held)
        };
        let mut apart = |b: &mut Buckets, c: &mut dyn Collective, p: &mut [(String, tch::Tensor)], _: usize| {
            let (Optim::Sharded(o), Some(ranges)) = (&mut *optimizer, ranges) else { unreachable!("sharded above") };
            let began = Instant::now();
            let s =
                sharded_step::reduce_and_update((b, ranges), c, p, o, (&clip, lr, None), (extra_len, check, &send))?;
            let extra = s.extra.clone();
            stepped = Some((s, began.elapsed()));
            Ok(extra)
        };
        let reduce: &mut step::Reduce<'_> = if sharded { &mut apart } else { &mut whole };
        // A returner fed from here takes each bucket's average as the reducing thread ends it.
        let told = |b: usize, sum: &tch::Tensor| feed.expect("told only with a feed").told(b, sum);
        let overlap = overlap(self.cfg, session.collective().on_device(), sharded, feed.map(|_| &told as _));
        let result =
            self.replicas.of_step(self.model, (&mut model.params, &mut model.buffers), scale).and_then(|mut r| {
                let collective = session.collective();
                let buckets = (&mut self.buckets, reduce, overlap);
                step::train_step(&mut r, buckets, collective, (batches, &saved), raised, &mut prefetch_next)
            });
        let result = result.map_err(|e| {
            model.restore_buffers(&saved);
            session.interrupt(e)
        })?;
        drop(prefetch_next);
        if let Some(read) = stepped.as_mut().and_then(|(s, _)| s.differed.take()) {
            // Nothing was updated: the step is trained again.
            model.restore_buffers(&saved);
            return Err(self.integrity.read_differed(state, session, &mut self.report, &read));
        }
        self.ranges_stepped(stepped.as_mut().map(|(s, _)| s), (state.position().global_step + 1, lr));
        Ok((result, prefetch, stepped))
    }

    /// A pass over the test split after `epoch`, on the parameters of `global_step`, each
    /// collective bounded by the collective timeout. The shards already evaluated on these
    /// parameters (before a failure abandoned the pass) are not evaluated again.
    fn evaluate(&mut self, (epoch, global_step): (u32, u64), session: &mut Session) -> Result<Totals, Interrupt> {
        let ctxs = self.ctxs(&session.collective().slots().clone(), epoch, false);
        self.report.evaluating(epoch);
        if self.evaluated.0 != global_step {
            self.evaluated = (global_step, BTreeMap::new());
        }
        let on = (self.cfg.device, self.metrics(), self.cfg.precision);
        step::evaluate(self.model, self.data, &ctxs, session.collective(), on, &mut self.evaluated.1)
            .map_err(|e| session.interrupt(e))
    }

    /// The epoch's evaluation, its last line, and its commit.
    fn end_epoch(&mut self, state: &mut TrainState, session: &mut Session) -> Result<(), Interrupt> {
        self.check(state, session)?;
        let epoch = state.position().epoch;
        let at = (epoch, state.position().global_step);
        let eval = if self.cfg.evaluate { Some(self.evaluate(at, session)?) } else { None };
        state.model.position.next_epoch(eval.clone());
        let p = state.position();
        // The rate the epoch's last step used.
        let lr = self.lr(p.global_step.saturating_sub(1), p);
        self.report.epoch_end((epoch, p.global_step, self.steps_per_epoch), &p.last_epoch, eval.as_ref(), lr);
        self.callbacks(state);
        self.donor.moved(state, &mut self.report);
        self.commit(Moment::EpochEnd, state, session)?;
        Ok(())
    }

    /// The callbacks' turn at an epoch's end (the epoch's figures are in the position), and what
    /// they did, told.
    fn callbacks(&mut self, state: &mut TrainState) {
        if self.cfg.callbacks.is_empty() {
            return;
        }
        let p = &mut state.model.position;
        let figures = crate::state::epoch_figures(&self.info.metrics, &p.last_epoch, p.last_eval.as_ref());
        let acted = self.cfg.callbacks.epoch_end(p.epoch, &figures, &mut p.callbacks);
        for (what, line) in [("reduce-lr-on-plateau", acted.reduced), ("early stopping", acted.stop)] {
            if let Some(line) = line {
                self.report.line(&format!("trainerd: {what}: {line}"));
            }
        }
    }

    /// The members compare their states (with another member to compare with).
    fn check(&mut self, state: &mut TrainState, session: &mut Session) -> Result<(), Interrupt> {
        if session.collective().world() < 2 {
            return Ok(());
        }
        let ranges = self.sharding.as_ref().map_or(0, |(_, r)| r.len());
        self.integrity.check(state, session, &mut self.report, (self.coordinates, ranges))
    }
}

/// The loss scale a step's backward pass multiplies by: float16's (made at its first step), else
/// 1.
fn loss_scale(precision: crate::optim::precision::Precision, position: &mut crate::state::Position) -> f64 {
    if precision == crate::optim::precision::Precision::Fp16 {
        position.loss_scale.get_or_insert_with(Default::default);
    }
    position.loss_scale.map_or(1.0, |s| s.scale)
}

/// The reduction each bucket of a step gets during the backward pass, and who is `told` of each
/// bucket reduced, or `None` where the buckets are reduced after it: `--overlap off`, or gradients
/// that are not carried from CPU parameters through host memory (a backend on the device, or a
/// model on CUDA: a reduction on its own stream is not yet built).
pub(crate) fn overlap<'t>(
    cfg: &RunConfig,
    on_device: bool,
    sharded: bool,
    told: Option<OnReduced<'t>>,
) -> Option<Overlap<'t>> {
    let ring_on_cpu = !on_device && cfg.devices.iter().all(|d| *d == tch::Device::Cpu);
    // A sharded step's reduce-scatter leaves no member a bucket's whole sum to tell of.
    let (how, told) = if sharded { (Reduction::ReduceScatter, None) } else { (Reduction::AllReduce, told) };
    (cfg.overlap && ring_on_cpu).then_some(Overlap { how, told })
}

/// What makes the next step's batches (of `ctxs`, step `step` of an epoch of `spe`) while the
/// devices compute, adding the time it took to `spent`. An error making one shows when that step
/// asks for it.
fn next_batches<'a, 'b>(
    next: &'a mut Batches<'b>,
    ctxs: &'a [InputContext],
    (step, spe): (u64, u64),
    spent: &'a mut Duration,
) -> impl FnMut() + use<'a, 'b> {
    move || {
        let began = Instant::now();
        if step < spe {
            for ctx in ctxs {
                let _ = next.get(ctx, step);
            }
        }
        *spent += began.elapsed();
    }
}
