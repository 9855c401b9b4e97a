//! A returner's catch-up as the cluster carries it (docs/fault-tolerance.md, "A return that does
//! not pause the survivors"). On the donor (the coordinator's process), the service leaves a
//! returner's request in the [`Hub`] and the training thread takes it as a [`Feed`]: the sending
//! side of the stream, which counts what is queued and not yet taken by the stream (the kept
//! outputs, which the donor bounds). With the optimizer state sharded, every member's service also
//! leaves a returner's request for the ranges it will hold ([`Hubs::ranges`]), fed the same way. On
//! the returner, [`Catching`] reads a stream and puts each item's pieces back together. What the
//! items hold is the training loop's (`train::driver::catch_up`).

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::sync::mpsc;
use tokio_stream::{Stream, StreamExt};
use tonic::{Status, Streaming};

use super::wire::proto;
use proto::catch_up_part::Kind;

/// The largest piece of an item on the stream. The returner's client takes messages of up to
/// [`LARGEST_PART`] (gRPC's default refuses those above 4 MiB, a piece's header included). On a
/// 2-core machine whose 3 workers train meanwhile, 4 MiB pieces carried a 1 GB state in 2.1-2.9 s
/// where 1 MiB pieces took 3.9 s (with the control plane's windows, `member::dial`).
const PIECE: usize = 4 << 20;

/// The largest catch-up part the returner's client decodes: a piece and its header.
pub(crate) const LARGEST_PART: usize = 2 * PIECE;

