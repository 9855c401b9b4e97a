//! Electing a coordinator when the one before is lost for good, by a majority of the run's
//! ranks (TF_CONFIG's static list), with the generation's number line as the term: the chief
//! coordinates term 0 without a vote; a member that has lost its coordinator for longer than
//! `--replace-after` asks the others for their vote in a term above every generation and term it
//! has seen; votes from more than half of the ranks make it the coordinator of that term. Each
//! member grants at most one vote per term and persists it (fsync) before answering, so a
//! restart cannot make it vote twice; a coordinator forms a generation only with a majority that
//! follows its term, so two coordinators can never both form. The rules are pure functions here
//! ([`answer`], [`stands`], [`follows`], [`won`]); [`Elections`] holds a member's vote and the
//! facts the rules read; `member/` carries them out. The protocol: `docs/fault-tolerance.md`.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::error::VoteError;

/// A member's vote and what it knows of the coordinator: persisted before any answer that
/// depends on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Vote {
    /// The highest term this member knows of.
    pub(crate) term: u64,
    /// Whom it voted for in that term, if it voted.
    pub(crate) voted_for: Option<usize>,
    /// The coordinator of that term, once known.
    pub(crate) coordinator: Option<usize>,
}

impl Default for Vote {
    /// Term 0: the chief coordinates.
    fn default() -> Vote {
        Vote { term: 0, voted_for: None, coordinator: Some(0) }
    }
}

/// A candidate's request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ballot {
    /// The term it stands in.
    pub(crate) term: u64,
    /// Its rank.
    pub(crate) candidate: usize,
}

/// What a voter sees when it answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Voter {
    /// Its vote so far.
    pub(crate) vote: Vote,
    /// The highest generation it has been in or been told of.
    pub(crate) generation: u64,
    /// How long it has been without a coordinator (`None`: its coordinator answers).
    pub(crate) lost_for: Option<Duration>,
    /// It found no kept vote at start (a new machine, an emptied directory) and has since been
    /// in no generation nor heard the term from a majority of the others: it may have voted
    /// before and forgotten.
    pub(crate) forgetful: bool,
}

/// Why a vote is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The voter knows a term at least as high (and voted in it for someone else, or learned it).
    Term(u64),
    /// The voter has been in a generation at least as high.
    Generation(u64),
    /// The voter's coordinator answers: a healthy coordinator is never deposed by a member cut
    /// off alone.
    Healthy,
    /// The voter lost its kept vote and has since been in no generation nor heard the current
    /// term from a majority.
    Forgetful,
}

impl Refusal {
    /// The refusal in words.
    pub(crate) fn reason(&self, coordinator: Option<&str>) -> String {
        match self {
            Refusal::Term(t) => format!("it knows term {t}"),
            Refusal::Generation(g) => format!("it has seen generation {g}"),
            Refusal::Healthy => format!("its coordinator, {}, answers", coordinator.unwrap_or("the chief")),
            Refusal::Forgetful => {
                "it has no kept vote, and has been in no generation nor heard the current term from a majority since"
                    .into()
            }
        }
    }
}

/// The voter's answer to `ballot`: the vote to persist before saying yes, or why not. At most one
/// vote per term (asking again for the same candidate gets the same yes), never for a term below
/// one it knows, nor one it voted in or knows the winner of, nor at or below a generation it saw, only while it too has lost its coordinator (its
/// link broke, or stayed silent for the heartbeat deadline: a member cut off alone cannot depose
/// a coordinator the others still hear), and not while it may have forgotten a vote
/// ([`caught_up`]).
pub(crate) fn answer(voter: &Voter, ballot: &Ballot) -> Result<Vote, Refusal> {
    let mine = voter.vote;
    if voter.forgetful {
        return Err(Refusal::Forgetful);
    }
    if ballot.term == mine.term && mine.voted_for == Some(ballot.candidate) {
        return Ok(mine);
    }
    // A term only heard of (from a candidate's `Who` answer: no vote given in it, no winner
    // known) can still be voted in, once: hearing of a term does not spend the vote.
    let open = ballot.term == mine.term && mine.voted_for.is_none() && mine.coordinator.is_none();
    if ballot.term <= mine.term && !open {
        return Err(Refusal::Term(mine.term));
    }
    if ballot.term <= voter.generation {
        return Err(Refusal::Generation(voter.generation));
    }
    if voter.lost_for.is_none() {
        return Err(Refusal::Healthy);
    }
    Ok(Vote { term: ballot.term, voted_for: Some(ballot.candidate), coordinator: None })
}

