//! Peer authentication: every connection to a daemon's control plane or data plane opens with a
//! mutual challenge that proves both ends know the cluster secret, before a single byte of the
//! protocol is read (`docs/operations.md`, "Authentication").
//!
//! ```text
//! server -> client   "TRDAUTH1" ‖ Ns                     (8 + 32 bytes)
//! client -> server   Nc ‖ HMAC(K, "client" ‖ plane ‖ Ns ‖ Nc)   (32 + 32 bytes)
//! server -> client   HMAC(K, "server" ‖ plane ‖ Ns ‖ Nc)        (32 bytes)
//! ```
//!
//! `K` is the secret file's bytes, `Ns` and `Nc` fresh random nonces, `plane` names the port
//! (a proof made for one plane is worthless on the other), and the role labels stop a proof
//! from being reflected back. Tags are compared in constant time (`hmac`'s `verify_slice`). A
//! peer that fails is disconnected without a reply: it learns that a trainerd listens there and
//! nothing about the cluster. A cluster with no secret (loopback only, or `--insecure`) skips
//! the exchange on both ends.

pub(crate) mod trust;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;

const MAGIC: [u8; 8] = *b"TRDAUTH1";
const NONCE: usize = 32;
const TAG: usize = 32;
/// Bytes of the server's challenge.
pub(crate) const CHALLENGE_BYTES: usize = MAGIC.len() + NONCE;
/// How long either end waits for the other's part of the exchange.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// Shortest secret accepted.
pub(crate) const MIN_SECRET_BYTES: usize = 16;

/// Which listener a connection is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Plane {
    /// The gRPC control plane (the TF_CONFIG port).
    Control,
    /// The ring's data listener.
    Data,
}

impl Plane {
    fn label(self) -> &'static [u8] {
        match self {
            Plane::Control => b"control",
            Plane::Data => b"data",
        }
    }
}

/// Why a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The other end does not speak the handshake (no secret configured there, or not trainerd).
    #[error("it did not start the authentication handshake (is the same --secret-file set on every worker?)")]
    NoHandshake,
    /// The other end's proof is wrong (or it refused ours): the secrets differ.
    #[error("the cluster secrets differ (is the same --secret-file set on every worker?)")]
    WrongSecret,
    /// The connection failed during the exchange.
    #[error("the authentication handshake broke off: {0}")]
    Io(#[source] std::io::Error),
    /// The other end did not answer in time.
    #[error("the authentication handshake broke off: timed out")]
    TimedOut,
}

/// A problem with the secret file.
#[derive(Debug, thiserror::Error)]
#[error("--secret-file {}: {why}", path.display())]
pub(crate) struct SecretFileError {
    /// The file.
    pub(crate) path: PathBuf,
    /// What is wrong, and what to do.
    #[source]
    pub(crate) why: trust::TrustError,
}

/// The cluster secret. Cheap to clone; its bytes are never printed.
#[derive(Clone)]
pub struct ClusterKey(Arc<[u8]>);

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterKey(..)")
    }
}

impl ClusterKey {
    /// A key from bytes (tests, and [`ClusterKey::load`]).
    pub(crate) fn from_bytes(bytes: &[u8]) -> ClusterKey {
        ClusterKey(Arc::from(bytes))
    }

    /// Reads the secret file: it must be a regular file owned by this user or root that nobody
    /// else can write or read, holding at least [`MIN_SECRET_BYTES`] (surrounding white space,
    /// such as a trailing newline, is not part of the secret).
    pub(crate) fn load(path: &Path) -> Result<ClusterKey, SecretFileError> {
        let hint = " (make one with `head -c 32 /dev/urandom | base64 > FILE`)";
        crate::auth::trust::read_secret(path, "a cluster secret", MIN_SECRET_BYTES, hint)
            .map(|secret| ClusterKey::from_bytes(&secret))
            .map_err(|why| SecretFileError { path: path.to_path_buf(), why })
    }

    fn tag(&self, role: &[u8], plane: Plane, server_nonce: &[u8], client_nonce: &[u8]) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        for part in [b"trainerd-auth-v1 ".as_slice(), role, b" ", plane.label(), server_nonce, client_nonce] {
            mac.update(part);
        }
        mac
    }
}

