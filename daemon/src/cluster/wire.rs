//! What crosses the control plane, read the same way on both sides: the generated gRPC code
//! ([`proto`], from `daemon/proto/control.proto`), the two records a member and the coordinator
//! read from it ([`Identity`], what every member must agree on; [`Formed`], a formed generation),
//! and a rank's check against the cluster's size.

use tonic::Status;

/// Generated gRPC code.
#[allow(missing_docs, unreachable_pub, clippy::all)]
pub(crate) mod proto {
    tonic::include_proto!("trainerd.control.v1");
}

pub(crate) use proto::control_client::ControlClient;
pub(crate) use proto::control_server::ControlServer;

/// What every member must agree on for the replicas to stay identical.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Identity {
    /// The TF_CONFIG `cluster`, canonical JSON.
    pub(crate) cluster_json: String,
    /// Plugin name, version and build facts.
    pub(crate) plugin: String,
    /// Run configuration, canonical JSON (an object).
    pub(crate) run_config_json: String,
}

/// A formed generation, as a member learns it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Formed {
    /// Its number.
    pub(crate) generation: u64,
    /// Data-plane address of each rank.
    pub(crate) data_addresses: Vec<String>,
    /// The rank whose state everyone continues from.
    pub(crate) source: usize,
    /// That state's progress.
    pub(crate) progress: (u64, u64),
    /// That state's sha256.
    pub(crate) digest: String,
    /// Ranks that receive the source's state.
    pub(crate) receivers: Vec<usize>,
    /// A generation had formed before: this one is a recovery.
    pub(crate) recovery: bool,
    /// Steps the members' states had reached that this formation does not continue from: every
    /// member trains them again.
    pub(crate) steps_trained_again: u64,
    /// Of those, the ones no repair of a corrupted replica asked for.
    pub(crate) steps_lost: u64,
    /// The ranks in the generation, ascending (the ring's order).
    pub(crate) members: Vec<usize>,
    /// The coordinator's rank (it commits).
    pub(crate) coordinator: usize,
    /// The coordinator's term (0: the chief's, without a vote).
    pub(crate) term: u64,
}

impl Formed {
    /// The generation of a worker alone, at `progress`.
    pub(crate) fn alone(generation: u64, progress: (u64, u64)) -> Formed {
        Formed {
            generation,
            data_addresses: Vec::new(),
            source: 0,
            progress,
            digest: String::new(),
            receivers: Vec::new(),
            recovery: false,
            steps_trained_again: 0,
            steps_lost: 0,
            members: vec![0],
            coordinator: 0,
            term: 0,
        }
    }
}

impl From<&Formed> for proto::JoinReply {
    fn from(f: &Formed) -> proto::JoinReply {
        proto::JoinReply {
            generation: f.generation,
            data_addresses: f.data_addresses.clone(),
            source: f.source as u32,
            progress_major: f.progress.0,
            progress_minor: f.progress.1,
            sha256: f.digest.clone(),
            receivers: f.receivers.iter().map(|&r| r as u32).collect(),
            recovery: f.recovery,
            steps_lost: f.steps_lost,
            steps_trained_again: f.steps_trained_again,
            members: f.members.iter().map(|&r| r as u32).collect(),
            coordinator: f.coordinator as u32,
            term: f.term,
            read_first: false,
        }
    }
}

impl From<proto::JoinReply> for Formed {
    fn from(r: proto::JoinReply) -> Formed {
        Formed {
            generation: r.generation,
            data_addresses: r.data_addresses,
            source: r.source as usize,
            progress: (r.progress_major, r.progress_minor),
            digest: r.sha256,
            receivers: r.receivers.into_iter().map(|r| r as usize).collect(),
            recovery: r.recovery,
            steps_trained_again: r.steps_trained_again,
            steps_lost: r.steps_lost,
            members: r.members.into_iter().map(|r| r as usize).collect(),
            coordinator: r.coordinator as usize,
            term: r.term,
        }
    }
}

/// `rank` as an index, or why it is no rank of a cluster of `world` members.
pub(crate) fn check_rank(rank: u32, world: usize) -> Result<usize, Status> {
    let r = rank as usize;
    if r >= world {
        return Err(Status::invalid_argument(format!("rank {rank} is out of range for {world} members")));
    }
    Ok(r)
}
