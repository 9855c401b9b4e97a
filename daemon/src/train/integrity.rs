//! The replicas compared, so that silent corruption (a bit flipped by faulty memory or a faulty
//! core) is caught and undone (docs/fault-tolerance.md, "Replicas compared"). At the points
//! [`due`] names, every member hashes its encoded state (xxh3-64) and one all-reduce gives every
//! member every digest. Equal: the bytes are kept as the *agreed* state. Different: every member
//! computes the same [`verdict`], names the odd ones, goes back to its agreed state (the odd ones
//! drop theirs), and abandons the generation; the next formation hands the agreed state to
//! whoever lacks it, and the steps since are trained again, so the run stays the failure-free
//! one, bit for bit. A comparison cut short (a member lost during its exchange) undoes nothing:
//! the members keep the compared state, *owe* the comparison, and finish it as the next
//! generation forms ([`Integrity::flags`]).

use std::time::Instant;

use bytes::Bytes;

use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use super::report::Reporter;
use super::session::{Interrupt, Session};
use super::sharded::Read;
use super::summary::{ReplicaFigures, ReplicaMismatch};
use crate::state::{Optim, Position, Shareable, StateError, TrainState};

/// The default of `--replica-check-every`: at mnist-cnn's step on this project's CPUs the check
/// costs well under 1% of the step time (bench/multi_worker.sh measures it).
pub(crate) const DEFAULT_EVERY: u64 = 100;

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

/// The last state every member agreed on: its step, its digest, its bytes.
struct Agreed {
    step: u64,
    digest: u64,
    bytes: Bytes,
}

