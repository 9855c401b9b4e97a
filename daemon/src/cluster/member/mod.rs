//! A member's side of the control plane: the server every daemon runs (with the coordinator on
//! the chief), the heartbeat stream to the chief ([`heartbeat`]), and the blocking calls the
//! training thread makes: [`ControlPlane::join`] (the next generation), [`ControlPlane::barrier`],
//! [`ControlPlane::abandon`] (a failure seen here: abort the generation and push the notice to
//! every peer) and [`ControlPlane::leave`].
//!
//! The member's decisions are pure functions ([`watch`]): when the chief counts as lost (the
//! heartbeat stream breaks because the chief died, or its acks stop because it froze: the member
//! then aborts its generation and tells every peer, so nobody waits for a timeout), and when a
//! join stops waiting. The chief's answers are read one way for every call
//! ([`super::error::from_status`]); [`dial`] is how a member reaches the others.

mod catch_up;
pub(crate) mod dial;
mod elect;
mod finished;
mod formed;
mod found;
pub(crate) mod heartbeat;
pub(crate) mod parts;
mod position;
mod setup;
pub(crate) mod watch;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::oneshot;
use tonic::transport::Channel;

use super::catchup::Hub;
use super::coordinator::rules::Report;
use super::coordinator::Coordinator;
use super::election::Elections;
use super::error::{from_status, Call, ClusterError};
use super::finding::Findings;
use super::network::Network;
use super::parts::Reports;
use super::service::{seated, Chair, Service};
use super::tf_config::ClusterConfig;
use super::timeouts::Timeouts;
use super::wire::{proto, ControlClient, Formed, Identity};
use crate::collective::{AbortSignal, Aborted};
pub(crate) use dial::resolve;
use dial::{push_abort, Dial};
use heartbeat::Beater;
use position::PositionRecord;
use setup::{bind, control_runtime, peers, run_identity, seat, serve};
use watch::{JoinEnd, JoinWait};

/// What the heartbeat task and the training thread share.
struct Shared {
    /// The generation this member is in (0 before the first).
    generation: AtomicU64,
    /// The furthest global step its state reached in its generation (0 until it adopted the
    /// formation), carried by the beats.
    step: AtomicU64,
    abort: AbortSignal,
    /// Set when a newer process took this rank: nothing this one does counts any more.
    replaced: Mutex<Option<String>>,
    /// When the coordinator last answered (ms since `epoch`), so a member waits for an answer
    /// as long as it is alive and gives up only when it is unreachable.
    last_contact_ms: AtomicU64,
    epoch: Instant,
    /// This member's vote, and the coordinator it follows.
    elections: Arc<Elections>,
    /// The latest commit's generation, which every formation must exceed (whoever coordinates).
    floor: AtomicU64,
    /// It said that nothing it reads shows the run finished ([`ControlPlane::finished`]).
    said_unfinished: AtomicBool,
}

impl Shared {
    fn new(abort: AbortSignal, elections: Arc<Elections>) -> Shared {
        let (generation, step, last_contact_ms) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
        let (replaced, epoch, floor) = (Mutex::new(None), Instant::now(), AtomicU64::new(0));
        let said_unfinished = AtomicBool::new(false);
        Shared { generation, step, abort, replaced, last_contact_ms, epoch, elections, floor, said_unfinished }
    }

