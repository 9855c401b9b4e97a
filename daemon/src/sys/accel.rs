//! libtorch's accelerators: loading its CUDA library, what the build and the machine offer, the
//! device a worker trains on, and the switches that make CUDA results reproducible.
//!
//! **Loading CUDA.** Rust links with `--as-needed`, and the daemon calls nothing in
//! `libtorch_cuda.so` directly, so a plain link drops it and libtorch never registers CUDA.
//! Linking it unconditionally would cost every worker start ~0.2 s of CUDA library
//! initialisation, on CPU nodes too, and a restarted worker pays its start-up on the way back
//! into the run. So [`load_cuda`] opens `libtorch_cuda.so` from beside the libtorch this process
//! runs on, first thing in `main` (libtorch caches its CUDA hooks on first use), whenever the
//! machine has NVIDIA devices or a CUDA device is asked for. Plugins share the process, and so
//! its CUDA.
//!
//! **Determinism.** tch 0.26 exposes no setter for deterministic cuDNN or deterministic
//! algorithms; they are plain non-virtual members of `at::Context` that libtorch exports, looked up
//! by name here (and reported if a libtorch lacks them).

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;

use tch::Device;

/// What became of `libtorch_cuda.so`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CudaLibrary {
    /// Loaded from this path.
    Loaded(PathBuf),
    /// Not looked for: no NVIDIA device on this machine and none asked for.
    NotNeeded,
    /// This libtorch has no CUDA library (a CPU-only build).
    NotBuilt,
    /// It exists but could not be loaded.
    Failed(String),
}

fn dl_error() -> String {
    // SAFETY: dlerror returns a thread-local message or null.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: a NUL-terminated string owned by libc.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// A symbol of a library already loaded in this process.
fn symbol(name: &str) -> Option<*mut c_void> {
    let name = CString::new(name).ok()?;
    // SAFETY: dlsym with RTLD_DEFAULT searches every loaded object; `name` is NUL-terminated.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// The directory of the libtorch this process runs on.
pub(crate) fn libtorch_dir() -> Option<PathBuf> {
    let addr = symbol("_ZN2at13globalContextEv")?;
    // SAFETY: Dl_info is plain data (pointers and integers); all zeroes is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr fills `info` for an address inside a loaded object.
    if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is the NUL-terminated path of the object.
    let file = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned();
    PathBuf::from(file).parent().map(PathBuf::from)
}

/// Whether the machine has NVIDIA devices (the driver's device files).
pub(crate) fn nvidia_devices() -> bool {
    std::fs::read_dir("/dev").is_ok_and(|entries| {
        entries.flatten().any(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.strip_prefix("nvidia").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        })
    })
}

/// Loads `libtorch_cuda.so` when the machine has NVIDIA devices or `wanted` (a CUDA device was
/// asked for). Must run before anything asks libtorch about CUDA.
pub fn load_cuda(wanted: bool) -> CudaLibrary {
    if !wanted && !nvidia_devices() {
        return CudaLibrary::NotNeeded;
    }
    let Some(dir) = libtorch_dir() else { return CudaLibrary::Failed("cannot find libtorch's directory".into()) };
    let path = dir.join("libtorch_cuda.so");
    if !path.exists() {
        return CudaLibrary::NotBuilt;
    }
    if std::env::var_os("CUBLAS_WORKSPACE_CONFIG").is_none() {
        // cuBLAS is deterministic only with a fixed workspace; it reads this when it starts.
        // SAFETY: called first thing in main, before any thread of ours exists.
        unsafe { std::env::set_var("CUBLAS_WORKSPACE_CONFIG", ":4096:8") };
    }
    if std::env::var_os("NCCL_P2P_NET_CHUNKSIZE").is_none() {
        // `--collective nccl` moves bytes with NCCL's send/recv; over its socket transport the
        // default 128 KiB chunk halves their throughput (1.2 against 2.3 GB/s at 100 MiB, 2 ranks
        // on one H100 over loopback, 2026-11-25). NCCL reads it when its first communicator starts.
        // SAFETY: called first thing in main, before any thread of ours exists.
        unsafe { std::env::set_var("NCCL_P2P_NET_CHUNKSIZE", "524288") };
    }
    let c = CString::new(path.to_string_lossy().as_bytes()).expect("a path without NUL");
    // SAFETY: dlopen of libtorch's own CUDA library; it stays loaded for the life of the process.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        return CudaLibrary::Failed(format!("{}: {}", path.display(), dl_error()));
    }
    CudaLibrary::Loaded(path)
}

/// `13.0` from CUDA's `13000`, `9.19.0` from cuDNN's `91900`.
fn cuda_version(v: i64) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

fn cudnn_version(v: i64) -> String {
    format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
}

