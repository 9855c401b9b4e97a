//! Gradients reduced on the GPU with NCCL, in trainerd's fixed order, abortable.
//!
//! **Which NCCL.** The one libtorch already loaded: `libtorch_cuda.so` needs `libnccl.so.2`, so
//! [`library`] opens that name with `RTLD_NOLOAD` (the copy in the process, never a second one),
//! and libtorch's CUDA runtime the same way. Below NCCL 2.26 it is refused: `ncclCommAbort` could
//! hang there (pytorch#149153), and abort is how a lost peer is survived.
//!
//! **The order of the sums.** NCCL's own all-reduce adds in an order that follows its topology,
//! channels and rank count, so its bits would change when a worker holds several slots (virtual
//! ranks) or the cluster runs short. trainerd uses NCCL to move bytes only (grouped
//! `ncclSend`/`ncclRecv`) and adds on the device itself, in the ring's order:
//! 1. all-to-all: chunk c of every slot's buffer goes to the worker holding slot c;
//! 2. that worker adds chunk c as the V-slot ring does (slot c, then c+1, ... c+V-1, mod V), with
//!    libtorch's element-wise float32 additions, which round as the host's do;
//! 3. all-gather: each reduced chunk goes to every worker.
//!
//! Each worker sends 2(V-1)/V of the buffer, as a ring all-reduce does, and the result is bit for
//! bit the host ring's ([`crate::collective::ring`]), whoever holds which slots. Two workers with
//! a slot each exchange their whole buffers in one group instead (the same bytes, one NCCL kernel
//! instead of two), and each adds a + b, the ring's one addition.
//!
//! **Transport settings.** `NCCL_P2P_NET_CHUNKSIZE` is 512 KiB unless set ([`crate::accel`]):
//! over the socket transport NCCL's 128 KiB default halved send/recv throughput. Ranks that may
//! share a GPU (`NCCL_HOSTID` set) first wait for their own backward pass and meet at a one-float
//! ring barrier, so that no NCCL kernel spins on the shared GPU while the peer still computes.
//!
//! **No thread stays blocked.** Communicators are non-blocking (`blocking = 0`): their creation
//! and every enqueue return at once and are completed by polling `ncclCommGetAsyncError`; a
//! collective's completion is a CUDA event polled with `cudaEventQuery`, never a synchronising
//! libtorch call behind a kernel that may hang. Between polls the generation's [`AbortSignal`]
//! and the collective timeout are checked; either aborts the communicator (`ncclCommAbort` makes
//! NCCL's kernels return) and the collective fails. A communicator belongs to one generation;
//! the next builds a new one, its creation overlapping the state transfer.
//!
//! [`AbortSignal`]: super::AbortSignal

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::ops::Range;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use libloading::os::unix::{Library, RTLD_NOW};
use tch::{Device, Kind, Tensor};

use super::ring::CollectiveError;
use super::slots::{assign, Slots};

/// The first NCCL whose `ncclCommAbort` cannot hang (pytorch#149153).
pub const MIN_VERSION: c_int = 22600;
/// Bytes of an `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;

type NcclComm = *mut c_void;
type CudaStream = *mut c_void;
type CudaEvent = *mut c_void;

const NCCL_SUCCESS: c_int = 0;
const NCCL_IN_PROGRESS: c_int = 7;
const NCCL_FLOAT32: c_int = 7;
const CUDA_SUCCESS: c_int = 0;
const CUDA_NOT_READY: c_int = 600;
const CUDA_EVENT_DISABLE_TIMING: c_uint = 2;
/// The legacy default stream: libtorch's current stream unless a caller changes it, so NCCL's
/// work is ordered with the kernels before and after it.
const DEFAULT_STREAM: CudaStream = std::ptr::null_mut();

#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [c_char; UNIQUE_ID_BYTES],
}

/// `ncclConfig_t` as NCCL 2.18 laid it out: NCCL reads `size` bytes and the fields its `version`
/// knows, and gives the newer fields their defaults.
#[repr(C)]
struct Config {
    size: usize,
    magic: c_uint,
    version: c_uint,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

const CONFIG_UNDEF_INT: c_int = c_int::MIN;

impl Config {
    fn non_blocking() -> Config {
        Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            version: 21800,
            blocking: 0,
            cga_cluster_size: CONFIG_UNDEF_INT,
            min_ctas: CONFIG_UNDEF_INT,
            max_ctas: CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: CONFIG_UNDEF_INT,
        }
    }
}

