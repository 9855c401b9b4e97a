//! When the chief commits: a pure policy ([`decide`]) maps (the moment, the state's position, the
//! settings, the last commit) to commit, wait or skip, with no I/O, so that every rule is a plain
//! unit test; the chief's [`Committer`] carries the decisions out through the [`Checkpointer`]
//! (which does the how). Only the chief has a committer.

use trainerd_sdk::PluginInfo;
use trainerd_storage::{Blob, BlobEntry, Mode, Score};

use super::error::TrainError;
use super::report::Reporter;
use crate::checkpoint::{Checkpointer, Finished};
use crate::state::{Meta, Position, Reader, TrainState};

/// Where the loop is when it asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Moment {
    /// A step is done.
    Step,
    /// An epoch is done and evaluated.
    EpochEnd,
    /// Every epoch is done: the run's last commit, which the cluster waits for.
    Finish,
    /// A stop signal: the state is committed, and waited for, before the members leave.
    Stop,
}

impl Moment {
    /// Whether the loop waits for the commit before it goes on (it is the run's last word).
    pub(crate) fn last(self) -> bool {
        matches!(self, Moment::Finish | Moment::Stop)
    }
}

/// The settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Policy {
    /// Commit every this many global steps (0: only at epoch ends).
    pub(crate) every: u64,
    /// Steps in an epoch (the epoch's last step is committed at its end, after evaluation).
    pub(crate) steps_per_epoch: u64,
}

/// The state of the last commit, as the checkpointer knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Last {
    /// This state (or a later one) is already committed or on its way.
    pub(crate) holds: bool,
    /// A commit is still uploading and the storage failed under it.
    pub(crate) stuck: bool,
}

/// What to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Commit the state; for the last moments, then wait for the commit.
    Commit,
    /// The state is already on its way: wait for the commit in flight.
    Wait,
    /// Nothing now.
    Skip(Skip),
}

/// Why nothing is committed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Skip {
    /// No commit is due at this step.
    NotDue,
    /// This state is already committed or on its way.
    Held,
    /// The previous commit is stuck on failing storage: training does not wait for an outage,
    /// except at the end of the run or a stop.
    Stuck,
    /// This process holds no state of the run yet (nothing to commit).
    NoState,
}

/// What to do at `moment` with a state at `position` (`live`: a state of the run).
pub(crate) fn decide(moment: Moment, position: &Position, live: bool, policy: Policy, last: Last) -> Action {
    if !live {
        return Action::Skip(Skip::NoState);
    }
    let due = match moment {
        Moment::Step => {
            policy.every > 0
                && position.global_step.is_multiple_of(policy.every)
                && position.step_in_epoch < policy.steps_per_epoch
        }
        Moment::EpochEnd | Moment::Finish | Moment::Stop => true,
    };
    if !due {
        return Action::Skip(Skip::NotDue);
    }
    match (last.holds, moment.last()) {
        (true, true) => Action::Wait,
        (true, false) => Action::Skip(Skip::Held),
        (false, false) if last.stuck => Action::Skip(Skip::Stuck),
        (false, _) => Action::Commit,
    }
}

/// What the coordinator does at a moment of a sharded commit ([`Committer::plan_parts`]).
#[derive(Debug, PartialEq)]
pub(crate) enum Parts {
    /// Commit now: the members write their parts under this data id; the epoch-end commit's
    /// score.
    Commit(String, Option<Score>),
    /// Nothing to write: the sequence of the commit in flight, if it was waited for and committed.
    Done(Option<u64>),
}

/// The chief's commits: the policy's decisions, carried out.
pub(crate) struct Committer {
    checkpointer: Checkpointer,
    policy: Policy,
    info: PluginInfo,
    workers: usize,
    run_config: String,
    /// The figure whose best commit retention keeps (`--keep-best`).
    best: Option<(String, Mode)>,
    /// An epoch-end state whose commit was skipped on failing storage, the best of those, kept
    /// in host memory until the next commit (docs/best-checkpoint.md).
    pending: Option<(Vec<Blob>, Meta, Score)>,
    /// The checkpoints skipped in a row since the last commit started.
    skipped: Option<Skipped>,
}