/// Whether a member stands now: it has been without a coordinator for longer than
/// `replace_after`, plus a stagger by `place` (its position among the ranks other than the lost
/// coordinator, so the lowest live rank stands first) and by `tries` (elections it already
/// lost), two heartbeat deadlines apiece, so that candidates rarely split the votes.
pub(crate) fn stands(lost_for: Duration, place: usize, tries: u32, world: usize, opts: (Duration, Duration)) -> bool {
    let (replace_after, heartbeat_deadline) = opts;
    let turns = place as u32 + tries * world as u32;
    lost_for > replace_after + heartbeat_deadline * 2 * turns
}

/// Whether a member that lost its kept vote may vote again: `answers` of the other ranks told it
/// their term, more than half of all `world` ranks. Every term won was kept by a majority, and
/// the majority without this member still meets any majority of the others, so it has heard of
/// every term it may have voted in (it takes the highest first).
pub(crate) fn caught_up(answers: usize, world: usize) -> bool {
    answers * 2 > world
}

/// The term a candidate stands in: above every term and generation it knows.
pub(crate) fn next_term(vote: &Vote, generation: u64) -> u64 {
    vote.term.max(generation) + 1
}

/// Whether `grants` votes (the candidate's own included) of `world` ranks are a majority.
pub(crate) fn won(grants: usize, world: usize) -> bool {
    grants * 2 > world
}

/// The vote after hearing that `coordinator` coordinates `term`, if the member should follow it:
/// a higher term, or its own term whose coordinator it did not know.
pub(crate) fn follows(mine: &Vote, term: u64, coordinator: usize) -> Option<Vote> {
    let newer = term > mine.term || (term == mine.term && mine.coordinator.is_none());
    newer.then_some(Vote {
        term,
        voted_for: if term == mine.term { mine.voted_for } else { None },
        coordinator: Some(coordinator),
    })
}

/// A member's elections: its vote (persisted in `--state-dir`), and the facts the rules read.
pub(crate) struct Elections {
    file: Option<PathBuf>,
    inner: Mutex<Inner>,
    /// Told when the elector should look at once: the coordinator is newly lost, or a vote was
    /// given (the winner is soon known).
    look: tokio::sync::Notify,
    /// Told when the coordinator followed changes (or takes its seat): the heartbeat and a
    /// waiting join link to it at once.
    moved: tokio::sync::Notify,
    /// How many times it has: a waiter compares with what it saw before its last try.
    moves: std::sync::atomic::AtomicU64,
}

struct Inner {
    vote: Vote,
    /// No kept vote was found at start.
    forgetful: bool,
    /// The highest generation this member has been in or told of.
    generation: u64,
    /// Since when its coordinator has been lost (`None`: it answers).
    lost_since: Option<Instant>,
}