/// A GPU's name, asked of the CUDA runtime libtorch loaded.
fn gpu_name(index: i64) -> Option<String> {
    type GetProperties = unsafe extern "C" fn(*mut c_void, c_int) -> c_int;
    let f = symbol("cudaGetDeviceProperties").or_else(|| symbol("cudaGetDeviceProperties_v2"))?;
    // SAFETY: cudaGetDeviceProperties(cudaDeviceProp*, int); the struct starts with `char
    // name[256]` and is under 2 KiB in every CUDA release, so 8 KiB is room enough.
    let get: GetProperties = unsafe { std::mem::transmute::<*mut c_void, GetProperties>(f) };
    let mut prop = vec![0u8; 8192];
    // SAFETY: as above; `prop` outlives the call.
    if unsafe { get(prop.as_mut_ptr().cast(), index as c_int) } != 0 {
        return None;
    }
    // SAFETY: the name is NUL-terminated within its 256 bytes.
    Some(unsafe { CStr::from_ptr(prop.as_ptr() as *const c_char) }.to_string_lossy().into_owned())
}

/// What this libtorch and this machine offer.
#[derive(Clone, Debug)]
pub(crate) struct Facts {
    /// libtorch's version (from the build).
    pub(crate) libtorch: String,
    /// What became of its CUDA library.
    pub(crate) cuda_library: CudaLibrary,
    /// The CUDA runtime libtorch was built with, once its CUDA is loaded.
    pub(crate) cuda: Option<String>,
    /// cuDNN's version, once libtorch's CUDA is loaded.
    pub(crate) cudnn: Option<String>,
    /// The visible GPUs, by index: their names.
    pub(crate) gpus: Vec<String>,
}

/// Asks libtorch (after [`load_cuda`]).
pub(crate) fn facts(cuda_library: CudaLibrary) -> Facts {
    let loaded = matches!(cuda_library, CudaLibrary::Loaded(_));
    let cuda = (loaded && tch::utils::has_cudart()).then(|| cuda_version(tch::utils::version_cudart()));
    let cudnn = loaded.then(tch::utils::version_cudnn).filter(|&v| v > 0).map(cudnn_version);
    let gpus = (0..tch::Cuda::device_count()).map(|i| gpu_name(i).unwrap_or_else(|| "unnamed GPU".into())).collect();
    Facts { libtorch: trainerd_sdk::abi::LIBTORCH_VERSION.to_string(), cuda_library, cuda, cudnn, gpus }
}

impl Facts {
    /// `libtorch 2.13.0 (CUDA 13.0, cuDNN 9.19.0); GPUs: cuda:0 NVIDIA H100 80GB HBM3`.
    pub(crate) fn line(&self) -> String {
        let build = match (&self.cuda_library, &self.cuda) {
            (_, Some(cuda)) => {
                format!("CUDA {cuda}{}", self.cudnn.as_ref().map(|v| format!(", cuDNN {v}")).unwrap_or_default())
            }
            (CudaLibrary::NotNeeded, _) => "CUDA not loaded: no NVIDIA device".into(),
            (CudaLibrary::NotBuilt, _) => "CPU-only build".into(),
            (CudaLibrary::Failed(why), _) => format!("CUDA failed to load: {why}"),
            (CudaLibrary::Loaded(_), None) => "CUDA library loaded, no CUDA runtime".into(),
        };
        format!("libtorch {} ({build}); GPUs: {}", self.libtorch, self.gpu_list())
    }

    fn gpu_list(&self) -> String {
        if self.gpus.is_empty() {
            return "none visible".into();
        }
        self.gpus.iter().enumerate().map(|(i, n)| format!("cuda:{i} {n}")).collect::<Vec<_>>().join(", ")
    }

    /// The device `--device TEXT` names. `auto` is `cuda:(LOCAL_RANK mod GPUs)` when GPUs are
    /// visible (`local_rank`, as torchrun's LOCAL_RANK), else the CPU.
    pub(crate) fn device(&self, text: &str, local_rank: usize) -> Result<Device, DeviceError> {
        self.named(("--device", text), text, local_rank).ok_or_else(|| DeviceError::DeviceForm { text: text.into() })?
    }

    /// The device `item` names, for `flag` given `text`; `None` when `item` names none.
    fn named(
        &self,
        (flag, text): (&'static str, &str),
        item: &str,
        local_rank: usize,
    ) -> Option<Result<Device, DeviceError>> {
        let count = self.gpus.len();
        let cuda = |index: usize| {
            if index < count {
                return Ok(Device::Cuda(index));
            }
            Err(DeviceError::NoSuchGpu { flag, text: text.into(), index, facts: self.line() })
        };
        Some(match item {
            "auto" if count > 0 => Ok(Device::Cuda(local_rank % count)),
            "auto" | "cpu" => Ok(Device::Cpu),
            "cuda" => cuda(0),
            _ => match item.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => cuda(n),
                _ => return None,
            },
        })
    }

