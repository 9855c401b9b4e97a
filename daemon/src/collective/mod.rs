//! Collectives among the workers of a run: the ring data plane ([`ring`]) and gradient
//! averaging over fused buckets ([`buckets`]).

pub mod buckets;
pub mod ring;

pub use ring::{CollectiveError, ReduceOp, Ring};