/// Why a checkpoint due was skipped: the previous commit is still being made (its parts, record
/// or collection: a commit takes longer than the interval), or it is retrying failing storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Busy {
    Making,
    Retrying,
}

/// Checkpoints skipped in a row for one reason: the first is said as it is skipped, the rest
/// counted in one line as the next commit starts (a line per step flooded the soak's logs).
#[derive(Debug)]
struct Skipped {
    first: u64,
    last: u64,
    count: u64,
    why: Busy,
}

impl Committer {
    /// Commits through `checkpointer` by `policy`, each commit's metadata naming `info`'s
    /// plugin, `workers` and `run_config` (canonical JSON).
    pub(crate) fn new(
        checkpointer: Checkpointer,
        policy: Policy,
        info: &PluginInfo,
        workers: usize,
        run_config: String,
    ) -> Self {
        let (best, pending, skipped) = (None, None, None);
        Committer { checkpointer, policy, info: info.clone(), workers, run_config, best, pending, skipped }
    }

    /// Puts the newest commit that verifies into `state` (a sharded run whose member was lost
    /// goes back to it), once this member's own commit in flight, if any, has ended; its
    /// sequence and global step, or `None` when there is no commit.
    pub(crate) fn restore_latest(
        &mut self,
        state: &mut TrainState,
        report: &mut Reporter<'_>,
    ) -> Result<Option<(u64, u64)>, TrainError> {
        let location = self.checkpointer.location().to_string();
        if let Some(f) = self.checkpointer.wait() {
            report.commit_finished(&location, &f);
        }
        let (restored, _) = self.checkpointer.restore()?;
        let Some(r) = restored else { return Ok(None) };
        let reader = Reader::Training { workers: self.workers, run_config: &self.run_config };
        let meta = Meta::read(&r, &self.info, reader)
            .map_err(|source| TrainError::Unfit { location: location.clone(), source })?;
        let step = meta.position.global_step;
        state
            .restore(&r, meta.position)
            .map_err(|source| TrainError::Restore { location, source: Box::new(source) })?;
        Ok(Some((r.record.sequence, step)))
    }

    /// Scores every epoch-end commit by `best` (figure and mode), so that retention keeps the
    /// best one.
    pub(crate) fn keeping_best(mut self, best: Option<(String, Mode)>) -> Self {
        self.best = best;
        self
    }

    /// The score of an epoch-end commit of a state at `position`; none for a value that is not
    /// finite (a diverged epoch is never best, and JSON has no NaN to write in the record).
    fn score(&self, position: &Position) -> Option<Score> {
        let (metric, mode) = self.best.as_ref()?;
        let figures =
            crate::state::epoch_figures(&self.info.metrics, &position.last_epoch, position.last_eval.as_ref());
        let value = figures.iter().find(|(name, _)| name == metric)?.1;
        value.is_finite().then(|| Score { metric: metric.clone(), value, mode: *mode })
    }

    /// Keeps the state at an epoch's end whose commit is skipped, if it beats the one kept.
    fn keep_pending(&mut self, state: &TrainState, score: Score, report: &mut Reporter<'_>) -> Result<(), TrainError> {
        if !score.beats(self.pending.as_ref().map(|(_, _, s)| s)) {
            return Ok(());
        }
        let position = state.position();
        let meta = Meta::new(position.clone(), &self.info, self.workers, &self.run_config);
        report.line(&format!(
            "trainerd: keeping the state of epoch {} ({} {:.4}) in memory, to commit when storage returns",
            position.epoch, score.metric, score.value
        ));
        self.pending = Some((state.blobs()?, meta, score));
        Ok(())
    }

    /// Commits the kept epoch-end state, if any, before the state the loop commits next (`next`:
    /// its score, which may make the kept one pointless).
    fn commit_pending(&mut self, next: Option<&Score>, report: &mut Reporter<'_>) -> Result<(), TrainError> {
        let Some((blobs, meta, score)) = self.pending.take() else { return Ok(()) };
        if next.is_some_and(|n| n.beats(Some(&score))) {
            return Ok(());
        }
        let previous = self.checkpointer.commit(blobs, &meta, Some(score))?;
        if let Some(f) = previous {
            report.commit_finished(self.checkpointer.location(), &f);
        }
        Ok(())
    }

