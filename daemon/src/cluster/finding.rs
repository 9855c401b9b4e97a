//! What a member found at a comparison of the replicas and told every peer before acting on it
//! (docs/fault-tolerance.md, "Replicas compared": a mismatch found is never forgotten). The cluster
//! keeps it as it keeps a state report, as opaque facts: a generation, a step, names and a text.
//! Deciding what a finding means for a state is the training loop's.

use std::sync::Mutex;

/// How many findings a member keeps until its training thread takes them.
const KEPT: usize = 16;

/// A peer's finding: in `generation`, the comparison of global step `step` found the states of
/// `odd` different (`why`, as the finder said it), and the run goes back before that step, or,
/// `in_place`, the odd members took a right member's parameters and no step is lost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Finding {
    pub(crate) generation: u64,
    /// The finder's name.
    pub(crate) finder: String,
    pub(crate) step: u64,
    pub(crate) odd: Vec<String>,
    pub(crate) why: String,
    pub(crate) in_place: bool,
}

/// The findings told to this member, until its training thread takes them (the newest [`KEPT`]).
#[derive(Default)]
pub(crate) struct Findings(Mutex<Vec<Finding>>);

impl Findings {
    /// Keeps `finding` (a finder that tells twice is kept once).
    pub(crate) fn keep(&self, finding: Finding) {
        let mut kept = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !kept.contains(&finding) {
            kept.push(finding);
        }
        let over = kept.len().saturating_sub(KEPT);
        kept.drain(..over);
    }

    /// The findings told in `generation`, taken; those of older generations are dropped (their
    /// formations are past).
    pub(crate) fn take(&self, generation: u64) -> Vec<Finding> {
        let mut kept = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (taken, newer): (Vec<Finding>, Vec<Finding>) =
            kept.drain(..).filter(|f| f.generation >= generation).partition(|f| f.generation == generation);
        *kept = newer;
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(generation: u64, step: u64) -> Finding {
        let odd = vec!["worker 2".to_string()];
        Finding { generation, finder: "worker 2".into(), step, odd, why: format!("step {step}"), in_place: false }
    }

    #[test]
    fn a_generations_findings_are_taken_once_and_older_ones_dropped() {
        let findings = Findings::default();
        findings.keep(found(3, 40));
        findings.keep(found(3, 40));
        findings.keep(found(2, 25));
        findings.keep(found(4, 50));
        assert_eq!(findings.take(3), vec![found(3, 40)]);
        assert_eq!(findings.take(3), vec![]);
        assert_eq!(findings.take(2), vec![], "dropped by the take of a newer generation");
        assert_eq!(findings.take(4), vec![found(4, 50)]);
    }

    #[test]
    fn only_the_newest_are_kept() {
        let findings = Findings::default();
        (0..40).for_each(|s| findings.keep(found(1, s)));
        let kept = findings.take(1);
        assert_eq!(kept.len(), KEPT);
        assert_eq!(kept[0].step, 40 - KEPT as u64);
    }
}
