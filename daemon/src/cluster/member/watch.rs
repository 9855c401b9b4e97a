//! A member's decisions about its chief, as pure functions of (what the member observed, now,
//! the options), the way the coordinator's are ([`super::super::membership::decide`]): no I/O,
//! no clock, so that every deadline is a plain unit test with injected time. The heartbeat task
//! and the join only observe, ask, and carry the answers out.
//!
//! - [`Watch`]: where the heartbeat link to the chief stands; [`Watch::lost`] says when the
//!   chief counts as lost (unreachable, no stream, the stream closed, or silent past the
//!   heartbeat deadline), and [`Watch::deadline`] when that can next change.
//! - [`JoinWait`]: a join waiting for its formation; [`JoinWait::end`] says when the wait is over
//!   without an answer (stopped, replaced, or the chief silent for the whole deadline), the one
//!   deadline counted from the later of the wait's start and the chief's last answer.

use std::time::{Duration, Instant};

/// Where the heartbeat link to the chief stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Link {
    /// Connecting to the chief, since then.
    Connecting(Instant),
    /// Connected; the heartbeat stream is being opened, since then.
    Opening(Instant),
    /// The stream is open.
    Open,
    /// The chief refused to open the stream.
    Refused,
    /// The open stream ended.
    Closed,
}

/// What the member saw on the link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Seen {
    /// Nothing before the deadline it waited to.
    Nothing,
    /// A connection to the chief.
    Connected,
    /// The stream opened.
    Opened,
    /// The chief refused the stream.
    Refused,
    /// A notice from the chief (an ack, or news).
    Notice,
    /// The stream ended.
    Closed,
}

/// Why the chief counts as lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lost {
    /// No connection within the heartbeat deadline.
    Unreachable,
    /// Connected, but no heartbeat stream opened within the deadline (or it was refused).
    NoStream,
    /// The open stream ended.
    Disconnected,
    /// No notice for longer than the deadline.
    Silent(Duration),
}

impl Lost {
    /// Why, naming the coordinator by its `role` (`chief`, or `coordinator` once one was
    /// elected) and `name`.
    pub(crate) fn reason(self, role: &str, name: &str) -> String {
        match self {
            Lost::Unreachable => format!("cannot reach the {role}, {name}"),
            Lost::NoStream => format!("the {role}, {name}, did not open a heartbeat stream"),
            Lost::Disconnected => format!("lost the connection to the {role}, {name}"),
            Lost::Silent(deadline) => format!("the {role}, {name}, did not answer heartbeats for {deadline:?}"),
        }
    }
}

/// What a member knows of its link to the chief.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Watch {
    /// The link's state.
    pub(crate) link: Link,
    /// When the chief last answered (or the watch began).
    pub(crate) last_notice: Instant,
}

impl Watch {
    /// A watch that starts connecting at `now`.
    pub(crate) fn new(now: Instant) -> Watch {
        Watch { link: Link::Connecting(now), last_notice: now }
    }

    /// Takes in what the member saw at `now`.
    pub(crate) fn saw(&mut self, seen: Seen, now: Instant) {
        self.link = match seen {
            Seen::Nothing => return,
            Seen::Connected => Link::Opening(now),
            Seen::Opened | Seen::Notice => {
                self.last_notice = now;
                Link::Open
            }
            Seen::Refused => Link::Refused,
            Seen::Closed => Link::Closed,
        };
    }

    /// When the link's current state runs out: the instant after which [`Watch::lost`] says the
    /// chief is lost if nothing is seen before.
    pub(crate) fn deadline(&self, heartbeat_deadline: Duration) -> Instant {
        match self.link {
            Link::Connecting(since) | Link::Opening(since) => since + heartbeat_deadline,
            Link::Open => self.last_notice + heartbeat_deadline,
            Link::Refused | Link::Closed => self.last_notice,
        }
    }

    /// Whether the chief counts as lost at `now`, and why.
    pub(crate) fn lost(&self, now: Instant, heartbeat_deadline: Duration) -> Option<Lost> {
        let expired = now >= self.deadline(heartbeat_deadline);
        match self.link {
            Link::Connecting(_) if expired => Some(Lost::Unreachable),
            Link::Opening(_) if expired => Some(Lost::NoStream),
            Link::Open if expired => Some(Lost::Silent(heartbeat_deadline)),
            Link::Refused => Some(Lost::NoStream),
            Link::Closed => Some(Lost::Disconnected),
            _ => None,
        }
    }
}

/// How a join's wait ends without an answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum JoinEnd {
    /// A stop signal arrived.
    Stopped,
    /// A newer process took this member's rank (why).
    Replaced(String),
    /// The chief was unreachable for the whole deadline.
    ChiefSilent,
}

/// A join waiting for its formation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct JoinWait {
    /// When the join began.
    pub(crate) started: Instant,
    /// How long the chief may stay silent: the rendezvous timeout before the first formation, the
    /// rejoin deadline after (the coordinator enforces the same ones while it is reachable).
    pub(crate) timeout: Duration,
    /// `rendezvous` or `recovery`.
    pub(crate) phase: &'static str,
}

