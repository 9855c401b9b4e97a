//! A return that does not pause the survivors (docs/fault-tolerance.md): the donor's side, where
//! the coordinator's process sends a returner its state at a step boundary and then every step's
//! outputs ([`Donor`], bounded by `--catch-up-memory`), and the returner's, which replays them
//! through the same update and joins with the lineage digest ([`Driver::catch_up`]).

use std::thread::JoinHandle;
use std::time::Instant;

use bytes::Bytes;

use super::Driver;
use crate::cluster::catch_up::{fingerprint, Catching, Feed, Item};
use crate::collective::slots;
use crate::optim::optimizer::RangedRules;
use crate::state::catch_up::{self, Carried, Incoming};
use crate::state::{Optim, StateError, TrainState};
use crate::train::kernels;
use crate::train::report::Reporter;
use crate::train::session::{lineage, Interrupt, Session};

/// A size for lines: `512 B`, `31.4 KB`, `100.0 MB`, `1.2 GB` (powers of 1000).
fn size(bytes: u64) -> String {
    match bytes {
        0..1_000 => format!("{bytes} B"),
        1_000..1_000_000 => format!("{:.1} KB", bytes as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} MB", bytes as f64 / 1e6),
        _ => format!("{:.1} GB", bytes as f64 / 1e9),
    }
}

/// The donor's side: at most one returner fed at a time.
pub(super) struct Donor {
    /// `--catch-up-memory`: the outputs queued and not yet sent may not exceed it.
    memory: u64,
    feeding: Option<Feeding>,
}

/// A returner being fed.
struct Feeding {
    rank: usize,
    name: String,
    generation: u64,
    feed: Feed,
    /// The snapshot's bytes and their fingerprint, while a thread of their own makes them.
    copying: Option<JoinHandle<Result<(Bytes, u64), StateError>>>,
    /// The state is queued: every step's outputs follow it.
    state_queued: bool,
    /// Bytes of the last step's outputs.
    step_bytes: u64,
    /// The returner's flags are raised in this step: the generation ends after it.
    switching: bool,
    /// The least the returner's replay was behind this member at a step's start, in steps, and
    /// how many step starts have passed since it last came closer.
    behind: Option<(u64, u32)>,
    /// The step the state was taken at, and when.
    from: (u64, Instant),
}

impl Donor {
    pub(super) fn new(memory: u64) -> Donor {
        Donor { memory, feeding: None }
    }

    /// Whether a returner is being fed.
    pub(super) fn feeding(&self) -> bool {
        self.feeding.is_some()
    }

    /// At a step's start: a returner's request waiting is taken (its state copied from here on,
    /// by a thread, while the step's forward and backward read it), and a returner that went away
    /// is let go. A request waits for the next step where this one changes the optimizer state's
    /// kind (`sharding`: this step shards it, at a sharded run's first step or a generation's
    /// first after a whole state was restored).
    pub(super) fn begin(&mut self, state: &TrainState, session: &Session, sharding: bool, report: &mut Reporter<'_>) {
        if let Some(f) = &self.feeding {
            if f.feed.gone() {
                report.line(&format!("trainerd: {}'s catch-up ended: its stream is gone", f.name));
                self.feeding = None;
            }
            return;
        }
        if matches!(state.optimizer, Optim::Fresh(_)) || (sharding && !state.optimizer.sharded()) {
            return;
        }
        let Some(offer) = session.catch_up_offer() else { return };
        let name = session.name(offer.rank);
        let why_not = if self.memory == 0 {
            Some("--catch-up-memory is 0 on the coordinator".to_string())
        } else if offer.generation != session.generation() {
            Some(format!("generation {} ended", offer.generation))
        } else {
            None
        };
        if let Some(why) = why_not {
            report.line(&format!("trainerd: {name} cannot catch up: {why}; it joins as before"));
            offer.feed.fallback(&why);
            return;
        }
        let encoding = match state.snapshot_encoding() {
            Ok(e) => e,
            Err(e) => return offer.feed.fallback(&format!("its state could not be encoded: {e}")),
        };
        let copying = std::thread::Builder::new().name("trainerd-snapshot".into()).spawn(move || {
            let bytes = Bytes::from(encoding.bytes()?);
            let xxh3 = fingerprint(&bytes);
            Ok((bytes, xxh3))
        });
        let Ok(copying) = copying else { return offer.feed.fallback("no thread for the snapshot") };
        let step = state.position().global_step;
        report.line(&format!("trainerd: {name} catches up: sending the state at step {step} while training goes on"));
        self.feeding = Some(Feeding {
            rank: offer.rank,
            name,
            generation: offer.generation,
            feed: offer.feed,
            copying: Some(copying),
            state_queued: false,
            step_bytes: 0,
            switching: false,
            behind: None,
            from: (step, Instant::now()),
        });
    }

