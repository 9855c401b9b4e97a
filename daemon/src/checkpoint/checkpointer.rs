//! The chief's checkpointer: commits a state's blobs and metadata to a checkpoint location in the
//! background, one commit at a time, fenced by the cluster's generation and this process's writer
//! id. The storage crate does the how (atomic, verified, fenced commits); what a checkpoint holds
//! is `state`'s ([`crate::state::TrainState::blobs`], [`Meta`]); when to commit is the training
//! loop's policy (`train::commit`).
//!
//! Committing is asynchronous: at the step boundary the state is copied into host memory (the
//! only blocking part); hashing and upload run on a background thread while training goes on.
//! At most one commit is in flight; the next waits for it.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use trainerd_storage::{Blob, CheckpointStore, CommitRecord, NewCheckpoint, Restored, Score, StorageError};

use super::CheckpointError;
use crate::state::Meta;

/// Background commit work runs at a lower scheduling priority (nice 10), so that on a busy
/// machine it yields the CPU to training: a commit takes a little longer, training is barely
/// slowed (bench/checkpoint.sh measures both).
fn lower_priority() {
    // SAFETY: setpriority(2) on the calling thread (Linux applies PRIO_PROCESS with who = 0 to
    // the calling thread); failure only leaves the default priority.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, 0, 10);
    }
}

/// A commit running in the background: the progress it saves, its start time, and its thread.
type InFlight = ((u64, u64), Instant, JoinHandle<Result<CommitRecord, StorageError>>);

/// How a background commit ended.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Finished {
    /// It is committed.
    Committed {
        /// The commit's sequence.
        sequence: u64,
        /// The global step it holds.
        step: u64,
        /// Bytes written.
        bytes: u64,
        /// Seconds from its start.
        seconds: f64,
    },
    /// It failed; the previous commit stays the latest.
    Failed {
        /// The global step it held.
        step: u64,
        /// Why.
        message: String,
    },
}

/// Commits checkpoints in the background, one at a time, fenced by the cluster's generation and
/// this process's writer id.
pub(crate) struct Checkpointer {
    store: CheckpointStore,
    runtime: Arc<tokio::runtime::Runtime>,
    keep: usize,
    generation: u64,
    writer: u64,
    in_flight: Option<InFlight>,
    /// The store's transient failures when the commit in flight began.
    failures_before: u64,
    /// Progress (global step, epoch) of the newest state committed or restored.
    committed: Option<(u64, u64)>,
    /// The last commit's failure, if it failed.
    last_error: Option<String>,
}

