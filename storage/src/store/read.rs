//! Reading a location: its commit records, and the newest commit whose manifest and every blob
//! verify (falling back to older ones, saying why).

use std::collections::BTreeSet;

use bytes::Bytes;
use futures::TryStreamExt;
use sha2::{Digest, Sha256};

use super::{hex, CheckpointStore, CommitRecord, Restored, StorageError};
use crate::protocol::{self, COMMITS, DATA};
use crate::{parts, tensors};

impl CheckpointStore {
    /// Commit records present, sorted by sequence (unreadable ones are skipped with a warning).
    pub async fn list(&self) -> Result<Vec<CommitRecord>, StorageError> {
        let mut out = Vec::new();
        for (_, record) in self.records().await? {
            match record {
                Ok(r) => out.push(r),
                Err(e) => tracing::warn!("{e}"),
            }
        }
        Ok(out)
    }

    /// Every commit record present, by sequence, each as read: a record that cannot be read
    /// (damaged, or its read failing after retries) is there with its error.
    pub async fn records(&self) -> Result<Vec<(u64, Result<CommitRecord, StorageError>)>, StorageError> {
        let mut out = Vec::new();
        for seq in self.sequences().await? {
            out.push((seq, self.record(seq).await));
        }
        Ok(out)
    }

    pub(super) async fn sequences(&self) -> Result<BTreeSet<u64>, StorageError> {
        let prefix = self.path(COMMITS);
        let metas: Vec<_> = self
            .retrying("listing", COMMITS, || async { self.store.list(Some(&prefix)).try_collect::<Vec<_>>().await })
            .await?;
        Ok(metas.iter().filter_map(|m| m.location.filename().and_then(protocol::parse_commit_name)).collect())
    }

    pub(super) async fn record(&self, sequence: u64) -> Result<CommitRecord, StorageError> {
        let name = format!("{COMMITS}/{}", protocol::commit_name(sequence));
        let bytes = self.get(&name).await?;
        let record: CommitRecord = serde_json::from_slice(&bytes)
            .map_err(|e| self.damaged(sequence, format!("commit record {name} is not valid: {e}")))?;
        if record.sequence != sequence {
            return Err(self.damaged(sequence, format!("commit record {name} says sequence {}", record.sequence)));
        }
        Ok(record)
    }

    /// The newest generation any writer has written data with (0 if none names one): a new
    /// chief takes a generation above it, so that the data of every earlier writer, committed
    /// or not, is fenced and collectable.
    pub async fn newest_data_generation(&self) -> Result<u64, StorageError> {
        let objects = self.data_objects().await?;
        Ok(objects.iter().filter_map(|(id, _)| protocol::data_owner(id).map(|(g, _)| g)).max().unwrap_or(0))
    }

    /// Every object under the data prefix, with the data id it belongs to. Ids are found from
    /// the objects themselves: a backend may keep empty "directories".
    pub(super) async fn data_objects(&self) -> Result<Vec<(String, object_store::ObjectMeta)>, StorageError> {
        let data = self.path(DATA);
        let objects = self
            .retrying("listing", DATA, || async { self.store.list(Some(&data)).try_collect::<Vec<_>>().await })
            .await?;
        Ok(objects
            .into_iter()
            .filter_map(|o| {
                let relative = self.relative(&o.location);
                let id = relative.strip_prefix(&format!("{DATA}/"))?.split('/').next()?.to_string();
                Some((id, o))
            })
            .collect())
    }

    /// The newest commit record, if any (unverified: for the generation fencing starts above).
    pub async fn latest_record(&self) -> Result<Option<CommitRecord>, StorageError> {
        match self.sequences().await?.last() {
            Some(&sequence) => Ok(Some(self.record(sequence).await?)),
            None => Ok(None),
        }
    }

    /// Reads an object of commit `sequence` and checks it against the `(sha256, size)` that
    /// `expected_by` recorded; a failure makes the commit damaged, described as `label`, but for
    /// a storage that did not answer (after its retries): that says nothing of the commit, and a
    /// reader must not fall back past it to an older one.
    pub(super) async fn get_verified(
        &self,
        sequence: u64,
        label: &str,
        relative: &str,
        (sha256, size): (&str, u64),
        expected_by: &str,
    ) -> Result<Bytes, StorageError> {
        let bytes =
            self.get(relative)
                .await
                .map_err(|e| if e.unanswered() { e } else { self.damaged(sequence, e.to_string()) })?;
        let found = hex(&Sha256::digest(&bytes));
        if found != sha256 || bytes.len() as u64 != size {
            return Err(self.damaged(
                sequence,
                format!(
                    "{label}: sha256 {found} ({} bytes), {expected_by} expects {sha256} ({size} bytes)",
                    bytes.len()
                ),
            ));
        }
        Ok(bytes)
    }

    /// Loads commit `sequence` and verifies its manifest and every blob.
    pub async fn load(&self, sequence: u64) -> Result<Restored, StorageError> {
        self.load_streaming(sequence, &[]).await
    }

    /// [`CheckpointStore::load`], but the blobs named in `streamed` are only verified, a chunk at
    /// a time as they arrive, and left out of the result: their tensors are read later by range
    /// ([`CheckpointStore::blob_ranges`]), so that no reader holds the whole of them.
    pub async fn load_streaming(&self, sequence: u64, streamed: &[&str]) -> Result<Restored, StorageError> {
        let (record, manifest) = self.manifest(sequence).await?;
        let mut entries = Vec::with_capacity(manifest.blobs.len());
        for entry in &manifest.blobs {
            let label = format!("blob {} ({})", entry.name, entry.path);
            let sums = (entry.sha256.as_str(), entry.size);
            if streamed.contains(&entry.name.as_str()) {
                self.verify_streaming(sequence, &label, &entry.path, sums).await?;
                continue;
            }
            let bytes = self.get_verified(sequence, &label, &entry.path, sums, "the manifest").await?;
            let tensors =
                tensors::decode(&bytes).map_err(|e| self.damaged(sequence, format!("blob {}: {e}", entry.name)))?;
            entries.push((entry, tensors));
        }
        // A sharded commit's blobs come in parts, put together here (whole ones as they are).
        let blobs = parts::assemble(entries).map_err(|why| self.damaged(sequence, why))?;
        Ok(Restored { record, manifest, blobs, fallbacks: Vec::new() })
    }

    /// The newest commit that verifies, falling back past damaged ones (each reported in
    /// `fallbacks` and the log). `Ok(None)` when nothing was ever committed.
    pub async fn latest(&self) -> Result<Option<Restored>, StorageError> {
        self.latest_streaming(&[]).await
    }

    /// [`CheckpointStore::latest`], each commit read as [`CheckpointStore::load_streaming`] reads
    /// it: the blobs named in `streamed` verified and left out.
    pub async fn latest_streaming(&self, streamed: &[&str]) -> Result<Option<Restored>, StorageError> {
        let sequences = self.sequences().await?;
        let mut fallbacks = Vec::new();
        for &seq in sequences.iter().rev() {
            match self.load_streaming(seq, streamed).await {
                Ok(mut restored) => {
                    restored.fallbacks = fallbacks;
                    return Ok(Some(restored));
                }
                Err(e @ StorageError::Damaged { .. }) => {
                    tracing::warn!("{e}; falling back to the previous commit");
                    fallbacks.push(e.to_string());
                }
                Err(e) => return Err(e),
            }
        }
        if sequences.is_empty() {
            Ok(None)
        } else {
            Err(StorageError::NoCommit {
                location: self.name.clone(),
                detail: format!(" that verifies: {}", fallbacks.join("; ")),
            })
        }
    }
}
