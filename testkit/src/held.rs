//! A return staged at fixed steps, whatever the build's speed: the worker that leaves is stopped
//! at a failpoint before the test kills or stops it, so the others cannot train past that step
//! without it; the others stop at the start of a later step (the `train-step` failpoint) until
//! the returner is back: the coordinator says it came back (to catch up while they train, or to
//! join at their next step boundary, a refused catch-up included), or it joins a generation that
//! forms. A return may be staged several times over ([`Return::rounds`]): the leaver's next
//! process is armed for the next round as it stops. A release build trains a small job's
//! remaining steps in less time than a restarted worker takes to load libtorch: without the
//! hold, such a return found the run over (`the run finished at step N ...; nothing left to
//! do`), and a test meant for a return while the others train tested nothing of it (CI's run of
//! a3a5c11 failed two more such returns, in `elastic.rs` and `integrity.rs`).

use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::time::Duration;

use trainerd_supervise::events::Event;

use crate::cluster::Cluster;

/// Where a return is staged, and where the stopped workers' release files go.
pub struct Return {
    dir: PathBuf,
    leaver: usize,
    /// Each round's failpoint for the leaver (none where the test stops it otherwise) and the
    /// step the others are held at.
    rounds: Vec<(Option<String>, u64)>,
    held: Vec<usize>,
    /// The round under way, and the transcript's mark where it began (its stops are after it).
    round: Cell<usize>,
    since: Cell<usize>,
}

impl Return {
    /// Worker `leaver` stopped at the start of global step `leaves_at`; the workers `held` stopped
    /// at the start of `held_at` (after it) until it is back. Release files go in `dir`.
    pub fn new(dir: &Path, leaver: usize, leaves_at: u64, held: &[usize], held_at: u64) -> Return {
        assert!(held_at > leaves_at, "the others are held after the leaver's step");
        Return::at_point(dir, leaver, &format!("train-step@step={leaves_at}"), held, held_at)
    }

    /// As [`Return::new`], the leaver stopped at the failpoint `point` (`replica-check@step=120`).
    pub fn at_point(dir: &Path, leaver: usize, point: &str, held: &[usize], held_at: u64) -> Return {
        Return::staged(dir, leaver, vec![(Some(point.to_string()), held_at)], held)
    }

    /// The workers `held` stopped at the start of `held_at` until worker `leaver` is back, where
    /// the test takes it down otherwise (killed at its start, or when a peer is at a step).
    pub fn held_for(dir: &Path, leaver: usize, held: &[usize], held_at: u64) -> Return {
        Return::staged(dir, leaver, vec![(None, held_at)], held)
    }

    /// As [`Return::new`], once per `(leaves_at, held_at)` of `rounds`, in order: the leaver
    /// leaves and comes back each time (restarted by the cluster, or brought back).
    pub fn rounds(dir: &Path, leaver: usize, rounds: &[(u64, u64)], held: &[usize]) -> Return {
        let steps = rounds.iter().flat_map(|&(l, h)| [l, h]);
        assert!(steps.clone().zip(steps.skip(1)).all(|(a, b)| a < b), "each round after the one before: {rounds:?}");
        let rounds = rounds.iter().map(|&(l, h)| (Some(format!("train-step@step={l}")), h)).collect();
        Return::staged(dir, leaver, rounds, held)
    }

    fn staged(dir: &Path, leaver: usize, rounds: Vec<(Option<String>, u64)>, held: &[usize]) -> Return {
        let (dir, held) = (dir.to_path_buf(), held.to_vec());
        Return { dir, leaver, rounds, held, round: Cell::new(0), since: Cell::new(0) }
    }

    /// The file whose creation lets worker `rank` go on from its failpoint (taken as it goes).
    pub fn release_file(&self, rank: usize) -> PathBuf {
        self.dir.join(format!("release.{rank}"))
    }

    /// The variables of every worker's first process, `also` (more failpoints of a worker,
    /// comma-separated, released by the same file) included: the leaver's stop and the others'
    /// hold.
    pub fn env(&self, workers: usize, also: &[(usize, &str)]) -> Vec<Vec<(String, String)>> {
        let points = |rank: usize| {
            let mut points: Vec<String> = also.iter().filter(|(r, _)| *r == rank).map(|(_, p)| p.to_string()).collect();
            if rank == self.leaver {
                points.extend(self.rounds[0].0.clone());
            } else if self.held.contains(&rank) {
                points.extend(self.rounds.iter().map(|(_, held_at)| format!("train-step@step={held_at}")));
            }
            points
        };
        (0..workers).map(|rank| self.process_env(rank, &points(rank))).collect()
    }

