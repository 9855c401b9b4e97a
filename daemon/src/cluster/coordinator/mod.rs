//! The coordinator's side of membership. The [`Coordinator`] lives in the chief's process (or,
//! once the chief is lost for good, in the process of a member elected by a majority;
//! [`super::election`]); the server every daemon runs hands it the calls ([`super::service`]).
//! It stores what joins, heartbeats, reports and departures say into a [`rules::State`], runs
//! [`rules::decide`] (the pure rules, [`rules`]) after every event and on a fine tick, and applies
//! the decisions (ending a generation and pushing the notice, forming the next one and answering
//! the waiting joins, giving up). It decides nothing itself. Who it admits is [`admission`].
//!
//! A member's side, what a member calls, is [`super::member`].

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tonic::Status;

use super::wire::{check_rank, proto, Formed, Identity};
use proto::notice::Kind;
use rules::{Effect, Gone, Report};

mod admission;
pub(crate) mod rules;

/// Barrier names are bounded, and so are the barriers of a generation (a peer cannot grow the
/// chief's memory with new names; the training loop uses two per generation at most).
const MAX_BARRIER_NAME: usize = 64;
const MAX_BARRIERS: usize = 16;

fn report_of(r: Option<proto::StateReport>) -> Report {
    let r = r.unwrap_or_default();
    Report {
        generation: r.generation,
        progress: (r.progress_major, r.progress_minor),
        digest: r.sha256,
        reached: r.reached,
        repaired: r.repaired,
        members: r.members.into_iter().map(|r| r as usize).collect(),
        recorded: r.recorded.map(|p| (p.generation, p.step)),
        unread: r.unread,
        start: r.start_sha256,
    }
}

/// A notice for a member's heartbeat stream.
fn notice(kind: Kind, generation: u64, reason: &str) -> proto::Notice {
    proto::Notice { kind: kind as i32, generation, reason: reason.into() }
}

pub(super) type NoticeSink = mpsc::UnboundedSender<Result<proto::Notice, Status>>;

/// The coordinator's stored state: the membership state the decisions read, and what the
/// control plane needs to carry them out.
struct Coord {
    state: rules::State,
    /// Data-plane addresses from the joins.
    addresses: Vec<String>,
    /// Each member's heartbeat stream, with the incarnation it belongs to.
    sinks: Vec<Option<(u64, NoticeSink)>>,
    /// The latest formation, as the waiting joins are answered with it.
    formation: Option<Formed>,
    /// A coordinator of a newer term exists: this one answers nothing any more, and why.
    deposed: Option<String>,
    /// Its own process's join is answered `read_first` ([`Effect::Read`]), until it joins again.
    read_first: bool,
}

/// Where a coordinator sits and since when: its rank and term, and the ranks already missing
/// when it took over (with the instant they were lost), which count as missing since then.
#[derive(Clone, Debug, Default)]
pub(crate) struct Seat {
    /// The rank of the process it lives in.
    pub(crate) rank: usize,
    /// Its term (0: the chief's, without a vote).
    pub(crate) term: u64,
    /// Ranks lost before it took over, and since when.
    pub(crate) lost: Vec<(usize, Instant)>,
    /// A generation formed before it took over: missing members get the rejoin deadline.
    pub(crate) ever_formed: bool,
}

/// The coordinator (the chief's, or one elected when the chief was lost for good).
pub(crate) struct Coordinator {
    expected: Identity,
    names: Vec<String>,
    seat: Seat,
    opts: rules::Options,
    inner: Mutex<Coord>,
    /// Bumped on every change a waiting call may care about.
    version: watch::Sender<u64>,
}

