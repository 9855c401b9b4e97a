//! The gRPC control plane. Every daemon serves it on its TF_CONFIG address; the chief's copy
//! coordinates: it answers `Join` once every member has joined with the same cluster, plugin
//! and run configuration (refusing a mismatch with both values shown), releases barriers, and
//! collects heartbeats. A generation number, fixed at rendezvous, and each process's random
//! incarnation tell messages of an older incarnation of a worker apart.
//!
//! The training loop is synchronous; this module runs a small tokio runtime of its own and
//! offers blocking calls.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, watch};
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};

use super::tf_config::ClusterConfig;

/// Generated gRPC code.
#[allow(missing_docs, clippy::all)]
pub mod proto {
    tonic::include_proto!("trainerd.control.v1");
}

use proto::control_client::ControlClient;
use proto::control_server::{Control, ControlServer};

/// What every member must agree on for the replicas to stay identical.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// The TF_CONFIG `cluster`, canonical JSON.
    pub cluster_json: String,
    /// Plugin name, version and build facts.
    pub plugin: String,
    /// Run configuration, canonical JSON (an object).
    pub run_config_json: String,
}

/// The result of a rendezvous.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Membership {
    /// Rendezvous round.
    pub generation: u64,
    /// Data-plane address of each rank.
    pub data_addresses: Vec<String>,
}

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
    /// The chief refused this worker.
    #[error("rendezvous refused by the chief: {0}")]
    Refused(String),
    /// Members missing when the deadline passed.
    #[error("rendezvous: {missing} did not join within {timeout:?}")]
    NotJoined {
        /// The missing members, named.
        missing: String,
        /// The deadline.
        timeout: Duration,
    },
    /// The chief did not answer in time.
    #[error("rendezvous: no answer from the chief, {chief}, within {timeout:?}: {detail}")]
    ChiefSilent {
        /// The chief, named.
        chief: String,
        /// The deadline.
        timeout: Duration,
        /// What happened last.
        detail: String,
    },
    /// A barrier did not complete.
    #[error("barrier {name:?}: {detail}")]
    Barrier {
        /// Barrier name.
        name: String,
        /// What happened.
        detail: String,
    },
    /// Anything else from the runtime.
    #[error("control plane: {0}")]
    Other(String),
}

/// Chief-side state.
struct Coordinator {
    expected: Identity,
    names: Vec<String>,
    state: Mutex<CoordState>,
    /// Bumped on every state change that a waiting call may care about.
    version: watch::Sender<u64>,
}

#[derive(Default)]
struct CoordState {
    joined: Vec<Option<(u64, String)>>,
    membership: Option<Membership>,
    generation: u64,
    barriers: HashMap<(u64, String), HashSet<u32>>,
    last_heartbeat: Vec<Option<Instant>>,
}

