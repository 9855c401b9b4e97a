//! The replicas compared, so that silent corruption (a bit flipped by faulty memory or a faulty
//! core) is caught and undone (docs/fault-tolerance.md, "Replicas compared"). At the points
//! [`due`] names, every member hashes its encoded state (xxh3-64) and one all-reduce gives every
//! member every digest. Equal: the bytes are kept as the *agreed* state. Different: every member
//! computes the same [`verdict`], names the odd ones, goes back to its agreed state (the odd ones
//! drop theirs), and abandons the generation; the next formation hands the agreed state to
//! whoever lacks it, and the steps since are trained again, so the run stays the failure-free
//! one, bit for bit. A comparison cut short (a member lost during its exchange) undoes nothing:
//! the members keep the compared state, *owe* the comparison, and finish it as the next
//! generation forms ([`Integrity::flags`]). A mismatch found is never forgotten: a member that
//! finds one which sends the run back tells every peer before it acts on it ([`Session::tell`]),
//! so that the next formation goes back even when the finder dropped its state, died, or was the
//! only member whose comparison completed ([`Integrity::heard`]).

use std::time::Instant;

mod agreed;
mod digests;

use agreed::Agreed;

pub(crate) use digests::ranges_differ;
use digests::{digest, exchange, parameters, parameters_alone, range_digests, split_digests};

use super::config::RunConfig;
use super::report::Reporter;
use super::session::{Interrupt, Session};
use super::sharded_step::Read;
use super::summary::{ReplicaFigures, ReplicaMismatch};
use crate::cluster::finding::Finding;
use crate::state::{Optim, Position, Shareable, TrainState};

/// When this member compares: every `every` global steps (agreed by every member), and before
/// the commits of any member that may coordinate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Schedule {
    /// Every this many global steps (0: only before commits).
    pub(crate) every: u64,
    /// This member's checkpoint interval in steps (0: epoch ends only, or no checkpoints). The
    /// members exchange theirs with each generation, so that the commits of whoever coordinates
    /// are compared first, though only the chief may have checkpoints.
    pub(crate) commits: u64,
}

impl Schedule {
    /// The run's: `--replica-check-every`, and this member's checkpoint interval.
    pub(crate) fn of(cfg: &RunConfig) -> Schedule {
        Schedule { every: cfg.replica_check_every, commits: cfg.checkpoint.as_ref().map_or(0, |c| c.every) }
    }
}

/// Whether a check is due after the step that brought the state to `position`: on the interval
/// `every`, or on any member's checkpoint interval in `commits` (an epoch's last step is checked
/// at the epoch's end, before its evaluation).
pub(crate) fn due(every: u64, commits: &[u64], position: &Position, steps_per_epoch: u64) -> bool {
    let step = position.global_step;
    let on = |every: u64| every > 0 && step.is_multiple_of(every);
    (on(every) || commits.iter().any(|&c| on(c))) && position.step_in_epoch < steps_per_epoch
}

/// The digest taken as right, and the members' places (in the generation's ring order) that
/// hold another.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Verdict {
    pub(crate) right: u64,
    pub(crate) odd: Vec<usize>,
}

/// `None` when every digest is the same; else the digest a strict majority holds (or, without
/// one, the coordinator's, at place `coordinator`) and the places that differ from it.
pub(crate) fn verdict(digests: &[u64], coordinator: usize) -> Option<Verdict> {
    if digests.iter().all(|&d| d == digests[0]) {
        return None;
    }
    let held = |d: u64| digests.iter().filter(|&&x| x == d).count();
    let right = digests.iter().copied().find(|&d| 2 * held(d) > digests.len()).unwrap_or(digests[coordinator]);
    let odd = (0..digests.len()).filter(|&p| digests[p] != right).collect();
    Some(Verdict { right, odd })
}

