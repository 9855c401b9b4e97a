//! The coordinator's rules, as a pure function: [`decide`] maps (state, now, options) to what the
//! coordinator must do next, with no I/O and no clock, the way torchft's `quorum_compute` does,
//! so that every corner (heartbeat expiry, a paused coordinator, a member that never returns) is
//! a plain unit test with injected time; [`State::apply`] makes a decision's changes to the state,
//! pure too, and says what the coordinator must carry out ([`Effect`]). The [`super::Coordinator`]
//! only stores the state that messages report, applies the decisions, and
//! carries the effects. The protocol is described in `docs/fault-tolerance.md`.
//!
//! The run's slots (V, every rank) are fixed; a generation trains with every member present, or,
//! as soon as the missing ones are known gone (their streams closed, or silent past the heartbeat
//! deadline; waited for `replace_after` when that is set), with at least `min_workers` of them (a
//! majority: two sides of a partition can never both train), their slots spread over those
//! present. Every change of membership (a failure, a formation, a member coming back) is a new
//! generation.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// What a member says about its training state when it joins. The cluster does not know what
/// training is: progress is an opaque ordered key, the digest an opaque fingerprint.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub(crate) struct Report {
    /// The last generation this member trained in (0: none).
    pub(crate) generation: u64,
    /// How far its state is; larger is further.
    pub(crate) progress: (u64, u64),
    /// sha256 of its state; empty when it has none (a fresh process).
    pub(crate) digest: String,
    /// The furthest global step its state reached since it last adopted a formation, even where
    /// it went back since (a repair of a corrupted replica, or a formation's first exchange).
    pub(crate) reached: u64,
    /// It went back from `reached` because a comparison of the replicas found a corrupted one.
    pub(crate) repaired: bool,
    /// The ranks of the generation it was last in (empty before its first).
    pub(crate) members: Vec<usize>,
    /// What the process this one replaced recorded before it died, until this one is in a
    /// generation: the generation it trained in and the furthest step its state reached there.
    pub(crate) recorded: Option<(u64, u64)>,
    /// It holds no state yet and has not read its checkpoint location (a process that coordinates
    /// at its start joins first): asked to ([`Decision::Read`]), it reads it and joins again.
    pub(crate) unread: bool,
    /// sha256 of the start state it built from the run's seed and has not trained, when it holds
    /// no state of the run (a fresh process other than the coordinator): no source, but it needs
    /// nothing sent where the source's state is that one. Empty otherwise.
    pub(crate) start: String,
}

impl Report {
    /// Whether the member holds a state.
    pub(crate) fn has_state(&self) -> bool {
        !self.digest.is_empty()
    }

    /// Whether it lacks the state `chosen` reports: its own differs, and the start state it built
    /// (if any) is another.
    fn lacks(&self, chosen: &Report) -> bool {
        let held = (self.progress, &self.digest) == (chosen.progress, &chosen.digest);
        let built = !self.start.is_empty() && self.start == chosen.digest;
        !held && !built
    }

    /// The newest generation the report names: the member's last, or its predecessor's recorded.
    fn newest_generation(&self) -> u64 {
        self.generation.max(self.recorded.map_or(0, |(g, _)| g))
    }
}

/// The barrier after which members may leave freely: the run is over. A return that finds
/// members waiting in it ends the generation at once (no step boundary will come).
pub(crate) const FINAL_BARRIER: &str = "finished";

/// Why a returning member ends a generation.
pub(crate) const CAME_BACK: &str = "came back: it takes its slots back";

/// Why an active member is out of its generation (reported by messages).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Gone {
    /// A peer reported it failed.
    Reported(String),
    /// It left on purpose (stopped).
    Left(String),
    /// A new process took its rank.
    Restarted,
}