impl Coordinator {
    fn bump(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    /// Waits (without losing a wakeup) until `done` holds.
    async fn wait_until(&self, done: impl Fn(&CoordState) -> bool) {
        let mut rx = self.version.subscribe();
        loop {
            if done(&self.state.lock().expect("coordinator state")) {
                return;
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    }

    fn missing(&self) -> Vec<String> {
        let st = self.state.lock().expect("coordinator state");
        st.joined.iter().enumerate().filter(|(_, j)| j.is_none()).map(|(r, _)| self.names[r].clone()).collect()
    }

    /// Why `req` cannot join, naming the member and both values.
    fn mismatch(&self, req: &proto::JoinRequest) -> Option<String> {
        let who = &self.names[req.rank as usize];
        let chief = &self.names[0];
        if req.cluster_json != self.expected.cluster_json {
            return Some(format!(
                "{who} has a different TF_CONFIG cluster: {} on {who}, {} on the chief, {chief}",
                req.cluster_json, self.expected.cluster_json
            ));
        }
        if req.plugin_identity != self.expected.plugin {
            return Some(format!(
                "{who} runs a different plugin: {} on {who}, {} on the chief, {chief}",
                req.plugin_identity, self.expected.plugin
            ));
        }
        if req.run_config_json != self.expected.run_config_json {
            return Some(format!(
                "{who} has a different run configuration: {} on the chief, {chief}",
                json_difference(&req.run_config_json, &self.expected.run_config_json, who)
            ));
        }
        None
    }
}

/// `key = theirs on WHO, ours` for the first differing key of two JSON objects.
fn json_difference(theirs: &str, ours: &str, who: &str) -> String {
    let parse = |s: &str| serde_json::from_str::<BTreeMap<String, serde_json::Value>>(s).unwrap_or_default();
    let (a, b) = (parse(theirs), parse(ours));
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    for key in keys {
        let (x, y) = (a.get(key), b.get(key));
        if x != y {
            let show = |v: Option<&serde_json::Value>| v.map_or("(absent)".to_string(), |v| v.to_string());
            return format!("{key} = {} on {who}, {}", show(x), show(y));
        }
    }
    format!("{theirs} on {who}, {ours}")
}

struct Service {
    rank: usize,
    names: Vec<String>,
    coordinator: Option<Arc<Coordinator>>,
}

impl Service {
    fn coordinator(&self) -> Result<&Arc<Coordinator>, Status> {
        self.coordinator.as_ref().ok_or_else(|| {
            Status::failed_precondition(format!(
                "{} is not the chief; the chief is {}",
                self.names[self.rank], self.names[0]
            ))
        })
    }
}

fn check_rank(rank: u32, world: usize) -> Result<usize, Status> {
    let r = rank as usize;
    if r >= world {
        return Err(Status::invalid_argument(format!("rank {rank} is out of range for {world} members")));
    }
    Ok(r)
}

#[tonic::async_trait]
impl Control for Service {
    async fn join(&self, request: Request<proto::JoinRequest>) -> Result<Response<proto::JoinReply>, Status> {
        let c = self.coordinator()?.clone();
        let req = request.into_inner();
        let rank = check_rank(req.rank, c.names.len())?;
        if let Some(why) = c.mismatch(&req) {
            tracing::warn!("refused {}: {why}", c.names[rank]);
            eprintln!("trainerd: refused {}: {why}", c.names[rank]);
            return Err(Status::failed_precondition(why));
        }
        {
            let mut st = c.state.lock().expect("coordinator state");
            if st.membership.is_some() && st.joined[rank].as_ref().map(|j| j.0) != Some(req.incarnation) {
                return Err(Status::failed_precondition(format!(
                    "the run's rendezvous already completed (generation {}); {} cannot rejoin a running run",
                    st.generation, c.names[rank]
                )));
            }
            st.joined[rank] = Some((req.incarnation, req.data_address.clone()));
            if st.membership.is_none() && st.joined.iter().all(Option::is_some) {
                st.generation += 1;
                let data_addresses = st.joined.iter().map(|j| j.as_ref().expect("all joined").1.clone()).collect();
                st.membership = Some(Membership { generation: st.generation, data_addresses });
            }
        }
        c.bump();
        c.wait_until(|st| st.membership.is_some()).await;
        let st = c.state.lock().expect("coordinator state");
        let m = st.membership.clone().expect("complete");
        Ok(Response::new(proto::JoinReply { generation: m.generation, data_addresses: m.data_addresses }))
    }

    async fn barrier(&self, request: Request<proto::BarrierRequest>) -> Result<Response<proto::BarrierReply>, Status> {
        let c = self.coordinator()?.clone();
        let req = request.into_inner();
        check_rank(req.rank, c.names.len())?;
        let key = (req.generation, req.name.clone());
        {
            let mut st = c.state.lock().expect("coordinator state");
            if req.generation != st.generation {
                return Err(Status::failed_precondition(format!(
                    "stale barrier from {}: generation {}, current {}",
                    c.names[req.rank as usize], req.generation, st.generation
                )));
            }
            st.barriers.entry(key.clone()).or_default().insert(req.rank);
        }
        c.bump();
        let world = c.names.len();
        c.wait_until(|st| st.barriers.get(&key).is_some_and(|s| s.len() == world)).await;
        Ok(Response::new(proto::BarrierReply {}))
    }

    async fn heartbeat(
        &self,
        request: Request<proto::HeartbeatRequest>,
    ) -> Result<Response<proto::HeartbeatReply>, Status> {
        let c = self.coordinator()?;
        let req = request.into_inner();
        let rank = check_rank(req.rank, c.names.len())?;
        let mut st = c.state.lock().expect("coordinator state");
        let current = st.joined[rank].as_ref().map(|j| j.0);
        if req.generation != st.generation || current != Some(req.incarnation) {
            return Err(Status::failed_precondition(format!(
                "stale heartbeat from {}: generation {} incarnation {:x}, current generation {} incarnation {}",
                c.names[rank],
                req.generation,
                req.incarnation,
                st.generation,
                current.map_or("(none)".into(), |i| format!("{i:x}"))
            )));
        }
        st.last_heartbeat[rank] = Some(Instant::now());
        Ok(Response::new(proto::HeartbeatReply { generation: st.generation }))
    }
}

/// Timeouts of the control plane.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// How long a rendezvous may wait for every member.
    pub rendezvous: Duration,
    /// How long a barrier may wait.
    pub barrier: Duration,
}

/// This daemon's control plane: its server, and a client to the chief.
pub struct ControlPlane {
    runtime: tokio::runtime::Runtime,
    cluster: ClusterConfig,
    names: Vec<String>,
    coordinator: Option<Arc<Coordinator>>,
    shutdown: Option<oneshot::Sender<()>>,
    incarnation: u64,
    membership: Option<Membership>,
    timeouts: Timeouts,
    heartbeat: Option<tokio::task::JoinHandle<()>>,
}

impl ControlPlane {
    /// Serves the control plane on this member's TF_CONFIG address (the chief also
    /// coordinates).
    pub fn start(
        cluster: &ClusterConfig,
        identity: Identity,
        timeouts: Timeouts,
    ) -> Result<ControlPlane, ClusterError> {
        let names: Vec<String> = cluster.members.iter().map(|m| m.to_string()).collect();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
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
        let addr = resolve(&me.address).map_err(bind_error)?;
        let listener = std::net::TcpListener::bind(addr).map_err(|e| bind_error(e.to_string()))?;
        listener.set_nonblocking(true).map_err(|e| bind_error(e.to_string()))?;
        let world = cluster.world_size();
        let coordinator = (cluster.rank == 0).then(|| {
            Arc::new(Coordinator {
                expected: identity,
                names: names.clone(),
                state: Mutex::new(CoordState {
                    joined: vec![None; world],
                    last_heartbeat: vec![None; world],
                    ..Default::default()
                }),
                version: watch::channel(0).0,
            })
        });
        let service = Service { rank: cluster.rank, names: names.clone(), coordinator: coordinator.clone() };
        let (shutdown, shutdown_rx) = oneshot::channel::<()>();
        let _guard = runtime.enter();
        let listener = tokio::net::TcpListener::from_std(listener).map_err(|e| bind_error(e.to_string()))?;
        runtime.spawn(async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let served = tonic::transport::Server::builder()
                .add_service(ControlServer::new(service))
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = shutdown_rx.await;
                })
                .await;
            if let Err(e) = served {
                tracing::error!("control plane server stopped: {e}");
            }
        });
        Ok(ControlPlane {
            runtime,
            cluster: cluster.clone(),
            names,
            coordinator,
            shutdown: Some(shutdown),
            incarnation: rand::random(),
            membership: None,
            timeouts,
            heartbeat: None,
        })
    }

    /// Names of the members, by rank (`worker 1 (host:port)`).
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Joins the run through the chief and waits until every member has joined. On success,
    /// starts sending heartbeats.
    pub fn rendezvous(&mut self, identity: &Identity, data_address: String) -> Result<Membership, ClusterError> {
        let timeout = self.timeouts.rendezvous;
        let deadline = Instant::now() + timeout;
        let chief = self.cluster.members[0].address.clone();
        let request = proto::JoinRequest {
            rank: self.cluster.rank as u32,
            incarnation: self.incarnation,
            cluster_json: identity.cluster_json.clone(),
            plugin_identity: identity.plugin.clone(),
            run_config_json: identity.run_config_json.clone(),
            data_address,
        };
        let result = self.runtime.block_on(async {
            let mut client = connect(&chief, deadline).await?;
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, client.join(request)).await {
                Err(_) => Err("timed out waiting for the other members".to_string()),
                Ok(Ok(reply)) => Ok(Ok(reply.into_inner())),
                Ok(Err(status)) if status.code() == tonic::Code::FailedPrecondition => {
                    Ok(Err(status.message().to_string()))
                }
                Ok(Err(status)) => Err(status.message().to_string()),
            }
        });
        let reply = match result {
            Ok(Ok(reply)) => reply,
            Ok(Err(refusal)) => return Err(ClusterError::Refused(refusal)),
            Err(detail) => {
                if let Some(c) = &self.coordinator {
                    let missing = c.missing();
                    if !missing.is_empty() {
                        return Err(ClusterError::NotJoined { missing: missing.join(", "), timeout });
                    }
                }
                return Err(ClusterError::ChiefSilent { chief: self.names[0].clone(), timeout, detail });
            }
        };
        let membership = Membership { generation: reply.generation, data_addresses: reply.data_addresses };
        self.membership = Some(membership.clone());
        self.start_heartbeats(membership.generation);
        Ok(membership)
    }

    fn start_heartbeats(&mut self, generation: u64) {
        let chief = self.cluster.members[0].address.clone();
        let (rank, incarnation) = (self.cluster.rank as u32, self.incarnation);
        let chief_name = self.names[0].clone();
        self.heartbeat = Some(self.runtime.spawn(async move {
            let mut client: Option<ControlClient<Channel>> = None;
            let mut warned = false;
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                if client.is_none() {
                    client = connect(&chief, Instant::now() + Duration::from_secs(2)).await.ok();
                }
                let Some(c) = client.as_mut() else { continue };
                let beat = proto::HeartbeatRequest { generation, rank, incarnation };
                match tokio::time::timeout(Duration::from_secs(2), c.heartbeat(beat)).await {
                    Ok(Ok(_)) => warned = false,
                    Ok(Err(status)) if status.code() == tonic::Code::FailedPrecondition => {
                        tracing::warn!("heartbeat refused by the chief: {}", status.message());
                    }
                    _ if !warned => {
                        tracing::warn!("no heartbeat answer from the chief, {chief_name}");
                        warned = true;
                        client = None;
                    }
                    _ => client = None,
                }
            }
        }));
    }

    /// Waits until every member reaches the barrier `name`.
    pub fn barrier(&self, name: &str) -> Result<(), ClusterError> {
        let membership = self
            .membership
            .as_ref()
            .ok_or_else(|| ClusterError::Barrier { name: name.into(), detail: "no rendezvous yet".into() })?;
        let timeout = self.timeouts.barrier;
        let deadline = Instant::now() + timeout;
        let chief = self.cluster.members[0].address.clone();
        let request = proto::BarrierRequest {
            generation: membership.generation,
            rank: self.cluster.rank as u32,
            incarnation: self.incarnation,
            name: name.into(),
        };
        self.runtime
            .block_on(async {
                let mut client = connect(&chief, deadline).await?;
                let left = deadline.saturating_duration_since(Instant::now());
                match tokio::time::timeout(left, client.barrier(request)).await {
                    Err(_) => Err(format!("not every member arrived within {timeout:?}")),
                    Ok(Err(status)) => Err(status.message().to_string()),
                    Ok(Ok(_)) => Ok(()),
                }
            })
            .map_err(|detail| ClusterError::Barrier { name: name.into(), detail })
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
    }
}