/// A member's comparisons.
pub(crate) struct Integrity {
    schedule: Schedule,
    /// Every member's checkpoint interval in the current generation (those not 0).
    commits: Vec<u64>,
    /// This process has been in a formation.
    formed_once: bool,
    /// The last agreed state, and where its file goes: the worker's state directory, else `$TMPDIR`.
    agreed: Option<Agreed>,
    dir: std::path::PathBuf,
    /// The step of a comparison this member entered that did not complete: its state is still
    /// that step's, not yet compared.
    owed: Option<u64>,
    /// The step of a comparison whose verdict (a mismatch) sent the run back before it, found
    /// here or told by a peer: a formation that hands this member a state at or past that step
    /// took a state the verdict did not reach.
    mismatch_at: Option<u64>,
    /// The global step at which every member last held the same state: this member's last
    /// formation, or its last comparison that found every state equal. A mismatch found after it
    /// condemns the steps since (a corrupted replica's gradients went into their updates); one
    /// found at it condemns only the odd replicas.
    equal_at: u64,
    /// The earliest finding a peer told of the comparison that sent the run back, while it is
    /// owed: what this member says when the formation goes back.
    heard: Option<Finding>,
    figures: ReplicaFigures,
    /// A comparison found this member's parameters alone corrupted under sharding: it dropped its
    /// state but keeps its ranges of the optimizer state (see [`Integrity::take_parameters`]).
    ranges_kept: bool,
    /// A verdict sent this member back, every member of its generation alive as it was reached
    /// (each gave its digest): their writers of an open sharded commit's parts are too.
    sent_back: bool,
}

/// What a member tells the others of its comparisons as a generation forms at some step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Flags {
    /// A mismatch it found sent it back from that step or an earlier one: the formation's state
    /// was not compared, and every member must go back to its agreed state.
    pub(crate) mismatch: bool,
    /// It owes the comparison of that step: every member compares before the first step.
    pub(crate) owes: bool,
}

impl Integrity {
    /// Comparisons on `schedule`.
    pub(crate) fn new(schedule: Schedule) -> Integrity {
        let figures = ReplicaFigures { every: schedule.every, ..ReplicaFigures::default() };
        Integrity {
            schedule,
            commits: vec![schedule.commits],
            formed_once: false,
            agreed: None,
            dir: std::env::temp_dir(),
            owed: None,
            mismatch_at: None,
            equal_at: 0,
            heard: None,
            figures,
            ranges_kept: false,
            sent_back: false,
        }
    }

    /// The agreed state's file goes in `dir` (the worker's state directory).
    pub(crate) fn keeping_in(self, dir: Option<&std::path::Path>) -> Integrity {
        Integrity { dir: dir.map_or_else(std::env::temp_dir, |d| d.to_path_buf()), ..self }
    }

    /// Whether the last mismatch had this member drop its state but keep its ranges of the
    /// sharded optimizer state (asked once).
    pub(crate) fn take_ranges_kept(&mut self) -> bool {
        std::mem::take(&mut self.ranges_kept)
    }

    /// Whether a verdict (a comparison's, or a formation's) sent this member back since last
    /// asked: every member of the generation was alive when it was reached.
    pub(crate) fn take_sent_back(&mut self) -> bool {
        std::mem::take(&mut self.sent_back)
    }

    /// This member's schedule.
    pub(crate) fn schedule(&self) -> Schedule {
        self.schedule
    }

    /// The optimizer state was sharded: the agreed state (whole) is no longer one this member
    /// can go back to alone, and is not kept (a mismatch sends every member back to the last
    /// commit).
    pub(crate) fn forget_agreed(&mut self) {
        self.agreed = None;
    }

    /// The checkpoint intervals of the generation's members (exchanged as it formed).
    pub(crate) fn set_commits(&mut self, intervals: Vec<u64>) {
        self.commits = intervals.into_iter().filter(|&c| c > 0).collect();
    }

    /// Whether a check is due after the step that brought the state to `position`.
    pub(crate) fn due(&self, position: &Position, steps_per_epoch: u64) -> bool {
        due(self.schedule.every, &self.commits, position, steps_per_epoch)
    }