/// What the coordinator knows about one rank.
#[derive(Clone, Debug)]
pub(crate) struct MemberState {
    /// The process holding the rank (random per process start), once one has come.
    pub(crate) incarnation: Option<u64>,
    /// Its heartbeat stream is open.
    pub(crate) connected: bool,
    /// Known gone: its stream closed, or the coordinator before this one lost it (cleared when a
    /// new process claims the rank, or its stream opens again).
    pub(crate) lost: bool,
    /// When it was last heard from.
    pub(crate) last_seen: Instant,
    /// Its pending join, if it asked to be in the next generation.
    pub(crate) joined: Option<Report>,
    /// It is in the current generation, which is formed.
    pub(crate) active: bool,
    /// Why it is out, when something said so.
    pub(crate) gone: Option<Gone>,
}

impl MemberState {
    /// A rank nobody has claimed yet.
    pub(crate) fn absent(now: Instant) -> MemberState {
        MemberState {
            incarnation: None,
            connected: false,
            lost: false,
            last_seen: now,
            joined: None,
            active: false,
            gone: None,
        }
    }
}

/// The coordinator's state.
#[derive(Clone, Debug)]
pub(crate) struct State {
    /// The rank of the process the coordinator lives in (the chief's, 0, unless one was
    /// elected): a formation always holds it.
    pub(crate) own: usize,
    /// The current generation.
    pub(crate) generation: u64,
    /// Whether it is formed (training) or gathering members.
    pub(crate) formed: bool,
    /// The next formation's generation must exceed this (the latest commit's generation).
    pub(crate) floor: u64,
    /// Per rank.
    pub(crate) members: Vec<MemberState>,
    /// When the current gathering began.
    pub(crate) gathering_since: Instant,
    /// A generation was formed before (here, or by a coordinator before this one, as the
    /// members' reports tell): missing members are then given the rejoin deadline.
    pub(crate) ever_formed: bool,
    /// When the coordinator last ran its decisions.
    pub(crate) last_tick: Instant,
    /// The members passed the final barrier: nobody's departure is a failure any more.
    pub(crate) finished: bool,
    /// The furthest global step a member's state reached in the generation formed last, as its
    /// beats carried it ([`State::heard`]); with the joins' `reached`, what a formation behind it
    /// trains again. A formation sets it to its own step.
    pub(crate) high_water: u64,
    /// The generation this coordinator formed last (0: none yet).
    pub(crate) last_formed: u64,
    /// What the joins since the last formation said of their members' positions, for the newest
    /// generation any of them was last in (only that one counts): (that generation, how far they
    /// reached, how far those that went back for a repair had). Kept even where the process that
    /// joined died since: the steps it reached are trained again.
    pub(crate) reaches: Option<(u64, u64, u64)>,
    /// Why recent generations ended (the newest 16), for members that missed the notice.
    pub(crate) ended: BTreeMap<u64, String>,
    /// Give-ups so far; a join waiting since before the latest one fails with its message.
    pub(crate) give_ups: u64,
    /// The latest give-up's message.
    pub(crate) gave_up: String,
    /// A give-up ends the cluster (the chief exits on it): later joins get its message at once.
    pub(crate) closed: bool,
    /// Members told of the give-up that have not yet left or disconnected: the chief's exit
    /// would cut off the answer on its way to them.
    pub(crate) unanswered: BTreeSet<usize>,
    /// Each open barrier of a generation, by (generation, name): the ranks that arrived.
    pub(crate) barriers: BTreeMap<(u64, String), BTreeSet<usize>>,
    /// The generation that made the latest commit, and its ranks (as the commit names them), when
    /// this coordinator restored one.
    pub(crate) committed: Option<(u64, Vec<usize>)>,
    /// The coordinator's process was asked to read its checkpoint location ([`Decision::Read`])
    /// and has not joined again: nothing is decided meanwhile (no give-up: no state exists but the
    /// one it reads).
    pub(crate) reading: bool,
}

impl State {
    /// A coordinator that has just started, with nobody joined.
    pub(crate) fn new(world: usize, floor: u64, now: Instant) -> State {
        State {
            own: 0,
            generation: 0,
            formed: false,
            floor,
            members: (0..world).map(|_| MemberState::absent(now)).collect(),
            gathering_since: now,
            ever_formed: false,
            last_tick: now,
            finished: false,
            high_water: 0,
            last_formed: 0,
            reaches: None,
            ended: BTreeMap::new(),
            give_ups: 0,
            gave_up: String::new(),
            closed: false,
            unanswered: BTreeSet::new(),
            barriers: BTreeMap::new(),
            committed: None,
            reading: false,
        }
    }

