//! The heartbeat task: beats to the coordinator (the chief, or the one elected after it) every
//! interval, takes its notices (a generation ended, this process was replaced), and notices when
//! it is gone. Whether and why the
//! chief is lost is [`Watch::lost`]'s to say; this task only carries out the link's steps, each
//! bounded by [`Watch::deadline`], and tells the watch what it saw. A lost chief aborts this
//! member's generation and is pushed to every peer, so nobody waits for a timeout.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;
use tokio::time::timeout_at;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use super::super::timeouts::Timeouts;
use super::super::wire::{proto, ControlClient};
use super::dial::{push_abort, Dial};
use super::watch::{Link, Lost, Seen, Watch};
use super::Shared;

/// Who beats, and to whom.
pub(super) struct Beater {
    /// How to reach each rank (the coordinator is one of them).
    pub(super) dials: Arc<Vec<Dial>>,
    pub(super) names: Arc<Vec<String>>,
    pub(super) rank: u32,
    pub(super) incarnation: u64,
    pub(super) timeouts: Timeouts,
    pub(super) shared: Arc<Shared>,
    pub(super) peers: Arc<Vec<Option<ControlClient<Channel>>>>,
}

/// How one link to the chief ended.
enum End {
    /// The chief is lost.
    Lost(Lost),
    /// A newer process took this rank: nothing this one does counts any more.
    Replaced,
    /// This member now follows another coordinator: link to it at once.
    Moved,
}

impl Beater {
    /// Beats until a newer process takes this rank; after each loss of the chief, waits an
    /// interval and links again.
    pub(super) async fn run(self) {
        loop {
            let seen = self.shared.elections.moves();
            let Some((term, rank)) = self.shared.elections.coordinator() else {
                // Voted in an election whose winner is not known yet: nobody to beat to.
                self.shared.elections.set_lost(Some(Instant::now()));
                self.shared.elections.moved_since(seen, self.timeouts.heartbeat_interval).await;
                continue;
            };
            match self.link((term, rank)).await {
                End::Replaced => return,
                End::Moved => continue,
                End::Lost(lost) => {
                    self.shared.elections.set_lost(Some(Instant::now()));
                    let role = if term == 0 { "chief" } else { "coordinator" };
                    self.lost(&lost.reason(role, &self.names[rank]));
                }
            }
            // Again after an interval, or at once to a newly elected coordinator.
            self.shared.elections.moved_since(seen, self.timeouts.heartbeat_interval).await;
        }
    }

    /// The coordinator is lost: abort this member's generation and tell every peer.
    fn lost(&self, why: &str) {
        let generation = self.shared.generation.load(Ordering::Relaxed);
        if generation > 0 && self.shared.abort.trigger(generation, why) {
            push_abort(&self.peers, generation, self.rank, why);
        }
    }

