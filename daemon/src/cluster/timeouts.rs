//! The cluster's timeouts, one hierarchy: a member beats every heartbeat interval; one silent
//! for the heartbeat deadline has failed; a socket with no bytes for the collective timeout is
//! an error even if nothing else noticed (a backstop); a missing member is waited for until the
//! rejoin deadline, long enough for a node to reboot. Each must be larger than the one before,
//! which [`Timeouts::check`] enforces at start-up.

use std::time::Duration;

use super::membership::Options;

/// Every deadline of the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Timeouts {
    /// How long the first formation may wait for every member.
    pub(crate) rendezvous: Duration,
    /// Between two heartbeats.
    pub(crate) heartbeat_interval: Duration,
    /// A member (or the chief) silent for longer has failed.
    pub(crate) heartbeat_deadline: Duration,
    /// A socket with no progress for longer fails its collective.
    pub(crate) collective: Duration,
    /// How long survivors wait for a missing member before giving up.
    pub(crate) rejoin: Duration,
    /// How long a member may be missing before a generation forms without it (its slots spread
    /// over those present).
    pub(crate) replace_after: Duration,
    /// The fewest workers a generation forms with; `None`: a majority of TF_CONFIG's.
    pub(crate) min_workers: Option<usize>,
}

impl Default for Timeouts {
    fn default() -> Timeouts {
        Timeouts {
            rendezvous: Duration::from_secs(300),
            heartbeat_interval: Duration::from_millis(100),
            heartbeat_deadline: Duration::from_millis(1500),
            collective: Duration::from_secs(120),
            rejoin: Duration::from_secs(600),
            replace_after: Duration::from_secs(300),
            min_workers: None,
        }
    }
}

impl Timeouts {
    /// Whether the hierarchy holds: interval < deadline < collective < rejoin, with the flag
    /// names in the error.
    pub(crate) fn check(&self) -> Result<(), TimeoutError> {
        let chain = [
            ("--heartbeat-interval", self.heartbeat_interval),
            ("--heartbeat-deadline", self.heartbeat_deadline),
            ("--collective-timeout", self.collective),
            ("--rejoin-deadline", self.rejoin),
        ];
        for pair in chain.windows(2) {
            let (shorter, longer) = (pair[0], pair[1]);
            if shorter.1 >= longer.1 {
                return Err(TimeoutError::Order { shorter, longer });
            }
        }
        if !(self.heartbeat_deadline < self.replace_after && self.replace_after < self.rejoin) {
            return Err(TimeoutError::ReplaceAfter {
                replace_after: self.replace_after,
                heartbeat_deadline: self.heartbeat_deadline,
                rejoin: self.rejoin,
            });
        }
        if self.heartbeat_deadline < self.heartbeat_interval * 3 {
            return Err(TimeoutError::FewBeats {
                heartbeat_deadline: self.heartbeat_deadline,
                heartbeat_interval: self.heartbeat_interval,
            });
        }
        Ok(())
    }

    /// `--replace-after` when not given: 300 s (a systemd restart takes seconds, a cloud VM's
    /// reboot one to three minutes: both come back first), or half the rejoin deadline when that
    /// is shorter, so that the hierarchy holds whatever deadlines were given.
    pub(crate) fn default_replace_after(heartbeat_deadline: Duration, rejoin: Duration) -> Duration {
        let half = rejoin / 2;
        if half >= Duration::from_secs(300) {
            Duration::from_secs(300)
        } else if half > heartbeat_deadline {
            half
        } else {
            (heartbeat_deadline + rejoin) / 2
        }
    }

    /// The fewest workers of `world` a generation forms with: `--min-workers`, else a majority.
    pub(crate) fn min_workers(&self, world: usize) -> usize {
        self.min_workers.unwrap_or(world / 2 + 1)
    }

    /// Whether `--min-workers` fits a cluster of `world` workers: more than half of them (two
    /// sides of a partition can never both train) and at most all; exactly half only when
    /// `even_split` (`--allow-even-split`) accepts that two halves may then both train.
    pub(crate) fn check_min_workers(&self, world: usize, even_split: bool) -> Result<(), TimeoutError> {
        match self.min_workers {
            Some(m) if m == 0 || m > world || m * 2 < world || (m * 2 == world && !even_split) => {
                Err(TimeoutError::MinWorkers { min_workers: m, world })
            }
            _ => Ok(()),
        }
    }

    /// The deadlines the membership decisions use, in a cluster of `world` workers.
    pub(crate) fn options(&self, world: usize) -> Options {
        Options {
            heartbeat_deadline: self.heartbeat_deadline,
            rendezvous_timeout: self.rendezvous,
            rejoin_deadline: self.rejoin,
            replace_after: self.replace_after,
            min_workers: self.min_workers(world),
        }
    }
}