/// NCCL's and the CUDA runtime's entry points, from the copies libtorch loaded.
pub struct Nccl {
    version: c_int,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
    comm_init_rank_config: unsafe extern "C" fn(*mut NcclComm, c_int, UniqueId, c_int, *mut Config) -> c_int,
    comm_get_async_error: unsafe extern "C" fn(NcclComm, *mut c_int) -> c_int,
    comm_abort: unsafe extern "C" fn(NcclComm) -> c_int,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    get_last_error: unsafe extern "C" fn(NcclComm) -> *const c_char,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, NcclComm, CudaStream) -> c_int,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, NcclComm, CudaStream) -> c_int,
    group_start: unsafe extern "C" fn() -> c_int,
    group_end: unsafe extern "C" fn() -> c_int,
    cuda_set_device: unsafe extern "C" fn(c_int) -> c_int,
    cuda_event_create: unsafe extern "C" fn(*mut CudaEvent, c_uint) -> c_int,
    cuda_event_record: unsafe extern "C" fn(CudaEvent, CudaStream) -> c_int,
    cuda_event_query: unsafe extern "C" fn(CudaEvent) -> c_int,
    cuda_event_destroy: unsafe extern "C" fn(CudaEvent) -> c_int,
    cuda_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    _libraries: (Library, Library),
}

/// A library this process already loaded, by its soname.
fn already_loaded(names: &[&str]) -> Result<Library, String> {
    for name in names {
        // SAFETY: RTLD_NOLOAD only returns a handle to an object already in the process, whose
        // initialisers have run; nothing new is loaded.
        if let Ok(lib) = unsafe { Library::open(Some(name), RTLD_NOW | libc::RTLD_NOLOAD) } {
            return Ok(lib);
        }
    }
    Err(format!("{} is not loaded in this process", names.join(" or ")))
}

/// Copies the function pointer `name` out of `lib`.
///
/// # Safety
/// `T` must be the symbol's C signature.
unsafe fn function<T: Copy>(lib: &Library, name: &str) -> Result<T, String> {
    let symbol = format!("{name}\0");
    // SAFETY: per the contract, T is the symbol's type; the library outlives the pointer (both
    // are kept in the `Nccl` that holds it, for the life of the process).
    unsafe { lib.get::<T>(symbol.as_bytes()) }.map(|s| *s).map_err(|e| format!("{name}: {e}"))
}

/// `2.29.7` from NCCL's `22907`.
pub fn version_text(code: c_int) -> String {
    format!("{}.{}.{}", code / 10000, code % 10000 / 100, code % 100)
}

impl Nccl {
    fn open() -> Result<Nccl, String> {
        let nccl = already_loaded(&["libnccl.so.2"])
            .map_err(|e| format!("{e}: this libtorch has no NCCL, or its CUDA library was not loaded"))?;
        let cudart = already_loaded(&["libcudart.so.13", "libcudart.so.12"])?;
        // SAFETY: each signature below is the one nccl.h and cuda_runtime_api.h declare.
        unsafe {
            let get_version: unsafe extern "C" fn(*mut c_int) -> c_int = function(&nccl, "ncclGetVersion")?;
            let mut version = 0;
            if get_version(&mut version) != NCCL_SUCCESS {
                return Err("ncclGetVersion failed".into());
            }
            Ok(Nccl {
                version,
                get_unique_id: function(&nccl, "ncclGetUniqueId")?,
                comm_init_rank_config: function(&nccl, "ncclCommInitRankConfig")?,
                comm_get_async_error: function(&nccl, "ncclCommGetAsyncError")?,
                comm_abort: function(&nccl, "ncclCommAbort")?,
                get_error_string: function(&nccl, "ncclGetErrorString")?,
                get_last_error: function(&nccl, "ncclGetLastError")?,
                send: function(&nccl, "ncclSend")?,
                recv: function(&nccl, "ncclRecv")?,
                group_start: function(&nccl, "ncclGroupStart")?,
                group_end: function(&nccl, "ncclGroupEnd")?,
                cuda_set_device: function(&cudart, "cudaSetDevice")?,
                cuda_event_create: function(&cudart, "cudaEventCreateWithFlags")?,
                cuda_event_record: function(&cudart, "cudaEventRecord")?,
                cuda_event_query: function(&cudart, "cudaEventQuery")?,
                cuda_event_destroy: function(&cudart, "cudaEventDestroy")?,
                cuda_error_string: function(&cudart, "cudaGetErrorString")?,
                _libraries: (nccl, cudart),
            })
        }
    }