impl Elections {
    /// The elections of the member whose vote lives in `file` (read now; `None`: this member
    /// keeps no vote, and so neither votes nor stands).
    pub(crate) fn open(file: Option<PathBuf>) -> Result<Elections, VoteError> {
        let (vote, forgetful) = match &file {
            Some(path) => read(path)?,
            None => (Vote::default(), true),
        };
        let inner = Inner { vote, forgetful, generation: 0, lost_since: None };
        Ok(Elections {
            file,
            inner: Mutex::new(inner),
            look: tokio::sync::Notify::new(),
            moved: tokio::sync::Notify::new(),
            moves: std::sync::atomic::AtomicU64::new(0),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether this member takes part (it has somewhere to keep its vote).
    pub(crate) fn enabled(&self) -> bool {
        self.file.is_some()
    }

    /// Whether it may have voted before and forgotten (no kept vote, not caught up yet).
    pub(crate) fn forgetful(&self) -> bool {
        self.lock().forgetful
    }

    /// `answers` of the others told it their terms, the highest `highest`: it takes that term and,
    /// if they are a majority, may vote again.
    pub(crate) fn heard_from(&self, answers: usize, world: usize, highest: u64) -> Result<(), VoteError> {
        self.heard(highest)?;
        let mut i = self.lock();
        if i.forgetful && caught_up(answers, world) {
            // Kept from now on: a restart need not ask again.
            self.persist(&i.vote)?;
            i.forgetful = false;
        }
        Ok(())
    }

    /// Its vote.
    pub(crate) fn vote(&self) -> Vote {
        self.lock().vote
    }

    /// The coordinator it follows: (term, rank), if known.
    pub(crate) fn coordinator(&self) -> Option<(u64, usize)> {
        let v = self.lock().vote;
        v.coordinator.map(|c| (v.term, c))
    }

    /// The highest generation it has been in or been told of.
    pub(crate) fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// It is in `generation`, formed by a majority that follows its coordinator's term: it
    /// knows the current term from them, and keeps its vote from now on.
    pub(crate) fn joined(&self, generation: u64) -> Result<(), VoteError> {
        self.saw(generation);
        let mut i = self.lock();
        if i.forgetful && self.file.is_some() {
            self.persist(&i.vote)?;
            i.forgetful = false;
        }
        Ok(())
    }

    /// It has been in, or was told of, `generation`.
    pub(crate) fn saw(&self, generation: u64) {
        let mut i = self.lock();
        i.generation = i.generation.max(generation);
    }

    /// Its coordinator stopped answering at `since` (kept if already lost), or answers again.
    pub(crate) fn set_lost(&self, since: Option<Instant>) {
        let mut i = self.lock();
        let newly = i.lost_since.is_none() && since.is_some();
        i.lost_since = since.map(|s| i.lost_since.unwrap_or(s));
        if newly {
            self.look.notify_one();
        }
    }

    /// Returns when the elector should look at once: the coordinator was newly lost, or a vote
    /// given, since the last call.
    pub(crate) async fn look_now(&self) {
        self.look.notified().await;
    }

    /// Returns once the coordinator followed is no longer `from` (at once if it changed
    /// already: the wait is registered before the look, so a change in between is not missed).
    pub(crate) async fn moved_from(&self, from: Option<(u64, usize)>) {
        let notified = self.moved.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.coordinator() == from {
            notified.await;
        }
    }

    /// Wakes whoever waits for the coordinator to move, and will only now find it (its seat is
    /// taken after its term was adopted: a link tried in between was refused).
    pub(crate) fn seated(&self) {
        self.moves.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.moved.notify_waiters();
    }

    /// How many times the coordinator followed has changed or taken its seat.
    pub(crate) fn moves(&self) -> u64 {
        self.moves.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Returns once [`Elections::moves`] is past `seen` (at once if it is already), or after
    /// `at_most`.
    pub(crate) async fn moved_since(&self, seen: u64, at_most: Duration) {
        let notified = self.moved.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.moves() == seen {
            let _ = tokio::time::timeout(at_most, notified).await;
        }
    }

    /// How long it has been without a coordinator at `now`.
    pub(crate) fn lost_for(&self, now: Instant) -> Option<Duration> {
        self.lock().lost_since.map(|s| now.saturating_duration_since(s))
    }

    /// Answers `ballot` at `now`; a granted vote is persisted first, and the clock of the lost
    /// coordinator starts again (the candidate gets its chance before this member stands). A
    /// pre-vote (`pre`) only says what the answer would be, and changes nothing.
    pub(crate) fn answer(&self, ballot: &Ballot, now: Instant, pre: bool) -> Result<(), (Refusal, Vote, u64)> {
        let mut i = self.lock();
        if self.file.is_none() {
            return Err((Refusal::Term(u64::MAX), i.vote, i.generation));
        }
        let voter = Voter {
            forgetful: i.forgetful,
            vote: i.vote,
            generation: i.generation,
            lost_for: i.lost_since.map(|s| now.saturating_duration_since(s)),
        };
        match answer(&voter, ballot) {
            Ok(_) if pre => Ok(()),
            Ok(vote) => {
                if vote != i.vote {
                    self.persist(&vote).map_err(|_| (Refusal::Term(i.vote.term), i.vote, i.generation))?;
                    i.vote = vote;
                }
                i.lost_since = Some(now);
                self.look.notify_one();
                Ok(())
            }
            Err(r) => Err((r, i.vote, i.generation)),
        }
    }

    /// Stands in `term`: votes for itself, persisted first; false if it knows that term already.
    pub(crate) fn stand(&self, term: u64, rank: usize) -> Result<bool, VoteError> {
        let mut i = self.lock();
        if term <= i.vote.term {
            return Ok(false);
        }
        let vote = Vote { term, voted_for: Some(rank), coordinator: None };
        self.persist(&vote)?;
        i.vote = vote;
        Ok(true)
    }

    /// Takes `vote` if it is the one it replaces by the rules (a term won, a coordinator heard
    /// of); persisted first. Whether it changed anything.
    pub(crate) fn adopt(&self, term: u64, coordinator: usize) -> Result<bool, VoteError> {
        let mut i = self.lock();
        let Some(vote) = follows(&i.vote, term, coordinator) else { return Ok(false) };
        self.persist(&vote)?;
        i.vote = vote;
        i.lost_since = None;
        self.moves.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.moved.notify_waiters();
        Ok(true)
    }

    /// A term higher than its own was heard of (its coordinator unknown): it will vote in no
    /// lower one.
    pub(crate) fn heard(&self, term: u64) -> Result<bool, VoteError> {
        let mut i = self.lock();
        if term <= i.vote.term {
            return Ok(false);
        }
        let vote = Vote { term, voted_for: None, coordinator: None };
        self.persist(&vote)?;
        i.vote = vote;
        Ok(true)
    }

    /// The run finished (this member passed its final barrier): its vote is of no further use,
    /// and its file is removed, so that the same job run again on these nodes starts with the
    /// chief coordinating, as TF_CONFIG says, not with a term this run elected.
    pub(crate) fn forget(&self) -> Result<(), VoteError> {
        let Some(path) = &self.file else { return Ok(()) };
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(VoteError::File { path: path.clone(), source: e })
            }
            _ => Ok(()),
        }
    }

    fn persist(&self, vote: &Vote) -> Result<(), VoteError> {
        let Some(path) = &self.file else { return Ok(()) };
        let bytes = serde_json::to_vec(vote).map_err(VoteError::Encode)?;
        crate::sys::atomic::write_file(path, &[&bytes]).map_err(|source| VoteError::File { path: path.clone(), source })
    }
}

/// The vote kept in `path`, and whether there was none (term 0, the chief).
fn read(path: &Path) -> Result<(Vote, bool), VoteError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(|v| (v, false))
            .map_err(|source| VoteError::NotAVote { path: path.to_path_buf(), source }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok((Vote::default(), true)),
        Err(source) => Err(VoteError::File { path: path.to_path_buf(), source }),
    }
}

/// Where `rank` keeps its vote for the run `identity` (the cluster, the plugin and the run
/// configuration, so that another run's votes in the same directory do not count).
pub(crate) fn vote_file(dir: &Path, rank: usize, identity: &str) -> PathBuf {
    dir.join(format!("vote-rank{rank}-{}.json", run_id(identity)))
}

/// A short name for the run `identity`, for the files a member keeps in its state directory.
pub(crate) fn run_id(identity: &str) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(identity.as_bytes()).iter().take(8).map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const HB: Duration = Duration::from_millis(1500);