    /// A beat of a member in `generation` whose state reached global step `step` in it: only the
    /// generation formed last counts, while it trains and while the next one gathers (an older
    /// one's steps were counted by the formation after it).
    pub(crate) fn heard(&mut self, generation: u64, step: u64) {
        if generation > 0 && generation == self.last_formed {
            self.high_water = self.high_water.max(step);
        }
    }

    /// A join's report: how far its member reached counts for the next formation, whatever
    /// becomes of the process.
    pub(crate) fn joined(&mut self, report: &Report) {
        add_reach(&mut self.reaches, report);
    }

    /// Makes `decision`'s changes, taken at `now` (`names`: every member's, by rank), and says
    /// what the coordinator must carry out.
    pub(crate) fn apply(&mut self, decision: Decision, now: Instant, names: &[String]) -> Effect {
        match decision {
            Decision::Grace => {
                self.members.iter_mut().for_each(|m| m.last_seen = now);
                self.last_tick = now;
                Effect::Grace
            }
            Decision::Fail(failed) => {
                let ended = self.generation;
                let reason =
                    failed.iter().map(|(rank, why)| format!("{} {why}", names[*rank])).collect::<Vec<_>>().join("; ");
                self.generation += 1;
                self.formed = false;
                self.gathering_since = now;
                for m in &mut self.members {
                    m.active = false;
                    m.gone = None;
                }
                self.barriers.retain(|(g, _), _| *g > ended);
                self.ended.insert(ended, reason.clone());
                while self.ended.len() > 16 {
                    self.ended.pop_first();
                }
                Effect::Ended { generation: ended, reason }
            }
            Decision::Form(f) => {
                self.generation = f.generation;
                self.formed = true;
                self.ever_formed = true;
                for (rank, m) in self.members.iter_mut().enumerate() {
                    // A member left out keeps its join (if it has one): it counts once it is live.
                    m.active = f.members.contains(&rank);
                    if m.active {
                        m.joined = None;
                    }
                    m.gone = None;
                }
                (self.high_water, self.last_formed) = (f.progress.0, f.generation);
                self.reaches = None;
                Effect::Formed(f)
            }
            Decision::Read => {
                self.members[self.own].joined = None;
                self.reading = true;
                Effect::Read
            }
            Decision::GiveUp { missing, waited } => {
                let missing: Vec<&str> = missing.iter().map(|&r| names[r].as_str()).collect();
                self.gave_up = format!("{} did not join within {waited:?}", missing.join(", "));
                self.give_ups += 1;
                self.gathering_since = now;
                self.closed = true;
                let own = self.own;
                let waiting = self.members.iter().enumerate().filter(|(r, m)| *r != own && m.joined.is_some());
                self.unanswered = waiting.map(|(rank, _)| rank).collect();
                Effect::GaveUp
            }
        }
    }
}

/// What the coordinator must carry out after [`State::apply`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Effect {
    /// Nothing to tell anyone (everyone was counted as just heard from).
    Grace,
    /// Tell every member that `generation` ended, and why.
    Ended {
        /// The generation that ended.
        generation: u64,
        /// Why, naming the members that failed.
        reason: String,
    },
    /// Answer the waiting joins with this formation.
    Formed(Formation),
    /// Answer the waiting joins with [`State::gave_up`].
    GaveUp,
    /// Answer the coordinator's own join: read the checkpoint location, then join again.
    Read,
}

/// Deadlines the decisions use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Options {
    /// A member silent for longer has failed.
    pub(crate) heartbeat_deadline: Duration,
    /// How long the first formation may wait for every member.
    pub(crate) rendezvous_timeout: Duration,
    /// How long a formed cluster waits for a missing member to return.
    pub(crate) rejoin_deadline: Duration,
    /// How long a member may be missing before a generation forms without it.
    pub(crate) replace_after: Duration,
    /// The fewest members a generation forms with.
    pub(crate) min_workers: usize,
}

