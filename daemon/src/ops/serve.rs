//! `--metrics-addr`: Prometheus's `/metrics` (OpenMetrics text) and `/healthz` (200 `ok`, or
//! 503 with why) over HTTP/1, on a thread and runtime of their own so that a slow scraper never
//! touches training. With `--metrics-token-file`, `/metrics` answers only requests that carry
//! `Authorization: Bearer <token>` (Prometheus's `authorization.credentials_file`); `/healthz`
//! says only `ok` or `unhealthy` and stays open to probes.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};

use super::Telemetry;

/// Why `/metrics` cannot be served.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ServeError {
    /// The token file is not to be trusted, or not a token.
    #[error("--metrics-token-file {}: {why}", path.display())]
    Token {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong, and what to do.
        #[source]
        why: crate::auth::trust::TrustError,
    },
    /// The address cannot be bound.
    #[error("--metrics-addr {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The server could not be set up.
    #[error("{0}")]
    Setup(#[source] std::io::Error),
}

/// The bearer token `/metrics` requires.
#[derive(Clone)]
pub(crate) struct Token(Arc<[u8]>);

impl Token {
    /// Reads `--metrics-token-file` (held to the same rules as the cluster secret).
    pub(crate) fn load(path: &Path) -> Result<Token, ServeError> {
        crate::auth::trust::read_secret(path, "a token", crate::auth::MIN_SECRET_BYTES, "")
            .map(|token| Token(Arc::from(token)))
            .map_err(|why| ServeError::Token { path: path.to_path_buf(), why })
    }

    /// Whether `header` is `Bearer <this token>`, compared in constant time.
    fn admits(&self, header: Option<&[u8]>) -> bool {
        let Some(given) = header.and_then(|h| h.strip_prefix(b"Bearer ")) else { return false };
        given.len() == self.0.len() && given.iter().zip(self.0.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

fn reply(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(Bytes::from(body)))
        .expect("a valid response")
}

fn answer(t: &Telemetry, token: Option<&Token>, req: &Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    const TEXT: &str = "text/plain; charset=utf-8";
    match req.uri().path() {
        "/metrics" => {
            let header = req.headers().get(hyper::header::AUTHORIZATION).map(|v| v.as_bytes());
            if token.is_some_and(|k| !k.admits(header)) {
                return reply(StatusCode::UNAUTHORIZED, TEXT, "unauthorized\n".into());
            }
            reply(StatusCode::OK, "application/openmetrics-text; version=1.0.0; charset=utf-8", t.encode())
        }
        "/healthz" => match (t.healthy(), token) {
            (Ok(()), _) => reply(StatusCode::OK, TEXT, "ok\n".into()),
            (Err(_), Some(_)) => reply(StatusCode::SERVICE_UNAVAILABLE, TEXT, "unhealthy\n".into()),
            (Err(why), None) => reply(StatusCode::SERVICE_UNAVAILABLE, TEXT, format!("unhealthy: {why}\n")),
        },
        _ => reply(StatusCode::NOT_FOUND, TEXT, "not found: /metrics and /healthz are served\n".into()),
    }
}

/// Serves `/metrics` and `/healthz` on `addr` until the process ends; the bound address.
pub(crate) fn start(
    addr: SocketAddr,
    telemetry: Arc<Telemetry>,
    token: Option<Token>,
) -> Result<SocketAddr, ServeError> {
    let listener = std::net::TcpListener::bind(addr).map_err(|source| ServeError::Bind { addr, source })?;
    let bound = listener.local_addr().map_err(ServeError::Setup)?;
    listener.set_nonblocking(true).map_err(ServeError::Setup)?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(ServeError::Setup)?;
    std::thread::Builder::new()
        .name("trainerd-metrics".into())
        .spawn(move || {
            runtime.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => return tracing::error!("metrics server: {e}"),
                };
                loop {
                    let Ok((stream, _)) = listener.accept().await else { continue };
                    let (t, token) = (Arc::clone(&telemetry), token.clone());
                    tokio::spawn(async move {
                        let service = hyper::service::service_fn(move |req| {
                            let response = answer(&t, token.as_ref(), &req);
                            async move { Ok::<_, Infallible>(response) }
                        });
                        let io = hyper_util::rt::TokioIo::new(stream);
                        let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
                    });
                }
            })
        })
        .map_err(ServeError::Setup)?;
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_must_match_exactly() {
        let t = Token(Arc::from(&b"0123456789abcdef"[..]));
        assert!(t.admits(Some(b"Bearer 0123456789abcdef")));
        assert!(!t.admits(Some(b"Bearer 0123456789abcdeX")));
        assert!(!t.admits(Some(b"Bearer 0123456789abcde")));
        assert!(!t.admits(Some(b"0123456789abcdef")));
        assert!(!t.admits(None));
    }
}
