//! Ranges streamed (docs/fault-tolerance.md): with the optimizer state sharded, the members that
//! own the ranges a returner will hold once back (its slots' and its predecessor's) send it those
//! ranges' state at a step boundary and then each step's clipped gradient of them
//! ([`RangeDonor`]); the returner stores each step from them as a buddy does ([`Streamed`]), so
//! that at the switch it holds its ranges at the others' step and the reshard moves nothing to it.

use bytes::Bytes;

use super::super::Driver;
use super::size;
use crate::cluster::catch_up::{Catching, Feed, Item, RangeHead};
use crate::collective::buckets::{owned, Range};
use crate::collective::Slots;
use crate::optim::sharded_state::{self, Piece, ShardedOptimizer};
use crate::state::{Optim, TrainState};
use crate::train::report::Reporter;
use crate::train::session::Session;
use crate::train::sharded_step::{self, Stepped};

/// The ranges returner `rank` will hold once back (docs/fault-tolerance.md, "Ranges streamed"):
/// those of its slots and of its predecessor's, when this generation's members and it form the
/// next.
pub(super) fn returners_ranges(session: &Session, ranges: &[Range], rank: usize) -> Vec<usize> {
    let mut members = session.members().to_vec();
    members.push(rank);
    members.sort_unstable();
    members.dedup();
    let place = members.iter().position(|&m| m == rank).expect("listed");
    let at = Slots::of(session.slot_count(), session.layout(&members), place);
    let mut held = owned(ranges, &at);
    if members.len() > 1 {
        held.extend(owned(ranges, &at.before()));
    }
    held
}

/// The members of this generation that own ranges returner `rank` will hold (`ranges`: the
/// generation's), ascending: whom it asks for them.
pub(super) fn range_donors(session: &Session, ranges: &[Range], rank: usize) -> Vec<usize> {
    let slots = session.slots();
    let v = slots.count;
    let owner = |r: usize| session.members()[slots.holder_place((ranges[r].chunk + v - 1) % v)];
    let mut donors: Vec<usize> = returners_ranges(session, ranges, rank).into_iter().map(owner).collect();
    donors.sort_unstable();
    donors.dedup();
    donors
}

/// Float32 values as a stream carries them: their bytes where they lie (little-endian, as on
/// every platform trainerd builds for), without a copy.
struct Floats(Vec<f32>);

impl AsRef<[u8]> for Floats {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

/// The stream's float32 values cut into arrays of `lens` (one copy each); why not, when the sizes
/// differ.
fn arrays(bytes: &[u8], lens: impl Iterator<Item = usize>) -> Result<Vec<Vec<f32>>, String> {
    let lens: Vec<usize> = lens.collect();
    let count: usize = lens.iter().sum();
    if count * 4 != bytes.len() {
        return Err(format!("{} bytes came for {count} value(s)", bytes.len()));
    }
    let copied: Vec<f32>;
    let values: &[f32] = match bytemuck::try_cast_slice(bytes) {
        Ok(v) => v,
        Err(_) => {
            copied = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            &copied
        }
    };
    let mut at = 0;
    Ok(lens
        .into_iter()
        .map(|n| {
            at += n;
            values[at - n..at].to_vec()
        })
        .collect())
}

/// A returner's streams of the ranges it will hold.
pub(super) enum Ranging {
    /// None: the optimizer state is not sharded, or they stopped.
    Off,
    /// To open once the replay is level with the donor: `generation`, the range donors.
    ToOpen(u64, Vec<usize>),
    Open(Streamed),
}

impl Ranging {
    /// With the optimizer state sharded, `donors` (ranks) own in `generation` the ranges the
    /// returner will hold.
    pub(super) fn new(generation: u64, donors: Vec<usize>) -> Ranging {
        if donors.is_empty() {
            Ranging::Off
        } else {
            Ranging::ToOpen(generation, donors)
        }
    }