    /// The devices `--devices TEXT` names, one replica each: `all` (every visible GPU, or the
    /// CPU when none is visible, as MirroredStrategy does) or a comma-separated list of `cpu`,
    /// `cuda` and `cuda:N`. Every replica must be on one kind of device (a step's bits are the same
    /// on every device of one kind); a device may be named twice (two replicas on one GPU, to try
    /// the replica logic on a machine with one).
    pub(crate) fn devices(&self, text: &str) -> Result<Vec<Device>, DeviceError> {
        if text == "all" {
            let all: Vec<Device> = (0..self.gpus.len()).map(Device::Cuda).collect();
            return Ok(if all.is_empty() { vec![Device::Cpu] } else { all });
        }
        let mut devices = Vec::new();
        for item in text.split(',').map(str::trim) {
            match self.named(("--devices", text), item, 0) {
                Some(device) if item != "auto" => devices.push(device?),
                _ => return Err(DeviceError::DevicesForm { text: text.into() }),
            }
        }
        if devices.iter().any(|d| d.is_cuda() != devices[0].is_cuda()) {
            return Err(DeviceError::MixedKinds { text: text.into() });
        }
        Ok(devices)
    }

    /// `cuda:0 (NVIDIA H100 80GB HBM3)` or `cpu`.
    pub(crate) fn describe(&self, device: Device) -> String {
        match device {
            Device::Cuda(n) => format!("cuda:{n} ({})", self.gpus.get(n).map_or("?", String::as_str)),
            _ => "cpu".into(),
        }
    }
}

/// A device flag that names no device here.
#[derive(Debug, PartialEq, thiserror::Error)]
pub(crate) enum DeviceError {
    /// A GPU this machine does not have.
    #[error("{flag} {text}: there is no cuda:{index}; {facts}")]
    NoSuchGpu {
        /// `--device` or `--devices`.
        flag: &'static str,
        /// What it was given.
        text: String,
        /// The GPU named.
        index: usize,
        /// What this machine has ([`Facts::line`]).
        facts: String,
    },
    /// `--device` given something that is not a device.
    #[error("--device {text}: expected auto, cpu, cuda or cuda:N")]
    DeviceForm {
        /// What it was given.
        text: String,
    },
    /// `--devices` given something that is not a list of devices.
    #[error("--devices {text}: expected all, or a list of cpu, cuda or cuda:N such as cuda:0,cuda:1")]
    DevicesForm {
        /// What it was given.
        text: String,
    },
    /// Replicas on CPU and CUDA both.
    #[error(
        "--devices {text}: every replica must be on the same kind of device (all CUDA or all CPU), so that every \
         slot's step has the same bits"
    )]
    MixedKinds {
        /// What it was given.
        text: String,
    },
}

/// Makes libtorch's CUDA results reproducible: deterministic cuDNN, no cuDNN benchmarking, and
/// deterministic algorithms: `strict`, every operation's deterministic one, an operation without
/// one failing (libtorch's `warn_only` off: only then do flash and memory-efficient attention run
/// their deterministic backward passes); else an operation without one warns once and runs.
/// Returns what could not be set.
pub(crate) fn make_deterministic(strict: bool) -> Vec<&'static str> {
    type SetBool = unsafe extern "C" fn(*mut c_void, bool);
    type SetTwo = unsafe extern "C" fn(*mut c_void, bool, bool);
    type Global = unsafe extern "C" fn() -> *mut c_void;
    let mut missing = Vec::new();
    tch::Cuda::cudnn_set_benchmark(false);
    let Some(global) = symbol("_ZN2at13globalContextEv") else { return vec!["at::globalContext"] };
    // SAFETY: at::globalContext() takes nothing and returns the process's at::Context.
    let context = unsafe { std::mem::transmute::<*mut c_void, Global>(global)() };
    match symbol("_ZN2at7Context21setDeterministicCuDNNEb") {
        // SAFETY: at::Context::setDeterministicCuDNN(bool), a non-virtual member: `this` first.
        Some(f) => unsafe { std::mem::transmute::<*mut c_void, SetBool>(f)(context, true) },
        None => missing.push("deterministic cuDNN"),
    }
    match symbol("_ZN2at7Context26setDeterministicAlgorithmsEbb") {
        // SAFETY: at::Context::setDeterministicAlgorithms(bool enabled, bool warn_only).
        Some(f) => unsafe { std::mem::transmute::<*mut c_void, SetTwo>(f)(context, true, !strict) },
        None => missing.push("deterministic algorithms"),
    }
    missing
}

