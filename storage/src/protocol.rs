//! The commit protocol's decisions, as pure functions: no I/O, so every corner is a plain unit
//! test. [`crate::store`] carries them out.
//!
//! Layout under a checkpoint location:
//!
//! ```text
//! data/<id>/<blob>.safetensors   tensors of one checkpoint (id: a fresh UUID per commit)
//! data/<id>/manifest.json        each blob's size and sha256, and the training position
//! commits/<sequence>.json        the commit record: points at a manifest (with its sha256)
//! ```
//!
//! A commit writes its blobs, then its manifest, then creates its commit record with
//! create-if-absent on sequence `latest + 1`. Only that last write makes a checkpoint visible,
//! and create-if-absent fences on both local disk and S3: two writers cannot both create the
//! same sequence. A writer whose generation is older than the latest commit's refuses to commit,
//! and so does one of the same generation when the latest commit is another writer's (each
//! writer, a process, has its own id): of two chiefs that read the same latest commit, the
//! first to commit fences the other.

use std::collections::BTreeSet;

/// Prefix of commit records.
pub const COMMITS: &str = "commits";
/// Prefix of checkpoint data.
pub const DATA: &str = "data";
/// Manifest file name inside a checkpoint's data prefix.
pub const MANIFEST: &str = "manifest.json";

/// The commit record's name for `sequence` (zero-padded so names sort by sequence).
pub fn commit_name(sequence: u64) -> String {
    format!("{sequence:020}.json")
}

/// The sequence of a commit record's file name, if it is one.
pub fn parse_commit_name(name: &str) -> Option<u64> {
    let digits = name.strip_suffix(".json")?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// A writer that may not commit: the newest commit is of a newer generation, or of the same
/// generation by another writer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "commit refused: commit {sequence} was made by generation {found} (writer {found_writer:x}) and this writer is \
     generation {mine} (writer {mine_writer:x}); {}",
    if found > mine { "a newer chief has taken over" } else { "another chief of the same generation committed first" }
)]
pub struct Fenced {
    /// The newest commit's sequence.
    pub sequence: u64,
    /// Its generation.
    pub found: u64,
    /// Its writer.
    pub found_writer: u64,
    /// The writer's generation.
    pub mine: u64,
    /// The writer.
    pub mine_writer: u64,
}

/// The newest commit, as fencing needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Latest {
    /// Its sequence.
    pub sequence: u64,
    /// Its writer's generation.
    pub generation: u64,
    /// Its writer.
    pub writer: u64,
}

/// The sequence that writer `writer` of `generation` creates next, given the newest commit.
pub fn next_sequence(latest: Option<Latest>, generation: u64, writer: u64) -> Result<u64, Fenced> {
    match latest {
        None => Ok(1),
        Some(l) if l.generation > generation || (l.generation == generation && l.writer != writer) => Err(Fenced {
            sequence: l.sequence,
            found: l.generation,
            found_writer: l.writer,
            mine: generation,
            mine_writer: writer,
        }),
        Some(l) => Ok(l.sequence + 1),
    }
}

/// Commits to delete so that the newest `keep` remain (oldest first). `keep` of 0 keeps all.
pub fn retention(sequences: &BTreeSet<u64>, keep: usize) -> Vec<u64> {
    if keep == 0 || sequences.len() <= keep {
        return Vec::new();
    }
    sequences.iter().copied().take(sequences.len() - keep).collect()
}

/// Data ids that no commit record references and that are not being written: blobs of commits
/// that never completed, or whose records retention removed.
pub fn garbage(ids: &BTreeSet<String>, referenced: &BTreeSet<String>, in_flight: Option<&str>) -> Vec<String> {
    ids.iter().filter(|id| !referenced.contains(*id) && Some(id.as_str()) != in_flight).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn names_sort_by_sequence() {
        assert_eq!(commit_name(7), "00000000000000000007.json");
        assert_eq!(parse_commit_name(&commit_name(u64::MAX)), Some(u64::MAX));
        assert_eq!(parse_commit_name("7.json"), None);
        assert_eq!(parse_commit_name("0000000000000000000x.json"), None);
        assert!(commit_name(9) < commit_name(10));
    }

    #[test]
    fn fencing() {
        let latest = |sequence, generation, writer| Some(Latest { sequence, generation, writer });
        assert_eq!(next_sequence(None, 1, 7), Ok(1));
        assert_eq!(next_sequence(latest(4, 2, 7), 2, 7), Ok(5), "the same writer goes on");
        assert_eq!(next_sequence(latest(4, 1, 9), 2, 7), Ok(5), "a newer generation takes over");
        let err = next_sequence(latest(4, 3, 9), 2, 7).unwrap_err();
        assert_eq!(
            err.to_string(),
            "commit refused: commit 4 was made by generation 3 (writer 9) and this writer is generation 2 (writer 7); \
             a newer chief has taken over"
        );
        // Two chiefs restored from the same commit share a generation: the first to commit wins.
        let err = next_sequence(latest(5, 3, 0xa), 3, 0xb).unwrap_err();
        assert_eq!(
            err.to_string(),
            "commit refused: commit 5 was made by generation 3 (writer a) and this writer is generation 3 (writer b); \
             another chief of the same generation committed first"
        );
    }

    #[test]
    fn garbage_spares_referenced_and_in_flight() {
        let ids: BTreeSet<String> = ["a", "b", "c", "d"].map(String::from).into();
        let referenced: BTreeSet<String> = ["b"].map(String::from).into();
        assert_eq!(garbage(&ids, &referenced, Some("d")), ["a", "c"]);
    }

    proptest! {
        #[test]
        fn retention_keeps_the_newest(seqs in proptest::collection::btree_set(0u64..1000, 0..30), keep in 0usize..10) {
            let doomed = retention(&seqs, keep);
            let kept: BTreeSet<u64> = seqs.iter().copied().filter(|s| !doomed.contains(s)).collect();
            if keep == 0 {
                prop_assert!(doomed.is_empty());
            } else {
                prop_assert_eq!(kept.len(), seqs.len().min(keep));
                prop_assert!(doomed.iter().all(|d| kept.iter().all(|k| d < k)));
            }
        }
    }
}
