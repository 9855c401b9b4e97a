//! The local cache: remote byte ranges (a row group's columns, a footer, a tokenizer fetched from
//! S3) and raw text's token streams, bounded in bytes together, least recently used out first,
//! and safe to share between the workers of one host (systemd's `CacheDirectory=`).
//!
//! A range entry is one file named by the sha256 of (location, file, ETag, size, range), so a
//! changed file never serves stale bytes; its last four bytes are the CRC-32C of the rest, so a
//! damaged entry is dropped and fetched again rather than decoded. A token stream is a file in
//! `tokens/` and its sidecar (what the pass counted), named by the caller's key. Both are written
//! to a temporary name and renamed into place (another worker sees the whole entry or none);
//! using one touches its modification time, which is what eviction orders by. Each process
//! evicts down to seven eighths of the bound whenever it has added an eighth of it since it last
//! looked, so the directory stays within the bound plus what its writers add between two looks.
//!
//! A token stream is read for a whole run, so it is held open under a shared `flock` from the
//! moment it is written or opened until it is let go ([`InUse`]); eviction takes the lock
//! exclusively before removing one, and passes over a stream that any process holds. A stream
//! larger than the whole bound is written anyway (training needs it) and goes at the first look
//! after it is let go.

use std::fs::File;
use std::io::Write;
use std::ops::Range;
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use sha2::{Digest, Sha256};

use crate::error::DataError;
use crate::location::FileRef;

/// Temporary files older than this are a crashed writer's, and removed.
const STALE: Duration = Duration::from_secs(3600);

/// The sub-directory of token streams.
pub const STREAMS: &str = "tokens";

/// A cache directory and its bound.
#[derive(Debug)]
pub struct Cache {
    dir: PathBuf,
    limit: u64,
    added: AtomicU64,
}

/// One thing the cache holds, as eviction sees it.
struct Entry {
    /// A range entry's file, or a token stream's (its sidecar beside it).
    path: PathBuf,
    /// Bytes on disk (a stream's with its sidecar's).
    len: u64,
    /// Last used: the file's modification time.
    used: SystemTime,
    /// Whether it is a token stream (which may be in use).
    stream: bool,
}

impl Cache {
    /// The cache in `dir` (created if missing), holding at most `limit` bytes.
    pub fn open(dir: &Path, limit: u64) -> Result<Cache, DataError> {
        std::fs::create_dir_all(dir).map_err(|source| DataError::Cache { path: dir.into(), source })?;
        let cache = Cache { dir: dir.to_path_buf(), limit, added: AtomicU64::new(0) };
        cache.evict();
        Ok(cache)
    }

