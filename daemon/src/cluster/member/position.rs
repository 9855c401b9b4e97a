//! A member's position record: the generation it trains in and the furthest global step its state
//! reached there, written in place after every step (one `pwrite` of 32 bytes, no rename, no
//! sync: a process killed keeps what it wrote; a machine that loses power may lose the last
//! steps, which are then counted as before) to a file beside its kept vote. The process that
//! replaces it reads it, and its first join reports it: the formation then counts the steps that
//! only a process that died trained (docs/fault-tolerance.md, "A step's position outlives its
//! process").

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use xxhash_rust::xxh3::xxh3_64;

const MAGIC: &[u8; 8] = b"TRDPOS01";
const LEN: usize = 32;

/// Where `rank` keeps its position for the run `identity` (as its vote: [`super::super::election::vote_file`]).
pub(crate) fn position_file(dir: &Path, rank: usize, identity: &str) -> PathBuf {
    dir.join(format!("position-rank{rank}-{}.bin", super::super::election::run_id(identity)))
}

/// The record: (generation, furthest step) as 32 bytes, checked by an xxh3 of the first 24.
fn encode(generation: u64, step: u64) -> [u8; LEN] {
    let mut out = [0u8; LEN];
    out[..8].copy_from_slice(MAGIC);
    out[8..16].copy_from_slice(&generation.to_le_bytes());
    out[16..24].copy_from_slice(&step.to_le_bytes());
    let check = xxh3_64(&out[..24]);
    out[24..].copy_from_slice(&check.to_le_bytes());
    out
}

/// A record read back, if it is whole (a file torn by a power loss, or of another format, reads
/// as none).
fn decode(bytes: &[u8]) -> Option<Position> {
    let bytes: &[u8; LEN] = bytes.try_into().ok()?;
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    (&bytes[..8] == MAGIC && word(24) == xxh3_64(&bytes[..24])).then(|| (word(8), word(16)))
}

/// A position: the generation, and the furthest global step reached in it.
pub(crate) type Position = (u64, u64);

/// This process's record, and the position the process before it recorded.
pub(crate) type Kept = (PositionRecord, Option<Position>);

/// This process's record, written after every step.
pub(crate) struct PositionRecord {
    file: File,
    path: PathBuf,
    /// A write failed and was said: the next ones are not.
    failed: AtomicBool,
}

impl PositionRecord {
    /// The record of `rank` for the run `identity`, kept in `state_dir` (none without one), and
    /// what the process before this one recorded there.
    pub(crate) fn kept(
        state_dir: Option<&Path>,
        rank: usize,
        identity: &str,
    ) -> Result<Option<Kept>, super::ClusterError> {
        let path = state_dir.map(|dir| position_file(dir, rank, identity));
        path.map(|path| PositionRecord::open(&path).map_err(super::ClusterError::Setup)).transpose()
    }

    /// Opens the record at `path` (made if absent), and what it held: the position the process
    /// before this one recorded, if any.
    pub(crate) fn open(path: &Path) -> std::io::Result<Kept> {
        let before = std::fs::read(path).ok().and_then(|b| decode(&b));
        let file = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(path)?;
        Ok((PositionRecord { file, path: path.to_path_buf(), failed: AtomicBool::new(false) }, before))
    }

    /// Records that this process's state reached `step` in `generation` (said once if it cannot:
    /// training goes on, and a replacement's count may then miss these steps).
    pub(crate) fn write(&self, generation: u64, step: u64) {
        if let Err(e) = self.file.write_all_at(&encode(generation, step), 0) {
            if !self.failed.swap(true, Ordering::Relaxed) {
                tracing::warn!("cannot record this worker's position in {}: {e}", self.path.display());
            }
        }
    }
}

impl PositionRecord {
    /// The run finished: the record goes with the vote, so that the same job started again on
    /// this node counts nothing of this run.
    pub(crate) fn remove(&self) {
        if let Err(e) = std::fs::remove_file(&self.path) {
            tracing::warn!("the run finished, but {} was not removed: {e}", self.path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_and_a_torn_or_foreign_one_reads_as_none() {
        assert_eq!(decode(&encode(7, 1234)), Some((7, 1234)));
        let mut torn = encode(7, 1234);
        torn[17] ^= 1;
        assert_eq!(decode(&torn), None);
        assert_eq!(decode(&torn[..20]), None);
        assert_eq!(decode(b"{\"term\":3,\"coordinator\":1}0000000"), None);
    }

    #[test]
    fn the_next_process_reads_what_the_last_one_wrote() {
        let dir = tempfile::tempdir().unwrap();
        let path = position_file(dir.path(), 2, "run");
        let (first, before) = PositionRecord::open(&path).unwrap();
        assert_eq!(before, None);
        first.write(3, 40);
        first.write(3, 41);
        drop(first);
        let (_, before) = PositionRecord::open(&path).unwrap();
        assert_eq!(before, Some((3, 41)));
    }
}
