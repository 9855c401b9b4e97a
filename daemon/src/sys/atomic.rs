//! Files the operator reads after a run (summaries, exported checkpoints) are written
//! atomically and durably: a reader, or a restart after a crash, sees the whole file or none
//! of it, never a torn one.

use std::io::Write;
use std::path::Path;

/// Writes `chunks` to `path` through a temporary file beside it: write, fsync, rename, fsync
/// the directory.
pub(crate) fn write_file(path: &Path, chunks: &[&[u8]]) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).open(&tmp)?;
    for chunk in chunks {
        file.write_all(chunk)?;
    }
    file.sync_all()?;
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    #[test]
    fn writes_the_whole_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.json");
        super::write_file(&path, &[b"ab", b"cd"]).unwrap();
        super::write_file(&path, &[b"xyz"]).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"xyz");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
