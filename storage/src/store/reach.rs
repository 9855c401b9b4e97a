//! Whether every member of a cluster reaches the same objects at a location: a node-local
//! directory on a multi-node cluster is not one location, and a sharded commit's parts must all
//! land where the coordinator's record points (docs/fault-tolerance.md, "Sharded commits").
//! Each member writes its own probe object, then reads every other member's.

use bytes::Bytes;
use object_store::{ObjectStoreExt, PutPayload};

use super::{CheckpointStore, StorageError};

/// The probe object of member `place` in the probe named `nonce`.
fn probe_name(nonce: &str, place: usize) -> String {
    format!(".trainerd-reach-{nonce}-{place}")
}

impl CheckpointStore {
    /// Writes member `place`'s object of the reach probe `nonce`, holding `token`.
    pub async fn write_reach_probe(&self, nonce: &str, place: usize, token: &[u8]) -> Result<(), StorageError> {
        let relative = probe_name(nonce, place);
        let (path, body) = (self.path(&relative), Bytes::copy_from_slice(token));
        self.retrying("writing", &relative, || async { self.store.put(&path, PutPayload::from(body.clone())).await })
            .await
            .map(|_| ())
    }

    /// What member `place`'s object of the reach probe `nonce` holds, as this member reads it.
    pub async fn read_reach_probe(&self, nonce: &str, place: usize) -> Result<Bytes, StorageError> {
        self.get(&probe_name(nonce, place)).await
    }

    /// Removes member `place`'s object of the reach probe `nonce` (best effort: a leftover is a
    /// few bytes that nothing reads).
    pub async fn remove_reach_probe(&self, nonce: &str, place: usize) {
        let relative = probe_name(nonce, place);
        let path = self.path(&relative);
        if let Err(e) = self.retrying("deleting", &relative, || async { self.store.delete(&path).await }).await {
            tracing::warn!("{e}");
        }
    }
}
