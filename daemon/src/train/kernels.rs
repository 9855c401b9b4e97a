//! One CPU kernel set per run (docs/fault-tolerance.md, "One kernel set per run"). The run's
//! capability is pinned at its first formation, the highest every member runs, and kept in the
//! state's position, so that every commit records it and every receiver of a state learns it.
//! A process whose libtorch runs higher kernels starts itself again with the run's; one that
//! runs lower ones is refused, naming both.

use super::error::TrainError;
use super::report::Reporter;
use crate::state::Position;
use crate::sys::cpu::{self, Capability};

/// What a process does about the run's capability.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pin {
    /// Its kernels are the run's.
    Keep,
    /// Its kernels are higher: start again with the run's.
    Restart(Capability),
    /// Its kernels are lower: it cannot compute the run's bits.
    Refuse(Capability),
}

/// What a process running `mine` does in a run of `run`.
pub(crate) fn decide(run: Capability, mine: Capability) -> Pin {
    match mine.cmp(&run) {
        std::cmp::Ordering::Equal => Pin::Keep,
        std::cmp::Ordering::Greater => Pin::Restart(run),
        std::cmp::Ordering::Less => Pin::Refuse(run),
    }
}

/// The run's capability: the one `recorded` in its state, else the lowest of the members'
/// (`codes`, [`Capability::code`]); `None` when a member's is unknown (another architecture's).
pub(crate) fn run_capability(recorded: Option<&str>, codes: &[u8]) -> Option<Capability> {
    if let Some(recorded) = recorded.and_then(Capability::parse) {
        return Some(recorded);
    }
    codes.iter().map(|&c| Capability::from_code(c)).collect::<Option<Vec<_>>>()?.into_iter().min()
}

/// Pins `position`'s capability to `run` (when not yet) and carries out what this process
/// (running `mine`) must do; `whose` names where the run's capability came from.
pub(crate) fn pin(
    position: &mut Position,
    (run, mine): (Capability, Capability),
    whose: &str,
    report: &mut Reporter<'_>,
) -> Result<(), TrainError> {
    position.cpu_capability.get_or_insert_with(|| run.name().to_string());
    match decide(run, mine) {
        Pin::Keep => Ok(()),
        Pin::Restart(run) => {
            report.line(&format!(
                "trainerd: {whose} computes with {} CPU kernels, this process with {}: starting it again with {}={}",
                run.name(),
                mine.name(),
                cpu::VARIABLE,
                run.variable()
            ));
            Err(cpu::restart_with(run, mine).into())
        }
        Pin::Refuse(run) => {
            let (mine_why, hint) = cpu::refusal(run);
            Err(TrainError::CpuCapability { whose: whose.to_string(), run, mine, mine_why, hint })
        }
    }
}

/// A restored commit's capability (`position`, from commit `whose`) against this process's.
pub(crate) fn restored(position: &mut Position, whose: &str, report: &mut Reporter<'_>) -> Result<(), TrainError> {
    let (Some(run), Some(mine)) = (position.cpu_capability.as_deref().and_then(Capability::parse), cpu::resolved()?)
    else {
        return Ok(());
    };
    pin(position, (run, mine), whose, report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Capability::*;

    #[test]
    fn higher_kernels_restart_lower_ones_are_refused() {
        assert_eq!(decide(Avx2, Avx2), Pin::Keep);
        assert_eq!(decide(Avx2, Avx512), Pin::Restart(Avx2));
        assert_eq!(decide(Avx2, Default), Pin::Refuse(Avx2));
    }

    #[test]
    fn the_run_keeps_its_recorded_kernels_else_takes_the_lowest_members() {
        let codes = [Avx512.code(), Default.code(), Avx2.code()];
        assert_eq!(run_capability(None, &codes), Some(Default));
        assert_eq!(run_capability(Some("AVX2"), &codes), Some(Avx2));
        // A member of another architecture: nothing is pinned.
        assert_eq!(run_capability(None, &[Avx2.code(), 0]), None);
    }
}