    /// Starts committing `state` with `score` (after the kept state, if any: once, when the kept
    /// state is this one).
    fn commit_now(
        &mut self,
        state: &TrainState,
        score: Option<Score>,
        report: &mut Reporter<'_>,
    ) -> Result<(), TrainError> {
        let progress = state.position().progress();
        if self.pending.as_ref().is_some_and(|(_, meta, _)| meta.position.progress() == progress) {
            let (blobs, meta, kept) = self.pending.take().expect("checked");
            let previous = self.checkpointer.commit(blobs, &meta, Some(score.unwrap_or(kept)))?;
            if let Some(f) = previous {
                report.commit_finished(self.checkpointer.location(), &f);
            }
            return Ok(());
        }
        self.commit_pending(score.as_ref(), report)?;
        let meta = Meta::new(state.position().clone(), &self.info, self.workers, &self.run_config);
        let blobs = state.blobs()?;
        let previous = self.checkpointer.commit(blobs, &meta, score)?;
        if let Some(f) = previous {
            report.commit_finished(self.checkpointer.location(), &f);
        }
        Ok(())
    }

    /// The run configuration every commit records (a commit read must be of it).
    pub(crate) fn run_config(&self) -> &str {
        &self.run_config
    }

    /// The checkpointer (restoring, its location, the generation commits carry).
    pub(crate) fn checkpointer(&mut self) -> &mut Checkpointer {
        &mut self.checkpointer
    }

    /// Reports a commit that has finished, without waiting.
    fn poll(&mut self, report: &mut Reporter<'_>) {
        if let Some(f) = self.checkpointer.poll() {
            report.commit_finished(self.checkpointer.location(), &f);
        }
    }

    /// Does what the policy decides at `moment` for `state`. For the last moments, returns the
    /// sequence of the commit waited for, if it committed.
    pub(crate) fn at(
        &mut self,
        moment: Moment,
        state: &TrainState,
        report: &mut Reporter<'_>,
    ) -> Result<Option<u64>, TrainError> {
        if moment == Moment::Step {
            // A commit that finished since the last step is reported now, not when the next one
            // starts: its line, its event, the metrics and the last error stay current.
            self.poll(report);
        }
        let position = state.position();
        let score = if moment == Moment::EpochEnd { self.score(position) } else { None };
        match self.decide(moment, state, report) {
            Action::Skip(Skip::Stuck) => {
                self.skip(position, Busy::Retrying, report);
                if let Some(score) = score {
                    self.keep_pending(state, score, report)?;
                }
                Ok(None)
            }
            Action::Skip(_) => Ok(None),
            // Never with a kept state: the commit that holds this state took the kept one first.
            Action::Wait => Ok(self.wait(report)),
            Action::Commit => {
                self.said_skipped(report);
                self.commit_now(state, score, report)?;
                Ok(if moment.last() { self.wait(report) } else { None })
            }
        }
    }

    /// The policy's decision at `moment` for `state`. A commit to start waits for the one in
    /// flight first, and is skipped as stuck should the storage fail under that one meanwhile.
    fn decide(&mut self, moment: Moment, state: &TrainState, report: &mut Reporter<'_>) -> Action {
        let position = state.position();
        let last = |c: &Checkpointer| Last { holds: c.has(position.progress()), stuck: c.stuck() };
        let action = decide(moment, position, state.model.live, self.policy, last(&self.checkpointer));
        if action != Action::Commit {
            return action;
        }
        if let Some(f) = self.checkpointer.wait_unless_stuck() {
            report.commit_finished(self.checkpointer.location(), &f);
        }
        decide(moment, position, state.model.live, self.policy, last(&self.checkpointer))
    }

    /// Says that the checkpoint of the state at `position` is skipped, the previous commit being
    /// `why` busy: the first of a row in a line, the others counted ([`Committer::said_skipped`]).
    pub(crate) fn skip(&mut self, position: &Position, why: Busy, report: &mut Reporter<'_>) {
        let step = position.global_step;
        if let Some(s) = self.skipped.as_mut().filter(|s| s.why == why) {
            (s.last, s.count) = (step, s.count + 1);
            return;
        }
        self.said_skipped(report);
        let busy = match why {
            Busy::Making => "is still being made",
            Busy::Retrying => "is still retrying",
        };
        let location = self.checkpointer.location();
        report.line(&format!("warning: checkpoint at step {step} skipped: the previous commit to {location} {busy}"));
        self.skipped = Some(Skipped { first: step, last: step, count: 1, why });
    }

