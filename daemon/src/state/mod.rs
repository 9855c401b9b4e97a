//! A replica's state and the forms it takes: where training stands ([`position`], with its
//! running [`totals`]), the model's and the optimizer's tensors ([`replica`]), the same as bytes
//! for a peer (a state transfer) or as blobs for storage ([`host`] moves tensors to and from host
//! memory), a checkpoint's metadata ([`meta`]: what must match to continue from it), and one
//! step's outputs as a catch-up carries them to a returner ([`catch_up`]).
//!
//! It knows nothing of the cluster, the loop or storage's protocol: the training loop
//! (`train`) changes a state, the session (`train::session`) carries it to peers, the
//! checkpointer (`checkpoint`) hands it to storage.

pub(crate) mod catch_up;
pub(crate) mod host;
pub(crate) mod meta;
pub(crate) mod position;
pub(crate) mod replica;
pub(crate) mod totals;

pub(crate) use meta::{
    Meta, MetaError, Reader, ACCUMULATE_KEY, GPU_KEY, PLUGIN_KEY, REPLICAS_KEY, REPLICA_CHECK_KEY,
    SCHEDULE_VERSION_KEY, SHARD_KEY,
};
pub(crate) use position::Position;
pub(crate) use replica::{sha256_hex, ModelState, Optim, Shareable, TrainState};
pub(crate) use totals::{epoch_figures, Totals};

/// Blob of the parameters and buffers.
pub(crate) const MODEL_BLOB: &str = "model.safetensors";
/// Blob of the optimizer state.
pub(crate) const OPTIMIZER_BLOB: &str = "optimizer.safetensors";

/// Why a state could not be taken in (from a checkpoint or a peer) or given out.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StateError {
    /// A sharded optimizer's state, asked for whole before it was gathered.
    #[error("the optimizer state is sharded over the workers and was not gathered for this commit")]
    Sharded,
    /// A sharded run's optimizer state, asked for whole while it is still a commit's, unread.
    #[error("the optimizer state is checkpoint {sequence}'s, not read yet: each member reads its own ranges of it")]
    Unread {
        /// The commit.
        sequence: u64,
    },
    /// libtorch failed reading or writing a tensor.
    #[error("tensor {name}: {source}")]
    Tensor {
        /// The tensor.
        name: String,
        /// libtorch's error.
        source: tch::TchError,
    },
    /// A tensor of a type checkpoints and transfers do not carry.
    #[error("tensor {name}: unsupported kind {kind:?}")]
    Kind {
        /// The tensor.
        name: String,
        /// Its type.
        kind: tch::Kind,
    },
    /// The source lacks a tensor of the model.
    #[error("{what} has no tensor {name}")]
    Missing {
        /// The source ("checkpoint 3's model").
        what: String,
        /// The tensor.
        name: String,
    },
    /// A tensor of another shape than the model's.
    #[error("{what} tensor {name} has shape {found:?}, the model's has {expected:?}")]
    Shape {
        /// The source.
        what: String,
        /// The tensor.
        name: String,
        /// Its shape in the source.
        found: Vec<i64>,
        /// The model's.
        expected: Vec<i64>,
    },
    /// A tensor of another type than the model's.
    #[error("{what} tensor {name} is {found:?}, the model's is {expected:?}")]
    Type {
        /// The source.
        what: String,
        /// The tensor.
        name: String,
        /// Its type in the source.
        found: tch::Kind,
        /// The model's.
        expected: tch::Kind,
    },
    /// A commit without one of the blobs a state is made of.
    #[error("checkpoint {sequence} has no {blob}")]
    NoBlob {
        /// The commit.
        sequence: u64,
        /// The blob.
        blob: &'static str,
    },
    /// The optimizer's state does not fit the optimizer.
    #[error("{what}: {source}")]
    Optimizer {
        /// The source.
        what: String,
        /// What does not fit.
        source: crate::optim::optimizer::RestoreError,
    },
    /// Bytes received from a peer that are not a state.
    #[error("the state received is not valid: {0}")]
    Invalid(&'static str),
    /// A received state whose position cannot be read.
    #[error("the state received is not valid: {0}")]
    InvalidPosition(#[source] serde_json::Error),
    /// A received state whose tensors cannot be read.
    #[error("the state received is not valid: {0}")]
    InvalidTensors(#[source] trainerd_storage::tensors::TensorError),
    /// The position could not be encoded.
    #[error("encoding the position: {0}")]
    EncodePosition(#[source] serde_json::Error),
    /// The tensors could not be encoded.
    #[error("encoding the tensors: {0}")]
    EncodeTensors(#[source] trainerd_storage::tensors::TensorError),
}
