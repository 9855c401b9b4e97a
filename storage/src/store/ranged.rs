//! A commit read in part, so that no reader holds all of it (docs/fault-tolerance.md, "A sharded
//! run's resume"): its blobs but those named to be streamed (each verified by hashing its bytes as
//! they arrive, none kept), and one blob's tensors read by element range, from the blob whole or
//! from its parts, as each member of a sharded run reads only its own ranges.

use std::collections::BTreeMap;
use std::ops::Range;

use futures::TryStreamExt;
use object_store::ObjectStoreExt;
use sha2::{Digest, Sha256};

use super::{hex, BlobEntry, CheckpointStore, Manifest, StorageError};
use crate::tensors::Dtype;

/// Where some of a tensor's elements lie: the object, the byte at which they start in it, and
/// which of the tensor's elements (flattened) they are.
#[derive(Clone, Debug)]
struct Stored {
    path: String,
    start: u64,
    first: usize,
    len: usize,
}

/// One tensor of a blob: its type, shape, and where its elements lie.
#[derive(Clone, Debug)]
struct Located {
    dtype: Dtype,
    shape: Vec<usize>,
    stored: Vec<Stored>,
}

/// A blob of a commit whose tensors are read by element range ([`CheckpointStore::blob_ranges`]):
/// only each object's safetensors header has been read.
#[derive(Clone, Debug)]
pub struct BlobRanges {
    store: CheckpointStore,
    sequence: u64,
    blob: String,
    tensors: BTreeMap<String, Located>,
}

/// One ranged read of an object: its bytes, and where they go (which asked range, which of its
/// bytes).
type Read = (Range<u64>, usize, usize);

/// A safetensors header's entry for one tensor.
#[derive(serde::Deserialize)]
struct HeaderEntry {
    dtype: Dtype,
    shape: Vec<usize>,
    data_offsets: (u64, u64),
}

impl CheckpointStore {
    /// Reads an object of commit `sequence` as a stream, hashing each chunk as it arrives and
    /// keeping none, and checks it against the `(sha256, size)` the manifest recorded; a failure
    /// makes the commit damaged, described as `label` (but for a storage that did not answer).
    pub(super) async fn verify_streaming(
        &self,
        sequence: u64,
        label: &str,
        relative: &str,
        (sha256, size): (&str, u64),
    ) -> Result<(), StorageError> {
        let path = self.path(relative);
        let (found, len) = self
            .retrying("reading", relative, || async {
                let mut stream = self.store.get(&path).await?.into_stream();
                let (mut hasher, mut len) = (Sha256::new(), 0u64);
                while let Some(chunk) = stream.try_next().await? {
                    hasher.update(&chunk);
                    len += chunk.len() as u64;
                }
                Ok((hex(&hasher.finalize()), len))
            })
            .await
            .map_err(|e| if e.unanswered() { e } else { self.damaged(sequence, e.to_string()) })?;
        if found != sha256 || len != size {
            return Err(self.damaged(
                sequence,
                format!("{label}: sha256 {found} ({len} bytes), the manifest expects {sha256} ({size} bytes)"),
            ));
        }
        Ok(())
    }

    /// Commit `sequence`'s manifest, verified against its record.
    pub(super) async fn manifest(&self, sequence: u64) -> Result<(super::CommitRecord, Manifest), StorageError> {
        let record = self.record(sequence).await?;
        let label = format!("manifest {}", record.manifest);
        let sums = (record.manifest_sha256.as_str(), record.manifest_size);
        let bytes = self.get_verified(sequence, &label, &record.manifest, sums, "the commit record").await?;
        let manifest: Manifest = serde_json::from_slice(&bytes)
            .map_err(|e| self.damaged(sequence, format!("manifest {} is not valid: {e}", record.manifest)))?;
        Ok((record, manifest))
    }

    /// Blob `blob` of commit `sequence`, whose manifest's sha256 is `manifest_sha256`, its tensors
    /// to be read by element range: the manifest is read and verified, and of each object the blob
    /// is stored in, its safetensors header alone. The objects' bytes are not verified here (a
    /// reader of the whole commit verified them: [`CheckpointStore::latest_streaming`]). Another
    /// commit of that sequence (another location's) is refused, naming both digests.
    pub async fn blob_ranges(
        &self,
        (sequence, manifest_sha256): (u64, &str),
        blob: &str,
    ) -> Result<BlobRanges, StorageError> {
        let (record, manifest) = self.manifest(sequence).await?;
        if record.manifest_sha256 != manifest_sha256 {
            let why = format!(
                "its manifest's sha256 is {}, the one asked for is {manifest_sha256}: another commit",
                record.manifest_sha256
            );
            return Err(self.damaged(sequence, why));
        }
        let entries: Vec<&BlobEntry> = manifest.blobs.iter().filter(|e| e.name == blob).collect();
        if entries.is_empty() {
            return Err(self.damaged(sequence, format!("its manifest lists no blob {blob}")));
        }
        let mut tensors: BTreeMap<String, Located> = BTreeMap::new();
        for entry in entries {
            let header = self.header(sequence, entry).await?;
            let at = |stored: &str| {
                header.get(stored).ok_or_else(|| {
                    self.damaged(sequence, format!("blob {blob}: {} holds no tensor {stored}", entry.path))
                })
            };
            let Some(slices) = &entry.slices else {
                for (name, (dtype, shape, start)) in &header {
                    let len = shape.iter().product();
                    let stored = vec![Stored { path: entry.path.clone(), start: *start, first: 0, len }];
                    tensors.insert(name.clone(), Located { dtype: *dtype, shape: shape.clone(), stored });
                }
                continue;
            };
            for slice in slices {
                let (dtype, shape, start) = at(&slice.stored)?;
                let located = tensors.entry(slice.tensor.clone()).or_insert_with(|| Located {
                    dtype: *dtype,
                    shape: slice.shape.clone(),
                    stored: Vec::new(),
                });
                let (path, len) = (entry.path.clone(), shape.iter().product());
                located.stored.push(Stored { path, start: *start, first: slice.offset, len });
            }
        }
        Ok(BlobRanges { store: self.clone(), sequence, blob: blob.to_string(), tensors })
    }

