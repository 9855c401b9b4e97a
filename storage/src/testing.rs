//! A backend wrapper that injects faults, as object_store's `ThrottledStore` wraps any store:
//! it "crashes" at the N-th write (that write and every later one fail, as if the process had
//! died there), or fails the next N writes with a transient error (a server that comes back).
//! The storage tests use it to stop a commit at every write point in turn.
//!
//! Also: [`S3Server`], a real S3-compatible server for tests, and [`TcpProxy`], a link to a
//! server that a test cuts and restores (a storage outage).

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use futures::stream::{BoxStream, StreamExt};
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore, PutMode,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, UploadPart,
};

#[derive(Debug, Default)]
struct Counters {
    writes: AtomicUsize,
    crash_at: AtomicUsize,
    transient: AtomicUsize,
    /// Writes lose their create-if-absent condition (a server that ignores `If-None-Match`).
    ignore_conditions: std::sync::atomic::AtomicBool,
    /// Multipart uploads aborted.
    aborts: AtomicUsize,
}

impl Counters {
    /// Counts a write and decides whether it fails.
    fn write(&self, what: &str) -> object_store::Result<()> {
        let n = self.writes.fetch_add(1, Ordering::SeqCst);
        if n >= self.crash_at.load(Ordering::SeqCst) {
            return Err(injected(format!("crashed before write {n} ({what})")));
        }
        if self.transient.load(Ordering::SeqCst) > 0 {
            self.transient.fetch_sub(1, Ordering::SeqCst);
            return Err(injected(format!("transient failure of write {n} ({what}): 503 Service Unavailable")));
        }
        Ok(())
    }
}

fn injected(message: String) -> object_store::Error {
    object_store::Error::Generic { store: "FaultStore", source: message.into() }
}

/// A store that fails on request.
#[derive(Debug, Clone)]
pub struct FaultStore {
    inner: Arc<dyn ObjectStore>,
    counters: Arc<Counters>,
}

impl FaultStore {
    /// Wraps `inner`; no faults until asked.
    pub fn new(inner: Arc<dyn ObjectStore>) -> FaultStore {
        let counters = Counters { crash_at: AtomicUsize::new(usize::MAX), ..Default::default() };
        FaultStore { inner, counters: Arc::new(counters) }
    }

    /// Writes so far.
    pub fn writes(&self) -> usize {
        self.counters.writes.load(Ordering::SeqCst)
    }

    /// Fail write number `n` (counting from 0 since creation) and every write after it.
    pub fn crash_at(&self, n: usize) {
        self.counters.crash_at.store(n, Ordering::SeqCst);
    }

    /// Fail the next `n` writes with a transient error.
    pub fn fail_next(&self, n: usize) {
        self.counters.transient.store(n, Ordering::SeqCst);
    }

    /// Multipart uploads aborted so far.
    pub fn aborts(&self) -> usize {
        self.counters.aborts.load(Ordering::SeqCst)
    }

    /// From now on, overwrite where a write asks to create only if absent, as a server that
    /// ignores `If-None-Match: *` does.
    pub fn ignore_conditions(&self) {
        self.counters.ignore_conditions.store(true, Ordering::SeqCst);
    }
}

impl fmt::Display for FaultStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FaultStore({})", self.inner)
    }
}

#[derive(Debug)]
struct FaultUpload {
    inner: Box<dyn MultipartUpload>,
    counters: Arc<Counters>,
}

#[async_trait]
impl MultipartUpload for FaultUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        match self.counters.write("multipart part") {
            Ok(()) => self.inner.put_part(data),
            Err(e) => Box::pin(async move { Err(e) }),
        }
    }

    async fn complete(&mut self) -> object_store::Result<PutResult> {
        self.counters.write("multipart complete")?;
        self.inner.complete().await
    }

    async fn abort(&mut self) -> object_store::Result<()> {
        self.counters.aborts.fetch_add(1, Ordering::SeqCst);
        self.inner.abort().await
    }
}

