//! The local cache of remote byte ranges (a row group's columns, a footer): bounded in bytes,
//! least recently used out first, and safe to share between the workers of one host (systemd's
//! `CacheDirectory=`).
//!
//! An entry is one file named by the sha256 of (location, file, ETag, size, range), so a changed
//! file never serves stale bytes; its last four bytes are the CRC-32C of the rest, so a damaged
//! entry is dropped and fetched again rather than decoded. Entries are written to a temporary
//! name and renamed into place (another worker sees the whole entry or none); reading one
//! touches its modification time, which is what eviction orders by. Each process evicts down to
//! seven eighths of the bound whenever it has added an eighth of it since it last looked, so
//! the directory stays within the bound plus what its writers add between two looks.

use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use sha2::{Digest, Sha256};

use crate::error::DataError;
use crate::source::FileRef;

/// Temporary files older than this are a crashed writer's, and removed.
const STALE: Duration = Duration::from_secs(3600);

/// A cache directory and its bound.
#[derive(Debug)]
pub struct Cache {
    dir: PathBuf,
    limit: u64,
    added: AtomicU64,
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
        if self.added.fetch_add(len, Ordering::Relaxed) + len > self.limit / 8 {
            self.added.store(0, Ordering::Relaxed);
            self.evict();
        }
        Ok(())
    }

    /// Bytes the cache holds now (its entries, as listed).
    pub fn size(&self) -> u64 {
        self.entries().iter().map(|e| e.1).sum()
    }

    /// Removes the least recently used entries until the cache holds at most seven eighths of
    /// its bound, and crashed writers' temporary files.
    fn evict(&self) {
        let mut entries = self.entries();
        let mut total: u64 = entries.iter().map(|e| e.1).sum();
        if total <= self.limit {
            return;
        }
        entries.sort_by_key(|e| e.2);
        for (path, len, _) in entries {
            if total <= self.limit / 8 * 7 {
                break;
            }
            // Another worker may have removed it first; either way it is gone.
            let _ = std::fs::remove_file(&path);
            total = total.saturating_sub(len);
        }
    }

    /// Every entry: (path, bytes, last used); stale temporary files are removed on the way.
    fn entries(&self) -> Vec<(PathBuf, u64, SystemTime)> {
        let mut out = Vec::new();
        let Ok(dirs) = std::fs::read_dir(&self.dir) else { return out };
        for sub in dirs.flatten() {
            let Ok(files) = std::fs::read_dir(sub.path()) else { continue };
            for f in files.flatten() {
                let (Ok(meta), name) = (f.metadata(), f.file_name()) else { continue };
                let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                let name = name.to_string_lossy();
                if name.ends_with(".tmp") {
                    if modified.elapsed().is_ok_and(|age| age > STALE) {
                        let _ = std::fs::remove_file(f.path());
                    }
                } else if name.ends_with(".bin") {
                    out.push((f.path(), meta.len(), modified));
                }
            }
        }
        out
    }
}

/// A number no other call in this process returns (temporary names of concurrent writers).
fn unique() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
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
}
