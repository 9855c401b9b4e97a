//! The commit protocol's decisions, as pure functions: no I/O, so every corner is a plain unit
//! test. [`crate::store`] carries them out.
//!
//! Layout under a checkpoint location:
//!
//! ```text
//! data/<id>/<blob>.safetensors   tensors of one checkpoint (id: g<generation>-w<writer>-<uuid>,
//!                                 generation and writer in 16 hex digits, a fresh UUID per commit)
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
//!
//! Collection (after each commit) never deletes data that a commit record names, readable or
//! not: while any record cannot be read, no data is deleted at all, and retention, which
//! removes the oldest records whatever their state, ends that. Of the data no record names it
//! deletes only what can never be published: the collector's own (but the commit in flight),
//! and the data of every writer the newest record fences (an older generation, or the same
//! generation and another writer). A newer writer's data, or the newest record's writer's when
//! that is not the collector, may be a commit in flight: it is spared until it is older than
//! the grace period, as object stores' lifecycle rules treat unfinished multipart uploads. So is
//! data whose id names no writer (written by trainerd before ids did).

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

/// Whether a lower or a higher [`Score`] is better.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Lower is better (losses).
    Min,
    /// Higher is better (accuracy).
    Max,
}

/// An epoch-end commit's value of the metric the run keeps the best commit by
/// (docs/best-checkpoint.md).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Score {
    /// The figure (`val_accuracy`, `val_loss`, ...).
    pub metric: String,
    /// Its value at that epoch's end.
    pub value: f64,
    /// Which way is better.
    pub mode: Mode,
}

impl Score {
    /// Whether this value is strictly better than `other`'s (a NaN never is, and nothing is worse
    /// than no value).
    pub fn beats(&self, other: Option<&Score>) -> bool {
        if self.value.is_nan() {
            return false;
        }
        match other {
            None => true,
            Some(o) if o.value.is_nan() => true,
            Some(o) => match self.mode {
                Mode::Min => self.value < o.value,
                Mode::Max => self.value > o.value,
            },
        }
    }
}

/// The best commit among `scores` (sequence -> the score of a readable record): of the records
/// scored by the metric and mode of the newest scored one, the best value, the oldest of equal
/// values; a NaN is never best.
pub fn best<'a>(scores: impl IntoIterator<Item = (u64, Option<&'a Score>)>) -> Option<u64> {
    let scored: Vec<(u64, &Score)> = scores.into_iter().filter_map(|(seq, s)| s.map(|s| (seq, s))).collect();
    let newest = scored.iter().max_by_key(|(seq, _)| *seq)?.1;
    let mut ordered: Vec<&(u64, &Score)> =
        scored.iter().filter(|(_, s)| s.metric == newest.metric && s.mode == newest.mode).collect();
    ordered.sort_by_key(|(seq, _)| *seq);
    let mut best: Option<&(u64, &Score)> = None;
    for candidate in ordered {
        if candidate.1.beats(best.map(|b| b.1)) {
            best = Some(candidate);
        }
    }
    best.map(|(seq, _)| *seq)
}

/// Commits to delete so that the newest `keep` remain, and the `best` (oldest first). `keep` of 0
/// keeps all.
pub fn retention(sequences: &BTreeSet<u64>, best: Option<u64>, keep: usize) -> Vec<u64> {
    if keep == 0 || sequences.len() <= keep {
        return Vec::new();
    }
    sequences.iter().copied().take(sequences.len() - keep).filter(|&seq| Some(seq) != best).collect()
}

/// The data id of a new commit by writer `writer` of `generation`; `unique` makes it fresh.
pub fn data_id(generation: u64, writer: u64, unique: &str) -> String {
    format!("g{generation:016x}-w{writer:016x}-{unique}")
}

/// The (generation, writer) a data id names, if it names one.
pub fn data_owner(id: &str) -> Option<(u64, u64)> {
    let rest = id.strip_prefix('g')?;
    let (generation, rest) = rest.split_at_checked(16)?;
    let writer = rest.strip_prefix("-w")?.get(..16)?;
    Some((u64::from_str_radix(generation, 16).ok()?, u64::from_str_radix(writer, 16).ok()?))
}

/// Data present under a location: its id, and when its newest object was written (ms since
/// the Unix epoch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataIds {
    /// Newest write per id.
    pub newest_ms: std::collections::BTreeMap<String, u64>,
}

/// Who collects, and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Collector<'a> {
    /// The collector's (generation, writer).
    pub me: (u64, u64),
    /// The data id of its commit in flight, if any.
    pub in_flight: Option<&'a str>,
    /// The newest commit record.
    pub newest: Option<Latest>,
    /// Now (ms since the Unix epoch).
    pub now_ms: u64,
    /// Unnamed data younger than this is spared (ms).
    pub grace_ms: u64,
}

