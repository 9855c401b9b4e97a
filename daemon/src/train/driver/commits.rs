//! Commits on a member: the coordinator's, and sharded commits (docs/fault-tolerance.md, "Sharded
//! commits"): whether every member
//! reaches the checkpoint location (a probe as a generation forms), and, where they do, each
//! commit written in parallel: the coordinator decides and names the commit's data id, every
//! member writes its parts under it, and the coordinator commits the record once every part is
//! durable and reported.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use trainerd_storage::{BlobEntry, Part, Score};

use super::Driver;
use crate::checkpoint::checkpointer::PartsWriter;
use crate::cluster::parts::Said;
use crate::state::{Optim, Position, TrainState};
use crate::train::commit::{Busy, Moment, Parts};
use crate::train::error::TrainError;
use crate::train::session::{Interrupt, Session};

/// What the reach probes found: the ranks known to reach the checkpoint location as every other
/// member does, whether no member of the forming generation knows that of every member (then
/// every member probes), and whether the current generation's members all do.
#[derive(Debug, Default)]
pub(super) struct Reach {
    reaching: BTreeSet<usize>,
    pub(super) needed: bool,
    pub(super) parallel: bool,
}

impl Reach {
    /// Whether every member of `members` (ranks) is known here to reach the location.
    pub(super) fn knows(&self, members: &[usize]) -> bool {
        members.iter().all(|r| self.reaching.contains(r))
    }
}

