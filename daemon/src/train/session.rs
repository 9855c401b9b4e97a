//! A member's place in the cluster across generations: it joins the next generation, forms its
//! ring, and moves the training state from the generation's source to the members that lack it,
//! verified by sha256. A failure on the way (a peer dies, the generation is aborted) is an
//! [`Interrupt::Abandoned`]: the member keeps its process and its state, and joins again.
//!
//! A run of one worker is a session too, whose every generation forms at once.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;

use super::error::TrainError;
use crate::cluster::catch_up::{Catching, NoCatchUp};
use crate::cluster::coordinator::rules::Report;
use crate::cluster::finding::Finding;
use crate::cluster::member::Settings;
use crate::cluster::parts::Said;
use crate::cluster::wire::{Formed, Identity};
use crate::cluster::{BindError, ClusterConfig, ClusterError, ControlPlane, Timeouts};
use crate::collective::{Backend, Collective, CollectiveError, DataListener, Link, Ring, Slots, Traffic};
use crate::state::{sha256_hex, Shareable};

/// How long a broken link waits for a peer's pushed notice before it blames the neighbour.
const NOTICE_GRACE: std::time::Duration = std::time::Duration::from_millis(30);

/// Why a formation, a step or a barrier did not go through.
#[derive(Debug)]
pub(crate) enum Interrupt {
    /// The generation was abandoned (a peer failed, or the cluster moved on): join again.
    Abandoned(String),
    /// A stop signal arrived while waiting for the cluster.
    Stopped,
    /// No member holds a state, and this member coordinates without having read its checkpoint
    /// location: it reads it, then joins again.
    ReadFirst,
    /// The run cannot go on.
    Fatal(TrainError),
}

impl From<TrainError> for Interrupt {
    fn from(e: TrainError) -> Interrupt {
        match e {
            TrainError::Collective(CollectiveError::Aborted { reason, .. }) => Interrupt::Abandoned(reason),
            TrainError::Collective(c) => Interrupt::Abandoned(c.to_string()),
            other => Interrupt::Fatal(other),
        }
    }
}

/// A generation this member has joined, its ring formed.
#[derive(Debug)]
pub(crate) struct Joined {
    /// The formation.
    pub(crate) formed: Formed,
    /// The source's state, when this member is one of its receivers (verified).
    pub(crate) received: Option<Vec<u8>>,
    /// This member's join reported a lineage digest ([`lineage`]) rather than its state's hash.
    pub(crate) by_lineage: bool,
    /// What peers found at comparisons of the replicas in the generation this member was in
    /// before ([`Session::tell`]).
    pub(crate) findings: Vec<Finding>,
}

/// How a worker begins: joined (or not) in the background, or with a catch-up stream to replay
/// first.
pub(crate) enum First {
    /// The first join's result, and why this process did not catch up instead, where the
    /// coordinator refused it while a generation trained (it joins with a pause).
    Joined(Result<Joined, Interrupt>, Option<String>),
    /// The coordinator feeds this returner (docs/fault-tolerance.md, "A return that does not
    /// pause the survivors").
    CatchUp(Catching),
}

/// A member of a cluster (or a worker alone).
pub(crate) struct Session {
    cluster: Option<Box<Member>>,
    /// The current generation's collectives.
    collective: Box<dyn Collective>,
    /// What carries each generation's collectives, formed over its ring.
    backend: Backend,
    /// Bytes and seconds of every generation's all-reduces.
    traffic: Traffic,
    /// The current generation (0 before the first).
    generation: u64,
    /// The ranks in the current generation, ascending (the ring's order).
    members: Vec<usize>,
    /// Alone: the generation of the latest commit, which the next must exceed.
    floor: u64,
    /// Slots of each worker: its replicas (`--devices`) times its micro-batches (`--accumulate`);
    /// the run has `world() * slots_per_worker` slots.
    slots_per_worker: usize,
    /// Whether every worker keeps its own slots and a lost worker's go to its neighbours
    /// ([`crate::collective::slots::assign_home`]: a sharded optimizer's ranges follow the slots,
    /// so a loss moves only the lost worker's); otherwise the slots are balanced ([`assign`]).
    ///
    /// [`assign`]: crate::collective::slots::assign
    home_slots: bool,
    /// The furthest global step this member's state reached since it last adopted a formation,
    /// and whether it went back from there for a repair: its next join says both.
    reached: u64,
    repaired: bool,
    /// The digest the next join reports instead of hashing the state: the lineage of a
    /// generation ended by a caught-up return ([`lineage`]).
    lineage: Option<String>,
    /// This member coordinates at its start and has not read its checkpoint location: it joins
    /// first, and reads the location only when the formation finds no member holding a state
    /// (docs/fault-tolerance.md, "Join first; read storage only when nobody holds the state").
    unread: bool,
}