    /// At a step's start (this member at global step `at`), after [`Donor::begin`]: whether the
    /// returner is close enough to level to take its slots back after this step (its state taken
    /// by the stream, at most one step's outputs waiting, and its replay, as it says, at most one
    /// step behind: the step about to be trained is then all it has left to replay once the
    /// others end it); its rank. A returner that replays no faster than this member trains (a
    /// small model's steps, whose cost is mostly their overhead) would never be: once 3 step
    /// starts pass without it coming closer, it switches anyway, and the others wait at the switch
    /// for what it has left. Not while others come back as before (`others`): their return ends
    /// the generation, and with it this catch-up (the returner joins as before).
    pub(super) fn switch(&mut self, others: bool, at: u64) -> Option<usize> {
        let f = self.feeding.as_mut()?;
        // Until the returner has said where its replay is, the stream's queue alone decides.
        let close = match f.feed.replayed() {
            None => true,
            Some(r) => {
                let lag = at.saturating_sub(r);
                let (least, since) = match f.behind {
                    Some((least, since)) if lag >= least => (least, since + 1),
                    _ => (lag, 0),
                };
                f.behind = Some((least, since));
                lag <= 1 || since >= 3
            }
        };
        let level = f.state_queued && f.feed.state_taken() && f.feed.kept() <= f.step_bytes && close;
        f.switching = level && !others;
        f.switching.then_some(f.rank)
    }

    /// After the step's reduction (`ok`: it went through): the snapshot's copy is complete (the
    /// update may write), its bytes queued, and this step's outputs queued behind them, within
    /// the bound; with `clip_norm`, the global norm the update clips the gradient at, sent first.
    pub(super) fn reduced(
        &mut self,
        (ok, clip_norm): (bool, Option<f64>),
        state: &TrainState,
        formation: &str,
        report: &mut Reporter<'_>,
    ) {
        let Some(f) = self.feeding.as_mut() else { return };
        if let Some(copying) = f.copying.take() {
            match copying.join() {
                Ok(Ok((bytes, xxh3))) if ok => f.state_queued = f.feed.state(f.generation, formation, (&bytes, xxh3)),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return self.stop(&format!("its state could not be encoded: {e}"), report),
                Err(_) => return self.stop("the snapshot's thread panicked", report),
            }
        }
        if !ok || !f.state_queued {
            return;
        }
        // A sharded step's update is done by now (in its reduction): its parameters are sent.
        let bytes = match catch_up::capture(&state.model, state.optimizer.sharded(), clip_norm) {
            Ok(b) => b,
            Err(e) => return self.stop(&format!("a step's outputs could not be encoded: {e}"), report),
        };
        let (kept, len) = (f.feed.kept(), bytes.len() as u64);
        if kept + len > self.memory {
            let why = format!(
                "its kept outputs would take {}, above --catch-up-memory {}",
                size(kept + len),
                size(self.memory)
            );
            return self.stop(&why, report);
        }
        f.step_bytes = len;
        f.feed.step(&Bytes::from(bytes));
    }