    /// Whether some stream is not open or has not begun (its ranges' state has not come): what
    /// the returner's word to the coordinator says, which the switch waits for.
    pub(super) fn pending(&self) -> bool {
        match self {
            Ranging::Off => false,
            Ranging::ToOpen(..) => true,
            Ranging::Open(s) => s.streams.iter().any(|s| s.at.is_none()),
        }
    }
}

/// A member's side: at most one returner's ranges streamed at a time.
#[derive(Default)]
pub(in crate::train::driver) struct RangeDonor {
    feeding: Option<RangeFeeding>,
}

struct RangeFeeding {
    name: String,
    generation: u64,
    feed: Feed,
    /// The returner's ranges this member owns, in the order their values go.
    ranges: Vec<usize>,
}

impl RangeDonor {
    /// At a step boundary: a returner gone, or a generation ended, let go; in a generation whose
    /// optimizer state is sharded (`ranges`, its ranges), a returner's request taken, and the
    /// state of its ranges this member owns queued (after the step just trained). `memory` bounds
    /// what is queued.
    pub(super) fn begin(
        &mut self,
        (state, session): (&TrainState, &Session),
        ranges: Option<&[Range]>,
        memory: u64,
        report: &mut Reporter<'_>,
    ) {
        if let Some(f) = &self.feeding {
            if f.feed.gone() || f.generation != session.generation() {
                let f = self.feeding.take().expect("feeding");
                f.feed.fallback(&format!("generation {} ended", f.generation));
            }
            return;
        }
        let (Optim::Sharded(o), Some(ranges)) = (&state.optimizer, ranges) else { return };
        let Some(offer) = session.catch_up_offer(true) else { return };
        if offer.generation != session.generation() {
            return offer.feed.fallback(&format!("generation {} ended", offer.generation));
        }
        let (held, mine) = (o.held(), o.owned());
        let theirs: Vec<usize> =
            returners_ranges(session, ranges, offer.rank).into_iter().filter(|r| mine.contains(r)).collect();
        let shard = |r: &usize| held.iter().position(|h| h == r).expect("owned");
        let k = o.slot_names().len();
        let mut values = Vec::with_capacity(theirs.iter().map(|&r| ranges[r].grads_len() * k).sum());
        theirs.iter().flat_map(|r| (0..k).map(move |k| (shard(r), k))).for_each(|(s, k)| {
            values.extend_from_slice(o.values(s, k));
        });
        let values = Bytes::from_owner(Floats(values));
        let name = session.name(offer.rank);
        if values.len() as u64 > memory {
            let why =
                format!("their state takes {}, above --catch-up-memory {}", size(values.len() as u64), size(memory));
            report.line(&format!("trainerd: {name} cannot take its ranges from this worker: {why}"));
            return offer.feed.fallback(&why);
        }
        let (steps, started) = o.replicated();
        let head = RangeHead {
            step: state.position().global_step,
            ranges: theirs.clone(),
            optimizer_steps: steps,
            flags: started.to_vec(),
            ..Default::default()
        };
        if offer.feed.ranges(false, &head, &values) {
            report.line(&format!(
                "trainerd: {name} takes the {} range(s) of the optimizer state it will hold that this worker owns \
                 ({}, after step {}), then each step's gradient of them",
                theirs.len(),
                size(values.len() as u64),
                head.step
            ));
            self.feeding = Some(RangeFeeding { name, generation: offer.generation, feed: offer.feed, ranges: theirs });
        }
    }

    /// The ranges whose clipped gradient the step hands back ([`Stepped::sent`]).
    pub(in crate::train::driver) fn wanted(&self) -> Vec<usize> {
        self.feeding.as_ref().map(|f| f.ranges.clone()).unwrap_or_default()
    }