    fn lost(v: Vote, generation: u64) -> Voter {
        Voter { vote: v, generation, lost_for: Some(Duration::from_secs(10)), forgetful: false }
    }

    #[test]
    fn a_vote_is_granted_once_per_term_and_again_to_the_same_candidate() {
        let v = lost(Vote::default(), 7);
        let granted = answer(&v, &Ballot { term: 8, candidate: 1 }).unwrap();
        assert_eq!(granted, Vote { term: 8, voted_for: Some(1), coordinator: None });
        let after = lost(granted, 7);
        assert_eq!(answer(&after, &Ballot { term: 8, candidate: 1 }), Ok(granted));
        assert_eq!(answer(&after, &Ballot { term: 8, candidate: 2 }), Err(Refusal::Term(8)));
        assert_eq!(answer(&after, &Ballot { term: 7, candidate: 2 }), Err(Refusal::Term(8)));
        assert_eq!(answer(&after, &Ballot { term: 9, candidate: 2 }).unwrap().voted_for, Some(2));
    }

    #[test]
    fn a_term_only_heard_of_can_still_be_voted_in_once() {
        // The candidate's own `Who` answer told this voter of term 8 before its ballot arrived.
        let heard = lost(Vote { term: 8, voted_for: None, coordinator: None }, 3);
        let granted = answer(&heard, &Ballot { term: 8, candidate: 1 }).unwrap();
        assert_eq!(granted, Vote { term: 8, voted_for: Some(1), coordinator: None });
        let after = Voter { vote: granted, ..heard };
        assert_eq!(answer(&after, &Ballot { term: 8, candidate: 2 }), Err(Refusal::Term(8)));
        // A term whose winner it follows is closed.
        let follows = lost(Vote { term: 8, voted_for: None, coordinator: Some(2) }, 3);
        assert_eq!(answer(&follows, &Ballot { term: 8, candidate: 1 }), Err(Refusal::Term(8)));
    }

