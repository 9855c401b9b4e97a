//! A member's side of a returner's catch-up (docs/fault-tolerance.md, "A return that does not
//! pause the survivors"): asking the coordinator for it, and, on the coordinator's process,
//! taking a returner's request for the training thread.

use std::time::{Duration, Instant};

use super::super::catch_up::{Catching, Offer, LARGEST_PART};
use super::super::wire::proto;
use super::ControlPlane;

impl ControlPlane {
    /// A returner's request to catch up, left here while this process coordinates (its next
    /// step boundary takes the snapshot).
    pub(crate) fn catch_up_offer(&self) -> Option<Offer> {
        self.hub.take()
    }

    /// Asks the coordinator this member follows to catch up with the generation it trains
    /// (docs/fault-tolerance.md, "A return that does not pause the survivors"): the stream, once
    /// its first part is on its way, or why not (the caller joins as before). `patience` bounds
    /// the wait for each part.
    pub(crate) fn catch_up(&self, patience: Duration) -> Result<Catching, String> {
        let Some((term, rank, dial)) = self.coordinator() else { return Err("no coordinator is known".into()) };
        if rank == self.rank {
            return Err("this process coordinates".into());
        }
        let request = proto::CatchUpRequest {
            rank: self.rank as u32,
            incarnation: self.incarnation,
            cluster_json: self.identity.cluster_json.clone(),
            plugin_identity: self.identity.plugin.clone(),
            run_config_json: self.identity.run_config_json.clone(),
            term: self.shared.elections.vote().term.max(term),
        };
        let deadline = self.timeouts.heartbeat_deadline;
        let stream = self.runtime.block_on(async {
            // One attempt: a coordinator not up yet (a cluster starting) has nothing to catch up with.
            let client = dial.connect(Instant::now() + Duration::from_millis(1)).await.map_err(|e| e.to_string())?;
            let mut client = client.max_decoding_message_size(LARGEST_PART);
            let call = tokio::time::timeout(deadline, client.catch_up(request)).await;
            let reply =
                call.map_err(|_| format!("{} did not answer in {:.1}s", self.names[rank], deadline.as_secs_f64()))?;
            reply.map(tonic::Response::into_inner).map_err(|status| status.message().to_string())
        })?;
        Ok(Catching::new(stream, self.runtime.handle().clone(), patience))
    }

    /// Tells the coordinator this returner's replay reached `step` (sent in the background; one
    /// lost is made up for by the next).
    pub(crate) fn caught_up_to(&self, step: u64) {
        let Some((_, _, dial)) = self.coordinator() else { return };
        let (dial, request) = (dial.clone(), proto::CatchUpProgressRequest { rank: self.rank as u32, step });
        self.runtime.spawn(async move {
            if let Ok(mut client) = dial.connect(Instant::now() + Duration::from_secs(1)).await {
                let _ = tokio::time::timeout(Duration::from_secs(1), client.catch_up_progress(request)).await;
            }
        });
    }
}