/// What a listener logs about a peer it refused.
pub(crate) fn refusal(e: &AuthError) -> String {
    match e {
        AuthError::WrongSecret => "it did not prove that it knows the cluster secret".into(),
        AuthError::NoHandshake => "it did not speak the authentication handshake".into(),
        AuthError::Io(why) => format!("it did not complete the authentication handshake ({why})"),
        AuthError::TimedOut => "it did not complete the authentication handshake (timed out)".into(),
    }
}

fn challenge() -> ([u8; CHALLENGE_BYTES], [u8; NONCE]) {
    let nonce: [u8; NONCE] = rand::random();
    let mut c = [0u8; CHALLENGE_BYTES];
    c[..MAGIC.len()].copy_from_slice(&MAGIC);
    c[MAGIC.len()..].copy_from_slice(&nonce);
    (c, nonce)
}

/// The client's answer to `challenge`, and the server's proof it expects back.
fn answer(
    key: &ClusterKey,
    plane: Plane,
    challenge: &[u8; CHALLENGE_BYTES],
) -> Result<([u8; NONCE + TAG], Hmac<Sha256>), AuthError> {
    let (magic, server_nonce) = challenge.split_at(MAGIC.len());
    if magic != MAGIC {
        return Err(AuthError::NoHandshake);
    }
    let client_nonce: [u8; NONCE] = rand::random();
    let mut reply = [0u8; NONCE + TAG];
    reply[..NONCE].copy_from_slice(&client_nonce);
    reply[NONCE..].copy_from_slice(&key.tag(b"client", plane, server_nonce, &client_nonce).finalize().into_bytes());
    Ok((reply, key.tag(b"server", plane, server_nonce, &client_nonce)))
}

/// The server's check of the client's answer; its proof, when the answer is right.
fn confirm(
    key: &ClusterKey,
    plane: Plane,
    server_nonce: &[u8; NONCE],
    reply: &[u8; NONCE + TAG],
) -> Result<[u8; TAG], AuthError> {
    let (client_nonce, tag) = reply.split_at(NONCE);
    key.tag(b"client", plane, server_nonce, client_nonce).verify_slice(tag).map_err(|_| AuthError::WrongSecret)?;
    Ok(key.tag(b"server", plane, server_nonce, client_nonce).finalize().into_bytes().into())
}

fn io(e: std::io::Error) -> AuthError {
    AuthError::Io(e)
}

/// The server's side on a blocking stream (read timeouts set by the caller).
pub(crate) fn accept_blocking<S: Read + Write>(
    stream: &mut S,
    key: &ClusterKey,
    plane: Plane,
) -> Result<(), AuthError> {
    let (c, nonce) = challenge();
    stream.write_all(&c).map_err(io)?;
    let mut reply = [0u8; NONCE + TAG];
    stream.read_exact(&mut reply).map_err(io)?;
    let proof = confirm(key, plane, &nonce, &reply)?;
    stream.write_all(&proof).map_err(io)
}

/// The client's side on a blocking stream (read timeouts set by the caller).
pub(crate) fn connect_blocking<S: Read + Write>(
    stream: &mut S,
    key: &ClusterKey,
    plane: Plane,
) -> Result<(), AuthError> {
    let mut c = [0u8; CHALLENGE_BYTES];
    stream.read_exact(&mut c).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut | std::io::ErrorKind::UnexpectedEof => {
            AuthError::NoHandshake
        }
        _ => io(e),
    })?;
    let (reply, expected) = answer(key, plane, &c)?;
    stream.write_all(&reply).map_err(io)?;
    let mut proof = [0u8; TAG];
    stream.read_exact(&mut proof).map_err(|e| match e.kind() {
        // The server hangs up on a wrong answer.
        std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset => AuthError::WrongSecret,
        _ => io(e),
    })?;
    expected.verify_slice(&proof).map_err(|_| AuthError::WrongSecret)
}

/// The server's side on an async stream, within [`HANDSHAKE_TIMEOUT`].
pub(crate) async fn accept<S>(stream: &mut S, key: &ClusterKey, plane: Plane) -> Result<(), AuthError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let (c, nonce) = challenge();
        stream.write_all(&c).await.map_err(io)?;
        let mut reply = [0u8; NONCE + TAG];
        stream.read_exact(&mut reply).await.map_err(io)?;
        let proof = confirm(key, plane, &nonce, &reply)?;
        stream.write_all(&proof).await.map_err(io)
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, exchange).await.map_err(|_| AuthError::TimedOut)?
}