/// The digest every member of generation `generation` (formed with digest `formation`) reports
/// for its state after step `step` when the generation ends by a caught-up return: they all hold
/// that generation's state at that step, the returner by replaying its outputs
/// (docs/fault-tolerance.md, "A return that does not pause the survivors"). A digest each already
/// has, so nobody hashes a whole state at the switch.
pub(crate) fn lineage(formation: &str, generation: u64, step: u64) -> String {
    sha256_hex(format!("trainerd lineage\n{formation}\n{generation}\n{step}").as_bytes())
}

struct Member {
    plane: ControlPlane,
    listener: DataListener,
    data_address: String,
    timeouts: Timeouts,
}

impl Session {
    /// A worker alone.
    pub(crate) fn single() -> Session {
        Session::of(None, vec![0])
    }

    /// A session of `cluster` (none: alone) before its first generation, `members` its ring.
    fn of(cluster: Option<Box<Member>>, members: Vec<usize>) -> Session {
        Session {
            cluster,
            collective: Box::new(Ring::single()),
            backend: Backend::Ring,
            traffic: Traffic::default(),
            generation: 0,
            members,
            floor: 0,
            slots_per_worker: 1,
            home_slots: false,
            reached: 0,
            repaired: false,
            lineage: None,
            unread: false,
        }
    }

    /// A worker alone when `cluster` is `None`, else a member of it whose peers must agree on
    /// `plugin` (its identity) and `run_config_json` (what decides the result).
    pub(crate) fn open(
        cluster: Option<&ClusterConfig>,
        (plugin, run_config_json): (String, String),
        settings: Settings<'_>,
    ) -> Result<Session, TrainError> {
        match cluster {
            None => Ok(Session::single()),
            Some(cluster) => {
                let identity = Identity { cluster_json: cluster.cluster_json(), plugin, run_config_json };
                Session::start(cluster, identity, settings)
            }
        }
    }

    /// Serves the control plane and the data listener at once (peers can reach this member while
    /// it loads), for `cluster` with `identity`.
    pub(crate) fn start(
        cluster: &ClusterConfig,
        identity: Identity,
        settings: Settings<'_>,
    ) -> Result<Session, TrainError> {
        let Settings { timeouts, network, state_dir } = settings;
        let plane = ControlPlane::start(cluster, identity, settings)?;
        let me = cluster.me();
        let name = plane.names()[cluster.rank].clone();
        let listener = DataListener::bind((network.bind, 0).into(), network.key.clone()).map_err(|source| {
            let reason = BindError::DataListener { bind: network.bind, source };
            TrainError::Cluster(ClusterError::Bind { address: me.address.clone(), member: name.clone(), reason })
        })?;
        let host = me.address.rsplit_once(':').map_or(me.address.as_str(), |(h, _)| h);
        let data_address = format!("{host}:{}", listener.local_addr().port());
        // Without a state directory, no position records tell the newest generation: a process
        // that coordinates at its start reads its location before it joins, as before.
        let unread = state_dir.is_some() && plane.coordinates().is_some();
        let member = Member { plane, listener, data_address, timeouts };
        Ok(Session { unread, ..Session::of(Some(Box::new(member)), Vec::new()) })
    }

    /// Whether this member has yet to read its checkpoint location (it coordinates at its start,
    /// and joins first).
    pub(crate) fn unread(&self) -> bool {
        self.unread
    }

    /// This member read its checkpoint location: its joins say so from now on.
    pub(crate) fn read(&mut self) {
        self.unread = false;
    }

    /// Carries the collectives over `backend` from the next generation on (each generation
    /// forms it over its ring, while its state moves).
    pub(crate) fn set_backend(&mut self, backend: Backend) {
        self.backend = backend;
    }

    /// Bytes this session sent in all-reduces, and seconds it spent in them.
    pub(crate) fn traffic(&self) -> (u64, f64) {
        self.traffic.totals()
    }

