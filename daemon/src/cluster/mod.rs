//! Cluster membership: `TF_CONFIG` ([`tf_config`]), the membership decisions ([`membership`], a
//! pure function), electing a coordinator when the chief is lost for good ([`election`], pure
//! rules and the kept vote), the timeout hierarchy ([`timeouts`]), the gRPC control plane that
//! carries them out ([`control`], the coordinator; [`service`], the server every daemon runs;
//! [`member`], a member's calls; [`error`], what goes wrong, and the one reading of the
//! coordinator's answers), and where it listens
//! ([`network`]; who may talk to it is `crate::auth`'s). It knows nothing of training, plugins or
//! storage: a member's state is an opaque ordered progress and a digest.

pub mod control;
pub mod election;
pub mod error;
pub mod member;
pub mod membership;
pub mod network;
pub mod service;
pub mod tf_config;
pub mod timeouts;

pub use error::{BindError, ClusterError, DialError, ResolveError, VoteError};
pub use member::ControlPlane;
pub use network::Network;
pub use tf_config::{ClusterConfig, Member, TfConfigError};
pub use timeouts::{TimeoutError, Timeouts};
