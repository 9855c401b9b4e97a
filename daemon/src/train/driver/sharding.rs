//! A member's sharded optimizer state across a generation (`--shard-optimizer`;
//! docs/fault-tolerance.md, "Sharded optimizer state"): cut into this member's ranges at the
//! generation's first step, moved to new owners when a generation forms on it (after a
//! return), gathered for commits, made whole before a stop, and gone back from to the last
//! commit after a failure.

use super::Driver;
use crate::optim::optimizer::Optimizer;
use crate::optim::sharded_state::ShardedOptimizer;
use crate::state::{host, Optim, Position, Shareable, TrainState};
use crate::train::error::TrainError;
use crate::train::session::{Interrupt, Session};
use crate::train::sharded_step;
use trainerd_storage::TensorData;

impl Driver<'_> {
    /// Whether this step's optimizer state is sharded (`--shard-optimizer`, with at least two
    /// workers present): a whole state is cut into this member's ranges at the generation's first
    /// step (the ranges and their owners follow the generation's slots).
    pub(super) fn shard(&mut self, state: &mut TrainState, session: &mut Session) -> bool {
        let (v, generation) = (session.slot_count(), session.generation());
        let params = &state.model.params;
        if !self.cfg.shard_optimizer || session.collective().world() < 2 || v < 2 {
            if let Optim::Fresh(config) = &state.optimizer {
                state.optimizer = Optim::Whole(Optimizer::new(config.clone(), params));
            }
            return false;
        }
        if !state.optimizer.sharded() {
            // A sharded state held over from another generation moved when this one formed
            // ([`Driver::reshard`]).
            let ranges = self.buckets.ranges(params, v, self.extra_len(v));
            let (mine, buddied) = sharded_step::holding(&ranges, session.collective());
            let held =
                (&sharded_step::with_pieces(&ranges, &mine)[..], &sharded_step::with_pieces(&ranges, &buddied)[..]);
            state.optimizer = Optim::Sharded(match &state.optimizer {
                Optim::Whole(whole) => ShardedOptimizer::of(whole, params, held),
                _ => ShardedOptimizer::new(state.optimizer.config().clone(), params, held),
            });
            self.sharding = Some((generation, ranges));
            self.integrity.forget_agreed();
        }
        debug_assert_eq!(self.sharding.as_ref().map(|(g, _)| *g), Some(generation), "sharded in this generation");
        true
    }

    /// A generation formed on a sharded state (the members of the last one kept their ranges
    /// through a return, the returner holds none; or a failure, whose lost ranges their buddies
    /// hold; or a commit's state, read by range): every range moves to its owner and buddy in
    /// this generation, before anything else needs the state. A range held by no member (its
    /// owner and buddy both lost), or holders at different steps, send every member back to the
    /// last commit. A member left alone makes the state whole (it holds every range).
    pub(super) fn reshard(&mut self, state: &mut TrainState, session: &mut Session) -> Result<(), Interrupt> {
        // A commit's state: each member reads its own ranges, and nothing moves, unless some
        // could not ([`Driver::read_committed`]).
        if matches!(state.optimizer, Optim::Committed { .. }) && self.read_committed(state, session)? {
            return Ok(());
        }
        let Optim::Sharded(held) = &mut state.optimizer else { return Ok(()) };
        let (v, generation, began) = (session.slot_count(), session.generation(), std::time::Instant::now());
        let extra_len = self.extra_len(v);
        let ranges = self.buckets.ranges(&state.model.params, v, extra_len);
        let moved = sharded_step::reshard(
            (&mut self.buckets, &ranges, extra_len),
            session.collective(),
            &state.model.params,
            held,
        )
        .map_err(|e| session.interrupt(e.into()))?;
        let (next, forward, moves) = moved.map_err(|unmoved| {
            self.sharded_lost = true;
            if let Some(copies) = &unmoved.copies {
                let when = format!("as generation {generation} forms, at step {}", unmoved.step);
                let (why, _) = crate::train::integrity::ranges_differ(session, &when, copies).expect("copies differ");
                return Interrupt::Abandoned(why);
            }
            Interrupt::Abandoned(format!(
                "{} of the {} range(s) of the sharded optimizer state were lost with both their owner and their \
                 buddy (ranges {}): no member holds them at step {}",
                unmoved.ranges.len(),
                ranges.len(),
                spans(&unmoved.ranges),
                unmoved.step
            ))
        })?;
        self.tell_moved(&next, (forward, moves), (generation, began));
        state.optimizer = Optim::Sharded(next);
        self.sharding = Some((generation, ranges));
        if session.collective().world() < 2 {
            // Alone, it holds every range: whole again (a gather among one), as an unsharded
            // step needs.
            self.make_whole(state, session)?;
        }
        Ok(())
    }

    /// What a reshard did to `next` (this member's state now): the parameters put back, the step
    /// gone forward, and what moved, told.
    fn tell_moved(
        &mut self,
        next: &ShardedOptimizer,
        (forward, moves): (bool, sharded_step::Moves),
        (generation, began): (u64, std::time::Instant),
    ) {
        if moves.repaired > 0 {
            self.report.line(&format!(
                "trainerd: the failed step's all-gather had written into {} bucket(s) of the parameters on some member \
                 (--shard gradients writes each as it is gathered): every member put them back to step {} from their \
                 ranges' holders",
                moves.repaired,
                next.steps()
            ));
        }
        if forward {
            self.report.line(&format!(
                "trainerd: step {} completed on another member before the failure: this worker stored it from the \
                 gradients it kept (the step goes forward)",
                next.steps()
            ));
        }
        let how = match moves.by_neighbours {
            true => "from its own copies and its neighbours'",
            false => "through reduce-scatters: some range was at no neighbour",
        };
        self.report.line(&format!(
            "trainerd: the sharded optimizer state moved to generation {generation}'s owners: this worker holds {} \
             range(s) and a buddy copy of {}, {:.1} MB; it received {:.1} MB {how} ({:.2}s)",
            next.owned().len(),
            next.buddied().len(),
            next.state_bytes() as f64 / 1e6,
            moves.received as f64 / 1e6,
            began.elapsed().as_secs_f64()
        ));
    }

    /// A sharded optimizer's whole state, gathered from every member (kept where `keep`).
    pub(super) fn gather(
        &mut self,
        state: &TrainState,
        session: &mut Session,
        keep: bool,
    ) -> Result<Vec<TensorData>, Interrupt> {
        let (Optim::Sharded(o), Some((_, ranges))) = (&state.optimizer, self.sharding.as_ref()) else {
            unreachable!("gathered only when sharded")
        };
        // The gather passes through the host buffers of every slot held here, which a member that
        // trained no step in this generation has not made (the values do not matter: it writes
        // every range it reads).
        let (held, extra_len) = (session.collective().slots().len(), self.extra_len(session.slot_count()));
        self.buckets.make(held, &state.model.params, extra_len, None);
        sharded_step::gather_state((&mut self.buckets, ranges), session.collective(), &state.model.params, (o, keep))
            .map_err(|e| session.interrupt(e.into()))
    }

    /// A sharded optimizer made whole again, before the generation ends at a step boundary (a
    /// return or a stop): every member then holds the whole state, and the next generation shards
    /// it by its own slots.
    pub(super) fn make_whole(&mut self, state: &mut TrainState, session: &mut Session) -> Result<(), Interrupt> {
        let Optim::Sharded(o) = &state.optimizer else { return Ok(()) };
        let (config, steps) = (o.config().clone(), o.steps());
        // Each gathered tensor's bytes are let go as soon as it is made a tensor.
        let gathered: Vec<(String, tch::Tensor)> = (self.gather(state, session, true)?.into_iter())
            .map(|t| (t.name.clone(), host::to_tensor(&t).expect("float32 host values")))
            .collect();
        let mut whole = Optimizer::new(config, &state.model.params);
        whole.restore(steps, &gathered).expect("the gathered state is the optimizer's own");
        state.optimizer = Optim::Whole(whole);
        self.sharding = None;
        Ok(())
    }

    /// After a generation ended on a failure with the optimizer state sharded (or dropped by a
    /// comparison), no member holds it whole: every member goes back to the newest commit, and
    /// says so (a member that finds none joins without a state).
    pub(super) fn unshard_after_failure(
        &mut self,
        state: &mut TrainState,
        session: &Session,
        (generation, why): (u64, &str),
    ) -> Result<(), TrainError> {
        // What sent the members back is this failure's alone: a member that returns early below
        // (its state whole and live) must not carry it to a later failure (the soak found a
        // worker killed 6,000 steps after a formation of mixed states send every member back).
        let lost = std::mem::take(&mut self.sharded_lost);
        let sent_back = self.integrity.take_sent_back();
        if !self.cfg.shard_optimizer || (!state.optimizer.sharded() && state.live()) {
            return Ok(());
        }
        let kept = self.integrity.take_ranges_kept();
        if state.optimizer.sharded() && (state.live() || kept) && !lost {
            // Each lost range has a buddy among the survivors, at the same step: the next
            // formation moves the ranges ([`Driver::reshard`]), and nothing is lost. Where it
            // finds otherwise, it sends every member back here with `sharded_lost` set. (A
            // member whose parameters alone a check found corrupted keeps its ranges, and
            // receives the parameters.)
            return Ok(());
        }
        self.sharding = None;
        let from = state.position().global_step;
        if sent_back && !lost {
            self.finish_open(session)?;
        }
        let restored = match self.committer.as_mut() {
            Some(c) => c.restore_latest(state, &mut self.report)?,
            None => None,
        };
        let Some((sequence, step)) = restored else {
            // A commit still in flight on the coordinator may be read by it alone: the
            // formation takes the furthest state any member found (none at all ends the run).
            // Members without one all report the start, so that no transfer is planned among
            // them.
            state.model.live = false;
            state.model.position = Position::start(self.info.metrics.len());
            // Its ranges, if any, belong to a state no member goes on from.
            state.optimizer = Optim::Fresh(state.optimizer.config().clone());
            self.report.line(&format!(
                "trainerd: the optimizer state was sharded over generation {generation}'s workers, and it ended ({why}): \
                 no commit found here; the state comes from a member that found one"
            ));
            return Ok(());
        };
        self.report.line(&format!(
            "trainerd: the optimizer state was sharded over generation {generation}'s workers, and it ended ({why}): \
             every member goes back to checkpoint {sequence} at step {step} ({} step(s) to train again from step {from})",
            from.saturating_sub(step)
        ));
        Ok(())
    }
}

/// Range indices as spans: `0-3, 7, 9-10`.
fn spans(ranges: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranges.len() {
        let mut j = i;
        while j + 1 < ranges.len() && ranges[j + 1] == ranges[j] + 1 {
            j += 1;
        }
        out.push(if i == j { ranges[i].to_string() } else { format!("{}-{}", ranges[i], ranges[j]) });
        i = j + 1;
    }
    out.join(", ")
}