impl Driver<'_> {
    /// Asks the coordinator's committer at `moment`; the sequence of a last commit waited for.
    ///
    /// With the optimizer state sharded, every member calls it at the same moments, and where a
    /// commit may be due (an epoch's end, the run's, a stop, or a step any member's checkpoint
    /// interval falls on) every member writes its parts ([`Driver::commit_in_parts`]), or, where
    /// not every member reaches the location, the whole state is first gathered from every member.
    pub(super) fn commit(
        &mut self,
        moment: Moment,
        state: &mut TrainState,
        session: &mut Session,
    ) -> Result<Option<u64>, Interrupt> {
        let sharded = self.committer.is_some() && state.optimizer.sharded();
        if sharded && (moment != Moment::Step || self.integrity.due(state.position(), self.steps_per_epoch)) {
            if self.reach.parallel {
                return self.commit_in_parts(moment, state, session);
            }
            // Only the coordinator commits: the others take part and keep nothing.
            state.gathered = Some(self.gather(state, session, self.coordinates)?);
        }
        let committed = self.commit_whole(moment, state);
        state.gathered = None;
        Ok(committed?)
    }

    /// The coordinator's commit of `state` at `moment` (its optimizer state whole, or gathered).
    pub(super) fn commit_whole(&mut self, moment: Moment, state: &TrainState) -> Result<Option<u64>, TrainError> {
        match self.committer.as_mut().filter(|_| self.coordinates) {
            Some(c) => c.at(moment, state, &mut self.report),
            None => Ok(None),
        }
    }

    /// As a generation forms on a sharded run with checkpoints: whether every member reaches the
    /// checkpoint location as the others do. A member that knows it of every member vouches for
    /// them all (the first exchange says: [`Reach::knows`]; a worker that comes back on its node
    /// is not probed again); where none does, every member probes: each writes an object named by
    /// its place, and reads every other member's back; one small all-reduce tells the result,
    /// said in a line.
    pub(super) fn probe_reach(&mut self, session: &mut Session) -> Result<(), Interrupt> {
        let world = session.collective().world();
        let Some(c) = self.committer.as_mut().filter(|_| self.cfg.shard_optimizer && world > 1) else {
            return Ok(());
        };
        let members: Vec<usize> = session.members().to_vec();
        if !self.reach.needed {
            self.reach.parallel = true;
            self.reach.reaching.extend(members);
            return Ok(());
        }
        let nonce = if self.coordinates { format!("{:016x}", rand::random::<u64>()) } else { String::new() };
        let nonce = String::from_utf8_lossy(&broadcast(session, self.coordinator, nonce.into_bytes())?).into_owned();
        let place = session.collective().rank();
        let tokens: Vec<String> = (0..world).map(|p| session.name_at(p)).collect();
        let wrote = c.checkpointer().write_probe(&nonce, place, &tokens[place]);
        session.gather(&[0.0])?; // every member's probe object is written (or failed) first
        let read = wrote.and_then(|()| c.checkpointer().read_probes(&nonce, place, &tokens));
        let all = session.gather(&[if read.is_ok() { 1.0 } else { 0.0 }])?;
        c.checkpointer().remove_probe(&nonce, place);
        let location = c.checkpointer().location().to_string();
        let missing: Vec<String> = (0..world).filter(|&p| all[p] < 0.5).map(|p| tokens[p].clone()).collect();
        self.reach.parallel = missing.is_empty();
        if self.reach.parallel {
            self.reach.reaching.extend(members);
            self.report.line(&format!(
                "trainerd: sharded commits: every member writes its parts of each commit to {location} in parallel \
                 (each read the others' probe objects there)"
            ));
        } else {
            let mine = read.err().map(|why| format!(" (this worker could not read {why})")).unwrap_or_default();
            self.report.line(&format!(
                "trainerd: sharded commits: {} could not read every other member's probe object at {location} (a \
                 directory local to each node?){mine}: the coordinator gathers the state and writes each commit alone",
                missing.join(", ")
            ));
        }
        Ok(())
    }

    /// A sharded commit at `moment`, written in parallel: the coordinator's decision and data id
    /// reach every member, each copies its parts ([`crate::train::parts::parts`]) and writes them
    /// in a thread of its own, which tells the coordinator what they came to; the coordinator
    /// commits the record once every member has said ([`Driver::settle`]). Training waits for
    /// none of it: a step's commit due while another is open is skipped. An epoch's end waits for
    /// the open commit first, unless the storage failed under it (then it is skipped too); the
    /// last moments (the run's end, a stop) wait for it, then write theirs and wait for it; for
    /// those, the sequence of the commit waited for.
    pub(super) fn commit_in_parts(
        &mut self,
        moment: Moment,
        state: &TrainState,
        session: &mut Session,
    ) -> Result<Option<u64>, Interrupt> {
        let plan = self.plan_in_parts(moment, state, session)?;
        let id = match &plan {
            Parts::Commit(id, _) => id.clone().into_bytes(),
            Parts::Done(_) => Vec::new(),
        };
        let id = broadcast(session, self.coordinator, id)?;
        if id.is_empty() {
            return Ok(match plan {
                Parts::Done(waited) => waited,
                Parts::Commit(..) => unreachable!("the coordinator sent its data id"),
            });
        }
        let id = String::from_utf8_lossy(&id).into_owned();
        let Optim::Sharded(optimizer) = &state.optimizer else { unreachable!("committed in parts only when sharded") };
        let (place, began) = (session.collective().rank(), Instant::now());
        let buffers = self.coordinates.then_some(&state.model.buffers[..]);
        let parts = crate::train::parts::parts(&state.model.params, buffers, optimizer, place);
        let c = self.committer.as_mut().expect("a member with checkpoints writes parts");
        if !moment.last() {
            write_in_background(c.checkpointer().parts_writer(), session, (&id, parts))?;
            if let Parts::Commit(id, score) = plan {
                let position = state.position().clone();
                let failures = c.checkpointer().transient_failures();
                let (generation, id) = (session.generation(), id);
                self.open = Some(Open { generation, id, moment, position, score, began, failures });
            }
            return Ok(None);
        }
        let written = c.checkpointer().write_parts(&id, &parts).map_err(|e| e.to_string());
        let written = exchange(session, written)?;
        match (plan, self.committer.as_mut()) {
            (Parts::Commit(id, score), Some(c)) => {
                let parts = ((id, written), began);
                c.commit_parts((moment, state.position()), parts, score, &mut self.report).map_err(Interrupt::Fatal)
            }
            _ => Ok(None),
        }
    }

    /// The coordinator's decision at `moment` ([`Driver::commit_in_parts`]), after it settled the
    /// open commit as the moment says; `Parts::Done` elsewhere.
    fn plan_in_parts(&mut self, moment: Moment, state: &TrainState, session: &mut Session) -> Result<Parts, Interrupt> {
        // An epoch's end waits for a slow store, not a failing one: then it is skipped.
        let failing = self
            .open
            .as_ref()
            .zip(self.committer.as_mut())
            .is_some_and(|(open, c)| c.checkpointer().transient_failures() > open.failures);
        if moment != Moment::Step {
            self.settle(session, moment.last() || !failing)?;
        }
        let open = self.open.as_ref().map(|_| if failing { Busy::Retrying } else { Busy::Making });
        Ok(match self.committer.as_mut().filter(|_| self.coordinates) {
            Some(c) => c.plan_parts(moment, state, open, &mut self.report),
            None => Parts::Done(None),
        })
    }

    /// On the coordinator: the open sharded commit's record started (in the background) once every
    /// member has said what its parts came to; with `wait`, waiting until they have, or the
    /// generation ends (a member lost). A commit of a generation that ended is abandoned: its
    /// parts are this writer's data, collected by a later commit.
    pub(super) fn settle(&mut self, session: &mut Session, wait: bool) -> Result<(), Interrupt> {
        let Some(open) = &self.open else { return Ok(()) };
        if open.generation != session.generation() {
            self.open = None;
            return Ok(());
        }
        let gone = || if wait { session.ended().map(|()| false) } else { Ok(true) };
        let Some(said) = parts_said(session, open, gone)? else { return Ok(()) };
        let open = self.open.take().expect("open");
        self.record(session, open, said).map_err(Interrupt::Fatal)
    }

    /// The record of the `open` commit started, from what every member `said` of its parts.
    fn record(&mut self, session: &Session, open: Open, said: BTreeMap<usize, Said>) -> Result<(), TrainError> {
        let Open { id, moment, position, score, began, .. } = open;
        let written = entries(session, said);
        let c = self.committer.as_mut().expect("the coordinator commits");
        c.commit_parts((moment, &position), ((id, written), began), score, &mut self.report)?;
        Ok(())
    }

    /// On the coordinator, as every member goes back to the last commit after a verdict of the
    /// generation that just ended (every member was alive to give its digest, and its writer goes
    /// on after the generation's end): the open commit's record is made first, once every member
    /// of that generation has said what its parts came to, so that the run goes back to it
    /// rather than to the commit before it (or, for the run's first, to nothing: the run would
    /// start over). Found by a repeated run under load, 2026-11-29: a range's copies found
    /// different at step 30 while the commit of step 25 was still being written. Waits at most
    /// ten heartbeat deadlines (a member that died meanwhile never says); the commit is then left
    /// as it was, its parts collected by a later commit.
    pub(super) fn finish_open(&mut self, session: &Session) -> Result<(), TrainError> {
        let Some(open) = self.open.take() else { return Ok(()) };
        let until = Instant::now() + self.cfg.timeouts.heartbeat_deadline * 10;
        let stop = &self.stop;
        let gone = || Ok::<_, TrainError>(Instant::now() >= until || stop.load(std::sync::atomic::Ordering::Relaxed));
        let Some(said) = parts_said(session, &open, gone)? else {
            self.report.line(&format!(
                "trainerd: the commit of step {} was still being written as generation {} ended: left unfinished",
                open.position.global_step, open.generation
            ));
            return Ok(());
        };
        self.record(session, open, said)
    }
}