    /// The NCCL version, as its code (`22907`).
    pub fn version(&self) -> c_int {
        self.version
    }

    fn nccl_error(&self, code: c_int, comm: NcclComm) -> String {
        // SAFETY: ncclGetErrorString takes any code and returns a static string (or null).
        let what = text(unsafe { (self.get_error_string)(code) }).unwrap_or_else(|| format!("error {code}"));
        if comm.is_null() {
            return what;
        }
        // SAFETY: a communicator that is not yet aborted; its last error is a string it owns.
        match text(unsafe { (self.get_last_error)(comm) }) {
            Some(last) if !last.is_empty() => format!("{what} ({last})"),
            _ => what,
        }
    }

    fn cuda_error(&self, code: c_int) -> String {
        // SAFETY: cudaGetErrorString takes any code and returns a static string (or null).
        text(unsafe { (self.cuda_error_string)(code) }).unwrap_or_else(|| format!("CUDA error {code}"))
    }
}

/// A C string NCCL or CUDA returned, copied (`None` for null).
fn text(p: *const c_char) -> Option<String> {
    // SAFETY: non-null pointers here come from NCCL's and CUDA's error functions, which return
    // NUL-terminated strings that live at least until the next call on this thread.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

// SAFETY: plain function pointers and library handles, usable from any thread.
unsafe impl Send for Nccl {}
// SAFETY: as for Send: nothing in it is mutated after it is opened.
unsafe impl Sync for Nccl {}

/// The NCCL in this process, opened once; why not, if it cannot be used.
pub fn library() -> Result<&'static Nccl, String> {
    static NCCL: OnceLock<Result<Nccl, String>> = OnceLock::new();
    NCCL.get_or_init(|| {
        let nccl = Nccl::open()?;
        if nccl.version < MIN_VERSION {
            return Err(format!(
                "NCCL {} is older than {}: its ncclCommAbort can hang (pytorch#149153), and abort is how trainerd \
                 survives a lost peer",
                version_text(nccl.version),
                version_text(MIN_VERSION)
            ));
        }
        Ok(nccl)
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Why `--collective nccl` cannot run on `device` here, if it cannot.
pub fn usable_on(device: Device) -> Result<&'static Nccl, String> {
    let Device::Cuda(_) = device else {
        return Err(format!(
            "--collective nccl needs CUDA: NCCL moves CUDA tensors only, and this worker trains on {}",
            format!("{device:?}").to_lowercase()
        ));
    };
    library().map_err(|e| format!("--collective nccl: {e}"))
}

/// A fresh id for a communicator, made by one worker and sent to the others.
pub fn unique_id() -> Result<Vec<u8>, String> {
    let nccl = library()?;
    let mut id = UniqueId { internal: [0; UNIQUE_ID_BYTES] };
    // SAFETY: `id` is a valid ncclUniqueId to fill.
    let code = unsafe { (nccl.get_unique_id)(&mut id) };
    if code != NCCL_SUCCESS {
        return Err(format!("ncclGetUniqueId: {}", nccl.nccl_error(code, std::ptr::null_mut())));
    }
    Ok(id.internal.iter().map(|&b| b as u8).collect())
}

/// What a collective checks between polls: `Err` when its generation was aborted.
pub type AbortCheck<'a> = &'a dyn Fn() -> Result<(), CollectiveError>;

/// A non-blocking NCCL communicator of one generation: this worker's place among `world`.
pub struct Comm {
    nccl: &'static Nccl,
    comm: NcclComm,
    device: c_int,
    place: usize,
    world: usize,
    /// Whether its creation is known to have completed.
    ready: bool,
    /// When its creation began, and how long it took once known.
    started: Instant,
    created_in: Option<Duration>,
    /// Whether `created_in` was handed out ([`Comm::take_created_in`]).
    told: bool,
    event: CudaEvent,
}

// SAFETY: an NCCL communicator and a CUDA event may be used from any thread, one at a time; the
// `&mut self` methods ensure one at a time.
unsafe impl Send for Comm {}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm").field("place", &self.place).field("world", &self.world).finish()
    }
}