    /// Where this member listens: `control A, data B`; `None` for a lone worker.
    pub(crate) fn listening(&self) -> Option<String> {
        let m = self.cluster.as_ref()?;
        Some(format!("control {}, data {}", m.plane.listening(), m.listener.local_addr()))
    }

    /// Whether this is a member of a cluster (not a worker alone).
    pub(crate) fn clustered(&self) -> bool {
        self.cluster.is_some()
    }

    /// This member's rank.
    pub(crate) fn rank(&self) -> usize {
        self.cluster.as_ref().map_or(0, |m| m.plane.rank())
    }

    /// Whether this member coordinates now (a lone worker always does): it commits.
    pub(crate) fn coordinates(&self) -> bool {
        self.cluster.as_ref().is_none_or(|m| m.plane.coordinates().is_some())
    }

    /// Members in all.
    pub(crate) fn world(&self) -> usize {
        self.cluster.as_ref().map_or(1, |m| m.plane.names().len())
    }

    /// Gives each worker `n` slots of the run (one per device and micro-batch) from the next
    /// generation on; `home`: each keeps its own wherever it can (a sharded optimizer).
    pub(crate) fn set_slots_per_worker(&mut self, n: usize, home: bool) {
        self.slots_per_worker = n;
        self.home_slots = home;
    }

    /// Which slots each member holds, by place in the ring, when `members` (ranks, ascending)
    /// form a generation.
    pub(crate) fn layout(&self, members: &[usize]) -> Vec<std::ops::Range<usize>> {
        let count = self.slot_count();
        match self.home_slots {
            true => crate::collective::slots::assign_home(count, self.world(), members),
            false => crate::collective::slots::assign(count, members),
        }
    }

    /// The run's slots: every worker's.
    pub(crate) fn slot_count(&self) -> usize {
        self.world() * self.slots_per_worker
    }

    /// Every member's name, by rank.
    pub(crate) fn name(&self, rank: usize) -> String {
        self.cluster.as_ref().map_or_else(|| "this worker".into(), |m| m.plane.names()[rank].clone())
    }

    /// The name of the member at `place` in the current generation's ring order.
    pub(crate) fn name_at(&self, place: usize) -> String {
        self.name(self.members()[place])
    }

    /// The rank of the worker holding `slot` in the current generation.
    pub(crate) fn holder(&self, slot: usize) -> usize {
        self.members[self.collective.slots().holder_place(slot)]
    }

    /// The run's slots, and the ones this worker holds in the current generation.
    pub(crate) fn slots(&self) -> &Slots {
        self.collective.slots()
    }

    /// The ranks in the current generation, ascending (the ring's order).
    pub(crate) fn members(&self) -> &[usize] {
        &self.members
    }

    /// The current generation's collectives.
    pub(crate) fn collective(&mut self) -> &mut dyn Collective {
        self.collective.as_mut()
    }

    /// The current generation (0 before the first).
    pub(crate) fn generation(&self) -> u64 {
        match &self.cluster {
            Some(_) => self.generation,
            None => self.floor,
        }
    }

    /// On the chief: generations must exceed `generation` (the latest commit's).
    pub(crate) fn set_floor(&mut self, generation: u64) {
        match &self.cluster {
            Some(m) => m.plane.set_floor(generation),
            None => self.floor = self.floor.max(generation),
        }
    }

    /// On the chief: the latest commit was made by `generation`, of `members` (none named in
    /// commits before they were): a rank it left out is not waited for after every process
    /// restarted.
    pub(crate) fn set_committed(&self, generation: u64, members: &[usize]) {
        if let Some(m) = &self.cluster {
            m.plane.set_committed(generation, members);
        }
    }

    /// This member's state reached global step `step` (the furthest is what its beats and its
    /// next join carry).
    pub(crate) fn set_step(&mut self, step: u64) {
        self.reached = self.reached.max(step);
        if let Some(m) = &self.cluster {
            m.plane.set_step(step);
        }
    }

    /// This member adopted the formation at global step `step`: the steps before it are counted.
    pub(crate) fn adopted(&mut self, step: u64) {
        (self.reached, self.repaired) = (step, false);
        self.set_step(step);
    }

    /// This member went back (or dropped its state) because a comparison of the replicas found a
    /// corrupted one: the steps it undid are trained again on purpose.
    pub(crate) fn went_back_for_repair(&mut self) {
        self.repaired = true;
    }

