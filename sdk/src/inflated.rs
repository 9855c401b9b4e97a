//! Inflated gzip files kept on local disk, so that a restarted worker reloads its data without
//! inflating it again (inflating Fashion-MNIST's training images takes about 0.15 s, reading them
//! back a few milliseconds; a worker restarted after a failure is on the cluster's critical path).
//!
//! An entry is named by the gzip trailer's CRC-32 and size of the inflated data, and is used only
//! if its bytes have exactly that size and CRC: a stale, damaged or half-written entry is never
//! read as data (it is inflated again and replaced). Entries are written through a temporary file
//! and renamed, so workers sharing the directory never see a partial one. The directory is the
//! one remote data is cached in: `$TRAINERD_DATA_CACHE`, else systemd's `CACHE_DIRECTORY`, else
//! `$XDG_CACHE_HOME/trainerd/data` or `~/.cache/trainerd/data`; `TRAINERD_NO_INFLATED_CACHE=1`
//! turns it off. Failing to write is not an error: the data was inflated anyway.

use std::path::{Path, PathBuf};

/// The gzip trailer: CRC-32 and size (mod 2^32) of the inflated data.
fn trailer(gz: &[u8]) -> Option<(u32, u32)> {
    let tail = gz.get(gz.len().checked_sub(8)?..)?;
    let crc = u32::from_le_bytes(tail[..4].try_into().ok()?);
    let size = u32::from_le_bytes(tail[4..].try_into().ok()?);
    Some((crc, size))
}

/// The cache directory, if there is one.
fn dir() -> Option<PathBuf> {
    if std::env::var_os("TRAINERD_NO_INFLATED_CACHE").is_some_and(|v| v == "1") {
        return None;
    }
    let env = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    let base = env("TRAINERD_DATA_CACHE")
        .or_else(|| {
            env("CACHE_DIRECTORY")
                .map(|d| PathBuf::from(d.to_string_lossy().split(':').next().unwrap_or_default()).join("data"))
        })
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("trainerd/data")))
        .or_else(|| env("HOME").map(|h| h.join(".cache/trainerd/data")))?;
    Some(base.join("inflated"))
}

fn entry(dir: &Path, gz: &[u8]) -> Option<(PathBuf, u32, u32)> {
    let (crc, size) = trailer(gz)?;
    Some((dir.join(format!("{crc:08x}-{size}.raw")), crc, size))
}

/// The inflated bytes of `gz`, if the cache holds them exactly.
pub(crate) fn cached(gz: &[u8]) -> Option<Vec<u8>> {
    cached_in(&dir()?, gz)
}

/// Keeps `bytes`, the inflated `gz`, for the next process (best effort).
pub(crate) fn keep(gz: &[u8], bytes: &[u8]) {
    if let Some(dir) = dir() {
        keep_in(&dir, gz, bytes);
    }
}

fn cached_in(dir: &Path, gz: &[u8]) -> Option<Vec<u8>> {
    let (path, crc, size) = entry(dir, gz)?;
    let bytes = std::fs::read(path).ok()?;
    (bytes.len() as u64 % (1 << 32) == u64::from(size) && libdeflater::crc32(&bytes) == crc).then_some(bytes)
}

fn keep_in(dir: &Path, gz: &[u8], bytes: &[u8]) {
    let Some((path, crc, _)) = entry(dir, gz) else { return };
    if libdeflater::crc32(bytes) != crc || path.is_file() {
        return;
    }
    let Some(parent) = path.parent() else { return };
    let tmp =
        parent.join(format!(".{}.{}.tmp", path.file_name().unwrap_or_default().to_string_lossy(), std::process::id()));
    let written = std::fs::create_dir_all(parent)
        .and_then(|()| std::fs::write(&tmp, bytes))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_is_used_only_when_its_size_and_crc_match_the_gzip_trailer() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("inflated");
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut gz = Vec::new();
        std::io::Write::write_all(&mut flate2::write::GzEncoder::new(&mut gz, flate2::Compression::fast()), &data)
            .unwrap();
        assert_eq!(cached_in(&dir, &gz), None);
        keep_in(&dir, &gz, &data);
        assert_eq!(cached_in(&dir, &gz).as_deref(), Some(&data[..]));
        // Damaged (same size): inflated again, never read as data.
        let (path, _, _) = entry(&dir, &gz).unwrap();
        let mut bad = data.clone();
        bad[7] ^= 1;
        std::fs::write(&path, &bad).unwrap();
        assert_eq!(cached_in(&dir, &gz), None);
        // Bytes that are not the gzip's are not kept.
        std::fs::remove_file(&path).unwrap();
        keep_in(&dir, &gz, &bad);
        assert!(!path.exists());
        assert_eq!(std::fs::read_dir(path.parent().unwrap()).unwrap().count(), 0, "no temporary left");
    }
}
