//! How a member reaches the others: [`Dial`] opens gRPC channels to a peer (through the cluster
//! secret's handshake when there is one), [`authenticated`] admits incoming connections to the
//! control plane's server only once they passed it, and [`push_abort`] carries a failure notice
//! to every peer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use super::super::wire::{proto, ControlClient};
use crate::auth::{self, ClusterKey, Plane};
use crate::cluster::election::Elections;
use crate::cluster::error::{DialError, ResolveError};

/// What a control-plane connection lets its peer send it before it reads any (HTTP/2's flow
/// control: a stream's window and the connection's, in bytes), and its largest frame. A catch-up
/// streams a state and each step's outputs (gigabytes at 1 GB of state) from the coordinator
/// over it. At hyper's defaults (windows of 2 and 5 MB, frames of 16 KB) the sender waits for
/// the returner's window updates every 2 MB, and on a machine whose cores the training keeps
/// busy each wait is long: on 2 cores a 1 GB state came in (from the returner's request to its
/// decoding) in 7.4 s, in 5.6-6.4 s with these windows, and in 4.8-5.0 s with 4 MiB pieces as
/// well (`catch_up::PIECE`). The other calls are small, so the windows cost nothing where nothing
/// is streamed.
pub(super) const HTTP2_WINDOWS: (u32, u32, u32) = (64 << 20, 128 << 20, 8 << 20);

/// Pushes an abort notice for `generation` to every peer (fire and forget, bounded).
pub(super) fn push_abort(peers: &Arc<Vec<Option<ControlClient<Channel>>>>, generation: u64, rank: u32, reason: &str) {
    for client in peers.iter().flatten() {
        let mut client = client.clone();
        let request = proto::AbortRequest { generation, rank, reason: reason.into() };
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(1), client.abort(request)).await;
        });
    }
}

/// The first socket address of `host:port`.
pub(crate) fn resolve(address: &str) -> Result<std::net::SocketAddr, ResolveError> {
    use std::net::ToSocketAddrs;
    address.to_socket_addrs().map_err(ResolveError::Lookup)?.next().ok_or(ResolveError::NoAddress)
}

/// The port of `host:port` (a host that does not resolve yet can still be listened for).
pub(super) fn port_of(address: &str) -> Option<u16> {
    address.rsplit_once(':').and_then(|(_, p)| p.parse().ok())
}

/// Accepted connections that passed the authentication handshake (every one without a key),
/// for the gRPC server; the task that accepts them. Handshakes run concurrently (at most 64),
/// each within its timeout, so a silent client holds up nobody.
pub(super) fn authenticated(
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
pub(super) struct Dial {
    address: String,
    key: Option<ClusterKey>,
}

impl Dial {
    pub(super) fn new(address: &str, key: &Option<ClusterKey>) -> Dial {
        Dial { address: address.to_string(), key: key.clone() }
    }

    fn endpoint(&self) -> Result<Endpoint, DialError> {
        let (stream, connection, frame) = HTTP2_WINDOWS;
        Ok(Endpoint::from_shared(format!("http://{}", self.address))
            .map_err(|source| DialError::Address { address: self.address.clone(), source })?
            .connect_timeout(Duration::from_secs(1))
            .initial_stream_window_size(stream)
            .initial_connection_window_size(connection)
            .max_frame_size(frame))
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
    pub(super) fn lazy(&self) -> Option<ControlClient<Channel>> {
        let endpoint = self.endpoint().ok()?;
        Some(ControlClient::new(endpoint.connect_with_connector_lazy(self.connector())))
    }

    /// A client, retrying until `until` ([`Dial::connect`]); `None` once `elections` follows
    /// another coordinator than the one of `term` (`rank`) this dials: a connection to one that
    /// died or froze is given up on at once.
    pub(super) async fn connect_while_followed(
        &self,
        until: Instant,
        elections: &Elections,
        (term, rank): (u64, usize),
    ) -> Option<Result<ControlClient<Channel>, DialError>> {
        tokio::select! {
            c = self.connect(until) => Some(c),
            () = elections.moved_from(Some((term, rank))) => None,
        }
    }

    /// A client, retrying until `deadline` (the peer may not be up yet). The first attempt is
    /// always made: a deadline that passed while this thread waited for a core (a returner's
    /// single attempt to catch up is 1 ms long) is no reason not to try.
    pub(super) async fn connect(&self, deadline: Instant) -> Result<ControlClient<Channel>, DialError> {
        let endpoint = self.endpoint()?;
        loop {
            let source = match endpoint.connect_with_connector(self.connector()).await {
                Ok(channel) => return Ok(ControlClient::new(channel)),
                Err(source) => source,
            };
            if Instant::now() >= deadline {
                return Err(DialError::Connect { address: self.address.clone(), source });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