    /// What this member tells the others of a generation formed at global step `step`, where it
    /// `holds` the formation's state (its own or the source's: a member that dropped its state and
    /// received none, as every member does where none held one, flags nothing; the run's way back
    /// is then the last commit, not another comparison).
    pub(crate) fn flags(&self, step: u64, holds: bool) -> Flags {
        let mismatch = holds && self.mismatch_at.is_some_and(|s| step >= s);
        Flags { mismatch, owes: self.owed == Some(step) }
    }

    /// What peers found at comparisons of the generation this member was in, told before they
    /// acted on it: each sends the run back before its step, as this member's own finding would;
    /// one repaired in place (no step lost) is counted here too ([`Integrity::heard_in_place`]).
    /// The lines to say, with the odd members.
    pub(crate) fn heard(
        &mut self,
        findings: Vec<Finding>,
        (state, me): (&mut TrainState, &str),
    ) -> Vec<(String, Vec<String>)> {
        let mut said = Vec::new();
        for finding in findings {
            if finding.in_place {
                said.extend(self.heard_in_place(finding, (&mut *state, me)));
                continue;
            }
            if self.mismatch_at.is_none_or(|s| finding.step < s) {
                self.mismatch_at = Some(finding.step);
            }
            if self.heard.as_ref().is_none_or(|h| finding.step < h.step) {
                self.heard = Some(finding);
            }
        }
        said
    }

    /// A peer's finding repaired in place, unless this member found it itself: counted, so that
    /// every member's summary names every mismatch; where it names this member (`me`) at the step
    /// its `state` is at (its own exchange was cut short), this member drops its parameters and
    /// keeps its ranges, as had its exchange completed (else the formation would find its state
    /// differed, and send every member back to the last commit). The line to say.
    fn heard_in_place(
        &mut self,
        finding: Finding,
        (state, me): (&mut TrainState, &str),
    ) -> Option<(String, Vec<String>)> {
        let found = ReplicaMismatch { step: finding.step, members: finding.odd, back_to: Some(finding.step) };
        if self.counted(&found) {
            return None;
        }
        let named = found.members.iter().any(|m| m == me);
        let what = if named && state.live() && state.position().global_step == found.step {
            state.model.live = false;
            self.ranges_kept = matches!(state.optimizer, Optim::Sharded(_));
            DROPS_PARAMETERS
        } else {
            "no step is lost"
        };
        let said = (format!("trainerd: {} found: {}; {what}", finding.finder, finding.why), found.members.clone());
        self.mismatched(found);
        Some(said)
    }

    /// A generation formed on `state`. At this process's first formation, the state it brought
    /// (the initial one, or a restored commit, which was compared before it was committed)
    /// becomes its agreed state. Nothing else does: a state received from a peer, or trained since
    /// without a comparison, may already hold the gradients of a replica corrupted since the last
    /// comparison (its bits still wrong, unseen until the next one), and going back to it would
    /// keep them. The last comparison's state is kept instead; a member without one takes the
    /// agreed state from a peer when a comparison fails (the randomized soak found this).
    /// A comparison owed at another step is no longer this member's to finish (its state was
    /// replaced), and a formation before a mismatch's step is its repair.
    pub(crate) fn formed(&mut self, state: &TrainState, received: bool) -> Result<(), Interrupt> {
        let step = state.position().global_step;
        self.owed = self.owed.filter(|&s| s == step);
        self.mismatch_at = self.mismatch_at.filter(|&s| step >= s);
        self.heard = self.heard.take().filter(|_| self.mismatch_at.is_some());
        self.equal_at = step;
        let first = !std::mem::replace(&mut self.formed_once, true);
        // A sharded optimizer's state is not in the bytes: nothing to keep (see `check`).
        if !first || received || !state.live() || state.optimizer.whole().is_none() {
            return Ok(());
        }
        // The last agreed state dropped first: one kept at a time.
        self.agreed = None;
        self.agreed = Some(Agreed::keep(state, &self.dir, None).map_err(|e| Interrupt::Fatal(e.into()))?);
        Ok(())
    }