    #[test]
    fn no_vote_below_a_generation_seen_or_while_the_coordinator_answers() {
        let v = lost(Vote::default(), 12);
        assert_eq!(answer(&v, &Ballot { term: 12, candidate: 1 }), Err(Refusal::Generation(12)));
        let healthy = Voter { lost_for: None, ..v };
        assert_eq!(answer(&healthy, &Ballot { term: 13, candidate: 1 }), Err(Refusal::Healthy));
        // A link that broke a moment ago is lost: the vote is granted at once.
        let just = Voter { lost_for: Some(Duration::from_millis(1)), ..v };
        assert_eq!(answer(&just, &Ballot { term: 13, candidate: 1 }).unwrap().voted_for, Some(1));
        assert_eq!(Refusal::Healthy.reason(Some("worker 0 (h:1)")), "its coordinator, worker 0 (h:1), answers");
    }

    #[test]
    fn a_member_without_its_vote_file_votes_once_a_majority_told_it_the_term_or_it_joined_a_generation() {
        let fresh = Voter { forgetful: true, ..lost(Vote::default(), 9) };
        assert_eq!(answer(&fresh, &Ballot { term: 12, candidate: 1 }), Err(Refusal::Forgetful));
        assert!(!caught_up(1, 3) && caught_up(2, 3) && !caught_up(2, 4) && caught_up(3, 4));
        assert!(!caught_up(1, 2), "in a 2-worker job the other alone is no majority of the two");
        let dir = tempfile::tempdir().unwrap();
        let e = Elections::open(Some(vote_file(dir.path(), 0, "run"))).unwrap();
        assert!(e.forgetful());
        e.heard_from(1, 3, 5).unwrap();
        assert!(e.forgetful(), "one of three is not enough");
        e.heard_from(2, 3, 7).unwrap();
        assert!(!e.forgetful());
        assert_eq!(e.vote().term, 7, "it took the highest term it heard of");
        // Or it is in a generation, formed by a majority that follows its coordinator's term.
        let other = Elections::open(Some(vote_file(dir.path(), 1, "run"))).unwrap();
        other.joined(3).unwrap();
        assert!(!other.forgetful() && vote_file(dir.path(), 1, "run").is_file());
    }