    /// Says how many checkpoints were skipped in the row that ends (a commit starts), where more
    /// than its first, which was said as it was skipped.
    fn said_skipped(&mut self, report: &mut Reporter<'_>) {
        let Some(Skipped { first, last, count, why }) = self.skipped.take().filter(|s| s.count > 1) else { return };
        let location = self.checkpointer.location();
        let why = match why {
            Busy::Making => "was being made: each commit takes longer than --checkpoint-every steps here",
            Busy::Retrying => "was retrying",
        };
        report.line(&format!(
            "warning: {count} checkpoints skipped, steps {first} to {last}, while the previous commit to {location} {why}"
        ));
    }

    /// The policy's decision at `moment` for a state whose members write their parts of each
    /// commit (docs/fault-tolerance.md, "Sharded commits"): a commit to start now, under a fresh
    /// data id, or what was done instead. `open` says why, if so, the previous commit's parts are
    /// still being written. (An epoch-end state skipped on failing storage is not kept for later:
    /// no member holds it whole.)
    pub(crate) fn plan_parts(
        &mut self,
        moment: Moment,
        state: &TrainState,
        open: Option<Busy>,
        report: &mut Reporter<'_>,
    ) -> Parts {
        if moment == Moment::Step {
            self.poll(report);
        }
        let position = state.position();
        // One commit at a time: the one in flight ends first, its collection included (that
        // deletes this writer's data that no record names but its own, which the parts about to
        // be written under the new data id would be: the soak found records naming parts so
        // deleted). A step's commit due meanwhile is skipped, so that training never waits for
        // storage; an epoch's end and the last moments wait for it (the driver settled the open
        // one, unless failing).
        let stuck = self.checkpointer.stuck();
        let busy = (moment == Moment::Step && self.checkpointer.busy())
            .then_some(if stuck { Busy::Retrying } else { Busy::Making })
            .or(open);
        let last = Last { holds: self.checkpointer.has(position.progress()), stuck };
        if let Some(why) =
            busy.filter(|_| decide(moment, position, state.model.live, self.policy, last) == Action::Commit)
        {
            self.skip(position, why, report);
            return Parts::Done(None);
        }
        match self.decide(moment, state, report) {
            Action::Skip(Skip::Stuck) => {
                self.skip(position, Busy::Retrying, report);
                Parts::Done(None)
            }
            Action::Skip(_) => Parts::Done(None),
            Action::Wait => Parts::Done(self.wait(report)),
            Action::Commit => {
                self.said_skipped(report);
                if let Some(f) = self.checkpointer.wait() {
                    report.commit_finished(self.checkpointer.location(), &f);
                }
                let score = if moment == Moment::EpochEnd { self.score(position) } else { None };
                Parts::Commit(self.checkpointer.new_data_id(), score)
            }
        }
    }

    /// Starts committing `state` at `moment` from the parts every member wrote under data id `id`
    /// (`written`: their entries, or why a member could not write its part: then nothing is
    /// committed, and the previous commit stays the latest) since `began`, with an epoch-end
    /// commit's `score`.
    /// For the last moments, returns the sequence of the commit waited for, if it committed.
    pub(crate) fn commit_parts(
        &mut self,
        (moment, position): (Moment, &Position),
        ((id, written), began): ((String, Result<Vec<BlobEntry>, String>), std::time::Instant),
        score: Option<Score>,
        report: &mut Reporter<'_>,
    ) -> Result<Option<u64>, TrainError> {
        let location = self.checkpointer.location().to_string();
        match written {
            Ok(entries) => {
                let meta = Meta::new(position.clone(), &self.info, self.workers, &self.run_config);
                if let Some(f) = self.checkpointer.commit_parts((id, entries), &meta, (score, began))? {
                    report.commit_finished(&location, &f);
                }
            }
            Err(why) => {
                let (previous, failed) = self.checkpointer.failed_parts(position.progress(), &why);
                for f in previous.iter().chain([&failed]) {
                    report.commit_finished(&location, f);
                }
            }
        }
        Ok(if moment.last() { self.wait(report) } else { None })
    }

