//! A real S3-compatible server for tests (SeaweedFS `weed mini`) on loopback, started and stopped
//! by the test, tied to the test process's life.

use crate::ports::free_port_pairs;
use crate::proxy::TcpProxy;

use std::time::Duration;

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

    /// Starts a server and waits until its S3 endpoint answers and takes a write.
    ///
    /// A start that fails (a port taken between choosing it and weed binding it, by something
    /// outside this process) is tried again on other ports, twice; the error names weed's last
    /// lines.
    pub fn start() -> Result<S3Server, String> {
        const TRIES: usize = 3;
        let weed = S3Server::binary()?;
        let mut failures = Vec::new();
        for _ in 0..TRIES {
            let dir = std::env::temp_dir().join(format!("trainerd-s3-{}", uuid::Uuid::new_v4()));
            std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
            // weed derives gRPC ports as port + 10000: pick ports whose +10000 twin is free too.
            let ports = free_port_pairs(9)?;
            let child = S3Server::spawn(&weed, &dir, &ports)?;
            let endpoint = format!("http://127.0.0.1:{}", ports[3]);
            let mut server = S3Server { child, dir, endpoint, bucket: "ckpt".into() };
            match server.wait_ready() {
                Ok(()) => return Ok(server),
                Err(e) => failures.push(format!("{e}; its last lines:\n{}", server.log_tail(8))),
            }
        }
        Err(format!("weed mini did not start in {TRIES} tries:\n{}", failures.join("\n")))
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
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
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
            std::thread::sleep(Duration::from_millis(200));
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

    /// True once the bucket answers a signed listing and takes (and deletes) a small object: the
    /// listing needs weed's filer, the write its volume server too.
    fn bucket_ready(&self) -> bool {
        // Each request tried once, briefly: a server that is not ready is asked again.
        let options = object_store::ClientOptions::new().with_allow_http(true).with_timeout(Duration::from_secs(5));
        let client = self.client(&self.endpoint).with_client_options(options);
        let no_retries = object_store::RetryConfig { max_retries: 0, ..Default::default() };
        let Ok(store) = client.with_retry(no_retries).build() else { return false };
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async {
            use futures::TryStreamExt;
            use object_store::{path::Path, ObjectStore, ObjectStoreExt};
            let probe = Path::from(".trainerd-test-server-ready");
            store.list(None).try_collect::<Vec<_>>().await.is_ok()
                && store.put(&probe, object_store::PutPayload::from_static(b"ready")).await.is_ok()
                && store.delete(&probe).await.is_ok()
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
        trainerd_storage::tls::install_crypto_provider();
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
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while matches!(self.child.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
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