    #[test]
    fn the_lowest_live_rank_stands_first_and_a_lost_election_waits_a_round() {
        let opts = (Duration::from_secs(10), HB);
        let secs = Duration::from_secs_f64;
        assert!(!stands(secs(10.0), 0, 0, 3, opts));
        assert!(stands(secs(10.1), 0, 0, 3, opts));
        assert!(!stands(secs(12.9), 1, 0, 3, opts), "the next rank waits two heartbeat deadlines");
        assert!(stands(secs(13.1), 1, 0, 3, opts));
        assert!(!stands(secs(18.9), 0, 1, 3, opts), "after a lost election: a round of the others first");
        assert!(stands(secs(19.1), 0, 1, 3, opts));
        assert_eq!(next_term(&Vote::default(), 41), 42);
        assert!(won(2, 3) && !won(1, 3) && !won(2, 4) && won(3, 4));
    }

    #[test]
    fn a_member_follows_a_higher_term_or_the_winner_of_its_own() {
        let mine = Vote { term: 8, voted_for: Some(1), coordinator: None };
        assert_eq!(follows(&mine, 8, 1), Some(Vote { term: 8, voted_for: Some(1), coordinator: Some(1) }));
        assert_eq!(follows(&mine, 9, 2), Some(Vote { term: 9, voted_for: None, coordinator: Some(2) }));
        assert_eq!(follows(&mine, 7, 0), None);
        let known = Vote { coordinator: Some(1), ..mine };
        assert_eq!(follows(&known, 8, 2), None, "one coordinator per term");
    }