/// The client's side on an async stream, within [`HANDSHAKE_TIMEOUT`].
pub(crate) async fn connect<S>(stream: &mut S, key: &ClusterKey, plane: Plane) -> Result<(), AuthError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut c = [0u8; CHALLENGE_BYTES];
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, stream.read_exact(&mut c)).await {
        Err(_) | Ok(Err(_)) => return Err(AuthError::NoHandshake),
        Ok(Ok(_)) => {}
    }
    let (reply, expected) = answer(key, plane, &c)?;
    stream.write_all(&reply).await.map_err(io)?;
    let mut proof = [0u8; TAG];
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, stream.read_exact(&mut proof)).await {
        Err(_) => return Err(AuthError::TimedOut),
        Ok(Err(_)) => return Err(AuthError::WrongSecret),
        Ok(Ok(_)) => {}
    }
    expected.verify_slice(&proof).map_err(|_| AuthError::WrongSecret)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    /// Runs the server side on a thread and the client side here.
    fn exchange(
        server: Option<ClusterKey>,
        client: &ClusterKey,
        plane: (Plane, Plane),
    ) -> (Result<(), AuthError>, Result<(), AuthError>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
            match server {
                Some(k) => accept_blocking(&mut s, &k, plane.0),
                None => {
                    // A server without a secret reads a protocol hello and waits.
                    let _ = s.read(&mut [0u8; 64]);
                    Ok(())
                }
            }
        });
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
        let client_side = connect_blocking(&mut c, client, plane.1);
        drop(c);
        (t.join().unwrap(), client_side)
    }

    #[test]
    fn both_ends_with_the_secret_pass_and_anything_else_is_refused() {
        let k = ClusterKey::from_bytes(b"0123456789abcdef-the-secret");
        let other = ClusterKey::from_bytes(b"0123456789abcdef-another-one");
        let (server, client) = exchange(Some(k.clone()), &k, (Plane::Data, Plane::Data));
        assert!(server.is_ok() && client.is_ok(), "{server:?} {client:?}");
        let (server, client) = exchange(Some(k.clone()), &other, (Plane::Data, Plane::Data));
        assert!(matches!(server, Err(AuthError::WrongSecret)), "{server:?}");
        assert!(matches!(client, Err(AuthError::WrongSecret)), "{client:?}");
        // A proof made for the control plane is refused on the data plane.
        let (server, _) = exchange(Some(k.clone()), &k, (Plane::Data, Plane::Control));
        assert!(matches!(server, Err(AuthError::WrongSecret)), "{server:?}");
        // A server that does not speak the handshake.
        let (_, client) = exchange(None, &k, (Plane::Data, Plane::Data));
        assert!(matches!(client, Err(AuthError::NoHandshake)), "{client:?}");
        assert_eq!(
            client.unwrap_err().to_string(),
            "it did not start the authentication handshake (is the same --secret-file set on every worker?)"
        );
    }

    #[test]
    fn a_client_that_does_not_answer_learns_only_the_challenge() {
        let k = ClusterKey::from_bytes(b"0123456789abcdef-the-secret");
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
            accept_blocking(&mut s, &k, Plane::Control)
        });
        let mut c = TcpStream::connect(addr).unwrap();
        // A gRPC client's opening bytes instead of an answer.
        c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
        let mut got = Vec::new();
        c.read_to_end(&mut got).unwrap();
        assert_eq!(got.len(), CHALLENGE_BYTES, "the challenge and nothing else");
        assert_eq!(&got[..8], b"TRDAUTH1");
        assert!(matches!(t.join().unwrap(), Err(AuthError::Io(_))));
    }

    #[test]
    fn secret_files_others_can_write_or_read_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "0123456789abcdef0123\n").unwrap();
        let set = |mode| std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        set(0o600);
        assert!(ClusterKey::load(&path).is_ok());
        set(0o640);
        assert!(ClusterKey::load(&path).is_ok());
        set(0o644);
        let p = path.display();
        assert_eq!(
            ClusterKey::load(&path).unwrap_err().to_string(),
            format!("--secret-file {p}: every user can read it (mode 0644); run `chmod 600 {p}`")
        );
        set(0o666);
        assert_eq!(
            ClusterKey::load(&path).unwrap_err().to_string(),
            format!("--secret-file {p}: every user can write it (mode 0666); run `chmod go-w {p}`")
        );
        set(0o600);
        std::fs::write(&path, "short\n").unwrap();
        assert!(ClusterKey::load(&path)
            .unwrap_err()
            .to_string()
            .contains("holds 5 byte(s); a cluster secret needs at least 16"));
    }
}
