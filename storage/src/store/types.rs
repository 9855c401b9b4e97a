//! What a checkpoint location holds and says: the blobs of a checkpoint to commit, its manifest,
//! the commit record that makes it visible, a verified checkpoint read back, the errors, and how
//! hard transient errors are retried.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::protocol::{Fenced, DATA, MANIFEST};
pub use crate::protocol::{Mode, Score};
use crate::tensors::{TensorData, TensorError};

/// Blobs at least this large go up as multipart uploads, in parts of this size (measured: 32 MiB
/// parts commit ~10% faster to local disk than 8 MiB; S3 needs at least 5 MiB).
pub const PART_BYTES: usize = 32 << 20;
/// Manifest format tag.
pub const FORMAT: &str = "trainerd-checkpoint/1";

/// A storage failure.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The backend failed (after retries, for transient errors).
    #[error("{location}: {op} {path}: {source}")]
    Backend {
        /// The checkpoint location.
        location: String,
        /// What was being done.
        op: &'static str,
        /// The object.
        path: String,
        /// The backend's error.
        source: Box<object_store::Error>,
    },
    /// A writer of an older generation.
    #[error("{location}: {source}")]
    Fenced {
        /// The checkpoint location.
        location: String,
        /// Details.
        source: Fenced,
    },
    /// Another writer created the same sequence first.
    #[error("{location}: commit {sequence} was created by another writer first; this commit is abandoned")]
    LostRace {
        /// The checkpoint location.
        location: String,
        /// The sequence.
        sequence: u64,
    },
    /// A commit that does not verify.
    #[error("{location}: commit {sequence}: {what}")]
    Damaged {
        /// The checkpoint location.
        location: String,
        /// The sequence.
        sequence: u64,
        /// What is wrong.
        what: String,
    },
    /// A server that does not refuse a second create-if-absent write of one object.
    #[error(
        "{location}: {endpoint} does not honour create-if-absent writes: a second create of {probe} succeeded, \
         where it must be refused (If-None-Match: *, HTTP 412 Precondition Failed); two chiefs could then \
         overwrite each other's commits, so none is made there (use a server with conditional writes, or \
         --s3-skip-probe at your own risk)"
    )]
    NoConditionalWrites {
        /// The checkpoint location.
        location: String,
        /// The server.
        endpoint: String,
        /// The probe object.
        probe: String,
    },
    /// Nothing committed (or nothing that verifies).
    #[error("{location}: no committed checkpoint{detail}")]
    NoCommit {
        /// The checkpoint location.
        location: String,
        /// Why the commits present were rejected, if any.
        detail: String,
    },
    /// Bad tensor data.
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

/// One safetensors blob of a checkpoint.
#[derive(Clone, Debug)]
pub struct Blob {
    /// File name, e.g. `model.safetensors`.
    pub name: String,
    /// Its tensors.
    pub tensors: Vec<TensorData>,
}

/// A checkpoint to commit.
#[derive(Clone, Debug)]
pub struct NewCheckpoint {
    /// The writer's generation (fencing).
    pub generation: u64,
    /// The writer (a process) within its generation (fencing).
    pub writer: u64,
    /// Global step it was taken at.
    pub global_step: u64,
    /// Epoch it was taken in.
    pub epoch: u64,
    /// Everything else needed to continue (position, configuration), as JSON.
    pub meta: serde_json::Value,
    /// The tensors.
    pub blobs: Vec<Blob>,
    /// An epoch-end commit's score, by which retention keeps the best commit.
    pub score: Option<Score>,
}

/// A blob as the manifest lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobEntry {
    /// File name.
    pub name: String,
    /// Object path relative to the location.
    pub path: String,
    /// Bytes.
    pub size: u64,
    /// Hex sha256.
    pub sha256: String,
    /// A part of the blob `name`, written by one member of a sharded commit: what it holds of the
    /// blob's tensors, possibly nothing (none: the whole blob).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slices: Option<Vec<Slice>>,
}

