//! Cluster membership: `TF_CONFIG` ([`tf_config`]), the membership decisions ([`membership`], a
//! pure function), electing a coordinator when the chief is lost for good ([`election`], pure
//! rules and the kept vote), the timeout hierarchy ([`timeouts`]), the gRPC control plane that
//! carries them out ([`control`], the coordinator; [`service`], the server every daemon runs;
//! [`member`], a member's calls; [`error`], what goes wrong, and the one reading of the
//! coordinator's answers), what a member found at a comparison of the replicas and told its peers
//! ([`finding`]), what members said of their parts of a sharded commit ([`parts`]), and where it
//! listens
//! ([`network`]; who may talk to it is `crate::auth`'s). It knows nothing of training, plugins or
//! storage: a member's state is an opaque ordered progress and a digest.

pub(crate) mod catchup;
pub(crate) mod control;
mod difference;
pub(crate) mod election;
pub(crate) mod error;
pub(crate) mod finding;
pub(crate) mod member;
pub(crate) mod membership;
pub(crate) mod network;
pub(crate) mod parts;
pub(crate) mod service;
pub(crate) mod tf_config;
pub(crate) mod timeouts;

pub(crate) use error::{BindError, ClusterError};
pub(crate) use member::ControlPlane;
pub(crate) use network::Network;
pub(crate) use tf_config::{ClusterConfig, Member};
pub(crate) use timeouts::Timeouts;
