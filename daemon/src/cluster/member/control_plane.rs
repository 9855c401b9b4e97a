//! [`ControlPlane`]: this daemon's side of the control plane, its server and its calls to the
//! coordinator and its peers, and what its heartbeat task and training thread share
//! ([`Shared`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::oneshot;
use tonic::transport::Channel;

use super::super::catch_up::Hubs;
use super::super::coordinator::rules::Report;
use super::super::coordinator::Coordinator;
use super::super::election::Elections;
use super::super::error::{from_status, Call, ClusterError};
use super::super::finding::Findings;
use super::super::network::Network;
use super::super::parts::Reports;
use super::super::service::{seated, Chair, Service};
use super::super::tf_config::ClusterConfig;
use super::super::timeouts::Timeouts;
use super::super::wire::{proto, ControlClient, Formed, Identity};
use super::dial::{push_abort, Dial};
use super::heartbeat::Beater;
use super::position::PositionRecord;
use super::setup::{bind, control_runtime, peers, run_identity, seat, serve};
use super::watch::{JoinEnd, JoinWait};
use super::{elect, formed, position};
use crate::collective::{AbortSignal, Aborted};

/// What the heartbeat task and the training thread share.
pub(super) struct Shared {
    /// The generation this member is in (0 before the first).
    pub(super) generation: AtomicU64,
    /// The furthest global step its state reached in its generation (0 until it adopted the
    /// formation), carried by the beats.
    pub(super) step: AtomicU64,
    pub(super) abort: AbortSignal,
    /// Set when a newer process took this rank: nothing this one does counts any more.
    pub(super) replaced: Mutex<Option<String>>,
    /// When the coordinator last answered (ms since `epoch`), so a member waits for an answer
    /// as long as it is alive and gives up only when it is unreachable.
    pub(super) last_contact_ms: AtomicU64,
    pub(super) epoch: Instant,
    /// This member's vote, and the coordinator it follows.
    pub(super) elections: Arc<Elections>,
    /// The latest commit's generation, which every formation must exceed (whoever coordinates).
    pub(super) floor: AtomicU64,
    /// It said that nothing it reads shows the run finished ([`ControlPlane::finished`]).
    pub(super) said_unfinished: AtomicBool,
}

impl Shared {
    pub(super) fn new(abort: AbortSignal, elections: Arc<Elections>) -> Shared {
        let (generation, step, last_contact_ms) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
        let (replaced, epoch, floor) = (Mutex::new(None), Instant::now(), AtomicU64::new(0));
        let said_unfinished = AtomicBool::new(false);
        Shared { generation, step, abort, replaced, last_contact_ms, epoch, elections, floor, said_unfinished }
    }

    pub(super) fn touch(&self) {
        self.last_contact_ms.store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    pub(super) fn last_contact(&self) -> Instant {
        self.epoch + Duration::from_millis(self.last_contact_ms.load(Ordering::Relaxed))
    }

    pub(super) fn replaced(&self) -> Option<String> {
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
    pub(super) runtime: tokio::runtime::Runtime,
    pub(super) listening: std::net::SocketAddr,
    pub(super) rank: usize,
    pub(super) names: Vec<String>,
    /// How to reach each rank.
    pub(super) dials: Arc<Vec<Dial>>,
    pub(super) identity: Identity,
    pub(super) chair: Chair,
    pub(super) shutdown: Option<oneshot::Sender<()>>,
    pub(super) incarnation: u64,
    pub(super) timeouts: Timeouts,
    pub(super) shared: Arc<Shared>,
    pub(super) peers: Arc<Vec<Option<ControlClient<Channel>>>>,
    pub(super) tasks: Vec<tokio::task::JoinHandle<()>>,
    pub(super) formed_once: bool,
    /// Whether the run has finished (from the checkpoint location), asked while a join gets no
    /// answer from the coordinator: `Some(what to say)`.
    pub(super) finished: Option<FinishedProbe>,
    /// Where the service leaves a returner's request to catch up (when this process coordinates)
    /// or for the ranges it owns.
    pub(super) hub: Arc<Hubs>,
    /// Where the service leaves what peers found at comparisons of the replicas.
    pub(super) findings: Arc<Findings>,
    /// This process's position record (with a state directory), and what the process before it
    /// recorded: its first join reports that.
    pub(super) position: Option<position::Kept>,
    /// Where the service leaves what members said of their parts of sharded commits.
    pub(super) parts: Arc<Reports>,
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

/// How this member takes part, whatever the cluster: its timeouts, where it listens and who may
/// talk to it (`network`), and the directory that keeps its vote and its position record
/// (`state_dir`; none: it takes no part in electing a coordinator when the chief is lost for
/// good, and records no position).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Settings<'a> {
    /// The timeout hierarchy.
    pub(crate) timeouts: Timeouts,
    /// Where it listens, and the cluster secret.
    pub(crate) network: &'a Network,
    /// `--state-dir`.
    pub(crate) state_dir: Option<&'a std::path::Path>,
}

impl ControlPlane {
    /// Serves the control plane on this member's TF_CONFIG port (the chief also coordinates,
    /// or the member its kept vote says coordinates), bound and authenticated as `settings`
    /// say, and starts beating to the coordinator.
    pub(crate) fn start(
        cluster: &ClusterConfig,
        identity: Identity,
        settings: Settings<'_>,
    ) -> Result<ControlPlane, ClusterError> {
        let Settings { timeouts, network, state_dir } = settings;
        let names: Vec<String> = cluster.members.iter().map(|m| m.to_string()).collect();
        let runtime = control_runtime()?;
        let listener = bind(cluster, network, &names[cluster.rank])?;
        let listening = listener.local_addr().map_err(ClusterError::Setup)?;
        let abort = AbortSignal::new();
        let (elections, chair) = seat(cluster, &identity, timeouts, state_dir)?;
        let position = PositionRecord::kept(state_dir, cluster.rank, &run_identity(&identity))?;
        let (hub, findings, parts): (Arc<Hubs>, Arc<Findings>, Arc<Reports>) = Default::default();
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
    pub(super) fn coordinator(&self) -> Option<(u64, usize, &Dial)> {
        self.shared.elections.coordinator().map(|(term, rank)| (term, rank, &self.dials[rank]))
    }

    /// The coordinator's name, or what stands in for it while none is known.
    pub(super) fn coordinator_name(&self) -> String {
        match self.coordinator() {
            Some((_, rank, _)) => self.names[rank].clone(),
            None => "(being elected)".into(),
        }
    }

    /// The coordinator in this process, if it coordinates.
    pub(super) fn seated(&self) -> Option<Arc<Coordinator>> {
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
                start_sha256: report.start.clone(),
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