#[async_trait]
impl ObjectStore for FaultStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.counters.write(&format!("put {location}"))?;
        let mut opts = opts;
        if self.counters.ignore_conditions.load(Ordering::SeqCst) && opts.mode == PutMode::Create {
            opts.mode = PutMode::Overwrite;
        }
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.counters.write(&format!("multipart start {location}"))?;
        let inner = self.inner.put_multipart_opts(location, opts).await?;
        Ok(Box::new(FaultUpload { inner, counters: Arc::clone(&self.counters) }))
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> object_store::Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        let counters = Arc::clone(&self.counters);
        let allowed = locations.map(move |l| {
            let l = l?;
            counters.write(&format!("delete {l}"))?;
            Ok(l)
        });
        self.inner.delete_stream(allowed.boxed())
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> object_store::Result<()> {
        self.counters.write(&format!("copy {from} -> {to}"))?;
        self.inner.copy_opts(from, to, options).await
    }
}

/// The checkpoint data ids that hold objects under `root` on `raw`, listed directly (not through
/// the store, whose collection the tests check). A backend may keep empty "directories", so
/// ids come from the objects themselves.
pub async fn data_ids(raw: &dyn ObjectStore, root: &Path) -> std::collections::BTreeSet<String> {
    let prefix = root.clone().join(crate::protocol::DATA);
    let objects: Vec<ObjectMeta> =
        futures::TryStreamExt::try_collect(raw.list(Some(&prefix))).await.expect("listing the data prefix");
    objects
        .iter()
        .filter_map(|o| {
            let relative = o.location.as_ref().strip_prefix(prefix.as_ref())?.trim_start_matches('/');
            relative.split('/').next().map(String::from)
        })
        .collect()
}

/// A real S3-compatible server (SeaweedFS `weed mini`) on loopback for tests, with every port
/// it opens chosen free, telemetry off, and one bucket. Stopped and its data removed on drop.
///
/// The `weed` binary comes from `TRAINERD_WEED`, else the virtualenv scripts/setup.sh installs
/// (`$TRAINERD_CACHE/venv-s3/bin/weed`, default `~/.cache/trainerd/venv-s3/bin/weed`).
pub struct S3Server {
    child: std::process::Child,
    dir: std::path::PathBuf,
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    /// The bucket it created.
    pub bucket: String,
}

/// weed's output, in its data directory.
const WEED_LOG: &str = "weed.log";

/// Credentials the test server accepts.
pub const S3_KEY_ID: &str = "trainerd-test";
/// Secret for [`S3_KEY_ID`].
pub const S3_SECRET: &str = "trainerd-test-secret";

impl S3Server {
    /// The weed binary, or why there is none.
    pub fn binary() -> Result<std::path::PathBuf, String> {
        if let Some(p) = std::env::var_os("TRAINERD_WEED") {
            return Ok(p.into());
        }
        let cache = std::env::var_os("TRAINERD_CACHE").map(std::path::PathBuf::from).unwrap_or_else(|| {
            let base = std::env::var_os("XDG_CACHE_HOME").map(std::path::PathBuf::from).unwrap_or_else(|| {
                std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache")
            });
            base.join("trainerd")
        });
        let weed = cache.join("venv-s3/bin/weed");
        if weed.exists() {
            Ok(weed)
        } else {
            Err(format!("no SeaweedFS at {} (run scripts/setup.sh, or set TRAINERD_WEED)", weed.display()))
        }
    }