/// What every member said of `open`'s parts, asked every 5 ms until they all have (`Some`) or
/// `gone` says it is no longer waited for (`None`), or fails.
fn parts_said<E>(
    session: &Session,
    open: &Open,
    mut gone: impl FnMut() -> Result<bool, E>,
) -> Result<Option<BTreeMap<usize, Said>>, E> {
    loop {
        if let Some(said) = session.parts_said(open.generation, &open.id) {
            return Ok(Some(said));
        }
        if gone()? {
            return Ok(None);
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// A sharded commit whose parts the members are writing, on the coordinator until every member
/// has said what they came to: the generation it was planned in, its data id, and what its record
/// says (the moment, the state's position, an epoch-end commit's score), from when.
pub(super) struct Open {
    generation: u64,
    id: String,
    moment: Moment,
    position: Position,
    score: Option<Score>,
    began: Instant,
    /// The location's transient failures when it began.
    failures: u64,
}

/// Writes this member's `parts` of the commit `id` with `writer` in a thread of its own, which then
/// tells the coordinator what they came to (the entries, or why not).
fn write_in_background(
    writer: PartsWriter,
    session: &Session,
    (id, parts): (&str, Vec<Part>),
) -> Result<(), Interrupt> {
    let reporter = session.parts_reporter().expect("a sharded commit has a cluster");
    let (generation, id, step) = (session.generation(), id.to_string(), trainerd_failpoint::step());
    let writing = move || {
        trainerd_failpoint::set_thread_step(step);
        let written = writer.write(&id, &parts).map_err(|e| e.to_string());
        reporter.say((generation, &id), written.map(|e| serde_json::to_string(&e).expect("plain data")));
    };
    let spawned = std::thread::Builder::new().name("trainerd-parts".into()).spawn(writing);
    spawned.map(drop).map_err(|source| Interrupt::Fatal(TrainError::Start { what: "the thread writing parts", source }))
}

/// Every member's entries of its parts (`said`, by rank), put together; or why not, naming each
/// member that could not write its part.
fn entries(session: &Session, said: BTreeMap<usize, Said>) -> Result<Vec<BlobEntry>, String> {
    put_together(said.into_iter().map(|(rank, said)| {
        (session.name(rank), said.map(|json| serde_json::from_str(&json).map_err(|e| e.to_string())))
    }))
}

/// Every member's entries of its parts, by place, put together; or why not, naming each member
/// that could not write its part. One broadcast per member (each the root of its own).
fn exchange(
    session: &mut Session,
    mine: Result<Vec<BlobEntry>, String>,
) -> Result<Result<Vec<BlobEntry>, String>, Interrupt> {
    let place = session.collective().rank();
    let bytes = serde_json::to_vec(&mine).expect("plain data");
    let mut reports = Vec::new();
    for root in 0..session.collective().world() {
        let sent = if root == place { bytes.clone() } else { Vec::new() };
        let got = broadcast(session, root, sent)?;
        let report = match serde_json::from_slice::<Result<Vec<BlobEntry>, String>>(&got) {
            Ok(written) => written.map(Ok),
            Err(e) => Ok(Err(e.to_string())),
        };
        reports.push((session.name_at(root), report));
    }
    Ok(put_together(reports.into_iter()))
}

/// Each member's (name, report) put together: the entries of them all, or why not, naming each
/// member that could not write its part (`Err`) or whose report cannot be read (`Ok(Err)`).
fn put_together(
    reports: impl Iterator<Item = (String, Result<Result<Vec<BlobEntry>, String>, String>)>,
) -> Result<Vec<BlobEntry>, String> {
    let (mut entries, mut failed) = (Vec::new(), Vec::new());
    for (name, report) in reports {
        match report {
            Ok(Ok(theirs)) => entries.extend(theirs),
            Ok(Err(e)) => failed.push(format!("{name}'s report of its part cannot be read: {e}")),
            Err(why) => failed.push(format!("{name} could not write its part: {why}")),
        }
    }
    if failed.is_empty() {
        Ok(entries)
    } else {
        Err(failed.join("; "))
    }
}

/// The bytes the member at place `root` sends every member (`bytes` there; ignored elsewhere).
fn broadcast(session: &mut Session, root: usize, bytes: Vec<u8>) -> Result<Vec<u8>, Interrupt> {
    session.collective().broadcast_bytes(root, bytes).map_err(|e| session.interrupt(e.into()))
}