    /// The next join reports `digest` (a [`lineage`]) instead of hashing the state.
    pub(crate) fn set_lineage(&mut self, digest: String) {
        self.lineage = Some(digest);
    }

    /// A returner's request to catch up, when this process coordinates; with `ranges`, its
    /// request for the ranges this member owns.
    pub(crate) fn catch_up_offer(&self, ranges: bool) -> Option<crate::cluster::catch_up::Offer> {
        let plane = &self.cluster.as_ref()?.plane;
        if ranges {
            plane.range_offer()
        } else {
            plane.catch_up_offer()
        }
    }

    /// Asks the coordinator to catch up with the generation it trains (see
    /// [`crate::cluster::ControlPlane::catch_up`]); why not, alone or coordinating.
    pub(crate) fn catch_up(&self) -> Result<Catching, NoCatchUp> {
        let Some(m) = self.cluster.as_ref() else { return Err(NoCatchUp::NothingTrains("a worker alone".into())) };
        m.plane.catch_up(m.timeouts.collective)
    }

    /// Asks member `donor` for the ranges it owns in `generation`; why not.
    pub(crate) fn catch_up_ranges(&self, donor: usize, generation: u64) -> Result<Catching, String> {
        let Some(m) = self.cluster.as_ref() else { return Err("a worker alone".into()) };
        m.plane.catch_up_ranges(donor, generation, m.timeouts.collective)
    }

    /// Tells the coordinator this returner's catch-up reached `step` (`pending`: the streams of
    /// its ranges have not all begun).
    pub(crate) fn caught_up_to(&self, step: u64, pending: bool) {
        if let Some(m) = self.cluster.as_ref() {
            m.plane.caught_up_to(step, pending);
        }
    }

    /// The ranks that came back to the generation this process coordinates (none elsewhere): it
    /// ends after the step about to be trained.
    pub(crate) fn returning(&self) -> Vec<usize> {
        self.cluster.as_ref().map(|m| m.plane.returning()).unwrap_or_default()
    }

    /// Joins the next generation with `state` (`None`: a fresh process with nothing to report),
    /// forms its ring, and receives the source's state if this member lacks it. Waits while the
    /// cluster gathers; `stop` ends the wait.
    pub(crate) fn join(&mut self, state: Option<&dyn Shareable>, stop: &AtomicBool) -> Result<Joined, Interrupt> {
        if self.cluster.is_none() {
            let mut ring = Ring::single();
            ring.set_slots(Slots::all(self.slots_per_worker));
            self.collective = Box::new(ring);
            self.floor += 1;
            let progress = state.map_or((0, 0), |s| s.progress());
            let formed = Formed::alone(self.floor, progress);
            return Ok(Joined { formed, received: None, by_lineage: false, findings: Vec::new() });
        }
        let (report, by_lineage) = self.report(state)?;
        let m = self.cluster.as_mut().expect("a member of a cluster");
        let formed = match m.plane.join(&m.data_address, &report, stop) {
            Ok(f) => f,
            Err(ClusterError::Stopped) => return Err(Interrupt::Stopped),
            // The driver reads the location, then joins again.
            Err(ClusterError::ReadFirst) => return Err(Interrupt::ReadFirst),
            Err(e) => return Err(Interrupt::Fatal(e.into())),
        };
        // Told while this member was still in the generation before (its finder tells every peer
        // before it leaves it), so all here by now.
        let findings = m.plane.findings(self.generation);
        let rank = m.plane.rank();
        let names = m.plane.names().to_vec();
        let abort = m.plane.abort_signal();
        // The ring runs over the generation's members, in rank order; the slots of the run (one
        // per replica and micro-batch of every rank) are spread over them.
        let members = formed.members.clone();
        let Some(place) = members.iter().position(|&r| r == rank) else {
            let why = format!("generation {} was formed without {}", formed.generation, names[rank]);
            return Err(Interrupt::Abandoned(why));
        };
        let ring_names: Vec<String> = members.iter().map(|&r| names[r].clone()).collect();
        let next = &formed.data_addresses[members[(place + 1) % members.len()]];
        let next_addr = crate::cluster::member::resolve(next)
            .map_err(|source| Interrupt::Fatal(ClusterError::DataAddress { address: next.clone(), source }.into()))?;
        let generation = formed.generation;
        let link = Link::new(generation, m.timeouts.collective, &abort, &self.traffic);
        let mut ring = match Ring::form(&m.listener, place, &ring_names, next_addr, link) {
            Ok(ring) => ring,
            Err(e) => return Err(self.abandon(generation, e)),
        };
        self.generation = generation;
        ring.set_members(&members);
        let count = names.len() * self.slots_per_worker;
        debug_assert_eq!(count, self.slot_count());
        ring.set_slots(Slots::of(count, self.layout(&members), place));
        self.members = members;
        self.collective = match self.backend.form(ring) {
            Ok(collective) => collective,
            Err(e) => return Err(self.abandon(generation, e)),
        };
        // Chaos tests stop a member here: a failure while a generation forms.
        trainerd_failpoint::point("formed");
        let received = self.transfer(&formed, state, &names)?;
        Ok(Joined { formed, received, by_lineage, findings })
    }