    /// Starts a server and waits until its S3 endpoint answers.
    pub fn start() -> Result<S3Server, String> {
        let weed = S3Server::binary()?;
        let dir = std::env::temp_dir().join(format!("trainerd-s3-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        // weed derives gRPC ports as port + 10000: pick ports whose +10000 twin is free too.
        let ports = free_port_pairs(9)?;
        let child = S3Server::spawn(&weed, &dir, &ports)?;
        let endpoint = format!("http://127.0.0.1:{}", ports[3]);
        let mut server = S3Server { child, dir, endpoint, bucket: "ckpt".into() };
        server.wait_ready()?;
        Ok(server)
    }

    fn spawn(weed: &std::path::Path, dir: &std::path::Path, ports: &[u16]) -> Result<std::process::Child, String> {
        let flags = [
            "master.port",
            "volume.port",
            "filer.port",
            "s3.port",
            "admin.port",
            "s3.port.iceberg",
            "s3.port.lance",
            "debug.port",
            "s3.debug.port",
        ];
        // Its output, for a failing test to show (`log_tail`).
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(WEED_LOG))
            .map_err(|e| format!("{}: {e}", dir.join(WEED_LOG).display()))?;
        let mut cmd = std::process::Command::new(weed);
        cmd.arg("mini")
            .arg(format!("-dir={}", dir.display()))
            .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-bucket=ckpt", "-admin.ui=false", "-webdav=false"])
            .arg("-master.telemetry=false")
            .env("AWS_ACCESS_KEY_ID", S3_KEY_ID)
            .env("AWS_SECRET_ACCESS_KEY", S3_SECRET)
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        for (flag, port) in flags.iter().zip(ports) {
            cmd.arg(format!("-{flag}={port}"));
        }
        spawn_tied_to_this_process(cmd).map_err(|e| format!("starting {}: {e}", weed.display()))
    }

    /// Waits until the S3 endpoint answers.
    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("weed mini exited at start: {status}"));
            }
            if self.bucket_ready() {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                return Err("weed mini did not answer within 60s".into());
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }

    /// The last `n` lines weed wrote, for a failing test's message.
    pub fn log_tail(&self, n: usize) -> String {
        let log = std::fs::read_to_string(self.dir.join(WEED_LOG)).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// True once the bucket answers a signed request.
    fn bucket_ready(&self) -> bool {
        let Ok(store) = self.store() else { return false };
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async {
            use futures::TryStreamExt;
            store.list(None).try_collect::<Vec<_>>().await.is_ok()
        })
    }

    /// A link to this server that a test can cut and restore (see [`TcpProxy`]).
    pub fn link(&self) -> std::io::Result<TcpProxy> {
        let addr = self.endpoint.trim_start_matches("http://").parse().map_err(std::io::Error::other)?;
        TcpProxy::start(addr)
    }

    /// An `object_store` client for the bucket.
    pub fn store(&self) -> object_store::Result<object_store::aws::AmazonS3> {
        self.client(&self.endpoint).build()
    }

    /// A client for the bucket reached through `endpoint` (a [`TcpProxy`] in front of this
    /// server) that tries each request once, as the daemon's does (its store retries instead).
    pub fn store_via(&self, endpoint: &str) -> object_store::Result<object_store::aws::AmazonS3> {
        self.client(endpoint).with_retry(object_store::RetryConfig { max_retries: 0, ..Default::default() }).build()
    }

    fn client(&self, endpoint: &str) -> object_store::aws::AmazonS3Builder {
        object_store::aws::AmazonS3Builder::new()
            .with_bucket_name(&self.bucket)
            .with_endpoint(endpoint)
            .with_region("us-east-1")
            .with_access_key_id(S3_KEY_ID)
            .with_secret_access_key(S3_SECRET)
            .with_virtual_hosted_style_request(false)
            .with_allow_http(true)
    }

    /// Environment for a process that should reach this server through the AWS variables.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", S3_KEY_ID.into()),
            ("AWS_SECRET_ACCESS_KEY", S3_SECRET.into()),
            ("AWS_REGION", "us-east-1".into()),
            ("AWS_ENDPOINT_URL", self.endpoint.clone()),
        ]
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while matches!(self.child.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Spawns `cmd` so that it is killed when this process ends, however it ends: a server in a
/// `static` is never dropped, and a test binary that aborts or is killed drops nothing.
///
/// The kernel's parent-death signal (`PR_SET_PDEATHSIG`) fires when the *thread* that forked
/// the child exits, and test threads come and go; so every child is forked by one spawner
/// thread that lives as long as the process.
fn spawn_tied_to_this_process(mut cmd: std::process::Command) -> std::io::Result<std::process::Child> {
    use std::os::unix::process::CommandExt;
    use std::sync::mpsc;
    type Request = (std::process::Command, mpsc::Sender<std::io::Result<std::process::Child>>);
    static SPAWNER: std::sync::OnceLock<std::sync::Mutex<mpsc::Sender<Request>>> = std::sync::OnceLock::new();
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: prctl and getppid are async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before the signal was armed.
            if libc::getppid() != parent {
                return Err(std::io::Error::other("the test process ended before its server started"));
            }
            Ok(())
        })
    };
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("test-server-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("a thread");
        std::sync::Mutex::new(tx)
    });
    let (reply, answer) = mpsc::channel();
    spawner.lock().expect("not poisoned").send((cmd, reply)).expect("the spawner lives as long as the process");
    answer.recv().expect("the spawner answers")
}