fn nccl_failure(op: &'static str, message: String) -> CollectiveError {
    CollectiveError::Nccl { op, message }
}

impl Comm {
    /// Starts creating this worker's communicator (place `place` of `world`, on CUDA device
    /// `device`) from the id every worker received; returns at once.
    pub fn start(id: &[u8], world: usize, place: usize, device: usize) -> Result<Comm, CollectiveError> {
        let nccl = library().map_err(|e| nccl_failure("creating the communicator", e))?;
        let id: [u8; UNIQUE_ID_BYTES] = id
            .try_into()
            .map_err(|_| nccl_failure("creating the communicator", format!("an id of {} bytes", id.len())))?;
        let id = UniqueId { internal: id.map(|b| b as c_char) };
        let device = device as c_int;
        let mut config = Config::non_blocking();
        let mut comm: NcclComm = std::ptr::null_mut();
        let mut event: CudaEvent = std::ptr::null_mut();
        // SAFETY: valid out-pointers and config; the id is the 128 bytes ncclGetUniqueId made.
        unsafe {
            let code = (nccl.cuda_set_device)(device);
            if code != CUDA_SUCCESS {
                return Err(nccl_failure(
                    "creating the communicator",
                    format!("cudaSetDevice({device}): {}", nccl.cuda_error(code)),
                ));
            }
            let code = (nccl.cuda_event_create)(&mut event, CUDA_EVENT_DISABLE_TIMING);
            if code != CUDA_SUCCESS {
                return Err(nccl_failure(
                    "creating the communicator",
                    format!("cudaEventCreate: {}", nccl.cuda_error(code)),
                ));
            }
            let code = (nccl.comm_init_rank_config)(&mut comm, world as c_int, id, place as c_int, &mut config);
            if code != NCCL_SUCCESS && code != NCCL_IN_PROGRESS {
                (nccl.cuda_event_destroy)(event);
                let message = format!("ncclCommInitRankConfig: {}", nccl.nccl_error(code, comm));
                if !comm.is_null() {
                    (nccl.comm_abort)(comm);
                }
                return Err(nccl_failure("creating the communicator", message));
            }
        }
        Ok(Comm {
            nccl,
            comm,
            device,
            place,
            world,
            ready: false,
            started: Instant::now(),
            created_in: None,
            told: false,
            event,
        })
    }

    /// How long the communicator took to create, once it is known to be ready.
    pub fn created_in(&self) -> Option<Duration> {
        self.created_in
    }

    /// [`Comm::created_in`], the first time it is known (`None` before, and after).
    pub fn take_created_in(&mut self) -> Option<Duration> {
        if self.told {
            return None;
        }
        self.told = self.created_in.is_some();
        self.created_in
    }

    /// Waits, polling, until NCCL has finished what it was doing in the background (the
    /// communicator's creation, or an enqueue that returned "in progress"); fails on NCCL's
    /// error, on `check`, or at `deadline` (aborting the communicator).
    fn settle(&mut self, op: &'static str, deadline: Instant, check: AbortCheck<'_>) -> Result<(), CollectiveError> {
        let mut spins = 0u32;
        loop {
            let mut state = NCCL_SUCCESS;
            // SAFETY: a live communicator and a valid out-pointer.
            let code = unsafe { (self.nccl.comm_get_async_error)(self.comm, &mut state) };
            let state = if code == NCCL_SUCCESS { state } else { code };
            match state {
                NCCL_SUCCESS => {
                    if !self.ready {
                        self.ready = true;
                        self.created_in = Some(self.started.elapsed());
                    }
                    return Ok(());
                }
                NCCL_IN_PROGRESS => {}
                e => {
                    let message = self.nccl.nccl_error(e, self.comm);
                    self.abort();
                    return Err(nccl_failure(op, message));
                }
            }
            self.poll_checks(op, deadline, check)?;
            pause(&mut spins);
        }
    }

    fn poll_checks(
        &mut self,
        op: &'static str,
        deadline: Instant,
        check: AbortCheck<'_>,
    ) -> Result<(), CollectiveError> {
        if let Err(e) = check() {
            self.abort();
            return Err(e);
        }
        if Instant::now() >= deadline {
            self.abort();
            let what = if self.ready { "did not complete" } else { "the communicator was not created" };
            return Err(nccl_failure(op, format!("{what} within the collective timeout; communicator aborted")));
        }
        Ok(())
    }