/// Data ids to delete, by the rule in the module docs. `referenced` holds the ids that
/// readable records name; the caller deletes nothing while any record is unreadable.
pub fn garbage(data: &DataIds, referenced: &BTreeSet<String>, c: Collector<'_>) -> Vec<String> {
    let unpublishable = |id: &str| match data_owner(id) {
        Some(owner) if owner == c.me => true,
        Some((generation, writer)) => {
            c.newest.is_some_and(|l| generation < l.generation || (generation == l.generation && writer != l.writer))
        }
        None => false,
    };
    data.newest_ms
        .iter()
        .filter(|(id, _)| !referenced.contains(*id) && Some(id.as_str()) != c.in_flight)
        .filter(|(id, &newest)| unpublishable(id) || c.now_ms.saturating_sub(newest) >= c.grace_ms)
        .map(|(id, _)| id.clone())
        .collect()
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
    fn data_ids_name_their_writer() {
        let id = data_id(3, 0xabc, "7d0c");
        assert_eq!(id, "g0000000000000003-w0000000000000abc-7d0c");
        assert_eq!(data_owner(&id), Some((3, 0xabc)));
        assert_eq!(data_owner("7d0c5c3e-uuid-of-an-older-trainerd"), None);
        assert_eq!(data_owner("g0000000000000003-x"), None);
    }

    #[test]
    fn garbage_is_only_what_can_never_be_published() {
        const HOUR: u64 = 3_600_000;
        let now = 100 * HOUR;
        let id = |g, w, u: &str| data_id(g, w, u);
        let data = DataIds {
            newest_ms: [
                (id(2, 0xa, "mine-referenced"), now),
                (id(2, 0xa, "mine-in-flight"), now),
                (id(2, 0xa, "mine-failed"), now),
                (id(1, 0xb, "older-generation"), now),
                (id(2, 0xc, "same-generation-other-writer"), now),
                (id(3, 0xd, "newer-writer-in-flight"), now),
                (id(3, 0xd, "newer-writer-long-gone"), now - 2 * HOUR),
                ("legacy-uuid-fresh".to_string(), now - HOUR / 2),
                ("legacy-uuid-old".to_string(), now - 2 * HOUR),
            ]
            .into_iter()
            .collect(),
        };
        let referenced: BTreeSet<String> = [id(2, 0xa, "mine-referenced")].into();
        let in_flight = id(2, 0xa, "mine-in-flight");
        let c = Collector {
            me: (2, 0xa),
            in_flight: Some(&in_flight),
            newest: Some(Latest { sequence: 9, generation: 2, writer: 0xa }),
            now_ms: now,
            grace_ms: HOUR,
        };
        let doomed = garbage(&data, &referenced, c);
        assert_eq!(
            doomed,
            [
                id(1, 0xb, "older-generation"),
                id(2, 0xa, "mine-failed"),
                id(2, 0xc, "same-generation-other-writer"),
                id(3, 0xd, "newer-writer-long-gone"),
                "legacy-uuid-old".to_string(),
            ]
        );
        // A collector that is not the newest record's writer spares that writer's data: it
        // may be committing right now.
        let other = Collector { me: (1, 0xb), ..c };
        assert!(!garbage(&data, &referenced, other).contains(&id(2, 0xa, "mine-failed")));
    }

    fn score(metric: &str, value: f64, mode: Mode) -> Score {
        Score { metric: metric.into(), value, mode }
    }

    #[test]
    fn the_best_is_the_best_value_of_the_newest_metric_and_the_oldest_of_equals() {
        let acc = |v| Some(score("val_accuracy", v, Mode::Max));
        let loss = |v| Some(score("val_loss", v, Mode::Min));
        let pick = |scores: Vec<(u64, Option<Score>)>| best(scores.iter().map(|(seq, s)| (*seq, s.as_ref())));
        assert_eq!(pick(vec![(1, acc(0.8)), (2, None), (3, acc(0.85)), (4, acc(0.83))]), Some(3));
        assert_eq!(pick(vec![(1, acc(0.8)), (2, acc(0.8))]), Some(1), "an equal value does not replace the best");
        assert_eq!(pick(vec![(1, loss(0.4)), (2, loss(0.3)), (3, loss(0.5))]), Some(2), "min mode");
        assert_eq!(pick(vec![(1, acc(0.9)), (2, loss(0.5)), (3, loss(0.6))]), Some(2), "the newest metric decides");
        assert_eq!(pick(vec![(1, acc(f64::NAN)), (2, acc(0.1))]), Some(2), "NaN is never best");
        assert_eq!(pick(vec![(1, acc(f64::NAN))]), None);
        assert_eq!(pick(vec![(1, None), (2, None)]), None, "unscored commits have no best");
        let min_acc = Some(score("val_accuracy", 0.5, Mode::Min));
        assert_eq!(pick(vec![(1, acc(0.9)), (2, min_acc)]), Some(2), "another mode is another metric");
    }

    #[test]
    fn retention_keeps_the_best_beside_the_newest() {
        let seqs: BTreeSet<u64> = (1..=6).collect();
        assert_eq!(retention(&seqs, Some(2), 2), [1, 3, 4]);
        assert_eq!(retention(&seqs, Some(6), 2), [1, 2, 3, 4], "a best among the newest costs nothing");
        assert_eq!(retention(&seqs, Some(2), 0), Vec::<u64>::new());
    }

    proptest! {
        #[test]
        fn retention_never_deletes_the_best(
            seqs in proptest::collection::btree_set(0u64..1000, 1..30),
            keep in 1usize..10,
            pick in 0usize..30,
        ) {
            let best = seqs.iter().copied().nth(pick % seqs.len());
            let doomed = retention(&seqs, best, keep);
            prop_assert!(!doomed.contains(&best.unwrap()));
            let kept = seqs.len() - doomed.len();
            prop_assert!(kept == seqs.len().min(keep) || kept == keep + 1);
        }

        #[test]
        fn retention_keeps_the_newest(seqs in proptest::collection::btree_set(0u64..1000, 0..30), keep in 0usize..10) {
            let doomed = retention(&seqs, None, keep);
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
