//! A backend wrapper that injects faults, as object_store's `ThrottledStore` wraps any store:
//! it "crashes" at the N-th write (that write and every later one fail, as if the process had
//! died there), or fails the next N writes with a transient error (a server that comes back).
//! The storage tests use it to stop a commit at every write point in turn; [`data_ids`] lists
//! what a location holds behind the store's back.

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
    let prefix = root.clone().join(trainerd_storage::protocol::DATA);
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
