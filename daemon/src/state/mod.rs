//! A replica's state and the forms it takes: where training stands ([`position`], with its
//! running [`totals`]), the model's and the optimizer's tensors ([`replica`]), the same as bytes
//! for a peer (a state transfer) or as blobs for storage ([`host`] moves tensors to and from host
//! memory), and a checkpoint's metadata ([`meta`]: what must match to continue from it).
//!
//! It knows nothing of the cluster, the loop or storage's protocol: the training loop
//! (`train`) changes a state, the session (`train::session`) carries it to peers, the
//! checkpointer (`checkpoint`) hands it to storage.

pub mod host;
pub mod meta;
pub mod position;
pub mod replica;
pub mod totals;

pub use meta::{Meta, Reader, ACCUMULATE_KEY, PLUGIN_KEY, REPLICAS_KEY};
pub use position::Position;
pub use replica::{sha256_hex, ModelState, Named, Shareable, TrainState};
pub use totals::{epoch_figures, Totals};

/// Blob of the parameters and buffers.
pub const MODEL_BLOB: &str = "model.safetensors";
/// Blob of the optimizer state.
pub const OPTIMIZER_BLOB: &str = "optimizer.safetensors";