/// A generation to form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Formation {
    /// Its number.
    pub(crate) generation: u64,
    /// The member whose state everyone continues from.
    pub(crate) source: usize,
    /// That state's progress.
    pub(crate) progress: (u64, u64),
    /// That state's digest.
    pub(crate) digest: String,
    /// Members whose state differs from the source's: they receive it.
    pub(crate) receivers: Vec<usize>,
    /// The members of the generation, ascending (the ring's order).
    pub(crate) members: Vec<usize>,
    /// A generation had been formed before: this one is a recovery.
    pub(crate) recovery: bool,
    /// Steps the members' states had reached that the source's state does not hold: every member
    /// trains them again.
    pub(crate) steps_trained_again: u64,
    /// Of those, the ones no repair of a corrupted replica asked for.
    pub(crate) steps_lost: u64,
}

/// What the coordinator must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// The coordinator itself did not run for longer than the heartbeat deadline (it was
    /// frozen, or starved): count everyone as just heard from rather than failing them all.
    Grace,
    /// End the current generation: these members failed, or came back (rank, why).
    Fail(Vec<(usize, String)>),
    /// Every member has joined, or those missing were replaced: form the next generation.
    Form(Formation),
    /// Every member needed has joined, but none holds a state of the newest generation they name,
    /// and the coordinator's process has not read its checkpoint location: it reads it first.
    Read,
    /// These members stayed away past the deadline: the waiting members give up.
    GiveUp {
        /// Missing ranks.
        missing: Vec<usize>,
        /// The deadline that passed.
        waited: Duration,
    },
}

/// What the coordinator must do now, if anything.
pub(crate) fn decide(state: &State, now: Instant, opts: &Options) -> Option<Decision> {
    if now.saturating_duration_since(state.last_tick) > opts.heartbeat_deadline {
        return Some(Decision::Grace);
    }
    if state.finished {
        return None;
    }
    let live = |m: &MemberState| live(m, now, opts);
    if state.formed {
        return ended(state, now, opts);
    }
    if state.reading {
        return None;
    }
    let present: Vec<usize> =
        (0..state.members.len()).filter(|&r| state.members[r].joined.is_some() && live(&state.members[r])).collect();
    if must_read(state, &present, |m| live(m)) {
        return Some(Decision::Read);
    }
    if present.len() == state.members.len() {
        return Some(Decision::Form(form(state, present)));
    }
    let rejoin = state.ever_formed || state.members.iter().any(|m| m.joined.as_ref().is_some_and(|r| r.generation > 0));
    let unseen = |m: &MemberState| now.saturating_duration_since(m.last_seen);
    let left_out = left_out(state);
    // After a formation, a member known gone (its stream closed, silent past the deadline, or
    // never seen here and left out of the newest generation the joins report) is replaced once
    // out of sight for `replace_after` (0: at once); one that is live but has not joined yet is on
    // its way and waited for. Before it, anyone missing for the rendezvous timeout, unless the
    // latest commit's generation had left it out (every process restarted since).
    let never_seen_and_left_out = |r: usize, m: &MemberState| m.incarnation.is_none() && left_out.contains(&r);
    let replaceable = |r: usize, m: &MemberState| match rejoin {
        true => {
            (m.lost || unseen(m) > opts.heartbeat_deadline || never_seen_and_left_out(r, m))
                && (opts.replace_after.is_zero() || unseen(m) > opts.replace_after)
        }
        false => unseen(m) > opts.rendezvous_timeout || never_seen_and_left_out(r, m),
    };
    let replaceable = state.members.iter().enumerate().all(|(r, m)| present.contains(&r) || replaceable(r, m));
    if present.len() >= opts.min_workers && present.contains(&state.own) && replaceable {
        return Some(Decision::Form(form(state, present)));
    }
    let waited = if rejoin { opts.rejoin_deadline } else { opts.rendezvous_timeout };
    if now.saturating_duration_since(state.gathering_since) > waited {
        let missing: Vec<usize> =
            state.members.iter().enumerate().filter(|(_, m)| m.joined.is_none() || !live(m)).map(|(r, _)| r).collect();
        return Some(Decision::GiveUp { missing, waited });
    }
    None
}

