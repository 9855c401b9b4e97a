//! A return staged at fixed steps, whatever the build's speed: the worker that leaves is stopped
//! at a failpoint before the test kills or stops it, so the others cannot train past that step
//! without it; the others stop at the start of a later step (the `train-step` failpoint) until
//! the returner is back: the coordinator hears it ask to catch up, or it joins a generation, or
//! it says it joins with a pause (no catch-up). A
//! release build trains a small job's remaining steps in less time than a restarted worker takes
//! to load libtorch: without the hold, such a return found the run over (`the run finished at
//! step N ...; nothing left to do`), and a test meant for a return while the others train tested
//! nothing of it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use trainerd_supervise::events::Event;

use crate::cluster::Cluster;

/// Where a return is staged, and where the stopped workers' release files go.
pub struct Return {
    dir: PathBuf,
    leaver: usize,
    leaves_at: String,
    held: Vec<usize>,
    held_at: u64,
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
        let (dir, leaves_at, held) = (dir.to_path_buf(), point.to_string(), held.to_vec());
        Return { dir, leaver, leaves_at, held, held_at }
    }

    /// The file whose creation lets worker `rank` go on from its failpoint (taken as it goes).
    pub fn release_file(&self, rank: usize) -> PathBuf {
        self.dir.join(format!("release.{rank}"))
    }

    /// The variables of every worker's first process, `also` (more failpoints of a worker,
    /// comma-separated, released by the same file) included: the leaver's stop, the others'
    /// hold, and the coordinator's service lines (where it hears a request to catch up).
    pub fn env(&self, workers: usize, also: &[(usize, &str)]) -> Vec<Vec<(String, String)>> {
        let points = |rank: usize| {
            let mut points: Vec<String> = also.iter().filter(|(r, _)| *r == rank).map(|(_, p)| p.to_string()).collect();
            if rank == self.leaver {
                points.push(self.leaves_at.clone());
            } else if self.held.contains(&rank) {
                points.push(format!("train-step@step={}", self.held_at));
            }
            points
        };
        (0..workers)
            .map(|rank| {
                let mut env = vec![("TRAINERD_LOG".to_string(), "warn,trainerd::cluster::service=info".to_string())];
                let points = points(rank);
                if !points.is_empty() {
                    env.push(("TRAINERD_FAILPOINT".to_string(), points.join(",")));
                    env.push(("TRAINERD_FAILPOINT_RELEASE".to_string(), self.release_file(rank).display().to_string()));
                }
                env
            })
            .collect()
    }

    /// Waits for the leaver to stop at its failpoint (it is then `signal`led: SIGKILL, SIGTERM).
    pub fn stop_leaver(&self, c: &mut Cluster, timeout: Duration) {
        let name = self.leaves_at.split('@').next().unwrap_or_default();
        c.wait_line(self.leaver, &format!("trainerd: failpoint {name} reached"), 0, timeout);
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
    pub fn bring_back(&self, c: &mut Cluster, coordinator: usize, timeout: Duration) -> usize {
        self.wait_held(c, timeout);
        let back = c.mark();
        c.bring_back(self.leaver);
        self.release_once_back(c, coordinator, back, timeout);
        back
    }

    /// Waits for the held workers to stop at their step and for the leaver's new process, after
    /// `mark`, to be back: the coordinator `coordinator` hears it ask to catch up, or it joins a
    /// generation, or it says it joins with a pause; then lets the held workers go on.
    pub fn release_when_back(&self, c: &mut Cluster, coordinator: usize, mark: usize, timeout: Duration) {
        self.wait_held(c, timeout);
        self.release_once_back(c, coordinator, mark, timeout);
    }

    /// Lets the held workers go on once the leaver's new process, after `mark`, is back.
    fn release_once_back(&self, c: &mut Cluster, coordinator: usize, mark: usize, timeout: Duration) {
        // A log line (time, level, target, then the message).
        let asks = format!(" worker {} (", self.leaver);
        let asked = |l: &str| l.contains(&asks) && l.contains(") asks to catch up with generation ");
        let joined = |e: &Event| matches!(e, Event::Joined { .. });
        // Refused a catch-up, it joins with a pause: the others' next step boundary.
        let refused = |l: &str| l.starts_with("trainerd: no catch-up: ");
        c.wait_after(
            mark,
            |e| {
                (e.worker == coordinator && e.line().is_some_and(asked))
                    || (e.worker == self.leaver && (e.event().is_some_and(joined) || e.line().is_some_and(refused)))
            },
            timeout,
        );
        self.held.iter().for_each(|&rank| self.release(rank));
    }

    fn wait_held(&self, c: &mut Cluster, timeout: Duration) {
        for &rank in &self.held {
            c.wait_line(rank, "trainerd: failpoint train-step reached", 0, timeout);
        }
    }
}