/// A member's comparisons.
pub(crate) struct Integrity {
    schedule: Schedule,
    /// Every member's checkpoint interval in the current generation (those not 0).
    commits: Vec<u64>,
    /// This process has been in a formation.
    formed_once: bool,
    agreed: Option<Agreed>,
    /// The step of a comparison this member entered that did not complete: its state is still
    /// that step's, not yet compared.
    owed: Option<u64>,
    /// The step of a comparison whose verdict (a mismatch) sent this member back: a formation
    /// that hands it a state at or past that step took a state the verdict did not reach.
    mismatch_at: Option<u64>,
    figures: ReplicaFigures,
    /// A comparison found this member's parameters alone corrupted under sharding: it dropped its
    /// state but keeps its ranges of the optimizer state (see [`Integrity::take_parameters`]).
    ranges_kept: bool,
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
            owed: None,
            mismatch_at: None,
            figures,
            ranges_kept: false,
        }
    }

    /// Whether the last mismatch had this member drop its state but keep its ranges of the
    /// sharded optimizer state (asked once).
    pub(crate) fn take_ranges_kept(&mut self) -> bool {
        std::mem::take(&mut self.ranges_kept)
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

    /// What this member tells the others of a generation formed at global step `step`.
    pub(crate) fn flags(&self, step: u64) -> Flags {
        Flags { mismatch: self.mismatch_at.is_some_and(|s| step >= s), owes: self.owed == Some(step) }
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
        let first = !std::mem::replace(&mut self.formed_once, true);
        // A sharded optimizer's state is not in the bytes: nothing to keep (see `check`).
        if !first || received || !state.live() || state.optimizer.whole().is_none() {
            return Ok(());
        }
        let bytes = state.encode().map_err(|e| Interrupt::Fatal(e.into()))?;
        self.agreed = Some(Agreed { step: state.position().global_step, digest: xxh3_64(&bytes), bytes: bytes.into() });
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
        let (digest, bytes) = digest(state).map_err(|e| Interrupt::Fatal(e.into()))?;
        // Chaos tests hold a member here, so that its peers' comparison is cut short.
        trainerd_failpoint::point("replica-check");
        let mine = range_digests(state, ranges);
        let split = if ranges > 0 { split_digests(state).map_err(|e| Interrupt::Fatal(e.into()))? } else { (0, 0) };
        let (digests, coordinator) = match exchange(session, (digest, split), coordinates, &mine) {
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
            self.agreed = bytes.map(|bytes| Agreed { step: state.position().global_step, digest, bytes });
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
            true => "this worker drops its parameters and takes a right member's, and keeps its ranges of the optimizer state",
            false => "this worker keeps its state",
        };
        state.model.live &= !dropped;
        self.ranges_kept = dropped;
        report.replica_mismatch(&format!("trainerd: {why}; no step is lost: {what}"), &odd);
        self.figures.mismatches.push(ReplicaMismatch { step, members: odd, back_to: (!dropped).then_some(step) });
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
        let why = format!(
            "generation {} formed at step {step}, but {} found the replicas' states differ at a comparison not \
             after it",
            session.generation(),
            names.join(", ")
        );
        let back_to = self.back_for_repair(state, session, true);
        report.line(&format!("trainerd: {why}; {}", going_back(back_to)));
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
        let agreed = self.agreed.as_ref().filter(|a| xxh3_64(&a.bytes) == a.digest);
        let back_to = agreed.and_then(|a| state.decode(a.bytes.clone()).ok().map(|()| a.step));
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
        let what = match (back_to, &state.optimizer) {
            // Its optimizer state exists nowhere whole: the last commit is the agreed state.
            (None, Optim::Sharded(_)) => "this worker drops its state and goes back to the last commit".to_string(),
            _ => going_back(back_to),
        };
        report.replica_mismatch(&format!("trainerd: {why}; {what}"), &odd);
        self.figures.mismatches.push(ReplicaMismatch { step, members: odd, back_to });
        // No abort is pushed: every member reaches the same verdict from the same digests; a member
        // whose exchange the others' leaving cut short learns it as the next generation forms.
        Interrupt::Abandoned(why)
    }

    /// A repair: this member goes back to its agreed state if its state was `right` and the
    /// agreed one is intact, else drops its state; the step it went back to.
    fn back_for_repair(&mut self, state: &mut TrainState, session: &mut Session, right: bool) -> Option<u64> {
        let step = state.position().global_step;
        session.went_back_for_repair();
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
    /// (`None`: it dropped its state). Where that is an earlier step, a formation at `step` or
    /// later took a state the verdict did not reach: [`Integrity::flags`] says so. (Where it is the
    /// same step, or none, the formation after it is the repair itself.)
    fn went_back(&mut self, step: u64, back_to: Option<u64>) {
        self.owed = None;
        self.mismatch_at = back_to.filter(|&b| b < step).map(|_| step);
    }

    /// What the summary says.
    pub(crate) fn figures(&self) -> ReplicaFigures {
        self.figures.clone()
    }
}

/// The odd members' names (places `odd`, by their parameters' `digests`), and what differs: `the
/// parameters of worker 2 (…) differ from those of worker 0 (…), … (xxh3 X against Y)`.
fn parameters(session: &Session, digests: &[u64], odd: &[usize]) -> (Vec<String>, String) {
    let names = |places: &mut dyn Iterator<Item = usize>| places.map(|p| session.name_at(p)).collect::<Vec<_>>();
    let right: Vec<usize> = (0..digests.len()).filter(|p| !odd.contains(p)).collect();
    let found: Vec<String> = odd.iter().map(|&p| format!("{:016x}", digests[p])).collect();
    let odd = names(&mut odd.iter().copied());
    let said = format!(
        "the parameters of {} differ from those of {} (xxh3 {} against {:016x})",
        odd.join(", "),
        names(&mut right.iter().copied()).join(", "),
        found.join(", "),
        right.first().map_or(0, |&p| digests[p])
    );
    (odd, said)
}

/// Per range of a sharded optimizer's `ranges` (none otherwise), this member's copy's digest if it
/// holds one.
fn range_digests(state: &TrainState, ranges: usize) -> Vec<Option<u64>> {
    let mut out = vec![None; ranges];
    if let Optim::Sharded(o) = &state.optimizer {
        o.digests().into_iter().filter(|&(r, _)| r < ranges).for_each(|(r, d)| out[r] = Some(d));
    }
    out
}

/// Per member, its state's digest, its parameters' and the rest's (under sharding), and, per
/// range, its copy's (if it holds one).
type Exchanged = (Vec<u64>, Vec<(u64, u64)>, Vec<Vec<Option<u64>>>);

/// Every member's `digest` (with its parameters' and the rest's), its `ranges`' digests and the
/// coordinator's place, by one all-reduce: each member puts its digests' halves (a range's after
/// a 1 when it holds it, and a 1 when it coordinates) in its own place of zeros; the sum is then
/// every member's value, exactly.
fn exchange(
    session: &mut Session,
    (digest, (params, rest)): (u64, (u64, u64)),
    coordinates: bool,
    ranges: &[Option<u64>],
) -> Result<(Exchanged, usize), Interrupt> {
    let halves = |d: u64| [(d >> 32) as f64, (d & 0xffff_ffff) as f64];
    let whole = |v: &[f64]| ((v[0] as u64) << 32) | v[1] as u64;
    let mut mine = vec![if coordinates { 1.0 } else { 0.0 }];
    [digest, params, rest].into_iter().for_each(|d| mine.extend(halves(d)));
    for r in ranges {
        mine.push(if r.is_some() { 1.0 } else { 0.0 });
        mine.extend(halves(r.unwrap_or(0)));
    }
    let values = session.gather(&mine)?;
    let rows: Vec<&[f64]> = values.chunks(mine.len()).collect();
    let digests = rows.iter().map(|v| whole(&v[1..3])).collect();
    let split = rows.iter().map(|v| (whole(&v[3..5]), whole(&v[5..7]))).collect();
    let held = rows.iter().map(|v| v[7..].chunks(3).map(|c| (c[0] > 0.5).then(|| whole(&c[1..]))).collect()).collect();
    let coordinator = rows.iter().position(|v| v[0] > 0.5).unwrap_or(0);
    Ok(((digests, split, held), coordinator))
}

/// Under sharding, where the replicated states differ (`whole`, the verdict on their digests): the
/// places whose parameters alone differ from a strict majority's (`split`: per member, its
/// parameters' digest and the rest's), the rest being equal everywhere; `None` otherwise.
fn parameters_alone(split: &[(u64, u64)], whole: &Verdict) -> Option<Vec<usize>> {
    if split.iter().any(|s| s.1 != split[0].1) {
        return None;
    }
    let params: Vec<u64> = split.iter().map(|s| s.0).collect();
    let found = verdict(&params, 0)?;
    let majority = 2 * (params.len() - found.odd.len()) > params.len();
    (majority && found.odd == whole.odd).then_some(found.odd)
}

/// A sharded state's digests of its parameters (as the per-step check hashes them) and of the
/// rest of its replicated state (its buffers' bytes and its position).
fn split_digests(state: &TrainState) -> Result<(u64, u64), StateError> {
    let mut rest = Xxh3::new();
    for (name, t) in &state.model.buffers {
        crate::state::host::stream_bytes(name, t, &mut |b| rest.update(b))?;
    }
    rest.update(&serde_json::to_vec(state.position()).expect("plain data"));
    Ok((super::sharded::params_digest(&state.model.params), rest.digest()))
}

/// Where two copies of a sharded optimizer's range differ (per member, per range: its copy's
/// digest): why, naming the first such range and its holders, and the holders' names. `when`:
/// the replica check at a step, or a generation forming.
pub(crate) fn ranges_differ(session: &Session, when: &str, held: &[Vec<Option<u64>>]) -> Option<(String, Vec<String>)> {
    let ranges = held.first().map_or(0, Vec::len);
    let differing: Vec<usize> = (0..ranges)
        .filter(|&r| {
            let copies: Vec<u64> = held.iter().filter_map(|h| h[r]).collect();
            copies.iter().any(|&d| d != copies[0])
        })
        .collect();
    let &r = differing.first()?;
    let holders: Vec<(String, u64)> =
        held.iter().enumerate().filter_map(|(p, h)| h[r].map(|d| (session.name_at(p), d))).collect();
    let names: Vec<String> = holders.iter().map(|(n, _)| n.clone()).collect();
    let found: Vec<String> = holders.iter().map(|(n, d)| format!("{d:016x} on {n}")).collect();
    let why = format!(
        "{when}: {} range(s) of the sharded optimizer state differ between their two copies \
         (range {r}: xxh3 {}); with two copies neither is known right, and every member goes back to the last commit",
        differing.len(),
        found.join(" against ")
    );
    Some((why, names))
}

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

/// A state's xxh3-64, and its bytes where they can be gone back to (a whole optimizer's state);
/// a sharded one is hashed as it is written, without a copy.
fn digest(state: &TrainState) -> Result<(u64, Option<Bytes>), StateError> {
    if state.optimizer.whole().is_some() {
        let bytes = state.encode()?;
        return Ok((xxh3_64(&bytes), Some(bytes.into())));
    }
    let mut hasher = Xxh3::new();
    state.encoding()?.write(&mut |b| hasher.update(b))?;
    Ok((hasher.digest(), None))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_digests_have_no_verdict() {
        assert_eq!(verdict(&[7, 7, 7], 0), None);
    }

    #[test]
    fn the_majority_is_right_even_against_the_coordinator() {
        assert_eq!(verdict(&[1, 2, 2], 0), Some(Verdict { right: 2, odd: vec![0] }));
        assert_eq!(verdict(&[2, 1, 2, 2], 3), Some(Verdict { right: 2, odd: vec![1] }));
        // Two odd ones, each their own way.
        assert_eq!(verdict(&[3, 2, 2, 2, 4], 0), Some(Verdict { right: 2, odd: vec![0, 4] }));
    }

    #[test]
    fn without_a_majority_the_coordinator_is_right() {
        assert_eq!(verdict(&[1, 2], 0), Some(Verdict { right: 1, odd: vec![1] }));
        assert_eq!(verdict(&[1, 2], 1), Some(Verdict { right: 2, odd: vec![0] }));
        assert_eq!(verdict(&[1, 1, 2, 2], 2), Some(Verdict { right: 2, odd: vec![0, 1] }));
    }

    /// Found by the kernels' chaos test: two workers whose initial states differed at step 0
    /// both dropped them (nothing agreed yet), and every formation after it at step 0 was taken
    /// for one past the mismatch, sending everyone back again, for ever. Only a member that went
    /// back to an earlier step flags a formation at or past the mismatch.
    #[test]
    fn a_formation_past_a_mismatch_is_flagged_only_where_a_member_went_back_to_an_earlier_step() {
        let mut integrity = Integrity::new(Schedule { every: 25, commits: 40 });
        integrity.went_back(0, None);
        assert_eq!(integrity.flags(0), Flags::default());
        integrity.went_back(40, Some(40));
        assert_eq!(integrity.flags(40), Flags::default());
        integrity.went_back(40, Some(25));
        assert_eq!(integrity.flags(40), Flags { mismatch: true, owes: false });
        assert_eq!(integrity.flags(41), Flags { mismatch: true, owes: false });
        assert_eq!(integrity.flags(25), Flags::default(), "the repair's own formation");
    }

    #[test]
    fn checks_fall_on_the_interval_and_on_commits_but_not_on_an_epochs_last_step() {
        let at = |global_step, step_in_epoch| Position { global_step, step_in_epoch, ..Position::start(1) };
        // Every 100 steps, and on the commits of one member every 30 and another every 45.
        let commits = [30, 45];
        assert!(due(100, &commits, &at(100, 10), 50));
        assert!(due(100, &commits, &at(30, 30), 50));
        assert!(due(100, &commits, &at(45, 45), 50));
        assert!(!due(100, &commits, &at(31, 31), 50));
        assert!(!due(100, &commits, &at(300, 50), 50), "checked at the epoch's end instead");
        assert!(!due(0, &[], &at(100, 1), 50));
    }
}