    /// A process's variables: `points` released by its file.
    fn process_env(&self, rank: usize, points: &[String]) -> Vec<(String, String)> {
        let mut env = Vec::new();
        if !points.is_empty() {
            env.push(("TRAINERD_FAILPOINT".to_string(), points.join(",")));
            env.push(("TRAINERD_FAILPOINT_RELEASE".to_string(), self.release_file(rank).display().to_string()));
        }
        env
    }

    /// Waits for the leaver to stop at this round's failpoint (it is then `signal`led: SIGKILL,
    /// SIGTERM), and arms its next process for the next round, if any.
    pub fn stop_leaver(&self, c: &mut Cluster, timeout: Duration) {
        let round = self.round.get();
        let point = self.rounds[round].0.as_deref().expect("a leaver stopped at a failpoint (not Return::held_for)");
        let name = point.split('@').next().unwrap_or_default();
        c.wait_line(self.leaver, &format!("trainerd: failpoint {name} reached"), self.since.get(), timeout);
        if let Some((next, _)) = self.rounds.get(round + 1) {
            c.arm(self.leaver, self.process_env(self.leaver, next.as_slice()));
        }
    }

    /// Arms the held workers' next processes to wait at this round's step as well (for a test
    /// about to kill and restart them before that step).
    pub fn arm_held(&self, c: &Cluster) {
        let hold = format!("train-step@step={}", self.rounds[self.round.get()].1);
        for &rank in &self.held {
            c.arm(rank, self.process_env(rank, std::slice::from_ref(&hold)));
        }
    }

    /// Lets the leaver go on from its failpoint (after a SIGTERM, to stop at the step's end).
    pub fn release_leaver(&self) {
        self.release(self.leaver);
    }

    fn release(&self, rank: usize) {
        std::fs::write(self.release_file(rank), b"").expect("a release file");
    }

    /// For a leaver held down: waits for the held workers to stop at their step, brings the
    /// leaver back, and lets them go on once it is back ([`Return::release_when_back`]). The
    /// mark before it came back.
    pub fn bring_back(&self, c: &mut Cluster, timeout: Duration) -> usize {
        self.wait_held(c, timeout);
        let back = c.mark();
        c.bring_back(self.leaver);
        self.wait_back(c, self.leaver, back, timeout);
        self.release_held(c);
        back
    }

    /// Brings back `rank`, another worker held down, while the others are held, and waits until
    /// it is back (as the leaver's return is awaited; the others are not released). The mark
    /// before it came back.
    pub fn bring_back_also(&self, c: &mut Cluster, rank: usize, timeout: Duration) -> usize {
        self.wait_held(c, timeout);
        let back = c.mark();
        c.bring_back(rank);
        self.wait_back(c, rank, back, timeout);
        back
    }

    /// Waits for the held workers to stop at their step and for the leaver's new process, after
    /// `mark`, to be back: the coordinator (whichever worker coordinates) says it came back, or
    /// it joins a generation that forms; then lets the held workers go on.
    pub fn release_when_back(&self, c: &mut Cluster, mark: usize, timeout: Duration) {
        self.wait_held(c, timeout);
        self.wait_back(c, self.leaver, mark, timeout);
        self.release_held(c);
    }

    /// Waits for worker `rank`'s new process, after `mark`, to be back.
    fn wait_back(&self, c: &mut Cluster, rank: usize, mark: usize, timeout: Duration) {
        // The coordinator's line: it catches up while the others train, or (not asking, with
        // `--catch-up-memory 0`) it ends the generation at the next step boundary.
        let came = format!("trainerd: worker {rank} (");
        let came_back = |l: &str| l.starts_with(&came) && l.contains(") came back; ");
        // Or it joins a generation forming (no generation formed to come back to).
        let joined = |e: &Event| matches!(e, Event::Joined { .. });
        c.wait_after(
            mark,
            |e| {
                (e.worker != rank && e.line().is_some_and(came_back))
                    || (e.worker == rank && e.event().is_some_and(joined))
            },
            timeout,
        );
    }

    /// Lets the held workers go on, and starts the next round.
    fn release_held(&self, c: &mut Cluster) {
        self.held.iter().for_each(|&rank| self.release(rank));
        self.since.set(c.mark());
        self.round.set(self.round.get() + 1);
    }

    fn wait_held(&self, c: &mut Cluster, timeout: Duration) {
        for &rank in &self.held {
            c.wait_line(rank, "trainerd: failpoint train-step reached", self.since.get(), timeout);
        }
    }
}
