//! What can go wrong on the control plane, as one error type, and the one mapping from a gRPC
//! answer of the chief's to it ([`from_status`]): every call a member makes reads the chief's
//! answers the same way.

use std::time::Duration;

use tonic::{Code, Status};

/// A control-plane failure.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ClusterError {
    /// This daemon's own address cannot be served.
    #[error("cannot listen on {address} ({member}'s address in TF_CONFIG): {reason}")]
    Bind {
        /// The address.
        address: String,
        /// Whose address it is.
        member: String,
        /// Why.
        #[source]
        reason: BindError,
    },
    /// The chief refused this member.
    #[error("rendezvous refused by the chief: {0}")]
    Refused(String),
    /// The coordinator gave up waiting for missing members.
    #[error("{phase}: {detail}")]
    GaveUp {
        /// `rendezvous` (the first formation) or `recovery`.
        phase: &'static str,
        /// Who was missing, and for how long they were waited for.
        detail: String,
    },
    /// The chief could not be reached for the whole deadline.
    #[error("{phase}: no answer from the chief, {chief}, within {timeout:?}: {detail}")]
    ChiefSilent {
        /// `rendezvous` or `recovery`.
        phase: &'static str,
        /// The chief, named.
        chief: String,
        /// The deadline.
        timeout: Duration,
        /// What happened last.
        detail: String,
    },
    /// The run had finished: a worker that came back after its end learned it (from the final
    /// commit) while its coordinator did not answer; nothing is left to do.
    #[error("{0}")]
    Finished(String),
    /// No member holds a state, and this process coordinates without having read its checkpoint
    /// location: it reads it first, then joins again (not an error the command line sees).
    #[error("no member holds a state: the coordinator reads its checkpoint location first")]
    ReadFirst,
    /// The generation ended while this member waited in it.
    #[error("generation {generation} ended: {reason}")]
    Aborted {
        /// The generation.
        generation: u64,
        /// Why.
        reason: String,
    },
    /// A newer process holds this member's rank.
    #[error("{0}")]
    Replaced(String),
    /// Stopped by a signal while waiting.
    #[error("stopped while waiting for the cluster")]
    Stopped,
    /// The chief refused a request that cannot succeed.
    #[error("control plane: {request}: {message}")]
    Rejected {
        /// The request (`barrier NAME`, `rendezvous: join`).
        request: String,
        /// The chief's answer.
        message: String,
    },
    /// This member's vote cannot be read or kept.
    #[error("control plane: {0}")]
    Vote(#[from] VoteError),
    /// The control plane's runtime or listener could not be set up.
    #[error("control plane: {0}")]
    Setup(#[source] std::io::Error),
    /// The coordinator sent a formation this member cannot follow (another version, or a bug).
    #[error("control plane: {from} formed generation {generation} with what this worker cannot follow: {what}")]
    Malformed {
        /// The coordinator, named.
        from: String,
        /// The generation.
        generation: u64,
        /// What is wrong with it.
        what: String,
    },
    /// A member's data-plane address does not resolve.
    #[error("control plane: data address {address}: {source}")]
    DataAddress {
        /// The address.
        address: String,
        /// Why.
        source: ResolveError,
    },
}

/// Why this daemon's address cannot be served.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BindError {
    /// It does not resolve (and names no port either).
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    /// The address itself cannot be bound.
    #[error("{0}")]
    Address(#[source] std::io::Error),
    /// The address it binds for it (another interface) cannot be bound.
    #[error("binding {addr}: {source}")]
    Other {
        /// The address bound.
        addr: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The data plane's listener cannot be bound.
    #[error("data-plane listener on {bind}: {source}")]
    DataListener {
        /// The interface.
        bind: std::net::IpAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// Why `host:port` gives no socket address.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ResolveError {
    /// The lookup failed.
    #[error("cannot resolve: {0}")]
    Lookup(#[source] std::io::Error),
    /// It resolves to nothing.
    #[error("resolves to no address")]
    NoAddress,
}

/// Why a connection to a member's control plane failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DialError {
    /// Its address is not a URI.
    #[error("bad address {address}: {source}")]
    Address {
        /// The address.
        address: String,
        /// Why.
        source: tonic::transport::Error,
    },
    /// It did not accept a connection in time.
    #[error("cannot connect to {address}: {}", chain(source))]
    Connect {
        /// The address.
        address: String,
        /// The last attempt's failure.
        source: tonic::transport::Error,
    },
}

/// An error and its causes, `: `-separated (tonic's own text says only "transport error").
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        text.push_str(": ");
        text.push_str(&s.to_string());
        cur = s.source();
    }
    text
}

/// Why this member's vote (for electing a coordinator) cannot be read or kept.
#[derive(Debug, thiserror::Error)]
pub(crate) enum VoteError {
    /// The vote file holds something else.
    #[error("{}: not a trainerd vote ({source}); remove it to start from term 0", path.display())]
    NotAVote {
        /// The file.
        path: std::path::PathBuf,
        /// Why it does not read.
        source: serde_json::Error,
    },
    /// The vote file cannot be read or written.
    #[error("{}: {source}", path.display())]
    File {
        /// The file.
        path: std::path::PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// The vote cannot be encoded.
    #[error("encoding the vote: {0}")]
    Encode(#[source] serde_json::Error),
}

/// A call to the chief, as the mapping names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Call<'a> {
    /// A join, in its phase (`rendezvous` or `recovery`).
    Join {
        /// `rendezvous` (the first formation) or `recovery`.
        phase: &'static str,
    },
    /// A barrier of a generation.
    Barrier {
        /// The generation.
        generation: u64,
        /// The barrier's name.
        name: &'a str,
    },
}

impl std::fmt::Display for Call<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Call::Join { phase } => write!(f, "{phase}: join"),
            Call::Barrier { name, .. } => write!(f, "barrier {name}"),
        }
    }
}

