//! A dataset's bytes: its files listed once at start (name, size, ETag), and byte ranges of them
//! read against that record, so that a file changed under the running job is refused, naming it
//! (reads carry `If-Match`; on local disk the ETag is object_store's inode-mtime-size).
//!
//! A read that fails transiently (a server down, 5xx, a timeout) is retried with the checkpoint
//! store's back-off (0.2 s doubling to 2 s) for at most the wait bound (`--data-timeout`), each
//! failure logged and told to an [`Observer`] (the daemon keeps systemd's watchdog fed and says
//! so in `STATUS=`); past the bound it is one error naming the file. Nothing is skipped.
//!
//! Remote ranges go through the local [`Cache`] when there is one. Every range is counted, by
//! epoch, as fetched or served from the cache ([`Traffic`]).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use object_store::path::Path as StorePath;
use object_store::{GetOptions, GetRange, ObjectMeta, ObjectStore};
use trainerd_storage::{transient, Retry, S3Options};

use crate::cache::Cache;
use crate::error::{DataError, WriteError};
use crate::location::DataLocation;
pub use crate::location::FileRef;

/// Told when the data source fails and comes back, while a read waits within its bound.
pub trait Observer: Send + Sync {
    /// Reading `file` failed with `error`; it is retried, `waited` so far of at most `bound`.
    fn retrying(&self, file: &str, error: &str, waited: Duration, bound: Duration);
    /// Reading `file` succeeded again after `waited`.
    fn recovered(&self, file: &str, waited: Duration);
}

/// An observer that only logs (the log lines are the source's own).
pub struct Quiet;

impl Observer for Quiet {
    fn retrying(&self, _: &str, _: &str, _: Duration, _: Duration) {}
    fn recovered(&self, _: &str, _: Duration) {}
}

/// What a read is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Purpose {
    /// The index (footers).
    Index,
    /// An epoch of training.
    Train(u32),
    /// An epoch's evaluation.
    Test(u32),
    /// Tokenizing raw text before training.
    Tokenize,
}

/// Bytes read for one purpose.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Traffic {
    /// Bytes fetched from the location.
    pub fetched: u64,
    /// Bytes served by the local cache instead.
    pub from_cache: u64,
}

/// The files of a location, read by range.
pub struct Source {
    location: DataLocation,
    store: Arc<dyn ObjectStore>,
    root: StorePath,
    runtime: tokio::runtime::Runtime,
    timeout: Duration,
    backoff: Retry,
    cache: Option<Arc<Cache>>,
    observer: Arc<dyn Observer>,
    traffic: Mutex<BTreeMap<Purpose, Traffic>>,
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Source").field("location", &self.location).finish()
    }
}