impl Coordinator {
    /// A coordinator for `names.len()` members that admits only `expected`, sitting in `seat`:
    /// its generations exceed its term.
    pub(crate) fn new(expected: Identity, names: Vec<String>, opts: rules::Options, seat: Seat) -> Arc<Coordinator> {
        let world = names.len();
        let now = Instant::now();
        let mut state = rules::State::new(world, seat.term, now);
        state.own = seat.rank;
        state.ever_formed = seat.ever_formed;
        for &(rank, since) in &seat.lost {
            state.members[rank].last_seen = since;
            state.members[rank].lost = true;
        }
        Arc::new(Coordinator {
            expected,
            opts,
            inner: Mutex::new(Coord {
                state,
                addresses: vec![String::new(); world],
                sinks: vec![None; world],
                formation: None,
                deposed: None,
                read_first: false,
            }),
            names,
            seat,
            version: watch::channel(0).0,
        })
    }

    /// Its term.
    pub(crate) fn term(&self) -> u64 {
        self.seat.term
    }

    /// A coordinator of a newer term exists: answer nothing more (waiting calls get `why`, the
    /// heartbeat streams close).
    pub(crate) fn depose(&self, why: &str) {
        let mut c = self.lock();
        if c.deposed.is_none() {
            tracing::warn!("{}", why);
            c.deposed = Some(why.to_string());
            c.sinks.iter_mut().for_each(|s| *s = None);
            self.version.send_modify(|v| *v += 1);
        }
    }

    /// The ranks left out of the formed generation that joined (they came back): it ends at the
    /// members' next step boundary. The coordinator's process raises their return flags in its
    /// next step's all-reduce, so every member learns it at the same step.
    pub(crate) fn returning(&self) -> Vec<usize> {
        rules::returners(&self.lock().state, Instant::now(), &self.opts)
    }

    /// Whether it is gathering members (no generation formed, or the last one ended).
    pub(crate) fn gathering(&self) -> bool {
        !self.lock().state.formed
    }

