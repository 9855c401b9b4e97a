//! What this member found at a comparison of the replicas, told to every peer before it acts on
//! it, and what peers told it ([`super::super::finding`]).

use super::super::finding::Finding;
use super::super::wire::proto;
use super::ControlPlane;

impl ControlPlane {
    /// Tells every peer what this member found at the comparison of global step `step` in
    /// `generation` (`odd`: the members whose state differed; `why`: what it says; `in_place`:
    /// they took a right member's parameters and no step is lost), and waits until each has kept
    /// it, failed, or not answered within the heartbeat deadline: a peer that answered carries
    /// the finding into the next formation whatever becomes of this process. How many peers kept
    /// it.
    pub(crate) fn tell(&self, generation: u64, step: u64, (odd, why, in_place): (&[String], &str, bool)) -> usize {
        let (rank, odd, why) = (self.rank as u32, odd.to_vec(), why.to_string());
        let request = proto::FoundRequest { generation, rank, step, odd, why, in_place };
        let within = self.timeouts.heartbeat_deadline;
        let calls = self.peers.iter().flatten().map(|client| {
            let (mut client, request) = (client.clone(), request.clone());
            async move { matches!(tokio::time::timeout(within, client.found(request)).await, Ok(Ok(_))) }
        });
        self.runtime.block_on(futures::future::join_all(calls)).into_iter().filter(|&kept| kept).count()
    }

    /// What peers found at comparisons of `generation`, the generation this member was in, taken
    /// ([`ControlPlane::tell`]).
    pub(crate) fn findings(&self, generation: u64) -> Vec<Finding> {
        self.findings.take(generation)
    }
}
