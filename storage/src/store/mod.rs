//! Committing and restoring checkpoints over any `object_store` backend, following
//! [`crate::protocol`]: blobs, then manifest, then a create-if-absent commit record. Readers take
//! the newest commit whose manifest and every blob verify, and fall back to older ones, saying
//! why.
//!
//! Transient storage errors (a server down, 5xx, timeouts) are retried with backoff; nothing a
//! failed or interrupted commit leaves behind can be mistaken for a commit, and its blobs are
//! collected later.
//!
//! [`types`] holds what a location holds and says; reading is in `read.rs` (a commit in part, its
//! blobs read by element range, in `ranged.rs`), committing and collection in `write.rs`, the
//! probe of whether every member reaches the location in `reach.rs`.

mod ranged;
mod reach;
mod read;
pub mod types;
mod write;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};

pub use ranged::BlobRanges;
pub use types::*;

/// A checkpoint location opened on a backend.
#[derive(Clone, Debug)]
pub struct CheckpointStore {
    store: Arc<dyn ObjectStore>,
    root: Path,
    name: String,
    retry: Retry,
    /// Transient failures seen so far (shared by clones).
    failures: Arc<std::sync::atomic::AtomicU64>,
}

/// How long data that no record names, and that may be another writer's commit in flight, is
/// spared by collection (see [`crate::protocol`]).
pub const COLLECT_GRACE: Duration = Duration::from_secs(24 * 3600);
impl CheckpointStore {
    /// A store over `store`, under `root`, called `name` in messages.
    pub fn new(store: Arc<dyn ObjectStore>, root: Path, name: impl Into<String>) -> CheckpointStore {
        CheckpointStore { store, root, name: name.into(), retry: Retry::default(), failures: Arc::default() }
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

    pub(super) fn path(&self, relative: &str) -> Path {
        relative.split('/').fold(self.root.clone(), |p, part| p.join(part))
    }

    pub(super) fn relative(&self, path: &Path) -> String {
        let root = self.root.as_ref();
        let full = path.as_ref();
        if root.is_empty() {
            full.to_string()
        } else {
            full.strip_prefix(root).map(|s| s.trim_start_matches('/').to_string()).unwrap_or_else(|| full.to_string())
        }
    }

    pub(super) fn backend(&self, op: &'static str, path: &str, source: object_store::Error) -> StorageError {
        StorageError::Backend { location: self.name.clone(), op, path: path.to_string(), source: Box::new(source) }
    }

    pub(super) fn damaged(&self, sequence: u64, what: String) -> StorageError {
        StorageError::Damaged { location: self.name.clone(), sequence, what }
    }

    /// Runs `f` until it succeeds, fails definitely, or the attempts run out.
    pub(super) async fn retrying<T, F, Fut>(&self, op: &'static str, path: &str, mut f: F) -> Result<T, StorageError>
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

    pub(super) async fn get(&self, relative: &str) -> Result<Bytes, StorageError> {
        let path = self.path(relative);
        self.retrying("reading", relative, || async { self.store.get(&path).await?.bytes().await }).await
    }
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