    /// Compares this member's `state` with every other member's of the session's generation
    /// (`coordinates`: this member coordinates it), and, with the optimizer state sharded over
    /// `ranges` ranges, each range's copies (its owner's and its buddy's). Equal: the state is the
    /// agreed one. Different: the verdict is told, the state put back or dropped, and the
    /// generation abandoned.
    pub(crate) fn check(
        &mut self,
        state: &mut TrainState,
        session: &mut Session,
        report: &mut Reporter<'_>,
        (coordinates, ranges): (bool, usize),
    ) -> Result<(), Interrupt> {
        let began = Instant::now();
        let digest = digest(state).map_err(|e| Interrupt::Fatal(e.into()))?;
        // Chaos tests hold a member here, so that its peers' comparison is cut short.
        trainerd_failpoint::point("replica-check");
        let mine = range_digests(state, ranges);
        let split = if ranges > 0 { split_digests(state).map_err(|e| Interrupt::Fatal(e.into()))? } else { (0, 0) };
        // Chaos tests stop a member inside the exchange (`replica-check/all-gather`): some members'
        // comparisons complete, some not.
        let region = trainerd_failpoint::region("replica-check");
        let exchanged = exchange(session, (digest, split), coordinates, &mine);
        drop(region);
        let (digests, coordinator) = match exchanged {
            Ok(exchanged) => exchanged,
            // Interrupted (a peer failed, or the generation ended): the verdict is unknown here.
            // The state is kept and the comparison finished as the next generation forms.
            Err(interrupt) => {
                self.cut_short(state, report, &interrupt);
                return Err(interrupt);
            }
        };
        self.figures.checks += 1;
        self.figures.seconds += began.elapsed().as_secs_f64();
        report.replica_checked();
        self.owed = None;
        let Some(verdict) = verdict(&digests.0, coordinator) else {
            if let Some(why) =
                ranges_differ(session, &format!("replica check at step {}", state.position().global_step), &digests.2)
            {
                // Two copies, no majority: neither is known right, and every member goes back to
                // the last commit (no sharded agreed state is kept).
                let holders = why.1.clone();
                return Err(self.go_back(state, session, report, (false, holders, why.0)));
            }
            // A sharded optimizer's state is not in the bytes, so they could not be gone back to:
            // a mismatch sends every member back to the last commit instead, and nothing is kept.
            self.agreed = None;
            if state.optimizer.whole().is_some() {
                // Its digest is the one just compared.
                let kept = Agreed::keep(state, &self.dir, Some(digest));
                self.agreed = Some(kept.map_err(|e| Interrupt::Fatal(e.into()))?);
            }
            self.equal_at = state.position().global_step;
            return Ok(());
        };
        if ranges > 0 {
            if let Some(odd) = parameters_alone(&digests.1, &verdict) {
                return Err(self.parameters_differ(state, session, report, (odd, &digests.1)));
            }
        }
        Err(self.repair(state, session, report, (&digests.0, &verdict)))
    }

    /// Under sharding, a comparison found the parameters of `odd` (places) alone differ from a
    /// strict majority's, and nothing else of the replicated state: the per-step check saw every
    /// step read equal parameters, so they were corrupted after the last all-gather and no
    /// gradient carried them. The odd members take a right member's parameters and keep their
    /// ranges, and no step is lost ([`Integrity::take_parameters`]).
    fn parameters_differ(
        &mut self,
        state: &mut TrainState,
        session: &mut Session,
        report: &mut Reporter<'_>,
        (odd, split): (Vec<usize>, &[(u64, u64)]),
    ) -> Interrupt {
        let params: Vec<u64> = split.iter().map(|s| s.0).collect();
        let (names, said) = parameters(session, &params, &odd);
        let why = format!(
            "replica check at step {}: {said}, and nothing else of the replicated state",
            state.position().global_step
        );
        let dropped = odd.contains(&session.collective().rank());
        self.take_parameters(state, session, report, (names, why, dropped))
    }