    /// Waits for the commit in flight and reports it; its sequence, if it committed.
    fn wait(&mut self, report: &mut Reporter<'_>) -> Option<u64> {
        report.committing(self.checkpointer.location());
        let finished = self.checkpointer.wait()?;
        report.commit_finished(self.checkpointer.location(), &finished);
        match finished {
            Finished::Committed { sequence, .. } => Some(sequence),
            Finished::Failed { .. } => None,
        }
    }

    /// Where the state at `progress` lives on after the run's last commit (`sequence`, if it
    /// committed).
    pub(crate) fn saved(&self, sequence: Option<u64>, progress: (u64, u64)) -> String {
        let c = &self.checkpointer;
        match sequence {
            Some(seq) => format!("committed as checkpoint {seq} in {}", c.location()),
            None if c.has(progress) => format!("already committed in {}", c.location()),
            None => format!(
                "not committed: {}",
                c.last_error().map_or_else(|| format!("no commit to {}", c.location()), String::from)
            ),
        }
    }

    /// Why the last commit failed, if it did.
    pub(crate) fn last_error(&self) -> Option<String> {
        self.checkpointer.last_error().map(String::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: Policy = Policy { every: 25, steps_per_epoch: 60 };
    const FREE: Last = Last { holds: false, stuck: false };

    fn at(global_step: u64, step_in_epoch: u64) -> Position {
        Position { global_step, step_in_epoch, ..Position::start(1) }
    }

    #[test]
    fn a_step_commits_every_n_global_steps_but_not_at_an_epochs_last_step() {
        assert_eq!(decide(Moment::Step, &at(25, 25), true, POLICY, FREE), Action::Commit);
        assert_eq!(decide(Moment::Step, &at(26, 26), true, POLICY, FREE), Action::Skip(Skip::NotDue));
        // Global step 75 is step 15 of epoch 2: due.
        assert_eq!(decide(Moment::Step, &at(75, 15), true, POLICY, FREE), Action::Commit);
        // The epoch's last step is committed at the epoch's end, after its evaluation.
        let end = Policy { every: 30, ..POLICY };
        assert_eq!(decide(Moment::Step, &at(60, 60), true, end, FREE), Action::Skip(Skip::NotDue));
        let never = Policy { every: 0, ..POLICY };
        assert_eq!(decide(Moment::Step, &at(50, 50), true, never, FREE), Action::Skip(Skip::NotDue));
    }

    #[test]
    fn epoch_ends_finishes_and_stops_are_always_due() {
        for moment in [Moment::EpochEnd, Moment::Finish, Moment::Stop] {
            assert_eq!(decide(moment, &at(61, 0), true, POLICY, FREE), Action::Commit, "{moment:?}");
        }
    }

    #[test]
    fn a_state_already_held_is_skipped_or_waited_for_at_the_end() {
        let held = Last { holds: true, stuck: false };
        assert_eq!(decide(Moment::Step, &at(25, 25), true, POLICY, held), Action::Skip(Skip::Held));
        assert_eq!(decide(Moment::EpochEnd, &at(60, 0), true, POLICY, held), Action::Skip(Skip::Held));
        assert_eq!(decide(Moment::Finish, &at(120, 0), true, POLICY, held), Action::Wait);
        assert_eq!(decide(Moment::Stop, &at(70, 10), true, POLICY, held), Action::Wait);
    }

    #[test]
    fn a_stuck_commit_skips_periodic_commits_but_not_the_last_one() {
        let stuck = Last { holds: false, stuck: true };
        assert_eq!(decide(Moment::Step, &at(50, 50), true, POLICY, stuck), Action::Skip(Skip::Stuck));
        assert_eq!(decide(Moment::EpochEnd, &at(60, 0), true, POLICY, stuck), Action::Skip(Skip::Stuck));
        assert_eq!(decide(Moment::Finish, &at(120, 0), true, POLICY, stuck), Action::Commit);
        assert_eq!(decide(Moment::Stop, &at(70, 10), true, POLICY, stuck), Action::Commit);
    }

    #[test]
    fn a_process_without_a_state_of_the_run_commits_nothing() {
        assert_eq!(decide(Moment::Stop, &at(0, 0), false, POLICY, FREE), Action::Skip(Skip::NoState));
    }
}