impl JoinWait {
    /// A join beginning at `now`, after a first formation or not.
    pub(crate) fn new(now: Instant, formed_once: bool, (rendezvous, rejoin): (Duration, Duration)) -> JoinWait {
        let (phase, timeout) = if formed_once { ("recovery", rejoin) } else { ("rendezvous", rendezvous) };
        JoinWait { started: now, timeout, phase }
    }

    /// The instant after which the chief, last heard from at `last_contact`, counts as silent:
    /// the wait goes on as long as the chief answers, and gives up only when it is unreachable.
    pub(crate) fn deadline(&self, last_contact: Instant) -> Instant {
        last_contact.max(self.started) + self.timeout
    }

    /// Whether the wait is over at `now` (`stop`: a stop signal came; `replaced`: why a newer
    /// process holds the rank, if one does).
    pub(crate) fn end(
        &self,
        now: Instant,
        last_contact: Instant,
        stop: bool,
        replaced: Option<String>,
    ) -> Option<JoinEnd> {
        if stop {
            return Some(JoinEnd::Stopped);
        }
        if let Some(why) = replaced {
            return Some(JoinEnd::Replaced(why));
        }
        (now > self.deadline(last_contact)).then_some(JoinEnd::ChiefSilent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEADLINE: Duration = Duration::from_millis(1500);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_chief_that_cannot_be_reached_is_lost_at_the_deadline() {
        let t0 = Instant::now();
        let w = Watch::new(t0);
        assert_eq!(w.lost(t0 + ms(1499), DEADLINE), None);
        assert_eq!(w.deadline(DEADLINE), t0 + DEADLINE);
        assert_eq!(w.lost(t0 + DEADLINE, DEADLINE), Some(Lost::Unreachable));
        assert_eq!(Lost::Unreachable.reason("chief", "worker 0 (h:1)"), "cannot reach the chief, worker 0 (h:1)");
    }

    #[test]
    fn a_stream_must_open_within_the_deadline_and_a_refusal_is_at_once() {
        let t0 = Instant::now();
        let mut w = Watch::new(t0);
        w.saw(Seen::Connected, t0 + ms(100));
        assert_eq!(w.lost(t0 + ms(1500), DEADLINE), None, "the deadline counts from the connection");
        assert_eq!(w.lost(t0 + ms(1600), DEADLINE), Some(Lost::NoStream));
        w.saw(Seen::Refused, t0 + ms(200));
        assert_eq!(w.lost(t0 + ms(200), DEADLINE), Some(Lost::NoStream));
        assert_eq!(Lost::NoStream.reason("chief", "c"), "the chief, c, did not open a heartbeat stream");
    }

    #[test]
    fn an_open_stream_is_lost_when_it_closes_or_stays_silent_past_the_deadline() {
        let t0 = Instant::now();
        let mut w = Watch::new(t0);
        w.saw(Seen::Connected, t0);
        w.saw(Seen::Opened, t0 + ms(10));
        w.saw(Seen::Notice, t0 + ms(1000));
        w.saw(Seen::Nothing, t0 + ms(2400));
        assert_eq!(w.lost(t0 + ms(2499), DEADLINE), None, "silent for 1.499s");
        assert_eq!(w.deadline(DEADLINE), t0 + ms(2500));
        assert_eq!(w.lost(t0 + ms(2500), DEADLINE), Some(Lost::Silent(DEADLINE)));
        assert_eq!(Lost::Silent(DEADLINE).reason("chief", "c"), "the chief, c, did not answer heartbeats for 1.5s");
        w.saw(Seen::Closed, t0 + ms(1100));
        assert_eq!(w.lost(t0 + ms(1100), DEADLINE), Some(Lost::Disconnected));
        assert_eq!(Lost::Disconnected.reason("chief", "c"), "lost the connection to the chief, c");
    }

    #[test]
    fn a_join_waits_while_the_chief_answers_and_gives_up_one_deadline_after_its_last_answer() {
        let t0 = Instant::now();
        let timeouts = (Duration::from_secs(300), Duration::from_secs(600));
        let first = JoinWait::new(t0, false, timeouts);
        assert_eq!((first.phase, first.timeout), ("rendezvous", Duration::from_secs(300)));
        let w = JoinWait::new(t0, true, timeouts);
        assert_eq!((w.phase, w.timeout), ("recovery", Duration::from_secs(600)));
        // Heard from the chief before the join began: the deadline counts from the join.
        let before = t0.checked_sub(ms(5)).unwrap_or(t0);
        assert_eq!(w.end(t0 + Duration::from_secs(600), before, false, None), None);
        assert_eq!(w.end(t0 + Duration::from_secs(601), before, false, None), Some(JoinEnd::ChiefSilent));
        // Heard from it 500 s into the wait: 600 s more.
        let contact = t0 + Duration::from_secs(500);
        assert_eq!(w.end(t0 + Duration::from_secs(1000), contact, false, None), None);
        assert_eq!(w.end(t0 + Duration::from_secs(1101), contact, false, None), Some(JoinEnd::ChiefSilent));
        // A stop or a replacement ends it at once.
        assert_eq!(w.end(t0, t0, true, None), Some(JoinEnd::Stopped));
        assert_eq!(w.end(t0, t0, false, Some("newer".into())), Some(JoinEnd::Replaced("newer".into())));
    }
}