/// The first socket address of `host:port`.
pub fn resolve(address: &str) -> Result<SocketAddr, String> {
    address
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve: {e}"))?
        .next()
        .ok_or_else(|| "resolves to no address".to_string())
}

/// A client to `address`, retrying until `deadline` (the peer may not be up yet).
async fn connect(address: &str, deadline: Instant) -> Result<ControlClient<Channel>, String> {
    let endpoint = Endpoint::from_shared(format!("http://{address}"))
        .map_err(|e| format!("bad address {address}: {e}"))?
        .connect_timeout(Duration::from_secs(1))
        .tcp_nodelay(true);
    let mut last = String::from("deadline passed before the first attempt");
    while Instant::now() < deadline {
        match endpoint.connect().await {
            Ok(channel) => return Ok(ControlClient::new(channel)),
            Err(e) => {
                last = format!("cannot connect to {address}: {}", source_chain(&e));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    Err(last)
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

    const T: Timeouts = Timeouts { rendezvous: Duration::from_secs(10), barrier: Duration::from_secs(10) };

    #[test]
    fn three_members_rendezvous_and_pass_a_barrier() {
        let ports = [free_port(), free_port(), free_port()];
        let results: Vec<Membership> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3)
                .map(|rank| {
                    s.spawn(move || {
                        let c = cluster(&ports, rank);
                        let id = identity(&c, r#"{"batch":64}"#);
                        let mut plane = ControlPlane::start(&c, id.clone(), T).unwrap();
                        let m = plane.rendezvous(&id, format!("127.0.0.1:{}", 1000 + rank)).unwrap();
                        plane.barrier("done").unwrap();
                        m
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for m in &results {
            assert_eq!(m.generation, 1);
            assert_eq!(m.data_addresses, ["127.0.0.1:1000", "127.0.0.1:1001", "127.0.0.1:1002"]);
        }
    }

    #[test]
    fn a_different_run_configuration_is_refused_with_both_values() {
        let ports = [free_port(), free_port()];
        let c0 = cluster(&ports, 0);
        let id0 = identity(&c0, r#"{"batch_size":64,"seed":0}"#);
        let chief = ControlPlane::start(&c0, id0, Timeouts { rendezvous: Duration::from_secs(1), ..T }).unwrap();
        let c1 = cluster(&ports, 1);
        let id1 = identity(&c1, r#"{"batch_size":32,"seed":0}"#);
        let mut worker = ControlPlane::start(&c1, id1.clone(), T).unwrap();
        let err = worker.rendezvous(&id1, "127.0.0.1:1".into()).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "rendezvous refused by the chief: worker 1 (127.0.0.1:{}) has a different run configuration: \
                 batch_size = 32 on worker 1 (127.0.0.1:{}), 64 on the chief, worker 0 (127.0.0.1:{})",
                ports[1], ports[1], ports[0]
            )
        );
        drop(chief);
    }

    #[test]
    fn the_chief_names_a_member_that_never_comes() {
        let ports = [free_port(), free_port()];
        let c0 = cluster(&ports, 0);
        let id0 = identity(&c0, "{}");
        let mut chief =
            ControlPlane::start(&c0, id0.clone(), Timeouts { rendezvous: Duration::from_millis(800), ..T }).unwrap();
        let err = chief.rendezvous(&id0, "127.0.0.1:1".into()).unwrap_err().to_string();
        assert_eq!(err, format!("rendezvous: worker 1 (127.0.0.1:{}) did not join within 800ms", ports[1]));
    }

    #[test]
    fn a_port_in_use_is_named() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let c = cluster(&[port, free_port()], 0);
        let err = ControlPlane::start(&c, identity(&c, "{}"), T).err().unwrap().to_string();
        assert_eq!(
            err,
            format!(
                "cannot listen on 127.0.0.1:{port} (worker 0 (127.0.0.1:{port})'s address in TF_CONFIG): Address \
                 already in use (os error 98)"
            )
        );
    }
}
