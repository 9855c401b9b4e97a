//! A member's side of the control plane: the server every daemon runs (with the coordinator on
//! the chief), the heartbeat stream to the chief, and the blocking calls the training thread
//! makes: [`ControlPlane::join`] (the next generation), [`ControlPlane::barrier`],
//! [`ControlPlane::abandon`] (a failure seen here: abort the generation and push the notice to
//! every peer) and [`ControlPlane::leave`].
//!
//! The heartbeat stream is also how a member notices that the chief is gone: the stream breaks
//! (the chief died) or its acks stop (the chief froze). The member then aborts its generation
//! and tells every peer, so nobody waits for a timeout.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use super::auth::{self, ClusterKey, Plane};
use super::control::{proto, ControlClient, ControlServer, Coordinator, Formed, Identity, Service};
use super::membership::Report;
use super::network::Network;
use super::tf_config::ClusterConfig;
use super::timeouts::Timeouts;
use crate::collective::AbortSignal;

/// A control-plane failure.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// This daemon's own address cannot be served.
    #[error("cannot listen on {address} ({member}'s address in TF_CONFIG): {reason}")]
    Bind {
        /// The address.
        address: String,
        /// Whose address it is.
        member: String,
        /// Why.
        reason: String,
    },
    /// The chief refused this member.
    #[error("rendezvous refused by the chief: {0}")]
    Refused(String),
    /// The coordinator gave up waiting for missing members.
    #[error("{phase}: {detail}")]
    GaveUp {
        /// `rendezvous` (the first formation) or `recovery`.
        phase: &'static str,
        /// Who was missing, and for how long they were waited for.
        detail: String,
    },
    /// The chief could not be reached for the whole deadline.
    #[error("{phase}: no answer from the chief, {chief}, within {timeout:?}: {detail}")]
    ChiefSilent {
        /// `rendezvous` or `recovery`.
        phase: &'static str,
        /// The chief, named.
        chief: String,
        /// The deadline.
        timeout: Duration,
        /// What happened last.
        detail: String,
    },
    /// The generation ended while this member waited in it.
    #[error("generation {generation} ended: {reason}")]
    Aborted {
        /// The generation.
        generation: u64,
        /// Why.
        reason: String,
    },
    /// A newer process holds this member's rank.
    #[error("{0}")]
    Replaced(String),
    /// Stopped by a signal while waiting.
    #[error("stopped while waiting for the cluster")]
    Stopped,
    /// Anything else from the runtime.
    #[error("control plane: {0}")]
    Other(String),
}

/// What the heartbeat task and the training thread share.
struct Shared {
    /// The generation this member is in (0 before the first).
    generation: AtomicU64,
    /// Its global step, carried by the beats.
    step: AtomicU64,
    abort: AbortSignal,
    /// Set when a newer process took this rank: nothing this one does counts any more.
    replaced: Mutex<Option<String>>,
    /// When the chief last answered (ms since `epoch`), so a member waits for an answer as long
    /// as the chief is alive and gives up only when it is unreachable.
    last_contact_ms: AtomicU64,
    epoch: Instant,
}