    /// After a mismatch: this member's state put back to the agreed one when its digest was
    /// right (else dropped), the mismatch told, and the generation abandoned.
    fn repair(
        &mut self,
        state: &mut TrainState,
        session: &mut Session,
        report: &mut Reporter<'_>,
        (digests, verdict): (&[u64], &Verdict),
    ) -> Interrupt {
        let step = state.position().global_step;
        let odd: Vec<String> = verdict.odd.iter().map(|&p| session.name_at(p)).collect();
        let right: Vec<String> =
            (0..digests.len()).filter(|p| !verdict.odd.contains(p)).map(|p| session.name_at(p)).collect();
        let mine = digests[session.collective().rank()];
        let found: Vec<String> = verdict.odd.iter().map(|&p| format!("{:016x}", digests[p])).collect();
        let why = format!(
            "replica check at step {step}: the state of {} differs from that of {} (xxh3 {} against {:016x})",
            odd.join(", "),
            right.join(", "),
            found.join(", "),
            verdict.right
        );
        self.go_back(state, session, report, (mine == verdict.right, odd, why))
    }

    /// The per-step check under sharding found the members' parameters differ as their step
    /// read them ([`Read`]), before anything was updated. With a strict majority, the odd members
    /// drop their state but keep their ranges of the optimizer state (a corrupted parameter never
    /// reaches them: ranges are updated from reduced gradients only after this check), the next
    /// formation hands them a right member's parameters, the step is trained again, and no step
    /// is lost. Without one, every member goes back to the last commit.
    pub(crate) fn read_differed(
        &mut self,
        state: &mut TrainState,
        session: &mut Session,
        report: &mut Reporter<'_>,
        read: &Read,
    ) -> Interrupt {
        let Some(verdict) = verdict(&read.digests, read.coordinator) else {
            unreachable!("told only where the digests differ")
        };
        let step = state.position().global_step + 1;
        let (odd, said) = parameters(session, &read.digests, &verdict.odd);
        let why = format!("replica check at step {step}, before its update, of the parameters it read: {said}");
        if 2 * verdict.odd.len() >= read.digests.len() {
            let why = format!("{why}, and no majority is right: every member goes back to the last commit");
            return self.go_back(state, session, report, (false, odd, why));
        }
        let dropped = read.digests[session.collective().rank()] != verdict.right;
        self.take_parameters(state, session, report, (odd, why, dropped))
    }

    /// A repair under sharding that loses no step: the odd members (`odd`; this one if `dropped`)
    /// drop their state but keep their ranges of the optimizer state (ranges are written from
    /// reduced gradients only, which no corrupted parameter reached), the next formation hands
    /// them a right member's parameters, and the others keep their state; `why` is told.
    fn take_parameters(
        &mut self,
        state: &mut TrainState,
        session: &mut Session,
        report: &mut Reporter<'_>,
        (odd, why, dropped): (Vec<String>, String, bool),
    ) -> Interrupt {
        let step = state.position().global_step;
        session.went_back_for_repair();
        self.went_back(step, Some(step));
        let what = match dropped {
            true => DROPS_PARAMETERS,
            false => "no step is lost: this worker keeps its state",
        };
        state.model.live &= !dropped;
        self.ranges_kept = dropped;
        // Told for the record: a peer whose exchange was cut short names it in its summary too.
        let kept = session.tell(step, (&odd, &why, true));
        tracing::debug!("the mismatch at step {step}, repaired in place, told to {kept} peer(s)");
        report.replica_mismatch(&format!("trainerd: {why}; {what}"), &odd);
        self.mismatched(ReplicaMismatch { step, members: odd, back_to: (!dropped).then_some(step) });
        Interrupt::Abandoned(why)
    }