    #[test]
    fn a_vote_survives_a_restart_and_a_damaged_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = vote_file(dir.path(), 2, "run");
        let e = Elections::open(Some(path.clone())).unwrap();
        assert_eq!(e.vote(), Vote::default());
        // No file yet: it votes once a majority of the others told it the term (here, 0).
        e.heard_from(2, 3, 0).unwrap();
        let now = Instant::now();
        e.set_lost(Some(now - Duration::from_secs(5)));
        e.answer(&Ballot { term: 4, candidate: 1 }, now, true).unwrap();
        assert_eq!(e.vote(), Vote::default(), "a pre-vote changes nothing");
        e.answer(&Ballot { term: 4, candidate: 1 }, now, false).unwrap();
        drop(e);
        let again = Elections::open(Some(path.clone())).unwrap();
        assert_eq!(again.vote(), Vote { term: 4, voted_for: Some(1), coordinator: None });
        again.set_lost(Some(now - Duration::from_secs(5)));
        let (refusal, _, _) = again.answer(&Ballot { term: 4, candidate: 3 }, now, false).unwrap_err();
        assert_eq!(refusal, Refusal::Term(4), "the restarted member does not vote twice in term 4");
        std::fs::write(&path, b"{").unwrap();
        let err = Elections::open(Some(path.clone())).err().unwrap().to_string();
        assert!(err.starts_with(&format!("{}: not a trainerd vote", path.display())), "{err}");
        assert_ne!(vote_file(dir.path(), 2, "another run"), path);
    }

    /// A finished run's vote is removed: the same job started again begins at term 0 (its chief
    /// coordinates), not at the term this run elected.
    #[test]
    fn a_finished_runs_vote_is_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let path = vote_file(dir.path(), 1, "run");
        let e = Elections::open(Some(path.clone())).unwrap();
        e.heard_from(2, 3, 0).unwrap();
        e.set_lost(Some(Instant::now() - Duration::from_secs(5)));
        e.answer(&Ballot { term: 3, candidate: 1 }, Instant::now(), false).unwrap();
        assert!(path.exists());
        e.forget().unwrap();
        assert!(!path.exists());
        e.forget().unwrap();
        assert_eq!(Elections::open(Some(path)).unwrap().vote(), Vote::default());
    }

    /// A model of the cluster's elections: `n` members with persisted votes, candidates asking
    /// any subset, members restarting (losing everything but the vote file), and coordinators
    /// forming with whoever follows them.
    #[derive(Clone, Debug)]
    enum Event {
        /// `candidate` stands and asks the members in `asked` (a bit set).
        Stand { candidate: usize, asked: u8 },
        /// `member` asks `peer` whom it follows.
        Who { member: usize, peer: usize },
        /// `member` restarts.
        Restart { member: usize },

        /// The coordinator `member` believes in tries to form with the members in `asked`.
        Form { member: usize, asked: u8 },
    }

    fn event(n: usize) -> impl Strategy<Value = Event> {
        prop_oneof![
            (0..n, any::<u8>()).prop_map(|(candidate, asked)| Event::Stand { candidate, asked }),
            (0..n, 0..n).prop_map(|(member, peer)| Event::Who { member, peer }),
            (0..n).prop_map(|member| Event::Restart { member }),
            (0..n, any::<u8>()).prop_map(|(member, asked)| Event::Form { member, asked }),
        ]
    }

    proptest! {
        /// Never two coordinators with a majority each: every term has at most one winner, and a
        /// formation happens only at the highest term that ever formed (a coordinator of an older
        /// term can never form again once a majority has moved on), through restarts (the votes
        /// are kept; a member that lost its file is `a_member_that_lost_its_vote_file_...`'s).
        #[test]
        fn never_two_coordinators_with_a_majority(
            n in 2usize..6,
            events in proptest::collection::vec(event(5), 1..120),
        ) {
            // Persisted: each member's vote. Volatile: the generation seen.
            let mut votes = vec![Vote::default(); n];
            let mut seen = vec![0u64; n];
            let mut winners: std::collections::BTreeMap<u64, usize> = Default::default();
            let mut formed_term = 0u64;
            for e in events {
                match e {
                    Event::Stand { candidate, asked } => {
                        let c = candidate % n;
                        // As the elector: only a member that has been in a generation stands.
                        if seen[c] == 0 {
                            continue;
                        }
                        let term = next_term(&votes[c], seen[c]);
                        votes[c] = Vote { term, voted_for: Some(c), coordinator: None };
                        let mut grants = 1;
                        for m in (0..n).filter(|&m| m != c && asked & (1 << m) != 0) {
                            let voter = Voter { vote: votes[m], generation: seen[m], lost_for: Some(HB * 2), forgetful: false };
                            if let Ok(v) = answer(&voter, &Ballot { term, candidate: c }) {
                                votes[m] = v;
                                grants += 1;
                            }
                        }
                        if won(grants, n) {
                            prop_assert!(winners.insert(term, c).is_none_or(|w| w == c), "two winners in term {term}");
                            votes[c] = follows(&votes[c], term, c).unwrap();
                        }
                    }
                    Event::Who { member, peer } => {
                        let (m, p) = (member % n, peer % n);
                        match votes[p].coordinator {
                            Some(c) => {
                                if let Some(v) = follows(&votes[m], votes[p].term, c) {
                                    votes[m] = v;
                                }
                            }
                            // A higher term heard of, its winner unknown (`Elections::heard`).
                            None if votes[p].term > votes[m].term => {
                                votes[m] = Vote { term: votes[p].term, voted_for: None, coordinator: None };
                            }
                            None => {}
                        }
                    }
                    Event::Restart { member } => seen[member % n] = 0,

                    Event::Form { member, asked } => {
                        let m = member % n;
                        // It coordinates the term it follows itself in.
                        if votes[m].coordinator != Some(m) {
                            continue;
                        }
                        let term = votes[m].term;
                        let joined: Vec<usize> = (0..n)
                            .filter(|&r| r == m || asked & (1 << r) != 0)
                            .filter(|&r| votes[r].term == term && votes[r].coordinator == Some(m))
                            .collect();
                        if won(joined.len(), n) {
                            prop_assert!(term >= formed_term, "term {term} formed after term {formed_term}");
                            formed_term = term;
                            // Every member of the formation was in its generation: the next
                            // candidate stands above it.
                            let g = joined.iter().map(|&r| seen[r]).max().unwrap().max(term) + 1;
                            for &r in &joined {
                                seen[r] = g;
                            }
                        }
                    }
                }
            }
        }
    }
}