/// A boolean of libtorch's global context, read by its const getter's mangled name (what
/// [`make_deterministic`] set).
#[cfg(test)]
fn context_flag(getter: &str) -> Option<bool> {
    type GetBool = unsafe extern "C" fn(*const c_void) -> bool;
    type Global = unsafe extern "C" fn() -> *mut c_void;
    let global = symbol("_ZN2at13globalContextEv")?;
    let get = symbol(getter)?;
    // SAFETY: as in make_deterministic; the getter is a const member taking nothing.
    Some(unsafe {
        let context = std::mem::transmute::<*mut c_void, Global>(global)();
        std::mem::transmute::<*mut c_void, GetBool>(get)(context)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_read_as_their_projects_write_them() {
        assert_eq!(cuda_version(13000), "13.0");
        assert_eq!(cuda_version(12080), "12.8");
        assert_eq!(cudnn_version(91900), "9.19.0");
    }

    #[test]
    fn determinism_switches_are_found_and_take_effect() {
        assert!(libtorch_dir().is_some_and(|d| d.join("libtorch_cpu.so").exists()));
        let cudnn = || context_flag("_ZNK2at7Context18deterministicCuDNNEv");
        let algorithms = || context_flag("_ZNK2at7Context23deterministicAlgorithmsEv");
        let warn_only = || context_flag("_ZNK2at7Context31deterministicAlgorithmsWarnOnlyEv");
        // --allow-nondeterministic-ops: an operation without a deterministic algorithm warns.
        assert_eq!(make_deterministic(false), Vec::<&str>::new());
        assert_eq!((cudnn(), algorithms(), warn_only()), (Some(true), Some(true), Some(true)));
        // The default: every operation's deterministic algorithm, or the step fails.
        assert_eq!(make_deterministic(true), Vec::<&str>::new());
        assert_eq!((cudnn(), algorithms(), warn_only()), (Some(true), Some(true), Some(false)));
    }

    #[test]
    fn devices_are_refused_naming_what_is_visible() {
        let f = Facts {
            libtorch: "2.13.0".into(),
            cuda_library: CudaLibrary::Loaded("x".into()),
            cuda: Some("13.0".into()),
            cudnn: None,
            gpus: vec!["A".into(), "B".into()],
        };
        assert_eq!(f.device("auto", 3), Ok(Device::Cuda(1)));
        assert_eq!(f.device("cuda:1", 0), Ok(Device::Cuda(1)));
        assert_eq!(
            f.device("cuda:2", 0).unwrap_err().to_string(),
            "--device cuda:2: there is no cuda:2; libtorch 2.13.0 (CUDA 13.0); GPUs: cuda:0 A, cuda:1 B"
        );
        let none = Facts { gpus: vec![], ..f };
        assert_eq!(none.device("auto", 1), Ok(Device::Cpu));
        assert_eq!(
            none.device("cuda", 0).unwrap_err().to_string(),
            "--device cuda: there is no cuda:0; libtorch 2.13.0 (CUDA 13.0); GPUs: none visible"
        );
        assert_eq!(none.device("gpu", 0).unwrap_err().to_string(), "--device gpu: expected auto, cpu, cuda or cuda:N");
    }

    #[test]
    fn replica_devices_are_all_gpus_or_a_list_of_one_kind() {
        let two = Facts {
            libtorch: "2.13.0".into(),
            cuda_library: CudaLibrary::Loaded("x".into()),
            cuda: Some("13.0".into()),
            cudnn: None,
            gpus: vec!["A".into(), "B".into()],
        };
        assert_eq!(two.devices("all"), Ok(vec![Device::Cuda(0), Device::Cuda(1)]));
        assert_eq!(two.devices("cuda:1,cuda:0"), Ok(vec![Device::Cuda(1), Device::Cuda(0)]));
        assert_eq!(two.devices("cuda:0,cuda:0"), Ok(vec![Device::Cuda(0), Device::Cuda(0)]));
        assert_eq!(two.devices("cpu, cpu"), Ok(vec![Device::Cpu, Device::Cpu]));
        assert_eq!(
            two.devices("cpu,cuda:0").unwrap_err().to_string(),
            "--devices cpu,cuda:0: every replica must be on the same kind of device (all CUDA or all CPU), so that \
             every slot's step has the same bits"
        );
        assert_eq!(
            two.devices("cuda:0,cuda:2").unwrap_err().to_string(),
            "--devices cuda:0,cuda:2: there is no cuda:2; libtorch 2.13.0 (CUDA 13.0); GPUs: cuda:0 A, cuda:1 B"
        );
        assert_eq!(
            two.devices("cuda:0,").unwrap_err().to_string(),
            "--devices cuda:0,: expected all, or a list of cpu, cuda or cuda:N such as cuda:0,cuda:1"
        );
        let none = Facts { gpus: vec![], ..two };
        assert_eq!(none.devices("all"), Ok(vec![Device::Cpu]));
    }
}
