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

use trainerd_storage::{
    Blob, BlobEntry, BlobRanges, CheckpointStore, CommitRecord, NewCheckpoint, Part, Restored, Retry, Score,
    StorageError,
};

use super::CheckpointError;
use crate::state::Meta;

/// Writes a member's parts of a sharded commit from a thread of its own (the training thread goes
/// on meanwhile): the location's store and runtime.
pub(crate) struct PartsWriter {
    store: CheckpointStore,
    runtime: Arc<tokio::runtime::Runtime>,
}

impl PartsWriter {
    /// Writes `parts` under the commit's data id `id`, at the lower priority of commit work; the
    /// entries the manifest lists, or why not.
    pub(crate) fn write(&self, id: &str, parts: &[Part]) -> Result<Vec<BlobEntry>, StorageError> {
        lower_priority();
        self.upload(id, parts)
    }

    /// Writes `parts` under `id` from the calling thread, at its priority.
    fn upload(&self, id: &str, parts: &[Part]) -> Result<Vec<BlobEntry>, StorageError> {
        self.runtime.block_on(futures::future::try_join_all(parts.iter().map(|p| self.store.write_part(id, p))))
    }
}

/// The server the location is on proved (if it still had to be) to refuse a second
/// create-if-absent write; the proof is made once.
async fn probed(store: &CheckpointStore, unprobed: &std::sync::Mutex<Option<String>>) -> Result<(), StorageError> {
    let endpoint = unprobed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    let Some(endpoint) = endpoint else { return Ok(()) };
    store.probe_create_if_absent(&endpoint).await?;
    *unprobed.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    Ok(())
}

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
    /// The ranks of that generation, which its commits name, of TF_CONFIG's worker count.
    members: (Vec<usize>, usize),
    writer: u64,
    in_flight: Option<InFlight>,
    /// The store's transient failures when the commit in flight began.
    failures_before: u64,
    /// Progress (global step, epoch) of the newest state committed or restored.
    committed: Option<(u64, u64)>,
    /// The last commit's failure, if it failed.
    last_error: Option<String>,
    /// The S3 server to prove refuses a second create-if-absent write before anything is read or
    /// committed, until it has (taken by the proof; shared with the commit thread that makes it).
    unprobed: Arc<std::sync::Mutex<Option<String>>>,
    /// Blobs a restore only verifies, as a stream, and leaves out: a sharded run's optimizer
    /// state, which each member reads by range ([`Checkpointer::blob_ranges`]).
    streamed: Vec<&'static str>,
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
            members: (Vec::new(), 0),
            writer: rand::random::<u64>() >> 1,
            in_flight: None,
            failures_before: 0,
            committed: None,
            last_error: None,
            unprobed: Arc::default(),
            streamed: Vec::new(),
        })
    }

    /// From now on a restore verifies `blob` as a stream and leaves it out, to be read by range:
    /// no member holds it whole.
    pub(crate) fn stream_on_restore(&mut self, blob: &'static str) {
        self.streamed.push(blob);
    }

    /// Blob `blob` of commit `sequence`, whose manifest's sha256 is `manifest`, to be read by
    /// element range (its objects' headers read).
    pub(crate) fn blob_ranges(&self, commit: (u64, &str), blob: &str) -> Result<BlobRanges, StorageError> {
        self.runtime.block_on(self.store.blob_ranges(commit, blob))
    }

    /// The bytes of each of `wants` (a tensor of `ranges`' blob and a range of its elements).
    pub(crate) fn read_ranges(
        &self,
        ranges: &BlobRanges,
        wants: &[(&str, std::ops::Range<usize>)],
    ) -> Result<Vec<Vec<u8>>, StorageError> {
        self.runtime.block_on(ranges.read(wants))
    }

    /// Proves that the location's server refuses a second create-if-absent write (see
    /// [`CheckpointStore::probe_create_if_absent`]); `endpoint` names it.
    pub(crate) fn probe(&self) -> Result<(), StorageError> {
        self.runtime.block_on(probed(&self.store, &self.unprobed))
    }

    /// Proves `endpoint` refuses a second create-if-absent write before the location is first
    /// read ([`Checkpointer::probe`]) or committed to: a process that coordinates may never read it
    /// (survivors held the state), and its first commit then proves it.
    pub(crate) fn probe_before_writing(&mut self, endpoint: &str) {
        *self.unprobed.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(endpoint.to_string());
    }

    /// The location's name.
    pub(crate) fn location(&self) -> &str {
        self.store.name()
    }

    /// The last commit's failure, if it failed.
    pub(crate) fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    /// The newest verified commit (its streamed blobs verified and left out), if any, and the
    /// newest generation the location has seen, in a commit record or in data a writer left
    /// (which the cluster's next generation must exceed, so that every earlier writer is fenced).
    pub(crate) fn restore(&mut self) -> Result<(Option<Restored>, u64), StorageError> {
        let latest = self.runtime.block_on(self.store.latest_streaming(&self.streamed))?;
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

    /// Commits from now on carry `generation` (the cluster's current one) and name its
    /// `members`, ranks of a cluster of `world` workers.
    pub(crate) fn set_generation(&mut self, generation: u64, (members, world): (&[usize], usize)) {
        self.generation = generation;
        self.members = (members.to_vec(), world);
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

    /// Waits for the commit in flight, unless the storage fails under it meanwhile (then
    /// [`Checkpointer::stuck`] says so, and nothing is returned). Sampled once before a wait, a
    /// failure that came just after the sample held the training up for the whole retry: the
    /// soak saw a 19 s pause at a 17.5 s cut of the link to S3.
    pub(crate) fn wait_unless_stuck(&mut self) -> Option<Finished> {
        while self.in_flight.as_ref().is_some_and(|(_, _, h)| !h.is_finished()) {
            if self.stuck() {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        self.wait()
    }

    /// Whether a commit is in flight (its record, or its collection, still being made).
    pub(crate) fn busy(&self) -> bool {
        self.in_flight.as_ref().is_some_and(|(_, _, h)| !h.is_finished())
    }

    /// Transient storage failures met so far by this location's store and every writer of it
    /// (a count that moves while a commit is open says the storage is failing, not slow).
    pub(crate) fn transient_failures(&self) -> u64 {
        self.store.transient_failures()
    }

    /// What a thread other than the training thread writes a member's parts of a sharded commit
    /// with ([`PartsWriter::write`]).
    pub(crate) fn parts_writer(&self) -> PartsWriter {
        PartsWriter { store: self.store.clone(), runtime: Arc::clone(&self.runtime) }
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
        self.start(blobs, None, (meta, score, Instant::now()))
    }

    /// A fresh data id for this writer's next commit, whose parts the members write
    /// ([`Checkpointer::write_parts`]) before it commits them ([`Checkpointer::commit_parts`]).
    pub(crate) fn new_data_id(&self) -> String {
        CheckpointStore::new_data_id(self.generation, self.writer)
    }

    /// Writes this member's `parts` of a sharded commit under its coordinator's data id `id`, and
    /// waits for them: the entries the coordinator lists in the manifest.
    pub(crate) fn write_parts(&self, id: &str, parts: &[Part]) -> Result<Vec<BlobEntry>, StorageError> {
        self.parts_writer().upload(id, parts)
    }

    /// Starts committing the `parts` every member wrote under data id `id` (since `began`: the
    /// commit's time counts their writes) with `meta` and an epoch-end commit's `score`, as
    /// [`Checkpointer::commit`].
    pub(crate) fn commit_parts(
        &mut self,
        (id, parts): (String, Vec<BlobEntry>),
        meta: &Meta,
        (score, began): (Option<Score>, Instant),
    ) -> Result<Option<Finished>, CheckpointError> {
        self.start(Vec::new(), Some((id, parts)), (meta, score, began))
    }

    /// A sharded commit of the state at `progress` that never started: a member could not write
    /// its part (`why`). The previous commit stays the latest; how the one in flight ended, if
    /// any, and this one.
    pub(crate) fn failed_parts(&mut self, progress: (u64, u64), why: &str) -> (Option<Finished>, Finished) {
        let previous = self.wait();
        let message = format!("checkpoint at step {} failed: {why}", progress.0);
        self.last_error = Some(message.clone());
        (previous, Finished::Failed { step: progress.0, message })
    }

    /// Starts the commit of `blobs` and any members' `parts` (with their data id) in the
    /// background, after the previous one.
    fn start(
        &mut self,
        blobs: Vec<Blob>,
        parts: Option<(String, Vec<BlobEntry>)>,
        (meta, score, began): (&Meta, Option<Score>, Instant),
    ) -> Result<Option<Finished>, CheckpointError> {
        let previous = self.wait();
        let position = &meta.position;
        let checkpoint = NewCheckpoint {
            generation: self.generation,
            writer: self.writer,
            global_step: position.global_step,
            epoch: u64::from(position.epoch),
            meta: serde_json::to_value(Meta {
                members: self.members.0.clone(),
                cluster_workers: self.members.1,
                ..meta.clone()
            })
            .map_err(CheckpointError::Meta)?,
            blobs,
            score,
        };
        let (store, runtime, keep) = (self.store.clone(), Arc::clone(&self.runtime), self.keep);
        let unprobed = Arc::clone(&self.unprobed);
        let handle = std::thread::Builder::new()
            .name("trainerd-commit".into())
            .spawn(move || {
                lower_priority();
                runtime.block_on(async {
                    probed(&store, &unprobed).await?;
                    match parts {
                        Some((id, parts)) => store.commit_parts(&checkpoint, (&id, parts), keep).await,
                        None => store.commit(&checkpoint, keep).await,
                    }
                })
            })
            .map_err(CheckpointError::Thread)?;
        self.failures_before = self.store.transient_failures();
        self.in_flight = Some((position.progress(), began, handle));
        Ok(previous)
    }

    /// The store for reach probes: a few tries only, so that a storage outage as a generation
    /// forms costs it under a second (the generation then commits through its coordinator).
    fn probing(&self) -> CheckpointStore {
        self.store.clone().with_retry(Retry { attempts: 3, ..Retry::default() })
    }

    /// Writes this member's object (it is `place`) of the reach probe `nonce` at the location,
    /// holding `token` (its name).
    pub(crate) fn write_probe(&self, nonce: &str, place: usize, token: &str) -> Result<(), String> {
        self.runtime
            .block_on(self.probing().write_reach_probe(nonce, place, token.as_bytes()))
            .map_err(|e| e.to_string())
    }

    /// Whether this member reads every other member's object of the reach probe `nonce` back as
    /// it wrote it (`tokens`: each member's, by place; this member is `place`): `Err` names the
    /// first it could not, and why.
    pub(crate) fn read_probes(&self, nonce: &str, place: usize, tokens: &[String]) -> Result<(), String> {
        let store = self.probing();
        self.runtime.block_on(async {
            for (other, token) in tokens.iter().enumerate().filter(|&(p, _)| p != place) {
                let read = store.read_reach_probe(nonce, other).await.map_err(|e| format!("{token}'s: {e}"))?;
                if read != token.as_bytes() {
                    return Err(format!("{token}'s holds {:?}", String::from_utf8_lossy(&read)));
                }
            }
            Ok(())
        })
    }

    /// Removes this member's object of the reach probe `nonce`.
    pub(crate) fn remove_probe(&self, nonce: &str, place: usize) {
        self.runtime.block_on(self.probing().remove_reach_probe(nonce, place));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Position, Reader};
    use trainerd_sdk::PluginInfo;
    use trainerd_storage::{Location, S3Options};

    /// A commit names the ranks of the generation that made it, and a restore reads them back:
    /// what lets a restarted coordinator know who was gone already.
    #[test]
    fn a_commit_names_its_generations_ranks() {
        let store = Location::Memory.open(&S3Options::default()).unwrap();
        let mut c = Checkpointer::new(store, 0).unwrap();
        c.set_generation(3, (&[0, 1, 3], 4));
        let info = PluginInfo::classifier("linear", "0.1.0", "");
        let meta = Meta::new(Position::start(1), &info, 3, "{}");
        c.commit(Vec::new(), &meta, None).unwrap();
        assert!(matches!(c.wait(), Some(Finished::Committed { sequence: 1, .. })));
        let (restored, floor) = c.restore().unwrap();
        let restored = restored.expect("the commit");
        assert_eq!((floor, restored.record.generation), (3, 3));
        let meta = Meta::read(&restored, &info, Reader::Evaluation).unwrap();
        assert_eq!((meta.members, meta.cluster_workers), (vec![0, 1, 3], 4));
    }

    /// Found by the soak: a commit that came due while the one in flight had not failed yet
    /// waited out that one's whole retry (a 19 s pause at a 17.5 s cut of the link to S3). The
    /// wait now ends at the first failure, and the next commit is skipped as stuck.
    #[test]
    fn a_wait_for_the_commit_in_flight_ends_when_the_storage_fails_under_it() {
        use std::time::Duration;
        use trainerd_testkit::s3::S3Server;
        let server = S3Server::start().unwrap_or_else(|e| panic!("S3-compatible test server: {e}"));
        let link = server.link().unwrap();
        let store = CheckpointStore::new(Arc::new(server.store_via(&link.endpoint()).unwrap()), "stuck".into(), "s3");
        let mut c = Checkpointer::new(store, 0).unwrap();
        let info = PluginInfo::classifier("linear", "0.1.0", "");
        let meta = Meta::new(Position::start(1), &info, 1, "{}");
        link.cut();
        c.commit(Vec::new(), &meta, None).unwrap();
        let began = Instant::now();
        assert_eq!(c.wait_unless_stuck(), None);
        assert!(c.stuck() && began.elapsed() < Duration::from_secs(5), "waited {:?}", began.elapsed());
        // The commit in flight goes on retrying, and ends once the storage answers again.
        link.restore();
        assert!(matches!(c.wait(), Some(Finished::Committed { sequence: 1, .. })));
    }
}