    /// Aborts the communicator: NCCL's kernels in flight return, nothing waits for a peer.
    fn abort(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: a live communicator, aborted once (then forgotten).
            unsafe { (self.nccl.comm_abort)(self.comm) };
            self.comm = std::ptr::null_mut();
        }
    }

    fn enqueue(
        &mut self,
        op: &'static str,
        code: c_int,
        deadline: Instant,
        check: AbortCheck<'_>,
    ) -> Result<(), CollectiveError> {
        match code {
            NCCL_SUCCESS => Ok(()),
            NCCL_IN_PROGRESS => self.settle(op, deadline, check),
            e => {
                let message = self.nccl.nccl_error(e, self.comm);
                self.abort();
                Err(nccl_failure(op, message))
            }
        }
    }

    /// One group of sends and receives: `(tensor, peer place, send?)`, in the order both sides
    /// list them.
    fn exchange(
        &mut self,
        op: &'static str,
        moves: &[(Tensor, usize, bool)],
        deadline: Instant,
        check: AbortCheck<'_>,
    ) -> Result<(), CollectiveError> {
        if moves.is_empty() {
            return Ok(());
        }
        if self.comm.is_null() {
            return Err(nccl_failure(op, "the communicator was aborted".into()));
        }
        // SAFETY: group calls bracket the sends and receives; each pointer is a contiguous float32
        // CUDA tensor of `numel` elements that `moves` keeps alive until the caller has seen the
        // collective's event complete.
        unsafe {
            let code = (self.nccl.group_start)();
            self.enqueue(op, code, deadline, check)?;
            for (t, peer, send) in moves {
                let (n, peer) = (t.numel(), *peer as c_int);
                let code = if *send {
                    (self.nccl.send)(t.data_ptr(), n, NCCL_FLOAT32, peer, self.comm, DEFAULT_STREAM)
                } else {
                    (self.nccl.recv)(t.data_ptr(), n, NCCL_FLOAT32, peer, self.comm, DEFAULT_STREAM)
                };
                if code != NCCL_SUCCESS && code != NCCL_IN_PROGRESS {
                    let message = self.nccl.nccl_error(code, self.comm);
                    (self.nccl.group_end)();
                    self.abort();
                    return Err(nccl_failure(op, message));
                }
            }
            let code = (self.nccl.group_end)();
            self.enqueue(op, code, deadline, check)
        }
    }

    /// Waits for everything queued on the stream so far by polling a CUDA event.
    fn complete(&mut self, op: &'static str, deadline: Instant, check: AbortCheck<'_>) -> Result<(), CollectiveError> {
        // SAFETY: our event, recorded on the default stream of the current device.
        let code = unsafe { (self.nccl.cuda_event_record)(self.event, DEFAULT_STREAM) };
        if code != CUDA_SUCCESS {
            return Err(nccl_failure(op, format!("cudaEventRecord: {}", self.nccl.cuda_error(code))));
        }
        let mut spins = 0u32;
        loop {
            // SAFETY: our recorded event.
            match unsafe { (self.nccl.cuda_event_query)(self.event) } {
                CUDA_SUCCESS => break,
                CUDA_NOT_READY => {}
                e => {
                    self.abort();
                    return Err(nccl_failure(op, format!("cudaEventQuery: {}", self.nccl.cuda_error(e))));
                }
            }
            // A peer that died can surface as NCCL's asynchronous error before any timeout.
            let mut state = NCCL_SUCCESS;
            let asked = !self.comm.is_null()
                // SAFETY: a live (not aborted) communicator and a valid out-pointer.
                && unsafe { (self.nccl.comm_get_async_error)(self.comm, &mut state) } == NCCL_SUCCESS;
            if asked && state != NCCL_SUCCESS && state != NCCL_IN_PROGRESS {
                let message = self.nccl.nccl_error(state, self.comm);
                self.abort();
                return Err(nccl_failure(op, message));
            }
            self.poll_checks(op, deadline, check)?;
            pause(&mut spins);
        }
        Ok(())
    }

    /// Waits, polling a CUDA event, until the device has done everything queued so far (this
    /// worker's backward pass).
    pub fn wait_for_device(&mut self, timeout: Duration, check: AbortCheck<'_>) -> Result<(), CollectiveError> {
        // SAFETY: sets this thread's device to the communicator's.
        unsafe { (self.nccl.cuda_set_device)(self.device) };
        self.complete("waiting for the backward pass", Instant::now() + timeout, check)
    }

    /// Sums `bufs` (one contiguous float32 CUDA buffer per slot this worker holds, in slot order,
    /// of equal lengths) over every slot of the run, in the V-slot ring's order; on return
    /// `bufs[0]` holds the sum on every worker, bit for bit the ring's (the others are scratch).
    /// `slots` says which slots this worker holds; every place holds the ranges
    /// [`assign`] gives for `world` workers.
    pub fn all_reduce_slots(
        &mut self,
        bufs: &[Tensor],
        slots: &Slots,
        timeout: Duration,
        check: AbortCheck<'_>,
    ) -> Result<(), CollectiveError> {
        const OP: &str = "all-reduce (NCCL)";
        let deadline = Instant::now() + timeout;
        // SAFETY: sets this thread's device to the communicator's.
        unsafe { (self.nccl.cuda_set_device)(self.device) };
        if !self.ready {
            self.settle("creating the communicator", deadline, check)?;
        }
        let (v, me) = (slots.count, self.place);
        let len = bufs[0].numel();
        if self.world == 2 && v == 2 {
            return self.exchange_and_add(&bufs[0], deadline, check);
        }
        let ranges: Vec<Range<usize>> = assign(v, &(0..self.world).collect::<Vec<_>>());
        debug_assert_eq!(ranges[me], slots.held);
        let holder = |s: usize| ranges.iter().position(|r| r.contains(&s)).expect("every slot is held");
        let a = slots.held.start;
        let chunk = |c: usize| chunk_of(c, v, len);
        let part = |t: &Tensor, r: &Range<usize>| t.narrow(0, r.start as i64, r.len() as i64);
        // 1. All-to-all: chunk c of each slot to the holder of slot c.
        let mut moves = Vec::new();
        let mut received = std::collections::HashMap::new();
        for c in 0..v {
            let r = chunk(c);
            for s in 0..v {
                let (owner, from) = (holder(c), holder(s));
                if owner == from || r.is_empty() {
                    continue;
                }
                if from == me {
                    moves.push((part(&bufs[s - a], &r), owner, true));
                } else if owner == me {
                    let t = Tensor::empty([r.len() as i64], (Kind::Float, bufs[0].device()));
                    received.insert((c, s), t.shallow_clone());
                    moves.push((t, from, false));
                }
            }
        }
        self.exchange(OP, &moves, deadline, check)?;
        // 2. Each chunk held here, added in the ring's order.
        let _no_grad = tch::no_grad_guard();
        let mut sums = Vec::new();
        for c in slots.held.clone() {
            let r = chunk(c);
            if r.is_empty() {
                continue;
            }
            let parts: Vec<Tensor> = (0..v)
                .map(|s| if holder(s) == me { part(&bufs[s - a], &r) } else { received[&(c, s)].shallow_clone() })
                .collect();
            sums.push((r, ring_order_sum(&parts, c)));
        }
        for (r, sum) in &sums {
            part(&bufs[0], r).copy_(sum);
        }
        // 3. All-gather: each reduced chunk from its holder to every other worker.
        let mut gather = Vec::new();
        for c in 0..v {
            let (r, owner) = (chunk(c), holder(c));
            if r.is_empty() {
                continue;
            }
            if owner == me {
                for p in (0..self.world).filter(|&p| p != me) {
                    gather.push((part(&bufs[0], &r), p, true));
                }
            } else {
                gather.push((part(&bufs[0], &r), owner, false));
            }
        }
        self.exchange(OP, &gather, deadline, check)?;
        self.complete(OP, deadline, check)?;
        drop((moves, received, sums, gather));
        Ok(())
    }
}

