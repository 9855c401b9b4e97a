//! What members said of their parts of a sharded commit, kept by the coordinator's process until
//! its training thread takes them (docs/fault-tolerance.md, "Sharded commits"). The cluster keeps
//! them as opaque facts: a generation, a data id, a rank, and a text (the parts' entries as JSON)
//! or why not. What a part is and what to commit is the training loop's.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// A member's word on its parts: the entries (JSON), or why it could not write them.
pub(crate) type Said = Result<String, String>;

/// The reports, by (generation, data id), then by rank.
#[derive(Default)]
pub(crate) struct Reports(Mutex<BTreeMap<(u64, String), BTreeMap<usize, Said>>>);

impl Reports {
    /// Keeps `rank`'s word on its parts of the commit `id` planned in `generation`; commits of
    /// older generations are dropped, and a late word on one ignored (theirs were abandoned as
    /// the generation ended).
    pub(crate) fn keep(&self, (generation, id): (u64, &str), rank: usize, said: Said) {
        let mut reports = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if reports.keys().any(|(g, _)| *g > generation) {
            return;
        }
        reports.retain(|(g, _), _| *g >= generation);
        reports.entry((generation, id.to_string())).or_default().insert(rank, said);
    }

    /// Every word on the commit `id` of `generation`, taken, once each of `ranks` has said;
    /// `None` before.
    pub(crate) fn take_when_all(
        &self,
        (generation, id): (u64, &str),
        ranks: &[usize],
    ) -> Option<BTreeMap<usize, Said>> {
        let mut reports = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let key = (generation, id.to_string());
        let all = reports.get(&key).is_some_and(|said| ranks.iter().all(|r| said.contains_key(r)));
        all.then(|| reports.remove(&key).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_commits_words_are_taken_once_every_member_said_and_older_generations_dropped() {
        let reports = Reports::default();
        reports.keep((3, "a"), 0, Ok("[0]".into()));
        assert_eq!(reports.take_when_all((3, "a"), &[0, 1]), None);
        reports.keep((3, "a"), 1, Err("no space".into()));
        let said = reports.take_when_all((3, "a"), &[0, 1]).unwrap();
        assert_eq!(said.get(&1), Some(&Err("no space".to_string())));
        assert_eq!(reports.take_when_all((3, "a"), &[0, 1]), None, "taken");
        reports.keep((3, "b"), 0, Ok("[]".into()));
        reports.keep((4, "c"), 0, Ok("[]".into()));
        assert_eq!(reports.take_when_all((3, "b"), &[0]), None, "dropped with its generation");
        reports.keep((3, "d"), 0, Ok("[]".into()));
        assert_eq!(reports.take_when_all((3, "d"), &[0]), None, "a late word on an older generation");
        assert!(reports.take_when_all((4, "c"), &[0]).is_some());
    }
}