    /// The entry name of `range` of `file` at `location`.
    pub fn key(&self, location: &str, file: &FileRef, range: &Range<u64>) -> String {
        let etag = file.etag.as_deref().unwrap_or("");
        let id = format!("{location}\0{}\0{etag}\0{}\0{}-{}", file.name, file.size, range.start, range.end);
        Sha256::digest(id.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(&key[..2]).join(format!("{key}.bin"))
    }

    /// The `len` bytes of entry `key`, if the cache holds them whole.
    pub fn get(&self, key: &str, len: u64) -> Option<Bytes> {
        let path = self.path(key);
        let mut bytes = std::fs::read(&path).ok()?;
        let intact = bytes.len() as u64 == len + 4 && {
            let (body, tail) = bytes.split_at(len as usize);
            crc32c::crc32c(body).to_le_bytes() == tail
        };
        if !intact {
            tracing::warn!("data cache {}: damaged entry removed; fetching its range again", path.display());
            let _ = std::fs::remove_file(&path);
            return None;
        }
        // Recently used: eviction goes by modification time.
        if let Ok(f) = std::fs::File::options().append(true).open(&path) {
            let _ = f.set_modified(SystemTime::now());
        }
        bytes.truncate(len as usize);
        Some(Bytes::from(bytes))
    }

    /// Stores `bytes` as entry `key` (an entry over half the bound is not cached).
    pub fn put(&self, key: &str, bytes: &[u8]) -> Result<(), DataError> {
        let len = bytes.len() as u64;
        if len > self.limit / 2 {
            return Ok(());
        }
        let path = self.path(key);
        let dir = path.parent().expect("entries live in a sub-directory");
        let err = |source| DataError::Cache { path: dir.to_path_buf(), source };
        std::fs::create_dir_all(dir).map_err(err)?;
        let tmp = dir.join(format!(".{key}.{}.{}.tmp", std::process::id(), unique()));
        let written = std::fs::File::create(&tmp).and_then(|mut f| {
            f.write_all(bytes)?;
            f.write_all(&crc32c::crc32c(bytes).to_le_bytes())
        });
        let renamed = written.and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = renamed {
            let _ = std::fs::remove_file(&tmp);
            return Err(err(e));
        }
        self.added(len);
        Ok(())
    }

    /// The paths of token stream `key`: the stream, and its sidecar.
    pub fn stream_paths(&self, key: &str) -> (PathBuf, PathBuf) {
        let dir = self.dir.join(STREAMS);
        (dir.join(format!("{key}.tokens")), dir.join(format!("{key}.json")))
    }

    /// Token stream `key`, opened for use (held: no eviction removes it while the [`InUse`]
    /// lives), with its sidecar's bytes; `None` when the cache does not hold it whole.
    pub fn open_stream(&self, key: &str) -> Option<(InUse, Vec<u8>)> {
        let (path, sidecar) = self.stream_paths(key);
        // The lock is taken on what was opened: if the path was removed or replaced meanwhile,
        // what is held is no longer the cache's stream, and the path is opened again.
        for _ in 0..3 {
            let file = File::open(&path).ok()?;
            let _ = lock(&file, libc::LOCK_SH);
            if !names(&path, &file) {
                continue;
            }
            let side = std::fs::read(&sidecar).ok()?;
            let _ = file.set_modified(SystemTime::now());
            return Some((InUse { file, path }, side));
        }
        None
    }

    /// A new token stream `key`, held from its first byte: written to a temporary file that
    /// [`StreamWriter::finish`] puts in place.
    pub fn write_stream(&self, key: &str) -> Result<StreamWriter<'_>, DataError> {
        let dir = self.dir.join(STREAMS);
        let err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| DataError::Cache { path, source }
        };
        std::fs::create_dir_all(&dir).map_err(err(&dir))?;
        let tmp = dir.join(format!(".{key}.tokens.{}.{}.tmp", std::process::id(), unique()));
        let file = File::options().read(true).write(true).create_new(true).open(&tmp).map_err(err(&tmp))?;
        let _ = lock(&file, libc::LOCK_SH);
        Ok(StreamWriter { cache: self, key: key.to_string(), file: Some(file), tmp })
    }

    /// Bytes the cache holds now (its entries and streams, as listed).
    pub fn size(&self) -> u64 {
        self.entries().iter().map(|e| e.len).sum()
    }

    /// Counts `len` bytes added, and evicts when an eighth of the bound was added since the
    /// last look.
    fn added(&self, len: u64) {
        if self.added.fetch_add(len, Ordering::Relaxed) + len > self.limit / 8 {
            self.added.store(0, Ordering::Relaxed);
            self.evict();
        }
    }

    /// Removes the least recently used entries and streams (passing over streams in use) until
    /// the cache holds at most seven eighths of its bound, and crashed writers' temporary files.
    fn evict(&self) {
        let mut entries = self.entries();
        let mut total: u64 = entries.iter().map(|e| e.len).sum();
        if total <= self.limit {
            return;
        }
        entries.sort_by_key(|e| e.used);
        for entry in entries {
            if total <= self.limit / 8 * 7 {
                break;
            }
            let gone = if entry.stream {
                remove_unused_stream(&entry.path)
            } else {
                // Another worker may have removed it first; either way it is gone.
                let _ = std::fs::remove_file(&entry.path);
                true
            };
            if gone {
                total = total.saturating_sub(entry.len);
            }
        }
    }

    /// Every entry and stream; stale temporary files are removed on the way.
    fn entries(&self) -> Vec<Entry> {
        let mut out = Vec::new();
        let Ok(dirs) = std::fs::read_dir(&self.dir) else { return out };
        for sub in dirs.flatten() {
            let streams = sub.file_name() == STREAMS;
            let Ok(files) = std::fs::read_dir(sub.path()) else { continue };
            for f in files.flatten() {
                let (Ok(meta), name) = (f.metadata(), f.file_name()) else { continue };
                let used = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                let name = name.to_string_lossy();
                if name.ends_with(".tmp") {
                    if used.elapsed().is_ok_and(|age| age > STALE) {
                        let _ = std::fs::remove_file(f.path());
                    }
                } else if streams && name.ends_with(".tokens") {
                    let sidecar = std::fs::metadata(f.path().with_extension("json")).map_or(0, |m| m.len());
                    out.push(Entry { path: f.path(), len: meta.len() + sidecar, used, stream: true });
                } else if !streams && name.ends_with(".bin") {
                    out.push(Entry { path: f.path(), len: meta.len(), used, stream: false });
                }
            }
        }
        out
    }
}

/// A token stream being written: its temporary file, held, removed if never finished.
#[derive(Debug)]
pub struct StreamWriter<'a> {
    cache: &'a Cache,
    key: String,
    file: Option<File>,
    tmp: PathBuf,
}