/// A state's fingerprint on the stream (xxh3), computed where its bytes are assembled, off the
/// donor's training thread, and checked by the returner.
pub(crate) fn fingerprint(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// An item of a catch-up stream, put back together.
#[derive(Debug)]
pub(crate) enum Item {
    /// The donor's state at a step boundary, in generation `generation` whose formation's digest
    /// is `formation`.
    State {
        /// The generation the donor trains in.
        generation: u64,
        /// Its formation's digest.
        formation: String,
        /// The state's bytes (checked against the xxh3 the donor sent).
        bytes: Bytes,
        /// With the optimizer state sharded: the members that own ranges the returner will hold.
        donors: Vec<usize>,
    },
    /// One step's outputs: their first piece and their length. The rest is read piece by piece
    /// ([`Catching::more`]), so that the returner puts each in place as it arrives, never holding
    /// the whole.
    Step {
        /// Bytes in all.
        total: usize,
        /// The first piece.
        first: Bytes,
    },
    /// One bucket's averaged gradients in the step the donor computes, before that step's
    /// outputs (which leave them out); read as a [`Item::Step`] is.
    Bucket {
        /// Bytes in all.
        total: usize,
        /// The first piece.
        first: Bytes,
    },
    /// The position after a step or an epoch's end.
    Position(Bytes),
    /// The generation ends after `step`; join with the lineage digest when `lineage`.
    End {
        /// The last step of the generation.
        step: u64,
        /// Whether every member joins with the lineage digest.
        lineage: bool,
    },
    /// The catch-up stopped: why.
    Fallback(String),
    /// On a range stream: the state of its ranges after a step (`RANGES`), its float32 arrays.
    Ranges(RangeHead, Bytes),
    /// On a range stream: a step's clipped gradient of its ranges (`RANGE_GRADS`), float32.
    RangeGrads(RangeHead, Bytes),
    /// The run finished after `step`: nothing is left to catch up with.
    Finished {
        /// The run's last step.
        step: u64,
    },
}

/// What a range stream's items carry besides their values (docs/fault-tolerance.md, "Ranges
/// streamed").
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct RangeHead {
    /// `RANGES`: the step the state is after; `RANGE_GRADS`: the step whose gradient it is.
    pub(crate) step: u64,
    /// `RANGES`: the ranges (indices among the run's), in the order their values follow.
    pub(crate) ranges: Vec<usize>,
    /// `RANGES`: the optimizer's count of steps.
    pub(crate) optimizer_steps: u64,
    /// Per parameter: `RANGES`, whether it has started; `RANGE_GRADS`, whether any slot had a
    /// gradient for it.
    pub(crate) flags: Vec<bool>,
    /// `RANGE_GRADS`: the step's rate.
    pub(crate) lr: f64,
    /// `RANGE_GRADS`: the step updated nothing (no values follow).
    pub(crate) skipped: bool,
}

impl RangeHead {
    fn write(&self, p: &mut proto::CatchUpPart) {
        p.step = self.step;
        p.ranges = self.ranges.iter().map(|&r| r as u32).collect();
        p.optimizer_steps = self.optimizer_steps;
        p.flags = self.flags.iter().map(|&f| u8::from(f)).collect();
        (p.lr, p.skipped) = (self.lr, self.skipped);
    }

    fn read(p: &proto::CatchUpPart) -> RangeHead {
        RangeHead {
            step: p.step,
            ranges: p.ranges.iter().map(|&r| r as usize).collect(),
            optimizer_steps: p.optimizer_steps,
            flags: p.flags.iter().map(|&f| f != 0).collect(),
            lr: p.lr,
            skipped: p.skipped,
        }
    }
}

/// What the stream has queued and not yet sent, in bytes: the state's and the outputs'; the
/// most outputs ever queued at once; the step the returner says its replay has reached, plus one
/// (0: it has said nothing yet), and whether it waits for ranges streamed.
#[derive(Debug, Default)]
struct Counts {
    state: AtomicU64,
    outputs: AtomicU64,
    peak: AtomicU64,
    replayed: AtomicU64,
    /// The returner said, last, that streams of its ranges have not all begun.
    ranges_pending: AtomicBool,
}

/// A part on its way to the stream, and whether it counts as state or as kept outputs.
struct Queued {
    part: proto::CatchUpPart,
    state: bool,
}

/// The sending side of one returner's catch-up stream; a clone sends on the same stream (the
/// reducing thread's buckets, [`Feed::bucket`]).
#[derive(Clone)]
pub(crate) struct Feed {
    tx: mpsc::UnboundedSender<Queued>,
    counts: Arc<Counts>,
}

impl Feed {
    /// Queues `bytes` as one item of `kind` (the first piece filled in by `head`); false when the
    /// returner's stream is gone.
    fn item(&self, kind: Kind, bytes: &Bytes, head: impl FnOnce(&mut proto::CatchUpPart)) -> bool {
        let state = kind == Kind::State;
        let counter = if state { &self.counts.state } else { &self.counts.outputs };
        let queued = counter.fetch_add(bytes.len() as u64, Ordering::SeqCst) + bytes.len() as u64;
        if !state {
            self.counts.peak.fetch_max(queued, Ordering::SeqCst);
        }
        let mut first = proto::CatchUpPart { kind: kind as i32, total: bytes.len() as u64, ..Default::default() };
        head(&mut first);
        let mut at = 0;
        let mut part = Some(first);
        loop {
            let end = (at + PIECE).min(bytes.len());
            let mut piece = part.take().unwrap_or_default();
            piece.data = bytes.slice(at..end);
            if self.tx.send(Queued { part: piece, state }).is_err() {
                return false;
            }
            at = end;
            if at >= bytes.len() {
                return true;
            }
        }
    }

    /// Queues the donor's state (`bytes`, whose [`fingerprint`] is `xxh3`) in `generation`, whose
    /// formation's digest is `formation`; with the optimizer state sharded, `donors` own the
    /// ranges the returner will hold.
    pub(crate) fn state(
        &self,
        (generation, formation): (u64, &str),
        (bytes, xxh3): (&Bytes, u64),
        donors: &[usize],
    ) -> bool {
        self.item(Kind::State, bytes, |p| {
            (p.generation, p.formation_digest, p.xxh3) = (generation, formation.to_string(), xxh3);
            p.range_donors = donors.iter().map(|&r| r as u32).collect();
        })
    }

    /// Queues a range stream's state of its ranges (`RANGES`), or a step's gradient of them
    /// (`RANGE_GRADS`, `grads`).
    pub(crate) fn ranges(&self, grads: bool, head: &RangeHead, values: &Bytes) -> bool {
        let kind = if grads { Kind::RangeGrads } else { Kind::Ranges };
        self.item(kind, values, |p| head.write(p))
    }

    /// Queues one step's outputs.
    pub(crate) fn step(&self, bytes: &Bytes) -> bool {
        self.item(Kind::Step, bytes, |_| {})
    }

    /// Queues one bucket's averaged gradients, before the rest of their step's outputs.
    pub(crate) fn bucket(&self, bytes: &Bytes) -> bool {
        self.item(Kind::Bucket, bytes, |_| {})
    }

    /// Queues the position after a step or an epoch's end.
    pub(crate) fn position(&self, bytes: &Bytes) -> bool {
        self.item(Kind::Position, bytes, |_| {})
    }

    /// The generation ends after `step`: the last item.
    pub(crate) fn end(self, step: u64, lineage: bool) {
        self.item(Kind::End, &Bytes::new(), |p| (p.step, p.lineage) = (step, lineage));
    }

    /// The catch-up stops (`reason`): the last item.
    pub(crate) fn fallback(self, reason: &str) {
        self.item(Kind::Fallback, &Bytes::new(), |p| p.reason = reason.to_string());
    }

    /// The run finished after `step`: the last item (false when the returner's stream is gone).
    pub(crate) fn finished(&self, step: u64) -> bool {
        self.item(Kind::Finished, &Bytes::new(), |p| p.step = step)
    }

    /// Bytes of outputs queued and not yet taken by the stream.
    pub(crate) fn kept(&self) -> u64 {
        self.counts.outputs.load(Ordering::SeqCst)
    }

    /// The most bytes of outputs queued at once.
    pub(crate) fn peak(&self) -> u64 {
        self.counts.peak.load(Ordering::SeqCst)
    }

    /// Whether the stream has taken every piece of the state.
    pub(crate) fn state_taken(&self) -> bool {
        self.counts.state.load(Ordering::SeqCst) == 0
    }

    /// The step the returner says its replay has reached, once it has said one.
    pub(crate) fn replayed(&self) -> Option<u64> {
        self.counts.replayed.load(Ordering::SeqCst).checked_sub(1)
    }

    /// Whether the returner said, last, that the streams of its ranges have not all begun (the
    /// switch waits for them).
    pub(crate) fn ranges_pending(&self) -> bool {
        self.counts.ranges_pending.load(Ordering::SeqCst)
    }

    /// Whether the returner's stream is gone (it died, or gave up).
    pub(crate) fn gone(&self) -> bool {
        self.tx.is_closed()
    }
}

/// What the coordinator answers a returner's request while no generation trains (a cluster
/// starting, or forming one): the returner joins, and there is nothing to say.
pub(crate) const NOTHING_TRAINS: &str = "no generation is training";

/// Why a returner does not catch up, and joins with a pause instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NoCatchUp {
    /// Nothing trains to catch up with: no coordinator is known or reached, this process
    /// coordinates, or the coordinator trains no generation (every process of a cluster that
    /// starts asks, and is told so).
    NothingTrains(String),
    /// The coordinator refused it, or did not answer: the returner says why.
    Refused(String),
}