impl Shared {
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

/// This daemon's control plane: its server, and its calls to the chief and its peers.
pub struct ControlPlane {
    runtime: tokio::runtime::Runtime,
    listening: std::net::SocketAddr,
    rank: usize,
    names: Vec<String>,
    chief: Dial,
    identity: Identity,
    coordinator: Option<Arc<Coordinator>>,
    shutdown: Option<oneshot::Sender<()>>,
    incarnation: u64,
    timeouts: Timeouts,
    shared: Arc<Shared>,
    peers: Arc<Vec<Option<ControlClient<Channel>>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    formed_once: bool,
}

impl ControlPlane {
    /// Serves the control plane on this member's TF_CONFIG port (the chief also coordinates),
    /// bound and authenticated as `network` says, and starts beating to the chief.
    pub fn start(
        cluster: &ClusterConfig,
        identity: Identity,
        timeouts: Timeouts,
        network: &Network,
    ) -> Result<ControlPlane, ClusterError> {
        let names: Vec<String> = cluster.members.iter().map(|m| m.to_string()).collect();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("trainerd-control")
            .enable_all()
            .build()
            .map_err(|e| ClusterError::Other(e.to_string()))?;
        let me = cluster.me();
        let bind_error = |reason: String| ClusterError::Bind {
            address: me.address.clone(),
            member: names[cluster.rank].clone(),
            reason,
        };
        let port =
            resolve(&me.address).map(|a| a.port()).or_else(|e| port_of(&me.address).ok_or(e)).map_err(bind_error)?;
        let addr = std::net::SocketAddr::new(network.bind, port);
        let listener = std::net::TcpListener::bind(addr).map_err(|e| {
            bind_error(if addr.to_string() == me.address { e.to_string() } else { format!("binding {addr}: {e}") })
        })?;
        listener.set_nonblocking(true).map_err(|e| bind_error(e.to_string()))?;
        let listening = listener.local_addr().map_err(|e| bind_error(e.to_string()))?;
        let abort = AbortSignal::new();
        let coordinator =
            (cluster.rank == 0).then(|| Coordinator::new(identity.clone(), names.clone(), timeouts.options()));
        let service = Service {
            rank: cluster.rank,
            names: names.clone(),
            coordinator: coordinator.clone(),
            abort: abort.clone(),
        };
        let (shutdown, shutdown_rx) = oneshot::channel::<()>();
        let _guard = runtime.enter();
        let listener = tokio::net::TcpListener::from_std(listener).map_err(|e| bind_error(e.to_string()))?;
        let (accepting, incoming) = authenticated(listener, network.key.clone());
        let mut tasks = vec![accepting];
        tasks.push(runtime.spawn(async move {
            let served = tonic::transport::Server::builder()
                .add_service(ControlServer::new(service))
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = shutdown_rx.await;
                })
                .await;
            if let Err(e) = served {
                tracing::error!("control plane server stopped: {e}");
            }
        }));
        if let Some(c) = &coordinator {
            tasks.push(runtime.spawn(Arc::clone(c).tick(timeouts.heartbeat_interval / 4)));
        }
        let peers: Vec<Option<ControlClient<Channel>>> = cluster
            .members
            .iter()
            .enumerate()
            .map(|(r, m)| (r != cluster.rank).then(|| Dial::new(&m.address, &network.key).lazy())?)
            .collect();
        let epoch = Instant::now();
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            step: AtomicU64::new(0),
            abort,
            replaced: Mutex::new(None),
            last_contact_ms: AtomicU64::new(0),
            epoch,
        });
        let mut plane = ControlPlane {
            runtime,
            listening,
            rank: cluster.rank,
            chief: Dial::new(&cluster.members[0].address, &network.key),
            names,
            identity,
            coordinator,
            shutdown: Some(shutdown),
            incarnation: new_incarnation(),
            timeouts,
            shared,
            peers: Arc::new(peers),
            tasks,
            formed_once: false,
        };
        let beating = plane.heartbeats();
        plane.tasks.push(plane.runtime.spawn(beating));
        Ok(plane)
    }

    /// The address the control plane listens on.
    pub fn listening(&self) -> std::net::SocketAddr {
        self.listening
    }

    /// Names of the members, by rank (`worker 1 (host:port)`).
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// This member's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The abort signal of this member's collectives (raised by notices).
    pub fn abort_signal(&self) -> AbortSignal {
        self.shared.abort.clone()
    }

    /// On the chief: the next formation's generation must exceed `generation`.
    pub fn set_floor(&self, generation: u64) {
        if let Some(c) = &self.coordinator {
            c.set_floor(generation);
        }
    }

    /// The global step the beats carry.
    pub fn set_step(&self, step: u64) {
        self.shared.step.store(step, Ordering::Relaxed);
    }

    /// Why this process no longer counts (a newer one holds its rank), if so.
    pub fn replaced(&self) -> Option<String> {
        self.shared.replaced()
    }

    /// The heartbeat task: beats to the chief, takes its notices, and notices when it is gone.
    fn heartbeats(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let (chief, chief_name) = (self.chief.clone(), self.names[0].clone());
        let (rank, incarnation, t) = (self.rank as u32, self.incarnation, self.timeouts);
        let (shared, peers) = (Arc::clone(&self.shared), Arc::clone(&self.peers));
        async move {
            let lost = |why: String| {
                let generation = shared.generation.load(Ordering::Relaxed);
                if generation > 0 && shared.abort.trigger(generation, &why) {
                    push_abort(&peers, generation, rank, &why);
                }
            };
            loop {
                let client = chief.connect(Instant::now() + t.heartbeat_deadline).await;
                let Ok(mut client) = client else {
                    lost(format!("cannot reach the chief, {chief_name}"));
                    tokio::time::sleep(t.heartbeat_interval).await;
                    continue;
                };
                let (tx, rx) = mpsc::channel::<proto::Beat>(4);
                let beater = {
                    let shared = Arc::clone(&shared);
                    tokio::spawn(async move {
                        loop {
                            let beat = proto::Beat {
                                rank,
                                incarnation,
                                generation: shared.generation.load(Ordering::Relaxed),
                                step: shared.step.load(Ordering::Relaxed),
                            };
                            if tx.send(beat).await.is_err() {
                                return;
                            }
                            tokio::time::sleep(t.heartbeat_interval).await;
                        }
                    })
                };
                let opened = tokio::time::timeout(
                    t.heartbeat_deadline,
                    client.heartbeat(tokio_stream::wrappers::ReceiverStream::new(rx)),
                )
                .await;
                let mut notices = match opened {
                    Ok(Ok(response)) => response.into_inner(),
                    _ => {
                        beater.abort();
                        lost(format!("the chief, {chief_name}, did not open a heartbeat stream"));
                        tokio::time::sleep(t.heartbeat_interval).await;
                        continue;
                    }
                };
                loop {
                    match tokio::time::timeout(t.heartbeat_deadline, notices.message()).await {
                        Ok(Ok(Some(n))) => {
                            shared.touch();
                            match proto::notice::Kind::try_from(n.kind) {
                                Ok(proto::notice::Kind::Ended) => {
                                    shared.abort.trigger(n.generation, &n.reason);
                                }
                                Ok(proto::notice::Kind::Replaced) => {
                                    *shared.replaced.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
                                        Some(n.reason.clone());
                                    shared.abort.trigger(u64::MAX, &n.reason);
                                    beater.abort();
                                    return;
                                }
                                _ => {}
                            }
                        }
                        Ok(Ok(None)) | Ok(Err(_)) => {
                            lost(format!("lost the connection to the chief, {chief_name}"));
                            break;
                        }
                        Err(_) => {
                            lost(format!(
                                "the chief, {chief_name}, did not answer heartbeats for {:?}",
                                t.heartbeat_deadline
                            ));
                            break;
                        }
                    }
                }
                beater.abort();
                tokio::time::sleep(t.heartbeat_interval).await;
            }
        }
    }

    /// Joins the next generation with `report`, waiting while the chief is reachable for as long
    /// as the coordinator waits (it enforces the rendezvous timeout and the rejoin deadline), and
    /// at most that long while it is not. `data_address` is this member's ring listener.
    pub fn join(&mut self, data_address: &str, report: &Report, stop: &AtomicBool) -> Result<Formed, ClusterError> {
        let (phase, timeout) = if self.formed_once {
            ("recovery", self.timeouts.rejoin)
        } else {
            ("rendezvous", self.timeouts.rendezvous)
        };
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
            }),
        };
        let started = Instant::now();
        let shared = Arc::clone(&self.shared);
        let interval = self.timeouts.heartbeat_interval;
        let result = self.runtime.block_on(async {
            let mut last = String::from("no attempt finished");
            loop {
                if stop.load(Ordering::Relaxed) {
                    return Err(ClusterError::Stopped);
                }
                if let Some(why) = shared.replaced() {
                    return Err(ClusterError::Replaced(why));
                }
                let unreachable_since = shared.last_contact().max(started);
                if unreachable_since.elapsed() > timeout {
                    return Err(ClusterError::ChiefSilent {
                        phase,
                        chief: self.names[0].clone(),
                        timeout,
                        detail: last,
                    });
                }
                let mut client = match self.chief.connect(Instant::now() + interval * 5).await {
                    Ok(c) => c,
                    Err(e) => {
                        last = e;
                        continue;
                    }
                };
                let call = client.join(request.clone());
                tokio::pin!(call);
                let outcome = loop {
                    tokio::select! {
                        r = &mut call => break Some(r),
                        () = tokio::time::sleep(Duration::from_millis(50)) => {
                            let gone = shared.last_contact().max(started).elapsed() > timeout;
                            if stop.load(Ordering::Relaxed) || shared.replaced().is_some() || gone {
                                break None;
                            }
                        }
                    }
                };
                match outcome {
                    None => continue,
                    Some(Ok(reply)) => return Ok(Formed::from(reply.into_inner())),
                    Some(Err(status)) => match status.code() {
                        tonic::Code::FailedPrecondition => return Err(ClusterError::Refused(status.message().into())),
                        tonic::Code::Aborted => {
                            return Err(ClusterError::GaveUp { phase, detail: status.message().into() })
                        }
                        _ => {
                            // The chief went away while we waited; wait for it to come back.
                            last = status.message().to_string();
                            tokio::time::sleep(interval).await;
                        }
                    },
                }
            }
        });
        if let Err(ClusterError::GaveUp { detail, .. }) = &result {
            self.gave_up(detail);
        }
        let result = result?;
        self.formed_once = true;
        self.shared.generation.store(result.generation, Ordering::Relaxed);
        Ok(result)
    }

    /// Waits until every member of `generation` reaches the barrier `name`; fails if the
    /// generation ends first (a member failed, or the chief was lost).
    pub fn barrier(&self, generation: u64, name: &str) -> Result<(), ClusterError> {
        let request = proto::BarrierRequest {
            generation,
            rank: self.rank as u32,
            incarnation: self.incarnation,
            name: name.into(),
        };
        let abort = &self.shared.abort;
        let aborted = |reason: String| ClusterError::Aborted { generation, reason };
        self.runtime.block_on(async {
            loop {
                abort.check(generation).map_err(aborted)?;
                let Ok(mut client) = self.chief.connect(Instant::now() + self.timeouts.heartbeat_deadline).await
                else {
                    continue; // the heartbeat task notices a lost chief and raises the abort
                };
                let call = client.barrier(request.clone());
                tokio::pin!(call);
                loop {
                    tokio::select! {
                        r = &mut call => match r {
                            Ok(_) => return Ok(()),
                            Err(status) if status.code() == tonic::Code::Aborted => {
                                return Err(aborted(status.message().into()))
                            }
                            Err(status) if matches!(
                                status.code(),
                                tonic::Code::InvalidArgument | tonic::Code::ResourceExhausted | tonic::Code::FailedPrecondition
                            ) => return Err(ClusterError::Other(format!("barrier {name}: {}", status.message()))),
                            Err(_) => break,
                        },
                        () = tokio::time::sleep(Duration::from_millis(20)) => abort.check(generation).map_err(aborted)?,
                    }
                }
            }
        })
    }

    /// A failure seen here in `generation`: aborts this member's collectives, and if this is the
    /// first word of it, pushes the notice to every peer and reports `suspect` to the chief.
    pub fn abandon(&self, generation: u64, reason: &str, suspect: Option<usize>) {
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
            let chief = self.chief.clone();
            self.runtime.spawn(async move {
                if let Ok(mut client) = chief.connect(Instant::now() + Duration::from_secs(1)).await {
                    let _ = tokio::time::timeout(Duration::from_secs(1), client.report(request)).await;
                }
            });
        }
    }

    /// After the final barrier: a member says it leaves; the chief waits (a bounded while) until
    /// every member has, since its exit would cut off a barrier reply still on its way.
    pub fn finish(&self) {
        match &self.coordinator {
            None => self.leave("finished"),
            Some(c) => self.linger(|| c.departed()),
        }
    }

    /// After the coordinator gave up: a member says it got the answer (it leaves); the chief
    /// waits (a bounded while) until every member told has, since its exit would cut off an
    /// answer still on its way and leave that member waiting out its own timeout.
    fn gave_up(&self, why: &str) {
        match &self.coordinator {
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
    pub fn leave(&self, reason: &str) {
        let request =
            proto::LeaveRequest { rank: self.rank as u32, incarnation: self.incarnation, reason: reason.into() };
        self.runtime.block_on(async {
            if let Ok(mut client) = self.chief.connect(Instant::now() + Duration::from_secs(1)).await {
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

/// Pushes an abort notice for `generation` to every peer (fire and forget, bounded).
fn push_abort(peers: &Arc<Vec<Option<ControlClient<Channel>>>>, generation: u64, rank: u32, reason: &str) {
    for client in peers.iter().flatten() {
        let mut client = client.clone();
        let request = proto::AbortRequest { generation, rank, reason: reason.into() };
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(1), client.abort(request)).await;
        });
    }
}

/// The first socket address of `host:port`.
pub fn resolve(address: &str) -> Result<std::net::SocketAddr, String> {
    use std::net::ToSocketAddrs;
    address
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve: {e}"))?
        .next()
        .ok_or_else(|| "resolves to no address".to_string())
}

/// The port of `host:port` (a host that does not resolve yet can still be listened for).
fn port_of(address: &str) -> Option<u16> {
    address.rsplit_once(':').and_then(|(_, p)| p.parse().ok())
}

/// Accepted connections that passed the authentication handshake (every one without a key),
/// for the gRPC server; the task that accepts them. Handshakes run concurrently (at most 64),
/// each within its timeout, so a silent client holds up nobody.
fn authenticated(
    listener: tokio::net::TcpListener,
    key: Option<ClusterKey>,
) -> (tokio::task::JoinHandle<()>, ReceiverStream<std::io::Result<tokio::net::TcpStream>>) {
    let (tx, rx) = mpsc::channel(16);
    let handshakes = Arc::new(tokio::sync::Semaphore::new(64));
    let accepting = tokio::spawn(async move {
        loop {
            let (mut stream, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::debug!("control plane: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let Some(key) = key.clone() else {
                if tx.send(Ok(stream)).await.is_err() {
                    return;
                }
                continue;
            };
            let Ok(permit) = Arc::clone(&handshakes).try_acquire_owned() else {
                tracing::warn!("control plane: refused a connection from {peer}: too many handshakes in progress");
                continue;
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                let _permit = permit;
                match auth::accept(&mut stream, &key, Plane::Control).await {
                    Ok(()) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Err(e) => tracing::warn!("control plane: refused a connection from {peer}: {}", auth::refusal(&e)),
                }
            });
        }
    });
    (accepting, ReceiverStream::new(rx))
}

/// How this member calls another: its address, and the secret to prove there.
#[derive(Clone)]
struct Dial {
    address: String,
    key: Option<ClusterKey>,
}

impl Dial {
    fn new(address: &str, key: &Option<ClusterKey>) -> Dial {
        Dial { address: address.to_string(), key: key.clone() }
    }

    fn endpoint(&self) -> Result<Endpoint, String> {
        Ok(Endpoint::from_shared(format!("http://{}", self.address))
            .map_err(|e| format!("bad address {}: {e}", self.address))?
            .connect_timeout(Duration::from_secs(1)))
    }

    /// Opens TCP connections for tonic, each through the handshake when there is a key.
    fn connector(
        &self,
    ) -> impl tower::Service<
        tonic::transport::Uri,
        Response = hyper_util::rt::TokioIo<tokio::net::TcpStream>,
        Error = std::io::Error,
        Future = impl Send,
    > + Clone
           + Send
           + 'static {
        let (address, key) = (self.address.clone(), self.key.clone());
        tower::service_fn(move |_: tonic::transport::Uri| {
            let (address, key) = (address.clone(), key.clone());
            async move {
                let mut stream = tokio::net::TcpStream::connect(address.as_str()).await?;
                stream.set_nodelay(true)?;
                if let Some(key) = &key {
                    auth::connect(&mut stream, key, Plane::Control).await.map_err(std::io::Error::other)?;
                }
                Ok(hyper_util::rt::TokioIo::new(stream))
            }
        })
    }

    /// A client that connects on first use.
    fn lazy(&self) -> Option<ControlClient<Channel>> {
        let endpoint = self.endpoint().ok()?;
        Some(ControlClient::new(endpoint.connect_with_connector_lazy(self.connector())))
    }

    /// A client, retrying until `deadline` (the peer may not be up yet).
    async fn connect(&self, deadline: Instant) -> Result<ControlClient<Channel>, String> {
        let endpoint = self.endpoint()?;
        let mut last = String::from("deadline passed before the first attempt");
        while Instant::now() < deadline {
            match endpoint.connect_with_connector(self.connector()).await {
                Ok(channel) => return Ok(ControlClient::new(channel)),
                Err(e) => {
                    last = format!("cannot connect to {}: {}", self.address, source_chain(&e));
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        Err(last)
    }
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        text.push_str(": ");
        text.push_str(&s.to_string());
        cur = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::tf_config;

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    fn cluster(ports: &[u16], rank: usize) -> ClusterConfig {
        let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let text = serde_json::json!({"cluster": {"worker": addrs}, "task": {"type": "worker", "index": rank}});
        tf_config::parse(&text.to_string(), "TF_CONFIG").unwrap().unwrap()
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
    };

    fn plane(ports: &[u16], rank: usize, t: Timeouts) -> ControlPlane {
        let c = cluster(ports, rank);
        ControlPlane::start(&c, identity(&c, "{}"), t, &Network::loopback()).unwrap()
    }

    fn report(generation: u64, step: u64, digest: &str) -> Report {
        Report { generation, progress: (step, 0), digest: digest.into() }
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
            if let Err(reason) = plane.abort_signal().check(generation) {
                return reason;
            }
            assert!(Instant::now() < until, "generation {generation} was not aborted within {within:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_crashed_member_ends_the_generation_and_its_successor_gets_the_furthest_state() {
        let ports = [free_port(), free_port(), free_port()];
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

    #[test]
    fn a_silent_member_is_failed_at_the_heartbeat_deadline_and_barriers_abort() {
        let ports = [free_port(), free_port()];
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
        let ports = [free_port(), free_port(), free_port()];
        let t = Timeouts { rendezvous: Duration::from_secs(2), ..FAST };
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
        let coordinator = planes[0].coordinator.as_ref().unwrap();
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
        let ports = [free_port(), free_port()];
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
        let ports = [free_port(), free_port()];
        let c0 = cluster(&ports, 0);
        let _chief =
            ControlPlane::start(&c0, identity(&c0, r#"{"batch_size":64,"seed":0}"#), FAST, &Network::loopback())
                .unwrap();
        let c1 = cluster(&ports, 1);
        let mut worker =
            ControlPlane::start(&c1, identity(&c1, r#"{"batch_size":32,"seed":0}"#), FAST, &Network::loopback())
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
        let c = cluster(&[port, free_port()], 0);
        let err = ControlPlane::start(&c, identity(&c, "{}"), FAST, &Network::loopback()).err().unwrap().to_string();
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
        let ports = [free_port(), free_port()];
        let key = |k: &[u8]| Network { key: Some(ClusterKey::from_bytes(k)), ..Network::loopback() };
        let secret = b"a-cluster-secret-0123456789";
        let start = |rank| {
            let c = cluster(&ports, rank);
            ControlPlane::start(&c, identity(&c, "{}"), FAST, &key(secret)).unwrap()
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