    /// The safetensors header of `entry`'s object: each tensor's type, shape and the byte at
    /// which its data starts in the object.
    async fn header(
        &self,
        sequence: u64,
        entry: &BlobEntry,
    ) -> Result<BTreeMap<String, (Dtype, Vec<usize>, u64)>, StorageError> {
        let path = self.path(&entry.path);
        let damaged = |why: String| self.damaged(sequence, format!("blob {} ({}): {why}", entry.name, entry.path));
        if entry.size < 8 {
            return Err(damaged(format!("{} bytes, too few for a safetensors header", entry.size)));
        }
        let len = self.retrying("reading", &entry.path, || self.store.get_range(&path, 0..8)).await?;
        let n = u64::from_le_bytes(len[..].try_into().map_err(|_| damaged("a short read".into()))?);
        if 8 + n > entry.size {
            return Err(damaged(format!("a header of {n} bytes in an object of {}", entry.size)));
        }
        let json = self.retrying("reading", &entry.path, || self.store.get_range(&path, 8..8 + n)).await?;
        let mut entries: BTreeMap<String, serde_json::Value> =
            serde_json::from_slice(&json).map_err(|e| damaged(format!("its header is not valid: {e}")))?;
        entries.remove("__metadata__");
        let mut out = BTreeMap::new();
        for (name, value) in entries {
            let h: HeaderEntry =
                serde_json::from_value(value).map_err(|e| damaged(format!("tensor {name}'s header: {e}")))?;
            let bytes = h.shape.iter().product::<usize>() as u64 * h.dtype.size() as u64;
            let (from, to) = h.data_offsets;
            if from > to || to - from != bytes || 8 + n + to > entry.size {
                return Err(damaged(format!("tensor {name}'s offsets {:?} do not fit", h.data_offsets)));
            }
            out.insert(name, (h.dtype, h.shape, 8 + n + h.data_offsets.0));
        }
        Ok(out)
    }
}

impl BlobRanges {
    /// The blob's tensors' names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Tensor `name`'s type and shape, if the blob holds it.
    pub fn tensor(&self, name: &str) -> Option<(Dtype, &[usize])> {
        self.tensors.get(name).map(|t| (t.dtype, t.shape.as_slice()))
    }

    /// The bytes of each of `wants` (a tensor and a range of its elements, flattened), read with
    /// one request per object for all the ranges it holds. Damaged (naming the blob, the tensor
    /// and the elements) when the blob lacks a tensor or an element.
    pub async fn read(&self, wants: &[(&str, Range<usize>)]) -> Result<Vec<Vec<u8>>, StorageError> {
        let mut plan: BTreeMap<&str, Vec<Read>> = BTreeMap::new();
        let mut out = Vec::with_capacity(wants.len());
        for (w, (name, elements)) in wants.iter().enumerate() {
            let damaged = |why: &str| {
                let blob = &self.blob;
                self.store.damaged(self.sequence, format!("blob {blob}: tensor {name}, elements {elements:?}: {why}"))
            };
            let t = self.tensors.get(*name).ok_or_else(|| damaged("not in the blob"))?;
            let size = t.dtype.size();
            let mut covered = 0;
            for s in &t.stored {
                let (from, to) = (elements.start.max(s.first), elements.end.min(s.first + s.len));
                if from >= to {
                    continue;
                }
                covered += to - from;
                let byte = |e: usize| s.start + ((e - s.first) * size) as u64;
                plan.entry(s.path.as_str()).or_default().push((
                    byte(from)..byte(to),
                    w,
                    (from - elements.start) * size,
                ));
            }
            if covered != elements.len() {
                return Err(damaged(&format!("{covered} of them stored")));
            }
            out.push(vec![0u8; elements.len() * size]);
        }
        for (relative, pieces) in plan {
            let path = self.store.path(relative);
            let ranges: Vec<Range<u64>> = pieces.iter().map(|(r, _, _)| r.clone()).collect();
            let read = self.store.retrying("reading", relative, || self.store.store.get_ranges(&path, &ranges)).await?;
            for ((range, w, at), bytes) in pieces.into_iter().zip(read) {
                if bytes.len() as u64 != range.end - range.start {
                    let why = format!("{} bytes read of {}", bytes.len(), range.end - range.start);
                    return Err(self.store.damaged(self.sequence, format!("blob {} ({relative}): {why}", self.blob)));
                }
                out[w][at..at + bytes.len()].copy_from_slice(&bytes);
            }
        }
        Ok(out)
    }
}
