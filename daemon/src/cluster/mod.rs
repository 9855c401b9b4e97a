//! Cluster membership: `TF_CONFIG` ([`tf_config`]), the membership decisions ([`membership`], a
//! pure function), the timeout hierarchy ([`timeouts`]), the gRPC control plane that carries
//! them out ([`control`], the server and coordinator; [`member`], a member's calls), and who may
//! talk to it ([`network`]: where to listen; [`auth`]: the cluster secret). It knows nothing of
//! training: a member's state is an opaque ordered progress and a digest.

pub mod auth;
pub mod control;
pub mod member;
pub mod membership;
pub mod network;
pub mod tf_config;
pub mod timeouts;

pub use member::{ClusterError, ControlPlane};
pub use network::Network;
pub use tf_config::{ClusterConfig, Member, TfConfigError};
pub use timeouts::Timeouts;
