//! The cluster's timeouts, one hierarchy: a member beats every heartbeat interval; one silent
//! for the heartbeat deadline has failed; a socket with no bytes for the collective timeout is
//! an error even if nothing else noticed (a backstop); a missing member is waited for until the
//! rejoin deadline, long enough for a node to reboot. Each must be larger than the one before,
//! which [`Timeouts::check`] enforces at start-up. The ones the user did not set are derived
//! from the ones they did ([`Given::derive`]), so only two flags set by hand can contradict.

use std::time::Duration;

use super::coordinator::rules::Options;

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
    /// How long a known-gone member is waited for before a generation forms without it (its
    /// slots spread over those present); 0, the default: not at all.
    pub(crate) replace_after: Duration,
    /// How long a read of the data waits for a failing source.
    pub(crate) data: Duration,
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
            replace_after: Duration::ZERO,
            data: Duration::from_secs(60),
            min_workers: None,
        }
    }
}

/// The timeouts the user set (`None`: not given).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Given {
    /// `--rendezvous-timeout`.
    pub(crate) rendezvous: Option<Duration>,
    /// `--heartbeat-interval`.
    pub(crate) heartbeat_interval: Option<Duration>,
    /// `--heartbeat-deadline`.
    pub(crate) heartbeat_deadline: Option<Duration>,
    /// `--collective-timeout`.
    pub(crate) collective: Option<Duration>,
    /// `--rejoin-deadline`.
    pub(crate) rejoin: Option<Duration>,
    /// `--replace-after`.
    pub(crate) replace_after: Option<Duration>,
    /// `--data-timeout`.
    pub(crate) data: Option<Duration>,
}

