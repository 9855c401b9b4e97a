//! The daemon's exit statuses, and which of them are final: a supervisor (systemd's
//! `RestartPreventExitStatus=0 3`, `trainerd local`, the chaos tests) restarts a worker after any
//! other.

/// How a `trainerd` process ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// The run finished, or the worker was stopped (its state committed or held by the cluster).
    Done,
    /// An error: restarting may help (a peer missing past the deadline, storage down at start).
    Failed,
    /// The run finished but its last commit failed: restarting cannot help, the other workers
    /// are done.
    FinishedUncommitted,
    /// The model failed in a step (an exception in a Python model's forward pass, a panic in a
    /// plugin's loss): every worker computes the same step from the same data and fails the same
    /// way, so a restart cannot help. Nothing half-done was committed.
    ModelFailed,
    /// `trainerd local` was interrupted (Ctrl-C, SIGTERM) and stopped its workers.
    Interrupted,
}

impl Exit {
    /// The statuses after which a supervisor does not restart a worker.
    pub const FINAL: [Exit; 3] = [Exit::Done, Exit::FinishedUncommitted, Exit::ModelFailed];

    /// The process exit status.
    pub fn code(self) -> i32 {
        match self {
            Exit::Done => 0,
            Exit::Failed => 1,
            Exit::FinishedUncommitted => 3,
            Exit::ModelFailed => 4,
            Exit::Interrupted => 130,
        }
    }

    /// Whether a worker that exited with `code` (not killed by a signal) is done for good.
    pub fn is_final(code: i32) -> bool {
        Exit::FINAL.iter().any(|e| e.code() == code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_systemd_unit_prevents_restarts_after_exactly_the_final_statuses() {
        let unit = include_str!("../../systemd/trainerd@.service");
        let line = unit.lines().find(|l| l.starts_with("RestartPreventExitStatus=")).expect("the unit sets it");
        let listed: Vec<i32> =
            line["RestartPreventExitStatus=".len()..].split(' ').map(|c| c.parse().unwrap()).collect();
        assert_eq!(listed, Exit::FINAL.map(Exit::code));
        assert!(Exit::is_final(0) && Exit::is_final(3) && Exit::is_final(4));
        assert!(!Exit::is_final(1) && !Exit::is_final(137));
    }
}
