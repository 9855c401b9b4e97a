//! Cluster membership: `TF_CONFIG` ([`tf_config`]) and the gRPC control plane ([`control`]):
//! rendezvous, barriers, heartbeats and generations.

pub mod control;
pub mod tf_config;

pub use tf_config::{ClusterConfig, Member, TfConfigError};
