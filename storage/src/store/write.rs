//! Committing to a location: blobs, then the manifest, then a create-if-absent commit record;
//! the probe that the server honours create-if-absent; and collection of what old or failed
//! commits left.

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use sha2::{Digest, Sha256};

use super::{
    hex, unix_ms, BlobEntry, CheckpointStore, CommitRecord, Manifest, NewCheckpoint, Part, StorageError, COLLECT_GRACE,
    FORMAT, PART_BYTES,
};
use crate::protocol::{self, COMMITS, DATA, MANIFEST};
use crate::tensors;

impl CheckpointStore {
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

    /// Commits `checkpoint` as exactly `sequence`: fails with [`StorageError::LostRace`] if
    /// another writer created it first.
    pub async fn commit_sequence(
        &self,
        sequence: u64,
        checkpoint: &NewCheckpoint,
        keep: usize,
    ) -> Result<CommitRecord, StorageError> {
        let id = Self::new_data_id(checkpoint.generation, checkpoint.writer);
        self.commit_in(sequence, checkpoint, (&id, Vec::new()), keep).await
    }

    /// A fresh data id for a commit by `writer` of `generation`: a sharded commit's, which its
    /// coordinator sends the members so that they write their parts under it.
    pub fn new_data_id(generation: u64, writer: u64) -> String {
        protocol::data_id(generation, writer, &uuid::Uuid::new_v4().to_string())
    }

    /// Writes `part` of a sharded commit under data id `id` (its coordinator's): the entry the
    /// coordinator lists in the manifest. Nothing is visible until a commit record names it, and
    /// a part no record names is collected as its data id's writer's data.
    pub async fn write_part(&self, id: &str, part: &Part) -> Result<BlobEntry, StorageError> {
        let relative = format!("{DATA}/{id}/{}", part.file);
        let chunks = tensors::encode(&part.tensors)?;
        // Chaos tests stop a member here: a sharded commit cut short in a member's part.
        trainerd_failpoint::point("commit-part");
        let (size, sha256) = self.upload(&relative, &chunks).await?;
        Ok(BlobEntry { name: part.blob.clone(), path: relative, size, sha256, slices: Some(part.slices.clone()) })
    }

    /// Commits `checkpoint` with the `parts` that a sharded commit's members wrote under data id
    /// `id` ([`CheckpointStore::write_part`]) as the next sequence: its own blobs, then the
    /// manifest listing every part, then the record, as [`CheckpointStore::commit`].
    ///
    /// # Panics
    /// When a part lies under another data id (it would be collected as another commit's).
    pub async fn commit_parts(
        &self,
        checkpoint: &NewCheckpoint,
        (id, parts): (&str, Vec<BlobEntry>),
        keep: usize,
    ) -> Result<CommitRecord, StorageError> {
        let under = format!("{DATA}/{id}/");
        assert!(parts.iter().all(|p| p.path.starts_with(&under)), "every part lies under the commit's data id {id}");
        let sequence = self.next_sequence(checkpoint.generation, checkpoint.writer).await?;
        self.commit_in(sequence, checkpoint, (id, parts), keep).await
    }

    /// Commits `checkpoint`'s blobs and the `parts` already written, under data id `id`, as
    /// exactly `sequence`.
    async fn commit_in(
        &self,
        sequence: u64,
        checkpoint: &NewCheckpoint,
        (id, parts): (&str, Vec<BlobEntry>),
        keep: usize,
    ) -> Result<CommitRecord, StorageError> {
        let mut entries = Vec::new();
        for blob in &checkpoint.blobs {
            let relative = format!("{DATA}/{id}/{}", blob.name);
            let chunks = tensors::encode(&blob.tensors)?;
            let (size, sha256) = self.upload(&relative, &chunks).await?;
            entries.push(BlobEntry { name: blob.name.clone(), path: relative, size, sha256, slices: None });
        }
        entries.extend(parts);
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

        trainerd_failpoint::point("commit-before-record");
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
            score: checkpoint.score.clone(),
        };
        self.create_record(&record).await?;
        // Chaos tests hold a commit here: its collection deletes this writer's data that no record
        // names, so a sharded commit's parts are written only after it ends.
        trainerd_failpoint::point("commit-before-collect");
        self.collect(keep, (checkpoint.generation, checkpoint.writer), Some(id)).await;
        Ok(record)
    }

    /// Creates the commit record if absent: the one write that makes a commit visible.
    pub(super) async fn create_record(&self, record: &CommitRecord) -> Result<(), StorageError> {
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
    pub(super) async fn upload(&self, relative: &str, chunks: &[Bytes]) -> Result<(u64, String), StorageError> {
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
    pub(super) async fn upload_multipart(
        &self,
        path: &Path,
        chunks: &[Bytes],
    ) -> object_store::Result<object_store::PutResult> {
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

    /// Deletes all but the newest `keep` commits (record first, so no visible commit ever lacks
    /// its data), then the data no commit can ever name (the rule is in [`crate::protocol`]);
    /// `me` is the collector's (generation, writer), `in_flight` its commit's data id. Best
    /// effort: a failure here is logged and retried at the next commit.
    pub async fn collect(&self, keep: usize, me: (u64, u64), in_flight: Option<&str>) {
        if let Err(e) = self.try_collect(keep, me, in_flight).await {
            tracing::warn!("{}: cleaning up old checkpoints: {e}", self.name);
        }
    }

    pub(super) async fn try_collect(
        &self,
        keep: usize,
        me: (u64, u64),
        in_flight: Option<&str>,
    ) -> Result<(), StorageError> {
        let records = self.records().await?;
        // A record that could not be read for a storage error (not damage) might be the best:
        // no record is deleted this time.
        let unknown = records.iter().any(|(_, r)| matches!(r, Err(e) if !matches!(e, StorageError::Damaged { .. })));
        if !unknown {
            let sequences: BTreeSet<u64> = records.iter().map(|(seq, _)| *seq).collect();
            let scores = records.iter().map(|(seq, r)| (*seq, r.as_ref().ok().and_then(|r| r.score.as_ref())));
            for seq in protocol::retention(&sequences, protocol::best(scores), keep) {
                let relative = format!("{COMMITS}/{}", protocol::commit_name(seq));
                let path = self.path(&relative);
                self.retrying("deleting", &relative, || async { self.store.delete(&path).await }).await?;
            }
        }
        // Listed again: a commit another writer made meanwhile is then named, and its data spared.
        let records = self.records().await?;
        if let Some((seq, Err(e))) = records.iter().find(|(_, r)| r.is_err()) {
            tracing::warn!(
                "{}: no checkpoint data is deleted while commit {seq} cannot be read (its data is unknown); retention \
                 removes that record in time: {e}",
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
        let collector = protocol::Collector {
            me,
            in_flight,
            newest,
            now_ms: unix_ms(),
            grace_ms: COLLECT_GRACE.as_millis() as u64,
        };
        for id in protocol::garbage(&ids, &referenced, collector) {
            for location in &by_id[&id] {
                let relative = self.relative(location);
                self.retrying("deleting", &relative, || async { self.store.delete(location).await }).await?;
            }
        }
        Ok(())
    }
}