impl StreamWriter<'_> {
    /// The file to write the stream to.
    pub fn file(&self) -> &File {
        self.file.as_ref().expect("present until finished")
    }

    /// The temporary file's path, as errors name it.
    pub fn path(&self) -> &Path {
        &self.tmp
    }

    /// Puts the written stream in place with its `sidecar` (written last: a stream without one
    /// is never opened), counts both against the bound, and hands the stream over, still held.
    pub fn finish(mut self, sidecar: &[u8]) -> Result<InUse, DataError> {
        let (path, side_path) = self.cache.stream_paths(&self.key);
        let err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| DataError::Cache { path, source }
        };
        // Until the rename, an error leaves the temporary file to the writer's drop to remove.
        let synced = self.file().sync_all();
        synced.and_then(|()| std::fs::rename(&self.tmp, &path)).map_err(err(&path))?;
        let file = self.file.take().expect("present until finished");
        let side_tmp = self.tmp.with_extension("json.tmp");
        let written = std::fs::write(&side_tmp, sidecar).and_then(|()| std::fs::rename(&side_tmp, &side_path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&side_tmp);
            return Err(err(&side_path)(e));
        }
        let len = file.metadata().map_or(0, |m| m.len()) + sidecar.len() as u64;
        self.cache.added(len);
        Ok(InUse { file, path })
    }
}

