//! A generation's start on a member: the formation's state adopted, the first exchange (what
//! every member must agree on, and what each knows of the comparison of the formation's step),
//! the formation told, and a comparison owed finished before the first step.

use std::time::Instant;

use super::Driver;
use crate::cluster::wire::Formed;
use crate::state::{Optim, Shareable, TrainState};
use crate::train::commit::Moment;
use crate::train::error::TrainError;
use crate::train::kernels;
use crate::train::report::JoinedGeneration;
use crate::train::session::{Interrupt, Joined, Session};
use crate::train::startup;

/// Where each of a member's values sits in the first exchange, and how many there are.
const STEPS: usize = 0;
const KERNELS: usize = 1;
const DIFFERED: usize = 2;
const COMMITS: usize = 3;
const MISMATCH: usize = 4;
const OWES: usize = 5;
const SHARDED: usize = 6;
const KNOWS: usize = 7;
const TORN: usize = 8;
const N: usize = 9;

impl Driver<'_> {
    /// Takes the state a formation settled on, is admitted, and says what happened; then, when a
    /// member owes the comparison of the formation's step (one cut short), every member makes it.
    pub(super) fn adopt(
        &mut self,
        state: &mut TrainState,
        session: &mut Session,
        joined: Joined,
        started: Instant,
    ) -> Result<(), Interrupt> {
        let Joined { formed, received, by_lineage, findings } = joined;
        let me = session.name(session.rank());
        for (line, odd) in self.integrity.heard(findings, (state, &me)) {
            self.report.replica_mismatch(&line, &odd);
        }
        // A live state at the source's step that still had to receive the source's: the two
        // differed where healthy replicas never do. Not when the kinds of optimizer state differ
        // (a coordinator that restored a commit, whole, among members whose state is sharded):
        // it takes the source's kind with the state; nor when this member reported a lineage
        // digest, which is no hash of its state; nor when its state is the placeholder a fresh
        // process builds (a restarted chief joining the coordinator elected meanwhile at step 0:
        // its model is the run's initial one, its position not yet pinned to the run's kernels).
        let same_kind = !by_lineage && received.as_deref().is_some_and(|b| state.same_kind(b));
        let of_the_run = self.adopted_once || self.resumed;
        let differed = same_kind && of_the_run && state.live() && state.position().progress() == formed.progress;
        self.report.formed(formed.generation, session.members().len(), session.slots());
        let got = received.is_some();
        let holds = got || state.live();
        if let Some(bytes) = received {
            // Decoded in place (the tensors are views of the bytes until copied into the model).
            state.decode(bytes.into()).map_err(|e| Interrupt::Fatal(e.into()))?;
        } else if !state.live() && self.adopted_once && self.cfg.shard_optimizer {
            // Every member went back to the last commit and none found one: the sharded state is
            // gone, and there is nothing to go back to.
            return Err(Interrupt::Fatal(TrainError::ShardedStateLost { generation: formed.generation }));
        }
        self.adopted_once = true;
        tracing::debug!("generation {} adopted after {:?}", formed.generation, started.elapsed());
        state.model.live = true;
        (self.coordinates, self.formation) = (formed.coordinator == session.rank(), formed.digest.clone());
        self.coordinator = session.members().iter().position(|&r| r == formed.coordinator).unwrap_or(0);
        if let Some(c) = self.committer.as_mut() {
            c.checkpointer().set_generation(formed.generation, (&formed.members, session.world()));
        }
        self.batches.keep(session.collective().slots());
        let owed = self.agree(state, session, (differed, formed.source, holds))?;
        self.reshard(state, session)?;
        self.probe_reach(session)?;
        self.integrity.formed(state, got || std::mem::take(&mut self.caught_up))?; // caught up: from a peer too
        session.adopted(state.position().global_step);
        let source_name = session.name(formed.source);
        self.joined(state, session, (&formed, source_name.as_str()), started);
        // The comparison the last generation could not finish, and the commit it held up. At an
        // epoch's end or the run's, the training loop begins with that comparison and commit.
        if owed && self.steps_next(state.position()) {
            self.check(state, session)?;
            self.commit(Moment::Step, state, session)?;
        }
        Ok(())
    }

    /// No member holds a state of the newest generation the members name, and this process
    /// coordinates without having read its checkpoint location (it joined first): it reads it
    /// now, waiting while it does not answer (there is nothing else to train from), and joins
    /// again with the latest commit that verifies, or the run's initial model where there is none
    /// (docs/fault-tolerance.md, "Join first; read storage only when nobody holds the state").
    pub(super) fn read_first(&mut self, state: &mut TrainState, session: &mut Session) -> Result<(), TrainError> {
        let world = session.slot_count();
        if let Some(c) = self.committer.as_mut() {
            let run_config = c.run_config().to_string();
            let at = (&mut *session, &mut *state, &mut self.report);
            let read = startup::resume(c.checkpointer(), &run_config, (self.info, world), at, (true, &self.stop));
            self.resumed = read?;
        }
        state.model.live = true;
        session.read();
        Ok(())
    }

    /// Says that this member joined the generation `formed` (whose source is named `source`).
    fn joined(&mut self, state: &TrainState, session: &Session, (formed, source): (&Formed, &str), started: Instant) {
        let world = session.world();
        let generation = JoinedGeneration {
            generation: formed.generation,
            rank: session.rank(),
            workers: world,
            present: session.members().len(),
            layout: (session.members().len() < world).then(|| layout(session)),
            global_step: state.position().global_step,
            recovery: formed.recovery,
            steps: (formed.steps_lost, formed.steps_trained_again),
            source: (!formed.receivers.is_empty()).then_some((formed.source, source)),
        };
        self.report.joined(&generation, started);
    }

    /// What every member must agree on, exchanged once per generation before any step: its steps
    /// per epoch (members whose input pipelines yield different counts would desynchronise the
    /// collectives: the run is refused, naming both counts), its CPU kernels (the run's are
    /// pinned: [`kernels`]), whether it held another state than the source's at the same step (a
    /// corruption the formation would hide:
    /// [`crate::train::integrity::Integrity::differed_at_formation`]), its checkpoint interval
    /// (commits are compared first), and what it knows of the comparison of the formation's step
    /// (its own, or told by a peer: [`crate::train::integrity::Flags`]; `holds`: it holds the
    /// formation's state), and whether its optimizer state is sharded (all
    /// members' or none: see [`Driver::reshard`]), and whether it knows every member to reach the
    /// checkpoint location (when none does, every member probes: [`Driver::probe_reach`]), and
    /// whether a failed all-gather tore its parameters (`--shard gradients`). Every
    /// member sees the same values, so every
    /// member decides alike; whether a comparison is owed.
    fn agree(
        &mut self,
        state: &mut TrainState,
        session: &mut Session,
        (differed, source, holds): (bool, usize, bool),
    ) -> Result<bool, Interrupt> {
        let mine = crate::sys::cpu::resolved().map_err(|e| Interrupt::Fatal(e.into()))?;
        let present = session.collective().world();
        let flags = self.integrity.flags(state.position().global_step, holds);
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        let values = session.gather(&[
            self.steps_per_epoch as f64,
            f64::from(mine.map_or(0, |c| c.code())),
            flag(differed),
            self.integrity.schedule().commits as f64,
            flag(flags.mismatch),
            flag(flags.owes),
            flag(state.optimizer.sharded()),
            flag(self.reach.knows(session.members())),
            flag(matches!(&state.optimizer, Optim::Sharded(o) if o.written().0 > 0)),
        ])?;
        let column = |i: usize| -> Vec<f64> { values.iter().copied().skip(i).step_by(N).collect() };
        let counts = column(STEPS);
        if let Some(other) = counts.iter().position(|&c| c != counts[0]) {
            return Err(Interrupt::Fatal(TrainError::StepsDiffer {
                chief: session.name_at(0),
                chief_steps: counts[0] as u64,
                other: session.name_at(other),
                other_steps: counts[other] as u64,
                batch_size: self.cfg.batch_size,
            }));
        }
        self.integrity.set_commits(column(COMMITS).into_iter().map(|c| c as u64).collect());
        let raised = |i: usize| -> Vec<usize> { (0..present).filter(|&p| values[N * p + i] > 0.5).collect() };
        let odd = raised(DIFFERED);
        // Parameters a failed all-gather tore differ at the same step, and the reshard puts them
        // back (docs/fault-tolerance.md, "Sharded gradients and parameters"): no corruption.
        if !odd.is_empty() && raised(TORN).is_empty() {
            return Err(self.integrity.differed_at_formation(state, session, &mut self.report, (&odd, source)));
        }
        self.one_kind_of_state(session, &raised(SHARDED))?;
        self.reach.needed = raised(KNOWS).is_empty();
        let finders = raised(MISMATCH);
        if !finders.is_empty() {
            return Err(self.integrity.mismatch_found_before(state, session, &mut self.report, &finders));
        }
        let codes: Vec<u8> = column(KERNELS).into_iter().map(|c| c as u8).collect();
        self.pin_kernels(state, session, (mine, &codes, source))?;
        Ok(!raised(OWES).is_empty())
    }

    /// Pins the run's CPU kernels ([`kernels`]) from the members' (`codes`, in member order;
    /// `mine`: this process's). The run's initial model is the chief's, made at its start with
    /// its own kernels: made with others than the run's (the chief's are higher: it starts itself
    /// again), it is not the run's, and every member that stays drops it and abandons the
    /// generation, so that the next one forms from the initial model the chief makes again.
    fn pin_kernels(
        &mut self,
        state: &mut TrainState,
        session: &Session,
        (mine, codes, source): (Option<crate::sys::cpu::Capability>, &[u8], usize),
    ) -> Result<(), Interrupt> {
        let recorded = state.position().cpu_capability.clone();
        let (Some(mine), Some(run)) = (mine, kernels::run_capability(recorded.as_deref(), codes)) else {
            return Ok(());
        };
        kernels::pin(&mut state.model.position, (run, mine), "the run", &mut self.report).map_err(Interrupt::Fatal)?;
        let made_with = session.members().iter().position(|&r| r == source).map(|p| codes[p]);
        let initial = recorded.is_none() && state.position().global_step == 0 && !self.resumed;
        match made_with.and_then(crate::sys::cpu::Capability::from_code) {
            Some(made) if initial && made != run => {
                state.model.position.cpu_capability = None;
                state.model.live = false;
                Err(Interrupt::Abandoned(format!(
                    "the run's initial model was made by {} with {} CPU kernels, the run's are {}: it is made again \
                     with the run's",
                    session.name(source),
                    made.name(),
                    run.name()
                )))
            }
            _ => Ok(()),
        }
    }

    /// A generation forms with every member's optimizer state sharded (`sharded`: the places
    /// whose is), or none's: the ranges move together ([`Driver::reshard`]). A guard: every
    /// member holds the source's digest, or received its state, and either way its kind (the
    /// bytes say it, `TrainState::same_kind`). Should both kinds meet, every member goes back to
    /// the last commit (`sharded_lost`) rather than wait on itself in a reshard the others skip.
    fn one_kind_of_state(&mut self, session: &Session, sharded: &[usize]) -> Result<(), Interrupt> {
        if sharded.is_empty() || sharded.len() == session.members().len() {
            return Ok(());
        }
        let names: Vec<String> = sharded.iter().map(|&p| session.name_at(p)).collect();
        self.sharded_lost = true;
        Err(Interrupt::Abandoned(format!(
            "the optimizer state is sharded on {} and whole on the others as generation {} forms",
            names.join(", "),
            session.generation()
        )))
    }
}

/// Who holds which slots in the session's generation: `worker 0: slots 0-1, worker 1: slot 2`.
fn layout(session: &Session) -> String {
    let slots = session.slots();
    session
        .members()
        .iter()
        .zip(&slots.layout)
        .map(|(&rank, r)| format!("{}: {}", session.name(rank), crate::collective::slots::describe(slots.count, r)))
        .collect::<Vec<_>>()
        .join(", ")
}
