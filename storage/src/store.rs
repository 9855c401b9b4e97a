//! Committing and restoring checkpoints over any `object_store` backend, following
//! [`crate::protocol`]: blobs, then manifest, then a create-if-absent commit record. Readers take
//! the newest commit whose manifest and every blob verify, and fall back to older ones, saying
//! why.
//!
//! Transient storage errors (a server down, 5xx, timeouts) are retried with backoff; nothing a
//! failed or interrupted commit leaves behind can be mistaken for a commit, and its blobs are
//! collected later.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::protocol::{self, Fenced, COMMITS, DATA, MANIFEST};
use crate::tensors::{self, TensorData, TensorError};

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
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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

/// Errors that another try may cure. Everything definite (not found, already exists, a
/// precondition, an unsupported operation, a bad path) is not.
fn transient(e: &object_store::Error) -> bool {
    matches!(e, object_store::Error::Generic { .. } | object_store::Error::JoinError { .. })
}

/// A checkpoint location opened on a backend.
#[derive(Clone, Debug)]
pub struct CheckpointStore {
    store: Arc<dyn ObjectStore>,
    root: Path,
    name: String,
    retry: Retry,
    grace: Duration,
    /// Transient failures seen so far (shared by clones).
    failures: Arc<std::sync::atomic::AtomicU64>,
}

/// How long data that no record names, and that may be another writer's commit in flight, is
/// spared by collection (see [`crate::protocol`]).
pub const COLLECT_GRACE: Duration = Duration::from_secs(24 * 3600);

impl CheckpointStore {
    /// A store over `store`, under `root`, called `name` in messages.
    pub fn new(store: Arc<dyn ObjectStore>, root: Path, name: impl Into<String>) -> CheckpointStore {
        CheckpointStore {
            store,
            root,
            name: name.into(),
            retry: Retry::default(),
            grace: COLLECT_GRACE,
            failures: Arc::default(),
        }
    }

    /// The same store with another grace period for data that may be in flight.
    pub fn with_collect_grace(mut self, grace: Duration) -> CheckpointStore {
        self.grace = grace;
        self
    }

    /// The same store with another retry policy.
    pub fn with_retry(mut self, retry: Retry) -> CheckpointStore {
        self.retry = retry;
        self
    }

