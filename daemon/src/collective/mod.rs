//! Collectives among the workers of a run: the abortable ring data plane ([`ring`]) on a
//! persistent listener ([`listener`]), its abort switch ([`abort`]), and gradient averaging
//! over fused buckets ([`buckets`]). It knows nothing of training or plugins.

pub mod abort;
pub mod buckets;
pub mod listener;
pub mod ring;

pub use abort::AbortSignal;
pub use listener::DataListener;
pub use ring::{CollectiveError, ReduceOp, Ring};
