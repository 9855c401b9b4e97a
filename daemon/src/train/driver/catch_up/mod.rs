//! A return that does not pause the survivors (docs/fault-tolerance.md): the donor's side, where
//! the coordinator's process sends a returner its state at a step boundary and then every step's
//! outputs ([`Donor`], bounded by `--catch-up-memory`; a bucket's averaged gradients as soon as
//! the reducing thread ends it, [`BucketFeed`]), and the returner's, which replays them through
//! the same update and joins with the lineage digest ([`Driver::catch_up`]).

use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tch::Tensor;

use super::Driver;

mod ranges;
mod replay;
use crate::cluster::catch_up::{fingerprint, Catching, Feed, Item};
use crate::cluster::ClusterError;
use crate::collective::buckets::Range;
use crate::collective::slots;
use crate::state::catch_up;
use crate::state::{Optim, Position, StateError, TrainState};
use crate::train::error::TrainError;
use crate::train::kernels;
use crate::train::report::Reporter;
use crate::train::session::{lineage, Interrupt, Session};

pub(super) use ranges::RangeDonor;
use ranges::Ranging;
use replay::{Replayed, Taking};

/// A size for lines: `512 B`, `31.4 KB`, `100.0 MB`, `1.2 GB` (powers of 1000).
fn size(bytes: u64) -> String {
    match bytes {
        0..1_000 => format!("{bytes} B"),
        1_000..1_000_000 => format!("{:.1} KB", bytes as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} MB", bytes as f64 / 1e6),
        _ => format!("{:.1} GB", bytes as f64 / 1e9),
    }
}

/// How long a returner told the run finished may go without its replay moving before this
/// process exits anyway (it then finds the run's end in a commit, or waits for its cluster).
const FINISH_PATIENCE: Duration = Duration::from_secs(5);

/// A returner's state taken: its generation, that generation's formation digest, its step, and
/// the members that own ranges it will hold (sharded).
type Taken = (u64, String, u64, Vec<usize>);

/// The donor's side: at most one returner fed at a time.
pub(super) struct Donor {
    /// `--catch-up-memory`: the outputs queued and not yet sent may not exceed it.
    memory: u64,
    feeding: Option<Feeding>,
}

/// A returner being fed.
struct Feeding {
    rank: usize,
    name: String,
    generation: u64,
    feed: Feed,
    /// The snapshot's bytes and their fingerprint, while a thread of their own makes them.
    copying: Option<JoinHandle<Result<(Bytes, u64), StateError>>>,
    /// The state is queued: every step's outputs follow it.
    state_queued: bool,
    /// Bytes of the last step's outputs.
    step_bytes: u64,
    /// The returner's flags are raised in this step: the generation ends after it.
    switching: bool,
    /// The least the returner's replay was behind this member at a step's start, in steps, and
    /// how many step starts have passed since it last came closer.
    behind: Option<(u64, u32)>,
    /// The step the state was taken at, and when.
    from: (u64, Instant),
    /// With the optimizer state sharded: the members that own ranges the returner will hold.
    donors: Vec<usize>,
}

/// A step's buckets sent to a returner as the reducing thread ends each during the backward pass
/// (docs/fault-tolerance.md, "By bucket"): each bucket's sum times 1/V (the float32 product
/// [`crate::collective::buckets::Buckets::reduce`] writes back), in the step after `position`,
/// encoded straight from the reduced buffer.
pub(super) struct BucketFeed {
    feed: Feed,
    /// `--catch-up-memory`: a bucket that would take the kept outputs past it is left to the
    /// step's outputs.
    memory: u64,
    position: Position,
    /// 1/V.
    scale: f32,
    /// Per bucket, its parameters: place, name and shape.
    groups: Vec<Vec<(usize, String, Vec<i64>)>>,
    sent: Mutex<Sent>,
}

/// What a [`BucketFeed`] sent in a step.
#[derive(Default)]
pub(super) struct Sent {
    /// Per parameter, whether its gradient went in a bucket.
    pub(super) params: Vec<bool>,
    /// Bytes queued.
    pub(super) bytes: u64,
}