/// What a part of a sharded blob holds of one of the blob's tensors: the elements
/// `[offset, offset + len)` of tensor `tensor` (of shape `shape`) flattened, stored in the part as
/// the one-dimensional tensor `stored` of `len` elements.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slice {
    /// The part's tensor.
    pub stored: String,
    /// The blob's tensor it is a slice of.
    pub tensor: String,
    /// That tensor's shape.
    pub shape: Vec<usize>,
    /// Where the slice starts among its elements.
    pub offset: usize,
}

/// A part of a sharded commit's blob, which any member writes under the commit's data id
/// ([`crate::CheckpointStore::write_part`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Part {
    /// The blob it is a part of, e.g. `optimizer.safetensors`.
    pub blob: String,
    /// Its file name under the data id, unique in the commit, e.g. `optimizer.part-2.safetensors`.
    pub file: String,
    /// Its tensors, each one-dimensional.
    pub tensors: Vec<TensorData>,
    /// What each of them is a slice of.
    pub slices: Vec<Slice>,
}

/// A checkpoint's manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: String,
    /// Writer's generation.
    pub generation: u64,
    /// Global step.
    pub global_step: u64,
    /// Epoch.
    pub epoch: u64,
    /// When the snapshot was taken (ms since the Unix epoch).
    pub created_unix_ms: u64,
    /// The writer's metadata.
    pub meta: serde_json::Value,
    /// The blobs.
    pub blobs: Vec<BlobEntry>,
}

/// A commit record: what makes a checkpoint visible.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CommitRecord {
    /// Sequence (1, 2, ...).
    pub sequence: u64,
    /// Writer's generation.
    pub generation: u64,
    /// The writer within its generation (0 in records of trainerd before writers had ids).
    #[serde(default)]
    pub writer: u64,
    /// Manifest path relative to the location.
    pub manifest: String,
    /// Hex sha256 of the manifest.
    pub manifest_sha256: String,
    /// Manifest bytes.
    pub manifest_size: u64,
    /// Global step.
    pub global_step: u64,
    /// Epoch.
    pub epoch: u64,
    /// Total bytes of the blobs.
    pub bytes: u64,
    /// Commit time (ms since the Unix epoch).
    pub created_unix_ms: u64,
    /// An epoch-end commit's score (docs/best-checkpoint.md); none in records before scores, and
    /// in commits within an epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score: Option<Score>,
}

impl CommitRecord {
    /// The data id (the unique prefix of its blobs).
    pub fn data_id(&self) -> Option<&str> {
        self.manifest.strip_prefix(&format!("{DATA}/"))?.strip_suffix(&format!("/{MANIFEST}"))
    }
}

/// A verified checkpoint.
#[derive(Clone, Debug)]
pub struct Restored {
    /// Its commit record.
    pub record: CommitRecord,
    /// Its manifest.
    pub manifest: Manifest,
    /// Tensors of each blob, by blob name.
    pub blobs: BTreeMap<String, Vec<TensorData>>,
    /// Newer commits that were passed over, and why.
    pub fallbacks: Vec<String>,
}

/// How hard to retry transient errors.
#[derive(Clone, Copy, Debug)]
pub struct Retry {
    /// Attempts in all (1 = no retry).
    pub attempts: u32,
    /// First back-off; doubles each time.
    pub base: Duration,
    /// Longest back-off.
    pub max: Duration,
}

impl Default for Retry {
    fn default() -> Retry {
        // About 23 s in all; once the backend answers again a retry comes within 2 s.
        Retry { attempts: 15, base: Duration::from_millis(200), max: Duration::from_secs(2) }
    }
}

impl StorageError {
    /// Whether the storage did not answer (its retries spent on errors another try may cure):
    /// nothing was learnt of the commits there.
    pub fn unanswered(&self) -> bool {
        matches!(self, StorageError::Backend { source, .. } if transient(source))
    }
}

/// Errors that another try may cure (a server down, 5xx, a timeout). Everything definite (not
/// found, already exists, a precondition, an unsupported operation, a bad path) is not.
pub fn transient(e: &object_store::Error) -> bool {
    matches!(e, object_store::Error::Generic { .. } | object_store::Error::JoinError { .. })
}