    /// After a sharded step `step` at rate `lr` (`stepped`, asked for [`RangeDonor::wanted`]):
    /// its gradient of the returner's ranges queued, within `memory`.
    pub(super) fn stepped(
        &mut self,
        stepped: &mut Stepped,
        (step, lr): (u64, f64),
        memory: u64,
        report: &mut Reporter<'_>,
    ) {
        let Some(f) = &self.feeding else { return };
        let skipped = !stepped.finite;
        let head = RangeHead { step, flags: stepped.used.clone(), lr, skipped, ..Default::default() };
        let values = Bytes::from_owner(Floats(std::mem::take(&mut stepped.sent)));
        let queued = f.feed.kept() + values.len() as u64;
        let why = match queued > memory {
            true => format!("its queue would take {}, above --catch-up-memory {}", size(queued), size(memory)),
            false if !f.feed.ranges(true, &head, &values) => "its stream is gone".to_string(),
            false => return,
        };
        let f = self.feeding.take().expect("feeding");
        report.line(&format!("trainerd: the ranges streamed to {} stopped: {why}", f.name));
        f.feed.fallback(&why);
    }
}

/// A returner's side: one stream per member that owns ranges it will hold.
pub(super) struct Streamed {
    streams: Vec<RangeStream>,
    /// The run's ranges.
    ranges: Vec<Range>,
}

struct RangeStream {
    donor: String,
    catching: Catching,
    /// Once its state came: the step its ranges are at, and them.
    at: Option<(u64, ShardedOptimizer)>,
}

impl Streamed {
    /// Streams from `donors` (ranks) of the ranges this returner will hold in `generation`
    /// (`ranges`: the run's); why not.
    pub(super) fn open(
        session: &Session,
        generation: u64,
        donors: &[usize],
        ranges: Vec<Range>,
    ) -> Result<Self, String> {
        let open = |&d: &usize| {
            let catching = session.catch_up_ranges(d, generation).map_err(|e| format!("{}: {e}", session.name(d)))?;
            Ok(RangeStream { donor: session.name(d), catching, at: None })
        };
        Ok(Streamed { streams: donors.iter().map(open).collect::<Result<_, String>>()?, ranges })
    }

    /// Before the replay takes step `step`'s outputs (`state` at the step before): each stream's
    /// ranges brought to it (their state taken once it has come, then the step's gradient
    /// stored, reading the parameters before the step); why not (a stream that began after the
    /// replay passed its step, or broke).
    pub(super) fn before_step(&mut self, state: &TrainState, step: u64) -> Result<(), String> {
        let config = state.optimizer.config().clone();
        let params = &state.model.params;
        for s in &mut self.streams {
            let said = |e: String| format!("{}: {e}", s.donor);
            if s.at.is_none() {
                // It begins at its member's next step boundary: not yet, maybe.
                let Some(first) = s.catching.ready() else { continue };
                let Item::Ranges(head, bytes) = first.map_err(said)? else {
                    return Err(format!("{}'s stream began with no ranges", s.donor));
                };
                if let Some(r) = head.ranges.iter().find(|&&r| r >= self.ranges.len()) {
                    return Err(format!("{} sent range {r}; the run has {}", s.donor, self.ranges.len()));
                }
                let held: Vec<(usize, Vec<Piece>)> = sharded_step::with_pieces(&self.ranges, &head.ranges);
                let k = sharded_state::slot_names(&config).len();
                let lens = held.iter().flat_map(|(_, p)| std::iter::repeat_n(p.iter().map(|p| p.len).sum(), k));
                let flat = arrays(&bytes, lens).map_err(said)?;
                let mut flat = flat.into_iter();
                let per_range = held.iter().map(|_| flat.by_ref().take(k).collect()).collect();
                let o = ShardedOptimizer::streamed(
                    config.clone(),
                    params,
                    &held,
                    (per_range, head.optimizer_steps, &head.flags),
                );
                s.at = Some((head.step, o.map_err(said)?));
            }
            let (at, o) = s.at.as_mut().expect("begun");
            if *at >= step {
                continue; // it began after this step
            }
            if *at + 1 != step {
                return Err(format!("{}'s ranges are at step {at}, the replay at step {}", s.donor, step - 1));
            }
            let Item::RangeGrads(head, bytes) = s.catching.next().map_err(said)? else {
                return Err(format!("{} sent no gradient of step {step}", s.donor));
            };
            if head.step != step || head.flags.len() != params.len() {
                let (at, flags) = (head.step, head.flags.len());
                return Err(format!("{} sent step {at}'s gradient, {flags} used-flag(s), for step {step}", s.donor));
            }
            if !head.skipped {
                let lens = o.held().into_iter().map(|r| self.ranges[r].grads_len());
                let grads = arrays(&bytes, lens).map_err(said)?;
                let grads: Vec<&[f32]> = grads.iter().map(Vec::as_slice).collect();
                let current = |piece: &Piece| sharded_step::param_values(&params[piece.param].1, piece);
                o.store_step(&grads, &current, &head.flags, head.lr);
            }
            *at = step;
        }
        Ok(())
    }