    /// After a step or an epoch's end: the position queued.
    pub(super) fn moved(&mut self, state: &TrainState, report: &mut Reporter<'_>) {
        let Some(f) = self.feeding.as_ref().filter(|f| f.state_queued) else { return };
        match serde_json::to_vec(state.position()) {
            Ok(json) => {
                f.feed.position(&Bytes::from(json));
            }
            Err(e) => self.stop(&format!("the position could not be encoded: {e}"), report),
        }
    }

    /// After a step that passed its comparison and commit: when the returner's flags were raised
    /// in it, the end (the generation ends after `step`), with the lineage digest.
    pub(super) fn passed(&mut self, step: u64, report: &mut Reporter<'_>) {
        if !self.feeding.as_ref().is_some_and(|f| f.switching) {
            return;
        }
        let f = self.feeding.take().expect("switching");
        let (from, began) = f.from;
        report.line(&format!(
            "trainerd: {} caught up: it takes its slots back after step {step} (state from step {from}, {:.2}s ago; at \
             most {} of outputs kept)",
            f.name,
            began.elapsed().as_secs_f64(),
            size(f.feed.peak())
        ));
        report.served_catch_up(f.feed.peak());
        f.feed.end(step, true);
    }

    /// The catch-up stops (`why`): the returner joins as before.
    pub(super) fn stop(&mut self, why: &str, report: &mut Reporter<'_>) {
        let Some(mut f) = self.feeding.take() else { return };
        if let Some(copying) = f.copying.take() {
            // Nothing may write the state while the copy reads it.
            let _ = copying.join();
        }
        report.line(&format!("trainerd: {}'s catch-up stopped: {why}; it takes its slots back with a pause", f.name));
        report.served_catch_up(f.feed.peak());
        f.feed.fallback(why);
    }
}