impl Source {
    /// Opens `location`: remote reads cached in `cache` (local files are read in place), each
    /// read waiting at most `timeout` for a failing source.
    pub fn open(
        location: &DataLocation,
        s3: &S3Options,
        timeout: Duration,
        cache: Option<Arc<Cache>>,
        observer: Arc<dyn Observer>,
    ) -> Result<Source, DataError> {
        let err = |reason: String| DataError::Location { location: location.to_string(), reason };
        let (store, root): (Arc<dyn ObjectStore>, StorePath) = match location {
            DataLocation::Local(dir) => {
                if !dir.is_dir() {
                    return Err(err("no such directory".into()));
                }
                let fs = object_store::local::LocalFileSystem::new_with_prefix(dir)
                    .map_err(|source| DataError::Store { location: location.to_string(), source })?;
                (Arc::new(fs), StorePath::default())
            }
            DataLocation::S3 { bucket, prefix } => {
                let store = trainerd_storage::s3_store(bucket, s3)
                    .map_err(|source| DataError::Store { location: location.to_string(), source })?;
                (Arc::new(store), StorePath::from(prefix.as_str()))
            }
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("trainerd-data-io")
            .enable_all()
            .build()
            .map_err(|e| DataError::Start {
                location: location.to_string(),
                what: "cannot start its I/O runtime",
                source: Box::new(e),
            })?;
        let cache = cache.filter(|_| matches!(location, DataLocation::S3 { .. }));
        let traffic = Mutex::default();
        let backoff = Retry::default();
        Ok(Source { location: location.clone(), store, root, runtime, timeout, backoff, cache, observer, traffic })
    }

    /// The location.
    pub fn location(&self) -> &DataLocation {
        &self.location
    }

    /// The files directly under the location (not in sub-directories), by name.
    pub fn list(&self) -> Result<Vec<FileRef>, DataError> {
        let what = self.location.to_string();
        let root = (!self.root.as_ref().is_empty()).then_some(&self.root);
        let listed = self.retrying(&what, || async move { self.store.list_with_delimiter(root).await }).map_err(
            |f| match f {
                Failure::Definite(source) => DataError::Store { location: what.clone(), source },
                Failure::Gave(e) => e,
            },
        )?;
        let mut files: Vec<FileRef> = listed.objects.into_iter().map(|m| self.file_ref(m)).collect();
        files.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(files)
    }

    fn file_ref(&self, meta: ObjectMeta) -> FileRef {
        let full = meta.location.as_ref();
        let name = full.strip_prefix(self.root.as_ref()).unwrap_or(full).trim_start_matches('/').to_string();
        FileRef { name, size: meta.size, etag: meta.e_tag }
    }

    /// The file `name` (a name inside the location) as it is now; `None` when there is none.
    pub fn head(&self, name: &str) -> Result<Option<FileRef>, DataError> {
        let shown = self.location.file(name);
        let path = name.split('/').fold(self.root.clone(), |p, part| p.join(part));
        let got = self.retrying(&shown, || {
            let path = path.clone();
            async move { Ok(self.store.get_opts(&path, GetOptions::new().with_head(true)).await?.meta) }
        });
        match got {
            Ok(meta) => Ok(Some(self.file_ref(meta))),
            Err(Failure::Definite(object_store::Error::NotFound { .. })) => Ok(None),
            Err(Failure::Definite(source)) => Err(DataError::Source { file: shown, source }),
            Err(Failure::Gave(e)) => Err(e),
        }
    }

    /// Bytes `range` of `file`, read for `purpose`, from the cache when it holds them.
    pub fn read(&self, file: &FileRef, range: Range<u64>, purpose: Purpose) -> Result<Bytes, DataError> {
        let len = range.end - range.start;
        let key = self.cache.as_ref().map(|c| c.key(&self.location.to_string(), file, &range));
        if let (Some(cache), Some(key)) = (&self.cache, &key) {
            if let Some(bytes) = cache.get(key, len) {
                self.count(purpose, Traffic { fetched: 0, from_cache: len });
                return Ok(bytes);
            }
        }
        let bytes = self.fetch(file, range)?;
        self.count(purpose, Traffic { fetched: len, from_cache: 0 });
        if let (Some(cache), Some(key)) = (&self.cache, &key) {
            // A cache that cannot be written (a full disk) costs speed, never the run.
            if let Err(e) = cache.put(key, &bytes) {
                tracing::warn!("{e}; reading on without caching this range");
            }
        }
        Ok(bytes)
    }

    /// Writes `bytes` as the file `name` (whole, atomically: a local file is renamed into place,
    /// an S3 object appears whole), retrying a failing source within the bound.
    pub fn write(&self, name: &str, bytes: bytes::Bytes) -> Result<(), DataError> {
        let shown = self.location.file(name);
        let path = name.split('/').fold(self.root.clone(), |p, part| p.join(part));
        let payload = object_store::PutPayload::from(bytes);
        self.retrying(&shown, || {
            let (path, payload) = (path.clone(), payload.clone());
            async move { self.store.put_opts(&path, payload, object_store::PutOptions::default()).await }
        })
        .map(drop)
        .map_err(|f| match f {
            Failure::Definite(e) => DataError::Write { what: shown.clone(), reason: WriteError::Store(e) },
            Failure::Gave(e) => e,
        })
    }

    /// What was read so far, by purpose.
    pub fn traffic(&self) -> BTreeMap<Purpose, Traffic> {
        self.traffic.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    fn count(&self, purpose: Purpose, t: Traffic) {
        let mut traffic = self.traffic.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let entry = traffic.entry(purpose).or_default();
        entry.fetched += t.fetched;
        entry.from_cache += t.from_cache;
    }

    fn fetch(&self, file: &FileRef, range: Range<u64>) -> Result<Bytes, DataError> {
        let shown = self.location.file(&file.name);
        let path = file.name.split('/').fold(self.root.clone(), |p, part| p.join(part));
        let options = GetOptions {
            range: Some(GetRange::Bounded(range.clone())),
            if_match: file.etag.clone(),
            ..GetOptions::default()
        };
        let got = self.retrying(&shown, || {
            let (path, options) = (path.clone(), options.clone());
            async move { self.store.get_opts(&path, options).await?.bytes().await }
        });
        let changed = |what: String| DataError::Changed { file: shown.clone(), what };
        match got {
            Ok(bytes) if bytes.len() as u64 == range.end - range.start => Ok(bytes),
            Ok(_) => Err(changed(format!("it is shorter than the {} bytes it had", file.size))),
            Err(Failure::Definite(object_store::Error::Precondition { .. })) => Err(changed(format!(
                "it is not the file it was (its ETag is no longer {})",
                file.etag.as_deref().unwrap_or("?")
            ))),
            Err(Failure::Definite(object_store::Error::NotFound { .. })) => Err(changed("it is gone".into())),
            Err(Failure::Definite(source)) => Err(DataError::Source { file: shown, source }),
            Err(Failure::Gave(e)) => Err(e),
        }
    }

    /// Runs `f` until it succeeds, fails definitely, or failures have lasted the wait bound.
    fn retrying<T, F, Fut>(&self, what: &str, mut f: F) -> Result<T, Failure>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = object_store::Result<T>>,
    {
        let started = Instant::now();
        let mut delay = self.backoff.base;
        let mut failed = false;
        loop {
            match self.runtime.block_on(f()) {
                Ok(v) => {
                    if failed {
                        tracing::warn!(
                            "data source {what}: answering again after {:.1} s",
                            started.elapsed().as_secs_f64()
                        );
                        self.observer.recovered(what, started.elapsed());
                    }
                    return Ok(v);
                }
                Err(e) if transient(&e) => {
                    let waited = started.elapsed();
                    if waited + delay > self.timeout {
                        let last = e.to_string();
                        return Err(Failure::Gave(DataError::Unavailable { file: what.to_string(), waited, last }));
                    }
                    failed = true;
                    tracing::warn!(
                        "data source {what}: {e}; retrying in {delay:?} ({:.0} s so far)",
                        waited.as_secs_f64()
                    );
                    self.observer.retrying(what, &e.to_string(), waited, self.timeout);
                    std::thread::sleep(delay);
                    delay = (delay * 2).min(self.backoff.max);
                }
                Err(e) => return Err(Failure::Definite(e)),
            }
        }
    }
}

/// How a read failed.
enum Failure {
    /// The store answered with a definite error.
    Definite(object_store::Error),
    /// Transient failures lasted the whole bound.
    Gave(DataError),
}