/// Whether the formed generation ends: its members that failed, and then the ranks that came back.
fn ended(state: &State, now: Instant, opts: &Options) -> Option<Decision> {
    let mut failed: Vec<(usize, String)> = state
        .members
        .iter()
        .enumerate()
        .filter(|(_, m)| m.active)
        .filter_map(|(rank, m)| failure(m, now, opts).map(|why| (rank, why)))
        .collect();
    // A member left out of the generation and back takes its slots back at the members' next step
    // boundary (the coordinator's process raises the return flag in its step); with members in the
    // final barrier no step comes, and it ends the generation at once.
    if !failed.is_empty() || in_final_barrier(state) {
        failed.extend(returners(state, now, opts).into_iter().map(|rank| (rank, CAME_BACK.to_string())));
    }
    (!failed.is_empty()).then_some(Decision::Fail(failed))
}

/// Whether the coordinator's process must read its checkpoint location before anything forms: it
/// has not (it joined first), every member that is live has joined (one on its way may hold a
/// state), and none of them (`present`) holds a state of the newest generation any of them names
/// (a state of an older one may be behind a commit the newer made). Members not live are not
/// waited for: the read tells which of them the latest commit left out
/// (docs/fault-tolerance.md, "Join first; read storage only when nobody holds the state").
fn must_read(state: &State, present: &[usize], live: impl Fn(&MemberState) -> bool) -> bool {
    let unread = present.contains(&state.own) && state.members[state.own].joined.as_ref().is_some_and(|r| r.unread);
    if !unread || state.members.iter().any(|m| live(m) && m.joined.is_none()) {
        return false;
    }
    let reports: Vec<&Report> = present.iter().filter_map(|&r| state.members[r].joined.as_ref()).collect();
    let newest = reports.iter().map(|r| r.newest_generation()).max().unwrap_or(0);
    !reports.iter().any(|r| r.has_state() && r.generation >= newest && r.generation > 0)
}

/// Whether `m` is connected and was heard from within the heartbeat deadline.
fn live(m: &MemberState, now: Instant, opts: &Options) -> bool {
    m.connected && now.saturating_duration_since(m.last_seen) <= opts.heartbeat_deadline
}

/// The ranks outside the formed generation that joined and are live: they came back, and take
/// their slots back at the members' next step boundary.
pub(crate) fn returners(state: &State, now: Instant, opts: &Options) -> Vec<usize> {
    if !state.formed {
        return Vec::new();
    }
    let back = |m: &MemberState| !m.active && m.joined.is_some() && live(m, now, opts);
    state.members.iter().enumerate().filter(|(_, m)| back(m)).map(|(rank, _)| rank).collect()
}

/// Whether a member of the formed generation waits in its final barrier.
pub(crate) fn in_final_barrier(state: &State) -> bool {
    state
        .barriers
        .iter()
        .any(|((g, name), arrived)| *g == state.generation && name == FINAL_BARRIER && !arrived.is_empty())
}

/// The ranks left out of the newest generation that a joined member reports, or that made the
/// latest commit (where every process restarted, no join reports one): the coordinator before
/// this one counted them gone.
fn left_out(state: &State) -> Vec<usize> {
    let reported = state.members.iter().filter_map(|m| m.joined.as_ref()).filter(|r| !r.members.is_empty());
    let reported = reported.map(|r| (r.generation, r.members.as_slice()));
    let committed = state.committed.iter().map(|(g, members)| (*g, members.as_slice()));
    let Some((_, newest)) = reported.chain(committed).max_by_key(|(g, _)| *g) else { return Vec::new() };
    (0..state.members.len()).filter(|r| !newest.contains(r)).collect()
}