    fn touch(&self) {
        self.last_contact_ms.store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn last_contact(&self) -> Instant {
        self.epoch + Duration::from_millis(self.last_contact_ms.load(Ordering::Relaxed))
    }

    fn replaced(&self) -> Option<String> {
        self.replaced.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

/// A process's incarnation: its start time in nanoseconds with random low bits, so that a
/// restarted process's is larger than its predecessor's.
fn new_incarnation() -> u64 {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    (nanos & !0xffff) | (rand::random::<u64>() & 0xffff)
}

/// This daemon's control plane: its server, and its calls to the coordinator and its peers.
pub(crate) struct ControlPlane {
    runtime: tokio::runtime::Runtime,
    listening: std::net::SocketAddr,
    rank: usize,
    names: Vec<String>,
    /// How to reach each rank.
    dials: Arc<Vec<Dial>>,
    identity: Identity,
    chair: Chair,
    shutdown: Option<oneshot::Sender<()>>,
    incarnation: u64,
    timeouts: Timeouts,
    shared: Arc<Shared>,
    peers: Arc<Vec<Option<ControlClient<Channel>>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    formed_once: bool,
    /// Whether the run has finished (from the checkpoint location), asked while a join gets no
    /// answer from the coordinator: `Some(what to say)`.
    finished: Option<FinishedProbe>,
    /// Where the service leaves a returner's request to catch up, when this process coordinates.
    hub: Arc<Hub>,
    /// Where the service leaves what peers found at comparisons of the replicas.
    findings: Arc<Findings>,
    /// This process's position record (with a state directory), and what the process before it
    /// recorded: its first join reports that.
    position: Option<position::Kept>,
    /// Where the service leaves what members said of their parts of sharded commits.
    parts: Arc<Reports>,
}

/// Says whether the run has finished, and at which step and commit (blocking: it reads storage).
pub(crate) type FinishedProbe = Arc<dyn Fn() -> Option<String> + Send + Sync>;

/// `call`'s answer, or `None` once `gone` says it is no longer waited for (looked at every 50 ms).
async fn answered<T>(call: impl std::future::Future<Output = T>, gone: impl Fn() -> bool) -> Option<T> {
    tokio::pin!(call);
    loop {
        tokio::select! {
            r = &mut call => return Some(r),
            () = tokio::time::sleep(Duration::from_millis(50)) => if gone() { return None },
        }
    }
}

impl ControlPlane {
    /// Serves the control plane on this member's TF_CONFIG port (the chief also coordinates,
    /// or the member its kept vote says coordinates), bound and authenticated as `network`
    /// says, and starts beating to the coordinator. `state_dir` keeps this member's vote (none:
    /// it takes no part in electing a coordinator when the chief is lost for good).
    pub(crate) fn start(
        cluster: &ClusterConfig,
        identity: Identity,
        timeouts: Timeouts,
        network: &Network,
        state_dir: Option<&std::path::Path>,
    ) -> Result<ControlPlane, ClusterError> {
        let names: Vec<String> = cluster.members.iter().map(|m| m.to_string()).collect();
        let runtime = control_runtime()?;
        let listener = bind(cluster, network, &names[cluster.rank])?;
        let listening = listener.local_addr().map_err(ClusterError::Setup)?;
        let abort = AbortSignal::new();
        let (elections, chair) = seat(cluster, &identity, timeouts, state_dir)?;
        let position = PositionRecord::kept(state_dir, cluster.rank, &run_identity(&identity))?;
        let (hub, findings, parts): (Arc<Hub>, Arc<Findings>, Arc<Reports>) = Default::default();
        let service = Service {
            rank: cluster.rank,
            names: names.clone(),
            chair: Arc::clone(&chair),
            elections: Arc::clone(&elections),
            abort: abort.clone(),
            hub: Arc::clone(&hub),
            findings: Arc::clone(&findings),
            parts: Arc::clone(&parts),
        };
        let (shutdown, shutdown_rx) = oneshot::channel::<()>();
        // Serving, and the peers' clients (which connect on first use), need the runtime.
        let (mut tasks, peers) = {
            let _guard = runtime.enter();
            let listener = tokio::net::TcpListener::from_std(listener).map_err(ClusterError::Setup)?;
            (serve(listener, service, network, shutdown_rx), peers(cluster, network))
        };
        if let Some(c) = &seated(&chair) {
            tasks.push(runtime.spawn(Arc::clone(c).tick(timeouts.heartbeat_interval / 4)));
        }
        let mut plane = ControlPlane {
            runtime,
            listening,
            rank: cluster.rank,
            dials: Arc::new(cluster.members.iter().map(|m| Dial::new(&m.address, &network.key)).collect()),
            names,
            identity,
            chair,
            shutdown: Some(shutdown),
            incarnation: new_incarnation(),
            timeouts,
            shared: Arc::new(Shared::new(abort, elections)),
            peers: Arc::new(peers),
            tasks,
            formed_once: false,
            finished: None,
            hub,
            findings,
            position,
            parts,
        };
        let (beater, elector) = (plane.beater(), plane.elector());
        plane.tasks.extend([plane.runtime.spawn(beater.run()), plane.runtime.spawn(elector.run())]);
        Ok(plane)
    }

    /// The coordinator this member follows: its term, rank and how to reach it (`None` while an
    /// election's winner is unknown).
    fn coordinator(&self) -> Option<(u64, usize, &Dial)> {
        self.shared.elections.coordinator().map(|(term, rank)| (term, rank, &self.dials[rank]))
    }

    /// The coordinator's name, or what stands in for it while none is known.
    fn coordinator_name(&self) -> String {
        match self.coordinator() {
            Some((_, rank, _)) => self.names[rank].clone(),
            None => "(being elected)".into(),
        }
    }

    /// The coordinator in this process, if it coordinates.
    fn seated(&self) -> Option<Arc<Coordinator>> {
        seated(&self.chair)
    }

    /// Whether this process coordinates now, and in which term.
    pub(crate) fn coordinates(&self) -> Option<u64> {
        self.seated().map(|c| c.term())
    }

    /// The address the control plane listens on.
    pub(crate) fn listening(&self) -> std::net::SocketAddr {
        self.listening
    }

    /// Names of the members, by rank (`worker 1 (host:port)`).
    pub(crate) fn names(&self) -> &[String] {
        &self.names
    }

    /// This member's rank.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// The abort signal of this member's collectives (raised by notices).
    pub(crate) fn abort_signal(&self) -> AbortSignal {
        self.shared.abort.clone()
    }

    /// The next formation's generation must exceed `generation` (the latest commit's), whoever
    /// coordinates it.
    pub(crate) fn set_floor(&self, generation: u64) {
        self.shared.floor.fetch_max(generation, Ordering::Relaxed);
        if let Some(c) = self.seated() {
            c.set_floor(generation);
        }
    }

    /// The latest commit was made by `generation`, of `members`: told to the coordinator this
    /// process holds, if any.
    pub(crate) fn set_committed(&self, generation: u64, members: &[usize]) {
        if let Some(c) = self.seated() {
            c.set_committed(generation, members);
        }
    }

    /// This member's state reached global step `step` in its generation: the furthest is what
    /// the beats carry.
    pub(crate) fn set_step(&self, step: u64) {
        let furthest = self.shared.step.fetch_max(step, Ordering::Relaxed).max(step);
        if let Some((record, _)) = &self.position {
            record.write(self.shared.generation.load(Ordering::Relaxed), furthest);
        }
    }

    /// The ranks that came back to the generation this process coordinates (none elsewhere): it
    /// ends at the next step boundary.
    pub(crate) fn returning(&self) -> Vec<usize> {
        self.seated().map(|c| c.returning()).unwrap_or_default()
    }

    /// Why this process no longer counts (a newer one holds its rank), if so.
    pub(crate) fn replaced(&self) -> Option<String> {
        self.shared.replaced()
    }

    /// The heartbeat task's part.
    fn beater(&self) -> Beater {
        Beater {
            dials: Arc::clone(&self.dials),
            names: Arc::new(self.names.clone()),
            rank: self.rank as u32,
            incarnation: self.incarnation,
            timeouts: self.timeouts,
            shared: Arc::clone(&self.shared),
            peers: Arc::clone(&self.peers),
        }
    }

    /// The elector task's part.
    fn elector(&self) -> elect::Elector {
        elect::Elector {
            rank: self.rank,
            names: Arc::new(self.names.clone()),
            peers: Arc::clone(&self.peers),
            shared: Arc::clone(&self.shared),
            chair: Arc::clone(&self.chair),
            identity: self.identity.clone(),
            timeouts: self.timeouts,
        }
    }

    /// Joins the next generation with `report`, waiting while the chief is reachable for as long
    /// as the coordinator waits (it enforces the rendezvous timeout and the rejoin deadline), and
    /// at most that long while it is not. `data_address` is this member's ring listener.
    pub(crate) fn join(
        &mut self,
        data_address: &str,
        report: &Report,
        stop: &AtomicBool,
    ) -> Result<Formed, ClusterError> {
        let wait = JoinWait::new(Instant::now(), self.formed_once, (self.timeouts.rendezvous, self.timeouts.rejoin));
        let request = proto::JoinRequest {
            rank: self.rank as u32,
            incarnation: self.incarnation,
            cluster_json: self.identity.cluster_json.clone(),
            plugin_identity: self.identity.plugin.clone(),
            run_config_json: self.identity.run_config_json.clone(),
            data_address: data_address.to_string(),
            report: Some(proto::StateReport {
                generation: report.generation,
                progress_major: report.progress.0,
                progress_minor: report.progress.1,
                sha256: report.digest.clone(),
                reached: report.reached,
                repaired: report.repaired,
                members: report.members.iter().map(|&r| r as u32).collect(),
                unread: report.unread,
                // Until this process is in a generation: what the process before it recorded.
                recorded: self
                    .position
                    .as_ref()
                    .and_then(|(_, r)| *r)
                    .filter(|_| !self.formed_once)
                    .map(|(generation, step)| proto::Position { generation, step }),
            }),
            term: 0,
        };
        let result = self.runtime.block_on(self.ask_to_join(&wait, request, stop));
        if let Err(ClusterError::GaveUp { detail, .. }) = &result {
            self.gave_up(detail);
        }
        let result = result?;
        self.formed_once = true;
        // The steps of the generation before were counted by this formation: the beats of the new
        // one carry none until its state is adopted (stored first, so that no beat names the new
        // generation with the old generation's step).
        self.shared.step.store(0, Ordering::SeqCst);
        self.shared.generation.store(result.generation, Ordering::SeqCst);
        let elections = &self.shared.elections;
        if let Err(e) =
            elections.adopt(result.term, result.coordinator).and_then(|_| elections.joined(result.generation))
        {
            tracing::error!("cannot keep the vote: {e}");
        }
        Ok(result)
    }

    /// Asks the chief to join until it answers, or [`JoinWait::end`] says the wait is over.
    async fn ask_to_join(
        &self,
        wait: &JoinWait,
        request: proto::JoinRequest,
        stop: &AtomicBool,
    ) -> Result<Formed, ClusterError> {
        let shared = &self.shared;
        let over = || wait.end(Instant::now(), shared.last_contact(), stop.load(Ordering::Relaxed), shared.replaced());
        let interval = self.timeouts.heartbeat_interval;
        let mut last = String::from("no attempt finished");
        let mut probed = None;
        loop {
            if let Some(end) = over() {
                return Err(self.join_ended(end, wait, last));
            }
            if let Some(said) = self.finished(wait.started, &mut probed).await {
                return Err(ClusterError::Finished(said));
            }
            let seen = self.shared.elections.moves();
            let Some((term, rank, dial)) = self.coordinator() else {
                last = "a coordinator is being elected".into();
                self.shared.elections.moved_since(seen, interval).await;
                continue;
            };
            let following = || self.shared.elections.coordinator() == Some((term, rank));
            let request = proto::JoinRequest { term: self.shared.elections.vote().term, ..request.clone() };
            let until = Instant::now() + interval * 5;
            let mut client = match dial.connect_while_followed(until, &self.shared.elections, (term, rank)).await {
                Some(Ok(c)) => c,
                Some(Err(e)) => {
                    last = e.to_string();
                    continue;
                }
                None => continue,
            };
            let call = answered(client.join(request), || over().is_some() || !following());
            match self.answer_or_end(call, rank == self.rank, wait.started).await? {
                None => continue,
                Some(Ok(reply)) => match self.formed_of(reply.into_inner(), rank)? {
                    Ok(formed) => return Ok(formed),
                    Err(why) => last = why,
                },
                Some(Err(status)) => match from_status(&status, Call::Join { phase: wait.phase }) {
                    Some(e) => return Err(e),
                    None => {
                        // The chief went away while we waited (or is not seated yet): wait for it to
                        // come back, or for another to be followed.
                        last = status.message().to_string();
                        self.shared.elections.moved_since(seen, interval).await;
                    }
                },
            }
        }
    }

    /// The formation that a join's `reply` from the coordinator `rank` gives, or why it is not
    /// this member's generation (the join goes on); `ReadFirst` where this process must read its
    /// checkpoint location first.
    fn formed_of(&self, reply: proto::JoinReply, rank: usize) -> Result<Result<Formed, String>, ClusterError> {
        if reply.read_first {
            return Err(ClusterError::ReadFirst);
        }
        let formed = Formed::from(reply);
        if let Some(what) = formed::wrong(&formed, self.names.len(), self.rank) {
            let from = self.names[rank].clone();
            return Err(ClusterError::Malformed { from, generation: formed.generation, what });
        }
        // Formed by a coordinator this member no longer follows (it voted in a newer term
        // meanwhile): not its generation; the others fail it and rejoin.
        if formed.term < self.shared.elections.vote().term {
            return Ok(Err(format!("{} formed generation {} in an old term", self.names[rank], formed.generation)));
        }
        Ok(Ok(formed))
    }

    /// Why a join's wait ended without an answer (`last`: what happened last).
    fn join_ended(&self, end: JoinEnd, wait: &JoinWait, last: String) -> ClusterError {
        match end {
            JoinEnd::Stopped => ClusterError::Stopped,
            JoinEnd::Replaced(why) => ClusterError::Replaced(why),
            JoinEnd::ChiefSilent => {
                let (phase, chief, timeout) = (wait.phase, self.coordinator_name(), wait.timeout);
                ClusterError::ChiefSilent { phase, chief, timeout, detail: last }
            }
        }
    }

    /// Waits until every member of `generation` reaches the barrier `name`; fails if the
    /// generation ends first (a member failed, or the chief was lost).
    pub(crate) fn barrier(&self, generation: u64, name: &str) -> Result<(), ClusterError> {
        let request = proto::BarrierRequest {
            generation,
            rank: self.rank as u32,
            incarnation: self.incarnation,
            name: name.into(),
        };
        let abort = &self.shared.abort;
        let aborted = |a: Aborted| ClusterError::Aborted { generation: a.generation, reason: a.reason };
        self.runtime.block_on(async {
            loop {
                abort.check(generation).map_err(aborted)?;
                let Some((_, _, dial)) = self.coordinator() else {
                    tokio::time::sleep(self.timeouts.heartbeat_interval).await;
                    continue;
                };
                let Ok(mut client) = dial.connect(Instant::now() + self.timeouts.heartbeat_deadline).await else {
                    continue; // the heartbeat task notices a lost coordinator and raises the abort
                };
                let call = client.barrier(request.clone());
                tokio::pin!(call);
                loop {
                    tokio::select! {
                        r = &mut call => match r {
                            Ok(_) => return Ok(()),
                            Err(status) => match from_status(&status, Call::Barrier { generation, name }) {
                                Some(e) => return Err(e),
                                None => break,
                            },
                        },
                        () = tokio::time::sleep(Duration::from_millis(20)) => abort.check(generation).map_err(aborted)?,
                    }
                }
            }
        })
    }

    /// A failure seen here in `generation`: aborts this member's collectives, and if this is the
    /// first word of it, pushes the notice to every peer and reports `suspect` to the chief.
    pub(crate) fn abandon(&self, generation: u64, reason: &str, suspect: Option<usize>) {
        if generation == 0 || !self.shared.abort.trigger(generation, reason) {
            return;
        }
        let _runtime = self.runtime.enter();
        push_abort(&self.peers, generation, self.rank as u32, reason);
        if let Some(suspect) = suspect {
            let request = proto::ReportRequest {
                rank: self.rank as u32,
                incarnation: self.incarnation,
                generation,
                suspect: suspect as u32,
                reason: reason.into(),
            };
            let Some((_, _, dial)) = self.coordinator() else { return };
            let dial = dial.clone();
            self.runtime.spawn(async move {
                if let Ok(mut client) = dial.connect(Instant::now() + Duration::from_secs(1)).await {
                    let _ = tokio::time::timeout(Duration::from_secs(1), client.report(request)).await;
                }
            });
        }
    }

    /// After the final barrier: its vote is removed (the run is over); a member says it leaves;
    /// the chief waits (a bounded while) until every member has, since its exit would cut off a
    /// barrier reply still on its way.
    pub(crate) fn finish(&self) {
        if let Err(e) = self.shared.elections.forget() {
            tracing::warn!("the run finished, but this worker's vote was not removed: {e}");
        }
        if let Some((record, _)) = &self.position {
            record.remove();
        }
        match self.seated() {
            None => self.leave("finished"),
            Some(c) => self.linger(|| c.departed()),
        }
    }

    /// After the coordinator gave up: a member says it got the answer (it leaves); the chief
    /// waits (a bounded while) until every member told has, since its exit would cut off an
    /// answer still on its way and leave that member waiting out its own timeout.
    fn gave_up(&self, why: &str) {
        match self.seated() {
            None => self.leave(&format!("gave up: {why}")),
            Some(c) => self.linger(|| c.answered()),
        }
    }

    /// On the chief, before it exits: waits until `done`, for at most 4 heartbeat deadlines (a
    /// member that vanished holds nobody up for long).
    fn linger(&self, done: impl Fn() -> bool) {
        let until = Instant::now() + self.timeouts.heartbeat_deadline * 4;
        while !done() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Tells the chief this member leaves on purpose (best effort, bounded).
    pub(crate) fn leave(&self, reason: &str) {
        let request =
            proto::LeaveRequest { rank: self.rank as u32, incarnation: self.incarnation, reason: reason.into() };
        let Some((_, _, dial)) = self.coordinator() else { return };
        self.runtime.block_on(async {
            if let Ok(mut client) = dial.connect(Instant::now() + Duration::from_secs(1)).await {
                let _ = tokio::time::timeout(Duration::from_secs(2), client.leave(request)).await;
            }
        });
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        for task in self.tasks.drain(..) {
            task.abort();
        }
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::ClusterKey;
    use crate::cluster::tf_config;

    fn ports(n: usize) -> Vec<u16> {
        trainerd_supervise::loopback::free_ports(n).unwrap()
    }

    fn cluster(ports: &[u16], rank: usize) -> ClusterConfig {
        tf_config::parse(&trainerd_supervise::loopback::tf_config(ports, rank), "TF_CONFIG").unwrap().unwrap()
    }

    fn identity(c: &ClusterConfig, run: &str) -> Identity {
        Identity { cluster_json: c.cluster_json(), plugin: "p 1".into(), run_config_json: run.into() }
    }

    const FAST: Timeouts = Timeouts {
        rendezvous: Duration::from_secs(20),
        heartbeat_interval: Duration::from_millis(50),
        heartbeat_deadline: Duration::from_millis(500),
        collective: Duration::from_secs(5),
        rejoin: Duration::from_secs(20),
        replace_after: Duration::from_secs(10),
        data: Duration::from_secs(2),
        min_workers: None,
    };

    fn plane(ports: &[u16], rank: usize, t: Timeouts) -> ControlPlane {
        let c = cluster(ports, rank);
        ControlPlane::start(&c, identity(&c, "{}"), t, &Network::loopback(), None).unwrap()
    }

    fn report(generation: u64, step: u64, digest: &str) -> Report {
        Report { generation, progress: (step, 0), digest: digest.into(), reached: step, ..Report::default() }
    }

    /// Every plane joins with its report, in threads; the formations, by rank.
    fn join_all(planes: &mut [ControlPlane], reports: &[Report]) -> Vec<Formed> {
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            let handles: Vec<_> = planes
                .iter_mut()
                .zip(reports)
                .map(|(p, r)| {
                    let stop = &stop;
                    s.spawn(move || p.join(&format!("127.0.0.1:{}", 1000 + p.rank()), r, stop).unwrap())
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Waits until `generation` is aborted on `plane`; its reason.
    fn aborted(plane: &ControlPlane, generation: u64, within: Duration) -> String {
        let until = Instant::now() + within;
        loop {
            if let Err(aborted) = plane.abort_signal().check(generation) {
                return aborted.reason;
            }
            assert!(Instant::now() < until, "generation {generation} was not aborted within {within:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_crashed_member_ends_the_generation_and_its_successor_gets_the_furthest_state() {
        let ports = ports(3);
        let mut planes: Vec<ControlPlane> = (0..3).map(|r| plane(&ports, r, FAST)).collect();
        let first = join_all(&mut planes, &[report(0, 0, "init"), Report::default(), Report::default()]);
        for f in &first {
            assert_eq!((f.generation, f.source, f.receivers.clone(), f.recovery), (1, 0, vec![1, 2], false));
            assert_eq!(f.data_addresses, ["127.0.0.1:1000", "127.0.0.1:1001", "127.0.0.1:1002"]);
        }
        // Worker 2 crashes: its heartbeat stream closes, and the chief ends generation 1 for everyone.
        drop(planes.pop());
        for p in &planes {
            let why = aborted(p, 1, Duration::from_secs(5));
            assert!(why.contains("worker 2") && why.contains("lost its connection to the chief"), "{why}");
        }
        // Its restarted process joins with nothing; worker 1 finished step 6, worker 0 only step 5.
        planes.push(plane(&ports, 2, FAST));
        let second = join_all(&mut planes, &[report(1, 5, "s5"), report(1, 6, "s6"), Report::default()]);
        for f in &second {
            assert_eq!((f.generation, f.source, f.progress), (3, 1, (6, 0)));
            assert_eq!((f.receivers.clone(), f.recovery, f.steps_lost), (vec![0, 2], true, 0));
        }
    }

    /// A plane that keeps its vote in `dir`.
    fn voting(ports: &[u16], rank: usize, t: Timeouts, dir: &std::path::Path) -> ControlPlane {
        let c = cluster(ports, rank);
        ControlPlane::start(&c, identity(&c, "{}"), t, &Network::loopback(), Some(dir)).unwrap()
    }

    #[test]
    fn a_chief_lost_for_good_is_replaced_by_an_elected_coordinator_and_rejoins_as_a_member() {
        let ports = ports(3);
        let dir = tempfile::tempdir().unwrap();
        let t = Timeouts { replace_after: Duration::from_secs(1), ..FAST };
        let mut planes: Vec<ControlPlane> = (0..3).map(|r| voting(&ports, r, t, dir.path())).collect();
        let first = join_all(&mut planes, &[report(0, 0, "init"), Report::default(), Report::default()]);
        assert_eq!((first[0].coordinator, first[0].term), (0, 0));
        // Fresh vote directories: each member votes once a majority of the others told it the term.
        let until = Instant::now() + Duration::from_secs(5);
        while planes.iter().any(|p| p.shared.elections.forgetful()) {
            assert!(Instant::now() < until, "the members never heard the term from a majority");
            std::thread::sleep(Duration::from_millis(20));
        }
        // The chief dies and does not come back.
        let chief = planes.remove(0);
        drop(chief);
        let started = Instant::now();
        let second = join_all(&mut planes, &[report(1, 5, "s5"), report(1, 5, "s5")]);
        let took = started.elapsed();
        // Worker 1 stands first; on a loaded machine its term can lose to late votes, and worker 2
        // wins the next one. Either survivor may coordinate, but both follow the same one.
        let elected = second[0].coordinator;
        assert!(elected == 1 || elected == 2, "{:?}", second[0]);
        for f in &second {
            assert_eq!((f.coordinator, f.members.clone()), (elected, vec![1, 2]), "{f:?}");
            assert!(f.term > first[0].generation && f.generation > f.term, "{f:?}");
        }
        assert!(took >= Duration::from_secs(1), "elected before --replace-after: {took:?}");
        assert!(took < Duration::from_secs(6), "the election took {took:?}");
        let (winner, voter) = if elected == 1 { (0, 1) } else { (1, 0) };
        assert_eq!(planes[winner].coordinates(), Some(second[0].term));
        assert_eq!(planes[voter].coordinates(), None);
        // The votes are kept: the other survivor voted for the winner in that term, and follows it.
        let files = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap());
        let votes = files.filter(|name| name.starts_with("vote-")).count();
        assert_eq!(votes, 3, "every member keeps its vote");
        let vote = planes[voter].shared.elections.vote();
        assert_eq!((vote.term, vote.voted_for, vote.coordinator), (second[0].term, Some(elected), Some(elected)));
        // The chief comes back: it finds the new coordinator, joins as a member, takes its slot back.
        // (Workers 1 and 2 join again until a generation holds it, as the training loop does.)
        planes.insert(0, voting(&ports, 0, t, dir.path()));
        let theirs = report(second[0].generation, 9, "s9");
        let stop = AtomicBool::new(false);
        let third: Vec<Formed> = std::thread::scope(|s| {
            let handles: Vec<_> = planes
                .iter_mut()
                .map(|p| {
                    let (stop, r) = (&stop, if p.rank() == 0 { Report::default() } else { theirs.clone() });
                    s.spawn(move || loop {
                        let f = p.join("127.0.0.1:1", &r, stop).unwrap();
                        if f.members.len() == 3 {
                            return f;
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for f in &third {
            assert_eq!((f.coordinator, f.term, f.members.clone()), (elected, second[0].term, vec![0, 1, 2]), "{f:?}");
            assert_eq!((f.source, f.receivers.clone()), (1, vec![0]));
        }
        assert_eq!(planes[0].coordinates(), None, "the old chief coordinates no more");
    }

    #[test]
    fn a_silent_member_is_failed_at_the_heartbeat_deadline_and_barriers_abort() {
        let ports = ports(2);
        // Worker 1 beats once, then stays silent as a frozen process would.
        let silent = Timeouts {
            heartbeat_interval: Duration::from_secs(60),
            heartbeat_deadline: Duration::from_secs(120),
            ..FAST
        };
        let mut planes = vec![plane(&ports, 0, FAST), plane(&ports, 1, silent)];
        let formed = join_all(&mut planes, &[report(0, 0, "init"), Report::default()]);
        let generation = formed[0].generation;
        let started = Instant::now();
        let err = planes[0].barrier(generation, "never").unwrap_err().to_string();
        let took = started.elapsed();
        assert!(
            err.starts_with(&format!(
                "generation {generation} ended: worker 1 (127.0.0.1:{}) sent no heartbeat for ",
                ports[1]
            )),
            "{err}"
        );
        assert!(took < Duration::from_secs(5), "the barrier waited {took:?}");
        let why = aborted(&planes[0], generation, Duration::from_secs(1));
        assert!(why.contains("sent no heartbeat for"), "{why}");
    }

    #[test]
    fn after_a_give_up_every_member_gets_its_reason_before_the_chief_exits_and_late_ones_at_once() {
        let ports = ports(3);
        // Every member is needed (a majority would start short without worker 2).
        let t = Timeouts { rendezvous: Duration::from_secs(2), min_workers: Some(3), ..FAST };
        let mut planes = [plane(&ports, 0, t), plane(&ports, 1, FAST)];
        let stop = AtomicBool::new(false);
        let errors: Vec<String> = std::thread::scope(|s| {
            let joins: Vec<_> = planes
                .iter_mut()
                .map(|p| {
                    let stop = &stop;
                    s.spawn(move || p.join("127.0.0.1:1", &Report::default(), stop).unwrap_err().to_string())
                })
                .collect();
            joins.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let expected = format!("rendezvous: worker 2 (127.0.0.1:{}) did not join within 2s", ports[2]);
        assert_eq!(errors, [expected.clone(), expected.clone()]);
        let coordinator = planes[0].seated().unwrap();
        assert!(coordinator.answered(), "the chief's join returned before worker 1 had its answer");
        // Worker 2 comes after the give-up, while the chief is on its way out: it is told at once,
        // not after another rendezvous timeout.
        let mut late = plane(&ports, 2, FAST);
        let started = Instant::now();
        let err = late.join("127.0.0.1:1", &Report::default(), &stop).unwrap_err().to_string();
        assert_eq!(err, expected);
        assert!(started.elapsed() < Duration::from_millis(1500), "the late join waited {:?}", started.elapsed());
        assert!(coordinator.answered(), "worker 2 said it got the answer");
    }

    #[test]
    fn a_generation_holds_a_bounded_number_of_barriers() {
        let ports = ports(2);
        let mut planes = vec![plane(&ports, 0, FAST), plane(&ports, 1, FAST)];
        let generation = join_all(&mut planes, &[report(0, 0, "init"), Report::default()])[0].generation;
        let worker = Arc::new(planes.pop().unwrap());
        // 17 barriers the chief never reaches: 16 stay open, one is refused at once.
        let (tx, rx) = std::sync::mpsc::channel();
        for i in 0..17 {
            let (w, tx) = (Arc::clone(&worker), tx.clone());
            std::thread::spawn(move || tx.send(w.barrier(generation, &format!("b{i:02}"))));
        }
        let refused = rx.recv_timeout(Duration::from_secs(10)).expect("one barrier is refused").unwrap_err();
        let text = refused.to_string();
        assert!(
            text.starts_with("control plane: barrier b") && text.ends_with(": a generation has at most 16 barriers"),
            "{text}"
        );
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "the other 16 stay open");
        let long = "x".repeat(65);
        let err = worker.barrier(generation, &long).unwrap_err().to_string();
        assert_eq!(err, format!("control plane: barrier {long}: barrier names are at most 64 bytes"));
    }

    #[test]
    fn a_different_run_configuration_is_refused_with_both_values() {
        let ports = ports(2);
        let c0 = cluster(&ports, 0);
        let _chief =
            ControlPlane::start(&c0, identity(&c0, r#"{"batch_size":64,"seed":0}"#), FAST, &Network::loopback(), None)
                .unwrap();
        let c1 = cluster(&ports, 1);
        let mut worker =
            ControlPlane::start(&c1, identity(&c1, r#"{"batch_size":32,"seed":0}"#), FAST, &Network::loopback(), None)
                .unwrap();
        let err = worker.join("127.0.0.1:1", &Report::default(), &AtomicBool::new(false)).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "rendezvous refused by the chief: worker 1 (127.0.0.1:{}) has a different run configuration: \
                 batch_size = 32 on worker 1 (127.0.0.1:{}), 64 on the chief, worker 0 (127.0.0.1:{})",
                ports[1], ports[1], ports[0]
            )
        );
    }

    #[test]
    fn a_port_in_use_is_named() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let c = cluster(&[port, ports(1)[0]], 0);
        let err =
            ControlPlane::start(&c, identity(&c, "{}"), FAST, &Network::loopback(), None).err().unwrap().to_string();
        assert_eq!(
            err,
            format!(
                "cannot listen on 127.0.0.1:{port} (worker 0 (127.0.0.1:{port})'s address in TF_CONFIG): Address \
                 already in use (os error 98)"
            )
        );
    }

    #[test]
    fn with_a_secret_only_members_that_know_it_are_served() {
        let ports = ports(2);
        let key = |k: &[u8]| Network { key: Some(ClusterKey::from_bytes(k)), ..Network::loopback() };
        let secret = b"a-cluster-secret-0123456789";
        let start = |rank| {
            let c = cluster(&ports, rank);
            ControlPlane::start(&c, identity(&c, "{}"), FAST, &key(secret), None).unwrap()
        };
        let mut planes = vec![start(0), start(1)];
        let formed = join_all(&mut planes, &[report(0, 0, ""), report(0, 0, "")]);
        assert_eq!(formed[0].generation, formed[1].generation);
        let chief = format!("127.0.0.1:{}", ports[0]);
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let soon = || Instant::now() + Duration::from_millis(500);
        // Another secret, and none at all: no call gets through.
        let err =
            runtime.block_on(Dial::new(&chief, &key(b"another-secret-0123456789").key).connect(soon())).err().unwrap();
        let err = err.to_string();
        assert!(err.ends_with("the cluster secrets differ (is the same --secret-file set on every worker?)"), "{err}");
        let bare = runtime.block_on(async {
            let mut client = Dial::new(&chief, &None).connect(soon()).await.ok()?;
            let request = proto::LeaveRequest { rank: 1, incarnation: 0, reason: "x".into() };
            Some(tokio::time::timeout(Duration::from_secs(5), client.leave(request)).await)
        });
        match bare {
            None | Some(Err(_)) => {} // no connection, or no answer
            Some(Ok(Ok(_))) => panic!("a client without the secret was served"),
            Some(Ok(Err(status))) => {
                let text = status.message();
                assert!(!text.contains("worker") && !text.contains("127.0.0.1"), "the refusal names nothing: {text}");
            }
        }
    }
}