    /// At the switch after step `step`: every stream's ranges, at that step, as one optimizer
    /// (what the reshard finds this returner holding), and what they take; why not.
    pub(super) fn finish(self, step: u64) -> Result<(ShardedOptimizer, usize), String> {
        let mut all: Option<ShardedOptimizer> = None;
        let count = self.streams.len();
        for s in self.streams {
            match s.at {
                Some((at, o)) if at == step => match all.as_mut() {
                    Some(a) => a.absorb(o).map_err(|e| format!("{}: {e}", s.donor))?,
                    None => all = Some(o),
                },
                Some((at, _)) => return Err(format!("{}'s ranges are at step {at}, the switch after {step}", s.donor)),
                None => return Err(format!("no ranges came from {}", s.donor)),
            }
        }
        let all = all.ok_or_else(|| "no member streamed ranges".to_string())?;
        let mut held = all.held();
        held.sort_unstable();
        if held.windows(2).any(|w| w[0] == w[1]) {
            return Err("two members streamed the same range".into());
        }
        Ok((all, count))
    }
}

impl Driver<'_> {
    /// After a sharded step `step` at rate `lr` (`stepped`): its gradient of the ranges streamed
    /// from here to a returner queued.
    pub(in crate::train::driver) fn ranges_stepped(&mut self, stepped: Option<&mut Stepped>, at: (u64, f64)) {
        if let Some(s) = stepped {
            self.range_donor.stepped(s, at, self.cfg.catch_up_memory, &mut self.report);
        }
    }

    /// The catch-up stream's next item. Once the replay has taken everything the donor sent (the
    /// next item not there yet), the streams of the ranges it will hold are opened first: they
    /// then carry the few steps left rather than the whole catch-up (none when one could not be
    /// opened, said: the switch moves them as before).
    pub(super) fn next_item(
        &mut self,
        (state, session): (&TrainState, &Session),
        catching: &mut Catching,
        ranging: &mut Ranging,
    ) -> Result<Item, String> {
        if let Ranging::ToOpen(generation, donors) = ranging {
            if let Some(item) = catching.ready() {
                return item;
            }
            let v = session.slot_count();
            let ranges = self.buckets.ranges(&state.model.params, v, self.extra_len(v));
            *ranging = match Streamed::open(session, *generation, donors, ranges) {
                Ok(s) => Ranging::Open(s),
                Err(why) => {
                    self.ranges_dropped(&why);
                    Ranging::Off
                }
            };
        }
        catching.next()
    }

    /// Before the replay takes step `step`'s outputs: the streamed ranges brought to it, or let
    /// go (said) when they cannot be.
    pub(super) fn ranges_before(&mut self, state: &TrainState, ranging: &mut Ranging, step: u64) {
        let Ranging::Open(streamed) = ranging else { return };
        if let Err(why) = streamed.before_step(state, step) {
            *ranging = Ranging::Off;
            self.ranges_dropped(&why);
        }
    }

    /// At the switch after step `step`: the streamed ranges, at that step, made this returner's
    /// optimizer state (said), or let go (said).
    pub(super) fn ranges_at_switch(&mut self, state: &mut TrainState, ranging: Ranging, step: u64) {
        let streamed = match ranging {
            Ranging::Off => return,
            Ranging::ToOpen(..) => return self.ranges_dropped("the replay was never level with the donor"),
            Ranging::Open(s) => s,
        };
        match streamed.finish(step) {
            Ok((o, donors)) => {
                self.report.line(&format!(
                    "trainerd: catching up: {} range(s) of the optimizer state it will hold came from {donors} \
                     member(s) and are at step {step} ({})",
                    o.held().len(),
                    size(o.state_bytes())
                ));
                state.optimizer = Optim::Sharded(o);
            }
            Err(why) => self.ranges_dropped(&why),
        }
    }

    /// The streamed ranges let go (`why`): the reshard at the switch moves them, as without.
    fn ranges_dropped(&mut self, why: &str) {
        self.report.line(&format!(
            "trainerd: catching up: the ranges streamed stopped: {why}; they move to this worker at the switch"
        ));
    }
}