impl BucketFeed {
    /// Bucket `b`, whose sum over the slots is the front of `sum`, sent (on the reducing thread).
    pub(super) fn told(&self, b: usize, sum: &Tensor) {
        let group = &self.groups[b];
        let mut at = 0;
        let mut sums = Vec::with_capacity(group.len());
        for (_, name, shape) in group {
            let n: i64 = shape.iter().product();
            sums.push((name.clone(), sum.narrow(0, at, n).view(shape.as_slice())));
            at += n;
        }
        // A bucket that cannot be sent now is left to the step's outputs.
        let Ok(bytes) = catch_up::capture_bucket(&self.position, sums, self.scale) else { return };
        let len = bytes.len() as u64;
        if self.feed.kept() + len > self.memory || !self.feed.bucket(&Bytes::from(bytes)) {
            return;
        }
        let mut sent = self.sent.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        group.iter().for_each(|(i, _, _)| sent.params[*i] = true);
        sent.bytes += len;
        drop(sent);
        // Chaos tests stop the donor here: a bucket queued, its step's backward pass going on.
        trainerd_failpoint::point("bucket-sent");
    }

    /// What was sent.
    pub(super) fn sent(self) -> Sent {
        self.sent.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Donor {
    pub(super) fn new(memory: u64) -> Donor {
        Donor { memory, feeding: None }
    }

    /// Whether a returner is being fed.
    pub(super) fn feeding(&self) -> bool {
        self.feeding.is_some()
    }

    /// At a step's start: a returner's request waiting is taken (its state copied from here on,
    /// by a thread, while the step's forward and backward read it), and a returner that went away
    /// is let go. A request waits for the next step where this one changes the optimizer state's
    /// kind (`sharding`: this step shards it, at a sharded run's first step or a generation's
    /// first after a whole state was restored).
    /// `ranges`: this generation's, with the optimizer state sharded.
    pub(super) fn begin(
        &mut self,
        state: &TrainState,
        session: &Session,
        (sharding, ranges): (bool, Option<&[Range]>),
        report: &mut Reporter<'_>,
    ) {
        if let Some(f) = &self.feeding {
            if f.feed.gone() {
                report.line(&format!("trainerd: {}'s catch-up ended: its stream is gone", f.name));
                self.feeding = None;
            }
            return;
        }
        if matches!(state.optimizer, Optim::Fresh(_)) || (sharding && !state.optimizer.sharded()) {
            return;
        }
        let Some(offer) = session.catch_up_offer(false) else { return };
        let name = session.name(offer.rank);
        let why_not = if self.memory == 0 {
            Some("--catch-up-memory is 0 on the coordinator".to_string())
        } else if offer.generation != session.generation() {
            Some(format!("generation {} ended", offer.generation))
        } else {
            None
        };
        if let Some(why) = why_not {
            report.line(&format!("trainerd: {name} cannot catch up: {why}; it joins as before"));
            offer.feed.fallback(&why);
            return;
        }
        let encoding = match state.snapshot_encoding() {
            Ok(e) => e,
            Err(e) => return offer.feed.fallback(&format!("its state could not be encoded: {e}")),
        };
        let copying = std::thread::Builder::new().name("trainerd-snapshot".into()).spawn(move || {
            let bytes = Bytes::from(encoding.bytes()?);
            let xxh3 = fingerprint(&bytes);
            Ok((bytes, xxh3))
        });
        let Ok(copying) = copying else { return offer.feed.fallback("no thread for the snapshot") };
        let step = state.position().global_step;
        let sharded = ranges.filter(|_| state.optimizer.sharded());
        let donors = sharded.map(|r| ranges::range_donors(session, r, offer.rank)).unwrap_or_default();
        report.line(&format!("trainerd: {name} catches up: sending the state at step {step} while training goes on"));
        self.feeding = Some(Feeding {
            rank: offer.rank,
            name,
            generation: offer.generation,
            feed: offer.feed,
            copying: Some(copying),
            state_queued: false,
            step_bytes: 0,
            switching: false,
            behind: None,
            from: (step, Instant::now()),
            donors,
        });
    }

    /// At a step's start (this member at global step `at`), after [`Donor::begin`]: whether the
    /// returner is close enough to level to take its slots back after this step (its state taken
    /// by the stream, at most one step's outputs waiting, and its replay, as it says, at most one
    /// step behind: the step about to be trained is then all it has left to replay once the
    /// others end it); its rank. A returner that replays no faster than this member trains (a
    /// small model's steps, whose cost is mostly their overhead) would never be: once 3 step
    /// starts pass without it coming closer, it switches anyway, and the others wait at the switch
    /// for what it has left. Not while others come back as before (`others`): their return ends
    /// the generation, and with it this catch-up (the returner joins as before).
    pub(super) fn switch(&mut self, others: bool, at: u64) -> Option<usize> {
        let f = self.feeding.as_mut()?;
        // Until the returner has said where its replay is, the stream's queue alone decides (with
        // ranges streamed, it waits for the returner's word that their streams began).
        let close = match f.feed.replayed() {
            None => f.donors.is_empty(),
            Some(r) => {
                let lag = at.saturating_sub(r);
                let (least, since) = match f.behind {
                    Some((least, since)) if lag >= least => (least, since + 1),
                    _ => (lag, 0),
                };
                f.behind = Some((least, since));
                // The streams of the returner's ranges begin first ("Ranges streamed").
                (lag <= 1 && !f.feed.ranges_pending()) || since >= 3
            }
        };
        let level = f.state_queued && f.feed.state_taken() && f.feed.kept() <= f.step_bytes && close;
        f.switching = level && !others;
        f.switching.then_some(f.rank)
    }

    /// At a step's start, once [`Donor::begin`] and [`Donor::switch`] ran: the feed of the step's
    /// buckets, when a returner is fed with its state queued, the step's update is the whole
    /// optimizer's (not sharded), and every parameter is plain float32 on the CPU; `groups` are the
    /// buckets' parameters, `v` the run's slots.
    pub(super) fn bucket_feed(&self, state: &TrainState, groups: &[Vec<usize>], v: usize) -> Option<BucketFeed> {
        let f = self.feeding.as_ref().filter(|f| f.state_queued && f.copying.is_none())?;
        let params = &state.model.params;
        let plain = params.iter().all(|(_, p)| crate::optim::elementwise::plain(p));
        if !matches!(state.optimizer, Optim::Whole(_)) || !plain {
            return None;
        }
        let of = |&i: &usize| (i, params[i].0.clone(), params[i].1.size());
        Some(BucketFeed {
            feed: f.feed.clone(),
            memory: self.memory,
            position: state.position().clone(),
            scale: 1.0 / v as f32,
            groups: groups.iter().map(|g| g.iter().map(of).collect()).collect(),
            sent: Mutex::new(Sent { params: vec![false; params.len()], bytes: 0 }),
        })
    }

    /// After the step's reduction (`ok`: it went through): the snapshot's copy is complete (the
    /// update may write), its bytes queued, and this step's outputs queued behind them, within
    /// the bound, without the gradients `sent` already in buckets; with `clip_norm`, the global
    /// norm the update clips the gradient at, sent first.
    pub(super) fn reduced(
        &mut self,
        (ok, clip_norm): (bool, Option<f64>),
        (state, sent): (&TrainState, Sent),
        formation: &str,
        report: &mut Reporter<'_>,
    ) {
        let Some(f) = self.feeding.as_mut() else { return };
        if let Some(copying) = f.copying.take() {
            match copying.join() {
                Ok(Ok((bytes, xxh3))) if ok => {
                    f.state_queued = f.feed.state((f.generation, formation), (&bytes, xxh3), &f.donors)
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return self.stop(&format!("its state could not be encoded: {e}"), report),
                Err(_) => return self.stop("the snapshot's thread panicked", report),
            }
        }
        if !ok || !f.state_queued {
            return;
        }
        // A sharded step's update is done by now (in its reduction): its parameters are sent.
        let bytes = match catch_up::capture(&state.model, state.optimizer.sharded(), clip_norm, &sent.params) {
            Ok(b) => b,
            Err(e) => return self.stop(&format!("a step's outputs could not be encoded: {e}"), report),
        };
        let (kept, len) = (f.feed.kept(), bytes.len() as u64);
        if kept + len > self.memory {
            let why = format!(
                "its kept outputs would take {}, above --catch-up-memory {}",
                size(kept + len),
                size(self.memory)
            );
            return self.stop(&why, report);
        }
        f.step_bytes = len + sent.bytes;
        f.feed.step(&Bytes::from(bytes));
    }

    /// After a step or an epoch's end: the position queued.
    pub(super) fn moved(&mut self, state: &TrainState, report: &mut Reporter<'_>) {
        let Some(f) = self.feeding.as_ref().filter(|f| f.state_queued) else { return };
        match serde_json::to_vec(state.position()) {
            Ok(json) => {
                f.feed.position(&Bytes::from(json));
            }
            Err(e) => self.stop(&format!("the position could not be encoded: {e}"), report),
        }
    }

    /// After a step that passed its comparison and commit: when the returner's flags were raised
    /// in it, the end (the generation ends after `step`), with the lineage digest.
    pub(super) fn passed(&mut self, step: u64, report: &mut Reporter<'_>) {
        if !self.feeding.as_ref().is_some_and(|f| f.switching) {
            return;
        }
        let f = self.feeding.take().expect("switching");
        let (from, began) = f.from;
        report.line(&format!(
            "trainerd: {} caught up: it takes its slots back after step {step} (state from step {from}, {:.2}s ago; at \
             most {} of outputs kept)",
            f.name,
            began.elapsed().as_secs_f64(),
            size(f.feed.peak())
        ));
        report.served_catch_up(f.feed.peak());
        f.feed.end(step, true);
    }

    /// The catch-up stops (`why`): the returner joins as before.
    pub(super) fn stop(&mut self, why: &str, report: &mut Reporter<'_>) {
        let Some(mut f) = self.feeding.take() else { return };
        if let Some(copying) = f.copying.take() {
            // Nothing may write the state while the copy reads it.
            let _ = copying.join();
        }
        report.line(&format!("trainerd: {}'s catch-up stopped: {why}; it takes its slots back with a pause", f.name));
        report.served_catch_up(f.feed.peak());
        f.feed.fallback(why);
    }

    /// The run finished after `step`: a returner fed from here, or one whose request waits, is
    /// told so (`FINISHED`: it exits 0, where otherwise it would join a cluster that is gone and,
    /// with no commit showing the end, wait for it), and this process waits for it to read that:
    /// until its stream closes, or [`FINISH_PATIENCE`] passes without its replay moving.
    pub(super) fn finish(&mut self, step: u64, session: &Session, report: &mut Reporter<'_>) {
        let (name, feed) = match self.feeding.take() {
            Some(mut f) => {
                if let Some(copying) = f.copying.take() {
                    let _ = copying.join();
                }
                report.served_catch_up(f.feed.peak());
                (f.name, f.feed)
            }
            None => match session.catch_up_offer(false) {
                Some(offer) => (session.name(offer.rank), offer.feed),
                None => return,
            },
        };
        if !feed.finished(step) {
            return;
        }
        report.line(&format!("trainerd: {name} is told the run finished at step {step}, as it catches up"));
        let mut moved = (feed.replayed(), Instant::now());
        while !feed.gone() {
            if feed.replayed() != moved.0 {
                moved = (feed.replayed(), Instant::now());
            }
            if moved.1.elapsed() >= FINISH_PATIENCE {
                report.line(&format!(
                    "trainerd: {name} did not read to the run's end in {}s; this process exits without it",
                    FINISH_PATIENCE.as_secs()
                ));
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Driver<'_> {
    /// At a step's start: the slots of the ranks that came back (known to the coordinator's
    /// process only), among them a returner fed from here that is level enough to take them back
    /// after this step (then true: it caught up); and the feed of this step's buckets to a
    /// returner fed from here ([`Donor::bucket_feed`]).
    pub(super) fn back(&mut self, state: &TrainState, session: &mut Session) -> (Vec<bool>, bool, Option<BucketFeed>) {
        let mut back = session.returning();
        let sharding = self.cfg.shard_optimizer && session.collective().world() >= 2 && session.slot_count() >= 2;
        let generation = session.generation();
        let ranges = self.sharding.as_ref().filter(|(g, _)| *g == generation).map(|(_, r)| r.as_slice());
        self.donor.begin(state, session, (sharding, ranges), &mut self.report);
        self.range_donor.begin((state, session), ranges, self.cfg.catch_up_memory, &mut self.report);
        let switching = self.donor.switch(!back.is_empty(), state.position().global_step);
        back.extend(switching);
        let flags =
            if back.is_empty() { Vec::new() } else { slots::of_ranks(session.slot_count(), session.world(), &back) };
        let buckets = self.donor.bucket_feed(state, self.buckets.groups(), session.slot_count());
        (flags, switching.is_some(), buckets)
    }

    /// A returner's catch-up from `catching`: the donor's state decoded, every step's outputs
    /// replayed through the same update, the positions taken; at the end, the next join reports
    /// the lineage digest. When it stops short (the bound, a failure, the donor gone), this
    /// process's state is dropped (it receives the formation's, as before) and the reason said.
    pub(super) fn catch_up(
        &mut self,
        state: &mut TrainState,
        session: &mut Session,
        (mut catching, started): (Catching, Instant),
    ) -> Result<(), Interrupt> {
        let began = Instant::now();
        let Some((generation, formation, from, donors)) = self.take_state(state, session, &mut catching)? else {
            return Ok(());
        };
        let mut ranging = Ranging::new(generation, donors);
        let mut counted = Replayed::default();
        // A step whose buckets came before its outputs.
        let mut taking: Option<Taking> = None;
        loop {
            if self.stop.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(Interrupt::Stopped);
            }
            let item = self.next_item((state, session), &mut catching, &mut ranging);
            if let (Some(_), Ok(Item::Position(_) | Item::End { .. } | Item::State { .. })) = (&taking, &item) {
                return self.caught_short(state, "a step's buckets came, and then no outputs of that step");
            }
            let replay = match item {
                Ok(Item::Bucket { total, first }) => {
                    let t = taking.get_or_insert_with(|| self.taking(state));
                    counted.buckets += 1;
                    self.take_bucket(state, &mut catching, t, (total, first))
                }
                Ok(Item::Step { total, first }) => {
                    self.ranges_before(state, &mut ranging, state.position().global_step + 1);
                    let t = taking.take().unwrap_or_else(|| self.taking(state));
                    self.replay(state, &mut catching, t, (total, first), session.slot_count()).map(|r| counted.step(r))
                }
                Ok(Item::Position(bytes)) => Self::take_position(state, session, (&bytes, ranging.pending())),
                Ok(Item::End { step, lineage: with_lineage }) if state.position().global_step == step => {
                    if with_lineage {
                        session.set_lineage(lineage(&formation, generation, step));
                    }
                    self.ranges_at_switch(state, std::mem::replace(&mut ranging, Ranging::Off), step);
                    self.caught_up = true;
                    self.say_caught_up((from, step), &counted, (began, started));
                    return Ok(());
                }
                Ok(Item::End { step, .. }) => {
                    Err(format!("the end came at step {step}, the replay is at {}", state.position().global_step))
                }
                Ok(Item::Fallback(why)) => {
                    return self.caught_short(state, &format!("{why}{}", Self::half_taken(&taking, state)))
                }
                Ok(Item::Finished { step }) => return Err(Self::finished(step, Some(state.position().global_step))),
                Ok(Item::State { .. }) => Err("a second state".to_string()),
                Ok(Item::Ranges(..) | Item::RangeGrads(..)) => Err("a range stream's item".to_string()),
                Err(why) => return self.caught_short(state, &why),
            };
            if let Err(why) = replay {
                return self.caught_short(state, &why);
            }
        }
    }

    /// Caught up, said and counted: from the state at step `from` to `step`, what was replayed,
    /// since `began` (the state's request) and `started` (this process's start).
    fn say_caught_up(&mut self, (from, step): (u64, u64), counted: &Replayed, times: (Instant, Instant)) {
        let (began, started) = times;
        let replayed = counted.steps;
        let mut how = Vec::new();
        if counted.by_range > 0 {
            how.push(format!("{} updated range by range as their pieces came", counted.by_range));
        }
        if counted.buckets > 0 {
            how.push(format!("{} bucket(s) sent as the donor's backward pass reduced them", counted.buckets));
        }
        let how = if how.is_empty() { String::new() } else { format!(" ({})", how.join("; ")) };
        self.report.line(&format!(
            "trainerd: caught up in {:.2}s: the state at step {from}, {replayed} step(s) replayed{how}; takes its slots \
             back after step {step}",
            began.elapsed().as_secs_f64()
        ));
        self.report.caught_up(counted.steps, started.elapsed());
    }

    /// The stream's first item, the donor's state, taken (said, and told to the donor): its
    /// generation, that generation's formation digest, and its step; `None` when the catch-up was
    /// refused or stopped (said).
    fn take_state(
        &mut self,
        state: &mut TrainState,
        session: &Session,
        catching: &mut Catching,
    ) -> Result<Option<Taken>, Interrupt> {
        let began = Instant::now();
        match catching.next() {
            Ok(Item::State { generation, formation, bytes, donors }) => {
                if let Err(e) = state.decode(bytes) {
                    // Nothing of it was taken, or part: either way this process's state is not one.
                    self.caught_short(state, &format!("the state received could not be taken: {e}"))?;
                    return Ok(None);
                }
                kernels::restored(&mut state.model.position, "the run", &mut self.report).map_err(Interrupt::Fatal)?;
                state.model.live = true;
                let from = state.position().global_step;
                session.caught_up_to(from, !donors.is_empty());
                self.report.line(&format!(
                    "trainerd: catching up: the state at step {from} of generation {generation} came in {:.2}s; \
                     replaying the steps trained since",
                    began.elapsed().as_secs_f64()
                ));
                Ok(Some((generation, formation, from, donors)))
            }
            // Refused before anything was taken: this process keeps what it restored.
            Ok(Item::Fallback(why)) | Err(why) => self.refused(&why).map(|()| None),
            Ok(Item::Finished { step }) => Err(Self::finished(step, None)),
            Ok(other) => self.refused(&format!("the stream began with {other:?}")).map(|()| None),
        }
    }

    /// The position after a step or an epoch's end taken (`bytes`), and told to the donor.
    fn take_position(state: &mut TrainState, session: &Session, (bytes, pending): (&[u8], bool)) -> Result<(), String> {
        let p: Position = serde_json::from_slice(bytes).map_err(|e| format!("a position could not be read: {e}"))?;
        session.caught_up_to(p.global_step, pending);
        state.model.position = p;
        Ok(())
    }

    /// What a catch-up stopped with a step `taking` in says of it.
    fn half_taken(taking: &Option<Taking>, state: &TrainState) -> String {
        let next = state.position().global_step + 1;
        taking.as_ref().map(|_| format!(" (step {next} half taken: its first buckets came)")).unwrap_or_default()
    }

    /// The run finished after `step` while this process came back, the donor says: it exits 0
    /// (nothing is left to do), saying where its replay reached (`replayed`), if it began one.
    fn finished(step: u64, replayed: Option<u64>) -> Interrupt {
        let said = match replayed {
            Some(at) => format!(
                "the run finished at step {step} while this worker caught up (the coordinator said so; its replay \
                 reached step {at})"
            ),
            None => format!("the run finished at step {step} as this worker came back (the coordinator said so)"),
        };
        Interrupt::Fatal(TrainError::Cluster(ClusterError::Finished(said)))
    }

    /// The catch-up was refused before any state came (`why`): it joins as before.
    fn refused(&mut self, why: &str) -> Result<(), Interrupt> {
        self.report.line(&format!("trainerd: no catch-up: {why}; joining with a pause"));
        Ok(())
    }

    /// The catch-up stopped short (`why`): this process's state is dropped, and it joins as
    /// before (it receives the formation's state).
    fn caught_short(&mut self, state: &mut TrainState, why: &str) -> Result<(), Interrupt> {
        state.model.live = false;
        self.report.line(&format!("trainerd: the catch-up stopped: {why}; joining with a pause"));
        Ok(())
    }
}
