//! Cluster membership, in two sides that talk over one wire. The coordinator's side
//! ([`coordinator`]): the [`coordinator::Coordinator`] that stores what members say and carries
//! out its pure rules ([`coordinator::rules`]). A member's side ([`member`]): the
//! [`ControlPlane`], the calls a member's training thread makes, its heartbeat, and watching for
//! a lost coordinator. Between them: what crosses the wire ([`wire`]), the server every daemon
//! runs ([`service`]), and what goes wrong and the one reading of the coordinator's answers
//! ([`error`]). Beside them: `TF_CONFIG` ([`tf_config`]), the timeout hierarchy ([`timeouts`]),
//! electing a coordinator when the chief is lost for good ([`election`], pure rules and the kept
//! vote), a returner's catch-up stream ([`catch_up`]), what a member found at a comparison of the
//! replicas and told its peers ([`finding`]), what members said of their parts of a sharded
//! commit ([`parts`]), and where it listens ([`network`]; who may talk to it is `crate::auth`'s).
//! It knows nothing of training, plugins or storage: a member's state is an opaque ordered
//! progress and a digest.

pub(crate) mod catch_up;
pub(crate) mod coordinator;
mod difference;
pub(crate) mod election;
pub(crate) mod error;
pub(crate) mod finding;
pub(crate) mod member;
pub(crate) mod network;
pub(crate) mod parts;
pub(crate) mod service;
pub(crate) mod tf_config;
pub(crate) mod timeouts;
pub(crate) mod wire;

pub(crate) use error::{BindError, ClusterError};
pub(crate) use member::ControlPlane;
pub(crate) use network::Network;
pub(crate) use tf_config::{ClusterConfig, Member};
pub(crate) use timeouts::Timeouts;