impl Comm {
    /// Two workers holding a slot each: the whole buffers cross in one group (each sends what it
    /// would send in the two phases together), and each adds the two, which for V = 2 is the
    /// ring's one addition per element (a + b, the same bits whichever side adds). One NCCL
    /// kernel per all-reduce instead of two: on a GPU shared by both ranks, each NCCL kernel
    /// waits on the GPU for its peer's.
    fn exchange_and_add(
        &mut self,
        mine: &Tensor,
        deadline: Instant,
        check: AbortCheck<'_>,
    ) -> Result<(), CollectiveError> {
        const OP: &str = "all-reduce (NCCL)";
        let other = 1 - self.place;
        let theirs = Tensor::empty([mine.numel() as i64], (Kind::Float, mine.device()));
        let moves = [(mine.shallow_clone(), other, true), (theirs.shallow_clone(), other, false)];
        self.exchange(OP, &moves, deadline, check)?;
        let _no_grad = tch::no_grad_guard();
        let mut sum = mine.shallow_clone();
        sum += &theirs;
        self.complete(OP, deadline, check)?;
        drop((moves, theirs));
        Ok(())
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // Abort rather than destroy: destroying waits for peers, which may be gone.
        self.abort();
        // SAFETY: our event, no longer recorded on anything we wait for.
        unsafe { (self.nccl.cuda_event_destroy)(self.event) };
    }
}