    /// A formation found that these members (`odd`, places in the ring) held another state than
    /// the source's at the same step, and overwrote it: a corruption seen at the formation
    /// instead of a comparison. Every member goes back as after a mismatch (the overwritten
    /// state, since the last comparison, may hold the corrupted replica's gradients).
    pub(crate) fn differed_at_formation(
        &mut self,
        state: &mut TrainState,
        session: &mut Session,
        report: &mut Reporter<'_>,
        (odd, source): (&[usize], usize),
    ) -> Interrupt {
        let step = state.position().global_step;
        let names: Vec<String> = odd.iter().map(|&p| session.name_at(p)).collect();
        let why = format!(
            "replica check at step {step}: the state of {} differed from that of {}, the source of generation {}, at \
             the same step",
            names.join(", "),
            session.name(source),
            session.generation()
        );
        let right = !odd.contains(&session.collective().rank());
        self.go_back(state, session, report, (right, names, why))
    }

    /// A generation formed at this member's step although these members (`finders`, places in
    /// the ring) had found a mismatch at that step or before: a member the verdict did not reach
    /// (its exchange cut short) was the source. Every member goes back as after the mismatch.
    pub(crate) fn mismatch_found_before(
        &mut self,
        state: &mut TrainState,
        session: &mut Session,
        report: &mut Reporter<'_>,
        finders: &[usize],
    ) -> Interrupt {
        let step = state.position().global_step;
        let names: Vec<String> = finders.iter().map(|&p| session.name_at(p)).collect();
        let heard = self.heard.take();
        let why = match &heard {
            // A peer's own words, whichever member flagged it here (the finder may be gone).
            Some(f) => format!(
                "generation {} formed at step {step}, but {} found at step {}: {}",
                session.generation(),
                f.finder,
                f.step,
                f.why
            ),
            None => format!(
                "generation {} formed at step {step}, but {} found the replicas' states differ at a comparison not \
                 after it",
                session.generation(),
                names.join(", ")
            ),
        };
        let back_to = self.back_for_repair(state, session, true);
        let line = format!("trainerd: {why}; {}", going_back(back_to));
        // What a peer found is this member's mismatch too (once), as if its own comparison had
        // completed: its summary names the odd members.
        match heard {
            Some(f) => {
                report.replica_mismatch(&line, &f.odd);
                self.mismatched(ReplicaMismatch { step: f.step, members: f.odd, back_to });
            }
            None => report.line(&line),
        }
        Interrupt::Abandoned(why)
    }

    /// A comparison that did not complete: the state is kept, and the comparison of its step
    /// owed; said in a line (a stop or a fatal error needs none).
    fn cut_short(&mut self, state: &TrainState, report: &mut Reporter<'_>, interrupt: &Interrupt) {
        let Interrupt::Abandoned(why) = interrupt else { return };
        let step = state.position().global_step;
        self.owed = Some(step);
        report.line(&format!(
            "trainerd: the replicas' comparison at step {step} did not complete ({why}); it is finished in the next \
             generation"
        ));
    }

    /// Puts `state` back to the agreed state, when there is one and its bytes are intact; its
    /// step. Otherwise the state is dropped (a peer's is taken at the next formation).
    fn back_to_agreed(&self, state: &mut TrainState) -> Option<u64> {
        let back_to = self.agreed.as_ref().and_then(|a| a.restore(state));
        if back_to.is_none() {
            state.model.live = false;
        }
        back_to
    }

    /// This member goes back to its agreed state if its state was `right` and the agreed one is
    /// intact, else drops its state; the mismatch (`odd` members, `why`) is told and the
    /// generation abandoned (this member rejoins, which ends it).
    fn go_back(
        &mut self,
        state: &mut TrainState,
        session: &mut Session,
        report: &mut Reporter<'_>,
        (right, odd, why): (bool, Vec<String>, String),
    ) -> Interrupt {
        let step = state.position().global_step;
        let back_to = self.back_for_repair(state, session, right);
        // A verdict that sends the run back before this step is told to every peer before this
        // member acts on it: a peer whose exchange was cut short (by this member's leaving, first)
        // carries it into the next formation, even where this member dropped its state or dies.
        if self.mismatch_at.is_some() {
            let kept = session.tell(step, (&odd, &why, false));
            tracing::debug!("the mismatch at step {step} told to {kept} peer(s)");
        }
        let what = match (back_to, &state.optimizer) {
            // Its optimizer state exists nowhere whole: the last commit is the agreed state.
            (None, Optim::Sharded(_)) => "this worker drops its state and goes back to the last commit".to_string(),
            _ => going_back(back_to),
        };
        report.replica_mismatch(&format!("trainerd: {why}; {what}"), &odd);
        self.mismatched(ReplicaMismatch { step, members: odd, back_to });
        // No abort is pushed: every member reaches the same verdict from the same digests, and one
        // whose exchange the others' leaving cut short was told it. Chaos tests hold the finder
        // here, its finding told and said, to kill it before it rejoins.
        trainerd_failpoint::point("replica-mismatch");
        Interrupt::Abandoned(why)
    }

