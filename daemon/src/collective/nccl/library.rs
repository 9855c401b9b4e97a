//! NCCL's and the CUDA runtime's entry points, taken from the copies libtorch already loaded
//! (`dlopen` with `RTLD_NOLOAD`: never a second copy), and NCCL's version.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

use libloading::os::unix::{Library, RTLD_NOW};
use tch::Device;

use crate::collective::BackendError;

/// The first NCCL whose `ncclCommAbort` cannot hang (pytorch#149153).
pub(crate) const MIN_VERSION: c_int = 22600;
/// Bytes of an `ncclUniqueId`.
pub(crate) const UNIQUE_ID_BYTES: usize = 128;

pub(super) type NcclComm = *mut c_void;
pub(super) type CudaStream = *mut c_void;
pub(super) type CudaEvent = *mut c_void;

pub(super) const NCCL_SUCCESS: c_int = 0;
pub(super) const NCCL_IN_PROGRESS: c_int = 7;
pub(super) const NCCL_FLOAT32: c_int = 7;
pub(super) const CUDA_SUCCESS: c_int = 0;
pub(super) const CUDA_NOT_READY: c_int = 600;
pub(super) const CUDA_EVENT_DISABLE_TIMING: c_uint = 2;
/// The legacy default stream: libtorch's current stream unless a caller changes it, so NCCL's
/// work is ordered with the kernels before and after it.
pub(super) const DEFAULT_STREAM: CudaStream = std::ptr::null_mut();

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct UniqueId {
    pub(super) internal: [c_char; UNIQUE_ID_BYTES],
}

/// `ncclConfig_t` as NCCL 2.18 laid it out: NCCL reads `size` bytes and the fields its `version`
/// knows, and gives the newer fields their defaults.
#[repr(C)]
pub(super) struct Config {
    size: usize,
    magic: c_uint,
    pub(super) version: c_uint,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

const CONFIG_UNDEF_INT: c_int = c_int::MIN;

impl Config {
    pub(super) fn non_blocking() -> Config {
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
    pub(super) version: c_int,
    pub(super) get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
    pub(super) comm_init_rank_config: unsafe extern "C" fn(*mut NcclComm, c_int, UniqueId, c_int, *mut Config) -> c_int,
    pub(super) comm_get_async_error: unsafe extern "C" fn(NcclComm, *mut c_int) -> c_int,
    pub(super) comm_abort: unsafe extern "C" fn(NcclComm) -> c_int,
    pub(super) get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    pub(super) get_last_error: unsafe extern "C" fn(NcclComm) -> *const c_char,
    pub(super) send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, NcclComm, CudaStream) -> c_int,
    pub(super) recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, NcclComm, CudaStream) -> c_int,
    pub(super) group_start: unsafe extern "C" fn() -> c_int,
    pub(super) group_end: unsafe extern "C" fn() -> c_int,
    pub(super) cuda_set_device: unsafe extern "C" fn(c_int) -> c_int,
    pub(super) cuda_event_create: unsafe extern "C" fn(*mut CudaEvent, c_uint) -> c_int,
    pub(super) cuda_event_record: unsafe extern "C" fn(CudaEvent, CudaStream) -> c_int,
    pub(super) cuda_event_query: unsafe extern "C" fn(CudaEvent) -> c_int,
    pub(super) cuda_event_destroy: unsafe extern "C" fn(CudaEvent) -> c_int,
    pub(super) cuda_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    _libraries: (Library, Library),
}

