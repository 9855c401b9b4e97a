//! Commits on a member: the coordinator's, and sharded commits (docs/fault-tolerance.md, "Sharded
//! commits"): whether every member
//! reaches the checkpoint location (a probe as a generation forms), and, where they do, each
//! commit written in parallel: the coordinator decides and names the commit's data id, every
//! member writes its parts under it, and the coordinator commits the record once every part is
//! durable and reported.

use std::collections::BTreeSet;
use std::time::Instant;

use trainerd_storage::BlobEntry;

use super::Driver;
use crate::optim::sharded::ShardedOptimizer;
use crate::state::{Optim, TrainState};
use crate::train::commit::{Moment, Parts};
use crate::train::session::{Interrupt, Session};
use crate::train::TrainError;

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
    /// reach every member, each writes its parts under it ([`crate::train::parts::parts`]), every
    /// member's entries (or why it failed) reach the coordinator, and it commits the record in
    /// the background. For the last moments, the sequence of the commit waited for.
    pub(super) fn commit_in_parts(
        &mut self,
        moment: Moment,
        state: &TrainState,
        session: &mut Session,
    ) -> Result<Option<u64>, Interrupt> {
        let plan = match self.committer.as_mut().filter(|_| self.coordinates) {
            Some(c) => c.plan_parts(moment, state, &mut self.report),
            None => Parts::Done(None),
        };
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
        let written = self.write_parts(state, optimizer, (&id, place));
        let written = exchange(session, written)?;
        match (plan, self.committer.as_mut()) {
            (Parts::Commit(id, score), Some(c)) => {
                let parts = ((id, written), began);
                c.commit_parts((moment, state), parts, score, &mut self.report).map_err(Interrupt::Fatal)
            }
            _ => Ok(None),
        }
    }

    /// This member's parts written under data id `id` (it is `place`), or why not.
    fn write_parts(
        &mut self,
        state: &TrainState,
        optimizer: &ShardedOptimizer,
        (id, place): (&str, usize),
    ) -> Result<Vec<BlobEntry>, String> {
        let buffers = self.coordinates.then_some(&state.model.buffers[..]);
        let parts = crate::train::parts::parts(&state.model.params, buffers, optimizer, place);
        let c = self.committer.as_mut().expect("a member with checkpoints writes parts");
        c.checkpointer().write_parts(id, &parts).map_err(|e| e.to_string())
    }
}

/// Every member's entries of its parts, by place, put together; or why not, naming each member
/// that could not write its part. One broadcast per member (each the root of its own).
fn exchange(
    session: &mut Session,
    mine: Result<Vec<BlobEntry>, String>,
) -> Result<Result<Vec<BlobEntry>, String>, Interrupt> {
    let place = session.collective().rank();
    let bytes = serde_json::to_vec(&mine).expect("plain data");
    let (mut entries, mut failed) = (Vec::new(), Vec::new());
    for root in 0..session.collective().world() {
        let sent = if root == place { bytes.clone() } else { Vec::new() };
        let got = broadcast(session, root, sent)?;
        match serde_json::from_slice::<Result<Vec<BlobEntry>, String>>(&got) {
            Ok(Ok(theirs)) => entries.extend(theirs),
            Ok(Err(why)) => failed.push(format!("{} could not write its part: {why}", session.name_at(root))),
            Err(e) => failed.push(format!("{}'s report of its part cannot be read: {e}", session.name_at(root))),
        }
    }
    Ok(if failed.is_empty() { Ok(entries) } else { Err(failed.join("; ")) })
}

/// The bytes the member at place `root` sends every member (`bytes` there; ignored elsewhere).
fn broadcast(session: &mut Session, root: usize, bytes: Vec<u8>) -> Result<Vec<u8>, Interrupt> {
    session.collective().broadcast_bytes(root, bytes).map_err(|e| session.interrupt(e.into()))
}