/// What an error answer from the chief to `call` means: `None` when it is transient (the chief
/// is not there, or restarting) and the call is tried again while the chief may come back.
///
/// - `Aborted`: what the call waited for ended: the coordinator gave up on a join, or the
///   barrier's generation ended;
/// - `FailedPrecondition` on a join: the chief refused this member (another run, a stale
///   process);
/// - `FailedPrecondition` elsewhere, `InvalidArgument`, `ResourceExhausted`, `OutOfRange`: the
///   request itself cannot succeed;
/// - anything else: transient.
pub(crate) fn from_status(status: &Status, call: Call<'_>) -> Option<ClusterError> {
    let message = status.message().to_string();
    Some(match (status.code(), call) {
        (Code::Aborted, Call::Join { phase }) => ClusterError::GaveUp { phase, detail: message },
        (Code::Aborted, Call::Barrier { generation, .. }) => ClusterError::Aborted { generation, reason: message },
        (Code::FailedPrecondition, Call::Join { .. }) => ClusterError::Refused(message),
        (Code::FailedPrecondition | Code::InvalidArgument | Code::ResourceExhausted | Code::OutOfRange, call) => {
            ClusterError::Rejected { request: call.to_string(), message }
        }
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_call_reads_the_chiefs_answers_one_way() {
        let join = Call::Join { phase: "recovery" };
        let barrier = Call::Barrier { generation: 4, name: "finished" };
        let text = |s: Status, c| from_status(&s, c).map(|e| e.to_string());
        assert_eq!(
            text(Status::aborted("worker 2 did not join within 2s"), join).unwrap(),
            "recovery: worker 2 did not join within 2s"
        );
        assert_eq!(text(Status::aborted("worker 1 left"), barrier).unwrap(), "generation 4 ended: worker 1 left");
        assert_eq!(
            text(Status::failed_precondition("a different plugin"), join).unwrap(),
            "rendezvous refused by the chief: a different plugin"
        );
        assert_eq!(
            text(Status::failed_precondition("held by another process"), barrier).unwrap(),
            "control plane: barrier finished: held by another process"
        );
        assert_eq!(
            text(Status::resource_exhausted("at most 16 barriers"), barrier).unwrap(),
            "control plane: barrier finished: at most 16 barriers"
        );
        assert_eq!(
            text(Status::invalid_argument("rank 9 is out of range"), join).unwrap(),
            "control plane: recovery: join: rank 9 is out of range"
        );
        for transient in [Status::unavailable("connection refused"), Status::unknown("reset"), Status::cancelled("")] {
            assert!(from_status(&transient, join).is_none() && from_status(&transient, barrier).is_none());
        }
    }
}
