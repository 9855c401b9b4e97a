//! The cluster's timeouts, one hierarchy: a member beats every heartbeat interval; one silent
//! for the heartbeat deadline has failed; a socket with no bytes for the collective timeout is
//! an error even if nothing else noticed (a backstop); a missing member is waited for until the
//! rejoin deadline, long enough for a node to reboot. Each must be larger than the one before,
//! which [`Timeouts::check`] enforces at start-up.

use std::time::Duration;

use super::membership::Options;

/// Every deadline of the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// How long the first formation may wait for every member.
    pub rendezvous: Duration,
    /// Between two heartbeats.
    pub heartbeat_interval: Duration,
    /// A member (or the chief) silent for longer has failed.
    pub heartbeat_deadline: Duration,
    /// A socket with no progress for longer fails its collective.
    pub collective: Duration,
    /// How long survivors wait for a missing member before giving up.
    pub rejoin: Duration,
}

impl Default for Timeouts {
    fn default() -> Timeouts {
        Timeouts {
            rendezvous: Duration::from_secs(300),
            heartbeat_interval: Duration::from_millis(100),
            heartbeat_deadline: Duration::from_millis(1500),
            collective: Duration::from_secs(120),
            rejoin: Duration::from_secs(600),
        }
    }
}

impl Timeouts {
    /// Whether the hierarchy holds: interval < deadline < collective < rejoin, with the flag
    /// names in the error.
    pub fn check(&self) -> Result<(), String> {
        let chain = [
            ("--heartbeat-interval", self.heartbeat_interval),
            ("--heartbeat-deadline", self.heartbeat_deadline),
            ("--collective-timeout", self.collective),
            ("--rejoin-deadline", self.rejoin),
        ];
        for pair in chain.windows(2) {
            let ((a, x), (b, y)) = (pair[0], pair[1]);
            if x >= y {
                return Err(format!(
                    "{a} {} must be less than {b} {} (the timeouts must grow: heartbeat interval < heartbeat \
                     deadline < collective timeout < rejoin deadline)",
                    seconds(x),
                    seconds(y)
                ));
            }
        }
        if self.heartbeat_deadline < self.heartbeat_interval * 3 {
            return Err(format!(
                "--heartbeat-deadline {} must be at least 3 heartbeat intervals ({}): one late beat is not a failure",
                seconds(self.heartbeat_deadline),
                seconds(self.heartbeat_interval * 3)
            ));
        }
        Ok(())
    }

    /// The deadlines the membership decisions use.
    pub fn options(&self) -> Options {
        Options {
            heartbeat_deadline: self.heartbeat_deadline,
            rendezvous_timeout: self.rendezvous,
            rejoin_deadline: self.rejoin,
        }
    }
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
            t.check().unwrap_err(),
            "--heartbeat-deadline 1.5s must be less than --collective-timeout 1s (the timeouts must grow: heartbeat \
             interval < heartbeat deadline < collective timeout < rejoin deadline)"
        );
        let t = Timeouts { heartbeat_deadline: Duration::from_millis(250), ..Timeouts::default() };
        assert_eq!(
            t.check().unwrap_err(),
            "--heartbeat-deadline 0.25s must be at least 3 heartbeat intervals (0.3s): one late beat \
             is not a failure"
        );
    }
}