    /// The name of this coordinator's role: `the chief, worker 0 (…)` or `the coordinator, …`.
    fn role(&self) -> String {
        let name = &self.names[self.seat.rank];
        if self.seat.term == 0 {
            format!("the chief, {name}")
        } else {
            format!("the coordinator, {name}")
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Coord> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// After the final barrier: whether every member other than the coordinator's own has left
    /// or disconnected (so that its exit can no longer cut off a reply they wait for).
    pub(crate) fn departed(&self) -> bool {
        let c = self.lock();
        let others = c.state.members.iter().enumerate().filter(|(r, _)| *r != self.seat.rank);
        c.state.finished && others.map(|(_, m)| m).all(|m| m.gone.is_some() || !m.connected || !m.active)
    }

    /// After a give-up: whether every member told of it has left or disconnected (so that the
    /// chief's exit can no longer cut off the answer on its way).
    pub(crate) fn answered(&self) -> bool {
        self.lock().state.unanswered.is_empty()
    }

    /// The next formation must exceed `generation` (the latest commit's).
    pub(crate) fn set_floor(&self, generation: u64) {
        let mut c = self.lock();
        c.state.floor = c.state.floor.max(generation);
    }

    /// The latest commit was made by `generation`, of `members`: before any join reports a
    /// generation as new, a rank it left out counts as gone at once.
    pub(crate) fn set_committed(&self, generation: u64, members: &[usize]) {
        let mut c = self.lock();
        if !members.is_empty() {
            c.state.committed = Some((generation, members.to_vec()));
        }
    }

    /// Runs the decisions until none is due, and wakes every waiting call (after an event, or
    /// when a decision changed something).
    fn settle(&self, c: &mut Coord) {
        self.decide(c);
        self.version.send_modify(|v| *v += 1);
    }

    /// Runs the decisions until none is due; true if any was.
    fn decide(&self, c: &mut Coord) -> bool {
        let now = Instant::now();
        if c.deposed.is_some() {
            return false;
        }
        let mut any = false;
        while let Some(decision) = rules::decide(&c.state, now, &self.opts) {
            let effect = c.state.apply(decision, now, &self.names);
            self.carry(c, effect);
            any = true;
        }
        c.state.last_tick = now;
        any
    }

    /// Carries out what applying a decision requires.
    fn carry(&self, c: &mut Coord, effect: Effect) {
        match effect {
            Effect::Grace => {
                tracing::warn!(
                    "coordinator: did not run for a while (paused?); counting every member as just heard from"
                )
            }
            Effect::Ended { generation, reason } => {
                tracing::info!("generation {generation} ended: {reason}");
                for (_, sink) in c.sinks.iter().flatten() {
                    let _ = sink.send(Ok(notice(Kind::Ended, generation, &reason)));
                }
            }
            Effect::Formed(f) => {
                tracing::info!("generation {} formed from {}'s state", f.generation, self.names[f.source]);
                c.formation = Some(Formed {
                    generation: f.generation,
                    data_addresses: c.addresses.clone(),
                    source: f.source,
                    progress: f.progress,
                    digest: f.digest,
                    receivers: f.receivers,
                    recovery: f.recovery,
                    steps_trained_again: f.steps_trained_again,
                    steps_lost: f.steps_lost,
                    members: f.members,
                    coordinator: self.seat.rank,
                    term: self.seat.term,
                });
            }
            Effect::GaveUp => tracing::warn!("coordinator gave up: {}", c.state.gave_up),
            Effect::Read => {
                tracing::info!("no member holds a state: this process reads its checkpoint location first");
                c.read_first = true;
            }
        }
    }

    /// Runs the decisions every `interval` (deadlines pass without any message).
    pub(crate) async fn tick(self: Arc<Self>, interval: Duration) {
        loop {
            tokio::time::sleep(interval).await;
            let mut c = self.lock();
            if c.deposed.is_some() {
                return;
            }
            if self.decide(&mut c) {
                self.version.send_modify(|v| *v += 1);
            }
        }
    }

    /// Waits (without losing a wakeup) until `done` returns a value.
    async fn wait_for<T>(&self, mut done: impl FnMut(&Coord) -> Option<T>) -> T {
        let mut rx = self.version.subscribe();
        loop {
            if let Some(v) = done(&self.lock()) {
                return v;
            }
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Records that `incarnation` holds `rank`. Incarnations grow with each process start, so
    /// a newer process replaces an older one, and an older one (frozen, then resumed) is
    /// refused.
    fn claim(&self, c: &mut Coord, rank: usize, incarnation: u64) -> Result<(), Status> {
        let m = &mut c.state.members[rank];
        match m.incarnation {
            Some(current) if current == incarnation => return Ok(()),
            Some(current) if current > incarnation => {
                return Err(Status::failed_precondition(format!(
                    "a newer process (incarnation {current:x}) holds {}; this one ({incarnation:x}) is stale",
                    self.names[rank]
                )))
            }
            _ => {}
        }
        if m.incarnation.is_some() && m.active {
            m.gone = Some(Gone::Restarted);
        }
        m.incarnation = Some(incarnation);
        m.joined = None;
        m.connected = false;
        m.lost = false;
        if let Some((old, sink)) = c.sinks[rank].take() {
            let _ = sink.send(Ok(notice(
                Kind::Replaced,
                0,
                &format!(
                    "a newer process (incarnation {incarnation:x}) took {}; this one ({old:x}) stops",
                    self.names[rank]
                ),
            )));
        }
        Ok(())
    }

    fn current(&self, c: &Coord, rank: usize, incarnation: u64) -> Result<(), Status> {
        if c.state.members[rank].incarnation == Some(incarnation) {
            Ok(())
        } else {
            Err(Status::failed_precondition(format!("{} is held by another process", self.names[rank])))
        }
    }

    pub(super) async fn join(&self, req: proto::JoinRequest) -> Result<proto::JoinReply, Status> {
        let rank = check_rank(req.rank, self.names.len())?;
        if let Some(why) = self.mismatch(rank, (&req.cluster_json, &req.plugin_identity, &req.run_config_json)) {
            tracing::warn!("refused {}: {why}", self.names[rank]);
            eprintln!("trainerd: refused {}: {why}", self.names[rank]);
            return Err(Status::failed_precondition(why));
        }
        let incarnation = req.incarnation;
        let (since_generation, since_give_ups) = {
            let mut c = self.lock();
            self.claim(&mut c, rank, incarnation)?;
            let report = report_of(req.report);
            c.addresses[rank] = req.data_address;
            if let Some(why) = &c.deposed {
                return Err(Status::unavailable(why.clone()));
            }
            if c.state.closed {
                if rank != self.seat.rank {
                    c.state.unanswered.insert(rank);
                }
                return Err(Status::aborted(c.state.gave_up.clone()));
            }
            tracing::debug!("{} asks to join (term {})", self.names[rank], req.term);
            let m = &c.state.members[rank];
            if c.state.formed && !m.active && m.joined.is_none() {
                eprintln!(
                    "trainerd: {} came back; generation {} ends at its members' next step boundary (at once \
                     where they wait at the run's end)",
                    self.names[rank], c.state.generation
                );
            }
            c.state.joined(&report);
            if rank == self.seat.rank {
                // Its own join again: after a read, if it was asked to read first.
                (c.state.reading, c.read_first) = (false, false);
            }
            let m = &mut c.state.members[rank];
            m.joined = Some(report);
            m.last_seen = Instant::now();
            let seen = (c.formation.as_ref().map_or(0, |f| f.generation), c.state.give_ups);
            self.settle(&mut c);
            seen
        };
        self.wait_for(|c| self.answer(c, (rank, incarnation), (since_generation, since_give_ups))).await
    }

    /// The answer for the join of `rank` by `incarnation`, once there is one: a formation after
    /// generation `since` that holds it (or, for its own process, `read_first`), or a give-up after
    /// `give_ups`, or why it no longer counts.
    fn answer(
        &self,
        c: &Coord,
        (rank, incarnation): (usize, u64),
        (since, give_ups): (u64, u64),
    ) -> Option<Result<proto::JoinReply, Status>> {
        if let Some(why) = &c.deposed {
            return Some(Err(Status::unavailable(why.clone())));
        }
        if c.state.members[rank].incarnation != Some(incarnation) {
            let why = format!("another process took {} while this one was joining", self.names[rank]);
            return Some(Err(Status::failed_precondition(why)));
        }
        if rank == self.seat.rank && c.read_first {
            return Some(Ok(proto::JoinReply { read_first: true, ..proto::JoinReply::default() }));
        }
        // A formation this member is left out of (it was missing too long) is not its answer: it
        // waits, and its join brings the next generation about once it is live.
        if let Some(f) = c.formation.as_ref().filter(|f| f.generation > since && f.members.contains(&rank)) {
            return Some(Ok(proto::JoinReply::from(f)));
        }
        (c.state.give_ups > give_ups).then(|| Err(Status::aborted(c.state.gave_up.clone())))
    }

    /// A beat on `rank`'s stream: the stream now speaks for `incarnation`.
    pub(super) fn beat(&self, beat: &proto::Beat, sink: &NoticeSink, registered: &mut Option<(usize, u64)>) -> bool {
        let Ok(rank) = check_rank(beat.rank, self.names.len()) else { return false };
        let mut c = self.lock();
        if c.deposed.is_some() {
            return false;
        }
        if registered.is_none() {
            // The first beat of a stream: a process that already joined, or a new one.
            if let Err(stale) = self.claim(&mut c, rank, beat.incarnation) {
                let _ = sink.send(Ok(notice(Kind::Replaced, 0, stale.message())));
                return false;
            }
            c.sinks[rank] = Some((beat.incarnation, sink.clone()));
            *registered = Some((rank, beat.incarnation));
        } else if c.state.members[rank].incarnation != Some(beat.incarnation) {
            return false; // replaced; the Replaced notice was sent on this stream
        }
        c.state.heard(beat.generation, beat.step);
        let generation = c.state.generation;
        let m = &mut c.state.members[rank];
        let newly = !m.connected;
        m.connected = true;
        m.lost = false;
        m.last_seen = Instant::now();
        // A member still in a generation that ended (it missed the notice, or was frozen) is told.
        let stale = beat.generation > 0 && beat.generation < generation && !m.active && m.joined.is_none();
        let reply = match c.state.ended.range(beat.generation..).next().filter(|_| stale) {
            Some((&ended, why)) => notice(Kind::Ended, ended, why),
            None => notice(Kind::Ack, generation, ""),
        };
        let _ = sink.send(Ok(reply));
        if newly {
            tracing::debug!("{}'s heartbeat stream is open", self.names[rank]);
            self.settle(&mut c);
        }
        true
    }

    pub(super) fn disconnected(&self, rank: usize, incarnation: u64) {
        let mut c = self.lock();
        if c.state.members[rank].incarnation == Some(incarnation) {
            c.state.members[rank].connected = false;
            c.state.members[rank].lost = true;
            c.sinks[rank] = None;
            c.state.unanswered.remove(&rank);
            self.settle(&mut c);
        }
    }

    pub(super) fn report(&self, req: proto::ReportRequest) -> Result<(), Status> {
        let rank = check_rank(req.rank, self.names.len())?;
        let suspect = check_rank(req.suspect, self.names.len())?;
        let mut c = self.lock();
        self.current(&c, rank, req.incarnation)?;
        if c.state.formed && req.generation == c.state.generation && c.state.members[suspect].active {
            let why = format!("was reported by {}: {}", self.names[rank], req.reason);
            c.state.members[suspect].gone.get_or_insert(Gone::Reported(why));
            self.settle(&mut c);
        }
        Ok(())
    }

    pub(super) fn leave(&self, req: proto::LeaveRequest) -> Result<(), Status> {
        let rank = check_rank(req.rank, self.names.len())?;
        let mut c = self.lock();
        self.current(&c, rank, req.incarnation)?;
        let finished = c.state.finished;
        c.state.unanswered.remove(&rank);
        let m = &mut c.state.members[rank];
        m.joined = None;
        if m.active || finished {
            m.gone = Some(Gone::Left(req.reason.chars().take(200).collect()));
        }
        self.settle(&mut c);
        Ok(())
    }

    pub(super) async fn barrier(&self, req: proto::BarrierRequest) -> Result<(), Status> {
        let rank = check_rank(req.rank, self.names.len())?;
        if req.name.len() > MAX_BARRIER_NAME {
            return Err(Status::invalid_argument(format!("barrier names are at most {MAX_BARRIER_NAME} bytes")));
        }
        let key = (req.generation, req.name.clone());
        {
            let mut c = self.lock();
            self.current(&c, rank, req.incarnation)?;
            if !c.state.formed || req.generation != c.state.generation {
                let why = c.state.ended.get(&req.generation).cloned().unwrap_or_else(|| "it is not current".into());
                return Err(Status::aborted(why));
            }
            if !c.state.members[rank].active {
                return Err(Status::aborted(format!("{} is not in generation {}", self.names[rank], req.generation)));
            }
            let world = c.state.members.iter().filter(|m| m.active).count();
            let open = c.state.barriers.keys().filter(|(g, _)| *g == req.generation).count();
            if open >= MAX_BARRIERS && !c.state.barriers.contains_key(&key) {
                return Err(Status::resource_exhausted(format!("a generation has at most {MAX_BARRIERS} barriers")));
            }
            let arrived = c.state.barriers.entry(key.clone()).or_default();
            arrived.insert(rank);
            if arrived.len() == world && req.name == rules::FINAL_BARRIER {
                c.state.finished = true;
            }
            self.settle(&mut c);
        }
        self.wait_for(|c| {
            if let Some(why) = &c.deposed {
                return Some(Err(Status::unavailable(why.clone())));
            }
            let world = c.state.members.iter().filter(|m| m.active).count();
            if c.state.barriers.get(&key).is_some_and(|s| s.len() == world) {
                return Some(Ok(()));
            }
            (c.state.generation != req.generation)
                .then(|| Err(Status::aborted(c.state.ended.get(&req.generation).cloned().unwrap_or_default())))
        })
        .await
    }
}
