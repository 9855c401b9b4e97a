//! A member's wait for a run that may have finished: a worker that comes back after the end
//! (its join gets no answer, or, coordinating, no member) reads the latest commit record and
//! exits 0 naming where the run finished, instead of waiting for a cluster that is gone
//! (docs/fault-tolerance.md, "A return after the end").

use std::future::Future;
use std::time::{Duration, Instant};

use super::{ClusterError, ControlPlane, FinishedProbe};

impl ControlPlane {
    /// While a join gets no answer, ask `probe` now and then whether the run has finished (a worker
    /// that comes back after the end then exits 0 instead of waiting for a cluster that is gone).
    pub(crate) fn set_finished_probe(&mut self, probe: FinishedProbe) {
        self.finished = Some(probe);
    }

    /// Whether the run has finished, when the coordinator has not answered for two heartbeat
    /// deadlines since `since` and `probed` (the last look) is a second old: what to say.
    pub(super) async fn finished(&self, since: Instant, probed: &mut Option<Instant>) -> Option<String> {
        let probe = self.finished.clone()?;
        let now = Instant::now();
        let silent = now.saturating_duration_since(since.max(self.shared.last_contact()));
        let due = probed.is_none_or(|p| now.saturating_duration_since(p) >= Duration::from_secs(1));
        if silent < self.timeouts.heartbeat_deadline * 2 || !due {
            return None;
        }
        *probed = Some(now);
        let said = tokio::task::spawn_blocking(move || probe()).await.ok().flatten();
        // A worker down when the run finished on another machine's disk cannot tell that from a
        // cluster that is down, and waits for it: said once, past what an election or a restart
        // takes.
        let long = silent >= self.timeouts.heartbeat_deadline * 10;
        if said.is_none() && long && !self.shared.said_unfinished.swap(true, std::sync::atomic::Ordering::Relaxed) {
            eprintln!(
                "trainerd: no coordinator has answered for {:.0}s ({} was the last known), and the checkpoint \
                 location holds no commit that ends this run: waiting for the cluster (a run that finished while this \
                 worker was down shows here only where the others committed to a location this worker reads; SIGTERM \
                 stops the wait)",
                silent.as_secs_f64(),
                self.coordinator_name()
            );
        }
        said
    }

    /// On the coordinator's process, while its own join waits for members: from two heartbeat
    /// deadlines after `since` on, asks the probe every second whether the run has finished (its
    /// own beats keep it in contact, so [`ControlPlane::finished`]'s silence never comes); what
    /// to say once it has. Never, without a probe.
    async fn finished_meanwhile(&self, since: Instant) -> String {
        let Some(probe) = self.finished.clone() else { return std::future::pending().await };
        tokio::time::sleep_until((since + self.timeouts.heartbeat_deadline * 2).into()).await;
        loop {
            let ask = probe.clone();
            if let Some(said) = tokio::task::spawn_blocking(move || ask()).await.ok().flatten() {
                return said;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// The answer to this process's join `call`; on the coordinator's process (`own`: its own
    /// join waits for members, and none comes to a run that finished), the run's end instead once
    /// the probe finds it, `since` being when the join began.
    pub(super) async fn answer_or_end<T>(
        &self,
        call: impl Future<Output = T>,
        own: bool,
        since: Instant,
    ) -> Result<T, ClusterError> {
        if !own {
            return Ok(call.await);
        }
        tokio::select! {
            answer = call => Ok(answer),
            said = self.finished_meanwhile(since) => Err(ClusterError::Finished(said)),
        }
    }
}