impl Checkpointer {
    /// A checkpointer over `store`, keeping the newest `keep` commits.
    pub(crate) fn new(store: CheckpointStore, keep: usize) -> Result<Checkpointer, CheckpointError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("trainerd-storage")
            .on_thread_start(lower_priority)
            .enable_all()
            .build()
            .map_err(CheckpointError::Runtime)?;
        Ok(Checkpointer {
            store,
            runtime: Arc::new(runtime),
            keep,
            generation: 1,
            writer: rand::random::<u64>() >> 1,
            in_flight: None,
            failures_before: 0,
            committed: None,
            last_error: None,
        })
    }

    /// Proves that the location's server refuses a second create-if-absent write (see
    /// [`CheckpointStore::probe_create_if_absent`]); `endpoint` names it.
    pub(crate) fn probe(&self, endpoint: &str) -> Result<(), StorageError> {
        self.runtime.block_on(self.store.probe_create_if_absent(endpoint))
    }

    /// The location's name.
    pub(crate) fn location(&self) -> &str {
        self.store.name()
    }

    /// The last commit's failure, if it failed.
    pub(crate) fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    /// The newest verified commit, if any, and the newest generation the location has seen, in
    /// a commit record or in data a writer left (which the cluster's next generation must
    /// exceed, so that every earlier writer is fenced).
    pub(crate) fn restore(&mut self) -> Result<(Option<Restored>, u64), StorageError> {
        let latest = self.runtime.block_on(self.store.latest())?;
        let newest = self.runtime.block_on(self.store.latest_record()).ok().flatten();
        let written = self.runtime.block_on(self.store.newest_data_generation())?;
        let floor =
            newest.map_or(0, |r| r.generation).max(latest.as_ref().map_or(0, |r| r.record.generation)).max(written);
        self.generation = floor + 1;
        if let Some(r) = &latest {
            self.committed = Some((r.record.global_step, r.record.epoch));
        }
        Ok((latest, floor))
    }

    /// The newest commit's record, if any (its data unread).
    pub(crate) fn latest(&self) -> Result<Option<CommitRecord>, StorageError> {
        self.runtime.block_on(self.store.latest_record())
    }

    /// Commit `sequence`, verified.
    pub(crate) fn load(&self, sequence: u64) -> Result<Restored, StorageError> {
        self.runtime.block_on(self.store.load(sequence))
    }

    /// Commits from now on carry `generation` (the cluster's current one).
    pub(crate) fn set_generation(&mut self, generation: u64) {
        self.generation = generation;
    }

    /// Whether the state at `progress` is already committed (or on its way).
    pub(crate) fn has(&self, progress: (u64, u64)) -> bool {
        self.committed.is_some_and(|c| c >= progress) || self.in_flight.as_ref().is_some_and(|(p, _, _)| *p >= progress)
    }

    /// The commit in flight, if it has finished (without waiting).
    pub(crate) fn poll(&mut self) -> Option<Finished> {
        if self.in_flight.as_ref().is_some_and(|(_, _, h)| h.is_finished()) {
            return self.wait();
        }
        None
    }

    /// Waits for the commit in flight, if any; how it ended.
    pub(crate) fn wait(&mut self) -> Option<Finished> {
        let (progress, started, handle) = self.in_flight.take()?;
        let step = progress.0;
        let message = match handle.join() {
            Ok(Ok(record)) => {
                self.last_error = None;
                self.committed = self.committed.max(Some(progress));
                let seconds = started.elapsed().as_secs_f64();
                return Some(Finished::Committed { sequence: record.sequence, step, bytes: record.bytes, seconds });
            }
            Ok(Err(e)) => format!("checkpoint at step {step} failed: {e}"),
            Err(_) => format!("checkpoint at step {step}: the commit thread panicked"),
        };
        self.last_error = Some(message.clone());
        Some(Finished::Failed { step, message })
    }

    /// Whether a commit is still uploading and the storage failed under it since it began (a
    /// slow but healthy store is waited for; a failing one is not).
    pub(crate) fn stuck(&self) -> bool {
        self.in_flight.as_ref().is_some_and(|(_, _, h)| !h.is_finished())
            && self.store.transient_failures() > self.failures_before
    }

    /// Starts committing `blobs` (a snapshot in host memory) with `meta` and an epoch-end
    /// commit's `score`, after the previous commit finishes (how that one ended is returned).
    pub(crate) fn commit(
        &mut self,
        blobs: Vec<Blob>,
        meta: &Meta,
        score: Option<Score>,
    ) -> Result<Option<Finished>, CheckpointError> {
        let previous = self.wait();
        let position = &meta.position;
        let checkpoint = NewCheckpoint {
            generation: self.generation,
            writer: self.writer,
            global_step: position.global_step,
            epoch: u64::from(position.epoch),
            meta: serde_json::to_value(meta).map_err(CheckpointError::Meta)?,
            blobs,
            score,
        };
        let (store, runtime, keep) = (self.store.clone(), Arc::clone(&self.runtime), self.keep);
        let handle = std::thread::Builder::new()
            .name("trainerd-commit".into())
            .spawn(move || {
                lower_priority();
                runtime.block_on(store.commit(&checkpoint, keep))
            })
            .map_err(CheckpointError::Thread)?;
        self.failures_before = self.store.transient_failures();
        self.in_flight = Some((position.progress(), Instant::now(), handle));
        Ok(previous)
    }
}