impl Drop for StreamWriter<'_> {
    fn drop(&mut self) {
        if self.file.is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// A token stream in use: its file, open and held under a shared lock, so that no process's
/// eviction removes it; touched when let go, so that its last use counts from its release.
#[derive(Debug)]
pub struct InUse {
    file: File,
    path: PathBuf,
}

impl InUse {
    /// The stream's file, for positioned reads.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Its path in the cache.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for InUse {
    fn drop(&mut self) {
        let _ = self.file.set_modified(SystemTime::now());
    }
}

/// Takes `how` of `file`'s `flock`: `WouldBlock` when another holds it the other way
/// (`LOCK_NB`); another error where locks are not supported (then nothing is protected, and a
/// reader keeps reading the file it has open even if it is removed).
fn lock(file: &File, how: libc::c_int) -> std::io::Result<()> {
    loop {
        // SAFETY: flock(2) on the descriptor `file` owns, open for the call's duration.
        if unsafe { libc::flock(file.as_raw_fd(), how) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Whether `path` still names the file `file` has open.
fn names(path: &Path, file: &File) -> bool {
    match (std::fs::metadata(path), file.metadata()) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

/// Removes the token stream at `path` and its sidecar unless a process holds it; whether it is
/// gone.
fn remove_unused_stream(path: &Path) -> bool {
    let Ok(file) = File::open(path) else { return true };
    if lock(&file, libc::LOCK_EX | libc::LOCK_NB).is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock) {
        return false;
    }
    // The sidecar first: a stream without one is never opened.
    let _ = std::fs::remove_file(path.with_extension("json"));
    let _ = std::fs::remove_file(path);
    true
}

/// A number no other call in this process returns (temporary names of concurrent writers).
fn unique() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;

    fn file(name: &str, etag: &str) -> FileRef {
        FileRef { name: name.into(), size: 1000, etag: Some(etag.into()) }
    }

    #[test]
    fn entries_round_trip_and_a_changed_file_misses() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::open(dir.path(), 1 << 20).unwrap();
        let key = cache.key("s3://b/p", &file("a.parquet", "e1"), &(10..20));
        assert_eq!(cache.get(&key, 10), None);
        cache.put(&key, b"0123456789").unwrap();
        assert_eq!(cache.get(&key, 10).as_deref(), Some(&b"0123456789"[..]));
        let changed = cache.key("s3://b/p", &file("a.parquet", "e2"), &(10..20));
        assert_ne!(key, changed);
        assert_eq!(cache.get(&changed, 10), None);
    }

    #[test]
    fn a_damaged_entry_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::open(dir.path(), 1 << 20).unwrap();
        let key = cache.key("s3://b/p", &file("a.parquet", "e1"), &(0..4));
        cache.put(&key, b"abcd").unwrap();
        let path = cache.path(&key);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[1] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        assert_eq!(cache.get(&key, 4), None);
        assert!(!path.exists());
    }

    /// Two caches on one directory (two workers of one host) stay within the bound together,
    /// and the entries used last stay.
    #[test]
    fn shared_caches_stay_within_their_bound_keeping_recent_entries() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (Cache::open(dir.path(), 64 << 10).unwrap(), Cache::open(dir.path(), 64 << 10).unwrap());
        let block = vec![7u8; 4 << 10];
        let keys: Vec<String> = (0..64).map(|i| a.key("s3://b/p", &file(&format!("f{i}"), "e"), &(0..4096))).collect();
        for (i, key) in keys.iter().enumerate() {
            let cache = if i % 2 == 0 { &a } else { &b };
            cache.put(key, &block).unwrap();
            // Modification times one second apart order the entries for eviction.
            let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + i as u64);
            std::fs::File::options().append(true).open(cache.path(key)).unwrap().set_modified(t).unwrap();
        }
        let bound = (64 << 10) + (64 << 10) / 8 * 2;
        assert!(a.size() <= bound, "{} bytes cached, bound {bound}", a.size());
        assert!(a.get(&keys[63], 4096).is_some(), "the newest entry stays");
        assert!(a.get(&keys[0], 4096).is_none(), "the oldest goes");
    }

    /// Writes token stream `key` of `len` bytes and lets it go, last used at second `at`.
    fn stream(cache: &Cache, key: &str, len: usize, at: u64) {
        drop(held_stream(cache, key, len));
        used_at(&cache.stream_paths(key).0, at);
    }

    /// Writes token stream `key` of `len` bytes, still held.
    fn held_stream(cache: &Cache, key: &str, len: usize) -> InUse {
        let writer = cache.write_stream(key).unwrap();
        writer.file().write_all(&vec![1u8; len]).unwrap();
        writer.finish(b"{}").unwrap()
    }

    fn used_at(path: &Path, at: u64) {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + at);
        File::options().append(true).open(path).unwrap().set_modified(t).unwrap();
    }

    fn kept(cache: &Cache, key: &str) -> bool {
        cache.stream_paths(key).0.exists()
    }

    /// Token streams count against the bound: with room for one, writing a second evicts the
    /// first (stream and sidecar), as range entries are evicted.
    #[test]
    fn a_stream_written_evicts_the_least_recently_used() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::open(dir.path(), 10_000).unwrap();
        let range = cache.key("s3://b/p", &file("a.parquet", "e1"), &(0..1000));
        cache.put(&range, &[0u8; 1000]).unwrap();
        used_at(&cache.path(&range), 1);
        stream(&cache, "a", 6000, 2);
        assert!(kept(&cache, "a") && cache.get(&range, 1000).is_some());
        used_at(&cache.path(&range), 1);
        stream(&cache, "b", 6000, 3);
        assert!(!kept(&cache, "a"), "the stream used least recently goes");
        assert!(!cache.stream_paths("a").1.exists(), "with its sidecar");
        assert!(cache.get(&range, 1000).is_none(), "older still: the range entry went first");
        assert!(kept(&cache, "b"));
        assert!(cache.size() <= 10_000, "{} bytes cached", cache.size());
    }

    /// Opening a stream is a use: the one read since stays, the one not read goes.
    #[test]
    fn a_stream_read_since_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::open(dir.path(), 10_000).unwrap();
        stream(&cache, "a", 4000, 1);
        stream(&cache, "b", 4000, 2);
        let (held, sidecar) = cache.open_stream("a").unwrap();
        assert_eq!((held.file().metadata().unwrap().len(), sidecar), (4000, b"{}".to_vec()));
        drop(held);
        stream(&cache, "c", 4000, 3);
        assert!(kept(&cache, "a"), "read since b was");
        assert!(!kept(&cache, "b"));
        assert!(cache.open_stream("b").is_none());
    }

    /// A stream held (by this process or another worker of the host) is passed over, however old
    /// and large; let go, it goes at the next look.
    #[test]
    fn a_stream_in_use_is_never_removed() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::open(dir.path(), 10_000).unwrap();
        stream(&cache, "a", 6000, 1);
        let (reading, _) = cache.open_stream("a").unwrap();
        used_at(&cache.stream_paths("a").0, 1);
        let writing = held_stream(&cache, "b", 12_000);
        assert!(kept(&cache, "a") && kept(&cache, "b"), "both held: nothing removed");
        let mut bytes = [0u8; 6];
        reading.file().read_exact_at(&mut bytes, 10).unwrap();
        assert_eq!(bytes, [1u8; 6]);
        drop(reading);
        used_at(&cache.stream_paths("a").0, 1);
        let other = Cache::open(dir.path(), 10_000).unwrap();
        assert!(!kept(&other, "a"), "let go, the oldest goes");
        assert!(kept(&other, "b"), "larger than the bound, but still held");
        drop(writing);
        drop(Cache::open(dir.path(), 10_000).unwrap());
        assert!(!kept(&other, "b"));
    }

    /// A writer that never finishes leaves nothing; one whose key exists already replaces it.
    #[test]
    fn an_unfinished_stream_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::open(dir.path(), 1 << 20).unwrap();
        let writer = cache.write_stream("a").unwrap();
        writer.file().write_all(b"partial").unwrap();
        let tmp = writer.path().to_path_buf();
        drop(writer);
        assert!(!tmp.exists());
        assert!(cache.open_stream("a").is_none());
        assert_eq!(cache.size(), 0);
    }
}