/// Why the NCCL in this process cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NcclError {
    /// libtorch brought no NCCL.
    #[error(
        "libnccl.so.2 is not loaded in this process: this libtorch has no NCCL, or its CUDA library was not loaded"
    )]
    NoNccl,
    /// A library NCCL needs beside it is not loaded.
    #[error("{} is not loaded in this process", names.join(" or "))]
    NotLoaded {
        /// Its sonames.
        names: &'static [&'static str],
    },
    /// An entry point is missing.
    #[error("{name}: {reason}")]
    Symbol {
        /// The symbol.
        name: &'static str,
        /// The dynamic loader's reason.
        reason: String,
    },
    /// NCCL does not say its version.
    #[error("ncclGetVersion failed")]
    Version,
    /// An NCCL whose abort can hang.
    #[error(
        "NCCL {} is older than {}: its ncclCommAbort can hang (pytorch#149153), and abort is how trainerd survives \
         a lost peer",
        version_text(*version),
        version_text(MIN_VERSION)
    )]
    TooOld {
        /// Its version code.
        version: c_int,
    },
    /// No communicator id could be made.
    #[error("ncclGetUniqueId: {0}")]
    UniqueId(String),
}

/// A library this process already loaded, by its soname.
fn already_loaded(names: &'static [&'static str]) -> Result<Library, NcclError> {
    for name in names {
        // SAFETY: RTLD_NOLOAD only returns a handle to an object already in the process, whose
        // initialisers have run; nothing new is loaded.
        if let Ok(lib) = unsafe { Library::open(Some(name), RTLD_NOW | libc::RTLD_NOLOAD) } {
            return Ok(lib);
        }
    }
    Err(NcclError::NotLoaded { names })
}

/// Copies the function pointer `name` out of `lib`.
///
/// # Safety
/// `T` must be the symbol's C signature.
unsafe fn function<T: Copy>(lib: &Library, name: &'static str) -> Result<T, NcclError> {
    let symbol = format!("{name}\0");
    // SAFETY: per the contract, T is the symbol's type; the library outlives the pointer (both
    // are kept in the `Nccl` that holds it, for the life of the process).
    unsafe { lib.get::<T>(symbol.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| NcclError::Symbol { name, reason: e.to_string() })
}

/// `2.29.7` from NCCL's `22907`.
pub(crate) fn version_text(code: c_int) -> String {
    format!("{}.{}.{}", code / 10000, code % 10000 / 100, code % 100)
}

impl Nccl {
    fn open() -> Result<Nccl, NcclError> {
        let nccl = already_loaded(&["libnccl.so.2"]).map_err(|_| NcclError::NoNccl)?;
        let cudart = already_loaded(&["libcudart.so.13", "libcudart.so.12"])?;
        // SAFETY: each signature below is the one nccl.h and cuda_runtime_api.h declare.
        unsafe {
            let get_version: unsafe extern "C" fn(*mut c_int) -> c_int = function(&nccl, "ncclGetVersion")?;
            let mut version = 0;
            if get_version(&mut version) != NCCL_SUCCESS {
                return Err(NcclError::Version);
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

    pub(super) fn nccl_error(&self, code: c_int, comm: NcclComm) -> String {
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

    pub(super) fn cuda_error(&self, code: c_int) -> String {
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
pub fn library() -> Result<&'static Nccl, NcclError> {
    static NCCL: OnceLock<Result<Nccl, NcclError>> = OnceLock::new();
    NCCL.get_or_init(|| {
        let nccl = Nccl::open()?;
        if nccl.version < MIN_VERSION {
            return Err(NcclError::TooOld { version: nccl.version });
        }
        Ok(nccl)
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Why `--collective nccl` cannot run on `device` here, if it cannot.
pub(crate) fn usable_on(device: Device) -> Result<&'static Nccl, BackendError> {
    let Device::Cuda(_) = device else {
        return Err(BackendError::NeedsCuda { device: format!("{device:?}").to_lowercase() });
    };
    Ok(library()?)
}

/// A fresh id for a communicator, made by one worker and sent to the others.
pub(crate) fn unique_id() -> Result<Vec<u8>, NcclError> {
    let nccl = library()?;
    let mut id = UniqueId { internal: [0; UNIQUE_ID_BYTES] };
    // SAFETY: `id` is a valid ncclUniqueId to fill.
    let code = unsafe { (nccl.get_unique_id)(&mut id) };
    if code != NCCL_SUCCESS {
        return Err(NcclError::UniqueId(nccl.nccl_error(code, std::ptr::null_mut())));
    }
    Ok(id.internal.iter().map(|&b| b as u8).collect())
}