    /// What this member's join says of `state`, and whether its digest is the lineage set for it
    /// ([`lineage`]) rather than the state's hash.
    fn report(&mut self, state: Option<&dyn Shareable>) -> Result<(Report, bool), Interrupt> {
        let lineage = self.lineage.take();
        let Some(s) = state else { return Ok((Report::default(), false)) };
        let by_lineage = lineage.is_some();
        let digest = match lineage {
            Some(digest) => digest,
            None => s.digest().map_err(|e| Interrupt::Fatal(e.into()))?,
        };
        let (generation, progress, repaired, members) =
            (self.generation, s.progress(), self.repaired, self.members.clone());
        let reached = self.reached.max(progress.0);
        // A fresh process's start state: at a fresh start every member built the coordinator's.
        let start =
            if by_lineage { String::new() } else { s.start_digest().map_err(|e| Interrupt::Fatal(e.into()))? };
        let unread = self.unread;
        let report = Report { generation, progress, digest, reached, repaired, members, unread, recorded: None, start };
        Ok((report, by_lineage))
    }

    /// Moves the formation's state from its source to the members that lack it, over the new
    /// ring; what this member received (verified by sha256), if it is a receiver.
    fn transfer(
        &mut self,
        formed: &Formed,
        state: Option<&dyn Shareable>,
        names: &[String],
    ) -> Result<Option<Vec<u8>>, Interrupt> {
        if formed.receivers.is_empty() {
            return Ok(None);
        }
        let (rank, generation) = (self.rank(), formed.generation);
        let mine = if rank == formed.source {
            let state = state.filter(|s| s.live()).ok_or(Interrupt::Fatal(TrainError::NoStateToSend))?;
            state.encode().map_err(|e| Interrupt::Fatal(e.into()))?
        } else {
            Vec::new()
        };
        // Chaos tests stop a member here: a failure while the state moves.
        trainerd_failpoint::point("state-transfer");
        let root = self.members.iter().position(|&r| r == formed.source).unwrap_or(0);
        let bytes = match self.collective.broadcast_bytes(root, mine) {
            Ok(b) => b,
            Err(e) => return Err(self.abandon(generation, e)),
        };
        if !formed.receivers.contains(&rank) {
            return Ok(None);
        }
        let found = sha256_hex(&bytes);
        if found != formed.digest {
            let why = format!(
                "the state received from {} has sha256 {found}, its report said {}",
                names[formed.source], formed.digest
            );
            self.abandon_with(generation, &why, Some(formed.source));
            return Err(Interrupt::Abandoned(why));
        }
        Ok(Some(bytes))
    }