/// A returner's request, as the service leaves it for the training thread.
pub(crate) struct Offer {
    /// The returner's rank.
    pub(crate) rank: usize,
    /// The generation it catches up with.
    pub(crate) generation: u64,
    /// Its stream.
    pub(crate) feed: Feed,
}

/// The stream a returner reads.
pub(crate) type PartStream = Pin<Box<dyn Stream<Item = Result<proto::CatchUpPart, Status>> + Send + 'static>>;

/// Where the coordinator's service leaves a returner's request, and the training thread takes it:
/// one catch-up at a time.
#[derive(Default)]
pub(crate) struct Hub {
    inner: Mutex<Slot>,
}

#[derive(Default)]
struct Slot {
    /// A request not taken yet.
    offer: Option<Offer>,
    /// The counts of the stream being fed (alive while its feed or its stream is), and its
    /// returner's rank.
    running: (Weak<Counts>, usize),
}

/// Where returners' requests wait on a member: to catch up (when it coordinates), and for the
/// ranges of the optimizer state it owns ("Ranges streamed").
#[derive(Default)]
pub(crate) struct Hubs {
    pub(crate) catch_up: Hub,
    pub(crate) ranges: Hub,
}

impl Hub {
    fn lock(&self) -> std::sync::MutexGuard<'_, Slot> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A returner of rank `rank` (named `name`) asks to catch up with `generation`: its stream,
    /// or why not now.
    pub(crate) fn offer(&self, rank: usize, name: &str, generation: u64) -> Result<PartStream, Status> {
        let mut slot = self.lock();
        if slot.offer.as_ref().is_some_and(|o| o.feed.gone()) {
            slot.offer = None;
        }
        if let Some(o) = slot.offer.as_ref().filter(|o| o.rank != rank) {
            return Err(Status::unavailable(format!("another worker's catch-up (rank {}) is starting", o.rank)));
        }
        if slot.running.0.upgrade().is_some() {
            return Err(Status::unavailable(format!("another catch-up is running; {name} joins as before")));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let counts = Arc::new(Counts::default());
        let taken = Arc::clone(&counts);
        let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(move |q: Queued| {
            let counter = if q.state { &taken.state } else { &taken.outputs };
            counter.fetch_sub(q.part.data.len() as u64, Ordering::SeqCst);
            Ok(q.part)
        });
        slot.offer = Some(Offer { rank, generation, feed: Feed { tx, counts } });
        Ok(Box::pin(stream))
    }

    /// The request waiting, if any (its returner still there): the caller feeds it.
    pub(crate) fn take(&self) -> Option<Offer> {
        let mut slot = self.lock();
        let offer = slot.offer.take().filter(|o| !o.feed.gone())?;
        slot.running = (Arc::downgrade(&offer.feed.counts), offer.rank);
        Some(offer)
    }

    /// The returner of rank `rank` says its replay reached `step` (and, `pending`, that the
    /// streams of its ranges have not all begun): kept for the feed, if that returner is being
    /// fed; whether it is.
    pub(crate) fn progress(&self, rank: usize, step: u64, pending: bool) -> bool {
        let slot = self.lock();
        let Some(counts) = slot.running.0.upgrade().filter(|_| slot.running.1 == rank) else { return false };
        counts.replayed.fetch_max(step + 1, Ordering::SeqCst);
        counts.ranges_pending.store(pending, Ordering::SeqCst);
        true
    }
}

/// A returner's side of its catch-up stream.
pub(crate) struct Catching {
    stream: Streaming<proto::CatchUpPart>,
    runtime: tokio::runtime::Handle,
    /// How long a part may take to come.
    patience: Duration,
}

impl Catching {
    pub(super) fn new(
        stream: Streaming<proto::CatchUpPart>,
        runtime: tokio::runtime::Handle,
        patience: Duration,
    ) -> Self {
        Catching { stream, runtime, patience }
    }