/// Why an active member has failed, if it has.
fn failure(m: &MemberState, now: Instant, opts: &Options) -> Option<String> {
    if let Some(gone) = &m.gone {
        return Some(match gone {
            Gone::Reported(why) | Gone::Left(why) => why.clone(),
            Gone::Restarted => "was restarted (a new process took its place)".into(),
        });
    }
    if m.joined.is_some() {
        return Some("abandoned the generation and asked to rejoin".into());
    }
    if !m.connected {
        return Some("lost its connection to the chief".into());
    }
    let silent = now.saturating_duration_since(m.last_seen);
    (silent > opts.heartbeat_deadline).then(|| {
        format!(
            "sent no heartbeat for {:.1}s (deadline {:.1}s)",
            silent.as_secs_f64(),
            opts.heartbeat_deadline.as_secs_f64()
        )
    })
}

/// The formation of the `members` present (all joined): the generation above every one seen, and
/// the furthest state as the source.
fn form(state: &State, members: Vec<usize>) -> Formation {
    let report = |r: usize| state.members[r].joined.as_ref().expect("every member joined");
    let seen = members.iter().map(|&r| report(r).newest_generation()).max().unwrap_or(0);
    let generation = state.generation.max(state.floor).max(seen) + 1;
    // The furthest state that exists; where members hold different states that far, the one
    // most of them hold (a replica corrupted in silence is outvoted); on a tie the lowest rank
    // (the chief first).
    let same = |a: &Report, b: &Report| (a.progress, &a.digest) == (b.progress, &b.digest);
    let holders = |r: usize| members.iter().filter(|&&o| same(report(o), report(r))).count();
    let source = members
        .iter()
        .copied()
        .filter(|&r| report(r).has_state())
        .max_by(|&a, &b| {
            let key = |r: usize| (report(r).progress, holders(r));
            key(a).cmp(&key(b)).then(b.cmp(&a))
        })
        .unwrap_or(members[0]);
    let chosen = report(source);
    // A member whose start state, built from the seed, is the source's (a fresh start: every
    // member built the same) receives nothing.
    let receivers = members.iter().copied().filter(|&r| report(r).lacks(chosen)).collect();
    let (reached, repaired) = reached(state, &members);
    let step = chosen.progress.0;
    Formation {
        generation,
        source,
        progress: chosen.progress,
        digest: chosen.digest.clone(),
        receivers,
        members,
        recovery: state.ever_formed || seen > 0,
        steps_trained_again: reached.saturating_sub(step),
        steps_lost: reached.saturating_sub(step.max(repaired)),
    }
}

/// How far the members' states reached since the last formation (the beats of the generation
/// formed last, and the joins of `members` and every other join since it, processes that died
/// since included, from a member of the newest generation they report), and how far a member
/// that went back for a repair had reached.
fn reached(state: &State, members: &[usize]) -> (u64, u64) {
    let mut reaches = state.reaches;
    for report in members.iter().filter_map(|&r| state.members[r].joined.as_ref()) {
        add_reach(&mut reaches, report);
    }
    let (_, reached, repaired) = reaches.unwrap_or_default();
    (reached.max(state.high_water), repaired)
}

/// Folds what `report` says into `reaches`: a newer generation than the one kept replaces it, the
/// same one raises its furthest step (and the furthest of a member that went back for a repair),
/// an older one counts for nothing. A position the process before the reporting one recorded
/// counts as a report of its own (the steps a process trained before it died count).
fn add_reach(reaches: &mut Option<(u64, u64, u64)>, report: &Report) {
    let recorded = report.recorded.filter(|&(generation, _)| generation > 0);
    let own = (report.generation, report.reached, report.repaired);
    for (of, at, repair) in recorded.map(|(g, s)| (g, s, false)).into_iter().chain([own]) {
        let (generation, reached, repaired) = reaches.get_or_insert((of, 0, 0));
        if of > *generation {
            (*generation, *reached, *repaired) = (of, 0, 0);
        }
        if of == *generation {
            *reached = (*reached).max(at);
            if repair {
                *repaired = (*repaired).max(at);
            }
        }
    }
}

#[cfg(test)]
mod property_tests;
#[cfg(test)]
mod tests;