    /// A collective of `generation` failed here: abort the generation everywhere, and say why.
    pub(crate) fn abandon(&self, generation: u64, e: CollectiveError) -> Interrupt {
        if let CollectiveError::Aborted { reason, .. } = &e {
            return Interrupt::Abandoned(reason.clone());
        }
        // A neighbour that abandoned first shuts its sockets, which can reach us before its
        // notice does: give the notice a moment before blaming the neighbour.
        if let Some(m) = &self.cluster {
            let abort = m.plane.abort_signal();
            let until = std::time::Instant::now() + NOTICE_GRACE;
            while std::time::Instant::now() < until {
                if let Err(aborted) = abort.check(generation) {
                    return Interrupt::Abandoned(aborted.reason);
                }
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        }
        let reason = e.to_string();
        self.abandon_with(generation, &reason, e.suspect());
        Interrupt::Abandoned(reason)
    }

    fn abandon_with(&self, generation: u64, reason: &str, suspect: Option<usize>) {
        if let Some(m) = &self.cluster {
            m.plane.abandon(generation, reason, suspect);
        }
    }

    /// Tells every peer what this member found at the comparison of global step `step` in the
    /// current generation (the states of `odd` differed; `why`; `in_place`: no step is lost),
    /// before it acts on it: whatever becomes of this process, the next formation learns it
    /// ([`Joined::findings`]). How many peers kept it.
    pub(crate) fn tell(&self, step: u64, (odd, why, in_place): (&[String], &str, bool)) -> usize {
        self.cluster.as_ref().map_or(0, |m| m.plane.tell(self.generation(), step, (odd, why, in_place)))
    }

    /// How a thread that writes this member's parts of a sharded commit tells the coordinator
    /// what they came to (none alone).
    pub(crate) fn parts_reporter(&self) -> Option<crate::cluster::member::parts::PartsReporter> {
        self.cluster.as_ref().map(|m| m.plane.parts_reporter())
    }

    /// On the coordinator's process: what every member of the current generation said of its
    /// parts of commit `id` (planned in `generation`), by rank, taken once every member has said.
    pub(crate) fn parts_said(&self, generation: u64, id: &str) -> Option<BTreeMap<usize, Said>> {
        let m = self.cluster.as_ref()?;
        m.plane.parts_said((generation, id), &self.members)
    }

    /// Whether the current generation is still on: `Abandoned` once it has been aborted (a member
    /// lost), for a wait outside any collective.
    pub(crate) fn ended(&self) -> Result<(), Interrupt> {
        let Some(m) = &self.cluster else { return Ok(()) };
        m.plane.abort_signal().check(self.generation()).map_err(|aborted| Interrupt::Abandoned(aborted.reason))
    }

    /// Every member's `mine` (the same length on every member), in ring order, concatenated: one
    /// all-reduce of each member's values in its own place of zeros, whose sum is exact (an
    /// all-gather). Alone, `mine` itself.
    pub(crate) fn gather(&mut self, mine: &[f64]) -> Result<Vec<f64>, Interrupt> {
        let (place, present) = (self.collective.rank(), self.collective.world());
        let mut values = vec![0f64; mine.len() * present];
        values[place * mine.len()..(place + 1) * mine.len()].copy_from_slice(mine);
        if present > 1 {
            let reduced = self.collective.all_reduce_workers(&mut values, crate::collective::ReduceOp::Sum);
            reduced.map_err(|e| self.interrupt(e.into()))?;
        }
        Ok(values)
    }

    /// Turns a step's error into an interrupt, abandoning the generation on a collective failure.
    pub(crate) fn interrupt(&self, e: TrainError) -> Interrupt {
        match e {
            TrainError::Collective(c) => self.abandon(self.generation(), c),
            other => Interrupt::Fatal(other),
        }
    }

    /// Waits until every member reaches the barrier `name` of the current generation.
    pub(crate) fn barrier(&self, name: &str) -> Result<(), Interrupt> {
        let Some(m) = &self.cluster else { return Ok(()) };
        match m.plane.barrier(self.generation(), name) {
            Ok(()) => Ok(()),
            Err(ClusterError::Aborted { reason, .. }) => Err(Interrupt::Abandoned(reason)),
            Err(e) => Err(Interrupt::Fatal(e.into())),
        }
    }

    /// The run is over for every member (the final barrier passed): leave in an orderly way.
    pub(crate) fn finish(&self) {
        if let Some(m) = &self.cluster {
            m.plane.finish();
        }
    }

    /// Tells the chief this member leaves on purpose.
    /// While a join gets no answer, `probe` says whether the run has finished.
    pub(crate) fn set_finished_probe(&mut self, probe: crate::cluster::member::FinishedProbe) {
        if let Some(m) = self.cluster.as_mut() {
            m.plane.set_finished_probe(probe);
        }
    }

    pub(crate) fn leave(&self, reason: &str) {
        if let Some(m) = &self.cluster {
            m.plane.leave(reason);
        }
    }

    /// Why this process no longer counts (a newer one took its rank), if so.
    pub(crate) fn replaced(&self) -> Option<String> {
        self.cluster.as_ref().and_then(|m| m.plane.replaced())
    }
}