impl Given {
    /// Every timeout: the given ones, and the others from their defaults, moved only as far as
    /// the given ones require for the hierarchy to hold (pure; the result is then checked, so
    /// that two given ones that contradict each other are refused naming both).
    pub(crate) fn derive(&self) -> Timeouts {
        let d = Timeouts::default();
        // The collective timeout's bound from above, when one is given: it bounds the deadline.
        let cap = self.collective.or(self.rejoin.map(|r| r / 2));
        let deadline = self.heartbeat_deadline.unwrap_or_else(|| {
            let at_least = self.heartbeat_interval.map_or(d.heartbeat_deadline, |i| d.heartbeat_deadline.max(i * 15));
            cap.map_or(at_least, |c| at_least.min(c / 3))
        });
        let interval = self.heartbeat_interval.unwrap_or(d.heartbeat_interval.min(deadline / 5));
        let collective = self.collective.unwrap_or_else(|| {
            let at_least = d.collective.max(deadline * 4).max(self.data.map_or(Duration::ZERO, |t| t * 2));
            self.rejoin.map_or(at_least, |r| at_least.min(r / 2))
        });
        let replace_after = self.replace_after.unwrap_or(d.replace_after);
        let rejoin = self.rejoin.unwrap_or_else(|| d.rejoin.max(collective * 2).max(replace_after * 2));
        Timeouts {
            rendezvous: self.rendezvous.unwrap_or(d.rendezvous),
            heartbeat_interval: interval,
            heartbeat_deadline: deadline,
            collective,
            rejoin,
            replace_after,
            data: self.data.unwrap_or_else(|| d.data.min(collective / 2)),
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
        if self.replace_after >= self.rejoin {
            return Err(TimeoutError::ReplaceAfter { replace_after: self.replace_after, rejoin: self.rejoin });
        }
        if self.data >= self.collective {
            return Err(TimeoutError::Data { data: self.data, collective: self.collective });
        }
        if self.heartbeat_deadline < self.heartbeat_interval * 3 {
            return Err(TimeoutError::FewBeats {
                heartbeat_deadline: self.heartbeat_deadline,
                heartbeat_interval: self.heartbeat_interval,
            });
        }
        Ok(())
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
    /// `--replace-after` past the rejoin deadline.
    #[error(
        "--replace-after {} must be less than --rejoin-deadline {} (a lost worker is waited for before the others go \
         on without it, and they give up only later)",
        seconds(*replace_after), seconds(*rejoin)
    )]
    ReplaceAfter {
        /// `--replace-after`.
        replace_after: Duration,
        /// `--rejoin-deadline`.
        rejoin: Duration,
    },
    /// A data wait as long as the collective timeout.
    #[error(
        "--data-timeout {} must be less than --collective-timeout {}: a worker waiting for its data must give up \
         before its peers waiting in a collective do",
        seconds(*data), seconds(*collective)
    )]
    Data {
        /// `--data-timeout`.
        data: Duration,
        /// `--collective-timeout`.
        collective: Duration,
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
            "--replace-after 700s must be less than --rejoin-deadline 600s (a lost worker is waited for before the \
             others go on without it, and they give up only later)"
        );
        let t = Timeouts { data: Duration::from_secs(120), ..Timeouts::default() };
        assert_eq!(
            t.check().unwrap_err().to_string(),
            "--data-timeout 120s must be less than --collective-timeout 120s: a worker waiting for its data must give \
             up before its peers waiting in a collective do"
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
    }

    fn secs(s: f64) -> Option<Duration> {
        Some(Duration::from_secs_f64(s))
    }

    #[test]
    fn timeouts_not_given_follow_the_given_ones() {
        assert_eq!(Given::default().derive(), Timeouts::default());
        // --collective-timeout 10 alone: the data wait goes under it, the deadline stays.
        let t = Given { collective: secs(10.0), ..Given::default() }.derive();
        assert_eq!(
            (t.data, t.heartbeat_deadline, t.rejoin),
            (secs(5.0).unwrap(), secs(1.5).unwrap(), secs(600.0).unwrap())
        );
        assert_eq!(t.check(), Ok(()));
        // A short collective timeout pulls the heartbeat deadline under it, and a long interval
        // pushes the deadline above it.
        let t = Given { collective: secs(3.0), ..Given::default() }.derive();
        assert_eq!((t.heartbeat_deadline, t.data), (secs(1.0).unwrap(), secs(1.5).unwrap()));
        let t = Given { heartbeat_interval: secs(1.0), ..Given::default() }.derive();
        assert_eq!(t.heartbeat_deadline, secs(15.0).unwrap());
        let t = Given { heartbeat_deadline: secs(0.3), ..Given::default() }.derive();
        assert_eq!(t.heartbeat_interval, secs(0.06).unwrap());
        let t = Given { heartbeat_deadline: secs(60.0), ..Given::default() }.derive();
        assert_eq!(t.collective, secs(240.0).unwrap());
        let t = Given { data: secs(300.0), ..Given::default() }.derive();
        assert_eq!((t.collective, t.rejoin), (secs(600.0).unwrap(), secs(1200.0).unwrap()));
        let t = Given { rejoin: secs(30.0), ..Given::default() }.derive();
        assert_eq!((t.collective, t.data), (secs(15.0).unwrap(), secs(7.5).unwrap()));
        let t = Given { replace_after: secs(900.0), ..Given::default() }.derive();
        assert_eq!(t.rejoin, secs(1800.0).unwrap());
        // Two given ones that contradict each other are refused, naming both.
        let t = Given { collective: secs(10.0), data: secs(20.0), ..Given::default() }.derive();
        assert_eq!(t.check(), Err(TimeoutError::Data { data: secs(20.0).unwrap(), collective: secs(10.0).unwrap() }));
    }

    proptest::proptest! {
        /// Any single flag given alone, at any value in its range, makes a hierarchy that holds.
        #[test]
        fn any_one_flag_alone_is_accepted(flag in 0usize..7, value in 0.05f64..5000.0) {
            let mut g = Given::default();
            let v = secs(value);
            match flag {
                0 => g.rendezvous = v,
                1 => g.heartbeat_interval = v,
                2 => g.heartbeat_deadline = v,
                3 => g.collective = v,
                4 => g.rejoin = v,
                5 => g.replace_after = v,
                _ => g.data = v,
            }
            proptest::prop_assert_eq!(g.derive().check(), Ok(()), "{:?}", g);
        }
    }
}