    /// Transient storage failures this store (and its clones) met so far, retried or not: a
    /// count that moves while a commit is in flight says the storage is failing, not slow.
    pub fn transient_failures(&self) -> u64 {
        self.failures.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The location's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The backend and the root under which this location lives (for tools and tests that
    /// look at the objects themselves).
    pub fn raw(&self) -> (Arc<dyn ObjectStore>, Path) {
        (Arc::clone(&self.store), self.root.clone())
    }

    fn path(&self, relative: &str) -> Path {
        relative.split('/').fold(self.root.clone(), |p, part| p.join(part))
    }

    fn relative(&self, path: &Path) -> String {
        let root = self.root.as_ref();
        let full = path.as_ref();
        if root.is_empty() {
            full.to_string()
        } else {
            full.strip_prefix(root).map(|s| s.trim_start_matches('/').to_string()).unwrap_or_else(|| full.to_string())
        }
    }

    fn backend(&self, op: &'static str, path: &str, source: object_store::Error) -> StorageError {
        StorageError::Backend { location: self.name.clone(), op, path: path.to_string(), source: Box::new(source) }
    }

    fn damaged(&self, sequence: u64, what: String) -> StorageError {
        StorageError::Damaged { location: self.name.clone(), sequence, what }
    }

    /// Runs `f` until it succeeds, fails definitely, or the attempts run out.
    async fn retrying<T, F, Fut>(&self, op: &'static str, path: &str, mut f: F) -> Result<T, StorageError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = object_store::Result<T>>,
    {
        let mut delay = self.retry.base;
        for attempt in 1..=self.retry.attempts.max(1) {
            let result = f().await;
            if result.as_ref().is_err_and(transient) {
                self.failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            match result {
                Ok(v) => return Ok(v),
                Err(e) if transient(&e) && attempt < self.retry.attempts => {
                    tracing::warn!("{}: {op} {path} failed ({e}); retrying in {delay:?}", self.name);
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(self.retry.max);
                }
                Err(e) => return Err(self.backend(op, path, e)),
            }
        }
        unreachable!("the last attempt returns")
    }

    async fn get(&self, relative: &str) -> Result<Bytes, StorageError> {
        let path = self.path(relative);
        self.retrying("reading", relative, || async { self.store.get(&path).await?.bytes().await }).await
    }

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

    async fn sequences(&self) -> Result<BTreeSet<u64>, StorageError> {
        let prefix = self.path(COMMITS);
        let metas: Vec<_> = self
            .retrying("listing", COMMITS, || async { self.store.list(Some(&prefix)).try_collect::<Vec<_>>().await })
            .await?;
        Ok(metas.iter().filter_map(|m| m.location.filename().and_then(protocol::parse_commit_name)).collect())
    }

    async fn record(&self, sequence: u64) -> Result<CommitRecord, StorageError> {
        let name = format!("{COMMITS}/{}", protocol::commit_name(sequence));
        let bytes = self.get(&name).await?;
        let record: CommitRecord = serde_json::from_slice(&bytes)
            .map_err(|e| self.damaged(sequence, format!("commit record {name} is not valid: {e}")))?;
        if record.sequence != sequence {
            return Err(self.damaged(sequence, format!("commit record {name} says sequence {}", record.sequence)));
        }
        Ok(record)
    }

    /// Proves that the backend refuses a second create-if-absent write of one object, which
    /// commits rely on: writes a probe object twice (the second must fail with "already
    /// exists"), then removes it. `endpoint` names the server in the error.
    pub async fn probe_create_if_absent(&self, endpoint: &str) -> Result<(), StorageError> {
        let relative = format!(".trainerd-probe-{}", uuid::Uuid::new_v4());
        let path = self.path(&relative);
        let create = || async {
            let opts = PutOptions { mode: PutMode::Create, ..Default::default() };
            self.store.put_opts(&path, PutPayload::from_static(b"trainerd create-if-absent probe"), opts).await
        };
        self.retrying("creating", &relative, create).await?;
        let second = self.retrying("creating", &relative, create).await;
        let _ = self.retrying("deleting", &relative, || async { self.store.delete(&path).await }).await;
        match second {
            Err(StorageError::Backend { source, .. })
                if matches!(*source, object_store::Error::AlreadyExists { .. }) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
            Ok(_) => Err(StorageError::NoConditionalWrites {
                location: self.name.clone(),
                endpoint: endpoint.to_string(),
                probe: relative,
            }),
        }
    }

    /// Commits `checkpoint` as the next sequence, then keeps only the newest `keep` commits (0:
    /// all) and collects the blobs of commits that never completed.
    pub async fn commit(&self, checkpoint: &NewCheckpoint, keep: usize) -> Result<CommitRecord, StorageError> {
        let sequence = self.next_sequence(checkpoint.generation, checkpoint.writer).await?;
        self.commit_sequence(sequence, checkpoint, keep).await
    }

    /// The sequence writer `writer` of `generation` commits next, or why it may not. A newest
    /// record that cannot be read refuses the commit: its generation is unknown, so nothing
    /// could be fenced against it.
    pub async fn next_sequence(&self, generation: u64, writer: u64) -> Result<u64, StorageError> {
        let sequences = self.sequences().await?;
        let latest = match sequences.last() {
            Some(&sequence) => {
                let record = self.record(sequence).await.map_err(|e| match e {
                    StorageError::Damaged { location, sequence, what } => StorageError::Damaged {
                        location,
                        sequence,
                        what: format!(
                            "{what}; no commit is made over a newest record that cannot be read (its generation \
                             is unknown): repair or remove it"
                        ),
                    },
                    other => other,
                })?;
                Some(protocol::Latest { sequence, generation: record.generation, writer: record.writer })
            }
            None => None,
        };
        protocol::next_sequence(latest, generation, writer)
            .map_err(|source| StorageError::Fenced { location: self.name.clone(), source })
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
    async fn data_objects(&self) -> Result<Vec<(String, object_store::ObjectMeta)>, StorageError> {
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

    /// Commits `checkpoint` as exactly `sequence`: fails with [`StorageError::LostRace`] if
    /// another writer created it first.
    pub async fn commit_sequence(
        &self,
        sequence: u64,
        checkpoint: &NewCheckpoint,
        keep: usize,
    ) -> Result<CommitRecord, StorageError> {
        let id = protocol::data_id(checkpoint.generation, checkpoint.writer, &uuid::Uuid::new_v4().to_string());

        let mut entries = Vec::new();
        for blob in &checkpoint.blobs {
            let relative = format!("{DATA}/{id}/{}", blob.name);
            let chunks = tensors::encode(&blob.tensors)?;
            let (size, sha256) = self.upload(&relative, &chunks).await?;
            entries.push(BlobEntry { name: blob.name.clone(), path: relative, size, sha256 });
        }
        let now = unix_ms();
        let manifest = Manifest {
            format: FORMAT.into(),
            generation: checkpoint.generation,
            global_step: checkpoint.global_step,
            epoch: checkpoint.epoch,
            created_unix_ms: now,
            meta: checkpoint.meta.clone(),
            blobs: entries,
        };
        let manifest_bytes = Bytes::from(serde_json::to_vec_pretty(&manifest).expect("plain data"));
        let manifest_path = format!("{DATA}/{id}/{MANIFEST}");
        self.upload(&manifest_path, std::slice::from_ref(&manifest_bytes)).await?;

        crate::failpoint::point("commit-before-record");
        let record = CommitRecord {
            sequence,
            generation: checkpoint.generation,
            writer: checkpoint.writer,
            manifest: manifest_path,
            manifest_sha256: hex(&Sha256::digest(&manifest_bytes)),
            manifest_size: manifest_bytes.len() as u64,
            global_step: checkpoint.global_step,
            epoch: checkpoint.epoch,
            bytes: manifest.blobs.iter().map(|b| b.size).sum(),
            created_unix_ms: now,
        };
        self.create_record(&record).await?;
        self.collect(keep, (checkpoint.generation, checkpoint.writer), Some(&id)).await;
        Ok(record)
    }

    /// Creates the commit record if absent: the one write that makes a commit visible.
    async fn create_record(&self, record: &CommitRecord) -> Result<(), StorageError> {
        let relative = format!("{COMMITS}/{}", protocol::commit_name(record.sequence));
        let path = self.path(&relative);
        let body = Bytes::from(serde_json::to_vec_pretty(record).expect("plain data"));
        let opts = || PutOptions { mode: PutMode::Create, ..Default::default() };
        match self
            .retrying("creating", &relative, || async {
                self.store.put_opts(&path, PutPayload::from(body.clone()), opts()).await
            })
            .await
        {
            Ok(_) => Ok(()),
            Err(StorageError::Backend { source, .. })
                if matches!(*source, object_store::Error::AlreadyExists { .. }) =>
            {
                // Ours, if an earlier attempt's answer was lost; anyone else's otherwise.
                match self.record(record.sequence).await {
                    Ok(existing) if existing == *record => Ok(()),
                    _ => Err(StorageError::LostRace { location: self.name.clone(), sequence: record.sequence }),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Uploads `chunks` as one object, multipart when large, hashing on another thread while
    /// the upload runs (a commit costs the slower of the two, not their sum).
    async fn upload(&self, relative: &str, chunks: &[Bytes]) -> Result<(u64, String), StorageError> {
        let path = self.path(relative);
        let size: usize = chunks.iter().map(Bytes::len).sum();
        let to_hash: Vec<Bytes> = chunks.to_vec(); // reference counts, not copies
        let hashing = tokio::task::spawn_blocking(move || {
            let mut hasher = Sha256::new();
            to_hash.iter().for_each(|c| hasher.update(c));
            hex(&hasher.finalize())
        });
        if size < PART_BYTES {
            let payload: PutPayload = chunks.iter().cloned().collect();
            self.retrying("writing", relative, || async { self.store.put(&path, payload.clone()).await }).await?;
        } else {
            self.retrying("writing", relative, || self.upload_multipart(&path, chunks)).await?;
        }
        let sha256 = hashing
            .await
            .map_err(|e| self.backend("hashing", relative, object_store::Error::JoinError { source: e }))?;
        Ok((size as u64, sha256))
    }

    /// One multipart upload of `chunks` in parts of [`PART_BYTES`] (each part references the
    /// snapshot, no copy), at most four in flight. An upload that fails is aborted, so that the
    /// server drops its parts; one that a killed process leaves behind is the server's lifecycle
    /// rule's to clean (README: "Checkpoints on S3").
    async fn upload_multipart(&self, path: &Path, chunks: &[Bytes]) -> object_store::Result<object_store::PutResult> {
        let mut upload = self.store.put_multipart(path).await?;
        let mut parts = Vec::new();
        let mut part: Vec<Bytes> = Vec::new();
        let mut filled = 0;
        for chunk in chunks {
            let mut rest = chunk.clone();
            while !rest.is_empty() {
                let take = rest.len().min(PART_BYTES - filled);
                part.push(rest.split_to(take));
                filled += take;
                if filled == PART_BYTES {
                    parts.push(std::mem::take(&mut part).into_iter().collect::<PutPayload>());
                    filled = 0;
                }
            }
        }
        if !part.is_empty() {
            parts.push(part.into_iter().collect::<PutPayload>());
        }
        let mut in_flight = futures::stream::FuturesUnordered::new();
        let mut sent = Ok(());
        for payload in parts {
            if in_flight.len() == 4 {
                if let Some(Err(e)) = futures::StreamExt::next(&mut in_flight).await {
                    sent = Err(e);
                    break;
                }
            }
            in_flight.push(upload.put_part(payload));
        }
        while let Some(done) = futures::StreamExt::next(&mut in_flight).await {
            if let (Ok(()), Err(e)) = (&sent, done) {
                sent = Err(e);
            }
        }
        let result = match sent {
            Ok(()) => upload.complete().await,
            Err(e) => Err(e),
        };
        if let Err(e) = &result {
            if let Err(abort) = upload.abort().await {
                tracing::warn!("{}: aborting the failed upload of {path} ({e}): {abort}", self.name);
            }
        }
        result
    }

    /// Reads an object of commit `sequence` and checks it against the `(sha256, size)` that
    /// `expected_by` recorded; any failure makes the commit damaged, described as `label`.
    async fn get_verified(
        &self,
        sequence: u64,
        label: &str,
        relative: &str,
        (sha256, size): (&str, u64),
        expected_by: &str,
    ) -> Result<Bytes, StorageError> {
        let bytes = self.get(relative).await.map_err(|e| self.damaged(sequence, e.to_string()))?;
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
        let record = self.record(sequence).await?;
        let manifest_bytes = self
            .get_verified(
                sequence,
                &format!("manifest {}", record.manifest),
                &record.manifest,
                (&record.manifest_sha256, record.manifest_size),
                "the commit record",
            )
            .await?;
        let manifest: Manifest = serde_json::from_slice(&manifest_bytes)
            .map_err(|e| self.damaged(sequence, format!("manifest {} is not valid: {e}", record.manifest)))?;
        let mut blobs = BTreeMap::new();
        for entry in &manifest.blobs {
            let bytes = self
                .get_verified(
                    sequence,
                    &format!("blob {} ({})", entry.name, entry.path),
                    &entry.path,
                    (&entry.sha256, entry.size),
                    "the manifest",
                )
                .await?;
            let tensors =
                tensors::decode(&bytes).map_err(|e| self.damaged(sequence, format!("blob {}: {e}", entry.name)))?;
            blobs.insert(entry.name.clone(), tensors);
        }
        Ok(Restored { record, manifest, blobs, fallbacks: Vec::new() })
    }

    /// The newest commit that verifies, falling back past damaged ones (each reported in
    /// `fallbacks` and the log). `Ok(None)` when nothing was ever committed.
    pub async fn latest(&self) -> Result<Option<Restored>, StorageError> {
        let sequences = self.sequences().await?;
        let mut fallbacks = Vec::new();
        for &seq in sequences.iter().rev() {
            match self.load(seq).await {
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

    /// Deletes all but the newest `keep` commits (record first, so no visible commit ever lacks
    /// its data), then the data no commit can ever name (the rule is in [`crate::protocol`]);
    /// `me` is the collector's (generation, writer), `in_flight` its commit's data id. Best
    /// effort: a failure here is logged and retried at the next commit.
    pub async fn collect(&self, keep: usize, me: (u64, u64), in_flight: Option<&str>) {
        if let Err(e) = self.try_collect(keep, me, in_flight).await {
            tracing::warn!("{}: cleaning up old checkpoints: {e}", self.name);
        }
    }

    async fn try_collect(&self, keep: usize, me: (u64, u64), in_flight: Option<&str>) -> Result<(), StorageError> {
        let sequences = self.sequences().await?;
        for seq in protocol::retention(&sequences, keep) {
            let relative = format!("{COMMITS}/{}", protocol::commit_name(seq));
            let path = self.path(&relative);
            self.retrying("deleting", &relative, || async { self.store.delete(&path).await }).await?;
        }
        let records = self.records().await?;
        if let Some((seq, Err(e))) = records.iter().find(|(_, r)| r.is_err()) {
            tracing::warn!(
                "{}: no checkpoint data is deleted while commit {seq} cannot be read (its data is unknown); retention                  removes that record in time: {e}",
                self.name
            );
            return Ok(());
        }
        let records: Vec<CommitRecord> = records.into_iter().filter_map(|(_, r)| r.ok()).collect();
        let referenced: BTreeSet<String> = records.iter().filter_map(|r| r.data_id().map(String::from)).collect();
        let newest = records.last().map(|r| protocol::Latest {
            sequence: r.sequence,
            generation: r.generation,
            writer: r.writer,
        });
        let mut by_id: BTreeMap<String, Vec<Path>> = BTreeMap::new();
        let mut ids = protocol::DataIds { newest_ms: BTreeMap::new() };
        for (id, object) in self.data_objects().await? {
            let written = object.last_modified.timestamp_millis().max(0) as u64;
            let newest = ids.newest_ms.entry(id.clone()).or_default();
            *newest = (*newest).max(written);
            by_id.entry(id).or_default().push(object.location);
        }
        let collector =
            protocol::Collector { me, in_flight, newest, now_ms: unix_ms(), grace_ms: self.grace.as_millis() as u64 };
        for id in protocol::garbage(&ids, &referenced, collector) {
            for location in &by_id[&id] {
                let relative = self.relative(location);
                self.retrying("deleting", &relative, || async { self.store.delete(location).await }).await?;
            }
        }
        Ok(())
    }
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