/// Spins briefly, then yields, then sleeps: completion is usually microseconds away.
fn pause(spins: &mut u32) {
    *spins += 1;
    if *spins < 1000 {
        std::hint::spin_loop();
    } else if *spins < 5000 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Chunk `c` (taken modulo `v`) of a buffer of `len` elements cut into `v` chunks: the ring's.
pub fn chunk_of(c: usize, v: usize, len: usize) -> Range<usize> {
    (c % v) * len / v..(c % v + 1) * len / v
}

/// The sum of `parts` (one tensor per slot, in slot order) for chunk `c`, in the V-slot ring's
/// order: slot c first, then c+1, ... c+V-1 (mod V).
pub fn ring_order_sum(parts: &[Tensor], c: usize) -> Tensor {
    let v = parts.len();
    let mut sum = &parts[c % v] + &parts[(c + 1) % v];
    for k in 2..v {
        sum += &parts[(c + k) % v];
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::{ReduceOp, Ring};

    /// The claim the NCCL path rests on, checked on the CPU: chunk by chunk, the ring order's
    /// sums of libtorch's float32 additions are bit for bit the host ring's, for any V.
    #[test]
    fn ring_order_sums_on_tensors_are_the_host_rings_bits() {
        for (v, len) in [(2, 1000), (3, 1001), (4, 7), (5, 4096), (8, 333)] {
            let slots: Vec<Vec<f32>> = (0..v)
                .map(|s| {
                    let t = Tensor::randn([len as i64], (Kind::Float, Device::Cpu)) * (10f64).powi(s as i32 % 4 - 2);
                    Vec::<f32>::try_from(t).unwrap()
                })
                .collect();
            // The host ring, one worker holding every slot (the V-slot ring's hops in memory).
            let mut ring = Ring::single();
            ring.set_slots(Slots { count: v, held: 0..v });
            let mut copies = slots.clone();
            let mut views: Vec<&mut [f32]> = copies.iter_mut().map(|b| b.as_mut_slice()).collect();
            ring.all_reduce_slots(&mut views, ReduceOp::Sum).unwrap();
            // Chunk by chunk, as the NCCL path's holder of each chunk adds it.
            let tensors: Vec<Tensor> = slots.iter().map(|b| Tensor::from_slice(b)).collect();
            let mut ours = Vec::with_capacity(len);
            for c in 0..v {
                let r = chunk_of(c, v, len);
                if r.is_empty() {
                    continue;
                }
                let parts: Vec<Tensor> = tensors.iter().map(|t| t.narrow(0, r.start as i64, r.len() as i64)).collect();
                ours.extend(Vec::<f32>::try_from(ring_order_sum(&parts, c)).unwrap());
            }
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&ours), bits(&copies[0]), "V = {v}, {len} elements");
        }
    }

    #[test]
    fn nccl_is_refused_on_the_cpu_naming_nccl_and_cuda() {
        let e = usable_on(Device::Cpu).err().unwrap();
        assert_eq!(e, "--collective nccl needs CUDA: NCCL moves CUDA tensors only, and this worker trains on cpu");
    }

    #[test]
    fn versions_read_as_nccl_writes_them() {
        assert_eq!(version_text(22907), "2.29.7");
        assert_eq!(version_text(MIN_VERSION), "2.26.0");
    }
}