/// `n` ports below 55000, each free together with its +10000 twin.
///
/// Nothing holds them until weed binds them, so two servers starting at once must not scan the
/// same ports: the scan starts at a random place (another process, a test's child among them,
/// starts elsewhere) and goes on, in this process, from where the last one stopped.
fn free_port_pairs(n: usize) -> Result<Vec<u16>, String> {
    use std::net::TcpListener;
    static NEXT: std::sync::Mutex<Option<u16>> = std::sync::Mutex::new(None);
    let mut next = NEXT.lock().expect("not poisoned");
    let mut held = Vec::new();
    let mut ports = Vec::new();
    let mut candidate = next.unwrap_or_else(|| 20000 + (uuid::Uuid::new_v4().as_u128() % 25000) as u16);
    for _ in 0..25000 {
        if ports.len() == n {
            break;
        }
        candidate = if candidate >= 44999 { 20000 } else { candidate + 1 };
        if let (Ok(a), Ok(b)) =
            (TcpListener::bind(("127.0.0.1", candidate)), TcpListener::bind(("127.0.0.1", candidate + 10000)))
        {
            held.push((a, b));
            ports.push(candidate);
        }
    }
    *next = Some(candidate);
    if ports.len() < n {
        return Err("no free ports for weed".into());
    }
    Ok(ports)
}

/// A loopback TCP forwarder in front of a server, which a test cuts to make the server
/// unreachable without touching it (an outage of the network or of a load balancer's backend):
/// while cut, every open connection is shut down and every new one is closed at once; restored,
/// it forwards again. The server itself keeps running, so it answers at full speed the moment the
/// link comes back, and how long a real server takes to restart plays no part in a test.
pub struct TcpProxy {
    addr: std::net::SocketAddr,
    state: Arc<ProxyState>,
}

#[derive(Default)]
struct ProxyState {
    cut: std::sync::atomic::AtomicBool,
    closed: std::sync::atomic::AtomicBool,
    /// Both ends of every connection forwarded since the last cut, to shut down on the next.
    open: std::sync::Mutex<Vec<std::net::TcpStream>>,
}

impl ProxyState {
    /// Sets `cut` and shuts every open connection, under the lock new connections register by.
    fn cut_all(&self) {
        let mut open = self.open.lock().expect("not poisoned");
        self.cut.store(true, Ordering::SeqCst);
        for s in open.drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl TcpProxy {
    /// Forwards a new port on 127.0.0.1 to `target`.
    pub fn start(target: std::net::SocketAddr) -> std::io::Result<TcpProxy> {
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
        let addr = listener.local_addr()?;
        let state = Arc::new(ProxyState::default());
        let shared = Arc::clone(&state);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if shared.closed.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = std::net::TcpStream::connect(target) else {
                    let _ = client.shutdown(std::net::Shutdown::Both);
                    continue;
                };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let ends = [client.try_clone(), server.try_clone(), client.try_clone(), server.try_clone()];
                let [Ok(c1), Ok(s1), Ok(c2), Ok(s2)] = ends else { continue };
                {
                    // Under the lock `cut` takes: a connection is either shut by a cut or refused.
                    let mut open = shared.open.lock().expect("not poisoned");
                    if shared.cut.load(Ordering::SeqCst) {
                        let _ = (client.shutdown(std::net::Shutdown::Both), server.shutdown(std::net::Shutdown::Both));
                        continue;
                    }
                    open.extend([c2, s2]);
                }
                for (mut from, mut to) in [(client, server), (s1, c1)] {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Write);
                    });
                }
            }
        });
        Ok(TcpProxy { addr, state })
    }

    /// `http://127.0.0.1:PORT` of the forwarder.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Cuts the link: open connections are shut down, new ones closed at once.
    pub fn cut(&self) {
        self.state.cut_all();
    }

    /// Restores the link.
    pub fn restore(&self) {
        self.state.cut.store(false, Ordering::SeqCst);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.state.closed.store(true, Ordering::SeqCst);
        self.state.cut_all();
        // Wakes the accept loop so that it sees `closed`.
        let _ = std::net::TcpStream::connect(self.addr);
    }
}