/// Deadlines that do not make one hierarchy, naming the flags.
#[derive(Clone, Copy, Debug, PartialEq, thiserror::Error)]
pub(crate) enum TimeoutError {
    /// Two deadlines of the chain in the wrong order.
    #[error(
        "{} {} must be less than {} {} (the timeouts must grow: heartbeat interval < heartbeat deadline < \
         collective timeout < rejoin deadline)",
        shorter.0, seconds(shorter.1), longer.0, seconds(longer.1)
    )]
    Order {
        /// The flag that must be shorter, and its value.
        shorter: (&'static str, Duration),
        /// The flag that must be longer, and its value.
        longer: (&'static str, Duration),
    },
    /// `--replace-after` outside its bounds.
    #[error(
        "--replace-after {} must be more than --heartbeat-deadline {} and less than --rejoin-deadline {} (a member \
         is replaced after it failed, and before the survivors give up)",
        seconds(*replace_after), seconds(*heartbeat_deadline), seconds(*rejoin)
    )]
    ReplaceAfter {
        /// `--replace-after`.
        replace_after: Duration,
        /// `--heartbeat-deadline`.
        heartbeat_deadline: Duration,
        /// `--rejoin-deadline`.
        rejoin: Duration,
    },
    /// A heartbeat deadline shorter than three beats.
    #[error(
        "--heartbeat-deadline {} must be at least 3 heartbeat intervals ({}): one late beat is not a failure",
        seconds(*heartbeat_deadline), seconds(*heartbeat_interval * 3)
    )]
    FewBeats {
        /// `--heartbeat-deadline`.
        heartbeat_deadline: Duration,
        /// `--heartbeat-interval`.
        heartbeat_interval: Duration,
    },
    /// `--min-workers` that lets two sides of a partition train.
    #[error(
        "--min-workers {min_workers} must be more than half of TF_CONFIG's {world} training tasks and at most {world} \
         (so that two sides of a partition can never both train): {}..={world}{}",
        world / 2 + 1,
        if min_workers * 2 == *world {
            "; --allow-even-split accepts exactly half, and the risk that two halves both train"
        } else {
            ""
        }
    )]
    MinWorkers {
        /// `--min-workers`.
        min_workers: usize,
        /// TF_CONFIG's training tasks.
        world: usize,
    },
}

/// `1.5s`, `0.1s`, `600s` (to the millisecond).
fn seconds(d: Duration) -> String {
    format!("{}s", d.as_millis() as f64 / 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_hold_and_an_inversion_is_named() {
        assert_eq!(Timeouts::default().check(), Ok(()));
        let t = Timeouts { collective: Duration::from_secs(1), ..Timeouts::default() };
        assert_eq!(
            t.check().unwrap_err().to_string(),
            "--heartbeat-deadline 1.5s must be less than --collective-timeout 1s (the timeouts must grow: heartbeat \
             interval < heartbeat deadline < collective timeout < rejoin deadline)"
        );
        let t = Timeouts { heartbeat_deadline: Duration::from_millis(250), ..Timeouts::default() };
        assert_eq!(
            t.check().unwrap_err().to_string(),
            "--heartbeat-deadline 0.25s must be at least 3 heartbeat intervals (0.3s): one late beat \
             is not a failure"
        );
        let t = Timeouts { replace_after: Duration::from_secs(700), ..Timeouts::default() };
        assert_eq!(
            t.check().unwrap_err().to_string(),
            "--replace-after 700s must be more than --heartbeat-deadline 1.5s and less than --rejoin-deadline 600s (a \
             member is replaced after it failed, and before the survivors give up)"
        );
    }

    #[test]
    fn min_workers_is_a_majority_unless_told_and_then_must_be_one() {
        let t = Timeouts::default();
        assert_eq!((t.min_workers(2), t.min_workers(3), t.min_workers(4), t.min_workers(5)), (2, 2, 3, 3));
        assert_eq!(Timeouts { min_workers: Some(2), ..t }.check_min_workers(3, false), Ok(()));
        assert_eq!(
            Timeouts { min_workers: Some(2), ..t }.check_min_workers(4, false).unwrap_err().to_string(),
            "--min-workers 2 must be more than half of TF_CONFIG's 4 training tasks and at most 4 (so that two sides \
             of a partition can never both train): 3..=4; --allow-even-split accepts exactly half, and the risk that \
             two halves both train"
        );
        assert_eq!(Timeouts { min_workers: Some(2), ..t }.check_min_workers(4, true), Ok(()));
        assert!(Timeouts { min_workers: Some(1), ..t }.check_min_workers(4, true).is_err());
        assert!(Timeouts { min_workers: Some(4), ..t }.check_min_workers(3, false).is_err());
        let secs = Duration::from_secs_f64;
        assert_eq!(Timeouts::default_replace_after(secs(1.5), secs(600.0)), secs(300.0));
        assert_eq!(Timeouts::default_replace_after(secs(1.5), secs(60.0)), secs(30.0));
        assert_eq!(Timeouts::default_replace_after(secs(1.5), secs(2.5)), secs(2.0));
    }
}