impl Driver<'_> {
    /// At a step's start: the slots of the ranks that came back (known to the coordinator's
    /// process only), among them a returner fed from here that is level enough to take them back
    /// after this step (then true: it caught up).
    pub(super) fn back(&mut self, state: &TrainState, session: &mut Session) -> (Vec<bool>, bool) {
        let mut back = session.returning();
        let sharding = self.cfg.shard_optimizer && session.collective().world() >= 2 && session.slot_count() >= 2;
        self.donor.begin(state, session, sharding, &mut self.report);
        let switching = self.donor.switch(!back.is_empty(), state.position().global_step);
        back.extend(switching);
        let flags =
            if back.is_empty() { Vec::new() } else { slots::of_ranks(session.slot_count(), session.world(), &back) };
        (flags, switching.is_some())
    }

    /// A returner's catch-up from `catching`: the donor's state decoded, every step's outputs
    /// replayed through the same update, the positions taken; at the end, the next join reports
    /// the lineage digest. When it stops short (the bound, a failure, the donor gone), this
    /// process's state is dropped (it receives the formation's, as before) and the reason said.
    pub(super) fn catch_up(
        &mut self,
        state: &mut TrainState,
        session: &mut Session,
        (mut catching, started): (Catching, Instant),
    ) -> Result<(), Interrupt> {
        let began = Instant::now();
        let Some((generation, formation, from)) = self.take_state(state, &mut catching)? else { return Ok(()) };
        let received = began.elapsed();
        session.caught_up_to(from);
        self.report.line(&format!(
            "trainerd: catching up: the state at step {from} of generation {generation} came in {:.2}s; replaying \
             the steps trained since",
            received.as_secs_f64()
        ));
        // Steps replayed, and of those, updated range by range as their pieces came.
        let (mut replayed, mut by_range) = (0u64, 0u64);
        loop {
            if self.stop.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(Interrupt::Stopped);
            }
            let replay = match catching.next() {
                Ok(Item::Step { total, first }) => self
                    .replay(state, &mut catching, (total, first), session.slot_count())
                    .map(|ranged| (replayed, by_range) = (replayed + 1, by_range + u64::from(ranged))),
                Ok(Item::Position(bytes)) => serde_json::from_slice(&bytes)
                    .map(|p: crate::state::Position| {
                        session.caught_up_to(p.global_step);
                        state.model.position = p;
                    })
                    .map_err(|e| format!("a position could not be read: {e}")),
                Ok(Item::End { step, lineage: with_lineage }) => {
                    if state.position().global_step != step {
                        let at = state.position().global_step;
                        return self
                            .caught_short(state, &format!("the end came at step {step}, the replay is at {at}"));
                    }
                    if with_lineage {
                        session.set_lineage(lineage(&formation, generation, step));
                    }
                    self.caught_up = true;
                    self.say_caught_up((from, step), (replayed, by_range), (began, started));
                    return Ok(());
                }
                Ok(Item::Fallback(why)) => return self.caught_short(state, &why),
                Ok(Item::State { .. }) => Err("a second state".to_string()),
                Err(why) => return self.caught_short(state, &why),
            };
            if let Err(why) = replay {
                return self.caught_short(state, &why);
            }
        }
    }

    /// Caught up, said and counted: from the state at step `from` to `step`, `replayed` steps
    /// replayed (`by_range` of them updated range by range), since `began` (the state's request)
    /// and `started` (this process's start).
    fn say_caught_up(&mut self, (from, step): (u64, u64), (replayed, by_range): (u64, u64), times: (Instant, Instant)) {
        let (began, started) = times;
        let how = match by_range {
            0 => String::new(),
            n => format!(" ({n} updated range by range as their pieces came)"),
        };
        self.report.line(&format!(
            "trainerd: caught up in {:.2}s: the state at step {from}, {replayed} step(s) replayed{how}; takes its slots \
             back after step {step}",
            began.elapsed().as_secs_f64()
        ));
        self.report.caught_up(replayed, started.elapsed());
    }

    /// The stream's first item, the donor's state, taken: its generation, that generation's
    /// formation digest, and its step; `None` when the catch-up was refused or stopped (said).
    fn take_state(
        &mut self,
        state: &mut TrainState,
        catching: &mut Catching,
    ) -> Result<Option<(u64, String, u64)>, Interrupt> {
        match catching.next() {
            Ok(Item::State { generation, formation, bytes }) => {
                if let Err(e) = state.decode(bytes) {
                    // Nothing of it was taken, or part: either way this process's state is not one.
                    self.caught_short(state, &format!("the state received could not be taken: {e}"))?;
                    return Ok(None);
                }
                kernels::restored(&mut state.model.position, "the run", &mut self.report).map_err(Interrupt::Fatal)?;
                state.model.live = true;
                Ok(Some((generation, formation, state.position().global_step)))
            }
            // Refused before anything was taken: this process keeps what it restored.
            Ok(Item::Fallback(why)) | Err(why) => self.refused(&why).map(|()| None),
            Ok(other) => self.refused(&format!("the stream began with {other:?}")).map(|()| None),
        }
    }

    /// One step's outputs, `total` bytes beginning with `first` and read piece by piece from
    /// `catching`, applied to `state` (at the step before them): each gradient put in place as
    /// it arrives and, where the update needs nothing global but the clip's norm, which then
    /// comes first (no float16 loss scale), the update of its complete elements run meanwhile, so
    /// that the returner's work ends about when the last piece comes; else the same update once
    /// the gradient is whole. A sharded step's parameters after it are taken instead. Then the
    /// buffers. Whether the update ran range by range.
    fn replay(
        &mut self,
        state: &mut TrainState,
        catching: &mut Catching,
        (total, first): (usize, Bytes),
        slots: usize,
    ) -> Result<bool, String> {
        let at = state.position().global_step;
        let lr = self.lr(at, state.position());
        let mut incoming = Incoming::new(total);
        // Decided once the head is read: what the outputs carry and, where the update runs by
        // range, per parameter its rule (None: no gradient).
        let mut ranged: Option<(Carried, Option<RangedRules>)> = None;
        let mut piece = first;
        loop {
            let complete = incoming.take(&mut state.model, &piece)?;
            if ranged.is_none() {
                ranged = incoming
                    .grads_in_place(&state.model)
                    .map(|(carried, with)| (carried, self.ranged(state, carried, with, lr)));
            }
            if let (Some((carried, Some(rules))), Optim::Whole(optimizer)) = (&ranged, &mut state.optimizer) {
                // Clipped outputs: each range clipped first at the norm that came before it, as
                // the update clips the whole.
                let norm = incoming.clip_norm();
                if *carried == Carried::Clipped && norm.is_none() && !complete.is_empty() {
                    return Err("a step's outputs: a gradient came before the norm it is clipped at".into());
                }
                for (i, elements) in complete {
                    let (p, rule) = (&state.model.params[i].1, rules[i].expect("a gradient in place has its rule"));
                    if let Some(norm) = norm {
                        let clipped = self.cfg.clip.clip_elements(&p.grad(), Some(elements.clone()), norm);
                        clipped.map_err(|e| format!("clipping a step's gradient: {e}"))?;
                    }
                    optimizer.update_range(i, rule, (p, &p.grad()), elements);
                }
            }
            if incoming.whole() {
                break;
            }
            piece = catching.more("Step", (incoming.got(), total))?;
        }
        match incoming.finish(&mut state.model)? {
            carried if carried.gradients() && !matches!(state.optimizer, Optim::Whole(_)) => {
                Err("a step's gradients came for a state whose optimizer state is not whole".into())
            }
            carried if carried.gradients() && matches!(ranged, Some((_, Some(_)))) => {
                self.flip_bit(state);
                Ok(true)
            }
            // The whole update, which finds the same norm in the same gradient.
            Carried::Gradients | Carried::Clipped => {
                self.update(state, (at + 1, lr, None), slots).map(|_| false).map_err(|e| format!("{e:?}"))
            }
            // A sharded step: this process holds no range (the next formation moves its own to it).
            Carried::Parameters => Ok(false),
        }
    }

    /// The update of a step whose outputs carry `carried`, made ready for ranges of each
    /// gradient as it arrives ([`crate::optim::optimizer::Optimizer::ranged`]), when every
    /// gradient is written in place (`with`) and the update needs no factor over the whole
    /// gradient but the clip's, whose norm comes first ([`Carried::Clipped`]): no float16 loss
    /// scale.
    fn ranged(
        &self,
        state: &mut TrainState,
        carried: Carried,
        with: Option<Vec<bool>>,
        lr: f64,
    ) -> Option<RangedRules> {
        let (true, Some(with), Optim::Whole(o)) = (carried.gradients(), with, &mut state.optimizer) else {
            return None;
        };
        let norm_missing = carried != Carried::Clipped && !self.cfg.clip.is_off();
        if norm_missing || state.model.position.loss_scale.is_some() {
            return None;
        }
        o.ranged(&state.model.params, &with, lr)
    }

    /// The catch-up was refused before any state came (`why`): it joins as before.
    fn refused(&mut self, why: &str) -> Result<(), Interrupt> {
        self.report.line(&format!("trainerd: no catch-up: {why}; joining with a pause"));
        Ok(())
    }

    /// The catch-up stopped short (`why`): this process's state is dropped, and it joins as
    /// before (it receives the formation's state).
    fn caught_short(&mut self, state: &mut TrainState, why: &str) -> Result<(), Interrupt> {
        state.model.live = false;
        self.report.line(&format!("trainerd: the catch-up stopped: {why}; joining with a pause"));
        Ok(())
    }
}
