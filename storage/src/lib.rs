//! Where trainerd's checkpoints live and how they are committed: atomically, verified, and
//! fenced, on a local directory or any S3-compatible service (through `object_store`).
//!
//! This crate is the mechanism; the daemon decides when to commit. [`location`] parses and opens
//! locations, [`protocol`] holds the commit protocol's pure decisions, [`store`] carries them out, [`parts`] puts sharded commits' blobs together,
//! [`tensors`] encodes tensors as safetensors, [`tls`] gives S3 clients their crypto provider.
//! Test servers and fault-injecting stores are the test kit's (`trainerd-testkit`), failpoints
//! their own crate's (`trainerd-failpoint`).

pub mod location;
pub mod parts;
pub mod protocol;
pub mod store;
pub mod tensors;
pub mod tls;

pub use location::{s3_store, Location, LocationError, OpenError, S3Options};
pub use store::types::transient;
pub use store::{
    Blob, BlobEntry, BlobRanges, CheckpointStore, CommitRecord, Manifest, Mode, NewCheckpoint, Part, Restored, Retry,
    Score, Slice, StorageError,
};
pub use tensors::{Dtype, TensorData};
