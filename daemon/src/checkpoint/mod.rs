//! Checkpoints as the daemon sees them: the coordinator's background commits ([`checkpointer`])
//! and what `trainerd ckpt` shows of a location ([`inspect`]).

pub(crate) mod checkpointer;
pub(crate) mod inspect;

pub(crate) use checkpointer::{Checkpointer, Finished};

/// What went wrong with checkpoints, besides storage's own failures (which [`StorageError`]
/// names: the location, the operation, the object).
#[derive(Debug, thiserror::Error)]
pub(crate) enum CheckpointError {
    /// Storage failed.
    #[error(transparent)]
    Storage(#[from] trainerd_storage::StorageError),
    /// The checkpointer's storage runtime could not start.
    #[error("the storage runtime could not start: {0}")]
    Runtime(#[source] std::io::Error),
    /// A commit's metadata could not be encoded.
    #[error("the commit's metadata could not be encoded: {0}")]
    Meta(#[source] serde_json::Error),
    /// The thread that commits in the background could not start.
    #[error("the commit thread could not start: {0}")]
    Thread(#[source] std::io::Error),
    /// No commit of the location is scored, so none is the best.
    #[error(
        "{location}: no commit has a score to be best by (train with --keep-best METRIC to score each epoch's commit)"
    )]
    NoBest {
        /// The location.
        location: String,
    },
    /// A commit without the model's blob.
    #[error("commit {sequence} has no {blob}")]
    NoBlob {
        /// The commit.
        sequence: u64,
        /// The blob.
        blob: &'static str,
    },
    /// A commit whose export names a variable it does not hold.
    #[error("commit {sequence} has no variable {name}, which its export names")]
    NoTensor {
        /// The commit.
        sequence: u64,
        /// The variable.
        name: String,
    },
    /// A commit's tensors could not be written as safetensors.
    #[error("{0}")]
    Encode(#[source] trainerd_storage::tensors::TensorError),
    /// The exported file could not be written.
    #[error("writing {}: {source}", path.display())]
    Write {
        /// The file.
        path: std::path::PathBuf,
        /// What failed.
        source: std::io::Error,
    },
}
