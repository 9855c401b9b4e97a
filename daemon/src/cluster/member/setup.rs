//! What stands a member's control plane up: its runtime, the coordinator it holds at start (its
//! kept vote), its bound port, its clients for the other members, and its server.

use std::sync::Arc;

use tokio::sync::oneshot;
use tonic::transport::Channel;

use super::super::coordinator::{Coordinator, Seat};
use super::super::election::{vote_file, Elections};
use super::super::error::BindError;
use super::super::network::Network;
use super::super::service::Service;
use super::super::tf_config::ClusterConfig;
use super::super::timeouts::Timeouts;
use super::super::wire::{ControlClient, ControlServer, Identity};
use super::dial::{authenticated, port_of, resolve, Dial};
use super::{Chair, ClusterError};

/// The control plane's runtime: two threads.
pub(super) fn control_runtime() -> Result<tokio::runtime::Runtime, ClusterError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("trainerd-control")
        .enable_all()
        .build()
        .map_err(ClusterError::Setup)
}

/// This member's vote (kept in `state_dir`, if given) and the coordinator it holds at start: the
/// chief coordinates term 0; a member whose kept vote says it won a term takes it up again.
pub(super) fn seat(
    cluster: &ClusterConfig,
    identity: &Identity,
    timeouts: Timeouts,
    state_dir: Option<&std::path::Path>,
) -> Result<(Arc<Elections>, Chair), ClusterError> {
    let names: Vec<String> = cluster.members.iter().map(|m| m.to_string()).collect();
    let file = state_dir.map(|dir| vote_file(dir, cluster.rank, &run_identity(identity)));
    let elections = Arc::new(Elections::open(file)?);
    let coordinator = match elections.coordinator() {
        Some((term, rank)) if rank == cluster.rank => {
            let seat = Seat { rank, term, ..Seat::default() };
            Some(Coordinator::new(identity.clone(), names.clone(), timeouts.options(names.len()), seat))
        }
        _ => None,
    };
    Ok((elections, Arc::new(std::sync::RwLock::new(coordinator))))
}

/// What tells this run from another in a member's state directory: the cluster, the plugin and
/// the run configuration.
pub(super) fn run_identity(identity: &Identity) -> String {
    format!("{}\n{}\n{}", identity.cluster_json, identity.plugin, identity.run_config_json)
}

/// This member's TF_CONFIG port, bound as `network` says; `name` is this member's.
pub(super) fn bind(
    cluster: &ClusterConfig,
    network: &Network,
    name: &str,
) -> Result<std::net::TcpListener, ClusterError> {
    let me = cluster.me();
    let bind_error =
        |reason: BindError| ClusterError::Bind { address: me.address.clone(), member: name.to_string(), reason };
    let port = resolve(&me.address)
        .map(|a| a.port())
        .or_else(|e| port_of(&me.address).ok_or(e))
        .map_err(|e| bind_error(e.into()))?;
    let addr = std::net::SocketAddr::new(network.bind, port);
    let listener = std::net::TcpListener::bind(addr).map_err(|source| {
        bind_error(if addr.to_string() == me.address {
            BindError::Address(source)
        } else {
            BindError::Other { addr, source }
        })
    })?;
    listener.set_nonblocking(true).map_err(|e| bind_error(BindError::Address(e)))?;
    Ok(listener)
}

/// A client for every other member (connecting on first use), by rank.
pub(super) fn peers(cluster: &ClusterConfig, network: &Network) -> Vec<Option<ControlClient<Channel>>> {
    let dial = |(r, m): (usize, &super::super::tf_config::Member)| {
        (r != cluster.rank).then(|| Dial::new(&m.address, &network.key).lazy())?
    };
    cluster.members.iter().enumerate().map(dial).collect()
}

/// Serves the control plane on `listener` until `shutdown`: connections admitted once they pass
/// the cluster secret's handshake, answered by `service`. The tasks, to abort on drop.
pub(super) fn serve(
    listener: tokio::net::TcpListener,
    service: Service,
    network: &Network,
    shutdown: oneshot::Receiver<()>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let (accepting, incoming) = authenticated(listener, network.key.clone());
    let serving = tokio::spawn(async move {
        let (stream, connection, frame) = super::dial::HTTP2_WINDOWS;
        let served = tonic::transport::Server::builder()
            .initial_stream_window_size(stream)
            .initial_connection_window_size(connection)
            .max_frame_size(frame)
            .add_service(ControlServer::new(service))
            .serve_with_incoming_shutdown(incoming, async {
                let _ = shutdown.await;
            })
            .await;
        if let Err(e) = served {
            tracing::error!("control plane server stopped: {e}");
        }
    });
    vec![accepting, serving]
}