    /// The next part within `patience` (zero polls once): `None` when none came in that time; why
    /// not when the stream broke or ended.
    fn part_within(&mut self, patience: Duration) -> Result<Option<proto::CatchUpPart>, String> {
        let stream = &mut self.stream;
        // `message` is cancel safe: a part not whole yet stays buffered for the next call.
        let next = self.runtime.block_on(async { tokio::time::timeout(patience, stream.message()).await });
        match next {
            Err(_) => Ok(None),
            Ok(Err(status)) => Err(status.message().to_string()),
            Ok(Ok(None)) => Err("the stream ended early".into()),
            Ok(Ok(Some(part))) => Ok(Some(part)),
        }
    }

    /// The next part, or why none came.
    fn part(&mut self) -> Result<proto::CatchUpPart, String> {
        let patience = self.patience;
        self.part_within(patience)?.ok_or_else(|| format!("nothing came for {:.1}s", patience.as_secs_f64()))
    }

    /// The next item if its first part has come, without waiting for that part (the rest is
    /// waited for as [`Catching::next`] does); `None` when it has not.
    pub(crate) fn ready(&mut self) -> Option<Result<Item, String>> {
        let first = self.part_within(Duration::ZERO).transpose()?;
        Some(first.and_then(|first| self.item(first)))
    }

    /// The next piece of an item of `kind` and `total` bytes, of which `got` came already.
    pub(crate) fn more(&mut self, kind: &str, (got, total): (usize, usize)) -> Result<Bytes, String> {
        let more = self.part()?;
        if more.kind != Kind::More as i32 || got + more.data.len() > total || more.data.is_empty() {
            return Err(format!("a {kind} item cut short ({got} of {total} bytes)"));
        }
        Ok(more.data)
    }

    /// The next item, put back together (a step's outputs, only begun: [`Item::Step`]); an
    /// error when the stream broke (the donor died).
    pub(crate) fn next(&mut self) -> Result<Item, String> {
        let first = self.part()?;
        self.item(first)
    }