    /// One link to the coordinator of `term` (`rank`): connect, open the heartbeat stream, read
    /// its notices, until the watch says it is lost or this member follows another.
    async fn link(&self, (term, rank): (u64, usize)) -> End {
        let (dial, elections) = (&self.dials[rank], &self.shared.elections);
        let moved = || elections.coordinator() != Some((term, rank));
        let deadline = self.timeouts.heartbeat_deadline;
        let mut watch = Watch::new(Instant::now());
        let mut client = None;
        let mut notices = None;
        let (tx, rx) = mpsc::channel::<proto::Beat>(4);
        let beats = tokio::spawn(self.beats(tx));
        let mut rx = Some(rx);
        let end = loop {
            if moved() {
                break End::Moved;
            }
            // Each wait is bounded by the watch's deadline, and ends when another coordinator is
            // followed (a look now and then, or, for the stream's opening, which cannot be taken up
            // again, at once).
            let until = watch.deadline(deadline).min(Instant::now() + deadline / 4);
            let seen = match watch.link {
                // Given up on at once when another coordinator is followed (it retries until then).
                Link::Connecting(_) => match dial.connect_while_followed(until, elections, (term, rank)).await {
                    Some(Ok(c)) => {
                        client = Some(c);
                        Seen::Connected
                    }
                    Some(Err(_)) => Seen::Nothing,
                    None => continue,
                },
                Link::Opening(_) => {
                    let client = client.as_mut().expect("connected");
                    let stream = ReceiverStream::new(rx.take().expect("opened once"));
                    match self.open(client, stream, watch.deadline(deadline), (term, rank)).await {
                        Some(Ok(opened)) => {
                            notices = Some(opened);
                            Seen::Opened
                        }
                        Some(Err(seen)) => seen,
                        None => break End::Moved,
                    }
                }
                Link::Open => match timeout_at(until.into(), notices.as_mut().expect("open").message()).await {
                    Ok(Ok(Some(n))) => match self.notice(&n) {
                        Some(end) => break end,
                        None => Seen::Notice,
                    },
                    Ok(Ok(None) | Err(_)) => Seen::Closed,
                    Err(_) => Seen::Nothing,
                },
                Link::Refused | Link::Closed => Seen::Nothing,
            };
            let now = Instant::now();
            watch.saw(seen, now);
            if let Some(lost) = watch.lost(now, deadline) {
                break End::Lost(lost);
            }
        };
        beats.abort();
        end
    }

    /// Opens the heartbeat stream of `beats` on `client` to the coordinator of `term` (`rank`),
    /// waiting until `until`: its notices, or what was seen instead; `None` once another
    /// coordinator is followed. A frozen coordinator's kernel takes the connection, but its
    /// opening would hang to the deadline (the soak measured 1.3 s more of a freeze's pause,
    /// after the election), so the wait ends at once when this member follows another.
    async fn open(
        &self,
        client: &mut ControlClient<Channel>,
        beats: ReceiverStream<proto::Beat>,
        until: Instant,
        (term, rank): (u64, usize),
    ) -> Option<Result<tonic::Streaming<proto::Notice>, Seen>> {
        let opening = timeout_at(until.into(), client.heartbeat(beats));
        let opened = tokio::select! {
            opened = opening => opened,
            () = self.shared.elections.moved_from(Some((term, rank))) => return None,
        };
        Some(match opened {
            Ok(Ok(response)) => {
                self.shared.elections.set_lost(None);
                Ok(response.into_inner())
            }
            Ok(Err(_)) => Err(Seen::Refused),
            Err(_) => Err(Seen::Nothing),
        })
    }

    /// Beats into `tx` every interval, carrying this member's generation and the furthest global step
    /// its state reached in it.
    fn beats(&self, tx: mpsc::Sender<proto::Beat>) -> impl std::future::Future<Output = ()> + Send + 'static {
        let (shared, rank, incarnation, interval) =
            (Arc::clone(&self.shared), self.rank, self.incarnation, self.timeouts.heartbeat_interval);
        async move {
            loop {
                let beat = proto::Beat {
                    rank,
                    incarnation,
                    // In this order: a beat naming a new generation never carries the old one's step.
                    generation: shared.generation.load(Ordering::SeqCst),
                    step: shared.step.load(Ordering::SeqCst),
                    term: shared.elections.vote().term,
                };
                if tx.send(beat).await.is_err() {
                    return;
                }
                tokio::time::sleep(interval).await;
            }
        }
    }

    /// Takes a notice from the coordinator; `Some` when it ends the link for good.
    fn notice(&self, n: &proto::Notice) -> Option<End> {
        self.shared.touch();
        self.shared.elections.set_lost(None);
        match proto::notice::Kind::try_from(n.kind) {
            Ok(proto::notice::Kind::Ended) => {
                self.shared.abort.trigger(n.generation, &n.reason);
                None
            }
            Ok(proto::notice::Kind::Replaced) => {
                *self.shared.replaced.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
                    Some(n.reason.clone());
                self.shared.abort.trigger(u64::MAX, &n.reason);
                Some(End::Replaced)
            }
            _ => None,
        }
    }
}
