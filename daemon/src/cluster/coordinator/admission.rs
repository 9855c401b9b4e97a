//! Who the coordinator admits: a member running the same job (its TF_CONFIG cluster, plugin and
//! run configuration), and, to catch up, a process that starts while a generation trains
//! without it.

use tonic::Status;

use super::super::catch_up::NOTHING_TRAINS;
use super::super::difference;
use super::super::wire::{check_rank, proto};
use super::rules::in_final_barrier;
use super::Coordinator;

impl Coordinator {
    /// Why the member of rank `rank` with `identity` (TF_CONFIG cluster, plugin, run
    /// configuration) cannot take part, naming the member and both values.
    pub(super) fn mismatch(&self, rank: usize, (cluster, plugin, run): (&str, &str, &str)) -> Option<String> {
        let who = &self.names[rank];
        let role = self.role();
        if cluster != self.expected.cluster_json {
            return Some(format!(
                "{who} has a different TF_CONFIG cluster: {cluster} on {who}, {} on {role}",
                self.expected.cluster_json
            ));
        }
        if plugin != self.expected.plugin {
            return Some(format!(
                "{who} runs a different plugin: {plugin} on {who}, {} on {role}",
                self.expected.plugin
            ));
        }
        if run != self.expected.run_config_json {
            return Some(format!(
                "{who} has a different run configuration: {} on {role}",
                difference::json_difference(run, &self.expected.run_config_json, who)
            ));
        }
        None
    }

    /// Whether the process `req` speaks for may catch up now (docs/fault-tolerance.md, "A return
    /// that does not pause the survivors"): a generation is formed and training without it, it
    /// has not joined, its heartbeats speak for it, and it runs the same job. Its rank, its name
    /// and the generation; else why not (it joins as before).
    pub(in crate::cluster) fn may_catch_up(&self, req: &proto::CatchUpRequest) -> Result<(usize, String, u64), Status> {
        let rank = check_rank(req.rank, self.names.len())?;
        let identity = (req.cluster_json.as_str(), req.plugin_identity.as_str(), req.run_config_json.as_str());
        if let Some(why) = self.mismatch(rank, identity) {
            return Err(Status::failed_precondition(why));
        }
        let c = self.lock();
        let name = self.names[rank].clone();
        if let Some(why) = &c.deposed {
            return Err(Status::unavailable(why.clone()));
        }
        let m = &c.state.members[rank];
        let not_now = |why: String| Err(Status::failed_precondition(why));
        if !c.state.formed || c.state.finished || in_final_barrier(&c.state) {
            return not_now(NOTHING_TRAINS.into());
        }
        if m.active || m.joined.is_some() {
            return not_now(format!("{name} is in generation {} or has joined it", c.state.generation));
        }
        if m.incarnation != Some(req.incarnation) {
            return not_now(format!("{name}'s heartbeats speak for another process"));
        }
        Ok((rank, name, c.state.generation))
    }
}