    /// A repair: this member goes back to its agreed state if its state was `right` and the
    /// agreed one is intact, else drops its state; the step it went back to.
    fn back_for_repair(&mut self, state: &mut TrainState, session: &mut Session, right: bool) -> Option<u64> {
        let step = state.position().global_step;
        session.went_back_for_repair();
        self.sent_back = true;
        let back_to = if right {
            self.back_to_agreed(state)
        } else {
            state.model.live = false;
            None
        };
        self.went_back(step, back_to);
        back_to
    }

    /// A verdict sent this member from its state at `step` back to its agreed state at `back_to`
    /// (`None`: it dropped its state). Where that is an earlier step, or where it dropped a state
    /// trained since every member last held the same one, the verdict condemns the steps since
    /// (the run goes back before `step`): a formation at `step` or later took a state the verdict
    /// did not reach, and [`Integrity::flags`] says so. (Where the members held the same state at
    /// `step`, nothing but the odd replicas is condemned, and the formation after it is the
    /// repair itself.)
    fn went_back(&mut self, step: u64, back_to: Option<u64>) {
        self.owed = None;
        let condemns = match back_to {
            Some(b) => b < step,
            None => step > self.equal_at,
        };
        self.mismatch_at = condemns.then_some(step);
    }

    /// A mismatch for the summary: one of the same step and members as one already there is the
    /// same corruption met again (a formation that finds the state a peer's comparison condemned),
    /// and counts once.
    fn mismatched(&mut self, m: ReplicaMismatch) {
        if !self.counted(&m) {
            self.figures.mismatches.push(m);
        }
    }

    /// Whether the summary already has a mismatch of `m`'s step and members.
    fn counted(&self, m: &ReplicaMismatch) -> bool {
        self.figures.mismatches.iter().any(|k| k.step == m.step && k.members == m.members)
    }

    /// What the summary says.
    pub(crate) fn figures(&self) -> ReplicaFigures {
        self.figures.clone()
    }
}

/// What an odd member does after a mismatch of its parameters alone (no step lost).
const DROPS_PARAMETERS: &str =
    "no step is lost: this worker drops its parameters and takes a right member's, and keeps its ranges of the \
     optimizer state";

/// What a member does after a comparison failed: back to the agreed state's step, or (`None`) it
/// takes the agreed state from a peer.
fn going_back(back_to: Option<u64>) -> String {
    match back_to {
        Some(s) => format!("this worker goes back to step {s}, the last state every member agreed on"),
        None => "this worker drops its state and takes the agreed one from a peer".to_string(),
    }
}

/// Flips one bit of the first parameter's first element (a chaos test's failpoint `flip-bit`:
/// faulty memory, on purpose), and says which.
pub(crate) fn flip_bit(state: &mut TrainState) -> Option<String> {
    let _no_grad = tch::no_grad_guard();
    let (name, tensor) = state.model.params.first()?;
    let flat = tensor.flatten(0, -1);
    let before = flat.double_value(&[0]) as f32;
    let after = f32::from_bits(before.to_bits() ^ (1 << 12));
    let _ = flat.get(0).fill_(f64::from(after));
    Some(format!("flipped bit 12 of {name}[0]: {before:e} is now {after:e}"))
}

#[cfg(test)]
mod tests;