    /// The item whose first part is `first`, put back together.
    fn item(&mut self, first: proto::CatchUpPart) -> Result<Item, String> {
        let kind = Kind::try_from(first.kind).map_err(|_| format!("a part of unknown kind {}", first.kind))?;
        let total = usize::try_from(first.total).map_err(|_| "an item too large".to_string())?;
        if kind == Kind::Step || kind == Kind::Bucket {
            if first.data.len() > total {
                return Err(format!("a {kind:?} item's first piece holds {} of {total} bytes", first.data.len()));
            }
            return Ok(match kind {
                Kind::Step => Item::Step { total, first: first.data },
                _ => Item::Bucket { total, first: first.data },
            });
        }
        let mut bytes = BytesMut::with_capacity(total);
        bytes.extend_from_slice(&first.data);
        while bytes.len() < total {
            let more = self.more(&format!("{kind:?}"), (bytes.len(), total))?;
            bytes.extend_from_slice(&more);
        }
        let bytes = bytes.freeze();
        Ok(match kind {
            Kind::State => {
                let found = fingerprint(&bytes);
                if found != first.xxh3 {
                    return Err(format!("the state's xxh3 is {found:016x}, the donor sent {:016x}", first.xxh3));
                }
                let donors = first.range_donors.iter().map(|&r| r as usize).collect();
                Item::State { generation: first.generation, formation: first.formation_digest, bytes, donors }
            }
            Kind::Step | Kind::Bucket => unreachable!("returned above"),
            Kind::Position => Item::Position(bytes),
            Kind::End => Item::End { step: first.step, lineage: first.lineage },
            Kind::Fallback => Item::Fallback(first.reason),
            Kind::Finished => Item::Finished { step: first.step },
            Kind::Ranges => Item::Ranges(RangeHead::read(&first), bytes),
            Kind::RangeGrads => Item::RangeGrads(RangeHead::read(&first), bytes),
            Kind::More => return Err("a piece with no item before it".into()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
    }

    /// Every part the stream yields, in order.
    fn drain(rt: &tokio::runtime::Runtime, mut stream: PartStream) -> Vec<proto::CatchUpPart> {
        rt.block_on(async {
            let mut parts = Vec::new();
            while let Some(Ok(p)) = stream.next().await {
                parts.push(p);
            }
            parts
        })
    }

    #[test]
    fn items_are_cut_into_pieces_and_what_is_queued_is_counted_until_the_stream_takes_it() {
        let rt = runtime();
        let hub = Hub::default();
        let stream = hub.offer(2, "worker 2", 7).unwrap();
        let offer = hub.take().expect("the offer is there");
        assert_eq!((offer.rank, offer.generation), (2, 7));
        let feed = offer.feed;
        let state = Bytes::from(vec![1u8; PIECE * 2 + 5]);
        assert!(feed.state((7, "abc"), (&state, fingerprint(&state)), &[]));
        assert!(!feed.state_taken());
        assert!(feed.step(&Bytes::from(vec![2u8; 10])));
        assert!(feed.position(&Bytes::from_static(b"{}")));
        assert_eq!((feed.kept(), feed.peak()), (12, 12));
        let counts = Arc::clone(&feed.counts);
        feed.end(41, true);
        let parts = drain(&rt, stream);
        assert_eq!(counts.state.load(Ordering::SeqCst) + counts.outputs.load(Ordering::SeqCst), 0);
        let kinds: Vec<i32> = parts.iter().map(|p| p.kind).collect();
        let (s, m) = (Kind::State as i32, Kind::More as i32);
        let tail = [Kind::Step as i32, Kind::Position as i32, Kind::End as i32];
        assert_eq!(kinds, [&[s, m, m][..], &tail[..]].concat());
        assert_eq!(parts[0].total as usize, state.len());
        assert_eq!((parts[5].step, parts[5].lineage), (41, true));
    }

    #[test]
    fn the_runs_end_is_the_last_item_and_names_the_last_step() {
        let rt = runtime();
        let hub = Hub::default();
        let stream = hub.offer(2, "worker 2", 7).unwrap();
        let feed = hub.take().unwrap().feed;
        assert!(feed.position(&Bytes::from_static(b"{}")));
        assert!(feed.finished(150));
        drop(feed);
        let parts = drain(&rt, stream);
        let kinds: Vec<i32> = parts.iter().map(|p| p.kind).collect();
        assert_eq!(kinds, [Kind::Position as i32, Kind::Finished as i32]);
        assert_eq!((parts[1].step, parts[1].total), (150, 0));
    }

    #[test]
    fn one_catch_up_at_a_time_its_returners_progress_reaches_its_feed_and_a_gone_returner_frees_the_hub() {
        let hub = Hub::default();
        let stream = hub.offer(1, "worker 1", 3).unwrap();
        let err = hub.offer(2, "worker 2", 3).err().expect("busy");
        assert!(err.message().contains("another worker's catch-up (rank 1) is starting"), "{}", err.message());
        assert!(!hub.progress(1, 7, false), "not taken yet: nobody to tell");
        let offer = hub.take().unwrap();
        let err = hub.offer(2, "worker 2", 3).err().expect("busy");
        assert_eq!(err.message(), "another catch-up is running; worker 2 joins as before");
        // The returner's word of its replay reaches its feed, the highest kept.
        assert_eq!(offer.feed.replayed(), None);
        assert!(hub.progress(1, 7, false) && hub.progress(1, 6, true) && !hub.progress(2, 9, false));
        assert_eq!(offer.feed.replayed(), Some(7));
        assert!(offer.feed.ranges_pending(), "the last word on the ranges is kept");
        drop(stream);
        assert!(offer.feed.gone());
        drop(offer);
        assert!(hub.offer(2, "worker 2", 3).is_ok(), "free once the stream and the feed are gone");
        // A request whose returner gave up before it was taken is not taken.
        let stream = hub.offer(2, "worker 2", 4).unwrap();
        drop(stream);
        assert!(hub.take().is_none());
    }
}
